"""The service layer under KaZoo, against the real ZooKeeper and Kafka.

What KaZoo relies on, checked end to end: the servers come up bound to loopback; a kazoo
election hands leadership over in about one session timeout when the leader's process is
SIGKILLed (and at once on a graceful close); an idempotent producer and an `assign()`
consumer round-trip every message exactly once, in order; clients ride out a restart of
either server; an unreachable address fails fast with `ServiceUnavailable`. The tool's own
failure messages (port taken, Java missing, foreign PID, a jar that cannot be fetched or
does not match its pin) and `tandem services`' exit codes are checked without starting a
JVM. (tests/test_newcomer.py runs the tool from an installed wheel, outside the checkout.)
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from kazoo.client import KazooClient, KazooState

from tandem import ServiceUnavailable, cli, testing
from tandem._services import Services, control, ensure_running

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "services.sh"

pytestmark = pytest.mark.timeout(120)


def _wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def _unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


# ---------------------------------------------------------------- servers up, loopback only


def _listening_addresses(pid: int) -> list[str]:
    """Local addresses of the TCP sockets `pid` listens on, from `ss`."""
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    return [line.split()[3] for line in out.splitlines() if f"pid={pid}," in line]


def test_status_reports_both_up_and_bound_to_loopback_only(zookeeper, kafka):
    states = kafka.status()
    assert set(states) == {"zookeeper", "kafka"}
    assert states["zookeeper"].up, states
    assert states["kafka"].up, states
    assert states["zookeeper"].address == kafka.zk_hosts
    assert states["kafka"].address == kafka.kafka_bootstrap
    for state in states.values():
        assert state.pid is not None
        addresses = _listening_addresses(state.pid)
        assert addresses, f"{state.name} (pid {state.pid}) listens on nothing"
        # Java reports IPv4 sockets of a dual-stack JVM as [::ffff:127.0.0.1]:PORT.
        for address in addresses:
            host = address.rpartition(":")[0].strip("[]").removeprefix("::ffff:")
            assert host == "127.0.0.1", f"{state.name} listens on {address}: {addresses}"
    zk_ports = {a.rpartition(":")[2] for a in _listening_addresses(states["zookeeper"].pid)}
    assert zk_ports == {str(kafka.zk_port)}, "the ZooKeeper admin server (8080) must be off"


# ---------------------------------------------------------------- ZooKeeper: election


class _Contender:
    """One kazoo `Election` contender running in a thread; records when it won."""

    def __init__(self, client: KazooClient, path: str, ident: str) -> None:
        self.election = client.Election(path, ident)
        self.won = threading.Event()
        self.release = threading.Event()
        self.won_at: float | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"contender-{ident}", daemon=True)

    def _lead(self) -> None:
        self.won_at = time.monotonic()
        self.won.set()
        self.release.wait(60)

    def _run(self) -> None:
        try:
            self.election.run(self._lead)
        except Exception as exc:  # a closed client cannot release its lock: expected there
            self.error = exc

    def start(self) -> _Contender:
        self.thread.start()
        return self

    def finish(self) -> None:
        self.release.set()
        self.election.cancel()
        self.thread.join(10)
        assert not self.thread.is_alive()


def _client(hosts: str, session_timeout: float) -> KazooClient:
    client = KazooClient(hosts=hosts, timeout=session_timeout)
    client.start(timeout=10)
    return client


def _close(client: KazooClient) -> None:
    client.stop()
    client.close()


# Holds leadership until killed; run as a separate process so SIGKILL leaves its session
# to expire on the server, exactly as a crashed replica would.
_LEADER_PROCESS = """
import sys, time
from kazoo.client import KazooClient
hosts, path, session = sys.argv[1], sys.argv[2], float(sys.argv[3])
client = KazooClient(hosts=hosts, timeout=session)
client.start(timeout=10)
client.Election(path, "doomed").run(lambda: time.sleep(3600))
"""


@pytest.mark.parametrize("session_timeout", [0.5, 1.0])
def test_election_takeover_after_leader_sigkill(zookeeper, session_timeout):
    path = f"/tandem/test/{_unique('election-kill')}"
    leader = subprocess.Popen(
        [sys.executable, "-c", _LEADER_PROCESS, zookeeper.zk_hosts, path, str(session_timeout)]
    )
    client = _client(zookeeper.zk_hosts, session_timeout)
    survivor = _Contender(client, path, "survivor")
    try:
        _wait_until(lambda: survivor.election.contenders() == ["doomed"], 20, "the leader process")
        survivor.start()
        _wait_until(
            lambda: survivor.election.contenders() == ["doomed", "survivor"],
            10,
            "the survivor to queue behind the leader",
        )
        assert not survivor.won.is_set()
        killed_at = time.monotonic()
        leader.send_signal(signal.SIGKILL)
        leader.wait(10)
        assert survivor.won.wait(10 * session_timeout), "the survivor never became leader"
        takeover = survivor.won_at - killed_at
        print(
            f"\nkazoo election takeover after SIGKILL, session {session_timeout:.1f} s: "
            f"{takeover * 1000:.0f} ms"
        )
        assert takeover < 2 * session_timeout
        assert survivor.election.contenders() == ["survivor"]
    finally:
        survivor.finish()
        leader.kill()
        leader.wait(10)
        _close(client)
    assert survivor.error is None, survivor.error


def test_election_hands_over_at_once_when_the_leader_closes_its_session(zookeeper):
    path = f"/tandem/test/{_unique('election-close')}"
    first_client = _client(zookeeper.zk_hosts, 1.0)
    second_client = _client(zookeeper.zk_hosts, 1.0)
    first = _Contender(first_client, path, "first").start()
    second = _Contender(second_client, path, "second")
    try:
        assert first.won.wait(10)
        second.start()
        _wait_until(
            lambda: second.election.contenders() == ["first", "second"], 10, "two contenders"
        )
        closed_at = time.monotonic()
        first_client.stop()  # closes the session without releasing: ephemerals go at once
        assert second.won.wait(5)
        handover = second.won_at - closed_at
        print(f"\nkazoo election handover after client.stop(): {handover * 1000:.1f} ms")
        assert handover < 0.5
    finally:
        first.finish()
        second.finish()
        first_client.close()
        _close(second_client)
    assert second.error is None, second.error


def test_kazoo_client_reconnects_across_a_zookeeper_restart(zookeeper):
    client = _client(zookeeper.zk_hosts, 10.0)
    states: list[str] = []
    reconnected = threading.Event()

    def listener(state: str) -> None:
        states.append(state)
        if state == KazooState.CONNECTED and KazooState.SUSPENDED in states:
            reconnected.set()

    client.add_listener(listener)
    path = f"/tandem/test/{_unique('restart')}"
    try:
        client.create(path, b"before", makepath=True)
        client.create(f"{path}/ephemeral", b"", ephemeral=True)
        restart_s = zookeeper.restart("zookeeper")
        began = time.monotonic()
        assert reconnected.wait(20), f"kazoo never reconnected; states seen: {states}"
        print(
            f"\nZooKeeper restart took {restart_s:.2f} s; kazoo reconnected "
            f"{time.monotonic() - began:.2f} s after it was ready; states {states}"
        )
        # Persistent data survives the restart in every case. The session survives too if
        # the client came back within its timeout (ZooKeeper reloads sessions from its data;
        # it caps the timeout at 20 ticks = 5 s): then the ephemeral is still there; if the
        # restart outlasted it, the session is LOST and ZooKeeper must have removed it.
        assert client.get(path)[0] == b"before"
        survived = KazooState.LOST not in states
        assert (client.exists(f"{path}/ephemeral") is not None) == survived, states
        client.create(f"{path}/after", b"after")
        expected = ["after", "ephemeral"] if survived else ["after"]
        assert sorted(client.get_children(path)) == expected
    finally:
        _close(client)


# ---------------------------------------------------------------- Kafka: exactly once, in order

_PRODUCER = {
    "acks": "all",
    "enable.idempotence": True,
    "linger.ms": 0,
    # Default backoff grows to 10 s; a restarted broker should be retried sooner.
    "reconnect.backoff.max.ms": 500,
    # librdkafka prints each refused reconnect to stderr; send it to logging instead.
    "logger": logging.getLogger("tandem.test.kafka"),
}


def _create_topic(bootstrap: str) -> str:
    topic = _unique("tandem-test")
    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    futures[topic].result(timeout=30)
    return topic


def _produce(producer: Producer, topic: str, values: list[bytes]) -> list[int]:
    """Produce `values`, wait for every acknowledgement, return their offsets in order."""
    acked: list[tuple[bytes, int]] = []
    errors: list[str] = []

    def on_delivery(err, msg) -> None:
        if err is not None:
            errors.append(str(err))
        else:
            acked.append((msg.value(), msg.offset()))

    for value in values:
        producer.produce(topic, value=value, on_delivery=on_delivery)
        producer.poll(0)
    remaining = producer.flush(60)
    assert remaining == 0, f"{remaining} messages not acknowledged within 60 s"
    assert errors == []
    assert [value for value, _ in acked] == values
    return [offset for _, offset in acked]


def _consume(bootstrap: str, topic: str, count: int) -> list[tuple[int, bytes]]:
    """Read partition 0 from the beginning with `assign()` until `count` messages arrived."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": _unique("tandem-test"),
            "enable.auto.commit": False,
        }
    )
    try:
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        got: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + 30
        while len(got) < count and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            got.append((msg.offset(), msg.value()))
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
        assert (low, high) == (0, count), "the partition holds more or fewer than expected"
        return got
    finally:
        consumer.close()


def test_idempotent_producer_and_assigned_consumer_round_trip_in_order(kafka):
    topic = _create_topic(kafka.kafka_bootstrap)
    n = 2000
    values = [b"event-%d" % i for i in range(n)]
    producer = Producer({"bootstrap.servers": kafka.kafka_bootstrap, **_PRODUCER})
    offsets = _produce(producer, topic, values)
    assert offsets == list(range(n))
    got = _consume(kafka.kafka_bootstrap, topic, n)
    assert got == list(zip(range(n), values, strict=True))


def test_producer_delivers_after_a_kafka_restart(kafka):
    topic = _create_topic(kafka.kafka_bootstrap)
    producer = Producer({"bootstrap.servers": kafka.kafka_bootstrap, **_PRODUCER})
    before = [b"before-%d" % i for i in range(100)]
    after = [b"after-%d" % i for i in range(100)]
    assert _produce(producer, topic, before) == list(range(100))
    restart_s = kafka.restart("kafka")
    began = time.monotonic()
    assert _produce(producer, topic, after) == list(range(100, 200))
    print(
        f"\nKafka restart took {restart_s:.2f} s; the producer's next 100 messages were "
        f"acknowledged {time.monotonic() - began:.2f} s after it was ready"
    )
    got = _consume(kafka.kafka_bootstrap, topic, 200)
    assert [value for _, value in got] == before + after


# ---------------------------------------------------------------- unreachable: fail fast


@pytest.mark.parametrize("service", ["zookeeper", "kafka"])
def test_unreachable_service_raises_service_unavailable_quickly(service):
    port = testing.free_port()
    began = time.monotonic()
    with pytest.raises(ServiceUnavailable) as raised:
        ensure_running(
            zookeeper=service == "zookeeper",
            kafka=service == "kafka",
            start=False,
            timeout=2.0,
            zk_port=port,
            kafka_port=port,
        )
    elapsed = time.monotonic() - began
    message = str(raised.value)
    assert f"127.0.0.1:{port}" in message
    assert f"tandem services start {service}" in message
    assert elapsed <= 5.0, f"took {elapsed:.1f} s to report {service} unreachable"


# ---------------------------------------------------------------- the tool's own checks
# These never start a JVM: each fails before it would, in a private state folder. They run
# the checkout's scripts/services.sh, the wrapper around the packaged tool.


def _script(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "TANDEM_SERVICES_DIR": str(tmp_path / "state"), **env}
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_script_names_the_port_and_process_when_the_port_is_taken(tmp_path):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        done = _script(tmp_path, "start", "zookeeper", TANDEM_ZK_PORT=str(port))
    assert done.returncode == 1, done
    assert f"port {port} is already taken by" in done.stderr
    assert f"pid={os.getpid()}" in done.stderr
    assert "TANDEM_ZK_PORT" in done.stderr
    assert not (tmp_path / "state" / "run" / "zookeeper.pid").exists()


def test_script_says_java_is_missing(tmp_path):
    done = _script(tmp_path, "start", "kafka", TANDEM_JAVA=str(tmp_path / "no-java"))
    assert done.returncode == 1, done
    assert "Java not found" in done.stderr
    assert "openjdk-17" in done.stderr


def test_script_stop_never_signals_a_process_it_did_not_start(tmp_path):
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        run = tmp_path / "state" / "run"
        run.mkdir(parents=True)
        (run / "kafka.pid").write_text(f"{bystander.pid}\n")
        done = _script(tmp_path, "stop", "kafka")
        assert done.returncode == 0, done
        assert "not ours: left alone" in done.stdout
        assert bystander.poll() is None, "stop killed a process it did not start"
        assert not (run / "kafka.pid").exists()
    finally:
        bystander.kill()
        bystander.wait(10)


def test_script_status_reports_down_with_exit_code_3(tmp_path):
    port = testing.free_port()
    done = _script(tmp_path, "status", "all", TANDEM_ZK_PORT=str(port))
    assert done.returncode == 3, done
    assert done.stdout.splitlines()[0] == f"zookeeper down 127.0.0.1:{port}"
    assert done.stdout.splitlines()[1].startswith("kafka down 127.0.0.1:")


def test_services_rejects_an_empty_selection_and_a_bad_port(monkeypatch):
    from tandem import ConfigError

    with pytest.raises(ConfigError, match="selects no service"):
        Services(zookeeper=False, kafka=False)
    monkeypatch.setenv("TANDEM_ZK_PORT", "70000")
    with pytest.raises(ConfigError, match="TANDEM_ZK_PORT='70000'"):
        Services()


def test_cached_jars_need_neither_maven_nor_the_network(tmp_path):
    # A second start must work offline: with the jars cached, neither Maven Central nor a
    # local Maven repository is read (here both would fail loudly). The first call may
    # fetch them (only on a fresh machine).
    first = _script(tmp_path, "jars", "all")
    assert first.returncode == 0, first
    cache = Path(first.stdout.splitlines()[-1].split(" ", 1)[1]).parent
    done = _script(
        tmp_path,
        "jars",
        "all",
        HOME=str(tmp_path / "home"),
        TANDEM_SERVICES_JARS=str(cache),
        TANDEM_MAVEN_REPOSITORY=(tmp_path / "no-repository").as_uri(),
    )
    assert done.returncode == 0, done
    assert "fetching" not in done.stdout
    folders = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert set(folders) == {"zookeeper", "kafka"}
    for name, folder in folders.items():
        jars = {p.name for p in Path(folder).glob("*.jar")}
        main = "zookeeper-3" if name == "zookeeper" else "kafka_2.13-"
        assert any(j.startswith(main) for j in jars), (name, sorted(jars))
    # The run-time extras the ZooKeeper artifact leaves out of its own dependencies.
    zk_jars = {p.name for p in Path(folders["zookeeper"]).glob("*.jar")}
    assert any(j.startswith("metrics-core-") for j in zk_jars)
    assert any(j.startswith("snappy-java-") for j in zk_jars)


# Stands in for a server: carries the markers the script puts on the JVM command line, so
# `stop` recognises it as its own, and optionally ignores SIGTERM like a hung server.
_FAKE_SERVER = """
import signal, sys, time
if sys.argv[1] == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize(
    ("behaviour", "expected_signal"),
    [("obey-term", signal.SIGTERM), ("ignore-term", signal.SIGKILL)],
)
def test_script_stop_sends_sigterm_then_sigkill_after_the_grace_period(
    tmp_path, behaviour, expected_signal
):
    state = tmp_path / "state"
    fake = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _FAKE_SERVER,
            behaviour,
            "-Dtandem.service=zookeeper",
            f"-Dtandem.state={state}",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert fake.stdout.readline() == "ready\n"
        (state / "run").mkdir(parents=True)
        (state / "run" / "zookeeper.pid").write_text(f"{fake.pid}\n")
        began = time.monotonic()
        done = _script(tmp_path, "stop", "zookeeper", TANDEM_SERVICES_STOP_GRACE="1")
        elapsed = time.monotonic() - began
        assert done.returncode == 0, done
        assert fake.wait(5) == -expected_signal
        assert ("sending SIGKILL" in done.stdout) == (expected_signal == signal.SIGKILL)
        assert elapsed < 5
        assert not (state / "run" / "zookeeper.pid").exists()
    finally:
        fake.kill()
        fake.wait(10)
        fake.stdout.close()


def test_ensure_running_uses_running_services_without_starting_or_owning_them(zookeeper, kafka):
    began = time.monotonic()
    services = ensure_running()
    assert services.started == ()
    assert (services.zk_hosts, services.kafka_bootstrap) == (kafka.zk_hosts, kafka.kafka_bootstrap)
    services.stop()  # stops only what it started: nothing
    assert kafka.status()["zookeeper"].up
    assert kafka.status()["kafka"].up
    assert time.monotonic() - began < 10


def test_start_failure_raises_service_unavailable_with_the_scripts_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_SERVICES_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("TANDEM_JAVA", str(tmp_path / "no-java"))
    port = testing.free_port()
    services = Services(zookeeper=True, kafka=False, zk_port=port)
    with pytest.raises(ServiceUnavailable) as raised:
        services.start()
    assert f"127.0.0.1:{port}" in str(raised.value)
    assert "Java not found" in str(raised.value)
    assert services.started == ()


# ---------------------------------------------------------------- jars: pinned, checked


def test_the_jar_lock_pins_the_versions_of_the_pom():
    pom = (ROOT / "scripts" / "services" / "pom.xml").read_text()
    servers = control.lock()["servers"]
    assert set(servers) == {"zookeeper", "kafka"}
    for name, server in servers.items():
        assert f"<{name}.version>{server['version']}</{name}.version>" in pom
        main = {"zookeeper": "zookeeper", "kafka": "kafka_2.13"}[name]
        assert any(
            j["artifact"] == main and j["version"] == server["version"] for j in server["jars"]
        ), name
        for jar in server["jars"]:
            assert re.fullmatch(r"[0-9a-f]{64}", jar["sha256"]), jar


def _fetch_env(tmp_path: Path, repository: Path) -> dict[str, str]:
    # No cached jars, no local Maven repository: the jars must come from `repository`.
    return {
        "HOME": str(tmp_path / "home"),
        "TANDEM_SERVICES_JARS": str(tmp_path / "jars"),
        "TANDEM_MAVEN_REPOSITORY": repository.as_uri(),
    }


def test_an_unreachable_repository_is_reported_with_what_to_do(tmp_path):
    done = _script(tmp_path, "jars", "zookeeper", **_fetch_env(tmp_path, tmp_path / "none"))
    assert done.returncode == 1, done
    assert "services: error: could not fetch the zookeeper jars: could not download" in done.stderr
    assert "TANDEM_MAVEN_REPOSITORY" in done.stderr
    assert not (tmp_path / "jars" / f"zookeeper-{_version('zookeeper')}" / ".complete").exists()


def _version(name: str) -> str:
    return control.lock()["servers"][name]["version"]


def test_a_jar_that_does_not_match_its_pin_is_refused(tmp_path):
    repository = tmp_path / "repository"
    for jar in control.lock()["servers"]["zookeeper"]["jars"]:
        path = repository / control._jar_path(jar)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"not the pinned jar")
    done = _script(tmp_path, "jars", "zookeeper", **_fetch_env(tmp_path, repository))
    assert done.returncode == 1, done
    assert "not the pinned" in done.stderr and "refused" in done.stderr
    folder = tmp_path / "jars" / f"zookeeper-{_version('zookeeper')}"
    assert not (folder / ".complete").exists()
    assert not list(folder.glob("*.jar")), "a refused jar must not stay in the cache"


# ---------------------------------------------------------------- `tandem services`


def test_tandem_services_exit_codes_usage_and_status(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TANDEM_SERVICES_DIR", str(tmp_path / "state"))
    port = testing.free_port()
    monkeypatch.setenv("TANDEM_ZK_PORT", str(port))
    monkeypatch.setenv("TANDEM_KAFKA_PORT", str(testing.free_port()))
    assert cli.main(["services", "status", "zookeeper"]) == 3
    assert capsys.readouterr().out == f"zookeeper down 127.0.0.1:{port}\n"
    assert cli.main(["services", "stop"]) == 0  # nothing to stop is no failure
    assert "not running" in capsys.readouterr().out
    for argv in (["services"], ["services", "start", "zk"], ["services", "begin"]):
        with pytest.raises(SystemExit) as exited:
            cli.main(argv)
        assert exited.value.code == 2, argv
    monkeypatch.setenv("TANDEM_ZK_PORT", "70000")
    assert cli.main(["services", "status"]) == 2
    assert "TANDEM_ZK_PORT=70000 is not a TCP port" in capsys.readouterr().err


def test_tandem_services_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["services", "start", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "(default: all)" in out and "--fresh" in out
    for variable, default, _ in control.ENVIRONMENT:
        assert variable in out and f"(default: {default})" in " ".join(out.split()), variable


def test_tandem_services_says_java_is_missing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TANDEM_SERVICES_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("TANDEM_ZK_PORT", str(testing.free_port()))
    monkeypatch.setenv("TANDEM_JAVA", str(tmp_path / "no-java"))
    assert cli.main(["services", "start", "zookeeper"]) == 1
    err = capsys.readouterr().err
    assert "Java not found" in err and "apt-get install -y openjdk-17-jre-headless" in err
