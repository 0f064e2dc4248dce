"""The tandem job of the cluster tests, run as a user runs a driver on a cluster's head node:

    scripts/cluster.sh exec head .venv/bin/python tests/cluster_job.py \\
        --input rows.parquet --out out/run1 --tag run1 --rate 1000 --duration 6 --restore

A keyed count at r = 2 (``--replication``) over a Parquet file of ``(id, key)`` rows — the
file's rows released at ``--rate`` rows per second, 2 partitions, ``key_by("key")``, a
running count per key in 2 partitions, a ``Collect`` sink — on ``tandem_spark.SparkEngine``
at the standalone master ``$TANDEM_CLUSTER_MASTER`` (``scripts/cluster.sh exec`` sets it, and
``TANDEM_CLUSTER_ADDRESS``, the head's address the driver binds). One worker per replica
group, one for the sinks: three worker tasks. ``--kazoo ADDRESS`` orders the count with
KaZoo instead of LiveRobin, on the ZooKeeper and Kafka of the services host at ADDRESS
(``scripts/cluster.sh up N --services``).

Each replica of ``count`` and of the (replicated) sink prints one line to its executor's
stderr when it opens — ``tandem-cluster TAG: count[P]/R on ADDRESS pid PID`` or
``sink[P]/R on ...``
— so a test can read from the executor logs of each host which host runs which replica
while the job runs (see ``cluster_harness.placed``).

It writes ``OUT/result.json`` (the Result's counts, latencies, lost and restored replicas,
where the registry saw every replica) and ``OUT/output.parquet`` (the sink's rows); the
exit status is 0 when the run completed (checked or not), 1 when it raised.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

import tandem as td
import tandem_spark
from tandem.testing import new_topic, read_committed


def announce(tag: str, what: str) -> None:
    address = os.environ.get("SPARK_LOCAL_IP", "?")
    print(
        f"tandem-cluster {tag}: {what} on {address} pid {os.getpid()}", file=sys.stderr, flush=True
    )


class PlacedCount(td.CountPerKey):
    """A running count per key that says where each replica runs when it opens."""

    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag

    def open(self, ctx) -> None:
        super().open(ctx)
        announce(self.tag, f"count[{ctx.partition}]/{ctx.replica}")


class PlacedCollect(td.sinks.Collect):
    """The Collect sink, saying where each replica of each partition runs when it opens."""

    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag

    def open(self, partition, parallelism=1, schema=None) -> None:
        super().open(partition, parallelism, schema)
        announce(self.tag, f"sink[{partition}]/{self.replica}")


class PlacedKafka(td.sinks.Kafka):
    """The Kafka sink, saying where each replica of each partition runs when it opens."""

    def __init__(self, tag: str, topic: str, bootstrap: str) -> None:
        super().__init__(topic, bootstrap=bootstrap, columns=["id", "key", "count"])
        self.tag = tag

    def open(self, partition, parallelism=1, schema=None) -> None:
        super().open(partition, parallelism, schema)
        announce(self.tag, f"kafka[{partition}]/{self.replica}")


def build(
    path: str,
    rate: int,
    tag: str,
    restore: bool,
    replication: int = 2,
    kazoo=None,
    kafka_topic: tuple[str, str] | None = None,
) -> td.Job:
    ordering = {} if kazoo is None else {"ordering": "kazoo", "kazoo": kazoo}
    job = td.Job(f"cluster-{tag}", replication=replication, restore=restore, workers=1, **ordering)
    rows = job.source(td.sources.Parquet(path, rate=rate), parallelism=2)
    counted = rows.key_by("key").process(PlacedCount(tag), parallelism=2, name="count")
    counted.sink(PlacedCollect(tag))
    if kafka_topic is not None:
        counted.sink(PlacedKafka(tag, *kafka_topic), name="kafka")
    return job


def read_back(bootstrap: str, topic: str) -> pa.Table:
    """What an outside read_committed consumer reads of the Kafka sink's topic: its rows
    and each record's produce time (``produced_ms``)."""
    records = read_committed(bootstrap, topic, 1)
    values = [json.loads(m.value()) for m in records]
    return pa.table(
        {
            "id": pa.array([v["id"] for v in values], pa.int64()),
            "key": pa.array([v["key"] for v in values], pa.int64()),
            "count": pa.array([v["count"] for v in values], pa.int64()),
            "produced_ms": pa.array([m.timestamp()[1] for m in records], pa.int64()),
        }
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tag", required=True)
    ap.add_argument("--rate", type=int, default=1000)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--restore", action="store_true")
    ap.add_argument("--replication", type=int, default=2)
    ap.add_argument(
        "--fault",
        choices=("kill", "pause"),
        help="td.Kill (or td.Pause for --pause-s) count[0] replica 1 at --fault-at seconds",
    )
    ap.add_argument("--fault-at", type=float, default=2.0)
    ap.add_argument("--pause-s", type=float, default=30.0)
    ap.add_argument("--master", default=os.environ.get("TANDEM_CLUSTER_MASTER"))
    ap.add_argument(
        "--kazoo",
        metavar="ADDRESS",
        help="order the count with KaZoo, on the ZooKeeper and Kafka of the services host at "
        "ADDRESS (scripts/cluster.sh up N --services: ports 21810 and 19092)",
    )
    ap.add_argument("--session-timeout", type=float, default=1.0)
    ap.add_argument(
        "--kafka-sink",
        metavar="ADDRESS",
        help="write the counts to a new one-partition topic of the Kafka at ADDRESS:19092 too "
        "(a second sink, 'kafka'), read back with read_committed into OUT/kafka.parquet",
    )
    args = ap.parse_args()
    address = os.environ.get("TANDEM_CLUSTER_ADDRESS")
    if not args.master or not address:
        print(
            "cluster_job: run it on a cluster host (scripts/cluster.sh exec head ...), which sets "
            "TANDEM_CLUSTER_MASTER and TANDEM_CLUSTER_ADDRESS, or give --master",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("tandem").setLevel(logging.INFO)  # the registry's decisions, on the driver
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    # The executors open the file by this path, from their own working directories: it
    # must be absolute (and, on a real cluster, on storage every node mounts there).
    kazoo = None
    if args.kazoo:
        from tandem.ordering.kazoo import KazooConfig

        kazoo = KazooConfig(
            zk_hosts=f"{args.kazoo}:21810",
            kafka_bootstrap=f"{args.kazoo}:19092",
            session_timeout_s=args.session_timeout,
        )
    kafka_topic = None
    if args.kafka_sink:
        bootstrap = f"{args.kafka_sink}:19092"
        kafka_topic = (new_topic(bootstrap, 1, f"cluster-{args.tag}"), bootstrap)
    job = build(
        str(Path(args.input).resolve()),
        args.rate,
        args.tag,
        args.restore,
        args.replication,
        kazoo,
        kafka_topic,
    )
    started = time.monotonic()
    # A run that hangs says where: every thread's stack in the driver log, well before the
    # test gives up on it (its duration + 120 s).
    faulthandler.dump_traceback_later(args.duration + 90, exit=False)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    spark = tandem_spark.local_session(
        job,
        master=args.master,
        **{
            "spark.driver.host": address,
            "spark.driver.bindAddress": address,
            "spark.executor.memory": "512m",
            "spark.app.name": f"tandem-cluster-{args.tag}",
        },
    )
    # The workers log at WARNING; INFO on the driver is for the registry only.
    os.environ.setdefault("TANDEM_LOG_LEVEL", "WARNING")
    try:
        engine = tandem_spark.SparkEngine(spark)
        ready = time.monotonic()
        faults = []
        if args.fault == "kill":
            faults = [td.Kill("count", 0, 1, at=args.fault_at)]
        elif args.fault == "pause":
            faults = [td.Pause("count", 0, 1, at=args.fault_at, for_s=args.pause_s)]
        res = job.run(duration=args.duration, engine=engine, faults=faults)
        ran, returned_at = time.monotonic(), time.time()
        plan = job.plan()
        hosts = {
            f"{plan.tasks[t].name}[{p}]/{r}": attempt.node
            for (t, p, r), attempt in engine.last_run.hosts().items()
        }
        first = {a.worker: a for a in engine.last_run.attempts if a.incarnation == 0}
        first_hosts = {  # where each replica ran before any fault
            f"{plan.tasks[t].name}[{p}]/{r}": first[w].node
            for w, rids in enumerate(plan.placement())
            for t, p, r in rids
            if w in first
        }
        result = {
            "rows": res.output.num_rows,
            "events_in": res.events_in,
            "events_out": res.events_out,
            "lost": res.lost,
            "duplicates": res.duplicates,
            "digests_match": res.digests_match,
            "determinism_errors": res.determinism_errors,
            "p50_ms": res.p50_ms,
            "p99_ms": res.p99_ms,
            "max_ms": res.max_ms,
            "per_second_p99_ms": res.per_second_p99_ms,
            "max_gap_ms": res.max_gap_ms,
            "lost_replicas": res.lost_replicas,
            "restored_replicas": res.restored_replicas,
            "faults": res.faults,
            "leaders": res.leaders,
            "fenced": [f for s in res.kazoo_sessions for f in s["fenced"]],
            "sessions_expired": sum(s["expired"] for s in res.kazoo_sessions),
            "cpu_s": res.workers_cpu_s,
            "sink_handovers": res.sink_handovers,
            "hosts": hosts,
            "first_hosts": first_hosts,
            "session_s": ready - started,
            "run_s": ran - ready,
            "returned_at": returned_at,
            "t0": res.t0_ns / 1e9,
        }
        pq.write_table(res.output, out / "output.parquet")
        if kafka_topic is not None:
            pq.write_table(read_back(kafka_topic[1], kafka_topic[0]), out / "kafka.parquet")
        (out / "result.json").write_text(json.dumps(result, indent=1, default=str))
        print(json.dumps({k: result[k] for k in ("rows", "lost", "duplicates", "run_s")}))
        return 0
    except Exception:
        traceback.print_exc()
        (out / "error.txt").write_text(traceback.format_exc())
        return 1
    finally:
        spark.stop()


if __name__ == "__main__":
    sys.exit(main())
