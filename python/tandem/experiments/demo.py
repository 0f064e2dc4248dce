"""The demo job behind ``tandem demo``: a replicated pipeline that survives a SIGKILL.

``source (2 partitions) → enrich (map) → count (key_by + stateful process) → alert (filter)
→ sink``, every task partition actively replicated. Halfway through, one replica of the
stateful task is killed; the summary shows what the sink saw: nothing lost, nothing
duplicated, no gap, and replicas whose outputs agreed cycle after cycle.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

import tandem as td


def enrich(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Adds a ``bucket`` column (key modulo 16) — a stand-in for a lookup."""
    return batch.append_column("bucket", pc.bit_wise_and(batch.column("key"), 15))


def keep_all(batch: pa.RecordBatch) -> pa.Array:
    """Keeps every row whose running count is positive (all of them): the stage is there
    to make the pipeline three tasks long, as in the paper's fault experiment."""
    return pc.greater(batch.column("count"), 0)


def build(
    rate: int = 5_000,
    replication: int = 2,
    ordering: str = "liverobin",
    heartbeat_ms: float = 10.0,
    buffer_timeout_ms: float = 5.0,
    sink: td.sinks.Sink | None = None,
    kazoo: td.KazooConfig | None = None,
    restore: bool = False,
    sink_replication: int | None = None,
    checkpoint_ms: float | None = None,
    checkpoint_dir: str | None = None,
) -> td.Job:
    """The demo job. Under ``ordering="none"`` (the unordered baseline, whose replicas are
    expected to diverge) divergence is logged and shown in the summary instead of stopping
    the run. ``checkpoint_dir``: durable checkpoints there every ``checkpoint_ms``."""
    job = td.Job(
        "demo",
        replication=replication,
        ordering=ordering,
        heartbeat_ms=heartbeat_ms,
        buffer_timeout_ms=buffer_timeout_ms,
        kazoo=kazoo,
        on_divergence="log" if ordering == "none" else "fail",
        restore=restore,
        checkpoint_ms=checkpoint_ms,
        checkpoint_dir=checkpoint_dir,
    )
    events = job.source(td.sources.Synthetic(rate=rate, keys=1_000, seed=7), parallelism=2)
    counted = (
        events.map(enrich, parallelism=2, name="enrich")
        .key_by("key")
        .process(td.CountPerKey(), parallelism=2, name="count")
    )
    counted.filter(keep_all, parallelism=2, name="alert").sink(
        sink or td.sinks.Collect(), replication=sink_replication
    )
    return job


def plot(result: td.Result, path: str, title: str = "tandem demo") -> None:
    """Per-second p99 latency over time, faults marked, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = result.per_second_p99_ms
    fig, ax = plt.subplots(figsize=(8, 3.5), dpi=120)
    xs = [s for s, v in enumerate(series) if v is not None]
    ax.plot(xs, [series[s] for s in xs], marker="o", markersize=3, label="p99 latency")
    restored = sorted({r["restored_s"] for r in result.restored_replicas})
    # Many events (td.Chaos): a legend instead of a label at every line.
    labelled = len(result.faults) + len(restored) <= 6
    for i, f in enumerate(result.faults):
        at = f.get("injected_at", f.get("at"))
        ax.axvline(
            at,
            color="crimson",
            linestyle="--",
            linewidth=1,
            label=None if labelled or i else "SIGKILL (a worker)",
        )
        if not labelled:
            continue
        signal = "SIGSTOP" if f.get("kind") == "pause" else "SIGKILL"
        if "task" in f:
            victim = f"r{f.get('victim', f['replica'])}"
            if isinstance(f["replica"], str):
                victim = f"{f['replica']} ({victim})"
            what = f"{signal} {f['task']}[{f['partition']}] {victim}"
        else:  # a whole worker (td.KillWorker, td.Chaos)
            what = f"{signal} worker {f['worker']}"
        ax.annotate(
            what,
            (at, ax.get_ylim()[1]),
            xytext=(4, -12),
            textcoords="offset points",
            color="crimson",
            fontsize=8,
        )
    for i, at in enumerate(restored):
        ax.axvline(
            at,
            color="seagreen",
            linestyle=":",
            linewidth=1,
            label=None if labelled or i else "r restored",
        )
        if not labelled:
            continue
        ax.annotate(
            "r restored",
            (at, ax.get_ylim()[1]),
            xytext=(4, -24),
            textcoords="offset points",
            color="seagreen",
            fontsize=8,
        )
    if not labelled:
        ax.legend(loc="upper left", fontsize=8)
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("p99 latency (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title(
        f"{title}: lost {result.lost}, duplicates {result.duplicates}, "
        f"digests {'match' if result.digests_match else 'DIFFER'}",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
