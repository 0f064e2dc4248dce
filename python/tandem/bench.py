"""End-to-end experiments of the paper's evaluation (§VII), on the local engine.

* ``mib1`` — MiB1: a pipeline of 1 to 4 identity map tasks of 2 partitions each at 5,000 ev/s,
  heartbeat 10 ms, buffer timeout 5 ms; latency measured after a warm-up; configurations
  side by side in the same run: no replication, ``none``, ``liverobin``, ``kazoo``. As in
  the paper, every task partition reads both upstream partitions (the stream is keyed
  between tasks), so the replicas of each partition have two inputs to order.
* ``failover`` — the paper's fault experiment: 3 map tasks of 2 partitions, 5,000 ev/s,
  one replica of the middle task SIGKILLed halfway; per-second p99 over time and the
  downtime (the longest gap between two outputs), for the passive baseline (one replica,
  checkpoints every :data:`PASSIVE_CHECKPOINT_MS`, rolled back after the kill), LiveRobin,
  KaZoo with the leader killed and KaZoo with a follower killed; the peak after the kill
  as a ratio to the same seconds of a fault-free run of the same configuration in the
  same invocation.
* ``throughput`` — the highest rate a replicated length-1 pipeline (forward edges) sustains
  without its latency growing: rates are tried in increasing order until the p99 of the
  last third of the run exceeds ``max(10 x the first rate's p99, 250 ms)`` or the run
  falls behind.
* ``cost`` — what replication costs the machine: the demo job and MiB1 of length 3, each
  with r = 1, r = 2 LiveRobin, r = 2 KaZoo and r = 3 LiveRobin, under load and again at an
  idle rate; per run the CPU-seconds of the job's processes (exact: ``getrusage`` of the
  reaped children), per million events and as a share of a core, ZooKeeper's and Kafka's
  CPU for KaZoo, peak memory, time to the first output, and ratios against r = 1 of the
  same run, next to the targets of :data:`COST_TARGETS`.

Each writes rows of JSON; the CLI (``tandem bench ...``) prints them as a table. Every row
says whether its output was complete and unrepeated (``lost``, ``duplicates``): ``mib1`` and
``throughput`` by a sequence check at the sink (:class:`SequenceSink`: every source row
exactly once), ``failover`` and ``cost`` against the reference executor, row by row.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from dataclasses import asdict, dataclass

import numpy as np
import psutil
import pyarrow as pa

import tandem as td
from tandem.operators import SOURCE_SEQ

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
    heartbeat_ms: float = 10,
    checkpoint_ms: float | None = None,
) -> td.Job:
    """MiB1 of length ``length``; the sink records latency unless another is given (a
    ``td.sinks.Collect()`` makes the output comparable with the reference's). ``keyed``:
    each task reads every upstream partition (keyed by ``key``), else partition p feeds
    partition p only (forward edges: one input channel each, nothing to order)."""
    job = td.Job(
        f"mib1-{length}",
        replication=replication,
        ordering=ordering,
        heartbeat_ms=heartbeat_ms,
        buffer_timeout_ms=5,
        kazoo=kazoo if ordering == "kazoo" else None,
        # The unordered baseline diverges by design: measure it rather than stop it.
        on_divergence="log" if ordering == "none" else "fail",
        checkpoint_ms=checkpoint_ms,
    )
    stream = job.source(td.sources.Synthetic(rate=rate, keys=1_000, seed=1), parallelism=2)
    for i in range(length):
        stream = stream.key_by("key") if keyed else stream
        stream = stream.map(identity, parallelism=2, name=f"map{i + 1}")
    stream.sink(sink or td.sinks.Latency(), parallelism=1)
    return job


@dataclass(frozen=True)
class Sequences:
    """The ``source_seq`` values a :class:`SequenceSink` received: ``runs``, the distinct
    values as sorted, disjoint half-open ranges ``[start, end)`` (an ``(n, 2)`` int64
    array), and ``repeats``, how many rows repeated a value already received."""

    runs: np.ndarray
    repeats: int

    def check(self, expected: int) -> tuple[int, int]:
        """(lost, duplicates) against exactly one row of each of ``source_seq`` ``0 ..
        expected - 1``: lost, the values missing; duplicates, the repeats plus the values
        outside that range."""
        starts, ends = self.runs[:, 0], self.runs[:, 1]
        inside = np.maximum(0, np.minimum(ends, expected) - np.maximum(starts, 0)).sum()
        outside = (ends - starts).sum() - inside
        return int(expected - inside), int(self.repeats + outside)


def _runs(values: np.ndarray) -> np.ndarray:
    """Sorted distinct int64 ``values`` as runs ``[start, end)`` of consecutive values."""
    if not len(values):
        return np.empty((0, 2), dtype=np.int64)
    breaks = np.flatnonzero(np.diff(values) != 1) + 1
    starts = values[np.concatenate(([0], breaks))]
    ends = values[np.concatenate((breaks - 1, [len(values) - 1]))] + 1
    return np.stack([starts, ends], axis=1)


class SequenceSink(td.sinks.Sink):
    """Keeps only the ``source_seq`` of every row it receives, compacted into runs when the
    stream ends (:class:`Sequences`): the output check of a job that delivers every source
    row exactly once, such as MiB1 (identity maps), without the reference executor — cheap
    enough for the highest rates. Latency is measured by the engine, as for any sink."""

    def open(self, partition: int, parallelism: int = 1, schema: pa.Schema | None = None) -> None:
        super().open(partition, parallelism, schema)
        if schema is not None and SOURCE_SEQ not in schema.names:
            raise td.ConfigError(f"SequenceSink: its input has no {SOURCE_SEQ!r} column")
        self.seqs: list[np.ndarray] = []

    def write(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows:  # a copy: a view would keep the whole received frame alive
            self.seqs.append(np.array(batch.column(SOURCE_SEQ), dtype=np.int64))

    def close(self) -> Sequences:
        seqs = np.sort(np.concatenate(self.seqs)) if self.seqs else np.empty(0, np.int64)
        self.seqs = []
        distinct = np.unique(seqs)
        return Sequences(_runs(distinct), len(seqs) - len(distinct))

    def combine(self, parts: list, schema: pa.Schema | None = None) -> Sequences:
        parts = [p for p in parts if p is not None]
        runs = np.concatenate([p.runs for p in parts]) if parts else np.empty((0, 2), np.int64)
        merged = _merge(runs)
        # Values that two partitions both received are repeats too.
        overlap = int((runs[:, 1] - runs[:, 0]).sum() - (merged[:, 1] - merged[:, 0]).sum())
        return Sequences(merged, sum(p.repeats for p in parts) + overlap)


def _merge(runs: np.ndarray) -> np.ndarray:
    """The union of runs ``[start, end)`` as sorted, disjoint runs."""
    if not len(runs):
        return runs
    runs = runs[np.argsort(runs[:, 0], kind="stable")]
    reach = np.maximum.accumulate(runs[:, 1])  # the furthest end so far
    first = np.flatnonzero(np.concatenate(([True], runs[1:, 0] > reach[:-1])))
    last = np.concatenate((first[1:] - 1, [len(runs) - 1]))
    return np.stack([runs[first, 0], reach[last]], axis=1)


def sequence_check(res: td.Result) -> tuple[int, int]:
    """(lost, duplicates) of a run whose :class:`SequenceSink` must have received every
    source row exactly once (``source_seq`` 0 .. ``events_in`` - 1, ``events_in`` from the
    plan's schedules, not from the run)."""
    seqs = [v for v in res.outputs.values() if isinstance(v, Sequences)]
    if len(seqs) != 1:
        raise td.TandemError(f"sequence_check: the job needs one SequenceSink, got {len(seqs)}")
    return seqs[0].check(res.events_in)


@dataclass
class Row:
    config: str
    length: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    rate: int
    events_out: int
    lost: int
    """Source rows that never reached the sink (a sequence check at the sink)."""
    duplicates: int
    """Rows the sink received more than once."""
    rss_mb_max: float


def _row(config: str, length: int, rate: int, res: td.Result) -> Row:
    rss = max(res.rss_mb.values(), default=0.0)
    lost, duplicates = sequence_check(res)
    return Row(
        config,
        length,
        round(res.p50_ms, 2),
        round(res.p99_ms, 2),
        round(res.max_ms, 2),
        rate,
        res.events_out,
        lost,
        duplicates,
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
            sink = SequenceSink()  # checks the output: the reference would take too long
            job = mib1_job(length, opts["replication"], opts["ordering"], rate, kazoo, sink)
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
        job = mib1_job(1, 2, "liverobin", rate, sink=SequenceSink(), keyed=False)
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
    "passive": ("passive", 0),
    "liverobin": ("liverobin", 0),
    "kazoo-leader": ("kazoo", "leader"),
    "kazoo-follower": ("kazoo", "follower"),
}
PASSIVE_CHECKPOINT_MS = 1000
"""How often the passive case of ``failover`` checkpoints (``Job(checkpoint_ms=...)``)."""
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
    log=sys.stderr,
) -> list[FailoverRow]:
    """The paper's fault experiment (see the module documentation), each case in turn;
    each ordering also runs once without the fault, for the ratio of the peaks."""
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


def table(rows: list) -> str:
    """Rows (dataclasses or dicts) as aligned text."""
    dicts = [r if isinstance(r, dict) else asdict(r) for r in rows]
    cols = list(dicts[0]) if dicts else []
    lines = ["  ".join(f"{c:>14}" for c in cols)]
    lines += ["  ".join(f"{v!s:>14}" for v in d.values()) for d in dicts]
    return "\n".join(lines)


# -- cost: what replication costs the machine --------------------------------------------

COST_CONFIGS = {
    "r1": {"replication": 1, "ordering": "liverobin"},
    "r2": {"replication": 2, "ordering": "liverobin"},
    "r2-kazoo": {"replication": 2, "ordering": "kazoo"},
    "r3": {"replication": 3, "ordering": "liverobin"},
}
COST_WORKLOADS = ("demo", "mib1")

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


def cost_job(workload: str, config: str, rate: int, kazoo: td.KazooConfig | None) -> td.Job:
    """The job of one cost run: the demo (``tandem.demo.build``, no fault) or MiB1 of
    length 3 (keyed), each ending in a Collect sink so that the run is checked row by row
    against the reference."""
    from tandem import demo

    opts = COST_CONFIGS[config]
    zoo = kazoo if opts["ordering"] == "kazoo" else None
    if workload == "demo":
        return demo.build(rate=rate, **opts, kazoo=zoo)
    return mib1_job(3, opts["replication"], opts["ordering"], rate, zoo, sink=td.sinks.Collect())


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


def _port(address: str) -> int:
    return int(address.split(",")[0].rpartition(":")[2])


def listener_pid(port: int) -> int | None:
    """The PID of the process listening on TCP ``port`` (IPv4 or IPv6), or None (also when
    the listener is not ours to see)."""
    for conn in psutil.net_connections(kind="tcp"):
        listens = conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port
        if listens and conn.pid is not None:
            return conn.pid
    return None


def service_pids(kazoo: td.KazooConfig, log=None) -> dict[str, int]:
    """The PIDs of the ZooKeeper and Kafka servers ``kazoo`` points at: the ones
    ``scripts/services.sh`` started (its PID files), else whoever listens on the port (a
    server started from another checkout, or by hand)."""
    from tandem._services import Services

    zoo = kazoo.resolved()
    ports = {"zookeeper": _port(zoo.zk_hosts), "kafka": _port(zoo.kafka_bootstrap)}
    pids: dict[str, int] = {}
    try:
        states = Services(zk_port=ports["zookeeper"], kafka_port=ports["kafka"]).status()
        pids = {name: s.pid for name, s in states.items() if s.up and s.pid}
    except td.TandemError as exc:  # no script here: fall back to the listeners
        print(
            f"cost: scripts/services.sh status failed ({exc}); using the ports",
            file=log or sys.stderr,
        )
    for name, port in ports.items():
        if name not in pids:
            pid = listener_pid(port)
            if pid is not None:
                pids[name] = pid
    return pids


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
) -> CostRow:
    """Run one configuration once and measure it."""
    from tandem.engines.local import process_cpu_s

    opts = COST_CONFIGS[config]
    job = cost_job(workload, config, rate, kazoo)
    plan = job.plan()
    steady_events = sum(
        plan.source_rows(t.id, p, duration) - plan.source_rows(t.id, p, warmup)
        for t in plan.sources()
        for p in range(t.parallelism)
    )
    pids = service_pids(kazoo or td.KazooConfig(), log) if opts["ordering"] == "kazoo" else {}
    before = {name: process_cpu_s(pid) for name, pid in pids.items()}
    res = job.run(duration=duration, warmup=warmup, progress=False, check=True)
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
    workloads=COST_WORKLOADS,
    rate: int = 5_000,
    duration: float = 15.0,
    warmup: float = 5.0,
    idle_rate: int = 10,
    idle_duration: float = 10.0,
    kazoo: td.KazooConfig | None = None,
    log=None,
    busy_neighbour: bool = False,
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
                    row = _cost_row(workload, config, phase, r, d, w, kazoo, log)
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


# -- recovery: restoring r (Job(restore=True)) against state size -----------------------


class Ballast(td.KeyedProcess):
    """Passes its rows on and carries ``mb`` MiB of state per partition (a byte array it
    touches once per batch): what a replica rebuilt from its twin must receive."""

    def __init__(self, mb: float) -> None:
        self.mb = mb

    def process(self, batch: pa.RecordBatch, state: dict) -> pa.RecordBatch:
        if "bytes" not in state:
            state["bytes"], state["batches"] = np.zeros(max(1, round(self.mb * 2**20)), np.uint8), 0
        ballast = state["bytes"]
        ballast[state["batches"] % len(ballast)] ^= 1
        state["batches"] += 1
        return batch

    def snapshot(self) -> bytes:
        st = self.state
        if "bytes" not in st:
            return b""
        return b"".join((st["batches"].to_bytes(8, "little"), st["bytes"].data))  # one copy

    def state_size(self) -> int:
        return 8 + self.state["bytes"].nbytes if "bytes" in self.state else 0

    def restore(self, data: bytes) -> None:
        self.state.clear()
        if data:
            self.state["batches"] = int.from_bytes(data[:8], "little")
            self.state["bytes"] = np.frombuffer(data, np.uint8, offset=8).copy()  # one copy


@dataclass
class RecoveryRow:
    """One run of ``recovery``: a replica group holding ``state_mb`` MiB per stateful
    partition is killed at ``kill_at_s`` and rebuilt from its twins. ``restore_ms``: from
    the kill to the rebuilt replicas receiving their input (process start, cuts, state
    transfer, replay); ``p99_before_ms``: median per-second p99 before the kill;
    ``p99_during_ms``: the worst per-second p99 from the kill's second until 2 s after the
    rebuild, and ``during_vs_before`` their ratio; ``rebuilt``: replicas restored."""

    state_mb: float
    rate: int
    kill_at_s: float
    restore_ms: float | None
    rebuilt: int
    p99_before_ms: float
    p99_during_ms: float
    during_vs_before: float
    max_gap_ms: float | None
    lost: int
    duplicates: int
    digests_match: bool
    per_second_p99_ms: list


def recovery_job(state_mb: float, rate: int) -> td.Job:
    job = td.Job("recovery", replication=2, restore=True)
    events = job.source(td.sources.Synthetic(rate=rate, keys=1_000, seed=5), parallelism=2)
    (
        events.key_by("key")
        .process(Ballast(state_mb), parallelism=2, name="state")
        .sink(td.sinks.Collect())
    )
    return job


def recovery(
    sizes=(1, 10, 100),
    rate: int = 5_000,
    duration: float = 12.0,
    kill_at: float = 4.0,
    log=sys.stderr,
) -> list[RecoveryRow]:
    """Kill the replica group holding ``state[0]`` replica 0 at ``kill_at`` and rebuild it
    from its twins (``Job(restore=True)``), once per state size; every run is checked
    against the reference executor."""
    rows = []
    for mb in sizes:
        print(f"recovery: {mb:g} MiB of state per partition ...", file=log, flush=True)
        res = recovery_job(mb, rate).run(
            duration=duration, faults=[td.Kill("state", 0, 0, at=kill_at)], progress=False
        )
        series = res.per_second_p99_ms
        restored = [r for r in res.restored_replicas if r["lost_s"] >= kill_at - 0.5]
        back = max((r["restored_s"] for r in restored), default=kill_at)
        before = [v for v in series[1 : int(kill_at)] if v is not None]
        during = [v for v in series[int(kill_at) : int(back) + 3] if v is not None]
        calm = float(np.median(before)) if before else float("nan")
        worst = max(during) if during else float("nan")
        rows.append(
            RecoveryRow(
                mb,
                rate,
                kill_at,
                max((r["restore_ms"] for r in restored), default=None),
                len(restored),
                round(calm, 1),
                round(worst, 1),
                round(worst / calm, 2) if calm > 0 else float("nan"),
                res.max_gap_ms,
                res.lost,
                res.duplicates,
                res.digests_match,
                [None if v is None else round(v, 1) for v in series],
            )
        )
    return rows
