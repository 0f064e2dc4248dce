//! Shared helpers of the integration tests: a seeded generator (tests stay reproducible
//! from the seed proptest prints) and builders for channel contents and replica streams.

#![allow(dead_code)]

use tandem_core::item::Rows;
use tandem_core::Item;

/// SplitMix64: tiny, seeded, good enough to pick batch boundaries and interleavings.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    pub fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
}

/// One element of a logical channel's content, before batching: a data row or a heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elem {
    Row,
    Heartbeat(u64),
}

/// The content of one logical channel: `rows_per_cycle` rows, then the cycle's heartbeat,
/// for `cycles` cycles (epochs 1..=cycles, as the heartbeat generator numbers them), then
/// a few trailing rows. Row counts vary per cycle so channels differ.
pub fn channel_content(rng: &mut Rng, cycles: u64, max_rows: usize) -> Vec<Elem> {
    let mut out = Vec::new();
    for epoch in 1..=cycles {
        for _ in 0..rng.below(max_rows + 1) {
            out.push(Elem::Row);
        }
        out.push(Elem::Heartbeat(epoch));
    }
    for _ in 0..rng.below(max_rows + 1) {
        out.push(Elem::Row);
    }
    out
}

/// How an upstream replica sends a channel's content: runs of rows cut into batches at
/// random boundaries (at most `max_batch` rows), heartbeats on their own, then End.
///
/// Under DESIGN §2 invariant 1 the batches are cut once per channel and every replica of
/// the upstream partition sends that same list (`order_props`); `dedup_stress` draws one
/// list per replica to exercise the trimming of overlapping copies as well.
pub fn replica_stream(rng: &mut Rng, content: &[Elem], max_batch: usize) -> Vec<Item<Rows>> {
    let mut out = Vec::new();
    let mut seq = 0u64;
    let mut i = 0;
    while i < content.len() {
        match content[i] {
            Elem::Heartbeat(epoch) => {
                out.push(Item::Heartbeat { seq, epoch });
                seq += 1;
                i += 1;
            }
            Elem::Row => {
                let run = content[i..].iter().take_while(|e| **e == Elem::Row).count();
                let len = 1 + rng.below(run.min(max_batch));
                out.push(Item::Data {
                    first_seq: seq,
                    payload: Rows { start: seq, len },
                });
                seq += len as u64;
                i += len;
            }
        }
    }
    out.push(Item::End { seq });
    out
}
