"""The embedded default engine: one OS process per replica on this machine.

The coordinator (this module, in the caller's process) starts a process for every replica
of every task partition, collects the port each one listens on, fixes the logical time
origin ``t0`` and tells every replica to start. It then watches them: it injects the
requested faults (``td.Kill`` SIGKILLs a replica process, ``td.Pause`` SIGSTOPs it and
SIGCONTs it later), notices replicas that die, stops everything on an error, a timeout or
Ctrl-C — no process outlives a run, and every child also dies with its parent — and
finally hands the replicas' reports to :func:`tandem.engines.common.assemble_result`,
which every engine shares.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing as mp
import os
import signal
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

from tandem.api import Result
from tandem.engines.common import assemble_result, check_options, multiset_diff
from tandem.exceptions import ConfigError, ServiceUnavailable, TandemError, TaskFailed
from tandem.faults import Kill, Pause, ReplicaFault
from tandem.ordering import kazoo
from tandem.ordering.kazoo import KazooRun
from tandem.plan import Plan
from tandem.runtime import Replica, ReplicaId, ReplicaReport

log = logging.getLogger("tandem")

STARTUP_S = 1.0
"""Time between the go signal and t0: every replica dials its downstream peers meanwhile."""

ON_READY = None
"""Test hook: called with every inbox address once all replicas listen, before they start."""


@dataclass(frozen=True)
class _Resume:
    """The second half of a ``td.Pause``: SIGCONT the frozen replica at ``at``."""

    rid: ReplicaId
    at: float


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no orphans, ever)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):  # libc without prctl: nothing to do
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _child(plan: Plan, rid: ReplicaId, secret: bytes, conn, kazoo: KazooRun | None) -> None:
    """Entry point of a replica process."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the coordinator handles Ctrl-C
    try:
        replica = Replica(plan, *rid, secret, kazoo=kazoo)

        def terminate(_signo, _frame) -> None:
            # A graceful stop: hand leadership over at once instead of after a session
            # timeout, then go.
            replica.release()
            os._exit(128 + signal.SIGTERM)

        signal.signal(signal.SIGTERM, terminate)
        conn.send(("ready", replica.bind()))
    except Exception as exc:  # a bind failure is a configuration problem
        conn.send(("error", f"replica {rid} could not start: {type(exc).__name__}: {exc}"))
        return
    msg = conn.recv()
    if msg[0] != "go":
        return
    _, addresses, t0_ns, duration = msg
    conn.send(("done", replica.run(addresses, t0_ns, duration)))


class LocalEngine:
    """Runs a plan with one OS process per replica on 127.0.0.1."""

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
        check_options(self.name, duration, warmup, faults, kinds=(Kill, Pause), roles=True)
        zoo = kazoo.prepare(plan) if plan.ordered_partitions() else None
        run = _Run(plan, duration, list(faults), progress, host, zoo)
        try:
            try:
                run.start()
                run.watch(timeout if timeout is not None else duration + 60.0)
            finally:
                run.stop()
            return run.result(warmup, check)
        finally:
            if zoo is not None:
                kazoo.cleanup(zoo)


class _Run:
    """The state of one run of the local engine."""

    def __init__(
        self, plan: Plan, duration: float, faults: list[ReplicaFault], progress, host, zoo
    ) -> None:
        self.plan, self.duration, self.progress, self.host = plan, duration, progress, host
        self.zoo: KazooRun | None = zoo
        self.faults = sorted(faults, key=lambda f: f.at)
        self.secret = os.urandom(32)
        self.ctx = mp.get_context("spawn")
        self.procs: dict[ReplicaId, Any] = {}
        self.conns: dict[ReplicaId, Any] = {}
        self.reports: dict[ReplicaId, ReplicaReport] = {}
        self.killed: dict[ReplicaId, float] = {}
        self.crashed: list[ReplicaId] = []
        self.injected: list[dict] = []
        self.t0_ns = 0
        self.rss_mb: dict[str, float] = {}
        self._rss_at = 0.0

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        for rid in self.plan.replicas():
            parent, child = self.ctx.Pipe()
            proc = self.ctx.Process(
                target=_child,
                args=(self.plan, rid, self.secret, child, self.zoo),
                name=f"tandem-{self.plan.tasks[rid[0]].name}-{rid[1]}-{rid[2]}",
                daemon=True,
            )
            proc.start()
            child.close()
            self.procs[rid], self.conns[rid] = proc, parent
        addresses: dict[ReplicaId, tuple[str, int]] = {}
        pending = set(self.procs)
        deadline = time.monotonic() + 60.0
        while pending:
            ready = wait([self.conns[r] for r in pending], timeout=deadline - time.monotonic())
            if not ready:
                names = sorted(self._name(r) for r in pending)
                raise TandemError(f"replicas did not start within 60 s: {names}")
            for conn in ready:
                rid = next(r for r in pending if self.conns[r] is conn)
                try:
                    kind, value = conn.recv()
                except EOFError:
                    raise TandemError(f"{self._name(rid)} exited while starting") from None
                if kind == "error":
                    raise ConfigError(value)
                if value is not None:
                    addresses[rid] = (self.host, value)
                pending.discard(rid)
        if ON_READY is not None:
            ON_READY(addresses)
        self.t0_ns = time.time_ns() + int(STARTUP_S * 1e9)
        for conn in self.conns.values():
            conn.send(("go", addresses, self.t0_ns, self.duration))

    def watch(self, timeout: float) -> None:
        deadline = time.monotonic() + STARTUP_S + timeout
        faults = list(self.faults)
        running = set(self.procs)
        while running:
            now_s = (time.time_ns() - self.t0_ns) / 1e9
            while faults and faults[0].at <= now_s:
                self._inject(faults.pop(0), now_s, faults)
                running -= set(self.killed)
            self._draw(now_s)
            self._sample_rss(running)
            waitables = {self.conns[r]: r for r in running}
            waitables.update({self.procs[r].sentinel: r for r in running})
            next_fault = (faults[0].at - now_s) if faults else 0.2
            for obj in wait(list(waitables), timeout=max(0.0, min(0.2, next_fault))):
                rid = waitables[obj]
                if rid not in running:
                    continue
                if obj is self.conns[rid]:
                    try:
                        kind, report = obj.recv()
                    except EOFError:
                        continue  # the sentinel reports the exit
                    if kind == "done":
                        self.reports[rid] = report
                        running.discard(rid)
                        if report.error:
                            raise report.failure()
                elif not self.procs[rid].is_alive() and rid not in self.reports:
                    running.discard(rid)
                    self._crashed(rid)
            if time.monotonic() > deadline:
                stuck = sorted(self._name(r) for r in running)
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
        """Peak resident memory per replica process, sampled about once a second."""
        if time.monotonic() - self._rss_at < 1.0:
            return
        self._rss_at = time.monotonic()
        for rid in running:
            try:
                with open(f"/proc/{self.procs[rid].pid}/status") as f:
                    kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
            except (OSError, StopIteration):
                continue
            name = self._name(rid)
            self.rss_mb[name] = max(self.rss_mb.get(name, 0.0), kb / 1024)

    # -- faults ---------------------------------------------------------------------------

    def _resolve(self, task: int, partition: int, role: str) -> int:
        """The replica index holding ``role`` in a KaZoo partition right now (waiting up to
        one session timeout and a bit if an election is under way)."""
        alive = [
            r
            for r in range(self.plan.tasks[task].replication)
            if (task, partition, r) not in self.killed
            and self.procs[(task, partition, r)].is_alive()
        ]
        deadline = time.monotonic() + self.zoo.config.session_timeout_s + 10.0
        leader = None
        while True:
            with contextlib.suppress(ServiceUnavailable):  # a busy or restarting server
                leader = kazoo.current_leader(self.zoo, task, partition)
            if leader in alive or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        if role == "leader":
            if leader not in alive:
                raise TandemError(
                    f"{self.plan.tasks[task].name}[{partition}] has no live leader to kill"
                )
            return leader
        followers = [r for r in alive if r != leader]
        if not followers:
            raise TandemError(
                f"{self.plan.tasks[task].name}[{partition}] has no live follower to kill"
            )
        return followers[0]

    def _inject(self, fault: ReplicaFault | _Resume, now_s: float, pending: list) -> None:
        """Inject ``fault``; a Pause also schedules its resume in ``pending``."""
        if isinstance(fault, _Resume):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.procs[fault.rid].pid, signal.SIGCONT)
            log.info("fault: SIGCONT %s at %.2f s", self._name(fault.rid), now_s)
            return
        task = self.plan.task(fault.task)
        replica = fault.replica
        if isinstance(replica, str):
            replica = self._resolve(task.id, fault.partition, replica)
        rid = (task.id, fault.partition, replica)
        proc = self.procs[rid]
        record = {**fault.to_dict(), "victim": replica, "injected_at": round(now_s, 3)}
        self.injected.append(record)
        if isinstance(fault, Pause):
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGSTOP)
            pending.append(_Resume(rid, fault.at + fault.for_s))
            pending.sort(key=lambda f: f.at)
            log.info("fault: SIGSTOP %s at %.2f s for %g s", self._name(rid), now_s, fault.for_s)
            return
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(timeout=5)
        self.killed[rid] = now_s
        log.info("fault: SIGKILL %s at %.2f s", self._name(rid), now_s)

    def _crashed(self, rid: ReplicaId) -> None:
        code = self.procs[rid].exitcode
        log.warning("%s died unexpectedly (exit code %s)", self._name(rid), code)
        self.crashed.append(rid)
        task, part, _ = rid
        alive = [
            r
            for r in range(self.plan.tasks[task].replication)
            if (task, part, r) not in self.killed and (task, part, r) not in self.crashed
        ]
        if not alive:
            raise TandemError(
                f"every replica of {self.plan.tasks[task].describe()} partition {part} is gone "
                f"({self._name(rid)} exited with code {code}); the job cannot continue"
            )

    # -- reporting ------------------------------------------------------------------------

    def _name(self, rid: ReplicaId) -> str:
        t, p, r = rid
        return f"{self.plan.tasks[t].name}[{p}] replica {r}"

    def _draw(self, elapsed: float, done: bool = False) -> None:
        if not self.progress:
            return
        elapsed = min(max(elapsed, 0.0), self.duration)
        width = 30
        filled = int(width * elapsed / self.duration)
        note = "".join(f"  killed {self._name(r)} at {t:.1f}s" for r, t in self.killed.items())
        sys.stderr.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {elapsed:5.1f}/{self.duration:g}s{note}"
        )
        if done:
            sys.stderr.write("\n")
        sys.stderr.flush()

    def result(self, warmup: float, check: bool) -> Result:
        lost = [(rid, "killed") for rid in self.killed] + [(rid, "crashed") for rid in self.crashed]
        return assemble_result(
            self.plan,
            self.duration,
            self.reports,
            t0_ns=self.t0_ns,
            warmup=warmup,
            check=check,
            faults=self.injected,
            lost_replicas=lost,
            rss_mb=self.rss_mb,
            kazoo=self.zoo,
        )


__all__ = ["LocalEngine", "TaskFailed", "multiset_diff"]
