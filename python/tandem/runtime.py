"""The replica worker: what one replica of one task partition runs, on any engine.

An engine (``tandem.engines.local`` runs one OS process per replica; the Spark engine runs
each replica as a long-running Spark task) drives a replica through three steps:

1. :meth:`Replica.bind` — create the replica's inbox (operators and sinks) and return the
   port its upstream replicas must dial;
2. :meth:`Replica.run` — given every inbox address of the job and the logical time origin
   ``t0_ns``, dial the downstream replicas and run to the end of input;
3. the returned :class:`ReplicaReport` goes back to the engine.

The loop follows the forwarding contract of :mod:`tandem.plan`, the same one the reference
executor follows, so that with LiveRobin every operator replica consumes the reference's
row sequence: heartbeats move a per-channel watermark; when the minimum over the channels
advances to ``k``, the operator's ``on_watermark`` output is emitted, then heartbeat ``k``
is forwarded on every output channel. Every replica keeps a digest of its output per
output edge and heartbeat cycle (invariant 4); the engine compares them across replicas.
"""

from __future__ import annotations

import hashlib
import time
import traceback
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from tandem import _core
from tandem.exceptions import ConfigError
from tandem.ordering.kazoo import KazooRun, Orderer
from tandem.plan import OutputEdge, Plan, Task, WatermarkTracker

ReplicaId = tuple[int, int, int]  # task id, partition, replica
Addresses = dict[ReplicaId, tuple[str, int]]

MIN_SOURCE_TICK_S = 0.001
"""A source wakes up once per tick — its buffer timeout, at least this — and releases every
row and heartbeat due by then, as one flush. That is the buffer timeout applied where rows
enter the job: without it, every row would travel in a frame of its own at low rates and
the per-frame cost of every downstream replica would dominate."""

IDLE_WAIT_S = 0.05
"""How long a worker waits for input before checking again (buffer timeouts are enforced
by flushing whenever the input runs dry)."""


@dataclass
class ReplicaReport:
    """What one replica reports to its engine when it finishes."""

    task: int
    partition: int
    replica: int
    kind: str
    rows_in: int = 0
    rows_out: int = 0
    digests: dict[tuple[int, int], str] = field(default_factory=dict)
    sink_part: object = None
    receive_ns: np.ndarray | None = None
    latency_ms: np.ndarray | None = None
    inbox_stats: dict | None = None
    ordering_stats: dict | None = None
    """KaZoo partitions: the epochs this replica led, orders published and followed."""
    error: str | None = None
    abandoned: str | None = None
    """Set when every downstream replica had already finished (its twin got there first):
    the replica's remaining output was needed by nobody, so it stopped early."""


def _warm_up() -> None:
    """Pay pyarrow's lazy imports now, while the job starts, not on the first batch after
    t0: building any array loads pyarrow's pandas shim, which imports pandas when it is
    installed (pyspark brings it) — about a CPU-second per process, enough for a job's
    replica processes to stall the first seconds of the stream on a small machine."""
    pa.array([0])


class CycleDigest:
    """Digest of one output edge's rows per heartbeat cycle, independent of how the rows
    were cut into batches (replicas of a task see different batch boundaries).

    Every column feeds three running hashes — null flags, fixed-width values (or string
    lengths), string bytes — each of which sees the same byte stream however the cycle's
    rows are split into batches. Closing a cycle folds them into one digest."""

    def __init__(self) -> None:
        self.columns: list[list] | None = None
        self.rows = 0
        self.done: dict[int, str] = {}

    def add(self, batch: pa.RecordBatch) -> None:
        if not batch.num_rows:
            return
        if self.columns is None:
            self.columns = [[hashlib.blake2b(digest_size=16) for _ in range(3)] for _ in batch]
        self.rows += batch.num_rows
        for hashers, column in zip(self.columns, batch.columns, strict=True):
            for h, part in zip(hashers, _canonical_parts(column), strict=True):
                h.update(part)

    def close(self, epoch: int) -> None:
        total = hashlib.blake2b(self.rows.to_bytes(8, "little"), digest_size=16)
        for hashers in self.columns or ():
            for h in hashers:
                total.update(h.digest())
        self.done[epoch] = total.hexdigest()
        self.columns, self.rows = None, 0


def _canonical_parts(arr: pa.Array) -> tuple[bytes, bytes, bytes]:
    """(null flags, values or lengths, variable-length bytes) of ``arr``: equal row
    sequences give equal concatenations whatever their buffer layout or batch split."""
    if arr.null_count:
        nulls = arr.is_null().to_numpy(zero_copy_only=False).tobytes()
    else:
        nulls = bytes(len(arr))  # the same flags an all-valid is_null() gives
    t = arr.type
    if pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t):
        arr = arr.cast(pa.large_binary())
        t = arr.type
    if pa.types.is_large_binary(t):
        offsets = np.frombuffer(arr.buffers()[1], dtype=np.int64)[
            arr.offset : arr.offset + len(arr) + 1
        ]
        data = arr.buffers()[2]
        body = b"" if data is None else data.to_pybytes()[offsets[0] : offsets[-1]]
        return nulls, np.diff(offsets).tobytes(), body
    if pa.types.is_primitive(t) or pa.types.is_boolean(t):
        if arr.null_count:  # nulls as zeros of the column's type (to_numpy would go float)
            arr = arr.fill_null(pa.scalar(0).cast(t))
        return nulls, np.ascontiguousarray(arr.to_numpy(zero_copy_only=False)).tobytes(), b""
    return nulls, b"", repr(arr.to_pylist()).encode()


class _Output:
    """One output edge of a replica: an outbox towards every replica of the downstream
    partitions, plus the edge's cycle digest."""

    def __init__(
        self,
        plan: Plan,
        me: ReplicaId,
        edge: OutputEdge,
        addresses: Addresses,
        secret: bytes,
    ) -> None:
        down = plan.tasks[edge.downstream]
        targets = [
            [addresses[(down.id, p, r)] for r in range(down.replication)] for p in edge.partitions
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
            buffer_timeout_ms=plan.buffer_timeout_ms,
        )
        self.digest = CycleDigest()

    def emit(self, batch: pa.RecordBatch | None) -> int:
        if batch is None or batch.num_rows == 0:
            return 0
        self.digest.add(batch)
        self.outbox.emit(batch)
        return batch.num_rows

    def heartbeat(self, epoch: int) -> None:
        self.digest.close(epoch)
        self.outbox.heartbeat(epoch)


class Replica:
    """One replica of one task partition (see the module documentation)."""

    def __init__(
        self,
        plan: Plan,
        task_id: int,
        partition: int,
        replica: int,
        secret: bytes,
        kazoo: KazooRun | None = None,
    ):
        self.plan = plan
        self.task: Task = plan.tasks[task_id]
        self.me: ReplicaId = (task_id, partition, replica)
        self.secret = secret
        self.kazoo = kazoo
        self.orderer: Orderer | None = None
        self.inbox = None
        self.inputs = []
        self.outputs: list[_Output] = []

    @property
    def name(self) -> str:
        _, p, r = self.me
        return f"{self.task.kind} task {self.task.name!r} partition {p} replica {r}"

    def bind(self, host: str = "127.0.0.1") -> int | None:
        """Listen for upstream replicas; the port, or None for a source."""
        _warm_up()
        if self.task.kind == "source":
            return None
        t, p, r = self.me
        self.inputs = self.plan.input_channels(t, p)
        ordering = self.plan.inbox_ordering(t, p)
        self.inbox = _core.Inbox(
            self.plan.job,
            self.secret,
            [(c.task, c.partition) for c in self.inputs],
            ordering=ordering,
            quantum_rows=self.plan.quantum_rows,
            host=host,
        )
        if ordering == "kazoo":
            if self.kazoo is None:
                raise ConfigError(
                    f"{self.name} orders its input with KaZoo, but the engine gave it no "
                    "KazooRun (tandem.ordering.kazoo.prepare)"
                )
            # Connect and contend now, while the job starts, not when the first row comes.
            self.orderer = Orderer(self.kazoo, t, p, r, self.inbox.order_feed())
            self.orderer.start()
        return self.inbox.port

    def release(self) -> None:
        """Give up leadership at once (a graceful stop: SIGTERM)."""
        if self.orderer is not None:
            self.orderer.stop()

    def run(self, addresses: Addresses, t0_ns: int, duration: float) -> ReplicaReport:
        """Run to the end of input; never raises (errors are reported)."""
        t, p, r = self.me
        report = ReplicaReport(t, p, r, self.task.kind)
        outputs = self.outputs
        try:
            outputs += [
                _Output(self.plan, self.me, e, addresses, self.secret)
                for e in self.plan.output_edges(t, p)
            ]
            if self.task.kind == "source":
                self._run_source(outputs, report, t0_ns, duration)
            elif self.task.kind == "operator":
                self._run_operator(outputs, report, t0_ns)
            else:
                self._run_sink(report)
        except _core.ChannelClosed as exc:
            # No live downstream replica is left on some output channel. Downstream only
            # closes once it has received everything (from a faster twin of this replica);
            # had they all crashed instead, the engine fails the job for that reason.
            report.abandoned = str(exc)
        except Exception as exc:
            report.error = f"{self.name} failed: {type(exc).__name__}: {exc}\n" + "".join(
                traceback.format_exception(exc)
            )
        finally:
            for o in outputs:
                o.outbox.close()
            if self.orderer is not None:
                self.orderer.stop()
                report.ordering_stats = self.orderer.stats()
            if self.inbox is not None:
                report.inbox_stats = self.inbox.stats()
                self.inbox.close()
        report.digests = {
            (i, epoch): d for i, o in enumerate(outputs) for epoch, d in o.digest.done.items()
        }
        return report

    # -- sources -------------------------------------------------------------------------

    def _run_source(self, outputs, report, t0_ns: int, duration: float) -> None:
        """Release rows on the logical clock; heartbeat k after every row released before
        ``t0 + k * heartbeat`` (so both replicas put it at the same sequence number)."""
        plan, t, p = self.plan, self.task.id, self.me[1]
        total = plan.source_rows(t, p, duration)
        last_epoch = plan.last_epoch(duration)
        emitted, epoch = 0, 1
        tick_ns = int(max(MIN_SOURCE_TICK_S, plan.buffer_timeout_ms / 1000) * 1e9)

        def emit_until(limit: int) -> None:
            nonlocal emitted
            while emitted < limit:
                j1 = min(limit, emitted + plan.batch_rows)
                batch = plan.source_batch(t, p, emitted, j1, t0_ns)
                for o in outputs:
                    report.rows_out += o.emit(batch)
                report.rows_in += batch.num_rows
                emitted = j1

        while True:
            offset = time.time_ns() - t0_ns
            while epoch <= last_epoch and plan.heartbeat_offset_ns(epoch) <= offset:
                hb = plan.heartbeat_offset_ns(epoch)
                emit_until(min(total, plan.source_rows_before(t, p, hb)))
                for o in outputs:
                    o.heartbeat(epoch)
                epoch += 1
            emit_until(min(total, plan.source_rows_before(t, p, offset + 1)))
            for o in outputs:
                o.outbox.flush()
            if emitted >= total and epoch > last_epoch:
                break
            now = time.time_ns() - t0_ns  # sleep to the next tick boundary of the logical clock
            time.sleep(max(0, tick_ns - now % tick_ns) / 1e9 if now >= 0 else -now / 1e9)
        for o in outputs:
            o.outbox.end()

    # -- operators -----------------------------------------------------------------------

    def _run_operator(self, outputs, report, t0_ns: int) -> None:
        plan, t, p, r = self.plan, self.task.id, self.me[1], self.me[2]
        inst = plan.instantiate(t, p, replica=r, t0_ns=t0_ns)
        tracker = WatermarkTracker(len(self.inputs))

        def emit(batch) -> None:
            for o in outputs:
                report.rows_out += o.emit(batch)

        while True:
            d = self._next()
            if d.kind == "data":
                report.rows_in += d.batch.num_rows
                emit(inst.batch(d.batch, self.inputs[d.channel].input_index))
            elif d.kind == "heartbeat":
                before = tracker.current
                now = tracker.observe(d.channel, d.epoch)
                if now is not None:
                    for k in range(before + 1, now + 1):
                        emit(inst.watermark(plan.watermark_ns(k, t0_ns)))
                        for o in outputs:
                            o.heartbeat(k)
            else:
                emit(inst.finish())
                for o in outputs:
                    o.outbox.end()
                return

    # -- sinks ---------------------------------------------------------------------------

    def _run_sink(self, report) -> None:
        sink = self.plan.open_sink(self.task.id, self.me[1])
        receive: list[np.ndarray] = []
        latency: list[np.ndarray] = []
        track_latency = "event_time_ns" in self.task.schema.names if self.task.schema else False
        while True:
            d = self._next()
            if d.kind == "end":
                break
            if d.kind != "data":
                continue
            now = time.time_ns()
            batch = d.batch
            report.rows_in += batch.num_rows
            sink.write(batch)
            if track_latency:
                ev = batch.column("event_time_ns").to_numpy(zero_copy_only=False)
                receive.append(np.full(len(ev), now, dtype=np.int64))
                latency.append((now - ev) / 1e6)
        report.sink_part = sink.close()
        if receive:
            report.receive_ns = np.concatenate(receive)
            report.latency_ms = np.concatenate(latency)

    def _next(self):
        """The next delivery. When the input has run dry, every output is flushed first
        (the "no more input ready" rule of the flush policy), then it waits."""
        d = self.inbox.next(timeout=0)
        if d is None:
            for o in self.outputs:
                o.outbox.flush()
        while d is None:
            if self.orderer is not None:
                self.orderer.check()
            d = self.inbox.next(timeout=IDLE_WAIT_S)
        return d
