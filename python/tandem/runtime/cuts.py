"""Cuts: a replica's state at a heartbeat-cycle boundary, what a replica rebuilt from a
live twin (or rolled back to a checkpoint) starts from (DESIGN §4), and the forked child
that writes a large one to a file (:func:`fork_cuts`) while the worker goes on."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("tandem")

#: How long a child writing a cut's state may take (:meth:`Resume.written`).
WRITER_TIMEOUT_S = 60.0
#: Whether a rebuild's cut snapshots the operator's state in a forked child
#: (:meth:`Replica.forks`, :func:`fork_cuts`): Linux only, where fork is cheap and the usual start.
FORK_CUTS = sys.platform == "linux"
#: How long a slot cut for a rebuild waits, held, for the other slots of its worker asked
#: for in the same rebuild, so that one fork writes every state (:meth:`SlotCuts.take`).
HOLD_CUTS_S = 0.02
#: The niceness of a child writing a cut's state (``os.nice``; 0: its parent's), and of a
#: worker's thread writing a savepoint's.
CHILD_NICE = 19
#: The pieces a state is hashed and written in (:meth:`Resume.checkpointed`).
WRITE_CHUNK = 1 << 20
#: Beside a state file a forked child wrote and hashed (``fork_cuts(digest=True)``), the
#: file holding its SHA-256 in hex until :meth:`Resume.written` reads it.
SHA256_SUFFIX = ".sha256"

#: A rebuild's cut of a state known to be at most this large (``Operator.state_size``)
#: is snapshotted in place rather than in a forked child: the fork of a worker costs it
#: 3.5-4 ms here (its page tables, whatever the state), then copy-on-write faults while
#: the child lives, where copying 2 MiB of arrays takes well under a millisecond.
INLINE_CUT_BYTES = 2 << 20


class CutWriter:
    """A forked child writing the states of one or more cuts (:func:`fork_cuts`): waited
    for once, by whichever of its cuts is sent first; the others read the same outcome."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._lock = threading.Lock()
        self._code: int | None = None

    def wait(self, timeout: float = WRITER_TIMEOUT_S) -> int:
        """The child's exit code (killed, and not 0, after ``timeout``)."""
        with self._lock:
            if self._code is None:
                self._code = self._reap(timeout)
            return self._code

    def _reap(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            if time.monotonic() > deadline:
                with contextlib.suppress(OSError):
                    os.kill(self.pid, 9)
                os.waitpid(self.pid, 0)
                log.warning("writing a cut's state took over %g s: abandoned", timeout)
                return -9
            time.sleep(0.002)

    def __repr__(self) -> str:
        return f"CutWriter(pid={self.pid}, exit={self._code})"


@dataclass(frozen=True)
class Resume:
    """What a replica rebuilt while the job runs starts from, taken from a live twin at a
    heartbeat-cycle boundary (DESIGN §4): ``cut``, the core's part (the heartbeat epoch,
    input positions and merge state, output seqs; opaque here) and ``state``, the
    operator's :meth:`~tandem.operators.Operator.snapshot`. A large state travels as a
    file instead (``state_file``, written by the twin's worker, read once and removed by
    the rebuilt replica's): it then crosses no process but the two that need it. A
    checkpoint's state file (``Job(checkpoint_ms=...)``) belongs to the checkpoint
    (``keep_file``): read, never removed by the replica. ``writer``: the child process
    still writing ``state_file`` (:func:`fork_cuts`); wait for it with :meth:`written`
    before the cut goes anywhere."""

    cut: tuple
    state: bytes
    state_file: str | None = None
    keep_file: bool = False
    writer: CutWriter | None = None
    forked_with: int = 0
    """How many states the forked child that wrote this one wrote in all (one fork for
    every cut of a rebuild in a worker: :func:`fork_cuts`); 0: not written by a child."""
    savepoint: bool = False
    """Cut from a savepoint (:mod:`tandem.savepoints`), for a job resumed from it: an
    operator is created and its state loaded as it starts; a sink starts with no output,
    its input positions at the cut's."""
    sha256: str | None = None
    """The SHA-256 (hex) of ``state_file``, when it was computed as the file was written
    (:meth:`checkpointed` with ``digest``): a savepoint's manifest takes it as it is."""
    filesystem: Any = None
    """The ``pyarrow.fs`` filesystem ``state_file`` is on, when it is not the local one (a
    savepoint's state read where the savepoint is); None: a local path."""

    def written(self, inline_below: int = 0, timeout: float = WRITER_TIMEOUT_S) -> Resume | None:
        """Wait for the child writing the state file; this cut without it — a state under
        ``inline_below`` bytes read back into the cut and its file removed — or None if
        the child failed (or took longer than ``timeout``: it is killed): the caller then
        reports the cut as not taken and a later one is tried."""
        if self.writer is None:
            return self
        code = self.writer.wait(timeout)
        path = self.state_file
        if code != 0 or path is None:
            if path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            return None
        sha256 = None
        with contextlib.suppress(FileNotFoundError):  # fork_cuts(digest=True)
            with open(path + SHA256_SUFFIX) as f:
                sha256 = f.read().strip()
            os.unlink(path + SHA256_SUFFIX)
        if os.path.getsize(path) < inline_below:
            with open(path, "rb") as f:
                state = f.read()
            os.unlink(path)
            return Resume(self.cut, state, forked_with=self.forked_with)
        return Resume(
            self.cut, b"", path, self.keep_file, forked_with=self.forked_with, sha256=sha256
        )

    @property
    def epoch(self) -> int:
        """The heartbeat after which the rebuilt replica takes over."""
        return self.cut[0]

    @property
    def order_log_offset(self) -> int | None:
        """KaZoo: the order log offset the twin had read through at the cut (None for the
        other orders); the rebuilt replica's reader may start there or before."""
        inbox = self.cut[2]
        log = inbox[5] if inbox is not None else None
        return log[3] if log is not None else None

    def spilled(self, folder: str) -> Resume:
        """This cut with its state written to a new file in ``folder``, for the rebuilt
        replica to read and remove."""
        fd, path = tempfile.mkstemp(dir=folder, suffix=".state")
        os.close(fd)
        try:
            return self._to_file(path, keep=False)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise

    def checkpointed(self, path: str, digest: bool = False) -> Resume:
        """This cut with its state written to ``path``, a checkpoint's file, which stays;
        ``digest``: its SHA-256 computed as it is written (:attr:`sha256`). A state a
        forked child wrote to a local file (:func:`fork_cuts`, waited for with
        :meth:`written`) is moved there, its SHA-256 the child's."""
        if self.state_file is not None and self.filesystem is None:
            if digest and self.sha256 is None:
                raise ValueError(f"{self.state_file}: a state file with no SHA-256 to move")
            os.replace(self.state_file, path)
            return Resume(self.cut, b"", path, keep_file=True, sha256=self.sha256)
        return self._to_file(path, keep=True, digest=digest)

    def _to_file(self, path: str, keep: bool, digest: bool = False) -> Resume:
        # Written whole under a temporary name first: a file that exists is complete.
        part = path + ".part"
        sha = hashlib.sha256() if digest else None
        try:
            with open(part, "wb") as f:
                if sha is None:
                    f.write(self.state)
                else:  # in pieces: the GIL is free while each is hashed and written
                    view = memoryview(self.state)
                    for at in range(0, len(view), WRITE_CHUNK):
                        piece = view[at : at + WRITE_CHUNK]
                        sha.update(piece)
                        f.write(piece)
            os.replace(part, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(part)
            raise
        return Resume(
            self.cut,
            b"",
            path,
            keep_file=keep,
            sha256=None if sha is None else sha.hexdigest(),
        )

    def load(self) -> bytes:
        """The state: in the message, or read from its file."""
        if self.state_file is None:
            return self.state
        if self.filesystem is not None:
            with self.filesystem.open_input_stream(self.state_file) as f:
                return f.read()
        with open(self.state_file, "rb") as f:
            return f.read()


def fork_cuts(cuts: list[tuple[Any, tuple, str]], digest: bool = False) -> list[Resume]:
    """The cuts ``(replica, cut, folder)`` — each :class:`~tandem.runtime.Replica` stopped
    at its cut — with their operators' states snapshotted and written, each to a new file
    in its folder, by one forked child (:meth:`Replica.forks`): one fork of the worker,
    whatever the number of states. The child runs only ``snapshot()`` and the writes, at
    the lowest priority, so what other threads held at the fork does not matter.
    ``digest`` (a savepoint's states): the child also hashes each state as it writes it and
    leaves the SHA-256 beside the file, which :meth:`Resume.written` takes into the cut."""
    paths = []
    for _, _, folder in cuts:
        # A savepoint's folder may not be on this host yet (as the writer thread's makedirs).
        os.makedirs(folder, exist_ok=True)
        fd, path = tempfile.mkstemp(dir=folder, suffix=".state")
        os.close(fd)
        paths.append(path)
    with warnings.catch_warnings():
        # Python 3.12+ warns of fork in a threaded process: the child runs only the
        # operators' snapshot() and file writes, then leaves by os._exit.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            # Lowest priority: the replicas its parent serves, and their twins, get the
            # cores first; it has until WRITER_TIMEOUT_S.
            with contextlib.suppress(OSError):
                os.nice(CHILD_NICE)
            for (rep, cut, _), path in zip(cuts, paths, strict=True):
                written = Resume(cut, rep._inst.snapshot())._to_file(path, False, digest)
                if digest:
                    with open(path + SHA256_SUFFIX, "w") as f:
                        f.write(written.sha256)
            code = 0
        finally:
            os._exit(code)
    writer = CutWriter(pid)
    return [
        Resume(cut, b"", path, writer=writer, forked_with=len(cuts))
        for (_, cut, _), path in zip(cuts, paths, strict=True)
    ]


class SlotCuts:
    """The cuts a worker was asked for, by slot of its core (``_core.Worker``): a
    rebuild's (:meth:`ask`; each handed to :attr:`on_cut` with its token) and a
    checkpoint's aligned ones (:meth:`ask_checkpoint`; to :attr:`on_checkpoint`). The core
    stops a slot at its next heartbeat-cycle boundary and the worker thread takes the cut
    there (:meth:`take`); the cuts of one rebuild that fork are written by one child
    (:meth:`release_held`). Every method runs on the worker thread."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.on_cut = None
        """Called (from the worker thread) with ``(rid, Resume | None, token)`` for every
        cut taken on the engine's request (a cut whose ``writer`` is set is still being
        written: :meth:`Resume.written`)."""
        self.state_folder = lambda token: None
        """The folder where the state of the cut asked for with ``token`` should be
        written (None: it travels in the cut): the replica's state is then snapshotted in
        a forked child where :meth:`Replica.forks` says so (:func:`fork_cuts`)."""
        self.on_checkpoint = None
        """Called (from the worker thread) with ``(rid, epoch, Resume | None)`` for every
        replica cut for checkpoint ``epoch`` (:meth:`ask_checkpoint`; None: too late, or
        the replica finished)."""
        self.asked: dict[int, list] = {}  # slot -> tokens of the cuts asked of it
        self.held: dict[int, tuple[Any, tuple, str, float]] = {}
        """Slots held at a rebuild's cut (``Worker.hold``) until their siblings are cut too
        (:meth:`take`): slot -> (replica, cut, state folder, monotonic time held)."""
        self.checkpoints: dict[int, int] = {}  # slot -> the checkpoint epoch asked of it
        self.on_savepoint = None
        """Called (from the worker thread) with ``(rid, epoch, Resume | None)`` for every
        replica cut for the savepoint at heartbeat ``epoch`` (:meth:`ask_savepoint`)."""
        self.savepoints: dict[int, int] = {}  # slot -> the savepoint epoch asked of it
        self.rolls: set[int] = set()  # slots whose savepoint cut closes a sink's part
        self.savepoint_folders: dict[int, str] = {}
        """Savepoint epoch -> the folder its states are written to, where a large one's
        forked child writes it (:meth:`take`); the last few asked."""

    def ask(self, rid: tuple[int, int, int], rep: Any, token) -> None:
        """Have the core cut replica ``rid`` (hosted as ``rep``, None if it is not) at its
        next heartbeat-cycle boundary, for :attr:`on_cut` with ``token``."""
        if rep is None or rep.slot is None or rep.done:
            self.on_cut(rid, None, token)
            return
        self.asked.setdefault(rep.slot, []).append(token)
        self.core.request_cut(rep.slot)

    def ask_checkpoint(self, replicas: list, epoch: int) -> None:
        """Have the core cut every replica of ``replicas`` but the sinks right after it
        forwards heartbeat ``epoch``, for :attr:`on_checkpoint`."""
        for rep in replicas:
            if rep.task.kind == "sink":
                continue  # sinks keep their rows: a replayed row is a duplicate there
            if rep.slot is None or rep.done:
                self.on_checkpoint(rep.me, epoch, None)
                continue
            self.checkpoints[rep.slot] = epoch  # replaces one not taken yet
            self.core.request_cut_at(rep.slot, epoch)

    def ask_savepoint(
        self,
        replicas: list,
        epoch: int,
        roll: bool = False,
        leaders_hold=frozenset(),
        folder: str | None = None,
    ) -> None:
        """Have the core cut every replica of ``replicas`` — sinks too: their input
        positions are where a resumed sink starts — right after it forwards heartbeat
        ``epoch``, for :attr:`on_savepoint`; ``roll`` (a durable checkpoint): a sink that
        commits at checkpoints closes its part at that cut. One in ``leaders_hold`` that
        leads its KaZoo partition now is not cut: it holds its orders at ``epoch`` for
        its twins' cuts (``tandem._core.OrderFeed.hold_at``) and answers with none. The
        coordinator never asks for a savepoint's cuts and a checkpoint's at once (the core
        keeps one aligned cut per slot). ``folder``: where the savepoint's states go; an
        operator's state that is not known to be small is snapshotted and written there by
        a forked child, as a rebuild's (:meth:`Replica.forks`)."""
        if folder is not None:
            self.savepoint_folders[epoch] = folder
            for old in sorted(self.savepoint_folders)[:-4]:  # taken long ago
                del self.savepoint_folders[old]
        for rep in replicas:
            if rep.slot is None or rep.done:
                self.on_savepoint(rep.me, epoch, None)
                continue
            orderer = rep.orderer
            if rep.me in leaders_hold and orderer is not None and orderer.leading() is not None:
                orderer.feed.hold_at(epoch)
                self.on_savepoint(rep.me, epoch, None)
                continue
            self.savepoints[rep.slot] = epoch
            if roll:
                self.rolls.add(rep.slot)
            else:
                self.rolls.discard(rep.slot)
            self.core.request_cut_at(rep.slot, epoch)

    def retire(self, rep: Any) -> None:
        """``rep`` finished (its slot retired): the cuts asked of it are not taken."""
        for token in self.asked.pop(rep.slot, []):  # no boundary will come any more
            self.on_cut(rep.me, None, token)
        epoch = self.checkpoints.pop(rep.slot, None)
        if epoch is not None:
            self.on_checkpoint(rep.me, epoch, None)
        epoch = self.savepoints.get(rep.slot)
        if epoch is not None and self.core.slot_stats()[rep.slot]["watermark"] < epoch:
            del self.savepoints[rep.slot]  # ended before the savepoint's heartbeat
            self.on_savepoint(rep.me, epoch, None)
        # else its cut was taken as it forwarded the heartbeat (a source ends right after
        # its last one), and the core hands it out next (Worker.run drains it).

    def take(self, rep: Any, item) -> None:
        """The core stopped ``rep`` at a boundary (``item``, a ``"cut"`` work item): take
        the cuts asked of it there."""
        if item.at is not None and self.savepoints.get(item.slot) == item.at:
            del self.savepoints[item.slot]
            roll = item.slot in self.rolls
            self.rolls.discard(item.slot)
            folder = self.savepoint_folders.get(item.at)
            try:
                if folder is not None and rep.task.kind != "sink" and rep.forks(item.cut):
                    # A large state: snapshotted and written (hashed) by a forked child
                    # while this replica goes on; the writer thread waits for it.
                    taken = fork_cuts([(rep, item.cut, folder)], digest=True)[0]
                else:  # in place; the state is written off the worker thread
                    taken = rep.cut(item.cut)
                if roll and taken is not None:
                    rep.roll(item.at)  # the rows through the cut: a part of their own
            except Exception:
                log.exception("%s: taking a savepoint's cut failed", rep.name)
                taken = None
            if taken is not None and rep.task.kind == "sink":
                # Counted once what the sink wrote through the cut is durable outside (a
                # Kafka sink: once a transaction through it committed; the others at once).
                me, at = rep.me, item.at
                rep.commit_through(item.cut, lambda: self.on_savepoint(me, at, taken))
                return
            self.on_savepoint(rep.me, item.at, taken)
            return
        if rep.task.kind == "sink":
            # A rebuild's cut of a rebuildable sink: its copy so far (in place: it is in
            # memory already, and a copy of the output, not a state to fork for).
            tokens = self.asked.pop(item.slot, [])
            if tokens:
                try:
                    taken = rep.cut(item.cut, copy=True)
                except Exception:
                    log.exception("%s: taking a cut failed", rep.name)
                    taken = None
                for token in tokens:
                    self.on_cut(rep.me, taken, token)
            if rep.keeps_positions:  # the sink's own cut (a mark)
                rep.mark(item.cut)
            return
        checkpoint = item.at is not None  # a checkpoint's aligned cut
        if checkpoint and self.checkpoints.get(item.slot) != item.at:
            return  # replaced by a later checkpoint
        tokens = [] if checkpoint else self.asked.get(item.slot, [])
        # One rebuild asking, with a folder for its state: written by a forked child.
        folder = self.state_folder(tokens[0]) if len(tokens) == 1 else None
        try:
            if folder is not None and rep.forks(item.cut):
                # Held until every other slot asked to fork for a cut is cut too: one
                # fork then writes them all (:meth:`release_held`).
                self.held[item.slot] = (rep, item.cut, folder, time.monotonic())
                self.core.hold(item.slot, True)
                self.release_held()
                return
            taken = rep.cut(item.cut)  # small, or no folder: in place
        except Exception:
            what = "a checkpoint's cut" if checkpoint else "a cut"
            log.exception("%s: taking %s failed", rep.name, what)
            taken = None
        if checkpoint:
            del self.checkpoints[item.slot]
            self.on_checkpoint(rep.me, item.at, taken)
            return
        for token in self.asked.pop(item.slot, []):
            self.on_cut(rep.me, taken, token)

    def release_held(self) -> float:
        """Fork once for the slots held at their cuts (:meth:`take`) once no other slot
        of this worker waits to be cut with a state folder — or once the first of them
        has been held for :data:`HOLD_CUTS_S` (a sibling late to its boundary, behind
        the held ones, say) — then let them go on. How soon to look again (infinity: no
        sooner than the worker would anyway)."""
        if not self.held:
            return math.inf
        oldest = min(since for *_, since in self.held.values())
        left = oldest + HOLD_CUTS_S - time.monotonic()
        pending = [
            slot
            for slot, tokens in self.asked.items()
            if slot not in self.held
            and len(tokens) == 1
            and self.state_folder(tokens[0]) is not None
        ]
        if pending and left > 0:
            return left
        held, self.held = self.held, {}
        entries = [(rep, cut, folder) for rep, cut, folder, _ in held.values()]
        try:
            taken = fork_cuts(entries)
        except Exception:
            log.exception("taking the cuts of %s failed", [r.name for r, *_ in entries])
            taken = [None] * len(entries)
        for slot, resume in zip(held, taken, strict=True):
            with contextlib.suppress(Exception):
                self.core.hold(slot, False)
            rep = held[slot][0]
            for token in self.asked.pop(slot, []):
                self.on_cut(rep.me, resume, token)
        return math.inf
