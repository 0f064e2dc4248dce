"""tandem._core.LiveRobin / Fcfs / Positional against the plain-Python reference.

The central property (DESIGN §2, invariant 3): for any batch boundaries, any arrival
interleaving from 1-3 upstream replicas (one of which may crash), every downstream replica
consumes exactly the sequence ReferenceLiveRobin computes from the channels' contents.
"""

from __future__ import annotations

import random

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
    ReferenceLiveRobin,
    channel_content,
    deduplicate,
    flatten,
    interleave,
    replica_streams,
)


def batch(values) -> pa.RecordBatch:
    return pa.record_batch({"seq": pa.array(values, pa.int64())})


def run_downstream(merge, channels: int, arriving, seed: int) -> list[tuple]:
    """One downstream replica: Rust dedup, then the merge, called at random moments
    between arrivals (so it sees partial input and must wait)."""
    rng = random.Random(seed)
    dedup = _core.Dedup(channels)
    out: list[tuple] = []
    for c, e in arriving:
        if isinstance(e, Data):
            kept = dedup.offer(c, e.first_seq, batch(list(e.rows)))
            if kept is not None:
                merge.push(c, dedup.next_seq(c) - kept.num_rows, kept)
        elif isinstance(e, Heartbeat):
            if dedup.offer_heartbeat(c, e.seq, e.epoch):
                merge.push_heartbeat(c, e.seq, e.epoch)
        elif dedup.offer_end(c, e.seq):
            merge.push_end(c, e.seq)
        if rng.random() < 0.3 and out[-1:] != [("end",)]:
            out.extend(flatten(merge.drain()))
    if out[-1:] != [("end",)]:
        out.extend(flatten(merge.drain()))
    return out


@st.composite
def workloads(draw):
    channels = draw(st.integers(1, 3))
    replicas = draw(st.integers(1, 3))
    streams = []
    contents = []
    for c in range(channels):
        cycles = draw(st.lists(st.integers(0, 6), min_size=0, max_size=4))
        content = channel_content(cycles, draw(st.integers(0, 5)), start=1000 * c)
        contents.append(content)
        crash = None
        if replicas > 1 and draw(st.booleans()):
            crash = (draw(st.integers(0, replicas - 1)), draw(st.integers(0, 12)))
        streams.append(
            replica_streams(
                content,
                replicas,
                max_batch=draw(st.integers(1, 6)),
                seed=draw(st.integers(0, 2**16)),
                crash=crash,
            )
        )
    return channels, streams


@settings(max_examples=150, deadline=None)
@given(
    workloads(),
    st.sampled_from([1, 2, 3, 1024]),
    st.integers(0, 2**16),
    st.integers(0, 2**16),
)
def test_every_downstream_replica_consumes_the_reference_sequence(case, quantum, seed_a, seed_b):
    channels, streams = case
    arriving_a = interleave(streams, seed=seed_a)
    arriving_b = interleave(streams, seed=seed_b)
    expected = ReferenceLiveRobin(channels, quantum).run(deduplicate(arriving_a, channels))
    a = run_downstream(_core.LiveRobin(channels, quantum), channels, arriving_a, seed_a)
    b = run_downstream(_core.LiveRobin(channels, quantum), channels, arriving_b, seed_b + 1)
    assert a == expected
    assert b == a


@settings(max_examples=60, deadline=None)
@given(workloads(), st.integers(0, 2**16))
def test_positional_follows_a_leaders_order(case, seed):
    channels, streams = case
    arriving = interleave(streams, seed=seed)
    leader = ReferenceLiveRobin(channels, 2).run(deduplicate(arriving, channels))
    follower = _core.Positional(channels)
    pos = [0] * channels  # seq after the last row of each channel the leader consumed
    seq_of = {}
    for c, e in (x for x in arriving if isinstance(x[1], Data)):
        for k, v in enumerate(e.rows):
            seq_of[(c, v)] = e.first_seq + k
    for ev in leader:
        if ev[0] == "row":
            pos[ev[1]] = seq_of[(ev[1], ev[2])] + 1
            follower.push_order(ev[1], pos[ev[1]])
    got = run_downstream(follower, channels, arriving, seed)
    rows = [ev for ev in leader if ev[0] == "row"]
    assert [ev for ev in got if ev[0] == "row"] == rows


def test_the_fix_a_repeated_epoch_closes_the_channels_cycle():
    lr = _core.LiveRobin(2, 1)
    lr.push_heartbeat(0, 0, 1)
    lr.push(0, 1, batch([10, 11]))
    lr.push(1, 0, batch([20]))
    assert lr.next() == ("heartbeat", 0, 1, True)
    assert flatten([lr.next()]) == [("row", 1, 20)]
    # Channel 0 has rows ready but its cycle is over: wait for channel 1's heartbeat.
    assert lr.next() is None
    assert lr.waiting_on == 1
    lr.push_heartbeat(1, 1, 1)
    assert lr.next() == ("heartbeat", 1, 1, False)
    # New cycle: one row per turn, and channel 1 (next in turn) is empty again.
    assert flatten(lr.drain()) == [("row", 0, 10)]
    assert lr.waiting_on == 1


def test_quantum_partial_batches_and_end():
    lr = _core.LiveRobin(2, quantum_rows=3)
    lr.push(0, 0, batch([0, 1, 2, 3, 4]))
    lr.push(1, 0, batch([100]))
    out = lr.drain()
    assert [(d[0], d[1], d[2], d[3].num_rows) for d in out] == [
        ("data", 0, 0, 3),
        ("data", 1, 0, 1),
    ]
    assert lr.waiting_on == 1
    lr.push_end(1, 1)
    lr.push_end(0, 5)
    assert flatten(lr.drain()) == [("row", 0, 3), ("row", 0, 4), ("end",)]
    assert lr.next() == ("end",)


def test_single_input_passes_through():
    lr = _core.LiveRobin(1, 1)
    lr.push(0, 0, batch(list(range(50))))
    lr.push_heartbeat(0, 50, 7)
    out = lr.drain()
    assert out[0][3].num_rows == 50, "no splitting on the single-input fast path"
    assert out[1] == ("heartbeat", 0, 7, True)


def test_fcfs_order_depends_on_arrival():
    def run(first: int):
        f = _core.Fcfs(2)
        f.push(first, 0, batch([first]))
        out = flatten(f.drain())
        f.push(1 - first, 0, batch([1 - first]))
        return out + flatten(f.drain())

    assert run(0) != run(1)


def test_positional_is_idempotent_and_slices():
    p = _core.Positional(2)
    p.push(0, 0, batch(list(range(10))))
    p.push_order(0, 4)
    p.push_order(0, 2)
    assert flatten(p.drain()) == [("row", 0, v) for v in range(4)]
    assert p.position(0) == 4
    p.push_order(1, 1)
    assert p.next() is None
    assert p.waiting_on == 1


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: _core.LiveRobin(0, 1), "channels must be at least 1"),
        (lambda: _core.LiveRobin(2, 0), "quantum_rows must be at least 1"),
        (lambda: _core.LiveRobin(2, 1).push(3, 0, batch([1])), "channel 3 does not exist"),
        (lambda: _core.LiveRobin(2, 1).push(0, 5, batch([1])), "expects seq 0 next"),
        (lambda: _core.Fcfs(2).push(0, 0, "x"), "batch must be a pyarrow.RecordBatch"),
        (lambda: _core.Positional(2).push_order(2, 5), "channel 2 does not exist"),
        (lambda: _core.Positional(2).push_order(0, -1), "up_to_seq must be an integer"),
    ],
)
def test_bad_arguments_raise_config_errors(call, message):
    with pytest.raises(tandem.ConfigError, match=message):
        call()


def test_nothing_follows_an_end_marker():
    lr = _core.LiveRobin(2, 1)
    lr.push_end(0, 0)
    with pytest.raises(tandem.ConfigError, match="channel 0 has ended"):
        lr.push(0, 1, batch([1]))


def test_reference_reproduces_algorithm_1_on_a_hand_example():
    # Channel 0: rows 0, 1, heartbeat 1, row 3; channel 1: row 0, heartbeat 1, row 2.
    channels = [
        [Data(0, [0, 1]), Heartbeat(2, 1), Data(3, [3]), End(4)],
        [Data(0, [100]), Heartbeat(1, 1), Data(2, [102]), End(3)],
    ]
    assert ReferenceLiveRobin(2, 1).run(channels) == [
        ("row", 0, 0),
        ("row", 1, 100),
        ("row", 0, 1),
        ("heartbeat", 1, 1, True),
        # The fix: channel 0's heartbeat is not first, yet it closes channel 0's cycle.
        ("heartbeat", 0, 1, False),
        ("row", 1, 102),
        ("row", 0, 3),
        ("end",),
    ]


def test_reference_rejects_bad_arguments():
    with pytest.raises(ValueError, match="at least 1"):
        ReferenceLiveRobin(0)
