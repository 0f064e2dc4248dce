"""``tandem bench recovery``: what a lost replica costs, in one invocation, on the local
engine.

* ``restore`` — restoring r (``Job(restore=True)``) against state size: a keyed task
  carrying 1, 10 and 100 MiB per partition (:func:`tandem.bench.recovery`), the replica
  group holding ``state[0]`` replica 0 SIGKILLed and rebuilt from its twins; per size the
  time to restore r, the per-second p99 before the kill and during the rebuild, lost and
  duplicates.
* ``fault`` — the paper's fault experiment as ``tandem bench paper`` runs it (its cases,
  runner and figure, :mod:`tandem.bench_paper`): MiB1 of length 3, one replica of
  ``map2[0]`` SIGKILLed at half time, in ``passive`` (ours: one replica, checkpoints,
  rollback), ``liverobin`` and ``kazoo`` (leader, then follower killed), with ``r1``
  beside them without the fault; per row the downtime (the longest gap between two
  outputs), lost, duplicates and the peak per-second p99 after the kill.

Every row is checked against the reference executor; a row that lost or repeated a row,
whose replicas' digests differed, that did not run, or (``restore``) in which no replica
was rebuilt fails the run (:func:`failures`).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass, replace

import tandem as td
from tandem import bench, bench_paper

EXPERIMENTS = ("restore", "fault")
FAULT_CONFIGS = tuple(bench_paper.FAULT_VARIANTS)
"""The configurations the fault experiment runs: r1 (no fault), passive, liverobin, kazoo."""


@dataclass(frozen=True)
class Settings:
    """The state sizes and run lengths of one invocation (:data:`FULL` or :data:`QUICK`);
    ``fault`` holds the fault experiment's (``tandem bench paper``'s settings)."""

    sizes: tuple[float, ...] = (1, 10, 100)
    rate: int = 5_000
    duration_s: float = 12.0
    kill_at_s: float = 4.0
    fault: bench_paper.Settings = bench_paper.FULL

    def with_flags(
        self,
        rate: int | None = None,
        duration_s: float | None = None,
        warmup_s: float | None = None,
        session_timeout_s: float | None = None,
    ) -> Settings:
        """These settings with what the command line gave: ``rate`` for every run,
        ``duration_s`` for every run (the restore kill at a third of it, at 4 s at the
        latest; the fault kill at half), ``warmup_s`` for the fault runs."""
        s, fault = self, self.fault
        if rate is not None:
            s, fault = replace(s, rate=rate), replace(fault, rate=rate)
        if duration_s is not None:
            s = replace(s, duration_s=duration_s, kill_at_s=min(4.0, duration_s / 3))
            fault = replace(fault, fault_duration_s=duration_s)
        if warmup_s is not None:
            fault = replace(fault, fault_warmup_s=warmup_s)
        if session_timeout_s is not None:
            fault = replace(fault, session_timeout_s=session_timeout_s)
        return replace(s, fault=fault)


FULL = Settings()
"""1, 10 and 100 MiB (12 s runs, kill at 4 s); the fault runs of ``tandem bench paper``
(30 s, kill at 15 s): about 5 minutes on 2 cores."""
QUICK = Settings(sizes=(1,), duration_s=6.0, kill_at_s=2.0, fault=bench_paper.QUICK)
"""1 MiB only (6 s, kill at 2 s) and the fault runs of ``tandem bench paper --quick``
(3 s, kill at 1.5 s): for CI."""


def check_selection(experiments, configs) -> None:
    """Raise ConfigError for an unknown or empty selection, before anything runs."""
    known = (EXPERIMENTS, FAULT_CONFIGS)
    bench_paper.check_selection(experiments, configs, known, "bench recovery")


def fault_cases(settings: Settings, configs) -> list[bench_paper.Case]:
    """The fault experiment's runs in ``configs``, as ``tandem bench paper`` has them."""
    return bench_paper.cases(settings.fault, ["fault"], configs)


def estimate_s(settings: Settings, experiments, configs) -> float:
    """A guess of the invocation's wall time on 2 cores."""
    total = 0.0
    if "restore" in experiments:
        total += len(settings.sizes) * (settings.duration_s + bench_paper.OVERHEAD_S + 2)
    if "fault" in experiments:
        total += sum(bench_paper.estimate_s(c) for c in fault_cases(settings, configs))
    return total


def failures(restore_rows: list[bench.RecoveryRow], fault_rows: list[bench_paper.Row]) -> list[str]:
    """What makes the run fail: a restore row that lost or repeated rows, whose digests
    differed or in which nothing was rebuilt; a fault row that failed as
    :func:`tandem.bench_paper.failures` says. Never timings."""
    out = []
    for r in restore_rows:
        where = f"restore {r.state_mb:g} MiB"
        if r.lost or r.duplicates:
            out.append(f"{where}: lost {r.lost}, duplicates {r.duplicates}")
        if not r.digests_match:
            out.append(f"{where}: the replicas' output digests differed")
        if not r.rebuilt:
            out.append(f"{where}: no replica was rebuilt after the kill")
    if fault_rows:
        out += bench_paper.failures(fault_rows, ["fault"])
    return out


def restore_table(rows: list[bench.RecoveryRow]) -> list[str]:
    """The restore rows as the lines of a Markdown section."""
    r0 = rows[0]
    out = [
        "### Restoring r against state size",
        "",
        f"{r0.rate:,} ev/s, r = 2, a keyed task of 2 partitions; the replica group holding "
        f"`state[0]` replica 0 SIGKILLed at {r0.kill_at_s:g} s and rebuilt from its twins. "
        "restore: from the kill to the rebuilt replicas receiving their input. p99 before: "
        "median per-second p99 before the kill; during: the worst second from the kill "
        "until 2 s after the rebuild.",
        "",
        "| state per partition | restore ms | rebuilt | p99 before | p99 during | ratio "
        "| longest gap | lost | dup | digests |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    cell = bench_paper._cell
    for r in rows:
        cells = [
            f"{r.state_mb:g} MiB",
            cell(r.restore_ms, 0),
            cell(r.rebuilt),
            cell(r.p99_before_ms),
            cell(r.p99_during_ms),
            cell(r.during_vs_before, 2, "x"),
            cell(r.max_gap_ms, 0),
            cell(r.lost),
            cell(r.duplicates),
            "match" if r.digests_match else "DIFFER",
        ]
        out.append("| " + " | ".join(cells) + " |")
    return out


def markdown(
    restore_rows: list[bench.RecoveryRow], fault_rows: list[bench_paper.Row], meta: dict
) -> str:
    """The report: the restore table, then the fault experiment's (``tandem bench
    paper``'s table for it)."""
    out = [bench_paper.headline(meta)]
    if restore_rows:
        out += ["", *restore_table(restore_rows)]
    if fault_rows:
        out += ["", bench_paper.LEGEND, "Downtime: the longest gap between two outputs."]
        out += ["", *bench_paper.experiment_table(fault_rows, "fault")]
    return "\n".join(out)


def recovery(
    settings: Settings,
    experiments=EXPERIMENTS,
    configs=FAULT_CONFIGS,
    kazoo: td.KazooConfig | None = None,
    json_path: str | os.PathLike | None = "out/recovery.json",
    plot_path: str | os.PathLike | None = "out/recovery_fault_p99.png",
    command: str = "tandem bench recovery",
    log=None,
) -> dict:
    """Run ``experiments`` (``fault`` in ``configs``), write the JSON document to
    ``json_path`` and the fault rows' per-second p99 over time (the kill marked) to
    ``plot_path``, and return the document: ``restore_rows``, ``fault_rows``, the report
    as ``markdown``, ``figures`` written and ``failures`` (see :func:`failures`)."""
    log = log or sys.stderr
    experiments, configs = tuple(experiments), tuple(configs)
    check_selection(experiments, configs)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    t = time.monotonic()
    restore_rows: list[bench.RecoveryRow] = []
    if "restore" in experiments:
        restore_rows = bench.recovery(
            sizes=settings.sizes,
            rate=settings.rate,
            duration=settings.duration_s,
            kill_at=settings.kill_at_s,
            log=log,
        )
    fault_rows: list[bench_paper.Row] = []
    if "fault" in experiments:
        fault_rows = bench_paper.run_all(fault_cases(settings, configs), kazoo, log)
        bench_paper.add_ratios(fault_rows)
    meta = bench_paper.run_meta(started, command, time.monotonic() - t)
    doc = {
        "experiment": "recovery",
        **meta,
        "settings": asdict(settings),
        "experiments": list(experiments),
        "configs": list(configs) if "fault" in experiments else [],
        "restore_rows": [asdict(r) for r in restore_rows],
        "fault_rows": [asdict(r) for r in fault_rows],
        "failures": failures(restore_rows, fault_rows),
        "figures": [],
    }
    if plot_path and any(r.status == "ok" for r in fault_rows) and bench_paper.can_plot(log):
        os.makedirs(os.path.dirname(os.path.abspath(plot_path)), exist_ok=True)
        bench_paper.plot_over_time(fault_rows, "fault", str(plot_path))
        doc["figures"].append(str(plot_path))
    doc["markdown"] = markdown(restore_rows, fault_rows, meta)
    if json_path:
        import json

        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=2)
    return doc
