"""OS priorities of a worker's threads (Linux keeps a niceness per thread): a rebuilt
worker loads its states and catches up at a lower one (:data:`~tandem.runtime.CATCH_UP_NICE`),
and gives every thread the normal priority back once it caught up, where the process may
raise it (:func:`may_raise_priority`)."""

from __future__ import annotations

import os
import threading

import psutil


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
