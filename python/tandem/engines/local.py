"""The embedded default engine: a handful of worker processes on this machine.

The coordinator (this module, in the caller's process) starts one process per worker of
the plan's placement (:meth:`tandem.plan.Plan.placement`: one or more workers per replica
group, plus one for the sinks), each hosting many task replicas
(:class:`tandem.runtime.Worker`). A worker process is a fresh interpreter running
:mod:`tandem.engines.worker` (not a ``multiprocessing`` child, which would import the
caller's main script again: a plain script without a ``__main__`` guard works), linked to
the coordinator by a socket pair; the plan reaches it by cloudpickle, so lambdas and
closures travel by value. The coordinator collects the port every replica listens on, fixes
the logical time origin ``t0`` and tells every worker to start. It then watches them: it
injects the requested faults at the level of the fault domain — ``td.Kill`` SIGKILLs the
worker that hosts the named replica, and with it every replica it hosts; ``td.Pause``
SIGSTOPs that worker and SIGCONTs it later — notices workers that die, stops everything on
an error, a timeout or Ctrl-C — no process outlives a run, and every child also dies with
its parent — and finally hands the replicas' reports to
:func:`tandem.engines.common.assemble_result`, which every engine shares.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import cloudpickle
import psutil

from tandem.engines.common import STARTUP_S, Stop, assemble_result, check_options
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
from tandem.engines.process import child_env
from tandem.exceptions import ConfigError, TandemError
from tandem.faults import Chaos, Kill, KillHeartbeats, KillWorker, Pause, ReplicaFault
from tandem.heartbeat import Generators
from tandem.ordering import kazoo
from tandem.ordering.kazoo import KazooRun
from tandem.plan import Plan
from tandem.result import Result
from tandem.runtime import ReplicaId, ReplicaReport, Resume

log = logging.getLogger("tandem")

ON_READY = None
"""Test hook: called with every inbox address once all replicas listen, before they start."""


STOP_LEAD_S = 1.0
"""A run with no duration: how far ahead of the wall clock, in source time, the sources
may emit; the coordinator moves that point on every half of it, and a stop takes effect
there (so a stop drains at most this much source time more)."""

CHECKPOINT_LEAD_S = 0.05
"""How far ahead of the sources' clock a checkpoint's epoch is picked (at least three
heartbeat periods): the request must reach every worker before its replicas forward it."""

CHECKPOINT_TIMEOUT_S = 10.0
"""A checkpoint not complete this long after it started is abandoned."""


@dataclass
class _Rejoin:
    """A lost worker being rebuilt (``Job(restore=True)``): its new process, the live twin
    each of its replicas is rebuilt from, and how far it got."""

    worker: int
    proc: _Process
    twins: dict[ReplicaId, ReplicaId]
    lost_s: float
    deadline: float
    generation: int
    state: str = "starting"  # starting -> cutting -> binding -> linking
    started: bool = False
    """The new process said its replicas have started (dialled their downstream
    replicas): until then it is no twin to count on, and no kill of its twins comes."""
    cuts: dict[ReplicaId, Resume] = field(default_factory=dict)
    feeding: Feeding = field(default_factory=Feeding)
    warm: bool = False
    """The new process is the spare, started before the loss."""
    checkpoint: int | None = None
    """Rolled back (``Job(checkpoint_ms=...)``): the checkpoint's epoch (0: none was
    complete, the replicas restart from the beginning of the stream); None: from twins."""
    sinks: bool = False
    """Restarted sinks: each from the position its last committed output stored (no
    cut: nothing was committed, from the beginning of the stream)."""


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


@dataclass(frozen=True)
class _Resume:
    """The second half of a ``td.Pause``: SIGCONT the frozen worker at ``at``."""

    worker: int
    at: float
    pid: int


DEFER_STEP_S = 0.05
"""How often a kill waiting for a rebuild (:class:`_Deferred`) looks again."""


@dataclass(frozen=True)
class _Deferred:
    """A kill that came while the twins of its victims were still being rebuilt
    (``Job(restore=True)``): looked at again at ``at``, injected once they are back."""

    fault: ReplicaFault | KillWorker
    at: float
    due: float
    """When the fault was scheduled."""


SPARE_NICE = 19
"""The niceness of the thread a spare process loads its modules on (``0``: none)."""

_SPARE_BOOT = """
import os, resource, sys, threading

def may_raise(base):
    # Whether this process may give a thread back its normal priority after the lowest
    # (CAP_SYS_NICE, or an RLIMIT_NICE that allows it): tandem.runtime.may_raise_priority,
    # which cannot be imported before the modules load.
    soft = resource.getrlimit(resource.RLIMIT_NICE)[0]
    return os.geteuid() == 0 or soft == resource.RLIM_INFINITY or 20 - soft <= base

def lowest(tid):
    os.setpriority(os.PRIO_PROCESS, tid, int(sys.argv[4]))
    if hasattr(os, "SCHED_IDLE"):  # runs only when a core has nothing else to run
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))

def threads():
    try:
        return set(map(int, os.listdir("/proc/self/task")))
    except OSError:
        return {threading.get_native_id()}

base = os.getpriority(os.PRIO_PROCESS, 0)
if may_raise(base):
    # Everything at the lowest priority, then every thread (the modules' own: numpy's
    # BLAS threads, pyarrow's jemalloc purger) back to the normal one.
    try:
        lowest(threading.get_native_id())
    except (AttributeError, OSError):
        pass
    from tandem.engines import worker
    worker.warm_up()
    for tid in threads():
        try:
            if hasattr(os, "SCHED_OTHER"):
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, base)
        except OSError:
            pass
else:
    # numpy and pyarrow start threads, which get their creator's priority and could not
    # be given the normal one back: they load first, at normal priority, and the rest on
    # a thread of the lowest (Linux keeps a priority per thread).
    import numpy, pyarrow

    def load():
        try:
            lowest(threading.get_native_id())
        except (AttributeError, OSError):
            pass
        from tandem.engines import worker
        worker.warm_up()

    loader = threading.Thread(target=load, name="tandem-spare-load")
    loader.start()
    loader.join()
from tandem.engines.worker import main
sys.exit(main(sys.argv[1:4]))
"""
"""How a spare starts (``python -c``): a spare is started right after a rebuild, beside
the survivors and the rebuilt worker catching up, and its start is about half a
CPU-second of imports. It loads them at the lowest priority — niceness ``SPARE_NICE`` and
``SCHED_IDLE``, so that the survivors get a core the moment they need one — where ``python
-m tandem.engines.worker`` would import ``tandem`` at normal priority before any of our
code runs. Then every thread it has (numpy's BLAS threads and pyarrow's jemalloc purger
among them, which inherit the priority of the thread that loads those modules) goes back
to the normal priority: where the process may raise a thread's priority (root, or an
``RLIMIT_NICE`` that allows it). Elsewhere numpy and pyarrow load first, at normal
priority, and the rest on a thread of the lowest. The spare waits for a loss anyway;
every thread it has once loaded runs at normal priority (``tests/test_restore.py``
checks), and so does the work a rebuild does once the payload comes."""


class _Process:
    """A worker process (``python -m tandem.engines.worker``) and its end of the link;
    a spare (``payload`` None) starts as :data:`_SPARE_BOOT` says. ``relay``: its stderr
    comes through a pipe and is written line by line above the progress bar
    (:func:`_relay`) instead of across it."""

    def __init__(
        self, payload: tuple | None, env: dict[str, str], worker: int | str, relay: bool
    ) -> None:
        mine, theirs = socket.socketpair()
        args = [str(theirs.fileno()), str(os.getpid()), str(worker)]
        if payload is None and SPARE_NICE:
            command = [sys.executable, "-c", _SPARE_BOOT, *args, str(SPARE_NICE)]
        else:
            command = [sys.executable, "-m", "tandem.engines.worker", *args]
        try:
            self.popen = subprocess.Popen(
                command,
                pass_fds=(theirs.fileno(),),
                env=env,
                stderr=subprocess.PIPE if relay else None,
            )
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        self.conn = Connection(mine.detach())
        self.pid = self.popen.pid
        self.payload = payload
        self.relay: threading.Thread | None = None
        if relay:
            self.relay = threading.Thread(
                target=_relay, args=(self.popen.stderr,), name=f"tandem-relay-{worker}", daemon=True
            )
            self.relay.start()

    def send_payload(self) -> None:
        """Send the job (a worker that already died shows as EOF on the link)."""
        with contextlib.suppress(OSError):
            self.conn.send(self.payload)
        self.payload = None

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        """The exit code (negative: killed by that signal), None while it runs."""
        return self.popen.poll()

    def kill(self) -> None:
        if self.is_alive():
            self.popen.kill()

    def join(self, timeout: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)
        if self.relay is not None and self.popen.poll() is not None:
            self.relay.join(timeout)  # its last lines, up to the exit


def _relay(pipe) -> None:
    """Copy a worker's stderr to ours line by line through ``tqdm.write``, which clears the
    progress bar, writes the line and draws the bar again, until the worker exits."""
    from tqdm import tqdm

    with pipe:
        for raw in iter(pipe.readline, b""):
            tqdm.write(raw.decode(errors="replace").rstrip("\n"), file=sys.stderr)


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU-seconds of process ``pid`` so far (all its threads, not its
    children; a zombie's too); None if there is no such process. Resolution: one clock
    tick (10 ms on Linux)."""
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return times.user + times.system


def _children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _self_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class _CostMeter:
    """What a run costs this machine, for ``tandem bench cost`` (see the cost fields of
    :class:`~tandem.result.Result`).

    The replica processes are children of the coordinator, and it reaps every one of them
    before the run returns (:meth:`_Run.stop`), so the CPU they used — start-up, run,
    shutdown — is exactly the growth of ``getrusage(RUSAGE_CHILDREN)`` across the run.
    The steady state is bracketed by two readings of the CPU used so far (reaped children
    from rusage, live ones by :func:`process_cpu_s`): when the warm-up ends and when the
    stream does (t0 + duration), which leaves process start-up and shutdown out. Only the
    coordinator thread reaps children, so nothing is counted twice or missed within a
    reading.
    """

    def __init__(self, warmup: float) -> None:
        self.warmup = warmup
        self.called_ns = time.time_ns()
        self._children0 = _children_cpu_s()
        self._self0 = _self_cpu_s()
        self.steady: list[tuple[int, float]] = []  # (time_ns, CPU so far): from, to
        self.end_ns = 0
        self.cpu_s = self.coordinator_cpu_s = 0.0

    def due(self, now_s: float, duration: float) -> float | None:
        """Seconds until the next steady-state reading (<= 0: take it now); None: done."""
        if len(self.steady) >= 2:
            return None
        return (self.warmup if not self.steady else duration) - now_s

    def read(self, pids: list[int]) -> None:
        """Take a steady-state reading (``pids``: every process the run started)."""
        live = [process_cpu_s(pid) for pid in pids]  # None: already reaped
        reaped = _children_cpu_s() - self._children0
        self.steady.append((time.time_ns(), reaped + sum(c for c in live if c is not None)))

    def finish(self) -> None:
        """Read the totals; call once every replica process has been reaped."""
        self.end_ns = time.time_ns()
        self.cpu_s = _children_cpu_s() - self._children0
        self.coordinator_cpu_s = _self_cpu_s() - self._self0

    def apply(self, res: Result, processes: int, sink_reports: list[ReplicaReport]) -> None:
        """Fill in the cost fields of ``res``."""
        res.processes = processes
        res.cpu_s = self.cpu_s
        res.coordinator_cpu_s = self.coordinator_cpu_s
        res.wall_s = (self.end_ns - self.called_ns) / 1e9
        if len(self.steady) == 2:
            (from_ns, cpu_from), (to_ns, cpu_to) = self.steady
            res.steady_cpu_s = max(0.0, cpu_to - cpu_from)
            res.steady_wall_s = (to_ns - from_ns) / 1e9
        firsts = [r.first_receive_ns for r in sink_reports if r.first_receive_ns is not None]
        if firsts:
            res.first_output_s = (min(firsts) - self.called_ns) / 1e9


class LocalEngine:
    """Runs a plan on worker processes on 127.0.0.1 (see the module documentation)."""

    name = "local"
    until_stopped = True
    """``run(duration=None)`` runs until ``stop`` says so (or its bounded sources end)."""

    def check(
        self,
        plan: Plan,
        duration: float | None,
        faults: list[Any] = (),
        *,
        progress: bool | None = None,
        warmup: float = 0.0,
        check: bool = True,
        timeout: float | None = None,
        host: str = "127.0.0.1",
        stop: Stop | None = None,
        metrics_port: int | None = None,
    ) -> None:
        """Raise ConfigError for arguments :meth:`run` cannot honour (TypeError for one it
        does not take), before anything starts."""
        check_options(
            self.name,
            duration,
            warmup,
            faults,
            kinds=(Kill, KillWorker, Pause, Chaos, KillHeartbeats),
        )
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0
        ):
            raise ConfigError(f"timeout must be None or a number of seconds > 0, got {timeout!r}")

    def run(
        self,
        plan: Plan,
        duration: float | None,
        faults: list[Any] = (),
        *,
        progress: bool | None = None,
        warmup: float = 0.0,
        check: bool = True,
        timeout: float | None = None,
        host: str = "127.0.0.1",
        stop: Stop | None = None,
        metrics_port: int | None = None,
    ) -> Result:
        """Run ``plan`` for ``duration`` seconds of source time.

        ``duration=None``: until ``stop`` (a :class:`tandem.engines.common.Stop`) is
        requested (with a ``duration`` and a ``stop``: until either), or, when every
        source is bounded, until their last row
        (:meth:`Plan.natural_end_ns`). The coordinator then picks the stop point — the
        source time the sources were allowed to reach (:data:`STOP_LEAD_S` ahead of the
        clock), later than anything emitted — and tells every worker; every replica of
        every source ends there, what is in flight drains to the sinks, and the result
        is that of a run of exactly that duration. ``stop.kill()`` kills the workers at
        once instead (TandemError).

        ``warmup`` seconds of output are left out of the latency figures; ``check``
        compares the output with the reference executor (lost / duplicates); ``timeout``
        bounds the whole run (default: duration + 60 s; with no duration, how long it may
        take after the stop point); ``progress`` draws a progress bar on stderr (default:
        when stderr is a terminal); ``metrics_port`` serves Prometheus metrics of every
        worker on 127.0.0.1 at that port while the run lasts (:mod:`tandem.metrics`; 0: a
        free port, logged).
        """
        if progress is None:
            progress = sys.stderr.isatty()
        cost = _CostMeter(warmup)
        self.check(plan, duration, faults, warmup=warmup)
        metrics = None
        if metrics_port is not None:
            from tandem import metrics as _metrics

            metrics = _metrics.serve(plan, metrics_port)  # a taken port fails before anything
        try:
            return self._run(
                plan, duration, faults, progress, warmup, check, timeout, host, stop, cost, metrics
            )
        finally:
            if metrics is not None:
                metrics.close()

    def _run(
        self, plan, duration, faults, progress, warmup, check, timeout, host, stop, cost, metrics
    ):
        zoo = kazoo.prepare(plan) if plan.ordered_partitions() else None
        # Kafka sources: the heartbeat generators run from before the workers start until
        # every worker has stopped (their markers before t0 are ignored).
        generators = Generators(plan, env=child_env())
        # With a stop to honour, even a run with a duration goes by stop points (ending
        # at its duration unless stopped before).
        cap_ns = None if duration is None or stop is None else round(duration * 1e9)
        run = _Run(
            plan,
            duration if stop is None else None,
            list(faults),
            progress,
            host,
            zoo,
            warmup,
            generators,
            stop,
            cap_ns,
        )
        run.metrics = metrics
        try:
            generators.start()
            try:
                with _above_the_bar(progress):
                    run.start()
                    if timeout is None:
                        timeout = 60.0 if run.duration is None else duration + 60.0
                    run.watch(timeout, cost)
            finally:
                run.stop()
                generators.stop()
            cost.finish()
            result = run.result(check)
            sinks = [r for (t, _, _), r in run.reports.items() if plan.tasks[t].kind == "sink"]
            cost.apply(result, len(run._all_procs()), sinks)
            return result
        finally:
            generators.stop()
            if zoo is not None:
                kazoo.cleanup(zoo)


def _above_the_bar(progress: bool):
    """While the progress bar is drawn, this process's console log handlers (on the root
    logger and on ``tandem``) write through tqdm, above the bar instead of across it."""
    if not progress:
        return contextlib.nullcontext()
    from tqdm.contrib.logging import logging_redirect_tqdm

    return logging_redirect_tqdm(loggers=[logging.root, logging.getLogger("tandem")])


class _Run:
    """The state of one run of the local engine. Processes are indexed by worker."""

    def __init__(
        self,
        plan: Plan,
        duration: float,
        faults: list[ReplicaFault],
        progress,
        host,
        zoo,
        warmup: float = 0.0,
        generators: Generators | None = None,
        stop: Stop | None = None,
        cap_ns: int | None = None,
    ) -> None:
        self.plan, self.duration, self.progress, self.host = plan, duration, progress, host
        # A run with no duration: the source time the sources may reach (ns after t0), and
        # whether the run stops there; the end of the bounded sources, if all are.
        self.until_ns, self.final = 0, duration is not None
        self.natural_ns = plan.natural_end_ns() if duration is None else None
        if cap_ns is not None:
            self.natural_ns = min(cap_ns, self.natural_ns or cap_ns)
        self.stop_token = stop or Stop()
        self.generators = generators
        self._bar = None  # the tqdm progress bar, while drawn
        self.warmup = warmup
        self.zoo: KazooRun | None = zoo
        self.faults = sorted(faults, key=lambda f: f.at)
        self.secret = os.urandom(32)
        self.placement = plan.placement()
        self.worker_of: dict[ReplicaId, int] = {
            rid: w for w, rids in enumerate(self.placement) for rid in rids
        }
        self.procs: dict[int, _Process] = {}
        self.conns: dict[int, Connection] = {}
        self.retired: list[_Process] = []  # processes of workers since rebuilt
        self.running: set[int] = set()
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
        self._generation = 0
        self._attempts: dict[int, int] = {}  # worker -> rebuild attempts for its last loss
        # A process started ahead, interpreter and imports paid, that becomes the next
        # rebuilt worker: a rebuild does not wait for a process start (about half a second
        # of CPU on a small machine), and that start does not land beside the rebuild.
        self.spare: _Process | None = None
        self._state_dir: str | None = None  # where twins leave large states for newcomers
        self.chaos: Chaos | None = None
        self._chaos_rng = random.Random(0)
        self._chaos_at = 0.0
        self.addresses: dict[ReplicaId, tuple[str, int]] = {}
        self.heard: dict[int, float] = {}  # worker -> when it last spoke (monotonic)
        self._blob = b""
        self._env: dict[str, str] = {}
        self.t0_ns = 0
        self.rss_mb: dict[str, float] = {}
        self._rss_at = 0.0
        self.metrics = None
        """A :class:`tandem.metrics.Metrics` the workers' snapshots go to, if served."""

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        # The plan goes by cloudpickle: functions, lambdas and closures of the main script
        # by value (Job.plan checked that every task can be sent).
        self._blob = blob = cloudpickle.dumps(self.plan)
        self._env = env = child_env()
        for w, rids in enumerate(self.placement):
            proc = _Process(
                (list(sys.path), blob, rids, self.secret, self.zoo, False),
                env,
                w,
                relay=self.progress,
            )
            self.procs[w], self.conns[w] = proc, proc.conn
        for proc in self.procs.values():
            proc.send_payload()
        addresses: dict[ReplicaId, tuple[str, int]] = {}
        pending = set(self.procs)
        deadline = time.monotonic() + 60.0
        while pending:
            ready = wait([self.conns[w] for w in pending], timeout=deadline - time.monotonic())
            if not ready:
                names = sorted(self._worker_name(w) for w in pending)
                raise TandemError(f"workers did not start within 60 s: {names}")
            for conn in ready:
                w = next(w for w in pending if self.conns[w] is conn)
                try:
                    kind, value = conn.recv()
                except EOFError:
                    proc = self.procs[w]
                    proc.join(timeout=5)
                    raise TandemError(
                        f"{self._worker_name(w)} exited while starting (exit code "
                        f"{proc.exitcode}); its error, if any, is on stderr above"
                    ) from None
                if kind == "error":
                    raise ConfigError(value)
                addresses |= listening(value, self.host)
                pending.discard(w)
        if ON_READY is not None:
            ON_READY(addresses)
        self.addresses = addresses
        self.t0_ns = time.time_ns() + int(STARTUP_S * 1e9)
        for conn in self.conns.values():
            conn.send(("go", addresses, self.t0_ns, self.duration, self.warmup))
            if self.metrics is not None:
                conn.send(("metrics", self.metrics.every_s))
        self.running = set(self.procs)
        self.heard = dict.fromkeys(self.procs, time.monotonic())
        if self.restoring:
            self._start_spare()
        if self.duration is None:
            self._extend(-STARTUP_S)

    # -- runs with no duration ------------------------------------------------------------

    def end_s(self) -> float:
        """Where the stream ends, in seconds of source time (inf: not known yet)."""
        if self.duration is not None:
            return self.duration
        return self.until_ns / 1e9 if self.final else math.inf

    def _extend(self, now_s: float) -> None:
        """A run with no duration: move the point the sources may reach on, to
        ``STOP_LEAD_S`` ahead of ``now_s`` (a whole number of heartbeats), or make the
        current one final when a stop was requested or the bounded sources end there."""
        if self.final:
            return
        hb = self.plan.heartbeat_ns
        if self.stop_token.requested and self.until_ns > 0:
            self.final = True
            log.info(
                "stopping job %r: its sources end at %.2f s of source time, then what is in "
                "flight drains to the sinks",
                self.plan.job,
                self.until_ns / 1e9,
            )
        else:
            if self.until_ns / 1e9 - now_s > STOP_LEAD_S / 2 and self.until_ns > 0:
                return
            target = round((max(now_s, 0.0) + STOP_LEAD_S) * 1e9)
            self.until_ns = max(self.until_ns, -(-target // hb) * hb)
            if self.natural_ns is not None and self.until_ns >= self.natural_ns:
                self.until_ns, self.final = self.natural_ns, True
            self.final |= self.stop_token.requested
        self._send_until(self.conns[w] for w in self.running)

    def _send_until(self, conns) -> None:
        for conn in conns:
            with contextlib.suppress(OSError):  # a worker that died: the watch loop sees it
                conn.send(("until", self.until_ns, self.final))

    def watch(self, timeout: float, cost: _CostMeter | None = None) -> None:
        """Inject the faults, sample memory, take ``cost``'s readings, rebuild lost workers
        (``Job(restore=True)``), collect the reports until every worker has finished or
        died."""
        deadline = time.monotonic() + STARTUP_S + timeout
        if self.duration is None:  # from the stop point on
            deadline = math.inf
        faults = list(self.faults)
        running = self.running
        while running:
            if self.metrics is not None:
                self.metrics.engine(self.lost, self.restored, self.down)
            now_s = (time.time_ns() - self.t0_ns) / 1e9
            if self.stop_token.killed:
                raise TandemError(
                    f"job {self.plan.job!r} was killed: its workers were stopped at once, "
                    "without a drain, so the sinks may hold part of its output"
                )
            if not self.final:
                self._extend(now_s)
                if self.final:
                    deadline = time.monotonic() + max(0.0, self.end_s() - now_s) + timeout
            reading = cost.due(now_s, self.end_s()) if cost is not None else None
            if reading is not None and reading <= 0:
                cost.read([p.pid for p in self._all_procs()])
                reading = cost.due(now_s, self.end_s())
            while faults and faults[0].at <= now_s:
                self._inject(faults.pop(0), now_s, faults)
                running -= self.killed_workers
            if self.chaos is not None:
                self._chaos_step(now_s)
                running -= self.killed_workers
            for w, rj in list(self.rejoins.items()):
                if time.monotonic() > rj.deadline:
                    self._abort_rejoin(
                        w, f"not done within {REJOIN_TIMEOUT_S:.0f} s ({self._stuck(rj)})"
                    )
            if self.checkpointing:
                self._checkpoint_step(now_s)
            self._draw(now_s)
            self._sample_rss(running)
            # A worker that exits closes its end of the link: EOF on the connection.
            waitables = {self.conns[w]: (w, False) for w in running}
            waitables |= {
                rj.proc.conn: (w, True)
                for w, rj in self.rejoins.items()
                if rj.state in ("starting", "binding")
            }
            next_fault = (faults[0].at - now_s) if faults else 0.2
            if reading is not None:
                next_fault = min(next_fault, reading)
            if not self.final:  # a stop is seen within 0.1 s
                next_fault = min(next_fault, 0.1)
            if self.checkpointing and self._taking is None:
                next_fault = min(next_fault, self._checkpoint_at - now_s)
            for obj in wait(list(waitables), timeout=max(0.0, min(0.2, next_fault))):
                w, rejoining = waitables[obj]
                if rejoining:
                    self._rejoin_message(w, now_s)
                    continue
                if w not in running:
                    continue
                try:
                    msg = obj.recv()
                except EOFError:
                    proc = self.procs[w]
                    proc.join(timeout=5)
                    if proc.is_alive():  # closed the link but lingers: finish it off
                        proc.kill()
                        proc.join(timeout=5)
                    running.discard(w)
                    self._crashed(w, now_s)
                    continue
                self.heard[w] = time.monotonic()
                if msg[0] == "cut":
                    self._on_cut(*msg[1:], now_s=now_s)
                elif msg[0] == "linked":
                    self._on_linked(*msg[1:], now_s=now_s)
                elif msg[0] == "started":
                    self._on_started(w, now_s)
                elif msg[0] == "evicted":
                    self._on_evicted(*msg[1:], now_s=now_s)
                elif msg[0] == "metrics":
                    if self.metrics is not None:
                        self.metrics.update(msg[1])
                elif msg[0] == "checkpointed":
                    self._on_checkpointed(*msg[1:], now_s=now_s)
                elif msg[0] == "done":
                    reports = msg[1]
                    self.reports.update(reports)
                    running.discard(w)
                    self._unanswered(w, now_s)
                    for report in reports.values():
                        if report.error:
                            raise report.failure()
            if self.restoring:
                self._silent(now_s)
                if (
                    self.spare is None
                    and not self.rejoins
                    and now_s < self.end_s() - REJOIN_MARGIN_S
                ):
                    self._start_spare()  # after a rebuild, not beside it
            if running and time.monotonic() > deadline:
                stuck = sorted(self._worker_name(w) for w in running)
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
                )
        for w in list(self.rejoins):
            self._abort_rejoin(w, "the job ended first")
        if self.metrics is not None:
            self.metrics.engine(self.lost, self.restored, self.down)
        self._draw(self.end_s(), done=True)

    def _silent(self, now_s: float) -> None:
        """Declare lost every running worker that has not spoken for the job's
        ``failure_timeout_ms`` (a frozen or wedged process: its keepalives stopped), and
        fence it — SIGKILL, so it never comes back to send stale output — to rebuild it."""
        if self.checkpointing and self.rejoins:
            # Rolling a worker back: its neighbours wait for it (on a loaded machine a
            # keepalive may then come late), and a second loss meanwhile fails the job.
            return
        limit = self.plan.failure_timeout_ms / 1000
        now = time.monotonic()
        for w in sorted(self.running):
            if now - self.heard.get(w, now) <= limit or self._hosts_sinks(w):
                continue  # a sink has no twin to take over: killing it would lose the job
            log.warning(
                "%s has been silent for %.0f ms (failure_timeout_ms=%g): declared lost",
                self._worker_name(w),
                (now - self.heard[w]) * 1000,
                self.plan.failure_timeout_ms,
            )
            self._kill_worker(w, now_s, "silent")
            self.running.discard(w)

    def _on_evicted(self, up: ReplicaId, down: ReplicaId, now_s: float) -> None:
        """``up`` dropped ``down`` as a straggler: its input is incomplete from then on, so
        its worker is declared lost — fenced (SIGKILL) and rebuilt from the twins."""
        w = self.worker_of[down]
        if w not in self.running or down in self.down or self._hosts_sinks(w):
            return
        log.warning(
            "%s dropped %s as a straggler: %s declared lost",
            self._name(up),
            self._name(down),
            self._worker_name(w),
        )
        self._kill_worker(w, now_s, "evicted")
        self.running.discard(w)

    def _hosts_sinks(self, w: int) -> bool:
        return any(self.plan.tasks[t].kind == "sink" for t, _, _ in self.placement[w])

    def _all_procs(self) -> list[_Process]:
        """Every process the run started: live, retired and being rebuilt."""
        rebuilding = [rj.proc for rj in self.rejoins.values() if rj.state != "linking"]
        spare = [self.spare] if self.spare is not None else []
        return [*self.procs.values(), *self.retired, *rebuilding, *spare]

    def _start_spare(self) -> None:
        """Start the process the next rebuilt worker will be (see ``spare``)."""
        self.spare = _Process(None, self._env, "spare", relay=self.progress)

    def _take_spare(self, payload: tuple) -> tuple[_Process, bool]:
        """The spare process, given ``payload``, if it is alive (True); otherwise a new
        process (False)."""
        proc, self.spare = self.spare, None
        warm = proc is not None and proc.is_alive()
        if not warm:
            if proc is not None:
                self.retired.append(proc)
            proc = _Process(payload, self._env, payload[-1], relay=self.progress)
        proc.payload = payload
        proc.send_payload()
        return proc, warm

    def _state_files(self) -> str:
        """The folder twins write large states to for their rebuilt replicas (memory-backed
        where Linux offers it), made on first use and removed with the run."""
        if self._state_dir is None:
            self._state_dir = state_folder()
        return self._state_dir

    # -- rebuilding lost workers (Job(restore=True)) --------------------------------------

    def _lost_worker(self, w: int, now_s: float) -> None:
        """Start rebuilding worker ``w``'s replicas from their twins, if the job asks for it
        and it can be done: a new process for the worker, which waits for their cuts."""
        if self.checkpointing and w in self.rejoins:
            self._abort_rejoin(w, "its new process was lost too")
        if not self.restoring or w in self.rejoins:
            return
        if self._hosts_sinks(w):
            self._restart_sinks(w, now_s)
            return
        if self.checkpointing:
            self._roll_back(w, now_s)
            return
        self._attempts[w] = self._attempts.get(w, 0) + 1
        rids = self.placement[w]
        if now_s > self.end_s() - REJOIN_MARGIN_S:
            log.info(
                "%s is not rebuilt: the stream ends in under %g s",
                self._worker_name(w),
                REJOIN_MARGIN_S,
            )
            return
        twins = live_twins(self.plan, rids, self.down)
        if twins is None:
            return  # the job fails for it (_crashed)
        self._generation += 1
        proc, warm = self._take_spare(
            (list(sys.path), self._blob, rids, self.secret, self.zoo, True, w)
        )
        self.rejoins[w] = _Rejoin(
            w, proc, twins, now_s, time.monotonic() + REJOIN_TIMEOUT_S, self._generation, warm=warm
        )
        log.info(
            "rebuilding %s (%s) from live twins",
            self._worker_name(w),
            ", ".join(self._name(r) for r in rids),
        )

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
            with contextlib.suppress(OSError):
                self.conns[w].send(("checkpoint", epoch, folder))
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
            self._abandon(f"{self._name(rid)} had forwarded heartbeat {epoch} already")
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
        self._abandon(f"{self._worker_name(w)} was lost")
        ck = self.checkpoint
        cuts = {} if ck is None else {r: ck.cuts[r] for r in self.placement[w] if r in ck.cuts}
        epoch = 0 if ck is None else ck.epoch
        missing = [self._name(r) for r in self.placement[w] if ck is not None and r not in cuts]
        if missing:
            raise TandemError(
                f"{self._worker_name(w)} was lost, but checkpoint {epoch} holds no cut of "
                f"{', '.join(missing)}; the job cannot continue"
            )
        self._generation += 1
        rids = self.placement[w]
        proc, warm = self._take_spare(
            (list(sys.path), self._blob, rids, self.secret, self.zoo, True, w)
        )
        rj = _Rejoin(
            w,
            proc,
            {},
            now_s,
            time.monotonic() + REJOIN_TIMEOUT_S,
            self._generation,
            warm=warm,
            checkpoint=epoch,
        )
        rj.cuts = cuts
        self.rejoins[w] = rj
        self.checkpoint_stats["rollbacks"] += 1
        log.info(
            "rolling %s (%s) back to %s",
            self._worker_name(w),
            ", ".join(self._name(r) for r in rids),
            f"checkpoint {epoch}" if ck is not None else "the beginning of the stream",
        )

    def _restart_sinks(self, w: int, now_s: float) -> None:
        """Restart worker ``w``'s sinks, each from the input position stored with its
        last committed output (:meth:`tandem.sinks.Sink.recover`, which fences the lost
        sink's writer first): the exchange of a rollback, with those positions as the
        cuts; the live upstream replicas replay the rest from their replay windows."""
        rids = self.placement[w]
        fixed = [self._name(r) for r in rids if not self.plan.restarts_sink(r[0])]
        if fixed:
            raise TandemError(
                f"{self._worker_name(w)}, which hosts the sinks, was lost: "
                f"{', '.join(fixed)} cannot be restarted (only a sink that stores its input "
                "position with its output, td.sinks.Kafka, can), so the job cannot continue"
            )
        # The spare loads the job while the lost sinks are fenced and their positions read
        # (each sink partition's at once).
        proc, warm = self._take_spare(
            (list(sys.path), self._blob, rids, self.secret, self.zoo, True, w)
        )
        try:
            with ThreadPoolExecutor(len(rids)) as pool:
                found = list(
                    pool.map(lambda r: self.plan.tasks[r[0]].sink.recover(r[1], self.t0_ns), rids)
                )
        except BaseException:
            proc.kill()
            self.retired.append(proc)
            raise
        cuts = {
            rid: Resume(cut, state)
            for rid, (cut, state) in zip(rids, found, strict=True)
            if cut is not None
        }
        self._generation += 1
        rj = _Rejoin(
            w, proc, {}, now_s, time.monotonic() + REJOIN_TIMEOUT_S, self._generation, warm=warm
        )
        rj.cuts, rj.sinks = cuts, True
        self.rejoins[w] = rj
        log.info(
            "restarting %s (%s) from %s",
            self._worker_name(w),
            ", ".join(self._name(r) for r in rids),
            ", ".join(f"heartbeat {cuts[r].epoch}" if r in cuts else "the beginning" for r in rids),
        )

    def _rejoin_message(self, w: int, now_s: float) -> None:
        """A message from a rebuilt worker's process before it runs: ``waiting`` (ask the
        twins for cuts), ``ready`` (link its upstream replicas to it and let it go) or an
        error."""
        rj = self.rejoins[w]
        try:
            kind, value = rj.proc.conn.recv()
        except EOFError:
            self._abort_rejoin(w, f"its new process exited (exit code {rj.proc.exitcode})")
            return
        if kind == "waiting" and (rj.checkpoint is not None or rj.sinks):
            # Rolled back, or sinks restarted: the cuts are at hand.
            rj.state = "binding"
            with contextlib.suppress(OSError):
                rj.proc.conn.send(("resume", rj.cuts, self.t0_ns))
            return
        if kind == "waiting":
            rj.state = "cutting"
            for rid, twin in rj.twins.items():
                self.conns[self.worker_of[twin]].send(
                    ("cut", twin, (w, rj.generation, rid), self._state_files())
                )
            return
        if kind != "ready":
            self._abort_rejoin(w, str(value))
            return
        self.addresses |= listening(value, self.host)
        # No cut (rolled back with no checkpoint complete): from the very beginning.
        links, here = rebuild_links(
            self.plan, value, rj.cuts, self.down, lambda up: self.worker_of[up] == w
        )
        # Rolled back with it to the same checkpoint: fed by a local link.
        rj.feeding.fed = {key: rj.checkpoint is not None and on for key, on in here.items()}
        for up, rid, epoch in links:
            if self.worker_of[up] not in self.running:
                continue  # finished: its replay window went with it
            self.conns[self.worker_of[up]].send(("link", up, rid, self.addresses[rid], epoch))
            rj.feeding.asked.add((up, rid))
        rj.state = "linking"
        with contextlib.suppress(OSError):
            rj.proc.conn.send(("go", self.addresses, self.t0_ns, self.duration, self.warmup))
            if self.metrics is not None:
                rj.proc.conn.send(("metrics", self.metrics.every_s))
        if self.duration is None:
            self._send_until([rj.proc.conn])
        self.retired.append(self.procs[w])
        self.procs[w], self.conns[w] = rj.proc, rj.proc.conn
        self.killed_workers.discard(w)
        self.running.add(w)
        self.heard[w] = time.monotonic()

    def _on_cut(self, twin: ReplicaId, taken: Resume | None, token, now_s: float) -> None:
        w, generation, rid = token
        rj = self.rejoins.get(w)
        if rj is None or rj.generation != generation:
            return
        if taken is None:
            # Finished or failed — or going by a moment ago: a later try finds out.
            retry = self._attempts.get(w, 0) < REJOIN_ATTEMPTS
            self._abort_rejoin(
                w,
                f"its twin {self._name(twin)} could not be cut (it finished, or failed)"
                + ("; trying again" if retry else ""),
            )
            if retry:
                self._lost_worker(w, now_s)
            return
        rj.cuts[rid] = taken
        if len(rj.cuts) == len(rj.twins):
            rj.state = "binding"
            with contextlib.suppress(OSError):
                rj.proc.conn.send(("resume", rj.cuts, self.t0_ns))

    def _on_linked(self, up: ReplicaId, down: ReplicaId, error: str | None, now_s: float) -> None:
        rj = self.rejoins.get(self.worker_of[down])
        if rj is None or rj.state != "linking":
            return
        if error is not None and (up, down) in rj.feeding.asked:
            log.warning(
                "%s could not feed the rebuilt %s: %s", self._name(up), self._name(down), error
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
        ``done`` never will be (its replicas finished first)."""
        for rj in list(self.rejoins.values()):
            for up, down in sorted(rj.feeding.asked):
                if self.worker_of[up] == w:
                    self._on_linked(up, down, "it finished first", now_s)

    def _linked(self, w: int, now_s: float) -> None:
        rj = self.rejoins[w]
        unfed = [
            f"{self._name(rid)} from {self.plan.tasks[t].name}[{p}]"
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
                f"{self._name(r)} is lost too ({causes.get(r, 'lost')})"
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
            self._worker_name(w),
            now_s,
            (now_s - rj.lost_s) * 1000,
        )

    def _stuck(self, rj: _Rejoin) -> str:
        """What a rebuild that timed out was waiting for, in words."""
        if rj.state == "starting":
            return "its new process never said it was ready for its cuts"
        if rj.state == "cutting":
            missing = [self._name(rj.twins[r]) for r in sorted(rj.twins) if r not in rj.cuts]
            return "no cut came from " + ", ".join(missing)
        if rj.state == "binding":
            return "its new process did not take its cuts"
        if not rj.started:
            return "its replicas did not start (dialling their downstream replicas)"
        unanswered = sorted(rj.feeding.asked)
        return "no answer to the links asked of " + ", ".join(
            f"{self._name(up)} (to {self._name(down)})" for up, down in unanswered
        )

    def _abort_rejoin(self, w: int, why: str) -> None:
        rj = self.rejoins.pop(w, None)
        if rj is None:
            return
        if rj.sinks or rj.checkpoint is not None:
            rj.proc.kill()
            rj.proc.join(timeout=5)
            self.retired.append(rj.proc)
            if rj.sinks:
                raise TandemError(
                    f"{self._worker_name(w)}, which hosts the sinks, could not be restarted: "
                    f"{why}. A sink has no twin, so the job cannot continue"
                )
            raise TandemError(
                f"{self._worker_name(w)} could not be rolled back to checkpoint "
                f"{rj.checkpoint}: {why}. At replication=1 nothing else holds its "
                "partitions, so the job cannot continue"
            )
        log.warning(
            "%s is not rebuilt: %s; its partitions go on with fewer replicas",
            self._worker_name(w),
            why,
        )
        rj.proc.kill()
        rj.proc.join(timeout=5)
        if self.procs.get(w) is rj.proc:  # it was already running
            self.running.discard(w)
            self.killed_workers.add(w)
        else:
            self.retired.append(rj.proc)

    def stop(self) -> None:
        """Kill whatever still runs and reap every child (also on errors and Ctrl-C)."""
        procs = self._all_procs()
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=10)
            proc.conn.close()
        if self._state_dir is not None:
            shutil.rmtree(self._state_dir, ignore_errors=True)
        if self._checkpoint_dir is not None:
            shutil.rmtree(self._checkpoint_dir, ignore_errors=True)

    def _sample_rss(self, running) -> None:
        """Peak resident memory per worker process, sampled about once a second."""
        if time.monotonic() - self._rss_at < 1.0:
            return
        self._rss_at = time.monotonic()
        for w in running:
            try:
                rss = psutil.Process(self.procs[w].pid).memory_info().rss
            except psutil.Error:
                continue
            name = self._worker_name(w)
            self.rss_mb[name] = max(self.rss_mb.get(name, 0.0), rss / 2**20)

    # -- faults ---------------------------------------------------------------------------

    def _alive(self, rid: ReplicaId) -> bool:
        w = self.worker_of[rid]
        return rid not in self.down and w not in self.killed_workers and self.procs[w].is_alive()

    def _resolve(self, task: int, partition: int, role: str) -> int:
        """The replica index holding ``role`` in a KaZoo partition right now."""
        alive = [
            r for r in range(self.plan.tasks[task].replication) if self._alive((task, partition, r))
        ]
        return kazoo.resolve_role(self.zoo, task, partition, role, alive)

    def _chaos_step(self, now_s: float) -> None:
        """Kill a random worker of replicated tasks once the chaos schedule says so and
        every partition is back at full replication (see :class:`tandem.faults.Chaos`)."""
        chaos = self.chaos
        if chaos.until is not None and now_s >= chaos.until:
            self.chaos = None
            return
        if now_s < self._chaos_at or self.rejoins or self.down:
            return
        if now_s > self.end_s() - REJOIN_MARGIN_S - chaos.every_s[0]:
            return
        victims = sorted(w for w in self.running if not self._hosts_sinks(w))
        if not victims:
            return
        w = self._chaos_rng.choice(victims)
        self.injected.append(
            {
                "kind": "chaos",
                "worker": w,
                "replicas": [
                    {"task": self.plan.tasks[t].name, "partition": p, "replica": r}
                    for t, p, r in self.placement[w]
                ],
                "injected_at": round(now_s, 3),
            }
        )
        log.info("chaos: SIGKILL %s at %.2f s", self._worker_name(w), now_s)
        self._kill_worker(w, now_s, "killed")
        self._chaos_at = now_s + self._chaos_rng.uniform(*chaos.every_s)

    def _inject(
        self,
        fault: ReplicaFault | KillWorker | KillHeartbeats | _Resume | _Deferred | Chaos,
        now_s: float,
        pending: list,
    ) -> None:
        """Inject ``fault`` on the worker hosting its replica (or the worker it names); a
        Pause also schedules its resume in ``pending``; Chaos starts its schedule. With
        ``Job(restore=True)`` a kill waits while it would take the last live replica of a
        partition whose other replicas are being rebuilt."""
        deferred = isinstance(fault, _Deferred)
        due = fault.due if deferred else fault.at
        if deferred:
            fault = fault.fault
        if isinstance(fault, Chaos):
            self.chaos, self._chaos_at = fault, now_s
            self._chaos_rng = random.Random(fault.seed)
            return
        if isinstance(fault, _Resume):
            if self.procs[fault.worker].pid != fault.pid:
                return  # declared lost and killed meanwhile (Job(restore=True))
            with contextlib.suppress(ProcessLookupError):
                os.kill(fault.pid, signal.SIGCONT)
            log.info("fault: SIGCONT %s at %.2f s", self._worker_name(fault.worker), now_s)
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
                replica = self._resolve(task.id, fault.partition, replica)
            rid = (task.id, fault.partition, replica)
            w = self.worker_of[rid]
        if not isinstance(fault, Pause) and self._twins_rebuilding(w):
            # The twins are still being rebuilt: this kill would take the last live replica
            # of a partition. It comes once they are back (restore_ms varies with the
            # machine's load; the job is not to fail because a rebuild was slow).
            if not deferred:
                log.info(
                    "fault: %s waits for the rebuild of its twins (at %.2f s)",
                    self._worker_name(w),
                    now_s,
                )
            pending.append(_Deferred(fault, now_s + DEFER_STEP_S, due))
            pending.sort(key=lambda f: f.at)
            return
        proc = self.procs[w]
        record = {
            **fault.to_dict(),
            "victim": replica,
            "worker": w,
            "replicas": [
                {"task": self.plan.tasks[t].name, "partition": p, "replica": r}
                for t, p, r in self.placement[w]
            ],
            "injected_at": round(now_s, 3),
        }
        if deferred:
            record["waited_for_rebuild_s"] = round(now_s - due, 3)
        self.injected.append(record)
        if isinstance(fault, Pause):
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGSTOP)
            pending.append(_Resume(w, fault.at + fault.for_s, proc.pid))
            pending.sort(key=lambda f: f.at)
            log.info(
                "fault: SIGSTOP %s (hosting %s) at %.2f s for %g s",
                self._worker_name(w),
                self._name(rid),
                now_s,
                fault.for_s,
            )
            return
        if w in self.killed_workers:
            return  # already dead: a kill of another replica it hosted
        log.info(
            "fault: SIGKILL %s (hosting %s) at %.2f s", self._worker_name(w), self._name(rid), now_s
        )
        self._kill_worker(w, now_s, "killed")

    def _twins_rebuilding(self, w: int) -> bool:
        """Whether worker ``w`` hosts the last live replica of a partition whose other
        replicas are being rebuilt."""
        for t, p, r in self.placement[w]:
            twins = [(t, p, o) for o in range(self.plan.tasks[t].replication) if o != r]
            if (
                (t, p, r) not in self.down
                and twins
                and all(o in self.down and self.worker_of[o] in self.rejoins for o in twins)
            ):
                return True
        return False

    def _kill_worker(self, w: int, now_s: float, cause: str) -> None:
        """SIGKILL worker ``w``; its replicas are lost (``cause``) and rebuilt if the job
        restores them. Fails the job if a partition has no live replica left."""
        proc = self.procs[w]
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(timeout=5)
        self.killed_workers.add(w)
        for r in self.placement[w]:
            if r not in self.reports:
                self.killed[r] = now_s
                self.lost.append((r, cause))
                self.down.add(r)
        self._check_partitions(
            [r for r in self.placement[w] if r in self.down],
            f"{self._worker_name(w)} was {'killed' if cause == 'killed' else 'declared lost'}",
        )
        self._attempts.pop(w, None)  # a new loss
        self._lost_worker(w, now_s)

    def _crashed(self, w: int, now_s: float) -> None:
        code = self.procs[w].exitcode
        log.warning("%s died unexpectedly (exit code %s)", self._worker_name(w), code)
        lost = [r for r in self.placement[w] if r not in self.reports and r not in self.down]
        self.crashed.extend(lost)
        self.lost += [(r, "crashed") for r in lost]
        self.down |= set(lost)
        self._check_partitions(lost, f"{self._worker_name(w)} exited with code {code}")
        self._attempts.pop(w, None)  # a new loss
        self._lost_worker(w, now_s)

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

    # -- reporting ------------------------------------------------------------------------

    def _name(self, rid: ReplicaId) -> str:
        t, p, r = rid
        return f"{self.plan.tasks[t].name}[{p}] replica {r}"

    def _worker_name(self, w: int) -> str:
        return f"worker {w}"

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
        note = ", ".join(f"killed {self._worker_name(w)} at {t:.1f}s" for w, t in killed.items())
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

    def result(self, check: bool) -> Result:
        result = assemble_result(
            self.plan,
            self.end_s(),
            self.reports,
            t0_ns=self.t0_ns,
            warmup=self.warmup,
            check=check,
            faults=self.injected,
            lost_replicas=self.lost,
            rss_mb=self.rss_mb,
            kazoo=self.zoo,
        )
        result.restored_replicas = list(self.restored)
        if self.checkpointing:
            result.checkpoints = dict(self.checkpoint_stats)
        return result


__all__ = ["LocalEngine"]
