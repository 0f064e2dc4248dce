"""OS priorities of a worker's threads (Linux keeps a niceness per thread): a rebuilt
worker loads its states and catches up at a lower one (:data:`~tandem.runtime.CATCH_UP_NICE`),
a spare loads its modules at the lowest (:mod:`tandem.engines.spare`), and both give every
thread the normal priority back where the process may raise it (:func:`may_raise_priority`).

This module imports only the standard library at its top: a spare loads it from its file,
before the tandem package (:mod:`tandem.engines.spare`)."""

from __future__ import annotations

import os
import threading


def may_raise_priority() -> bool:
    """Whether this process may give a thread back a priority it lowered (``nice``):
    root (``CAP_SYS_NICE``), or an ``RLIMIT_NICE`` that allows the process's niceness."""
    if not hasattr(os, "getpriority"):
        return False
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NICE)[0]
    base = os.getpriority(os.PRIO_PROCESS, 0)
    return os.geteuid() == 0 or soft == resource.RLIM_INFINITY or 20 - soft <= base


def thread_nice(more: int) -> int | None:
    """Add ``more`` to the calling thread's niceness (Linux keeps one per thread); the
    niceness it had, or None if it could not."""
    tid = threading.get_native_id()
    try:
        before = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, before + more))
    except (AttributeError, OSError):
        return None
    return before


def thread_ids() -> list[int] | None:
    """The native ids of this process's threads, or None where they cannot be listed (or
    are no ids that ``os.setpriority`` takes: outside Linux)."""
    # Imported here, not at the top: a spare imports this module before it lowers its
    # priority, and lists its threads only once its modules loaded.
    import psutil

    if not psutil.LINUX:
        return None
    try:
        return [t.id for t in psutil.Process().threads()]
    except (psutil.Error, OSError):
        return None


def renice_threads(nice: int) -> None:
    """Give the calling thread niceness ``nice`` again, and every thread of this process
    at the niceness it had (the threads it started meanwhile inherited it: the socket
    reactor's, the links' writers', a log reader's)."""
    me = threading.get_native_id()
    try:
        was = os.getpriority(os.PRIO_PROCESS, me)
    except (AttributeError, OSError):
        was = None
    tids = thread_ids() if was is not None else None
    if tids is None:
        tids, was = [me], None
    for tid in tids:
        try:
            if tid == me or os.getpriority(os.PRIO_PROCESS, tid) == was:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:  # ended meanwhile, or not permitted
            pass


def lowest_priority(tid: int, nice: int) -> None:
    """Run thread ``tid`` at niceness ``nice`` and, where there is one, the idle scheduling
    class (``SCHED_IDLE``: it runs only when a core has nothing else to run)."""
    os.setpriority(os.PRIO_PROCESS, tid, nice)
    if hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))


def normal_priority(tid: int, nice: int) -> None:
    """Give thread ``tid`` the normal scheduling class back, at niceness ``nice``."""
    if hasattr(os, "SCHED_OTHER"):
        os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
    os.setpriority(os.PRIO_PROCESS, tid, nice)
