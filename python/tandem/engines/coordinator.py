"""The coordinator of a run, one for every engine: it starts the workers' exchange, injects
faults, decides losses, rebuilds lost workers, takes checkpoints and restarts sinks.

An engine only *hosts* workers — the local engine as processes on this machine
(:mod:`tandem.engines.local`), the Spark engine as long-running tasks that check in with a
registry on the driver (the Spark integration's) — behind the small
:class:`WorkerHost` protocol: start them, send one a message, kill, freeze or thaw one,
start a new *incarnation* of one to rebuild it, and hand over what they say as
:class:`Received` and :class:`Exited` events. Everything else is decided here, once, in
one thread, against the typed messages of :mod:`tandem.engines.protocol`:

- **Start.** Every worker says :class:`~tandem.engines.protocol.Ready` with its inbox
  ports; then every one gets :class:`~tandem.engines.protocol.Go` with every address and
  the logical time origin ``t0``.
- **Faults** (:mod:`tandem.faults`) at their times: ``td.Kill`` takes the worker hosting
  the replica down with every replica in it (``WorkerHost.kill``), ``td.Pause`` freezes
  it and thaws it later, ``td.Chaos`` kills random workers of replicated tasks, and
  ``td.KillHeartbeats`` a heartbeat generator. A kill that would take the last live
  replica of a partition whose other replicas are being rebuilt waits for them.
- **Loss** is decided by the job: a worker whose link drops, whose keepalives stop for
  ``failure_timeout_ms``, or whose upstream replicas drop it as a straggler is lost at
  once, and fenced — its incarnation ends, and nothing it says afterwards is used.
- **Rebuilds** (``Job(restore=True)``, DESIGN §4): a new incarnation of the lost worker
  gets cuts of its replicas from their live twins, the live upstream replicas replay to
  it from the cuts, and once all of them feed it, ``r`` is restored
  (``Result.restored_replicas``). The passive configuration (``Job(checkpoint_ms=...)``)
  rolls a lost worker back to the latest complete checkpoint instead, and a lost
  restartable sink restarts from the position its last commit stored — the same
  exchange, with those cuts.

Incarnations: each worker slot counts the processes or tasks that have run it; a rebuild
runs the next one. Events carry the incarnation they come from, and one that is neither
the slot's current incarnation nor the one being rebuilt is stale and ignored.
"""

from __future__ import annotations

import logging
import math
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from tandem.engines.common import STARTUP_S, RescaleAsk, SavepointAsk, Stop, assemble_result
from tandem.engines.exchange import (
    REJOIN_ATTEMPTS,
    REJOIN_MARGIN_S,
    REJOIN_TIMEOUT_S,
    Feeding,
    live_twins,
    rebuild_links,
    restored_entry,
)
from tandem.engines.protocol import (
    Alive,
    Assign,
    Checkpointed,
    CheckpointRequest,
    CutRequest,
    CutTaken,
    Done,
    Evicted,
    Failed,
    Go,
    Leads,
    Link,
    Linked,
    Message,
    Metrics,
    MetricsEvery,
    Ready,
    RescaleArm,
    RescaleCancel,
    Rescaled,
    RescalePrepare,
    Restore,
    Savepointed,
    SavepointRequest,
    Started,
    StartFailed,
    Starved,
    TakeOver,
    Until,
    Waiting,
    expect,
)
from tandem.exceptions import ConfigError, ServiceUnavailable, TandemError
from tandem.faults import Chaos, KillHeartbeats, KillWorker, Pause, ReplicaFault
from tandem.heartbeat import Generators
from tandem.ordering import kazoo
from tandem.ordering.kazoo import KazooRun
from tandem.plan import Plan
from tandem.result import Result
from tandem.runtime import CHILD_NICE, ReplicaId, ReplicaReport, Resume, thread_nice
from tandem.runtime.replica import failure_error

log = logging.getLogger("tandem")

STOP_LEAD_S = 1.0
"""A run with no duration: how far ahead of the wall clock, in source time, the sources
may emit; the coordinator moves that point on every half of it, and a stop takes effect
there (so a stop drains at most this much source time more)."""

CHECKPOINT_LEAD_S = 0.05
"""How far ahead of the sources' clock a checkpoint's epoch is picked (at least three
heartbeat periods): the request must reach every worker before its replicas forward it."""

CHECKPOINT_TIMEOUT_S = 10.0
"""A checkpoint not complete this long after it started is abandoned."""

SAVEPOINT_ROUNDS = 3
"""A running savepoint (or durable checkpoint) whose request reached every live replica of
a partition only after they had forwarded its heartbeat — a worker late to read it, on a
loaded machine — is asked again at a later heartbeat this many times in all, its lead four
times longer each round, before it fails."""

DRAIN_GRACE_S = 5.0
"""Once every sink has finished, how long the other workers may take to finish too: one
still running then is a straggler (its host's link throttled, say) whose output the sinks
no longer need; it is declared lost (``late``), so a slow host never holds the end of a
run back."""

RESCALE_ARM_S = 0.8
"""How long a live rescale may take to prepare and arm every worker while the sources'
lease is held short of its heartbeat (the lease is about :data:`STOP_LEAD_S` ahead, so
they never wait for it); past it the rescale is given up and the job goes on unchanged."""

RESCALE_SWITCH_S = 10.0
"""How long after its heartbeat's time a committed live rescale waits to hear every
switch done before it says which workers did not."""

DEFER_STEP_S = 0.05
"""How often a kill waiting for a rebuild (:class:`_Deferred`) looks again."""

ELECTION_WAIT_S = 10.0
"""A fault naming a KaZoo role (``replica="leader"``) while no live replica holds it (an
election under way) looks again for up to one session timeout and this long, then is
dropped with a warning."""

STUCK_REPORT_S = 2.0
"""A run that timed out: how long its running workers have to send the snapshot its error
reports (:meth:`Coordinator._where_stuck`)."""


# -- events and the host ------------------------------------------------------------------


@dataclass(frozen=True)
class Received:
    """Incarnation ``incarnation`` of worker ``worker`` said ``message``."""

    worker: int
    incarnation: int
    message: Message


@dataclass(frozen=True)
class Exited:
    """The link to incarnation ``incarnation`` of worker ``worker`` is gone: its process
    exited or its task ended (``code``: the exit code where known; negative: a signal)."""

    worker: int
    incarnation: int
    code: int | None = None


@dataclass
class Call:
    """A host's question for the coordinator's thread (e.g. a Spark retry asking whether
    it rebuilds a worker): ``fn()`` is run there and its result set on ``future``."""

    fn: Any
    future: Future = field(default_factory=Future)


Event = Received | Exited | Call


@runtime_checkable
class WorkerHost(Protocol):
    """What an engine does for the :class:`Coordinator`: host workers. Every method is
    called from the coordinator's thread."""

    name: str
    """``"local"``, ``"spark"``: how the coordinator names the engine in messages."""
    starts_rebuilds: bool
    """:meth:`replace` brings the new incarnation up itself (True), or one comes by
    itself — a Spark retry — and is claimed (:meth:`Coordinator.pending_rebuild`)."""

    def start(self, assignments: list[Assign]) -> None:
        """Start incarnation 0 of every worker (asynchronously: each says ``Ready``)."""

    def replace(self, assign: Assign, incarnation: int) -> bool:
        """Bring up incarnation ``incarnation`` of worker ``assign.worker`` to rebuild it
        (it says ``Waiting``); True if it comes from a process started ahead (warm)."""

    def send(self, worker: int, incarnation: int, message: Message) -> bool:
        """Send ``message``; False if that incarnation is gone."""

    def kill(self, worker: int, incarnation: int, cause: str) -> list[int]:
        """Take that incarnation down now, never waiting for what it would say: SIGKILL,
        or told to exit where it cannot be signalled. ``cause``: ``killed`` (a fault),
        ``silent``, ``evicted``, ``starved``, ``late``, ``unfed``, ``aborted``. Returns
        every other worker taken down with it (a whole executor killed)."""

    def pause(self, worker: int, incarnation: int, for_s: float) -> bool:
        """Freeze it (SIGSTOP) for ``for_s`` seconds: True if the coordinator is to thaw
        it then (:meth:`thaw`), False if it thaws by itself or could not be frozen."""

    def thaw(self, worker: int, incarnation: int) -> None:
        """Let a frozen incarnation go on (SIGCONT)."""

    def poll(self, timeout: float) -> list[Event]:
        """The events since the last call, waiting up to ``timeout`` s for the first."""

    def node(self, worker: int, incarnation: int) -> str:
        """The address the incarnation's inboxes listen on."""

    def pid(self, worker: int, incarnation: int) -> int | None:
        """Its process id, where this machine can see it."""

    def dead(self, worker: int, incarnation: int) -> bool:
        """Whether that incarnation's process is known to be gone (reaped, or SIGKILLed
        and no longer there) — not merely silent or cut off."""

    def state_folder(self, twin_worker: int, worker: int, incarnation: int) -> str | None:
        """Where ``twin_worker`` may leave a large state for that incarnation of
        ``worker`` (None: it travels inline)."""

    def idle(self) -> None:
        """No rebuild runs: a moment to prepare the next (start a spare)."""

    def close(self) -> None:
        """Stop whatever still runs, also on errors and Ctrl-C."""


# -- the coordinator's records ------------------------------------------------------------


@dataclass
class _Rejoin:
    """A lost worker being rebuilt: its new incarnation, the live twin each of its replicas
    is rebuilt from, and how far it got."""

    worker: int
    incarnation: int
    twins: dict[ReplicaId, ReplicaId]
    lost_s: float
    deadline: float
    state: str = "starting"  # starting -> cutting -> binding -> linking
    generation: int = 0
    """Raised with every round of cut requests: a late cut of an earlier round is dropped."""
    cut_rounds: int = 0
    started: bool = False
    """The new incarnation said its replicas have started (dialled their downstream
    replicas): until then it is no twin to count on, and no kill of its twins comes."""
    cuts: dict[ReplicaId, Resume] = field(default_factory=dict)
    feeding: Feeding = field(default_factory=Feeding)
    warm: bool = False
    """The new incarnation is a spare, started before the loss."""
    checkpoint: int | None = None
    """Rolled back (``Job(checkpoint_ms=...)``): the checkpoint's epoch (0: none was
    complete, the replicas restart from the beginning of the stream); None: from twins."""
    sinks: bool = False
    """Restarted sinks: each from the position its last committed output stored (no
    cut: nothing was committed, from the beginning of the stream)."""
    claimed: bool = True
    """The new incarnation exists (False: a Spark retry is awaited)."""


@dataclass
class _Checkpoint:
    """A checkpoint being taken (``Job(checkpoint_ms=...)``): every replica not a sink cut
    right after heartbeat ``epoch``, its state written to ``folder``."""

    epoch: int
    folder: str
    waiting: set[ReplicaId]
    deadline: float
    started_s: float
    cuts: dict[ReplicaId, Resume] = field(default_factory=dict)


@dataclass
class _Saving:
    """A savepoint being taken (:meth:`Coordinator._savepoint_step`): one live replica of
    every task partition, sinks too, cut right after heartbeat ``epoch``, each state
    written to ``folder`` first, then the whole to the asked path."""

    ask: SavepointAsk
    epoch: int
    folder: str
    waiting: set[ReplicaId]
    deadline: float
    cuts: dict[ReplicaId, Resume] = field(default_factory=dict)
    checkpoint_at: float = 0.0
    """When the next checkpoint was due (none starts while a savepoint is cut)."""
    tried: set[ReplicaId] = field(default_factory=set)
    """Replicas that could not be cut (a twin is asked instead)."""
    round: int = 1
    """Which attempt this is (:data:`SAVEPOINT_ROUNDS`)."""


@dataclass
class _Rescale:
    """A live rescale (:mod:`tandem.runtime.rescaling`): ``task`` from ``was`` to ``now``
    partitions right after heartbeat ``epoch``, going through ``state`` — ``"preparing"``,
    ``"arming"`` (the lease held short of ``epoch`` meanwhile), ``"committed"`` (the
    lease free: the switch happens in the data plane), ``"cancelling"`` (the lease held
    until every worker undid its part)."""

    id: int
    ask: RescaleAsk
    task: int
    was: int
    now: int
    epoch: int
    new_plan: Plan
    state: str
    waiting: set[int]
    deadline: float
    asked_s: float
    addresses: dict[ReplicaId, tuple[str, int]] = field(default_factory=dict)
    hosts: dict[ReplicaId, int] = field(default_factory=dict)
    """New replica -> the worker that hosts it."""
    switching: set[int] = field(default_factory=set)
    """Workers hosting partitions of the task: they say when their switch is done."""
    why: str = ""
    switch_ms: float = 0.0
    committed_s: float = 0.0

    @property
    def holds(self) -> bool:
        """Whether the sources' lease must stay short of :attr:`epoch`."""
        return self.state in ("preparing", "arming", "cancelling")


@dataclass(frozen=True)
class _Thaw:
    """The second half of a ``td.Pause``: thaw the frozen incarnation at ``at``."""

    worker: int
    incarnation: int
    at: float


@dataclass(frozen=True)
class _Deferred:
    """A kill that came while the twins of its victims were still being rebuilt: looked
    at again at ``at``, injected once they are back."""

    fault: ReplicaFault | KillWorker
    at: float
    due: float
    """When the fault was scheduled."""


class Coordinator:
    """One run's coordinator (see the module documentation), on ``host``.

    ``duration``: seconds of source time (None: until ``stop`` or the end of the bounded
    sources, by stop points: :meth:`end_s`). ``progress``: draw a progress bar on stderr.
    ``on_ready(addresses)``: called once every replica listens, before the go.
    ``startup_timeout``: how long the workers may take to say ready.
    """

    def __init__(
        self,
        plan: Plan,
        host: WorkerHost,
        duration: float | None,
        faults: list,
        *,
        secret: bytes,
        zoo: KazooRun | None = None,
        warmup: float = 0.0,
        progress: bool = False,
        generators: Generators | None = None,
        stop: Stop | None = None,
        cap_ns: int | None = None,
        startup_timeout: float = 60.0,
        on_ready=None,
        metrics=None,
    ) -> None:
        self.plan, self.host, self.duration, self.progress = plan, host, duration, progress
        self.secret, self.zoo, self.warmup = secret, zoo, warmup
        # A run with no duration: the source time the sources may reach (ns after t0), and
        # whether the run stops there; the end of the bounded sources, if all are.
        self.until_ns, self.final = 0, duration is not None
        # False once the run stops at a savepoint: the operators' final output (a window's
        # open windows) is left to the resumed run, which has their state.
        self.drain = True
        self.natural_ns = plan.natural_end_ns() if duration is None else None
        if cap_ns is not None:
            self.natural_ns = min(cap_ns, self.natural_ns or cap_ns)
        self.stop_token = stop or Stop()
        self.generators = generators
        self.startup_timeout, self.on_ready = startup_timeout, on_ready
        self.metrics = metrics
        """A :class:`tandem.metrics.Metrics` the workers' snapshots go to, if served."""
        self._bar = None  # the tqdm progress bar, while drawn
        self.pending: list = sorted(faults, key=lambda f: f.at)
        self.placement = plan.placement()
        self.worker_of: dict[ReplicaId, int] = {
            rid: w for w, rids in enumerate(self.placement) for rid in rids
        }
        self.current: dict[int, int] = dict.fromkeys(range(len(self.placement)), 0)
        """Worker -> the incarnation running it (or that last ran it)."""
        self._incarnations: dict[int, int] = dict.fromkeys(range(len(self.placement)), 0)
        """Worker -> the last incarnation started for it."""
        self.running: set[int] = set()
        self.started = False
        """Every worker has had its go."""
        self.finished = False
        """The run is over (or failed): no event is looked at any more."""
        self.reports: dict[ReplicaId, ReplicaReport] = {}
        self.killed: dict[ReplicaId, float] = {}
        self.killed_workers: set[int] = set()
        self.crashed: list[ReplicaId] = []
        self.lost: list[tuple[ReplicaId, str]] = []  # every loss, in order, with its cause
        self.down: set[ReplicaId] = set()  # lost and not (yet) rebuilt
        self.injected: list[dict] = []
        # Rebuilding lost replicas from their twins (DESIGN §4).
        self.restoring = plan.restore and plan.replication > 1
        # The passive configuration (Job(checkpoint_ms=...), replication 1): checkpoints
        # taken while the job runs, and a lost worker rolled back to the latest complete one.
        self.checkpointing = plan.checkpointing
        self.restoring |= self.checkpointing
        self.checkpoint: _Checkpoint | None = None  # the latest complete one
        self._taking: _Checkpoint | None = None  # the one in flight
        # Seconds from t0: when the next one starts (the first, one period in).
        self._checkpoint_at = (plan.checkpoint_ms or 0) / 1000
        self._checkpoint_dir: str | None = None
        self.checkpoint_stats: dict[str, Any] = {
            "completed": 0,
            "abandoned": 0,
            "last_epoch": None,
            "last_s": None,
            "rollbacks": 0,
        }
        self.rejoins: dict[int, _Rejoin] = {}
        self.restored: list[dict] = []
        # Owned sinks (a replicated Kafka sink): which replica of each partition writes —
        # replica 0 until it is lost, then a twin (_hand_over).
        self.owners: dict[tuple[int, int], ReplicaId] = {
            (t.id, p): (t.id, p, 0)
            for t in plan.sinks()
            if t.sink.owned and t.replication > 1
            for p in range(t.parallelism)
        }
        self.handovers: list[dict] = []
        self.leads: list[tuple[ReplicaId, int, int]] = []
        """KaZoo: every term a replica announced (:class:`Leads`): ``(rid, epoch,
        since_ns)``; those of replicas lost while leading are known from here only."""
        self.evictions: dict[tuple[ReplicaId, int], set[ReplicaId]] = {}
        self._sinks_done_at: float | None = None
        """(replica, its worker's incarnation) -> the upstream replicas that dropped it."""
        self._attempts: dict[int, int] = {}  # worker -> rebuild attempts for its last loss
        self.chaos: Chaos | None = None
        self._chaos_rng = random.Random(0)
        self._chaos_at = 0.0
        self.addresses: dict[ReplicaId, tuple[str, int]] = {}
        self.heard: dict[int, float] = {}  # worker -> when it last spoke (monotonic)
        # (worker, incarnation) -> the CPU-seconds its process last said it had used
        self.cpu_s: dict[tuple[int, int], float] = {}
        self.t0_ns = 0
        self.releaser = kazoo.Releaser(zoo) if zoo is not None and zoo.partitions else None
        """Hands the election of a dead worker's KaZoo leaders over at once."""
        self.sampler = None
        """Called with the time since t0 on every turn of the watch loop (the local
        engine's cost and memory readings)."""
        self._rescaling: _Rescale | None = None  # the live rescale under way
        self._rescale_ids = 0
        self.rescales: list[dict] = []
        """The live rescales done, in order (:attr:`tandem.Result.rescales`)."""
        self._saving: _Saving | None = None  # the savepoint being cut
        self._writing: list = []  # the threads writing savepoints whose cuts are in
        # Durable checkpoints (Plan.durable_dir): when the next is due (source time, s).
        self._durable_at = None if plan.durable_dir is None else self._first_durable_s(plan)
        # Resumed from a savepoint: its source time is where the sources start.
        resumed = plan.resumed
        self.resumed_ns = 0 if resumed is None else resumed.epoch * plan.heartbeat_ns

    # -- names ----------------------------------------------------------------------------

    def name(self, rid: ReplicaId) -> str:
        t, p, r = rid
        return f"{self.plan.tasks[t].name}[{p}] replica {r}"

    @staticmethod
    def worker_name(w: int) -> str:
        return f"worker {w}"

    def hosts_sinks(self, w: int) -> bool:
        return any(self.plan.tasks[t].kind == "sink" for t, _, _ in self.placement[w])

    def rebuilds_sinks(self, w: int) -> bool:
        """Every sink replica worker ``w`` hosts is rebuilt from a twin's copy when lost
        (:attr:`tandem.sinks.Sink.rebuildable`: ``Collect``)."""
        tasks = self.plan.tasks
        return all(
            tasks[t].sink.rebuildable for t, _, _ in self.placement[w] if tasks[t].kind == "sink"
        )

    def lone_sinks(self, w: int) -> bool:
        """Worker ``w`` hosts unreplicated sinks: no twin takes over when it is lost."""
        tasks = self.plan.tasks
        return any(
            tasks[t].kind == "sink" and tasks[t].replication < 2 for t, _, _ in self.placement[w]
        )

    def now_s(self) -> float:
        return (time.time_ns() - self.t0_ns) / 1e9

    def assignment(self, w: int, rejoin: bool = False) -> Assign:
        """What worker ``w``'s process or task is told to run."""
        return Assign(w, tuple(self.placement[w]), rejoin, secret=self.secret, kazoo=self.zoo)

    # -- start ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start every worker, wait for each to be ready, then let them go."""
        self.host.start([self.assignment(w) for w in range(len(self.placement))])
        ports: dict[int, dict] = {}
        deadline = time.monotonic() + self.startup_timeout
        while len(ports) < len(self.placement):
            left = deadline - time.monotonic()
            if left <= 0:
                names = sorted(
                    self.worker_name(w) for w in range(len(self.placement)) if w not in ports
                )
                raise TandemError(
                    f"workers did not start within {self.startup_timeout:.0f} s: {names}"
                )
            for event in self.host.poll(min(left, 0.5)):
                if isinstance(event, Call):
                    self._call(event)
                    continue
                w = event.worker
                if isinstance(event, Exited):
                    raise TandemError(
                        f"{self.worker_name(w)} exited while starting (exit code "
                        f"{event.code}); its error, if any, is in its log above"
                    )
                msg = expect(
                    event.message, Ready, StartFailed, Alive, what=f"from {self.worker_name(w)}"
                )
                if isinstance(msg, StartFailed):
                    raise ConfigError(msg.why)
                if isinstance(msg, Ready):
                    ports[w] = msg.ports
        for w, found in ports.items():
            self.addresses |= self._listening(w, 0, found)
        if self.on_ready is not None:
            self.on_ready(self.addresses)
        self.t0_ns = time.time_ns() + int(STARTUP_S * 1e9) - self.resumed_ns
        go = Go(dict(self.addresses), self.t0_ns, self.duration, self.warmup)
        for w in range(len(self.placement)):
            self.host.send(w, 0, go)
            if self.metrics is not None:
                self.host.send(w, 0, MetricsEvery(self.metrics.every_s))
        self.running = set(range(len(self.placement)))
        self.started = True
        self.heard = dict.fromkeys(self.running, time.monotonic())
        if self.restoring:
            self.host.idle()
        if self.duration is None:
            self._extend(self.resumed_ns / 1e9 - STARTUP_S)

    def _listening(self, w: int, inc: int, ports: dict) -> dict[ReplicaId, tuple[str, int]]:
        node = self.host.node(w, inc)
        return {rid: (node, port) for rid, port in ports.items() if port is not None}

    # -- runs with no duration ------------------------------------------------------------

    def end_s(self) -> float:
        """Where the stream ends, in seconds of source time (inf: not known yet)."""
        if self.duration is not None:
            return self.duration
        return self.until_ns / 1e9 if self.final else math.inf

    def _extend(self, now_s: float, force: bool = False) -> None:
        """A run with no duration: move the point the sources may reach on, to
        ``STOP_LEAD_S`` ahead of ``now_s`` (a whole number of heartbeats), or make the
        current one final when a stop was requested or the bounded sources end there. A
        stop at a savepoint is made final by the savepoint (:meth:`_start_savepoint`):
        one heartbeat past the lease, its cuts asked for first. ``force``: move it on now
        even if it is still far enough ahead (a live rescale, before it holds it there;
        nothing moves it while it is held)."""
        if self.final or (self._rescaling is not None and self._rescaling.holds):
            return
        hb = self.plan.heartbeat_ns
        stopping = self.stop_token.requested and not self.stop_token.stops_at_savepoint()
        if stopping and self.until_ns > 0:
            self._finalize(self.until_ns)
            return
        if self.until_ns / 1e9 - now_s > STOP_LEAD_S / 2 and self.until_ns > 0 and not force:
            return
        target = round((max(now_s, 0.0) + STOP_LEAD_S) * 1e9)
        self.until_ns = max(self.until_ns, -(-target // hb) * hb)
        if self.natural_ns is not None and self.until_ns >= self.natural_ns:
            self.until_ns, self.final = self.natural_ns, True
        self.final |= stopping
        for w in self.running:
            self.host.send(w, self.current[w], Until(self.until_ns, self.final, self.drain))

    def _finalize(self, until_ns: int) -> None:
        """Stop the run at ``until_ns`` of source time: the sources end there."""
        self.until_ns, self.final = until_ns, True
        log.info(
            "stopping job %r: its sources end at %.2f s of source time, then what is in "
            "flight drains to the sinks",
            self.plan.job,
            self.until_ns / 1e9,
        )
        for w in self.running:
            self.host.send(w, self.current[w], Until(self.until_ns, self.final, self.drain))

    # -- the run --------------------------------------------------------------------------

    def watch(self, timeout: float) -> None:
        """Inject the faults, rebuild lost workers, take checkpoints, collect the reports
        until every worker has finished or is lost for good; ``timeout``: how long the run
        may take after its end (its start, with no duration, after the stop point)."""
        deadline = time.monotonic() + STARTUP_S + timeout
        if self.duration is None:  # from the stop point on
            deadline = math.inf
        pending = self.pending
        while self.running:
            if self.metrics is not None:
                self.metrics.engine(self.lost, self.restored, self.down)
            now_s = self.now_s()
            if self.stop_token.killed:
                raise TandemError(
                    f"job {self.plan.job!r} was killed: its workers were stopped at once, "
                    "without a drain, so the sinks may hold part of its output"
                )
            if not self.final:
                self._extend(now_s)
                if self.final:
                    deadline = time.monotonic() + max(0.0, self.end_s() - now_s) + timeout
            if self.sampler is not None:
                self.sampler(now_s)
            while pending and pending[0].at <= now_s:
                self._inject(pending.pop(0), now_s)
            if self.chaos is not None:
                self._chaos_step(now_s)
            for w, rj in list(self.rejoins.items()):
                if time.monotonic() > rj.deadline:
                    self._abort_rejoin(
                        w, f"not done within {REJOIN_TIMEOUT_S:.0f} s ({self._stuck(rj)})"
                    )
            if self.checkpointing:
                self._checkpoint_step(now_s)
            self._rescale_step(now_s)
            was_final = self.final
            self._savepoint_step(now_s)
            if self.final and not was_final:  # a stop at a savepoint: from its stop point
                deadline = time.monotonic() + max(0.0, self.end_s() - now_s) + timeout
            self._draw(now_s)
            wait_s = (pending[0].at - now_s) if pending else 0.2
            if not self.final:  # a stop is seen within 0.1 s
                wait_s = min(wait_s, 0.1)
            if self.checkpointing and self._taking is None:
                wait_s = min(wait_s, self._checkpoint_at - now_s)
            if self.restoring:
                wait_s = min(wait_s, self.plan.failure_timeout_ms / 4000)
            # A failure first: the replicas it starved may have spoken in the same batch.
            events = sorted(self.host.poll(max(0.0, min(0.2, wait_s))), key=_not_a_failure)
            for event in events:
                self._handle(event, now_s)
            if self.restoring:
                self._silent(now_s)
                if not self.rejoins and now_s < self.end_s() - REJOIN_MARGIN_S:
                    self.host.idle()  # after a rebuild, not beside it
            self._late(now_s)
            if self.running and time.monotonic() > deadline:
                stuck = sorted(self.worker_name(w) for w in self.running)
                logs_hint = ""
                if any(self.plan.is_log_source(t.id) for t in self.plan.sources()):
                    logs_hint = (
                        " A Kafka source ends only at a heartbeat marker in its log: is a "
                        "heartbeat generator running for its topic (generators=, or "
                        "`tandem heartbeats`)?"
                    )
                raise TandemError(
                    f"the run did not finish within {timeout:.0f} s of its start; still running: "
                    f"{stuck}. Raise timeout= if the job is expected to take longer.{logs_hint}"
                    f"{self._where_stuck()}"
                )
        self.finished = True
        for w in list(self.rejoins):
            self._abort_rejoin(w, "the job ended first")
        if self.metrics is not None:
            self.metrics.engine(self.lost, self.restored, self.down)
        self._draw(self.end_s(), done=True)

    def _where_stuck(self) -> str:
        """For a run that timed out: ask every running worker for one snapshot of its
        replicas' counters and say, for each replica not done, where it stands — what it
        took in and sent, the input its merge holds and for how long it has waited (with
        KaZoo: for an order), its output backlog, its KaZoo role. A worker that does not
        answer within ``STUCK_REPORT_S`` is named as such (its loop is blocked)."""
        asked = {w: self.current[w] for w in self.running}
        for w, inc in asked.items():
            self.host.send(w, inc, MetricsEvery(STUCK_REPORT_S / 4))
        snapshots: dict[int, dict] = {}
        until = time.monotonic() + STUCK_REPORT_S
        while len(snapshots) < len(asked) and time.monotonic() < until:
            for event in self.host.poll(0.1):
                if isinstance(event, Call):
                    self._call(event)
                    continue
                if asked.get(event.worker) != event.incarnation:
                    continue
                if isinstance(event, Exited):
                    snapshots[event.worker] = {"exited": event.code}
                elif isinstance(event.message, Metrics):
                    snapshots[event.worker] = event.message.snapshot
        lines = []
        for w in sorted(asked):
            snap = snapshots.get(w)
            if snap is None:
                lines.append(
                    f"{self.worker_name(w)}: no answer in {STUCK_REPORT_S:.0f} s (frozen, cut "
                    "off, or its loop blocked)"
                )
                continue
            if "exited" in snap:
                lines.append(f"{self.worker_name(w)}: exited (code {snap['exited']})")
                continue
            for rid, m in sorted(snap["replicas"].items()):
                if not m.get("active", True):
                    continue
                parts = [f"{m['rows_in']} rows in, {m['rows_out']} out"]
                if m.get("queued") or m.get("merge_wait_s"):
                    parts.append(
                        f"{m['queued']} input seqs held by its merge, which has waited "
                        f"{m['merge_wait_s']:.1f} s in all"
                    )
                if m.get("backlog"):
                    parts.append(f"{m['backlog']} frames of output unread")
                if "kazoo" in m:
                    leading, epoch = m["kazoo"]
                    parts.append(
                        f"KaZoo leader of epoch {leading}"
                        if leading is not None
                        else f"KaZoo follower (log at epoch {epoch})"
                    )
                lines.append(f"{self.name(rid)} on {self.worker_name(w)}: " + "; ".join(parts))
        if not lines:
            return ""
        return "\nWhere the replicas not done stand:\n  " + "\n  ".join(lines)

    def _call(self, event: Call) -> None:
        try:
            event.future.set_result(event.fn())
        except BaseException as exc:
            event.future.set_exception(exc)

    def _handle(self, event: Event, now_s: float) -> None:
        if isinstance(event, Call):
            self._call(event)
            return
        w, inc = event.worker, event.incarnation
        said = getattr(event, "message", None)
        if isinstance(said, Alive | Done) and said.cpu_s is not None:
            self.cpu_s[(w, inc)] = said.cpu_s  # a fenced one's too: its work was done
        if isinstance(said, Leads):  # a fenced one's too: it did lead
            self.leads.append((said.rid, said.epoch, said.since_ns))
            return
        rj = self.rejoins.get(w)
        if rj is not None and rj.incarnation == inc and rj.state != "linking":
            if isinstance(event, Exited):
                self._abort_rejoin(w, f"its new process exited (exit code {event.code})")
            else:
                self._rejoin_message(rj, event.message, now_s)
            return
        if inc != self.current[w] or w not in self.running:
            return  # stale: an incarnation fenced or finished
        if isinstance(event, Exited):
            self.running.discard(w)
            self._crashed(w, event.code, now_s)
            return
        self.heard[w] = time.monotonic()
        msg = event.message
        if isinstance(msg, Alive):
            pass
        elif isinstance(msg, CutTaken):
            self._on_cut(msg.twin, msg.taken, msg.token, now_s)
        elif isinstance(msg, Linked):
            self._on_linked(msg.up, msg.down, msg.error, now_s)
        elif isinstance(msg, Started):
            self._on_started(w, now_s)
        elif isinstance(msg, Evicted):
            self._on_evicted(msg.up, msg.down, now_s)
        elif isinstance(msg, Starved):
            self._on_starved(msg.rid, msg.why, now_s)
        elif isinstance(msg, Failed):
            _raise_first(msg.failures)
        elif isinstance(msg, Metrics):
            if self.metrics is not None:
                self.metrics.update(msg.snapshot)
        elif isinstance(msg, Checkpointed):
            self._on_checkpointed(msg.epoch, msg.rid, msg.taken, now_s)
        elif isinstance(msg, Savepointed):
            self._on_savepointed(msg.epoch, msg.rid, msg.taken)
        elif isinstance(msg, Rescaled):
            self._on_rescaled(w, msg)
        elif isinstance(msg, Done):
            self.reports.update(msg.reports or {})
            self.running.discard(w)
            self._unanswered(w, now_s)
            _raise_first(msg.failures)
        else:
            expect(
                msg,
                Alive,
                CutTaken,
                Linked,
                Started,
                Evicted,
                Starved,
                Failed,
                Metrics,
                Checkpointed,
                Savepointed,
                Rescaled,
                Done,
            )

    # -- loss -----------------------------------------------------------------------------

    def _silent(self, now_s: float) -> None:
        """Declare lost every running worker that has not spoken for the job's
        ``failure_timeout_ms`` (a frozen or wedged process, or one cut off: its keepalives
        stopped), and fence it, to rebuild it."""
        if self.checkpointing and self.rejoins:
            # Rolling a worker back: its neighbours wait for it (on a loaded machine a
            # keepalive may then come late), and a second loss meanwhile fails the job.
            return
        limit = self.plan.failure_timeout_ms / 1000
        now = time.monotonic()
        for w in sorted(self.running):
            if now - self.heard.get(w, now) <= limit:
                continue
            if self.hosts_sinks(w) and not self._silent_owner_has_heirs(w, now, limit):
                # Sinks are not rebuilt, so a suspicion would cost a copy for good (a last
                # copy or an unreplicated sink: the job). A sink copy is lost when its
                # process is known dead; a silent one that never ends is a straggler
                # (_late), and a rebuilt worker does not dial it (_rejoin_message).
                continue
            log.warning(
                "%s has been silent for %.0f ms (failure_timeout_ms=%g): declared lost",
                self.worker_name(w),
                (now - self.heard[w]) * 1000,
                self.plan.failure_timeout_ms,
            )
            self._kill_worker(w, now_s, "silent")

    def _silent_owner_has_heirs(self, w: int, now: float, limit: float) -> bool:
        """Whether silent worker ``w``, which hosts sink replicas, is declared lost anyway:
        it runs the writing owner of an owned sink partition (a Kafka sink's), whose rows
        stop for every reader while it is silent, and each sink replica on it has a twin
        that carries its partition on — for an owned partition, a twin still running and
        heard from within ``limit``, to take over its writes (:meth:`_hand_over`). A
        silent copy of any other sink costs nothing while its twin writes."""
        owns = False
        for rid in self.placement[w]:
            t, p, _ = rid
            if self.plan.tasks[t].kind != "sink" or rid in self.reports or rid in self.down:
                continue
            owner = self.owners.get((t, p)) == rid
            owns = owns or owner
            heard = any(
                (v := self.worker_of[h]) != w and now - self.heard.get(v, now) <= limit
                for h in self._heirs(t, p)
            )
            finished = not owner and any(
                (t, p, q) in self.reports and (t, p, q) not in self.down
                for q in range(self.plan.tasks[t].replication)
            )
            if not (heard or finished):
                return False
        return owns

    def _heirs(self, t: int, p: int) -> list[ReplicaId]:
        """The replicas of sink partition ``(t, p)`` that could write on for it: not down,
        not finished, on a running worker (lowest replica first)."""
        return [
            (t, p, r)
            for r in range(self.plan.tasks[t].replication)
            if (t, p, r) not in self.down
            and (t, p, r) not in self.reports
            and self.worker_of[(t, p, r)] in self.running
        ]

    def _late(self, now_s: float) -> None:
        """Declare lost the workers still running :data:`DRAIN_GRACE_S` after a replica of
        every sink partition finished (stragglers: the output is complete without them;
        a sink replica among them only had a copy the job does not need)."""
        sinks = self.plan.sinks()
        if not self.running or not sinks:
            return
        finished = {
            rid[:2]
            for rid, rep in self.reports.items()
            if rep.ended and self.owners.get(rid[:2], rid) == rid  # an owned sink: its owner
        }
        if any((t.id, p) not in finished for t in sinks for p in range(t.parallelism)):
            return
        if self._sinks_done_at is None:
            self._sinks_done_at = time.monotonic()
        now = time.monotonic()
        limit = self.plan.failure_timeout_ms / 1000
        waited = now - self._sinks_done_at
        # A shorter grace where workers send keepalives (a job that rebuilds; elsewhere
        # they speak only when they finish) and every straggler is silent (a cut-off
        # host's): one failure timeout. Not none: a sink copy that finished beside its
        # twin is silent while its Done is on the way (its keepalives queue behind it).
        if waited < DRAIN_GRACE_S and not (
            self.plan.rebuilds
            and waited >= limit
            and all(self.heard.get(w, now) < now - limit for w in self.running)
        ):
            return
        for w in sorted(self.running):
            log.warning(
                "%s had not finished %g s after the sinks (a straggler): declared lost",
                self.worker_name(w),
                DRAIN_GRACE_S,
            )
            self._kill_worker(w, now_s, "late")

    def _on_evicted(self, up: ReplicaId, down: ReplicaId, now_s: float) -> None:
        """``up`` dropped ``down`` as a straggler: its link to ``down`` lagged. That says
        one of the two is slow — ``down``, or ``up`` itself (its own host's link
        throttled: it lags towards every replica). So ``down``'s worker is declared lost
        (fenced and rebuilt from the twins) only once every live replica of ``up``'s
        task partition has dropped it; while ``up``'s twins still feed it, it is not the
        slow one, and a slow sender never takes a healthy receiver down."""
        w = self.worker_of[down]
        if w not in self.running or down in self.down or self.hosts_sinks(w):
            # A sink copy dropped by its upstream gets no more of that input; it never
            # ends, and is discarded as a straggler (_late). Not declared lost for it: a
            # copy lags in a replay's burst, and it is not rebuilt.
            return
        t, p, _ = up
        voters = self.evictions.setdefault((down, self.current[w]), set())
        voters.add(up)
        live = {(t, p, q) for q in range(self.plan.tasks[t].replication)} - self.down
        if not live <= voters:
            log.info(
                "%s dropped %s as a straggler; its other upstream replicas still feed it",
                self.name(up),
                self.name(down),
            )
            return
        log.warning(
            "%s dropped %s as a straggler: %s declared lost",
            self.name(up),
            self.name(down),
            self.worker_name(w),
        )
        self._kill_worker(w, now_s, "evicted")

    def _on_starved(self, rid: ReplicaId, why: str, now_s: float) -> None:
        """``rid`` stopped because an input channel lost every upstream replica feeding it
        (they are gone, or dropped it as a straggler — its upstream dropped it while it
        was being rebuilt, say, and its twin was lost next): it is lost. Its worker is
        declared lost and rebuilt if the job rebuilds; a rebuild that starved is tried
        again from later cuts. A sink copy (never rebuilt) or a replica of a job that
        does not rebuild is lost alone: its twins carry the partition, and if none is
        left the job fails saying so, instead of waiting for input that never comes."""
        w = self.worker_of[rid]
        rj = self.rejoins.get(w)
        if rj is not None and rj.state == "linking":
            log.warning("the rebuilt %s is starved of input: %s", self.name(rid), why)
            retry = self._attempts.get(w, 0) < REJOIN_ATTEMPTS
            self._abort_rejoin(
                w,
                f"{self.name(rid)} was starved of input",
                level=logging.INFO if retry else logging.WARNING,
            )
            if retry:
                self._lost_worker(w, now_s)  # from later cuts
            return
        if rid in self.down:
            return
        if self.restoring and not self.hosts_sinks(w):
            log.warning(
                "%s is starved of input (%s): %s declared lost",
                self.name(rid),
                why,
                self.worker_name(w),
            )
            self._kill_worker(w, now_s, "starved")
            return
        log.warning(
            "%s is starved of input (%s): it is lost; its twins carry on", self.name(rid), why
        )
        self.lost.append((rid, "starved"))
        self.down.add(rid)
        self._check_partitions([rid], f"{self.name(rid)} was starved of input")

    def _kill_worker(self, w: int, now_s: float, cause: str) -> None:
        """Take worker ``w`` down (``cause``) and fence it; its replicas are lost and
        rebuilt if the job restores them. Fails the job if a partition has no live
        replica left."""
        others = self.host.kill(w, self.current[w], cause)
        for v in [w, *(v for v in others if v in self.running and v != w)]:
            self._release(v)
            self.running.discard(v)
            self.killed_workers.add(v)
            for r in self.placement[v]:
                if r not in self.reports:
                    self.killed[r] = now_s
                    self.lost.append((r, cause))
                    self.down.add(r)
            self._check_partitions(
                [r for r in self.placement[v] if r in self.down],
                f"{self.worker_name(v)} was {'killed' if cause == 'killed' else 'declared lost'}",
            )
            self._attempts.pop(v, None)  # a new loss
            self._lost_worker(v, now_s)

    def _release(self, w: int) -> None:
        """KaZoo: worker ``w`` is known dead — its leaderships go to the followers now,
        not after its ZooKeeper session's timeout (:class:`tandem.ordering.kazoo.Releaser`)."""
        inc = self.current[w]
        pid = self.host.pid(w, inc)
        if self.releaser is not None and pid is not None and self.host.dead(w, inc):
            self.releaser.release(self.placement[w], pid)

    def _crashed(self, w: int, code: int | None, now_s: float) -> None:
        log.warning("%s died unexpectedly (exit code %s)", self.worker_name(w), code)
        self._release(w)
        lost = [r for r in self.placement[w] if r not in self.reports and r not in self.down]
        self.crashed.extend(lost)
        self.lost += [(r, "crashed") for r in lost]
        self.down |= set(lost)
        self._check_partitions(lost, f"{self.worker_name(w)} exited with code {code}")
        self._attempts.pop(w, None)  # a new loss
        self._lost_worker(w, now_s)

    def _hand_over(self, w: int, now_s: float) -> None:
        """Worker ``w`` is lost: every owned sink partition whose owner it ran goes to the
        lowest live twin, told to take over (``TakeOver``: it fences the lost owner's
        writer, reads its last committed position and writes on from there). A partition
        whose twins are all gone fails the job (``_check_partitions``) before this."""
        for (t, p), owner in sorted(self.owners.items()):
            if self.worker_of[owner] != w or owner in self.reports:
                continue
            heirs = self._heirs(t, p)
            if not heirs:
                raise TandemError(
                    f"{self.name(owner)}, the owner of {self.plan.tasks[t].describe()} "
                    f"partition {p}, was lost after its twins had finished: the rows after "
                    "its last commit are written by no one, so the job cannot continue"
                )
            heir = heirs[0]
            hw = self.worker_of[heir]
            self.owners[(t, p)] = heir
            self.handovers.append(
                {
                    "task": self.plan.tasks[t].name,
                    "partition": p,
                    "from": owner[2],
                    "to": heir[2],
                    "at_s": round(now_s, 3),
                }
            )
            log.info("%s lost: %s takes over its writes", self.name(owner), self.name(heir))
            self.host.send(hw, self.current[hw], TakeOver(heir))

    def _check_partitions(self, lost: list[ReplicaId], why: str) -> None:
        """Fail the job if a partition of ``lost`` has no live replica left (one being
        rebuilt does not count: it starts from a live twin)."""
        for task, part, _ in lost:
            if self.checkpointing and self.plan.tasks[task].kind != "sink":
                continue  # rolled back to the latest checkpoint (_roll_back)
            if self.restoring and self.plan.restarts_sink(task):
                continue  # restarted from its committed position (_restart_sinks)
            alive = [
                r
                for r in range(self.plan.tasks[task].replication)
                if (task, part, r) not in self.down
            ]
            if not alive:
                raise TandemError(
                    f"every replica of {self.plan.tasks[task].describe()} partition {part} is "
                    f"gone ({why}); the job cannot continue"
                )

    # -- rebuilding lost workers (Job(restore=True)) --------------------------------------

    def _new_incarnation(self, w: int) -> int:
        self._incarnations[w] += 1
        return self._incarnations[w]

    def _lost_worker(self, w: int, now_s: float) -> None:
        """Start rebuilding worker ``w``'s replicas from their twins, if the job asks for it
        and it can be done: a new incarnation of the worker, which waits for their cuts.
        An owned sink's partitions it wrote for are handed to a twin first."""
        self._hand_over(w, now_s)
        if self.checkpointing and w in self.rejoins:
            self._abort_rejoin(w, "its new process was lost too")
        if not self.restoring or w in self.rejoins:
            return
        if self.lone_sinks(w):
            self._restart_sinks(w, now_s)
            return
        if self.hosts_sinks(w) and not self.rebuilds_sinks(w):
            # Replicated sinks whose copies live outside the process (files, a topic):
            # their twins hold a copy each, and one copy is all the job publishes.
            log.info(
                "%s hosted sink replicas (%s): their twins carry on, it is not rebuilt",
                self.worker_name(w),
                ", ".join(self.name(r) for r in self.placement[w]),
            )
            return
        if self.checkpointing:
            self._roll_back(w, now_s)
            return
        self._attempts[w] = self._attempts.get(w, 0) + 1
        rids = self.placement[w]
        if now_s > self.end_s() - REJOIN_MARGIN_S:
            log.info(
                "%s is not rebuilt: the stream ends in under %g s",
                self.worker_name(w),
                REJOIN_MARGIN_S,
            )
            return
        twins = live_twins(self.plan, rids, self.down)
        if twins is None:
            return  # the job fails for it (_check_partitions)
        self._rebuild(w, now_s, twins=twins)
        log.info(
            "rebuilding %s (%s) from live twins",
            self.worker_name(w),
            ", ".join(self.name(r) for r in rids),
        )

    def _rebuild(self, w: int, now_s: float, **how) -> _Rejoin:
        """A new incarnation of worker ``w`` to rebuild it (``how``: the rejoin's fields)."""
        inc = self._new_incarnation(w)
        warm = self.host.replace(self.assignment(w, rejoin=True), inc)
        rj = _Rejoin(
            w, inc, how.pop("twins", {}), now_s, time.monotonic() + REJOIN_TIMEOUT_S, **how
        )
        rj.warm, rj.claimed = warm, self.host.starts_rebuilds
        self.rejoins[w] = rj
        return rj

    # -- the passive configuration (Job(checkpoint_ms=...)) ------------------------------

    def _checkpoint_step(self, now_s: float) -> None:
        """Start the next checkpoint when due: pick a heartbeat epoch a little ahead of the
        sources' clock, so the request reaches every worker before any replica forwards it,
        and ask every live worker to cut its replicas (not the sinks) right after it."""
        taking = self._taking
        if taking is not None:
            if time.monotonic() > taking.deadline:
                self._abandon(f"not complete within {CHECKPOINT_TIMEOUT_S:g} s")
            return
        if now_s < self._checkpoint_at or self.rejoins or self.down:
            return
        hb_s = self.plan.heartbeat_ms / 1000
        lead = max(3 * hb_s, CHECKPOINT_LEAD_S)
        if now_s + lead >= self.end_s() - hb_s:
            return  # the stream ends first
        epoch = int((max(now_s, 0.0) + lead) / hb_s) + 1
        if self._checkpoint_dir is None:
            self._checkpoint_dir = tempfile.mkdtemp(prefix="tandem-checkpoints-")
        folder = os.path.join(self._checkpoint_dir, str(epoch))
        waiting: set[ReplicaId] = set()
        for w in sorted(self.running):
            rids = [r for r in self.placement[w] if self.plan.tasks[r[0]].kind != "sink"]
            if not rids:
                continue
            waiting.update(rids)
            self.host.send(w, self.current[w], CheckpointRequest(epoch, folder))
        self._checkpoint_at = now_s + self.plan.checkpoint_ms / 1000
        if waiting:
            self._taking = _Checkpoint(
                epoch, folder, waiting, time.monotonic() + CHECKPOINT_TIMEOUT_S, now_s
            )

    def _abandon(self, why: str) -> None:
        """Give the checkpoint in flight up (the next one is tried when due)."""
        taking, self._taking = self._taking, None
        if taking is None:
            return
        self.checkpoint_stats["abandoned"] += 1
        log.debug("checkpoint %d abandoned: %s", taking.epoch, why)
        shutil.rmtree(taking.folder, ignore_errors=True)

    def _on_checkpointed(
        self, epoch: int, rid: ReplicaId, taken: Resume | None, now_s: float
    ) -> None:
        """A replica's cut for checkpoint ``epoch`` is on disk (None: it could not be
        taken); the checkpoint is complete once every replica's is."""
        taking = self._taking
        if taking is None or taking.epoch != epoch:
            # An abandoned checkpoint's late answer: its file goes.
            current = self.checkpoint is not None and self.checkpoint.epoch == epoch
            if not current and self._checkpoint_dir is not None:
                shutil.rmtree(os.path.join(self._checkpoint_dir, str(epoch)), ignore_errors=True)
            return
        if taken is None:
            self._abandon(f"{self.name(rid)} had forwarded heartbeat {epoch} already")
            return
        taking.cuts[rid] = taken
        taking.waiting.discard(rid)
        if taking.waiting:
            return
        previous, self.checkpoint, self._taking = self.checkpoint, taking, None
        if previous is not None:
            shutil.rmtree(previous.folder, ignore_errors=True)
        stats = self.checkpoint_stats
        stats["completed"] += 1
        stats["last_epoch"] = epoch
        stats["last_s"] = round(now_s, 3)
        log.debug(
            "checkpoint %d complete (%.0f ms after it started)",
            epoch,
            (now_s - taking.started_s) * 1000,
        )

    def _roll_back(self, w: int, now_s: float) -> None:
        """Rebuild worker ``w``'s replicas from the latest complete checkpoint (none: from
        the beginning of the stream): the exchange of a rebuild from twins, with the
        checkpoint's cuts instead of the twins'."""
        self._abandon(f"{self.worker_name(w)} was lost")
        ck = self.checkpoint
        cuts = {} if ck is None else {r: ck.cuts[r] for r in self.placement[w] if r in ck.cuts}
        epoch = 0 if ck is None else ck.epoch
        missing = [self.name(r) for r in self.placement[w] if ck is not None and r not in cuts]
        if missing:
            raise TandemError(
                f"{self.worker_name(w)} was lost, but checkpoint {epoch} holds no cut of "
                f"{', '.join(missing)}; the job cannot continue"
            )
        rj = self._rebuild(w, now_s, checkpoint=epoch)
        rj.cuts = cuts
        self.checkpoint_stats["rollbacks"] += 1
        log.info(
            "rolling %s (%s) back to %s",
            self.worker_name(w),
            ", ".join(self.name(r) for r in self.placement[w]),
            f"checkpoint {epoch}" if ck is not None else "the beginning of the stream",
        )

    def _restart_sinks(self, w: int, now_s: float) -> None:
        """Restart worker ``w``'s sinks, each from the input position stored with its
        last committed output (:meth:`tandem.sinks.Sink.recover`, which fences the lost
        sink's writer first): the exchange of a rollback, with those positions as the
        cuts; the live upstream replicas replay the rest from their replay windows."""
        rids = self.placement[w]
        fixed = [self.name(r) for r in rids if not self.plan.restarts_sink(r[0])]
        if fixed:
            raise TandemError(
                f"{self.worker_name(w)}, which hosts the sinks, was lost: "
                f"{', '.join(fixed)} cannot be restarted (only a sink that stores its input "
                "position with its output, td.sinks.Kafka, can), so the job cannot continue"
            )
        # The new incarnation loads the job while the lost sinks are fenced and their
        # positions read (each sink partition's at once).
        rj = self._rebuild(w, now_s, sinks=True)
        try:
            with ThreadPoolExecutor(len(rids)) as pool:
                found = list(
                    pool.map(lambda r: self.plan.tasks[r[0]].sink.recover(r[1], self.t0_ns), rids)
                )
        except BaseException:
            self.rejoins.pop(w, None)
            self.host.kill(w, rj.incarnation, "aborted")
            raise
        rj.cuts = {
            rid: Resume(cut, state)
            for rid, (cut, state) in zip(rids, found, strict=True)
            if cut is not None
        }
        log.info(
            "restarting %s (%s) from %s",
            self.worker_name(w),
            ", ".join(self.name(r) for r in rids),
            ", ".join(
                f"heartbeat {rj.cuts[r].epoch}" if r in rj.cuts else "the beginning" for r in rids
            ),
        )

    # -- savepoints (RunningJob.savepoint, RunningJob.stop(savepoint=...)) ---------------

    # -- live rescale (RunningJob.rescale) ------------------------------------------------

    def _rescale_step(self, now_s: float) -> None:
        """Start the live rescale asked for next, or give the one under way up when it
        could not be armed in time."""
        rs = self._rescaling
        if rs is not None:
            gone = (rs.waiting | rs.switching) - self.running
            rs.waiting &= self.running
            rs.switching &= self.running
            if gone and rs.state in ("preparing", "arming"):
                names = ", ".join(self.worker_name(w) for w in sorted(gone))
                self._cancel_rescale(rs, f"{names} was lost")
                return
            if rs.state == "cancelling" and not rs.waiting:
                self._rescale_cancelled(rs)
                return
            if rs.state == "arming" and not rs.waiting:
                self._commit_rescale(rs)
                return
            if rs.state == "committed" and not rs.switching:
                self._rescale_done(rs)
                return
            late = time.monotonic() > rs.deadline
            if rs.state in ("preparing", "arming") and late:
                left = ", ".join(self.worker_name(w) for w in sorted(rs.waiting))
                self._cancel_rescale(rs, f"not armed within {RESCALE_ARM_S:g} s ({left})")
            elif rs.state == "committed" and late:
                left = ", ".join(self.worker_name(w) for w in sorted(rs.switching))
                log.warning("live rescale %d: no switch heard yet from %s", rs.id, left)
                rs.deadline = math.inf
            return
        if not self.started or self.final:
            return
        busy = self._saving is not None or self._taking is not None or self.rejoins or self.down
        if busy:
            return  # the ask waits: one thing at a time (and every replica up)
        ask = self.stop_token.next_rescale()
        if ask is None:
            return
        try:
            self._start_rescale(ask, now_s)
        except Exception as exc:
            if not ask.future.done():
                ask.future.set_exception(exc)

    def _start_rescale(self, ask: RescaleAsk, now_s: float) -> None:
        """Check the rescale, move the lease on and hold it there, and have every worker
        prepare for a switch right after the heartbeat one past it: no replica can have
        forwarded that heartbeat, nor will any before every worker is armed."""
        from tandem import rescale

        if self.duration is not None:
            raise ConfigError(
                "a live rescale needs a run with no duration (Job.start(), or "
                "run(duration=None)): its switch is placed past the sources' lease"
            )
        if not getattr(self.host, "live_rescale", False):
            raise ConfigError(
                f"the {getattr(self.host, 'name', 'this')} engine does not rescale a running "
                "job; stop it with a savepoint and resume at the new parallelism"
            )
        t = self.plan.task(ask.task)
        rescale.check(self.plan, t.id, ask.parallelism)
        hb = self.plan.heartbeat_ns
        self._extend(now_s, force=True)  # a full lead before the hold
        epoch = self.until_ns // hb + 1
        new_plan = rescale.after(self.plan, t.id, ask.parallelism, epoch)
        end_ns = self.until_ns if self.final else self.natural_ns  # stopping, or bounded
        if end_ns is not None and epoch * hb >= end_ns:
            raise ConfigError(
                f"job {self.plan.job!r} ends at {end_ns / 1e9:.2f} s of source time, before a "
                "live rescale could switch"
            )
        self._rescale_ids += 1
        rs = _Rescale(
            self._rescale_ids,
            ask,
            t.id,
            t.parallelism,
            ask.parallelism,
            epoch,
            new_plan,
            "preparing",
            set(self.running),
            time.monotonic() + RESCALE_ARM_S,
            now_s,
        )
        self._rescaling = rs
        for w in sorted(self.running):
            self.host.send(w, self.current[w], RescalePrepare(rs.id, t.id, rs.was, rs.now, epoch))
        log.info(
            "live rescale of %s from %d to %d partitions at heartbeat %d (%.2f s of source time)",
            t.describe(),
            rs.was,
            rs.now,
            epoch,
            epoch * hb / 1e9,
        )

    def _on_rescaled(self, w: int, msg: Rescaled) -> None:
        rs = self._rescaling
        if rs is None or rs.id != msg.id:
            return
        error = msg.details.get("error")
        if msg.what == "cancelled":
            rs.waiting.discard(w)
            if rs.state == "cancelling" and not rs.waiting:
                self._rescale_cancelled(rs)
            return
        if rs.state == "cancelling":
            return
        if error is not None:
            self._cancel_rescale(rs, f"{self.worker_name(w)}: {error}")
            return
        if msg.what == "prepared" and rs.state == "preparing":
            node = self.host.node(w, self.current[w])
            for rid, port in msg.details["ports"].items():
                rs.addresses[rid] = (node, port)
                rs.hosts[rid] = w
            if msg.details.get("olds"):
                rs.switching.add(w)
            rs.waiting.discard(w)
            if not rs.waiting:
                rs.state, rs.waiting = "arming", set(self.running)
                for v in sorted(self.running):
                    self.host.send(v, self.current[v], RescaleArm(rs.id, dict(rs.addresses)))
        elif msg.what == "armed" and rs.state == "arming":
            rs.waiting.discard(w)
            if not rs.waiting:
                self._commit_rescale(rs)
        elif msg.what == "started" and rs.state == "committed":
            rs.switching.discard(w)
            rs.switch_ms = max(rs.switch_ms, msg.details.get("switch_ms", 0.0))
            if not rs.switching:
                self._rescale_done(rs)

    def _commit_rescale(self, rs: _Rescale) -> None:
        """Every worker is armed: the rescale is irrevocable. The lease is free again (the
        switch happens as the replicas pass its heartbeat), and the job is the new plan's
        from here on — its placement, its addresses, what a rebuilt worker runs."""
        rs.state, rs.committed_s = "committed", self.now_s()
        rs.deadline = (
            time.monotonic() + max(0.0, rs.epoch * self.plan.heartbeat_ns / 1e9 - rs.committed_s)
        ) + RESCALE_SWITCH_S
        self.plan = rs.new_plan
        placement = [list(rids) for rids in self.placement]
        for rid, w in sorted(rs.hosts.items()):
            placement[w].append(rid)
            self.worker_of[rid] = w
        self.placement = [tuple(rids) for rids in placement]
        self.addresses |= rs.addresses
        set_plan = getattr(self.host, "set_plan", None)
        if set_plan is not None:
            set_plan(self.plan)
        if not rs.switching:
            self._rescale_done(rs)

    def _rescale_done(self, rs: _Rescale) -> None:
        hb_s = self.plan.heartbeat_ns / 1e9
        record = {
            "task": self.plan.tasks[rs.task].name,
            "from": rs.was,
            "to": rs.now,
            "epoch": rs.epoch,
            "asked_s": rs.asked_s,
            "committed_s": rs.committed_s,
            "switch_s": rs.epoch * hb_s,
            "switch_ms": rs.switch_ms,
        }
        self.rescales.append(record)
        self._rescaling = None
        log.info(
            "live rescale of %r to %d partitions done at heartbeat %d (the switch took %.1f ms)",
            record["task"],
            rs.now,
            rs.epoch,
            rs.switch_ms,
        )
        if not rs.ask.future.done():
            rs.ask.future.set_result(record)

    def _cancel_rescale(self, rs: _Rescale, why: str) -> None:
        """Give a rescale not yet committed up: every worker undoes its part, and the lease
        stays held until each has said so."""
        rs.state, rs.why, rs.waiting = "cancelling", why, set(self.running)
        log.warning("live rescale %d given up: %s", rs.id, why)
        for w in sorted(self.running):
            self.host.send(w, self.current[w], RescaleCancel(rs.id))
        if not rs.waiting:
            self._rescale_cancelled(rs)

    def _rescale_cancelled(self, rs: _Rescale) -> None:
        self._rescaling = None
        if not rs.ask.future.done():
            rs.ask.future.set_exception(
                TandemError(f"the live rescale was given up, the job runs on unchanged: {rs.why}")
            )

    def _savepoint_step(self, now_s: float) -> None:
        """Start the savepoint asked for next through the run's :class:`Stop`, or give the
        one being cut up when a replica it waits for is lost or its time is over."""
        saving = self._saving
        if saving is not None:
            lost = sorted(saving.waiting & self.down)
            for rid in lost:  # as one that could not be cut: a twin's cut may do
                self._not_cut(saving, rid, f"{self.name(rid)} was lost before its cut")
                if self._saving is not saving:  # given up, or asked again later
                    return
            if lost:
                return
            if time.monotonic() > saving.deadline:
                waiting = ", ".join(self.name(r) for r in sorted(saving.waiting))
                self._savepoint_failed(
                    f"not cut within {CHECKPOINT_TIMEOUT_S:g} s (no cut came from {waiting})"
                )
            return
        if not self.started or self._taking is not None or self._rescaling is not None:
            # After the checkpoint in flight (the core keeps one aligned cut a slot), and
            # after a live rescale (the plan changes).
            return
        ask = self.stop_token.next_savepoint()
        if ask is None:
            ask = self._durable_ask(now_s)
            if ask is None:
                return
        try:
            self._start_savepoint(ask, now_s)
        except Exception as exc:
            if not ask.future.done():
                ask.future.set_exception(exc)

    # -- durable checkpoints (Job(checkpoint_ms=..., checkpoint_dir=...)) ------------------

    @staticmethod
    def _first_durable_s(plan) -> float:
        """When the first durable checkpoint is due: a period after the start (a resumed
        run's start is its savepoint's cut)."""
        start = 0.0 if plan.resumed is None else plan.resumed.epoch * plan.heartbeat_ms / 1000
        return start + plan.durable_ms / 1000

    def _durable_ask(self, now_s: float) -> SavepointAsk | None:
        """A durable checkpoint, when one is due: a savepoint the coordinator asks of
        itself, written into ``Plan.durable_dir`` (its name is its epoch); the older ones
        beyond :data:`tandem.savepoints.KEEP_CHECKPOINTS` are removed once it is written.
        One that fails is logged, and the next is taken a period later."""
        if self._durable_at is None or now_s < self._durable_at:
            return None
        self._durable_at = now_s + self.plan.durable_ms / 1000
        ask = SavepointAsk("", checkpoint=True)
        ask.future.add_done_callback(self._durable_done)
        return ask

    def _durable_done(self, future: Future) -> None:
        """A durable checkpoint written (on the writer's thread) or given up."""
        from tandem import savepoints

        if future.cancelled():
            return
        error = future.exception()
        if error is not None:
            # At the end of the stream a checkpoint under way is given up: nothing is lost.
            level = logging.INFO if self.finished else logging.WARNING
            log.log(level, "checkpoint not taken (the next is a period later): %s", error)
            return
        try:
            removed = savepoints.prune_checkpoints(self.plan.durable_dir)
        except OSError as exc:
            log.warning("older checkpoints in %s not removed: %s", self.plan.durable_dir, exc)
            return
        log.info(
            "checkpoint at heartbeat %d written to %s%s",
            future.result().epoch,
            future.result().path,
            f" ({len(removed)} older removed)" if removed else "",
        )

    def _start_savepoint(self, ask: SavepointAsk, now_s: float, round_: int = 1) -> None:
        """Ask one live replica of every task partition, sinks included, for its cut right
        after one heartbeat epoch: the stop point's (``ask.stop``: the run ends there,
        nothing after it consumed), or one a little ahead of the sources' clock (further
        ahead in a later ``round_``: :data:`SAVEPOINT_ROUNDS`)."""
        from tandem import savepoints

        if not ask.checkpoint:
            savepoints.check_target(ask.path)
        hb = self.plan.heartbeat_ns
        finalize = False
        if ask.stop and self.final:  # the sources end there anyway (bounded, or stopped)
            epoch = self.until_ns // hb
        elif ask.stop:
            # One heartbeat past the lease: the sources never pass the lease, so no replica
            # has forwarded it, and the cuts are asked for before the sources may (the
            # lease is made final after the requests, on the same connections). At the
            # lease itself a replica may have forwarded it already — when the coordinator
            # was slow to move it on — and could not be cut.
            epoch = self.until_ns // hb + 1
            if self.natural_ns is not None:
                epoch = min(epoch, self.natural_ns // hb)
            finalize = True
        else:
            lead = max(3 * hb / 1e9, CHECKPOINT_LEAD_S) * 4 ** (round_ - 1)
            epoch = int((max(now_s, 0.0) + lead) * 1e9 / hb) + 1
            if epoch * hb > self.end_s() * 1e9:
                if ask.checkpoint:  # the stream ends first: no checkpoint is needed
                    self._durable_at = math.inf
                    ask.future.cancel()
                    return
                raise savepoints.failed(
                    f"job {self.plan.job!r} ends at {self.end_s():.2f} s of source time, "
                    "before a cut could be taken; stop(savepoint=...) cuts at the stop point"
                )
        if ask.checkpoint:
            ask.path = savepoints.checkpoint_path(self.plan.durable_dir, epoch)
            savepoints.check_target(ask.path)
        rids = []
        in_parts = {t.id for t in savepoints.part_sinks(self.plan)}
        # Every replica of a KaZoo partition is asked: the one that leads holds its orders
        # at the heartbeat for all of them to be cut there, and is not cut itself where a
        # twin is (its pause would pause the partition's orders). So is every replica at a
        # stop, which cannot be asked again later: the sources end at its heartbeat, and a
        # replica dropped as a straggler on the way there (a burst, a busy machine) ends
        # before it, as its twin's worker may too before a second request could reach it.
        ordered = set(self.plan.ordered_partitions())
        holds: set[ReplicaId] = set()
        for task in self.plan.tasks:
            # A durable checkpoint closes the part of every replica of a sink in parts.
            rolls = ask.checkpoint and task.id in in_parts
            for p in range(task.parallelism):
                live = [
                    (task.id, p, r) for r in range(task.replication) if self._alive((task.id, p, r))
                ]
                if not live:
                    raise savepoints.failed(
                        f"{task.describe()} partition {p} has no live replica to cut"
                    )
                every = rolls or ask.stop or (task.id, p) in ordered
                rids += live if every else live[:1]
                if (task.id, p) in ordered and len(live) > 1:
                    holds.update(live)
        folder = savepoints.staging(ask.path)  # where the workers write the states
        by_worker: dict[int, list[ReplicaId]] = {}
        for rid in rids:
            by_worker.setdefault(self.worker_of[rid], []).append(rid)
        for w, asked in sorted(by_worker.items()):
            self.host.send(
                w,
                self.current[w],
                SavepointRequest(
                    epoch,
                    folder,
                    tuple(asked),
                    roll=ask.checkpoint,
                    leaders_hold=tuple(r for r in asked if r in holds),
                ),
            )
        if finalize:
            self.drain = False
            self._finalize(epoch * hb)
        saving = _Saving(ask, epoch, folder, set(rids), time.monotonic() + CHECKPOINT_TIMEOUT_S)
        saving.round = round_
        if self.checkpointing:  # no checkpoint meanwhile: one aligned cut a slot
            saving.checkpoint_at, self._checkpoint_at = self._checkpoint_at, math.inf
        self._saving = saving
        log.info(
            "%s of job %r at heartbeat %d (%.2f s of source time)%s",
            "checkpoint" if ask.checkpoint else "savepoint",
            self.plan.job,
            epoch,
            epoch * hb / 1e9,
            ", then the job stops" if ask.stop else "",
        )

    def _on_savepointed(self, epoch: int, rid: ReplicaId, taken: Resume | None) -> None:
        """A replica's cut for the savepoint at heartbeat ``epoch`` (None: not taken); once
        every one is in, a thread writes the savepoint while the job goes on."""
        saving = self._saving
        if saving is None or saving.epoch != epoch or rid not in saving.waiting:
            if taken is not None and taken.state_file is not None:  # a savepoint given up
                shutil.rmtree(os.path.dirname(taken.state_file), ignore_errors=True)
            return
        if taken is None:
            self._not_cut(
                saving,
                rid,
                f"{self.name(rid)} could not be cut at heartbeat {epoch}: it had passed it "
                "already, or finished (a straggler dropped by its upstream replicas)",
            )
            return
        saving.cuts[rid] = taken
        saving.waiting.discard(rid)
        if not saving.waiting:
            self._savepoint_cut(saving)

    def _not_cut(self, saving: _Saving, rid: ReplicaId, why: str) -> None:
        """``rid``, asked for its cut in ``saving``, gives none (``why``): a twin's cut
        will do — one asked too, or one asked now — or, with none left, the savepoint is
        asked again at a later heartbeat or fails (a stop's, or the last round)."""
        saving.waiting.discard(rid)
        saving.tried.add(rid)
        t, p, _ = rid
        asked = [o for o in (*saving.waiting, *saving.cuts) if o[:2] == (t, p)]
        if asked:  # a twin was asked too (a stop, a sink in parts, KaZoo): its cut will do
            if not saving.waiting:
                self._savepoint_cut(saving)
            return
        twins = [
            (t, p, r)
            for r in range(self.plan.tasks[t].replication)
            if (t, p, r) not in saving.tried and self._alive((t, p, r))
        ]
        if not twins:
            if saving.ask.stop or saving.round >= SAVEPOINT_ROUNDS:
                self._savepoint_failed(why)
            else:
                self._savepoint_again(saving, why)
            return
        # A twin of it may still be before the heartbeat: ask it instead.
        twin = twins[0]
        w = self.worker_of[twin]
        saving.waiting.add(twin)
        self.host.send(w, self.current[w], SavepointRequest(saving.epoch, saving.folder, (twin,)))

    def _savepoint_cut(self, saving: _Saving) -> None:
        """Every cut of the savepoint is in: a thread writes it while the job goes on (and,
        a durable checkpoint, publishes the parts of the sinks in parts)."""
        self._saving = None
        # One cut per partition (every replica of a sink in parts or of a KaZoo partition
        # was cut): the lowest.
        lowest = {rid[:2]: rid for rid in sorted(saving.cuts, reverse=True)}
        cuts = {rid: saving.cuts[rid] for rid in lowest.values()}
        if self.checkpointing:
            self._checkpoint_at = saving.checkpoint_at
        plan, ask = self.plan, saving.ask

        def write() -> None:
            from tandem import savepoints

            # At the lowest priority: a state to copy and hash (a remote savepoint's) takes
            # a core only when the job's processes leave one.
            thread_nice(CHILD_NICE)
            try:
                runs = (() if plan.resumed is None else plan.resumed.runs) + (self.t0_ns,)
                written = savepoints.write(
                    ask.path, plan, saving.epoch, cuts, runs, staged=saving.folder
                )
                if ask.checkpoint:  # complete: its parts become the output
                    savepoints.publish_parts(plan, saving.epoch, cuts)
            except BaseException as exc:
                ask.future.set_exception(exc)
            else:
                if not ask.checkpoint:
                    log.info("savepoint written to %s", ask.path)
                ask.future.set_result(written)
            finally:
                shutil.rmtree(saving.folder, ignore_errors=True)

        thread = threading.Thread(target=write, name="tandem-savepoint-writer", daemon=True)
        thread.start()
        self._writing.append(thread)

    def _savepoint_again(self, saving: _Saving, why: str) -> None:
        """Give the cuts of ``saving`` up and ask for them again at a later heartbeat (the
        answers still coming for this one are dropped: its epoch is no longer asked)."""
        self._saving = None
        if self.checkpointing:
            self._checkpoint_at = saving.checkpoint_at
        shutil.rmtree(saving.folder, ignore_errors=True)
        log.info("savepoint at heartbeat %d asked again later: %s", saving.epoch, why)
        try:
            self._start_savepoint(saving.ask, self.now_s(), saving.round + 1)
        except Exception as exc:
            if not saving.ask.future.done():
                saving.ask.future.set_exception(exc)

    def _savepoint_failed(self, why: str) -> None:
        from tandem import savepoints

        saving, self._saving = self._saving, None
        if saving is None:
            return
        if self.checkpointing:
            self._checkpoint_at = saving.checkpoint_at
        shutil.rmtree(saving.folder, ignore_errors=True)
        if not saving.ask.checkpoint:
            log.warning("savepoint at heartbeat %d not taken: %s", saving.epoch, why)
        if not saving.ask.future.done():
            saving.ask.future.set_exception(savepoints.failed(why))

    def _close_savepoints(self) -> None:
        """The run is over: a savepoint still being cut fails, any asked later too; the
        ones being written are waited for."""
        self._savepoint_failed("the job ended before every partition was cut")
        self.stop_token.close_savepoints(f"savepoint not taken: job {self.plan.job!r} has ended")
        for thread in self._writing:
            thread.join()

    # -- the rebuild exchange -------------------------------------------------------------

    def _ask_cuts(self, rj: _Rejoin) -> None:
        """Ask the twins' workers for a cut of every replica ``rj`` rebuilds (a new round:
        answers to an earlier one are dropped)."""
        rj.state, rj.generation, rj.cuts = "cutting", rj.generation + 1, {}
        rj.cut_rounds += 1
        for rid, twin in rj.twins.items():
            tw = self.worker_of[twin]
            folder = self.host.state_folder(tw, rj.worker, rj.incarnation)
            sent = tw in self.running and self.host.send(
                tw,
                self.current[tw],
                CutRequest(twin, (rj.worker, rj.incarnation, rj.generation, rid), folder),
            )
            if not sent:
                if tw not in self.running and twin not in self.down:
                    # Not lost: it said Done. A retry that comes this late is not needed.
                    self._abort_rejoin(
                        rj.worker,
                        f"the stream ended before its twin {self.name(twin)} could be cut",
                        level=logging.INFO,
                    )
                else:
                    self._abort_rejoin(rj.worker, f"its twin {self.name(twin)} is gone")
                return

    def _rejoin_message(self, rj: _Rejoin, msg: Message, now_s: float) -> None:
        """A message from a rebuilt worker's new incarnation before it runs:
        ``Waiting`` (ask the twins for cuts), ``Ready`` (link its upstream replicas to it
        and let it go) or ``StartFailed``."""
        w = rj.worker
        msg = expect(msg, Waiting, Ready, StartFailed, Alive, what=f"from rebuilt worker {w}")
        if isinstance(msg, Alive):
            return
        if isinstance(msg, StartFailed):
            self._abort_rejoin(w, msg.why)
            return
        if isinstance(msg, Waiting):
            if rj.checkpoint is not None or rj.sinks:
                # Rolled back, or sinks restarted: the cuts are at hand.
                self._bind(rj)
            else:
                self._ask_cuts(rj)
            return
        self.addresses |= self._listening(w, rj.incarnation, msg.ports)
        # No cut (rolled back with no checkpoint complete): from the very beginning.
        links, here = rebuild_links(
            self.plan, msg.ports, rj.cuts, self.down, lambda up: self.worker_of[up] == w
        )
        # Rolled back with it to the same checkpoint: fed by a local link.
        rj.feeding.fed = {key: rj.checkpoint is not None and on for key, on in here.items()}
        for up, rid, epoch in links:
            uw = self.worker_of[up]
            if uw not in self.running:
                continue  # finished: its replay window went with it
            if self.host.send(uw, self.current[uw], Link(up, rid, self.addresses[rid], epoch)):
                rj.feeding.asked.add((up, rid))
        rj.state = "linking"
        inc = rj.incarnation
        # Not the replicas that are down or silent: dialling a dead or cut-off address only
        # delays the start (a sink copy lost for good is never back; a replica rebuilt
        # later links itself; a silent sink copy, never declared lost, may be cut off).
        limit = time.monotonic() - self.plan.failure_timeout_ms / 1000
        live = {
            rid: a
            for rid, a in self.addresses.items()
            if rid not in self.down
            and not (
                self.hosts_sinks(self.worker_of[rid])
                and self.heard.get(self.worker_of[rid], math.inf) < limit
            )
        }
        self.host.send(w, inc, Go(live, self.t0_ns, self.duration, self.warmup))
        if self.metrics is not None:
            self.host.send(w, inc, MetricsEvery(self.metrics.every_s))
        if self.duration is None:
            self.host.send(w, inc, Until(self.until_ns, self.final, self.drain))
        self.current[w] = inc
        self.killed_workers.discard(w)
        self.running.add(w)
        self.heard[w] = time.monotonic()

    def _bind(self, rj: _Rejoin) -> None:
        rj.state = "binding"
        self.host.send(rj.worker, rj.incarnation, Restore(rj.cuts, self.t0_ns))

    def _on_cut(self, twin: ReplicaId, taken: Resume | None, token, now_s: float) -> None:
        w, inc, generation, rid = token
        rj = self.rejoins.get(w)
        if rj is None or rj.incarnation != inc or rj.generation != generation:
            return
        if rj.state != "cutting":
            return
        if taken is None:
            # Finished or failed — or going by a moment ago: a later round finds out.
            if rj.cut_rounds < REJOIN_ATTEMPTS:
                log.info(
                    "%s: its twin %s could not be cut; trying again",
                    self.worker_name(w),
                    self.name(twin),
                )
                self._ask_cuts(rj)
            else:
                self._abort_rejoin(
                    w, f"its twin {self.name(twin)} could not be cut (it finished, or failed)"
                )
            return
        rj.cuts[rid] = taken
        if len(rj.cuts) == len(rj.twins):
            self._bind(rj)

    def _on_linked(self, up: ReplicaId, down: ReplicaId, error: str | None, now_s: float) -> None:
        rj = self.rejoins.get(self.worker_of[down])
        if rj is None or rj.state != "linking":
            return
        if error is not None and (up, down) in rj.feeding.asked:
            log.warning(
                "%s could not feed the rebuilt %s: %s", self.name(up), self.name(down), error
            )
        if rj.feeding.answered(up, down, error) and rj.started:
            self._linked(rj.worker, now_s)

    def _on_started(self, w: int, now_s: float) -> None:
        rj = self.rejoins.get(w)
        if rj is None or rj.state != "linking":
            return
        rj.started = True
        if not rj.feeding.asked:
            self._linked(w, now_s)

    def _unanswered(self, w: int, now_s: float) -> None:
        """Worker ``w`` finished: the link requests it had not answered before it said
        ``Done`` never will be (its replicas finished first)."""
        for rj in list(self.rejoins.values()):
            for up, down in sorted(rj.feeding.asked):
                if self.worker_of[up] == w:
                    self._on_linked(up, down, "it finished first", now_s)

    def _linked(self, w: int, now_s: float) -> None:
        rj = self.rejoins[w]
        unfed = [
            f"{self.name(rid)} from {self.plan.tasks[t].name}[{p}]"
            for rid, (t, p) in rj.feeding.unfed()
        ]
        if unfed and rj.sinks:
            self._abort_rejoin(
                w,
                "no live upstream replica could replay its input: "
                + ", ".join(unfed)
                + (
                    " (a replay window no longer reaches back to the position its last "
                    "committed output stored: raise Job(replay_ms=...))"
                    if rj.feeding.stale
                    else " (its upstream replicas finished or were lost meanwhile)"
                ),
            )
            return
        if unfed and rj.checkpoint is not None:
            causes = dict(self.lost)
            gone = [
                f"{self.name(r)} is lost too ({causes.get(r, 'lost')})"
                for r in sorted(self.down)
                if r not in rj.cuts and self.worker_of[r] != w
            ]
            self._abort_rejoin(
                w,
                "no live upstream replica could replay its input: "
                + ", ".join(unfed)
                + (f"; {', '.join(gone)}" if gone else "")
                + (
                    f" (a replay window no longer reaches back to checkpoint {rj.checkpoint}: "
                    "raise Job(replay_ms=...) or lower checkpoint_ms)"
                    if rj.feeding.stale
                    else ""
                ),
            )
            return
        if unfed:
            retry = rj.feeding.stale and self._attempts.get(w, 0) < REJOIN_ATTEMPTS
            self._abort_rejoin(
                w,
                "no live upstream replica could replay its input: "
                + ", ".join(unfed)
                + ("; trying again from a later cut" if retry else ""),
            )
            if retry:
                self._lost_worker(w, now_s)
            return
        del self.rejoins[w]
        self._attempts.pop(w, None)
        rolled = {} if rj.checkpoint is None else {"checkpoint": rj.checkpoint}
        if rj.sinks:
            rolled = {"sink": True}
        for rid in self.placement[w]:
            self.down.discard(rid)
            self.restored.append(
                restored_entry(
                    self.plan,
                    rid,
                    rj.twins.get(rid),
                    rj.cuts.get(rid),
                    rj.lost_s,
                    now_s,
                    rj.warm,
                    **rolled,
                )
            )
        log.info(
            "rebuilt %s at %.2f s (%.0f ms after its loss)",
            self.worker_name(w),
            now_s,
            (now_s - rj.lost_s) * 1000,
        )

    def _stuck(self, rj: _Rejoin) -> str:
        """What a rebuild that timed out was waiting for, in words."""
        if rj.state == "starting":
            if not rj.claimed:
                return f"no new {self.host.name} worker came to run it"
            return "its new process never said it was ready for its cuts"
        if rj.state == "cutting":
            missing = [self.name(rj.twins[r]) for r in sorted(rj.twins) if r not in rj.cuts]
            return "no cut came from " + ", ".join(missing)
        if rj.state == "binding":
            return "its new process did not take its cuts"
        if not rj.started:
            return "its replicas did not start (dialling their downstream replicas)"
        unanswered = sorted(rj.feeding.asked)
        return "no answer to the links asked of " + ", ".join(
            f"{self.name(up)} (to {self.name(down)})" for up, down in unanswered
        )

    def _abort_rejoin(self, w: int, why: str, level: int = logging.WARNING) -> None:
        rj = self.rejoins.pop(w, None)
        if rj is None:
            return
        self.host.kill(w, rj.incarnation, "aborted")
        if rj.sinks:
            raise TandemError(
                f"{self.worker_name(w)}, which hosts the sinks, could not be restarted: "
                f"{why}. A sink has no twin, so the job cannot continue"
            )
        if rj.checkpoint is not None:
            raise TandemError(
                f"{self.worker_name(w)} could not be rolled back to checkpoint "
                f"{rj.checkpoint}: {why}. At replication=1 nothing else holds its "
                "partitions, so the job cannot continue"
            )
        log.log(
            level,
            "%s is not rebuilt: %s%s",
            self.worker_name(w),
            why,
            "; its partitions go on with fewer replicas" if level >= logging.WARNING else "",
        )
        if self.current[w] == rj.incarnation:  # it was already running
            self.running.discard(w)
            self.killed_workers.add(w)

    def give_up(self, w: int, why: str) -> None:
        """Give the rebuild of worker ``w`` up, saying ``why`` (a host found it cannot be
        run); call on the coordinator's thread."""
        self._abort_rejoin(w, why)

    def pending_rebuild(self, w: int) -> _Rejoin | None:
        """The rebuild of worker ``w`` waiting for its new incarnation to come (a Spark
        retry), if any; call on the coordinator's thread."""
        rj = self.rejoins.get(w)
        return rj if rj is not None and not rj.claimed else None

    # -- faults ---------------------------------------------------------------------------

    def _alive(self, rid: ReplicaId) -> bool:
        w = self.worker_of[rid]
        return rid not in self.down and w in self.running

    def _resolve(self, task: int, partition: int, role: str) -> int | None:
        """The replica index holding ``role`` in a KaZoo partition right now; None while
        its election is under way or ZooKeeper does not answer (the fault looks again:
        this never waits on the coordinator's thread)."""
        alive = [
            r for r in range(self.plan.tasks[task].replication) if self._alive((task, partition, r))
        ]
        try:
            if self.releaser is not None:
                leader = self.releaser.leader(task, partition)
            else:
                leader = kazoo.current_leader(self.zoo, task, partition, timeout=1.0)
        except ServiceUnavailable as exc:
            log.info("fault on task %d partition %d: %s; looking again", task, partition, exc)
            return None
        where = f"{self.plan.tasks[task].describe()} partition {partition}"
        return kazoo.resolve_role(role, leader, alive, where)

    def _last_live(self, task: int, partition: int) -> bool:
        """Whether partition ``(task, partition)`` is down to one live replica while its
        other replicas are being rebuilt (no kill may take that one)."""
        rids = [(task, partition, r) for r in range(self.plan.tasks[task].replication)]
        live = [rid for rid in rids if rid not in self.down]
        return (
            len(rids) > 1
            and len(live) == 1
            and all(self.worker_of[rid] in self.rejoins for rid in rids if rid in self.down)
        )

    def _chaos_step(self, now_s: float) -> None:
        """Kill a random worker of replicated tasks once the chaos schedule says so and
        every partition is back at full replication (see :class:`tandem.faults.Chaos`)."""
        chaos = self.chaos
        if chaos.until is not None and now_s >= chaos.until:
            self.chaos = None
            return
        # (A lost replica of a sink that is not rebuilt stays down, and its workers are not
        # chaos's victims.)
        if now_s < self._chaos_at or self.rejoins or self._down_rebuilt():
            return
        if now_s > self.end_s() - REJOIN_MARGIN_S - chaos.every_s[0]:
            return
        victims = sorted(w for w in self.running if self.rebuilds_sinks(w))
        if not victims:
            return
        w = self._chaos_rng.choice(victims)
        self.injected.append(
            {
                "kind": "chaos",
                "worker": w,
                "replicas": self._replica_names(w),
                "injected_at": round(now_s, 3),
            }
        )
        log.info("chaos: SIGKILL %s at %.2f s", self.worker_name(w), now_s)
        self._kill_worker(w, now_s, "killed")
        self._chaos_at = now_s + self._chaos_rng.uniform(*chaos.every_s)

    def _down_rebuilt(self) -> list[ReplicaId]:
        """The replicas down that are rebuilt (all but those of sinks not rebuildable)."""
        tasks = self.plan.tasks
        return [r for r in self.down if tasks[r[0]].kind != "sink" or tasks[r[0]].sink.rebuildable]

    def _replica_names(self, w: int) -> list[dict]:
        return [
            {"task": self.plan.tasks[t].name, "partition": p, "replica": r}
            for t, p, r in self.placement[w]
        ]

    def _inject(self, fault, now_s: float) -> None:
        """Inject ``fault`` on the worker hosting its replica (or the worker it names); a
        Pause also schedules its thaw; Chaos starts its schedule. With
        ``Job(restore=True)`` a kill waits while it would take the last live replica of a
        partition whose other replicas are being rebuilt."""
        pending = self.pending
        deferred = isinstance(fault, _Deferred)
        due = fault.due if deferred else fault.at
        if deferred:
            fault = fault.fault
        if isinstance(fault, Chaos):
            self.chaos, self._chaos_at = fault, now_s
            self._chaos_rng = random.Random(fault.seed)
            return
        if isinstance(fault, _Thaw):
            w = fault.worker
            if self.current[w] != fault.incarnation or w not in self.running:
                return  # declared lost and fenced meanwhile
            self.host.thaw(fault.worker, fault.incarnation)
            log.info("fault: SIGCONT %s at %.2f s", self.worker_name(fault.worker), now_s)
            return
        if isinstance(fault, KillHeartbeats):
            pid = self.generators.kill(fault.generator) if self.generators else None
            self.injected.append({**fault.to_dict(), "pid": pid, "injected_at": round(now_s, 3)})
            log.info("fault: SIGKILL heartbeat generator %d at %.2f s", fault.generator, now_s)
            return
        if isinstance(fault, KillWorker):
            w, replica = fault.worker, None
            rid = self.placement[w][0]
        else:
            task = self.plan.task(fault.task)
            replica = fault.replica
            if isinstance(replica, str):
                if not isinstance(fault, Pause) and self._last_live(task.id, fault.partition):
                    # Whichever replica holds the role, it is the partition's last: wait
                    # for the rebuild (below) without asking ZooKeeper every step.
                    self._wait_for_rebuild(
                        fault, now_s, due, deferred, f"{task.name}[{fault.partition}]"
                    )
                    return
                try:
                    replica = self._resolve(task.id, fault.partition, replica)
                except TandemError as exc:
                    log.warning("fault %r: %s", fault, exc)
                    return
                if replica is None:  # an election under way: look again in a moment
                    timeout = self.zoo.config.session_timeout_s + ELECTION_WAIT_S
                    if now_s < due + timeout:
                        self._defer(fault, now_s, due)
                    else:
                        log.warning(
                            "fault %r: %s partition %d had no live %s for %.0f s",
                            fault,
                            task.describe(),
                            fault.partition,
                            fault.replica,
                            timeout,
                        )
                    return
            rid = (task.id, fault.partition, replica)
            w = self.worker_of[rid]
        if not isinstance(fault, Pause) and self._twins_rebuilding(w):
            # The twins are still being rebuilt: this kill would take the last live replica
            # of a partition. It comes once they are back (restore_ms varies with the
            # machine's load; the job is not to fail because a rebuild was slow).
            self._wait_for_rebuild(fault, now_s, due, deferred, self.worker_name(w))
            return
        record = {
            **fault.to_dict(),
            "victim": replica,
            "worker": w,
            "replicas": self._replica_names(w),
            "injected_at": round(now_s, 3),
        }
        if deferred:
            record["waited_for_rebuild_s"] = round(now_s - due, 3)
        self.injected.append(record)
        if w not in self.running:
            log.warning("fault %r: %s had already finished or died", fault, self.worker_name(w))
            return
        inc = self.current[w]
        if isinstance(fault, Pause):
            if self.host.pause(w, inc, fault.for_s):
                pending.append(_Thaw(w, inc, fault.at + fault.for_s))
                pending.sort(key=lambda f: f.at)
            log.info(
                "fault: SIGSTOP %s (hosting %s) at %.2f s for %g s",
                self.worker_name(w),
                self.name(rid),
                now_s,
                fault.for_s,
            )
            return
        log.info(
            "fault: SIGKILL %s (hosting %s) at %.2f s", self.worker_name(w), self.name(rid), now_s
        )
        self._kill_worker(w, now_s, "killed")

    def _defer(self, fault, now_s: float, due: float) -> None:
        """Look at ``fault`` (due at ``due``) again in a moment."""
        self.pending.append(_Deferred(fault, now_s + DEFER_STEP_S, due))
        self.pending.sort(key=lambda f: f.at)

    def _wait_for_rebuild(self, fault, now_s: float, due: float, deferred: bool, what: str) -> None:
        """Kill ``fault`` would take ``what``'s last live replica: look again in a moment,
        saying so the first time."""
        if not deferred:
            log.info("fault: %s waits for the rebuild of its twins (at %.2f s)", what, now_s)
        self._defer(fault, now_s, due)

    def _twins_rebuilding(self, w: int) -> bool:
        """Whether worker ``w`` hosts the last live replica of a partition whose other
        replicas are being rebuilt."""
        return any(rid not in self.down and self._last_live(*rid[:2]) for rid in self.placement[w])

    # -- the end --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop whatever still runs (also on errors and Ctrl-C) and remove the run's
        checkpoints."""
        self.finished = True
        try:
            self._close_savepoints()
            self.host.close()
        finally:
            if self.releaser is not None:
                self.releaser.close()
            if self._checkpoint_dir is not None:
                shutil.rmtree(self._checkpoint_dir, ignore_errors=True)
            from tandem import savepoints

            savepoints.release(self.plan)  # a rescaled resume's states

    def _draw(self, elapsed: float, done: bool = False) -> None:
        """The progress bar (tqdm, on stderr): source time run so far, and the workers
        killed, when."""
        if not self.progress:
            return
        if self._bar is None:
            from tqdm import tqdm

            bounded = self.duration is not None
            self._bar = tqdm(
                total=self.duration,
                file=sys.stderr,
                bar_format="{desc} |{bar:30}| {n:5.1f}/{total:g}s{postfix}"
                if bounded
                else "{desc} {n:5.1f}s, until stopped{postfix}",
                desc=self.plan.job,
                leave=True,
            )
        killed: dict[int, float] = {}
        for rid, t in self.killed.items():
            killed.setdefault(self.worker_of[rid], t)
        note = ", ".join(f"killed {self.worker_name(w)} at {t:.1f}s" for w, t in killed.items())
        rebuilt = sorted({(r["lost_s"], r["restored_s"]) for r in self.restored})
        if rebuilt:
            note += f"; r restored {len(rebuilt)}x (last at {rebuilt[-1][1]:.1f}s)"
        if self.duration is None and self.final:
            note = f"stopping at {self.end_s():.1f}s" + (f"; {note}" if note else "")
        self._bar.n = min(max(elapsed, 0.0), self.end_s())
        self._bar.set_postfix_str(note, refresh=False)
        self._bar.refresh()
        if done:
            self._bar.close()
            self._bar = None

    def result(self, check: bool, reports: dict[ReplicaId, ReplicaReport] | None = None) -> Result:
        """The run's :class:`Result` from the replicas' reports (``reports``: where they
        came another way than :class:`~tandem.engines.protocol.Done`)."""
        result = assemble_result(
            self.plan,
            self.end_s(),
            self.reports if reports is None else reports,
            t0_ns=self.t0_ns,
            warmup=self.warmup,
            check=check,
            faults=self.injected,
            lost_replicas=self.lost,
            rss_mb=getattr(self.host, "rss_mb", {}),
            kazoo=self.zoo,
            drained=self.drain,
            leads=self.leads,
        )
        result.restored_replicas = list(self.restored)
        result.workers_cpu_s = sum(self.cpu_s.values()) if self.cpu_s else None
        result.sink_handovers = list(self.handovers)
        result.rescales = list(self.rescales)
        if self.checkpointing:
            result.checkpoints = dict(self.checkpoint_stats)
        return result


def _raise_first(failures: tuple[tuple[ReplicaId, str, bool], ...]) -> None:
    """Fail the run for the first of a worker's failures, if any (:class:`Done`,
    :class:`Failed`)."""
    for _, error, diverged in failures:
        raise failure_error(error, diverged)


def _not_a_failure(event: Event) -> bool:
    return not (isinstance(event, Received) and isinstance(event.message, Failed))


__all__ = ["Call", "Coordinator", "Event", "Exited", "Received", "WorkerHost"]
