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
   partition run on different executors where there are several — or, if its placement
   row was already started once (Spark retried the task after a crash), is told to
   retire;
3. reports the port each of its replicas' inboxes listens on;
4. once every worker has bound, gets every address and the logical time origin ``t0``;
5. reports when it has finished (and which of its replicas' operators failed).

The registry is also where faults are injected: it knows every worker's PID, so a
``td.Kill`` SIGKILLs the Python worker hosting the replica (or the executor JVM above it)
at ``t0 + at``, with every replica it hosts. A connection that drops before step 5 is a
worker that died: killed on purpose, or a crash; when every replica of a task partition is
gone the run cannot continue and the registry says so through ``on_failure``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener

from tandem.exceptions import DeterminismError, TandemError, TaskFailed
from tandem.faults import Kill, KillWorker
from tandem.ordering import kazoo
from tandem.ordering.kazoo import KazooRun
from tandem.plan import Plan
from tandem.runtime import ReplicaId

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
    """The worker of the placement this attempt ran; None for an attempt told to retire."""
    replicas: list[ReplicaId] = field(default_factory=list)
    """The replicas that worker hosts."""

    @property
    def executor(self) -> tuple[str, int | None]:
        """The executor that ran the attempt: its node and JVM PID."""
        return (self.node, self.executor_pid)


@dataclass
class RunLog:
    """What the registry saw during one run (kept by the engine as ``last_run``)."""

    attempts: list[Attempt] = field(default_factory=list)
    killed: dict[ReplicaId, float] = field(default_factory=dict)
    """Replica → seconds after t0 when a fault SIGKILLed its worker."""
    crashed: list[ReplicaId] = field(default_factory=list)
    faults: list[dict] = field(default_factory=list)
    t0_ns: int = 0
    failure: TandemError | None = None
    """Why the run was stopped: a replica's operator failed (TaskFailed), a whole
    partition was lost, or the run timed out."""

    def retried_slots(self) -> list[int]:
        """Placement rows that Spark started more than once."""
        return sorted({a.slot for a in self.attempts if a.worker is None})

    def workers(self) -> dict[int, Attempt]:
        """Worker index → the task attempt that ran it."""
        return {a.worker: a for a in self.attempts if a.worker is not None}

    def hosts(self) -> dict[ReplicaId, Attempt]:
        """Replica → the task attempt (so the executor) that ran it."""
        return {rid: a for a in self.workers().values() for rid in a.replicas}


class Registry:
    """The driver side (see the module documentation). Use as a context manager.
    ``placement``: the replicas of every worker (:meth:`tandem.plan.Plan.placement`), one
    Spark task each."""

    def __init__(
        self,
        plan: Plan,
        placement: list[list[ReplicaId]],
        secret: bytes,
        duration: float,
        faults: list[Kill | KillWorker],
        *,
        host: str,
        startup_s: float,
        timeout: float,
        kill: str,
        on_failure: Callable[[TandemError], None],
        zoo: KazooRun | None = None,
        warmup: float = 0.0,
    ) -> None:
        self.plan, self.placement, self.secret = plan, placement, secret
        self.warmup = warmup
        self.zoo = zoo
        self.worker_of = {rid: w for w, rids in enumerate(placement) for rid in rids}
        self.duration, self.startup_s, self.kill = duration, startup_s, kill
        self.timeout = timeout
        self.faults = sorted(faults, key=lambda f: f.at)
        self.on_failure = on_failure
        self.log = RunLog()
        self._lock = threading.Condition()
        self._ports: dict[ReplicaId, int | None] = {}
        self._nodes: dict[int, str] = {}
        """Worker → the node its inboxes listen on, once it has bound."""
        self._live: dict[int, Attempt] = {}
        """Workers bound and not finished (nor dead)."""
        self._first: dict[int, Attempt] = {}
        self._assigned = False
        self._go: tuple | None = None
        self._closing = False
        # Every worker task checks in at about the same time: a backlog of one (the
        # default) would drop connections whose clients then wait for ever.
        self._listener = Listener((host, 0), backlog=len(placement) + 8, authkey=secret)
        self.address: tuple[str, int] = self._listener.address
        self._threads: list[threading.Thread] = []

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

    # -- one worker task ------------------------------------------------------------------

    def _serve(self, conn: Connection) -> None:
        attempt = None
        try:
            _, slot, number, pid, node, executor_pid = conn.recv()
            attempt = Attempt(slot, number, pid, node, executor_pid)
            with self._lock:
                self.log.attempts.append(attempt)
                if slot not in self._first and 0 <= slot < len(self.placement):
                    self._first[slot] = attempt
                    if len(self._first) == len(self.placement):
                        self._assign()
                    self._lock.wait_for(lambda: self._assigned or self._closing)
            if attempt.worker is None:
                # A retry of a worker that crashed or was killed: the twins of its replicas
                # carry on, and rejoining needs their state (DESIGN §4), so this attempt
                # stays out.
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
            conn.send(("worker", w, attempt.replicas))
            _, ports = conn.recv()  # ("bound", {replica: port or None})
            with self._lock:
                self._ports.update(ports)
                self._nodes[w], self._live[w] = attempt.node, attempt
                if len(self._nodes) == len(self.placement):
                    self._start_run()
                while self._go is None and not self._closing:
                    self._lock.wait()
                if self._go is None:
                    return
            conn.send(self._go)
            _, failures = conn.recv()  # ("done", [(replica, error, diverged), ...])
            with self._lock:
                self._live.pop(w, None)
            for _, error, diverged in failures:
                self.fail(DeterminismError(error) if diverged else TaskFailed(error))
        except (EOFError, OSError):
            if attempt is not None and attempt.worker is not None:
                self._lost(attempt.worker)
        finally:
            conn.close()

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
        self.log.t0_ns = time.time_ns() + int(self.startup_s * 1e9)
        self._go = ("go", addresses, self.log.t0_ns, self.duration, self.warmup)
        self._lock.notify_all()
        self._spawn(self._watch_clock, "tandem-clock")

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
                if self.kill == "executor":
                    workers = sorted(
                        v for v, a in self._live.items() if a.executor == victim.executor
                    )
                    pids = [self._live[v].pid for v in workers]
                    if victim.executor_pid is not None:  # None: no JVM found above the worker
                        pids.insert(0, victim.executor_pid)
                else:
                    workers, pids = [w], [victim.pid]
                replicas = [rid for v in workers for rid in self.placement[v]]
                for rid in replicas:
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
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            log.info("fault: SIGKILL %s %s (workers %s) at %.2f s", self.kill, pids, workers, now_s)

    def _lost(self, w: int) -> None:
        """A worker's connection dropped before it finished: every replica it hosts is
        gone."""
        with self._lock:
            self._live.pop(w, None)
            if self._closing:
                return
            starting = self._go is None
            crashed = [rid for rid in self.placement[w] if rid not in self.log.killed]
            if crashed:
                log.warning("worker %d (replicas %s) died unexpectedly", w, crashed)
                self.log.crashed.extend(crashed)
            gone = set(self.log.killed) | set(self.log.crashed)
            orphans = [
                (task, part)
                for task, part, _ in self.placement[w]
                if all((task, part, r) in gone for r in range(self.plan.tasks[task].replication))
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
    conn.send(("hello", slot, attempt, os.getpid(), node, executor_pid()))
    return conn


def receive(conn: Connection, what: str, timeout: float = REGISTER_TIMEOUT_S):
    """The registry's next message, or a clear error if the driver never sends it."""
    if not conn.poll(timeout):
        raise TimeoutError(
            f"the tandem registry on the driver sent no {what} within {timeout:.0f} s; are all "
            "worker tasks running (one task slot per worker)?"
        )
    return conn.recv()


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
