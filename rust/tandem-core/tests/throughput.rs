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

use arrow_array::types::Int32Type;
use arrow_array::{ArrayRef, DictionaryArray, Int64Array, RecordBatch, StringArray};
use arrow_buffer::Buffer;
use tandem_core::dedup::{channel, Offer};
use tandem_core::liverobin::LiveRobin;
use tandem_core::merge::Merge;
use tandem_core::sync::Doorbell;
use tandem_core::wire::{self, Frame};
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

/// A batch of `n` rows in three columns: an Int64, a nullable Utf8 and a dictionary of Utf8.
fn mixed_batch(n: usize) -> RecordBatch {
    let ids = Int64Array::from_iter_values((0..n as i64).map(|i| i * 7));
    let names = StringArray::from_iter((0..n).map(|i| (i % 3 != 0).then(|| format!("name-{i}"))));
    let colours: DictionaryArray<Int32Type> =
        (0..n).map(|i| ["red", "green", "blue"][i % 3]).collect();
    RecordBatch::try_from_iter([
        ("id", Arc::new(ids) as ArrayRef),
        ("name", Arc::new(names) as ArrayRef),
        ("colour", Arc::new(colours) as ArrayRef),
    ])
    .expect("valid batch")
}

/// Decoding Data frames as a receiver does (`FrameReader`: the frame in an aligned Arrow
/// buffer, the batch decoded zero-copy and validated), for small and large batches of a
/// one-column Int64 schema and of a three-column mixed schema.
#[test]
#[ignore = "throughput measurement; run with --ignored --nocapture on a release build"]
fn decode_data_frames() {
    let frames_per_round = 2000;
    for (schema, rows) in [
        ("int64", 16),
        ("int64", 1024),
        ("mixed", 16),
        ("mixed", 1024),
    ] {
        let b = if schema == "int64" {
            batch(0, rows)
        } else {
            mixed_batch(rows)
        };
        let frame = Buffer::from_vec(wire::encode_data(0, 0, &b).expect("encodes"));
        let (rows_decoded, t) = best_of(20, || {
            let mut total = 0u64;
            for _ in 0..frames_per_round {
                let (f, _) = wire::decode_frame_buffer(&frame, wire::DEFAULT_MAX_FRAME_BYTES)
                    .expect("decodes");
                match f {
                    Frame::Data { batch, .. } => total += batch.num_rows() as u64,
                    other => panic!("decoded {other:?}"),
                }
            }
            total
        });
        assert_eq!(rows_decoded, (frames_per_round * rows) as u64);
        println!(
            "decode {schema} x {rows} rows ({} bytes): {:.2} us/frame, {:.1} M rows/s",
            frame.len(),
            t.as_secs_f64() * 1e6 / frames_per_round as f64,
            rows_decoded as f64 / t.as_secs_f64() / 1e6
        );
    }
}
