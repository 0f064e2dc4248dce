"""End-to-end tests of the TCP transport through Python: upstream replicas send pyarrow
batches with ``tandem._core.Outbox``, downstream replicas receive them with
``tandem._core.Inbox`` (dedup + LiveRobin). Every wait has a timeout: no test can hang."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pyarrow as pa
import pytest

import tandem
from tandem import _core

JOB = "job-e2e"
SECRET = b"correct horse"
TASK = 1
HOST = "127.0.0.1"


def rows(start: int, n: int) -> pa.RecordBatch:
    return pa.record_batch({"v": pa.array(range(start, start + n), type=pa.int64())})


def base(partition: int) -> int:
    return partition * 1_000_000


def run_upstream(
    ports: list[int],
    partition: int,
    replica: int,
    *,
    total: int,
    hb_every: int,
    emit_rows: int,
    batch_rows: int,
    kill_after: int | None = None,
    kill: str = "close",
) -> None:
    """One upstream replica: rows ``base + i``, a heartbeat of epoch k after row
    ``k * hb_every``, then end — or, with ``kill_after``, a crash at that row."""
    downstream = [[(HOST, p) for p in ports]]
    out = _core.Outbox(
        JOB,
        SECRET,
        (TASK, partition, replica),
        downstream,
        batch_rows=batch_rows,
        connect_timeout=10.0,
    )
    b = base(partition)
    i = 0
    while i < total:
        if kill_after is not None and i >= kill_after:
            # Crash: no end marker. "close" still delivers what was queued; "abort" cuts
            # the sockets with frames in flight.
            if kill == "abort":
                out.abort()
            else:
                out.close()
            return
        n = min(emit_rows, total - i, hb_every - i % hb_every)
        out.emit(rows(b + i, n))
        i += n
        if i % hb_every == 0:
            out.heartbeat(i // hb_every)
            time.sleep(0.002)  # let the writers run: a later crash has data in flight
    out.end()
    out.close()


class Threads:
    """Start functions in threads; join them with a timeout and re-raise their errors."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []

    def start(self, fn, *args, **kwargs) -> None:
        def body() -> None:
            try:
                fn(*args, **kwargs)
            except BaseException as e:
                self.errors.append(e)

        t = threading.Thread(target=body, daemon=True)
        t.start()
        self.threads.append(t)

    def join(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
            assert not t.is_alive(), "a sender thread did not finish"
        if self.errors:
            raise self.errors[0]


def consume(inbox: _core.Inbox, limit: float = 60.0) -> list[tuple]:
    """Everything ``inbox`` delivers up to End: per data batch a ``("batch", channel,
    first_seq, rows)`` entry (its boundaries) followed by its rows, and the heartbeats."""
    events: list[tuple] = []
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        d = inbox.next(timeout=0.5)
        if d is None:
            continue
        if d.kind == "end":
            events.append(("end",))
            return events
        if d.kind == "data":
            assert isinstance(d.batch, pa.RecordBatch)
            assert d.batch.num_rows > 0
            events.append(("batch", d.channel, d.first_seq, d.batch.num_rows))
            events.extend(("row", d.channel, v) for v in d.batch.column("v").to_pylist())
        else:
            assert d.kind == "heartbeat"
            events.append(("hb", d.channel, d.epoch, d.first))
    pytest.fail(f"no end within {limit} s after {len(events)} events; stats {inbox.stats()}")


def rows_of(events: list[tuple], channel: int) -> list[int]:
    return [e[2] for e in events if e[0] == "row" and e[1] == channel]


@pytest.fixture
def inboxes():
    """Two replicas of one downstream partition reading upstream partitions 0 and 1."""
    made = [
        _core.Inbox(JOB, SECRET, [(TASK, 0), (TASK, 1)], ordering="liverobin") for _ in range(2)
    ]
    yield made
    for ib in made:
        ib.close()


@pytest.mark.parametrize("kill", ["close", "abort"])
def test_a_crashed_upstream_replica_is_masked_and_replicas_agree(inboxes, kill):
    ports = [ib.port for ib in inboxes]
    total, hb = 12_000, 1_000
    senders = Threads()
    # The replicas of a partition emit the same batches; the two partitions cut differently.
    p0 = {"total": total, "hb_every": hb, "emit_rows": 37, "batch_rows": 29}
    p1 = {"total": total, "hb_every": hb, "emit_rows": 101, "batch_rows": 64}
    senders.start(run_upstream, ports, 0, 0, **p0)
    senders.start(run_upstream, ports, 0, 1, kill_after=5_000, kill=kill, **p0)
    senders.start(run_upstream, ports, 1, 0, **p1)
    senders.start(run_upstream, ports, 1, 1, **p1)

    results: list[list[tuple] | None] = [None, None]

    def take(i: int) -> None:
        results[i] = consume(inboxes[i])

    consumers = Threads()
    for i in range(2):
        consumers.start(take, i)
    consumers.join(timeout=90)
    senders.join()

    a, b = results
    assert a is not None and b is not None
    for c in (0, 1):
        want = [base(c) + i for i in range(total)]
        assert rows_of(a, c) == want, f"channel {c}: complete, in order, no duplicates"
    assert a == b, "both downstream replicas consume the identical batches in the same order"
    first_hbs = [e[2] for e in a if e[0] == "hb" and e[3]]
    assert first_hbs == list(range(1, total // hb + 1)), "each epoch forwarded exactly once"

    for ib in inboxes:
        st = ib.stats()
        assert st["rejected_connections"] == 0
        assert (st["divergence_count"], st["divergences"]) == (0, [])
        assert [c["accepted_rows"] for c in st["channels"]] == [total, total]
        assert [c["upstream"] for c in st["channels"]] == [(TASK, 0), (TASK, 1)]
        crashed = [
            c
            for c in st["connections"]
            if c["identity"] == {"job": JOB, "task": TASK, "partition": 0, "replica": 1}
        ]
        assert len(crashed) == 1 and crashed[0]["frames"] > 0, "the crash happened mid-stream"


def test_garbage_and_failed_handshakes_are_rejected_and_output_is_unchanged():
    with _core.Inbox(JOB, SECRET, [(TASK, 0)], handshake_timeout=0.5) as ib:
        total, hb = 3_000, 500
        senders = Threads()
        senders.start(
            run_upstream, [ib.port], 0, 0, total=total, hb_every=hb, emit_rows=20, batch_rows=50
        )
        # Raw bytes that are not a handshake.
        garbage = socket.create_connection((HOST, ib.port), timeout=5)
        garbage.sendall(bytes((i * 131 + 7) % 256 for i in range(4096)))
        # A peer that knows the job but not the secret.
        with pytest.raises(tandem.AuthenticationError):
            _core.Outbox(JOB, b"wrong", (TASK, 0, 1), [[(HOST, ib.port)]], connect_timeout=5.0)
        # A peer of another job.
        with pytest.raises(tandem.AuthenticationError):
            _core.Outbox("other", SECRET, (TASK, 0, 2), [[(HOST, ib.port)]], connect_timeout=5.0)

        events = consume(ib)
        senders.join()
        garbage.close()
        assert rows_of(events, 0) == list(range(total))
        assert [e[2] for e in events if e[0] == "hb"] == list(range(1, total // hb + 1))
        assert events[-1] == ("end",)

        deadline = time.monotonic() + 5
        while ib.stats()["rejected_connections"] < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        st = ib.stats()
        assert st["rejected_connections"] == 3, st
        errors = [c["error"] for c in st["connections"] if c["error"]]
        assert len(errors) == 3 and all("handshake" in e for e in errors), errors
        good = [c for c in st["connections"] if c["identity"] is not None]
        assert len(good) == 1 and good[0]["error"] is None


def test_hash_partitioning_routes_each_key_to_one_inbox_deterministically():
    inboxes = [_core.Inbox(JOB, SECRET, [(TASK, 0)]) for _ in range(3)]
    try:
        out = _core.Outbox(
            JOB,
            SECRET,
            (TASK, 0, 0),
            [[(HOST, ib.port)] for ib in inboxes],
            partitioner="hash",
            key="k",
            batch_rows=16,
        )
        keys = [f"user-{i % 50}" for i in range(600)]
        batch = pa.record_batch({"v": pa.array(range(600), pa.int64()), "k": keys})
        out.emit(batch)
        out.end()
        assert sum(out.next_seqs) == 600 + 3, "every row once + one end marker per channel"
        out.close()
        seen: dict[str, int] = {}
        total = 0
        for c, ib in enumerate(inboxes):
            got = []
            while (d := ib.next(timeout=10)) is not None and d.kind != "end":
                cols = d.batch.to_pydict()
                got.extend(zip(cols["v"], cols["k"], strict=True))
            assert d is not None, f"inbox {c} timed out"
            assert [v for v, _ in got] == sorted(v for v, _ in got), "emit order kept"
            for _, k in got:
                assert seen.setdefault(k, c) == c, f"key {k} went to two channels"
            total += len(got)
        assert total == 600
        assert len(set(seen.values())) == 3, "50 keys spread over all 3 channels"
    finally:
        for ib in inboxes:
            ib.close()


def test_next_times_out_with_none_and_delivery_fields():
    with _core.Inbox(JOB, SECRET, [(TASK, 0)]) as ib:
        t = time.monotonic()
        assert ib.next(timeout=0.05) is None
        assert time.monotonic() - t < 2
        out = _core.Outbox(JOB, SECRET, (TASK, 0, 0), [[(HOST, ib.port)]])
        out.emit(rows(0, 3))
        out.heartbeat(4)
        assert out.next_seqs == [4]
        out.end()
        out.close()
        d = ib.next(timeout=10)
        assert (d.kind, d.channel, d.first_seq, d.epoch, d.first) == ("data", 0, 0, None, None)
        assert d.batch.equals(rows(0, 3))
        assert "rows=3" in repr(d)
        d = ib.next(timeout=10)
        assert (d.kind, d.channel, d.first_seq, d.epoch, d.first) == ("heartbeat", 0, None, 4, True)
        assert d.batch is None
        d = ib.next(timeout=10)
        assert d.kind == "end" and d.channel is None
        with pytest.raises(AttributeError):
            d.kind = "data"  # frozen
    with pytest.raises(tandem.ChannelClosed):
        ib.next(timeout=0)
    with pytest.raises(tandem.ChannelClosed):
        out.emit(rows(0, 1))


def test_a_channel_whose_downstream_finished_goes_quiet_and_the_others_are_served_on(caplog):
    """Partition 1 of the downstream task finished (on this replica's twin's copies): its
    inbox closed. The replicas of partition 0 may have no feed but this one (its twin
    dropped them as a straggler): this replica goes on serving them, rather than stop
    with their input half sent. Once no channel is left, it is abandoned."""
    from tandem import logs as tlogs

    caplog.set_level(logging.INFO, logger="tandem")
    inboxes = [_core.Inbox(JOB, SECRET, [(0, 0)]) for _ in range(2)]
    out = _core.Outbox(
        JOB,
        SECRET,
        (0, 0, 0),
        [[("127.0.0.1", ib.port)] for ib in inboxes],
        partitioner="broadcast",
        name="sender",
    )
    inboxes[1].close()

    def quiet() -> bool:
        assert tlogs.flush()
        return any("output channel 1 has no live" in r.getMessage() for r in caplog.records)

    sent, deadline = 0, time.monotonic() + 10
    while not quiet():  # until the closed connection is found
        assert time.monotonic() < deadline, "the closed inbox was never noticed"
        out.emit(rows(sent, 64))
        sent += 64
        time.sleep(0.005)
    out.heartbeat(1)
    out.end()
    got = []
    while (d := inboxes[0].next(timeout=10)).kind != "end":
        if d.kind == "data":
            got += d.batch.column("v").to_pylist()
    assert got == list(range(sent))
    out.close()
    # No channel left: abandoned.
    again = _core.Outbox(JOB, SECRET, (0, 0, 1), [[("127.0.0.1", inboxes[0].port)]])
    inboxes[0].close()
    with pytest.raises(tandem.ChannelClosed, match="no output channel has a live downstream"):
        for n in range(10_000):
            again.emit(rows(n, 64))
            time.sleep(0.001)
    again.close()


def test_an_input_whose_every_upstream_replica_is_gone_before_its_end_is_starved():
    """Both replicas of the upstream partition gone mid-stream (aborted: no end marker):
    the inbox says the input is starved — the rest will never come — rather than a quiet
    close (a starved replica is lost, never one that finished early)."""
    with _core.Inbox(JOB, SECRET, [(TASK, 0)]) as ib:
        outs = [_core.Outbox(JOB, SECRET, (TASK, 0, r), [[(HOST, ib.port)]]) for r in (0, 1)]
        for out in outs:
            out.emit(rows(0, 3))
        d = ib.next(timeout=10)
        assert d.kind == "data" and d.batch.num_rows == 3
        for out in outs:
            out.abort()
        deadline = time.monotonic() + 10
        with pytest.raises(tandem.InputStarved, match="lost every upstream replica"):
            while time.monotonic() < deadline:
                ib.next(timeout=0.1)
        assert not issubclass(tandem.InputStarved, tandem.ChannelClosed)


class _CapsuleOnly:
    """Rows behind the Arrow PyCapsule protocol only (not a pyarrow object)."""

    def __init__(self, batch: pa.RecordBatch) -> None:
        self.batch = batch

    def __arrow_c_array__(self, requested_schema=None):
        return self.batch.__arrow_c_array__(requested_schema)


def test_batches_cross_the_boundary_intact_whatever_their_layout_and_schema():
    """Batches move between pyarrow and Rust by their C data only once the schema is known:
    slices, nulls, strings, nested types, schema metadata and a schema change mid-stream
    all come out as they went in."""
    plain = pa.record_batch(
        {
            "n": pa.array([1, None, 3, 4, 5], pa.int64()),
            "s": pa.array(["a", None, "ccc", "", "e"]),
            "l": pa.array([[1], [], None, [2, 3], [4]], pa.list_(pa.int32())),
        }
    )
    tagged = plain.replace_schema_metadata({"origin": "test"})
    other = pa.record_batch({"x": pa.array([0.5, 1.5], pa.float64())})
    sent = [plain, plain.slice(1, 3), tagged, plain.slice(2), other, tagged.slice(4), plain]
    with _core.Inbox(JOB, SECRET, [(TASK, 0)], ordering="none") as ib:
        out = _core.Outbox(JOB, SECRET, (TASK, 0, 0), [[(HOST, ib.port)]])
        for b in sent:
            out.emit(b)
        out.emit(_CapsuleOnly(plain.slice(0, 2)))
        got = [ib.next(timeout=10) for _ in range(len(sent) + 1)]
        out.close()
    for want, d in zip([*sent, plain.slice(0, 2)], got, strict=True):
        assert d.kind == "data"
        assert d.batch.equals(want, check_metadata=True), (want, d.batch)
    with pytest.raises(ValueError, match="__arrow_c_array__"):
        out.emit([1, 2, 3])


def test_outbox_sends_each_emit_at_once_in_frames_cut_at_fixed_offsets():
    with _core.Inbox(JOB, SECRET, [(TASK, 0)], ordering="none") as ib:
        out = _core.Outbox(JOB, SECRET, (TASK, 0, 0), [[(HOST, ib.port)]], batch_rows=4)
        out.emit(rows(0, 3))
        d = ib.next(timeout=10)
        assert d is not None and (d.first_seq, d.batch.num_rows) == (0, 3), "no timer to wait for"
        out.emit(rows(3, 10))
        got = [ib.next(timeout=10) for _ in range(3)]
        assert [(d.first_seq, d.batch.num_rows) for d in got] == [(3, 4), (7, 4), (11, 2)]
        out.close()


def emit_all(out: _core.Outbox, cuts: list[int]) -> list[tuple[int, int, bytes]]:
    """Emit rows 0.. in batches of ``cuts`` rows, a heartbeat after each, then end; return
    the digests."""
    start = 0
    for epoch, n in enumerate(cuts, start=1):
        out.emit(rows(start, n))
        out.heartbeat(epoch)
        start += n
    out.end()
    return out.digests()


def test_outbox_digests_follow_rows_and_batch_boundaries():
    with _core.Inbox(JOB, SECRET, [(TASK, 0)], queue_capacity=64) as ib:
        outs = [
            _core.Outbox(JOB, SECRET, (TASK, 0, r), [[(HOST, ib.port)]], batch_rows=4)
            for r in range(3)
        ]
        a = emit_all(outs[0], [5, 3])
        b = emit_all(outs[1], [5, 3])
        assert [(c, e) for c, e, _ in a] == [(0, 1), (0, 2), (0, 2**64 - 1)]
        assert all(isinstance(d, bytes) and len(d) == 16 for _, _, d in a)
        assert a == b, "the same batches give the same digests"
        assert outs[0].digests() == [], "digests() drains"
        # Cycle 1's rows emitted as 2 + 3 (frames of 2 and 3 rows, not 4 and 1): only that
        # cycle's digest differs.
        outs[2].emit(rows(0, 2))
        outs[2].emit(rows(2, 3))
        outs[2].heartbeat(1)
        outs[2].emit(rows(5, 3))
        outs[2].heartbeat(2)
        outs[2].end()
        c = outs[2].digests()
        assert c[0] != a[0] and c[1:] == a[1:]
        for out in outs:
            out.close()


def run_twin(port: int, replica: int, differ_in: int | None = None) -> None:
    """Replica ``replica`` of upstream partition 0: heartbeat cycles 1..3 of 10 rows each,
    then end. In cycle ``differ_in``, replica 1 emits other values (as a non-deterministic
    operator would)."""
    out = _core.Outbox(JOB, SECRET, (TASK, 0, replica), [[(HOST, port)]], batch_rows=4)
    for epoch in (1, 2, 3):
        shift = 1000 if replica == 1 and epoch == differ_in else 0
        out.emit(rows(10 * (epoch - 1) + shift, 10))
        out.heartbeat(epoch)
    out.end()
    out.close()


def all_closed(ib: _core.Inbox, connections: int = 2) -> dict:
    """``ib.stats()`` once its ``connections`` connections were read to their end."""
    deadline = time.monotonic() + 10
    while True:
        st = ib.stats()
        if sum(not c["open"] for c in st["connections"]) == connections:
            return st
        assert time.monotonic() < deadline, f"connections stay open: {st}"
        time.sleep(0.01)


def test_replicas_with_equal_output_pass_the_determinism_check():
    with _core.Inbox(JOB, SECRET, [(TASK, 0)]) as ib:
        senders = Threads()
        for r in (0, 1):
            senders.start(run_twin, ib.port, r)
        events = consume(ib)
        senders.join()
        assert rows_of(events, 0) == list(range(30))
        st = all_closed(ib)
        assert (st["divergence_count"], st["divergences"]) == (0, [])
        assert st["channels"][0]["duplicate_rows"] > 0, "both replicas were compared"


def test_divergent_replicas_make_next_raise_determinism_error():
    with _core.Inbox(JOB, SECRET, [(TASK, 0)], on_divergence="fail") as ib:
        senders = Threads()
        for r in (0, 1):
            senders.start(run_twin, ib.port, r, differ_in=2)
        deadline = time.monotonic() + 30
        with pytest.raises(tandem.DeterminismError) as info:
            while time.monotonic() < deadline:
                ib.next(timeout=0.2)
        senders.join()
        assert isinstance(info.value, tandem.TandemError)
        (d,) = ib.stats()["divergences"]
        assert (d["channel"], d["upstream"], d["epoch"]) == (0, (TASK, 0), 2)
        assert sorted(d["replicas"]) == [0, 1]
        a, b = d["replicas"]
        msg = str(info.value)
        for needle in (
            f"replicas {a} and {b} of upstream task {TASK} partition 0",
            "heartbeat cycle 2",
            *d["digests"],
            "not deterministic for a given input batch",
            'on_divergence="log"',
        ):
            assert needle in msg, (needle, msg)
        with pytest.raises(tandem.DeterminismError):
            ib.next(timeout=0)
        assert all_closed(ib)["divergence_count"] == 1, "cycles 1 and 3 agree"


def test_divergent_replicas_under_log_are_reported_and_delivery_goes_on(caplog):
    caplog.set_level(logging.WARNING, logger="tandem")
    with _core.Inbox(JOB, SECRET, [(TASK, 0)], on_divergence="log") as ib:
        senders = Threads()
        for r in (0, 1):
            senders.start(run_twin, ib.port, r, differ_in=2)
        events = consume(ib)
        senders.join()
        assert len(rows_of(events, 0)) == 30 and events[-1] == ("end",)
        st = all_closed(ib)
        assert st["divergence_count"] == 1
        (d,) = st["divergences"]
        assert (d["channel"], d["upstream"], d["epoch"]) == (0, (TASK, 0), 2)
        assert sorted(d["replicas"]) == [0, 1]
        first, second = d["digests"]
        assert len(first) == len(second) == 32 and first != second
    tandem.logs.flush()
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == "tandem.core.inbox" and "different output digests" in r.getMessage()
    ]
    assert len(lines) == 1 and "heartbeat cycle 2" in lines[0], lines


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"ordering": "fifo"}, "ordering"),
        ({"queue_capacity": -1}, "queue_capacity"),
        ({"port": 70000}, "port"),
        ({"host": "localhost:1"}, "host"),
        ({"upstreams": []}, "upstreams"),
        ({"upstreams": [(1, 0), (1, 0)]}, "twice"),
        ({"upstreams": [(-1, 0)]}, "task"),
        ({"max_frame_bytes": 0}, "max_frame_bytes"),
        ({"on_divergence": "warn"}, "'fail' or 'log', got \"warn\""),
    ],
)
def test_inbox_bad_arguments_raise_config_error(kwargs, needle):
    args = {"upstreams": [(TASK, 0)], **kwargs}
    upstreams = args.pop("upstreams")
    with pytest.raises(tandem.ConfigError, match=needle):
        _core.Inbox(JOB, SECRET, upstreams, **args)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"partitioner": "shuffle"}, "shuffle"),
        ({"partitioner": "hash"}, "key"),
        ({"key": "k"}, "only meaningful"),
        ({"batch_rows": 0}, "batch_rows"),
        ({"me": (1, -2, 0)}, "partition"),
        ({"downstream": []}, "downstream"),
        ({"downstream": [[]]}, r"downstream\[0\]"),
        ({"downstream": [[(HOST, 0)]]}, "port"),
    ],
)
def test_outbox_bad_arguments_raise_config_error(kwargs, needle):
    args = {"me": (TASK, 0, 0), "downstream": [[(HOST, 1)]], **kwargs}
    me = args.pop("me")
    downstream = args.pop("downstream")
    with pytest.raises(tandem.ConfigError, match=needle):
        _core.Outbox(JOB, SECRET, me, downstream, **args)


def test_outbox_fails_fast_when_no_downstream_replica_listens():
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    t = time.monotonic()
    with pytest.raises(tandem.ChannelClosed, match="reachable"):
        _core.Outbox(JOB, SECRET, (TASK, 0, 0), [[(HOST, port)]], connect_timeout=0.2)
    assert time.monotonic() - t < 5


def test_ordering_none_delivers_every_channel_completely():
    """The ``none`` baseline: per-channel order and completeness hold; the interleaving of
    channels is whatever arrived first (not compared across replicas)."""
    with _core.Inbox(JOB, SECRET, [(TASK, 0), (TASK, 1)], ordering="none") as ib:
        senders = Threads()
        for p in (0, 1):
            for r in (0, 1):
                senders.start(
                    run_upstream,
                    [ib.port],
                    p,
                    r,
                    total=4_000,
                    hb_every=500,
                    emit_rows=33 + 10 * p,
                    batch_rows=40 + 7 * p,
                )
        events = consume(ib)
        senders.join()
        for c in (0, 1):
            assert rows_of(events, c) == [base(c) + i for i in range(4_000)]
        assert [e[2] for e in events if e[0] == "hb" and e[3]] == list(range(1, 9))


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_getaffinity"), reason="Linux only")
def test_close_joins_every_io_thread():
    import os

    def native_threads() -> int:
        return len(os.listdir("/proc/self/task"))

    before = native_threads()
    ib = _core.Inbox(JOB, SECRET, [(TASK, 0)])
    outs = [_core.Outbox(JOB, SECRET, (TASK, 0, r), [[(HOST, ib.port)]]) for r in range(2)]
    silent = socket.create_connection((HOST, ib.port), timeout=5)  # stuck in the handshake
    for out in outs:
        out.emit(rows(0, 10))
    assert ib.next(timeout=10) is not None
    deadline = time.monotonic() + 5
    while len(ib.stats()["connections"]) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert native_threads() >= before + 1 + 3 + 2, "accept + 3 readers + 2 writers"
    for out in outs:
        out.close()
    t = time.monotonic()
    ib.close()
    assert time.monotonic() - t < 2, "close must not wait for the silent peer's timeout"
    silent.close()
    assert native_threads() == before


def test_back_pressure_blocks_the_sender_without_holding_the_gil():
    capacity, batch_rows, total = 2, 64, 64 * 400  # 25,600 rows of 1 KiB: > socket buffers
    pad = b"x" * 1024

    def fat(start: int) -> pa.RecordBatch:
        return pa.record_batch(
            {"v": pa.array(range(start, start + batch_rows), pa.int64()), "pad": [pad] * batch_rows}
        )

    with _core.Inbox(JOB, SECRET, [(TASK, 0)], queue_capacity=capacity) as ib:
        out = _core.Outbox(
            JOB, SECRET, (TASK, 0, 0), [[(HOST, ib.port)]], batch_rows=batch_rows, queue_frames=2
        )
        progress = [0]

        def send() -> None:
            for i in range(0, total, batch_rows):
                out.emit(fat(i))
                progress[0] = i + batch_rows
            out.end()

        sender = Threads()
        sender.start(send)
        time.sleep(0.3)
        # The sender is blocked inside emit(); this thread still runs Python and calls in.
        stalled = progress[0]
        assert stalled < total, "a consumer that read nothing received everything"
        assert out.next_seqs[0] <= stalled + batch_rows  # readable while emit() is blocked
        assert ib.stats()["channels"][0]["queued_seqs"] <= capacity * batch_rows
        got: list[int] = []
        deadline = time.monotonic() + 60
        while (d := ib.next(timeout=1)) is None or d.kind != "end":
            assert time.monotonic() < deadline, f"stuck after {len(got)} rows"
            if d is not None and d.kind == "data":
                got.extend(d.batch.column("v").to_pylist())
            assert ib.stats()["channels"][0]["queued_seqs"] <= capacity * batch_rows
        sender.join()
        out.close()
        assert got == list(range(total))
