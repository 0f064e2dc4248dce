//! LiveRobin: the leaderless deterministic merge of the paper (Algorithm 1), one whole
//! batch per turn.
//!
//! Round-robin over the logical input channels still *active* in the current heartbeat
//! cycle. A channel leaves the active set `A` when its heartbeat for the cycle is dequeued;
//! once every channel has delivered a heartbeat, `A` is refilled and the next cycle starts.
//! A heartbeat epoch seen for the first time (`epoch > gen`) is forwarded: replicas see it
//! first on the same channel at the same position, so they forward it at the same place.
//!
//! # A turn is one element: a whole batch
//!
//! The paper dequeues one event per turn; here the event is one *element* of the current
//! channel: a whole data batch (never sliced), or a heartbeat, or the end marker. After it
//! the turn moves to the next active channel. This is deterministic because of DESIGN §2
//! invariant 1: every replica of an upstream partition emits the same batches with the
//! same sequence ranges, so dedup keeps whole batches whichever copy arrives first, and
//! every downstream replica finds the same sequence of batches on each channel. The merge
//! decides from that sequence alone, so the replicas of a task hand their operator the same
//! *batches* in the same order — identical batch boundaries, not only identical rows. An
//! operator may therefore compute over its whole batch (a batch mean, a rank within the
//! batch, any `mapInArrow` function). Cutting turns into row quanta would put batch
//! boundaries wherever a channel happened to run dry, i.e. at timing-dependent points.
//!
//! An empty data batch covers no sequence number, so nothing can tell its copies apart:
//! dedup drops it and the wire refuses to encode it. One that reaches the merge anyway (a
//! caller pushing elements directly) is skipped without taking a turn, so the order never
//! depends on whether such a batch showed up.
//!
//! # The fix to the printed algorithm (DESIGN §2)
//!
//! Algorithm 1 removes a channel from `A` only inside the `if e.seq > gen` branch, i.e.
//! only when the heartbeat is the first of its epoch. The second channel to deliver the
//! heartbeat of epoch `e` then stays active, the cycle never completes, and a fast channel
//! runs ahead into the next cycle — merge order then depends on timing again. Here a
//! channel leaves `A` whenever its heartbeat is dequeued, first or not; only forwarding
//! depends on `epoch > gen`.
//!
//! # Other departures
//!
//! * `gen` starts as "nothing seen", so an epoch 0 heartbeat is forwarded too (the paper
//!   initialises `gen = 0` and numbers epochs from 1).
//! * End of a channel: its end marker ends the turn like any element but delivers nothing;
//!   the channel leaves `A` for good and the same `next` call goes on with the next channel
//!   in turn. Once every channel ended the merge delivers [`Delivery::End`] (and keeps
//!   doing so).
//! * One input channel (`n == 1`): pass-through, heartbeats forwarded. Round-robin over a
//!   single channel delivers every element as it comes anyway; the fast path skips the
//!   bookkeeping (the paper ran the full merge even there).
//!
//! # Channels that join (a live rescale)
//!
//! [`Merge::join`] appends channels that take no turn until heartbeat `K` has ended its
//! cycle: they become active with the first refill of `A` at which `gen >= K`. Every
//! channel carries every epoch and leaves `A` at its heartbeat, so `gen` first reaches
//! `K` inside cycle `K` and that refill is the cycle's end — a point set by what the
//! channels delivered, the same in every replica however late or early each was told
//! (before it saw `K`). Should every other channel end first, they join at that refill.
//! While they wait the merge cannot be cut.

use std::marker::PhantomData;

use crate::consume::{Ended, HeartbeatGate, Inputs, Merge, MergeCut};
use crate::error::{Error, Result};
use crate::item::{Chunk, Delivery, Item};

/// See the module documentation. `P` is the payload of the batches it hands out (an Arrow
/// `RecordBatch` in production); the merge never looks inside one beyond its row count.
#[derive(Debug)]
pub struct LiveRobin<P> {
    /// Channel whose turn it is (`next` in Algorithm 1).
    current: usize,
    /// The active set `A`, one flag per channel, and how many are set.
    active: Vec<bool>,
    active_count: usize,
    ended: Ended,
    gate: HeartbeatGate,
    /// Channels that joined ([`Merge::join`]) and wait for the refill after heartbeat
    /// `after`: `(after, first of them)`; they are the channels from `first` on.
    joining: Option<(u64, usize)>,
    /// Batches pass through untouched: no per-channel state depends on the payload.
    payload: PhantomData<fn() -> P>,
}

impl<P: Chunk> LiveRobin<P> {
    /// A merge over `channels` inputs, one element per turn. With 0 channels it delivers
    /// [`Delivery::End`] at once.
    pub fn new(channels: usize) -> Self {
        Self {
            current: 0,
            active: vec![true; channels],
            active_count: channels,
            ended: Ended::new(channels),
            gate: HeartbeatGate::default(),
            joining: None,
            payload: PhantomData,
        }
    }

    /// The current heartbeat cycle's active channels, in channel order.
    pub fn active_channels(&self) -> Vec<usize> {
        (0..self.active.len()).filter(|&c| self.active[c]).collect()
    }

    fn deactivate(&mut self, channel: usize) {
        if self.active[channel] {
            self.active[channel] = false;
            self.active_count -= 1;
        }
        if self.active_count == 0 {
            // Every channel delivered this cycle's heartbeat: start the next cycle with all
            // channels that have not ended (and joining ones, once their cycle is over).
            let open = match self.joining {
                Some((after, first)) => {
                    let over = self.gate.gen().is_some_and(|g| g >= after)
                        || (0..first).all(|c| self.ended.is_ended(c));
                    if over {
                        self.joining = None;
                        self.active.len()
                    } else {
                        first
                    }
                }
                None => self.active.len(),
            };
            for c in 0..open {
                self.active[c] = !self.ended.is_ended(c);
            }
            self.active_count = self.active.iter().filter(|&&a| a).count();
        }
    }

    /// End the current turn: move to the next active channel after `current`, wrapping
    /// around (lines 20–23 of Algorithm 1).
    fn advance(&mut self) {
        let n = self.active.len();
        if self.active_count == 0 {
            return;
        }
        for step in 1..=n {
            let c = (self.current + step) % n;
            if self.active[c] {
                self.current = c;
                return;
            }
        }
    }

    fn pass_through(&mut self, inputs: &mut dyn Inputs<P>) -> Option<Delivery<P>> {
        loop {
            match inputs.pop(0)? {
                Item::Data { first_seq, payload } => {
                    if payload.rows() > 0 {
                        return Some(Delivery::Data {
                            channel: 0,
                            first_seq,
                            payload,
                        });
                    }
                }
                Item::Heartbeat { epoch, .. } => {
                    let first = self.gate.see(epoch);
                    return Some(Delivery::Heartbeat {
                        channel: 0,
                        epoch,
                        first,
                    });
                }
                Item::End { .. } => {
                    self.ended.mark(0);
                    return Some(Delivery::End);
                }
            }
        }
    }
}

impl<P: Chunk + Send> Merge<P> for LiveRobin<P> {
    fn next(&mut self, inputs: &mut dyn Inputs<P>) -> Option<Delivery<P>> {
        if self.ended.all() {
            return Some(Delivery::End);
        }
        if self.active.len() == 1 && self.joining.is_none() {
            return self.pass_through(inputs);
        }
        loop {
            let c = self.current;
            match inputs.pop(c)? {
                Item::Data { first_seq, payload } => {
                    if payload.rows() == 0 {
                        // Covers no seq: skipped without taking a turn (module docs).
                        continue;
                    }
                    // One whole batch is the turn.
                    self.advance();
                    return Some(Delivery::Data {
                        channel: c,
                        first_seq,
                        payload,
                    });
                }
                Item::Heartbeat { epoch, .. } => {
                    let first = self.gate.see(epoch);
                    // The fix: leave the cycle whether or not the epoch is new.
                    self.deactivate(c);
                    self.advance();
                    return Some(Delivery::Heartbeat {
                        channel: c,
                        epoch,
                        first,
                    });
                }
                Item::End { .. } => {
                    self.ended.mark(c);
                    if self.ended.all() {
                        return Some(Delivery::End);
                    }
                    // Leaves A; if that empties A the refill skips ended channels.
                    self.deactivate(c);
                    self.advance();
                }
            }
        }
    }

    fn waiting_on(&self) -> Option<usize> {
        if self.ended.all() {
            None
        } else {
            Some(self.current)
        }
    }

    fn join(&mut self, count: usize, after_epoch: u64) -> Result<()> {
        if self.joining.is_some() {
            return Err(Error::Config(
                "channels are joining already; one join at a time".to_owned(),
            ));
        }
        if self.gate.gen().is_some_and(|g| g >= after_epoch) {
            return Err(Error::Config(format!(
                "channels cannot join after heartbeat {after_epoch}: the merge has seen it"
            )));
        }
        if self.ended.all() {
            return Err(Error::Config(
                "channels cannot join a merge whose channels all ended".to_owned(),
            ));
        }
        if count == 0 {
            return Ok(());
        }
        let first = self.active.len();
        self.active.resize(first + count, false);
        self.ended.grow(count);
        self.joining = Some((after_epoch, first));
        Ok(())
    }

    fn cancel_join(&mut self, count: usize) -> Result<()> {
        match self.joining {
            Some((_, first)) if first + count == self.active.len() => {
                self.active.truncate(first);
                self.ended.truncate(first);
                self.joining = None;
                Ok(())
            }
            Some((_, first)) => Err(Error::Config(format!(
                "{count} channels to take back, but {} are joining",
                self.active.len() - first
            ))),
            None if count == 0 => Ok(()),
            None => Err(Error::Config(format!(
                "{count} channels to take back, but none is joining (they have taken turns \
                 already)"
            ))),
        }
    }

    /// Only at a cycle boundary: every channel that has not ended is active again (and
    /// none is waiting to join).
    fn cut(&self) -> Option<MergeCut> {
        if self.joining.is_some() {
            return None;
        }
        let boundary = (0..self.active.len()).all(|c| self.active[c] != self.ended.is_ended(c));
        boundary.then(|| MergeCut {
            turn: self.current,
            gen: self.gate.gen(),
            ended: self.ended.flags(),
            orders: Vec::new(),
        })
    }

    fn resume(&mut self, cut: &MergeCut, _positions: &[u64]) -> Result<()> {
        cut.check(self.active.len())?;
        self.current = cut.turn;
        self.gate = HeartbeatGate::resumed(cut.gen);
        self.ended = Ended::resumed(&cut.ended);
        for (c, a) in self.active.iter_mut().enumerate() {
            *a = !cut.ended[c];
        }
        self.active_count = self.active.iter().filter(|&&a| a).count();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::*;
    use crate::item::Rows;

    fn data(first_seq: u64, len: usize) -> Item<Rows> {
        Item::rows(first_seq, len)
    }
    fn hb(seq: u64, epoch: u64) -> Item<Rows> {
        Item::Heartbeat { seq, epoch }
    }
    fn d(channel: usize, first_seq: u64, len: usize) -> Delivery<Rows> {
        Delivery::Data {
            channel,
            first_seq,
            payload: Rows {
                start: first_seq,
                len,
            },
        }
    }
    fn h(channel: usize, epoch: u64, first: bool) -> Delivery<Rows> {
        Delivery::Heartbeat {
            channel,
            epoch,
            first,
        }
    }
    fn run(m: &mut LiveRobin<Rows>, inp: &mut Vec<VecDeque<Item<Rows>>>) -> Vec<Delivery<Rows>> {
        let mut out = Vec::new();
        while let Some(x) = m.next(inp) {
            let end = x == Delivery::End;
            out.push(x);
            if end {
                break;
            }
        }
        out
    }
    fn inputs(channels: Vec<Vec<Item<Rows>>>) -> Vec<VecDeque<Item<Rows>>> {
        channels.into_iter().map(VecDeque::from).collect()
    }

    #[test]
    fn one_whole_batch_per_turn_round_robin_within_a_cycle() {
        let mut inp = inputs(vec![
            vec![data(0, 2), hb(2, 1), data(3, 1)],
            vec![data(0, 1), hb(1, 1), data(2, 1)],
        ]);
        let mut m = LiveRobin::new(2);
        assert_eq!(
            run(&mut m, &mut inp),
            vec![
                d(0, 0, 2),
                d(1, 0, 1),
                h(0, 1, true),
                // Channel 0 left the cycle: channel 1 alone until its heartbeat.
                h(1, 1, false),
                // New cycle; round-robin continues after channel 1, i.e. with channel 0.
                d(0, 3, 1),
                d(1, 2, 1),
            ]
        );
        assert_eq!(m.waiting_on(), Some(0));
    }

    #[test]
    fn a_batch_is_never_sliced_and_the_turn_waits_on_its_channel() {
        let mut inp = inputs(vec![vec![data(0, 5), data(5, 3)], vec![data(0, 2)]]);
        let mut m = LiveRobin::new(2);
        assert_eq!(m.next(&mut inp), Some(d(0, 0, 5)), "all 5 rows in one turn");
        assert_eq!(m.next(&mut inp), Some(d(1, 0, 2)));
        assert_eq!(m.next(&mut inp), Some(d(0, 5, 3)));
        assert_eq!(m.next(&mut inp), None, "channel 1's turn, and it is empty");
        assert_eq!(m.waiting_on(), Some(1));
        inp[0].push_back(data(8, 1));
        assert_eq!(
            m.next(&mut inp),
            None,
            "a ready batch on channel 0 does not jump the turn"
        );
        inp[1].push_back(data(2, 4));
        assert_eq!(m.next(&mut inp), Some(d(1, 2, 4)));
        assert_eq!(m.next(&mut inp), Some(d(0, 8, 1)));
        assert_eq!(m.waiting_on(), Some(1));
    }

    #[test]
    fn a_heartbeat_is_a_turn_of_its_own() {
        let mut inp = inputs(vec![
            vec![data(0, 1), hb(1, 1), data(2, 9)],
            vec![data(0, 9), data(9, 9)],
        ]);
        let mut m = LiveRobin::new(2);
        assert_eq!(m.next(&mut inp), Some(d(0, 0, 1)));
        assert_eq!(m.next(&mut inp), Some(d(1, 0, 9)));
        assert_eq!(m.next(&mut inp), Some(h(0, 1, true)));
        assert_eq!(
            m.next(&mut inp),
            Some(d(1, 9, 9)),
            "channel 1 alone in the cycle"
        );
        assert_eq!(m.next(&mut inp), None);
        assert_eq!(
            m.waiting_on(),
            Some(1),
            "channel 0 waits for the next cycle"
        );
    }

    #[test]
    fn empty_batches_take_no_turn() {
        let mut inp = inputs(vec![
            vec![data(0, 0), data(0, 2), data(2, 0)],
            vec![data(0, 0), data(0, 1), hb(1, 1)],
        ]);
        let mut m = LiveRobin::new(2);
        assert_eq!(m.next(&mut inp), Some(d(0, 0, 2)));
        assert_eq!(m.next(&mut inp), Some(d(1, 0, 1)));
        assert_eq!(
            m.next(&mut inp),
            None,
            "the trailing empty batch was dropped"
        );
        assert_eq!(m.waiting_on(), Some(0));
        assert!(inp[0].is_empty());
        let mut one = inputs(vec![vec![data(0, 0), hb(0, 4)]]);
        assert_eq!(LiveRobin::new(1).next(&mut one), Some(h(0, 4, true)));
    }

    #[test]
    fn the_fix_a_repeated_epoch_still_closes_the_channels_cycle() {
        // Channel 0 is fast: with the printed algorithm its non-first heartbeat would keep
        // it active and it would run into cycle 2 before channel 1's cycle-1 data.
        let mut inp = inputs(vec![vec![hb(0, 1), data(1, 3), hb(4, 2)], vec![data(0, 1)]]);
        let mut m = LiveRobin::new(2);
        assert_eq!(m.next(&mut inp), Some(h(0, 1, true)));
        assert_eq!(m.active_channels(), vec![1]);
        assert_eq!(m.next(&mut inp), Some(d(1, 0, 1)));
        // Channel 1 has nothing more: the merge waits on it, channel 0's next cycle waits.
        assert_eq!(m.next(&mut inp), None);
        assert_eq!(m.waiting_on(), Some(1));
        inp[1].push_back(hb(1, 1));
        assert_eq!(m.next(&mut inp), Some(h(1, 1, false)));
        assert_eq!(
            m.active_channels(),
            vec![0, 1],
            "cycle complete, both active again"
        );
        assert_eq!(m.next(&mut inp), Some(d(0, 1, 3)));
    }

    #[test]
    fn end_leaves_for_good_and_all_ended_is_end() {
        let mut inp = inputs(vec![
            vec![data(0, 1), Item::End { seq: 1 }],
            vec![
                data(0, 1),
                hb(1, 1),
                data(2, 1),
                hb(3, 2),
                Item::End { seq: 4 },
            ],
        ]);
        let mut m = LiveRobin::new(2);
        assert_eq!(
            run(&mut m, &mut inp),
            vec![
                d(0, 0, 1),
                d(1, 0, 1),
                // channel 0 ends; A = {1}
                h(1, 1, true),
                // A was {1}, now empty: new cycle with the non-ended channels only.
                d(1, 2, 1),
                h(1, 2, true),
                Delivery::End,
            ]
        );
        assert_eq!(m.next(&mut inp), Some(Delivery::End));
        assert_eq!(m.waiting_on(), None);
    }

    #[test]
    fn end_completing_a_cycle_starts_the_next() {
        let mut inp = inputs(vec![vec![hb(0, 1), data(1, 1)], vec![Item::End { seq: 0 }]]);
        let mut m = LiveRobin::new(2);
        assert_eq!(m.next(&mut inp), Some(h(0, 1, true)));
        assert_eq!(m.next(&mut inp), Some(d(0, 1, 1)));
        assert_eq!(m.active_channels(), vec![0]);
    }

    #[test]
    fn single_input_is_a_pass_through() {
        let mut inp = inputs(vec![vec![
            data(0, 100),
            hb(100, 3),
            hb(101, 3),
            Item::End { seq: 102 },
        ]]);
        let mut m = LiveRobin::new(1);
        assert_eq!(
            run(&mut m, &mut inp),
            vec![d(0, 0, 100), h(0, 3, true), h(0, 3, false), Delivery::End]
        );
    }

    #[test]
    fn joined_channels_take_turns_from_the_cycle_after_their_heartbeat() {
        // Channels 0 and 1 carry heartbeats 1..=3; channel 2 joins after heartbeat 2, its
        // data already queued, and first takes a turn once both delivered heartbeat 2.
        let old = || {
            vec![
                data(0, 1),
                hb(1, 1),
                data(2, 1),
                hb(3, 2),
                data(4, 1),
                hb(5, 3),
            ]
        };
        let mut inp = inputs(vec![
            old(),
            old(),
            vec![data(0, 2), hb(2, 3), Item::End { seq: 3 }],
        ]);
        inp[0].push_back(Item::End { seq: 6 });
        inp[1].push_back(Item::End { seq: 6 });
        let mut m = LiveRobin::<Rows>::new(2);
        assert_eq!(m.next(&mut inp), Some(d(0, 0, 1)));
        m.join(1, 2).unwrap();
        assert!(m.cut().is_none(), "not while a channel waits to join");
        let out = run(&mut m, &mut inp);
        assert_eq!(
            out,
            vec![
                d(1, 0, 1),
                h(0, 1, true),
                h(1, 1, false),
                d(0, 2, 1),
                d(1, 2, 1),
                h(0, 2, true),
                h(1, 2, false),
                // Cycle 3 includes the joined channel, and the turn moves on from channel
                // 1, whose heartbeat ended cycle 2: to channel 2.
                d(2, 0, 2),
                d(0, 4, 1),
                d(1, 4, 1),
                h(2, 3, true),
                h(0, 3, false),
                h(1, 3, false),
                Delivery::End,
            ]
        );
    }

    #[test]
    fn a_join_is_refused_once_its_heartbeat_was_seen() {
        let mut inp = inputs(vec![vec![hb(0, 1), hb(1, 2)], vec![hb(0, 1), hb(1, 2)]]);
        let mut m = LiveRobin::<Rows>::new(2);
        assert_eq!(run(&mut m, &mut inp).len(), 4);
        assert!(m.join(1, 2).is_err(), "heartbeat 2 is past");
        assert!(m.join(1, 3).is_ok());
        assert!(m.join(1, 4).is_err(), "one join at a time");
    }

    #[test]
    fn joined_channels_join_when_every_other_channel_ended() {
        let mut inp = inputs(vec![
            vec![data(0, 1), Item::End { seq: 1 }],
            vec![data(0, 3), Item::End { seq: 3 }],
        ]);
        let mut m = LiveRobin::<Rows>::new(1);
        m.join(1, 5).unwrap();
        assert_eq!(
            run(&mut m, &mut inp),
            vec![d(0, 0, 1), d(1, 0, 3), Delivery::End]
        );
    }

    #[test]
    fn zero_channels_end_at_once() {
        let mut none: Vec<VecDeque<Item<Rows>>> = Vec::new();
        let mut m = LiveRobin::new(0);
        assert_eq!(m.next(&mut none), Some(Delivery::End));
        assert_eq!(m.waiting_on(), None);
    }
}
