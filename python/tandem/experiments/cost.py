"""``tandem bench cost``: what replication costs the machine.

The demo job and MiB1 of length 3, each with r = 1, r = 2 LiveRobin, r = 2 KaZoo and r = 3
LiveRobin, under load and again at an idle rate; per run the CPU-seconds of the job's
processes (exact: ``getrusage`` of the reaped children), per million events and as a share
of a core, ZooKeeper's and Kafka's CPU for KaZoo, peak memory, time to the first output,
and ratios against r = 1 of the same run, next to the targets of :data:`COST_TARGETS`.
Every run is checked against the reference executor, row by row.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import numpy as np

import tandem as td
from tandem.experiments import common, demo
from tandem.experiments.workloads import mib1_job, named

HELP = (
    "CPU, memory and time to first output of the demo and MiB1 length 3 at r = 1, 2 "
    "(LiveRobin, KaZoo) and 3, under load and idle"
)

COST_CONFIGS = named({"r1": "r1", "r2": "liverobin", "r2-kazoo": "kazoo", "r3": "r3"})
COST_CONFIGS["r2-single-sink"] = {**COST_CONFIGS["r2"], "sink_replication": 1}
"""``r2-single-sink``: r2 with the sink unreplicated, what replicated sinks cost beside."""
COST_CONFIGS["r2-checkpoints"] = {**COST_CONFIGS["r2"], "durable_ms": 1000}
"""``r2-checkpoints``: r2 writing a durable checkpoint every second (``Job(checkpoint_ms=1000,
checkpoint_dir=...)``, into a temporary directory), what they cost beside."""
COST_WORKLOADS = ("demo", "mib1", "kafka")
DEFAULT_WORKLOADS = ("demo", "mib1")
"""``kafka``: MiB1 of length 3 into a Kafka sink (the broker `tandem services` runs, started
for the command if it is not running): with ``r2`` beside ``r2-single-sink``, what a
replicated Kafka sink's standby twins cost beside a single, restartable sink."""

COST_TARGETS = {
    "r2_cpu_ratio": 2.3,
    "r2_kazoo_cpu_ratio": 3.0,
    "idle_core_share": 0.10,
    "rss_total_mb": 1024.0,
    "first_output_s": 3.0,
}
"""What the runtime should cost (the targets of the runtime rebuild): CPU of r = 2 LiveRobin
and of r = 2 KaZoo as multiples of r = 1's on the same workload; an idle replicated demo's
CPU as a share of one core (steady state, after the warm-up); the peak resident memory of
a run's processes together; seconds from ``run()`` to the first output."""


@dataclass
class CostRow:
    """One run of ``cost``: a workload in a configuration at a rate (``phase`` ``load`` or
    ``idle``). CPU figures are user + system CPU-seconds of the job's processes (the
    replicas and sinks): ``cpu_s`` from their start to their exit, ``steady_*`` in the
    steady state only, from ``warmup_s`` after t0 to the end of the stream (start-up and
    shutdown left out), over the events released in that span; ``core_share`` is
    CPU-seconds per wall-second (1.0 = one core busy); ``coordinator_cpu_s`` the calling
    process's own CPU while it ran the replicas.
    ``zookeeper_cpu_s`` / ``kafka_cpu_s``: CPU the servers used during the run (KaZoo
    rows; topic set-up and clean-up included), None elsewhere or when their process was
    not found. Ratios compare with the ``r1`` row of the same workload and phase of the
    same invocation (None without one)."""

    workload: str
    config: str
    phase: str
    replication: int
    ordering: str
    rate: int
    duration_s: float
    warmup_s: float
    processes: int
    events_in: int
    events_out: int
    steady_events: int
    p50_ms: float | None
    p99_ms: float | None
    lost: int
    duplicates: int
    digests_match: bool
    wall_s: float
    cpu_s: float
    cpu_s_per_m_events: float
    core_share: float
    steady_wall_s: float
    steady_cpu_s: float
    steady_cpu_s_per_m_events: float
    steady_core_share: float
    coordinator_cpu_s: float
    rss_mb_total: float
    rss_mb_max: float
    first_output_s: float | None
    zookeeper_cpu_s: float | None = None
    kafka_cpu_s: float | None = None
    cpu_ratio_vs_r1: float | None = None
    steady_cpu_ratio_vs_r1: float | None = None
    cpu_with_services_ratio_vs_r1: float | None = None
    p99_ratio_vs_r1: float | None = None

    @property
    def services_cpu_s(self) -> float | None:
        """ZooKeeper's and Kafka's CPU together (None unless both were measured)."""
        if self.zookeeper_cpu_s is None or self.kafka_cpu_s is None:
            return None
        return self.zookeeper_cpu_s + self.kafka_cpu_s


def cost_job(
    workload: str,
    config: str,
    rate: int,
    kazoo: td.KazooConfig | None,
    kafka_bootstrap: str | None = None,
) -> td.Job:
    """The job of one cost run: the demo (:func:`tandem.experiments.demo.build`, no fault)
    or MiB1 of length 3 (keyed), each ending in a Collect sink so that the run is checked
    row by row against the reference — or, ``kafka``, MiB1 into a Kafka sink on a topic
    of its own at ``kafka_bootstrap`` (checked by reading the topic back)."""
    opts = dict(COST_CONFIGS[config])
    zoo = kazoo if opts["ordering"] == "kazoo" else None
    durable_ms = opts.pop("durable_ms", None)
    if durable_ms is not None:  # removed after the run (_cost_row)
        opts["checkpoint_ms"] = durable_ms
        opts["checkpoint_dir"] = tempfile.mkdtemp(prefix="tandem-cost-checkpoints-")
    if workload == "demo":
        return demo.build(rate=rate, **opts, kazoo=zoo)
    sink: td.sinks.Sink = td.sinks.Collect()
    if workload == "kafka":
        from tandem.testing import new_topic

        if kafka_bootstrap is None:
            raise td.ConfigError("cost: the kafka workload needs a broker (kafka_bootstrap=)")
        sink = td.sinks.Kafka(new_topic(kafka_bootstrap, 2, "cost"), kafka_bootstrap)
    return mib1_job(
        3,
        opts["replication"],
        opts["ordering"],
        rate,
        zoo,
        sink=sink,
        sink_replication=opts.get("sink_replication"),
        checkpoint_ms=opts.get("checkpoint_ms"),
        checkpoint_dir=opts.get("checkpoint_dir"),
    )


def check_cost_options(
    configs, workloads, rate: int, duration: float, warmup: float, idle_rate: int, idle_duration
) -> None:
    """Raise ConfigError for options ``cost`` cannot run with, before anything runs."""
    unknown = sorted(set(configs) - set(COST_CONFIGS))
    if unknown or not configs:
        raise td.ConfigError(
            f"cost: unknown configurations {unknown or '(none given)'}; choose from "
            f"{', '.join(COST_CONFIGS)}"
        )
    unknown = sorted(set(workloads) - set(COST_WORKLOADS))
    if unknown or not workloads:
        raise td.ConfigError(
            f"cost: unknown workloads {unknown or '(none given)'}; choose from "
            f"{', '.join(COST_WORKLOADS)}"
        )
    for what, value in (("rate", rate), ("idle rate", idle_rate)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise td.ConfigError(f"cost: the {what} must be an int >= 1 ev/s, got {value!r}")
    if not duration > 0 or not idle_duration > 0:
        raise td.ConfigError(
            f"cost: durations must be > 0 s, got {duration} (load) and {idle_duration} (idle)"
        )
    if not 0 <= warmup < duration:
        raise td.ConfigError(
            f"cost: the warm-up ({warmup} s) must be >= 0 and shorter than the run "
            f"({duration} s): latency and steady-state CPU are measured after it"
        )


def _per_million(cpu: float, events: int) -> float:
    return round(cpu / events * 1e6, 3) if events else float("nan")


def _cost_row(
    workload: str,
    config: str,
    phase: str,
    rate: int,
    duration: float,
    warmup: float,
    kazoo: td.KazooConfig | None,
    log,
    kafka_bootstrap: str | None = None,
) -> CostRow:
    """Run one configuration once and measure it."""
    from tandem.engines.local import process_cpu_s

    opts = COST_CONFIGS[config]
    job = cost_job(workload, config, rate, kazoo, kafka_bootstrap)
    plan = job.plan()
    steady_events = sum(
        plan.source_rows(t.id, p, duration) - plan.source_rows(t.id, p, warmup)
        for t in plan.sources()
        for p in range(t.parallelism)
    )
    pids = (
        common.service_pids(kazoo or td.KazooConfig(), log) if opts["ordering"] == "kazoo" else {}
    )
    before = {name: process_cpu_s(pid) for name, pid in pids.items()}
    try:
        res = job.run(duration=duration, warmup=warmup, progress=False, check=True)
    finally:
        if job.checkpoint_dir is not None:
            shutil.rmtree(job.checkpoint_dir, ignore_errors=True)
    used = {}
    for name, pid in pids.items():
        now = process_cpu_s(pid)
        used[name] = None if now is None or before[name] is None else round(now - before[name], 3)
    if opts["ordering"] == "kazoo":
        missing = [n for n in ("zookeeper", "kafka") if used.get(n) is None]
        if missing:
            print(
                f"  (no CPU figure for {', '.join(missing)}: its process was not found)",
                file=log,
            )
    return CostRow(
        workload=workload,
        config=config,
        phase=phase,
        replication=opts["replication"],
        ordering=opts["ordering"],
        rate=rate,
        duration_s=duration,
        warmup_s=warmup,
        processes=res.processes,
        events_in=res.events_in,
        events_out=res.events_out,
        steady_events=steady_events,
        p50_ms=None if res.p50_ms is None else round(res.p50_ms, 2),
        p99_ms=None if res.p99_ms is None else round(res.p99_ms, 2),
        lost=res.lost,
        duplicates=res.duplicates,
        digests_match=res.digests_match,
        wall_s=round(res.wall_s, 3),
        cpu_s=round(res.cpu_s, 3),
        cpu_s_per_m_events=_per_million(res.cpu_s, res.events_in),
        core_share=round(res.cpu_s / res.wall_s, 4),
        steady_wall_s=round(res.steady_wall_s, 3),
        steady_cpu_s=round(res.steady_cpu_s, 3),
        steady_cpu_s_per_m_events=_per_million(res.steady_cpu_s, steady_events),
        steady_core_share=round(res.steady_cpu_s / res.steady_wall_s, 4),
        coordinator_cpu_s=round(res.coordinator_cpu_s, 3),
        rss_mb_total=round(sum(res.rss_mb.values()), 1),
        rss_mb_max=round(max(res.rss_mb.values(), default=0.0), 1),
        first_output_s=None if res.first_output_s is None else round(res.first_output_s, 3),
        zookeeper_cpu_s=used.get("zookeeper"),
        kafka_cpu_s=used.get("kafka"),
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 2)


def _add_ratios(rows: list[CostRow]) -> None:
    """Fill in every row's ratios against the r1 row of its workload and phase."""
    base = {(r.workload, r.phase): r for r in rows if r.config == "r1"}
    for r in rows:
        b = base.get((r.workload, r.phase))
        if b is None:
            continue
        r.cpu_ratio_vs_r1 = _ratio(r.cpu_s, b.cpu_s)
        r.steady_cpu_ratio_vs_r1 = _ratio(r.steady_cpu_s, b.steady_cpu_s)
        services = r.services_cpu_s
        if services is not None:
            r.cpu_with_services_ratio_vs_r1 = _ratio(r.cpu_s + services, b.cpu_s)
        r.p99_ratio_vs_r1 = _ratio(r.p99_ms, b.p99_ms)


@contextlib.contextmanager
def _spinning(on: bool):
    """While inside: a process spinning on one core, if ``on`` (killed on the way out)."""
    if not on:
        yield
        return
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        neighbour.kill()
        neighbour.wait()


def cost(
    configs=tuple(COST_CONFIGS),
    workloads=DEFAULT_WORKLOADS,
    rate: int = 5_000,
    duration: float = 15.0,
    warmup: float = 5.0,
    idle_rate: int = 10,
    idle_duration: float = 10.0,
    kazoo: td.KazooConfig | None = None,
    log=None,
    busy_neighbour: bool = False,
    kafka_bootstrap: str | None = None,
) -> list[CostRow]:
    """What replication costs: every workload in every configuration at ``rate`` for
    ``duration`` seconds, then all again at ``idle_rate`` for ``idle_duration`` seconds
    (warm-up: ``warmup``, at most half the idle run there); every run checked against the
    reference. Runs one after the other, so that they do not compete for the machine.
    ``busy_neighbour``: a process spinning on one core runs beside every run (another job
    on a shared machine), so the ratios say what replication costs when a core is taken.
    Progress goes to ``log`` (default: stderr), a line as each run starts and ends."""
    log = log or sys.stderr
    configs, workloads = tuple(configs), tuple(workloads)
    check_cost_options(configs, workloads, rate, duration, warmup, idle_rate, idle_duration)
    phases = [
        ("load", rate, duration, warmup),
        ("idle", idle_rate, idle_duration, min(warmup, idle_duration / 2)),
    ]
    total = len(phases) * len(workloads) * len(configs)
    rows: list[CostRow] = []
    with _spinning(busy_neighbour):
        for phase, r, d, w in phases:
            for workload in workloads:
                for config in configs:
                    print(
                        f"cost [{len(rows) + 1}/{total}] {workload} {config} {phase}: {r} ev/s "
                        f"for {d:g} s (warm-up {w:g} s) ...",
                        file=log,
                        flush=True,
                    )
                    row = _cost_row(workload, config, phase, r, d, w, kazoo, log, kafka_bootstrap)
                    print(
                        f"  {row.processes} processes, p99 {row.p99_ms} ms, lost {row.lost}, "
                        f"duplicates {row.duplicates}, CPU {row.cpu_s:.2f} s "
                        f"({row.core_share:.0%} of a core; steady {row.steady_core_share:.0%}), "
                        f"RSS {row.rss_mb_total:.0f} MB, "
                        f"first output after {row.first_output_s} s",
                        file=log,
                        flush=True,
                    )
                    rows.append(row)
    _add_ratios(rows)
    return rows


def _mark(holds: bool) -> str:
    return "✓" if holds else "✗"


def _cost_checks() -> list[tuple[str, float, str, dict, str]]:
    """(target, limit, unit, the rows it applies to, the field measured), in report order.
    The rows: every attribute given must be equal; ``replicated`` means r > 1."""
    t = COST_TARGETS
    load_r2 = {"phase": "load", "config": "r2"}
    load_kazoo = {"phase": "load", "config": "r2-kazoo"}
    idle_demo = {"phase": "idle", "workload": "demo", "replicated": True}
    load = {"phase": "load"}
    ratio, kazoo_ratio = t["r2_cpu_ratio"], t["r2_kazoo_cpu_ratio"]
    return [
        ("CPU of r2 LiveRobin / r1", ratio, "x", load_r2, "cpu_ratio_vs_r1"),
        ("steady CPU of r2 LiveRobin / r1", ratio, "x", load_r2, "steady_cpu_ratio_vs_r1"),
        ("CPU of r2 KaZoo / r1", kazoo_ratio, "x", load_kazoo, "cpu_ratio_vs_r1"),
        ("steady CPU of r2 KaZoo / r1", kazoo_ratio, "x", load_kazoo, "steady_cpu_ratio_vs_r1"),
        (
            "CPU of r2 KaZoo with ZooKeeper and Kafka / r1",
            kazoo_ratio,
            "x",
            load_kazoo,
            "cpu_with_services_ratio_vs_r1",
        ),
        (
            "idle replicated demo, share of a core (steady)",
            t["idle_core_share"],
            "core",
            idle_demo,
            "steady_core_share",
        ),
        ("total peak RSS", t["rss_total_mb"], "MB", load, "rss_mb_total"),
        ("run() to first output", t["first_output_s"], "s", load, "first_output_s"),
    ]


def _applies(row: CostRow, where: dict) -> bool:
    return all(
        (row.replication > 1) == v if k == "replicated" else getattr(row, k) == v
        for k, v in where.items()
    )


def cost_targets(rows: list[CostRow]) -> list[dict]:
    """Every row checked against :data:`COST_TARGETS`: dicts of ``target`` (what is
    checked), ``workload``, ``config``, ``phase``, ``measured``, ``limit``, ``unit``,
    ``holds``. Nothing is asserted: the current runtime is known to miss some. The CPU
    ratios are checked twice, on the whole run's CPU and on the steady state's."""
    checks = []
    for target, limit, unit, where, fieldname in _cost_checks():
        for row in rows:
            measured = getattr(row, fieldname)
            if _applies(row, where) and measured is not None:
                checks.append(
                    {
                        "target": target,
                        "workload": row.workload,
                        "config": row.config,
                        "phase": row.phase,
                        "measured": measured,
                        "limit": limit,
                        "unit": unit,
                        "holds": measured <= limit,
                    }
                )
    return checks


SATURATED = 0.8
"""A steady-state CPU share above this fraction of the machine's cores marks a run whose
figures the machine itself bent (see :func:`cost_markdown`)."""


def _num(v, digits: int = 1, suffix: str = "") -> str:
    if v is None:
        return "—"
    if isinstance(v, float) and v != v:  # NaN
        return "—"
    return f"{v:,.{digits}f}{suffix}" if isinstance(v, float) else f"{v}{suffix}"


def cost_markdown(rows: list[CostRow]) -> str:
    """The rows and the targets as Markdown tables."""
    load = [r for r in rows if r.phase == "load"]
    idle = [r for r in rows if r.phase == "idle"]
    out = []
    if load:
        r0 = load[0]
        out += [
            f"Under load: {r0.rate:,} ev/s for {r0.duration_s:g} s. CPU = user + system "
            "CPU-seconds of the job's processes, start to exit; steady = from the end of "
            f"the {r0.warmup_s:g} s warm-up (latency too) to the end of the stream; "
            "x r1 = against r1 of the same workload in this run.",
            "",
            "| workload | config | processes | p50 ms | p99 ms | p99 x r1 | lost | dup "
            "| CPU s | CPU s / M ev | CPU x r1 | steady CPU s / M ev | steady x r1 "
            "| ZooKeeper + Kafka CPU s | RSS total MB | first output s |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in load:
            out.append(
                f"| {r.workload} | {r.config} | {r.processes} | {_num(r.p50_ms)} "
                f"| {_num(r.p99_ms)} | {_num(r.p99_ratio_vs_r1, 2, 'x')} | {r.lost} "
                f"| {r.duplicates} | {_num(r.cpu_s)} | {_num(r.cpu_s_per_m_events, 0)} "
                f"| {_num(r.cpu_ratio_vs_r1, 2, 'x')} "
                f"| {_num(r.steady_cpu_s_per_m_events, 0)} "
                f"| {_num(r.steady_cpu_ratio_vs_r1, 2, 'x')} "
                f"| {_num(r.services_cpu_s, 2)} | {_num(r.rss_mb_total, 0)} "
                f"| {_num(r.first_output_s, 2)} |"
            )
    if idle:
        r0 = idle[0]
        out += [
            "",
            f"Idle: {r0.rate:,} ev/s for {r0.duration_s:g} s; share of one core = CPU-s / "
            "wall-s, over the whole run (start-up and shutdown included) and in the steady "
            f"state (from the end of the {r0.warmup_s:g} s warm-up to the end of the stream).",
            "",
            "| workload | config | processes | p99 ms | lost | dup | CPU s | core, whole run "
            "| core, steady | ZooKeeper + Kafka, core | RSS total MB |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in idle:
            services = r.services_cpu_s
            share = None if services is None else services / r.wall_s
            out.append(
                f"| {r.workload} | {r.config} | {r.processes} | {_num(r.p99_ms)} | {r.lost} "
                f"| {r.duplicates} | {_num(r.cpu_s)} | {_num(r.core_share * 100, 0, ' %')} "
                f"| {_num(r.steady_core_share * 100, 0, ' %')} "
                f"| {_num(None if share is None else share * 100, 0, ' %')} "
                f"| {_num(r.rss_mb_total, 0)} |"
            )
    busy = [r for r in rows if r.steady_core_share > SATURATED * (os.cpu_count() or 1)]
    if busy:
        names = ", ".join(f"{r.workload} {r.config} {r.phase}" for r in busy)
        out += [
            "",
            f"Saturated: {names} kept more than {SATURATED:.0%} of this machine's "
            f"{os.cpu_count()} cores busy in the steady state: their latency includes "
            "waiting for a core, and their CPU is capped by the cores and bent by contention "
            "(in either direction), so compare them with care; measure them again at a "
            "lower rate, or on more cores.",
        ]
    checks = cost_targets(rows)
    if checks:
        out += [
            "",
            "Targets (not asserted; ✓ holds, ✗ missed):",
            "",
            "| target | limit | workload | measured |",
            "|---|---:|---|---|",
        ]
        groups: dict[tuple[str, str], list[dict]] = {}
        for c in checks:
            groups.setdefault((c["target"], c["workload"]), []).append(c)
        for (target, workload), cs in groups.items():
            unit = cs[0]["unit"]
            fmt = _target_value(unit)
            cells = " · ".join(
                f"{c['config']} {fmt(c['measured'])} {_mark(c['holds'])}" for c in cs
            )
            out.append(f"| {target} | ≤ {fmt(cs[0]['limit'])} | {workload} | {cells} |")
    return "\n".join(out)


def _target_value(unit: str):
    if unit == "x":
        return lambda v: f"{v:.2f}x"
    if unit == "core":
        return lambda v: f"{v * 100:.0f} %"
    if unit == "MB":
        return lambda v: f"{v:,.0f} MB"
    return lambda v: f"{v:.2f} s"


def plot_cost(rows: list[CostRow], path: str) -> None:
    """CPU-seconds per million events and p99 under load, and the idle share of a core,
    per configuration, grouped by workload, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r.workload for r in rows))
    configs = list(dict.fromkeys(r.config for r in rows))
    panels = [
        ("load", "cpu_s_per_m_events", "CPU-seconds per million events", 1.0),
        ("load", "p99_ms", "p99 latency (ms)", 1.0),
        ("idle", "steady_core_share", "idle: % of one core (steady)", 100.0),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(13, 3.8), dpi=120)
    x = np.arange(len(workloads))
    width = 0.8 / max(len(configs), 1)
    for ax, (phase, fieldname, label, scale) in zip(axes, panels, strict=True):
        for i, config in enumerate(configs):
            values = []
            for w in workloads:
                row = next(
                    (r for r in rows if (r.workload, r.config, r.phase) == (w, config, phase)),
                    None,
                )
                v = None if row is None else getattr(row, fieldname)
                values.append(np.nan if v is None else v * scale)
            ax.bar(x + (i - (len(configs) - 1) / 2) * width, values, width, label=config)
        if fieldname == "steady_core_share":
            limit = COST_TARGETS["idle_core_share"] * 100
            ax.axhline(limit, color="crimson", linestyle="--", linewidth=1, label="target")
        ax.set_xticks(x, workloads)
        ax.set_ylabel(label, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[-1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle("tandem bench cost: what replication costs", fontsize=10, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path)
    plt.close(fig)


DEFAULTS = {
    "rate": 5_000,
    "duration": 15.0,
    "warmup": 5.0,
    "idle_rate": 10,
    "idle_duration": 10.0,
}
QUICK = {"rate": 1_000, "duration": 3.0, "warmup": 1.0, "idle_rate": 10, "idle_duration": 3.0}
"""``tandem bench cost`` and ``tandem bench cost --quick`` (short runs, for CI: 16 runs of
3 s, about 3 minutes on 2 cores, mostly process start-up); flags given explicitly win over
both."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_names(p, "--configs", COST_CONFIGS)
    common.add_names(p, "--workloads", COST_WORKLOADS, default=",".join(DEFAULT_WORKLOADS))
    common.add_rate(p, None, "the loaded runs' rate (default 5000)")
    common.add_seconds(p, "--duration", None, "the loaded runs' length (default 15)")
    common.add_seconds(p, "--warmup", None, "left out of latency and steady-state CPU (default 5)")
    p.add_argument("--idle-rate", type=int, metavar="EV_PER_S", help="the idle runs' rate (10)")
    common.add_seconds(p, "--idle-duration", None, "the idle runs' length (10)")
    p.add_argument(
        "--busy-neighbour",
        action="store_true",
        help="run a process spinning on one core beside every run",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="1000 ev/s for 3 s (warm-up 1 s), idle 3 s: short runs for CI (about 3 min on "
        "2 cores, mostly process start-up); flags given win",
    )
    common.add_session_timeout(p)
    common.add_json(p, "write the rows and the targets as JSON")
    p.add_argument("--plot", metavar="PATH", help="write CPU, p99 and idle share as a PNG")


def main(args: argparse.Namespace) -> int:
    defaults = QUICK if args.quick else DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    configs = tuple(args.configs.split(",")) if args.configs else tuple(COST_CONFIGS)
    workloads = tuple(args.workloads.split(",")) if args.workloads else DEFAULT_WORKLOADS
    # Every option checked before the services start or anything runs.
    check_cost_options(
        configs,
        workloads,
        args.rate,
        args.duration,
        args.warmup,
        args.idle_rate,
        args.idle_duration,
    )
    common.headline(
        f"bench cost: {', '.join(workloads)} x {', '.join(configs)}; {args.rate} ev/s for "
        f"{args.duration:g} s (warm-up {args.warmup:g} s), then {args.idle_rate} ev/s for "
        f"{args.idle_duration:g} s"
        + (", beside a process spinning on one core" if args.busy_neighbour else ""),
        measures="costs",
    )
    with (
        common.kazoo_services("r2-kazoo" in configs, args.session_timeout) as kazoo,
        contextlib.ExitStack() as stack,
    ):
        broker = None
        if "kafka" in workloads:  # the broker the kafka workload writes to, if not running
            from tandem._services import ensure_running

            broker = ensure_running(zookeeper=False, kafka=True)
            if broker.started:
                stack.callback(broker.stop)
        rows = cost(
            configs=configs,
            workloads=workloads,
            rate=args.rate,
            duration=args.duration,
            warmup=args.warmup,
            idle_rate=args.idle_rate,
            idle_duration=args.idle_duration,
            kazoo=kazoo,
            busy_neighbour=args.busy_neighbour,
            kafka_bootstrap=None if broker is None else broker.kafka_bootstrap,
        )
    print()
    print(cost_markdown(rows))
    out = {
        "experiment": "cost",
        "tandem": td.__version__,
        "build": td.build_profile,
        "cpus": os.cpu_count(),
        "settings": {
            "rate": args.rate,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "idle_rate": args.idle_rate,
            "idle_duration_s": args.idle_duration,
            "session_timeout_s": args.session_timeout,
            "busy_neighbour": args.busy_neighbour,
        },
        "targets": COST_TARGETS,
        "rows": [vars(r) for r in rows],
        "checks": cost_targets(rows),
    }
    common.write_json(args.json, out)
    if args.plot:
        common.plot_to(args.plot, plot_cost, rows)
    return 0
