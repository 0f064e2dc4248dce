"""What every process an engine starts shares — a worker, a heartbeat generator: it dies
with its parent, and it gets an environment in which it imports this tandem and logs at
the parent's level."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

from tandem import logs


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no orphans, ever)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):  # libc without prctl: nothing to do
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def child_env() -> dict[str, str]:
    """The environment of a process an engine starts: this one's, with the folder tandem
    was imported from on PYTHONPATH unless the interpreter finds it anyway
    (site-packages), and the log level (``TANDEM_LOG_LEVEL``) of this process's
    ``tandem`` logger unless it is set already."""
    import site

    env = dict(os.environ)
    env[logs.LEVEL_ENV] = logs.driver_level()
    # The folder holding the tandem package: three levels above tandem/engines/process.py.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    default = set(site.getsitepackages()) | {site.getusersitepackages()}
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in default and root not in paths:
        env["PYTHONPATH"] = os.pathsep.join([root, *paths])
    return env


__all__ = ["child_env", "die_with_parent"]
