//! Consumption orders over deduplicated logical channels (DESIGN §2, invariant 3).
//!
//! A [`Merge`] decides which input channel a replica consumes next. Replicas of one task
//! partition must consume in the same order, so the order may depend only on the
//! *contents* of the channels (identical at every replica), never on arrival timing:
//!
//! * [`crate::liverobin::LiveRobin`] — Algorithm 1 of the paper, leaderless, one whole
//!   batch (or heartbeat, or end marker) per turn;
//! * [`Positional`] — follows an order decided elsewhere ("consume channel `c` up to seq
//!   `s`"), the follower side of KaZoo;
//! * [`Fcfs`] — the `none` baseline: whatever arrived first. Not deterministic across
//!   replicas, which is exactly what the baseline is there to show.
//!
//! The batch is the unit of determinism (invariant 1): replicas of an upstream partition
//! emit the same batches with the same sequence ranges, so every downstream replica's
//! dedup queues hold the same batches, and a merge that decides at batch boundaries hands
//! every replica's operator the same batches. LiveRobin and Fcfs never slice a batch.
//!
//! A merge pops only the channel it needs and keeps at most one split remainder per
//! channel (only [`Positional`] ever splits), so input memory stays bounded by the dedup
//! queues (invariant 5).
//!
//! The [`Merge`] trait, the [`Inputs`] it reads and the [`MergeCut`] it resumes from live in
//! [`crate::consume`], with the bookkeeping every order shares, and are re-exported here.

use std::collections::VecDeque;

use crate::consume::{take, Ended, HeartbeatGate};
pub use crate::consume::{Inputs, Merge, MergeCut};
use crate::error::{Error, Result};
use crate::item::{Chunk, Delivery, Item};
use crate::liverobin::LiveRobin;

/// The ordering knob (`ordering` in DESIGN §5; `kazoo` replicas use [`Positional`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OrderingMode {
    /// First come, first served ([`Fcfs`]).
    None,
    /// [`LiveRobin`]: one whole element (a data batch, a heartbeat or the end marker) per
    /// turn, the paper's per-event algorithm with "event" = batch.
    LiveRobin,
    /// Follow orders pushed with [`Positional::push_order`].
    Positional,
}

/// Build the merge for `mode` over `channels` inputs. A [`Positional`] built here has no
/// way to receive orders through the trait object; construct it with [`Positional::new`]
/// where orders must be pushed.
pub fn build<P: Chunk + Send + 'static>(mode: &OrderingMode, channels: usize) -> Box<dyn Merge<P>> {
    match mode {
        OrderingMode::None => Box::new(Fcfs::new(channels)),
        OrderingMode::LiveRobin => Box::new(LiveRobin::new(channels)),
        OrderingMode::Positional => Box::new(Positional::new(channels)),
    }
}

/// `none`: deliver whatever is available, rotating fairly over the channels that have
/// something ready. Heartbeats are forwarded the first time their epoch is seen.
///
/// Aligned at an epoch ([`Merge::align_at`]), a channel that has delivered that heartbeat
/// waits until it is released: the replica is then cut with every channel exactly through
/// it, as a checkpoint's barrier alignment does, rather than with a faster channel's next
/// rows taken already (which a sink resumed from the cut would never see again).
#[derive(Debug, Clone)]
pub struct Fcfs {
    cursor: usize,
    gate: HeartbeatGate,
    ended: Ended,
    /// The highest heartbeat epoch each channel has delivered.
    passed: Vec<u64>,
    /// An aligned cut asked for at this epoch, not yet taken.
    barrier: Option<u64>,
}

impl Fcfs {
    pub fn new(channels: usize) -> Self {
        Self {
            cursor: 0,
            gate: HeartbeatGate::default(),
            ended: Ended::new(channels),
            passed: vec![0; channels],
            barrier: None,
        }
    }

    /// Whether channel `c` waits at the barrier: it has delivered the barrier's heartbeat,
    /// and no channel ended before delivering it (the replica's watermark then never
    /// reaches it, the cut is never taken, and holding would stop the replica for good).
    fn held(&self, c: usize) -> bool {
        self.barrier.is_some_and(|k| {
            self.passed[c] >= k
                && !(0..self.passed.len()).any(|i| self.ended.is_ended(i) && self.passed[i] < k)
        })
    }
}

impl<P: Chunk> Merge<P> for Fcfs {
    fn next(&mut self, inputs: &mut dyn Inputs<P>) -> Option<Delivery<P>> {
        let n = self.ended.channels();
        let mut tried = 0;
        while tried < n {
            if self.ended.all() {
                return Some(Delivery::End);
            }
            let c = self.cursor;
            self.cursor = (self.cursor + 1) % n;
            tried += 1;
            if self.ended.is_ended(c) || self.held(c) {
                continue;
            }
            match inputs.pop(c) {
                None => {}
                Some(Item::Data { first_seq, payload }) => {
                    if payload.rows() > 0 {
                        return Some(Delivery::Data {
                            channel: c,
                            first_seq,
                            payload,
                        });
                    }
                    // An empty chunk carries nothing; look again (it was consumed, so
                    // this terminates).
                    tried = 0;
                }
                Some(Item::Heartbeat { epoch, .. }) => {
                    self.passed[c] = self.passed[c].max(epoch);
                    let first = self.gate.see(epoch);
                    return Some(Delivery::Heartbeat {
                        channel: c,
                        epoch,
                        first,
                    });
                }
                Some(Item::End { .. }) => {
                    self.ended.mark(c);
                    // Something happened: give every channel another chance this call.
                    tried = 0;
                }
            }
        }
        self.ended.all().then_some(Delivery::End)
    }

    fn waiting_on(&self) -> Option<usize> {
        None
    }

    fn align_at(&mut self, epoch: u64) {
        self.barrier = Some(epoch);
    }

    fn release(&mut self) {
        self.barrier = None;
    }

    /// First come, first served: the joined channels are served at once (their content
    /// starts after `after_epoch`, which they count as delivered), and the merge ends once
    /// they have ended too.
    fn join(&mut self, count: usize, after_epoch: u64) -> Result<()> {
        if self.ended.all() {
            return Err(Error::Config(
                "channels cannot join a merge whose channels all ended".to_owned(),
            ));
        }
        self.ended.grow(count);
        self.passed.resize(self.passed.len() + count, after_epoch);
        Ok(())
    }

    /// Only while the joined channels have delivered nothing (no heartbeat, no end; data
    /// is not seen here, so the caller checks that nothing arrived on them).
    fn cancel_join(&mut self, count: usize) -> Result<()> {
        let n = self.passed.len();
        if count > n {
            return Err(Error::Config(format!(
                "{count} channels to take back from a merge of {n}"
            )));
        }
        let first = n - count;
        if first == 0 {
            return Err(Error::Config(
                "cannot take back every channel of a merge".to_owned(),
            ));
        }
        self.ended.truncate(first);
        self.passed.truncate(first);
        self.cursor %= first;
        Ok(())
    }

    fn cut(&self) -> Option<MergeCut> {
        Some(MergeCut {
            turn: self.cursor,
            gen: self.gate.gen(),
            ended: self.ended.flags(),
            orders: Vec::new(),
        })
    }

    fn resume(&mut self, cut: &MergeCut, _positions: &[u64]) -> Result<()> {
        cut.check(self.ended.channels())?;
        self.cursor = cut.turn;
        self.gate = HeartbeatGate::resumed(cut.gen);
        self.ended = Ended::resumed(&cut.ended);
        // Unknown per channel: none is held at a barrier before it delivers one more
        // heartbeat (safe; taking a channel for passed when it is not would hold it
        // forever).
        self.passed = vec![0; self.passed.len()];
        Ok(())
    }
}

/// The follower side of KaZoo: consume the channels in the order given by
/// [`Positional::push_order`] entries, each "consume channel `c` until its next sequence
/// number is `up_to_seq`". Orders are idempotent: one whose bound is at or before the
/// channel's position is a no-op, so a replayed order log is harmless.
///
/// The leader orders what its own dedup queues hold, whole frames, so every bound falls on
/// a batch boundary (DESIGN §2.3) and the follower hands its operator the same batches as
/// the leader. A chunk straddling a bound can only come from an order log that does not
/// match the channel's batches; it is sliced defensively, its remainder waiting for the
/// next order on that channel, so no row is lost or delivered twice.
#[derive(Debug)]
pub struct Positional<P> {
    orders: VecDeque<(usize, u64)>,
    /// Per channel: first sequence number not yet delivered.
    position: Vec<u64>,
    remainder: Vec<Option<Item<P>>>,
    gate: HeartbeatGate,
    ended: Ended,
    waiting: Option<usize>,
    /// Per channel, the epoch of the last heartbeat delivered and the position right
    /// after it: whether the channel stands right after a given heartbeat.
    heartbeat: Vec<(u64, u64)>,
    /// An aligned cut asked for at this epoch ([`Merge::align_at`]).
    barrier: Option<u64>,
}

impl<P: Chunk> Positional<P> {
    pub fn new(channels: usize) -> Self {
        Self {
            orders: VecDeque::new(),
            position: vec![0; channels],
            remainder: (0..channels).map(|_| None).collect(),
            gate: HeartbeatGate::default(),
            ended: Ended::new(channels),
            waiting: None,
            heartbeat: vec![(0, 0); channels],
            barrier: None,
        }
    }

    /// Whether every channel stands right after its heartbeat `epoch` (or ended before
    /// it): an aligned cut there.
    fn aligned_at(&self, epoch: u64) -> bool {
        (0..self.position.len()).all(|c| {
            let (last, after) = self.heartbeat[c];
            if self.ended.is_ended(c) {
                last < epoch
            } else {
                last == epoch && self.position[c] == after
            }
        })
    }

    /// Append the order "consume `channel` until its next sequence number is `up_to_seq`".
    /// Fails (and changes nothing) if `channel` does not exist.
    pub fn push_order(&mut self, channel: usize, up_to_seq: u64) -> Result<()> {
        if channel >= self.position.len() {
            return Err(Error::Config(format!(
                "order names input channel {channel}, but this merge has {} channels \
                 (0..{}); the order log and the task's inputs disagree",
                self.position.len(),
                self.position.len()
            )));
        }
        self.orders.push_back((channel, up_to_seq));
        Ok(())
    }

    /// Orders pushed but not yet fully consumed.
    pub fn pending_orders(&self) -> usize {
        self.orders.len()
    }

    /// First sequence number of `channel` not yet delivered (None if out of range).
    pub fn position(&self, channel: usize) -> Option<u64> {
        self.position.get(channel).copied()
    }
}

impl<P: Chunk + Send> Merge<P> for Positional<P> {
    fn next(&mut self, inputs: &mut dyn Inputs<P>) -> Option<Delivery<P>> {
        loop {
            if self.ended.all() {
                self.waiting = None;
                return Some(Delivery::End);
            }
            let Some(&(c, bound)) = self.orders.front() else {
                // Waiting for an order, not for a channel.
                self.waiting = None;
                return None;
            };
            if self.position[c] >= bound || self.ended.is_ended(c) {
                self.orders.pop_front();
                continue;
            }
            let Some(item) = take(&mut self.remainder, inputs, c) else {
                self.waiting = Some(c);
                return None;
            };
            self.waiting = None;
            match item {
                Item::Data { first_seq, payload } => {
                    let rows = payload.rows() as u64;
                    let end = first_seq.saturating_add(rows);
                    if rows == 0 {
                        continue;
                    }
                    if end > bound && first_seq < bound {
                        let head = (bound - first_seq) as usize;
                        let tail = payload.rows() - head;
                        self.remainder[c] = Some(Item::Data {
                            first_seq: bound,
                            payload: payload.slice(head, tail),
                        });
                        self.position[c] = bound;
                        let payload = payload.slice(0, head);
                        return Some(Delivery::Data {
                            channel: c,
                            first_seq,
                            payload,
                        });
                    }
                    self.position[c] = end;
                    return Some(Delivery::Data {
                        channel: c,
                        first_seq,
                        payload,
                    });
                }
                Item::Heartbeat { seq, epoch } => {
                    self.position[c] = seq.saturating_add(1);
                    self.heartbeat[c] = (epoch, self.position[c]);
                    let first = self.gate.see(epoch);
                    return Some(Delivery::Heartbeat {
                        channel: c,
                        epoch,
                        first,
                    });
                }
                Item::End { seq } => {
                    self.position[c] = seq.saturating_add(1);
                    self.ended.mark(c);
                }
            }
        }
    }

    fn waiting_on(&self) -> Option<usize> {
        self.waiting
    }

    fn push_order(&mut self, channel: usize, up_to_seq: u64) -> Result<()> {
        Positional::push_order(self, channel, up_to_seq)
    }

    /// The orders are the leader's: aligned, its replica's leader holds every channel at
    /// the heartbeat ([`crate::inbox::Inbox::align_at`]); here the cut is only checked
    /// ([`Merge::cut`]), never made by holding input, which would part this replica's
    /// order from its twins'.
    fn align_at(&mut self, epoch: u64) {
        self.barrier = Some(epoch);
    }

    fn release(&mut self) {
        self.barrier = None;
    }

    /// Anywhere no batch is held in part (an order's bound fell inside it): the positions,
    /// the heartbeat gate and the orders followed but not yet consumed are then all there
    /// is. Orders are positional, so a replica resumed here and fed the same orders from
    /// the log consumes exactly what its twin consumes after the cut. Aligned at a
    /// heartbeat ([`Merge::align_at`]), only where every channel stands right after it —
    /// not where the log ordered some channel past it first (its leader was not this
    /// replica, or it led only from a later point): a savepoint's cut must not hold input
    /// its producers' cuts at that heartbeat have not emitted yet.
    fn cut(&self) -> Option<MergeCut> {
        if self.remainder.iter().any(Option::is_some) {
            return None;
        }
        if self.barrier.is_some_and(|k| !self.aligned_at(k)) {
            return None;
        }
        Some(MergeCut {
            turn: 0,
            gen: self.gate.gen(),
            ended: self.ended.flags(),
            orders: self
                .orders
                .iter()
                .copied()
                .filter(|&(c, bound)| self.position[c] < bound && !self.ended.is_ended(c))
                .collect(),
        })
    }

    fn resume(&mut self, cut: &MergeCut, positions: &[u64]) -> Result<()> {
        cut.check(self.position.len())?;
        if positions.len() != self.position.len() {
            return Err(Error::Config(format!(
                "a cut of {} channel positions cannot resume a merge over {}",
                positions.len(),
                self.position.len()
            )));
        }
        self.position = positions.to_vec();
        self.gate = HeartbeatGate::resumed(cut.gen);
        self.ended = Ended::resumed(&cut.ended);
        self.orders = cut.orders.iter().copied().collect();
        self.heartbeat = vec![(0, 0); positions.len()];
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::item::Rows;

    fn data(first_seq: u64, len: usize) -> Item<Rows> {
        Item::rows(first_seq, len)
    }

    fn inputs(channels: Vec<Vec<Item<Rows>>>) -> Vec<VecDeque<Item<Rows>>> {
        channels.into_iter().map(VecDeque::from).collect()
    }

    #[test]
    fn fcfs_rotates_over_ready_channels_and_ends() {
        let mut inp = inputs(vec![
            vec![data(0, 1), data(1, 1), Item::End { seq: 2 }],
            vec![Item::Heartbeat { seq: 0, epoch: 1 }, Item::End { seq: 1 }],
        ]);
        let mut m = Fcfs::new(2);
        let mut out = Vec::new();
        while let Some(d) = Merge::<Rows>::next(&mut m, &mut inp) {
            let end = d == Delivery::End;
            out.push(d);
            if end {
                break;
            }
        }
        assert_eq!(
            out,
            vec![
                Delivery::Data {
                    channel: 0,
                    first_seq: 0,
                    payload: Rows { start: 0, len: 1 }
                },
                Delivery::Heartbeat {
                    channel: 1,
                    epoch: 1,
                    first: true
                },
                Delivery::Data {
                    channel: 0,
                    first_seq: 1,
                    payload: Rows { start: 1, len: 1 }
                },
                Delivery::End,
            ]
        );
        assert_eq!(Merge::<Rows>::next(&mut m, &mut inp), Some(Delivery::End));
    }

    #[test]
    fn fcfs_aligned_at_an_epoch_holds_a_channel_past_it_until_released() {
        // Channel 0 is fast: its heartbeat 1 and the rows after it are in before channel
        // 1's heartbeat 1.
        let mut inp = inputs(vec![
            vec![data(0, 1), Item::Heartbeat { seq: 1, epoch: 1 }, data(2, 1)],
            vec![data(0, 1)],
        ]);
        let mut m = Fcfs::new(2);
        Merge::<Rows>::align_at(&mut m, 1);
        let mut got = Vec::new();
        while let Some(d) = Merge::<Rows>::next(&mut m, &mut inp) {
            got.push(d);
        }
        // Everything through channel 0's heartbeat 1, and channel 1's row: not row 2.
        assert_eq!(got.len(), 3);
        assert!(!got.contains(&Delivery::Data {
            channel: 0,
            first_seq: 2,
            payload: Rows { start: 2, len: 1 }
        }));
        // Channel 1 delivers heartbeat 1: the cut is exactly through epoch 1 on both.
        inp[1].push_back(Item::Heartbeat { seq: 1, epoch: 1 });
        assert_eq!(
            Merge::<Rows>::next(&mut m, &mut inp),
            Some(Delivery::Heartbeat {
                channel: 1,
                epoch: 1,
                first: false
            })
        );
        assert_eq!(Merge::<Rows>::next(&mut m, &mut inp), None);
        Merge::<Rows>::release(&mut m);
        assert_eq!(
            Merge::<Rows>::next(&mut m, &mut inp),
            Some(Delivery::Data {
                channel: 0,
                first_seq: 2,
                payload: Rows { start: 2, len: 1 }
            })
        );
    }

    #[test]
    fn fcfs_holds_nothing_at_a_barrier_a_channel_ended_before() {
        // Channel 1 ends before heartbeat 2: the cut at 2 never comes, channel 0 goes on.
        let mut inp = inputs(vec![
            vec![
                Item::Heartbeat { seq: 0, epoch: 2 },
                data(1, 1),
                Item::End { seq: 2 },
            ],
            vec![Item::Heartbeat { seq: 0, epoch: 1 }, Item::End { seq: 1 }],
        ]);
        let mut m = Fcfs::new(2);
        Merge::<Rows>::align_at(&mut m, 2);
        let out = Merge::<Rows>::drain(&mut m, &mut inp);
        assert_eq!(out.last(), Some(&Delivery::End));
        assert!(out.contains(&Delivery::Data {
            channel: 0,
            first_seq: 1,
            payload: Rows { start: 1, len: 1 }
        }));
    }

    #[test]
    fn fcfs_waits_when_nothing_is_ready() {
        let mut inp = inputs(vec![vec![], vec![]]);
        let mut m = Fcfs::new(2);
        assert_eq!(Merge::<Rows>::next(&mut m, &mut inp), None);
        assert_eq!(Merge::<Rows>::waiting_on(&m), None);
    }

    #[test]
    fn positional_follows_orders_slices_and_is_idempotent() {
        let mut inp = inputs(vec![
            vec![data(0, 10), Item::Heartbeat { seq: 10, epoch: 1 }],
            vec![data(0, 4), Item::Heartbeat { seq: 4, epoch: 1 }],
        ]);
        let mut m = Positional::new(2);
        m.push_order(0, 6).unwrap();
        m.push_order(1, 5).unwrap();
        m.push_order(0, 3).unwrap(); // stale: already past seq 3
        m.push_order(0, 11).unwrap();
        let mut out = Vec::new();
        while let Some(d) = m.next(&mut inp) {
            out.push(d);
        }
        assert_eq!(
            out,
            vec![
                Delivery::Data {
                    channel: 0,
                    first_seq: 0,
                    payload: Rows { start: 0, len: 6 }
                },
                Delivery::Data {
                    channel: 1,
                    first_seq: 0,
                    payload: Rows { start: 0, len: 4 }
                },
                Delivery::Heartbeat {
                    channel: 1,
                    epoch: 1,
                    first: true
                },
                Delivery::Data {
                    channel: 0,
                    first_seq: 6,
                    payload: Rows { start: 6, len: 4 }
                },
                Delivery::Heartbeat {
                    channel: 0,
                    epoch: 1,
                    first: false
                },
            ]
        );
        assert_eq!(m.pending_orders(), 0);
        assert_eq!(m.position(0), Some(11));
        // Replaying the whole log changes nothing.
        for (c, s) in [(0, 6), (1, 5), (0, 11)] {
            m.push_order(c, s).unwrap();
        }
        assert_eq!(m.next(&mut inp), None);
    }

    #[test]
    fn positional_waits_on_the_ordered_channel() {
        let mut inp = inputs(vec![vec![], vec![data(0, 3)]]);
        let mut m = Positional::new(2);
        m.push_order(0, 2).unwrap();
        m.push_order(1, 3).unwrap();
        assert_eq!(m.next(&mut inp), None);
        assert_eq!(m.waiting_on(), Some(0), "must not skip ahead to channel 1");
        inp[0].push_back(data(0, 1));
        assert!(matches!(
            m.next(&mut inp),
            Some(Delivery::Data { channel: 0, .. })
        ));
        assert_eq!(m.next(&mut inp), None);
        assert_eq!(m.waiting_on(), Some(0));
        inp[0].push_back(data(1, 5));
        assert_eq!(
            m.next(&mut inp),
            Some(Delivery::Data {
                channel: 0,
                first_seq: 1,
                payload: Rows { start: 1, len: 1 }
            })
        );
        assert!(matches!(
            m.next(&mut inp),
            Some(Delivery::Data { channel: 1, .. })
        ));
    }

    #[test]
    fn a_positional_cut_aligned_at_a_heartbeat_is_taken_only_where_every_channel_stands_after_it() {
        let hb = |seq, epoch| Item::Heartbeat { seq, epoch };
        let streams = || {
            inputs(vec![
                vec![data(0, 3), hb(3, 1), data(4, 2), hb(6, 2), data(7, 1)],
                vec![
                    data(0, 1),
                    hb(1, 1),
                    data(2, 4),
                    hb(6, 2),
                    Item::End { seq: 7 },
                ],
            ])
        };
        // A merge aligned at heartbeat 2, having followed `orders` over `inp`.
        let followed = |mut inp: Vec<VecDeque<Item<Rows>>>, orders: &[(usize, u64)]| {
            let mut m = Positional::new(2);
            Merge::<Rows>::align_at(&mut m, 2);
            for &(c, s) in orders {
                m.push_order(c, s).unwrap();
            }
            while m.next(&mut inp).is_some_and(|d| d != Delivery::End) {}
            m
        };
        // Ordered as a leader holding every channel at heartbeat 2 does: each through its
        // heartbeat 2, and no further until both are.
        let m = followed(streams(), &[(0, 4), (1, 2), (0, 7), (1, 7)]);
        let cut = Merge::<Rows>::cut(&m).expect("aligned at heartbeat 2");
        assert!(cut.orders.is_empty(), "{cut:?}");
        assert_eq!((m.position(0), m.position(1)), (Some(7), Some(7)));
        // Ordered past it on channel 0 first (a leader that was not asked to hold): the
        // cut at heartbeat 2 would hold a row its producer's cut there has not emitted.
        let mut m = followed(streams(), &[(0, 8), (1, 7)]);
        assert_eq!(
            Merge::<Rows>::cut(&m),
            None,
            "channel 0 is one row past heartbeat 2"
        );
        Merge::<Rows>::release(&mut m);
        assert!(
            Merge::<Rows>::cut(&m).is_some(),
            "unaligned, a rebuild may cut it"
        );
        // A channel that ended before the heartbeat does not keep the cut from being taken;
        // one that ended after it does.
        for (end_after, aligned) in [(false, true), (true, false)] {
            let inp = inputs(vec![
                vec![data(0, 1), hb(1, 1), hb(2, 2)],
                if end_after {
                    vec![hb(0, 1), hb(1, 2), Item::End { seq: 2 }]
                } else {
                    vec![hb(0, 1), Item::End { seq: 1 }]
                },
            ]);
            let m = followed(inp, &[(1, 3), (0, 3)]);
            assert_eq!(
                Merge::<Rows>::cut(&m).is_some(),
                aligned,
                "ended after: {end_after}"
            );
        }
    }

    #[test]
    fn positional_rejects_unknown_channel_and_ends() {
        let mut m = Positional::<Rows>::new(1);
        let err = m.push_order(3, 1).unwrap_err().to_string();
        assert!(
            err.contains("channel 3") && err.contains("1 channels"),
            "{err}"
        );
        let mut inp = inputs(vec![vec![data(0, 1), Item::End { seq: 1 }]]);
        m.push_order(0, 100).unwrap();
        assert!(matches!(m.next(&mut inp), Some(Delivery::Data { .. })));
        assert_eq!(m.next(&mut inp), Some(Delivery::End));
        assert_eq!(m.next(&mut inp), Some(Delivery::End));
    }

    #[test]
    fn build_returns_each_mode() {
        let mut inp = inputs(vec![vec![data(0, 5)]]);
        let mut m = build::<Rows>(&OrderingMode::LiveRobin, 1);
        assert_eq!(
            m.next(&mut inp),
            Some(Delivery::Data {
                channel: 0,
                first_seq: 0,
                payload: Rows { start: 0, len: 5 }
            }),
            "the whole batch"
        );
        let mut f = build::<Rows>(&OrderingMode::None, 1);
        assert_eq!(f.next(&mut inputs(vec![vec![]])), None);
        let mut p = build::<Rows>(&OrderingMode::Positional, 1);
        assert_eq!(
            p.next(&mut inputs(vec![vec![data(0, 1)]])),
            None,
            "no orders yet"
        );
    }
}
