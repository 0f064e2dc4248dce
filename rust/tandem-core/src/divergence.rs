//! The online determinism check (DESIGN §2 invariant 4): a heartbeat frame carries the
//! sender's digest of its channel's Data frames since the previous heartbeat
//! ([`crate::digest`]). An inbox compares it, for every connection and local link, with the
//! digest of the same cycle from the replica whose copy came first; a difference is a
//! [`Divergence`], which fails [`Inbox::next`] or is logged ([`OnDivergence`]). Only
//! heartbeat frames touch the digest table.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use log::Level;
use parking_lot::{Mutex, RwLock};

use crate::digest::{to_hex, Digest};
#[cfg(doc)]
use crate::inbox::{Inbox, InboxConfig, InboxStats};
use crate::logs::{log_replica, ReplicaTag, INBOX};
use crate::sync::Doorbell;
use crate::{Error, Result};

/// Heartbeat cycles per logical channel whose first digest is kept for comparison: a copy
/// arriving more than this many cycles after the first one is not checked.
pub const DIGEST_EPOCHS_KEPT: usize = 4096;
/// Divergences kept in [`InboxStats::divergences`] (all are counted).
pub const DIVERGENCES_KEPT: usize = 16;

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

/// What the check keeps of one logical channel.
struct ChannelDigests {
    upstream: (u32, u32),
    digests: Mutex<CycleDigests>,
    logged: AtomicBool,
}

impl ChannelDigests {
    fn new(upstream: (u32, u32)) -> Self {
        Self {
            upstream,
            digests: Mutex::default(),
            logged: AtomicBool::new(false),
        }
    }
}

/// The determinism check of one inbox: per input channel, the first digest of each recent
/// cycle; the divergences found; and what a divergence does ([`OnDivergence`]). Shared by
/// the inbox's connections, its local links and its consumer.
pub(crate) struct DivergenceCheck {
    on_divergence: OnDivergence,
    /// Per logical channel: its upstream partition, its recent cycles' first digests
    /// (touched by heartbeats only) and whether a divergence on it was logged already.
    /// Written only when channels join or are taken back.
    channels: RwLock<Vec<ChannelDigests>>,
    divergences: Mutex<Vec<Divergence>>,
    count: AtomicU64,
    /// Wakes the consumer when a divergence must fail it.
    bell: Arc<Doorbell>,
    /// The replica the inbox receives for (log lines).
    me: Option<ReplicaTag>,
    /// How log lines name the inbox: its replica's name, or its address.
    who: String,
}

impl DivergenceCheck {
    pub(crate) fn new(
        on_divergence: OnDivergence,
        upstreams: Vec<(u32, u32)>,
        bell: Arc<Doorbell>,
        me: Option<ReplicaTag>,
        who: String,
    ) -> Self {
        DivergenceCheck {
            on_divergence,
            channels: RwLock::new(upstreams.into_iter().map(ChannelDigests::new).collect()),
            divergences: Mutex::new(Vec::new()),
            count: AtomicU64::new(0),
            bell,
            me,
            who,
        }
    }

    /// Compare the digest of cycle `epoch` that `replica` sent on logical channel `idx` with
    /// the first copy's; record (and log or signal) a divergence.
    pub(crate) fn check(&self, idx: usize, replica: u32, epoch: u64, digest: Digest) {
        let channels = self.channels.read();
        let Some(channel) = channels.get(idx) else {
            return;
        };
        let Some((first, first_digest)) = channel.digests.lock().check(epoch, replica, digest)
        else {
            return;
        };
        let d = Divergence {
            channel: idx,
            upstream: channel.upstream,
            epoch,
            replicas: (first, replica),
            digests: (first_digest, digest),
        };
        {
            let mut kept = self.divergences.lock();
            if kept.len() < DIVERGENCES_KEPT {
                kept.push(d.clone());
            }
            self.count.fetch_add(1, Ordering::SeqCst);
        }
        match self.on_divergence {
            OnDivergence::Fail => self.bell.ring(),
            OnDivergence::Log => {
                if !channel.logged.swap(true, Ordering::Relaxed) {
                    log_replica!(
                        Level::Warn,
                        INBOX,
                        self.me.as_ref(),
                        "{}: {d}; the operator of task {} is not deterministic for a given input \
                         batch (on_divergence=\"log\": the job keeps running; later divergences on \
                         this input are only counted)",
                        self.who,
                        d.upstream.0
                    );
                }
            }
        }
    }

    /// Channels for `upstreams`, numbered after the present ones.
    pub(crate) fn grow(&self, upstreams: &[(u32, u32)]) {
        self.channels
            .write()
            .extend(upstreams.iter().copied().map(ChannelDigests::new));
    }

    /// The first `len` channels only.
    pub(crate) fn truncate(&self, len: usize) {
        self.channels.write().truncate(len);
    }

    /// Under [`OnDivergence::Fail`], once a divergence has been found: the error the
    /// consumer fails with, naming the first one.
    #[inline]
    pub(crate) fn failure(&self) -> Option<Error> {
        if self.on_divergence == OnDivergence::Fail && self.count.load(Ordering::SeqCst) > 0 {
            if let Some(d) = self.divergences.lock().first() {
                return Some(d.error());
            }
        }
        None
    }

    /// The first [`DIVERGENCES_KEPT`] divergences, in the order they were found.
    pub(crate) fn found(&self) -> Vec<Divergence> {
        self.divergences.lock().clone()
    }

    /// Every divergence found.
    pub(crate) fn count(&self) -> u64 {
        self.count.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;
    use std::thread::JoinHandle;
    use std::time::{Duration, Instant};

    use crate::inbox::{Inbox, InboxConfig};
    use crate::outbox::{Outbox, OutboxConfig, Partitioner};
    use crate::test_support::*;
    use crate::Delivery;

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
    fn on_divergence_is_fail_or_log_by_name() {
        assert_eq!(OnDivergence::parse("log").unwrap(), OnDivergence::Log);
        assert_eq!(OnDivergence::parse("fail").unwrap(), OnDivergence::Fail);
        let msg = OnDivergence::parse("warn").unwrap_err().to_string();
        assert!(
            msg.contains("'fail' or 'log'") && msg.contains("\"warn\""),
            "{msg}"
        );
    }
}
