"""The rendezvous of a Spark run: a small server in the driver that every replica task calls.

Spark starts the replica tasks of a non-barrier job one by one and tells none of them
where the others are; barrier mode's ``allGather`` would, but it costs about a second and
a barrier job restarts *every* task when one fails — the opposite of what active
replication needs. So the driver runs this registry (a thread per connected task, on
``multiprocessing.connection``: length-prefixed pickles, HMAC-authenticated with the job
secret, so only the job's own tasks can talk to it) and every task, in ``replica_main``:

1. says hello: its Spark partition (= placement row), attempt number, PID and node;
2. once every task has checked in, gets its replica identity back — chosen so that the
   replicas of a partition run on different executors where there are several — or, if
   its placement row was already started once (Spark retried the task after a crash), is
   told to retire;
3. reports the port its inbox listens on;
4. once every replica has bound, gets every address and the logical time origin ``t0``;
5. reports when it has finished (or that its operator failed).

The registry is also where faults are injected: it knows every replica's PID, so a
``td.Kill`` SIGKILLs that Python worker (or the executor JVM hosting it) at ``t0 + at``.
A connection that drops before step 5 is a replica that died: killed on purpose, or a crash;
when every replica of a task partition is gone the run cannot continue and the registry
says so through ``on_failure``.
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
from tandem.faults import Kill
from tandem.plan import Plan
from tandem.runtime import ReplicaId

log = logging.getLogger("tandem")

REGISTER_TIMEOUT_S = 120.0
"""How long a replica task waits for the others (a slow cluster may start tasks late)."""


@dataclass
class Attempt:
    """One Spark task attempt that called the registry."""

    slot: int
    attempt: int
    pid: int
    node: str
    executor_pid: int | None
    replica: ReplicaId | None = None
    """None for an attempt that was told to retire."""


@dataclass
class RunLog:
    """What the registry saw during one run (kept by the engine as ``last_run``)."""

    attempts: list[Attempt] = field(default_factory=list)
    killed: dict[ReplicaId, float] = field(default_factory=dict)
    """Replica → seconds after t0 when a fault SIGKILLed it."""
    crashed: list[ReplicaId] = field(default_factory=list)
    faults: list[dict] = field(default_factory=list)
    t0_ns: int = 0
    failure: TandemError | None = None
    """Why the run was stopped: a replica's operator failed (TaskFailed), a whole
    partition was lost, or the run timed out."""

    def retried_slots(self) -> list[int]:
        """Placement rows that Spark started more than once."""
        return sorted({a.slot for a in self.attempts if a.replica is None})


class Registry:
    """The driver side (see the module documentation). Use as a context manager."""

    def __init__(
        self,
        plan: Plan,
        placement: list[ReplicaId],
        secret: bytes,
        duration: float,
        faults: list[Kill],
        *,
        host: str,
        startup_s: float,
        timeout: float,
        kill: str,
        on_failure: Callable[[TandemError], None],
    ) -> None:
        self.plan, self.placement, self.secret = plan, placement, secret
        self.duration, self.startup_s, self.kill = duration, startup_s, kill
        self.timeout = timeout
        self.faults = sorted(faults, key=lambda f: f.at)
        self.on_failure = on_failure
        self.log = RunLog()
        self._lock = threading.Condition()
        self._ports: dict[ReplicaId, int | None] = {}
        self._live: dict[ReplicaId, Attempt] = {}
        self._first: dict[int, Attempt] = {}
        self._assigned = False
        self._go: tuple | None = None
        self._closing = False
        # Every replica task checks in at about the same time: a backlog of one (the
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

    # -- one replica task -----------------------------------------------------------------

    def _serve(self, conn: Connection) -> None:
        attempt = None
        try:
            _, slot, number, pid, node, executor_pid = conn.recv()
            attempt = Attempt(slot, number, pid, node, executor_pid)
            with self._lock:
                self.log.attempts.append(attempt)
                if slot not in self._first:
                    self._first[slot] = attempt
                    if len(self._first) == len(self.placement):
                        self._assign()
                    self._lock.wait_for(lambda: self._assigned or self._closing)
            if attempt.replica is None:
                # A retry of a replica that crashed or was killed: its twin carries on, and
                # rejoining needs the twin's state (DESIGN §4), so this attempt stays out.
                conn.send(("retire", f"placement row {slot} was already started"))
                if self._go is None:  # its first attempt failed before the job started
                    self.fail(
                        TandemError(
                            f"the replica task of placement row {slot} failed while the job "
                            "was starting and was retried; see the executor log for why"
                        )
                    )
                return
            rid = attempt.replica
            conn.send(("replica", rid))
            _, port = conn.recv()
            with self._lock:
                self._ports[rid], self._live[rid] = port, attempt
                if len(self._ports) == len(self.placement):
                    self._start_run()
                while self._go is None and not self._closing:
                    self._lock.wait()
                if self._go is None:
                    return
            conn.send(self._go)
            _, error, diverged = conn.recv()  # ("done", error or None, diverged)
            with self._lock:
                self._live.pop(rid, None)
            if error is not None:
                self.fail(DeterminismError(error) if diverged else TaskFailed(error))
        except (EOFError, OSError):
            if attempt is not None and attempt.replica is not None:
                self._lost(attempt.replica)
        finally:
            conn.close()

    def _assign(self) -> None:
        """Give every first attempt its replica (called with the lock held, once all have
        checked in). Spark decides which executor runs which task, so the registry decides
        which task runs which replica: replica ``r`` of every partition goes to the
        ``r``-th executor (executors ordered by how many tasks they run, most first) while
        it has tasks left, else to any executor not yet holding a twin of that partition —
        so that one executor's crash takes one replica of a partition, not two. Unreplicated
        tasks (sinks) come last and go where tasks are left, the first executor preferred.
        With a single executor (local mode) row ``i`` simply runs ``placement[i]``."""
        self._assigned = True
        self._lock.notify_all()
        by_executor: dict[tuple, list[Attempt]] = {}
        for slot in sorted(self._first):
            a = self._first[slot]
            by_executor.setdefault((a.node, a.executor_pid), []).append(a)
        if len(by_executor) == 1:
            for slot, a in self._first.items():
                a.replica = self.placement[slot]
            return
        executors = sorted(by_executor, key=lambda e: (-len(by_executor[e]), e))
        groups: dict[tuple[int, int], list[ReplicaId]] = {}
        for rid in self.placement:
            groups.setdefault(rid[:2], []).append(rid)
        for group in sorted(groups.values(), key=lambda g: len(g) == 1):
            used: set[tuple] = set()
            for i, rid in enumerate(group):
                free = [e for e in executors if by_executor[e]]
                apart = [e for e in free if e not in used] or free
                home = executors[i % len(executors)]
                chosen = home if home in apart else apart[0]
                used.add(chosen)
                by_executor[chosen].pop(0).replica = rid
        shared = [
            g[0][:2]
            for g in groups.values()
            if len({(a.node, a.executor_pid) for a in self._first.values() if a.replica in g})
            < min(len(g), len(executors))
        ]
        if shared:
            log.warning("replicas of task partitions %s share an executor", shared)

    def _start_run(self) -> None:
        """Every replica has bound (called with the lock held): publish the addresses and
        the logical time origin, and schedule the faults relative to it."""
        addresses = {
            rid: (self._live[rid].node, port)
            for rid, port in self._ports.items()
            if port is not None
        }
        self.log.t0_ns = time.time_ns() + int(self.startup_s * 1e9)
        self._go = ("go", addresses, self.log.t0_ns, self.duration)
        self._lock.notify_all()
        self._spawn(self._watch_clock, "tandem-clock")

    def _watch_clock(self) -> None:
        """Inject the faults at their times, then fail the run if it outlives its timeout
        (``timeout`` seconds after ``t0``; starting up is bounded separately, by
        REGISTER_TIMEOUT_S in every replica)."""
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
            with self._lock:
                rid = (self.plan.task(fault.task).id, fault.partition, fault.replica)
                victim = self._live.get(rid)
                now_s = (time.time_ns() - self.log.t0_ns) / 1e9
                if victim is None:
                    log.warning("fault %r: the replica had already finished", fault)
                    continue
                if self.kill == "executor":
                    victims = [
                        (r, a)
                        for r, a in self._live.items()
                        if a.executor_pid == victim.executor_pid and a.node == victim.node
                    ]
                    pids = [a.pid for _, a in victims]
                    if victim.executor_pid is not None:  # None: no JVM found above the worker
                        pids.insert(0, victim.executor_pid)
                else:
                    victims, pids = [(rid, victim)], [victim.pid]
                for r, _ in victims:
                    self.log.killed[r] = now_s
                self.log.faults.append(
                    {**fault.to_dict(), "kind": "kill", "injected_at": round(now_s, 3)}
                )
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            log.info("fault: SIGKILL %s %s at %.2f s", self.kill, pids, now_s)

    def _lost(self, rid: ReplicaId) -> None:
        """A replica's connection dropped before it finished."""
        with self._lock:
            self._live.pop(rid, None)
            if self._closing:
                return
            starting = self._go is None
            if rid not in self.log.killed:
                log.warning("replica %s died unexpectedly", rid)
                self.log.crashed.append(rid)
            task, part, _ = rid
            gone = set(self.log.killed) | set(self.log.crashed)
            alive = [
                r for r in range(self.plan.tasks[task].replication) if (task, part, r) not in gone
            ]
        if starting:
            self.fail(TandemError(f"replica {rid} died while the job was starting; see its log"))
        elif not alive:
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
    """The replica side of step 1: connect and say hello; the caller reads the answer."""
    conn = Client(address, authkey=secret)
    conn.send(("hello", slot, attempt, os.getpid(), node, executor_pid()))
    return conn


def receive(conn: Connection, what: str, timeout: float = REGISTER_TIMEOUT_S):
    """The registry's next message, or a clear error if the driver never sends it."""
    if not conn.poll(timeout):
        raise TimeoutError(
            f"the tandem registry on the driver sent no {what} within {timeout:.0f} s; are all "
            "replica tasks running (one task slot per replica)?"
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
