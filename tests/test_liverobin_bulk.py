"""The merges' bulk calls (``push_many`` / ``drain_many``) against the one-by-one calls.

``push_many`` hands a merge many elements of one channel at once (the rows back to back,
cut where the seqs say) and ``drain_many`` takes every available delivery in one crossing
(the rows as one record batch). On any channels — empty batches and heartbeats included,
pushed in pieces, in any chunking, drained at any moment — they must deliver exactly what
``push`` / ``push_heartbeat`` / ``push_end`` and ``drain`` deliver, which is what the
Python reference computes.
"""

from __future__ import annotations

import itertools
import random

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tandem
from tandem import _core
from tandem.testing import Data, End, Heartbeat, ReferenceLiveRobin, batches, bulk_batches

SCHEMA = pa.schema([("seq", pa.int64())])


def batch(values) -> pa.RecordBatch:
    return pa.record_batch([pa.array(values, pa.int64())], schema=SCHEMA)


@st.composite
def channels(draw, empty_batches: bool = True):
    """Per channel, deduplicated elements as a merge receives them, empty batches included
    unless told otherwise: ``(kind, seq, payload)``, ``payload`` a list of values or an
    epoch."""
    n = draw(st.integers(1, 4))
    out = []
    for c in range(n):
        elems, seq, epoch = [], 0, 0
        kinds = st.sampled_from(["data", "data", "hb"] + ["empty"] * empty_batches)
        for kind in draw(st.lists(kinds, max_size=14)):
            if kind == "hb":
                epoch += draw(st.integers(0, 1))
                elems.append(("heartbeat", seq, epoch))
                seq += 1
            else:
                rows = 0 if kind == "empty" else draw(st.integers(1, 5))
                elems.append(("data", seq, [1000 * c + seq + k for k in range(rows)]))
                seq += rows
        elems.append(("end", seq, None))
        out.append(elems)
    return out


def rows_of(elems, chunking: str):
    """The data rows of ``elems`` back to back, chunked one of three ways."""
    data = [batch(p) for k, _, p in elems if k == "data"]
    if chunking == "table":  # one chunk per batch, empty ones too
        return pa.Table.from_batches(data, schema=SCHEMA)
    if chunking == "list":
        return data
    return batch([v for k, _, p in elems if k == "data" for v in p])  # one batch


def push_bulk(merge, c: int, elems, chunking: str) -> None:
    merge.push_many(
        c,
        [s for k, s, _ in elems if k == "data"],
        rows_of(elems, chunking),
        [(s, e) for k, s, e in elems if k == "heartbeat"],
        next((s for k, s, _ in elems if k == "end"), None),
    )


def push_one_by_one(merge, c: int, elems) -> None:
    for kind, seq, payload in elems:
        if kind == "data":
            merge.push(c, seq, batch(payload))
        elif kind == "heartbeat":
            merge.push_heartbeat(c, seq, payload)
        else:
            merge.push_end(c, seq)


def run(merge_factory, chans, pushes, seed: int, bulk: bool) -> list[tuple]:
    """Push ``pushes`` (``(channel, elements)`` pieces, in order), draining at random."""
    rng = random.Random(seed)
    merge = merge_factory(len(chans))
    got: list[tuple] = []
    for c, piece, chunking in pushes:
        if bulk:
            push_bulk(merge, c, piece, chunking)
        else:
            push_one_by_one(merge, c, piece)
        if rng.random() < 0.4 and got[-1:] != [("end",)]:
            got.extend(bulk_batches(merge.drain_many()) if bulk else batches(merge.drain()))
    if got[-1:] != [("end",)]:
        got.extend(bulk_batches(merge.drain_many()) if bulk else batches(merge.drain()))
    return got


@st.composite
def pieces(draw, chans):
    """The channels' elements cut into pieces, the pieces of all channels interleaved
    (each channel's in order), each with a chunking for its rows."""
    per_channel = []
    for c, elems in enumerate(chans):
        cuts = []
        if len(elems) > 1:
            cuts = sorted(draw(st.sets(st.integers(1, len(elems) - 1), max_size=3)))
        bounds = [0, *cuts, len(elems)]
        per_channel.append([(c, elems[a:b]) for a, b in itertools.pairwise(bounds) if a < b])
    order = []
    cursors = [0] * len(chans)
    rng = random.Random(draw(st.integers(0, 2**16)))
    while any(cursors[c] < len(per_channel[c]) for c in range(len(chans))):
        c = rng.choice([c for c in range(len(chans)) if cursors[c] < len(per_channel[c])])
        ch, piece = per_channel[c][cursors[c]]
        cursors[c] += 1
        order.append((ch, piece, draw(st.sampled_from(["table", "list", "one"]))))
    return order


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_bulk_calls_deliver_what_the_one_by_one_calls_deliver(data):
    chans = data.draw(channels())
    pushes = data.draw(pieces(chans))
    seed = data.draw(st.integers(0, 2**16))
    one_by_one = run(_core.LiveRobin, chans, pushes, seed, bulk=False)
    bulk = run(_core.LiveRobin, chans, pushes, seed, bulk=True)
    assert bulk == one_by_one
    # And both are the reference's (empty batches take no turn anywhere).
    ref_input = [
        [
            Data(s, p) if k == "data" else Heartbeat(s, p) if k == "heartbeat" else End(s)
            for k, s, p in elems
        ]
        for elems in chans
    ]
    expected = [d for d in ReferenceLiveRobin(len(chans)).run(ref_input) if d[0] != "data" or d[3]]
    assert [d for d in bulk if d[0] != "data" or d[3]] == expected
    assert all(d[3] for d in bulk if d[0] == "data"), "an empty batch was delivered"


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_fcfs_bulk_calls_agree_with_one_by_one(data):
    # push_many leaves empty batches out, as dedup does; Fcfs's rotation moves past one
    # pushed by itself, so the two agree on channels without them (all the runtime has).
    chans = data.draw(channels(empty_batches=False))
    pushes = data.draw(pieces(chans))
    seed = data.draw(st.integers(0, 2**16))
    assert run(_core.Fcfs, chans, pushes, seed, bulk=True) == run(
        _core.Fcfs, chans, pushes, seed, bulk=False
    )


def test_rows_are_cut_zero_copy_where_the_seqs_say():
    lr = _core.LiveRobin(2)
    # Channel 0: [0, 1, 2] hb(3) [4, 5] end(6), its rows in one batch.
    lr.push_many(0, [0, 4], batch([0, 1, 2, 4, 5]), [(3, 1)], 6)
    lr.push_many(1, [0], [batch([100, 101])])
    deliveries, rows = lr.drain_many()
    assert deliveries == [
        ("data", 0, 0, 3),
        ("data", 1, 0, 2),
        ("heartbeat", 0, 1, True),
    ]
    assert rows.schema == SCHEMA
    assert rows.column("seq").to_pylist() == [0, 1, 2, 100, 101]
    assert lr.pending() == [2, 0]
    assert lr.waiting_on == 1
    lr.push_many(1, [], [], [(2, 1)], 3)
    deliveries, rows = lr.drain_many()
    assert deliveries == [("heartbeat", 1, 1, False), ("data", 0, 4, 2), ("end",)]
    assert rows.column("seq").to_pylist() == [4, 5]
    assert lr.drain_many() == ([("end",)], None), "no batch delivered: no rows"


@pytest.mark.parametrize(
    ("push", "message"),
    [
        (lambda lr: lr.push_many(0, [0], batch([1, 2])), None),
        (
            lambda lr: lr.push_many(0, [0], batch([1, 2]), [(3, 1)]),
            "covers 3 rows, but only 2 are left in its chunk of the rows; the rows ran out",
        ),
        (
            lambda lr: lr.push_many(0, [0], batch([1, 2, 3]), [(2, 1)]),
            "1 rows are left after the last batch",
        ),
        (
            lambda lr: lr.push_many(0, [0, 2], [batch([1]), batch([2, 3])]),
            "must not straddle two batches",
        ),
        (
            lambda lr: lr.push_many(0, [1], batch([1, 2])),
            "channel 0 expects seq 0 next, got an element starting at seq 1",
        ),
        (
            lambda lr: lr.push_many(0, [0], batch([1]), [(1, 1), (3, 2)]),
            "expects seq 2 next, got an element starting at seq 3",
        ),
        (lambda lr: lr.push_many(0, [0], batch([1]), end=1) or lr.push_end(0, 2), "has ended"),
        (lambda lr: lr.push_many(0, [0], batch([1]), [(1, -1)]), "heartbeat epoch"),
        (lambda lr: lr.push_many(0, [0], batch([1]), [1]), "heartbeats must be a sequence"),
        (lambda lr: lr.push_many(0, ["x"], batch([1])), "first_seq must be an integer"),
        (lambda lr: lr.push_many(5, [0], batch([1])), "channel 5 does not exist"),
    ],
)
def test_push_many_is_all_or_nothing_and_says_what_is_wrong(push, message):
    lr = _core.LiveRobin(2)
    if message is None:
        push(lr)
        assert lr.pending() == [1, 0]
        return
    with pytest.raises(tandem.ConfigError, match=message):
        push(lr)
    if "has ended" not in message:
        assert lr.pending() == [0, 0], "a refused push_many pushes nothing"


def test_drain_many_refuses_two_schemas_before_taking_anything():
    lr = _core.LiveRobin(2)
    lr.push(0, 0, batch([1]))
    lr.push(1, 0, pa.record_batch({"other": pa.array([1.5])}))
    with pytest.raises(tandem.ConfigError, match="use drain\\(\\) for batches of differing"):
        lr.drain_many()
    assert lr.pending() == [1, 1], "nothing was taken"
    assert [d[0] for d in lr.drain()] == ["data", "data"]
