"""Session fixtures for the real services: `zookeeper` and `kafka`; and `cluster`.

A test that takes either fixture is marked `zookeeper` / `kafka` automatically (so
`-m "not kafka"` deselects it) and gets the `tandem._services.Services` object, with
`.zk_hosts` and `.kafka_bootstrap`. The servers are the real ones `tandem services` runs;
nothing is mocked and nothing is skipped: when a server cannot be started the test errors
with the tool's own message (which port is taken, Java missing, ...).

Every server the session needs is started at the first request, all at once (ZooKeeper and
Kafka boot in parallel), with fresh data; servers already running (a developer's
`make services`) are used as they are and left running. At the end of the session the
fixtures stop exactly the servers they started, also when tests failed.

`cluster` is a multi-host cluster on this machine (`scripts/cluster.sh`, driven through
tests/cluster_harness.py): a head running a real Spark standalone master and
`TANDEM_TEST_CLUSTER_WORKERS` (default 3) worker hosts each running a real Worker, every
host a network namespace. A test that takes it is marked `cluster`. It is brought up at the
first request, once per session, and taken down after the last test that uses it (or at
the end of the session, also when tests failed); after each test that used it every host
is healed (links up, throttles gone) and a crashed host is booted again. It needs root:
without it the test errors with the script's message saying what is missing — it is never
skipped.
"""

from __future__ import annotations

import os
import time

import psutil
import pytest

from cluster_harness import Cluster, free_prefix
from tandem._services import SERVICE_NAMES, Services

_NEEDED = pytest.StashKey[frozenset]()
_LAST_ON_CLUSTER = pytest.StashKey[str]()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # First, so that `-m zookeeper` / `-m "not kafka"` see the markers added here.
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        for name in SERVICE_NAMES:
            if name in fixtures:
                item.add_marker(getattr(pytest.mark, name))
        if "cluster" in fixtures:
            item.add_marker(pytest.mark.cluster)


def pytest_collection_finish(session: pytest.Session) -> None:
    # After deselection: start only what the tests that will run need.
    needed = {
        name
        for item in session.items
        for name in SERVICE_NAMES
        if name in getattr(item, "fixturenames", ())
    }
    session.config.stash[_NEEDED] = frozenset(needed)
    on_cluster = [
        item.nodeid for item in session.items if "cluster" in getattr(item, "fixturenames", ())
    ]
    session.config.stash[_LAST_ON_CLUSTER] = on_cluster[-1] if on_cluster else ""


class _ServicePool:
    """Starts the services the collected tests need, once, and stops them at the end."""

    def __init__(self, needed: frozenset[str]) -> None:
        self.needed = needed
        self.services: Services | None = None

    def get(self, name: str) -> Services:
        if self.services is None or name not in self.services.names:
            # A fixture requested dynamically (getfixturevalue) may not have been counted
            # at collection time: widen the set and start what is missing.
            wanted = set(self.needed) | {name}
            if self.services is not None:
                wanted |= set(self.services.names)
            fresh = Services(zookeeper="zookeeper" in wanted, kafka="kafka" in wanted)
            if self.services is not None:
                fresh.started = self.services.started
            fresh.start(fresh=True)
            self.services = fresh
            print(
                f"\nservices: ZooKeeper {fresh.zk_hosts}, Kafka {fresh.kafka_bootstrap}; started "
                f"{', '.join(fresh.started) or 'nothing (already running)'}"
                + (f" in {fresh.start_seconds:.2f} s" if fresh.start_seconds else "")
            )
        return self.services

    def close(self) -> None:
        if self.services is not None and self.services.started:
            self.services.stop()


@pytest.fixture(scope="session")
def _service_pool(request: pytest.FixtureRequest):
    pool = _ServicePool(request.config.stash.get(_NEEDED, frozenset()))
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def zookeeper(_service_pool: _ServicePool) -> Services:
    """The real ZooKeeper (`.zk_hosts`), started for the session if it was not running."""
    return _service_pool.get("zookeeper")


@pytest.fixture(scope="session")
def kafka(_service_pool: _ServicePool) -> Services:
    """The real Kafka broker (`.kafka_bootstrap`), started for the session if needed."""
    return _service_pool.get("kafka")


@pytest.fixture(scope="session")
def cluster():
    """The cluster (`.master_url`, `.head`, `.hosts`, `.services_host` running ZooKeeper and
    Kafka, `.crash/.partition/.heal/.slow`,
    `.run_on(host, argv)`), brought up once for the session, taken down after the last
    test that uses it (its JVMs would idle beside the rest of the suite) or at the end."""
    hosts = int(os.environ.get("TANDEM_TEST_CLUSTER_WORKERS", "3"))
    # Names no other cluster on this machine uses: a CI run must not trip over a cluster
    # another checkout runs, or one a killed run left behind.
    # ZooKeeper and Kafka on a host of their own, for KaZoo across hosts.
    harness = Cluster(
        hosts,
        prefix=os.environ.get("TANDEM_CLUSTER_PREFIX") or free_prefix("td"),
        services=True,
    )
    harness.up()  # raises the script's message; a failed `up` has taken itself down
    print(
        f"\ncluster {harness.prefix}: {harness.master_url}, {hosts} worker hosts, "
        f"up in {harness.up_seconds:.1f} s"
    )
    try:
        yield harness
    finally:
        harness.down()


@pytest.fixture(autouse=True)
def _restore_cluster(request: pytest.FixtureRequest):
    """After a test that used the cluster: every host healed and running its daemons; after
    the last one, the cluster taken down."""
    harness = request.getfixturevalue("cluster") if "cluster" in request.fixturenames else None
    yield
    if harness is None:
        return
    if request.node.nodeid == request.config.stash.get(_LAST_ON_CLUSTER, ""):
        harness.down()
    else:
        harness.restore()


def worker_processes() -> dict[int, str]:
    """The live worker processes (``python -m tandem.engines.worker``) this test process
    started: PID → command line."""
    out = {}
    for child in psutil.Process().children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                cmd = " ".join(child.cmdline())
                if "-m tandem.engines.worker " in cmd:
                    out[child.pid] = cmd[:200]
        except psutil.Error:
            continue
    return out


@pytest.fixture
def no_orphans():
    """Fails the test if a worker process outlives it (by more than 5 s)."""
    yield
    deadline = time.monotonic() + 5
    while worker_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    left = worker_processes()
    assert not left, f"processes outlived the run: {left}"
