"""A/B: the same workloads on two installations of tandem, interleaved, in one run.

Compares a baseline build (e.g. the previous release's wheel in its own virtualenv) with a
candidate (this checkout) on the demo job and MiB1 of length 3, each at r = 1 and r = 2,
with no fault. Runs alternate baseline / candidate so that both see the same machine, and
each workload is repeated ``--repeat`` times; the report gives medians and the candidate's
ratio to the baseline.

CPU-seconds are exact: ``getrusage(RUSAGE_CHILDREN)`` around each run's interpreter, which
reaps its replica processes, so the figure covers every process of the run (start-up
included, the coordinator's reference check excluded by running with ``check=False``).

    python benches/ab.py --baseline /path/to/old-venv/bin/python \\
        --candidate .venv/bin/python --rate 5000 --duration 12 --warmup 4 --repeat 3 \\
        --json out/ab.json

Only the public API both builds share is used (the demo job's ``build`` and MiB1's
``mib1_job``, in ``tandem.experiments`` or, in a build from before it, ``tandem.demo`` and
``tandem.bench``; ``Job.run``), so any two builds since the Spark engine landed can be
compared.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

RUN = r"""
import json, sys, tandem as td
try:
    from tandem.experiments.demo import build
    from tandem.experiments.workloads import mib1_job
except ImportError:  # a build from before tandem.experiments
    from tandem.bench import mib1_job
    from tandem.demo import build
workload, r, rate = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
duration, warmup = float(sys.argv[4]), float(sys.argv[5])
if workload == "demo":
    job = build(rate=rate, replication=r)
else:
    job = mib1_job(3, replication=r, ordering="liverobin", rate=rate)
res = job.run(duration=duration, progress=False, warmup=warmup, check=False)
print(json.dumps({"p50_ms": res.p50_ms, "p99_ms": res.p99_ms, "events": res.events_in,
                  "digests_match": res.digests_match, "profile": td.build_profile}))
"""


def run_once(python: str, workload: str, r: int, args) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.monotonic()
    out = subprocess.run(
        [python, "-c", RUN, workload, str(r), str(args.rate), str(args.duration), str(args.warmup)],
        check=True,
        capture_output=True,
        text=True,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    if row.pop("profile") != "release":
        sys.exit(f"{python} does not run a release build of tandem; never benchmark a debug build")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    row["cpu_s"] = cpu
    row["cpu_s_per_m_events"] = cpu / row["events"] * 1e6
    row["wall_s"] = time.monotonic() - t
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="python of the baseline installation")
    p.add_argument("--candidate", default=sys.executable, help="python of the candidate")
    p.add_argument("--rate", type=int, default=5000)
    p.add_argument("--duration", type=float, default=12.0)
    p.add_argument("--warmup", type=float, default=4.0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--workloads", default="demo,mib1")
    p.add_argument("--replication", default="1,2")
    p.add_argument("--json", help="write every run and the summary here")
    args = p.parse_args(argv)
    builds = {"baseline": args.baseline, "candidate": args.candidate}
    runs: list[dict] = []
    for workload in args.workloads.split(","):
        for r in (int(x) for x in args.replication.split(",")):
            for i in range(args.repeat):
                for name, python in builds.items():
                    print(f"{workload} r={r} {name} run {i + 1}/{args.repeat} ...", file=sys.stderr)
                    row = run_once(python, workload, r, args)
                    runs.append({"workload": workload, "r": r, "build": name, **row})
    summary = []
    print("| workload | r | build | p50 ms | p99 ms | CPU-s / M events | vs baseline p50/p99/CPU |")
    print("|---|---:|---|---:|---:|---:|---|")
    for workload in args.workloads.split(","):
        for r in (int(x) for x in args.replication.split(",")):
            med = {}
            for name in builds:
                rows = [
                    x for x in runs if (x["workload"], x["r"], x["build"]) == (workload, r, name)
                ]
                med[name] = {
                    k: statistics.median(x[k] for x in rows)
                    for k in ("p50_ms", "p99_ms", "cpu_s_per_m_events")
                }
            for name in builds:
                m, b = med[name], med["baseline"]
                ratio = " / ".join(
                    f"{m[k] / b[k]:.2f}x" for k in ("p50_ms", "p99_ms", "cpu_s_per_m_events")
                )
                print(
                    f"| {workload} | {r} | {name} | {m['p50_ms']:.1f} | {m['p99_ms']:.1f} | "
                    f"{m['cpu_s_per_m_events']:,.0f} | {ratio if name == 'candidate' else '-'} |"
                )
                summary.append({"workload": workload, "r": r, "build": name, **m})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "runs": runs, "summary": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
