"""``tandem bench kafka``: a Kafka-sourced job's latency against the same job on a
synthetic source, in one invocation, on the local engine.

The job (:func:`job`): a source of 2 partitions → a filter (``value < 0.9``) → a keyed
running count (``td.CountPerKey``, 2 partitions) → a Kafka sink (a transactional producer
per sink partition), r = 2 LiveRobin, heartbeat 10 ms, buffer timeout 5 ms. A round runs
it twice, with Kafka's own delivery measured in between (``rounds`` repeat the three):

* ``synthetic`` — the source is ``td.sources.Synthetic(rate, keys, seed)``: row ``i`` is
  released at ``t0 + i / rate`` and carries that instant as its event time.
* ``kafka`` — the source is ``td.sources.Kafka`` on a fresh topic of 2 partitions, read
  from its start; a producer process (:func:`produce`) writes the very rows the synthetic
  source would release — the same keys and values, row ``i`` to partition ``i % 2`` — at
  the same pace: row ``i`` is produced once its instant ``start + i / rate`` has come, as
  a JSON object whose ``ts`` is that instant (ns), the source's ``event_time`` column. The
  producer starts as the job is submitted (its first rows wait for the job's ``t0``, in
  the warm-up). The engine runs its two heartbeat generators (``tandem heartbeats``) for
  the topic, as for any job with a Kafka source.
* ``delivery`` (:func:`run_delivery`) — no job: the same producer on a fresh topic, read
  by the readers a Kafka source's replicas use (one per partition and replica), each row
  timed as its reader hands it over. This is the part of the Kafka run's latency that is
  Kafka's (the producer's ``linger.ms``, the broker, the fetch), measured in the same
  invocation, so that the Kafka run's p99 can be read against what any consumer of the
  topic gets on the same machine at the same moment.

Both runs measure the same thing: at the sink replica, the time a row was received (before
the sink's transaction commits it; the sink is the same in both runs) minus the instant it
was due (its event time, on the same machine's clock): how long after a row came into
being its count reached the sink, whether it came from a clock inside the source or
through a producer, a broker and a consumer. Only rows received after the warm-up count.
What differs by design: a synthetic source cuts a batch every buffer timeout (5 ms); a
Kafka source at every heartbeat marker taken (every 10 ms) and, like both, every
``batch_rows`` rows — a log source never cuts on timing. Every run is
checked against the reference executor (lost and duplicates; the Kafka run's reference
replays the log it read; the delivery run's readers must see every offset once, in
order). CPU: ``cpu_s``, the job's processes (its workers, and for the Kafka run the
heartbeat generators) from start to exit, and for the delivery run this process's;
``producer_cpu_s`` and ``broker_cpu_s`` the outside producer's and the Kafka broker's
during the delivery and Kafka runs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import tandem as td
from tandem import testing
from tandem.experiments import common

RATE = 5_000
KEYS = 1_000
SEED = 1
PARTITIONS = 2
SOURCES = ("synthetic", "delivery", "kafka")
TICK_NS = 1_000_000
"""The producer wakes at most this often (ns)."""
LINGER_MS = 5.0
"""The producer's ``linger.ms`` (librdkafka's default). A broker handles one request of a
connection at a time, so on a busy machine many small requests queue up behind each other:
with 0 (a request per record) the broker fell behind by hundreds of ms at 5,000 records/s;
with 1 the Kafka run's p99 was 180-360 ms in 5 of 6 runs (load average 6-8 on 2 cores),
against 34-126 ms with 5 in the same invocations. A row waits up to this long in the
producer: part of its latency, as it would be in production."""
TARGET_P99_RATIO = 1.5
"""Issue #11: the Kafka-sourced job's p99 within 1.5x of the synthetic one's."""


def keep(batch: pa.RecordBatch) -> pa.Array:
    """The job's filter: rows with ``value < 0.9``."""
    return pc.less(batch["value"], 0.9)


def job(source: td.sources.Source, out_topic: str, bootstrap: str) -> td.Job:
    """The measured job, on ``source`` (see the module documentation)."""
    j = td.Job("kafka-p99", replication=2, ordering="liverobin", heartbeat_ms=10)
    rows = j.source(source, parallelism=PARTITIONS)
    kept = rows.filter(keep, parallelism=PARTITIONS, name="filter")
    counted = kept.key_by("key").process(td.CountPerKey(), parallelism=PARTITIONS, name="count")
    counted.sink(td.sinks.Kafka(out_topic, bootstrap, columns=["key", "count"], key="key"))
    return j


def synthetic(rate: int = RATE) -> td.sources.Synthetic:
    return td.sources.Synthetic(rate=rate, keys=KEYS, seed=SEED)


# -- the producer ---------------------------------------------------------------------------


def payloads(rate: int, start_ns: int, lo: int, hi: int) -> list[bytes]:
    """The records of rows ``lo .. hi - 1`` (:func:`produce`): JSON objects of the
    synthetic source's ``key`` and ``value`` and ``ts``, the row's instant."""
    idx = np.arange(lo, hi, dtype=np.int64)
    key, value = (c.to_pylist() for c in synthetic(rate)._rows(idx))
    ts = (start_ns + idx * 1_000_000_000 // rate).tolist()
    return [b'{"key":%d,"value":%r,"ts":%d}' % row for row in zip(key, value, ts, strict=True)]


def produce(
    bootstrap: str,
    topic: str,
    rate: int,
    start_ns: int,
    linger_ms: float = LINGER_MS,
    stop=None,
) -> int:
    """Write row ``i`` of :func:`synthetic` into partition ``i % 2`` of ``topic`` as soon
    as its instant ``start_ns + i / rate`` has come, ``ts`` = that instant, until ``stop``
    (a callable) says so; returns the rows written. The records of the next second are
    encoded ahead, while the producer waits, and what is due goes in one
    ``produce_batch`` per partition: the producer must keep pace on a loaded machine, or
    its own lag would count as the job's latency."""
    from confluent_kafka import Producer

    from tandem.kafka import client_config

    conf = client_config(bootstrap, {"linger.ms": linger_ms, "acks": "all"})
    producer = Producer(conf)
    sent = 0
    ahead: list[bytes] = []  # the records of rows sent .. sent + len(ahead) - 1
    try:
        while stop is None or not stop():
            now = time.time_ns()
            due = (now - start_ns) * rate // 1_000_000_000
            if due <= sent:
                if len(ahead) < rate:
                    lo = sent + len(ahead)
                    ahead += payloads(rate, start_ns, lo, lo + rate)
                    continue
                # Wake at most every millisecond: what came due meanwhile goes together
                # (the client batches for linger_ms anyway).
                wait_ns = start_ns + (sent + 1) * 1_000_000_000 // rate - now
                time.sleep(max(wait_ns, TICK_NS) / 1e9)
                producer.poll(0)
                continue
            if len(ahead) < due - sent:
                lo = sent + len(ahead)
                ahead += payloads(rate, start_ns, lo, due)
            for p in range(PARTITIONS):
                first = sent + (p - sent) % PARTITIONS  # the first row due of partition p
                batch = [{"value": v} for v in ahead[first - sent : due - sent : PARTITIONS]]
                while batch:
                    producer.produce_batch(topic, batch, partition=p)
                    batch = [m for m in batch if m.get("_error") is not None]
                    for m in batch:
                        del m["_error"]
                    if batch:  # the client's queue is full: let it drain
                        producer.poll(0.001)
            del ahead[: due - sent]
            sent = due
            producer.poll(0)
    finally:
        producer.flush(5)
    return sent


def _producer_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.experiments.kafka")
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--rate", type=int, required=True)
    p.add_argument("--start-ns", type=int, required=True)
    p.add_argument("--linger-ms", type=float, default=LINGER_MS)
    args = p.parse_args(argv)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    n = produce(
        args.bootstrap, args.topic, args.rate, args.start_ns, args.linger_ms, lambda: stopping
    )
    print(f"produced {n} rows", flush=True)
    return 0


# -- the runs -------------------------------------------------------------------------------


@dataclass
class KafkaRow:
    """One run: ``source`` ``synthetic`` or ``kafka``."""

    source: str
    rate: int
    round: int
    warmup_s: float
    measure_s: float
    events_in: int
    events_out: int
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    lost: int | None
    duplicates: int | None
    digests_match: bool
    cpu_s: float
    steady_cpu_s: float | None
    producer_cpu_s: float | None = None
    broker_cpu_s: float | None = None
    load_avg: float | None = None
    p99_ratio: float | None = None
    per_second_p99_ms: list = field(default_factory=list)


def _delete_topics(bootstrap: str, topics: list[str]) -> None:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for fut in admin.delete_topics(topics, operation_timeout=10).values():
        with contextlib.suppress(Exception):  # clean-up only
            fut.result(15)


def _broker_cpu(bootstrap: str) -> float | None:
    from tandem.engines.local import process_cpu_s

    pid = common.listener_pid(common.port_of(bootstrap))
    return None if pid is None else process_cpu_s(pid)


def _row(source: str, rate: int, warmup: float, measure: float, res: td.Result) -> KafkaRow:
    def r(v):
        return None if v is None else round(v, 2)

    return KafkaRow(
        source=source,
        rate=rate,
        round=1,
        warmup_s=warmup,
        measure_s=measure,
        events_in=res.events_in,
        events_out=res.events_out,
        p50_ms=r(res.p50_ms),
        p99_ms=r(res.p99_ms),
        max_ms=r(res.max_ms),
        lost=res.lost,
        duplicates=res.duplicates,
        digests_match=res.digests_match,
        cpu_s=round(res.cpu_s or 0.0, 2),
        steady_cpu_s=r(res.steady_cpu_s),
        load_avg=round(os.getloadavg()[0], 2),
        per_second_p99_ms=[r(v) for v in res.per_second_p99_ms],
    )


def run_synthetic(
    bootstrap: str, rate: int = RATE, warmup: float = 3.0, measure: float = 10.0
) -> KafkaRow:
    out = testing.new_topic(bootstrap, PARTITIONS, "bench-kafka-out")
    try:
        res = job(synthetic(rate), out, bootstrap).run(
            duration=warmup + measure, warmup=warmup, progress=False, check=True
        )
    finally:
        _delete_topics(bootstrap, [out])
    return _row("synthetic", rate, warmup, measure, res)


def run_kafka(
    bootstrap: str,
    rate: int = RATE,
    warmup: float = 3.0,
    measure: float = 10.0,
    linger_ms: float = LINGER_MS,
) -> KafkaRow:
    topic = testing.new_topic(bootstrap, PARTITIONS, "bench-kafka-in")
    out = testing.new_topic(bootstrap, PARTITIONS, "bench-kafka-out")
    schema = {"key": "int64", "value": "float64", "ts": "int64"}
    source = td.sources.Kafka(topic, bootstrap, schema=schema, event_time="ts")
    j = job(source, out, bootstrap)
    feed = _Feed(bootstrap, topic, rate, time.time_ns() + 200_000_000, linger_ms)
    try:
        with feed:
            res = j.run(duration=warmup + measure, warmup=warmup, progress=False, check=True)
    finally:
        _delete_topics(bootstrap, [topic, out])
    return feed.credit(_row("kafka", rate, warmup, measure, res))


class _Feed:
    """The producer process (:func:`produce`) filling ``topic`` while a run is inside
    ``with``, its first row due at ``start_ns``; on leaving, the CPU seconds it and the
    broker spent meanwhile (:meth:`credit` puts them in the run's row)."""

    def __init__(self, bootstrap: str, topic: str, rate: int, start_ns: int, linger_ms: float):
        self.bootstrap = bootstrap
        self.cmd = [
            sys.executable,
            "-m",
            "tandem.experiments.kafka",
            "--bootstrap",
            bootstrap,
            "--topic",
            topic,
            "--rate",
            str(rate),
            "--start-ns",
            str(start_ns),
            "--linger-ms",
            repr(linger_ms),
        ]
        self.producer_cpu_s: float | None = None
        self.broker_cpu_s: float | None = None

    def __enter__(self) -> _Feed:
        self._broker0 = _broker_cpu(self.bootstrap)
        self._producer = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc) -> None:
        self._producer.send_signal(signal.SIGTERM)
        _, status, usage = os.wait4(self._producer.pid, 0)
        self._producer.returncode = status
        self.producer_cpu_s = round(usage.ru_utime + usage.ru_stime, 2)
        broker1 = _broker_cpu(self.bootstrap)
        if self._broker0 is not None and broker1 is not None:
            self.broker_cpu_s = round(broker1 - self._broker0, 2)

    def credit(self, row: KafkaRow) -> KafkaRow:
        row.producer_cpu_s, row.broker_cpu_s = self.producer_cpu_s, self.broker_cpu_s
        return row


DELIVERY_GRACE_S = 30.0
"""How long after the measured span :func:`run_delivery` waits for its readers to reach
the end of it."""


class _Delivery:
    """One reader of :func:`run_delivery`: a :class:`tandem.kafka.LogReader` of one
    partition whose wake-up times every row it hands over (due within ``[lo_ns, hi_ns)``)
    and checks that offsets come in order, none missing or repeated."""

    def __init__(self, bootstrap: str, topic: str, partition: int, lo_ns: int, hi_ns: int):
        from tandem.kafka import LogReader

        self.lo_ns, self.hi_ns = lo_ns, hi_ns
        self.latencies_ms: list[float] = []
        self.next_offset = 0
        self.skipped = self.repeated = 0
        self.latest_ns = 0  # the latest instant a row handed over was due
        self.reader = LogReader(bootstrap, topic, partition, 0, None, self._wake, "delivery")

    def _wake(self) -> None:  # on the reader's thread
        now = time.time_ns()
        for m in self.reader.take():
            ts = int(m.value().rsplit(b'"ts":', 1)[1].rstrip(b"}"))
            if self.lo_ns <= ts < self.hi_ns:
                self.latencies_ms.append((now - ts) / 1e6)
            self.latest_ns = max(self.latest_ns, ts)
            off = m.offset()
            if off > self.next_offset:
                self.skipped += off - self.next_offset
            elif off < self.next_offset:
                self.repeated += 1
            self.next_offset = max(self.next_offset, off + 1)


def run_delivery(
    bootstrap: str,
    rate: int = RATE,
    warmup: float = 3.0,
    measure: float = 10.0,
    linger_ms: float = LINGER_MS,
    replication: int = 2,
) -> KafkaRow:
    """Kafka's own part of the Kafka run's latency, with no job: the same producer at the
    same pace, and the readers a Kafka source's replicas use (:class:`tandem.kafka.LogReader`,
    one per partition and replica, in this process), each row timed as its reader hands
    it over, minus the instant it was due. A reader's rows must come in log order with no
    offset missing or repeated (``lost``/``duplicates``, in offsets)."""
    topic = testing.new_topic(bootstrap, PARTITIONS, "bench-kafka-in")
    start_ns = time.time_ns() + 200_000_000
    lo_ns = start_ns + int(warmup * 1e9)
    hi_ns = lo_ns + int(measure * 1e9)
    readers = [
        _Delivery(bootstrap, topic, i % PARTITIONS, lo_ns, hi_ns)
        for i in range(PARTITIONS * replication)
    ]
    cpu0 = time.process_time()
    feed = _Feed(bootstrap, topic, rate, start_ns, linger_ms)
    try:
        with feed:
            try:
                for r in readers:
                    r.reader.start()
                # Until every reader has had a row due after the measured span (or the
                # producer or the broker is hopelessly behind).
                deadline = time.monotonic() + (hi_ns - time.time_ns()) / 1e9 + DELIVERY_GRACE_S
                while min(r.latest_ns for r in readers) < hi_ns and time.monotonic() < deadline:
                    if any(r.reader.error is not None for r in readers):
                        break
                    time.sleep(0.05)
            finally:
                for r in readers:
                    r.reader.stop()
    finally:
        _delete_topics(bootstrap, [topic])
    for r in readers:
        if r.reader.error is not None:
            raise r.reader.error
    behind = sum(r.latest_ns < hi_ns for r in readers)
    if behind:
        raise RuntimeError(
            f"bench kafka: {behind} of Kafka's delivery readers had not reached the end "
            f"of the measured span {DELIVERY_GRACE_S:g} s after it: the producer or the broker "
            "fell behind"
        )
    every = np.concatenate([np.asarray(r.latencies_ms, dtype=np.float64) for r in readers])

    def pct(q: float) -> float | None:
        return round(float(np.percentile(every, q)), 2) if every.size else None

    row = KafkaRow(
        source="delivery",
        rate=rate,
        round=1,
        warmup_s=warmup,
        measure_s=measure,
        events_in=int(every.size),
        events_out=int(every.size),
        p50_ms=pct(50),
        p99_ms=pct(99),
        max_ms=round(float(every.max()), 2) if every.size else None,
        lost=sum(r.skipped for r in readers),
        duplicates=sum(r.repeated for r in readers),
        digests_match=True,
        cpu_s=round(time.process_time() - cpu0, 2),
        steady_cpu_s=None,
        load_avg=round(os.getloadavg()[0], 2),
    )
    return feed.credit(row)


def kafka(
    bootstrap: str | None = None,
    rate: int = RATE,
    warmup: float = 3.0,
    measure: float = 10.0,
    linger_ms: float = LINGER_MS,
    rounds: int = 1,
    log=None,
) -> list[KafkaRow]:
    """``rounds`` pairs of runs, each a synthetic run then a Kafka run (alternating, so
    that a machine whose load changes weighs on both alike); each Kafka row's
    ``p99_ratio`` is its p99 over that of the synthetic run just before it."""
    log = log or sys.stderr  # at call time: sys.stderr may have been replaced
    from tandem.kafka import default_bootstrap

    bootstrap = bootstrap or default_bootstrap()
    rows: list[KafkaRow] = []
    for i in range(rounds):
        at = f" (round {i + 1}/{rounds})" if rounds > 1 else ""
        print(f"kafka bench: synthetic source, {rate} ev/s{at} ...", file=log, flush=True)
        syn = run_synthetic(bootstrap, rate, warmup, measure)
        print(f"kafka bench: Kafka's delivery alone, {rate} ev/s{at} ...", file=log, flush=True)
        dlv = run_delivery(bootstrap, rate, warmup, measure, linger_ms)
        print(f"kafka bench: Kafka source, {rate} ev/s{at} ...", file=log, flush=True)
        kaf = run_kafka(bootstrap, rate, warmup, measure, linger_ms)
        for row in (dlv, kaf):
            if syn.p99_ms and row.p99_ms is not None:
                row.p99_ratio = round(row.p99_ms / syn.p99_ms, 2)
        syn.round = dlv.round = kaf.round = i + 1
        rows += [syn, dlv, kaf]
    return rows


def check_options(rate: int, warmup: float, measure: float, rounds: int = 1) -> None:
    """Raise ConfigError for options the bench cannot run with, before anything runs."""
    if isinstance(rate, bool) or not isinstance(rate, int) or rate < 1:
        raise td.ConfigError(f"bench kafka: the rate must be an int >= 1 ev/s, got {rate!r}")
    if not warmup >= 0 or not measure > 0:
        raise td.ConfigError(
            f"bench kafka: the warm-up must be >= 0 s and the measured time > 0 s, got "
            f"{warmup} and {measure}"
        )
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise td.ConfigError(f"bench kafka: rounds must be an int >= 1, got {rounds!r}")


SUMMARY = (
    "round",
    "source",
    "p50_ms",
    "p99_ms",
    "max_ms",
    "p99_ratio",
    "events_out",
    "lost",
    "duplicates",
    "cpu_s",
    "producer_cpu_s",
    "broker_cpu_s",
    "load_avg",
)


def summary(rows: list[KafkaRow]) -> list[dict]:
    """The columns the CLI prints (``--json`` has them all)."""
    return [{k: getattr(r, k) for k in SUMMARY} for r in rows]


def median_ratio(rows: list[KafkaRow], source: str = "kafka") -> float | None:
    """The median of the rounds' p99 ratios of ``source``'s runs to the synthetic ones
    (None if none was measured)."""
    ratios = [r.p99_ratio for r in rows if r.source == source and r.p99_ratio is not None]
    return round(float(np.median(ratios)), 2) if ratios else None


def verdict(rows: list[KafkaRow]) -> str:
    """One line: the Kafka runs' p99 against the synthetic ones' and the target."""
    ratio = median_ratio(rows)
    if ratio is None:
        return "p99 ratio: not measured (a run recorded no latency)"
    p99 = {s: [r.p99_ms for r in rows if r.source == s] for s in SOURCES}
    rounds = len(p99["kafka"])
    what = "" if rounds == 1 else f"median of {rounds} rounds "
    loads = [r.load_avg for r in rows if r.load_avg is not None]
    line = (
        f"p99: Kafka {', '.join(map(str, p99['kafka']))} ms, synthetic "
        f"{', '.join(map(str, p99['synthetic']))} ms: {what}{ratio}x (target <= "
        f"{TARGET_P99_RATIO}x: {'met' if ratio <= TARGET_P99_RATIO else 'missed'}; load "
        f"average {min(loads, default=0):g}-{max(loads, default=0):g} on {os.cpu_count()} CPUs)"
    )
    alone = [v for v in p99["delivery"] if v is not None]
    if alone:
        share = median_ratio(rows, "delivery")
        line += (
            f"\nKafka's delivery alone (producer -> broker -> the source's readers, no job): "
            f"p99 {', '.join(map(str, alone))} ms, {what}{share}x the synthetic job's"
        )
    return line


def rows_json(rows: list[KafkaRow]) -> list[dict]:
    return [asdict(r) for r in rows]


# -- the command ---------------------------------------------------------------------------

HELP = (
    "filter -> keyed count -> Kafka sink (r = 2 LiveRobin) on a synthetic source, Kafka's "
    "delivery alone, then a Kafka source fed at the same rate: p50/p99, the p99 ratio, CPU"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_rate(p, RATE, f"the source's events per second (default {RATE})")
    common.add_seconds(p, "--warmup", 3.0, "left out of latency at every run's start (default 3)")
    common.add_seconds(p, "--measure", 10.0, "measured after the warm-up (default 10)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="N",
        help="N rounds of runs, synthetic, delivery, then Kafka, alternating (default 1); "
        "the ratio reported is the median of the rounds'",
    )
    common.add_json(p)


def main(args: argparse.Namespace) -> int:
    rate, warmup, measure, rounds = args.rate, args.warmup, args.measure, args.rounds
    check_options(rate, warmup, measure, rounds)
    common.headline(
        f"bench kafka: filter -> keyed count -> Kafka sink, r = 2 LiveRobin, {rate} ev/s, "
        f"warm-up {warmup:g} s, measured {measure:g} s; a synthetic source, Kafka's delivery "
        "alone, then a Kafka source" + (f", {rounds} rounds" if rounds > 1 else "")
    )
    from tandem._services import ensure_running

    services = ensure_running(zookeeper=False, kafka=True)
    try:
        rows = kafka(services.kafka_bootstrap, rate, warmup, measure, rounds=rounds)
    finally:
        if services.started:
            services.stop()
            print("stopped kafka (started for this command)")
    print(common.table(summary(rows)))
    print(verdict(rows))
    common.write_json(
        args.json,
        {
            "experiment": "kafka",
            "tandem": td.__version__,
            "build": td.build_profile,
            "cpus": os.cpu_count(),
            "target_p99_ratio": TARGET_P99_RATIO,
            "median_p99_ratio": median_ratio(rows),
            "delivery_median_p99_ratio": median_ratio(rows, "delivery"),
            "rows": rows_json(rows),
        },
    )
    return 0 if all(r.lost == 0 and r.duplicates == 0 and r.digests_match for r in rows) else 1


if __name__ == "__main__":
    sys.exit(_producer_main(sys.argv[1:]))
