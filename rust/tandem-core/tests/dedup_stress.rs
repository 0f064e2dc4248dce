//! Multi-threaded stress test of the lock-free dedup: r producer threads (one per upstream
//! replica) each offer the *whole* sequence, cut at their own random batch boundaries, into
//! one channel with a small queue; one consumer pops. Nothing may be lost, duplicated or
//! reordered, whatever the scheduling. Run it in release too:
//! `cargo test --release -p tandem-core --test dedup_stress`.

mod common;

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use common::{channel_content, replica_stream, Rng};
use tandem_core::dedup::{channel, Offer};
use tandem_core::item::Rows;
use tandem_core::sync::Doorbell;
use tandem_core::{Chunk, Item};

const WAIT: Duration = Duration::from_millis(20);

/// Rows whose slicing yields the CPU: it widens the window between claiming a range and
/// queueing it, so other producers' later claims overtake it and the receiver's reorder
/// buffer is exercised (with plain `Rows` that window is a few nanoseconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SlowRows(Rows);

impl Chunk for SlowRows {
    fn rows(&self) -> usize {
        self.0.len
    }
    fn slice(&self, offset: usize, len: usize) -> Self {
        thread::yield_now();
        SlowRows(self.0.slice(offset, len))
    }
}

fn slow(item: Item<Rows>) -> Item<SlowRows> {
    match item {
        Item::Data { first_seq, payload } => Item::Data {
            first_seq,
            payload: SlowRows(payload),
        },
        Item::Heartbeat { seq, epoch } => Item::Heartbeat { seq, epoch },
        Item::End { seq } => Item::End { seq },
    }
}

/// Offer every item of `stream`, holding it on Full or Gap until it fits.
fn produce(tx: tandem_core::dedup::DedupSender<SlowRows>, stream: Vec<Item<Rows>>) {
    for item in stream {
        let mut item = slow(item);
        loop {
            let seen = tx.producer_bell().generation();
            match tx.offer(item) {
                Offer::Accepted { .. } | Offer::Duplicate => break,
                Offer::Full(back) | Offer::Gap { item: back, .. } => {
                    item = back;
                    // Spin a little first: under contention the bell moves quickly.
                    thread::yield_now();
                    tx.producer_bell().wait(seen, WAIT);
                }
            }
        }
    }
}

fn run_once(seed: u64, replicas: usize, capacity: usize) {
    let mut rng = Rng::new(seed);
    let content = channel_content(&mut rng, 20, 60);
    let streams: Vec<_> = (0..replicas)
        .map(|_| replica_stream(&mut rng, &content, 17))
        .collect();
    let bell = Arc::new(Doorbell::new());
    let (tx, mut rx) = channel::<SlowRows>(capacity, Arc::clone(&bell));
    let producers: Vec<_> = streams
        .into_iter()
        .map(|s| {
            let tx = tx.clone();
            thread::spawn(move || produce(tx, s))
        })
        .collect();

    // Rebuild the sequence from what the consumer sees.
    let mut expected_seq = 0u64;
    let mut got = Vec::new();
    loop {
        let seen = bell.generation();
        match rx.pop() {
            Some(item) => {
                assert_eq!(
                    item.first_seq(),
                    expected_seq,
                    "seed {seed}: out of order or lost"
                );
                expected_seq = item.end_seq();
                match item {
                    Item::Data { payload, first_seq } => {
                        // Payload identity: the rows are exactly the seqs they claim.
                        assert_eq!(payload.0.start, first_seq, "seed {seed}: wrong slice");
                        got.extend(std::iter::repeat_n(common::Elem::Row, payload.rows()));
                    }
                    Item::Heartbeat { epoch, .. } => got.push(common::Elem::Heartbeat(epoch)),
                    Item::End { .. } => break,
                }
            }
            None => {
                bell.wait(seen, WAIT);
            }
        }
    }
    for p in producers {
        p.join().expect("producer panicked");
    }
    assert_eq!(
        got, content,
        "seed {seed}: consumed content differs from the channel's"
    );
    assert_eq!(rx.pop(), None, "seed {seed}: something after End");
    assert_eq!(tx.next_seq(), rx.next_seq());
}

#[test]
fn r_producers_one_consumer_no_loss_no_duplicate_no_reordering() {
    let iterations = if cfg!(debug_assertions) { 150 } else { 5000 };
    for i in 0..iterations {
        let replicas = 1 + (i % 3);
        let capacity = [1, 2, 4, 64][i % 4];
        run_once(0xD1CE_0000 + i as u64, replicas, capacity);
    }
}
