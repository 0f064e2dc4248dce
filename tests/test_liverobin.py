"""tandem._core.LiveRobin / Fcfs / Positional against the plain-Python reference.

The central property (DESIGN §2, invariants 1 and 3): every replica of an upstream
partition sends the same batches; for any batch boundaries, any arrival interleaving from
1-3 upstream replicas (one of which may crash), every downstream replica delivers exactly
the batch sequence ReferenceLiveRobin computes from the channels' batches — the same
batches, boundaries included, in the same order.
"""

from __future__ import annotations

import random
from collections import deque

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
    batches,
    channel_content,
    cut_batches,
    deduplicate,
    flatten,
    interleave,
    queue_entries,
    replica_streams,
)


def batch(values) -> pa.RecordBatch:
    return pa.record_batch({"seq": pa.array(values, pa.int64())})


def run_downstream(merge, channels: int, arriving, seed: int) -> list[tuple]:
    """One downstream replica: Rust dedup, then the merge, called at random moments
    between arrivals (so it sees partial input and must wait). Returns its deliveries with
    their batch boundaries (:func:`tandem.testing.batches`)."""
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
            out.extend(batches(merge.drain()))
    if out[-1:] != [("end",)]:
        out.extend(batches(merge.drain()))
    return out


@st.composite
def workloads(draw):
    """``(channels, streams, cut)``: ``streams[c][r]`` is what upstream replica ``r`` of
    channel ``c`` sent (the same batches for every replica, one possibly cut short by a
    crash), ``cut[c]`` the channel's complete batches."""
    channels = draw(st.integers(1, 3))
    replicas = draw(st.integers(1, 3))
    streams = []
    cut = []
    for c in range(channels):
        cycles = draw(st.lists(st.integers(0, 6), min_size=0, max_size=4))
        content = channel_content(cycles, draw(st.integers(0, 5)), start=1000 * c)
        crash = None
        if replicas > 1 and draw(st.booleans()):
            crash = (draw(st.integers(0, replicas - 1)), draw(st.integers(0, 12)))
        max_batch = draw(st.integers(1, 6))
        seed = draw(st.integers(0, 2**16))
        streams.append(
            replica_streams(content, replicas, max_batch=max_batch, seed=seed, crash=crash)
        )
        cut.append(cut_batches(content, max_batch=max_batch, seed=seed))
    return channels, streams, cut


@settings(max_examples=150, deadline=None)
@given(workloads(), st.integers(0, 2**16), st.integers(0, 2**16))
def test_every_downstream_replica_delivers_the_reference_batches(case, seed_a, seed_b):
    channels, streams, cut = case
    arriving_a = interleave(streams, seed=seed_a)
    arriving_b = interleave(streams, seed=seed_b)
    deduplicated = deduplicate(arriving_a, channels)
    assert deduplicated == cut, "dedup keeps whole batches: every copy has the same ranges"
    expected = ReferenceLiveRobin(channels).run(deduplicated)
    a = run_downstream(_core.LiveRobin(channels), channels, arriving_a, seed_a)
    b = run_downstream(_core.LiveRobin(channels), channels, arriving_b, seed_b + 1)
    assert a == expected
    assert b == a, "two downstream replicas delivered different batch sequences"


@st.composite
def raw_channels(draw):
    """Per channel, deduplicated elements as a merge receives them, including empty
    batches (which dedup never passes on, but a caller may push): a list of
    ``(kind, seq, payload)`` with ``payload`` a RecordBatch or an epoch."""
    channels = draw(st.integers(1, 3))
    out = []
    for c in range(channels):
        elems, seq, epoch = [], 0, 0
        for kind in draw(st.lists(st.sampled_from(["data", "data", "empty", "hb"]), max_size=12)):
            if kind == "hb":
                epoch += 1
                elems.append(("heartbeat", seq, epoch))
                seq += 1
            else:
                n = 0 if kind == "empty" else draw(st.integers(1, 4))
                elems.append(("data", seq, batch([1000 * c + seq + k for k in range(n)])))
                seq += n
        elems.append(("end", seq, None))
        out.append(elems)
    return out


def as_values(deliveries: list[tuple]) -> list[tuple]:
    """``("data", channel, values)`` per batch, whatever the delivery shape."""
    out = []
    for d in deliveries:
        if d[0] == "data":
            out.append(("data", d[1], d[-1].column("seq").to_pylist()))
        else:
            out.append(tuple(d))
    return out


def push(lr, c: int, kind: str, seq: int, payload) -> None:
    """Push one element of a channel (as the generators here write them) to a merge."""
    if kind == "data":
        lr.push(c, seq, payload)
    elif kind == "heartbeat":
        lr.push_heartbeat(c, seq, payload)
    else:
        lr.push_end(c, seq)


@settings(max_examples=150, deadline=None)
@given(raw_channels(), st.integers(0, 2**16))
def test_reference_step_over_record_batches_matches_the_rust_merge(chans, seed):
    # The reference through its generic stepping interface, on the RecordBatch payloads
    # the reference executor hands it.
    def entry(kind, payload):
        return ("end",) if kind == "end" else (kind, payload)

    ref = ReferenceLiveRobin(len(chans))
    queues = [deque(entry(k, p) for k, _, p in elems) for elems in chans]
    expected = []
    while (d := ref.step(queues)) is not None:
        expected.append(d)
        if d == ("end",):
            break
    assert expected[-1:] == [("end",)], "complete inputs never leave the reference waiting"

    # The Rust merge, fed in a random interleaving of the channels, drained at random.
    rng = random.Random(seed)
    lr = _core.LiveRobin(len(chans))
    cursors = [0] * len(chans)
    got: list[tuple] = []
    while any(cursors[c] < len(chans[c]) for c in range(len(chans))):
        c = rng.choice([c for c in range(len(chans)) if cursors[c] < len(chans[c])])
        kind, seq, payload = chans[c][cursors[c]]
        cursors[c] += 1
        push(lr, c, kind, seq, payload)
        if rng.random() < 0.3 and got[-1:] != [("end",)]:
            got.extend(lr.drain())
    if got[-1:] != [("end",)]:
        got.extend(lr.drain())
    assert all(d[3].num_rows > 0 for d in got if d[0] == "data"), "empty batches took a turn"
    assert as_values(got) == as_values(expected)


@st.composite
def joining_channels(draw):
    """A live rescale as a merge sees it: ``old`` channels with heartbeats 1, 2, ... (some
    ending before epoch ``k``), and ``new`` channels joined after heartbeat ``k``, whose
    heartbeats go on from ``k + 1``. Elements as in :func:`raw_channels`."""
    old, new, k = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 4))

    def channel(c: int, epochs: range) -> list[tuple]:
        elems, seq = [], 0
        for epoch in [*epochs, None]:
            for _ in range(draw(st.integers(0, 2))):
                n = draw(st.integers(0, 3))
                elems.append(("data", seq, batch([1000 * c + seq + i for i in range(n)])))
                seq += n
            if epoch is not None:
                elems.append(("heartbeat", seq, epoch))
                seq += 1
        elems.append(("end", seq, None))
        return elems

    chans = [channel(c, range(1, 1 + draw(st.integers(0, k + 2)))) for c in range(old)]
    later = range(old, old + new)
    chans += [channel(c, range(k + 1, k + 1 + draw(st.integers(0, 3)))) for c in later]
    return old, k, chans


@settings(max_examples=200, deadline=None)
@given(joining_channels(), st.integers(0, 2**16))
def test_a_join_delivers_what_the_reference_join_delivers(case, seed):
    """The channels a live rescale appends (``join(count, k)``), told to the Rust merge at
    a random moment before it has seen heartbeat ``k`` and to the reference before its
    first step: both deliver the same sequence, whatever the arrival interleaving."""
    old, k, chans = case

    def entry(kind, payload):
        return ("end",) if kind == "end" else (kind, payload)

    ref = ReferenceLiveRobin(old)
    assert ref.join(len(chans) - old, k) == old
    queues = [deque(entry(kind, p) for kind, _, p in elems) for elems in chans]
    expected = []
    while (d := ref.step(queues)) is not None:
        expected.append(d)
        if d == ("end",):
            break
    assert expected[-1:] == [("end",)], "complete inputs never leave the reference waiting"

    # Before the join only the old channels' elements ahead of their first heartbeat at k
    # or later (and of their end) may arrive: the merge must not have seen heartbeat k.
    def early(elems: list[tuple]) -> int:
        return next(
            i
            for i, (kind, _, p) in enumerate(elems)
            if kind == "end" or (kind == "heartbeat" and p >= k)
        )

    rng = random.Random(seed)
    bounds = [early(elems) for elems in chans[:old]] + [0] * (len(chans) - old)
    join_after = rng.randint(0, sum(bounds))
    lr = _core.LiveRobin(old)
    cursors = [0] * len(chans)
    got: list[tuple] = []
    pushed, joined = 0, False
    while any(cursors[c] < len(chans[c]) for c in range(len(chans))):
        if not joined and pushed == join_after:
            assert lr.join(len(chans) - old, k) == old
            joined = True
        limit = [len(e) for e in chans] if joined else bounds
        c = rng.choice([c for c in range(len(chans)) if cursors[c] < limit[c]])
        kind, seq, payload = chans[c][cursors[c]]
        cursors[c] += 1
        pushed += 1
        push(lr, c, kind, seq, payload)
        if rng.random() < 0.3 and got[-1:] != [("end",)]:
            got.extend(lr.drain())
    if got[-1:] != [("end",)]:
        got.extend(lr.drain())
    assert as_values(got) == as_values(expected)


def test_joined_channels_take_turns_from_the_end_of_their_cycle():
    # Channels 0 and 1 run cycles 1 and 2; channel 2, joined after heartbeat 1, waits out
    # cycle 1 and takes turns in the ring from the refill that closes it.
    ref = ReferenceLiveRobin(2)
    assert ref.join(1, 1) == 2
    queues = [
        deque([("data", "a0"), ("heartbeat", 1), ("data", "a1"), ("heartbeat", 2), ("end",)]),
        deque([("heartbeat", 1), ("data", "b1"), ("heartbeat", 2), ("end",)]),
        deque([("data", "c1"), ("data", "c2"), ("heartbeat", 2), ("end",)]),
    ]
    steps = []
    while (d := ref.step(queues)) != ("end",):
        steps.append(d[:3] if d[0] == "data" else d)
    assert steps == [
        ("data", 0, "a0"),
        ("heartbeat", 1, 1, True),
        ("heartbeat", 0, 1, False),
        ("data", 1, "b1"),
        ("data", 2, "c1"),
        ("data", 0, "a1"),
        ("heartbeat", 1, 2, True),
        ("data", 2, "c2"),
        ("heartbeat", 0, 2, False),
        ("heartbeat", 2, 2, False),
    ]


def test_joined_channels_take_turns_once_every_other_channel_ended():
    ref = ReferenceLiveRobin(1)
    ref.join(1, 5)
    queues = [deque([("heartbeat", 1), ("end",)]), deque([("data", "late"), ("end",)])]
    assert ref.step(queues) == ("heartbeat", 0, 1, True)
    assert ref.step(queues) == ("data", 1, "late")
    assert ref.step(queues) == ("end",)


@pytest.mark.parametrize("merge", [ReferenceLiveRobin, _core.LiveRobin])
def test_a_join_is_refused_past_its_epoch_while_another_waits_and_after_the_end(merge):
    error = ValueError if merge is ReferenceLiveRobin else tandem.ConfigError
    m = merge(1)
    queues = [deque([("heartbeat", 3)])]
    if merge is ReferenceLiveRobin:
        m.step(queues)
    else:
        m.push_heartbeat(0, 0, 3)
        m.drain()
    with pytest.raises(error, match="cannot join after heartbeat 3"):
        m.join(1, 3)
    assert m.join(1, 4) == 1
    with pytest.raises(error, match="one join at a time"):
        m.join(1, 5)
    done = merge(1)
    if merge is ReferenceLiveRobin:
        done.step([deque([("end",)])])
    else:
        done.push_end(0, 0)
        done.drain()
    with pytest.raises(error, match="whose channels all ended"):
        done.join(1, 1)


@settings(max_examples=60, deadline=None)
@given(workloads(), st.integers(0, 2**16))
def test_positional_follows_a_leaders_order_batch_for_batch(case, seed):
    channels, streams, _ = case
    arriving = interleave(streams, seed=seed)
    leader = ReferenceLiveRobin(channels).run(deduplicate(arriving, channels))
    follower = _core.Positional(channels)
    for d in leader:
        if d[0] == "data":
            _, c, first_seq, rows = d
            follower.push_order(c, first_seq + len(rows))
    got = run_downstream(follower, channels, arriving, seed)
    # Orders fall on batch boundaries: the follower delivers the leader's very batches.
    assert [d for d in got if d[0] == "data"] == [d for d in leader if d[0] == "data"]


def test_a_turn_is_one_whole_batch():
    lr = _core.LiveRobin(2)
    lr.push(0, 0, batch([0, 1, 2, 3, 4]))
    lr.push(0, 5, batch([5, 6, 7]))
    lr.push(1, 0, batch([100, 101]))
    assert batches(lr.drain()) == [
        ("data", 0, 0, [0, 1, 2, 3, 4]),
        ("data", 1, 0, [100, 101]),
        ("data", 0, 5, [5, 6, 7]),
    ]
    assert lr.waiting_on == 1
    lr.push_end(1, 2)
    lr.push_end(0, 8)
    assert lr.drain() == [("end",)]
    assert lr.next() == ("end",)


def test_a_ready_batch_does_not_jump_the_turn():
    lr = _core.LiveRobin(2)
    lr.push(0, 0, batch([0]))
    lr.push(0, 1, batch([1, 2]))
    assert batches(lr.drain()) == [("data", 0, 0, [0])]
    assert lr.next() is None, "channel 1's turn: channel 0's ready batch waits"
    assert lr.waiting_on == 1
    lr.push_heartbeat(1, 0, 1)
    assert batches(lr.drain()) == [("heartbeat", 1, 1, True), ("data", 0, 1, [1, 2])]


def test_empty_batches_take_no_turn():
    lr = _core.LiveRobin(2)
    lr.push(0, 0, batch([]))
    lr.push(0, 0, batch([0, 1]))
    lr.push(1, 0, batch([]))
    lr.push(1, 0, batch([100]))
    assert batches(lr.drain()) == [("data", 0, 0, [0, 1]), ("data", 1, 0, [100])]
    ref = ReferenceLiveRobin(2)
    queues = [deque([("data", []), ("data", [0, 1])]), deque([("data", []), ("data", [100])])]
    assert ref.step(queues) == ("data", 0, [0, 1])
    assert ref.step(queues) == ("data", 1, [100])


def test_the_fix_a_repeated_epoch_closes_the_channels_cycle():
    lr = _core.LiveRobin(2)
    lr.push_heartbeat(0, 0, 1)
    lr.push(0, 1, batch([10, 11]))
    lr.push(1, 0, batch([20]))
    assert lr.next() == ("heartbeat", 0, 1, True)
    assert batches([lr.next()]) == [("data", 1, 0, [20])]
    # Channel 0 has a batch ready but its cycle is over: wait for channel 1's heartbeat.
    assert lr.next() is None
    assert lr.waiting_on == 1
    lr.push_heartbeat(1, 1, 1)
    assert lr.next() == ("heartbeat", 1, 1, False)
    # New cycle: channel 0's whole batch, then channel 1 (next in turn) is empty again.
    assert batches(lr.drain()) == [("data", 0, 1, [10, 11])]
    assert lr.waiting_on == 1


def test_single_input_passes_through():
    lr = _core.LiveRobin(1)
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

    def run_lr(first: int):
        lr = _core.LiveRobin(2)
        lr.push(first, 0, batch([first]))
        out = batches(lr.drain())
        lr.push(1 - first, 0, batch([1 - first]))
        return out + batches(lr.drain())

    assert run_lr(0) == run_lr(1), "LiveRobin over the same two arrival orders agrees"


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
        (lambda: _core.LiveRobin(0), "channels must be at least 1"),
        (lambda: _core.LiveRobin(2).push(3, 0, batch([1])), "channel 3 does not exist"),
        (lambda: _core.LiveRobin(2).push(0, 5, batch([1])), "expects seq 0 next"),
        (lambda: _core.Fcfs(2).push(0, 0, "x"), "batch must be a pyarrow.RecordBatch"),
        (lambda: _core.Positional(2).push_order(2, 5), "channel 2 does not exist"),
        (lambda: _core.Positional(2).push_order(0, -1), "up_to_seq must be an integer"),
    ],
)
def test_bad_arguments_raise_config_errors(call, message):
    with pytest.raises(tandem.ConfigError, match=message):
        call()


def test_liverobin_takes_no_quantum():
    with pytest.raises(TypeError):
        _core.LiveRobin(2, 1)
    with pytest.raises(TypeError):
        ReferenceLiveRobin(2, 1)


def test_nothing_follows_an_end_marker():
    lr = _core.LiveRobin(2)
    lr.push_end(0, 0)
    with pytest.raises(tandem.ConfigError, match="channel 0 has ended"):
        lr.push(0, 1, batch([1]))


def test_reference_reproduces_algorithm_1_on_a_hand_example():
    # One row per batch: the paper's per-event algorithm exactly.
    channels = [
        [Data(0, [0]), Data(1, [1]), Heartbeat(2, 1), Data(3, [3]), End(4)],
        [Data(0, [100]), Heartbeat(1, 1), Data(2, [102]), End(3)],
    ]
    assert ReferenceLiveRobin(2).run(channels) == [
        ("data", 0, 0, [0]),
        ("data", 1, 0, [100]),
        ("data", 0, 1, [1]),
        ("heartbeat", 1, 1, True),
        # The fix: channel 0's heartbeat is not first, yet it closes channel 0's cycle.
        ("heartbeat", 0, 1, False),
        ("data", 1, 2, [102]),
        ("data", 0, 3, [3]),
        ("end",),
    ]
    # Channel 0's first two rows in one batch: one turn for both.
    channels[0] = [Data(0, [0, 1]), Heartbeat(2, 1), Data(3, [3]), End(4)]
    assert ReferenceLiveRobin(2).run(channels) == [
        ("data", 0, 0, [0, 1]),
        ("data", 1, 0, [100]),
        ("heartbeat", 0, 1, True),
        ("heartbeat", 1, 1, False),
        ("data", 0, 3, [3]),
        ("data", 1, 2, [102]),
        ("end",),
    ]


def test_reference_step_interface():
    a, b = batch([0, 1]), batch([100])
    ref = ReferenceLiveRobin(2)
    queues = [deque([("data", a)]), deque()]
    got = ref.step(queues)
    assert got == ("data", 0, a) and got[2] is a, "the payload object, whole"
    assert ref.step(queues) is None, "channel 1's turn and its queue is empty"
    assert ref.next == 1
    queues[1].extend([("heartbeat", 3), ("data", b)])
    assert ref.step(queues) == ("heartbeat", 1, 3, True)
    assert ref.active == {0}
    assert ref.step(queues) is None, "channel 0 alone in the cycle, and empty"
    queues[0].extend([("end",)])
    # Channel 0 ends (no return of its own) and completes the cycle; channel 1 goes on.
    assert ref.step(queues)[:2] == ("data", 1)
    queues[1].append(("end",))
    assert ref.step(queues) == ("end",)
    assert ref.step(queues) == ("end",)
    with pytest.raises(ValueError, match="unknown entry kind 'row'"):
        ReferenceLiveRobin(1).step([deque([("row", 1)])])
    with pytest.raises(ValueError, match="expected 2 queues, got 1"):
        ReferenceLiveRobin(2).step([deque()])
    assert queue_entries([Data(0, [7]), Heartbeat(1, 2), End(2)]) == [
        ("data", Data(0, [7])),
        ("heartbeat", 2),
        ("end",),
    ]


def test_replica_streams_send_the_same_batches():
    content = channel_content([5, 0, 7], 3)
    streams = replica_streams(content, 3, max_batch=3, seed=11, crash=(1, 4))
    cut = cut_batches(content, max_batch=3, seed=11)
    assert streams[0] == streams[2] == cut
    assert streams[1] == cut[:4]
    assert [e.first_seq for e in cut[1:]] == [e.end_seq for e in cut[:-1]], "contiguous"
    assert all(0 < len(e.rows) <= 3 for e in cut if isinstance(e, Data))
    assert cut_batches(content, max_batch=3, seed=12) != cut, "the seed picks the boundaries"


def test_reference_rejects_bad_arguments():
    with pytest.raises(ValueError, match="at least 1"):
        ReferenceLiveRobin(0)
    with pytest.raises(LookupError, match="ran dry"):
        ReferenceLiveRobin(1).run([[Data(0, [1])]])
