//! Writes the seed corpus (valid frames of every kind) into the directory given as the only
//! argument. The committed `seeds/` directory was made with it; rerun after a format change:
//! `cargo run --manifest-path rust/tandem-core/fuzz/Cargo.toml --bin seed -- rust/tandem-core/fuzz/seeds`

use std::sync::Arc;

use arrow_array::types::Int32Type;
use arrow_array::{
    ArrayRef, BooleanArray, DictionaryArray, Float64Array, Int64Array, ListArray, RecordBatch,
    StringArray, StructArray,
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
    let batches = [
        RecordBatch::try_from_iter([("i", ints.clone())])?,
        RecordBatch::try_from_iter([("i", ints), ("s", strs), ("f", floats), ("b", bools)])?,
        RecordBatch::try_from_iter([("d", dict)])?,
        RecordBatch::try_from_iter([("l", list), ("st", strukt)])?,
    ];
    let mut frames = Vec::new();
    for (i, b) in batches.iter().enumerate() {
        frames.push(wire::encode_data(i as u32, 10 * i as u64, b)?);
    }
    frames.push(wire::encode_heartbeat(1, 5, 2));
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
