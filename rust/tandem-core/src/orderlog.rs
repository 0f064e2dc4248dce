//! The KaZoo order log as every replica follows it (the paper's §IV, DESIGN §2.3).
//!
//! The leader of a task partition publishes *orders* to a log every replica reads in the
//! same sequence (a single-partition Kafka topic). An order is `(epoch, version, entries)`:
//! `epoch` is the publishing leader's fencing token (it grows with every new leader),
//! `version` numbers the leader's orders, and each entry says "consume channel `c` until
//! its next sequence number is `s`" ([`crate::merge::Positional`] executes them).
//!
//! [`OrderLog`] decides, order by order, what a replica follows. The decision depends only
//! on the orders before it in the log — never on timing — so every replica reading the same
//! log follows the same orders, and therefore consumes the same sequence:
//!
//! * an order whose epoch is *older* than the highest epoch already in the log is
//!   **stale** (a deposed leader that had not yet noticed) and is ignored: fencing;
//! * an order of the current epoch whose version is not above the last one followed is a
//!   **replay** (the log delivers at least once) and is ignored;
//! * anything else is followed. Entries are positional and idempotent, so an order that
//!   repeats ground already covered is a no-op, and a version gap loses nothing: a later
//!   order's bounds cover what a missing one would have said.
//!
//! The log also remembers, per channel, the furthest position any followed order reached
//! ([`OrderLog::ordered`]): a new leader reads the log to its end and continues from there.
//!
//! A [`Leader`] decides what the leader of one epoch publishes. Its first order is a
//! **fence**: no entries, just its epoch. Followed, it makes every older epoch stale for
//! every replica from that point of the log on (a dead leader's order still in flight when
//! it died is ignored if it lands after the fence, followed by all if before), and it tells
//! the new leader that its own replica has read everything before it: only then does it
//! order, from what the log covers by then. After that, per channel, what has
//! arrived beyond what the log covers, channels taken round-robin.
//! It keeps one order in flight, and an order counts as delivered once the leader's own
//! replica has *followed* it from the log — the point where every replica can act on it —
//! so what arrives meanwhile goes into the next order: orders grow with the load, an idle
//! stream waits for nothing, and the log and its readers see one message per round trip
//! rather than one per arrival.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::error::{Error, ProtocolError, Result};
use crate::wire::{self, Frame, OrderEntry};

/// What [`OrderLog::offer`] did with an order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Followed: its entries are queued for the merge.
    Followed,
    /// Ignored: published by a deposed leader (`epoch` < `current`).
    Stale { epoch: u64, current: u64 },
    /// Ignored: the current leader's `version` was already followed (a redelivery).
    Replayed { epoch: u64, version: u64 },
}

/// Counters of an [`OrderLog`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OrderLogStats {
    /// Orders followed.
    pub followed: u64,
    /// Orders ignored as stale (fenced off).
    pub stale: u64,
    /// Orders ignored as replays.
    pub replayed: u64,
    /// Entries followed.
    pub entries: u64,
    /// The highest leader epoch in the log (None before the first order).
    pub epoch: Option<u64>,
    /// Version of the last order followed in `epoch`.
    pub version: u64,
}

/// See the module documentation.
#[derive(Debug, Clone)]
pub struct OrderLog {
    ordered: Vec<u64>,
    pending: VecDeque<(usize, u64)>,
    stats: OrderLogStats,
    /// The log's offset this replica has read through (the next message it takes), as
    /// its reader reports with [`OrderLog::read_through`].
    through: u64,
}

/// What a replica rebuilt from a twin needs of the twin's [`OrderLog`] to follow the log
/// on from where the twin stood (with the orders followed but not consumed yet, which the
/// merge's cut carries). Its reader may start anywhere at or before `through`: every order
/// before that is at or below `(epoch, version)`, so the resumed log ignores it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OrderLogCut {
    pub epoch: Option<u64>,
    pub version: u64,
    pub ordered: Vec<u64>,
    pub through: u64,
}

impl OrderLog {
    /// A log for a merge over `channels` input channels.
    pub fn new(channels: usize) -> Self {
        Self {
            ordered: vec![0; channels],
            pending: VecDeque::new(),
            stats: OrderLogStats::default(),
            through: 0,
        }
    }

    /// The log of a replica rebuilt from a twin's `cut` (see [`OrderLogCut`]).
    pub fn resumed(channels: usize, cut: &OrderLogCut) -> Result<Self> {
        if cut.ordered.len() != channels {
            return Err(Error::Config(format!(
                "an order log cut over {} channels cannot resume a log over {channels}",
                cut.ordered.len()
            )));
        }
        Ok(Self {
            ordered: cut.ordered.clone(),
            pending: VecDeque::new(),
            stats: OrderLogStats {
                epoch: cut.epoch,
                version: cut.version,
                ..OrderLogStats::default()
            },
            through: cut.through,
        })
    }

    /// Where this log stands (the followed entries not drained yet are the caller's: they
    /// belong with the merge's, [`OrderLog::pending`]).
    pub fn cut(&self) -> OrderLogCut {
        OrderLogCut {
            epoch: self.stats.epoch,
            version: self.stats.version,
            ordered: self.ordered.clone(),
            through: self.through,
        }
    }

    /// The followed entries not yet drained, oldest first.
    pub fn pending(&self) -> impl Iterator<Item = (usize, u64)> + '_ {
        self.pending.iter().copied()
    }

    /// [`OrderLog::offer`] for an order of the message at `offset`; None (and nothing
    /// changes) if this log has read past that message already — a replica rebuilt from a
    /// twin's cut whose reader started before it.
    pub fn offer_at(
        &mut self,
        offset: u64,
        epoch: u64,
        version: u64,
        entries: &[OrderEntry],
    ) -> Result<Option<Verdict>> {
        if offset < self.through {
            return Ok(None);
        }
        self.offer(epoch, version, entries).map(Some)
    }

    /// The reader has offered every order of the messages before `offset`.
    pub fn read_through(&mut self, offset: u64) {
        self.through = self.through.max(offset);
    }

    /// See [`OrderLog::read_through`].
    pub fn through(&self) -> u64 {
        self.through
    }

    /// Decide on the next order of the log (see the module documentation). An entry naming
    /// a channel this merge does not have is an error, and the whole order is rejected
    /// without changing anything: the log and the task's inputs disagree.
    pub fn offer(&mut self, epoch: u64, version: u64, entries: &[OrderEntry]) -> Result<Verdict> {
        if let Some(bad) = entries
            .iter()
            .find(|e| e.channel as usize >= self.ordered.len())
        {
            return Err(Error::Config(format!(
                "order of epoch {epoch} version {version} names input channel {}, but this \
                 task partition has {} input channels (0..{}); the order log belongs to another \
                 task or job",
                bad.channel,
                self.ordered.len(),
                self.ordered.len()
            )));
        }
        let s = &mut self.stats;
        match s.epoch {
            Some(current) if epoch < current => {
                s.stale += 1;
                return Ok(Verdict::Stale { epoch, current });
            }
            Some(current) if epoch == current && version <= s.version => {
                s.replayed += 1;
                return Ok(Verdict::Replayed { epoch, version });
            }
            _ => {}
        }
        s.epoch = Some(epoch);
        s.version = version;
        s.followed += 1;
        s.entries += entries.len() as u64;
        for e in entries {
            let c = e.channel as usize;
            self.ordered[c] = self.ordered[c].max(e.up_to_seq);
            self.pending.push_back((c, e.up_to_seq));
        }
        Ok(Verdict::Followed)
    }

    /// [`OrderLog::offer`] for an encoded Order frame (a message of the order log). The
    /// buffer must hold exactly one Order frame.
    pub fn offer_frame(&mut self, frame: &[u8]) -> Result<Verdict> {
        let (decoded, used) = wire::decode_frame(frame, wire::DEFAULT_MAX_FRAME_BYTES)?;
        if used != frame.len() {
            return Err(ProtocolError::Inconsistent(format!(
                "an order log message must hold exactly one frame: {} bytes follow its \
                 {used}-byte frame",
                frame.len() - used
            ))
            .into());
        }
        match decoded {
            Frame::Order {
                epoch,
                version,
                entries,
                ..
            } => self.offer(epoch, version, &entries),
            other => Err(ProtocolError::Inconsistent(format!(
                "an order log message must be an Order frame, got a {:?} frame",
                kind_name(&other)
            ))
            .into()),
        }
    }

    /// Take the followed entries not yet handed to the merge, oldest first.
    pub fn drain(&mut self) -> std::collections::vec_deque::Drain<'_, (usize, u64)> {
        self.pending.drain(..)
    }

    /// Per channel, the furthest position a followed order reached: where a new leader
    /// continues from once it has read the log to its end.
    pub fn ordered(&self) -> &[u64] {
        &self.ordered
    }

    /// Counters, the current epoch and version.
    pub fn stats(&self) -> OrderLogStats {
        self.stats
    }
}

/// One Order frame of an order log message (see [`split_message`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrderPart {
    /// The frame header's channel: which ordered task partition of the run the order is
    /// for (the run numbers them; one log serves every ordered partition of a run).
    pub slot: u32,
    pub epoch: u64,
    pub version: u64,
    pub entries: Vec<OrderEntry>,
    /// Where the frame lies in the message.
    pub bytes: std::ops::Range<usize>,
}

/// The Order frames one message of the order log holds, in order: a leader's worker
/// publishes the orders of every partition it leads that are due at once in one message.
/// Anything but a non-empty sequence of whole Order frames is an error.
pub fn split_message(message: &[u8]) -> Result<Vec<OrderPart>> {
    let mut parts = Vec::new();
    let mut at = 0;
    while at < message.len() {
        let (frame, used) = wire::decode_frame(&message[at..], wire::DEFAULT_MAX_FRAME_BYTES)?;
        match frame {
            Frame::Order {
                channel,
                epoch,
                version,
                entries,
            } => parts.push(OrderPart {
                slot: channel,
                epoch,
                version,
                entries,
                bytes: at..at + used,
            }),
            other => {
                return Err(ProtocolError::Inconsistent(format!(
                    "an order log message holds Order frames only, got a {} frame at byte {at}",
                    kind_name(&other)
                ))
                .into())
            }
        }
        at += used;
    }
    if parts.is_empty() {
        return Err(ProtocolError::Inconsistent("an empty order log message".to_owned()).into());
    }
    Ok(parts)
}

/// The publishing side of one leadership (one epoch) of a task partition; see the module
/// documentation. [`Leader::next`] is a pure step — what arrived, what the log says, the
/// clock — so the decision is testable without a log or a thread
/// ([`crate::orderfeed::OrderFeed::next_order`] drives it from a replica's inbox).
#[derive(Debug, Clone)]
pub struct Leader {
    epoch: u64,
    /// The header `channel` of the Order frames: the task partition, for readers of the log.
    partition: u32,
    /// At most this many entries per order.
    batch: usize,
    /// Version of the last order handed out: versions start at 1 in every epoch, and a
    /// leadership resumed in the epoch the log follows continues after the log's version.
    version: u64,
    /// The channel the next order's entries start with (round-robin, so no channel is
    /// always last in a batch that is split).
    cursor: usize,
    /// Orders decided but not handed out yet (the rest of a split batch).
    queued: VecDeque<Vec<u8>>,
    /// The version the leader waits to see followed, and when it was handed out.
    in_flight: Option<(u64, Instant)>,
    /// An order not followed after this long is taken as lost: the leader publishes again
    /// from what the log holds (harmless: orders are positional, a replay is ignored).
    resend_after: Duration,
    published_orders: u64,
    resent: u64,
}

impl Leader {
    /// The leader of `epoch`, continuing from `log` (this replica's log, read to its end).
    ///
    /// A leadership of the epoch the log already follows (the same ZooKeeper session
    /// resuming after it was in doubt) numbers its orders after the last one the log
    /// followed: the log ignores an order of the current epoch whose version it has seen
    /// (a replay), so orders restarting at version 1 would all be ignored, and — counted
    /// as followed by their version — stall the partition.
    pub fn new(
        epoch: u64,
        partition: u32,
        batch: usize,
        log: OrderLogStats,
        resend_after: Duration,
    ) -> Self {
        let version = if log.epoch == Some(epoch) {
            log.version
        } else {
            0
        };
        Self {
            epoch,
            partition,
            batch: batch.max(1),
            version,
            cursor: 0,
            queued: VecDeque::new(),
            in_flight: None,
            resend_after,
            published_orders: 0,
            resent: 0,
        }
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Version of the last order handed out.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Number the next orders after `version` (at least): an earlier leadership of this
    /// epoch handed out orders up to it that may still land in the log, and an order of
    /// this one under the same version would be ignored as a replay of it.
    pub fn continue_after(&mut self, version: u64) {
        self.version = self.version.max(version);
    }

    /// Orders handed out, and how many times an order in flight was given up on.
    pub fn counts(&self) -> (u64, u64) {
        (self.published_orders, self.resent)
    }

    /// Whether the last order handed out is still on its way: not yet followed in `log`
    /// (this replica's log) and handed out less than `patience` ago.
    pub fn awaiting(&self, log: OrderLogStats, now: Instant, patience: Duration) -> bool {
        self.queued.is_empty()
            && self.in_flight.is_some_and(|(version, since)| {
                !self.followed(version, log) && now.duration_since(since) < patience
            })
    }

    /// Whether `log` (this replica's) has followed this leader's order `version`.
    fn followed(&self, version: u64, log: OrderLogStats) -> bool {
        log.epoch == Some(self.epoch) && log.version >= version
    }

    /// The last order handed out was not delivered: forget it, and order again from what
    /// the log holds at the next step.
    pub fn lost(&mut self) {
        self.in_flight = None;
        self.queued.clear();
    }

    /// The next order to publish, if one is due: none while the last one handed out is
    /// neither followed (`log`: the stats of this replica's log, `ordered` its positions)
    /// nor overdue, or while nothing arrived (`arrived`, per channel) beyond what the log
    /// covers.
    ///
    /// The leader orders from the log's positions, never from what it remembers having
    /// published: with one order in flight, everything it handed out before is settled
    /// once that order is followed — applied, or ignored as stale or a replay — and only
    /// the log knows which. So an order the log ignored is ordered again at the next step.
    pub fn next(
        &mut self,
        arrived: &[u64],
        ordered: &[u64],
        log: OrderLogStats,
        now: Instant,
    ) -> Option<Vec<u8>> {
        if let Some(order) = self.queued.pop_front() {
            // The rest of a split batch goes out at once, as its first part did.
            return Some(self.hand_out(order, now));
        }
        if let Some((version, since)) = self.in_flight {
            if self.followed(version, log) {
                self.in_flight = None;
            } else if now.duration_since(since) >= self.resend_after {
                self.resent += 1;
                self.lost();
            } else {
                return None;
            }
        }
        if log.epoch.is_none_or(|e| e < self.epoch) {
            // Not fenced yet (or the fence was lost): the fence first, alone.
            self.version += 1;
            let fence = wire::encode_order(self.partition, self.epoch, self.version, &[]);
            return Some(self.hand_out(fence, now));
        }
        self.decide(arrived, ordered);
        let order = self.queued.pop_front()?;
        Some(self.hand_out(order, now))
    }

    fn hand_out(&mut self, order: Vec<u8>, now: Instant) -> Vec<u8> {
        self.in_flight = Some((self.version - self.queued.len() as u64, now));
        self.published_orders += 1;
        order
    }

    fn decide(&mut self, arrived: &[u64], ordered: &[u64]) {
        let n = arrived.len().min(ordered.len());
        let mut entries = Vec::new();
        for i in 0..n {
            let c = (self.cursor + i) % n;
            if arrived[c] > ordered[c] {
                entries.push(OrderEntry {
                    channel: c as u32,
                    up_to_seq: arrived[c],
                });
            }
        }
        if entries.is_empty() {
            return;
        }
        self.cursor = (self.cursor + 1) % n;
        for chunk in entries.chunks(self.batch) {
            self.version += 1;
            self.queued.push_back(wire::encode_order(
                self.partition,
                self.epoch,
                self.version,
                chunk,
            ));
        }
    }
}

fn kind_name(frame: &Frame) -> &'static str {
    match frame {
        Frame::Data { .. } => "data",
        Frame::Heartbeat { .. } => "heartbeat",
        Frame::Order { .. } => "order",
        Frame::End { .. } => "end",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_resumed_from_a_cut_ignores_what_came_before_and_follows_what_comes_after() {
        let e = |channel, up_to_seq| OrderEntry { channel, up_to_seq };
        let mut twin = OrderLog::new(2);
        assert_eq!(
            twin.offer_at(0, 3, 1, &[e(0, 5)]).unwrap(),
            Some(Verdict::Followed)
        );
        twin.read_through(1);
        assert_eq!(
            twin.offer_at(1, 3, 2, &[e(1, 4)]).unwrap(),
            Some(Verdict::Followed)
        );
        twin.read_through(2);
        let cut = twin.cut();
        assert_eq!(cut.through, 2);
        assert_eq!(cut.ordered, vec![5, 4]);
        assert_eq!(
            twin.pending().collect::<Vec<_>>(),
            vec![(0, 5), (1, 4)],
            "not drained: the caller carries them with the merge's"
        );
        // A reader starting before the cut: what the twin read is skipped (offer_at) or,
        // read again from an earlier place, ignored as a replay.
        let mut resumed = OrderLog::resumed(2, &cut).unwrap();
        assert_eq!(resumed.offer_at(1, 3, 2, &[e(1, 4)]).unwrap(), None);
        assert_eq!(
            resumed.offer(3, 1, &[e(0, 5)]).unwrap(),
            Verdict::Replayed {
                epoch: 3,
                version: 1
            }
        );
        assert_eq!(
            resumed.offer_at(2, 2, 9, &[e(0, 9)]).unwrap(),
            Some(Verdict::Stale {
                epoch: 2,
                current: 3
            })
        );
        // After the cut, the same verdicts as the twin's.
        for log in [&mut twin, &mut resumed] {
            assert_eq!(
                log.offer_at(3, 3, 3, &[e(0, 8)]).unwrap(),
                Some(Verdict::Followed)
            );
        }
        twin.drain().count();
        assert_eq!(resumed.drain().collect::<Vec<_>>(), vec![(0, 8)]);
        assert_eq!(resumed.ordered(), twin.ordered());
        assert_eq!(resumed.stats().version, twin.stats().version);
        assert!(
            OrderLog::resumed(3, &cut).is_err(),
            "a cut of another task's log"
        );
    }

    fn e(channel: u32, up_to_seq: u64) -> OrderEntry {
        OrderEntry { channel, up_to_seq }
    }

    #[test]
    fn follows_orders_and_tracks_the_furthest_position() {
        let mut log = OrderLog::new(2);
        assert_eq!(
            log.offer(1, 1, &[e(0, 5), e(1, 3)]).unwrap(),
            Verdict::Followed
        );
        assert_eq!(log.offer(1, 2, &[e(0, 4)]).unwrap(), Verdict::Followed);
        assert_eq!(
            log.ordered(),
            &[5, 3],
            "an older bound never moves the position back"
        );
        assert_eq!(
            log.drain().collect::<Vec<_>>(),
            vec![(0, 5), (1, 3), (0, 4)]
        );
        assert_eq!(log.drain().count(), 0);
    }

    #[test]
    fn stale_epochs_are_fenced_off_and_replays_ignored() {
        let mut log = OrderLog::new(1);
        log.offer(3, 7, &[e(0, 10)]).unwrap();
        assert_eq!(
            log.offer(2, 99, &[e(0, 50)]).unwrap(),
            Verdict::Stale {
                epoch: 2,
                current: 3
            }
        );
        assert_eq!(
            log.offer(3, 7, &[e(0, 10)]).unwrap(),
            Verdict::Replayed {
                epoch: 3,
                version: 7
            }
        );
        // A new leader starts its own version count.
        assert_eq!(log.offer(4, 1, &[e(0, 12)]).unwrap(), Verdict::Followed);
        assert_eq!(log.ordered(), &[12]);
        let s = log.stats();
        assert_eq!(
            (s.followed, s.stale, s.replayed, s.epoch),
            (2, 1, 1, Some(4))
        );
    }

    #[test]
    fn an_order_for_a_missing_channel_changes_nothing() {
        let mut log = OrderLog::new(1);
        let err = log.offer(1, 1, &[e(0, 1), e(3, 2)]).unwrap_err();
        assert!(err.to_string().contains("names input channel 3"), "{err}");
        assert_eq!(log.stats(), OrderLogStats::default());
        assert_eq!(log.drain().count(), 0);
    }

    fn decoded(order: &[u8]) -> (u64, u64, Vec<OrderEntry>) {
        match wire::decode_frame(order, wire::DEFAULT_MAX_FRAME_BYTES)
            .unwrap()
            .0
        {
            Frame::Order {
                epoch,
                version,
                entries,
                ..
            } => (epoch, version, entries),
            other => panic!("not an order: {other:?}"),
        }
    }

    /// The leader's fence (its first order: no entries), followed by `log`.
    fn fence(leader: &mut Leader, log: &mut OrderLog, now: Instant) {
        let fence = leader
            .next(&[], log.ordered(), log.stats(), now)
            .expect("a new leader fences first");
        let (epoch, _, entries) = decoded(&fence);
        assert_eq!((epoch, entries), (leader.epoch(), vec![]));
        assert_eq!(log.offer_frame(&fence).unwrap(), Verdict::Followed);
    }

    #[test]
    fn a_new_leader_orders_nothing_until_its_fence_is_followed() {
        let t0 = Instant::now();
        let mut log = OrderLog::new(2);
        log.offer(1, 4, &[e(0, 3)]).unwrap();
        let mut leader = Leader::new(2, 0, 100, log.stats(), Duration::from_secs(5));
        let f = leader
            .next(&[5, 5], log.ordered(), log.stats(), t0)
            .unwrap();
        assert_eq!(decoded(&f), (2, 1, vec![]));
        // Nothing more while the fence is on its way, however much arrives.
        assert_eq!(leader.next(&[9, 9], log.ordered(), log.stats(), t0), None);
        // The dead leader's last order lands before the fence: every replica follows it,
        // and so does the new leader's next order, which starts where it left off.
        log.offer(1, 5, &[e(0, 8), e(1, 2)]).unwrap();
        assert_eq!(log.offer_frame(&f).unwrap(), Verdict::Followed);
        // One more of the old epoch, after the fence: stale for every replica.
        assert_eq!(
            log.offer(1, 6, &[e(1, 9)]).unwrap(),
            Verdict::Stale {
                epoch: 1,
                current: 2
            }
        );
        let first = leader
            .next(&[9, 9], log.ordered(), log.stats(), t0)
            .unwrap();
        assert_eq!(decoded(&first), (2, 2, vec![e(0, 9), e(1, 9)]));
        assert_eq!(log.ordered(), &[8, 2]);
        // A fence never followed is published again, under a new version.
        let mut lost = Leader::new(3, 0, 100, log.stats(), Duration::from_millis(10));
        let f1 = lost.next(&[], log.ordered(), log.stats(), t0).unwrap();
        let later = t0 + Duration::from_millis(10);
        let f2 = lost
            .next(&[9, 9], log.ordered(), log.stats(), later)
            .unwrap();
        assert_eq!(
            (decoded(&f1), decoded(&f2)),
            ((3, 1, vec![]), (3, 2, vec![]))
        );
        // A leader resumed in an epoch the log already follows does not fence again.
        log.offer_frame(&first).unwrap();
        let mut resumed = Leader::new(2, 0, 100, log.stats(), Duration::from_secs(5));
        let again = resumed
            .next(&[10, 9], log.ordered(), log.stats(), t0)
            .unwrap();
        assert_eq!(decoded(&again).2, vec![e(0, 10)]);
    }

    #[test]
    fn a_leadership_resumed_in_the_epoch_the_log_follows_numbers_its_orders_after_it() {
        // The session was in doubt (SUSPENDED) and came back: the same epoch leads again.
        let t0 = Instant::now();
        let mut log = OrderLog::new(2);
        let mut leader = Leader::new(4, 0, 100, log.stats(), Duration::from_secs(5));
        fence(&mut leader, &mut log, t0);
        for up_to in 1..=5 {
            let order = leader
                .next(&[up_to, 0], log.ordered(), log.stats(), t0)
                .unwrap();
            assert_eq!(log.offer_frame(&order).unwrap(), Verdict::Followed);
        }
        assert_eq!((log.stats().epoch, log.stats().version), (Some(4), 6));
        let mut resumed = Leader::new(4, 0, 100, log.stats(), Duration::from_secs(5));
        let order = resumed
            .next(&[5, 3], log.ordered(), log.stats(), t0)
            .unwrap();
        // Not version 1: the log would ignore it as a replay of the first leadership's.
        assert_eq!(decoded(&order), (4, 7, vec![e(1, 3)]));
        assert_eq!(log.offer_frame(&order).unwrap(), Verdict::Followed);
        assert_eq!(log.ordered(), &[5, 3]);
    }

    #[test]
    fn an_order_the_log_ignored_is_ordered_again() {
        // An earlier leadership of the epoch handed out version 3 and resigned before it
        // landed; the resumed one's version 3 lands second and is ignored as a replay.
        let t0 = Instant::now();
        let mut log = OrderLog::new(1);
        let mut first = Leader::new(1, 0, 100, log.stats(), Duration::from_secs(5));
        fence(&mut first, &mut log, t0);
        let early = first.next(&[2], log.ordered(), log.stats(), t0).unwrap();
        assert_eq!(log.offer_frame(&early).unwrap(), Verdict::Followed);
        let stray = first.next(&[4], log.ordered(), log.stats(), t0).unwrap();
        let mut resumed = Leader::new(1, 0, 100, log.stats(), Duration::from_secs(5));
        let mine = resumed.next(&[9], log.ordered(), log.stats(), t0).unwrap();
        assert_eq!((decoded(&stray).1, decoded(&mine).1), (3, 3));
        assert_eq!(log.offer_frame(&stray).unwrap(), Verdict::Followed);
        assert_eq!(
            log.offer_frame(&mine).unwrap(),
            Verdict::Replayed {
                epoch: 1,
                version: 3
            }
        );
        // Its version is followed, its positions are not: the leader orders them again
        // at once, rather than waiting for input that may never come.
        let again = resumed.next(&[9], log.ordered(), log.stats(), t0).unwrap();
        assert_eq!(decoded(&again), (1, 4, vec![e(0, 9)]));
        assert_eq!(log.offer_frame(&again).unwrap(), Verdict::Followed);
        assert_eq!(log.ordered(), &[9]);
        assert_eq!(resumed.next(&[9], log.ordered(), log.stats(), t0), None);
    }

    #[test]
    fn a_leader_keeps_one_order_in_flight_until_its_replica_follows_it() {
        let t0 = Instant::now();
        let resend = Duration::from_secs(5);
        let mut log = OrderLog::new(2);
        let mut leader = Leader::new(7, 3, 100, log.stats(), resend);
        fence(&mut leader, &mut log, t0);
        assert_eq!(leader.next(&[0, 0], log.ordered(), log.stats(), t0), None);
        let first = leader
            .next(&[4, 2], log.ordered(), log.stats(), t0)
            .unwrap();
        assert_eq!(decoded(&first), (7, 2, vec![e(0, 4), e(1, 2)]));
        // More arrives while the first is in flight: it waits for the next order.
        assert_eq!(leader.next(&[9, 5], log.ordered(), log.stats(), t0), None);
        log.offer_frame(&first).unwrap();
        let second = leader
            .next(&[9, 5], log.ordered(), log.stats(), t0)
            .unwrap();
        // The cursor moved on: channel 1 comes first this time.
        assert_eq!(decoded(&second), (7, 3, vec![e(1, 5), e(0, 9)]));
        log.offer_frame(&second).unwrap();
        assert_eq!(leader.next(&[9, 5], log.ordered(), log.stats(), t0), None);
        assert_eq!(leader.counts(), (3, 0));
    }

    #[test]
    fn a_new_leader_continues_from_the_log_and_skips_what_it_covers() {
        let mut log = OrderLog::new(2);
        log.offer(1, 5, &[e(0, 10), e(1, 3)]).unwrap();
        let now = Instant::now();
        let mut leader = Leader::new(2, 0, 100, log.stats(), Duration::from_secs(5));
        fence(&mut leader, &mut log, now);
        assert_eq!(leader.next(&[10, 3], log.ordered(), log.stats(), now), None);
        let order = leader
            .next(&[10, 6], log.ordered(), log.stats(), now)
            .unwrap();
        assert_eq!(decoded(&order), (2, 2, vec![e(1, 6)]));
    }

    #[test]
    fn a_split_batch_goes_out_at_once_and_the_last_part_is_awaited() {
        let now = Instant::now();
        let mut log = OrderLog::new(3);
        let mut leader = Leader::new(1, 0, 2, log.stats(), Duration::from_secs(5));
        fence(&mut leader, &mut log, now);
        let a = leader
            .next(&[1, 2, 3], log.ordered(), log.stats(), now)
            .unwrap();
        let b = leader
            .next(&[1, 2, 3], log.ordered(), log.stats(), now)
            .unwrap();
        assert_eq!(decoded(&a), (1, 2, vec![e(0, 1), e(1, 2)]));
        assert_eq!(decoded(&b), (1, 3, vec![e(2, 3)]));
        log.offer_frame(&a).unwrap();
        assert_eq!(
            leader.next(&[5, 5, 5], log.ordered(), log.stats(), now),
            None
        );
        log.offer_frame(&b).unwrap();
        assert!(leader
            .next(&[5, 5, 5], log.ordered(), log.stats(), now)
            .is_some());
    }

    #[test]
    fn an_order_never_followed_is_published_again_from_the_log() {
        let t0 = Instant::now();
        let resend = Duration::from_millis(100);
        let mut log = OrderLog::new(1);
        let mut leader = Leader::new(1, 0, 10, log.stats(), resend);
        fence(&mut leader, &mut log, t0);
        let lost = leader.next(&[4], log.ordered(), log.stats(), t0).unwrap();
        assert_eq!(decoded(&lost).2, vec![e(0, 4)]);
        let later = t0 + Duration::from_millis(99);
        assert_eq!(leader.next(&[6], log.ordered(), log.stats(), later), None);
        let overdue = t0 + resend;
        let again = leader
            .next(&[6], log.ordered(), log.stats(), overdue)
            .unwrap();
        // Everything the log does not cover, under a new version.
        assert_eq!(decoded(&again), (1, 3, vec![e(0, 6)]));
        assert_eq!(leader.counts(), (3, 1));
        // A delivery failure reported by the client does the same at once.
        leader.lost();
        let third = leader
            .next(&[6], log.ordered(), log.stats(), overdue)
            .unwrap();
        assert_eq!(decoded(&third), (1, 4, vec![e(0, 6)]));
        // Followed late, the replays are harmless: positions only grow.
        for o in [&lost, &again, &third] {
            log.offer_frame(o).unwrap();
        }
        assert_eq!(log.ordered(), &[6]);
    }

    #[test]
    fn a_message_splits_into_its_order_frames() {
        let a = wire::encode_order(3, 1, 1, &[e(0, 4)]);
        let b = wire::encode_order(5, 2, 7, &[e(1, 2), e(0, 9)]);
        let message = [a.clone(), b.clone()].concat();
        let parts = split_message(&message).unwrap();
        assert_eq!(parts.len(), 2);
        assert_eq!((parts[0].slot, parts[0].epoch, parts[0].version), (3, 1, 1));
        assert_eq!(parts[1].entries, vec![e(1, 2), e(0, 9)]);
        assert_eq!(&message[parts[1].bytes.clone()], &b[..]);
        assert!(split_message(&[]).is_err());
        assert!(split_message(&message[..message.len() - 1]).is_err());
        let with_heartbeat = [a, wire::encode_heartbeat(0, 0, 1)].concat();
        assert!(split_message(&with_heartbeat).is_err());
    }

    #[test]
    fn frames_must_be_single_order_frames() {
        let mut log = OrderLog::new(2);
        let order = wire::encode_order(0, 1, 1, &[e(1, 4)]);
        assert_eq!(log.offer_frame(&order).unwrap(), Verdict::Followed);
        let mut two = order.clone();
        two.extend_from_slice(&order);
        assert!(log.offer_frame(&two).is_err());
        assert!(log.offer_frame(&wire::encode_heartbeat(0, 0, 1)).is_err());
        assert!(log.offer_frame(&order[..order.len() - 1]).is_err());
        assert_eq!(log.ordered(), &[0, 4]);
    }
}
