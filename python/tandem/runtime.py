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
is forwarded on every output channel.

Batches are the unit of determinism (DESIGN §2 invariant 1): a source emits exactly the
batches of :meth:`tandem.plan.Plan.source_schedule`, each when it falls due; an operator
is called once per input batch and its output leaves at once, as one frame per output
channel (the Rust outbox has no timer). The Rust outbox digests every channel's frames per
heartbeat cycle and sends the digest inside the heartbeat; every receiver compares the
copies it gets from the replicas of an upstream partition, and a mismatch fails the job
with :class:`tandem.DeterminismError` unless the job says ``on_divergence="log"``
(invariant 4). The digests also come back in the report, for the engine's comparison.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from tandem import _core
from tandem.exceptions import ConfigError, DeterminismError, TandemError, TaskFailed
from tandem.ordering.kazoo import KazooRun, Orderer
from tandem.plan import OutputEdge, Plan, Task, WatermarkTracker

ReplicaId = tuple[int, int, int]  # task id, partition, replica
Addresses = dict[ReplicaId, tuple[str, int]]

IDLE_WAIT_S = 0.05
"""How long a worker waits for input before checking on its KaZoo orderer again."""


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
    receive_ns: np.ndarray | None = None
    latency_ms: np.ndarray | None = None
    inbox_stats: dict | None = None
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


def _warm_up() -> None:
    """Pay pyarrow's lazy imports now, while the job starts, not on the first batch after
    t0: building any array loads pyarrow's pandas shim, which imports pandas when it is
    installed (pyspark brings it) — about a CPU-second per process, enough for a job's
    replica processes to stall the first seconds of the stream on a small machine."""
    pa.array([0])


class _Output:
    """One output edge of a replica: an outbox towards every replica of the downstream
    partitions (it numbers, frames, digests and sends; nothing waits in it)."""

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
        )

    def emit(self, batch: pa.RecordBatch | None) -> int:
        if batch is None or batch.num_rows == 0:
            return 0
        self.outbox.emit(batch)
        return batch.num_rows

    def heartbeat(self, epoch: int) -> None:
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
            on_divergence=self.plan.on_divergence,
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
        except DeterminismError as exc:
            report.error, report.diverged = self._divergence(exc), True
        except Exception as exc:
            report.error = f"{self.name} failed: {type(exc).__name__}: {exc}\n" + "".join(
                traceback.format_exception(exc)
            )
        finally:
            for i, o in enumerate(outputs):
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

    # -- sources -------------------------------------------------------------------------

    def _run_source(self, outputs, report, t0_ns: int, duration: float) -> None:
        """Emit the partition's logical schedule (:meth:`Plan.source_schedule`), each step
        when it falls due: the same batches and heartbeats at every replica."""
        plan, t, p = self.plan, self.task.id, self.me[1]
        for step in plan.source_schedule(t, p, duration):
            wait_ns = t0_ns + step.at_ns - time.time_ns()
            if wait_ns > 0:
                time.sleep(wait_ns / 1e9)
            if step.kind == "rows":
                batch = plan.source_batch(t, p, step.j0, step.j1, t0_ns)
                for o in outputs:
                    report.rows_out += o.emit(batch)
                report.rows_in += batch.num_rows
            elif step.kind == "heartbeat":
                for o in outputs:
                    o.heartbeat(step.epoch)
            else:
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
        """The next delivery (the GIL is released while waiting); a KaZoo replica looks
        after its orderer between waits."""
        while True:
            d = self.inbox.next(timeout=IDLE_WAIT_S)
            if d is not None:
                return d
            if self.orderer is not None:
                self.orderer.check()
