"""The one coordinator every engine runs (``tandem.engines.coordinator``): its typed
protocol with the workers, the hosts both engines implement, and the same rebuild driven
through both of them."""

from __future__ import annotations

import dataclasses
import inspect
import os
import pickle
import socket
import subprocess
import sys
from multiprocessing.connection import Connection

import pytest

import tandem as td
from tandem import testing
from tandem.engines import protocol
from tandem.engines.coordinator import WorkerHost
from tandem.engines.local import LocalHost
from tandem.engines.process import child_env
from tandem.exceptions import ProtocolError


def messages() -> list[type]:
    return [
        c
        for _, c in inspect.getmembers(protocol, inspect.isclass)
        if issubclass(c, protocol.Message) and c is not protocol.Message
    ]


def test_every_message_is_a_frozen_slotted_dataclass_that_pickles():
    assert len(messages()) >= 20
    for cls in messages():
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls
        assert not hasattr(cls(*[None] * _required(cls)), "__dict__"), cls
    msg = protocol.Linked((1, 0, 1), (2, 0, 0), None)
    assert pickle.loads(pickle.dumps(msg)) == msg
    with pytest.raises(dataclasses.FrozenInstanceError):
        msg.error = "x"


def _required(cls) -> int:
    return sum(
        f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        for f in dataclasses.fields(cls)
    )


def test_expect_names_what_came_and_what_was_expected():
    go = protocol.Go({}, 1, 2.0, 0.0)
    assert protocol.expect(go, protocol.Go, protocol.Exit) is go
    with pytest.raises(ProtocolError, match=r"expected Restore or Exit for a rebuilt worker, "):
        protocol.expect(go, protocol.Restore, protocol.Exit, what="for a rebuilt worker")
    with pytest.raises(ProtocolError, match=r"got tuple \('go', 1\), which is no tandem message"):
        protocol.expect(("go", 1), protocol.Go)
    this = protocol.VERSION
    with pytest.raises(ProtocolError, match=rf"version 99, this process {this}: install the same"):
        protocol.check_version(99, "the coordinator")


def _worker_process(first) -> subprocess.CompletedProcess:
    """Start ``python -m tandem.engines.worker`` as the local engine does and send it
    ``first``; what it does with it."""
    mine, theirs = socket.socketpair()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.engines.worker", str(theirs.fileno()), str(os.getpid())],
        pass_fds=(theirs.fileno(),),
        env=child_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    theirs.close()
    conn = Connection(mine.detach())
    try:
        conn.send(first)
        _, err = proc.communicate(timeout=60)
    finally:
        conn.close()
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", err)


def test_a_worker_refuses_a_message_that_is_not_of_the_protocol():
    """An old-style tuple where an Assign is due: the worker fails, naming both."""
    done = _worker_process(("path", b"plan", [], b"", None, False))
    assert done.returncode != 0
    assert "ProtocolError: expected Assign to start a worker, got tuple" in done.stderr


def test_a_worker_refuses_a_coordinator_of_another_protocol_version():
    done = _worker_process(protocol.Assign(0, (), version=protocol.VERSION + 1))
    assert done.returncode != 0
    assert f"speaks tandem protocol version {protocol.VERSION + 1}" in done.stderr


def test_both_engines_host_workers_behind_one_protocol():
    import tandem_spark.registry as reg

    job = td.Job("hosts", replication=2)
    job.source(td.sources.Synthetic(rate=10)).sink(td.sinks.Collect())
    plan = job.plan()
    local = LocalHost(plan, "127.0.0.1", relay=False)
    assert isinstance(local, WorkerHost)
    with reg.Registry(
        plan, plan.placement(), b"s" * 32, host="127.0.0.1", kill="worker", on_failure=print
    ) as spark:
        assert isinstance(spark, WorkerHost)
    for host in (LocalHost, reg.Registry):
        for name in ("start", "replace", "send", "kill", "pause", "thaw", "poll", "node"):
            assert callable(getattr(host, name)), (host, name)


def test_both_engines_are_checked_against_the_engine_protocol():
    import tandem_spark
    from tandem import engines
    from tandem.engines.local import LocalEngine

    assert isinstance(LocalEngine(), engines.StoppableEngine)
    assert engines.stoppable(LocalEngine())
    spark = tandem_spark.SparkEngine(master="local[2,2]")
    assert isinstance(spark, engines.StoppableEngine) and engines.stoppable(spark)
    job = td.Job("not-an-engine")
    job.source(td.sources.Synthetic(rate=10)).sink(td.sinks.Collect())
    with pytest.raises(td.ConfigError, match=r"an engine object \(a name and a run\(\) method"):
        job.run(duration=1, engine=object())


def test_the_rebuild_state_machine_and_fault_injection_are_written_once():
    """Only the coordinator defines the rejoin state machine and injects faults; the
    engines' modules host workers."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    once = ("class _Rejoin", "def _on_cut", "def _on_linked", "def _abort_rejoin", "def _inject")
    found = {
        name: sorted(
            str(p.relative_to(root))
            for folder in ("python", "spark_integration")
            for p in (root / folder).rglob("*.py")
            if name in p.read_text()
        )
        for name in once
    }
    assert all(paths == ["python/tandem/engines/coordinator.py"] for paths in found.values()), found


def counting_job() -> td.Job:
    job = td.Job("rebuild", replication=2, restore=True)
    ev = job.source(td.sources.Synthetic(rate=1_000, keys=40, seed=11), parallelism=2)
    (
        ev.map(testing.bucket, parallelism=2, name="enrich")
        .key_by("key")
        .process(td.CountPerKey(), parallelism=2, name="count")
        .sink(td.sinks.Collect())
    )
    job.workers = 2  # per replica group, whatever this machine's cores
    return job


@pytest.mark.parametrize("engine", ["local", pytest.param("spark", marks=pytest.mark.spark)])
def test_the_same_rebuild_through_both_hosts(engine):
    """One scenario, one coordinator, two hosts: a worker of count[0] replica 0 killed at
    1 s is rebuilt from its twins (on Spark by the task Spark retries), then its twin
    is killed and masked by the rebuilt replica."""
    faults = [td.Kill("count", 0, 0, at=1.0), td.Kill("count", 0, 1, at=5.0)]
    res = counting_job().run(duration=8, faults=faults, engine=engine)
    assert res.lost == 0 and res.duplicates == 0
    assert res.digests_match, res.determinism_errors
    rebuilt = {(r["task"], r["partition"], r["replica"]) for r in res.restored_replicas}
    assert rebuilt == testing.lost_replicas(res) == testing.killed_replicas(res)
    assert {("count", 0, 0), ("count", 0, 1)} <= rebuilt
    for r in res.restored_replicas:
        assert r["lost_s"] < r["restored_s"] < r["lost_s"] + 5, r
        assert r["epoch"] > 0 and r["twin"] != r["replica"], r
