"""Tooling, not library API: start, stop and watch the real ZooKeeper and Kafka that
KaZoo runs against on a developer machine and in CI — for the tests (``tests/conftest.py``),
``tandem demo --ordering kazoo`` and the benchmarks. Private (not exported by ``tandem``);
a job's own services are the user's business, and the library only needs their addresses
and probes (:mod:`tandem.endpoints`).

The servers are run by :mod:`tandem._services.control` — ``tandem services`` on the command
line, ``scripts/services.sh`` in a checkout — which ships in the wheel and runs a
standalone ZooKeeper and a single-node KRaft Kafka from Maven Central jars, bound to
127.0.0.1, with their data under ``~/.cache/tandem/services``. This module is the Python
face of that tool:

```python
from tandem._services import ensure_running

services = ensure_running()  # starts what is not already reachable
services.zk_hosts  # "127.0.0.1:21810"
services.kafka_bootstrap  # "127.0.0.1:19092"
services.stop()  # only stops the servers this Services started
```

The tool does the process work (jars, configs, PID files, readiness of the server itself),
in a subprocess of its own; this module adds what only a real client can tell (the probes
of :mod:`tandem.endpoints`) and turns every failure into `tandem.ServiceUnavailable` naming
the address and how to start the services. Ports come from `TANDEM_ZK_PORT` (21810) and
`TANDEM_KAFKA_PORT` (19092), the same variables the tool reads.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tandem.endpoints import (
    DEFAULT_KAFKA_PORT,
    DEFAULT_ZK_PORT,
    HOST,
    PORT_ENV,
    port_from_env,
    probe_kafka,
    probe_zookeeper,
)
from tandem.exceptions import ConfigError, ServiceUnavailable

log = logging.getLogger(__name__)

SERVICE_NAMES = ("zookeeper", "kafka")

#: The tool itself: standard library only, run as a file (no import of tandem there).
CONTROL = Path(__file__).resolve().with_name("control.py")

#: How long `start` waits for the tool (jar download on the very first start included).
START_TIMEOUT_S = 300.0


def _listening(address: str, timeout: float = 0.5) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


@dataclass(frozen=True)
class ServiceState:
    """One line of `tandem services status`: the server as the tool sees it."""

    name: str
    #: "up" (running and ready), "starting" (running, not ready yet) or "down"
    state: str
    address: str
    #: PID of the server the tool started, or None
    pid: int | None

    @property
    def up(self) -> bool:
        return self.state == "up"


class Services:
    """The ZooKeeper and/or Kafka a process uses, and the servers it started itself.

    Construct it for the servers you need; `start()` starts the selected ones that are not
    already reachable and remembers them in `started`, and `stop()` stops only those, so a
    server a developer runs is never stopped by a test session.
    """

    def __init__(
        self,
        zookeeper: bool = True,
        kafka: bool = True,
        *,
        zk_port: int | None = None,
        kafka_port: int | None = None,
    ) -> None:
        self.names: tuple[str, ...] = tuple(
            name for name, wanted in zip(SERVICE_NAMES, (zookeeper, kafka), strict=True) if wanted
        )
        if not self.names:
            raise ConfigError("Services(zookeeper=False, kafka=False) selects no service")
        self.zk_port = zk_port or port_from_env(PORT_ENV["zookeeper"], DEFAULT_ZK_PORT)
        self.kafka_port = kafka_port or port_from_env(PORT_ENV["kafka"], DEFAULT_KAFKA_PORT)
        self.started: tuple[str, ...] = ()
        #: wall-clock seconds of the last `start()` that started something
        self.start_seconds: float | None = None

    def __repr__(self) -> str:
        return (
            f"Services(names={self.names}, zk_hosts={self.zk_hosts!r}, "
            f"kafka_bootstrap={self.kafka_bootstrap!r}, started={self.started})"
        )

    @property
    def zk_hosts(self) -> str:
        """The ZooKeeper connect string, e.g. `127.0.0.1:21810`."""
        return f"{HOST}:{self.zk_port}"

    @property
    def kafka_bootstrap(self) -> str:
        """The Kafka `bootstrap.servers` value, e.g. `127.0.0.1:19092`."""
        return f"{HOST}:{self.kafka_port}"

    def address(self, name: str) -> str:
        return self.zk_hosts if self._check_name(name) == "zookeeper" else self.kafka_bootstrap

    def _check_name(self, name: str) -> str:
        if name not in SERVICE_NAMES:
            raise ConfigError(f"unknown service {name!r}: expected one of {SERVICE_NAMES}")
        return name

    def _run(self, *args: str, timeout: float = START_TIMEOUT_S) -> subprocess.CompletedProcess:
        env = dict(os.environ)
        env["TANDEM_ZK_PORT"] = str(self.zk_port)
        env["TANDEM_KAFKA_PORT"] = str(self.kafka_port)
        try:
            return subprocess.run(
                [sys.executable, str(CONTROL), *args],
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            state = os.environ.get("TANDEM_SERVICES_DIR") or "~/.cache/tandem/services"
            raise ServiceUnavailable(
                f"`tandem services {' '.join(args)}` did not finish in {timeout:.0f} s; "
                f"see the logs under {state}/logs/"
            ) from exc

    def _target(self, names: tuple[str, ...]) -> str:
        """The tool's argument for `names`: one server, or `all`."""
        return "all" if set(names) == set(SERVICE_NAMES) else names[0]

    def start(self, *, fresh: bool = False) -> tuple[str, ...]:
        """Start the selected servers that are not reachable yet (both at once when both
        are missing), wait until real clients get through, and return the names started.

        `fresh=True` wipes the data of the servers it starts (an empty ZooKeeper, a newly
        formatted Kafka cluster); servers already running are used as they are.
        """
        missing = tuple(n for n in self.names if not _listening(self.address(n)))
        if missing:
            began = time.monotonic()
            # One call of the tool, so two missing servers boot in parallel.
            target = self._target(missing)
            done = self._run("start", target, *(["--fresh"] if fresh else []))
            for line in done.stdout.splitlines():
                log.info("%s", line)
            if done.returncode != 0:
                # One server may be up while the other failed: stop what this call started
                # (the tool only signals its own PIDs) so nothing is left running unowned.
                self._run("stop", target, timeout=60.0)
                addresses = ", ".join(self.address(n) for n in missing)
                raise ServiceUnavailable(
                    f"could not start {target} ({addresses}): "
                    f"{done.stderr.strip() or done.stdout.strip()}"
                )
            self.started = tuple(dict.fromkeys((*self.started, *missing)))
            self.check()
            self.start_seconds = time.monotonic() - began
        else:
            self.check()
        return missing

    def stop(self, names: tuple[str, ...] | list[str] | None = None) -> None:
        """Stop the servers this object started (or `names`, which must be ones the tool
        started: it never signals a process it did not start)."""
        targets = tuple(self.started if names is None else names)
        for name in targets:
            self._check_name(name)
        if not targets:
            return
        done = self._run("stop", self._target(targets))
        if done.returncode != 0:
            raise ServiceUnavailable(f"could not stop {targets}: {done.stderr.strip()}")
        self.started = tuple(n for n in self.started if n not in targets)

    def restart(self, name: str) -> float:
        """Stop and start one server the tool runs, keeping its data, as a crash and
        recovery would; wait until clients get through again; return the seconds it took."""
        self._check_name(name)
        began = time.monotonic()
        done = self._run("restart", name)
        if done.returncode != 0:
            raise ServiceUnavailable(
                f"could not restart {name} at {self.address(name)}: "
                f"{done.stderr.strip() or done.stdout.strip()}"
            )
        self.check(names=(name,))
        return time.monotonic() - began

    def status(self) -> dict[str, ServiceState]:
        """What the tool reports for each selected server."""
        target = self._target(self.names)
        done = self._run("status", target, timeout=30.0)
        states: dict[str, ServiceState] = {}
        for line in done.stdout.splitlines():
            fields = line.split()
            if len(fields) < 3 or fields[0] not in SERVICE_NAMES:
                continue
            pid = None
            for field in fields[3:]:
                if field.startswith("pid="):
                    pid = int(field.removeprefix("pid="))
            states[fields[0]] = ServiceState(fields[0], fields[1], fields[2], pid)
        if set(states) != set(self.names):
            raise ServiceUnavailable(
                f"`tandem services status {target}` printed no line for "
                f"{sorted(set(self.names) - set(states))}: {done.stdout!r} {done.stderr!r}"
            )
        return states

    def check(self, timeout: float = 5.0, names: tuple[str, ...] | None = None) -> None:
        """Raise `ServiceUnavailable` unless a real client reaches every selected server
        (a kazoo session; a Kafka metadata request) within `timeout` seconds each."""
        for name in names or self.names:
            if name == "zookeeper":
                probe_zookeeper(self.zk_hosts, timeout)
            else:
                probe_kafka(self.kafka_bootstrap, timeout)


def ensure_running(
    zookeeper: bool = True,
    kafka: bool = True,
    *,
    start: bool = True,
    fresh: bool = False,
    timeout: float = 5.0,
    zk_port: int | None = None,
    kafka_port: int | None = None,
) -> Services:
    """Make sure the selected services answer, starting them with `tandem services start`
    when `start` is true, and return the `Services` describing them.

    With `start=False` nothing is started: a server that does not answer within `timeout`
    seconds raises `ServiceUnavailable` naming its address and how to start it.
    """
    services = Services(zookeeper, kafka, zk_port=zk_port, kafka_port=kafka_port)
    if start:
        services.start(fresh=fresh)
    else:
        services.check(timeout)
    return services


__all__ = [
    "SERVICE_NAMES",
    "ServiceState",
    "Services",
    "ensure_running",
]
