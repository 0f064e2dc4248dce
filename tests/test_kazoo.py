"""KaZoo end to end, against the real ZooKeeper and Kafka `scripts/services.sh` runs.

Every run's output is checked against the reference executor following the orders the
replicas followed (read back from the order topics), so "identical to the reference" here
means: every row, each exactly once, with every stateful result (running counts per key)
exactly what that consumption order gives — and both replicas of every partition agreed,
cycle by cycle (digests).
"""

from __future__ import annotations

import itertools
import socket
import threading
import time

import pyarrow as pa
import pytest

import tandem as td
from tandem import _core, testing
from tandem.ordering import kazoo
from tandem.ordering.kazoo import KazooConfig

RATE = 1_000
pytestmark = pytest.mark.timeout(240)


def relay(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch


def kazoo_job(
    services, name: str = "kz", session_timeout_s: float = 1.0, replication: int = 2
) -> td.Job:
    """source (2) → key_by → count (2, stateful) → key_by → relay (2) → sink: both operator
    tasks read two input channels, so both run an election and follow an order log."""
    config = KazooConfig(
        zk_hosts=services.zk_hosts,
        kafka_bootstrap=services.kafka_bootstrap,
        session_timeout_s=session_timeout_s,
    )
    job = td.Job(name, replication=replication, ordering="kazoo", kazoo=config)
    ev = job.source(td.sources.Synthetic(rate=RATE, keys=40, seed=5), parallelism=2)
    counted = ev.key_by("key").process(td.CountPerKey(), parallelism=2, name="count")
    counted.key_by("key").map(relay, parallelism=2, name="relay").sink(td.sinks.Collect())
    return job


def assert_masked(res: td.Result) -> None:
    assert res.lost == 0 and res.duplicates == 0, (res.lost, res.duplicates)
    assert res.digests_match, res.determinism_errors
    assert res.events_out == res.events_in > 0
    assert res.output is not None and res.output.num_rows == res.events_in


def test_fault_free_run_follows_one_leader_per_partition(zookeeper, kafka):
    job = kazoo_job(kafka)
    res = job.run(duration=3.0, progress=False)
    assert_masked(res)
    assert sorted(res.leaders) == ["count[0]", "count[1]", "relay[0]", "relay[1]"]
    # One ZooKeeper session per worker, shared by the four ordered partitions it hosts;
    # none expired without a fault.
    plan = job.plan()
    ordered = set(plan.ordered_partitions())
    workers = [w for w in plan.placement() if any((t, p) in ordered for t, p, _ in w)]
    assert len(res.kazoo_sessions) == len(workers) == 2, res.kazoo_sessions
    assert all(s["expired"] == 0 for s in res.kazoo_sessions), res.kazoo_sessions
    for name, terms in res.leaders.items():
        # Usually one leader through the input (when it has consumed everything it stops,
        # and its twin may lead for the last few milliseconds). A starved machine can let
        # a session expire mid-run; then terms follow each other with growing epochs.
        epochs = [t["epoch"] for t in terms]
        assert epochs == sorted(set(epochs)), f"{name}: {terms}"
        for before, after in itertools.pairwise(terms):
            assert after["from_s"] >= before["from_s"], f"{name}: overlapping terms {terms}"


def test_killing_the_leader_then_a_follower_is_masked(zookeeper, kafka):
    """Two kills take down two workers (replica groups): r = 3 keeps a third."""
    faults = [
        td.Kill("count", partition=0, replica="leader", at=2.0),
        td.Kill("relay", partition=1, replica="follower", at=3.5),
    ]
    res = kazoo_job(kafka, replication=3).run(duration=6.0, faults=faults, progress=False)
    assert_masked(res)
    (leader_kill, follower_kill) = res.faults
    # The killed leader reports nothing; its successor's epoch shows it was deposed.
    count0 = res.leaders["count[0]"]
    assert leader_kill["victim"] not in {t["replica"] for t in count0}, count0
    assert any(t["from_s"] >= leader_kill["injected_at"] and t["epoch"] > 1 for t in count0)
    relay1 = res.leaders["relay[1]"]
    assert relay1[0]["replica"] != follower_kill["victim"], relay1
    lost = testing.lost_replicas(res)
    assert lost == testing.killed_replicas(res)
    assert {("count", 0, leader_kill["victim"]), ("relay", 1, follower_kill["victim"])} <= lost


def test_a_frozen_leader_is_replaced_and_fenced_off_when_it_wakes(zookeeper, kafka):
    """SIGSTOP the leader past its session timeout: a follower takes over with a higher
    epoch; after SIGCONT the old leader may still publish an order or two before it learns
    it lost its session — fenced off, or harmless — and the replicas stay identical."""
    fault = td.Pause("count", partition=1, replica="leader", at=1.5, for_s=2.5)
    res = kazoo_job(kafka).run(duration=6.0, faults=[fault], progress=False)
    assert_masked(res)
    terms = res.leaders["count[1]"]
    frozen = res.faults[0]["victim"]
    assert terms[0]["replica"] == frozen
    assert any(t["replica"] != frozen for t in terms), f"nobody took over: {terms}"
    assert res.lost_replicas == [], "a paused replica is not lost"


@pytest.mark.parametrize("service", ["zookeeper", "kafka"])
def test_the_job_rides_out_a_service_restart(zookeeper, kafka, service):
    """Restart ZooKeeper (no elections, no publishing while it is down) or Kafka (no
    orders in or out) mid-run: the job stalls, then resumes; nothing lost or repeated."""
    restarted: dict[str, float] = {}

    def restart() -> None:
        restarted["s"] = kafka.restart(service)

    timer = threading.Timer(2.0, restart)
    timer.start()
    try:
        res = kazoo_job(kafka, name=f"kz-{service}").run(duration=8.0, progress=False)
    finally:
        timer.join()
    assert restarted["s"] > 0
    assert_masked(res)


def test_multi_input_tasks_agree_and_match_the_order_they_followed(zookeeper, kafka):
    """Two sources into one stateful task: its per-key counts depend on the order of the
    inputs, so replica agreement and reference equality both rest on the order log."""
    config = KazooConfig(zk_hosts=kafka.zk_hosts, kafka_bootstrap=kafka.kafka_bootstrap)
    job = td.Job("kz-union", replication=2, ordering="kazoo", kazoo=config)
    a = job.source(td.sources.Synthetic(rate=RATE, keys=5, seed=1), name="a")
    b = job.source(td.sources.Synthetic(rate=RATE, keys=5, seed=2), name="b")
    a.union(b).key_by("key").process(td.CountPerKey(), parallelism=1, name="count").sink(
        td.sinks.Collect()
    )
    res = job.run(duration=3.0, progress=False)
    assert_masked(res)
    assert res.leaders["count[0]"], "the union task ran an election"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("down", ["zookeeper", "kafka"])
def test_an_unreachable_service_fails_fast_naming_it(zookeeper, kafka, down):
    port = _free_port()
    config = KazooConfig(
        zk_hosts=f"127.0.0.1:{port}" if down == "zookeeper" else kafka.zk_hosts,
        kafka_bootstrap=f"127.0.0.1:{port}" if down == "kafka" else kafka.kafka_bootstrap,
    )
    job = td.Job("kz-down", replication=2, ordering="kazoo", kazoo=config)
    ev = job.source(td.sources.Synthetic(rate=RATE, keys=4, seed=1), parallelism=2)
    ev.key_by("key").map(relay, parallelism=2).sink(td.sinks.Collect())
    began = time.monotonic()
    with pytest.raises(td.ServiceUnavailable, match=rf"127\.0\.0\.1:{port}.*services\.sh"):
        job.run(duration=1.0, progress=False)
    assert time.monotonic() - began < 30


# ------------------------------------------------------------ no services needed


def test_roles_need_a_partition_with_a_leader():
    job = td.Job("kz-roles", replication=2, ordering="kazoo")
    ev = job.source(td.sources.Synthetic(rate=RATE, keys=4, seed=1), parallelism=2)
    ev.map(relay, parallelism=2, name="single").sink(td.sinks.Collect())
    plan = job.plan()
    assert plan.ordered_partitions() == []  # forward edges: one input channel each
    with pytest.raises(td.ConfigError, match="has no leader"):
        job.run(duration=1.0, faults=[td.Kill("single", 0, "leader", at=0.5)])
    with pytest.raises(td.ConfigError, match="ordering='kazoo'"):
        td.Job("x", ordering="liverobin", kazoo=KazooConfig())
    with pytest.raises(td.ConfigError, match="session_timeout_s"):
        KazooConfig(session_timeout_s=0.1)


def test_order_log_fences_stale_epochs_and_ignores_replays():
    log = _core.OrderLog(2)
    order = _core.encode_order_frame
    assert log.offer(order(0, 5, 1, [(0, 10), (1, 4)])) == "followed"
    assert log.offer(order(0, 5, 1, [(0, 10)])) == "replayed"
    assert log.offer(order(0, 4, 9, [(0, 99)])) == "stale"
    assert log.offer(order(0, 6, 1, [(1, 8)])) == "followed"
    assert log.drain() == [(0, 10), (1, 4), (1, 8)]
    assert log.ordered() == [10, 8]
    stats = log.stats()
    assert (stats["followed"], stats["stale"], stats["replayed"], stats["epoch"]) == (2, 1, 1, 6)
    with pytest.raises(td.ConfigError, match="input channel 2"):
        log.offer(order(0, 6, 2, [(2, 1)]))
    with pytest.raises(td.ProtocolError):
        log.offer(_core.encode_heartbeat_frame(0, 0, 1))


def test_a_graceful_stop_hands_leadership_over_at_once(zookeeper, kafka):
    """What a worker does on SIGTERM (`KazooSession.stop`): close its session, so its
    twin leads in milliseconds instead of after a session timeout."""
    job = kazoo_job(kafka, name="kz-handover", session_timeout_s=5.0)
    plan = job.plan()
    (task, partition), *_ = plan.ordered_partitions()
    run = kazoo.prepare(plan)
    upstreams = [(c.task, c.partition) for c in plan.input_channels(task, partition)]
    inboxes = [_core.Inbox("kz", b"s", upstreams, ordering="kazoo") for _ in range(2)]
    sessions = [kazoo.KazooSession(run, name=f"worker{r}") for r in range(2)]
    orderers = [
        kazoo.Orderer(session, task, partition, r, inbox.order_feed())
        for r, (session, inbox) in enumerate(zip(sessions, inboxes, strict=True))
    ]
    try:
        for s, o in zip(sessions, orderers, strict=True):
            s.start()
            o.start()
        deadline = time.monotonic() + 10
        while not any(o.led for o in orderers) and time.monotonic() < deadline:
            time.sleep(0.005)
        (leader,) = [o for o in orderers if o.led]
        (twin,) = [o for o in orderers if o is not leader]
        stopped = time.monotonic()
        leader.session.stop()
        while not twin.led and time.monotonic() < stopped + 10:
            time.sleep(0.001)
        handover = time.monotonic() - stopped
        assert twin.led, "the twin never took over"
        assert twin.led[0]["epoch"] > leader.led[0]["epoch"]
        # A crash would take the 5 s session timeout; a graceful stop is at once.
        assert handover < 1.0, f"handover took {handover:.3f} s"
    finally:
        for s in sessions:
            s.stop()
        for inbox in inboxes:
            inbox.close()
        kazoo.cleanup(run)
