"""Kafka clients for the Kafka source and sink (confluent-kafka), kept out of the hot path.

* :func:`partition_count` and :func:`resolve_offsets` run on the coordinator, when a job
  is planned: a source's partition count and the offset every replica of each source
  partition starts from (``earliest``/``latest``/a timestamp are resolved to numbers
  once, so that replicas starting at different moments agree).
* :class:`LogReader` reads one partition on a thread of its own, from a fixed offset,
  ``read_committed``, and hands the records over in log order; it wakes the worker
  (``tandem._core.Worker.wake``) when records came. :func:`read_log` reads a partition
  in the calling thread up to its current end (the reference executor's replay).
* :class:`TransactionalWriter` writes a sink partition's rows with a transactional
  producer: one transaction in flight, on a thread of its own, so the worker never waits
  for a commit. A restartable sink's writer also stores, in every transaction, where the
  sink's input stood after the rows it commits (a record of the sink's positions topic);
  :func:`ensure_positions_topic` creates that topic, :func:`recover_positions` fences a
  lost writer and reads its last committed positions back.

Every client logs through ``logging`` (``tandem.kafka.librdkafka``), not on stderr.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime
from typing import Any

from tandem import endpoints
from tandem.exceptions import ConfigError, ServiceUnavailable, TandemError
from tandem.logs import librdkafka_logger

log = logging.getLogger(__name__)

TIMEOUT_S = 10.0
"""How long a metadata or offset request may take before the service counts as down."""

POLL_S = 0.05
"""How long a reader blocks in ``consume`` before it checks whether it must stop."""

POSITIONS_EVERY_S = 0.5
"""A restartable sink with no new rows still commits its input position this often (see
:class:`TransactionalWriter`), so that a restart never needs a replay older than this."""


def _require() -> None:
    try:
        import confluent_kafka  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError(
            "the Kafka source and sink need confluent-kafka: pip install 'tandem-stream[kazoo]'"
        ) from exc


def default_bootstrap() -> str:
    """The broker `tandem services start kafka` runs (``TANDEM_KAFKA_PORT`` on 127.0.0.1)."""
    return endpoints.default_kafka_bootstrap()


def client_config(bootstrap: str, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """librdkafka settings for ``bootstrap``, ``extra`` on top, logging through
    ``logging``."""
    conf: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "logger": librdkafka_logger("tandem.kafka.librdkafka"),
    }
    conf.update(extra or {})
    return conf


def _consumer(bootstrap: str, extra: Mapping[str, Any] | None, **settings: Any):
    from confluent_kafka import Consumer

    conf = client_config(bootstrap, extra)
    conf.setdefault("group.id", f"tandem-{threading.get_ident():x}-{time.time_ns():x}")
    conf.update(
        {
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "isolation.level": "read_committed",
            # A start offset that is gone (retention) must fail, never jump elsewhere:
            # replicas would then read different records.
            "auto.offset.reset": "error",
        }
    )
    conf.update(settings)
    return Consumer(conf)


def _unavailable(bootstrap: str, what: str, exc: BaseException) -> ServiceUnavailable:
    detail = exc.args[0].str() if exc.args and hasattr(exc.args[0], "str") else str(exc)
    return ServiceUnavailable(
        f"Kafka at {bootstrap}: {what} failed ({detail}); is the broker running? "
        "`tandem services start kafka` starts the local one"
    )


def partition_count(
    bootstrap: str, topic: str, extra: Mapping[str, Any] | None = None, timeout: float = TIMEOUT_S
) -> int:
    """How many partitions ``topic`` has; ConfigError if it does not exist,
    ServiceUnavailable if the broker does not answer."""
    _require()
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(client_config(bootstrap, extra))
    try:
        meta = admin.list_topics(topic=topic, timeout=timeout)
    except KafkaException as exc:
        raise _unavailable(bootstrap, f"reading the metadata of topic {topic!r}", exc) from exc
    info = meta.topics.get(topic)
    if info is None or info.error is not None or not info.partitions:
        why = f" ({info.error.str()})" if info is not None and info.error is not None else ""
        raise ConfigError(
            f"Kafka topic {topic!r} does not exist at {bootstrap}{why}; create it first "
            "(the broker of `tandem services` does not create topics on first use)"
        )
    return len(info.partitions)


def start_timestamp_ms(start: Any) -> int | None:
    """The timestamp (ms since the Unix epoch) a ``start=`` names, or None if it names
    none: an int is milliseconds, a ``datetime`` must carry a time zone."""
    if isinstance(start, datetime):
        if start.tzinfo is None:
            raise ConfigError(
                f"sources.Kafka: start={start!r} has no time zone; give an aware datetime "
                "(e.g. datetime.now(timezone.utc)) or milliseconds since the Unix epoch"
            )
        return int(start.timestamp() * 1000)
    if isinstance(start, int) and not isinstance(start, bool):
        if start < 0:
            raise ConfigError(f"sources.Kafka: start={start} ms is before the Unix epoch")
        return start
    return None


_NOT_LED_YET = frozenset({3, 5, 6})
"""UNKNOWN_TOPIC_OR_PART, LEADER_NOT_AVAILABLE, NOT_LEADER_FOR_PARTITION: what a broker
answers about a topic created a moment ago whose partition leaders it does not know yet."""


def _once_led(call: Callable[[], Any], timeout: float) -> Any:
    """``call()``, asked again every 0.1 s for up to ``timeout`` s while the broker answers
    that it does not know the partition's leader yet (a topic just created: the partitions
    get their leaders a moment after ``create_topics`` returns); any other error, or this
    one after the timeout, is raised."""
    from confluent_kafka import KafkaException

    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            code = err.code() if hasattr(err, "code") else None
            if code not in _NOT_LED_YET or time.monotonic() >= deadline:
                raise
        time.sleep(0.1)


def resolve_offsets(
    bootstrap: str,
    topic: str,
    partitions: int,
    start: Any,
    extra: Mapping[str, Any] | None = None,
    timeout: float = TIMEOUT_S,
) -> tuple[int, ...]:
    """The offset each partition of ``topic`` is read from, resolved now: ``"earliest"``
    (the first offset still in the log), ``"latest"`` (the next offset to be written), a
    ``{partition: offset}`` dict naming every partition, or a timestamp (the first record
    at or after it; the next offset to be written where there is none)."""
    _require()
    from confluent_kafka import KafkaException, TopicPartition

    consumer = _consumer(bootstrap, extra)
    try:
        bounds = []
        for p in range(partitions):
            try:
                bounds.append(
                    _once_led(
                        lambda p=p: consumer.get_watermark_offsets(
                            TopicPartition(topic, p), timeout=timeout, cached=False
                        ),
                        timeout,
                    )
                )
            except KafkaException as exc:
                raise _unavailable(bootstrap, f"reading the offsets of {topic}[{p}]", exc) from exc
        if start == "earliest":
            return tuple(low for low, _ in bounds)
        if start == "latest":
            return tuple(high for _, high in bounds)
        if isinstance(start, Mapping):
            missing = [p for p in range(partitions) if p not in start]
            extra_parts = [p for p in start if not (isinstance(p, int) and 0 <= p < partitions)]
            if missing or extra_parts:
                raise ConfigError(
                    f"sources.Kafka({topic!r}): start offsets must name every partition "
                    f"0..{partitions - 1} exactly (missing {missing}, unknown {extra_parts})"
                )
            out = []
            for p in range(partitions):
                off, (low, high) = start[p], bounds[p]
                if isinstance(off, bool) or not isinstance(off, int) or not low <= off <= high:
                    raise ConfigError(
                        f"sources.Kafka({topic!r}): start offset {off!r} of partition {p} is "
                        f"outside the log's offsets [{low}, {high}]"
                    )
                out.append(off)
            return tuple(out)
        ts = start_timestamp_ms(start)
        if ts is None:
            raise ConfigError(
                f"sources.Kafka({topic!r}): start must be 'earliest', 'latest', a "
                f"{{partition: offset}} dict or a timestamp, got {start!r}"
            )
        try:
            found = _once_led(
                lambda: consumer.offsets_for_times(
                    [TopicPartition(topic, p, ts) for p in range(partitions)], timeout=timeout
                ),
                timeout,
            )
        except KafkaException as exc:
            raise _unavailable(bootstrap, f"looking up offsets of {topic!r} by time", exc) from exc
        return tuple(
            tp.offset if tp.offset >= 0 else bounds[tp.partition][1]
            for tp in sorted(found, key=lambda tp: tp.partition)
        )
    finally:
        consumer.close()


def _check(msg) -> bool:
    """True for a record; False for an end-of-partition event; raises on an error the
    client cannot retry by itself."""
    err = msg.error()
    if err is None:
        return True
    from confluent_kafka import KafkaError, KafkaException

    if err.code() == KafkaError._PARTITION_EOF:
        return False
    if err.fatal() or not err.retriable():
        raise KafkaException(err)
    log.warning("Kafka: %s (retrying)", err.str())
    return False


class LogReader:
    """Reads one partition from ``offset`` on a thread of its own and queues its records
    (lists of ``confluent_kafka.Message``, in log order) for :meth:`take`; calls ``wake``
    when it queued some. It pauses while more than ``limit`` records wait. An error it
    cannot retry is kept in ``error`` (and ``wake`` called)."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        partition: int,
        offset: int,
        extra: Mapping[str, Any] | None,
        wake: Callable[[], None],
        name: str = "",
        limit: int = 65_536,
    ) -> None:
        self.bootstrap, self.topic, self.partition, self.offset = (
            bootstrap,
            topic,
            partition,
            offset,
        )
        self.extra = extra
        self.wake = wake
        self.limit = limit
        self.error: BaseException | None = None
        self._queue: deque[list] = deque()
        self._queued = 0
        self._lock = threading.Lock()
        self._room = threading.Event()
        self._room.set()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"tandem-kafka-{name or topic}-{partition}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def take(self) -> list:
        """Every record queued so far, in log order."""
        with self._lock:
            if not self._queue:
                return []
            chunks, self._queue = list(self._queue), deque()
            self._queued = 0
            self._room.set()
        return chunks[0] if len(chunks) == 1 else [m for c in chunks for m in c]

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._room.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        from confluent_kafka import TopicPartition

        try:
            consumer = _consumer(self.bootstrap, self.extra, **{"fetch.wait.max.ms": 10})
            consumer.assign([TopicPartition(self.topic, self.partition, self.offset)])
        except Exception as exc:
            self.error = exc
            self.wake()
            return
        try:
            while not self._stop.is_set():
                if not self._room.wait(POLL_S):
                    continue
                # consume() waits for its whole count or its timeout: wait for the first
                # record alone, then take what else has come without waiting.
                first = consumer.poll(POLL_S)
                if first is None:
                    continue
                msgs = [first, *consumer.consume(num_messages=1023, timeout=0)]
                records = [m for m in msgs if _check(m)]
                if not records:
                    continue
                with self._lock:
                    self._queue.append(records)
                    self._queued += len(records)
                    if self._queued >= self.limit:
                        self._room.clear()
                self.wake()
        except Exception as exc:
            self.error = exc
            self.wake()
        finally:
            with contextlib.suppress(Exception):
                consumer.close()


def read_log(
    bootstrap: str,
    topic: str,
    partition: int,
    offset: int,
    extra: Mapping[str, Any] | None = None,
    timeout: float = 30.0,
) -> Iterator[list]:
    """The records of one partition from ``offset`` to the current end of the log (the
    last stable offset: ``read_committed``), as lists of messages in log order. Stop
    iterating to stop reading."""
    _require()
    from confluent_kafka import TopicPartition

    # Without a short fetch wait, the end of the log shows only after the broker's
    # default wait for more (500 ms).
    consumer = _consumer(
        bootstrap, extra, **{"enable.partition.eof": True, "fetch.wait.max.ms": 10}
    )
    try:
        _, high = consumer.get_watermark_offsets(
            TopicPartition(topic, partition), timeout=TIMEOUT_S, cached=False
        )
        if offset >= high:
            return
        consumer.assign([TopicPartition(topic, partition, offset)])
        deadline = time.monotonic() + timeout
        while True:
            msgs = consumer.consume(num_messages=4096, timeout=POLL_S)
            records = []
            at_end = False
            for m in msgs:
                if _check(m):
                    records.append(m)
                elif m.error() is not None:
                    at_end = True
            if records:
                deadline = time.monotonic() + timeout
                yield records
            if at_end:
                return
            if time.monotonic() > deadline:
                raise ServiceUnavailable(
                    f"Kafka at {bootstrap}: reading {topic}[{partition}] from offset {offset} "
                    f"made no progress for {timeout:.0f} s"
                )
    finally:
        consumer.close()


def encode_positions(
    cut: tuple | None,
    run: int,
    rows: int,
    transactions: int,
    ranges: Mapping[int, tuple[int, int]],
) -> bytes:
    """A sink's positions record (JSON): ``cut``, where its input stood after the rows
    committed with it (the core's cut of the sink's slot, see ``tandem._core``; None: the
    input ended), the ``run`` of the job it belongs to (its t0), and the totals committed
    through this transaction — rows, transactions and offset ranges per partition of the
    sink's topic."""
    import json

    return json.dumps(
        {
            "cut": cut,
            "run": run,
            "rows": rows,
            "transactions": transactions,
            "ranges": {str(p): list(r) for p, r in ranges.items()},
        },
        separators=(",", ":"),
    ).encode()


def decode_positions(value: bytes) -> dict[str, Any]:
    """A positions record (:func:`encode_positions`) read back, its cut the tuple the core
    takes (JSON turned its tuples into lists): ``(epoch, epochs, (positions, turn, gen,
    ended, orders, log), outboxes)``."""
    import json

    record = json.loads(value)
    cut = record["cut"]
    if cut is not None:
        epoch, epochs, inbox, outboxes = cut
        if inbox is not None:
            positions, turn, gen, ended, orders, order_log = inbox
            inbox = (
                positions,
                turn,
                gen,
                ended,
                [tuple(o) for o in orders],
                None if order_log is None else tuple(order_log),
            )
        record["cut"] = (epoch, epochs, inbox, [tuple(o) for o in outboxes])
    return record


def ensure_positions_topic(
    bootstrap: str,
    topic: str,
    partitions: int,
    extra: Mapping[str, Any] | None = None,
    timeout: float = TIMEOUT_S,
) -> None:
    """Create ``topic``, where a restartable sink of ``partitions`` partitions stores its
    positions (partition ``p`` for sink partition ``p``; compacted, keyed by partition),
    unless it exists; ConfigError if it exists with fewer partitions."""
    _require()
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient(client_config(bootstrap, extra))
    new = NewTopic(topic, partitions, -1, config={"cleanup.policy": "compact"})
    try:
        admin.create_topics([new], request_timeout=timeout)[topic].result(timeout)
    except KafkaException as exc:
        err = exc.args[0] if exc.args else None
        if not hasattr(err, "code") or err.code() != KafkaError.TOPIC_ALREADY_EXISTS:
            raise _unavailable(bootstrap, f"creating the positions topic {topic!r}", exc) from exc
    have = partition_count(bootstrap, topic, extra, timeout)
    if have < partitions:
        raise ConfigError(
            f"the positions topic {topic!r} has {have} partitions, but its sink has "
            f"{partitions}: give it at least {partitions} (kafka-topics --alter "
            "--partitions), or name another one with sinks.Kafka(positions_topic=...)"
        )


def recover_positions(
    bootstrap: str,
    transactional_id: str,
    topic: str,
    partition: int,
    run: int | Iterable[int],
    extra: Mapping[str, Any] | None = None,
    timeout: float = TIMEOUT_S,
) -> dict[str, Any] | None:
    """Fence every writer with ``transactional_id`` (its open transaction is aborted, or
    completed if its commit had begun), then read the last positions record committed to
    ``topic[partition]`` (:func:`decode_positions`); None if there is none of ``run``
    (nothing was committed in this run: the last record is an earlier run's, or there is
    none). Fencing first makes the record read the last one there will ever be."""
    _require()
    # The broker answers "concurrent transactions" until the lost writer's open one is
    # aborted: ask again every 10 ms rather than after the client's default backoff (about
    # 0.5 s in all, against 50 ms, measured here).
    quick = {**(extra or {}), "retry.backoff.ms": 10}
    fence = TransactionalWriter(bootstrap, topic, transactional_id, quick, timeout=timeout)
    try:
        fence.ready(timeout)
    finally:
        fence.abort()
    return last_positions(bootstrap, topic, partition, run, extra, timeout)


def last_positions(
    bootstrap: str,
    topic: str,
    partition: int,
    run: int | Iterable[int],
    extra: Mapping[str, Any] | None = None,
    timeout: float = TIMEOUT_S,
) -> dict[str, Any] | None:
    """The last positions record committed to ``topic[partition]``, if it is of ``run``
    (or of one of several runs: a job resumed from checkpoints, run after run)
    (:func:`decode_positions`; None if it is not, or there is none). Only after every
    writer of the sink partition is fenced is it the last there will ever be."""
    runs = {run} if isinstance(run, int) else set(run)
    _require()
    from confluent_kafka import TopicPartition

    consumer = _consumer(bootstrap, extra)
    try:
        low, high = consumer.get_watermark_offsets(
            TopicPartition(topic, partition), timeout=timeout, cached=False
        )
    finally:
        consumer.close()
    # Each transaction ends with its record then a commit marker: the last one is near
    # the end; look further back only if the tail holds none (aborted ones).
    back = 64
    while True:
        start = max(low, high - back)
        last = None
        chunks = read_log(bootstrap, topic, partition, start, extra)
        try:
            for records in chunks:
                last = records[-1].value()
        finally:
            chunks.close()
        if last is not None:
            record = decode_positions(last)
            return record if record["run"] in runs else None
        if start == low:
            return None
        back *= 8


class TransactionalWriter:
    """Writes records with a transactional producer, one transaction in flight, from a
    thread of its own: :meth:`put` queues records (``(value, key, partition)`` tuples, in
    order) and returns at once; the thread takes everything queued, produces it in one
    transaction and commits, then takes what came meanwhile. A transaction thus holds what
    arrived during the previous commit: it grows with the load, and an idle stream waits
    for no timer.

    ``transactional_id`` is fixed per sink partition: a new writer with the same id fences
    this one (its next produce or commit fails; a transaction it left open is aborted by
    the broker before the new writer's first), so only one writer of a sink partition can
    ever commit. Taking the id (``init_transactions``, which fences the predecessors) is
    the thread's first step (:meth:`ready` waits for it). :meth:`close` commits what is
    queued and returns the offsets it committed, per partition, as ``(first, last)``
    ranges.

    With ``positions`` (a topic, a partition and the job's run), the writer commits only
    what a :meth:`mark` covers: a transaction holds the records queued before the latest
    mark and, written last, one record of ``positions`` — the mark's cut (where the sink's
    input stood right after those records), the run and the totals committed so far
    (:func:`encode_positions`). The rows and the position they were consumed up to thus
    become visible together or not at all, and :func:`recover_positions` reads the last
    committed one back. A mark with no record after it is committed alone every
    ``POSITIONS_EVERY_S``, so an idle sink's stored position keeps up with its input.
    The last transaction (:meth:`close`) takes everything queued and stores no cut: the
    sink's input ended.

    ``encode`` turns a ``RecordBatch`` into records, for :meth:`receive`. ``standby``: a
    writer for a twin of the sink partition's owner. It takes no ``transactional.id`` and
    writes nothing; :meth:`receive` holds each batch with where it stands in its input
    channel, for the last ``hold_s`` seconds. :meth:`take_over` makes it the owner: on its
    thread it takes the id — which fences the lost owner, a zombie's commit fails, and has
    the broker finish its open transaction — reads the owner's last positions record,
    drops every held row at or before that record's cut (per input channel, by sequence
    number), goes on counting from its totals, and writes the rest as an owner does. Rows
    that arrive meanwhile, or before the twin's input has passed the cut, are dropped in
    the same way, and no mark is committed until the input has passed it on every
    channel, so the stored position never moves back. A takeover that finds the cut older
    than what it still holds fails (``hold_s`` too short: the owner had not committed for
    that long).

    ``commit_s``: at least this long between the starts of two transactions (0: the next
    starts as soon as the previous one committed). Rows then wait up to that long before
    ``read_committed`` consumers see them, and each transaction carries more of them: the
    broker handles a handful of requests per transaction (adding partitions, producing,
    ending it and writing its markers): one transaction after another took about 40 % of
    its CPU in ``tandem bench kafka`` (docs/kafka.md). Queued records past
    ``limit`` and :meth:`close` do not wait."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        transactional_id: str,
        extra: Mapping[str, Any] | None = None,
        limit: int = 262_144,
        timeout: float = 30.0,
        positions: tuple[str, int, int] | None = None,
        commit_s: float = 0.0,
        encode: Callable[[Any], list] | None = None,
        standby: bool = False,
        hold_s: float = 10.0,
    ) -> None:
        _require()
        from confluent_kafka import Producer

        if standby and (positions is None or encode is None):
            raise ValueError("a standby writer needs positions and encode")
        self.topic = topic
        self.commit_s = commit_s
        self.positions = positions
        self.transactional_id = transactional_id
        self.timeout = timeout
        self.limit = limit
        conf = client_config(bootstrap, extra)
        conf.update(
            {
                "transactional.id": transactional_id,
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 0,
                "partitioner": "murmur2_random",  # the Java clients' choice, by key
            }
        )
        self.bootstrap = bootstrap
        self.producer = Producer(conf)
        self.error: BaseException | None = None
        self._initialised = threading.Event()
        self.committed_rows = 0
        self.transactions = 0
        self.ranges: dict[int, tuple[int, int]] = {}
        self._pending: list = []
        self._marked = 0  # the first records of _pending that _cut covers
        self._cut: tuple | None = None
        self._cut_new = False  # _cut moved since the last commit
        self._ended = False  # the last transaction (no cut: the input ended) committed
        self._committed_at = time.monotonic()
        self._began_at = -float("inf")  # when the last transaction was taken
        self._cond = threading.Condition()
        self._closing = False
        self._aborted = False
        # Standing by (a twin of the owner): what it holds, until it takes over.
        self._encode = encode
        self._standby = standby
        self._promote = False  # take_over() was called
        self._hold_s = hold_s
        self._held: deque = deque()  # (t, channel, first_seq, batch)
        self._held_mark = 0  # how many of the held batches came before the latest mark
        self._trimmed: dict[int, int] = {}  # channel -> end seq of the rows dropped as old
        self._floor: list[int] | None = None  # per channel: the owner's committed position
        # A run resumed from a checkpoint: what the lost run had committed (its totals and
        # its position, below which every row is the lost run's): a takeover before this
        # run's first commit starts from it.
        self._baseline: dict[str, Any] | None = None
        # when_committed(): (positions, callback) waiting for a commit through them
        self._waiting: list[tuple[list[int], Callable[[], None]]] = []
        self.took_over_s: float | None = None  # how long the takeover took (fence to ready)
        self._thread = threading.Thread(
            target=self._run, name=f"tandem-kafka-tx-{transactional_id}", daemon=True
        )
        self._thread.start()

    def ready(self, timeout: float | None = None) -> bool:
        """Wait until the writer holds its ``transactional.id`` (its predecessors fenced
        off and their open transaction aborted): the thread does that first, so that
        creating a writer never waits for the broker. Raises what failed it."""
        done = self._initialised.wait(timeout)
        if self.error is not None:
            raise self.error
        return done

    def put(self, records: list) -> None:
        """Queue ``records`` for the next transaction; waits while ``limit`` records are
        queued (back-pressure); raises what failed the writer."""
        with self._cond:
            while len(self._pending) >= self.limit and self.error is None:
                self._cond.wait(0.1)
            if self.error is not None:
                raise self.error
            self._pending.extend(records)
            self._cond.notify_all()

    def mark(self, cut: tuple) -> None:
        """The records queued so far are the sink's input through ``cut`` (with
        ``positions``): the next transaction commits them with it."""
        with self._cond:
            if self._standby:  # held: the cut counts once the takeover knows the floor
                self._held_mark, self._cut = len(self._held), cut
                return
            if self._floor is not None and not _past(cut, self._floor):
                return  # the owner had committed further: never store an earlier cut
            self._floor = None
            self._marked, self._cut, self._cut_new = len(self._pending), cut, True
            self._cond.notify_all()

    def receive(self, channel: int, first_seq: int, batch) -> None:
        """The next rows of a standby writer's input (``batch`` from input channel
        ``channel``, its rows at sequence numbers ``first_seq`` on): held while it stands
        by, written once it has taken over — without the rows the owner had committed."""
        with self._cond:
            if self.error is not None:
                raise self.error
            if self._standby:
                now = time.monotonic()
                self._held.append((now, channel, first_seq, batch))
                while self._held and self._held[0][0] < now - self._hold_s:
                    _, c, seq, old = self._held.popleft()
                    self._trimmed[c] = max(self._trimmed.get(c, 0), seq + old.num_rows)
                    self._held_mark = max(0, self._held_mark - 1)
                return
            if self._ended:
                return  # the owner had written everything: nothing left to write
            floor = self._floor
        if floor is not None:
            batch = _above(batch, first_seq, floor[channel])
            if batch is None:
                return
        self.put(self._encode(batch))

    def take_over(self) -> None:
        """A standby writer becomes the owner (see the class): returns at once; the
        thread fences the lost owner and reads its last position first."""
        with self._cond:
            if self._standby:
                self._promote = True
                self._cond.notify_all()

    def resume(self, committed: Mapping[str, Any], floor: list[int] | None = None) -> None:
        """Go on counting from a predecessor's totals (what :func:`recover_positions`
        found), so that :meth:`close` and the sink's report cover both; call before the
        first :meth:`put`. ``floor``: the input position (per channel) through which the
        predecessor had committed — a run resumed from a checkpoint gets its input again
        from the checkpoint's cut on, and drops what is below it (see :meth:`receive`)."""
        self.committed_rows = committed["rows"]
        self.transactions = committed["transactions"]
        self.ranges = {int(p): (lo, hi) for p, (lo, hi) in committed["ranges"].items()}
        if committed.get("ended"):  # the predecessor wrote everything there is
            with self._cond:
                self._ended = True
        elif floor is not None:
            with self._cond:
                self._floor = list(floor)
                self._baseline = {**committed, "floor": list(floor)}

    def when_committed(self, cut: tuple, then: Callable[[], None]) -> None:
        """Call ``then`` (on the writer's thread) once a transaction through ``cut`` — or
        a later mark — has committed; at once for a writer standing by, which commits
        nothing (its owner's commits count). A durable checkpoint waits for it."""
        with self._cond:
            if not self._standby and not self._ended:
                self._waiting.append((list(cut[2][0]), then))
                self._cond.notify_all()
                return
        then()

    @property
    def standing_by(self) -> bool:
        """A standby writer that has not been asked to take over: it wrote nothing."""
        return self._standby and not self._promote

    def close(self) -> dict[int, tuple[int, int]]:
        """Commit everything queued, stop, and return the committed offset ranges (a
        writer still standing by drops what it holds and returns none)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        if self.error is not None:
            raise self.error
        self.producer.flush(self.timeout)
        return dict(self.ranges)

    def abort(self) -> None:
        """Stop without committing what is queued (a transaction in flight still ends)."""
        with self._cond:
            self._pending = []
            self._closing = self._aborted = True
            self._cond.notify_all()
        self._thread.join(self.timeout)

    def _run(self) -> None:
        if self._standby:
            with self._cond:
                while not self._promote and not self._closing:
                    self._cond.wait()
                if not self._promote:  # the input ended with the owner alive
                    self._held.clear()
                    self._initialised.set()
                    return
        began = time.monotonic()
        try:
            self.producer.init_transactions(self.timeout)
        except Exception as exc:
            with self._cond:
                self.error = _unavailable(
                    self.bootstrap, f"starting transactions as {self.transactional_id!r}", exc
                )
                self._cond.notify_all()
            return
        finally:
            self._initialised.set()
        if self._standby:
            try:
                if not self._took_over():
                    return
            except BaseException as exc:
                with self._cond:
                    self.error = exc
                    self._cond.notify_all()
                return
            self.took_over_s = time.monotonic() - began
        while True:
            with self._cond:
                while not self._closing and not self._due():
                    self._cond.wait(self._wait_s())
                if self._aborted:
                    return
                if self._closing or self.positions is None:
                    batch, self._pending, cut = self._pending, [], None
                else:
                    batch, cut = self._pending[: self._marked], self._cut
                    del self._pending[: self._marked]
                self._marked, self._cut_new = 0, False
                self._began_at = time.monotonic()
                self._cond.notify_all()
                if not batch and self._closing and (self.positions is None or self._ended):
                    return
            try:
                self._commit(batch, cut)
            except BaseException as exc:
                with self._cond:
                    self.error = exc
                    self._cond.notify_all()
                return

    def _took_over(self) -> bool:
        """The takeover, once the id is taken (the lost owner fenced): what the owner
        committed last, then what of the held rows comes after it, queued as an owner's.
        False if there is nothing left to write (the owner committed its last
        transaction: the input had ended)."""
        topic, part, run = self.positions
        found = last_positions(self.bootstrap, topic, part, run, timeout=self.timeout)
        if found is None and self._baseline is not None:
            found = self._baseline  # nothing committed in this run: what the lost run had
        with self._cond:
            if found is not None:
                self.resume(found)
            if found is not None and found["cut"] is None:
                self._ended, self._standby = True, False
                self._held.clear()
                return False
            floor = None if found is None else _floor_of(found)
            behind = {
                c: end
                for c, end in self._trimmed.items()
                if end > (0 if floor is None else floor[c])
            }
            if behind:
                c = min(behind)
                at = (
                    "nothing in this run"
                    if floor is None
                    else f"through position {floor[c]} of input channel {c}"
                )
                raise TandemError(
                    f"Kafka sink {self.transactional_id}: taking over from its lost owner, "
                    f"which had committed {at}, this replica no longer holds all the rows "
                    f"after that (it keeps {self._hold_s:g} s; it dropped input channel "
                    f"{c}'s up to position {behind[c]}): the owner had not committed for "
                    "longer than that — is the broker slow, or its transactions failing?"
                )
            records: list = []
            marked = 0
            for i, (_, c, seq, batch) in enumerate(self._held):
                kept = batch if floor is None else _above(batch, seq, floor[c])
                if kept is not None:
                    records += self._encode(kept)
                if i + 1 == self._held_mark:
                    marked = len(records)
            self._held.clear()
            self._pending = records + self._pending
            self._standby, self._floor = False, floor
            cut = self._cut
            if cut is not None and self._held_mark and (floor is None or _past(cut, floor)):
                self._marked, self._cut_new, self._floor = marked, True, None
            else:
                self._marked, self._cut_new = 0, False
            self._cond.notify_all()
        log.info(
            "Kafka sink %s: took over from its lost owner at %s (%d rows held after it)",
            self.transactional_id,
            "the start" if floor is None else f"heartbeat {found['cut'][0]}",
            len(records),
        )
        return True

    def _early(self) -> float:
        """How long before ``commit_s`` has passed since the last transaction began (0:
        it has), unless the queue is full."""
        if len(self._pending) >= self.limit:
            return 0.0
        return max(0.0, self._began_at + self.commit_s - time.monotonic())

    def _wait_s(self) -> float | None:
        """How long the thread may sleep before a transaction can fall due unasked (None:
        until a put or a mark)."""
        early = self._early()
        if early > 0 and (self._pending if self.positions is None else self._marked):
            return early
        if self._cut_new:
            return max(early, POSITIONS_EVERY_S)
        return None

    def _due(self) -> bool:
        """Whether a transaction is due (with the lock held): ``commit_s`` since the last
        one began, and records queued (with ``positions``: records a mark covers), or a
        mark with no record after it that has waited ``POSITIONS_EVERY_S``."""
        if self._early() > 0:
            return False
        if self.positions is None:
            return bool(self._pending)
        if self._marked:
            return True
        return self._cut_new and time.monotonic() - self._committed_at >= POSITIONS_EVERY_S

    def _commit(self, batch: list, cut: tuple | None) -> None:
        from confluent_kafka import KafkaException

        offsets: dict[int, list[int]] = {}
        failed: list = []

        def delivered(err, msg) -> None:
            if err is not None:
                failed.append(err)
                return
            seen = offsets.setdefault(msg.partition(), [msg.offset(), msg.offset()])
            seen[0] = min(seen[0], msg.offset())
            seen[1] = max(seen[1], msg.offset())

        p = self.producer
        for attempt in range(3):
            offsets.clear()
            failed.clear()
            try:
                p.begin_transaction()
                for value, key, partition in batch:
                    while True:
                        try:
                            p.produce(
                                self.topic,
                                value=value,
                                key=key,
                                partition=-1 if partition is None else partition,
                                on_delivery=delivered,
                            )
                            break
                        except BufferError:  # the client's queue is full: let it drain
                            p.poll(0.01)
                if self.positions is not None:
                    # The record of where the input stood goes last, with the totals this
                    # transaction brings: its own offsets are known once flushed.
                    p.flush(self.timeout)
                    topic, part, run = self.positions
                    value = encode_positions(
                        cut,
                        run,
                        self.committed_rows + len(batch),
                        self.transactions + 1,
                        _merged(self.ranges, offsets),
                    )
                    p.produce(topic, value=value, key=str(part).encode(), partition=part)
                p.commit_transaction(self.timeout)
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                if err is not None and err.txn_requires_abort() and attempt < 2:
                    log.warning("Kafka sink %s: %s; retrying", self.transactional_id, err.str())
                    p.abort_transaction(self.timeout)
                    continue
                raise
            if failed:  # cannot happen after a successful commit; be loud if it does
                raise RuntimeError(f"records failed after a commit: {failed[0]}")
            break
        self.ranges = _merged(self.ranges, offsets)
        self.committed_rows += len(batch)
        self.transactions += 1
        self._committed_at = time.monotonic()
        self._ended = cut is None and self._closing
        with self._cond:
            done = [then for floor, then in self._waiting if cut is None or _past(cut, floor)]
            self._waiting = [w for w in self._waiting if cut is not None and not _past(cut, w[0])]
        for then in done:
            then()


def _floor_of(found: Mapping[str, Any]) -> list[int]:
    """The per-channel input position a positions record (or a resumed baseline) says was
    committed through."""
    if "floor" in found:
        return list(found["floor"])
    return list(found["cut"][2][0])


def _past(cut: tuple, floor: list[int]) -> bool:
    """Whether ``cut`` (a sink slot's) stands at or after ``floor`` on every input channel."""
    return all(at >= low for at, low in zip(cut[2][0], floor, strict=True))


def _above(batch, first_seq: int, floor: int):
    """The rows of ``batch`` (sequence numbers ``first_seq`` on) at ``floor`` or after; None
    if there are none."""
    skip = floor - first_seq
    if skip <= 0:
        return batch
    if skip >= batch.num_rows:
        return None
    return batch.slice(skip)


def _merged(
    ranges: Mapping[int, tuple[int, int]], offsets: Mapping[int, list[int]]
) -> dict[int, tuple[int, int]]:
    """``ranges`` widened by a transaction's first and last offset per partition."""
    out = dict(ranges)
    for part, (lo, hi) in offsets.items():
        old = out.get(part)
        out[part] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))
    return out


__all__ = [
    "LogReader",
    "TransactionalWriter",
    "client_config",
    "decode_positions",
    "default_bootstrap",
    "encode_positions",
    "ensure_positions_topic",
    "last_positions",
    "partition_count",
    "read_log",
    "recover_positions",
    "resolve_offsets",
]
