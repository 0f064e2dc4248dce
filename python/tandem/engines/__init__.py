"""Execution engines, found through the ``tandem.engines`` entry point group.

An engine is a class whose instances have ``run(plan, duration=, faults=, ...)`` and
return a :class:`tandem.Result`. A package offers one by declaring an entry point in the
``tandem.engines`` group (``name = "module:Class"`` under
``[project.entry-points."tandem.engines"]`` in its ``pyproject.toml``); ``get(name,
**options)`` loads it and constructs it with ``options``. ``Job.run(engine="name")`` and
``tandem demo --engine name`` go through it.

* ``local`` (the default; declared by tandem itself): worker processes on this machine,
  each hosting many replicas (:meth:`tandem.plan.Plan.placement`), talking over Unix
  sockets or TCP on 127.0.0.1.
* ``spark``: declared by the Spark integration (``spark_integration/``): one long-running
  Spark task per worker, on a session it creates for the run and stops after it; pass the
  engine object itself to ``Job.run(engine=...)`` to use a session of your own.

tandem never imports an engine package: engines depend on tandem — on its public modules,
:mod:`tandem.engines.common` being what every engine shares — and not the other way round.
An engine that can run a job until it is stopped says so with ``until_stopped = True`` and
takes ``run(plan, duration=None, stop=Stop())`` (:class:`tandem.engines.common.Stop`; the
local engine can). One whose runs may resume from a savepoint (``Plan.resumed``) and write
durable checkpoints (``Plan.durable_dir``) — the run's coordinator does both, so an engine
that runs :class:`tandem.engines.coordinator.Coordinator` can — says so with ``savepoints
= True`` (both engines do).
The contract is :class:`Engine` (and :class:`StoppableEngine` for one that runs until
stopped), ``typing.Protocol`` s that both engines are checked against
(``tests/test_coordinator.py``); ``Job.run`` refuses an object that is not an ``Engine``.
Benchmarks that an engine package brings are found the same way, in the
``tandem.benchmarks`` group: a module with ``HELP``, ``add_arguments(parser)`` and
``main(args)``, loaded by ``tandem.experiments`` (``tandem bench <name>``), not by the
library.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any, ClassVar, Protocol, runtime_checkable

from tandem.exceptions import ConfigError


@runtime_checkable
class Engine(Protocol):
    """What ``Job.run(engine=...)`` needs of an engine."""

    name: str

    def run(
        self,
        plan: Any,
        duration: float,
        faults: list[Any] = ...,
        *,
        progress: bool | None = None,
        warmup: float = 0.0,
        check: bool = True,
        timeout: float | None = None,
    ) -> Any:
        """Run ``plan`` for ``duration`` seconds of source time with ``faults``; the
        :class:`tandem.Result`."""


@runtime_checkable
class StoppableEngine(Engine, Protocol):
    """An engine that runs a job until it is stopped (``Job.start``, ``run(duration=None)``):
    ``until_stopped`` is true, ``run`` takes ``stop=`` (:class:`tandem.engines.common.Stop`)
    and ``check(plan, duration, faults, **options)`` refuses bad options before a start."""

    until_stopped: ClassVar[bool]

    def check(self, plan: Any, duration: float | None, faults: list[Any] = ..., **options) -> None:
        """Raise ConfigError for options ``run`` cannot honour."""


def stoppable(engine: object) -> bool:
    """Whether ``engine`` runs a job until it is stopped."""
    return isinstance(engine, StoppableEngine) and bool(engine.until_stopped)


ENGINE_GROUP = "tandem.engines"
BENCHMARK_GROUP = "tandem.benchmarks"
DEFAULT = "local"

_BUILTIN = {
    ENGINE_GROUP: {DEFAULT: "tandem.engines.local:LocalEngine"},
    BENCHMARK_GROUP: {},
}
"""What tandem declares itself (``pyproject.toml``), for a tandem imported from a source
tree whose distribution metadata is not installed; installed metadata wins."""

_INSTALL_HINTS = {
    "spark": "the Spark engine and its benchmark come with the tandem-spark package: "
    "`pip install ./spark_integration` from a tandem checkout (`make install` does)",
}


def entry_points(group: str = ENGINE_GROUP) -> dict[str, metadata.EntryPoint]:
    """The installed entry points of ``group`` by name (tandem's own included even when
    its metadata is not installed)."""
    found = {
        name: metadata.EntryPoint(name=name, value=value, group=group)
        for name, value in _BUILTIN[group].items()
    }
    found.update({ep.name: ep for ep in metadata.entry_points(group=group)})
    return found


def available() -> list[str]:
    """The names of the installed engines, the default first."""
    return sorted(entry_points(ENGINE_GROUP), key=lambda name: (name != DEFAULT, name))


def load(group: str, name: str, what: str) -> Any:
    """The object the entry point ``name`` of ``group`` names, imported; a ConfigError
    naming the installed ones (and how to install a known one) if there is no such entry
    point or its package does not import. ``what`` names the kind in the message."""
    found = entry_points(group)
    hint = _INSTALL_HINTS.get(name)
    if name not in found:
        raise ConfigError(
            f"unknown {what} {name!r}; installed: {sorted(found) or 'none'}"
            + (f" ({hint})" if hint else "")
        )
    ep = found[name]
    try:
        return ep.load()
    except ImportError as exc:
        dist = getattr(ep, "dist", None)
        origin = f", from {dist.name} {dist.version}" if dist is not None else ""
        raise ConfigError(
            f"the {name} {what} ({ep.value}{origin}) cannot be loaded: {exc}; "
            + (hint or "reinstall the package that provides it, with its dependencies")
        ) from exc


def get(name: str, **options: Any) -> Any:
    """The engine called ``name``, constructed with ``options`` (for ``spark``: e.g.
    ``master``, the Spark master URL of the session it creates)."""
    return load(ENGINE_GROUP, name, "engine")(**options)


__all__ = [
    "BENCHMARK_GROUP",
    "DEFAULT",
    "ENGINE_GROUP",
    "Engine",
    "StoppableEngine",
    "available",
    "entry_points",
    "get",
    "load",
    "stoppable",
]
