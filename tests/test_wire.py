"""The wire codec through `tandem._core`: round trips, and a `tandem.ProtocolError` that
names the problem for every kind of malformed frame."""

from __future__ import annotations

import contextlib
import random
import struct

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tandem
from tandem import _core

MAGIC = 0x544E444D
# magic, version, kind, flags, channel, first_seq, count, body_len
HEADER = struct.Struct("<IHBBIQQI")


def sample_batch(rows: int = 5) -> pa.RecordBatch:
    return pa.record_batch(
        {
            "id": pa.array(range(rows), pa.int64()),
            "name": pa.array([None if i % 3 == 0 else f"n{i}" for i in range(rows)]),
            "colour": pa.array([["red", "green"][i % 2] for i in range(rows)]).dictionary_encode(),
            "tags": pa.array([[i, i + 1] for i in range(rows)], pa.list_(pa.int32())),
            "ts": pa.array(range(rows), pa.timestamp("us", tz="UTC")),
        }
    )


def with_header(frame: bytes, **fields: int) -> bytes:
    """`frame` with some header fields replaced."""
    names = ("magic", "version", "kind", "flags", "channel", "first_seq", "count", "body_len")
    values = dict(zip(names, HEADER.unpack_from(frame), strict=True))
    values.update(fields)
    return HEADER.pack(*(values[n] for n in names)) + frame[HEADER.size :]


def test_constants() -> None:
    assert _core.HEADER_LEN == HEADER.size == 32
    assert _core.DEFAULT_MAX_FRAME_BYTES == 64 << 20
    assert _core.WIRE_VERSION == 2


def test_data_round_trip() -> None:
    batch = sample_batch(7)
    frame = _core.encode_data_frame(3, 100, batch)
    assert isinstance(frame, bytes)
    kind, channel, first_seq, decoded = _core.decode_frame(frame)
    assert (kind, channel, first_seq) == ("data", 3, 100)
    assert isinstance(decoded, pa.RecordBatch)
    assert decoded.equals(batch)
    assert decoded.schema == batch.schema


def test_sliced_batch_round_trips_as_the_slice() -> None:
    batch = sample_batch(40).slice(11, 9)
    _, _, _, decoded = _core.decode_frame(_core.encode_data_frame(0, 11, batch))
    assert decoded.equals(batch)


def test_control_frames_round_trip() -> None:
    assert _core.decode_frame(_core.encode_heartbeat_frame(2, 41, 9)) == (
        "heartbeat",
        2,
        41,
        9,
        None,
    )
    digest = bytes(range(16))
    frame = _core.encode_heartbeat_frame(2, 41, 9, digest)
    assert len(frame) == 32 + 16
    assert _core.decode_frame(frame) == ("heartbeat", 2, 41, 9, digest)
    assert _core.decode_frame(_core.encode_end_frame(2, 1000)) == ("end", 2, 1000)
    entries = [(0, 10), (1, 2**64 - 1)]
    frame = _core.encode_order_frame(5, 3, 77, entries)
    assert len(frame) == 32 + 16 + 12 * len(entries)
    assert _core.decode_frame(frame) == ("order", 5, 3, 77, entries)
    assert _core.decode_frame(_core.encode_order_frame(5, 3, 78, [])) == ("order", 5, 3, 78, [])


def test_frame_written_by_pyarrow_ipc_decodes() -> None:
    """A body produced by pyarrow's own IPC writer passes the decoder's validation."""
    batch = sample_batch(6)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    body = sink.getvalue().to_pybytes()
    frame = HEADER.pack(MAGIC, _core.WIRE_VERSION, 1, 0, 4, 50, batch.num_rows, len(body)) + body
    kind, channel, first_seq, decoded = _core.decode_frame(frame)
    assert (kind, channel, first_seq) == ("data", 4, 50)
    assert decoded.equals(batch)


def test_protocol_error_is_a_tandem_error() -> None:
    assert issubclass(tandem.ProtocolError, tandem.TandemError)
    with pytest.raises(tandem.TandemError):
        _core.decode_frame(b"")


def test_empty_batch_is_refused() -> None:
    with pytest.raises(tandem.ProtocolError, match="0 rows"):
        _core.encode_data_frame(0, 0, sample_batch(0))


def test_out_of_range_integers_are_refused() -> None:
    with pytest.raises(OverflowError):
        _core.encode_heartbeat_frame(-1, 0, 0)
    with pytest.raises(OverflowError):
        _core.encode_end_frame(0, 2**64)


@pytest.mark.parametrize("length", [0, 15, 17])
def test_heartbeat_digest_must_be_16_bytes(length: int) -> None:
    with pytest.raises(tandem.ConfigError, match=f"exactly 16 bytes, got {length}"):
        _core.encode_heartbeat_frame(0, 1, 2, bytes(length))


@pytest.mark.parametrize("length", [1, 8, 15, 17, 32])
def test_heartbeat_body_is_empty_or_a_digest(length: int) -> None:
    frame = with_header(_core.encode_heartbeat_frame(0, 1, 2), body_len=length) + bytes(length)
    with pytest.raises(tandem.ProtocolError, match=f"body of {length} bytes; it must be empty"):
        _core.decode_frame(frame)


@pytest.mark.parametrize(
    "garbage",
    [b"GET / HTTP/1.1\r\n\r\n", bytes(64), b"\xff" * 100, b"TNDM" * 10],
    ids=["http", "zeros", "ones", "text-magic"],
)
def test_garbage_bytes(garbage: bytes) -> None:
    with pytest.raises(tandem.ProtocolError, match="bad magic"):
        _core.decode_frame(garbage)


def test_random_garbage_never_escapes_as_another_error() -> None:
    rng = random.Random(20211004)
    for _ in range(2000):
        data = rng.randbytes(rng.randrange(0, 200))
        with pytest.raises(tandem.ProtocolError):
            _core.decode_frame(data)


def test_garbage_body_under_a_valid_header() -> None:
    body = b"\xab" * 64
    frame = HEADER.pack(MAGIC, _core.WIRE_VERSION, 1, 0, 0, 0, 3, len(body)) + body
    with pytest.raises(tandem.ProtocolError, match="Arrow IPC"):
        _core.decode_frame(frame)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.integers(min_value=0, max_value=399))
def test_mutated_frames_raise_protocol_error_or_decode(noise: bytes, at: int) -> None:
    frame = bytearray(_core.encode_data_frame(1, 0, sample_batch(4)))
    at = 32 + at % (len(frame) - 32)
    frame[at : at + len(noise)] = noise[: len(frame) - at]
    # Anything but a ProtocolError (a panic surfacing as PanicException, a TypeError, ...)
    # fails the test.
    with contextlib.suppress(tandem.ProtocolError):
        assert _core.decode_frame(bytes(frame))[0] == "data"


@pytest.mark.parametrize(
    "frame",
    [
        _core.encode_data_frame(0, 0, sample_batch(3)),
        _core.encode_heartbeat_frame(0, 1, 2),
        _core.encode_heartbeat_frame(0, 1, 2, b"\x07" * 16),
        _core.encode_end_frame(0, 3),
        _core.encode_order_frame(0, 1, 1, [(0, 5), (1, 6)]),
    ],
    ids=["data", "heartbeat", "heartbeat-digest", "end", "order"],
)
def test_every_prefix_is_truncated(frame: bytes) -> None:
    for cut in range(len(frame)):
        with pytest.raises(tandem.ProtocolError, match="truncated frame") as info:
            _core.decode_frame(frame[:cut])
        assert f"got {cut}" in str(info.value)


def test_oversized_frame_vs_limit() -> None:
    frame = _core.encode_data_frame(0, 0, sample_batch(100))
    body_len = len(frame) - 32
    with pytest.raises(tandem.ProtocolError, match=rf"{body_len} bytes exceeds the limit of 100"):
        _core.decode_frame(frame, max_frame_bytes=100)
    assert _core.decode_frame(frame, max_frame_bytes=body_len)[0] == "data"


def test_wrong_magic() -> None:
    frame = with_header(_core.encode_end_frame(0, 1), magic=0x12345678)
    with pytest.raises(tandem.ProtocolError, match="bad magic 0x12345678"):
        _core.decode_frame(frame)


@pytest.mark.parametrize("version", [1, 3])
def test_wrong_version(version: int) -> None:
    """Version 1 predates heartbeat digests: its frames are refused, not misread."""
    frame = with_header(_core.encode_heartbeat_frame(0, 1, 1), version=version)
    with pytest.raises(tandem.ProtocolError, match=f"unsupported wire version {version}"):
        _core.decode_frame(frame)


def test_header_body_row_count_mismatch() -> None:
    frame = with_header(_core.encode_data_frame(0, 0, sample_batch(5)), count=6)
    with pytest.raises(
        tandem.ProtocolError, match="header announces 6 rows but the Arrow batch has 5"
    ):
        _core.decode_frame(frame)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kind": 9}, "unknown frame kind 9"),
        ({"flags": 1}, "flags byte is 0x01"),
        ({"count": 0}, "announces 0 rows"),
    ],
)
def test_inconsistent_headers(fields: dict[str, int], message: str) -> None:
    frame = with_header(_core.encode_data_frame(0, 0, sample_batch(2)), **fields)
    with pytest.raises(tandem.ProtocolError, match=message):
        _core.decode_frame(frame)


def test_trailing_bytes_are_refused() -> None:
    frame = _core.encode_end_frame(0, 1) + _core.encode_end_frame(0, 2)
    with pytest.raises(tandem.ProtocolError, match="32 bytes follow the 32-byte frame"):
        _core.decode_frame(frame)
