"""Sources that replay Spark data.

``tandem_spark.sources.DataFrame(df, order_by=[...])`` turns a DataFrame (or a table:
``spark.table(name)``) into a replayable tandem source. Every replica of a source
partition must emit exactly the same rows in the same batches (DESIGN §2 invariant 1),
and a DataFrame promises neither: Spark may return its rows in another order, or other
rows (a changing table, ``rand()``), each time it is evaluated. So the source evaluates
the DataFrame exactly once, when it is created: one Spark job sorts it and writes it, from
the executors, as Parquet files under a directory; every replica then reads its share of
those files with pyarrow, and nothing is collected on the driver.

The order is total: rows are sorted by ``order_by``, then by every other column Spark can
sort (all but maps), so two rows that tie on all of them are identical and their order
cannot show. Spark writes the sorted rows as part files in order (an ``orderBy`` is
range-partitioned: partition ``i``'s rows precede partition ``i + 1``'s, and the file of
partition ``i`` is ``part-<i>-...``), which gives every row a position ``0 .. N-1``.

Partitions: source partition ``p`` of ``P`` owns a contiguous range of positions, as many
rows as the round-robin split of the other sources gives it (``ceil`` or ``floor`` of
``N / P``); its local row ``j`` is released at the same offset as a round-robin source's
(the offset of global row ``j * P + p``: all at once without a ``rate``, else ``rate`` rows
per second over all partitions). Batches are cut by :meth:`tandem.plan.Plan.source_schedule`
like every source's. ``source_seq`` is the row's position in the sorted order.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
from typing import Any

import numpy as np
import pyarrow as pa

from tandem.exceptions import ConfigError
from tandem.operators import EVENT_TIME, SOURCE_SEQ
from tandem.sources import Source, parse_rate
from tandem_spark.session import is_local


def _filesystem(path: str):
    """(pyarrow filesystem, path inside it) for a local path or a URI (hdfs://, s3://...)."""
    from pyarrow import fs

    if "://" in path and not path.startswith("file://"):
        return fs.FileSystem.from_uri(path)
    if path.startswith("file://"):
        path = path[len("file://") :]
    return fs.LocalFileSystem(), os.path.abspath(path)


def _absolute(path: str) -> str:
    """A local path made absolute (workers may not share the driver's working directory);
    a URI as it is."""
    return path if "://" in path else os.path.abspath(path)


def _part_key(name: str) -> tuple[int, int, str]:
    """Sort key of a Spark part file: its partition number, then its chunk (``c000``,
    ``c001`` when ``spark.sql.files.maxRecordsPerFile`` splits a partition)."""
    m = re.match(r"^part-(\d+)", name)
    chunk = re.search(r"-c(\d+)(?:\.|$)", name)
    return (int(m[1]), int(chunk[1]) if chunk else 0, name)


class DataFrame(Source):
    """A deterministic replay of a Spark DataFrame (or table), sorted by ``order_by``.

    ``df``: a ``pyspark.sql.DataFrame``; it is evaluated once, here, by one Spark job that
    sorts it and writes it as Parquet (see the module documentation), so creating the
    source takes as long as that job. ``order_by``: a column name or a list of them, the
    order rows are replayed in (required: a DataFrame has no order of its own); ties are
    broken by the other columns. ``rate``: rows per second over all partitions (None: all
    at once, as fast as the job runs). ``path``: where the sorted rows are written — by
    default a temporary directory on this machine, removed when this process exits; on a
    cluster give a directory every executor can read (HDFS, S3, a shared file system),
    which must not exist yet and is left in place afterwards.

    Columns: ``source_seq`` (the row's position in the order), ``event_time_ns`` (its
    release time), then the DataFrame's columns as pyarrow reads Spark's Parquet.

    The run must last long enough to release every row: with a ``rate``, ``N / rate``
    seconds (rows not released by the end of the run are not emitted). Each source replica
    holds its partition's rows in memory, on its executor. A run with ``check=True`` (the
    default) replays the whole source on the driver, in the reference executor, to check
    the output: pass ``check=False`` for data that does not fit there.
    """

    def __init__(
        self,
        df: Any,
        order_by: str | list[str] | tuple[str, ...] | None = None,
        *,
        rate: float | None = None,
        path: str | os.PathLike | None = None,
    ) -> None:
        what = "tandem_spark.sources.DataFrame"
        try:
            from pyspark.sql import DataFrame as SparkDataFrame
        except ImportError as exc:  # pragma: no cover - tandem_spark needs pyspark
            raise ConfigError(f"{what} needs pyspark: pip install 'pyspark[sql]'") from exc
        if not isinstance(df, SparkDataFrame):
            raise ConfigError(
                f"{what}: df must be a pyspark.sql.DataFrame (e.g. spark.table('name')), got "
                f"{type(df).__name__}"
            )
        columns = df.columns
        if order_by is None or (isinstance(order_by, list | tuple) and not order_by):
            raise ConfigError(
                f"{what}: order_by is required: the column(s) to replay the rows in, e.g. "
                f"order_by={columns[:1]!r}. A DataFrame has no deterministic order of its own "
                "(Spark may return its rows in another order every time), and every replica "
                "of a source must emit the same rows in the same order"
            )
        keys = [order_by] if isinstance(order_by, str) else list(order_by)
        kinds = {f.name: f.dataType for f in df.schema.fields}
        for key in keys:
            if not isinstance(key, str):
                raise ConfigError(
                    f"{what}: order_by takes column names (strings), got {key!r}; to sort by "
                    "an expression, add it as a column first (df.withColumn(...))"
                )
            if key not in kinds:
                raise ConfigError(
                    f"{what}: order_by names an unknown column {key!r}; the DataFrame's "
                    f"columns are {columns}"
                )
            if _unsortable(kinds[key]):
                raise ConfigError(
                    f"{what}: cannot order by column {key!r} of type "
                    f"{kinds[key].simpleString()}: Spark cannot sort maps"
                )
        if len(set(keys)) != len(keys):
            raise ConfigError(f"{what}: order_by names a column twice: {keys}")
        for col in (SOURCE_SEQ, EVENT_TIME):
            if col in kinds:
                raise ConfigError(
                    f"{what}: the DataFrame already has a column {col!r}, which the source "
                    "adds itself; rename or drop it (df.withColumnRenamed / df.drop)"
                )
        self.rate = parse_rate(rate, what)
        self.order_by = keys
        master = df.sparkSession.sparkContext.master
        if path is None:
            if not is_local(master):
                raise ConfigError(
                    f"{what}: on master {master!r} the executors do not share this machine's "
                    "temporary directory; give path= a new directory every executor can read "
                    "(HDFS, S3 or a shared file system)"
                )
            top = tempfile.mkdtemp(prefix="tandem-dataframe-")
            atexit.register(shutil.rmtree, top, ignore_errors=True)
            self.path = os.path.join(top, "rows")
            self.default_path = True
        else:
            self.path = _absolute(os.fspath(path))
            self.default_path = False
            fs, inner = _filesystem(self.path)
            from pyarrow import fs as pafs

            if fs.get_file_info(inner).type != pafs.FileType.NotFound:
                raise ConfigError(
                    f"{what}: path {self.path!r} already exists; give a new directory (the "
                    "source writes the sorted rows there) or remove it"
                )
        ties = [c for c in columns if c not in keys and not _unsortable(kinds[c])]
        df.orderBy(*keys, *ties).write.parquet(self.path)
        self.files, self._schema = self._list()
        self.rows_total = sum(n for _, n in self.files)
        self._cache: tuple[tuple[int, int], pa.Table] | None = None

    def _list(self) -> tuple[list[tuple[str, int]], pa.Schema]:
        """The part files in order, with their row counts, and the rows' schema (from the
        Parquet footers only)."""
        import pyarrow.parquet as pq
        from pyarrow import fs as pafs

        fs, inner = _filesystem(self.path)
        found = fs.get_file_info(pafs.FileSelector(inner))
        names = sorted(
            (
                os.path.basename(f.path)
                for f in found
                if f.type == pafs.FileType.File
                and os.path.basename(f.path).startswith("part-")
                and f.path.endswith(".parquet")
            ),
            key=_part_key,
        )
        files, schema = [], None
        for name in names:
            full = f"{inner.rstrip('/')}/{name}"
            meta = pq.ParquetFile(fs.open_input_file(full)).metadata
            files.append((name, meta.num_rows))
            if schema is None:
                schema = meta.schema.to_arrow_schema().remove_metadata()
        if schema is None:
            raise ConfigError(f"{self.describe()}: Spark wrote no Parquet file under {self.path}")
        return files, schema

    def check_master(self, master: str) -> None:
        """Refuse the default (local) directory of the sorted rows on a cluster master."""
        if self.default_path and not is_local(master):
            raise ConfigError(
                f"{self.describe()}: its rows are in a temporary directory of this machine, "
                f"which the executors of master {master!r} cannot read; create the source "
                "with path= a directory every executor can read (HDFS, S3, a shared file "
                "system)"
            )

    def describe(self) -> str:
        return f"DataFrame(order_by={self.order_by}, path={self.path!r})"

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_cache"] = None  # re-read in the process that replays the partition
        return state

    def schema(self) -> pa.Schema:
        fields = [
            pa.field(SOURCE_SEQ, pa.int64(), nullable=False),
            pa.field(EVENT_TIME, pa.int64(), nullable=False),
        ]
        return pa.schema(fields + list(self._schema))

    def total_rows(self, duration_ns: int | None) -> int | None:
        if duration_ns is None or self.rate is None:
            return self.rows_total
        return min(self.rows_total, self.rows_before(duration_ns))

    def partition_start(self, partition: int, parallelism: int) -> int:
        """The position of partition ``partition``'s first row in the sorted order."""
        n = self.rows_total
        return sum(self.local_count(n, q, parallelism) for q in range(partition))

    def read(
        self, partition: int, parallelism: int, j0: int, j1: int, t0_ns: int
    ) -> pa.RecordBatch:
        """Local rows ``[j0, j1)`` of a partition: sorted positions ``start + j0 ..
        start + j1``, released when a round-robin source releases its local rows."""
        size = self.local_count(self.rows_total, partition, parallelism)
        if not 0 <= partition < parallelism or j0 < 0 or j1 < j0 or j1 > size:
            raise ConfigError(
                f"{self.describe()}: cannot read rows [{j0}, {j1}) of partition {partition} "
                f"of {parallelism} ({size} rows)"
            )
        start = self.partition_start(partition, parallelism)
        rows = self._partition(partition, parallelism).slice(j0, j1 - j0)
        timing = np.arange(j0, j1, dtype=np.int64) * parallelism + partition
        cols = [
            pa.array(np.arange(start + j0, start + j1, dtype=np.int64), pa.int64()),
            pa.array(self.offsets_ns(timing) + t0_ns, pa.int64()),
            *(c.combine_chunks() for c in rows.columns),
        ]
        return pa.RecordBatch.from_arrays(cols, schema=self.schema())

    def _partition(self, partition: int, parallelism: int) -> pa.Table:
        """Every row of a partition, read once per process from the files it spans."""
        key = (partition, parallelism)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        import pyarrow.parquet as pq

        lo = self.partition_start(partition, parallelism)
        hi = lo + self.local_count(self.rows_total, partition, parallelism)
        fs, inner = _filesystem(self.path)
        pieces, at = [], 0
        for name, n in self.files:
            if at < hi and at + n > lo and n:
                table = pq.read_table(f"{inner.rstrip('/')}/{name}", filesystem=fs)
                table = table.replace_schema_metadata(None).cast(self._schema)
                pieces.append(table.slice(max(0, lo - at), min(n, hi - at) - max(0, lo - at)))
            at += n
        rows = pa.concat_tables(pieces) if pieces else self._schema.empty_table()
        rows = rows.combine_chunks()
        self._cache = (key, rows)
        return rows


def _unsortable(data_type) -> bool:
    """Whether Spark cannot order by a column of ``data_type`` (maps, at any depth)."""
    from pyspark.sql import types as T

    if isinstance(data_type, T.MapType):
        return True
    if isinstance(data_type, T.ArrayType):
        return _unsortable(data_type.elementType)
    if isinstance(data_type, T.StructType):
        return any(_unsortable(f.dataType) for f in data_type.fields)
    return type(data_type).__name__ == "VariantType"


__all__ = ["DataFrame"]
