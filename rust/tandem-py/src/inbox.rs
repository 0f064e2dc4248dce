//! `tandem._core.Inbox` and `Delivery`: the receiving side of a replica
//! ([`tandem_core::inbox`]) over pyarrow record batches.
//!
//! `Inbox.next` runs with the GIL released through [`gil::wait`] (it still honours
//! Ctrl-C).

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use pyo3_arrow::PyRecordBatch;
use tandem_core::digest::to_hex;
use tandem_core::divergence::OnDivergence;
use tandem_core::inbox::{Inbox as CoreInbox, InboxConfig};
use tandem_core::merge::OrderingMode;
use tandem_core::wire::DEFAULT_MAX_FRAME_BYTES;
use tandem_core::worker::Handle;
use tandem_core::Delivery as CoreDelivery;

use crate::args::{arg_at_least_1, arg_seconds, arg_u32, closed, config_err, replica_tag};
use crate::errors::IntoPyResult;
use crate::gil;
use crate::orderfeed::OrderFeed;

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Inbox>()?;
    m.add_class::<Delivery>()?;
    Ok(())
}

/// One step of the consumption order: `kind` is `"data"`, `"heartbeat"` or `"end"`.
///
/// * data: `channel`, `first_seq`, `batch` (a `pyarrow.RecordBatch`);
/// * heartbeat: `channel`, `epoch`, `first` (True the first time this epoch is seen: the
///   task forwards it on every output channel exactly then);
/// * end: every upstream has ended; the other fields are None.
#[pyclass(frozen, module = "tandem._core")]
pub struct Delivery {
    #[pyo3(get)]
    kind: &'static str,
    #[pyo3(get)]
    channel: Option<usize>,
    #[pyo3(get)]
    first_seq: Option<u64>,
    #[pyo3(get)]
    epoch: Option<u64>,
    #[pyo3(get)]
    first: Option<bool>,
    #[pyo3(get)]
    batch: Option<Py<PyAny>>,
}

#[pymethods]
impl Delivery {
    fn __repr__(&self, py: Python<'_>) -> String {
        match self.kind {
            "data" => {
                let rows = self
                    .batch
                    .as_ref()
                    .and_then(|b| b.bind(py).getattr("num_rows").ok())
                    .map_or_else(|| "?".to_owned(), |n| n.to_string());
                format!(
                    "Delivery(kind='data', channel={}, first_seq={}, rows={rows})",
                    self.channel.unwrap_or_default(),
                    self.first_seq.unwrap_or_default()
                )
            }
            "heartbeat" => format!(
                "Delivery(kind='heartbeat', channel={}, epoch={}, first={})",
                self.channel.unwrap_or_default(),
                self.epoch.unwrap_or_default(),
                if self.first == Some(true) {
                    "True"
                } else {
                    "False"
                }
            ),
            _ => "Delivery(kind='end')".to_owned(),
        }
    }
}

fn delivery_to_py(py: Python<'_>, d: CoreDelivery<arrow_array::RecordBatch>) -> PyResult<Delivery> {
    let none = Delivery {
        kind: "end",
        channel: None,
        first_seq: None,
        epoch: None,
        first: None,
        batch: None,
    };
    Ok(match d {
        CoreDelivery::Data {
            channel,
            first_seq,
            payload,
        } => Delivery {
            kind: "data",
            channel: Some(channel),
            first_seq: Some(first_seq),
            batch: Some(PyRecordBatch::new(payload).into_pyarrow(py)?.unbind()),
            ..none
        },
        CoreDelivery::Heartbeat {
            channel,
            epoch,
            first,
        } => Delivery {
            kind: "heartbeat",
            channel: Some(channel),
            epoch: Some(epoch),
            first: Some(first),
            ..none
        },
        CoreDelivery::End => none,
    })
}

/// Listens on TCP for the upstream replicas of this task partition, authenticates them,
/// deduplicates their copies (first copy wins) and merges the logical channels in the
/// consumption order every replica agrees on.
///
/// `upstreams` lists the upstream partitions `(task, partition)`; the position in the
/// list is the channel index deliveries report (identical at every replica).
///
/// The heartbeats of the replicas of each upstream partition carry digests of their output;
/// when two replicas disagree on a cycle, `on_divergence="fail"` makes `next()` raise
/// `tandem.DeterminismError`, `"log"` logs it (once per input) and keeps going. Either way
/// `stats()` reports it.
///
/// `worker`: the `Worker` that serves this inbox (it then sleeps on all its inboxes at
/// once); pass it to `Worker.add_task` too, and call `next` only through the worker.
#[pyclass(frozen, module = "tandem._core")]
pub struct Inbox {
    pub(crate) inner: Handle<CoreInbox>,
    port: u16,
}

#[pymethods]
impl Inbox {
    #[new]
    #[pyo3(signature = (job, secret, upstreams, ordering = "liverobin", queue_capacity = 1024,
                        max_frame_bytes = DEFAULT_MAX_FRAME_BYTES as i64, host = "127.0.0.1",
                        port = 0, handshake_timeout = 2.0, on_divergence = "fail",
                        worker = None, me = None, name = None, resume = None,
                        wait_orphaned = false, parked = false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        job: &str,
        secret: &[u8],
        upstreams: Vec<(i64, i64)>,
        ordering: &str,
        queue_capacity: i64,
        max_frame_bytes: i64,
        host: &str,
        port: i64,
        handshake_timeout: f64,
        on_divergence: &str,
        worker: Option<PyRef<'_, crate::worker::Worker>>,
        me: Option<(i64, i64, i64)>,
        name: Option<String>,
        resume: Option<crate::cut::PyInboxCut>,
        wait_orphaned: bool,
        parked: bool,
    ) -> PyResult<Self> {
        crate::logs::sync_level(py)?;
        let ordering = match ordering {
            "liverobin" => OrderingMode::LiveRobin,
            "none" => OrderingMode::None,
            "kazoo" => OrderingMode::Positional,
            other => {
                return Err(config_err(format!(
                    "ordering must be 'liverobin', 'kazoo' or 'none' for an Inbox, got {other:?}"
                )))
            }
        };
        let upstreams = upstreams
            .into_iter()
            .map(|(t, p)| {
                Ok((
                    arg_u32("upstream task", t)?,
                    arg_u32("upstream partition", p)?,
                ))
            })
            .collect::<PyResult<Vec<_>>>()?;
        let host: IpAddr = host.parse().map_err(|_| {
            config_err(format!(
                "host must be an IP address such as '127.0.0.1', got {host:?}"
            ))
        })?;
        let port = u16::try_from(port)
            .map_err(|_| config_err(format!("port must be in 0..=65535 (0 = any), got {port}")))?;
        if max_frame_bytes < 1 {
            return Err(config_err(format!(
                "max_frame_bytes must be ≥ 1, got {max_frame_bytes}"
            )));
        }
        let mut cfg = InboxConfig::new(job, secret, upstreams);
        cfg.ordering = ordering;
        cfg.queue_capacity = arg_at_least_1("queue_capacity", queue_capacity)?;
        cfg.max_frame_bytes = max_frame_bytes as u64;
        cfg.host = host;
        cfg.port = port;
        cfg.handshake_timeout = arg_seconds("handshake_timeout", handshake_timeout)?;
        cfg.on_divergence = OnDivergence::parse(on_divergence).py()?;
        cfg.bell = worker.as_ref().map(|w| w.bell());
        cfg.reactor = worker.as_ref().map(|w| w.reactor());
        cfg.order_bell = worker.map(|w| w.order_bell());
        cfg.me = replica_tag(me, name)?;
        cfg.resume = resume.map(crate::cut::inbox_from_py);
        cfg.wait_orphaned = wait_orphaned;
        cfg.parked = parked;
        let inbox = py.detach(|| CoreInbox::bind(cfg)).py()?;
        let port = inbox.local_addr().port();
        Ok(Inbox {
            inner: Arc::new(Mutex::new(Some(inbox))),
            port,
        })
    }

    /// The TCP port the inbox listens on.
    #[getter]
    fn port(&self) -> u16 {
        self.port
    }

    /// Whether the inbox was bound with `parked=True` and is not unparked yet.
    #[getter]
    fn parked(&self, py: Python<'_>) -> PyResult<bool> {
        py.detach(|| {
            self.inner
                .lock()
                .as_ref()
                .map(CoreInbox::parked)
                .ok_or_else(|| closed("parked"))
        })
    }

    /// Start an inbox bound with `parked=True` at `cut` (the inbox part of a cut,
    /// `cut[2]`): each channel takes its input from the cut's positions on, the merge from
    /// its state. Until then it takes nothing and its peers' input waits.
    fn unpark(&self, py: Python<'_>, cut: crate::cut::PyInboxCut) -> PyResult<()> {
        let cut = crate::cut::inbox_from_py(cut);
        py.detach(|| {
            self.inner
                .lock()
                .as_mut()
                .ok_or_else(|| closed("unpark"))?
                .unpark(&cut)
                .py()
        })
    }

    /// The next delivery, waiting at most `timeout` seconds (None = until one arrives).
    /// Returns None on timeout. The GIL is released while waiting; Ctrl-C interrupts.
    /// Raises `tandem.DeterminismError` once upstream replicas diverged under
    /// `on_divergence="fail"`.
    #[pyo3(signature = (timeout = None))]
    fn next(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<Delivery>> {
        let deadline = match timeout {
            None => None,
            Some(t) => Some(Instant::now() + arg_seconds("timeout", t)?),
        };
        let got = gil::wait(py, |budget| {
            let mut guard = self.inner.lock();
            let Some(inbox) = guard.as_mut() else {
                return Some(Err(closed("next")));
            };
            let now = Instant::now();
            let wait = deadline.map_or(budget, |d| budget.min(d.saturating_duration_since(now)));
            match inbox.next(wait) {
                Ok(Some(d)) => Some(Ok(Some(d))),
                Ok(None) if deadline.is_some_and(|d| Instant::now() >= d) => Some(Ok(None)),
                Ok(None) => None,
                Err(e) => Some(Err(crate::errors::to_py(e))),
            }
        })??;
        got.map(|d| delivery_to_py(py, d)).transpose()
    }

    /// The inbox's side of the KaZoo order log (`ordering="kazoo"` only, else None): feed
    /// it the log's messages; a leader also reads what has arrived from it.
    fn order_feed(&self, py: Python<'_>) -> PyResult<Option<OrderFeed>> {
        let feed = py
            .detach(|| self.inner.lock().as_ref().map(CoreInbox::order_feed))
            .ok_or_else(|| closed("order_feed"))?;
        Ok(feed.map(|inner| OrderFeed { inner }))
    }

    /// Counters: per channel accepted/duplicate rows, dedup position and backlog; per
    /// connection peer, identity, frames, bytes, state; rejected connections; the first 16
    /// divergences between upstream replicas and their count; the merge's wait.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        // Locks are taken with the GIL released: another thread may hold this one for a
        // moment inside `next()` and must not then wait for a GIL we would be holding.
        let stats = py
            .detach(|| self.inner.lock().as_ref().map(CoreInbox::stats))
            .ok_or_else(|| closed("stats"))?;
        let out = PyDict::new(py);
        let channels = PyList::empty(py);
        for c in stats.channels {
            let d = PyDict::new(py);
            d.set_item("upstream", c.upstream)?;
            d.set_item("accepted_rows", c.accepted_rows)?;
            d.set_item("duplicate_rows", c.duplicate_rows)?;
            d.set_item("next_seq", c.next_seq)?;
            d.set_item("queued_seqs", c.queued_seqs)?;
            channels.append(d)?;
        }
        let conns = PyList::empty(py);
        for c in stats.connections {
            let d = PyDict::new(py);
            d.set_item("peer", c.peer.to_string())?;
            let identity = match c.identity {
                Some(i) => {
                    let id = PyDict::new(py);
                    id.set_item("job", i.job)?;
                    id.set_item("task", i.task)?;
                    id.set_item("partition", i.partition)?;
                    id.set_item("replica", i.replica)?;
                    Some(id)
                }
                None => None,
            };
            d.set_item("identity", identity)?;
            d.set_item("frames", c.frames)?;
            d.set_item("bytes", c.bytes)?;
            d.set_item("open", c.open)?;
            d.set_item("error", c.error)?;
            conns.append(d)?;
        }
        out.set_item("channels", channels)?;
        out.set_item("connections", conns)?;
        out.set_item("rejected_connections", stats.rejected_connections)?;
        let divergences = PyList::empty(py);
        for v in stats.divergences {
            let d = PyDict::new(py);
            d.set_item("channel", v.channel)?;
            d.set_item("upstream", v.upstream)?;
            d.set_item("epoch", v.epoch)?;
            d.set_item("replicas", v.replicas)?;
            d.set_item("digests", (to_hex(&v.digests.0), to_hex(&v.digests.1)))?;
            divergences.append(d)?;
        }
        out.set_item("divergences", divergences)?;
        out.set_item("divergence_count", stats.divergence_count)?;
        out.set_item("merge_wait_s", stats.merge_wait.as_secs_f64())?;
        Ok(out)
    }

    /// Stop listening, close every connection and join the I/O threads. Idempotent.
    fn close(&self, py: Python<'_>) {
        py.detach(|| drop(self.inner.lock().take()));
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) {
        self.close(py);
    }
}
