"""Workers and the replicas they host: what runs on every engine.

A **worker** is one OS process — the fault domain — hosting many task replicas ("slots")
and serving them all from one Python thread. The control path is in Rust
(``tandem._core.Worker``): it sleeps on every inbox of the worker at once, tracks each
slot's watermark, forwards heartbeats, sends the sources' heartbeats when they fall due
and keeps back-pressure from blocking one slot on another, all without the GIL. Python is
woken only to run operator code on a data batch, an ``on_watermark`` that may emit, a
sink write, or a source's next batch of rows.

An engine (``tandem.engines.local`` runs a handful of worker processes; the Spark engine
runs each worker as a long-running Spark task) drives a worker through three steps:

1. :meth:`Worker.bind` — create every hosted replica's inbox (operators and sinks) and
   return the port each one's upstream replicas must dial;
2. :meth:`Worker.run` — given every inbox address of the job, the logical time origin
   ``t0_ns`` and the warm-up the sinks leave out of their latency record
   (:mod:`tandem.latency`), dial the downstream replicas and run to the end of input;
3. the returned :class:`ReplicaReport` s (one per hosted replica) go back to the engine.

The replicas follow the forwarding contract of :mod:`tandem.plan`, the same one the
reference executor follows, so that with LiveRobin every operator replica consumes the
reference's row sequence: heartbeats move a per-channel watermark; when the minimum over
the channels advances to ``k``, the operator's ``on_watermark`` output is emitted, then
heartbeat ``k`` is forwarded on every output channel.

Batches are the unit of determinism (DESIGN §2 invariant 1): a source emits exactly the
batches of :meth:`tandem.plan.Plan.source_schedule`, each when it falls due (a source that
reads a log, Kafka, those of :meth:`tandem.plan.Plan.log_schedule`, each once its closing
record has been read: see :class:`_LogSource`); an operator
is called once per input batch and its output leaves at once, as one frame per output
channel (the Rust outbox has no timer). The Rust outbox digests every channel's frames per
heartbeat cycle and sends the digest inside the heartbeat; every receiver compares the
copies it gets from the replicas of an upstream partition, and a mismatch fails the job
with :class:`tandem.DeterminismError` unless the job says ``on_divergence="log"``
(invariant 4). The digests also come back in the report, for the engine's comparison.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import pyarrow as pa

from tandem import _core
from tandem.exceptions import ConfigError, DeterminismError, TandemError, TaskFailed
from tandem.heartbeat import LogStep
from tandem.latency import LatencyRecorder, SinkLatency
from tandem.operators import Operator
from tandem.ordering.kazoo import KazooRun, KazooSession, Orderer
from tandem.plan import OutputEdge, Plan, SourceStep, Task

log = logging.getLogger("tandem")

ReplicaId = tuple[int, int, int]  # task id, partition, replica
Addresses = dict[ReplicaId, tuple[str, int]]

IDLE_WAIT_S = 0.05
"""How long a worker waits for input before checking on its KaZoo orderers again."""

LOG_POSITIONS_KEPT = 1024
"""Heartbeats a log source remembers the log position of, for cuts (one is asked for at a
time, and taken as the next heartbeat leaves)."""

CREDIT_POLL_S = 0.001
"""How soon a worker looks again at a source whose downstream links are backed up."""

METRICS_EVERY_S = 1.0
"""How often a worker hands :attr:`Worker.on_metrics` a snapshot, when the engine asks for
them (:mod:`tandem.metrics`)."""
#: How long a child writing a cut's state may take (:meth:`Resume.written`).
WRITER_TIMEOUT_S = 60.0
#: Whether a rebuild's cut snapshots the operator's state in a forked child
#: (:meth:`Replica.forks`, :func:`fork_cuts`): Linux only, where fork is cheap and the usual start.
FORK_CUTS = sys.platform == "linux"
#: Added to the niceness of a rebuilt worker's thread while it loads its states and
#: catches up (:attr:`Worker.caught_up_nice`).
CATCH_UP_NICE = 10
#: How long a slot cut for a rebuild waits, held, for the other slots of its worker asked
#: for in the same rebuild, so that one fork writes every state (:meth:`Worker._cut`).
HOLD_CUTS_S = 0.02
#: The niceness of a child writing a cut's state (``os.nice``; 0: its parent's).
CHILD_NICE = 19
#: A rebuild's cut of a state known to be at most this large (``Operator.state_size``)
#: is snapshotted in place rather than in a forked child: the fork of a worker costs it
#: 3.5-4 ms here (its page tables, whatever the state), then copy-on-write faults while
#: the child lives, where copying 2 MiB of arrays takes well under a millisecond.
INLINE_CUT_BYTES = 2 << 20


class CutWriter:
    """A forked child writing the states of one or more cuts (:func:`fork_cuts`): waited
    for once, by whichever of its cuts is sent first; the others read the same outcome."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._lock = threading.Lock()
        self._code: int | None = None

    def wait(self, timeout: float = WRITER_TIMEOUT_S) -> int:
        """The child's exit code (killed, and not 0, after ``timeout``)."""
        with self._lock:
            if self._code is None:
                self._code = self._reap(timeout)
            return self._code

    def _reap(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            if time.monotonic() > deadline:
                with contextlib.suppress(OSError):
                    os.kill(self.pid, 9)
                os.waitpid(self.pid, 0)
                log.warning("writing a cut's state took over %g s: abandoned", timeout)
                return -9
            time.sleep(0.002)

    def __repr__(self) -> str:
        return f"CutWriter(pid={self.pid}, exit={self._code})"


@dataclass
class ReplicaReport:
    """What one replica reports to its engine when it finishes."""

    task: int
    partition: int
    replica: int
    kind: str
    rows_in: int = 0
    rows_out: int = 0
    digests: dict[tuple[int, int, int], str] = field(default_factory=dict)
    """``(output edge, channel, heartbeat epoch)`` → the digest (hex) of the frames the
    replica sent on that channel in that cycle (epoch ``2**64 - 1``: after the last
    heartbeat)."""
    sink_part: object = None
    first_receive_ns: int | None = None
    """Sinks: the wall clock when the first row arrived."""
    latency: SinkLatency | None = None
    """Sinks whose rows carry ``event_time_ns``: latency histograms and output times per
    second (:mod:`tandem.latency`; its size grows with the run's length, not its rows)."""
    inbox_stats: dict | None = None
    log_stats: dict | None = None
    """Log sources: the data rows read, the heartbeat markers taken and ignored."""
    ordering_stats: dict | None = None
    """KaZoo partitions: the epochs this replica led, orders published and followed."""
    error: str | None = None
    diverged: bool = False
    """True when ``error`` is a divergence this replica detected in its input (the job
    fails with :class:`tandem.DeterminismError` rather than ``TaskFailed``)."""
    abandoned: str | None = None
    """Set when every downstream replica had already finished (its twin got there first):
    the replica's remaining output was needed by nobody, so it stopped early."""

    def failure(self) -> TandemError | None:
        """The exception the run fails with because of this replica, if any."""
        if self.error is None:
            return None
        return DeterminismError(self.error) if self.diverged else TaskFailed(self.error)


@dataclass(frozen=True)
class Resume:
    """What a replica rebuilt while the job runs starts from, taken from a live twin at a
    heartbeat-cycle boundary (DESIGN §4): ``cut``, the core's part (the heartbeat epoch,
    input positions and merge state, output seqs; opaque here) and ``state``, the
    operator's :meth:`~tandem.operators.Operator.snapshot`. A large state travels as a
    file instead (``state_file``, written by the twin's worker, read once and removed by
    the rebuilt replica's): it then crosses no process but the two that need it. A
    checkpoint's state file (``Job(checkpoint_ms=...)``) belongs to the checkpoint
    (``keep_file``): read, never removed by the replica. ``writer``: the child process
    still writing ``state_file`` (:func:`fork_cuts`); wait for it with :meth:`written`
    before the cut goes anywhere."""

    cut: tuple
    state: bytes
    state_file: str | None = None
    keep_file: bool = False
    writer: CutWriter | None = None
    forked_with: int = 0
    """How many states the forked child that wrote this one wrote in all (one fork for
    every cut of a rebuild in a worker: :func:`fork_cuts`); 0: not written by a child."""

    def written(self, inline_below: int = 0, timeout: float = WRITER_TIMEOUT_S) -> Resume | None:
        """Wait for the child writing the state file; this cut without it — a state under
        ``inline_below`` bytes read back into the cut and its file removed — or None if
        the child failed (or took longer than ``timeout``: it is killed): the caller then
        reports the cut as not taken and a later one is tried."""
        if self.writer is None:
            return self
        code = self.writer.wait(timeout)
        path = self.state_file
        if code != 0 or path is None:
            if path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            return None
        if os.path.getsize(path) < inline_below:
            with open(path, "rb") as f:
                state = f.read()
            os.unlink(path)
            return Resume(self.cut, state, forked_with=self.forked_with)
        return Resume(self.cut, b"", path, self.keep_file, forked_with=self.forked_with)

    @property
    def epoch(self) -> int:
        """The heartbeat after which the rebuilt replica takes over."""
        return self.cut[0]

    @property
    def order_log_offset(self) -> int | None:
        """KaZoo: the order log offset the twin had read through at the cut (None for the
        other orders); the rebuilt replica's reader may start there or before."""
        inbox = self.cut[2]
        log = inbox[5] if inbox is not None else None
        return log[3] if log is not None else None

    def spilled(self, folder: str) -> Resume:
        """This cut with its state written to a new file in ``folder``, for the rebuilt
        replica to read and remove."""
        fd, path = tempfile.mkstemp(dir=folder, suffix=".state")
        os.close(fd)
        try:
            return self._to_file(path, keep=False)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise

    def checkpointed(self, path: str) -> Resume:
        """This cut with its state written to ``path``, a checkpoint's file, which stays."""
        return self._to_file(path, keep=True)

    def _to_file(self, path: str, keep: bool) -> Resume:
        # Written whole under a temporary name first: a file that exists is complete.
        part = path + ".part"
        try:
            with open(part, "wb") as f:
                f.write(self.state)
            os.replace(part, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(part)
            raise
        return Resume(self.cut, b"", path, keep_file=keep)

    def load(self) -> bytes:
        """The state: in the message, or read from its file."""
        if self.state_file is None:
            return self.state
        with open(self.state_file, "rb") as f:
            return f.read()


def _warm_up() -> None:
    """Pay pyarrow's lazy imports now, while the job starts, not on the first batch after
    t0: building any array loads pyarrow's pandas shim, which imports pandas when it is
    installed (pyspark brings it) — about a CPU-second per process, enough for a job's
    replica processes to stall the first seconds of the stream on a small machine."""
    pa.array([0])


class _Output:
    """One output edge of a replica: an outbox towards every replica of the downstream
    partitions (it numbers, frames, digests and sends; nothing waits in it). A downstream
    replica in ``local`` (same worker) gets the Arrow batches in memory; the others are
    dialled at their address."""

    def __init__(
        self,
        plan: Plan,
        me: ReplicaId,
        edge: OutputEdge,
        addresses: Addresses,
        secret: bytes,
        local: dict[ReplicaId, _core.Inbox],
        name: str | None = None,
    ) -> None:
        down = plan.tasks[edge.downstream]
        self.peers: dict[str, ReplicaId] = {
            "{}:{}".format(*addresses[rid]): rid
            for rid in ((down.id, p, r) for p in edge.partitions for r in range(down.replication))
            if rid not in local and rid in addresses
        }
        """Where each remote downstream replica listens (``host:port``), to name the ones
        the outbox drops as stragglers."""
        targets = [
            [
                local.get((down.id, p, r)) or addresses[(down.id, p, r)]
                for r in range(down.replication)
            ]
            for p in edge.partitions
        ]
        # One downstream partition: every row goes to it, whatever the edge's partitioner.
        single = len(edge.partitions) == 1
        partitioner = "forward" if single else edge.partitioner
        self.outbox = _core.Outbox(
            plan.job,
            secret,
            me,
            targets,
            partitioner=partitioner,
            key=None if single else edge.key,
            batch_rows=plan.batch_rows,
            name=name,
            evict_after_ms=plan.evict_after_ms,
            replay_cycles=plan.replay_cycles,
            # While a downstream replica is down for a rollback or a sink restart, what it
            # would get goes on into the replay window.
            hold_orphans=plan.checkpointing or plan.restarts_sink(down.id),
        )
        self.edge = edge

    def emit(self, batch: pa.RecordBatch | None) -> int:
        if batch is None or batch.num_rows == 0:
            return 0
        self.outbox.emit(batch)
        return batch.num_rows

    def heartbeat(self, epoch: int) -> None:
        self.outbox.heartbeat(epoch)


class Replica:
    """One replica of one task partition, hosted by a :class:`Worker` (see the module
    documentation). The worker calls the ``on_*`` methods; each runs to completion, its
    output emitted, before the worker asks Rust for the next work item."""

    def __init__(
        self,
        plan: Plan,
        task_id: int,
        partition: int,
        replica: int,
        secret: bytes,
        core: _core.Worker,
        kazoo: KazooSession | None = None,
    ):
        self.plan = plan
        self.task: Task = plan.tasks[task_id]
        self.me: ReplicaId = (task_id, partition, replica)
        self.secret = secret
        self.core = core
        self.kazoo = kazoo
        self.orderer: Orderer | None = None
        self.inbox = None
        self.inputs = []
        self._conform = []
        self.outputs: list[_Output] = []
        self.report = ReplicaReport(task_id, partition, replica, self.task.kind)
        self.slot: int | None = None
        self.done = False
        self.t0_ns = 0
        self._inst = None
        self._sink = None
        self._latency: LatencyRecorder | None = None
        self.resume: Resume | None = None
        """Set by the worker before :meth:`bind` when this replica is rebuilt from a twin."""
        self.log_reader = None
        self.log_positions: OrderedDict[int, tuple[int, int]] = OrderedDict()
        """A log source's latest heartbeats sent: epoch → (next offset, data rows read)."""

    @property
    def name(self) -> str:
        _, p, r = self.me
        return f"{self.task.kind} task {self.task.name!r} partition {p} replica {r}"

    def bind(self, host: str = "127.0.0.1") -> int | None:
        """Listen for upstream replicas; the port, or None for a source (a log source
        starts reading its partition now, while the job starts)."""
        if self.task.kind == "source":
            t, p, _ = self.me
            if self.plan.is_log_source(t):
                offset = self.log_resume()[1] if self.resume is not None else None
                self.log_reader = self.task.source.reader(
                    p, self.core.wake, name=self.name, offset=offset
                )
                self.log_reader.start()
            return None
        t, p, r = self.me
        self.inputs = self.plan.input_channels(t, p)
        self._conform = [self.plan.input_conformer(t, c) for c in self.inputs]
        ordering = self.plan.inbox_ordering(t, p)
        resume = self.resume.cut[2] if self.resume is not None else None
        self.inbox = _core.Inbox(
            self.plan.job,
            self.secret,
            [(c.task, c.partition) for c in self.inputs],
            ordering=ordering,
            on_divergence=self.plan.on_divergence,
            host=host,
            worker=self.core,
            me=self.me,
            name=self.name,
            resume=resume,
            wait_orphaned=self.plan.checkpointing,
        )
        if ordering == "kazoo":
            if self.kazoo is None:
                raise ConfigError(
                    f"{self.name} orders its input with KaZoo, but the engine gave it no "
                    "KazooRun (tandem.ordering.kazoo.prepare)"
                )
            # Contend from the start of the job (the worker starts the session and the
            # election), not when the first row comes.
            self.orderer = Orderer(self.kazoo, t, p, r, self.inbox.order_feed())
        return self.inbox.port

    # -- lifecycle --------------------------------------------------------------------

    def start(
        self,
        addresses: Addresses,
        t0_ns: int,
        local: dict[ReplicaId, _core.Inbox],
        warmup: float = 0.0,
    ) -> None:
        """Link the downstream replicas (``local``: the inboxes of this worker), open the
        operator or sink, take a worker slot. A sink leaves the rows it receives in the
        first ``warmup`` seconds after ``t0_ns`` out of its latency record."""
        t, p, r = self.me
        self.t0_ns = t0_ns
        self.outputs += [
            _Output(self.plan, self.me, e, addresses, self.secret, local, self.name)
            for e in self.plan.output_edges(t, p)
        ]
        boxes = [o.outbox for o in self.outputs]
        cut = self.resume.cut if self.resume is not None else None
        if self.task.kind == "source":
            self.slot = self.core.add_source(boxes, t0_ns, self.plan.heartbeat_ns, resume=cut)
            return
        if self.task.kind == "operator":
            if self._inst is None:
                self._inst = self.plan.instantiate(t, p, replica=r, t0_ns=t0_ns)
            watermarks = type(self._inst.op).on_watermark is not Operator.on_watermark
        else:
            self._sink = self.plan.open_sink(t, p, run=t0_ns)
            if self.resume is not None:  # restarted from what the lost sink committed
                self.report.rows_in = self._sink.restore(self.resume.load())
            schema = self.task.schema
            if schema is not None and "event_time_ns" in schema.names:
                self._latency = LatencyRecorder(t0_ns, t0_ns + round(warmup * 1e9))
            watermarks = False
        self.slot = self.core.add_task(self.inbox, boxes, watermarks, resume=cut)
        if self._sink is not None and self._sink.keep_positions:
            self.core.request_cut(self.slot)  # see mark()

    def mark(self, cut: tuple | None) -> None:
        """A sink that keeps its positions, cut at a heartbeat-cycle boundary: the rows
        written so far are its input through ``cut`` (:meth:`tandem.sinks.Sink.mark`);
        cut again at the next boundary (None: the slot is going, no more cuts)."""
        if cut is None or self._sink is None:
            return
        self._sink.mark(cut)
        self.core.request_cut(self.slot)

    def restore(self, t0_ns: int) -> None:
        """A rebuilt operator replica: create the operator and load the twin's state into it
        now (before ``start``), so that it is ready when its input is replayed."""
        if self.resume is None or self.task.kind != "operator":
            return
        t, p, r = self.me
        self._inst = self.plan.instantiate(t, p, replica=r, t0_ns=t0_ns)
        self._inst.restore(self.resume.load())
        if self.resume.state_file is not None and not self.resume.keep_file:
            # Read once: the memory is the operator's now (a checkpoint's file stays).
            with contextlib.suppress(OSError):
                os.unlink(self.resume.state_file)
        self.resume = Resume(self.resume.cut, b"")  # the state lives in the operator now

    def cut(self, cut: tuple | None) -> Resume | None:
        """This replica at the heartbeat-cycle boundary the worker stopped it at (``cut``,
        from the core; None: it cannot be cut): what a replica rebuilt from it needs. A log
        source's state is where its log continues after the marker it took as that
        heartbeat, and the data rows it read before it."""
        if cut is None:
            return None
        if self.log_reader is not None:
            position = self.log_positions.get(cut[0])
            if position is None:  # not a heartbeat it sent lately: try a later cut
                return None
            return Resume(cut, json.dumps(position).encode())
        state = self._inst.snapshot() if self._inst is not None else b""
        return Resume(cut, state)

    def forks(self, cut: tuple | None) -> bool:
        """Whether a rebuild's cut ``cut`` of this replica should have its operator's state
        snapshotted and written by a forked child (:func:`fork_cuts`): the child sees the
        state as it is at the cut (copy-on-write), and this replica goes on at once instead
        of pausing for the snapshot's copy (about 120 ms for 100 MiB here; a fork of such
        a worker 3.5-9 ms, growing with the process, not the state). Not for a replica
        with no operator state to speak of, or a state known to be small
        (``Operator.state_size`` at most :data:`INLINE_CUT_BYTES`): :meth:`cut` copies
        those in place."""
        if cut is None or self._inst is None or self.log_reader is not None or not FORK_CUTS:
            return False
        try:
            size = self._inst.state_size()
        except Exception:  # a hint, not the snapshot: unknown then
            log.debug("%s: state_size() failed; the cut forks", self.name, exc_info=True)
            size = None
        return size is None or size > INLINE_CUT_BYTES

    def cut_in_child(self, cut: tuple | None, folder: str) -> Resume | None:
        """:meth:`cut`, the operator's state written to a new file in ``folder`` by a
        forked child where :meth:`forks` says so (the returned cut's ``writer``: see
        :meth:`Resume.written`)."""
        if not self.forks(cut):
            return self.cut(cut)
        return fork_cuts([(self, cut, folder)])[0]

    def log_resume(self) -> tuple[int, int, int]:
        """A rebuilt log source's ``(heartbeat, next offset, data rows before it)``."""
        offset, rows = json.loads(self.resume.load())
        return self.resume.epoch, offset, rows

    def evicted(self) -> list[ReplicaId]:
        """The downstream replicas this replica's outboxes dropped as stragglers since the
        last call."""
        found = []
        for o in self.outputs:
            for _, peer in o.outbox.take_evicted():
                if peer in o.peers:
                    found.append(o.peers[peer])
        return found

    def output_to(self, down: ReplicaId) -> tuple[_Output, int]:
        """The output edge towards downstream replica ``down``, and the channel of its
        partition."""
        task, part, _ = down
        for o in self.outputs:
            if o.edge.downstream == task and part in o.edge.partitions:
                return o, o.edge.partitions.index(part)
        raise ConfigError(f"{self.name} has no output to {self.plan.tasks[task].name}[{part}]")

    def attach(
        self, down: ReplicaId, link: _core.DialedLink, address: tuple[str, int], after_epoch: int
    ) -> None:
        """Send the output meant for ``down``, a downstream replica rebuilt from a twin cut
        at heartbeat ``after_epoch``, to its new ``address`` too — the replay window's
        cycles after the cut first — over ``link``, dialled already (``Outbox.dial``, on
        any thread: :meth:`Worker.link`)."""
        output, channel = self.output_to(down)
        output.outbox.attach(channel, link, after_epoch)
        output.peers["{}:{}".format(*address)] = down

    def _emit(self, batch: pa.RecordBatch | None) -> None:
        for o in self.outputs:
            self.report.rows_out += o.emit(batch)

    def on_rows(self, batch: pa.RecordBatch) -> None:
        """A source's next batch of rows."""
        self.report.rows_in += batch.num_rows
        self._emit(batch)

    def on_data(self, channel: int, batch: pa.RecordBatch) -> None:
        self.report.rows_in += batch.num_rows
        conform = self._conform[channel]
        if conform is not None:  # a union's input with a stricter nullability
            batch = conform(batch)
        if self._inst is not None:
            self._emit(self._inst.batch(batch, self.inputs[channel].input_index))
            return
        now = time.time_ns()
        self._sink.write(batch)
        if self.report.first_receive_ns is None:
            self.report.first_receive_ns = now
        if self._latency is not None:
            self._latency.record(now, batch.column("event_time_ns").to_numpy(zero_copy_only=False))

    def on_watermark(self, epoch: int) -> None:
        self._emit(self._inst.watermark(self.plan.watermark_ns(epoch, self.t0_ns)))

    def on_end(self) -> None:
        """Every input ended (sources: the schedule did): final output, end markers."""
        if self._inst is not None:
            self._emit(self._inst.finish())
        if self._sink is not None:
            self.report.sink_part = self._sink.close()
            self._sink = None
            if self._latency is not None:
                self.report.latency = self._latency.finish()
        for o in self.outputs:
            o.outbox.end()
        self.done = True

    def fail(self, exc: BaseException) -> None:
        """Record why this replica stopped (see :class:`ReplicaReport`)."""
        self.done = True
        if isinstance(exc, _core.ChannelClosed):
            # No live downstream replica is left on some output channel. Downstream only
            # closes once it has received everything (from a faster twin of this replica);
            # had they all crashed instead, the engine fails the job for that reason.
            self.report.abandoned = str(exc)
        elif isinstance(exc, DeterminismError):
            self.report.error, self.report.diverged = self._divergence(exc), True
        else:
            self.report.error = f"{self.name} failed: {type(exc).__name__}: {exc}\n" + "".join(
                traceback.format_exception(exc)
            )

    def finish(self) -> ReplicaReport:
        """Close everything; the report (call once, when the worker is done)."""
        report = self.report
        if self.log_reader is not None:
            self.log_reader.stop()
        for i, o in enumerate(self.outputs):
            for channel, epoch, digest in o.outbox.digests():  # before close: it drains
                report.digests[(i, channel, epoch)] = digest.hex()
            o.outbox.close()
        if self.orderer is not None:
            self.orderer.stop()
            report.ordering_stats = self.orderer.stats()
        if self.inbox is not None:
            report.inbox_stats = self.inbox.stats()
            self.inbox.close()
        return report

    def metrics(self, slots: list[dict], now_ns: int) -> dict:
        """This replica's counters for the metrics endpoint (:mod:`tandem.metrics`): what
        its report, its inbox, its slot in the core, its sink's latency record and its KaZoo
        orderer keep anyway; nothing is counted per row for it."""
        rep = self.report
        m: dict = {"rows_in": rep.rows_in, "rows_out": rep.rows_out, "active": not self.done}
        if self.slot is not None and self.slot < len(slots):
            s = slots[self.slot]
            m["active"] = m["active"] and s["active"]
            m["backlog"] = s["backlog"]
            watermark_ns = self.t0_ns + s["watermark"] * self.plan.heartbeat_ns
            m["heartbeat_lag_s"] = max(0.0, (now_ns - watermark_ns) / 1e9)
        stats = rep.inbox_stats
        if stats is None and self.inbox is not None:
            try:
                stats = self.inbox.stats()
            except _core.ChannelClosed:
                stats = None
        if stats is not None:
            channels = stats["channels"]
            m["dedup_dropped"] = sum(c["duplicate_rows"] for c in channels)
            m["queued"] = sum(c["queued_seqs"] for c in channels)
            m["merge_wait_s"] = stats["merge_wait_s"]
            m["divergences"] = stats["divergence_count"]
        if self._latency is not None:
            self._latency.flush()
            m["latency"] = (self._latency.buckets.tolist(), self._latency.sum_ns)
        if self.orderer is not None:
            m["kazoo"] = (self.orderer.leading(), self.orderer.feed.stats()["epoch"])
        return m

    def _divergence(self, exc: DeterminismError) -> str:
        """The message of a divergence this replica saw in its input, with task names."""
        stats = self.inbox.stats() if self.inbox is not None else {}
        found = stats.get("divergences") or []
        if not found:
            return f"{self.name}: {exc}"
        d = found[0]
        up_task, up_part = d["upstream"]
        a, b = d["replicas"]
        _, p, r = self.me
        return (
            f"{self.plan.tasks[up_task].describe()} partition {up_part}: replicas {a} and {b} "
            f"sent different output to {self.task.name!r}[{p}] in heartbeat cycle "
            f"{d['epoch']} (digests {d['digests'][0]} and {d['digests'][1]}; seen by its "
            f"replica {r}). An operator function must be deterministic for a given input "
            "batch; the sinks may already hold a mix of both replicas' rows, so the job "
            "stops. td.Job(on_divergence='log') keeps it running."
        )


class _Source:
    """A source replica's place in its logical schedule (:meth:`Plan.source_schedule`).

    Python emits the rows, each batch when it falls due; the Rust worker sends the
    heartbeats on its clock, through the last one before the next batch still to be
    emitted, so no heartbeat overtakes a row that precedes it in the schedule.

    A run with no duration (``duration=None``) follows the schedule with no end, but only
    through the source time the engine allowed (:meth:`extend`; nothing before it says):
    a step due later waits. When the engine says where the run stops (``final``, never
    before anything it allowed), the replica goes on with the schedule of a run of exactly
    that length, after the steps it has taken — the same steps, then its end (see
    :meth:`Plan.source_schedule`). Every replica of every source thus ends at the same
    place, wherever it was when it was told."""

    def __init__(self, replica: Replica, duration: float | None) -> None:
        self.replica = replica
        t, p, _ = replica.me
        self._steps = iter(replica.plan.source_schedule(t, p, duration))
        self._next: SourceStep | None = None  # pulled from the schedule, not taken yet
        self.taken = 0  # steps taken from the schedule
        self.until_ns: int | None = None if duration is not None else 0
        """Unbounded: steps due after this offset from t0 wait (None: no limit)."""
        self.final = duration is not None
        self.heartbeat = 0  # the last heartbeat epoch before the pending step
        self.step = None
        if replica.resume is not None:  # rebuilt: the twin emitted everything through it
            self.heartbeat = replica.resume.epoch
            while (step := self._take(gated=False)) is not None:
                if step.kind == "heartbeat" and step.epoch >= self.heartbeat:
                    break
        self.advance()

    def _take(self, gated: bool = True) -> SourceStep | None:
        """The next step of the schedule, or None: the schedule ended, or (``gated``) its
        next step is due after what the engine allowed so far."""
        if self._next is None:
            self._next = next(self._steps, None)
        step = self._next
        if step is None or (gated and self.until_ns is not None and step.at_ns > self.until_ns):
            return None
        self._next = None
        self.taken += 1
        return step

    def advance(self) -> None:
        """Move to the next rows (or end) step, letting the worker send the heartbeats
        before it."""
        while (step := self._take()) is not None:
            if step.kind == "heartbeat":
                self.heartbeat = step.epoch
                continue
            self.step = step
            self.replica.core.allow(self.replica.slot, self.heartbeat)
            return
        self.step = None
        if not self.final:  # waiting for the engine: its heartbeats so far may go
            self.replica.core.allow(self.replica.slot, self.heartbeat)

    def extend(self, until_ns: int, final: bool) -> None:
        """The engine's word in a run with no duration: steps due through ``until_ns``
        (ns after t0) may go; ``final``: the run stops there."""
        if self.final or self.replica.done:
            return
        if final:
            t, p, _ = self.replica.me
            schedule = self.replica.plan.source_schedule(t, p, until_ns / 1e9)
            self._steps = itertools.islice(schedule, self.taken, None)
            self._next, self.until_ns, self.final = None, None, True
        else:
            self.until_ns = max(self.until_ns, until_ns)
        if self.step is None:
            self.advance()

    def due_ns(self) -> int:
        return self.replica.t0_ns + self.step.at_ns

    def run_step(self) -> None:
        """Emit the pending step (its heartbeats first), then move on."""
        rep, step = self.replica, self.step
        rep.core.heartbeats_through(rep.slot, self.heartbeat)
        if step.kind == "rows":
            t, p, _ = rep.me
            rep.on_rows(rep.plan.source_batch(t, p, step.j0, step.j1, rep.t0_ns))
            self.advance()
        else:
            rep.on_end()
            self.step = None


class _LogSource:
    """A log source replica (:class:`tandem.sources.LogSource`, e.g. Kafka) and its place
    in the log (:meth:`Plan.log_schedule`).

    A thread reads the partition (:attr:`Replica.log_reader`, started at bind) and wakes the
    worker when records came; the worker cuts them into the schedule's steps and emits each
    as soon as it is complete — a batch once the record that closes it (a heartbeat marker,
    or its ``batch_rows``-th row) has been read, a heartbeat with ``heartbeats_through``
    (every epoch not sent yet through it, one apiece: markers taken may skip epochs,
    :func:`tandem.reference.log_entries`), then the end. The slot's Rust clock never sends a
    heartbeat of its own: it may send only through the epoch it was allowed, and
    ``heartbeats_through`` allows exactly what it sends. Nothing is emitted before ``t0``. A
    replica rebuilt from a twin's cut at heartbeat ``k`` (``Job(restore=True)``) reads from
    the record after the marker the twin took as ``k``, its schedule resumed there: the
    schedule is a function of the log, so it emits what the twin emits after ``k``.

    A run with no duration reads on until the engine says where it stops: a heartbeat
    through the epoch the engine allowed goes out as it comes; a later one waits
    (:meth:`extend`). Once the engine says the run stops at epoch ``K`` (``final``, never
    before anything it allowed), the first marker taken at or after ``K`` is the last
    heartbeat, and the end follows it — what a run of that duration does."""

    def __init__(self, replica: Replica, duration: float | None) -> None:
        self.replica = replica
        t, p, _ = replica.me
        self.partition = p
        self.until_epoch: int | None = None if duration is not None else 0
        """Unbounded: a heartbeat at or after this epoch waits (or, ``final``, ends the
        run); None: the schedule ends the run by itself."""
        self.final = duration is not None
        self.source = replica.task.source
        resume = None
        if replica.resume is not None:  # rebuilt: its reader starts after the cut's marker
            epoch, _, rows = replica.log_resume()
            resume = (epoch, rows)
            replica.report.rows_in = rows
        self.schedule = replica.plan.log_schedule(t, p, duration, replica.t0_ns, resume)
        self.steps: deque = deque(self.schedule.feed(()))  # resumed at its end: the end

    def pump(self, now_ns: int) -> float | None:
        """Emit the steps ready to go; how soon to look again without being woken (None:
        when the reader wakes the worker)."""
        rep = self.replica
        if now_ns < rep.t0_ns:
            return (rep.t0_ns - now_ns) / 1e9
        reader = rep.log_reader
        if reader.error is not None:
            raise reader.error
        records = reader.take()
        if records:
            self.steps.extend(self.schedule.feed(records))
        core, slot = rep.core, rep.slot
        while self.steps:
            if not core.ready(slot):
                return CREDIT_POLL_S  # its links are backed up: look again soon
            step = self.steps[0]
            if (
                step.kind == "heartbeat"
                and self.until_epoch is not None
                and step.epoch >= self.until_epoch
            ):
                if not self.final:
                    return None  # the engine's next word wakes the worker
                # The run's last heartbeat: the end follows, nothing after it is read.
                self.steps = deque([step, LogStep("end")])
                self.schedule.ended, self.schedule.rows = True, step.rows
                self.until_epoch = None
            step = self.steps.popleft()
            if step.kind == "rows":
                rep.on_rows(self.source.decode(self.partition, step.records))
            elif step.kind == "heartbeat":
                # Where a replica rebuilt from a cut at this heartbeat would resume (the
                # core takes a cut asked for as the heartbeat leaves).
                positions = rep.log_positions
                positions[step.epoch] = (self.source.next_offset(step.records[0]), step.rows)
                if len(positions) > LOG_POSITIONS_KEPT:
                    positions.popitem(last=False)
                core.heartbeats_through(slot, step.epoch)
            else:
                rep.on_end()
                reader.stop(timeout=0)
                self._report()
                return None
        return None

    def extend(self, until_ns: int, final: bool) -> None:
        """The engine's word in a run with no duration: heartbeats through the epoch of
        ``until_ns`` (ns after t0) may go; ``final``: the run stops at that epoch."""
        if self.final or self.replica.done:
            return
        epoch = self.replica.plan.last_epoch(until_ns / 1e9)
        self.until_epoch = epoch if final else max(self.until_epoch, epoch)
        self.final = final

    def _report(self) -> None:
        s = self.schedule
        self.replica.report.log_stats = {
            "rows": s.rows,
            "markers_taken": s.markers_taken,
            "markers_ignored": s.markers_ignored,
        }


def may_raise_priority() -> bool:
    """Whether this process may give a thread back a priority it lowered (``nice``):
    root (``CAP_SYS_NICE``), or an ``RLIMIT_NICE`` that allows the process's niceness."""
    if not hasattr(os, "getpriority"):
        return False
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NICE)[0]
    base = os.getpriority(os.PRIO_PROCESS, 0)
    return os.geteuid() == 0 or soft == resource.RLIM_INFINITY or 20 - soft <= base


def thread_nice(more: int) -> int | None:
    """Add ``more`` to the calling thread's niceness (Linux keeps one per thread); the
    niceness it had, or None if it could not."""
    tid = threading.get_native_id()
    try:
        before = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, before + more))
    except (AttributeError, OSError):
        return None
    return before


def renice_threads(nice: int) -> None:
    """Give the calling thread niceness ``nice`` again, and every thread of this process
    at the niceness it had (the threads it started meanwhile inherited it: the socket
    reactor's, the links' writers', a log reader's)."""
    me = threading.get_native_id()
    try:
        was = os.getpriority(os.PRIO_PROCESS, me)
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except (AttributeError, OSError):
        tids, was = [me], None
    for tid in tids:
        try:
            if tid == me or os.getpriority(os.PRIO_PROCESS, tid) == was:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:  # ended meanwhile, or not permitted
            pass


def fork_cuts(cuts: list[tuple[Replica, tuple, str]]) -> list[Resume]:
    """The cuts ``(replica, cut, folder)`` — each replica stopped at its cut — with their
    operators' states snapshotted and written, each to a new file in its folder, by one
    forked child (:meth:`Replica.forks`): one fork of the worker, whatever the number of
    states. The child runs only ``snapshot()`` and the writes, at the lowest priority, so
    what other threads held at the fork does not matter."""
    paths = []
    for _, _, folder in cuts:
        fd, path = tempfile.mkstemp(dir=folder, suffix=".state")
        os.close(fd)
        paths.append(path)
    with warnings.catch_warnings():
        # Python 3.12+ warns of fork in a threaded process: the child runs only the
        # operators' snapshot() and file writes, then leaves by os._exit.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            # Lowest priority: the replicas its parent serves, and their twins, get the
            # cores first; it has until WRITER_TIMEOUT_S.
            with contextlib.suppress(OSError):
                os.nice(CHILD_NICE)
            for (rep, cut, _), path in zip(cuts, paths, strict=True):
                Resume(cut, rep._inst.snapshot())._to_file(path, keep=False)
            code = 0
        finally:
            os._exit(code)
    writer = CutWriter(pid)
    return [
        Resume(cut, b"", path, writer=writer, forked_with=len(cuts))
        for (_, cut, _), path in zip(cuts, paths, strict=True)
    ]


class Worker:
    """One worker process's replicas, served from one thread (see the module
    documentation). ``rids``: the ``(task, partition, replica)`` it hosts."""

    def __init__(
        self,
        plan: Plan,
        rids: list[ReplicaId],
        secret: bytes,
        kazoo: KazooRun | None = None,
        resume: dict[ReplicaId, Resume] | None = None,
    ) -> None:
        self.plan = plan
        self.core = _core.Worker()
        self.control: deque[tuple] = deque()
        """Requests from the engine, taken by the worker thread between work items
        (:meth:`request_cut`, :meth:`link`); any thread may add to it."""
        self.on_cut = None
        """Called (from the worker thread) with ``(rid, Resume | None, token)`` for every
        cut taken on the engine's request (a cut whose ``writer`` is set is still being
        written: :meth:`Resume.written`)."""
        self.state_folder = lambda token: None
        """The folder where the state of the cut asked for with ``token`` should be
        written (None: it travels in the cut): the replica's state is then snapshotted in
        a forked child where :meth:`Replica.forks` says so (:func:`fork_cuts`)."""
        self.on_link = None
        """Called with ``(upstream rid, downstream rid, error or None)`` after a link."""
        self.on_started = None
        """Called once every replica has started (its downstream replicas dialled): a
        rebuilt worker is not a twin to count on before."""
        self.caught_up_nice: int | None = None
        """A rebuilt worker whose thread set itself a lower priority for the rebuild
        (:data:`CATCH_UP_NICE`, by the exchange where the process may raise it back:
        :func:`may_raise_priority`): the niceness the worker thread goes back to once it
        has consumed its replay — the first time it finds nothing to do after some
        input. Loading the states and catching up take the CPU the survivors leave, not
        theirs."""
        self.on_evicted = None
        """Called with ``(upstream rid, downstream rid)`` when an outbox dropped a
        downstream replica as a straggler (checked every ``IDLE_WAIT_S``)."""
        self.on_checkpoint = None
        """Called (from the worker thread) with ``(rid, epoch, Resume | None)`` for every
        replica cut for checkpoint ``epoch`` (:meth:`request_checkpoint`; None: too late,
        or the replica finished)."""
        ordered = set(plan.ordered_partitions()) if kazoo is not None else set()
        # One ZooKeeper session and one Kafka producer/consumer for every ordered partition
        # the worker hosts.
        self.kazoo = (
            KazooSession(kazoo, self.core, name="w{}.{}.{}-pid{}".format(*rids[0], os.getpid()))
            if any((t, p) in ordered for t, p, _ in rids)
            else None
        )
        self.replicas = [Replica(plan, *rid, secret, self.core, kazoo=self.kazoo) for rid in rids]
        for r in self.replicas:
            r.resume = (resume or {}).get(r.me)
        if self.kazoo is not None and resume:
            # Rebuilt from twins: read the order log from the earliest place their cuts
            # stood at (each replica's log skips what it had read already).
            offsets = [
                (resume.get(r.me) and resume[r.me].order_log_offset)
                for r in self.replicas
                if (r.me[0], r.me[1]) in ordered
            ]
            if offsets and all(o is not None for o in offsets):
                self.kazoo.start_offset = min(offsets)
        self._cuts: dict[int, list] = {}  # slot -> tokens of the cuts asked of it
        self._held: dict[int, tuple[Replica, tuple, str, float]] = {}
        """Slots held at a rebuild's cut (``Worker.hold``) until their siblings are cut too
        (:meth:`_cut`): slot -> (replica, cut, state folder, monotonic time held)."""
        self.until: tuple[int, bool] | None = None
        """A run with no duration: the source time its sources may emit through (ns after
        t0) and whether the run stops there (:meth:`extend`)."""
        self._sources: list[_Source | _LogSource] = []
        self.on_metrics = None
        """Called (from the worker thread) with a :meth:`metrics` snapshot every
        :attr:`metrics_every` seconds while the replicas run."""
        self.metrics_every: float | None = None
        """Set (from any thread) to have :attr:`on_metrics` called; None: never."""
        self._checkpoints: dict[int, int] = {}  # slot -> the checkpoint epoch asked of it

    # -- requests from the engine (any thread) ------------------------------------------

    def request_cut(self, rid: ReplicaId, token) -> None:
        """Take a cut of replica ``rid`` at its next heartbeat-cycle boundary and hand it to
        :attr:`on_cut` with ``token``."""
        self.control.append(("cut", rid, token))
        self.core.wake()

    def request_checkpoint(self, epoch: int) -> None:
        """Cut every hosted replica but the sinks right after it forwards heartbeat
        ``epoch`` (an aligned cut: ``_core.Worker.request_cut_at``) and hand each to
        :attr:`on_checkpoint`."""
        self.control.append(("checkpoint", None, epoch))
        self.core.wake()

    def link(self, up: ReplicaId, down: ReplicaId, address: tuple[str, int], epoch: int) -> None:
        """Have replica ``up`` send to ``down``, rebuilt from a cut at heartbeat ``epoch``
        and listening at ``address`` (:meth:`Replica.attach`); the outcome goes to
        :attr:`on_link`. The connection is dialled on a thread of its own, the links of
        one rebuild in parallel: the new process answers the handshakes while it is still
        setting up its replicas, and the worker thread, which serves the replicas that
        mask the loss meanwhile, only attaches the dialled link (:meth:`Replica.attach`)."""
        rep = next((r for r in self.replicas if r.me == up), None)

        def dial() -> None:
            try:
                if rep is None:
                    raise ConfigError(f"this worker hosts no replica {up}")
                output, _ = rep.output_to(down)
                dialed = output.outbox.dial(address)
            except Exception as exc:
                self.control.append(("linked", up, down, exc))
            else:
                self.control.append(("linked", up, down, (dialed, address, epoch)))
            self.core.wake()

        name = "tandem-dial-{}.{}.{}".format(*down)
        threading.Thread(target=dial, name=name, daemon=True).start()

    def extend(self, until_ns: int, final: bool) -> None:
        """A run with no duration (``run(duration=None)``): the hosted sources may emit
        what falls due through ``until_ns`` ns after t0; ``final``: the run stops there
        (see :class:`_Source`). The engine only ever moves it forward."""
        self.control.append(("until", until_ns, final))
        self.core.wake()

    def _serve_control(self, by_rid: dict[ReplicaId, Replica]) -> None:
        while self.control:
            req = self.control.popleft()
            if req[0] == "until":
                self.until = req[1:]
                for src in self._sources:
                    src.extend(*self.until)
                continue
            if req[0] == "checkpoint":
                self._checkpoint(req[2])
                continue
            rep = by_rid.get(req[1])
            if req[0] == "cut":
                if rep is None or rep.slot is None or rep.done:
                    self.on_cut(req[1], None, req[2])
                    continue
                self._cuts.setdefault(rep.slot, []).append(req[2])
                self.core.request_cut(rep.slot)
            else:  # "linked": dialled (or not) by the thread :meth:`link` started
                _, up, down, dialed = req
                try:
                    if isinstance(dialed, Exception):
                        raise dialed
                    if rep is None:
                        raise ConfigError(f"this worker hosts no replica {up}")
                    rep.attach(down, *dialed)
                except Exception as exc:
                    self.on_link(up, down, f"{type(exc).__name__}: {exc}")
                else:
                    self.on_link(up, down, None)

    def metrics(self) -> dict:
        """A snapshot of every hosted replica's counters (:meth:`Replica.metrics`), taken on
        the worker thread (or after :meth:`run`): ``{"pid", "replicas": {rid: {...}}}``."""
        now = time.time_ns()
        slots = self.core.slot_stats()
        return {
            "pid": os.getpid(),
            "replicas": {r.me: r.metrics(slots, now) for r in self.replicas},
        }

    def _checkpoint(self, epoch: int) -> None:
        for rep in self.replicas:
            if rep.task.kind == "sink":
                continue  # sinks keep their rows: a replayed row is a duplicate there
            if rep.slot is None or rep.done:
                self.on_checkpoint(rep.me, epoch, None)
                continue
            self._checkpoints[rep.slot] = epoch  # replaces one not taken yet
            self.core.request_cut_at(rep.slot, epoch)

    def bind(self, host: str = "127.0.0.1") -> dict[ReplicaId, int | None]:
        """Create every hosted replica's inbox, and start contending for the leadership of
        its ordered partitions; each replica's port (None for a source)."""
        _warm_up()
        ports = {r.me: r.bind(host) for r in self.replicas}
        if self.kazoo is not None:
            self.kazoo.start()
            for r in self.replicas:
                if r.orderer is not None:
                    r.orderer.start()
        return ports

    def restore(self, t0_ns: int) -> None:
        """Load every rebuilt replica's operator state (see :meth:`Replica.restore`)."""
        for r in self.replicas:
            r.restore(t0_ns)

    def release(self) -> None:
        """Give up every KaZoo leadership at once (a graceful stop: SIGTERM)."""
        if self.kazoo is not None:
            self.kazoo.stop()

    def run(
        self, addresses: Addresses, t0_ns: int, duration: float | None, warmup: float = 0.0
    ) -> dict[ReplicaId, ReplicaReport]:
        """Run every hosted replica to the end of its input; never raises (errors are in
        the reports). The first replica that fails stops the worker: the job fails.
        ``duration``: seconds of source time; None: until the engine says where the run
        stops (:meth:`extend`). ``warmup``: seconds after ``t0_ns`` the sinks leave out of
        their latency record."""
        local = {r.me: r.inbox for r in self.replicas if r.inbox is not None}
        try:
            for r in self.replicas:
                try:
                    r.start(addresses, t0_ns, local, warmup)
                except Exception as exc:
                    r.fail(exc)
                    if r.report.error:
                        return self._finish()
            if self.on_started is not None:
                self.on_started()
            self._loop(duration)
            self._serve_control({r.me: r for r in self.replicas})
        except Exception as exc:  # a fault of the worker itself: blame every live replica
            for r in self.replicas:
                if not r.done:
                    r.fail(exc)
        return self._finish()

    def _finish(self) -> dict[ReplicaId, ReplicaReport]:
        reports = {}
        for r in self.replicas:
            try:
                reports[r.me] = r.finish()
            except Exception as exc:
                r.fail(exc)
                reports[r.me] = r.report
        if self.kazoo is not None:
            self.kazoo.stop()
        return reports

    def _loop(self, duration: float | None) -> None:
        core = self.core
        by_slot = {r.slot: r for r in self.replicas if not r.done}
        sources, logs = [], []
        for r in by_slot.values():
            if r.task.kind == "source":
                if r.log_reader is not None:
                    logs.append(_LogSource(r, duration))
                else:
                    sources.append(_Source(r, duration))
        self._sources = [*sources, *logs]
        if self.until is not None:
            for src in self._sources:
                src.extend(*self.until)
        orderers = [r.orderer for r in self.replicas if r.orderer is not None]
        by_rid = {r.me: r for r in self.replicas}
        control = self.control
        live = len(by_slot)
        served = 0  # work items served, while catching up
        checked = measured = time.monotonic()
        while live:
            if control:
                self._serve_control(by_rid)
            wait = IDLE_WAIT_S
            if self._held:
                wait = min(wait, self._release_held())
            if sources:
                now = time.time_ns()
                finished = False
                for src in sources:
                    rep = src.replica
                    blocked = False
                    while src.step is not None and src.due_ns() <= now:
                        if not core.ready(rep.slot):
                            blocked = True  # its links are backed up: look again soon
                            break
                        if not self._guard(rep, src.run_step):
                            return
                        if rep.done:
                            live -= 1
                            self._retire(rep)
                            break
                    if src.step is not None and not rep.done:
                        due_s = CREDIT_POLL_S if blocked else (src.due_ns() - now) / 1e9
                        wait = min(wait, max(0.0, due_s))
                    elif rep.done:
                        finished = True
                    # else: waiting for the engine's word (a run with no duration)
                if finished:
                    sources = [s for s in sources if not s.replica.done]
                if not live:
                    return
            if logs:
                now = time.time_ns()
                for src in logs:
                    rep = src.replica
                    try:
                        again = src.pump(now)
                    except Exception as exc:
                        rep.fail(exc)
                        if rep.report.error is not None:
                            return
                        again = None
                    if rep.done:
                        live -= 1
                        self._retire(rep)
                    elif again is not None:
                        wait = min(wait, max(0.0, again))
                logs = [s for s in logs if not s.replica.done]
                if not live:
                    return
            item = core.next(timeout=wait)
            if self.caught_up_nice is not None:
                if item is None and served and wait > 0:  # caught up
                    renice_threads(self.caught_up_nice)
                    self.caught_up_nice = None
                served += item is not None
            if item is not None:
                rep = by_slot[item.slot]
                if item.kind == "cut":
                    self._cut(rep, item)
                    continue
                if not self._dispatch(rep, item):
                    return
                if rep.done:
                    live -= 1
                    self._retire(rep)
            if time.monotonic() - checked >= IDLE_WAIT_S:
                checked = time.monotonic()
                for o in orderers:
                    o.check()
                if self.on_evicted is not None:
                    for r in self.replicas:
                        for down in r.evicted():
                            self.on_evicted(r.me, down)
                every = self.metrics_every
                if every is not None and checked - measured >= every:
                    measured = checked
                    self.on_metrics(self.metrics())

    def _retire(self, rep: Replica) -> None:
        self.core.retire(rep.slot)
        for token in self._cuts.pop(rep.slot, []):  # no boundary will come any more
            self.on_cut(rep.me, None, token)
        epoch = self._checkpoints.pop(rep.slot, None)
        if epoch is not None:
            self.on_checkpoint(rep.me, epoch, None)

    def _cut(self, rep: Replica, item) -> None:
        if rep.task.kind == "sink":  # the sink's own (sinks are never cut for others)
            rep.mark(item.cut)
            return
        checkpoint = item.at is not None  # a checkpoint's aligned cut
        if checkpoint and self._checkpoints.get(item.slot) != item.at:
            return  # replaced by a later checkpoint
        tokens = [] if checkpoint else self._cuts.get(item.slot, [])
        # One rebuild asking, with a folder for its state: written by a forked child.
        folder = self.state_folder(tokens[0]) if len(tokens) == 1 else None
        try:
            if folder is not None and rep.forks(item.cut):
                # Held until every other slot asked to fork for a cut is cut too: one
                # fork then writes them all (:meth:`_release_held`).
                self._held[item.slot] = (rep, item.cut, folder, time.monotonic())
                self.core.hold(item.slot, True)
                self._release_held()
                return
            taken = rep.cut(item.cut)  # small, or no folder: in place
        except Exception:
            what = "a checkpoint's cut" if checkpoint else "a cut"
            log.exception("%s: taking %s failed", rep.name, what)
            taken = None
        if checkpoint:
            del self._checkpoints[item.slot]
            self.on_checkpoint(rep.me, item.at, taken)
            return
        for token in self._cuts.pop(item.slot, []):
            self.on_cut(rep.me, taken, token)

    def _release_held(self) -> float:
        """Fork once for the slots held at their cuts (:meth:`_cut`) once no other slot
        of this worker waits to be cut with a state folder — or once the first of them
        has been held for :data:`HOLD_CUTS_S` (a sibling late to its boundary, behind
        the held ones, say) — then let them go on. How soon to look again."""
        if not self._held:
            return IDLE_WAIT_S
        oldest = min(since for *_, since in self._held.values())
        left = oldest + HOLD_CUTS_S - time.monotonic()
        pending = [
            slot
            for slot, tokens in self._cuts.items()
            if slot not in self._held
            and len(tokens) == 1
            and self.state_folder(tokens[0]) is not None
        ]
        if pending and left > 0:
            return left
        held, self._held = self._held, {}
        entries = [(rep, cut, folder) for rep, cut, folder, _ in held.values()]
        try:
            taken = fork_cuts(entries)
        except Exception:
            log.exception("taking the cuts of %s failed", [r.name for r, *_ in entries])
            taken = [None] * len(entries)
        for slot, resume in zip(held, taken, strict=True):
            with contextlib.suppress(Exception):
                self.core.hold(slot, False)
            rep = held[slot][0]
            for token in self._cuts.pop(slot, []):
                self.on_cut(rep.me, resume, token)
        return IDLE_WAIT_S

    @staticmethod
    def _dispatch(rep: Replica, item) -> bool:
        """Run ``item`` for ``rep``; False if it failed the job (the worker stops)."""
        try:
            if item.kind == "data":
                rep.on_data(item.channel, item.batch)
            elif item.kind == "watermark":
                rep.on_watermark(item.epoch)
            elif item.kind == "end":
                rep.on_end()
            else:
                rep.fail(item.error)
        except Exception as exc:
            rep.fail(exc)
        return rep.report.error is None

    @staticmethod
    def _guard(rep: Replica, fn) -> bool:
        """Run ``fn`` for ``rep``; False if it failed the job (the worker stops)."""
        try:
            fn()
        except Exception as exc:
            rep.fail(exc)
            return rep.report.error is None
        return True
