//! `tandem._core.OrderFeed`, `OrderRouter` and `OrderPublisher`: KaZoo's side of a
//! replica's inbox ([`tandem_core::orderfeed`]) — the order log fed to a `kazoo` inbox, a
//! worker's messages routed to its feeds, the orders of the partitions it leads published.
//! The order log itself is [`crate::orderlog`].
//!
//! Every call that may block or take a lock runs with the GIL released (`py.detach`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use tandem_core::orderfeed::{
    OrderFeed as CoreOrderFeed, OrderPublisher as CoreOrderPublisher, PublishStep,
};
use tandem_core::orderlog::{split_message, Verdict};

use crate::args::{arg_seconds, config_err};
use crate::errors::IntoPyResult;
use crate::orderlog::{stats_dict, verdict_str};

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<OrderFeed>()?;
    m.add_class::<OrderPublisher>()?;
    m.add_class::<OrderRouter>()?;
    Ok(())
}

/// The KaZoo orderer's handle on a `kazoo` inbox (see `Inbox.order_feed`). Every method
/// is safe to call from another thread while the inbox's consumer waits in `next()`.
#[pyclass(frozen, module = "tandem._core")]
pub struct OrderFeed {
    pub(crate) inner: CoreOrderFeed,
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

    /// Should this replica lead, hold its orders right after heartbeat `epoch` on every
    /// input channel until every channel is ordered through it: a twin following the
    /// log is cut there for a savepoint while this replica orders on.
    fn hold_at(&self, epoch: u64) {
        self.inner.hold_at(epoch);
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
