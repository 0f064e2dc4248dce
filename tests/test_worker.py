"""Workers: placement of replicas over worker processes, and the Rust control path
(`tandem._core.Worker`) that serves many replicas from one thread."""

from __future__ import annotations

import time

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tandem as td
from tandem import _core

JOB = "worker-test"
SECRET = b"s" * 32


def job_of(parallelisms: list[int], replication: int, workers: int | None) -> td.Job:
    job = td.Job("placed", replication=replication, workers=workers)
    stream = job.source(td.sources.Synthetic(rate=10), parallelism=parallelisms[0])
    for i, p in enumerate(parallelisms[1:]):
        stream = stream.map(lambda b: b, parallelism=p, name=f"m{i}")
    stream.sink(td.sinks.Collect())
    return job


@settings(max_examples=60, deadline=None)
@given(
    parallelisms=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    replication=st.integers(1, 4),
    workers=st.none() | st.integers(1, 6),
    cores=st.integers(1, 16),
)
def test_placement_never_puts_two_replicas_of_a_partition_in_one_worker(
    parallelisms, replication, workers, cores
):
    plan = job_of(parallelisms, replication, workers).plan()
    placement = plan.placement(cores=cores)
    placed = [rid for w in placement for rid in w]
    assert sorted(placed) == sorted(plan.replicas()), "every replica exactly once"
    for hosted in placement:
        assert hosted, "no empty worker"
        partitions = [(t, p) for t, p, _ in hosted]
        assert len(partitions) == len(set(partitions)), hosted
    # Sinks run on workers of their own, replica r of every sink partition on sink worker
    # r: losing any replica group's worker leaves them running, and losing a sink worker
    # loses one replica of each sink partition.
    sink_ids = {t.id for t in plan.sinks()}
    sink_workers = [w for w in placement if any(t in sink_ids for t, _, _ in w)]
    assert all(t in sink_ids for w in sink_workers for t, _, _ in w)
    assert len(sink_workers) == max(t.replication for t in plan.sinks())
    # A worker hosts one replica group; a group spans `workers` processes at most.
    per_group = workers or max(1, cores // replication)
    for hosted in placement:
        assert len({r for _, _, r in hosted}) == 1, hosted
    assert len(placement) - len(sink_workers) <= replication * per_group


def test_the_default_placement_fits_the_cores():
    plan = job_of([2, 2, 2], replication=2, workers=None).plan()
    assert len(plan.placement(cores=2)) == 2 + 2  # one worker per group, one per sink copy
    assert len(plan.placement(cores=4)) == 4 + 2  # two per group, split by partition
    plan = job_of([2, 2, 2], replication=1, workers=None).plan()
    assert len(plan.placement(cores=2)) == 2 + 1
    with pytest.raises(td.ConfigError, match="workers"):
        td.Job("bad", workers=0)


# -- the Rust control path, through the binding ------------------------------------------


def rows(n: int) -> pa.RecordBatch:
    return pa.record_batch({"x": pa.array(range(n), pa.int64())})


def two_workers(watermarks: bool):
    """Worker `up` hosts a source slot sending to worker `down`'s one operator slot."""
    down = _core.Worker()
    inbox = _core.Inbox(JOB, SECRET, [(0, 0)], ordering="none", worker=down)
    up = _core.Worker()
    outbox = _core.Outbox(JOB, SECRET, (0, 0, 0), [[("127.0.0.1", inbox.port)]])
    t0 = time.time_ns()
    src = up.add_source([outbox], t0, 1_000_000)  # heartbeat every ms
    op = down.add_task(inbox, [], watermarks)
    return up, src, outbox, down, op, inbox


def drain(worker, until: float = 2.0) -> list:
    items, deadline = [], time.monotonic() + until
    while time.monotonic() < deadline:
        item = worker.next(timeout=0.05)
        if item is not None:
            items.append(item)
    return items


def test_heartbeats_never_reach_python_when_nobody_needs_them():
    up, src, outbox, down, op, inbox = two_workers(watermarks=False)
    up.allow(src, 20)
    assert up.next(timeout=0.1) is None  # the clock sends; nothing for Python
    outbox.emit(rows(3))
    assert drain(up, 0.1) == []
    items = drain(down, 0.5)
    assert [(i.kind, i.slot, i.batch.num_rows) for i in items] == [("data", op, 3)]
    assert up.stats()["heartbeats"] == 20
    # The heartbeats did arrive: the inbox consumed 20 heartbeats and 3 rows.
    assert inbox.stats()["channels"][0]["next_seq"] == 23
    outbox.end()
    # What a slot sends leaves together when the worker is next asked for work.
    assert up.next(timeout=0) is None
    assert [i.kind for i in drain(down, 0.5)] == ["end"]
    outbox.close()
    inbox.close()


def test_watermarks_are_handed_out_in_order_then_forwarded():
    up, src, outbox, down, _op, inbox = two_workers(watermarks=True)
    up.heartbeats_through(src, 2)  # now, whether due or not
    outbox.emit(rows(1))
    up.heartbeats_through(src, 3)
    outbox.end()
    assert up.next(timeout=0) is None  # writes what the slot sent, in one go
    got = [(i.kind, i.epoch) for i in drain(down, 0.5)]
    assert got == [
        ("watermark", 1),
        ("watermark", 2),
        ("data", None),
        ("watermark", 3),
        ("end", None),
    ]
    assert down.stats()["watermarks"] == 3
    outbox.close()
    inbox.close()


def test_a_source_sends_no_heartbeat_it_was_not_allowed():
    up, src, outbox, down, _op, inbox = two_workers(watermarks=True)
    up.allow(src, 2)
    time.sleep(0.01)  # heartbeats 1..10 are due by now
    drain(up, 0.1)
    assert up.stats()["heartbeats"] == 2
    got = [(i.kind, i.epoch) for i in drain(down, 0.3)]
    assert got == [("watermark", 1), ("watermark", 2)]
    outbox.close()
    inbox.close()


def test_bad_slots_are_refused():
    w = _core.Worker()
    with pytest.raises(td.ConfigError, match="heartbeat_ns"):
        w.add_source([], 0, 0)
    inbox = _core.Inbox(JOB, SECRET, [(0, 0)], worker=w)
    inbox.close()
    with pytest.raises(_core.ChannelClosed, match="closed inbox"):
        w.add_task(inbox, [], False)
    with pytest.raises(td.ConfigError, match="no slot 7"):
        w.allow(7, 1)


# -- local channels: replicas of one worker pass Arrow batches in memory -----------------


def values(items) -> list[int]:
    return [v for i in items if i.kind == "data" for v in i.batch.column("x").to_pylist()]


def test_local_and_remote_copies_of_a_stream_deduplicate_against_each_other():
    w = _core.Worker()
    inbox = _core.Inbox(JOB, SECRET, [(0, 0)], worker=w)
    op = w.add_task(inbox, [], False)
    # Replica 0 of upstream partition (0, 0) lives in this worker, replica 1 elsewhere.
    local = _core.Outbox(JOB, SECRET, (0, 0, 0), [[inbox]], batch_rows=4)
    remote = _core.Outbox(JOB, SECRET, (0, 0, 1), [[("127.0.0.1", inbox.port)]], batch_rows=4)
    first = pa.record_batch({"x": pa.array(range(0, 6), pa.int64())})
    second = pa.record_batch({"x": pa.array(range(6, 9), pa.int64())})
    remote.emit(first)  # the remote copy of the first batch may come first...
    local.emit(first)
    local.heartbeat(1)
    local.emit(second)  # ...the local copy of the second surely does
    remote.heartbeat(1)
    remote.emit(second)
    for o in (local, remote):
        o.end()
    items = drain(w, 1.0)
    assert values(items) == list(range(9)), "every row exactly once, in order"
    assert [i.kind for i in items][-1] == "end" and all(i.slot == op for i in items)
    st = inbox.stats()
    (ch,) = st["channels"]
    assert (ch["accepted_rows"], ch["duplicate_rows"]) == (9, 9)
    assert st["divergence_count"] == 0, "the two copies' digests were compared and agree"
    # Only the remote replica holds a connection; the local one never touched a socket.
    assert [c["identity"]["replica"] for c in st["connections"]] == [1]
    for o in (local, remote):
        o.close()
    inbox.close()


def test_a_local_copy_that_differs_from_the_remote_one_fails_the_inbox():
    w = _core.Worker()
    inbox = _core.Inbox(JOB, SECRET, [(0, 0)], worker=w)
    w.add_task(inbox, [], False)
    local = _core.Outbox(JOB, SECRET, (0, 0, 0), [[inbox]])
    remote = _core.Outbox(JOB, SECRET, (0, 0, 1), [[("127.0.0.1", inbox.port)]])
    local.emit(rows(3))
    remote.emit(pa.record_batch({"x": pa.array([0, 1, 7], pa.int64())}))
    for o in (local, remote):
        o.heartbeat(1)
    failed = [i for i in drain(w, 1.0) if i.kind == "failed"]
    assert len(failed) == 1 and isinstance(failed[0].error, td.DeterminismError)
    d = inbox.stats()["divergences"][0]
    assert (d["epoch"], sorted(d["replicas"])) == (1, [0, 1])
    for o in (local, remote):
        o.close()
    inbox.close()


def test_a_full_local_channel_holds_frames_in_the_link_and_the_worker_moves_them_along():
    w = _core.Worker()
    inbox = _core.Inbox(JOB, SECRET, [(0, 0)], ordering="none", queue_capacity=2, worker=w)
    out = _core.Outbox(JOB, SECRET, (0, 0, 0), [[inbox]], batch_rows=1)
    src = w.add_source([out], time.time_ns(), 10**9)
    w.add_task(inbox, [], False)
    n = _core.WORKER_CREDIT_FRAMES + 10
    out.emit(rows(n))  # never blocks: what the channel has no room for waits in the link
    assert not w.ready(src), "a source whose local link is backed up is not served"
    out.end()
    items = drain(w, 1.0)
    assert values(items) == list(range(n))
    assert items[-1].kind == "end"
    assert w.ready(src)
    out.close()
    inbox.close()


def test_a_local_link_fails_like_a_closed_connection():
    w = _core.Worker()
    inbox = _core.Inbox(JOB, SECRET, [(0, 0)], worker=w)
    with pytest.raises(td.ConfigError, match="not an upstream"):
        _core.Outbox(JOB, SECRET, (3, 0, 0), [[inbox]])
    out = _core.Outbox(JOB, SECRET, (0, 0, 0), [[inbox]])
    inbox.close()  # the downstream replica finished
    with pytest.raises(_core.ChannelClosed, match="no output channel has a live downstream"):
        out.emit(rows(2))
    out.close()


# -- the data plane of a live rescale: switch, join, park ----------------------------------


def keyed(lo: int, hi: int) -> pa.RecordBatch:
    return pa.record_batch({"x": pa.array(range(lo, hi), pa.int64())})


def test_an_outbox_switches_to_more_hash_channels_right_after_a_heartbeat():
    from tandem.plan import key_group, key_group_channel

    groups = 16
    w = _core.Worker()
    inboxes = [_core.Inbox(JOB, SECRET, [(0, 0)], worker=w) for _ in range(3)]
    slots = [w.add_task(ib, [], False) for ib in inboxes]
    out = _core.Outbox(
        JOB, SECRET, (0, 0, 0), [[ib] for ib in inboxes[:2]], "hash", "x", key_groups=groups
    )
    out.emit(keyed(0, 40))
    out.switch_at(1, [[ib] for ib in inboxes], "hash", "x", key_groups=groups)
    with pytest.raises(td.ConfigError, match="armed already"):
        out.switch_at(1, [[ib] for ib in inboxes], "hash", "x", key_groups=groups)
    out.emit(keyed(40, 80))  # before heartbeat 1: still two channels
    seqs_before = out.next_seqs
    out.heartbeat(1)
    assert out.last_heartbeat == 1
    assert len(out.next_seqs) == 3
    assert out.next_seqs[:2] == [s + 1 for s in seqs_before], "the channels go on"
    out.emit(keyed(80, 200))
    out.heartbeat(2)
    out.end()
    items = drain(w, 2.0)
    by_slot = {s: [] for s in slots}
    for i in items:
        if i.kind == "data":
            by_slot[i.slot].extend(i.batch.column("x").to_pylist())
    for c, s in enumerate(slots):
        want = [
            v
            for v in range(80)
            if c < 2 and key_group_channel(key_group(v, groups), groups, 2) == c
        ]
        want += [
            v for v in range(80, 200) if key_group_channel(key_group(v, groups), groups, 3) == c
        ]
        assert by_slot[s] == want, f"channel {c}"
    out.close()
    for ib in inboxes:
        ib.close()


def test_a_cancelled_switch_sends_what_no_switch_sends():
    w = _core.Worker()
    inboxes = [_core.Inbox(JOB, SECRET, [(0, 0)], worker=w) for _ in range(3)]
    for ib in inboxes:
        w.add_task(ib, [], False)
    out = _core.Outbox(JOB, SECRET, (0, 0, 0), [[ib] for ib in inboxes[:2]], "hash", "x")
    out.switch_at(1, [[ib] for ib in inboxes], "hash", "x")
    assert out.cancel_switch() and not out.cancel_switch()
    out.heartbeat(1)
    out.emit(keyed(0, 50))
    out.end()
    assert len(out.next_seqs) == 2
    drain(w, 1.0)
    assert inboxes[2].stats()["channels"][0]["next_seq"] == 0, "the third never fed"
    out.close()
    for ib in inboxes:
        ib.close()


def test_a_downstream_replica_joins_new_upstream_partitions_after_a_heartbeat():
    w = _core.Worker()
    inbox = _core.Inbox(JOB, SECRET, [(1, 0)], worker=w)
    slot = w.add_task(inbox, [], False)
    old = _core.Outbox(JOB, SECRET, (1, 0, 0), [[inbox]])
    with pytest.raises(td.ConfigError, match="not an upstream"):
        _core.Outbox(JOB, SECRET, (1, 1, 0), [[inbox]])
    assert w.join_inputs(slot, [(1, 1)], 2) == (1, 2)
    new = _core.Outbox(JOB, SECRET, (1, 1, 0), [[inbox]])
    new.emit(keyed(100, 103))  # waits for the end of cycle 2
    new.heartbeat(3)
    new.end()
    old.emit(keyed(0, 3))
    old.heartbeat(1)
    old.emit(keyed(3, 6))
    old.heartbeat(2)
    old.emit(keyed(6, 9))
    old.heartbeat(3)
    old.end()
    items = drain(w, 2.0)
    seen = [
        (i.channel, v) for i in items if i.kind == "data" for v in i.batch.column("x").to_pylist()
    ]
    assert [v for c, v in seen if c == 0] == list(range(9))
    assert [v for c, v in seen if c == 1] == [100, 101, 102]
    assert seen.index((1, 100)) > seen.index((0, 5)), "no joined row before heartbeat 2 ended"
    assert items[-1].kind == "end"
    for o in (old, new):
        o.close()
    inbox.close()


def test_a_join_is_taken_back_until_the_joined_channels_take_input():
    w = _core.Worker()
    inbox = _core.Inbox(JOB, SECRET, [(1, 0)], worker=w)
    slot = w.add_task(inbox, [], False)
    w.join_inputs(slot, [(1, 1)], 5)
    w.cancel_join(slot)
    assert len(inbox.stats()["channels"]) == 1
    with pytest.raises(td.ConfigError, match="not an upstream"):
        _core.Outbox(JOB, SECRET, (1, 1, 0), [[inbox]])
    w.join_inputs(slot, [(1, 1)], 5)
    new = _core.Outbox(JOB, SECRET, (1, 1, 0), [[inbox]])
    new.emit(keyed(0, 2))
    with pytest.raises(td.ConfigError, match="too late"):
        w.cancel_join(slot)
    new.close()
    inbox.close()


def test_a_parked_inbox_starts_at_the_cut_it_is_unparked_with():
    w = _core.Worker()
    inbox = _core.Inbox(JOB, SECRET, [(0, 0)], worker=w, parked=True)
    assert inbox.parked
    out = _core.Outbox(JOB, SECRET, (0, 0, 1), [[("127.0.0.1", inbox.port)]])
    out.emit(keyed(0, 5))  # seqs 0..5
    out.heartbeat(1)  # seq 5
    out.emit(keyed(5, 8))  # seqs 6..9
    out.end()
    time.sleep(0.05)
    assert inbox.stats()["channels"][0]["next_seq"] == 0, "held by the sender"
    cut = ([6], 0, 1, [False], [], None)  # from seq 6, heartbeat 1 seen
    with pytest.raises(td.ConfigError, match="parked inbox"):
        w.add_task(inbox, [], False)
    inbox.unpark(cut)
    assert not inbox.parked
    with pytest.raises(td.ConfigError, match="not parked"):
        inbox.unpark(cut)
    w.add_task(inbox, [], False, resume=(1, [1], cut, []))
    items = drain(w, 2.0)
    assert values(items) == [5, 6, 7]
    out.close()
    inbox.close()
