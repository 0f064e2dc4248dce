"""The exchange between a worker and the coordinator of its engine, both sides.

Every engine runs the same workers (:class:`tandem.runtime.Worker`) and speaks to them the
same way, over a :class:`multiprocessing.connection.Connection`: the local engine's
coordinator to its worker processes, the Spark engine's registry on the driver to its
worker tasks. :func:`serve` is the worker's side; the helpers below it are what a
coordinator decides when it rebuilds a lost worker's replicas from their live twins
(``Job(restore=True)``, DESIGN §4): which twin each is cut from, which upstream replicas
replay to it, and what ``Result.restored_replicas`` records of it.

The messages are the typed ones of :mod:`tandem.engines.protocol`, in the order it gives.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tandem import logs
from tandem.engines.protocol import (
    Alive,
    Checkpointed,
    CheckpointRequest,
    Crash,
    CutRequest,
    CutTaken,
    Done,
    Evicted,
    Exit,
    Failed,
    Freeze,
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
from tandem.exceptions import ProtocolError
from tandem.ordering.kazoo import KazooRun
from tandem.plan import Plan
from tandem.runtime import (
    CATCH_UP_NICE,
    CHILD_NICE,
    ReplicaId,
    ReplicaReport,
    Resume,
    Worker,
    _warm_up,
    may_raise_priority,
    thread_nice,
)
from tandem.runtime.replica import failures
from tandem.runtime.rescaling import RescaleSpec

log = logging.getLogger("tandem")

SPILL_BYTES = 1 << 20
"""A cut's state at least this large travels from the twin to the rebuilt replica as a file
(``Resume.state_file``) instead of through the coordinator's links."""


def state_folder() -> str:
    """A new folder for the large states twins leave for rebuilt replicas (memory-backed
    where Linux offers it: ``/dev/shm``); its maker removes it with the run."""
    shm = "/dev/shm"
    where = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
    return tempfile.mkdtemp(prefix="tandem-state-", dir=where)


REJOIN_TIMEOUT_S = 30.0
"""How long rebuilding a lost worker's replicas may take before the run gives up on it
(the partitions go on with fewer replicas)."""

REJOIN_MARGIN_S = 1.0
"""A worker lost this close to the end of the stream is not rebuilt."""

REJOIN_ATTEMPTS = 3
"""Cuts taken for one loss before giving up: a cut that left an upstream replica's replay
window (the rebuild took longer than ``Job(replay_ms=...)``) is retried with a later one."""

EXIT_FENCED = 70
"""The exit code of a worker its coordinator fenced (``exit``)."""


def serve(
    plan: Plan,
    rids: list[ReplicaId],
    secret: bytes,
    conn,
    kazoo: KazooRun | None,
    rejoin: bool = False,
    *,
    host: str = "127.0.0.1",
    receive: Callable[[str], Message] | None = None,
    send_reports: bool = True,
    sigterm: bool = True,
) -> dict[ReplicaId, ReplicaReport] | None:
    """The worker's side of the exchange with its coordinator over ``conn``: ``ready``
    with its ports (the inboxes bound on ``host``), ``go``, then ``finish(reports)`` —
    by default ``done`` with the reports. Meanwhile the coordinator may ask it for cuts
    of its replicas and to link them to rebuilt downstream replicas (``cut``, ``link``;
    answered by ``cut`` and ``linked`` messages), and for a ``metrics`` snapshot every so
    many seconds (:mod:`tandem.metrics`; sent as ``metrics`` messages, the last one before
    ``done``). A worker that rebuilds lost replicas (``rejoin``) first says it is
    ``waiting`` and gets their twins' cuts (``resume``), and says ``started`` once its
    replicas have dialled their downstream replicas. ``receive(what)``: the
    coordinator's next message before the run (default: wait for it).
    ``send_reports``: the ``Done`` message carries the reports (else only the failed
    replicas: Spark returns the reports as its output). ``sigterm``: a SIGTERM hands KaZoo
    leadership over and exits the process. Returns the reports, or None if the
    coordinator stopped the worker before it ran."""
    recv = receive or (lambda what: conn.recv())
    cpu0 = process_cpu_s()
    resume = None
    base_nice = None
    if rejoin:
        # What a rebuild does here — load the states, catch up on the replay — runs at a
        # lower priority than the survivors' work, where the priority can be raised back
        # (Worker.caught_up_nice).
        if may_raise_priority():
            base_nice = thread_nice(CATCH_UP_NICE)
        _warm_up()
        conn.send(Waiting())
        msg = expect(recv("twins' cuts"), Restore, Exit, what="for a rebuilt worker")
        if isinstance(msg, Exit):
            return None
        resume = msg.cuts
    sending = threading.Lock()
    held: list[Message] | None = []  # what the worker announced before the run (Go)

    def send(message: Message) -> None:
        with sending, contextlib.suppress(OSError):
            conn.send(message)

    def announce(message: Message) -> None:
        with sending:
            if held is not None:
                held.append(message)
                return
        send(message)

    try:
        worker = Worker(plan, rids, secret, kazoo=kazoo, resume=resume)
        if worker.kazoo is not None:
            # Its replicas contend from bind() on: a term won before the run starts is
            # announced as it starts.
            worker.kazoo.on_lead = lambda rid, epoch, since: announce(Leads(rid, epoch, since))
        if resume is not None:
            # Load the operators' state before the upstream replicas start replaying to
            # them (they are linked once this worker is ready).
            worker.restore(msg.t0_ns)

        def terminate(_signo, _frame) -> None:
            # A graceful stop: hand leadership over at once instead of after a session
            # timeout, then go.
            worker.release()
            os._exit(128 + signal.SIGTERM)

        if sigterm:
            signal.signal(signal.SIGTERM, terminate)
        conn.send(Ready(worker.bind(host)))
    except Exception as exc:  # a bind failure is a configuration problem
        conn.send(StartFailed(f"worker of {rids} could not start: {type(exc).__name__}: {exc}"))
        return None
    go = expect(recv("start signal"), Go, Exit, what="before the run")
    if isinstance(go, Exit):
        return None
    with sending:
        for message in held:
            with contextlib.suppress(OSError):
                conn.send(message)
        held = None

    folders: dict[Any, str] = {}  # cut token -> where the coordinator wants large states

    def send_cut(rid, taken, token) -> None:
        # A cut may carry a large state: write and send it from a thread of its own, so
        # the replicas this worker serves go on meanwhile. A large one goes to a file the
        # rebuilt replica reads, rather than through the coordinator.
        folder = folders.pop(token, None)

        def run() -> None:
            nonlocal taken
            if taken is not None and taken.writer is not None:
                # A child writes the state to the folder; a small one comes back inline.
                taken = taken.written(inline_below=SPILL_BYTES)
            elif taken is not None and folder is not None and len(taken.state) >= SPILL_BYTES:
                try:
                    taken = taken.spilled(folder)
                except OSError as exc:
                    log.warning("a cut's state goes inline: writing it failed (%s)", exc)
            send(CutTaken(rid, taken, token))

        threading.Thread(target=run, name="tandem-cut", daemon=True).start()

    def send_metrics(snapshot: dict) -> None:
        # Best effort, never waiting on the worker thread: skipped while a cut is sent.
        if sending.acquire(blocking=False):
            try:
                with contextlib.suppress(OSError):
                    conn.send(Metrics(snapshot))
            finally:
                sending.release()

    worker.on_cut = send_cut
    worker.state_folder = folders.get
    worker.on_metrics = send_metrics

    checkpoints: dict[int, str] = {}  # checkpoint epoch -> its folder

    def write_cut(folder, rid, taken, what: str, digest: bool = False):
        """Write ``rid``'s cut into ``folder`` (``digest``: with its SHA-256); the file's
        path, or None (nothing taken, no folder, or the write failed: logged, naming
        ``what``)."""
        if taken is None or folder is None:
            return None
        try:
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, "{}-{}-{}.state".format(*rid))
            return taken.checkpointed(path, digest=digest)
        except OSError as exc:
            log.warning("%s of %s not written: %s", what, rid, exc)
            return None

    def send_checkpoint(rid, epoch, taken) -> None:
        # Written off the worker thread, like a large cut: the replicas go on meanwhile.
        folder = checkpoints.get(epoch)

        def run() -> None:
            written = write_cut(folder, rid, taken, f"checkpoint {epoch}")
            send(Checkpointed(epoch, rid, written))

        threading.Thread(target=run, name="tandem-checkpoint", daemon=True).start()

    worker.on_checkpoint = send_checkpoint

    saving: list[threading.Thread] = []  # savepoint writers: done before Done is sent

    def send_savepoint(rid, epoch, taken) -> None:
        # As a checkpoint's: written off the worker thread, into the coordinator's folder
        # (on the worker thread, which keeps the folders of the savepoints asked of it).
        folder = worker.cuts.savepoint_folders.get(epoch)

        def run() -> None:
            # At the lowest priority: a large state's write and hash take a core only when
            # the replicas leave one (their twins serve the output meanwhile).
            thread_nice(CHILD_NICE)  # (Linux keeps a niceness per thread)
            # A large state's forked child first (SlotCuts.take): its file is moved.
            cut = taken.written() if taken is not None else None
            if taken is not None and cut is None:
                log.warning("the savepoint's cut of %s: its state's writer failed", rid)
            written = write_cut(folder, rid, cut, "the savepoint's cut", digest=True)
            send(Savepointed(epoch, rid, written))

        thread = threading.Thread(target=run, name="tandem-savepoint", daemon=True)
        thread.start()
        saving.append(thread)

    worker.on_savepoint = send_savepoint
    worker.on_link = lambda up, down, error: send(Linked(up, down, error))
    if rejoin:
        worker.on_started = lambda: send(Started())
        worker.caught_up_nice = base_nice
    if plan.restore:
        worker.on_evicted = lambda up, down: send(Evicted(up, down))
    worker.on_starved = lambda rid, why: send(Starved(rid, why))
    worker.on_rescale = lambda what, id, details: send(Rescaled(id, what, details))
    worker.on_failed = lambda failed: send(Failed(failed))
    threading.Thread(
        target=_requests,
        args=(conn, worker, folders, checkpoints),
        name="tandem-requests",
        daemon=True,
    ).start()
    if plan.rebuilds:
        period = plan.failure_timeout_ms / 4000

        def keepalive() -> None:
            while True:
                time.sleep(period)
                send(Alive(process_cpu_s() - cpu0))

        threading.Thread(target=keepalive, name="tandem-keepalive", daemon=True).start()
    reports = worker.run(go.addresses, go.t0_ns, go.duration, go.warmup)
    if worker.metrics_every is not None:
        send(Metrics(worker.metrics()))  # the final counters
    # The coordinator may stop this process once it has the reports: hand what the core
    # logged to logging first.
    logs.flush(1.0)
    for thread in saving:  # a savepoint's cuts reach the coordinator before Done
        thread.join(60.0)
    send(Done(reports if send_reports else None, failures(reports), process_cpu_s() - cpu0))
    return reports


def process_cpu_s() -> float:
    """CPU-seconds (user + system) this process has used, every thread."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _requests(
    conn,
    worker: Worker,
    folders: dict[Any, str],
    checkpoints: dict[int, str] | None = None,
) -> None:
    """Hand the coordinator's requests during the run to the worker thread (a cut's
    ``folders`` entry: where to write its state if it is large; a checkpoint's
    ``checkpoints`` entry: where its states go; a savepoint's folder goes with its
    request, kept by :meth:`tandem.runtime.cuts.SlotCuts.ask_savepoint`)."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if isinstance(msg, CutRequest):
            if msg.folder is not None:
                folders[msg.token] = msg.folder
            worker.request_cut(msg.twin, msg.token)
        elif isinstance(msg, Link):
            worker.link(msg.up, msg.down, msg.address, msg.epoch)
        elif isinstance(msg, Until):
            worker.extend(msg.until_ns, msg.final, msg.drain)
        elif isinstance(msg, MetricsEvery):
            worker.metrics_every = msg.every_s
        elif isinstance(msg, CheckpointRequest) and checkpoints is not None:
            checkpoints[msg.epoch] = msg.folder
            for old in sorted(checkpoints)[:-4]:  # answered long ago
                del checkpoints[old]
            worker.request_checkpoint(msg.epoch)
        elif isinstance(msg, SavepointRequest):
            worker.request_savepoint(
                msg.epoch, msg.replicas, msg.roll, msg.leaders_hold, msg.folder
            )
        elif isinstance(msg, TakeOver):
            worker.take_over(msg.rid)
        elif isinstance(msg, RescalePrepare):
            spec = RescaleSpec(msg.id, msg.task, msg.was, msg.now, msg.epoch)
            worker.rescale("prepare", spec)
        elif isinstance(msg, RescaleArm):
            worker.rescale("arm", msg.id, msg.addresses)
        elif isinstance(msg, RescaleCancel):
            worker.rescale("cancel", msg.id)
        elif isinstance(msg, Crash):
            crash(msg.unit)
        elif isinstance(msg, Freeze):
            freeze(msg.for_s)
        elif isinstance(msg, Exit):
            # Fenced: the coordinator gave up on this worker (its replicas are rebuilt
            # elsewhere, or again); it must never send another row.
            log.warning("fenced by the coordinator: %s", msg.why)
            logs.flush(1.0)
            os._exit(EXIT_FENCED)
        else:
            try:
                expect(
                    msg,
                    CutRequest,
                    Link,
                    Until,
                    MetricsEvery,
                    CheckpointRequest,
                    SavepointRequest,
                    TakeOver,
                    RescalePrepare,
                    RescaleArm,
                    RescaleCancel,
                    Exit,
                    Crash,
                    Freeze,
                )
            except ProtocolError as exc:  # a coordinator of another make: say so, go on
                log.error("from the coordinator: %s", exc)


def crash(unit: str) -> None:
    """A fault told to this worker (:class:`~tandem.engines.protocol.Crash`): SIGKILL this
    process — with ``unit="executor"`` the Spark executor JVM above it first (a node's
    crash, as far as Spark can tell)."""
    log.warning("fault: SIGKILL of this %s, as the coordinator asked", unit)
    logs.flush(0.2)
    if unit == "executor":
        import psutil

        with contextlib.suppress(psutil.Error):
            for parent in psutil.Process().parents()[:4]:
                if parent.name() == "java":
                    parent.kill()
                    break
    os.kill(os.getpid(), signal.SIGKILL)


def freeze(for_s: float) -> None:
    """A ``td.Pause`` told to this worker (:class:`~tandem.engines.protocol.Freeze`):
    SIGSTOP this process for ``for_s`` seconds; a child left behind (its own session,
    so nothing waits for it) sends the SIGCONT."""
    import subprocess

    subprocess.Popen(
        ["sh", "-c", f"sleep {float(for_s):.3f}; kill -CONT {os.getpid()}"],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.kill(os.getpid(), signal.SIGSTOP)


# -- the coordinator's side of rebuilding a lost worker -----------------------------------


def live_twins(
    plan: Plan, rids: Iterable[ReplicaId], down: set[ReplicaId]
) -> dict[ReplicaId, ReplicaId] | None:
    """The live twin each of ``rids`` is rebuilt from (the first one not ``down``), or
    None if one of them has none left."""
    twins: dict[ReplicaId, ReplicaId] = {}
    for rid in rids:
        t, p, r = rid
        live = [
            (t, p, q) for q in range(plan.tasks[t].replication) if q != r and (t, p, q) not in down
        ]
        if not live:
            return None
        twins[rid] = live[0]
    return twins


@dataclass
class Feeding:
    """Which inputs of a rebuilt worker's replicas a live upstream replica feeds, as the
    link requests of its rebuild are answered."""

    fed: dict[tuple[ReplicaId, tuple[int, int]], bool] = field(default_factory=dict)
    """(rebuilt replica, upstream partition) -> whether a live upstream replica feeds it."""
    asked: set[tuple[ReplicaId, ReplicaId]] = field(default_factory=set)
    """Link requests ``(upstream, rebuilt replica)`` not yet answered."""
    stale: bool = False
    """Some upstream replica's replay window no longer reached back to a cut."""

    def answered(self, up: ReplicaId, down: ReplicaId, error: str | None) -> bool:
        """``up`` answered the request to feed rebuilt ``down`` (``error``: why it could
        not); True once every request is answered. An answer to no open request (a late
        one, or a second) changes nothing and gives False."""
        if (up, down) not in self.asked:
            return False
        self.asked.discard((up, down))
        if error is None:
            self.fed[(down, up[:2])] = True
        else:
            self.stale |= "needs a later cut" in error
        return not self.asked

    def unfed(self) -> list[tuple[ReplicaId, tuple[int, int]]]:
        """The (rebuilt replica, upstream partition) pairs nothing feeds."""
        return [key for key, ok in self.fed.items() if not ok]


def rebuild_links(
    plan: Plan,
    ports: dict[ReplicaId, int | None],
    cuts: dict[ReplicaId, Resume],
    down: set[ReplicaId],
    local: Callable[[ReplicaId], bool],
) -> tuple[list[tuple[ReplicaId, ReplicaId, int]], dict[tuple[ReplicaId, tuple[int, int]], bool]]:
    """What feeds rebuilt replicas that listen at ``ports``, each resumed from its cut in
    ``cuts`` (none: from the beginning of the stream): the link requests ``(upstream, rebuilt,
    epoch)`` for every upstream replica of their input that is alive and not ``local``
    (in the rebuilt worker itself, which feeds it in memory), and for every (rebuilt
    replica, upstream partition) whether a ``local`` upstream replica is there."""
    epochs = {rid: cut.epoch for rid, cut in cuts.items()}
    links: list[tuple[ReplicaId, ReplicaId, int]] = []
    here: dict[tuple[ReplicaId, tuple[int, int]], bool] = {}
    for rid, port in ports.items():
        if port is None:
            continue
        t, p, _ = rid
        for ch in plan.input_channels(t, p):
            ups = [(ch.task, ch.partition, q) for q in range(plan.tasks[ch.task].replication)]
            here[(rid, (ch.task, ch.partition))] = any(local(up) for up in ups)
            links += [
                (up, rid, epochs.get(rid, 0)) for up in ups if up not in down and not local(up)
            ]
    return links, here


def restored_entry(
    plan: Plan,
    rid: ReplicaId,
    twin: ReplicaId | None,
    cut: Resume | None,
    lost_s: float,
    now_s: float,
    warm: bool,
    **extra,
) -> dict:
    """What ``Result.restored_replicas`` records of ``rid``, rebuilt from ``twin``'s
    ``cut``, lost at ``lost_s`` and receiving its input again at ``now_s``."""
    t, p, r = rid
    return {
        "task": plan.tasks[t].name,
        "partition": p,
        "replica": r,
        "twin": twin[2] if twin is not None else None,
        **extra,
        "epoch": cut.epoch if cut is not None else 0,
        "lost_s": round(lost_s, 3),
        "restored_s": round(now_s, 3),
        "restore_ms": round((now_s - lost_s) * 1000, 1),
        "warm": warm,
        "state_file": cut is not None and cut.state_file is not None,
        "forked_with": cut.forked_with if cut is not None else 0,
    }


__all__ = [
    "EXIT_FENCED",
    "REJOIN_ATTEMPTS",
    "REJOIN_MARGIN_S",
    "REJOIN_TIMEOUT_S",
    "SPILL_BYTES",
    "Feeding",
    "live_twins",
    "rebuild_links",
    "restored_entry",
    "serve",
]
