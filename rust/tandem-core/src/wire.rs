//! The wire codec: how elements of a channel travel between workers, and the handshake that
//! opens every connection.
//!
//! A frame is a fixed 32-byte little-endian header followed by a body:
//!
//! ```text
//! offset  size  field
//!      0     4  magic      0x544E444D ("TNDM" read as a little-endian u32)
//!      4     2  version    VERSION
//!      6     1  kind       1 = Data, 2 = Heartbeat, 3 = Order, 4 = End
//!      7     1  flags      must be 0 (reserved; a non-zero value is rejected, not ignored)
//!      8     4  channel    logical channel id
//!     12     8  first_seq  Data: seq of the first row; Heartbeat/End: their seq; Order: 0
//!     20     8  count      Data: rows; Heartbeat: epoch; Order: entries; End: 0
//!     28     4  body_len   bytes following the header
//! ```
//!
//! Bodies:
//!
//! * **Data** — an Arrow IPC *stream*: one schema message, optional dictionary batches, exactly
//!   one record batch, the end-of-stream marker. The header repeats the row count so a
//!   receiver can deduplicate (DESIGN §2, invariant 2) without trusting the body, and the
//!   decoder checks the two agree.
//! * **Heartbeat** — empty, or exactly 16 bytes: the sender's cycle digest of the channel's
//!   Data frames since its previous heartbeat ([`crate::digest`]), which the receiver
//!   compares across the replicas of the sending partition (DESIGN §2, invariant 4).
//! * **End** — empty.
//! * **Order** — `epoch u64 | version u64 | count × (channel u32 | up_to_seq u64)`, so
//!   `body_len == 16 + 12 · count`. The epoch is the KaZoo leader's fencing token.
//!
//! Decoding never panics. Every header field is checked before it is used, and a frame's
//! body is bounded (`max_frame_bytes`) before anything is allocated for it. The Arrow body is
//! decoded and validated by arrow-ipc's [`StreamDecoder`] (message framing, schema,
//! dictionaries, buffer bounds, offsets, UTF-8, dictionary keys) under an unwind guard,
//! because arrow-ipc still panics on some malformed buffer layouts and schemas instead of
//! returning an error; the few checks that remain here are what a Data frame adds to an IPC
//! stream, and are listed at [`decode_ipc`]. The body is decoded zero-copy: columns of the
//! returned batch are slices of the buffer the frame was read into.

use std::io::{self, Read, Write};

use arrow_array::RecordBatch;
use arrow_buffer::{Buffer, MutableBuffer};
use arrow_ipc::reader::StreamDecoder;
use arrow_ipc::writer::StreamWriter;
use arrow_schema::{DataType, Field};
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::digest::Digest;
use crate::error::{Error, ProtocolError, Result};
use crate::item::Item;

/// First four bytes of every frame: "TNDM" read as a little-endian `u32`.
pub const MAGIC: u32 = 0x544E_444D;
/// Wire version spoken by this build. Bumped on any incompatible change of the header,
/// a body layout or the handshake. Version 2: a heartbeat may carry a 16-byte cycle digest
/// (version 1 receivers reject a heartbeat with a body).
pub const VERSION: u16 = 2;
/// Size of the fixed frame header in bytes.
pub const HEADER_LEN: usize = 32;
/// Default limit on a frame's body (64 MiB): a corrupt or hostile length cannot make a
/// receiver allocate more than this.
pub const DEFAULT_MAX_FRAME_BYTES: u64 = 64 << 20;

/// Bytes of an Order body before its entries (epoch and version).
const ORDER_FIXED_LEN: u64 = 16;
/// Bytes of one Order entry (channel u32, up_to_seq u64).
const ORDER_ENTRY_LEN: u64 = 12;
/// Bytes of a Heartbeat body that carries a cycle digest.
pub const HEARTBEAT_DIGEST_LEN: usize = crate::digest::DIGEST_LEN;

/// What a frame carries.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FrameKind {
    /// Rows of a channel, as an Arrow IPC stream.
    Data = 1,
    /// A heartbeat marker of one epoch.
    Heartbeat = 2,
    /// A KaZoo consumption order published by a leader.
    Order = 3,
    /// The channel has ended.
    End = 4,
}

impl FrameKind {
    fn from_u8(value: u8) -> Option<Self> {
        match value {
            1 => Some(FrameKind::Data),
            2 => Some(FrameKind::Heartbeat),
            3 => Some(FrameKind::Order),
            4 => Some(FrameKind::End),
            _ => None,
        }
    }
}

/// The decoded fixed header of a frame (magic, version and flags are checked, not kept).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    pub kind: FrameKind,
    pub channel: u32,
    pub first_seq: u64,
    /// Rows for Data, epoch for Heartbeat, entries for Order, 0 for End.
    pub count: u64,
    pub body_len: u32,
}

impl FrameHeader {
    /// The header as it goes on the wire.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        out[4..6].copy_from_slice(&VERSION.to_le_bytes());
        out[6] = self.kind as u8;
        out[7] = 0;
        out[8..12].copy_from_slice(&self.channel.to_le_bytes());
        out[12..20].copy_from_slice(&self.first_seq.to_le_bytes());
        out[20..28].copy_from_slice(&self.count.to_le_bytes());
        out[28..32].copy_from_slice(&self.body_len.to_le_bytes());
        out
    }

    /// Header plus body length in bytes.
    pub fn frame_len(&self) -> usize {
        HEADER_LEN + self.body_len as usize
    }
}

/// "Consume channel `channel` up to (excluding) seq `up_to_seq`": one positional entry of a
/// KaZoo order. Entries are idempotent, so replaying an order log is harmless.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct OrderEntry {
    pub channel: u32,
    pub up_to_seq: u64,
}

/// One decoded frame.
#[derive(Clone, Debug, PartialEq)]
pub enum Frame {
    /// Rows `[first_seq, first_seq + batch.num_rows())` of `channel`.
    Data {
        channel: u32,
        first_seq: u64,
        batch: RecordBatch,
    },
    /// The heartbeat of cycle `epoch` at seq `seq` of `channel`, with the sender's digest of
    /// the channel's Data frames since its previous heartbeat if it sent one.
    Heartbeat {
        channel: u32,
        seq: u64,
        epoch: u64,
        digest: Option<Digest>,
    },
    /// A consumption order; `epoch` is the publishing leader's fencing token.
    Order {
        channel: u32,
        epoch: u64,
        version: u64,
        entries: Vec<OrderEntry>,
    },
    /// `channel` has ended; `seq` is its last seq.
    End { channel: u32, seq: u64 },
}

impl Frame {
    /// The channel id in the frame header.
    pub fn channel(&self) -> u32 {
        match self {
            Frame::Data { channel, .. }
            | Frame::Heartbeat { channel, .. }
            | Frame::Order { channel, .. }
            | Frame::End { channel, .. } => *channel,
        }
    }

    /// The channel element this frame carries, with its channel id; `None` for an Order,
    /// which is a control message of the KaZoo follower, not a channel element. A
    /// heartbeat's digest is not part of the element (the merges never look at it): read it
    /// off the frame first.
    pub fn into_item(self) -> Option<(u32, Item<RecordBatch>)> {
        match self {
            Frame::Data {
                channel,
                first_seq,
                batch,
            } => Some((
                channel,
                Item::Data {
                    first_seq,
                    payload: batch,
                },
            )),
            Frame::Heartbeat {
                channel,
                seq,
                epoch,
                ..
            } => Some((channel, Item::Heartbeat { seq, epoch })),
            Frame::End { channel, seq } => Some((channel, Item::End { seq })),
            Frame::Order { .. } => None,
        }
    }
}

fn inconsistent(msg: impl Into<String>) -> ProtocolError {
    ProtocolError::Inconsistent(msg.into())
}

// ---------------------------------------------------------------------------------------
// Encoding
// ---------------------------------------------------------------------------------------

/// Encode a Data frame (header and Arrow IPC body) for rows
/// `[first_seq, first_seq + batch.num_rows())` of `channel`.
///
/// Fails if the batch has no rows (a Data frame always advances its channel), if the seqs
/// would overflow `u64`, if the body exceeds the header's `u32` length, or if Arrow cannot
/// encode the batch.
pub fn encode_data(channel: u32, first_seq: u64, batch: &RecordBatch) -> Result<Vec<u8>> {
    let rows = batch.num_rows() as u64;
    if rows == 0 {
        return Err(inconsistent(format!(
            "refusing to encode a Data frame of 0 rows on channel {channel}: every Data frame must \
             carry at least one row; skip empty batches instead"
        ))
        .into());
    }
    if first_seq.checked_add(rows).is_none() {
        return Err(inconsistent(format!(
            "Data frame of {rows} rows at first_seq {first_seq} on channel {channel} overflows \
             the u64 sequence space"
        ))
        .into());
    }
    let mut out = vec![0u8; HEADER_LEN];
    {
        let mut writer = StreamWriter::try_new(&mut out, batch.schema_ref())?;
        writer.write(batch)?;
        writer.finish()?;
    }
    let body_len = out.len() - HEADER_LEN;
    let body_len = u32::try_from(body_len).map_err(|_| ProtocolError::Oversized {
        len: body_len as u64,
        limit: u64::from(u32::MAX),
    })?;
    let header = FrameHeader {
        kind: FrameKind::Data,
        channel,
        first_seq,
        count: rows,
        body_len,
    };
    out[..HEADER_LEN].copy_from_slice(&header.to_bytes());
    Ok(out)
}

/// Encode a Heartbeat frame without a digest: the heartbeat of cycle `epoch` at seq `seq`
/// of `channel`.
pub fn encode_heartbeat(channel: u32, seq: u64, epoch: u64) -> Vec<u8> {
    FrameHeader {
        kind: FrameKind::Heartbeat,
        channel,
        first_seq: seq,
        count: epoch,
        body_len: 0,
    }
    .to_bytes()
    .to_vec()
}

/// Encode a Heartbeat frame carrying `digest`, the sender's cycle digest of `channel`'s Data
/// frames since its previous heartbeat.
pub fn encode_heartbeat_digest(channel: u32, seq: u64, epoch: u64, digest: &Digest) -> Vec<u8> {
    let header = FrameHeader {
        kind: FrameKind::Heartbeat,
        channel,
        first_seq: seq,
        count: epoch,
        body_len: HEARTBEAT_DIGEST_LEN as u32,
    };
    let mut out = Vec::with_capacity(header.frame_len());
    out.extend_from_slice(&header.to_bytes());
    out.extend_from_slice(digest);
    out
}

/// Encode an End frame: `channel` ends with seq `seq`.
pub fn encode_end(channel: u32, seq: u64) -> Vec<u8> {
    FrameHeader {
        kind: FrameKind::End,
        channel,
        first_seq: seq,
        count: 0,
        body_len: 0,
    }
    .to_bytes()
    .to_vec()
}

/// Encode an Order frame published by the leader of `epoch`.
///
/// # Panics
/// If `entries` has more than `(u32::MAX - 16) / 12` (≈ 357 million) elements, which do not
/// fit one frame; the KaZoo publisher batches orders far below that (`kazoo.batch`).
pub fn encode_order(channel: u32, epoch: u64, version: u64, entries: &[OrderEntry]) -> Vec<u8> {
    let body_len = ORDER_FIXED_LEN + ORDER_ENTRY_LEN * entries.len() as u64;
    let body_len = u32::try_from(body_len).unwrap_or_else(|_| {
        panic!(
            "an order of {} entries does not fit one frame; split it",
            entries.len()
        )
    });
    let header = FrameHeader {
        kind: FrameKind::Order,
        channel,
        first_seq: 0,
        count: entries.len() as u64,
        body_len,
    };
    let mut out = Vec::with_capacity(header.frame_len());
    out.extend_from_slice(&header.to_bytes());
    out.extend_from_slice(&epoch.to_le_bytes());
    out.extend_from_slice(&version.to_le_bytes());
    for entry in entries {
        out.extend_from_slice(&entry.channel.to_le_bytes());
        out.extend_from_slice(&entry.up_to_seq.to_le_bytes());
    }
    out
}

// ---------------------------------------------------------------------------------------
// Decoding
// ---------------------------------------------------------------------------------------

fn le_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn le_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn le_u64(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

/// Decode and check the fixed header at the front of `buf` (which may hold more bytes).
///
/// Magic and version are checked as soon as their bytes are present, so a peer that does
/// not speak this protocol is named as such even when it sent fewer than 32 bytes. Checks:
/// flags == 0; known kind; `body_len <= max_body`; a Heartbeat body is empty or a 16-byte
/// digest; End has no body and count 0; Data has count ≥ 1, a body, and `first_seq + count` fits `u64`; an Order body is
/// exactly `16 + 12 · count` bytes and its `first_seq` is 0; a Heartbeat/End seq is below
/// `u64::MAX` (the element covers `[seq, seq + 1)`).
pub fn decode_header(buf: &[u8], max_body: u64) -> Result<FrameHeader, ProtocolError> {
    if buf.len() >= 4 {
        let magic = le_u32(buf, 0);
        if magic != MAGIC {
            return Err(ProtocolError::BadMagic {
                found: magic,
                expected: MAGIC,
            });
        }
    }
    if buf.len() >= 6 {
        let version = le_u16(buf, 4);
        if version != VERSION {
            return Err(ProtocolError::BadVersion {
                found: version,
                supported: VERSION,
            });
        }
    }
    if buf.len() < HEADER_LEN {
        return Err(ProtocolError::Truncated {
            needed: HEADER_LEN,
            got: buf.len(),
        });
    }
    let kind = FrameKind::from_u8(buf[6]).ok_or_else(|| {
        inconsistent(format!(
            "unknown frame kind {} (expected 1=data, 2=heartbeat, 3=order or 4=end)",
            buf[6]
        ))
    })?;
    let flags = buf[7];
    if flags != 0 {
        return Err(inconsistent(format!(
            "flags byte is {flags:#04x}, must be 0 in wire version {VERSION}"
        )));
    }
    let header = FrameHeader {
        kind,
        channel: le_u32(buf, 8),
        first_seq: le_u64(buf, 12),
        count: le_u64(buf, 20),
        body_len: le_u32(buf, 28),
    };
    let body_len = u64::from(header.body_len);
    if body_len > max_body {
        return Err(ProtocolError::Oversized {
            len: body_len,
            limit: max_body,
        });
    }
    let FrameHeader {
        channel,
        first_seq,
        count,
        ..
    } = header;
    match kind {
        FrameKind::Data => {
            if count == 0 {
                return Err(inconsistent(format!(
                    "Data frame on channel {channel} announces 0 rows; a Data frame carries at \
                     least one row"
                )));
            }
            if body_len == 0 {
                return Err(inconsistent(format!(
                    "Data frame on channel {channel} announces {count} rows but has an empty body"
                )));
            }
            if first_seq.checked_add(count).is_none() {
                return Err(inconsistent(format!(
                    "Data frame on channel {channel}: first_seq {first_seq} + {count} rows \
                     overflows the u64 sequence space"
                )));
            }
        }
        FrameKind::Heartbeat | FrameKind::End => {
            let name = if kind == FrameKind::End {
                "End"
            } else {
                "Heartbeat"
            };
            if kind == FrameKind::End && body_len != 0 {
                return Err(inconsistent(format!(
                    "End frame on channel {channel} has a body of {body_len} bytes, must be empty"
                )));
            }
            if kind == FrameKind::Heartbeat
                && body_len != 0
                && body_len != HEARTBEAT_DIGEST_LEN as u64
            {
                return Err(inconsistent(format!(
                    "Heartbeat frame on channel {channel} has a body of {body_len} bytes; it must \
                     be empty or hold exactly the {HEARTBEAT_DIGEST_LEN}-byte cycle digest"
                )));
            }
            if kind == FrameKind::End && count != 0 {
                return Err(inconsistent(format!(
                    "End frame on channel {channel} has count {count}, must be 0"
                )));
            }
            if first_seq == u64::MAX {
                return Err(inconsistent(format!(
                    "{name} frame on channel {channel} at seq u64::MAX leaves no room for its \
                     own seq"
                )));
            }
        }
        FrameKind::Order => {
            if first_seq != 0 {
                return Err(inconsistent(format!(
                    "Order frame on channel {channel} has first_seq {first_seq}, must be 0"
                )));
            }
            let expected = count
                .checked_mul(ORDER_ENTRY_LEN)
                .and_then(|n| n.checked_add(ORDER_FIXED_LEN));
            if expected != Some(body_len) {
                return Err(inconsistent(format!(
                    "Order frame on channel {channel} announces {count} entries, which take \
                     16 + 12 x {count} bytes, but its body is {body_len} bytes"
                )));
            }
        }
    }
    Ok(header)
}

/// Decode one frame from the front of `buf`; returns the frame and the bytes consumed.
///
/// The Data body is copied once into an aligned Arrow buffer (a borrowed slice cannot be
/// kept alive by the batch); use [`decode_frame_buffer`] to decode without any copy.
pub fn decode_frame(buf: &[u8], max_body: u64) -> Result<(Frame, usize), ProtocolError> {
    let header = decode_header(buf, max_body)?;
    let total = header.frame_len();
    if buf.len() < total {
        return Err(ProtocolError::Truncated {
            needed: total,
            got: buf.len(),
        });
    }
    let body = &buf[HEADER_LEN..total];
    let frame = match header.kind {
        FrameKind::Data => decode_body(&header, Buffer::from_slice_ref(body))?,
        _ => decode_control(&header, body)?,
    };
    Ok((frame, total))
}

/// Zero-copy variant of [`decode_frame`]: the batch of a Data frame references `buf`.
pub fn decode_frame_buffer(buf: &Buffer, max_body: u64) -> Result<(Frame, usize), ProtocolError> {
    let header = decode_header(buf.as_slice(), max_body)?;
    let total = header.frame_len();
    if buf.len() < total {
        return Err(ProtocolError::Truncated {
            needed: total,
            got: buf.len(),
        });
    }
    let body = buf.slice_with_length(HEADER_LEN, total - HEADER_LEN);
    Ok((decode_body(&header, body)?, total))
}

/// Decode the body of a frame whose header has been checked; `body` holds exactly
/// `header.body_len` bytes.
fn decode_body(header: &FrameHeader, body: Buffer) -> Result<Frame, ProtocolError> {
    match header.kind {
        FrameKind::Data => {
            let batch = decode_ipc_guarded(body, header)?;
            Ok(Frame::Data {
                channel: header.channel,
                first_seq: header.first_seq,
                batch,
            })
        }
        _ => decode_control(header, body.as_slice()),
    }
}

/// Decode a Heartbeat, End or Order frame from its checked header and its body bytes.
fn decode_control(header: &FrameHeader, body: &[u8]) -> Result<Frame, ProtocolError> {
    let channel = header.channel;
    match header.kind {
        FrameKind::Heartbeat => {
            // decode_header checked body_len is 0 or the digest length; the callers pass
            // body_len bytes.
            let digest = match body.len() {
                0 => None,
                HEARTBEAT_DIGEST_LEN => {
                    let mut d = [0u8; HEARTBEAT_DIGEST_LEN];
                    d.copy_from_slice(body);
                    Some(d)
                }
                n => {
                    return Err(inconsistent(format!(
                        "Heartbeat frame on channel {channel} has a body of {n} bytes; it must \
                         be empty or hold exactly the {HEARTBEAT_DIGEST_LEN}-byte cycle digest"
                    )))
                }
            };
            Ok(Frame::Heartbeat {
                channel,
                seq: header.first_seq,
                epoch: header.count,
                digest,
            })
        }
        FrameKind::End => Ok(Frame::End {
            channel,
            seq: header.first_seq,
        }),
        FrameKind::Order => decode_order(header, body),
        FrameKind::Data => Err(inconsistent(format!(
            "Data frame on channel {channel} reached the control-frame decoder"
        ))),
    }
}

fn decode_order(header: &FrameHeader, body: &[u8]) -> Result<Frame, ProtocolError> {
    // decode_header checked body_len == 16 + 12 * count; the callers pass body_len bytes.
    if body.len() != header.body_len as usize || body.len() < ORDER_FIXED_LEN as usize {
        return Err(ProtocolError::Truncated {
            needed: HEADER_LEN + header.body_len as usize,
            got: HEADER_LEN + body.len(),
        });
    }
    let epoch = le_u64(body, 0);
    let version = le_u64(body, 8);
    let entries = body[ORDER_FIXED_LEN as usize..]
        .chunks_exact(ORDER_ENTRY_LEN as usize)
        .map(|e| OrderEntry {
            channel: le_u32(e, 0),
            up_to_seq: le_u64(e, 4),
        })
        .collect();
    Ok(Frame::Order {
        channel: header.channel,
        epoch,
        version,
        entries,
    })
}

/// Decode an Arrow IPC body with arrow-ipc's own [`StreamDecoder`] and its validation,
/// under an unwind guard.
///
/// arrow-ipc validates what it decodes: every array it builds goes through
/// `ArrayDataBuilder::build`, which runs `ArrayData::validate_data` (buffer sizes, offsets,
/// UTF-8, dictionary keys, null counts), children before their parents, so the whole tree
/// is checked as `ArrayData::validate_full` would; unions, structs and the batch itself go
/// through `UnionArray::try_new`, `StructArray::try_new` and `RecordBatch::try_new` (every
/// column of the stream's schema type and of the batch's row count). It does not promise
/// not to panic: arrow-ipc 59 still slices and reinterprets some buffers before validating
/// them (a validity bitmap shorter than its array, union type ids and offsets shorter or
/// misaligned, a fixed-size list whose length overflows, a childless union, several
/// `unimplemented!`s in the schema conversion). The guard turns such a panic into a
/// protocol error, so one malformed frame closes one connection instead of killing the
/// worker. It needs `panic = "unwind"`, Rust's default, which no profile of the workspace
/// changes.
fn decode_ipc_guarded(body: Buffer, header: &FrameHeader) -> Result<RecordBatch, ProtocolError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| decode_ipc(body, header)))
        .unwrap_or_else(|panic| {
            let what = panic
                .downcast_ref::<&str>()
                .copied()
                .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
                .unwrap_or("a panic");
            Err(inconsistent(format!(
                "Data frame on channel {}: the Arrow IPC body is malformed (the arrow decoder \
                 panicked: {what})",
                header.channel
            )))
        })
}

/// Decode the IPC stream in `body` and return its single record batch.
///
/// arrow-ipc does the decoding and the validation: the message framing and the flatbuffer
/// verification of each message ([`StreamDecoder`]: a second schema, a batch before the
/// schema, a message type other than schema, dictionary or record batch, and bytes after
/// the end-of-stream marker are its errors), the schema, the dictionaries and the arrays.
/// What stays here is what a Data frame adds to an IPC stream, and what tandem needs of a
/// batch that arrow does not check:
///
/// * the stream ends with the end-of-stream marker, and holds exactly one record batch;
/// * the batch has the row count the frame header announced, on which deduplication
///   already relied before the body was decoded;
/// * no field name or time zone contains a NUL byte: the batch reaches Python through the
///   Arrow C Data Interface, where both are C strings (a time zone is part of the type's
///   format string);
/// * no timestamp has an empty time zone: arrow decodes `""` to a type its writer encodes
///   differently (the time zone of a naive timestamp is omitted), so the frame would not
///   survive a round trip.
///
/// The body length was bounded by the frame header (`max_frame_bytes`) before a byte of it
/// was read, and everything arrow-ipc allocates is bounded by it: buffers are slices of the
/// body (copied at most once, to align them), and compressed bodies, whose announced
/// uncompressed size is not, are refused by arrow-ipc itself because tandem builds it
/// without the lz4 and zstd codecs.
fn decode_ipc(body: Buffer, header: &FrameHeader) -> Result<RecordBatch, ProtocolError> {
    let channel = header.channel;
    let bad = |what: String| inconsistent(format!("Data frame on channel {channel}: {what}"));
    let arrow = |e: arrow_schema::ArrowError| bad(format!("Arrow IPC body: {e}"));
    // Buffers inside the body are 8-byte aligned relative to its start (and the flatbuffer
    // verifier checks the alignment of the metadata); make the start aligned too, a no-op
    // for bodies read by FrameReader or copied by decode_frame.
    let body = if body.as_ptr().align_offset(8) == 0 {
        body
    } else {
        Buffer::from_slice_ref(body.as_slice())
    };
    let mut decoder = StreamDecoder::new();
    let mut rest = body.clone();
    let mut batch = None;
    while !rest.is_empty() {
        if let Some(b) = decoder.decode(&mut rest).map_err(arrow)? {
            if batch.replace(b).is_some() {
                return Err(bad(
                    "Arrow IPC body holds more than one record batch (exactly one per Data \
                     frame)"
                        .into(),
                ));
            }
        }
    }
    // finish() accepts a stream that ended with its end-of-stream marker, and one cut at a
    // message boundary; only a decoder that has read the marker refuses another byte (any
    // byte: the body's first, never empty in a Data frame, is at hand without an allocation).
    decoder.finish().map_err(arrow)?;
    if decoder.decode(&mut body.slice_with_length(0, 1)).is_ok() {
        return Err(bad(
            "Arrow IPC body does not end with the end-of-stream marker".into(),
        ));
    }
    let batch = batch.ok_or_else(|| bad("Arrow IPC body holds no record batch".into()))?;
    if batch.num_rows() as u64 != header.count {
        return Err(bad(format!(
            "header announces {} rows but the Arrow batch has {}",
            header.count,
            batch.num_rows()
        )));
    }
    for field in batch.schema_ref().fields() {
        check_field(field).map_err(|e| bad(format!("Arrow IPC schema: {e}")))?;
    }
    Ok(batch)
}

/// What tandem asks of a decoded field beyond arrow's validation (see [`decode_ipc`]), for
/// the field and every field nested in its type.
fn check_field(field: &Field) -> Result<(), String> {
    let name = field.name();
    if name.contains('\0') {
        return Err(format!("field name {name:?} contains a NUL byte"));
    }
    check_type(name, field.data_type())
}

fn check_type(name: &str, data_type: &DataType) -> Result<(), String> {
    match data_type {
        DataType::Timestamp(_, Some(tz)) if tz.is_empty() => Err(format!(
            "field {name:?} has an empty time zone (omit it for a naive timestamp)"
        )),
        DataType::Timestamp(_, Some(tz)) if tz.contains('\0') => Err(format!(
            "field {name:?} has a time zone containing a NUL byte"
        )),
        DataType::List(child)
        | DataType::LargeList(child)
        | DataType::ListView(child)
        | DataType::LargeListView(child)
        | DataType::FixedSizeList(child, _)
        | DataType::Map(child, _) => check_field(child),
        DataType::Struct(fields) => fields.iter().try_for_each(|f| check_field(f)),
        DataType::Union(fields, _) => fields.iter().try_for_each(|(_, f)| check_field(f)),
        DataType::RunEndEncoded(run_ends, values) => {
            check_field(run_ends)?;
            check_field(values)
        }
        DataType::Dictionary(_, values) => check_type(name, values),
        _ => Ok(()),
    }
}

// ---------------------------------------------------------------------------------------
// Reading frames off a stream
// ---------------------------------------------------------------------------------------

/// Reads frames off a byte stream (a `TcpStream`). `Ok(None)` on clean EOF at a frame
/// boundary; EOF inside a frame is [`ProtocolError::Truncated`].
///
/// The body is read straight into a 64-byte-aligned Arrow buffer, and the batch of a Data
/// frame is decoded zero-copy from it.
///
/// A read that fails with `WouldBlock`, `TimedOut` or `Interrupted` loses nothing: the
/// bytes read so far are kept and the next call to [`FrameReader::next_frame`] resumes the
/// same frame, so a socket read timeout can be used to poll. After a protocol error the
/// stream is out of step and the connection must be dropped.
pub struct FrameReader<R: Read> {
    inner: R,
    max_frame_bytes: u64,
    header: [u8; HEADER_LEN],
    header_got: usize,
    /// The frame whose body is being read, its body buffer and the body bytes read so far.
    body: Option<(FrameHeader, MutableBuffer, usize)>,
}

impl<R: Read> FrameReader<R> {
    /// `max_frame_bytes` bounds a frame's body (the header's 32 bytes do not count): a
    /// larger announced body is rejected as [`ProtocolError::Oversized`] before anything is
    /// allocated.
    pub fn new(inner: R, max_frame_bytes: u64) -> Self {
        FrameReader {
            inner,
            max_frame_bytes,
            header: [0u8; HEADER_LEN],
            header_got: 0,
            body: None,
        }
    }

    /// The wrapped stream.
    pub fn get_ref(&self) -> &R {
        &self.inner
    }

    /// The wrapped stream, mutably (e.g. to change its timeouts).
    pub fn get_mut(&mut self) -> &mut R {
        &mut self.inner
    }

    /// Read the next frame; `Ok(None)` when the stream ends cleanly between frames.
    pub fn next_frame(&mut self) -> Result<Option<Frame>> {
        Ok(self.next_frame_unless(|_| false)?.map(|next| match next {
            Next::Frame(f) => f,
            Next::Skipped(_) => unreachable!("nothing is skipped"),
        }))
    }

    /// Read the next frame, but once a Data frame's bytes are all in, leave its body
    /// undecoded if `skip(header)` says so (a receiver that already holds every row it
    /// covers): [`Next::Skipped`]. Its header was checked; its body never is.
    pub fn next_frame_unless(
        &mut self,
        skip: impl FnOnce(&FrameHeader) -> bool,
    ) -> Result<Option<Next>> {
        if self.body.is_none() {
            while self.header_got < HEADER_LEN {
                let n = match self.inner.read(&mut self.header[self.header_got..]) {
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e.into()),
                };
                if n == 0 {
                    let got = std::mem::take(&mut self.header_got);
                    if got == 0 {
                        return Ok(None);
                    }
                    return Err(ProtocolError::Truncated {
                        needed: HEADER_LEN,
                        got,
                    }
                    .into());
                }
                self.header_got += n;
                if self.header_got < HEADER_LEN {
                    // Fail fast on a peer that does not speak the protocol.
                    if let Err(
                        e @ (ProtocolError::BadMagic { .. } | ProtocolError::BadVersion { .. }),
                    ) = decode_header(&self.header[..self.header_got], self.max_frame_bytes)
                    {
                        self.header_got = 0;
                        return Err(e.into());
                    }
                }
            }
            self.header_got = 0;
            let header = decode_header(&self.header, self.max_frame_bytes)?;
            let body = MutableBuffer::from_len_zeroed(header.body_len as usize);
            self.body = Some((header, body, 0));
        }
        if let Some((header, body, got)) = self.body.as_mut() {
            while *got < body.len() {
                let n = match self.inner.read(&mut body.as_slice_mut()[*got..]) {
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e.into()),
                };
                if n == 0 {
                    let (needed, got) = (header.frame_len(), HEADER_LEN + *got);
                    self.body = None;
                    return Err(ProtocolError::Truncated { needed, got }.into());
                }
                *got += n;
            }
        }
        let Some((header, body, _)) = self.body.take() else {
            return Ok(None);
        };
        if header.kind == FrameKind::Data && skip(&header) {
            return Ok(Some(Next::Skipped(header)));
        }
        let frame = decode_body(&header, body.into())?;
        Ok(Some(Next::Frame(frame)))
    }
}

/// What [`FrameReader::next_frame_unless`] read.
#[derive(Debug)]
pub enum Next {
    /// A frame, decoded and checked.
    Frame(Frame),
    /// A Data frame read but left undecoded, by the caller's choice.
    Skipped(FrameHeader),
}

// ---------------------------------------------------------------------------------------
// Handshake
// ---------------------------------------------------------------------------------------

/// Who is on the other end of a connection.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Identity {
    pub job: String,
    pub task: u32,
    pub partition: u32,
    pub replica: u32,
}

/// Longest job id accepted in a handshake, in bytes of UTF-8.
pub const MAX_JOB_ID_LEN: usize = 256;
/// Bytes of each side's random nonce.
const NONCE_LEN: usize = 32;
/// Bytes of an HMAC-SHA256 tag.
const MAC_LEN: usize = 32;
/// Longest reject reason sent to a refused client.
const MAX_REASON_LEN: usize = 256;
/// Status byte the server sends after checking the client's proof.
const STATUS_ACCEPT: u8 = 0;
const STATUS_REJECT: u8 = 1;
/// Domain-separation labels so a client proof can never be replayed as a server proof.
const CLIENT_LABEL: &[u8] = b"tandem-handshake-client-v1";
const SERVER_LABEL: &[u8] = b"tandem-handshake-server-v1";

type HmacSha256 = Hmac<Sha256>;

/// The canonical bytes of an identity inside the MAC: job length (u16), job, task,
/// partition, replica (u32 each, little-endian).
fn identity_bytes(id: &Identity) -> Vec<u8> {
    let mut out = Vec::with_capacity(2 + id.job.len() + 12);
    out.extend_from_slice(&(id.job.len() as u16).to_le_bytes());
    out.extend_from_slice(id.job.as_bytes());
    out.extend_from_slice(&id.task.to_le_bytes());
    out.extend_from_slice(&id.partition.to_le_bytes());
    out.extend_from_slice(&id.replica.to_le_bytes());
    out
}

fn proof(secret: &[u8], label: &[u8], first: &[u8], second: &[u8], id: &[u8]) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(secret).expect("HMAC accepts keys of any length");
    mac.update(label);
    mac.update(first);
    mac.update(second);
    mac.update(id);
    mac
}

fn check_secret(secret: &[u8]) -> Result<()> {
    if secret.is_empty() {
        return Err(Error::Config(
            "the job secret is empty; give every worker of the job the same non-empty secret"
                .into(),
        ));
    }
    Ok(())
}

fn nonce() -> Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).map_err(|e| {
        Error::Io(io::Error::other(format!(
            "no randomness for a handshake nonce: {e}"
        )))
    })?;
    Ok(n)
}

/// Read exactly `buf.len()` bytes of the handshake step `what`, naming the step on failure.
/// I/O errors keep their kind (a `TimedOut`/`WouldBlock` from a socket timeout stays one) so
/// the caller can tell a silent peer from a refused one.
fn read_step<S: Read>(stream: &mut S, buf: &mut [u8], what: &str) -> Result<()> {
    stream.read_exact(buf).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => Error::Handshake(format!(
            "the peer closed the connection while sending {what}"
        )),
        kind => Error::Io(io::Error::new(
            kind,
            format!("handshake: reading {what}: {e}"),
        )),
    })
}

fn write_step<S: Write>(stream: &mut S, bytes: &[u8], what: &str) -> Result<()> {
    stream
        .write_all(bytes)
        .and_then(|()| stream.flush())
        .map_err(|e| {
            Error::Io(io::Error::new(
                e.kind(),
                format!("handshake: sending {what}: {e}"),
            ))
        })
}

fn check_preamble(buf: &[u8], who: &str) -> Result<()> {
    let magic = le_u32(buf, 0);
    if magic != MAGIC {
        return Err(Error::Handshake(format!(
            "the {who} sent {magic:#010x} instead of tandem's magic {MAGIC:#010x}: it does not \
             speak tandem's wire protocol"
        )));
    }
    let version = le_u16(buf, 4);
    if version != VERSION {
        return Err(Error::Handshake(format!(
            "the {who} speaks wire version {version}, this build speaks {VERSION}; run the same \
             tandem version on every worker"
        )));
    }
    Ok(())
}

/// Client side: proves knowledge of the per-job secret (challenge-response, HMAC-SHA256 over
/// the server's nonce, job and identity; constant-time compare). Err(Error::Handshake) if
/// refused. The server proves knowledge of the secret back, so a client never streams data
/// into an impostor.
///
/// Exchange (all integers little-endian):
/// 1. server → client: `magic u32 | version u16 | server_nonce [32]`
/// 2. client → server: `magic u32 | version u16 | job_len u16 | job | task u32 |
///    partition u32 | replica u32 | client_nonce [32] |
///    HMAC(secret, client label | server_nonce | client_nonce | identity)`
/// 3. server → client: `0 | HMAC(secret, server label | client_nonce | server_nonce |
///    identity)` to accept, or `1 | reason_len u16 | reason` to refuse.
pub fn client_handshake<S: Read + Write>(
    stream: &mut S,
    me: &Identity,
    secret: &[u8],
) -> Result<()> {
    check_secret(secret)?;
    if me.job.len() > MAX_JOB_ID_LEN {
        return Err(Error::Config(format!(
            "job id of {} bytes is longer than the {MAX_JOB_ID_LEN} bytes the handshake allows",
            me.job.len()
        )));
    }
    let mut hello = [0u8; 6 + NONCE_LEN];
    read_step(stream, &mut hello, "its hello")?;
    check_preamble(&hello, "server")?;
    let server_nonce = &hello[6..];
    let client_nonce = nonce()?;
    let id = identity_bytes(me);
    let tag = proof(secret, CLIENT_LABEL, server_nonce, &client_nonce, &id)
        .finalize()
        .into_bytes();
    let mut msg = Vec::with_capacity(6 + id.len() + NONCE_LEN + MAC_LEN);
    msg.extend_from_slice(&MAGIC.to_le_bytes());
    msg.extend_from_slice(&VERSION.to_le_bytes());
    msg.extend_from_slice(&id);
    msg.extend_from_slice(&client_nonce);
    msg.extend_from_slice(&tag);
    write_step(stream, &msg, "the client proof")?;

    let mut status = [0u8; 1];
    read_step(stream, &mut status, "the handshake verdict")?;
    match status[0] {
        STATUS_ACCEPT => {
            let mut server_tag = [0u8; MAC_LEN];
            read_step(stream, &mut server_tag, "the server proof")?;
            proof(secret, SERVER_LABEL, &client_nonce, server_nonce, &id)
                .verify_slice(&server_tag)
                .map_err(|_| {
                    Error::Handshake(format!(
                        "the server accepted job {:?} but could not prove it knows the job \
                         secret: it is not a worker of this job",
                        me.job
                    ))
                })
        }
        STATUS_REJECT => {
            let mut len = [0u8; 2];
            read_step(stream, &mut len, "the reject reason")?;
            let len = usize::from(u16::from_le_bytes(len));
            if len > MAX_REASON_LEN {
                return Err(Error::Handshake(format!(
                    "the server refused the connection with an over-long reason ({len} bytes)"
                )));
            }
            let mut reason = vec![0u8; len];
            read_step(stream, &mut reason, "the reject reason")?;
            Err(Error::Handshake(format!(
                "the server refused the connection: {}",
                String::from_utf8_lossy(&reason)
            )))
        }
        other => Err(Error::Handshake(format!(
            "the server answered with status byte {other:#04x} (expected 0 = accept, 1 = reject)"
        ))),
    }
}

/// Server side: sends a fresh nonce, checks the client's proof and job id; on failure tells
/// the client why (one short reject message) and returns Err(Error::Handshake(..)). Does not
/// hang forever on a silent peer when the caller has set socket timeouts: a read that times
/// out (`WouldBlock`/`TimedOut`) is returned as [`Error::Io`] with that kind.
pub fn server_handshake<S: Read + Write>(
    stream: &mut S,
    job: &str,
    secret: &[u8],
) -> Result<Identity> {
    check_secret(secret)?;
    let server_nonce = nonce()?;
    let mut hello = Vec::with_capacity(6 + NONCE_LEN);
    hello.extend_from_slice(&MAGIC.to_le_bytes());
    hello.extend_from_slice(&VERSION.to_le_bytes());
    hello.extend_from_slice(&server_nonce);
    write_step(stream, &hello, "the server hello")?;

    let mut pre = [0u8; 8];
    read_step(stream, &mut pre, "the client preamble")?;
    if let Err(e) = check_preamble(&pre, "client") {
        return Err(reject(stream, e));
    }
    let job_len = usize::from(le_u16(&pre, 6));
    if job_len > MAX_JOB_ID_LEN {
        let msg = format!("job id of {job_len} bytes exceeds {MAX_JOB_ID_LEN}");
        return Err(reject(stream, Error::Handshake(msg)));
    }
    let mut rest = vec![0u8; job_len + 12 + NONCE_LEN + MAC_LEN];
    read_step(stream, &mut rest, "the client identity")?;
    let Ok(peer_job) = std::str::from_utf8(&rest[..job_len]) else {
        return Err(reject(
            stream,
            Error::Handshake("job id is not valid UTF-8".into()),
        ));
    };
    let ids = &rest[job_len..job_len + 12];
    let peer = Identity {
        job: peer_job.to_owned(),
        task: le_u32(ids, 0),
        partition: le_u32(ids, 4),
        replica: le_u32(ids, 8),
    };
    let client_nonce = &rest[job_len + 12..job_len + 12 + NONCE_LEN];
    let tag = &rest[job_len + 12 + NONCE_LEN..];
    if peer.job != job {
        let msg = format!("peer belongs to job {:?}, this is job {job:?}", peer.job);
        return Err(reject(stream, Error::Handshake(msg)));
    }
    let id = identity_bytes(&peer);
    if proof(secret, CLIENT_LABEL, &server_nonce, client_nonce, &id)
        .verify_slice(tag)
        .is_err()
    {
        let msg = format!(
            "peer (task {}, partition {}, replica {}) failed to prove the secret of job {job:?}",
            peer.task, peer.partition, peer.replica
        );
        return Err(reject(stream, Error::Handshake(msg)));
    }
    let server_tag = proof(secret, SERVER_LABEL, client_nonce, &server_nonce, &id)
        .finalize()
        .into_bytes();
    let mut accept = Vec::with_capacity(1 + MAC_LEN);
    accept.push(STATUS_ACCEPT);
    accept.extend_from_slice(&server_tag);
    write_step(stream, &accept, "the handshake acceptance")?;
    Ok(peer)
}

/// Tell the client why it is refused (best effort: it may already be gone), and return the
/// error for the server's caller.
fn reject<S: Write>(stream: &mut S, err: Error) -> Error {
    let reason = match &err {
        Error::Handshake(msg) => msg.as_str(),
        _ => "handshake failed",
    };
    let mut end = reason.len().min(MAX_REASON_LEN);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let reason = &reason.as_bytes()[..end];
    let mut msg = Vec::with_capacity(3 + reason.len());
    msg.push(STATUS_REJECT);
    msg.extend_from_slice(&(reason.len() as u16).to_le_bytes());
    msg.extend_from_slice(reason);
    let _ = stream.write_all(&msg).and_then(|()| stream.flush());
    err
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::{ArrayRef, DictionaryArray, Int64Array, RecordBatchOptions, StringArray};
    use arrow_schema::Schema;
    use proptest::prelude::*;
    use std::io::Cursor;
    use std::net::{TcpListener, TcpStream};
    use std::sync::mpsc;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    const MAX: u64 = DEFAULT_MAX_FRAME_BYTES;

    fn batch(rows: usize) -> RecordBatch {
        let ids = Int64Array::from_iter_values((0..rows as i64).map(|i| i * 7));
        let names =
            StringArray::from_iter((0..rows).map(|i| (i % 3 != 0).then(|| format!("n{i}"))));
        let keys: DictionaryArray<arrow_array::types::Int32Type> =
            (0..rows).map(|i| ["red", "green", "blue"][i % 3]).collect();
        RecordBatch::try_from_iter([
            ("id", Arc::new(ids) as ArrayRef),
            ("name", Arc::new(names) as ArrayRef),
            ("colour", Arc::new(keys) as ArrayRef),
        ])
        .unwrap()
    }

    fn decode_one(bytes: &[u8]) -> Frame {
        let (frame, used) = decode_frame(bytes, MAX).unwrap();
        assert_eq!(used, bytes.len());
        frame
    }

    fn expect_inconsistent(bytes: &[u8], needle: &str) {
        match decode_frame(bytes, MAX) {
            Err(ProtocolError::Inconsistent(msg)) => {
                assert!(
                    msg.contains(needle),
                    "message {msg:?} does not mention {needle:?}"
                )
            }
            other => panic!("expected Inconsistent({needle}), got {other:?}"),
        }
    }

    fn set_u64(bytes: &mut [u8], at: usize, v: u64) {
        bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
    }

    #[test]
    fn data_round_trip() {
        let b = batch(10);
        let bytes = encode_data(3, 100, &b).unwrap();
        let header = decode_header(&bytes, MAX).unwrap();
        assert_eq!(header.kind, FrameKind::Data);
        assert_eq!(
            (header.channel, header.first_seq, header.count),
            (3, 100, 10)
        );
        assert_eq!(header.frame_len(), bytes.len());
        let frame = decode_one(&bytes);
        assert_eq!(
            frame,
            Frame::Data {
                channel: 3,
                first_seq: 100,
                batch: b.clone()
            }
        );
        assert_eq!(frame.channel(), 3);
        match frame.into_item() {
            Some((
                3,
                Item::Data {
                    first_seq: 100,
                    payload,
                },
            )) => assert_eq!(payload, b),
            other => panic!("unexpected item {other:?}"),
        }
    }

    #[test]
    fn sliced_batch_round_trips_as_the_slice() {
        let b = batch(50).slice(17, 9);
        let frame = decode_one(&encode_data(0, 17, &b).unwrap());
        assert_eq!(
            frame,
            Frame::Data {
                channel: 0,
                first_seq: 17,
                batch: b
            }
        );
    }

    #[test]
    fn zero_column_batch_with_rows_round_trips() {
        let schema = Arc::new(Schema::empty());
        let opts = RecordBatchOptions::new().with_row_count(Some(4));
        let b = RecordBatch::try_new_with_options(schema, vec![], &opts).unwrap();
        let frame = decode_one(&encode_data(1, 0, &b).unwrap());
        match frame {
            Frame::Data { batch, .. } => {
                assert_eq!((batch.num_rows(), batch.num_columns()), (4, 0))
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn empty_batch_is_refused_by_the_encoder() {
        let err = encode_data(1, 0, &batch(0)).unwrap_err();
        assert!(err.to_string().contains("0 rows"), "{err}");
        let err = encode_data(1, u64::MAX - 2, &batch(5)).unwrap_err();
        assert!(err.to_string().contains("overflows"), "{err}");
    }

    #[test]
    fn control_frames_round_trip() {
        let hb = encode_heartbeat(7, 41, 9);
        assert_eq!(hb.len(), HEADER_LEN);
        assert_eq!(
            decode_one(&hb),
            Frame::Heartbeat {
                channel: 7,
                seq: 41,
                epoch: 9,
                digest: None
            }
        );
        assert_eq!(
            decode_one(&hb).into_item(),
            Some((7, Item::Heartbeat { seq: 41, epoch: 9 }))
        );
        let digest: Digest = std::array::from_fn(|i| i as u8 * 17);
        let hb = encode_heartbeat_digest(7, 41, 9, &digest);
        assert_eq!(hb.len(), HEADER_LEN + 16);
        assert_eq!(
            decode_one(&hb),
            Frame::Heartbeat {
                channel: 7,
                seq: 41,
                epoch: 9,
                digest: Some(digest)
            }
        );
        assert_eq!(
            decode_frame_buffer(&Buffer::from_vec(hb.clone()), MAX)
                .unwrap()
                .0,
            decode_one(&hb),
            "both decoders read the digest"
        );
        assert_eq!(
            decode_one(&hb).into_item(),
            Some((7, Item::Heartbeat { seq: 41, epoch: 9 })),
            "the element is the same with or without a digest"
        );
        let end = encode_end(2, 1000);
        assert_eq!(
            decode_one(&end),
            Frame::End {
                channel: 2,
                seq: 1000
            }
        );
        assert_eq!(
            decode_one(&end).into_item(),
            Some((2, Item::End { seq: 1000 }))
        );
        let entries = [
            OrderEntry {
                channel: 0,
                up_to_seq: 10,
            },
            OrderEntry {
                channel: 1,
                up_to_seq: u64::MAX,
            },
        ];
        let order = encode_order(5, 3, 77, &entries);
        assert_eq!(order.len(), HEADER_LEN + 16 + 24);
        let frame = decode_one(&order);
        assert_eq!(
            frame,
            Frame::Order {
                channel: 5,
                epoch: 3,
                version: 77,
                entries: entries.to_vec()
            }
        );
        assert_eq!(frame.into_item(), None);
        let empty = encode_order(5, 3, 78, &[]);
        assert_eq!(
            decode_one(&empty),
            Frame::Order {
                channel: 5,
                epoch: 3,
                version: 78,
                entries: vec![]
            }
        );
    }

    #[test]
    fn decode_consumes_one_frame_of_many() {
        let mut bytes = encode_heartbeat(1, 2, 3);
        bytes.extend(encode_end(1, 3));
        let (frame, used) = decode_frame(&bytes, MAX).unwrap();
        assert_eq!(
            (frame, used),
            (
                Frame::Heartbeat {
                    channel: 1,
                    seq: 2,
                    epoch: 3,
                    digest: None
                },
                HEADER_LEN
            )
        );
        assert_eq!(
            decode_one(&bytes[used..]),
            Frame::End { channel: 1, seq: 3 }
        );
    }

    #[test]
    fn zero_copy_decode_references_the_input_buffer() {
        let bytes = Buffer::from_vec(encode_data(0, 0, &batch(64)).unwrap());
        let (frame, _) = decode_frame_buffer(&bytes, MAX).unwrap();
        let Frame::Data { batch, .. } = frame else {
            panic!("not data")
        };
        let values = batch.column(0).to_data().buffers()[0].as_ptr() as usize;
        let range = bytes.as_ptr() as usize..bytes.as_ptr() as usize + bytes.len();
        assert!(
            range.contains(&values),
            "column 0 was copied out of the frame buffer"
        );
    }

    #[test]
    fn truncated() {
        let bytes = encode_data(0, 0, &batch(3)).unwrap();
        assert_eq!(
            decode_frame(&bytes[..10], MAX).unwrap_err(),
            ProtocolError::Truncated {
                needed: HEADER_LEN,
                got: 10
            }
        );
        assert_eq!(
            decode_frame(&bytes[..bytes.len() - 1], MAX).unwrap_err(),
            ProtocolError::Truncated {
                needed: bytes.len(),
                got: bytes.len() - 1
            }
        );
        assert_eq!(
            decode_frame(&[], MAX).unwrap_err(),
            ProtocolError::Truncated { needed: 32, got: 0 }
        );
    }

    #[test]
    fn bad_magic_and_version() {
        let mut bytes = encode_heartbeat(0, 0, 0);
        bytes[0] = b'G';
        assert!(matches!(
            decode_frame(&bytes, MAX),
            Err(ProtocolError::BadMagic {
                expected: MAGIC,
                ..
            })
        ));
        // Detected from the first four bytes alone.
        assert!(matches!(
            decode_frame(b"GET / HTTP/1.1", MAX),
            Err(ProtocolError::BadMagic { .. })
        ));
        let mut bytes = encode_heartbeat(0, 0, 0);
        bytes[4] = 9;
        assert_eq!(
            decode_frame(&bytes, MAX).unwrap_err(),
            ProtocolError::BadVersion {
                found: 9,
                supported: VERSION
            }
        );
    }

    #[test]
    fn oversized() {
        let bytes = encode_data(0, 0, &batch(100)).unwrap();
        let len = (bytes.len() - HEADER_LEN) as u64;
        assert_eq!(
            decode_frame(&bytes, 100).unwrap_err(),
            ProtocolError::Oversized { len, limit: 100 }
        );
        assert!(decode_frame(&bytes, len).is_ok());
    }

    #[test]
    fn inconsistent_headers() {
        let mut b = encode_heartbeat(0, 0, 0);
        b[6] = 9;
        expect_inconsistent(&b, "unknown frame kind 9");
        let mut b = encode_heartbeat(0, 0, 0);
        b[7] = 1;
        expect_inconsistent(&b, "flags");
        // A heartbeat body is empty or a 16-byte digest: 4, 15 and 17 bytes are refused.
        for len in [4u8, 15, 17] {
            let mut b = encode_heartbeat(0, 0, 0);
            b[28] = len;
            b.extend(vec![0u8; len as usize]);
            expect_inconsistent(
                &b,
                &format!("body of {len} bytes; it must be empty or hold exactly the 16-byte"),
            );
        }
        let mut b = encode_end(0, 0);
        b[28] = 16;
        b.extend([0u8; 16]);
        expect_inconsistent(
            &b,
            "End frame on channel 0 has a body of 16 bytes, must be empty",
        );
        let mut b = encode_end(0, 0);
        set_u64(&mut b, 20, 3);
        expect_inconsistent(&b, "count 3");
        expect_inconsistent(&encode_end(0, u64::MAX), "u64::MAX");
        let mut b = encode_order(
            0,
            1,
            1,
            &[OrderEntry {
                channel: 0,
                up_to_seq: 1,
            }],
        );
        set_u64(&mut b, 20, 2);
        expect_inconsistent(&b, "announces 2 entries");
        let mut b = encode_order(0, 1, 1, &[]);
        set_u64(&mut b, 12, 5);
        expect_inconsistent(&b, "first_seq 5");
        let mut b = encode_order(0, 1, 1, &[]);
        set_u64(&mut b, 20, u64::MAX);
        expect_inconsistent(&b, "announces");
    }

    #[test]
    fn inconsistent_data_frames() {
        let good = encode_data(4, 10, &batch(5)).unwrap();
        let mut b = good.clone();
        set_u64(&mut b, 20, 6);
        expect_inconsistent(&b, "header announces 6 rows but the Arrow batch has 5");
        let mut b = good.clone();
        set_u64(&mut b, 20, 0);
        expect_inconsistent(&b, "0 rows");
        let mut b = good.clone();
        set_u64(&mut b, 12, u64::MAX - 1);
        expect_inconsistent(&b, "overflows");
        let mut b = FrameHeader {
            kind: FrameKind::Data,
            channel: 0,
            first_seq: 0,
            count: 1,
            body_len: 0,
        }
        .to_bytes()
        .to_vec();
        expect_inconsistent(&b, "empty body");
        // Garbage body under a well-formed header.
        b[28] = 16;
        b.extend([0xAB; 16]);
        expect_inconsistent(&b, "Arrow IPC body");
        // Trailing bytes after the end-of-stream marker.
        let mut b = good.clone();
        b.extend([0xFF, 0xFF, 0xFF, 0xFF, 0, 0, 0, 0]);
        let body_len = (b.len() - HEADER_LEN) as u32;
        b[28..32].copy_from_slice(&body_len.to_le_bytes());
        expect_inconsistent(&b, "Unexpected EOS");
        // No end-of-stream marker.
        let mut b = good.clone();
        b.truncate(b.len() - 8);
        let body_len = (b.len() - HEADER_LEN) as u32;
        b[28..32].copy_from_slice(&body_len.to_le_bytes());
        expect_inconsistent(&b, "end-of-stream");
    }

    #[test]
    fn names_the_c_data_interface_cannot_carry_are_refused() {
        let field = arrow_schema::Field::new("a\0b", DataType::Int64, false);
        let b = RecordBatch::try_new(
            Arc::new(Schema::new(vec![field])),
            vec![Arc::new(Int64Array::from(vec![1, 2])) as ArrayRef],
        )
        .unwrap();
        expect_inconsistent(&encode_data(0, 0, &b).unwrap(), "NUL byte");
    }

    /// Replace the only occurrence of `from` in `bytes` by `to` (same length).
    fn patch(bytes: &mut [u8], from: &[u8], to: &[u8]) {
        let at: Vec<usize> = bytes
            .windows(from.len())
            .enumerate()
            .filter(|(_, w)| *w == from)
            .map(|(i, _)| i)
            .collect();
        assert_eq!(at.len(), 1, "{from:?} occurs {} times", at.len());
        bytes[at[0]..at[0] + to.len()].copy_from_slice(to);
    }

    /// The values themselves are validated by arrow (the decoder must never skip its
    /// validation): UTF-8 at the top level and nested in a struct and in dictionary values,
    /// dictionary keys, and string offsets.
    #[test]
    fn arrow_validation_rejects_invalid_values() {
        let strings = || -> ArrayRef { Arc::new(StringArray::from(vec!["ok", "QQQQQQQQ", "ok"])) };
        let strukt: ArrayRef = Arc::new(arrow_array::StructArray::from(vec![(
            Arc::new(arrow_schema::Field::new("s", DataType::Utf8, false)),
            strings(),
        )]));
        let dict: ArrayRef = Arc::new(
            DictionaryArray::<arrow_array::types::Int32Type>::try_new(
                arrow_array::Int32Array::from(vec![0, 1, 2]),
                strings(),
            )
            .unwrap(),
        );
        let utf8 = |col: ArrayRef| {
            let b = RecordBatch::try_from_iter([("c", col)]).unwrap();
            let mut bytes = encode_data(0, 0, &b).unwrap();
            decode_one(&bytes);
            patch(&mut bytes, b"QQQQQQQQ", &[0xFF; 8]);
            expect_inconsistent(&bytes, "UTF8");
        };
        utf8(strings());
        utf8(strukt);
        utf8(dict);

        let keys = arrow_array::Int32Array::from(vec![2, 1, 2]);
        let dict = DictionaryArray::try_new(keys, strings()).unwrap();
        let b = RecordBatch::try_from_iter([("d", Arc::new(dict) as ArrayRef)]).unwrap();
        let mut bytes = encode_data(0, 0, &b).unwrap();
        decode_one(&bytes);
        patch(
            &mut bytes,
            &[2, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0],
            &[2, 0, 0, 0, 9, 0, 0, 0],
        );
        expect_inconsistent(&bytes, "out of bounds");

        let b = RecordBatch::try_from_iter([("c", strings())]).unwrap();
        let mut bytes = encode_data(0, 0, &b).unwrap();
        // Offsets 0, 2, 10, 12: the last one points past the 12-byte value buffer.
        patch(
            &mut bytes,
            &[0, 0, 0, 0, 2, 0, 0, 0, 10, 0, 0, 0, 12, 0, 0, 0],
            &[0, 0, 0, 0, 2, 0, 0, 0, 10, 0, 0, 0, 99, 0, 0, 0],
        );
        expect_inconsistent(&bytes, "larger than values length");
    }

    #[test]
    fn two_batches_in_one_frame_are_refused() {
        let b = batch(2);
        let mut body = Vec::new();
        {
            let mut w = StreamWriter::try_new(&mut body, b.schema_ref()).unwrap();
            w.write(&b).unwrap();
            w.write(&b).unwrap();
            w.finish().unwrap();
        }
        let header = FrameHeader {
            kind: FrameKind::Data,
            channel: 0,
            first_seq: 0,
            count: 2,
            body_len: body.len() as u32,
        };
        let mut bytes = header.to_bytes().to_vec();
        bytes.extend(body);
        expect_inconsistent(&bytes, "more than one record batch");
    }

    /// Inputs the fuzz target in `fuzz/` found. arrow-ipc 59 still panics on five of them: the
    /// unwind guard must turn each into an error. The empty time zone and the time zone with
    /// a NUL byte decode (the latter then panics in the C Data Interface export), and are
    /// refused by tandem's own checks.
    #[test]
    fn fuzz_regressions_are_rejected_without_panicking() {
        let cases: [(&str, &[u8], &str); 7] = [
            (
                "short validity bitmap",
                include_bytes!("../fuzz/regressions/short-validity-bitmap"),
                "the arrow decoder panicked",
            ),
            (
                "offsets not whole elements",
                include_bytes!("../fuzz/regressions/offsets-not-whole-elements"),
                "the arrow decoder panicked",
            ),
            (
                "misaligned union offsets",
                include_bytes!("../fuzz/regressions/misaligned-union-offsets"),
                "the arrow decoder panicked",
            ),
            (
                "fixed-size list length overflow",
                include_bytes!("../fuzz/regressions/fixed-size-list-overflow"),
                "the arrow decoder panicked",
            ),
            (
                "empty time zone",
                include_bytes!("../fuzz/regressions/empty-time-zone"),
                "empty time zone",
            ),
            (
                "childless union as dictionary values",
                include_bytes!("../fuzz/regressions/childless-union"),
                "the arrow decoder panicked",
            ),
            (
                "NUL byte in a time zone",
                include_bytes!("../fuzz/regressions/nul-in-time-zone"),
                "time zone containing a NUL byte",
            ),
        ];
        for (name, bytes, needle) in cases {
            match decode_frame(bytes, MAX) {
                Err(ProtocolError::Inconsistent(msg)) => {
                    assert!(msg.contains(needle), "{name}: {msg}")
                }
                other => panic!("{name}: expected Inconsistent, got {other:?}"),
            }
        }
    }

    /// Hands out the bytes of `data` in the chunk sizes of `pattern` (cycled).
    struct Chunked {
        data: Vec<u8>,
        pos: usize,
        pattern: Vec<usize>,
        step: usize,
        would_block_every: Option<usize>,
    }

    impl Read for Chunked {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.step += 1;
            if let Some(k) = self.would_block_every {
                if self.step % k == 0 {
                    return Err(io::ErrorKind::WouldBlock.into());
                }
            }
            let want = self.pattern[self.step % self.pattern.len()];
            let n = want.min(buf.len()).min(self.data.len() - self.pos);
            buf[..n].copy_from_slice(&self.data[self.pos..self.pos + n]);
            self.pos += n;
            Ok(n)
        }
    }

    fn stream_of_frames() -> (Vec<u8>, Vec<Frame>) {
        let b = batch(6);
        let entries = [OrderEntry {
            channel: 1,
            up_to_seq: 9,
        }];
        let parts = [
            encode_heartbeat_digest(0, 0, 1, &[0xD1; 16]),
            encode_data(0, 1, &b).unwrap(),
            encode_order(0, 2, 1, &entries),
            encode_end(0, 7),
        ];
        let frames = vec![
            Frame::Heartbeat {
                channel: 0,
                seq: 0,
                epoch: 1,
                digest: Some([0xD1; 16]),
            },
            Frame::Data {
                channel: 0,
                first_seq: 1,
                batch: b,
            },
            Frame::Order {
                channel: 0,
                epoch: 2,
                version: 1,
                entries: entries.to_vec(),
            },
            Frame::End { channel: 0, seq: 7 },
        ];
        (parts.concat(), frames)
    }

    fn read_all<R: Read>(mut reader: FrameReader<R>) -> Result<Vec<Frame>> {
        let mut out = Vec::new();
        loop {
            match reader.next_frame() {
                Ok(Some(f)) => out.push(f),
                Ok(None) => return Ok(out),
                Err(Error::Io(e)) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
    }

    #[test]
    fn frame_reader_split_at_every_byte_boundary() {
        let (bytes, frames) = stream_of_frames();
        for split in 0..=bytes.len() {
            let first = split.max(1);
            let r = Chunked {
                data: bytes.clone(),
                pos: 0,
                pattern: vec![usize::MAX, first],
                step: 0,
                would_block_every: None,
            };
            assert_eq!(
                read_all(FrameReader::new(r, MAX)).unwrap(),
                frames,
                "split at {split}"
            );
        }
        let r = Chunked {
            data: bytes.clone(),
            pos: 0,
            pattern: vec![1],
            step: 0,
            would_block_every: Some(3),
        };
        assert_eq!(
            read_all(FrameReader::new(r, MAX)).unwrap(),
            frames,
            "byte by byte, with WouldBlock"
        );
    }

    #[test]
    fn frame_reader_eof_inside_a_frame_is_truncated() {
        let (bytes, _) = stream_of_frames();
        for cut in 1..bytes.len() {
            let mut reader = FrameReader::new(Cursor::new(bytes[..cut].to_vec()), MAX);
            let result = loop {
                match reader.next_frame() {
                    Ok(Some(_)) => continue,
                    other => break other,
                }
            };
            let boundaries = [48, 48 + encode_data(0, 1, &batch(6)).unwrap().len()];
            if boundaries.contains(&cut) || cut == bytes.len() - 32 {
                assert!(
                    matches!(result, Ok(None)),
                    "cut at frame boundary {cut}: {result:?}"
                );
            } else {
                assert!(
                    matches!(
                        result,
                        Err(Error::Protocol(ProtocolError::Truncated { .. }))
                    ),
                    "cut at {cut}: {result:?}"
                );
            }
        }
    }

    #[test]
    fn frame_reader_rejects_garbage_and_oversized() {
        let mut r = FrameReader::new(Cursor::new(b"HTTP/1.1 200 OK\r\n".to_vec()), MAX);
        assert!(matches!(
            r.next_frame(),
            Err(Error::Protocol(ProtocolError::BadMagic { .. }))
        ));
        let bytes = encode_data(0, 0, &batch(100)).unwrap();
        let mut r = FrameReader::new(Cursor::new(bytes), 64);
        assert!(matches!(
            r.next_frame(),
            Err(Error::Protocol(ProtocolError::Oversized { limit: 64, .. }))
        ));
    }

    // ----- handshake -----

    fn ident(job: &str) -> Identity {
        Identity {
            job: job.into(),
            task: 3,
            partition: 1,
            replica: 2,
        }
    }

    /// One end of an in-memory duplex pipe.
    struct Pipe {
        rx: mpsc::Receiver<Vec<u8>>,
        tx: mpsc::Sender<Vec<u8>>,
        pending: Vec<u8>,
        timeout: Duration,
    }

    fn pipe_pair() -> (Pipe, Pipe) {
        let (atx, brx) = mpsc::channel();
        let (btx, arx) = mpsc::channel();
        let t = Duration::from_secs(5);
        (
            Pipe {
                rx: arx,
                tx: atx,
                pending: Vec::new(),
                timeout: t,
            },
            Pipe {
                rx: brx,
                tx: btx,
                pending: Vec::new(),
                timeout: t,
            },
        )
    }

    impl Read for Pipe {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if self.pending.is_empty() {
                match self.rx.recv_timeout(self.timeout) {
                    Ok(bytes) => self.pending = bytes,
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        return Err(io::ErrorKind::TimedOut.into())
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(0),
                }
            }
            let n = buf.len().min(self.pending.len());
            buf[..n].copy_from_slice(&self.pending[..n]);
            self.pending.drain(..n);
            Ok(n)
        }
    }

    impl Write for Pipe {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.tx
                .send(buf.to_vec())
                .map_err(|_| io::Error::from(io::ErrorKind::BrokenPipe))?;
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn tcp_pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        for s in [&client, &server] {
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        }
        (client, server)
    }

    /// Run both sides; returns (client result, server result).
    fn run<S: Read + Write + Send + 'static>(
        mut client: S,
        mut server: S,
        client_job: &str,
        client_secret: &'static [u8],
        server_secret: &'static [u8],
    ) -> (Result<()>, Result<Identity>) {
        let me = ident(client_job);
        let c = std::thread::spawn(move || client_handshake(&mut client, &me, client_secret));
        let s = server_handshake(&mut server, "job-a", server_secret);
        drop(server);
        (c.join().unwrap(), s)
    }

    fn check_outcomes<S: Read + Write + Send + 'static>(pair: impl Fn() -> (S, S)) {
        let (c, s) = pair();
        let (cr, sr) = run(c, s, "job-a", b"s3cret", b"s3cret");
        cr.unwrap();
        assert_eq!(sr.unwrap(), ident("job-a"));

        let (c, s) = pair();
        let (cr, sr) = run(c, s, "job-a", b"wrong", b"s3cret");
        let msg = sr.unwrap_err().to_string();
        assert!(msg.contains("failed to prove the secret"), "{msg}");
        let msg = cr.unwrap_err().to_string();
        assert!(
            msg.contains("refused") && msg.contains("failed to prove"),
            "{msg}"
        );

        let (c, s) = pair();
        let (cr, sr) = run(c, s, "job-b", b"s3cret", b"s3cret");
        assert!(
            matches!(sr, Err(Error::Handshake(ref m)) if m.contains("\"job-b\"")),
            "{sr:?}"
        );
        assert!(
            matches!(cr, Err(Error::Handshake(ref m)) if m.contains("job-a")),
            "{cr:?}"
        );

        // A client that answers the hello with garbage is refused with a reason.
        let (mut c, mut s) = pair();
        let garbage = std::thread::spawn(move || {
            let mut hello = [0u8; 6 + NONCE_LEN];
            c.read_exact(&mut hello).unwrap();
            c.write_all(&[0x5A; 200]).unwrap();
            let mut status = [0u8; 1];
            c.read_exact(&mut status).unwrap();
            status[0]
        });
        let err = server_handshake(&mut s, "job-a", b"s3cret").unwrap_err();
        assert!(
            matches!(err, Error::Handshake(ref m) if m.contains("magic")),
            "{err}"
        );
        assert_eq!(garbage.join().unwrap(), STATUS_REJECT);
    }

    #[test]
    fn handshake_over_pipes() {
        check_outcomes(pipe_pair);
    }

    #[test]
    fn handshake_over_tcp() {
        check_outcomes(tcp_pair);
    }

    #[test]
    fn server_rejects_garbage_and_client_rejects_impostor() {
        let (mut c, mut s) = tcp_pair();
        let garbage = std::thread::spawn(move || {
            let mut hello = [0u8; 38];
            c.read_exact(&mut hello).unwrap();
            c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
            let mut reply = Vec::new();
            let _ = c.read_to_end(&mut reply);
            reply
        });
        let err = server_handshake(&mut s, "job-a", b"k").unwrap_err();
        assert!(err.to_string().contains("does not speak tandem"), "{err}");
        drop(s);
        let reply = garbage.join().unwrap();
        assert_eq!(reply[0], STATUS_REJECT);

        // A server that does not know the secret cannot fake acceptance.
        let (mut c, mut s) = tcp_pair();
        let impostor = std::thread::spawn(move || {
            let mut hello = vec![];
            hello.extend_from_slice(&MAGIC.to_le_bytes());
            hello.extend_from_slice(&VERSION.to_le_bytes());
            hello.extend_from_slice(&[7u8; 32]);
            s.write_all(&hello).unwrap();
            let mut proof = vec![0u8; 8 + 5 + 12 + 64];
            s.read_exact(&mut proof).unwrap();
            s.write_all(&[STATUS_ACCEPT]).unwrap();
            s.write_all(&[0u8; 32]).unwrap();
        });
        let err = client_handshake(&mut c, &ident("job-a"), b"k").unwrap_err();
        assert!(err.to_string().contains("could not prove"), "{err}");
        impostor.join().unwrap();

        // A non-tandem server.
        let (mut c, mut s) = tcp_pair();
        s.write_all(&[0x42; 64]).unwrap();
        let err = client_handshake(&mut c, &ident("job-a"), b"k").unwrap_err();
        assert!(
            matches!(err, Error::Handshake(ref m) if m.contains("magic")),
            "{err}"
        );
    }

    #[test]
    fn handshake_field_limits() {
        let (mut c, _s) = tcp_pair();
        let long = ident(&"j".repeat(MAX_JOB_ID_LEN + 1));
        assert!(matches!(
            client_handshake(&mut c, &long, b"k"),
            Err(Error::Config(_))
        ));
        assert!(matches!(
            client_handshake(&mut c, &ident("a"), b""),
            Err(Error::Config(_))
        ));

        let (mut c, mut s) = tcp_pair();
        let liar = std::thread::spawn(move || {
            let mut hello = [0u8; 38];
            c.read_exact(&mut hello).unwrap();
            let mut msg = MAGIC.to_le_bytes().to_vec();
            msg.extend_from_slice(&VERSION.to_le_bytes());
            msg.extend_from_slice(&u16::MAX.to_le_bytes());
            c.write_all(&msg).unwrap();
            let mut reply = Vec::new();
            let _ = c.read_to_end(&mut reply);
            reply
        });
        let err = server_handshake(&mut s, "job-a", b"k").unwrap_err();
        assert!(err.to_string().contains("65535 bytes exceeds 256"), "{err}");
        drop(s);
        assert_eq!(liar.join().unwrap()[0], STATUS_REJECT);
    }

    #[test]
    fn silent_peer_times_out() {
        let (_c, mut s) = tcp_pair();
        s.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let start = Instant::now();
        match server_handshake(&mut s, "job-a", b"k") {
            Err(Error::Io(e)) => assert!(
                matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ),
                "{e}"
            ),
            other => panic!("expected a timeout, got {other:?}"),
        }
        assert!(start.elapsed() < Duration::from_secs(3));

        let (mut c, _s) = pipe_pair();
        c.timeout = Duration::from_millis(100);
        assert!(matches!(
            client_handshake(&mut c, &ident("job-a"), b"k"),
            Err(Error::Io(ref e)) if e.kind() == io::ErrorKind::TimedOut
        ));
    }

    // ----- properties -----

    fn arb_frame() -> impl Strategy<Value = (Vec<u8>, Frame)> {
        prop_oneof![
            (
                any::<u32>(),
                0..u64::MAX,
                any::<u64>(),
                any::<Option<Digest>>()
            )
                .prop_map(|(c, s, e, d)| (
                    match &d {
                        Some(d) => encode_heartbeat_digest(c, s, e, d),
                        None => encode_heartbeat(c, s, e),
                    },
                    Frame::Heartbeat {
                        channel: c,
                        seq: s,
                        epoch: e,
                        digest: d
                    }
                )),
            (any::<u32>(), 0..u64::MAX)
                .prop_map(|(c, s)| (encode_end(c, s), Frame::End { channel: c, seq: s })),
            (
                any::<u32>(),
                any::<u64>(),
                any::<u64>(),
                prop::collection::vec((any::<u32>(), any::<u64>()), 0..20)
            )
                .prop_map(|(c, e, v, es)| {
                    let entries: Vec<OrderEntry> = es
                        .into_iter()
                        .map(|(channel, up_to_seq)| OrderEntry { channel, up_to_seq })
                        .collect();
                    (
                        encode_order(c, e, v, &entries),
                        Frame::Order {
                            channel: c,
                            epoch: e,
                            version: v,
                            entries,
                        },
                    )
                }),
            (any::<u32>(), 0..1u64 << 60, 1..40usize, 0..5usize).prop_map(|(c, s, rows, off)| {
                let b = batch(rows + off).slice(off, rows);
                (
                    encode_data(c, s, &b).unwrap(),
                    Frame::Data {
                        channel: c,
                        first_seq: s,
                        batch: b,
                    },
                )
            }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        #[test]
        fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_frame(&bytes, MAX);
            let _ = read_all(FrameReader::new(Cursor::new(bytes), MAX));
        }

        #[test]
        fn random_bytes_behind_a_valid_header_never_panic(
            kind in 1u8..=4,
            count in 0u64..64,
            body in prop::collection::vec(any::<u8>(), 0..512),
        ) {
            let h = FrameHeader { kind: FrameKind::from_u8(kind).unwrap(), channel: 0, first_seq: 0, count, body_len: body.len() as u32 };
            let mut bytes = h.to_bytes().to_vec();
            bytes.extend(body);
            let _ = decode_frame(&bytes, MAX);
        }

        #[test]
        fn mutated_data_frames_never_panic(
            rows in 1usize..20,
            flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        ) {
            let mut bytes = encode_data(0, 0, &batch(rows)).unwrap();
            for (at, v) in flips {
                let i = HEADER_LEN + at.index(bytes.len() - HEADER_LEN);
                bytes[i] = v;
            }
            let _ = decode_frame(&bytes, MAX);
        }

        #[test]
        fn valid_frames_round_trip((bytes, frame) in arb_frame()) {
            let (decoded, used) = decode_frame(&bytes, MAX).unwrap();
            prop_assert_eq!(used, bytes.len());
            prop_assert_eq!(decoded, frame.clone());
            let mut reader = FrameReader::new(Cursor::new(bytes), MAX);
            prop_assert_eq!(reader.next_frame().unwrap(), Some(frame));
            prop_assert!(reader.next_frame().unwrap().is_none());
        }

        #[test]
        fn any_truncation_is_truncated((bytes, _) in arb_frame(), cut in any::<prop::sample::Index>()) {
            let cut = cut.index(bytes.len());
            let truncated = matches!(decode_frame(&bytes[..cut], MAX), Err(ProtocolError::Truncated { .. }));
            prop_assert!(truncated);
            let mut reader = FrameReader::new(Cursor::new(bytes[..cut].to_vec()), MAX);
            let result = reader.next_frame();
            if cut == 0 {
                prop_assert!(matches!(result, Ok(None)));
            } else {
                let truncated = matches!(result, Err(Error::Protocol(ProtocolError::Truncated { .. })));
                prop_assert!(truncated);
            }
        }
    }
}
