//! Record batches across the boundary on the hot path: the Arrow C data interface for the
//! rows, the schema converted once per distinct schema.
//!
//! pyo3-arrow's PyCapsule protocol exports and re-imports the schema with every batch —
//! for a batch of a few dozen rows that is most of the cost of crossing (field names,
//! format strings, metadata, one allocation each). A worker hands Python batches of a
//! handful of schemas, and an outbox receives batches of one, so both sides keep the
//! converted schema and move only the `ArrowArray` struct of each batch (zero-copy, as
//! before). Anything unexpected (not a `pyarrow.RecordBatch`, a schema not seen before)
//! takes the PyCapsule path.

use std::sync::Arc;

use arrow_array::ffi::{from_ffi_and_data_type, FFI_ArrowArray};
use arrow_array::{Array, RecordBatch, RecordBatchOptions, StructArray};
use arrow_schema::{DataType, SchemaRef};
use parking_lot::Mutex;
use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3_arrow::{PyRecordBatch, PySchema};

/// Distinct schemas a cache keeps (a worker sees one per input channel and task, at most).
const CAPACITY: usize = 64;

/// `pyarrow.RecordBatch`, imported once.
fn record_batch_type(py: Python<'_>) -> PyResult<&Bound<'_, PyAny>> {
    static TYPE: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    TYPE.import(py, "pyarrow", "RecordBatch")
}

/// Rust schemas and their pyarrow twins, most recently added last.
#[derive(Default)]
pub(crate) struct SchemaCache {
    entries: Mutex<Vec<(SchemaRef, Py<PyAny>)>>,
}

impl SchemaCache {
    /// The pyarrow schema of `schema`, converted on first sight. A batch decoded off the
    /// wire shares its connection's schema (a pointer compare); one passed in memory
    /// carries its own copy (a field-by-field compare, still far cheaper than converting).
    fn py_schema(&self, py: Python<'_>, schema: &SchemaRef) -> PyResult<Py<PyAny>> {
        {
            let entries = self.entries.lock();
            if let Some((_, s)) = entries.iter().rev().find(|(k, _)| Arc::ptr_eq(k, schema)) {
                return Ok(s.clone_ref(py));
            }
            if let Some((_, s)) = entries.iter().rev().find(|(k, _)| **k == **schema) {
                return Ok(s.clone_ref(py));
            }
        }
        let converted = PySchema::new(Arc::clone(schema)).into_pyarrow(py)?;
        self.remember(Arc::clone(schema), &converted);
        Ok(converted.unbind())
    }

    /// The Rust schema of pyarrow schema `schema`, if cached (compared with metadata).
    /// Entries are compared newest first, each taken out under the lock alone: Python's
    /// `equals` runs without it.
    fn lookup_py(&self, py: Python<'_>, schema: &Bound<'_, PyAny>) -> PyResult<Option<SchemaRef>> {
        let mut i = self.entries.lock().len();
        while i > 0 {
            i -= 1;
            let Some((k, s)) = self
                .entries
                .lock()
                .get(i)
                .map(|(k, s)| (Arc::clone(k), s.clone_ref(py)))
            else {
                continue; // the cache shrank meanwhile
            };
            if schema.is(&s)
                || schema
                    .call_method1(intern!(py, "equals"), (s.bind(py), true))?
                    .is_truthy()?
            {
                return Ok(Some(k));
            }
        }
        Ok(None)
    }

    /// Keep the pair, dropping the oldest beyond [`CAPACITY`].
    fn remember(&self, schema: SchemaRef, py_schema: &Bound<'_, PyAny>) {
        let mut entries = self.entries.lock();
        if entries.len() == CAPACITY {
            entries.remove(0);
        }
        entries.push((schema, py_schema.clone().unbind()));
    }

    /// `batch` as a `pyarrow.RecordBatch`, sharing its buffers.
    pub(crate) fn export<'py>(
        &self,
        py: Python<'py>,
        batch: RecordBatch,
    ) -> PyResult<Bound<'py, PyAny>> {
        if batch.num_columns() == 0 {
            return PyRecordBatch::new(batch).into_pyarrow(py);
        }
        let schema = self.py_schema(py, &batch.schema())?;
        let data = StructArray::from(batch).into_data();
        let mut array = Box::new(FFI_ArrowArray::new(&data));
        let ptr = std::ptr::addr_of_mut!(*array) as usize;
        // pyarrow moves the struct out (its `release` becomes null); if the call fails
        // before that, dropping the box releases the buffers.
        record_batch_type(py)?.call_method1(intern!(py, "_import_from_c"), (ptr, schema))
    }

    /// The rows of `obj` (a `pyarrow.RecordBatch`, or anything with `__arrow_c_array__`),
    /// sharing its buffers.
    pub(crate) fn import(&self, py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<RecordBatch> {
        if !obj.is_exact_instance(record_batch_type(py)?) {
            return Ok(obj.extract::<PyRecordBatch>()?.into_inner());
        }
        let py_schema = obj.getattr(intern!(py, "schema"))?;
        let Some(schema) = self.lookup_py(py, &py_schema)? else {
            let batch = obj.extract::<PyRecordBatch>()?.into_inner();
            self.remember(batch.schema(), &py_schema);
            return Ok(batch);
        };
        if schema.fields().is_empty() {
            return Ok(obj.extract::<PyRecordBatch>()?.into_inner());
        }
        let mut array = FFI_ArrowArray::empty();
        let ptr = std::ptr::addr_of_mut!(array) as usize;
        obj.call_method1(intern!(py, "_export_to_c"), (ptr,))?;
        // SAFETY: pyarrow just exported a struct array of exactly `schema`'s fields into
        // `array` (checked equal above), which we now own.
        let data =
            unsafe { from_ffi_and_data_type(array, DataType::Struct(schema.fields().clone())) }
                .map_err(|e| PyValueError::new_err(format!("importing a record batch: {e}")))?;
        let rows = data.len();
        let columns = StructArray::from(data).into_parts().1;
        RecordBatch::try_new_with_options(
            schema,
            columns,
            &RecordBatchOptions::new().with_row_count(Some(rows)),
        )
        .map_err(|e| PyValueError::new_err(format!("importing a record batch: {e}")))
    }
}
