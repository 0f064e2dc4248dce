"""Live rescale on the local engine (tandem.runtime.rescaling): a running keyed task goes
from 2 to more partitions with nothing stopped, lost or doubled — checked against an
independent expectation (pandas over the input) and against the reference run, which
replays the rescale (Plan.live_rescales) down to each row's count."""

from __future__ import annotations

import time

import pytest

import tandem as td
from jobs import write_events
from test_savepoints import KEYS, RATE, ROWS, check_continues, expected_counts, keyed_job, pairs


@pytest.fixture(scope="module")
def input_file(tmp_path_factory) -> str:
    return write_events(tmp_path_factory.mktemp("rescale") / "events.parquet", ROWS, KEYS, 11)


def check_exact(result: td.Result, input_file: str) -> None:
    assert result.events_out == ROWS
    assert result.lost == 0 and result.duplicates == 0 and result.digests_match
    out = result.output.to_pandas()
    assert out["id"].is_unique
    assert pairs(out).equals(expected_counts(input_file).reset_index(drop=True))


@pytest.mark.parametrize("to", [3, 4])
def test_a_running_keyed_task_rescales_with_nothing_lost_or_doubled(input_file, to):
    handle = keyed_job(input_file, name=f"live{to}").start(progress=False)
    time.sleep(1.0)  # a third of the input
    record = handle.rescale("count", to, timeout=60)
    result = handle.wait(timeout=120)
    assert (record["from"], record["to"]) == (2, to)
    assert 0 < record["switch_s"] < ROWS / RATE, "switched while the input ran"
    assert result.rescales == [record]
    check_exact(result, input_file)
    # Every partition of the new shape counted rows of its key groups after the switch.
    reports = {(r["task"], r["partition"]) for r in result.lost_replicas}
    assert not reports
    assert result.max_gap_ms is None or result.max_gap_ms < 1000


def test_a_rescale_that_cannot_be_done_is_refused_and_the_job_runs_on(input_file):
    handle = keyed_job(input_file, name="refused").start(progress=False)
    time.sleep(0.5)
    with pytest.raises(td.ConfigError, match="only an operator task"):
        handle.rescale("source", 3)
    with pytest.raises(td.ConfigError, match="not supported yet"):
        handle.rescale("count", 1)
    check_exact(handle.wait(timeout=120), input_file)


def test_a_rescale_not_armed_in_time_is_given_up_and_the_job_runs_on(input_file, monkeypatch):
    from tandem.engines import coordinator

    monkeypatch.setattr(coordinator, "RESCALE_ARM_S", 0.0)  # no worker can be that quick
    handle = keyed_job(input_file, name="given-up").start(progress=False)
    time.sleep(1.0)
    with pytest.raises(td.TandemError, match="given up, the job runs on unchanged"):
        handle.rescale("count", 4, timeout=60)
    result = handle.wait(timeout=120)
    assert result.rescales == []
    check_exact(result, input_file)  # the reference runs the plan with no rescale


def test_a_worker_lost_after_a_rescale_is_rebuilt_with_the_new_partitions(input_file):
    job = keyed_job(input_file, name="rebuilt")
    job.restore = True
    # Killed well after the switch (about 1 s of source time): its worker hosts the
    # new partitions of its replica group too, and is rebuilt from their twins.
    handle = job.start(progress=False, faults=[td.Kill("count", 0, 1, at=2.0)])
    handle.rescale("count", 4, timeout=60)
    result = handle.wait(timeout=120)
    check_exact(result, input_file)
    assert result.restored_replicas, "the lost worker came back"
    rebuilt = {(r["task"], r["partition"]) for r in result.restored_replicas}
    assert ("count", 3) in rebuilt, rebuilt


@pytest.mark.parametrize("resumed_at", [2, 4])
def test_a_job_rescaled_live_stops_at_a_savepoint_and_resumes_at_any_parallelism(
    input_file, tmp_path, resumed_at
):
    path = str(tmp_path / "after-rescale")
    handle = keyed_job(input_file, name="saved").start(progress=False)
    handle.rescale("count", 4, timeout=60)
    before = handle.stop(timeout=120, savepoint=path)
    assert before.lost == 0 and before.duplicates == 0 and before.digests_match
    assert before.rescales and td.Savepoint.read(path).epoch > before.rescales[0]["epoch"]
    after = keyed_job(input_file, 1, name="saved", count_parallelism=resumed_at).run(
        from_savepoint=path, progress=False, timeout=120
    )
    check_continues(input_file, before.output.to_pandas(), after.output.to_pandas())
