//! `tandem._core.Inbox`, `Outbox` and `Delivery`: the TCP transport of
//! [`tandem_core::inbox`] and the [`tandem_core::outbox`] over pyarrow record batches.
//!
//! Every blocking call runs with the GIL released: `Inbox.next` through [`gil::wait`]
//! (it still honours Ctrl-C), `Outbox.emit` and friends through `py.detach` (they block
//! only while a downstream queue is full, which is the back-pressure).

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use pyo3_arrow::PyRecordBatch;
use tandem_core::digest::to_hex;
use tandem_core::divergence::OnDivergence;
use tandem_core::inbox::{Inbox as CoreInbox, InboxConfig};
use tandem_core::link::{LinkConfig, TcpLink};
use tandem_core::logs::{ReplicaTag, OUTBOX};
use tandem_core::merge::OrderingMode;
use tandem_core::orderfeed::{
    OrderFeed as CoreOrderFeed, OrderPublisher as CoreOrderPublisher, PublishStep,
};
use tandem_core::outbox::{
    Eviction, Link, Outbox as CoreOutbox, OutboxConfig, Partitioner, ReplayWindow,
};
use tandem_core::wire::{Identity, DEFAULT_MAX_FRAME_BYTES};
use tandem_core::worker::Handle;
use tandem_core::{Delivery as CoreDelivery, Error};

use crate::batch::SchemaCache;
use crate::errors::{ConfigError, IntoPyResult};
use crate::gil;
use crate::orderlog::{stats_dict, verdict_str};
use tandem_core::orderlog::{split_message, Verdict};

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Inbox>()?;
    m.add_class::<Outbox>()?;
    m.add_class::<DialedLink>()?;
    m.add_class::<Delivery>()?;
    m.add_class::<OrderFeed>()?;
    m.add_class::<OrderPublisher>()?;
    m.add_class::<OrderRouter>()?;
    Ok(())
}

fn config_err(msg: String) -> PyErr {
    ConfigError::new_err(msg)
}

fn arg_u32(name: &str, v: i64) -> PyResult<u32> {
    u32::try_from(v).map_err(|_| config_err(format!("{name} must be in 0..=4294967295, got {v}")))
}

fn arg_at_least_1(name: &str, v: i64) -> PyResult<usize> {
    if v < 1 {
        return Err(config_err(format!("{name} must be ≥ 1, got {v}")));
    }
    usize::try_from(v).map_err(|_| config_err(format!("{name} is too large: {v}")))
}

/// The tag of the replica `me` (task, partition, replica) for log lines, named `name` if
/// given.
fn replica_tag(me: Option<(i64, i64, i64)>, name: Option<String>) -> PyResult<Option<ReplicaTag>> {
    let Some((t, p, r)) = me else {
        return Ok(None);
    };
    let tag = ReplicaTag::new(
        arg_u32("me task", t)?,
        arg_u32("me partition", p)?,
        arg_u32("me replica", r)?,
    );
    Ok(Some(match name {
        Some(n) => tag.named(n),
        None => tag,
    }))
}

fn arg_seconds(name: &str, v: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(v).map_err(|_| {
        config_err(format!(
            "{name} must be a finite number of seconds ≥ 0, got {v}"
        ))
    })
}

fn closed(what: &str) -> PyErr {
    crate::errors::to_py(Error::Closed(format!("{what}() on a closed object")))
}

// ───────────────────────────── Delivery ─────────────────────────────

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

// ───────────────────────────── Inbox ─────────────────────────────

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
                        wait_orphaned = false))]
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

// ───────────────────────────── OrderFeed ─────────────────────────────

/// The KaZoo orderer's handle on a `kazoo` inbox (see `Inbox.order_feed`). Every method
/// is safe to call from another thread while the inbox's consumer waits in `next()`.
#[pyclass(frozen, module = "tandem._core")]
pub struct OrderFeed {
    inner: CoreOrderFeed,
}

#[pymethods]
impl OrderFeed {
    /// Offer the next message of the order log (an encoded Order frame). Returns
    /// `"followed"`, `"stale"` (a deposed leader's order: fenced off) or `"replayed"` (a
    /// version already followed). Raises `ProtocolError` for bytes that are not one Order
    /// frame and `ConfigError` for an order naming a channel this task does not have.
    fn offer(&self, py: Python<'_>, frame: &[u8]) -> PyResult<&'static str> {
        let verdict = py.detach(|| self.inner.offer_frame(frame)).py()?;
        Ok(verdict_str(verdict))
    }

    /// Per input channel, the first sequence number not yet arrived here: everything
    /// before it is in this replica's dedup queue and may be ordered.
    fn arrived(&self, py: Python<'_>) -> Vec<u64> {
        py.detach(|| self.inner.arrived())
    }

    /// Per input channel, the furthest position the followed orders reach.
    fn ordered(&self, py: Python<'_>) -> Vec<u64> {
        py.detach(|| self.inner.ordered())
    }

    /// `{"followed", "stale", "replayed", "entries", "epoch", "version"}`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, py.detach(|| self.inner.stats()))
    }

    /// A token for `wait`: read it, look at `arrived()`, then wait with it.
    fn generation(&self) -> u64 {
        self.inner.generation()
    }

    /// Sleep (without the GIL) until input arrives or an order is followed after
    /// `generation` was read, or `timeout` seconds pass. True if woken.
    fn wait(&self, py: Python<'_>, generation: u64, timeout: f64) -> PyResult<bool> {
        let timeout = arg_seconds("timeout", timeout)?;
        Ok(py.detach(|| self.inner.wait(generation, timeout)))
    }
}

/// An order a feed did not follow: `(slot, verdict, epoch, version, current epoch)`.
type Ignored = (u32, &'static str, u64, u64, u64);

/// Hands each order of an order log message to the feeds of its partition in this worker
/// (see `tandem_core::orderlog::split_message`): what the follower of a worker's KaZoo
/// session does with every message, in Rust.
#[pyclass(module = "tandem._core")]
pub struct OrderRouter {
    feeds: std::collections::HashMap<u32, Vec<CoreOrderFeed>>,
    /// The publisher's follow bell, rung for every message offered: it may have been
    /// waiting for it.
    followed: Arc<tandem_core::sync::Doorbell>,
}

#[pymethods]
impl OrderRouter {
    /// A router for the worker `publisher` publishes for.
    #[new]
    fn new(publisher: PyRef<'_, OrderPublisher>) -> Self {
        OrderRouter {
            feeds: std::collections::HashMap::new(),
            followed: publisher.inner.lock().follow_bell(),
        }
    }

    /// Route the orders for `slot` to `feed` (a replica of that partition in this worker).
    fn add(&mut self, slot: u32, feed: PyRef<'_, OrderFeed>) {
        self.feeds.entry(slot).or_default().push(feed.inner.clone());
    }

    /// Offer the message at `offset` of the order log, in log order. Orders for
    /// partitions with no feed here are skipped, and so is every order for a feed whose
    /// log was read past `offset` already (a replica rebuilt from a twin's cut, whose
    /// reader starts at or before the twin's place). Returns what was not followed, as
    /// `(slot, verdict, epoch, version, current epoch)` (`verdict`: `"stale"` or
    /// `"replayed"`); raises `ProtocolError` for a message that is not whole Order frames
    /// and `ConfigError` for an order naming a channel its task does not have.
    fn offer(&self, py: Python<'_>, message: &[u8], offset: u64) -> PyResult<Vec<Ignored>> {
        let ignored = py
            .detach(|| {
                let mut ignored = Vec::new();
                for part in split_message(message)? {
                    for feed in self.feeds.get(&part.slot).into_iter().flatten() {
                        let Some(verdict) =
                            feed.offer_at(offset, part.epoch, part.version, &part.entries)?
                        else {
                            continue;
                        };
                        let current = match verdict {
                            Verdict::Followed => continue,
                            Verdict::Stale { current, .. } => current,
                            Verdict::Replayed { epoch, .. } => epoch,
                        };
                        ignored.push((
                            part.slot,
                            verdict_str(verdict),
                            part.epoch,
                            part.version,
                            current,
                        ));
                    }
                }
                for feed in self.feeds.values().flatten() {
                    feed.read_through(offset + 1);
                }
                Ok(ignored)
            })
            .py();
        self.followed.ring();
        ignored
    }
}

/// Publishes the orders of every partition one worker leads, from one thread, one message
/// in flight (see the core's `OrderPublisher`): `next` returns the orders due across all of
/// them at once, so they go to the log together. Created with the worker whose inboxes it
/// serves.
#[pyclass(frozen, module = "tandem._core")]
pub struct OrderPublisher {
    inner: Mutex<CoreOrderPublisher>,
    /// Keys whose last order was not delivered (`lost`), applied at the next `next`.
    lost: Mutex<Vec<u64>>,
    batch: usize,
    resend_after: Duration,
}

#[pymethods]
impl OrderPublisher {
    /// At most `batch` entries per order; an order its replica has not followed after
    /// `resend_after` seconds is published again from the log; at least `pace` seconds
    /// between two messages (orders due meanwhile wait and go together; 0: a message goes
    /// as soon as the last was followed).
    #[new]
    #[pyo3(signature = (worker, batch = 1000, resend_after = 5.0, pace = 0.0))]
    fn new(
        worker: PyRef<'_, crate::worker::Worker>,
        batch: usize,
        resend_after: f64,
        pace: f64,
    ) -> PyResult<Self> {
        if batch == 0 {
            return Err(config_err(
                "batch must be at least 1 entry per order".into(),
            ));
        }
        let mut inner = CoreOrderPublisher::new(worker.order_bell());
        inner.pace(arg_seconds("pace", pace)?);
        Ok(OrderPublisher {
            inner: Mutex::new(inner),
            lost: Mutex::new(Vec::new()),
            batch,
            resend_after: arg_seconds("resend_after", resend_after)?,
        })
    }

    /// Lead the partition numbered `slot` in the run (its orders' frame header channel)
    /// with `epoch`, through `feed`, from what its log covers now (read the log to its end
    /// first). Raises `ConfigError` if the feed's inbox belongs to another worker.
    fn lead(
        &self,
        py: Python<'_>,
        slot: u32,
        feed: PyRef<'_, OrderFeed>,
        epoch: u64,
    ) -> PyResult<()> {
        let feed = feed.inner.clone();
        py.detach(|| {
            let leader = feed.lead(epoch, slot, self.batch, self.resend_after);
            self.inner.lock().lead(u64::from(slot), feed, leader)
        })
        .py()
    }

    /// Stop publishing under `key`. Returns `(orders published, orders given up on after
    /// resend_after)` of that leadership, or None if it did not lead.
    fn resign(&self, py: Python<'_>, key: u64) -> Option<(u64, u64)> {
        py.detach(|| self.inner.lock().resign(key))
    }

    /// The last order under `key` was not delivered (the client said so): publish again
    /// from the log at the next step. Safe from any thread, also while `next` sleeps.
    fn lost(&self, key: u64) {
        self.lost.lock().push(key);
        let publisher = self.inner.lock();
        publisher.bell(false).ring();
        publisher.followed();
    }

    /// Sleep (without the GIL) until orders are due and return them all as `(key, order
    /// bytes)`, or `[]` after `timeout` seconds. One thread at a time.
    fn next<'py>(
        &self,
        py: Python<'py>,
        timeout: f64,
    ) -> PyResult<Vec<(u64, Bound<'py, PyBytes>)>> {
        let timeout = arg_seconds("timeout", timeout)?;
        // Never sleep holding the publisher: `lead` and `resign` come from other threads.
        let deadline = Instant::now() + timeout;
        let due = py.detach(|| loop {
            let step = {
                let mut publisher = self.inner.lock();
                for key in std::mem::take(&mut *self.lost.lock()) {
                    if let Some(leader) = publisher.leader(key) {
                        leader.lost();
                    }
                }
                publisher.step(deadline)
            };
            match step {
                PublishStep::Due(due) => break due,
                PublishStep::Sleep(sleep) => sleep.sleep(),
            }
        });
        Ok(due
            .into_iter()
            .map(|(key, order)| (key, PyBytes::new(py, &order)))
            .collect())
    }
}

// ───────────────────────────── Outbox ─────────────────────────────

/// The output of one task partition replica: partitions emitted rows over the downstream
/// partitions (channels), numbers every row and marker, sends each emitted batch's part of
/// a channel at once (frames of at most `batch_rows` rows cut at fixed offsets of that part)
/// to every replica of the channel's downstream partition, and keeps each channel's cycle
/// digest, which its heartbeats carry.
///
/// `me` is `(task, partition, replica)`; `downstream[c]` lists the replicas of downstream
/// partition `c`: each a `(host, port)` to dial, or the `Inbox` itself when the replica
/// lives in this process (the batches then go straight into its dedup, never encoded).
/// Construction dials the others (in parallel, retrying until `connect_timeout`); an
/// unreachable replica is logged and skipped, a channel with no reachable replica is an
/// error.
/// A connection to a downstream replica, dialled and authenticated by [`Outbox::dial`],
/// waiting to be attached to a channel of that outbox ([`Outbox::attach`]). Dropped
/// unattached, it closes.
#[pyclass(frozen, module = "tandem._core")]
pub struct DialedLink {
    peer: String,
    link: Mutex<Option<TcpLink>>,
}

#[pymethods]
impl DialedLink {
    fn __repr__(&self) -> String {
        let state = if self.link.lock().is_some() {
            "unattached"
        } else {
            "attached"
        };
        format!("DialedLink({}, {state})", self.peer)
    }
}

#[pyclass(frozen, module = "tandem._core")]
pub struct Outbox {
    pub(crate) inner: Handle<CoreOutbox>,
    /// Who this outbox sends as, and how it dials: for `dial`.
    me: Identity,
    secret: Vec<u8>,
    link_cfg: LinkConfig,
    /// `next_seqs` as of the last completed call, readable while another thread is blocked
    /// in `emit` holding `inner` (back-pressure may last as long as the consumer sleeps).
    seqs: Mutex<Vec<u64>>,
    schemas: SchemaCache,
}

impl Outbox {
    /// Run `f` on the outbox with the GIL released — the lock too: `emit` may hold it as
    /// long as a downstream applies back-pressure, and a thread waiting for it must not hold
    /// the GIL meanwhile.
    fn with<T: Send>(
        &self,
        py: Python<'_>,
        what: &str,
        f: impl FnOnce(&mut CoreOutbox) -> tandem_core::Result<T> + Send,
    ) -> PyResult<T> {
        py.detach(|| {
            let mut guard = self.inner.lock();
            let ob = guard.as_mut().ok_or_else(|| closed(what))?;
            let res = f(ob);
            self.seqs.lock().clone_from_slice(ob.next_seqs());
            res.py()
        })
    }
}

#[pymethods]
impl Outbox {
    #[new]
    #[pyo3(signature = (job, secret, me, downstream, partitioner = "forward", key = None,
                        batch_rows = 1024, connect_timeout = 10.0, queue_frames = 256,
                        name = None, evict_after_ms = None, replay_cycles = None,
                        replay_bytes = 64 << 20, hold_orphans = false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        job: &str,
        secret: &[u8],
        me: (i64, i64, i64),
        downstream: Vec<Vec<Bound<'_, PyAny>>>,
        partitioner: &str,
        key: Option<&str>,
        batch_rows: i64,
        connect_timeout: f64,
        queue_frames: i64,
        name: Option<String>,
        evict_after_ms: Option<f64>,
        replay_cycles: Option<i64>,
        replay_bytes: i64,
        hold_orphans: bool,
    ) -> PyResult<Self> {
        crate::logs::sync_level(py)?;
        let tag = replica_tag(Some(me), name)?;
        let partitioner = Partitioner::parse(partitioner, key).py()?;
        let me = Identity {
            job: job.to_owned(),
            task: arg_u32("me task", me.0)?,
            partition: arg_u32("me partition", me.1)?,
            replica: arg_u32("me replica", me.2)?,
        };
        let cfg = OutboxConfig {
            batch_rows: arg_at_least_1("batch_rows", batch_rows)?,
        };
        let queue_frames = arg_at_least_1("queue_frames", queue_frames)?;
        let eviction = match evict_after_ms {
            None => None,
            Some(ms) => Some(Eviction {
                frames: (queue_frames / 2).max(1),
                after: arg_seconds("evict_after_ms", ms / 1000.0)?,
            }),
        };
        let link_cfg = LinkConfig {
            queue_frames,
            connect_timeout: arg_seconds("connect_timeout", connect_timeout)?,
            ..LinkConfig::default()
        };
        if downstream.is_empty() {
            return Err(config_err(
                "downstream is empty; give at least one channel of (host, port) replicas"
                    .to_owned(),
            ));
        }
        let mut targets = Vec::with_capacity(downstream.len());
        for (c, replicas) in downstream.into_iter().enumerate() {
            if replicas.is_empty() {
                return Err(config_err(format!(
                    "downstream[{c}] is empty; every channel needs at least one (host, port)"
                )));
            }
            let mut ch = Vec::with_capacity(replicas.len());
            for replica in replicas {
                if let Ok(inbox) = replica.cast::<Inbox>() {
                    ch.push(Target::Local(Arc::clone(&inbox.get().inner)));
                    continue;
                }
                let (host, port): (String, i64) =
                    replica.extract().map_err(|_| {
                        config_err(format!(
                        "downstream[{c}] holds {}; give (host, port) or an Inbox of this process",
                        replica.repr().map_or_else(|_| "?".to_owned(), |r| r.to_string())
                    ))
                    })?;
                let port = u16::try_from(port)
                    .ok()
                    .filter(|&p| p != 0)
                    .ok_or_else(|| {
                        config_err(format!(
                            "downstream[{c}] port must be in 1..=65535, got {port}"
                        ))
                    })?;
                ch.push(Target::Remote(format!("{host}:{port}")));
            }
            targets.push(ch);
        }
        let window = match replay_cycles {
            None => None,
            Some(cycles) => Some(ReplayWindow {
                cycles: arg_at_least_1("replay_cycles", cycles)?,
                bytes: arg_at_least_1("replay_bytes", replay_bytes)?,
            }),
        };
        let secret = secret.to_vec();
        let outbox = py.detach(|| -> tandem_core::Result<CoreOutbox> {
            let links = dial_all(&targets, &me, tag.as_ref(), &secret, &link_cfg)?;
            let mut outbox = CoreOutbox::new(partitioner, links, cfg)?;
            outbox.evicting(eviction);
            outbox.keep_replay(window);
            outbox.hold_orphans(hold_orphans);
            Ok(match tag {
                Some(t) => outbox.tagged(t),
                None => outbox,
            })
        });
        let outbox = outbox.py()?;
        Ok(Outbox {
            seqs: Mutex::new(outbox.next_seqs().to_vec()),
            inner: Arc::new(Mutex::new(Some(outbox))),
            me,
            secret,
            link_cfg,
            schemas: SchemaCache::default(),
        })
    }

    /// Dial `address` (`(host, port)`) and authenticate, for a later [`Outbox::attach`]:
    /// blocking (GIL released) for as long as the peer takes to answer, touching nothing
    /// of the outbox, so any thread may dial while another sends. Fails (ConnectionError)
    /// if the peer cannot be reached within `connect_timeout` or refuses the handshake.
    fn dial(&self, py: Python<'_>, address: (String, u16)) -> PyResult<DialedLink> {
        let addr = format!("{}:{}", address.0, address.1);
        let link = py
            .detach(|| TcpLink::connect(&addr, &self.me, &self.secret, &self.link_cfg))
            .py()?;
        Ok(DialedLink {
            peer: addr,
            link: Mutex::new(Some(link)),
        })
    }

    /// Make `link` (from [`Outbox::dial`]) a link of channel `channel`, to a replica
    /// rebuilt from a twin's cut at heartbeat `after_epoch`: what the replay window holds
    /// after that heartbeat first, then everything from now on. Fails if the link was
    /// attached before, or the window no longer reaches back to the cut ("needs a later
    /// cut"); the link is then closed.
    fn attach(
        &self,
        py: Python<'_>,
        channel: usize,
        link: &DialedLink,
        after_epoch: u64,
    ) -> PyResult<()> {
        let link = link.link.lock().take().ok_or_else(|| {
            ConfigError::new_err(format!("the link to {} is attached already", link.peer))
        })?;
        self.with(py, "attach", move |ob| {
            ob.add_link(channel, Box::new(link), after_epoch)
        })
    }

    /// Partition the rows of `batch` (a pyarrow.RecordBatch or anything with
    /// `__arrow_c_array__`) and send each channel's part now, as frames of at most
    /// `batch_rows` rows. A batch that cannot be encoded or digested is refused whole
    /// (nothing sent). Blocks (GIL released) while a downstream queue is full.
    fn emit(&self, py: Python<'_>, batch: &Bound<'_, PyAny>) -> PyResult<()> {
        let batch = self.schemas.import(py, batch)?;
        self.with(py, "emit", move |ob| ob.emit(&batch))
    }

    /// Send a heartbeat of cycle `epoch` on every channel, carrying the channel's digest of
    /// the data sent since its previous heartbeat.
    fn heartbeat(&self, py: Python<'_>, epoch: u64) -> PyResult<()> {
        self.with(py, "heartbeat", move |ob| ob.heartbeat(epoch))
    }

    /// Send the end marker on every channel (the digest of the data after the last
    /// heartbeat is recorded under epoch 2**64 - 1).
    fn end(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, "end", CoreOutbox::end)
    }

    /// The cycle digests closed since the last call, oldest first: `(channel, epoch,
    /// digest)` with a 16-byte `digest`, one per channel per heartbeat, plus one per channel
    /// under epoch 2**64 - 1 once `end()` ran. Drains them.
    fn digests<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let taken = self.with(py, "digests", |ob| Ok(ob.take_digests()))?;
        PyList::new(
            py,
            taken
                .into_iter()
                .map(|(c, epoch, d)| (c, epoch, PyBytes::new(py, &d))),
        )
    }

    /// Close the connections (each delivers what it queued first; nothing else is
    /// pending, `emit` sends at once). Without a prior `end()`, receivers see this replica
    /// stop mid-stream. Idempotent.
    fn close(&self, py: Python<'_>) {
        py.detach(|| {
            if let Some(mut ob) = self.inner.lock().take() {
                ob.close();
            }
        });
    }

    /// Cut every connection now, dropping queued frames: a crash of this replica as the
    /// receivers see it (fault injection). Idempotent.
    fn abort(&self, py: Python<'_>) {
        py.detach(|| {
            if let Some(mut ob) = self.inner.lock().take() {
                ob.abort();
            }
        });
    }

    /// The downstream replicas dropped as stragglers since the last call: `(channel,
    /// peer)`, the peer as `host:port`.
    fn take_evicted(&self, py: Python<'_>) -> PyResult<Vec<(usize, String)>> {
        let taken = self.with(py, "take_evicted", |ob| Ok(ob.take_evicted()))?;
        Ok(taken
            .into_iter()
            .map(|(c, peer)| {
                let addr = peer.rsplit(' ').next().unwrap_or(&peer).to_owned();
                (c, addr)
            })
            .collect())
    }

    /// The seq the next element of each channel takes, as of the last completed call.
    /// Never blocks, even while another thread is in `emit`.
    #[getter]
    fn next_seqs(&self) -> Vec<u64> {
        self.seqs.lock().clone()
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

/// A downstream replica: an address to dial, or an inbox of this process.
enum Target {
    Remote(String),
    Local(Handle<CoreInbox>),
}

impl Target {
    fn describe(&self) -> String {
        match self {
            Target::Remote(addr) => addr.clone(),
            Target::Local(inbox) => inbox.lock().as_ref().map_or_else(
                || "a closed inbox of this process".to_owned(),
                |ib| format!("{} (in this process)", ib.local_addr()),
            ),
        }
    }
}

/// Link every downstream replica: the local ones directly, the remote ones dialled in
/// parallel. A replica that cannot be reached is logged and left out; a channel none of
/// whose replicas can be reached fails with the last error (so a wrong secret surfaces as
/// an authentication error).
fn dial_all(
    targets: &[Vec<Target>],
    me: &Identity,
    tag: Option<&ReplicaTag>,
    secret: &[u8],
    cfg: &LinkConfig,
) -> tandem_core::Result<Vec<Vec<Box<dyn Link>>>> {
    /// A link being dialled on its own thread, or one made at once (a local inbox).
    enum Pending<'s> {
        Dialing(std::thread::ScopedJoinHandle<'s, tandem_core::Result<Box<dyn Link>>>),
        Made(tandem_core::Result<Box<dyn Link>>),
    }
    let results: Vec<Vec<tandem_core::Result<Box<dyn Link>>>> = std::thread::scope(|s| {
        let pending: Vec<Vec<Pending<'_>>> = targets
            .iter()
            .map(|ch| {
                ch.iter()
                    .map(|t| match t {
                        Target::Remote(a) => Pending::Dialing(s.spawn(move || {
                            TcpLink::connect(a, me, secret, cfg)
                                .map(|l| Box::new(l) as Box<dyn Link>)
                        })),
                        Target::Local(inbox) => Pending::Made(match inbox.lock().as_ref() {
                            Some(ib) => ib.local_link(me).map(|l| Box::new(l) as Box<dyn Link>),
                            None => Err(Error::Closed(
                                "the downstream inbox in this process is closed".to_owned(),
                            )),
                        }),
                    })
                    .collect()
            })
            .collect();
        pending
            .into_iter()
            .map(|ch| {
                ch.into_iter()
                    .map(|p| match p {
                        Pending::Dialing(h) => h.join().unwrap_or_else(|_| {
                            Err(Error::Closed("the dialing thread panicked".to_owned()))
                        }),
                        Pending::Made(link) => link,
                    })
                    .collect()
            })
            .collect()
    });
    let mut links = Vec::with_capacity(results.len());
    for (c, ch) in results.into_iter().enumerate() {
        let mut live: Vec<Box<dyn Link>> = Vec::new();
        let mut last_err = None;
        for (r, res) in ch.into_iter().enumerate() {
            match res {
                Ok(link) => live.push(link),
                // A local inbox that does not read from this partition is a wiring bug.
                Err(e @ Error::Config(_)) if matches!(targets[c][r], Target::Local(_)) => {
                    return Err(e)
                }
                Err(e) => {
                    let who = tag.map_or_else(
                        || {
                            format!(
                                "task {} partition {} replica {}",
                                me.task, me.partition, me.replica
                            )
                        },
                        |t| t.name.clone(),
                    );
                    log::warn!(
                        target: OUTBOX,
                        task = me.task, partition = me.partition, replica = me.replica;
                        "{who}: skipping downstream replica {} of output channel {c}, which \
                         cannot be reached: {e}; the other replicas of that partition receive \
                         its output",
                        targets[c][r].describe()
                    );
                    last_err = Some(e);
                }
            }
        }
        if live.is_empty() {
            return Err(match last_err {
                Some(Error::Handshake(m)) => Error::Handshake(m),
                Some(e) => Error::Closed(format!(
                    "no replica of downstream channel {c} ({}) is reachable: {e}",
                    targets[c]
                        .iter()
                        .map(Target::describe)
                        .collect::<Vec<_>>()
                        .join(", ")
                )),
                None => Error::Config(format!("downstream channel {c} has no replica")),
            });
        }
        links.push(live);
    }
    Ok(links)
}
