"""Live rescale: the pure decisions (DESIGN: live rescale of a keyed operator task).

``RunningJob.rescale(task, m)`` changes a keyed operator task ``T`` from ``n`` to ``m``
partitions while the job runs. The switch happens right after one heartbeat ``K``: the
tasks feeding ``T`` route their rows after heartbeat ``K`` over ``m`` channels, ``T``'s
partitions are cut at ``K`` and their states split by key group over the ``m`` new ones,
and ``T``'s consumers append the new partitions' channels, which take turns from the end
of heartbeat cycle ``K``. Channels of the partitions that go on (``q < n``) keep their
identity and their sequence numbers; only the new ones start at 0.

What is here decides, with no engine in sight: whether a task can be rescaled so
(:func:`check`), the plan the job has afterwards (:func:`after`), and which key entries
each new partition starts with (:func:`split_entries`, which
:func:`tandem.savepoints.rescale` uses for a rescale at resume time too).
:func:`tandem.reference.run` replays a plan's :attr:`~tandem.plan.Plan.live_rescales`
with these rules.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

from tandem.exceptions import ConfigError
from tandem.plan import LiveRescale, Plan, Task, key_group, key_group_channel

_STOP_AND_RESUME = "stop with a savepoint and resume at"


def check(plan: Plan, task: int | str, parallelism: int) -> Plan:
    """Raise ConfigError naming the cause unless ``task`` of a job running ``plan`` can go
    live to ``parallelism`` partitions; return the plan it then runs
    (:meth:`Plan.rescaled`). The first version rescales only:

    * an operator task (a source's partitions or a sink's are not keyed state),
    * of a job ordered by LiveRobin at replication 2 or more (a KaZoo leader's orders name
      the channels it had; the switch relies on the twins of every partition),
    * whose every input is keyed (``key_by``), so that each key group's rows and state
      move together, and none of whose outputs is a forward edge,
    * with no log (Kafka) source upstream (its heartbeats are where the log's markers are,
      not a point the job can hold its sources before) and no restartable (Kafka) sink
      fed by it (its commits store where its input stood, channel by channel),
    * whose state is kept per key (:meth:`~tandem.operators.Operator.keyed_state`),
    * whose channels are the last of each consumer's inputs, so that the consumer's
      channels afterwards are its channels before with the new ones appended,
    * to more partitions than it has (shrinking is not supported yet).
    """
    t = plan.task(task)
    what = t.describe()
    if t.kind != "operator":
        raise ConfigError(
            f"{what} cannot be rescaled while the job runs: only an operator task can (a "
            "source's or a sink's partitions hold no keyed state to split)"
        )
    n = t.parallelism
    if parallelism == n:
        raise ConfigError(f"{what} has {n} partitions already: nothing to rescale")
    if isinstance(parallelism, int) and not isinstance(parallelism, bool) and parallelism < n:
        raise ConfigError(
            f"{what} has {n} partitions, asked for {parallelism}: shrinking a running task is "
            f"not supported yet; {_STOP_AND_RESUME} the smaller parallelism"
        )
    if plan.ordering == "kazoo":
        raise ConfigError(
            f"{what} cannot be rescaled while the job runs with ordering='kazoo': its "
            f"leaders' orders name the channels they had; {_STOP_AND_RESUME} "
            f"parallelism {parallelism}"
        )
    if t.replication < 2:
        raise ConfigError(
            f"{what} runs at replication {t.replication}: a live rescale needs replication "
            f"2 or more; {_STOP_AND_RESUME} parallelism {parallelism}"
        )
    for e in t.inputs:
        if e.partitioner != "hash":
            raise ConfigError(
                f"{what} cannot be rescaled while the job runs: its input from "
                f"{plan.tasks[e.upstream].name!r} is a {e.partitioner} edge, not keyed; "
                "key_by() its input so that every key's rows follow its state"
            )
    forward = _forward_out(plan, t)
    if forward is not None:
        raise ConfigError(
            f"{what} cannot be rescaled while the job runs: its output to {forward.describe()} "
            f"is a forward edge, partition for partition; give {forward.name!r} the keyed "
            "or rebalanced input of another parallelism"
        )
    logs = [plan.tasks[s].name for s in sorted(_upstream(plan, t.id)) if _is_log(plan, s)]
    if logs:
        raise ConfigError(
            f"{what} cannot be rescaled while the job runs: it reads the log source "
            f"{logs[0]!r}, whose heartbeats are where the log's markers are; "
            f"{_STOP_AND_RESUME} parallelism {parallelism}"
        )
    for down, _ in plan.consumers(t.id):
        if down.kind == "sink" and down.sink.restartable:
            raise ConfigError(
                f"{what} cannot be rescaled while the job runs: it feeds the restartable "
                f"{down.describe()}, whose commits store where its input stood on every "
                f"channel; {_STOP_AND_RESUME} parallelism {parallelism}"
            )
    if copy.deepcopy(t.operator).keyed_state() is None:
        raise ConfigError(
            f"{what} cannot be rescaled: {t.operator.describe()} keeps a state that is not "
            "per key (keyed_state() is None); implement keyed_state() and restore_keyed() "
            "to rescale it"
        )
    new = plan.rescaled(t.id, parallelism)
    for down, _ in plan.consumers(t.id):
        for d in range(down.parallelism):
            before = plan.input_channels(down.id, d)
            appended = [c for c in new.input_channels(down.id, d) if c not in before]
            if new.input_channels(down.id, d) != before + appended:
                raise ConfigError(
                    f"{what} cannot be rescaled while the job runs: its channels are not the "
                    f"last of {down.describe()}'s inputs (ordered by input, task, partition), "
                    "so its new partitions' channels cannot be appended to them; "
                    f"{_STOP_AND_RESUME} parallelism {parallelism}"
                )
    return new


def after(plan: Plan, task: int | str, parallelism: int, epoch: int) -> Plan:
    """The plan of a job running ``plan`` once ``task`` went live to ``parallelism``
    partitions right after heartbeat ``epoch``: :func:`check`'s plan with the rescale added
    to :attr:`~tandem.plan.Plan.live_rescales`. ConfigError as :func:`check`, and for an
    epoch below 1 or not after the previous live rescale's."""
    last = plan.live_rescales[-1].epoch if plan.live_rescales else 0
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch <= last:
        raise ConfigError(
            f"a live rescale happens after a heartbeat epoch above {last} (the previous "
            f"rescale's, or the start), got {epoch!r}"
        )
    new = check(plan, task, parallelism)
    t = plan.task(task)
    step = LiveRescale(t.name, epoch, t.parallelism, parallelism)
    return dataclasses.replace(new, live_rescales=(*plan.live_rescales, step))


def split_entries(
    task: Task, keyed: Sequence[dict], key_groups: int, parallelism: int, whose: str
) -> list[dict]:
    """Per partition of ``task`` at ``parallelism``, the key entries it starts with: those
    of ``keyed`` (partition ``p``'s :meth:`~tandem.operators.Operator.keyed_state` at the
    old parallelism ``len(keyed)``) whose key group it owns, in old-partition order and
    then each entry's order in its dict (so the split is a function of the states alone,
    the same in every replica). A None key (null keys go to channel 0) stays with
    partition 0. ConfigError when an entry is no key value, or is held by a partition that
    did not own its group; ``whose`` names the states in it (``"the saved state"``)."""
    was = len(keyed)
    out: list[dict] = [{} for _ in range(parallelism)]
    for p, entries in enumerate(keyed):
        for k, v in entries.items():
            try:
                g = None if k is None else key_group(k, key_groups)
            except ConfigError as exc:
                raise ConfigError(
                    f"{task.describe()}: {whose} of its partition {p} holds an entry that is no "
                    f"key of its input: {exc}; keyed_state() must return entries keyed by the "
                    "input's key values"
                ) from None
            owner = 0 if g is None else key_group_channel(g, key_groups, was)
            if owner != p:
                raise ConfigError(
                    f"{task.describe()}: {whose} of its partition {p} holds an entry for "
                    f"{k!r}, a key of partition {owner} (key group {g}): keyed_state() must "
                    "return entries keyed by the input's key values"
                )
            q = 0 if g is None else key_group_channel(g, key_groups, parallelism)
            out[q][k] = v
    return out


def split_states(
    task: Task, states: Sequence[bytes], key_groups: int, parallelism: int, epoch: int
) -> list[bytes]:
    """The states of ``task``'s partitions at ``parallelism`` from its old partitions'
    snapshots at heartbeat ``epoch`` (``states[p]``, in partition order): each loaded into a
    copy of the operator (never opened) to read its
    :meth:`~tandem.operators.Operator.keyed_state`, the entries split by key group
    (:func:`split_entries`), and each new partition's restored with ``restore_keyed`` into
    another copy and snapshotted."""
    whose = f"the state at heartbeat {epoch}"
    keyed = []
    for p, data in enumerate(states):
        op = copy.deepcopy(task.operator)
        op.restore(data)
        kv = op.keyed_state()
        if kv is None:
            raise ConfigError(
                f"{task.describe()}: {whose} of its partition {p} is not per key "
                f"(keyed_state() is None); implement keyed_state() and restore_keyed() to "
                "rescale it"
            )
        keyed.append(kv)
    out = []
    for entries in split_entries(task, keyed, key_groups, parallelism, whose):
        op = copy.deepcopy(task.operator)
        op.restore_keyed(entries)
        out.append(op.snapshot())
    return out


def _forward_out(plan: Plan, t: Task) -> Task | None:
    """A consumer ``t`` feeds over a forward edge, if any."""
    return next((d for d, e in plan.consumers(t.id) if e.partitioner == "forward"), None)


def _upstream(plan: Plan, task_id: int) -> set[int]:
    """Every task whose output reaches ``task_id``."""
    seen: set[int] = set()
    todo = [e.upstream for e in plan.tasks[task_id].inputs]
    while todo:
        u = todo.pop()
        if u not in seen:
            seen.add(u)
            todo += [e.upstream for e in plan.tasks[u].inputs]
    return seen


def _is_log(plan: Plan, task_id: int) -> bool:
    return plan.tasks[task_id].kind == "source" and plan.is_log_source(task_id)


__all__ = ["after", "check", "split_entries", "split_states"]
