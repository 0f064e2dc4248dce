"""KaZoo: leader-based ordering over ZooKeeper and Kafka (the paper's §IV, made safer).

Every replica of an ordered task partition runs an :class:`Orderer` beside its task loop.
The orderers of one worker share a :class:`KazooSession`: one ZooKeeper session (the
worker is the fault domain: its leaderships live and die together), one Kafka producer
and one consumer. A run has one **order log**: a single-partition topic that carries the
orders of every ordered partition, each order an Order frame whose header channel is the
partition's slot in the run (:meth:`KazooRun.slot`). Two roles (as in the paper's Flink
task managers):

* the **follower** (the session's thread) reads the order log from the beginning (a
  worker rebuilt from twins: from where their cuts stood, :attr:`KazooSession.start_offset`)
  (``assign()``, no consumer group, so no rebalances) and hands every message, in log
  order, to a Rust router (``tandem._core.OrderRouter``) that offers each order to its
  partition's inbox order feed in this worker. The Rust core fences off orders of a
  deposed leader (an epoch older than the newest of that partition in the log), ignores
  replays, and hands the rest to the positional merge, which waits for events that have
  not arrived yet. Every replica, the leader included, consumes only what the log says.
* the orderer's **election** thread contends for leadership with a kazoo lock under
  ``/tandem/<job>/<run>/<task>/<partition>``. The sequence number of the winning lock node
  is the leader's **epoch** (fencing token): ZooKeeper hands out increasing sequence
  numbers, and the lowest live node leads, so each new leader's epoch is above every
  earlier leader's. A new leader first reads the order log to its end, then publishes a
  fence (an order of its epoch with no entries: every older epoch is stale after it, for
  every replica) and, once its own replica has followed the fence, leads: for
  every channel on which its own deduplicated queues hold more than the log has ordered,
  an entry "channel ``c`` up to seq ``s``", at most ``batch`` entries per order, stamped
  with its epoch and a version counting its orders. Each leadership keeps one order in
  flight: the next one is due as soon as its own replica has *followed* the last from the
  log — the moment every replica can act on it — and covers everything that arrived
  meanwhile, so orders grow with the load and an idle stream waits for no timeout.
* the session's **publisher** thread sends what is due. The decisions run in Rust
  (``tandem._core.OrderPublisher``) without the GIL, woken only by the worker's KaZoo
  arrivals and followed orders; the orders of every partition the worker leads that are
  due at once go out as one message. Since all of them are followed at the same moment,
  they fall due together again: the broker and each reader see one message per round
  trip and worker, not one per partition or per arrival — and no more than one per
  ``KazooConfig.pace_ms``. The producer is idempotent,
  ``acks=all``, ``linger.ms=0``, and reports failed deliveries only (an order never
  followed is published again after ``ORDER_TIMEOUT_MS``).

Safety does not rest on timing. Orders are positional and idempotent, and every replica
applies the same deterministic filter to the same log, so even two leaders publishing at
once (a frozen leader waking up) leave the replicas in agreement; fencing only keeps the
deposed leader's late orders out. Liveness rests on ZooKeeper: a leader stops publishing
the moment its session is in doubt (kazoo's ``SUSPENDED``, which comes before the server
can expire the session and let anyone else lead), and resumes only if the same session
comes back. SIGTERM closes the worker's session at once (:meth:`KazooSession.stop`), so a
graceful stop hands every leadership over in milliseconds; so does a crash the engine
knows of (a reaped process, a failed Spark task: :class:`Releaser` deletes the dead
worker's election nodes); a frozen or cut-off leader hands over after one session
timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tandem import _core, endpoints
from tandem.exceptions import ConfigError, ServiceUnavailable, TandemError
from tandem.logs import librdkafka_logger

if TYPE_CHECKING:
    from tandem.plan import Plan

log = logging.getLogger(__name__)

#: How long a thread blocks before re-checking whether it must stop.
POLL_S = 0.05
#: Fenced-off orders a session keeps a record of (a woken leader publishes one or two).
FENCED_KEPT = 100
#: How long an order may wait in the producer for the broker's acknowledgement; an order
#: its own replica has not followed after this long is published again from the log.
ORDER_TIMEOUT_MS = 5000


@dataclass(frozen=True)
class KazooConfig:
    """Where the services are and how KaZoo uses them (DESIGN §5: ``kazoo.*``).

    ``zk_hosts`` / ``kafka_bootstrap`` default to the services `tandem services` runs
    (``TANDEM_ZK_PORT`` / ``TANDEM_KAFKA_PORT`` on 127.0.0.1). ``session_timeout_s`` is the
    ZooKeeper session timeout: a crashed leader is replaced after about this long (0.5 s is
    the shortest kazoo holds steadily). ``batch`` caps the entries of one order.
    ``pace_ms``: at least this long between two messages of one worker's publisher;
    orders that fall due meanwhile wait and go together. It trades up to that much
    latency per ordered hop for fewer messages: on this project's 2-core benchmark
    machine, 2 ms cut the CPU of MiB1 of length 4 under KaZoo by a fifth and the broker's
    by half (``docs/architecture.md``). 0: a message goes as soon as the last one was
    followed.
    """

    zk_hosts: str | None = None
    kafka_bootstrap: str | None = None
    session_timeout_s: float = 1.0
    batch: int = 1000
    pace_ms: float = 2.0

    def __post_init__(self) -> None:
        t = self.session_timeout_s
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0.5 <= t <= 60:
            raise ConfigError(
                f"kazoo session_timeout_s must be in [0.5, 60] seconds, got {t!r}: shorter "
                "sessions flap, and failover takes about one session timeout"
            )
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            raise ConfigError(
                f"kazoo batch must be an int >= 1 (entries per order), got {self.batch!r}"
            )
        p = self.pace_ms
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0 <= p <= 1000:
            raise ConfigError(
                f"kazoo pace_ms must be in [0, 1000] milliseconds between two order messages "
                f"of a worker, got {p!r}"
            )

    def resolved(self) -> KazooConfig:
        """This config with the service addresses filled in."""
        if self.zk_hosts and self.kafka_bootstrap:
            return self
        return KazooConfig(
            zk_hosts=self.zk_hosts or endpoints.default_zk_hosts(),
            kafka_bootstrap=self.kafka_bootstrap or endpoints.default_kafka_bootstrap(),
            session_timeout_s=self.session_timeout_s,
            batch=self.batch,
            pace_ms=self.pace_ms,
        )


def _name(text: str) -> str:
    """``text`` reduced to the characters Kafka topic names and znode names both allow."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", text)[:80] or "job"


@dataclass(frozen=True)
class KazooRun:
    """One run of a job under KaZoo: its config and the names its orderers use. Created
    by :func:`prepare` on the engine's side and shipped to every replica."""

    config: KazooConfig
    job: str
    run: str
    partitions: tuple[tuple[int, int], ...] = field(default=())

    def zk_path(self, task: int, partition: int) -> str:
        return f"/tandem/{_name(self.job)}/{self.run}/{task}/{partition}"

    @property
    def topic(self) -> str:
        """The run's order log: one single-partition topic for every ordered partition."""
        return f"tandem.{_name(self.job)}.{self.run}.orders"

    def slot(self, task: int, partition: int) -> int:
        """The number of ``(task, partition)`` in the run: its orders' frame header
        channel in the order log."""
        return self.partitions.index((task, partition))


def _require_clients() -> None:
    try:
        import confluent_kafka  # noqa: F401
        import kazoo  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"ordering='kazoo' needs kazoo and confluent-kafka ({exc.name} is missing): "
            "pip install 'tandem-stream[kazoo]'"
        ) from exc


def _kafka(bootstrap: str, **settings) -> dict:
    """librdkafka settings for a KaZoo client of ``bootstrap``, ``settings`` on top."""
    # librdkafka prints every refused reconnect to stderr; route it to logging instead.
    return {
        "bootstrap.servers": bootstrap,
        "logger": librdkafka_logger("tandem.kazoo.librdkafka"),
        **settings,
    }


def prepare(plan: Plan, config: KazooConfig | None = None, timeout: float = 10.0) -> KazooRun:
    """Check the services and create this run's order log (one single-partition topic
    for every ordered task partition of the run). Raises ``ServiceUnavailable`` naming an
    unreachable address and how to start the services."""
    _require_clients()
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic

    config = (config or plan.kazoo or KazooConfig()).resolved()
    endpoints.probe_zookeeper(config.zk_hosts, timeout=timeout)
    endpoints.probe_kafka(config.kafka_bootstrap, timeout=timeout)
    run = KazooRun(config, plan.job, os.urandom(4).hex(), tuple(plan.ordered_partitions()))
    if run.partitions:
        admin = AdminClient(_kafka(config.kafka_bootstrap))
        futures = admin.create_topics(
            [NewTopic(run.topic, num_partitions=1, replication_factor=1)],
            operation_timeout=timeout,
        )
        for name, fut in futures.items():
            try:
                fut.result(timeout=timeout)
            except KafkaException as exc:
                raise ServiceUnavailable(
                    f"Kafka at {config.kafka_bootstrap} could not create the order log "
                    f"{name!r}: {exc}"
                ) from exc
    return run


def cleanup(run: KazooRun) -> None:
    """Delete a finished run's order log and znodes (best effort: a run's names are
    unique, so leftovers never disturb another run)."""
    from confluent_kafka.admin import AdminClient
    from kazoo.client import KazooClient

    if run.partitions:
        admin = AdminClient(_kafka(run.config.kafka_bootstrap))
        for fut in admin.delete_topics([run.topic]).values():
            try:
                fut.result(timeout=10)
            except Exception as exc:
                log.debug("could not delete the order log: %s", exc)
    zk = KazooClient(
        hosts=run.config.zk_hosts,
        timeout=run.config.session_timeout_s,
        logger=endpoints.client_logger(),
    )
    try:
        zk.start(timeout=5)
        zk.delete(f"/tandem/{_name(run.job)}/{run.run}", recursive=True)
    except Exception as exc:
        log.debug("could not delete the run's znodes: %s", exc)
    finally:
        zk.stop()
        zk.close()


def read_orders(run: KazooRun, channels: dict[tuple[int, int], int], timeout: float = 30.0):
    """The orders every replica of each ordered partition followed, replayed from the
    run's order log: ``{(task, partition): [(channel, up_to_seq), ...]}``. ``channels``
    gives each partition's number of input channels. The same Rust fence the replicas ran
    decides, so this is exactly what they consumed."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    follow = {run.slot(t, p): _core.OrderLog(channels[(t, p)]) for t, p in run.partitions}
    consumer = Consumer(
        _kafka(
            run.config.kafka_bootstrap,
            **{"group.id": f"tandem-check-{run.run}", "enable.auto.commit": False},
        )
    )
    try:
        tp = TopicPartition(run.topic, 0, OFFSET_BEGINNING)
        _, high = consumer.get_watermark_offsets(tp, timeout=timeout)
        consumer.assign([tp])
        deadline = time.monotonic() + timeout
        offset = 0
        while offset < high:
            if time.monotonic() > deadline:
                raise ServiceUnavailable(
                    f"could not read the order log {tp.topic!r} to its end ({offset} of "
                    f"{high} messages) within {timeout:.0f} s from {run.config.kafka_bootstrap}"
                )
            msg = consumer.poll(POLL_S)
            if msg is None or msg.error() is not None:
                continue
            for slot, frame in _core.order_frames(msg.value()):
                if slot in follow:
                    follow[slot].offer(frame)
            offset = msg.offset() + 1
    finally:
        consumer.close()
    return {(t, p): follow[run.slot(t, p)].drain() for t, p in run.partitions}


def current_leader(
    run: KazooRun, task: int, partition: int, timeout: float = 5.0, zk: Any = None
) -> int | None:
    """The replica index currently leading ``(task, partition)``, or None if none does —
    asked on ``zk`` (a started client), or on a client of its own.
    Raises ``ServiceUnavailable`` if ZooKeeper does not answer within ``timeout``."""
    if zk is not None:
        # zk.retry rides out a connection loss (a loaded machine, a restarting server).
        contenders = zk.retry(zk.Lock(run.zk_path(task, partition)).contenders)
        return int(contenders[0].split(":")[2]) if contenders else None
    from kazoo.client import KazooClient
    from kazoo.handlers.threading import KazooTimeoutError

    zk = KazooClient(
        hosts=run.config.zk_hosts,
        timeout=max(run.config.session_timeout_s, 2.0),
        logger=endpoints.client_logger(),
    )
    try:
        zk.start(timeout=timeout)
    except KazooTimeoutError as exc:
        zk.close()
        raise ServiceUnavailable(
            f"ZooKeeper at {run.config.zk_hosts} did not answer within {timeout:.0f} s"
        ) from exc
    try:
        return current_leader(run, task, partition, zk=zk)
    finally:
        zk.stop()
        zk.close()


class Releaser:
    """Hands a dead leader's partitions over at once: deletes the election nodes of
    replicas whose worker the engine *knows* is dead (its process reaped, or SIGKILLed
    and gone), so that the follower waiting behind them in the lock queue leads now
    instead of after the dead session's timeout (any ZooKeeper client may delete an
    ephemeral node). Safety does not change: a new leader still reads the order log to
    its end before it orders, and its epoch is above the dead leader's. A worker merely
    silent or cut off is not released here — its session may still be alive, and it
    stops leading itself once that session is in doubt. The deletions run on a thread
    of their own, so a slow ZooKeeper never holds the coordinator up."""

    def __init__(self, run: KazooRun) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.run = run
        self._zk = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tandem-kazoo-release")
        self.released: list[tuple[int, int, int]] = []
        # Connected now, off the coordinator's thread: a first release then pays no
        # session set-up (tens of ms, the larger part of a handover otherwise).
        self._pool.submit(self._connect)

    def _connect(self):
        from kazoo.client import KazooClient

        if self._zk is None:
            cfg = self.run.config
            # Its own logger, quiet below errors: this client only deletes nodes, and its
            # connection's hiccups on a busy machine (a late ping) heal by themselves.
            quiet = logging.getLogger("tandem.kazoo.releaser")
            quiet.setLevel(logging.ERROR)
            zk = KazooClient(
                hosts=cfg.zk_hosts, timeout=max(cfg.session_timeout_s, 2.0), logger=quiet
            )
            zk.start(timeout=10)
            self._zk = zk
        return self._zk

    def release(self, replicas, pid: int):
        """Release the election nodes of ``replicas`` held by the dead process ``pid``
        (a future of the replicas released)."""
        ordered = [rid for rid in replicas if tuple(rid[:2]) in self.run.partitions]
        return self._pool.submit(self._release, ordered, pid)

    def _release(self, replicas, pid: int) -> list[tuple[int, int, int]]:
        from kazoo.exceptions import NoNodeError

        if not replicas:
            return []
        zk, done = self._connect(), []
        for t, p, r in replicas:
            path = self.run.zk_path(t, p)
            try:
                children = zk.get_children(path)
            except NoNodeError:
                continue
            for child in children:
                with contextlib.suppress(NoNodeError):
                    data, _ = zk.get(f"{path}/{child}")
                    if data.decode(errors="replace") == f"{t}:{p}:{r}:{pid}":
                        zk.delete(f"{path}/{child}")
                        done.append((t, p, r))
                        log.info("kazoo: released the election node of dead %s:%s:%s", t, p, r)
        self.released += done
        return done

    def leader(self, task: int, partition: int, timeout: float = 1.0) -> int | None:
        """The replica leading ``(task, partition)`` now (None: none does), asked on this
        releaser's client, already connected: a ZooKeeper round trip, no session set-up.
        Raises ``ServiceUnavailable`` if no answer comes within ``timeout``."""
        from concurrent.futures import TimeoutError as NoAnswer

        future = self._pool.submit(
            lambda: current_leader(self.run, task, partition, zk=self._connect())
        )
        try:
            return future.result(timeout)
        except NoAnswer as exc:
            raise ServiceUnavailable(
                f"ZooKeeper at {self.run.config.zk_hosts} did not name the leader of task "
                f"{task} partition {partition} within {timeout:g} s"
            ) from exc

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._zk is not None:
            with contextlib.suppress(Exception):
                self._zk.stop()
                self._zk.close()


def resolve_role(role: str, leader: int | None, alive: list[int], where: str) -> int | None:
    """The replica index holding ``role`` (``"leader"`` or ``"follower"``) of an ordered
    partition (``where``, for the error) whose election node ``leader`` leads now, among
    the ``alive`` replicas (what a fault naming a role resolves to). None while an election
    is under way (the leading node is no live replica's: a dead leader's node not deleted
    yet, or none); ``TandemError`` if no live replica can hold the role."""
    if not alive:
        raise TandemError(f"{where} has no live replica")
    if leader not in alive:
        return None
    if role == "leader":
        return leader
    followers = [r for r in alive if r != leader]
    if not followers:
        raise TandemError(f"{where} has no live follower to kill")
    return followers[0]


def _thread(owner: KazooSession | Orderer, fn, name: str, what: str) -> threading.Thread:
    """A daemon thread running ``fn``; what kills it, unless ``owner`` is stopping, is kept
    in ``owner.error`` (raised by :meth:`Orderer.check` in the replica loop) and logged."""

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            if not owner._stop.is_set():
                owner.error = exc
                log.exception("%s failed", what)

    return threading.Thread(target=run, name=name, daemon=True)


class KazooSession:
    """The connections one worker's orderers share (see the module documentation): one
    ZooKeeper session, one idempotent producer fed by one publishing thread for every
    partition the worker leads (``tandem._core.OrderPublisher`` on ``worker``, whose
    inboxes the orderers' feeds must belong to), one consumer following the order log
    of the worker, one consumer for watermark queries.

    Create the :class:`Orderer` s first (each registers itself), then :meth:`start` (which
    raises ``ServiceUnavailable`` if a service cannot be reached), then start the orderers.
    :meth:`stop` closes the session — every lock node of the worker goes with it, at once
    — and the clients. ``name`` tells the worker apart in logs and consumer groups.
    """

    def __init__(self, run: KazooRun, worker: _core.Worker, name: str | None = None) -> None:
        self.run = run
        self.name = name or f"pid{os.getpid()}"
        self.orderers: dict[int, Orderer] = {}  # by slot (the OrderPublisher key)
        # Every partition this worker leads publishes through it, from one thread; the
        # follower hands every message to it, and it to each order's feed.
        self.publisher = _core.OrderPublisher(
            worker,
            batch=run.config.batch,
            resend_after=ORDER_TIMEOUT_MS / 1000,
            pace=run.config.pace_ms / 1000,
        )
        self.router = _core.OrderRouter(self.publisher)
        self.on_lead = None
        """Called as ``on_lead((task, partition, replica), epoch, since_ns)`` the moment a
        replica of this worker wins its partition's election (on its election thread):
        the engine records the term, which a replica lost while leading cannot report."""
        self.start_offset = 0
        """Where the follower starts reading the order log. A worker rebuilt from twins
        sets it (before :meth:`start`) to the earliest place its replicas' cuts stood at:
        each replica's log ignores what it had read already."""
        self._consumed = 0  # next offset of the order log the follower has read
        self._catching_up = 0  # orderers waiting for _consumed (see Orderer._read_to_end)
        self._caught_up = threading.Condition()
        self._stop = threading.Event()
        self._meta_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.started = False
        self.error: BaseException | None = None
        self.suspended = 0  # times the session was in doubt (SUSPENDED)
        self.producers_replaced = 0  # order producers replaced after a timeout
        self._timed_out = threading.Event()  # an order timed out: replace the producer
        self.expired = 0  # times it was lost (LOST: expired, or closed)
        # Orders of deposed leaders the worker's replicas fenced off, as they met them.
        self.fenced: list[dict[str, int]] = []

    def stats(self) -> dict[str, Any]:
        """``suspended`` / ``expired``: how often the session was in doubt / lost;
        ``producers_replaced``: order producers replaced after an order timed out;
        ``fenced``: one record per stale order a replica of this worker ignored (``task``,
        ``partition``, ``replica``, the order's ``epoch`` and ``version``, the ``current``
        epoch it lost to, its ``offset`` in the order log); at most :data:`FENCED_KEPT`."""
        return {
            "name": self.name,
            "suspended": self.suspended,
            "expired": self.expired,
            "producers_replaced": self.producers_replaced,
            "fenced": list(self.fenced),
        }

    def add(self, orderer: Orderer) -> None:
        if self.started:
            raise ConfigError("KazooSession.add() after start(): create every orderer first")
        self.orderers[orderer.slot] = orderer
        self.router.add(orderer.slot, orderer.feed)

    def start(self) -> None:
        _require_clients()
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
        from kazoo.client import KazooClient
        from kazoo.handlers.threading import KazooTimeoutError

        cfg = self.run.config
        self.zk = KazooClient(
            hosts=cfg.zk_hosts, timeout=cfg.session_timeout_s, logger=endpoints.client_logger()
        )
        try:
            self.zk.start(timeout=10)
        except KazooTimeoutError as exc:
            self.zk.close()
            raise ServiceUnavailable(
                f"ZooKeeper is not reachable at {cfg.zk_hosts}: start it with "
                "`tandem services start zookeeper`"
            ) from exc
        self.zk.add_listener(self._on_state)
        kafka = _kafka(cfg.kafka_bootstrap)
        self.producer = self._producer()
        group = f"tandem-{self.run.run}-{self.name}"
        self.consumer = Consumer(
            {
                **kafka,
                "group.id": group,
                "enable.auto.commit": False,
                # The broker answers a fetch as soon as one order is there (fetch.min.bytes
                # is 1); a long wait only spares it a request every few ms while idle.
                "fetch.wait.max.ms": 100,
                "reconnect.backoff.max.ms": 200,
                # Should the position ever fall outside the log (a broker that came back
                # with less than it acknowledged), read it again from the start: orders are
                # positional and a replay is ignored, while the default (the end) would
                # skip orders and stall every replica of the partition.
                "auto.offset.reset": "earliest",
            }
        )
        self.tp = TopicPartition(self.run.topic, 0)
        start = self.start_offset or OFFSET_BEGINNING
        self._consumed = self.start_offset
        self.consumer.assign([TopicPartition(self.run.topic, 0, start)])
        # Watermark queries come from the election threads, on a consumer of their own: a
        # query on the follower's consumer while it polls deadlocks (confluent-kafka 2.x).
        self.meta = Consumer({**kafka, "group.id": f"tandem-meta-{self.run.run}-{self.name}"})
        self.started = True
        threads = (self._follow, "follow"), (self._acknowledge, "acks"), (self._publish, "publish")
        for target, name in threads:
            t = _thread(self, target, f"kazoo-{name}", f"kazoo session of {self.name}")
            t.start()
            self._threads.append(t)

    def _producer(self):
        """The order producer (one per worker session; replaced when its orders time out,
        see :meth:`_publish`)."""
        from confluent_kafka import Producer

        cfg = self.run.config
        return Producer(
            {
                **_kafka(cfg.kafka_bootstrap),
                "acks": "all",
                "enable.idempotence": True,
                "linger.ms": 0,
                # An order counts as delivered once its replica followed it from the log:
                # only failures need a report (one Python call less per order).
                "delivery.report.only.error": True,
                "reconnect.backoff.max.ms": 200,
                # An order stuck in the client (a broker restart can leave a request of
                # the idempotent producer waiting for a reply that never comes) fails
                # after this long instead of after the 300 s default; the leader then
                # publishes again from what the log holds (orders are positional, a
                # replay is ignored), so a stuck order costs seconds, not the run.
                "message.timeout.ms": ORDER_TIMEOUT_MS,
                "request.timeout.ms": ORDER_TIMEOUT_MS - 1000,
            }
        )

    def stop(self) -> None:
        """Close the session (every leadership of the worker ends at once), stop the
        threads, close the clients. Idempotent."""
        if self._stop.is_set() or not self.started:
            self._stop.set()
            return
        self._stop.set()
        for o in list(self.orderers.values()):
            o._sound.clear()
        try:
            self.zk.stop()  # closes the session: its lock nodes go with it, at once
        finally:
            for o in list(self.orderers.values()):
                o.stop()
            for t in self._threads:
                t.join(timeout=5)
            self.zk.close()
            self.producer.flush(2)
            self.consumer.close()
            self.meta.close()

    def high_watermark(self) -> int:
        """The order log's end offset, asked of the broker."""
        with self._meta_lock:
            _, high = self.meta.get_watermark_offsets(self.tp, timeout=1.0, cached=False)
        return high

    def _on_state(self, state) -> None:
        from kazoo.client import KazooState

        if state == KazooState.SUSPENDED:
            self.suspended += 1
        elif state == KazooState.LOST and not self._stop.is_set():
            self.expired += 1
        # kazoo calls this on its own thread: the orderers only flip flags.
        for o in list(self.orderers.values()):
            o._on_state(state)

    def _follow(self) -> None:
        while not self._stop.is_set():
            msg = self.consumer.poll(POLL_S)
            if msg is None:
                continue
            if msg.error() is not None:
                log.debug("order log of %s: %s", self.name, msg.error())
                continue
            offered = self.router.offer(msg.value(), msg.offset())
            for slot, verdict, epoch, version, current in offered:
                self.orderers[slot]._ignored(verdict, epoch, version, current, msg.offset())
            self._consumed = msg.offset() + 1
            if self._catching_up:  # a new leader waits for this (Orderer._read_to_end)
                with self._caught_up:
                    self._caught_up.notify_all()

    def _publish(self) -> None:
        """Publish every order due, as one message: those of all the partitions this
        worker leads come at once and go out together (one append for the broker, one
        message for each reader)."""
        orderers, topic = self.orderers, self.run.topic
        while not self._stop.is_set():
            if self._timed_out.is_set():
                self._replace_producer()
            producer = self.producer
            due = self.publisher.next(POLL_S)
            # A partition whose session came in doubt since is left out (its election
            # thread resigns it).
            sent = [(slot, order) for slot, order in due if orderers[slot]._sound.is_set()]
            if not sent:
                continue
            slots = [slot for slot, _ in sent]

            def on_delivery(err, _msg, slots=slots) -> None:  # failures only
                for slot in slots:
                    orderers[slot]._failed(err)

            producer.produce(topic, value=b"".join(o for _, o in sent), on_delivery=on_delivery)
            for slot in slots:
                orderers[slot].orders_published += 1

    def _replace_producer(self) -> None:
        """An order timed out: after a broker restart librdkafka's producer can stay on
        metadata that no longer holds (``new leader-1 not found in cache``) and time out
        every order from then on. A new producer starts from fresh metadata; what the old
        one still held is dropped (the leaders publish again from the log: orders are
        positional, a replay is ignored)."""
        self._timed_out.clear()
        old, self.producer = self.producer, self._producer()
        self.producers_replaced += 1
        log.info("order producer of %s replaced after an order timed out", self.name)
        old.purge(in_queue=True, in_flight=True, blocking=False)
        old.flush(0)

    def _acknowledge(self) -> None:
        """Serve the producer's reports of failed deliveries (each goes to the orderer that
        produced the order), so no orderer polls for another's."""
        while not self._stop.is_set():
            self.producer.poll(POLL_S)


class Orderer:
    """The KaZoo orderer of one replica (see the module documentation), on its worker's
    :class:`KazooSession`.

    ``start()`` starts the election thread (after the session started), ``stop()``
    releases leadership and joins it. ``stats()`` reports the epochs it led, the orders it
    published and what it followed.
    """

    def __init__(
        self,
        session: KazooSession,
        task: int,
        partition: int,
        replica: int,
        feed: _core.OrderFeed,
    ) -> None:
        self.session, self.run, self.feed = session, session.run, feed
        self.task, self.partition, self.replica = task, partition, replica
        self.channels = len(feed.arrived())
        self.slot = self.run.slot(task, partition)
        self.path = self.run.zk_path(task, partition)
        self.ident_pid = os.getpid()
        self.ident = f"{task}:{partition}:{replica}:{self.ident_pid}"
        self._stop = threading.Event()
        # Set while this replica may publish: it holds the lock and its session is sound.
        self._sound = threading.Event()
        # Set when the session that won the lock has expired: the leadership is gone.
        self._lost = threading.Event()
        self._leading = False
        self._changed = threading.Event()  # set on a session state change and on stop
        self._lock: Any = None
        self._threads: list[threading.Thread] = []
        self.led: list[dict] = []
        self.orders_published = 0
        self.publish_errors = 0
        self.error: BaseException | None = None
        session.add(self)

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def zk(self):
        return self.session.zk

    def start(self) -> None:
        if not self.session.started:
            raise ConfigError("Orderer.start() before its KazooSession.start()")
        t = _thread(self, self._elect, "kazoo-elect", f"kazoo orderer of {self.ident}")
        t.start()
        self._threads.append(t)

    def stop(self) -> None:
        """Release leadership at once and join the election thread. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._sound.clear()
        self._changed.set()
        lock = self._lock
        if lock is not None:
            lock.cancel()
        for t in self._threads:
            t.join(timeout=5)

    def stats(self) -> dict[str, Any]:
        return {
            "led": list(self.led),
            "published": self.orders_published,
            "publish_errors": self.publish_errors,
            "follow": self.feed.stats(),
            "session": self.session.stats(),
        }

    def leading(self) -> int | None:
        """The epoch this replica leads its partition with now; None while it follows."""
        if self._leading and self._sound.is_set() and self.led:
            return self.led[-1]["epoch"]
        return None

    def check(self) -> None:
        """Raise the error its thread (or its session's) died of, if any (the replica's
        task loop calls this)."""
        if self.error is not None:
            raise self.error
        if self.session.error is not None:
            raise self.session.error

    # -- ZooKeeper session ----------------------------------------------------------------

    def _on_state(self, state) -> None:
        from kazoo.client import KazooState

        if state == KazooState.CONNECTED:
            # Back on the same session (kazoo reports an expired one as LOST first): the
            # lock node, and so the leadership, is still ours.
            if self._leading and not self._lost.is_set():
                self._sound.set()
            self._changed.set()
            return
        # SUSPENDED: the session may be about to expire and a follower to take over; LOST:
        # it has. Either way, not one more order from here.
        self._sound.clear()
        if state == KazooState.LOST:
            self._lost.set()
        self._changed.set()

    # -- follower -------------------------------------------------------------------------

    def _ignored(self, verdict: str, epoch: int, version: int, current: int, offset: int):
        """An order of this partition the feed did not follow (on the session's follower):
        a deposed leader's is logged and recorded."""
        if verdict != "stale":
            return
        log.info(
            "%s: fenced off order %d of deposed leader epoch %d (epoch %d leads)",
            self.ident,
            version,
            epoch,
            current,
        )
        if len(self.session.fenced) < FENCED_KEPT:
            self.session.fenced.append(
                {
                    "task": self.task,
                    "partition": self.partition,
                    "replica": self.replica,
                    "epoch": epoch,
                    "version": version,
                    "current": current,
                    "offset": offset,
                }
            )

    def _still_leading(self) -> bool:
        """Wait while the session is in doubt; False once the leadership is gone."""
        while not self._sound.is_set():
            if self._lost.is_set() or self._stop.is_set():
                return False
            self._sound.wait(POLL_S)
        return not self._stop.is_set()

    def _read_to_end(self) -> bool:
        """Wait until the follower thread has followed every order published so far."""
        session = self.session
        while self._still_leading():
            try:
                high = session.high_watermark()
            except Exception as exc:  # Kafka unreachable: keep trying while leading
                log.debug("order log %s: no high watermark yet (%s)", self.run.topic, exc)
                continue
            # Never wait for the session under this lock: the follower thread takes it to
            # notify. A notification missed between the check and the wait costs POLL_S.
            with session._caught_up:
                session._catching_up += 1
            try:
                while self._still_leading():
                    with session._caught_up:
                        if session._consumed >= high:
                            return True
                        session._caught_up.wait(POLL_S)
            finally:
                with session._caught_up:
                    session._catching_up -= 1
        return False

    # -- leader ---------------------------------------------------------------------------

    def _elect(self) -> None:
        from kazoo.exceptions import CancelledError, KazooException

        while not self._stop.is_set():
            if not self.zk.connected:
                time.sleep(POLL_S)
                continue
            lock = self.zk.Lock(self.path, self.ident)
            self._lock = lock
            self._lost.clear()
            try:
                if not lock.acquire(timeout=None):
                    continue
            except CancelledError:
                continue
            except KazooException as exc:  # session trouble while contending: try again
                log.debug("%s: election interrupted (%s)", self.ident, exc)
                time.sleep(POLL_S)
                continue
            epoch = int(lock.node[-10:]) + 1  # the lock node's sequence number
            self._lost.clear()  # a session lost while contending is not this one
            self._leading = True
            self._sound.set()
            since_ns = time.time_ns()
            self.led.append({"epoch": epoch, "since_ns": since_ns})
            log.info("%s leads with epoch %d", self.ident, epoch)
            try:
                on_lead = self.session.on_lead
                if on_lead is not None:
                    on_lead((self.task, self.partition, self.replica), epoch, since_ns)
                if self._read_to_end():
                    self._lead(epoch)
            finally:
                self._leading = False
                self._sound.clear()
                self.led[-1]["until_ns"] = time.time_ns()
                try:
                    if self.zk.connected:
                        lock.release()
                except KazooException:
                    pass

    def _lead(self, epoch: int) -> None:
        """Publish through the session's publisher while the leadership lasts; while the
        session is in doubt, not at all (if the same session comes back, a new leadership
        of the same epoch resumes from the log, its orders numbered after the log's and the
        resigned leadership's: ``orderlog::Leader``)."""
        publisher = self.session.publisher
        leading = False
        try:
            while not self._stop.is_set():
                if self._sound.is_set():
                    if not leading:
                        publisher.lead(self.slot, self.feed, epoch)
                        leading = True
                elif leading:
                    publisher.resign(self.slot)
                    leading = False
                if self._lost.is_set():
                    return
                self._changed.wait(1.0)  # the session's state or a stop: look again
                self._changed.clear()
        finally:
            if leading:
                publisher.resign(self.slot)

    def _failed(self, err) -> None:
        """An order of this partition was not delivered (the producer reports failures
        only), on the session's acknowledging thread."""
        from confluent_kafka import KafkaError

        self.publish_errors += 1
        log.warning("%s: an order was not delivered: %s", self.ident, err)
        if err.code() == KafkaError._MSG_TIMED_OUT:
            self.session._timed_out.set()
        self.session.publisher.lost(self.slot)  # publish again from what the log holds


__all__ = [
    "KazooConfig",
    "KazooRun",
    "KazooSession",
    "Orderer",
    "Releaser",
    "cleanup",
    "current_leader",
    "prepare",
    "read_orders",
    "resolve_role",
]
