"""Where ZooKeeper and Kafka are, and whether they answer: for KaZoo, and for the Kafka
source and sink (:mod:`tandem.kafka`).

The default addresses are those `tandem services` binds: 127.0.0.1, ports
``TANDEM_ZK_PORT`` (21810) and ``TANDEM_KAFKA_PORT`` (19092). A probe is what only a real
client can tell — a kazoo session opens, a Kafka metadata request is answered — and turns
a failure into ``tandem.ServiceUnavailable`` naming the address and how to start the
service. Starting and stopping servers is not the library's business: that is
``tandem services`` (``tandem._services``: tooling for users, the tests, the demo and the
benchmarks).
"""

from __future__ import annotations

import logging
import os
import time

from tandem.exceptions import ConfigError, ServiceUnavailable
from tandem.logs import librdkafka_logger

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
DEFAULT_ZK_PORT = 21810
DEFAULT_KAFKA_PORT = 19092
PORT_ENV = {"zookeeper": "TANDEM_ZK_PORT", "kafka": "TANDEM_KAFKA_PORT"}
DISPLAY = {"zookeeper": "ZooKeeper", "kafka": "Kafka"}


def start_hint(name: str) -> str:
    """How to get the service ``name`` (``zookeeper`` or ``kafka``) running."""
    return (
        f"start it with `tandem services start {name}`, "
        f"or point {PORT_ENV[name]} at a running {DISPLAY[name]}"
    )


def port_from_env(var: str, default: int) -> int:
    """The TCP port in ``$var``, else ``default``; a ConfigError if it is not a port."""
    raw = os.environ.get(var)
    if raw is None or raw == "":
        return default
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise ConfigError(f"{var}={raw!r} is not a TCP port: set it to a number in 1..65535")
    return port


def default_zk_hosts() -> str:
    """The ZooKeeper connect string used unless one is given."""
    return f"{HOST}:{port_from_env(PORT_ENV['zookeeper'], DEFAULT_ZK_PORT)}"


def default_kafka_bootstrap() -> str:
    """The Kafka ``bootstrap.servers`` used unless one is given."""
    return f"{HOST}:{port_from_env(PORT_ENV['kafka'], DEFAULT_KAFKA_PORT)}"


def probe_zookeeper(hosts: str, timeout: float = 5.0) -> None:
    """Open and close a kazoo session with `hosts`; raise `ServiceUnavailable` if none
    opens within `timeout` seconds (a refused connection still takes the whole timeout:
    kazoo retries, as it would for a server that is restarting)."""
    try:
        from kazoo.client import KazooClient
        from kazoo.handlers.threading import KazooTimeoutError
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError(
            "kazoo is not installed, and the KaZoo ordering needs it: "
            "pip install 'tandem-stream[kazoo]'"
        ) from exc
    client = KazooClient(hosts=hosts, timeout=max(timeout, 0.5), logger=client_logger())
    started = time.monotonic()
    try:
        client.start(timeout=timeout)
    except KazooTimeoutError as exc:
        raise ServiceUnavailable(
            f"ZooKeeper is not reachable at {hosts}: no session within {timeout:.1f} s; "
            + start_hint("zookeeper")
        ) from exc
    try:
        client.get_children("/")
    finally:
        client.stop()
        client.close()
    log.debug("ZooKeeper at %s answered in %.3f s", hosts, time.monotonic() - started)


def probe_kafka(bootstrap: str, timeout: float = 5.0) -> None:
    """Ask the broker at `bootstrap` for cluster metadata; raise `ServiceUnavailable` if it
    does not answer within `timeout` seconds."""
    try:
        from confluent_kafka import KafkaException
        from confluent_kafka.admin import AdminClient
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError(
            "confluent-kafka is not installed, and the KaZoo ordering needs it: "
            "pip install 'tandem-stream[kazoo]'"
        ) from exc
    # librdkafka prints every refused connection to stderr; route it to logging instead.
    admin = AdminClient(
        {
            "bootstrap.servers": bootstrap,
            "socket.connection.setup.timeout.ms": max(int(timeout * 1000), 1000),
            "logger": librdkafka_logger("tandem.kazoo.librdkafka"),
        }
    )
    try:
        metadata = admin.list_topics(timeout=timeout)
    except KafkaException as exc:
        raise ServiceUnavailable(
            f"Kafka is not reachable at {bootstrap}: no metadata within {timeout:.1f} s "
            f"({exc.args[0].str() if exc.args else exc}); " + start_hint("kafka")
        ) from exc
    if not metadata.brokers:
        raise ServiceUnavailable(
            f"Kafka at {bootstrap} answered but lists no broker yet; "
            "wait for it to finish starting, or " + start_hint("kafka")
        )


class _Demoted(logging.LoggerAdapter):
    """kazoo's own records under ``tandem.kazoo.client``, its warnings at info: a
    connection it drops and re-establishes by itself (a ping answered late on a busy
    machine) is no news to a user — what matters, a session in doubt or lost, tandem
    reports itself (``Result.kazoo_sessions``, and the leaders' hand-overs)."""

    def warning(self, msg, *args, **kwargs) -> None:
        self.logger.info(msg, *args, **kwargs)

    def log(self, level, msg, *args, **kwargs) -> None:
        self.logger.log(logging.INFO if level == logging.WARNING else level, msg, *args, **kwargs)


def client_logger() -> logging.LoggerAdapter:
    """The logger tandem's ZooKeeper clients log through (see :class:`_Demoted`)."""
    return _Demoted(logging.getLogger("tandem.kazoo.client"), {})


__all__ = [
    "DEFAULT_KAFKA_PORT",
    "DEFAULT_ZK_PORT",
    "HOST",
    "client_logger",
    "default_kafka_bootstrap",
    "default_zk_hosts",
    "port_from_env",
    "probe_kafka",
    "probe_zookeeper",
    "start_hint",
]
