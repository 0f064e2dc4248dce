"""What every engine does once its replicas have finished: assemble the :class:`Result`.

An engine only runs replicas and collects their :class:`~tandem.runtime.ReplicaReport` s;
how a run is judged is the same on every engine, so it lives here: latencies measured at
the sinks, output compared against the single-process reference executor (lost and
duplicated rows), and the per-cycle output digests of the replicas of each task partition
compared with each other (the determinism check).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from tandem import latency
from tandem.exceptions import ConfigError, TandemError
from tandem.faults import Kill
from tandem.ordering import kazoo
from tandem.ordering.kazoo import KazooRun
from tandem.plan import Plan
from tandem.result import Result
from tandem.runtime import ReplicaId, ReplicaReport

log = logging.getLogger("tandem")

STARTUP_S = 1.0
"""Time between the go signal and t0 on every engine: every replica dials its downstream
peers meanwhile."""


@dataclass
class SavepointAsk:
    """A savepoint asked for through a :class:`Stop`: where, whether the run stops at its
    cut, and the future its outcome goes to. ``checkpoint``: a durable checkpoint the
    coordinator asks of itself (``Plan.durable_dir``): its path is known once its epoch
    is."""

    path: str
    stop: bool = False
    future: Future = field(default_factory=Future)
    checkpoint: bool = False


@dataclass
class RescaleAsk:
    """A live rescale asked for through a :class:`Stop`: task ``task`` to ``parallelism``
    partitions; the future gets what :meth:`tandem.RunningJob.rescale` returns."""

    task: str | int
    parallelism: int
    future: Future = field(default_factory=Future)


class Stop:
    """How the caller of an engine's ``run(duration=None, stop=...)`` ends the run, from
    any thread: :meth:`request` stops it gracefully — the engine picks a stop point later
    than anything emitted, every source replica ends there and what is in flight drains
    to the sinks — and :meth:`kill` kills its processes at once (the run raises
    :class:`tandem.TandemError`)."""

    def __init__(self) -> None:
        self._requested = threading.Event()
        self._killed = threading.Event()
        self._lock = threading.Lock()
        self._savepoints: list[SavepointAsk] = []
        self._rescales: list[RescaleAsk] = []
        self._closed: str | None = None

    def request(self) -> None:
        self._requested.set()

    def savepoint(self, path: str, stop: bool = False) -> Future:
        """Ask the engine for a savepoint at ``path`` (:mod:`tandem.savepoints`; ``stop``:
        and stop the run right after its cut); the future gets the written
        :class:`~tandem.savepoints.Savepoint`, or the error that prevented it."""
        ask = SavepointAsk(path, stop)
        with self._lock:
            if self._closed is not None:
                ask.future.set_exception(TandemError(self._closed))
                return ask.future
            self._savepoints.append(ask)
        if stop:
            self.request()
        return ask.future

    def rescale(self, task: str | int, parallelism: int) -> Future:
        """Ask the engine to rescale ``task`` to ``parallelism`` partitions while the run
        goes on (:mod:`tandem.rescale`); the future gets its record, or the error."""
        ask = RescaleAsk(task, parallelism)
        with self._lock:
            if self._closed is not None:
                ask.future.set_exception(TandemError(self._closed))
                return ask.future
            self._rescales.append(ask)
        return ask.future

    def next_rescale(self) -> RescaleAsk | None:
        """The engine's side: the oldest rescale asked for and not started yet."""
        with self._lock:
            return self._rescales.pop(0) if self._rescales else None

    def stops_at_savepoint(self) -> bool:
        """Whether a savepoint that stops the run is asked for and not taken yet: the
        engine then stops the run there, not at once."""
        with self._lock:
            return any(ask.stop for ask in self._savepoints)

    def next_savepoint(self) -> SavepointAsk | None:
        """The engine's side: the oldest savepoint asked for and not taken yet."""
        with self._lock:
            return self._savepoints.pop(0) if self._savepoints else None

    def close_savepoints(self, why: str) -> None:
        """The run is over: fail every savepoint still asked for (``why``), and any asked
        later."""
        with self._lock:
            self._closed, asks, self._savepoints = why, self._savepoints, []
            asks += self._rescales
            self._rescales = []
        for ask in asks:
            if not ask.future.done():
                ask.future.set_exception(TandemError(why))

    def kill(self) -> None:
        self._killed.set()
        self._requested.set()

    @property
    def requested(self) -> bool:
        return self._requested.is_set()

    @property
    def killed(self) -> bool:
        return self._killed.is_set()


def stop_points(duration: float | None, stop: Stop | None) -> tuple[float | None, int | None]:
    """The duration and the cap (ns after t0) a coordinator runs with for a run of
    ``duration`` seconds that honours ``stop``: with a stop to honour, even a run with a
    duration goes by stop points, ending at its duration unless stopped before."""
    if stop is None or duration is None:
        return duration, None
    return None, round(duration * 1e9)


def check_options(
    engine: str,
    duration: float | None,
    warmup: float,
    faults: Iterable,
    *,
    kinds: tuple[type, ...] = (Kill,),
) -> None:
    """Raise ConfigError for run options the engine cannot honour: a warm-up outside the
    run (``duration`` None: a run until stopped), fault types outside ``kinds``. (A
    leader/follower role is checked against the job's ordering by the fault itself.)"""
    if duration is None:
        if isinstance(warmup, bool) or not isinstance(warmup, int | float) or not warmup >= 0:
            raise ConfigError(f"warmup must be a number of seconds >= 0, got {warmup!r}")
    elif not 0 <= warmup < duration:
        raise ConfigError(f"warmup must be in [0, duration={duration}), got {warmup}")
    names = " and ".join(f"td.{k.__name__}" for k in kinds)
    for f in faults:
        if not isinstance(f, kinds):
            raise ConfigError(f"the {engine} engine injects {names} faults only, got {f!r}")


def assemble_result(
    plan: Plan,
    duration: float,
    reports: Mapping[ReplicaId, ReplicaReport],
    *,
    t0_ns: int,
    warmup: float,
    check: bool,
    faults: list[dict],
    lost_replicas: Iterable[tuple[ReplicaId, str]] = (),
    rss_mb: dict[str, float] | None = None,
    kazoo: KazooRun | None = None,
    drained: bool = True,
    leads: Iterable[tuple[ReplicaId, int, int]] = (),
) -> Result:
    """The :class:`Result` of a run of ``plan`` for ``duration`` seconds from ``t0_ns``
    (``drained``: its operators emitted their final output at the end — not when it
    stopped at a savepoint).

    ``reports`` holds the report of every replica that finished (the sinks' included);
    ``faults`` the faults injected (dicts); ``lost_replicas`` the replicas that died, each
    with its cause (``"killed"``, ``"crashed"``); ``warmup`` seconds of output are left out
    of the latency figures; ``check`` compares the output with the reference executor —
    under KaZoo (``kazoo``: the run's order log) following the orders the replicas
    followed, read back from the topics.
    """
    res = Result(t0_ns=t0_ns, faults=faults, rss_mb=rss_mb or {}, duration_s=duration)
    sink_tasks = {t.id for t in plan.sinks()}
    res.lost_replicas = [
        {"task": plan.tasks[t].name, "partition": p, "replica": r, "cause": cause}
        for (t, p, r), cause in lost_replicas
    ]
    res.events_in = sum(
        _source_rows(plan, t.id, p, duration, reports)
        for t in plan.sources()
        for p in range(t.parallelism)
    )
    chosen = published_copies(plan, reports)
    for task in plan.sinks():
        parts = [reports[chosen[(task.id, p)]].sink_part for p in range(task.parallelism)]
        res.outputs[task.name] = task.sink.combine(parts, task.schema)
        res.events_out += sum(
            reports[chosen[(task.id, p)]].rows_in for p in range(task.parallelism)
        )
        for p in range(task.parallelism):
            for r in range(task.replication):
                if (task.id, p, r) != chosen[(task.id, p)]:
                    rep = reports.get((task.id, p, r))
                    task.sink.discard(
                        None if rep is None else rep.sink_part,
                        partition=p,
                        replica=r,
                        parallelism=task.parallelism,
                        run=t0_ns,
                    )
    collects = [t.name for t in plan.sinks() if isinstance(res.outputs[t.name], pa.Table)]
    res.output = res.outputs[collects[0]] if collects else None
    sink_copies = set(chosen.values())
    _latency(
        res,
        [rep for rid, rep in reports.items() if rid in sink_copies or rid[0] not in sink_tasks],
        warmup,
    )
    _digests(res, plan, reports)
    _leaders(res, plan, reports, leads)
    if check:
        _check(res, plan, duration, reports, chosen, kazoo, drained)
    else:  # not measured: say so rather than report a reassuring zero
        res.lost = res.duplicates = None
    return res


def published_copies(
    plan: Plan, reports: Mapping[ReplicaId, ReplicaReport]
) -> dict[tuple[int, int], ReplicaId]:
    """Which replica's copy of each sink partition the job publishes: of those that
    finished their whole input (a copy cut off from its input reports too, not ended),
    the one whose output was interrupted least — the shortest longest gap between rows
    received — and of equals the first to report (``reports`` is in the order the reports
    came); of an owned sink (a replicated Kafka sink), the replica that wrote last,
    whose report holds every transaction's totals. Its rows are the output, its latency
    record the run's latency; the other replicas' copies are discarded. The copies hold
    the same rows; choosing the least interrupted one measures what the first copy to
    arrive gives, as dedup does for operators: a copy on a host cut off and healed gets
    its rows seconds late, all at once, and reports as soon as its twin. A copy rebuilt
    from a twin's comes after every copy that ran from the start."""
    chosen: dict[tuple[int, int], ReplicaId] = {}
    gaps: dict[tuple[int, int], tuple[bool, float]] = {}
    for rid, rep in reports.items():
        task = plan.tasks[rid[0]]
        if task.kind == "sink" and rep.ended:
            if task.sink.owned and task.replication > 1 and rep.sink_part is None:
                continue  # a twin of an owned sink's owner: it wrote nothing
            # A copy rebuilt from a twin's is whole, but its latency record starts at the
            # rebuild: published only if no copy that ran from the start ended.
            gap = (
                rep.from_twin,
                0.0 if rep.latency is None else latency.longest_gap_ms(rep.latency),
            )
            if rid[:2] not in chosen or gap < gaps[rid[:2]]:
                chosen[rid[:2]], gaps[rid[:2]] = rid, gap
    missing = [
        f"{t.name}[{p}]"
        for t in plan.sinks()
        for p in range(t.parallelism)
        if (t.id, p) not in chosen
    ]
    if missing:
        raise TandemError(
            f"no replica of sink partitions {missing} finished: the output is incomplete"
        )
    return chosen


def _source_rows(plan: Plan, task: int, partition: int, duration: float, reports: Mapping) -> int:
    """Rows a source partition emitted: from its schedule, or, for a log source, as its
    replicas that finished report (they all read the same rows)."""
    if not plan.is_log_source(task):
        return plan.source_rows(task, partition, duration)
    counts = [
        reports[(task, partition, r)].rows_in
        for r in range(plan.tasks[task].replication)
        if (task, partition, r) in reports
    ]
    return max(counts, default=0)


def _latency(res: Result, reports: Iterable[ReplicaReport], warmup: float) -> None:
    """The latency fields of ``res``, merged from the sinks' per-second histograms and
    output bitmaps (:mod:`tandem.latency`: percentiles within 0.8 %, gaps within 1 ms).
    The sinks left the warm-up out themselves; seconds wholly inside it are dropped here
    too, in case a worker was not told."""
    logs = [r.latency for r in reports if r.latency is not None]
    summary = latency.summarize(logs, skip_ns=round(warmup * 1e9))
    if summary is None:
        return
    res.p50_ms, res.p99_ms, res.max_ms = summary.p50_ms, summary.p99_ms, summary.max_ms
    res.per_second_p99_ms = summary.per_second_p99_ms
    res.max_gap_ms = summary.max_gap_ms


def _digests(res: Result, plan: Plan, reports: Mapping[ReplicaId, ReplicaReport]) -> None:
    """Compare the per-cycle output digests of the replicas of each task partition."""
    groups: dict[tuple[int, int], list[ReplicaReport]] = {}
    for (t, p, _), rep in reports.items():
        groups.setdefault((t, p), []).append(rep)
    mismatches = []
    for (t, p), reps in groups.items():
        base = reps[0]
        for other in reps[1:]:
            for key in sorted(base.digests.keys() & other.digests.keys()):
                if base.digests[key] != other.digests[key]:
                    edge, channel, epoch = key
                    cycle = "after the last heartbeat" if epoch >= 2**63 else f"in cycle {epoch}"
                    mismatches.append(
                        f"{plan.tasks[t].name}[{p}]: replicas {base.replica} and "
                        f"{other.replica} emitted different batches on output {edge} "
                        f"channel {channel} {cycle}"
                    )
                    break
    res.digests_match = not mismatches
    res.determinism_errors = mismatches
    for m in mismatches:
        log.error("DeterminismError: %s", m)


def _leaders(
    res: Result,
    plan: Plan,
    reports: Mapping[ReplicaId, ReplicaReport],
    leads: Iterable[tuple[ReplicaId, int, int]] = (),
) -> None:
    """Who led each KaZoo partition, in epoch order: each term from the report of the
    replica that led it, and a term whose replica was lost while leading (it reports
    nothing) from what its worker announced as it won the election (``leads``:
    :class:`~tandem.engines.protocol.Leads`), with ``until_s`` None — it ended with its
    replica, before the next epoch's ``from_s``."""
    terms: dict[str, list[dict]] = {}
    sessions: dict[str, dict] = {}
    reported: set[tuple[ReplicaId, int]] = set()

    def term(rid: ReplicaId, epoch: int, since_ns: int, until_ns: int | None) -> None:
        t, p, r = rid
        terms.setdefault(f"{plan.tasks[t].name}[{p}]", []).append(
            {
                "replica": r,
                "epoch": epoch,
                "from_s": round((since_ns - res.t0_ns) / 1e9, 3),
                "until_s": None if until_ns is None else round((until_ns - res.t0_ns) / 1e9, 3),
            }
        )

    for rid, rep in sorted(reports.items()):
        session = (rep.ordering_stats or {}).get("session")
        if session is not None:
            sessions[session["name"]] = session
        for led in (rep.ordering_stats or {}).get("led", []):
            reported.add((rid, led["epoch"]))
            term(rid, led["epoch"], led["since_ns"], led["until_ns"])
    for rid, epoch, since_ns in sorted(set(leads)):
        if (rid, epoch) not in reported:
            term(rid, epoch, since_ns, None)
    res.leaders = {k: sorted(v, key=lambda x: x["epoch"]) for k, v in sorted(terms.items())}
    res.kazoo_sessions = [sessions[name] for name in sorted(sessions)]


def _check(
    res: Result,
    plan: Plan,
    duration: float,
    reports: Mapping[ReplicaId, ReplicaReport],
    chosen: Mapping[tuple[int, int], ReplicaId],
    zoo: KazooRun | None,
    drained: bool = True,
) -> None:
    """Lost and duplicated rows: every sink's output against the reference run, as
    multisets of rows — read back from the files for file sinks (:meth:`Sink.rows`); by
    row counts only for a sink that keeps no rows to read back."""
    from tandem import reference

    orders = None
    if zoo is not None:  # the reference follows the orders the replicas followed
        channels = {tp: len(plan.input_channels(*tp)) for tp in plan.ordered_partitions()}
        orders = kazoo.read_orders(zoo, channels)
    # In memory: the reference must not write over the sinks' files before they are read.
    ref = reference.run(
        plan, duration, t0_ns=res.t0_ns, orders=orders, in_memory=True, drain=drained
    )
    lost = dups = 0
    for task in plan.sinks():
        want: pa.Table = ref.outputs[task.name]
        n_got = sum(reports[chosen[(task.id, p)]].rows_in for p in range(task.parallelism))
        try:
            got = task.sink.rows(res.outputs.get(task.name), task.schema)
        except (OSError, pa.ArrowInvalid) as exc:  # another machine's disk, a file not whole
            log.warning(
                "cannot read back the output of sink %r (%s): lost and duplicates not measured",
                task.name,
                exc,
            )
            res.lost = res.duplicates = None
            return
        if got is None:
            n_want = want.num_rows
            sink_lost, sink_dups = max(0, n_want - n_got), max(0, n_got - n_want)
        else:
            sink_lost, sink_dups = multiset_diff(want.select(got.schema.names), got)
        lost += sink_lost
        dups += sink_dups
    res.lost, res.duplicates = lost, dups


def multiset_diff(want: pa.Table, got: pa.Table) -> tuple[int, int]:
    """(rows of ``want`` missing from ``got``, rows of ``got`` beyond ``want``), comparing
    the tables as multisets of rows (a null equals a null; nested and dictionary columns
    by value, through :func:`tandem.reference.comparable`)."""
    from tandem.reference import comparable

    cols = want.schema.names
    if got.schema.names != cols:
        got = got.select(cols)
    want, got = comparable(want), comparable(got)

    def tagged(t: pa.Table, w: int, g: int) -> pa.Table:
        n = t.num_rows
        ones = [pa.array(np.full(n, v, dtype=np.int64)) for v in (w, g)]
        return pa.Table.from_arrays([*t.columns, *ones], names=[*cols, "_want", "_got"])

    # One grouping of both tables rather than a join: a join never matches null keys.
    both = pa.concat_tables([tagged(want, 1, 0), tagged(got, 0, 1)], promote_options="permissive")
    counts = both.group_by(cols).aggregate([("_want", "sum"), ("_got", "sum")])
    w = counts.column("_want_sum").to_numpy()
    g = counts.column("_got_sum").to_numpy()
    return int(np.maximum(w - g, 0).sum()), int(np.maximum(g - w, 0).sum())


__all__ = ["STARTUP_S", "SavepointAsk", "Stop", "assemble_result", "check_options", "multiset_diff"]
