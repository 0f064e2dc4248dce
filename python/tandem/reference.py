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
from collections.abc import Iterable, Iterator

import pyarrow as pa
import pyarrow.compute as pc

from tandem.exceptions import ConfigError
from tandem.heartbeat import LogStep
from tandem.plan import InputChannel, Plan, Router, Task, WatermarkTracker
from tandem.result import Result
from tandem.sinks import Collect
from tandem.testing import ReferenceLiveRobin

# Entries of a logical channel: ("data", batch) | ("heartbeat", epoch) | ("end",).
Item = tuple
ChannelKey = tuple[int, int, int, int]  # upstream task, upstream partition, task, partition


def live_robin(queues: list[deque]) -> Iterator[tuple]:
    """LiveRobin over fully known channel contents (each ending with ``("end",)``), one
    whole batch per turn. Yields ``("data", channel, batch)``, ``("heartbeat", channel,
    epoch, first)`` and finally ``("end",)`` (empty batches take no turn)."""
    if not queues:
        yield ("end",)
        return
    merge = ReferenceLiveRobin(len(queues))
    while True:
        step = merge.step(queues)
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
    the downstream channels."""

    def __init__(self, plan: Plan, task: Task, partition: int, chans: dict) -> None:
        self.targets = []
        for edge in plan.output_edges(task.id, partition):
            lists = []
            for p in edge.partitions:
                key = (task.id, partition, edge.downstream, p)
                lists.append(chans.setdefault(key, []))
            self.targets.append((Router(edge, plan.batch_rows, plan.max_parallelism), lists))

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
    chans: dict[ChannelKey, list[Item]] = {}
    events_in = 0
    events_out = 0
    outputs: dict[str, object] = {}
    first_collect = None
    for task in plan.tasks:
        if task.kind == "source":
            for p in range(task.parallelism):
                out = _Emitter(plan, task, p, chans)
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
            for p in range(task.parallelism):
                _run_operator(plan, task, p, t0_ns, chans, (orders or {}).get((task.id, p)), drain)
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
                for step in live_robin(queues):
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


def _run_operator(
    plan: Plan,
    task: Task,
    partition: int,
    t0_ns: int,
    chans: dict,
    orders: list | None,
    drain: bool = True,
) -> None:
    inst = plan.instantiate(task.id, partition, replica=0, t0_ns=t0_ns)
    inputs, queues = _queues(plan, task, partition, chans)
    out = _Emitter(plan, task, partition, chans)
    tracker = WatermarkTracker(len(inputs))
    merge = live_robin(queues) if orders is None else positional(queues, orders)
    for step in merge:
        if step[0] == "data":
            _, ch, batch = step
            out.data(inst.batch(batch, inputs[ch].input_index))
        elif step[0] == "heartbeat":
            before = tracker.current
            now = tracker.observe(step[1], step[2])
            if now is not None:
                for k in range(before + 1, now + 1):
                    out.data(inst.watermark(plan.watermark_ns(k, t0_ns)))
                    out.control("heartbeat", k)
        else:
            if drain:
                out.data(inst.finish())
            out.control("end")


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
