//! The wire codec seen from Python: encode and decode single frames. Meant for tests,
//! tooling and the KaZoo order log (orders travel through Kafka as encoded frames); the data
//! path itself never leaves Rust.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};
use pyo3_arrow::PyRecordBatch;
use tandem_core::error::{Error, ProtocolError};
use tandem_core::wire::{self, Frame, OrderEntry};

use crate::errors::{to_py, IntoPyResult};

/// Most entries one Order frame can hold (its body length is a `u32`).
const MAX_ORDER_ENTRIES: usize = (u32::MAX as usize - 16) / 12;

fn protocol(err: ProtocolError) -> PyErr {
    to_py(Error::Protocol(err))
}

/// Encode a Data frame carrying `batch` as rows `[first_seq, first_seq + num_rows)` of
/// `channel`. Raises `tandem.ProtocolError` for an empty batch or a seq overflow.
#[pyfunction]
fn encode_data_frame<'py>(
    py: Python<'py>,
    channel: u32,
    first_seq: u64,
    batch: PyRecordBatch,
) -> PyResult<Bound<'py, PyBytes>> {
    let batch = batch.into_inner();
    let bytes = py
        .detach(|| wire::encode_data(channel, first_seq, &batch))
        .py()?;
    Ok(PyBytes::new(py, &bytes))
}

/// Encode the heartbeat of cycle `epoch` at seq `seq` of `channel`, carrying `digest` (the
/// 16-byte cycle digest of the channel's data since its previous heartbeat) if given.
/// Raises `tandem.ConfigError` for a digest of another length.
#[pyfunction]
#[pyo3(signature = (channel, seq, epoch, digest = None))]
fn encode_heartbeat_frame<'py>(
    py: Python<'py>,
    channel: u32,
    seq: u64,
    epoch: u64,
    digest: Option<&[u8]>,
) -> PyResult<Bound<'py, PyBytes>> {
    let frame = match digest {
        None => wire::encode_heartbeat(channel, seq, epoch),
        Some(d) => {
            let d: &[u8; wire::HEARTBEAT_DIGEST_LEN] = d.try_into().map_err(|_| {
                to_py(Error::Config(format!(
                    "a heartbeat digest is exactly {} bytes, got {}; pass the bytes of a cycle \
                     digest or None",
                    wire::HEARTBEAT_DIGEST_LEN,
                    d.len()
                )))
            })?;
            wire::encode_heartbeat_digest(channel, seq, epoch, d)
        }
    };
    Ok(PyBytes::new(py, &frame))
}

/// Encode the end marker of `channel` at seq `seq`.
#[pyfunction]
fn encode_end_frame(py: Python<'_>, channel: u32, seq: u64) -> Bound<'_, PyBytes> {
    PyBytes::new(py, &wire::encode_end(channel, seq))
}

/// Encode a KaZoo order published by the leader of `epoch`: `entries` is a list of
/// `(channel, up_to_seq)` pairs, each meaning "consume that channel up to (excluding) seq".
#[pyfunction]
fn encode_order_frame<'py>(
    py: Python<'py>,
    channel: u32,
    epoch: u64,
    version: u64,
    entries: Vec<(u32, u64)>,
) -> PyResult<Bound<'py, PyBytes>> {
    if entries.len() > MAX_ORDER_ENTRIES {
        return Err(to_py(Error::Config(format!(
            "an order of {} entries does not fit one frame (at most {MAX_ORDER_ENTRIES}); \
             publish it in smaller batches (kazoo.batch)",
            entries.len()
        ))));
    }
    let entries: Vec<OrderEntry> = entries
        .into_iter()
        .map(|(channel, up_to_seq)| OrderEntry { channel, up_to_seq })
        .collect();
    Ok(PyBytes::new(
        py,
        &wire::encode_order(channel, epoch, version, &entries),
    ))
}

/// Decode exactly one frame. Returns `("data", channel, first_seq, pyarrow.RecordBatch)`,
/// `("heartbeat", channel, seq, epoch, digest)` (`digest`: 16 bytes, or None if the frame
/// carries none), `("end", channel, seq)` or
/// `("order", channel, epoch, version, [(channel, up_to_seq), ...])`. Raises
/// `tandem.ProtocolError` naming the problem for anything else, including bytes left over
/// after the frame.
#[pyfunction]
#[pyo3(signature = (data, max_frame_bytes = wire::DEFAULT_MAX_FRAME_BYTES))]
fn decode_frame<'py>(
    py: Python<'py>,
    data: &[u8],
    max_frame_bytes: u64,
) -> PyResult<Bound<'py, PyTuple>> {
    let (frame, used) = py
        .detach(|| wire::decode_frame(data, max_frame_bytes))
        .map_err(protocol)?;
    if used != data.len() {
        return Err(protocol(ProtocolError::Inconsistent(format!(
            "{} bytes follow the {used}-byte frame; decode_frame takes exactly one frame",
            data.len() - used
        ))));
    }
    match frame {
        Frame::Data {
            channel,
            first_seq,
            batch,
        } => {
            let batch = PyRecordBatch::new(batch).into_pyarrow(py)?;
            PyTuple::new(
                py,
                [
                    "data".into_pyobject(py)?.into_any(),
                    channel.into_pyobject(py)?.into_any(),
                    first_seq.into_pyobject(py)?.into_any(),
                    batch,
                ],
            )
        }
        Frame::Heartbeat {
            channel,
            seq,
            epoch,
            digest,
        } => {
            let digest = digest.map(|d| PyBytes::new(py, &d));
            ("heartbeat", channel, seq, epoch, digest).into_pyobject(py)
        }
        Frame::End { channel, seq } => ("end", channel, seq).into_pyobject(py),
        Frame::Order {
            channel,
            epoch,
            version,
            entries,
        } => {
            let entries = PyList::new(py, entries.iter().map(|e| (e.channel, e.up_to_seq)))?;
            ("order", channel, epoch, version, entries).into_pyobject(py)
        }
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("HEADER_LEN", wire::HEADER_LEN)?;
    m.add("DEFAULT_MAX_FRAME_BYTES", wire::DEFAULT_MAX_FRAME_BYTES)?;
    m.add("WIRE_VERSION", wire::VERSION)?;
    m.add_function(wrap_pyfunction!(encode_data_frame, m)?)?;
    m.add_function(wrap_pyfunction!(encode_heartbeat_frame, m)?)?;
    m.add_function(wrap_pyfunction!(encode_end_frame, m)?)?;
    m.add_function(wrap_pyfunction!(encode_order_frame, m)?)?;
    m.add_function(wrap_pyfunction!(decode_frame, m)?)?;
    Ok(())
}
