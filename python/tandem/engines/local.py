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
import ctypes
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import cloudpickle
import psutil

from tandem import logs
from tandem.api import Result
from tandem.engines.common import assemble_result, check_options, multiset_diff
from tandem.exceptions import ConfigError, TandemError, TaskFailed
from tandem.faults import Kill, KillWorker, Pause, ReplicaFault
from tandem.ordering import kazoo
from tandem.ordering.kazoo import KazooRun
from tandem.plan import Plan
from tandem.runtime import ReplicaId, ReplicaReport, Worker

log = logging.getLogger("tandem")

STARTUP_S = 1.0
"""Time between the go signal and t0: every replica dials its downstream peers meanwhile."""

ON_READY = None
"""Test hook: called with every inbox address once all replicas listen, before they start."""


@dataclass(frozen=True)
class _Resume:
    """The second half of a ``td.Pause``: SIGCONT the frozen worker at ``at``."""

    worker: int
    at: float


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no orphans, ever)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):  # libc without prctl: nothing to do
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def serve(plan: Plan, rids: list[ReplicaId], secret: bytes, conn, kazoo: KazooRun | None) -> None:
    """The ready/go/done exchange of a worker process with the coordinator, over ``conn``
    (see :mod:`tandem.engines.worker`, the process's entry point)."""
    try:
        worker = Worker(plan, rids, secret, kazoo=kazoo)

        def terminate(_signo, _frame) -> None:
            # A graceful stop: hand leadership over at once instead of after a session
            # timeout, then go.
            worker.release()
            os._exit(128 + signal.SIGTERM)

        signal.signal(signal.SIGTERM, terminate)
        conn.send(("ready", worker.bind()))
    except Exception as exc:  # a bind failure is a configuration problem
        conn.send(("error", f"worker of {rids} could not start: {type(exc).__name__}: {exc}"))
        return
    msg = conn.recv()
    if msg[0] != "go":
        return
    _, addresses, t0_ns, duration, warmup = msg
    reports = worker.run(addresses, t0_ns, duration, warmup)
    # The coordinator may stop this process once it has the reports: hand what the core
    # logged to logging first.
    logs.flush(1.0)
    conn.send(("done", reports))


def _worker_env() -> dict[str, str]:
    """The environment of a worker process: this one's, with the folder tandem was
    imported from on PYTHONPATH unless the interpreter finds it anyway (site-packages),
    and the log level (``TANDEM_LOG_LEVEL``) of this process's ``tandem`` logger unless it
    is set already."""
    import site

    import tandem

    env = dict(os.environ)
    env[logs.LEVEL_ENV] = logs.driver_level()
    root = os.path.dirname(os.path.dirname(os.path.abspath(tandem.__file__)))
    default = set(site.getsitepackages()) | {site.getusersitepackages()}
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in default and root not in paths:
        env["PYTHONPATH"] = os.pathsep.join([root, *paths])
    return env


class _Process:
    """A worker process (``python -m tandem.engines.worker``) and its end of the link.
    ``relay``: its stderr comes through a pipe and is written line by line above the
    progress bar (:func:`_relay`) instead of across it."""

    def __init__(self, payload: tuple, env: dict[str, str], worker: int, relay: bool) -> None:
        mine, theirs = socket.socketpair()
        try:
            self.popen = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tandem.engines.worker",
                    str(theirs.fileno()),
                    str(os.getpid()),
                    str(worker),
                ],
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
    :class:`~tandem.api.Result`).

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

    def run(
        self,
        plan: Plan,
        duration: float,
        faults: list[Any] = (),
        *,
        progress: bool | None = None,
        warmup: float = 0.0,
        check: bool = True,
        timeout: float | None = None,
        host: str = "127.0.0.1",
    ) -> Result:
        """Run ``plan`` for ``duration`` seconds of source time.

        ``warmup`` seconds of output are left out of the latency figures; ``check``
        compares the output with the reference executor (lost / duplicates); ``timeout``
        bounds the whole run (default: duration + 60 s); ``progress`` draws a progress bar
        on stderr (default: when stderr is a terminal).
        """
        if progress is None:
            progress = sys.stderr.isatty()
        cost = _CostMeter(warmup)
        check_options(self.name, duration, warmup, faults, kinds=(Kill, KillWorker, Pause))
        zoo = kazoo.prepare(plan) if plan.ordered_partitions() else None
        run = _Run(plan, duration, list(faults), progress, host, zoo, warmup)
        try:
            try:
                with _above_the_bar(progress):
                    run.start()
                    run.watch(timeout if timeout is not None else duration + 60.0, cost)
            finally:
                run.stop()
            cost.finish()
            result = run.result(check)
            sinks = [r for (t, _, _), r in run.reports.items() if plan.tasks[t].kind == "sink"]
            cost.apply(result, len(run.procs), sinks)
            return result
        finally:
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
    ) -> None:
        self.plan, self.duration, self.progress, self.host = plan, duration, progress, host
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
        self.reports: dict[ReplicaId, ReplicaReport] = {}
        self.killed: dict[ReplicaId, float] = {}
        self.killed_workers: set[int] = set()
        self.crashed: list[ReplicaId] = []
        self.injected: list[dict] = []
        self.t0_ns = 0
        self.rss_mb: dict[str, float] = {}
        self._rss_at = 0.0

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        # The plan goes by cloudpickle: functions, lambdas and closures of the main script
        # by value (Job.plan checked that every task can be sent).
        blob = cloudpickle.dumps(self.plan)
        env = _worker_env()
        for w, rids in enumerate(self.placement):
            proc = _Process(
                (list(sys.path), blob, rids, self.secret, self.zoo), env, w, relay=self.progress
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
                for rid, port in value.items():
                    if port is not None:
                        addresses[rid] = (self.host, port)
                pending.discard(w)
        if ON_READY is not None:
            ON_READY(addresses)
        self.t0_ns = time.time_ns() + int(STARTUP_S * 1e9)
        for conn in self.conns.values():
            conn.send(("go", addresses, self.t0_ns, self.duration, self.warmup))

    def watch(self, timeout: float, cost: _CostMeter | None = None) -> None:
        """Inject the faults, sample memory, take ``cost``'s readings, collect the reports
        until every worker has finished or died."""
        deadline = time.monotonic() + STARTUP_S + timeout
        faults = list(self.faults)
        running = set(self.procs)
        while running:
            now_s = (time.time_ns() - self.t0_ns) / 1e9
            reading = cost.due(now_s, self.duration) if cost is not None else None
            if reading is not None and reading <= 0:
                cost.read([p.pid for p in self.procs.values()])
                reading = cost.due(now_s, self.duration)
            while faults and faults[0].at <= now_s:
                self._inject(faults.pop(0), now_s, faults)
                running -= self.killed_workers
            self._draw(now_s)
            self._sample_rss(running)
            # A worker that exits closes its end of the link: EOF on the connection.
            waitables = {self.conns[w]: w for w in running}
            next_fault = (faults[0].at - now_s) if faults else 0.2
            if reading is not None:
                next_fault = min(next_fault, reading)
            for obj in wait(list(waitables), timeout=max(0.0, min(0.2, next_fault))):
                w = waitables[obj]
                if w not in running:
                    continue
                try:
                    kind, reports = obj.recv()
                except EOFError:
                    proc = self.procs[w]
                    proc.join(timeout=5)
                    if proc.is_alive():  # closed the link but lingers: finish it off
                        proc.kill()
                        proc.join(timeout=5)
                    running.discard(w)
                    self._crashed(w)
                    continue
                if kind == "done":
                    self.reports.update(reports)
                    running.discard(w)
                    for report in reports.values():
                        if report.error:
                            raise report.failure()
            if running and time.monotonic() > deadline:
                stuck = sorted(self._worker_name(w) for w in running)
                raise TandemError(
                    f"the run did not finish within {timeout:.0f} s of its start; still running: "
                    f"{stuck}. Raise timeout= if the job is expected to take longer."
                )
        self._draw(self.duration, done=True)

    def stop(self) -> None:
        """Kill whatever still runs and reap every child (also on errors and Ctrl-C)."""
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
        for proc in self.procs.values():
            proc.join(timeout=10)
        for conn in self.conns.values():
            conn.close()

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
        return w not in self.killed_workers and self.procs[w].is_alive()

    def _resolve(self, task: int, partition: int, role: str) -> int:
        """The replica index holding ``role`` in a KaZoo partition right now."""
        alive = [
            r for r in range(self.plan.tasks[task].replication) if self._alive((task, partition, r))
        ]
        return kazoo.resolve_role(self.zoo, task, partition, role, alive)

    def _inject(
        self, fault: ReplicaFault | KillWorker | _Resume, now_s: float, pending: list
    ) -> None:
        """Inject ``fault`` on the worker hosting its replica (or the worker it names); a
        Pause also schedules its resume in ``pending``."""
        if isinstance(fault, _Resume):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.procs[fault.worker].pid, signal.SIGCONT)
            log.info("fault: SIGCONT %s at %.2f s", self._worker_name(fault.worker), now_s)
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
        self.injected.append(record)
        if isinstance(fault, Pause):
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGSTOP)
            pending.append(_Resume(w, fault.at + fault.for_s))
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
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(timeout=5)
        self.killed_workers.add(w)
        for r in self.placement[w]:
            if r not in self.reports:
                self.killed[r] = now_s
        log.info(
            "fault: SIGKILL %s (hosting %s) at %.2f s", self._worker_name(w), self._name(rid), now_s
        )

    def _crashed(self, w: int) -> None:
        code = self.procs[w].exitcode
        log.warning("%s died unexpectedly (exit code %s)", self._worker_name(w), code)
        lost = [r for r in self.placement[w] if r not in self.reports and r not in self.killed]
        self.crashed.extend(lost)
        gone = set(self.killed) | set(self.crashed)
        for task, part, _ in lost:
            alive = [
                r for r in range(self.plan.tasks[task].replication) if (task, part, r) not in gone
            ]
            if not alive:
                raise TandemError(
                    f"every replica of {self.plan.tasks[task].describe()} partition {part} is "
                    f"gone ({self._worker_name(w)} exited with code {code}); the job cannot "
                    "continue"
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

            self._bar = tqdm(
                total=self.duration,
                file=sys.stderr,
                bar_format="{desc} |{bar:30}| {n:5.1f}/{total:g}s{postfix}",
                desc=self.plan.job,
                leave=True,
            )
        killed: dict[int, float] = {}
        for rid, t in self.killed.items():
            killed.setdefault(self.worker_of[rid], t)
        note = ", ".join(f"killed {self._worker_name(w)} at {t:.1f}s" for w, t in killed.items())
        self._bar.n = min(max(elapsed, 0.0), self.duration)
        self._bar.set_postfix_str(note, refresh=False)
        self._bar.refresh()
        if done:
            self._bar.close()
            self._bar = None

    def result(self, check: bool) -> Result:
        lost = [(rid, "killed") for rid in self.killed] + [(rid, "crashed") for rid in self.crashed]
        return assemble_result(
            self.plan,
            self.duration,
            self.reports,
            t0_ns=self.t0_ns,
            warmup=self.warmup,
            check=check,
            faults=self.injected,
            lost_replicas=lost,
            rss_mb=self.rss_mb,
            kazoo=self.zoo,
        )


__all__ = ["LocalEngine", "TaskFailed", "multiset_diff"]
