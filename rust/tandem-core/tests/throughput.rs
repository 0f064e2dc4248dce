//! Throughput of the pure Rust hot path, with no Python boundary: the same workloads as
//! `benches/bench_core.py`, on Arrow record batches. Ignored by default (timing is not a
//! test); run on a release build:
//!
//! ```text
//! cargo test --release -p tandem-core --test throughput -- --ignored --nocapture
//! ```

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow_array::{Int64Array, RecordBatch};
use tandem_core::dedup::{channel, Offer};
use tandem_core::liverobin::LiveRobin;
use tandem_core::merge::Merge;
use tandem_core::sync::Doorbell;
use tandem_core::{Delivery, Item};

const BATCH_ROWS: usize = 1024;

fn batch(start: i64, n: usize) -> RecordBatch {
    let seq = Int64Array::from_iter_values(start..start + n as i64);
    RecordBatch::try_from_iter([("seq", Arc::new(seq) as _)]).expect("valid batch")
}

/// Best of `rounds` timings of `f`, which returns the rows it processed.
fn best_of(rounds: usize, mut f: impl FnMut() -> u64) -> (u64, Duration) {
    let mut best = Duration::MAX;
    let mut rows = 0;
    for _ in 0..rounds {
        let t0 = Instant::now();
        rows = f();
        best = best.min(t0.elapsed());
    }
    (rows, best)
}

fn report(name: &str, rows: u64, t: Duration) {
    println!(
        "{name}: {rows} rows in {:.2} ms = {:.1} M rows/s",
        t.as_secs_f64() * 1e3,
        rows as f64 / t.as_secs_f64() / 1e6
    );
}

#[test]
#[ignore = "throughput measurement; run with --ignored --nocapture on a release build"]
fn dedup_two_replicas_1024_row_batches() {
    let total = 1000 * BATCH_ROWS;
    let mut arrivals: Vec<(u64, RecordBatch)> = (0..total)
        .step_by(BATCH_ROWS)
        .map(|s| (s as u64, batch(s as i64, BATCH_ROWS)))
        .collect();
    arrivals.push((0, batch(0, BATCH_ROWS / 2)));
    for s in (BATCH_ROWS / 2..total).step_by(BATCH_ROWS) {
        arrivals.push((s as u64, batch(s as i64, BATCH_ROWS.min(total - s))));
    }
    arrivals.sort_by_key(|(s, _)| *s);
    let (rows, t) = best_of(20, || {
        let (tx, mut rx) = channel(1024, Arc::new(Doorbell::new()));
        let mut rows = 0;
        for (first_seq, payload) in &arrivals {
            let item = Item::Data {
                first_seq: *first_seq,
                payload: payload.clone(),
            };
            match tx.offer(item) {
                Offer::Accepted { .. } => {
                    if let Some(item) = rx.pop() {
                        rows += item.seq_len();
                    }
                }
                Offer::Duplicate => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        rows
    });
    assert_eq!(rows, total as u64);
    report("dedup (rust core)", rows, t);
}

#[test]
#[ignore = "throughput measurement; run with --ignored --nocapture on a release build"]
fn liverobin_four_channels_with_heartbeats() {
    let (channels, batches, per_cycle) = (4, 256, 8);
    let contents: Vec<Vec<Item<RecordBatch>>> = (0..channels)
        .map(|c| {
            let mut items = Vec::new();
            let mut seq = 0u64;
            for i in 0..batches {
                let payload = batch(c as i64 * 1_000_000_000 + seq as i64, BATCH_ROWS);
                items.push(Item::Data {
                    first_seq: seq,
                    payload,
                });
                seq += BATCH_ROWS as u64;
                if (i + 1) % per_cycle == 0 {
                    items.push(Item::Heartbeat {
                        seq,
                        epoch: ((i + 1) / per_cycle) as u64,
                    });
                    seq += 1;
                }
            }
            items.push(Item::End { seq });
            items
        })
        .collect();
    let (rows, t) = best_of(20, || {
        let mut inputs: Vec<VecDeque<Item<RecordBatch>>> = contents
            .iter()
            .map(|c| c.iter().cloned().collect())
            .collect();
        let mut merge = LiveRobin::new(channels);
        let mut rows = 0u64;
        loop {
            match merge.next(&mut inputs) {
                Some(Delivery::Data { payload, .. }) => rows += payload.num_rows() as u64,
                Some(Delivery::Heartbeat { .. }) => {}
                Some(Delivery::End) => break rows,
                None => panic!("stalled with every input present"),
            }
        }
    });
    assert_eq!(rows, (channels * batches * BATCH_ROWS) as u64);
    report("liverobin (rust core)", rows, t);
}
