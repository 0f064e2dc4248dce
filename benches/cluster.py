"""The keyed count of the cluster tests across hosts, r = 1 beside r = 2, through each
host-level fault: one invocation, a Markdown table and JSON.

A Spark standalone cluster on network-namespace hosts (``scripts/cluster.sh``, root
needed): a master on the head, ``--hosts`` Workers. The job is ``tests/cluster_job.py``
(a Parquet file of ``(id, key)`` rows released at 1,000 a second, a running count per key in 2
partitions, a ``Collect`` sink), its driver on the head host. Each case runs it for
``--duration`` seconds; a fault comes ``--fault-at`` seconds after every replica has
opened, on the host of ``sink[0]`` replica 0 (the job's single point of failure while
sinks were unreplicated; at r = 1 the host of everything but the driver's side):

* ``none`` — no fault;
* ``crash`` — every process on that host SIGKILLed;
* ``partition`` — its link down, no reset, never healed during the run;
* ``healed`` — the same, healed 10 s later while the job runs on;
* ``k2:none`` / ``k2:partition`` — KaZoo at r = 2 (ZooKeeper and Kafka on a services host
  of their own), the fault on the host of ``count[0]``'s leader;
* ``slow`` — its link throttled to ``--slow`` (2 mbit/s) both ways (``tc tbf``). At
  1,000 rows/s 2 mbit/s still carries the job (r = 1 too keeps its latency, only its
  end waits for the result to cross the link); ``--slow 256kbit`` does not, and there
  r = 1 never finishes while r = 2 keeps its no-fault p99.

Each row: rows out, lost / duplicates against the input alone (every id once, per key the
running counts 1..n), p50 / p99 / max latency at the sink, the longest output gap, how
long after the fault the job returned, the replicas lost and rebuilt, and the CPU-seconds
the worker processes used (``Result.workers_cpu_s``: what each said in its last keepalive
or its ``Done``; Spark's JVMs not counted), beside r = 1's for the same fault. A case that failed
(r = 1 loses its only copy in a crash or a partition) says how.

    sudo python benches/cluster.py --json out/cluster.json          # every case, ~12 min
    sudo python benches/cluster.py --cases r1:none,r1:slow,r2:none,r2:slow
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from cluster_harness import Cluster, free_prefix, placed  # noqa: E402
from test_cluster import check_output, kazoo_leader, start_job  # noqa: E402

CASES = [f"r{r}:{f}" for r in (1, 2) for f in ("none", "crash", "partition", "healed", "slow")]
CASES += ["k2:none", "k2:partition"]  # KaZoo at r = 2, ZooKeeper and Kafka on their own host


def run_case(
    cluster: Cluster, work: Path, case: str, duration: float, fault_at: float, slow: str
) -> dict:
    replication, fault = case.split(":")
    r, kazoo = int(replication[1:]), replication.startswith("k")
    tag = case.replace(":", "-")
    folder = work / tag
    folder.mkdir(parents=True, exist_ok=True)
    row: dict = {
        "case": case,
        "replication": r,
        "ordering": "kazoo" if kazoo else "liverobin",
        "fault": fault,
    }
    timers: list[threading.Timer] = []
    extra = ["--replication", str(r)]
    if kazoo:
        extra += ["--kazoo", cluster.address(cluster.services_host)]
    proc, log, path, out = start_job(cluster, folder, tag, duration, r > 1, *extra)
    with log:
        wanted = {f"count[{p}]/{i}" for p in (0, 1) for i in range(r)} | {
            f"sink[0]/{i}" for i in range(r)
        }
        deadline = time.monotonic() + 180
        while not wanted <= set(where := placed(cluster, tag)):
            if proc.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        victim = where.get("sink[0]/0")
        faulted_at = None
        if fault != "none" and victim is not None and proc.poll() is None:
            time.sleep(fault_at)
            if kazoo:  # the host of count[0]'s leader
                victim = where[f"count[0]/{kazoo_leader(cluster, tag)}"]
            faulted_at = time.time()
            if fault == "crash":
                cluster.crash(victim)
            elif fault == "partition":
                cluster.partition(victim)
            elif fault == "healed":
                cluster.partition(victim)
                timers.append(threading.Timer(10.0, cluster.heal, [victim]))
                timers[-1].start()
            elif fault == "slow":
                cluster.slow(victim, slow)
        row["victim"] = victim
        try:
            proc.wait(timeout=duration + 150)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            row["error"] = f"the driver did not finish within {duration + 150:.0f} s"
        for timer in timers:
            timer.join()
    if "error" not in row and proc.returncode != 0:
        error = (out / "error.txt").read_text() if (out / "error.txt").exists() else ""
        last = [line for line in error.splitlines() if line.strip()][-1:] or ["(no error.txt)"]
        row["error"] = last[0][:300]
    if "error" not in row:
        result = json.loads((out / "result.json").read_text())
        try:
            check_output(result, pq.read_table(out / "output.parquet"), pq.read_table(path))
            row["checked"] = True
        except AssertionError as exc:
            row["checked"] = False
            row["check_error"] = str(exc)[:300]
        row |= {
            k: result.get(k)
            for k in (
                "rows",
                "lost",
                "duplicates",
                "p50_ms",
                "p99_ms",
                "max_ms",
                "max_gap_ms",
                "cpu_s",
            )
        }
        row["replicas_lost"] = len(result["lost_replicas"])
        row["replicas_rebuilt"] = len(result["restored_replicas"])
        if faulted_at is not None:
            row["ended_after_fault_s"] = round(result["returned_at"] - faulted_at, 1)
    cluster.restore()
    return row


def fmt(v, digits: int = 1) -> str:
    if v is None:
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def table(rows: list[dict]) -> str:
    base = {r["fault"]: r for r in rows if r["replication"] == 2 and r["ordering"] != "kazoo"}
    single = {r["fault"]: r for r in rows if r["replication"] == 1}
    lines = [
        "| case | rows | lost / dup | p50 / p99 / max ms | p99 x r2 same fault | longest gap ms "
        "| ended after fault | replicas lost / rebuilt | workers' CPU s | CPU x r1 same fault |",
        "|---|---:|---|---|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | failed: {r['error']} |||||||||")
            continue
        twin = base.get(r["fault"], {}).get("p99_ms")
        ratio = f"{r['p99_ms'] / twin:.2f}x" if twin and r.get("p99_ms") else "-"
        one = single.get(r["fault"], {}).get("cpu_s")
        cpu = f"{r['cpu_s'] / one:.2f}x" if one and r.get("cpu_s") else "-"
        lines.append(
            f"| {r['case']} | {r['rows']} | {r['lost']} / {r['duplicates']}"
            f"{'' if r.get('checked') else ' (check failed)'} "
            f"| {fmt(r['p50_ms'])} / {fmt(r['p99_ms'])} / {fmt(r['max_ms'])} | {ratio} "
            f"| {fmt(r['max_gap_ms'], 0)} | {fmt(r.get('ended_after_fault_s'))} s "
            f"| {r['replicas_lost']} / {r['replicas_rebuilt']} | {fmt(r.get('cpu_s'))} | {cpu} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated rN:fault")
    ap.add_argument("--hosts", type=int, default=3, help="worker hosts")
    ap.add_argument("--duration", type=float, default=22.0, help="seconds of input per case")
    ap.add_argument("--fault-at", type=float, default=3.0, help="seconds after placement")
    ap.add_argument("--slow", default="2mbit", help="the throttled link's rate (tc syntax)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    for c in cases:
        if c not in CASES:
            ap.error(f"unknown case {c!r}; the cases are {', '.join(CASES)}")
    cluster = Cluster(
        args.hosts, prefix=free_prefix("tb"), services=any(c.startswith("k") for c in cases)
    )
    cluster.up()
    print(f"cluster {cluster.prefix}: {cluster.master_url}, up in {cluster.up_seconds:.1f} s")
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="tandem-cluster-bench-") as work:
            for case in cases:
                print(f"{case} ...", flush=True)
                row = run_case(cluster, Path(work), case, args.duration, args.fault_at, args.slow)
                print(f"  {json.dumps(row)}", flush=True)
                rows.append(row)
    finally:
        cluster.down()
    print()
    print(table(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
