"""A worker process of the local engine: ``python -m tandem.engines.worker FD PARENT_PID
[WORKER]``.

The coordinator (:mod:`tandem.engines.local`) starts this module as a fresh interpreter
rather than with ``multiprocessing``, so that the user's main script is never imported
again here: a plain script without an ``if __name__ == "__main__":`` guard works. ``FD`` is
this process's end of a socket pair, a :class:`multiprocessing.connection.Connection`.
The coordinator first sends an :class:`~tandem.engines.protocol.Assign`: the worker's
replicas, the coordinator's ``sys.path`` and the plan as a cloudpickle blob — functions,
lambdas and closures defined in ``__main__`` travel by value, those of importable modules
by reference, found through that ``sys.path``. Then the exchange of
:func:`tandem.engines.exchange.serve`.
``WORKER`` (the worker's index) names the process in its log lines, which go to stderr at
the level in ``TANDEM_LOG_LEVEL`` (:func:`tandem.logs.configure_worker`). A spare process,
started ahead of a loss to rebuild a worker (``Job(restore=True)``), is named ``spare``
until its :class:`~tandem.engines.protocol.Assign` arrives, which names the worker it
becomes.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
from multiprocessing.connection import Connection


def warm_up() -> None:
    """Import what a worker runs and pay pyarrow's lazy imports before the payload comes:
    a spare waits for a loss after this, and its rebuild then waits for none of it (a
    spare runs this on a low-priority thread first: :mod:`tandem.engines.spare`)."""
    from tandem import runtime
    from tandem.engines import exchange, process  # noqa: F401

    runtime._warm_up()


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the coordinator handles Ctrl-C
    argv = sys.argv[1:] if argv is None else argv
    fd, parent = int(argv[0]), int(argv[1])
    worker = argv[2] if len(argv) > 2 else "?"

    from tandem import logs
    from tandem.engines import exchange, process, protocol

    logs.configure_worker(worker)

    process.die_with_parent()
    if os.getppid() != parent:  # the coordinator died before we asked to die with it
        return 1
    os.set_inheritable(fd, False)  # nothing this process starts may hold the link open
    conn = Connection(fd)
    warm_up()
    try:
        assign = protocol.expect(conn.recv(), protocol.Assign, what="to start a worker")
    except EOFError:
        return 1
    protocol.check_version(assign.version, "the coordinator")
    logs.configure_worker(assign.worker)
    path = assign.path
    sys.path[:] = list(path) + [p for p in sys.path if p not in path]
    rids = list(assign.replicas)
    try:
        plan = pickle.loads(assign.plan)
    except BaseException as exc:
        conn.send(
            protocol.StartFailed(
                f"the worker of {rids} could not load the job: {type(exc).__name__}: {exc} "
                "(a function of an importable module is shipped by name: that module must "
                "be importable in the worker process too, from the coordinator's sys.path "
                "and working directory)",
            )
        )
        return 1
    exchange.serve(plan, rids, assign.secret, conn, assign.kazoo, rejoin=assign.rejoin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
