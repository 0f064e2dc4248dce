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


def _parse_rate(rate: Any, what: str) -> Fraction | None:
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
        self.rate = _parse_rate(rate, what)
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
        self.rate = _parse_rate(rate, what)
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


__all__ = ["Csv", "Parquet", "Source", "Synthetic", "splitmix64"]
