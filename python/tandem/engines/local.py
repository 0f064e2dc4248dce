"""The embedded default engine: a handful of worker processes on this machine.

The engine hosts the workers of the plan's placement (:meth:`tandem.plan.Plan.placement`:
one or more workers per replica group, plus one for the sinks) as processes, each hosting
many task replicas (:class:`tandem.runtime.Worker`), for the run's
:class:`~tandem.engines.coordinator.Coordinator` — the one every engine shares, which
injects faults, decides losses, rebuilds lost workers and takes checkpoints. This module
is its :class:`~tandem.engines.coordinator.WorkerHost`, :class:`LocalHost`: a worker
process is a fresh interpreter running :mod:`tandem.engines.worker` (not a
``multiprocessing`` child, which would import the caller's main script again: a plain
script without a ``__main__`` guard works), linked to the coordinator by a socket pair;
the plan reaches it by cloudpickle, so lambdas and closures travel by value. ``td.Kill``
SIGKILLs the worker process, ``td.Pause`` SIGSTOPs it and SIGCONTs it later; no process
outlives a run, and every child also dies with its parent. A rebuilt worker is a new
process — a spare started ahead where there is one. The replicas' reports then go to
:func:`tandem.engines.common.assemble_result`, which every engine shares.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Any

import cloudpickle
import psutil

from tandem.engines import spare
from tandem.engines.common import STARTUP_S, Stop, check_options, stop_points
from tandem.engines.coordinator import STOP_LEAD_S, Coordinator, Event, Exited, Received
from tandem.engines.exchange import state_folder
from tandem.engines.process import child_env
from tandem.engines.protocol import Assign, Message
from tandem.exceptions import ConfigError
from tandem.faults import Chaos, Kill, KillHeartbeats, KillWorker, Pause
from tandem.heartbeat import Generators
from tandem.ordering import kazoo
from tandem.plan import Plan
from tandem.result import Result
from tandem.runtime import ReplicaReport

log = logging.getLogger("tandem")

ON_READY = None
"""Test hook: called with every inbox address once all replicas listen, before they start."""


SPARE_NICE = 19
"""The niceness of the thread a spare process loads its modules on (``0``: none): it runs
:mod:`tandem.engines.spare` by its file, which loads the worker's modules at this niceness
and ``SCHED_IDLE``, then gives every thread the normal priority back (see there why)."""


class _Process:
    """A worker process (``python -m tandem.engines.worker``) and its end of the link;
    a spare (``payload`` None: its :class:`Assign` comes later) starts as
    :mod:`tandem.engines.spare` says. ``relay``: its stderr comes through a pipe and is written
    line by line above the progress bar (:func:`_relay`) instead of across it."""

    def __init__(
        self, payload: Assign | None, env: dict[str, str], worker: int | str, relay: bool
    ) -> None:
        mine, theirs = socket.socketpair()
        args = [str(theirs.fileno()), str(os.getpid()), str(worker)]
        if payload is None and SPARE_NICE:
            command = [sys.executable, spare.PATH, *args, str(SPARE_NICE)]
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
    before the run returns (:meth:`LocalHost.close`), so the CPU they used — start-up, run,
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
            res.first_output_unix_ns = min(firsts)


class LocalEngine:
    """Runs a plan on worker processes on 127.0.0.1 (see the module documentation)."""

    name = "local"
    until_stopped = True
    savepoints = True  # a run may resume from a savepoint and write durable checkpoints
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
        length, cap_ns = stop_points(duration, stop)
        lh = LocalHost(plan, host, relay=progress)
        run = Coordinator(
            plan,
            lh,
            length,
            list(faults),
            secret=os.urandom(32),
            zoo=zoo,
            warmup=warmup,
            progress=progress,
            generators=generators,
            stop=stop,
            cap_ns=cap_ns,
            on_ready=lambda addresses: ON_READY(addresses) if ON_READY is not None else None,
            metrics=metrics,
        )

        def sample(now_s: float) -> None:
            reading = cost.due(now_s, run.end_s())
            if reading is not None and reading <= 0:
                cost.read([p.pid for p in lh.all_procs()])
            lh.sample_rss(run.current, run.running)

        run.sampler = sample
        try:
            generators.start()
            try:
                with _above_the_bar(progress):
                    run.start()
                    if timeout is None:
                        timeout = 60.0 if run.duration is None else duration + 60.0
                    run.watch(timeout)
            finally:
                run.close()
                generators.stop()
            cost.finish()
            result = run.result(check)
            sinks = [r for (t, _, _), r in run.reports.items() if plan.tasks[t].kind == "sink"]
            cost.apply(result, len(lh.all_procs()), sinks)
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


class LocalHost:
    """Worker processes on this machine, for a :class:`Coordinator` (its
    :class:`~tandem.engines.coordinator.WorkerHost`). Processes are indexed by worker and
    incarnation; ``relay``: their stderr is written above the progress bar."""

    name = "local"
    starts_rebuilds = True
    live_rescale = True
    """Its coordinator rescales a running job (:mod:`tandem.runtime.rescaling`)."""

    def __init__(self, plan: Plan, bind: str, relay: bool) -> None:
        self.bind, self.relay = bind, relay
        # The plan goes by cloudpickle: functions, lambdas and closures of the main script
        # by value (Job.plan checked that every task can be sent).
        self.blob = cloudpickle.dumps(plan)
        self.env = child_env()
        self.procs: dict[tuple[int, int], _Process] = {}
        self.open: set[tuple[int, int]] = set()
        """The processes whose link is still read (not yet exited)."""
        self.spare: _Process | None = None
        """A process started ahead, interpreter and imports paid, that becomes the next
        rebuilt worker: a rebuild does not wait for a process start (about half a second
        of CPU on a small machine), and that start does not land beside the rebuild."""
        self.unused: list[_Process] = []  # spares that died before they were used
        self._state_dir: str | None = None  # where twins leave large states for newcomers
        self.rss_mb: dict[str, float] = {}
        self._rss_at = 0.0

    def set_plan(self, plan: Plan) -> None:
        """The job runs ``plan`` from now on (a live rescale): what a rebuilt worker gets."""
        self.blob = cloudpickle.dumps(plan)

    def _assign(self, assign: Assign) -> Assign:
        return Assign(
            assign.worker,
            assign.replicas,
            assign.rejoin,
            tuple(sys.path),
            self.blob,
            assign.secret,
            assign.kazoo,
        )

    def start(self, assignments: list[Assign]) -> None:
        for a in assignments:
            proc = _Process(self._assign(a), self.env, a.worker, relay=self.relay)
            self.procs[(a.worker, 0)] = proc
            self.open.add((a.worker, 0))
        for a in assignments:
            self.procs[(a.worker, 0)].send_payload()

    def replace(self, assign: Assign, incarnation: int) -> bool:
        """The spare process, given the assignment, if it is alive (warm); otherwise a
        new process."""
        payload = self._assign(assign)
        proc, self.spare = self.spare, None
        warm = proc is not None and proc.is_alive()
        if not warm:
            if proc is not None:
                self.unused.append(proc)
            proc = _Process(payload, self.env, assign.worker, relay=self.relay)
        proc.payload = payload
        proc.send_payload()
        self.procs[(assign.worker, incarnation)] = proc
        self.open.add((assign.worker, incarnation))
        return warm

    def send(self, worker: int, incarnation: int, message: Message) -> bool:
        proc = self.procs.get((worker, incarnation))
        if proc is None:
            return False
        try:
            proc.conn.send(message)
        except OSError:  # a worker that died: its link's EOF says so
            return False
        return True

    def kill(self, worker: int, incarnation: int, cause: str) -> list[int]:
        proc = self.procs.get((worker, incarnation))
        if proc is not None and proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(timeout=5)
        return []

    def pause(self, worker: int, incarnation: int, for_s: float) -> bool:
        proc = self.procs[(worker, incarnation)]
        if not proc.is_alive():
            return False
        os.kill(proc.pid, signal.SIGSTOP)
        return True

    def thaw(self, worker: int, incarnation: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.procs[(worker, incarnation)].pid, signal.SIGCONT)

    def poll(self, timeout: float) -> list[Event]:
        # A worker that exits closes its end of the link: EOF on the connection.
        waitables = {self.procs[key].conn: key for key in self.open}
        events: list[Event] = []
        for conn in wait(list(waitables), timeout=timeout):
            w, inc = key = waitables[conn]
            try:
                events.append(Received(w, inc, conn.recv()))
            except (EOFError, OSError):  # a process killed mid-write resets its link
                proc = self.procs[key]
                proc.join(timeout=5)
                if proc.is_alive():  # closed the link but lingers: finish it off
                    proc.kill()
                    proc.join(timeout=5)
                self.open.discard(key)
                events.append(Exited(w, inc, proc.exitcode))
        return events

    def node(self, worker: int, incarnation: int) -> str:
        return self.bind

    def pid(self, worker: int, incarnation: int) -> int | None:
        proc = self.procs.get((worker, incarnation))
        return None if proc is None else proc.pid

    def dead(self, worker: int, incarnation: int) -> bool:
        proc = self.procs.get((worker, incarnation))
        return proc is not None and proc.exitcode is not None

    def state_folder(self, twin_worker: int, worker: int, incarnation: int) -> str:
        """The folder twins write large states to for their rebuilt replicas (memory-backed
        where Linux offers it), made on first use and removed with the run."""
        if self._state_dir is None:
            self._state_dir = state_folder()
        return self._state_dir

    def idle(self) -> None:
        if self.spare is None:
            self.spare = _Process(None, self.env, "spare", relay=self.relay)

    def all_procs(self) -> list[_Process]:
        """Every process the run started: live, retired, being rebuilt and spare."""
        spare = [self.spare] if self.spare is not None else []
        return [*self.procs.values(), *self.unused, *spare]

    def sample_rss(self, current: dict[int, int], running: set[int]) -> None:
        """Peak resident memory per worker process, sampled about once a second."""
        if time.monotonic() - self._rss_at < 1.0:
            return
        self._rss_at = time.monotonic()
        for w in running:
            try:
                rss = psutil.Process(self.procs[(w, current[w])].pid).memory_info().rss
            except psutil.Error:
                continue
            name = f"worker {w}"
            self.rss_mb[name] = max(self.rss_mb.get(name, 0.0), rss / 2**20)

    def close(self) -> None:
        """Kill whatever still runs and reap every child (also on errors and Ctrl-C)."""
        procs = self.all_procs()
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=10)
            proc.conn.close()
        if self._state_dir is not None:
            shutil.rmtree(self._state_dir, ignore_errors=True)


__all__ = ["STARTUP_S", "STOP_LEAD_S", "LocalEngine", "LocalHost"]
