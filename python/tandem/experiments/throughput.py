"""``tandem bench throughput``: the highest rate a replicated length-1 pipeline (r = 2
LiveRobin, forward edges) sustains without its latency growing.

Rates are tried in increasing order until the p99 of the last third of the run exceeds
``max(10 x the first rate's p99, 250 ms)`` or the run falls behind. Every row's output is
checked by a sequence check at the sink
(:class:`~tandem.experiments.workloads.SequenceSink`: every source row exactly once).
"""

from __future__ import annotations

import argparse
import sys

from tandem.experiments import common
from tandem.experiments.workloads import Row, SequenceSink, latency_row, mib1_job

HELP = "the highest rate a replicated pipeline sustains without its latency growing"


def throughput(
    rates=(25_000, 100_000, 200_000, 400_000, 700_000, 1_000_000, 1_500_000),
    duration: float = 10.0,
    log=None,
) -> tuple[int, list[Row]]:
    """The highest sustained rate of a replicated (r=2, LiveRobin) length-1 pipeline."""
    log = log or sys.stderr  # at call time: sys.stderr may have been replaced
    rows, best, limit = [], 0, None
    for rate in rates:
        job = mib1_job(1, 2, "liverobin", rate, sink=SequenceSink(), keyed=False)
        print(f"throughput: {rate} ev/s ...", file=log, flush=True)
        res = job.run(duration=duration, warmup=duration * 2 / 3, progress=False, check=False)
        row = latency_row("liverobin", 1, rate, res)
        rows.append(row)
        limit = limit or max(10 * row.p99_ms, 250.0)
        behind = res.events_out < res.events_in
        if row.p99_ms > limit or behind:
            break
        best = rate
    return best, rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_seconds(
        p, "--measure", 30.0, "each rate's run length; its last third is measured (default 30)"
    )
    common.add_json(p)


def main(args: argparse.Namespace) -> int:
    best, rows = throughput(duration=args.measure)
    print(f"highest sustained rate (r=2, liverobin, length 1): {best} ev/s")
    print(common.table(rows))
    common.write_json(
        args.json,
        {
            "experiment": "throughput",
            "max_sustained_ev_per_s": best,
            "rows": [vars(r) for r in rows],
        },
    )
    return 0
