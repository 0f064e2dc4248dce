"""Sinks: the unreplicated consumers at the end of a job.

A sink task partition deduplicates its input like any receiver (the engine's job) and then
hands every row exactly once, in consumption order, to its sink instance::

    sink.open(partition, parallelism, schema)
    sink.write(batch)            # any number of times
    part = sink.close()          # what this partition contributes to the job's Result

The plan keeps an unopened prototype of each sink; every sink partition gets its own deep
copy, so a sink keeps per-partition state in ``self``. ``close()`` returns a picklable value
(or None) that the engine ships back to the coordinator; :meth:`Sink.combine` merges the
partitions' values, in partition order, into what the Result exposes, and
:meth:`Sink.rows` reads the rows back out of that value (from the files a file sink wrote),
so that the engines can compare them with the reference executor's, row by row.
"""

from __future__ import annotations

import abc
import os
import time
from typing import Any

import pyarrow as pa

from tandem.exceptions import ConfigError
from tandem.operators import EVENT_TIME


class Sink(abc.ABC):
    """Base class of sinks."""

    partition: int = 0
    parallelism: int = 1
    schema: pa.Schema | None = None

    def describe(self) -> str:
        return type(self).__name__

    def check(self, schema: pa.Schema) -> None:
        """Raise ConfigError if this sink cannot take a stream of ``schema`` (e.g. a
        column it names is missing). ``Stream.sink()`` calls it, before anything runs."""
        return None

    def open(self, partition: int, parallelism: int = 1, schema: pa.Schema | None = None) -> None:
        """Start writing partition ``partition`` of ``parallelism``."""
        self.partition = partition
        self.parallelism = parallelism
        self.schema = schema

    @abc.abstractmethod
    def write(self, batch: pa.RecordBatch) -> None:
        """Consume the next rows (each row is written exactly once)."""

    def close(self) -> Any:
        """Finish; return this partition's contribution to the Result (or None)."""
        return None

    def combine(self, parts: list[Any], schema: pa.Schema | None = None) -> Any:
        """Merge the partitions' ``close()`` values (in partition order); ``schema`` is the
        sink's input schema. Runs wherever the Result is assembled."""
        return None

    def rows(self, value: Any, schema: pa.Schema | None = None) -> pa.Table | None:
        """The rows ``value`` (what :meth:`combine` returned) holds, read back from wherever
        the sink put them, as a table of some of the input's columns (``schema``); None if
        the sink keeps nothing to read back. The engines' reference check compares them, as
        a multiset, with the reference run's rows projected onto the same columns; a sink
        without rows is checked by row counts only. The default: ``value`` itself if it is
        a table."""
        return value if isinstance(value, pa.Table) else None


def _concat(parts: list[pa.Table | None], schema: pa.Schema | None) -> pa.Table | None:
    tables = [p for p in parts if p is not None]
    if not tables:
        return None if schema is None else schema.empty_table()
    return pa.concat_tables(tables)


class Collect(Sink):
    """Keeps every row in memory; the Result's ``output`` is the rows of all partitions
    (partition 0 first, each in consumption order) as one ``pyarrow.Table``."""

    def open(self, partition: int, parallelism: int = 1, schema: pa.Schema | None = None) -> None:
        super().open(partition, parallelism, schema)
        self.batches: list[pa.RecordBatch] = []

    def write(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows:
            self.batches.append(batch)

    def close(self) -> pa.Table:
        if self.batches:
            return pa.Table.from_batches(self.batches)
        if self.schema is not None:
            return self.schema.empty_table()
        return pa.table({})

    def combine(self, parts: list[Any], schema: pa.Schema | None = None) -> pa.Table | None:
        return _concat(parts, schema)


class _FileSink(Sink):
    suffix = ""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        if not self.path:
            raise ConfigError(f"sinks.{type(self).__name__}: path must not be empty")

    def describe(self) -> str:
        return f"{type(self).__name__}({self.path!r})"

    def combine(self, parts: list[Any], schema: pa.Schema | None = None) -> list[str]:
        return [p for p in parts if p]

    def rows(self, value: Any, schema: pa.Schema | None = None) -> pa.Table:
        """Every row of the files ``value`` lists (in that order), read back with the
        column types of ``schema``."""
        tables = [self._read(f, schema) for f in value]
        if not tables:
            return pa.table({}) if schema is None else schema.empty_table()
        return pa.concat_tables(tables)

    @abc.abstractmethod
    def _read(self, file: str, schema: pa.Schema | None) -> pa.Table:
        """The rows of one file this sink wrote."""

    @abc.abstractmethod
    def _writer(self, schema: pa.Schema):
        """The open writer of ``self.file``, created on first use."""

    def write(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows:
            self._writer(batch.schema).write_batch(batch)

    def close(self) -> str:
        if self.writer is None and self.schema is not None:
            self._writer(self.schema)
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        return self.file


class Parquet(_FileSink):
    """Writes partition ``p`` to ``<dir>/part-<p:05d>.parquet`` (directory created)."""

    def open(self, partition: int, parallelism: int = 1, schema: pa.Schema | None = None) -> None:
        super().open(partition, parallelism, schema)
        os.makedirs(self.path, exist_ok=True)
        self.file = os.path.join(self.path, f"part-{partition:05d}.parquet")
        self.writer = None

    def _writer(self, schema: pa.Schema):
        import pyarrow.parquet as pq

        if self.writer is None:
            self.writer = pq.ParquetWriter(self.file, schema)
        return self.writer

    def _read(self, file: str, schema: pa.Schema | None) -> pa.Table:
        import pyarrow.parquet as pq

        return pq.read_table(file, schema=schema)


class Csv(_FileSink):
    """Writes CSV with a header: to ``path`` itself when the sink has one partition, else
    partition ``p`` to ``<stem>-<p:05d><suffix>`` next to it."""

    def open(self, partition: int, parallelism: int = 1, schema: pa.Schema | None = None) -> None:
        super().open(partition, parallelism, schema)
        if parallelism == 1:
            self.file = self.path
        else:
            stem, ext = os.path.splitext(self.path)
            self.file = f"{stem}-{partition:05d}{ext}"
        parent = os.path.dirname(self.file)
        if parent:
            os.makedirs(parent, exist_ok=True)
        self.writer = None

    def _writer(self, schema: pa.Schema):
        import pyarrow.csv as pacsv

        if self.writer is None:
            self.writer = pacsv.CSVWriter(self.file, schema)
        return self.writer

    def _read(self, file: str, schema: pa.Schema | None) -> pa.Table:
        import pyarrow.csv as pacsv

        # The writer quotes every string and leaves nulls empty and unquoted.
        convert = pacsv.ConvertOptions(
            column_types=schema,
            strings_can_be_null=True,
            quoted_strings_can_be_null=False,
        )
        table = pacsv.read_csv(file, convert_options=convert)
        return table if schema is None else table.select(schema.names).cast(schema)


LATENCY_SCHEMA = pa.schema(
    [
        pa.field(EVENT_TIME, pa.int64(), nullable=False),
        pa.field("receive_ns", pa.int64(), nullable=False),
    ]
)


class Latency(Sink):
    """Records, per row, ``receive_ns`` (wall clock when the sink got it) next to its
    ``event_time_ns``; latency = ``receive_ns - event_time_ns`` on one clock (every process
    of the local engine reads the same system clock). ``clock`` is injectable for tests."""

    def __init__(self, clock=time.time_ns) -> None:
        self.clock = clock

    def open(self, partition: int, parallelism: int = 1, schema: pa.Schema | None = None) -> None:
        super().open(partition, parallelism, schema)
        if schema is not None and EVENT_TIME not in schema.names:
            raise ConfigError(
                f"sinks.Latency: its input has no {EVENT_TIME!r} column (columns: "
                f"{schema.names}); keep the column through every operator"
            )
        self.batches: list[pa.RecordBatch] = []

    def write(self, batch: pa.RecordBatch) -> None:
        if not batch.num_rows:
            return
        now = self.clock()
        et = batch.column(EVENT_TIME)
        recv = pa.repeat(pa.scalar(now, pa.int64()), batch.num_rows)
        self.batches.append(pa.RecordBatch.from_arrays([et, recv], schema=LATENCY_SCHEMA))

    def close(self) -> pa.Table:
        return pa.Table.from_batches(self.batches, schema=LATENCY_SCHEMA)

    def combine(self, parts: list[Any], schema: pa.Schema | None = None) -> pa.Table:
        return _concat(parts, LATENCY_SCHEMA)

    def rows(self, value: Any, schema: pa.Schema | None = None) -> pa.Table:
        """The event times of the rows received (the only input column it keeps)."""
        return value.select([EVENT_TIME])


__all__ = ["LATENCY_SCHEMA", "Collect", "Csv", "Latency", "Parquet", "Sink"]
