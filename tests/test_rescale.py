"""Live rescale on the local engine (tandem.runtime.rescaling): a running keyed task goes
from 2 to more partitions with nothing stopped, lost or doubled — checked against an
independent expectation (pandas over the input) and against the reference run, which
replays the rescale (Plan.live_rescales) down to each row's count."""

from __future__ import annotations

import time

import pytest
from test_savepoints import KEYS, RATE, ROWS, expected_counts, keyed_job, pairs

import tandem as td
from jobs import write_events


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
