"""A showcase of tandem's replication core on real processes and real TCP.

Topology (every box is its own OS process, every arrow a TCP connection on 127.0.0.1)::

    source p0 replica 0 ──┐        ┌──> merge replica 0 (LiveRobin over p0, p1)
    source p0 replica 1 ──┼─ x4 ───┤
    source p1 replica 0 ──┤        └──> merge replica 1 (LiveRobin over p0, p1)
    source p1 replica 1 ──┘

Each source partition runs as two replicas that emit the same deterministic stream
(event ``j`` of partition ``p`` is released at ``t0 + j / rate_p``) with heartbeats at
deterministic positions on the same logical clock, so both replicas of a partition put
every row and heartbeat at the same sequence number. Every source replica sends to
both merge replicas (duplicate sending); each merge replica deduplicates (first copy wins)
and consumes the two partitions in LiveRobin order. Halfway through, one source replica is
SIGKILLed. The merge replicas must still see every event exactly once, in the same order.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field

import pyarrow as pa

from tandem import _core

JOB = "showcase"
SOURCE_TASK = 0
SCHEMA = pa.schema(
    [
        ("partition", pa.int64()),
        ("seq", pa.int64()),
        ("key", pa.int64()),
        ("release_ns", pa.int64()),
    ]
)


@dataclass(frozen=True)
class ShowcaseConfig:
    """Knobs of the showcase run (names follow DESIGN §5)."""

    rate: int = 5_000
    duration: float = 10.0
    heartbeat_ms: float = 10.0
    buffer_timeout_ms: float = 5.0
    batch_rows: int = 1024
    ordering: str = "liverobin"
    kill: bool = True
    partitions: int = 2
    replicas: int = 2


@dataclass
class ReplicaReport:
    """What one merge replica consumed."""

    replica: int
    rows: int
    duplicates: int
    missing: int
    order_digest: str
    p50_ms: float
    p99_ms: float
    max_ms: float
    max_gap_ms: float
    per_second_p99_ms: list[float] = field(default_factory=list)


def _source_events(partition: int, j0: int, j1: int, t0_ns: int, period_ns: int) -> pa.RecordBatch:
    """Events ``j0 .. j1-1`` of a source partition. Pure function of its arguments."""
    seqs = pa.array(range(j0, j1), pa.int64())
    n = j1 - j0
    keys = pa.array([(j * 7919 + partition) % 1000 for j in range(j0, j1)], pa.int64())
    release = pa.array([t0_ns + j * period_ns for j in range(j0, j1)], pa.int64())
    part = pa.array([partition] * n, pa.int64())
    return pa.RecordBatch.from_arrays([part, seqs, keys, release], schema=SCHEMA)


def _run_source(
    cfg: ShowcaseConfig, partition: int, replica: int, t0_ns: int, secret: bytes, addrs: list
) -> None:
    """One source replica: release events on the logical clock, heartbeats on the same clock."""
    out = _core.Outbox(
        JOB,
        secret,
        (SOURCE_TASK, partition, replica),
        [addrs],
        partitioner="forward",
        batch_rows=cfg.batch_rows,
        buffer_timeout_ms=cfg.buffer_timeout_ms,
    )
    period_ns = int(1e9 * cfg.partitions / cfg.rate)
    hb_ns = int(cfg.heartbeat_ms * 1e6)
    end_ns = t0_ns + int(cfg.duration * 1e9)
    total = (end_ns - t0_ns) // period_ns
    emitted = 0
    next_hb = 1
    while True:
        now = time.time_ns()
        # Events released by now, and heartbeats due by now, merged on the logical clock:
        # heartbeat k sits after every event released before t0 + k * hb.
        due = min(total, max(0, (now - t0_ns) // period_ns + 1))
        while True:
            hb_time = t0_ns + next_hb * hb_ns
            if hb_time > now or hb_time > end_ns:
                break
            before_hb = min(total, -(-(hb_time - t0_ns) // period_ns))
            if before_hb > emitted:
                out.emit(_source_events(partition, emitted, before_hb, t0_ns, period_ns))
                emitted = before_hb
            out.heartbeat(next_hb)
            next_hb += 1
        if due > emitted:
            out.emit(_source_events(partition, emitted, due, t0_ns, period_ns))
            emitted = due
        out.flush()
        if emitted >= total and t0_ns + next_hb * hb_ns > end_ns:
            break
        time.sleep(0.0005)
    out.end()
    out.close()


def _run_merge(cfg: ShowcaseConfig, replica: int, secret: bytes, ports, results) -> None:
    """One merge replica: dedup + ordering over the source partitions; reports what it saw."""
    inbox = _core.Inbox(
        JOB,
        secret,
        [(SOURCE_TASK, p) for p in range(cfg.partitions)],
        ordering=cfg.ordering,
        quantum_rows=cfg.batch_rows,
    )
    ports.put((replica, inbox.port))
    order = hashlib.blake2b(digest_size=16)
    partitions: list[pa.Array] = []
    seqs: list[pa.Array] = []
    latencies: list[pa.Array] = []
    recv: list[int] = []
    while True:
        d = inbox.next(timeout=30.0)
        if d is None:
            raise TimeoutError(f"merge replica {replica}: no input for 30 s")
        if d.kind == "end":
            break
        if d.kind != "data":
            continue
        now = time.time_ns()
        b = d.batch
        part, seq, release = b.column(0), b.column(1), b.column(3)
        order.update(part.to_numpy().tobytes())
        order.update(seq.to_numpy().tobytes())
        partitions.append(part)
        seqs.append(seq)
        latencies.append(pa.array((now - release.to_numpy()) / 1e6))
        recv.extend([now] * len(b))
    inbox.close()
    results.put(_report(cfg, replica, partitions, seqs, latencies, recv, order.hexdigest()))


def _report(cfg, replica, partitions, seqs, latencies, recv, digest) -> ReplicaReport:
    import numpy as np

    part = np.concatenate([a.to_numpy() for a in partitions]) if partitions else np.zeros(0)
    seq = np.concatenate([a.to_numpy() for a in seqs]) if seqs else np.zeros(0)
    lat = np.concatenate([a.to_numpy() for a in latencies]) if latencies else np.zeros(0)
    ids = part * (1 << 40) + seq
    unique = np.unique(ids)
    period_ns = int(1e9 * cfg.partitions / cfg.rate)
    expected = cfg.partitions * (int(cfg.duration * 1e9) // period_ns)
    recv_s = (np.asarray(recv) - recv[0]) / 1e9 if recv else np.zeros(0)
    per_sec = [
        float(np.percentile(lat[(recv_s >= s) & (recv_s < s + 1)], 99))
        for s in range(int(np.ceil(recv_s.max())) if len(recv_s) else 0)
        if np.any((recv_s >= s) & (recv_s < s + 1))
    ]
    gaps = np.diff(np.unique(np.asarray(recv))) / 1e6 if len(recv) > 1 else np.zeros(1)
    return ReplicaReport(
        replica=replica,
        rows=len(ids),
        duplicates=len(ids) - len(unique),
        missing=expected - len(unique),
        order_digest=digest,
        p50_ms=float(np.percentile(lat, 50)) if len(lat) else float("nan"),
        p99_ms=float(np.percentile(lat, 99)) if len(lat) else float("nan"),
        max_ms=float(lat.max()) if len(lat) else float("nan"),
        max_gap_ms=float(gaps.max()) if len(gaps) else 0.0,
        per_second_p99_ms=per_sec,
    )


def run(cfg: ShowcaseConfig, progress=sys.stderr) -> dict:
    """Run the showcase and return its summary (also what ``--json`` writes)."""
    if cfg.replicas < 1 or cfg.partitions < 1:
        raise _core.ConfigError(
            f"replicas and partitions must be >= 1 (got {cfg.replicas}, {cfg.partitions})"
        )
    ctx = mp.get_context("spawn")
    secret = os.urandom(32)
    ports, results = ctx.Queue(), ctx.Queue()
    procs: list = []
    try:
        merges = [
            ctx.Process(target=_run_merge, args=(cfg, r, secret, ports, results), daemon=True)
            for r in range(cfg.replicas)
        ]
        for p in merges:
            p.start()
        procs += merges
        addrs = dict(ports.get(timeout=30) for _ in merges)
        addr_list = [("127.0.0.1", addrs[r]) for r in range(cfg.replicas)]
        t0_ns = time.time_ns() + 1_500_000_000  # give every process time to connect
        sources = {}
        for p in range(cfg.partitions):
            for r in range(cfg.replicas):
                proc = ctx.Process(
                    target=_run_source,
                    args=(cfg, p, r, t0_ns, secret, addr_list),
                    daemon=True,
                )
                proc.start()
                sources[(p, r)] = proc
        procs += sources.values()
        killed = None
        kill_at = t0_ns + int(cfg.duration * 1e9 / 2)
        while any(p.is_alive() for p in sources.values()):
            now = time.time_ns()
            if cfg.kill and killed is None and cfg.replicas > 1 and now >= kill_at:
                victim = sources[(0, 0)]
                os.kill(victim.pid, signal.SIGKILL)
                killed = {
                    "task": "source",
                    "partition": 0,
                    "replica": 0,
                    "at_s": (now - t0_ns) / 1e9,
                }
            elapsed = max(0.0, (now - t0_ns) / 1e9)
            _progress(progress, min(elapsed, cfg.duration), cfg.duration, killed)
            time.sleep(0.2)
        _progress(progress, cfg.duration, cfg.duration, killed, done=True)
        reports = sorted((results.get(timeout=60) for _ in merges), key=lambda r: r.replica)
        for p in procs:
            p.join(timeout=10)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return {
        "config": asdict(cfg),
        "fault": killed,
        "replicas": [asdict(r) for r in reports],
        "digests_match": len({r.order_digest for r in reports}) == 1,
        "lost": max(r.missing for r in reports),
        "duplicates": max(r.duplicates for r in reports),
    }


def _progress(stream, elapsed: float, total: float, killed, done: bool = False) -> None:
    if stream is None:
        return
    width = 30
    filled = int(width * elapsed / total) if total else width
    note = f"  killed source p0/r0 at {killed['at_s']:.1f}s" if killed else ""
    stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {elapsed:5.1f}/{total:.0f}s{note}")
    if done:
        stream.write("\n")
    stream.flush()
