//! A worker: one OS process — the fault domain — hosting many task replicas ("slots"), all
//! served by one thread. The worker owns the control path, so the host language is woken
//! only for work that runs user code.
//!
//! ```text
//!            ┌───────────────────────── Worker::next() ─────────────────────────┐
//! inboxes ──►│ heartbeat: per-slot watermark (min over input channels); when it   │
//! (one shared│   advances, forward heartbeat k on the slot's outboxes — or, for   │
//!  doorbell) │   an operator that uses watermarks, hand `Watermark(k)` out first   │
//!            │ source clocks: heartbeat k at t0 + k·heartbeat, once allowed        │──► Work
//!            │ data / end / failure: handed out                                    │
//!            └──────────────────────────────────────────────────────────────────┘
//! ```
//!
//! The caller runs what `next` hands out to completion (the operator on the batch, its
//! output emitted on the slot's outboxes) before calling `next` again; that is what keeps
//! every slot's output in its input order: heartbeat `k` leaves after every row that came
//! before it, and after the output of `on_watermark(k)`.
//!
//! **No blocking between slots of one thread.** A slot whose downstream links hold
//! [`CREDIT_FRAMES`] frames or more is not served (neither its input nor its clock) until
//! they drain: its sends then never block on a full queue, so one slot cannot wait for a
//! downstream slot that the same thread would have to run. The DAG has a most-downstream
//! slot with input, which can always run, so the worker always makes progress.
//!
//! Sources have no inbox. Their rows come from the caller, who follows the source's
//! logical schedule; the worker sends their heartbeats at `t0 + k·heartbeat_ns` (wall
//! clock, nanoseconds since the Unix epoch), but only through the epoch the caller
//! allowed — the last heartbeat before the next batch of rows still to be emitted — so a
//! heartbeat never overtakes a row that precedes it in the schedule. A source whose
//! heartbeats come from its input (markers in a log) is allowed exactly the heartbeats
//! the caller sends itself with [`Worker::heartbeats_through`], so its clock never sends
//! one; the caller, which reads that input on another thread, brings a waiting `next`
//! back early through a [`Waker`].

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use arrow_array::RecordBatch;
use parking_lot::Mutex;

use crate::inbox::{Inbox, InboxCut};
use crate::outbox::{Outbox, OutboxCut};
use crate::reactor::Reactor;
use crate::sync::Doorbell;
use crate::{Delivery, Error, Result};

/// An inbox or outbox shared between the worker and its host-language wrapper; `None`
/// once closed.
pub type Handle<T> = Arc<Mutex<Option<T>>>;

/// A slot whose links have this many frames queued is not served until they drain. Links
/// queue up to 256 frames before `send` blocks, so one serving may emit up to the rest
/// without blocking.
pub const CREDIT_FRAMES: usize = 64;

/// How long the worker sleeps at most while some slot waits for its links to drain (the
/// writers do not ring the doorbell; this is a poll, taken only under back-pressure).
const CREDIT_POLL: Duration = Duration::from_millis(1);

/// When a source's heartbeats fall due.
#[derive(Debug, Clone, Copy)]
pub struct SourceClock {
    /// Logical time zero, in nanoseconds since the Unix epoch.
    pub t0_ns: i64,
    /// Heartbeat `k` is due at `t0_ns + k·heartbeat_ns`.
    pub heartbeat_ns: u64,
}

/// What a slot is.
pub struct SlotConfig {
    /// Operators and sinks; None for a source.
    pub inbox: Option<Handle<Inbox>>,
    /// Where the slot's output goes (empty for a sink).
    pub outboxes: Vec<Handle<Outbox>>,
    /// Hand watermark advances out ([`Work::Watermark`]) before forwarding the heartbeat:
    /// the operator has an `on_watermark` that may emit.
    pub watermarks: bool,
    /// Sources: when heartbeats are due.
    pub clock: Option<SourceClock>,
    /// A replica rebuilt from a twin: continue from the twin's cut (its inbox was bound
    /// with [`SlotCut::inbox`] already; the outboxes must not have sent anything).
    pub resume: Option<SlotCut>,
}

/// A slot's state at a heartbeat-cycle boundary: right after the worker forwarded (or, for
/// a source, sent) heartbeat `epoch`, before anything later was handed out. With the
/// operator's own state (taken by the caller before it runs anything else of the slot),
/// it is what a replica rebuilt from this one starts from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotCut {
    pub epoch: u64,
    /// Per input channel, the highest heartbeat epoch it delivered.
    pub epochs: Vec<u64>,
    /// None for a source.
    pub inbox: Option<InboxCut>,
    pub outboxes: Vec<OutboxCut>,
}

/// What the caller must do next.
pub enum Work {
    /// Run slot `slot`'s operator (or sink) on `batch`, from input channel `channel`.
    Data {
        slot: usize,
        channel: usize,
        first_seq: u64,
        batch: RecordBatch,
    },
    /// Every input of `slot` passed heartbeat `epoch`: run its `on_watermark` and emit the
    /// output; the worker forwards heartbeat `epoch` on the next call.
    Watermark { slot: usize, epoch: u64 },
    /// Every input of `slot` ended: finish it (final output, end marker). The worker no
    /// longer serves it.
    End { slot: usize },
    /// `slot` failed (a divergence detected in its input, a lost downstream channel); the
    /// worker no longer serves it.
    Failed { slot: usize, error: Error },
    /// `slot` reached the heartbeat-cycle boundary a cut was asked for
    /// ([`Worker::request_cut`]; `at`: [`Worker::request_cut_at`] with that epoch): take
    /// the operator's state now, before anything else of the slot runs. None: the slot
    /// cannot be cut (it finished, or — `at` — it had already forwarded heartbeat `at`
    /// when asked, or its merge held part of a batch there).
    Cut {
        slot: usize,
        cut: Option<SlotCut>,
        at: Option<u64>,
    },
}

struct Slot {
    cfg: SlotConfig,
    /// Per input channel, the highest heartbeat epoch delivered.
    epochs: Vec<u64>,
    /// The minimum of `epochs`: the slot's watermark, as a heartbeat epoch.
    current: u64,
    /// Heartbeats forwarded on the outboxes (sources: sent).
    forwarded: u64,
    /// A watermark handed out whose heartbeat is forwarded on the next call.
    handed: Option<u64>,
    /// Sources: heartbeats may be sent through this epoch.
    allowed: u64,
    active: bool,
    /// A cut was asked for: take it at the next heartbeat forwarded.
    cut_asked: bool,
    /// A cut taken and not yet handed out (`Some(None)`: the slot cannot be cut).
    cut: Option<Option<SlotCut>>,
    /// An aligned cut was asked for at this epoch ([`Worker::request_cut_at`]): take it as
    /// `forwarded` first reaches it.
    cut_at: Option<u64>,
    /// An aligned cut taken (or refused) and not yet handed out: `(epoch asked, cut)`.
    aligned: Option<(u64, Option<SlotCut>)>,
    /// Held by the caller ([`Worker::hold`]): nothing of the slot runs, its input waits.
    held: bool,
}

impl Slot {
    /// Move what the links to replicas of this worker hold along (see
    /// [`crate::link::LocalLink`]); the largest backlog left over every link.
    fn flush(&self) -> usize {
        let mut most = 0;
        for o in &self.cfg.outboxes {
            if let Some(ob) = o.lock().as_mut() {
                ob.flush();
                most = most.max(ob.backlog());
            }
        }
        most
    }

    /// Send heartbeats `forwarded + 1 ..= epoch` on every outbox; how many were sent.
    /// Takes the cut asked for, if any, once they are out; an aligned cut at `k`
    /// ([`Worker::request_cut_at`]) right after heartbeat `k` itself, before the later
    /// ones of the same call: its outboxes' sequence numbers must be those of `k`, where
    /// every consumer's cut at `k` stands.
    fn forward_through(&mut self, epoch: u64) -> Result<u64> {
        let from = self.forwarded;
        while self.forwarded < epoch {
            let k = self.forwarded + 1;
            for o in &self.cfg.outboxes {
                if let Some(ob) = o.lock().as_mut() {
                    if !ob.is_ended() {
                        ob.heartbeat(k)?;
                    }
                }
            }
            self.forwarded = k;
            if self.cut_at == Some(k) {
                self.cut_at = None;
                self.aligned = Some((k, self.take_cut().cut()));
                self.align(None);
            }
        }
        if self.forwarded > from && self.cut_asked {
            match self.take_cut() {
                // KaZoo: an order's bound fell inside a batch, part of which the merge
                // holds; the next boundary will do.
                Taken::NotHere => {}
                taken => {
                    self.cut_asked = false;
                    self.cut = Some(taken.cut());
                }
            }
        }
        Ok(self.forwarded - from)
    }

    /// Have the inbox's merge hold every channel at heartbeat `epoch` for an aligned cut
    /// there (None: let them go on), see [`crate::consume::Merge::align_at`].
    fn align(&self, epoch: Option<u64>) {
        if let Some(h) = &self.cfg.inbox {
            if let Some(ib) = h.lock().as_mut() {
                match epoch {
                    Some(k) => ib.align_at(k),
                    None => ib.release(),
                }
            }
        }
    }

    /// A cut taken and not yet handed out, if any (the next-boundary one first).
    fn take_ready(&mut self, idx: usize) -> Option<Work> {
        if let Some(cut) = self.cut.take() {
            return Some(Work::Cut {
                slot: idx,
                cut,
                at: None,
            });
        }
        let (k, cut) = self.aligned.take()?;
        Some(Work::Cut {
            slot: idx,
            cut,
            at: Some(k),
        })
    }

    /// This slot's cut, right after heartbeat `forwarded` (see [`SlotCut`]).
    fn take_cut(&self) -> Taken {
        let inbox = match &self.cfg.inbox {
            Some(h) => match h.lock().as_ref() {
                None => return Taken::Closed,
                Some(ib) => match ib.cut() {
                    None => return Taken::NotHere,
                    cut => cut,
                },
            },
            None => None,
        };
        let mut outboxes = Vec::with_capacity(self.cfg.outboxes.len());
        for o in &self.cfg.outboxes {
            match o.lock().as_ref() {
                Some(ob) => outboxes.push(ob.cut()),
                None => return Taken::Closed,
            }
        }
        Taken::Cut(Box::new(SlotCut {
            epoch: self.forwarded,
            epochs: self.epochs.clone(),
            inbox,
            outboxes,
        }))
    }
}

/// What [`Slot::take_cut`] found.
enum Taken {
    Cut(Box<SlotCut>),
    /// The merge cannot be cut at this boundary (see [`crate::merge::Merge::cut`]).
    NotHere,
    /// The inbox or an outbox is closed: the slot is going.
    Closed,
}

impl Taken {
    /// The cut, or None (the slot cannot be cut here).
    fn cut(self) -> Option<SlotCut> {
        match self {
            Taken::Cut(c) => Some(*c),
            Taken::NotHere | Taken::Closed => None,
        }
    }
}

/// Counters of a worker.
#[derive(Debug, Clone, Default)]
pub struct WorkerStats {
    /// Heartbeats forwarded (or, for sources, sent) without waking the caller.
    pub heartbeats: u64,
    /// Work items handed out, by kind.
    pub data: u64,
    pub watermarks: u64,
    /// Times a slot was passed over because its links were backed up.
    pub credit_waits: u64,
}

/// Where one slot stands, for monitoring ([`Worker::slot_stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotStats {
    /// The last heartbeat epoch the slot forwarded (a source: sent): its watermark.
    pub watermark: u64,
    /// Frames queued on its output links (per channel the most backed-up link, or the
    /// least one when stragglers may be dropped; the largest over the channels).
    pub backlog: usize,
    /// Still served.
    pub active: bool,
}

/// Brings a [`Worker::next`] waiting on another thread back early, without taking the
/// worker's lock: for input that does not come through an inbox (a source reading a log
/// on a thread of its own).
#[derive(Clone)]
pub struct Waker {
    bell: Arc<Doorbell>,
    woken: Arc<AtomicBool>,
}

impl Waker {
    /// Make the current or next [`Worker::next`] return `Ok(None)` once no slot has work.
    pub fn wake(&self) {
        self.woken.store(true, Ordering::SeqCst);
        self.bell.ring();
    }
}

/// See the module documentation.
pub struct Worker {
    bell: Arc<Doorbell>,
    /// Reads the connections of every inbox of this worker (started with the first).
    reactor: Arc<Reactor>,
    slots: Vec<Slot>,
    /// The slot served first on the next call (round robin).
    cursor: usize,
    stats: WorkerStats,
    /// Set by a [`Waker`]; taken by `next`.
    woken: Arc<AtomicBool>,
    /// Whether the last `next` that returned `Ok(None)` did so because it was woken.
    was_woken: bool,
}

impl Default for Worker {
    fn default() -> Self {
        Self::new()
    }
}

/// Now, in nanoseconds since the Unix epoch.
pub fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}

impl Worker {
    pub fn new() -> Self {
        Worker {
            bell: Arc::new(Doorbell::new()),
            reactor: Arc::new(Reactor::new()),
            slots: Vec::new(),
            cursor: 0,
            stats: WorkerStats::default(),
            woken: Arc::new(AtomicBool::new(false)),
            was_woken: false,
        }
    }

    /// A handle that brings a waiting [`Worker::next`] back early, from any thread.
    pub fn waker(&self) -> Waker {
        Waker {
            bell: Arc::clone(&self.bell),
            woken: Arc::clone(&self.woken),
        }
    }

    /// Whether the last [`Worker::next`] that returned `Ok(None)` was woken by a
    /// [`Waker`] (rather than reaching its deadline).
    pub fn was_woken(&self) -> bool {
        self.was_woken
    }

    /// The doorbell every inbox of this worker must ring
    /// ([`crate::inbox::InboxConfig::bell`]).
    pub fn bell(&self) -> Arc<Doorbell> {
        Arc::clone(&self.bell)
    }

    /// The reactor every inbox of this worker should be read by
    /// ([`crate::inbox::InboxConfig::reactor`]): one thread for all their connections.
    pub fn reactor(&self) -> Arc<Reactor> {
        Arc::clone(&self.reactor)
    }

    /// Add a slot; returns its index.
    pub fn add_slot(&mut self, cfg: SlotConfig) -> Result<usize> {
        if cfg.clock.is_some() == cfg.inbox.is_some() {
            return Err(Error::Config(
                "a slot has either an inbox (operator, sink) or a source clock, not both or \
                 neither"
                    .to_owned(),
            ));
        }
        if cfg.clock.is_some_and(|c| c.heartbeat_ns == 0) {
            return Err(Error::Config("heartbeat_ns must be ≥ 1".to_owned()));
        }
        let channels = match &cfg.inbox {
            Some(h) => {
                let ib = h.lock();
                let ib = ib
                    .as_ref()
                    .ok_or_else(|| Error::Closed("add_slot() with a closed inbox".to_owned()))?;
                if ib.parked() {
                    return Err(Error::Config(
                        "add_slot() with a parked inbox: unpark it with its cut first".to_owned(),
                    ));
                }
                ib.channels()
            }
            None => 0,
        };
        let (epochs, forwarded) = match &cfg.resume {
            None => (vec![0; channels], 0),
            Some(cut) => {
                if cut.epochs.len() != channels || cut.outboxes.len() != cfg.outboxes.len() {
                    return Err(Error::Config(format!(
                        "a cut of {} input channels and {} outputs cannot resume a slot of {} \
                         and {}",
                        cut.epochs.len(),
                        cut.outboxes.len(),
                        channels,
                        cfg.outboxes.len()
                    )));
                }
                for (o, oc) in cfg.outboxes.iter().zip(&cut.outboxes) {
                    if let Some(ob) = o.lock().as_mut() {
                        ob.resume(oc, cut.epoch)?;
                    }
                }
                (cut.epochs.clone(), cut.epoch)
            }
        };
        for o in &cfg.outboxes {
            if let Some(ob) = o.lock().as_mut() {
                ob.defer_writes(true);
            }
        }
        let current = if channels == 0 {
            forwarded
        } else {
            epochs.iter().copied().min().unwrap_or(0)
        };
        self.slots.push(Slot {
            cfg,
            epochs,
            current,
            forwarded,
            handed: None,
            allowed: forwarded,
            active: true,
            cut_asked: false,
            cut: None,
            cut_at: None,
            aligned: None,
            held: false,
        });
        self.bell.ring();
        Ok(self.slots.len() - 1)
    }

    fn slot(&mut self, slot: usize) -> Result<&mut Slot> {
        let n = self.slots.len();
        self.slots
            .get_mut(slot)
            .ok_or_else(|| Error::Config(format!("no slot {slot} (the worker has {n})")))
    }

    /// A source slot may send its heartbeats through `epoch`, each when it falls due.
    pub fn allow(&mut self, slot: usize, epoch: u64) -> Result<()> {
        let s = self.slot(slot)?;
        s.allowed = s.allowed.max(epoch);
        self.bell.ring();
        Ok(())
    }

    /// Send a source slot's heartbeats through `epoch` now, due or not (the caller is
    /// about to emit rows that follow them in the schedule).
    pub fn heartbeats_through(&mut self, slot: usize, epoch: u64) -> Result<()> {
        let s = self.slot(slot)?;
        s.allowed = s.allowed.max(epoch);
        let sent = s.forward_through(epoch)?;
        self.stats.heartbeats += sent;
        Ok(())
    }

    /// Take a cut of `slot` at its next heartbeat-cycle boundary: [`Worker::next`] hands
    /// it out as [`Work::Cut`] right after the heartbeat leaves (KaZoo: at a later one if
    /// the merge holds part of a batch there, see [`crate::merge::Merge::cut`]). A slot that is not
    /// served any more (it finished) hands out `cut: None` at once.
    pub fn request_cut(&mut self, slot: usize) -> Result<()> {
        let s = self.slot(slot)?;
        if s.active {
            s.cut_asked = true;
        } else {
            s.cut = Some(None);
        }
        self.bell.ring();
        Ok(())
    }

    /// Take a cut of `slot` right after it forwards heartbeat `epoch` (a source: sends it):
    /// an *aligned* cut, the same epoch on every slot of the job, for a checkpoint.
    /// [`Worker::next`] hands it out as [`Work::Cut`] with `at: Some(epoch)`. A slot that
    /// forwards several heartbeats in one go (nothing comes between them) is cut after the
    /// last of them: its state there is its state right after `epoch`, and the cut's own
    /// epoch is that last one. A slot that already forwarded `epoch`, or is not served any
    /// more, hands out `cut: None` at once (too late: the caller abandons that checkpoint).
    /// A newer request replaces one not yet taken.
    pub fn request_cut_at(&mut self, slot: usize, epoch: u64) -> Result<()> {
        let s = self.slot(slot)?;
        if s.active && s.forwarded < epoch {
            s.cut_at = Some(epoch);
            s.align(Some(epoch));
        } else {
            s.cut_at = None;
            s.align(None);
            s.aligned = Some((epoch, None));
        }
        self.bell.ring();
        Ok(())
    }

    /// Hold `slot` where it stands (`on`), or let it go on: while held, [`Worker::next`]
    /// hands out nothing of it — no input, no heartbeat, no watermark — and its input
    /// waits in its inbox (its upstream replicas feel the back-pressure once that is
    /// full). The caller holds a slot cut for a rebuild until the other slots asked for
    /// in the same rebuild are cut too, so that one fork copies every state.
    pub fn hold(&mut self, slot: usize, on: bool) -> Result<()> {
        let s = self.slot(slot)?;
        s.held = on;
        self.bell.ring();
        Ok(())
    }

    /// Give `slot`'s inbox a channel for each of `upstreams`, new partitions of an upstream
    /// task that start after heartbeat `after_epoch` (a live rescale; see
    /// [`Inbox::join_channels`]). They count as having delivered `after_epoch`, so the
    /// slot's watermark waits for the other channels only until then. Returns the new
    /// channels' indices.
    pub fn join_inputs(
        &mut self,
        slot: usize,
        upstreams: &[(u32, u32)],
        after_epoch: u64,
    ) -> Result<Range<usize>> {
        let s = self.slot(slot)?;
        let Some(h) = &s.cfg.inbox else {
            return Err(Error::Config(format!(
                "slot {slot} is a source: it has no inputs to join"
            )));
        };
        let joined = h
            .lock()
            .as_mut()
            .ok_or_else(|| Error::Closed("join_inputs() with a closed inbox".to_owned()))?
            .join_channels(upstreams, after_epoch)?;
        s.epochs.resize(joined.end, after_epoch);
        self.bell.ring();
        Ok(joined)
    }

    /// Take back the channels the last [`Worker::join_inputs`] of `slot` gave it (a live
    /// rescale given up before its switch; see [`Inbox::cancel_join`]).
    pub fn cancel_join(&mut self, slot: usize) -> Result<()> {
        let s = self.slot(slot)?;
        let Some(h) = &s.cfg.inbox else {
            return Err(Error::Config(format!("slot {slot} is a source")));
        };
        let mut ib = h.lock();
        let ib = ib
            .as_mut()
            .ok_or_else(|| Error::Closed("cancel_join() with a closed inbox".to_owned()))?;
        ib.cancel_join()?;
        s.epochs.truncate(ib.channels());
        Ok(())
    }

    /// Whether `slot`'s links have room: a source emits only then.
    pub fn ready(&self, slot: usize) -> bool {
        self.slots
            .get(slot)
            .is_some_and(|s| s.flush() < CREDIT_FRAMES)
    }

    /// Stop serving `slot` (it finished or was abandoned by the caller), and stop its
    /// inbox receiving (its counters stay readable): what its upstream replicas still send
    /// it would never be taken, so their links to it fail now, as they would to a closed
    /// process, and they stop waiting for it — a replica whose every downstream replica is
    /// gone is abandoned in turn.
    pub fn retire(&mut self, slot: usize) -> Result<()> {
        let s = self.slot(slot)?;
        s.active = false;
        if let Some(h) = &s.cfg.inbox {
            if let Some(ib) = h.lock().as_mut() {
                ib.close();
            }
        }
        Ok(())
    }

    pub fn stats(&self) -> WorkerStats {
        self.stats.clone()
    }

    /// Every slot's watermark and output backlog, in slot order. Reads only: nothing is
    /// moved along or sent.
    pub fn slot_stats(&self) -> Vec<SlotStats> {
        self.slots
            .iter()
            .map(|s| SlotStats {
                watermark: s.forwarded,
                backlog: s
                    .cfg
                    .outboxes
                    .iter()
                    .filter_map(|o| o.lock().as_ref().map(Outbox::backlog))
                    .max()
                    .unwrap_or(0),
                active: s.active,
            })
            .collect()
    }

    /// The next work item, waiting until `deadline` (None: without limit) while there is
    /// none; meanwhile heartbeats are tracked and forwarded. `Ok(None)` at the deadline, or
    /// before it when a [`Waker`] woke the worker and no slot has work
    /// ([`Worker::was_woken`] tells which).
    pub fn next(&mut self, deadline: Option<Instant>) -> Result<Option<Work>> {
        self.was_woken = false;
        loop {
            let seen = self.bell.generation();
            let mut wake: Option<Instant> = None;
            let n = self.slots.len();
            for i in 0..n {
                let idx = (self.cursor + i) % n;
                match self.serve(idx, &mut wake) {
                    Some(w) => {
                        self.cursor = (idx + 1) % n;
                        self.push();
                        return Ok(Some(w));
                    }
                    None => continue,
                }
            }
            self.push();
            // A wake after this check rings the bell, so the wait below returns at once.
            if self.woken.swap(false, Ordering::SeqCst) {
                self.was_woken = true;
                return Ok(None);
            }
            let now = Instant::now();
            let until = match (deadline, wake) {
                (Some(d), Some(w)) => d.min(w),
                (Some(d), None) => d,
                (None, Some(w)) => w,
                (None, None) => now + Duration::from_secs(3600),
            };
            if deadline.is_some_and(|d| d <= now) {
                return Ok(None);
            }
            if until > now {
                self.bell.wait(seen, until - now);
            }
        }
    }

    /// Write out what the slots' links hold back ([`Outbox::defer_writes`]): before the
    /// caller runs anything, and before the worker sleeps.
    fn push(&self) {
        for s in &self.slots {
            for o in &s.cfg.outboxes {
                if let Some(ob) = o.lock().as_mut() {
                    ob.push();
                }
            }
        }
    }

    /// Serve slot `idx` until it has work for the caller or nothing to do now; lowers
    /// `wake` to when it next needs attention without input.
    fn serve(&mut self, idx: usize, wake: &mut Option<Instant>) -> Option<Work> {
        let stats = &mut self.stats;
        let s = &mut self.slots[idx];
        // Links to replicas of this worker hold what their inboxes had no room for; move it
        // along whenever the worker looks, even for a slot that finished (its end marker may
        // be among it).
        let backlog = s.flush();
        if backlog > 0 {
            let poll = Instant::now() + CREDIT_POLL;
            *wake = Some(wake.map_or(poll, |w| w.min(poll)));
        }
        if let Some(w) = s.take_ready(idx) {
            return Some(w);
        }
        if !s.active || s.held {
            return None;
        }
        // The heartbeat of a watermark handed out last time follows its output.
        if let Some(k) = s.handed.take() {
            if let Err(error) = s.forward_through(k) {
                s.active = false;
                return Some(Work::Failed { slot: idx, error });
            }
            if let Some(w) = s.take_ready(idx) {
                return Some(w);
            }
        }
        if backlog >= CREDIT_FRAMES {
            stats.credit_waits += 1;
            return None;
        }
        if let Some(clock) = s.cfg.clock {
            // Heartbeat k is due at t0 + k·period: send those due by now, as far as allowed.
            let now = now_ns();
            let elapsed = u64::try_from(now.saturating_sub(clock.t0_ns)).unwrap_or(0);
            match s.forward_through((elapsed / clock.heartbeat_ns).min(s.allowed)) {
                Ok(sent) => stats.heartbeats += sent,
                Err(error) => {
                    s.active = false;
                    return Some(Work::Failed { slot: idx, error });
                }
            }
            if let Some(w) = s.take_ready(idx) {
                return Some(w);
            }
            if s.forwarded < s.allowed {
                let next = (s.forwarded + 1).saturating_mul(clock.heartbeat_ns);
                let due = clock
                    .t0_ns
                    .saturating_add(i64::try_from(next).unwrap_or(i64::MAX));
                let left = u64::try_from(due.saturating_sub(now)).unwrap_or(0);
                let at = Instant::now() + Duration::from_nanos(left);
                *wake = Some(wake.map_or(at, |w| w.min(at)));
            }
            return None;
        }
        loop {
            // Watermarks still to hand out come before any later input.
            if s.cfg.watermarks && s.forwarded < s.current {
                let k = s.forwarded + 1;
                s.handed = Some(k);
                stats.watermarks += 1;
                return Some(Work::Watermark {
                    slot: idx,
                    epoch: k,
                });
            }
            let got = {
                let inbox = s.cfg.inbox.as_ref()?;
                let mut guard = inbox.lock();
                match guard.as_mut() {
                    Some(ib) => ib.next(Duration::ZERO),
                    None => Err(Error::Closed("the slot's inbox was closed".to_owned())),
                }
            };
            match got {
                Ok(None) => return None,
                Ok(Some(Delivery::Data {
                    channel,
                    first_seq,
                    payload,
                })) => {
                    stats.data += 1;
                    return Some(Work::Data {
                        slot: idx,
                        channel,
                        first_seq,
                        batch: payload,
                    });
                }
                Ok(Some(Delivery::Heartbeat { channel, epoch, .. })) => {
                    if let Some(e) = s.epochs.get_mut(channel) {
                        *e = (*e).max(epoch);
                    }
                    let low = s.epochs.iter().copied().min().unwrap_or(0);
                    if low > s.current {
                        s.current = low;
                    }
                    if !s.cfg.watermarks {
                        match s.forward_through(s.current) {
                            Ok(sent) => stats.heartbeats += sent,
                            Err(error) => {
                                s.active = false;
                                return Some(Work::Failed { slot: idx, error });
                            }
                        }
                        if let Some(w) = s.take_ready(idx) {
                            return Some(w);
                        }
                    }
                }
                Ok(Some(Delivery::End)) => {
                    s.active = false;
                    return Some(Work::End { slot: idx });
                }
                Err(error) => {
                    s.active = false;
                    return Some(Work::Failed { slot: idx, error });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_waker_brings_a_waiting_next_back_early_and_only_once() {
        let mut worker = Worker::new();
        let waker = worker.waker();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            waker.wake();
        });
        let began = Instant::now();
        let got = worker.next(Some(began + Duration::from_secs(10))).unwrap();
        assert!(got.is_none());
        assert!(worker.was_woken());
        assert!(
            began.elapsed() < Duration::from_secs(5),
            "the wake was missed"
        );
        t.join().unwrap();
        // The wake is taken: the next call waits for its deadline.
        let began = Instant::now();
        assert!(worker
            .next(Some(began + Duration::from_millis(30)))
            .unwrap()
            .is_none());
        assert!(!worker.was_woken());
        assert!(began.elapsed() >= Duration::from_millis(30));
    }

    #[test]
    fn a_wake_before_next_is_not_lost() {
        let mut worker = Worker::new();
        worker.waker().wake();
        let began = Instant::now();
        assert!(worker
            .next(Some(began + Duration::from_secs(10)))
            .unwrap()
            .is_none());
        assert!(worker.was_woken());
        assert!(began.elapsed() < Duration::from_secs(5));
    }

    /// A link that takes every frame and keeps nothing.
    struct Sink;

    impl crate::outbox::Link for Sink {
        fn send(&mut self, _frame: &crate::outbox::OutFrame) -> Result<()> {
            Ok(())
        }
        fn wants_bytes(&self) -> bool {
            false
        }
    }

    /// A worker with one source slot whose heartbeats are all due (t0 an hour ago), sent
    /// only as far as `allow` lets them.
    fn source_worker() -> (Worker, usize) {
        let outbox = Outbox::new(
            crate::outbox::Partitioner::Forward,
            vec![vec![Box::new(Sink) as Box<dyn crate::outbox::Link>]],
            crate::outbox::OutboxConfig::default(),
        )
        .unwrap();
        let mut worker = Worker::new();
        let slot = worker
            .add_slot(SlotConfig {
                inbox: None,
                outboxes: vec![Arc::new(Mutex::new(Some(outbox)))],
                watermarks: false,
                clock: Some(SourceClock {
                    t0_ns: now_ns() - 3_600_000_000_000,
                    heartbeat_ns: 1_000_000,
                }),
                resume: None,
            })
            .unwrap();
        (worker, slot)
    }

    /// The work items `next` hands out until it has none (a short deadline).
    fn drain(worker: &mut Worker) -> Vec<Work> {
        let mut out = Vec::new();
        while let Some(w) = worker
            .next(Some(Instant::now() + Duration::from_millis(20)))
            .unwrap()
        {
            out.push(w);
        }
        out
    }

    fn cuts(items: &[Work]) -> Vec<(Option<u64>, Option<u64>)> {
        items
            .iter()
            .filter_map(|w| match w {
                Work::Cut { cut, at, .. } => Some((*at, cut.as_ref().map(|c| c.epoch))),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn an_aligned_cut_is_taken_as_the_slot_first_forwards_its_epoch() {
        let (mut worker, slot) = source_worker();
        worker.request_cut_at(slot, 5).unwrap();
        worker.allow(slot, 3).unwrap();
        assert!(cuts(&drain(&mut worker)).is_empty(), "cut before epoch 5");
        // Heartbeats 4..=8 leave in one go: the cut is right after 5, before 6..=8 (its
        // outboxes' seqs are those of heartbeat 5, where a consumer's cut at 5 stands).
        worker.allow(slot, 8).unwrap();
        let items = drain(&mut worker);
        assert_eq!(cuts(&items), vec![(Some(5), Some(5))]);
        let seqs: Vec<Vec<u64>> = items
            .iter()
            .filter_map(|w| match w {
                Work::Cut { cut: Some(c), .. } => {
                    Some(c.outboxes.iter().map(|o| o.seqs[0]).collect())
                }
                _ => None,
            })
            .collect();
        assert_eq!(seqs, vec![vec![5]], "five heartbeats sent through the cut");
        // Taken once.
        worker.allow(slot, 12).unwrap();
        assert!(cuts(&drain(&mut worker)).is_empty());
    }

    #[test]
    fn an_aligned_cut_asked_too_late_is_refused_at_once() {
        let (mut worker, slot) = source_worker();
        worker.allow(slot, 6).unwrap();
        drain(&mut worker);
        worker.request_cut_at(slot, 6).unwrap();
        assert_eq!(cuts(&drain(&mut worker)), vec![(Some(6), None)]);
        // A later epoch is still taken, and a finished slot refuses.
        worker.request_cut_at(slot, 7).unwrap();
        worker.allow(slot, 7).unwrap();
        assert_eq!(cuts(&drain(&mut worker)), vec![(Some(7), Some(7))]);
        worker.retire(slot).unwrap();
        worker.request_cut_at(slot, 9).unwrap();
        assert_eq!(cuts(&drain(&mut worker)), vec![(Some(9), None)]);
    }

    #[test]
    fn a_held_slot_runs_nothing_until_it_is_let_go() {
        let (mut worker, slot) = source_worker();
        worker.request_cut(slot).unwrap();
        worker.allow(slot, 2).unwrap();
        assert_eq!(cuts(&drain(&mut worker)), vec![(None, Some(2))]);
        // Held where its cut was taken: no heartbeat leaves, so an aligned cut at 4 is
        // not taken either, however far the slot is allowed.
        worker.hold(slot, true).unwrap();
        worker.request_cut_at(slot, 4).unwrap();
        worker.allow(slot, 6).unwrap();
        assert!(drain(&mut worker).is_empty());
        // Let go, it forwards 3..=6 in one go: the aligned cut follows heartbeat 4.
        worker.hold(slot, false).unwrap();
        assert_eq!(cuts(&drain(&mut worker)), vec![(Some(4), Some(4))]);
    }

    #[test]
    fn an_aligned_cut_and_a_next_boundary_cut_are_handed_out_apart() {
        let (mut worker, slot) = source_worker();
        worker.allow(slot, 2).unwrap();
        drain(&mut worker);
        worker.request_cut(slot).unwrap();
        worker.request_cut_at(slot, 4).unwrap();
        worker.allow(slot, 5).unwrap();
        assert_eq!(
            cuts(&drain(&mut worker)),
            vec![(None, Some(5)), (Some(4), Some(4))]
        );
    }
}
