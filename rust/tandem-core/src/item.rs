//! The elements that flow on a logical channel, generic over the payload so the ordering
//! algorithms can be tested on plain ranges as well as on Arrow record batches.

use arrow_array::RecordBatch;

/// A run of rows that can be cut without copying (an Arrow `RecordBatch` is sliced
/// zero-copy; tests use plain ranges).
pub trait Chunk: Clone {
    /// Number of rows (each row takes one sequence number).
    fn rows(&self) -> usize;
    /// Rows `[offset, offset + len)`, without copying the data.
    fn slice(&self, offset: usize, len: usize) -> Self;
}

impl Chunk for RecordBatch {
    fn rows(&self) -> usize {
        self.num_rows()
    }
    fn slice(&self, offset: usize, len: usize) -> Self {
        RecordBatch::slice(self, offset, len)
    }
}

/// A half-open range of row ids, the payload used by property tests and benchmarks of the
/// pure algorithms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rows {
    pub start: u64,
    pub len: usize,
}

impl Chunk for Rows {
    fn rows(&self) -> usize {
        self.len
    }
    fn slice(&self, offset: usize, len: usize) -> Self {
        assert!(offset + len <= self.len, "slice out of range");
        Rows {
            start: self.start + offset as u64,
            len,
        }
    }
}

/// One element of a channel. Every element takes sequence numbers: a data chunk of `n`
/// rows covers `[first_seq, first_seq + n)`, a heartbeat or end marker covers one seq.
#[derive(Debug, Clone, PartialEq)]
pub enum Item<P> {
    /// Rows `[first_seq, first_seq + payload.rows())`.
    Data { first_seq: u64, payload: P },
    /// Heartbeat of cycle `epoch`, at seq `seq` of its channel.
    Heartbeat { seq: u64, epoch: u64 },
    /// The upstream partition has finished; no element follows `seq`.
    End { seq: u64 },
}

impl<P: Chunk> Item<P> {
    /// First sequence number this element covers.
    pub fn first_seq(&self) -> u64 {
        match self {
            Item::Data { first_seq, .. } => *first_seq,
            Item::Heartbeat { seq, .. } | Item::End { seq } => *seq,
        }
    }
    /// Number of sequence numbers this element covers.
    pub fn seq_len(&self) -> u64 {
        match self {
            Item::Data { payload, .. } => payload.rows() as u64,
            Item::Heartbeat { .. } | Item::End { .. } => 1,
        }
    }
    /// One past the last sequence number covered.
    pub fn end_seq(&self) -> u64 {
        self.first_seq() + self.seq_len()
    }
}

/// What a consumption order hands to the task, in the order every replica agrees on.
#[derive(Debug, Clone, PartialEq)]
pub enum Delivery<P> {
    /// Rows of logical input channel `channel`, starting at `first_seq`.
    Data {
        channel: usize,
        first_seq: u64,
        payload: P,
    },
    /// The heartbeat of cycle `epoch`, dequeued from `channel`. `first` is true the first
    /// time this epoch is seen: the task forwards it on every output channel exactly then.
    Heartbeat {
        channel: usize,
        epoch: u64,
        first: bool,
    },
    /// Every input channel has ended.
    End,
}
