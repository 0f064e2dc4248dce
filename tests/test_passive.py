"""The passive configuration (``Job(replication=1, checkpoint_ms=...)``): aligned
checkpoints of every replica to local disk, and a lost worker rolled back to the latest.

Every run is checked against the reference executor (lost and duplicated rows as
multisets, the stateful counts included): a rollback replays from the checkpoint, and the
sinks' dedup drops what had been delivered already.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pytest

import tandem as td
from tandem.exceptions import TandemError

RATE = 1500


def batch_mean(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A function of the whole batch: a rolled-back replica agrees only if its batches do."""
    mean = pc.mean(batch.column("value")).as_py()
    return batch.append_column("batch_mean", pa.array([mean] * batch.num_rows, pa.float64()))


def passive_job(checkpoint_ms: float = 500, replay_ms: float | None = None) -> td.Job:
    job = td.Job("passive", replication=1, checkpoint_ms=checkpoint_ms, replay_ms=replay_ms)
    ev = job.source(td.sources.Synthetic(rate=RATE, keys=40, seed=11), parallelism=2)
    (
        ev.map(batch_mean, parallelism=2, name="mean")
        .key_by("key")
        .process(td.CountPerKey(), parallelism=2, name="count")
        .sink(td.sinks.Collect())
    )
    return job


def replicas(records: list[dict]) -> set[tuple[str, int, int]]:
    return {(r["task"], r["partition"], r["replica"]) for r in records}


def test_a_killed_worker_rolls_back_to_the_latest_checkpoint_twice_and_loses_nothing():
    faults = [td.Kill("count", 0, 0, at=2.0), td.Kill("count", 1, 0, at=4.5)]
    res = passive_job().run(duration=7, faults=faults)
    assert res.lost == 0 and res.duplicates == 0
    assert res.digests_match, res.determinism_errors
    # Each kill took a whole worker (source, mean and count of one partition) down, and
    # both were rolled back.
    assert replicas(res.restored_replicas) == replicas(res.lost_replicas)
    assert {("count", 0, 0), ("count", 1, 0), ("source", 0, 0), ("mean", 1, 0)} <= replicas(
        res.restored_replicas
    )
    for r in res.restored_replicas:
        assert r["twin"] is None and r["checkpoint"] > 0, r
        assert r["epoch"] >= r["checkpoint"], r
        assert r["lost_s"] < r["restored_s"] < r["lost_s"] + 10, r
        # The checkpoint is at most a period and a bit old at the loss (10 ms heartbeats).
        assert r["lost_s"] - r["checkpoint"] / 100 < 2.0, r
    ck = res.checkpoints
    assert ck is not None and ck["rollbacks"] == 2
    assert ck["completed"] >= 5 and ck["last_s"] > 4.5, ck
    # Passive: the output stops from the loss until the rolled-back replicas have
    # replayed past it — much longer than a heartbeat period, but bounded.
    assert res.max_gap_ms is not None and 50 < res.max_gap_ms < 5000, res.max_gap_ms


def test_a_loss_before_the_first_checkpoint_restarts_from_the_beginning_of_the_stream():
    res = passive_job(checkpoint_ms=3000).run(duration=5, faults=[td.Kill("count", 0, 0, at=1.0)])
    assert res.lost == 0 and res.duplicates == 0
    assert res.digests_match, res.determinism_errors
    assert ("count", 0, 0) in replicas(res.restored_replicas)
    for r in res.restored_replicas:
        assert r["checkpoint"] == 0 and r["epoch"] == 0, r
    assert res.checkpoints["rollbacks"] == 1


def test_a_replay_window_that_no_longer_reaches_the_checkpoint_fails_the_job_clearly():
    # 100 ms of replay, a checkpoint a second: the window has moved past it at the loss.
    job = passive_job(checkpoint_ms=1000, replay_ms=100)
    with pytest.raises(TandemError, match=r"raise Job\(replay_ms=\.\.\.\) or lower checkpoint_ms"):
        job.run(duration=4, faults=[td.Kill("count", 0, 0, at=1.8)])


def test_checkpoints_are_taken_without_faults_and_the_knobs_are_checked():
    res = passive_job().run(duration=2.5)
    assert res.lost == 0 and res.duplicates == 0
    assert res.checkpoints["completed"] >= 2 and res.checkpoints["rollbacks"] == 0
    assert res.restored_replicas == []
    # Without checkpoint_ms nothing is reported.
    assert td.Job("j", replication=1).plan is not None
    job = passive_job(checkpoint_ms=1500)
    assert job.replay_ms == 2 * 1500 + 3000
    with pytest.raises(td.ConfigError, match="more than the heartbeat period"):
        td.Job("j", replication=1, checkpoint_ms=10)
    with pytest.raises(td.ConfigError, match="replication=1"):
        td.Job("j", replication=2, checkpoint_ms=500)
    with pytest.raises(td.ConfigError, match="choose one"):
        td.Job("j", replication=1, checkpoint_ms=500, restore=True)
    with pytest.raises(td.ConfigError, match="ordering='kazoo'"):
        td.Job("j", replication=1, checkpoint_ms=500, ordering="kazoo")


def test_bench_failover_runs_the_passive_baseline_beside_the_others():
    import io

    from tandem.experiments import failover

    (row,) = failover.failover(
        rate=500, duration=4.0, kill_at=2.0, cases=("passive",), log=io.StringIO()
    )
    assert (row.case, row.lost, row.duplicates, row.digests_match) == ("passive", 0, 0, True)
    # The rollback shows: a gap in the output well beyond a heartbeat period.
    assert row.downtime_ms is not None and row.downtime_ms > 50, row
    assert row.fault_free_peak_ms > 0


def test_a_rolled_back_replica_reads_its_checkpoint_file_and_leaves_it(tmp_path):
    from tandem import _core
    from tandem.runtime import Replica, Resume

    plan = passive_job().plan()
    count = plan.task("count")
    inst = plan.instantiate(count.id, 0, replica=0, t0_ns=0)
    columns = {
        "source_seq": [0, 1, 2],
        "event_time_ns": [0, 0, 0],
        "key": [1, 1, 2],
        "value": [0.5, 0.5, 0.5],
        "batch_mean": [0.5, 0.5, 0.5],
    }
    inst.batch(pa.record_batch(columns, schema=plan.task("mean").schema), 0)
    state = inst.snapshot()
    assert state
    cut = (7, [7], None, [])  # only the epoch matters here

    def restored(resume: Resume) -> Replica:
        rep = Replica(plan, count.id, 0, 0, b"s" * 32, _core.Worker())
        rep.resume = resume
        rep.restore(0)
        return rep

    kept = Resume(cut, state).checkpointed(str(tmp_path / "count-0-0.state"))
    assert kept.keep_file and kept.state == b"" and kept.load() == state
    assert restored(kept)._inst.snapshot() == state
    assert restored(kept)._inst.snapshot() == state  # a second loss reads it again
    assert (tmp_path / "count-0-0.state").read_bytes() == state
    # A twin's spilled state is read once and removed.
    spilled = Resume(cut, state).spilled(str(tmp_path))
    restored(spilled)
    assert not (tmp_path / spilled.state_file).exists()
