//! LiveRobin: the leaderless deterministic merge of the paper (Algorithm 1).
//!
//! Round-robin over the logical input channels still *active* in the current heartbeat
//! cycle. A channel leaves the active set `A` when its heartbeat for the cycle is dequeued;
//! once every channel has delivered a heartbeat, `A` is refilled and the next cycle starts.
//! A heartbeat epoch seen for the first time (`epoch > gen`) is forwarded: replicas see it
//! first on the same channel at the same position, so they forward it at the same place.
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
//! # Batching
//!
//! The paper dequeues one event per turn. Here a turn takes up to `quantum_rows` data rows
//! from the current channel and never crosses a heartbeat or end marker: a turn is either
//! up to `quantum_rows` rows, or up to `quantum_rows - 1` rows followed by the heartbeat or
//! end marker that stops it (dequeued as the turn's last element). Rows available now are
//! delivered at once (a partial batch); the turn stays on that channel until
//! `quantum_rows` rows were taken or a heartbeat/end was dequeued. The *row order* therefore
//! depends only on the channels' contents (`quantum_rows = 1` is exactly the paper's
//! per-event algorithm); only batch boundaries vary with arrival timing.
//!
//! # Other departures
//!
//! * `gen` starts as "nothing seen", so an epoch 0 heartbeat is forwarded too (the paper
//!   initialises `gen = 0` and numbers epochs from 1).
//! * End of a channel: it leaves `A` for good; once every channel ended the merge delivers
//!   [`Delivery::End`] (and keeps doing so).
//! * One input channel (`n == 1`): pure pass-through, heartbeats forwarded, no round-robin
//!   bookkeeping and no batch splitting — the paper ran the merge even there and paid
//!   latency for nothing.

use crate::item::{Chunk, Delivery, Item};
use crate::merge::{take, Ended, HeartbeatGate, Inputs, Merge};

/// See the module documentation.
#[derive(Debug)]
pub struct LiveRobin<P> {
    /// Channel whose turn it is (`next` in Algorithm 1).
    current: usize,
    /// The active set `A`, one flag per channel, and how many are set.
    active: Vec<bool>,
    active_count: usize,
    ended: Ended,
    gate: HeartbeatGate,
    quantum_rows: usize,
    /// Rows taken in the current turn.
    taken: usize,
    /// Per channel: the tail of a chunk cut at the end of a turn.
    remainder: Vec<Option<Item<P>>>,
}

impl<P: Chunk> LiveRobin<P> {
    /// A merge over `channels` inputs taking at most `quantum_rows` rows per turn
    /// (0 is treated as 1). With 0 channels it delivers [`Delivery::End`] at once.
    pub fn new(channels: usize, quantum_rows: usize) -> Self {
        Self {
            current: 0,
            active: vec![true; channels],
            active_count: channels,
            ended: Ended::new(channels),
            gate: HeartbeatGate::default(),
            quantum_rows: quantum_rows.max(1),
            taken: 0,
            remainder: (0..channels).map(|_| None).collect(),
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
            // channels that have not ended.
            for c in 0..self.active.len() {
                self.active[c] = !self.ended.is_ended(c);
            }
            self.active_count = self.active.iter().filter(|&&a| a).count();
        }
    }

    /// End the current turn: move to the next active channel after `current`, wrapping
    /// around (lines 20–23 of Algorithm 1).
    fn advance(&mut self) {
        self.taken = 0;
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
            match take(&mut self.remainder, inputs, 0)? {
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
        if self.active.len() == 1 {
            return self.pass_through(inputs);
        }
        loop {
            let c = self.current;
            let item = take(&mut self.remainder, inputs, c)?;
            match item {
                Item::Data { first_seq, payload } => {
                    let rows = payload.rows();
                    if rows == 0 {
                        continue;
                    }
                    let room = self.quantum_rows - self.taken;
                    let payload = if rows > room {
                        let tail = payload.slice(room, rows - room);
                        self.remainder[c] = Some(Item::Data {
                            first_seq: first_seq + room as u64,
                            payload: tail,
                        });
                        payload.slice(0, room)
                    } else {
                        payload
                    };
                    self.taken += payload.rows();
                    if self.taken >= self.quantum_rows {
                        self.advance();
                    }
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
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::*;
    use crate::item::Rows;

    fn data(first_seq: u64, len: usize) -> Item<Rows> {
        Item::Data {
            first_seq,
            payload: Rows {
                start: first_seq,
                len,
            },
        }
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
    fn per_event_round_robin_within_a_cycle() {
        let mut inp = inputs(vec![
            vec![data(0, 2), hb(2, 1), data(3, 1)],
            vec![data(0, 1), hb(1, 1), data(2, 1)],
        ]);
        let mut m = LiveRobin::new(2, 1);
        assert_eq!(
            run(&mut m, &mut inp),
            vec![
                d(0, 0, 1),
                d(1, 0, 1),
                d(0, 1, 1),
                h(1, 1, true),
                // Channel 1 left the cycle: channel 0 alone until its heartbeat.
                h(0, 1, false),
                // New cycle; round-robin continues after channel 0, i.e. with channel 1.
                d(1, 2, 1),
                d(0, 3, 1),
            ]
        );
        assert_eq!(m.waiting_on(), Some(1));
    }

    #[test]
    fn the_fix_a_repeated_epoch_still_closes_the_channels_cycle() {
        // Channel 0 is fast: with the printed algorithm its non-first heartbeat would keep
        // it active and it would run into cycle 2 before channel 1's cycle-1 data.
        let mut inp = inputs(vec![vec![hb(0, 1), data(1, 3), hb(4, 2)], vec![data(0, 1)]]);
        let mut m = LiveRobin::new(2, 1);
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
        assert_eq!(m.next(&mut inp), Some(d(0, 1, 1)));
    }

    #[test]
    fn quantum_limits_a_turn_and_partial_rows_go_out_at_once() {
        let mut inp = inputs(vec![vec![data(0, 5)], vec![data(0, 2)]]);
        let mut m = LiveRobin::new(2, 3);
        assert_eq!(m.next(&mut inp), Some(d(0, 0, 3)));
        assert_eq!(
            m.next(&mut inp),
            Some(d(1, 0, 2)),
            "partial: 2 rows available now"
        );
        assert_eq!(m.next(&mut inp), None, "the turn stays on channel 1");
        assert_eq!(m.waiting_on(), Some(1));
        inp[1].push_back(data(2, 4));
        assert_eq!(
            m.next(&mut inp),
            Some(d(1, 2, 1)),
            "completes the quantum of 3"
        );
        assert_eq!(
            m.next(&mut inp),
            Some(d(0, 3, 2)),
            "remainder kept for channel 0"
        );
        assert_eq!(m.next(&mut inp), None);
        assert_eq!(m.waiting_on(), Some(0));
    }

    #[test]
    fn a_turn_never_crosses_a_heartbeat() {
        let mut inp = inputs(vec![
            vec![data(0, 1), hb(1, 1), data(2, 9)],
            vec![data(0, 9)],
        ]);
        let mut m = LiveRobin::new(2, 4);
        assert_eq!(m.next(&mut inp), Some(d(0, 0, 1)));
        assert_eq!(m.next(&mut inp), Some(h(0, 1, true)));
        assert_eq!(m.next(&mut inp), Some(d(1, 0, 4)));
        assert_eq!(
            m.next(&mut inp),
            Some(d(1, 4, 4)),
            "channel 1 alone in the cycle"
        );
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
        let mut m = LiveRobin::new(2, 1);
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
        let mut m = LiveRobin::new(2, 1);
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
        let mut m = LiveRobin::new(1, 1);
        assert_eq!(
            run(&mut m, &mut inp),
            vec![d(0, 0, 100), h(0, 3, true), h(0, 3, false), Delivery::End]
        );
    }

    #[test]
    fn zero_channels_and_zero_quantum() {
        let mut none: Vec<VecDeque<Item<Rows>>> = Vec::new();
        assert_eq!(LiveRobin::new(0, 1).next(&mut none), Some(Delivery::End));
        let mut inp = inputs(vec![vec![data(0, 2)], vec![]]);
        assert_eq!(LiveRobin::new(2, 0).next(&mut inp), Some(d(0, 0, 1)));
    }
}
