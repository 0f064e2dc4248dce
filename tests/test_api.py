"""The Job/Stream API, validation, the plan, sources, sinks and faults."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import tandem as td
from tandem.plan import HASH_SEED, Router, WatermarkTracker, hash_channels, xxh3_64
from tandem.reference import canonical


def identity(batch):
    return batch


def double_value(batch):
    return batch.set_column(
        batch.schema.get_field_index("value"), "value", pc.multiply(batch["value"], 2)
    )


def drop_value(batch):
    return batch.drop_columns(["value"])


def small_job(**knobs) -> td.Job:
    return td.Job("t", **knobs)


def src(rate=1000, keys=10, seed=1, **kw):
    return td.sources.Synthetic(rate=rate, keys=keys, seed=seed, **kw)


# -- knobs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"replication": 0}, "replication must be an int >= 1, got 0"),
        ({"replication": 1.5}, "replication must be an int >= 1"),
        ({"heartbeat_ms": 0}, "heartbeat_ms must be > 0 (got 0)"),
        ({"heartbeat_ms": -5}, "heartbeat_ms must be > 0 (got -5)"),
        ({"buffer_timeout_ms": -1}, "buffer_timeout_ms must be >= 0 (got -1)"),
        ({"evict_after_ms": -1}, "evict_after_ms must be >= 0 or None (got -1)"),
        ({"evict_after_ms": "soon"}, "evict_after_ms must be a finite number"),
        ({"ordering": "fifo"}, "ordering 'fifo' is unknown; use one of ['none', 'liverobin'"),
        ({"batch_rows": 0}, "batch_rows must be an int >= 1, got 0"),
    ],
)
def test_bad_knobs_raise_config_error_naming_the_knob(knobs, message):
    with pytest.raises(td.ConfigError, match=r"Job 't'") as e:
        td.Job("t", **knobs)
    assert message in str(e.value)


@pytest.mark.parametrize("ordering", ["none", "liverobin", "kazoo"])
def test_orderings_accepted(ordering):
    assert td.Job("t", ordering=ordering, buffer_timeout_ms=0).ordering == ordering


def test_parallelism_below_one_is_rejected_for_every_kind():
    job = small_job()
    with pytest.raises(td.ConfigError, match=r"source 'source': parallelism must be an int >= 1"):
        job.source(src(), parallelism=0)
    s = job.source(src())
    with pytest.raises(
        td.ConfigError, match=r"operator 'm': parallelism must be an int >= 1, got 0"
    ):
        s.map(identity, parallelism=0, name="m")
    with pytest.raises(td.ConfigError, match=r"sink 'sink': parallelism must be an int >= 1"):
        s.sink(td.sinks.Collect(), parallelism=-1)


# -- columns and keys -------------------------------------------------------------------


def test_key_by_unknown_column_names_the_column_and_the_columns():
    s = small_job().source(src(), name="events")
    with pytest.raises(td.ConfigError) as e:
        s.key_by("user")
    msg = str(e.value)
    assert "key_by('user') after 'events'" in msg
    assert "unknown column 'user'" in msg
    assert "'key'" in msg and "'event_time_ns'" in msg


def test_key_by_unhashable_type():
    with pytest.raises(td.ConfigError, match=r"column type double cannot be hash-partitioned"):
        small_job().source(src()).key_by("value")


def test_process_without_key_by():
    s = small_job().source(src())
    with pytest.raises(
        td.ConfigError, match=r"process 'counts' \(CountPerKey\) has no key.*key_by"
    ):
        s.process(td.CountPerKey(), name="counts")


def test_process_needs_a_keyed_process_instance():
    s = small_job().source(src()).key_by("key")
    with pytest.raises(td.ConfigError, match=r"td.KeyedProcess subclass, got function"):
        s.process(identity)


def test_join_unknown_column_and_mismatched_key_types():
    job = small_job()
    ev = job.source(src(), name="ev")
    rules = job.source(
        td.sources.Synthetic(rate=10, keys=10, seed=2, extras={"threshold": "float64"}),
        name="rules",
    )
    with pytest.raises(td.ConfigError, match=r"join 'j' on 'user' \(event side 'ev'\): unknown "):
        ev.join(rules, on="user", name="j")
    as_str = rules.map(
        lambda b: b.set_column(2, "key", pc.cast(b["key"], pa.string())), name="stringify"
    )
    with pytest.raises(td.ConfigError) as e:
        ev.join(as_str, on="key", name="j")
    assert "key types differ — events have int64, rules have string" in str(e.value)
    assert "join 'j'" in str(e.value)


def test_join_rejects_self_join_and_column_clash():
    job = small_job()
    ev = job.source(src(), name="ev")
    with pytest.raises(td.ConfigError, match="cannot be joined with itself"):
        ev.join(ev, on="key")
    other = job.source(src(seed=5), name="other")
    with pytest.raises(td.ConfigError, match=r"rule columns \['value'\] also exist"):
        other.join(ev, on="key")


def test_window_validation():
    s = small_job().source(src(), name="ev")
    with pytest.raises(td.ConfigError, match=r"window 'window': key: unknown column 'nope'"):
        s.window(100, {"n": ("value", "count")}, key="nope")
    with pytest.raises(td.ConfigError, match=r"agg\['n'\] reads unknown column 'nope'"):
        s.window(100, {"n": ("nope", "count")}, key="key")
    with pytest.raises(td.ConfigError, match=r"unknown function 'median'"):
        s.window(100, {"n": ("value", "median")}, key="key")
    with pytest.raises(td.ConfigError, match=r"size_ms must be > 0, got 0"):
        s.window(0, {"n": ("value", "count")}, key="key")
    with pytest.raises(
        td.ConfigError,
        match=r"no key, so it is one global window and needs "
        r"parallelism 1 \(got 2\)",
    ):
        s.window(100, {"n": ("value", "count")}, parallelism=2)
    with pytest.raises(td.ConfigError, match=r"conflicts with the preceding key_by\('key'\)"):
        s.key_by("key").window(100, {"n": ("value", "count")}, key="source_seq")


# -- schemas ----------------------------------------------------------------------------


def test_map_dropping_event_time_is_rejected_naming_the_operator():
    s = small_job().source(src())
    with pytest.raises(td.ConfigError) as e:
        s.map(lambda b: b.drop_columns(["event_time_ns"]), name="strip")
    msg = str(e.value)
    assert "operator 'strip'" in msg and "drops the 'event_time_ns' column" in msg


def test_schema_inference_failure_asks_for_a_declared_schema():
    def needs_rows(batch):
        return batch.slice(0, 1).append_column("first", pa.array([batch["key"][0].as_py()]))

    s = small_job().source(src())
    with pytest.raises(td.ConfigError, match=r"operator 'f'.*failed on an empty batch.*schema="):
        s.map(needs_rows, name="f")
    declared = s.schema.append(pa.field("first", pa.int64()))
    out = s.map(needs_rows, name="f", schema=declared)
    assert out.schema == declared


def test_filter_must_return_a_boolean_mask():
    s = small_job().source(src())
    with pytest.raises(
        td.ConfigError,
        match=r"returned int64; a filter function must return a "
        r"boolean",
    ):
        s.filter(lambda b: b["key"], name="bad")


def test_union_schema_mismatch_and_duplicate():
    job = small_job()
    a = job.source(src(), name="a")
    b = job.source(src(payload_bytes=4), name="b")
    with pytest.raises(td.ConfigError, match=r"union\(\) of 'a' and 'b': schemas differ"):
        a.union(b)
    with pytest.raises(td.ConfigError, match=r"the output of 'a' appears twice"):
        a.union(a)


def test_runtime_wrong_schema_names_operator_and_partition():
    def sometimes_wrong(batch):
        if batch.num_rows == 0:
            return batch
        return batch.append_column("extra", pa.array([1] * batch.num_rows))

    job = small_job()
    job.source(src()).flat_map(sometimes_wrong, name="shifty").sink(td.sinks.Collect())
    with pytest.raises(td.ConfigError) as e:
        job.run_reference(duration=0.01)
    msg = str(e.value)
    assert "operator 'shifty' (task 1, partition 0) returned a batch with schema" in msg
    assert "extra: int64" in msg and "declared output schema" in msg


def test_user_exception_passes_through_with_a_note_naming_the_task():
    def boom(batch):
        if batch.num_rows:
            raise ValueError("bad row")
        return batch

    job = small_job()
    job.source(src()).map(boom, name="boom").sink(td.sinks.Collect())
    with pytest.raises(ValueError, match="bad row") as e:
        job.run_reference(duration=0.01)
    assert "in operator 'boom' (task 1, partition 0), replica 0" in e.value.__notes__


# -- graph ------------------------------------------------------------------------------


def test_stream_without_sink_names_it():
    job = small_job()
    s = job.source(src())
    s.map(identity, name="dangling")
    s.sink(td.sinks.Collect())
    with pytest.raises(
        td.ConfigError,
        match=r"operator 'dangling' goes nowhere: the stream has "
        r"no sink",
    ):
        job.plan()


def test_job_without_source():
    with pytest.raises(td.ConfigError, match="has no source"):
        small_job().plan()


def test_duplicate_names_and_default_names():
    job = small_job()
    s = job.source(src())
    a = s.map(identity)
    b = s.map(identity)
    assert [h.name for h in a._heads + b._heads] == ["map", "map_2"]
    with pytest.raises(td.ConfigError, match=r"duplicate task name 'map' in job 't'"):
        s.map(identity, name="map")


def test_cycle_detection():
    from tandem.api import _Node, _toposort

    schema = pa.schema([("event_time_ns", pa.int64())])
    a = _Node("a", "operator", 1, schema)
    b = _Node("b", "operator", 1, schema, inputs=[(a, 0, None)])
    a.inputs.append((b, 0, None))
    with pytest.raises(td.ConfigError, match=r"cycle through \['a', 'b'\]"):
        _toposort([a, b])


def test_streams_from_another_job_are_rejected():
    a = td.Job("a").source(src())
    b = td.Job("b").source(src())
    with pytest.raises(td.ConfigError, match="must belong to job 'a'"):
        a.union(b)


# -- the plan ---------------------------------------------------------------------------


def pipeline_plan() -> td.Plan:
    job = td.Job("p", replication=3, heartbeat_ms=5, batch_rows=8)
    ev = job.source(src(), parallelism=2, name="ev")
    rules = job.source(
        td.sources.Synthetic(rate=50, keys=10, seed=3, extras={"limit": "float64"}), name="rules"
    )
    m = ev.map(double_value, name="m")  # forward: 2 -> 2
    r = rules.map(drop_value, name="r")
    j = m.join(r, on="key", parallelism=3, name="j")  # hash on both sides
    j.sink(td.sinks.Collect(), name="out")  # rebalance 3 -> 1
    return job.plan()


def test_plan_tasks_edges_and_partitioners():
    plan = pipeline_plan()
    assert [(t.id, t.name, t.kind, t.parallelism, t.replication) for t in plan.tasks] == [
        (0, "ev", "source", 2, 3),
        (1, "rules", "source", 1, 3),
        (2, "m", "operator", 2, 3),
        (3, "r", "operator", 1, 3),
        (4, "j", "operator", 3, 3),
        (5, "out", "sink", 1, 3),  # a Collect sink: replicated as the job is
    ]
    assert plan.task("m").inputs == (td.plan.Edge(0, 0, "forward"),)
    assert plan.task("j").inputs == (
        td.plan.Edge(2, 0, "hash", "key"),
        td.plan.Edge(3, 1, "hash", "key"),
    )
    assert plan.task("out").inputs == (td.plan.Edge(4, 0, "rebalance"),)
    assert plan.task("j").input_schemas[1].names[-1] == "limit"
    assert plan.task("j").schema.names[-1] == "limit"
    assert plan.task("j").key == "key"


def test_plan_channels_are_ordered_by_input_index_task_partition():
    plan = pipeline_plan()
    C = td.plan.InputChannel
    assert plan.input_channels(2, 1) == [C(0, 1, 0)]  # forward: only partition 1
    assert plan.input_channels(4, 2) == [C(2, 0, 0), C(2, 1, 0), C(3, 0, 1)]
    assert plan.input_channels(5, 0) == [C(4, 0, 0), C(4, 1, 0), C(4, 2, 0)]
    Out = td.plan.OutputEdge
    assert plan.output_edges(0, 1) == [Out(2, 0, "forward", None, (1,))]
    assert plan.output_edges(2, 0) == [Out(4, 0, "hash", "key", (0, 1, 2))]
    assert plan.output_edges(3, 0) == [Out(4, 1, "hash", "key", (0, 1, 2))]
    assert plan.output_edges(5, 0) == []
    assert len(plan.replicas()) == 2 * 3 + 3 + 2 * 3 + 3 + 3 * 3 + 3
    with pytest.raises(td.ConfigError, match=r"partitions 0..1, got 2"):
        plan.input_channels(2, 2)
    with pytest.raises(td.ConfigError, match=r"no task 'nope'"):
        plan.task("nope")


def test_plan_is_picklable_and_round_trips():
    plan = pipeline_plan()
    again = pickle.loads(pickle.dumps(plan))
    assert [t.name for t in again.tasks] == [t.name for t in plan.tasks]
    assert again.input_channels(4, 0) == plan.input_channels(4, 0)
    assert again.task("j").schema == plan.task("j").schema


def test_check_picklable_takes_lambdas_and_names_the_task_that_cannot_be_sent():
    pipeline_plan().check_picklable()
    job = small_job()
    job.source(src()).map(lambda b: b, name="anon").sink(td.sinks.Collect())
    job.plan().check_picklable()  # cloudpickle ships a lambda by value
    with pytest.raises(td.ConfigError, match=r"operator task 'anon' cannot be sent to a worker"):
        job.plan().check_picklable(pickle.dumps)  # plain pickle cannot


def test_plan_describe_lists_tasks_and_edges():
    text = pipeline_plan().describe()
    assert "4: operator 'j' x3 partitions x3 replicas <- m[0]:hash(key), r[1]:hash(key)" in text
    assert "5: sink 'out' x1 partitions x3 replicas <- j[0]:rebalance" in text


def test_heartbeat_positions_follow_the_logical_clock():
    job = td.Job("hb", heartbeat_ms=10, buffer_timeout_ms=5, batch_rows=3)
    job.source(td.sources.Synthetic(rate=1000, keys=5, seed=1), parallelism=2).sink(
        td.sinks.Collect()
    )
    plan = job.plan()
    # rate 1000/s -> global row i released at i ms; partition p owns rows 2j+p.
    # Rows before heartbeat 1 (t=10 ms): global 0..9 -> 5 per partition.
    assert plan.source_rows_before(0, 0, plan.heartbeat_offset_ns(1)) == 5
    assert plan.source_rows_before(0, 1, plan.heartbeat_offset_ns(1)) == 5
    # Row 10 is released exactly at 10 ms: strictly before means it follows heartbeat 1.
    assert plan.source_rows_before(0, 0, 10_000_001) == 6
    assert plan.last_epoch(0.05) == 5
    assert plan.source_rows(0, 0, 0.05) == 25 and plan.source_rows(0, 1, 0.05) == 25
    assert plan.watermark_ns(3, t0_ns=1_000) == 30_001_000


def test_sources_cut_batches_at_windows_heartbeats_and_multiples_of_batch_rows():
    job = td.Job("hb", heartbeat_ms=10, buffer_timeout_ms=5, batch_rows=3)
    job.source(td.sources.Synthetic(rate=1000, keys=5, seed=1), parallelism=2).sink(
        td.sinks.Collect()
    )
    plan = job.plan()
    # Partition 1 releases local row j (global 2j+1) at 2j+1 ms. Windows of 5 ms; a batch
    # is due when its window closes; cuts also where j is a multiple of batch_rows = 3.
    steps = [
        (s.kind, s.j0, s.j1, s.epoch, s.at_ns // 1_000_000)
        for s in plan.source_schedule(0, 1, 0.03)
    ]
    assert steps == [
        ("rows", 0, 2, 0, 5),  # 1, 3 ms
        ("rows", 2, 3, 0, 10),  # 5 ms | cut at j = 3
        ("rows", 3, 5, 0, 10),  # 7, 9 ms
        ("heartbeat", 0, 0, 1, 10),
        ("rows", 5, 6, 0, 15),  # 11 ms | cut at j = 6
        ("rows", 6, 7, 0, 15),  # 13 ms
        ("rows", 7, 9, 0, 20),  # 15, 17 ms | cut at j = 9
        ("rows", 9, 10, 0, 20),  # 19 ms
        ("heartbeat", 0, 0, 2, 20),
        ("rows", 10, 12, 0, 25),
        ("rows", 12, 15, 0, 30),
        ("heartbeat", 0, 0, 3, 30),
        ("end", 0, 0, 0, 30),
    ]


@pytest.mark.parametrize("window_ms", [0, 0.3, 2, 7, 25])
@pytest.mark.parametrize("batch_rows", [1, 4, 1024])
def test_source_schedule_covers_every_row_once_in_order(window_ms, batch_rows):
    job = td.Job("s", heartbeat_ms=10, buffer_timeout_ms=window_ms, batch_rows=batch_rows)
    src = td.sources.Synthetic(rate=3_000, keys=5, seed=1)
    job.source(src, parallelism=3).sink(td.sinks.Collect())
    plan = job.plan()
    for p in range(3):
        steps = list(plan.source_schedule(0, p, 0.045))
        rows = [s for s in steps if s.kind == "rows"]
        assert [s.j0 for s in rows] == [0] + [s.j1 for s in rows[:-1]]
        assert rows[-1].j1 == plan.source_rows(0, p, 0.045)
        assert all(0 < s.j1 - s.j0 <= batch_rows for s in rows)
        assert [s.epoch for s in steps if s.kind == "heartbeat"] == [1, 2, 3, 4]
        assert [s.at_ns for s in steps] == sorted(s.at_ns for s in steps)
        window_ns = round(window_ms * 1e6)
        for s in rows:  # due after its last row's release, at most a window after its first
            first, last = src.offsets_ns(np.array([s.j0 * 3 + p, (s.j1 - 1) * 3 + p]))
            assert last < s.at_ns <= first + max(window_ns, 1)
        done = 0
        for s in steps:  # heartbeat k follows exactly the rows released before k * 10 ms
            if s.kind == "rows":
                done = s.j1
            elif s.kind == "heartbeat":
                assert done == plan.source_rows_before(0, p, s.at_ns)


def test_watermark_tracker_takes_the_minimum_and_ignores_ended_channels():
    w = WatermarkTracker(3)
    assert w.observe(0, 1) is None
    assert w.observe(1, 1) is None
    assert w.observe(2, 2) == 1
    assert w.observe(0, 2) is None
    assert w.end(1) == 2
    assert w.observe(0, 3) is None and w.observe(2, 4) == 3
    assert not w.all_ended()


# -- routing mirrors the Rust outbox ----------------------------------------------------


def test_xxh3_matches_xxhash_rust_vectors():
    # xxhash-rust 0.8.19 xxh3_64_with_seed(data, HASH_SEED) with data[i] = (31*i + 7) % 251,
    # one vector per length class (0, 1-3, 4-8, 9-16, 17-128, 129-240, long).
    golden = {
        0: 12218823120915544186,
        3: 3565325876381413840,
        8: 15777662474054500314,
        16: 6928720260845047009,
        97: 9399634905331492480,
        200: 8125823016188123154,
        241: 10196913739817952449,
        1025: 17219864054118037678,
    }
    for n, want in golden.items():
        data = bytes((31 * i + 7) % 251 for i in range(n))
        assert xxh3_64(data, HASH_SEED) == want, n
    assert xxh3_64(b"") == 0x2D06800538D394C2  # the reference XXH3 test vector


def test_hash_channels_match_the_rust_golden_vectors():
    # tandem-core outbox tests: GOLDEN_INT_4 and GOLDEN_STR_3.
    ints = [1, 1, 0, 0, 2, 2, 3, 3, 2, 0, 3, 3, 3, 3, 0, 0]
    assert hash_channels(pa.array(range(16), pa.int64()), 4).tolist() == ints
    assert hash_channels(pa.array(range(16), pa.int32()), 4).tolist() == ints
    strs = pa.array(["alice", "bob", None, "", "carol", "dave", "eve", "mallory"])
    assert hash_channels(strs, 3).tolist() == [1, 0, 0, 2, 0, 2, 1, 2]
    assert hash_channels(strs.cast(pa.large_string()), 3).tolist() == [1, 0, 0, 2, 0, 2, 1, 2]


def test_a_key_goes_to_the_partition_owning_its_key_group():
    keys = pa.array([*range(300), 2**63 + 5, 2**64 - 1], pa.uint64())
    signed = pa.array(list(range(-150, 150)), pa.int64())
    strs = pa.array([f"user-{i}" for i in range(300)])
    for groups in (1, 7, 128):
        for n in range(1, min(groups, 9) + 1):
            for array in (keys, signed, strs):
                chans = hash_channels(array, n, key_groups=groups)
                for value, c in zip(array.to_pylist(), chans.tolist(), strict=True):
                    g = td.plan.key_group(value, groups)
                    assert g in td.plan.key_group_range(c, n, groups)
                    assert td.plan.key_group_channel(g, groups, n) == c
            ranges = [td.plan.key_group_range(p, n, groups) for p in range(n)]
            assert [g for r in ranges for g in r] == list(range(groups))
    with pytest.raises(td.ConfigError, match=r"1\.5 \(float\) cannot be a key"):
        td.plan.key_group(1.5, 128)


def test_max_parallelism_bounds_a_keyed_tasks_parallelism():
    job = td.Job("bounded", max_parallelism=4)
    stream = job.source(td.sources.Synthetic(rate=10, keys=8, limit=10))
    stream.key_by("key").process(td.CountPerKey(), parallelism=5).sink(td.sinks.Collect())
    with pytest.raises(td.ConfigError, match=r"parallelism 5 is above the job's max_paral"):
        job.plan()
    with pytest.raises(td.ConfigError, match="max_parallelism"):
        td.Job("zero", max_parallelism=0)
    with pytest.raises(td.ConfigError, match="above 32768"):
        td.Job("huge", max_parallelism=1 << 16)


def test_router_rebalance_counts_rows_across_emits():
    r = Router(td.plan.OutputEdge(1, 0, "rebalance", None, (0, 1, 2)), batch_rows=1024)
    b = pa.record_batch({"x": [10, 11]})
    first = [(c, p["x"].to_pylist()) for c, p in r.route(b)]
    second = [(c, p["x"].to_pylist()) for c, p in r.route(b)]
    assert first == [(0, [10]), (1, [11])]
    assert second == [(0, [11]), (2, [10])]


# -- sources ----------------------------------------------------------------------------

SYNTHETIC_DIGEST = "572b6b969ba0573ac2bbd6b4e24848bb684745109b3dd22481d728319e3de560"

DIGEST_SCRIPT = """
import hashlib
import tandem as td
s = td.sources.Synthetic(rate=10_000, keys=1000, seed=7, payload_bytes=12,
                         extras={"x": "int64", "y": "float64"})
h = hashlib.sha256()
for p in range(3):
    b = s.read(p, 3, 0, 500, t0_ns=1_000_000_000)
    for name in b.schema.names:
        col = b.column(name)
        if name == "payload":
            h.update(b"".join(col.to_pylist()))
        else:
            h.update(col.to_numpy().tobytes())
print(h.hexdigest())
"""


@pytest.mark.parametrize("hash_seed", ["0", "12345"])
def test_synthetic_source_matches_golden_digest_in_fresh_processes(hash_seed):
    out = subprocess.run(
        [sys.executable, "-c", DIGEST_SCRIPT],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": hash_seed, "PATH": ""},
    )
    assert out.stdout.strip() == SYNTHETIC_DIGEST


def test_synthetic_rows_release_times_and_partition_split():
    s = td.sources.Synthetic(rate=4000, keys=7, seed=9)
    b = s.read(1, 2, 0, 4, t0_ns=100)
    assert b["source_seq"].to_pylist() == [1, 3, 5, 7]
    assert b["event_time_ns"].to_pylist() == [100 + 250_000 * i for i in (1, 3, 5, 7)]
    assert all(0 <= k < 7 for k in b["key"].to_pylist())
    # Reading a sub-range gives the same rows: contents depend only on the row index.
    whole = s.read(0, 1, 0, 100, 0)
    part = s.read(0, 1, 40, 60, 0)
    assert part.equals(whole.slice(40, 20))
    # Fractional rates: 1.5 rows/s -> row i at floor(i / 1.5 s).
    slow = td.sources.Synthetic(rate=1.5, keys=3, seed=1)
    assert slow.offsets_ns(np.arange(4)).tolist() == [0, 666_666_666, 1_333_333_333, 2 * 10**9]
    assert slow.total_rows(2 * 10**9) == 3


def test_synthetic_skew_makes_low_keys_hot():
    b = td.sources.Synthetic(rate=1000, keys=100, seed=3, skew=1.0).read(0, 1, 0, 5000, 0)
    counts = np.bincount(b["key"].to_numpy(), minlength=100)
    assert counts[0] > 5 * counts[50:].mean()
    uniform = td.sources.Synthetic(rate=1000, keys=100, seed=3).read(0, 1, 0, 5000, 0)
    assert np.bincount(uniform["key"].to_numpy()).max() < 100


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rate": 0}, "rate must be > 0"),
        ({"rate": "fast"}, "rate must be a number"),
        ({"rate": 10, "keys": 0}, "keys must be an int >= 1"),
        ({"rate": 10, "skew": -1}, "skew must be a float >= 0"),
        ({"rate": 10, "extras": {"key": "int64"}}, "clashes with a built-in column"),
        ({"rate": 10, "extras": {"z": "string"}}, "use 'int64' or 'float64'"),
    ],
)
def test_synthetic_rejects_bad_parameters(kwargs, message):
    with pytest.raises(td.ConfigError, match=message):
        td.sources.Synthetic(**kwargs)


def test_file_sources_replay_rows_with_event_times(tmp_path):
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    table = pa.table({"user": ["a", "b", "c", "d", "e"], "amount": [1, 2, 3, 4, 5]})
    pq.write_table(table, tmp_path / "in.parquet")
    pacsv.write_csv(table, tmp_path / "in.csv")
    for source in (
        td.sources.Parquet(tmp_path / "in.parquet", rate=1000),
        td.sources.Csv(tmp_path / "in.csv", rate=1000),
    ):
        b = source.read(1, 2, 0, 2, t0_ns=7)
        assert b.schema.names == ["source_seq", "event_time_ns", "user", "amount"]
        assert b["user"].to_pylist() == ["b", "d"]
        assert b["event_time_ns"].to_pylist() == [1_000_007, 3_000_007]
        assert source.total_rows(2_500_000) == 3
        clone = pickle.loads(pickle.dumps(source))
        assert clone._table is None and clone.read(1, 2, 0, 2, 7).equals(b)
    fast = td.sources.Csv(tmp_path / "in.csv")
    assert (
        fast.total_rows(1) == 5 and fast.read(0, 1, 0, 5, 9)["event_time_ns"].to_pylist() == [9] * 5
    )
    with pytest.raises(td.ConfigError, match="no such file or directory"):
        td.sources.Parquet(tmp_path / "missing.parquet")
    pq.write_table(pa.table({"event_time_ns": [1]}), tmp_path / "bad.parquet")
    with pytest.raises(td.ConfigError, match="already has a column 'event_time_ns'"):
        td.sources.Parquet(tmp_path / "bad.parquet")


# -- sinks ------------------------------------------------------------------------------


def test_file_sinks_write_every_partition(tmp_path):
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    job = td.Job("files", batch_rows=16)
    s = job.source(src(rate=2000), parallelism=2)
    s.sink(td.sinks.Parquet(tmp_path / "pq"), parallelism=2, name="pq")
    s.sink(td.sinks.Csv(tmp_path / "out.csv"), name="csv")
    s.sink(td.sinks.Collect(), name="mem")
    result = job.run_reference(duration=0.05)
    assert result.events_in == 100 and result.events_out == 300
    files = result.outputs["pq"]
    assert [f.rsplit("/", 1)[-1] for f in files] == ["part-00000.parquet", "part-00001.parquet"]
    parquet_rows = pa.concat_tables([pq.read_table(f) for f in files])
    assert sorted(parquet_rows["source_seq"].to_pylist()) == list(range(100))
    csv_rows = pacsv.read_csv(tmp_path / "out.csv")
    assert sorted(csv_rows["source_seq"].to_pylist()) == list(range(100))
    assert result.output.num_rows == 100


def _file_sink_job(tmp_path) -> td.Job:
    job = td.Job("files", batch_rows=16)
    s = job.source(src(rate=2000, extras={"x": "float64"}), parallelism=2)
    s.sink(td.sinks.Parquet(tmp_path / "pq"), parallelism=2, name="pq")
    s.sink(td.sinks.Csv(tmp_path / "out.csv"), name="csv")
    return job


@pytest.mark.parametrize("kind", [td.sinks.Parquet, td.sinks.Csv])
def test_file_sinks_read_back_what_they_wrote(tmp_path, kind):
    schema = src(extras={"x": "float64"}).schema()
    schema = schema.append(pa.field("s", pa.string())).append(pa.field("t", pa.timestamp("us")))
    rows = pa.Table.from_batches([src(extras={"x": "float64"}).read(0, 1, 0, 5, 7)])
    rows = rows.append_column("s", pa.array(['a,"b', "", None, "é", "x"]))
    rows = rows.append_column("t", pa.array([0, 1, None, 3, 4], pa.timestamp("us")))
    sink = kind(tmp_path / ("out.csv" if kind is td.sinks.Csv else "pq"))
    sink.open(0, 1, schema)
    sink.write(rows.to_batches()[0])
    back = sink.rows(sink.combine([sink.close()], schema), schema)
    assert back.equals(rows)


def test_multiset_diff_counts_rows_with_nulls_and_repeats():
    from tandem.engines.common import multiset_diff

    want = pa.table({"k": [1, None, None, 2, 3], "s": ["a", "b", "b", None, "c"]})
    assert multiset_diff(want, want) == (0, 0)
    assert multiset_diff(want, want.select(["s", "k"]).take([4, 3, 2, 1, 0])) == (0, 0)
    # One (None, "b") lost, (1, "a") repeated, (9, "z") never in want.
    got = pa.table({"k": [1, 1, None, 2, 3, 9], "s": ["a", "a", "b", None, "c", "z"]})
    assert multiset_diff(want, got) == (1, 2)
    assert multiset_diff(want, want.slice(0, 0)) == (5, 0)
    assert multiset_diff(want.slice(0, 0), want) == (0, 5)


def test_multiset_diff_and_canonical_compare_nested_values():
    """Lists, structs, maps and dictionaries are compared by value: a lost row and a
    repeated one differing only in a nested value do not cancel out."""
    from tandem.engines.common import multiset_diff

    want = pa.table(
        {
            "k": [1, 1, 2, None],
            "l": pa.array([[1, 2], [2, 1], None, []], pa.list_(pa.int64())),
            "s": pa.array([{"x": 1, "y": "a"}, None, {"x": None, "y": "b"}, {"x": 1, "y": "a"}]),
            "m": pa.array([[("a", 1)], [], None, [("a", 1)]], pa.map_(pa.string(), pa.int64())),
            "d": pa.array(["p", "q", "p", None]).dictionary_encode(),
        }
    )
    shuffled = want.take([3, 1, 0, 2])
    assert multiset_diff(want, shuffled) == (0, 0)
    assert canonical(shuffled).equals(canonical(want))
    # Row 0's list [1, 2] lost, row 1's [2, 1] repeated: same counts, not the same rows.
    got = want.take([1, 1, 2, 3])
    assert multiset_diff(want, got) == (1, 1)
    assert not canonical(got).equals(canonical(want))
    nested = pa.table({"l": pa.array([[[1], []], [[1]], [[1], []]], pa.list_(pa.list_(pa.int8())))})
    assert multiset_diff(nested, nested.take([2, 1, 0])) == (0, 0)
    assert multiset_diff(nested, nested.take([1, 1, 0])) == (1, 1)


def test_reference_check_compares_file_sink_rows_not_counts(tmp_path):
    """One row lost and another duplicated leave every row count right: only the rows of
    the files, read back and compared as a multiset with the reference's, show it."""
    from tandem import reference
    from tandem.engines.common import assemble_result
    from tandem.runtime import ReplicaReport

    plan = _file_sink_job(tmp_path).plan()
    ref = reference.run(plan, 0.05, in_memory=True)

    def write(mangle) -> dict:
        reports = {}
        for task in plan.sinks():
            rows = mangle(ref.outputs[task.name])
            for p in range(task.parallelism):
                sink = plan.open_sink(task.id, p)
                part = rows if p == 0 else rows.slice(0, 0)  # all rows in partition 0
                for batch in part.to_batches():
                    sink.write(batch)
                reports[(task.id, p, 0)] = ReplicaReport(
                    task.id, p, 0, "sink", rows_in=part.num_rows, sink_part=sink.close(), ended=True
                )
        return reports

    def check(reports) -> td.Result:
        return assemble_result(plan, 0.05, reports, t0_ns=0, warmup=0.0, check=True, faults=[])

    intact = check(write(lambda t: t))
    assert (intact.lost, intact.duplicates) == (0, 0)
    assert intact.events_out == ref.events_out == 200
    # Row 3 lost and row 7 written twice, in both sinks.
    swapped = check(write(lambda t: pa.concat_tables([t.slice(0, 3), t.slice(4), t.slice(7, 1)])))
    assert swapped.events_out == ref.events_out
    assert (swapped.lost, swapped.duplicates) == (2, 2)
    # Files that cannot be read back: not measured, rather than a reassuring zero.
    reports = write(lambda t: t)
    with open(reports[(plan.task("pq").id, 0, 0)].sink_part["staged"], "wb") as f:
        f.write(b"not parquet")
    gone = check(reports)
    assert gone.lost is None and gone.duplicates is None
    # A staged file gone before the commit: said, not published half.
    reports = write(lambda t: t)
    os.remove(reports[(plan.task("pq").id, 0, 0)].sink_part["staged"])
    with pytest.raises(td.TandemError, match=r"staged file .* is missing"):
        check(reports)


def test_latency_sink_records_receive_time():
    sink = td.sinks.Latency(clock=lambda: 3_000_000)
    sink.open(0, 1, src().schema())
    sink.write(src().read(0, 1, 0, 3, t0_ns=1_000))
    table = sink.combine([sink.close()])
    assert table["receive_ns"].to_pylist() == [3_000_000] * 3
    # rate 1000/s: rows at t0 + 0, 1, 2 ms.
    assert pc.subtract(table["receive_ns"], table["event_time_ns"]).to_pylist() == [
        2_999_000,
        1_999_000,
        999_000,
    ]
    with pytest.raises(td.ConfigError, match="no 'event_time_ns' column"):
        td.sinks.Latency().open(0, 1, pa.schema([("x", pa.int64())]))


# -- faults and running -----------------------------------------------------------------


def fault_plan_job(sink_replication: int | None = 1) -> td.Job:
    job = td.Job("f", replication=2)
    job.source(src(), name="ev").key_by("key").process(td.CountPerKey(), parallelism=2).sink(
        td.sinks.Collect(), name="out", replication=sink_replication
    )
    return job


class RecordingEngine:
    name = "recording"  # tandem.engines.Engine: a name and run()

    def __init__(self):
        self.calls = []

    def run(self, plan, **kw):
        self.calls.append((plan, kw))
        return td.Result(events_in=1)


def test_run_dispatches_to_an_engine_object_with_validated_faults():
    engine = RecordingEngine()
    kill = td.Kill("process", partition=1, replica=1, at=0.5)
    result = fault_plan_job().run(duration=1, faults=[kill], engine=engine, extra=3)
    assert result.events_in == 1
    plan, kw = engine.calls[0]
    assert isinstance(plan, td.Plan) and kw == {"duration": 1, "faults": [kill], "extra": 3}


@pytest.mark.parametrize(
    ("kill", "message"),
    [
        (td.Kill("nope", 0, 0, 0.1), r"no task 'nope'; its tasks are \['ev', 'process', 'out'\]"),
        (td.Kill("process", 2, 0, 0.1), r"task 'process' has partitions 0..1"),
        (td.Kill("process", 0, 2, 0.1), r"task 'process' has replicas 0..1"),
        (td.Kill("out", 0, 0, 0.1), r"'out' is an unreplicated sink, so killing it loses"),
        (td.Kill("ev", 0, "leader", 0.1), r"roles exist only with ordering='kazoo'"),
        (td.Kill("ev", 0, 0, 5), r"at=5 s is not before the end of the run"),
    ],
)
def test_faults_are_validated_against_the_plan(kill, message):
    with pytest.raises(td.ConfigError, match=message):
        fault_plan_job().run(duration=1, faults=[kill], engine=RecordingEngine())


def test_sinks_are_replicated_as_the_job_unless_they_cannot_be():
    """A replicable sink runs the job's replication (or its own); a sink with an effect
    outside as it writes runs once, and asking for more is refused, saying why. A replica
    of a replicated sink may be killed; an unreplicated sink may not."""
    plan = fault_plan_job(None).plan()
    assert plan.task("out").replication == 2
    # Replica r of every replicated sink on sink worker r, after the replica groups.
    *_, w0, w1 = plan.placement()
    assert (w0, w1) == ([(plan.task("out").id, 0, 0)], [(plan.task("out").id, 0, 1)])
    kill = td.Kill("out", partition=0, replica=1, at=0.5)
    fault_plan_job(None).run(duration=1, faults=[kill], engine=RecordingEngine())
    assert fault_plan_job(1).plan().task("out").replication == 1
    job = td.Job("k", replication=2)
    stream = job.source(src(), name="ev")
    # A Kafka sink is replicated too: one replica writes, its twins stand by to take over.
    stream.sink(td.sinks.Kafka("t", bootstrap="127.0.0.1:1"), name="kafka")
    stream.sink(td.sinks.Kafka("t", bootstrap="127.0.0.1:1"), name="k1", replication=1)
    assert job.plan().task("kafka").replication == 2
    assert job.plan().task("k1").replication == 1

    class Outside(td.sinks.Sink):  # writes somewhere as it goes, with no owner protocol
        def write(self, batch) -> None:
            pass

    stream.sink(Outside(), name="outside")
    assert job.plan().task("outside").replication == 1
    with pytest.raises(td.ConfigError, match=r"cannot run replicated \(replication=2\)"):
        stream.sink(Outside(), name="o2", replication=2)
    with pytest.raises(td.ConfigError, match=r"replication must be"):
        stream.sink(td.sinks.Collect(), name="c", replication=0)


def bounded_job() -> td.Job:
    """Every source bounded: 500 rows at 1,000 rows/s, so a run with no duration ends
    about 0.5 s in."""
    job = td.Job("bounded", replication=2)
    rows = job.source(td.sources.Synthetic(rate=1_000, keys=10, limit=500), name="ev")
    rows.key_by("key").process(td.CountPerKey(), name="count").sink(td.sinks.Collect())
    return job


@pytest.mark.parametrize(
    "fault",
    [
        td.Kill("count", partition=0, replica=1, at=1.5),
        td.Pause("count", 0, 1, at=0.5),
        td.KillWorker(0, at=2),
        td.Chaos(at=2.0),
    ],
)
def test_a_fault_after_the_bounded_sources_end_is_refused_before_anything_starts(fault):
    """With no duration the run ends after the bounded sources' last row: a fault at or
    after it would never fire, and a fault-tolerance test would pass without it."""
    job = td.Job("bounded", replication=2, restore=isinstance(fault, td.Chaos))
    rows = job.source(td.sources.Synthetic(rate=1_000, keys=10, limit=500), name="ev")
    rows.key_by("key").process(td.CountPerKey(), name="count").sink(td.sinks.Collect())
    message = r"is not before the end of the run: with no duration, job 'bounded' ends .* 0.5 s"
    with pytest.raises(td.ConfigError, match=message):
        job.run(faults=[fault])
    with pytest.raises(td.ConfigError, match=message):
        job.start(faults=[fault])
    # an engine that runs for a fixed time gets the sources' end as its duration
    with pytest.raises(td.ConfigError, match=message):
        job.run(faults=[fault], engine=RecordingEngine())


def test_a_fault_before_the_bounded_sources_end_passes():
    engine = RecordingEngine()
    kill = td.Kill("count", partition=0, replica=1, at=0.25)
    bounded_job().run(faults=[kill], engine=engine)
    _, kw = engine.calls[0]
    assert kw["faults"] == [kill] and kw["duration"] == pytest.approx(0.5, abs=0.011)


def test_an_option_the_engine_does_not_take_is_a_config_error():
    with pytest.raises(td.ConfigError, match=r"'progres': not an option of the local engine"):
        bounded_job().run(progres=False)
    with pytest.raises(td.ConfigError, match=r"it takes duration, faults, engine and progress"):
        bounded_job().start(warmpu=1)


def test_kill_spec_validation_and_duplicates():
    with pytest.raises(td.ConfigError, match="replica must be an index or one of"):
        td.Kill("a", 0, "primary", 1)
    with pytest.raises(td.ConfigError, match="at must be seconds >= 0"):
        td.Kill("a", 0, 0, -1)
    k = td.Kill("ev", 0, 0, 0.2)
    with pytest.raises(td.ConfigError, match="killed twice"):
        fault_plan_job().run(duration=1, faults=[k, k], engine=RecordingEngine())
    assert k.to_dict() == {"kind": "kill", "task": "ev", "partition": 0, "replica": 0, "at": 0.2}


def test_engines_are_looked_up_by_name(monkeypatch):
    """A name goes to tandem.engines.get; an unknown one is refused naming the engines."""
    from tandem import engines

    calls = []

    def get(name, **options):
        calls.append((name, options))
        return RecordingEngine()

    with pytest.raises(td.ConfigError, match=r"unknown engine 'nope'.*\['local', 'spark'\]"):
        fault_plan_job().run(duration=1, engine="nope")
    monkeypatch.setattr(engines, "get", get)
    assert fault_plan_job().run(duration=1, engine="local").events_in == 1
    assert calls == [("local", {})]


def test_run_rejects_bad_duration_and_engine():
    with pytest.raises(td.ConfigError, match="duration must be > 0 seconds, got 0"):
        fault_plan_job().run(duration=0, engine=RecordingEngine())
    with pytest.raises(td.ConfigError, match=r"an engine object \(a name and a run\(\) method"):
        fault_plan_job().run(duration=1, engine=42)


def test_result_json_has_exactly_the_documented_fields():
    r = td.Result(
        events_in=3,
        events_out=3,
        output=pa.table({"a": [1, 2, 3]}),
        faults=[td.Kill("m", 0, 0, 1.0)],
        lost_replicas=[{"task": "m"}],
    )
    data = json.loads(r.to_json())
    assert list(data) == list(td.result.JSON_FIELDS)
    assert set(td.result.JSON_FIELDS) == {
        "duration_s",
        "events_in",
        "events_out",
        "lost",
        "duplicates",
        "p50_ms",
        "p99_ms",
        "max_ms",
        "max_gap_ms",
        "per_second_p99_ms",
        "faults",
        "digests_match",
        "lost_replicas",
        "restored_replicas",
        "checkpoints",
        "leaders",
        "output",
        "t0_ns",
        "first_output_unix_ns",
        "rescales",
    }
    assert data["output"] == {"rows": 3, "columns": ["a"]}
    assert data["faults"][0]["task"] == "m"
