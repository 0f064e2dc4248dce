"""``tandem bench paper``: the paper's evaluation (§VII, DESIGN §6) in one command, every
configuration side by side in one run, on the local engine.

Experiments, each a grid of points, every point run in every configuration:

* ``mib1`` — MiB1: a pipeline of 1 to 4 identity map tasks, 2 partitions each, keyed between
  tasks (:func:`tandem.experiments.workloads.mib1_job`), 5,000 ev/s.
* ``mib2`` — MiB2: one identity map task of 1 to 4 partitions behind a source of as many
  partitions, keyed: with one partition the task has a single input and nothing to order.
* ``mib3`` — MiB3: one task of one partition merging two sources, one at 5 ev/s and the
  other at 10 to 10,000 ev/s (LiveRobin waits on the slow source's heartbeats).
* ``heartbeat`` — LiveRobin's heartbeat period, 5 to 100 ms, on MiB1 of length 3; r1 (at
  the default 10 ms) is the baseline.
* ``fault`` — MiB1 of length 3, one replica of ``map2[0]`` SIGKILLed at half time:
  passive (its only replica, rolled back to the latest checkpoint), LiveRobin (replica 0),
  KaZoo with the partition's leader killed, KaZoo with a follower killed; r1 runs without
  the fault (it would lose the job). Downtime is the longest gap
  between two outputs; beside it the per-second p99 before the kill and its peak after.
* ``bettercloud`` — the application of the paper's Fig. 15
  (:func:`~tandem.experiments.workloads.bettercloud_job`) at 1,000 and 5,000 ev/s, one
  replica of ``flat_map[0]`` killed at half time as in ``fault``.

Configurations: ``r1`` (one replica per task partition: the paper's unreplicated
baseline), ``none`` (two replicas, unordered: incorrect by design, the paper's measure of
what ordering costs), ``liverobin`` and ``kazoo`` (two replicas each). ``r1`` merges its
inputs as LiveRobin does (as in ``tandem bench cost``): its output is then the reference
executor's row for row, also where the order of two inputs decides the output (a join);
consuming them as they arrive instead, as the paper's plain Flink does, is ``none`` at one
replica.
``passive`` is the paper's passive baseline, ours: one replica per task partition with
aligned checkpoints every :data:`~tandem.experiments.workloads.PASSIVE_CHECKPOINT_MS` to
local disk, a lost worker rolled back to the latest and replayed from there
(``Job(replication=1, checkpoint_ms=...)``).
The paper's fault experiments leave ``none`` out, and so do these.
``sss`` is Spark Structured Streaming (the Spark package's ``structured`` module,
through the ``spark`` benchmark entry point ``tandem bench spark`` uses;
``pip install ./spark_integration``):
the same Synthetic events through a query of identity ``mapInArrow`` stages into a
``foreachBatch`` sink, one driver with a checkpoint (offset and commit logs), micro-batches
back to back, on ``local[2]``. It runs where its query fits, MiB1 and ``fault`` (the
driver SIGKILLed at half time and restarted from its checkpoint at once, as ``tandem
bench spark`` does), with a longer warm-up than tandem's rows and its MiB1 runs as long
as the fault runs (:attr:`Settings.spark_warmup_s`: the first micro-batches wait for the
JVM's Python workers). MiB2, MiB3 and BetterCloud need more source partitions or a second
source than that query has, and the heartbeat period is LiveRobin's.

Every row is checked. Where every source row must reach the sink exactly once (MiB1, MiB2,
the sweep) a :class:`tandem.experiments.workloads.SequenceSink` counts what is missing and
what repeats; elsewhere (MiB3, fault, BetterCloud) the output is compared row by row with
the reference executor's. ``sss`` counts every released event's copies at its sink (by
``source_seq``). ``r1``, ``passive``, ``liverobin`` and ``kazoo`` must lose and repeat
nothing (else the run fails, see :func:`failures`); ``none`` may, and its rows say how
much. ``sss`` must lose nothing, and repeat nothing without a fault; across its driver
kill it keeps what Spark promises a ``foreachBatch`` sink: at least once, the repeats all
one whole micro-batch re-run with the same events, none left for a sink idempotent by
batch id.

CPU is the CPU-seconds (user + system) of the job's processes in the steady state (after the
warm-up, start-up and shutdown left out) per million events released meanwhile; for KaZoo
the CPU ZooKeeper and Kafka used during the run is in ``services_cpu_s``, apart; for
``sss``, its driver processes' (Python driver, JVM, Python workers), sampled every half
second. Ratios
compare p99 and CPU with the ``r1`` row of the same experiment and point in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np

import tandem as td
from tandem.experiments import common, workloads
from tandem.experiments.workloads import (
    PAPER_KAZOO_LEADER_PEAK_MS,
    PAPER_KAZOO_MIB1,
    PAPER_LIVEROBIN,
    PASSIVE,
    SSS,
    bettercloud_job,
    mib2_job,
    mib3_job,
    named,
)

CONFIGS = named({c: c for c in ("r1", PASSIVE, "none", "liverobin", "kazoo", SSS)})
"""The configurations of the paper's evaluation (see the module documentation)."""

ALL_CONFIGS = tuple(CONFIGS)
SPARK_EXPERIMENTS = ("mib1", "fault")
"""Where ``sss`` runs: the experiments whose workload its query is."""
EXACTLY_ONCE = ("r1", PASSIVE, "liverobin", "kazoo")
"""The configurations that must deliver every row exactly once; ``none`` need not."""

EXPERIMENTS = ("mib1", "mib2", "mib3", "heartbeat", "fault", "bettercloud")
FAULT_EXPERIMENTS = ("fault", "bettercloud")

TITLES = {
    "mib1": "MiB1: pipeline of identity maps, 2 partitions each",
    "mib2": "MiB2: one task, 1 to 4 partitions",
    "mib3": "MiB3: one task merging a 5 ev/s source and a faster one",
    "heartbeat": "LiveRobin heartbeat period (MiB1)",
    "fault": "Fault: 3 map tasks, one replica of map2[0] SIGKILLed at half time",
    "bettercloud": "BetterCloud-like application, one replica of flat_map[0] SIGKILLed",
}

PAPER_NOTES = {
    "mib1": "Fig. 10 (37 servers, 5 x 120 s after 30 s): latency grows with the length; "
    "no ordering has the lowest medians; KaZoo a lower median than LiveRobin but more "
    "variability.",
    "mib2": "Fig. 12 (no figures in the text): parallelism barely changes latency; LiveRobin "
    "with one partition is as fast as no ordering (a single input); KaZoo has the highest "
    "tails.",
    "mib3": "Fig. 13 (no figures in the text): medians stable for passive and KaZoo, "
    "slightly higher for LiveRobin; imbalance widens every distribution; KaZoo has the "
    "highest tail; LiveRobin's tail rises at 10,000-to-5.",
    "heartbeat": "Fig. 11 (no figures in the text): LiveRobin's latency grows with the "
    "heartbeat period; 10 ms is the default chosen.",
    "fault": "Fig. 14 (5,000 ev/s, kill at 50 s): passive replication shows latencies of more "
    "than 60 s after the kill; a KaZoo leader kill, outliers up to about a second "
    f"({PAPER_KAZOO_LEADER_PEAK_MS[0]}-{PAPER_KAZOO_LEADER_PEAK_MS[1]} ms); "
    "LiveRobin and a KaZoo follower kill, no visible effect.",
    "bettercloud": "Fig. 16: passive replication inactive for more than a minute; LiveRobin "
    "and a KaZoo follower kill, little impact, under the 2 s objective; a KaZoo leader kill, "
    "higher tails for a short time, still under 2 s.",
}


def paper_figure(experiment: str, group_x: float, config: str, variant: str) -> str | None:
    """What the paper reports for this row's cell, as text (None: nothing comparable)."""
    if experiment == "mib1":
        table = {"liverobin": PAPER_LIVEROBIN, "kazoo": PAPER_KAZOO_MIB1}.get(config, {})
        p = table.get(int(group_x))
        return None if p is None else f"{p[0]:g} / {p[1]:g}"
    if experiment in FAULT_EXPERIMENTS:
        if config == PASSIVE:
            return "> 60 s after the kill"
        if variant == "kill leader":
            lo, hi = PAPER_KAZOO_LEADER_PEAK_MS
            return f"peak {lo}-{hi}" if experiment == "fault" else "peak < 2,000"
        if variant in ("kill replica 0", "kill follower"):
            return "no visible effect" if experiment == "fault" else "little effect, < 2,000"
    return None


@dataclass(frozen=True)
class Settings:
    """Rates, lengths and grids of one invocation (:data:`FULL` or :data:`QUICK`)."""

    rate: int = 5_000
    duration_s: float = 12.0
    warmup_s: float = 5.0
    fault_duration_s: float = 20.0
    fault_warmup_s: float = 5.0
    lengths: tuple[int, ...] = (1, 2, 3, 4)
    partitions: tuple[int, ...] = (1, 2, 3, 4)
    slow_rate: int = 5
    fast_rates: tuple[int, ...] = (10, 100, 1_000, 10_000)
    heartbeats_ms: tuple[float, ...] = (5, 10, 20, 50, 100)
    heartbeat_length: int = 3
    fault_length: int = 3
    bettercloud_rates: tuple[int, ...] = (1_000, 5_000)
    session_timeout_s: float = 0.5
    spark_warmup_s: float = 10.0
    """``sss`` rows' warm-up: Spark's first micro-batches wait for its Python workers to
    start. Its MiB1 runs last as long as the fault runs (``fault_duration_s``, longer than
    the others), so that as much is measured after it as after tandem's warm-up."""
    spark_fault: bool = True
    """Whether ``sss`` runs in ``fault`` (each of its runs starts a JVM or two)."""


FULL = Settings()
"""The full set: 86 runs, under 30 minutes on 2 cores (:func:`estimate_s` guesses 28.5), the 5
``sss`` runs (Spark Structured Streaming) about 4 of them."""
QUICK = Settings(
    duration_s=1.5,
    warmup_s=0.5,
    fault_duration_s=3.0,
    fault_warmup_s=0.5,
    lengths=(3,),
    partitions=(2,),
    fast_rates=(1_000,),
    heartbeats_ms=(5, 100),
    bettercloud_rates=(1_000,),
    spark_warmup_s=0.5,
    spark_fault=False,
)
"""Every experiment briefly, one point each (two for the sweep), for CI: 29 runs, ``sss``
in MiB1 only (a Spark run costs half a minute or more of start-up, a driver kill as much
again)."""


# -- cases and rows ----------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One run: ``experiment``, its ``group`` (the point whose ``r1`` row the ratios use),
    ``variant`` (what else tells rows of one group and configuration apart: a heartbeat
    period, a fault) and ``config``; ``build(kazoo=..., sink=...)`` makes the job."""

    experiment: str
    group: str
    group_x: float
    variant: str
    config: str
    build: Callable | None
    rate: int
    duration_s: float
    warmup_s: float
    check: str = "sequence"
    """``sequence`` (a SequenceSink) or ``reference`` (a Collect sink and the reference)."""
    heartbeat_ms: float = 10
    fault: td.Kill | None = None
    spark: dict | None = None
    """For ``sss``: what the Spark package's ``bench.structured_streaming`` is given besides
    the rate and times (``maps``, ``kill_driver_at``); ``build`` is then None."""


@dataclass
class Row:
    """One row of the report; ``status`` is ``ok`` or ``error`` (``error`` says why)."""

    experiment: str
    group: str
    group_x: float
    variant: str
    config: str
    status: str
    replication: int | None = None
    ordering: str | None = None
    heartbeat_ms: float | None = None
    rate: int | None = None
    duration_s: float | None = None
    warmup_s: float | None = None
    check: str | None = None
    error: str | None = None
    events_in: int | None = None
    events_out: int | None = None
    lost: int | None = None
    duplicates: int | None = None
    digests_match: bool | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None
    max_gap_ms: float | None = None
    cpu_s: float | None = None
    steady_cpu_s: float | None = None
    steady_events: int | None = None
    cpu_s_per_m_events: float | None = None
    """Steady-state CPU-seconds per million events (see the module documentation), or
    the whole run's when the engine took no steady-state reading (``cpu_basis``)."""
    cpu_basis: str | None = None
    """``steady`` or ``whole run``: what ``cpu_s_per_m_events`` measured."""
    whole_run_cpu_s_per_m_events: float | None = None
    services_cpu_s: float | None = None
    rss_mb_total: float | None = None
    rss_mb_max: float | None = None
    processes: int | None = None
    run_s: float | None = None
    """Seconds the harness spent on the run, start-up, check and shutdown included."""
    p99_ratio_vs_r1: float | None = None
    cpu_ratio_vs_r1: float | None = None
    kill: str | None = None
    kill_at_s: float | None = None
    victim: int | None = None
    p99_before_ms: float | None = None
    peak_p99_after_ms: float | None = None
    leaders: dict = field(default_factory=dict)
    per_second_p99_ms: list = field(default_factory=list)
    paper: str | None = None
    note: str | None = None
    spark: dict | None = None
    """``sss`` rows: what Structured Streaming's run reports beyond the common fields
    (:data:`SPARK_FIELDS`)."""

    @property
    def exactly_once(self) -> bool:
        return self.config in EXACTLY_ONCE


def _r(v: float | None, digits: int = 2) -> float | None:
    return None if v is None else round(float(v), digits)


def _kill(task: str, victim, at: float) -> td.Kill:
    return td.Kill(task, partition=0, replica=victim, at=at)


FAULT_VARIANTS = {
    "r1": [("no fault", None)],
    PASSIVE: [("kill replica 0", 0)],
    "liverobin": [("kill replica 0", 0)],
    "kazoo": [("kill leader", "leader"), ("kill follower", "follower")],
}
SPARK_KILL = "kill driver"


def cases(settings: Settings, experiments, configs) -> list[Case]:
    """Every run of ``experiments`` in ``configs``, in order."""
    s = settings
    run = [c for c in configs if c in CONFIGS and c != SSS]
    out: list[Case] = []

    def spark(experiment, group, x, variant, length, duration, kill_at=None):
        if SSS in configs:
            kwargs = {"maps": length, "kill_driver_at": kill_at}
            warmup = s.spark_warmup_s
            if not warmup < duration:
                raise td.ConfigError(
                    f"bench paper: sss's warm-up ({warmup:g} s) must be shorter than its "
                    f"{duration:g} s {experiment} runs; give a longer --duration or a shorter "
                    "--warmup, or leave sss out of --configs"
                )
            out.append(
                Case(
                    experiment,
                    group,
                    x,
                    variant,
                    SSS,
                    None,
                    s.rate,
                    duration,
                    warmup,
                    "sequence",
                    spark=kwargs,
                )
            )

    def steady(experiment, group, x, variant, config, build, rate, check, hb=10):
        duration, warmup = s.duration_s, s.warmup_s
        out.append(
            Case(experiment, group, x, variant, config, build, rate, duration, warmup, check, hb)
        )

    for experiment in experiments:
        if experiment == "mib1":
            for n in s.lengths:
                for c in run:
                    build = _mib1(n, c, s.rate)
                    steady("mib1", f"length {n}", n, "", c, build, s.rate, "sequence")
                spark("mib1", f"length {n}", n, "", n, s.fault_duration_s)
        elif experiment == "mib2":
            for n in s.partitions:
                for c in run:
                    build = partial(_with_sink, mib2_job, n, c, s.rate)
                    group = f"{n} partition{'s' if n > 1 else ''}"
                    steady("mib2", group, n, "", c, build, s.rate, "sequence")
        elif experiment == "mib3":
            for fast in s.fast_rates:
                for c in run:
                    build = partial(_with_sink, mib3_job, s.slow_rate, fast, c)
                    group = f"{s.slow_rate} + {fast:,} ev/s"
                    steady("mib3", group, fast, "", c, build, s.slow_rate + fast, "reference")
        elif experiment == "heartbeat":
            n, group = s.heartbeat_length, f"length {s.heartbeat_length}"
            if "r1" in run:
                build = _mib1(n, "r1", s.rate)
                steady("heartbeat", group, n, "", "r1", build, s.rate, "sequence")
            if "liverobin" in run:
                for hb in s.heartbeats_ms:
                    build = _mib1(n, "liverobin", s.rate, heartbeat_ms=hb)
                    variant = f"heartbeat {hb:g} ms"
                    steady(
                        "heartbeat", group, n, variant, "liverobin", build, s.rate, "sequence", hb
                    )
        elif experiment in FAULT_EXPERIMENTS:
            if experiment == "fault":
                points = [(f"length {s.fault_length}", s.fault_length, s.rate)]
                task = "map2"
            else:
                points = [(f"{r:,} ev/s", r, r) for r in s.bettercloud_rates]
                task = "flat_map"
            kill_at = s.fault_duration_s / 2
            for group, x, rate in points:
                for c in run:
                    if experiment == "fault":
                        build = _mib1(s.fault_length, c, rate)
                    else:
                        build = partial(_with_sink, bettercloud_job, rate, c)
                    for variant, victim in FAULT_VARIANTS.get(c, []):
                        fault = None if victim is None else _kill(task, victim, kill_at)
                        out.append(
                            Case(
                                experiment,
                                group,
                                x,
                                variant,
                                c,
                                build,
                                rate,
                                s.fault_duration_s,
                                s.fault_warmup_s,
                                "reference",
                                fault=fault,
                            )
                        )
                if experiment == "fault" and s.spark_fault:
                    n, duration = s.fault_length, s.fault_duration_s
                    spark(experiment, group, x, SPARK_KILL, n, duration, kill_at)
        else:
            raise td.ConfigError(
                f"bench paper: unknown experiment {experiment!r}; choose from "
                f"{', '.join(EXPERIMENTS)}"
            )
    return out


def _with_sink(builder, *args, kazoo=None, sink=None, **kwargs):
    """``builder(*args, kazoo=kazoo, sink=sink, **kwargs)``: how a :class:`Case` builds
    its job."""
    return builder(*args, kazoo=kazoo, sink=sink, **kwargs)


def _mib1(length: int, config: str, rate: int, **kwargs) -> partial:
    """How a :class:`Case` builds MiB1 of ``length`` in ``config``."""
    opts = workloads.options(config)
    return partial(_with_sink, workloads.mib1_job, length, rate=rate, **opts, **kwargs)


def run_case(case: Case, kazoo: td.KazooConfig | None, log=None) -> Row:
    """Run one case and measure it; a failure to run becomes a row with status ``error``."""
    opts = CONFIGS[case.config]
    row = Row(
        case.experiment,
        case.group,
        case.group_x,
        case.variant,
        case.config,
        "ok",
        replication=opts["replication"],
        ordering=opts["ordering"],
        heartbeat_ms=case.heartbeat_ms,
        rate=case.rate,
        duration_s=case.duration_s,
        warmup_s=case.warmup_s,
        check=case.check,
        paper=paper_figure(case.experiment, case.group_x, case.config, case.variant),
    )
    if case.fault is not None:
        f = case.fault
        row.kill = f"{f.task}[{f.partition}] {f.replica}"
        row.kill_at_s = f.at
    elif case.spark is not None and case.spark["kill_driver_at"] is not None:
        row.kill, row.kill_at_s = "driver", case.spark["kill_driver_at"]
    started = time.monotonic()
    try:
        if case.config == SSS:
            _run_spark(row, case)
        else:
            _run_tandem(row, case, kazoo, log)
    except Exception as exc:  # reported in the row, and the run fails at the end
        row.status, row.error = "error", f"{type(exc).__name__}: {exc}"
    row.run_s = round(time.monotonic() - started, 2)
    return row


def _run_tandem(row: Row, case: Case, kazoo: td.KazooConfig | None, log) -> None:
    from tandem.engines.local import process_cpu_s

    sink = workloads.SequenceSink() if case.check == "sequence" else td.sinks.Collect()
    job = case.build(kazoo=kazoo, sink=sink)
    plan = job.plan()
    row.steady_events = sum(
        plan.source_rows(t.id, p, case.duration_s) - plan.source_rows(t.id, p, case.warmup_s)
        for t in plan.sources()
        for p in range(t.parallelism)
    )
    pids = {}
    if row.ordering == "kazoo" and kazoo is not None:
        pids = common.service_pids(kazoo, log)
    before = {name: process_cpu_s(pid) for name, pid in pids.items()}
    res = job.run(
        duration=case.duration_s,
        warmup=case.warmup_s,
        faults=[case.fault] if case.fault is not None else [],
        progress=False,
        check=case.check == "reference",
    )
    used = [process_cpu_s(pid) for pid in pids.values()]
    if pids and None not in used and None not in before.values():
        row.services_cpu_s = round(sum(used) - sum(before.values()), 3)
    if case.check == "sequence":
        row.lost, row.duplicates = workloads.sequence_check(res)
    else:
        row.lost, row.duplicates = res.lost, res.duplicates
    _require_checked(row)
    _measure(row, res, case)


def _require_checked(row: Row) -> None:
    if row.lost is None or row.duplicates is None:
        raise td.TandemError("the output could not be checked against the reference")


SPARK_FIELDS = (
    "pyspark",
    "query",
    "batches",
    "first_output_s",
    "kill_driver_at_s",
    "downtime_s",
    "restart_s",
    "duplicate_batches",
    "duplicates_if_idempotent",
    "replays_identical",
    "rss_mb",
)


def spark_benchmark():
    """The ``spark`` benchmark module (the Spark package's ``bench``), found by its entry point as
    ``tandem bench spark`` finds it; a ConfigError saying how to install it if it is not."""
    from tandem import engines

    return engines.load(engines.BENCHMARK_GROUP, "spark", "benchmark")


def _run_spark(row: Row, case: Case) -> None:
    """An ``sss`` case: MiB1 on Spark Structured Streaming through the ``spark`` benchmark."""
    res = spark_benchmark().structured_streaming(
        rate=case.rate, duration=case.duration_s, warmup=case.warmup_s, **case.spark
    )
    row.lost, row.duplicates = res["lost"], res["duplicates"]
    _require_checked(row)
    row.steady_events = res["steady_events"]
    row.spark = {k: res[k] for k in SPARK_FIELDS}
    # Its figures in the shape of a td.Result, for what every row measures alike.
    fields = ("events_in", "events_out", "p50_ms", "p99_ms", "max_ms", "max_gap_ms", "cpu_s")
    shaped = SimpleNamespace(
        **{k: res[k] for k in (*fields, "steady_cpu_s", "processes", "per_second_p99_ms")},
        digests_match=None,  # one copy: no replicas to compare
        leaders={},
        faults=[],
        rss_mb={},
    )
    if res["downtime_s"] is not None:
        # The longest gap after the warm-up is between two outputs; when the killed driver
        # had written nothing after the warm-up, the hole the kill left starts before the
        # first of them: from the kill, it lasts until the restarted driver's first output.
        shaped.max_gap_ms = max(res["max_gap_ms"], 1_000 * res["downtime_s"])
    _measure(row, shaped, case)
    # A restarted driver replaces the killed one (they overlap only while the kernel tears
    # the old JVM down): the largest incarnation is what ran at once.
    row.rss_mb_total = max(res["rss_mb"].values())
    row.rss_mb_max = res["rss_mb_max"]


def _measure(row: Row, res: td.Result, case: Case) -> None:
    row.events_in, row.events_out = res.events_in, res.events_out
    row.digests_match = res.digests_match
    row.p50_ms, row.p99_ms, row.max_ms = _r(res.p50_ms), _r(res.p99_ms), _r(res.max_ms)
    row.max_gap_ms = _r(res.max_gap_ms, 1)
    row.cpu_s, row.steady_cpu_s = _r(res.cpu_s, 3), _r(res.steady_cpu_s, 3)
    if res.cpu_s is not None and res.events_in:
        row.whole_run_cpu_s_per_m_events = round(res.cpu_s / res.events_in * 1e6, 1)
    if res.steady_cpu_s is not None and row.steady_events:
        row.cpu_s_per_m_events = round(res.steady_cpu_s / row.steady_events * 1e6, 1)
        row.cpu_basis = "steady"
    elif row.whole_run_cpu_s_per_m_events is not None:  # a run too short for both readings
        row.cpu_s_per_m_events = row.whole_run_cpu_s_per_m_events
        row.cpu_basis = "whole run"
    row.rss_mb_total = round(sum(res.rss_mb.values()), 1) if res.rss_mb else None
    row.rss_mb_max = round(max(res.rss_mb.values()), 1) if res.rss_mb else None
    row.processes = res.processes
    row.leaders = res.leaders
    row.per_second_p99_ms = [_r(v, 1) for v in res.per_second_p99_ms]
    if case.fault is not None:
        row.victim = res.faults[0].get("victim") if res.faults else None
    if case.experiment in FAULT_EXPERIMENTS:
        half = int(case.duration_s / 2)
        series = res.per_second_p99_ms
        before = [v for v in series[:half] if v is not None]
        # The peak in the six seconds from the first output after the kill: at once for
        # tandem's rows, after the restart for a driver that had to start again.
        resumed = next((i for i in range(half, len(series)) if series[i] is not None), half)
        after = [v for v in series[half : resumed + 6] if v is not None]
        row.p99_before_ms = _r(np.median(before), 1) if before else None
        row.peak_p99_after_ms = _r(max(after), 1) if after else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 2)


def add_ratios(rows: list[Row]) -> None:
    """p99 and CPU of every measured row against the ``r1`` row of its experiment and group."""
    base = {(r.experiment, r.group): r for r in rows if r.config == "r1" and r.status == "ok"}
    for r in rows:
        b = base.get((r.experiment, r.group))
        if b is None or r.status != "ok":
            continue
        r.p99_ratio_vs_r1 = _ratio(r.p99_ms, b.p99_ms)
        if r.cpu_basis == b.cpu_basis:
            r.cpu_ratio_vs_r1 = _ratio(r.cpu_s_per_m_events, b.cpu_s_per_m_events)
        else:  # compare like with like
            r.cpu_ratio_vs_r1 = _ratio(
                r.whole_run_cpu_s_per_m_events, b.whole_run_cpu_s_per_m_events
            )


def failures(rows: list[Row], experiments) -> list[str]:
    """What makes the run fail: a run that did not complete, an experiment without a
    measured row, a row of an exactly-once configuration that lost or repeated rows (or
    whose replicas' digests differed), an ``sss`` row that broke what Spark promises
    (:func:`spark_broken`). Never timings."""
    out = []
    for r in rows:
        where = f"{r.experiment} {r.group}{' ' + r.variant if r.variant else ''} {r.config}"
        if r.status == "error":
            out.append(f"{where}: did not run ({r.error})")
        elif r.status == "ok" and r.exactly_once:
            if r.lost or r.duplicates:
                out.append(f"{where}: lost {r.lost}, duplicates {r.duplicates}")
            if r.digests_match is False:
                out.append(f"{where}: the replicas' output digests differed")
        elif r.status == "ok" and r.config == SSS:
            out += [f"{where}: {broken}" for broken in spark_broken(r)]
    measured = {r.experiment for r in rows if r.status == "ok"}
    out += [f"{e}: no configuration ran" for e in experiments if e not in measured]
    return out


def spark_broken(r: Row) -> list[str]:
    """What an ``sss`` row broke of Spark's guarantees: nothing lost, ever; without a
    fault, nothing repeated; across a driver kill, ``foreachBatch`` is at-least-once: only
    the micro-batch in flight at the crash (planned, not committed) is run again, with the
    same events, so a sink idempotent by batch id would have kept every event once."""
    out = []
    if r.lost:
        out.append(f"lost {r.lost}")
    if r.kill is None and r.duplicates:
        out.append(f"duplicates {r.duplicates} without a fault")
    if r.kill is not None:
        s = r.spark or {}
        if s.get("duplicate_batches", 0) > 1:
            out.append(f"{s['duplicate_batches']} micro-batches re-written after the restart")
        if s.get("duplicates_if_idempotent"):
            out.append(f"{s['duplicates_if_idempotent']} duplicates within one batch id")
        if s.get("replays_identical") is False:
            out.append("a re-run micro-batch held other events than its first run")
    return out


# -- progress ----------------------------------------------------------------------------

OVERHEAD_S = 3.5
"""About what a run costs beyond its duration on 2 cores: start-up, shutdown, the check."""


SPARK_OVERHEAD_S = 20.0
"""About what an ``sss`` run costs beyond its duration on 2 cores (17 to 40 s measured on a
busy machine): the driver's JVM and session, the first micro-batch (Python workers start),
the drain, shutdown; twice with a driver kill."""


def estimate_s(case: Case) -> float:
    """A guess of a case's wall time, for the progress lines."""
    if case.config == SSS:
        kills = case.spark["kill_driver_at"] is not None
        return case.duration_s + SPARK_OVERHEAD_S * (2 if kills else 1)
    extra = 1.5 if CONFIGS[case.config]["ordering"] == "kazoo" else 0.0
    if case.check == "reference":
        extra += case.rate * case.duration_s / 20_000  # the reference executor, the drain
    return case.duration_s + OVERHEAD_S + extra


def _clock(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 60}:{s % 60:02d}"


def _label(c: Case | Row) -> str:
    return f"{c.experiment} {c.group}{' · ' + c.variant if c.variant else ''} · {c.config}"


def summary_line(row: Row) -> str:
    if row.status != "ok":
        return f"    {row.status}: {row.error}"
    extra = ""
    if row.kill:
        extra = f", longest output gap {row.max_gap_ms} ms, peak p99 after {row.peak_p99_after_ms}"
    return (
        f"    p50 {row.p50_ms} / p99 {row.p99_ms} / max {row.max_ms} ms, lost {row.lost}, "
        f"duplicates {row.duplicates}, CPU {row.cpu_s} s{extra} ({row.run_s:.1f} s)"
    )


def run_all(all_cases: list[Case], kazoo: td.KazooConfig | None, log=None) -> list[Row]:
    """Every case in turn, one at a time (so that they do not compete for the machine),
    with a progress line before each (elapsed, about how long is left) and a line of
    figures after it."""
    log = log or sys.stderr
    rows: list[Row] = []
    start = time.monotonic()
    spent_guess = 0.0
    remaining = sum(estimate_s(c) for c in all_cases)
    for i, case in enumerate(all_cases, 1):
        elapsed = time.monotonic() - start
        # Scale the rest of the guess by how the guesses so far compared with the clock.
        scale = elapsed / spent_guess if spent_guess else 1.0
        print(
            f"[{i:>{len(str(len(all_cases)))}}/{len(all_cases)}] {_label(case)}: "
            f"{case.duration_s:g} s run (elapsed {_clock(elapsed)}, about "
            f"{_clock(remaining * scale)} to go)",
            file=log,
            flush=True,
        )
        row = run_case(case, kazoo, log)
        guess = estimate_s(case)
        spent_guess += guess
        remaining -= guess
        print(summary_line(row), file=log, flush=True)
        rows.append(row)
    return rows


# -- report ------------------------------------------------------------------------------


def _cell(v, digits: int = 1, suffix: str = "") -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "—"
    if isinstance(v, float):
        return f"{v:,.{digits}f}{suffix}"
    return f"{v:,}{suffix}" if isinstance(v, int) else f"{v}{suffix}"


def _note(r: Row, warmup_s: float | None = None) -> str:
    """The row's note; ``warmup_s``: the table's warm-up (a row's own is said if it differs)."""
    if r.status == "error":
        return f"did not run: {r.error}"
    if r.status != "ok":
        return r.note or r.status
    notes = []
    if r.config == "none" and (r.lost or r.duplicates):
        notes.append("unordered: loses and repeats rows by design")
    if r.config == SSS:
        notes += _spark_notes(r, warmup_s)
    if r.digests_match is False:
        notes.append("replica digests differ")
    if r.cpu_basis == "whole run":
        notes.append("CPU of the whole run (no steady-state reading)")
    if r.services_cpu_s is not None:
        notes.append(f"ZooKeeper + Kafka: {r.services_cpu_s:.2f} CPU-s")
    return "; ".join(notes)


LEGEND = (
    "Latency in ms: sink receive time - source release time, after the warm-up (p50 / "
    "p99 / max). lost / dup: rows missing / repeated at the sink, checked (a sequence "
    "check at the sink, or row by row against the reference executor). CPU: CPU-seconds "
    "of the job's processes in the steady state per million events. RSS: the processes' "
    "peak resident memory, summed. x r1: against the r1 row of the same point in this "
    "run. paper: the paper's figure for the cell (37 servers; p50 / p99 ms unless said)."
)
"""What the columns of :func:`experiment_table` mean."""


def headline(meta: dict) -> str:
    """The report's first line: version, build, cores, when, the command, how long."""
    return (
        f"tandem {meta['tandem']} ({meta['build']} build), {meta['cpus']} cores, "
        f"{meta['started']}: `{meta['command']}`, {_clock(meta['wall_s'])} in all."
    )


def _spark_notes(r: Row, warmup_s: float | None) -> list[str]:
    s = r.spark or {}
    notes = [] if r.warmup_s == warmup_s else [f"warm-up {r.warmup_s:g} s"]
    first = s.get("first_output_s")
    if first is not None and r.warmup_s is not None and first > r.warmup_s:
        notes.append(f"first output {first:g} s into the stream: Spark's start-up is in it")
    if s.get("downtime_s") is not None:
        notes.append(f"restarted driver's first output {s['downtime_s']:g} s after the kill")
    if r.duplicates:
        notes.append(
            f"at-least-once foreachBatch: {s.get('duplicate_batches')} micro-batch in flight "
            "run again after the restart; idempotent by batch id, "
            f"{s.get('duplicates_if_idempotent')} duplicates"
        )
    return notes


SPARK_NOT_HERE = {
    "mib2": "MiB2 (1-4 source partitions; its query's source has 2)",
    "mib3": "MiB3 (a second source)",
    "heartbeat": "the heartbeat sweep (LiveRobin's period)",
    "bettercloud": "BetterCloud (a second source, filters and joins)",
    "fault": "the fault run (left out of --quick: a driver kill costs a second JVM start)",
}
"""Why an experiment has no ``sss`` row: what its Structured Streaming query
(the Spark package's ``structured``: one 2-partition source, identity maps) lacks."""


def not_in_table(rows: list[Row]) -> str:
    """The report's last line: who is not in it, and why."""
    experiments = dict.fromkeys(r.experiment for r in rows)
    with_spark = {r.experiment for r in rows if r.config == SSS}
    if with_spark:
        lacking = [SPARK_NOT_HERE[e] for e in experiments if e not in with_spark]
        spark = "Spark Structured Streaming in " + ", ".join(lacking) if lacking else ""
    else:
        spark = (
            "Spark Structured Streaming (not selected; `--configs` with `sss` runs it in "
            "MiB1 and the fault run)"
        )
    flink = (
        "Apache Flink, the paper's engine: PyFlink is not installed with tandem and no row "
        "here runs on Flink (the paper column has the paper's figures)"
    )
    return "Not in this table: " + "; ".join(x for x in (spark, flink) if x) + "."


def markdown(rows: list[Row], meta: dict) -> str:
    """The report: a table per experiment, the paper's figures beside ours."""
    out = [headline(meta), "", LEGEND]
    for experiment in dict.fromkeys(r.experiment for r in rows):
        out += ["", *experiment_table(rows, experiment)]
    out += ["", not_in_table(rows)]
    return "\n".join(out)


def experiment_table(rows: list[Row], experiment: str) -> list[str]:
    """The lines of one experiment's section: its title, what ran, a row per case (fault
    experiments: the kill, the longest output gap, the per-second p99 before the kill and
    its peak after), and what the paper reports."""
    rs = [r for r in rows if r.experiment == experiment]
    ran = next((r for r in rs if r.status == "ok"), rs[0])
    faulty = experiment in FAULT_EXPERIMENTS
    run = "" if ran.duration_s is None else f"{ran.duration_s:g} s runs, warm-up {ran.warmup_s:g} s"
    if faulty and ran.duration_s is not None:
        run += f", kill at {ran.duration_s / 2:g} s"
    out = [f"### {TITLES[experiment]}", "", f"{_rates(experiment, rs)}; {run}.", ""]
    head = ["point", "config"] + (["fault"] if faulty else [])
    head += ["p50", "p99", "max"]
    head += ["longest gap", "p99 before", "peak p99 after"] if faulty else []
    head += ["lost", "dup", "CPU-s / M ev", "RSS MB", "p99 x r1", "CPU x r1", "paper", "note"]
    out += ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rs:
        point = r.group + (f", {r.variant}" if r.variant and not faulty else "")
        cells = [point, r.config] + ([r.variant or "—"] if faulty else [])
        cells += [_cell(r.p50_ms), _cell(r.p99_ms), _cell(r.max_ms)]
        if faulty:
            cells += [_cell(r.max_gap_ms), _cell(r.p99_before_ms), _cell(r.peak_p99_after_ms)]
        cells += [
            _cell(r.lost),
            _cell(r.duplicates),
            _cell(r.cpu_s_per_m_events, 0),
            _cell(r.rss_mb_total, 0),
            _cell(r.p99_ratio_vs_r1, 2, "x"),
            _cell(r.cpu_ratio_vs_r1, 2, "x"),
            r.paper or "—",
            _note(r, ran.warmup_s),
        ]
        out.append("| " + " | ".join(cells) + " |")
    out += ["", f"The paper: {PAPER_NOTES[experiment]}"]
    return out


def _rates(experiment: str, rows: list[Row]) -> str:
    r = next((r for r in rows if r.rate is not None), None)
    if r is None:
        return "not run"
    if experiment == "mib3":
        return "a 5 ev/s source and one at the rate of the point"
    if experiment == "bettercloud":
        rules = workloads.BETTERCLOUD_RULE_RATE
        return f"customer events at the rate of the point, rule updates at {rules} ev/s"
    return f"{r.rate:,} ev/s"


# -- figures -----------------------------------------------------------------------------

COLORS = {
    "r1": "#4c72b0",
    "none": "#8c8c8c",
    "liverobin": "#55a868",
    "kazoo": "#c44e52",
    PASSIVE: "#8172b3",
    SSS: "#dd8452",
}


def _box_stats(r: Row) -> dict:
    """Quartiles and extremes of the per-second p99 values measured after the warm-up
    (the run's p99 alone when it has none)."""
    start = int(r.warmup_s or 0)
    values = [v for v in r.per_second_p99_ms[start:] if v is not None] or [r.p99_ms]
    q1, med, q3 = np.percentile(values, [25, 50, 75])
    return {
        "med": med,
        "q1": q1,
        "q3": q3,
        "whislo": min(values),
        "whishi": max(values),
        "fliers": [],
    }


BOX_CAPTION = (
    "box: per-second p99 over the measured seconds (quartiles; whiskers: lowest and highest "
    "second); dot: the run's p50; triangle: its max. Log scale."
)


def plot_latency(rows: list[Row], experiment: str, path: str) -> None:
    """Box plots of latency per configuration at every point of ``experiment``: the
    engine reports percentiles, not samples, so each box is the distribution of the
    per-second p99 (see :data:`BOX_CAPTION`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = [r for r in rows if r.experiment == experiment and r.status == "ok"]
    if not rs:
        return
    points = list(dict.fromkeys((r.group, r.variant) for r in rs))
    configs = list(dict.fromkeys(r.config for r in rs))
    width = 0.8 / len(configs)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(points) + 2), 4.0), dpi=120)
    for r in rs:
        i = points.index((r.group, r.variant))
        here = [
            c
            for c in configs
            if any(x.config == c and (x.group, x.variant) == (r.group, r.variant) for x in rs)
        ]
        pos = i + (here.index(r.config) - (len(here) - 1) / 2) * width
        color = COLORS.get(r.config, "black")
        boxes = ax.bxp(
            [_box_stats(r)],
            positions=[pos],
            widths=width * 0.8,
            patch_artist=True,
            showfliers=False,
            medianprops={"color": "black"},
        )
        for box in boxes["boxes"]:
            box.set(facecolor=color, alpha=0.45, edgecolor=color)
        ax.plot([pos], [r.p50_ms], "o", color=color, markersize=3)
        ax.plot([pos], [r.max_ms], "^", color=color, markersize=4)
    ax.set_xticks(range(len(points)), [v or g for g, v in points], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("latency (ms)")
    ax.grid(axis="y", alpha=0.3)
    handles = [
        plt.Rectangle((0, 0), 1, 1, facecolor=COLORS.get(c, "black"), alpha=0.45) for c in configs
    ]
    ax.legend(handles, configs, fontsize=8, loc="upper left")
    ax.set_title(TITLES[experiment], fontsize=10)
    caption = textwrap.fill(BOX_CAPTION, int(fig.get_figwidth() * 16))
    fig.text(0.01, 0.01, caption, fontsize=6.5, color="#444444", va="bottom")
    fig.tight_layout(rect=(0, 0.03 + 0.035 * caption.count("\n"), 1, 1))
    fig.savefig(path)
    plt.close(fig)


def plot_over_time(rows: list[Row], experiment: str, path: str) -> None:
    """Per-second p99 over the run for every case of a fault experiment, one panel per
    point, the kill marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = [r for r in rows if r.experiment == experiment and r.status == "ok"]
    if not rs:
        return
    groups = list(dict.fromkeys(r.group for r in rs))
    fig, axes = plt.subplots(len(groups), 1, figsize=(8, 3.2 * len(groups)), dpi=120, squeeze=False)
    for ax, group in zip(axes[:, 0], groups, strict=True):
        for r in (r for r in rs if r.group == group):
            # A second without output is a gap in the line, not a segment across it.
            xs = [s + 0.5 for s in range(len(r.per_second_p99_ms))]
            ys = [np.nan if v is None else v for v in r.per_second_p99_ms]
            style = "--" if r.variant == "kill follower" else "-"
            label = f"{r.config} ({r.variant})" if r.variant else r.config
            ax.plot(
                xs,
                ys,
                style,
                marker="o",
                markersize=2,
                linewidth=1,
                label=label,
                color=COLORS.get(r.config),
            )
        kill = next((r for r in rs if r.group == group and r.kill_at_s is not None), None)
        if kill is not None:
            ax.axvline(kill.kill_at_s, color="crimson", linestyle=":", linewidth=1)
            ax.annotate(
                f"SIGKILL {kill.kill.split()[0]}",
                (kill.kill_at_s, 0.02),
                xycoords=("data", "axes fraction"),
                xytext=(4, 0),
                textcoords="offset points",
                color="crimson",
                fontsize=8,
            )
        ax.set_yscale("log")
        ax.set_xlabel("seconds since start")
        ax.set_ylabel("p99 per second (ms)")
        ax.set_title(f"{TITLES[experiment]}: {group}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def can_plot(log=None) -> bool:
    """Whether matplotlib can be imported; if not, a line on ``log`` says so."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(
            "no figures: matplotlib is not installed (pip install 'tandem-stream[plot]'); "
            "the JSON and Markdown are written all the same",
            file=log or sys.stderr,
        )
        return False
    return True


def write_figures(rows: list[Row], out_dir: Path, log=None) -> list[str]:
    """Every figure as a PNG in ``out_dir``; [] (and a line on ``log``) without matplotlib."""
    if not can_plot(log):
        return []
    written = []
    for experiment in dict.fromkeys(r.experiment for r in rows if r.status == "ok"):
        path = out_dir / f"{experiment}_latency.png"
        plot_latency(rows, experiment, str(path))
        written.append(str(path))
        if experiment in FAULT_EXPERIMENTS:
            path = out_dir / f"{experiment}_p99_over_time.png"
            plot_over_time(rows, experiment, str(path))
            written.append(str(path))
    return written


# -- the whole -----------------------------------------------------------------------------


def paper(
    settings: Settings,
    experiments=EXPERIMENTS,
    configs=ALL_CONFIGS,
    out_dir: str | os.PathLike = "out/paper",
    kazoo: td.KazooConfig | None = None,
    command: str = "tandem bench paper",
    log=None,
) -> dict:
    """Run ``experiments`` in ``configs``, write ``paper.json``, ``paper.md`` and the PNG
    figures into ``out_dir``, and return the JSON document (its ``failures``: what makes
    the run fail, see :func:`failures`)."""
    log = log or sys.stderr
    experiments, configs = tuple(experiments), tuple(configs)
    check_selection(experiments, configs)
    all_cases = cases(settings, experiments, configs)
    missing = [e for e in experiments if not any(c.experiment == e for c in all_cases)]
    if missing:
        raise td.ConfigError(
            f"bench paper: {', '.join(missing)} would run nothing with --configs "
            f"{','.join(configs)} (heartbeat needs r1 or liverobin; fault and bettercloud "
            f"need r1, passive, liverobin or kazoo; sss runs in {' and '.join(SPARK_EXPERIMENTS)}"
            f"{'' if settings.spark_fault else ', and not in fault with --quick'})"
        )
    if any(c.config == SSS for c in all_cases):
        spark_benchmark()  # not installed: say so now, not once per row
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    t = time.monotonic()
    rows = run_all(all_cases, kazoo, log)
    add_ratios(rows)
    wall = time.monotonic() - t
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = run_meta(started, command, wall)
    doc = {
        "experiment": "paper",
        **meta,
        "settings": asdict(settings),
        "experiments": list(experiments),
        "configs": list(configs),
        "config_settings": CONFIGS,
        "paper_notes": {e: PAPER_NOTES[e] for e in experiments},
        "rows": [asdict(r) for r in rows],
        "failures": failures(rows, experiments),
    }
    doc["figures"] = write_figures(rows, out, log)
    (out / "paper.md").write_text(markdown(rows, meta) + "\n")
    (out / "paper.json").write_text(json.dumps(doc, indent=2))
    return doc


def run_meta(started: str, command: str, wall_s: float) -> dict:
    """What a report says of its run: version, build, cores, start, command, wall time."""
    return {
        "tandem": td.__version__,
        "build": td.build_profile,
        "cpus": os.cpu_count(),
        "started": started,
        "command": command,
        "wall_s": round(wall_s, 1),
    }


def check_selection(
    experiments, configs, known=(EXPERIMENTS, ALL_CONFIGS), command: str = "bench paper"
) -> None:
    """Raise ConfigError for an unknown or empty selection, before anything runs; ``known``:
    the experiments and the configurations ``command`` has."""
    names, selection = ("experiments", "configs"), (experiments, configs)
    for what, given, choices in zip(names, selection, known, strict=True):
        unknown = sorted(set(given) - set(choices))
        if unknown or not given:
            raise td.ConfigError(
                f"{command}: --{what}: unknown {unknown or '(none given)'}; choose from "
                f"{','.join(choices)}"
            )


# -- the command ---------------------------------------------------------------------------

HELP = (
    "the paper's whole evaluation (MiB1-3, the heartbeat sweep, the fault run, the "
    "BetterCloud-like application) in every configuration side by side: JSON, Markdown, PNGs"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_names(p, "--experiments", EXPERIMENTS)
    common.add_names(
        p,
        "--configs",
        ALL_CONFIGS,
        default=f"all; {SSS}, Spark Structured Streaming, in mib1 and fault where the "
        "Spark package is installed",
    )
    common.add_rate(p, None, "every run's rate (default 5000)")
    common.add_seconds(
        p,
        "--duration",
        None,
        "each run's length (default 12); fault and sss runs: twice the length given (default 20)",
    )
    common.add_seconds(p, "--warmup", None, "left out of latency (default 5, sss 10)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="every experiment briefly, one point each, 1.5 s runs (3 s with a fault), "
        "Spark Structured Streaming in mib1 only: for CI, a few minutes",
    )
    common.add_session_timeout(p)
    p.add_argument(
        "--out",
        metavar="DIR",
        help="where paper.json, paper.md and the figures go (default out/paper)",
    )


def main(args: argparse.Namespace) -> int:
    from tandem import engines

    settings = QUICK if args.quick else FULL
    if args.rate is not None:
        settings = replace(settings, rate=args.rate)
    if args.duration is not None:
        settings = replace(settings, duration_s=args.duration, fault_duration_s=2 * args.duration)
    if args.warmup is not None:
        settings = replace(
            settings, warmup_s=args.warmup, fault_warmup_s=args.warmup, spark_warmup_s=args.warmup
        )
    settings = replace(settings, session_timeout_s=args.session_timeout)
    experiments = common.csv(args.experiments) or EXPERIMENTS
    configs = common.csv(args.configs) or ALL_CONFIGS
    check_selection(experiments, configs)
    if not args.configs and "spark" not in engines.entry_points(engines.BENCHMARK_GROUP):
        # All by default: Spark Structured Streaming only where its package is installed.
        print(
            f"({SSS}: Spark Structured Streaming is not installed; left out. "
            "`pip install ./spark_integration` from a tandem checkout brings it)"
        )
        configs = tuple(c for c in configs if c != SSS)
    all_cases = cases(settings, experiments, configs)
    if not args.experiments:  # all by default: leave out those the configurations cannot run
        idle = [e for e in experiments if not any(c.experiment == e for c in all_cases)]
        if idle:
            print(f"({', '.join(idle)}: nothing to run with --configs {args.configs}; left out)")
            experiments = tuple(e for e in experiments if e not in idle)
    out_dir = args.out or "out/paper"
    command = common.command(
        args, "paper", "quick", "experiments", "configs", "rate", "duration"
    ) + common.command(args, "", "warmup", "out")
    expected = sum(estimate_s(c) for c in all_cases)
    common.headline(
        f"bench paper{' --quick' if args.quick else ''}: {', '.join(experiments)} x "
        f"{', '.join(configs)}; {len(all_cases)} runs, about {expected / 60:.0f} min; "
        f"writing to {out_dir}/"
    )
    needed = "kazoo" in configs and any(c.config == "kazoo" for c in all_cases)
    with common.kazoo_services(needed, args.session_timeout) as kazoo:
        doc = paper(settings, experiments, configs, out_dir=out_dir, kazoo=kazoo, command=command)
    print()
    print(Path(out_dir, "paper.md").read_text())
    print(f"wrote {out_dir}/paper.json, {out_dir}/paper.md", flush=True)
    return common.report_written(doc)
