"""What a run reports: :class:`Result`, the same for every engine and for the reference
executor (``td.Result``). In its own module so that the engines and the reference executor,
which return one, do not import the user API (:mod:`tandem.api`), which calls them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

JSON_FIELDS = (
    "duration_s",
    "events_in",
    "events_out",
    "lost",
    "duplicates",
    "p50_ms",
    "p99_ms",
    "max_ms",
    "max_gap_ms",
    "per_second_p99_ms",
    "faults",
    "digests_match",
    "lost_replicas",
    "restored_replicas",
    "checkpoints",
    "leaders",
    "output",
    "t0_ns",
    "first_output_unix_ns",
    "rescales",
)


@dataclass
class Result:
    """What a run reports. ``to_json()`` writes exactly :data:`JSON_FIELDS`.

    ``duration_s``: the seconds of source time the run covered — its ``duration``, or for
    a run with no duration where it stopped (the reference executor replays exactly that);
    ``events_in``: rows released by all sources; ``events_out``: rows delivered to all sinks (a
    row reaching two sinks counts twice). ``lost``/``duplicates``: rows of the reference
    execution's output missing from / repeated in the run's, every sink's rows compared as a
    multiset (file sinks' read back from their files; None when a run skipped that check or
    could not read a sink's output back); latency fields are in ms (None when the run measured
    no latency, e.g. the reference executor, which has no clock), from the sinks' per-second
    histograms: percentiles and ``max_ms`` within 0.8 % above the exact value,
    ``max_gap_ms`` within 1 ms (:mod:`tandem.latency`); ``faults`` the faults injected
    (dicts), ``lost_replicas`` the replicas that died (dicts with task, partition, replica and the
    ``cause``: ``killed``, ``crashed``, ``silent``, ``evicted``, ``starved``, ``late``);
    ``restored_replicas`` those rebuilt from a live twin while the job ran (``Job(restore=
    True)``: dicts with task, partition, replica, the ``twin`` it was rebuilt from, the
    heartbeat ``epoch`` of the cut, ``lost_s`` and ``restored_s`` — seconds from t0 — and
    ``restore_ms``, from the loss to the new replica receiving its input; ``warm``: it ran in
    the spare process started ahead of the loss; ``state_file``: its state came as a file
    from the twin, not through the coordinator; ``forked_with``: how many states the child
    forked from the twin's worker wrote with this one (one fork per worker and rebuild; 0:
    snapshotted in place); rolled back to a checkpoint, under
    ``Job(checkpoint_ms=...)``: ``twin`` None and ``checkpoint``, the checkpoint's epoch,
    0 for a restart from the beginning of the stream; a Kafka sink restarted from its last
    commit: ``twin`` None, ``sink`` True, ``epoch`` the heartbeat its stored input position
    stands at, 0 when it had committed nothing); ``checkpoints`` (``Job(
    checkpoint_ms=...)``, else None): ``completed`` and ``abandoned`` counts, the
    ``last_epoch`` completed and when (``last_s``, seconds from t0), and ``rollbacks``,
    the losses rolled back;
    ``output`` the rows of the first Collect sink (a pyarrow.Table; in JSON: ``{"rows": n,
    "columns": [...]}``). Not in JSON: ``outputs`` (every sink's combined value by sink name)
    and ``t0_ns`` (the logical time origin of the run: pass it to ``run_reference`` to reproduce
    event times); ``determinism_errors``, one message per task partition whose replicas' output
    digests differed (each is also logged as a DeterminismError; ``digests_match`` is then
    false); ``rss_mb``, the peak resident memory of each replica process (engines that measure
    it). ``leaders``, for KaZoo-ordered partitions (by ``"task[partition]"``): who led, in epoch
    order — ``{"replica", "epoch", "from_s", "until_s"}``, seconds from the run's start
    (``until_s`` None: the replica was lost while leading — its term ended before the next
    epoch's ``from_s``);
    ``kazoo_sessions`` (not in JSON), one per worker that hosts KaZoo-ordered replicas: its
    ZooKeeper session's ``name``, how often it was ``suspended`` or ``expired``, and the
    deposed leaders' orders its replicas ``fenced`` off (one record each: ``task`` id,
    ``partition``, ``replica``, the order's ``epoch`` and ``version``, the ``current``
    epoch, its ``offset`` in the order log).

    What the run cost the machine (engines that measure it, the local engine; None
    otherwise; not in JSON — ``tandem bench cost`` reports them): ``processes``, the OS
    processes the run started; ``cpu_s``, the CPU-seconds (user + system) those processes
    used from start to exit; ``steady_cpu_s``, the part of it used in the steady state,
    from ``warmup`` seconds after t0 to the end of the stream (t0 + duration), start-up
    and shutdown left out, and ``steady_wall_s`` the length of that span as measured;
    ``coordinator_cpu_s``, the CPU of the calling process while it started and watched
    the replicas (not the result assembly nor the reference check); ``wall_s``, seconds
    from the engine's ``run()`` call until every process had exited; ``first_output_s``,
    seconds from the engine's ``run()`` call to the first row received by a sink, and
    ``first_output_unix_ns`` when that was (the wall clock).
    ``workers_cpu_s`` (every engine, the Spark engine's only CPU figure): the CPU-seconds
    the worker processes said they used, each from its assignment to its ``Done``, or to
    its last keepalive if it was lost (a worker lost before either is not counted) — the
    replicas' own work, without the engine's (Spark's JVMs, the local engine's spares).

    ``sink_handovers``: an owned sink's partitions (a replicated Kafka sink) whose owner
    was lost and which a twin took over — ``{"task", "partition", "from", "to", "at_s"}``
    (replicas, and seconds from t0).

    ``rescales``: the live rescales of the run (:meth:`tandem.RunningJob.rescale`), each
    ``{"task", "from", "to", "epoch", "asked_s", "committed_s", "switch_s", "switch_ms"}``
    — partitions before and after, the heartbeat after which the switch came, when it was
    asked, committed and due (seconds from t0), and the longest time a worker spent on
    the switch (cutting the old partitions, splitting their states, starting the new).

    ``savepoint`` (not in JSON): the :class:`tandem.savepoints.Savepoint` the run stopped
    at (``Job.run(savepoint_on_stop=...)`` stopped by a signal), else None.
    """

    duration_s: float | None = None
    events_in: int = 0
    events_out: int = 0
    lost: int | None = 0
    duplicates: int | None = 0
    p50_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None
    max_gap_ms: float | None = None
    per_second_p99_ms: list[float] = field(default_factory=list)
    faults: list[dict] = field(default_factory=list)
    digests_match: bool = True
    lost_replicas: list[dict] = field(default_factory=list)
    restored_replicas: list[dict] = field(default_factory=list)
    checkpoints: dict | None = None
    leaders: dict[str, list[dict]] = field(default_factory=dict)
    kazoo_sessions: list[dict] = field(default_factory=list)
    output: pa.Table | None = None
    determinism_errors: list[str] = field(default_factory=list)
    rss_mb: dict[str, float] = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict, repr=False)
    t0_ns: int = 0
    processes: int | None = None
    cpu_s: float | None = None
    steady_cpu_s: float | None = None
    steady_wall_s: float | None = None
    coordinator_cpu_s: float | None = None
    wall_s: float | None = None
    first_output_s: float | None = None
    first_output_unix_ns: int | None = None
    workers_cpu_s: float | None = None
    sink_handovers: list[dict] = field(default_factory=list)
    rescales: list[dict] = field(default_factory=list)
    savepoint: Any = None

    def to_dict(self) -> dict[str, Any]:
        d = {name: getattr(self, name) for name in JSON_FIELDS}
        out = self.output
        d["output"] = None if out is None else {"rows": out.num_rows, "columns": out.schema.names}
        d["faults"] = [f.to_dict() if hasattr(f, "to_dict") else f for f in self.faults]
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


__all__ = ["JSON_FIELDS", "Result"]
