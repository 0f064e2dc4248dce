"""`tandem bench paper`: the paper's evaluation, every configuration side by side.

The end-to-end test runs the whole `--quick` set from the CLI, in-process, against the real
ZooKeeper and Kafka (KaZoo) and a real local Spark (Structured Streaming, `sss`), and checks
that every experiment ran in every configuration it has, that no row of an exactly-once
configuration lost or repeated a row, and that the JSON, the Markdown and the figures were
written; another runs Structured Streaming's driver kill in the fault experiment. The others
check the pieces without running a job (the BetterCloud-like job on the reference executor
only), fast.
"""

import json
import sys
from dataclasses import replace

import pyarrow as pa
import pytest

import tandem as td
from tandem.cli import main
from tandem.experiments import paper as bp
from tandem.experiments import workloads

FIGURES = [
    "mib1_latency.png",
    "mib2_latency.png",
    "mib3_latency.png",
    "heartbeat_latency.png",
    "fault_latency.png",
    "fault_p99_over_time.png",
    "bettercloud_latency.png",
    "bettercloud_p99_over_time.png",
]

EXPECTED_CONFIGS = {
    "mib1": {"r1", "passive", "none", "liverobin", "kazoo", "sss"},
    "mib2": {"r1", "passive", "none", "liverobin", "kazoo"},
    "mib3": {"r1", "passive", "none", "liverobin", "kazoo"},
    "heartbeat": {"r1", "liverobin"},
    "fault": {"r1", "passive", "liverobin", "kazoo"},
    "bettercloud": {"r1", "passive", "liverobin", "kazoo"},
}


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.timeout(900)
def test_paper_quick_runs_every_experiment_in_every_configuration(
    zookeeper, kafka, tmp_path, capsys
):
    code = main(["bench", "paper", "--quick", "--out", str(tmp_path)])
    printed = capsys.readouterr()
    assert code == 0, printed.out[-4000:] + printed.err[-4000:]
    doc = json.loads((tmp_path / "paper.json").read_text())
    assert doc["build"] == "release" and doc["failures"] == []
    assert doc["experiments"] == list(bp.EXPERIMENTS)
    rows = doc["rows"]
    runs = rows
    assert len(runs) == len(bp.cases(bp.QUICK, bp.EXPERIMENTS, bp.ALL_CONFIGS)) == 29
    for experiment, configs in EXPECTED_CONFIGS.items():
        ran = {r["config"] for r in runs if r["experiment"] == experiment}
        assert ran == configs, experiment
    for r in runs:
        where = f"{r['experiment']} {r['group']} {r['variant']} {r['config']}"
        assert r["status"] == "ok", (where, r["error"])
        # Checked in every row, never None; exactly once wherever the configuration promises it.
        assert isinstance(r["lost"], int) and isinstance(r["duplicates"], int), where
        if r["config"] in bp.EXACTLY_ONCE:
            assert r["lost"] == 0 and r["duplicates"] == 0 and r["digests_match"], where
        assert r["events_in"] > 0 and r["events_out"] > 0, where
        assert r["p99_ms"] >= r["p50_ms"] > 0 and r["max_ms"] >= r["p99_ms"], where
        assert r["cpu_s_per_m_events"] > 0 and r["rss_mb_total"] > 0, where
        assert r["cpu_basis"] in ("steady", "whole run"), where
        assert r["p99_ratio_vs_r1"] is not None and r["cpu_ratio_vs_r1"] is not None, where
        if r["config"] == "r1":
            assert r["p99_ratio_vs_r1"] == 1.0 and r["cpu_ratio_vs_r1"] == 1.0, where
        if r["config"] == "kazoo":
            assert r["services_cpu_s"] is not None, where
    (spark,) = [r for r in runs if r["config"] == "sss"]
    # Structured Streaming without a fault: every released event at the sink exactly once,
    # counted by source_seq; one copy, so no replica digests.
    assert (spark["experiment"], spark["group"], spark["kill"]) == ("mib1", "length 3", None)
    assert spark["lost"] == 0 and spark["duplicates"] == 0
    assert spark["events_out"] == spark["events_in"] == 3 * 5_000  # as long as a fault run
    assert spark["digests_match"] is None and spark["cpu_basis"] == "steady"
    assert spark["spark"]["query"] == "python source -> mapInArrow x3 -> foreachBatch"
    assert spark["processes"] >= 2  # the Python driver and its JVM at least
    kills = [r for r in runs if r["kill"] is not None]
    assert {(r["experiment"], r["variant"], r["config"]) for r in kills} == {
        (e, v, c)
        for e in bp.FAULT_EXPERIMENTS
        for v, c in (
            ("kill replica 0", "passive"),
            ("kill replica 0", "liverobin"),
            ("kill leader", "kazoo"),
            ("kill follower", "kazoo"),
        )
    }
    for r in kills:
        assert r["victim"] is not None and r["max_gap_ms"] is not None, r["variant"]
        assert r["peak_p99_after_ms"] is not None, r["variant"]
    md = (tmp_path / "paper.md").read_text()
    for title in bp.TITLES.values():
        assert f"### {title}" in md
    assert "| length 3 | liverobin | " in md and "20.9 / 41.4" in md  # the paper beside ours
    assert md in printed.out
    assert doc["figures"] == [str(tmp_path / f) for f in FIGURES]
    for f in FIGURES:
        assert (tmp_path / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f
    assert printed.err.count("to go)") == 29  # a progress line per run
    assert "Not in this table: Spark Structured Streaming in MiB2" in md
    assert "the fault run (left out of --quick" in md and "PyFlink is not installed" in md


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.timeout(600)
def test_structured_streaming_driver_kill_in_the_fault_experiment(tmp_path):
    settings = replace(
        bp.QUICK, spark_fault=True, fault_duration_s=12, fault_warmup_s=2, spark_warmup_s=2
    )
    doc = bp.paper(settings, ["fault"], ["r1", "sss"], out_dir=tmp_path, log=sys.stderr)
    assert doc["failures"] == []
    r1, spark = doc["rows"]
    assert (r1["config"], spark["config"], spark["variant"]) == ("r1", "sss", "kill driver")
    assert spark["status"] == "ok", spark["error"]
    assert (spark["kill"], spark["kill_at_s"]) == ("driver", 6)
    s = spark["spark"]
    # Passive recovery: nothing lost, a hole in the output while a new driver starts, and
    # every event released at the kill waits for it (downtime is latency).
    assert spark["lost"] == 0 and spark["events_in"] == 12 * 5_000
    assert s["downtime_s"] > 0 and s["restart_s"]["first_output"] == s["downtime_s"]
    assert spark["max_ms"] >= 1_000 * s["downtime_s"] - 2
    assert spark["peak_p99_after_ms"] is not None
    assert spark["max_gap_ms"] >= 1_000 * s["downtime_s"]  # the longest gap: downtime at least
    # foreachBatch is at-least-once across the crash: any duplicate is the one batch in
    # flight written again with the same events; idempotent by batch id, none is left.
    assert s["duplicate_batches"] <= 1
    assert (spark["duplicates"] > 0) == (s["duplicate_batches"] == 1)
    assert s["replays_identical"] and s["duplicates_if_idempotent"] == 0
    assert spark["events_out"] == spark["events_in"] + spark["duplicates"]
    assert spark["cpu_s_per_m_events"] > 0 and spark["rss_mb_total"] > 0
    assert spark["p99_ratio_vs_r1"] is not None
    md = (tmp_path / "paper.md").read_text()
    assert "| length 3 | sss | kill driver |" in md
    assert "restarted driver's first output" in md
    assert (tmp_path / "fault_p99_over_time.png").exists()


def test_quick_and_full_grids():
    quick = bp.cases(bp.QUICK, bp.EXPERIMENTS, bp.ALL_CONFIGS)
    assert {c.experiment for c in quick} == set(bp.EXPERIMENTS)
    # One short Structured Streaming row (MiB1), whose JVM start-up is most of its time.
    assert [(c.experiment, c.group) for c in quick if c.config == "sss"] == [("mib1", "length 3")]
    assert sum(bp.estimate_s(c) for c in quick if c.config != "sss") < 180
    assert sum(bp.estimate_s(c) for c in quick) < 210
    full = bp.cases(bp.FULL, bp.EXPERIMENTS, bp.ALL_CONFIGS)
    assert len(full) == 20 * 3 + 6 + 5 + 10 + 4 + 1
    # The budget for the full set on 2 cores (the guesses run high: 28.5 min guessed
    # for the run docs/paper.md shows).
    assert sum(bp.estimate_s(c) for c in full) < 30 * 60
    fault = [c for c in full if c.experiment == "fault"]
    assert [(c.config, c.fault and c.fault.replica) for c in fault] == [
        ("r1", None),
        ("passive", 0),
        ("liverobin", 0),
        ("kazoo", "leader"),
        ("kazoo", "follower"),
        ("sss", None),
    ]
    assert fault[-1].spark == {"maps": 3, "kill_driver_at": bp.FULL.fault_duration_s / 2}
    assert fault[-1].variant == "kill driver" and fault[-1].warmup_s == 10
    assert all(c.fault is None or c.fault.at == c.duration_s / 2 for c in full)
    spark = [(c.experiment, c.spark["maps"]) for c in full if c.config == "sss"]
    assert spark == [("mib1", 1), ("mib1", 2), ("mib1", 3), ("mib1", 4), ("fault", 3)]
    assert bp.cases(bp.FULL, ["mib2", "mib3", "heartbeat", "bettercloud"], ["sss"]) == []
    only = bp.cases(bp.QUICK, ["heartbeat"], ["liverobin"])
    assert [c.heartbeat_ms for c in only] == [5, 100]


def _row(config, lost=0, duplicates=0, status="ok", experiment="mib1", **kw):
    row = bp.Row(experiment, "length 1", 1, "", config, status, lost=lost, duplicates=duplicates)
    for k, v in kw.items():
        setattr(row, k, v)
    return row


def test_failures_count_losses_only_where_exactly_once_is_promised():
    rows = [_row("r1"), _row("none", lost=5, duplicates=7), _row("liverobin")]
    assert bp.failures(rows, ["mib1"]) == []
    rows.append(_row("kazoo", duplicates=1))
    assert bp.failures(rows, ["mib1"]) == ["mib1 length 1 kazoo: lost 0, duplicates 1"]
    err = _row("liverobin", status="error", experiment="mib2", error="ServiceUnavailable: x")
    assert bp.failures([err], ["mib2", "mib3"]) == [
        "mib2 length 1 liverobin: did not run (ServiceUnavailable: x)",
        "mib2: no configuration ran",
        "mib3: no configuration ran",
    ]
    assert bp.failures([_row("r1", digests_match=False)], ["mib1"]) == [
        "mib1 length 1 r1: the replicas' output digests differed"
    ]


def test_structured_streaming_rows_are_held_to_what_spark_promises():
    def spark_row(lost=0, duplicates=0, kill=None, **spark):
        spark = {"duplicate_batches": 0, "duplicates_if_idempotent": 0} | spark
        return _row("sss", lost, duplicates, kill=kill, spark=spark | {"replays_identical": True})

    assert (
        bp.failures(
            [spark_row(), spark_row(duplicates=400, kill="driver", duplicate_batches=1)], ["mib1"]
        )
        == []
    )
    assert bp.failures([spark_row(duplicates=3)], ["mib1"]) == [
        "mib1 length 1 sss: duplicates 3 without a fault"
    ]
    assert bp.failures([spark_row(lost=2, kill="driver")], ["mib1"]) == [
        "mib1 length 1 sss: lost 2"
    ]
    broken = spark_row(duplicates=9, kill="driver", duplicate_batches=2, duplicates_if_idempotent=1)
    assert bp.spark_broken(broken) == [
        "2 micro-batches re-written after the restart",
        "1 duplicates within one batch id",
    ]


def test_ratios_and_report_rows():
    r1 = _row("r1", p99_ms=10.0, cpu_s_per_m_events=100.0, cpu_basis="steady")
    lr = _row("liverobin", p99_ms=12.5, cpu_s_per_m_events=180.0, cpu_basis="steady")
    # Without a steady-state reading on one side, the whole runs are compared.
    kz = _row("kazoo", p99_ms=20.0, cpu_s_per_m_events=300.0, cpu_basis="whole run")
    r1.whole_run_cpu_s_per_m_events, kz.whole_run_cpu_s_per_m_events = 200.0, 300.0
    lr.paper = bp.paper_figure("mib1", 1, "liverobin", "")
    rows = [r1, lr]
    bp.add_ratios([*rows, kz])
    assert (lr.p99_ratio_vs_r1, lr.cpu_ratio_vs_r1) == (1.25, 1.8)
    assert (kz.p99_ratio_vs_r1, kz.cpu_ratio_vs_r1) == (2.0, 1.5)
    assert "CPU of the whole run" in bp._note(kz)
    pv = _row("passive", p99_ms=11.0, cpu_s_per_m_events=110.0, cpu_basis="steady")
    rows.append(pv)
    bp.add_ratios(rows)
    assert pv.p99_ratio_vs_r1 == 1.1
    meta = {"tandem": "0", "build": "release", "cpus": 2, "started": "now", "command": "c"}
    md = bp.markdown(rows, {**meta, "wall_s": 61})
    assert (
        "| length 1 | liverobin | — | 12.5 | — | 0 | 0 | 180 | — | 1.25x | 1.80x | 7.6 / 21.5 |"
        in md
    )
    assert "| length 1 | passive | — | 11.0 |" in md
    assert "1:01 in all" in md


def test_cli_rejects_what_paper_cannot_run(capsys):
    assert main(["bench", "paper", "--experiments", "mib9"]) == 2
    assert "--experiments: unknown ['mib9']" in capsys.readouterr().err
    assert main(["bench", "paper", "--experiments", "fault", "--configs", "none"]) == 2
    assert "fault would run nothing" in capsys.readouterr().err
    assert main(["bench", "paper", "--configs", "kazoo", "--experiments", "heartbeat"]) == 2
    assert "heartbeat would run nothing" in capsys.readouterr().err
    assert main(["bench", "paper", "--experiments", "mib2", "--configs", "sss"]) == 2
    assert "sss runs in mib1 and fault" in capsys.readouterr().err
    assert main(["bench", "paper", "--quick", "--experiments", "fault", "--configs", "sss"]) == 2
    assert "not in fault with --quick" in capsys.readouterr().err
    assert main(["bench", "paper", "--configs", "sss", "--duration", "4"]) == 2
    assert "sss's warm-up (10 s) must be shorter than its 8 s mib1 runs" in capsys.readouterr().err
    for flags in (["paper", "--json", "x.json"], ["mib1", "--out", "x"]):
        with pytest.raises(SystemExit) as exc:  # a flag of another experiment's
            main(["bench", *flags])
        assert exc.value.code == 2
        assert f"unrecognized arguments: {' '.join(flags[1:])}" in capsys.readouterr().err


def test_figures_without_matplotlib_say_so(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    assert bp.write_figures([_row("r1")], tmp_path, log=sys.stderr) == []
    assert "matplotlib is not installed" in capsys.readouterr().err


def test_bettercloud_job_on_the_reference():
    job = workloads.bettercloud_job(1_000, "liverobin", None, td.sinks.Collect())
    plan = job.plan()
    tasks = {t.name: t for t in plan.tasks}
    assert tasks["flat_map"].parallelism == 2
    assert {"join_logins", "join_messages", "filter_logins", "filter_messages"} <= set(tasks)
    res = job.run_reference(duration=3.0)
    out: pa.Table = res.output
    assert 0 < out.num_rows < res.events_in
    actions = set(out.column("action").to_pylist())
    assert actions == {1, 2}  # alerts, and the escalations the flat_map adds
    assert out.column("limit").null_count < out.num_rows  # some events met a rule
