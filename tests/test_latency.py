"""Latency at the sinks (tandem.latency): per-second HDR histograms and output bitmaps
instead of per-row arrays. The figures are checked against numpy on the exact values, and
a sink's report is checked to stay flat as its row count grows."""

from __future__ import annotations

import pickle
import types

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tandem as td
from tandem import _core, latency, runtime
from tandem.engines import common
from tandem.engines.common import assemble_result
from tandem.testing import CountRows

MS = 1_000_000
S = 1_000_000_000
# The upper end of a value's bucket is at most 1/128 of the value above it (2 significant
# figures; values below 256 ns are exact).
REL = 1 / 128


@given(st.integers(0, latency.HIGHEST_NS))
def test_vectorised_index_is_the_packages_own(value):
    h = latency.new_histogram()
    want = h.get_counts_array_index(value)
    assert latency._LAYOUT.index(np.array([value], dtype=np.int64))[0] == want
    # and recording the bucket's value, as a sealed second does, lands in the same bucket
    assert h.get_counts_array_index(h.get_value_from_index(want)) == want


def test_layout_covers_one_hour_within_one_percent():
    h = latency.new_histogram()
    for v in (10_000, 1_234_567, 3_600 * S):
        assert v <= h.get_highest_equivalent_value(v) <= v * (1 + REL)
    assert h.get_highest_equivalent_value(10_000) - 10_000 < 0.01 * 10_000


def _nearest_rank(values: np.ndarray, p: float) -> int:
    """The value of rank max(1, round(p·n/100)), as HdrHistogram ranks it."""
    k = max(1, int(p * len(values) / 100 + 0.5))
    return int(np.sort(values)[k - 1])


def _close(got_ms: float, exact_ns: int) -> bool:
    got = round(got_ms * MS)
    return exact_ns <= got <= exact_ns + exact_ns * REL


latencies = st.one_of(
    st.integers(0, 2_000),  # exact range
    st.integers(0, 50 * MS),
    st.integers(0, 3_600 * S),
)
batch = st.tuples(st.integers(0, 400 * MS), st.lists(latencies, min_size=1, max_size=12))
sink_batches = st.lists(batch, min_size=1, max_size=30)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(sink_batches, min_size=1, max_size=3),
    st.integers(0, 3 * S),
)
def test_figures_match_numpy_on_the_exact_values(sinks, warmup_ns):
    """Several sinks, each receiving batches (after a gap, with their rows' latencies);
    rows received before the warm-up are left out."""
    logs, recv, lat = [], [], []
    for batches in sinks:
        rec = latency.LatencyRecorder(0, warmup_ns)
        now = 0
        for gap, lats in batches:
            now += gap
            rec.record(now, now - np.array(lats, dtype=np.int64))
            if now >= warmup_ns:
                recv += [now] * len(lats)
                lat += lats
        logs.append(rec.finish())
    got = latency.summarize(logs, skip_ns=warmup_ns)
    if not lat:
        assert got is None
        return
    recv, lat = np.array(recv), np.array(lat)
    assert _close(got.p50_ms, _nearest_rank(lat, 50))
    assert _close(got.p99_ms, _nearest_rank(lat, 99))
    assert _close(got.max_ms, int(lat.max()))
    second = recv // S
    assert len(got.per_second_p99_ms) == second.max() + 1
    for s, p99 in enumerate(got.per_second_p99_ms):
        if np.any(second == s):
            assert _close(p99, _nearest_rank(lat[second == s], 99))
        else:
            assert p99 is None
    times = np.unique(recv)
    exact_gap_ms = np.diff(times).max() / MS if len(times) > 1 else 0.0
    assert abs(got.max_gap_ms - exact_gap_ms) < 1


def test_latencies_out_of_range_are_clamped():
    rec = latency.LatencyRecorder(0)
    rec.record(5 * S, np.array([5 * S + 10, 5 * S - 7_200 * S], dtype=np.int64))
    got = latency.summarize([rec.finish()])
    assert got.p50_ms == 0
    assert _close(got.max_ms, latency.HIGHEST_NS)


def test_rows_without_an_event_time_are_not_measured():
    rec = latency.LatencyRecorder(0)
    rec.record(S, np.array([S - 3 * MS, np.nan]))
    rec.record(S + MS, np.array([np.nan]))
    got = latency.summarize([rec.finish()])
    assert _close(got.max_ms, 3 * MS) and got.max_gap_ms == 0.0


def test_receive_times_never_go_back():
    """A wall clock stepping back puts rows in the current second, not a sealed one."""
    rec = latency.LatencyRecorder(0)
    rec.record(2 * S + 5 * MS, np.array([2 * S], dtype=np.int64))
    rec.record(1 * S, np.array([1 * S - MS], dtype=np.int64))
    out = rec.finish()
    assert sorted(out.histograms) == [2]
    got = latency.summarize([out])
    assert got.per_second_p99_ms[:2] == [None, None]
    assert got.max_gap_ms == 0.0


def _sink_report(monkeypatch, rate: int, duration: float) -> tuple[runtime.ReplicaReport, int]:
    """Drive a real sink replica with ``duration`` seconds of a source's batches at
    ``rate``, each received 1-20 ms after its last row was released (a fake clock)."""
    job = td.Job("flat", buffer_timeout_ms=5)
    job.source(td.sources.Synthetic(rate=rate, keys=10, seed=1)).sink(CountRows())
    plan = job.plan()
    src, sink = plan.sources()[0].id, plan.sinks()[0].id
    t0 = 10**18
    clock = {"now": t0}
    monkeypatch.setattr(
        runtime.replica,
        "time",
        types.SimpleNamespace(time_ns=lambda: clock["now"], monotonic=None),
    )
    rep = runtime.Replica(plan, sink, 0, 0, b"k" * 32, _core.Worker())
    rep.bind()
    rep.start({}, t0, {}, warmup=0.0)
    rng = np.random.default_rng(0)
    rows = 0
    for step in plan.source_schedule(src, 0, duration):
        if step.kind != "rows":
            continue
        batch = plan.source_batch(src, 0, step.j0, step.j1, t0)
        last = batch.column("event_time_ns")[-1].as_py()
        clock["now"] = max(clock["now"], last + int(rng.integers(1, 20)) * MS)
        rep.on_data(0, batch)
        rows += batch.num_rows
    rep.on_end()
    report = rep.finish()
    assert report.rows_in == rows and report.sink_part == rows
    assert report.first_receive_ns is not None
    return report, rows


def test_a_sinks_report_stays_flat_as_its_rows_grow(monkeypatch):
    small, n_small = _sink_report(monkeypatch, 1_000, 10.0)
    big, n_big = _sink_report(monkeypatch, 10_000, 10.0)
    assert n_big == 10 * n_small == 100_000
    size_small, size_big = len(pickle.dumps(small)), len(pickle.dumps(big))
    print(f"report: {size_small} B for {n_small} rows, {size_big} B for {n_big} rows")
    # Per-row arrays took 16 bytes a row: 1.6 MB for the big run.
    assert size_big < 1.5 * size_small
    assert size_big / n_big < 0.5
    # the last batches arrive just after the tenth second
    assert sorted(big.latency.histograms) == list(range(11))
    # The report gives the engine the figures.
    res = td.Result()
    common._latency(res, [big], warmup=0.0)
    assert 1 <= res.p50_ms <= res.p99_ms <= res.max_ms < 30
    assert len(res.per_second_p99_ms) == 11
    assert res.max_gap_ms < 30


def test_assemble_result_fills_the_latency_fields_from_sink_reports():
    job = td.Job("asm")
    job.source(td.sources.Synthetic(rate=100, keys=5, seed=1)).sink(CountRows())
    plan = job.plan()
    sink = plan.sinks()[0].id
    rec = latency.LatencyRecorder(0, S // 2)  # warm-up 0.5 s
    for ms in range(0, 3_000, 5):
        now = ms * MS
        rec.record(now, np.array([now - 2 * MS, now - 4 * MS], dtype=np.int64))
    report = runtime.ReplicaReport(sink, 0, 0, "sink", rows_in=1200, sink_part=1200, ended=True)
    report.latency = rec.finish()
    res = assemble_result(
        plan, 3.0, {(sink, 0, 0): report}, t0_ns=0, warmup=0.5, check=False, faults=[]
    )
    assert _close(res.p50_ms, 2 * MS) and _close(res.p99_ms, 4 * MS)
    assert res.per_second_p99_ms == pytest.approx([4.0] * 3, rel=REL)
    assert res.max_gap_ms == 5.0


@pytest.mark.parametrize("order", ["late-first", "late-last"])
def test_the_copy_published_is_the_least_interrupted_whichever_reports_first(order):
    """Two copies of one sink partition, the same rows: one received them steadily, the
    other (a host cut off and healed) nothing for 2 s and then all at once. The steady
    copy is published, and the run's latency and gap are its own, in either order of
    the reports."""
    job = td.Job("two-copies")
    job.source(td.sources.Synthetic(rate=100, keys=5, seed=1)).sink(td.sinks.Collect())
    plan = job.plan()
    sink = plan.sinks()[0].id

    def copy(replica: int, stalled: bool) -> runtime.ReplicaReport:
        rec = latency.LatencyRecorder(0)
        for ms in range(0, 4_000, 5):
            due = ms * MS
            now = max(due, 3_000 * MS) if stalled and 1_000 <= ms < 3_000 else due + 2 * MS
            rec.record(now, np.array([due], dtype=np.int64))
        rows = pa.table({"n": np.arange(800)})
        rep = runtime.ReplicaReport(sink, 0, replica, "sink", rows_in=800, sink_part=rows)
        rep.ended, rep.latency = True, rec.finish()
        return rep

    steady, late = copy(0, stalled=False), copy(1, stalled=True)
    reports = {(sink, 0, 1): late, (sink, 0, 0): steady}
    if order == "late-last":
        reports = {(sink, 0, 0): steady, (sink, 0, 1): late}
    assert common.published_copies(plan, reports) == {(sink, 0): (sink, 0, 0)}
    assert latency.longest_gap_ms(late.latency) > 1_900
    res = assemble_result(plan, 4.0, reports, t0_ns=0, warmup=0.0, check=False, faults=[])
    assert res.max_gap_ms == 5.0 and _close(res.max_ms, 2 * MS)
