"""Typed stubs of the native module ``tandem._core`` (rust/tandem-py)."""

from collections.abc import Sequence
from types import TracebackType
from typing import Any, Literal, TypeAlias

import pyarrow
import pyarrow as pa

__version__: str
build_profile: Literal["release", "debug"]

class TandemError(Exception): ...
class ConfigError(TandemError): ...
class ProtocolError(TandemError): ...
class AuthenticationError(ProtocolError): ...
class ChannelClosed(TandemError): ...
class InputStarved(TandemError): ...
class DeterminismError(TandemError): ...
class ServiceUnavailable(TandemError): ...

# --- wire (rust/tandem-py/src/wire.rs) ---

HEADER_LEN: int
"""Size of the fixed frame header in bytes (32)."""
DEFAULT_MAX_FRAME_BYTES: int
"""Default limit on a frame's body in bytes (64 MiB)."""
WIRE_VERSION: int
"""Wire version spoken by this build."""

def encode_data_frame(channel: int, first_seq: int, batch: pyarrow.RecordBatch) -> bytes:
    """Encode rows ``[first_seq, first_seq + batch.num_rows)`` of ``channel`` as a Data frame.

    Raises ``tandem.ProtocolError`` for an empty batch or a sequence-number overflow.
    """

def encode_heartbeat_frame(
    channel: int, seq: int, epoch: int, digest: bytes | None = None
) -> bytes:
    """Encode the heartbeat of cycle ``epoch`` at seq ``seq`` of ``channel``, carrying
    ``digest`` (the 16-byte cycle digest of the channel's data since its previous heartbeat)
    if given. Raises ``tandem.ConfigError`` for a digest of another length."""

def encode_end_frame(channel: int, seq: int) -> bytes:
    """Encode the end marker of ``channel`` at seq ``seq``."""

def encode_order_frame(
    channel: int, epoch: int, version: int, entries: list[tuple[int, int]]
) -> bytes:
    """Encode a KaZoo order of leader ``epoch``; entries are ``(channel, up_to_seq)`` pairs."""

def decode_frame(
    data: bytes, max_frame_bytes: int = ...
) -> (
    tuple[Literal["data"], int, int, pyarrow.RecordBatch]
    | tuple[Literal["heartbeat"], int, int, int, bytes | None]
    | tuple[Literal["end"], int, int]
    | tuple[Literal["order"], int, int, int, list[tuple[int, int]]]
):
    """Decode exactly one frame.

    Returns ``("data", channel, first_seq, batch)``,
    ``("heartbeat", channel, seq, epoch, digest)`` (``digest``: 16 bytes, or None if the frame
    carries none), ``("end", channel, seq)`` or
    ``("order", channel, epoch, version, [(channel, up_to_seq)])``.
    Raises ``tandem.ProtocolError`` naming the problem for malformed, truncated, oversized or
    trailing bytes.
    """

# --- dedup and consumption orders (rust/tandem-py/src/{dedup,merge}.rs) ---------------

DataDelivery: TypeAlias = tuple[Literal["data"], int, int, pa.RecordBatch]
"""``("data", channel, first_seq, batch)``: rows of ``channel`` from seq ``first_seq``."""
HeartbeatDelivery: TypeAlias = tuple[Literal["heartbeat"], int, int, bool]
"""``("heartbeat", channel, epoch, first)``: ``first`` is True the first time the epoch is
seen; the task forwards the heartbeat on every output channel exactly then."""
EndDelivery: TypeAlias = tuple[Literal["end"]]
"""``("end",)``: every input channel has ended (repeated on every later call)."""
MergeDelivery: TypeAlias = DataDelivery | HeartbeatDelivery | EndDelivery
RowCountDelivery: TypeAlias = tuple[Literal["data"], int, int, int]
"""``("data", channel, first_seq, num_rows)``: a data delivery of ``drain_many``, whose rows
are in the record batch it returns beside the deliveries."""
MergeManyDelivery: TypeAlias = RowCountDelivery | HeartbeatDelivery | EndDelivery

class Dedup:
    """Duplicate sending, first copy wins: one high-water mark per logical channel.

    Every upstream replica sends every element, so each seq arrives several times; only
    the first copy is kept. Runs the lock-free core (the transport feeds the same code from
    its I/O threads). Channels are numbered ``0..channels``; seqs start at 0 and count
    rows and markers alike.

    Raises ``tandem.ConfigError`` for bad arguments and ``tandem.ProtocolError`` for a gap
    (an element starting after the first missing seq): gaps are never skipped; offer the
    missing seqs first, or hold the element and offer it again once ``next_seq`` reached it.
    """

    def __init__(self, channels: int, capacity: int | None = None) -> None:
        """``capacity``: queued elements per channel (default 1024)."""
    @property
    def channels(self) -> int: ...
    def next_seq(self, channel: int) -> int:
        """First seq of ``channel`` not yet accepted."""
    def offer(self, channel: int, first_seq: int, batch: pa.RecordBatch) -> pa.RecordBatch | None:
        """Offer rows ``[first_seq, first_seq + batch.num_rows)``. Returns the rows not seen
        before — a zero-copy slice of ``batch`` — or None if every row was a duplicate."""
    def offer_heartbeat(self, channel: int, seq: int, epoch: int) -> bool:
        """Offer a heartbeat at ``seq``; True if this copy was the first."""
    def offer_end(self, channel: int, seq: int) -> bool:
        """Offer the end marker at ``seq``; True if this copy was the first."""
    def offer_many(
        self,
        channel: int,
        first_seqs: Sequence[int],
        batches: pa.Table | pa.RecordBatchReader | Sequence[pa.RecordBatch],
    ) -> int:
        """Offer many batches (``first_seqs[i]`` is the first seq of batch ``i``; a Table's
        chunks are its batches) with the GIL released; returns the number of new rows (the
        rows themselves are not returned). Concurrent calls from several threads race on
        the lock-free claim, like the transport's I/O threads."""

class _MergeBase:
    """Shared interface of LiveRobin, Fcfs and Positional (not a runtime class).

    The object owns its input channels: push each channel's deduplicated, contiguous
    elements (``tandem.ConfigError`` if an element does not start where the previous one
    ended, or follows the end marker), then take deliveries.
    """

    @property
    def channels(self) -> int: ...
    @property
    def waiting_on(self) -> int | None:
        """The channel the merge is blocked on; None if any channel would do (or it waits
        for an order, or has ended)."""
    def push(self, channel: int, first_seq: int, batch: pa.RecordBatch) -> None: ...
    def push_heartbeat(self, channel: int, seq: int, epoch: int) -> None: ...
    def push_end(self, channel: int, seq: int) -> None: ...
    def next(self) -> MergeDelivery | None:
        """The next delivery in this replica's consumption order, or None: wait for input."""
    def drain(self) -> list[MergeDelivery]:
        """Every delivery available now, in order (stops after ``("end",)``)."""
    def push_many(
        self,
        channel: int,
        first_seqs: Sequence[int],
        rows: pa.Table | pa.RecordBatchReader | pa.RecordBatch | Sequence[pa.RecordBatch],
        heartbeats: Sequence[tuple[int, int]] | None = None,
        end: int | None = None,
    ) -> None:
        """Append many elements of ``channel`` in one call, all or none: data batches
        starting at ``first_seqs``, the heartbeats ``(seq, epoch)`` and the end marker at
        ``end``. ``rows`` holds the batches' rows back to back, chunked like the batches or
        in one chunk; each batch ends where the channel's next element starts (the last at
        the end of ``rows``) and is a zero-copy slice. A batch of no rows is left out, as
        ``Dedup`` leaves it out (LiveRobin would give it no turn; Fcfs's rotation would
        move past it). The same elements pushed one by one give the same deliveries."""
    def drain_many(self) -> tuple[list[MergeManyDelivery], pa.RecordBatch | None]:
        """:meth:`drain` in one crossing: ``(deliveries, rows)``, a data delivery being
        ``("data", channel, first_seq, num_rows)`` and ``rows`` the delivered batches'
        rows back to back in delivery order, as one record batch (a copy; None if no batch
        was delivered). ``tandem.ConfigError``, before anything is taken, unless every
        queued batch has one schema."""
    def pending(self) -> list[int]:
        """Elements pushed but not yet delivered, per channel."""
    def join(self, count: int, after_epoch: int) -> int:
        """Append ``count`` channels that join after heartbeat ``after_epoch`` (a live
        rescale): LiveRobin gives them turns from the end of that epoch's cycle (or once
        every other channel ended), Fcfs at once; Positional raises ConfigError. Returns
        the first new channel's index."""

class LiveRobin(_MergeBase):
    """LiveRobin (Algorithm 1 of the paper): deterministic round-robin over the channels
    still active in the current heartbeat cycle; a channel leaves the cycle when its
    heartbeat is dequeued (first of its epoch or not). A turn is one element of the
    current channel: a whole batch (never sliced), a heartbeat or the end marker; an empty
    batch is skipped without taking a turn. The delivered batches and their order depend
    only on each channel's sequence of batches, never on arrival timing."""

    def __init__(self, channels: int) -> None: ...

class Fcfs(_MergeBase):
    """``ordering="none"``: whatever is available, rotating over ready channels. Not
    deterministic across replicas (the baseline)."""

    def __init__(self, channels: int) -> None: ...

class Positional(_MergeBase):
    """The KaZoo follower: consumes channels in the order given by ``push_order``."""

    def __init__(self, channels: int) -> None: ...
    def push_order(self, channel: int, up_to_seq: int) -> None:
        """Append "consume ``channel`` until its next seq is ``up_to_seq``". A leader's
        bounds fall on batch boundaries; a batch straddling one is sliced defensively.
        Orders at or before the channel's position are no-ops, so replaying an order log
        is harmless."""
    def position(self, channel: int) -> int:
        """First seq of ``channel`` not yet delivered."""

# --- transport (rust/tandem-py/src/{inbox,orderlog,orderfeed,outbox}.rs) ---------------

class Delivery:
    """One step of an Inbox's consumption order (immutable).

    * ``kind == "data"``: ``channel``, ``first_seq`` and ``batch`` are set;
    * ``kind == "heartbeat"``: ``channel``, ``epoch`` and ``first`` are set (``first`` is
      True the first time the epoch is seen: forward the heartbeat on every output then);
    * ``kind == "end"``: every upstream has ended; every other field is None.
    """

    @property
    def kind(self) -> Literal["data", "heartbeat", "end"]: ...
    @property
    def channel(self) -> int | None:
        """Logical input channel: the index of the upstream in ``Inbox(upstreams=...)``."""
    @property
    def first_seq(self) -> int | None: ...
    @property
    def epoch(self) -> int | None: ...
    @property
    def first(self) -> bool | None: ...
    @property
    def batch(self) -> pa.RecordBatch | None: ...

class Inbox:
    """Receives the upstream replicas of one task partition replica over TCP.

    Authenticates every connection (job id + per-job secret), deduplicates the copies sent
    by the replicas of each upstream partition (first copy wins), and merges the logical
    channels in the order every replica agrees on (``"liverobin"``) or first come, first
    served (``"none"``). Bad connections (garbage, failed handshake, unknown sender,
    malformed frames) are closed on their own and counted in ``stats()``.

    Determinism is checked as data arrives: heartbeats carry each upstream replica's digest
    of its output for the cycle, and two replicas of one upstream partition that disagree
    are a divergence. ``on_divergence="fail"`` (the default) makes ``next()`` raise
    ``tandem.DeterminismError`` naming the partition, replicas, cycle and digests;
    ``"log"`` logs the first divergence per input and keeps delivering. ``stats()`` reports
    them either way.

    Raises ``tandem.ConfigError`` for bad arguments, ``OSError`` if the port cannot be bound.
    """

    def __init__(
        self,
        job: str,
        secret: bytes,
        upstreams: list[tuple[int, int]],
        ordering: Literal["liverobin", "kazoo", "none"] = "liverobin",
        queue_capacity: int = 1024,
        max_frame_bytes: int = 67108864,
        host: str = "127.0.0.1",
        port: int = 0,
        handshake_timeout: float = 2.0,
        on_divergence: Literal["fail", "log"] = "fail",
        worker: Worker | None = None,
        me: tuple[int, int, int] | None = None,
        name: str | None = None,
        resume: InboxCut | None = None,
        wait_orphaned: bool = False,
        parked: bool = False,
    ) -> None:
        """``upstreams``: ``(task, partition)`` pairs; the position is the channel index.
        ``queue_capacity``: frames queued per channel before the readers stop reading (the
        back-pressure). ``port=0`` picks a free port (see ``port``). ``worker``: the
        ``Worker`` that will serve this inbox (``Worker.add_task``); its ``next()`` then
        wakes on this inbox's input. ``me``: ``(task, partition, replica)`` this inbox
        receives for, and ``name`` how its log lines (logger ``tandem.core.inbox``) name
        it; without ``me`` they name the inbox by its address. ``resume``: the inbox part
        of a twin's cut (``SlotCut[2]``): every channel starts at the twin's position (what
        comes before is dropped as consumed) and the merge at the twin's state.
        ``wait_orphaned``: a channel whose every upstream replica is gone before its end
        waits for one to come back (replication 1, rolled back to a checkpoint) instead of
        failing ``next()`` with ``InputStarved``. ``parked``: take nothing (the peers'
        input waits, held by them) until ``unpark`` gives the cut to start from — a
        partition a live rescale adds, set up before its state exists."""
    @property
    def port(self) -> int: ...
    @property
    def parked(self) -> bool:
        """Bound with ``parked=True`` and not unparked yet."""
    def unpark(self, cut: InboxCut) -> None:
        """Start a parked inbox at ``cut`` (an inbox cut, ``SlotCut[2]``): each channel from
        its position on, the merge from its state. Raises ConfigError if not parked."""
    def next(self, timeout: float | None = None) -> Delivery | None:
        """The next delivery, or None after ``timeout`` seconds (None = wait until one
        arrives). Releases the GIL while waiting; Ctrl-C interrupts. Raises
        ``tandem.ChannelClosed`` after ``close()``, and ``tandem.DeterminismError`` on every
        call once upstream replicas diverged under ``on_divergence="fail"``."""
    def order_feed(self) -> OrderFeed | None:
        """The inbox's side of the KaZoo order log (``ordering="kazoo"`` only, else None)."""
    def stats(self) -> dict[str, Any]:
        """``{"channels": [{"upstream", "accepted_rows", "duplicate_rows", "next_seq",
        "queued_seqs"}], "connections": [{"peer", "identity", "frames", "bytes", "open",
        "error"}], "rejected_connections": int, "divergences": [{"channel", "upstream",
        "epoch", "replicas", "digests"}], "divergence_count": int, "merge_wait_s": float}``.
        ``divergences`` holds the first 16 found: ``replicas`` is (the replica whose
        heartbeat came first, the one that differed), ``digests`` their digests in hex, in
        that order. ``merge_wait_s``: how long the merge held input back — the total time
        during which some channel had accepted elements queued and the merge delivered
        nothing."""
    def close(self) -> None:
        """Stop listening, close every connection, join the I/O threads. Idempotent."""
    def __enter__(self) -> Inbox: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

class OrderLog:
    """The orders a replica of a task partition with ``channels`` input channels follows,
    given the order log's messages in log order (stale epochs fenced off, replays ignored):
    the same decisions ``OrderFeed`` makes inside a replica, for replaying a log."""

    def __init__(self, channels: int) -> None: ...
    def offer(self, frame: bytes) -> Literal["followed", "stale", "replayed"]:
        """Offer the next message (an encoded Order frame); raises like ``OrderFeed.offer``."""
    def drain(self) -> list[tuple[int, int]]:
        """The followed entries ``(channel, up_to_seq)`` not taken yet, oldest first."""
    def ordered(self) -> list[int]:
        """Per channel, the furthest position the followed orders reach."""
    def stats(self) -> dict[str, Any]:
        """``{"followed", "stale", "replayed", "entries", "epoch", "version"}``."""

class OrderFeed:
    """The KaZoo orderer's handle on a ``kazoo`` inbox; usable from any thread while the
    inbox's consumer waits in ``next()``. Every replica offers it the order log's messages
    in log order; the leader decides new orders from ``arrived()`` beyond ``ordered()``."""

    def offer(self, frame: bytes) -> Literal["followed", "stale", "replayed"]:
        """Offer the next order log message (an encoded Order frame): ``"stale"`` = a
        deposed leader's order, fenced off; ``"replayed"`` = a version already followed.
        Raises ``ProtocolError`` for bytes that are not one Order frame, ``ConfigError`` for
        an order naming a channel this task does not have."""
    def arrived(self) -> list[int]:
        """Per input channel, the first sequence number not yet arrived here."""
    def ordered(self) -> list[int]:
        """Per input channel, the furthest position the followed orders reach."""
    def stats(self) -> dict[str, Any]:
        """``{"followed", "stale", "replayed", "entries", "epoch", "version"}``."""
    def hold_at(self, epoch: int) -> None:
        """Should this replica lead, hold its orders right after heartbeat ``epoch`` on
        every input channel until every channel is ordered through it: a twin following
        the log is cut there for a savepoint while this replica orders on."""
    def generation(self) -> int:
        """A token for ``wait``: read it, look at ``arrived()``, then wait with it."""
    def wait(self, generation: int, timeout: float) -> bool:
        """Sleep (GIL released) until input arrives or an order is followed after
        ``generation`` was read, or ``timeout`` seconds pass. True if woken."""

class OrderPublisher:
    """Publishes the orders of every KaZoo partition one worker leads, from one thread, one
    message in flight: ``next`` returns the orders due across all of them at once, once
    the last message was followed (``OrderRouter.offer``), so they go to the log together.
    Each leadership counts an order as delivered once its replica has followed it; what
    arrives meanwhile goes into the next one. ``batch``: at most this many entries per
    order; ``resend_after``: an order not followed after this many seconds is published
    again from the log; ``pace``: at least this many seconds between two messages.
    Created with the ``Worker`` whose inboxes (``Inbox(..., worker=w)``) it serves."""

    def __init__(
        self, worker: Worker, batch: int = 1000, resend_after: float = 5.0, pace: float = 0.0
    ) -> None: ...
    def lead(self, slot: int, feed: OrderFeed, epoch: int) -> None:
        """Lead the partition numbered ``slot`` in the run (its orders' frame header
        channel) with ``epoch`` through ``feed``, from what its log covers now (read the
        log to its end first). ``ConfigError`` if the feed's inbox belongs to another
        worker."""
    def resign(self, slot: int) -> tuple[int, int] | None:
        """Stop publishing for ``slot``: ``(orders published, orders given up on)`` of
        that leadership, or None if it did not lead."""
    def lost(self, slot: int) -> None:
        """The last order for ``slot`` was not delivered: publish again from the log at
        the next step (safe from any thread, also while ``next`` sleeps)."""
    def next(self, timeout: float) -> list[tuple[int, bytes]]:
        """Sleep (GIL released) until orders are due; return them all as ``(slot,
        order)``, or ``[]`` after ``timeout`` seconds. One thread at a time."""

class OrderRouter:
    """Hands each order of an order log message to its partition's feeds in this worker,
    and tells ``publisher`` a message was followed."""

    def __init__(self, publisher: OrderPublisher) -> None: ...
    def add(self, slot: int, feed: OrderFeed) -> None:
        """Route the orders for ``slot`` to ``feed`` (a replica of it in this worker)."""
    def offer(self, message: bytes, offset: int) -> list[tuple[int, str, int, int, int]]:
        """Offer the message at ``offset``, in log order (orders for slots with no feed are
        skipped, and so are those for a feed whose log was read past ``offset`` already: a
        replica rebuilt from a twin's cut); returns what was not followed, as ``(slot,
        "stale" | "replayed", epoch, version, current epoch)``. ``ProtocolError`` for a
        message that is not whole Order frames, ``ConfigError`` for an order naming a
        channel its task does not have."""

def order_frames(message: bytes) -> list[tuple[int, bytes]]:
    """The Order frames of one order log message as ``(slot, frame)``; ``ProtocolError``
    unless it is a non-empty sequence of whole Order frames."""

class DialedLink:
    """A connection ``Outbox.dial`` made, for ``Outbox.attach``; closed if dropped
    unattached."""

class Outbox:
    """The output of one task partition replica.

    Partitions emitted rows over the output channels (one per downstream partition),
    gives every row, heartbeat and end marker the channel's next sequence number, and sends
    each emitted batch's part of a channel at once, as frames of at most ``batch_rows`` rows
    cut at offsets ``0, batch_rows, 2 * batch_rows, ...`` of that part (no timer: replicas
    that emit the same batches send identical frames), to every replica of the channel's
    downstream partition. Each channel keeps a cycle digest of the data it sent since its
    last heartbeat; the heartbeat carries it, so receivers can compare replicas. A replica
    whose connection fails is dropped (logged); a channel with no live replica left sends
    nothing (logged), and once no channel has one, sending raises ``tandem.ChannelClosed``.

    ``partitioner``: ``"forward"`` (exactly one channel: the downstream partition with this
    partition's index), ``"hash"`` (needs ``key``: an int, string or binary column; a key's
    group ``xxh3(key) % key_groups`` goes to channel ``group * n // key_groups``; nulls go
    to channel 0), ``"rebalance"`` (row i → channel i % n), ``"broadcast"``.
    Construction dials every replica (retrying until ``connect_timeout`` seconds); raises
    ``tandem.AuthenticationError`` if refused, ``tandem.ChannelClosed`` if a channel has no
    reachable replica, ``tandem.ConfigError`` for bad arguments.
    """

    def __init__(
        self,
        job: str,
        secret: bytes,
        me: tuple[int, int, int],
        downstream: list[list[tuple[str, int]]],
        partitioner: Literal["forward", "hash", "rebalance", "broadcast"] = "forward",
        key: str | None = None,
        key_groups: int = 128,
        batch_rows: int = 1024,
        connect_timeout: float = 10.0,
        queue_frames: int = 256,
        name: str | None = None,
        evict_after_ms: float | None = None,
        replay_cycles: int | None = None,
        replay_bytes: int = 64 << 20,
        hold_orphans: bool = False,
    ) -> None:
        """``me``: ``(task, partition, replica)``. ``downstream[c]``: ``(host, port)`` of
        each replica of downstream partition ``c``. ``queue_frames``: frames queued per
        connection before ``emit`` blocks. ``name``: how log lines (logger
        ``tandem.core.outbox``) name this replica (default ``task T partition P replica
        R``). ``evict_after_ms``: drop a downstream replica on another process whose
        frames have waited this long to be read, or that has ``queue_frames / 2`` frames
        waiting, while another replica of its channel keeps up (logged); the backlog a
        worker reads is then each channel's least backed-up link's. None: wait for every
        replica. ``replay_cycles``: keep each channel's last that many heartbeat cycles
        (fewer if they hold more than ``replay_bytes``) for ``attach``; None keeps
        nothing. ``hold_orphans``: a channel that lost every link goes on into its replay
        window only (until ``attach``) instead of failing with ``ChannelClosed``."""
    def dial(self, address: tuple[str, int]) -> DialedLink:
        """Dial and authenticate ``address``, a replica of a downstream partition rebuilt
        from a twin's cut, for a later ``attach`` (blocks, GIL released; touches nothing
        of the outbox, so any thread may dial while another sends). Raises
        ConnectionError if it cannot be reached or refuses the handshake."""
    def attach(self, channel: int, link: DialedLink, after_epoch: int) -> None:
        """Make ``link`` a link of downstream partition ``channel``, a replica rebuilt from
        a twin's cut at heartbeat ``after_epoch``: send it what the replay window holds
        after that heartbeat (one write), then everything from now on. Raises if the link
        was attached before, or the window no longer reaches back to the cut ("needs a
        later cut")."""
    def switch_at(
        self,
        epoch: int,
        downstream: list[list[tuple[str, int] | Inbox]],
        partitioner: Literal["forward", "hash", "rebalance", "broadcast"],
        key: str | None = None,
        key_groups: int = 128,
    ) -> None:
        """Change the channel set right after heartbeat ``epoch`` leaves (the downstream
        task rescaled live): rows then go to ``len(downstream)`` channels routed by
        ``partitioner``; present channels go on with their seqs and digests to the replicas
        ``downstream[c]`` (their present links retire after heartbeat ``epoch``; an empty
        list keeps them), the rest are new, from seq 0. Dials first (GIL released, the
        outbox not held). Raises ConfigError once heartbeat ``epoch`` was sent, or for
        fewer channels."""
    def cancel_switch(self) -> bool:
        """Disarm the switch ``switch_at`` armed, if still to come; whether one was."""
    @property
    def last_heartbeat(self) -> int | None:
        """The last heartbeat epoch sent (None: none yet)."""
    def emit(self, batch: pa.RecordBatch) -> None:
        """Partition ``batch`` and send each channel's part now. A batch that cannot be
        encoded or digested is refused whole (nothing sent). Blocks (GIL released) while a
        downstream is slow."""
    def heartbeat(self, epoch: int) -> None:
        """Send a heartbeat of cycle ``epoch`` on every channel, carrying the channel's
        digest of the data sent since its previous heartbeat."""
    def end(self) -> None:
        """Send the end marker on every channel (the digest of the data after the last
        heartbeat is recorded under epoch ``2**64 - 1``)."""
    def digests(self) -> list[tuple[int, int, bytes]]:
        """The cycle digests closed since the last call, oldest first: ``(channel, epoch,
        digest)`` with a 16-byte digest, one per channel per heartbeat, plus one per
        channel under epoch ``2**64 - 1`` once ``end()`` ran. Drains them (at most 65,536
        are kept between calls; the oldest are dropped first)."""
    def close(self) -> None:
        """Close the connections after they delivered what was queued. Without ``end()``
        first, receivers see this replica stop mid-stream. Idempotent."""
    def abort(self) -> None:
        """Cut every connection now, dropping what is queued (a crash, for fault
        injection)."""
    def take_evicted(self) -> list[tuple[int, str]]:
        """The downstream replicas dropped as stragglers since the last call: ``(channel,
        "host:port")``."""
    @property
    def next_seqs(self) -> list[int]:
        """The seq the next element of each channel takes, as of the last completed call;
        never blocks, even while another thread is inside ``emit``."""
    def __enter__(self) -> Outbox: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

InboxCut = tuple[
    list[int],
    int,
    int | None,
    list[bool],
    list[tuple[int, int]],
    tuple[int | None, int, list[int], int] | None,
]
"""``(positions, turn, gen, ended, orders, log)``: per channel the first seq not consumed,
the merge's state (KaZoo: the followed orders not yet consumed) and, for KaZoo, the place
in the order log ``(epoch, version, ordered, through)``."""

SlotCut = tuple[int, list[int], InboxCut | None, list[tuple[list[int], int]]]
"""A replica's state at a heartbeat-cycle boundary, without its operator's: ``(epoch,
input channel epochs, inbox cut or None for a source, per output (seqs, rows emitted))``."""

WORKER_CREDIT_FRAMES: int
"""A worker slot whose downstream links hold this many queued frames is not served until
they drain."""

class WorkItem:
    """One thing for the Python runtime to do (see ``Worker.next``)."""

    kind: Literal["data", "watermark", "end", "failed", "cut"]
    slot: int
    channel: int | None
    """data: the input channel."""
    first_seq: int | None
    epoch: int | None
    """watermark: every input of the slot passed heartbeat ``epoch``."""
    batch: pyarrow.RecordBatch | None
    error: BaseException | None
    """failed: why the slot stopped (``DeterminismError``, ``ChannelClosed``, ...)."""
    cut: SlotCut | None
    """cut: the slot at the boundary ``request_cut`` asked for (None: it cannot be cut);
    take the operator's snapshot before running anything else of the slot."""
    at: int | None
    """cut asked by ``request_cut_at``: the epoch asked for (``cut`` None: too late)."""

class Worker:
    """Serves many task replicas ("slots") of one worker process from one thread, in Rust:
    tracks their watermarks, forwards their heartbeats, sends their sources' heartbeats on
    the clock, and hands out only the work that runs Python code. A slot whose downstream
    links are backed up (``WORKER_CREDIT_FRAMES``) is not served until they drain, so one
    slot never blocks on another that the same thread must run.

    Create it first, pass it to every ``Inbox`` it serves, then add the slots. The caller
    runs each item to completion (output emitted on the slot's outboxes) before calling
    ``next()`` again: that keeps heartbeat ``k`` behind every row that precedes it."""

    def __init__(self) -> None: ...
    def add_source(
        self,
        outboxes: list[Outbox],
        t0_ns: int,
        heartbeat_ns: int,
        resume: SlotCut | None = None,
    ) -> int:
        """A source slot: heartbeat ``k`` goes out on ``outboxes`` at ``t0_ns +
        k·heartbeat_ns`` (ns since the Unix epoch), once ``allow``ed. ``resume``: a twin's
        cut to continue from. Returns the slot."""
    def add_task(
        self,
        inbox: Inbox,
        outboxes: list[Outbox],
        watermarks: bool,
        resume: SlotCut | None = None,
    ) -> int:
        """An operator or sink slot; ``watermarks``: hand out watermark advances (the
        operator overrides ``on_watermark``). ``resume``: a twin's cut to continue from
        (the inbox bound with its inbox part). Returns the slot."""
    def request_cut(self, slot: int) -> None:
        """Cut ``slot`` at its next heartbeat-cycle boundary: ``next()`` hands out a
        ``"cut"`` item right after that heartbeat leaves."""
    def request_cut_at(self, slot: int, epoch: int) -> None:
        """Cut ``slot`` right after it forwards heartbeat ``epoch`` (an aligned cut, for a
        checkpoint): ``next()`` hands out a ``"cut"`` item with ``at=epoch`` — its cut taken
        after the last heartbeat forwarded together with ``epoch``, nothing between them —
        or with ``cut=None`` at once if the slot already forwarded ``epoch`` or finished."""
    def hold(self, slot: int, on: bool) -> None:
        """Hold ``slot`` where it stands (``on``) or let it go on: while held, ``next()``
        hands out nothing of it — no input, heartbeat or watermark — and its input waits
        in its inbox."""
    def allow(self, slot: int, epoch: int) -> None:
        """A source slot may send its heartbeats through ``epoch``, each when due."""
    def heartbeats_through(self, slot: int, epoch: int) -> None:
        """Send a source slot's heartbeats through ``epoch`` now."""
    def ready(self, slot: int) -> bool:
        """Whether the slot's downstream links have room (a source emits only then)."""
    def retire(self, slot: int) -> None:
        """Stop serving ``slot``."""
    def join_inputs(
        self, slot: int, upstreams: list[tuple[int, int]], after_epoch: int
    ) -> tuple[int, int]:
        """Give ``slot``'s inbox one input channel per upstream ``(task, partition)`` (new
        partitions of an upstream task: a live rescale), taking turns after heartbeat
        ``after_epoch`` (LiveRobin: from the end of that cycle); they count as having
        delivered it. Returns the new channels' ``(start, stop)``."""
    def cancel_join(self, slot: int) -> None:
        """Take back the channels of the last ``join_inputs`` of ``slot`` (a live rescale
        given up); raises ConfigError once they took input."""
    def wake(self) -> None:
        """Bring a waiting ``next()`` back early (it returns None once no slot has work),
        from any thread, without a lock: a source reading a log on a thread of its own
        calls it when records came."""
    def next(self, timeout: float | None = None) -> WorkItem | None:
        """The next work item, or None after ``timeout`` seconds (None: wait) or after
        ``wake()``. Releases the GIL while waiting; Ctrl-C interrupts."""
    def stats(self) -> dict[str, int]:
        """``{"heartbeats", "data", "watermarks", "credit_waits"}``."""
    def slot_stats(self) -> list[dict[str, Any]]:
        """Per slot, in slot order: ``{"watermark": int, "backlog": int, "active": bool}``
        — the last heartbeat epoch it forwarded (a source: sent), the frames queued on its
        output links, whether it is still served. Reads only."""

def sync_level() -> None:
    """Cache the effective level of the logger ``tandem.core`` as the Rust core's: records
    below it are never formatted. Inbox and Outbox construction call it too."""

def flush_logs(timeout: float = 5.0) -> bool:
    """Wait (GIL released) until every Rust log record logged before the call has been
    handed to ``logging``, at most ``timeout`` seconds; True if it was."""

def shutdown_logs() -> None:
    """Stop forwarding Rust log records (at interpreter exit; ``tandem.logs`` registers
    it with ``atexit``)."""

def _log_from_thread(
    level: str, target: str, message: str, me: tuple[int, int, int] | None = None
) -> None:
    """Test hook: log ``message`` from a Rust thread that never holds the GIL."""
