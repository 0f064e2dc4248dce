"""tandem._core.Dedup against the plain-Python ReferenceDedup, plus its edge rules."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tandem
from tandem import _core
from tandem.testing import (
    Data,
    End,
    Heartbeat,
    ReferenceDedup,
    channel_content,
    cut_batches,
    interleave,
    replica_streams,
)


def batch(values) -> pa.RecordBatch:
    return pa.record_batch({"seq": pa.array(values, pa.int64())})


def seqs(b: pa.RecordBatch | None) -> list[int]:
    return [] if b is None else b.column("seq").to_pylist()


def data_start(b: pa.RecordBatch) -> int:
    """Address of the first value of the seq column (buffer address + array offset)."""
    col = b.column("seq")
    return col.buffers()[1].address + col.offset * 8


def test_first_copy_wins_and_overlap_is_trimmed():
    d = _core.Dedup(1)
    assert seqs(d.offer(0, 0, batch([0, 1, 2]))) == [0, 1, 2]
    assert d.offer(0, 0, batch([0, 1])) is None
    assert seqs(d.offer(0, 1, batch([1, 2, 3, 4]))) == [3, 4]
    assert d.next_seq(0) == 5
    assert d.offer_heartbeat(0, 5, 1) is True
    assert d.offer_heartbeat(0, 5, 1) is False
    assert d.offer_end(0, 6) is True
    assert d.offer_end(0, 6) is False


def test_accepted_rows_are_a_zero_copy_slice_of_the_input():
    d = _core.Dedup(1)
    whole = batch(list(range(100)))
    out = d.offer(0, 0, whole)
    assert data_start(out) == data_start(whole)
    overlapping = batch(list(range(60, 200)))
    out = d.offer(0, 60, overlapping)
    assert seqs(out) == list(range(100, 200))
    assert data_start(out) == data_start(overlapping) + 40 * 8


def test_a_gap_raises_and_is_not_skipped():
    d = _core.Dedup(2)
    d.offer(1, 0, batch([0, 1]))
    with pytest.raises(tandem.ProtocolError, match=r"gap on channel 1.*seq 5.*seq 2"):
        d.offer(1, 5, batch([5]))
    assert d.next_seq(1) == 2
    assert seqs(d.offer(1, 2, batch([2, 3, 4, 5]))) == [2, 3, 4, 5]
    with pytest.raises(tandem.ProtocolError, match="gap"):
        d.offer_heartbeat(0, 3, 1)


def test_offer_many_counts_new_rows():
    d = _core.Dedup(1)
    a = [(i, batch(list(range(i, i + 10)))) for i in range(0, 100, 10)]
    b = [(i, batch(list(range(i, min(i + 15, 100))))) for i in range(0, 100, 15)]

    def split(pairs):
        return [s for s, _ in pairs], [x for _, x in pairs]

    assert d.offer_many(0, *split(a[:3])) == 30
    seqs, batches = split(b[:3])
    assert d.offer_many(0, seqs, pa.Table.from_batches(batches)) == 15
    seqs, batches = split(a[3:] + b[3:])
    reader = pa.RecordBatchReader.from_batches(batches[0].schema, batches)
    assert d.offer_many(0, seqs, reader) == 55
    assert d.next_seq(0) == 100


def _offer_one_by_one(d, first_seqs, table) -> list[int]:
    got = []
    for s, b in zip(first_seqs, table.to_batches(), strict=True):
        got.extend(seqs(d.offer(0, s, b)))
    return got


def test_concurrent_replicas_each_row_counted_once():
    """Three threads (upstream replicas) offer the same 20,000 rows at their own batch
    boundaries; offer_many releases the GIL, so they really race on the high-water mark."""
    total = 20_000
    inputs = []
    for r in range(3):
        rng = random.Random(r)
        first_seqs, batches, s = [], [], 0
        while s < total:
            n = min(rng.randint(1, 300), total - s)
            first_seqs.append(s)
            batches.append(batch(list(range(s, s + n))))
            s += n
        inputs.append((first_seqs, pa.Table.from_batches(batches)))
    for _ in range(5):
        d = _core.Dedup(1, capacity=2)
        with ThreadPoolExecutor(max_workers=3) as pool:
            futures = [pool.submit(d.offer_many, 0, fs, table) for fs, table in inputs]
            counts = [f.result() for f in futures]
        assert sum(counts) == total
        assert d.next_seq(0) == total

    # Mixed: one replica offers batch by batch and gets its new rows back, two race it
    # with offer_many; every row is new for exactly one of them.
    for _ in range(5):
        d = _core.Dedup(1, capacity=2)
        with ThreadPoolExecutor(max_workers=3) as pool:
            mine = pool.submit(_offer_one_by_one, d, *inputs[0])
            others = [pool.submit(d.offer_many, 0, fs, table) for fs, table in inputs[1:]]
            got = mine.result()
            counts = [f.result() for f in others]
        assert len(set(got)) == len(got), "a row was returned twice"
        assert len(got) + sum(counts) == total


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: _core.Dedup(0), "channels must be at least 1, got 0"),
        (lambda: _core.Dedup(2, capacity=0), "capacity must be at least 1"),
        (lambda: _core.Dedup(-1), "channels must be an integer"),
        (lambda: _core.Dedup(2).offer(2, 0, batch([0])), "channel 2 does not exist"),
        (lambda: _core.Dedup(2).offer(-1, 0, batch([0])), "channel must be an integer"),
        (lambda: _core.Dedup(2).offer(0, -3, batch([0])), "first_seq must be an integer"),
        (lambda: _core.Dedup(2).offer(0, 0, [1, 2]), "batch must be a pyarrow.RecordBatch"),
        (lambda: _core.Dedup(2).offer(0, 2**64 - 1, batch([0, 1])), "past 2\\*\\*64"),
        (lambda: _core.Dedup(2).next_seq(9), "channel 9 does not exist"),
        (lambda: _core.Dedup(1).offer_many(0, [0, 1], [batch([0])]), "first_seqs has 2 entries"),
        (lambda: _core.Dedup(1).offer_many(0, [0], 5), "batches must be an Arrow stream"),
    ],
)
def test_bad_arguments_raise_config_errors(call, message):
    with pytest.raises(tandem.ConfigError, match=message):
        call()


# Differential: for any replica streams and arrival interleaving, Rust keeps exactly what
# the reference keeps, arrival by arrival.
@st.composite
def arrivals(draw):
    """Replicas send the same batches (DESIGN §2 invariant 1: whole copies are dropped),
    or — to exercise trimming, which dedup still defends — each its own cut of the same
    content, so copies overlap partially."""
    channels = draw(st.integers(1, 3))
    replicas = draw(st.integers(1, 3))
    streams = []
    for c in range(channels):
        cycles = draw(st.lists(st.integers(0, 6), max_size=4))
        content = channel_content(cycles, draw(st.integers(0, 6)), start=1000 * c)
        crash = None
        if replicas > 1 and draw(st.booleans()):
            crash = (draw(st.integers(0, replicas - 1)), draw(st.integers(0, 12)))
        max_batch = draw(st.integers(1, 6))
        if draw(st.booleans()):
            reps = replica_streams(
                content, replicas, max_batch=max_batch, seed=draw(st.integers(0, 2**16))
            )
        else:
            reps = [
                cut_batches(content, max_batch=max_batch, seed=draw(st.integers(0, 2**16)))
                for _ in range(replicas)
            ]
        if crash is not None:
            victim, keep = crash
            reps[victim] = reps[victim][:keep]
        streams.append(reps)
    return channels, interleave(streams, seed=draw(st.integers(0, 2**16)))


@settings(max_examples=150, deadline=None)
@given(arrivals())
def test_rust_dedup_matches_the_reference(case):
    channels, arriving = case
    rust, ref = _core.Dedup(channels, capacity=4), ReferenceDedup(channels)
    for c, element in arriving:
        if isinstance(element, Data):
            got = seqs(rust.offer(c, element.first_seq, batch(list(element.rows))))
            assert got == ref.offer(c, element.first_seq, element.rows)
        elif isinstance(element, Heartbeat):
            assert rust.offer_heartbeat(c, element.seq, element.epoch) == ref.offer_marker(
                c, element.seq
            )
        else:
            assert isinstance(element, End)
            assert rust.offer_end(c, element.seq) == ref.offer_marker(c, element.seq)
    assert [rust.next_seq(c) for c in range(channels)] == ref.next
