//! `tandem._core.OrderLog`: the KaZoo order log as a replica follows it
//! ([`tandem_core::orderlog`]), for replaying a run's order log outside a replica (the
//! reference executor follows the same orders the replicas did).

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use tandem_core::orderlog::{split_message, OrderLog as CoreOrderLog, OrderLogStats, Verdict};

use crate::errors::IntoPyResult;

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(order_frames, m)?)?;
    m.add_class::<OrderLog>()
}

/// The Order frames of one order log message, as `(slot, frame bytes)`: a worker
/// publishes the orders of every partition it leads that are due at once in one message,
/// each frame's header channel naming the partition's slot in the run. Raises
/// `ProtocolError` unless the message is a non-empty sequence of whole Order frames.
#[pyfunction]
fn order_frames<'py>(py: Python<'py>, message: &[u8]) -> PyResult<Vec<(u32, Bound<'py, PyBytes>)>> {
    let parts = split_message(message).py()?;
    Ok(parts
        .into_iter()
        .map(|p| (p.slot, PyBytes::new(py, &message[p.bytes])))
        .collect())
}

pub(crate) fn verdict_str(v: Verdict) -> &'static str {
    match v {
        Verdict::Followed => "followed",
        Verdict::Stale { .. } => "stale",
        Verdict::Replayed { .. } => "replayed",
    }
}

pub(crate) fn stats_dict(py: Python<'_>, s: OrderLogStats) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("followed", s.followed)?;
    d.set_item("stale", s.stale)?;
    d.set_item("replayed", s.replayed)?;
    d.set_item("entries", s.entries)?;
    d.set_item("epoch", s.epoch)?;
    d.set_item("version", s.version)?;
    Ok(d)
}

/// The orders a replica of a task partition with `channels` input channels follows, given
/// the order log's messages in log order: stale epochs are fenced off, replays ignored.
#[pyclass(module = "tandem._core")]
pub struct OrderLog {
    inner: CoreOrderLog,
}

#[pymethods]
impl OrderLog {
    #[new]
    fn new(channels: usize) -> Self {
        OrderLog {
            inner: CoreOrderLog::new(channels),
        }
    }

    /// Offer the next message (an encoded Order frame): `"followed"`, `"stale"` or
    /// `"replayed"`. Raises `ProtocolError` / `ConfigError` like `OrderFeed.offer`.
    fn offer(&mut self, frame: &[u8]) -> PyResult<&'static str> {
        self.inner.offer_frame(frame).py().map(verdict_str)
    }

    /// The followed entries `(channel, up_to_seq)` not taken yet, oldest first.
    fn drain(&mut self) -> Vec<(usize, u64)> {
        self.inner.drain().collect()
    }

    /// Per channel, the furthest position the followed orders reach.
    fn ordered(&self) -> Vec<u64> {
        self.inner.ordered().to_vec()
    }

    /// `{"followed", "stale", "replayed", "entries", "epoch", "version"}`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, self.inner.stats())
    }
}
