"""The embedded default engine: one OS process per replica on this machine.

The coordinator (this module, in the caller's process) starts a process for every replica
of every task partition, collects the port each one listens on, fixes the logical time
origin ``t0`` and tells every replica to start. It then watches them: it injects the
requested faults (``td.Kill`` SIGKILLs a replica process, ``td.Pause`` SIGSTOPs it and
SIGCONTs it later), notices replicas that die, stops everything on an error, a timeout or
Ctrl-C — no process outlives a run, and every child also dies with its parent — and
finally assembles the :class:`tandem.Result`: latencies measured at the sinks, output
compared against the single-process reference executor (lost and duplicated rows; under
KaZoo the reference follows the orders the replicas followed), and the per-cycle output
digests of the replicas of each task partition compared with each other (the determinism
check).
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

import numpy as np
import pyarrow as pa

from tandem.api import Result
from tandem.exceptions import ConfigError, ServiceUnavailable, TandemError
from tandem.faults import Pause, ReplicaFault
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


class TaskFailed(TandemError):
    """A replica's operator raised; the message names task, partition and replica."""


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
        if not 0 <= warmup < duration:
            raise ConfigError(f"warmup must be in [0, duration={duration}), got {warmup}")
        for f in faults:
            if not isinstance(f, ReplicaFault):
                raise ConfigError(
                    f"the local engine injects td.Kill and td.Pause faults, got {f!r}"
                )
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
                            raise TaskFailed(report.error)
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
        plan = self.plan
        res = Result(t0_ns=self.t0_ns, faults=self.injected, rss_mb=self.rss_mb)
        res.lost_replicas = [
            {"task": plan.tasks[t].name, "partition": p, "replica": r, "cause": cause}
            for cause, rids in (("killed", list(self.killed)), ("crashed", self.crashed))
            for t, p, r in rids
        ]
        res.events_in = sum(
            plan.source_rows(t.id, p, self.duration)
            for t in plan.sources()
            for p in range(t.parallelism)
        )
        for task in plan.sinks():
            parts = [self.reports[(task.id, p, 0)].sink_part for p in range(task.parallelism)]
            res.outputs[task.name] = task.sink.combine(parts, task.schema)
            res.events_out += sum(
                self.reports[(task.id, p, 0)].rows_in for p in range(task.parallelism)
            )
        collects = [t.name for t in plan.sinks() if isinstance(res.outputs[t.name], pa.Table)]
        res.output = res.outputs[collects[0]] if collects else None
        self._latency(res, warmup)
        self._digests(res)
        self._leaders(res)
        if check:
            self._check(res)
        else:  # not measured: say so rather than report a reassuring zero
            res.lost = res.duplicates = None
        return res

    def _latency(self, res: Result, warmup: float) -> None:
        recv = [r.receive_ns for r in self.reports.values() if r.receive_ns is not None]
        lat = [r.latency_ms for r in self.reports.values() if r.latency_ms is not None]
        if not recv:
            return
        recv_ns, lat_ms = np.concatenate(recv), np.concatenate(lat)
        keep = recv_ns >= self.t0_ns + int(warmup * 1e9)
        recv_ns, lat_ms = recv_ns[keep], lat_ms[keep]
        if not len(lat_ms):
            return
        res.p50_ms = float(np.percentile(lat_ms, 50))
        res.p99_ms = float(np.percentile(lat_ms, 99))
        res.max_ms = float(lat_ms.max())
        second = (recv_ns - self.t0_ns) // 1_000_000_000
        res.per_second_p99_ms = [
            float(np.percentile(lat_ms[second == s], 99)) if np.any(second == s) else None
            for s in range(int(second.max()) + 1)
        ]
        times = np.unique(recv_ns)
        res.max_gap_ms = float(np.diff(times).max() / 1e6) if len(times) > 1 else 0.0

    def _leaders(self, res: Result) -> None:
        """Who led each KaZoo partition, in epoch order (a replica that died while leading
        is known from its successor's higher epoch only)."""
        terms: dict[str, list[dict]] = {}
        for (t, p, r), rep in sorted(self.reports.items()):
            for term in (rep.ordering_stats or {}).get("led", []):
                terms.setdefault(f"{self.plan.tasks[t].name}[{p}]", []).append(
                    {
                        "replica": r,
                        "epoch": term["epoch"],
                        "from_s": round((term["since_ns"] - self.t0_ns) / 1e9, 3),
                        "until_s": round((term["until_ns"] - self.t0_ns) / 1e9, 3),
                    }
                )
        res.leaders = {k: sorted(v, key=lambda x: x["epoch"]) for k, v in sorted(terms.items())}

    def _digests(self, res: Result) -> None:
        """Compare the per-cycle output digests of the replicas of each task partition."""
        groups: dict[tuple[int, int], list[ReplicaReport]] = {}
        for (t, p, _), rep in self.reports.items():
            groups.setdefault((t, p), []).append(rep)
        mismatches = []
        for (t, p), reps in groups.items():
            base = reps[0]
            for other in reps[1:]:
                for key in sorted(base.digests.keys() & other.digests.keys()):
                    if base.digests[key] != other.digests[key]:
                        edge, epoch = key
                        mismatches.append(
                            f"{plan_name(self.plan, t)}[{p}]: replicas {base.replica} and "
                            f"{other.replica} emitted different rows on output {edge} in "
                            f"heartbeat cycle {epoch}"
                        )
                        break
        res.digests_match = not mismatches
        res.determinism_errors = mismatches
        for m in mismatches:
            log.error("DeterminismError: %s", m)

    def _check(self, res: Result) -> None:
        """Lost and duplicated rows: every sink's output against the reference run."""
        from tandem import reference

        orders = None
        if self.zoo is not None:  # the reference follows the orders the replicas followed
            channels = {
                tp: len(self.plan.input_channels(*tp)) for tp in self.plan.ordered_partitions()
            }
            orders = kazoo.read_orders(self.zoo, channels)
        ref = reference.run(self.plan, self.duration, t0_ns=self.t0_ns, orders=orders)
        for task in self.plan.sinks():
            got, want = res.outputs.get(task.name), ref.outputs.get(task.name)
            if isinstance(got, pa.Table) and isinstance(want, pa.Table):
                lost, dups = multiset_diff(want, got)
            else:
                n_got = sum(self.reports[(task.id, p, 0)].rows_in for p in range(task.parallelism))
                n_want = ref.events_out
                lost, dups = max(0, n_want - n_got), max(0, n_got - n_want)
            res.lost += lost
            res.duplicates += dups


def plan_name(plan: Plan, task: int) -> str:
    return plan.tasks[task].name


def multiset_diff(want: pa.Table, got: pa.Table) -> tuple[int, int]:
    """(rows of ``want`` missing from ``got``, rows of ``got`` beyond ``want``), comparing
    the tables as multisets of rows."""
    if want.schema.names != got.schema.names:
        got = got.select(want.schema.names)
    cols = want.schema.names
    a = want.group_by(cols).aggregate([([], "count_all")]).rename_columns([*cols, "_want"])
    b = got.group_by(cols).aggregate([([], "count_all")]).rename_columns([*cols, "_got"])
    j = a.join(b, keys=cols, join_type="full outer")
    w = j.column("_want").fill_null(0).to_numpy()
    g = j.column("_got").fill_null(0).to_numpy()
    return int(np.maximum(w - g, 0).sum()), int(np.maximum(g - w, 0).sum())
