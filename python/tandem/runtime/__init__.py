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
record has been read: see :mod:`tandem.runtime.pumps`); an operator
is called once per input batch and its output leaves at once, as one frame per output
channel (the Rust outbox has no timer). The Rust outbox digests every channel's frames per
heartbeat cycle and sends the digest inside the heartbeat; every receiver compares the
copies it gets from the replicas of an upstream partition, and a mismatch fails the job
with :class:`tandem.DeterminismError` unless the job says ``on_divergence="log"``
(invariant 4). The digests also come back in the report, for the engine's comparison.

The package holds one concept per module: :mod:`~tandem.runtime.worker` (the worker and
its loop), :mod:`~tandem.runtime.replica` (a replica, its outputs and its report),
:mod:`~tandem.runtime.pumps` (what emits a source's schedule), :mod:`~tandem.runtime.cuts`
(a replica's state at a boundary, for a rebuild or a checkpoint) and
:mod:`~tandem.runtime.priority` (the OS priorities of a worker's threads). Every name other
modules use is here.
"""

from tandem.runtime.cuts import (
    CHILD_NICE,
    FORK_CUTS,
    HOLD_CUTS_S,
    INLINE_CUT_BYTES,
    WRITER_TIMEOUT_S,
    CutWriter,
    Resume,
    SlotCuts,
    fork_cuts,
)
from tandem.runtime.priority import may_raise_priority, renice_threads, thread_nice
from tandem.runtime.pumps import CREDIT_POLL_S, LOG_POSITIONS_KEPT, _LogSource, _Source
from tandem.runtime.replica import Addresses, Replica, ReplicaId, ReplicaReport, _Output
from tandem.runtime.worker import (
    CATCH_UP_NICE,
    IDLE_WAIT_S,
    METRICS_EVERY_S,
    Worker,
    _warm_up,
)

__all__ = [
    "CATCH_UP_NICE",
    "CHILD_NICE",
    "CREDIT_POLL_S",
    "FORK_CUTS",
    "HOLD_CUTS_S",
    "IDLE_WAIT_S",
    "INLINE_CUT_BYTES",
    "LOG_POSITIONS_KEPT",
    "METRICS_EVERY_S",
    "WRITER_TIMEOUT_S",
    "Addresses",
    "CutWriter",
    "Replica",
    "ReplicaId",
    "ReplicaReport",
    "Resume",
    "SlotCuts",
    "Worker",
    "_LogSource",
    "_Output",
    "_Source",
    "_warm_up",
    "fork_cuts",
    "may_raise_priority",
    "renice_threads",
    "thread_nice",
]
