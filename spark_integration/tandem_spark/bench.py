"""``tandem bench spark``: tandem on Spark against tandem locally and against Spark's own
Structured Streaming, on the same workload in the same run.

The workload is the paper's MiB1 of length 3 (source → 3 identity maps → sink, two
partitions per task, heartbeat 10 ms, buffer timeout 5 ms) at ``rate`` events per second:

1. tandem, local engine (worker processes hosting the replicas), fault-free;
2. tandem, Spark engine (one Spark task per worker), fault-free — the target is latency
   within 1.3x of (1);
3. tandem, Spark engine, the worker hosting a replica of ``map2`` SIGKILLed (with every
   replica it hosts) halfway through the measured window: downtime (the longest gap
   between outputs), lost and duplicated events against the reference executor;
4. Structured Streaming running the same operators (:mod:`tandem_spark.structured`),
   fault-free and with its driver killed and restarted from the checkpoint.

Every tandem run collects its output, so lost and duplicates are counted for each; latency
is sink receive time minus source release time on one clock, after ``warmup`` seconds.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import tandem as td
from tandem.experiments import common
from tandem.experiments.workloads import mib1_job

HELP = (
    "MiB1 length 3 on the local engine, the Spark engine (with a replica kill) and Spark "
    "Structured Streaming (with a driver kill)"
)
LENGTH = 3
KILLED = ("map2", 0, 0)
SS_FIELDS = ("p50_ms", "p99_ms", "max_gap_ms", "events_out", "lost", "duplicates")
"""What the table shows of a Structured Streaming run (the JSON keeps all of it)."""


def _row(config: str, res: td.Result) -> dict[str, Any]:
    return {
        "config": config,
        "p50_ms": round(res.p50_ms, 2),
        "p99_ms": round(res.p99_ms, 2),
        "max_gap_ms": round(res.max_gap_ms, 1),
        "events_out": res.events_out,
        "lost": res.lost,
        "duplicates": res.duplicates,
        "digests_match": res.digests_match,
    }


def structured_streaming(**kwargs: Any) -> dict[str, Any]:
    """One run of MiB1 on Spark Structured Streaming:
    :func:`tandem_spark.structured.run_baseline` with ``kwargs`` (``rate``, ``duration``,
    ``warmup``, ``maps``, ``kill_driver_at``, ...). ``tandem bench paper`` runs its ``sss``
    rows through this, as :func:`run` runs its own."""
    from tandem_spark import structured

    return structured.run_baseline(**kwargs)


def run(
    rate: int = 5_000,
    warmup: float = 10.0,
    measure: float = 20.0,
    master: str | None = None,
    log=sys.stderr,
) -> dict[str, Any]:
    """Every configuration of the module documentation; a JSON-ready dict."""
    from tandem_spark.engine import SparkEngine
    from tandem_spark.session import local_session

    duration = warmup + measure

    def job() -> td.Job:
        return mib1_job(LENGTH, 2, "liverobin", rate, sink=td.sinks.Collect())

    rows = []
    print(f"bench spark: MiB1 length {LENGTH}, {rate} ev/s, local engine ...", file=log)
    rows.append(_row("tandem local", job().run(duration, warmup=warmup, progress=False)))

    spark = local_session(job(), master)
    try:
        engine = SparkEngine(spark)
        print("bench spark: Spark engine ...", file=log)
        rows.append(_row("tandem spark", job().run(duration, warmup=warmup, engine=engine)))
        task, partition, replica = KILLED
        at = warmup + measure / 2
        kill = td.Kill(task, partition=partition, replica=replica, at=at)
        print(f"bench spark: Spark engine, SIGKILL {task}[{partition}] r{replica} ...", file=log)
        res = job().run(duration, faults=[kill], warmup=warmup, engine=engine)
        rows.append(
            {
                **_row(f"tandem spark, kill {task}[{partition}] r{replica} @{at:g}s", res),
                "downtime_s": round(res.max_gap_ms / 1000, 3),
                "retried_tasks": len(engine.last_run.retried_slots()),
            }
        )
    finally:
        spark.stop()

    for kill_at in (None, at):
        what = "fault-free" if kill_at is None else f"driver kill @{kill_at:g}s"
        print(f"bench spark: Structured Streaming, {what} ...", file=log)
        ss = structured_streaming(
            rate=rate, duration=duration, kill_driver_at=kill_at, warmup=warmup, maps=LENGTH
        )
        row = {"config": f"structured streaming, {what}"}
        row |= {k: ss[k] for k in SS_FIELDS}
        rows.append(row | {"downtime_s": ss["downtime_s"], "details": ss})

    local, spark_row = rows[0], rows[1]
    return {
        "experiment": "spark",
        "workload": {"mib1_length": LENGTH, "rate": rate, "warmup": warmup, "measure": measure},
        "spark_over_local": {
            "p50": round(spark_row["p50_ms"] / local["p50_ms"], 2),
            "p99": round(spark_row["p99_ms"] / local["p99_ms"], 2),
        },
        "rows": rows,
    }


def table(out: dict[str, Any]) -> str:
    """The rows as an aligned text table (columns: the union of the rows' keys)."""
    cols = list(dict.fromkeys(k for r in out["rows"] for k in r if k != "details"))
    width = max(len(r["config"]) for r in out["rows"])
    lines = [f"{cols[0]:<{width}}  " + "  ".join(f"{c:>13}" for c in cols[1:])]
    for r in out["rows"]:
        cells = "  ".join(f"{r.get(c, '-')!s:>13}" for c in cols[1:])
        lines.append(f"{r['config']:<{width}}  {cells}")
    ratio = out["spark_over_local"]
    lines.append(f"Spark engine / local engine: p50 {ratio['p50']}x, p99 {ratio['p99']}x")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_rate(p, 5_000, "the source's events per second (default 5000)")
    common.add_seconds(p, "--warmup", 30.0, "left out of latency at every run's start (default 30)")
    common.add_seconds(
        p, "--measure", 30.0, "measured after the warm-up; the kills at half of it (default 30)"
    )
    p.add_argument(
        "--master", metavar="URL", help="Spark master (default: local[N,8], N = workers + spares)"
    )
    common.add_json(p)


def main(args: argparse.Namespace) -> int:
    """``tandem bench spark``: :func:`run` with the flags, its :func:`table` printed."""
    out = run(rate=args.rate, warmup=args.warmup, measure=args.measure, master=args.master)
    print(table(out))
    common.write_json(args.json, out)
    return 0
