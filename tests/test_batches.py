"""The batch is the unit of determinism (DESIGN §2 invariant 1).

Every replica of a task partition is called with the same batches, so an Arrow function
that computes over its whole batch — a row count, a mean, a rank, two filters
concatenated — gives the same output at every replica, with and without faults, and the
run equals the reference executor row for row. A function that is not deterministic for a
given batch makes the job fail with ``DeterminismError`` (unless ``on_divergence="log"``).
"""

from __future__ import annotations

import random
import time

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tandem as td
from tandem import testing
from tandem.engines.common import multiset_diff
from tandem.reference import canonical
from tandem.testing import BATCH_FUNCTIONS, noisy, two_thresholds

RATE = 1_500
DURATION = 2.5


# -- functions (module level: they travel to the replica processes) -------------------------


def jittery(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Deterministic output, random timing: sleeps up to 3 ms, so the replicas' batches
    arrive downstream in different interleavings."""
    time.sleep(random.random() * 0.003)
    return batch


def noisy_schema() -> pa.Schema:
    return td.sources.Synthetic(rate=1).schema().append(pa.field("noise", pa.float64()))


BATCH_FNS = {**BATCH_FUNCTIONS, "jitter": ("map", jittery)}


def pipeline(stages: list[str], replication: int, **knobs) -> td.Job:
    """Two source partitions, then the stages in order, each keyed on ``key`` (so every
    stage merges two input channels), then a Collect sink."""
    job = td.Job("batches", replication=replication, **knobs)
    stream = job.source(td.sources.Synthetic(rate=RATE, keys=40, seed=11), parallelism=2)
    for i, name in enumerate(stages):
        kind, fn = BATCH_FNS[name]
        stream = getattr(stream.key_by("key"), kind)(fn, parallelism=2, name=f"s{i}_{name}")
    stream.sink(td.sinks.Collect())
    return job


def assert_equals_reference(job: td.Job, res: td.Result) -> None:
    """Digests agree and the sink holds exactly the reference's rows."""
    assert res.digests_match, res.determinism_errors
    ref = job.run_reference(duration=DURATION, t0_ns=res.t0_ns)
    assert res.output.num_rows == ref.output.num_rows > 0
    assert multiset_diff(ref.output, res.output) == (0, 0)
    assert canonical(res.output).equals(canonical(ref.output))
    assert res.lost == 0 and res.duplicates == 0


@pytest.mark.parametrize("replication", [2, 3])
@pytest.mark.parametrize("kill", [False, True], ids=["no-fault", "kill"])
def test_batch_functions_agree_across_replicas(replication, kill):
    job = pipeline(["rows", "thresholds", "rank", "mean"], replication)
    faults = []
    if kill:
        rng = random.Random(replication)
        faults = [
            td.Kill(
                rng.choice(["s0_rows", "s1_thresholds", "s2_rank"]),
                partition=rng.randrange(2),
                replica=rng.randrange(replication),
                at=rng.uniform(0.5, DURATION - 0.5),
            )
        ]
    res = job.run(duration=DURATION, faults=faults, progress=False)
    assert_equals_reference(job, res)
    assert testing.lost_replicas(res) == testing.killed_replicas(res)
    assert bool(res.lost_replicas) == bool(faults)
    # The batch functions really saw multi-row batches (else this proves nothing).
    assert pc.max(res.output.column("batch_rows")).as_py() > 1


def rules_and_events(replication: int) -> td.Job:
    """The application of the paper's §VII shape: customer events and two rule streams,
    filters, two joins, a 2-partition flat_map alerting over two thresholds, a window."""
    job = td.Job("alerts", replication=replication)
    events = job.source(td.sources.Synthetic(rate=RATE, keys=30, seed=5), parallelism=2)
    limits = job.source(
        td.sources.Synthetic(rate=50, keys=30, seed=6, extras={"limit": "float64"}), name="limits"
    )
    tiers = job.source(
        td.sources.Synthetic(rate=20, keys=30, seed=8, extras={"tier": "int64"}), name="tiers"
    )
    joined = (
        events.filter(valid_value, name="valid")
        .join(limits.map(drop_value, name="limit_rules"), on="key", name="join_limits")
        .join(tiers.map(drop_value, name="tier_rules"), on="key", name="join_tiers")
    )
    alerts = joined.key_by("key").flat_map(two_thresholds, parallelism=2, name="alert")
    alerts.window(100, {"alerts": ("value", "count")}, key="key", name="per_key").sink(
        td.sinks.Collect()
    )
    return job


def valid_value(batch: pa.RecordBatch) -> pa.Array:
    return pc.greater_equal(batch.column("value"), 0.05)


def drop_value(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch.drop_columns(["value"])


@pytest.mark.parametrize("kill", [False, True], ids=["no-fault", "kill-alert"])
def test_filter_twice_after_two_joins(kill):
    job = rules_and_events(2)
    faults = [td.Kill("alert", partition=1, replica=0, at=1.2)] if kill else []
    res = job.run(duration=DURATION, faults=faults, progress=False)
    assert_equals_reference(job, res)


def test_a_non_deterministic_function_fails_the_job():
    job = td.Job("noise", replication=2)
    ev = job.source(td.sources.Synthetic(rate=RATE, keys=10, seed=1), parallelism=2)
    ev.map(noisy, parallelism=2, name="noisy", schema=noisy_schema()).sink(td.sinks.Collect())
    t = time.monotonic()
    with pytest.raises(td.DeterminismError, match=r"'noisy'.* partition \d: replicas \d and \d"):
        job.run(duration=60, progress=False)
    # Online: the first heartbeat cycles give it away, long before the 60 s end (start-up
    # alone can take several seconds on a busy machine).
    assert time.monotonic() - t < 40


def test_on_divergence_log_keeps_running_and_reports():
    job = td.Job("noise", replication=2, on_divergence="log")
    ev = job.source(td.sources.Synthetic(rate=RATE, keys=10, seed=1), parallelism=1)
    ev.map(noisy, name="noisy", schema=noisy_schema()).sink(td.sinks.Collect())
    res = job.run(duration=1.5, progress=False, check=False)
    assert not res.digests_match
    assert res.determinism_errors and "noisy" in res.determinism_errors[0]


def test_bad_on_divergence_is_a_config_error():
    with pytest.raises(td.ConfigError, match=r"on_divergence must be 'fail' or 'log'"):
        td.Job("x", on_divergence="ignore")


@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    stages=st.lists(st.sampled_from(sorted(BATCH_FNS)), min_size=1, max_size=3),
    replication=st.sampled_from([2, 3]),
    fault=st.sampled_from(["none", "kill", "pause"]),
    seed=st.integers(0, 1_000),
)
def test_random_pipelines_of_batch_functions_equal_the_reference(stages, replication, fault, seed):
    """Random pipelines of batch-dependent functions, with a replica killed or frozen for
    a while at a random moment: replicas agree and the output is the reference's."""
    job = pipeline(stages, replication)
    rng = random.Random(seed)
    names = [f"s{i}_{n}" for i, n in enumerate(stages)]
    task = rng.choice(names)
    at = rng.uniform(0.4, DURATION - 0.6)
    where = {"partition": rng.randrange(2), "replica": rng.randrange(replication), "at": at}
    faults = {
        "none": [],
        "kill": [td.Kill(task, **where)],
        "pause": [td.Pause(task, for_s=0.3, **where)],
    }[fault]
    res = job.run(duration=DURATION, faults=faults, progress=False)
    assert_equals_reference(job, res)
