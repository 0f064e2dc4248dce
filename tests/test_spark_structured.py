"""Spark Structured Streaming as the passive baseline, on a real local Spark.

Each run starts real driver processes (a local[2] SparkSession and its JVM each), so the
streams are short and slow (1,000 ev/s, ~10 s). On a lightly loaded machine the first
driver writes a few micro-batches before the kill; on a busy one it may not finish its
first, and then the restart re-runs that batch from the offset log. The assertions hold
either way: they are what Spark guarantees, not what a particular timing produced.
"""

from __future__ import annotations

import pytest

from tandem.exceptions import ConfigError
from tandem_spark.structured import run_baseline

pytestmark = pytest.mark.spark


def test_fault_free_run_delivers_every_event_once_and_measures_latency():
    res = run_baseline(rate=1_000, duration=8, warmup=3)
    assert res["events_in"] == 8_000
    assert (res["lost"], res["duplicates"], res["events_out"]) == (0, 0, 8_000)
    assert 0 < res["p50_ms"] <= res["p99_ms"] <= res["max_ms"]
    assert res["batches"] > 1 and res["first_output_s"] > 0
    assert res["downtime_s"] is None and res["duplicate_batches"] == 0


def test_driver_kill_resumes_from_the_checkpoint_with_no_loss_and_exact_state(tmp_path):
    res = run_baseline(
        rate=1_000, duration=14, kill_driver_at=8, stateful=True, warmup=2, workdir=tmp_path / "r"
    )
    assert res["events_in"] == 14_000
    assert res["lost"] == 0
    # Passive recovery leaves a hole in the output: a new JVM, session and query first.
    assert res["downtime_s"] > 0
    assert res["restart_s"]["first_output"] == res["downtime_s"]
    # Every event released at the kill waits for the restarted driver: downtime is latency.
    assert res["max_ms"] >= 1_000 * res["downtime_s"] - 2  # 1 ms between events, 1 ms rounding
    # foreachBatch is at-least-once across a driver crash: the batch in flight (planned in
    # the offset log, not yet in the commit log) is run again with the same offsets, so any
    # duplicate is a whole re-written batch with the same events, and a sink idempotent by
    # batch id would have kept each event once.
    assert res["duplicate_batches"] <= 1
    assert (res["duplicates"] > 0) == (res["duplicate_batches"] == 1)
    assert res["replays_identical"]
    assert res["duplicates_if_idempotent"] == 0
    assert res["events_out"] == res["events_in"] + res["duplicates"]
    # Keyed state is restored to the version the re-run batch started from: every row's
    # running count matches tandem.CountPerKey on the same stream, re-written rows included.
    assert res["wrong_counts"] == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rate": 0}, "rate must be > 0"),
        ({"duration": 10, "warmup": 10}, "warmup must be in"),
        ({"duration": 20, "kill_driver_at": 20}, "kill_driver_at must be inside the stream"),
        ({"maps": -1}, "maps must be an int"),
    ],
)
def test_bad_parameters_fail_before_starting_spark(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        run_baseline(**kwargs)


def test_a_used_workdir_is_refused_rather_than_resumed(tmp_path):
    (tmp_path / "checkpoint").mkdir()
    with pytest.raises(ConfigError, match="is not empty"):
        run_baseline(duration=5, warmup=1, workdir=tmp_path)
