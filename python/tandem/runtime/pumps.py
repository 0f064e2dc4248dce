"""Source pumps: what emits a source replica's rows and heartbeats, each when its schedule
says — :class:`_Source` for a generated source (:meth:`tandem.plan.Plan.source_schedule`),
:class:`_LogSource` for one that reads a log such as Kafka
(:meth:`tandem.plan.Plan.log_schedule`). The worker's loop drives them
(:meth:`tandem.runtime.Worker.run`)."""

from __future__ import annotations

import itertools
from collections import deque
from typing import TYPE_CHECKING

from tandem.heartbeat import LogStep
from tandem.plan import SourceStep

if TYPE_CHECKING:
    from tandem.runtime.replica import Replica

LOG_POSITIONS_KEPT = 1024
"""Heartbeats a log source remembers the log position of, for cuts (one is asked for at a
time, and taken as the next heartbeat leaves)."""

CREDIT_POLL_S = 0.001
"""How soon a worker looks again at a source whose downstream links are backed up."""


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
        self.offset: int | None = None  # where a resumed reader started
        if replica.resume is not None:  # rebuilt: its reader starts after the cut's marker
            epoch, self.offset, rows = replica.log_resume()
            resume = (epoch, rows)
            replica.report.rows_in = rows
        self.schedule = replica.plan.log_schedule(t, p, duration, replica.t0_ns, resume)
        self.steps: deque = deque(self.schedule.feed(()))  # resumed at its end: the end
        if resume is not None and resume[0] > replica.resume.epoch:
            # Cut inside the heartbeats sent for one marker: the rest of them go first,
            # as they did after the cut (nothing came between them).
            self.steps.appendleft(LogStep("heartbeat", (), epoch=resume[0], rows=resume[1]))

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
                offset = self.source.next_offset(step.records[0]) if step.records else self.offset
                positions[step.epoch] = (offset, step.rows)
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
