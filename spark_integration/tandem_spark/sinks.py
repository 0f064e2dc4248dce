"""Sinks that write through Spark's writers.

``tandem_spark.sinks.Spark(table="db.events")`` (or ``path="out/events"``) delivers a
stream to a Spark table or to files in any format Spark writes, with Spark's own
``DataFrameWriter`` (``format``, ``mode``, ``options``, ``partitionBy``, ``saveAsTable``
or ``save``), and never through the driver's memory:

1. each replica of each sink partition — a deduplicating consumer, so it gets every row of
   its partition exactly once — writes the rows it receives to one Parquet file of its own
   in a *staging* directory, on the executor (or worker process) that runs it;
2. when the run has ended, the driver commits the run in one Spark job:
   ``spark.read.parquet(<the staging files>).write.format(...).mode(...)`` and
   ``.saveAsTable(table)`` or ``.save(path)``, reading one replica's file per partition
   (the first replica to finish). Spark's executors read the staging files and write the
   target; the driver only plans the job. Then every staging file is deleted.

What you get: the rows appear in the target **at the end of the job, all in one Spark
write job, each exactly once** (a killed replica upstream is masked by its twin, and the
sink drops the twins' duplicates). Nothing reaches the target while the job runs. If the
job fails, nothing is committed; if the commit itself fails (e.g. ``mode="errorifexists"``
and the table appeared meanwhile), the error names the staging files, which are kept, so
the rows can still be committed by hand. How atomic the commit is (whether a failure
halfway leaves some files) is whatever Spark's committer for that format and target
gives a write job. The order of the rows in the target means nothing.

The commit needs a SparkSession on the driver: the session of the ``SparkEngine`` or, on
the local engine, the active one (``SparkSession.builder.getOrCreate()``).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from tandem.exceptions import ConfigError, TandemError
from tandem.sinks import Sink
from tandem_spark.session import is_local
from tandem_spark.sources import _absolute, _filesystem

log = logging.getLogger("tandem")

MODES = ("append", "overwrite", "errorifexists", "error", "ignore")
"""Spark's save modes (``error`` is ``errorifexists``)."""


@dataclass
class Written:
    """What a :class:`Spark` sink committed (``Result.outputs[sink name]``): the target
    (a table name or a path), the format and mode, the rows committed, and whether the
    target holds this run's rows only (then ``lost``/``duplicates`` read it back)."""

    table: str | None
    path: str | None
    format: str | None
    mode: str
    rows: int
    committed: bool
    exclusive: bool
    columns: list[str]

    @property
    def target(self) -> str:
        return f"table {self.table!r}" if self.table is not None else f"path {self.path!r}"


class Spark(Sink):
    """Writes the stream with Spark's ``DataFrameWriter`` at the end of the job (see the
    module documentation for how, and what consistency that gives). Replicable: each
    replica of a partition stages a file of its own; the commit reads one per partition.

    Exactly one of ``table`` (``saveAsTable``) and ``path`` (``save``). ``format``: a
    Spark data source (``"parquet"``, ``"orc"``, ``"json"``, ``"csv"``, ``"delta"``, ...;
    None: ``spark.sql.sources.default`` for a table, parquet for a path). ``mode``: one of
    ``MODES``. ``options``: writer options (``.options(**options)``). ``partition_by``:
    columns to partition the output by. ``columns``: the columns to write (default: all,
    ``source_seq`` and ``event_time_ns`` included). ``staging``: where the sink partitions
    write their files before the commit — by default a temporary directory on this
    machine (fine on a local master; on a cluster give a directory the sink's executor
    can write and every executor can read: HDFS, S3, a shared file system).
    """

    replicable = True

    def __init__(
        self,
        table: str | None = None,
        *,
        path: str | os.PathLike | None = None,
        format: str | None = None,
        mode: str = "errorifexists",
        options: dict[str, Any] | None = None,
        partition_by: str | list[str] | None = None,
        columns: list[str] | None = None,
        staging: str | os.PathLike | None = None,
    ) -> None:
        what = "tandem_spark.sinks.Spark"
        if (table is None) == (path is None):
            raise ConfigError(
                f"{what}: give exactly one target: table='db.name' (saveAsTable) or "
                "path='dir' (save)"
            )
        if table is not None and (not isinstance(table, str) or not table.strip()):
            raise ConfigError(f"{what}: table must be a non-empty table name, got {table!r}")
        if path is not None and not os.fspath(path):
            raise ConfigError(f"{what}: path must not be empty")
        if not isinstance(mode, str) or mode.lower() not in MODES:
            raise ConfigError(
                f"{what}: unsupported mode {mode!r}; use one of {list(MODES)} (Spark's save "
                "modes: 'append' adds to the target, 'overwrite' replaces it)"
            )
        if format is not None and (not isinstance(format, str) or not format):
            raise ConfigError(f"{what}: format must be a Spark data source name, got {format!r}")
        if options is not None and not isinstance(options, dict):
            raise ConfigError(f"{what}: options must be a dict of writer options")
        if isinstance(partition_by, str):
            partition_by = [partition_by]
        if columns is not None and (
            isinstance(columns, str) or not all(isinstance(c, str) for c in columns) or not columns
        ):
            raise ConfigError(f"{what}: columns must be a non-empty list of column names")
        self.table = table
        self.path = None if path is None else os.fspath(path)
        self.format = format
        self.mode = "errorifexists" if mode.lower() == "error" else mode.lower()
        self.options = {k: str(v) for k, v in (options or {}).items()}
        self.partition_by = list(partition_by or [])
        self.columns = None if columns is None else list(columns)
        if staging is None:
            staging = tempfile.mkdtemp(prefix="tandem-spark-sink-")
            atexit.register(shutil.rmtree, staging, ignore_errors=True)
            self.default_staging = True
        else:
            self.default_staging = False
        self.staging = _absolute(os.fspath(staging))
        self.file: str | None = None
        self.writer = None

    def describe(self) -> str:
        target = f"table={self.table!r}" if self.table is not None else f"path={self.path!r}"
        return f"Spark({target}, format={self.format!r}, mode={self.mode!r})"

    # -- before the run ----------------------------------------------------------------

    def check(self, schema: pa.Schema) -> None:
        """The named columns exist; where a session is already active, the format exists
        and an ``errorifexists`` target does not."""
        for what, names in (("columns", self.columns), ("partition_by", self.partition_by)):
            for name in names or ():
                if name not in schema.names:
                    raise ConfigError(
                        f"{what} names an unknown column {name!r}; the stream's columns are "
                        f"{schema.names}"
                    )
        if self.columns is not None and self.partition_by:
            missing = [c for c in self.partition_by if c not in self.columns]
            if missing:
                raise ConfigError(f"partition_by columns {missing} are not in columns=")
        spark = _session(required=False)
        if spark is None:
            return
        self.check_master(spark.sparkContext.master)
        if self.format is not None:
            jvm = spark._jvm
            try:
                jvm.org.apache.spark.sql.execution.datasources.DataSource.lookupDataSource(
                    self.format, spark._jsparkSession.sessionState().conf()
                )
            except Exception as exc:
                raise ConfigError(
                    f"Spark has no data source {self.format!r} (is its package on the "
                    "classpath?); use e.g. 'parquet', 'orc', 'json' or 'csv'"
                ) from exc
        if self.mode == "errorifexists" and self._exists(spark):
            raise ConfigError(
                f"the {self._target()} already exists and mode is 'errorifexists'; use "
                "mode='overwrite' to replace it or 'append' to add to it"
            )

    def check_master(self, master: str) -> None:
        """Refuse the default (local) staging directory on a cluster master: the sink's
        executor and the commit's would not see the same files."""
        if self.default_staging and not is_local(master):
            raise ConfigError(
                f"on master {master!r} the executors do not share this machine's temporary "
                "directory; give staging= a directory the executors can all read and write "
                "(HDFS, S3 or a shared file system)"
            )

    # -- on the sink's worker ----------------------------------------------------------

    def open(self, partition: int, parallelism: int = 1, schema: pa.Schema | None = None) -> None:
        super().open(partition, parallelism, schema)
        fs, inner = _filesystem(self.staging)
        fs.create_dir(inner, recursive=True)
        self.file = self._staged(partition, self.run, self.replica)
        self.writer = None
        self.rows_written = 0

    def _staged(self, partition: int, run: int, replica: int) -> str:
        """The staging file of one replica of a partition in one run (the job's t0)."""
        name = f"part-{partition:05d}-{run}-r{replica}.parquet"
        return f"{self.staging.rstrip('/')}/{name}"

    def _writer(self, schema: pa.Schema):
        """The open writer of this partition's staging file, created on first use."""
        import pyarrow.parquet as pq

        if self.writer is None:
            fs, inner = _filesystem(self.file)
            # Microsecond timestamps: what Spark reads (it refuses Parquet's nanoseconds).
            self.writer = pq.ParquetWriter(inner, schema, filesystem=fs, coerce_timestamps="us")
        return self.writer

    def write(self, batch: pa.RecordBatch) -> None:
        if not batch.num_rows:
            return
        if self.columns is not None:
            batch = batch.select(self.columns)
        self._writer(batch.schema).write_batch(batch)
        self.rows_written += batch.num_rows

    def close(self) -> dict:
        if self.writer is None and self.schema is not None:
            schema = self.schema
            if self.columns is not None:
                schema = pa.schema([schema.field(c) for c in self.columns])
            self._writer(schema)
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        return {"file": self.file, "rows": self.rows_written}

    # -- on the driver, after the run --------------------------------------------------

    def combine(self, parts: list[Any], schema: pa.Schema | None = None) -> Written:
        """Commit the run: one Spark job reads the partitions' staging files and writes
        them to the target; then the staging files are deleted."""
        files = [p["file"] for p in parts if p]
        rows = sum(p["rows"] for p in parts if p)
        for f in files:  # a copy staged on a disk this driver does not see: say so
            fs, inner = _filesystem(f)
            if not fs.get_file_info(inner).size:
                raise TandemError(
                    f"{self.describe()}: the staging file {f} is missing or empty here, on "
                    "the driver; give staging= a directory every executor and the driver share"
                )
        spark = _session(required=True)
        existed = self._exists(spark)
        dynamic = (
            spark.conf.get("spark.sql.sources.partitionOverwriteMode", "static").lower()
            == "dynamic"
        )
        exclusive = not existed or (self.mode == "overwrite" and not dynamic)
        committed = not (existed and self.mode == "ignore")
        writer = spark.read.parquet(*files).write.mode(self.mode)
        if self.format is not None:
            writer = writer.format(self.format)
        if self.options:
            writer = writer.options(**self.options)
        if self.partition_by:
            writer = writer.partitionBy(*self.partition_by)
        try:
            if self.table is not None:
                writer.saveAsTable(self.table)
            else:
                writer.save(self.path)
        except Exception as exc:
            raise TandemError(
                f"{self.describe()}: committing the run's {rows} rows to the {self._target()} "
                f"failed: {exc}. The rows are still in the staging files {files}: commit them "
                f"with spark.read.parquet(*files).write...; they are not deleted"
            ) from exc
        if not committed:
            log.warning(
                "%s: the %s exists and mode is 'ignore': the run's rows were not written",
                self.describe(),
                self._target(),
            )
        for f in files:
            fs, inner = _filesystem(f)
            fs.delete_file(inner)
        names = self.columns or ([] if schema is None else schema.names)
        return Written(
            self.table, self.path, self.format, self.mode, rows, committed, exclusive, names
        )

    def discard(
        self, part: Any, *, partition: int, replica: int, parallelism: int, run: int
    ) -> None:
        """Delete the staging file of a replica whose copy was not committed."""
        fs, inner = _filesystem(part["file"] if part else self._staged(partition, run, replica))
        with contextlib.suppress(FileNotFoundError):
            fs.delete_file(inner)

    def rows(self, value: Any, schema: pa.Schema | None = None) -> pa.Table | None:
        """The target's rows, read back through Spark (onto the driver: this is the
        ``check``), when it holds this run's rows only; else None (rows are then checked
        by count)."""
        if not isinstance(value, Written) or not value.committed or not value.exclusive:
            return None
        spark = _session(required=True)
        try:
            if value.table is not None:
                df = spark.table(value.table)
            else:
                reader = spark.read
                if value.format is not None:
                    reader = reader.format(value.format)
                if schema is not None and value.format not in (None, "parquet", "orc"):
                    from pyspark.sql.pandas.types import from_arrow_schema

                    want = pa.schema([schema.field(c) for c in value.columns])
                    reader = reader.schema(from_arrow_schema(want))
                df = reader.options(**self.options).load(value.path)
            got = df.select(*value.columns).toArrow()
            if schema is not None:
                want = pa.schema([schema.field(c).with_nullable(True) for c in value.columns])
                got = got.cast(want)
            return got
        except Exception as exc:
            log.warning(
                "%s: cannot read the %s back (%s); lost and duplicates are counted, not "
                "compared row by row",
                self.describe(),
                value.target,
                exc,
            )
            return None

    def _target(self) -> str:
        return f"table {self.table!r}" if self.table is not None else f"path {self.path!r}"

    def _exists(self, spark) -> bool:
        if self.table is not None:
            return bool(spark.catalog.tableExists(self.table))
        jvm = spark._jvm
        p = jvm.org.apache.hadoop.fs.Path(self.path)
        return bool(p.getFileSystem(spark._jsc.hadoopConfiguration()).exists(p))


def _session(required: bool):
    """The driver's SparkSession (the active one, else the default), or None."""
    from pyspark.sql import SparkSession

    spark = SparkSession.getActiveSession() or SparkSession._instantiatedSession
    if spark is None and required:
        raise ConfigError(
            "tandem_spark.sinks.Spark commits through a SparkSession on the driver, and none "
            "is running; create one before job.run (SparkSession.builder.getOrCreate(), "
            "tandem_spark.local_session(job)) or run on engine=tandem_spark.SparkEngine(spark)"
        )
    return spark


__all__ = ["MODES", "Spark", "Written"]
