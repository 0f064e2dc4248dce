"""What a sink's latency record costs: CPU per row, report bytes, peak memory of a run.

``record``: the sink's latency bookkeeping alone, per row, at several batch sizes (from
one-row batches at 5,000 ev/s to 1,024-row batches at 1,000,000 ev/s, on a fake clock),
``tandem.latency.LatencyRecorder`` beside the per-row arrays it replaced (a receive time
and a latency per row, concatenated and pickled at the end). Both include reading the
batch's ``event_time_ns`` column and pickling the result.

``run``: a real run of MiB1 length 1 at r = 2 (forward edges) into a sink that keeps
only a count, then the peak resident memory of the largest worker process and of the
coordinator (``getrusage``: exact peaks, not samples). It uses only the public API, so
it measures any build: run it once per checkout with ``PYTHONPATH`` pointing at each.

    python benches/sink_memory.py record
    python benches/sink_memory.py run --rate 1000000 --duration 10
"""

from __future__ import annotations

import argparse
import pickle
import resource
import time

import numpy as np
import pyarrow as pa

from tandem.testing import CountRows


def _arrays(batches, nows) -> int:
    recv, lat = [], []
    for now, b in zip(nows, batches, strict=True):
        ev = b.column("event_time_ns").to_numpy(zero_copy_only=False)
        recv.append(np.full(len(ev), now, dtype=np.int64))
        lat.append((now - ev) / 1e6)
    return len(pickle.dumps((np.concatenate(recv), np.concatenate(lat))))


def _histograms(batches, nows) -> int:
    from tandem.latency import LatencyRecorder

    rec = LatencyRecorder(0)
    for now, b in zip(nows, batches, strict=True):
        rec.record(now, b.column("event_time_ns").to_numpy(zero_copy_only=False))
    return len(pickle.dumps(rec.finish()))


def record() -> None:
    rng = np.random.default_rng(0)
    for rows, rate in [(1, 5_000), (12, 5_000), (100, 100_000), (1024, 1_000_000)]:
        n = 200_000 if rows == 1 else max(2_000, 2_000_000 // rows)
        step_ns = rows / rate * 1e9
        nows = [int(8e6 + i * step_ns) for i in range(n)]
        offsets = np.sort(rng.integers(0, 5_000_000, rows)).astype(np.int64)
        distinct = [
            pa.record_batch({"event_time_ns": pa.array(nows[i] - 8_000_000 + offsets)})
            for i in range(50)
        ]
        batches = [distinct[i % 50] for i in range(n)]
        for name, fn in (("per-row arrays", _arrays), ("histograms", _histograms)):
            best, size = float("inf"), 0
            for _ in range(3):
                t = time.perf_counter()
                size = fn(batches, nows)
                best = min(best, time.perf_counter() - t)
            print(
                f"{rows:5d} rows/batch, {rate:>9,} ev/s, {n * rows / rate:4.0f} s: {name:15s}"
                f"{best / (n * rows) * 1e9:8.1f} ns/row, report {size:>10,} B"
            )


def run(rate: int, duration: float) -> None:
    from tandem.experiments import workloads

    job = workloads.mib1_job(1, 2, "liverobin", rate, sink=CountRows(), keyed=False)
    res = job.run(duration=duration, warmup=1.0, progress=False, check=False)
    workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    coordinator = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"{rate:,} ev/s for {duration:g} s: {res.events_out:,} rows out of {res.events_in:,}; "
        f"p50 / p99 {res.p50_ms:.1f} / {res.p99_ms:.1f} ms; peak RSS: largest worker "
        f"{workers:.0f} MB, coordinator {coordinator:.0f} MB; sampled per worker "
        + ", ".join(f"{k} {v:.0f} MB" for k, v in res.rss_mb.items())
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["record", "run"])
    p.add_argument("--rate", type=int, default=1_000_000)
    p.add_argument("--duration", type=float, default=10.0)
    args = p.parse_args()
    if args.what == "record":
        record()
    else:
        run(args.rate, args.duration)


if __name__ == "__main__":
    main()
