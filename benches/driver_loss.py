"""A lost driver, resumed: ``tandem run job.py`` SIGKILLed halfway through a bounded keyed
job with durable checkpoints, then ``tandem run job.py --resume`` — per checkpoint period,
a Markdown table and JSON.

The job: ``Synthetic(rate, keys=100, limit=rate * duration)`` in 2 partitions → a running
count per key (2 partitions) → ``Parquet``, r = 2, ``Job(checkpoint_ms=P,
checkpoint_dir=...)``. It is killed ``--kill-at`` seconds after it says it runs (the
process running it SIGKILLed: its workers go with it) and resumed at once.

Each row: the checkpoint period; the cut it resumed from (source time); the rows the lost
run had emitted after that cut, which the resumed run emits again (about rate * the time from
the checkpoint's manifest to the kill: the cut is a few ms before its manifest); the time
from the ``--resume`` command to its first output row (the release of the first row in
the parts it wrote: a row's ``event_time_ns`` is the wall clock it was released at, and it
reaches the sink milliseconds later); and whether the output directory holds every row
once (per key the running counts 1..n, and ``limit`` rows in all).

    python benches/driver_loss.py --json out/driver_loss.json        # 500, 1000, 2000 ms
    python benches/driver_loss.py --periods 1000 --rate 5000
"""

from __future__ import annotations

import argparse
import datetime
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from jobs import tandem_run  # noqa: E402

JOB = """
import tandem as td

job = td.Job("driver-loss", replication=2, checkpoint_ms={period}, checkpoint_dir={checkpoints!r})
events = job.source(
    td.sources.Synthetic(rate={rate}, keys=100, seed=5, limit={limit}), parallelism=2
)
events.key_by("key").process(td.CountPerKey(), parallelism=2, name="count").sink(
    td.sinks.Parquet({out!r}), parallelism=2
)
"""


def exact(out: Path, limit: int) -> bool:
    """Every row once: ``limit`` rows, and per key the running counts 1..n."""
    table = pq.read_table(out).to_pandas()
    if len(table) != limit:
        return False
    return all(
        sorted(rows["count"]) == list(range(1, len(rows) + 1)) for _, rows in table.groupby("key")
    )


def run_period(work: Path, period: int, rate: int, duration: float, kill_at: float) -> dict:
    folder = work / f"p{period}"
    folder.mkdir(parents=True)
    checkpoints, out = folder / "checkpoints", folder / "out"
    limit = int(rate * duration)
    script = JOB.format(
        period=period, checkpoints=str(checkpoints), rate=rate, limit=limit, out=str(out)
    )
    first = tandem_run(folder, script, "--no-progress")
    assert first.stdout is not None
    first.stdout.readline()  # "running job ... until stopped"
    time.sleep(kill_at)
    workers = psutil.Process(first.pid).children(recursive=True)
    first.send_signal(signal.SIGKILL)
    killed = time.time()
    first.communicate(timeout=30)
    psutil.wait_procs(workers, timeout=15)

    kept = sorted(p for p in checkpoints.glob("checkpoint-*") if (p / "manifest.json").exists())
    if not kept:
        return {"period_ms": period, "error": f"no checkpoint within {kill_at} s"}
    manifest = json.loads((kept[-1] / "manifest.json").read_text())
    cut_s = manifest["epoch"] * manifest["heartbeat_ms"] / 1000
    written = datetime.datetime.fromisoformat(manifest["created"]).timestamp()

    result_json = folder / "resumed.json"
    launched = time.time()
    second = tandem_run(folder, script, "--no-progress", "--resume", "--json", str(result_json))
    stdout, stderr = second.communicate(timeout=300)
    if second.returncode != 0 or "resuming job" not in stdout:
        return {
            "period_ms": period,
            "error": f"the resumed run failed ({second.returncode}): {stdout[-300:]}"
            f"{stderr[-500:]}",
        }
    result = json.loads(result_json.read_text())
    # The resumed run's parts start at the cut; the first row it emitted was released at
    # its event time (the wall clock), and reached the sink milliseconds later.
    epoch = manifest["epoch"]
    resumed = [p for p in out.glob("part-*.parquet") if int(p.stem.rsplit("-", 1)[1]) >= epoch]
    first_row = min(
        pq.read_table(p, columns=["event_time_ns"]).column(0).to_numpy().min()
        for p in resumed
        if pq.read_metadata(p).num_rows
    )
    return {
        "period_ms": period,
        "rate": rate,
        "rows": limit,
        "killed_at_s": kill_at,
        "cut_s": round(cut_s, 2),
        "reprocessed_rows": round(rate * max(0.0, killed - written)),
        "resume_to_first_output_s": round(first_row / 1e9 - launched, 2),
        "resumed_wall_s": round(time.time() - launched, 2),
        "resumed_rows_out": result["events_out"],
        "exact": exact(out, limit),
    }


def markdown(rows: list[dict]) -> str:
    head = (
        "| checkpoint every | cut resumed from | rows reprocessed (≈) | resume → first output "
        "| resumed run | every row once |\n|---:|---:|---:|---:|---:|:---:|\n"
    )
    lines = []
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['period_ms']} ms | {r['error']} | | | | |")
            continue
        lines.append(
            f"| {r['period_ms']} ms | {r['cut_s']} s | {r['reprocessed_rows']} "
            f"| {r['resume_to_first_output_s']} s | {r['resumed_wall_s']} s "
            f"| {'yes' if r['exact'] else 'NO'} |"
        )
    return head + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--periods", default="500,1000,2000", help="checkpoint_ms values")
    parser.add_argument("--rate", type=int, default=2000, help="rows per second")
    parser.add_argument("--duration", type=float, default=12.0, help="source time, s")
    parser.add_argument("--kill-at", type=float, default=6.0, help="wall seconds to the kill")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tandem-driver-loss-") as work:
        for period in (int(p) for p in args.periods.split(",")):
            row = run_period(Path(work), period, args.rate, args.duration, args.kill_at)
            print(json.dumps(row), flush=True)
            rows.append(row)
    print()
    print(markdown(rows))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r.get("exact") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
