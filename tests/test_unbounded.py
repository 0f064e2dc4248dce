"""Jobs that run until stopped: ``job.start()`` / ``handle.stop()``, ``job.run()`` without a
duration, ``tandem run job.py`` stopped by SIGTERM, bounded sources that end a job by
themselves.

A stopped run must be a run of exactly the length where it stopped: every replica of every
source ends at the same stop point, what is in flight reaches the sinks, the output is
the reference executor's for that length, and no process is left behind. Besides the
engine's own check (lost / duplicates against the reference), the tests read the output
back and check that it is exactly the source's rows ``0 .. n-1``.
"""

from __future__ import annotations

import itertools
import json
import signal
import textwrap
import threading
import time

import psutil
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tandem as td
from jobs import reaped, tandem_run
from tandem import testing
from tandem.cli import main
from tandem.engines import local
from tandem.engines.common import multiset_diff

pytestmark = pytest.mark.timeout(180)

RATE = 1_000


def bucket(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch.append_column("bucket", pc.bit_wise_and(batch.column("key"), 7))


def pipeline(sink: td.sinks.Sink, rate: int = RATE, limit: int | None = None) -> td.Job:
    job = td.Job("forever", replication=2)
    src = job.source(td.sources.Synthetic(rate=rate, keys=50, seed=11, limit=limit), parallelism=2)
    src.map(bucket, name="bucket").key_by("key").process(
        td.CountPerKey(), parallelism=2, name="count"
    ).sink(sink)
    return job


def assert_every_row_once(seqs: list[int], n: int) -> None:
    """The output holds source rows ``0 .. n-1``, each exactly once."""
    assert len(seqs) == n, f"{len(seqs)} rows out, {n} in"
    assert sorted(seqs) == list(range(n))


def workers_of(pid: int) -> set[int]:
    """The worker processes (``-m tandem.engines.worker``) under process ``pid``."""
    found = set()
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return found
    for child in children:
        try:
            if "tandem.engines.worker" in " ".join(child.cmdline()):
                found.add(child.pid)
        except psutil.Error:
            continue
    return found


def alive(pids: set[int]) -> set[int]:
    left = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.add(pid)
        except psutil.Error:
            continue
    return left


def wait_for_workers(pid: int, timeout: float = 60.0) -> set[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = workers_of(pid)
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"no worker process appeared under {pid} within {timeout:g} s")


# -- the schedule with no end --------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    window_ms=st.sampled_from([0, 1, 3.3, 5, 12]),
    heartbeat_ms=st.sampled_from([1, 7, 10, 25]),
    rate=st.integers(min_value=1, max_value=5_000),
    limit=st.one_of(st.none(), st.integers(min_value=0, max_value=3_000)),
    batch_rows=st.integers(min_value=1, max_value=300),
    stop_ns=st.integers(min_value=1, max_value=2_000_000_000),
)
def test_a_run_stopped_anywhere_emits_what_a_run_of_that_length_emits(
    window_ms, heartbeat_ms, rate, limit, batch_rows, stop_ns
):
    """What the stop relies on: the steps of the schedule with no end due at or before a
    point P are the first steps of the schedule of a run of length P."""
    job = td.Job("s", heartbeat_ms=heartbeat_ms, buffer_timeout_ms=window_ms, batch_rows=batch_rows)
    src = td.sources.Synthetic(rate=rate, limit=limit)
    job.source(src, parallelism=2).sink(td.sinks.Collect())
    plan = job.plan()
    for p in range(2):
        upto = itertools.takewhile(lambda s: s.at_ns <= stop_ns, plan.source_schedule(0, p, None))
        emitted = list(itertools.islice(upto, 5_000))
        finite = list(itertools.islice(plan.source_schedule(0, p, stop_ns / 1e9), 5_001))
        assert finite[: len(emitted)] == emitted
        assert finite[-1].kind == "end" or len(finite) > 5_000


# -- job.start() and handle.stop() ---------------------------------------------------------


def test_a_started_job_stops_at_one_point_with_nothing_lost(no_orphans):
    job = pipeline(td.sinks.Collect())
    handle = job.start(progress=False)
    assert handle.running
    with pytest.raises(TimeoutError, match="still running"):
        handle.wait(0.1)
    time.sleep(4.0)  # the workers start, then the stream runs for a while
    assert handle.running  # an unbounded source: nothing ends it but stop()
    result = handle.stop(timeout=120)
    assert not handle.running
    assert result.duration_s is not None and result.duration_s > 0
    assert result.events_in > 0 and result.events_out == result.events_in
    assert result.lost == 0 and result.duplicates == 0
    assert result.digests_match and not result.determinism_errors
    # The rows a run of exactly that length releases, each once.
    assert result.events_in == round(RATE * result.duration_s)
    assert_every_row_once(result.output.column("source_seq").to_pylist(), result.events_in)
    assert handle.wait(0) is result and handle.result() is result


def test_the_stop_point_is_where_the_reference_replays(no_orphans):
    job = pipeline(td.sinks.Collect())
    with job.start(progress=False) as handle:
        time.sleep(2.5)
    result = handle.result()
    ref = job.run_reference(duration=result.duration_s, t0_ns=result.t0_ns)
    assert ref.events_in == result.events_in > 0
    assert multiset_diff(ref.output, result.output) == (0, 0)


def test_a_kill_in_a_run_until_stopped_is_masked(no_orphans):
    job = pipeline(td.sinks.Collect())
    handle = job.start(faults=[td.Kill("count", partition=0, replica=1, at=0.5)], progress=False)
    time.sleep(4.0)
    result = handle.stop(timeout=120)
    assert result.lost == 0 and result.duplicates == 0 and result.digests_match
    assert testing.lost_replicas(result) == testing.killed_replicas(result) != set()
    assert result.faults and result.faults[0]["injected_at"] < result.duration_s
    assert_every_row_once(result.output.column("source_seq").to_pylist(), result.events_in)


def test_a_killed_job_leaves_no_process(no_orphans):
    handle = pipeline(td.sinks.Collect()).start(progress=False)
    time.sleep(2.0)
    handle.kill(timeout=60)
    assert not handle.running
    with pytest.raises(td.TandemError, match="killed"):
        handle.result()


# -- bounded sources end a job by themselves -----------------------------------------------


def test_a_bounded_source_ends_a_job_with_no_duration(no_orphans):
    # 1500 rows at 2000/s: the last at 0.7495 s, so the run ends at the next heartbeat.
    job = pipeline(td.sinks.Collect(), rate=2_000, limit=1_500)
    assert job.plan().natural_end_ns() == 750_000_000
    result = job.run(progress=False)  # no duration, no signal: the source ends it
    assert result.duration_s == 0.75
    assert result.events_in == result.events_out == 1_500
    assert result.lost == 0 and result.duplicates == 0 and result.digests_match
    assert_every_row_once(result.output.column("source_seq").to_pylist(), 1_500)
    assert job.run_reference().events_out == 1_500


def test_a_file_source_ends_a_started_job(tmp_path, no_orphans):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"key": list(range(300)), "value": [0.5] * 300}), path)
    job = td.Job("file", replication=2, heartbeat_ms=10)
    job.source(td.sources.Parquet(path, rate=1_000)).sink(td.sinks.Collect())
    result = job.start(progress=False).wait(120)  # ends by itself
    assert result.duration_s == 0.3 and result.events_out == 300 and result.lost == 0


# -- arguments -----------------------------------------------------------------------------


def test_run_arguments_are_checked_before_anything_starts(no_orphans):
    job = pipeline(td.sinks.Collect())
    for bad in (0, -1, float("nan"), "10"):
        with pytest.raises(td.ConfigError, match="duration"):
            job.start(duration=bad)
    with pytest.raises(td.ConfigError, match="warmup"):
        job.start(warmup=-1)

    class FixedTime:
        name = "fixed"

        def run(self, plan, duration, faults, **options):
            return td.Result(duration_s=duration)

    with pytest.raises(td.ConfigError, match="a source of this job never ends; pass duration="):
        job.run(engine=FixedTime())
    with pytest.raises(td.ConfigError, match="cannot stop a run"):
        job.start(duration=1, engine=FixedTime())
    # Bounded sources on an engine that runs for a fixed time: until their last row.
    bounded = pipeline(td.sinks.Collect(), rate=2_000, limit=10)
    assert bounded.run(engine=FixedTime()).duration_s == 0.01

    errors = []

    def from_a_thread() -> None:
        try:
            job.run()
        except td.ConfigError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=from_a_thread)
    t.start()
    t.join(30)
    assert errors and "job.start()" in errors[0]
    with pytest.raises(td.ConfigError, match="never ends"):
        job.run_reference()
    with pytest.raises(td.ConfigError, match="timeout"):
        td.RunningJob("x").wait(-1)


# -- tandem run job.py ---------------------------------------------------------------------

SCRIPT = """
import pyarrow as pa
import pyarrow.compute as pc
import tandem as td

# A plain script, no `if __name__ == "__main__":` guard, that runs its job itself.


def bucket(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch.append_column("bucket", pc.bit_wise_and(batch.column("key"), 7))


job = td.Job("plain", replication=2)
src = job.source(td.sources.Synthetic(rate=1000, keys=50, seed=3), parallelism=2)
src.map(bucket, name="bucket").key_by("key").process(td.CountPerKey(), name="count").sink(
    td.sinks.Parquet({out!r})
)
result = job.run(progress=False)
print("the script got", result.events_out, "rows")
"""


def _scrape(port: int) -> dict[str, float]:
    """The samples of a Prometheus endpoint, summed by metric name and ``task`` label."""
    sums: dict[str, float] = {}
    for name, samples in testing.scrape_metrics(port).items():
        for labels, value in samples.items():
            key = f"{name}[{dict(labels).get('task', '')}]"
            sums[key] = sums.get(key, 0.0) + value
    return sums


def test_tandem_run_stops_cleanly_on_sigterm_and_serves_metrics_meanwhile(tmp_path):
    out = tmp_path / "out"
    report = tmp_path / "r.json"
    port = testing.free_port()
    proc = tandem_run(
        tmp_path,
        SCRIPT.format(out=str(out)),
        "--json",
        str(report),
        "--metrics-port",
        str(port),
    )
    with reaped(proc):
        workers = wait_for_workers(proc.pid)
        # The script runs its job itself: its run serves the metrics --metrics-port asks for.
        scraped: list[dict[str, float]] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                sums = _scrape(port)
            except OSError:
                time.sleep(0.2)
                continue
            # Snapshots come once a second per worker: scrape until one moved on (two
            # scrapes a second apart may both fall between a worker's snapshots).
            rows = sums.get("tandem_rows_in_total[sink]", 0)
            if rows > 0 and (not scraped or rows > scraped[0]["tandem_rows_in_total[sink]"]):
                scraped.append(sums)
                if len(scraped) == 2:
                    break
            time.sleep(0.5)
        assert len(scraped) == 2, f"the sink rows in the metrics did not grow: {scraped}"
        assert scraped[1].get("tandem_dedup_dropped_rows_total[count]", 0) > 0
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stdout + stderr
    assert "SIGTERM: stopping job 'plain'" in stderr
    assert "the script got" in stdout and "job 'plain':" in stdout
    result = json.loads(report.read_text())
    assert result["lost"] == 0 and result["duplicates"] == 0 and result["digests_match"]
    n = result["events_in"]
    assert n == result["events_out"] == round(1000 * result["duration_s"]) > 0
    # The files hold exactly the rows the sources released before the stop point.
    rows = pq.read_table(out)
    assert_every_row_once(rows.column("source_seq").to_pylist(), n)
    assert f"the script got {n} rows" in stdout
    assert not alive(workers), "worker processes outlived tandem run"


def test_a_second_signal_kills_the_workers_at_once(tmp_path):
    proc = tandem_run(tmp_path, SCRIPT.format(out=str(tmp_path / "out")))
    with reaped(proc):
        workers = wait_for_workers(proc.pid)
        time.sleep(1.5)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stdout + stderr
    assert "SIGINT again: killing the workers of job 'plain' at once" in stderr
    deadline = time.monotonic() + 5
    while alive(workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(workers)


def test_tandem_run_runs_the_module_level_job_of_a_script(tmp_path, capsys, no_orphans):
    # No job.run() in the script: `tandem run` runs `job`, here until its bounded source
    # ends (no --duration, no module-level duration).
    script = tmp_path / "bounded.py"
    script.write_text(
        textwrap.dedent(
            """
            import tandem as td

            job = td.Job("bounded", replication=2)
            job.source(td.sources.Synthetic(rate=2000, limit=700)).sink(td.sinks.Collect())
            """
        )
    )
    report = tmp_path / "r.json"
    assert main(["run", str(script), "--no-progress", "--json", str(report)]) == 0
    printed = capsys.readouterr().out
    assert "running job 'bounded' until stopped" in printed
    result = json.loads(report.read_text())
    assert result["events_out"] == 700 and result["lost"] == 0 and result["duration_s"] == 0.35


def test_unbounded_on_ready_hook_still_sees_every_inbox(monkeypatch, no_orphans):
    # The engine's start-up is unchanged by a run with no duration: every replica listens
    # before t0, and the first stop point is given to every worker right after `go`.
    seen = []
    monkeypatch.setattr(local, "ON_READY", lambda addresses: seen.append(len(addresses)))
    job = pipeline(td.sinks.Collect())
    result = job.start(progress=False).stop(timeout=120)
    assert seen and seen[0] > 0
    assert result.lost == 0 and result.events_out == result.events_in
    assert result.duration_s == local.STOP_LEAD_S  # stopped at once: the first stop point


# -- Kafka in and out, until stopped -------------------------------------------------------


def test_kafka_to_kafka_until_stopped_commits_every_row_once(kafka, no_orphans, monkeypatch):
    """A log source stops at the first heartbeat marker at or after the stop point, the
    same record at every replica; the Kafka sink commits what drained, exactly once."""
    import uuid

    from confluent_kafka import Consumer, Producer, TopicPartition
    from confluent_kafka.admin import AdminClient, NewTopic

    b = kafka.kafka_bootstrap
    admin = AdminClient({"bootstrap.servers": b})
    src_topic, out_topic = (f"{p}-{uuid.uuid4().hex[:10]}" for p in ("in", "out"))
    for fut in admin.create_topics([NewTopic(t, 2, 1) for t in (src_topic, out_topic)]).values():
        fut.result(30)

    job = td.Job("k2k-forever", replication=2, heartbeat_ms=10)
    schema = {"key": "int64", "amount": "int64"}
    events = job.source(td.sources.Kafka(src_topic, bootstrap=b, schema=schema), name="in")
    events.key_by("key").process(td.CountPerKey(), parallelism=2, name="count").sink(
        td.sinks.Kafka(out_topic, bootstrap=b, columns=["key", "amount", "count"], key="key")
    )
    ready, done = threading.Event(), threading.Event()
    monkeypatch.setattr(local, "ON_READY", lambda _addresses: ready.set())
    written = []

    def feed() -> None:  # rows keep coming while the job runs, and after it stopped
        producer = Producer({"bootstrap.servers": b, "linger.ms": 0})
        n = 0
        while not done.is_set():
            for _ in range(20):
                row = {"key": n % 7, "amount": n}
                producer.produce(src_topic, json.dumps(row).encode(), partition=n % 2)
                n += 1
            producer.poll(0)
            time.sleep(0.02)
        assert producer.flush(30) == 0
        written.append(n)

    feeder = threading.Thread(target=feed)
    feeder.start()
    try:
        handle = job.start(progress=False)
        assert ready.wait(120)
        time.sleep(local.STARTUP_S + 2.0)
        result = handle.stop(timeout=120)
    finally:
        done.set()
        feeder.join(60)
    assert result.lost == 0 and result.duplicates == 0 and result.digests_match
    assert 0 < result.events_in < written[0]  # rows after the stop point were not read
    assert result.events_out == result.events_in

    consumer = Consumer(
        {
            "bootstrap.servers": b,
            "group.id": f"check-{uuid.uuid4().hex}",
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
            "enable.auto.commit": False,
        }
    )
    amounts = []
    try:
        for p in range(2):
            consumer.assign([TopicPartition(out_topic, p, 0)])
            while True:
                m = consumer.poll(10)
                assert m is not None, f"no end of partition {p} within 10 s"
                if m.error() is not None:
                    break
                amounts.append(json.loads(m.value())["amount"])
    finally:
        consumer.close()
    assert len(amounts) == len(set(amounts)) == result.events_out  # each committed once
    # Each source partition was read from its start up to one marker: a prefix of what
    # was written to it.
    for p in range(2):
        mine = sorted(a for a in amounts if a % 2 == p)
        assert mine == list(range(p, p + 2 * len(mine), 2))
