"""End-to-end experiments of the paper's evaluation (§VII), on the local engine.

* ``mib1`` — MiB1: a pipeline of 1 to 4 identity map tasks of 2 partitions each at 5,000 ev/s,
  heartbeat 10 ms, buffer timeout 5 ms; latency measured after a warm-up; configurations
  side by side in the same run: no replication, ``none``, ``liverobin``.
* ``throughput`` — the highest rate a replicated length-1 pipeline sustains without its
  latency growing: rates are tried in increasing order until the p99 of the last third of
  the run exceeds ``max(10 x the first rate's p99, 250 ms)`` or the run falls behind.

Each writes rows of JSON; the CLI (``tandem bench ...``) prints them as a table.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass

import pyarrow as pa

import tandem as td

CONFIGS = {
    "replication=1": {"replication": 1, "ordering": "liverobin"},
    "none": {"replication": 2, "ordering": "none"},
    "liverobin": {"replication": 2, "ordering": "liverobin"},
}

PAPER_LIVEROBIN = {1: (7.6, 21.5), 2: (14.0, 34.5), 3: (20.9, 41.4), 4: (27.7, 51.4)}
"""The paper's MiB1 LiveRobin median/p99 in ms by pipeline length (37 servers)."""


def identity(batch: pa.RecordBatch) -> pa.RecordBatch:
    """The MiB1 operator."""
    return batch


def mib1_job(
    length: int,
    replication: int,
    ordering: str,
    rate: int = 5_000,
    sink: td.sinks.Sink | None = None,
) -> td.Job:
    """MiB1 of length ``length``; the sink records latency unless another is given (a
    ``td.sinks.Collect()`` makes the output comparable with the reference's)."""
    job = td.Job(
        f"mib1-{length}",
        replication=replication,
        ordering=ordering,
        heartbeat_ms=10,
        buffer_timeout_ms=5,
    )
    stream = job.source(td.sources.Synthetic(rate=rate, keys=1_000, seed=1), parallelism=2)
    for i in range(length):
        stream = stream.map(identity, parallelism=2, name=f"map{i + 1}")
    stream.sink(sink or td.sinks.Latency(), parallelism=1)
    return job


@dataclass
class Row:
    config: str
    length: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    rate: int
    events_out: int
    lost: int | None  # None: the benchmarks skip the reference check
    duplicates: int | None
    rss_mb_max: float


def _row(config: str, length: int, rate: int, res: td.Result) -> Row:
    rss = max(res.rss_mb.values(), default=0.0)
    return Row(
        config,
        length,
        round(res.p50_ms, 2),
        round(res.p99_ms, 2),
        round(res.max_ms, 2),
        rate,
        res.events_out,
        res.lost,
        res.duplicates,
        round(rss, 1),
    )


def mib1(
    lengths=(1, 2, 3, 4),
    configs=tuple(CONFIGS),
    rate: int = 5_000,
    warmup: float = 30.0,
    measure: float = 30.0,
    log=sys.stderr,
) -> list[Row]:
    rows = []
    for length in lengths:
        for config in configs:
            opts = CONFIGS[config]
            job = mib1_job(length, opts["replication"], opts["ordering"], rate)
            print(f"mib1: length {length}, {config} ...", file=log, flush=True)
            res = job.run(duration=warmup + measure, warmup=warmup, progress=False, check=False)
            rows.append(_row(config, length, rate, res))
    return rows


def throughput(
    rates=(25_000, 100_000, 200_000, 400_000, 700_000, 1_000_000, 1_500_000),
    duration: float = 10.0,
    log=sys.stderr,
) -> tuple[int, list[Row]]:
    """The highest sustained rate of a replicated (r=2, LiveRobin) length-1 pipeline."""
    rows, best, limit = [], 0, None
    for rate in rates:
        job = mib1_job(1, 2, "liverobin", rate)
        print(f"throughput: {rate} ev/s ...", file=log, flush=True)
        res = job.run(duration=duration, warmup=duration * 2 / 3, progress=False, check=False)
        row = _row("liverobin", 1, rate, res)
        rows.append(row)
        limit = limit or max(10 * row.p99_ms, 250.0)
        behind = res.events_out < res.events_in
        if row.p99_ms > limit or behind:
            break
        best = rate
    return best, rows


def table(rows: list[Row]) -> str:
    cols = list(asdict(rows[0])) if rows else []
    lines = ["  ".join(f"{c:>13}" for c in cols)]
    lines += ["  ".join(f"{v!s:>13}" for v in asdict(r).values()) for r in rows]
    return "\n".join(lines)
