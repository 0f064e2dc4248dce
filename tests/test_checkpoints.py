"""Durable checkpoints (``Job(checkpoint_ms=..., checkpoint_dir=...)``, at any replication):
the job writes a savepoint-format checkpoint every period and keeps the newest few; when
the process running it dies, ``resume=True`` (``tandem run --resume``) starts it again
from the newest complete one — every row after the cut once, keyed state going on across
the loss. Checkpoints and their mistakes are checked here (tandem.savepoints)."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tandem as td
from jobs import reaped, write_events
from tandem import savepoints

ROWS = 9000
KEYS = 30
RATE = 2000  # rows per second of source time: the input lasts 4.5 s
PERIOD_MS = 400


@pytest.fixture(scope="module")
def input_file(tmp_path_factory) -> str:
    return write_events(tmp_path_factory.mktemp("input") / "events.parquet", ROWS, KEYS, 5)


def keyed_job(
    input_file: str, directory, count_parallelism: int = 2, replication: int = 2, **options
) -> td.Job:
    """Parquet (2 partitions) -> count per key (``count_parallelism`` partitions) ->
    Collect, at ``replication``, a durable checkpoint every PERIOD_MS into ``directory``."""
    job = td.Job(
        "durable",
        replication=replication,
        checkpoint_ms=PERIOD_MS,
        checkpoint_dir=str(directory),
        **options,
    )
    stream = job.source(td.sources.Parquet(input_file, rate=RATE), parallelism=2, name="source")
    count = td.CountPerKey()
    stream.key_by("key").process(count, parallelism=count_parallelism, name="count").sink(
        td.sinks.Collect()
    )
    return job


def complete(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("checkpoint-*") if (p / "manifest.json").exists())


def newest_epoch(directory: Path) -> int:
    return int(complete(directory)[-1].name.split("-")[1])


def kill_after_checkpoints(handle: td.RunningJob, directory: Path, through_ms: float) -> None:
    """Kill the running job at once (what a lost driver does to its workers) once it has
    written a checkpoint at ``through_ms`` of source time or later."""
    deadline = time.monotonic() + 60
    while not complete(directory) or newest_epoch(directory) * 10 < through_ms:
        assert time.monotonic() < deadline, "no checkpoints written"
        assert handle.running, "the job ended before it wrote its checkpoints"
        time.sleep(0.05)
    handle.kill()
    with pytest.raises(td.TandemError):
        handle.result()


def check_continues(input_file: str, resumed: pa.Table, cut: td.Savepoint) -> None:
    """``resumed`` is exactly the output after ``cut``: every row the sources had not
    emitted there once, and per key the running count going on from the count the cut
    held (the rows of that key emitted before it)."""
    frame = pq.read_table(input_file).to_pandas()
    after = resumed.to_pandas()
    emitted = sum(p["rows"] for p in cut.sources["source"])
    assert 0 < emitted < ROWS
    assert len(after) == ROWS - emitted
    assert after["id"].is_unique
    before = frame[~frame["id"].isin(after["id"])]
    assert len(before) == emitted
    for key, rows in after.groupby("key"):
        n_before = int((before["key"] == key).sum())
        expected = list(range(n_before + 1, n_before + len(rows) + 1))
        assert sorted(rows["count"].tolist()) == expected, key


def test_a_job_killed_at_once_resumes_from_its_newest_checkpoint(input_file, tmp_path):
    """The running job's workers are killed at once (what a lost driver does to them):
    its newest complete checkpoint (of at most KEEP_CHECKPOINTS kept) is where
    resume=True starts it again — here with 3 partitions of the keyed count where the lost
    run had 2 — and the output from there is exact."""
    directory = tmp_path / "checkpoints"
    handle = keyed_job(input_file, directory).start(progress=False)
    # Once more checkpoints were written than are kept (they are a period apart).
    kill_after_checkpoints(handle, directory, (savepoints.KEEP_CHECKPOINTS + 1) * PERIOD_MS)
    kept = complete(directory)
    assert 1 <= len(kept) <= savepoints.KEEP_CHECKPOINTS  # older ones removed
    newest = td.Savepoint.read(str(kept[-1]))
    assert newest.job == "durable" and newest.epoch > 0

    # A run that does not resume refuses the directory (it would write beside them).
    with pytest.raises(td.ConfigError, match=r"holds .* checkpoint.* resume=True"):
        keyed_job(input_file, directory).run(progress=False)

    # A partial checkpoint newer than the newest complete one: passed over, removed.
    partial = directory / f"checkpoint-{newest.epoch + 1:012d}"
    partial.mkdir()
    second = keyed_job(input_file, directory, count_parallelism=3).run(
        progress=False, resume=True, timeout=120
    )
    assert not partial.exists()
    assert second.digests_match
    check_continues(input_file, second.output, newest)


def test_a_kazoo_job_that_lost_its_leader_then_its_driver_resumes_exact(
    input_file, tmp_path, zookeeper, kafka
):
    """Under KaZoo the leader of each ordered partition holds its orders at a
    checkpoint's heartbeat (every replica is asked, so whichever leads): here the worker
    leading count[0] is killed at 1 s — its follower leads on, and is asked at the next
    checkpoint — then the whole job after its checkpoints passed 2.5 s. Resumed from the
    newest, on a new order log: exact from the cut on."""
    from tandem.ordering.kazoo import KazooConfig

    config = KazooConfig(zk_hosts=kafka.zk_hosts, kafka_bootstrap=kafka.kafka_bootstrap)
    directory = tmp_path / "checkpoints"
    job = keyed_job(input_file, directory, ordering="kazoo", kazoo=config)
    handle = job.start(progress=False, faults=[td.Kill("count", 0, "leader", at=1.0)])
    kill_after_checkpoints(handle, directory, 2500)
    newest = td.Savepoint.read(str(complete(directory)[-1]))
    second = keyed_job(input_file, directory, ordering="kazoo", kazoo=config).run(
        progress=False, resume=True, timeout=120
    )
    assert second.digests_match, second.determinism_errors
    check_continues(input_file, second.output, newest)


def test_at_r1_a_lost_worker_rolls_back_and_a_lost_job_resumes(input_file, tmp_path):
    """At replication 1 the passive checkpoints roll a lost worker back within the run
    while the durable ones are written beside them; the job killed at once then resumes
    from its newest durable one (at 3 partitions), exact from the cut on."""
    directory = tmp_path / "checkpoints"
    first = keyed_job(input_file, directory, replication=1).run(
        progress=False, timeout=120, faults=[td.Kill("count", 0, 0, at=2.0)]
    )
    assert first.lost == 0 and first.duplicates == 0 and first.output.num_rows == ROWS
    assert first.checkpoints["rollbacks"] == 1 and first.checkpoints["completed"] > 0
    assert 1 <= len(complete(directory)) <= savepoints.KEEP_CHECKPOINTS

    directory = tmp_path / "lost"
    handle = keyed_job(input_file, directory, replication=1).start(progress=False)
    kill_after_checkpoints(handle, directory, 2 * PERIOD_MS)
    newest = td.Savepoint.read(str(complete(directory)[-1]))
    second = keyed_job(input_file, directory, count_parallelism=3, replication=1).run(
        progress=False, resume=True, timeout=120
    )
    check_continues(input_file, second.output, newest)


def test_checkpoints_leave_the_output_alone(input_file, tmp_path):
    """A run that writes checkpoints emits what the reference executor does."""
    directory = tmp_path / "checkpoints"
    result = keyed_job(input_file, directory).run(progress=False, timeout=120)
    assert result.lost == 0 and result.duplicates == 0 and result.digests_match
    assert result.output.num_rows == ROWS
    kept = complete(directory)
    assert 1 <= len(kept) <= savepoints.KEEP_CHECKPOINTS
    assert not list(directory.glob(".*"))  # nothing partial left behind
    epochs = [td.Savepoint.read(str(p)).epoch for p in kept]
    assert epochs == sorted(epochs) and len(set(epochs)) == len(epochs)


def test_resume_with_no_checkpoint_yet_starts_from_the_beginning(input_file, tmp_path):
    result = keyed_job(input_file, tmp_path / "empty").run(progress=False, resume=True, timeout=120)
    assert result.output.num_rows == ROWS and result.lost == 0


def test_durable_checkpoint_mistakes_are_refused_before_anything_starts(input_file, tmp_path):
    with pytest.raises(td.ConfigError, match=r"checkpoint_dir= .* checkpoint_ms= how often"):
        td.Job("j", checkpoint_dir=str(tmp_path))
    with pytest.raises(td.ConfigError, match="drop restore=True"):
        td.Job("j", replication=1, restore=True, checkpoint_ms=500, checkpoint_dir=str(tmp_path))
    with pytest.raises(td.ConfigError, match="ordering='kazoo' does not do"):
        td.Job("j", replication=1, ordering="kazoo", checkpoint_ms=500, checkpoint_dir="d")
    # At replication >= 2 a KaZoo job writes durable checkpoints like any other.
    assert td.Job("j", ordering="kazoo", checkpoint_ms=500, checkpoint_dir="d").plan is not None
    with pytest.raises(td.ConfigError, match="checkpoint_dir=PATH with checkpoint_ms"):
        td.Job("j", replication=2, checkpoint_ms=500)

    plain = td.Job("plain")
    plain.source(td.sources.Synthetic(rate=10)).sink(td.sinks.Collect())
    with pytest.raises(td.ConfigError, match="has none: give"):
        plain.run(duration=1.0, resume=True)

    job = keyed_job(input_file, tmp_path / "a")
    with pytest.raises(td.ConfigError, match="give one of them"):
        job.run(resume=True, from_savepoint=str(tmp_path / "sp"))

    class Outside(td.sinks.Sink):  # a sink of the user's: its rows go out as it writes
        def write(self, batch):
            pass

    outside = td.Job("outside", checkpoint_ms=500, checkpoint_dir=str(tmp_path / "b"))
    outside.source(td.sources.Synthetic(rate=10)).sink(Outside())
    with pytest.raises(td.ConfigError, match=r"does not take sink .* writes outside the job"):
        outside.run(duration=1.0)

    other = tmp_path / "other"
    keyed_job(input_file, other).run(progress=False, timeout=120)
    renamed = td.Job("renamed", checkpoint_ms=PERIOD_MS, checkpoint_dir=str(other))
    renamed.source(td.sources.Synthetic(rate=10)).sink(td.sinks.Collect())
    with pytest.raises(td.ConfigError, match="holds checkpoints of job 'durable'"):
        renamed.run(duration=1.0, resume=True)


def parquet_job(input_file: str, directory, out) -> td.Job:
    """:func:`keyed_job` writing Parquet: durable checkpoints make it write in parts."""
    job = td.Job("parts", replication=2, checkpoint_ms=PERIOD_MS, checkpoint_dir=str(directory))
    stream = job.source(td.sources.Parquet(input_file, rate=RATE), parallelism=2, name="source")
    stream.key_by("key").process(td.CountPerKey(), parallelism=2, name="count").sink(
        td.sinks.Parquet(str(out)), parallelism=2
    )
    return job


def test_a_file_sink_killed_with_its_job_resumes_with_every_row_once(input_file, tmp_path):
    """A Parquet sink in a job with durable checkpoints writes a part per checkpoint,
    published once the checkpoint is complete. The job killed at once and resumed from
    its newest checkpoint: the parts after it (and what was being written) are dropped,
    the resumed run writes on from the cut — the directory holds every row once, with the
    counts an independent count gives."""
    directory, out = tmp_path / "checkpoints", tmp_path / "out"
    handle = parquet_job(input_file, directory, out).start(progress=False)
    kill_after_checkpoints(handle, directory, 3 * PERIOD_MS)
    published = sorted(p.name for p in out.glob("part-*.parquet"))
    assert published, "no part was published at a checkpoint"
    assert all(p.count("-") == 2 for p in published)  # part-<partition>-<epoch>.parquet

    resumed = parquet_job(input_file, directory, out).run(progress=False, resume=True, timeout=120)
    assert resumed.digests_match
    assert not list(out.glob(".*")), "staged or rolled parts left behind"
    table = pq.read_table(out).to_pandas()  # every part, of both runs
    assert len(table) == ROWS and table["id"].is_unique
    frame = pq.read_table(input_file).to_pandas()
    for key, rows in table.groupby("key"):
        n = int((frame["key"] == key).sum())
        assert sorted(rows["count"].tolist()) == list(range(1, n + 1)), key


def test_a_file_sink_with_checkpoints_publishes_every_row_once(input_file, tmp_path):
    """A run that writes checkpoints and ends by itself: its parts are the whole output,
    checked against the reference."""
    directory, out = tmp_path / "checkpoints", tmp_path / "out"
    result = parquet_job(input_file, directory, out).run(progress=False, timeout=120)
    assert result.lost == 0 and result.duplicates == 0 and result.digests_match
    parts = sorted(out.glob("part-*.parquet"))
    assert len(parts) > 2  # partitions x checkpoints
    assert pq.read_table(out).num_rows == ROWS
    assert not list(out.glob(".*"))


DRIVER_JOB = """
import tandem as td

job = td.Job("driver", replication=2, checkpoint_ms={period}, checkpoint_dir={directory!r})
events = job.source(td.sources.Parquet({input_file!r}, rate={rate}), parallelism=2, name="source")
events.key_by("key").process(td.CountPerKey(), parallelism=2, name="count").sink(
    td.sinks.Collect()
)
"""


def sigkill_after_checkpoint(proc, directory: Path, through_ms: float, timeout: float) -> float:
    """SIGKILL the driver ``proc`` (`tandem run job.py`) once it has a complete checkpoint
    at ``through_ms`` of source time or later; every process it started (workers, a Spark
    JVM) must go with it. Returns how long they took to."""
    import psutil

    with reaped(proc):
        deadline = time.monotonic() + timeout
        while not complete(directory) or newest_epoch(directory) * 10 < through_ms:
            assert time.monotonic() < deadline, "no checkpoint written"
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        spawned = psutil.Process(proc.pid).children(recursive=True)
        assert spawned
        killed_at = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    _, alive = psutil.wait_procs(spawned, timeout=30)
    assert not alive, f"processes outlived the killed driver: {alive}"
    return time.monotonic() - killed_at


def test_tandem_run_sigkilled_then_resumed(input_file, tmp_path):
    """`tandem run job.py` SIGKILLed once it has a checkpoint: its workers go with it (no
    orphan), and `tandem run job.py --resume` goes on from the newest checkpoint, saying
    so — what follows the cut, once."""

    from jobs import tandem_run

    directory = tmp_path / "checkpoints"
    script = DRIVER_JOB.format(
        period=PERIOD_MS, directory=str(directory), input_file=input_file, rate=RATE // 2
    )
    proc = tandem_run(tmp_path, script, "--no-progress")
    sigkill_after_checkpoint(proc, directory, 0, timeout=60)

    newest = complete(directory)[-1]  # the one --resume starts from
    cut = td.Savepoint.read(str(newest))
    out = tmp_path / "resumed.json"
    done = tandem_run(tmp_path, script, "--no-progress", "--resume", "--json", str(out))
    stdout, stderr = done.communicate(timeout=180)
    assert done.returncode == 0, stdout + stderr
    assert f"resuming job 'driver' from {newest} (heartbeat {cut.epoch}" in stdout, stdout
    result = json.loads(out.read_text())
    emitted = sum(p["rows"] for p in cut.sources["source"])
    assert result["events_out"] == ROWS - emitted > 0
    assert result["digests_match"]


def test_parts_chain_stays_every_row_once_when_a_replica_missed_a_roll(tmp_path):
    """The parts of a file sink, replica by replica (no job): rolled at checkpoints and
    published from the replica the manifest names. A replica whose cut was refused at a
    checkpoint has a longer part; published later, it replaces the shorter ones it covers."""
    schema = pa.schema([("x", pa.int64())])

    def replica(r: int) -> td.sinks.Parquet:
        sink = td.sinks.Parquet(str(tmp_path / "out"))
        sink.replica, sink.parts_from = r, 0
        sink.open(0, 1, schema)
        return sink

    def rows(*xs):
        return pa.record_batch([pa.array(list(xs), pa.int64())], schema=schema)

    a, b = replica(0), replica(1)
    for sink in (a, b):
        sink.write(rows(1, 2))
        sink.roll(10)
        sink.write(rows(3))
    first = a.publish_parts(0, 1, 10, 0)  # the rows up to heartbeat 10: a part from 0
    assert first == [str(tmp_path / "out" / "part-00000-000000000000.parquet")]
    # a's cuts at 20 and 25 were refused: it writes on in its part from 10, and the
    # checkpoints at 20 and 25 name b.
    b.roll(20)
    a.publish_parts(0, 1, 20, 1)
    b.roll(25)
    a.publish_parts(0, 1, 25, 1)
    assert len(list((tmp_path / "out").glob("part-*"))) == 3
    for sink in (a, b):
        sink.write(rows(4))
        sink.roll(30)
    a.publish_parts(0, 1, 30, 0)  # back to a: its part from 10 covers b's from 10 and 20
    names = sorted(p.name for p in (tmp_path / "out").glob("part-*"))
    assert names == ["part-00000-000000000000.parquet", "part-00000-000000000010.parquet"]
    assert sorted(pq.read_table(tmp_path / "out")["x"].to_pylist()) == [1, 2, 3, 4]


SPARK_DRIVER_JOB = """
import tandem as td

job = td.Job(
    "spark-driver", replication={replication}, checkpoint_ms={period}, checkpoint_dir={directory!r}
)
events = job.source(td.sources.Parquet({input_file!r}, rate={rate}), parallelism=2, name="source")
counted = events.key_by("key").process(td.CountPerKey(), parallelism={count}, name="count")
counted.sink(td.sinks.Parquet({out!r}))
"""


@pytest.mark.spark
def test_on_spark_a_driver_sigkilled_resumes_and_the_files_hold_every_row_once(
    input_file, tmp_path
):
    """The Spark engine, its driver `tandem run job.py --engine spark` SIGKILLed once it
    has written a durable checkpoint (its Spark tasks and their Python workers go with
    it): `--resume` goes on from the newest checkpoint on a new Spark session, and the
    Parquet sink's published parts — those of the lost run through the checkpoint, then
    the resumed run's — hold every input row exactly once, each key's counts 1..n across
    the loss (seed 002's driver failure: Structured Streaming writes 2,092 rows twice).
    The resumed job has a new shape: 3 partitions of the keyed count (the lost run had 2),
    each starting with the key groups it owns, and r = 3."""

    from jobs import tandem_run

    directory, out = tmp_path / "checkpoints", tmp_path / "out"

    def script(replication: int, count: int) -> str:
        return SPARK_DRIVER_JOB.format(
            period=PERIOD_MS,
            directory=str(directory),
            input_file=input_file,
            rate=RATE // 2,
            out=str(out),
            replication=replication,
            count=count,
        )

    flags = ["--engine", "spark", "--master", "local[7,3]", "--no-progress"]
    proc = tandem_run(tmp_path, script(2, 2), *flags)
    lost_after = sigkill_after_checkpoint(proc, directory, 2 * PERIOD_MS, timeout=120)
    published = sorted(p.name for p in out.glob("part-*.parquet"))
    assert published, "the lost run published no part at its checkpoints"

    newest = complete(directory)[-1]  # the one --resume starts from
    cut = td.Savepoint.read(str(newest))
    started = time.monotonic()
    resume = ["--resume", "--json", str(tmp_path / "r.json")]
    done = tandem_run(tmp_path, script(3, 3), *flags, *resume)
    stdout, stderr = done.communicate(timeout=240)
    assert done.returncode == 0, stdout + stderr[-4000:]
    assert f"resuming job 'spark-driver' from {newest} (heartbeat {cut.epoch}" in stdout, stdout
    result = json.loads((tmp_path / "r.json").read_text())
    emitted = sum(p["rows"] for p in cut.sources["source"])
    assert result["events_out"] == ROWS - emitted > 0 and result["digests_match"]

    frame = pq.read_table(input_file).to_pandas()
    output = pq.read_table(out).to_pandas()
    assert not list(out.glob(".*")), list(out.glob(".*"))  # no staged or rolled part left
    assert sorted(output["id"]) == sorted(frame["id"])  # every row once, none twice
    for key, rows in output.groupby("key"):
        n = int((frame["key"] == key).sum())
        assert sorted(rows["count"].tolist()) == list(range(1, n + 1)), key
    print(
        f"spark driver loss: {emitted} of {ROWS} rows before the cut at heartbeat "
        f"{cut.epoch}; resumed run {time.monotonic() - started:.1f} s (workers gone "
        f"{lost_after:.1f} s after the kill)",
        file=sys.stderr,
    )


def test_a_kafka_sink_across_a_lost_driver_writes_every_row_once(input_file, tmp_path, kafka):
    """A Kafka sink in a job with durable checkpoints: a checkpoint is complete only once
    the sink has committed through its cut, and the positions record of every commit says
    how far it got. The job killed at once (what a lost driver does to its workers) after
    writing past its newest checkpoint; resumed, the sink fences the lost run's writers,
    reads that record and drops the rows the run regenerates up to it: an outside
    read_committed consumer reads every row once, each key's counts 1..n across the loss."""
    from collections import Counter

    from tandem.testing import new_topic, read_committed

    b = kafka.kafka_bootstrap
    topic = new_topic(b, 2, "durable-out")
    directory = tmp_path / "checkpoints"

    def job() -> td.Job:
        j = td.Job(
            "durable-kafka", replication=2, checkpoint_ms=PERIOD_MS, checkpoint_dir=str(directory)
        )
        stream = j.source(td.sources.Parquet(input_file, rate=RATE), parallelism=2, name="source")
        stream.key_by("key").process(td.CountPerKey(), parallelism=2, name="count").sink(
            td.sinks.Kafka(topic, b, columns=["id", "key", "count"]), parallelism=2
        )
        return j

    handle = job().start(progress=False)
    kill_after_checkpoints(handle, directory, 3 * PERIOD_MS)
    written = len(read_committed(b, topic, 2))
    cut = td.Savepoint.read(str(complete(directory)[-1]))
    emitted = sum(p["rows"] for p in cut.sources["source"])
    assert 0 < emitted <= written < ROWS, (emitted, written)  # committed past the cut
    result = job().run(progress=False, resume=True, timeout=120)
    assert result.digests_match
    out = [json.loads(m.value()) for m in read_committed(b, topic, 2)]
    frame = pq.read_table(input_file).to_pandas()
    assert sorted(r["id"] for r in out) == sorted(frame["id"])  # every row once
    counts = Counter(frame["key"])
    for key, n in counts.items():
        assert sorted(r["count"] for r in out if r["key"] == key) == list(range(1, n + 1)), key
    print(
        f"kafka across a lost driver: cut after {emitted} rows, {written} committed before "
        f"the loss, {len(out)} in the topic after the resume",
        file=sys.stderr,
    )


def test_a_kafka_source_across_a_lost_driver_reads_every_row_after_the_cut_once(tmp_path, kafka):
    """A Kafka source in a job with durable checkpoints, its input still arriving: killed at
    once after its checkpoints (what a lost driver does to its workers), resumed from the
    newest — each source partition reads on from the offset its cut holds, with what the
    topic got while nothing ran: exactly the rows after the cut, each key's counts going
    on from those before it."""
    import json
    import threading

    from confluent_kafka import Producer

    from tandem.testing import new_topic

    b = kafka.kafka_bootstrap
    topic = new_topic(b, 2, "durable-in")
    rows = [{"key": i % 7, "id": i} for i in range(2_400)]
    directory = tmp_path / "checkpoints"

    def produce(first: int, last: int, pause: float) -> None:
        p = Producer({"bootstrap.servers": b, "linger.ms": 0})
        for i in range(first, last, 50):
            time.sleep(pause)
            for j in range(i, i + 50):
                p.produce(topic, json.dumps(rows[j]).encode(), partition=j % 2)
            p.poll(0)
        assert p.flush(30) == 0

    def job() -> td.Job:
        j = td.Job(
            "durable-kafka-in",
            replication=2,
            batch_rows=64,
            checkpoint_ms=PERIOD_MS,
            checkpoint_dir=str(directory),
        )
        source = td.sources.Kafka(topic, bootstrap=b, schema={"key": "int64", "id": "int64"})
        j.source(source, name="in").key_by("key").process(
            td.CountPerKey(), parallelism=2, name="count"
        ).sink(td.sinks.Collect())
        return j

    feeder = threading.Thread(target=produce, args=(0, 1_800, 0.15))  # about 5.4 s
    handle = job().start(progress=False)
    feeder.start()
    kill_after_checkpoints(handle, directory, 3 * PERIOD_MS)
    feeder.join()
    produce(1_800, len(rows), 0)  # while nothing runs
    cut = td.Savepoint.read(str(complete(directory)[-1]))
    before = {p["partition"]: p["rows"] for p in cut.sources["in"]}
    assert all(p["offset"] > 0 for p in cut.sources["in"]) and sum(before.values()) > 0

    second = job().run(progress=False, resume=True, duration=cut.source_time_s + 3.0, timeout=120)
    assert second.digests_match
    # A partition's log holds its rows in id order: the first `before[p]` were read.
    read = {r["id"] for p in (0, 1) for r in [x for x in rows if x["id"] % 2 == p][: before[p]]}
    after = second.output.to_pandas()
    assert sorted(after["id"]) == sorted(r["id"] for r in rows if r["id"] not in read)
    for key, got in after.groupby("key"):
        n = sum(1 for r in rows if r["key"] == key and r["id"] in read)
        assert sorted(got["count"]) == list(range(n + 1, n + len(got) + 1)), key
