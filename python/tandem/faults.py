"""Fault specifications for experiments: which replica to crash, and when.

A fault is data: the engine injects it (the local engine SIGKILLs the replica's process at
``t0 + at`` seconds). Faults are validated against the plan before the run starts, so a
typo in a task name fails at once instead of silently running without the fault.
"""

from __future__ import annotations

import abc
import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from tandem.exceptions import ConfigError

if TYPE_CHECKING:
    from tandem.plan import Plan

ROLES = ("leader", "follower")


@dataclass(frozen=True)
class Fault(abc.ABC):
    """Base class of fault specs."""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": type(self).__name__.lower(), **asdict(self)}

    @abc.abstractmethod
    def validate(self, plan: Plan, duration: float) -> None:
        """Raise ConfigError if this fault cannot apply to ``plan`` run for ``duration``."""


@dataclass(frozen=True)
class ReplicaFault(Fault):
    """A fault hitting one replica of one task partition ``at`` seconds after the start.

    ``replica`` is an index (``0 .. replication-1``) or, with ``ordering="kazoo"``, the
    role ``"leader"`` / ``"follower"`` of that partition at the time of the fault.
    """

    task: str
    partition: int
    replica: int | str
    at: float

    def __post_init__(self) -> None:
        kind = type(self).__name__
        if not isinstance(self.task, str) or not self.task:
            raise ConfigError(f"{kind}: task must be a task name, got {self.task!r}")
        if (
            isinstance(self.partition, bool)
            or not isinstance(self.partition, int)
            or (self.partition < 0)
        ):
            raise ConfigError(
                f"{kind}({self.task!r}): partition must be an int >= 0, got {self.partition!r}"
            )
        if isinstance(self.replica, str):
            if self.replica not in ROLES:
                raise ConfigError(
                    f"{kind}({self.task!r}): replica must be an index or one of {ROLES}, got "
                    f"{self.replica!r}"
                )
        elif (
            isinstance(self.replica, bool)
            or not isinstance(self.replica, int)
            or (self.replica < 0)
        ):
            raise ConfigError(
                f"{kind}({self.task!r}): replica must be an int >= 0 or one of "
                f"{ROLES}, got {self.replica!r}"
            )
        if (
            isinstance(self.at, bool)
            or not isinstance(self.at, int | float)
            or not (math.isfinite(self.at) and self.at >= 0)
        ):
            raise ConfigError(f"{kind}({self.task!r}): at must be seconds >= 0, got {self.at!r}")

    def validate(self, plan: Plan, duration: float) -> None:
        """Check the fault against the plan and the run's duration."""
        kind = type(self).__name__
        names = [t.name for t in plan.tasks]
        if self.task not in names:
            raise ConfigError(
                f"{kind}: job {plan.job!r} has no task {self.task!r}; its tasks are {names}"
            )
        task = plan.task(self.task)
        where = f"{kind}({self.task!r}, partition={self.partition}, replica={self.replica!r})"
        if (
            task.kind == "sink"
            and task.replication < 2
            and not (isinstance(self, Kill) and plan.restarts_sink(task.id))
        ):
            raise ConfigError(
                f"{where}: {self.task!r} is an unreplicated sink, so killing it loses output "
                "by design — kill a source or operator replica, or replicate the sink "
                "(stream.sink(..., replication=2): Collect and file sinks can; a Kafka sink "
                "with Job(restore=True) or checkpoint_ms restarts, from its last commit)"
            )
        if self.partition >= task.parallelism:
            raise ConfigError(
                f"{where}: task {self.task!r} has partitions 0..{task.parallelism - 1}"
            )
        if isinstance(self.replica, str):
            if plan.ordering != "kazoo":
                raise ConfigError(
                    f"{where}: replica roles exist only with ordering='kazoo' (this job uses "
                    f"{plan.ordering!r}); give a replica index instead"
                )
            if plan.inbox_ordering(task.id, self.partition) != "kazoo":
                raise ConfigError(
                    f"{where}: {self.task!r} partition {self.partition} has no leader: only a "
                    "replicated operator with two or more input channels runs a KaZoo "
                    "election; give a replica index, or pick such a task"
                )
        elif self.replica >= task.replication:
            raise ConfigError(f"{where}: task {self.task!r} has replicas 0..{task.replication - 1}")
        if self.at >= duration:
            raise ConfigError(
                f"{where}: at={self.at} s is not before the end of the run (duration={duration} s)"
            )


@dataclass(frozen=True)
class Kill(ReplicaFault):
    """Crash (SIGKILL) one replica of one task partition ``at`` seconds after the start."""


@dataclass(frozen=True)
class Pause(ReplicaFault):
    """Freeze (SIGSTOP) one replica ``at`` seconds after the start and resume it (SIGCONT)
    ``for_s`` seconds later: a stalled machine, a long GC pause. With KaZoo, a leader frozen
    past its session timeout is replaced, and its orders after it wakes are fenced off."""

    for_s: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        f = self.for_s
        if isinstance(f, bool) or not isinstance(f, int | float) or not math.isfinite(f) or f <= 0:
            raise ConfigError(f"Pause({self.task!r}): for_s must be seconds > 0, got {f!r}")


@dataclass(frozen=True)
class KillWorker(Fault):
    """Crash (SIGKILL) worker process ``worker`` — the fault domain, with every replica it
    hosts — ``at`` seconds after the start. Workers are numbered as in
    :meth:`tandem.plan.Plan.placement`; a worker of unreplicated sinks cannot be killed
    (they have no twin; replicated sinks' workers can)."""

    worker: int
    at: float

    def __post_init__(self) -> None:
        w = self.worker
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ConfigError(f"KillWorker: worker must be an int >= 0, got {w!r}")
        at = self.at
        if (
            isinstance(at, bool)
            or not isinstance(at, int | float)
            or not (math.isfinite(at) and at >= 0)
        ):
            raise ConfigError(f"KillWorker({w}): at must be seconds >= 0, got {at!r}")

    def validate(self, plan: Plan, duration: float) -> None:
        placement = plan.placement()
        lone = {t.id for t in plan.sinks() if t.replication < 2}
        killable = [i for i, w in enumerate(placement) if not any(t in lone for t, _, _ in w)]
        if self.worker not in killable:
            raise ConfigError(
                f"KillWorker({self.worker}): job {plan.job!r} runs workers "
                f"0..{len(placement) - 1} on this machine, of which {killable} host replicated "
                "tasks (the others host unreplicated sinks); see Plan.placement()"
            )
        if self.at >= duration:
            raise ConfigError(
                f"KillWorker({self.worker}): at={self.at} s is not before the end of the run "
                f"(duration={duration} s)"
            )


@dataclass(frozen=True)
class KillHeartbeats(Fault):
    """Crash (SIGKILL) heartbeat generator ``generator`` ``at`` seconds after the start.
    The engine runs the generators of a job with Kafka sources (``generators=`` per Kafka
    cluster, 2 by default), numbered from 0 as :func:`tandem.heartbeat.specs` lists them;
    the others' markers keep every source going."""

    generator: int
    at: float

    def __post_init__(self) -> None:
        g = self.generator
        if isinstance(g, bool) or not isinstance(g, int) or g < 0:
            raise ConfigError(f"KillHeartbeats: generator must be an int >= 0, got {g!r}")
        at = self.at
        if (
            isinstance(at, bool)
            or not isinstance(at, int | float)
            or not (math.isfinite(at) and at >= 0)
        ):
            raise ConfigError(f"KillHeartbeats({g}): at must be seconds >= 0, got {at!r}")

    def validate(self, plan: Plan, duration: float) -> None:
        from tandem.heartbeat import specs

        n = len(specs(plan))
        if self.generator >= n:
            raise ConfigError(
                f"KillHeartbeats({self.generator}): job {plan.job!r} runs {n} heartbeat "
                "generators"
                + (f" (0..{n - 1})" if n else ": it has no Kafka source with generators= above 0")
            )
        if self.at >= duration:
            raise ConfigError(
                f"KillHeartbeats({self.generator}): at={self.at} s is not before the end of "
                f"the run (duration={duration} s)"
            )


def validate_faults(faults: list[Any], plan: Plan, duration: float) -> None:
    """Validate every fault; also reject two kills of the same replica or worker, unless
    the job rebuilds what it loses (``restore``). A role (``"leader"``) names whoever
    holds it when the kill comes, so two kills of one role are two replicas."""
    seen = set()
    again = plan.restore
    for f in faults:
        if not isinstance(f, Fault):
            raise ConfigError(f"faults must be tandem fault specs like td.Kill(...), got {f!r}")
        f.validate(plan, duration)
        if isinstance(f, Kill) and not again and not isinstance(f.replica, str):
            target = (f.task, f.partition, f.replica)
            if target in seen:
                raise ConfigError(
                    f"Kill{target}: the same replica is killed twice (it stays lost unless "
                    "the job rebuilds it: Job(restore=True))"
                )
            seen.add(target)
        if isinstance(f, KillWorker) and not again:
            if f.worker in seen:
                raise ConfigError(f"KillWorker({f.worker}): the same worker is killed twice")
            seen.add(f.worker)
        if isinstance(f, KillHeartbeats):
            target = ("heartbeats", f.generator)
            if target in seen:
                raise ConfigError(
                    f"KillHeartbeats({f.generator}): the same generator is killed twice"
                )
            seen.add(target)


__all__ = [
    "ROLES",
    "Fault",
    "Kill",
    "KillHeartbeats",
    "KillWorker",
    "Pause",
    "ReplicaFault",
    "validate_faults",
]


@dataclass(frozen=True)
class Chaos(Fault):
    """Kill a random worker (SIGKILL, every replica it hosts) every ``every_s`` seconds —
    a uniform draw from ``(low, high)`` after the previous kill, seeded by ``seed`` —
    from ``at`` until ``until`` (None: the end of the run), each kill only once every
    partition is back at its full replication: never the last live replica of a
    partition. Meant for jobs that rebuild lost replicas (``Job(restore=True)``); the
    local engine injects it. It picks a sinks' worker only if every sink replica there is
    rebuilt from a twin's copy (:attr:`tandem.sinks.Sink.rebuildable`: ``Collect``); a
    lost copy of another sink is not rebuilt, so a second pick could take the last one."""

    at: float = 2.0
    every_s: tuple[float, float] = (5.0, 10.0)
    seed: int = 0
    until: float | None = None

    def __post_init__(self) -> None:
        low, high = self.every_s if len(self.every_s) == 2 else (None, None)
        if not (isinstance(low, int | float) and isinstance(high, int | float) and 0 < low <= high):
            raise ConfigError(
                f"Chaos: every_s must be (low, high) seconds, 0 < low <= high; got {self.every_s!r}"
            )
        if not (isinstance(self.at, int | float) and math.isfinite(self.at) and self.at >= 0):
            raise ConfigError(f"Chaos: at must be seconds >= 0, got {self.at!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"Chaos: seed must be an int, got {self.seed!r}")

    def validate(self, plan: Plan, duration: float) -> None:
        if plan.replication < 2:
            raise ConfigError(
                "Chaos kills workers of a replicated job; this job has replication=1, so every "
                "kill would lose its partitions"
            )
        if not plan.restore:
            raise ConfigError(
                "Chaos kills a worker again and again: without Job(restore=True) the second "
                "kill of a replica group would lose partitions; set restore=True"
            )
        if self.at >= duration:
            raise ConfigError(
                f"Chaos: at={self.at} s is not before the end of the run (duration={duration} s)"
            )
