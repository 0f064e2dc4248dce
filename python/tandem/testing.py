"""Plain-Python reference implementations and helpers for testing replicated stream jobs.

Everything here is written straight from the paper (Rosinosky et al., "Active replication
for latency-sensitive stream processing in Apache Flink", SRDS 2021) and tandem's
DESIGN §2, one element at a time, with no cleverness: it is the yardstick the Rust core is
differentially tested (and benchmarked) against, and it is handy in your own tests.

Model of a logical channel
    A channel carries *elements*, each taking sequence numbers: a data row takes one, a
    heartbeat takes one, the end marker takes one. An upstream replica sends the channel
    as a list of :class:`Data` batches (``first_seq`` + a list of rows), :class:`Heartbeat`
    markers and a final :class:`End`. The batch is the unit of determinism (DESIGN §2
    invariant 1): the content is cut into batches once (:func:`cut_batches`) and every
    replica of the upstream partition sends those same batches; replicas differ only in
    timing, and a crashed one stops early.

Consumption order
    :class:`ReferenceLiveRobin` is Algorithm 1 with one element per turn: a whole batch,
    a heartbeat or the end. :meth:`~ReferenceLiveRobin.step` works on queues of opaque
    payloads (the reference executor runs it over ``pyarrow.RecordBatch``es);
    :meth:`~ReferenceLiveRobin.run` consumes complete element lists. Compare with
    ``tandem._core`` merges through :func:`batches` (boundaries kept) or :func:`flatten`
    (rows only).

Typical use::

    from tandem.testing import (ReferenceLiveRobin, batches, channel_content,
                                deduplicate, interleave, replica_streams)

    contents = [channel_content(rows_per_cycle=[3, 0, 5]), channel_content([1, 4, 2])]
    streams = [replica_streams(c, replicas=2, seed=s) for s, c in enumerate(contents)]
    arrivals = interleave(streams, seed=7)          # [(channel, element), ...]
    channels = deduplicate(arrivals, len(contents))  # per-channel element lists
    expected = ReferenceLiveRobin(len(contents)).run(channels)
    # a tandem._core.LiveRobin fed the same channels: batches(lr.drain()) == expected

KaZoo order log
    :func:`decode_order` reads one Order frame of the order log with
    ``struct``; :class:`ReferenceOrderLog` applies DESIGN §2.3's rule to a log of them
    (stale epochs fenced off, replays ignored); :func:`read_order_topic` reads a topic with
    a plain ``confluent_kafka`` consumer. Together, an independent reading of what the
    replicas of a KaZoo-ordered partition must have followed.

Functions of a whole batch
    :func:`with_batch_rows`, :func:`with_batch_mean`, :func:`with_rank` and
    :func:`two_thresholds` are operator functions whose output depends on how the rows are
    cut into batches — deterministic for a given batch, as the contract asks, and wrong
    the moment two replicas see different batches; :func:`noisy` is not deterministic at
    all. Put them in a job to check that a deployment keeps its replicas in step (and that
    the divergence check fires).
"""

from __future__ import annotations

import os
import random
import socket
import struct
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tandem.sinks import Sink

__all__ = [
    "BATCH_FUNCTIONS",
    "CountRows",
    "Data",
    "End",
    "Heartbeat",
    "Order",
    "ReferenceDedup",
    "ReferenceLiveRobin",
    "ReferenceOrderLog",
    "batches",
    "bulk_batches",
    "channel_content",
    "cut_batches",
    "decode_order",
    "deduplicate",
    "flatten",
    "free_port",
    "interleave",
    "noisy",
    "queue_entries",
    "read_order_topic",
    "replica_streams",
    "scrape_metrics",
    "two_thresholds",
    "with_batch_mean",
    "with_batch_rows",
    "with_rank",
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

    @property
    def num_rows(self) -> int:
        """Rows in the batch (as ``pyarrow.RecordBatch.num_rows``)."""
        return len(self.rows)


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
    """LiveRobin, Algorithm 1 of the paper, one element per turn, with the fix DESIGN §2
    states.

    The paper's *event* is one element of a channel: a whole data batch, a heartbeat or
    the end marker. Variables as in the paper: ``next`` (the channel whose turn it is),
    ``gen`` (the highest heartbeat epoch seen) and ``A`` (channels still active in this
    cycle).

    * **Whole batches**: a data batch is consumed whole, never sliced, and its turn ends
      with it. Replicas of an upstream partition send identical batches (DESIGN §2
      invariant 1), so every downstream replica consumes the same batches in the same
      order. A batch with no rows covers no seq; it is dropped without taking a turn, as
      in the Rust core.
    * **The fix**: a channel leaves ``A`` whenever its heartbeat is dequeued, not only
      when the epoch is new (the printed algorithm does it only inside ``if e.seq > gen``,
      which lets a channel whose heartbeat was not first run into the next cycle).
    * ``gen`` starts as "nothing seen" (None), so epoch 0 is forwarded too.
    * End of a channel: its end marker ends the turn like any element but returns
      nothing; the channel leaves ``A`` for good and the same :meth:`step` goes on with
      the next channel in turn. After every channel ended, ``("end",)``.
    * When ``A`` becomes empty the next cycle starts with every channel not ended.
    * **Joining channels** (a live rescale, :meth:`join`): channels appended while the
      merge runs wait, neither active nor ended, until the first time ``A`` is refilled
      with ``gen`` at or past the epoch they join after — the end of that epoch's cycle —
      or with every other channel ended; from that refill on they take their turns in
      the round-robin like the others, in channel order.
    """

    channels: int
    next: int = field(default=0, init=False)
    gen: int | None = field(default=None, init=False)
    active: set[int] = field(default_factory=set, init=False)
    ended: set[int] = field(default_factory=set, init=False)
    waiting: set[int] = field(default_factory=set, init=False)
    """Joined channels not taking turns yet."""
    join_after: int | None = field(default=None, init=False)
    """The epoch whose cycle the :attr:`waiting` channels join after."""

    def __post_init__(self) -> None:
        if self.channels < 1:
            raise ValueError(f"channels must be at least 1, got {self.channels}")
        self.active = set(range(self.channels))

    def _advance(self) -> None:
        """Lines 20-23: round-robin to the next active channel after ``next``."""
        if not self.active:
            return
        if self.next >= max(self.active):
            self.next = min(self.active)
        else:
            self.next = min(c for c in self.active if c > self.next)

    def _leave(self, channel: int) -> None:
        """Lines 15-17: leave the cycle; an empty ``A`` starts the next cycle, with the
        waiting channels once their epoch's cycle is over or nothing else is left."""
        self.active.discard(channel)
        if not self.active:
            if self.waiting:
                cycle_over = self.gen is not None and self.gen >= self.join_after
                others = set(range(self.channels)) - self.waiting
                if cycle_over or others <= self.ended:
                    self.waiting, self.join_after = set(), None
            self.active = set(range(self.channels)) - self.ended - self.waiting

    def join(self, count: int, after_epoch: int) -> int:
        """Append ``count`` channels that take turns from the end of heartbeat cycle
        ``after_epoch`` on (or once every other channel ended): what a consumer of a task
        rescaled live at ``after_epoch`` does with the new partitions' channels. Returns
        the first new channel's index; :meth:`step` then takes that many more queues.
        ValueError while channels are waiting to join already, once ``after_epoch`` was
        seen (its cycle's end could have passed) and after every channel ended."""
        if count < 0:
            raise ValueError(f"count must be at least 0, got {count}")
        if self.waiting:
            raise ValueError(
                f"channels {sorted(self.waiting)} are waiting to join already; one join at a time"
            )
        if self.gen is not None and self.gen >= after_epoch:
            raise ValueError(
                f"channels cannot join after heartbeat {after_epoch}: the merge has seen "
                f"heartbeat {self.gen}"
            )
        if len(self.ended) == self.channels:
            raise ValueError("channels cannot join a merge whose channels all ended")
        first = self.channels
        self.channels += count
        if count:
            self.waiting = set(range(first, self.channels))
            self.join_after = after_epoch
        return first

    def step(self, queues: Sequence[deque[tuple[Any, ...]]]) -> tuple[Any, ...] | None:
        """Dequeue the next element of ``queues[next]`` and return what is consumed, or
        None if that queue is empty (the algorithm blocks there: call again once it grew).

        ``queues[c]`` holds channel ``c``'s deduplicated elements in seq order, as entries
        ``("data", payload)``, ``("heartbeat", epoch)`` or ``("end",)``. The payload is
        opaque (a ``pyarrow.RecordBatch``, a :class:`Data`, a list of rows); only its row
        count is read — ``num_rows``, else ``len()`` — to drop empty batches. Returns

        * ``("data", channel, payload)`` — the payload object, whole;
        * ``("heartbeat", channel, epoch, first)`` — ``first`` is True the first time
          ``epoch`` is seen: the task forwards the heartbeat then;
        * ``("end",)`` — every channel's end marker has been dequeued (and on every later
          call). A channel's own end marker is consumed without a return of its own: the
          call goes on with the next channel in turn;
        * None — the current channel's queue is empty.
        """
        if len(queues) != self.channels:
            raise ValueError(f"expected {self.channels} queues, got {len(queues)}")
        while True:
            if len(self.ended) == self.channels:
                return ("end",)
            c = self.next
            if not queues[c]:
                return None
            entry = queues[c].popleft()
            kind = entry[0]
            if kind == "data":
                payload = entry[1]
                if _row_count(payload) == 0:
                    continue  # covers no seq: no turn
                self._advance()
                return ("data", c, payload)
            if kind == "heartbeat":
                epoch = entry[1]
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
                continue
            raise ValueError(
                f"unknown entry kind {kind!r} on channel {c}; expected 'data', 'heartbeat' or 'end'"
            )

    def run(self, channels: Sequence[Iterable[Element]]) -> list[tuple[Any, ...]]:
        """Consume complete channel contents (each ending with :class:`End`, e.g. from
        :func:`deduplicate`) and return every delivery, up to and including ``("end",)``:
        ``("data", channel, first_seq, rows)`` per batch (``rows`` a list), heartbeats
        and the end as :meth:`step` returns them — the shape :func:`batches` gives
        ``tandem._core`` deliveries. Raises :class:`LookupError` if a channel runs dry
        without an End."""
        if len(channels) != self.channels:
            raise ValueError(f"expected {self.channels} channels, got {len(channels)}")
        queues = [deque(queue_entries(ch)) for ch in channels]
        out: list[tuple[Any, ...]] = []
        while True:
            d = self.step(queues)
            if d is None:
                raise LookupError(f"channel {self.next} ran dry before its End marker")
            if d[0] == "data":
                _, c, element = d
                d = ("data", c, element.first_seq, list(element.rows))
            out.append(d)
            if d == ("end",):
                return out


def _row_count(payload: Any) -> int:
    """Rows of an opaque batch payload: ``num_rows`` (RecordBatch, :class:`Data`), else
    ``len()``."""
    n = getattr(payload, "num_rows", None)
    return len(payload) if n is None else n


def queue_entries(elements: Iterable[Element]) -> list[tuple[Any, ...]]:
    """Turn elements into the entries :meth:`ReferenceLiveRobin.step` reads: a
    :class:`Data` becomes ``("data", element)`` (the element is the payload),
    a heartbeat ``("heartbeat", epoch)``, the end ``("end",)``."""
    out: list[tuple[Any, ...]] = []
    for e in elements:
        if isinstance(e, Data):
            out.append(("data", e))
        elif isinstance(e, Heartbeat):
            out.append(("heartbeat", e.epoch))
        elif isinstance(e, End):
            out.append(("end",))
        else:
            raise TypeError(f"expected a Data, Heartbeat or End element, got {e!r}")
    return out


def channel_content(rows_per_cycle: Sequence[int], tail_rows: int = 0, *, start: int = 0):
    """The elements of one logical channel: for cycle ``i`` (epoch ``i + 1``),
    ``rows_per_cycle[i]`` rows then the cycle's heartbeat; then ``tail_rows`` rows and End.
    A row's value is its seq plus ``start`` (so rows identify themselves).

    Returns a list of per-seq entries: ``("row", value)``, ``("heartbeat", epoch)``,
    ``("end",)``. Feed it to :func:`replica_streams` or :func:`cut_batches`.
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


def cut_batches(
    content: Sequence[tuple[Any, ...]], *, max_batch: int = 8, seed: int = 0
) -> list[Element]:
    """Cut ``content`` (from :func:`channel_content`) into the elements an upstream
    partition emits: :class:`Data` batches of 1..``max_batch`` rows at random boundaries
    (a batch never spans a heartbeat), :class:`Heartbeat` markers, then :class:`End`.
    Deterministic in ``seed``."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    rng = random.Random(seed)
    out: list[Element] = []
    seq = 0
    while seq < len(content):
        kind = content[seq][0]
        if kind == "row":
            run = 0
            while seq + run < len(content) and content[seq + run][0] == "row":
                run += 1
            n = rng.randint(1, min(run, max_batch))
            out.append(Data(seq, [content[seq + k][1] for k in range(n)]))
            seq += n
        elif kind == "heartbeat":
            out.append(Heartbeat(seq, content[seq][1]))
            seq += 1
        elif kind == "end":
            out.append(End(seq))
            seq += 1
        else:
            raise ValueError(f"unknown content entry {content[seq]!r} at seq {seq}")
    return out


def replica_streams(
    content: Sequence[tuple[Any, ...]],
    replicas: int = 2,
    *,
    max_batch: int = 8,
    seed: int = 0,
    crash: tuple[int, int] | None = None,
) -> list[list[Element]]:
    """How ``replicas`` upstream replicas send one channel: ``content`` (from
    :func:`channel_content`) is cut into batches once (:func:`cut_batches`, 1..``max_batch``
    rows, deterministic in ``seed``) and every replica sends those same batches, as
    DESIGN §2 invariant 1 requires. ``crash=(replica, k)`` stops that replica's stream
    after its first ``k`` elements."""
    cut = cut_batches(content, max_batch=max_batch, seed=seed)
    streams = [list(cut) for _ in range(replicas)]
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


def _values(payload: Any, column: str) -> list[Any]:
    """The rows of a delivered batch: ``payload[column]`` of a ``pyarrow.RecordBatch``,
    or the payload itself as a list (:meth:`ReferenceLiveRobin.run` delivers lists)."""
    if hasattr(payload, "column"):
        return payload.column(column).to_pylist()
    return list(payload)


def batches(deliveries: Iterable[tuple[Any, ...]], column: str = "seq") -> list[tuple[Any, ...]]:
    """Merge deliveries as comparable tuples that keep their batch boundaries: a
    ``("data", channel, first_seq, batch)`` delivery of ``tandem._core`` becomes
    ``("data", channel, first_seq, [values of batch[column]])``, the shape
    :meth:`ReferenceLiveRobin.run` returns; heartbeats and the end pass through."""
    out: list[tuple[Any, ...]] = []
    for d in deliveries:
        if d[0] == "data":
            _, c, first_seq, payload = d
            out.append(("data", c, first_seq, _values(payload, column)))
        else:
            out.append(tuple(d))
    return out


def bulk_batches(drained: tuple[list, Any], column: str = "seq") -> list[tuple[Any, ...]]:
    """``drain_many()``'s ``(deliveries, rows)`` — each data delivery says how many of the
    record batch's rows are its own, in order — in the shape :func:`batches` returns."""
    deliveries, rows = drained
    flat = [] if rows is None else rows.column(column).to_pylist()
    out: list[tuple[Any, ...]] = []
    at = 0
    for d in deliveries:
        if d[0] == "data":
            out.append(("data", d[1], d[2], flat[at : at + d[3]]))
            at += d[3]
        else:
            out.append(tuple(d))
    if at != len(flat):
        raise ValueError(f"the deliveries take {at} rows of the record batch's {len(flat)}")
    return out


def flatten(deliveries: Iterable[tuple[Any, ...]], column: str = "seq") -> list[tuple[Any, ...]]:
    """Merge deliveries (``tandem._core``'s or :meth:`ReferenceLiveRobin.run`'s) as
    per-row tuples: each data delivery becomes one ``("row", channel, value)`` per row;
    heartbeats and the end pass through. Batch boundaries disappear: for comparisons
    that must not depend on them (what ``none`` delivers per channel, say)."""
    out: list[tuple[Any, ...]] = []
    for d in deliveries:
        if d[0] == "data":
            _, c, _, payload = d
            out.extend(("row", c, v) for v in _values(payload, column))
        else:
            out.append(tuple(d))
    return out


# -- the KaZoo order log ------------------------------------------------------------------

ORDER_FRAME = struct.Struct("<IHBBIQQI")
"""The frame header as the wire codec documents it (``rust/tandem-core/src/wire/mod.rs``):
magic, wire version, kind, flags, channel, first_seq, count, body_len; little-endian,
32 bytes."""
ORDER_MAGIC = 0x544E444D  # "TNDM"
ORDER_KIND = 3
ORDER_ENTRY = struct.Struct("<IQ")  # channel, up_to_seq


@dataclass(frozen=True)
class Order:
    """One message of a KaZoo order log: the leader of ``epoch`` says, in its order number
    ``version``, "consume channel ``c`` up to (excluding) seq ``s``" for each ``(c, s)``
    of ``entries``."""

    epoch: int
    version: int
    entries: tuple[tuple[int, int], ...]


def decode_order(frame: bytes) -> Order:
    """The order one Order frame holds, header then
    ``epoch u64 | version u64 | count x (channel u32 | up_to_seq u64)``. Raises
    ``ValueError`` for bytes that are not exactly one Order frame."""
    if len(frame) < ORDER_FRAME.size + 16:
        raise ValueError(f"an order frame takes at least 48 bytes, got {len(frame)}")
    magic, _, kind, flags, _, first_seq, count, body_len = ORDER_FRAME.unpack_from(frame)
    if (magic, kind, flags, first_seq) != (ORDER_MAGIC, ORDER_KIND, 0, 0):
        raise ValueError(f"not an order frame: magic {magic:#x}, kind {kind}, flags {flags}")
    if body_len != 16 + ORDER_ENTRY.size * count or len(frame) != ORDER_FRAME.size + body_len:
        raise ValueError(f"order frame of {len(frame)} bytes announces {count} entries")
    epoch, version = struct.unpack_from("<QQ", frame, ORDER_FRAME.size)
    start = ORDER_FRAME.size + 16
    entries = tuple(
        ORDER_ENTRY.unpack_from(frame, start + i * ORDER_ENTRY.size) for i in range(count)
    )
    return Order(epoch, version, entries)


def split_orders(message: bytes) -> list[tuple[int, Order]]:
    """The orders one message of a run's order log holds, as ``(slot, order)``: whole
    Order frames back to back, each header's channel naming the partition's slot. Raises
    ``ValueError`` for anything else."""
    out, at = [], 0
    while at < len(message):
        if len(message) - at < ORDER_FRAME.size:
            raise ValueError(f"{len(message) - at} bytes at {at} are no frame header")
        slot, body_len = (
            ORDER_FRAME.unpack_from(message, at)[4],
            ORDER_FRAME.unpack_from(message, at)[7],
        )
        end = at + ORDER_FRAME.size + body_len
        if end > len(message):
            raise ValueError(f"the frame at {at} runs past the message's end")
        out.append((slot, decode_order(message[at:end])))
        at = end
    if not out:
        raise ValueError("an empty order log message")
    return out


@dataclass
class ReferenceOrderLog:
    """What the replicas of a KaZoo-ordered task partition with ``channels`` input channels
    follow, given their order log's messages in log order — DESIGN §2.3 as it reads:
    orders are stamped with the leader's epoch (the fencing token) and a version; an
    order of an epoch older than the newest the log has shown is a deposed leader's and
    is ignored (**stale**); an order of the newest epoch whose version is not above the
    last one followed was followed already (**replayed**: the log delivers at least
    once); every other order is followed, its entries consumed in turn.

    :meth:`offer` returns the verdict; ``verdicts`` keeps them all, in log order, and
    ``followed`` the entries of the followed orders, in log order."""

    channels: int
    epoch: int | None = None
    version: int = 0
    followed: list[tuple[int, int]] = field(default_factory=list)
    verdicts: list[str] = field(default_factory=list)

    def offer(self, order: Order | bytes) -> str:
        if not isinstance(order, Order):
            order = decode_order(order)
        bad = [c for c, _ in order.entries if not 0 <= c < self.channels]
        if bad:
            raise ValueError(f"order names channel {bad[0]}; the task has {self.channels}")
        if self.epoch is not None and order.epoch < self.epoch:
            verdict = "stale"
        elif order.epoch == self.epoch and order.version <= self.version:
            verdict = "replayed"
        else:
            verdict = "followed"
            self.epoch, self.version = order.epoch, order.version
            self.followed.extend(order.entries)
        self.verdicts.append(verdict)
        return verdict

    def ordered(self) -> list[int]:
        """Per channel, the furthest position the followed orders reach."""
        out = [0] * self.channels
        for c, s in self.followed:
            out[c] = max(out[c], s)
        return out


def new_topic(bootstrap: str, partitions: int, prefix: str = "t") -> str:
    """Create a Kafka topic of ``partitions`` partitions with a fresh name starting with
    ``prefix``, and return the name."""
    import uuid

    from confluent_kafka.admin import AdminClient, NewTopic

    name = f"{prefix}-{uuid.uuid4().hex[:10]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for fut in admin.create_topics([NewTopic(name, partitions, 1)]).values():
        fut.result(30)
    return name


def read_committed(bootstrap: str, topic: str, partitions: int, timeout: float = 10.0) -> list:
    """Every record of ``topic`` a ``read_committed`` consumer sees, partition by
    partition, as ``confluent_kafka`` messages (a plain consumer, no group offsets
    committed: what an outside reader gets). Raises ``AssertionError`` if a partition's
    end does not come within ``timeout`` seconds."""
    import uuid

    from confluent_kafka import Consumer, TopicPartition

    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"check-{uuid.uuid4().hex}",
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
            "enable.auto.commit": False,
        }
    )
    out = []
    try:
        for p in range(partitions):
            c.assign([TopicPartition(topic, p, 0)])
            while True:
                m = c.poll(timeout)
                assert m is not None, f"no end of partition {p} within {timeout:g} s"
                if m.error() is not None:
                    break  # end of the partition (read_committed: the last stable offset)
                out.append(m)
    finally:
        c.close()
    return out


def read_order_topic(bootstrap: str, topic: str, timeout: float = 30.0) -> list[bytes]:
    """Every message of a single-partition Kafka topic, in log order, read from its
    beginning to its current end with a plain ``confluent_kafka`` consumer (no group
    offsets committed). Raises ``TimeoutError`` if it cannot within ``timeout``."""
    import time

    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"tandem-testing-{os.getpid()}-{random.getrandbits(32):08x}",
            "enable.auto.commit": False,
        }
    )
    try:
        tp = TopicPartition(topic, 0, OFFSET_BEGINNING)
        low, high = consumer.get_watermark_offsets(tp, timeout=timeout)
        consumer.assign([tp])
        out: list[bytes] = []
        deadline = time.monotonic() + timeout
        offset = low
        while offset < high:
            if time.monotonic() > deadline:
                raise TimeoutError(f"read {offset} of {high} messages of {topic!r} in {timeout} s")
            msg = consumer.poll(0.1)
            if msg is None or msg.error() is not None:
                continue
            if msg.offset() != offset:
                raise ValueError(f"{topic!r}: expected offset {offset}, got {msg.offset()}")
            out.append(msg.value())
            offset += 1
        return out
    finally:
        consumer.close()


# -- a keyed, stateful job ----------------------------------------------------------------


def bucket(batch):
    """Map, row by row: adds column ``bucket``, the low three bits of ``key``."""
    return batch.append_column("bucket", pc.bit_wise_and(batch.column("key"), 7))


# -- functions of a whole batch ------------------------------------------------------------


def with_batch_rows(batch):
    """Map: adds column ``batch_rows``, the batch's row count, to every row."""
    return batch.append_column("batch_rows", pa.array(np.full(batch.num_rows, batch.num_rows)))


def with_batch_mean(batch, column: str = "value"):
    """Map: adds column ``batch_mean``, the mean of ``column`` over the batch."""
    mean = pc.mean(batch.column(column)).as_py() or 0.0
    return batch.append_column("batch_mean", pa.array(np.full(batch.num_rows, mean)))


def with_rank(batch, column: str = "value"):
    """Map: adds column ``rank``, each row's rank by ``column`` within its batch."""
    return batch.append_column("rank", pc.rank(batch.column(column), sort_keys="ascending"))


def two_thresholds(batch, column: str = "value"):
    """Flat map: alerts over two thresholds — the rows over 0.5, then the rows over 0.8
    (filtered twice and concatenated), so a row over both comes out twice, its second
    copy after every first-threshold alert of the batch."""
    low = batch.filter(pc.greater(batch.column(column), 0.5))
    high = batch.filter(pc.greater(batch.column(column), 0.8))
    return pa.concat_batches([low, high]) if high.num_rows else low


def noisy(batch):
    """Map that is *not* deterministic: adds a column ``noise`` of fresh random floats at
    every call. Replicas running it diverge at once (declare its output schema: the
    input's plus ``noise: double``)."""
    return batch.append_column("noise", pa.array(np.frombuffer(os.urandom(8 * batch.num_rows))))


BATCH_FUNCTIONS = {
    "rows": ("map", with_batch_rows),
    "mean": ("map", with_batch_mean),
    "rank": ("map", with_rank),
    "thresholds": ("flat_map", two_thresholds),
}
"""The batch-dependent functions above by short name, with the ``Stream`` method that
takes each (``map`` or ``flat_map``)."""


def killed_replicas(result) -> set[tuple[str, int, int]]:
    """``(task, partition, replica)`` of every replica the run's ``td.Kill`` and
    ``td.KillWorker`` faults took down: all the replicas hosted by each killed worker (the
    fault domain), as recorded in ``result.faults``. A run that masked its faults lists
    exactly these in ``result.lost_replicas``."""
    return {
        (r["task"], r["partition"], r["replica"])
        for f in result.faults
        if f["kind"] in ("kill", "killworker")
        for r in f.get("replicas", [])
    }


def lost_replicas(result) -> set[tuple[str, int, int]]:
    """``(task, partition, replica)`` of every replica in ``result.lost_replicas``."""
    return {(x["task"], x["partition"], x["replica"]) for x in result.lost_replicas}


def starved_sink_copies(result, sinks=("sink",)) -> set[tuple[str, int, int]]:
    """``(task, partition, replica)`` of the copies of the tasks named ``sinks`` lost
    as starved: a sink copy that one upstream replica dropped as a straggler (a moment
    behind on a busy machine) has only the other left, and starves when that one is lost.
    Sink copies are not rebuilt; the twin copy carries the output on."""
    return {
        (x["task"], x["partition"], x["replica"])
        for x in result.lost_replicas
        if x["task"] in sinks and x["cause"] == "starved"
    }


class CountRows(Sink):
    """A sink that keeps a row count only: what a run's sinks hold is then the runtime's
    own bookkeeping (latency record, report), nothing of the rows."""

    in_result = True

    def open(self, partition, parallelism=1, schema=None):
        super().open(partition, parallelism, schema)
        self.n = 0

    def write(self, batch):
        self.n += batch.num_rows

    def close(self):
        return self.n

    def combine(self, parts, schema=None):
        return sum(p for p in parts if p is not None)


def free_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape_metrics(port: int, timeout: float = 5.0) -> dict[str, dict[tuple, float]]:
    """One scrape of the Prometheus endpoint on 127.0.0.1:``port`` (:mod:`tandem.metrics`):
    ``{sample name: {sorted (label, value) pairs: value}}``. Raises ``OSError`` while
    nothing serves there."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as resp:
        text = resp.read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out
