"""The single-process reference executor: the oracle replicated runs are compared with.

It runs a :class:`tandem.plan.Plan` to completion in this process, with no clock, no
threads and no network, following exactly the rules a replicated run follows (see the
:mod:`tandem.plan` module documentation):

* every source partition produces its logical schedule (:meth:`Plan.source_schedule`: the
  same batches, cut at the same deterministic positions, heartbeat ``k`` after every row
  released before ``t0 + k * heartbeat``, end); a log source (Kafka) replays its log
  through the same :class:`~tandem.heartbeat.LogSchedule` as its replicas
  (:func:`log_steps`), so a run's reference reads the rows that run read;
* every output is routed with the same partitioners as the Rust outbox (forward,
  rebalance with a running row counter, xxh3 hash with the same seed) and leaves as the
  same frames (:class:`tandem.plan.Router`);
* every operator partition consumes its logical input channels in LiveRobin order, one
  whole batch per turn — the paper's algorithm as :class:`tandem.testing.ReferenceLiveRobin`
  writes it, not a port of the Rust merge — so every operator is called with the same
  batches as at every replica;
* watermarks advance when every input channel has delivered a heartbeat, and heartbeats
  are forwarded right after ``on_watermark``; end of input calls
  ``on_watermark(WATERMARK_MAX)``.

A plan's :attr:`~tandem.plan.Plan.live_rescales` (:mod:`tandem.rescale`) are replayed
with the rules the replicas follow: right after emitting heartbeat ``K`` the tasks feeding
the rescaled task route their rows over its new partitions; its old partitions run through
heartbeat ``K`` and their states are split by key group over the new ones. A partition
that was there goes on where it stands — its channels, their positions and sequence
numbers, its merge — with its share of the state; a new one starts there (its merge at
turn 0, having seen ``K``) on the new channels, which start after ``K``; its consumers join
the new partitions' channels after ``K`` (:meth:`ReferenceLiveRobin.join`). The plan given
is the one after the rescales, and so is the layout of every channel: a partition that
goes on through a rescale is one partition, its output before ``K`` and after it one
channel; one added by the rescale has channels that start after ``K``.

Tasks run one after the other in topological order; every channel's whole content is
kept in memory, so this is meant for small jobs (tests, examples, oracles).

What a replicated run must match: with ``ordering="liverobin"`` every operator partition
consumes the same batch sequence as here, so every operator's output per channel is the
same batch sequence — for any function that is deterministic for a given input batch.
Sinks consume first-come-first-served in a replicated run (DESIGN §2.3), so a sink
partition's rows may interleave its input channels differently: compare sink output per
upstream channel, or as a multiset (:func:`canonical`). ``ordering="none"`` guarantees
this only for tasks with one input channel.

The :class:`tandem.Result` it returns has ``lost == duplicates == 0``, ``digests_match``
true, no faults, and ``None`` for every latency field (there is no clock to measure with).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterable, Iterator, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from tandem.exceptions import ConfigError
from tandem.heartbeat import LogStep
from tandem.plan import InputChannel, OutputEdge, Plan, Router, Task, WatermarkTracker
from tandem.rescale import check, split_states
from tandem.result import Result
from tandem.sinks import Collect
from tandem.testing import ReferenceLiveRobin

# Entries of a logical channel: ("data", batch) | ("heartbeat", epoch) | ("end",).
Item = tuple
ChannelKey = tuple[int, int, int, int]  # upstream task, upstream partition, task, partition


def live_robin(
    queues: list[deque], joins: Sequence[tuple[int, int]] = (), gen: int | None = None
) -> Iterator[tuple]:
    """LiveRobin over fully known channel contents (each ending with ``("end",)``), one
    whole batch per turn. Yields ``("data", channel, batch)``, ``("heartbeat", channel,
    epoch, first)`` and finally ``("end",)`` (empty batches take no turn).

    ``joins``: ``(count, after_epoch)`` per live rescale upstream, in epoch order — the
    last queues are channels that join the merge (:meth:`ReferenceLiveRobin.join`), each
    join told as soon as the one before took its place and before the merge sees its
    epoch. ``gen``: the highest heartbeat epoch a merge resumed at a cut had seen."""
    if not queues:
        yield ("end",)
        return
    pending = deque(joins)
    merge = ReferenceLiveRobin(len(queues) - sum(count for count, _ in joins))
    merge.gen = gen
    while True:
        if pending and not merge.waiting:
            count, after = pending.popleft()
            if merge.gen is not None and merge.gen >= after:
                raise ConfigError(
                    f"reference executor: channels join after heartbeat {after}, but the "
                    f"merge had seen heartbeat {merge.gen} before it could join them"
                )
            merge.join(count, after)
        step = merge.step(queues if merge.channels == len(queues) else queues[: merge.channels])
        if step is None:
            raise ConfigError(
                f"reference executor: input channel {merge.next} ran dry before its end "
                "marker (a bug in the upstream task's schedule)"
            )
        yield step
        if step[0] == "end":
            return


def positional(queues: list[deque], orders: list[tuple[int, int]]) -> Iterator[tuple]:
    """The positional merge (the KaZoo follower) over fully known channel contents:
    consume channel ``c`` until its next sequence number is ``s``, for each followed order
    entry ``(c, s)`` in turn. Yields like :func:`live_robin`. A leader orders at batch
    boundaries; a bound inside a batch splits it, as tandem-core's ``Positional`` does."""
    n = len(queues)
    position, ended = [0] * n, [False] * n
    for c, bound in orders:
        while position[c] < bound and not ended[c]:
            if not queues[c]:
                raise ConfigError(
                    f"reference executor: an order runs channel {c} to seq {bound}, past "
                    f"its content ({position[c]} seqs): the order log is not this job's"
                )
            entry = queues[c].popleft()
            if entry[0] == "data":
                value = entry[1]
                if value.num_rows == 0:
                    continue
                if position[c] + value.num_rows > bound:
                    head = bound - position[c]
                    queues[c].appendleft(("data", value.slice(head)))
                    value = value.slice(0, head)
                position[c] += value.num_rows
                yield ("data", c, value)
                continue
            position[c] += 1
            if entry[0] == "heartbeat":
                yield ("heartbeat", c, entry[1], None)
            else:
                ended[c] = True
                if all(ended):
                    yield ("end",)
                    return
    raise ConfigError(
        "reference executor: the order log ends before every input channel did; was the "
        "run complete?"
    )


class _Emitter:
    """The outputs of one task partition: a router per output edge, appending entries to
    the downstream channels. ``switches``: per heartbeat epoch, the plan a consumer's live
    rescale goes to right after it — the edges to the rescaled task route the rows that
    follow over its new partitions, the channels of the partitions that go on continuing."""

    def __init__(
        self,
        plan: Plan,
        task: Task,
        partition: int,
        chans: dict,
        switches: dict[int, tuple[int, Plan]] | None = None,
    ) -> None:
        self.task, self.partition, self.chans = task, partition, chans
        self.switches = switches or {}
        self.targets = [self._target(plan, e) for e in plan.output_edges(task.id, partition)]

    def _target(self, plan: Plan, edge: OutputEdge) -> tuple[Router, list[list]]:
        lists = [
            self.chans.setdefault((self.task.id, self.partition, edge.downstream, p), [])
            for p in edge.partitions
        ]
        return Router(edge, plan.batch_rows, plan.max_parallelism), lists

    def data(self, batch: pa.RecordBatch | None) -> None:
        if batch is None or batch.num_rows == 0:
            return
        for router, lists in self.targets:
            for c, frame in router.route(batch):
                lists[c].append(("data", frame))

    def control(self, *entry: object) -> None:
        for _, lists in self.targets:
            for items in lists:
                items.append(entry)
        if entry[0] == "heartbeat" and entry[1] in self.switches:
            rescaled, plan = self.switches[entry[1]]
            edges = plan.output_edges(self.task.id, self.partition)
            for i, edge in enumerate(edges):
                if edge.downstream == rescaled:
                    self.targets[i] = self._target(plan, edge)


def _queues(plan: Plan, task: Task, partition: int, chans: dict) -> tuple[list, list]:
    inputs: list[InputChannel] = plan.input_channels(task.id, partition)
    queues = []
    for c in inputs:
        entries = chans.pop((c.task, c.partition, task.id, partition), [])
        conform = plan.input_conformer(task.id, c)  # a union's input: see Plan
        if conform is not None:
            entries = [(e[0], conform(e[1])) if e[0] == "data" else e for e in entries]
        queues.append(deque(entries))
    return inputs, queues


class _Rescales:
    """A plan's :attr:`~tandem.plan.Plan.live_rescales` as the phases of the run: the plan
    in force from the start and after each rescale's heartbeat, and what each task
    partition does at those heartbeats."""

    def __init__(self, plan: Plan) -> None:
        self.steps = plan.live_rescales
        plans = [plan]
        for step in reversed(self.steps):
            later = plans[0]
            if later.task(step.task).parallelism != step.now:
                raise ConfigError(
                    f"reference executor: the live rescale of {step.task!r} at heartbeat "
                    f"{step.epoch} went to {step.now} partitions, but the plan after it has "
                    f"{later.task(step.task).parallelism}"
                )
            plans.insert(0, later.rescaled(step.task, step.was))
        for i, step in enumerate(self.steps):
            if step.epoch <= (self.steps[i - 1].epoch if i else 0):
                raise ConfigError(
                    f"reference executor: live rescales happen after heartbeats 1, 2, ... "
                    f"in heartbeat order, got {[s.epoch for s in self.steps]}"
                )
            check(plans[i], step.task, step.now)
        self.plans = plans
        """``plans[i]``: the plan before rescale ``i`` (and after rescale ``i - 1``)."""

    def plan_after(self, epoch: int) -> Plan:
        """The plan in force right after heartbeat ``epoch`` (0: from the start)."""
        return self.plans[sum(1 for s in self.steps if s.epoch <= epoch)]

    def of(self, task: Task) -> list[tuple[int, Plan]]:
        """``task``'s own rescales: ``(epoch, plan after it)``."""
        return [
            (s.epoch, self.plans[i + 1]) for i, s in enumerate(self.steps) if s.task == task.name
        ]

    def switches(self, task: Task, since: int) -> dict[int, tuple[int, Plan]]:
        """For an :class:`_Emitter` of ``task`` started after heartbeat ``since``: the
        rescales of its consumers after it, by epoch (the rescaled task, the plan after)."""
        consumers = {d.id for d, _ in self.plans[0].consumers(task.id)}
        out = {}
        for i, s in enumerate(self.steps):
            t = self.plans[0].task(s.task).id
            if s.epoch > since and t in consumers:
                out[s.epoch] = (t, self.plans[i + 1])
        return out

    def joins(self, task: Task, partition: int, since: int) -> list[tuple[int, int]]:
        """For the merge of ``task``'s partition started after heartbeat ``since``: the
        ``(count, after_epoch)`` of the channels each later rescale of an upstream task
        appends to its inputs."""
        out = []
        for i, s in enumerate(self.steps):
            if s.epoch > since:
                before = len(self.plans[i].input_channels(task.id, partition))
                count = len(self.plans[i + 1].input_channels(task.id, partition)) - before
                if count:
                    out.append((count, s.epoch))
        return out


def run(
    plan: Plan,
    duration: float,
    t0_ns: int = 0,
    orders: dict[tuple[int, int], list[tuple[int, int]]] | None = None,
    in_memory: bool = False,
    drain: bool = True,
) -> Result:
    """Run ``plan`` for ``duration`` seconds of source time; return its Result.

    ``orders`` gives, for KaZoo-ordered ``(task, partition)`` s, the order entries a run's
    replicas followed (:func:`tandem.ordering.kazoo.read_orders`): those partitions then
    consume in that order instead of LiveRobin's, so the result is the one output that run
    must have produced. ``in_memory``: every sink is a :class:`~tandem.sinks.Collect`, so
    that every output is a table of the sink's input rows and nothing is written anywhere
    (what an oracle needs: a file sink would overwrite the files of the run it checks).
    ``drain``: the operators emit their final output at the end (False: a run stopped at
    a savepoint, which leaves it to the resumed run)."""
    rescales = _Rescales(plan)
    chans: dict[ChannelKey, list[Item]] = {}
    events_in = 0
    events_out = 0
    outputs: dict[str, object] = {}
    first_collect = None
    for task in plan.tasks:
        if task.kind == "source":
            for p in range(task.parallelism):
                out = _Emitter(rescales.plans[0], task, p, chans, rescales.switches(task, 0))
                if plan.is_log_source(task.id):
                    steps = log_steps(plan, task.id, p, duration, t0_ns)
                    for entry in log_entries(steps):
                        if entry[0] == "rows":
                            batch = task.source.decode(p, entry[1])
                            events_in += batch.num_rows
                            out.data(batch)
                        else:
                            out.control(*entry)
                    continue
                for step in plan.source_schedule(task.id, p, duration):
                    if step.kind == "rows":
                        batch = plan.source_batch(task.id, p, step.j0, step.j1, t0_ns)
                        events_in += batch.num_rows
                        out.data(batch)
                    elif step.kind == "heartbeat":
                        out.control("heartbeat", step.epoch)
                    else:
                        out.control("end")
        elif task.kind == "operator":
            _run_operator(rescales, task, t0_ns, chans, orders or {}, drain)
        else:
            parts = []
            proto = Collect() if in_memory else task.sink
            for p in range(task.parallelism):
                if in_memory:
                    sink = Collect()
                    sink.open(p, task.parallelism, task.schema)
                else:
                    sink = plan.open_sink(task.id, p)
                _, queues = _queues(plan, task, p, chans)
                for step in live_robin(queues, rescales.joins(task, p, 0)):
                    if step[0] == "data":
                        events_out += step[2].num_rows
                        sink.write(step[2])
                parts.append(sink.close())
            outputs[task.name] = proto.combine(parts, task.schema)
            if first_collect is None and isinstance(task.sink, Collect):
                first_collect = task.name
    return Result(
        duration_s=duration,
        events_in=events_in,
        events_out=events_out,
        output=outputs.get(first_collect) if first_collect else None,
        outputs=outputs,
        t0_ns=t0_ns,
    )


def log_steps(
    plan: Plan, task_id: int, partition: int, duration: float | None, t0_ns: int
) -> Iterator[LogStep]:
    """The steps of a log source partition in a run from ``t0_ns``, replayed from the log
    (:meth:`tandem.sources.LogSource.replay`) through the same
    :class:`~tandem.heartbeat.LogSchedule` the replicas ran. The log of a finished run
    holds the marker its replicas ended at; a log that ends before such a marker (a
    replay with no run behind it) ends where it ends: its last rows form the last batch."""
    schedule = plan.log_schedule(task_id, partition, duration, t0_ns)
    with contextlib.closing(plan.tasks[task_id].source.replay(partition)) as chunks:
        for records in chunks:
            for step in schedule.feed(records):
                yield step
                if step.kind == "end":
                    return
    if schedule.pending:
        yield LogStep("rows", schedule.pending)
    yield LogStep("end")


def log_entries(steps: Iterable[LogStep]) -> Iterator[tuple]:
    """What a log source partition whose schedule yields ``steps`` puts on each of its
    output channels, in order, as its replicas do: ``("rows", records)`` (one batch),
    ``("heartbeat", k)``, ``("end",)``.

    A marker taken as heartbeat ``k`` sends **every** heartbeat not sent yet, ``k`` last
    — one element apiece, as a source slot does (tandem-core ``Worker::heartbeats_through``
    sends each epoch from the last one sent through ``k``). The markers a partition takes
    may skip epochs: a generator held up skips those whose instants passed, and of two
    generators racing, one partition may get a later epoch's marker before an earlier one,
    which it then ignores. Two partitions therefore skip different epochs, and a merge
    downstream ends a channel's cycle on every heartbeat element (LiveRobin): a channel
    carrying only the epochs taken would put the partitions' batches in other cycles than
    at the replicas."""
    sent = 0
    for step in steps:
        if step.kind == "rows":
            yield ("rows", step.records)
        elif step.kind == "heartbeat":
            for k in range(sent + 1, step.epoch + 1):
                yield ("heartbeat", k)
            sent = max(sent, step.epoch)
        else:
            yield ("end",)


class _Partition:
    """One operator partition in the reference run: from the start (``since`` 0) or, a
    partition of a task rescaled live, from that rescale's heartbeat ``since`` on with the
    ``state`` split for it. Its merge starts over the channels of the plan in force then
    (turn 0, having seen heartbeat ``since``: a cut at a cycle boundary) and joins the
    channels later rescales upstream append; every channel counts as having delivered
    ``since``, a joined one its join's epoch."""

    def __init__(
        self,
        rescales: _Rescales,
        task: Task,
        partition: int,
        t0_ns: int,
        queues: list[deque],
        out: _Emitter,
        since: int = 0,
        orders: list | None = None,
        state: bytes | None = None,
    ) -> None:
        plan = rescales.plan_after(since)
        self.t0_ns, self.plan = t0_ns, plan
        self.inst = plan.instantiate(task.id, partition, replica=0, t0_ns=t0_ns)
        if state is not None:
            self.inst.restore(state)
        self.inputs = rescales.plans[-1].input_channels(task.id, partition)
        self.queues, self.out = queues, out
        joins = rescales.joins(task, partition, since)
        self.tracker = WatermarkTracker(len(self.inputs))
        self.tracker.current = since
        epochs = [since] * (len(self.inputs) - sum(count for count, _ in joins))
        for count, epoch in joins:
            epochs += [epoch] * count
        self.tracker.epochs = epochs
        self.merge = (
            live_robin(queues, joins, gen=since or None)
            if orders is None
            else positional(queues, orders)
        )

    def run(self, until: int | None = None, drain: bool = True) -> None:
        """Consume the input until the partition forwarded heartbeat ``until`` (where a
        live rescale cuts it), or to its end (None; ``drain``: emit the final output)."""
        inst, out = self.inst, self.out
        for step in self.merge:
            if step[0] == "data":
                _, ch, batch = step
                out.data(inst.batch(batch, self.inputs[ch].input_index))
            elif step[0] == "heartbeat":
                before = self.tracker.current
                now = self.tracker.observe(step[1], step[2])
                if now is None:
                    continue
                for k in range(before + 1, now + 1):
                    out.data(inst.watermark(self.plan.watermark_ns(k, self.t0_ns)))
                    out.control("heartbeat", k)
                if until is not None and before < until <= now:
                    if now != until:
                        raise ConfigError(
                            f"reference executor: {inst.where} passed heartbeats "
                            f"{before + 1}..{now} at once, so it has no cut at heartbeat "
                            f"{until} for its live rescale"
                        )
                    return
            else:
                if until is not None:
                    raise ConfigError(
                        f"reference executor: {inst.where} ended before heartbeat {until}, "
                        "where its live rescale happens: the run ends before it"
                    )
                if drain:
                    out.data(inst.finish())
                out.control("end")


def _run_operator(
    rescales: _Rescales,
    task: Task,
    t0_ns: int,
    chans: dict,
    orders: dict[tuple[int, int], list],
    drain: bool = True,
) -> None:
    """Every partition of an operator task; at each live rescale of the task, its
    partitions run through the rescale's heartbeat, their states are split by key group
    over the new partitions, and those go on from there: a partition that was there
    before keeps its input channels (at the positions after the heartbeat) and its output
    channels (its output after the heartbeat continues them) and its merge where it stands,
    a new one takes the new channels, which start after it, with a merge at turn 0."""
    final, start = rescales.plans[-1], rescales.plans[0]
    parts = []
    for p in range(start.task(task.id).parallelism):
        _, queues = _queues(final, task, p, chans)
        out = _Emitter(start, task, p, chans, rescales.switches(task, 0))
        parts.append(_Partition(rescales, task, p, t0_ns, queues, out, 0, orders.get((task.id, p))))
    for epoch, after in rescales.of(task):
        for part in parts:
            part.run(until=epoch)
        now = after.task(task.id).parallelism
        snapshots = [part.inst.snapshot() for part in parts]
        states = split_states(task, snapshots, after.max_parallelism, now, epoch)
        went_on = parts
        parts = []
        for q, state in enumerate(states):
            if q < len(went_on):
                # It goes on where it stands — its merge too (the turn after the cycle's
                # end is where that merge's round robin is, not 0) — with its new state.
                part = went_on[q]
                part.plan = rescales.plan_after(epoch)
                part.inst = part.plan.instantiate(task.id, q, replica=0, t0_ns=t0_ns)
                part.inst.restore(state)
                parts.append(part)
                continue
            _, queues = _queues(final, task, q, chans)
            out = _Emitter(after, task, q, chans, rescales.switches(task, epoch))
            parts.append(_Partition(rescales, task, q, t0_ns, queues, out, epoch, state=state))
    for part in parts:
        part.run(drain=drain)


def comparable(table: pa.Table) -> pa.Table:
    """``table`` with every column pyarrow cannot sort or group by replaced, row for row,
    by one it can: a dictionary column by its values, a nested one (list, struct, map,
    union) by a text rendering of each value (``repr`` of its Python value; a null stays
    null). Two rows are equal here exactly when their values are, so this is what
    multiset comparisons of rows sort and group (:func:`canonical`,
    :func:`tandem.engines.common.multiset_diff`)."""
    cols = []
    for col in table.columns:
        if pa.types.is_dictionary(col.type):
            col = col.cast(col.type.value_type)
        if pa.types.is_nested(col.type):
            col = pa.array([None if v is None else repr(v) for v in col.to_pylist()], pa.string())
        cols.append(col)
    return pa.Table.from_arrays(cols, names=table.schema.names)


def canonical(table: pa.Table) -> pa.Table:
    """``table``'s rows sorted by every column (in column order; nested and dictionary
    columns by their :func:`comparable` form) — for comparing outputs as multisets."""
    if not table.num_columns:
        return table
    keys = [(name, "ascending") for name in table.schema.names]
    return table.take(pc.sort_indices(comparable(table), sort_keys=keys))


__all__ = [
    "canonical",
    "comparable",
    "live_robin",
    "log_entries",
    "log_steps",
    "positional",
    "run",
]
