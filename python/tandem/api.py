"""The user API: a :class:`Job` builds a graph of :class:`Stream` s; :meth:`Job.plan` turns
it into the physical :class:`tandem.plan.Plan`; :meth:`Job.run` hands that to an engine.

```python
import tandem as td
job = td.Job("monitor", replication=2, ordering="liverobin", heartbeat_ms=10)
ev = job.source(td.sources.Synthetic(rate=5_000, keys=1_000, seed=7), parallelism=1)
out = ev.map(enrich, parallelism=2).key_by("key").process(td.CountPerKey(), parallelism=2)
out.sink(td.sinks.Parquet("out/"))
result = job.run(duration=60, faults=[td.Kill("process", partition=0, replica=0, at=30)])
```

Without a duration, :meth:`Job.run` runs until Ctrl-C/SIGTERM (or the end of bounded
sources) and :meth:`Job.start` returns a :class:`RunningJob` whose ``stop()`` ends it; either
way the stop is graceful: one stop point for every source, then a drain.

Everything that can be checked before start is checked while the graph is built (or at
the latest by :meth:`Job.plan`) and fails with a :class:`tandem.ConfigError` naming the
operator, the problem and what to do.

Output schemas: a source declares its schema; ``filter`` keeps its input schema, ``union``
the streams' common one (nullable wherever one of them is); ``map``/``flat_map`` take
``schema=`` or infer it by calling the function once on a zero-row batch of the input
schema; a ``KeyedProcess`` declares the class attribute ``schema`` or has it inferred the
same way (on a scratch copy); ``join`` and ``window`` derive theirs. Every operator output
must keep ``event_time_ns``.

Default names are the operator kind (``source``, ``map``, ``filter``, ``flat_map``,
``process``, ``join``, ``window``, ``sink``), suffixed ``_2``, ``_3``… when taken; explicit
names must be unique. Default parallelism: the largest parallelism among the operator's
inputs (an unkeyed window: 1; a sink: 1).
"""

from __future__ import annotations

import concurrent.futures
import copy
import inspect
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from tandem import operators as ops
from tandem import savepoints
from tandem.engines.common import Stop
from tandem.exceptions import ConfigError, TandemError
from tandem.faults import Fault, validate_faults
from tandem.plan import (
    DEFAULT_MAX_PARALLELISM,
    MAX_KEY_GROUPS,
    ORDERINGS,
    Edge,
    Plan,
    Task,
    hashable_key_type,
    schema_differences,
    union_schema,
)
from tandem.result import Result
from tandem.savepoints import Savepoint
from tandem.sinks import Sink
from tandem.sources import LogSource, Source

log = logging.getLogger("tandem")

RUN_OBSERVERS: list[Callable[[Job, Result], None]] = []
"""Called with the job and the :class:`Result` of every :meth:`Job.run` that returns
(``tandem run`` prints the summary of the runs a script makes itself)."""

LOCAL_DEFAULTS: dict[str, Any] = {}
"""Options of every run on the local engine that does not set them itself (``tandem run
--metrics-port`` serves the metrics of the runs a script makes itself)."""


def _local_defaults(runner: Any, options: dict) -> dict:
    if getattr(runner, "name", None) != "local" or not LOCAL_DEFAULTS:
        return options
    return {**LOCAL_DEFAULTS, **options}


def _positive_int(value: Any, what: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{what} must be an int >= {minimum}, got {value!r}")
    return value


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{what} must be a finite number, got {value!r}")
    return value


def _check_faults_fire(faults: list[Fault], end_s: float, job: str) -> None:
    """A run with no duration whose sources are all bounded ends at ``end_s``: a fault at
    or after it would never fire, and a fault-tolerance test would pass without it."""
    for f in faults:
        at = getattr(f, "at", None)
        if at is not None and at >= end_s:
            raise ConfigError(
                f"{f!r}: at={at} s is not before the end of the run: with no duration, job "
                f"{job!r} ends after its bounded sources' last row, {end_s:g} s of source "
                "time in, so the fault would never fire; schedule it earlier, or pass a "
                "duration= (seconds) longer than at"
            )


def _check_options(runner: Any, options: dict) -> None:
    """An option the engine's run() does not take is a ConfigError naming the ones it
    does (not a TypeError from deep inside the engine)."""
    try:
        params = inspect.signature(runner.run).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    internal = {"plan", "duration", "faults", "stop", "self"}
    known = [n for n, p in params.items() if n not in internal and p.kind is not p.VAR_POSITIONAL]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ConfigError(
            f"{', '.join(map(repr, unknown))}: not an option of the "
            f"{getattr(runner, 'name', type(runner).__name__)} engine's run; it takes "
            f"duration, faults, engine and {', '.join(known)}"
        )


@dataclass(eq=False)
class _Node:
    """A vertex of the logical graph (a task once planned)."""

    name: str
    kind: str  # "source" | "operator" | "sink"
    parallelism: int
    schema: pa.Schema
    inputs: list[tuple[_Node, int, str | None]] = field(default_factory=list)
    source: Source | None = None
    operator: ops.Operator | None = None
    sink: Sink | None = None
    key: str | None = None
    replication: int | None = None
    """A sink's own replication (None: the job's if the sink is replicable, else 1)."""


def _check_checkpoint(
    name: str,
    checkpoint_ms: Any,
    replication: int,
    ordering: str,
    restore: bool,
    heartbeat_ms: float,
    checkpoint_dir: Any = None,
) -> None:
    """Raise ConfigError unless ``checkpoint_ms`` (and ``checkpoint_dir``) fit the rest of
    the job."""
    if checkpoint_ms is None:
        if checkpoint_dir is not None:
            raise ConfigError(
                f"Job {name!r}: checkpoint_dir= is where durable checkpoints go, and "
                "checkpoint_ms= how often: give both"
            )
        return
    if _number(checkpoint_ms, f"Job {name!r}: checkpoint_ms") <= heartbeat_ms:
        raise ConfigError(
            f"Job {name!r}: checkpoint_ms={checkpoint_ms} must be more than the heartbeat "
            f"period (heartbeat_ms={heartbeat_ms}): a checkpoint is cut at a heartbeat"
        )
    if ordering == "kazoo" and replication == 1:
        raise ConfigError(
            f"Job {name!r}: checkpoint_ms at replication=1 rolls a lost worker back to a "
            "checkpoint, which ordering='kazoo' does not do; use replication >= 2 (durable "
            "checkpoints with checkpoint_dir=) or ordering 'liverobin' or 'none'"
        )
    if checkpoint_dir is not None:
        if not isinstance(checkpoint_dir, (str, os.PathLike)) or not os.fspath(checkpoint_dir):
            raise ConfigError(
                f"Job {name!r}: checkpoint_dir must be a directory path or a URI, got "
                f"{checkpoint_dir!r}"
            )
        if replication == 1 and restore:
            raise ConfigError(
                f"Job {name!r}: restore=True rebuilds lost replicas from live twins "
                "(replication >= 2); at replication=1 checkpoint_ms rolls them back to a "
                "checkpoint: drop restore=True"
            )
        return
    if replication != 1:
        raise ConfigError(
            f"Job {name!r}: checkpoint_ms alone is the passive configuration (replication=1, "
            f"rolled back to a checkpoint after a loss); this job has replication="
            f"{replication}: its lost replicas restore=True rebuilds from live twins, and "
            "checkpoint_dir=PATH with checkpoint_ms writes durable checkpoints there that "
            "the job resumes from (resume=True) after its driver is lost"
        )
    if restore:
        raise ConfigError(
            f"Job {name!r}: restore=True rebuilds lost replicas from live twins "
            "(replication >= 2); checkpoint_ms rolls them back to a checkpoint "
            "(replication=1): choose one"
        )


class Job:
    """A stream job: its knobs (DESIGN §5) and its graph.

    ``replication``: replicas per task partition (1 = none); ``ordering``: ``none``,
    ``liverobin`` or ``kazoo``; ``heartbeat_ms``: heartbeat period (> 0);
    ``buffer_timeout_ms``: the logical-time window a source batch covers, so the longest a
    row waits at its source (>= 0; 0: every release instant is a batch of its own);
    ``batch_rows``: the most rows a batch or frame holds (sources and outputs cut at fixed
    multiples of it); ``on_divergence``: ``"fail"`` (default) stops the job with
    :class:`tandem.DeterminismError` when two replicas of a task partition emit different
    output — the sinks may already hold a mix of both — and ``"log"`` logs it and goes on;
    ``kazoo``: a ``tandem.ordering.kazoo.KazooConfig`` (service addresses, session timeout,
    order batch) for ``ordering="kazoo"``; ``workers``: worker processes per replica group
    (default: the machine's cores divided by ``replication``, at least 1; see
    :meth:`tandem.plan.Plan.placement`); ``evict_after_ms``: a downstream replica whose
    input has waited this long for it to read (a frozen or overloaded process) while another
    replica of its partition keeps up is dropped by its upstream replicas, so it never holds
    its twins back (None: wait for it; one that falls half a link queue behind is dropped
    sooner); ``restore``: when a worker dies, rebuild its replicas from live twins while the
    job runs, so every partition gets back to ``replication`` replicas (DESIGN §4; local
    engine, ``liverobin`` and ``none`` orderings), and restart a lost Kafka sink from the
    input position its last transaction stored; ``replay_ms``: how much recent output
    every replica then keeps per channel to replay to a rebuilt downstream replica;
    ``failure_timeout_ms``: with ``restore``, a worker that sends no keepalive for this long
    (frozen, wedged) is declared lost: killed, so it never comes back, and rebuilt.
    ``checkpoint_ms``: the passive baseline (``replication=1``, local engine, not with
    KaZoo): every ``checkpoint_ms`` the workers cut every replica at one heartbeat epoch and
    write the cuts to local disk; a lost worker's replicas restart from the latest complete
    checkpoint and are replayed from there (``replay_ms`` then defaults to ``2 *
    checkpoint_ms + 3000``, so the replay windows reach back to it); a lost Kafka sink
    restarts from its last commit, as with ``restore``. ``checkpoint_dir`` (with
    ``checkpoint_ms``, any replication; at 1 beside the passive ones): durable
    checkpoints — every ``checkpoint_ms`` a savepoint of the whole job (one live replica
    of every partition cut at one heartbeat, the job going on) is written to a directory
    of its own in ``checkpoint_dir`` (a local path or a URI ``pyarrow.fs`` opens), the
    newest :data:`tandem.savepoints.KEEP_CHECKPOINTS` kept; when the process running the
    job dies, ``run(resume=True)`` (``tandem run --resume``) starts it from the newest
    complete one (the local engine; Spark at ``replication >= 2``).
    ``max_parallelism``: the key groups of every keyed (``key_by``) edge — a key's group is
    its hash modulo this, and each partition of a keyed task owns a contiguous range of
    groups — so the most partitions a keyed task can have, now or when it resumes from a
    savepoint at another parallelism (it then takes whole groups of the old partitions'
    state). Keep it the same across savepoints; 128 by default.

    The batch is the unit of determinism: every replica of a task partition is called
    with the same batches, so an operator function must be deterministic for a given input
    batch — nothing more (it may compute over its whole batch, like a ``mapInArrow``
    function).
    """

    def __init__(
        self,
        name: str,
        replication: int = 2,
        ordering: str = "liverobin",
        heartbeat_ms: float = 10,
        buffer_timeout_ms: float = 5,
        batch_rows: int = 1024,
        kazoo: Any = None,
        on_divergence: str = "fail",
        workers: int | None = None,
        evict_after_ms: float | None = 1000,
        restore: bool = False,
        replay_ms: float | None = None,
        failure_timeout_ms: float = 2000,
        checkpoint_ms: float | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        max_parallelism: int = DEFAULT_MAX_PARALLELISM,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"Job name must be a non-empty string, got {name!r}")
        self.name = name
        self.replication = _positive_int(replication, f"Job {name!r}: replication")
        if ordering not in ORDERINGS:
            raise ConfigError(
                f"Job {name!r}: ordering {ordering!r} is unknown; use one of {list(ORDERINGS)}"
            )
        self.ordering = ordering
        if _number(heartbeat_ms, f"Job {name!r}: heartbeat_ms") <= 0:
            raise ConfigError(
                f"Job {name!r}: heartbeat_ms must be > 0 (got {heartbeat_ms}); heartbeats "
                "bound how long merges and windows wait, 10 ms is the default"
            )
        if round(heartbeat_ms * 1_000_000) < 1:
            raise ConfigError(f"Job {name!r}: heartbeat_ms={heartbeat_ms} is below 1 ns")
        self.heartbeat_ms = heartbeat_ms
        if _number(buffer_timeout_ms, f"Job {name!r}: buffer_timeout_ms") < 0:
            raise ConfigError(
                f"Job {name!r}: buffer_timeout_ms must be >= 0 (got {buffer_timeout_ms}); "
                "0 sends every batch at once"
            )
        self.buffer_timeout_ms = buffer_timeout_ms
        self.batch_rows = _positive_int(batch_rows, f"Job {name!r}: batch_rows")
        if on_divergence not in ("fail", "log"):
            raise ConfigError(
                f"Job {name!r}: on_divergence must be 'fail' or 'log', got {on_divergence!r}"
            )
        self.on_divergence = on_divergence
        self.workers = None if workers is None else _positive_int(workers, f"Job {name!r}: workers")
        evict_what = f"Job {name!r}: evict_after_ms"
        if evict_after_ms is not None and _number(evict_after_ms, evict_what) < 0:
            raise ConfigError(
                f"Job {name!r}: evict_after_ms must be >= 0 or None (got {evict_after_ms}); "
                "None never drops a slow replica"
            )
        self.evict_after_ms = evict_after_ms
        if not isinstance(restore, bool):
            raise ConfigError(f"Job {name!r}: restore must be True or False, got {restore!r}")
        self.restore = restore
        _check_checkpoint(
            name, checkpoint_ms, self.replication, ordering, restore, heartbeat_ms, checkpoint_dir
        )
        self.checkpoint_ms = checkpoint_ms
        self.checkpoint_dir = None if checkpoint_dir is None else os.fspath(checkpoint_dir)
        # At r = 1 the passive checkpoints roll a lost worker back within the run, and
        # with checkpoint_dir the durable ones are written beside them (Plan.durable_dir).
        passive = checkpoint_ms is not None and (checkpoint_dir is None or self.replication == 1)
        self._passive = passive
        if replay_ms is None:
            replay_ms = 2 * checkpoint_ms + 3000 if passive else 3000
        if _number(replay_ms, f"Job {name!r}: replay_ms") <= 0:
            raise ConfigError(
                f"Job {name!r}: replay_ms must be > 0 (got {replay_ms}); it bounds the output "
                "each replica keeps to replay to a rebuilt downstream replica"
            )
        self.replay_ms = replay_ms
        if _number(failure_timeout_ms, f"Job {name!r}: failure_timeout_ms") <= 0:
            raise ConfigError(
                f"Job {name!r}: failure_timeout_ms must be > 0 (got {failure_timeout_ms})"
            )
        self.failure_timeout_ms = failure_timeout_ms
        if kazoo is not None:
            from tandem.ordering.kazoo import KazooConfig

            if not isinstance(kazoo, KazooConfig):
                raise ConfigError(
                    f"Job {name!r}: kazoo must be a tandem.ordering.kazoo.KazooConfig, got "
                    f"{type(kazoo).__name__}"
                )
            if ordering != "kazoo":
                raise ConfigError(
                    f"Job {name!r}: kazoo= settings given, but ordering is {ordering!r}; set "
                    "ordering='kazoo' or drop them"
                )
        self.kazoo = kazoo
        self.max_parallelism = _positive_int(max_parallelism, f"Job {name!r}: max_parallelism")
        if self.max_parallelism > MAX_KEY_GROUPS:
            raise ConfigError(
                f"Job {name!r}: max_parallelism={max_parallelism} is above {MAX_KEY_GROUPS}; "
                "it is the number of key groups every keyed edge hashes into"
            )
        self._nodes: list[_Node] = []

    def __repr__(self) -> str:
        return (
            f"Job({self.name!r}, replication={self.replication}, ordering={self.ordering!r}, "
            f"tasks={[n.name for n in self._nodes]})"
        )

    # -- graph building ----------------------------------------------------------------

    def _name(self, name: str | None, default: str) -> str:
        taken = {n.name for n in self._nodes}
        if name is None:
            candidate, k = default, 2
            while candidate in taken:
                candidate, k = f"{default}_{k}", k + 1
            return candidate
        if not isinstance(name, str) or not name:
            raise ConfigError(f"a task name must be a non-empty string, got {name!r}")
        if name in taken:
            raise ConfigError(
                f"duplicate task name {name!r} in job {self.name!r}; every operator, source "
                "and sink needs a unique name"
            )
        return name

    def _replication_of(self, node: _Node) -> int:
        """A task's replication: the job's; a sink's its own, or the job's if it can run
        replicated, else 1."""
        if node.kind != "sink":
            return self.replication
        if node.replication is not None:
            return node.replication
        return self.replication if node.sink.replicable else 1

    def _add(self, node: _Node) -> _Node:
        self._nodes.append(node)
        return node

    def source(
        self, source: Source, parallelism: int | None = None, name: str | None = None
    ) -> Stream:
        """Add a source; returns its stream. ``parallelism``: its partitions (default 1; a
        log such as Kafka has its own — one source partition per log partition — and
        refuses another)."""
        if not isinstance(source, Source):
            raise ConfigError(
                f"job.source() needs a tandem source (e.g. td.sources.Synthetic(...)), got "
                f"{type(source).__name__}"
            )
        name = self._name(name, "source")
        natural = source.natural_parallelism() if isinstance(source, LogSource) else None
        if parallelism is None:
            parallelism = natural or 1
        par = _positive_int(parallelism, f"source {name!r}: parallelism")
        if natural is not None and par != natural:
            raise ConfigError(
                f"source {name!r}: parallelism={par}, but {source.describe()} has {natural} "
                "partitions: a log is read with one source partition per partition; leave "
                "parallelism out"
            )
        schema = source.schema()
        ops.check_event_time(schema, f"source {name!r}")
        node = self._add(_Node(name, "source", par, schema, source=copy.deepcopy(source)))
        return Stream(self, (node,), None, schema)

    # -- planning ----------------------------------------------------------------------

    def plan(self) -> Plan:
        """Validate the whole graph and expand it into the physical plan."""
        if not any(n.kind == "source" for n in self._nodes):
            raise ConfigError(f"job {self.name!r} has no source; add one with job.source(...)")
        consumers: dict[int, int] = {id(n): 0 for n in self._nodes}
        for n in self._nodes:
            for up, _, _ in n.inputs:
                consumers[id(up)] += 1
        for n in self._nodes:
            if n.kind != "sink" and consumers[id(n)] == 0:
                raise ConfigError(
                    f"the output of {n.kind} {n.name!r} goes nowhere: the stream has no sink; "
                    "end it with .sink(td.sinks.Collect()) (or another sink) or remove it"
                )
        order = _toposort(self._nodes)
        ids = {id(n): i for i, n in enumerate(order)}
        tasks = []
        for i, n in enumerate(order):
            edges = []
            for up, input_index, key in n.inputs:
                if key is not None:
                    part = "hash"
                    if n.parallelism > self.max_parallelism:
                        raise ConfigError(
                            f"{n.kind} {n.name!r}: parallelism {n.parallelism} is above the "
                            f"job's max_parallelism={self.max_parallelism}, the key groups "
                            f"its keyed input is split into; raise "
                            f"Job(max_parallelism=...) to at least {n.parallelism}"
                        )
                elif up.parallelism == n.parallelism:
                    part = "forward"
                else:
                    part = "rebalance"
                edges.append(Edge(ids[id(up)], input_index, part, key))
            edges.sort(key=lambda e: (e.input_index, e.upstream))
            in_schemas: list[pa.Schema] = []
            for e in edges:  # a union's input: nullable where any of its streams is
                up_schema = order[e.upstream].schema
                if e.input_index == len(in_schemas):
                    in_schemas.append(up_schema)
                elif up_schema is not None and in_schemas[-1] is not None:
                    in_schemas[-1] = union_schema(in_schemas[-1], up_schema) or in_schemas[-1]
            source = copy.deepcopy(n.source)
            if isinstance(source, LogSource):
                # Once per plan, on the plan's own copy: where every replica starts reading.
                source.resolve(n.parallelism)
            tasks.append(
                Task(
                    id=i,
                    name=n.name,
                    kind=n.kind,
                    parallelism=n.parallelism,
                    replication=self._replication_of(n),
                    inputs=tuple(edges),
                    input_schemas=tuple(in_schemas),
                    schema=n.schema,
                    source=source,
                    operator=copy.deepcopy(n.operator),
                    sink=copy.deepcopy(n.sink),
                    key=n.key,
                )
            )
        plan = Plan(
            job=self.name,
            replication=self.replication,
            ordering=self.ordering,
            heartbeat_ms=self.heartbeat_ms,
            buffer_timeout_ms=self.buffer_timeout_ms,
            batch_rows=self.batch_rows,
            tasks=tuple(tasks),
            kazoo=self.kazoo,
            on_divergence=self.on_divergence,
            workers=self.workers,
            evict_after_ms=self.evict_after_ms,
            restore=self.restore,
            replay_ms=self.replay_ms,
            failure_timeout_ms=self.failure_timeout_ms,
            checkpoint_ms=self.checkpoint_ms if self._passive else None,
            durable_ms=None if self.checkpoint_dir is None else self.checkpoint_ms,
            durable_dir=self.checkpoint_dir,
            max_parallelism=self.max_parallelism,
        )
        plan.check_picklable()  # what cannot be shipped to the workers fails here
        return plan

    def _engine(self, engine: str | Any) -> Any:
        from tandem import engines

        if isinstance(engine, str):
            return engines.get(engine)
        if isinstance(engine, engines.Engine):
            return engine
        raise ConfigError(
            f"engine must be a name like 'local' or an engine object (a name and a run() "
            f"method: tandem.engines.Engine), got {type(engine).__name__}"
        )

    def _prepare(
        self,
        duration: float | None,
        faults: Iterable[Fault],
        engine: str | Any,
        from_savepoint: str | os.PathLike | None = None,
        options: dict | None = None,
    ) -> tuple[Plan, Any, list[Fault], float | None]:
        """Check a run's arguments: the plan, the engine, the faults, and the duration to
        hand the engine (None: until stopped, on an engine that can); ``from_savepoint``:
        the plan resumed from that savepoint (checked here, before anything starts), and
        ``options`` adjusted for it."""
        if duration is not None and _number(duration, "duration") <= 0:
            raise ConfigError(
                f"duration must be > 0 seconds, got {duration!r} (None: until stopped)"
            )
        plan = self.plan()
        runner = self._engine(engine)
        if plan.durable_dir is not None:
            self._check_durable(plan, runner)
        if from_savepoint is not None:
            plan = self._resumed(plan, runner, duration, from_savepoint, options)
        from tandem import engines

        natural_s = None  # with no duration: when every source is bounded, their end
        if duration is None:
            natural = plan.natural_end_ns()
            natural_s = None if natural is None else natural / 1e9
            if natural_s is None and not engines.stoppable(runner):
                raise ConfigError(
                    f"job {self.name!r}: the {runner.name} engine runs a "
                    "job for a fixed time, and a source of this job never ends; pass "
                    "duration= (seconds), or run it on the local engine"
                )
        faults = list(faults)
        validate_faults(faults, plan, math.inf if duration is None else duration)
        if natural_s is not None:
            _check_faults_fire(faults, natural_s, self.name)
            if not engines.stoppable(runner):
                duration = natural_s  # every source is bounded: until their last row
        return plan, runner, faults, duration

    def _check_durable(self, plan: Plan, runner: Any) -> None:
        """Raise ConfigError unless a job with durable checkpoints can run as asked."""
        if not getattr(runner, "savepoints", False):
            raise ConfigError(
                f"job {self.name!r}: checkpoint_dir= runs on the local and the spark engine, "
                f"not on {getattr(runner, 'name', runner)!r}"
            )
        for task in plan.tasks:
            sink = task.sink
            if task.kind == "sink" and not (
                sink.in_result or sink.commits_at_checkpoints or sink.restartable
            ):
                raise ConfigError(
                    f"job {self.name!r}: checkpoint_dir= does not take sink {task.name!r} "
                    f"({sink.describe()}): it writes outside the job as it goes, and the "
                    "rows it wrote between the newest checkpoint and a lost driver would be "
                    "written again; file sinks (Parquet, Csv) commit at checkpoints, Kafka "
                    "stores its position with what it commits, Collect and Latency keep "
                    "their rows in the Result, and a job stopped with a savepoint resumes "
                    "exactly with any sink"
                )

    def _resume_point(
        self, resume: bool, from_savepoint: str | os.PathLike | None
    ) -> str | os.PathLike | None:
        """Where a run starts from: ``from_savepoint``, or with ``resume`` the newest
        complete checkpoint in ``checkpoint_dir`` (None: none yet, from the beginning). A
        run that does not resume is refused when ``checkpoint_dir`` holds checkpoints."""

        if not isinstance(resume, bool):
            raise ConfigError(f"resume must be True or False, got {resume!r}")
        if self.checkpoint_dir is None:
            if resume:
                raise ConfigError(
                    f"job {self.name!r}: resume=True continues from the newest checkpoint in "
                    "the job's checkpoint_dir, and this job has none: give "
                    "Job(checkpoint_ms=..., checkpoint_dir=PATH)"
                )
            return from_savepoint
        if not resume:
            savepoints.check_no_checkpoints(self.checkpoint_dir, self.name)
            savepoints.clear_checkpoints(self.checkpoint_dir)
            if from_savepoint is None:
                savepoints.settle_parts(self.plan(), None)  # written anew, from the start
            return from_savepoint
        if from_savepoint is not None:
            raise ConfigError(
                f"job {self.name!r}: resume=True starts from the newest checkpoint, "
                "from_savepoint= from a savepoint: give one of them"
            )
        latest = savepoints.latest_checkpoint(self.checkpoint_dir, self.name)
        if latest is None:
            savepoints.clear_checkpoints(self.checkpoint_dir)
            savepoints.settle_parts(self.plan(), None)
            log.info(
                "job %r: no complete checkpoint in %s; starting from the beginning",
                self.name,
                self.checkpoint_dir,
            )
            return None
        savepoints.clear_checkpoints(self.checkpoint_dir, after=latest.epoch)
        savepoints.settle_parts(self.plan(), latest)
        log.info(
            "job %r: resuming from %s (heartbeat %d, %.2f s of source time)",
            self.name,
            latest.path,
            latest.epoch,
            latest.source_time_s,
        )
        return latest.path

    def _resumed(
        self,
        plan: Plan,
        runner: Any,
        duration: float | None,
        path: str | os.PathLike,
        options: dict | None,
    ) -> Plan:
        """``plan`` resumed from the savepoint at ``path`` (:func:`tandem.savepoints.resume`):
        refused with a ConfigError naming what differs, before anything starts."""

        if not getattr(runner, "savepoints", False):
            raise ConfigError(
                f"job {self.name!r}: from_savepoint= runs on the local and the spark engine, "
                f"not on {getattr(runner, 'name', runner)!r}"
            )
        plan = savepoints.resume(path, plan)
        at_s = plan.resumed.epoch * plan.heartbeat_ns / 1e9
        if duration is not None and duration <= at_s:
            raise ConfigError(
                f"job {self.name!r}: duration={duration:g} s of source time ends before the "
                f"savepoint's cut at {at_s:.2f} s (a resumed job's source time goes on from "
                "there)"
            )
        if options is not None:
            if options.get("check"):
                raise ConfigError(
                    f"job {self.name!r}: check=True compares the output with a run from the "
                    "start, and a job resumed from a savepoint emits only what follows the "
                    "cut; leave check out"
                )
            options["check"] = False
        return plan

    def run(
        self,
        duration: float | None = None,
        faults: Iterable[Fault] = (),
        engine: str | Any = "local",
        from_savepoint: str | os.PathLike | None = None,
        savepoint_on_stop: str | os.PathLike | None = None,
        resume: bool = False,
        control: bool = False,
        **options: Any,
    ) -> Result:
        """Run the job on an engine (``"local"``, the default, or an engine object with
        ``run(plan, duration=, faults=, ...)``) and return its :class:`Result`.

        ``duration``: seconds of source time. None (the default): until stopped — Ctrl-C
        (SIGINT) or SIGTERM — or, when every source is bounded (a file,
        ``Synthetic(limit=...)``), until their last row. On the first signal the job stops
        gracefully: every source ends at one stop point, later than anything emitted (at
        most about a second of source time ahead), what is in flight drains to the sinks,
        and the result is that of a run of exactly that length (``Result.duration_s``);
        a second signal kills the workers at once (KeyboardInterrupt). Signals reach the
        main thread only: from another thread, use :meth:`start`.

        ``faults``: faults to inject (``td.Kill``, ``td.KillWorker``, ``td.Pause``,
        ``td.KillHeartbeats``, ``td.Chaos``), checked against the plan first: one naming
        what the job does not have, or due at or after the end of the run (``duration``,
        or the end of the bounded sources), is a :class:`ConfigError` before anything
        starts.

        ``options`` go to the engine; the local engine takes ``progress`` (a progress bar
        on stderr; default: when stderr is a terminal), ``warmup`` (seconds of output left
        out of the latency figures), ``check`` (compare the output with the reference
        executor; default True), ``timeout`` (bounds the run; default duration + 60 s),
        ``host`` (the workers' address, default 127.0.0.1) and ``metrics_port``
        (Prometheus metrics on 127.0.0.1 while it runs). An option the engine does not
        take is a :class:`ConfigError` naming the ones it does.

        ``from_savepoint``: resume from the savepoint at that path or URI (taken with
        :meth:`RunningJob.savepoint` or ``RunningJob.stop(savepoint=...)``; local engine):
        every task partition starts from its state there, found by task name, and the
        sources continue after the cut, so the output goes on where the savepoint's run
        left it — nothing lost, nothing twice. The operators' code may have changed; the
        tasks, their kinds, parallelism and inputs, and ``heartbeat_ms`` may not (a
        :class:`ConfigError` naming the task and what differs, as is a savepoint that is
        partial, corrupt or of another job, before anything starts). Source time goes on
        from the cut: ``duration`` and fault times count from the stream's start, and the
        output is not checked against the reference (``check`` is off).

        ``savepoint_on_stop``: with no ``duration``, the first Ctrl-C or SIGTERM stops the
        job at a savepoint written to that path (as ``RunningJob.stop(savepoint=...)``):
        ``from_savepoint=`` the same path continues it, with new code if need be. A path
        that holds anything is refused before the job starts (ConfigError); a savepoint
        that could not be cut raises TandemError once the job has stopped. A job whose
        bounded sources end it by themselves writes none.

        ``resume``: a job with durable checkpoints (``Job(checkpoint_ms=...,
        checkpoint_dir=PATH)``) starts from the newest complete checkpoint in PATH, as
        ``from_savepoint=`` would — after its driver was killed, say — or from the
        beginning when there is none yet; a run without ``resume`` refuses a
        ``checkpoint_dir`` that holds checkpoints (it would write beside them).

        ``control``: with no ``duration``, listen on a Unix socket of this user's (see
        :mod:`tandem.control`) for ``tandem savepoint PATH`` from another shell: a
        savepoint written while the job runs, or (``--stop``) the job stopped at one, as
        ``RunningJob.savepoint`` and ``stop(savepoint=...)`` do. ``tandem run`` listens."""
        if savepoint_on_stop is not None:
            if duration is not None:
                raise ConfigError(
                    f"job {self.name!r}: savepoint_on_stop= is for a run until stopped "
                    f"(no duration); this one ends by itself after {duration} s — take a "
                    "savepoint while it runs with job.start() and handle.savepoint(path)"
                )
            savepoints.check_target(savepoint_on_stop)
        from_savepoint = self._resume_point(resume, from_savepoint)
        result = self._run(
            duration, faults, engine, options, from_savepoint, savepoint_on_stop, control
        )
        for observe in list(RUN_OBSERVERS):
            observe(self, result)
        return result

    def _run(
        self,
        duration: float | None,
        faults: Iterable[Fault],
        engine: str | Any,
        options: dict,
        from_savepoint: str | os.PathLike | None = None,
        savepoint_on_stop: str | os.PathLike | None = None,
        control: bool = False,
    ) -> Result:
        plan, runner, faults, duration = self._prepare(
            duration, faults, engine, from_savepoint, options
        )
        try:
            return self._run_prepared(
                plan, runner, faults, duration, options, savepoint_on_stop, control
            )
        finally:  # the run's rescaled states (the engine removes them too, as it ends)
            savepoints.release(plan)

    def _run_prepared(
        self,
        plan: Plan,
        runner: Any,
        faults: list,
        duration: float | None,
        options: dict,
        savepoint_on_stop: str | os.PathLike | None,
        control: bool,
    ) -> Result:
        _check_options(runner, options)
        options = _local_defaults(runner, options)
        if duration is not None:  # an engine that cannot stop: bounded sources, to their end
            return runner.run(plan, duration=duration, faults=faults, **options)
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError(
                f"job {self.name!r}: run() without a duration stops on SIGINT/SIGTERM, which "
                "only the main thread receives; from this thread, use handle = job.start() "
                "and handle.stop(), or pass duration="
            )
        stop = Stop()
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {s: signal.getsignal(s) for s in signals}
        saved: list = []  # the stop's savepoint, asked for on the first signal

        def on_signal(signo: int, _frame) -> None:
            name = signal.Signals(signo).name
            if not stop.requested:
                at = (
                    ""
                    if savepoint_on_stop is None
                    else f" at a savepoint in {os.fspath(savepoint_on_stop)}"
                )
                print(
                    f"\ntandem: {name}: stopping job {self.name!r}{at}, draining what is in "
                    "flight to the sinks (Ctrl-C again kills its workers at once)",
                    file=sys.stderr,
                    flush=True,
                )
                if savepoint_on_stop is None:
                    stop.request()
                else:
                    saved.append(stop.savepoint(os.fspath(savepoint_on_stop), stop=True))
                return
            stop.kill()
            print(
                f"\ntandem: {name} again: killing the workers of job {self.name!r} at once",
                file=sys.stderr,
                flush=True,
            )
            raise KeyboardInterrupt

        server = None
        if control:
            from tandem.control import ControlServer

            server = ControlServer(self.name, stop.savepoint, on_stop=saved.append)
        for s in signals:
            signal.signal(s, on_signal)
        try:
            result = runner.run(plan, duration=None, faults=faults, stop=stop, **options)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            if server is not None:
                server.close()
        if saved:
            result.savepoint = saved[0].result()  # raises if it could not be cut
        return result

    def start(
        self,
        duration: float | None = None,
        faults: Iterable[Fault] = (),
        engine: str | Any = "local",
        from_savepoint: str | os.PathLike | None = None,
        resume: bool = False,
        **options: Any,
    ) -> RunningJob:
        """Start the job in a thread of this process and return at once: a
        :class:`RunningJob` to stop it (``stop()``: the graceful stop of :meth:`run`),
        wait for it and get its :class:`Result`. It runs until stopped, or for
        ``duration`` seconds of source time, or, when every source is bounded, until
        their last row. Arguments as for :meth:`run` (checked here, before it starts);
        the engine must be able to stop a run (the local engine can). ``from_savepoint``:
        resume from a savepoint, and ``resume`` from the newest checkpoint, as for
        :meth:`run`."""
        from_savepoint = self._resume_point(resume, from_savepoint)
        plan, runner, faults, _ = self._prepare(duration, faults, engine, from_savepoint, options)
        from tandem import engines

        if not engines.stoppable(runner):
            raise ConfigError(
                f"job {self.name!r}: the {runner.name} engine cannot "
                "stop a run it started; call job.run(duration=...) instead of job.start()"
            )
        try:
            # The engine's options, here rather than in its thread.
            _check_options(runner, options)
            runner.check(plan, duration, faults, **options)
        except BaseException:
            savepoints.release(plan)
            raise
        handle = RunningJob(self.name)
        handle._start(runner, plan, duration, faults, options)
        return handle

    def run_reference(self, duration: float | None = None, t0_ns: int = 0) -> Result:
        """Run the job in this process with the deterministic single-process reference
        executor (:mod:`tandem.reference`), the oracle replicated runs are compared with.
        ``duration``: seconds of source time (None: when every source is bounded, until
        their last row). A Kafka source is replayed from its log: pass the ``t0_ns`` of
        the run to replay (``Result.t0_ns``), whose heartbeat markers cut its batches and
        end it."""
        from tandem import reference

        if duration is not None and _number(duration, "duration") <= 0:
            raise ConfigError(f"duration must be > 0 seconds, got {duration!r}")
        plan = self.plan()
        if duration is None:
            natural = plan.natural_end_ns()
            if natural is None:
                raise ConfigError(
                    f"job {self.name!r}: a source never ends, so the reference run needs "
                    "duration= (seconds of source time; Result.duration_s of the run to "
                    "replay)"
                )
            duration = natural / 1e9
        return reference.run(plan, duration=duration, t0_ns=t0_ns)


class RunningJob:
    """A job started by :meth:`Job.start`, running in a thread of this process.

    ``stop()`` stops it gracefully (every source ends at one stop point later than
    anything emitted, what is in flight drains to the sinks, the sinks commit) and
    returns its :class:`Result`; ``kill()`` kills its workers at once; ``wait(timeout)``
    waits for it to end by itself (a bounded job) and returns the Result, or raises
    ``TimeoutError``; ``result()`` waits as long as it takes. A failed job's exception is
    raised by all three. As a context manager it is stopped when the block ends (killed
    when the block ends by an exception such as KeyboardInterrupt) and waited for.

    ``savepoint(path)`` writes a savepoint of the running job (one consistent cut of every
    task partition at one heartbeat) while it goes on; ``stop(savepoint=path)`` stops it
    exactly at such a cut. ``Job.run(from_savepoint=path)`` resumes from either."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._stop = Stop()
        self._thread: threading.Thread | None = None
        self._result: Result | None = None
        self._error: BaseException | None = None

    def __repr__(self) -> str:
        state = "running" if self.running else "done"
        return f"RunningJob({self.name!r}, {state})"

    def _start(
        self, runner: Any, plan: Plan, duration: float | None, faults: list, options: dict
    ) -> None:
        options = _local_defaults(runner, options)

        def body() -> None:
            try:
                self._result = runner.run(
                    plan, duration=duration, faults=faults, stop=self._stop, **options
                )
            except BaseException as exc:  # handed to whoever waits
                self._error = exc
            finally:  # a savepoint asked for and not taken fails now, not never
                self._stop.close_savepoints(
                    f"savepoint not taken: job {self.name!r} ended before it was cut"
                )
                savepoints.release(plan)

        self._thread = threading.Thread(target=body, name=f"tandem-job-{self.name}", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the job has not ended yet (its result is not ready)."""
        return self._thread is not None and self._thread.is_alive()

    def stop(
        self, timeout: float | None = None, savepoint: str | os.PathLike | None = None
    ) -> Result:
        """Stop the job gracefully and wait (at most ``timeout`` seconds) for its Result.

        ``savepoint``: a path or URI to write a savepoint to, cut exactly where the job
        stops: its stop point is a heartbeat, every task partition is cut right after it,
        and nothing after it is consumed (what is in flight then only drains to the
        sinks, whose input positions are in the cut). ``Job.run(from_savepoint=...)``
        continues from it. A path that holds anything is refused (ConfigError) before the
        job is stopped; a savepoint that could not be cut raises TandemError once the job
        has stopped."""
        if savepoint is None:
            self._stop.request()
            return self.wait(timeout)

        savepoints.check_target(savepoint)
        asked = self._stop.savepoint(os.fspath(savepoint), stop=True)
        result = self.wait(timeout)
        asked.result()  # decided by the time the run ends: raises if it was not taken
        return result

    def savepoint(self, path: str | os.PathLike, timeout: float | None = 60.0) -> Savepoint:
        """Write a savepoint of the running job to ``path`` (a local directory, created, or
        a URI :func:`pyarrow.fs.FileSystem.from_uri` opens) and return it once written;
        the job goes on meanwhile, its output unaffected. One live replica of every task
        partition, the sinks included, is cut right after one heartbeat a little ahead of
        the sources' clock (:mod:`tandem.savepoints` has the format). Raises ConfigError if
        ``path`` holds anything (a savepoint is never overwritten), TandemError if the
        savepoint could not be taken (the job ended first, a replica was lost while
        cut), TimeoutError after ``timeout`` seconds (None: no limit)."""

        if not self.running:
            raise savepoints.failed(f"job {self.name!r} is not running")
        savepoints.check_target(path)
        asked = self._stop.savepoint(os.fspath(path))
        try:
            return asked.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"job {self.name!r}: the savepoint at {os.fspath(path)!r} was not written "
                f"within {timeout:g} s"
            ) from None

    def rescale(self, task: str, parallelism: int, timeout: float | None = 60.0) -> dict:
        """Change the parallelism of keyed operator task ``task`` while the job runs, with
        nothing stopped, lost or doubled (the local engine; :mod:`tandem.rescale` says
        which tasks can). The switch comes right after one heartbeat about a second
        ahead: the tasks feeding ``task`` route what follows over ``parallelism``
        partitions, its partitions are cut there and their keyed states split by key
        group, and the new partitions start, in the processes that run the old ones.
        Returns the rescale's record (as in :attr:`tandem.Result.rescales`) once the
        switch is done. Raises ConfigError for a task that cannot be rescaled so (naming
        why), TandemError if the rescale was given up (the job then runs on unchanged),
        TimeoutError after ``timeout`` seconds."""
        if not self.running:
            raise TandemError(f"job {self.name!r} is not running")
        asked = self._stop.rescale(task, parallelism)
        try:
            return asked.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"job {self.name!r}: the rescale of {task!r} to {parallelism} partitions was "
                f"not done within {timeout:g} s"
            ) from None

    def kill(self, timeout: float | None = None) -> None:
        """Kill the job's workers at once and wait for them to be gone; the sinks may hold
        part of its output. Waiting for the job afterwards raises TandemError."""
        self._stop.kill()
        if self._thread is not None:
            self._thread.join(timeout)

    def wait(self, timeout: float | None = None) -> Result:
        """The job's Result once it has ended; TimeoutError if it has not within
        ``timeout`` seconds (None: wait as long as it takes)."""
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout < 0
        ):
            raise ConfigError(f"timeout must be None or a number of seconds >= 0, got {timeout!r}")
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(
                    f"job {self.name!r} is still running after {timeout:g} s; stop() ends it"
                )
        if self._error is not None:
            raise self._error
        return self._result

    def result(self) -> Result:
        """Wait for the job to end by itself (or by :meth:`stop`) and return its Result."""
        return self.wait()

    def __enter__(self) -> RunningJob:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.stop()
            return
        self.kill()
        if self._thread is not None:
            self._thread.join()


def _toposort(nodes: list[_Node]) -> list[_Node]:
    """Kahn's algorithm; ties broken by creation order so task ids are deterministic."""
    indeg = {id(n): len(n.inputs) for n in nodes}
    out: dict[int, list[_Node]] = {id(n): [] for n in nodes}
    for n in nodes:
        for up, _, _ in n.inputs:
            out[id(up)].append(n)
    pos = {id(n): i for i, n in enumerate(nodes)}
    ready = [n for n in nodes if indeg[id(n)] == 0]
    order: list[_Node] = []
    while ready:
        ready.sort(key=lambda n: pos[id(n)])
        n = ready.pop(0)
        order.append(n)
        for d in out[id(n)]:
            indeg[id(d)] -= 1
            if indeg[id(d)] == 0:
                ready.append(d)
    if len(order) != len(nodes):
        stuck = sorted(n.name for n in nodes if indeg[id(n)] > 0)
        raise ConfigError(f"the job graph has a cycle through {stuck}; streams must form a DAG")
    return order


class Stream:
    """The output of one or more tasks (several after ``union``), optionally keyed."""

    def __init__(
        self, job: Job, heads: tuple[_Node, ...], key: str | None, schema: pa.Schema
    ) -> None:
        self.job = job
        self._heads = heads
        self.key = key
        self.schema = schema

    def __repr__(self) -> str:
        key = f", key={self.key!r}" if self.key else ""
        return f"Stream({[h.name for h in self._heads]}{key})"

    # -- helpers -----------------------------------------------------------------------

    def _parallelism(self, parallelism: int | None, name: str, heads=None) -> int:
        if parallelism is None:
            return max(h.parallelism for h in (heads or self._heads))
        return _positive_int(parallelism, f"operator {name!r}: parallelism")

    def _inputs(self, input_index: int, key: str | None) -> list[tuple[_Node, int, str | None]]:
        return [(h, input_index, key) for h in self._heads]

    def _operator(
        self,
        kind: str,
        op: ops.Operator,
        parallelism: int | None,
        name: str | None,
        schema_of: Callable[[str], pa.Schema] | None = None,
    ) -> Stream:
        name = self.job._name(name, kind)
        par = self._parallelism(parallelism, name)
        what = f"operator {name!r} ({op.describe()})"
        try:
            schema = schema_of(name) if schema_of else op.output_schema([self.schema])
        except ConfigError as exc:
            raise ConfigError(f"{what}: {exc}") from exc
        ops.check_event_time(schema, what)
        node = _Node(
            name, "operator", par, schema, self._inputs(0, self.key), operator=op, key=self.key
        )
        self.job._add(node)
        return Stream(self.job, (node,), None, schema)

    def _check_schema(self, schema: Any, what: str) -> pa.Schema | None:
        if schema is not None and not isinstance(schema, pa.Schema):
            raise ConfigError(f"{what}: schema must be a pyarrow.Schema, got {schema!r}")
        return schema

    def _column(self, column: Any, what: str, schema: pa.Schema | None = None) -> pa.Field:
        schema = schema or self.schema
        if not isinstance(column, str) or column not in schema.names:
            raise ConfigError(
                f"{what}: unknown column {column!r}; the stream's columns are {schema.names}"
            )
        return schema.field(column)

    # -- operators ---------------------------------------------------------------------

    def map(
        self,
        fn: Callable,
        parallelism: int | None = None,
        name: str | None = None,
        schema: pa.Schema | None = None,
    ) -> Stream:
        """``fn(batch) -> batch`` with one output row per input row."""
        return self._operator(
            "map", ops.Map(fn, self._check_schema(schema, "map")), parallelism, name
        )

    def filter(
        self, fn: Callable, parallelism: int | None = None, name: str | None = None
    ) -> Stream:
        """Keep the rows where ``fn(batch)`` (a boolean array) is true."""
        return self._operator("filter", ops.Filter(fn), parallelism, name)

    def flat_map(
        self,
        fn: Callable,
        parallelism: int | None = None,
        name: str | None = None,
        schema: pa.Schema | None = None,
    ) -> Stream:
        """``fn(batch) -> batch | None`` with any number of rows."""
        return self._operator(
            "flat_map", ops.FlatMap(fn, self._check_schema(schema, "flat_map")), parallelism, name
        )

    def key_by(self, column: str) -> Stream:
        """Hash-partition the next operator's input on ``column``: a key's group is its
        hash modulo the job's ``max_parallelism``, and each partition of the next operator
        owns a contiguous range of groups (so it can resume from a savepoint at another
        parallelism with whole groups of its state)."""
        field_ = self._column(column, f"key_by({column!r}) after {self._head_names()}")
        if not hashable_key_type(field_.type):
            raise ConfigError(
                f"key_by({column!r}): column type {field_.type} cannot be hash-partitioned; "
                "use an integer, string or binary column (cast it in a map first)"
            )
        return Stream(self.job, self._heads, column, self.schema)

    def _head_names(self) -> str:
        return ", ".join(repr(h.name) for h in self._heads)

    def process(
        self, op: ops.KeyedProcess, parallelism: int | None = None, name: str | None = None
    ) -> Stream:
        """A keyed stateful operator (needs a preceding ``key_by``)."""
        label = name or "process"
        if not isinstance(op, ops.KeyedProcess):
            raise ConfigError(
                f"process {label!r}: needs an instance of a td.KeyedProcess subclass, got "
                f"{type(op).__name__}"
            )
        if self.key is None:
            raise ConfigError(
                f"process {label!r} ({op.describe()}) has no key: keyed state needs a keyed "
                f"input; call .key_by(column) before .process(...)"
            )

        def schema_of(final_name: str) -> pa.Schema:
            probe = copy.deepcopy(op)
            probe.ctx = ops.OperatorContext(
                task=final_name, task_id=-1, partition=0, parallelism=1, key=self.key
            )
            return probe.output_schema([self.schema])

        return self._operator("process", op, parallelism, name, schema_of)

    def union(self, *others: Stream) -> Stream:
        """All rows of this stream and ``others``, interleaved by the merge. The schemas
        must be the same up to nullability; the union's is nullable wherever one of the
        streams' is."""
        if not others:
            raise ConfigError("union() needs at least one other stream")
        heads = list(self._heads)
        keys = {self.key}
        schema = self.schema
        for o in others:
            if not isinstance(o, Stream) or o.job is not self.job:
                raise ConfigError(
                    f"union(): every stream must belong to job {self.job.name!r}, got {o!r}"
                )
            merged = union_schema(schema, o.schema)
            if merged is None:
                raise ConfigError(
                    f"union() of {self._head_names()} and {o._head_names()}: schemas differ: "
                    f"{schema_differences(schema, o.schema)}; map them to one schema first "
                    "(nullability alone may differ)"
                )
            schema = merged
            for h in o._heads:
                if h in heads:
                    raise ConfigError(
                        f"union(): the output of {h.name!r} appears twice; a stream can be "
                        "unioned with itself only through an operator in between"
                    )
                heads.append(h)
            keys.add(o.key)
        return Stream(self.job, tuple(heads), keys.pop() if len(keys) == 1 else None, schema)

    def join(
        self,
        other: Stream,
        on: str = "key",
        how: str = "inner",
        parallelism: int | None = None,
        name: str | None = None,
    ) -> Stream:
        """Enrich this (event) stream with the latest row of ``other`` (the rule stream)
        per ``on`` key; see :class:`tandem.operators.Join` for the exact semantics."""
        label = name or "join"
        if not isinstance(other, Stream) or other.job is not self.job:
            raise ConfigError(
                f"join {label!r}: the other stream must belong to job "
                f"{self.job.name!r}, got {other!r}"
            )
        if set(self._heads) & set(other._heads):
            raise ConfigError(f"join {label!r}: a stream cannot be joined with itself")
        ev = self._column(on, f"join {label!r} on {on!r} (event side {self._head_names()})")
        ru = self._column(
            on, f"join {label!r} on {on!r} (rule side {other._head_names()})", other.schema
        )
        if ev.type != ru.type:
            raise ConfigError(
                f"join {label!r} on {on!r}: key types differ — events have {ev.type}, rules "
                f"have {ru.type}; cast one side in a map so both match"
            )
        if not hashable_key_type(ev.type):
            raise ConfigError(
                f"join {label!r} on {on!r}: key type {ev.type} cannot be hash-partitioned; "
                "use an integer, string or binary key"
            )
        op = ops.Join(on, how)
        name = self.job._name(name, "join")
        heads = self._heads + other._heads
        par = self._parallelism(parallelism, name, heads)
        try:
            schema = op.output_schema([self.schema, other.schema])
        except ConfigError as exc:
            raise ConfigError(f"join {name!r}: {exc}") from exc
        node = _Node(
            name,
            "operator",
            par,
            schema,
            self._inputs(0, on) + other._inputs(1, on),
            operator=op,
            key=on,
        )
        self.job._add(node)
        return Stream(self.job, (node,), None, schema)

    def window(
        self,
        size_ms: float,
        agg: Mapping[str, tuple[str, str]],
        key: str | None = None,
        parallelism: int | None = None,
        name: str | None = None,
    ) -> Stream:
        """Tumbling event-time window of ``size_ms`` with aggregates
        ``{"out": ("col", "sum"|"count"|"min"|"max"|"mean")}`` per ``key`` (default: the
        ``key_by`` column, if any; no key: one global window, parallelism 1)."""
        label = name or "window"
        if _number(size_ms, f"window {label!r}: size_ms") <= 0 or round(size_ms * 1e6) < 1:
            raise ConfigError(f"window {label!r}: size_ms must be > 0, got {size_ms!r}")
        if key is None:
            key = self.key
        elif self.key is not None and key != self.key:
            raise ConfigError(
                f"window {label!r}: key={key!r} conflicts with the preceding "
                f"key_by({self.key!r}); drop one of them"
            )
        if key is not None:
            f = self._column(key, f"window {label!r}: key")
            if not hashable_key_type(f.type):
                raise ConfigError(
                    f"window {label!r}: key column {key!r} of type {f.type} cannot be "
                    "hash-partitioned; use an integer, string or binary key"
                )
        agg = ops.validate_aggregates(agg, self.schema, f"window {label!r}")
        if key is not None and key in agg:
            raise ConfigError(f"window {label!r}: output name {key!r} is the key column")
        if key is None:
            if parallelism not in (None, 1):
                raise ConfigError(
                    f"window {label!r} has no key, so it is one global window and needs "
                    f"parallelism 1 (got {parallelism}); add key=... or key_by(...) to scale"
                )
            parallelism = 1
        keyed = Stream(self.job, self._heads, key, self.schema)
        return keyed._operator("window", ops.Window(size_ms, agg, key), parallelism, name)

    def sink(
        self,
        sink: Sink,
        parallelism: int = 1,
        name: str | None = None,
        replication: int | None = None,
    ) -> None:
        """Deliver this stream to ``sink`` (each row exactly once).

        ``replication``: how many replicas of each sink partition run, on different
        workers, so that losing one loses nothing (:mod:`tandem.sinks` says how one copy
        is published). Default: the job's replication for a sink that can run replicated
        (:attr:`tandem.sinks.Sink.replicable`: ``Collect``, ``Latency``, ``Parquet``,
        ``Csv``, Spark's table sink, and ``Kafka``, whose twins stand by while one
        replica writes), 1 for the others. ``replication=1`` keeps a single, unreplicated
        sink (a Kafka one restarts from its last commit when it is lost)."""
        if not isinstance(sink, Sink):
            raise ConfigError(
                f"sink() needs a tandem sink (e.g. td.sinks.Collect()), got {type(sink).__name__}"
            )
        name = self.job._name(name, "sink")
        par = _positive_int(parallelism, f"sink {name!r}: parallelism")
        if replication is not None:
            replication = _positive_int(replication, f"sink {name!r}: replication")
            if replication > 1 and not sink.replicable:
                raise ConfigError(
                    f"sink {name!r} ({sink.describe()}) cannot run replicated "
                    f"(replication={replication}): it has an effect outside as it writes, "
                    "so two replicas would write every row twice; leave replication out "
                    "(a single sink) or use a replicable sink (Collect, Parquet, Csv, Kafka)"
                )
        if self.schema is not None:
            try:
                sink.check(self.schema)
            except ConfigError as exc:
                raise ConfigError(f"sink {name!r} ({sink.describe()}): {exc}") from exc
        self.job._add(
            _Node(
                name,
                "sink",
                par,
                self.schema,
                self._inputs(0, self.key),
                sink=sink,
                key=self.key,
                replication=replication,
            )
        )


__all__ = ["Job", "RunningJob", "Stream"]
