"""Heartbeats in the log: the generators, the markers, and the rule a source replica applies.

A log-driven source (:class:`tandem.sources.Kafka`) has no clock of its own: its batches
and heartbeats are cut where the log says, so that every replica of a source partition —
reading the same partition from the same offset — emits the same batches and heartbeats
with no coordination, whenever it runs.

**Generators.** ``tandem heartbeats --bootstrap B --topic T [--heartbeat-ms N]`` writes a
*marker* into every partition of every topic it is given, every ``heartbeat_ms``: a record
with a null key and value and the header ``tandem-heartbeat: <epoch>/<period_ns>``, where
``epoch = floor(wall_ns / period_ns)`` is read from its own wall clock when the marker
falls due. Two generators never talk to each other, yet write the same epochs at about the
same moments, so any number of them may run (the engine starts two per Kafka cluster for a
job with Kafka sources) and any of them may die: the others' markers keep coming.

**Taking markers.** A marker stands for the instant ``epoch · period_ns`` (ns since the
Unix epoch), which a job with heartbeat period ``h`` reads as its heartbeat epoch
``K = floor(epoch · period_ns / h)`` — so a generator with another period still serves
(a slower one cuts less often, a faster one writes repeats). A source replica **takes the
first marker whose K is greater than every K taken before** and ignores the rest (repeats
from the other generators, late or old markers): every replica reads the same log, so
every replica takes the same markers at the same offsets. A run that starts at ``t0``
counts its heartbeats from ``K0 = floor(t0 / h)``: a marker taken with epoch ``K`` is the
job's heartbeat ``k = K - K0`` (and markers with ``K <= K0``, older than the run, are
ignored), so heartbeat ``k`` carries the watermark ``t0 + k·h`` as a synthetic source's
does (within one period of the marker's instant). A run of ``duration`` ends at the first
marker taken with ``k >= last_epoch(duration)``. The markers taken may skip epochs (a
generator held up skips those whose instants passed; a partition that gets a later epoch's
marker first ignores the earlier one), and two partitions may skip different ones: taking
heartbeat ``k`` sends every heartbeat not sent yet through ``k``, one apiece, as a clock
does (:func:`tandem.reference.log_entries`), so every channel carries every epoch.

**Cutting batches (DESIGN §2 invariant 1).** :class:`LogSchedule` is a pure function of
the log's content: a batch ends at every marker taken (a batch never spans a heartbeat)
and where the partition-local count of data rows read since the start offset reaches a
multiple of ``batch_rows``. Nothing timing-dependent — how many records a ``poll``
returned, when they came — cuts a batch, so a replica emits a batch only once it has read
the record that closes it: with markers every ``heartbeat_ms`` a row waits at most one
period (plus the time the marker takes to arrive) at its source.

**Clocks.** Generators should run on clocks kept in step (NTP): one ahead by ``d`` makes
its markers the ones taken, ``d`` early; one behind only writes repeats. A generator far
ahead (an hour) would make the sources take its future epochs and ignore everyone else's
until the wall clock catches up: do not run one on a machine with a wrong clock. Markers
carry no rows; they are never decoded and never reach an operator.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

HEADER = "tandem-heartbeat"
"""The record header that makes a record a heartbeat marker."""

DEFAULT_GENERATORS = 2
"""Generators the engine starts per Kafka cluster of a job's log sources."""

log = logging.getLogger(__name__)


def marker_header(epoch: int, period_ns: int) -> bytes:
    """The header value of marker ``epoch`` of a generator with period ``period_ns``."""
    return f"{epoch}/{period_ns}".encode()


def marker_ns(headers: list | None) -> int | None:
    """The instant (ns since the Unix epoch) a record with ``headers`` marks, or None if
    it is not a marker (a data row). A marker whose header does not parse marks instant
    -1: it is never taken, and never a row either."""
    if not headers:
        return None
    for key, value in headers:
        if key == HEADER:
            try:
                epoch, _, period = bytes(value).decode().partition("/")
                return int(epoch) * int(period)
            except (ValueError, TypeError, UnicodeDecodeError):
                return -1
    return None


@dataclass(frozen=True)
class LogStep:
    """A step of a log-driven source partition: ``rows`` (the records of one batch, in log
    order), ``heartbeat`` (the job's epoch ``epoch``; ``records`` holds the marker taken,
    and ``rows`` counts the data rows before it: where a replica rebuilt from a cut at this
    heartbeat resumes) or ``end``."""

    kind: str
    records: tuple | list = ()
    epoch: int = 0
    rows: int = 0


class LogSchedule:
    """Cuts one source partition's log into the steps every replica emits (see the module
    documentation): :meth:`feed` it the records in log order, in any chunks; it returns
    the steps they complete. The steps depend on the records alone, never on the chunks.

    ``heartbeat_ns``: the job's heartbeat period ``h``; ``t0_ns``: the run's time origin
    (``K0 = t0 // h``); ``last_epoch``: the run ends after the first marker taken with
    ``k >= last_epoch`` (None: never); ``batch_rows``: a batch ends where the count of data
    rows read reaches a multiple of it. ``marker(record)`` is the instant a record marks,
    or None for a data row (:func:`marker_ns` of its headers).

    ``resume=(k, rows)``: continue right after heartbeat ``k``, before which ``rows`` data
    rows were read (a replica rebuilt from a twin's cut, fed the log from the record after
    that marker): the same steps follow as for a schedule fed the whole log."""

    def __init__(
        self,
        heartbeat_ns: int,
        t0_ns: int,
        last_epoch: int | None,
        batch_rows: int,
        marker: Callable[[Any], int | None],
        resume: tuple[int, int] | None = None,
    ) -> None:
        if heartbeat_ns < 1 or batch_rows < 1:
            raise ValueError("heartbeat_ns and batch_rows must be >= 1")
        self.heartbeat_ns = heartbeat_ns
        self.base = t0_ns // heartbeat_ns
        self.taken = self.base + (resume[0] if resume else 0)
        self.last = last_epoch
        self.cap = batch_rows
        self.marker = marker
        self.rows = resume[1] if resume else 0
        self.markers_taken = 0
        self.markers_ignored = 0
        self.pending: list = []
        self.ended = False
        # Resumed at the run's last heartbeat: the end is all that follows.
        self._end_due = resume is not None and last_epoch is not None and resume[0] >= last_epoch

    def feed(self, records: Iterable) -> list[LogStep]:
        """The steps completed by ``records`` (the next records of the log, in order)."""
        out: list[LogStep] = []
        if self._end_due:
            self._end_due, self.ended = False, True
            return [LogStep("end")]
        if self.ended:
            return out
        pending, cap, marker = self.pending, self.cap, self.marker
        for rec in records:
            at = marker(rec)
            if at is None:
                pending.append(rec)
                self.rows += 1
                if self.rows % cap == 0:
                    out.append(LogStep("rows", pending))
                    pending = []
                continue
            epoch = at // self.heartbeat_ns if at >= 0 else -1
            if epoch <= self.taken:
                self.markers_ignored += 1
                continue
            self.taken = epoch
            self.markers_taken += 1
            if pending:
                out.append(LogStep("rows", pending))
                pending = []
            k = epoch - self.base
            out.append(LogStep("heartbeat", (rec,), epoch=k, rows=self.rows))
            if self.last is not None and k >= self.last:
                out.append(LogStep("end"))
                self.ended = True
                break
        self.pending = pending
        return out


# -- the generator ------------------------------------------------------------------------


def generate(
    bootstrap: str,
    topics: list[str],
    heartbeat_ms: float,
    *,
    duration: float | None = None,
    stop: threading.Event | None = None,
    config: Mapping[str, Any] | None = None,
) -> int:
    """Write a marker into every partition of ``topics`` every ``heartbeat_ms`` (see the
    module documentation) until ``stop`` is set or ``duration`` seconds have passed;
    returns the markers written. An epoch whose instant has passed while the generator
    was held up (a stall, a slow broker) is skipped, never written late in a burst."""
    from confluent_kafka import Producer

    from tandem.kafka import client_config, partition_count

    period = round(heartbeat_ms * 1_000_000)
    if period < 1:
        raise ValueError(f"heartbeat_ms must be > 0, got {heartbeat_ms}")
    parts = {t: partition_count(bootstrap, t, config) for t in topics}
    conf = client_config(bootstrap, config)
    conf.update(
        {
            "linger.ms": 0,
            "acks": "all",
            # A marker is worth nothing late (its epoch is soon a repeat): never queue
            # them up for long behind a broker that does not answer.
            "message.timeout.ms": 5_000,
            "queue.buffering.max.messages": 100_000,
        }
    )
    producer = Producer(conf)
    stop = stop or threading.Event()
    end = None if duration is None else time.monotonic() + duration
    written = 0
    epoch = time.time_ns() // period + 1
    try:
        while not stop.is_set() and (end is None or time.monotonic() < end):
            wait = (epoch * period - time.time_ns()) / 1e9
            if wait > 0 and stop.wait(wait):
                break
            epoch = max(epoch, time.time_ns() // period)
            header = [(HEADER, marker_header(epoch, period))]
            for topic, n in parts.items():
                for p in range(n):
                    while True:
                        try:
                            producer.produce(topic, value=None, partition=p, headers=header)
                            break
                        except BufferError:
                            producer.poll(0.01)
                    written += 1
            producer.poll(0)
            epoch += 1
    finally:
        producer.flush(2.0)
    return written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The generator's command-line arguments (``tandem heartbeats``)."""
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers (default: the local one)")
    parser.add_argument(
        "--topic",
        action="append",
        required=True,
        metavar="TOPIC",
        help="a topic to mark, every partition (repeatable)",
    )
    parser.add_argument(
        "--heartbeat-ms", type=float, default=10.0, help="the period (the job's heartbeat_ms)"
    )
    parser.add_argument("--duration", type=float, metavar="S", help="stop after S seconds")
    parser.add_argument(
        "--parent",
        type=int,
        metavar="PID",
        help="exit when process PID exits (as the engine runs it)",
    )
    parser.add_argument(
        "-X",
        dest="config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a librdkafka producer setting (repeatable), e.g. -X security.protocol=SSL",
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Run a generator as ``tandem heartbeats`` asks, until SIGTERM, Ctrl-C or
    ``--duration``; prints how many markers it wrote."""
    from tandem.kafka import default_bootstrap

    config = {}
    for item in args.config:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"tandem heartbeats: -X {item!r}: expected KEY=VALUE")
        config[key] = value
    if args.parent is not None:
        from tandem.engines.process import die_with_parent

        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine stops it with SIGTERM
        die_with_parent()
        if os.getppid() != args.parent:
            return 1
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    bootstrap = args.bootstrap or default_bootstrap()
    try:
        written = generate(
            bootstrap,
            args.topic,
            args.heartbeat_ms,
            duration=args.duration,
            stop=stop,
            config=config,
        )
    except KeyboardInterrupt:
        return 130
    print(
        f"tandem heartbeats: wrote {written} markers into {', '.join(args.topic)} at "
        f"{bootstrap} every {args.heartbeat_ms:g} ms",
        flush=True,
    )
    return 0


# -- the engine's generators ------------------------------------------------------------


@dataclass(frozen=True)
class GeneratorSpec:
    """One generator process the engine runs: its cluster and topics."""

    bootstrap: str
    topics: tuple[str, ...]
    heartbeat_ms: float
    config: tuple[tuple[str, str], ...] = ()


def specs(plan) -> list[GeneratorSpec]:
    """The generators the engine runs for ``plan``: per Kafka cluster of its log sources,
    as many as the most any of those sources asks for (``generators=``, default 2), each
    marking every source topic of that cluster. Generator ``i`` of the job is
    ``specs(plan)[i]`` (:class:`tandem.KillHeartbeats` names it)."""
    clusters: dict[tuple, tuple[list[str], int]] = {}
    for task in plan.sources():
        if not plan.is_log_source(task.id):
            continue
        src = task.source
        bootstrap, topic, config = src.heartbeat_target()
        key = (bootstrap, tuple(sorted(config.items())))
        topics, n = clusters.get(key, ([], 0))
        if topic not in topics:
            topics.append(topic)
        clusters[key] = (topics, max(n, src.generators))
    out = []
    for (bootstrap, config), (topics, n) in clusters.items():
        spec = GeneratorSpec(bootstrap, tuple(topics), plan.heartbeat_ms, config)
        out += [spec] * n
    return out


class Generators:
    """The heartbeat generators of one run (:func:`specs`), each a process
    (``tandem heartbeats --parent PID``) that dies with its parent."""

    def __init__(self, plan, env: dict[str, str] | None = None) -> None:
        self.specs = specs(plan)
        self.env = env
        self.procs: list[subprocess.Popen] = []

    def __len__(self) -> int:
        return len(self.specs)

    def start(self) -> None:
        for spec in self.specs:
            cmd = [
                sys.executable,
                "-m",
                "tandem.cli",
                "heartbeats",
                "--bootstrap",
                spec.bootstrap,
                "--heartbeat-ms",
                repr(spec.heartbeat_ms),
                "--parent",
                str(os.getpid()),
            ]
            for topic in spec.topics:
                cmd += ["--topic", topic]
            for key, value in spec.config:
                cmd += ["-X", f"{key}={value}"]
            self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL))

    def kill(self, index: int) -> int | None:
        """SIGKILL generator ``index``; its PID (None if it had exited already)."""
        proc = self.procs[index]
        if proc.poll() is not None:
            return None
        proc.kill()
        proc.wait(5)
        return proc.pid

    def alive(self) -> list[int]:
        return [i for i, p in enumerate(self.procs) if p.poll() is None]

    def stop(self, grace: float = 3.0) -> None:
        """SIGTERM every generator, SIGKILL what is left after ``grace`` s, reap them (a
        second call does nothing more)."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.terminate()
        deadline = time.monotonic() + grace
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


__all__ = [
    "DEFAULT_GENERATORS",
    "HEADER",
    "GeneratorSpec",
    "Generators",
    "LogSchedule",
    "LogStep",
    "generate",
    "marker_header",
    "marker_ns",
    "specs",
]
