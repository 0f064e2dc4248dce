"""``tandem bench failover``: the paper's fault experiment (§VII) on its own.

3 map tasks of 2 partitions (MiB1 of length 3), 5,000 ev/s, one replica of the middle
task SIGKILLed halfway; per-second p99 over time and the downtime (the longest gap
between two outputs), for the passive baseline (one replica, checkpoints every
:data:`~tandem.experiments.workloads.PASSIVE_CHECKPOINT_MS`, rolled back after the kill),
LiveRobin, KaZoo with the leader killed and KaZoo with a follower killed; the peak after
the kill as a ratio to the same seconds of a fault-free run of the same configuration in
the same invocation. Every run is checked against the reference executor, row by row.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import numpy as np

import tandem as td
from tandem.experiments import common
from tandem.experiments.workloads import (
    PAPER_KAZOO_LEADER_PEAK_MS,
    PASSIVE_CHECKPOINT_MS,
    mib1_job,
)

HELP = (
    "the paper's fault experiment: passive, LiveRobin, KaZoo leader and follower kills "
    "(downtime, lost, duplicates, peak p99)"
)

FAILOVER_CASES = {
    "passive": ("passive", 0),
    "liverobin": ("liverobin", 0),
    "kazoo-leader": ("kazoo", "leader"),
    "kazoo-follower": ("kazoo", "follower"),
}


@dataclass
class FailoverRow:
    case: str
    victim: int
    p99_before_ms: float
    """Median of the per-second p99 over the seconds before the kill."""
    peak_after_ms: float
    """Highest per-second p99 from the kill to 5 s after it."""
    fault_free_peak_ms: float
    """Highest per-second p99 over the same seconds of the fault-free run of the same
    ordering, run in the same invocation just before the first fault case using it."""
    peak_ratio: float
    """``peak_after_ms / fault_free_peak_ms``: what the fault added to the worst second
    (1.0 = no spike beyond what the fault-free run shows)."""
    downtime_ms: float | None
    """The longest gap between two outputs of the faulty run (``Result.max_gap_ms``)."""
    lost: int
    duplicates: int
    digests_match: bool
    per_second_p99_ms: list


def _window(series: list, kill_at: float) -> list[float]:
    """The per-second p99 values from the kill's second to 5 s after it."""
    second = int(kill_at)
    return [v for v in series[second : second + 6] if v is not None]


def failover(
    rate: int = 5_000,
    duration: float = 100.0,
    kill_at: float = 50.0,
    cases=tuple(FAILOVER_CASES),
    kazoo: td.KazooConfig | None = None,
    log=None,
) -> list[FailoverRow]:
    """The paper's fault experiment (see the module documentation), each case in turn;
    each ordering also runs once without the fault, for the ratio of the peaks."""
    log = log or sys.stderr  # at call time: sys.stderr may have been replaced
    rows = []
    fault_free: dict[str, list] = {}
    for case in cases:
        ordering, replica = FAILOVER_CASES[case]
        # A Collect sink, so the run is checked against the reference (lost, duplicates).
        if ordering == "passive":
            job = mib1_job(
                3,
                1,
                "liverobin",
                rate,
                sink=td.sinks.Collect(),
                checkpoint_ms=PASSIVE_CHECKPOINT_MS,
            )
        else:
            job = mib1_job(3, 2, ordering, rate, kazoo, sink=td.sinks.Collect())
        if ordering not in fault_free:
            print(f"failover: {ordering}, no fault ...", file=log, flush=True)
            fault_free[ordering] = job.run(duration=duration, progress=False).per_second_p99_ms
        fault = td.Kill("map2", partition=0, replica=replica, at=kill_at)
        print(
            f"failover: {case}, kill map2[0] {replica} at {kill_at:g} s ...", file=log, flush=True
        )
        res = job.run(duration=duration, faults=[fault], progress=False)
        series = res.per_second_p99_ms
        before = [v for v in series[2 : int(kill_at)] if v is not None]
        after = _window(series, kill_at)
        calm = _window(fault_free[ordering], kill_at)
        peak = round(max(after), 1) if after else float("nan")
        calm_peak = round(max(calm), 1) if calm else float("nan")
        rows.append(
            FailoverRow(
                case,
                res.faults[0]["victim"],
                round(float(np.median(before)), 1) if before else float("nan"),
                peak,
                calm_peak,
                round(peak / calm_peak, 2) if calm_peak > 0 else float("nan"),
                res.max_gap_ms,
                res.lost,
                res.duplicates,
                res.digests_match,
                [None if v is None else round(v, 1) for v in series],
            )
        )
    return rows


def plot_failover(rows: list[FailoverRow], kill_at: float, path: str) -> None:
    """Per-second p99 of every failover case on one chart, the kill marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5), dpi=120)
    for row in rows:
        xs = [s for s, v in enumerate(row.per_second_p99_ms) if v is not None]
        ys = [row.per_second_p99_ms[s] for s in xs]
        ax.plot(xs, ys, marker="o", markersize=2, linewidth=1, label=row.case)
    ax.axvline(kill_at, color="crimson", linestyle="--", linewidth=1)
    ax.annotate(
        "SIGKILL map2[0]",
        (kill_at, 0),
        xytext=(4, 4),
        textcoords="offset points",
        color="crimson",
        fontsize=8,
    )
    ax.set_yscale("log")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("p99 latency per second (ms)")
    ax.set_title("failover: 3 tasks x 2 partitions, one replica of map2[0] killed", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_rate(p, 5_000, "the source's events per second (default 5000)")
    common.add_seconds(
        p, "--duration", 100.0, "every run's length; the kill at half of it (default 100)"
    )
    common.add_session_timeout(p)
    p.add_argument(
        "--plot",
        metavar="PATH",
        default="out/failover_p99.png",
        help="the per-second p99 of every case as a PNG (default out/failover_p99.png)",
    )
    common.add_json(p)


def main(args: argparse.Namespace) -> int:
    duration = args.duration
    kill_at = duration / 2
    with common.kazoo_services(True, args.session_timeout) as kazoo:
        rows = failover(rate=args.rate, duration=duration, kill_at=kill_at, kazoo=kazoo)
        out = {
            "experiment": "failover",
            "rate": args.rate,
            "duration_s": duration,
            "kill_at_s": kill_at,
            "session_timeout_s": args.session_timeout,
            "rows": [vars(r) for r in rows],
            "paper_kazoo_leader_peak_ms": PAPER_KAZOO_LEADER_PEAK_MS,
        }
        common.plot_to(args.plot, plot_failover, rows, kill_at)
        series = "per_second_p99_ms"
        print(common.table([{k: v for k, v in vars(r).items() if k != series} for r in rows]))
        common.write_json(args.json, out)
    return 0
