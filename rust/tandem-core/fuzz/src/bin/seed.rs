//! Writes the seed corpus (valid frames of every kind) into the directory given as the only
//! argument. The committed `seeds/` directory was made with it; rerun after a format change:
//! `cargo run --manifest-path rust/tandem-core/fuzz/Cargo.toml --bin seed -- rust/tandem-core/fuzz/seeds`

use std::sync::Arc;

use arrow_array::types::Int32Type;
use arrow_array::{
    ArrayRef, BooleanArray, Decimal128Array, DictionaryArray, FixedSizeBinaryArray, Float64Array,
    Int32Array, Int64Array, LargeStringArray, ListArray, RecordBatch, RunArray, StringArray,
    StringViewArray, StructArray, TimestampMicrosecondArray, UnionArray,
};
use tandem_core::wire::{self, OrderEntry};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args()
        .nth(1)
        .ok_or("usage: seed <output directory>")?;
    std::fs::create_dir_all(&dir)?;
    let ints: ArrayRef = Arc::new(Int64Array::from(vec![Some(1), None, Some(3)]));
    let strs: ArrayRef = Arc::new(StringArray::from(vec![Some("a"), Some("bc"), None]));
    let floats: ArrayRef = Arc::new(Float64Array::from(vec![0.5, -1.0, 2.25]));
    let bools: ArrayRef = Arc::new(BooleanArray::from(vec![true, false, true]));
    let dict: ArrayRef = Arc::new(
        ["x", "y", "x"]
            .into_iter()
            .collect::<DictionaryArray<Int32Type>>(),
    );
    let list: ArrayRef = Arc::new(ListArray::from_iter_primitive::<Int32Type, _, _>(vec![
        Some(vec![Some(1), Some(2)]),
        None,
        Some(vec![]),
    ]));
    let strukt: ArrayRef = Arc::new(StructArray::from(vec![
        (Arc::new(arrow_schema_field("i")), ints.clone()),
        (Arc::new(arrow_schema_field_utf8("s")), strs.clone()),
    ]));
    let type_ids: arrow_buffer::ScalarBuffer<i8> = vec![0i8, 1, 0].into();
    let offsets: arrow_buffer::ScalarBuffer<i32> = vec![0i32, 0, 1].into();
    let union_fields = arrow_schema::UnionFields::try_new(
        [0i8, 1],
        [arrow_schema_field("a"), arrow_schema_field_utf8("b")],
    )?;
    let dense: ArrayRef = Arc::new(UnionArray::try_new(
        union_fields.clone(),
        type_ids.clone(),
        Some(offsets),
        vec![
            Arc::new(Int64Array::from(vec![1, 2])) as ArrayRef,
            Arc::new(StringArray::from(vec!["z"])),
        ],
    )?);
    let sparse: ArrayRef = Arc::new(UnionArray::try_new(
        union_fields,
        type_ids,
        None,
        vec![
            Arc::new(Int64Array::from(vec![1, 2, 3])) as ArrayRef,
            Arc::new(StringArray::from(vec!["x", "y", "z"])),
        ],
    )?);
    let view: ArrayRef = Arc::new(StringViewArray::from(vec![
        Some("a string longer than twelve bytes"),
        None,
        Some("short"),
    ]));
    let large: ArrayRef = Arc::new(LargeStringArray::from(vec!["p", "q", "r"]));
    let ts: ArrayRef =
        Arc::new(TimestampMicrosecondArray::from(vec![1, 2, 3]).with_timezone("UTC"));
    let dec: ArrayRef = Arc::new(
        Decimal128Array::from(vec![Some(1), None, Some(3)]).with_precision_and_scale(10, 2)?,
    );
    let fsb: ArrayRef = Arc::new(FixedSizeBinaryArray::try_from_iter(
        vec![vec![1u8, 2], vec![3, 4], vec![5, 6]].into_iter(),
    )?);
    let ree: ArrayRef = Arc::new(RunArray::<Int32Type>::try_new(
        &Int32Array::from(vec![2, 3]),
        &Int64Array::from(vec![7, 8]),
    )?);
    let batches = [
        RecordBatch::try_from_iter([("i", ints.clone())])?,
        RecordBatch::try_from_iter([("i", ints), ("s", strs), ("f", floats), ("b", bools)])?,
        RecordBatch::try_from_iter([("d", dict)])?,
        RecordBatch::try_from_iter([("l", list), ("st", strukt)])?,
        RecordBatch::try_from_iter([("du", dense), ("su", sparse)])?,
        RecordBatch::try_from_iter([("v", view), ("ls", large), ("ts", ts)])?,
        RecordBatch::try_from_iter([("dec", dec), ("fsb", fsb), ("ree", ree)])?,
    ];
    let mut frames = Vec::new();
    for (i, b) in batches.iter().enumerate() {
        frames.push(wire::encode_data(i as u32, 10 * i as u64, b)?);
    }
    frames.push(wire::encode_heartbeat(1, 5, 2));
    frames.push(wire::encode_heartbeat_digest(1, 5, 2, &[0x5A; 16]));
    frames.push(wire::encode_end(1, 6));
    frames.push(wire::encode_order(
        0,
        3,
        4,
        &[
            OrderEntry {
                channel: 0,
                up_to_seq: 9,
            },
            OrderEntry {
                channel: 1,
                up_to_seq: 2,
            },
        ],
    ));
    for (i, f) in frames.iter().enumerate() {
        // A seed the decoder rejects would only teach the fuzzer the error paths.
        wire::decode_frame(f, u64::MAX)
            .map_err(|e| format!("seed frame {i} does not decode: {e}"))?;
        std::fs::write(format!("{dir}/frame-{i:02}"), f)?;
        // frame_reader input: no chunk sizes (first byte 0), then the frame twice.
        let mut r = vec![0u8];
        r.extend_from_slice(f);
        r.extend_from_slice(f);
        std::fs::write(format!("{dir}/stream-{i:02}"), r)?;
    }
    Ok(())
}

fn arrow_schema_field(name: &str) -> arrow_schema::Field {
    arrow_schema::Field::new(name, arrow_schema::DataType::Int64, true)
}

fn arrow_schema_field_utf8(name: &str) -> arrow_schema::Field {
    arrow_schema::Field::new(name, arrow_schema::DataType::Utf8, true)
}
