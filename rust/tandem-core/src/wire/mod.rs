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
//! decoded and validated by arrow-ipc's `StreamDecoder` (message framing, schema,
//! dictionaries, buffer bounds, offsets, UTF-8, dictionary keys) under an unwind guard,
//! because arrow-ipc still panics on some malformed buffer layouts and schemas instead of
//! returning an error; the few checks that remain here are what a Data frame adds to an IPC
//! stream, and are listed in `ipc.rs`. The body is decoded zero-copy: columns of the
//! returned batch are slices of the buffer the frame was read into.
//!
//! One concept per file, re-exported here: `frame.rs` (the frame codec: header, frames,
//! encoding, decoding from memory), `ipc.rs` (a Data frame's Arrow IPC body and its
//! checks), `reader.rs` ([`FrameReader`], frames off a byte stream) and `handshake.rs`
//! ([`client_handshake`], [`server_handshake`]).

mod frame;
mod handshake;
mod ipc;
mod reader;

pub use frame::{
    decode_frame, decode_frame_buffer, decode_header, encode_data, encode_end, encode_heartbeat,
    encode_heartbeat_digest, encode_order, Frame, FrameHeader, FrameKind, OrderEntry,
    DEFAULT_MAX_FRAME_BYTES, HEADER_LEN, HEARTBEAT_DIGEST_LEN, MAGIC, VERSION,
};
pub use handshake::{client_handshake, server_handshake, Identity, MAX_JOB_ID_LEN};
pub use reader::{FrameReader, Next};

use crate::error::ProtocolError;

fn inconsistent(msg: impl Into<String>) -> ProtocolError {
    ProtocolError::Inconsistent(msg.into())
}

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

/// What the tests of every part of the codec share.
#[cfg(test)]
mod test_support {
    use std::io::{self, Read};
    use std::sync::Arc;

    use arrow_array::{ArrayRef, DictionaryArray, Int64Array, RecordBatch, StringArray};

    use super::*;
    use crate::error::{Error, Result};

    pub(super) const MAX: u64 = DEFAULT_MAX_FRAME_BYTES;

    pub(super) fn batch(rows: usize) -> RecordBatch {
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

    pub(super) fn decode_one(bytes: &[u8]) -> Frame {
        let (frame, used) = decode_frame(bytes, MAX).unwrap();
        assert_eq!(used, bytes.len());
        frame
    }

    pub(super) fn expect_inconsistent(bytes: &[u8], needle: &str) {
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

    pub(super) fn set_u64(bytes: &mut [u8], at: usize, v: u64) {
        bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
    }

    pub(super) fn read_all<R: Read>(mut reader: FrameReader<R>) -> Result<Vec<Frame>> {
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
}
