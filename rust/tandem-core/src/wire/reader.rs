//! Reading frames off a byte stream: [`FrameReader`], resumable across read timeouts, the
//! body read into an aligned buffer and a Data frame decoded zero-copy from it.

use std::io::{self, Read};

use arrow_buffer::MutableBuffer;

use super::frame::{decode_body, decode_header, Frame, FrameHeader, FrameKind, HEADER_LEN};
use crate::error::{ProtocolError, Result};

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::wire::test_support::*;
    use crate::wire::*;
    use std::io::Cursor;

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
}
