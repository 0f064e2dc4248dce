"""KaZoo end to end, against the real ZooKeeper and Kafka `tandem services` runs.

Every run's output is checked against the reference executor following the orders the
replicas followed (read back from the order log), so "identical to the reference" here
means: every row, each exactly once, with every stateful result (running counts per key)
exactly what that consumption order gives — and both replicas of every partition agreed,
cycle by cycle (digests).

The engine reads the order log back through the Rust ``OrderLog`` fence the replicas
run. Here every run's order log is also read independently — a plain
``confluent_kafka`` consumer, the frames decoded and the fencing rule applied in Python
as DESIGN §2.3 states it (:class:`tandem.testing.ReferenceOrderLog`) — and the reference
follows *that* reading: the two readings must agree, and every order a replica reports
having fenced off must be one the independent reading calls stale.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from dataclasses import dataclass

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tandem as td
from tandem import _core, testing
from tandem.ordering import kazoo
from tandem.ordering.kazoo import KazooConfig

RATE = 1_000
pytestmark = pytest.mark.timeout(240)


def relay(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch


def kazoo_job(
    services,
    name: str = "kz",
    session_timeout_s: float = 1.0,
    replication: int = 2,
    restore: bool = False,
) -> td.Job:
    """source (2) → key_by → count (2, stateful) → key_by → relay (2) → sink: both operator
    tasks read two input channels, so both run an election and follow an order log."""
    config = KazooConfig(
        zk_hosts=services.zk_hosts,
        kafka_bootstrap=services.kafka_bootstrap,
        session_timeout_s=session_timeout_s,
    )
    job = td.Job(name, replication=replication, ordering="kazoo", kazoo=config, restore=restore)
    ev = job.source(td.sources.Synthetic(rate=RATE, keys=40, seed=5), parallelism=2)
    counted = ev.key_by("key").process(td.CountPerKey(), parallelism=2, name="count")
    counted.key_by("key").map(relay, parallelism=2, name="relay").sink(td.sinks.Collect())
    return job


@dataclass
class OrderReading:
    """A run's order log, read twice: ``rust`` through the engine's
    ``kazoo.read_orders`` (the Rust fence), ``logs`` / ``orders`` / ``offsets``
    independently (by ``(task, partition)``: the Python fence after it took every order,
    the decoded orders in log order, the offset of the message each came in)."""

    rust: dict[tuple[int, int], list[tuple[int, int]]]
    logs: dict[tuple[int, int], testing.ReferenceOrderLog]
    orders: dict[tuple[int, int], list[testing.Order]]
    offsets: dict[tuple[int, int], list[int]]

    def at(self, tp: tuple[int, int], offset: int) -> int:
        """The index in ``orders[tp]`` of the order of ``tp`` the message at ``offset``
        holds (the tests publish one order of a partition per message at most)."""
        return self.offsets[tp].index(offset)


@pytest.fixture(autouse=True)
def order_readings(monkeypatch) -> list[OrderReading]:
    """Every run's order log, read both ways when the engine checks the run (the log is
    deleted after that); the reference executor follows the independent reading."""
    readings: list[OrderReading] = []
    rust_reading = kazoo.read_orders

    def read_both(run: kazoo.KazooRun, channels, timeout: float = 30.0):
        rust = rust_reading(run, channels, timeout)
        logs = {tp: testing.ReferenceOrderLog(channels[tp]) for tp in run.partitions}
        orders: dict[tuple[int, int], list[testing.Order]] = {tp: [] for tp in run.partitions}
        offsets: dict[tuple[int, int], list[int]] = {tp: [] for tp in run.partitions}
        msgs = testing.read_order_topic(run.config.kafka_bootstrap, run.topic, timeout)
        for offset, msg in enumerate(msgs):  # a run's order log starts at offset 0
            for slot, order in testing.split_orders(msg):
                tp = run.partitions[slot]
                orders[tp].append(order)
                offsets[tp].append(offset)
                logs[tp].offer(order)
        readings.append(OrderReading(rust, logs, orders, offsets))
        return {tp: list(log.followed) for tp, log in logs.items()}

    monkeypatch.setattr(kazoo, "read_orders", read_both)
    return readings


def fenced(res: td.Result) -> set[tuple[int, int, int, int]]:
    """``(task, partition, replica, offset)`` of every order the replicas fenced off."""
    return {
        (f["task"], f["partition"], f["replica"], f["offset"])
        for s in res.kazoo_sessions
        for f in s["fenced"]
    }


def assert_masked(res: td.Result, readings: list[OrderReading]) -> OrderReading:
    """The run lost nothing, repeated nothing, its replicas agreed, and what they followed
    is what the independent reading of the order log says; returns that reading."""
    assert res.lost == 0 and res.duplicates == 0, (res.lost, res.duplicates)
    assert res.digests_match, res.determinism_errors
    assert res.events_out == res.events_in > 0
    assert res.output is not None and res.output.num_rows == res.events_in
    (reading,) = readings
    assert reading.logs, "no order topic was read"
    for tp, log in reading.logs.items():
        assert log.followed, f"{tp}: no order was followed"
        assert log.followed == reading.rust[tp], f"{tp}: the two readings of the log differ"
    for t, p, r, offset in fenced(res):
        k = reading.at((t, p), offset)
        order = reading.orders[(t, p)][k]
        assert reading.logs[(t, p)].verdicts[k] == "stale", (t, p, r, offset, order)
    return reading


def test_fault_free_run_follows_one_leader_per_partition(zookeeper, kafka, order_readings):
    job = kazoo_job(kafka)
    res = job.run(duration=3.0, progress=False)
    reading = assert_masked(res, order_readings)
    assert set(reading.logs) == set(job.plan().ordered_partitions())
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


def test_killing_the_leader_then_a_follower_is_masked(zookeeper, kafka, order_readings):
    """Two kills take down two workers (replica groups): r = 3 keeps a third."""
    faults = [
        td.Kill("count", partition=0, replica="leader", at=2.0),
        td.Kill("relay", partition=1, replica="follower", at=3.5),
    ]
    res = kazoo_job(kafka, replication=3).run(duration=6.0, faults=faults, progress=False)
    assert_masked(res, order_readings)
    (leader_kill, follower_kill) = res.faults
    # The killed leader reports nothing: its term is what its worker announced as it won
    # (often before the run's start: the replicas contend from the moment they are
    # bound), ended by the kill; its successor's epoch is higher.
    count0 = res.leaders["count[0]"]
    assert count0[0]["replica"] == leader_kill["victim"], count0
    assert count0[0]["until_s"] is None, count0
    assert count0[0]["from_s"] < leader_kill["injected_at"], count0
    successor = [t for t in count0 if t["from_s"] >= leader_kill["injected_at"]]
    assert successor and successor[0]["epoch"] > count0[0]["epoch"], count0
    assert leader_kill["victim"] not in {t["replica"] for t in count0[1:]}, count0
    relay1 = res.leaders["relay[1]"]
    assert relay1[0]["replica"] != follower_kill["victim"], relay1
    lost = testing.lost_replicas(res)
    assert lost == testing.killed_replicas(res)
    assert {("count", 0, leader_kill["victim"]), ("relay", 1, follower_kill["victim"])} <= lost


def test_a_lost_leader_is_rebuilt_from_its_twin_and_leads_when_that_twin_is_lost(
    zookeeper, kafka, order_readings
):
    """Job(restore=True): the worker of count[0]'s leader is killed and rebuilt from the
    twins' cuts — each rebuilt replica follows the order log on from where its twin stood
    and contends as a follower — then the twin, leading by now, is killed too: the
    rebuilt replica takes the partition over, and nothing is lost or repeated."""
    faults = [
        td.Kill("count", partition=0, replica="leader", at=1.5),
        # A rebuild here takes 1-2.5 s (a new ZooKeeper session and Kafka clients
        # included); the second kill must find the first one done.
        td.Kill("count", partition=0, replica="leader", at=6.0),
    ]
    res = kazoo_job(kafka, name="kz-restore", restore=True).run(
        duration=9.0, faults=faults, progress=False
    )
    assert_masked(res, order_readings)
    first, second = res.faults
    assert first["victim"] != second["victim"], res.faults
    rebuilt = {(r["task"], r["partition"], r["replica"]) for r in res.restored_replicas}
    assert rebuilt == testing.lost_replicas(res) == testing.killed_replicas(res)
    assert {("count", 0, 0), ("count", 0, 1), ("relay", 0, 0), ("relay", 0, 1)} <= rebuilt
    for r in res.restored_replicas:
        assert r["lost_s"] < r["restored_s"] < r["lost_s"] + 10, r
    # count[0]: led by one replica, then its twin, then the first again — rebuilt, it
    # followed the log from its twin's cut and won the election once the twin was gone.
    # The killed leaders report nothing: their terms are what their workers announced
    # as they won, each ended by its kill (until_s None).
    terms = res.leaders["count[0]"]
    killed = [
        [t for t in terms if t["replica"] == f["victim"] and t["from_s"] < f["injected_at"]]
        for f in (first, second)
    ]
    assert killed[0] and killed[0][-1]["until_s"] is None, terms
    assert killed[1] and killed[1][-1]["until_s"] is None, terms
    assert killed[1][-1]["from_s"] >= first["injected_at"], terms
    after = [t for t in terms if t["from_s"] >= second["injected_at"]]
    assert after and after[0]["replica"] == first["victim"], terms
    assert killed[0][-1]["epoch"] < killed[1][-1]["epoch"] < after[0]["epoch"], terms


def kept_runs(monkeypatch) -> list[kazoo.KazooRun]:
    """The KaZoo runs the next jobs prepare, as they are prepared (their order log's name
    is known only then)."""
    runs: list[kazoo.KazooRun] = []
    prepare = kazoo.prepare

    def prepare_and_keep(*args, **kwargs) -> kazoo.KazooRun:
        runs.append(prepare(*args, **kwargs))
        return runs[-1]

    monkeypatch.setattr(kazoo, "prepare", prepare_and_keep)
    return runs


def publish_as_deposed_leader(runs: list, task: int, partition: int, out: dict) -> None:
    """Follow the orders of ``(task, partition)`` of the run ``kazoo.prepare`` put in
    ``runs``; as soon as a second leader has published, publish one more order of the
    first leader's epoch — what that leader sends if it wakes and wins the race against
    its lost session — and record its offset and content in ``out``."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

    deadline = time.monotonic() + 30
    while not runs and time.monotonic() < deadline:
        time.sleep(0.01)
    (run,) = runs
    bootstrap, topic = run.config.kafka_bootstrap, run.topic
    slot = run.slot(task, partition)
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"deposed-{run.run}"})
    consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    try:
        first: testing.Order | None = None
        while time.monotonic() < deadline:
            msg = consumer.poll(0.05)
            if msg is None or msg.error() is not None:
                continue
            mine = [o for s, o in testing.split_orders(msg.value()) if s == slot]
            if not mine:
                continue
            order = mine[0]
            if first is None or order.epoch == first.epoch:
                first = mine[-1]
                continue
            # The successor leads. The deposed leader's next order, channel by channel one
            # seq past where its successor's first order runs them.
            stale = testing.Order(
                first.epoch, first.version + 1000, tuple((c, s + 1) for c, s in order.entries)
            )
            producer = Producer({"bootstrap.servers": bootstrap, "acks": "all"})
            producer.produce(
                topic,
                _core.encode_order_frame(slot, stale.epoch, stale.version, stale.entries),
                on_delivery=lambda err, m: out.update(error=err, offset=m.offset()),
            )
            producer.flush(10)
            out["order"] = stale
            return
    finally:
        consumer.close()


def test_a_frozen_leader_is_replaced_and_fenced_off_when_it_wakes(
    zookeeper, kafka, order_readings, monkeypatch
):
    """SIGSTOP the leader past its session timeout: a follower takes over with a higher
    epoch. Orders of the deposed leader's epoch that reach the log after its successor's
    are fenced off: the independent reading calls them stale, every replica (the woken
    one included) reports having ignored exactly those, and the replicas stay identical,
    following the successor's orders.

    The woken leader publishes such an order only if its publishing thread runs before
    kazoo reports the lost session, a race it usually loses; so the test also publishes,
    under the deposed leader's epoch, the order it would send."""
    runs = kept_runs(monkeypatch)
    job = kazoo_job(kafka)
    (count,) = [t.id for t in job.plan().tasks if t.name == "count"]
    injected: dict = {}
    zombie = threading.Thread(target=publish_as_deposed_leader, args=(runs, count, 1, injected))
    zombie.start()
    fault = td.Pause("count", partition=1, replica="leader", at=1.5, for_s=2.5)
    try:
        res = job.run(duration=6.0, faults=[fault], progress=False)
    finally:
        zombie.join()
    reading = assert_masked(res, order_readings)
    terms = res.leaders["count[1]"]
    frozen, paused_s = res.faults[0]["victim"], res.faults[0]["injected_at"]
    # The frozen replica led when the pause came (on a loaded machine a 1 s session may
    # also have changed hands before it: the term that counts is the one it paused in),
    # and a twin leads after it, with a higher epoch.
    held = [t for t in terms if t["replica"] == frozen and t["from_s"] <= paused_s]
    assert held, f"replica {frozen} did not lead when paused at {paused_s} s: {terms}"
    deposed = held[-1]
    assert any(
        t["replica"] != frozen and t["epoch"] > deposed["epoch"] and t["from_s"] > paused_s
        for t in terms
    ), f"nobody took over: {terms}"
    assert res.lost_replicas == [], "a paused replica is not lost"

    assert injected.get("order") and injected["error"] is None, injected
    orders, log = reading.orders[(count, 1)], reading.logs[(count, 1)]
    assert orders[reading.at((count, 1), injected["offset"])] == injected["order"]
    stale = [k for k, verdict in enumerate(log.verdicts) if verdict == "stale"]
    assert reading.at((count, 1), injected["offset"]) in stale
    for k in stale:
        # A deposed leader's epoch (the frozen one's, or of a term before it), after an
        # order of a successor's higher epoch.
        assert orders[k].epoch <= deposed["epoch"], (k, orders[k], terms)
        assert max(o.epoch for o in orders[:k]) > orders[k].epoch, (k, orders[: k + 1])
    # Ignored by both replicas, the woken one included (it follows the log too).
    offsets = reading.offsets[(count, 1)]
    assert {(r, k) for t, p, r, k in fenced(res) if (t, p) == (count, 1)} == {
        (r, offsets[k]) for r in (0, 1) for k in stale
    }, res.kazoo_sessions


@pytest.mark.parametrize("service", ["zookeeper", "kafka"])
def test_the_job_rides_out_a_service_restart(zookeeper, kafka, service, order_readings):
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
    assert_masked(res, order_readings)


def test_multi_input_tasks_agree_and_match_the_order_they_followed(
    zookeeper, kafka, order_readings
):
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
    assert_masked(res, order_readings)
    assert res.leaders["count[0]"], "the union task ran an election"


def test_a_kazoo_job_stopped_at_a_savepoint_resumes_with_every_row_once(
    zookeeper, kafka, order_readings, tmp_path
):
    """Savepoints of a KaZoo job: every replica of an ordered partition is asked for its
    cut at heartbeat K, and the one leading holds its orders there until every channel is
    ordered through K, so the cut of every partition is aligned — nothing consumed past K
    that its producer's cut had not emitted. A savepoint taken while the job runs, then one
    it stops at; resumed with r 2 -> 3 and the ordered task at parallelism 3 on a new
    order log: every row once, each key's count going on from where it stood."""
    config = KazooConfig(zk_hosts=kafka.zk_hosts, kafka_bootstrap=kafka.kafka_bootstrap)
    rows = 4_000

    def build(replication: int, parallelism: int, ordering: str = "kazoo") -> td.Job:
        zoo = config if ordering == "kazoo" else None
        job = td.Job("kz-savepoint", replication=replication, ordering=ordering, kazoo=zoo)
        ev = job.source(td.sources.Synthetic(rate=RATE, keys=40, seed=5, limit=rows), parallelism=2)
        counted = ev.key_by("key").process(td.CountPerKey(), parallelism=parallelism, name="count")
        counted.key_by("key").map(relay, parallelism=2, name="relay").sink(td.sinks.Collect())
        return job

    running = build(2, 2).start(progress=False)
    time.sleep(1.0)
    taken = running.savepoint(str(tmp_path / "running"), timeout=60)
    time.sleep(0.5)
    stopped = str(tmp_path / "stopped")
    first = running.stop(savepoint=stopped)
    assert first.lost == 0 and first.duplicates == 0, (first.lost, first.duplicates)
    assert first.digests_match, first.determinism_errors
    assert 0 < taken.epoch < td.Savepoint.read(stopped).epoch
    assert 0 < first.events_out < rows
    # Resumed at another shape: its order logs start empty, led from the cuts' positions.
    second = build(3, 3).run(from_savepoint=stopped, progress=False, timeout=120)
    assert second.digests_match, second.determinism_errors
    assert second.leaders["count[2]"], "the new partition ran an election"
    # Or under LiveRobin: the aligned cut is the end of a cycle.
    third = build(2, 2, "liverobin").run(from_savepoint=stopped, progress=False)
    for then in (second, third):
        both = pa.concat_tables([first.output, then.output]).to_pandas()
        assert sorted(both["source_seq"]) == list(range(rows)), "every row once"
        for key, counts in both.groupby("key")["count"]:
            assert sorted(counts) == list(range(1, len(counts) + 1)), key


@pytest.mark.parametrize("down", ["zookeeper", "kafka"])
def test_an_unreachable_service_fails_fast_naming_it(zookeeper, kafka, down):
    port = testing.free_port()
    config = KazooConfig(
        zk_hosts=f"127.0.0.1:{port}" if down == "zookeeper" else kafka.zk_hosts,
        kafka_bootstrap=f"127.0.0.1:{port}" if down == "kafka" else kafka.kafka_bootstrap,
    )
    job = td.Job("kz-down", replication=2, ordering="kazoo", kazoo=config)
    ev = job.source(td.sources.Synthetic(rate=RATE, keys=4, seed=1), parallelism=2)
    ev.key_by("key").map(relay, parallelism=2).sink(td.sinks.Collect())
    began = time.monotonic()
    with pytest.raises(td.ServiceUnavailable, match=rf"127\.0\.0\.1:{port}.*tandem services start"):
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
    for pace in (-1, 1001, "2", True):
        with pytest.raises(td.ConfigError, match="pace_ms"):
            KazooConfig(pace_ms=pace)


def test_a_role_resolves_among_the_live_replicas_or_waits_for_the_election():
    """What a fault naming a role hits: the leading node's replica if it is live; while
    that node is a dead replica's (or there is none), nothing yet — the coordinator looks
    again rather than wait on its own thread."""
    where = "operator task 'count' partition 0"
    assert kazoo.resolve_role("leader", 1, [0, 1], where) == 1
    assert kazoo.resolve_role("follower", 1, [0, 1, 2], where) == 0
    assert kazoo.resolve_role("leader", 1, [0], where) is None  # 1 is dead, its node not gone
    assert kazoo.resolve_role("follower", None, [0, 1], where) is None
    with pytest.raises(td.TandemError, match="no live follower to kill"):
        kazoo.resolve_role("follower", 0, [0], where)
    with pytest.raises(td.TandemError, match="no live replica"):
        kazoo.resolve_role("leader", 0, [], where)


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


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 4).flatmap(
        lambda n: st.tuples(
            st.just(n),
            st.lists(
                st.tuples(
                    st.integers(1, 5),  # epoch
                    st.integers(1, 6),  # version
                    st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, 50)), max_size=4),
                ),
                max_size=25,
            ),
        )
    )
)
def test_python_and_rust_fences_agree_on_any_log(case):
    """The independent reading (plain Python frame decoding and fencing rule) and the Rust
    OrderLog the replicas run give the same verdicts and entries on any log: epochs that
    go back (deposed leaders), repeated and skipped versions, empty orders."""
    channels, log = case
    rust, python = _core.OrderLog(channels), testing.ReferenceOrderLog(channels)
    for epoch, version, entries in log:
        frame = _core.encode_order_frame(0, epoch, version, entries)
        assert testing.decode_order(frame) == testing.Order(epoch, version, tuple(entries))
        assert python.offer(frame) == rust.offer(frame)
    assert python.followed == rust.drain()
    assert python.ordered() == rust.ordered()
    stats = rust.stats()
    assert [stats[v] for v in ("followed", "stale", "replayed")] == [
        python.verdicts.count(v) for v in ("followed", "stale", "replayed")
    ]


def test_the_python_order_decoder_refuses_what_is_not_one_order():
    frame = _core.encode_order_frame(0, 2, 1, [(1, 7)])
    with pytest.raises(ValueError, match="not an order frame"):
        testing.decode_order(_core.encode_heartbeat_frame(0, 0, 1) + bytes(16))
    with pytest.raises(ValueError, match="announces 1 entries"):
        testing.decode_order(frame + b"\0")
    with pytest.raises(ValueError, match="at least 48 bytes"):
        testing.decode_order(frame[:40])
    with pytest.raises(ValueError, match="names channel 1"):
        testing.ReferenceOrderLog(1).offer(frame)


@contextlib.contextmanager
def two_contenders(kafka, name: str):
    """Two replicas of one ordered partition, each with a session of its own (as two
    workers), contending in a real election with a 5 s session timeout: yields
    ``(run, task, partition, leader, twin)`` once one leads; everything stops after."""
    job = kazoo_job(kafka, name=name, session_timeout_s=5.0)
    plan = job.plan()
    (task, partition), *_ = plan.ordered_partitions()
    run = kazoo.prepare(plan)
    upstreams = [(c.task, c.partition) for c in plan.input_channels(task, partition)]
    workers = [_core.Worker() for _ in range(2)]
    inboxes = [_core.Inbox("kz", b"s", upstreams, ordering="kazoo", worker=w) for w in workers]
    sessions = [kazoo.KazooSession(run, w, name=f"worker{r}") for r, w in enumerate(workers)]
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
        yield run, task, partition, leader, twin
    finally:
        for s in sessions:
            s.stop()
        for inbox in inboxes:
            inbox.close()
        kazoo.cleanup(run)


def test_a_graceful_stop_hands_leadership_over_at_once(zookeeper, kafka):
    """What a worker does on SIGTERM (`KazooSession.stop`): close its session, so its
    twin leads in milliseconds instead of after a session timeout."""
    with two_contenders(kafka, "kz-handover") as (_, _, _, leader, twin):
        stopped = time.monotonic()
        leader.session.stop()
        while not twin.led and time.monotonic() < stopped + 10:
            time.sleep(0.001)
        handover = time.monotonic() - stopped
        assert twin.led, "the twin never took over"
        assert twin.led[0]["epoch"] > leader.led[0]["epoch"]
        # A crash would take the 5 s session timeout; a graceful stop is at once.
        assert handover < 1.0, f"handover took {handover:.3f} s"


def test_an_abandoned_leader_hands_its_partition_over_while_its_worker_runs_on(zookeeper, kafka):
    """A replica whose every downstream replica is gone (finished on its twins' copies, or
    a sink copy lost) stops, abandoned — but its worker runs on for the other replicas it
    hosts, with its ZooKeeper session alive. A KaZoo leader among them resigns as it
    retires: its followers, which still feed live sinks, would otherwise wait for its
    orders while the session lives (a run that never ended)."""
    from types import SimpleNamespace

    from tandem.runtime.replica import ReplicaReport
    from tandem.runtime.worker import Worker

    with two_contenders(kafka, "kz-abandoned") as (_, _, _, leader, twin):
        retired = []
        worker = SimpleNamespace(
            core=SimpleNamespace(retire=retired.append),
            cuts=SimpleNamespace(retire=retired.append),
            on_starved=None,
        )
        rep = SimpleNamespace(
            report=ReplicaReport(
                task=2, partition=0, replica=0, kind="operator", abandoned="no channel left"
            ),
            orderer=leader,
            slot=0,
        )
        stopped = time.monotonic()
        Worker._retire(worker, rep)
        while not twin.led and time.monotonic() < stopped + 10:
            time.sleep(0.001)
        assert twin.led, "the twin never took over"
        assert leader.session.zk.connected, "the worker's session lives on"
        # Not after the 5 s session timeout: at once.
        assert time.monotonic() - stopped < 2.0
        assert retired == [0, rep]


def test_a_dead_leaders_partitions_are_led_at_once_not_after_its_session_timeout(
    zookeeper, kafka, order_readings, monkeypatch
):
    """The engine knows a killed leader's worker is dead (it reaped the process), so it
    deletes that worker's election nodes: the followers lead within milliseconds, not
    after the dead session's 5 s timeout — and nothing is lost or repeated. The killed
    leader's last order, still in flight, lands after its successor's first (the test
    publishes it under the dead leader's epoch once the successor has ordered): the new
    leader fenced the log with its own epoch before ordering, so the live replica
    ignores it as stale."""
    runs = kept_runs(monkeypatch)
    job = kazoo_job(kafka, name="kz-dead", session_timeout_s=5.0)
    (count,) = [t.id for t in job.plan().tasks if t.name == "count"]
    injected: dict = {}
    late = threading.Thread(target=publish_as_deposed_leader, args=(runs, count, 0, injected))
    late.start()
    faults = [td.Kill("count", partition=0, replica="leader", at=1.5)]
    try:
        res = job.run(duration=5.0, faults=faults, progress=False)
    finally:
        late.join()
    reading = assert_masked(res, order_readings)
    (kill,) = res.faults
    terms = res.leaders["count[0]"]
    successor = [t for t in terms if t["from_s"] >= kill["injected_at"]]
    assert successor and successor[0]["replica"] != kill["victim"], terms
    # The dead leader reports nothing; its term is what its worker announced as it won.
    dead = [t for t in terms if t["replica"] == kill["victim"]]
    assert dead and dead[-1]["until_s"] is None, terms
    assert dead[-1]["from_s"] < kill["injected_at"], terms
    assert dead[-1]["epoch"] < successor[0]["epoch"], terms
    took = successor[0]["from_s"] - kill["injected_at"]
    assert took < 1.0, f"the follower led {took:.3f} s after the kill (session timeout 5 s)"
    assert res.max_gap_ms < 1500, res.max_gap_ms
    # The dead leader's late order: stale in the independent reading, and ignored by the
    # live replica.
    assert injected.get("order") and injected["error"] is None, injected
    k = reading.at((count, 0), injected["offset"])
    assert reading.logs[(count, 0)].verdicts[k] == "stale", reading.logs[(count, 0)].verdicts
    live = 1 - kill["victim"]
    assert (count, 0, live, injected["offset"]) in fenced(res), res.kazoo_sessions


def test_the_releaser_deletes_only_the_dead_processes_election_node(zookeeper, kafka):
    """`Releaser.release` names the dead process: the election node of the same replica
    held by another process (a rebuilt one) stays, and the one it deletes lets the next
    contender lead at once."""
    with two_contenders(kafka, "kz-release") as (run, task, partition, leader, twin):
        releaser = kazoo.Releaser(run)
        try:
            rid = (task, partition, leader.replica)
            # Who leads, asked on the releaser's own connected client (faults naming a role).
            assert releaser.leader(task, partition) == leader.replica
            assert releaser.release([rid], pid=1).result(10) == []  # not that process's
            assert not twin.led
            released = time.monotonic()
            assert releaser.release([rid], pid=leader.ident_pid).result(10) == [rid]
            while not twin.led and time.monotonic() < released + 10:
                time.sleep(0.001)
            handover = time.monotonic() - released
            assert twin.led and twin.led[0]["epoch"] > leader.led[0]["epoch"]
            assert handover < 1.0, f"handover took {handover:.3f} s (session timeout 5 s)"
            assert releaser.leader(task, partition) == twin.replica
        finally:
            releaser.close()


def test_kazoos_own_connection_warnings_are_logged_at_info(caplog):
    """A connection kazoo drops and re-establishes by itself is no warning to a user (a
    successful run prints nothing); tandem's ZooKeeper clients log under
    ``tandem.kazoo.client``, kazoo's warnings demoted to info, its errors kept."""
    from tandem import endpoints

    logger = endpoints.client_logger()
    with caplog.at_level(logging.DEBUG, logger="tandem.kazoo.client"):
        logger.warning("Connection dropped: %s", "outstanding heartbeat ping not received")
        logger.log(logging.WARNING, "Transition to CONNECTING")
        logger.error("Session expired")
    got = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert got == [
        (
            "tandem.kazoo.client",
            logging.INFO,
            "Connection dropped: outstanding heartbeat ping not received",
        ),
        ("tandem.kazoo.client", logging.INFO, "Transition to CONNECTING"),
        ("tandem.kazoo.client", logging.ERROR, "Session expired"),
    ]
