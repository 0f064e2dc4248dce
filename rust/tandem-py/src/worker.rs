//! `tandem._core.Worker` and `WorkItem`: [`tandem_core::worker`] for the Python runtime.
//!
//! One Python thread per worker process calls `Worker.next()` (the GIL released while it
//! waits), runs the operator code of the item it gets, emits the output through the slot's
//! `Outbox`es, and calls `next()` again. Heartbeats, watermark tracking and source
//! heartbeat clocks never reach Python.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use tandem_core::reactor::Reactor;
use tandem_core::sync::Doorbell;
use tandem_core::worker::{SlotConfig, SourceClock, Waker, Work, Worker as CoreWorker};

use crate::batch::SchemaCache;
use crate::errors::{ConfigError, IntoPyResult};
use crate::gil;
use crate::inbox::Inbox;
use crate::outbox::Outbox;

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Worker>()?;
    m.add_class::<WorkItem>()?;
    m.add("WORKER_CREDIT_FRAMES", tandem_core::worker::CREDIT_FRAMES)?;
    Ok(())
}

/// One thing for the Python runtime to do: `kind` is
///
/// * `"data"`: run slot `slot` on `batch` from input channel `channel` (`first_seq`);
/// * `"watermark"`: every input of `slot` passed heartbeat `epoch`: run its `on_watermark`
///   and emit the output (the worker forwards the heartbeat on the next `next()`);
/// * `"end"`: every input of `slot` ended: finish it and send its end markers;
/// * `"failed"`: `slot` stopped with `error` (an exception instance, e.g.
///   `tandem.DeterminismError` or `ChannelClosed`);
/// * `"cut"`: `slot` is at the heartbeat-cycle boundary `Worker.request_cut` asked for
///   (`at`: the epoch `Worker.request_cut_at` asked for; None for `request_cut`): take its
///   operator's state now; `cut` is the rest (None: it cannot be cut, or — `at` — it was
///   asked too late).
#[pyclass(frozen, module = "tandem._core")]
pub struct WorkItem {
    #[pyo3(get)]
    kind: &'static str,
    #[pyo3(get)]
    slot: usize,
    #[pyo3(get)]
    channel: Option<usize>,
    #[pyo3(get)]
    first_seq: Option<u64>,
    #[pyo3(get)]
    epoch: Option<u64>,
    #[pyo3(get)]
    batch: Option<Py<PyAny>>,
    #[pyo3(get)]
    error: Option<Py<PyAny>>,
    /// `"cut"`: the slot's cut (a tuple, see `Worker.request_cut`), or None.
    #[pyo3(get)]
    cut: Option<Py<PyAny>>,
    /// `"cut"` asked by `Worker.request_cut_at`: the epoch it was asked at (None otherwise).
    #[pyo3(get)]
    at: Option<u64>,
}

#[pymethods]
impl WorkItem {
    fn __repr__(&self) -> String {
        match self.kind {
            "data" => format!(
                "WorkItem(kind='data', slot={}, channel={}, first_seq={})",
                self.slot,
                self.channel.unwrap_or_default(),
                self.first_seq.unwrap_or_default()
            ),
            "watermark" => format!(
                "WorkItem(kind='watermark', slot={}, epoch={})",
                self.slot,
                self.epoch.unwrap_or_default()
            ),
            kind => format!("WorkItem(kind='{kind}', slot={})", self.slot),
        }
    }
}

fn item(py: Python<'_>, cache: &SchemaCache, work: Work) -> PyResult<WorkItem> {
    let base = |kind, slot| WorkItem {
        kind,
        slot,
        channel: None,
        first_seq: None,
        epoch: None,
        batch: None,
        error: None,
        cut: None,
        at: None,
    };
    Ok(match work {
        Work::Data {
            slot,
            channel,
            first_seq,
            batch,
        } => WorkItem {
            channel: Some(channel),
            first_seq: Some(first_seq),
            batch: Some(cache.export(py, batch)?.unbind()),
            ..base("data", slot)
        },
        Work::Watermark { slot, epoch } => WorkItem {
            epoch: Some(epoch),
            ..base("watermark", slot)
        },
        Work::End { slot } => base("end", slot),
        Work::Failed { slot, error } => WorkItem {
            error: Some(crate::errors::to_py(error).into_value(py).into_any()),
            ..base("failed", slot)
        },
        Work::Cut { slot, cut, at } => WorkItem {
            epoch: cut.as_ref().map(|c| c.epoch),
            at,
            cut: match cut {
                Some(c) => Some(
                    crate::cut::slot_to_py(c)
                        .into_pyobject(py)?
                        .into_any()
                        .unbind(),
                ),
                None => None,
            },
            ..base("cut", slot)
        },
    })
}

/// Serves many task replicas ("slots") of one worker process from one thread: tracks
/// their watermarks, forwards their heartbeats and sends their sources' heartbeats, and
/// hands out only the work that runs Python code (see `WorkItem`).
///
/// Create it first, give it to every `Inbox` it serves (`Inbox(..., worker=w)`), then add
/// the slots. A slot whose downstream links are backed up is not served until they drain,
/// so one slot never blocks on another that the same thread must run.
#[pyclass(frozen, module = "tandem._core")]
pub struct Worker {
    inner: Mutex<CoreWorker>,
    bell: Arc<Doorbell>,
    /// Rung by this worker's KaZoo inboxes (arrivals, followed orders): the bell of the
    /// worker's `OrderPublisher`.
    order_bell: Arc<Doorbell>,
    /// Reads the connections of every inbox made with this worker.
    reactor: Arc<Reactor>,
    waker: Waker,
    schemas: SchemaCache,
}

impl Worker {
    pub(crate) fn bell(&self) -> Arc<Doorbell> {
        Arc::clone(&self.bell)
    }

    pub(crate) fn order_bell(&self) -> Arc<Doorbell> {
        Arc::clone(&self.order_bell)
    }

    pub(crate) fn reactor(&self) -> Arc<Reactor> {
        Arc::clone(&self.reactor)
    }

    fn with<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut CoreWorker) -> tandem_core::Result<T> + Send,
    ) -> PyResult<T> {
        py.detach(|| f(&mut self.inner.lock())).py()
    }
}

fn handles(
    outboxes: &[PyRef<'_, Outbox>],
) -> Vec<tandem_core::worker::Handle<tandem_core::outbox::Outbox>> {
    outboxes.iter().map(|o| Arc::clone(&o.inner)).collect()
}

#[pymethods]
impl Worker {
    #[new]
    fn new() -> Self {
        let inner = CoreWorker::new();
        Worker {
            bell: inner.bell(),
            order_bell: Arc::default(),
            reactor: inner.reactor(),
            waker: inner.waker(),
            inner: Mutex::new(inner),
            schemas: SchemaCache::default(),
        }
    }

    /// Add a source slot: its rows come from Python; the worker sends heartbeat `k` on
    /// `outboxes` at `t0_ns + k·heartbeat_ns` (ns since the Unix epoch) once `allow`ed.
    /// `resume`: a twin's cut to continue from. Returns the slot index.
    #[pyo3(signature = (outboxes, t0_ns, heartbeat_ns, resume = None))]
    fn add_source(
        &self,
        py: Python<'_>,
        outboxes: Vec<PyRef<'_, Outbox>>,
        t0_ns: i64,
        heartbeat_ns: u64,
        resume: Option<crate::cut::PySlotCut>,
    ) -> PyResult<usize> {
        let cfg = SlotConfig {
            inbox: None,
            outboxes: handles(&outboxes),
            watermarks: false,
            clock: Some(SourceClock {
                t0_ns,
                heartbeat_ns,
            }),
            resume: resume.map(crate::cut::slot_from_py),
        };
        self.with(py, move |w| w.add_slot(cfg))
    }

    /// Add an operator or sink slot reading `inbox` (created with `worker=self`) and
    /// writing `outboxes`; `watermarks`: hand out watermark advances (the operator has an
    /// `on_watermark`). `resume`: a twin's cut to continue from (the inbox must have been
    /// bound with its inbox part). Returns the slot index.
    #[pyo3(signature = (inbox, outboxes, watermarks, resume = None))]
    fn add_task(
        &self,
        py: Python<'_>,
        inbox: PyRef<'_, Inbox>,
        outboxes: Vec<PyRef<'_, Outbox>>,
        watermarks: bool,
        resume: Option<crate::cut::PySlotCut>,
    ) -> PyResult<usize> {
        let cfg = SlotConfig {
            inbox: Some(Arc::clone(&inbox.inner)),
            outboxes: handles(&outboxes),
            watermarks,
            clock: None,
            resume: resume.map(crate::cut::slot_from_py),
        };
        self.with(py, move |w| w.add_slot(cfg))
    }

    /// Take a cut of `slot` at its next heartbeat-cycle boundary: `next()` hands out a
    /// `"cut"` item for it right after that heartbeat leaves — the tuple
    /// `(epoch, epochs, inbox, outboxes)` a replica rebuilt from this one resumes from
    /// (`Inbox(resume=cut[2])`, `add_task(resume=cut)`), or None if the slot cannot be cut.
    fn request_cut(&self, py: Python<'_>, slot: usize) -> PyResult<()> {
        self.with(py, move |w| w.request_cut(slot))
    }

    /// Take an aligned cut of `slot` right after it forwards heartbeat `epoch` (a checkpoint
    /// at the same epoch on every slot): `next()` hands out a `"cut"` item with
    /// `at=epoch`, its `cut` taken after the last heartbeat forwarded together with `epoch`
    /// (nothing comes between them), or None if the slot already forwarded `epoch` or
    /// finished. A newer request replaces one not yet taken.
    fn request_cut_at(&self, py: Python<'_>, slot: usize, epoch: u64) -> PyResult<()> {
        self.with(py, move |w| w.request_cut_at(slot, epoch))
    }

    /// Hold `slot` where it stands (`on=True`) or let it go on: while held, `next()` hands
    /// out nothing of it and its input waits in its inbox.
    fn hold(&self, py: Python<'_>, slot: usize, on: bool) -> PyResult<()> {
        self.with(py, move |w| w.hold(slot, on))
    }

    /// A source slot may send its heartbeats through `epoch`, each when due.
    fn allow(&self, py: Python<'_>, slot: usize, epoch: u64) -> PyResult<()> {
        self.with(py, move |w| w.allow(slot, epoch))
    }

    /// Send a source slot's heartbeats through `epoch` now.
    fn heartbeats_through(&self, py: Python<'_>, slot: usize, epoch: u64) -> PyResult<()> {
        self.with(py, move |w| w.heartbeats_through(slot, epoch))
    }

    /// Give `slot`'s inbox one input channel per upstream partition `(task, partition)` of
    /// `upstreams` (new partitions of an upstream task: a live rescale), taking turns after
    /// heartbeat `after_epoch`. Returns the new channels' `(start, stop)` indices.
    fn join_inputs(
        &self,
        py: Python<'_>,
        slot: usize,
        upstreams: Vec<(u32, u32)>,
        after_epoch: u64,
    ) -> PyResult<(usize, usize)> {
        self.with(py, move |w| {
            w.join_inputs(slot, &upstreams, after_epoch)
                .map(|r| (r.start, r.end))
        })
    }

    /// Take back the channels the last `join_inputs` of `slot` gave it (a live rescale
    /// given up before its switch); refused once they took input.
    fn cancel_join(&self, py: Python<'_>, slot: usize) -> PyResult<()> {
        self.with(py, move |w| w.cancel_join(slot))
    }

    /// Whether `slot`'s downstream links have room (a source emits only then).
    fn ready(&self, py: Python<'_>, slot: usize) -> bool {
        py.detach(|| self.inner.lock().ready(slot))
    }

    /// Stop serving `slot`.
    fn retire(&self, py: Python<'_>, slot: usize) -> PyResult<()> {
        self.with(py, move |w| w.retire(slot))
    }

    /// Bring a waiting `next()` back early (it returns None once no slot has work), from
    /// any thread: a source that reads its input on a thread of its own calls it when rows
    /// came. Takes no lock and never blocks.
    fn wake(&self) {
        self.waker.wake();
    }

    /// The next work item, waiting at most `timeout` seconds (None: until there is one);
    /// None on timeout or after `wake()`. The GIL is released while waiting; Ctrl-C interrupts.
    #[pyo3(signature = (timeout = None))]
    fn next(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<WorkItem>> {
        let deadline = match timeout {
            None => None,
            Some(t) => Some(
                Instant::now()
                    + Duration::try_from_secs_f64(t.max(0.0)).map_err(|_| {
                        ConfigError::new_err(format!(
                            "timeout must be a finite number of seconds, got {t}"
                        ))
                    })?,
            ),
        };
        let got = gil::wait(py, |budget| {
            let now = Instant::now();
            let step = deadline.map_or(now + budget, |d| d.min(now + budget));
            let mut worker = self.inner.lock();
            match worker.next(Some(step)) {
                Ok(Some(w)) => Some(Ok(Some(w))),
                Ok(None) if worker.was_woken() => Some(Ok(None)),
                Ok(None) if deadline.is_some_and(|d| Instant::now() >= d) => Some(Ok(None)),
                Ok(None) => None,
                Err(e) => Some(Err(e)),
            }
        })?
        .py()?;
        got.map(|w| item(py, &self.schemas, w)).transpose()
    }

    /// Per slot, in slot order: `{"watermark", "backlog", "active"}` — the last heartbeat
    /// epoch it forwarded (a source: sent), the frames queued on its output links, whether
    /// it is still served. Reads only.
    fn slot_stats<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let slots = py.detach(|| self.inner.lock().slot_stats());
        slots
            .into_iter()
            .map(|s| {
                let d = PyDict::new(py);
                d.set_item("watermark", s.watermark)?;
                d.set_item("backlog", s.backlog)?;
                d.set_item("active", s.active)?;
                Ok(d)
            })
            .collect()
    }

    /// `{"heartbeats", "data", "watermarks", "credit_waits"}`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = py.detach(|| self.inner.lock().stats());
        let d = PyDict::new(py);
        d.set_item("heartbeats", s.heartbeats)?;
        d.set_item("data", s.data)?;
        d.set_item("watermarks", s.watermarks)?;
        d.set_item("credit_waits", s.credit_waits)?;
        Ok(d)
    }
}
