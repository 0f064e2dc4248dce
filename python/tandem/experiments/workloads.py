"""The workloads of the experiments, written once: the paper's microbenchmarks (MiB1, MiB2,
MiB3) and its BetterCloud-like application as jobs, the named configurations they run in
(:data:`CONFIGS`), the output check of a job that must deliver every source row exactly
once (:class:`SequenceSink`) and the row of a latency run (:class:`Row`).

Every experiment of ``tandem bench`` builds its jobs here: ``mib1``, ``throughput``,
``failover``, ``cost`` and ``paper`` (and the Spark package's benchmark) run
:func:`mib1_job`; ``paper`` the others too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import tandem as td
from tandem.operators import SOURCE_SEQ

PASSIVE = "passive"
SSS = "sss"
PASSIVE_CHECKPOINT_MS = 1000
"""How often the passive configuration checkpoints (``Job(checkpoint_ms=...)``)."""

CONFIGS = {
    "r1": {"replication": 1, "ordering": "liverobin"},
    PASSIVE: {"replication": 1, "ordering": "liverobin", "checkpoint_ms": PASSIVE_CHECKPOINT_MS},
    "none": {"replication": 2, "ordering": "none"},
    "liverobin": {"replication": 2, "ordering": "liverobin"},
    "kazoo": {"replication": 2, "ordering": "kazoo"},
    SSS: {"replication": 1, "ordering": None, "engine": "Spark Structured Streaming"},
    "r3": {"replication": 3, "ordering": "liverobin"},
}
"""Every named configuration: replicas per task partition, the ordering, for ``passive``
how often it checkpoints, and for ``sss`` (Spark Structured Streaming) that it is not
tandem. ``r1`` merges its inputs as LiveRobin does; ``none`` is the unordered baseline.
An experiment offers those it can run (:func:`named`), under its own names where it has
always had them (``tandem bench cost``'s ``r2`` is ``liverobin``)."""


def named(names: dict[str, str]) -> dict[str, dict]:
    """The configurations an experiment offers, by the names it gives them: ``names``
    maps each to one of :data:`CONFIGS` (``{"r1": "r1", "r2": "liverobin"}``)."""
    return {name: CONFIGS[config] for name, config in names.items()}


def options(config: str) -> dict:
    """What :func:`mib1_job` and :func:`new_job` take of the configuration ``config``:
    ``replication``, ``ordering``, ``checkpoint_ms``."""
    opts = CONFIGS[config]
    return {
        "replication": opts["replication"],
        "ordering": opts["ordering"],
        "checkpoint_ms": opts.get("checkpoint_ms"),
    }


PAPER_LIVEROBIN = {1: (7.6, 21.5), 2: (14.0, 34.5), 3: (20.9, 41.4), 4: (27.7, 51.4)}
"""The paper's MiB1 LiveRobin median/p99 in ms by pipeline length (37 servers)."""
PAPER_KAZOO_MIB1 = {1: (7.9, 39.1), 2: (11.5, 54.9), 3: (15.2, 64.4), 4: (18.8, 82.4)}
"""The paper's MiB1 KaZoo median/p99 in ms by pipeline length (Fig. 10, 37 servers)."""
PAPER_KAZOO_LEADER_PEAK_MS = (650, 1000)
"""The paper's per-second p99 peak after a KaZoo leader kill (Fig. 14)."""


def new_job(
    name: str,
    replication: int,
    ordering: str,
    kazoo: td.KazooConfig | None = None,
    heartbeat_ms: float = 10,
    checkpoint_ms: float | None = None,
    checkpoint_dir: str | None = None,
) -> td.Job:
    """A job as every workload here sets it up: heartbeat ``heartbeat_ms``, buffer timeout
    5 ms, ``kazoo`` only for KaZoo, and the unordered baseline's divergence logged (it
    diverges by design: measure it rather than stop it); ``checkpoint_dir``: durable
    checkpoints there every ``checkpoint_ms``."""
    return td.Job(
        name,
        replication=replication,
        ordering=ordering,
        heartbeat_ms=heartbeat_ms,
        buffer_timeout_ms=5,
        kazoo=kazoo if ordering == "kazoo" else None,
        on_divergence="log" if ordering == "none" else "fail",
        checkpoint_ms=checkpoint_ms,
        checkpoint_dir=checkpoint_dir,
    )


def identity(batch: pa.RecordBatch) -> pa.RecordBatch:
    """The MiB operator."""
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
    sink_replication: int | None = None,
    checkpoint_dir: str | None = None,
) -> td.Job:
    """MiB1 of length ``length``: a source of 2 partitions at ``rate`` ev/s, then
    ``length`` identity map tasks of 2 partitions each; the sink records latency unless
    another is given (a ``td.sinks.Collect()`` makes the output comparable with the
    reference's). ``keyed``: each task reads every upstream partition (keyed by ``key``),
    else partition p feeds partition p only (forward edges: one input channel each,
    nothing to order). ``sink_replication``: the sink's (default: the job's);
    ``checkpoint_dir``: durable checkpoints there every ``checkpoint_ms``."""
    job = new_job(
        f"mib1-{length}", replication, ordering, kazoo, heartbeat_ms, checkpoint_ms, checkpoint_dir
    )
    stream = job.source(td.sources.Synthetic(rate=rate, keys=1_000, seed=1), parallelism=2)
    for i in range(length):
        stream = stream.key_by("key") if keyed else stream
        stream = stream.map(identity, parallelism=2, name=f"map{i + 1}")
    stream.sink(sink or td.sinks.Latency(), parallelism=1, replication=sink_replication)
    return job


def mib2_job(partitions: int, config: str, rate: int, kazoo, sink) -> td.Job:
    """A source of ``partitions`` partitions, keyed into one identity map task of as many."""
    job = new_job(f"mib2-{partitions}", kazoo=kazoo, **options(config))
    stream = job.source(td.sources.Synthetic(rate=rate, keys=1_000, seed=1), parallelism=partitions)
    stream = stream.key_by("key").map(identity, parallelism=partitions, name="map1")
    stream.sink(sink, parallelism=1)
    return job


def mib3_job(slow: int, fast: int, config: str, kazoo, sink) -> td.Job:
    """Two sources (``slow`` and ``fast`` ev/s) merged by one identity map task of one
    partition."""
    job = new_job(f"mib3-{fast}", kazoo=kazoo, **options(config))
    a = job.source(td.sources.Synthetic(rate=slow, keys=1_000, seed=1), name="slow")
    b = job.source(td.sources.Synthetic(rate=fast, keys=1_000, seed=2), name="fast")
    a.union(b).map(identity, parallelism=1, name="map1").sink(sink, parallelism=1)
    return job


BETTERCLOUD_KEYS = 200
BETTERCLOUD_RULE_RATE = 20


def even_key(batch: pa.RecordBatch) -> pa.Array:
    """BetterCloud: customer events of the first kind (say, logins)."""
    return pc.equal(pc.bit_wise_and(batch.column("key"), 1), 0)


def odd_key(batch: pa.RecordBatch) -> pa.Array:
    """BetterCloud: customer events of the second kind (say, messages)."""
    return pc.equal(pc.bit_wise_and(batch.column("key"), 1), 1)


def active_rule(batch: pa.RecordBatch) -> pa.Array:
    """BetterCloud: rule updates that set a limit (the others are dropped)."""
    return pc.less(batch.column("value"), 0.8)


def as_limit(batch: pa.RecordBatch) -> pa.RecordBatch:
    """BetterCloud: a rule row's ``value`` is the limit it sets for its key."""
    names = ["limit" if n == "value" else n for n in batch.schema.names]
    return batch.rename_columns(names)


def violations(batch: pa.RecordBatch) -> pa.RecordBatch:
    """BetterCloud's flatMap: an alert per event above its key's limit (or with no rule
    yet), and a second row (an escalation) for events above 0.99."""
    value = np.asarray(batch.column("value"))
    limit = batch.column("limit")
    no_rule = np.asarray(limit.is_null())
    above = value > np.asarray(limit.fill_null(1.0))
    alert = np.flatnonzero(no_rule | above)
    escalate = np.flatnonzero(value > 0.99)
    rows = np.sort(np.concatenate([alert, escalate]))
    action = np.ones(len(rows), np.int64)
    action[1:][np.diff(rows) == 0] = 2  # the second row of an event: its escalation
    out = batch.take(pa.array(rows, pa.int64()))
    return out.append_column("action", pa.array(action, pa.int64()))


def bettercloud_job(rate: int, config: str, kazoo, sink) -> td.Job:
    """The paper's Fig. 15, on tandem's operators: customer events (``rate`` ev/s) split by
    two filters into two kinds, each joined (``how="left"``, on ``key``) with the rule
    updates (20 ev/s, filtered, their ``value`` renamed ``limit``), both joins' outputs
    merged into a 2-partition flat_map (keyed) that emits alerts, then a sink. Every task
    has one partition but the flat_map, as in the paper."""
    job = new_job(f"bettercloud-{rate}", kazoo=kazoo, **options(config))
    events = job.source(
        td.sources.Synthetic(rate=rate, keys=BETTERCLOUD_KEYS, seed=11), name="customer_events"
    )
    rules = job.source(
        td.sources.Synthetic(rate=BETTERCLOUD_RULE_RATE, keys=BETTERCLOUD_KEYS, seed=12),
        name="rule_updates",
    )
    rules = rules.filter(active_rule, parallelism=1, name="filter_rules")
    rules = rules.map(as_limit, parallelism=1, name="rules")
    logins = events.filter(even_key, parallelism=1, name="filter_logins")
    messages = events.filter(odd_key, parallelism=1, name="filter_messages")
    joined_a = logins.join(rules, on="key", how="left", parallelism=1, name="join_logins")
    joined_b = messages.join(rules, on="key", how="left", parallelism=1, name="join_messages")
    alerts = joined_a.union(joined_b).key_by("key")
    alerts.flat_map(violations, parallelism=2, name="flat_map").sink(sink, parallelism=1)
    return job


# -- the output check of a job that delivers every source row once ------------------------


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

    in_result = True

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
    """A latency run of :func:`mib1_job` (``tandem bench mib1`` and ``throughput``), its
    output checked by a :class:`SequenceSink`."""

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


def latency_row(config: str, length: int, rate: int, res: td.Result) -> Row:
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
