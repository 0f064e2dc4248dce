"""The physical plan: what an engine runs.

A :class:`Plan` is a plain, picklable tree of dataclasses (user functions inside operators
must be picklable by whatever the engine uses to ship them: cloudpickle, which takes
lambdas and closures, on both engines; :meth:`Plan.check_picklable`). It expands the
job's logical graph into tasks x partitions x replicas and the logical channels between
them:

* :class:`Task` — ``id`` (its index in ``plan.tasks``, a topological order), ``name``,
  ``kind`` (``source`` | ``operator`` | ``sink``), ``parallelism``, ``replication``
  (a sink's may differ from the job's: 1 for a sink that cannot run replicated, see
  :mod:`tandem.sinks`), the source / operator / sink
  prototype, its input :class:`Edge` s and schemas.
* :class:`Edge` — ``upstream`` task id, ``input_index`` (0, or 1 for a join's rule side),
  ``partitioner``: ``forward`` (same parallelism, no key: partition p feeds partition p
  only), ``rebalance`` (row i of an upstream partition's output → downstream partition
  ``i % n``), ``hash`` on ``key`` (the key group of its xxh3, see :func:`hash_channels`).
* Input channels of a task partition (:meth:`Plan.input_channels`): the logical channels
  ``(upstream task, upstream partition, input index)`` ordered by (input index, upstream
  task id, upstream partition). That order is the channel index every replica's merge uses.
  A stream never feeds one task twice (self-union / self-join are rejected), so
  ``(upstream task, upstream partition)`` alone identifies a channel at its receiver.
* Output channels (:meth:`Plan.output_edges`): one :class:`OutputEdge` per downstream edge
  (one Outbox each), with one channel per downstream partition (``forward``: exactly one).

Heartbeats and watermarks (the heartbeat generator is logical, not a process): source
partition ``(s, p)`` emits heartbeat epoch ``k = 1, 2, ...`` at logical time
``t0 + k * heartbeat_ns``, placed after exactly :meth:`Plan.source_rows_before` ``(s, p,
k * heartbeat_ns)`` rows — every row released strictly before it. Both replicas of a source
partition therefore put every heartbeat at the same sequence number. Heartbeat ``k``
carries watermark ``t0 + k * heartbeat_ns`` (:meth:`Plan.watermark_ns`): every row with an
earlier ``event_time_ns`` precedes it on that channel.

The forwarding contract (what the reference executor does, and what an engine must do for
its output to equal the reference's): an operator or sink partition tracks, per input
channel, the last heartbeat epoch delivered (:class:`WatermarkTracker`). When the minimum
over its channels advances to ``k`` — a deterministic position in the merged input — it
calls ``on_watermark(watermark_ns(k))``, emits that output, then forwards heartbeat ``k``
on every output channel. For a single-input task that is "forward each heartbeat as it is
dequeued"; for LiveRobin it is the end of cycle ``k``. At end of input (every channel
delivered its end marker) it calls ``on_watermark(WATERMARK_MAX)``, emits, then sends end.
A source that reads a log (Kafka, :class:`tandem.sources.LogSource`) has no logical clock:
heartbeat generators write markers into the log, and its heartbeats and batch boundaries
are where the markers are (:meth:`Plan.log_schedule`, :mod:`tandem.heartbeat`) — again the
same at every replica, because every replica reads the same log.

Batches (DESIGN §2 invariant 1: the batch is the unit of determinism): sources cut their
rows into batches at deterministic positions (:meth:`Plan.source_schedule`); an operator is
called once per input batch, in the order the merge decides at batch granularity (LiveRobin
takes one whole batch per turn); each output batch leaves as one frame per output channel
(:class:`Router` says which rows go where), split only at multiples of ``batch_rows`` rows.
So every replica of a task partition sees the same batches, and an operator function need
only be deterministic for a given input batch.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import struct
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import xxhash

from tandem.exceptions import ConfigError
from tandem.operators import (
    WATERMARK_MAX,
    Operator,
    OperatorContext,
    as_batch,
    check_event_time,
)
from tandem.sinks import Sink
from tandem.sources import Source

if TYPE_CHECKING:
    from tandem.heartbeat import LogSchedule

ORDERINGS = ("none", "liverobin", "kazoo")
PARTITIONERS = ("forward", "rebalance", "hash", "broadcast")
KINDS = ("source", "operator", "sink")
_UNBOUNDED = 1 << 62
"""The row count of a source with no end, in a schedule with no end."""


@dataclass(frozen=True)
class Edge:
    """An input of a task: where it comes from and how rows are routed to partitions."""

    upstream: int
    input_index: int
    partitioner: str
    key: str | None = None


DEFAULT_MAX_PARALLELISM = 128
"""Key groups of a job's hash edges unless it sets its own (``Job(max_parallelism=...)``,
tandem-core ``outbox::DEFAULT_KEY_GROUPS``)."""
MAX_KEY_GROUPS = 1 << 15
"""The most key groups a job may have (Flink's bound too)."""


@dataclass(frozen=True)
class InputChannel:
    """A logical input channel of a task partition."""

    task: int
    partition: int
    input_index: int


@dataclass(frozen=True)
class OutputEdge:
    """The output of a task partition towards one downstream task: output channel ``c``
    goes to downstream partition ``partitions[c]`` (every replica of it)."""

    downstream: int
    input_index: int
    partitioner: str
    key: str | None
    partitions: tuple[int, ...]


@dataclass
class Task:
    """One task of the plan (see the module documentation)."""

    id: int
    name: str
    kind: str
    parallelism: int
    replication: int
    inputs: tuple[Edge, ...] = ()
    input_schemas: tuple[pa.Schema, ...] = ()
    schema: pa.Schema | None = None
    source: Source | None = None
    operator: Operator | None = None
    sink: Sink | None = None
    key: str | None = None

    def describe(self) -> str:
        return f"{self.kind} task {self.name!r}"


@dataclass(frozen=True)
class SourceStep:
    """One step of a source partition's logical schedule: the batch of local rows ``[j0,
    j1)``, heartbeat ``epoch``, or the end. ``at_ns`` is when the step falls due, as an
    offset from t0 (a batch: when its window closes)."""

    kind: str
    at_ns: int
    j0: int = 0
    j1: int = 0
    epoch: int = 0


@dataclass(frozen=True)
class LiveRescale:
    """A keyed operator task that changed its parallelism while the job ran: from ``was``
    partitions to ``now``, right after heartbeat ``epoch`` (DESIGN: live rescale). Its
    upstream tasks route the rows after their heartbeat ``epoch`` over ``now`` channels,
    its old partitions are cut at that heartbeat, and its consumers take the new channels
    from the end of heartbeat cycle ``epoch`` on (:func:`tandem.reference.run` replays
    it)."""

    task: str
    epoch: int
    was: int
    now: int


@dataclass
class Plan:
    """The physical plan of a job. Tasks are in topological order (``tasks[i].id == i``)."""

    job: str
    replication: int
    ordering: str
    heartbeat_ms: float
    buffer_timeout_ms: float
    batch_rows: int
    tasks: tuple[Task, ...] = field(default_factory=tuple)
    kazoo: Any = None
    """``tandem.ordering.kazoo.KazooConfig`` of a ``kazoo`` job (None: the defaults)."""
    on_divergence: str = "fail"
    """What a replica does when two upstream replicas' outputs differ (DESIGN §2
    invariant 4): ``"fail"`` the job with ``DeterminismError``, or ``"log"`` it and go on."""
    workers: int | None = None
    """Worker processes per replica group (None: cores // replication, at least 1)."""
    evict_after_ms: float | None = 1000
    """How long a downstream replica may keep its input waiting, while a twin keeps up,
    before its upstream replicas drop it (None: they wait for it)."""
    restore: bool = False
    """Rebuild a lost replica from a live twin while the job runs (DESIGN §4)."""
    failure_timeout_ms: float = 2000
    """With ``restore``: a worker silent this long (no keepalive) is declared lost, killed
    and rebuilt."""
    replay_ms: float = 3000
    """With ``restore`` or ``checkpoint_ms``: how much recent output every replica keeps
    per channel to replay to a rebuilt downstream replica (whole heartbeat cycles)."""
    checkpoint_ms: float | None = None
    """The passive configuration (replication 1): cut every replica at one heartbeat epoch
    this often, write the cuts to local disk, roll a lost worker back to the latest."""
    durable_ms: float | None = None
    """Durable checkpoints (replication 2 or more, ``Job(checkpoint_dir=...)``): a
    savepoint-format checkpoint of the whole job this often, into :attr:`durable_dir`."""
    durable_dir: str | None = None
    """Where durable checkpoints go (a directory or URI); a job resumed with
    ``resume=True`` starts from the newest complete one there."""
    max_parallelism: int = DEFAULT_MAX_PARALLELISM
    """Key groups of every hash edge (``Job(max_parallelism=...)``): a keyed task's keys
    are hashed into this many groups, each partition owning a contiguous range of them
    (:func:`key_group_range`), so the task can resume from a savepoint at any parallelism
    up to this one with whole groups of its state."""
    resumed: Any = None
    """A job resumed from a savepoint (:class:`tandem.savepoints.Resumed`): the heartbeat
    epoch it continues after and every replica's cut; None: from the start."""
    live_rescales: tuple[LiveRescale, ...] = ()
    """The live rescales this run went through, in epoch order; the tasks' parallelisms
    are those after the last (:func:`tandem.rescale.after`)."""

    def __reduce_ex__(self, protocol: int):
        """Pickled (by cloudpickle, or pickle: the engines ship the plan to the workers)
        as the bytes of :func:`dumps_keeping_files`, so that a user's function in a worker
        keeps the file it was written in: its traceback names the user's file and line."""
        return (_plan_from_bytes, (dumps_keeping_files(self),))

    # -- structure ----------------------------------------------------------------------

    @property
    def heartbeat_ns(self) -> int:
        return round(self.heartbeat_ms * 1_000_000)

    @property
    def checkpointing(self) -> bool:
        """The passive configuration: lost replicas roll back to a checkpoint."""
        return self.checkpoint_ms is not None

    @property
    def rebuilds(self) -> bool:
        """Lost workers are rebuilt while the job runs (from twins or a checkpoint)."""
        return self.restore or self.checkpointing

    @property
    def replay_cycles(self) -> int | None:
        """Heartbeat cycles each output channel keeps for replay (None: none, the job does
        not rebuild replicas)."""
        if not self.checkpointing and (not self.restore or self.replication < 2):
            return None
        return max(1, math.ceil(self.replay_ms / self.heartbeat_ms))

    def restarts_sink(self, task_id: int) -> bool:
        """Whether a lost partition of sink ``task_id`` is restarted: the sink is
        restartable (:attr:`tandem.sinks.Sink.restartable`, a Kafka sink) and its upstream
        replicas keep replay windows (``restore`` with replication 2 or more, or
        ``checkpoint_ms``). Their outboxes then hold its output while it is down."""
        task = self.tasks[task_id]
        return task.kind == "sink" and task.sink.restartable and self.replay_cycles is not None

    def task(self, ref: int | str) -> Task:
        """A task by id or name."""
        if isinstance(ref, int) and not isinstance(ref, bool):
            if 0 <= ref < len(self.tasks):
                return self.tasks[ref]
        else:
            for t in self.tasks:
                if t.name == ref:
                    return t
        names = [t.name for t in self.tasks]
        raise ConfigError(f"job {self.job!r} has no task {ref!r}; its tasks are {names}")

    def rescaled(self, task: int | str, parallelism: int) -> Plan:
        """This plan with task ``task`` at ``parallelism`` partitions, everything else
        (the other tasks, the edges, the settings, :attr:`live_rescales`) the same.
        ConfigError for a parallelism below 1 or above :attr:`max_parallelism`, and for a
        task with a forward edge (which pairs partitions one to one, so both of its ends
        keep one parallelism)."""
        t = self.task(task)
        if (
            isinstance(parallelism, bool)
            or not isinstance(parallelism, int)
            or not 1 <= parallelism <= self.max_parallelism
        ):
            raise ConfigError(
                f"{t.describe()}: parallelism must be an int from 1 to the job's "
                f"max_parallelism={self.max_parallelism} (its key groups), got {parallelism!r}"
            )
        forward = [self.tasks[e.upstream].name for e in t.inputs if e.partitioner == "forward"]
        forward += [d.name for d, e in self.consumers(t.id) if e.partitioner == "forward"]
        if forward and parallelism != t.parallelism:
            raise ConfigError(
                f"{t.describe()} cannot change its parallelism: a forward edge links it to "
                f"{forward[0]!r}, partition for partition, so both keep {t.parallelism}"
            )
        tasks = tuple(
            dataclasses.replace(u, parallelism=parallelism) if u.id == t.id else u
            for u in self.tasks
        )
        return dataclasses.replace(self, tasks=tasks)

    def sources(self) -> list[Task]:
        return [t for t in self.tasks if t.kind == "source"]

    def sinks(self) -> list[Task]:
        return [t for t in self.tasks if t.kind == "sink"]

    def consumers(self, task_id: int) -> list[tuple[Task, Edge]]:
        """The tasks reading ``task_id``'s output, ordered by (task id, input index)."""
        out = [(t, e) for t in self.tasks for e in t.inputs if e.upstream == task_id]
        return sorted(out, key=lambda te: (te[0].id, te[1].input_index))

    def replicas(self) -> list[tuple[int, int, int]]:
        """Every ``(task id, partition, replica)`` the engine must run."""
        return [
            (t.id, p, r)
            for t in self.tasks
            for p in range(t.parallelism)
            for r in range(t.replication)
        ]

    def placement(self, cores: int | None = None) -> list[list[tuple[int, int, int]]]:
        """Which replicas each worker process hosts (a worker is the fault domain).

        Replica group ``g`` — replica ``g`` of every source and operator partition — is
        split over ``workers`` processes (default: ``cores // replication``, at least 1),
        partition ``p`` going to worker ``p % workers`` of its group, so a pipeline of
        forward edges stays in one process. The sinks run on workers of their own:
        replica ``r`` of every replicated sink partition on sink worker ``r`` (as many as
        the most replicated sink has replicas), then the unreplicated sinks together on
        one more, last. Killing a replica group's worker leaves every sink running, and
        killing a replicated sink's worker loses one replica of each partition it hosts.
        Two replicas of one task partition are never in the same worker: losing a worker
        loses at most one replica of each partition, which its twins mask.
        """
        per_group = self.workers
        if per_group is None:
            per_group = max(1, (cores or os.cpu_count() or 1) // max(1, self.replication))
        groups: list[list[list[tuple[int, int, int]]]] = [
            [[] for _ in range(per_group)] for _ in range(self.replication)
        ]
        copies = max((t.replication for t in self.sinks() if t.replication > 1), default=0)
        sinks: list[list[tuple[int, int, int]]] = [[] for _ in range(copies)]
        lone: list[tuple[int, int, int]] = []
        for t, p, r in self.replicas():
            if self.tasks[t].kind != "sink":
                groups[r][p % per_group].append((t, p, r))
            elif self.tasks[t].replication > 1:
                sinks[r].append((t, p, r))
            else:
                lone.append((t, p, r))
        return [w for g in groups for w in g if w] + sinks + ([lone] if lone else [])

    def inbox_ordering(self, task_id: int, partition: int) -> str:
        """The consumption order a partition's inbox uses: the job's ordering where there
        is something to order — a replicated operator with two or more input channels —
        and first come, first served elsewhere (one channel has one order; a sink's
        replicas each keep a copy whose order within a partition does not matter, and
        nothing downstream of a sink could diverge). LiveRobin takes its single-channel
        fast path by itself."""
        task = self.task(task_id)
        if task.kind == "sink":
            return "none"
        if self.ordering == "kazoo" and (
            task.replication < 2 or len(self.input_channels(task_id, partition)) < 2
        ):
            return "none"
        return self.ordering

    def ordered_partitions(self) -> list[tuple[int, int]]:
        """The ``(task, partition)`` s whose replicas run a KaZoo orderer."""
        return [
            (t.id, p)
            for t in self.tasks
            if t.kind == "operator"
            for p in range(t.parallelism)
            if self.inbox_ordering(t.id, p) == "kazoo"
        ]

    def input_channels(self, task_id: int, partition: int) -> list[InputChannel]:
        """The logical input channels of a task partition, in channel-index order."""
        task = self.task(task_id)
        self._check_partition(task, partition)
        chans = []
        for e in task.inputs:
            up = self.tasks[e.upstream]
            parts = [partition] if e.partitioner == "forward" else range(up.parallelism)
            chans += [InputChannel(up.id, p, e.input_index) for p in parts]
        return sorted(chans, key=lambda c: (c.input_index, c.task, c.partition))

    def input_conformer(self, task_id: int, channel: InputChannel):
        """A function casting the batches of input ``channel`` of a task to the schema the
        task reads on that input, or None when they have it already. They differ after a
        ``union`` of streams whose schemas differ in nullability only: the union's schema
        is nullable wherever one of its streams is."""
        want = self.task(task_id).input_schemas[channel.input_index]
        have = self.tasks[channel.task].schema
        if want is None or have is None or have.equals(want, check_metadata=False):
            return None
        return lambda batch: conform(batch, want)

    def output_edges(self, task_id: int, partition: int) -> list[OutputEdge]:
        """The outputs of a task partition, one per downstream edge."""
        task = self.task(task_id)
        self._check_partition(task, partition)
        out = []
        for down, e in self.consumers(task_id):
            parts = (partition,) if e.partitioner == "forward" else tuple(range(down.parallelism))
            out.append(OutputEdge(down.id, e.input_index, e.partitioner, e.key, parts))
        return out

    def _check_partition(self, task: Task, partition: int) -> None:
        if not 0 <= partition < task.parallelism:
            raise ConfigError(
                f"{task.describe()} has partitions 0..{task.parallelism - 1}, got {partition}"
            )

    def check_picklable(self, dumps=None) -> None:
        """Raise ConfigError naming the first task whose source, operator or sink cannot
        be pickled with ``dumps`` (default ``cloudpickle.dumps``, what the local engine
        ships the plan with), and the captured value to blame where one is found.
        :meth:`tandem.Job.plan` calls it, so nothing starts with a plan that cannot be
        sent to the workers."""
        if dumps is None:
            import cloudpickle

            dumps = cloudpickle.dumps
        for t in self.tasks:
            for what, obj in (("source", t.source), ("operator", t.operator), ("sink", t.sink)):
                try:
                    dumps(obj)
                except Exception as exc:
                    culprit = _unpicklable_part(obj, dumps)
                    blame = f" ({what} {culprit})" if culprit else ""
                    raise ConfigError(
                        f"{t.describe()} cannot be sent to a worker process{blame}: "
                        f"{type(exc).__name__}: {exc}. A function or operator shipped to the "
                        "workers must not capture a lock, socket, open file, client or "
                        "thread; create such objects in the worker instead (in an "
                        "operator's open(), or lazily on first use)"
                    ) from exc

    def describe(self) -> str:
        """A readable listing of the tasks, their sizes and their inputs."""
        lines = [
            f"plan {self.job!r}: ordering={self.ordering}, heartbeat={self.heartbeat_ms} ms, "
            f"buffer_timeout={self.buffer_timeout_ms} ms, batch_rows={self.batch_rows}"
        ]
        for t in self.tasks:
            ins = ", ".join(
                f"{self.tasks[e.upstream].name}[{e.input_index}]:{e.partitioner}"
                + (f"({e.key})" if e.key else "")
                for e in t.inputs
            )
            lines.append(
                f"  {t.id}: {t.kind} {t.name!r} x{t.parallelism} partitions "
                f"x{t.replication} replicas" + (f" <- {ins}" if ins else "")
            )
        return "\n".join(lines)

    # -- heartbeats and sources --------------------------------------------------------

    def last_epoch(self, duration_s: float) -> int:
        """The last heartbeat epoch of a run of ``duration_s`` (heartbeats at k*hb <= end)."""
        return round(duration_s * 1e9) // self.heartbeat_ns

    def heartbeat_offset_ns(self, epoch: int) -> int:
        return epoch * self.heartbeat_ns

    def watermark_ns(self, epoch: int, t0_ns: int) -> int:
        """The event-time watermark heartbeat ``epoch`` carries."""
        return t0_ns + epoch * self.heartbeat_ns

    def _source(self, task_id: int) -> tuple[Task, Source]:
        task = self.task(task_id)
        if task.kind != "source" or task.source is None:
            raise ConfigError(f"{task.describe()} is not a source")
        return task, task.source

    def source_rows(self, task_id: int, partition: int, duration_s: float) -> int:
        """Rows source partition ``partition`` releases during a run of ``duration_s``."""
        task, src = self._source(task_id)
        self._check_partition(task, partition)
        return src.partition_rows(partition, task.parallelism, round(duration_s * 1e9))

    def source_rows_before(self, task_id: int, partition: int, offset_ns: int) -> int:
        """Rows of a source partition released strictly before ``t0 + offset_ns``
        (unclamped: take the min with :meth:`source_rows`)."""
        task, src = self._source(task_id)
        return src.partition_rows_before(partition, task.parallelism, offset_ns)

    def source_batch(
        self, task_id: int, partition: int, j0: int, j1: int, t0_ns: int
    ) -> pa.RecordBatch:
        """Local rows ``[j0, j1)`` of a source partition, as one batch."""
        task, src = self._source(task_id)
        return src.read(partition, task.parallelism, j0, j1, t0_ns)

    def is_log_source(self, task_id: int) -> bool:
        """Whether a source reads a log (Kafka): its batches and heartbeats come from the
        log (:meth:`log_schedule`), not from :meth:`source_schedule`."""
        from tandem.sources import LogSource

        return isinstance(self._source(task_id)[1], LogSource)

    def log_schedule(
        self,
        task_id: int,
        partition: int,
        duration_s: float | None,
        t0_ns: int,
        resume: tuple[int, int] | None = None,
    ) -> LogSchedule:
        """How a log source partition is cut into batches and heartbeats
        (:class:`tandem.heartbeat.LogSchedule`): at the heartbeat markers of the log, taken
        from the run's epoch ``t0 // heartbeat`` on, and at every ``batch_rows`` data rows;
        the run ends at the first marker taken with epoch ``>= last_epoch(duration_s)``.
        ``resume``: see :class:`~tandem.heartbeat.LogSchedule`."""
        from tandem.heartbeat import LogSchedule

        task, src = self._source(task_id)
        self._check_partition(task, partition)
        last = None if duration_s is None else self.last_epoch(duration_s)
        return LogSchedule(
            self.heartbeat_ns, t0_ns, last, self.batch_rows, src.marker, resume=resume
        )

    @property
    def buffer_timeout_ns(self) -> int:
        return round(self.buffer_timeout_ms * 1_000_000)

    def natural_end_ns(self) -> int | None:
        """When a run with no duration ends by itself: every source is bounded (a file,
        ``Synthetic(limit=...)``) — the first heartbeat after the last row any source
        releases (offset from t0, ns); None when a source never ends (a rate without a
        limit, a log)."""
        end = 0
        for task in self.sources():
            src = task.source
            if self.is_log_source(task.id):
                return None
            total = src.total_rows(None)
            if total is None:
                return None
            if total > 0:
                end = max(end, int(src.offsets_ns(np.array([total - 1]))[0]) + 1)
        hb = self.heartbeat_ns
        return max(1, -(-end // hb)) * hb

    def source_schedule(
        self, task_id: int, partition: int, duration_s: float | None
    ) -> Iterator[SourceStep]:
        """The logical schedule of a source partition: its rows cut into batches at
        deterministic positions, its heartbeats, its end (DESIGN §2 invariant 1: the batch
        is the unit of determinism). Every replica of the partition, and the reference
        executor, emits exactly these batches, whenever it runs.

        * **Windows.** Rows whose release offset falls in ``[w·b, (w+1)·b)`` (``b`` =
          ``buffer_timeout_ms``) form one batch, due when its window closes (``at_ns =
          (w+1)·b``): a row waits at most the buffer timeout. ``b = 0``: every release
          instant is a window of its own.
        * **Heartbeats.** Heartbeat ``k`` is due at ``k·heartbeat``; it closes the batch it
          falls in (rows released before it go before it), so a batch never straddles a
          heartbeat.
        * **Size.** A batch holds at most ``batch_rows`` rows: a window's rows are cut where
          the partition's local row index is a multiple of ``batch_rows``.
        * The end is due at ``duration_s``; rows released before it all precede it.
        * ``duration_s=None``: no end (a run that goes on until it is stopped; a bounded
          source sends heartbeats after its last row). Its steps due at or before any
          instant ``E`` are those of the schedule for ``duration_s = E``, whose end
          follows (the run's stop point, :mod:`tandem.engines.local`).
        """
        task, src = self._source(task_id)
        if duration_s is None:
            total = src.total_rows(None)
            total = (
                _UNBOUNDED if total is None else src.local_count(total, partition, task.parallelism)
            )
            end_ns = last = None
        else:
            total = self.source_rows(task_id, partition, duration_s)
            end_ns = round(duration_s * 1e9)
            last = self.last_epoch(duration_s)
        window_ns, hb_ns, cap = self.buffer_timeout_ns, self.heartbeat_ns, self.batch_rows
        done, epoch, now = 0, 1, 0

        def next_window(now: int) -> int | None:
            if window_ns > 0:
                return (now // window_ns + 1) * window_ns
            if done >= total:
                return end_ns
            row = done * task.parallelism + partition  # the next row's global index
            return max(now, int(src.offsets_ns(np.array([row]))[0])) + 1

        while True:
            hb_at = epoch * hb_ns if last is None or epoch <= last else None
            due = min(t for t in (next_window(now), end_ns, hb_at) if t is not None)
            limit = min(total, self.source_rows_before(task_id, partition, due))
            while done < limit:
                j1 = min(limit, (done // cap + 1) * cap)
                yield SourceStep("rows", due, j0=done, j1=j1)
                done = j1
            if due == hb_at:
                yield SourceStep("heartbeat", due, epoch=epoch)
                epoch += 1
            now = due
            if end_ns is not None and now >= end_ns and epoch > last:
                break
        yield SourceStep("end", end_ns)

    # -- running tasks -----------------------------------------------------------------

    def instantiate(
        self, task_id: int, partition: int, replica: int = 0, t0_ns: int = 0
    ) -> TaskInstance:
        """A fresh, opened operator instance for one replica of an operator partition."""
        task = self.task(task_id)
        if task.kind != "operator" or task.operator is None:
            raise ConfigError(f"{task.describe()} has no operator to instantiate")
        self._check_partition(task, partition)
        return TaskInstance(task, partition, replica, t0_ns)

    def open_sink(self, task_id: int, partition: int, run: int = 0, replica: int = 0) -> Sink:
        """A fresh sink instance for replica ``replica`` of one sink partition of ``run``
        (the engine's t0), opened."""
        task = self.task(task_id)
        if task.kind != "sink" or task.sink is None:
            raise ConfigError(f"{task.describe()} is not a sink")
        self._check_partition(task, partition)
        sink = copy.deepcopy(task.sink)
        sink.run, sink.replica, sink.replicas = run, replica, task.replication
        # An owned sink's twins take over from the positions its owner stores, and a run
        # resumed from a durable checkpoint skips what the lost run had committed past it.
        sink.keep_positions = (
            self.restarts_sink(task.id)
            or (sink.owned and task.replication > 1)
            or (sink.restartable and self.durable_dir is not None)
        )
        if self.durable_dir is not None and sink.commits_at_checkpoints:
            sink.parts_from = 0 if self.resumed is None else self.resumed.epoch
        sink.open(partition, task.parallelism, task.schema)
        return sink


class TaskInstance:
    """One replica of one operator partition: the operator plus the checks around it.

    Every output is checked against the task's declared schema (a mismatch is a
    ConfigError naming the task and partition); user exceptions pass through unchanged
    with a note naming the task, partition and replica.
    """

    def __init__(self, task: Task, partition: int, replica: int, t0_ns: int) -> None:
        self.task = task
        self.partition = partition
        self.replica = replica
        self.op: Operator = copy.deepcopy(task.operator)
        self.where = f"operator {task.name!r} (task {task.id}, partition {partition})"
        ctx = OperatorContext(
            task=task.name,
            task_id=task.id,
            partition=partition,
            parallelism=task.parallelism,
            replica=replica,
            key=task.key,
            t0_ns=t0_ns,
        )
        self._guard(lambda: self.op.open(ctx))

    def _guard(self, fn) -> Any:
        try:
            return fn()
        except Exception as exc:
            exc.add_note(f"in {self.where}, replica {self.replica}")
            raise

    def _check(self, out: Any) -> pa.RecordBatch | None:
        out = as_batch(out, self.where)
        if out is None or out.num_rows == 0:
            return None
        want = self.task.schema
        if want is not None and not out.schema.equals(want, check_metadata=False):
            raise ConfigError(
                f"{self.where} returned a batch with schema {_schema_str(out.schema)} but its "
                f"declared output schema is {_schema_str(want)}; return batches of the "
                "declared schema (or declare the one it really returns)"
            )
        return out

    def batch(self, batch: pa.RecordBatch, input_index: int = 0) -> pa.RecordBatch | None:
        """Feed the next input rows; the output rows, or None."""
        return self._check(self._guard(lambda: self.op.on_batch(batch, input_index)))

    def watermark(self, wm_ns: int) -> pa.RecordBatch | None:
        """Every input passed event time ``wm_ns``."""
        return self._check(self._guard(lambda: self.op.on_watermark(wm_ns)))

    def finish(self) -> pa.RecordBatch | None:
        """End of input: the watermark that closes everything."""
        return self.watermark(WATERMARK_MAX)

    def snapshot(self) -> bytes:
        return self._guard(self.op.snapshot)

    def state_size(self) -> int | None:
        """The operator's :meth:`~tandem.operators.Operator.state_size`."""
        return self._guard(self.op.state_size)

    def restore(self, data: bytes) -> None:
        self._guard(lambda: self.op.restore(data))


def _unpicklable_part(obj: Any, dumps, depth: int = 0) -> str | None:
    """Where in ``obj`` the part that ``dumps`` cannot pickle lies, e.g. ``fn -> lock (a
    _thread.lock)``: an object's attributes, a function's free variables and the globals
    it uses, searched a few levels deep; None if no single part fails."""
    if depth > 4:
        return None
    if isinstance(obj, types.FunctionType):
        code = obj.__code__
        items = []
        for name, cell in zip(code.co_freevars, obj.__closure__ or (), strict=False):
            with contextlib.suppress(ValueError):  # an empty cell
                items.append((name, cell.cell_contents))
        items += [(n, obj.__globals__[n]) for n in code.co_names if n in obj.__globals__]
    elif isinstance(obj, (list, tuple)):
        items = [(f"[{i}]", v) for i, v in enumerate(obj)]
    elif isinstance(obj, dict):
        items = [(f"[{k!r}]", v) for k, v in obj.items()]
    else:
        try:
            items = list(vars(obj).items())
        except TypeError:
            return None
    for name, value in items:
        try:
            dumps(value)
        except Exception:
            inner = _unpicklable_part(value, dumps, depth + 1)
            if inner:
                return f"{name}{'' if inner.startswith('[') else ' -> '}{inner}"
            kind = type(value)
            return f"{name} (a {kind.__module__}.{kind.__qualname__})"
    return None


def conform(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """``batch`` as a batch of ``schema``, which has the same columns and types up to
    nullability (see :func:`union_schema`)."""
    if batch.schema.equals(schema, check_metadata=False):
        return batch
    cols = [
        col if col.type.equals(f.type) else col.cast(f.type)
        for col, f in zip(batch.columns, schema, strict=True)
    ]
    return pa.RecordBatch.from_arrays(cols, schema=schema)


def union_schema(a: pa.Schema, b: pa.Schema) -> pa.Schema | None:
    """The schema that rows of ``a`` and rows of ``b`` both fit when the two differ in
    nullability only (nested fields too): nullable wherever either is. None if they
    differ otherwise (names, order or types)."""
    if a.names != b.names:
        return None
    fields = []
    for fa, fb in zip(a, b, strict=True):
        t = _union_type(fa.type, fb.type)
        if t is None:
            return None
        fields.append(pa.field(fa.name, t, fa.nullable or fb.nullable, metadata=fa.metadata))
    return pa.schema(fields, metadata=a.metadata)


def _union_type(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    if a.equals(b):
        return a
    if a.id != b.id or a.num_fields != b.num_fields or a.num_fields == 0:
        return None
    if pa.types.is_struct(a):
        kids = [_union_field(a.field(i), b.field(i)) for i in range(a.num_fields)]
        return None if None in kids else pa.struct(kids)
    if pa.types.is_list(a) or pa.types.is_large_list(a):
        kid = _union_field(a.value_field, b.value_field)
        if kid is None:
            return None
        return pa.list_(kid) if pa.types.is_list(a) else pa.large_list(kid)
    if pa.types.is_fixed_size_list(a):
        kid = _union_field(a.value_field, b.value_field)
        return None if kid is None or a.list_size != b.list_size else pa.list_(kid, a.list_size)
    return None


def _union_field(a: pa.Field, b: pa.Field) -> pa.Field | None:
    if a.name != b.name:
        return None
    t = _union_type(a.type, b.type)
    return None if t is None else pa.field(a.name, t, a.nullable or b.nullable)


def schema_differences(a: pa.Schema, b: pa.Schema) -> str:
    """What differs between ``a`` and ``b``, beyond nullability, in words."""
    out = []
    only_a = [n for n in a.names if n not in b.names]
    only_b = [n for n in b.names if n not in a.names]
    if only_a:
        out.append(f"only the first has {only_a}")
    if only_b:
        out.append(f"only the second has {only_b}")
    for f in a:
        if f.name in b.names:
            g = b.field(b.names.index(f.name))
            if _union_type(f.type, g.type) is None:
                out.append(f"{f.name!r} is {f.type} vs {g.type}")
    if not out:
        out.append(f"the column order differs: {a.names} vs {b.names}")
    return "; ".join(out)


def _schema_str(schema: pa.Schema) -> str:
    return (
        "["
        + ", ".join(f"{f.name}: {f.type}{'' if f.nullable else ' not null'}" for f in schema)
        + "]"
    )


class WatermarkTracker:
    """Per input channel, the last heartbeat epoch delivered; reports when the minimum
    over all channels advances (ended channels no longer hold it back)."""

    def __init__(self, channels: int) -> None:
        self.epochs = [0] * channels
        self.ended = [False] * channels
        self.current = 0

    def _advance(self) -> int | None:
        live = [e for e, done in zip(self.epochs, self.ended, strict=True) if not done]
        low = min(live) if live else max(self.epochs, default=0)
        if low > self.current:
            self.current = low
            return low
        return None

    def observe(self, channel: int, epoch: int) -> int | None:
        """Channel ``channel`` delivered heartbeat ``epoch``; the new minimum epoch if it
        advanced, else None."""
        if epoch > self.epochs[channel]:
            self.epochs[channel] = epoch
        return self._advance()

    def end(self, channel: int) -> int | None:
        """Channel ``channel`` ended; the new minimum epoch if that advanced it."""
        self.ended[channel] = True
        return self._advance()

    def all_ended(self) -> bool:
        return all(self.ended)


# -- routing: a Python mirror of the Rust outbox partitioners ---------------------------

HASH_SEED = 0x74616E64656D0001
"""Seed of the hash partitioner (tandem-core ``outbox::HASH_SEED``)."""
NULL_KEY_CHANNEL = 0

_M64 = (1 << 64) - 1


def xxh3_64(data: bytes, seed: int = 0) -> int:
    """XXH3-64 with a seed (the ``xxhash`` package, i.e. the reference C implementation):
    the hash the Rust outbox routes keys with (xxhash-rust's ``xxh3_64_with_seed``), so the
    reference executor routes rows identically."""
    return xxhash.xxh3_64_intdigest(data, seed=seed & _M64)


def _key_bytes(value: Any, typ: pa.DataType) -> bytes:
    if pa.types.is_signed_integer(typ):
        return struct.pack("<q", value)
    if pa.types.is_unsigned_integer(typ):
        return struct.pack("<Q", value)
    if pa.types.is_string(typ) or pa.types.is_large_string(typ):
        return value.encode()
    return bytes(value)


def hashable_key_type(typ: pa.DataType) -> bool:
    """Whether the hash partitioner accepts key columns of type ``typ``."""
    return (
        pa.types.is_integer(typ)
        or pa.types.is_string(typ)
        or pa.types.is_large_string(typ)
        or pa.types.is_binary(typ)
        or pa.types.is_large_binary(typ)
    )


def key_group_channel(group: int, key_groups: int, n: int) -> int:
    """The channel (partition) key group ``group`` of ``key_groups`` goes to among ``n``:
    the groups split into ``n`` contiguous ranges (tandem-core ``key_group_channel``)."""
    return group * n // key_groups


def key_group_range(partition: int, n: int, key_groups: int) -> range:
    """The key groups partition ``partition`` of ``n`` owns (:func:`key_group_channel`'s
    inverse): ``range(ceil(p·G/n), ceil((p+1)·G/n))``."""
    return range(-(-partition * key_groups // n), -(-(partition + 1) * key_groups // n))


def key_group(value: Any, key_groups: int) -> int:
    """The key group of one key value as the hash partitioner computes it: an integer
    hashes as 8 little-endian bytes (signed, or unsigned at 2**63 and above), a string its
    UTF-8 bytes, bytes themselves. ConfigError for anything else (a value that cannot be
    a key column's)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        v = int(value)
        data = struct.pack("<q", v) if v < (1 << 63) else struct.pack("<Q", v)
    elif isinstance(value, str):
        data = value.encode()
    elif isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
    else:
        raise ConfigError(
            f"{value!r} ({type(value).__name__}) cannot be a key: a key column holds "
            "integers, strings or bytes"
        )
    return xxh3_64(data, HASH_SEED) % key_groups


def hash_channels(
    keys: pa.Array,
    n: int,
    cache: dict | None = None,
    key_groups: int = DEFAULT_MAX_PARALLELISM,
) -> np.ndarray:
    """The output channel of every row under hash partitioning over ``n`` channels: its
    key group ``xxh3_64(canonical key bytes, HASH_SEED) % key_groups``, and the group's
    channel ``group * n // key_groups`` (:func:`key_group_channel`); integers hash their
    value as 8 little-endian bytes, strings/binaries their bytes, null keys go to channel
    0. ``cache`` (key value → channel, for this ``n``, ``key_groups`` and key type) saves
    rehashing keys."""
    import pyarrow.compute as pc

    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks()
    if not hashable_key_type(keys.type):
        raise ConfigError(
            f"hash partitioning on a key of type {keys.type} is not supported; use an "
            "integer, string or binary key column"
        )
    enc = pc.dictionary_encode(keys)
    uniques = enc.dictionary.to_pylist()
    cache = {} if cache is None else cache
    chosen = []
    for u in uniques:
        c = cache.get(u)
        if c is None:
            group = xxh3_64(_key_bytes(u, keys.type), HASH_SEED) % key_groups
            c = cache[u] = key_group_channel(group, key_groups, n)
        chosen.append(c)
    table = np.array([*chosen, NULL_KEY_CHANNEL], dtype=np.int64)
    codes = enc.indices.fill_null(len(uniques)).to_numpy(zero_copy_only=False)
    return table[codes.astype(np.int64)]


class Router:
    """Splits an upstream partition's output over the channels of one :class:`OutputEdge`
    exactly as the Rust outbox does: rebalance counts rows across every emit, and each
    channel's piece of a batch leaves as frames of at most ``batch_rows`` rows, cut at
    multiples of ``batch_rows`` within the piece."""

    def __init__(
        self, edge: OutputEdge, batch_rows: int, key_groups: int = DEFAULT_MAX_PARALLELISM
    ) -> None:
        self.edge = edge
        self.batch_rows = batch_rows
        self.key_groups = key_groups
        self.rows_emitted = 0
        self._hash_cache: dict = {}

    def route(self, batch: pa.RecordBatch) -> list[tuple[int, pa.RecordBatch]]:
        """``(channel, frame)`` pieces of ``batch``, each channel's frames in emit order."""
        return [
            (c, piece.slice(at, self.batch_rows))
            for c, piece in self._split(batch)
            for at in range(0, piece.num_rows, self.batch_rows)
        ]

    def _split(self, batch: pa.RecordBatch) -> list[tuple[int, pa.RecordBatch]]:
        rows = batch.num_rows
        n = len(self.edge.partitions)
        if rows == 0:
            return []
        start = self.rows_emitted
        self.rows_emitted += rows
        p = self.edge.partitioner
        if p == "broadcast":
            return [(c, batch) for c in range(n)]
        if p == "forward" or n == 1:
            return [(0, batch)]
        if p == "rebalance":
            targets = (start + np.arange(rows, dtype=np.int64)) % n
        else:
            targets = hash_channels(
                batch.column(self.edge.key), n, self._hash_cache, self.key_groups
            )
        out = []
        for c in range(n):
            idx = np.flatnonzero(targets == c)
            if len(idx):
                out.append((c, batch.take(pa.array(idx))))
        return out


def check_output_schema(task: Task) -> None:
    """Plan-time checks of an operator's declared output schema."""
    if task.schema is None:
        raise ConfigError(f"{task.describe()} has no output schema")
    check_event_time(task.schema, f"operator {task.name!r}")


__all__ = [
    "KINDS",
    "ORDERINGS",
    "PARTITIONERS",
    "Edge",
    "InputChannel",
    "LiveRescale",
    "OutputEdge",
    "Plan",
    "Router",
    "SourceStep",
    "Task",
    "TaskInstance",
    "WatermarkTracker",
    "hash_channels",
    "key_group",
    "key_group_channel",
    "key_group_range",
    "xxh3_64",
]


def dumps_keeping_files(plan: Plan) -> bytes:
    """``cloudpickle.dumps(plan)``, but each function shipped by value keeps its code's
    file name: cloudpickle writes ``<dynamic-code>`` instead (for payloads that do not
    depend on where a function was written), which leaves a traceback from a worker
    without the user's file and line."""
    import io

    import cloudpickle

    code_reduce = getattr(cloudpickle.cloudpickle, "_code_reduce", None)

    class Pickler(cloudpickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if obj is plan:  # the plan itself: by its fields, not through __reduce_ex__
                return object.__reduce_ex__(obj, 4)
            if code_reduce is not None and isinstance(obj, types.CodeType):
                rebuild, args = code_reduce(obj)
                return rebuild, tuple(
                    obj.co_filename if isinstance(a, str) and a == "<dynamic-code>" else a
                    for a in args
                )
            return super().reducer_override(obj)

    buf = io.BytesIO()
    Pickler(buf, protocol=5).dump(plan)
    return buf.getvalue()


def _plan_from_bytes(data: bytes) -> Plan:
    import cloudpickle

    return cloudpickle.loads(data)
