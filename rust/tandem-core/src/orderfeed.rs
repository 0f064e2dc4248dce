//! KaZoo's side of a replica's inbox: the orderer feeds the order log to a positional
//! inbox and sees what has arrived there ([`OrderFeed`]); a leader decides the next orders
//! from that ([`crate::orderlog::Leader`]), and one [`OrderPublisher`] per worker publishes
//! the orders of every partition the worker leads, one message in flight. The log itself,
//! as a replica follows it (fencing, replays), is [`crate::orderlog`].

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

#[cfg(doc)]
use crate::inbox::InboxConfig;
use crate::inbox::{Arrivals, Inbox, OrderParts};
use crate::orderlog::{Leader, OrderLog, OrderLogStats, Verdict};
use crate::sync::Doorbell;
use crate::wire;
use crate::{Error, Result};

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
    arrivals: Arrivals,
    /// The consumer's bell (shared by the worker's inboxes).
    bell: Arc<Doorbell>,
    /// Rung by this inbox's arrivals and followed orders only.
    order_bell: Arc<Doorbell>,
}

impl Inbox {
    /// The handle through which the KaZoo orderer feeds the order log to this inbox and
    /// sees what has arrived; None unless the ordering is positional.
    pub fn order_feed(&self) -> Option<OrderFeed> {
        self.order_parts().map(|p: OrderParts| OrderFeed {
            log: p.log,
            arrivals: p.arrivals,
            bell: p.bell,
            order_bell: p.order_bell,
        })
    }
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

    /// Hold this replica's orders, should it lead, right after heartbeat `epoch` on every
    /// channel until every channel is ordered through it, as [`Inbox::align_at`] does,
    /// without asking the replica itself for a cut: a twin following the log is cut there
    /// while the leader orders on (the holds end by themselves, see
    /// [`crate::inbox::Arrivals::orderable`]).
    pub fn hold_at(&self, epoch: u64) {
        self.arrivals.hold_at(epoch);
    }

    /// The leader of `epoch` (see [`Leader`]), continuing from what the log covers now:
    /// call once the log has been read to its end.
    pub fn lead(&self, epoch: u64, partition: u32, batch: usize, resend_after: Duration) -> Leader {
        Leader::new(epoch, partition, batch, self.stats(), resend_after)
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
        leader.next(&self.arrivals.orderable(&ordered), &ordered, stats, now)
    }

    /// Per channel, the first sequence number not yet accepted: everything before it has
    /// arrived here (deduplicated) and may be ordered.
    pub fn arrived(&self) -> Vec<u64> {
        self.arrivals.arrived()
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
    /// Per key, the epoch and last version of its leadership that resigned: a leadership
    /// of the same epoch resumed later numbers its orders after it (see
    /// [`Leader::continue_after`]).
    resigned: HashMap<u64, (u64, u64)>,
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
            resigned: HashMap::new(),
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
    /// partition); replaces a leadership under the same key. A leadership of an epoch
    /// this publisher led under `key` before continues its versions.
    pub fn lead(&mut self, key: u64, feed: OrderFeed, mut leader: Leader) -> Result<()> {
        if !Arc::ptr_eq(&feed.order_bell, &self.bell) {
            return Err(Error::Config(
                "the inbox of a partition an OrderPublisher leads must ring its bell: create                  the inbox with the publisher's worker"
                    .to_owned(),
            ));
        }
        self.resign(key);
        if let Some((epoch, version)) = self.resigned.remove(&key) {
            if epoch == leader.epoch() {
                leader.continue_after(version);
            }
        }
        self.leaders.push((key, feed, leader));
        self.bell.ring(); // orders may be due at once
        Ok(())
    }

    /// Stop publishing under `key`; returns its leader's `counts()` if it led.
    pub fn resign(&mut self, key: u64) -> Option<(u64, u64)> {
        let i = self.leaders.iter().position(|(k, _, _)| *k == key)?;
        let (_, _, leader) = self.leaders.swap_remove(i);
        self.resigned
            .insert(key, (leader.epoch(), leader.version()));
        Some(leader.counts())
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    use crate::inbox::InboxConfig;
    use crate::item::Delivery;
    use crate::merge::OrderingMode;
    use crate::test_support::*;

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

    /// A positional inbox over `channels` upstream partitions of `TASK`, its feed, and a
    /// publisher whose bell it rings.
    fn one_partition(channels: u32) -> (Inbox, OrderFeed, OrderPublisher) {
        let bell = Arc::new(Doorbell::new());
        let upstream = (0..channels).map(|p| (TASK, p)).collect();
        let mut cfg = InboxConfig::new(JOB, SECRET, upstream);
        cfg.ordering = OrderingMode::Positional;
        cfg.order_bell = Some(Arc::clone(&bell));
        let ib = Inbox::bind(cfg).unwrap();
        let feed = ib.order_feed().unwrap();
        (ib, feed, OrderPublisher::new(bell))
    }

    #[test]
    fn a_paced_publisher_leaves_its_pace_between_two_messages() {
        let (ib, feed, mut publisher) = one_partition(2);
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
    fn a_leadership_resumed_under_a_key_numbers_its_orders_after_the_resigned_one() {
        let version = |order: &[u8]| match wire::decode_frame(order, 1 << 20).unwrap().0 {
            wire::Frame::Order { epoch, version, .. } => (epoch, version),
            other => panic!("not an order: {other:?}"),
        };
        let (ib, feed, mut publisher) = one_partition(1);
        let resend = Duration::from_secs(5);
        publisher
            .lead(0, feed.clone(), feed.lead(3, 0, 10, resend))
            .unwrap();
        let fence = publisher.next(Duration::from_secs(5));
        assert_eq!(version(&fence[0].1), (3, 1));
        feed.offer_frame(&fence[0].1).unwrap();
        publisher.followed();
        let plan = Plan {
            total: 40,
            emit_rows: 5,
            hb_every: 1000,
            batch_rows: 5,
            crash_after: None,
        };
        let up = upstream(ib.local_addr(), 0, 0, plan);
        let stray = publisher.next(Duration::from_secs(5));
        assert_eq!(version(&stray[0].1), (3, 2), "an order, handed out");
        // The session comes in doubt before it lands: the leadership resigns, and resumes
        // in the same epoch once the session is back.
        assert_eq!(publisher.resign(0), Some((2, 0)));
        publisher
            .lead(0, feed.clone(), feed.lead(3, 0, 10, resend))
            .unwrap();
        let mine = publisher.next(Duration::from_secs(5));
        assert_eq!(
            version(&mine[0].1),
            (3, 3),
            "after the resigned leadership's"
        );
        // Both land: neither is a replay of the other.
        assert_eq!(feed.offer_frame(&stray[0].1).unwrap(), Verdict::Followed);
        assert_eq!(feed.offer_frame(&mine[0].1).unwrap(), Verdict::Followed);
        // Another epoch starts from the log alone.
        publisher.resign(0);
        publisher
            .lead(0, feed.clone(), feed.lead(4, 0, 10, resend))
            .unwrap();
        let fence = publisher.next(Duration::from_secs(5));
        assert_eq!(version(&fence[0].1), (4, 1));
        up.join().unwrap();
    }

    #[test]
    fn a_leader_asked_for_an_aligned_cut_orders_no_channel_past_its_heartbeat_until_all_are() {
        let plan = Plan {
            total: 2000,
            emit_rows: 50,
            hb_every: 200,
            batch_rows: 50,
            crash_after: None,
        };
        let mut x = inbox(2, OrderingMode::Positional, 64);
        let fx = x.order_feed().unwrap();
        x.align_at(3);
        // Heartbeat 3 of either channel: seq 602 (600 rows and heartbeats 1 and 2 first).
        let after_hb3 = 603;
        let stop = Arc::new(AtomicBool::new(false));
        let leader = {
            let (fx, stop) = (fx.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut leader = fx.lead(1, 0, 1000, Duration::from_secs(5));
                while !stop.load(Ordering::SeqCst) {
                    if let Some(order) = fx.next_order(&mut leader, Duration::from_millis(20)) {
                        fx.offer_frame(&order).unwrap();
                    }
                }
            })
        };
        // Channel 0 arrives whole while channel 1 has not started: unheld, the leader
        // would order all of it at once.
        let mut threads = vec![upstream(x.local_addr(), 0, 0, plan)];
        let deadline = Instant::now() + Duration::from_secs(20);
        while fx.arrived()[0] < 2011 {
            assert!(Instant::now() < deadline, "channel 0 did not arrive");
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(
            fx.ordered(),
            vec![after_hb3, 0],
            "held right after heartbeat 3"
        );
        threads.push(upstream(x.local_addr(), 1, 0, plan));
        let mut got = Vec::new();
        let mut cut = None;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            assert!(Instant::now() < deadline, "no End; got {}", got.len());
            match x.next(Duration::from_millis(200)).unwrap() {
                None => {}
                Some(Delivery::End) => break,
                Some(d) => {
                    flatten(d, &mut got);
                    let hb3 = got.iter().filter(|e| matches!(e, Ev::Hb(_, 3, _))).count();
                    if hb3 == 2 && cut.is_none() {
                        cut = Some(x.cut());
                    }
                }
            }
        }
        stop.store(true, Ordering::SeqCst);
        leader.join().unwrap();
        for t in threads {
            t.join().unwrap();
        }
        let cut = cut
            .expect("both heartbeats 3 delivered")
            .expect("an aligned cut");
        assert_eq!(cut.positions, vec![after_hb3, after_hb3]);
        let second_hb3 = got
            .iter()
            .rposition(|e| matches!(e, Ev::Hb(_, 3, _)))
            .unwrap();
        assert!(
            !got[..second_hb3].iter().any(|e| match e {
                Ev::Row(c, v) => *v - base(*c as u32) >= 600,
                Ev::Hb(_, epoch, _) => *epoch > 3,
                Ev::End => false,
            }),
            "nothing past heartbeat 3 before both channels delivered it"
        );
        // Once both were ordered through heartbeat 3 the leader went on by itself.
        for c in 0..2 {
            let want: Vec<i64> = (0..plan.total).map(|i| base(c as u32) + i).collect();
            assert_eq!(rows_of(&got, c), want, "channel {c}: complete and in order");
        }
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
}
