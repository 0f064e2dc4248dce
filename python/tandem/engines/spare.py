"""A spare worker process of the local engine, started ahead of a loss to rebuild a worker
(``Job(restore=True)``): ``python PATH/tandem/engines/spare.py FD PARENT_PID WORKER NICE``,
``PATH/tandem/engines/spare.py`` being this file (:data:`PATH`). It then becomes a worker
process, :mod:`tandem.engines.worker` ``FD PARENT_PID WORKER``, waiting for its payload.

A spare is started right after a rebuild, beside the survivors and the rebuilt worker
catching up, and its start is about half a CPU-second of imports. It loads them at the
lowest priority — niceness ``NICE`` (``engines.local.SPARE_NICE``) and ``SCHED_IDLE``, so
that the survivors get a core the moment they need one. It is run by its file, not with
``python -m tandem.engines.spare``, which would import the ``tandem`` package (the core,
pyarrow, numpy) at normal priority before any of this module runs; so nothing here but
the standard library loads before the priority drops, :mod:`tandem.runtime.priority`
included (which imports only the standard library too), loaded from its file. Then every
thread the spare has (numpy's BLAS threads and pyarrow's jemalloc purger among them, which
inherit the priority of the thread that loads those modules) goes back to the normal
priority: where the process may raise a thread's priority (root, or an ``RLIMIT_NICE``
that allows it: :func:`tandem.runtime.may_raise_priority`). Elsewhere numpy and pyarrow
load first, at normal priority, and the rest on a thread of the lowest (Linux keeps a
priority per thread). The spare waits for a loss anyway; every thread it has once loaded
runs at normal priority (``tests/test_restore.py`` checks), and so does the work a rebuild
does once the payload comes.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

PATH = os.path.abspath(__file__)
"""This file: what a spare's command line runs (``[sys.executable, PATH, ...]``)."""


def _priority():
    """:mod:`tandem.runtime.priority`: imported by name where the tandem package is loaded
    already, else loaded from its file (its name would import the package first)."""
    if "tandem" in sys.modules:
        from tandem.runtime import priority

        return priority
    import importlib.util

    engines = os.path.dirname(PATH)
    path = os.path.join(os.path.dirname(engines), "runtime", "priority.py")
    spec = importlib.util.spec_from_file_location("_tandem_spare_priority", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load() -> None:
    """Import what a worker runs (:func:`tandem.engines.worker.warm_up`)."""
    from tandem.engines import worker

    worker.warm_up()


def boot(nice: int) -> None:
    """Load the worker's modules with the calling thread at niceness ``nice`` and
    ``SCHED_IDLE``, then leave every thread of the process at the normal priority (see
    the module documentation)."""
    priority = _priority()
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if priority.may_raise_priority():
        # Everything at the lowest priority, then every thread (the modules' own: numpy's
        # BLAS threads, pyarrow's jemalloc purger) back to the normal one.
        with contextlib.suppress(AttributeError, OSError):
            priority.lowest_priority(threading.get_native_id(), nice)
        _load()
        for tid in priority.thread_ids() or [threading.get_native_id()]:
            with contextlib.suppress(OSError):
                priority.normal_priority(tid, base)
    else:
        # numpy and pyarrow start threads, which get their creator's priority and could
        # not be given the normal one back: they load first, at normal priority, and the
        # rest on a thread of the lowest (Linux keeps a priority per thread).
        import numpy  # noqa: F401
        import pyarrow  # noqa: F401

        def load() -> None:
            with contextlib.suppress(AttributeError, OSError):
                priority.lowest_priority(threading.get_native_id(), nice)
            _load()

        loader = threading.Thread(target=load, name="tandem-spare-load")
        loader.start()
        loader.join()


def main(argv: list[str] | None = None) -> int:
    """``FD PARENT_PID WORKER NICE``: load at niceness ``NICE`` (:func:`boot`), then run
    as the worker process :func:`tandem.engines.worker.main` ``FD PARENT_PID WORKER``."""
    argv = sys.argv[1:] if argv is None else argv
    boot(int(argv[3]))
    from tandem.engines import worker

    return worker.main(argv[:3])


if __name__ == "__main__":
    # Run by its file, the interpreter put this folder first on sys.path, where its
    # modules (worker, process, ...) would shadow any top-level module of those names:
    # the working directory instead, as ``python -m`` has it.
    if sys.path and sys.path[0] == os.path.dirname(PATH):
        sys.path[0] = os.getcwd()
    sys.exit(main())
