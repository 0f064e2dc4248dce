"""PySpark data in and out: a DataFrame replayed as a source, a stream written through
Spark's writers, on a real local Spark (pyspark from PyPI, Java 17).

One session for the module: ``local[6,8]``, the 4 workers of a job with one worker per
replica group (two groups) and one per replica of the sink, plus spares. Shuffles cut 4 partitions
and adaptive execution does not merge them, so a sorted DataFrame is written as several
part files and a source partition spans more than one.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

import tandem as td
import tandem_spark
from tandem.engines.common import multiset_diff
from tandem.testing import killed_replicas, lost_replicas

pytestmark = pytest.mark.spark

N = 2_000  # rows of the orders DataFrame
RATE = 1_000  # rows per second: the source releases them over 2 s
DURATION = 2.5
WORKERS = 4
COLUMNS = ["order_id", "customer", "amount", "total"]


@pytest.fixture(scope="module")
def spark(tmp_path_factory):
    conf = {
        "spark.sql.warehouse.dir": str(tmp_path_factory.mktemp("warehouse")),
        "spark.sql.shuffle.partitions": "4",
        "spark.sql.adaptive.coalescePartitions.enabled": "false",
    }
    session = tandem_spark.local_session(WORKERS, **conf)
    yield session
    session.stop()


def orders(spark, slices: int = 3):
    """``N`` orders; ``order_id`` is a permutation of ``0 .. N-1`` (7919 is prime to N), so
    the DataFrame's own order is not the replay's."""
    from pyspark.sql import functions as F

    i = F.col("id")
    return spark.range(0, N, numPartitions=slices).select(
        ((i * 7919) % N).alias("order_id"), (i % 10).alias("customer"), (i * 0.5).alias("amount")
    )


def expected() -> pa.Table:
    """The rows the job must write: the orders, each with its total."""
    return pa.table(
        {
            "order_id": pa.array([(i * 7919) % N for i in range(N)], pa.int64()),
            "customer": pa.array([i % 10 for i in range(N)], pa.int64()),
            "amount": pa.array([i * 0.5 for i in range(N)], pa.float64()),
            "total": pa.array([i * 0.5 * 1.25 for i in range(N)], pa.float64()),
        }
    )


def with_total(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch.append_column("total", pc.multiply(batch.column("amount"), 1.25))


def job_of(source, sink) -> td.Job:
    job = td.Job("orders", replication=2, ordering="liverobin", heartbeat_ms=10)
    job.workers = 1  # per replica group: 4 workers with the sink's two
    rows = job.source(source, parallelism=2, name="orders")
    rows.map(with_total, parallelism=2, name="tax").sink(sink, name="out")
    return job


@pytest.fixture(scope="module")
def source(spark):
    return tandem_spark.sources.DataFrame(orders(spark), order_by="order_id", rate=RATE)


def test_the_replay_is_sorted_split_into_ranges_and_independent_of_spark(spark, source):
    assert len(source.files) > 1  # several part files, read back in order
    assert source.schema().names == ["source_seq", "event_time_ns", *COLUMNS[:3]]
    parts = [source.read(p, 2, 0, N // 2, t0_ns=0) for p in range(2)]
    assert [b.num_rows for b in parts] == [N // 2, N // 2]
    ids = [b.column("order_id").to_pylist() for b in parts]
    assert ids[0] + ids[1] == list(range(N))  # partition 0 the low half, in order
    assert parts[1].column("source_seq").to_pylist() == list(range(N // 2, N))
    # Released like a round-robin source: partition p's row j at (j * 2 + p) / RATE.
    assert parts[1].column("event_time_ns").to_pylist()[:2] == [1_000_000, 3_000_000]
    # Another evaluation, from a DataFrame partitioned differently, replays the same rows.
    again = tandem_spark.sources.DataFrame(orders(spark, slices=5), order_by=["order_id"])
    for p in range(2):
        assert (
            again.read(p, 2, 0, N // 2, t0_ns=0)
            .select(COLUMNS[:3])
            .equals(parts[p].select(COLUMNS[:3]))
        )


def assert_rows(got: pa.Table) -> None:
    got = got.select(COLUMNS)
    assert got.num_rows == N
    assert multiset_diff(expected(), got) == (0, 0)  # nothing lost, nothing twice


def test_dataframe_to_table_on_the_spark_engine(spark, source):
    sink = tandem_spark.sinks.Spark(table="orders_out", mode="overwrite", columns=COLUMNS)
    job = job_of(source, sink)
    res = job.run(duration=DURATION, engine=tandem_spark.SparkEngine(spark))
    assert res.events_in == res.events_out == N
    assert res.lost == 0 and res.duplicates == 0 and res.digests_match  # read back from it
    written = res.outputs["out"]
    assert (written.rows, written.committed, written.exclusive) == (N, True, True)
    assert_rows(spark.table("orders_out").toArrow())
    assert not list(Path(sink.staging).iterdir())  # the staging files are gone


def test_a_killed_replica_is_masked_and_the_files_hold_every_row_once(spark, source, tmp_path):
    target = str(tmp_path / "orders_orc")
    sink = tandem_spark.sinks.Spark(path=target, format="orc", columns=COLUMNS)
    job = job_of(source, sink)
    kill = td.Kill("tax", partition=0, replica=1, at=1.0)
    res = job.run(duration=DURATION, faults=[kill], engine=tandem_spark.SparkEngine(spark))
    assert lost_replicas(res) == killed_replicas(res) != set()
    assert res.lost == 0 and res.duplicates == 0
    assert_rows(spark.read.orc(target).toArrow())


def test_a_killed_sink_replica_is_masked_and_the_table_holds_every_row_once(spark, source):
    """The worker of the sink's replica 1 killed mid-run on the Spark engine: the commit
    reads replica 0's staging file, every row lands in the table once, and the lost
    replica's partial staging file is deleted with the rest."""
    sink = tandem_spark.sinks.Spark(table="orders_sink_kill", mode="overwrite", columns=COLUMNS)
    job = job_of(source, sink)
    kill = td.Kill("out", partition=0, replica=1, at=1.0)
    res = job.run(duration=DURATION, faults=[kill], engine=tandem_spark.SparkEngine(spark))
    assert lost_replicas(res) == killed_replicas(res) == {("out", 0, 1)}
    assert res.lost == 0 and res.duplicates == 0 and res.events_out == N
    assert res.outputs["out"].rows == N
    assert_rows(spark.table("orders_sink_kill").toArrow())
    assert not list(Path(sink.staging).iterdir())  # no staging file of either replica left


def test_both_run_on_the_local_engine_too(spark, source):
    """The local engine's workers replay the same files; the driver commits the sink's
    staging files through the active session (appending creates the table)."""
    sink = tandem_spark.sinks.Spark(table="orders_local", format="json", mode="append")
    res = job_of(source, sink).run(duration=DURATION)
    assert res.lost == 0 and res.duplicates == 0 and res.outputs["out"].exclusive
    assert_rows(spark.table("orders_local").toArrow())


def test_wrong_usage_names_what_to_change(spark):
    df = orders(spark)
    with pytest.raises(td.ConfigError, match=r"order_by is required.*no deterministic order"):
        tandem_spark.sources.DataFrame(df)
    with pytest.raises(td.ConfigError, match=r"unknown column 'id'.*\['order_id', 'customer'"):
        tandem_spark.sources.DataFrame(df, order_by=["customer", "id"])
    with pytest.raises(td.ConfigError, match=r"pyspark.sql.DataFrame.*got Table"):
        tandem_spark.sources.DataFrame(expected(), order_by="order_id")
    from pyspark.sql import functions as F

    with pytest.raises(td.ConfigError, match=r"cannot order by column 'm'.*maps"):
        tandem_spark.sources.DataFrame(df.withColumn("m", F.create_map("customer", "amount")), "m")
    with pytest.raises(td.ConfigError, match=r"unsupported mode 'upsert'.*'append'"):
        tandem_spark.sinks.Spark(table="t", mode="upsert")
    with pytest.raises(td.ConfigError, match=r"exactly one target"):
        tandem_spark.sinks.Spark(table="t", path="p")
    source = tandem_spark.sources.DataFrame(df.limit(10), order_by="order_id")
    with pytest.raises(td.ConfigError, match=r"sink 'out'.*partition_by names an unknown column"):
        job_of(source, tandem_spark.sinks.Spark(table="t", partition_by="region"))
    with pytest.raises(td.ConfigError, match=r"no data source 'nope'"):
        job_of(source, tandem_spark.sinks.Spark(table="t", format="nope"))
    spark.range(1).write.saveAsTable("taken")
    with pytest.raises(td.ConfigError, match=r"table 'taken' already exists.*'overwrite'"):
        job_of(source, tandem_spark.sinks.Spark(table="taken"))
