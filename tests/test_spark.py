"""The Spark engine end to end, on a real local Spark (pyspark from PyPI, Java 17).

One session for the module (a JVM costs seconds): ``local[8,8]`` — 8 task slots, for the
6 workers of MiB1 of length 3 with two workers per replica group (each one Spark task
hosting its group's replica of one partition of every task) and one per sink replica,
plus 2 spares, and up to 8 attempts per task.
"""

from __future__ import annotations

import glob
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

import tandem as td
import tandem_spark
from tandem import engines
from tandem.cli import main
from tandem.engines.common import multiset_diff
from tandem.experiments.workloads import mib1_job
from tandem.reference import canonical
from tandem.testing import (
    bucket,
    killed_replicas,
    lost_replicas,
    starved_sink_copies,
    two_thresholds,
    with_batch_rows,
)

pytestmark = pytest.mark.spark
TANDEM = str(Path(sys.executable).with_name("tandem"))  # the command of this environment

RATE = 1_000
DURATION = 3.0
REPLICAS = 18  # MiB1 of length 3: a source and 3 maps (2 partitions x 2 replicas each), 2 sinks
WORKERS = 6  # two per replica group (one per partition), and one per sink replica


@pytest.fixture(scope="module")
def spark():
    session = tandem_spark.local_session(WORKERS)
    yield session
    session.stop()


def mib1(length: int = 3, replication: int = 2) -> td.Job:
    job = mib1_job(length, replication, ordering="liverobin", rate=RATE, sink=td.sinks.Collect())
    job.workers = 2  # per replica group, whatever this machine's cores
    return job


def spark_tasks(spark) -> tuple[int, int]:
    """Tasks of the last Spark job (one stage: ``mapInArrow`` over the placement rows),
    and how many of their attempts failed."""
    tracker = spark.sparkContext.statusTracker()
    job = tracker.getJobInfo(max(tracker.getJobIdsForGroup()))
    stages = [tracker.getStageInfo(s) for s in job.stageIds]
    return sum(s.numTasks for s in stages), sum(s.numFailedTasks for s in stages)


@pytest.fixture(scope="module")
def fault_free(spark):
    job, engine = mib1(), tandem_spark.SparkEngine(spark)
    res = job.run(duration=DURATION, engine=engine)
    return job, engine, res, spark_tasks(spark)


def assert_same_as_reference(job: td.Job, res: td.Result) -> pa.Table:
    ref = job.run_reference(duration=DURATION, t0_ns=res.t0_ns)
    assert res.output.num_rows == ref.output.num_rows == res.events_in == RATE * DURATION
    assert canonical(res.output).equals(canonical(ref.output))
    assert res.lost == 0 and res.duplicates == 0 and res.digests_match
    return ref.output


def test_mib1_output_equals_the_reference(fault_free):
    job, engine, res, _ = fault_free
    assert_same_as_reference(job, res)
    assert res.p50_ms is not None and res.p50_ms > 0
    assert res.lost_replicas == [] and engine.last_run.retried_slots() == []


def test_one_spark_task_per_worker(fault_free):
    job, engine, _, (tasks, failed) = fault_free
    placement = job.plan().placement()
    assert len(placement) == WORKERS and len(job.plan().replicas()) == REPLICAS
    assert (tasks, failed) == (WORKERS, 0)
    # One attempt per placement row; on one executor row i runs worker i, all its replicas.
    run = engine.last_run
    assert sorted(a.slot for a in run.attempts) == list(range(WORKERS))
    assert all(a.worker == a.slot and a.replicas == placement[a.slot] for a in run.attempts)
    assert sorted(run.hosts()) == sorted(job.plan().replicas())


def test_output_dataframe_equals_the_reference(fault_free):
    job, engine, res, _ = fault_free
    df = engine.output_df()
    assert df.count() == res.output.num_rows
    got = df.toArrow()
    want = job.run_reference(duration=DURATION, t0_ns=res.t0_ns).output
    assert multiset_diff(want, got) == (0, 0)


@pytest.mark.parametrize(
    "fault",
    [td.Kill("map2", partition=1, replica=0, at=1.5), td.KillWorker(2, at=1.5)],
    ids=["kill-replica", "kill-worker"],
)
def test_killed_worker_is_masked_and_only_its_task_is_retried(spark, fault_free, fault):
    """A kill takes down the worker task hosting the replica, with every replica in it:
    their twins mask them all, and Spark retries that one task, which retires."""
    job, engine = mib1(), tandem_spark.SparkEngine(spark)
    plan = job.plan()
    res = job.run(duration=DURATION, faults=[fault], engine=engine)
    tasks, failed = spark_tasks(spark)
    assert_same_as_reference(job, res)
    (record,) = res.faults
    w = record["worker"]
    names = {t.id: t.name for t in plan.tasks}
    hosted = {(names[t], p, r) for t, p, r in plan.placement()[w]}
    if isinstance(fault, td.Kill):
        assert (plan.task("map2").id, 1, 0) in plan.placement()[w]
    else:
        assert w == fault.worker
    assert len(hosted) == 4  # group 0 or 1: one partition of the source and of each map
    assert lost_replicas(res) == killed_replicas(res) == hosted
    # Masked: no stall beyond the scheduling noise the fault-free run shows on this machine.
    assert res.max_gap_ms < max(1_000, 2 * fault_free[2].max_gap_ms)
    run = engine.last_run
    victim = run.workers()[w]
    # Spark retried the killed task (attempt 1 of the same placement row) and no other.
    assert run.retried_slots() == [victim.slot]
    assert sorted(a.attempt for a in run.attempts if a.slot == victim.slot) == [0, 1]
    assert (tasks, failed) == (WORKERS, 1)


def counting_job(**options) -> td.Job:
    """Keyed counts (operator state a rebuilt replica must get from its twin's cut), its
    lost workers rebuilt while it runs: 5 workers, as MiB1's."""
    job = td.Job("rejoin", replication=2, workers=2, restore=True, **options)
    events = job.source(td.sources.Synthetic(rate=RATE, keys=40, seed=11), parallelism=2)
    (
        events.map(bucket, parallelism=2, name="enrich")
        .key_by("key")
        .process(td.CountPerKey(), parallelism=2, name="count")
        .sink(td.sinks.Collect())
    )
    return job


REJOIN_RUN = 12.0
# A rebuild takes 0.6-2.6 s here, and over 3 s on a busy 2-core CI machine (a Spark retry
# starts a Python worker): the second kill must find the first rebuild done, and the
# second rebuild must find its twin still running (not finished with the stream).
FIRST_KILL, SECOND_KILL = 1.0, 6.0
# KaZoo's rebuilds open a ZooKeeper session and Kafka clients too, and a kill of the leader
# waits while its twins are rebuilt (it never takes a partition's last replica): 3 s more
# for the second rebuild to be done before the stream ends.
KAZOO_REJOIN_RUN = 15.0


def test_a_retried_task_rejoins_and_then_masks_the_loss_of_its_twin(spark):
    """restore=True: Spark retries the killed worker's task, which rebuilds the worker's
    replicas from cuts of their live twins, so r is restored; then the other replica of
    the same partition is killed, and that is masked too (its retry rejoins as well)."""
    job, engine = counting_job(), tandem_spark.SparkEngine(spark)
    plan = job.plan()
    faults = [td.Kill("count", 0, 0, at=FIRST_KILL), td.Kill("count", 0, 1, at=SECOND_KILL)]
    res = job.run(duration=REJOIN_RUN, faults=faults, engine=engine)
    tasks, failed = spark_tasks(spark)
    ref = job.run_reference(duration=REJOIN_RUN, t0_ns=res.t0_ns)
    assert res.output.num_rows == ref.output.num_rows == RATE * REJOIN_RUN
    assert canonical(res.output).equals(canonical(ref.output))
    assert res.lost == 0 and res.duplicates == 0
    assert res.digests_match, res.determinism_errors

    first, second = res.faults
    assert first["worker"] != second["worker"]
    names = {t.id: t.name for t in plan.tasks}
    hosted = [{(names[t], p, r) for t, p, r in plan.placement()[f["worker"]]} for f in res.faults]
    assert ("count", 0, 0) in hosted[0] and ("count", 0, 1) in hosted[1]
    assert lost_replicas(res) - starved_sink_copies(res) == killed_replicas(res)
    assert killed_replicas(res) == hosted[0] | hosted[1]
    # r restored after the first kill, before the second: every replica of the first
    # victim rebuilt from its twin (in the worker the second kill took), from a cut
    # with state; then the second victim's too, from the rebuilt replicas.
    rebuilt = [
        {(r["task"], r["partition"], r["replica"]) for r in res.restored_replicas if pick(r)}
        for pick in (
            lambda r: r["lost_s"] < SECOND_KILL,
            lambda r: r["lost_s"] >= SECOND_KILL,  # lost_s is rounded to the ms
        )
    ]
    assert rebuilt == hosted, res.restored_replicas
    for r in res.restored_replicas:
        assert r["lost_s"] < r["restored_s"] < r["lost_s"] + 10, r
        assert r["epoch"] > 0 and r["twin"] != r["replica"] and not r["warm"], r
    first_rebuilt = [r["restored_s"] for r in res.restored_replicas if r["lost_s"] < SECOND_KILL]
    assert max(first_rebuilt) < second["injected_at"]
    # Each killed task was retried once, and that attempt ran the rebuilt worker.
    run = engine.last_run
    victims = sorted(run.workers()[f["worker"]].slot for f in res.faults)
    assert run.retried_slots() == victims
    assert all(run.workers()[f["worker"]].rejoined for f in res.faults)
    assert (tasks, failed) == (WORKERS, 2)
    assert res.max_gap_ms < 2_000


def test_kazoo_a_lost_leader_rejoins_and_leads_once_its_twin_is_lost(spark, zookeeper, kafka):
    """KaZoo, restore=True: the worker task of count[0]'s leader is killed; its retry
    rejoins from the twins' cuts (each rebuilt replica follows the order log on from its
    twin's place in it); then the twin, leading by now, is killed: the rebuilt replica
    takes the partition over, and nothing is lost or repeated."""
    # A session longer than the default: a killed leader's partition goes to its twin
    # at once anyway (the coordinator releases a dead worker's leaderships), and on a busy
    # 2-core machine a 1 s session may expire under a live leader, whose twin then leads
    # and would take the second kill in its place.
    config = td.KazooConfig(
        zk_hosts=kafka.zk_hosts, kafka_bootstrap=kafka.kafka_bootstrap, session_timeout_s=3.0
    )
    # A replay window as long as the run: on a busy 2-core machine (Spark, ZooKeeper and
    # Kafka beside 10 replicas) the retried task may take over 3 s from its twin's cut to
    # its links, and the default window (3 s) would then no longer reach back to the cut
    # (the rebuild is retried from a later cut, which this short run may not see).
    job = counting_job(ordering="kazoo", kazoo=config, replay_ms=KAZOO_REJOIN_RUN * 1000)
    faults = [
        td.Kill("count", partition=0, replica="leader", at=FIRST_KILL),
        td.Kill("count", partition=0, replica="leader", at=SECOND_KILL),
    ]
    engine = tandem_spark.SparkEngine(spark)
    res = job.run(duration=KAZOO_REJOIN_RUN, faults=faults, engine=engine)
    assert res.lost == 0 and res.duplicates == 0
    assert res.digests_match, res.determinism_errors
    first, second = res.faults
    assert first["victim"] != second["victim"], res.faults
    restored = {(r["task"], r["partition"], r["replica"]) for r in res.restored_replicas}
    assert restored == lost_replicas(res) - starved_sink_copies(res) == killed_replicas(res)
    assert {("count", 0, 0), ("count", 0, 1)} <= restored
    # Every term, the killed leaders' included (announced as they won; ended by the kill).
    terms = res.leaders["count[0]"]
    for f in (first, second):
        led = [t for t in terms if t["replica"] == f["victim"] and t["from_s"] < f["injected_at"]]
        assert led and led[-1]["until_s"] is None, (f, terms)
    after = [t for t in terms if t["from_s"] >= second["injected_at"]]
    assert after and after[0]["replica"] == first["victim"], terms


def test_a_frozen_worker_task_is_declared_lost_fenced_and_rebuilt_by_its_retry(spark):
    """restore=True: a worker task frozen (SIGSTOP) sends no keepalive (and reads nothing);
    the registry declares it lost after failure_timeout_ms (or once its upstream replicas
    drop it as a straggler) and fences it (SIGKILL), Spark retries the
    task, and the retry rejoins — the frozen replicas never send again, r is restored."""
    job, engine = counting_job(failure_timeout_ms=1000), tandem_spark.SparkEngine(spark)
    plan = job.plan()
    pause = td.Pause("count", partition=1, replica=0, at=1.0, for_s=30.0)
    res = job.run(duration=REJOIN_RUN, faults=[pause], engine=engine)
    tasks, failed = spark_tasks(spark)
    assert res.output.num_rows == RATE * REJOIN_RUN
    assert res.lost == 0 and res.duplicates == 0
    assert res.digests_match, res.determinism_errors
    (record,) = res.faults
    names = {t.id: t.name for t in plan.tasks}
    frozen = {(names[t], p, r) for t, p, r in plan.placement()[record["worker"]]}
    assert ("count", 1, 0) in frozen and killed_replicas(res) == set()
    # Both sink copies end (neither is taken for a straggler while its Done is on the way).
    assert lost_replicas(res) == frozen
    # Its keepalives stopped, and its upstream replicas dropped it as a straggler: either
    # declares it lost, whichever comes first.
    causes = {r["cause"] for r in res.lost_replicas if r["task"] != "sink"}
    assert len(causes) == 1 and causes <= {"silent", "evicted"}, res.lost_replicas
    restored = {(r["task"], r["partition"], r["replica"]) for r in res.restored_replicas}
    assert restored == frozen
    for r in res.restored_replicas:  # declared lost about failure_timeout_ms after the pause
        assert 1.5 < r["lost_s"] < 4.0 and r["restored_s"] < REJOIN_RUN, r
    assert engine.last_run.workers()[record["worker"]].rejoined
    assert (tasks, failed) == (WORKERS, 1)


def test_a_large_state_goes_to_the_retried_task_as_a_file_never_through_the_registry(spark):
    """On a master on this machine, a twin's worker and the retried task share the node:
    a state of SPILL_BYTES or more goes from one to the other as a file in a folder the
    driver made (as on the local engine), and the folder goes with the run."""
    from tandem.engines import exchange
    from tandem.experiments import recovery

    def folders() -> set[str]:
        return set(glob.glob("/dev/shm/tandem-state-*")) | set(glob.glob("/tmp/tandem-state-*"))

    before = folders()
    mb = 2 * exchange.SPILL_BYTES / 2**20
    res = recovery.recovery_job(mb, RATE).run(
        duration=6,
        faults=[td.Kill("state", 0, 0, at=1.0)],
        engine=tandem_spark.SparkEngine(spark),
        progress=False,
    )
    assert res.lost == 0 and res.duplicates == 0
    assert res.digests_match, res.determinism_errors
    by_task = {(r["task"], r["partition"]): r for r in res.restored_replicas}
    # The stateful replicas' states (2 MiB each) came as files, the sources' inline.
    assert by_task[("state", 0)]["state_file"] and by_task[("state", 1)]["state_file"]
    assert not by_task[("source", 0)]["state_file"]
    assert folders() <= before, "the run left its state folder behind"


def test_too_small_cluster_fails_fast_with_the_fix(spark):
    job = mib1(replication=3)  # 3 groups of 2 workers, and 3 sink workers: 9 workers
    with pytest.raises(td.ConfigError, match=r"9 workers.*10 slots.*offers 8.*local\[10,8\]"):
        job.run(duration=DURATION, engine=tandem_spark.SparkEngine(spark))


def test_engine_by_name_from_the_cli(spark, capsys, tmp_path):
    # The engine sizes a session for the demo's workers; getOrCreate finds this one.
    argv = ["demo", "--engine", "spark", "--duration", "3", "--rate", "500", "--no-progress"]
    code = main([*argv, "--plot", str(tmp_path / "p99.png")])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "fault masked" in printed


def test_a_successful_spark_demo_prints_no_java_stack_trace(tmp_path):
    """`tandem demo --engine spark` as a user runs it, in a process of its own (its JVM
    writes to the console directly): the worker the demo kills on purpose is reported by
    tandem in one line, without a Java stack trace of Spark's."""
    argv = ["demo", "--engine", "spark", "--duration", "3", "--rate", "500", "--no-progress"]
    done = subprocess.run(
        [TANDEM, *argv, "--plot", str(tmp_path / "p99.png")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "fault masked" in done.stdout
    assert "\tat org.apache" not in done.stderr + done.stdout, done.stderr[-3000:]


def test_kazoo_demo_on_spark_from_the_cli(spark, zookeeper, kafka, capsys, tmp_path):
    argv = ["demo", "--engine", "spark", "--ordering", "kazoo", "--duration", "3"]
    code = main([*argv, "--rate", "500", "--no-progress", "--plot", str(tmp_path / "p99.png")])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "fault masked" in printed
    assert "leaders of count[0]" in printed


def test_missing_spark_integration_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "tandem_spark", None)  # makes the import fail
    with pytest.raises(td.ConfigError, match=r"pip install \./spark_integration"):
        engines.get("spark")


def test_replication_1_with_checkpoints_is_refused_on_spark_naming_what_runs(spark, tmp_path):
    """At replication 1 checkpoint_ms is the passive rollback, which Spark does not run,
    and checkpoint_dir= comes with it there: refused before anything starts, saying that
    durable checkpoints alone run on Spark at replication >= 2."""
    job = td.Job("r1", replication=1, checkpoint_ms=500, checkpoint_dir=str(tmp_path / "ck"))
    job.source(td.sources.Synthetic(rate=100, limit=100)).sink(td.sinks.Collect())
    with pytest.raises(td.ConfigError, match=r"durable checkpoints alone run on Spark at repl"):
        job.run(engine=tandem_spark.SparkEngine(spark))
    assert not (tmp_path / "ck").exists()


def test_master_without_the_spark_engine_is_refused(capsys):
    assert main(["demo", "--master", "local[4,2]", "--duration", "1"]) == 2
    assert "--master is for --engine spark" in capsys.readouterr().err


def test_kazoo_ordering_runs_on_spark(spark, zookeeper, kafka):
    """KaZoo on the Spark engine: every ordered replica runs its orderer (one session per
    worker task) against the real services; the output is the one the followed orders
    give, replicas agreeing."""
    config = td.KazooConfig(zk_hosts=kafka.zk_hosts, kafka_bootstrap=kafka.kafka_bootstrap)
    job = mib1_job(3, 2, "kazoo", RATE, kazoo=config, sink=td.sinks.Collect())
    res = job.run(duration=DURATION, engine=tandem_spark.SparkEngine(spark))
    assert res.lost == 0 and res.duplicates == 0 and res.digests_match
    assert res.events_out == res.events_in == RATE * DURATION
    assert sorted(res.leaders) == [f"map{i}[{p}]" for i in (1, 2, 3) for p in (0, 1)]


@pytest.mark.parametrize("kill", [False, True], ids=["no-fault", "kill"])
def test_functions_of_a_whole_batch_agree_on_spark(spark, kill):
    """A batch's row count and two filters concatenated, each after a keyed merge: the
    replicas are called with the same batches, so they agree, and the output is the
    reference's row for row — with the worker task of one replica killed too."""
    job = td.Job("batches", replication=2, workers=2)
    events = job.source(td.sources.Synthetic(rate=RATE, keys=40, seed=11), parallelism=2)
    rows = events.key_by("key").map(with_batch_rows, parallelism=2, name="rows")
    rows.key_by("key").flat_map(two_thresholds, parallelism=2, name="alert").sink(
        td.sinks.Collect()
    )
    faults = [td.Kill("alert", partition=1, replica=0, at=1.5)] if kill else []
    res = job.run(duration=DURATION, faults=faults, engine=tandem_spark.SparkEngine(spark))
    assert res.lost == 0 and res.duplicates == 0 and res.digests_match
    want = job.run_reference(duration=DURATION, t0_ns=res.t0_ns).output
    assert multiset_diff(want, res.output) == (0, 0)
    assert max(res.output.column("batch_rows").to_pylist()) > 1
    assert lost_replicas(res) == killed_replicas(res)
    assert len(res.lost_replicas) == (3 if kill else 0)  # one partition of each task


def test_a_sink_kill_is_refused_on_spark_which_restarts_no_sink():
    # Valid for the local engine (a single Kafka sink with restore=True restarts from its
    # last commit); the Spark engine says so before it starts anything. (A replicated
    # Kafka sink's kill is handed to its twin on both engines: tests/test_kafka.py.)
    job = td.Job("spark-sink-kill", replication=2, restore=True)
    kafka = td.sinks.Kafka("t", bootstrap="x:1")
    job.source(td.sources.Synthetic(rate=10)).sink(kafka, name="out", replication=1)
    with pytest.raises(td.ConfigError, match=r"does not restart a lost sink.*local engine"):
        job.run(duration=2, faults=[td.Kill("out", 0, 0, at=1)], engine=tandem_spark.SparkEngine())
