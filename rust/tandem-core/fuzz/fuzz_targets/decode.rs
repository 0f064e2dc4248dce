//! `decode_frame` must return a frame or a `ProtocolError` for any input, never panic (a
//! panic inside arrow-ipc must be caught by its unwind guard); a decoded frame must survive a
//! re-encode/decode round trip, and a decoded batch must be exportable through the Arrow C
//! Data Interface (how it reaches Python).
#![no_main]

#[path = "../src/escape.rs"]
mod escape;

use arrow_array::{Array, StructArray};
use libfuzzer_sys::fuzz_target;
use tandem_core::wire::{self, Frame};

/// Small enough that libFuzzer also explores the Oversized path.
const LIMIT: u64 = 1 << 16;

fuzz_target!(init: escape::init(), |data: &[u8]| {
    escape::check(|| decode(data))
});

fn decode(data: &[u8]) {
    if let Ok((frame, used)) = wire::decode_frame(data, LIMIT) {
        assert!(
            used <= data.len(),
            "consumed {used} bytes of {}",
            data.len()
        );
        if let Frame::Data { batch, .. } = &frame {
            let data = StructArray::from(batch.clone()).into_data();
            if let Err(e) = arrow_array::ffi::to_ffi(&data) {
                panic!("decoded batch cannot cross the C Data Interface: {e}");
            }
        }
        let again = match &frame {
            Frame::Data {
                channel,
                first_seq,
                batch,
            } => {
                wire::encode_data(*channel, *first_seq, batch).expect("a decoded batch re-encodes")
            }
            Frame::Heartbeat {
                channel,
                seq,
                epoch,
                digest: None,
            } => wire::encode_heartbeat(*channel, *seq, *epoch),
            Frame::Heartbeat {
                channel,
                seq,
                epoch,
                digest: Some(digest),
            } => wire::encode_heartbeat_digest(*channel, *seq, *epoch, digest),
            Frame::End { channel, seq } => wire::encode_end(*channel, *seq),
            Frame::Order {
                channel,
                epoch,
                version,
                entries,
            } => wire::encode_order(*channel, *epoch, *version, entries),
        };
        let (back, _) = wire::decode_frame(&again, u64::MAX).expect("a re-encoded frame decodes");
        assert_eq!(back, frame);
    }
}
