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

use std::collections::VecDeque;

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
}

impl OrderLog {
    /// A log for a merge over `channels` input channels.
    pub fn new(channels: usize) -> Self {
        Self {
            ordered: vec![0; channels],
            pending: VecDeque::new(),
            stats: OrderLogStats::default(),
        }
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
