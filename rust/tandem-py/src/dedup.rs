//! `tandem._core.Dedup`: duplicate sending, first copy wins, over pyarrow record batches.
//!
//! A synchronous facade over [`tandem_core::dedup`]: `offer` runs the real lock-free claim
//! and queue, then takes the accepted element straight back out, so Python sees "the new
//! part of this batch" (a zero-copy slice of it) or `None`. The transport uses the core
//! channel directly, with the I/O threads as producers.

use arrow_array::RecordBatch;
use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3_arrow::{PyRecordBatch, PyRecordBatchReader};
use std::sync::Arc;
use tandem_core::dedup::{channel, DedupReceiver, DedupSender, Offer};
use tandem_core::sync::Doorbell;
use tandem_core::Item;

use crate::errors::{ConfigError, ProtocolError};

/// Read a non-negative integer argument, naming it in the error.
pub(crate) fn arg_u64(value: &Bound<'_, PyAny>, name: &str) -> PyResult<u64> {
    value.extract::<u64>().map_err(|_| {
        ConfigError::new_err(format!(
            "{name} must be an integer in 0..2**64, got {}",
            value
                .repr()
                .map(|r| r.to_string())
                .unwrap_or_else(|_| "<unprintable>".into())
        ))
    })
}

/// Read a channel index and check it against the number of channels.
pub(crate) fn arg_channel(value: &Bound<'_, PyAny>, channels: usize) -> PyResult<usize> {
    let c = arg_u64(value, "channel")?;
    if c >= channels as u64 {
        return Err(ConfigError::new_err(format!(
            "channel {c} does not exist: there are {channels} channels, numbered 0..{channels}"
        )));
    }
    Ok(c as usize)
}

/// Read a record batch (a `pyarrow.RecordBatch` or anything exporting `__arrow_c_array__`).
pub(crate) fn arg_batch(value: &Bound<'_, PyAny>) -> PyResult<RecordBatch> {
    value
        .extract::<PyRecordBatch>()
        .map(PyRecordBatch::into_inner)
        .map_err(|e| {
            let ty = value
                .get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_else(|_| "?".into());
            ConfigError::new_err(format!(
                "batch must be a pyarrow.RecordBatch (or export __arrow_c_array__ as a struct \
             array), got {ty}: {e}"
            ))
        })
}

/// Read many record batches: an Arrow stream (`__arrow_c_stream__`: a `pyarrow.Table`,
/// a `RecordBatchReader`) — one schema import for all — or a sequence of batches.
pub(crate) fn arg_batches(value: &Bound<'_, PyAny>) -> PyResult<Vec<RecordBatch>> {
    if value.hasattr("__arrow_c_stream__")? {
        let reader = value.extract::<PyRecordBatchReader>()?.into_reader()?;
        return reader.collect::<Result<Vec<_>, _>>().map_err(|e| {
            ConfigError::new_err(format!(
                "could not read the batches from the Arrow stream: {e}"
            ))
        });
    }
    let items = value.try_iter().map_err(|_| {
        ConfigError::new_err(
            "batches must be an Arrow stream (pyarrow.Table, RecordBatchReader) or a sequence \
             of pyarrow.RecordBatch",
        )
    })?;
    items.map(|b| arg_batch(&b?)).collect()
}

/// Read a count that must be at least 1.
pub(crate) fn arg_positive(value: &Bound<'_, PyAny>, name: &str) -> PyResult<usize> {
    let v = arg_u64(value, name)?;
    if v == 0 || v > usize::MAX as u64 {
        return Err(ConfigError::new_err(format!(
            "{name} must be at least 1, got {v}"
        )));
    }
    Ok(v as usize)
}

/// Queue capacity (elements per channel) when none is given.
const DEFAULT_CAPACITY: usize = 1024;

struct Lane {
    tx: DedupSender<RecordBatch>,
    rx: Mutex<DedupReceiver<RecordBatch>>,
}

/// Per-logical-channel deduplication of batches that arrive from several upstream
/// replicas. See the stub (`_core.pyi`) for the Python-facing documentation.
#[pyclass(frozen, module = "tandem._core")]
pub(crate) struct Dedup {
    lanes: Vec<Lane>,
}

/// What one offer did, before conversion to Python.
enum Outcome {
    Accepted(Item<RecordBatch>),
    Duplicate,
}

impl Dedup {
    /// Offer one element and return what of it was accepted. Holding the receiver, it pops
    /// up to its own element: anything before it was accepted (and counted) by a
    /// concurrent [`Dedup::offer_all`], whose elements are only counted, never returned.
    fn offer_item(&self, c: usize, mut item: Item<RecordBatch>) -> PyResult<Outcome> {
        let lane = &self.lanes[c];
        let end = item.first_seq().saturating_add(item.seq_len());
        let mut rx = lane.rx.lock();
        loop {
            match lane.tx.offer(item) {
                Offer::Accepted { .. } => loop {
                    match rx.pop() {
                        Some(accepted) if accepted.end_seq() == end => {
                            return Ok(Outcome::Accepted(accepted))
                        }
                        Some(_) => {}
                        // An earlier claim is being queued by another thread right now
                        // (claimers push at once, without waiting on anything).
                        None => std::thread::yield_now(),
                    }
                },
                Offer::Duplicate => return Ok(Outcome::Duplicate),
                Offer::Gap { expected, item } => {
                    return Err(gap_error(c, expected, item.first_seq()))
                }
                // Filled by concurrent offer_all calls: make room (we hold the receiver).
                Offer::Full(back) => {
                    while rx.pop().is_some() {}
                    item = back;
                }
            }
        }
    }

    /// Offer `items` without holding the receiver, so threads calling this concurrently
    /// race on the lock-free claim like the transport's I/O threads; whoever gets the
    /// receiver drains what was accepted (the rows are discarded, only counted).
    fn offer_all(&self, c: usize, items: Vec<Item<RecordBatch>>) -> PyResult<u64> {
        let lane = &self.lanes[c];
        let drain = |rx: &mut DedupReceiver<RecordBatch>| while rx.pop().is_some() {};
        let mut rows = 0u64;
        for mut item in items {
            loop {
                let len = item.seq_len();
                match lane.tx.offer(item) {
                    Offer::Accepted { trimmed_rows } => {
                        rows += len - trimmed_rows;
                        if let Some(mut rx) = lane.rx.try_lock() {
                            drain(&mut rx);
                        }
                        break;
                    }
                    Offer::Duplicate => break,
                    Offer::Full(back) => {
                        drain(&mut lane.rx.lock());
                        item = back;
                    }
                    Offer::Gap { expected, item } => {
                        return Err(gap_error(c, expected, item.first_seq()));
                    }
                }
            }
        }
        drain(&mut lane.rx.lock());
        Ok(rows)
    }
}

#[pymethods]
impl Dedup {
    #[new]
    #[pyo3(signature = (channels, capacity = None))]
    fn new(channels: &Bound<'_, PyAny>, capacity: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let channels = arg_positive(channels, "channels")?;
        let capacity = match capacity {
            Some(c) => arg_positive(c, "capacity")?,
            None => DEFAULT_CAPACITY,
        };
        let bell = Arc::new(Doorbell::new());
        let lanes = (0..channels)
            .map(|_| {
                let (tx, rx) = channel(capacity, Arc::clone(&bell));
                Lane {
                    tx,
                    rx: Mutex::new(rx),
                }
            })
            .collect();
        Ok(Self { lanes })
    }

    /// Number of logical channels.
    #[getter]
    fn channels(&self) -> usize {
        self.lanes.len()
    }

    /// First sequence number of `channel` not yet accepted.
    fn next_seq(&self, channel: &Bound<'_, PyAny>) -> PyResult<u64> {
        let c = arg_channel(channel, self.lanes.len())?;
        Ok(self.lanes[c].tx.next_seq())
    }

    /// Offer rows `[first_seq, first_seq + batch.num_rows)` of `channel`. Returns the rows
    /// not seen before (a zero-copy slice of `batch`), or None if all were duplicates.
    fn offer<'py>(
        &self,
        py: Python<'py>,
        channel: &Bound<'py, PyAny>,
        first_seq: &Bound<'py, PyAny>,
        batch: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let c = arg_channel(channel, self.lanes.len())?;
        let first_seq = arg_u64(first_seq, "first_seq")?;
        let payload = arg_batch(batch)?;
        check_range(first_seq, payload.num_rows())?;
        match self.offer_item(c, Item::Data { first_seq, payload })? {
            Outcome::Accepted(Item::Data { payload, .. }) => {
                Ok(Some(PyRecordBatch::new(payload).into_pyarrow(py)?))
            }
            Outcome::Accepted(_) | Outcome::Duplicate => Ok(None),
        }
    }

    /// Offer the heartbeat of cycle `epoch` at seq `seq`. True if this copy was the first.
    fn offer_heartbeat(
        &self,
        channel: &Bound<'_, PyAny>,
        seq: &Bound<'_, PyAny>,
        epoch: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let c = arg_channel(channel, self.lanes.len())?;
        let seq = arg_u64(seq, "seq")?;
        let epoch = arg_u64(epoch, "epoch")?;
        check_range(seq, 1)?;
        Ok(matches!(
            self.offer_item(c, Item::Heartbeat { seq, epoch })?,
            Outcome::Accepted(_)
        ))
    }

    /// Offer the end marker at seq `seq`. True if this copy was the first.
    fn offer_end(&self, channel: &Bound<'_, PyAny>, seq: &Bound<'_, PyAny>) -> PyResult<bool> {
        let c = arg_channel(channel, self.lanes.len())?;
        let seq = arg_u64(seq, "seq")?;
        check_range(seq, 1)?;
        Ok(matches!(
            self.offer_item(c, Item::End { seq })?,
            Outcome::Accepted(_)
        ))
    }

    /// Offer many batches of one channel in one call, with the GIL released while
    /// offering; returns how many rows were new. `batches` is an Arrow stream (a
    /// `pyarrow.Table` keeps its chunks as the batches, or a `RecordBatchReader`) or a
    /// sequence of record batches; `first_seqs[i]` is the first seq of batch `i`. The new
    /// rows themselves are not returned (no per-batch export): for benchmarks and for
    /// counting a replay's new rows.
    fn offer_many(
        &self,
        py: Python<'_>,
        channel: &Bound<'_, PyAny>,
        first_seqs: &Bound<'_, PyAny>,
        batches: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        let c = arg_channel(channel, self.lanes.len())?;
        let payloads = arg_batches(batches)?;
        let seqs: Vec<Bound<'_, PyAny>> = first_seqs
            .try_iter()
            .and_then(|it| it.collect::<PyResult<Vec<_>>>())
            .map_err(|_| ConfigError::new_err("first_seqs must be a sequence of integers"))?;
        if seqs.len() != payloads.len() {
            return Err(ConfigError::new_err(format!(
                "first_seqs has {} entries but there are {} batches: give one first seq per batch",
                seqs.len(),
                payloads.len()
            )));
        }
        let mut items = Vec::with_capacity(payloads.len());
        for (seq, payload) in seqs.iter().zip(payloads) {
            let first_seq = arg_u64(seq, "first_seq")?;
            check_range(first_seq, payload.num_rows())?;
            items.push(Item::Data { first_seq, payload });
        }
        py.detach(|| self.offer_all(c, items))
    }

    fn __repr__(&self) -> String {
        let next: Vec<String> = self
            .lanes
            .iter()
            .map(|l| l.tx.next_seq().to_string())
            .collect();
        format!(
            "Dedup(channels={}, next_seq=[{}])",
            self.lanes.len(),
            next.join(", ")
        )
    }
}

fn gap_error(c: usize, expected: u64, first_seq: u64) -> PyErr {
    ProtocolError::new_err(format!(
        "gap on channel {c}: the element starts at seq {first_seq} but seq {expected} has not \
         arrived yet; offer the missing seqs first (or hold this one and offer it again once \
         next_seq({c}) has reached {first_seq})"
    ))
}

/// Reject an element whose seq range would run past u64::MAX.
pub(crate) fn check_range(first_seq: u64, len: usize) -> PyResult<()> {
    if first_seq.checked_add(len as u64).is_none() {
        return Err(ConfigError::new_err(format!(
            "seqs [{first_seq}, {first_seq} + {len}) run past 2**64 - 1"
        )));
    }
    Ok(())
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Dedup>()
}
