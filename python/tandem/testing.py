"""Plain-Python reference implementations and helpers for testing replicated stream jobs.

Everything here is written straight from the paper (Rosinosky et al., "Active replication
for latency-sensitive stream processing in Apache Flink", SRDS 2021) and tandem's
DESIGN §2, one event at a time, with no cleverness: it is the yardstick the Rust core is
differentially tested (and benchmarked) against, and it is handy in your own tests.

Model of a logical channel
    A channel carries *elements*, each taking sequence numbers: a data row takes one, a
    heartbeat takes one. An upstream replica sends the channel as a list of :class:`Data`
    runs (``first_seq`` + a list of rows), :class:`Heartbeat` markers and a final
    :class:`End`. Replicas of one upstream partition send the same elements, cut at
    different batch boundaries.

Typical use::

    from tandem.testing import (ReferenceLiveRobin, channel_content, replica_streams,
                                interleave, deduplicate)

    contents = [channel_content(rows_per_cycle=[3, 0, 5]), channel_content([1, 4, 2])]
    streams = [replica_streams(c, replicas=2, seed=s) for s, c in enumerate(contents)]
    arrivals = interleave(streams, seed=7)          # [(channel, element), ...]
    channels = deduplicate(arrivals, len(contents))  # per-channel element lists
    expected = ReferenceLiveRobin(len(contents), quantum_rows=1).run(channels)
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Data",
    "End",
    "Heartbeat",
    "ReferenceDedup",
    "ReferenceLiveRobin",
    "channel_content",
    "deduplicate",
    "flatten",
    "interleave",
    "per_event",
    "replica_streams",
]


@dataclass(frozen=True)
class Data:
    """Rows ``first_seq, first_seq + 1, ...`` of a channel (one seq per row)."""

    first_seq: int
    rows: Sequence[Any]

    @property
    def end_seq(self) -> int:
        """One past the last seq covered."""
        return self.first_seq + len(self.rows)


@dataclass(frozen=True)
class Heartbeat:
    """The heartbeat of cycle ``epoch``, at seq ``seq`` of its channel."""

    seq: int
    epoch: int

    @property
    def first_seq(self) -> int:
        return self.seq

    @property
    def end_seq(self) -> int:
        return self.seq + 1


@dataclass(frozen=True)
class End:
    """The channel's last element, at seq ``seq``."""

    seq: int

    @property
    def first_seq(self) -> int:
        return self.seq

    @property
    def end_seq(self) -> int:
        return self.seq + 1


Element = Data | Heartbeat | End
"""One element of a channel as sent by an upstream replica."""


class ReferenceDedup:
    """Duplicate sending, first copy wins — one event at a time (paper §V-A, DESIGN §2).

    Per logical channel a high-water mark ``next`` (the first seq not yet accepted). An
    element covering seqs ``[a, b)`` keeps its events with seq ``>= next``; if ``a > next``
    the events in between are missing: that is a *gap*, reported, never skipped.

    >>> d = ReferenceDedup(1)
    >>> d.offer(0, 0, ["a", "b"])
    ['a', 'b']
    >>> d.offer(0, 1, ["b", "c"])
    ['c']
    >>> d.offer(0, 0, ["a"])
    []
    """

    def __init__(self, channels: int) -> None:
        if channels < 1:
            raise ValueError(f"channels must be at least 1, got {channels}")
        self.next = [0] * channels

    def offer(self, channel: int, first_seq: int, rows: Sequence[Any]) -> list[Any]:
        """Offer rows ``first_seq, ...`` of ``channel``; return the ones not seen before.

        Raises :class:`LookupError` on a gap (``first_seq`` beyond the high-water mark):
        the caller must offer the missing seqs first.
        """
        nxt = self.next[channel]
        if first_seq > nxt:
            raise LookupError(f"gap on channel {channel}: got seq {first_seq}, expected {nxt}")
        kept = []
        seq = first_seq
        for row in rows:
            if seq >= nxt:
                kept.append(row)
                nxt = seq + 1
            seq += 1
        self.next[channel] = nxt
        return kept

    def offer_marker(self, channel: int, seq: int) -> bool:
        """Offer a heartbeat or end marker at ``seq``; True if this copy is the first."""
        nxt = self.next[channel]
        if seq > nxt:
            raise LookupError(f"gap on channel {channel}: got seq {seq}, expected {nxt}")
        if seq < nxt:
            return False
        self.next[channel] = seq + 1
        return True

    def offer_element(self, channel: int, element: Element) -> Element | None:
        """Offer any element; return its new part (same type), or None if a duplicate."""
        if isinstance(element, Data):
            kept = self.offer(channel, element.first_seq, element.rows)
            if not kept:
                return None
            return Data(element.end_seq - len(kept), kept)
        return element if self.offer_marker(channel, element.first_seq) else None


@dataclass
class ReferenceLiveRobin:
    """LiveRobin, Algorithm 1 of the paper, per event, with the fix DESIGN §2 states.

    Variables as in the paper: ``next`` (the channel whose turn it is), ``gen`` (the
    highest heartbeat epoch seen) and ``A`` (channels still active in this cycle).

    * **The fix**: a channel leaves ``A`` whenever its heartbeat is dequeued, not only
      when the epoch is new (the printed algorithm does it only inside ``if e.seq > gen``,
      which lets a channel whose heartbeat was not first run into the next cycle).
    * ``gen`` starts as "nothing seen" (None), so epoch 0 is forwarded too.
    * **Quantum**: a turn takes up to ``quantum_rows`` rows, or fewer rows followed by the
      heartbeat / end marker that stops it; ``quantum_rows=1`` is the paper exactly.
    * End of a channel: it leaves ``A`` for good; after every channel ended, ``("end",)``.
    * When ``A`` becomes empty the next cycle starts with every channel not ended.
    """

    channels: int
    quantum_rows: int = 1
    next: int = field(default=0, init=False)
    gen: int | None = field(default=None, init=False)
    active: set[int] = field(default_factory=set, init=False)
    ended: set[int] = field(default_factory=set, init=False)
    taken: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.channels < 1 or self.quantum_rows < 1:
            raise ValueError(
                f"channels and quantum_rows must be at least 1, got {self.channels} "
                f"and {self.quantum_rows}"
            )
        self.active = set(range(self.channels))

    def _advance(self) -> None:
        """Lines 20-23: round-robin to the next active channel after ``next``."""
        self.taken = 0
        if not self.active:
            return
        if self.next >= max(self.active):
            self.next = min(self.active)
        else:
            self.next = min(c for c in self.active if c > self.next)

    def _leave(self, channel: int) -> None:
        """Lines 15-17: leave the cycle; an empty ``A`` starts the next cycle."""
        self.active.discard(channel)
        if not self.active:
            self.active = set(range(self.channels)) - self.ended

    def step(self, queues: Sequence[deque[Any]]) -> tuple[Any, ...] | None:
        """Dequeue one event from ``queues[next]`` (a deque of per-event entries:
        ``("row", value)``, ``("heartbeat", epoch)`` or ``("end",)``) and return what is
        consumed, or None if that queue is empty (the algorithm blocks there)."""
        if len(self.ended) == self.channels:
            return ("end",)
        c = self.next
        if not queues[c]:
            return None
        event = queues[c].popleft()
        kind = event[0]
        if kind == "row":
            self.taken += 1
            if self.taken >= self.quantum_rows:
                self._advance()
            return ("row", c, event[1])
        if kind == "heartbeat":
            epoch = event[1]
            first = self.gen is None or epoch > self.gen
            if first:
                self.gen = epoch
            self._leave(c)
            self._advance()
            return ("heartbeat", c, epoch, first)
        if kind == "end":
            self.ended.add(c)
            if len(self.ended) == self.channels:
                return ("end",)
            self._leave(c)
            self._advance()
            return self.step(queues)
        raise ValueError(f"unknown event kind {kind!r} on channel {c}")

    def run(self, channels: Sequence[Iterable[Element]]) -> list[tuple[Any, ...]]:
        """Consume complete channel contents (each ending with :class:`End`, e.g. from
        :func:`deduplicate`) and return every consumed event, up to and including
        ``("end",)``. Raises :class:`LookupError` if a channel runs dry without an End."""
        queues = [deque(per_event(ch)) for ch in channels]
        if len(queues) != self.channels:
            raise ValueError(f"expected {self.channels} channels, got {len(queues)}")
        out: list[tuple[Any, ...]] = []
        while True:
            ev = self.step(queues)
            if ev is None:
                raise LookupError(f"channel {self.next} ran dry before its End marker")
            out.append(ev)
            if ev == ("end",):
                return out


def per_event(elements: Iterable[Element]) -> list[tuple[Any, ...]]:
    """Expand elements into per-event entries as :meth:`ReferenceLiveRobin.step` reads."""
    out: list[tuple[Any, ...]] = []
    for e in elements:
        if isinstance(e, Data):
            out.extend(("row", r) for r in e.rows)
        elif isinstance(e, Heartbeat):
            out.append(("heartbeat", e.epoch))
        else:
            out.append(("end",))
    return out


def channel_content(rows_per_cycle: Sequence[int], tail_rows: int = 0, *, start: int = 0):
    """The elements of one logical channel: for cycle ``i`` (epoch ``i + 1``),
    ``rows_per_cycle[i]`` rows then the cycle's heartbeat; then ``tail_rows`` rows and End.
    A row's value is its seq plus ``start`` (so rows identify themselves).

    Returns a list of per-seq entries: ``("row", value)``, ``("heartbeat", epoch)``,
    ``("end",)``. Feed it to :func:`replica_streams`.
    """
    out: list[tuple[Any, ...]] = []
    for i, n in enumerate(rows_per_cycle):
        base = start + len(out)
        out.extend(("row", base + k) for k in range(n))
        out.append(("heartbeat", i + 1))
    base = start + len(out)
    out.extend(("row", base + k) for k in range(tail_rows))
    out.append(("end",))
    return out


def replica_streams(
    content: Sequence[tuple[Any, ...]],
    replicas: int = 2,
    *,
    max_batch: int = 8,
    seed: int = 0,
    crash: tuple[int, int] | None = None,
) -> list[list[Element]]:
    """How ``replicas`` upstream replicas send one channel: the same ``content`` (from
    :func:`channel_content`), each cut into :class:`Data` runs at its own random
    boundaries (1..``max_batch`` rows). ``crash=(replica, k)`` stops that replica's
    stream after its first ``k`` elements. Deterministic in ``seed``."""
    rng = random.Random(seed)
    streams = []
    for _ in range(replicas):
        stream: list[Element] = []
        seq = 0
        while seq < len(content):
            kind = content[seq][0]
            if kind == "row":
                run = 0
                while seq + run < len(content) and content[seq + run][0] == "row":
                    run += 1
                n = rng.randint(1, min(run, max_batch))
                stream.append(Data(seq, [content[seq + k][1] for k in range(n)]))
                seq += n
            elif kind == "heartbeat":
                stream.append(Heartbeat(seq, content[seq][1]))
                seq += 1
            else:
                stream.append(End(seq))
                seq += 1
        streams.append(stream)
    if crash is not None:
        victim, keep = crash
        streams[victim] = streams[victim][:keep]
    return streams


def interleave(streams: Sequence[Sequence[Sequence[Element]]], *, seed: int = 0):
    """One random arrival order at a downstream replica: ``streams[channel][replica]`` are
    element lists; each replica's list stays in order (a FIFO connection), lists are
    interleaved at random. Returns ``[(channel, element), ...]``. Deterministic in
    ``seed``; different seeds model different downstream replicas."""
    rng = random.Random(seed)
    cursors = [(c, list(s)) for c, reps in enumerate(streams) for s in reps]
    cursors = [(c, s) for c, s in cursors if s]
    positions = [0] * len(cursors)
    out: list[tuple[int, Element]] = []
    live = list(range(len(cursors)))
    while live:
        i = rng.choice(live)
        c, s = cursors[i]
        out.append((c, s[positions[i]]))
        positions[i] += 1
        if positions[i] == len(s):
            live.remove(i)
    return out


def deduplicate(arrivals: Iterable[tuple[int, Element]], channels: int) -> list[list[Element]]:
    """Run arrivals through :class:`ReferenceDedup`; return each channel's deduplicated,
    contiguous elements (what a merge consumes)."""
    dedup = ReferenceDedup(channels)
    out: list[list[Element]] = [[] for _ in range(channels)]
    for c, element in arrivals:
        kept = dedup.offer_element(c, element)
        if kept is not None:
            out[c].append(kept)
    return out


def flatten(deliveries: Iterable[tuple[Any, ...]], column: str = "seq") -> list[tuple[Any, ...]]:
    """Turn ``tandem._core`` merge deliveries into per-event tuples comparable with
    :meth:`ReferenceLiveRobin.run`: a ``("data", channel, first_seq, batch)`` delivery
    becomes one ``("row", channel, value)`` per row of ``batch[column]``; heartbeats and
    the end pass through. Batch boundaries disappear, so two runs can be compared."""
    out: list[tuple[Any, ...]] = []
    for d in deliveries:
        if d[0] == "data":
            _, c, _, batch = d
            out.extend(("row", c, v) for v in batch.column(column).to_pylist())
        else:
            out.append(tuple(d))
    return out
