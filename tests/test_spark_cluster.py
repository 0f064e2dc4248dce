"""The Spark engine on ``local-cluster[2,3,1024]``: two executor JVMs (a standalone master
and workers, all on this machine), so killing one executor is a node crash.

Its own module, because a process hosts one SparkContext at a time and this one differs
from ``test_spark``'s ``local[N,F]``.
"""

from __future__ import annotations

import pytest

import tandem as td
import tandem_spark
from tandem.experiments.workloads import mib1_job
from tandem.testing import killed_replicas, lost_replicas

pytestmark = pytest.mark.spark

# 6 slots: MiB1 of length 1 with one worker per replica group runs 3 worker tasks (group
# 0, group 1, the sink), and the surviving executor has room for a retry.
MASTER = "local-cluster[2,3,1024]"
RATE, DURATION = 1_000, 4.0
REJOIN_RUN = 8.0
# A lost executor is replaced by a new JVM: seconds to start on a small machine.
EXECUTOR_REJOIN_RUN = 16.0


def mib1() -> td.Job:
    job = mib1_job(1, replication=2, ordering="liverobin", rate=RATE, sink=td.sinks.Collect())
    job.workers = 1  # per replica group, whatever this machine's cores
    return job


@pytest.fixture(scope="module")
def local_cluster():
    session = tandem_spark.local_session(mib1(), master=MASTER, spare_slots=1)
    yield session
    session.stop()


def test_executor_crash_is_masked_and_twins_run_on_different_executors(local_cluster):
    job = mib1()
    plan = job.plan()
    assert len(plan.placement()) == 4
    engine = tandem_spark.SparkEngine(local_cluster, kill="executor")
    # The workers of replica group 1 run on the second executor, with the worker of the
    # sink's replica 1; group 0 and the sink's replica 0 on the first.
    fault = td.Kill("map1", partition=0, replica=1, at=2.0)
    res = job.run(duration=DURATION, faults=[fault], engine=engine)

    run = engine.last_run
    assert sorted(run.workers()) == [0, 1, 2, 3]  # one task per worker
    placed = {rid: a.executor for rid, a in run.hosts().items()}
    assert sorted(placed) == sorted(plan.replicas())
    assert len(set(placed.values())) == 2
    for task in plan.tasks:
        for p in range(task.parallelism):
            hosts = {placed[(task.id, p, r)] for r in range(task.replication)}
            assert len(hosts) == task.replication, f"twins of {task.name}[{p}] share an executor"
    victim = placed[(plan.task("map1").id, 0, 1)]
    on_victim = sorted(rid for rid, executor in placed.items() if executor == victim)
    assert sorted(run.killed) == on_victim  # the whole executor went down
    # The sink's replica 1 went with it (its own worker, on that executor); its twin had
    # every row.
    assert lost_replicas(res) == killed_replicas(res) | {("sink", 0, 1)}
    # Replica group 1 (both partitions of the source and the map) and the sink's replica 1.
    assert len(on_victim) == 5

    ref = job.run_reference(duration=DURATION, t0_ns=res.t0_ns)
    assert res.output.num_rows == ref.output.num_rows == RATE * DURATION
    assert res.lost == 0 and res.duplicates == 0 and res.digests_match
    assert res.max_gap_ms < 2_000  # no restart: a Structured Streaming driver takes ~20 s
    # Spark re-ran the lost executor's tasks elsewhere; each retired at once.
    victims = {a.slot for a in run.workers().values() if a.executor == victim}
    assert run.retried_slots() == sorted(victims)


def test_retried_tasks_rejoin_on_their_executors_and_r_is_restored(local_cluster):
    """restore=True, the Python worker of a replica killed: Spark retries its task on the
    same executor, the retry rebuilds the worker's replicas from cuts of their twins on
    the other executor, and the later kill of those twins' worker is masked too — every
    partition keeps its replicas on two executors throughout."""
    job = mib1()
    job.restore = True
    plan = job.plan()
    engine = tandem_spark.SparkEngine(local_cluster)
    first, second = 1.0, 5.0
    faults = [td.Kill("map1", 0, 1, at=first), td.Kill("map1", 0, 0, at=second)]
    res = job.run(duration=REJOIN_RUN, faults=faults, engine=engine)

    ref = job.run_reference(duration=REJOIN_RUN, t0_ns=res.t0_ns)
    assert res.output.num_rows == ref.output.num_rows == RATE * REJOIN_RUN
    assert res.lost == 0 and res.duplicates == 0
    assert res.digests_match, res.determinism_errors
    assert lost_replicas(res) == killed_replicas(res)
    # Both kills took a replica group down (the source's and map1's replicas of both
    # partitions); each was rebuilt, the first before the second kill.
    restored = {(r["task"], r["partition"], r["replica"]) for r in res.restored_replicas}
    assert restored == lost_replicas(res)
    assert len(res.restored_replicas) == 8
    (injected,) = [f["injected_at"] for f in res.faults if f["at"] == second]
    assert all(r["restored_s"] < injected for r in res.restored_replicas if r["lost_s"] < second), (
        res.restored_replicas
    )
    run = engine.last_run
    placed = {rid: a.executor for rid, a in run.hosts().items()}
    for task in plan.tasks:
        for p in range(task.parallelism):
            hosts = {placed[(task.id, p, r)] for r in range(task.replication)}
            assert len(hosts) == task.replication, f"twins of {task.name}[{p}] share an executor"
    assert all(run.workers()[f["worker"]].rejoined for f in res.faults)


def test_an_executor_crash_is_rebuilt_on_another_executor_and_r_is_restored(local_cluster):
    """restore=True, an executor JVM killed: Spark retries its worker task at once on the
    surviving executor, beside the twins, so that attempt retires and the driver starts
    the worker again in a job of its own on the lost executor's replacement (the
    standalone master starts one), where it rejoins: r is restored and every partition
    has its replicas on two executors again."""
    job = mib1()
    job.restore = True
    plan = job.plan()
    engine = tandem_spark.SparkEngine(local_cluster, kill="executor")
    fault = td.Kill("map1", partition=0, replica=1, at=1.0)
    res = job.run(duration=EXECUTOR_REJOIN_RUN, faults=[fault], engine=engine)

    assert res.output.num_rows == RATE * EXECUTOR_REJOIN_RUN
    assert res.lost == 0 and res.duplicates == 0
    assert res.digests_match, res.determinism_errors
    restored = {(r["task"], r["partition"], r["replica"]) for r in res.restored_replicas}
    # The sink's replica 1, on the same executor, is lost too: rebuilt from its twin's
    # copy if there is time (its twin has every row, and one copy is all the job
    # publishes).
    assert lost_replicas(res) == killed_replicas(res) | {("sink", 0, 1)}
    assert killed_replicas(res) <= restored <= lost_replicas(res)
    # replica group 1: both partitions of the source and the map
    assert len(killed_replicas(res)) == 4
    run = engine.last_run
    (record,) = res.faults
    killed = next(a for a in run.attempts if a.cause == "killed")
    rebuilt = run.workers()[record["worker"]]
    assert rebuilt.rejoined and rebuilt.executor_id not in (None, killed.executor_id)
    placed = {rid: a.executor for rid, a in run.hosts().items()}
    for task in plan.tasks:
        for p in range(task.parallelism):
            hosts = {placed[(task.id, p, r)] for r in range(task.replication)}
            assert len(hosts) == task.replication, f"twins of {task.name}[{p}] share an executor"
