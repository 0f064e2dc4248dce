"""``tandem bench recovery``: what a lost replica costs, in one invocation, on the local
engine.

* ``restore`` — restoring r (``Job(restore=True)``) against state size: a keyed task
  carrying 1, 10 and 100 MiB per partition (:func:`restore`), the replica
  group holding ``state[0]`` replica 0 SIGKILLed and rebuilt from its twins; per size the
  time to restore r, the per-second p99 before the kill and during the rebuild, lost and
  duplicates.
* ``savepoint`` — what a savepoint costs the running job, against state size: the same
  keyed task with 1, 10 and 100 MiB per partition, a savepoint written a third of the way
  in (:func:`savepoint`); per size the time to write it, the per-second p99 of the
  seconds around the cut against a run without a savepoint (same size, same run of the
  command), and the resumed run's time to its first output — under LiveRobin, and under
  KaZoo when ``--configs`` names it (its leaders hold their orders at the cut).
* ``fault`` — the paper's fault experiment as ``tandem bench paper`` runs it (its cases,
  runner and figure, :mod:`tandem.experiments.paper`): MiB1 of length 3, one replica of
  ``map2[0]`` SIGKILLed at half time, in ``passive`` (ours: one replica, checkpoints,
  rollback), ``liverobin`` and ``kazoo`` (leader, then follower killed), with ``r1``
  beside them without the fault; per row the downtime (the longest gap between two
  outputs), lost, duplicates and the peak per-second p99 after the kill.

Every row is checked against the reference executor; a row that lost or repeated a row,
whose replicas' digests differed, that did not run, or (``restore``) in which no replica
was rebuilt fails the run (:func:`failures`).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from dataclasses import asdict, dataclass, replace

import numpy as np
import pyarrow as pa

import tandem as td
from tandem.experiments import common, paper

EXPERIMENTS = ("restore", "savepoint", "driver", "rescale", "fault")
FAULT_CONFIGS = tuple(paper.FAULT_VARIANTS)
"""The configurations the fault experiment runs: r1 (no fault), passive, liverobin, kazoo."""


@dataclass(frozen=True)
class Settings:
    """The state sizes and run lengths of one invocation (:data:`FULL` or :data:`QUICK`);
    ``fault`` holds the fault experiment's (``tandem bench paper``'s settings)."""

    sizes: tuple[float, ...] = (1, 10, 100)
    rate: int = 5_000
    duration_s: float = 12.0
    kill_at_s: float = 4.0
    fault: paper.Settings = paper.FULL

    def with_flags(
        self,
        rate: int | None = None,
        duration_s: float | None = None,
        warmup_s: float | None = None,
        session_timeout_s: float | None = None,
    ) -> Settings:
        """These settings with what the command line gave: ``rate`` for every run,
        ``duration_s`` for every run (the restore kill at a third of it, at 4 s at the
        latest; the fault kill at half), ``warmup_s`` for the fault runs."""
        s, fault = self, self.fault
        if rate is not None:
            s, fault = replace(s, rate=rate), replace(fault, rate=rate)
        if duration_s is not None:
            s = replace(s, duration_s=duration_s, kill_at_s=min(4.0, duration_s / 3))
            fault = replace(fault, fault_duration_s=duration_s)
        if warmup_s is not None:
            fault = replace(fault, fault_warmup_s=warmup_s)
        if session_timeout_s is not None:
            fault = replace(fault, session_timeout_s=session_timeout_s)
        return replace(s, fault=fault)


FULL = Settings()
"""1, 10 and 100 MiB (12 s runs, kill at 4 s); the fault runs of ``tandem bench paper``
(30 s, kill at 15 s): about 5 minutes on 2 cores."""
QUICK = Settings(sizes=(1,), duration_s=6.0, kill_at_s=2.0, fault=paper.QUICK)
"""1 MiB only (6 s, kill at 2 s) and the fault runs of ``tandem bench paper --quick``
(3 s, kill at 1.5 s): for CI."""


# -- restore: restoring r (Job(restore=True)) against state size ------------------------


class Ballast(td.KeyedProcess):
    """Passes its rows on and carries ``mb`` MiB of state per partition (a byte array it
    touches once per batch): what a replica rebuilt from its twin must receive."""

    def __init__(self, mb: float) -> None:
        self.mb = mb

    def process(self, batch: pa.RecordBatch, state: dict) -> pa.RecordBatch:
        if "bytes" not in state:
            state["bytes"], state["batches"] = np.zeros(max(1, round(self.mb * 2**20)), np.uint8), 0
        ballast = state["bytes"]
        ballast[state["batches"] % len(ballast)] ^= 1
        state["batches"] += 1
        return batch

    def snapshot(self) -> bytes:
        st = self.state
        if "bytes" not in st:
            return b""
        return b"".join((st["batches"].to_bytes(8, "little"), st["bytes"].data))  # one copy

    def state_size(self) -> int:
        return 8 + self.state["bytes"].nbytes if "bytes" in self.state else 0

    def restore(self, data: bytes) -> None:
        self.state.clear()
        if data:
            self.state["batches"] = int.from_bytes(data[:8], "little")
            self.state["bytes"] = np.frombuffer(data, np.uint8, offset=8).copy()  # one copy


@dataclass
class RecoveryRow:
    """One run of :func:`restore`: a replica group holding ``state_mb`` MiB per stateful
    partition is killed at ``kill_at_s`` and rebuilt from its twins. ``restore_ms``: from
    the kill to the rebuilt replicas receiving their input (process start, cuts, state
    transfer, replay); ``p99_before_ms``: median per-second p99 before the kill;
    ``p99_during_ms``: the worst per-second p99 from the kill's second until 2 s after the
    rebuild, and ``during_vs_before`` their ratio; ``rebuilt``: replicas restored."""

    state_mb: float
    rate: int
    kill_at_s: float
    restore_ms: float | None
    rebuilt: int
    p99_before_ms: float
    p99_during_ms: float
    during_vs_before: float
    max_gap_ms: float | None
    lost: int
    duplicates: int
    digests_match: bool
    per_second_p99_ms: list


def recovery_job(state_mb: float, rate: int) -> td.Job:
    job = td.Job("recovery", replication=2, restore=True)
    events = job.source(td.sources.Synthetic(rate=rate, keys=1_000, seed=5), parallelism=2)
    (
        events.key_by("key")
        .process(Ballast(state_mb), parallelism=2, name="state")
        .sink(td.sinks.Collect())
    )
    return job


def restore(
    sizes=(1, 10, 100),
    rate: int = 5_000,
    duration: float = 12.0,
    kill_at: float = 4.0,
    log=None,
) -> list[RecoveryRow]:
    """Kill the replica group holding ``state[0]`` replica 0 at ``kill_at`` and rebuild it
    from its twins (``Job(restore=True)``), once per state size; every run is checked
    against the reference executor."""
    log = log or sys.stderr  # at call time: sys.stderr may have been replaced
    rows = []
    for mb in sizes:
        print(f"recovery: {mb:g} MiB of state per partition ...", file=log, flush=True)
        res = recovery_job(mb, rate).run(
            duration=duration, faults=[td.Kill("state", 0, 0, at=kill_at)], progress=False
        )
        series = res.per_second_p99_ms
        restored = [r for r in res.restored_replicas if r["lost_s"] >= kill_at - 0.5]
        back = max((r["restored_s"] for r in restored), default=kill_at)
        before = [v for v in series[1 : int(kill_at)] if v is not None]
        during = [v for v in series[int(kill_at) : int(back) + 3] if v is not None]
        calm = float(np.median(before)) if before else float("nan")
        worst = max(during) if during else float("nan")
        rows.append(
            RecoveryRow(
                mb,
                rate,
                kill_at,
                max((r["restore_ms"] for r in restored), default=None),
                len(restored),
                round(calm, 1),
                round(worst, 1),
                round(worst / calm, 2) if calm > 0 else float("nan"),
                res.max_gap_ms,
                res.lost,
                res.duplicates,
                res.digests_match,
                [None if v is None else round(v, 1) for v in series],
            )
        )
    return rows


# -- savepoint: what a savepoint of the running job costs, against state size -------------


@dataclass
class SavepointRow:
    """One size of :func:`savepoint`: a run of ``state_mb`` MiB per stateful partition with
    a savepoint asked for at ``at_s``, beside a run without one. ``write_ms``: from the
    request to the savepoint written (cut at ``cut_s`` of source time; ``state_mb_written``
    in its state files); ``p99_without_ms``/``p99_with_ms``: the worst per-second p99 of
    the seconds from the request to a second after the cut, in the run without and the
    run with the savepoint, and ``ratio`` the second over the first; ``resume_load_ms``:
    reading and checking the savepoint and building the resumed plan;
    ``resume_first_output_ms``: the resumed run, from its engine's start to its first
    output row; ``resumed_rows``: the rows it delivered, and ``rows_exact`` whether those
    are exactly the rows after the cut (the run with the savepoint's, less those before
    it); ``lost``/``duplicates``: of the run with the savepoint, against the reference."""

    state_mb: float
    rate: int
    at_s: float
    cut_s: float
    write_ms: float
    state_mb_written: float
    p99_without_ms: float
    p99_with_ms: float
    ratio: float
    resume_load_ms: float
    resume_first_output_ms: float | None
    resumed_rows: int
    rows_exact: bool
    lost: int | None
    duplicates: int | None
    digests_match: bool
    ordering: str = "liverobin"
    """The configuration (:func:`savepoint_orderings`): ``liverobin`` or ``kazoo`` at r = 2
    (under ``kazoo`` the leaders hold their orders at the cut's heartbeat until every
    input is ordered through it), or ``r1``, a single replica, whose cut no twin masks."""


def savepoint_orderings(configs) -> tuple[str, ...]:
    """The configurations the savepoint experiment runs under: those of ``configs`` that
    order a replicated job, and ``r1`` (LiveRobin when none is named)."""
    return tuple(c for c in ("r1", "liverobin", "kazoo") if c in configs) or ("liverobin",)


def savepoint_job(
    state_mb: float, rate: int, ordering: str = "liverobin", kazoo: td.KazooConfig | None = None
) -> td.Job:
    """The savepoint experiment's job; ``ordering`` ``r1``: one replica of each task."""
    r1 = ordering == "r1"
    job = td.Job(
        "savepoint",
        replication=1 if r1 else 2,
        ordering="liverobin" if r1 else ordering,
        kazoo=kazoo,
    )
    events = job.source(td.sources.Synthetic(rate=rate, keys=1_000, seed=5), parallelism=2)
    (
        events.key_by("key")
        .process(Ballast(state_mb), parallelism=2, name="state")
        .sink(td.sinks.Collect())
    )
    return job


def _worst(series: list, lo: float, hi: float) -> float:
    values = [v for v in series[int(lo) : int(hi) + 1] if v is not None]
    return max(values) if values else float("nan")


def savepoint(
    sizes=(1, 10, 100),
    rate: int = 5_000,
    duration: float = 12.0,
    at: float = 4.0,
    log=None,
    orderings=("liverobin",),
    kazoo: td.KazooConfig | None = None,
) -> list[SavepointRow]:
    """Per ordering and state size: a run without a savepoint, a run with one asked for at
    ``at`` seconds of source time (the job going on to ``duration``), and that savepoint
    resumed to ``duration``; every run of the first two is checked against the reference."""
    import tempfile

    from tandem import savepoints
    from tandem.engines.common import STARTUP_S

    log = log or sys.stderr
    rows = []
    for ordering, mb in itertools.product(orderings, sizes):
        print(f"savepoint: {mb:g} MiB of state per partition, {ordering} ...", file=log, flush=True)
        zoo = kazoo if ordering == "kazoo" else None

        def job(ordering=ordering, mb=mb, zoo=zoo) -> td.Job:
            return savepoint_job(mb, rate, ordering, zoo)

        without = job().run(duration=duration, progress=False)
        with tempfile.TemporaryDirectory(prefix="tandem-bench-savepoint-") as folder:
            path = os.path.join(folder, "sp")
            handle = job().start(duration=duration, progress=False)
            time.sleep(STARTUP_S + at)  # about ``at`` of source time: a guess, the cut says
            asked = time.monotonic()
            sp = handle.savepoint(path, timeout=120)
            write_ms = (time.monotonic() - asked) * 1000
            with_sp = handle.result()
            written = sum(p.get("bytes", 0) for p in sp.partitions) / 2**20
            t = time.monotonic()
            savepoints.resume(path, job().plan())
            load_ms = (time.monotonic() - t) * 1000
            resumed = job().run(duration=duration, from_savepoint=path, progress=False)
        cut = sp.source_time_s
        emitted = sum(p["rows"] for parts in sp.sources.values() for p in parts)
        lo, hi = cut - write_ms / 1000, cut + 1
        base = _worst(without.per_second_p99_ms, lo, hi)
        worst = _worst(with_sp.per_second_p99_ms, lo, hi)
        first = resumed.first_output_s
        rows.append(
            SavepointRow(
                mb,
                rate,
                at,
                round(cut, 2),
                round(write_ms, 1),
                round(written, 1),
                round(base, 1),
                round(worst, 1),
                round(worst / base, 2) if base > 0 else float("nan"),
                round(load_ms, 1),
                None if first is None else round(first * 1000, 1),
                resumed.events_out,
                resumed.events_out == with_sp.events_out - emitted,
                with_sp.lost,
                with_sp.duplicates,
                with_sp.digests_match and resumed.digests_match,
                ordering,
            )
        )
    return rows


# -- rescale: a keyed task rescaled while the job runs (RunningJob.rescale) ---------------


@dataclass
class RescaleRow:
    """:func:`rescale_live`: a run whose keyed task goes from ``was`` to ``now`` partitions
    at about ``at_s`` of source time (the switch at ``switch_s``), beside the same run
    without a rescale. ``switch_ms``: the longest a worker spent on the switch (the old
    partitions cut, their states split, the new ones started); ``ask_ms``: from the
    request to the switch done; ``gap_without_ms``/``gap_with_ms``: the sink's longest gap
    between two outputs in each run; ``p99_without_ms``/``p99_with_ms``: the worst
    per-second p99 from a second before the switch to a second after, and ``ratio`` the
    second over the first; ``settled_without_ms``/``settled_with_ms``/``settled_ratio``:
    the same from two seconds after the switch to two before the end — what the new
    partitions cost once running, on this machine's cores, apart from the switch;
    ``cpu_without_s``/``cpu_with_s``: each run's CPU-seconds;
    ``lost``/``duplicates``/``digests_match``: of the rescaled run, against the reference,
    which replays the rescale."""

    rate: int
    was: int
    now: int
    at_s: float
    switch_s: float
    heartbeat_ms: float
    switch_ms: float
    ask_ms: float
    gap_without_ms: float | None
    gap_with_ms: float | None
    p99_without_ms: float
    p99_with_ms: float
    ratio: float
    settled_without_ms: float
    settled_with_ms: float
    settled_ratio: float
    cpu_without_s: float | None
    cpu_with_s: float | None
    lost: int | None
    duplicates: int | None
    digests_match: bool


def rescale_job(rate: int, name: str = "rescale") -> td.Job:
    job = td.Job(name, replication=2)
    events = job.source(td.sources.Synthetic(rate=rate, keys=1_000, seed=5), parallelism=2)
    (
        events.key_by("key")
        .process(td.CountPerKey(), parallelism=2, name="count")
        .sink(td.sinks.Collect())
    )
    return job


def rescale_live(
    rate: int = 5_000,
    duration: float = 12.0,
    at: float = 4.0,
    now: int = 4,
    log=None,
) -> RescaleRow:
    """A run of :func:`rescale_job` without a rescale, then one rescaled to ``now``
    partitions at about ``at`` seconds of source time, both to ``duration`` and checked
    against the reference."""
    from tandem.engines.common import STARTUP_S

    log = log or sys.stderr
    print(f"rescale: 2 -> {now} partitions at {rate:,} ev/s ...", file=log, flush=True)
    without = rescale_job(rate).start(duration=duration, progress=False).wait(duration + 120)
    handle = rescale_job(rate).start(duration=duration, progress=False)
    time.sleep(STARTUP_S + at)
    asked = time.monotonic()
    record = handle.rescale("count", now, timeout=60)
    ask_ms = (time.monotonic() - asked) * 1000
    with_rs = handle.wait(duration + 120)
    switch = record["switch_s"]
    base = _worst(without.per_second_p99_ms, switch - 1, switch + 1)
    worst = _worst(with_rs.per_second_p99_ms, switch - 1, switch + 1)
    settled = (switch + 2, max(switch + 2, duration - 2))
    settled_base = _worst(without.per_second_p99_ms, *settled)
    settled_worst = _worst(with_rs.per_second_p99_ms, *settled)
    return RescaleRow(
        rate,
        record["from"],
        record["to"],
        at,
        round(switch, 2),
        rescale_job(rate).plan().heartbeat_ms,
        round(record["switch_ms"], 2),
        round(ask_ms, 0),
        without.max_gap_ms,
        with_rs.max_gap_ms,
        round(base, 1),
        round(worst, 1),
        round(worst / base, 2) if base > 0 else float("nan"),
        round(settled_base, 1),
        round(settled_worst, 1),
        round(settled_worst / settled_base, 2) if settled_base > 0 else float("nan"),
        None if without.cpu_s is None else round(without.cpu_s, 1),
        None if with_rs.cpu_s is None else round(with_rs.cpu_s, 1),
        with_rs.lost,
        with_rs.duplicates,
        with_rs.digests_match,
    )


def rescale_table(row: RescaleRow) -> list[str]:
    """The rescale row as the lines of a Markdown section."""
    cell = paper._cell
    return _section(
        "A keyed task rescaled while the job runs",
        f"{row.rate:,} ev/s, r = 2, Synthetic → keyed count → Collect; "
        f'`RunningJob.rescale("count", {row.now})` from {row.was} partitions at about '
        f"{row.at_s:g} s of source time, beside the same run without it. switch: the "
        "longest a worker spent on it (old partitions cut at the heartbeat, their states "
        "split by key group, new partitions started); asked → done: the call's wait, most "
        f"of it the lead to the switch's heartbeat. Heartbeat period {row.heartbeat_ms:g} ms. "
        "p99: the worst per-second p99 from a second before the switch to a second after; "
        "settled: the same from two seconds after it to two before the end, what twice the "
        "partitions cost on this machine once the switch is over. CPU: each run's "
        "CPU-seconds, without → with.",
        "| switch at | switch ms | asked → done ms | longest gap without | with "
        "| p99 without | p99 with | ratio | settled ratio | CPU s | lost | dup | digests |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        [
            [
                f"{row.switch_s:g} s",
                cell(row.switch_ms, 1),
                cell(row.ask_ms, 0),
                cell(row.gap_without_ms, 0),
                cell(row.gap_with_ms, 0),
                cell(row.p99_without_ms),
                cell(row.p99_with_ms),
                cell(row.ratio, 2, "x"),
                cell(row.settled_ratio, 2, "x"),
                f"{cell(row.cpu_without_s, 1)} → {cell(row.cpu_with_s, 1)}",
                cell(row.lost),
                cell(row.duplicates),
                "match" if row.digests_match else "DIFFER",
            ]
        ],
    )


# -- driver: the process running the job SIGKILLed, then --resume ------------------------


@dataclass
class DriverRow:
    """:func:`driver`: `tandem run job.py` (durable checkpoints every ``checkpoint_ms``)
    SIGKILLed at ``killed_s`` of source time and at once `tandem run job.py --resume`, as
    a supervisor restarts a lost driver. ``cut_s``: the checkpoint it resumed from;
    ``rows_before_cut``: the input rows the sources had emitted there;
    ``rows_reprocessed``: those the lost run had emitted after it, emitted again;
    ``downtime_ms``: from the kill to the resumed run's first output row;
    ``resume_to_output_ms``: from the resume command to that row (the process's start,
    reading the checkpoint, the workers' start); ``resumed_wall_s``: the resumed run's
    command, start to exit. ``rows_out``: rows in the Parquet output of both runs,
    ``duplicates``/``lost`` against the input, and ``counts_exact`` whether every key's
    counts there are 1..n (the state went on across the loss)."""

    rate: int
    rows: int
    checkpoint_ms: float
    killed_s: float
    cut_s: float
    rows_before_cut: int
    rows_reprocessed: int
    downtime_ms: float | None
    resume_to_output_ms: float | None
    resumed_wall_s: float
    rows_out: int
    lost: int
    duplicates: int
    counts_exact: bool


DRIVER_JOB = """\
import tandem as td

job = td.Job("driver-loss", replication=2, checkpoint_ms={period}, checkpoint_dir={checkpoints!r})
events = job.source(
    td.sources.Synthetic(rate={rate}, limit={rows}, keys=1_000, seed=5), name="source"
)
events.key_by("key").process(td.CountPerKey(), parallelism=2, name="count").sink(
    td.sinks.Parquet({out!r}), parallelism=2
)
"""


def driver(
    rate: int = 5_000,
    duration: float = 12.0,
    kill_at: float = 4.0,
    checkpoint_ms: float = 1_000,
    log=None,
) -> DriverRow:
    """The driver-loss experiment (see :class:`DriverRow`): ``duration`` seconds of input
    at ``rate``, the driver SIGKILLed half a checkpoint period after its first checkpoint
    at ``kill_at`` s of source time or later."""
    import json
    import signal
    import subprocess
    import tempfile

    import pyarrow.parquet as pq

    from tandem import savepoints

    log = log or sys.stderr
    rows = int(rate * duration)
    print(f"driver: {rows:,} rows at {rate:,} ev/s, killed after {kill_at:g} s ...", file=log)
    with tempfile.TemporaryDirectory(prefix="tandem-bench-driver-") as folder:
        checkpoints, out = os.path.join(folder, "checkpoints"), os.path.join(folder, "out")
        script = os.path.join(folder, "job.py")
        with open(script, "w") as f:
            f.write(
                DRIVER_JOB.format(
                    period=checkpoint_ms, checkpoints=checkpoints, rate=rate, rows=rows, out=out
                )
            )
        command = [sys.executable, "-m", "tandem.cli", "run", script, "--no-progress"]
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE, "cwd": folder}
        first = subprocess.Popen(command, **quiet)
        try:
            deadline = time.monotonic() + 60 + duration
            while True:
                newest = savepoints.latest_checkpoint(checkpoints, "driver-loss")
                if newest is not None and newest.source_time_s >= kill_at:
                    break
                if first.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"bench recovery driver: no checkpoint past {kill_at:g} s: "
                        + first.communicate()[1][-2000:]
                    )
                time.sleep(0.02)
            time.sleep(checkpoint_ms / 2000)  # the kill half a period after the checkpoint
            killed_ns = time.time_ns()
            first.send_signal(signal.SIGKILL)
            first.communicate(timeout=30)
        finally:
            if first.poll() is None:
                first.kill()
                first.communicate()
        # The newest complete checkpoint: where --resume starts (the lost run wrote the
        # manifests, so none completes after the kill).
        cut = savepoints.latest_checkpoint(checkpoints, "driver-loss")
        # At once, as a supervisor would: the lost run's workers exit as they find it gone.
        result_file = os.path.join(folder, "resumed.json")
        started_ns = time.time_ns()
        resumed = subprocess.run(
            [*command, "--resume", "--json", result_file], timeout=120 + duration, **quiet
        )
        resumed_wall = (time.time_ns() - started_ns) / 1e9
        if resumed.returncode != 0:
            raise RuntimeError(f"bench recovery driver: --resume failed: {resumed.stderr[-2000:]}")
        with open(result_file) as f:
            result = json.load(f)
        output = pq.read_table(out).to_pandas()
    lost_t0 = cut.runs[-1]
    killed_s = (killed_ns - lost_t0) / 1e9
    before = sum(p["rows"] for p in cut.sources["source"])
    at_kill = min(rows, int(killed_s * rate) + 1)  # Synthetic: row i is due at i / rate
    firsts = result.get("first_output_unix_ns")
    seqs = output["source_seq"]
    counts_exact = all(
        sorted(group["count"]) == list(range(1, len(group) + 1))
        for _, group in output.groupby("key")
    )
    return DriverRow(
        rate,
        rows,
        checkpoint_ms,
        round(killed_s, 2),
        round(cut.source_time_s, 2),
        before,
        max(0, at_kill - before),
        None if firsts is None else round((firsts - killed_ns) / 1e6, 0),
        None if firsts is None else round((firsts - started_ns) / 1e6, 0),
        round(resumed_wall, 2),
        len(output),
        rows - seqs.nunique(),
        len(seqs) - seqs.nunique(),
        counts_exact,
    )


def driver_table(row: DriverRow) -> list[str]:
    """The driver row as the lines of a Markdown section."""
    cell = paper._cell
    return _section(
        "The driver lost: SIGKILL, then `tandem run --resume`",
        f"{row.rows:,} rows at {row.rate:,} ev/s, r = 2, Synthetic → keyed count (2 "
        f"partitions) → Parquet; durable checkpoints every {row.checkpoint_ms:g} ms. `tandem "
        "run job.py` SIGKILLed, then at once `tandem run job.py --resume`, as a supervisor "
        "would. Downtime: from the kill to the resumed run's first output row; resume → "
        "output: from the resume command to that row. Structured Streaming's driver kill "
        "is in `tandem bench paper --experiments fault` (at-least-once there).",
        "| killed at | cut at | rows before the cut | rows reprocessed | downtime ms "
        "| resume → output ms | resumed run s | rows out | lost | dup | counts 1..n |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        [
            [
                f"{row.killed_s:g} s",
                f"{row.cut_s:g} s",
                f"{row.rows_before_cut:,}",
                f"{row.rows_reprocessed:,}",
                cell(row.downtime_ms, 0),
                cell(row.resume_to_output_ms, 0),
                cell(row.resumed_wall_s, 1),
                f"{row.rows_out:,}",
                cell(row.lost),
                cell(row.duplicates),
                "yes" if row.counts_exact else "NO",
            ]
        ],
    )


def savepoint_table(rows: list[SavepointRow]) -> list[str]:
    """The savepoint rows as the lines of a Markdown section."""
    r0 = rows[0]
    cell = paper._cell
    return _section(
        "A savepoint of the running job against state size",
        f"{r0.rate:,} ev/s, r = 2 (r = 1 in the r1 rows), a keyed task of 2 partitions; a "
        "savepoint asked for at "
        f"about {r0.at_s:g} s of source time while the job runs, beside a run without one. "
        "p99: the worst per-second p99 from the request to a second after the cut, "
        "without and with the savepoint; resume: loading the savepoint (read, checked, the "
        "plan built) and the resumed run's first output from its engine's start.",
        "| configuration | state per partition | written | write ms | p99 without | p99 with "
        "| ratio | resume load ms | first output ms | resumed rows exact | lost | dup "
        "| digests |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|",
        [
            [
                r.ordering,
                f"{r.state_mb:g} MiB",
                f"{r.state_mb_written:.1f} MiB",
                cell(r.write_ms, 0),
                cell(r.p99_without_ms),
                cell(r.p99_with_ms),
                cell(r.ratio, 2, "x"),
                cell(r.resume_load_ms, 0),
                cell(r.resume_first_output_ms, 0),
                "yes" if r.rows_exact else "NO",
                cell(r.lost),
                cell(r.duplicates),
                "match" if r.digests_match else "DIFFER",
            ]
            for r in rows
        ],
    )


def _section(title: str, intro: str, header: str, align: str, rows: list[list[str]]) -> list[str]:
    """A Markdown section: its title, a paragraph, and a table of ``rows``."""
    return [
        f"### {title}",
        "",
        intro,
        "",
        header,
        align,
        *("| " + " | ".join(cells) + " |" for cells in rows),
    ]


# -- the invocation ----------------------------------------------------------------------


def check_selection(experiments, configs) -> None:
    """Raise ConfigError for an unknown or empty selection, before anything runs."""
    known = (EXPERIMENTS, FAULT_CONFIGS)
    paper.check_selection(experiments, configs, known, "bench recovery")


def fault_cases(settings: Settings, configs) -> list[paper.Case]:
    """The fault experiment's runs in ``configs``, as ``tandem bench paper`` has them."""
    return paper.cases(settings.fault, ["fault"], configs)


def estimate_s(settings: Settings, experiments, configs) -> float:
    """A guess of the invocation's wall time on 2 cores."""
    total = 0.0
    if "restore" in experiments:
        total += len(settings.sizes) * (settings.duration_s + paper.OVERHEAD_S + 2)
    if "savepoint" in experiments:
        runs = len(settings.sizes) * len(savepoint_orderings(configs)) * 3
        total += runs * (settings.duration_s + paper.OVERHEAD_S + 1)
    if "driver" in experiments:
        total += settings.duration_s + 2 * paper.OVERHEAD_S + 4
    if "rescale" in experiments:
        total += 2 * (settings.duration_s + paper.OVERHEAD_S)
    if "fault" in experiments:
        total += sum(paper.estimate_s(c) for c in fault_cases(settings, configs))
    return total


def failures(
    restore_rows: list[RecoveryRow],
    fault_rows: list[paper.Row],
    savepoint_rows: list[SavepointRow] = (),
    driver_row: DriverRow | None = None,
    rescale_row: RescaleRow | None = None,
) -> list[str]:
    """What makes the run fail: a rescale row that lost or repeated rows or whose digests
    differed; a restore row that lost or repeated rows, whose digests
    differed or in which nothing was rebuilt; a savepoint row that lost or repeated rows,
    whose digests differed or whose resumed run did not deliver exactly the rows after
    the cut; a driver row that lost or repeated rows or whose counts did not go on; a
    fault row that failed as :func:`tandem.paper.failures` says. Never timings."""
    out = []
    if rescale_row is not None:
        if rescale_row.lost or rescale_row.duplicates:
            out.append(f"rescale: lost {rescale_row.lost}, duplicates {rescale_row.duplicates}")
        if not rescale_row.digests_match:
            out.append("rescale: the replicas' output digests differed")
    if driver_row is not None:
        if driver_row.lost or driver_row.duplicates:
            out.append(f"driver: lost {driver_row.lost}, duplicates {driver_row.duplicates}")
        if not driver_row.counts_exact:
            out.append("driver: a key's counts in the output are not 1..n")
    for r in savepoint_rows:
        where = f"savepoint {r.state_mb:g} MiB"
        if r.lost or r.duplicates:
            out.append(f"{where}: lost {r.lost}, duplicates {r.duplicates}")
        if not r.digests_match:
            out.append(f"{where}: the replicas' output digests differed")
        if not r.rows_exact:
            out.append(
                f"{where}: the resumed run delivered {r.resumed_rows} rows, not those after the cut"
            )
    for r in restore_rows:
        where = f"restore {r.state_mb:g} MiB"
        if r.lost or r.duplicates:
            out.append(f"{where}: lost {r.lost}, duplicates {r.duplicates}")
        if not r.digests_match:
            out.append(f"{where}: the replicas' output digests differed")
        if not r.rebuilt:
            out.append(f"{where}: no replica was rebuilt after the kill")
    if fault_rows:
        out += paper.failures(fault_rows, ["fault"])
    return out


def restore_table(rows: list[RecoveryRow]) -> list[str]:
    """The restore rows as the lines of a Markdown section."""
    r0 = rows[0]
    cell = paper._cell
    return _section(
        "Restoring r against state size",
        f"{r0.rate:,} ev/s, r = 2, a keyed task of 2 partitions; the replica group holding "
        f"`state[0]` replica 0 SIGKILLed at {r0.kill_at_s:g} s and rebuilt from its twins. "
        "restore: from the kill to the rebuilt replicas receiving their input. p99 before: "
        "median per-second p99 before the kill; during: the worst second from the kill "
        "until 2 s after the rebuild.",
        "| state per partition | restore ms | rebuilt | p99 before | p99 during | ratio "
        "| longest gap | lost | dup | digests |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        [
            [
                f"{r.state_mb:g} MiB",
                cell(r.restore_ms, 0),
                cell(r.rebuilt),
                cell(r.p99_before_ms),
                cell(r.p99_during_ms),
                cell(r.during_vs_before, 2, "x"),
                cell(r.max_gap_ms, 0),
                cell(r.lost),
                cell(r.duplicates),
                "match" if r.digests_match else "DIFFER",
            ]
            for r in rows
        ],
    )


def markdown(
    restore_rows: list[RecoveryRow],
    fault_rows: list[paper.Row],
    meta: dict,
    savepoint_rows: list[SavepointRow] = (),
    driver_row: DriverRow | None = None,
    rescale_row: RescaleRow | None = None,
) -> str:
    """The report: the restore table, the savepoint table, the driver row, then the fault
    experiment's (``tandem bench paper``'s table for it)."""
    out = [paper.headline(meta)]
    if restore_rows:
        out += ["", *restore_table(restore_rows)]
    if savepoint_rows:
        out += ["", *savepoint_table(savepoint_rows)]
    if driver_row is not None:
        out += ["", *driver_table(driver_row)]
    if rescale_row is not None:
        out += ["", *rescale_table(rescale_row)]
    if fault_rows:
        out += ["", paper.LEGEND, "Downtime: the longest gap between two outputs."]
        out += ["", *paper.experiment_table(fault_rows, "fault")]
    return "\n".join(out)


def recovery(
    settings: Settings,
    experiments=EXPERIMENTS,
    configs=FAULT_CONFIGS,
    kazoo: td.KazooConfig | None = None,
    json_path: str | os.PathLike | None = "out/recovery.json",
    plot_path: str | os.PathLike | None = "out/recovery_fault_p99.png",
    command: str = "tandem bench recovery",
    log=None,
) -> dict:
    """Run ``experiments`` (``fault`` in ``configs``), write the JSON document to
    ``json_path`` and the fault rows' per-second p99 over time (the kill marked) to
    ``plot_path``, and return the document: ``restore_rows``, ``fault_rows``, the report
    as ``markdown``, ``figures`` written and ``failures`` (see :func:`failures`)."""
    log = log or sys.stderr  # at call time: sys.stderr may have been replaced
    log = log or sys.stderr
    experiments, configs = tuple(experiments), tuple(configs)
    check_selection(experiments, configs)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    t = time.monotonic()
    restore_rows: list[RecoveryRow] = []
    if "restore" in experiments:
        restore_rows = restore(
            sizes=settings.sizes,
            rate=settings.rate,
            duration=settings.duration_s,
            kill_at=settings.kill_at_s,
            log=log,
        )
    savepoint_rows: list[SavepointRow] = []
    if "savepoint" in experiments:
        savepoint_rows = savepoint(
            sizes=settings.sizes,
            rate=settings.rate,
            duration=settings.duration_s,
            at=settings.kill_at_s,
            log=log,
            orderings=savepoint_orderings(configs),
            kazoo=kazoo,
        )
    driver_row = None
    if "driver" in experiments:
        driver_row = driver(
            rate=settings.rate, duration=settings.duration_s, kill_at=settings.kill_at_s, log=log
        )
    rescale_row = None
    if "rescale" in experiments:
        rescale_row = rescale_live(
            rate=settings.rate, duration=settings.duration_s, at=settings.kill_at_s, log=log
        )
    fault_rows: list[paper.Row] = []
    if "fault" in experiments:
        fault_rows = paper.run_all(fault_cases(settings, configs), kazoo, log)
        paper.add_ratios(fault_rows)
    meta = paper.run_meta(started, command, time.monotonic() - t)
    doc = {
        "experiment": "recovery",
        **meta,
        "settings": asdict(settings),
        "experiments": list(experiments),
        "configs": list(configs) if "fault" in experiments else [],
        "restore_rows": [asdict(r) for r in restore_rows],
        "savepoint_rows": [asdict(r) for r in savepoint_rows],
        "driver_row": None if driver_row is None else asdict(driver_row),
        "rescale_row": None if rescale_row is None else asdict(rescale_row),
        "fault_rows": [asdict(r) for r in fault_rows],
        "failures": failures(restore_rows, fault_rows, savepoint_rows, driver_row, rescale_row),
        "figures": [],
    }
    if plot_path and any(r.status == "ok" for r in fault_rows) and paper.can_plot(log):
        os.makedirs(os.path.dirname(os.path.abspath(plot_path)), exist_ok=True)
        paper.plot_over_time(fault_rows, "fault", str(plot_path))
        doc["figures"].append(str(plot_path))
    doc["markdown"] = markdown(
        restore_rows, fault_rows, meta, savepoint_rows, driver_row, rescale_row
    )
    if json_path:
        import json

        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=2)
    return doc


HELP = (
    "time to restore r and the cost of a savepoint against state size, and the fault "
    "experiment (passive, LiveRobin, KaZoo) in the same run: Markdown tables, JSON and a PNG"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_names(p, "--experiments", EXPERIMENTS)
    p.add_argument(
        "--sizes",
        metavar="MIB,...",
        help="restore, savepoint: MiB of state per partition, comma-separated (default 1,10,100)",
    )
    common.add_names(
        p,
        "--configs",
        FAULT_CONFIGS,
        "all; savepoint runs under r1, liverobin and kazoo of them",
    )
    common.add_rate(p, None, "every run's rate (default 5000)")
    common.add_seconds(
        p,
        "--duration",
        None,
        "every run's length (default 12 for the state sizes, kill or savepoint at 4 s or a "
        "third; 30 for the fault runs, kill at half)",
    )
    common.add_seconds(p, "--warmup", None, "the fault runs' warm-up, left out of latency (5)")
    common.add_session_timeout(p)
    p.add_argument(
        "--quick",
        action="store_true",
        help="1 MiB (6 s) and the fault runs of `tandem bench paper --quick`: for CI",
    )
    common.add_json(p, "where the JSON goes (default out/recovery.json)")
    p.add_argument(
        "--plot",
        metavar="PATH",
        help="the fault rows' per-second p99 as a PNG (default out/recovery_fault_p99.png)",
    )


def main(args: argparse.Namespace) -> int:
    settings = (QUICK if args.quick else FULL).with_flags(
        args.rate, args.duration, args.warmup, args.session_timeout
    )
    if args.sizes:
        try:
            sizes = tuple(float(x) for x in common.csv(args.sizes))
        except ValueError:
            sizes = ()
        if not sizes or min(sizes) <= 0:
            raise td.ConfigError(
                f"--sizes {args.sizes!r}: MiB of state per partition, positive numbers "
                "separated by commas (e.g. 1,10,100)"
            )
        settings = replace(settings, sizes=sizes)
    experiments = common.csv(args.experiments) or EXPERIMENTS
    configs = common.csv(args.configs) or FAULT_CONFIGS
    check_selection(experiments, configs)
    json_path = args.json or "out/recovery.json"
    plot_path = args.plot or "out/recovery_fault_p99.png"
    command = common.command(
        args, "recovery", "quick", "experiments", "sizes", "configs", "rate"
    ) + common.command(args, "", "duration", "warmup", "json", "plot")
    parts = []
    sizes = ", ".join(f"{mb:g}" for mb in settings.sizes)
    if "restore" in experiments:
        parts.append(f"restore r with {sizes} MiB")
    if "savepoint" in experiments:
        under = " and ".join(savepoint_orderings(configs))
        parts.append(f"savepoints of {sizes} MiB under {under}")
    if "driver" in experiments:
        parts.append("a lost driver resumed")
    if "rescale" in experiments:
        parts.append("a live rescale 2 -> 4")
    if "fault" in experiments:
        parts.append(f"the fault experiment in {', '.join(configs)}")
    expected = estimate_s(settings, experiments, configs)
    about = f"{expected / 60:.0f} min" if expected >= 90 else f"{expected:.0f} s"
    common.headline(f"bench recovery: {'; '.join(parts)}; about {about}")
    needed = ("fault" in experiments or "savepoint" in experiments) and "kazoo" in configs
    with common.kazoo_services(needed, args.session_timeout) as kazoo:
        doc = recovery(
            settings,
            experiments,
            configs,
            kazoo=kazoo,
            json_path=json_path,
            plot_path=plot_path,
            command=command,
        )
    print()
    print(doc["markdown"])
    print(f"wrote {json_path}", flush=True)
    return common.report_written(doc)
