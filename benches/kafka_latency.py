"""Latency of a job reading Kafka, beside the same job on a synthetic source.

The job: source → filter → keyed count (2 partitions) → sink, r = 2, LiveRobin, 10 ms
heartbeats, ``rate`` events per second. ``synthetic`` reads ``td.sources.Synthetic``
(event time = the logical release instant); ``kafka`` reads a fresh 2-partition topic that
a producer thread of this process fills at ``rate`` during the run (event time = the
record's timestamp, set when it was produced, by a producer lingering up to 2 ms: Kafka's
own produce → fetch path is in the figure), with the engine's two heartbeat generators.
Both measure at the sink (receive - event time, after ``warmup``). ``kafka-sink`` writes
the output to a topic with the exactly-once sink instead and also measures, with an
outside ``read_committed`` consumer, when each row became visible there (that includes
the transaction it waited for).

    tandem services start kafka
    python benches/kafka_latency.py --rate 5000 --duration 20 --warmup 5
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

import tandem as td
from tandem.engines import local
from tandem.kafka import default_bootstrap


def keep(batch: pa.RecordBatch) -> pa.Array:
    return pc.not_equal(pc.bit_wise_and(batch.column("key"), 7), 7)


def topic(bootstrap: str, prefix: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for fut in admin.create_topics([NewTopic(name, 2, 1)]).values():
        fut.result(30)
    return name


def build(source: td.sources.Source, sink: td.sinks.Sink) -> td.Job:
    job = td.Job("kafka-latency", replication=2, heartbeat_ms=10)
    ev = job.source(source, parallelism=None if isinstance(source, td.sources.Kafka) else 2)
    counted = ev.filter(keep).key_by("key").process(td.CountPerKey(), parallelism=2)
    counted.sink(sink)
    return job


def feed(bootstrap: str, name: str, rate: int, duration: float, ready: threading.Event) -> None:
    """Produce ``rate`` JSON rows per second from t0 to t0 + duration, in 1 ms steps."""
    ready.wait(120)
    t0 = time.monotonic() + local.STARTUP_S
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 2, "acks": 1})
    i, step = 0, 0.001
    while True:
        now = time.monotonic() - t0
        if now >= duration:
            break
        due = int(max(0.0, now) * rate)
        while i < due:
            p.produce(name, json.dumps({"key": i % 1000, "v": i}).encode(), partition=i % 2)
            i += 1
        p.poll(0)
        time.sleep(step)
    p.flush(30)


def summary(name: str, res: td.Result) -> dict:
    return {
        "config": name,
        "events_in": res.events_in,
        "events_out": res.events_out,
        "p50_ms": res.p50_ms,
        "p99_ms": res.p99_ms,
        "max_ms": res.max_ms,
        "lost": res.lost,
        "duplicates": res.duplicates,
        "digests_match": res.digests_match,
        "cpu_s": round(res.cpu_s, 1),
        "steady_cpu_s": round(res.steady_cpu_s, 1),
        "coordinator_cpu_s": round(res.coordinator_cpu_s, 1),
        "per_second_p99_ms": [x if x is None else round(x, 1) for x in res.per_second_p99_ms],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=int, default=5_000)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--configs", default="synthetic,kafka,kafka-sink")
    args = ap.parse_args()
    bootstrap = default_bootstrap()
    rows = []
    for config in args.configs.split(","):
        if config == "synthetic":
            job = build(td.sources.Synthetic(rate=args.rate, keys=1000, seed=1), td.sinks.Collect())
            res = job.run(duration=args.duration, warmup=args.warmup, progress=False)
            rows.append(summary(config, res))
            continue
        src_topic = topic(bootstrap, "lat-in")
        schema = {"key": "int64", "v": "int64"}
        source = td.sources.Kafka(src_topic, bootstrap=bootstrap, schema=schema)
        visible: list[float] = []
        if config == "kafka":
            sink: td.sinks.Sink = td.sinks.Collect()
        else:
            out_topic = topic(bootstrap, "lat-out")
            sink = td.sinks.Kafka(out_topic, bootstrap=bootstrap, columns=["key", "event_time_ns"])
        job = build(source, sink)
        ready, stop = threading.Event(), threading.Event()
        local.ON_READY = lambda _a, ready=ready: ready.set()
        feeder = threading.Thread(
            target=feed, args=(bootstrap, src_topic, args.rate, args.duration - 1.0, ready)
        )
        watcher = None
        if config == "kafka-sink":
            watcher = threading.Thread(
                target=watch, args=(bootstrap, out_topic, ready, stop, visible, args.warmup)
            )
            watcher.start()
        feeder.start()
        try:
            res = job.run(duration=args.duration, warmup=args.warmup, progress=False)
        finally:
            local.ON_READY = None
            feeder.join()
            stop.set()
            if watcher is not None:
                watcher.join()
        row = summary(config, res)
        if visible:
            v = np.array(visible)
            row["visible_p50_ms"] = round(float(np.percentile(v, 50)), 2)
            row["visible_p99_ms"] = round(float(np.percentile(v, 99)), 2)
            row["visible_rows"] = len(v)
        rows.append(row)
    for row in rows:
        print(json.dumps(row))


def watch(bootstrap, name, ready, stop, out: list, warmup: float) -> None:
    """A read_committed consumer following the output topic during the run: each row's
    visibility latency = when it was received here - its event time."""
    ready.wait(120)
    t0 = time.time_ns() + int(local.STARTUP_S * 1e9)
    skip = t0 + int(warmup * 1e9)
    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"watch-{uuid.uuid4().hex}",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "fetch.wait.max.ms": 5,
        }
    )
    c.assign([TopicPartition(name, p, 0) for p in range(2)])
    try:
        while not stop.is_set():
            first = c.poll(0.01)
            if first is None:
                continue
            for m in [first, *c.consume(1000, 0)]:
                if m.error() is not None:
                    continue
                now = time.time_ns()
                et = json.loads(m.value())["event_time_ns"]
                if et >= skip:
                    out.append((now - et) / 1e6)
    finally:
        c.close()


if __name__ == "__main__":
    main()
