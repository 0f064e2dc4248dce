"""Live rescale, step 2: the oracle and the pure decisions (tandem.rescale, Plan.rescaled,
reference.run replaying Plan.live_rescales).

The reference run of the keyed job of tests/test_savepoints.py with its count going from n
to m partitions right after a heartbeat K gives every input row once, with the counts per
key 1..n an independent pandas expectation gives; the rows of a run with no rescale (up to
K with the same counts, row for row); and the rows of a key whose group moved counted by
the old partition up to a point and by the new one from there on. Every refusal of
tandem.rescale.check names its cause."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

import tandem as td
from jobs import write_events
from tandem import reference, rescale
from tandem.plan import LiveRescale, hash_channels
from tandem.sources import LogSource
from test_savepoints import KEYS, ROWS, Opaque, Tally, expected_counts, keyed_job, pairs

K = 120
"""The heartbeat the rescales happen after: 1.2 s into the 3 s of input (heartbeat 10 ms)."""


@pytest.fixture(scope="module")
def input_file(tmp_path_factory) -> str:
    return write_events(tmp_path_factory.mktemp("input") / "events.parquet", ROWS, KEYS, 11)


class Tagged(td.CountPerKey):
    """A running count per key that also says which partition counted the row."""

    def process(self, batch: pa.RecordBatch, state: dict) -> pa.RecordBatch:
        out = super().process(batch, state)
        where = pa.array(np.full(out.num_rows, self.ctx.partition), pa.int64())
        return out.append_column("partition", where)


def run(plan: td.plan.Plan) -> pd.DataFrame:
    return reference.run(plan, plan.natural_end_ns() / 1e9).output.to_pandas()


@pytest.mark.parametrize(("was", "now"), [(2, 4), (2, 3), (1, 2)])
def test_a_live_rescale_counts_every_row_once_and_every_key_on(input_file, was, now):
    # A sink of the count's parallelism would be fed by a forward edge, which refuses.
    sinks = 1 if was > 1 else 2
    plan = keyed_job(
        input_file, count_parallelism=was, counter=Tagged(), sink_parallelism=sinks
    ).plan()
    live = rescale.after(plan, "count", now, K)
    assert live.task("count").parallelism == now
    assert live.live_rescales == (LiveRescale("count", K, was, now),)
    got = run(live)

    # Every row once, and the counts per key 1..n over the switch (pandas, not tandem).
    assert len(got) == ROWS and set(got["id"]) == set(range(ROWS))
    assert pairs(got).equals(expected_counts(input_file).reset_index(drop=True))

    # The rows of a run with no rescale. Which of a key's rows gets which count does
    # depend on the partitioning (it decides the batches, hence the turns, in which the
    # rows of the two sources meet), so that equality is of the rows with their ids and of
    # the counts per key; up to the switch, with the counts too, row for row.
    unscaled = run(plan).sort_values("id").reset_index(drop=True)
    got = got.sort_values("id").reset_index(drop=True)
    assert got[["id", "key", "tag"]].equals(unscaled[["id", "key", "tag"]])
    assert pairs(got).equals(pairs(unscaled))
    early = got["event_time_ns"] < K * plan.heartbeat_ns
    assert 0 < early.sum() < ROWS
    assert got[early]["count"].equals(unscaled[early]["count"])

    # Every row counted by its key's owner before the switch or after it; a key that moved
    # was counted by the old owner up to a point and by the new one from there on.
    keys = pa.array(got["key"].unique())
    before = dict(zip(keys.to_pylist(), hash_channels(keys, was).tolist(), strict=True))
    after = dict(zip(keys.to_pylist(), hash_channels(keys, now).tolist(), strict=True))
    moved = 0
    for key, rows in got.groupby("key"):
        assert set(rows["partition"]) <= {before[key], after[key]}
        if before[key] != after[key]:
            old = rows[rows["partition"] == before[key]]["count"]
            new = rows[rows["partition"] == after[key]]["count"]
            assert len(old) and len(new), f"key {key} was not counted on both sides of K"
            assert old.max() + 1 == new.min()
            moved += 1
    assert moved > 0
    assert set(got["partition"]) == set(range(now)), "every new partition counted rows"


def test_two_rescales_one_after_the_other(input_file):
    plan = keyed_job(input_file, counter=Tagged()).plan()
    live = rescale.after(rescale.after(plan, "count", 3, 80), "count", 4, 200)
    assert [(r.epoch, r.was, r.now) for r in live.live_rescales] == [(80, 2, 3), (200, 3, 4)]
    got = run(live)
    assert len(got) == ROWS and set(got["id"]) == set(range(ROWS))
    assert pairs(got).equals(expected_counts(input_file).reset_index(drop=True))
    assert set(got["partition"]) == {0, 1, 2, 3}


def test_a_consumer_takes_every_keys_rows_in_order_across_the_switch(input_file):
    """The count feeds a second count per key (one partition): its LiveRobin takes the new
    partitions' channels only from the end of cycle K, after the rows a moved key had on
    its old partition's channel, so it counts every key's rows in the first count's
    order."""
    job = td.Job("chain", replication=2)
    source = job.source(td.sources.Parquet(input_file, rate=2000), parallelism=2, name="source")
    counted = source.key_by("key").process(td.CountPerKey(), parallelism=2, name="count")
    again = counted.key_by("key").process(td.CountPerKey("again"), parallelism=1, name="again")
    again.sink(td.sinks.Collect())
    got = run(rescale.after(job.plan(), "count", 4, K))
    assert len(got) == ROWS and set(got["id"]) == set(range(ROWS))
    assert pairs(got).equals(expected_counts(input_file).reset_index(drop=True))
    assert (got["again"] == got["count"]).all()


def test_a_state_that_cannot_be_split_is_refused_at_the_switch(input_file):
    # Its keyed_state() is per key at first sight, but holds an entry no key owns.
    live = rescale.after(keyed_job(input_file, counter=Tally()).plan(), "count", 3, K)
    with pytest.raises(
        td.ConfigError, match=rf"the state at heartbeat {K} of its partition \d holds an entry"
    ):
        run(live)


def test_the_reference_refuses_a_rescale_after_the_run_ends(input_file):
    plan = keyed_job(input_file).plan()
    late = rescale.after(plan, "count", 3, plan.last_epoch(plan.natural_end_ns() / 1e9) + 1)
    with pytest.raises(td.ConfigError, match=r"ended before heartbeat \d+, where its live rescale"):
        run(late)


# -- Plan.rescaled and live_rescales ---------------------------------------------------------


def test_rescaled_replaces_one_parallelism_and_keeps_everything_else(input_file):
    plan = keyed_job(input_file).plan()
    bigger = plan.rescaled("count", 5)
    assert [t.parallelism for t in bigger.tasks] == [2, 2, 5, 1]
    assert dataclasses.replace(bigger, tasks=plan.tasks) == plan
    assert [t.inputs for t in bigger.tasks] == [t.inputs for t in plan.tasks]
    assert plan.task("count").parallelism == 2  # a new plan; this one is unchanged
    live = rescale.after(plan, "count", 3, K)
    again = pickle.loads(pickle.dumps(live))
    assert again.live_rescales == live.live_rescales
    assert again.task("count").parallelism == 3


@pytest.mark.parametrize(
    ("task", "m", "error"),
    [
        ("count", 0, r"parallelism must be an int from 1 to the job's max_parallelism=128"),
        ("count", 129, r"max_parallelism=128 \(its key groups\), got 129"),
        ("enrich", 3, r"a forward edge links it to 'source'"),
    ],
)
def test_rescaled_refuses(input_file, task, m, error):
    with pytest.raises(td.ConfigError, match=error):
        keyed_job(input_file).plan().rescaled(task, m)


def test_a_rescale_follows_the_previous_one(input_file):
    live = rescale.after(keyed_job(input_file).plan(), "count", 3, K)
    with pytest.raises(td.ConfigError, match=rf"epoch above {K} .*got {K}"):
        rescale.after(live, "count", 4, K)


# -- refusals -------------------------------------------------------------------------------


class Replayed(LogSource):
    """A log source that is never read: only its kind matters here."""

    @property
    def schema(self) -> pa.Schema:
        return pa.schema([("id", pa.int64()), ("key", pa.int64())])

    def resolve(self, parallelism: int) -> None:
        pass

    def reader(self, partition, wake, name="", offset=None):
        raise NotImplementedError

    def next_offset(self, record) -> int:
        raise NotImplementedError

    def replay(self, partition):
        raise NotImplementedError

    def marker(self, record):
        raise NotImplementedError

    def decode(self, partition, records):
        raise NotImplementedError

    def heartbeat_target(self):
        raise NotImplementedError


class Restartable(td.sinks.Collect):
    """Stands for a Kafka sink: a sink whose commits store where its input stood."""

    restartable = True


def union_last(input_file: str) -> td.Job:
    """The count unioned with a stream whose task comes after it in the plan: the count's
    channels are not the last of the sink's."""
    job = td.Job("union", replication=2)
    source = job.source(td.sources.Parquet(input_file, rate=2000), parallelism=2, name="source")
    counted = source.key_by("key").process(td.CountPerKey(), parallelism=2, name="count")
    other = source.map(lambda b: b.append_column("count", b.column("id")), name="other")
    counted.union(other).sink(td.sinks.Collect())
    return job


def with_log_source(plan: td.plan.Plan) -> td.plan.Plan:
    tasks = list(plan.tasks)
    tasks[0] = dataclasses.replace(tasks[0], source=Replayed())
    return dataclasses.replace(plan, tasks=tuple(tasks))


@pytest.mark.parametrize(
    ("make", "task", "m", "error"),
    [
        (lambda f: keyed_job(f).plan(), "nope", 3, r"has no task 'nope'"),
        (lambda f: keyed_job(f).plan(), "source", 3, r"source task 'source' .* only an operator"),
        (lambda f: keyed_job(f).plan(), "sink", 3, r"sink task 'sink' cannot be rescaled"),
        (
            lambda f: dataclasses.replace(keyed_job(f).plan(), ordering="kazoo"),
            "count",
            3,
            r"ordering='kazoo'",
        ),
        (lambda f: keyed_job(f, replication=1).plan(), "count", 3, r"runs at replication 1"),
        (lambda f: keyed_job(f).plan(), "count", 2, r"has 2 partitions already: nothing to"),
        (
            lambda f: keyed_job(f).plan(),
            "count",
            1,
            r"shrinking a running task is not supported yet; stop with a savepoint and "
            r"resume at the smaller parallelism",
        ),
        (
            lambda f: keyed_job(f, source_parallelism=3).plan(),
            "enrich",
            4,
            r"its input from 'source' is a forward edge, not keyed",
        ),
        (
            lambda f: with_log_source(keyed_job(f).plan()),
            "count",
            3,
            r"it reads the log source 'source'",
        ),
        (
            lambda f: keyed_job(f, sink=Restartable()).plan(),
            "count",
            3,
            r"it feeds the restartable sink task 'sink'",
        ),
        (
            lambda f: keyed_job(f, counter=Opaque()).plan(),
            "count",
            3,
            r"keeps a state that is not per key \(keyed_state\(\) is None\)",
        ),
        (
            union_last,
            "count",
            3,
            r"its channels are not the last of sink task 'sink'.s inputs",
        ),
        (lambda f: keyed_job(f).plan(), "count", 200, r"max_parallelism=128"),
    ],
    ids=[
        "no-task",
        "source",
        "sink",
        "kazoo",
        "replication-1",
        "same",
        "shrink",
        "input-not-hash",
        "log-source",
        "restartable-sink",
        "not-keyed-state",
        "channel-order",
        "above-max-parallelism",
    ],
)
def test_check_refuses_naming_the_cause(input_file, make, task, m, error):
    plan = make(input_file)
    if callable(getattr(plan, "plan", None)):
        plan = plan.plan()
    with pytest.raises(td.ConfigError, match=error):
        rescale.check(plan, task, m)


def test_check_refuses_a_forward_output(input_file):
    def identity(batch: pa.RecordBatch) -> pa.RecordBatch:
        return batch

    job = td.Job("forward", replication=2)
    source = job.source(td.sources.Parquet(input_file, rate=2000), parallelism=2, name="source")
    counted = source.key_by("key").process(td.CountPerKey(), parallelism=2, name="count")
    counted.map(identity, name="after").sink(td.sinks.Collect())
    with pytest.raises(td.ConfigError, match=r"its output to operator task 'after' is a forward"):
        rescale.check(job.plan(), "count", 4)
