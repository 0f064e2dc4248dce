//! The body of a Data frame: an Arrow IPC stream, decoded and validated by arrow-ipc under
//! an unwind guard, and the few checks a Data frame adds to an IPC stream.

use arrow_array::RecordBatch;
use arrow_buffer::Buffer;
use arrow_ipc::reader::StreamDecoder;
use arrow_schema::{DataType, Field};

use super::inconsistent;
use crate::error::ProtocolError;

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
pub(super) fn decode_ipc_guarded(
    body: Buffer,
    channel: u32,
    rows: u64,
) -> Result<RecordBatch, ProtocolError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        decode_ipc(body, channel, rows)
    }))
    .unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
            .unwrap_or("a panic");
        Err(inconsistent(format!(
            "Data frame on channel {channel}: the Arrow IPC body is malformed (the arrow decoder \
                 panicked: {what})"
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
fn decode_ipc(body: Buffer, channel: u32, rows: u64) -> Result<RecordBatch, ProtocolError> {
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
    if batch.num_rows() as u64 != rows {
        return Err(bad(format!(
            "header announces {} rows but the Arrow batch has {}",
            rows,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::test_support::*;
    use crate::wire::*;
    use arrow_array::{ArrayRef, DictionaryArray, Int64Array, StringArray};
    use arrow_ipc::writer::StreamWriter;
    use arrow_schema::Schema;
    use std::sync::Arc;

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
                include_bytes!("../../fuzz/regressions/short-validity-bitmap"),
                "the arrow decoder panicked",
            ),
            (
                "offsets not whole elements",
                include_bytes!("../../fuzz/regressions/offsets-not-whole-elements"),
                "the arrow decoder panicked",
            ),
            (
                "misaligned union offsets",
                include_bytes!("../../fuzz/regressions/misaligned-union-offsets"),
                "the arrow decoder panicked",
            ),
            (
                "fixed-size list length overflow",
                include_bytes!("../../fuzz/regressions/fixed-size-list-overflow"),
                "the arrow decoder panicked",
            ),
            (
                "empty time zone",
                include_bytes!("../../fuzz/regressions/empty-time-zone"),
                "empty time zone",
            ),
            (
                "childless union as dictionary values",
                include_bytes!("../../fuzz/regressions/childless-union"),
                "the arrow decoder panicked",
            ),
            (
                "NUL byte in a time zone",
                include_bytes!("../../fuzz/regressions/nul-in-time-zone"),
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
}
