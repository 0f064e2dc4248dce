"""The experiments of ``tandem bench`` and ``tandem demo``, beside the library: it never
imports them.

One module per experiment, named as ``tandem bench NAME`` names it — :mod:`.mib1`,
:mod:`.throughput`, :mod:`.failover`, :mod:`.recovery`, :mod:`.cost`, :mod:`.paper`,
:mod:`.kafka` — each with ``HELP`` (a line for ``tandem bench --help``),
``add_arguments(parser)`` (its flags, and only its own) and ``main(args)`` (runs it, returns
the exit status); :mod:`.demo` is the job of ``tandem demo``. They share
:mod:`.workloads` (the jobs, the named configurations, the output check, the row of a
latency run) and :mod:`.common` (services, flags, writing results).

An engine package brings its own benchmark as an entry point of the ``tandem.benchmarks``
group, a module of the same shape (the Spark package's is ``tandem bench spark``).
"""

from __future__ import annotations

import argparse
import importlib

from tandem import engines
from tandem.exceptions import ConfigError

BUILTIN = ("mib1", "throughput", "failover", "recovery", "cost", "paper", "kafka")
"""The experiments of this package, in the order ``tandem bench --help`` lists them."""
EXTERNAL = ("spark",)
"""Benchmarks known to come as entry points (listed even when not installed)."""


def add_commands(sub) -> None:
    """A subcommand of ``sub`` (``tandem bench``'s subparsers) per experiment: the built-in
    ones and every benchmark entry point installed; a known one that is not installed
    says how to install it when run."""
    for name in BUILTIN:
        _add(sub, name, importlib.import_module(f"{__name__}.{name}"))
    for name in dict.fromkeys([*EXTERNAL, *engines.entry_points(engines.BENCHMARK_GROUP)]):
        try:
            module = engines.load(engines.BENCHMARK_GROUP, name, "benchmark")
        except ConfigError as exc:
            p = sub.add_parser(name, help=f"(not installed: `tandem bench {name}` says how)")
            p.set_defaults(func=_missing(exc))
        else:
            _add(sub, name, module)


def _add(sub, name: str, module) -> None:
    # The module's first paragraph, its reST quotes as Markdown's.
    description = (module.__doc__ or "").strip().split("\n\n")[0].replace("``", "`")
    p = sub.add_parser(name, help=module.HELP, description=description)
    module.add_arguments(p)
    p.set_defaults(func=module.main)


def _missing(exc: ConfigError):
    def fail(_args: argparse.Namespace) -> int:
        raise exc

    return fail
