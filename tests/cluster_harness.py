"""The multi-host cluster of ``scripts/cluster.sh``, from Python: what the ``cluster`` fixture
(tests/conftest.py) gives the tests.

Hosts are network namespaces on one bridge with no route out, each with an address in
198.18.0.0/15: a head running the real Spark standalone master and worker hosts each
running a real Spark Worker (from the pyspark package of this interpreter's environment).
Every operation is the script's own subcommand, so what the tests do is what a developer
does by hand; a failure raises :class:`ClusterError` with the script's message. Root is
required (the script says so, and what else is missing, when it fails).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "cluster.sh"


class ClusterError(RuntimeError):
    """A ``scripts/cluster.sh`` subcommand failed; the message is the script's."""


@dataclass(frozen=True)
class Host:
    """One host of the cluster: its namespace's name, role (``head``, ``worker``,
    ``services``) and address."""

    name: str
    role: str
    address: str


def free_prefix(base: str) -> str:
    """``base``, or ``base1``, ``base2``...: the first name prefix no bridge or namespace on
    this machine uses yet. Another checkout's cluster, or one a killed run left behind
    (its records went with its clone), keeps its names; this session takes the next."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    bridges = {m.group(1) for m in re.finditer(r"^\d+: ([^:@]+)", links, re.M)}
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    spaces = {line.split()[0] for line in namespaces.splitlines() if line.strip()}
    for k in range(100):
        prefix = base if k == 0 else f"{base}{k}"
        used = f"{prefix}br0" in bridges or any(
            re.fullmatch(rf"{re.escape(prefix)}(head|svc|w\d+)", name) for name in spaces
        )
        if not used:
            return prefix
    raise ClusterError(f"prefixes {base}..{base}99 are all in use: scripts/cluster.sh down them")


class Cluster:
    """``workers`` worker hosts and a head, brought up by :meth:`up`, taken down by
    :meth:`down` (everything the script started, nothing else). ``state_dir``: where the
    script records what it started and keeps logs (``TANDEM_CLUSTER_DIR``, default
    ``.cluster/``); ``prefix``: its hosts' and links' name prefix
    (``TANDEM_CLUSTER_PREFIX``, default ``td``); ``python``: the interpreter the Workers'
    executors run (by default this one, so the tandem under test)."""

    def __init__(
        self,
        workers: int = 3,
        *,
        state_dir: str | os.PathLike | None = None,
        prefix: str | None = None,
        python: str = sys.executable,
        services: bool = False,
    ) -> None:
        self.workers, self.services = workers, services
        self.prefix = prefix or os.environ.get("TANDEM_CLUSTER_PREFIX") or "td"
        self.state_dir = Path(
            state_dir or os.environ.get("TANDEM_CLUSTER_DIR") or ROOT / ".cluster"
        )
        self.env = {
            **os.environ,
            "TANDEM_CLUSTER_DIR": str(self.state_dir),
            "TANDEM_CLUSTER_PREFIX": self.prefix,
            "TANDEM_CLUSTER_PYTHON": python,
        }
        self.python = python
        self._hosts: dict[str, Host] = {}
        self.master_url = ""
        self.up_seconds = 0.0

    # -- the script -----------------------------------------------------------------------

    def _script(self, *args: str, timeout: float = 300) -> str:
        try:
            done = subprocess.run(
                ["bash", str(SCRIPT), *args],
                env=self.env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as exc:
            raise ClusterError(
                f"scripts/cluster.sh {' '.join(args)} did not finish within {timeout:.0f} s"
            ) from exc
        if done.returncode != 0:
            raise ClusterError(
                f"scripts/cluster.sh {' '.join(args)} failed (exit {done.returncode}):\n"
                f"{done.stderr.strip() or done.stdout.strip()}"
            )
        return done.stdout

    def up(self) -> Cluster:
        """Bring the cluster up (a previous one this state folder recorded is taken down
        first) and wait until the master and every Worker are ready."""
        t0 = time.monotonic()
        self._script("up", str(self.workers), *(["--services"] if self.services else []))
        self.up_seconds = time.monotonic() - t0
        run = self.state_dir / "run"
        self._hosts = {}
        for line in (run / "hosts").read_text().splitlines():
            name, role, address, _link = line.split()
            self._hosts[name] = Host(name, role, address)
        self.master_url = (run / "master").read_text().strip()
        return self

    def down(self) -> str:
        """Stop every process the cluster runs and remove its hosts, links and bridge (a
        no-op once done)."""
        out = self._script("down")
        self._hosts, self.master_url = {}, ""
        return out

    def status(self) -> str:
        return self._script("status")

    # -- hosts ----------------------------------------------------------------------------

    @property
    def head(self) -> str:
        """The head host's name (it runs the master; drivers run there too)."""
        return next(h.name for h in self._hosts.values() if h.role == "head")

    @property
    def hosts(self) -> list[str]:
        """The worker hosts' names, w1 first."""
        return [h.name for h in self._hosts.values() if h.role == "worker"]

    @property
    def services_host(self) -> str | None:
        return next((h.name for h in self._hosts.values() if h.role == "services"), None)

    def address(self, host: str) -> str:
        return self._host(host).address

    def host_of(self, address: str) -> str:
        """The host that has ``address``."""
        for h in self._hosts.values():
            if h.address == address:
                return h.name
        raise ClusterError(f"no host of this cluster has address {address}")

    def _host(self, host: str) -> Host:
        if host not in self._hosts:
            raise ClusterError(f"no host {host!r}: the cluster's hosts are {sorted(self._hosts)}")
        return self._hosts[host]

    def work_dir(self, host: str) -> Path:
        """The host's ``SPARK_WORKER_DIR``: ``app-*/<executor>/stderr`` are its executors'
        logs (where the worker tasks' own stderr lines go)."""
        self._host(host)
        return self.state_dir / "work" / host

    def executor_logs(self, host: str) -> list[Path]:
        return sorted(self.work_dir(host).glob("app-*/*/stderr"))

    # -- faults ---------------------------------------------------------------------------

    def crash(self, host: str) -> None:
        """SIGKILL every process on ``host`` (its network stays: peers see resets)."""
        self._script("crash", self._host(host).name)

    def restart(self, host: str) -> None:
        """``host`` boots again after a crash: its daemons are started again."""
        self._script("restart", self._host(host).name)

    def partition(self, host: str) -> None:
        """Take ``host``'s link down: packets to and from it vanish (no reset)."""
        self._script("partition", self._host(host).name)

    def slow(self, host: str, rate: str) -> None:
        """Throttle ``host``'s link to ``rate`` (tc's syntax, e.g. ``"2mbit"``) both ways."""
        self._script("slow", self._host(host).name, rate)

    def heal(self, host: str | None = None) -> None:
        """Undo ``partition`` and ``slow`` on ``host`` (every host if None)."""
        self._script("heal", *([self._host(host).name] if host else []))

    def crashed(self) -> list[str]:
        """Hosts whose daemons do not all run (crashed and not restarted)."""
        out = []
        for line in self.status().splitlines()[1:]:
            fields = line.split()
            if fields and fields[0] in self._hosts and "=dead" in line:
                out.append(fields[0])
        return out

    def restore(self) -> None:
        """Every host healed and running its daemons again: what a test leaves behind."""
        self.heal()
        for host in self.crashed():
            self.restart(host)

    # -- commands on hosts ----------------------------------------------------------------

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """The argv that runs ``argv`` on ``host`` (``scripts/cluster.sh exec``: in its
        namespace, with ``SPARK_LOCAL_IP``, ``SPARK_LOCAL_HOSTNAME``,
        ``TANDEM_CLUSTER_ADDRESS`` and ``TANDEM_CLUSTER_MASTER`` set)."""
        return ["bash", str(SCRIPT), "exec", self._host(host).name, *map(str, argv)]

    def run_on(
        self, host: str, argv: Sequence[str], *, timeout: float | None = 60, **kwargs
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` on ``host`` and wait for it (``subprocess.run``'s keywords; output
        captured as text unless told otherwise)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.command(host, argv), env=self.env, timeout=timeout, **kwargs)

    def popen_on(self, host: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` on ``host`` without waiting (``subprocess.Popen``'s keywords)."""
        return subprocess.Popen(self.command(host, argv), env=self.env, **kwargs)

    def python_on(self, host: str, code: str, *, timeout: float | None = 60):
        """Run Python ``code`` on ``host`` with the cluster's interpreter."""
        return self.run_on(host, [self.python, "-c", code], timeout=timeout)


PLACED = re.compile(
    r"tandem-cluster (?P<tag>\S+): (?P<what>\S+) on (?P<address>\S+) pid (?P<pid>\d+)"
)
"""The line a job's replica prints to its executor's stderr when it opens (see
tests/cluster_job.py): ``tandem-cluster TAG: count[0]/1 on 198.18.0.12 pid 1234``."""


def placed(cluster: Cluster, tag: str) -> dict[str, str]:
    """What runs where in run ``tag``, from the executor logs of every worker host:
    ``count[P]/R`` (replica R of partition P, so replica group R) and ``sink[P]/R`` → host."""
    found: dict[str, str] = {}
    for host in cluster.hosts:
        for path in cluster.executor_logs(host):
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            for m in PLACED.finditer(text):
                if m["tag"] == tag:
                    found[m["what"]] = cluster.host_of(m["address"])
    return found
