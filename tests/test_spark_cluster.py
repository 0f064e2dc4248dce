"""The Spark engine on ``local-cluster[2,5,1024]``: two executor JVMs (a standalone master
and workers, all on this machine), so killing one executor is a node crash.

Its own module, because a process hosts one SparkContext at a time and this one differs
from ``test_spark``'s ``local[N,F]``.
"""

from __future__ import annotations

import pytest

import tandem as td
import tandem_spark
from tandem.bench import mib1_job

pytestmark = pytest.mark.spark

MASTER = "local-cluster[2,5,1024]"  # 10 slots: MiB1 of length 1 has 9 replicas, 1 spare
RATE, DURATION = 1_000, 4.0


@pytest.fixture(scope="module")
def cluster():
    session = tandem_spark.local_session(9, master=MASTER, spare_slots=1)
    yield session
    session.stop()


def test_executor_crash_is_masked_and_twins_run_on_different_executors(cluster):
    job = mib1_job(1, replication=2, ordering="liverobin", rate=RATE, sink=td.sinks.Collect())
    engine = tandem_spark.SparkEngine(cluster, kill="executor")
    # Replica 1 of every partition runs on the second executor; the sink (unreplicated)
    # runs with the replicas 0, on the first.
    fault = td.Kill("map1", partition=0, replica=1, at=2.0)
    res = job.run(duration=DURATION, faults=[fault], engine=engine)

    run = engine.last_run
    placed = {a.replica: a.executor_pid for a in run.attempts if a.replica is not None}
    assert len(set(placed.values())) == 2
    for task in job.plan().tasks:
        for p in range(task.parallelism):
            hosts = {placed[(task.id, p, r)] for r in range(task.replication)}
            assert len(hosts) == task.replication, f"twins of {task.name}[{p}] share an executor"
    victim = placed[(job.plan().task("map1").id, 0, 1)]
    on_victim = sorted(rid for rid, pid in placed.items() if pid == victim)
    assert sorted(run.killed) == on_victim  # the whole executor went down

    ref = job.run_reference(duration=DURATION, t0_ns=res.t0_ns)
    assert res.output.num_rows == ref.output.num_rows == RATE * DURATION
    assert res.lost == 0 and res.duplicates == 0 and res.digests_match
    assert res.max_gap_ms < 2_000  # no restart: a Structured Streaming driver takes ~20 s
    # Spark re-ran the lost executor's tasks elsewhere; each retired at once.
    assert len(run.retried_slots()) == len(on_victim)
