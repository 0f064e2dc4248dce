//! The sending side of a task partition: partitioner, per-output-channel sequence numbers,
//! frame boundaries and cycle digests (DESIGN §2 invariants 1 and 4, §5 knob `batch_rows`).
//!
//! An output *channel* is one downstream partition. Every element put on a channel — each
//! data row, each heartbeat, the end marker — takes the channel's next `u64` sequence
//! number, in emit order.
//!
//! The batch is the unit of determinism: [`Outbox::emit`] sends its part of an operator's
//! output batch on each channel at once, as frames of at most `batch_rows` rows cut at
//! offsets `0, batch_rows, 2·batch_rows…` of that part. No timer coalesces or splits
//! frames, so two replicas that emit the same batches and heartbeats send byte-identical
//! frames with identical boundaries on every channel; only timing differs.
//!
//! Every channel keeps a [`CycleDigest`] of the Data frames it sent since its last heartbeat.
//! [`Outbox::heartbeat`] closes it and sends it inside the heartbeat frame, so receivers can
//! compare the replicas of this partition cycle by cycle; the digests are also recorded for
//! [`Outbox::take_digests`].
//!
//! Every element goes to every downstream replica of its channel (duplicate sending,
//! DESIGN §2 invariant 2) as one [`OutFrame`]: a replica in this process takes the Arrow
//! batch itself; the others take the frame's bytes, encoded once per channel (and only
//! when some link of the channel writes bytes) and shared by all of them.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type, UInt64Type, UInt8Type,
};
use arrow_array::{Array, ArrayRef, ArrowPrimitiveType, RecordBatch, UInt32Array};
use arrow_schema::DataType;
use log::Level;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::digest::{CycleDigest, Digest};
use crate::item::Item;
use crate::logs::{log_replica, ReplicaTag, OUTBOX};
use crate::wire;
use crate::{Error, Result};

/// Seed of the hash partitioner. Fixed forever: changing it re-routes every key, which
/// would break a job whose replicas run different builds.
pub const HASH_SEED: u64 = 0x7461_6e64_656d_0001; // "tandem" + version 1

/// The channel rows with a null key go to.
pub const NULL_KEY_CHANNEL: usize = 0;

/// Key groups of a hash edge unless the job sets its own (`Job(max_parallelism=...)`):
/// the most partitions a keyed task can be rescaled to.
pub const DEFAULT_KEY_GROUPS: u32 = 128;

/// Key column types the hash partitioner accepts.
pub const HASHABLE_TYPES: &str =
    "Int8/16/32/64, UInt8/16/32/64, Utf8, LargeUtf8, Binary, LargeBinary";

/// Which output channel each row goes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Partitioner {
    /// Every row to channel 0. This is the pointwise connection ("forward"): when the
    /// upstream and downstream tasks have the same partition count, partition `p` feeds only
    /// downstream partition `p`. Choosing that partition is the planner's job — it hands the
    /// outbox the links of that one downstream partition — so `Forward` requires exactly one
    /// output channel and rejects any other count as a configuration error.
    Forward,
    /// Row → its key group `g = xxh3(canonical key bytes, HASH_SEED) % key_groups`, and
    /// key group `g` → channel `g * channels / key_groups`: each channel takes one
    /// contiguous range of key groups, so a keyed task run at another parallelism takes
    /// whole groups of the old partitions' state (Flink's key groups). Deterministic
    /// across processes, runs, machines and builds. Integers of every width hash their
    /// value as a little-endian 8-byte integer (so an `Int32` 7 and an `Int64` 7 go to the
    /// same channel), strings and binaries their bytes; null keys go to
    /// [`NULL_KEY_CHANNEL`].
    Hash { column: String, key_groups: u32 },
    /// Row `i` of this task partition's output (a running counter over every emit) →
    /// channel `i % channels`.
    Rebalance,
    /// Every row to every channel.
    Broadcast,
}

impl Partitioner {
    /// Hash partitioning on `column` over [`DEFAULT_KEY_GROUPS`] key groups.
    pub fn hash(column: &str) -> Self {
        Partitioner::Hash {
            column: column.to_owned(),
            key_groups: DEFAULT_KEY_GROUPS,
        }
    }

    /// This partitioner with `groups` key groups (a hash partitioner; the others have
    /// none and are returned as they are). At least 1.
    pub fn with_key_groups(self, groups: u32) -> Result<Self> {
        match self {
            Partitioner::Hash { column, .. } if groups >= 1 => Ok(Partitioner::Hash {
                column,
                key_groups: groups,
            }),
            Partitioner::Hash { .. } => {
                Err(Error::Config("key_groups must be at least 1".to_owned()))
            }
            other => Ok(other),
        }
    }

    /// Parse the Python-facing name (`"forward"`, `"hash"`, `"rebalance"`, `"broadcast"`).
    /// `key` is required for `"hash"` and rejected otherwise.
    pub fn parse(name: &str, key: Option<&str>) -> Result<Self> {
        match (name, key) {
            ("hash", Some(k)) if !k.is_empty() => Ok(Partitioner::hash(k)),
            ("hash", _) => Err(Error::Config(
                "partitioner 'hash' needs key=<column name> (got no key column)".to_owned(),
            )),
            ("forward" | "rebalance" | "broadcast", Some(k)) => Err(Error::Config(format!(
                "key={k:?} is only meaningful with partitioner 'hash' (got partitioner {name:?})"
            ))),
            ("forward", None) => Ok(Partitioner::Forward),
            ("rebalance", None) => Ok(Partitioner::Rebalance),
            ("broadcast", None) => Ok(Partitioner::Broadcast),
            _ => Err(Error::Config(format!(
                "unknown partitioner {name:?}; use one of 'forward', 'hash', 'rebalance', 'broadcast'"
            ))),
        }
    }
}

/// One element of an output channel as the [`Outbox`] hands it to every [`Link`] of the
/// channel.
#[derive(Debug, Clone)]
pub struct OutFrame {
    /// The element itself (a data frame's rows are a zero-copy slice of the emitted batch).
    pub item: Item<RecordBatch>,
    /// The cycle digest a heartbeat carries (None for data and end).
    pub digest: Option<Digest>,
    /// The element encoded for the wire, shared by every link of the channel; None when no
    /// link of the channel wants bytes ([`Link::wants_bytes`]).
    pub bytes: Option<Arc<[u8]>>,
}

/// Where the frames of one output channel go: one `Link` per downstream replica.
pub trait Link: Send {
    /// Queue one frame for the peer. May block while the peer is slow (bounded queue: that
    /// is the back-pressure). An error means the peer is gone for good: the outbox drops
    /// the link and keeps serving the other replicas.
    fn send(&mut self, frame: &OutFrame) -> Result<()>;

    /// Whether the link writes [`OutFrame::bytes`] (the default) rather than taking the
    /// item itself: the outbox encodes a channel's frames only if one of its links does.
    fn wants_bytes(&self) -> bool {
        true
    }

    /// Move queued frames along without blocking. Called by [`Outbox::flush`]; the default
    /// (a link that queues nothing of its own) does nothing.
    fn flush(&mut self) {}

    /// Whether `send` may hold small frames back until [`Link::push`], to write them
    /// together with those that follow ([`Outbox::defer_writes`]). Off by default; the
    /// default (a link that never holds anything back) ignores it.
    fn defer(&mut self, _on: bool) {}

    /// Write out what `send` held back. An error means the peer is gone, as for `send`.
    /// The default (a link that holds nothing back) does nothing.
    fn push(&mut self) -> Result<()> {
        Ok(())
    }

    /// Deliver what is queued and close the connection. Called by [`Outbox::close`];
    /// the default does nothing.
    fn close(&mut self) -> Result<()> {
        Ok(())
    }

    /// Cut the connection now, dropping whatever is still queued: to the peer this looks
    /// like a crash of this replica. Called by [`Outbox::abort`]; the default does nothing.
    fn abort(&mut self) {}

    /// Frames queued for the peer and not yet written: a worker does not run a replica
    /// whose links are backed up, so that its send never blocks on a downstream replica
    /// the same thread would have to run. The default (an unqueued link) is 0.
    fn backlog(&self) -> usize {
        0
    }

    /// A short description of the peer for log lines and errors.
    fn describe(&self) -> String {
        "link".to_owned()
    }

    /// How long, as of `now`, frames have been waiting for the peer to read (zero when
    /// none are): what makes a downstream replica a straggler ([`Eviction`]). None for a
    /// link that cannot be one — a replica of this worker, run by the same thread (the
    /// default).
    fn backed_up_for(&self, _now: Instant) -> Option<Duration> {
        None
    }

    /// Whether the link failed because the peer closed its end (a downstream replica that
    /// finished on its twins' copies, or one that is gone) rather than for a reason worth
    /// a warning. The outbox logs the first at debug level only. The default is false.
    fn peer_closed(&self) -> bool {
        false
    }

    /// Whether the peer is known to be gone — its link failed, or it closed or reset its
    /// end — before a send finds out: a replica killed a moment ago still shows an empty
    /// queue, and must not count as one that keeps up ([`Eviction`]). Checked only when a
    /// twin lags, so it may cost a system call. The default is [`Link::peer_closed`].
    fn gone(&self) -> bool {
        self.peer_closed()
    }

    /// Whether the peer is a replica rebuilt from a twin that has not yet caught up with
    /// its replay ([`Link::replay`]): what queues meanwhile says it is catching up, not that
    /// it is slow, so it is no straggler by the frame count ([`Eviction`]). As of the last
    /// [`Link::backed_up_for`]. The default (a link that replays nothing) is false.
    fn catching_up(&self) -> bool {
        false
    }

    /// Send what a channel's [`ReplayWindow`] holds to a replica that joined late, before
    /// anything else; every frame has its bytes if the link [`Link::wants_bytes`]. It must
    /// not block the sender for long: a link with a writer thread hands it the whole
    /// replay as one write. The default sends the frames one by one.
    fn replay(&mut self, frames: &[OutFrame]) -> Result<()> {
        frames.iter().try_for_each(|f| self.send(f))
    }
}

/// When an outbox drops a downstream replica that lags behind the other replicas of its
/// channel (a frozen or overloaded process), so that it never holds back this replica and,
/// through it, the twins it also feeds. A link lags once `frames` frames wait for its peer
/// or frames have waited for `after`; it is dropped only while another link of the channel
/// does not lag (a channel whose every replica is slow is back-pressure, and waits). To the
/// dropped replica this looks like a crash of this one. A replica rebuilt from a twin lags
/// by neither rule until it has caught up with its replay or its grace ran out
/// ([`Link::catching_up`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Eviction {
    pub frames: usize,
    pub after: Duration,
}

/// Frame policy of an [`Outbox`].
#[derive(Debug, Clone)]
pub struct OutboxConfig {
    /// Frames never carry more rows than this: a channel's part of an emitted batch leaves
    /// as frames cut at offsets `0, batch_rows, 2·batch_rows…` of that part (the last one
    /// shorter). Must be ≥ 1.
    pub batch_rows: usize,
}

impl Default for OutboxConfig {
    fn default() -> Self {
        OutboxConfig { batch_rows: 1024 }
    }
}

/// How much of each output channel an outbox keeps to replay to a replica rebuilt while the
/// job runs ([`Outbox::add_link`]): whole heartbeat cycles, the most recent `cycles` of
/// them, fewer if they hold more than `bytes` (the current cycle is always kept).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayWindow {
    pub cycles: usize,
    pub bytes: usize,
}

/// The frames one channel keeps for replay.
#[derive(Default)]
struct Replay {
    /// Each frame with its size in bytes (encoded, or its rows' memory).
    frames: VecDeque<(OutFrame, usize)>,
    /// The window holds everything after heartbeat `after` (0: from the first element).
    after: u64,
    heartbeats: usize,
    bytes: usize,
}

impl Replay {
    fn push(&mut self, frame: &OutFrame, size: usize) {
        if matches!(frame.item, Item::Heartbeat { .. }) {
            self.heartbeats += 1;
        }
        self.bytes += size;
        self.frames.push_back((frame.clone(), size));
    }

    /// Drop the oldest whole cycles beyond the window.
    fn trim(&mut self, window: &ReplayWindow) {
        while self.heartbeats > window.cycles.max(1)
            || (self.bytes > window.bytes && self.heartbeats > 1)
        {
            while let Some((frame, size)) = self.frames.pop_front() {
                self.bytes -= size;
                if let Item::Heartbeat { epoch, .. } = frame.item {
                    self.heartbeats -= 1;
                    self.after = epoch;
                    break;
                }
            }
        }
    }

    /// The frames after heartbeat `epoch` — or, if this channel has not sent that one yet,
    /// after the latest it sent; None if the window no longer reaches back to it.
    fn after(&self, epoch: u64) -> Option<Vec<OutFrame>> {
        if epoch < self.after {
            return None;
        }
        let start = self
            .frames
            .iter()
            .rposition(|(f, _)| matches!(f.item, Item::Heartbeat { epoch: e, .. } if e <= epoch))
            .map_or(0, |i| i + 1);
        Some(
            self.frames
                .iter()
                .skip(start)
                .map(|(f, _)| f.clone())
                .collect(),
        )
    }
}

/// Where an outbox stands at a heartbeat-cycle boundary: the seq each channel's next
/// element takes and the rows emitted so far (the `rebalance` partitioner's position). An
/// outbox resumed from it emits what its twin emits after the cut, with the same seqs.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OutboxCut {
    pub seqs: Vec<u64>,
    pub rows_emitted: u64,
}

/// Closed cycle digests kept for [`Outbox::take_digests`] before the oldest are dropped
/// (receivers compare digests online; this record only feeds reports, and must stay
/// bounded when nobody takes it).
pub const DIGESTS_KEPT: usize = 65_536;

/// One output channel: its links, its next seq and the digest of its current cycle.
struct Channel {
    links: Vec<Box<dyn Link>>,
    /// Seq the next element emitted on this channel takes.
    next_seq: u64,
    /// Digest of the Data frames sent since the last heartbeat.
    digest: CycleDigest,
    /// What a replica that joins late is sent first (None: nothing is kept).
    replay: Option<Replay>,
    /// The channel lost its every link and that was logged (a link added revives it).
    bare: bool,
}

/// A change of the channel set armed for heartbeat `epoch` ([`Outbox::switch_at`]).
struct Switch {
    epoch: u64,
    partitioner: Partitioner,
    links: Vec<Vec<Box<dyn Link>>>,
}

/// One Data frame of an emit, encoded (if some link wants bytes) but not yet sent.
struct Outgoing {
    first_seq: u64,
    rows: RecordBatch,
    bytes: Option<Arc<[u8]>>,
}

/// The output side of one task partition replica. See the module documentation.
pub struct Outbox {
    partitioner: Partitioner,
    channels: Vec<Channel>,
    cfg: OutboxConfig,
    /// Rows emitted so far (drives `Rebalance`).
    rows_emitted: u64,
    /// `next_seq` of every channel, kept contiguous for [`Outbox::next_seqs`].
    seqs: Vec<u64>,
    /// Closed digests `(channel, epoch, digest)` not yet taken, oldest first.
    digests: VecDeque<(usize, u64, Digest)>,
    ended: bool,
    /// Links write only on [`Outbox::push`] (a worker's outboxes: see
    /// [`Outbox::defer_writes`]); otherwise at the end of every call that sends.
    deferred: bool,
    /// The replica this outbox sends for, as its log lines name it.
    me: Option<ReplicaTag>,
    /// Drop stragglers ([`Outbox::evicting`]); None: wait for them.
    eviction: Option<Eviction>,
    /// What each channel keeps for replay ([`Outbox::keep_replay`]).
    window: Option<ReplayWindow>,
    /// Links dropped as stragglers, `(channel, peer)`, not yet taken
    /// ([`Outbox::take_evicted`]).
    evicted: Vec<(usize, String)>,
    /// A channel may have no live link for a while ([`Outbox::hold_orphans`]).
    orphans: bool,
    /// The last heartbeat sent (None: none yet).
    last_heartbeat: Option<u64>,
    /// The channel set's change armed for a heartbeat ([`Outbox::switch_at`]).
    switch: Option<Switch>,
    /// The links a switch took off their channels: they deliver what they hold, take
    /// nothing new, and go once their peer closes (or this outbox does).
    retiring: Vec<Box<dyn Link>>,
}

impl Outbox {
    /// `links[c]` are the downstream replicas of output channel `c` (downstream partition
    /// `c`). Every channel needs at least one link.
    pub fn new(
        partitioner: Partitioner,
        links: Vec<Vec<Box<dyn Link>>>,
        cfg: OutboxConfig,
    ) -> Result<Self> {
        if cfg.batch_rows == 0 {
            return Err(Error::Config("batch_rows must be ≥ 1 (got 0)".to_owned()));
        }
        if links.is_empty() {
            return Err(Error::Config(
                "an outbox needs at least one output channel (got 0 channels)".to_owned(),
            ));
        }
        if let Some(c) = links.iter().position(Vec::is_empty) {
            return Err(Error::Config(format!(
                "output channel {c} has no downstream replica; give every channel at least one link"
            )));
        }
        if partitioner == Partitioner::Forward && links.len() != 1 {
            return Err(Error::Config(format!(
                "partitioner 'forward' needs exactly one output channel (the downstream partition \
                 with this partition's index), got {}; use 'hash', 'rebalance' or 'broadcast' to \
                 fan out",
                links.len()
            )));
        }
        let n = links.len();
        let channels = links
            .into_iter()
            .map(|links| Channel {
                links,
                next_seq: 0,
                digest: CycleDigest::new(),
                replay: None,
                bare: false,
            })
            .collect();
        Ok(Outbox {
            partitioner,
            channels,
            cfg,
            rows_emitted: 0,
            seqs: vec![0; n],
            digests: VecDeque::new(),
            ended: false,
            deferred: false,
            me: None,
            eviction: None,
            window: None,
            evicted: Vec::new(),
            orphans: false,
            last_heartbeat: None,
            switch: None,
            retiring: Vec::new(),
        })
    }

    /// Change the channel set right after heartbeat `epoch` has left on every channel,
    /// before anything else: from then on rows are routed by `partitioner` over
    /// `links.len()` channels (a task downstream rescaled to that many partitions at that
    /// heartbeat, a live rescale). Channel `c` of the present ones goes on — its seqs, its
    /// digest and its replay window — with `links[c]` as its downstream replicas, its
    /// present links retiring (they deliver what they hold, heartbeat `epoch` last, and
    /// take nothing more), or with its present links if `links[c]` is empty (the
    /// downstream partition goes on in the same replicas); the channels after them are
    /// new, their seqs from 0, their replay windows from `epoch` on. The set may only
    /// grow, and every new channel needs a link. Refused once heartbeat `epoch` was sent,
    /// or after the end.
    pub fn switch_at(
        &mut self,
        epoch: u64,
        partitioner: Partitioner,
        links: Vec<Vec<Box<dyn Link>>>,
    ) -> Result<()> {
        self.check_open("switch_at")?;
        if let Some(armed) = &self.switch {
            return Err(Error::Config(format!(
                "switch at heartbeat {epoch}: a switch at heartbeat {} is armed already; \
                 cancel it first (cancel_switch)",
                armed.epoch
            )));
        }
        if self.last_heartbeat.is_some_and(|h| h >= epoch) {
            return Err(Error::Config(format!(
                "switch at heartbeat {epoch}: this outbox has sent heartbeat {} already",
                self.last_heartbeat.unwrap_or_default()
            )));
        }
        if links.len() < self.channels.len() {
            return Err(Error::Config(format!(
                "switch to {} output channels from {}: the channel set may only grow",
                links.len(),
                self.channels.len()
            )));
        }
        if let Some(c) = links
            .iter()
            .skip(self.channels.len())
            .position(Vec::is_empty)
        {
            return Err(Error::Config(format!(
                "switch: new output channel {} has no downstream replica; give every new \
                 channel at least one link",
                self.channels.len() + c
            )));
        }
        if partitioner == Partitioner::Forward && links.len() != 1 {
            return Err(Error::Config(format!(
                "switch: partitioner 'forward' needs exactly one output channel, got {}",
                links.len()
            )));
        }
        if let Partitioner::Hash { key_groups, .. } = &partitioner {
            if links.len() > *key_groups as usize {
                return Err(Error::Config(format!(
                    "switch: {} output channels, more than the {key_groups} key groups",
                    links.len()
                )));
            }
        }
        self.switch = Some(Switch {
            epoch,
            partitioner,
            links,
        });
        Ok(())
    }

    /// Disarm the switch [`Outbox::switch_at`] armed, if it is still to come; whether one
    /// was. The outbox then sends exactly what it would have with none armed.
    pub fn cancel_switch(&mut self) -> bool {
        self.switch.take().is_some()
    }

    /// The last heartbeat sent (None: none yet).
    pub fn last_heartbeat(&self) -> Option<u64> {
        self.last_heartbeat
    }

    fn apply_switch(&mut self, switch: Switch) {
        let Switch {
            epoch,
            partitioner,
            links,
        } = switch;
        for (c, mut new) in links.into_iter().enumerate() {
            for link in &mut new {
                link.defer(self.deferred);
            }
            if let Some(ch) = self.channels.get_mut(c) {
                if !new.is_empty() {
                    self.retiring.append(&mut ch.links);
                    ch.links = new;
                    ch.bare = false;
                }
            } else {
                self.channels.push(Channel {
                    links: new,
                    next_seq: 0,
                    digest: CycleDigest::new(),
                    replay: self.window.map(|_| Replay {
                        after: epoch,
                        ..Replay::default()
                    }),
                    bare: false,
                });
                self.seqs.push(0);
            }
        }
        self.partitioner = partitioner;
    }

    /// Name the replica this outbox sends for in its log lines (see [`crate::logs`]).
    #[must_use]
    pub fn tagged(mut self, me: ReplicaTag) -> Self {
        self.me = Some(me);
        self
    }

    /// Drop downstream replicas that lag behind their channel's other replicas (see
    /// [`Eviction`]) before each send, push and flush; [`Outbox::backlog`] then reports each
    /// channel's least backed-up link, so a straggler never holds this replica back.
    pub fn evicting(&mut self, eviction: Option<Eviction>) {
        self.eviction = eviction;
    }

    /// Let every channel lose its every link without failing (`on`): what it emits
    /// meanwhile goes only to its replay window ([`Outbox::keep_replay`]), and a downstream
    /// replica rebuilt from a checkpoint gets it through [`Outbox::add_link`]. For a job
    /// without twins (replication 1) that rolls lost replicas back instead; off by
    /// default, where the next call that sends fails with [`Error::Closed`] once no channel
    /// has a live link left (one channel without links is only logged).
    pub fn hold_orphans(&mut self, on: bool) {
        self.orphans = on;
    }

    /// Keep each channel's recent cycles (`window`), so that a downstream replica rebuilt
    /// while the job runs can be sent everything after its cut ([`Outbox::add_link`]).
    /// None: keep nothing (the default).
    pub fn keep_replay(&mut self, window: Option<ReplayWindow>) {
        self.window = window;
        for ch in &mut self.channels {
            ch.replay = window.map(|_| Replay {
                after: 0,
                ..Replay::default()
            });
        }
    }

    /// Where this outbox stands (see [`OutboxCut`]): call at a heartbeat-cycle boundary.
    pub fn cut(&self) -> OutboxCut {
        OutboxCut {
            seqs: self.seqs.clone(),
            rows_emitted: self.rows_emitted,
        }
    }

    /// Continue from a twin's `cut`, taken right after heartbeat `epoch`: the next elements
    /// take the seqs the twin's did, and the replay window starts there. Only before
    /// anything was sent.
    pub fn resume(&mut self, cut: &OutboxCut, epoch: u64) -> Result<()> {
        if cut.seqs.len() != self.channels.len() {
            return Err(Error::Config(format!(
                "a cut of {} output channels cannot resume an outbox of {}",
                cut.seqs.len(),
                self.channels.len()
            )));
        }
        if self.rows_emitted > 0 || self.seqs.iter().any(|&s| s > 0) {
            return Err(Error::Config(
                "resume() after the outbox sent something; resume a fresh outbox".to_owned(),
            ));
        }
        for (ch, &seq) in self.channels.iter_mut().zip(&cut.seqs) {
            ch.next_seq = seq;
            if let Some(r) = ch.replay.as_mut() {
                r.after = epoch;
            }
        }
        self.seqs.clone_from(&cut.seqs);
        self.rows_emitted = cut.rows_emitted;
        Ok(())
    }

    /// Add `link`, a downstream replica of channel `channel` rebuilt from a twin's cut at
    /// heartbeat `after_epoch`: it is first sent what the channel's replay window holds
    /// after that heartbeat (its dedup drops what it has already), then everything else.
    /// Fails, adding nothing, if the window no longer reaches back to the cut (the
    /// replica needs a later one) or if this outbox keeps no window.
    pub fn add_link(
        &mut self,
        channel: usize,
        mut link: Box<dyn Link>,
        after_epoch: u64,
    ) -> Result<()> {
        let n = self.channels.len();
        let ch = self
            .channels
            .get_mut(channel)
            .ok_or_else(|| Error::Config(format!("no output channel {channel} (of {n})")))?;
        let replay = ch.replay.as_ref().ok_or_else(|| {
            Error::Config("this outbox keeps no replay window (keep_replay)".to_owned())
        })?;
        let mut frames = replay.after(after_epoch).ok_or_else(|| {
            Error::Closed(format!(
                "output channel {channel} keeps the cycles after heartbeat {} only; a replica \
                 cut at heartbeat {after_epoch} needs a later cut",
                replay.after
            ))
        })?;
        if link.wants_bytes() {
            for f in &mut frames {
                if f.bytes.is_none() {
                    f.bytes = Some(encoded(channel, f)?);
                }
            }
        }
        link.defer(self.deferred);
        link.replay(&frames)?;
        ch.links.push(link);
        ch.bare = false;
        Ok(())
    }

    /// The links dropped as stragglers since the last call, `(channel, peer)` with the
    /// peer as [`Link::describe`] names it: replicas the engine should replace.
    pub fn take_evicted(&mut self) -> Vec<(usize, String)> {
        std::mem::take(&mut self.evicted)
    }

    /// Number of output channels.
    pub fn channels(&self) -> usize {
        self.channels.len()
    }

    /// Live links of channel `c` (links whose peer failed were dropped).
    pub fn live_links(&self, channel: usize) -> usize {
        self.channels.get(channel).map_or(0, |c| c.links.len())
    }

    /// Partition the rows of `batch` over the channels and send each channel's part now, as
    /// frames of at most `batch_rows` rows cut at fixed offsets of that part; its rows take
    /// the channel's next seqs. Every frame is encoded (and its digest prepared) before any
    /// is sent: a batch that cannot be encoded or digested is refused whole, sending
    /// nothing and taking no seq. Blocks while a downstream queue is full.
    pub fn emit(&mut self, batch: &RecordBatch) -> Result<()> {
        self.check_open("emit")?;
        let rows = batch.num_rows();
        if rows == 0 {
            return Ok(());
        }
        let n = self.channels.len();
        let parts: Vec<(usize, RecordBatch)> = match &self.partitioner {
            Partitioner::Forward => vec![(0, batch.clone())],
            Partitioner::Broadcast => (0..n).map(|c| (c, batch.clone())).collect(),
            Partitioner::Hash { column, .. } if n == 1 => {
                // Nothing to route, but a bad key is still a configuration error, whatever
                // the downstream parallelism.
                key_column(batch, column)?;
                vec![(0, batch.clone())]
            }
            Partitioner::Rebalance if n == 1 => vec![(0, batch.clone())],
            Partitioner::Rebalance => {
                let start = self.rows_emitted;
                let targets = (0..rows).map(|i| ((start + i as u64) % n as u64) as usize);
                scatter(batch, targets, n)?
            }
            Partitioner::Hash { column, key_groups } => {
                let targets = hash_channels(batch, column, n, *key_groups)?;
                scatter(batch, targets.iter().map(|&c| c as usize), n)?
            }
        };
        let mut outgoing = Vec::with_capacity(parts.len());
        for (c, part) in parts {
            let ch = &mut self.channels[c];
            ch.digest.prepare(part.schema_ref())?;
            let encode = ch.links.iter().any(|l| l.wants_bytes());
            outgoing.push((
                c,
                frames(c, ch.next_seq, &part, self.cfg.batch_rows, encode)?,
            ));
        }
        self.rows_emitted += rows as u64;
        let mut first_err = None;
        for (c, frames) in outgoing {
            let ch = &mut self.channels[c];
            for frame in frames {
                ch.next_seq = frame.first_seq + frame.rows.num_rows() as u64;
                if let Err(e) = ch.digest.add(frame.first_seq, &frame.rows) {
                    first_err.get_or_insert(e);
                }
                let out = OutFrame {
                    item: Item::Data {
                        first_seq: frame.first_seq,
                        payload: frame.rows,
                    },
                    digest: None,
                    bytes: frame.bytes,
                };
                send_all(
                    self.me.as_ref(),
                    self.eviction,
                    c,
                    &mut ch.links,
                    &out,
                    &mut self.evicted,
                );
                if let Some(r) = ch.replay.as_mut() {
                    let size = out
                        .bytes
                        .as_ref()
                        .map_or_else(|| rows_size(&out.item), |b| b.len());
                    r.push(&out, size);
                }
            }
            self.seqs[c] = ch.next_seq;
        }
        self.push_unless_deferred();
        first_err.map_or_else(|| self.served(), Err)
    }

    /// Send one heartbeat of cycle `epoch` on every channel (each takes one seq), carrying
    /// the channel's digest of the Data frames it sent since its previous heartbeat; the
    /// digest is recorded for [`Outbox::take_digests`]. The heartbeat follows every row
    /// emitted before it.
    pub fn heartbeat(&mut self, epoch: u64) -> Result<()> {
        self.check_open("heartbeat")?;
        let sent = self.control(Some(epoch));
        self.last_heartbeat = Some(epoch);
        if self.switch.as_ref().is_some_and(|s| s.epoch == epoch) {
            let switch = self.switch.take().expect("armed");
            self.apply_switch(switch);
        }
        sent
    }

    /// Send the end marker on every channel (an empty frame; the digest of the rows sent
    /// since the last heartbeat is recorded under epoch `u64::MAX`). Later calls to
    /// `emit`, `heartbeat` or `end` fail with [`Error::Closed`].
    pub fn end(&mut self) -> Result<()> {
        self.check_open("end")?;
        let res = self.control(None);
        self.ended = true;
        res
    }

    /// Hold frames in the links until [`Outbox::push`] (`on`), so that what one turn of a
    /// worker sends to a peer — a batch and the heartbeat after it, say — leaves in one
    /// write, and the peer wakes once for it. The worker pushes before it runs anything
    /// else and before it sleeps. Off (the default), every `emit`, `heartbeat` and `end`
    /// pushes before it returns.
    pub fn defer_writes(&mut self, on: bool) {
        self.deferred = on;
        for ch in &mut self.channels {
            for link in &mut ch.links {
                link.defer(on);
            }
        }
        for link in &mut self.retiring {
            link.defer(on);
        }
        if !on {
            self.push();
        }
    }

    /// Write out what the links hold back ([`Link::push`]). A link that fails is dropped,
    /// as on `send`; once no channel has a live link left, the next call that sends fails.
    pub fn push(&mut self) {
        for (c, ch) in self.channels.iter_mut().enumerate() {
            if let Some(ev) = self.eviction {
                evict_stragglers(self.me.as_ref(), &ev, c, &mut ch.links, &mut self.evicted);
            }
            retain_live(self.me.as_ref(), c, &mut ch.links, |link| link.push());
        }
        // A retiring link that fails has nothing more to deliver: it goes quietly.
        self.retiring
            .retain_mut(|link| link.push().is_ok() && !link.peer_closed());
    }

    /// Move what links queued of their own along, without blocking ([`Link::flush`]), and
    /// drop stragglers if [`Outbox::evicting`].
    pub fn flush(&mut self) {
        for (c, ch) in self.channels.iter_mut().enumerate() {
            for link in &mut ch.links {
                link.flush();
            }
            if let Some(ev) = self.eviction {
                evict_stragglers(self.me.as_ref(), &ev, c, &mut ch.links, &mut self.evicted);
            }
        }
        for link in &mut self.retiring {
            link.flush();
        }
        self.retiring.retain(|link| !link.peer_closed());
    }

    /// The largest [`Link::backlog`] over every live link (0 once closed) — or, when
    /// evicting stragglers, over every channel its least backed-up link: a lagging replica
    /// is dropped before it could block a send, so only a channel whose every replica is
    /// slow holds this one back. A link whose peer closed its end counts for nothing: what
    /// it holds will never be taken, and the next send drops it (a worker that waited for
    /// it to drain would never send again, so never find out).
    pub fn backlog(&self) -> usize {
        let per_channel = |c: &Channel| {
            let each = c
                .links
                .iter()
                .map(|l| if l.peer_closed() { 0 } else { l.backlog() });
            if self.eviction.is_some() {
                each.min()
            } else {
                each.max()
            }
        };
        self.channels
            .iter()
            .filter_map(per_channel)
            .max()
            .unwrap_or(0)
    }

    /// Whether `end()`, `close()` or `abort()` ran: nothing more can be sent.
    pub fn is_ended(&self) -> bool {
        self.ended
    }

    /// The seq the next element of each channel will take.
    pub fn next_seqs(&self) -> &[u64] {
        &self.seqs
    }

    /// The closed cycle digests `(channel, epoch, digest)` recorded since the last call,
    /// oldest first: one per channel per heartbeat, and one per channel under epoch
    /// `u64::MAX` for the rows after the last heartbeat once `end()` ran. At most
    /// [`DIGESTS_KEPT`] are kept between calls (the oldest are dropped first).
    pub fn take_digests(&mut self) -> Vec<(usize, u64, Digest)> {
        self.digests.drain(..).collect()
    }

    /// Close every link (each delivers what it queued). Nothing is left to send: `emit`
    /// sends at once. Does not send the end marker: call [`Outbox::end`] first for a clean
    /// finish; closing without it looks to the receivers like a crash of this replica. A
    /// link that fails to close is logged.
    pub fn close(&mut self) {
        let mut links = std::mem::take(&mut self.retiring);
        for ch in &mut self.channels {
            links.append(&mut ch.links);
        }
        for mut link in links {
            if let Err(e) = link.close() {
                log_replica!(
                    failure_level(link.as_ref()),
                    OUTBOX,
                    self.me.as_ref(),
                    "{}: closing the link to {} failed: {e}",
                    who(self.me.as_ref()),
                    link.describe()
                );
            }
        }
        self.ended = true;
    }

    /// Drop every connection at once without delivering what is queued — a crash of this
    /// replica as the receivers see it (fault injection; the other replicas of this
    /// partition mask it).
    pub fn abort(&mut self) {
        for ch in &mut self.channels {
            for mut link in ch.links.drain(..) {
                link.abort();
            }
        }
        for mut link in self.retiring.drain(..) {
            link.abort();
        }
        self.ended = true;
    }

    fn check_open(&self, what: &str) -> Result<()> {
        if self.ended {
            Err(Error::Closed(format!(
                "outbox.{what}() after end() or close(); the outbox no longer sends"
            )))
        } else {
            Ok(())
        }
    }

    /// Close every channel's digest (recording it), then send one control element per
    /// channel, each taking one seq: heartbeat `epoch` carrying the digest, or (None) the
    /// end marker, whose digest is recorded under epoch `u64::MAX`.
    fn control(&mut self, heartbeat: Option<u64>) -> Result<()> {
        let cycle = heartbeat.unwrap_or(u64::MAX);
        for (c, ch) in self.channels.iter_mut().enumerate() {
            let digest = ch.digest.close(cycle);
            if self.digests.len() == DIGESTS_KEPT {
                self.digests.pop_front();
            }
            self.digests.push_back((c, cycle, digest));
            let seq = ch.next_seq;
            let encode = ch.links.iter().any(|l| l.wants_bytes());
            let out = match heartbeat {
                Some(epoch) => OutFrame {
                    item: Item::Heartbeat { seq, epoch },
                    digest: Some(digest),
                    bytes: encode.then(|| {
                        wire::encode_heartbeat_digest(c as u32, seq, epoch, &digest).into()
                    }),
                },
                None => OutFrame {
                    item: Item::End { seq },
                    digest: None,
                    bytes: encode.then(|| wire::encode_end(c as u32, seq).into()),
                },
            };
            ch.next_seq += 1;
            self.seqs[c] = ch.next_seq;
            send_all(
                self.me.as_ref(),
                self.eviction,
                c,
                &mut ch.links,
                &out,
                &mut self.evicted,
            );
            if let (Some(r), Some(window)) = (ch.replay.as_mut(), self.window.as_ref()) {
                r.push(&out, CONTROL_FRAME_BYTES);
                r.trim(window);
            }
        }
        self.push_unless_deferred();
        self.served()
    }

    fn push_unless_deferred(&mut self) {
        if !self.deferred {
            self.push();
        }
    }

    /// Whether this replica's output still reaches anyone: an error once no channel has a
    /// live link left (unless it [`Outbox::hold_orphans`]) — every downstream replica
    /// finished on its twins' copies, or is gone. A channel that lost its every link while
    /// others have some is only logged: its downstream replicas finished (or were lost,
    /// which is the engine's to handle), and the replicas downstream on the other channels
    /// may have no other feed than this one (their upstream twin dropped them as a
    /// straggler): they are served on.
    fn served(&mut self) -> Result<()> {
        if self.orphans {
            return Ok(());
        }
        let served = self.channels.iter().any(|ch| !ch.links.is_empty());
        for (c, ch) in self.channels.iter_mut().enumerate() {
            if !ch.links.is_empty() || ch.bare {
                continue;
            }
            ch.bare = true;
            if served {
                log_replica!(
                    Level::Info,
                    OUTBOX,
                    self.me.as_ref(),
                    "{}: output channel {c} has no live downstream replica left (they \
                     finished on its twins' copies, or are gone); its other channels are \
                     served on",
                    who(self.me.as_ref())
                );
            }
        }
        if served {
            Ok(())
        } else {
            Err(Error::Closed(
                "no output channel has a live downstream replica left (every link failed): \
                 its output cannot be delivered"
                    .to_owned(),
            ))
        }
    }
}

/// What a heartbeat or end marker counts for in a replay window.
const CONTROL_FRAME_BYTES: usize = 64;

/// The memory a Data frame's rows hold (buffers shared with other frames of one emitted
/// batch are counted in each: the estimate errs on the large side).
fn rows_size(item: &Item<RecordBatch>) -> usize {
    match item {
        Item::Data { payload, .. } => payload.get_array_memory_size(),
        _ => CONTROL_FRAME_BYTES,
    }
}

/// `frame` encoded for the wire as an element of channel `c`.
fn encoded(c: usize, frame: &OutFrame) -> Result<Arc<[u8]>> {
    let c = c as u32;
    Ok(match (&frame.item, &frame.digest) {
        (Item::Data { first_seq, payload }, _) => wire::encode_data(c, *first_seq, payload)?.into(),
        (Item::Heartbeat { seq, epoch }, Some(d)) => {
            wire::encode_heartbeat_digest(c, *seq, *epoch, d).into()
        }
        (Item::Heartbeat { seq, epoch }, None) => wire::encode_heartbeat(c, *seq, *epoch).into(),
        (Item::End { seq }, _) => wire::encode_end(c, *seq).into(),
    })
}

/// Route row `i` of `batch` to channel `targets[i]`: one `take` per non-empty channel, in
/// channel order.
fn scatter(
    batch: &RecordBatch,
    targets: impl Iterator<Item = usize>,
    n: usize,
) -> Result<Vec<(usize, RecordBatch)>> {
    // Counting pass first so every index vector is allocated once at its final size.
    let targets: Vec<u32> = targets.map(|c| c as u32).collect();
    let mut counts = vec![0usize; n];
    for &c in &targets {
        counts[c as usize] += 1;
    }
    if let Some(c) = counts.iter().position(|&k| k == targets.len()) {
        // Everything goes to one channel: no copy at all.
        return Ok(vec![(c, batch.clone())]);
    }
    let mut indices: Vec<Vec<u32>> = counts.iter().map(|&k| Vec::with_capacity(k)).collect();
    for (row, &c) in targets.iter().enumerate() {
        indices[c as usize].push(row as u32);
    }
    let mut parts = Vec::with_capacity(n);
    for (c, idx) in indices.into_iter().enumerate() {
        if !idx.is_empty() {
            let part = arrow_select::take::take_record_batch(batch, &UInt32Array::from(idx))?;
            parts.push((c, part));
        }
    }
    Ok(parts)
}

/// Cut `part` into the Data frames of channel `c` starting at seq `first_seq`: slices of
/// `batch_rows` rows at offsets `0, batch_rows, 2·batch_rows…` (the last one shorter),
/// each encoded for the wire if `encode`.
fn frames(
    c: usize,
    first_seq: u64,
    part: &RecordBatch,
    batch_rows: usize,
    encode: bool,
) -> Result<Vec<Outgoing>> {
    let total = part.num_rows();
    let mut out = Vec::with_capacity(total.div_ceil(batch_rows));
    let mut seq = first_seq;
    for offset in (0..total).step_by(batch_rows) {
        let rows = part.slice(offset, batch_rows.min(total - offset));
        let bytes = if encode {
            Some(wire::encode_data(c as u32, seq, &rows)?.into())
        } else {
            None
        };
        let next = seq + rows.num_rows() as u64;
        out.push(Outgoing {
            first_seq: seq,
            rows,
            bytes,
        });
        seq = next;
    }
    Ok(out)
}

/// Send `frame` to every link of channel `c`; a link that fails is dropped (logged). A
/// channel with no live link sends nothing ([`Outbox::served`] says whether that is an
/// error).
fn send_all(
    me: Option<&ReplicaTag>,
    eviction: Option<Eviction>,
    c: usize,
    links: &mut Vec<Box<dyn Link>>,
    frame: &OutFrame,
    evicted: &mut Vec<(usize, String)>,
) {
    if let Some(ev) = eviction {
        evict_stragglers(me, &ev, c, links, evicted);
    }
    retain_live(me, c, links, |link| link.send(frame));
}

/// Apply `op` to every link of channel `c`, dropping (and logging) each one it fails on:
/// that peer is gone for good, and the other replicas of its partition keep receiving. A
/// peer that closed its end is logged at debug level: a downstream replica that finished
/// on its twins' copies does that, and a lost one is the engine's to report.
fn retain_live(
    me: Option<&ReplicaTag>,
    c: usize,
    links: &mut Vec<Box<dyn Link>>,
    mut op: impl FnMut(&mut Box<dyn Link>) -> Result<()>,
) {
    links.retain_mut(|link| match op(link) {
        Ok(()) => true,
        Err(e) => {
            log_replica!(
                failure_level(link.as_ref()),
                OUTBOX,
                me,
                "{}: dropping {} of output channel {c}: {e}; the other replicas of that \
                 partition keep receiving",
                who(me),
                link.describe()
            );
            false
        }
    });
}

/// Drop (abort) the links of channel `c` that lag ([`Eviction`]) if another one does not.
fn evict_stragglers(
    me: Option<&ReplicaTag>,
    ev: &Eviction,
    c: usize,
    links: &mut Vec<Box<dyn Link>>,
    evicted: &mut Vec<(usize, String)>,
) {
    if links.len() < 2 {
        return;
    }
    let now = Instant::now();
    let lag: Vec<Option<Duration>> = links
        .iter()
        .map(|l| {
            l.backed_up_for(now)
                .filter(|&d| d >= ev.after || (l.backlog() >= ev.frames && !l.catching_up()))
        })
        .collect();
    let lagging = lag.iter().filter(|d| d.is_some()).count();
    if lagging == 0 || lagging == links.len() {
        return;
    }
    // Only a replica that is still there keeps up: one killed a moment ago shows an empty
    // queue until the next send finds it gone, and the straggler dropped for it would
    // leave the partition with no replica (a rebuilt one catching up, its twin then lost).
    if !links
        .iter()
        .zip(&lag)
        .any(|(l, d)| d.is_none() && !l.gone())
    {
        return;
    }
    let mut lag = lag.into_iter();
    links.retain_mut(|link| {
        let Some(waited) = lag.next().flatten() else {
            return true;
        };
        log_replica!(
            Level::Warn,
            OUTBOX,
            me,
            "{}: dropping {} of output channel {c}, a straggler ({} frames unread, the oldest \
             for {} ms) while another replica of that partition keeps up",
            who(me),
            link.describe(),
            link.backlog(),
            waited.as_millis()
        );
        evicted.push((c, link.describe()));
        link.abort();
        false
    });
}

/// The level a link's failure is logged at: debug when the peer closed its end (a
/// downstream replica that finished on its twins' copies does that), else warning.
fn failure_level(link: &dyn Link) -> Level {
    if link.peer_closed() {
        Level::Debug
    } else {
        Level::Warn
    }
}

/// How a log line names the sending replica.
fn who(me: Option<&ReplicaTag>) -> &str {
    me.map_or("outbox", |m| m.name.as_str())
}

/// The channel key group `group` of `key_groups` goes to among `channels`: groups are
/// split into `channels` contiguous ranges, as even as they can be.
pub fn key_group_channel(group: u32, key_groups: u32, channels: usize) -> u32 {
    (u64::from(group) * channels as u64 / u64::from(key_groups)) as u32
}

/// The output channel of every row of `batch` under hash partitioning on `column` over
/// `key_groups` key groups.
fn hash_channels(batch: &RecordBatch, column: &str, n: usize, key_groups: u32) -> Result<Vec<u32>> {
    let array = key_column(batch, column)?;
    let groups = u64::from(key_groups);
    let pick = |h: u64| key_group_channel((h % groups) as u32, key_groups, n);
    let mut out = Vec::with_capacity(array.len());
    fn ints<T: ArrowPrimitiveType>(
        a: &dyn Array,
        out: &mut Vec<u32>,
        canon: impl Fn(T::Native) -> [u8; 8],
        pick: impl Fn(u64) -> u32,
    ) {
        let a = a.as_primitive::<T>();
        if a.null_count() == 0 {
            out.extend(
                a.values()
                    .iter()
                    .map(|&v| pick(xxh3_64_with_seed(&canon(v), HASH_SEED))),
            );
        } else {
            out.extend(a.iter().map(|v| match v {
                Some(v) => pick(xxh3_64_with_seed(&canon(v), HASH_SEED)),
                None => NULL_KEY_CHANNEL as u32,
            }));
        }
    }
    fn bytes<'a>(
        values: impl Iterator<Item = Option<&'a [u8]>>,
        out: &mut Vec<u32>,
        pick: impl Fn(u64) -> u32,
    ) {
        out.extend(values.map(|v| match v {
            Some(v) => pick(xxh3_64_with_seed(v, HASH_SEED)),
            None => NULL_KEY_CHANNEL as u32,
        }));
    }
    let a = array.as_ref();
    match a.data_type() {
        DataType::Int8 => ints::<Int8Type>(a, &mut out, |v| i64::from(v).to_le_bytes(), pick),
        DataType::Int16 => ints::<Int16Type>(a, &mut out, |v| i64::from(v).to_le_bytes(), pick),
        DataType::Int32 => ints::<Int32Type>(a, &mut out, |v| i64::from(v).to_le_bytes(), pick),
        DataType::Int64 => ints::<Int64Type>(a, &mut out, |v| v.to_le_bytes(), pick),
        DataType::UInt8 => ints::<UInt8Type>(a, &mut out, |v| u64::from(v).to_le_bytes(), pick),
        DataType::UInt16 => ints::<UInt16Type>(a, &mut out, |v| u64::from(v).to_le_bytes(), pick),
        DataType::UInt32 => ints::<UInt32Type>(a, &mut out, |v| u64::from(v).to_le_bytes(), pick),
        DataType::UInt64 => ints::<UInt64Type>(a, &mut out, |v| v.to_le_bytes(), pick),
        DataType::Utf8 => bytes(
            a.as_string::<i32>().iter().map(|s| s.map(str::as_bytes)),
            &mut out,
            pick,
        ),
        DataType::LargeUtf8 => bytes(
            a.as_string::<i64>().iter().map(|s| s.map(str::as_bytes)),
            &mut out,
            pick,
        ),
        DataType::Binary => bytes(a.as_binary::<i32>().iter(), &mut out, pick),
        DataType::LargeBinary => bytes(a.as_binary::<i64>().iter(), &mut out, pick),
        other => return Err(unhashable(column, other)),
    }
    Ok(out)
}

/// The key column of `batch`, checked to exist and to have a hashable type.
fn key_column<'a>(batch: &'a RecordBatch, column: &str) -> Result<&'a ArrayRef> {
    let Some(array) = batch.column_by_name(column) else {
        let have: Vec<String> = batch
            .schema()
            .fields()
            .iter()
            .map(|f| format!("{} ({})", f.name(), f.data_type()))
            .collect();
        return Err(Error::Config(format!(
            "hash partitioner key column {column:?} is not in the batch; its columns are [{}]",
            have.join(", ")
        )));
    };
    use DataType::*;
    match array.data_type() {
        Int8 | Int16 | Int32 | Int64 | UInt8 | UInt16 | UInt32 | UInt64 | Utf8 | LargeUtf8
        | Binary | LargeBinary => Ok(array),
        other => Err(unhashable(column, other)),
    }
}

fn unhashable(column: &str, found: &DataType) -> Error {
    Error::Config(format!(
        "hash partitioner key column {column:?} has type {found}, which cannot be hashed; \
         supported types: {HASHABLE_TYPES}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::types::Int32Type;
    use arrow_array::{BinaryArray, Int32Array, Int64Array, LargeStringArray, StringArray};
    use arrow_schema::{Field, Schema};
    use parking_lot::Mutex;

    use crate::wire::{decode_frame, Frame};

    /// In-memory link: records every frame; can be told to fail.
    #[derive(Clone, Default)]
    struct MemLink {
        frames: Arc<Mutex<Vec<Arc<[u8]>>>>,
        fail: Arc<Mutex<bool>>,
    }

    impl Link for MemLink {
        fn send(&mut self, frame: &OutFrame) -> Result<()> {
            if *self.fail.lock() {
                return Err(Error::Closed("peer gone (test)".to_owned()));
            }
            let bytes = frame
                .bytes
                .clone()
                .expect("a link that wants bytes gets them");
            self.frames.lock().push(bytes);
            Ok(())
        }
    }

    impl MemLink {
        fn decoded(&self) -> Vec<Frame> {
            self.frames
                .lock()
                .iter()
                .map(|f| decode_frame(f, u64::MAX).unwrap().0)
                .collect()
        }
        /// `(kind, first_seq, rows-or-epoch, values of column "v")` per frame.
        fn summary(&self) -> Vec<(char, u64, u64, Vec<i64>)> {
            self.decoded()
                .into_iter()
                .map(|f| match f {
                    Frame::Data {
                        first_seq, batch, ..
                    } => {
                        let v = batch
                            .column(0)
                            .as_primitive::<Int64Type>()
                            .values()
                            .to_vec();
                        ('D', first_seq, batch.num_rows() as u64, v)
                    }
                    Frame::Heartbeat { seq, epoch, .. } => ('H', seq, epoch, vec![]),
                    Frame::End { seq, .. } => ('E', seq, 0, vec![]),
                    Frame::Order { .. } => panic!("outbox never sends order frames"),
                })
                .collect()
        }
    }

    fn batch(values: std::ops::Range<i64>) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, false)]));
        RecordBatch::try_new(schema, vec![Arc::new(Int64Array::from_iter_values(values))]).unwrap()
    }

    fn outbox(p: Partitioner, links: &[Vec<MemLink>], batch_rows: usize) -> Outbox {
        let links = links
            .iter()
            .map(|ch| {
                ch.iter()
                    .map(|l| Box::new(l.clone()) as Box<dyn Link>)
                    .collect()
            })
            .collect();
        Outbox::new(p, links, OutboxConfig { batch_rows }).unwrap()
    }

    fn mem(channels: usize, replicas: usize) -> Vec<Vec<MemLink>> {
        (0..channels)
            .map(|_| (0..replicas).map(|_| MemLink::default()).collect())
            .collect()
    }

    fn boxed(links: &[Vec<MemLink>]) -> Vec<Vec<Box<dyn Link>>> {
        links
            .iter()
            .map(|ch| {
                ch.iter()
                    .map(|l| Box::new(l.clone()) as Box<dyn Link>)
                    .collect()
            })
            .collect()
    }

    /// The values of `v` a link received as data, in order.
    fn values(link: &MemLink) -> Vec<i64> {
        link.summary()
            .into_iter()
            .filter(|f| f.0 == 'D')
            .flat_map(|f| f.3)
            .collect()
    }

    #[test]
    fn a_switch_at_a_heartbeat_routes_what_follows_over_the_new_channels() {
        let old = mem(2, 1);
        let mut ob = outbox(Partitioner::hash("v"), &old, 1024);
        ob.keep_replay(Some(ReplayWindow {
            cycles: 8,
            bytes: 1 << 20,
        }));
        ob.emit(&batch(0..20)).unwrap();
        ob.heartbeat(1).unwrap();
        let new = mem(4, 1);
        ob.switch_at(2, Partitioner::hash("v"), boxed(&new))
            .unwrap();
        ob.emit(&batch(20..40)).unwrap(); // before heartbeat 2: the old channels
        let seqs_at_2: Vec<u64> = ob.next_seqs().iter().map(|s| s + 1).collect();
        ob.heartbeat(2).unwrap();
        assert_eq!(ob.channels(), 4);
        ob.emit(&batch(40..100)).unwrap();
        ob.heartbeat(3).unwrap();

        let route = |range: std::ops::Range<i64>, n: usize| -> Vec<Vec<i64>> {
            let b = batch(range.clone());
            let to = hash_channels(&b, "v", n, DEFAULT_KEY_GROUPS).unwrap();
            (0..n)
                .map(|c| {
                    range
                        .clone()
                        .zip(&to)
                        .filter(|(_, &t)| t as usize == c)
                        .map(|(v, _)| v)
                        .collect()
                })
                .collect()
        };
        // The old links: every row up to heartbeat 2, heartbeat 2 last, nothing after.
        let (before, after) = (route(0..40, 2), route(40..100, 4));
        for c in 0..2 {
            let mut want = route(0..20, 2)[c].clone();
            want.extend(&route(20..40, 2)[c]);
            assert_eq!(values(&old[c][0]), want, "old channel {c}");
            assert_eq!(
                old[c][0].summary().last().map(|f| (f.0, f.2)),
                Some(('H', 2))
            );
            assert!(!before[c].is_empty() && !after[c].is_empty());
        }
        // The new links: the rows after it, routed over 4 channels by key group; channels
        // 0 and 1 go on with their seqs, 2 and 3 start at 0; heartbeat 3 on each.
        for c in 0..4 {
            assert_eq!(values(&new[c][0]), after[c], "new channel {c}");
            let first = new[c][0].summary()[0].1;
            assert_eq!(
                first,
                if c < 2 { seqs_at_2[c] } else { 0 },
                "channel {c}'s first seq"
            );
            assert_eq!(
                new[c][0].summary().last().map(|f| (f.0, f.2)),
                Some(('H', 3))
            );
        }
        // A replica of a new channel rebuilt later is replayed from the switch on.
        let late = MemLink::default();
        ob.add_link(3, Box::new(late.clone()), 2).unwrap();
        assert_eq!(values(&late), after[3]);
        assert!(ob.add_link(3, Box::new(MemLink::default()), 1).is_err());
    }

    #[test]
    fn a_switch_keeps_the_present_links_of_a_channel_given_none() {
        let old = mem(2, 1);
        let mut ob = outbox(Partitioner::hash("v"), &old, 1024);
        let added = mem(1, 1);
        let links = vec![vec![], vec![], boxed(&added).remove(0)];
        ob.switch_at(1, Partitioner::hash("v"), links).unwrap();
        ob.emit(&batch(0..30)).unwrap();
        ob.heartbeat(1).unwrap();
        ob.emit(&batch(30..90)).unwrap();
        ob.heartbeat(2).unwrap();
        let to = hash_channels(&batch(30..90), "v", 3, DEFAULT_KEY_GROUPS).unwrap();
        for (c, link) in [&old[0][0], &old[1][0], &added[0][0]]
            .into_iter()
            .enumerate()
        {
            let after: Vec<i64> = (30..90)
                .zip(&to)
                .filter(|(_, &t)| t as usize == c)
                .map(|(v, _)| v)
                .collect();
            let got = values(link);
            assert!(
                got.ends_with(&after),
                "channel {c}: {got:?} does not end with {after:?}"
            );
            assert_eq!(link.summary().last().map(|f| (f.0, f.2)), Some(('H', 2)));
        }
        assert!(
            values(&added[0][0]).iter().all(|v| *v >= 30),
            "nothing before the switch"
        );
    }

    #[test]
    fn a_switch_is_refused_after_its_heartbeat_and_when_it_shrinks_and_cancels_cleanly() {
        let links = mem(2, 1);
        let mut ob = outbox(Partitioner::hash("v"), &links, 1024);
        ob.heartbeat(1).unwrap();
        assert!(ob
            .switch_at(1, Partitioner::hash("v"), boxed(&mem(3, 1)))
            .is_err());
        assert!(ob
            .switch_at(2, Partitioner::hash("v"), boxed(&mem(1, 1)))
            .is_err());
        assert!(
            ob.switch_at(2, Partitioner::hash("v"), vec![vec![], vec![], vec![]])
                .is_err(),
            "a new channel with no link"
        );
        let unused = mem(3, 1);
        ob.switch_at(2, Partitioner::hash("v"), boxed(&unused))
            .unwrap();
        assert!(ob.cancel_switch() && !ob.cancel_switch());
        ob.emit(&batch(0..10)).unwrap();
        ob.heartbeat(2).unwrap();
        ob.emit(&batch(10..20)).unwrap();
        assert_eq!(ob.channels(), 2);
        assert!(unused.iter().all(|ch| ch[0].summary().is_empty()));
        let got: usize = links.iter().map(|ch| values(&ch[0]).len()).sum();
        assert_eq!(got, 20);
    }

    #[test]
    fn the_replay_window_keeps_whole_recent_cycles_and_replays_what_follows_a_cut() {
        let links = mem(1, 1);
        let mut ob = outbox(Partitioner::Forward, &links, 8);
        ob.keep_replay(Some(ReplayWindow {
            cycles: 2,
            bytes: 1 << 20,
        }));
        for k in 1..=3u64 {
            let at = (k as i64 - 1) * 10;
            ob.emit(&batch(at..at + 2)).unwrap();
            ob.heartbeat(k).unwrap();
        }
        ob.emit(&batch(30..32)).unwrap();
        // Cycles 2 and 3 and the rows after heartbeat 3 are kept; cycle 1 was dropped whole.
        let late = MemLink::default();
        ob.add_link(0, Box::new(late.clone()), 2).unwrap();
        assert_eq!(
            late.summary(),
            vec![
                ('D', 6, 2, vec![20, 21]),
                ('H', 8, 3, vec![]),
                ('D', 9, 2, vec![30, 31])
            ]
        );
        // A link added late takes everything from then on, like the others.
        ob.heartbeat(4).unwrap();
        assert_eq!(late.summary().last(), Some(&('H', 11, 4, vec![])));
        assert_eq!(links[0][0].summary().last(), Some(&('H', 11, 4, vec![])));
        // A cut the window no longer reaches back to is refused, adding nothing.
        let too_late = MemLink::default();
        let err = ob.add_link(0, Box::new(too_late.clone()), 1).unwrap_err();
        assert!(err.to_string().contains("needs a later cut"), "{err}");
        assert!(too_late.summary().is_empty());
        assert_eq!(ob.live_links(0), 2);
        // A cut this channel has not reached yet (its twin's upstream ran ahead of it)
        // replays from the latest heartbeat it sent.
        let ahead = MemLink::default();
        ob.add_link(0, Box::new(ahead.clone()), 9).unwrap();
        assert!(ahead.summary().is_empty());
    }

    #[test]
    fn an_outbox_holding_orphans_keeps_a_channel_without_links_for_a_rebuilt_replica() {
        let links = mem(1, 1);
        let mut ob = outbox(Partitioner::Forward, &links, 8);
        ob.keep_replay(Some(ReplayWindow {
            cycles: 8,
            bytes: 1 << 20,
        }));
        ob.hold_orphans(true);
        ob.emit(&batch(0..2)).unwrap();
        ob.heartbeat(1).unwrap();
        // The only downstream replica is gone: the channel goes on, into its window only.
        *links[0][0].fail.lock() = true;
        ob.emit(&batch(10..12)).unwrap();
        ob.heartbeat(2).unwrap();
        assert_eq!(ob.live_links(0), 0);
        ob.emit(&batch(20..22)).unwrap();
        // Its replacement, rolled back to heartbeat 1, gets everything after it.
        let back = MemLink::default();
        ob.add_link(0, Box::new(back.clone()), 1).unwrap();
        assert_eq!(
            back.summary(),
            vec![
                ('D', 3, 2, vec![10, 11]),
                ('H', 5, 2, vec![]),
                ('D', 6, 2, vec![20, 21])
            ]
        );
        // Without it, a channel left with no link fails the send.
        let links = mem(1, 1);
        let mut strict = outbox(Partitioner::Forward, &links, 8);
        *links[0][0].fail.lock() = true;
        assert!(strict.emit(&batch(0..2)).is_err());
    }

    #[test]
    fn an_outbox_resumed_from_a_cut_numbers_on_like_its_twin() {
        let (a_links, b_links) = (mem(2, 1), mem(2, 1));
        let mut a = outbox(Partitioner::Rebalance, &a_links, 8);
        a.emit(&batch(0..3)).unwrap();
        a.heartbeat(1).unwrap();
        let cut = a.cut();
        let mut b = outbox(Partitioner::Rebalance, &b_links, 8);
        b.resume(&cut, 1).unwrap();
        for ob in [&mut a, &mut b] {
            ob.emit(&batch(3..8)).unwrap();
            ob.heartbeat(2).unwrap();
        }
        for c in 0..2 {
            let tail = a_links[c][0].frames.lock()[2..].to_vec();
            assert_eq!(*b_links[c][0].frames.lock(), tail, "channel {c}");
        }
        let err = b.resume(&cut, 1).unwrap_err();
        assert!(err.to_string().contains("fresh outbox"), "{err}");
    }

    #[test]
    fn emit_sends_at_once_in_frames_cut_at_fixed_offsets_and_seqs_count_markers() {
        let links = mem(1, 1);
        let mut ob = outbox(Partitioner::Forward, &links, 4);
        ob.emit(&batch(0..3)).unwrap();
        assert_eq!(
            links[0][0].summary(),
            vec![('D', 0, 3, vec![0, 1, 2])],
            "fewer than batch_rows rows leave at once, as one frame"
        );
        assert_eq!(ob.next_seqs(), &[3]);
        // 7 rows → frames of 4 and 3, cut at offsets 0 and 4 of this batch (not of the
        // channel's row count, which is 3 here).
        ob.emit(&batch(3..10)).unwrap();
        ob.heartbeat(7).unwrap();
        ob.emit(&batch(10..11)).unwrap();
        ob.end().unwrap();
        assert_eq!(
            links[0][0].summary()[1..],
            [
                ('D', 3, 4, vec![3, 4, 5, 6]),
                ('D', 7, 3, vec![7, 8, 9]),
                ('H', 10, 7, vec![]),
                ('D', 11, 1, vec![10]),
                ('E', 12, 0, vec![]),
            ]
        );
        assert_eq!(ob.next_seqs(), &[13]);
        assert!(matches!(ob.emit(&batch(0..1)), Err(Error::Closed(_))));
        assert!(matches!(ob.heartbeat(8), Err(Error::Closed(_))));
    }

    #[test]
    fn every_replica_of_a_channel_gets_the_same_bytes() {
        let links = mem(1, 3);
        let mut ob = outbox(Partitioner::Forward, &links, 1024);
        ob.emit(&batch(0..5)).unwrap();
        ob.heartbeat(1).unwrap();
        for (i, f0) in links[0][0].frames.lock().iter().enumerate() {
            for l in &links[0][1..] {
                let f = l.frames.lock()[i].clone();
                assert!(Arc::ptr_eq(f0, &f), "one encoding shared by every replica");
            }
        }
    }

    /// Two outboxes standing for two replicas: the same emits and heartbeats, whatever the
    /// timing between them, give the same bytes on every channel and the same digests.
    #[test]
    fn replicas_emitting_the_same_batches_send_identical_frames_and_digests() {
        let run = |pause: bool| {
            let links = mem(3, 1);
            let mut ob = outbox(Partitioner::Rebalance, &links, 5);
            for (k, n) in [(0, 7), (7, 12), (19, 1), (20, 30)] {
                ob.emit(&batch(k..k + n)).unwrap();
                if pause {
                    std::thread::sleep(std::time::Duration::from_millis(3));
                }
                if k == 19 {
                    ob.heartbeat(1).unwrap();
                }
            }
            ob.end().unwrap();
            let frames: Vec<Vec<Vec<u8>>> = links
                .iter()
                .map(|ch| ch[0].frames.lock().iter().map(|f| f.to_vec()).collect())
                .collect();
            (frames, ob.take_digests())
        };
        let (frames_a, digests_a) = run(false);
        let (frames_b, digests_b) = run(true);
        assert_eq!(frames_a, frames_b);
        assert_eq!(digests_a, digests_b);
        assert_eq!(digests_a.len(), 6, "3 channels × (one heartbeat + end)");
    }

    #[test]
    fn heartbeats_carry_the_digest_of_the_frames_since_the_previous_one() {
        let links = mem(2, 1);
        let mut ob = outbox(Partitioner::Broadcast, &links, 4);
        ob.emit(&batch(0..6)).unwrap();
        ob.heartbeat(1).unwrap();
        ob.heartbeat(2).unwrap();
        ob.emit(&batch(6..7)).unwrap();
        ob.end().unwrap();
        // The same frames, digested independently.
        let mut want = CycleDigest::new();
        want.add(0, &batch(0..4)).unwrap();
        want.add(4, &batch(4..6)).unwrap();
        let cycle1 = want.close(1);
        let empty2 = want.close(2);
        want.add(8, &batch(6..7)).unwrap();
        let tail = want.close(u64::MAX);
        for (c, ch) in links.iter().enumerate() {
            let digests: Vec<Option<Digest>> = ch[0]
                .decoded()
                .into_iter()
                .filter_map(|f| match f {
                    Frame::Heartbeat { digest, .. } => Some(digest),
                    Frame::End { .. } => Some(None),
                    _ => None,
                })
                .collect();
            assert_eq!(
                digests,
                [Some(cycle1), Some(empty2), None],
                "channel {c}: end frames stay empty"
            );
        }
        assert_eq!(
            ob.take_digests(),
            [
                (0, 1, cycle1),
                (1, 1, cycle1),
                (0, 2, empty2),
                (1, 2, empty2),
                (0, u64::MAX, tail),
                (1, u64::MAX, tail),
            ]
        );
        assert!(ob.take_digests().is_empty(), "take_digests drains");
        // Other batch boundaries over the same rows → another digest.
        let links = mem(1, 1);
        let mut other = outbox(Partitioner::Forward, &links, 4);
        other.emit(&batch(0..3)).unwrap();
        other.emit(&batch(3..6)).unwrap();
        other.heartbeat(1).unwrap();
        assert_ne!(other.take_digests(), [(0, 1, cycle1)]);
    }

    #[test]
    fn the_digest_record_stays_bounded() {
        let links = mem(1, 1);
        let mut ob = outbox(Partitioner::Forward, &links, 4);
        for epoch in 0..DIGESTS_KEPT as u64 + 10 {
            ob.heartbeat(epoch).unwrap();
        }
        let kept = ob.take_digests();
        assert_eq!(kept.len(), DIGESTS_KEPT);
        assert_eq!(kept[0].1, 10, "the oldest were dropped first");
    }

    #[test]
    fn a_batch_that_cannot_be_digested_is_refused_whole() {
        let links = mem(2, 1);
        let mut ob = outbox(Partitioner::Broadcast, &links, 4);
        ob.emit(&batch(0..2)).unwrap();
        // A struct holding a dictionary of lists: the row format cannot encode it.
        let lists = arrow_array::ListArray::from_iter_primitive::<Int32Type, _, _>(vec![Some(
            vec![Some(1)],
        )]);
        let dict =
            arrow_array::DictionaryArray::<Int32Type>::try_new(vec![0, 0].into(), Arc::new(lists))
                .unwrap();
        let dict_field = Field::new("d", dict.data_type().clone(), false);
        let strukt = arrow_array::StructArray::new(
            vec![Arc::new(dict_field)].into(),
            vec![Arc::new(dict) as ArrayRef],
            None,
        );
        let bad = RecordBatch::try_from_iter([("st", Arc::new(strukt) as ArrayRef)]).unwrap();
        let err = ob.emit(&bad).unwrap_err();
        assert!(
            matches!(&err, Error::Config(m) if m.contains("\"st\"")),
            "{err}"
        );
        assert_eq!(ob.next_seqs(), &[2, 2], "no seq taken");
        assert_eq!(links[0][0].frames.lock().len(), 1, "nothing sent");
        assert_eq!(links[1][0].frames.lock().len(), 1, "nothing sent");
        ob.emit(&batch(2..3)).unwrap();
        assert_eq!(links[1][0].summary()[1], ('D', 2, 1, vec![2]));
    }

    #[test]
    fn heartbeat_follows_all_earlier_data_on_every_channel() {
        let links = mem(3, 1);
        let mut ob = outbox(Partitioner::Rebalance, &links, 1024);
        ob.emit(&batch(0..7)).unwrap();
        ob.heartbeat(1).unwrap();
        let s0 = links[0][0].summary();
        assert_eq!(s0, vec![('D', 0, 3, vec![0, 3, 6]), ('H', 3, 1, vec![])]);
        assert_eq!(
            links[1][0].summary(),
            vec![('D', 0, 2, vec![1, 4]), ('H', 2, 1, vec![])]
        );
        assert_eq!(
            links[2][0].summary(),
            vec![('D', 0, 2, vec![2, 5]), ('H', 2, 1, vec![])]
        );
        assert_eq!(ob.next_seqs(), &[4, 3, 3]);
    }

    #[test]
    fn rebalance_counter_runs_across_emits() {
        let links = mem(2, 1);
        let mut ob = outbox(Partitioner::Rebalance, &links, 1024);
        ob.emit(&batch(0..3)).unwrap(); // rows 0,1,2 → 0,1,0
        ob.emit(&batch(3..4)).unwrap(); // row 3 → 1 (a single-channel emit: no take)
        ob.emit(&batch(4..6)).unwrap(); // rows 4,5 → 0,1
        assert_eq!(
            links[0][0].summary(),
            vec![('D', 0, 2, vec![0, 2]), ('D', 2, 1, vec![4])]
        );
        assert_eq!(
            links[1][0].summary(),
            vec![
                ('D', 0, 1, vec![1]),
                ('D', 1, 1, vec![3]),
                ('D', 2, 1, vec![5])
            ]
        );
    }

    #[test]
    fn broadcast_sends_every_row_everywhere() {
        let links = mem(2, 2);
        let mut ob = outbox(Partitioner::Broadcast, &links, 2);
        ob.emit(&batch(0..3)).unwrap();
        ob.end().unwrap();
        for ch in &links {
            for l in ch {
                assert_eq!(
                    l.summary(),
                    vec![
                        ('D', 0, 2, vec![0, 1]),
                        ('D', 2, 1, vec![2]),
                        ('E', 3, 0, vec![])
                    ]
                );
            }
        }
    }

    fn keyed(keys: Arc<dyn Array>) -> RecordBatch {
        let n = keys.len() as i64;
        let schema = Arc::new(Schema::new(vec![
            Field::new("v", DataType::Int64, false),
            Field::new("k", keys.data_type().clone(), true),
        ]));
        RecordBatch::try_new(
            schema,
            vec![Arc::new(Int64Array::from_iter_values(0..n)), keys],
        )
        .unwrap()
    }

    /// Golden vectors: these exact assignments must never change (replicas built from
    /// different versions must route every key identically).
    #[test]
    fn hash_partition_golden_vectors() {
        let ints = keyed(Arc::new(Int64Array::from_iter_values(0..16)));
        let got = hash_channels(&ints, "k", 4, DEFAULT_KEY_GROUPS).unwrap();
        assert_eq!(got, GOLDEN_INT_4, "int64 keys 0..16 over 4 channels");
        // Every integer width hashes the value, not the representation.
        let i32s = keyed(Arc::new(Int32Array::from_iter_values(0..16)));
        assert_eq!(
            hash_channels(&i32s, "k", 4, DEFAULT_KEY_GROUPS).unwrap(),
            GOLDEN_INT_4
        );
        let strs = keyed(Arc::new(StringArray::from(vec![
            Some("alice"),
            Some("bob"),
            None,
            Some(""),
            Some("carol"),
            Some("dave"),
            Some("eve"),
            Some("mallory"),
        ])));
        let got = hash_channels(&strs, "k", 3, DEFAULT_KEY_GROUPS).unwrap();
        assert_eq!(got, GOLDEN_STR_3, "utf8 keys over 3 channels");
        // large_utf8 and binary hash the same bytes.
        let large = keyed(Arc::new(LargeStringArray::from(vec![
            Some("alice"),
            Some("bob"),
            None,
            Some(""),
            Some("carol"),
            Some("dave"),
            Some("eve"),
            Some("mallory"),
        ])));
        assert_eq!(
            hash_channels(&large, "k", 3, DEFAULT_KEY_GROUPS).unwrap(),
            GOLDEN_STR_3
        );
        let bin = keyed(Arc::new(BinaryArray::from(vec![
            Some(&b"alice"[..]),
            Some(b"bob"),
            None,
            Some(b""),
            Some(b"carol"),
            Some(b"dave"),
            Some(b"eve"),
            Some(b"mallory"),
        ])));
        assert_eq!(
            hash_channels(&bin, "k", 3, DEFAULT_KEY_GROUPS).unwrap(),
            GOLDEN_STR_3
        );
        assert_eq!(
            GOLDEN_STR_3[2], NULL_KEY_CHANNEL as u32,
            "null key → fixed channel"
        );
    }

    // Cross-checked against an independent implementation (python-xxhash 3.x), over the
    // default 128 key groups:
    //   xxhash.xxh3_64_intdigest(struct.pack("<q", i), seed=HASH_SEED) % 128 * 4 // 128
    //   xxhash.xxh3_64_intdigest(s.encode(), seed=HASH_SEED) % 128 * 3 // 128
    const GOLDEN_INT_4: [u32; 16] = [1, 1, 0, 0, 2, 2, 3, 3, 2, 0, 3, 3, 3, 3, 0, 0];
    const GOLDEN_STR_3: [u32; 8] = [1, 0, 0, 2, 0, 2, 1, 2];

    #[test]
    fn key_groups_split_into_contiguous_ranges_one_per_channel() {
        for groups in [1u32, 7, 128, 1000] {
            for n in 1..=groups.min(130) as usize {
                let chans: Vec<u32> = (0..groups)
                    .map(|g| key_group_channel(g, groups, n))
                    .collect();
                assert!(chans.windows(2).all(|w| w[0] <= w[1]), "{groups}/{n}");
                assert_eq!(chans[0], 0);
                assert_eq!(*chans.last().unwrap() as usize, n - 1);
                // Every channel takes at least floor(groups / n) groups, at most one more.
                for c in 0..n as u32 {
                    let size = chans.iter().filter(|&&x| x == c).count() as u32;
                    assert!(size == groups / n as u32 || size == groups / n as u32 + 1);
                }
            }
        }
        // Fewer key groups than channels: some channels get none (the planner refuses it).
        assert_eq!(key_group_channel(1, 2, 4), 2);
        let p = Partitioner::hash("k").with_key_groups(16).unwrap();
        assert_eq!(
            p,
            Partitioner::Hash {
                column: "k".to_owned(),
                key_groups: 16
            }
        );
        assert!(Partitioner::hash("k").with_key_groups(0).is_err());
        assert_eq!(
            Partitioner::Rebalance.with_key_groups(16).unwrap(),
            Partitioner::Rebalance
        );
    }

    #[test]
    fn hash_partition_routes_rows_and_keeps_emit_order_per_channel() {
        let links = mem(4, 1);
        let mut ob = outbox(Partitioner::hash("k"), &links, 1024);
        let b = keyed(Arc::new(Int64Array::from_iter_values(0..16)));
        ob.emit(&b).unwrap();
        for (c, ch) in links.iter().enumerate() {
            let want: Vec<i64> = (0..16)
                .filter(|&i| GOLDEN_INT_4[i as usize] == c as u32)
                .collect();
            let got: Vec<i64> = ch[0].summary().into_iter().flat_map(|s| s.3).collect();
            assert_eq!(got, want, "channel {c}");
        }
    }

    #[test]
    fn hash_partition_config_errors_name_the_column_and_type() {
        let links = mem(2, 1);
        let mut ob = outbox(Partitioner::hash("nope"), &links, 8);
        let msg = ob.emit(&batch(0..4)).unwrap_err().to_string();
        assert!(
            msg.contains("\"nope\"") && msg.contains("v (Int64)"),
            "{msg}"
        );
        let schema = Arc::new(Schema::new(vec![Field::new("f", DataType::Float64, false)]));
        let floats = RecordBatch::try_new(
            schema,
            vec![Arc::new(arrow_array::Float64Array::from(vec![1.0, 2.0]))],
        )
        .unwrap();
        let mut ob = outbox(Partitioner::hash("f"), &links, 8);
        let msg = ob.emit(&floats).unwrap_err().to_string();
        assert!(
            msg.contains("\"f\"") && msg.contains("Float64") && msg.contains("Utf8"),
            "{msg}"
        );
        // One channel: nothing to route, the key is still checked.
        let one = mem(1, 1);
        let mut ob = outbox(Partitioner::hash("f"), &one, 8);
        assert!(matches!(ob.emit(&floats), Err(Error::Config(m)) if m.contains("Float64")));
        assert_eq!(ob.next_seqs(), &[0], "rejected rows take no seq");
    }

    #[test]
    fn dead_link_is_dropped_and_the_survivor_keeps_receiving() {
        let links = mem(2, 2);
        let mut ob = outbox(Partitioner::Broadcast, &links, 1);
        ob.emit(&batch(0..1)).unwrap();
        *links[0][0].fail.lock() = true;
        ob.emit(&batch(1..2)).unwrap();
        assert_eq!(ob.live_links(0), 1);
        assert_eq!(ob.live_links(1), 2);
        *links[0][0].fail.lock() = false; // a dropped link never comes back
        ob.emit(&batch(2..3)).unwrap();
        assert_eq!(links[0][0].frames.lock().len(), 1);
        assert_eq!(links[0][1].frames.lock().len(), 3);
        assert_eq!(links[1][0].frames.lock().len(), 3);
    }

    /// A link to another process whose peer reads as slowly as the test says.
    #[derive(Clone, Default)]
    struct SlowLink {
        sent: Arc<Mutex<usize>>,
        /// Frames waiting for the peer, and for how long the oldest has.
        backlog: Arc<Mutex<(usize, Duration)>>,
        aborted: Arc<Mutex<bool>>,
        /// The peer closed its end: the next send fails.
        closed: Arc<Mutex<bool>>,
    }

    impl Link for SlowLink {
        fn send(&mut self, _frame: &OutFrame) -> Result<()> {
            if *self.closed.lock() {
                return Err(Error::Closed("the peer closed its end".to_owned()));
            }
            *self.sent.lock() += 1;
            Ok(())
        }
        fn backlog(&self) -> usize {
            self.backlog.lock().0
        }
        fn backed_up_for(&self, _now: Instant) -> Option<Duration> {
            Some(self.backlog.lock().1)
        }
        fn abort(&mut self) {
            *self.aborted.lock() = true;
        }
        fn peer_closed(&self) -> bool {
            *self.closed.lock()
        }
    }

    #[test]
    fn a_link_whose_peer_closed_holds_nothing_back_and_the_next_send_drops_it() {
        // The worker serves a slot only while its backlog is under the credit; a backlog
        // left in a link whose downstream replica retired would never drain, and the slot
        // would never send again to find the link dead.
        let (live, gone) = (SlowLink::default(), SlowLink::default());
        let links: Vec<Box<dyn Link>> = vec![Box::new(live.clone()), Box::new(gone.clone())];
        let mut ob =
            Outbox::new(Partitioner::Forward, vec![links], OutboxConfig::default()).unwrap();
        *gone.backlog.lock() = (64, Duration::from_secs(5));
        assert_eq!(ob.backlog(), 64);
        *gone.closed.lock() = true;
        assert_eq!(ob.backlog(), 0);
        ob.emit(&batch(0..3)).unwrap();
        assert_eq!(ob.live_links(0), 1);
        assert_eq!((*live.sent.lock(), *gone.sent.lock()), (1, 0));
    }

    #[test]
    fn a_straggler_is_dropped_while_its_twin_keeps_up_and_never_holds_the_sender_back() {
        let ev = Eviction {
            frames: 8,
            after: Duration::from_millis(500),
        };
        let (fast, slow) = (SlowLink::default(), SlowLink::default());
        let links: Vec<Box<dyn Link>> = vec![Box::new(fast.clone()), Box::new(slow.clone())];
        let mut ob =
            Outbox::new(Partitioner::Forward, vec![links], OutboxConfig::default()).unwrap();
        // Without eviction the slowest link is the backlog the worker's credit rule reads.
        *slow.backlog.lock() = (5, Duration::from_millis(100));
        assert_eq!(ob.backlog(), 5);
        ob.evicting(Some(ev));
        // With it, the channel's least backed-up link is; a short lag is tolerated.
        assert_eq!(ob.backlog(), 0);
        ob.emit(&batch(0..3)).unwrap();
        assert_eq!((*fast.sent.lock(), *slow.sent.lock()), (1, 1));
        assert_eq!(ob.live_links(0), 2);
        // Every replica of the channel slow: back-pressure, nobody is dropped.
        *fast.backlog.lock() = (9, Duration::from_secs(2));
        *slow.backlog.lock() = (9, Duration::from_secs(2));
        ob.flush();
        assert_eq!((ob.live_links(0), ob.backlog()), (2, 9));
        // One slow for too long while the other keeps up: dropped, by time or by queue.
        for lag in [(1, Duration::from_millis(600)), (8, Duration::ZERO)] {
            let (fast, slow) = (SlowLink::default(), SlowLink::default());
            let links: Vec<Box<dyn Link>> = vec![Box::new(slow.clone()), Box::new(fast.clone())];
            let mut ob =
                Outbox::new(Partitioner::Forward, vec![links], OutboxConfig::default()).unwrap();
            ob.evicting(Some(ev));
            *slow.backlog.lock() = lag;
            ob.emit(&batch(0..3)).unwrap();
            assert!(*slow.aborted.lock(), "{lag:?}");
            assert_eq!((*fast.sent.lock(), *slow.sent.lock()), (1, 0));
            assert_eq!((ob.live_links(0), ob.backlog()), (1, 0));
        }
        // Nor one whose only twin keeping up is gone (killed a moment ago: its queue is
        // empty until a send finds it dead); the gone one is dropped by that send.
        let (gone, slow) = (SlowLink::default(), SlowLink::default());
        let links: Vec<Box<dyn Link>> = vec![Box::new(slow.clone()), Box::new(gone.clone())];
        let mut ob =
            Outbox::new(Partitioner::Forward, vec![links], OutboxConfig::default()).unwrap();
        ob.evicting(Some(ev));
        *slow.backlog.lock() = (9, Duration::from_secs(2));
        *gone.closed.lock() = true;
        ob.emit(&batch(0..3)).unwrap();
        assert!(!*slow.aborted.lock(), "the last replica there was dropped");
        assert_eq!(ob.live_links(0), 1);
        assert_eq!(*slow.sent.lock(), 1);
        // A channel's only replica is never dropped, however slow.
        let only = SlowLink::default();
        *only.backlog.lock() = (100, Duration::from_secs(60));
        let mut ob = Outbox::new(
            Partitioner::Forward,
            vec![vec![Box::new(only.clone()) as Box<dyn Link>]],
            OutboxConfig::default(),
        )
        .unwrap();
        ob.evicting(Some(ev));
        ob.emit(&batch(0..1)).unwrap();
        assert!(!*only.aborted.lock());
        assert_eq!(ob.backlog(), 100);
    }

    #[test]
    fn a_channel_with_every_link_dead_goes_quiet_while_others_are_served_on() {
        // Channel 1's downstream replicas finished on this replica's twin's copies (or are
        // gone): channel 0's may have no other feed than this replica, which goes on.
        let links = mem(2, 2);
        let mut ob = outbox(Partitioner::Broadcast, &links, 1);
        *links[1][0].fail.lock() = true;
        *links[1][1].fail.lock() = true;
        ob.emit(&batch(0..1)).unwrap();
        assert_eq!(ob.live_links(1), 0);
        ob.heartbeat(1).unwrap();
        ob.emit(&batch(1..2)).unwrap();
        for link in &links[0] {
            let kinds: Vec<char> = link.summary().iter().map(|f| f.0).collect();
            assert_eq!(kinds, ['D', 'H', 'D'], "channel 0 is served on");
        }
        // No channel left: nothing this replica sends reaches anyone.
        *links[0][0].fail.lock() = true;
        *links[0][1].fail.lock() = true;
        let err = ob.emit(&batch(2..3)).unwrap_err();
        assert!(
            matches!(&err, Error::Closed(m) if m.contains("no output channel")),
            "{err}"
        );
        assert!(matches!(ob.heartbeat(2), Err(Error::Closed(_))));
    }

    #[test]
    fn bad_configurations_are_rejected() {
        let cfg = OutboxConfig::default();
        let none = Outbox::new(Partitioner::Rebalance, vec![], cfg.clone());
        assert!(matches!(none, Err(Error::Config(_))));
        let empty = Outbox::new(Partitioner::Rebalance, vec![vec![]], cfg.clone());
        assert!(matches!(empty, Err(Error::Config(m)) if m.contains("channel 0")));
        let two = vec![
            vec![Box::new(MemLink::default()) as Box<dyn Link>],
            vec![Box::new(MemLink::default()) as Box<dyn Link>],
        ];
        let fwd = Outbox::new(Partitioner::Forward, two, cfg);
        assert!(matches!(fwd, Err(Error::Config(m)) if m.contains("got 2")));
        let zero = OutboxConfig { batch_rows: 0 };
        let one = vec![vec![Box::new(MemLink::default()) as Box<dyn Link>]];
        assert!(matches!(
            Outbox::new(Partitioner::Forward, one, zero),
            Err(Error::Config(_))
        ));
        assert!(Partitioner::parse("hash", None).is_err());
        assert!(Partitioner::parse("forward", Some("k")).is_err());
        assert!(Partitioner::parse("shuffle", None)
            .unwrap_err()
            .to_string()
            .contains("shuffle"));
        assert_eq!(
            Partitioner::parse("hash", Some("k")).unwrap(),
            Partitioner::hash("k")
        );
    }

    #[test]
    fn a_schema_change_keeps_seqs_contiguous() {
        let links = mem(1, 1);
        let mut ob = outbox(Partitioner::Forward, &links, 1024);
        ob.emit(&batch(0..2)).unwrap();
        let other = keyed(Arc::new(Int64Array::from_iter_values(0..3)));
        ob.emit(&other).unwrap();
        ob.heartbeat(1).unwrap();
        let s = links[0][0].summary();
        assert_eq!(
            s,
            vec![
                ('D', 0, 2, vec![0, 1]),
                ('D', 2, 3, vec![0, 1, 2]),
                ('H', 5, 1, vec![])
            ]
        );
    }
}
