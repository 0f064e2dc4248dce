"""Operator semantics (batch invariance) and the single-process reference executor."""

from __future__ import annotations

import copy
from collections import deque

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tandem as td
from tandem.operators import WATERMARK_MAX, OperatorContext
from tandem.reference import canonical, live_robin

# -- batch invariance -------------------------------------------------------------------
#
# An input is a list of segments: ("rows", input_index, batch) or ("wm", wm_ns). The
# positions of watermarks and the interleaving of inputs are part of the input; only the
# batch boundaries inside a "rows" segment are cut at random. Every operator must produce
# the same output rows however they are cut.


def run_segments(op, segments, cuts, key="key"):
    op = copy.deepcopy(op)
    op.open(OperatorContext("t", 0, 0, 1, key=key, t0_ns=0))
    outs = []
    cut = iter(cuts)
    for seg in segments:
        if seg[0] == "wm":
            outs.append(op.on_watermark(seg[1]))
            continue
        _, idx, batch = seg
        start = 0
        while start < batch.num_rows:
            n = max(1, next(cut, batch.num_rows))
            outs.append(op.on_batch(batch.slice(start, n), idx))
            start += n
    outs.append(op.on_watermark(WATERMARK_MAX))
    outs = [o for o in outs if o is not None and o.num_rows]
    return pa.Table.from_batches(outs).combine_chunks() if outs else None


def events(n, keys, seed, t_step=1_000_000):
    rng = np.random.default_rng(seed)
    return pa.record_batch(
        {
            "source_seq": pa.array(np.arange(n), pa.int64()),
            "event_time_ns": pa.array(np.arange(n) * t_step, pa.int64()),
            "key": pa.array(rng.integers(0, keys, n), pa.int64()),
            "value": pa.array(rng.integers(-50, 50, n).astype(np.float64) / 8),
        }
    )


cut_lists = st.lists(st.integers(min_value=1, max_value=9), min_size=0, max_size=60)
seeds = st.integers(min_value=0, max_value=2**32 - 1)


def plus_one(batch):
    return batch.append_column("v1", pc.add(batch["value"], 1.0))


def positive(batch):
    return pc.greater(batch["value"], 0)


def explode(batch):
    # Each row k times, k = key % 3 (0 rows for some): a row-wise flat map.
    reps = pc.remainder(batch["key"], 3).to_numpy()
    return batch.take(pa.array(np.repeat(np.arange(batch.num_rows), reps)))


@settings(max_examples=40, deadline=None)
@given(seed=seeds, a=cut_lists, b=cut_lists, n=st.integers(min_value=0, max_value=80))
@pytest.mark.parametrize(
    "op",
    [
        td.operators.Map(plus_one),
        td.operators.Filter(positive),
        td.operators.FlatMap(explode),
        td.CountPerKey(),
    ],
    ids=["map", "filter", "flat_map", "process"],
)
def test_single_input_operators_are_batch_invariant(op, seed, a, b, n):
    segs = [("rows", 0, events(n, 5, seed))]
    one = run_segments(op, segs, a)
    two = run_segments(op, segs, b)
    whole = run_segments(op, segs, [])
    assert (one is None and two is None and whole is None) or (
        one.equals(two) and one.equals(whole)
    )


@settings(max_examples=40, deadline=None)
@given(
    seed=seeds,
    a=cut_lists,
    b=cut_lists,
    pattern=st.lists(st.tuples(st.sampled_from([0, 1]), st.integers(1, 12)), max_size=10),
    how=st.sampled_from(["inner", "left"]),
)
def test_join_is_batch_invariant(seed, a, b, pattern, how):
    ev = events(sum(n for i, n in pattern if i == 0), 4, seed)
    rng = np.random.default_rng(seed + 1)
    n_rules = sum(n for i, n in pattern if i == 1)
    rules = pa.record_batch(
        {
            "key": pa.array(rng.integers(0, 4, n_rules), pa.int64()),
            "limit": pa.array(rng.integers(0, 100, n_rules), pa.int64()),
            "tag": pa.array([f"r{i}" for i in range(n_rules)]),
        }
    )
    segs, pos = [], [0, 0]
    for idx, n in pattern:
        src = ev if idx == 0 else rules
        segs.append(("rows", idx, src.slice(pos[idx], n)))
        pos[idx] += n
    op = td.operators.Join("key", how)
    op.output_schema([ev.schema, rules.schema])
    one, two = run_segments(op, segs, a), run_segments(op, segs, b)
    assert (one is None and two is None) or one.equals(two)


@settings(max_examples=40, deadline=None)
@given(seed=seeds, a=cut_lists, b=cut_lists, n=st.integers(0, 80), wm_every=st.integers(1, 30))
def test_window_is_batch_invariant(seed, a, b, n, wm_every):
    ev = events(n, 3, seed, t_step=1_000_000)
    segs = []
    for start in range(0, n, wm_every):
        segs.append(("rows", 0, ev.slice(start, wm_every)))
        # Watermark: every row so far has event_time < (last + 1 ms).
        segs.append(("wm", min(n, start + wm_every) * 1_000_000))
    agg = {
        "total": ("value", "sum"),
        "n": ("value", "count"),
        "lo": ("value", "min"),
        "hi": ("value", "max"),
        "avg": ("value", "mean"),
    }
    op = td.operators.Window(7, agg, "key")
    op.output_schema([ev.schema])
    one, two = run_segments(op, segs, a), run_segments(op, segs, b)
    assert (one is None and two is None) or one.equals(two)
    if one is not None:
        assert sum(one["n"].to_pylist()) == n


def test_count_per_key_counts_in_input_order():
    op = td.CountPerKey()
    op.open(OperatorContext("t", 0, 0, 1, key="k"))
    b = pa.record_batch({"k": pa.array([1, 2, 1, None, 1], pa.int64())})
    out = op.on_batch(b)
    assert out["count"].to_pylist() == [1, 1, 2, None, 3]
    assert op.on_batch(b.slice(0, 2))["count"].to_pylist() == [4, 2]
    fresh = td.CountPerKey()
    fresh.open(op.ctx)
    fresh.restore(op.snapshot())
    assert fresh.on_batch(b.slice(1, 1))["count"].to_pylist() == [3]


@settings(max_examples=60, deadline=None)
@given(
    keys=st.lists(
        st.one_of(st.none(), st.integers(0, 5), st.sampled_from(["a", "b"])), max_size=40
    ),
    cut=st.integers(0, 40),
)
def test_count_per_key_small_batch_loop_agrees_with_the_vectorised_path(keys, cut):
    """CountPerKey counts small batches in a loop and large ones with numpy: both paths
    must give the same counts and leave the same state, whatever the batch split."""
    ints = [k for k in keys if not isinstance(k, str)]
    strs = [k for k in keys if not isinstance(k, int)]
    for col, typ in ((ints, pa.int64()), (strs, pa.string())):
        b = pa.record_batch({"k": pa.array(col, typ)})
        runs = []
        for loop_rows in (-1, 1 << 20):  # -1: always vectorised; huge: always the loop
            saved, td.operators._LOOP_ROWS = td.operators._LOOP_ROWS, loop_rows
            try:
                op = td.CountPerKey()
                op.open(OperatorContext("t", 0, 0, 1, key="k"))
                at = min(cut, len(b))
                outs = [op.on_batch(b.slice(0, at)), op.on_batch(b.slice(at))]
            finally:
                td.operators._LOOP_ROWS = saved
            runs.append(([o["count"].to_pylist() for o in outs], list(op.state.items())))
        assert runs[0] == runs[1]


def test_join_snapshot_restore_and_left_fill():
    op = td.operators.Join("key", "left")
    ev = pa.record_batch({"key": pa.array([1, 2], pa.int64()), "event_time_ns": [0, 1]})
    rules = pa.record_batch({"key": pa.array([1], pa.int64()), "limit": [9]})
    op.output_schema([ev.schema, rules.schema])
    assert op.on_batch(rules, 1) is None
    clone = copy.deepcopy(op)
    clone.restore(op.snapshot())
    for o in (op, clone):
        assert o.on_batch(ev, 0).to_pydict() == {
            "key": [1, 2],
            "event_time_ns": [0, 1],
            "limit": [9, None],
        }


def test_window_drops_late_rows_and_counts_them():
    op = td.operators.Window(10, {"n": ("value", "count")}, None)
    ev = events(5, 1, 0)
    op.output_schema([ev.schema])
    op.open(OperatorContext("w", 0, 0, 1))
    op.on_batch(ev)
    out = op.on_watermark(10_000_000)
    assert out.to_pydict() == {
        "window_start_ns": [0],
        "window_end_ns": [10_000_000],
        "event_time_ns": [9_999_999],
        "n": [5],
    }
    op.on_batch(ev.slice(0, 2))  # window 0 is closed: both rows are late
    assert op.late_rows == 2 and op.on_watermark(WATERMARK_MAX) is None
    restored = td.operators.Window(10, {"n": ("value", "count")}, None)
    restored.restore(op.snapshot())
    assert restored.late_rows == 2 and restored.closed_before == op.closed_before


# -- LiveRobin, one whole batch per turn ------------------------------------------------


def rows(*seqs):
    return ("data", pa.record_batch({"s": pa.array(list(seqs), pa.int64())}))


def turns(deliveries):
    """Deliveries with their batch boundaries: a data turn is (channel, [rows])."""
    out = []
    for d in deliveries:
        if d[0] == "data":
            out.append((d[1], d[2]["s"].to_pylist()))
        else:
            out.append(tuple(d))
    return out


def test_liverobin_takes_whole_batches_and_cycles_by_hand():
    q0 = deque([rows(0, 1, 2), rows(3), ("heartbeat", 1), rows(4), ("heartbeat", 2), ("end",)])
    q1 = deque([rows(10), ("heartbeat", 1), rows(11, 12, 13), ("heartbeat", 2), ("end",)])
    assert turns(live_robin([q0, q1])) == [
        (0, [0, 1, 2]),  # a whole batch is one turn, however many rows it has
        (1, [10]),
        (0, [3]),
        ("heartbeat", 1, 1, True),  # channel 1 leaves cycle 1
        ("heartbeat", 0, 1, False),  # channel 1 left the cycle: channel 0 alone
        (1, [11, 12, 13]),  # cycle 2 continues after channel 0, i.e. with channel 1
        (0, [4]),
        ("heartbeat", 1, 2, True),
        ("heartbeat", 0, 2, False),
        ("end",),
    ]


def test_liverobin_skips_empty_batches_and_ends_once_all_channels_ended():
    empty = ("data", pa.record_batch({"s": pa.array([], pa.int64())}))
    q0 = deque([empty, rows(0), ("end",)])
    q1 = deque([rows(0), ("heartbeat", 1), rows(2), ("heartbeat", 2), ("end",)])
    assert turns(live_robin([q0, q1])) == [
        (0, [0]),
        (1, [0]),
        ("heartbeat", 1, 1, True),
        (1, [2]),
        ("heartbeat", 1, 2, True),
        ("end",),
    ]


def test_liverobin_single_channel_passes_through():
    q = deque([rows(0, 1, 2, 3), ("heartbeat", 1), ("end",)])
    got = list(live_robin([q]))
    assert [d[0] for d in got] == ["data", "heartbeat", "end"]
    assert got[0][2].num_rows == 4


# -- the reference executor end to end --------------------------------------------------


def csv_source(tmp_path, name, table, rate=None):
    path = tmp_path / f"{name}.csv"
    pacsv.write_csv(table, path)
    return td.sources.Csv(path, rate=rate)


def identity(batch):
    return batch


def test_union_interleaves_in_liverobin_order(tmp_path):
    job = td.Job("u", heartbeat_ms=10, batch_rows=3)
    a = job.source(td.sources.Synthetic(rate=1000, keys=5, seed=1), name="a")
    b = job.source(td.sources.Synthetic(rate=500, keys=5, seed=2), name="b")
    a.union(b).map(identity, name="merge").sink(td.sinks.Collect())
    r = job.run_reference(duration=0.02)
    # Batches (5 ms windows, cut where the row index is a multiple of 3):
    #   a (1 ms apart): [0 1 2] [3 4] | [5] [6 7 8] [9] hb1 [10 11] [12 13 14] | [15 16 17]
    #                   [18 19] hb2
    #   b (2 ms apart): [0 1 2] | [3 4] hb1 [5] [6 7] | [8] [9] hb2
    # One whole batch per turn; a channel leaves the cycle at its heartbeat; cycle 2
    # starts after the channel that closed cycle 1 (a), i.e. with b.
    cycle1 = [0, 1, 2, 0, 1, 2, 3, 4, 3, 4, 5, 6, 7, 8, 9]
    cycle2 = [5, 10, 11, 6, 7, 12, 13, 14, 8, 15, 16, 17, 9, 18, 19]
    assert r.output["source_seq"].to_pylist() == cycle1 + cycle2
    assert r.events_in == r.events_out == 30


def test_join_enriches_events_with_the_latest_rule(tmp_path):
    ev = pa.table({"user": ["a", "b", "a", "c", "a"], "amount": [1, 2, 3, 4, 5]})
    rules = pa.table({"user": ["a", "b", "a"], "limit": [10, 20, 30]})
    for how, expected in [
        ("inner", {"user": ["b", "a", "a"], "amount": [2, 3, 5], "limit": [20, 30, 30]}),
        (
            "left",
            {
                "user": ["a", "b", "a", "c", "a"],
                "amount": [1, 2, 3, 4, 5],
                "limit": [None, 20, 30, None, 30],
            },
        ),
    ]:
        job = td.Job("j", heartbeat_ms=10)
        e = job.source(csv_source(tmp_path, "ev", ev, rate=100), name="events")
        r = job.source(csv_source(tmp_path, "rules", rules), name="rules")
        e.join(r, on="user", how=how, parallelism=2).sink(td.sinks.Collect())
        out = job.run_reference(duration=0.05).output
        # Event 0 (released at t=0) is consumed before any rule: LiveRobin starts at
        # channel 0 (the event side), and the rules all arrive in cycle 1 after it.
        got = canonical(out.select(["source_seq", "user", "amount", "limit"]))
        assert got.drop_columns(["source_seq"]).to_pydict() == expected, how


def test_window_sums_per_key_by_hand(tmp_path):
    data = pa.table(
        {
            "k": ["x", "y", "x", "x", "y", "y", "x", "y", "x", "x", "y", "x"],
            "v": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0],
        }
    )
    job = td.Job("w", heartbeat_ms=2)
    s = job.source(csv_source(tmp_path, "w", data, rate=1000))
    s.key_by("k").window(
        5,
        {"sum": ("v", "sum"), "n": ("v", "count"), "hi": ("v", "max"), "avg": ("v", "mean")},
        parallelism=2,
    ).sink(td.sinks.Collect())
    out = canonical(job.run_reference(duration=0.012, t0_ns=1_000).output)
    # rows 0-4 in [0, 5 ms), 5-9 in [5, 10), 10-11 in [10, 15); t0 shifts every time.
    assert out.to_pydict() == {
        "k": ["x", "x", "x", "y", "y", "y"],
        "window_start_ns": [1_000, 5_001_000, 10_001_000] * 2,
        "window_end_ns": [5_001_000, 10_001_000, 15_001_000] * 2,
        "event_time_ns": [5_000_999, 10_000_999, 15_000_999] * 2,
        "sum": [8.0, 26.0, 12.0, 7.0, 14.0, 11.0],
        "n": [3, 3, 1, 2, 2, 1],
        "hi": [4.0, 10.0, 12.0, 5.0, 8.0, 11.0],
        "avg": [8 / 3, 26 / 3, 12.0, 3.5, 7.0, 11.0],
    }


def test_key_by_process_counts_every_key_in_source_order():
    job = td.Job("kp", heartbeat_ms=5, batch_rows=16)
    s = job.source(td.sources.Synthetic(rate=5000, keys=7, seed=11), parallelism=2)
    s.map(identity, parallelism=3).key_by("key").process(td.CountPerKey(), parallelism=2).sink(
        td.sinks.Collect(), parallelism=2
    )
    r = job.run_reference(duration=0.04)
    assert r.events_in == r.events_out == 200
    # process partition p feeds sink partition p (forward), so the output is each
    # process partition's output in processing order: per key, counts run 1, 2, ..., n.
    per_key: dict[int, list[int]] = {}
    for key, count in zip(r.output["key"].to_pylist(), r.output["count"].to_pylist(), strict=True):
        per_key.setdefault(key, []).append(count)
    assert sorted(per_key) == list(range(7))
    for counts in per_key.values():
        assert counts == list(range(1, len(counts) + 1))
    assert r.output["source_seq"].sort().to_pylist() == list(range(200))


def full_job(batch_rows=64, t0_hb=10):
    job = td.Job("full", heartbeat_ms=t0_hb, batch_rows=batch_rows)
    ev = job.source(td.sources.Synthetic(rate=4000, keys=20, seed=5), parallelism=2, name="ev")
    rules = job.source(
        td.sources.Synthetic(rate=300, keys=20, seed=6, extras={"limit": "float64"}),
        name="rules",
    ).map(lambda b: b.drop_columns(["value"]), name="rules_only")
    other = job.source(td.sources.Synthetic(rate=1000, keys=20, seed=8), name="other")
    both = ev.union(other)
    joined = both.filter(positive_half, name="half").join(rules, on="key", parallelism=3)
    joined.key_by("key").process(td.CountPerKey(), parallelism=2).sink(td.sinks.Collect())
    both.window(20, {"n": ("value", "count"), "s": ("value", "sum")}, key="key").sink(
        td.sinks.Collect(), name="windows"
    )
    return job


def positive_half(batch):
    return pc.greater(batch["value"], 0.5)


def test_two_reference_runs_are_identical():
    one = full_job().run_reference(duration=0.1, t0_ns=123)
    two = full_job().run_reference(duration=0.1, t0_ns=123)
    assert one.output.num_rows > 50
    assert one.output.equals(two.output)
    assert one.outputs["windows"].equals(two.outputs["windows"])
    assert one.to_json() == two.to_json()
    windows = one.outputs["windows"]
    assert sum(windows["n"].to_pylist()) == 400 + 100  # every ev and other row, once


def test_single_input_results_do_not_depend_on_batch_rows():
    def counts(batch_rows):
        job = td.Job("b", batch_rows=batch_rows)
        job.source(td.sources.Synthetic(rate=3000, keys=9, seed=4), parallelism=2).key_by(
            "key"
        ).process(td.CountPerKey(), parallelism=3).sink(td.sinks.Collect())
        return job.run_reference(duration=0.05).output

    # batch_rows cuts the source batches, and LiveRobin takes one batch per turn, so the
    # interleaving of the two source partitions differs; what may not differ: every row
    # once, and per key counts 1..n.
    small, big = counts(3), counts(1024)
    assert small.num_rows == big.num_rows == 150
    assert canonical(small.select(["source_seq", "key"])).equals(
        canonical(big.select(["source_seq", "key"]))
    )
    for t in (small, big):
        per_key = t.group_by("key").aggregate([("count", "max"), ("count", "count")])
        assert per_key["count_max"].to_pylist() == per_key["count_count"].to_pylist()


def test_window_contents_do_not_depend_on_t0():
    a = full_job().run_reference(duration=0.1, t0_ns=0).outputs["windows"]
    b = full_job().run_reference(duration=0.1, t0_ns=987_654_321).outputs["windows"]
    assert a.select(["key", "n", "s"]).equals(b.select(["key", "n", "s"]))
    assert pc.subtract(b["window_start_ns"], a["window_start_ns"]).unique().to_pylist() == [
        987_654_321
    ]


def test_reference_result_fields():
    r = full_job().run_reference(duration=0.05)
    assert (r.lost, r.duplicates, r.digests_match, r.faults, r.lost_replicas) == (
        0,
        0,
        True,
        [],
        [],
    )
    assert r.p50_ms is None and r.per_second_p99_ms == []
    assert r.events_in == 200 + 15 + 50


class MaxSoFar(td.KeyedProcess):
    """User-style keyed operator: per key, the largest value seen so far; at the final
    watermark, one summary row per key (sorted by key)."""

    schema = pa.schema(
        [("key", pa.int64()), ("event_time_ns", pa.int64()), ("max_so_far", pa.float64())]
    )

    def process(self, batch, state):
        out = []
        for key, value in zip(batch["key"].to_pylist(), batch["value"].to_pylist(), strict=True):
            state[key] = max(state.get(key, value), value)
            out.append(state[key])
        return pa.record_batch(
            [batch["key"], batch["event_time_ns"], pa.array(out, pa.float64())],
            schema=self.schema,
        )

    def on_watermark(self, wm_ns):
        if wm_ns != WATERMARK_MAX or not self.state:
            return None
        keys = sorted(self.state)
        return pa.record_batch(
            [
                pa.array(keys, pa.int64()),
                pa.array([wm_ns] * len(keys), pa.int64()),
                pa.array([self.state[k] for k in keys], pa.float64()),
            ],
            schema=self.schema,
        )


class WrongShape(MaxSoFar):
    def process(self, batch, state):
        return batch  # not the declared schema


def test_user_keyed_process_with_declared_schema_and_final_watermark():
    job = td.Job("user", batch_rows=8)
    s = job.source(td.sources.Synthetic(rate=2000, keys=4, seed=3))
    s.key_by("key").process(MaxSoFar(), parallelism=2, name="max").sink(td.sinks.Collect())
    r = job.run_reference(duration=0.05)
    out = r.output
    assert out.schema == MaxSoFar.schema
    assert out.num_rows == 100 + 4  # one row per input, one summary per key
    finals = out.filter(pc.equal(out["event_time_ns"], WATERMARK_MAX))
    src = pa.Table.from_batches(
        [td.sources.Synthetic(rate=2000, keys=4, seed=3).read(0, 1, 0, 100, 0)]
    )
    want = src.group_by("key").aggregate([("value", "max")]).sort_by("key")
    assert canonical(finals)["max_so_far"].to_pylist() == want["value_max"].to_pylist()


def test_keyed_process_returning_the_wrong_schema_names_operator_and_partition():
    job = td.Job("user")
    s = job.source(td.sources.Synthetic(rate=2000, keys=4, seed=3))
    s.key_by("key").process(WrongShape(), parallelism=2, name="bad").sink(td.sinks.Collect())
    with pytest.raises(
        td.ConfigError,
        match=r"operator 'bad' \(task 1, partition \d\) returned a "
        r"batch with schema \[source_seq: int64",
    ):
        job.run_reference(duration=0.01)
