"""Kafka in and out: the Kafka source, heartbeats in the log, the exactly-once Kafka sink.

Everything runs against the real broker `tandem services` starts (the `kafka`
fixture); what a job wrote is read back by a plain confluent-kafka ``read_committed``
consumer here, independently of the engine's own check.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, deque

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from confluent_kafka import KafkaException, Producer
from hypothesis import example, given, settings
from hypothesis import strategies as st

import tandem as td
from tandem import _core, heartbeat, reference, testing
from tandem.engines import local
from tandem.heartbeat import HEADER, LogSchedule, LogStep, marker_header, marker_ns
from tandem.kafka import (
    TransactionalWriter,
    decode_positions,
    encode_positions,
    ensure_positions_topic,
    recover_positions,
)
from tandem.testing import new_topic, read_committed

pytestmark = pytest.mark.timeout(180)

SCHEMA = {"key": "int64", "amount": "int64"}


def produce(bootstrap: str, topic: str, rows: list[dict], partitions: int) -> None:
    """Row ``i`` goes to partition ``i % partitions`` as a JSON object."""
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for i, row in enumerate(rows):
        p.produce(topic, json.dumps(row).encode(), partition=i % partitions)
    assert p.flush(30) == 0


# -- the schedule: a pure function of the log ----------------------------------------------

H = 1_000  # heartbeat period (ns) in the schedule's own unit tests


def _records(draw_ops) -> list[tuple[int, int | None]]:
    """(offset, marker instant or None) records from a list of ops."""
    return [(i, op) for i, op in enumerate(draw_ops)]


ops = st.lists(
    st.one_of(
        st.none(),  # a data row
        st.integers(min_value=0, max_value=40).map(lambda k: k * H + 3),  # a marker
        st.just(-1),  # a malformed marker
    ),
    max_size=300,
)


@settings(max_examples=200, deadline=None)
@given(
    log=ops,
    cuts=st.lists(st.integers(min_value=1, max_value=50), max_size=20),
    batch_rows=st.integers(min_value=1, max_value=17),
    t0=st.integers(min_value=0, max_value=10 * H),
    last=st.one_of(st.none(), st.integers(min_value=1, max_value=30)),
)
def test_the_schedule_is_a_function_of_the_log_not_of_how_it_arrives(
    log, cuts, batch_rows, t0, last
):
    records = _records(log)

    def run(chunks):
        sched = LogSchedule(H, t0, last, batch_rows, marker=lambda r: r[1])
        steps = []
        for chunk in chunks:
            steps += sched.feed(chunk)
        return [(s.kind, [r[0] for r in s.records], s.epoch) for s in steps]

    whole = run([records])
    pieces, at = [], 0
    for n in cuts:
        pieces.append(records[at : at + n])
        at += n
    pieces.append(records[at:])
    assert run(pieces) == whole == run([[r] for r in records])

    # Batches hold data rows only, never span a taken marker, and are cut at every
    # batch_rows-th data row; heartbeats are the markers taken, strictly increasing.
    taken, rows_seen, epochs = t0 // H, 0, []
    expect_batches: list[list[int]] = []
    current: list[int] = []
    ended = False
    for off, m in records:
        if m is None:
            current.append(off)
            rows_seen += 1
            if rows_seen % batch_rows == 0:
                expect_batches.append(current)
                current = []
        elif m >= 0 and m // H > taken:
            taken = m // H
            if current:
                expect_batches.append(current)
                current = []
            epochs.append(taken - t0 // H)
            if last is not None and epochs[-1] >= last:
                ended = True
                break
    assert [b for kind, b, _ in whole if kind == "rows"] == expect_batches
    assert [e for kind, _, e in whole if kind == "heartbeat"] == epochs
    assert all(a < b for a, b in itertools.pairwise(epochs))
    assert ([k for k, _, _ in whole].count("end") == 1) == ended
    if ended:
        assert whole[-1][0] == "end"

    # A replica rebuilt from a cut at any heartbeat, reading the log from the record after
    # that heartbeat's marker, emits exactly what follows it in the whole schedule.
    full = LogSchedule(H, t0, last, batch_rows, marker=lambda r: r[1]).feed(records)
    for i, step in enumerate(full):
        if step.kind != "heartbeat":
            continue
        after = step.records[0][0] + 1
        rebuilt = LogSchedule(
            H, t0, last, batch_rows, marker=lambda r: r[1], resume=(step.epoch, step.rows)
        ).feed(records[after:])
        assert rebuilt == full[i + 1 :]


def test_offsets_are_asked_again_while_a_new_topic_has_no_leader_yet():
    """Planning right after create_topics may find a partition without its leader yet
    (NOT_LEADER_FOR_PARTITION): asked again until the timeout; any other error at once."""
    from confluent_kafka import KafkaError

    from tandem.kafka import _once_led

    answers = [KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE, None]
    calls = []

    def call():
        calls.append(1)
        code = answers[len(calls) - 1]
        if code is not None:
            raise KafkaException(KafkaError(code))
        return (0, 7)

    assert _once_led(call, timeout=5.0) == (0, 7) and len(calls) == 3

    def fails(code):
        def call():
            calls.append(1)
            raise KafkaException(KafkaError(code))

        return call

    calls.clear()
    with pytest.raises(KafkaException):
        _once_led(fails(KafkaError._TRANSPORT), timeout=5.0)
    assert len(calls) == 1  # not a leader question: raised at once
    calls.clear()
    with pytest.raises(KafkaException):
        _once_led(fails(KafkaError.NOT_LEADER_FOR_PARTITION), timeout=0.25)
    assert 2 <= len(calls) <= 5  # asked again until the timeout, then raised


def test_marker_headers():
    assert marker_ns([(HEADER, marker_header(17, 10_000_000))]) == 170_000_000
    assert marker_ns(None) is None
    assert marker_ns([("other", b"x")]) is None
    assert marker_ns([(HEADER, b"junk")]) == -1


# -- the generator -------------------------------------------------------------------------


def test_heartbeats_command_marks_every_partition_with_wall_clock_epochs(kafka):
    topic = new_topic(kafka.kafka_bootstrap, 3, "hb")
    began = time.time_ns()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.cli",
            "heartbeats",
            "--bootstrap",
            kafka.kafka_bootstrap,
            "--topic",
            topic,
            "--heartbeat-ms",
            "20",
            "--duration",
            "0.6",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    ended = time.time_ns()
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout
    records = read_committed(kafka.kafka_bootstrap, topic, 3)
    by_part: dict[int, list[int]] = {}
    for m in records:
        assert m.value() is None and m.key() is None
        header = dict(m.headers())[HEADER].decode()
        epoch, period = map(int, header.split("/"))
        assert period == 20_000_000
        assert began // period <= epoch <= ended // period
        by_part.setdefault(m.partition(), []).append(epoch)
    assert set(by_part) == {0, 1, 2}
    for epochs in by_part.values():
        assert epochs == sorted(set(epochs)) and len(epochs) >= 10
    assert by_part[0] == by_part[1] == by_part[2]


# -- the source: offsets fixed at plan time, one partition per Kafka partition ------------


def test_start_offsets_are_resolved_once_when_the_job_is_planned(kafka):
    b = kafka.kafka_bootstrap
    topic = new_topic(b, 2, "start")
    produce(b, topic, [{"key": i, "amount": i} for i in range(6)], 2)
    now_ms = int(time.time() * 1000)
    time.sleep(0.05)
    produce(b, topic, [{"key": i, "amount": i} for i in range(4)], 2)

    def planned(start, parallelism=None):
        job = td.Job("start", replication=2)
        src = td.sources.Kafka(topic, bootstrap=b, start=start, schema=SCHEMA)
        job.source(src, parallelism=parallelism).sink(td.sinks.Collect())
        return job.plan().tasks[0].source.offsets

    assert planned("earliest") == (0, 0)
    assert planned("latest") == (5, 5)
    assert planned(now_ms) == (3, 3)
    assert planned({0: 1, 1: 2}) == (1, 2)
    latest = planned("latest")
    produce(b, topic, [{"key": 1, "amount": 1}] * 2, 2)
    assert planned("latest") == (6, 6) != latest  # a new plan, a new resolution

    with pytest.raises(td.ConfigError, match="2 partitions"):
        planned("earliest", parallelism=3)
    with pytest.raises(td.ConfigError, match="every partition"):
        planned({0: 1})
    with pytest.raises(td.ConfigError, match="outside"):
        planned({0: 1, 1: 99})
    with pytest.raises(td.ConfigError, match="does not exist"):
        td.Job("x").source(td.sources.Kafka("no-such-topic-here", bootstrap=b))
    with pytest.raises(td.ConfigError, match="event_time"):
        td.sources.Kafka(topic, bootstrap=b, event_time="ts")


# -- Kafka in, Kafka out, with faults --------------------------------------------------------


def keep(batch: pa.RecordBatch) -> pa.Array:
    return pc.not_equal(pc.bit_wise_and(batch.column("amount"), 3), 0)


def mean_of_amount(batch: pa.RecordBatch) -> pa.RecordBatch:
    # A function of the whole batch: replicas handed different batches would diverge.
    return testing.with_batch_mean(batch, "amount")


def feed_during_run(
    monkeypatch, bootstrap: str, topic: str, rows: list[dict], first: int, burst: int, every: float
) -> tuple[threading.Thread, list[float]]:
    """Start writing ``rows[first:]`` into ``topic`` (row ``j`` to partition ``j % 2``)
    once the next job's workers are ready: ``burst`` rows every ``every`` seconds from
    t0 + 0.1 s. Returns the thread and a list that gets when the last row was written
    (seconds after t0)."""
    ready = threading.Event()
    monkeypatch.setattr(local, "ON_READY", lambda _addresses: ready.set())
    fed: list[float] = []

    def feed() -> None:
        ready.wait(60)
        t0 = time.monotonic() + local.STARTUP_S
        p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})
        for at, i in enumerate(range(first, len(rows), burst)):
            time.sleep(max(0.0, t0 + 0.1 + at * every - time.monotonic()))
            for j in range(i, min(i + burst, len(rows))):
                p.produce(topic, json.dumps(rows[j]).encode(), partition=j % 2)
            p.poll(0)
        assert p.flush(30) == 0
        fed.append(time.monotonic() - t0)

    feeder = threading.Thread(target=feed)
    feeder.start()
    return feeder, fed


def test_kafka_to_kafka_exactly_once_through_a_replica_and_a_generator_kill(
    kafka, no_orphans, monkeypatch
):
    b = kafka.kafka_bootstrap
    src_topic = new_topic(b, 2, "in")
    out_topic = new_topic(b, 2, "out")
    rows = [{"key": i % 13, "amount": i} for i in range(3_000)]
    produce(b, src_topic, rows[:1_000], 2)  # a backlog, read from "earliest"

    job = td.Job("k2k", replication=2, heartbeat_ms=10)
    events = job.source(td.sources.Kafka(src_topic, bootstrap=b, schema=SCHEMA), name="in")
    counted = (
        events.map(mean_of_amount, name="mean")
        .filter(keep, name="keep")
        .key_by("key")
        .process(td.CountPerKey(), parallelism=2, name="count")
    )
    counted.sink(
        td.sinks.Kafka(out_topic, bootstrap=b, columns=["key", "amount", "count"], key="key")
    )
    assert job.plan().tasks[0].parallelism == 2  # the topic's partition count

    # The rest of the input arrives while the job runs, in small bursts from t0 + 0.1 s to
    # t0 + 1.6 s: well before the heartbeat the sources end at (t0 + 2.5 s).
    duration = 2.5
    feeder, fed = feed_during_run(monkeypatch, b, src_topic, rows, 1_000, 20, 0.015)
    faults = [td.KillHeartbeats(0, at=0.5), td.Kill("count", partition=0, replica=1, at=1.0)]
    result = job.run(duration=duration, faults=faults, progress=False)
    feeder.join()
    assert fed and fed[0] < duration - 0.3, f"the input was not all written in time ({fed})"

    assert result.lost == 0 and result.duplicates == 0
    assert result.digests_match and not result.determinism_errors
    assert testing.lost_replicas(result) == testing.killed_replicas(result) != set()
    assert result.events_in == len(rows)
    assert [f["kind"] for f in result.faults] == ["killheartbeats", "kill"]

    # An outside read_committed consumer sees every expected row exactly once.
    got = Counter()
    for m in read_committed(b, out_topic, 2):
        r = json.loads(m.value())
        assert m.key() == str(r["key"]).encode()
        got[(r["key"], r["amount"], r["count"])] += 1
    kept = [r for r in rows if r["amount"] & 3]
    # A row's count depends on the order the two source partitions were merged in, so
    # compare per key: every kept row once, with the counts 1..n of its key.
    per_key: dict[int, list[tuple[int, int]]] = {}
    for (key, amount, count), n in got.items():
        assert n == 1, f"row {(key, amount, count)} read {n} times"
        per_key.setdefault(key, []).append((amount, count))
    want = Counter(r["key"] for r in kept)
    assert sorted(per_key) == sorted(want)
    for key, items in per_key.items():
        assert sorted(a for a, _ in items) == sorted(r["amount"] for r in kept if r["key"] == key)
        assert sorted(c for _, c in items) == list(range(1, want[key] + 1))


def test_partitions_that_take_different_epochs_still_match_the_reference(kafka, no_orphans):
    """The job's own marker writer (``generators=0``) marks partition 0 every epoch and
    partition 1 every other epoch, rows going to both between markers: partition 1's
    channel jumps two epochs at each marker it takes. The replicas send every epoch on
    every channel, and the reference must merge the partitions as they do (a reference
    sending only the epochs taken counted the rows in another order: lost == duplicates
    > 0 for any such run, as on a loaded machine whose generators skip epochs)."""
    b = kafka.kafka_bootstrap
    src_topic = new_topic(b, 2, "in")
    heartbeat_ms = 20
    period = heartbeat_ms * 1_000_000
    job = td.Job("k2k-skips", replication=2, heartbeat_ms=heartbeat_ms)
    src = td.sources.Kafka(src_topic, bootstrap=b, schema=SCHEMA, generators=0)
    events = job.source(src, name="in")
    events.key_by("key").process(td.CountPerKey(), name="count").sink(td.sinks.Collect())
    done = threading.Event()
    marked: list[int] = [0, 0]

    def mark() -> None:  # a generator, but partition 1 gets the even epochs only
        p = Producer({"bootstrap.servers": b, "linger.ms": 0})
        n, epoch = 0, time.time_ns() // period + 1
        while not done.is_set():
            done.wait(max(0.0, (epoch * period - time.time_ns()) / 1e9))
            epoch = max(epoch, time.time_ns() // period)
            for _ in range(6):
                p.produce(
                    src_topic, json.dumps({"key": n % 3, "amount": n}).encode(), partition=n % 2
                )
                n += 1
            for part in (0, 1) if epoch % 2 == 0 else (0,):
                header = [(HEADER, marker_header(epoch, period))]
                p.produce(src_topic, value=None, partition=part, headers=header)
                marked[part] += 1
            p.poll(0)
            epoch += 1
        assert p.flush(30) == 0

    writer = threading.Thread(target=mark)
    writer.start()
    try:
        result = job.run(duration=1.5, progress=False)
    finally:
        done.set()
        writer.join(60)
    assert marked[0] > marked[1] > 10  # partition 1 skipped every other epoch
    assert result.events_in > 100
    assert result.digests_match and not result.determinism_errors
    assert result.lost == 0 and result.duplicates == 0
    assert result.events_out == result.events_in


def counted_from_kafka(job: td.Job, bootstrap: str, topic: str):
    """``topic`` (2 partitions) through a whole-batch map and a 2-partition CountPerKey."""
    events = job.source(td.sources.Kafka(topic, bootstrap=bootstrap, schema=SCHEMA), name="in")
    return (
        events.map(mean_of_amount, name="mean")
        .key_by("key")
        .process(td.CountPerKey(), parallelism=2, name="count")
    )


def longest_pause(out: list, fault_ms: float) -> tuple[int, float]:
    """The longest pause between the records' produce times (an outside reader's view of
    the output), and where it began relative to ``fault_ms``; rows were committed on both
    sides of the fault."""
    stamps = sorted(m.timestamp()[1] for m in out)
    assert stamps[0] < fault_ms < stamps[-1]
    gap, at = max((later - t, t) for t, later in itertools.pairwise(stamps))
    return gap, at - fault_ms


def assert_counted_once(out: list[dict], rows: list[dict]) -> None:
    """``out`` holds every row of ``rows`` exactly once, with the counts 1..n of its key."""
    got = Counter((r["key"], r["amount"], r["count"]) for r in out)
    assert max(got.values()) == 1, [row for row, n in got.items() if n > 1][:5]
    assert sorted(r["amount"] for r in out) == list(range(len(rows)))
    counts = Counter(r["key"] for r in rows)
    for key, n in counts.items():
        assert sorted(r["count"] for r in out if r["key"] == key) == list(range(1, n + 1))


def test_a_lost_kafka_source_replica_is_rebuilt_from_its_twins_log_position(kafka, no_orphans):
    """Job(restore=True): the worker holding replica 0 of everything is killed and rebuilt
    from the twins' cuts — a rebuilt Kafka source replica reads on from the record after
    the marker its twin took at the cut — then the twins' worker is killed: the rebuilt
    replicas alone carry the job to its end, exactly once."""
    b = kafka.kafka_bootstrap
    src_topic, out_topic = new_topic(b, 2, "rin"), new_topic(b, 2, "rout")
    rows = [{"key": i % 11, "amount": i} for i in range(3_000)]
    produce(b, src_topic, rows[:500], 2)
    job = td.Job("kafka-restore", replication=2, restore=True, batch_rows=64)
    counted = counted_from_kafka(job, b, src_topic)
    counted.sink(td.sinks.Kafka(out_topic, bootstrap=b, columns=["key", "amount", "count"]))

    def feed() -> None:  # the rest arrives during the first 2.5 s of the run
        p = Producer({"bootstrap.servers": b, "linger.ms": 0})
        for i in range(500, 3_000, 50):
            time.sleep(0.05)
            for j in range(i, i + 50):
                p.produce(src_topic, json.dumps(rows[j]).encode(), partition=j % 2)
            p.poll(0)
        assert p.flush(30) == 0

    feeder = threading.Thread(target=feed)
    feeder.start()
    faults = [td.Kill("in", 0, 0, at=1.0), td.Kill("in", 0, 1, at=3.5)]
    result = job.run(duration=5.0, faults=faults, progress=False)
    feeder.join()

    assert result.lost == 0 and result.duplicates == 0
    assert result.digests_match, result.determinism_errors
    rebuilt = {(r["task"], r["partition"], r["replica"]) for r in result.restored_replicas}
    assert {("in", 0, 0), ("in", 1, 0), ("count", 0, 0)} <= rebuilt
    assert result.events_in == len(rows)
    assert_counted_once([json.loads(m.value()) for m in read_committed(b, out_topic, 2)], rows)


@pytest.mark.parametrize("marker_ms", [None, 50])
def test_a_kafka_source_stops_at_a_savepoint_and_resumes_from_its_log_position(
    kafka, no_orphans, tmp_path, marker_ms
):
    """A Kafka source's cut is a place in its log: stopped at a savepoint while its input
    still arrives, the job resumes — at 3 partitions of the keyed count — from the record
    after the marker each source partition took as the cut's heartbeat, with what arrived
    while it was stopped: every row once across the two runs, each key's counts 1..n.
    ``marker_ms=50``: one generator of our own marks the log every 5 of the job's 10 ms
    heartbeats, so the cut mostly falls inside the heartbeats one marker sends: the
    resumed source sends the rest of them first, as the stopped one did."""
    b = kafka.kafka_bootstrap
    topic = new_topic(b, 2, "sp-in")
    rows = [{"key": i % 11, "amount": i} for i in range(3_000)]
    produce(b, topic, rows[:300], 2)
    marking = threading.Event()
    if marker_ms is not None:
        threading.Thread(
            target=heartbeat.generate, args=(b, [topic], marker_ms), kwargs={"stop": marking}
        ).start()
    generators = {} if marker_ms is None else {"generators": 0}

    def job(parallelism: int) -> td.Job:
        j = td.Job("kafka-savepoint", replication=2, batch_rows=64)
        source = td.sources.Kafka(topic, bootstrap=b, schema=SCHEMA, **generators)
        events = j.source(source, name="in")
        events.key_by("key").process(td.CountPerKey(), parallelism=parallelism, name="count").sink(
            td.sinks.Collect()
        )
        return j

    def feed() -> None:  # rows 300..2000 over about 6.8 s: the stop comes amid them
        p = Producer({"bootstrap.servers": b, "linger.ms": 0})
        for i in range(300, 2_000, 50):
            time.sleep(0.2)
            for j in range(i, i + 50):
                p.produce(topic, json.dumps(rows[j]).encode(), partition=j % 2)
            p.poll(0)
        assert p.flush(30) == 0

    path = str(tmp_path / "sp")
    handle = job(2).start(progress=False)
    feeder = threading.Thread(target=feed)
    feeder.start()
    time.sleep(4.0)  # the job starts, then runs a while
    first = handle.stop(timeout=120, savepoint=path)
    feeder.join()
    produce(b, topic, rows[2_000:], 2)  # while the job is stopped
    saved = td.Savepoint.read(path)
    positions = saved.sources["in"]
    assert [p["partition"] for p in positions] == [0, 1]
    assert all(p["offset"] > 0 for p in positions)
    assert 300 < sum(p["rows"] for p in positions) == first.events_in < 2_000
    for part in saved.partitions:
        if part["task"] == "in":  # the marker its log goes on after: the cut's, or later
            _, _, marker = part["log_position"]
            assert marker >= part["epoch"] == saved.epoch
            print(f"in[{part['partition']}]: cut at {saved.epoch}, marker {marker}")

    try:
        second = job(3).run(
            from_savepoint=path, duration=saved.source_time_s + 3.0, progress=False, timeout=120
        )
    finally:
        marking.set()
    assert first.digests_match and second.digests_match
    # Its sources count the rows before the cut in (they start there), its sink does not.
    assert second.events_in == len(rows) and second.events_out == len(rows) - first.events_in
    out = first.output.to_pylist() + second.output.to_pylist()
    assert_counted_once(out, rows)


def test_raw_records_arrive_once_and_markers_never_reach_an_operator(kafka, no_orphans):
    b = kafka.kafka_bootstrap
    topic = new_topic(b, 2, "raw")
    p = Producer({"bootstrap.servers": b})
    sent = {}
    for i in range(400):
        key, value = f"k{i}".encode(), f"v{i}".encode()
        p.produce(topic, value, key, partition=i % 2, headers=[("user-header", b"x")])
        sent[value] = key
    assert p.flush(30) == 0

    def no_markers(batch: pa.RecordBatch) -> pa.RecordBatch:
        for value in batch.column("value").to_pylist():
            if value is None or not value.startswith(b"v"):
                raise AssertionError(f"a record that is no data row reached an operator: {value!r}")
        return batch

    job = td.Job("raw", replication=2, heartbeat_ms=5, batch_rows=64)
    src = job.source(td.sources.Kafka(topic, bootstrap=b))
    src.map(no_markers, name="check").sink(td.sinks.Collect())
    result = job.run(duration=1.0, progress=False)
    assert result.lost == 0 and result.duplicates == 0 and result.digests_match
    out = result.output
    assert out.num_rows == 400 == result.events_in
    assert (
        dict(zip(out.column("value").to_pylist(), out.column("key").to_pylist(), strict=True))
        == sent
    )
    # source_seq is the record's offset: partition p holds rows p, p + 2, ... in order.
    for v, seq in zip(
        out.column("value").to_pylist(), out.column("source_seq").to_pylist(), strict=True
    ):
        assert seq == int(v[1:]) // 2


def test_commit_ms_spaces_transactions_and_still_commits_unasked(kafka):
    """With ``commit_s`` a writer starts a transaction at most that often, whatever the
    rate of puts, and commits what waits once the interval passed, with no further put."""
    b = kafka.kafka_bootstrap
    topic = new_topic(b, 1, "spaced")
    w = TransactionalWriter(b, topic, f"spaced-{uuid.uuid4().hex[:8]}", commit_s=0.25)
    w.ready(30)
    began = time.monotonic()
    sent = [f"r{i}".encode() for i in range(100)]
    for value in sent:
        w.put([(value, None, 0)])
        time.sleep(0.01)
    spent = time.monotonic() - began
    # At most one transaction per 0.25 s began (the first at once).
    assert 1 <= w.transactions <= int(spent / 0.25) + 1, (w.transactions, spent)
    w.put([(b"last", None, 0)])
    deadline = time.monotonic() + 30
    while w.committed_rows < len(sent) + 1:
        assert time.monotonic() < deadline, "what waited was never committed"
        time.sleep(0.02)
    w.close()
    assert [m.value() for m in read_committed(b, topic, 1)] == [*sent, b"last"]


def test_commit_ms_must_be_a_number_of_milliseconds():
    for bad in (-1, float("nan"), float("inf"), "100", True):
        with pytest.raises(td.ConfigError, match="commit_ms must be a number of milliseconds"):
            td.sinks.Kafka("t", "127.0.0.1:1", commit_ms=bad)
    assert td.sinks.Kafka("t", "127.0.0.1:1", commit_ms=100).commit_ms == 100


def test_a_second_writer_with_the_same_transactional_id_fences_the_first(kafka):
    b = kafka.kafka_bootstrap
    topic = new_topic(b, 1, "fence")
    tid = f"fence-{uuid.uuid4().hex[:8]}"
    first = TransactionalWriter(b, topic, tid)
    first.put([(b"committed-1", None, 0)])
    first.close()  # committed, and its producer kept open

    # A transaction left open, as by a sink that crashed before its commit.
    first.producer.begin_transaction()
    first.producer.produce(topic, b"never-committed", partition=0)
    first.producer.flush(10)

    second = TransactionalWriter(b, topic, tid)
    second.ready(30)  # it fenced the first and aborted its open transaction
    with pytest.raises(KafkaException) as fenced:
        first.producer.produce(topic, b"zombie", partition=0)
        first.producer.commit_transaction(10)
    assert fenced.value.args[0].fatal()
    second.put([(b"committed-2", None, 0)])
    ranges = second.close()
    assert set(ranges) == {0}

    values = [m.value() for m in read_committed(b, topic, 1)]
    assert values == [b"committed-1", b"committed-2"]


def test_an_aborted_transaction_is_invisible_to_read_committed(kafka):
    b = kafka.kafka_bootstrap
    topic = new_topic(b, 1, "abort")
    w = TransactionalWriter(b, topic, f"abort-{uuid.uuid4().hex[:8]}")
    p = w.producer
    w.put([(b"a", None, 0)])
    w.close()
    p.begin_transaction()
    p.produce(topic, b"aborted", partition=0)
    p.abort_transaction(10)
    p.begin_transaction()
    p.produce(topic, b"b", partition=0)
    p.commit_transaction(10)
    assert [m.value() for m in read_committed(b, topic, 1)] == [b"a", b"b"]


# -- a sink restarted from the position its last transaction stored -------------------------

# A sink's cut as the core hands it out: (epoch, per-channel heartbeat epochs, (positions,
# turn, gen, ended, orders, order log), per-output (seqs, rows)) — a sink has no outputs.
CUT_A = (7, [7, 8], ([120, 96], 0, None, [False, False], [], None), [])
RUN = 1_700_000_000_000_000_000  # a job run's t0
CUT_B = (9, [9, 9], ([180, 140], 1, 3, [False, True], [(1, 140)], (2, 5, [180, 140], 44)), [])


def test_a_positions_record_gives_the_core_its_cut_back():
    for cut in (CUT_A, CUT_B, None):
        value = encode_positions(cut, 77, 12, 3, {0: (4, 9), 1: (0, 2)})
        record = decode_positions(value)
        assert record["cut"] == cut and record["run"] == 77
        assert (record["rows"], record["transactions"]) == (12, 3)
        assert record["ranges"] == {"0": [4, 9], "1": [0, 2]}
    # The core takes the cut it gave: an inbox bound with it starts at its positions.
    inbox = _core.Inbox(
        "j",
        b"s" * 32,
        [(0, 0), (0, 1)],
        ordering="none",
        resume=decode_positions(encode_positions(CUT_A, 77, 0, 0, {}))["cut"][2],
    )
    assert [c["next_seq"] for c in inbox.stats()["channels"]] == [120, 96]
    inbox.close()


def test_a_writer_with_positions_commits_only_what_a_mark_covers(kafka):
    """Each transaction holds the rows queued before the latest mark and, with them, the
    mark's cut; rows after it wait. What a lost writer committed last is read back after
    fencing it, and a writer resumed from it goes on counting."""
    b = kafka.kafka_bootstrap
    topic = new_topic(b, 1, "pos-out")
    positions = f"{topic}.positions"
    ensure_positions_topic(b, positions, 2)
    ensure_positions_topic(b, positions, 2)  # exists: fine
    with pytest.raises(td.ConfigError, match="has 2 partitions, but its sink has 3"):
        ensure_positions_topic(b, positions, 3)
    tid = f"pos-{uuid.uuid4().hex[:8]}"
    assert recover_positions(b, tid, positions, 1, RUN) is None  # nothing committed yet

    first = TransactionalWriter(b, topic, tid, positions=(positions, 1, RUN))
    first.put([(b"r1", None, 0), (b"r2", None, 0)])
    first.mark(CUT_A)
    first.put([(b"r3", None, 0)])  # after the mark: not in the first transaction
    deadline = time.monotonic() + 30
    while first.transactions < 1:
        assert time.monotonic() < deadline, "no transaction within 30 s"
        time.sleep(0.02)
    first.abort()  # lost before r3 was marked

    found = recover_positions(b, tid, positions, 1, RUN)
    assert found["cut"] == CUT_A and (found["rows"], found["transactions"]) == (2, 1)
    assert [m.value() for m in read_committed(b, topic, 1)] == [b"r1", b"r2"]

    second = TransactionalWriter(b, topic, tid, positions=(positions, 1, RUN))
    second.resume(found)
    second.mark(CUT_B)  # no rows after it: committed alone, once POSITIONS_EVERY_S passed
    deadline = time.monotonic() + 30
    while second.transactions < 2:
        assert time.monotonic() < deadline, "no positions-only transaction within 30 s"
        time.sleep(0.02)
    assert recover_positions(b, tid, positions, 1, RUN)["cut"] == CUT_B
    second = TransactionalWriter(b, topic, tid, positions=(positions, 1, RUN))  # fenced it
    second.resume(found)
    second.put([(b"r3", None, 0)])
    assert set(second.close()) == {0}
    last = recover_positions(b, tid, positions, 1, RUN)
    assert last["cut"] is None and last["rows"] == 3  # the input ended
    assert [m.value() for m in read_committed(b, topic, 1)] == [b"r1", b"r2", b"r3"]
    # A later run of the job that has committed nothing yet starts from the beginning,
    # not from this run's positions.
    assert recover_positions(b, tid, positions, 1, RUN + 1) is None
    assert recover_positions(b, tid, positions, 0, RUN) is None  # another sink partition's


def _values(batch: pa.RecordBatch) -> list:
    return [(str(v).encode(), None, 0) for v in batch.column("v").to_pylist()]


def _rows(*values: int) -> pa.RecordBatch:
    return pa.record_batch([pa.array(values, pa.int64())], names=["v"])


def _cut(epoch: int, *positions: int) -> tuple:
    """A sink slot's cut at heartbeat ``epoch`` with these input positions."""
    return (epoch, [epoch] * len(positions), (list(positions), 0, None, [False] * 2, [], None), [])


@pytest.mark.parametrize("standby_behind", [False, True], ids=["caught-up", "behind"])
def test_a_standby_writer_takes_over_from_its_owners_last_commit_exactly_once(
    kafka, standby_behind
):
    """Two writers of one sink partition fed the same input (two channels, sequence
    numbers with heartbeats between batches): the owner commits through a mark, then is
    lost with rows queued after it; the standby takes the id (the owner is fenced: its
    next commit fails), reads that mark back and writes what came after it, from what it
    held and what it gets next. A standby behind the owner's commit drops the rows it
    gets that the owner had committed, and stores no earlier position. Every row once."""
    b = kafka.kafka_bootstrap
    topic = new_topic(b, 1, "own-out")
    positions = f"{topic}.positions"
    ensure_positions_topic(b, positions, 1)
    tid = f"own-{uuid.uuid4().hex[:8]}"
    owner = TransactionalWriter(b, topic, tid, positions=(positions, 0, RUN))
    standby = TransactionalWriter(
        b, topic, tid, positions=(positions, 0, RUN), encode=_values, standby=True
    )
    owner.ready(30)
    # Through heartbeat 1: channel 0 rows at seqs 0-2 (its heartbeat at 3), channel 1 at
    # 0-1 (heartbeat at 2).
    a, c = _rows(0, 1, 2), _rows(10, 11)
    owner.put(_values(a) + _values(c))
    owner.mark(_cut(1, 4, 3))
    deadline = time.monotonic() + 30
    while owner.transactions < 1:
        assert time.monotonic() < deadline, "the owner committed nothing within 30 s"
        time.sleep(0.02)
    later_a, later_c = _rows(3, 4), _rows(12)  # seqs 4-5 and 3: never committed by it
    owner.put(_values(later_a) + _values(later_c))
    if standby_behind:
        standby.receive(0, 0, a)  # channel 1's first rows come after the takeover
    else:
        for channel, seq, rows in [(0, 0, a), (1, 0, c), (0, 4, later_a), (1, 3, later_c)]:
            standby.receive(channel, seq, rows)
        standby.mark(_cut(2, 7, 5))
    standby.take_over()
    if standby_behind:
        standby.receive(1, 0, c)  # the owner committed these: dropped
        standby.mark(_cut(1, 4, 3))  # not after the owner's commit: not stored
        for channel, seq, rows in [(0, 4, later_a), (1, 3, later_c)]:
            standby.receive(channel, seq, rows)
        standby.mark(_cut(2, 7, 5))
    standby.receive(0, 7, _rows(5))
    standby.mark(_cut(3, 9, 6))
    standby.close()
    assert standby.took_over_s is not None and standby.took_over_s < 10
    # The lost owner, if it is not dead, can commit nothing any more.
    owner.mark(_cut(2, 7, 5))
    with pytest.raises(KafkaException):
        owner.close()
    got = sorted(int(m.value()) for m in read_committed(b, topic, 1))
    assert got == [0, 1, 2, 3, 4, 5, 10, 11, 12]
    last = recover_positions(b, tid, positions, 0, RUN)
    assert last["cut"] is None and last["rows"] == 9  # the totals go on across the owners


def test_a_standby_that_no_longer_holds_the_rows_after_the_last_commit_says_so(kafka):
    """A takeover needs every row after the owner's last commit: a standby that dropped
    some as older than it keeps fails, naming the channel and what to look at."""
    b = kafka.kafka_bootstrap
    topic = new_topic(b, 1, "own-old")
    positions = f"{topic}.positions"
    ensure_positions_topic(b, positions, 1)
    tid = f"old-{uuid.uuid4().hex[:8]}"
    standby = TransactionalWriter(
        b, topic, tid, positions=(positions, 0, RUN), encode=_values, standby=True, hold_s=0.05
    )
    standby.receive(0, 0, _rows(1, 2))
    time.sleep(0.1)
    standby.receive(0, 2, _rows(3))  # the first rows are now older than 50 ms: dropped
    standby.take_over()  # the owner committed nothing: every row was needed
    with pytest.raises(td.TandemError, match=r"committed nothing .*no longer holds .*channel 0"):
        standby.close()


def test_a_replicated_kafka_sinks_owner_lost_a_twin_writes_on_exactly_once(
    kafka, no_orphans, monkeypatch
):
    """The Kafka sink at r = 2 (its default): replica 0 of each partition writes, replica 1
    stands by. The sink worker of replica 0 is SIGKILLed mid-stream, rows arriving before
    and after: each partition's twin fences the lost writer, reads where its last
    transaction stood and writes on from there with the rows it held — no replay, no
    restart, and no Job(restore=True) needed. An outside read_committed consumer reads
    every row exactly once, and the output pauses for no longer than the takeover."""
    b = kafka.kafka_bootstrap
    src_topic, out_topic = new_topic(b, 2, "own-in"), new_topic(b, 2, "own-out")
    rows = [{"key": i % 11, "amount": i} for i in range(3_000)]
    produce(b, src_topic, rows[:500], 2)
    job = td.Job("kafka-sink-owner", batch_rows=64, replication=2)
    counted = counted_from_kafka(job, b, src_topic)
    sink = td.sinks.Kafka(out_topic, bootstrap=b, columns=["key", "amount", "count"])
    counted.sink(sink, parallelism=2, name="out")
    assert job.plan().task("out").replication == 2

    feeder, fed = feed_during_run(monkeypatch, b, src_topic, rows, 500, 50, 0.048)
    result = job.run(duration=4.0, faults=[td.Kill("out", 0, 0, at=1.0)], progress=False)
    feeder.join()
    assert fed and fed[0] < 3.5, f"the input was not all written in time ({fed})"

    assert testing.lost_replicas(result) == {("out", 0, 0), ("out", 1, 0)}
    assert result.restored_replicas == []  # nothing restarted: the twins took over
    handed = {(h["task"], h["partition"]): h for h in result.sink_handovers}
    assert set(handed) == {("out", 0), ("out", 1)}
    assert all(h["from"] == 0 and h["to"] == 1 for h in handed.values()), handed
    assert result.lost == 0 and result.duplicates == 0, (result.lost, result.duplicates)
    assert result.events_in == result.events_out == len(rows)
    out = read_committed(b, out_topic, 2)
    assert_counted_once([json.loads(m.value()) for m in out], rows)
    parts = result.outputs["out"]
    assert all(p["took_over_s"] is not None for p in parts), parts
    # Rows were committed on both sides of the kill, and the longest pause between the
    # records' produce times is the takeover.
    kill_ms = result.t0_ns / 1e6 + 1000
    gap, at = longest_pause(out, kill_ms)
    print(
        f"sink takeover: {[round(p['took_over_s'] * 1000) for p in parts]} ms from the "
        f"fence to writing; longest output pause {gap} ms, from {at:+.0f} ms "
        "after the kill"
    )
    assert gap < 1500, f"the output paused {gap} ms"  # a restart: 700 ms and more


def test_a_frozen_kafka_sink_owner_is_declared_lost_and_its_twin_writes_on(
    kafka, no_orphans, monkeypatch
):
    """The Kafka sink's owner frozen (SIGSTOP) mid-stream for 4 s, in a job that restores:
    a silent owner stops every reader's output, so — unlike a silent copy of another sink,
    whose twin writes on anyway — it is declared lost after failure_timeout_ms like an
    operator, fenced, and its twin takes over its writes. Every row exactly once for an
    outside read_committed consumer, and the output pauses for about the failure timeout,
    not for the freeze."""
    b = kafka.kafka_bootstrap
    src_topic, out_topic = new_topic(b, 2, "frz-in"), new_topic(b, 2, "frz-out")
    rows = [{"key": i % 11, "amount": i} for i in range(3_000)]
    produce(b, src_topic, rows[:500], 2)
    job = td.Job(
        "kafka-sink-frozen", batch_rows=64, replication=2, restore=True, failure_timeout_ms=1000
    )
    counted = counted_from_kafka(job, b, src_topic)
    sink = td.sinks.Kafka(out_topic, bootstrap=b, columns=["key", "amount", "count"])
    counted.sink(sink, parallelism=2, name="out")

    feeder, fed = feed_during_run(monkeypatch, b, src_topic, rows, 500, 50, 0.048)
    freeze = td.Pause("out", 0, 0, at=1.0, for_s=4.0)
    result = job.run(duration=6.0, faults=[freeze], progress=False)
    feeder.join()
    assert fed and fed[0] < 3.5, f"the input was not all written in time ({fed})"

    assert ("out", 0, 0) in testing.lost_replicas(result)
    causes = {r["cause"] for r in result.lost_replicas if r["task"] == "out"}
    assert causes == {"silent"}, result.lost_replicas
    assert {(h["partition"], h["from"], h["to"]) for h in result.sink_handovers} >= {(0, 0, 1)}
    assert result.lost == 0 and result.duplicates == 0, (result.lost, result.duplicates)
    out = read_committed(b, out_topic, 2)
    assert_counted_once([json.loads(m.value()) for m in out], rows)
    freeze_ms = result.t0_ns / 1e6 + 1000
    gap, at = longest_pause(out, freeze_ms)
    print(f"frozen owner: longest output pause {gap} ms, from {at:+.0f} ms")
    assert gap < 3000, f"the output paused {gap} ms (the freeze was 4000 ms)"


@pytest.mark.parametrize(
    "knobs",
    [{"replication": 2, "restore": True}, {"replication": 1, "checkpoint_ms": 500}],
    ids=["restore", "passive"],
)
def test_a_killed_kafka_sink_restarts_from_its_committed_position_exactly_once(
    kafka, no_orphans, monkeypatch, knobs
):
    """Job(restore=True) at r = 2, and the passive baseline: the worker of the Kafka
    sink (both its partitions) is SIGKILLed mid-stream, rows arriving before and after.
    The engine fences its producers, reads the input positions their last transactions
    stored, restarts the sinks from there and has the live upstream replicas replay the
    rest from their replay windows (which held the sinks' output meanwhile): an outside
    read_committed consumer reads every row exactly once."""
    b = kafka.kafka_bootstrap
    src_topic, out_topic = new_topic(b, 2, "sin"), new_topic(b, 2, "sout")
    rows = [{"key": i % 11, "amount": i} for i in range(3_000)]
    produce(b, src_topic, rows[:500], 2)
    job = td.Job("kafka-sink-restart", batch_rows=64, **knobs)
    counted = counted_from_kafka(job, b, src_topic)
    sink = td.sinks.Kafka(out_topic, bootstrap=b, columns=["key", "amount", "count"])
    counted.sink(sink, parallelism=2, name="out", replication=1)  # restarted, not replicated

    # The rest arrives while the job runs, from t0 + 0.1 s to t0 + 2.5 s; the kill is at
    # t0 + 1.0 s, the sources end at t0 + 4 s.
    feeder, fed = feed_during_run(monkeypatch, b, src_topic, rows, 500, 50, 0.048)
    result = job.run(duration=4.0, faults=[td.Kill("out", 0, 0, at=1.0)], progress=False)
    feeder.join()
    assert fed and fed[0] < 3.5, f"the input was not all written in time ({fed})"

    assert testing.lost_replicas(result) == {("out", 0, 0), ("out", 1, 0)}
    restarted = {(r["task"], r["partition"]): r for r in result.restored_replicas}
    assert set(restarted) == {("out", 0), ("out", 1)}
    for r in restarted.values():
        # From a position stored in a transaction, not from the beginning (which would
        # write the rows committed before the kill again).
        assert r["sink"] and r["epoch"] > 0, r
    assert result.lost == 0 and result.duplicates == 0, (result.lost, result.duplicates)
    assert result.events_in == result.events_out == len(rows)
    out = read_committed(b, out_topic, 2)
    assert_counted_once([json.loads(m.value()) for m in out], rows)
    # Rows were committed on both sides of the kill (the restart wrote some), and the
    # sinks' downtime shows as the longest pause between the records' produce times.
    kill_ms = result.t0_ns / 1e6 + 1000
    gap, at = longest_pause(out, kill_ms)
    print(
        f"sink restart: linked {[r['restore_ms'] for r in restarted.values()]} ms after the "
        f"kill; longest output pause {gap} ms, from {at:+.0f} ms after the kill"
    )


def test_a_sink_restart_the_replay_windows_no_longer_reach_fails_naming_replay_ms(
    kafka, no_orphans
):
    """Replay windows of 50 ms cannot reach back to a position committed before the kill
    by the time the sink is back: the job fails, naming the sink partitions and the knob."""
    b = kafka.kafka_bootstrap
    src_topic, out_topic = new_topic(b, 2, "win"), new_topic(b, 2, "wout")
    produce(b, src_topic, [{"key": i % 5, "amount": i} for i in range(500)], 2)
    job = td.Job("kafka-sink-window", replication=2, restore=True, replay_ms=50)
    counted = counted_from_kafka(job, b, src_topic)
    counted.sink(td.sinks.Kafka(out_topic, bootstrap=b), name="out", replication=1)
    with pytest.raises(td.TandemError, match=r"out\[0\] replica 0 .*raise Job\(replay_ms"):
        job.run(duration=3.0, faults=[td.Kill("out", 0, 0, at=1.0)], progress=False)


def test_generator_specs_and_the_fault_are_checked(kafka):
    b = kafka.kafka_bootstrap
    topic = new_topic(b, 2, "spec")
    job = td.Job("specs", replication=2)
    job.source(td.sources.Kafka(topic, bootstrap=b, generators=3)).sink(td.sinks.Collect())
    plan = job.plan()
    assert [s.topics for s in heartbeat.specs(plan)] == [(topic,)] * 3
    with pytest.raises(td.ConfigError, match="runs 3 heartbeat generators"):
        job.run(duration=1, faults=[td.KillHeartbeats(3, at=0.5)])
    synthetic = td.Job("nokafka")
    synthetic.source(td.sources.Synthetic(rate=10)).sink(td.sinks.Collect())
    with pytest.raises(td.ConfigError, match="no Kafka source"):
        synthetic.run(duration=1, faults=[td.KillHeartbeats(0, at=0.5)])


@pytest.mark.spark
@pytest.mark.parametrize("victim", ["count", "sink"])
def test_kafka_to_kafka_on_spark_with_a_worker_killed(kafka, victim):
    """The same source, generators and sink on the Spark engine: the generators run on the
    driver, the source replicas read Kafka inside the worker tasks. The worker killed
    runs a replica of ``count``, or the Kafka sink's owner — whose twin takes over, as on
    the local engine (the one coordinator hands it over)."""
    import tandem_spark

    b = kafka.kafka_bootstrap
    src_topic, out_topic = new_topic(b, 2, "sin"), new_topic(b, 2, "sout")
    rows = [{"key": i % 7, "amount": i} for i in range(2_000)]
    produce(b, src_topic, rows, 2)
    job = td.Job("spark-kafka", replication=2)
    events = job.source(td.sources.Kafka(src_topic, bootstrap=b, schema=SCHEMA))
    counted = events.key_by("key").process(td.CountPerKey(), parallelism=2, name="count")
    counted.sink(
        td.sinks.Kafka(out_topic, bootstrap=b, columns=["key", "amount", "count"]), name="out"
    )
    spark = tandem_spark.local_session(job)
    try:
        kill = (
            td.Kill("count", partition=0, replica=1, at=1.0)
            if victim == "count"
            else td.Kill("out", partition=0, replica=0, at=1.0)
        )
        result = job.run(duration=2.0, faults=[kill], engine=tandem_spark.SparkEngine(spark))
    finally:
        spark.stop()
    assert result.lost == 0 and result.duplicates == 0 and result.digests_match
    if victim == "sink":
        assert [(h["task"], h["from"], h["to"]) for h in result.sink_handovers] == [("out", 0, 1)]
    assert result.events_in == len(rows)
    out = [json.loads(m.value()) for m in read_committed(b, out_topic, 2)]
    assert sorted(r["amount"] for r in out) == list(range(len(rows)))
    counts = Counter(r["key"] for r in rows)
    for key, n in counts.items():
        assert sorted(r["count"] for r in out if r["key"] == key) == list(range(1, n + 1))


@settings(max_examples=25, deadline=None)
@given(logs=st.tuples(ops, ops), batch_rows=st.integers(min_value=1, max_value=6))
# Partition 1 takes epoch 2 without epoch 1: at the replicas its channel carries
# heartbeats 1 and 2, so partition 0's row after its marker 1 is merged before
# partition 1's row.
@example(logs=([None, 1 * H + 3, None], [2 * H + 3, None]), batch_rows=1)
def test_the_reference_merges_log_partitions_as_the_replicas_do(logs, batch_rows):
    """Two partitions of a log source, each cut by its schedule, into an operator merging
    them with LiveRobin: the Rust core (source slots sending what the runtime sends for
    each step, ``heartbeats_through`` for a marker taken) hands the operator the batches
    in the order the reference executor's merge takes them. The partitions take different
    markers — one skips epochs the other took, as under a loaded generator — and the
    merge ends a channel's cycle on every heartbeat element, so the reference must put
    every epoch on a channel, as a source slot does, not only the epochs taken."""
    job, secret = "log-merge", b"s" * 32
    steps = []
    for p, log in enumerate(logs):
        sched = LogSchedule(H, 0, None, batch_rows, marker=lambda r: r[1])
        mine = sched.feed([(p * 100_000 + i, m) for i, m in enumerate(log)])
        if sched.pending:
            mine.append(LogStep("rows", sched.pending))
        steps.append([*mine, LogStep("end")])

    def batch(records) -> pa.RecordBatch:
        return pa.record_batch({"x": pa.array([r[0] for r in records], pa.int64())})

    queues = [
        deque(("data", batch(e[1])) if e[0] == "rows" else e for e in reference.log_entries(s))
        for s in steps
    ]
    want = [
        step[2].column("x").to_pylist()
        for step in reference.live_robin(queues)
        if step[0] == "data"
    ]

    down = _core.Worker()
    inbox = _core.Inbox(job, secret, [(0, 0), (0, 1)], ordering="liverobin", worker=down)
    up = _core.Worker()
    outboxes = [
        _core.Outbox(job, secret, (0, p, 0), [[("127.0.0.1", inbox.port)]]) for p in range(2)
    ]
    slots = [up.add_source([ob], time.time_ns(), H) for ob in outboxes]
    op = down.add_task(inbox, [], False)
    got: list[list[int]] = []
    ended = False

    def collect(timeout: float) -> None:
        nonlocal ended
        up.next(timeout=0)  # writes what the slots sent
        while (item := down.next(timeout=timeout)) is not None:
            assert item.slot == op
            if item.kind == "data":
                got.append(item.batch.column("x").to_pylist())
            else:
                assert item.kind == "end", item
                ended = True
                return
            timeout = 0

    try:
        for p, mine in enumerate(steps):
            for step in mine:
                if step.kind == "rows":
                    outboxes[p].emit(batch(step.records))
                elif step.kind == "heartbeat":
                    up.heartbeats_through(slots[p], step.epoch)
                else:
                    outboxes[p].end()
                collect(0)
        deadline = time.monotonic() + 30
        while not ended and time.monotonic() < deadline:
            collect(0.05)
        assert ended, "the merge did not end within 30 s"
        assert got == want
    finally:
        for ob in outboxes:
            ob.close()
        inbox.close()


# -- tandem bench kafka ------------------------------------------------------------------


def test_bench_kafka_runs_both_sources_and_loses_nothing(kafka, tmp_path, capsys):
    """A short `tandem bench kafka`: the same job on a synthetic and on a Kafka source,
    both checked against the reference; the timing ratio is reported, not asserted (CI
    machines are loaded)."""
    from tandem import cli
    from tandem.experiments import kafka as bench_kafka

    out = tmp_path / "kafka.json"
    argv = ["bench", "kafka", "--rate", "1000", "--warmup", "1", "--measure", "2"]
    assert cli.main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "p99: Kafka" in printed and "synthetic" in printed
    assert "Kafka's delivery alone" in printed
    doc = json.loads(out.read_text())
    assert doc["experiment"] == "kafka" and doc["target_p99_ratio"] == 1.5
    assert doc["median_p99_ratio"] == rows_ratio(doc)
    rows = {r["source"]: r for r in doc["rows"]}
    assert set(rows) == set(bench_kafka.SOURCES)
    for r in rows.values():
        assert r["lost"] == 0 and r["duplicates"] == 0 and r["digests_match"], r
        assert r["events_out"] > 0 and r["p50_ms"] is not None and r["p99_ms"] is not None
        assert r["cpu_s"] > 0 and r["rate"] == 1000
    for name in ("kafka", "delivery"):
        row = rows[name]
        assert row["producer_cpu_s"] is not None and row["p99_ratio"] == round(
            row["p99_ms"] / rows["synthetic"]["p99_ms"], 2
        )
    # Kafka's delivery alone: every record of the measured second, at each of the four
    # readers (2 partitions x 2 replicas), in offset order with none missing.
    assert rows["delivery"]["events_out"] == 2 * 1000 * 2


def rows_ratio(doc: dict) -> float:
    return next(r["p99_ratio"] for r in doc["rows"] if r["source"] == "kafka")


def test_bench_kafka_refuses_options_it_does_not_take(capsys):
    from tandem import cli

    with pytest.raises(SystemExit) as exc:  # a flag of other experiments'
        cli.main(["bench", "kafka", "--duration", "5"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --duration 5" in capsys.readouterr().err
    assert cli.main(["bench", "kafka", "--measure", "0"]) == 2
    assert "measured time > 0 s" in capsys.readouterr().err
    assert cli.main(["bench", "kafka", "--rounds", "0"]) == 2
    assert "rounds must be an int >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # a flag of `tandem bench kafka`'s
        cli.main(["bench", "mib1", "--rounds", "2"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --rounds 2" in capsys.readouterr().err


json_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
    st.lists(st.integers(), max_size=2),
)


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(
        st.dictionaries(st.sampled_from(["a", "b", "c"]), json_values, max_size=3), max_size=8
    ),
    types=st.lists(
        st.sampled_from(["int64", "float64", "bool", "string", "int32", "timestamp[ms]"]),
        min_size=3,
        max_size=3,
    ),
    nullable=st.booleans(),
    raw=st.sampled_from([None, b"[1]", b'{"a": 1, "a": 2}', b'{"a": 1}{"a": 2}', b"{"]),
)
@example(
    rows=[{"a": 1, "b": 2, "c": "x"}, {"a": -5, "b": 0.5, "d": 1}, {"b": None}],
    types=["int64", "float64", "string"],
    nullable=True,
    raw=None,
)
def test_small_kafka_batches_parse_as_read_json_does(rows, types, nullable, raw):
    """Python's json parses a small batch only where it cannot differ from read_json (which
    then decides: the same columns, or the same error)."""
    import io

    import pyarrow.json as pajson

    from tandem.sources import _parse_small

    schema = pa.schema(
        [pa.field(n, pa.type_for_alias(t), nullable) for n, t in zip("abc", types, strict=True)]
    )
    values = [json.dumps(r).encode() for r in rows] + ([raw] if raw is not None else [])
    if not values:
        return
    small = _parse_small(schema, values)
    if small is None:
        assert rows != [{"a": 1, "b": 2, "c": "x"}, {"a": -5, "b": 0.5, "d": 1}, {"b": None}]
        return
    table = pajson.read_json(
        io.BytesIO(b"\n".join(values)),
        read_options=pajson.ReadOptions(use_threads=False),
        parse_options=pajson.ParseOptions(
            explicit_schema=schema, unexpected_field_behavior="ignore", newlines_in_values=True
        ),
    )
    assert table.num_rows == len(values)
    for col, got in zip(table.columns, small, strict=True):
        assert col.combine_chunks().equals(got), (col, got)
