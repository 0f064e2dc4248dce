"""The Spark engine's host of workers: a small server in the driver that every worker task
calls, and through which the run's coordinator speaks to them.

Spark starts the worker tasks of a non-barrier job one by one and tells none of them
where the others are; barrier mode's ``allGather`` would, but it costs about a second and
a barrier job restarts *every* task when one fails — the opposite of what active
replication needs. So the driver runs this registry (a thread per connected task, on
``multiprocessing.connection``: length-prefixed pickles, HMAC-authenticated with the job
secret, so only the job's own tasks can talk to it) and every task, in ``worker_main``:

1. says :class:`~tandem.engines.protocol.Hello`: its Spark partition (= placement row),
   attempt number, PID and node;
2. once every task has checked in, gets its worker back
   (:class:`~tandem.engines.protocol.Assign`) — the index and the replicas of one worker
   of :meth:`tandem.plan.Plan.placement`, chosen so that the replicas of a partition run
   on different executors where there are several;
3. then speaks the exchange every engine has with its workers
   (:func:`tandem.engines.exchange.serve`) with the run's
   :class:`~tandem.engines.coordinator.Coordinator` — the one the local engine runs too,
   here on a thread of the driver: this registry is its
   :class:`~tandem.engines.coordinator.WorkerHost`, handing every message it reads over as
   an event and sending what the coordinator says.

The coordinator decides everything else — faults, losses, fencing, rebuilds — as on the
local engine. What is Spark's here: a worker lost is rebuilt by the task Spark retries
(``Job(restore=True)``): the retry checks in with its placement row and *claims* the
rebuild the coordinator has waiting for that worker, as the worker's next incarnation
(a retry with nothing to claim is told to retire); where Spark ran the retry on an
executor that runs a twin of its replicas (after an executor crash), the registry starts
the row again in a Spark job of its own elsewhere (``relaunch``). Faults reach the
processes of the executors on this machine: ``td.Kill`` SIGKILLs the Python worker (or
the executor JVM above it), ``td.Pause`` freezes it; a fenced worker is told to exit and,
on a master on this machine, SIGKILLed.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError
from multiprocessing.connection import (
    Client,
    Connection,
    answer_challenge,
    deliver_challenge,
)

import psutil

from tandem.engines.coordinator import Call, Coordinator, Event, Exited, Received
from tandem.engines.exchange import REJOIN_ATTEMPTS, state_folder
from tandem.engines.protocol import (
    Assign,
    Crash,
    Done,
    Exit,
    Freeze,
    Hello,
    Message,
    Retire,
    check_version,
    expect,
)
from tandem.exceptions import TandemError
from tandem.plan import Plan
from tandem.runtime import ReplicaId

log = logging.getLogger("tandem")

REGISTER_TIMEOUT_S = 120.0
"""How long a worker task waits for the others (a slow cluster may start tasks late)."""

CLAIM_WAIT_S = 5.0
"""How long a retried task waits for the coordinator to see its worker's loss (the
connection of the attempt it replaces may not have dropped yet)."""

ELSEWHERE_FIRST_S = 20.0
"""How long the rebuild of a worker fenced on purpose (cut off, frozen, a straggler) is
kept for the task started again on another executor: Spark's own retry of its task, on
the executor it was fenced on — a host just cut off and healed, say — waits that long
before it may claim the rebuild itself (a task on a busy cluster can take ten seconds
to start its Python worker)."""


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
    incarnation: int = 0
    """Which incarnation of its worker it runs."""

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
    """A worker task's connection, which several threads send on."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._sending = threading.Lock()

    def send(self, message: Message) -> bool:
        """Send ``message``; False if the task is gone."""
        with self._sending:
            try:
                self.conn.send(message)
            except OSError:
                return False
        return True


class Registry:
    """The driver side (see the module documentation). Use as a context manager, and set
    :attr:`coordinator` before the Spark job starts. ``placement``: the replicas of every
    worker (:meth:`tandem.plan.Plan.placement`), one Spark task each. ``local``: the tasks
    run on this machine (their PIDs can be signalled). ``kill``: what a ``td.Kill``
    takes down, the Python ``worker`` or its ``executor`` JVM. ``relaunch(slot,
    avoid)``: start placement row ``slot``'s task again in a Spark job of its own, on an
    executor whose id is not in ``avoid``. ``on_failure(error)``: stop the Spark job."""

    name = "spark"
    starts_rebuilds = False

    def __init__(
        self,
        plan: Plan,
        placement: list[list[ReplicaId]],
        secret: bytes,
        *,
        host: str,
        kill: str,
        on_failure: Callable[[TandemError], None],
        local: bool = True,
        relaunch: Callable[[int, set[str]], None] | None = None,
    ) -> None:
        self.plan, self.placement, self.secret = plan, placement, secret
        self.kill_unit, self.on_failure = kill, on_failure
        self.local, self.relaunch = local, relaunch
        self.coordinator: Coordinator | None = None
        self.log = RunLog()
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._lock = threading.Condition()
        self._first: dict[int, Attempt] = {}
        self._assigned = False
        self._assignments: dict[int, Assign] = {}
        self._running: dict[tuple[int, int], Attempt] = {}
        """(worker, incarnation) -> the attempt running it."""
        self._peers: dict[tuple[int, int], _Peer] = {}
        self._latest: dict[int, Attempt] = {}
        """Worker -> the attempt that runs it now (or last did)."""
        self._relaunched: dict[int, int] = {}
        """Placement row → its tasks started by ``relaunch`` for its latest loss."""
        self._unkillable: dict[int, Attempt] = {}
        """Worker → its attempt fenced where it could not be killed (a cluster)."""
        self._elsewhere: dict[int, tuple[str, float]] = {}
        """Worker → (the executor it was fenced on, until when its rebuild waits for the
        task started again elsewhere): see ELSEWHERE_FIRST_S."""
        self._closing = False
        # Every worker task checks in at about the same time: a backlog of one (the
        # default) would drop connections whose clients then wait for ever.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, 0), family=family, backlog=len(placement) + 8)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._threads: list[threading.Thread] = []
        self._state_dir: str | None = None
        """Where twins leave large states for rebuilt workers on the same host (see
        :meth:`state_folder`), made on first use and removed with the run."""

    # -- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> Registry:
        self._spawn(self._accept_loop, "tandem-registry")
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        # Wake the accept loop with a connection of our own; it sees _closing and exits.
        # A bare one, never a handshake: nothing here may wait on the loop's answer.
        with contextlib.suppress(OSError), socket.create_connection(self.address, timeout=1.0):
            pass
        for t in self._threads:
            # A connection thread of a worker cut off from the driver waits for ever on
            # a connection that never drops: the run does not wait for it (a daemon).
            t.join(timeout=5 if t.name == "tandem-registry" else 0.1)
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
                sock, _ = self._listener.accept()
            except OSError:
                if self._closing:
                    return
                continue
            if self._closing:
                sock.close()
                return
            self._spawn(self._greet, "tandem-registry-conn", Connection(sock.detach()))

    def _greet(self, conn: Connection) -> None:
        """The authentication handshake, then :meth:`_serve`, on the connection's own
        thread: a client that stalls in the handshake (its host's link throttled or cut
        off mid-way) holds up no other. Done by the accept loop, it held every later
        worker task, and the registry's own wake-up connection at the end of the run,
        which then waited for ever."""
        try:
            deliver_challenge(conn, self.secret)
            answer_challenge(conn, self.secret)
        except (OSError, EOFError, AuthenticationError):  # a client that is not ours
            conn.close()
            return
        self._serve(conn)

    def fail(self, error: BaseException) -> None:
        """Stop the run for ``error`` (the first reason given wins)."""
        if not isinstance(error, TandemError):
            error = TandemError(f"the coordinator failed: {type(error).__name__}: {error}")
        with self._lock:
            if self.log.failure is not None:
                return
            self.log.failure = error
        self.on_failure(error)

    # -- one worker task ------------------------------------------------------------------

    def _serve(self, conn: Connection) -> None:
        attempt = None
        try:
            hello = expect(conn.recv(), Hello, what="from a worker task")
            check_version(hello.version, f"the worker task of placement row {hello.slot}")
            attempt = Attempt(
                hello.slot,
                hello.attempt,
                hello.pid,
                hello.node,
                hello.executor_pid,
                executor_id=hello.executor_id,
            )
            with self._lock:
                self.log.attempts.append(attempt)
                if attempt.slot not in self._first and 0 <= attempt.slot < len(self.placement):
                    self._first[attempt.slot] = attempt
                    if len(self._first) == len(self.placement):
                        self._assign()
                self._lock.wait_for(
                    lambda: (
                        (self._assigned and len(self._assignments) == len(self.placement))
                        or self._closing
                    )
                )
                if self._closing:
                    return
                w = attempt.worker
            if w is None:
                inc = self._claim(attempt)
                if inc is None:
                    # A retry of a worker that crashed or was killed, which does not
                    # rejoin: the twins of its replicas carry on without it.
                    conn.send(Retire(f"placement row {attempt.slot} was already started"))
                    return
                w = attempt.worker
            peer = _Peer(conn)
            with self._lock:
                self._running[(w, attempt.incarnation)] = attempt
                self._peers[(w, attempt.incarnation)] = peer
                self._latest[w] = attempt
            peer.send(Assign(w, tuple(self.placement[w]), attempt.rejoined))
            self._forward(conn, w, attempt.incarnation)
        except (EOFError, OSError):
            if attempt is not None and attempt.worker is not None:
                self._events.put(Exited(attempt.worker, attempt.incarnation))
        except TandemError as exc:
            self.fail(exc)
        finally:
            conn.close()

    def executors(self) -> set[str]:
        """The Spark executors running a worker's latest task now (their ids)."""
        with self._lock:
            return {a.executor_id for a in self._latest.values() if a.executor_id is not None}

    def _forward(self, conn: Connection, w: int, inc: int) -> None:
        """Hand every message of that incarnation to the coordinator, up to ``Done``; a
        connection that drops first is the incarnation exiting."""
        while True:
            msg = conn.recv()
            self._events.put(Received(w, inc, msg))
            if isinstance(msg, Done):
                return

    def _ask(self, fn, otherwise=None):
        """Run ``fn`` on the coordinator's thread and return its result (``otherwise``
        once the coordinator is done: nothing answers any more)."""
        call = Call(fn)
        self._events.put(call)
        while True:
            with contextlib.suppress(FutureTimeout):
                return call.future.result(timeout=0.5)
            coord = self.coordinator
            if self._closing or coord is None or coord.finished:
                return otherwise

    def _claim(self, attempt: Attempt) -> int | None:
        """A retried task: the incarnation it runs of its placement row's worker — the
        rebuild the coordinator has waiting for it — or None if it retires."""
        first = self._first.get(attempt.slot)
        if first is None or first.worker is None:
            return None
        w = first.worker
        deadline = time.monotonic() + CLAIM_WAIT_S
        while True:
            answer = self._ask(lambda: self._claim_on_coordinator(attempt, w))
            if answer == "elsewhere":
                deadline = max(deadline, self._elsewhere[w][1] + CLAIM_WAIT_S)
            elif answer != "wait":
                return answer
            if time.monotonic() > deadline or self._closing:
                log.info("worker %d runs: Spark's retry of its task retires", w)
                return None
            time.sleep(0.05)

    def _claim_on_coordinator(self, attempt: Attempt, w: int):
        coord = self.coordinator
        if coord is None or not coord.started:
            raise TandemError(
                f"the worker task of placement row {attempt.slot} failed while the job "
                "was starting and was retried; see the executor log for why"
            )
        rj = coord.pending_rebuild(w)
        if rj is None:
            return "wait" if w in coord.running and w not in coord.rejoins else None
        fenced_on = self._elsewhere.get(w)
        if (
            fenced_on is not None
            and attempt.executor_id == fenced_on[0]
            and time.monotonic() < fenced_on[1]
        ):
            return "elsewhere"  # the task started again on another executor comes first
        twins = rj.twins
        with self._lock:
            shared = sorted(
                rid
                for rid, twin in twins.items()
                if (tw := self._latest.get(coord.worker_of[twin])) is not None
                and tw.executor == attempt.executor
                and len({a.executor for a in self._first.values()}) > 1
            )
            avoid = {
                self._latest[coord.worker_of[twin]].executor_id
                for twin in twins.values()
                if coord.worker_of[twin] in self._latest
            }
        if shared:
            why = (
                f"Spark ran its retried task on executor {attempt.executor_id} "
                f"({attempt.node}, JVM {attempt.executor_pid}), which runs the twins "
                f"of {shared}; one executor's crash must not take two replicas of a "
                "partition"
            )
            tries = self._relaunched.get(attempt.slot, 0)
            if self.relaunch is not None and None not in avoid and tries < REJOIN_ATTEMPTS:
                self._relaunched[attempt.slot] = tries + 1
                log.info("worker %d: %s; it is started again on another executor", w, why)
                self.relaunch(attempt.slot, avoid)
            else:
                coord.give_up(w, why)
            return None
        rj.claimed = True
        attempt.worker, attempt.replicas = w, list(self.placement[w])
        attempt.rejoined, attempt.incarnation = True, rj.incarnation
        log.info("rebuilding worker %d (%s) from live twins", w, self.placement[w])
        return rj.incarnation

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

    # -- the coordinator's host (WorkerHost) ----------------------------------------------

    def start(self, assignments: list[Assign]) -> None:
        """The tasks check in by themselves; each gets its assignment once all have."""
        with self._lock:
            self._assignments = {a.worker: a for a in assignments}
            self._lock.notify_all()

    def replace(self, assign: Assign, incarnation: int) -> bool:
        """Spark retries the lost worker's task by itself, and the retry claims the
        rebuild. On a cluster (executors elsewhere) the placement row is also started
        again at once in a Spark job of its own on another executor (``relaunch``),
        whichever comes first claiming it: Spark retries a task only once it has noticed
        the loss — seconds after a host's crash, and not before it declares the executor
        lost when the task was cut off or frozen (it could not be killed). A worker fenced
        on purpose is rebuilt elsewhere first: Spark's retry on the executor it was fenced
        on (a host healed after a cut) may claim the rebuild only ELSEWHERE_FIRST_S later."""
        lost = self._unkillable.pop(assign.worker, None) or self._latest.get(assign.worker)
        if lost is None or self.local or self.relaunch is None:
            return False
        self._relaunched.pop(lost.slot, None)  # a new loss
        # Nor beside a twin: one executor's loss must not take two replicas of a partition.
        parts = {rid[:2] for rid in self.placement[assign.worker]}
        with self._lock:
            twins = {
                a.executor_id
                for v, a in self._latest.items()
                if v != assign.worker and any(rid[:2] in parts for rid in self.placement[v])
            }
        avoid = ({lost.executor_id} | twins) - {None}
        if lost.cause not in (None, "killed") and lost.executor_id is not None:
            # Fenced where it ran (cut off, frozen, too slow): rebuilt elsewhere if it can be.
            self._elsewhere[assign.worker] = (
                lost.executor_id,
                time.monotonic() + ELSEWHERE_FIRST_S,
            )
        else:
            self._elsewhere.pop(assign.worker, None)
        log.info(
            "worker %d is started again at once on an executor other than %s",
            assign.worker,
            sorted(avoid),
        )
        self.relaunch(lost.slot, avoid)
        return False

    def send(self, worker: int, incarnation: int, message: Message) -> bool:
        with self._lock:
            peer = self._peers.get((worker, incarnation))
        return peer is not None and peer.send(message)

    def kill(self, worker: int, incarnation: int, cause: str) -> list[int]:
        """A fault (``killed``) SIGKILLs the worker's Python process, or its executor JVM
        with every worker on it (``kill="executor"``); any other cause fences it: it is
        told to exit and, on a master on this machine, SIGKILLed. Nothing waits for it."""
        with self._lock:
            victim = self._running.get((worker, incarnation))
            peer = self._peers.get((worker, incarnation))
            if victim is None or victim.cause is not None:
                return []
            victim.cause = cause
            others: list[tuple[int, Attempt]] = []
            if cause == "killed" and self.kill_unit == "executor":
                others = [
                    (w, a)
                    for (w, inc), a in self._running.items()
                    if a is not victim
                    and a.cause is None
                    and a.executor == victim.executor
                    and self._latest.get(w) is a
                ]
                for _, a in others:
                    a.cause = "killed"
        if cause == "killed" and not self.local:
            # The executors are elsewhere: the worker kills itself (and its executor).
            if peer is not None:
                peer.send(Crash(self.kill_unit))
            log.info("fault: %s of worker %d told to crash", self.kill_unit, worker)
            return [w for w, _ in others]
        if cause == "killed":
            pids = [victim.pid, *(a.pid for _, a in others)]
            if self.kill_unit == "executor" and victim.executor_pid is not None:
                pids.insert(0, victim.executor_pid)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            log.info(
                "fault: SIGKILL %s %s (workers %s)",
                self.kill_unit,
                pids,
                [worker] + [w for w, _ in others],
            )
            return [w for w, _ in others]
        if peer is not None:
            peer.send(Exit(f"declared lost ({cause})"))
        if self.local:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim.pid, signal.SIGKILL)
        else:
            # Cut off, frozen or wedged where it cannot be signalled: its task may not
            # fail until Spark declares the executor lost, so no retry comes by itself.
            self._unkillable[worker] = victim
        return []

    def pause(self, worker: int, incarnation: int, for_s: float) -> bool:
        """SIGSTOP on a master on this machine (thawed by the coordinator); elsewhere the
        worker freezes itself and thaws by itself."""
        victim = self._running.get((worker, incarnation))
        if victim is None:
            return False
        if not self.local:
            self.send(worker, incarnation, Freeze(for_s))
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim.pid, signal.SIGSTOP)
        return True

    def thaw(self, worker: int, incarnation: int) -> None:
        victim = self._running.get((worker, incarnation))
        if victim is not None and victim.cause is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim.pid, signal.SIGCONT)

    def poll(self, timeout: float) -> list[Event]:
        events: list[Event] = []
        try:
            events.append(self._events.get(timeout=max(timeout, 0.0)))
            while True:
                events.append(self._events.get_nowait())
        except queue.Empty:
            pass
        return events

    def node(self, worker: int, incarnation: int) -> str:
        return self._running[(worker, incarnation)].node

    def pid(self, worker: int, incarnation: int) -> int | None:
        attempt = self._running.get((worker, incarnation))
        return None if attempt is None or not self.local else attempt.pid

    def dead(self, worker: int, incarnation: int) -> bool:
        """On a master on this machine: the task's Python process is gone (a zombie
        counts as gone), looked at for up to half a second (a SIGKILL just sent)."""
        attempt = self._running.get((worker, incarnation))
        if attempt is None or not self.local:
            return False
        deadline = time.monotonic() + 0.5
        while True:
            try:
                if psutil.Process(attempt.pid).status() == psutil.STATUS_ZOMBIE:
                    return True
            except psutil.NoSuchProcess:
                return True
            except psutil.Error:
                return False
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)

    def state_folder(self, twin_worker: int, worker: int, incarnation: int) -> str | None:
        """A folder this driver made, when the master runs on this machine and the twin's
        worker and the rebuilt one run on one node — the file then never travels through
        the registry, as on the local engine. Else None: the state comes inline."""
        with self._lock:
            rebuilt = self._running.get((worker, incarnation))
            twin = self._latest.get(twin_worker)
        if not self.local or rebuilt is None or twin is None or twin.node != rebuilt.node:
            return None
        if self._state_dir is None:
            self._state_dir = state_folder()
        return self._state_dir

    def idle(self) -> None:
        pass

    def close(self) -> None:
        """The Spark job ends its tasks; the registry closes with its context."""


def register(address, secret: bytes, slot: int, attempt: int, node: str) -> Connection:
    """The worker task's side of step 1: connect and say hello; the caller reads the
    answer."""
    conn = Client(address, authkey=secret)
    jvm = executor_pid()
    conn.send(Hello(slot, attempt, os.getpid(), node, jvm, executor_id(jvm)))
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
        args = psutil.Process(jvm).cmdline()
    except psutil.Error:
        return None
    for flag, value in itertools.pairwise(args):
        if flag == "--executor-id":
            return value
    return None


def executor_pid() -> int | None:
    """The PID of the executor JVM hosting this Python worker: the nearest ancestor process
    named ``java`` (the worker's parent is usually PySpark's daemon), or None."""
    try:
        for parent in psutil.Process().parents()[:4]:
            if parent.pid <= 1:
                return None
            if parent.name() == "java":
                return parent.pid
    except psutil.Error:
        return None
    return None
