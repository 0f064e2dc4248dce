"""The metrics endpoint: Prometheus text from the driver, covering every worker.

While a run goes on, each worker process hands the driver a snapshot of its replicas'
counters once a second (``Worker.metrics``, asked for with ``metrics_every``): the counts
the runtime keeps anyway — a replica's report (rows in and out), its inbox's counters in
the Rust core (duplicate rows dropped, input queued, merge wait, digest mismatches), its
slot in the core's worker (the last heartbeat it forwarded, frames queued on its output
links), a sink's latency record (:mod:`tandem.latency`), a KaZoo orderer's leadership.
Nothing is counted per row for the metrics, and the snapshot is taken on the worker thread
at its existing idle check, so the data path gets no extra wake-up. :class:`Metrics`, on
the driver, keeps the latest snapshot of every replica plus the engine's own record (lost
and restored replicas) and renders them at each scrape, in a registry of its own (never
``prometheus_client``'s global one), served over HTTP on 127.0.0.1.

Every metric is named ``tandem_*`` and labelled ``task``, ``partition``, ``replica``
(see :data:`METRICS` and docs/operations.md, "Metrics"). A replica rebuilt in a new process
(``Job(restore=True)``) continues its counters from where the lost one's last snapshot
left them, so they never go back. Gauges are served only for replicas that run.

The local engine serves it with ``metrics_port=`` (``job.run(..., metrics_port=9464)``,
``tandem demo --metrics-port 9464``); port 0 picks a free port (:attr:`Metrics.port`).
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from tandem.exceptions import ConfigError
from tandem.latency import METRIC_BUCKETS_S
from tandem.plan import Plan
from tandem.runtime import METRICS_EVERY_S, ReplicaId

log = logging.getLogger("tandem")

LABELS = ["task", "partition", "replica"]

COUNTERS = {
    "rows_in": (
        "tandem_rows_in",
        "Rows a replica took in: a source's rows read or generated, an operator's or sink's "
        "rows delivered by its merge (after dedup).",
    ),
    "rows_out": (
        "tandem_rows_out",
        "Rows a replica emitted, summed over its output edges.",
    ),
    "dedup_dropped": (
        "tandem_dedup_dropped_rows",
        "Rows dropped by a replica's dedup because another upstream replica's copy came first.",
    ),
    "merge_wait_s": (
        "tandem_merge_wait_seconds",
        "Time a replica's merge held queued input back (LiveRobin waiting for the channel "
        "whose turn it is, a KaZoo follower waiting for an order).",
    ),
    "divergences": (
        "tandem_digest_mismatches",
        "Heartbeat cycles in which two replicas of an upstream partition sent this replica "
        "different digests.",
    ),
}
"""Per-replica counters: snapshot key -> (metric name without ``_total``, help)."""

GAUGES = {
    "heartbeat_lag_s": (
        "tandem_heartbeat_lag_seconds",
        "Wall clock minus the logical time of the last heartbeat a replica forwarded (a "
        "source: sent): how far its watermark trails real time.",
    ),
    "queued": (
        "tandem_input_queue_seqs",
        "Sequence numbers (rows and markers) accepted by a replica's dedup and not yet "
        "taken by its merge, over its input channels.",
    ),
    "backlog": (
        "tandem_output_backlog_frames",
        "Frames queued on a replica's output links (its most backed-up channel).",
    ),
}
"""Per-replica gauges of running replicas: snapshot key -> (metric name, help)."""

METRICS = (
    *(f"{name}_total" for name, _ in COUNTERS.values()),
    *(name for name, _ in GAUGES.values()),
    "tandem_latency_seconds",
    "tandem_kazoo_leader",
    "tandem_kazoo_epoch",
    "tandem_lost_replicas_total",
    "tandem_restored_replicas_total",
)
"""Every metric name served (counters with their ``_total`` suffix; the histogram also
as its ``_bucket``, ``_sum`` and ``_count`` series)."""


class Metrics:
    """The driver's collector for one run of ``plan`` (see the module documentation).

    The engine calls :meth:`update` with each worker snapshot and :meth:`engine` with its
    record of lost and restored replicas; :meth:`serve` starts the HTTP endpoint,
    :meth:`close` stops it. Thread-safe: scrapes come on the server's threads."""

    every_s = METRICS_EVERY_S
    """How often workers send snapshots."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self.port: int | None = None
        self._lock = threading.Lock()
        self._latest: dict[ReplicaId, dict] = {}
        self._pid: dict[ReplicaId, int] = {}
        self._base: dict[ReplicaId, dict[str, float]] = {}
        """Per replica, the counters of the processes it ran in before (rebuilt)."""
        self._base_latency: dict[ReplicaId, tuple[list[int], int]] = {}
        self._lost: tuple[tuple[ReplicaId, str], ...] = ()
        self._restored: tuple[dict, ...] = ()
        self._down: frozenset[ReplicaId] = frozenset()
        self._server = None
        self._thread: threading.Thread | None = None

    # -- the engine's side ----------------------------------------------------------------

    def update(self, snapshot: dict) -> None:
        """Take a worker's snapshot (``Worker.metrics``)."""
        pid = snapshot["pid"]
        with self._lock:
            for rid, m in snapshot["replicas"].items():
                prev = self._latest.get(rid)
                if prev is not None and self._pid.get(rid) != pid:
                    # A new process for this replica (rebuilt): keep what the old one counted.
                    base = self._base.setdefault(rid, {})
                    for key in COUNTERS:
                        base[key] = base.get(key, 0) + prev.get(key, 0)
                    if "latency" in prev:
                        self._base_latency[rid] = _add_latency(
                            self._base_latency.get(rid), prev["latency"]
                        )
                self._latest[rid] = m
                self._pid[rid] = pid

    def engine(
        self,
        lost: Iterable[tuple[ReplicaId, str]],
        restored: Iterable[dict],
        down: Iterable[ReplicaId],
    ) -> None:
        """The engine's record so far: every replica lost (with its cause), every replica
        restored (``Result.restored_replicas`` entries), the replicas down now."""
        lost, restored, down = tuple(lost), tuple(restored), frozenset(down)
        with self._lock:
            self._lost, self._restored, self._down = lost, restored, down

    # -- HTTP -----------------------------------------------------------------------------

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve ``http://host:port/metrics`` (any path answers) until :meth:`close`; port
        0 picks a free one. The port served. Raises ConfigError if the port is taken."""
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError(f"metrics_port must be a port number in [0, 65535], got {port!r}")
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            taken = exc.errno == errno.EADDRINUSE
            raise ConfigError(
                f"cannot serve metrics on {host}:{port}: "
                + (
                    "the port is taken (another tandem run or another program listens there)"
                    if taken
                    else str(exc)
                )
                + "; choose another port (--metrics-port / metrics_port=), or 0 for a free one"
            ) from None
        self.port = self._server.server_port
        log.info("metrics at http://%s:%d/metrics", host, self.port)
        return self.port

    def close(self) -> None:
        """Stop serving and release the port. Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def text(self) -> str:
        """What a scrape returns now (Prometheus text format)."""
        return generate_latest(self.registry).decode()

    # -- rendering (prometheus_client's Collector interface) -----------------------------

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            latest = dict(self._latest)
            base = {rid: dict(b) for rid, b in self._base.items()}
            base_latency = dict(self._base_latency)
            lost, restored, down = self._lost, self._restored, self._down
        counters = {
            key: CounterMetricFamily(name, doc, labels=LABELS)
            for key, (name, doc) in COUNTERS.items()
        }
        gauges = {
            key: GaugeMetricFamily(name, doc, labels=LABELS) for key, (name, doc) in GAUGES.items()
        }
        latency = HistogramMetricFamily(
            "tandem_latency_seconds",
            "End-to-end latency of the rows a sink received (receive time - event time), "
            "after the run's warm-up.",
            labels=LABELS,
        )
        leaders: dict[tuple[int, int], tuple[int, int]] = {}  # partition -> (epoch, replica)
        epochs: dict[tuple[int, int], int] = {}
        for rid in sorted(latest):
            m = latest[rid]
            labels = self._labels(rid)
            earlier = base.get(rid, {})
            for key, family in counters.items():
                if key in m or key in earlier:
                    family.add_metric(labels, m.get(key, 0) + earlier.get(key, 0))
            if "latency" in m:
                buckets, sum_ns = _add_latency(base_latency.get(rid), m["latency"])
                cumulative, total = [], 0
                for bound, n in zip((*map(str, METRIC_BUCKETS_S), "+Inf"), buckets, strict=True):
                    total += n
                    cumulative.append((bound, total))
                latency.add_metric(labels, cumulative, sum_ns / 1e9)
            running = m.get("active") and rid not in down
            if not running:
                continue
            for key, family in gauges.items():
                if key in m:
                    family.add_metric(labels, m[key])
            if "kazoo" in m:
                leading, followed = m["kazoo"]
                part = rid[:2]
                epochs[part] = max(epochs.get(part, 0), followed or 0, leading or 0)
                # Two replicas may both believe they lead for a moment: the newer epoch
                # fences the older.
                if leading is not None and leading > leaders.get(part, (-1, -1))[0]:
                    leaders[part] = (leading, rid[2])
        yield from counters.values()
        yield from gauges.values()
        yield latency
        if epochs:
            leader = GaugeMetricFamily(
                "tandem_kazoo_leader",
                "The replica leading a KaZoo partition's order (-1: none known now).",
                labels=LABELS[:2],
            )
            epoch = GaugeMetricFamily(
                "tandem_kazoo_epoch",
                "The newest leader epoch of a KaZoo partition (its fencing token).",
                labels=LABELS[:2],
            )
            for part in sorted(epochs):
                labels = self._labels(part)
                leader.add_metric(labels, leaders.get(part, (-1, -1))[1])
                epoch.add_metric(labels, epochs[part])
            yield leader
            yield epoch
        lost_family = CounterMetricFamily(
            "tandem_lost_replicas",
            "Replicas the engine lost, by cause (killed, crashed, silent, evicted).",
            labels=[*LABELS, "cause"],
        )
        counts: dict[tuple, int] = {}
        for rid, cause in lost:
            key = (*self._labels(rid), cause)
            counts[key] = counts.get(key, 0) + 1
        for key, n in sorted(counts.items()):
            lost_family.add_metric(list(key), n)
        yield lost_family
        restored_family = CounterMetricFamily(
            "tandem_restored_replicas",
            "Lost replicas the engine rebuilt from a live twin (Job(restore=True)).",
            labels=LABELS,
        )
        counts = {}
        for r in restored:
            key = (r["task"], str(r["partition"]), str(r["replica"]))
            counts[key] = counts.get(key, 0) + 1
        for key, n in sorted(counts.items()):
            restored_family.add_metric(list(key), n)
        yield restored_family

    def _labels(self, rid: tuple[int, ...]) -> list[str]:
        return [self.plan.tasks[rid[0]].name, *map(str, rid[1:])]


def _add_latency(
    a: tuple[list[int], int] | None, b: tuple[list[int], int]
) -> tuple[list[int], int]:
    if a is None:
        return list(b[0]), b[1]
    return [x + y for x, y in zip(a[0], b[0], strict=True)], a[1] + b[1]


def serve(plan: Plan, port: int, host: str = "127.0.0.1") -> Metrics:
    """A :class:`Metrics` for a run of ``plan``, already serving on ``host:port``."""
    metrics = Metrics(plan)
    metrics.serve(port, host)
    return metrics


__all__ = ["METRICS", "Metrics", "serve"]
