//! The sending side of a task partition: partitioner, per-output-channel sequence numbers
//! and the flush policy (DESIGN §2 invariant 1, §5 knobs `batch_rows` and
//! `buffer_timeout_ms`).
//!
//! An output *channel* is one downstream partition. Every element put on a channel — each
//! data row, each heartbeat, the end marker — takes the channel's next `u64` sequence
//! number. Seqs are assigned when a row is emitted, in emit order; buffering only decides
//! where frame boundaries fall, which receivers do not care about (dedup and the merge
//! work on seqs). So two replicas that emit the same rows and heartbeats produce the same
//! seq → row mapping on every channel even if their flush timing differs.
//!
//! Every frame is encoded once per channel and the same `Arc<[u8]>` goes to every
//! downstream replica of that channel (duplicate sending, DESIGN §2 invariant 2).

use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type, UInt64Type, UInt8Type,
};
use arrow_array::{Array, ArrayRef, ArrowPrimitiveType, RecordBatch, UInt32Array};
use arrow_schema::{DataType, SchemaRef};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::wire;
use crate::{Error, Result};

/// Seed of the hash partitioner. Fixed forever: changing it re-routes every key, which
/// would break a job whose replicas run different builds.
pub const HASH_SEED: u64 = 0x7461_6e64_656d_0001; // "tandem" + version 1

/// The channel rows with a null key go to.
pub const NULL_KEY_CHANNEL: usize = 0;

/// Key column types the hash partitioner accepts.
pub const HASHABLE_TYPES: &str =
    "Int8/16/32/64, UInt8/16/32/64, Utf8, LargeUtf8, Binary, LargeBinary";

/// Which output channel each row goes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Partitioner {
    /// Every row to channel 0. This is the pointwise connection ("forward"): when the
    /// upstream and downstream tasks have the same partition count, partition `p` feeds only
    /// downstream partition `p`. Choosing that partition is the planner's job — it hands the
    /// outbox the links of that one downstream partition — so `Forward` requires exactly one
    /// output channel and rejects any other count as a configuration error.
    Forward,
    /// Row → `xxh3(canonical key bytes, HASH_SEED) % channels`, deterministic across
    /// processes, runs, machines and builds. Integers of every width hash their value as a
    /// little-endian 8-byte integer (so an `Int32` 7 and an `Int64` 7 go to the same
    /// channel), strings and binaries their bytes; null keys go to [`NULL_KEY_CHANNEL`].
    Hash { column: String },
    /// Row `i` of this task partition's output (a running counter over every emit) →
    /// channel `i % channels`.
    Rebalance,
    /// Every row to every channel.
    Broadcast,
}

impl Partitioner {
    /// Parse the Python-facing name (`"forward"`, `"hash"`, `"rebalance"`, `"broadcast"`).
    /// `key` is required for `"hash"` and rejected otherwise.
    pub fn parse(name: &str, key: Option<&str>) -> Result<Self> {
        match (name, key) {
            ("hash", Some(k)) if !k.is_empty() => Ok(Partitioner::Hash { column: k.to_owned() }),
            ("hash", _) => Err(Error::Config(
                "partitioner 'hash' needs key=<column name> (got no key column)".to_owned(),
            )),
            ("forward" | "rebalance" | "broadcast", Some(k)) => Err(Error::Config(format!(
                "key={k:?} is only meaningful with partitioner 'hash' (got partitioner {name:?})"
            ))),
            ("forward", None) => Ok(Partitioner::Forward),
            ("rebalance", None) => Ok(Partitioner::Rebalance),
            ("broadcast", None) => Ok(Partitioner::Broadcast),
            _ => Err(Error::Config(format!(
                "unknown partitioner {name:?}; use one of 'forward', 'hash', 'rebalance', 'broadcast'"
            ))),
        }
    }
}

/// Where the frames of one output channel go: one `Link` per downstream replica.
pub trait Link: Send {
    /// Queue one encoded frame for the peer. May block while the peer is slow (bounded
    /// queue: that is the back-pressure). An error means the peer is gone for good: the
    /// outbox drops the link and keeps serving the other replicas.
    fn send(&mut self, frame: Arc<[u8]>) -> Result<()>;

    /// Deliver what is queued and close the connection. Called by [`Outbox::close`];
    /// the default does nothing.
    fn close(&mut self) -> Result<()> {
        Ok(())
    }

    /// Cut the connection now, dropping whatever is still queued: to the peer this looks
    /// like a crash of this replica. Called by [`Outbox::abort`]; the default does nothing.
    fn abort(&mut self) {}

    /// A short description of the peer for log lines and errors.
    fn describe(&self) -> String {
        "link".to_owned()
    }
}

/// Flush policy of an [`Outbox`].
#[derive(Debug, Clone)]
pub struct OutboxConfig {
    /// A channel's buffer is sent as soon as it holds this many rows; frames never carry
    /// more rows than this. Must be ≥ 1.
    pub batch_rows: usize,
    /// Upper bound on how long a buffered row waits before it is sent (see
    /// [`Outbox::deadline`]).
    pub buffer_timeout: Duration,
}

impl Default for OutboxConfig {
    fn default() -> Self {
        OutboxConfig {
            batch_rows: 1024,
            buffer_timeout: Duration::from_millis(5),
        }
    }
}

/// One output channel: its links, its next seq and its not-yet-sent rows.
struct Channel {
    links: Vec<Box<dyn Link>>,
    /// Seq the next element emitted on this channel takes (buffered rows included).
    next_seq: u64,
    /// Buffered pieces, in emit order; they cover seqs `[next_seq - buffered_rows, next_seq)`.
    pending: Vec<RecordBatch>,
    buffered_rows: usize,
    /// When the oldest buffered row was emitted.
    oldest: Option<Instant>,
}

/// The output side of one task partition replica. See the module documentation.
pub struct Outbox {
    partitioner: Partitioner,
    channels: Vec<Channel>,
    cfg: OutboxConfig,
    /// Rows emitted so far (drives `Rebalance`).
    rows_emitted: u64,
    /// `next_seq` of every channel, kept contiguous for [`Outbox::next_seqs`].
    seqs: Vec<u64>,
    ended: bool,
}

impl Outbox {
    /// `links[c]` are the downstream replicas of output channel `c` (downstream partition
    /// `c`). Every channel needs at least one link.
    pub fn new(
        partitioner: Partitioner,
        links: Vec<Vec<Box<dyn Link>>>,
        cfg: OutboxConfig,
    ) -> Result<Self> {
        if cfg.batch_rows == 0 {
            return Err(Error::Config("batch_rows must be ≥ 1 (got 0)".to_owned()));
        }
        if links.is_empty() {
            return Err(Error::Config(
                "an outbox needs at least one output channel (got 0 channels)".to_owned(),
            ));
        }
        if let Some(c) = links.iter().position(Vec::is_empty) {
            return Err(Error::Config(format!(
                "output channel {c} has no downstream replica; give every channel at least one link"
            )));
        }
        if partitioner == Partitioner::Forward && links.len() != 1 {
            return Err(Error::Config(format!(
                "partitioner 'forward' needs exactly one output channel (the downstream partition \
                 with this partition's index), got {}; use 'hash', 'rebalance' or 'broadcast' to \
                 fan out",
                links.len()
            )));
        }
        let n = links.len();
        let channels = links
            .into_iter()
            .map(|links| Channel {
                links,
                next_seq: 0,
                pending: Vec::new(),
                buffered_rows: 0,
                oldest: None,
            })
            .collect();
        Ok(Outbox {
            partitioner,
            channels,
            cfg,
            rows_emitted: 0,
            seqs: vec![0; n],
            ended: false,
        })
    }

    /// Number of output channels.
    pub fn channels(&self) -> usize {
        self.channels.len()
    }

    /// Live links of channel `c` (links whose peer failed were dropped).
    pub fn live_links(&self, channel: usize) -> usize {
        self.channels.get(channel).map_or(0, |c| c.links.len())
    }

    /// Partition the rows of `batch` over the channels, buffer them (they take their seqs
    /// now) and send every channel whose buffer reached `batch_rows`.
    pub fn emit(&mut self, batch: &RecordBatch) -> Result<()> {
        self.check_open("emit")?;
        let rows = batch.num_rows();
        if rows == 0 {
            return Ok(());
        }
        let n = self.channels.len();
        // A schema change starts a new frame: buffered pieces of the old schema go first,
        // so a frame never mixes schemas and no seq is ever skipped.
        let mut first_err = None;
        for c in 0..n {
            let stale = self.channels[c]
                .pending
                .first()
                .is_some_and(|p| p.schema() != batch.schema());
            if stale {
                if let Err(e) = self.send_data(c, false) {
                    first_err.get_or_insert(e);
                }
            }
        }
        let now = Instant::now();
        match &self.partitioner {
            Partitioner::Forward => self.buffer(0, batch.clone(), now),
            Partitioner::Broadcast => {
                for c in 0..n {
                    self.buffer(c, batch.clone(), now);
                }
            }
            Partitioner::Hash { column } if n == 1 => {
                // Nothing to route, but a bad key is still a configuration error, whatever
                // the downstream parallelism.
                key_column(batch, column)?;
                self.buffer(0, batch.clone(), now);
            }
            Partitioner::Rebalance if n == 1 => self.buffer(0, batch.clone(), now),
            Partitioner::Rebalance => {
                let start = self.rows_emitted;
                let targets = (0..rows).map(|i| ((start + i as u64) % n as u64) as usize);
                self.scatter(batch, targets, now)?;
            }
            Partitioner::Hash { column } => {
                let targets = hash_channels(batch, column, n)?;
                self.scatter(batch, targets.iter().map(|&c| c as usize), now)?;
            }
        }
        self.rows_emitted += rows as u64;
        for c in 0..n {
            if self.channels[c].buffered_rows >= self.cfg.batch_rows {
                if let Err(e) = self.send_data(c, true) {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Send all buffered data, then one heartbeat of cycle `epoch` on every channel (each
    /// takes one seq). The heartbeat therefore follows every row emitted before it.
    pub fn heartbeat(&mut self, epoch: u64) -> Result<()> {
        self.check_open("heartbeat")?;
        self.control(|ch, seq| wire::encode_heartbeat(ch, seq, epoch))
    }

    /// Send all buffered data, then the end marker on every channel. Later calls to
    /// `emit`, `heartbeat` or `end` fail with [`Error::Closed`].
    pub fn end(&mut self) -> Result<()> {
        self.check_open("end")?;
        let res = self.control(wire::encode_end);
        self.ended = true;
        res
    }

    /// Send every buffered row now ("no more input ready": waiting would only add latency).
    pub fn flush(&mut self) -> Result<()> {
        let mut first_err = None;
        for c in 0..self.channels.len() {
            if let Err(e) = self.send_data(c, false) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// When the oldest buffered row reaches `buffer_timeout` (None if nothing is buffered).
    /// The caller sleeps at most until then and calls [`Outbox::flush_due`].
    pub fn deadline(&self) -> Option<Instant> {
        self.channels
            .iter()
            .filter_map(|c| c.oldest)
            .min()
            .map(|t| t + self.cfg.buffer_timeout)
    }

    /// Send the buffers of the channels whose oldest row has waited `buffer_timeout` by `now`.
    pub fn flush_due(&mut self, now: Instant) -> Result<()> {
        let mut first_err = None;
        for c in 0..self.channels.len() {
            let due = self.channels[c]
                .oldest
                .is_some_and(|t| t + self.cfg.buffer_timeout <= now);
            if due {
                if let Err(e) = self.send_data(c, false) {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// The seq the next element of each channel will take (buffered rows already count).
    pub fn next_seqs(&self) -> &[u64] {
        &self.seqs
    }

    /// Send what is buffered, then close every link (each delivers what it queued).
    /// Does not send the end marker: call [`Outbox::end`] first for a clean finish; closing
    /// without it looks to the receivers like a crash of this replica.
    pub fn close(&mut self) -> Result<()> {
        let res = self.flush();
        for ch in &mut self.channels {
            for mut link in ch.links.drain(..) {
                if let Err(e) = link.close() {
                    eprintln!("tandem outbox: closing {} failed: {e}", link.describe());
                }
            }
        }
        self.ended = true;
        res
    }

    /// Drop every connection at once without sending what is buffered or queued — a crash
    /// of this replica as the receivers see it (fault injection; the other replicas of this
    /// partition mask it).
    pub fn abort(&mut self) {
        for ch in &mut self.channels {
            ch.pending.clear();
            ch.buffered_rows = 0;
            ch.oldest = None;
            for mut link in ch.links.drain(..) {
                link.abort();
            }
        }
        self.ended = true;
    }

    fn check_open(&self, what: &str) -> Result<()> {
        if self.ended {
            Err(Error::Closed(format!(
                "outbox.{what}() after end() or close(); the outbox no longer sends"
            )))
        } else {
            Ok(())
        }
    }

    /// Append `piece` to channel `c`'s buffer; its rows take the next seqs.
    fn buffer(&mut self, c: usize, piece: RecordBatch, now: Instant) {
        let rows = piece.num_rows();
        if rows == 0 {
            return;
        }
        let ch = &mut self.channels[c];
        ch.pending.push(piece);
        ch.buffered_rows += rows;
        ch.next_seq += rows as u64;
        ch.oldest.get_or_insert(now);
        self.seqs[c] = ch.next_seq;
    }

    /// Route row `i` of `batch` to channel `targets[i]`: one `take` per non-empty channel.
    fn scatter(
        &mut self,
        batch: &RecordBatch,
        targets: impl Iterator<Item = usize>,
        now: Instant,
    ) -> Result<()> {
        let n = self.channels.len();
        // Counting pass first so every index vector is allocated once at its final size.
        let targets: Vec<u32> = targets.map(|c| c as u32).collect();
        let mut counts = vec![0usize; n];
        for &c in &targets {
            counts[c as usize] += 1;
        }
        if let Some(c) = counts.iter().position(|&k| k == targets.len()) {
            // Everything goes to one channel: no copy at all.
            self.buffer(c, batch.clone(), now);
            return Ok(());
        }
        let mut indices: Vec<Vec<u32>> = counts.iter().map(|&k| Vec::with_capacity(k)).collect();
        for (row, &c) in targets.iter().enumerate() {
            indices[c as usize].push(row as u32);
        }
        for (c, idx) in indices.into_iter().enumerate() {
            if idx.is_empty() {
                continue;
            }
            let piece = arrow_select::take::take_record_batch(batch, &UInt32Array::from(idx))?;
            self.buffer(c, piece, now);
        }
        Ok(())
    }

    /// Send channel `c`'s buffer as frames of at most `batch_rows` rows. With `only_full`,
    /// a remainder smaller than `batch_rows` stays buffered.
    fn send_data(&mut self, c: usize, only_full: bool) -> Result<()> {
        let batch_rows = self.cfg.batch_rows;
        let ch = &mut self.channels[c];
        if ch.buffered_rows == 0 || (only_full && ch.buffered_rows < batch_rows) {
            return Ok(());
        }
        let joined = join(&mut ch.pending)?;
        let mut first_seq = ch.next_seq - ch.buffered_rows as u64;
        let mut offset = 0;
        let total = joined.num_rows();
        let mut result = Ok(());
        while offset < total {
            let len = batch_rows.min(total - offset);
            if only_full && len < batch_rows {
                break;
            }
            let frame = match wire::encode_data(c as u32, first_seq, &joined.slice(offset, len)) {
                Ok(f) => f,
                Err(e) => {
                    // Keep the unsent rows buffered: their seqs are taken, dropping them
                    // would leave a hole receivers wait on forever.
                    result = Err(e);
                    break;
                }
            };
            if let Err(e) = send_all(c, &mut ch.links, frame.into()) {
                result = Err(e);
            }
            offset += len;
            first_seq += len as u64;
        }
        ch.buffered_rows = total - offset;
        if offset < total {
            ch.pending.push(joined.slice(offset, total - offset));
        } else {
            ch.oldest = None;
        }
        result
    }

    /// Flush data, then send one control frame (built by `encode(channel, seq)`) per
    /// channel, each taking one seq.
    fn control(&mut self, encode: impl Fn(u32, u64) -> Vec<u8>) -> Result<()> {
        let mut first_err = self.flush().err();
        for (c, ch) in self.channels.iter_mut().enumerate() {
            let frame = encode(c as u32, ch.next_seq);
            ch.next_seq += 1;
            self.seqs[c] = ch.next_seq;
            if let Err(e) = send_all(c, &mut ch.links, frame.into()) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

/// Concatenate the buffered pieces into one batch (zero-copy when there is a single piece).
/// All pieces share one schema: `emit` sends the buffer before a schema change.
fn join(pending: &mut Vec<RecordBatch>) -> Result<RecordBatch> {
    if pending.len() == 1 {
        return Ok(pending.pop().expect("one piece"));
    }
    let schema: SchemaRef = pending[0].schema();
    let joined = arrow_select::concat::concat_batches(&schema, pending.iter())?;
    pending.clear();
    Ok(joined)
}

/// Send `frame` to every link of channel `c`; a link that fails is dropped (logged). Only
/// a channel left with no live link is an error: nobody can receive its output.
fn send_all(c: usize, links: &mut Vec<Box<dyn Link>>, frame: Arc<[u8]>) -> Result<()> {
    if links.is_empty() {
        return Err(closed_channel(c));
    }
    links.retain_mut(|link| match link.send(Arc::clone(&frame)) {
        Ok(()) => true,
        Err(e) => {
            eprintln!(
                "tandem outbox: dropping {} of output channel {c}: {e}; the other replicas of that \
                 partition keep receiving",
                link.describe()
            );
            false
        }
    });
    if links.is_empty() {
        Err(closed_channel(c))
    } else {
        Ok(())
    }
}

fn closed_channel(c: usize) -> Error {
    Error::Closed(format!(
        "output channel {c} has no live downstream replica left (every link failed); its output \
         cannot be delivered"
    ))
}

/// The output channel of every row of `batch` under hash partitioning on `column`.
fn hash_channels(batch: &RecordBatch, column: &str, n: usize) -> Result<Vec<u32>> {
    let array = key_column(batch, column)?;
    let n = n as u64;
    let pick = |h: u64| (h % n) as u32;
    let mut out = Vec::with_capacity(array.len());
    fn ints<T: ArrowPrimitiveType>(
        a: &dyn Array,
        out: &mut Vec<u32>,
        canon: impl Fn(T::Native) -> [u8; 8],
        pick: impl Fn(u64) -> u32,
    ) {
        let a = a.as_primitive::<T>();
        if a.null_count() == 0 {
            out.extend(
                a.values()
                    .iter()
                    .map(|&v| pick(xxh3_64_with_seed(&canon(v), HASH_SEED))),
            );
        } else {
            out.extend(a.iter().map(|v| match v {
                Some(v) => pick(xxh3_64_with_seed(&canon(v), HASH_SEED)),
                None => NULL_KEY_CHANNEL as u32,
            }));
        }
    }
    fn bytes<'a>(
        values: impl Iterator<Item = Option<&'a [u8]>>,
        out: &mut Vec<u32>,
        pick: impl Fn(u64) -> u32,
    ) {
        out.extend(values.map(|v| match v {
            Some(v) => pick(xxh3_64_with_seed(v, HASH_SEED)),
            None => NULL_KEY_CHANNEL as u32,
        }));
    }
    let a = array.as_ref();
    match a.data_type() {
        DataType::Int8 => ints::<Int8Type>(a, &mut out, |v| i64::from(v).to_le_bytes(), pick),
        DataType::Int16 => ints::<Int16Type>(a, &mut out, |v| i64::from(v).to_le_bytes(), pick),
        DataType::Int32 => ints::<Int32Type>(a, &mut out, |v| i64::from(v).to_le_bytes(), pick),
        DataType::Int64 => ints::<Int64Type>(a, &mut out, |v| v.to_le_bytes(), pick),
        DataType::UInt8 => ints::<UInt8Type>(a, &mut out, |v| u64::from(v).to_le_bytes(), pick),
        DataType::UInt16 => ints::<UInt16Type>(a, &mut out, |v| u64::from(v).to_le_bytes(), pick),
        DataType::UInt32 => ints::<UInt32Type>(a, &mut out, |v| u64::from(v).to_le_bytes(), pick),
        DataType::UInt64 => ints::<UInt64Type>(a, &mut out, |v| v.to_le_bytes(), pick),
        DataType::Utf8 => bytes(
            a.as_string::<i32>().iter().map(|s| s.map(str::as_bytes)),
            &mut out,
            pick,
        ),
        DataType::LargeUtf8 => bytes(
            a.as_string::<i64>().iter().map(|s| s.map(str::as_bytes)),
            &mut out,
            pick,
        ),
        DataType::Binary => bytes(a.as_binary::<i32>().iter(), &mut out, pick),
        DataType::LargeBinary => bytes(a.as_binary::<i64>().iter(), &mut out, pick),
        other => return Err(unhashable(column, other)),
    }
    Ok(out)
}

/// The key column of `batch`, checked to exist and to have a hashable type.
fn key_column<'a>(batch: &'a RecordBatch, column: &str) -> Result<&'a ArrayRef> {
    let Some(array) = batch.column_by_name(column) else {
        let have: Vec<String> = batch
            .schema()
            .fields()
            .iter()
            .map(|f| format!("{} ({})", f.name(), f.data_type()))
            .collect();
        return Err(Error::Config(format!(
            "hash partitioner key column {column:?} is not in the batch; its columns are [{}]",
            have.join(", ")
        )));
    };
    use DataType::*;
    match array.data_type() {
        Int8 | Int16 | Int32 | Int64 | UInt8 | UInt16 | UInt32 | UInt64 | Utf8 | LargeUtf8
        | Binary | LargeBinary => Ok(array),
        other => Err(unhashable(column, other)),
    }
}

fn unhashable(column: &str, found: &DataType) -> Error {
    Error::Config(format!(
        "hash partitioner key column {column:?} has type {found}, which cannot be hashed; \
         supported types: {HASHABLE_TYPES}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::{BinaryArray, Int32Array, Int64Array, LargeStringArray, StringArray};
    use arrow_schema::{Field, Schema};
    use parking_lot::Mutex;

    use crate::wire::{decode_frame, Frame};

    /// In-memory link: records every frame; can be told to fail.
    #[derive(Clone, Default)]
    struct MemLink {
        frames: Arc<Mutex<Vec<Arc<[u8]>>>>,
        fail: Arc<Mutex<bool>>,
    }

    impl Link for MemLink {
        fn send(&mut self, frame: Arc<[u8]>) -> Result<()> {
            if *self.fail.lock() {
                return Err(Error::Closed("peer gone (test)".to_owned()));
            }
            self.frames.lock().push(frame);
            Ok(())
        }
    }

    impl MemLink {
        fn decoded(&self) -> Vec<Frame> {
            self.frames
                .lock()
                .iter()
                .map(|f| decode_frame(f, u64::MAX).unwrap().0)
                .collect()
        }
        /// `(kind, first_seq, rows-or-epoch, values of column "v")` per frame.
        fn summary(&self) -> Vec<(char, u64, u64, Vec<i64>)> {
            self.decoded()
                .into_iter()
                .map(|f| match f {
                    Frame::Data {
                        first_seq, batch, ..
                    } => {
                        let v = batch
                            .column(0)
                            .as_primitive::<Int64Type>()
                            .values()
                            .to_vec();
                        ('D', first_seq, batch.num_rows() as u64, v)
                    }
                    Frame::Heartbeat { seq, epoch, .. } => ('H', seq, epoch, vec![]),
                    Frame::End { seq, .. } => ('E', seq, 0, vec![]),
                    Frame::Order { .. } => panic!("outbox never sends order frames"),
                })
                .collect()
        }
    }

    fn batch(values: std::ops::Range<i64>) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, false)]));
        RecordBatch::try_new(schema, vec![Arc::new(Int64Array::from_iter_values(values))]).unwrap()
    }

    fn outbox(p: Partitioner, links: &[Vec<MemLink>], batch_rows: usize) -> Outbox {
        let links = links
            .iter()
            .map(|ch| {
                ch.iter()
                    .map(|l| Box::new(l.clone()) as Box<dyn Link>)
                    .collect()
            })
            .collect();
        let cfg = OutboxConfig {
            batch_rows,
            buffer_timeout: Duration::from_millis(5),
        };
        Outbox::new(p, links, cfg).unwrap()
    }

    fn mem(channels: usize, replicas: usize) -> Vec<Vec<MemLink>> {
        (0..channels)
            .map(|_| (0..replicas).map(|_| MemLink::default()).collect())
            .collect()
    }

    #[test]
    fn seqs_count_rows_and_markers_and_flush_on_batch_rows() {
        let links = mem(1, 1);
        let mut ob = outbox(Partitioner::Forward, &links, 4);
        ob.emit(&batch(0..3)).unwrap();
        assert!(
            links[0][0].frames.lock().is_empty(),
            "3 < batch_rows: still buffered"
        );
        assert_eq!(
            ob.next_seqs(),
            &[3],
            "buffered rows already took their seqs"
        );
        ob.emit(&batch(3..10)).unwrap();
        // 10 rows buffered → two full frames of 4, 2 rows stay.
        assert_eq!(
            links[0][0].summary(),
            vec![('D', 0, 4, vec![0, 1, 2, 3]), ('D', 4, 4, vec![4, 5, 6, 7])]
        );
        ob.heartbeat(7).unwrap();
        ob.emit(&batch(10..11)).unwrap();
        ob.end().unwrap();
        assert_eq!(
            links[0][0].summary()[2..],
            [
                ('D', 8, 2, vec![8, 9]),
                ('H', 10, 7, vec![]),
                ('D', 11, 1, vec![10]),
                ('E', 12, 0, vec![]),
            ]
        );
        assert_eq!(ob.next_seqs(), &[13]);
        assert!(matches!(ob.emit(&batch(0..1)), Err(Error::Closed(_))));
        assert!(matches!(ob.heartbeat(8), Err(Error::Closed(_))));
    }

    #[test]
    fn flush_sends_partial_buffers_and_every_replica_gets_the_same_bytes() {
        let links = mem(1, 3);
        let mut ob = outbox(Partitioner::Forward, &links, 1024);
        ob.emit(&batch(0..5)).unwrap();
        ob.emit(&batch(5..7)).unwrap();
        assert!(links[0][0].frames.lock().is_empty());
        ob.flush().unwrap();
        assert_eq!(links[0][0].summary(), vec![('D', 0, 7, (0..7).collect())]);
        let f0 = links[0][0].frames.lock()[0].clone();
        for l in &links[0][1..] {
            let f = l.frames.lock()[0].clone();
            assert!(Arc::ptr_eq(&f0, &f), "one encoding shared by every replica");
        }
        ob.flush().unwrap();
        assert_eq!(
            links[0][0].frames.lock().len(),
            1,
            "nothing buffered → nothing sent"
        );
    }

    #[test]
    fn deadline_tracks_the_oldest_buffered_row() {
        let links = mem(2, 1);
        let mut ob = outbox(Partitioner::Broadcast, &links, 1024);
        assert_eq!(ob.deadline(), None);
        let before = Instant::now();
        ob.emit(&batch(0..2)).unwrap();
        let d = ob.deadline().expect("rows buffered");
        assert!(d >= before + Duration::from_millis(5));
        assert!(d <= Instant::now() + Duration::from_millis(5));
        ob.flush_due(d - Duration::from_millis(1)).unwrap();
        assert!(links[0][0].frames.lock().is_empty(), "not due yet");
        ob.flush_due(d).unwrap();
        assert_eq!(links[0][0].summary(), vec![('D', 0, 2, vec![0, 1])]);
        assert_eq!(links[1][0].summary(), vec![('D', 0, 2, vec![0, 1])]);
        assert_eq!(ob.deadline(), None);
    }

    #[test]
    fn heartbeat_follows_all_earlier_data_on_every_channel() {
        let links = mem(3, 1);
        let mut ob = outbox(Partitioner::Rebalance, &links, 1024);
        ob.emit(&batch(0..7)).unwrap();
        ob.heartbeat(1).unwrap();
        let s0 = links[0][0].summary();
        assert_eq!(s0, vec![('D', 0, 3, vec![0, 3, 6]), ('H', 3, 1, vec![])]);
        assert_eq!(
            links[1][0].summary(),
            vec![('D', 0, 2, vec![1, 4]), ('H', 2, 1, vec![])]
        );
        assert_eq!(
            links[2][0].summary(),
            vec![('D', 0, 2, vec![2, 5]), ('H', 2, 1, vec![])]
        );
        assert_eq!(ob.next_seqs(), &[4, 3, 3]);
    }

    #[test]
    fn rebalance_counter_runs_across_emits() {
        let links = mem(2, 1);
        let mut ob = outbox(Partitioner::Rebalance, &links, 1024);
        ob.emit(&batch(0..3)).unwrap(); // rows 0,1,2 → 0,1,0
        ob.emit(&batch(3..4)).unwrap(); // row 3 → 1 (a single-channel emit: no take)
        ob.emit(&batch(4..6)).unwrap(); // rows 4,5 → 0,1
        ob.flush().unwrap();
        assert_eq!(links[0][0].summary(), vec![('D', 0, 3, vec![0, 2, 4])]);
        assert_eq!(links[1][0].summary(), vec![('D', 0, 3, vec![1, 3, 5])]);
    }

    #[test]
    fn broadcast_sends_every_row_everywhere() {
        let links = mem(2, 2);
        let mut ob = outbox(Partitioner::Broadcast, &links, 2);
        ob.emit(&batch(0..3)).unwrap();
        ob.end().unwrap();
        for ch in &links {
            for l in ch {
                assert_eq!(
                    l.summary(),
                    vec![
                        ('D', 0, 2, vec![0, 1]),
                        ('D', 2, 1, vec![2]),
                        ('E', 3, 0, vec![])
                    ]
                );
            }
        }
    }

    fn keyed(keys: Arc<dyn Array>) -> RecordBatch {
        let n = keys.len() as i64;
        let schema = Arc::new(Schema::new(vec![
            Field::new("v", DataType::Int64, false),
            Field::new("k", keys.data_type().clone(), true),
        ]));
        RecordBatch::try_new(
            schema,
            vec![Arc::new(Int64Array::from_iter_values(0..n)), keys],
        )
        .unwrap()
    }

    /// Golden vectors: these exact assignments must never change (replicas built from
    /// different versions must route every key identically).
    #[test]
    fn hash_partition_golden_vectors() {
        let ints = keyed(Arc::new(Int64Array::from_iter_values(0..16)));
        let got = hash_channels(&ints, "k", 4).unwrap();
        assert_eq!(got, GOLDEN_INT_4, "int64 keys 0..16 over 4 channels");
        // Every integer width hashes the value, not the representation.
        let i32s = keyed(Arc::new(Int32Array::from_iter_values(0..16)));
        assert_eq!(hash_channels(&i32s, "k", 4).unwrap(), GOLDEN_INT_4);
        let strs = keyed(Arc::new(StringArray::from(vec![
            Some("alice"),
            Some("bob"),
            None,
            Some(""),
            Some("carol"),
            Some("dave"),
            Some("eve"),
            Some("mallory"),
        ])));
        let got = hash_channels(&strs, "k", 3).unwrap();
        assert_eq!(got, GOLDEN_STR_3, "utf8 keys over 3 channels");
        // large_utf8 and binary hash the same bytes.
        let large = keyed(Arc::new(LargeStringArray::from(vec![
            Some("alice"),
            Some("bob"),
            None,
            Some(""),
            Some("carol"),
            Some("dave"),
            Some("eve"),
            Some("mallory"),
        ])));
        assert_eq!(hash_channels(&large, "k", 3).unwrap(), GOLDEN_STR_3);
        let bin = keyed(Arc::new(BinaryArray::from(vec![
            Some(&b"alice"[..]),
            Some(b"bob"),
            None,
            Some(b""),
            Some(b"carol"),
            Some(b"dave"),
            Some(b"eve"),
            Some(b"mallory"),
        ])));
        assert_eq!(hash_channels(&bin, "k", 3).unwrap(), GOLDEN_STR_3);
        assert_eq!(
            GOLDEN_STR_3[2], NULL_KEY_CHANNEL as u32,
            "null key → fixed channel"
        );
    }

    // Cross-checked against an independent implementation (python-xxhash 3.x):
    //   xxhash.xxh3_64_intdigest(struct.pack("<q", i), seed=HASH_SEED) % 4
    //   xxhash.xxh3_64_intdigest(s.encode(), seed=HASH_SEED) % 3
    const GOLDEN_INT_4: [u32; 16] = [3, 3, 0, 3, 2, 0, 1, 0, 3, 0, 3, 0, 3, 3, 3, 0];
    const GOLDEN_STR_3: [u32; 8] = [0, 1, 0, 1, 2, 1, 2, 1];

    #[test]
    fn hash_partition_routes_rows_and_keeps_emit_order_per_channel() {
        let links = mem(4, 1);
        let mut ob = outbox(
            Partitioner::Hash {
                column: "k".to_owned(),
            },
            &links,
            1024,
        );
        let b = keyed(Arc::new(Int64Array::from_iter_values(0..16)));
        ob.emit(&b).unwrap();
        ob.flush().unwrap();
        for (c, ch) in links.iter().enumerate() {
            let want: Vec<i64> = (0..16)
                .filter(|&i| GOLDEN_INT_4[i as usize] == c as u32)
                .collect();
            let got: Vec<i64> = ch[0].summary().into_iter().flat_map(|s| s.3).collect();
            assert_eq!(got, want, "channel {c}");
        }
    }

    #[test]
    fn hash_partition_config_errors_name_the_column_and_type() {
        let links = mem(2, 1);
        let mut ob = outbox(
            Partitioner::Hash {
                column: "nope".to_owned(),
            },
            &links,
            8,
        );
        let msg = ob.emit(&batch(0..4)).unwrap_err().to_string();
        assert!(
            msg.contains("\"nope\"") && msg.contains("v (Int64)"),
            "{msg}"
        );
        let schema = Arc::new(Schema::new(vec![Field::new("f", DataType::Float64, false)]));
        let floats = RecordBatch::try_new(
            schema,
            vec![Arc::new(arrow_array::Float64Array::from(vec![1.0, 2.0]))],
        )
        .unwrap();
        let mut ob = outbox(
            Partitioner::Hash {
                column: "f".to_owned(),
            },
            &links,
            8,
        );
        let msg = ob.emit(&floats).unwrap_err().to_string();
        assert!(
            msg.contains("\"f\"") && msg.contains("Float64") && msg.contains("Utf8"),
            "{msg}"
        );
        // One channel: nothing to route, the key is still checked.
        let one = mem(1, 1);
        let mut ob = outbox(
            Partitioner::Hash {
                column: "f".to_owned(),
            },
            &one,
            8,
        );
        assert!(matches!(ob.emit(&floats), Err(Error::Config(m)) if m.contains("Float64")));
        assert_eq!(ob.next_seqs(), &[0], "rejected rows take no seq");
    }

    #[test]
    fn dead_link_is_dropped_and_the_survivor_keeps_receiving() {
        let links = mem(2, 2);
        let mut ob = outbox(Partitioner::Broadcast, &links, 1);
        ob.emit(&batch(0..1)).unwrap();
        *links[0][0].fail.lock() = true;
        ob.emit(&batch(1..2)).unwrap();
        assert_eq!(ob.live_links(0), 1);
        assert_eq!(ob.live_links(1), 2);
        *links[0][0].fail.lock() = false; // a dropped link never comes back
        ob.emit(&batch(2..3)).unwrap();
        assert_eq!(links[0][0].frames.lock().len(), 1);
        assert_eq!(links[0][1].frames.lock().len(), 3);
        assert_eq!(links[1][0].frames.lock().len(), 3);
    }

    #[test]
    fn a_channel_with_every_link_dead_is_closed_but_others_still_receive() {
        let links = mem(2, 2);
        let mut ob = outbox(Partitioner::Broadcast, &links, 1);
        *links[1][0].fail.lock() = true;
        *links[1][1].fail.lock() = true;
        let err = ob.emit(&batch(0..1)).unwrap_err();
        assert!(
            matches!(&err, Error::Closed(m) if m.contains("channel 1")),
            "{err}"
        );
        assert_eq!(
            links[0][0].frames.lock().len(),
            1,
            "channel 0 still got its frame"
        );
        assert!(matches!(ob.heartbeat(1), Err(Error::Closed(_))));
        assert_eq!(links[0][1].summary()[1], ('H', 1, 1, vec![]));
    }

    #[test]
    fn bad_configurations_are_rejected() {
        let cfg = OutboxConfig::default();
        let none = Outbox::new(Partitioner::Rebalance, vec![], cfg.clone());
        assert!(matches!(none, Err(Error::Config(_))));
        let empty = Outbox::new(Partitioner::Rebalance, vec![vec![]], cfg.clone());
        assert!(matches!(empty, Err(Error::Config(m)) if m.contains("channel 0")));
        let two = vec![
            vec![Box::new(MemLink::default()) as Box<dyn Link>],
            vec![Box::new(MemLink::default()) as Box<dyn Link>],
        ];
        let fwd = Outbox::new(Partitioner::Forward, two, cfg);
        assert!(matches!(fwd, Err(Error::Config(m)) if m.contains("got 2")));
        let zero = OutboxConfig {
            batch_rows: 0,
            ..OutboxConfig::default()
        };
        let one = vec![vec![Box::new(MemLink::default()) as Box<dyn Link>]];
        assert!(matches!(
            Outbox::new(Partitioner::Forward, one, zero),
            Err(Error::Config(_))
        ));
        assert!(Partitioner::parse("hash", None).is_err());
        assert!(Partitioner::parse("forward", Some("k")).is_err());
        assert!(Partitioner::parse("shuffle", None)
            .unwrap_err()
            .to_string()
            .contains("shuffle"));
        assert_eq!(
            Partitioner::parse("hash", Some("k")).unwrap(),
            Partitioner::Hash {
                column: "k".to_owned()
            }
        );
    }

    #[test]
    fn schema_change_sends_the_old_buffer_first_and_keeps_seqs_contiguous() {
        let links = mem(1, 1);
        let mut ob = outbox(Partitioner::Forward, &links, 1024);
        ob.emit(&batch(0..2)).unwrap();
        let other = keyed(Arc::new(Int64Array::from_iter_values(0..3)));
        ob.emit(&other).unwrap();
        ob.flush().unwrap();
        let s = links[0][0].summary();
        assert_eq!(s, vec![('D', 0, 2, vec![0, 1]), ('D', 2, 3, vec![0, 1, 2])]);
    }
}
