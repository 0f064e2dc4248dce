"""The single-process reference executor: the oracle replicated runs are compared with.

It runs a :class:`tandem.plan.Plan` to completion in this process, with no clock, no
threads and no network, following exactly the rules a replicated run follows (see the
:mod:`tandem.plan` module documentation):

* every source partition produces its logical schedule (rows, heartbeat ``k`` after every
  row released before ``t0 + k * heartbeat``, end);
* every output is routed with the same partitioners as the Rust outbox (forward,
  rebalance with a running row counter, xxh3 hash with the same seed);
* every operator and sink partition consumes its logical input channels in LiveRobin
  order with ``quantum_rows = plan.quantum_rows`` (a port of tandem-core's
  ``liverobin.rs``; a single channel is passed through);
* watermarks advance when every input channel has delivered a heartbeat, and heartbeats
  are forwarded right after ``on_watermark``; end of input calls
  ``on_watermark(WATERMARK_MAX)``.

Tasks run one after the other in topological order; every channel's whole content is
kept in memory, so this is meant for small jobs (tests, examples, oracles).

What a replicated run must match: with ``ordering="liverobin"`` every operator partition
consumes the same row sequence as here, so every operator's output per channel is the same
row sequence. Sinks consume first-come-first-served in a replicated run (DESIGN §2.3), so
a sink partition's rows may interleave its input channels differently: compare sink output
per upstream channel, or as a multiset (:func:`canonical`). ``ordering="none"`` guarantees
this only for tasks with one input channel.

The :class:`tandem.Result` it returns has ``lost == duplicates == 0``, ``digests_match``
true, no faults, and ``None`` for every latency field (there is no clock to measure with).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import pyarrow as pa

from tandem.api import Result
from tandem.exceptions import ConfigError
from tandem.plan import InputChannel, Plan, Router, Task, WatermarkTracker
from tandem.sinks import Collect

# Items on a logical channel: ("data", batch) | ("hb", epoch) | ("end", None).
Item = tuple[str, object]
ChannelKey = tuple[int, int, int, int]  # upstream task, upstream partition, task, partition


class LiveRobin:
    """A port of tandem-core's LiveRobin merge over fully known channel contents.

    Yields ``("data", channel, batch)``, ``("hb", channel, epoch)`` and finally
    ``("end", None, None)``. Row order depends only on the channels' contents.
    """

    def __init__(self, queues: list[deque], quantum_rows: int) -> None:
        n = len(queues)
        self.queues = queues
        self.quantum = max(1, quantum_rows)
        self.current = 0
        self.active = [True] * n
        self.active_count = n
        self.ended = [False] * n
        self.taken = 0

    def _deactivate(self, c: int) -> None:
        if self.active[c]:
            self.active[c] = False
            self.active_count -= 1
        if self.active_count == 0:
            self.active = [not e for e in self.ended]
            self.active_count = sum(self.active)

    def _advance(self) -> None:
        self.taken = 0
        n = len(self.active)
        if self.active_count == 0:
            return
        for step in range(1, n + 1):
            c = (self.current + step) % n
            if self.active[c]:
                self.current = c
                return

    def _pop(self, c: int) -> Item:
        if not self.queues[c]:
            raise ConfigError(
                f"reference executor: input channel {c} ran dry before its end marker (a bug "
                "in the upstream task's schedule)"
            )
        return self.queues[c].popleft()

    def __iter__(self) -> Iterator[tuple[str, int | None, object]]:
        n = len(self.queues)
        if n == 0:
            yield ("end", None, None)
            return
        if n == 1:
            while True:
                kind, value = self._pop(0)
                if kind == "end":
                    yield ("end", None, None)
                    return
                if kind == "data" and value.num_rows == 0:
                    continue
                yield (kind, 0, value)
        while True:
            if all(self.ended):
                yield ("end", None, None)
                return
            c = self.current
            kind, value = self._pop(c)
            if kind == "data":
                rows = value.num_rows
                if rows == 0:
                    continue
                room = self.quantum - self.taken
                if rows > room:
                    self.queues[c].appendleft(("data", value.slice(room)))
                    value = value.slice(0, room)
                self.taken += value.num_rows
                if self.taken >= self.quantum:
                    self._advance()
                yield ("data", c, value)
            elif kind == "hb":
                self._deactivate(c)
                self._advance()
                yield ("hb", c, value)
            else:
                self.ended[c] = True
                if all(self.ended):
                    yield ("end", None, None)
                    return
                self._deactivate(c)
                self._advance()


class Positional:
    """A port of tandem-core's positional merge (the KaZoo follower) over fully known
    channel contents: consume channel ``c`` until its next sequence number is ``s``, for
    each followed order entry ``(c, s)`` in turn. Yields like :class:`LiveRobin`."""

    def __init__(self, queues: list[deque], orders: list[tuple[int, int]]) -> None:
        self.queues = queues
        self.orders = orders

    def __iter__(self) -> Iterator[tuple[str, int | None, object]]:
        n = len(self.queues)
        position, ended = [0] * n, [False] * n
        for c, bound in self.orders:
            while position[c] < bound and not ended[c]:
                if not self.queues[c]:
                    raise ConfigError(
                        f"reference executor: an order runs channel {c} to seq {bound}, past "
                        f"its content ({position[c]} seqs): the order log is not this job's"
                    )
                kind, value = self.queues[c].popleft()
                if kind == "data":
                    if value.num_rows == 0:
                        continue
                    if position[c] + value.num_rows > bound:
                        head = bound - position[c]
                        self.queues[c].appendleft(("data", value.slice(head)))
                        value = value.slice(0, head)
                    position[c] += value.num_rows
                    yield ("data", c, value)
                    continue
                position[c] += 1
                if kind == "hb":
                    yield ("hb", c, value)
                else:
                    ended[c] = True
                    if all(ended):
                        yield ("end", None, None)
                        return
        raise ConfigError(
            "reference executor: the order log ends before every input channel did; was the "
            "run complete?"
        )


class _Emitter:
    """The outputs of one task partition: a router per output edge, appending items to
    the downstream channels."""

    def __init__(self, plan: Plan, task: Task, partition: int, chans: dict) -> None:
        self.targets = []
        for edge in plan.output_edges(task.id, partition):
            lists = []
            for p in edge.partitions:
                key = (task.id, partition, edge.downstream, p)
                lists.append(chans.setdefault(key, []))
            self.targets.append((Router(edge), lists))

    def data(self, batch: pa.RecordBatch | None) -> None:
        if batch is None or batch.num_rows == 0:
            return
        for router, lists in self.targets:
            for c, piece in router.route(batch):
                lists[c].append(("data", piece))

    def control(self, kind: str, value: object) -> None:
        for _, lists in self.targets:
            for items in lists:
                items.append((kind, value))


def _queues(plan: Plan, task: Task, partition: int, chans: dict) -> tuple[list, list]:
    inputs: list[InputChannel] = plan.input_channels(task.id, partition)
    queues = [deque(chans.pop((c.task, c.partition, task.id, partition), [])) for c in inputs]
    return inputs, queues


def run(
    plan: Plan,
    duration: float,
    t0_ns: int = 0,
    chunk_rows: int | None = None,
    orders: dict[tuple[int, int], list[tuple[int, int]]] | None = None,
) -> Result:
    """Run ``plan`` for ``duration`` seconds of source time; return its Result.

    ``chunk_rows`` sets how many rows a source hands on at once (default
    ``plan.batch_rows``). It changes batch boundaries only, never the result: that is
    the property that lets replicas with different batching agree.

    ``orders`` gives, for KaZoo-ordered ``(task, partition)`` s, the order entries a run's
    replicas followed (:func:`tandem.ordering.kazoo.read_orders`): those partitions then
    consume in that order instead of LiveRobin's, so the result is the one output that run
    must have produced."""
    chans: dict[ChannelKey, list[Item]] = {}
    events_in = 0
    events_out = 0
    outputs: dict[str, object] = {}
    first_collect = None
    for task in plan.tasks:
        if task.kind == "source":
            for p in range(task.parallelism):
                out = _Emitter(plan, task, p, chans)
                for step in plan.source_schedule(task.id, p, duration, chunk_rows):
                    if step.kind == "rows":
                        batch = plan.source_batch(task.id, p, step.j0, step.j1, t0_ns)
                        events_in += batch.num_rows
                        out.data(batch)
                    elif step.kind == "heartbeat":
                        out.control("hb", step.epoch)
                    else:
                        out.control("end", None)
        elif task.kind == "operator":
            for p in range(task.parallelism):
                _run_operator(plan, task, p, t0_ns, chans, (orders or {}).get((task.id, p)))
        else:
            parts = []
            for p in range(task.parallelism):
                sink = plan.open_sink(task.id, p)
                _, queues = _queues(plan, task, p, chans)
                for kind, _, value in LiveRobin(queues, plan.quantum_rows):
                    if kind == "data":
                        events_out += value.num_rows
                        sink.write(value)
                parts.append(sink.close())
            outputs[task.name] = task.sink.combine(parts, task.schema)
            if first_collect is None and isinstance(task.sink, Collect):
                first_collect = task.name
    return Result(
        events_in=events_in,
        events_out=events_out,
        output=outputs.get(first_collect) if first_collect else None,
        outputs=outputs,
        t0_ns=t0_ns,
    )


def _run_operator(
    plan: Plan, task: Task, partition: int, t0_ns: int, chans: dict, orders: list | None
) -> None:
    inst = plan.instantiate(task.id, partition, replica=0, t0_ns=t0_ns)
    inputs, queues = _queues(plan, task, partition, chans)
    out = _Emitter(plan, task, partition, chans)
    tracker = WatermarkTracker(len(inputs))
    merge = LiveRobin(queues, plan.quantum_rows) if orders is None else Positional(queues, orders)
    for kind, ch, value in merge:
        if kind == "data":
            out.data(inst.batch(value, inputs[ch].input_index))
        elif kind == "hb":
            before = tracker.current
            now = tracker.observe(ch, value)
            if now is not None:
                for k in range(before + 1, now + 1):
                    out.data(inst.watermark(plan.watermark_ns(k, t0_ns)))
                    out.control("hb", k)
        else:
            out.data(inst.finish())
            out.control("end", None)


def canonical(table: pa.Table) -> pa.Table:
    """``table`` sorted by every column (in column order) — for comparing outputs as
    multisets. Columns pyarrow cannot sort by are left out of the sort key."""
    keys = []
    for f in table.schema:
        t = f.type
        if pa.types.is_nested(t) or pa.types.is_dictionary(t):
            continue
        keys.append((f.name, "ascending"))
    return table.sort_by(keys) if keys else table


__all__ = ["LiveRobin", "Positional", "canonical", "run"]
