"""`tandem bench mib1` / `throughput`: every row says whether its output was complete and
unrepeated, by a sequence check at the sink (the reference executor would take too long at
their rates). `tandem bench failover` and `tandem bench recovery` (restore r against state
size, and the fault experiment beside it), checked against the reference executor."""

import dataclasses
import io
import json

import numpy as np
import pyarrow as pa
import pytest

import tandem as td
from tandem.cli import main
from tandem.experiments import failover, mib1, throughput, workloads


def _batch(seqs) -> pa.RecordBatch:
    seqs = np.asarray(seqs, dtype=np.int64)
    return pa.RecordBatch.from_arrays(
        [pa.array(seqs), pa.array(seqs * 1000)], names=["source_seq", "event_time_ns"]
    )


def _received(*partitions) -> workloads.Sequences:
    """What a SequenceSink of ``len(partitions)`` partitions reports, partition ``p``
    receiving the batches ``partitions[p]``."""
    proto, parts = workloads.SequenceSink(), []
    for p, batches in enumerate(partitions):
        sink = workloads.SequenceSink()
        sink.open(p, len(partitions), _batch([]).schema)
        for seqs in batches:
            sink.write(_batch(seqs))
        parts.append(sink.close())
    return proto.combine(parts)


def test_sequence_check_counts_what_is_missing_and_what_is_repeated():
    interleaved = [range(0, 100, 2), range(1, 100, 2)]  # two channels, in any order
    assert _received(interleaved).check(100) == (0, 0)
    assert _received([range(0, 60)], [range(60, 100)]).check(100) == (0, 0)
    # Row 10 lost and row 20 repeated: the row count is right, the check is not fooled.
    swapped = [[*range(0, 10), *range(11, 50), 20]], [range(50, 100)]
    assert _received(*swapped).check(100) == (1, 1)
    # A row both partitions received, and one the source never released.
    assert _received([range(0, 60)], [range(50, 100), [100]]).check(100) == (0, 11)
    assert _received([], []).check(5) == (5, 0)
    assert _received([range(5)]).check(0) == (0, 5)


def test_sequence_sink_needs_source_seq():
    with pytest.raises(td.ConfigError, match="source_seq"):
        workloads.SequenceSink().open(0, 1, pa.schema([("x", pa.int64())]))


def test_mib1_and_throughput_rows_report_lost_and_duplicates_as_ints():
    types = {f.name: f.type for f in dataclasses.fields(workloads.Row)}
    assert types["lost"] in (int, "int") and types["duplicates"] in (int, "int")
    rows = mib1.mib1(
        lengths=(1,), configs=("liverobin",), rate=1_000, warmup=0.5, measure=1.0, log=io.StringIO()
    )
    best, more = throughput.throughput(rates=(2_000,), duration=1.5, log=io.StringIO())
    assert best == 2_000
    for row in [*rows, *more]:
        assert type(row.lost) is int and type(row.duplicates) is int, row
        assert row.lost == 0 and row.duplicates == 0, row
        assert row.events_out > 0


def test_failover_states_its_peak_as_a_ratio_to_a_fault_free_run():
    """`tandem bench failover` runs each ordering once without the fault in the same
    invocation and reports the peak after the kill over that run's peak in the same
    seconds."""
    (row,) = failover.failover(
        rate=500, duration=4.0, kill_at=2.0, cases=("liverobin",), log=io.StringIO()
    )
    assert (row.lost, row.duplicates, row.digests_match) == (0, 0, True)
    assert row.peak_after_ms == max(v for v in row.per_second_p99_ms[2:8] if v is not None)
    assert row.fault_free_peak_ms > 0
    assert row.peak_ratio == round(row.peak_after_ms / row.fault_free_peak_ms, 2)


def test_recovery_runs_the_restore_rows_and_the_fault_experiment_in_one_invocation(
    tmp_path, capsys
):
    """`tandem bench recovery --quick`: restore r with 1 MiB of state, a savepoint of a
    running job with 1 MiB, the driver SIGKILLed and resumed, a live rescale 2 -> 4, then
    the fault experiment of
    `tandem bench paper` (passive and LiveRobin here; KaZoo runs in
    tests/test_bench_paper.py), one report, one JSON, one PNG."""
    doc_path, plot = tmp_path / "recovery.json", tmp_path / "fault.png"
    argv = ["bench", "recovery", "--quick", "--configs", "passive,liverobin"]
    code = main([*argv, "--json", str(doc_path), "--plot", str(plot)])
    printed = capsys.readouterr()
    assert code == 0, printed.out[-4000:] + printed.err[-4000:]
    doc = json.loads(doc_path.read_text())
    assert doc["experiments"] == ["restore", "savepoint", "driver", "rescale", "fault"]
    assert doc["failures"] == []
    live = doc["rescale_row"]
    assert (live["was"], live["now"]) == (2, 4) and 0 < live["switch_s"] < 6
    assert live["switch_ms"] > 0 and live["p99_with_ms"] > 0 and live["gap_with_ms"] > 0
    assert live["settled_with_ms"] > 0 and live["cpu_with_s"] > 0 and live["cpu_without_s"] > 0
    assert (live["lost"], live["duplicates"], live["digests_match"]) == (0, 0, True)
    lost = doc["driver_row"]
    assert lost["cut_s"] < lost["killed_s"] and 0 < lost["rows_before_cut"] < lost["rows"]
    assert lost["rows_reprocessed"] > 0 and lost["downtime_ms"] > 0
    assert lost["rows_out"] == lost["rows"] and (lost["lost"], lost["duplicates"]) == (0, 0)
    assert lost["counts_exact"]
    (saved,) = doc["savepoint_rows"]
    assert saved["state_mb"] == 1 and saved["state_mb_written"] >= 2  # 2 partitions
    assert saved["write_ms"] > 0 and saved["p99_with_ms"] > 0 and saved["ratio"] > 0
    assert saved["rows_exact"] and saved["resumed_rows"] > 0
    assert (saved["lost"], saved["duplicates"], saved["digests_match"]) == (0, 0, True)
    (restore,) = doc["restore_rows"]
    assert restore["state_mb"] == 1 and restore["rebuilt"] > 0 and restore["restore_ms"] > 0
    assert (restore["lost"], restore["duplicates"], restore["digests_match"]) == (0, 0, True)
    faults = doc["fault_rows"]
    assert [(r["config"], r["variant"]) for r in faults] == [
        ("passive", "kill replica 0"),
        ("liverobin", "kill replica 0"),
    ]
    for r in faults:
        assert r["status"] == "ok", (r["config"], r["error"])
        assert (r["lost"], r["duplicates"], r["digests_match"]) == (0, 0, True), r["config"]
        assert r["kill"] == "map2[0] 0" and r["victim"] is not None, r["config"]
        assert r["max_gap_ms"] > 0 and r["peak_p99_after_ms"] > 0, r["config"]
    md = doc["markdown"]
    assert md in printed.out
    assert "### Restoring r against state size" in md and "| 1 MiB | " in md
    assert "### A savepoint of the running job against state size" in md
    assert "### The driver lost: SIGKILL, then `tandem run --resume`" in md
    assert "### A keyed task rescaled while the job runs" in md
    assert "| length 3 | passive | kill replica 0 | " in md
    assert "| length 3 | liverobin | kill replica 0 | " in md
    assert doc["figures"] == [str(plot)]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_recovery_cli_refuses_what_it_cannot_run(capsys):
    assert main(["bench", "recovery", "--configs", "none"]) == 2
    assert "--configs: unknown ['none']" in capsys.readouterr().err
    assert main(["bench", "recovery", "--experiments", "mib1"]) == 2
    assert "--experiments: unknown ['mib1']" in capsys.readouterr().err
    assert main(["bench", "recovery", "--sizes", "1,x"]) == 2
    assert "--sizes '1,x': MiB of state per partition" in capsys.readouterr().err
    for flags in (["recovery", "--out", "x"], ["mib1", "--experiments", "fault"]):
        with pytest.raises(SystemExit) as exc:  # a flag of another experiment's
            main(["bench", *flags])
        assert exc.value.code == 2
        assert f"unrecognized arguments: {' '.join(flags[1:])}" in capsys.readouterr().err
