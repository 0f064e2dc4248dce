//! The receiving side of one task partition replica, the [`Inbox`]: its listener, the
//! handshakes, its connections read by a [`Reactor`] (each one's reading state machine),
//! dedup and merge. What feeds it is in [`crate::link`] (a [`TcpLink`] from another
//! process, a [`LocalLink`] from this one, made by [`Inbox::local_link`]), the KaZoo
//! orderer's handle on it in [`crate::orderfeed`] ([`Inbox::order_feed`]), the comparison
//! of its upstream replicas' digests in [`crate::divergence`]. Those modules build on this
//! one, not the other way round: each method is defined beside what it returns.
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
//! Determinism is checked online, on every heartbeat of every connection and local link
//! ([`crate::divergence`]).

use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener};
use std::ops::Range;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use arrow_array::RecordBatch;
use log::Level;
use parking_lot::{Mutex, RwLock};

use crate::dedup::{self, DedupReceiver, DedupSender, Offer};
use crate::digest::Digest;
use crate::divergence::{Divergence, DivergenceCheck, OnDivergence};
use crate::logs::{log_replica, ReplicaTag, INBOX};
use crate::merge::{self, Merge, MergeCut, OrderingMode};
use crate::orderlog::{OrderLog, OrderLogCut};
use crate::reactor::{Reactor, Source, Turn};
use crate::socket::{self, Listener, Stream};
use crate::sync::{Doorbell, Wake};
use crate::wire::{self, Frame, FrameReader, Identity, Next};
#[cfg(doc)]
use crate::{
    divergence::DIVERGENCES_KEPT,
    link::{LocalLink, TcpLink},
    orderfeed::OrderPublisher,
};
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
    /// Take nothing until [`Inbox::unpark`] gives the cut to start from: a partition a live
    /// rescale adds, whose upstreams connect before the switch its state is built at.
    pub parked: bool,
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
            parked: false,
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
        if self.parked && self.resume.is_some() {
            return Err(Error::Config(
                "a parked inbox gets its cut when it is unparked, not at bind".to_owned(),
            ));
        }
        if self.parked && matches!(self.ordering, OrderingMode::Positional) {
            return Err(Error::Config(
                "a KaZoo (positional) inbox cannot be parked".to_owned(),
            ));
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
}

struct Conn {
    counters: Arc<ConnCounters>,
    /// The thread of its handshake (which hands the connection to the reactor).
    handshake: Option<JoinHandle<()>>,
}

/// One logical input channel as its feeders reach it: the upstream partition, the dedup
/// channel's sending side and the counters. A connection or local link holds its
/// channel's `Arc`, so the receive path indexes nothing and takes no lock.
struct Chan {
    upstream: (u32, u32),
    sender: DedupSender<RecordBatch>,
    counters: ChannelCounters,
    /// KaZoo, an aligned cut asked for ([`Inbox::align_at`]): its heartbeat epoch (0:
    /// none), and, once that heartbeat arrived, the sequence number right after it — how
    /// far this replica's leader may order the channel until every channel is ordered
    /// through the heartbeat ([`Arrivals::orderable`]).
    barrier: AtomicU64,
    hold: AtomicU64,
    /// The highest heartbeat epoch offered on the channel.
    heartbeat: AtomicU64,
}

impl Chan {
    fn new(upstream: (u32, u32), sender: DedupSender<RecordBatch>) -> Arc<Self> {
        Arc::new(Chan {
            upstream,
            sender,
            counters: ChannelCounters {
                wire_channel: AtomicU64::new(u64::MAX),
                ..Default::default()
            },
            barrier: AtomicU64::new(0),
            hold: AtomicU64::new(u64::MAX),
            heartbeat: AtomicU64::new(0),
        })
    }

    /// Hold the leader's orders of this channel at heartbeat `epoch` (0: let them go).
    fn hold_at(&self, epoch: u64) {
        self.hold.store(u64::MAX, Ordering::SeqCst);
        self.barrier.store(epoch, Ordering::SeqCst);
    }
}

/// State shared by the accept threads, the handshake threads, the reactor and the consumer.
struct Shared {
    job: String,
    secret: Vec<u8>,
    /// The logical channels in index order. Written only when channels join
    /// ([`Inbox::join_channels`]); read by handshakes, which look their channel up.
    chans: RwLock<Vec<Arc<Chan>>>,
    max_frame_bytes: u64,
    handshake_timeout: Duration,
    stop: AtomicBool,
    conns: Mutex<Vec<Conn>>,
    rejected: AtomicU64,
    order_frames_logged: AtomicBool,
    /// The online determinism check of the heartbeats' digests.
    divergence: DivergenceCheck,
    /// Wakes the consumer (a feeder gone).
    bell: Arc<Doorbell>,
    /// The replica this inbox receives for (log lines).
    me: Option<ReplicaTag>,
    /// How log lines name this inbox: its replica's name, or its address.
    who: String,
}

impl Shared {
    /// The logical channel upstream partition `(task, partition)` feeds, and its index,
    /// counted as fed by one more feeder — under the lock, so a join being taken back
    /// ([`Inbox::cancel_join`]) sees it.
    fn feed(&self, task: u32, partition: u32) -> Option<(usize, Arc<Chan>)> {
        let chans = self.chans.read();
        let (i, c) = chans
            .iter()
            .enumerate()
            .find(|(_, c)| c.upstream == (task, partition))?;
        c.counters.feed();
        Some((i, Arc::clone(c)))
    }

    /// Hold every channel at heartbeat `epoch` (0: let them go): [`Chan::hold_at`].
    fn hold_at(&self, epoch: u64) {
        for c in self.chans.read().iter() {
            c.hold_at(epoch);
        }
    }

    fn upstreams(&self) -> Vec<(u32, u32)> {
        self.chans.read().iter().map(|c| c.upstream).collect()
    }
}

/// The receiving side of one task partition replica. See the module documentation.
pub struct Inbox {
    shared: Arc<Shared>,
    /// The consumer's copy of `shared.chans` (it alone changes them).
    chans: Vec<Arc<Chan>>,
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
    /// The channels of the last [`Inbox::join_channels`], which [`Inbox::cancel_join`]
    /// may take back until they take input.
    joined: Option<Range<usize>>,
    /// Elements queued per channel ([`InboxConfig::queue_capacity`]), for joined channels.
    queue_capacity: usize,
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
                if cfg.parked {
                    dedup::channel_parked(cfg.queue_capacity, Arc::clone(&bell), None)
                } else {
                    dedup::channel_watched(
                        start(c),
                        cfg.queue_capacity,
                        Arc::clone(&bell),
                        order_bell.clone(),
                    )
                }
            })
            .unzip();
        let chans: Vec<Arc<Chan>> = cfg
            .upstreams
            .iter()
            .zip(senders)
            .map(|(&u, s)| Chan::new(u, s))
            .collect();
        let who = cfg
            .me
            .as_ref()
            .map_or_else(|| format!("inbox at {local_addr}"), |m| m.name.clone());
        let divergence = DivergenceCheck::new(
            cfg.on_divergence,
            cfg.upstreams.clone(),
            Arc::clone(&bell),
            cfg.me.clone(),
            who.clone(),
        );
        let shared = Arc::new(Shared {
            job: cfg.job,
            secret: cfg.secret,
            chans: RwLock::new(chans.clone()),
            max_frame_bytes: cfg.max_frame_bytes,
            handshake_timeout: cfg.handshake_timeout,
            stop: AtomicBool::new(false),
            conns: Mutex::new(Vec::new()),
            rejected: AtomicU64::new(0),
            order_frames_logged: AtomicBool::new(false),
            divergence,
            bell: Arc::clone(&bell),
            who,
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
                chans[c].counters.ended.store(ended, Ordering::SeqCst);
            }
        }
        Ok(Inbox {
            shared,
            chans,
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
            joined: None,
            queue_capacity: cfg.queue_capacity,
        })
    }

    /// The number of logical input channels.
    pub fn channels(&self) -> usize {
        self.receivers.len()
    }

    /// Whether the inbox was bound parked ([`InboxConfig::parked`]) and is not unparked yet.
    pub fn parked(&self) -> bool {
        self.receivers.first().is_some_and(DedupReceiver::parked)
    }

    /// Start a parked inbox at `cut`: each channel takes its input from `cut.positions` on
    /// (what its senders held back is offered again at once), the merge from `cut.merge`.
    /// A cut built for the new partition from its predecessors' cuts: one live rescale.
    pub fn unpark(&mut self, cut: &InboxCut) -> Result<()> {
        if !self.parked() {
            return Err(Error::Config(
                "unpark of an inbox that is not parked (or unparked already)".to_owned(),
            ));
        }
        let n = self.receivers.len();
        if cut.positions.len() != n || cut.log.is_some() {
            return Err(Error::Config(format!(
                "a cut of {} input channels{} cannot start a parked inbox of {n}",
                cut.positions.len(),
                if cut.log.is_some() {
                    " with an order log"
                } else {
                    ""
                }
            )));
        }
        self.merge.resume(&cut.merge, &cut.positions)?;
        for (i, (r, c)) in self.receivers.iter_mut().zip(&self.chans).enumerate() {
            r.unpark(cut.positions[i])?;
            let ended = cut.merge.ended.get(i).copied().unwrap_or(false);
            c.counters.ended.store(ended, Ordering::SeqCst);
        }
        self.bell.ring();
        Ok(())
    }

    /// Append a logical channel for each of `upstreams` (new partitions of an upstream
    /// task: a live rescale), each starting at seq 0, and have the merge take them after
    /// heartbeat `after_epoch` ([`Merge::join`]). Peers of the new upstreams are accepted
    /// from now on. Returns the new channels' indices. Nothing changes if it fails.
    pub fn join_channels(
        &mut self,
        upstreams: &[(u32, u32)],
        after_epoch: u64,
    ) -> Result<Range<usize>> {
        if self.orders.is_some() {
            return Err(Error::Config(
                "a KaZoo (positional) inbox takes no new channels".to_owned(),
            ));
        }
        let mut all: Vec<(u32, u32)> = self.chans.iter().map(|c| c.upstream).collect();
        all.extend_from_slice(upstreams);
        let mut seen = all.clone();
        seen.sort_unstable();
        if let Some(w) = seen.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::Config(format!(
                "upstream (task, partition) {:?} is a channel of this inbox already",
                w[0]
            )));
        }
        self.merge.join(upstreams.len(), after_epoch)?;
        let first = self.chans.len();
        let capacity = self.queue_capacity;
        let mut chans = self.shared.chans.write();
        for &u in upstreams {
            let (tx, rx) = dedup::channel(capacity, Arc::clone(&self.bell));
            let chan = Chan::new(u, tx);
            chans.push(Arc::clone(&chan));
            self.chans.push(chan);
            self.receivers.push(rx);
        }
        self.shared.divergence.grow(upstreams);
        drop(chans);
        let joined = first..self.chans.len();
        self.joined = Some(joined.clone());
        Ok(joined)
    }

    /// Take back the channels of the last [`Inbox::join_channels`] (a live rescale given
    /// up before its switch), so the inbox is the one it was before. Refused once any of
    /// them took input or a connection for them was accepted.
    pub fn cancel_join(&mut self) -> Result<()> {
        let Some(joined) = self.joined.clone() else {
            return Err(Error::Config("no channels joined to take back".to_owned()));
        };
        let touched = self.chans[joined.clone()]
            .iter()
            .any(|c| c.sender.next_seq() > 0 || c.counters.fed.load(Ordering::SeqCst));
        if touched {
            return Err(Error::Config(
                "the joined channels took input already; too late to take them back".to_owned(),
            ));
        }
        self.merge.cancel_join(joined.len())?;
        let mut chans = self.shared.chans.write();
        chans.truncate(joined.start);
        self.shared.divergence.truncate(joined.start);
        drop(chans);
        self.chans.truncate(joined.start);
        self.receivers.truncate(joined.start);
        self.joined = None;
        Ok(())
    }

    /// The channel `me`, a replica of an upstream partition living in this process, feeds
    /// (for [`Inbox::local_link`]), counted among the channel's feeders.
    pub(crate) fn feeder(&self, me: &Identity) -> Result<Feeder> {
        let shared = &self.shared;
        if me.job != shared.job {
            return Err(Error::Handshake(format!(
                "a local link of job {:?} to an inbox of job {:?}",
                me.job, shared.job
            )));
        }
        let (idx, chan) = shared.feed(me.task, me.partition).ok_or_else(|| {
            Error::Config(format!(
                "(task {}, partition {}) is not an upstream of the inbox at {} (upstreams: {:?})",
                me.task,
                me.partition,
                self.local_addr,
                shared.upstreams()
            ))
        })?;
        Ok(Feeder {
            shared: Arc::clone(shared),
            chan,
            idx,
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
        if self.parked() {
            return Err(Error::Config(
                "inbox.next() on a parked inbox: unpark it with its cut first".to_owned(),
            ));
        }
        let deadline = Instant::now().checked_add(timeout);
        loop {
            // Read the generation before looking, so an arrival between the look and the
            // sleep still wakes us.
            let seen = self.bell.generation();
            if let Some(e) = self.shared.divergence.failure() {
                return Err(e);
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
                .chans
                .iter()
                .position(|c| c.counters.orphaned())
                .filter(|_| !self.wait_orphaned)
            {
                let (task, partition) = self.chans[c].upstream;
                return Err(Error::Starved(format!(
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

    /// An aligned cut at heartbeat `epoch` is asked for: see [`Merge::align_at`]. A
    /// positional (KaZoo) merge follows its leader's orders, so its leader, if this
    /// replica leads, orders no channel past its heartbeat `epoch` until every channel is
    /// ordered through it ([`crate::orderfeed::OrderFeed::next_order`]); the cut is then
    /// taken where every channel stands right after that heartbeat, at every replica
    /// following the log.
    pub fn align_at(&mut self, epoch: u64) {
        self.merge.align_at(epoch);
        if self.orders.is_some() {
            self.shared.hold_at(epoch);
        }
    }

    /// The aligned cut is taken or given up: see [`Merge::release`].
    pub fn release(&mut self) {
        self.merge.release();
        if self.orders.is_some() {
            self.shared.hold_at(0);
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

    /// What the KaZoo orderer's handle on this inbox ([`Inbox::order_feed`]) is made of:
    /// the order log the merge follows, what has arrived, the consumer's bell and the bell
    /// rung by this inbox's arrivals and followed orders. None unless the ordering is
    /// positional.
    pub(crate) fn order_parts(&self) -> Option<OrderParts> {
        self.orders.as_ref().map(|(log, order_bell)| OrderParts {
            log: Arc::clone(log),
            arrivals: Arrivals(Arc::clone(&self.shared)),
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
            .zip(&self.chans)
            .any(|(r, c)| c.sender.next_seq() > r.next_seq());
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
            .chans
            .iter()
            .zip(&self.receivers)
            .map(|(c, r)| {
                let next_seq = c.sender.next_seq();
                ChannelStats {
                    upstream: c.upstream,
                    accepted_rows: c.counters.accepted_rows.load(Ordering::Relaxed),
                    duplicate_rows: c.counters.duplicate_rows.load(Ordering::Relaxed),
                    next_seq,
                    queued_seqs: next_seq.saturating_sub(r.next_seq()),
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
            divergences: self.shared.divergence.found(),
            divergence_count: self.shared.divergence.count(),
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

/// One logical channel of an inbox as a feeder in this process ([`LocalLink`]) reaches it:
/// elements go straight into its dedup channel, heartbeat digests to the inbox's
/// determinism check. Counted among the channel's feeders until [`Feeder::unfeed`].
pub(crate) struct Feeder {
    shared: Arc<Shared>,
    chan: Arc<Chan>,
    idx: usize,
}

impl Feeder {
    /// Whether the inbox is closing or closed.
    #[inline]
    pub(crate) fn closed(&self) -> bool {
        self.shared.stop.load(Ordering::SeqCst)
    }

    /// Compare the digest of cycle `epoch` that `replica` sent with the first copy's.
    #[inline]
    pub(crate) fn check_digest(&self, replica: u32, epoch: u64, digest: Digest) {
        self.shared
            .divergence
            .check(self.idx, replica, epoch, digest);
    }

    /// Offer `item` to the channel once, counting its rows as accepted or duplicate;
    /// handed back when there is no room or a gap before it (offer it again later).
    #[inline]
    pub(crate) fn offer(&self, item: Item<RecordBatch>) -> Option<Item<RecordBatch>> {
        offer(&self.chan, item)
    }

    /// No longer a feeder of the channel; the consumer is woken (it may now be waiting for
    /// what will never come).
    pub(crate) fn unfeed(&self) {
        self.chan.counters.feeders.fetch_sub(1, Ordering::SeqCst);
        self.shared.bell.ring();
    }
}

/// What has arrived at an inbox (deduplicated), for the KaZoo leader deciding the next
/// orders.
#[derive(Clone)]
pub(crate) struct Arrivals(Arc<Shared>);

impl Arrivals {
    /// Per channel, the first sequence number not yet accepted.
    pub(crate) fn arrived(&self) -> Vec<u64> {
        self.0
            .chans
            .read()
            .iter()
            .map(|c| c.sender.next_seq())
            .collect()
    }

    /// [`Arrivals::arrived`] as far as the leader may order it, given `ordered` (what the
    /// log covers): while an aligned cut is asked for ([`Inbox::align_at`]) and some
    /// channel is not yet ordered through its heartbeat, no channel beyond its own
    /// heartbeat. A channel's hold is stored before its heartbeat is offered, and read
    /// here after what arrived, so an arrival past the heartbeat is never seen without it.
    ///
    /// A channel is through once ordered past its hold; with no hold, once it ended, or
    /// passed the heartbeat before the cut was asked for (it cannot be held there: the
    /// cut will not be aligned, and is asked for again later). So the holds always end,
    /// even for a replica never cut.
    /// Have this replica's leader hold every channel right after its heartbeat `epoch`
    /// (0: let them go) — see [`Arrivals::orderable`].
    pub(crate) fn hold_at(&self, epoch: u64) {
        self.0.hold_at(epoch);
    }

    pub(crate) fn orderable(&self, ordered: &[u64]) -> Vec<u64> {
        let chans = self.0.chans.read();
        let mut arrived: Vec<u64> = chans.iter().map(|c| c.sender.next_seq()).collect();
        let barrier = chans
            .iter()
            .map(|c| c.barrier.load(Ordering::SeqCst))
            .max()
            .unwrap_or(0);
        if barrier == 0 {
            return arrived;
        }
        let holds: Vec<u64> = chans
            .iter()
            .map(|c| c.hold.load(Ordering::SeqCst))
            .collect();
        let through = chans.iter().zip(&holds).zip(ordered).all(|((c, &h), &o)| {
            if h == u64::MAX {
                c.counters.ended.load(Ordering::SeqCst)
                    || c.heartbeat.load(Ordering::SeqCst) >= barrier
            } else {
                o >= h
            }
        });
        if !through {
            for (a, h) in arrived.iter_mut().zip(holds) {
                *a = (*a).min(h);
            }
        }
        arrived
    }
}

/// What the orderer's handle on a positional inbox is made of ([`Inbox::order_parts`]).
pub(crate) struct OrderParts {
    /// The order log the merge follows.
    pub(crate) log: Arc<Mutex<OrderLog>>,
    pub(crate) arrivals: Arrivals,
    /// The consumer's bell (shared by the worker's inboxes).
    pub(crate) bell: Arc<Doorbell>,
    /// Rung by this inbox's arrivals and followed orders only.
    pub(crate) order_bell: Arc<Doorbell>,
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
                        let chan = Arc::clone(&reading.chan);
                        if let Err((source, e)) = reactor.register(Box::new(reading)) {
                            drop(source);
                            conn_ended(
                                &shared,
                                &counters,
                                Some(&chan),
                                ConnEnd::Failed(format!("cannot read the connection: {e}")),
                            );
                        }
                    }
                    Err(end) => conn_ended(&shared, &counters, None, end),
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
/// `chan`: the channel it fed, once its handshake was accepted.
fn conn_ended(shared: &Shared, counters: &ConnCounters, chan: Option<&Chan>, end: ConnEnd) {
    if let Some(c) = chan {
        c.counters.feeders.fetch_sub(1, Ordering::SeqCst);
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
    // From here on the reactor reads only what is there; the FrameReader keeps a frame
    // cut short by `WouldBlock` and resumes it on the next turn.
    if let Err(e) = stream.inner.set_nonblocking(true) {
        return Err(ConnEnd::Failed(format!(
            "cannot make the socket non-blocking: {e}"
        )));
    }
    let Some((idx, chan)) = shared.feed(identity.task, identity.partition) else {
        return Err(ConnEnd::Rejected(format!(
            "sender (task {}, partition {}) replica {} is not an upstream of this inbox (upstreams: \
             {:?})",
            identity.task,
            identity.partition,
            identity.replica,
            shared.upstreams()
        )));
    };
    let replica = identity.replica;
    *counters.identity.lock() = Some(identity);
    // Buffered: a sender writes a worker turn's frames in one go, and one read takes them
    // all (instead of two per frame: header, then body). A body larger than the buffer is
    // still read straight into its own allocation.
    let stream = io::BufReader::with_capacity(READ_BUFFER_BYTES, stream);
    Ok(Reading {
        shared: Arc::clone(shared),
        counters: Arc::clone(counters),
        chan,
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
    /// The logical channel it feeds, and its index.
    chan: Arc<Chan>,
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
        self.seen = self.chan.sender.producer_bell().generation();
        match offer(&self.chan, item) {
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
        let chan = &*self.chan;
        let sender = &chan.sender;
        // A Data frame whose every row is in already (the twin's copy came first) is
        // counted and dropped without decoding its Arrow body.
        let next = self
            .reader
            .next_frame_unless(|h| h.first_seq.saturating_add(h.count) <= sender.next_seq());
        let frame = match next {
            Ok(Some(Next::Frame(f))) => f,
            Ok(Some(Next::Skipped(h))) => {
                self.counters.frames.fetch_add(1, Ordering::Relaxed);
                check_wire_channel(&chan.counters, h.channel).map_err(ConnEnd::Failed)?;
                chan.counters
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
        check_wire_channel(&chan.counters, wire_channel).map_err(ConnEnd::Failed)?;
        if let Some((epoch, digest)) = digest {
            shared
                .divergence
                .check(self.idx, self.replica, epoch, digest);
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
            || self.chan.sender.producer_bell().generation() != self.seen
    }

    fn notify(&self, wake: Arc<dyn Wake>) -> bool {
        self.chan
            .sender
            .producer_bell()
            .notify_once(self.seen, wake)
    }

    fn finish(self: Box<Self>) {
        let Reading {
            shared,
            counters,
            chan,
            reader,
            end,
            ..
        } = *self;
        drop(reader); // closes the socket: the peer sees the end at once
        conn_ended(
            &shared,
            &counters,
            Some(&chan),
            end.unwrap_or(ConnEnd::Stopped),
        );
    }
}

/// Whether a read error means the sender went away (its process died, or it reset the
/// connection) rather than that it sent something wrong.
fn sender_lost(e: &Error) -> bool {
    match e {
        Error::Io(io) => socket::peer_gone(io.kind()),
        Error::Protocol(crate::error::ProtocolError::Truncated { .. }) => true,
        _ => false,
    }
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

/// Offer `item` to the dedup channel once, counting its rows as accepted or duplicate;
/// handed back when there is no room or a gap before it (offer it again later).
fn offer(chan: &Chan, item: Item<RecordBatch>) -> Option<Item<RecordBatch>> {
    let counters = &chan.counters;
    let rows = match &item {
        Item::Data { payload, .. } => payload.rows() as u64,
        Item::Heartbeat { .. } | Item::End { .. } => 0,
    };
    if let Item::Heartbeat { seq, epoch } = &item {
        // An aligned cut's heartbeat (KaZoo): the leader holds the channel right after it.
        chan.heartbeat.fetch_max(*epoch, Ordering::SeqCst);
        let barrier = chan.barrier.load(Ordering::SeqCst);
        if barrier != 0 && barrier == *epoch {
            chan.hold.store(seq.saturating_add(1), Ordering::SeqCst);
        }
    }
    let end = matches!(item, Item::End { .. });
    let offered = chan.sender.offer(item);
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use std::sync::atomic::AtomicUsize;

    use arrow_array::cast::AsArray;
    use arrow_array::types::Int64Type;

    use crate::link::{LinkConfig, TcpLink};
    use crate::outbox::{Link, OutFrame, Outbox, OutboxConfig, Partitioner};
    use crate::test_support::*;

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
            matches!(&e, Error::Starved(m) if m.contains("lost every upstream replica")),
            "{e}"
        );
    }

    /// A TCP outbox of upstream `(TASK, partition)` replica `replica` into `addr`.
    fn tcp_outbox(addr: SocketAddr, partition: u32, replica: u32) -> Outbox {
        let me = identity(partition, replica);
        Outbox::new(
            Partitioner::Forward,
            vec![vec![link(addr, &me)]],
            OutboxConfig::default(),
        )
        .unwrap()
    }

    /// A peer of upstream `(TASK, partition)` dials `addr` and sends an end, if the inbox
    /// lets it in (a refused one is counted in `rejected_connections`).
    fn knock(addr: SocketAddr, partition: u32) {
        let cfg = LinkConfig {
            connect_timeout: Duration::from_secs(5),
            ..LinkConfig::default()
        };
        let me = identity(partition, 0);
        if let Ok(mut l) = TcpLink::connect(&addr.to_string(), &me, SECRET, &cfg) {
            let _ = l.send(&end_at(0));
        }
    }

    #[test]
    fn joined_channels_are_accepted_from_the_join_and_take_turns_after_their_heartbeat() {
        let mut ib = inbox(1, OrderingMode::LiveRobin, 64);
        let addr = ib.local_addr();
        knock(addr, 1); // not an upstream yet: refused
        wait_for(&ib, "the early peer refused", |st| {
            st.rejected_connections == 1
        });
        let mut old = tcp_outbox(addr, 0, 0);
        old.emit(&rows(0..3)).unwrap();
        old.heartbeat(1).unwrap();
        old.emit(&rows(3..6)).unwrap();
        assert_eq!(ib.join_channels(&[(TASK, 1)], 2).unwrap(), 1..2);
        assert!(
            ib.join_channels(&[(TASK, 0)], 2).is_err(),
            "an upstream that is a channel already"
        );
        let mut new = tcp_outbox(addr, 1, 0);
        // The new channel's rows arrive first; they wait for the end of cycle 2.
        new.emit(&rows(100..103)).unwrap();
        new.heartbeat(3).unwrap();
        new.end().unwrap();
        new.close();
        wait_for(&ib, "the new channel's input", |st| {
            st.channels[1].next_seq == 5
        });
        old.heartbeat(2).unwrap();
        old.emit(&rows(6..9)).unwrap();
        old.heartbeat(3).unwrap();
        old.end().unwrap();
        old.close();
        let got = drain(&mut ib, Duration::from_secs(10));
        let hb2 = got.iter().position(|e| *e == Ev::Hb(0, 2, true)).unwrap();
        let first_new = got.iter().position(|e| matches!(e, Ev::Row(1, _))).unwrap();
        assert!(
            first_new > hb2,
            "a joined row before heartbeat 2 ended: {got:?}"
        );
        assert_eq!(rows_of(&got, 0), (0..9).collect::<Vec<_>>());
        assert_eq!(rows_of(&got, 1), vec![100, 101, 102]);
        assert_eq!(got.last(), Some(&Ev::End));
        let st = ib.stats();
        assert_eq!(st.channels.len(), 2);
        assert_eq!(st.channels[1].upstream, (TASK, 1));
        assert_eq!(st.channels[1].accepted_rows, 3);
        assert_eq!(st.rejected_connections, 1);
    }

    #[test]
    fn a_join_taken_back_leaves_the_inbox_as_it_was() {
        let mut ib = inbox(1, OrderingMode::LiveRobin, 64);
        let addr = ib.local_addr();
        ib.join_channels(&[(TASK, 1)], 4).unwrap();
        ib.cancel_join().unwrap();
        assert_eq!(ib.channels(), 1);
        assert!(ib.cancel_join().is_err(), "nothing left to take back");
        knock(addr, 1);
        wait_for(&ib, "the taken-back upstream refused", |st| {
            st.rejected_connections == 1
        });
        // Joined again, and a peer of the joined channel connected: too late to take back.
        ib.join_channels(&[(TASK, 1)], 4).unwrap();
        let mut new = tcp_outbox(addr, 1, 0);
        new.emit(&rows(0..2)).unwrap();
        wait_for(&ib, "the joined channel fed", |st| {
            st.channels[1].next_seq == 2
        });
        assert!(ib.cancel_join().is_err());
        // Channel 0 alone until cycle 4 (the joined channel still has its feeder: a lost
        // one would starve the inbox, as for any channel).
        let mut old = tcp_outbox(addr, 0, 0);
        old.emit(&rows(0..3)).unwrap();
        old.heartbeat(1).unwrap();
        let mut got = Vec::new();
        while got.len() < 4 {
            if let Some(d) = ib.next(Duration::from_secs(10)).unwrap() {
                flatten(d, &mut got);
            }
        }
        assert_eq!(
            got,
            vec![
                Ev::Row(0, 0),
                Ev::Row(0, 1),
                Ev::Row(0, 2),
                Ev::Hb(0, 1, true)
            ]
        );
        old.abort();
    }

    #[test]
    fn a_parked_inbox_holds_its_peers_then_delivers_from_the_unpark_positions() {
        let mut cfg = InboxConfig::new(JOB, SECRET, vec![(TASK, 0)]);
        cfg.parked = true;
        let mut ib = Inbox::bind(cfg).unwrap();
        assert!(ib.parked());
        assert!(
            ib.next(Duration::from_millis(1)).is_err(),
            "not before its cut"
        );
        // seqs: rows 0..5 = 0..5, heartbeat 1 = 5, rows 5..8 = 6..9, heartbeat 2 = 9, end 10.
        let mut twins: Vec<Outbox> = (0..2).map(|r| tcp_outbox(ib.local_addr(), 0, r)).collect();
        for ob in &mut twins {
            ob.emit(&rows(0..5)).unwrap();
            ob.heartbeat(1).unwrap();
            ob.emit(&rows(5..8)).unwrap();
            ob.heartbeat(2).unwrap();
            ob.end().unwrap();
        }
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            ib.stats().channels[0].next_seq,
            0,
            "a parked channel takes nothing"
        );
        assert_eq!(ib.stats().channels[0].accepted_rows, 0);
        let cut = InboxCut {
            positions: vec![6],
            merge: MergeCut {
                turn: 0,
                gen: Some(1),
                ended: vec![false],
                orders: Vec::new(),
            },
            log: None,
        };
        ib.unpark(&cut).unwrap();
        assert!(!ib.parked());
        assert!(ib.unpark(&cut).is_err(), "only once");
        let got = drain(&mut ib, Duration::from_secs(10));
        assert_eq!(
            got,
            vec![
                Ev::Row(0, 5),
                Ev::Row(0, 6),
                Ev::Row(0, 7),
                Ev::Hb(0, 2, true),
                Ev::End
            ]
        );
        assert_eq!(ib.stats().channels[0].accepted_rows, 3);
        for ob in &mut twins {
            ob.close();
        }
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
        assert!(Inbox::bind(ok).unwrap().order_feed().is_none());
    }
}
