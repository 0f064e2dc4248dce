"""What the experiments share: starting ZooKeeper and Kafka for a command that needs them,
finding their processes to count their CPU, the flags several experiments take, and
writing what they measured (text tables, JSON)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import asdict
from pathlib import Path

import psutil

import tandem as td

# -- ZooKeeper and Kafka ---------------------------------------------------------------------


@contextlib.contextmanager
def kazoo_services(needed: bool, session_timeout: float):
    """The KazooConfig of the local ZooKeeper and Kafka (None if not ``needed``), started
    for the command if they are not running, and stopped again afterwards if so."""
    if not needed:
        yield None
        return
    from tandem._services import ensure_running

    print("KaZoo needs ZooKeeper and Kafka: starting what is not running ...", flush=True)
    services = ensure_running()
    try:
        yield td.KazooConfig(
            zk_hosts=services.zk_hosts,
            kafka_bootstrap=services.kafka_bootstrap,
            session_timeout_s=session_timeout,
        )
    finally:
        if services.started:
            started = services.started  # stop() empties it
            services.stop()
            print(
                f"stopped {', '.join(started)} (started for this command; "
                "`tandem services start` keeps them running between runs)"
            )


# -- their processes -------------------------------------------------------------------------


def port_of(address: str) -> int:
    """The port of the first ``host:port`` of a comma-separated list."""
    return int(address.split(",")[0].rpartition(":")[2])


def listener_pid(port: int) -> int | None:
    """The PID of the process listening on TCP ``port`` (IPv4 or IPv6), or None (also when
    the listener is not ours to see)."""
    for conn in psutil.net_connections(kind="tcp"):
        listens = conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port
        if listens and conn.pid is not None:
            return conn.pid
    return None


def service_pids(kazoo: td.KazooConfig, log=None) -> dict[str, int]:
    """The PIDs of the ZooKeeper and Kafka servers ``kazoo`` points at: the ones
    ``tandem services`` started (its PID files), else whoever listens on the port (a
    server started from another checkout, or by hand)."""
    from tandem._services import Services

    zoo = kazoo.resolved()
    ports = {"zookeeper": port_of(zoo.zk_hosts), "kafka": port_of(zoo.kafka_bootstrap)}
    pids: dict[str, int] = {}
    try:
        states = Services(zk_port=ports["zookeeper"], kafka_port=ports["kafka"]).status()
        pids = {name: s.pid for name, s in states.items() if s.up and s.pid}
    except td.TandemError as exc:  # no tool answer: fall back to the listeners
        print(
            f"cost: `tandem services status` failed ({exc}); using the ports",
            file=log or sys.stderr,
        )
    for name, port in ports.items():
        if name not in pids:
            pid = listener_pid(port)
            if pid is not None:
                pids[name] = pid
    return pids


# -- flags -------------------------------------------------------------------------------------


def add_session_timeout(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--session-timeout",
        type=float,
        default=0.5,
        metavar="S",
        help="KaZoo: the ZooKeeper session timeout (a crashed leader is replaced after "
        "about this; default 0.5)",
    )


def add_names(p: argparse.ArgumentParser, flag: str, choices, default: str = "all") -> None:
    """A flag taking some of ``choices``, comma-separated."""
    p.add_argument(
        flag,
        metavar="NAMES",
        help=f"comma-separated, from {','.join(choices)} (default: {default})",
    )


def add_rate(p: argparse.ArgumentParser, default: int | None, help: str) -> None:
    p.add_argument("--rate", type=int, default=default, metavar="EV_PER_S", help=help)


def add_seconds(p: argparse.ArgumentParser, flag: str, default: float | None, help: str) -> None:
    p.add_argument(flag, type=float, default=default, metavar="S", help=help)


def add_json(p: argparse.ArgumentParser, help: str = "write the rows as JSON") -> None:
    p.add_argument("--json", metavar="PATH", help=help)


def csv(value: str | None) -> tuple[str, ...]:
    """A comma-separated flag's values (none given: ``()``)."""
    return tuple(v.strip() for v in value.split(",") if v.strip()) if value else ()


def command(args: argparse.Namespace, experiment: str, *flags: str) -> str:
    """``tandem bench EXPERIMENT`` (nothing if empty) and the ``flags`` given, as typed."""
    out = f"tandem bench {experiment}" if experiment else ""
    for flag in flags:
        value = getattr(args, flag)
        if value is not None and value is not False:
            out += f" --{flag}" + ("" if value is True else f" {value}")
    return out


def headline(what: str, measures: str = "timings") -> None:
    """Print the first line of an experiment (version, build, ``what`` it runs), and under
    a debug build a warning that its ``measures`` say nothing about a release build."""
    print(f"tandem {td.__version__} ({td.build_profile} build) {what}", flush=True)
    if td.build_profile != "release":
        print(
            f"warning: a debug build: its {measures} say nothing about a release build",
            flush=True,
        )


# -- what was measured -------------------------------------------------------------------------


def table(rows: list) -> str:
    """Rows (dataclasses or dicts) as aligned text."""
    dicts = [r if isinstance(r, dict) else asdict(r) for r in rows]
    cols = list(dicts[0]) if dicts else []
    lines = ["  ".join(f"{c:>14}" for c in cols)]
    lines += ["  ".join(f"{v!s:>14}" for v in d.values()) for d in dicts]
    return "\n".join(lines)


def write_json(path: str | None, out: dict) -> None:
    """``out`` as JSON at ``path`` (nothing if None), and a line saying so."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(out, indent=2))
        print(f"wrote {path}")


def plot_to(path: str, plot, *args) -> None:
    """``plot(*args, path)`` into ``path`` (its folder made), or a line saying why not."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        plot(*args, path)
        print(f"wrote {path}")
    except ImportError:
        print("(no plot: matplotlib is not installed; pip install 'tandem-stream[plot]')")


def report_written(doc: dict) -> int:
    """Print the figures written and what failed; 1 if anything did, else 0."""
    for f in doc["figures"]:
        print(f"wrote {f}")
    if doc["failures"]:
        print("\nFAILED:", file=sys.stderr)
        for f in doc["failures"]:
            print(f"  {f}", file=sys.stderr)
        return 1
    return 0
