//! The frame codec: the fixed header and the frames it introduces, encoded and decoded from
//! memory. Every header field is checked here; a Data frame's body goes to [`super::ipc`].

use arrow_array::RecordBatch;
use arrow_buffer::Buffer;
use arrow_ipc::writer::StreamWriter;

use super::ipc::decode_ipc_guarded;
use super::{inconsistent, le_u16, le_u32, le_u64};
use crate::digest::Digest;
use crate::error::{ProtocolError, Result};
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
pub(super) fn decode_body(header: &FrameHeader, body: Buffer) -> Result<Frame, ProtocolError> {
    match header.kind {
        FrameKind::Data => {
            let batch = decode_ipc_guarded(body, header.channel, header.count)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::wire::test_support::*;
    use crate::wire::*;
    use arrow_array::RecordBatchOptions;
    use arrow_schema::Schema;
    use proptest::prelude::*;
    use std::io::Cursor;
    use std::sync::Arc;

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
