"""The multi-host harness (scripts/cluster.sh) and tandem on the real Spark standalone cluster
it runs: hosts are network namespaces on one bridge with no route out, the head runs the
master and the driver, each worker host a Worker. Real components only; every test takes
the session's `cluster` fixture (tests/conftest.py), so it is marked `cluster` and needs
root."""

from __future__ import annotations

import collections
import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cluster_harness import SCRIPT, Cluster, ClusterError, free_prefix, placed

JOB = Path(__file__).with_name("cluster_job.py")
WEB_UI = 8081  # every Worker's web UI: a listening port on each worker host

PROBE = """
import errno, socket, sys, time
host, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
t0 = time.monotonic()
try:
    socket.create_connection((host, port), timeout=timeout).close()
    outcome = "ok"
except ConnectionRefusedError:
    outcome = "refused"
except TimeoutError:
    outcome = "timeout"
except OSError as exc:
    outcome = "error:" + errno.errorcode.get(exc.errno or 0, type(exc).__name__)
print(outcome, round(time.monotonic() - t0, 3))
"""


def probe(cluster: Cluster, host: str, address: str, port: int, timeout: float = 2.0):
    """Connect from ``host`` to ``address:port``: ("ok" | "refused" | "timeout" |
    "error:ERRNO", seconds it took)."""
    done = cluster.run_on(
        host, [cluster.python, "-c", PROBE, address, str(port), str(timeout)], timeout=60
    )
    assert done.returncode == 0, done.stderr
    outcome, seconds = done.stdout.split()
    return outcome, float(seconds)


def test_hosts_reach_each_other_and_nothing_outside(cluster):
    head, w1, w2 = cluster.head, cluster.hosts[0], cluster.hosts[1]
    assert cluster.master_url == f"spark://{cluster.address(head)}:7077"
    for host in (cluster.head, *cluster.hosts):
        assert cluster.address(host).startswith("198.18.")
    assert probe(cluster, w1, cluster.address(head), 7077)[0] == "ok"  # the master
    assert probe(cluster, w1, cluster.address(w2), WEB_UI)[0] == "ok"
    assert probe(cluster, head, cluster.address(w1), WEB_UI)[0] == "ok"

    # No default route on a host: only its own /24 on the bridge.
    routes = cluster.run_on(w1, ["ip", "-4", "route"]).stdout
    assert "default" not in routes and routes.strip().startswith("198.18.0.0/24"), routes

    # A service of the machine's own (root) namespace on loopback is not reachable from
    # a host: its 127.0.0.1 is its own.
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert probe(cluster, w1, "127.0.0.1", port)[0] == "refused"
    # Nor is anything beyond the bridge: the machine's outside address has no route.
    outside = subprocess.run(
        ["ip", "-4", "-o", "route", "get", "192.0.2.1"], capture_output=True, text=True
    ).stdout
    src = outside.split(" src ")[1].split()[0] if " src " in outside else "192.0.2.1"
    outcome, _ = probe(cluster, w1, src, 22, timeout=2.0)
    assert outcome == "error:ENETUNREACH", outcome


def test_a_partitioned_host_drops_packets_without_reset_and_heal_restores_it(cluster):
    w1, w2 = cluster.hosts[0], cluster.hosts[1]
    target = cluster.address(w2)
    assert probe(cluster, w1, target, WEB_UI)[0] == "ok"  # also leaves w2 in w1's ARP cache

    cluster.partition(w2)
    assert "down" in next(line for line in cluster.status().splitlines() if line.startswith(w2))
    outcome, seconds = probe(cluster, w1, target, WEB_UI, timeout=1.5)
    # Packets vanish: no RST, so the connect hangs until its timeout — not "refused".
    assert outcome == "timeout", outcome
    assert seconds >= 1.4
    # The partitioned host cannot reach out either.
    assert probe(cluster, w2, cluster.address(w1), WEB_UI, timeout=1.5)[0] != "ok"

    cluster.heal(w2)
    deadline = time.monotonic() + 10
    while (outcome := probe(cluster, w1, target, WEB_UI)[0]) != "ok":
        assert time.monotonic() < deadline, f"{w2} still unreachable after heal: {outcome}"
        time.sleep(0.2)


# One TCP connection from host A to host B: A sends SIZE bytes, B reads them all and sends
# SIZE bytes back; each side reports the seconds its receive took.
SERVER = """
import socket, sys, time
sock = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
conn, _ = sock.accept()
size, got, t0 = int(sys.argv[3]), 0, None
while got < size:
    chunk = conn.recv(1 << 16)
    if not chunk:
        break
    t0 = t0 or time.monotonic()
    got += len(chunk)
print("received", got, round(time.monotonic() - t0, 3), flush=True)
conn.sendall(b"x" * size)
conn.close()
"""
CLIENT = """
import socket, sys, time
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
size = int(sys.argv[3])
conn.sendall(b"x" * size)
got, t0 = 0, None
while got < size:
    chunk = conn.recv(1 << 16)
    if not chunk:
        break
    t0 = t0 or time.monotonic()
    got += len(chunk)
print("received", got, round(time.monotonic() - t0, 3), flush=True)
"""


def throughput(cluster: Cluster, src: str, dst: str, size: int) -> tuple[float, float]:
    """Bytes per second src → dst and dst → src over one TCP connection."""
    port = 9999
    server = cluster.popen_on(
        dst,
        [cluster.python, "-c", SERVER, cluster.address(dst), str(port), str(size)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout.readline().strip() == "listening"
        client = cluster.run_on(
            src,
            [cluster.python, "-c", CLIENT, cluster.address(dst), str(port), str(size)],
            timeout=120,
        )
        assert client.returncode == 0, client.stderr
        out, _ = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    _, got_there, there_s = out.split()
    _, got_back, back_s = client.stdout.split()
    assert int(got_there) == int(got_back) == size
    return size / max(float(there_s), 1e-3), size / max(float(back_s), 1e-3)


def test_a_slow_link_limits_throughput_both_ways(cluster):
    w1, w2 = cluster.hosts[0], cluster.hosts[1]
    fast_there, fast_back = throughput(cluster, w1, w2, 4_000_000)
    cluster.slow(w2, "8mbit")  # 1 MB/s
    assert "8Mbit" in next(line for line in cluster.status().splitlines() if line.startswith(w2))
    slow_there, slow_back = throughput(cluster, w1, w2, 1_500_000)
    # tbf lets a burst through at once (10 ms of the rate here), then holds the rate.
    assert slow_there < 1.3e6 and slow_back < 1.3e6, (slow_there, slow_back)
    assert fast_there > 5 * slow_there and fast_back > 5 * slow_back, (fast_there, fast_back)
    cluster.heal(w2)
    healed_there, _ = throughput(cluster, w1, w2, 4_000_000)
    assert healed_there > 5 * slow_there


def test_without_root_the_script_fails_saying_so(tmp_path):
    env = {**os.environ, "TANDEM_CLUSTER_DIR": str(tmp_path / "state")}
    script = SCRIPT
    # As root (CI), drop to nobody for this one command, which runs a world-readable copy
    # of the script: the checkout may be in a directory that only root may enter.
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    if os.geteuid() == 0:
        readable = Path(tempfile.mkdtemp(prefix="tandem-cluster-script-"))
        readable.chmod(0o755)
        script = readable / "scripts" / SCRIPT.name
        script.parent.mkdir(mode=0o755)
        shutil.copy(SCRIPT, script)
        script.chmod(0o644)
    done = subprocess.run(
        [*(nobody if os.geteuid() == 0 else []), "bash", str(script), "up", "1"],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )
    if script != SCRIPT:
        shutil.rmtree(script.parent.parent)
    assert done.returncode == 1
    assert "needs root" in done.stderr and "sudo" in done.stderr, done.stderr
    assert not (tmp_path / "state").exists()  # it started nothing, recorded nothing


def running(pid: int) -> bool:
    """Alive and not a zombie (a dead daemon's parent, init here, reaps it when it can)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.cluster
def test_a_second_cluster_cleans_up_after_a_crashed_run_and_runs_kafka(tmp_path):
    """Another prefix and state folder: a cluster beside the session's. `up` over the
    records of a run that never called `down` (a crashed test session) takes that one
    down first; `--services` runs ZooKeeper and Kafka on a host of their own, which the
    worker hosts reach; `down` leaves no process, namespace or link behind."""
    px = free_prefix("tx")
    first = Cluster(1, state_dir=tmp_path / "state", prefix=px).up()
    pids = [int(line.split()[2]) for line in (tmp_path / "state/run/pids").read_text().splitlines()]
    second = Cluster(1, state_dir=tmp_path / "state", prefix=px, services=True)
    try:
        second.up()  # no `first.down()`: as if the session that started it had died
        assert not [pid for pid in pids if running(pid)], "the stale run survived"
        assert second.services_host == f"{px}svc" and first.hosts == second.hosts == [f"{px}w1"]
        svc = second.address(f"{px}svc")
        code = (
            "from confluent_kafka.admin import AdminClient; "
            f"print(len(AdminClient({{'bootstrap.servers': '{svc}:19092'}})"
            ".list_topics(timeout=30).brokers))"
        )
        done = second.python_on(f"{px}w1", code)
        assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr
        assert probe(second, f"{px}w1", svc, 21810)[0] == "ok"  # ZooKeeper
        pids = [
            int(line.split()[2]) for line in (tmp_path / "state/run/pids").read_text().splitlines()
        ]
    finally:
        second.down()
    assert not [pid for pid in pids if running(pid)]
    left = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert not [
        line for line in left.splitlines() if f": {px}v-" in line or f": {px}br0" in line
    ], left
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [n for n in namespaces.split() if re.fullmatch(rf"{px}(head|svc|w\d+)", n)], (
        namespaces
    )
    with pytest.raises(ClusterError, match="no cluster is up"):
        second._script("crash", f"{px}w1")


# -- tandem on the cluster ------------------------------------------------------------------

RATE, KEYS = 1_000, 50


def input_file(tmp_path: Path, duration: float) -> Path:
    """RATE x duration rows ``(id, key)``, keys drawn at random: the job's input."""
    n = int(RATE * duration)
    keys = np.random.default_rng(7).integers(0, KEYS, size=n)
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"id": np.arange(n, dtype=np.int64), "key": keys}), path)
    return path


def check_output(result: dict, output: pa.Table, rows: pa.Table) -> None:
    """The sink's rows against what the input alone implies: every input row exactly
    once, and per key the running counts 1..n where n is how often the key occurs."""
    assert result["rows"] == output.num_rows == rows.num_rows
    ids = output.column("id").to_pylist()
    assert sorted(ids) == rows.column("id").to_pylist()  # each row once: none lost, none twice
    expected = collections.Counter(rows.column("key").to_pylist())
    counts = collections.defaultdict(list)
    keys, running = output.column("key").to_pylist(), output.column("count").to_pylist()
    for key, count in zip(keys, running, strict=True):
        counts[key].append(count)
    assert {k: sorted(v) for k, v in counts.items()} == {
        k: list(range(1, n + 1)) for k, n in expected.items()
    }


def start_job(
    cluster: Cluster, tmp_path: Path, tag: str, duration: float, restore: bool, *extra: str
):
    """The driver on the head host, as a user runs it there: a subprocess in its namespace
    (``extra``: more of ``cluster_job.py``'s arguments)."""
    path = input_file(tmp_path, duration)
    out = tmp_path / tag
    argv = [cluster.python, str(JOB), "--input", str(path), "--out", str(out), "--tag", tag]
    argv += ["--rate", str(RATE), "--duration", str(duration), *extra]
    if restore:
        argv.append("--restore")
    log = open(tmp_path / f"{tag}.driver.log", "w")  # noqa: SIM115 (closed by finish_job)
    proc = cluster.popen_on(cluster.head, argv, stdout=log, stderr=subprocess.STDOUT)
    return proc, log, path, out


def finish_job(proc, log, path: Path, out: Path, timeout: float) -> tuple[dict, pa.Table]:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(
            f"the driver did not finish within {timeout:.0f} s; log: {log.name}"
        ) from None
    finally:
        log.close()
    driver_log = Path(log.name).read_text()
    assert proc.returncode == 0, f"the driver failed:\n{driver_log[-6000:]}"
    result = json.loads((out / "result.json").read_text())
    print(f"driver: {json.dumps(result)}", file=sys.stderr)
    return result, pq.read_table(out / "output.parquet")


def spread(result: dict, cluster: Cluster) -> dict[str, str]:
    """Replica → host as the registry saw it; the twins of every partition on two hosts."""
    hosts = {rid: cluster.host_of(node) for rid, node in result["hosts"].items()}
    assert set(hosts.values()) <= set(cluster.hosts), hosts  # executors run on worker hosts only
    for name in ("count[0]", "count[1]"):
        assert hosts[f"{name}/0"] != hosts[f"{name}/1"], f"the twins of {name} share a host"
    return hosts


def test_a_keyed_count_on_the_standalone_cluster(cluster, tmp_path):
    duration = 4.0
    proc, log, path, out = start_job(cluster, tmp_path, "nofault", duration, restore=True)
    result, output = finish_job(proc, log, path, out, timeout=240)

    assert result["lost"] == 0 and result["duplicates"] == 0
    assert result["digests_match"], result["determinism_errors"]
    assert result["lost_replicas"] == []
    check_output(result, output, pq.read_table(path))
    hosts = spread(result, cluster)
    # What the replicas printed to their executors' logs agrees with the registry.
    seen = placed(cluster, "nofault")
    assert {k: v for k, v in seen.items() if k.startswith("count")} == {
        k: v for k, v in hosts.items() if k.startswith("count")
    }


def _fault_a_replica_host(
    cluster, tmp_path, tag: str, fault, duration: float = 8.0, *extra: str, victim=None
):
    """Run the keyed count, and once its replicas run, ``fault`` (a harness method) the
    host of sink replica 0 — the job's single point of failure while sinks were not
    replicated — and of a replica group with it (``victim``: a function of what runs
    where that names another host): the result, how long after the fault ``job.run``
    returned, the replicas restored, those lost and those that ran on the victim."""
    proc, log, path, out = start_job(cluster, tmp_path, tag, duration, True, *extra)
    wanted = {"count[0]/0", "count[0]/1", "count[1]/0", "count[1]/1", "sink[0]/0", "sink[0]/1"}
    deadline = time.monotonic() + 180
    while not wanted <= set(where := placed(cluster, tag)):
        assert proc.poll() is None, (
            f"the driver exited early:\n{Path(log.name).read_text()[-4000:]}"
        )
        assert time.monotonic() < deadline, f"replicas not placed after 180 s: {where}"
        time.sleep(0.2)
    assert where["sink[0]/1"] != where["sink[0]/0"], f"the sink's replicas share a host: {where}"
    time.sleep(3.0)  # the replicas open about a second before t0: the fault comes mid-run
    victim = where["sink[0]/0"] if victim is None else victim(where)
    faulted_at = time.time()  # the hosts share this machine's clock
    fault(victim)
    result, output = finish_job(proc, log, path, out, timeout=duration + 120)
    ended_after = result["returned_at"] - faulted_at  # job.run returned, before spark.stop()
    assert result["lost"] == 0 and result["duplicates"] == 0
    assert result["digests_match"], result["determinism_errors"]
    check_output(result, output, pq.read_table(path))
    hosts = spread(result, cluster)
    # Lost: exactly the replicas the registry had on the victim, and nothing else; their
    # twins on other hosts carried every partition.
    gone = {f"{r['task']}[{r['partition']}]/{r['replica']}" for r in result["lost_replicas"]}
    first = {rid: cluster.host_of(node) for rid, node in result["first_hosts"].items()}
    on_victim = {rid for rid, host in first.items() if host == victim}
    print(
        f"{tag} of {victim} ({sorted(gone)}): job ended {ended_after:.1f} s later, "
        f"longest gap {result['max_gap_ms']} ms, restored {len(result['restored_replicas'])}",
        file=sys.stderr,
    )
    restored = {
        f"{r['task']}[{r['partition']}]/{r['replica']}" for r in result["restored_replicas"]
    }
    assert not any(hosts[rid] == victim for rid in restored), hosts  # rebuilt elsewhere
    result["faulted_s"] = faulted_at - result["t0"]
    return result, ended_after, restored, gone, on_victim


def test_a_crashed_replica_host_is_masked(cluster, tmp_path):
    """Every process of a host running one replica group and a replica of the sink
    SIGKILLed mid-run: their twins carry the partitions and the sink's twin the output —
    nothing lost, nothing twice — the group's replicas are rebuilt on another host (r
    restored; the sink's copy too if there is time), and the job ends with its result."""
    duration = 12.0  # room for the rebuild: a Spark job started on another host
    result, ended_after, restored, gone, on_victim = _fault_a_replica_host(
        cluster, tmp_path, "crash", cluster.crash, duration
    )
    assert gone == on_victim, result["lost_replicas"]
    assert {r["cause"] for r in result["lost_replicas"]} == {"crashed"}
    assert "sink[0]/0" in gone
    # r restored on another host: the operators' replicas, and the Collect sink's copy
    # (rebuilt from its twin's) unless the stream ended first
    operators = {r for r in on_victim if not r.startswith("sink")}
    assert operators <= restored <= on_victim, restored
    assert ended_after < duration + 10, f"the job ended {ended_after:.1f} s after the crash"


def test_a_replica_host_cut_off_is_declared_lost_and_the_job_ends(cluster, tmp_path):
    """The link of a host running one replica group taken down mid-run (no reset: its
    packets vanish) and never healed during the run: the job, not Spark, decides it is
    lost — its keepalives stop, or its upstream replicas drop it as a straggler — fences
    it, rebuilds its replicas on another host (a Spark job of its own: no retry comes for
    a task Spark still thinks runs), and ends with its result within its duration and
    10 s, never waiting for Spark's executor timeout; nothing lost or repeated."""
    duration = 14.0  # room for the rebuild: a Spark job started on another host
    result, ended_after, restored, gone, on_victim = _fault_a_replica_host(
        cluster, tmp_path, "partition", cluster.partition, duration
    )
    assert gone == on_victim, result["lost_replicas"]
    # r restored on another host (a sink replica is not rebuilt: its twin has the output)
    assert restored == {r for r in on_victim if not r.startswith("sink")}, restored
    causes = {r["cause"] for r in result["lost_replicas"] if r["task"] != "sink"}
    assert causes <= {"silent", "evicted"}, result["lost_replicas"]
    # The sink's copy there is never suspected (not rebuilt, it would be gone for good):
    # once the twin's copy has ended, the silent one is a straggler.
    assert {r["cause"] for r in result["lost_replicas"] if r["task"] == "sink"} == {"late"}
    # Its rows came from the twins: the longest gap is about failure_timeout_ms at most.
    assert result["max_gap_ms"] < 2000 + 1000, result["max_gap_ms"]
    assert ended_after < duration + 10, f"the job ended {ended_after:.1f} s after the cut"
    after = result["returned_at"] - result["t0"] - duration
    assert after < 10, f"job.run returned {after:.1f} s after the stream's end"


def test_a_kafka_sink_owner_host_cut_off_is_handed_over_and_writes_every_row_once(
    cluster, tmp_path
):
    """A Kafka sink beside the Collect sink, on the services host's Kafka, r = 2: replica
    0 of its partition writes, replica 1 stands by. The owner's host is cut off mid-run
    (no reset) for good. A silent owner stops every reader's output, so its worker is
    declared lost on silence like an operator's, and the twin on another host takes
    over: it fences the lost writer's transactional id, reads where its last transaction
    stood and writes on with the rows it held. An outside read_committed consumer reads
    every row exactly once, and the output pauses for about the failure timeout."""
    duration = 14.0
    svc = cluster.address(cluster.services_host)
    result, ended_after, restored, gone, on_victim = _fault_a_replica_host(
        cluster, tmp_path, "kafka", cluster.partition, duration, "--kafka-sink", svc
    )
    assert gone == on_victim, result["lost_replicas"]
    sinks = {r["cause"] for r in result["lost_replicas"] if r["task"] in ("sink", "kafka")}
    assert sinks == {"silent"}, result["lost_replicas"]  # not "late": the owner was handed over
    handed = [(h["task"], h["partition"], h["from"], h["to"]) for h in result["sink_handovers"]]
    assert handed == [("kafka", 0, 0, 1)], result["sink_handovers"]
    # (The operators' rebuild elsewhere, ~10 s on this machine, may come after the stream's
    # end: the cut-off test above covers it.)
    assert restored <= {r for r in on_victim if r.startswith(("source", "count"))}, restored
    written = pq.read_table(tmp_path / "kafka" / "kafka.parquet")
    check_output({"rows": written.num_rows}, written, pq.read_table(tmp_path / "rows.parquet"))
    stamps = sorted(written.column("produced_ms").to_pylist())
    cut_ms = (result["t0"] + result["faulted_s"]) * 1000
    assert stamps[0] < cut_ms < stamps[-1]
    gap = max(later - t for t, later in itertools.pairwise(stamps))
    print(f"kafka owner cut off: longest output pause {gap} ms", file=sys.stderr)
    assert gap < 2000 + 3000, f"the output paused {gap} ms"  # silence, then the takeover
    assert ended_after < duration + 10, f"the job ended {ended_after:.1f} s after the cut"


def cut_then_heal(cluster: Cluster, after_s: float, timers: list[threading.Timer]):
    """A fault that cuts a host off and heals it ``after_s`` seconds later (the timer goes
    to ``timers``: join them once the job is done)."""

    def fault(host: str) -> None:
        cluster.partition(host)
        timer = threading.Timer(after_s, cluster.heal, [host])
        timer.start()
        timers.append(timer)

    return fault


def test_a_host_cut_off_for_10_s_and_healed_mid_run_changes_nothing_it_was_fenced_from(
    cluster, tmp_path
):
    """The cut-off host's link comes back 10 s later, while the job still runs: by then
    its replicas were declared lost, fenced and rebuilt on another host. Healed, its
    stale worker tasks find their peers again — their connections were never reset, and
    what they had queued arrives late — yet nothing they send counts twice (their rows
    are their twins' rows, deduplicated by position), nothing waits for them, and the job
    ends on time with every row once."""
    duration = 22.0  # cut at ~3 s, healed at ~13 s: the job runs on for ~9 s after
    healer: list[threading.Timer] = []
    try:
        result, _, restored, gone, on_victim = _fault_a_replica_host(
            cluster, tmp_path, "healed", cut_then_heal(cluster, 10.0, healer), duration
        )
    finally:
        for timer in healer:
            timer.join()
    operators = {r for r in on_victim if not r.startswith("sink")}
    assert operators <= gone <= on_victim, result["lost_replicas"]
    assert restored == operators, restored
    causes = {r["cause"] for r in result["lost_replicas"] if r["task"] != "sink"}
    assert causes <= {"silent", "evicted"}, result["lost_replicas"]
    # The sink's copy there is never suspected: healed, it is fed again (its upstream
    # links were never reset) and may end with every row — or, dropped meanwhile by every
    # upstream replica of a partition as a straggler, it stops starved once healed, or
    # never ends and is discarded once its twin's copy has. Either way one complete copy
    # is published (checked above).
    sink_causes = {r["cause"] for r in result["lost_replicas"] if r["task"] == "sink"}
    assert sink_causes <= {"late", "starved"}, result["lost_replicas"]
    assert result["max_gap_ms"] < 2000 + 1000, result["max_gap_ms"]
    after = result["returned_at"] - result["t0"] - duration
    assert after < 10, f"job.run returned {after:.1f} s after the stream's end"


@pytest.mark.parametrize("fault", ["kill", "pause"])
def test_faults_reach_workers_on_a_cluster_whose_executors_the_driver_cannot_signal(
    cluster, tmp_path, fault
):
    """``td.Kill`` and ``td.Pause`` through the engine on the standalone cluster, whose
    executors run in other namespaces: the driver cannot signal them, so the worker is
    told to SIGKILL itself, or to freeze itself for 30 s — then it is declared lost
    (silent, or dropped as a straggler), fenced without being killed, and rebuilt on
    another host; when it thaws it reads its Exit and leaves. Masked either way, r
    restored, and the run does not wait for the frozen task."""
    duration = 12.0
    proc, log, path, out = start_job(
        cluster, tmp_path, fault, duration, True, "--fault", fault, "--fault-at", "2.0"
    )
    result, output = finish_job(proc, log, path, out, timeout=duration + 120)
    assert result["lost"] == 0 and result["duplicates"] == 0
    assert result["digests_match"], result["determinism_errors"]
    check_output(result, output, pq.read_table(path))
    (record,) = result["faults"]
    assert record["kind"] == fault and record["replica"] == 1, record
    lost = {(r["task"], r["partition"], r["replica"]) for r in result["lost_replicas"]}
    restored = {(r["task"], r["partition"], r["replica"]) for r in result["restored_replicas"]}
    # Every operator replica lost is rebuilt. A sink copy may be lost besides, if its
    # upstream dropped it as a straggler while its twin kept up (a busy machine): such a
    # copy is not rebuilt, and the twin's is published.
    operators = {r for r in lost if r[0] != "sink"}
    assert ("count", 0, 1) in lost and restored == operators, (lost, restored)
    assert len(lost - operators) <= 1, lost
    causes = {r["cause"] for r in result["lost_replicas"] if r["task"] != "sink"}
    assert causes == {"killed"} if fault == "kill" else causes <= {"silent", "evicted"}
    # The run ends within its duration and 10 s of t0, not after the frozen task's 30 s.
    after = result["returned_at"] - result["t0"] - duration
    assert after < 10, f"job.run returned {after:.1f} s after the stream's end"
    print(
        f"{fault}: gap {result['max_gap_ms']} ms, ended {after:.1f} s after the stream",
        file=sys.stderr,
    )


def test_a_throttled_replica_host_is_hedged_by_its_twins(cluster, tmp_path):
    """One replica host's link throttled to 2 mbit/s both ways mid-run (`tc tbf`): its
    twins' output keeps the job's latency. Its upstream replicas drop links that lag, but
    a replica is declared lost only once every live upstream replica has dropped it, so
    the slow host's senders never take a healthy receiver down (they did: a slow sender
    dropped the healthy replicas it fed, the job fenced those, and its latency went to
    seconds). Nothing lost or repeated."""
    duration = 12.0
    result, _, restored, gone, on_victim = _fault_a_replica_host(
        cluster, tmp_path, "slow", lambda host: cluster.slow(host, "2mbit"), duration
    )
    assert gone <= on_victim, result["lost_replicas"]  # never a healthy host's replica
    assert restored <= gone, result["restored_replicas"]
    causes = {r["cause"] for r in result["lost_replicas"]}
    # "starved": the slow host's sink copy, once every replica of a count partition
    # dropped it (it can never be whole; its twin has the output).
    assert causes <= {"silent", "evicted", "late", "starved"}, result["lost_replicas"]
    assert result["p99_ms"] < 200, result["p99_ms"]  # not the seconds of a run waiting on it
    assert result["max_gap_ms"] < 1000, result["max_gap_ms"]
    print(f"slow: p50/p99 {result['p50_ms']}/{result['p99_ms']} ms", file=sys.stderr)


LEADER = """
import sys
from kazoo.client import KazooClient
zk = KazooClient(hosts=sys.argv[1] + ":21810", timeout=5.0)
zk.start(timeout=10)
base = "/tandem/cluster-" + sys.argv[2]
(run,) = zk.get_children(base)
# count is the job's task 1 (source, count, sink); its partition 0's election queue
print(zk.Lock(f"{base}/{run}/1/0").contenders()[0])
zk.stop()
"""


def kazoo_leader(cluster: Cluster, tag: str) -> int:
    """The replica leading KaZoo partition count[0] of run ``tag`` now, as ZooKeeper says
    (asked from the head: the services host is reachable from the cluster's hosts only)."""
    svc = cluster.address(cluster.services_host)
    done = cluster.run_on(cluster.head, [cluster.python, "-c", LEADER, svc, tag], timeout=60)
    assert done.returncode == 0, done.stderr
    task, partition, replica, _pid = done.stdout.strip().split(":")
    assert (task, partition) == ("1", "0"), done.stdout
    return int(replica)


def test_kazoo_a_leader_host_cut_off_is_replaced_and_its_late_orders_fenced(cluster, tmp_path):
    """KaZoo across hosts, ZooKeeper and Kafka on a host of their own: the host of
    count[0]'s leader is cut off mid-run (no reset) and healed 6 s later. Its ZooKeeper
    session expires, so the twin on another host leads with a higher epoch within about
    one session timeout and orders from the log's end; the old leader stopped ordering
    when its session went in doubt, and whatever it still gets into the order log once
    healed is ignored by epoch. Its replicas are declared lost, fenced and rebuilt;
    nothing lost or repeated, and the job ends on time."""
    # cut at ~3 s, lost at ~5 s; the rebuild, a Spark job on the third host, takes ~10 s
    # on this two-core machine running every host, and up to ~18 s while the rest of the
    # suite loads it (its first Python task there starts a Python worker and imports)
    duration, session_s = 28.0, 1.0
    svc = cluster.address(cluster.services_host)
    leader: list[int] = []
    healer: list[threading.Timer] = []

    def leader_host(where: dict[str, str]) -> str:
        leader.append(kazoo_leader(cluster, "kazoo"))
        return where[f"count[0]/{leader[0]}"]

    try:
        result, ended_after, restored, gone, on_victim = _fault_a_replica_host(
            cluster,
            tmp_path,
            "kazoo",
            cut_then_heal(cluster, 6.0, healer),
            duration,
            "--kazoo",
            svc,
            "--session-timeout",
            str(session_s),
            victim=leader_host,
        )
    finally:
        for timer in healer:
            timer.join()
    old = leader[0]
    assert f"count[0]/{old}" in gone, result["lost_replicas"]
    operators = {r for r in on_victim if not r.startswith("sink")}
    assert operators <= gone <= on_victim and restored == operators, result["lost_replicas"]
    # The old leader's report went with its fenced worker (its term is known from what
    # it announced as it won): a twin's term follows it, with a higher epoch, about a
    # session timeout after the cut (the session's expiry, then the election).
    terms = result["leaders"]["count[0]"]
    after = [t for t in terms if t["from_s"] > result["faulted_s"]]
    assert after and after[0]["replica"] != old and after[0]["epoch"] > 1, terms
    took = after[0]["from_s"] - result["faulted_s"]
    assert took < session_s + 3.0, f"a new leader took {took:.2f} s after the cut: {terms}"
    # Nothing waited for the cut-off leader beyond that: the output's longest gap.
    assert result["max_gap_ms"] < (session_s + 3.0) * 1000, result["max_gap_ms"]
    assert ended_after < duration + 10, f"the job ended {ended_after:.1f} s after the cut"
    # What the deposed leader still got into the log once healed was ignored by epoch.
    assert all(f["epoch"] < f["current"] for f in result["fenced"]), result["fenced"]
    print(
        f"kazoo: leader count[0]/{old} cut off at {result['faulted_s']:.2f} s; next leader "
        f"after {took:.2f} s; longest gap {result['max_gap_ms']} ms; "
        f"late orders fenced: {len(result['fenced'])}; sessions expired: "
        f"{result['sessions_expired']}",
        file=sys.stderr,
    )


def test_the_demo_masks_its_kill_on_the_standalone_cluster(cluster, tmp_path):
    """`tandem demo --engine spark --master spark://...` as a user runs it on a cluster's
    head: its replica is killed on whatever host runs it (the worker is told to SIGKILL
    itself: the driver cannot signal another host's process) and the fault is masked."""
    argv = [str(Path(cluster.python).with_name("tandem")), "demo", "--engine", "spark"]
    argv += ["--master", cluster.master_url, "--duration", "8", "--rate", "2000"]
    argv += ["--json", str(tmp_path / "demo.json"), "--plot", "none", "--no-progress"]
    done = cluster.run_on(cluster.head, argv, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "fault masked." in done.stdout, done.stdout
    result = json.loads((tmp_path / "demo.json").read_text())
    assert result["lost"] == 0 and result["duplicates"] == 0 and result["digests_match"]
    (fault,) = result["faults"]
    assert fault["task"] == "count" and fault["kind"] == "kill", fault
    assert {r["cause"] for r in result["lost_replicas"]} == {"killed"}, result["lost_replicas"]
    assert not list(tmp_path.glob("none*")) and not (tmp_path / "out").exists()  # --plot none
