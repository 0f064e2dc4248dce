//! `FrameReader` over arbitrary bytes delivered in arbitrary chunk sizes: it must end with
//! `Ok(None)` or an error, never panic or loop, and agree with `decode_frame` frame by frame.
#![no_main]

#[path = "../src/escape.rs"]
mod escape;

use std::io::{self, Read};

use libfuzzer_sys::fuzz_target;
use tandem_core::wire::{self, FrameReader};

const LIMIT: u64 = 1 << 16;

/// Delivers `data` in chunks whose sizes come from `sizes` (cycled), returning `WouldBlock`
/// where a size is 0, like a non-blocking socket (never twice in a row, so every other call
/// makes progress).
struct Chunks<'a> {
    data: &'a [u8],
    sizes: &'a [u8],
    step: usize,
    blocked: bool,
}

impl Read for Chunks<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let size = if self.sizes.is_empty() {
            usize::MAX
        } else {
            self.sizes[self.step % self.sizes.len()] as usize
        };
        self.step += 1;
        if size == 0 && !self.data.is_empty() && !self.blocked {
            self.blocked = true;
            return Err(io::ErrorKind::WouldBlock.into());
        }
        self.blocked = false;
        let n = size.max(1).min(buf.len()).min(self.data.len());
        buf[..n].copy_from_slice(&self.data[..n]);
        self.data = &self.data[n..];
        Ok(n)
    }
}

fuzz_target!(init: escape::init(), |input: &[u8]| {
    escape::check(|| read(input))
});

fn read(input: &[u8]) {
    // First byte: how many of the following bytes describe chunk sizes.
    let Some((&n, rest)) = input.split_first() else {
        return;
    };
    let (sizes, data) = rest.split_at((n as usize % 16).min(rest.len()));
    let mut reader = FrameReader::new(
        Chunks {
            data,
            sizes,
            step: 0,
            blocked: false,
        },
        LIMIT,
    );
    let mut offset = 0usize;
    let mut would_blocks = 0usize;
    loop {
        match reader.next_frame() {
            Ok(Some(frame)) => {
                let (expected, used) = wire::decode_frame(&data[offset..], LIMIT)
                    .expect("reader and decode_frame agree");
                assert_eq!(frame, expected);
                offset += used;
            }
            Ok(None) => {
                assert_eq!(offset, data.len(), "clean EOF only at a frame boundary");
                break;
            }
            Err(tandem_core::Error::Io(e)) if e.kind() == io::ErrorKind::WouldBlock => {
                would_blocks += 1;
                assert!(
                    would_blocks <= data.len() * 16 + 16,
                    "reader makes no progress"
                );
            }
            Err(_) => break,
        }
    }
}
