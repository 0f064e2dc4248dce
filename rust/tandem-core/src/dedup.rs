//! Duplicate sending, first copy wins (DESIGN §2, invariant 2).
//!
//! Every upstream replica sends every element of a logical channel to this receiver, so each
//! sequence number arrives `r` times, on `r` connections served by `r` I/O threads. The
//! receiver keeps one high-water mark per logical channel — `next`, the first sequence
//! number not yet accepted — and for an element covering `[a, b)`:
//!
//! * `b <= next`: everything is already in → [`Offer::Duplicate`];
//! * `a > next`: something in `[next, a)` is missing → [`Offer::Gap`]. The element is handed
//!   back, never skipped: the caller holds it and offers it again once `next` has moved
//!   (the [`DedupSender::producer_bell`] rings when it does);
//! * otherwise `[next, b)` is new: it is *claimed* (`next` moves to `b`) and queued, a data
//!   chunk cut with a zero-copy [`Chunk::slice`].
//!
//! # Lock-free design
//!
//! The I/O threads race on one `AtomicU64` (`next`): a compare-and-swap from `n` to `b`
//! claims `[n, b)`. Claims are therefore contiguous and disjoint, whoever wins. The claimed
//! element goes into a bounded lock-free [`ArrayQueue`]. To make sure a claim can always be
//! pushed at once (a thread must never block — or fail — while holding a claim, or the
//! consumer would wait forever for the hole), a producer first takes a *capacity permit*
//! and only then attempts the claim; with no permit the offer returns [`Offer::Full`]
//! without claiming anything, and the caller retries after the producer bell rings.
//!
//! Two producers may claim `[0, 10)` and `[10, 20)` and push them in the opposite order, so
//! the single consumer ([`DedupReceiver`]) restores sequence order with a tiny reorder
//! buffer. It never holds more than one element per concurrently offering thread (r − 1 for
//! r upstream replicas), because every claim is pushed immediately after it is made.
//!
//! Doorbells: the consumer's bell rings after every accepted element (there is something to
//! pop); the producers' bell rings after every pop (there is space) and after `next` moved
//! (a held gap may now fit).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use crossbeam_queue::ArrayQueue;

use crate::item::{Chunk, Item};
use crate::sync::Doorbell;

/// The outcome of [`DedupSender::offer`].
#[derive(Debug, Clone, PartialEq)]
pub enum Offer<P> {
    /// New sequence numbers were claimed and queued; the first `trimmed_rows` rows of the
    /// element were already in and were cut off (0 when it was entirely new).
    Accepted { trimmed_rows: u64 },
    /// Every sequence number of the element was already accepted: dropped.
    Duplicate,
    /// The element starts after `expected`, the first sequence number still missing. It is
    /// handed back untouched: hold it and offer it again once the gap is filled.
    Gap { expected: u64, item: Item<P> },
    /// The queue has no room. Nothing was claimed; the element is handed back: wait on
    /// [`DedupSender::producer_bell`] and offer it again.
    Full(Item<P>),
}

/// State shared by every sender of one logical channel and its receiver.
struct Shared<P> {
    /// First sequence number not yet claimed (the high-water mark).
    next: AtomicU64,
    /// Capacity permits still free; a producer takes one *before* claiming.
    permits: AtomicUsize,
    queue: ArrayQueue<Item<P>>,
    consumer_bell: Arc<Doorbell>,
    producer_bell: Doorbell,
    /// Rung with the consumer bell when something is accepted (see [`channel_watched`]).
    arrival_bell: Option<Arc<Doorbell>>,
}

/// The producing side of one logical channel, shared by the I/O threads of every upstream
/// replica (cheap to clone; `Send + Sync`).
pub struct DedupSender<P> {
    shared: Arc<Shared<P>>,
}

impl<P> Clone for DedupSender<P> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

/// The consuming side of one logical channel: yields every sequence number exactly once,
/// in order. There is exactly one receiver per channel.
pub struct DedupReceiver<P> {
    shared: Arc<Shared<P>>,
    /// First sequence number not yet returned by [`DedupReceiver::pop`].
    delivered: u64,
    /// Elements popped from the queue ahead of their turn (at most one per concurrent
    /// producer), kept until the element they follow arrives.
    reorder: Vec<Item<P>>,
    /// A [`channel_parked`] channel not yet unparked: nothing was taken.
    parked: bool,
}

/// Create one logical channel: a sender to clone into every upstream connection and the
/// receiver the merge consumes. `capacity` (clamped to at least 1) bounds the number of
/// queued elements; `consumer_bell` rings whenever something becomes available to pop
/// (share one bell among all the channels a merge reads).
pub fn channel<P: Chunk + Send>(
    capacity: usize,
    consumer_bell: Arc<Doorbell>,
) -> (DedupSender<P>, DedupReceiver<P>) {
    channel_from(0, capacity, consumer_bell)
}

/// A logical channel whose sequence numbers before `start` count as already delivered: the
/// channel of a replica rebuilt from a twin's cut, which consumed everything before it.
pub fn channel_from<P: Chunk + Send>(
    start: u64,
    capacity: usize,
    consumer_bell: Arc<Doorbell>,
) -> (DedupSender<P>, DedupReceiver<P>) {
    channel_watched(start, capacity, consumer_bell, None)
}

/// [`channel_from`] whose accepted elements also ring `arrival_bell`: a bell of a few
/// channels only, for a thread that waits for *their* arrivals while the consumer bell is
/// shared by every channel of a worker (the KaZoo leader of one task partition).
pub fn channel_watched<P: Chunk + Send>(
    start: u64,
    capacity: usize,
    consumer_bell: Arc<Doorbell>,
    arrival_bell: Option<Arc<Doorbell>>,
) -> (DedupSender<P>, DedupReceiver<P>) {
    let capacity = capacity.max(1);
    let shared = Arc::new(Shared {
        next: AtomicU64::new(start),
        permits: AtomicUsize::new(capacity),
        queue: ArrayQueue::new(capacity),
        consumer_bell,
        producer_bell: Doorbell::new(),
        arrival_bell,
    });
    (
        DedupSender {
            shared: Arc::clone(&shared),
        },
        DedupReceiver {
            shared,
            delivered: start,
            reorder: Vec::new(),
            parked: false,
        },
    )
}

/// A logical channel that takes nothing until [`DedupReceiver::unpark`] says where it
/// starts: the channel of a replica that is set up before the cut it starts from is taken
/// (a partition a live rescale adds, built at the switch from its predecessors' cuts). It
/// has no capacity permit, so every offer is handed back ([`Offer::Full`], or
/// [`Offer::Gap`] past seq 0) and held by its sender until the unpark rings the producer
/// bell.
pub fn channel_parked<P: Chunk + Send>(
    capacity: usize,
    consumer_bell: Arc<Doorbell>,
    arrival_bell: Option<Arc<Doorbell>>,
) -> (DedupSender<P>, DedupReceiver<P>) {
    let (tx, mut rx) = channel_watched(0, capacity, consumer_bell, arrival_bell);
    tx.shared.permits.store(0, Ordering::Release);
    rx.parked = true;
    (tx, rx)
}

impl<P: Chunk> DedupSender<P> {
    /// Offer one element received from any upstream replica. Never blocks; see [`Offer`]
    /// for what happened to it.
    pub fn offer(&self, item: Item<P>) -> Offer<P> {
        let shared = &*self.shared;
        let start = item.first_seq();
        // Saturating: a corrupt seq near u64::MAX must not wrap around into "new".
        let end = start.saturating_add(item.seq_len());
        let mut next = shared.next.load(Ordering::Acquire);
        if end <= next {
            return Offer::Duplicate;
        }
        if start > next {
            return Offer::Gap {
                expected: next,
                item,
            };
        }
        if !self.take_permit() {
            return Offer::Full(item);
        }
        // Holding a permit: claim [next, end) or find out that someone else got there first.
        loop {
            match shared
                .next
                .compare_exchange_weak(next, end, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break,
                Err(now) => {
                    next = now;
                    if end <= next || start > next {
                        // Lost the race for all of it (or a gap opened, which cannot happen
                        // as `next` only grows, but the check keeps the claim sound).
                        self.give_back_permit();
                        return if end <= next {
                            Offer::Duplicate
                        } else {
                            Offer::Gap {
                                expected: next,
                                item,
                            }
                        };
                    }
                }
            }
        }
        let trimmed = next - start;
        let claimed = match item {
            Item::Data { first_seq, payload } if trimmed > 0 => {
                // `trimmed < rows` here because `end > next`; both fit in usize as they are
                // bounded by the payload's row count.
                let offset = trimmed as usize;
                let len = payload.rows() - offset;
                Item::Data {
                    first_seq: first_seq + trimmed,
                    payload: payload.slice(offset, len),
                }
            }
            other => other,
        };
        // The permit guarantees room: every queued element holds one.
        if shared.queue.push(claimed).is_err() {
            unreachable!("dedup queue full although a capacity permit was held");
        }
        shared.consumer_bell.ring();
        shared.producer_bell.ring();
        if let Some(bell) = &shared.arrival_bell {
            bell.ring();
        }
        Offer::Accepted {
            trimmed_rows: trimmed,
        }
    }

    /// First sequence number not yet accepted (the high-water mark).
    pub fn next_seq(&self) -> u64 {
        self.shared.next.load(Ordering::Acquire)
    }

    /// Rings when there is new space in the queue or the high-water mark advanced: wait on
    /// it after [`Offer::Full`] or [`Offer::Gap`].
    pub fn producer_bell(&self) -> &Doorbell {
        &self.shared.producer_bell
    }

    fn take_permit(&self) -> bool {
        self.shared
            .permits
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |p| p.checked_sub(1))
            .is_ok()
    }

    fn give_back_permit(&self) {
        self.shared.permits.fetch_add(1, Ordering::AcqRel);
        // Another producer may have seen Full because of the permit held here.
        self.shared.producer_bell.ring();
    }
}

impl<P: Chunk> DedupReceiver<P> {
    /// The next element in sequence order, or `None` if it has not been accepted yet
    /// (wait on the consumer bell given to [`channel`]).
    pub fn pop(&mut self) -> Option<Item<P>> {
        if let Some(pos) = self
            .reorder
            .iter()
            .position(|i| i.first_seq() == self.delivered)
        {
            let item = self.reorder.swap_remove(pos);
            return Some(self.deliver(item));
        }
        while let Some(item) = self.shared.queue.pop() {
            self.shared.permits.fetch_add(1, Ordering::AcqRel);
            self.shared.producer_bell.ring();
            if item.first_seq() == self.delivered {
                return Some(self.deliver(item));
            }
            self.reorder.push(item);
        }
        None
    }

    /// First sequence number not yet returned by [`DedupReceiver::pop`].
    pub fn next_seq(&self) -> u64 {
        self.delivered
    }

    /// Whether this is a [`channel_parked`] channel not yet unparked.
    pub fn parked(&self) -> bool {
        self.parked
    }

    /// Start a [`channel_parked`] channel at `start`: every seq before it counts as
    /// delivered, the permits are granted and the senders holding elements are rung.
    /// Refused on a channel that is not parked (it may have taken something already).
    pub fn unpark(&mut self, start: u64) -> crate::Result<()> {
        if !self.parked() {
            return Err(crate::Error::Config(
                "unpark of a channel that is not parked".to_owned(),
            ));
        }
        self.shared.next.store(start, Ordering::Release);
        self.delivered = start;
        self.parked = false;
        self.shared
            .permits
            .store(self.shared.queue.capacity(), Ordering::Release);
        self.shared.producer_bell.ring();
        Ok(())
    }

    fn deliver(&mut self, item: Item<P>) -> Item<P> {
        self.delivered = item.first_seq().saturating_add(item.seq_len());
        item
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::item::Rows;

    fn data(first_seq: u64, len: usize) -> Item<Rows> {
        Item::rows(first_seq, len)
    }

    fn pair(capacity: usize) -> (DedupSender<Rows>, DedupReceiver<Rows>, Arc<Doorbell>) {
        let bell = Arc::new(Doorbell::new());
        let (tx, rx) = channel(capacity, Arc::clone(&bell));
        (tx, rx, bell)
    }

    #[test]
    fn first_copy_wins_and_overlap_is_trimmed_zero_copy() {
        let (tx, mut rx, _) = pair(8);
        assert_eq!(tx.offer(data(0, 10)), Offer::Accepted { trimmed_rows: 0 });
        assert_eq!(tx.offer(data(0, 4)), Offer::Duplicate);
        assert_eq!(tx.offer(data(0, 10)), Offer::Duplicate);
        assert_eq!(tx.offer(data(6, 8)), Offer::Accepted { trimmed_rows: 4 });
        assert_eq!(tx.next_seq(), 14);
        assert_eq!(rx.pop(), Some(data(0, 10)));
        // The trimmed chunk is the slice [10, 14) of the offered payload.
        assert_eq!(rx.pop(), Some(data(10, 4)));
        assert_eq!(rx.pop(), None);
        assert_eq!(rx.next_seq(), 14);
    }

    #[test]
    fn a_gap_is_never_skipped() {
        let (tx, mut rx, _) = pair(8);
        assert_eq!(tx.offer(data(0, 3)), Offer::Accepted { trimmed_rows: 0 });
        let held = data(5, 2);
        assert_eq!(
            tx.offer(held.clone()),
            Offer::Gap {
                expected: 3,
                item: held.clone()
            }
        );
        assert_eq!(tx.next_seq(), 3, "a gap must not move the high-water mark");
        assert_eq!(
            tx.offer(Item::Heartbeat { seq: 3, epoch: 1 }),
            Offer::Accepted { trimmed_rows: 0 }
        );
        assert_eq!(
            tx.offer(held.clone()),
            Offer::Gap {
                expected: 4,
                item: held.clone()
            }
        );
        assert_eq!(tx.offer(data(4, 1)), Offer::Accepted { trimmed_rows: 0 });
        assert_eq!(tx.offer(held), Offer::Accepted { trimmed_rows: 0 });
        let seqs: Vec<u64> = std::iter::from_fn(|| rx.pop())
            .map(|i| i.first_seq())
            .collect();
        assert_eq!(seqs, vec![0, 3, 4, 5]);
    }

    #[test]
    fn full_returns_the_item_without_claiming() {
        let (tx, mut rx, _) = pair(2);
        assert!(matches!(tx.offer(data(0, 1)), Offer::Accepted { .. }));
        assert!(matches!(tx.offer(data(1, 1)), Offer::Accepted { .. }));
        let bell_before = tx.producer_bell().generation();
        assert_eq!(tx.offer(data(2, 1)), Offer::Full(data(2, 1)));
        assert_eq!(tx.next_seq(), 2, "Full must not claim");
        assert_eq!(rx.pop(), Some(data(0, 1)));
        assert!(
            tx.producer_bell().generation() > bell_before,
            "a pop rings the producers"
        );
        assert!(matches!(tx.offer(data(2, 1)), Offer::Accepted { .. }));
        // A duplicate is recognised even when the queue is full: no permit needed.
        assert_eq!(tx.offer(data(0, 2)), Offer::Duplicate);
    }

    #[test]
    fn accept_rings_the_consumer_bell() {
        let (tx, _rx, bell) = pair(2);
        let seen = bell.generation();
        assert_eq!(
            tx.offer(data(0, 0)),
            Offer::Duplicate,
            "an empty chunk adds nothing"
        );
        assert_eq!(bell.generation(), seen);
        tx.offer(data(0, 1));
        assert!(bell.generation() > seen);
    }

    #[test]
    fn end_closes_the_sequence() {
        let (tx, mut rx, _) = pair(4);
        tx.offer(data(0, 2));
        assert!(matches!(
            tx.offer(Item::End { seq: 2 }),
            Offer::Accepted { .. }
        ));
        assert_eq!(tx.offer(Item::End { seq: 2 }), Offer::Duplicate);
        assert_eq!(rx.pop(), Some(data(0, 2)));
        assert_eq!(rx.pop(), Some(Item::End { seq: 2 }));
        assert_eq!(rx.pop(), None);
    }

    #[test]
    fn corrupt_seq_near_the_top_does_not_wrap() {
        let (tx, _rx, _) = pair(4);
        let huge = Item::Data {
            first_seq: u64::MAX - 1,
            payload: Rows { start: 0, len: 5 },
        };
        assert!(matches!(tx.offer(huge), Offer::Gap { expected: 0, .. }));
    }

    #[test]
    fn a_parked_channel_holds_everything_until_it_is_unparked_at_its_start() {
        let bell = Arc::new(Doorbell::new());
        let (tx, mut rx) = channel_parked::<Rows>(4, Arc::clone(&bell), None);
        assert!(rx.parked());
        assert_eq!(tx.offer(data(0, 3)), Offer::Full(data(0, 3)));
        assert!(matches!(tx.offer(data(7, 2)), Offer::Gap { .. }));
        assert_eq!(rx.pop(), None);
        let rung = tx.producer_bell().generation();
        rx.unpark(7).unwrap();
        assert!(
            tx.producer_bell().generation() > rung,
            "the held senders are rung"
        );
        assert!(!rx.parked());
        assert_eq!(
            tx.offer(data(0, 3)),
            Offer::Duplicate,
            "before the start: delivered"
        );
        assert_eq!(tx.offer(data(7, 2)), Offer::Accepted { trimmed_rows: 0 });
        for s in 9..12 {
            assert!(matches!(tx.offer(data(s, 1)), Offer::Accepted { .. }));
        }
        assert_eq!(
            tx.offer(data(12, 1)),
            Offer::Full(data(12, 1)),
            "the whole capacity"
        );
        assert_eq!(rx.pop(), Some(data(7, 2)));
        assert_eq!(rx.next_seq(), 9);
        assert!(rx.unpark(0).is_err(), "only once");
    }

    #[test]
    fn out_of_order_pushes_are_restored_by_the_receiver() {
        // Simulate two producers whose claims were pushed in the opposite order.
        let (tx, mut rx, _) = pair(4);
        tx.shared.next.store(20, Ordering::Release);
        tx.shared.permits.fetch_sub(2, Ordering::AcqRel);
        tx.shared.queue.push(data(10, 10)).unwrap();
        tx.shared.queue.push(data(0, 10)).unwrap();
        assert_eq!(rx.pop(), Some(data(0, 10)));
        assert_eq!(rx.pop(), Some(data(10, 10)));
        assert_eq!(rx.pop(), None);
        assert_eq!(tx.shared.permits.load(Ordering::Acquire), 4);
    }
}
