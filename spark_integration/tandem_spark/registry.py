"""The rendezvous of a Spark run: a small server in the driver that every worker task calls.

Spark starts the worker tasks of a non-barrier job one by one and tells none of them
where the others are; barrier mode's ``allGather`` would, but it costs about a second and
a barrier job restarts *every* task when one fails — the opposite of what active
replication needs. So the driver runs this registry (a thread per connected task, on
``multiprocessing.connection``: length-prefixed pickles, HMAC-authenticated with the job
secret, so only the job's own tasks can talk to it) and every task, in ``worker_main``:

1. says hello: its Spark partition (= placement row), attempt number, PID and node;
2. once every task has checked in, gets its worker back — the index and the replicas of
   one worker of :meth:`tandem.plan.Plan.placement`, chosen so that the replicas of a
   partition run on different executors where there are several;
3. then speaks the exchange every engine has with its workers
   (:func:`tandem.engines.exchange.serve`): reports the port each of its replicas'
   inboxes listens on (``ready``); once every worker has, gets every address and the
   logical time origin ``t0`` (``go``); reports when it has finished (``done``, with
   which of its replicas' operators failed).

A task Spark retries — its worker was killed or crashed — checks in again with its
placement row. Under ``Job(restore=True)`` it **rejoins**: the registry plays the part the
local engine's coordinator plays (DESIGN §4) — it asks a live twin's worker for a cut of
each replica the lost worker hosted, hands the cuts to the retried task, tells the live
upstream replicas to link to the rebuilt ones and replay from the cuts, and records each
in ``restored_replicas`` once all of them feed it — so ``r`` is restored and a later loss
of the twins is masked too. Otherwise (or when it cannot rejoin: its twins are gone, the
stream is about to end, it landed on an executor that runs a twin of its replicas) the
retried task is told to retire.

The registry is also where faults are injected: it knows every worker's PID, so a
``td.Kill`` SIGKILLs the Python worker hosting the replica (or the executor JVM above it)
at ``t0 + at``, with every replica it hosts. A connection that drops before ``done`` is a
worker that died: killed on purpose, or a crash; when every replica of a task partition is
gone the run cannot continue and the registry says so through ``on_failure``. Under
``Job(restore=True)`` workers send keepalives, and one silent for the job's
``failure_timeout_ms`` (or dropped by an upstream replica as a straggler) is declared lost
and fenced — told to exit and, on a master on this machine, SIGKILLed — so Spark retries
it and it rejoins.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener

from tandem.engines.exchange import (
    REJOIN_ATTEMPTS,
    REJOIN_MARGIN_S,
    REJOIN_TIMEOUT_S,
    Feeding,
    listening,
    live_twins,
    rebuild_links,
    restored_entry,
    state_folder,
)
from tandem.exceptions import ConfigError, DeterminismError, TandemError, TaskFailed
from tandem.faults import Kill, KillWorker, Pause
from tandem.ordering import kazoo
from tandem.ordering.kazoo import KazooRun
from tandem.plan import Plan
from tandem.runtime import ReplicaId, Resume

log = logging.getLogger("tandem")

REGISTER_TIMEOUT_S = 120.0
"""How long a worker task waits for the others (a slow cluster may start tasks late)."""


@dataclass
class Attempt:
    """One Spark task attempt that called the registry."""

    slot: int
    attempt: int
    pid: int
    node: str
    executor_pid: int | None
    worker: int | None = None
    """The worker of the placement this attempt ran (rebuilt, if a retry rejoined); None
    for an attempt told to retire."""
    replicas: list[ReplicaId] = field(default_factory=list)
    """The replicas that worker hosts."""
    rejoined: bool = False
    """A retry that rebuilt its worker's replicas from their twins."""
    cause: str | None = None
    """Why its worker was taken down on purpose (``killed``, ``silent``, ``evicted``)."""
    executor_id: str | None = None
    """Spark's id of its executor (None: the driver's JVM, in local mode)."""

    @property
    def executor(self) -> tuple[str, int | None]:
        """The executor that ran the attempt: its node and JVM PID."""
        return (self.node, self.executor_pid)


@dataclass
class RunLog:
    """What the registry saw during one run (kept by the engine as ``last_run``)."""

    attempts: list[Attempt] = field(default_factory=list)
    killed: dict[ReplicaId, float] = field(default_factory=dict)
    """Replica → seconds after t0 when a fault last SIGKILLed its worker."""
    crashed: list[ReplicaId] = field(default_factory=list)
    lost: list[tuple[ReplicaId, str]] = field(default_factory=list)
    """Every loss of a replica, in order, with its cause (``killed``, ``crashed``, ...)."""
    restored: list[dict] = field(default_factory=list)
    """The replicas rebuilt from a live twin (``Result.restored_replicas``)."""
    faults: list[dict] = field(default_factory=list)
    t0_ns: int = 0
    failure: TandemError | None = None
    """Why the run was stopped: a replica's operator failed (TaskFailed), a whole
    partition was lost, or the run timed out."""

    def retried_slots(self) -> list[int]:
        """Placement rows that Spark started more than once."""
        slots = [a.slot for a in self.attempts]
        return sorted({s for s in slots if slots.count(s) > 1})

    def workers(self) -> dict[int, Attempt]:
        """Worker index → the task attempt that ran it last."""
        return {a.worker: a for a in self.attempts if a.worker is not None}

    def hosts(self) -> dict[ReplicaId, Attempt]:
        """Replica → the task attempt (so the executor) that ran it last."""
        return {rid: a for a in self.workers().values() for rid in a.replicas}


class _Peer:
    """A worker task's connection, which several registry threads send on."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._sending = threading.Lock()

    def send(self, message: tuple) -> bool:
        """Send ``message``; False if the task is gone."""
        with self._sending:
            try:
                self.conn.send(message)
            except OSError:
                return False
        return True


@dataclass
class _Rejoin:
    """A lost worker being rebuilt by a retried task (see the module documentation)."""

    worker: int
    attempt: Attempt
    twins: dict[ReplicaId, ReplicaId]
    lost_s: float
    generation: int = 0
    cuts: dict[ReplicaId, Resume] = field(default_factory=dict)
    refused: ReplicaId | None = None
    """A twin that could not be cut (finished, failed, or going by): cut again."""
    feeding: Feeding = field(default_factory=Feeding)
    started: bool = False
    """The retried task said its replicas have started (dialled their downstream
    replicas): until then it is no twin to count on."""


class Registry:
    """The driver side (see the module documentation). Use as a context manager.
    ``placement``: the replicas of every worker (:meth:`tandem.plan.Plan.placement`), one
    Spark task each. ``local``: the tasks run on this machine (their PIDs can be
    signalled). ``relaunch(slot, avoid)``: start placement row ``slot``'s task again in a
    Spark job of its own, on an executor whose id is not in ``avoid`` — for a worker
    whose retried task Spark ran beside its twins (after an executor crash)."""

    def __init__(
        self,
        plan: Plan,
        placement: list[list[ReplicaId]],
        secret: bytes,
        duration: float,
        faults: list[Kill | KillWorker | Pause],
        *,
        host: str,
        startup_s: float,
        timeout: float,
        kill: str,
        on_failure: Callable[[TandemError], None],
        zoo: KazooRun | None = None,
        warmup: float = 0.0,
        local: bool = True,
        relaunch: Callable[[int, set[str]], None] | None = None,
    ) -> None:
        self.plan, self.placement, self.secret = plan, placement, secret
        self.warmup, self.local, self.relaunch = warmup, local, relaunch
        self._relaunched: dict[int, int] = {}
        """Placement row → its tasks started by ``relaunch`` for its latest loss."""
        self._lost_at: dict[int, float] = {}
        """Worker → when it was last lost (seconds after t0)."""
        self.zoo = zoo
        self.worker_of = {rid: w for w, rids in enumerate(placement) for rid in rids}
        self.duration, self.startup_s, self.kill = duration, startup_s, kill
        self.timeout = timeout
        self.faults = sorted(faults, key=lambda f: f.at)
        self.on_failure = on_failure
        self.restoring = plan.restore and plan.replication > 1
        self.log = RunLog()
        self._lock = threading.Condition()
        self._ports: dict[ReplicaId, int | None] = {}
        self._nodes: dict[int, str] = {}
        """Worker → the node its inboxes listen on, once it has bound."""
        self._live: dict[int, Attempt] = {}
        """Workers bound and not finished (nor dead), by the attempt running them."""
        self._peers: dict[int, _Peer] = {}
        """Live worker → its connection, once it runs."""
        self._heard: dict[int, float] = {}
        """Live worker → when it last spoke (monotonic)."""
        self._down: set[ReplicaId] = set()
        """Replicas lost and not (yet) rebuilt."""
        self._rejoins: dict[int, _Rejoin] = {}
        self.addresses: dict[ReplicaId, tuple[str, int]] = {}
        self._first: dict[int, Attempt] = {}
        self._assigned = False
        self._go: tuple | None = None
        self._closing = False
        # Every worker task checks in at about the same time: a backlog of one (the
        # default) would drop connections whose clients then wait for ever.
        self._listener = Listener((host, 0), backlog=len(placement) + 8, authkey=secret)
        self.address: tuple[str, int] = self._listener.address
        self._threads: list[threading.Thread] = []
        self._state_dir: str | None = None
        """Where twins leave large states for rebuilt workers on the same host (see
        :meth:`_state_files`), made on first use and removed with the run."""

    # -- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> Registry:
        self._spawn(self._accept_loop, "tandem-registry")
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        # Wake the accept loop with a connection of our own; it sees _closing and exits.
        with contextlib.suppress(OSError), Client(self.address, authkey=self.secret):
            pass
        for t in self._threads:
            t.join(timeout=5)
        self._listener.close()
        if self._state_dir is not None:
            shutil.rmtree(self._state_dir, ignore_errors=True)

    def _spawn(self, target, name: str, *args) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except (OSError, EOFError, AuthenticationError):  # a client that is not ours
                if self._closing:
                    return
                continue
            if self._closing:
                conn.close()
                return
            self._spawn(self._serve, "tandem-registry-conn", conn)

    def _now_s(self) -> float:
        return (time.time_ns() - self.log.t0_ns) / 1e9

    # -- one worker task ------------------------------------------------------------------

    def _serve(self, conn: Connection) -> None:
        attempt = None
        try:
            _, slot, number, pid, node, jvm, executor = conn.recv()
            attempt = Attempt(slot, number, pid, node, jvm, executor_id=executor)
            with self._lock:
                self.log.attempts.append(attempt)
                if slot not in self._first and 0 <= slot < len(self.placement):
                    self._first[slot] = attempt
                    if len(self._first) == len(self.placement):
                        self._assign()
                    self._lock.wait_for(lambda: self._assigned or self._closing)
            if attempt.worker is None:
                rj = self._rejoinable(attempt)
                if rj is not None:
                    self._rejoin(conn, rj)
                    return
                # A retry of a worker that crashed or was killed, which does not rejoin:
                # the twins of its replicas carry on without it.
                conn.send(("retire", f"placement row {slot} was already started"))
                if self._go is None:  # its first attempt failed before the job started
                    self.fail(
                        TandemError(
                            f"the worker task of placement row {slot} failed while the job "
                            "was starting and was retried; see the executor log for why"
                        )
                    )
                return
            w = attempt.worker
            conn.send(("worker", w, attempt.replicas, False))
            kind, ports = conn.recv()  # ("ready", {replica: port or None}) or ("error", why)
            if kind != "ready":
                self.fail(ConfigError(str(ports)))
                return
            with self._lock:
                self._ports.update(ports)
                self._nodes[w], self._live[w] = attempt.node, attempt
                if len(self._nodes) == len(self.placement):
                    self._start_run()
                while self._go is None and not self._closing:
                    self._lock.wait()
                if self._go is None:
                    return
                peer = self._peers[w] = _Peer(conn)  # cut and link requests go through it too
                self._heard[w] = time.monotonic()
            peer.send(self._go)
            self._run(conn, attempt)
        except (EOFError, OSError):
            if attempt is not None and attempt.worker is not None:
                self._lost(attempt)
        finally:
            conn.close()

    def _run(self, conn: Connection, attempt: Attempt) -> None:
        """Serve a running worker's messages until it is ``done``: keepalives, and its
        replicas' answers to cut and link requests for rebuilt workers."""
        w = attempt.worker
        while True:
            msg = conn.recv()
            with self._lock:
                self._heard[w] = time.monotonic()
            if msg[0] == "done":
                break
            if msg[0] == "cut":
                self._on_cut(*msg[1:])
            elif msg[0] == "linked":
                self._on_linked(*msg[1:])
            elif msg[0] == "started":
                self._on_started(w)
            elif msg[0] == "evicted":
                self._on_evicted(*msg[1:])
        with self._lock:
            if self._live.get(w) is attempt:
                del self._live[w]
                self._peers.pop(w, None)
        for _, error, diverged in msg[1]:  # ("done", [(replica, error, diverged), ...])
            self.fail(DeterminismError(error) if diverged else TaskFailed(error))

    def _assign(self) -> None:
        """Give every first attempt its worker (called with the lock held, once all have
        checked in). Spark decides which executor runs which task, so the registry decides
        which task runs which worker: the workers of replica group ``g`` go to the
        ``g``-th executor (executors ordered by how many tasks they run, most first) while
        it has tasks left, else to any executor not yet running a twin of one of their
        replicas — so that one executor's crash takes one replica of a partition, not two.
        Workers of unreplicated tasks (the sinks') come last and go where tasks are left,
        the first executor preferred. With a single executor (local mode) row ``i``
        simply runs worker ``i``."""
        self._assigned = True
        self._lock.notify_all()
        by_executor: dict[tuple, list[Attempt]] = {}
        for slot in sorted(self._first):
            a = self._first[slot]
            by_executor.setdefault(a.executor, []).append(a)
        if len(by_executor) == 1:
            for slot, a in self._first.items():
                self._give(a, slot)
            return
        executors = sorted(by_executor, key=lambda e: (-len(by_executor[e]), e[0], e[1] or 0))
        tasks = self.plan.tasks

        def replicated(w: int) -> bool:
            return any(tasks[t].replication > 1 for t, _, _ in self.placement[w])

        order = sorted(
            range(len(self.placement)),
            key=lambda w: (not replicated(w), self.placement[w][0][2], w),
        )
        hosts: dict[tuple[int, int], set[tuple]] = {}  # task partition -> its executors
        for w in order:
            parts = {rid[:2] for rid in self.placement[w]}
            free = [e for e in executors if by_executor[e]]
            apart = [e for e in free if not any(e in hosts.get(tp, ()) for tp in parts)] or free
            home = executors[self.placement[w][0][2] % len(executors) if replicated(w) else 0]
            chosen = home if home in apart else apart[0]
            for tp in parts:
                hosts.setdefault(tp, set()).add(chosen)
            self._give(by_executor[chosen].pop(0), w)
        shared = sorted(
            tp
            for tp, es in hosts.items()
            if len(es) < min(tasks[tp[0]].replication, len(executors))
        )
        if shared:
            log.warning("replicas of task partitions %s share an executor", shared)

    def _give(self, attempt: Attempt, w: int) -> None:
        attempt.worker, attempt.replicas = w, list(self.placement[w])

    def _start_run(self) -> None:
        """Every worker has bound (called with the lock held): publish the addresses and
        the logical time origin (with the run's length and warm-up), and schedule the
        faults relative to it."""
        addresses = {
            rid: (self._nodes[self.worker_of[rid]], port)
            for rid, port in self._ports.items()
            if port is not None
        }
        self.addresses = addresses
        self.log.t0_ns = time.time_ns() + int(self.startup_s * 1e9)
        self._go = ("go", dict(addresses), self.log.t0_ns, self.duration, self.warmup)
        self._lock.notify_all()
        self._spawn(self._watch_clock, "tandem-clock")
        if self.restoring:
            self._spawn(self._watch_keepalives, "tandem-keepalives")

    def _watch_clock(self) -> None:
        """Inject the faults at their times, then fail the run if it outlives its timeout
        (``timeout`` seconds after ``t0``; starting up is bounded separately, by
        REGISTER_TIMEOUT_S in every worker task)."""
        self._inject_faults()
        if self._sleep_until(self.timeout):
            return
        self.fail(
            TandemError(
                f"the run did not finish within {self.timeout:.0f} s of its start; raise "
                "timeout= if the job is expected to take longer"
            )
        )

    def _sleep_until(self, offset_s: float) -> bool:
        """Wait until ``t0 + offset_s``; True if the registry closed meanwhile."""
        delay = self.log.t0_ns / 1e9 + offset_s - time.time()
        with self._lock:
            return self._lock.wait_for(lambda: self._closing, timeout=max(0.0, delay))

    # -- faults and deaths ----------------------------------------------------------------

    def _inject_faults(self) -> None:
        for fault in self.faults:
            if self._sleep_until(fault.at):
                return
            replica = None if isinstance(fault, KillWorker) else fault.replica
            if isinstance(replica, str):  # a KaZoo role: who holds it now
                task = self.plan.task(fault.task)
                with self._lock:
                    alive = [
                        r
                        for r in range(task.replication)
                        if self.worker_of[(task.id, fault.partition, r)] in self._live
                    ]
                try:
                    replica = kazoo.resolve_role(self.zoo, task.id, fault.partition, replica, alive)
                except TandemError as exc:
                    log.warning("fault %r: %s", fault, exc)
                    continue
            with self._lock:
                if isinstance(fault, KillWorker):
                    w = fault.worker
                else:
                    w = self.worker_of[(self.plan.task(fault.task).id, fault.partition, replica)]
                victim = self._live.get(w)
                now_s = (time.time_ns() - self.log.t0_ns) / 1e9
                if victim is None:
                    log.warning("fault %r: worker %d had already finished or died", fault, w)
                    continue
                if isinstance(fault, Pause):
                    workers, pids = [w], [victim.pid]
                elif self.kill == "executor":
                    workers = sorted(
                        v for v, a in self._live.items() if a.executor == victim.executor
                    )
                    pids = [self._live[v].pid for v in workers]
                    if victim.executor_pid is not None:  # None: no JVM found above the worker
                        pids.insert(0, victim.executor_pid)
                else:
                    workers, pids = [w], [victim.pid]
                replicas = [rid for v in workers for rid in self.placement[v]]
                for v in workers if not isinstance(fault, Pause) else ():
                    self._live[v].cause = "killed"
                    for rid in self.placement[v]:
                        self.log.killed[rid] = now_s
                self.log.faults.append(
                    {
                        **fault.to_dict(),
                        "victim": replica,
                        "worker": w,
                        "workers": workers,
                        "replicas": [
                            {"task": self.plan.tasks[t].name, "partition": p, "replica": r}
                            for t, p, r in replicas
                        ],
                        "injected_at": round(now_s, 3),
                    }
                )
            if isinstance(fault, Pause):
                self._pause(victim, fault.for_s, now_s)
                continue
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            log.info("fault: SIGKILL %s %s (workers %s) at %.2f s", self.kill, pids, workers, now_s)

    def _pause(self, victim: Attempt, for_s: float, now_s: float) -> None:
        """A ``td.Pause``: SIGSTOP the worker task's Python process now and SIGCONT it
        ``for_s`` seconds later — unless it was declared lost and fenced meanwhile."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim.pid, signal.SIGSTOP)
        log.info("fault: SIGSTOP worker %d (PID %d) at %.2f s", victim.worker, victim.pid, now_s)

        def resume() -> None:
            if victim.cause is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim.pid, signal.SIGCONT)
                log.info("fault: SIGCONT worker %d at %.2f s", victim.worker, self._now_s())

        timer = threading.Timer(for_s, resume)
        timer.daemon = True
        timer.start()

    def _lost(self, attempt: Attempt) -> None:
        """A worker task's connection dropped before it finished: every replica its worker
        hosts is gone (a rebuild it was running is given up)."""
        w = attempt.worker
        with self._lock:
            if self._closing:
                return
            rj = self._rejoins.get(w)
            if rj is not None and rj.attempt is attempt:
                del self._rejoins[w]
                self._lock.notify_all()
                log.warning("worker %d is not rebuilt: its retried task died too", w)
            if self._live.get(w) is not attempt:
                return
            del self._live[w]
            self._peers.pop(w, None)
            starting = self._go is None
            cause = attempt.cause or "crashed"
            gone = [rid for rid in self.placement[w] if rid not in self._down]
            if cause == "crashed" and gone:
                log.warning("worker %d (replicas %s) died unexpectedly", w, gone)
                self.log.crashed.extend(gone)
            self.log.lost += [(rid, cause) for rid in gone]
            self._lost_at[w] = self._now_s()
            self._relaunched.pop(attempt.slot, None)  # a new loss
            self._down |= set(gone)
            orphans = [
                (task, part)
                for task, part, _ in self.placement[w]
                if all(
                    (task, part, r) in self._down for r in range(self.plan.tasks[task].replication)
                )
            ]
        if starting:
            self.fail(TandemError(f"worker {w} died while the job was starting; see its log"))
        elif orphans:
            task, part = orphans[0]
            self.fail(
                TandemError(
                    f"every replica of {self.plan.tasks[task].describe()} partition {part} is "
                    "gone; the job cannot continue"
                )
            )

    def _fence(self, w: int, cause: str, why: str) -> None:
        """Take live worker ``w`` down on purpose (``cause``): tell it to exit and, on a
        master on this machine, SIGKILL it; Spark retries its task, which rejoins."""
        with self._lock:
            attempt, peer = self._live.get(w), self._peers.get(w)
            if attempt is None or attempt.cause is not None:
                return
            attempt.cause = cause
        log.warning("worker %d %s: declared lost and fenced", w, why)
        if peer is not None:
            peer.send(("exit", why))
        if self.local:
            with contextlib.suppress(ProcessLookupError):
                os.kill(attempt.pid, signal.SIGKILL)

    def _on_evicted(self, up: ReplicaId, down: ReplicaId) -> None:
        """``up`` dropped ``down`` as a straggler: its input is incomplete from then on."""
        w = self.worker_of[down]
        if not self._hosts_sinks(w):
            self._fence(w, "evicted", f"was dropped by {up} as a straggler ({down})")

    def _watch_keepalives(self) -> None:
        """Declare lost every running worker silent for the job's ``failure_timeout_ms``
        (a frozen or wedged task: its keepalives stopped), except the sinks' (they have no
        twin to take over)."""
        limit = self.plan.failure_timeout_ms / 1000
        while True:
            with self._lock:
                if self._lock.wait_for(lambda: self._closing, timeout=limit / 4):
                    return
                now = time.monotonic()
                silent = [
                    (w, now - self._heard.get(w, now))
                    for w in sorted(self._live)
                    if now - self._heard.get(w, now) > limit and not self._hosts_sinks(w)
                ]
            for w, quiet in silent:
                self._fence(w, "silent", f"has been silent for {quiet * 1000:.0f} ms")

    def _hosts_sinks(self, w: int) -> bool:
        return any(self.plan.tasks[t].kind == "sink" for t, _, _ in self.placement[w])

    # -- rebuilding a lost worker in its retried task (Job(restore=True)) ---------------

    def _rejoinable(self, attempt: Attempt) -> _Rejoin | None:
        """A retried task: the rebuild it runs of its placement row's worker, or None
        (with the reason, if it is one the user may want to know) if it retires."""
        first = self._first.get(attempt.slot)
        if self._go is None or not self.restoring or first is None:
            return None
        w = first.worker
        with self._lock:
            # The connection of the attempt it replaces may not have dropped yet.
            self._lock.wait_for(lambda: self._live.get(w) is None or self._closing, timeout=5)
            now_s = self._now_s()
            why = None
            twins = live_twins(self.plan, self.placement[w], self._down)
            if self._closing or self.log.failure is not None:
                return None
            if w in self._live or w in self._rejoins:
                why = "its worker still runs"
            elif self._hosts_sinks(w):
                return None  # sinks are not replicated: nothing to rebuild them from
            elif now_s > self.duration - REJOIN_MARGIN_S:
                why = f"the stream ends in under {REJOIN_MARGIN_S:g} s"
            elif twins is None:
                return None  # every replica of a partition is gone: the run fails for it
            else:
                shared = sorted(
                    rid
                    for rid, twin in twins.items()
                    if self._live.get(self.worker_of[twin]) is not None
                    and self._live[self.worker_of[twin]].executor == attempt.executor
                    and len({a.executor for a in self._first.values()}) > 1
                )
                if shared:
                    why = (
                        f"Spark ran its retried task on executor {attempt.executor_id} "
                        f"({attempt.node}, JVM {attempt.executor_pid}), which runs the twins "
                        f"of {shared}; one executor's crash must not take two replicas of a "
                        "partition"
                    )
                    avoid = {
                        self._live[self.worker_of[twin]].executor_id
                        for twin in twins.values()
                        if self.worker_of[twin] in self._live
                    }
                    tries = self._relaunched.get(attempt.slot, 0)
                    if self.relaunch is not None and None not in avoid and tries < REJOIN_ATTEMPTS:
                        self._relaunched[attempt.slot] = tries + 1
                        log.info("worker %d: %s; it is started again on another executor", w, why)
                        self.relaunch(attempt.slot, avoid)
                        return None
            if why is not None:
                log.warning("worker %d is not rebuilt: %s", w, why)
                return None
            self._give(attempt, w)
            attempt.rejoined = True
            rj = _Rejoin(w, attempt, twins, self._lost_at.get(w, now_s))
            self._rejoins[w] = rj
        log.info("rebuilding worker %d (%s) from live twins", w, self.placement[w])
        return rj

    def _rejoin(self, conn: Connection, rj: _Rejoin) -> None:
        """Run rebuild ``rj`` in its retried task (on that task's registry thread): get
        the twins' cuts to it, link its upstream replicas to it once it listens, let it
        go; then serve it like any running worker."""
        attempt, w = rj.attempt, rj.worker
        peer = _Peer(conn)
        conn.send(("worker", w, attempt.replicas, True))
        kind, value = conn.recv()  # ("waiting", None): it has loaded the job
        if kind != "waiting" or not self._cut_twins(rj):
            self._abort_rejoin(rj, str(value) if kind == "error" else "no cut could be taken")
            peer.send(("abandon", None))
            return
        conn.send(("resume", rj.cuts, self.log.t0_ns))
        kind, ports = conn.recv()
        if kind != "ready":
            self._abort_rejoin(rj, str(ports))
            return
        with self._lock:
            if self._rejoins.get(w) is not rj or self._closing:
                peer.send(("abandon", None))
                return
            self.addresses |= listening(ports, attempt.node)
            links, here = rebuild_links(
                self.plan, ports, rj.cuts, self._down, lambda up: self.worker_of[up] == w
            )
            rj.feeding = Feeding(dict.fromkeys(here, False), {(up, rid) for up, rid, _ in links})
            self._live[w], self._peers[w], self._heard[w] = attempt, peer, time.monotonic()
            go = ("go", dict(self.addresses), self.log.t0_ns, self.duration, self.warmup)
        timer = threading.Timer(REJOIN_TIMEOUT_S, self._expire, args=(rj,))
        timer.daemon = True
        timer.start()
        peer.send(go)
        for up, rid, epoch in links:
            with self._lock:
                upstream = self._peers.get(self.worker_of[up])
            sent = upstream is not None and upstream.send(
                ("link", up, rid, self.addresses[rid], epoch)
            )
            if not sent:
                self._on_linked(up, rid, "its worker is gone")
        try:
            self._run(conn, attempt)
        finally:
            timer.cancel()

    def _cut_twins(self, rj: _Rejoin) -> bool:
        """Ask the twins' workers for a cut of every replica ``rj`` rebuilds, again if one
        could not be taken (up to REJOIN_ATTEMPTS times); True once all are in."""
        deadline = time.monotonic() + REJOIN_TIMEOUT_S
        for _ in range(REJOIN_ATTEMPTS):
            with self._lock:
                rj.generation += 1
                rj.cuts, rj.refused = {}, None
                asks = [
                    (
                        self._peers.get(self.worker_of[twin]),
                        twin,
                        (rj.worker, rj.generation, rid),
                        self._state_files(rj, self.worker_of[twin]),
                    )
                    for rid, twin in rj.twins.items()
                ]
            if any(
                peer is None or not peer.send(("cut", twin, token, *folder))
                for peer, twin, token, folder in asks
            ):
                return False  # a twin's worker is gone
            with self._lock:
                self._lock.wait_for(
                    lambda: (
                        len(rj.cuts) == len(rj.twins)
                        or rj.refused is not None
                        or self._rejoins.get(rj.worker) is not rj
                        or self._closing
                    ),
                    timeout=max(0.0, deadline - time.monotonic()),
                )
                if self._rejoins.get(rj.worker) is not rj or self._closing:
                    return False
                if len(rj.cuts) == len(rj.twins):
                    return True
                if rj.refused is None:  # timed out
                    return False
                log.info("worker %d: twin %s could not be cut; trying again", rj.worker, rj.refused)
        return False

    def _state_files(self, rj: _Rejoin, twin_worker: int) -> tuple[str, ...]:
        """Where the twin's worker ``twin_worker`` should leave a large state for ``rj``
        (called with the lock held): a folder this driver made, when the master runs on
        this machine and the twin's worker and the retried task are on one node — the
        file then never travels through the registry, as on the local engine. Else
        nothing: the state comes inline."""
        if not self.local or self._nodes.get(twin_worker) != rj.attempt.node:
            return ()
        if self._state_dir is None:
            self._state_dir = state_folder()
        return (self._state_dir,)

    def _on_cut(self, twin: ReplicaId, taken: Resume | None, token) -> None:
        w, generation, rid = token
        with self._lock:
            rj = self._rejoins.get(w)
            if rj is None or rj.generation != generation:
                return
            if taken is None:
                rj.refused = twin
            else:
                rj.cuts[rid] = taken
            self._lock.notify_all()

    def _on_linked(self, up: ReplicaId, down: ReplicaId, error: str | None) -> None:
        with self._lock:
            rj = self._rejoins.get(self.worker_of[down])
            if rj is None or (up, down) not in rj.feeding.asked:
                return
            if error is not None:
                log.warning("%s could not feed the rebuilt %s: %s", up, down, error)
            done = rj.feeding.answered(up, down, error) and rj.started
        if done:
            self._linked(rj)

    def _on_started(self, w: int) -> None:
        with self._lock:
            rj = self._rejoins.get(w)
            if rj is None:
                return
            rj.started = True
            done = not rj.feeding.asked
        if done:
            self._linked(rj)

    def _linked(self, rj: _Rejoin) -> None:
        """Every link request of ``rj`` is answered: its replicas are restored if a live
        upstream replica feeds each input; else the rebuilt worker is fenced (Spark then
        retries its task, which rejoins from later cuts)."""
        unfed = sorted(f"{rid} from {part}" for rid, part in rj.feeding.unfed())
        if unfed:
            why = "no live upstream replica could replay its input: " + ", ".join(unfed)
            if rj.feeding.stale:
                why += " (a replay window no longer reached back to its cut)"
            self._abort_rejoin(rj, why)
            self._fence(rj.worker, "unfed", why)
            return
        with self._lock:
            if self._rejoins.get(rj.worker) is not rj:
                return
            del self._rejoins[rj.worker]
            now_s = self._now_s()
            for rid in self.placement[rj.worker]:
                self._down.discard(rid)
                self.log.restored.append(
                    restored_entry(
                        self.plan,
                        rid,
                        rj.twins[rid],
                        rj.cuts.get(rid),
                        rj.lost_s,
                        now_s,
                        warm=False,
                    )
                )
        log.info(
            "rebuilt worker %d at %.2f s (%.0f ms after its loss)",
            rj.worker,
            now_s,
            (now_s - rj.lost_s) * 1000,
        )

    def _expire(self, rj: _Rejoin) -> None:
        with self._lock:
            pending = self._rejoins.get(rj.worker) is rj
        if pending:
            why = f"not done within {REJOIN_TIMEOUT_S:.0f} s"
            self._abort_rejoin(rj, why)
            self._fence(rj.worker, "unfed", why)

    def _abort_rejoin(self, rj: _Rejoin, why: str) -> None:
        with self._lock:
            if self._rejoins.get(rj.worker) is not rj:
                return
            del self._rejoins[rj.worker]
            self._lock.notify_all()
        log.warning(
            "worker %d is not rebuilt: %s; its partitions go on with fewer replicas",
            rj.worker,
            why,
        )

    def fail(self, error: TandemError) -> None:
        """Stop the run for ``error`` (the first reason given wins)."""
        with self._lock:
            if self.log.failure is not None:
                return
            self.log.failure = error
        self.on_failure(error)


def register(address, secret: bytes, slot: int, attempt: int, node: str) -> Connection:
    """The worker task's side of step 1: connect and say hello; the caller reads the
    answer."""
    conn = Client(address, authkey=secret)
    jvm = executor_pid()
    conn.send(("hello", slot, attempt, os.getpid(), node, jvm, executor_id(jvm)))
    return conn


def receive(conn: Connection, what: str, timeout: float = REGISTER_TIMEOUT_S):
    """The registry's next message, or a clear error if the driver never sends it."""
    if not conn.poll(timeout):
        raise TimeoutError(
            f"the tandem registry on the driver sent no {what} within {timeout:.0f} s; are all "
            "worker tasks running (one task slot per worker)?"
        )
    return conn.recv()


def executor_id(jvm: int | None) -> str | None:
    """Spark's id of the executor JVM ``jvm`` (its ``--executor-id`` argument), or None
    (in local mode the JVM is the driver's)."""
    if jvm is None:
        return None
    try:
        with open(f"/proc/{jvm}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except OSError:
        return None
    for flag, value in itertools.pairwise(args):
        if flag == b"--executor-id":
            return value.decode()
    return None


def executor_pid() -> int | None:
    """The PID of the executor JVM hosting this Python worker: the nearest ancestor process
    named ``java`` (the worker's parent is usually PySpark's daemon), or None."""
    pid = os.getppid()
    for _ in range(4):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            return None
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        if name == "java":
            return pid
        pid = int(stat[stat.rindex(")") + 2 :].split()[1])
        if pid <= 1:
            return None
    return None
