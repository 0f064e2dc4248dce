"""The Prometheus endpoint (`tandem.metrics`): scraped over HTTP while real runs go on."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

import jobs
import tandem as td
from tandem import testing
from tandem.cli import main
from tandem.metrics import METRICS, Metrics

RATE = 1_000


def pipeline(**job_options) -> td.Job:
    return jobs.counting_job("metered", RATE, **job_options)


class Scraper:
    """Scrapes ``port`` every ``every`` seconds from a thread until stopped."""

    def __init__(self, port: int, every: float = 0.25) -> None:
        self.port, self.every = port, every
        self.scrapes: list[dict] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.scrapes.append(testing.scrape_metrics(self.port))
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                self.errors += 1  # before the server is up, or after it closed
            self._stop.wait(self.every)

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def key(task: str, partition: int, replica: int, **more: str) -> tuple:
    labels = {"task": task, "partition": str(partition), "replica": str(replica), **more}
    return tuple(sorted(labels.items()))


def test_a_run_serves_every_replicas_counters_and_closes_the_port():
    port = testing.free_port()
    job = pipeline(restore=True)
    faults = [td.Kill("count", partition=0, replica=0, at=1.5)]
    # Often enough to see the rebuild's window (a few hundred ms) with the killed replicas down.
    with Scraper(port, every=0.02) as scraper:
        res = job.run(duration=8.0, faults=faults, progress=False, metrics_port=port)
    assert res.lost == 0 and res.duplicates == 0 and res.digests_match
    scrapes = [s for s in scraper.scrapes if "tandem_rows_in_total" in s]
    assert len(scrapes) >= 5, f"{len(scraper.scrapes)} scrapes, {scraper.errors} refused"

    replicas = [
        (t.name, p, r)
        for t in job.plan().tasks
        for p in range(t.parallelism)
        for r in range(t.replication)
    ]
    assert len(replicas) == 14  # source, enrich, count: 2 partitions x 2 replicas; 2 sinks
    last = scrapes[-1]
    for name in ("tandem_rows_in_total", "tandem_rows_out_total"):
        for rid in replicas:
            if name == "tandem_rows_out_total" and rid[0] == "sink":
                continue
            assert last[name].get(key(*rid), 0) > 0, (name, rid, last[name])
    # Counters never go back, the killed and rebuilt replica's included, and they grew
    # while the run went on.
    for name in (
        "tandem_rows_in_total",
        "tandem_rows_out_total",
        "tandem_dedup_dropped_rows_total",
    ):
        for labels in last[name]:
            seen = [s[name][labels] for s in scrapes if labels in s.get(name, {})]
            assert seen == sorted(seen), (name, labels, seen)
    for rid in replicas:
        seen = [s["tandem_rows_in_total"].get(key(*rid)) for s in scrapes]
        seen = [v for v in seen if v is not None]
        assert seen[-1] > seen[0], (rid, seen)
    # Every source row reached both replicas of `enrich`: the twin copies were dropped.
    for p in (0, 1):
        for r in (0, 1):
            assert last["tandem_dedup_dropped_rows_total"][key("enrich", p, r)] > 0
            assert key("count", p, r) in last["tandem_merge_wait_seconds_total"]
            assert last["tandem_digest_mismatches_total"][key("count", p, r)] == 0
    assert last["tandem_rows_in_total"][key("sink", 0, 0)] == res.events_out
    # Each sink copy's latency histogram counts every row it received (no warm-up here).
    counts = last["tandem_latency_seconds_count"]
    assert sum(counts.values()) == 2 * res.events_out
    for labels, n in counts.items():
        inf = dict(labels) | {"le": "+Inf"}
        assert last["tandem_latency_seconds_bucket"][tuple(sorted(inf.items()))] == n
    # Gauges are served for running replicas only: all 14 before the kill, 8 in any scrape
    # taken while the killed worker's 6 were down (lost, not yet restored), none once the
    # stream ended. The rebuild may be quicker than the scrape period, so whether a scrape
    # fell in that window is timing; what such a scrape shows is not.
    gauged = [len(s.get("tandem_heartbeat_lag_seconds", {})) for s in scrapes]
    assert max(gauged) == 14 and gauged[-1] == 0, gauged
    down = [
        (
            sum(s.get("tandem_lost_replicas_total", {}).values())
            - sum(s.get("tandem_restored_replicas_total", {}).values()),
            n,
        )
        for s, n in zip(scrapes, gauged, strict=True)
    ]
    assert all(n in (14 - d, 0) for d, n in down if d > 0), down
    assert (0, 14) in down and {d for d, _ in down} <= {0, 6}, down
    # Mid-run (a second or more after t0), the watermarks trail real time by about a
    # heartbeat period (10 ms), not by the time since t0.
    middle = next(s for s in scrapes if len(s.get("tandem_heartbeat_lag_seconds", {})) == 14)
    lags = sorted(middle["tandem_heartbeat_lag_seconds"].values())
    assert lags[len(lags) // 2] < 1.0 and lags[-1] < 10.0, lags
    assert len(middle["tandem_input_queue_seqs"]) == 10  # every replica with an inbox
    assert len(middle["tandem_output_backlog_frames"]) == 14
    # The engine's record: the kill, and the rebuilt replica group.
    lost = last["tandem_lost_replicas_total"]
    assert lost[key("count", 0, 0, cause="killed")] == 1, lost
    assert sum(lost.values()) == len(res.lost_replicas)
    restored = last.get("tandem_restored_replicas_total", {})
    assert sum(restored.values()) == len(res.restored_replicas) > 0, restored
    # Only the names the module documents, and all of them but KaZoo's (the gauges while
    # replicas ran: the last scrape came after they finished).
    served = {name for s in scrapes for name in s}
    served -= {f"tandem_latency_seconds_{s}" for s in ("bucket", "count", "sum")}
    assert served | {"tandem_latency_seconds"} == set(METRICS) - {
        "tandem_kazoo_leader",
        "tandem_kazoo_epoch",
    }

    # The run is over: nothing listens on the port any more.
    with pytest.raises(urllib.error.URLError):
        testing.scrape_metrics(port)


def test_a_taken_port_is_refused_before_anything_starts():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        began = time.monotonic()
        with pytest.raises(td.ConfigError, match=f"127.0.0.1:{port}: the port is taken"):
            pipeline().run(duration=2.0, progress=False, metrics_port=port)
        assert time.monotonic() - began < 5.0


def test_demo_metrics_port_flag(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["demo", "--duration", "2", "--no-progress", "--metrics-port", str(port)])
    assert code == 2
    assert "--metrics-port" in capsys.readouterr().err


def test_a_rebuilt_replicas_counters_continue_and_gauges_follow_liveness():
    job = pipeline()
    plan = job.plan()
    m = Metrics(plan)
    count = next(t.id for t in plan.tasks if t.name == "count")
    rid = (count, 0, 1)
    m.update({"pid": 10, "replicas": {rid: {"rows_in": 5, "active": True, "backlog": 3}}})
    text = m.text()
    assert 'tandem_rows_in_total{partition="0",replica="1",task="count"} 5.0' in text
    assert 'tandem_output_backlog_frames{partition="0",replica="1",task="count"} 3.0' in text
    # Lost: its gauges go, its counters stay.
    m.engine([(rid, "killed")], [], [rid])
    text = m.text()
    assert "tandem_output_backlog_frames{" not in text
    assert 'tandem_rows_in_total{partition="0",replica="1",task="count"} 5.0' in text
    assert 'tandem_lost_replicas_total{cause="killed",partition="0",replica="1",task="count"}' in (
        text
    )
    # Rebuilt in a new process, which counts from 0 again: the counter goes on from 5.
    m.engine([(rid, "killed")], [{"task": "count", "partition": 0, "replica": 1}], [])
    m.update({"pid": 11, "replicas": {rid: {"rows_in": 2, "active": True}}})
    text = m.text()
    assert 'tandem_rows_in_total{partition="0",replica="1",task="count"} 7.0' in text
    assert 'tandem_restored_replicas_total{partition="0",replica="1",task="count"} 1.0' in text


def test_kazoo_leaders_and_epochs_are_read_from_the_replicas():
    plan = pipeline().plan()
    m = Metrics(plan)
    count = next(t.id for t in plan.tasks if t.name == "count")
    m.update(
        {
            "pid": 1,
            "replicas": {
                (count, 0, 0): {"active": True, "kazoo": (None, 3)},
                (count, 0, 1): {"active": True, "kazoo": (4, 3)},  # took over, not yet followed
                (count, 1, 0): {"active": True, "kazoo": (2, 2)},
                (count, 1, 1): {"active": True, "kazoo": (None, 2)},
                # Leading before any order was followed (the log's epoch is unknown).
                (count, 2, 0): {"active": True, "kazoo": (1, None)},
                (count, 2, 1): {"active": True, "kazoo": (None, None)},
            },
        }
    )
    text = m.text()
    assert 'tandem_kazoo_leader{partition="0",task="count"} 1.0' in text
    assert 'tandem_kazoo_epoch{partition="0",task="count"} 4.0' in text
    assert 'tandem_kazoo_leader{partition="1",task="count"} 0.0' in text
    assert 'tandem_kazoo_epoch{partition="1",task="count"} 2.0' in text
    assert 'tandem_kazoo_leader{partition="2",task="count"} 0.0' in text
    assert 'tandem_kazoo_epoch{partition="2",task="count"} 1.0' in text


def test_kazoo_run_serves_the_leader_and_epoch_of_every_partition(zookeeper, kafka):
    port = testing.free_port()
    config = td.KazooConfig(
        zk_hosts=zookeeper.zk_hosts, kafka_bootstrap=kafka.kafka_bootstrap, session_timeout_s=0.5
    )
    job = pipeline(ordering="kazoo", kazoo=config)  # `count` (two input channels) is ordered
    faults = [td.Kill("count", partition=0, replica="leader", at=2.0)]
    with Scraper(port) as scraper:
        res = job.run(duration=5.0, faults=faults, progress=False, metrics_port=port)
    assert res.lost == 0 and res.duplicates == 0 and res.digests_match
    part = {p: (("partition", str(p)), ("task", "count")) for p in (0, 1)}
    led = [s for s in scraper.scrapes if s.get("tandem_kazoo_leader", {}).get(part[0], -1) >= 0]
    assert led, f"{len(scraper.scrapes)} scrapes, {scraper.errors} refused"
    victim = res.faults[0]["victim"]
    first, last = led[0], led[-1]
    assert first["tandem_kazoo_leader"][part[0]] == victim
    assert last["tandem_kazoo_leader"][part[0]] == 1 - victim
    assert last["tandem_kazoo_epoch"][part[0]] > first["tandem_kazoo_epoch"][part[0]] >= 1
    assert last["tandem_kazoo_leader"][part[1]] in (0, 1)
    assert last["tandem_kazoo_epoch"][part[1]] >= 1
