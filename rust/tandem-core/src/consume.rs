//! What every consumption order shares: the [`Inputs`] a merge reads, the [`Merge`] trait
//! it implements, the [`MergeCut`] a rebuilt replica resumes from, and the bookkeeping of
//! heartbeat epochs and ended channels.
//!
//! The orders themselves are [`crate::liverobin::LiveRobin`] (Algorithm 1 of the paper) and
//! those of [`crate::merge`] (`none`, KaZoo's positional order, and the `ordering` knob that
//! picks one of the three). `liverobin` builds on this module alone; `merge` on this module
//! and, to build a LiveRobin, on `liverobin`, which never reaches back into `merge`.

use std::collections::VecDeque;

use crate::dedup::DedupReceiver;
use crate::error::{Error, Result};
use crate::item::{Chunk, Delivery, Item};

/// The input channels a merge reads, in a fixed order (channel `i` is logical upstream
/// channel `i` at every replica).
pub trait Inputs<P> {
    /// Number of channels.
    fn channels(&self) -> usize;
    /// The next element of `channel` in sequence order, or `None` if none is available
    /// yet (or `channel` is out of range).
    fn pop(&mut self, channel: usize) -> Option<Item<P>>;
}

impl<P: Chunk + Send> Inputs<P> for Vec<DedupReceiver<P>> {
    fn channels(&self) -> usize {
        self.len()
    }
    fn pop(&mut self, channel: usize) -> Option<Item<P>> {
        self.get_mut(channel)?.pop()
    }
}

/// Pre-filled channels: tests, benchmarks and the Python bindings feed these directly.
impl<P> Inputs<P> for Vec<VecDeque<Item<P>>> {
    fn channels(&self) -> usize {
        self.len()
    }
    fn pop(&mut self, channel: usize) -> Option<Item<P>> {
        self.get_mut(channel)?.pop_front()
    }
}

/// A consumption order. See the module documentation. The `inputs` passed to `next` must
/// be the same channels, in the same order, on every call and at every replica (a merge
/// built for `n` channels waits forever on a channel index the inputs do not have).
pub trait Merge<P: Chunk>: Send {
    /// Next delivery in this replica's consumption order, or None if it must wait for more input.
    fn next(&mut self, inputs: &mut dyn Inputs<P>) -> Option<Delivery<P>>;
    /// The channel it is blocked on (None = any channel would do).
    fn waiting_on(&self) -> Option<usize>;
    /// Every delivery available now, in order: [`Merge::next`] until it must wait for more
    /// input, or up to and including [`Delivery::End`] (which it then keeps returning, so
    /// the loop stops there).
    fn drain(&mut self, inputs: &mut dyn Inputs<P>) -> Vec<Delivery<P>> {
        let mut out = Vec::new();
        while let Some(d) = self.next(inputs) {
            let end = matches!(d, Delivery::End);
            out.push(d);
            if end {
                break;
            }
        }
        out
    }
    /// Append the order "consume `channel` until its next sequence number is `up_to_seq`".
    /// Only [`crate::merge::Positional`] follows orders; the other merges decide for
    /// themselves and refuse.
    fn push_order(&mut self, channel: usize, up_to_seq: u64) -> Result<()> {
        Err(Error::Config(format!(
            "order (channel {channel}, up to seq {up_to_seq}) pushed to a merge that decides its \
             own order; only ordering 'kazoo' (positional) follows orders"
        )))
    }
    /// An aligned cut at heartbeat `epoch` is asked for: take nothing on a channel past
    /// its heartbeat `epoch` until [`Merge::release`], so that when the last channel
    /// delivers it the merge has consumed exactly every channel through `epoch`. Only a
    /// merge that may run one channel ahead of another needs it ([`crate::merge::Fcfs`]);
    /// LiveRobin's cycles end at every heartbeat on every channel together, and a
    /// positional merge follows its orders.
    fn align_at(&mut self, _epoch: u64) {}
    /// The aligned cut is taken (or given up): take input as before.
    fn release(&mut self) {}
    /// Append `count` input channels (numbered after the present ones) that join the
    /// order once heartbeat `after_epoch` has ended its cycle — a task whose upstream
    /// grows partitions at that heartbeat (a live rescale): the same point in every
    /// replica, for it is defined by what the channels delivered, not by when this is
    /// called (LiveRobin refuses once it has seen heartbeat `after_epoch`: too late to be
    /// the same point everywhere; first come, first served serves them at once). Refused
    /// by the positional order, which follows its leader's orders.
    fn join(&mut self, count: usize, after_epoch: u64) -> Result<()> {
        Err(Error::Config(format!(
            "{count} channels joining after heartbeat {after_epoch}: this consumption order \
             takes no new channels"
        )))
    }
    /// Take back the last `count` channels of a [`Merge::join`] that is given up (a live
    /// rescale cancelled before its switch): the merge is again the one it was before the
    /// join. Refused once any of them could have been served (LiveRobin: they were
    /// activated; first come, first served: one delivered something).
    fn cancel_join(&mut self, count: usize) -> Result<()> {
        Err(Error::Config(format!(
            "{count} channels to take back: this consumption order takes no new channels"
        )))
    }
    /// The merge's state now, if a replica rebuilt from it can start here (see
    /// [`MergeCut`]); None if it cannot be cut now (mid-cycle, or holding part of a batch)
    /// and the caller must try again later.
    fn cut(&self) -> Option<MergeCut> {
        None
    }
    /// Continue from `cut`, taken from a twin's merge of the same kind over the same
    /// channels, whose first sequence numbers not yet consumed were `positions`; call
    /// before the first `next`.
    fn resume(&mut self, _cut: &MergeCut, _positions: &[u64]) -> Result<()> {
        Err(Error::Config(
            "this consumption order cannot resume from a twin's cut".to_owned(),
        ))
    }
}

/// Where a merge stands at a heartbeat-cycle boundary: what a replica rebuilt from a twin
/// needs so that, fed the same input from the cut on, it makes the same choices as the twin.
/// Everything else a merge keeps (LiveRobin's active set) is full at a boundary.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MergeCut {
    /// The channel whose turn is next (LiveRobin), or where the next scan starts (`none`).
    pub turn: usize,
    /// The highest heartbeat epoch seen (`gen` of Algorithm 1).
    pub gen: Option<u64>,
    /// Which channels have ended.
    pub ended: Vec<bool>,
    /// KaZoo's positional merge: the followed orders `(channel, up_to_seq)` not yet
    /// consumed, oldest first (empty for the orders that decide for themselves).
    pub orders: Vec<(usize, u64)>,
}

impl MergeCut {
    /// Check that the cut fits a merge over `channels` channels.
    pub(crate) fn check(&self, channels: usize) -> Result<()> {
        if let Some(&(c, _)) = self.orders.iter().find(|(c, _)| *c >= channels) {
            return Err(Error::Config(format!(
                "a merge cut orders input channel {c}, but the merge has {channels} channels"
            )));
        }
        if self.ended.len() != channels || (channels > 0 && self.turn >= channels) {
            return Err(Error::Config(format!(
                "a merge cut of {} channels (turn {}) does not fit a merge over {channels}",
                self.ended.len(),
                self.turn
            )));
        }
        Ok(())
    }
}

/// Heartbeat bookkeeping shared by every order: an epoch is forwarded (`first: true`) only
/// the first time it is seen, on whichever channel that is.
#[derive(Debug, Default, Clone)]
pub(crate) struct HeartbeatGate {
    /// Highest epoch seen so far (`gen` in Algorithm 1).
    gen: Option<u64>,
}

impl HeartbeatGate {
    pub(crate) fn resumed(gen: Option<u64>) -> Self {
        Self { gen }
    }
    pub(crate) fn gen(&self) -> Option<u64> {
        self.gen
    }
    /// Record a heartbeat of `epoch`; true if it is the first time this epoch is seen.
    pub(crate) fn see(&mut self, epoch: u64) -> bool {
        let first = self.gen.is_none_or(|g| epoch > g);
        if first {
            self.gen = Some(epoch);
        }
        first
    }
}

/// Which channels have ended; [`Delivery::End`] once all of them have.
#[derive(Debug, Clone)]
pub(crate) struct Ended {
    ended: Vec<bool>,
    count: usize,
}

impl Ended {
    pub(crate) fn new(channels: usize) -> Self {
        Self {
            ended: vec![false; channels],
            count: 0,
        }
    }
    pub(crate) fn mark(&mut self, channel: usize) {
        if !self.ended[channel] {
            self.ended[channel] = true;
            self.count += 1;
        }
    }
    pub(crate) fn is_ended(&self, channel: usize) -> bool {
        self.ended[channel]
    }
    /// The number of channels.
    pub(crate) fn channels(&self) -> usize {
        self.ended.len()
    }
    pub(crate) fn all(&self) -> bool {
        self.count == self.ended.len()
    }
    pub(crate) fn flags(&self) -> Vec<bool> {
        self.ended.clone()
    }
    /// `count` more channels, none ended.
    pub(crate) fn grow(&mut self, count: usize) {
        self.ended.resize(self.ended.len() + count, false);
    }
    /// The first `len` channels only (the ones dropped must not have ended).
    pub(crate) fn truncate(&mut self, len: usize) {
        debug_assert!(self.ended[len.min(self.ended.len())..].iter().all(|e| !e));
        self.ended.truncate(len);
    }
    pub(crate) fn resumed(flags: &[bool]) -> Self {
        Self {
            ended: flags.to_vec(),
            count: flags.iter().filter(|&&e| e).count(),
        }
    }
}

/// Take the held remainder of `channel` if any, else pop the channel.
pub(crate) fn take<P>(
    remainder: &mut [Option<Item<P>>],
    inputs: &mut dyn Inputs<P>,
    channel: usize,
) -> Option<Item<P>> {
    remainder[channel].take().or_else(|| inputs.pop(channel))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::item::Rows;
    use crate::liverobin::LiveRobin;

    fn data(first_seq: u64, len: usize) -> Item<Rows> {
        Item::rows(first_seq, len)
    }

    #[test]
    fn drain_is_next_until_it_must_wait() {
        let channels = || -> Vec<VecDeque<Item<Rows>>> {
            vec![
                VecDeque::from(vec![data(0, 2), Item::Heartbeat { seq: 2, epoch: 1 }]),
                VecDeque::from(vec![data(0, 3), data(3, 1)]),
            ]
        };
        let (mut a, mut b) = (channels(), channels());
        let (mut ma, mut mb) = (LiveRobin::<Rows>::new(2), LiveRobin::<Rows>::new(2));
        let mut one_by_one = Vec::new();
        while let Some(d) = ma.next(&mut a) {
            one_by_one.push(d);
        }
        let drained = mb.drain(&mut b);
        assert_eq!(drained, one_by_one);
        assert_eq!(
            drained.len(),
            4,
            "both data of the cycle, the heartbeat, then data"
        );
        assert_eq!(
            mb.waiting_on(),
            Some(1),
            "drain stops where next would wait"
        );
        assert!(
            mb.drain(&mut b).is_empty(),
            "nothing more until input arrives"
        );
    }

    #[test]
    fn drain_stops_after_the_end() {
        let mut inp = vec![
            VecDeque::from(vec![data(0, 1), Item::End { seq: 1 }]),
            VecDeque::from(vec![Item::End { seq: 0 }]),
        ];
        let mut m = LiveRobin::<Rows>::new(2);
        let out = m.drain(&mut inp);
        assert_eq!(out.last(), Some(&Delivery::End));
        assert_eq!(out.len(), 2);
        assert_eq!(
            m.drain(&mut inp),
            vec![Delivery::End],
            "the end, once per call"
        );
    }

    #[test]
    fn heartbeat_gate_forwards_each_epoch_once() {
        let mut g = HeartbeatGate::default();
        assert!(g.see(0), "epoch 0 is new to a fresh gate");
        assert!(!g.see(0));
        assert!(g.see(2));
        assert!(!g.see(1), "an older epoch is not first");
    }
}
