"""``tandem savepoint``: a savepoint of a job that ``tandem run`` runs until stopped, asked
for from another shell.

A run until stopped with ``control=True`` (``tandem run`` passes it) listens on a Unix
socket, ``<runtime dir>/tandem-<uid>/<job>.<pid>.sock`` (the runtime dir:
``$XDG_RUNTIME_DIR``, else the temporary directory; the ``tandem-<uid>`` folder is the
user's alone, mode 0700), for one request per connection — one line of JSON,
``{"savepoint": PATH, "stop": bool}`` — and answers with one line once the savepoint is
written: ``{"path", "epoch", "source_time_s"}``, or ``{"error"}`` saying why it was not.
:func:`ask` is the client: it finds the socket of the job named (or the only one running)
and returns the answer. A socket whose process is gone is removed when found.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from tandem.exceptions import ConfigError, TandemError

SAVEPOINT_TIMEOUT_S = 120.0
"""How long a request waits for its savepoint to be written."""


def folder() -> Path:
    """Where the sockets of this user's runs are."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"tandem-{os.getuid()}"


def _socket_name(job: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in job)
    return f"{safe}.{os.getpid()}.sock"


class ControlServer:
    """The listening side, for one run: ``savepoint(path, stop)`` is the run's
    :meth:`tandem.engines.common.Stop.savepoint`; ``on_stop`` gets the future of a
    savepoint that stops the run (the run reports it as its ``Result.savepoint``)."""

    def __init__(
        self,
        job: str,
        savepoint: Callable[[str, bool], Future],
        on_stop: Callable[[Future], None] | None = None,
    ) -> None:
        self.job = job
        self._savepoint = savepoint
        self._on_stop = on_stop
        where = folder()
        where.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(where, 0o700)
        self.path = where / _socket_name(job)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(self.path))
        self._sock.listen(4)
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="tandem-control", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(
                target=self._answer, args=(conn,), name="tandem-control-request", daemon=True
            ).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                request = json.loads(_read_line(conn))
                path, stop = str(request["savepoint"]), bool(request.get("stop", False))
                from tandem import savepoints

                savepoints.check_target(path)
                future = self._savepoint(path, stop)
                if stop and self._on_stop is not None:
                    self._on_stop(future)
                sp = future.result(SAVEPOINT_TIMEOUT_S)
                reply: dict[str, Any] = {
                    "path": sp.path,
                    "epoch": sp.epoch,
                    "source_time_s": sp.source_time_s,
                }
            except Exception as exc:  # said to the asker, whatever it is
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            with contextlib.suppress(OSError):
                conn.sendall((json.dumps(reply) + "\n").encode())

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def _read_line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return data.decode()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _listening(path: Path) -> bool:
    """Whether a process listens on the socket at ``path``: a run SIGKILLed leaves its
    socket behind, and its PID may be another process's by now."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True  # there, but busy: not stale
    finally:
        probe.close()
    return True


def running() -> list[tuple[str, int, Path]]:
    """``(job, pid, socket)`` of every run of this user listening; stale sockets (their
    process gone, or its PID reused by a process that does not listen there) are
    removed."""
    out = []
    where = folder()
    if not where.is_dir():
        return out
    for path in sorted(where.glob("*.sock")):
        job, _, pid = path.name[: -len(".sock")].rpartition(".")
        if not pid.isdigit():
            continue
        if not _alive(int(pid)) or not _listening(path):
            with contextlib.suppress(OSError):
                path.unlink()
            continue
        out.append((job, int(pid), path))
    return out


def ask(path: str, job: str | None = None, stop: bool = False, timeout: float | None = None):
    """Ask the run of ``job`` (None: the only run listening) for a savepoint at ``path``
    (``stop``: and to stop there); its answer (a dict: ``path``, ``epoch``,
    ``source_time_s``). ConfigError when no run (or more than one, and no ``job``)
    listens, TandemError when the savepoint was not taken."""
    runs = running()
    found = [r for r in runs if job is None or r[0] == job]
    if not found:
        listening = ", ".join(f"{j!r} (pid {p})" for j, p, _ in runs) or "none"
        who = f"a job named {job!r}" if job else "a job"
        raise ConfigError(
            f"no `tandem run` of {who} is running until stopped on this machine (listening: "
            f"{listening}); start one with `tandem run job.py` (no --duration)"
        )
    if len(found) > 1:
        names = ", ".join(f"{j!r} (pid {p})" for j, p, _ in found)
        raise ConfigError(f"several runs listen ({names}); name one with --job NAME")
    name, pid, where = found[0]
    absolute = path if "://" in path else os.path.abspath(path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout if timeout is not None else SAVEPOINT_TIMEOUT_S + 10)
        try:
            sock.connect(str(where))
        except OSError as exc:
            raise TandemError(f"job {name!r} (pid {pid}) did not answer: {exc}") from exc
        sock.sendall((json.dumps({"savepoint": absolute, "stop": stop}) + "\n").encode())
        line = _read_line(sock)
    if not line:
        raise TandemError(f"job {name!r} (pid {pid}) closed the connection without answering")
    reply = json.loads(line)
    if "error" in reply:
        raise TandemError(f"job {name!r} (pid {pid}): {reply['error']}")
    reply["job"], reply["pid"] = name, pid
    return reply
