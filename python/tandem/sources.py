"""Replayable, deterministic sources.

A source is a finite or unbounded sequence of rows ``0, 1, 2, ...`` (the *global* row
index ``i``, stored in ``source_seq``). Row ``i`` has a deterministic content and a logical
release offset ``offset(i)`` (ns after the job's time origin ``t0``); its ``event_time_ns``
is ``t0 + offset(i)``. With a ``rate`` (rows per second), ``offset(i) = floor(i * 1e9 /
rate)`` in exact integer arithmetic; file sources without a rate release every row at
offset 0 ("as fast as possible").

Partitions: a source with parallelism ``P`` splits its rows round-robin — partition ``p``
owns rows ``i = j*P + p`` for ``j = 0, 1, ...`` (its *local* index ``j``). Every
partition's rows are therefore in release order, and all partitions together release the
source's rows at the source's rate.

Everything here is a pure function of the source's parameters, the row indices and
``t0``: two replicas of a source partition, in different processes, produce byte-identical
batches. Nothing depends on Python's hash seed, clocks or global random state.
"""

from __future__ import annotations

import abc
import math
import os
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import numpy as np
import pyarrow as pa

from tandem.exceptions import ConfigError
from tandem.heartbeat import DEFAULT_GENERATORS
from tandem.operators import EVENT_TIME, SOURCE_SEQ

_NS = 1_000_000_000
_U64 = np.uint64
_MASK64 = (1 << 64) - 1
_GAMMA = _U64(0x9E3779B97F4A7C15)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser applied to ``x + gamma`` (uint64, wrapping), vectorised."""
    z = x.astype(_U64) + _GAMMA
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


def _stream(seed: int, stream: int, idx: np.ndarray) -> np.ndarray:
    """64 random-looking bits per global row index for one (seed, stream) pair."""
    base = splitmix64(np.array([(seed * 0x100 + stream) & _MASK64], dtype=_U64))[0]
    return splitmix64(idx.astype(_U64) * _GAMMA + base)


def _unit(bits: np.ndarray) -> np.ndarray:
    """uint64 bits → float64 uniform in [0, 1), exactly (53 bits)."""
    return (bits >> _U64(11)).astype(np.float64) * (1.0 / (1 << 53))


def parse_rate(rate: Any, what: str) -> Fraction | None:
    """A source's ``rate=`` (rows per second, > 0; None: all rows at once) as the exact
    fraction the release schedule uses; ``what`` names the source in the ConfigError."""
    if rate is None:
        return None
    if isinstance(rate, bool) or not isinstance(rate, int | float | Fraction):
        raise ConfigError(f"{what}: rate must be a number of rows per second, got {rate!r}")
    if not math.isfinite(float(rate)) or rate <= 0:
        raise ConfigError(f"{what}: rate must be > 0 rows per second, got {rate!r}")
    return (
        Fraction(rate).limit_denominator(1_000_000) if isinstance(rate, float) else Fraction(rate)
    )


class Source(abc.ABC):
    """Base class of sources. Subclasses define :meth:`schema`, :meth:`total_rows` and
    :meth:`_rows`; release offsets come from ``self.rate`` (None = all at offset 0)."""

    rate: Fraction | None = None

    def describe(self) -> str:
        return type(self).__name__

    @abc.abstractmethod
    def schema(self) -> pa.Schema:
        """The schema of every batch, ``source_seq`` and ``event_time_ns`` included."""

    @abc.abstractmethod
    def total_rows(self, duration_ns: int | None) -> int | None:
        """Rows released in ``[0, duration_ns)`` (None: unbounded)."""

    def _rows(self, idx: np.ndarray) -> list[pa.Array]:
        """The payload columns (everything but source_seq/event_time_ns) of global rows:
        what :meth:`read` builds its batches from. A source that overrides :meth:`read`
        instead need not implement it."""
        raise NotImplementedError(f"{type(self).__name__} implements neither _rows nor read")

    # -- release schedule ------------------------------------------------------------

    def offsets_ns(self, idx: np.ndarray) -> np.ndarray:
        """Release offsets (ns after t0) of global rows ``idx`` (int64)."""
        idx = np.asarray(idx, dtype=np.int64)
        if self.rate is None:
            return np.zeros(len(idx), dtype=np.int64)
        mult = _NS * self.rate.denominator
        top = int(idx.max()) if len(idx) else 0
        if top * mult < (1 << 63):
            return (idx * mult) // self.rate.numerator
        return np.array([(int(i) * mult) // self.rate.numerator for i in idx], dtype=np.int64)

    def rows_before(self, offset_ns: int) -> int:
        """Global rows with release offset strictly before ``offset_ns`` (ignores any
        end of the source: clamp with :meth:`total_rows`)."""
        if offset_ns <= 0:
            return 0
        if self.rate is None:
            return 1 << 62
        # offset(i) < x  <=>  i * 1e9 * den < x * num  (floor(a/b) < x <=> a < x*b)
        num, den = self.rate.numerator, self.rate.denominator
        return -(-(offset_ns * num) // (_NS * den))

    # -- partitions --------------------------------------------------------------------

    @staticmethod
    def local_count(global_rows: int, partition: int, parallelism: int) -> int:
        """How many of the first ``global_rows`` rows partition ``partition`` owns."""
        return max(0, (global_rows - partition + parallelism - 1) // parallelism)

    def partition_rows(self, partition: int, parallelism: int, duration_ns: int) -> int:
        """Rows partition ``partition`` releases in ``[0, duration_ns)``."""
        total = self.total_rows(duration_ns)
        return self.local_count(total, partition, parallelism)

    def partition_rows_before(self, partition: int, parallelism: int, offset_ns: int) -> int:
        """Rows of the partition released strictly before ``offset_ns``."""
        return self.local_count(self.rows_before(offset_ns), partition, parallelism)

    def read(
        self, partition: int, parallelism: int, j0: int, j1: int, t0_ns: int
    ) -> pa.RecordBatch:
        """Local rows ``[j0, j1)`` of a partition as one batch (vectorised)."""
        if not 0 <= partition < parallelism or j0 < 0 or j1 < j0:
            raise ConfigError(
                f"{self.describe()}: cannot read rows [{j0}, {j1}) of partition {partition} "
                f"of {parallelism}"
            )
        idx = np.arange(j0, j1, dtype=np.int64) * parallelism + partition
        cols = [
            pa.array(idx, pa.int64()),
            pa.array(self.offsets_ns(idx) + t0_ns, pa.int64()),
            *self._rows(idx),
        ]
        return pa.RecordBatch.from_arrays(cols, schema=self.schema())


class LogSource(Source):
    """A source whose rows, batches and heartbeats come from a replicated log (Kafka)
    instead of a clock: every replica of a source partition reads the same log partition
    from the same offset, fixed when the job is planned, and cuts it where the log says
    (:class:`tandem.heartbeat.LogSchedule`: at the heartbeat markers the generators write
    into the log, and at every ``batch_rows`` data rows). The runtime reads it on a thread
    (:meth:`reader`), the reference executor replays it (:meth:`replay`).

    Subclasses implement the methods below; ``generators`` is how many heartbeat
    generators the engine runs for it (0: you run ``tandem heartbeats`` yourself)."""

    generators: int = DEFAULT_GENERATORS

    def total_rows(self, duration_ns: int | None) -> int | None:
        return None  # as many as the log holds before the run's last heartbeat

    def partition_rows(self, partition: int, parallelism: int, duration_ns: int) -> int:
        raise ConfigError(
            f"{self.describe()} reads a log: how many rows a run reads is known only once it "
            "ran (Result.events_in)"
        )

    def natural_parallelism(self) -> int | None:
        """The log's partition count: the source's parallelism."""
        return None

    @abc.abstractmethod
    def resolve(self, parallelism: int) -> None:
        """Fix, on the plan's own copy of the source, what every replica must agree on
        (the offset each partition is read from); ConfigError if the log no longer has
        ``parallelism`` partitions."""

    @abc.abstractmethod
    def reader(self, partition: int, wake, name: str = "", offset: int | None = None):
        """A started-on-demand reader of the partition (``start()``, ``take()`` → records
        in log order, ``stop()``, ``error``) that calls ``wake()`` when records came; it
        reads from the start offset, or from ``offset``."""

    @abc.abstractmethod
    def next_offset(self, record) -> int:
        """Where the log continues after ``record``."""

    @abc.abstractmethod
    def replay(self, partition: int):
        """The partition's records from its start offset to the log's current end, as
        lists of records in log order."""

    @abc.abstractmethod
    def marker(self, record) -> int | None:
        """The instant (ns since the Unix epoch) a heartbeat marker stands for, or None if
        ``record`` is a data row (:func:`tandem.heartbeat.marker_ns`)."""

    @abc.abstractmethod
    def decode(self, partition: int, records: list) -> pa.RecordBatch:
        """The batch of data rows ``records`` (never markers), in order."""

    @abc.abstractmethod
    def heartbeat_target(self) -> tuple[str, str, dict]:
        """``(bootstrap, topic, client settings)`` the engine's generators mark."""


_JSON_TYPES = (
    pa.types.is_integer,
    pa.types.is_floating,
    pa.types.is_boolean,
    pa.types.is_string,
    pa.types.is_large_string,
    pa.types.is_timestamp,
)


SMALL_BATCH_ROWS = 64
"""A Kafka batch of at most this many rows is parsed by Python's ``json`` where it can
(:func:`_parse_small`): a ``pyarrow.json.read_json`` call costs about 0.2 ms whatever its
size (12 rows: 0.21 ms, against 0.05 ms with ``json``; 1,000 rows: 0.7 ms against 3 ms),
and a Kafka source cuts a batch at every heartbeat marker."""


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _distinct_keys(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("a key repeats")
    return out


def _is_int64(v) -> bool:
    return type(v) is int and -(2**63) <= v < 2**63


def _is_float64(v) -> bool:
    return (type(v) is float and math.isfinite(v)) or type(v) is int


_SMALL_CHECKS = {
    pa.int64(): _is_int64,
    pa.float64(): _is_float64,
    pa.bool_(): lambda v: type(v) is bool,
    pa.string(): lambda v: type(v) is str,
    pa.large_string(): lambda v: type(v) is str,
}
"""The column types :func:`_parse_small` parses, and which JSON values each takes (what
``read_json`` takes: an integer for a float column, never a boolean for a number)."""


def _parse_small(schema: pa.Schema, values: list) -> list[pa.Array] | None:
    """``values`` (JSON objects) parsed into the columns of ``schema`` with Python's
    ``json``, or None wherever that might differ from ``pyarrow.json.read_json``: a column
    of another type, a value that is not one JSON object with distinct keys, a number
    that is not finite, a JSON value of another type than its column's, a null in a
    non-nullable column. The caller then parses with ``read_json``, which decides."""
    import json

    checks = [_SMALL_CHECKS.get(f.type) for f in schema]
    if None in checks:
        return None
    try:
        objs = [
            json.loads(v, object_pairs_hook=_distinct_keys, parse_constant=_no_constant)
            for v in values
        ]
    except (ValueError, TypeError, RecursionError):
        return None
    if not all(type(o) is dict for o in objs):
        return None
    cols = []
    for f, ok in zip(schema, checks, strict=True):
        col = [o.get(f.name) for o in objs]
        for v in col:
            if v is None:
                if not f.nullable:
                    return None
            elif not ok(v):
                return None
        cols.append(pa.array(col, f.type))
    return cols


class Kafka(LogSource):
    """The records of a Kafka topic: one source partition per Kafka partition, each read
    ``read_committed`` by every replica from the same offset.

    * ``bootstrap``: the brokers (default: the local one of ``tandem services``).
    * ``start``: ``"earliest"`` (default), ``"latest"``, a ``{partition: offset}`` dict
      naming every partition, or a timestamp — an aware ``datetime`` or milliseconds since
      the Unix epoch (each partition from its first record at or after it). Resolved to
      offsets once, when the job is planned, so that every replica starts at the same one.
    * Rows: ``source_seq`` is the record's offset (offsets are not contiguous: markers
      and transaction markers take some), ``event_time_ns`` the record's timestamp, or the
      column ``event_time`` names (int64 nanoseconds, or a timestamp). The payload:
      with ``schema=None`` the columns ``key`` and ``value`` (binary, nullable: the
      record's bytes as they are); with ``schema`` (a ``pyarrow.Schema`` or a mapping of
      column name → type) every value must be a JSON object, parsed into those columns
      (a missing field is null; a field not declared is ignored; a value that does not
      parse, or a missing non-nullable field, fails the job naming the offset).
    * ``config``: more librdkafka settings for every client (security, say).
    * ``generators``: heartbeat generators the engine runs for the topic (default 2, so
      that none is a single point of failure; 0: run ``tandem heartbeats`` yourself, with
      the job's ``heartbeat_ms``).

    Records carrying the ``tandem-heartbeat`` header are heartbeat markers
    (:mod:`tandem.heartbeat`): they cut batches and advance the heartbeat epoch, and never
    reach an operator. The job's parallelism for the source is the topic's partition count.
    """

    def __init__(
        self,
        topic: str,
        bootstrap: str | None = None,
        start: Any = "earliest",
        event_time: str | None = None,
        schema: pa.Schema | Mapping[str, Any] | None = None,
        config: Mapping[str, Any] | None = None,
        generators: int = DEFAULT_GENERATORS,
    ) -> None:
        what = f"sources.Kafka({topic!r})"
        if not isinstance(topic, str) or not topic:
            raise ConfigError(f"sources.Kafka: topic must be a non-empty string, got {topic!r}")
        if bootstrap is not None and (not isinstance(bootstrap, str) or not bootstrap):
            raise ConfigError(f"{what}: bootstrap must be 'host:port[,...]', got {bootstrap!r}")
        from tandem.kafka import start_timestamp_ms

        if not (
            start in ("earliest", "latest")
            or isinstance(start, Mapping)
            or start_timestamp_ms(start) is not None
        ):
            raise ConfigError(
                f"{what}: start must be 'earliest', 'latest', a {{partition: offset}} dict or "
                f"a timestamp (aware datetime, or ms since the Unix epoch), got {start!r}"
            )
        if isinstance(generators, bool) or not isinstance(generators, int) or generators < 0:
            raise ConfigError(f"{what}: generators must be an int >= 0, got {generators!r}")
        if schema is not None and not isinstance(schema, pa.Schema):
            if not isinstance(schema, Mapping):
                raise ConfigError(
                    f"{what}: schema must be a pyarrow.Schema or a mapping of column -> type, "
                    f"got {type(schema).__name__}"
                )
            try:
                schema = pa.schema(
                    [
                        (n, pa.type_for_alias(t) if isinstance(t, str) else t)
                        for n, t in schema.items()
                    ]
                )
            except (TypeError, ValueError, KeyError) as exc:
                raise ConfigError(f"{what}: schema {dict(schema)!r} is not valid: {exc}") from exc
        if schema is not None:
            for f in schema:
                if f.name in (SOURCE_SEQ, EVENT_TIME):
                    raise ConfigError(
                        f"{what}: schema column {f.name!r} clashes with the column the source "
                        "adds itself; rename it"
                    )
                if not any(ok(f.type) for ok in _JSON_TYPES):
                    raise ConfigError(
                        f"{what}: schema column {f.name!r} has type {f.type}; JSON values "
                        "parse into integers, floats, booleans, strings and timestamps"
                    )
        if event_time is not None:
            if schema is None:
                raise ConfigError(
                    f"{what}: event_time={event_time!r} names a column, but without schema= "
                    "the rows are raw key/value bytes; declare the JSON schema, or leave "
                    "event_time out to use the record timestamps"
                )
            if event_time not in schema.names:
                raise ConfigError(
                    f"{what}: event_time={event_time!r} is not a column of the schema "
                    f"{schema.names}"
                )
            typ = schema.field(event_time).type
            if not (pa.types.is_int64(typ) or pa.types.is_timestamp(typ)):
                raise ConfigError(
                    f"{what}: event_time column {event_time!r} is {typ}; it must be int64 "
                    "(ns since the Unix epoch) or a timestamp"
                )
        self.topic = topic
        self.bootstrap = bootstrap
        self.start = dict(start) if isinstance(start, Mapping) else start
        self.event_time = event_time
        self.payload = schema
        self.config = dict(config or {})
        self.generators = generators
        self.offsets: tuple[int, ...] | None = None
        """Where each partition is read from: set by :meth:`resolve`, at plan time."""
        self._partitions: int | None = None

    def describe(self) -> str:
        return f"Kafka({self.topic!r})"

    def _bootstrap(self) -> str:
        from tandem.kafka import default_bootstrap

        if self.bootstrap is None:
            self.bootstrap = default_bootstrap()
        return self.bootstrap

    def schema(self) -> pa.Schema:
        fields = [
            pa.field(SOURCE_SEQ, pa.int64(), nullable=False),
            pa.field(EVENT_TIME, pa.int64(), nullable=False),
        ]
        if self.payload is None:
            fields += [pa.field("key", pa.binary()), pa.field("value", pa.binary())]
        else:
            fields += list(self.payload)
        return pa.schema(fields)

    def natural_parallelism(self) -> int:
        if self._partitions is None:
            from tandem.kafka import partition_count

            self._partitions = partition_count(self._bootstrap(), self.topic, self.config)
        return self._partitions

    def resolve(self, parallelism: int) -> None:
        from tandem.kafka import partition_count, resolve_offsets

        n = partition_count(self._bootstrap(), self.topic, self.config)
        if n != parallelism:
            raise ConfigError(
                f"{self.describe()}: the topic has {n} partitions now, but the job reads it "
                f"with parallelism {parallelism}: one source partition per Kafka partition; "
                "build the job again"
            )
        self.offsets = resolve_offsets(self._bootstrap(), self.topic, n, self.start, self.config)

    def _offset(self, partition: int) -> int:
        if self.offsets is None:
            raise ConfigError(
                f"{self.describe()}: no start offsets; a source is read through a plan "
                "(job.plan() resolves them)"
            )
        return self.offsets[partition]

    def heartbeat_target(self) -> tuple[str, str, dict]:
        return self._bootstrap(), self.topic, {str(k): str(v) for k, v in self.config.items()}

    def reader(self, partition: int, wake, name: str = "", offset: int | None = None):
        from tandem.kafka import LogReader

        return LogReader(
            self._bootstrap(),
            self.topic,
            partition,
            self._offset(partition) if offset is None else offset,
            self.config,
            wake,
            name=name,
        )

    def next_offset(self, record) -> int:
        return record.offset() + 1

    def replay(self, partition: int):
        from tandem.kafka import read_log

        return read_log(
            self._bootstrap(), self.topic, partition, self._offset(partition), self.config
        )

    def marker(self, record) -> int | None:
        from tandem.heartbeat import marker_ns

        return marker_ns(record.headers())

    def decode(self, partition: int, records: list) -> pa.RecordBatch:
        seq = pa.array([m.offset() for m in records], pa.int64())
        values = [m.value() for m in records]
        if self.payload is None:
            cols = [
                pa.array([m.key() for m in records], pa.binary()),
                pa.array(values, pa.binary()),
            ]
        else:
            cols = self._parse(partition, records, values)
        if self.event_time is None:
            ms = np.fromiter((m.timestamp()[1] for m in records), np.int64, len(records))
            et = pa.array(np.maximum(ms, 0) * 1_000_000, pa.int64())
        else:
            et = self._event_time(
                partition, records, cols[self.payload.names.index(self.event_time)]
            )
        return pa.RecordBatch.from_arrays([seq, et, *cols], schema=self.schema())

    def _parse(self, partition: int, records: list, values: list) -> list[pa.Array]:
        import io

        import pyarrow.json as pajson

        def parse(data: bytes) -> pa.Table:
            return pajson.read_json(
                io.BytesIO(data),
                read_options=pajson.ReadOptions(use_threads=False, block_size=len(data) + 1),
                parse_options=pajson.ParseOptions(
                    explicit_schema=self.payload,
                    unexpected_field_behavior="ignore",
                    newlines_in_values=True,
                ),
            )

        bad = None
        if all(values) and len(values) <= SMALL_BATCH_ROWS:
            cols = _parse_small(self.payload, values)
            if cols is not None:
                return cols
        if all(values):
            try:
                table = parse(b"\n".join(values))
            except pa.ArrowInvalid:
                table = None
            if table is not None and table.num_rows == len(values):
                return [
                    c.combine_chunks().cast(f.type)
                    for c, f in zip(table.columns, self.payload, strict=True)
                ]
        for m, v in zip(records, values, strict=True):  # find the culprit
            try:
                if not v:
                    raise ValueError("the value is empty or null")
                if parse(v).num_rows != 1:
                    raise ValueError("the value holds more than one JSON object")
            except (pa.ArrowInvalid, ValueError) as exc:
                bad = (m, v, exc)
                break
        m, v, exc = bad if bad is not None else (records[0], values[0], "unknown")
        shown = v if v is None or len(v) <= 200 else v[:200] + b"..."
        raise ValueError(
            f"{self.describe()} partition {partition} offset {m.offset()}: the value is not a "
            f"JSON object of the declared schema ({exc}): {shown!r}"
        )

    def _event_time(self, partition: int, records: list, col: pa.Array) -> pa.Array:
        if pa.types.is_timestamp(col.type):
            col = col.cast(pa.timestamp("ns", tz=col.type.tz)).cast(pa.int64())
        if col.null_count:
            import pyarrow.compute as pc

            i = pc.index(pc.is_null(col), True).as_py()
            raise ValueError(
                f"{self.describe()} partition {partition} offset {records[i].offset()}: the "
                f"event_time column {self.event_time!r} is null"
            )
        return col


class Synthetic(Source):
    """A generated stream: row ``i`` is released at ``t0 + i / rate``.

    Columns: ``source_seq`` (= i), ``event_time_ns``, ``key`` (int64 in ``[0, keys)``),
    ``value`` (float64 in [0, 1)), ``payload`` (fixed-size binary, only if
    ``payload_bytes > 0``) and one column per ``extras`` entry (name → "int64" or
    "float64"). Every value is a splitmix64 hash of ``(seed, column, i)``, a pure integer
    function, so rows are identical in every process and run.

    ``skew``: 0 draws keys uniformly (integer arithmetic only); ``skew > 0`` draws
    ``key = floor(keys * u ** (1 + skew))`` for a uniform ``u``, a power law where low keys
    are hot (skew 1: key 0 gets ~sqrt(1/keys) of the rows). The power uses libm, so a
    skewed stream is reproducible on one platform; the uniform one everywhere.

    ``limit``: stop after that many rows in total (None: as many as the run's duration
    releases).
    """

    def __init__(
        self,
        rate: float,
        keys: int = 1000,
        seed: int = 0,
        skew: float = 0.0,
        payload_bytes: int = 0,
        extras: Mapping[str, str] | None = None,
        limit: int | None = None,
    ) -> None:
        what = "sources.Synthetic"
        self.rate = parse_rate(rate, what)
        if self.rate is None:
            raise ConfigError(f"{what}: rate is required (rows per second), got None")
        if isinstance(keys, bool) or not isinstance(keys, int) or keys < 1:
            raise ConfigError(f"{what}: keys must be an int >= 1, got {keys!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"{what}: seed must be an int, got {seed!r}")
        if not isinstance(skew, int | float) or not math.isfinite(skew) or skew < 0:
            raise ConfigError(f"{what}: skew must be a float >= 0, got {skew!r}")
        if (
            isinstance(payload_bytes, bool)
            or not isinstance(payload_bytes, int)
            or (payload_bytes < 0)
        ):
            raise ConfigError(f"{what}: payload_bytes must be an int >= 0, got {payload_bytes!r}")
        if limit is not None and (not isinstance(limit, int) or limit < 0):
            raise ConfigError(f"{what}: limit must be None or an int >= 0, got {limit!r}")
        extras = dict(extras or {})
        taken = {SOURCE_SEQ, EVENT_TIME, "key", "value", "payload"}
        for name, typ in extras.items():
            if name in taken:
                raise ConfigError(f"{what}: extras column {name!r} clashes with a built-in column")
            if typ not in ("int64", "float64"):
                raise ConfigError(
                    f"{what}: extras[{name!r}] has type {typ!r}; use 'int64' or 'float64'"
                )
        self.keys = keys
        self.seed = seed
        self.skew = float(skew)
        self.payload_bytes = payload_bytes
        self.extras = extras
        self.limit = limit

    def describe(self) -> str:
        return f"Synthetic(rate={self.rate}, keys={self.keys}, seed={self.seed})"

    def schema(self) -> pa.Schema:
        fields = [
            pa.field(SOURCE_SEQ, pa.int64(), nullable=False),
            pa.field(EVENT_TIME, pa.int64(), nullable=False),
            pa.field("key", pa.int64(), nullable=False),
            pa.field("value", pa.float64(), nullable=False),
        ]
        if self.payload_bytes:
            fields.append(pa.field("payload", pa.binary(self.payload_bytes), nullable=False))
        for name, typ in self.extras.items():
            fields.append(pa.field(name, pa.type_for_alias(typ), nullable=False))
        return pa.schema(fields)

    def total_rows(self, duration_ns: int | None) -> int | None:
        if duration_ns is None:
            return self.limit
        n = self.rows_before(duration_ns)
        return n if self.limit is None else min(n, self.limit)

    def _rows(self, idx: np.ndarray) -> list[pa.Array]:
        n = len(idx)
        kbits = _stream(self.seed, 1, idx)
        if self.skew == 0.0:
            key = (kbits % _U64(self.keys)).astype(np.int64)
        else:
            u = _unit(kbits)
            key = np.minimum(
                np.floor(self.keys * np.power(u, 1.0 + self.skew)), self.keys - 1
            ).astype(np.int64)
        cols = [pa.array(key, pa.int64()), pa.array(_unit(_stream(self.seed, 2, idx)))]
        if self.payload_bytes:
            bits = _stream(self.seed, 3, idx).astype("<u8").view(np.uint8).reshape(n, 8)
            reps = -(-self.payload_bytes // 8)
            buf = np.ascontiguousarray(np.tile(bits, (1, reps))[:, : self.payload_bytes])
            cols.append(
                pa.FixedSizeBinaryArray.from_buffers(
                    pa.binary(self.payload_bytes), n, [None, pa.py_buffer(buf.tobytes())]
                )
            )
        for k, typ in enumerate(self.extras.values()):
            bits = _stream(self.seed, 16 + k, idx)
            if typ == "int64":
                cols.append(pa.array((bits >> _U64(1)).astype(np.int64), pa.int64()))
            else:
                cols.append(pa.array(_unit(bits), pa.float64()))
        return cols


class _FileSource(Source):
    """A file read once per process and replayed by row index."""

    kind = "file"

    def __init__(self, path: str | os.PathLike, rate: float | None = None) -> None:
        self.path = os.fspath(path)
        what = f"sources.{type(self).__name__}({self.path!r})"
        if not os.path.exists(self.path):
            raise ConfigError(f"{what}: no such file or directory; check the path")
        self.rate = parse_rate(rate, what)
        self._table: pa.Table | None = None
        schema = self._load().schema
        for col in (SOURCE_SEQ, EVENT_TIME):
            if col in schema.names:
                raise ConfigError(
                    f"{what}: the file already has a column {col!r}, which the source adds "
                    "itself; rename or drop it in the file"
                )

    def describe(self) -> str:
        return f"{type(self).__name__}({self.path!r})"

    def __getstate__(self) -> dict:
        # The table is re-read in the process that uses the source, not pickled.
        state = dict(self.__dict__)
        state["_table"] = None
        return state

    @abc.abstractmethod
    def _read(self) -> pa.Table:
        """The whole file as a table."""

    def _load(self) -> pa.Table:
        if self._table is None:
            try:
                self._table = self._read().combine_chunks()
            except (OSError, pa.ArrowInvalid) as exc:
                raise ConfigError(f"{self.describe()}: cannot read the file: {exc}") from exc
        return self._table

    def schema(self) -> pa.Schema:
        fields = [
            pa.field(SOURCE_SEQ, pa.int64(), nullable=False),
            pa.field(EVENT_TIME, pa.int64(), nullable=False),
        ]
        return pa.schema(fields + list(self._load().schema))

    def total_rows(self, duration_ns: int | None) -> int | None:
        n = self._load().num_rows
        if duration_ns is None or self.rate is None:
            return n
        return min(n, self.rows_before(duration_ns))

    def _rows(self, idx: np.ndarray) -> list[pa.Array]:
        taken = self._load().take(pa.array(idx, pa.int64()))
        return [c.combine_chunks() for c in taken.columns]


class Parquet(_FileSource):
    """Rows of a Parquet file (or directory of files), in file order."""

    def _read(self) -> pa.Table:
        import pyarrow.parquet as pq

        return pq.read_table(self.path)


class Csv(_FileSource):
    """Rows of a CSV file with a header line, in file order (types inferred by pyarrow)."""

    def _read(self) -> pa.Table:
        import pyarrow.csv as pacsv

        return pacsv.read_csv(self.path)


__all__ = [
    "Csv",
    "Kafka",
    "LogSource",
    "Parquet",
    "Source",
    "Synthetic",
    "parse_rate",
    "splitmix64",
]
