"""End-to-end experiments of the paper's evaluation (§VII), on the local engine.

* ``mib1`` — MiB1: a pipeline of 1 to 4 identity map tasks of 2 partitions each at 5,000 ev/s,
  heartbeat 10 ms, buffer timeout 5 ms; latency measured after a warm-up; configurations
  side by side in the same run: no replication, ``none``, ``liverobin``, ``kazoo``. As in
  the paper, every task partition reads both upstream partitions (the stream is keyed
  between tasks), so the replicas of each partition have two inputs to order.
* ``failover`` — the paper's fault experiment: 3 map tasks of 2 partitions, 5,000 ev/s,
  one replica of the middle task SIGKILLed halfway; per-second p99 over time, for
  LiveRobin, KaZoo with the leader killed and KaZoo with a follower killed.
* ``throughput`` — the highest rate a replicated length-1 pipeline (forward edges) sustains
  without its latency growing: rates are tried in increasing order until the p99 of the
  last third of the run exceeds ``max(10 x the first rate's p99, 250 ms)`` or the run
  falls behind.

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
    "kazoo": {"replication": 2, "ordering": "kazoo"},
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
    kazoo: td.KazooConfig | None = None,
    sink: td.sinks.Sink | None = None,
    keyed: bool = True,
) -> td.Job:
    """MiB1 of length ``length``; the sink records latency unless another is given (a
    ``td.sinks.Collect()`` makes the output comparable with the reference's). ``keyed``:
    each task reads every upstream partition (keyed by ``key``), else partition p feeds
    partition p only (forward edges: one input channel each, nothing to order)."""
    job = td.Job(
        f"mib1-{length}",
        replication=replication,
        ordering=ordering,
        heartbeat_ms=10,
        buffer_timeout_ms=5,
        kazoo=kazoo if ordering == "kazoo" else None,
        # The unordered baseline diverges by design: measure it rather than stop it.
        on_divergence="log" if ordering == "none" else "fail",
    )
    stream = job.source(td.sources.Synthetic(rate=rate, keys=1_000, seed=1), parallelism=2)
    for i in range(length):
        stream = stream.key_by("key") if keyed else stream
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
    kazoo: td.KazooConfig | None = None,
) -> list[Row]:
    rows = []
    for length in lengths:
        for config in configs:
            opts = CONFIGS[config]
            job = mib1_job(length, opts["replication"], opts["ordering"], rate, kazoo)
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
        job = mib1_job(1, 2, "liverobin", rate, keyed=False)
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


FAILOVER_CASES = {
    "liverobin": ("liverobin", 0),
    "kazoo-leader": ("kazoo", "leader"),
    "kazoo-follower": ("kazoo", "follower"),
}
PAPER_KAZOO_LEADER_PEAK_MS = (650, 1000)
"""The paper's per-second p99 peak after a KaZoo leader kill (Fig. 14)."""


@dataclass
class FailoverRow:
    case: str
    victim: int
    p99_before_ms: float
    """Median of the per-second p99 over the seconds before the kill."""
    peak_after_ms: float
    """Highest per-second p99 from the kill to 5 s after it."""
    lost: int | None
    duplicates: int | None
    digests_match: bool
    per_second_p99_ms: list


def failover(
    rate: int = 5_000,
    duration: float = 100.0,
    kill_at: float = 50.0,
    cases=tuple(FAILOVER_CASES),
    kazoo: td.KazooConfig | None = None,
    log=sys.stderr,
) -> list[FailoverRow]:
    """The paper's fault experiment (see the module documentation), each case in turn."""
    import numpy as np

    rows = []
    for case in cases:
        ordering, replica = FAILOVER_CASES[case]
        # A Collect sink, so the run is checked against the reference (lost, duplicates).
        job = mib1_job(3, 2, ordering, rate, kazoo, sink=td.sinks.Collect())
        fault = td.Kill("map2", partition=0, replica=replica, at=kill_at)
        print(
            f"failover: {case}, kill map2[0] {replica} at {kill_at:g} s ...", file=log, flush=True
        )
        res = job.run(duration=duration, faults=[fault], progress=False)
        series = res.per_second_p99_ms
        second = int(kill_at)
        before = [v for v in series[2:second] if v is not None]
        after = [v for v in series[second : second + 6] if v is not None]
        rows.append(
            FailoverRow(
                case,
                res.faults[0]["victim"],
                round(float(np.median(before)), 1) if before else float("nan"),
                round(max(after), 1) if after else float("nan"),
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


def table(rows: list) -> str:
    """Rows (dataclasses or dicts) as aligned text."""
    dicts = [r if isinstance(r, dict) else asdict(r) for r in rows]
    cols = list(dicts[0]) if dicts else []
    lines = ["  ".join(f"{c:>14}" for c in cols)]
    lines += ["  ".join(f"{v!s:>14}" for v in d.values()) for d in dicts]
    return "\n".join(lines)
