//! The elements that flow on a logical channel, generic over the payload so the ordering
//! algorithms can be tested on plain ranges as well as on Arrow record batches.

use arrow_array::RecordBatch;

use crate::error::{Error, Result};

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

impl Item<Rows> {
    /// A data element of `len` rows numbered from `first_seq` (for tests and benchmarks of
    /// the pure algorithms).
    pub fn rows(first_seq: u64, len: usize) -> Self {
        Item::Data {
            first_seq,
            payload: Rows {
                start: first_seq,
                len,
            },
        }
    }
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

/// One channel's elements, in seq order, from its data rows given back to back in `rows`
/// (however chunked), the first seq of each data batch, its heartbeats (`(seq, epoch)`)
/// and its end marker's seq if it has ended: how a caller hands a merge many elements at
/// once. A channel's elements take consecutive seqs, so the seqs alone say where each
/// batch ends: at the next element's seq, the channel's last batch at the end of `rows`.
/// Batches are zero-copy slices of the chunks, so a chunk must not straddle two batches
/// (chunks cut like the batches, or one chunk for them all). A batch of no rows covers no
/// seq and is left out (a merge would skip it without a turn anyway).
///
/// Fails, naming the batch, if `rows` holds fewer or more rows than the batches cover, or
/// if a batch straddles two chunks. Whether the elements continue the channel (no gap,
/// no seq claimed twice) is for the caller to check, as for elements pushed one by one.
pub fn channel_elements<P: Chunk>(
    rows: impl IntoIterator<Item = P>,
    first_seqs: &[u64],
    heartbeats: &[(u64, u64)],
    end: Option<u64>,
) -> Result<Vec<Item<P>>> {
    enum Mark {
        Data(u64),
        Heartbeat(u64, u64),
        End(u64),
    }
    let seq_of = |m: &Mark| match *m {
        Mark::Data(s) | Mark::Heartbeat(s, _) | Mark::End(s) => s,
    };
    let mut marks: Vec<Mark> = first_seqs.iter().map(|&s| Mark::Data(s)).collect();
    marks.extend(heartbeats.iter().map(|&(s, e)| Mark::Heartbeat(s, e)));
    marks.extend(end.map(Mark::End));
    // Stable: elements claiming one seq keep their order, for the caller to refuse.
    marks.sort_by_key(seq_of);

    let mut chunks = rows.into_iter().filter(|c| c.rows() > 0).peekable();
    // The chunk being cut and how many of its rows are taken.
    let mut current: Option<(P, usize)> = None;
    let mut items = Vec::with_capacity(marks.len());
    for (i, mark) in marks.iter().enumerate() {
        let first_seq = match *mark {
            Mark::Data(s) => s,
            Mark::Heartbeat(seq, epoch) => {
                items.push(Item::Heartbeat { seq, epoch });
                continue;
            }
            Mark::End(seq) => {
                items.push(Item::End { seq });
                continue;
            }
        };
        if current.as_ref().is_none_or(|(c, taken)| *taken == c.rows()) {
            current = chunks.next().map(|c| (c, 0));
        }
        let left = current.as_ref().map_or(0, |(c, taken)| c.rows() - taken);
        // Up to the next element; the channel's last batch takes the rest of its chunk.
        let len = marks
            .get(i + 1)
            .map_or(left as u64, |n| seq_of(n) - first_seq);
        if len == 0 {
            continue;
        }
        if len > left as u64 {
            let why = if chunks.peek().is_some() {
                "a chunk must not straddle two batches: cut the chunks where the batches \
                 start, or pass one chunk"
            } else {
                "the rows ran out: give every batch's rows, back to back"
            };
            return Err(Error::Config(format!(
                "the batch at seq {first_seq} covers {len} rows, but only {left} are left in its \
                 chunk of the rows; {why}"
            )));
        }
        let (chunk, taken) = current.as_mut().expect("left > 0, so there is a chunk");
        items.push(Item::Data {
            first_seq,
            payload: chunk.slice(*taken, len as usize),
        });
        *taken += len as usize;
    }
    let left =
        current.map_or(0, |(c, taken)| c.rows() - taken) + chunks.map(|c| c.rows()).sum::<usize>();
    if left > 0 {
        return Err(Error::Config(format!(
            "{left} rows are left after the last batch: the seqs cover fewer rows than were \
             given, or the channel's last batch straddles two chunks"
        )));
    }
    Ok(items)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(start: u64, len: usize) -> Rows {
        Rows { start, len }
    }
    fn data(first_seq: u64, len: usize) -> Item<Rows> {
        Item::Data {
            first_seq,
            payload: rows(first_seq, len),
        }
    }

    /// The channel data(0, 2) hb(2) data(3, 2) data(5, 3) hb(8) end(9), as pushed one by one.
    fn expected() -> Vec<Item<Rows>> {
        vec![
            data(0, 2),
            Item::Heartbeat { seq: 2, epoch: 0 },
            data(3, 2),
            data(5, 3),
            Item::Heartbeat { seq: 8, epoch: 1 },
            Item::End { seq: 9 },
        ]
    }

    /// Rows whose values are their seqs, so a slice's `start` is the seq it begins at.
    /// Seq 2 is a heartbeat: the data rows are seqs 0-1 then 3-7.
    fn chunked(cuts: &[(u64, usize)]) -> Vec<Rows> {
        cuts.iter().map(|&(s, n)| rows(s, n)).collect()
    }

    #[test]
    fn batches_end_where_the_next_element_starts() {
        // One chunk per batch, in any order of the seqs given.
        let got = channel_elements(
            chunked(&[(0, 2), (3, 2), (5, 3)]),
            &[5, 0, 3],
            &[(8, 1), (2, 0)],
            Some(9),
        )
        .unwrap();
        assert_eq!(got, expected());
        for w in got.windows(2) {
            assert_eq!(w[0].end_seq(), w[1].first_seq(), "consecutive seqs");
        }
    }

    #[test]
    fn one_chunk_per_run_of_rows_is_cut_zero_copy() {
        // Rows do not know about seq 2 (a heartbeat): a chunk's rows are back to back, so
        // a Rows payload here starts at its offset in the chunk, not at its seq.
        let got = channel_elements(
            vec![rows(0, 2), rows(100, 5)],
            &[0, 3, 5],
            &[(2, 0), (8, 1)],
            Some(9),
        )
        .unwrap();
        let starts: Vec<_> = got
            .iter()
            .filter_map(|i| match i {
                Item::Data { payload, .. } => Some((payload.start, payload.len)),
                _ => None,
            })
            .collect();
        assert_eq!(starts, vec![(0, 2), (100, 2), (102, 3)]);
    }

    #[test]
    fn the_last_batch_takes_the_rest_and_empty_batches_are_left_out() {
        let got = channel_elements(vec![rows(0, 0), rows(0, 7)], &[0, 3, 3], &[], None).unwrap();
        assert_eq!(
            got,
            vec![data(0, 3), data(3, 4)],
            "the batch at 3 followed by another at 3 has no rows: left out"
        );
        let none: Vec<Item<Rows>> = channel_elements(Vec::new(), &[], &[], None).unwrap();
        assert!(none.is_empty());
        let only_end: Vec<Item<Rows>> = channel_elements(Vec::new(), &[4], &[], Some(4)).unwrap();
        assert_eq!(only_end, vec![Item::End { seq: 4 }]);
    }

    #[test]
    fn too_few_or_too_many_rows_or_a_straddling_chunk_are_refused() {
        let err = |r: Result<Vec<Item<Rows>>>| r.unwrap_err().to_string();
        let few = err(channel_elements(vec![rows(0, 3)], &[0], &[(4, 1)], None));
        assert!(
            few.contains("seq 0 covers 4 rows") && few.contains("ran out"),
            "{few}"
        );
        let many = err(channel_elements(vec![rows(0, 5)], &[0], &[(4, 1)], None));
        assert!(many.contains("1 rows are left"), "{many}");
        let straddle = err(channel_elements(
            vec![rows(0, 3), rows(3, 3)],
            &[0, 4],
            &[],
            None,
        ));
        assert!(straddle.contains("must not straddle"), "{straddle}");
        let last = err(channel_elements(
            vec![rows(0, 3), rows(3, 3)],
            &[0],
            &[],
            None,
        ));
        assert!(last.contains("3 rows are left"), "{last}");
    }

    #[test]
    fn clashing_seqs_are_kept_for_the_caller_to_refuse() {
        let none: Vec<Rows> = Vec::new();
        let got = channel_elements(none, &[], &[(0, 1), (0, 2)], None).unwrap();
        assert_eq!(
            got,
            vec![
                Item::Heartbeat { seq: 0, epoch: 1 },
                Item::Heartbeat { seq: 0, epoch: 2 }
            ],
            "both kept, in the order given: not consecutive, for the caller to refuse"
        );
        // A batch and a heartbeat at one seq: the batch would have no rows, so its row is
        // left over.
        let clash = channel_elements(vec![rows(0, 1)], &[0], &[(0, 7)], None);
        assert!(clash.unwrap_err().to_string().contains("1 rows are left"));
    }
}
