"""A replica of one task partition (:class:`Replica`), its output edges (:class:`_Output`)
and what it reports to its engine when it finishes (:class:`ReplicaReport`)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass, field

import pyarrow as pa

from tandem import _core
from tandem.exceptions import ConfigError, DeterminismError, TandemError, TaskFailed
from tandem.latency import LatencyRecorder, SinkLatency
from tandem.operators import Operator
from tandem.ordering.kazoo import KazooSession, Orderer
from tandem.plan import OutputEdge, Plan, Task
from tandem.runtime.cuts import FORK_CUTS, INLINE_CUT_BYTES, Resume, fork_cuts

log = logging.getLogger("tandem")

ReplicaId = tuple[int, int, int]  # task id, partition, replica
Addresses = dict[ReplicaId, tuple[str, int]]


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
    starved: str | None = None
    """Set when an input channel of the replica lost every upstream replica feeding it
    before its end (gone, or they dropped it as a straggler): it stopped with part of its
    input missing, and the engine counts it lost (:class:`tandem.InputStarved`)."""
    ended: bool = False
    """The replica consumed its whole input and finished (a sink: closed its copy). A sink
    replica cut off from its upstream (dropped as a straggler, its other senders lost)
    reports too when its worker stops, with ``ended`` False: its copy is not whole."""
    from_twin: bool = False
    """A sink replica rebuilt from a twin's copy (:attr:`tandem.sinks.Sink.rebuildable`):
    its rows are whole, but its latency record covers only the rows it received itself."""

    def failure(self) -> TandemError | None:
        """The exception the run fails with because of this replica, if any."""
        if self.error is None:
            return None
        return failure_error(self.error, self.diverged)


def failure_error(error: str, diverged: bool) -> TandemError:
    """The exception a replica's failure fails the run with: a divergence of its input
    (:class:`DeterminismError`) or an error of its task (:class:`TaskFailed`)."""
    return DeterminismError(error) if diverged else TaskFailed(error)


def failures(reports: dict[ReplicaId, ReplicaReport]) -> tuple[tuple[ReplicaId, str, bool], ...]:
    """The replicas of ``reports`` that failed the job, as a worker tells its engine:
    ``(rid, error, diverged)`` each."""
    return tuple((rid, r.error, r.diverged) for rid, r in reports.items() if r.error)


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
        # A downstream replica with no address is down (lost, not rebuilt yet, or a sink
        # copy lost for good): not dialled; a rebuild links it later (attach).
        targets = [
            [
                local.get((down.id, p, r)) or addresses[(down.id, p, r)]
                for r in range(down.replication)
                if (down.id, p, r) in local or (down.id, p, r) in addresses
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
            key_groups=plan.max_parallelism,
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
        self._cut = False  # cut_outputs() ran
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

    def bind(self, host: str = "127.0.0.1", parked: bool = False) -> int | None:
        """Listen for upstream replicas; the port, or None for a source (a log source
        starts reading its partition now, while the job starts). ``parked``: the inbox
        takes nothing until it is unparked at its cut (a partition a live rescale adds:
        :mod:`tandem.runtime.rescaling`)."""
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
            parked=parked,
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
        self.connect(addresses, local, t0_ns)
        t, p, r = self.me
        boxes = [o.outbox for o in self.outputs]
        cut = self.resume.cut if self.resume is not None else None
        if self.task.kind == "source":
            self.slot = self.core.add_source(boxes, t0_ns, self.plan.heartbeat_ns, resume=cut)
            return
        if self.task.kind == "operator":
            if self._inst is None:
                self._inst = self.plan.instantiate(t, p, replica=r, t0_ns=t0_ns)
                if self.resume is not None and self.resume.savepoint:
                    self._inst.restore(self.resume.load())  # resumed from a savepoint
            watermarks = type(self._inst.op).on_watermark is not Operator.on_watermark
        else:
            self._sink = self.plan.open_sink(t, p, run=t0_ns, replica=r)
            if self.resume is not None and not self.resume.savepoint:
                # Restarted from what the lost sink committed, or rebuilt from a twin's
                # copy (a savepoint's sink starts with no output, at its input positions
                # there).
                self.report.rows_in = self._sink.restore(self.resume.load())
                self.report.from_twin = self._sink.rebuildable
            elif self.resume is not None and self.resume.state:
                # Resumed from a checkpoint: what the lost runs had written past it (a
                # Kafka sink's last commit), which it does not write again.
                self._sink.restore(self.resume.state)
            schema = self.task.schema
            if schema is not None and "event_time_ns" in schema.names:
                self._latency = LatencyRecorder(t0_ns, t0_ns + round(warmup * 1e9))
            watermarks = False
        self.slot = self.core.add_task(self.inbox, boxes, watermarks, resume=cut)
        if self._sink is not None and self._sink.keep_positions:
            self.core.request_cut(self.slot)  # see mark()

    def connect(
        self, addresses: Addresses, local: dict[ReplicaId, _core.Inbox], t0_ns: int
    ) -> None:
        """Link the downstream replicas (dials the remote ones: blocking, so a live
        rescale's new partition does it on a thread of its own)."""
        t, p, _ = self.me
        self.t0_ns = t0_ns
        self.outputs += [
            _Output(self.plan, self.me, e, addresses, self.secret, local, self.name)
            for e in self.plan.output_edges(t, p)
        ]

    def take_slot(self, cut: tuple) -> None:
        """A live rescale's new operator partition, its operator instance set and its
        inbox unparked: take a worker slot starting at ``cut`` (its outputs from sequence
        0 right after the cut's heartbeat)."""
        watermarks = type(self._inst.op).on_watermark is not Operator.on_watermark
        boxes = [o.outbox for o in self.outputs]
        self.slot = self.core.add_task(self.inbox, boxes, watermarks, resume=cut)

    @property
    def keeps_positions(self) -> bool:
        """A sink that stores its input positions with its rows (:meth:`mark`)."""
        return self._sink is not None and self._sink.keep_positions

    def mark(self, cut: tuple | None) -> None:
        """A sink that keeps its positions, cut at a heartbeat-cycle boundary: the rows
        written so far are its input through ``cut`` (:meth:`tandem.sinks.Sink.mark`);
        cut again at the next boundary (None: the slot is going, no more cuts)."""
        if cut is None or self._sink is None:
            return
        self._sink.mark(cut)
        self.core.request_cut(self.slot)

    def commit_through(self, cut: tuple, then) -> None:
        """A sink cut for a durable checkpoint: ``then`` once its writes through ``cut``
        are durable (:meth:`tandem.sinks.Sink.commit_through`)."""
        self._sink.commit_through(cut, then)

    def take_over(self) -> None:
        """An owned sink's replica standing by: become its partition's owner
        (:meth:`tandem.sinks.Sink.take_over`)."""
        self._sink.take_over()

    def roll(self, epoch: int) -> None:
        """A sink that commits at checkpoints, cut for the durable checkpoint at heartbeat
        ``epoch``: close the part holding its rows through the cut
        (:meth:`tandem.sinks.Sink.roll`)."""
        if self._sink is not None and self._sink.parts_from is not None:
            self._sink.roll(epoch)

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

    def cut(self, cut: tuple | None, copy: bool = False) -> Resume | None:
        """This replica at the heartbeat-cycle boundary the worker stopped it at (``cut``,
        from the core; None: it cannot be cut): what a replica rebuilt from it needs. A log
        source's state is where its log continues after the marker it took as that
        heartbeat, and the data rows it read before it; a rebuildable sink's, with
        ``copy``, its copy so far (:meth:`tandem.sinks.Sink.snapshot`: a savepoint's sink
        cut holds no rows)."""
        if cut is None:
            return None
        if copy and self._sink is not None:
            return Resume(cut, self._sink.snapshot())
        if self.log_reader is not None:
            # The marker taken as the cut's heartbeat, or, for an aligned cut inside a
            # run of heartbeats sent for one marker (the markers skipped epochs), that
            # marker: the first heartbeat sent at or after the cut's.
            at = next((k for k in self.log_positions if k >= cut[0]), None)
            if at is None:  # not a heartbeat it sent lately: try a later cut
                return None
            offset, rows = self.log_positions[at]
            return Resume(cut, json.dumps([offset, rows, at]).encode())
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
        """A rebuilt or resumed log source's ``(heartbeat, next offset, data rows before
        it)``: the heartbeat of the marker its log goes on after, which is the cut's, or
        a later one sent with it (:meth:`cut`: the heartbeats between are its to send
        first)."""
        offset, rows, *marker = json.loads(self.resume.load())
        return (marker[0] if marker else self.resume.epoch), offset, rows

    def evicted(self) -> list[ReplicaId]:
        """The downstream replicas this replica's outboxes dropped as stragglers since the
        last call."""
        found = []
        if self._cut:
            return found
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

    def on_data(self, channel: int, batch: pa.RecordBatch, first_seq: int = 0) -> None:
        self.report.rows_in += batch.num_rows
        conform = self._conform[channel]
        if conform is not None:  # a union's input with a stricter nullability
            batch = conform(batch)
        if self._inst is not None:
            self._emit(self._inst.batch(batch, self.inputs[channel].input_index))
            return
        now = time.time_ns()
        self._sink.receive(channel, first_seq, batch)
        if self.report.first_receive_ns is None:
            self.report.first_receive_ns = now
        if self._latency is not None:
            self._latency.record(now, batch.column("event_time_ns").to_numpy(zero_copy_only=False))

    def on_watermark(self, epoch: int) -> None:
        self._emit(self._inst.watermark(self.plan.watermark_ns(epoch, self.t0_ns)))

    def on_end(self, drain: bool = True) -> None:
        """Every input ended (sources: the schedule did): final output (``drain``: not at
        a stop at a savepoint, whose resumed run emits it), end markers."""
        if self._inst is not None and drain:
            self._emit(self._inst.finish())
        if self._sink is not None:
            self.report.sink_part = self._sink.close()
            self._sink = None
            if self._latency is not None:
                self.report.latency = self._latency.finish()
        for o in self.outputs:
            o.outbox.end()
        self.done = self.report.ended = True

    def fail(self, exc: BaseException) -> None:
        """Record why this replica stopped (see :class:`ReplicaReport`)."""
        self.done = True
        if isinstance(exc, _core.InputStarved):
            self.report.starved = str(exc)
        elif isinstance(exc, _core.ChannelClosed):
            # No live downstream replica is left on any output channel: they finished on
            # the copies of a faster twin of this replica (or crashed, which the engine
            # handles). Nothing this replica does reaches anyone any more.
            self.report.abandoned = str(exc)
        elif isinstance(exc, DeterminismError):
            self.report.error, self.report.diverged = self._divergence(exc), True
        else:
            self.report.error = f"{self.name} failed: {type(exc).__name__}: {exc}\n" + "".join(
                traceback.format_exception(exc)
            )

    def cut_outputs(self) -> None:
        """Cut every output link now, as a crash would (a starved replica is lost: links
        left open and silent would keep its downstream replicas waiting on it); the
        digests of what it sent are kept for its report."""
        self._take_digests()
        for o in self.outputs:
            o.outbox.abort()
        self._cut = True

    def _take_digests(self) -> None:
        for i, o in enumerate(self.outputs):
            for channel, epoch, digest in o.outbox.digests():  # before close: it drains
                self.report.digests[(i, channel, epoch)] = digest.hex()

    def finish(self) -> ReplicaReport:
        """Close everything; the report (call once, when the worker is done)."""
        report = self.report
        if self.log_reader is not None:
            self.log_reader.stop()
        if not self._cut:
            self._take_digests()
            for o in self.outputs:
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
