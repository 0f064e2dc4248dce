//! Transport: the receiving [`Inbox`] (listener, handshakes, its connections read by a
//! [`Reactor`], dedup, merge), the sending [`TcpLink`] (dialer, one writer thread, bounded
//! queue) and
//! the [`LocalLink`] between two replicas of one worker (the Arrow batch itself, straight
//! into the inbox's dedup: no encoding, no socket, no thread).
//!
//! Receive path, per connection (DESIGN §2 invariants 2 and 5):
//!
//! ```text
//! socket → handshake (who is this?  a short-lived thread)
//!        → the reactor (one thread per worker, epoll): FrameReader → dedup sender
//!                                                     │ Full: hold the item, stop reading
//!                                                     │       until the producer bell rings
//!                                                     │       (back-pressure: the socket is not
//!                                                     │       read, TCP's window closes, the
//!                                                     │       sender blocks)
//!                                                     │ Gap:  hold, retry when `next` moves
//! LocalLink::send (same process) ──── check digest ──────────► dedup sender ◄┤
//! Inbox::next() ← merge (none | liverobin | positional) ← dedup receivers ◄┘
//!                     ▲ orders (positional only)
//!                     └── OrderFeed::offer_frame ← the KaZoo order log, read by the orderer
//! ```
//!
//! A logical input channel is one upstream partition `(task, partition)`; its position in
//! [`InboxConfig::upstreams`] is its channel index at every replica (the merge relies on
//! every replica numbering channels identically). Every replica of that upstream partition
//! connects and sends the same sequence; dedup keeps the first copy. A connection that
//! misbehaves (bad handshake, unknown sender, malformed frame) is closed on its own: the
//! other connections, and therefore the other replicas, are unaffected.
//!
//! The reactor ([`crate::reactor`]) serves every inbox of a worker
//! ([`InboxConfig::reactor`]); a connection is one [`Source`] on it, with its own frame
//! decoder and the item its channel could not take yet. One connection held back by its
//! channel does not stop the reactor reading the others.
//!
//! Determinism is checked online (DESIGN §2 invariant 4): a heartbeat frame carries the
//! sender's digest of its channel's Data frames since the previous heartbeat. The reactor
//! compares it, for every connection, with the digest of the same cycle from the replica
//! whose copy came first; a difference is a [`Divergence`], which fails [`Inbox::next`] or is
//! logged ([`OnDivergence`]). Only heartbeat frames touch the digest table.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use arrow_array::RecordBatch;
use log::Level;
use parking_lot::{Condvar, Mutex};

use crate::dedup::{self, DedupReceiver, DedupSender, Offer};
use crate::digest::{to_hex, Digest};
use crate::logs::{log_replica, ReplicaTag, INBOX};
use crate::merge::{self, Merge, MergeCut, OrderingMode};
use crate::orderlog::{Leader, OrderLog, OrderLogCut, OrderLogStats, Verdict};
use crate::outbox::{Link, OutFrame};
use crate::reactor::{Reactor, Source, Turn};
use crate::socket::{self, Listener, Stream};
use crate::sync::{Doorbell, Wake};
use crate::wire::{self, Frame, FrameReader, Identity, Next};
use crate::{Chunk, Delivery, Error, Item, Result};

/// How long a blocked accept thread or writer goes without re-checking for shutdown.
const POLL: Duration = Duration::from_millis(50);
/// Bytes the reactor takes from a connection's socket per read, at most.
const READ_BUFFER_BYTES: usize = 64 << 10;
/// How long `close` waits to reach its own listener, which wakes the accept thread.
const ACCEPT_WAKE_TIMEOUT: Duration = Duration::from_secs(1);
/// How long `close` waits for the reactor to end the inbox's connections.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);
/// Closed connections kept for [`Inbox::stats`]; older ones are forgotten so a stream of
/// bad connections cannot grow memory.
const CLOSED_CONNECTIONS_KEPT: usize = 64;
/// Heartbeat cycles per logical channel whose first digest is kept for comparison: a copy
/// arriving more than this many cycles after the first one is not checked.
pub const DIGEST_EPOCHS_KEPT: usize = 4096;
/// Divergences kept in [`InboxStats::divergences`] (all are counted).
pub const DIVERGENCES_KEPT: usize = 16;

// ───────────────────────────── receiving side ─────────────────────────────

/// What an [`Inbox`] does when two replicas of an upstream partition send different digests
/// for the same heartbeat cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnDivergence {
    /// [`Inbox::next`] fails with [`Error::Determinism`] from then on: the output may
    /// already mix both replicas' versions, so the job should stop.
    #[default]
    Fail,
    /// Log one line per input channel (the first divergence on it), count every divergence
    /// in [`InboxStats`], and keep delivering.
    Log,
}

impl OnDivergence {
    /// Parse the Python-facing name (`"fail"` or `"log"`).
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "fail" => Ok(OnDivergence::Fail),
            "log" => Ok(OnDivergence::Log),
            other => Err(Error::Config(format!(
                "on_divergence must be 'fail' or 'log', got {other:?}"
            ))),
        }
    }
}

/// Two replicas of one upstream partition sent different digests for one heartbeat cycle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Divergence {
    /// Logical input channel (the upstream's index in [`InboxConfig::upstreams`]).
    pub channel: usize,
    /// The upstream partition `(task, partition)`.
    pub upstream: (u32, u32),
    /// The heartbeat cycle.
    pub epoch: u64,
    /// The replica whose copy of the heartbeat arrived first, and the one that differed.
    pub replicas: (u32, u32),
    /// Their digests, in the order of `replicas`.
    pub digests: (Digest, Digest),
}

impl fmt::Display for Divergence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (task, partition) = self.upstream;
        let (a, b) = self.replicas;
        write!(
            f,
            "replicas {a} and {b} of upstream task {task} partition {partition} (input channel \
             {}) sent different output digests for heartbeat cycle {}: {} (replica {a}) vs {} \
             (replica {b})",
            self.channel,
            self.epoch,
            to_hex(&self.digests.0),
            to_hex(&self.digests.1),
        )
    }
}

impl Divergence {
    /// The error [`Inbox::next`] fails with under [`OnDivergence::Fail`].
    fn error(&self) -> Error {
        Error::Determinism(format!(
            "{self}. The replicas' outputs differ, so the operator of task {} is not \
             deterministic for a given input batch: it must compute the same output batches \
             from the same input batch (no clocks, randomness or iteration over unordered \
             collections), and the output downstream may already mix both versions. To keep \
             the job running and only log divergences, use on_divergence=\"log\".",
            self.upstream.0
        ))
    }
}

/// The first digest of each recent heartbeat cycle of one logical channel, with the replica
/// that sent it: what the copies from the other replicas are compared with.
#[derive(Default)]
struct CycleDigests {
    /// epoch → (replica, digest) of the first copy; the last [`DIGEST_EPOCHS_KEPT`] epochs.
    first: BTreeMap<u64, (u32, Digest)>,
}

impl CycleDigests {
    /// Record or compare the digest of cycle `epoch` sent by `replica`. Returns the first
    /// copy `(replica, digest)` when it came from another replica and differs.
    fn check(&mut self, epoch: u64, replica: u32, digest: Digest) -> Option<(u32, Digest)> {
        use std::collections::btree_map::Entry;
        match self.first.entry(epoch) {
            Entry::Occupied(e) => {
                let (r, d) = *e.get();
                (r != replica && d != digest).then_some((r, d))
            }
            Entry::Vacant(v) => {
                v.insert((replica, digest));
                if self.first.len() > DIGEST_EPOCHS_KEPT {
                    self.first.pop_first();
                }
                None
            }
        }
    }
}

/// Settings of an [`Inbox`].
#[derive(Debug, Clone)]
pub struct InboxConfig {
    /// Job id every peer must present in the handshake.
    pub job: String,
    /// Per-job secret peers prove knowledge of.
    pub secret: Vec<u8>,
    /// The upstream partitions `(task, partition)` this inbox reads, in the fixed order
    /// that defines logical channel indices.
    pub upstreams: Vec<(u32, u32)>,
    /// Consumption order over the logical channels.
    pub ordering: OrderingMode,
    /// Elements (frames) queued per logical channel before readers stop reading.
    pub queue_capacity: usize,
    /// Largest frame body accepted.
    pub max_frame_bytes: u64,
    /// Address to bind.
    pub host: IpAddr,
    /// Port to bind (0 = let the OS pick; see [`Inbox::local_addr`]).
    pub port: u16,
    /// Read/write timeout during the handshake: a silent peer is dropped after this.
    pub handshake_timeout: Duration,
    /// What a divergence between upstream replicas does (see [`OnDivergence`]).
    pub on_divergence: OnDivergence,
    /// The doorbell rung when input arrives; None: the inbox's own. The inboxes of one
    /// worker share one, so the worker sleeps on all of them at once.
    pub bell: Option<Arc<Doorbell>>,
    /// Positional (KaZoo) inboxes: the doorbell rung when input arrives or an order is
    /// followed; None: the inbox's own. The KaZoo inboxes of one worker share one, so a
    /// single [`OrderPublisher`] serves every partition the worker leads.
    pub order_bell: Option<Arc<Doorbell>>,
    /// The replica this inbox receives for, as its log lines name it; None: they name the
    /// inbox by its address.
    pub me: Option<ReplicaTag>,
    /// The reactor that reads this inbox's connections; None: the inbox's own. The inboxes
    /// of one worker share one ([`crate::worker::Worker::reactor`]): one thread reads
    /// every connection of the worker.
    pub reactor: Option<Arc<Reactor>>,
    /// Start from a twin's cut ([`Inbox::cut`]) instead of from the beginning of every
    /// channel: a replica rebuilt while the job runs.
    pub resume: Option<InboxCut>,
    /// A channel whose every upstream replica is gone before its end waits for one to come
    /// back (a replica rolled back to a checkpoint: replication 1) instead of failing.
    pub wait_orphaned: bool,
}

/// Where an inbox stands at a heartbeat-cycle boundary: per logical channel the first
/// sequence number not yet consumed, and the merge's state. A replica resumed from it and
/// fed every channel from there consumes exactly what its twin consumes after the cut.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxCut {
    pub positions: Vec<u64>,
    pub merge: MergeCut,
    /// KaZoo: where the replica stood in the order log (None for the other orders).
    pub log: Option<OrderLogCut>,
}

impl InboxConfig {
    /// Defaults: LiveRobin (one whole batch per turn), 1,024 queued frames per channel, the
    /// wire's default frame limit, 127.0.0.1, any port, 2 s handshake timeout, a divergence
    /// between upstream replicas fails the inbox.
    pub fn new(
        job: impl Into<String>,
        secret: impl Into<Vec<u8>>,
        upstreams: Vec<(u32, u32)>,
    ) -> Self {
        InboxConfig {
            job: job.into(),
            secret: secret.into(),
            upstreams,
            ordering: OrderingMode::LiveRobin,
            queue_capacity: 1024,
            max_frame_bytes: wire::DEFAULT_MAX_FRAME_BYTES,
            host: IpAddr::from([127, 0, 0, 1]),
            port: 0,
            handshake_timeout: Duration::from_secs(2),
            on_divergence: OnDivergence::Fail,
            bell: None,
            order_bell: None,
            me: None,
            reactor: None,
            resume: None,
            wait_orphaned: false,
        }
    }

    fn validate(&self) -> Result<()> {
        if self.upstreams.is_empty() {
            return Err(Error::Config(
                "upstreams is empty; an inbox needs at least one upstream (task, partition)"
                    .to_owned(),
            ));
        }
        let mut seen = self.upstreams.clone();
        seen.sort_unstable();
        if let Some(w) = seen.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::Config(format!(
                "upstreams lists (task, partition) {:?} twice; each upstream partition is one \
                 logical channel",
                w[0]
            )));
        }
        if self.queue_capacity == 0 {
            return Err(Error::Config(
                "queue_capacity must be ≥ 1 (got 0)".to_owned(),
            ));
        }
        if self.max_frame_bytes == 0 {
            return Err(Error::Config(
                "max_frame_bytes must be ≥ 1 (got 0)".to_owned(),
            ));
        }
        if self.handshake_timeout.is_zero() {
            return Err(Error::Config("handshake_timeout must be > 0".to_owned()));
        }
        Ok(())
    }
}

/// Counters of one logical input channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChannelStats {
    /// The upstream partition `(task, partition)` this channel reads.
    pub upstream: (u32, u32),
    /// Rows kept (first copies).
    pub accepted_rows: u64,
    /// Rows dropped because another replica's copy arrived first.
    pub duplicate_rows: u64,
    /// First seq not yet accepted (dedup's high-water mark).
    pub next_seq: u64,
    /// Seqs accepted but not yet taken by the merge: the queue's backlog, bounded by
    /// `queue_capacity` frames.
    pub queued_seqs: u64,
}

/// Counters of one connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectionStats {
    pub peer: String,
    /// Who the peer proved to be (None if the handshake did not complete).
    pub identity: Option<Identity>,
    /// Frames read after the handshake.
    pub frames: u64,
    /// Bytes read, handshake included.
    pub bytes: u64,
    /// Still being served.
    pub open: bool,
    /// Why it was closed, if not by a clean end of stream.
    pub error: Option<String>,
}

/// Snapshot of an inbox's counters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxStats {
    pub channels: Vec<ChannelStats>,
    pub connections: Vec<ConnectionStats>,
    /// Connections refused: failed handshake, unknown sender, or a protocol error
    /// before the first valid frame.
    pub rejected_connections: u64,
    /// The first [`DIVERGENCES_KEPT`] divergences between upstream replicas, in the order
    /// they were found.
    pub divergences: Vec<Divergence>,
    /// Every divergence found.
    pub divergence_count: u64,
    /// How long the merge held input back: the total time during which some input channel
    /// had accepted elements queued and the merge delivered nothing (LiveRobin waiting for
    /// the channel whose turn it is, a KaZoo follower waiting for an order).
    pub merge_wait: Duration,
}

#[derive(Default)]
struct ChannelCounters {
    accepted_rows: AtomicU64,
    duplicate_rows: AtomicU64,
    /// Wire channel number the upstream uses for this logical channel (`u64::MAX` until
    /// the first frame): every connection of one upstream partition must agree.
    wire_channel: AtomicU64,
    /// Connections (past the handshake) and local links feeding this channel now.
    feeders: AtomicU64,
    /// Whether any ever did.
    fed: AtomicBool,
    /// Whether the channel's end marker was accepted.
    ended: AtomicBool,
}

impl ChannelCounters {
    fn feed(&self) {
        self.feeders.fetch_add(1, Ordering::SeqCst);
        self.fed.store(true, Ordering::SeqCst);
    }

    /// Whether every upstream replica that fed this channel is gone (or dropped this
    /// replica) before its end: what is missing will never come.
    fn orphaned(&self) -> bool {
        self.fed.load(Ordering::SeqCst)
            && self.feeders.load(Ordering::SeqCst) == 0
            && !self.ended.load(Ordering::SeqCst)
    }
}

struct ConnCounters {
    peer: String,
    identity: Mutex<Option<Identity>>,
    frames: AtomicU64,
    bytes: AtomicU64,
    open: AtomicBool,
    error: Mutex<Option<String>>,
    /// A second handle on the socket so `close()` can shut it down at once, whether it is
    /// in its handshake or on the reactor. Dropped when the connection ends, so the socket
    /// really closes then (the peer sees it at once) rather than when the inbox goes away.
    handle: Mutex<Option<Stream>>,
    /// The logical channel the peer feeds, once its handshake is accepted (else `usize::MAX`).
    channel: AtomicUsize,
}

struct Conn {
    counters: Arc<ConnCounters>,
    /// The thread of its handshake (which hands the connection to the reactor).
    handshake: Option<JoinHandle<()>>,
}

/// State shared by the accept threads, the handshake threads, the reactor and the consumer.
struct Shared {
    job: String,
    secret: Vec<u8>,
    upstreams: Vec<(u32, u32)>,
    senders: Vec<DedupSender<RecordBatch>>,
    channels: Vec<ChannelCounters>,
    max_frame_bytes: u64,
    handshake_timeout: Duration,
    stop: AtomicBool,
    conns: Mutex<Vec<Conn>>,
    rejected: AtomicU64,
    order_frames_logged: AtomicBool,
    on_divergence: OnDivergence,
    /// Per logical channel, its recent cycles' first digests (touched by heartbeats only).
    cycle_digests: Vec<Mutex<CycleDigests>>,
    /// Per logical channel, whether a divergence on it was logged already.
    divergence_logged: Vec<AtomicBool>,
    divergences: Mutex<Vec<Divergence>>,
    divergence_count: AtomicU64,
    /// Wakes the consumer when a divergence must fail it.
    bell: Arc<Doorbell>,
    /// The replica this inbox receives for (log lines).
    me: Option<ReplicaTag>,
    /// How log lines name this inbox: its replica's name, or its address.
    who: String,
}

/// The receiving side of one task partition replica. See the module documentation.
pub struct Inbox {
    shared: Arc<Shared>,
    receivers: Vec<DedupReceiver<RecordBatch>>,
    merge: Box<dyn Merge<RecordBatch>>,
    /// The order log the positional (KaZoo) merge follows, and the bell rung when input
    /// arrives at this inbox or an order is followed; None for the other orderings.
    orders: Option<(Arc<Mutex<OrderLog>>, Arc<Doorbell>)>,
    bell: Arc<Doorbell>,
    /// Reads the established connections.
    reactor: Arc<Reactor>,
    local_addr: SocketAddr,
    accept: Option<JoinHandle<()>>,
    /// The accept thread of the Unix socket paired with `local_addr` (see [`socket`]).
    local_accept: Option<JoinHandle<()>>,
    /// Merge wait ended so far (see [`InboxStats::merge_wait`]).
    merge_wait: Duration,
    /// Since when the merge has held queued input back, if it does now.
    held_since: Option<Instant>,
    /// See [`InboxConfig::wait_orphaned`].
    wait_orphaned: bool,
}

impl Inbox {
    /// Bind the listener and start accepting connections.
    pub fn bind(cfg: InboxConfig) -> Result<Self> {
        cfg.validate()?;
        let addr = SocketAddr::new(cfg.host, cfg.port);
        let listener = TcpListener::bind(addr).map_err(|e| {
            Error::Io(io::Error::new(
                e.kind(),
                format!("cannot listen on {addr}: {e}"),
            ))
        })?;
        let local_addr = listener.local_addr()?;
        let bell = cfg.bell.clone().unwrap_or_default();
        let reactor = match cfg.reactor.clone() {
            Some(r) => r,
            None => Arc::new(Reactor::new()),
        };
        let wait_orphaned = cfg.wait_orphaned;
        let n = cfg.upstreams.len();
        if let Some(cut) = &cfg.resume {
            if cut.positions.len() != n {
                return Err(Error::Config(format!(
                    "a cut of {} input channels cannot resume an inbox of {n}",
                    cut.positions.len()
                )));
            }
        }
        let start = |c: usize| cfg.resume.as_ref().map_or(0, |cut| cut.positions[c]);
        let positional = matches!(cfg.ordering, OrderingMode::Positional);
        // The KaZoo leader waits for this inbox's arrivals (and followed orders) only, not
        // for every arrival of the worker the shared `bell` rings for.
        let order_bell = positional.then(|| cfg.order_bell.clone().unwrap_or_default());
        let (senders, receivers): (Vec<_>, Vec<_>) = (0..n)
            .map(|c| {
                dedup::channel_watched(
                    start(c),
                    cfg.queue_capacity,
                    Arc::clone(&bell),
                    order_bell.clone(),
                )
            })
            .unzip();
        let shared = Arc::new(Shared {
            job: cfg.job,
            secret: cfg.secret,
            upstreams: cfg.upstreams,
            senders,
            channels: (0..n)
                .map(|_| ChannelCounters {
                    wire_channel: AtomicU64::new(u64::MAX),
                    ..Default::default()
                })
                .collect(),
            max_frame_bytes: cfg.max_frame_bytes,
            handshake_timeout: cfg.handshake_timeout,
            stop: AtomicBool::new(false),
            conns: Mutex::new(Vec::new()),
            rejected: AtomicU64::new(0),
            order_frames_logged: AtomicBool::new(false),
            on_divergence: cfg.on_divergence,
            cycle_digests: (0..n).map(|_| Mutex::default()).collect(),
            divergence_logged: (0..n).map(|_| AtomicBool::new(false)).collect(),
            divergences: Mutex::new(Vec::new()),
            divergence_count: AtomicU64::new(0),
            bell: Arc::clone(&bell),
            who: cfg
                .me
                .as_ref()
                .map_or_else(|| format!("inbox at {local_addr}"), |m| m.name.clone()),
            me: cfg.me,
        });
        let local = socket::listen_local(local_addr);
        let accept = {
            let shared = Arc::clone(&shared);
            let reactor = Arc::clone(&reactor);
            let listener = Listener::Tcp(listener);
            std::thread::Builder::new()
                .name(format!("tandem-accept-{}", local_addr.port()))
                .spawn(move || accept_loop(&shared, &reactor, &listener))?
        };
        let local_accept = match local {
            Some(l) => {
                let shared = Arc::clone(&shared);
                let reactor = Arc::clone(&reactor);
                let listener = Listener::Unix(l);
                Some(
                    std::thread::Builder::new()
                        .name(format!("tandem-accept-{}u", local_addr.port()))
                        .spawn(move || accept_loop(&shared, &reactor, &listener))?,
                )
            }
            None => None,
        };
        let log = match cfg.resume.as_ref().and_then(|c| c.log.as_ref()) {
            Some(cut) if order_bell.is_some() => OrderLog::resumed(n, cut)?,
            None if order_bell.is_some() && cfg.resume.is_some() => {
                return Err(Error::Config(
                    "a KaZoo replica resumes from a twin's cut that carries its place in the \
                     order log; this one has none"
                        .to_owned(),
                ))
            }
            _ => OrderLog::new(n),
        };
        let orders = order_bell.map(|bell| (Arc::new(Mutex::new(log)), bell));
        let mut merge = merge::build(&cfg.ordering, n);
        if let Some(cut) = &cfg.resume {
            merge.resume(&cut.merge, &cut.positions)?;
            for (c, &ended) in cut.merge.ended.iter().enumerate() {
                shared.channels[c].ended.store(ended, Ordering::SeqCst);
            }
        }
        Ok(Inbox {
            shared,
            receivers,
            merge,
            orders,
            bell,
            reactor,
            local_addr,
            accept: Some(accept),
            local_accept,
            merge_wait: Duration::ZERO,
            held_since: None,
            wait_orphaned,
        })
    }

    /// The number of logical input channels.
    pub fn channels(&self) -> usize {
        self.receivers.len()
    }

    /// A link through which `me`, a replica of an upstream partition living in this
    /// process, sends to this inbox without encoding or a socket. Its copies deduplicate
    /// against the copies the other replicas of `me`'s partition send over TCP, and its
    /// heartbeats' digests are compared with theirs, exactly as for a connection.
    pub fn local_link(&self, me: &Identity) -> Result<LocalLink> {
        let shared = &self.shared;
        if me.job != shared.job {
            return Err(Error::Handshake(format!(
                "a local link of job {:?} to an inbox of job {:?}",
                me.job, shared.job
            )));
        }
        let idx = shared
            .upstreams
            .iter()
            .position(|&(t, p)| t == me.task && p == me.partition)
            .ok_or_else(|| {
                Error::Config(format!(
                    "(task {}, partition {}) is not an upstream of the inbox at {} (upstreams: \
                     {:?})",
                    me.task, me.partition, self.local_addr, shared.upstreams
                ))
            })?;
        shared.channels[idx].feed();
        Ok(LocalLink {
            shared: Arc::clone(shared),
            idx,
            replica: me.replica,
            pending: VecDeque::new(),
            peer: self.local_addr,
            feeding: true,
        })
    }

    /// The address peers dial (the actual port when bound with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The next delivery in this replica's consumption order, waiting up to `timeout` for
    /// input. `Ok(None)` on timeout. After every upstream ended, returns `Delivery::End`.
    /// Under [`OnDivergence::Fail`], fails with [`Error::Determinism`] (naming the first
    /// divergence) as soon as one has been found, and on every call after.
    pub fn next(&mut self, timeout: Duration) -> Result<Option<Delivery<RecordBatch>>> {
        let deadline = Instant::now().checked_add(timeout);
        loop {
            // Read the generation before looking, so an arrival between the look and the
            // sleep still wakes us.
            let seen = self.bell.generation();
            if self.shared.on_divergence == OnDivergence::Fail
                && self.shared.divergence_count.load(Ordering::SeqCst) > 0
            {
                if let Some(d) = self.shared.divergences.lock().first() {
                    return Err(d.error());
                }
            }
            if let Some((log, _)) = &self.orders {
                for (channel, up_to_seq) in log.lock().drain() {
                    self.merge.push_order(channel, up_to_seq)?;
                }
            }
            if let Some(d) = self.merge.next(&mut self.receivers) {
                if let Some(since) = self.held_since.take() {
                    self.merge_wait += since.elapsed();
                }
                return Ok(Some(d));
            }
            self.note_held();
            if let Some(c) = self
                .shared
                .channels
                .iter()
                .position(ChannelCounters::orphaned)
                .filter(|_| !self.wait_orphaned)
            {
                let (task, partition) = self.shared.upstreams[c];
                return Err(Error::Closed(format!(
                    "input channel {c} (upstream task {task} partition {partition}) lost every \
                     upstream replica feeding it before its end (gone, or they dropped this \
                     replica as a straggler): this replica cannot go on"
                )));
            }
            if self.accept.is_none() {
                return Err(Error::Closed("inbox.next() after close()".to_owned()));
            }
            let now = Instant::now();
            let left = match deadline {
                Some(d) if d <= now => return Ok(None),
                Some(d) => d - now,
                None => Duration::from_secs(3600),
            };
            self.bell.wait(seen, left);
        }
    }

    /// Where this inbox stands now, if its merge can be cut here (see [`InboxCut`]): call
    /// right after a delivery that ended a heartbeat cycle.
    pub fn cut(&self) -> Option<InboxCut> {
        let mut merge = self.merge.cut()?;
        let log = self.orders.as_ref().map(|(log, _)| {
            let log = log.lock();
            // Followed but not handed to the merge yet: next in line after the merge's own.
            merge.orders.extend(log.pending());
            log.cut()
        });
        Some(InboxCut {
            positions: self.receivers.iter().map(DedupReceiver::next_seq).collect(),
            merge,
            log,
        })
    }

    /// The handle through which the KaZoo orderer feeds the order log to this inbox and
    /// sees what has arrived; None unless the ordering is positional.
    pub fn order_feed(&self) -> Option<OrderFeed> {
        self.orders.as_ref().map(|(log, order_bell)| OrderFeed {
            log: Arc::clone(log),
            shared: Arc::clone(&self.shared),
            bell: Arc::clone(&self.bell),
            order_bell: Arc::clone(order_bell),
        })
    }

    /// The merge delivered nothing: start or end a stretch of merge wait, as some channel
    /// has accepted input queued or not. Reads one atomic per channel; the clock only when
    /// a stretch starts or ends.
    fn note_held(&mut self) {
        let held = self
            .receivers
            .iter()
            .zip(&self.shared.senders)
            .any(|(r, s)| s.next_seq() > r.next_seq());
        match (held, self.held_since) {
            (true, None) => self.held_since = Some(Instant::now()),
            (false, Some(since)) => {
                self.merge_wait += since.elapsed();
                self.held_since = None;
            }
            _ => {}
        }
    }

    /// Current counters.
    pub fn stats(&self) -> InboxStats {
        let channels = self
            .shared
            .channels
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let next_seq = self.shared.senders[i].next_seq();
                ChannelStats {
                    upstream: self.shared.upstreams[i],
                    accepted_rows: c.accepted_rows.load(Ordering::Relaxed),
                    duplicate_rows: c.duplicate_rows.load(Ordering::Relaxed),
                    next_seq,
                    queued_seqs: next_seq.saturating_sub(self.receivers[i].next_seq()),
                }
            })
            .collect();
        let connections = self
            .shared
            .conns
            .lock()
            .iter()
            .map(|c| {
                let k = &c.counters;
                ConnectionStats {
                    peer: k.peer.clone(),
                    identity: k.identity.lock().clone(),
                    frames: k.frames.load(Ordering::Relaxed),
                    bytes: k.bytes.load(Ordering::Relaxed),
                    open: k.open.load(Ordering::Relaxed),
                    error: k.error.lock().clone(),
                }
            })
            .collect();
        InboxStats {
            channels,
            connections,
            rejected_connections: self.shared.rejected.load(Ordering::Relaxed),
            divergences: self.shared.divergences.lock().clone(),
            divergence_count: self.shared.divergence_count.load(Ordering::SeqCst),
            merge_wait: self.merge_wait + self.held_since.map_or(Duration::ZERO, |s| s.elapsed()),
        }
    }

    /// Stop accepting, close every connection and join every thread. Idempotent; also done
    /// on drop. Later calls to [`Inbox::next`] fail with [`Error::Closed`] once the
    /// already-queued input is consumed.
    pub fn close(&mut self) {
        let Some(accept) = self.accept.take() else {
            return;
        };
        self.shared.stop.store(true, Ordering::SeqCst);
        // The accept thread blocks in accept() (no polling while the job runs): a
        // connection of our own wakes it, and it sees `stop`. Should that fail, it is left
        // behind rather than waited for.
        let wake = socket::dialled(self.local_addr);
        if std::net::TcpStream::connect_timeout(&wake, ACCEPT_WAKE_TIMEOUT).is_ok() {
            let _ = accept.join();
        }
        if let Some(local) = self.local_accept.take() {
            if socket::poke_local(wake) {
                let _ = local.join();
            }
        }
        // The accept threads have exited: no connection can start any more. Shut every
        // socket down (the peers see it at once, a handshake in progress fails), let the
        // handshakes end, then have the reactor end the rest: a connection held back by a
        // full channel is not reading, so it learns of the close from a sweep.
        let threads: Vec<JoinHandle<()>> = {
            let mut conns = self.shared.conns.lock();
            conns
                .iter_mut()
                .filter_map(|c| {
                    if let Some(s) = c.counters.handle.lock().as_ref() {
                        let _ = s.shutdown(Shutdown::Both);
                    }
                    c.handshake.take()
                })
                .collect()
        };
        for t in threads {
            let _ = t.join();
        }
        self.reactor.sweep();
        let deadline = Instant::now() + CLOSE_TIMEOUT;
        while self
            .shared
            .conns
            .lock()
            .iter()
            .any(|c| c.counters.open.load(Ordering::SeqCst))
        {
            if Instant::now() > deadline {
                log_replica!(
                    Level::Warn,
                    INBOX,
                    self.shared.me.as_ref(),
                    "{}: connections still open {CLOSE_TIMEOUT:?} after close(); leaving them \
                     to the reactor",
                    self.shared.who
                );
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Drop for Inbox {
    fn drop(&mut self) {
        self.close();
    }
}

/// The orderer's side of a positional (KaZoo) inbox; cheap to clone, usable from any thread
/// while the consumer blocks in [`Inbox::next`].
///
/// * every replica feeds the order log, message by message, to [`OrderFeed::offer_frame`];
/// * the leader decides the next orders from [`OrderFeed::arrived`] (what its own dedup
///   queues have accepted) beyond [`OrderFeed::ordered`] (what the log already covers),
///   sleeping on [`OrderFeed::wait`] until something arrives.
#[derive(Clone)]
pub struct OrderFeed {
    log: Arc<Mutex<OrderLog>>,
    shared: Arc<Shared>,
    /// The consumer's bell (shared by the worker's inboxes).
    bell: Arc<Doorbell>,
    /// Rung by this inbox's arrivals and followed orders only.
    order_bell: Arc<Doorbell>,
}

impl OrderFeed {
    /// Offer the next message of the order log (an encoded Order frame); see
    /// [`OrderLog::offer`]. A followed order wakes the consumer and the leader.
    pub fn offer_frame(&self, frame: &[u8]) -> Result<Verdict> {
        let verdict = self.log.lock().offer_frame(frame)?;
        Ok(self.rung(verdict))
    }

    /// [`OrderFeed::offer_frame`] for an order already decoded (a part of a message,
    /// [`crate::orderlog::split_message`]).
    pub fn offer(&self, epoch: u64, version: u64, entries: &[wire::OrderEntry]) -> Result<Verdict> {
        let verdict = self.log.lock().offer(epoch, version, entries)?;
        Ok(self.rung(verdict))
    }

    /// [`OrderFeed::offer`] for an order of the log's message at `offset`: None if this
    /// replica's log was read past it already (see [`OrderLog::offer_at`]).
    pub fn offer_at(
        &self,
        offset: u64,
        epoch: u64,
        version: u64,
        entries: &[wire::OrderEntry],
    ) -> Result<Option<Verdict>> {
        let verdict = self.log.lock().offer_at(offset, epoch, version, entries)?;
        Ok(verdict.map(|v| self.rung(v)))
    }

    /// Every order of the log's messages before `offset` was offered (see
    /// [`OrderLog::read_through`]).
    pub fn read_through(&self, offset: u64) {
        self.log.lock().read_through(offset);
    }

    /// The log offset this replica's log has been read through.
    pub fn through(&self) -> u64 {
        self.log.lock().through()
    }

    /// `verdict`, after waking the consumer and the leader if the order was followed.
    fn rung(&self, verdict: Verdict) -> Verdict {
        if verdict == Verdict::Followed {
            self.bell.ring();
            self.order_bell.ring();
        }
        verdict
    }

    /// The leader of `epoch` (see [`Leader`]), continuing from what the log covers now:
    /// call once the log has been read to its end.
    pub fn lead(&self, epoch: u64, partition: u32, batch: usize, resend_after: Duration) -> Leader {
        Leader::new(epoch, partition, batch, &self.ordered(), resend_after)
    }

    /// Sleep until `leader` has an order to publish (see [`Leader::next`]) and return it
    /// encoded, or None after `timeout`. Woken by this inbox's arrivals and followed orders
    /// only, so a worker's leaders do not wake for each other's input.
    pub fn next_order(&self, leader: &mut Leader, timeout: Duration) -> Option<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        loop {
            let seen = self.order_bell.generation();
            let now = Instant::now();
            if let Some(order) = self.due(leader, now) {
                return Some(order);
            }
            if now >= deadline {
                return None;
            }
            self.order_bell.wait(seen, deadline - now);
        }
    }

    /// [`Leader::next`] on this replica's arrivals and log, now.
    fn due(&self, leader: &mut Leader, now: Instant) -> Option<Vec<u8>> {
        let (ordered, stats) = {
            let log = self.log.lock();
            (log.ordered().to_vec(), log.stats())
        };
        leader.next(&self.arrived(), &ordered, stats, now)
    }

    /// Per channel, the first sequence number not yet accepted: everything before it has
    /// arrived here (deduplicated) and may be ordered.
    pub fn arrived(&self) -> Vec<u64> {
        self.shared.senders.iter().map(|s| s.next_seq()).collect()
    }

    /// Per channel, the furthest position the followed orders reach.
    pub fn ordered(&self) -> Vec<u64> {
        self.log.lock().ordered().to_vec()
    }

    /// The order log's counters, epoch and version.
    pub fn stats(&self) -> OrderLogStats {
        self.log.lock().stats()
    }

    /// A token for [`OrderFeed::wait`]: read it, look at `arrived()`, then wait.
    pub fn generation(&self) -> u64 {
        self.order_bell.generation()
    }

    /// Sleep until something arrives or an order is followed after `seen` was read, or
    /// `timeout` passes. True if woken.
    pub fn wait(&self, seen: u64, timeout: Duration) -> bool {
        self.order_bell.wait(seen, timeout)
    }
}

/// Every partition one worker leads, published from one thread, one message in flight:
/// [`OrderPublisher::next`] returns the orders due across all of them once none of the
/// last message's orders is still on its way, so they go to the log together (one append
/// for the broker, one message for each reader) — one message per round trip and worker
/// rather than one per partition, or per arrival. Its bell is the one the worker's KaZoo
/// inboxes share ([`InboxConfig::order_bell`]).
pub struct OrderPublisher {
    /// Rung by the worker's KaZoo arrivals (and followed orders).
    bell: Arc<Doorbell>,
    /// Rung when an order log message was followed ([`OrderPublisher::followed`]): all a
    /// publisher with a message on its way waits for, however much arrives meanwhile.
    follow_bell: Arc<Doorbell>,
    leaders: Vec<(u64, OrderFeed, Leader)>,
    /// How long an order on its way holds the others back at most (a lost one is the
    /// leader's business: it publishes again after its own `resend_after`).
    patience: Duration,
    /// At least this long between two messages (see [`OrderPublisher::pace`]).
    pace: Duration,
    /// When the last message went out.
    sent: Option<Instant>,
}

/// How long an order of an [`OrderPublisher`]'s last message holds the next back at most.
pub const PUBLISH_PATIENCE: Duration = Duration::from_millis(50);

impl OrderPublisher {
    pub fn new(bell: Arc<Doorbell>) -> Self {
        Self {
            bell,
            follow_bell: Arc::default(),
            leaders: Vec::new(),
            patience: PUBLISH_PATIENCE,
            pace: Duration::ZERO,
            sent: None,
        }
    }

    /// Leave at least `pace` between two messages: orders due meanwhile wait and go
    /// together. Zero (the default): a message goes as soon as the last was followed.
    pub fn pace(&mut self, pace: Duration) {
        self.pace = pace;
    }

    /// How long until the pace allows the next message (zero: now).
    pub fn pace_left(&self) -> Duration {
        self.sent
            .map_or(Duration::ZERO, |t| self.pace.saturating_sub(t.elapsed()))
    }

    /// The follower offered a message of the order log: wake a publisher waiting for its
    /// last message to be followed.
    pub fn followed(&self) {
        self.follow_bell.ring();
    }

    /// The bell [`OrderPublisher::followed`] rings, for a follower on another thread.
    pub fn follow_bell(&self) -> Arc<Doorbell> {
        Arc::clone(&self.follow_bell)
    }

    /// Start publishing for `feed` as `leader`, under `key` (the caller's name for the
    /// partition); replaces a leadership under the same key.
    pub fn lead(&mut self, key: u64, feed: OrderFeed, leader: Leader) -> Result<()> {
        if !Arc::ptr_eq(&feed.order_bell, &self.bell) {
            return Err(Error::Config(
                "the inbox of a partition an OrderPublisher leads must ring its bell: create                  the inbox with the publisher's worker"
                    .to_owned(),
            ));
        }
        self.resign(key);
        self.leaders.push((key, feed, leader));
        self.bell.ring(); // orders may be due at once
        Ok(())
    }

    /// Stop publishing under `key`; returns its leader's `counts()` if it led.
    pub fn resign(&mut self, key: u64) -> Option<(u64, u64)> {
        let i = self.leaders.iter().position(|(k, _, _)| *k == key)?;
        Some(self.leaders.swap_remove(i).2.counts())
    }

    /// The leader under `key`, if it leads.
    pub fn leader(&mut self, key: u64) -> Option<&mut Leader> {
        self.leaders
            .iter_mut()
            .find(|(k, _, _)| *k == key)
            .map(|(_, _, l)| l)
    }

    /// The bell to wait on after [`OrderPublisher::due`] found nothing (with a
    /// generation read before calling it): the follow bell while an order of the last
    /// message is on its way ([`OrderPublisher::awaiting`]), else the arrivals' bell.
    pub fn bell(&self, awaiting: bool) -> &Arc<Doorbell> {
        if awaiting {
            &self.follow_bell
        } else {
            &self.bell
        }
    }

    /// Whether an order of the last message is still on its way (for at most
    /// `PUBLISH_PATIENCE`): nothing is due until it is followed.
    pub fn awaiting(&self) -> bool {
        let now = Instant::now();
        self.leaders
            .iter()
            .any(|(_, feed, leader)| leader.awaiting(feed.stats(), now, self.patience))
    }

    /// Every order due now, each under its key (in the order the leaders were added);
    /// none while an order of the last message is on its way.
    pub fn due(&mut self) -> Vec<(u64, Vec<u8>)> {
        if self.awaiting() || !self.pace_left().is_zero() {
            return Vec::new();
        }
        let now = Instant::now();
        let mut due = Vec::new();
        for (key, feed, leader) in &mut self.leaders {
            while let Some(order) = feed.due(leader, now) {
                due.push((*key, order));
            }
        }
        if !due.is_empty() {
            self.sent = Some(now);
        }
        due
    }

    /// One look: the orders due now, or — unless `deadline` has passed, which gives
    /// nothing due — how to sleep before looking again. [`OrderPublisher::next`] loops on
    /// it; a caller sharing the publisher between threads takes it for the look only and
    /// sleeps without it.
    pub fn step(&mut self, deadline: Instant) -> PublishStep {
        let awaiting = self.awaiting();
        let bell = Arc::clone(self.bell(awaiting));
        // Read the generation before looking, so a ring between the look and the sleep
        // still wakes the sleeper.
        let seen = bell.generation();
        let due = self.due();
        let now = Instant::now();
        if !due.is_empty() || now >= deadline {
            return PublishStep::Due(due);
        }
        let pace = self.pace_left();
        let sleep = if !pace.is_zero() {
            // Sleep the pace out: what falls due meanwhile waits for it anyway.
            PublishSleep::For(pace.min(deadline - now))
        } else {
            // Waiting for a follow: look again by the patience at the latest.
            let until = if awaiting {
                deadline.min(now + self.patience)
            } else {
                deadline
            };
            PublishSleep::Bell {
                bell,
                seen,
                timeout: until.saturating_duration_since(now),
            }
        };
        PublishStep::Sleep(sleep)
    }

    /// Sleep until some leader has orders due and return them all ([`OrderPublisher::due`]),
    /// or nothing after `timeout`.
    pub fn next(&mut self, timeout: Duration) -> Vec<(u64, Vec<u8>)> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.step(deadline) {
                PublishStep::Due(due) => return due,
                PublishStep::Sleep(sleep) => sleep.sleep(),
            }
        }
    }
}

/// What [`OrderPublisher::step`] found.
pub enum PublishStep {
    /// The orders due (none if the deadline passed).
    Due(Vec<(u64, Vec<u8>)>),
    /// Nothing due yet: sleep so, then look again.
    Sleep(PublishSleep),
}

/// How an [`OrderPublisher`] with nothing due sleeps.
pub enum PublishSleep {
    /// Out the pace.
    For(Duration),
    /// Until `bell` rings after generation `seen`, or `timeout`.
    Bell {
        bell: Arc<Doorbell>,
        seen: u64,
        timeout: Duration,
    },
}

impl PublishSleep {
    pub fn sleep(self) {
        match self {
            PublishSleep::For(d) => std::thread::sleep(d),
            PublishSleep::Bell {
                bell,
                seen,
                timeout,
            } => {
                bell.wait(seen, timeout);
            }
        }
    }
}

fn accept_loop(shared: &Arc<Shared>, reactor: &Arc<Reactor>, listener: &Listener) {
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok(_) if shared.stop.load(Ordering::SeqCst) => return,
            Ok((stream, peer)) => {
                if let Err(e) = start_connection(shared, reactor, stream, peer.clone()) {
                    log_replica!(
                        Level::Warn,
                        INBOX,
                        shared.me.as_ref(),
                        "{}: cannot serve the connection from {peer}: {e}",
                        shared.who
                    );
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                // E.g. out of file descriptors: back off instead of spinning.
                log_replica!(
                    Level::Warn,
                    INBOX,
                    shared.me.as_ref(),
                    "{}: accepting a connection failed: {e}",
                    shared.who
                );
                std::thread::sleep(POLL);
            }
        }
    }
}

/// Serve a new connection: its handshake on a thread of its own (a silent peer holds
/// nothing else up), then its frames on the reactor.
fn start_connection(
    shared: &Arc<Shared>,
    reactor: &Arc<Reactor>,
    stream: Stream,
    peer: String,
) -> Result<()> {
    stream.set_nonblocking(false)?;
    if let Stream::Tcp(s) = &stream {
        s.set_nodelay(true)?;
    }
    let thread_name = format!("tandem-handshake-{peer}");
    stream.set_read_timeout(Some(shared.handshake_timeout))?;
    stream.set_write_timeout(Some(shared.handshake_timeout))?;
    let handle = stream.try_clone()?;
    let counters = Arc::new(ConnCounters {
        peer,
        identity: Mutex::new(None),
        frames: AtomicU64::new(0),
        bytes: AtomicU64::new(0),
        open: AtomicBool::new(true),
        error: Mutex::new(None),
        handle: Mutex::new(Some(handle)),
        channel: AtomicUsize::new(usize::MAX),
    });
    let mut conns = shared.conns.lock();
    prune_closed(&mut conns);
    let thread = {
        let shared = Arc::clone(shared);
        let reactor = Arc::clone(reactor);
        let counters = Arc::clone(&counters);
        std::thread::Builder::new()
            .name(thread_name)
            .spawn(move || {
                let stream = Counting {
                    inner: stream,
                    counters: Arc::clone(&counters),
                };
                match handshake(&shared, stream, &counters) {
                    Ok(reading) => {
                        if let Err((source, e)) = reactor.register(Box::new(reading)) {
                            drop(source);
                            conn_ended(
                                &shared,
                                &counters,
                                ConnEnd::Failed(format!("cannot read the connection: {e}")),
                            );
                        }
                    }
                    Err(end) => conn_ended(&shared, &counters, end),
                }
            })?
    };
    conns.push(Conn {
        counters,
        handshake: Some(thread),
    });
    Ok(())
}

/// Forget the oldest closed connections beyond [`CLOSED_CONNECTIONS_KEPT`] (joining their
/// finished handshake threads).
fn prune_closed(conns: &mut Vec<Conn>) {
    let closed = conns
        .iter()
        .filter(|c| !c.counters.open.load(Ordering::SeqCst))
        .count();
    let mut excess = closed.saturating_sub(CLOSED_CONNECTIONS_KEPT);
    conns.retain_mut(|c| {
        let done = !c.counters.open.load(Ordering::SeqCst);
        if excess > 0 && done && c.handshake.as_ref().is_none_or(JoinHandle::is_finished) {
            if let Some(t) = c.handshake.take() {
                let _ = t.join();
            }
            excess -= 1;
            false
        } else {
            true
        }
    });
}

/// Why a connection stopped being served.
enum ConnEnd {
    /// Clean end of stream at a frame boundary.
    Eof,
    /// The inbox is closing.
    Stopped,
    /// Refused before any frame was accepted (counted as rejected).
    Rejected(String),
    /// A failure after the handshake: a frame that does not decode, a mis-wired sender.
    Failed(String),
    /// The sender went away mid-stream (reset, or a frame cut short): a crash its twins
    /// mask, not a protocol problem.
    Lost(String),
}

/// Account for the end of a connection (its socket already closed, but for `handle`): no
/// longer a feeder of its channel, the consumer woken, the end logged and kept.
fn conn_ended(shared: &Shared, counters: &ConnCounters, end: ConnEnd) {
    let channel = counters.channel.load(Ordering::SeqCst);
    if let Some(c) = shared.channels.get(channel) {
        c.feeders.fetch_sub(1, Ordering::SeqCst);
        shared.bell.ring(); // the consumer may now be waiting for what will never come
    }
    let peer = &counters.peer;
    let me = shared.me.as_ref();
    let sender = || {
        counters.identity.lock().as_ref().map_or_else(
            || peer.to_string(),
            |id| {
                format!(
                    "upstream task {} partition {} replica {} at {peer}",
                    id.task, id.partition, id.replica
                )
            },
        )
    };
    match &end {
        ConnEnd::Eof | ConnEnd::Stopped => {}
        ConnEnd::Rejected(why) => {
            shared.rejected.fetch_add(1, Ordering::Relaxed);
            log_replica!(
                Level::Warn,
                INBOX,
                me,
                "{}: rejected a connection from {peer}: {why}",
                shared.who
            );
        }
        ConnEnd::Failed(why) => {
            log_replica!(
                Level::Warn,
                INBOX,
                me,
                "{}: closed the connection from {}: {why}",
                shared.who,
                sender()
            );
        }
        ConnEnd::Lost(why) => {
            log_replica!(
                Level::Info,
                INBOX,
                me,
                "{}: lost the connection from {}: {why}; the other replicas of that partition \
                 keep sending",
                shared.who,
                sender()
            );
        }
    }
    if let ConnEnd::Rejected(why) | ConnEnd::Failed(why) | ConnEnd::Lost(why) = end {
        *counters.error.lock() = Some(why);
    }
    drop(counters.handle.lock().take());
    counters.open.store(false, Ordering::SeqCst);
}

/// The handshake (blocking, under the handshake timeout): who is this, and which logical
/// channel does it feed? Then the connection, non-blocking, ready for the reactor.
fn handshake(
    shared: &Arc<Shared>,
    mut stream: Counting,
    counters: &Arc<ConnCounters>,
) -> std::result::Result<Reading, ConnEnd> {
    let identity = match wire::server_handshake(&mut stream, &shared.job, &shared.secret) {
        Ok(id) => id,
        Err(_) if shared.stop.load(Ordering::SeqCst) => return Err(ConnEnd::Stopped),
        Err(e) => return Err(ConnEnd::Rejected(format!("handshake failed: {e}"))),
    };
    let Some(idx) = shared
        .upstreams
        .iter()
        .position(|&(t, p)| t == identity.task && p == identity.partition)
    else {
        return Err(ConnEnd::Rejected(format!(
            "sender (task {}, partition {}) replica {} is not an upstream of this inbox (upstreams: \
             {:?})",
            identity.task, identity.partition, identity.replica, shared.upstreams
        )));
    };
    let replica = identity.replica;
    shared.channels[idx].feed();
    counters.channel.store(idx, Ordering::SeqCst);
    *counters.identity.lock() = Some(identity);
    // From here on the reactor reads only what is there; the FrameReader keeps a frame
    // cut short by `WouldBlock` and resumes it on the next turn.
    if let Err(e) = stream.inner.set_nonblocking(true) {
        return Err(ConnEnd::Failed(format!(
            "cannot make the socket non-blocking: {e}"
        )));
    }
    // Buffered: a sender writes a worker turn's frames in one go, and one read takes them
    // all (instead of two per frame: header, then body). A body larger than the buffer is
    // still read straight into its own allocation.
    let stream = io::BufReader::with_capacity(READ_BUFFER_BYTES, stream);
    Ok(Reading {
        shared: Arc::clone(shared),
        counters: Arc::clone(counters),
        idx,
        replica,
        reader: FrameReader::new(stream, shared.max_frame_bytes),
        pending: None,
        seen: 0,
        end: None,
    })
}

/// An established connection as the reactor serves it: its frame decoder, and the item its
/// channel had no room for, if any.
struct Reading {
    shared: Arc<Shared>,
    counters: Arc<ConnCounters>,
    /// The logical channel it feeds.
    idx: usize,
    /// The upstream replica it comes from.
    replica: u32,
    reader: FrameReader<io::BufReader<Counting>>,
    /// Held back by a full channel or a gap before it: offered again, before anything is
    /// read, once the channel's producer bell rang past `seen`.
    pending: Option<Item<RecordBatch>>,
    seen: u64,
    /// Why it ended, once [`Turn::Done`].
    end: Option<ConnEnd>,
}

/// What one frame came to.
enum Step {
    /// Taken (delivered, skipped as a duplicate, or ignored).
    Taken,
    /// Its channel cannot take it yet: held in `pending`.
    Held,
    /// No whole frame in the socket yet.
    WouldBlock,
}

impl Reading {
    /// Offer `item` once; if the channel cannot take it, hold it and note the producer
    /// bell's generation read before the offer (a ring after it unblocks the connection).
    fn offer(&mut self, item: Item<RecordBatch>) -> Step {
        self.seen = self.shared.senders[self.idx].producer_bell().generation();
        match offer(&self.shared, self.idx, item) {
            None => Step::Taken,
            Some(back) => {
                self.pending = Some(back);
                Step::Held
            }
        }
    }

    /// Read and deliver the next frame, if a whole one is there.
    fn step(&mut self) -> std::result::Result<Step, ConnEnd> {
        let shared = &*self.shared;
        let idx = self.idx;
        let sender = &shared.senders[idx];
        // A Data frame whose every row is in already (the twin's copy came first) is
        // counted and dropped without decoding its Arrow body.
        let next = self
            .reader
            .next_frame_unless(|h| h.first_seq.saturating_add(h.count) <= sender.next_seq());
        let frame = match next {
            Ok(Some(Next::Frame(f))) => f,
            Ok(Some(Next::Skipped(h))) => {
                self.counters.frames.fetch_add(1, Ordering::Relaxed);
                check_wire_channel(&shared.channels[idx], h.channel).map_err(ConnEnd::Failed)?;
                shared.channels[idx]
                    .duplicate_rows
                    .fetch_add(h.count, Ordering::Relaxed);
                return Ok(Step::Taken);
            }
            Ok(None) => return Err(ConnEnd::Eof),
            Err(Error::Io(e)) if e.kind() == io::ErrorKind::WouldBlock => {
                return Ok(Step::WouldBlock)
            }
            Err(_) if shared.stop.load(Ordering::SeqCst) => return Err(ConnEnd::Stopped),
            Err(e) if sender_lost(&e) => return Err(ConnEnd::Lost(e.to_string())),
            Err(e) => return Err(ConnEnd::Failed(e.to_string())),
        };
        self.counters.frames.fetch_add(1, Ordering::Relaxed);
        if let Frame::Order { .. } = frame {
            if !shared.order_frames_logged.swap(true, Ordering::Relaxed) {
                log_replica!(
                    Level::Warn,
                    INBOX,
                    shared.me.as_ref(),
                    "{}: ignoring order frames from {}: orders travel on the KaZoo order log, \
                     never on replica connections (logged once)",
                    shared.who,
                    self.counters.peer
                );
            }
            return Ok(Step::Taken);
        }
        let digest = match &frame {
            Frame::Heartbeat {
                epoch,
                digest: Some(d),
                ..
            } => Some((*epoch, *d)),
            _ => None,
        };
        let Some((wire_channel, item)) = frame.into_item() else {
            return Ok(Step::Taken);
        };
        check_wire_channel(&shared.channels[idx], wire_channel).map_err(ConnEnd::Failed)?;
        if let Some((epoch, digest)) = digest {
            check_digest(shared, idx, self.replica, epoch, digest);
        }
        Ok(self.offer(item))
    }
}

/// Frames one connection takes per turn at most, so the others get theirs.
const FRAMES_PER_TURN: usize = 64;

impl Source for Reading {
    fn fd(&self) -> RawFd {
        self.reader.get_ref().get_ref().inner.as_raw_fd()
    }

    fn turn(&mut self) -> Turn {
        if self.shared.stop.load(Ordering::SeqCst) {
            self.end = Some(ConnEnd::Stopped);
            return Turn::Done;
        }
        if let Some(item) = self.pending.take() {
            if let Step::Held = self.offer(item) {
                return Turn::Blocked;
            }
        }
        for _ in 0..FRAMES_PER_TURN {
            match self.step() {
                Ok(Step::Taken) => {}
                Ok(Step::Held) => return Turn::Blocked,
                Ok(Step::WouldBlock) => return Turn::Drained,
                Err(end) => {
                    self.end = Some(end);
                    return Turn::Done;
                }
            }
        }
        Turn::More
    }

    fn unblocked(&self) -> bool {
        self.shared.stop.load(Ordering::SeqCst)
            || self.shared.senders[self.idx].producer_bell().generation() != self.seen
    }

    fn notify(&self, wake: Arc<dyn Wake>) -> bool {
        self.shared.senders[self.idx]
            .producer_bell()
            .notify_once(self.seen, wake)
    }

    fn finish(self: Box<Self>) {
        let Reading {
            shared,
            counters,
            reader,
            end,
            ..
        } = *self;
        drop(reader); // closes the socket: the peer sees the end at once
        conn_ended(&shared, &counters, end.unwrap_or(ConnEnd::Stopped));
    }
}

/// Whether a read error means the sender went away (its process died, or it reset the
/// connection) rather than that it sent something wrong.
fn sender_lost(e: &Error) -> bool {
    match e {
        Error::Io(io) => peer_gone(io.kind()),
        Error::Protocol(crate::error::ProtocolError::Truncated { .. }) => true,
        _ => false,
    }
}

/// The I/O errors of a connection whose peer closed or reset it.
fn peer_gone(kind: io::ErrorKind) -> bool {
    matches!(
        kind,
        io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::NotConnected
            | io::ErrorKind::UnexpectedEof
    )
}

/// Every connection of one upstream partition must use one wire channel number: a second
/// number means a mis-wired sender (frames meant for another downstream partition).
fn check_wire_channel(c: &ChannelCounters, wire_channel: u32) -> std::result::Result<(), String> {
    let want = u64::from(wire_channel);
    match c
        .wire_channel
        .compare_exchange(u64::MAX, want, Ordering::SeqCst, Ordering::SeqCst)
    {
        Ok(_) => Ok(()),
        Err(seen) if seen == want => Ok(()),
        Err(seen) => Err(format!(
            "frame on wire channel {wire_channel}, but this upstream partition sends on wire \
             channel {seen}: the sender is wired to the wrong downstream partition"
        )),
    }
}

/// Compare the digest of cycle `epoch` that `replica` sent on logical channel `idx` with
/// the first copy's; record (and log or signal) a divergence.
fn check_digest(shared: &Shared, idx: usize, replica: u32, epoch: u64, digest: Digest) {
    let Some((first, first_digest)) = shared.cycle_digests[idx]
        .lock()
        .check(epoch, replica, digest)
    else {
        return;
    };
    let d = Divergence {
        channel: idx,
        upstream: shared.upstreams[idx],
        epoch,
        replicas: (first, replica),
        digests: (first_digest, digest),
    };
    {
        let mut kept = shared.divergences.lock();
        if kept.len() < DIVERGENCES_KEPT {
            kept.push(d.clone());
        }
        shared.divergence_count.fetch_add(1, Ordering::SeqCst);
    }
    match shared.on_divergence {
        OnDivergence::Fail => shared.bell.ring(),
        OnDivergence::Log => {
            if !shared.divergence_logged[idx].swap(true, Ordering::Relaxed) {
                log_replica!(
                    Level::Warn,
                    INBOX,
                    shared.me.as_ref(),
                    "{}: {d}; the operator of task {} is not deterministic for a given input \
                     batch (on_divergence=\"log\": the job keeps running; later divergences on \
                     this input are only counted)",
                    shared.who,
                    d.upstream.0
                );
            }
        }
    }
}

/// Offer `item` to the dedup channel once, counting its rows as accepted or duplicate;
/// handed back when there is no room or a gap before it (offer it again later).
fn offer(shared: &Shared, idx: usize, item: Item<RecordBatch>) -> Option<Item<RecordBatch>> {
    let counters = &shared.channels[idx];
    let rows = match &item {
        Item::Data { payload, .. } => payload.rows() as u64,
        Item::Heartbeat { .. } | Item::End { .. } => 0,
    };
    let end = matches!(item, Item::End { .. });
    let offered = shared.senders[idx].offer(item);
    if end && matches!(offered, Offer::Accepted { .. } | Offer::Duplicate) {
        counters.ended.store(true, Ordering::SeqCst);
    }
    match offered {
        Offer::Accepted { trimmed_rows } => {
            counters
                .accepted_rows
                .fetch_add(rows.saturating_sub(trimmed_rows), Ordering::Relaxed);
            counters
                .duplicate_rows
                .fetch_add(trimmed_rows.min(rows), Ordering::Relaxed);
            None
        }
        Offer::Duplicate => {
            counters.duplicate_rows.fetch_add(rows, Ordering::Relaxed);
            None
        }
        Offer::Gap { item: back, .. } | Offer::Full(back) => Some(back),
    }
}

/// A connection's socket, counting the bytes read through it.
struct Counting {
    inner: Stream,
    counters: Arc<ConnCounters>,
}

impl Read for Counting {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.counters.bytes.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

impl Write for Counting {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.inner.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

// ───────────────────────────── sending side ─────────────────────────────

/// Settings of a [`TcpLink`].
#[derive(Debug, Clone)]
pub struct LinkConfig {
    /// Frames queued for the writer thread before [`Link::send`] blocks.
    pub queue_frames: usize,
    /// How long to keep retrying to reach the peer (it may not be listening yet).
    pub connect_timeout: Duration,
    /// Read/write timeout during the handshake.
    pub handshake_timeout: Duration,
    /// How long [`Link::close`] waits for queued frames to be written before cutting the
    /// connection.
    pub close_timeout: Duration,
}

impl Default for LinkConfig {
    fn default() -> Self {
        LinkConfig {
            queue_frames: 256,
            connect_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(2),
            close_timeout: Duration::from_secs(5),
        }
    }
}

/// A connection to one downstream replica. Implements [`Link`] for the
/// [`crate::outbox::Outbox`].
///
/// **Write-through.** `send` writes the frame to the socket itself, without blocking
/// (`MSG_DONTWAIT`), whenever nothing is queued before it — the common case, since a
/// loopback or LAN socket buffer holds far more than the worker's credit rule lets a slot
/// have in flight. Only what the socket does not take at once (the rest of a frame, and
/// every frame after it) goes to the link's writer thread, which writes it blocking, in
/// order. So a frame costs one `send(2)` and no thread wake-up on the sender's side: a
/// writer thread woken per frame preempted the worker on its own core, which was a tenth
/// of a worker's time.
pub struct TcpLink {
    peer: String,
    shared: Arc<LinkShared>,
    /// Receives one message when the writer thread is about to exit.
    done: Receiver<()>,
    socket: Stream,
    writer: Option<JoinHandle<()>>,
    close_timeout: Duration,
    /// Frames that may wait for the writer thread before `send` blocks.
    capacity: usize,
    /// Frames held back until [`Link::push`] (or until they reach [`COALESCE_BYTES`]).
    pending: Vec<u8>,
    /// Whether `send` holds small frames back ([`Link::defer`]).
    deferred: bool,
    /// Since when the writer's queue has not been empty, as last seen
    /// ([`Link::backed_up_for`]).
    backed_up: std::cell::Cell<Option<Instant>>,
    /// The replay handed to the writer ([`Link::replay`]) and when: while it is still being
    /// written, for up to [`REPLAY_GRACE`], the link is catching up, not lagging.
    replaying: std::cell::Cell<Option<(Arc<[u8]>, Instant)>>,
}

/// How long a replica rebuilt from a twin may take to read its replay before its link
/// counts as lagging like any other: one that never reads (wedged while it starts) must
/// not hold its upstream replicas, and so its twins, back for good; evicted, it is
/// rebuilt again.
pub const REPLAY_GRACE: Duration = Duration::from_secs(10);

/// A [`TcpLink`] holds small frames back until the outbox pushes, up to this many bytes;
/// a larger frame is written at once.
const COALESCE_BYTES: usize = 64 << 10;

/// What the sending thread and the writer thread of a [`TcpLink`] share.
struct LinkShared {
    state: Mutex<WriteState>,
    /// Rung when a frame is queued or the link closes (the writer waits on it).
    work: Condvar,
    /// Rung when the writer took a frame off the queue or stopped (a full `send` waits).
    space: Condvar,
    /// `state.queue.len()`, readable without the lock ([`Link::backlog`]).
    queued: AtomicUsize,
}

#[derive(Default)]
struct WriteState {
    /// Frames for the writer thread, each with how many of its bytes are already written.
    queue: VecDeque<(Arc<[u8]>, usize)>,
    /// No more frames will come: the writer drains the queue and half-closes.
    closing: bool,
    /// Why writing failed, once it did.
    failure: Option<String>,
    /// The failure was the peer closing or resetting the connection.
    peer_closed: bool,
}

impl TcpLink {
    /// Dial `addr` (retrying with backoff until `cfg.connect_timeout`), authenticate as `me`
    /// and start the writer thread. A rejected handshake is not retried.
    pub fn connect(addr: &str, me: &Identity, secret: &[u8], cfg: &LinkConfig) -> Result<Self> {
        if cfg.queue_frames == 0 {
            return Err(Error::Config("queue_frames must be ≥ 1 (got 0)".to_owned()));
        }
        let targets: Vec<SocketAddr> = addr
            .to_socket_addrs()
            .map_err(|e| Error::Config(format!("cannot resolve downstream address {addr:?}: {e}")))?
            .collect();
        let Some(&target) = targets.first() else {
            return Err(Error::Config(format!(
                "downstream address {addr:?} resolves to nothing"
            )));
        };
        let deadline = Instant::now() + cfg.connect_timeout;
        let mut backoff = Duration::from_millis(5);
        let stream = loop {
            let attempt = Stream::connect(target, cfg.handshake_timeout).and_then(|s| {
                s.set_read_timeout(Some(cfg.handshake_timeout))?;
                s.set_write_timeout(Some(cfg.handshake_timeout))?;
                Ok(s)
            });
            let err = match attempt
                .map_err(Error::from)
                .and_then(|mut s| wire::client_handshake(&mut s, me, secret).map(|()| s))
            {
                Ok(s) => break s,
                Err(Error::Handshake(m)) => {
                    return Err(Error::Handshake(format!(
                        "downstream replica at {addr}: {m}"
                    )))
                }
                Err(e) => e,
            };
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Closed(format!(
                    "cannot reach downstream replica at {addr} within {:?}: {err}",
                    cfg.connect_timeout
                )));
            }
            std::thread::sleep(backoff.min(deadline - now));
            backoff = (backoff * 2).min(Duration::from_millis(500));
        };
        stream.set_read_timeout(None)?;
        stream.set_write_timeout(None)?;
        let socket = stream.try_clone()?;
        let shared = Arc::new(LinkShared {
            state: Mutex::new(WriteState::default()),
            work: Condvar::new(),
            space: Condvar::new(),
            queued: AtomicUsize::new(0),
        });
        let (done_tx, done) = mpsc::channel();
        let writer = {
            let shared = Arc::clone(&shared);
            let close_timeout = cfg.close_timeout;
            std::thread::Builder::new()
                .name(format!("tandem-write-{addr}"))
                .spawn(move || {
                    if let Err(e) = write_loop(&stream, &shared, close_timeout) {
                        let mut st = shared.state.lock();
                        if st.failure.is_none() {
                            st.failure = Some(e.to_string());
                            st.peer_closed = peer_gone(e.kind());
                        }
                    }
                    shared.space.notify_all(); // a sender blocked on a full queue fails now
                    let _ = done_tx.send(());
                })?
        };
        Ok(TcpLink {
            peer: addr.to_owned(),
            shared,
            done,
            socket,
            writer: Some(writer),
            close_timeout: cfg.close_timeout,
            capacity: cfg.queue_frames,
            pending: Vec::new(),
            deferred: false,
            backed_up: std::cell::Cell::new(None),
            replaying: std::cell::Cell::new(None),
        })
    }

    fn dead(&self, why: Option<&str>) -> Error {
        Error::Closed(format!(
            "connection to downstream replica {} is gone: {}",
            self.peer,
            why.unwrap_or("the link was closed")
        ))
    }

    /// Write `bytes` after everything sent before: at once if nothing is queued and the
    /// socket takes it, else (the rest of it) through the writer thread, blocking while
    /// its queue is full.
    fn write(&mut self, bytes: Arc<[u8]>) -> Result<()> {
        let shared = &*self.shared;
        let mut st = shared.state.lock();
        if st.closing || st.failure.is_some() {
            return Err(self.dead(st.failure.as_deref()));
        }
        let written = if st.queue.is_empty() {
            // The writer thread is idle (it pops a frame only once written), so the
            // socket is ours for this frame.
            match self.write_now(&bytes) {
                Ok(n) if n == bytes.len() => return Ok(()),
                Ok(n) => n,
                Err(e) => {
                    st.peer_closed = peer_gone(e.kind());
                    let why = st.failure.insert(e.to_string()).clone();
                    shared.work.notify_one();
                    return Err(self.dead(Some(&why)));
                }
            }
        } else {
            while st.queue.len() >= self.capacity && st.failure.is_none() {
                shared.space.wait(&mut st);
            }
            if st.failure.is_some() {
                return Err(self.dead(st.failure.as_deref()));
            }
            0
        };
        st.queue.push_back((bytes, written));
        shared.queued.store(st.queue.len(), Ordering::Relaxed);
        shared.work.notify_one();
        Ok(())
    }

    /// Write as much of `bytes` as the socket takes now, without blocking; how much it took.
    fn write_now(&self, bytes: &[u8]) -> io::Result<usize> {
        let fd = self.socket.as_raw_fd();
        let mut off = 0;
        while off < bytes.len() {
            let rest = &bytes[off..];
            // SAFETY: `fd` is this link's open socket, and `rest` is a live slice.
            let n = unsafe {
                libc::send(
                    fd,
                    rest.as_ptr().cast(),
                    rest.len(),
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            };
            if n >= 0 {
                off += n.unsigned_abs();
                continue;
            }
            let err = io::Error::last_os_error();
            match err.kind() {
                io::ErrorKind::Interrupted => {}
                io::ErrorKind::WouldBlock => break,
                _ => return Err(err),
            }
        }
        Ok(off)
    }
}

/// The writer thread: write what `send` queued, in order, blocking; on a clean close,
/// half-close and wait for the peer to finish reading, so nothing queued is lost.
fn write_loop(stream: &Stream, shared: &LinkShared, close_timeout: Duration) -> io::Result<()> {
    let mut out = stream;
    loop {
        let (frame, written) = {
            let mut st = shared.state.lock();
            while st.queue.is_empty() && !st.closing && st.failure.is_none() {
                shared.work.wait(&mut st);
            }
            if st.failure.is_some() {
                return Ok(()); // the sender saw the socket fail and recorded why
            }
            match st.queue.front() {
                Some((frame, written)) => (Arc::clone(frame), *written),
                None => break, // closing, and everything is written
            }
        };
        out.write_all(&frame[written..])?;
        let mut st = shared.state.lock();
        st.queue.pop_front();
        shared.queued.store(st.queue.len(), Ordering::Relaxed);
        shared.space.notify_all();
    }
    match stream.shutdown(Shutdown::Write) {
        // The peer closed first (a downstream replica that finished on its twins' copies
        // of this stream resets what it left unread): nothing is owed to it any more.
        Err(e) if e.kind() == io::ErrorKind::NotConnected => return Ok(()),
        r => r?,
    }
    // Drain until the peer closes (it sends nothing after the handshake), so closing our
    // end cannot reset the connection before the peer read the tail.
    stream.set_read_timeout(Some(close_timeout))?;
    let mut sink = [0u8; 256];
    let mut reader = stream;
    loop {
        match reader.read(&mut sink) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return Ok(()),
        }
    }
}

impl Link for TcpLink {
    fn send(&mut self, frame: &OutFrame) -> Result<()> {
        let Some(bytes) = frame.bytes.as_ref() else {
            return Err(Error::Config(
                "an outbox handed a TCP link a frame without its bytes".to_owned(),
            ));
        };
        if self.deferred
            && self.shared.queued.load(Ordering::Relaxed) == 0
            && bytes.len() < COALESCE_BYTES
        {
            // Held back, to leave in one write with what follows (at the latest on push).
            self.pending.extend_from_slice(bytes);
            if self.pending.len() < COALESCE_BYTES {
                return Ok(());
            }
            return self.push();
        }
        self.push()?;
        self.write(Arc::clone(bytes))
    }

    fn defer(&mut self, on: bool) {
        self.deferred = on;
    }

    fn push(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let bytes: Arc<[u8]> = std::mem::take(&mut self.pending).into();
        self.write(bytes)
    }
    fn backlog(&self) -> usize {
        self.shared.queued.load(Ordering::Relaxed)
    }

    fn close(&mut self) -> Result<()> {
        if self.writer.is_none() {
            return Ok(());
        }
        let pushed = self.push();
        let Some(writer) = self.writer.take() else {
            return pushed;
        };
        self.shared.state.lock().closing = true;
        self.shared.work.notify_one();
        if self.done.recv_timeout(self.close_timeout).is_err() {
            // The peer stopped reading: give up on the tail rather than hang.
            let _ = self.socket.shutdown(Shutdown::Both);
        }
        let _ = writer.join();
        let failure = self.shared.state.lock().failure.clone();
        match failure {
            Some(why) => Err(self.dead(Some(&why))),
            None => pushed,
        }
    }

    /// Cut the connection now, dropping whatever is still queued.
    fn abort(&mut self) {
        self.pending.clear();
        let _ = self.socket.shutdown(Shutdown::Both);
        {
            let mut st = self.shared.state.lock();
            st.closing = true;
            st.queue.clear();
            self.shared.queued.store(0, Ordering::Relaxed);
        }
        self.shared.work.notify_one();
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }

    fn describe(&self) -> String {
        format!("downstream replica at {}", self.peer)
    }

    fn peer_closed(&self) -> bool {
        self.shared.state.lock().peer_closed
    }

    /// One write of every frame: the writer thread takes it while the sender goes on, and
    /// it counts as one queued frame, so a long replay neither blocks the sender nor makes
    /// the new replica look like a straggler by the frame count.
    fn replay(&mut self, frames: &[OutFrame]) -> Result<()> {
        let mut all = Vec::with_capacity(
            frames
                .iter()
                .map(|f| f.bytes.as_ref().map_or(0, |b| b.len()))
                .sum(),
        );
        for f in frames {
            let Some(bytes) = f.bytes.as_ref() else {
                return Err(Error::Config(
                    "an outbox handed a TCP link a replayed frame without its bytes".to_owned(),
                ));
            };
            all.extend_from_slice(bytes);
        }
        if all.is_empty() {
            return Ok(());
        }
        self.push()?;
        let all: Arc<[u8]> = all.into();
        self.write(Arc::clone(&all))?;
        if self.shared.queued.load(Ordering::Relaxed) > 0 {
            // The writer thread has the rest of it.
            self.replaying.set(Some((all, Instant::now())));
        }
        Ok(())
    }

    fn backed_up_for(&self, now: Instant) -> Option<Duration> {
        if self.shared.queued.load(Ordering::Relaxed) == 0 {
            self.backed_up.set(None);
            return Some(Duration::ZERO);
        }
        if let Some((replay, handed)) = self.replaying.take() {
            let st = self.shared.state.lock();
            if st
                .queue
                .front()
                .is_some_and(|(f, _)| Arc::ptr_eq(f, &replay))
            {
                drop(st);
                if now.saturating_duration_since(handed) < REPLAY_GRACE {
                    // A replica catching up on its replay is not a straggler (yet).
                    self.replaying.set(Some((replay, handed)));
                    self.backed_up.set(None);
                    return Some(Duration::ZERO);
                }
                // Not read for the whole grace: backed up since it was handed over.
                self.backed_up.set(Some(handed));
                return Some(now.saturating_duration_since(handed));
            }
        }
        let since = self.backed_up.get().unwrap_or(now);
        self.backed_up.set(Some(since));
        Some(now.saturating_duration_since(since))
    }
}

impl Drop for TcpLink {
    fn drop(&mut self) {
        let _ = Link::close(self);
    }
}

/// A link to an inbox of this process ([`Inbox::local_link`]): each element goes into the
/// inbox's dedup channel as it is — an Arrow batch, never encoded — with the same sequence
/// numbers a [`TcpLink`] would send, so the local copy and the remote replicas' copies
/// deduplicate against each other. It never blocks: an element the channel has no room for
/// waits in the link (its [`Link::backlog`], which the worker's credit rule keeps small)
/// until [`Link::flush`] finds room, in order. Closing or aborting the inbox (the
/// downstream replica finished) makes `send` fail, as a closed connection would.
pub struct LocalLink {
    shared: Arc<Shared>,
    idx: usize,
    replica: u32,
    pending: VecDeque<Item<RecordBatch>>,
    peer: SocketAddr,
    /// Counted among the channel's feeders (until closed, aborted or dropped).
    feeding: bool,
}

impl LocalLink {
    fn stop_feeding(&mut self) {
        if std::mem::take(&mut self.feeding) {
            self.shared.channels[self.idx]
                .feeders
                .fetch_sub(1, Ordering::SeqCst);
            self.shared.bell.ring();
        }
    }
}

impl Drop for LocalLink {
    fn drop(&mut self) {
        self.stop_feeding();
    }
}

impl Link for LocalLink {
    fn send(&mut self, frame: &OutFrame) -> Result<()> {
        if self.shared.stop.load(Ordering::SeqCst) {
            self.pending.clear();
            return Err(Error::Closed(format!(
                "the downstream replica at {} (in this worker) has closed its inbox",
                self.peer
            )));
        }
        if let (Item::Heartbeat { epoch, .. }, Some(digest)) = (&frame.item, frame.digest) {
            check_digest(&self.shared, self.idx, self.replica, *epoch, digest);
        }
        self.pending.push_back(frame.item.clone());
        self.flush();
        Ok(())
    }

    fn wants_bytes(&self) -> bool {
        false
    }

    fn flush(&mut self) {
        while let Some(item) = self.pending.pop_front() {
            if let Some(back) = offer(&self.shared, self.idx, item) {
                self.pending.push_front(back);
                return;
            }
        }
    }

    fn backlog(&self) -> usize {
        self.pending.len()
    }

    fn close(&mut self) -> Result<()> {
        self.flush();
        self.stop_feeding();
        if self.pending.is_empty() || self.shared.stop.load(Ordering::SeqCst) {
            return Ok(());
        }
        let left = self.pending.len();
        self.pending.clear();
        Err(Error::Closed(format!(
            "{left} elements for the downstream replica at {} (in this worker) were never \
             taken",
            self.peer
        )))
    }

    fn abort(&mut self) {
        self.pending.clear();
        self.stop_feeding();
    }

    fn describe(&self) -> String {
        format!("downstream replica at {} (in this worker)", self.peer)
    }

    fn peer_closed(&self) -> bool {
        self.shared.stop.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use std::sync::atomic::AtomicUsize;

    use arrow_array::cast::AsArray;
    use arrow_array::types::Int64Type;
    use arrow_array::{BinaryArray, Int64Array};
    use arrow_schema::{DataType, Field, Schema};

    use crate::digest::to_hex;
    use crate::logs::ReplicaTag;
    use crate::outbox::{Outbox, OutboxConfig, Partitioner};

    const JOB: &str = "job-7";
    const SECRET: &[u8] = b"s3cret";
    const TASK: u32 = 1;

    fn rows(values: std::ops::Range<i64>) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, false)]));
        RecordBatch::try_new(schema, vec![Arc::new(Int64Array::from_iter_values(values))]).unwrap()
    }

    /// Rows carrying a 1 KiB payload each, to fill socket buffers quickly.
    fn fat_rows(values: std::ops::Range<i64>) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("v", DataType::Int64, false),
            Field::new("pad", DataType::Binary, false),
        ]));
        let pad = vec![7u8; 1024];
        let n = (values.end - values.start) as usize;
        let pads = BinaryArray::from_iter_values(std::iter::repeat_n(&pad[..], n));
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int64Array::from_iter_values(values)),
                Arc::new(pads),
            ],
        )
        .unwrap()
    }

    fn identity(partition: u32, replica: u32) -> Identity {
        Identity {
            job: JOB.to_owned(),
            task: TASK,
            partition,
            replica,
        }
    }

    fn inbox(upstreams: usize, ordering: OrderingMode, capacity: usize) -> Inbox {
        let mut cfg = InboxConfig::new(
            JOB,
            SECRET,
            (0..upstreams as u32).map(|p| (TASK, p)).collect(),
        );
        cfg.ordering = ordering;
        cfg.queue_capacity = capacity;
        cfg.handshake_timeout = Duration::from_millis(500);
        Inbox::bind(cfg).unwrap()
    }

    fn link(addr: SocketAddr, me: &Identity) -> Box<dyn Link> {
        let cfg = LinkConfig {
            connect_timeout: Duration::from_secs(5),
            ..LinkConfig::default()
        };
        Box::new(TcpLink::connect(&addr.to_string(), me, SECRET, &cfg).unwrap())
    }

    /// A raw Data frame claiming `count` rows from `first_seq`, whose body is garbage.
    fn junk_data(first_seq: u64, count: u64) -> OutFrame {
        let header = wire::FrameHeader {
            kind: wire::FrameKind::Data,
            channel: 0,
            first_seq,
            count,
            body_len: 16,
        };
        let mut bytes = header.to_bytes().to_vec();
        bytes.extend_from_slice(&[0xAB; 16]);
        OutFrame {
            item: Item::End { seq: 0 }, // unused by a TCP link
            digest: None,
            bytes: Some(bytes.into()),
        }
    }

    fn end_at(seq: u64) -> OutFrame {
        OutFrame {
            item: Item::End { seq },
            digest: None,
            bytes: None,
        }
    }

    fn wait_for(ib: &Inbox, what: &str, ok: impl Fn(&InboxStats) -> bool) -> InboxStats {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let st = ib.stats();
            if ok(&st) {
                return st;
            }
            assert!(Instant::now() < deadline, "{what}: {st:?}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn local_copy_first_then_the_remote_duplicate_is_dropped_without_decoding() {
        let mut ib = inbox(1, OrderingMode::None, 64);
        let mut local = ib.local_link(&identity(0, 0)).unwrap();
        assert!(!local.wants_bytes());
        let first = OutFrame {
            item: Item::Data {
                first_seq: 0,
                payload: rows(0..10),
            },
            digest: None,
            bytes: None,
        };
        local.send(&first).unwrap();
        assert_eq!(local.backlog(), 0, "room in the channel: taken at once");
        // The remote twin's copy of the same rows: never decoded (its body is garbage),
        // counted as duplicate, and the connection stays up.
        let mut remote = link(ib.local_addr(), &identity(0, 1));
        remote.send(&junk_data(0, 10)).unwrap();
        let st = wait_for(&ib, "duplicate counted", |st| {
            st.channels[0].duplicate_rows == 10
        });
        assert!(st.connections[0].open && st.connections[0].error.is_none());
        // Garbage covering rows nobody has yet is decoded, and fails the connection.
        remote.send(&junk_data(10, 5)).unwrap();
        let st = wait_for(&ib, "connection failed", |st| {
            st.connections[0].error.is_some()
        });
        assert_eq!(st.channels[0].accepted_rows, 10);
        local.send(&end_at(10)).unwrap();
        let got = drain(&mut ib, Duration::from_secs(5));
        assert_eq!(rows_of(&got, 0), (0..10).collect::<Vec<_>>());
    }

    #[test]
    fn a_channel_whose_every_feeder_is_gone_before_its_end_fails_next_not_hangs() {
        let ob = |ib: &Inbox, replica: u32, local: bool| {
            let me = identity(0, replica);
            let l: Box<dyn Link> = if local {
                Box::new(ib.local_link(&me).unwrap())
            } else {
                link(ib.local_addr(), &me)
            };
            Outbox::new(Partitioner::Forward, vec![vec![l]], OutboxConfig::default()).unwrap()
        };
        let next_err = |ib: &mut Inbox| loop {
            match ib.next(Duration::from_secs(10)) {
                Ok(Some(_)) => continue,
                Ok(None) => panic!("next() waited for input that can never come"),
                Err(e) => return e,
            }
        };
        // One replica lost: its twin (here a local link) still feeds the channel.
        let mut ib = inbox(1, OrderingMode::LiveRobin, 64);
        let (mut a, mut b) = (ob(&ib, 0, false), ob(&ib, 1, true));
        for o in [&mut a, &mut b] {
            o.emit(&rows(0..5)).unwrap();
            o.heartbeat(1).unwrap();
        }
        a.abort();
        b.emit(&rows(5..9)).unwrap();
        b.end().unwrap();
        b.close();
        let mut got = Vec::new();
        while let Some(d) = ib.next(Duration::from_secs(10)).unwrap() {
            let end = matches!(d, Delivery::End);
            got.push(d);
            if end {
                break;
            }
        }
        assert!(matches!(got.last(), Some(Delivery::End)), "{got:?}");
        // Both lost before the end: next() says so instead of waiting forever.
        let mut ib = inbox(1, OrderingMode::LiveRobin, 64);
        let (mut a, mut b) = (ob(&ib, 0, false), ob(&ib, 1, true));
        for o in [&mut a, &mut b] {
            o.emit(&rows(0..5)).unwrap();
        }
        a.abort();
        b.abort();
        let e = next_err(&mut ib);
        assert!(
            matches!(&e, Error::Closed(m) if m.contains("lost every upstream replica")),
            "{e}"
        );
    }

    #[test]
    fn a_deferring_link_writes_what_it_held_back_on_push_in_order() {
        let mut ib = inbox(1, OrderingMode::None, 64);
        let mut remote = link(ib.local_addr(), &identity(0, 0));
        remote.defer(true);
        let data = |first: i64, n: i64| OutFrame {
            item: Item::End { seq: 0 }, // unused by a TCP link
            digest: None,
            bytes: Some(
                wire::encode_data(0, first as u64, &rows(first..first + n))
                    .unwrap()
                    .into(),
            ),
        };
        remote.send(&data(0, 3)).unwrap();
        remote.send(&data(3, 2)).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            ib.stats().channels[0].accepted_rows,
            0,
            "held back until push"
        );
        remote.push().unwrap();
        wait_for(&ib, "both frames delivered", |st| {
            st.channels[0].accepted_rows == 5
        });
        // Not deferring (the default): every frame leaves at once.
        remote.defer(false);
        remote.send(&data(5, 1)).unwrap();
        wait_for(&ib, "written at once", |st| {
            st.channels[0].accepted_rows == 6
        });
        let end = OutFrame {
            item: Item::End { seq: 6 },
            digest: None,
            bytes: Some(wire::encode_end(0, 6).into()),
        };
        remote.defer(true);
        remote.send(&end).unwrap();
        remote.close().unwrap(); // pushes what it held back first
        let got = drain(&mut ib, Duration::from_secs(5));
        assert_eq!(rows_of(&got, 0), (0..6).collect::<Vec<_>>());
    }

    #[test]
    fn merge_wait_counts_only_while_queued_input_is_held_back() {
        let data = |first_seq: u64| OutFrame {
            item: Item::Data {
                first_seq,
                payload: rows(0..2),
            },
            digest: None,
            bytes: None,
        };
        let mut ib = inbox(2, OrderingMode::LiveRobin, 64);
        // Nothing queued: waiting for input is not merge wait.
        assert!(ib.next(Duration::from_millis(30)).unwrap().is_none());
        assert_eq!(ib.stats().merge_wait, Duration::ZERO);
        // Channel 1 has rows, but it is channel 0's turn: they are held back.
        let mut zero = ib.local_link(&identity(0, 0)).unwrap();
        let mut one = ib.local_link(&identity(1, 0)).unwrap();
        one.send(&data(0)).unwrap();
        assert!(ib.next(Duration::from_millis(40)).unwrap().is_none());
        let held = ib.stats().merge_wait;
        assert!(held >= Duration::from_millis(30), "{held:?}");
        zero.send(&data(0)).unwrap();
        assert!(ib.next(Duration::from_secs(5)).unwrap().is_some());
        assert!(ib.next(Duration::from_secs(5)).unwrap().is_some());
        // Everything delivered: the wait stopped growing.
        let after = ib.stats().merge_wait;
        assert!(ib.next(Duration::from_millis(30)).unwrap().is_none());
        assert_eq!(ib.stats().merge_wait, after);
        assert!(after >= held);
    }

    #[test]
    fn a_local_link_holds_what_the_channel_has_no_room_for_in_order() {
        let mut ib = inbox(1, OrderingMode::None, 2);
        let mut local = ib.local_link(&identity(0, 0)).unwrap();
        for i in 0..5 {
            let f = OutFrame {
                item: Item::Data {
                    first_seq: i * 2,
                    payload: rows(i as i64 * 2..i as i64 * 2 + 2),
                },
                digest: None,
                bytes: None,
            };
            local.send(&f).unwrap();
        }
        local.send(&end_at(10)).unwrap();
        assert_eq!(local.backlog(), 4, "two fit the channel, the rest waits");
        let mut got = Vec::new();
        while local.backlog() > 0 {
            let d = ib.next(Duration::from_millis(100)).unwrap().unwrap();
            flatten(d, &mut got);
            local.flush();
        }
        got.extend(drain(&mut ib, Duration::from_secs(5)));
        assert_eq!(rows_of(&got, 0), (0..10).collect::<Vec<_>>());
        assert!(ib.local_link(&identity(5, 0)).is_err(), "not an upstream");
        ib.close();
        assert!(local.send(&junk_data(10, 1)).is_err(), "the inbox closed");
    }

    /// What one upstream replica sends: `total` rows `base + i` in emits of `emit_rows`, a
    /// heartbeat of epoch `k` after row `k * hb_every`, then end.
    #[derive(Clone, Copy)]
    struct Plan {
        total: i64,
        emit_rows: i64,
        hb_every: i64,
        batch_rows: usize,
        /// Abort (crash) after this many rows instead of finishing.
        crash_after: Option<i64>,
    }

    fn base(partition: u32) -> i64 {
        i64::from(partition) * 1_000_000
    }

    fn upstream(addr: SocketAddr, partition: u32, replica: u32, plan: Plan) -> JoinHandle<()> {
        std::thread::spawn(move || {
            let me = identity(partition, replica);
            let cfg = OutboxConfig {
                batch_rows: plan.batch_rows,
            };
            let mut ob =
                Outbox::new(Partitioner::Forward, vec![vec![link(addr, &me)]], cfg).unwrap();
            let b = base(partition);
            let mut i = 0;
            while i < plan.total {
                if plan.crash_after.is_some_and(|c| i >= c) {
                    ob.abort();
                    return;
                }
                let n = plan.emit_rows.min(plan.total - i);
                // Cut the emit at the next heartbeat position.
                let to_hb = plan.hb_every - i % plan.hb_every;
                let n = n.min(to_hb);
                if finished_on_twin(ob.emit(&rows(b + i..b + i + n))) {
                    return;
                }
                i += n;
                if i % plan.hb_every == 0 {
                    if finished_on_twin(ob.heartbeat((i / plan.hb_every) as u64)) {
                        return;
                    }
                    // Let the writers run, so a crash happens with data really in flight.
                    std::thread::sleep(Duration::from_millis(3));
                }
            }
            if !finished_on_twin(ob.end()) {
                ob.close();
            }
        })
    }

    /// Whether a send failed because every downstream replica already closed, having
    /// received the whole stream from this replica's twin (a replica behind its twin may
    /// find that); any other failure fails the test.
    fn finished_on_twin(sent: Result<()>) -> bool {
        match sent {
            Ok(()) => false,
            Err(Error::Closed(_)) => true,
            Err(e) => panic!("sending failed: {e}"),
        }
    }

    /// One element of a consumption, independent of batch boundaries.
    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Ev {
        Row(usize, i64),
        Hb(usize, u64, bool),
        End,
    }

    fn flatten(d: Delivery<RecordBatch>, out: &mut Vec<Ev>) {
        match d {
            Delivery::Data {
                channel, payload, ..
            } => {
                let v = payload.column(0).as_primitive::<Int64Type>();
                out.extend(v.values().iter().map(|&x| Ev::Row(channel, x)));
            }
            Delivery::Heartbeat {
                channel,
                epoch,
                first,
            } => out.push(Ev::Hb(channel, epoch, first)),
            Delivery::End => out.push(Ev::End),
        }
    }

    /// Consume until End (or fail after `limit`), one event per row.
    fn drain(inbox: &mut Inbox, limit: Duration) -> Vec<Ev> {
        let mut out = Vec::new();
        for d in drain_deliveries(inbox, limit) {
            flatten(d, &mut out);
        }
        out
    }

    /// Consume until End (or fail after `limit`), batches as delivered.
    fn drain_deliveries(inbox: &mut Inbox, limit: Duration) -> Vec<Delivery<RecordBatch>> {
        let deadline = Instant::now() + limit;
        let mut out = Vec::new();
        while Instant::now() < deadline {
            match inbox.next(Duration::from_millis(200)).unwrap() {
                Some(Delivery::End) => {
                    out.push(Delivery::End);
                    return out;
                }
                Some(d) => out.push(d),
                None => {}
            }
        }
        panic!(
            "no End within {limit:?}; got {} deliveries; stats {:#?}",
            out.len(),
            inbox.stats()
        );
    }

    /// The consumption a merge in `mode` produces when every channel's elements, as `got`
    /// delivered them (the same batches, in channel order), are present from the start.
    /// LiveRobin decides from the channels' batch sequences alone, so this must equal what
    /// the inbox consumed under real arrival timing.
    fn reference(mode: &OrderingMode, channels: usize, got: &[Delivery<RecordBatch>]) -> Vec<Ev> {
        let mut inputs: Vec<VecDeque<Item<RecordBatch>>> =
            (0..channels).map(|_| VecDeque::new()).collect();
        let mut next = vec![0u64; channels];
        for d in got {
            match d {
                Delivery::Data {
                    channel,
                    first_seq,
                    payload,
                } => {
                    assert_eq!(*first_seq, next[*channel], "channel {channel} skipped seqs");
                    next[*channel] += payload.num_rows() as u64;
                    inputs[*channel].push_back(Item::Data {
                        first_seq: *first_seq,
                        payload: payload.clone(),
                    });
                }
                Delivery::Heartbeat { channel, epoch, .. } => {
                    inputs[*channel].push_back(Item::Heartbeat {
                        seq: next[*channel],
                        epoch: *epoch,
                    });
                    next[*channel] += 1;
                }
                Delivery::End => {}
            }
        }
        for (q, &seq) in inputs.iter_mut().zip(&next) {
            q.push_back(Item::End { seq });
        }
        let mut m = merge::build::<RecordBatch>(mode, channels);
        let mut out = Vec::new();
        loop {
            match m.next(&mut inputs) {
                Some(Delivery::End) => {
                    out.push(Ev::End);
                    return out;
                }
                Some(d) => flatten(d, &mut out),
                None => panic!("reference merge stalled with complete inputs"),
            }
        }
    }

    fn rows_of(events: &[Ev], channel: usize) -> Vec<i64> {
        events
            .iter()
            .filter_map(|e| match e {
                Ev::Row(c, v) if *c == channel => Some(*v),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn liverobin_over_two_replicated_partitions_masks_an_abrupt_crash() {
        let mode = OrderingMode::LiveRobin;
        let mut ib = inbox(2, mode.clone(), 64);
        let addr = ib.local_addr();
        let plan = Plan {
            total: 6000,
            emit_rows: 37,
            hb_every: 500,
            batch_rows: 50,
            crash_after: None,
        };
        // The replicas of a partition emit the same batches (DESIGN §2 invariant 1); the two
        // partitions cut theirs differently.
        let other = Plan {
            emit_rows: 101,
            batch_rows: 64,
            ..plan
        };
        let threads = vec![
            upstream(addr, 0, 0, plan),
            // Replica 1 of partition 0 dies mid-stream: its sockets are cut, queued frames lost.
            upstream(
                addr,
                0,
                1,
                Plan {
                    crash_after: Some(2500),
                    ..plan
                },
            ),
            upstream(addr, 1, 0, other),
            upstream(addr, 1, 1, other),
        ];
        let deliveries = drain_deliveries(&mut ib, Duration::from_secs(60));
        let mut got = Vec::new();
        for d in deliveries.iter().cloned() {
            flatten(d, &mut got);
        }
        for t in threads {
            t.join().unwrap();
        }
        for c in 0..2 {
            let want: Vec<i64> = (0..plan.total).map(|i| base(c as u32) + i).collect();
            assert_eq!(
                rows_of(&got, c),
                want,
                "channel {c}: complete, in order, no duplicates"
            );
        }
        assert_eq!(
            got,
            reference(&mode, 2, &deliveries),
            "LiveRobin order is a function of the channels' batches"
        );
        let stats = ib.stats();
        for (c, s) in stats.channels.iter().enumerate() {
            assert_eq!(s.accepted_rows, plan.total as u64, "channel {c}");
            assert!(
                s.duplicate_rows > 0,
                "channel {c}: the second replica's copies were dropped: {stats:#?}"
            );
        }
        assert_eq!(stats.rejected_connections, 0);
        assert_eq!(
            (stats.divergence_count, stats.divergences.len()),
            (0, 0),
            "replicas emitting the same batches agree on every cycle"
        );
        assert_eq!(stats.connections.len(), 4);
        assert!(stats
            .connections
            .iter()
            .all(|c| c.identity.is_some() && c.frames > 0 && c.bytes > 0));
        let crashed = stats
            .connections
            .iter()
            .find(|c| {
                c.identity
                    .as_ref()
                    .is_some_and(|i| i.partition == 0 && i.replica == 1)
            })
            .unwrap();
        assert!(
            crashed.frames > 10,
            "the crashed replica did send before it died: {crashed:?}"
        );
    }

    #[test]
    fn one_publisher_sends_the_orders_of_every_partition_it_leads_together() {
        let plan = Plan {
            total: 3000,
            emit_rows: 17,
            hb_every: 300,
            batch_rows: 40,
            crash_after: None,
        };
        // Two ordered partitions of one worker: their inboxes ring one order bell.
        let bell = Arc::new(Doorbell::new());
        let bound = |_: usize| {
            let mut cfg = InboxConfig::new(JOB, SECRET, vec![(TASK, 0), (TASK, 1)]);
            cfg.ordering = OrderingMode::Positional;
            cfg.queue_capacity = 64;
            cfg.handshake_timeout = Duration::from_millis(500);
            cfg.order_bell = Some(Arc::clone(&bell));
            Inbox::bind(cfg).unwrap()
        };
        let (mut a, mut b) = (bound(0), bound(1));
        let feeds = [a.order_feed().unwrap(), b.order_feed().unwrap()];
        let mut publisher = OrderPublisher::new(Arc::clone(&bell));
        let resend = Duration::from_secs(5);
        for (key, feed) in feeds.iter().enumerate() {
            let leader = feed.lead(1, key as u32, 1000, resend);
            publisher.lead(key as u64, feed.clone(), leader).unwrap();
        }
        let foreign = inbox(2, OrderingMode::Positional, 4).order_feed().unwrap();
        let stray = foreign.lead(1, 9, 10, resend);
        assert!(
            publisher.lead(9, foreign, stray).is_err(),
            "an inbox of another worker rings another bell"
        );
        let mut threads = Vec::new();
        for addr in [a.local_addr(), b.local_addr()] {
            for p in 0..2 {
                threads.push(upstream(addr, p, 0, plan));
            }
        }
        let stop = Arc::new(AtomicBool::new(false));
        let log = {
            let stop = Arc::clone(&stop);
            let feeds = feeds.clone();
            std::thread::spawn(move || {
                // The order log: each message a batch of orders, followed by both at once.
                let (mut messages, mut shared, mut held) = (0, 0, 0);
                while !stop.load(Ordering::SeqCst) {
                    let due = publisher.next(Duration::from_millis(20));
                    if due.is_empty() {
                        continue;
                    }
                    // While this message is on its way, nothing more is due.
                    held += usize::from(publisher.due().is_empty());
                    messages += 1;
                    shared += usize::from(due.len() > 1);
                    let message: Vec<u8> = due.iter().flat_map(|(_, o)| o.clone()).collect();
                    for part in crate::orderlog::split_message(&message).unwrap() {
                        let feed = &feeds[part.slot as usize];
                        feed.offer(part.epoch, part.version, &part.entries).unwrap();
                    }
                    publisher.followed();
                }
                (messages, shared, held)
            })
        };
        let ga = std::thread::spawn(move || drain(&mut a, Duration::from_secs(60)));
        let got_b = drain(&mut b, Duration::from_secs(60));
        let got_a = ga.join().unwrap();
        stop.store(true, Ordering::SeqCst);
        let (messages, shared, held) = log.join().unwrap();
        for t in threads {
            t.join().unwrap();
        }
        for got in [&got_a, &got_b] {
            for c in 0..2 {
                let want: Vec<i64> = (0..plan.total).map(|i| base(c as u32) + i).collect();
                assert_eq!(rows_of(got, c), want, "channel {c}: complete and in order");
            }
        }
        assert_eq!(held, messages, "a message on its way held the next back");
        assert!(
            shared > 0,
            "{shared} of {messages} messages carried both partitions' orders"
        );
    }

    #[test]
    fn a_paced_publisher_leaves_its_pace_between_two_messages() {
        let bell = Arc::new(Doorbell::new());
        let mut cfg = InboxConfig::new(JOB, SECRET, vec![(TASK, 0), (TASK, 1)]);
        cfg.ordering = OrderingMode::Positional;
        cfg.order_bell = Some(Arc::clone(&bell));
        let ib = Inbox::bind(cfg).unwrap();
        let feed = ib.order_feed().unwrap();
        let mut publisher = OrderPublisher::new(bell);
        let pace = Duration::from_millis(40);
        publisher.pace(pace);
        let leader = feed.lead(1, 0, 10, Duration::from_secs(5));
        publisher.lead(0, feed.clone(), leader).unwrap();
        let plan = Plan {
            total: 50,
            emit_rows: 5,
            hb_every: 1000,
            batch_rows: 5,
            crash_after: None,
        };
        // Channel 1's input arrives only once the first message went out and was followed:
        // its order is due at once, and the pace holds it back.
        let first_up = upstream(ib.local_addr(), 0, 0, plan);
        let first = publisher.next(Duration::from_secs(5));
        let sent = Instant::now();
        assert!(!first.is_empty(), "channel 0's input arrived");
        for (_, order) in first {
            feed.offer_frame(&order).unwrap();
        }
        publisher.followed();
        let second_up = upstream(ib.local_addr(), 1, 0, plan);
        let second = loop {
            let due = publisher.next(Duration::from_secs(5));
            assert!(!due.is_empty(), "channel 1's input arrived");
            let orders: Vec<_> = due.into_iter().map(|(_, o)| o).collect();
            for o in &orders {
                feed.offer_frame(o).unwrap();
            }
            publisher.followed();
            if feed.ordered()[1] > 0 {
                break Instant::now();
            }
        };
        assert!(second - sent >= pace, "{:?}", second - sent);
        first_up.join().unwrap();
        second_up.join().unwrap();
    }

    #[test]
    fn positional_replicas_follow_one_order_log_across_a_leader_change() {
        let plan = Plan {
            total: 4000,
            emit_rows: 29,
            hb_every: 400,
            batch_rows: 40,
            crash_after: None,
        };
        // Two downstream replicas, each fed by both replicas of two upstream partitions. The
        // upstream replicas feeding X cut frames of 29 rows (one per emit), those feeding Y
        // of 23 + 6: the orders, positions published after what X received, must work at Y
        // whatever its frame boundaries. (Each inbox sees replicas that agree, as the
        // determinism check requires.)
        let mut x = inbox(2, OrderingMode::Positional, 64);
        let mut y = inbox(2, OrderingMode::Positional, 64);
        let (fx, fy) = (x.order_feed().unwrap(), y.order_feed().unwrap());
        let mut threads = Vec::new();
        for (addr, batch_rows) in [(x.local_addr(), 40), (y.local_addr(), 23)] {
            for p in 0..2 {
                for r in 0..2 {
                    let plan = Plan { batch_rows, ..plan };
                    threads.push(upstream(addr, p, r, plan));
                }
            }
        }
        // The order log: one sequence every replica reads, here offered to both in turn.
        let log: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let publisher = {
            let (log, stop, fx, fy) = (log.clone(), stop.clone(), fx.clone(), fy.clone());
            std::thread::spawn(move || {
                let resend = Duration::from_secs(5);
                let mut lx = fx.lead(1, 0, 1000, resend);
                let mut ly: Option<Leader> = None;
                let mut stale = None;
                while !stop.load(Ordering::SeqCst) {
                    // X leads (epoch 1) until half of channel 0 is ordered; then Y (epoch
                    // 2) takes over from the position the log implies, and one order X
                    // publishes after being deposed must be fenced off.
                    if ly.is_none() && fx.ordered()[0] >= plan.total as u64 / 2 {
                        stale = Some(wire::encode_order(
                            0,
                            1,
                            9_999,
                            &[wire::OrderEntry {
                                channel: 1,
                                up_to_seq: fx.arrived()[1],
                            }],
                        ));
                        ly = Some(fy.lead(2, 0, 1000, resend));
                    }
                    let wait = Duration::from_millis(20);
                    let order = match ly.as_mut() {
                        None => fx.next_order(&mut lx, wait),
                        Some(l) => fy.next_order(l, wait),
                    };
                    let late = ly.as_ref().is_some_and(|l| l.counts().0 == 3);
                    let late = if late { stale.take() } else { None };
                    for o in late.into_iter().chain(order) {
                        fx.offer_frame(&o).unwrap();
                        fy.offer_frame(&o).unwrap();
                        log.lock().push(o);
                    }
                }
            })
        };
        let gx = std::thread::spawn(move || drain(&mut x, Duration::from_secs(60)));
        let got_y = drain(&mut y, Duration::from_secs(60));
        let got_x = gx.join().unwrap();
        stop.store(true, Ordering::SeqCst);
        publisher.join().unwrap();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(got_x, got_y, "both replicas consumed the same sequence");
        for c in 0..2 {
            let want: Vec<i64> = (0..plan.total).map(|i| base(c as u32) + i).collect();
            assert_eq!(
                rows_of(&got_y, c),
                want,
                "channel {c}: complete and in order"
            );
        }
        let (sx, sy) = (fx.stats(), fy.stats());
        assert_eq!(sx, sy, "both replicas followed the same orders");
        assert_eq!(sx.epoch, Some(2));
        assert!(log.lock().len() > 10, "{sx:?}");
        assert_eq!(
            sx.stale, 1,
            "the deposed leader's order was fenced off: {sx:?}"
        );
    }

    #[test]
    fn a_slow_consumer_back_pressures_without_growing_the_queue_or_losing_rows() {
        const CAPACITY: usize = 4;
        const BATCH: usize = 16;
        const TOTAL: i64 = 8000; // ≈ 8 MiB of payload: more than the socket buffers hold
        let mut ib = inbox(1, OrderingMode::LiveRobin, CAPACITY);
        let addr = ib.local_addr();
        let sent = Arc::new(AtomicUsize::new(0));
        let producer = {
            let sent = Arc::clone(&sent);
            std::thread::spawn(move || {
                let cfg = OutboxConfig { batch_rows: BATCH };
                let links = vec![vec![link(addr, &identity(0, 0))]];
                let mut ob = Outbox::new(Partitioner::Forward, links, cfg).unwrap();
                for i in (0..TOTAL).step_by(BATCH) {
                    ob.emit(&fat_rows(i..i + BATCH as i64)).unwrap();
                    sent.store((i as usize) + BATCH, Ordering::SeqCst);
                }
                ob.end().unwrap();
                ob.close();
            })
        };
        // Consume nothing for a while: the producer must stall, the queue must stay bounded.
        let bound = (CAPACITY * BATCH) as u64;
        let mut stalled_at = 0;
        for _ in 0..10 {
            std::thread::sleep(Duration::from_millis(30));
            let q = ib.stats().channels[0].queued_seqs;
            assert!(q <= bound, "queue holds {q} seqs, bound {bound}");
            stalled_at = sent.load(Ordering::SeqCst);
        }
        assert!(
            stalled_at < TOTAL as usize,
            "the producer sent everything ({stalled_at} rows) to a consumer that read nothing"
        );
        // Now consume slowly at first, checking the bound all along, then drain.
        let mut got = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut n = 0;
        loop {
            assert!(Instant::now() < deadline, "no End; got {} rows", got.len());
            let q = ib.stats().channels[0].queued_seqs;
            assert!(q <= bound, "queue holds {q} seqs, bound {bound}");
            match ib.next(Duration::from_millis(200)).unwrap() {
                Some(Delivery::End) => break,
                Some(Delivery::Data { payload, .. }) => {
                    got.extend_from_slice(payload.column(0).as_primitive::<Int64Type>().values());
                    n += 1;
                    if n < 20 {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
                Some(Delivery::Heartbeat { .. }) | None => {}
            }
        }
        producer.join().unwrap();
        assert_eq!(got, (0..TOTAL).collect::<Vec<_>>());
    }

    #[test]
    fn bad_connections_are_rejected_while_a_good_one_flows() {
        let mut ib = inbox(1, OrderingMode::LiveRobin, 16);
        let addr = ib.local_addr();
        let plan = Plan {
            total: 3000,
            emit_rows: 10,
            hb_every: 300,
            batch_rows: 32,
            crash_after: None,
        };
        let good = upstream(addr, 0, 0, plan);

        let mut garbage = std::net::TcpStream::connect(addr).unwrap();
        let junk: Vec<u8> = (0..4096u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        let _ = garbage.write_all(&junk);

        let cfg = LinkConfig {
            connect_timeout: Duration::from_secs(5),
            ..LinkConfig::default()
        };
        let wrong_secret = TcpLink::connect(&addr.to_string(), &identity(0, 1), b"guess", &cfg);
        assert!(
            matches!(wrong_secret, Err(Error::Handshake(_))),
            "{:?}",
            wrong_secret.err()
        );
        let wrong_job = Identity {
            job: "other-job".to_owned(),
            ..identity(0, 1)
        };
        let r = TcpLink::connect(&addr.to_string(), &wrong_job, SECRET, &cfg);
        assert!(matches!(r, Err(Error::Handshake(_))), "{:?}", r.err());
        // Authenticated, but not an upstream of this inbox: accepted handshake, then dropped.
        let mut stranger = TcpLink::connect(
            &addr.to_string(),
            &Identity {
                partition: 9,
                ..identity(0, 2)
            },
            SECRET,
            &cfg,
        )
        .unwrap();
        let _ = stranger.send(&OutFrame {
            item: Item::Heartbeat { seq: 0, epoch: 99 },
            digest: None,
            bytes: Some(wire::encode_heartbeat(0, 0, 99).into()),
        });

        let got = drain(&mut ib, Duration::from_secs(30));
        good.join().unwrap();
        assert_eq!(rows_of(&got, 0), (0..plan.total).collect::<Vec<_>>());
        let hbs = got.iter().filter(|e| matches!(e, Ev::Hb(..))).count();
        assert_eq!(hbs, 10, "the stranger's heartbeat 99 never got in");
        // The garbage connection is rejected once its handshake fails (at once, or after the
        // handshake timeout): wait for it.
        let deadline = Instant::now() + Duration::from_secs(5);
        while ib.stats().rejected_connections < 4 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let stats = ib.stats();
        assert_eq!(stats.rejected_connections, 4, "{stats:#?}");
        let errors: Vec<&str> = stats
            .connections
            .iter()
            .filter_map(|c| c.error.as_deref())
            .collect();
        assert!(
            errors.iter().any(|e| e.contains("not an upstream")),
            "{errors:?}"
        );
        assert!(
            errors.iter().filter(|e| e.contains("handshake")).count() >= 3,
            "{errors:?}"
        );
        drop(garbage);
    }

    #[test]
    fn a_replay_left_unread_past_the_grace_counts_as_lagging() {
        // A receiver that never consumes: its queue of one fills, then the sockets.
        let ib = inbox(1, OrderingMode::LiveRobin, 1);
        let mut l = link(ib.local_addr(), &identity(0, 0));
        let frames: Vec<OutFrame> = (0..1_000_000u64)
            .map(|s| OutFrame {
                item: Item::Heartbeat {
                    seq: s,
                    epoch: s + 1,
                },
                digest: None,
                bytes: Some(wire::encode_heartbeat(0, s, s + 1).into()),
            })
            .collect();
        l.replay(&frames).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        let now = Instant::now();
        assert_eq!(
            l.backed_up_for(now),
            Some(Duration::ZERO),
            "catching up on its replay"
        );
        let later = now + REPLAY_GRACE + Duration::from_secs(1);
        let lag = l.backed_up_for(later).unwrap();
        assert!(lag > REPLAY_GRACE, "unread for the whole grace: {lag:?}");
        l.abort();
    }

    #[test]
    fn a_rejected_handshake_is_a_warning_naming_the_replica() {
        crate::logs::capture::install();
        let mut cfg = InboxConfig::new(JOB, SECRET, vec![(TASK, 0)]);
        cfg.me = Some(ReplicaTag::new(4, 2, 1).named("logtest-reject"));
        let ib = Inbox::bind(cfg).unwrap();
        let link_cfg = LinkConfig {
            connect_timeout: Duration::from_secs(5),
            ..LinkConfig::default()
        };
        let r = TcpLink::connect(
            &ib.local_addr().to_string(),
            &identity(0, 0),
            b"guess",
            &link_cfg,
        );
        assert!(matches!(r, Err(Error::Handshake(_))), "{:?}", r.err());
        let deadline = Instant::now() + Duration::from_secs(5);
        let got = loop {
            let got = crate::logs::capture::matching("logtest-reject: rejected a connection");
            if !got.is_empty() || Instant::now() > deadline {
                break got;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].level, log::Level::Warn);
        assert_eq!(got[0].target, "tandem.core.inbox");
        assert_eq!(got[0].kv("task"), Some("4"));
        assert_eq!(got[0].kv("partition"), Some("2"));
        assert_eq!(got[0].kv("replica"), Some("1"));
        assert!(got[0].message.contains("handshake"), "{got:?}");
    }

    #[test]
    fn a_downstream_that_closed_is_dropped_at_debug_level() {
        crate::logs::capture::install();
        let mut ib = inbox(1, OrderingMode::LiveRobin, 4);
        let l = link(ib.local_addr(), &identity(0, 0));
        let mut ob = Outbox::new(
            Partitioner::Forward,
            vec![vec![l]],
            OutboxConfig { batch_rows: 64 },
        )
        .unwrap()
        .tagged(ReplicaTag::new(TASK, 0, 0).named("logtest-finished"));
        // The downstream replica finished (on its twin's copies, say) and closed its end.
        ib.close();
        drop(ib);
        let mut failed = false;
        for i in 0..2000 {
            if ob.emit(&fat_rows(i * 64..(i + 1) * 64)).is_err() {
                failed = true;
                break;
            }
        }
        assert!(failed, "sending to a closed inbox kept succeeding");
        ob.close();
        let got = crate::logs::capture::matching("logtest-finished");
        assert!(!got.is_empty(), "the dropped link was not logged");
        assert!(
            got.iter().all(|c| c.level == log::Level::Debug),
            "a peer that closed its end is not a warning: {got:?}"
        );
        assert!(
            got[0].message.contains("dropping downstream replica"),
            "{got:?}"
        );
    }

    #[test]
    fn a_sender_on_another_wire_channel_is_cut_off() {
        let mut ib = inbox(1, OrderingMode::LiveRobin, 8);
        let addr = ib.local_addr();
        let dial = |replica| {
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            wire::client_handshake(&mut s, &identity(0, replica), SECRET).unwrap();
            s
        };
        let mut good = dial(0);
        good.write_all(&wire::encode_heartbeat(0, 0, 1)).unwrap();
        assert!(matches!(
            ib.next(Duration::from_secs(5)).unwrap(),
            Some(Delivery::Heartbeat {
                channel: 0,
                epoch: 1,
                first: true
            })
        ));
        // Same upstream partition, but frames of wire channel 3: mis-wired, dropped.
        let mut bad = dial(1);
        bad.write_all(&wire::encode_heartbeat(3, 1, 2)).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let err = loop {
            let stats = ib.stats();
            if let Some(e) = stats.connections.iter().find_map(|c| c.error.clone()) {
                break e;
            }
            assert!(
                Instant::now() < deadline,
                "the mis-wired connection stayed open"
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        assert!(
            err.contains("wire channel 3") && err.contains("wire channel 0"),
            "{err}"
        );
        assert_eq!(
            ib.next(Duration::from_millis(50)).unwrap(),
            None,
            "heartbeat 2 never got in"
        );
        good.write_all(&wire::encode_end(0, 1)).unwrap();
        assert_eq!(
            ib.next(Duration::from_secs(5)).unwrap(),
            Some(Delivery::End)
        );
    }

    #[test]
    fn close_does_not_hang_on_silent_or_blocked_peers() {
        let mut ib = inbox(1, OrderingMode::LiveRobin, 1);
        let addr = ib.local_addr();
        // A peer that connects and says nothing (stuck in the handshake).
        let _silent = std::net::TcpStream::connect(addr).unwrap();
        // A peer whose frames fill the queue: its reader waits for space forever.
        let mut ob = Outbox::new(
            Partitioner::Forward,
            vec![vec![link(addr, &identity(0, 0))]],
            OutboxConfig { batch_rows: 1 },
        )
        .unwrap();
        for i in 0..20 {
            ob.emit(&rows(i..i + 1)).unwrap();
        }
        std::thread::sleep(Duration::from_millis(100));
        let t = Instant::now();
        ib.close();
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "close took {:?}",
            t.elapsed()
        );
        assert!(
            matches!(ib.next(Duration::from_millis(10)), Ok(Some(_))),
            "queued input remains"
        );
        // The sender notices the peer is gone (possibly only after a few more frames).
        let t = Instant::now();
        let mut failed = false;
        for i in 20..10_000 {
            if ob.emit(&rows(i..i + 1)).is_err() {
                failed = true;
                break;
            }
        }
        assert!(failed, "sending to a closed inbox never failed");
        assert!(t.elapsed() < Duration::from_secs(5));
    }

    /// A one-channel inbox read by `reactor`.
    fn inbox_on(reactor: &Arc<Reactor>, capacity: usize) -> Inbox {
        let mut cfg = InboxConfig::new(JOB, SECRET, vec![(TASK, 0)]);
        cfg.queue_capacity = capacity;
        cfg.handshake_timeout = Duration::from_millis(500);
        cfg.reactor = Some(Arc::clone(reactor));
        Inbox::bind(cfg).unwrap()
    }

    /// A raw TCP connection of replica `replica` of partition 0, past its handshake.
    fn dial(addr: SocketAddr, replica: u32) -> std::net::TcpStream {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        wire::client_handshake(&mut s, &identity(0, replica), SECRET).unwrap();
        s
    }

    /// Send heartbeats 0..n (epoch seq + 1) then the end, from a thread of its own.
    fn send_heartbeats(mut s: std::net::TcpStream, n: u64) -> JoinHandle<()> {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            for seq in 0..n {
                buf.extend_from_slice(&wire::encode_heartbeat(0, seq, seq + 1));
                if buf.len() >= 64 << 10 {
                    s.write_all(&buf).unwrap();
                    buf.clear();
                }
            }
            buf.extend_from_slice(&wire::encode_end(0, n));
            s.write_all(&buf).unwrap();
        })
    }

    /// Heartbeats delivered before the end (which must come within `limit`).
    fn heartbeats_until_end(ib: &mut Inbox, limit: Duration) -> u64 {
        let deadline = Instant::now() + limit;
        let mut n = 0;
        loop {
            assert!(Instant::now() < deadline, "no end: {:?}", ib.stats());
            match ib.next(Duration::from_millis(100)).unwrap() {
                Some(Delivery::Heartbeat { .. }) => n += 1,
                Some(Delivery::End) => return n,
                Some(other) => panic!("unexpected {other:?}"),
                None => {}
            }
        }
    }

    #[test]
    fn one_reactor_reads_every_connection_of_many_inboxes() {
        let reactor = Arc::new(Reactor::new());
        let mut inboxes: Vec<Inbox> = (0..3).map(|_| inbox_on(&reactor, 16)).collect();
        let senders: Vec<JoinHandle<()>> = inboxes
            .iter()
            .flat_map(|ib| (0..2).map(|r| send_heartbeats(dial(ib.local_addr(), r), 5_000)))
            .collect();
        for ib in &mut inboxes {
            assert_eq!(heartbeats_until_end(ib, Duration::from_secs(30)), 5_000);
        }
        for s in senders {
            s.join().unwrap();
        }
        for ib in &inboxes {
            let stats = wait_all_closed(ib, 2);
            assert!(
                stats.connections.iter().all(|c| c.error.is_none()),
                "{stats:#?}"
            );
            assert_eq!(
                stats.connections.iter().map(|c| c.frames).sum::<u64>(),
                10_002
            );
        }
    }

    #[test]
    fn a_full_channel_holds_back_its_connection_only() {
        let reactor = Arc::new(Reactor::new());
        let mut stuck = inbox_on(&reactor, 1);
        let mut flowing = inbox_on(&reactor, 4);
        // Far more than the socket buffers hold: the sender blocks until it is read.
        let n = 200_000;
        let held = send_heartbeats(dial(stuck.local_addr(), 0), n);
        std::thread::sleep(Duration::from_millis(200));
        let free = send_heartbeats(dial(flowing.local_addr(), 0), 20_000);
        assert_eq!(
            heartbeats_until_end(&mut flowing, Duration::from_secs(30)),
            20_000
        );
        free.join().unwrap();
        let stats = stuck.stats();
        assert!(
            !held.is_finished(),
            "the stuck inbox's sender was never held back"
        );
        assert!(
            stats.channels[0].next_seq <= 2 && stats.channels[0].queued_seqs <= 1,
            "the queue is bounded: {stats:#?}"
        );
        // Consuming lets it go on: nothing was lost meanwhile.
        assert_eq!(heartbeats_until_end(&mut stuck, Duration::from_secs(60)), n);
        held.join().unwrap();
    }

    #[test]
    fn a_connection_cut_mid_frame_is_lost_and_no_longer_feeds_its_channel() {
        crate::logs::capture::install();
        let reactor = Arc::new(Reactor::new());
        let mut cfg = InboxConfig::new(JOB, SECRET, vec![(TASK, 0)]);
        cfg.reactor = Some(Arc::clone(&reactor));
        cfg.me = Some(ReplicaTag::new(4, 0, 0).named("logtest-cut-mid-frame"));
        let mut ib = Inbox::bind(cfg).unwrap();
        let mut s = dial(ib.local_addr(), 0);
        s.write_all(&wire::encode_heartbeat(0, 0, 1)).unwrap();
        let frame = wire::encode_heartbeat(0, 1, 2);
        s.write_all(&frame[..frame.len() / 2]).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        drop(s);
        assert!(matches!(
            ib.next(Duration::from_secs(5)).unwrap(),
            Some(Delivery::Heartbeat { epoch: 1, .. })
        ));
        let stats = wait_all_closed(&ib, 1);
        let err = stats.connections[0].error.clone().unwrap();
        assert!(err.contains("truncated"), "{err}");
        let got = crate::logs::capture::matching("logtest-cut-mid-frame: lost the connection");
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].level, log::Level::Info);
        let e = ib.next(Duration::from_secs(1)).unwrap_err().to_string();
        assert!(e.contains("lost every upstream replica"), "{e}");
    }

    #[test]
    fn close_ends_every_connection_at_once_and_spares_the_reactors_other_inboxes() {
        let reactor = Arc::new(Reactor::new());
        let mut closing = inbox_on(&reactor, 1);
        let mut other = inbox_on(&reactor, 8);
        // One connection held back by its full channel, one idle.
        let held = dial(closing.local_addr(), 0);
        let held_sender = send_heartbeats(held.try_clone().unwrap(), 200_000);
        let mut idle = dial(closing.local_addr(), 1);
        wait_for(&closing, "both connections served", |st| {
            st.connections
                .iter()
                .filter(|c| c.identity.is_some())
                .count()
                == 2
        });
        std::thread::sleep(Duration::from_millis(100));
        let t = Instant::now();
        closing.close();
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "close took {:?}",
            t.elapsed()
        );
        let stats = closing.stats();
        assert!(
            stats
                .connections
                .iter()
                .all(|c| !c.open && c.error.is_none()),
            "every connection ended by close(): {stats:#?}"
        );
        idle.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut byte = [0u8; 1];
        assert!(
            matches!(idle.read(&mut byte), Ok(0) | Err(_)),
            "the peer sees the end"
        );
        assert!(
            held_sender.join().is_err(),
            "the held-back sender's writes fail once the inbox is closed"
        );
        let s = send_heartbeats(dial(other.local_addr(), 0), 1_000);
        assert_eq!(
            heartbeats_until_end(&mut other, Duration::from_secs(30)),
            1_000
        );
        s.join().unwrap();
    }

    #[test]
    fn link_connect_times_out_when_nobody_listens() {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let cfg = LinkConfig {
            connect_timeout: Duration::from_millis(200),
            ..LinkConfig::default()
        };
        let t = Instant::now();
        let r = TcpLink::connect(&format!("127.0.0.1:{port}"), &identity(0, 0), SECRET, &cfg);
        assert!(
            matches!(&r, Err(Error::Closed(m)) if m.contains("cannot reach")),
            "{:?}",
            r.err()
        );
        assert!(t.elapsed() < Duration::from_secs(2));
    }

    fn determinism_inbox(on_divergence: OnDivergence) -> Inbox {
        let mut cfg = InboxConfig::new(JOB, SECRET, vec![(TASK, 0)]);
        cfg.on_divergence = on_divergence;
        Inbox::bind(cfg).unwrap()
    }

    /// Replicas 0 and 1 of upstream partition 0: cycles 1..=3 of 10 rows each (value
    /// `10 * (cycle - 1) + i`), frames of 4 rows, then end. In cycle `differ`, replica 1
    /// emits other values (as a non-deterministic operator would).
    fn twin_replicas(addr: SocketAddr, differ: Option<u64>) -> Vec<JoinHandle<()>> {
        (0..2)
            .map(|replica| {
                std::thread::spawn(move || {
                    let links = vec![vec![link(addr, &identity(0, replica))]];
                    let cfg = OutboxConfig { batch_rows: 4 };
                    let mut ob = Outbox::new(Partitioner::Forward, links, cfg).unwrap();
                    for epoch in 1..=3u64 {
                        let k = 10 * (epoch as i64 - 1);
                        let shift = if replica == 1 && differ == Some(epoch) {
                            1000
                        } else {
                            0
                        };
                        ob.emit(&rows(k + shift..k + shift + 10)).unwrap();
                        ob.heartbeat(epoch).unwrap();
                    }
                    ob.end().unwrap();
                    ob.close();
                })
            })
            .collect()
    }

    /// Wait until every connection of `ib` has been read to its end.
    fn wait_all_closed(ib: &Inbox, connections: usize) -> InboxStats {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let stats = ib.stats();
            let closed = stats.connections.iter().filter(|c| !c.open).count();
            if closed == connections {
                return stats;
            }
            assert!(
                Instant::now() < deadline,
                "connections stay open: {stats:#?}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn replicas_with_equal_output_pass_the_determinism_check() {
        let mut ib = determinism_inbox(OnDivergence::Fail);
        let threads = twin_replicas(ib.local_addr(), None);
        let got = drain(&mut ib, Duration::from_secs(30));
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(rows_of(&got, 0), (0..30).collect::<Vec<_>>());
        let stats = wait_all_closed(&ib, 2);
        assert_eq!((stats.divergence_count, stats.divergences.len()), (0, 0));
        assert!(
            stats.channels[0].duplicate_rows > 0,
            "both replicas were read: {stats:#?}"
        );
    }

    #[test]
    fn a_divergent_cycle_fails_next_naming_the_partition_replicas_cycle_and_digests() {
        let mut ib = determinism_inbox(OnDivergence::Fail);
        let threads = twin_replicas(ib.local_addr(), Some(2));
        let deadline = Instant::now() + Duration::from_secs(30);
        let msg = loop {
            assert!(Instant::now() < deadline, "no divergence reported");
            match ib.next(Duration::from_millis(200)) {
                Ok(_) => {}
                Err(Error::Determinism(msg)) => break msg,
                Err(e) => panic!("unexpected error {e}"),
            }
        };
        for t in threads {
            t.join().unwrap();
        }
        let d = ib.stats().divergences[0].clone();
        assert_eq!((d.channel, d.upstream, d.epoch), (0, (TASK, 0), 2));
        assert!(d.replicas == (0, 1) || d.replicas == (1, 0), "{d:?}");
        assert_ne!(d.digests.0, d.digests.1);
        let (a, b) = d.replicas;
        for needle in [
            format!("replicas {a} and {b} of upstream task {TASK} partition 0"),
            "heartbeat cycle 2".to_owned(),
            to_hex(&d.digests.0),
            to_hex(&d.digests.1),
            "not deterministic for a given input batch".to_owned(),
            "on_divergence=\"log\"".to_owned(),
        ] {
            assert!(msg.contains(&needle), "{needle:?} not in {msg:?}");
        }
        assert!(
            matches!(ib.next(Duration::ZERO), Err(Error::Determinism(_))),
            "every later call fails too"
        );
        let stats = wait_all_closed(&ib, 2);
        assert_eq!(
            stats.divergence_count, 1,
            "cycles 1 and 3 agree: {stats:#?}"
        );
    }

    #[test]
    fn under_log_a_divergence_is_counted_and_delivery_goes_on() {
        let mut ib = determinism_inbox(OnDivergence::Log);
        let threads = twin_replicas(ib.local_addr(), Some(2));
        let got = drain(&mut ib, Duration::from_secs(30));
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(rows_of(&got, 0).len(), 30, "every cycle delivered once");
        let stats = wait_all_closed(&ib, 2);
        assert_eq!(stats.divergence_count, 1, "{stats:#?}");
        let d = &stats.divergences[0];
        assert_eq!((d.channel, d.upstream, d.epoch), (0, (TASK, 0), 2));
        assert_ne!(d.digests.0, d.digests.1);
        assert_eq!(
            ib.next(Duration::ZERO).unwrap(),
            Some(Delivery::End),
            "still delivering"
        );
    }

    #[test]
    fn the_digest_table_keeps_recent_cycles_and_compares_other_replicas_only() {
        let mut t = CycleDigests::default();
        assert_eq!(t.check(5, 0, [1; 16]), None);
        assert_eq!(
            t.check(5, 0, [2; 16]),
            None,
            "the first replica again: not compared"
        );
        assert_eq!(t.check(5, 1, [1; 16]), None, "equal");
        assert_eq!(t.check(5, 2, [3; 16]), Some((0, [1; 16])));
        for epoch in 6..6 + DIGEST_EPOCHS_KEPT as u64 {
            assert_eq!(t.check(epoch, 0, [0; 16]), None);
        }
        assert_eq!(t.first.len(), DIGEST_EPOCHS_KEPT);
        assert_eq!(t.check(5, 1, [9; 16]), None, "cycle 5 has left the window");
        assert_eq!(t.first.len(), DIGEST_EPOCHS_KEPT, "and was not kept");
    }

    #[test]
    fn bad_inbox_configurations_are_rejected() {
        let ok = InboxConfig::new(JOB, SECRET, vec![(1, 0)]);
        let mut c = ok.clone();
        c.upstreams.clear();
        assert!(matches!(Inbox::bind(c), Err(Error::Config(m)) if m.contains("upstreams")));
        let mut c = ok.clone();
        c.upstreams = vec![(1, 0), (2, 0), (1, 0)];
        assert!(matches!(Inbox::bind(c), Err(Error::Config(m)) if m.contains("(1, 0)")));
        let mut c = ok.clone();
        c.queue_capacity = 0;
        assert!(matches!(Inbox::bind(c), Err(Error::Config(m)) if m.contains("queue_capacity")));
        let mut c = ok.clone();
        c.ordering = OrderingMode::Positional;
        assert!(Inbox::bind(c).unwrap().order_feed().is_some());
        assert_eq!(ok.on_divergence, OnDivergence::Fail);
        assert_eq!(OnDivergence::parse("log").unwrap(), OnDivergence::Log);
        assert_eq!(OnDivergence::parse("fail").unwrap(), OnDivergence::Fail);
        let msg = OnDivergence::parse("warn").unwrap_err().to_string();
        assert!(
            msg.contains("'fail' or 'log'") && msg.contains("\"warn\""),
            "{msg}"
        );
        assert!(Inbox::bind(ok).unwrap().order_feed().is_none());
    }
}
