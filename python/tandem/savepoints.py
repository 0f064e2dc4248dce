"""Savepoints: one consistent cut of a whole job, written to a directory, and a job resumed
from it.

A savepoint is taken while the job runs (:meth:`tandem.RunningJob.savepoint`) or as it
stops (``RunningJob.stop(savepoint=...)``): the coordinator picks one heartbeat epoch
``K`` ahead of the sources' clock and has one live replica of every task partition — the
sinks too — cut right after it forwards heartbeat ``K`` (the aligned cut of the passive
checkpoints, :mod:`tandem.engines.coordinator`). Each cut holds the replica's input
positions, merge state and output sequence numbers; an operator's cut also holds its
``snapshot()``. A job resumed from the savepoint (``Job.run(from_savepoint=...)``) starts
every replica of every partition from its partition's cut: its sources skip their
schedule through heartbeat ``K``, its operators load their states, its sinks start with
their input positions at the cut, so the output continues where the savepoint's ends —
nothing lost, nothing twice.

A job may resume with another parallelism of any operator task whose state is kept per
key (:meth:`tandem.operators.Operator.keyed_state`, a ``KeyedProcess``'s ``state``, a
join's rules): a key's group is its hash modulo ``max_parallelism``, every partition owns
one contiguous range of groups, so each new partition takes the entries of the groups it
owns from the saved partitions that owned them (:func:`rescale`). The edges into and out
of such a task start their sequence numbers again at the cut.

The format (``FORMAT_VERSION``), a directory on any filesystem :mod:`pyarrow.fs` opens:

- ``manifest.json``: the format and its version, the job's name, the tandem version that
  wrote it, when, the epoch and heartbeat period, the job's ``max_parallelism`` (its key
  groups), the plan's tasks (name, kind, parallelism, replication, inputs), every source
  partition's position at the cut, and per task partition its cut (JSON), the key groups
  it owned (a keyed task's) and the name, size and SHA-256 of its state file;
- ``states/<task>-<partition>.state``: an operator partition's state, as its
  ``snapshot()`` returned it (``<task>``: the task's index in the manifest).

It is written atomically: on a local disk into a temporary sibling directory renamed
into place; elsewhere (an object store, where a rename is no rename) the manifest is
written last. A directory without ``manifest.json`` is a partial savepoint, one whose
manifest does not parse, or whose state files differ from it, a corrupt one: both are
refused when read, and a path that holds anything is never written over.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import logging
import os
import posixpath
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import Any

from tandem.exceptions import ConfigError, TandemError
from tandem.plan import (
    DEFAULT_MAX_PARALLELISM,
    Plan,
    Task,
    key_group_range,
)
from tandem.rescale import split_entries
from tandem.runtime.cuts import Resume

log = logging.getLogger(__name__)

FORMAT = "tandem-savepoint"
FORMAT_VERSION = 2
"""The version of the savepoint format this tandem writes and reads (2: keys routed by key
group, ``max_parallelism`` in the manifest; a version 1 savepoint routed them by
``hash % parallelism`` and cannot be resumed)."""

MANIFEST = "manifest.json"
STATES = "states"
_CHUNK = 1 << 20

ReplicaId = tuple[int, int, int]


# -- where ----------------------------------------------------------------------------------


def _open(path: str | os.PathLike) -> tuple[Any, str]:
    """The filesystem of ``path`` and the path on it: a local path (relative ones from the
    current directory) or a URI :func:`pyarrow.fs.FileSystem.from_uri` opens."""
    from pyarrow import fs

    text = os.fspath(path)
    if "://" not in text:
        return fs.LocalFileSystem(), os.path.abspath(text)
    try:
        return fs.FileSystem.from_uri(text)
    except Exception as exc:  # an unknown scheme, a bucket that does not resolve, ...
        raise ConfigError(f"savepoint path {text!r} cannot be opened: {exc}") from exc


def _exists(filesystem, path: str) -> bool:
    from pyarrow import fs

    return filesystem.get_file_info(path).type != fs.FileType.NotFound


# -- the encoded cut --------------------------------------------------------------------------


def _encode(value: Any) -> Any:
    """A core cut (nested tuples of numbers, booleans, None, bytes) as JSON."""
    if isinstance(value, tuple | list):
        return [_encode(v) for v in value]
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"a cut holds a {type(value).__name__}, which a savepoint cannot store")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_decode(v) for v in value)
    if isinstance(value, dict):
        return bytes.fromhex(value["hex"])
    return value


# -- the savepoint ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Savepoint:
    """A savepoint as its manifest describes it (see the module documentation):
    :meth:`read` one from a path, :meth:`tandem.RunningJob.savepoint` returns the one it
    wrote. ``epoch``: the heartbeat after which every partition was cut; ``source_time_s``:
    where the job's source time stood there; ``sources``: per source task, every
    partition's position (``{"partition", "epoch", "rows"}``: the rows it had emitted);
    ``tasks``: the plan's tasks (``{"name", "kind", "parallelism", "replication",
    "inputs"}``)."""

    path: str
    job: str
    epoch: int
    heartbeat_ms: float
    tasks: list[dict]
    sources: dict[str, list[dict]]
    tandem_version: str
    created: str
    partitions: list[dict] = field(default_factory=list, repr=False)
    runs: tuple[int, ...] = ()
    """The runs of the job this cut continues, each its t0 (ns), the one that took it last:
    a run resumed from it finds there what they had written outside (a Kafka sink's
    commits) that it must not write again."""
    max_parallelism: int = DEFAULT_MAX_PARALLELISM
    """The key groups the job's keyed edges hashed keys into (``Job(max_parallelism=)``)."""

    @property
    def source_time_s(self) -> float:
        """Seconds of source time the job had run through at the cut."""
        return self.epoch * self.heartbeat_ms / 1000

    @classmethod
    def read(cls, path: str | os.PathLike, verify: bool = True) -> Savepoint:
        """The savepoint at ``path``; :class:`tandem.ConfigError` if there is none, or it is
        partial (no manifest) or corrupt (a manifest that does not parse, of another
        format version, or state files that differ from it — checked with ``verify``)."""
        filesystem, root = _open(path)
        where = os.fspath(path)
        if not _exists(filesystem, root):
            raise ConfigError(f"no savepoint at {where!r}: the path does not exist")
        manifest = posixpath.join(root, MANIFEST)
        if not _exists(filesystem, manifest):
            raise ConfigError(
                f"{where!r} is not a complete savepoint: it has no {MANIFEST} (a savepoint "
                "whose writing was interrupted, or another directory); it cannot be resumed"
            )
        try:
            with filesystem.open_input_stream(manifest) as f:
                doc = json.loads(f.read().decode())
            if doc.get("format") != FORMAT:
                raise ValueError(f"format {doc.get('format')!r}, not {FORMAT!r}")
            if doc.get("format_version") != FORMAT_VERSION:
                raise ValueError(
                    f"format version {doc.get('format_version')!r}; this tandem reads "
                    f"version {FORMAT_VERSION}"
                )
            sp = cls(
                where,
                str(doc["job"]),
                int(doc["epoch"]),
                float(doc["heartbeat_ms"]),
                list(doc["tasks"]),
                dict(doc["sources"]),
                str(doc["tandem_version"]),
                str(doc["created"]),
                list(doc["partitions"]),
                tuple(int(r) for r in doc.get("runs", ())),
                int(doc["max_parallelism"]),
            )
            names = {t["name"] for t in sp.tasks}
            for part in sp.partitions:
                if part["task"] not in names:
                    raise ValueError(f"a cut of task {part['task']!r}, which it does not list")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"the savepoint at {where!r} is corrupt: its {MANIFEST}: {exc}"
            ) from exc
        if verify:
            for part in sp.partitions:
                if part.get("state") is not None:
                    sp._state(filesystem, root, part)
        return sp

    def _state(self, filesystem, root: str, part: dict) -> bytes:
        """The state file of a partition's cut, checked against the manifest."""
        name = part["state"]
        path = posixpath.join(root, name)
        try:
            with filesystem.open_input_stream(path) as f:
                data = f.read()
        except (OSError, FileNotFoundError) as exc:
            raise ConfigError(
                f"the savepoint at {self.path!r} is corrupt: state file {name} of "
                f"{part['task']!r}[{part['partition']}] cannot be read ({exc})"
            ) from exc
        if len(data) != part["bytes"] or hashlib.sha256(data).hexdigest() != part["sha256"]:
            raise ConfigError(
                f"the savepoint at {self.path!r} is corrupt: state file {name} of "
                f"{part['task']!r}[{part['partition']}] differs from its manifest "
                f"({len(data)} bytes, {part['bytes']} written)"
            )
        return data


@dataclass(frozen=True)
class Resumed:
    """A job resumed from a savepoint (``Plan.resumed``): the heartbeat epoch it continues
    after and the cut every replica starts from."""

    path: str
    epoch: int
    cuts: dict[ReplicaId, Resume]
    runs: tuple[int, ...] = ()
    """The runs the savepoint continues (:attr:`Savepoint.runs`)."""
    scratch: tuple[Any, str] | None = None
    """The filesystem and directory the states of partitions built at a new parallelism
    were written to for the run (:func:`release` removes it); None: there are none."""


# -- writing ----------------------------------------------------------------------------------


def check_target(path: str | os.PathLike) -> None:
    """Raise ConfigError if a savepoint cannot be written at ``path``: it holds one
    already (never overwritten) or anything else."""
    filesystem, root = _open(path)
    _refuse_existing(filesystem, root, os.fspath(path))


def _refuse_existing(filesystem, root: str, where: str) -> None:
    from pyarrow import fs

    info = filesystem.get_file_info(root)
    if info.type == fs.FileType.NotFound:
        return
    if _exists(filesystem, posixpath.join(root, MANIFEST)):
        raise ConfigError(
            f"{where!r} holds a savepoint already; a savepoint is never overwritten: "
            "choose another path, or remove that one first"
        )
    if info.type == fs.FileType.Directory:
        inside = filesystem.get_file_info(fs.FileSelector(root, recursive=False))
        if not inside:
            return
        raise ConfigError(
            f"{where!r} exists and is no complete savepoint (no {MANIFEST}: perhaps one "
            "whose writing was interrupted); choose another path, or remove it first"
        )
    raise ConfigError(f"{where!r} exists and is not a directory: a savepoint is a directory")


def _describe_tasks(plan: Plan) -> list[dict]:
    return [
        {
            "name": t.name,
            "kind": t.kind,
            "parallelism": t.parallelism,
            "replication": t.replication,
            "inputs": [
                {
                    "upstream": plan.tasks[e.upstream].name,
                    "input": e.input_index,
                    "partitioner": e.partitioner,
                    "key": e.key,
                }
                for e in t.inputs
            ],
        }
        for t in plan.tasks
    ]


def source_positions(plan: Plan, cuts: dict[ReplicaId, Resume]) -> dict[str, list[dict]]:
    """Every source partition's position at its cut: the heartbeat it was cut after and the
    rows it had emitted before it (a generated or file source's schedule puts every row
    released before heartbeat ``k`` ahead of it)."""
    out: dict[str, list[dict]] = {}
    for (t, p, _), resume in sorted(cuts.items()):
        task = plan.tasks[t]
        if task.kind != "source":
            continue
        epoch = resume.epoch
        if plan.is_log_source(t):  # where its log goes on after the marker it took there
            offset, rows, *_ = json.loads(resume.load())
            position = {"partition": p, "epoch": epoch, "rows": rows, "offset": offset}
        else:
            rows = plan.source_rows(t, p, epoch * plan.heartbeat_ns / 1e9)
            position = {"partition": p, "epoch": epoch, "rows": rows}
        out.setdefault(task.name, []).append(position)
    return out


def settle(plan: Plan, cuts: dict[ReplicaId, Resume]) -> dict[ReplicaId, Resume]:
    """The cuts with the input channels a replica consuming first come, first served (a
    sink; an operator under ``ordering="none"``) took past the cut set back to it. Such a
    replica is cut once every input delivered heartbeat ``K``, and by then may have taken
    more of a faster channel:

    - its end marker, when the job stops at ``K`` (its sources end right after it):
      resumed as it was cut, it would take that channel for ended and drop what its
      upstream emits after the cut. The channel is opened again, at the position its
      upstream partition's cut emitted through.
    - a sink, rows its upstream emitted after its own cut at ``K`` (rows of source rows
      after the cut), when the job goes on: a resumed sink starts with no output, and
      would drop them as already taken. The sink's position is set back to its upstream
      partition's cut. (An operator's state holds what it took, so its positions stay.)"""
    by_part = {(t, p): r for (t, p, _), r in cuts.items()}
    out = {}
    for (t, p, r), resume in cuts.items():
        cut = resume.cut
        inbox = cut[2] if len(cut) > 2 else None
        sink = plan.tasks[t].kind == "sink"
        if inbox is None or not (sink or any(inbox[3])):
            out[(t, p, r)] = resume
            continue
        epochs, positions, ended = list(cut[1]), list(inbox[0]), list(inbox[3])
        for c, chan in enumerate(plan.input_channels(t, p)):
            up = by_part[(chan.task, chan.partition)].cut
            seq = _sent(plan, by_part, chan.task, chan.partition, t, chan.input_index, p)
            if not ended[c] and not (sink and positions[c] > seq):
                continue
            positions[c], ended[c], epochs[c] = seq, False, min(epochs[c], up[0])
        inbox = (tuple(positions), inbox[1], inbox[2], tuple(ended), *inbox[4:])
        cut = (cut[0], tuple(epochs), inbox, *cut[3:])
        out[(t, p, r)] = dataclasses.replace(resume, cut=cut)
    return out


def _without_orders(resume: Resume) -> Resume:
    """A cut with no KaZoo orders in it: neither the orders its replica had followed but
    not consumed yet (beyond the cut: an aligned cut is right after heartbeat ``K`` on
    every channel) nor its place in the run's order log. Every replica of a resumed
    partition starts from this one cut, and the resumed run has an order log of its own,
    whose first leader orders on from the cut's positions."""
    inbox = resume.cut[2] if len(resume.cut) > 2 else None
    if inbox is None or (not inbox[4] and inbox[5] is None):
        return resume
    cut = (resume.cut[0], resume.cut[1], (*inbox[:4], (), None), *resume.cut[3:])
    return dataclasses.replace(resume, cut=cut)


def staging(path: str | os.PathLike) -> str:
    """A new directory for the cuts of the savepoint to be written at ``path``: on a local
    disk the hidden sibling it is written in and renamed from (:func:`write`), so that the
    workers write its states in place — one write of each, its SHA-256 taken on the way —
    and on the disk the savepoint's path names (one path the driver and every executor of
    a cluster reach); elsewhere a local temporary directory."""
    filesystem, root = _open(path)
    if type(filesystem).__name__ != "LocalFileSystem":
        return tempfile.mkdtemp(prefix="tandem-savepoint-")
    parent, name = posixpath.split(root.rstrip("/"))
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)


def write(
    path: str | os.PathLike,
    plan: Plan,
    epoch: int,
    cuts: dict[ReplicaId, Resume],
    runs: tuple[int, ...] = (),
    staged: str | None = None,
) -> Savepoint:
    """Write the savepoint of ``plan`` cut at heartbeat ``epoch`` (``cuts``: one per task
    partition, each state in its file or in the cut; ``runs``: the runs it continues, the
    one cutting it last) to ``path``, atomically (see the module documentation); the
    :class:`Savepoint` written. ``staged``: the directory from :func:`staging` the states
    were written into; a state file there whose SHA-256 is known is moved, not copied.
    Refuses a path that holds anything (ConfigError)."""
    from tandem._core import __version__

    where = os.fspath(path)
    filesystem, root = _open(path)
    _refuse_existing(filesystem, root, where)
    cuts = settle(plan, {rid: _without_orders(resume) for rid, resume in cuts.items()})
    local = type(filesystem).__name__ == "LocalFileSystem"
    if local:
        parent, name = posixpath.split(root.rstrip("/"))
        filesystem.create_dir(parent, recursive=True)
        sibling = staged is not None and posixpath.dirname(staged) == parent
        if sibling and posixpath.basename(staged).startswith(f".{name}.tmp-"):
            target = staged
        else:
            target = posixpath.join(parent, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
    else:
        target = root
    filesystem.create_dir(posixpath.join(target, STATES), recursive=True)
    try:
        partitions = []
        index = {t.id: i for i, t in enumerate(plan.tasks)}
        for (t, p, r), resume in sorted(cuts.items()):
            task = plan.tasks[t]
            entry: dict[str, Any] = {
                "task": task.name,
                "partition": p,
                "replica": r,
                "epoch": resume.epoch,
                "cut": _encode(resume.cut),
                "state": None,
            }
            if task.kind == "operator":
                if _keyed(task):
                    groups = key_group_range(p, task.parallelism, plan.max_parallelism)
                    entry["key_groups"] = [groups.start, groups.stop]
                name = f"{STATES}/{index[t]}-{p}.state"
                dest = posixpath.join(target, name)
                file = resume.state_file
                if (
                    local
                    and file is not None
                    and resume.sha256 is not None
                    and (posixpath.dirname(os.path.abspath(file)) == target)
                ):
                    os.replace(file, dest)  # written here by its worker, hashed on the way
                    size, digest = os.path.getsize(dest), resume.sha256
                else:
                    size, digest = _copy_state(resume, filesystem, dest)
                entry.update(state=name, bytes=size, sha256=digest)
            elif task.kind == "source" and plan.is_log_source(t):
                # Where its log goes on: the offset after the marker it took as the cut's
                # heartbeat (or sent it with), the data rows it had read before it, and
                # that marker's heartbeat (Replica.log_resume).
                entry["log_position"] = json.loads(resume.load())
            partitions.append(entry)
        doc = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "job": plan.job,
            "tandem_version": __version__,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "epoch": epoch,
            "heartbeat_ms": plan.heartbeat_ms,
            "max_parallelism": plan.max_parallelism,
            "tasks": _describe_tasks(plan),
            "sources": source_positions(plan, cuts),
            "partitions": partitions,
            "runs": list(runs),
        }
        if local:  # what else the workers left there (other replicas' cuts)
            for leftover in os.scandir(target):
                if leftover.is_file():
                    os.unlink(leftover.path)
        # The manifest last: a directory without one is a partial savepoint.
        with filesystem.open_output_stream(posixpath.join(target, MANIFEST)) as f:
            f.write(json.dumps(doc, indent=1).encode())
        if local:
            _refuse_existing(filesystem, root, where)  # taken meanwhile?
            if _exists(filesystem, root):
                filesystem.delete_dir(root)  # an empty directory
            filesystem.move(target, root)
    except BaseException:
        if local:
            filesystem.delete_dir(target)
        raise
    return Savepoint.read(path, verify=False)


def _keyed(task: Task) -> bool:
    """Whether a task's input is keyed (hash-partitioned): its partitions own key groups."""
    return any(e.partitioner == "hash" for e in task.inputs)


def _copy_state(resume: Resume, filesystem, dest: str) -> tuple[int, str]:
    """Copy a cut's state (its file or its bytes) to ``dest``: (size, SHA-256)."""
    digest, size = hashlib.sha256(), 0
    with filesystem.open_output_stream(dest) as out:
        chunks = [resume.state] if resume.state_file is None else _chunks(resume.state_file)
        for chunk in chunks:
            out.write(chunk)
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def _chunks(path: str):
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            yield chunk


# -- resuming ---------------------------------------------------------------------------------


def check_compatible(sp: Savepoint, plan: Plan) -> None:
    """Raise ConfigError, naming the task and what differs, unless ``plan`` can resume
    from ``sp``: the same job, the same tasks by name (none missing, none new), each of
    the same kind, parallelism and inputs, and the same heartbeat period. Operator code
    may change (a state is data), and so may replication and the parallelism of an
    operator task (whether its state can be split is checked by :func:`rescale`)."""
    where = sp.path
    if sp.job != plan.job:
        raise ConfigError(
            f"the savepoint at {where!r} is of job {sp.job!r}, not of job {plan.job!r}"
        )
    if plan.heartbeat_ms != sp.heartbeat_ms:
        raise ConfigError(
            f"job {plan.job!r}: heartbeat_ms={plan.heartbeat_ms:g}, but the savepoint at "
            f"{where!r} was cut with heartbeat_ms={sp.heartbeat_ms:g} (its positions are "
            "heartbeat epochs)"
        )
    keyed = [t.name for t in plan.tasks if _keyed(t)]
    if keyed and sp.max_parallelism != plan.max_parallelism:
        raise ConfigError(
            f"job {plan.job!r}: max_parallelism={plan.max_parallelism}, but the savepoint at "
            f"{where!r} was cut with max_parallelism={sp.max_parallelism}: the keyed tasks "
            f"({', '.join(keyed)}) hold their state in that many key groups; keep "
            f"Job(max_parallelism={sp.max_parallelism})"
        )
    saved = {t["name"]: t for t in sp.tasks}
    new = {t.name: t for t in plan.tasks}
    for name, t in saved.items():
        if name not in new:
            raise ConfigError(
                f"task {name!r} ({t['kind']}) of the savepoint at {where!r} is missing from "
                f"job {plan.job!r} (its tasks: {sorted(new)}); its state would be lost"
            )
    for name, task in new.items():
        if name not in saved:
            raise ConfigError(
                f"{task.describe()} of job {plan.job!r} is not in the savepoint at "
                f"{where!r} (its tasks: {sorted(saved)}): it has no state to start from"
            )
    for name, task in new.items():
        old = saved[name]
        if old["kind"] != task.kind:
            raise ConfigError(
                f"task {name!r} is a {task.kind} in job {plan.job!r} but a {old['kind']} in "
                f"the savepoint at {where!r}"
            )
        if old["parallelism"] != task.parallelism and task.kind != "operator":
            what = (
                "a source's partitions are the shape of its input"
                if task.kind == "source"
                else "a sink's partitions are where its output goes"
            )
            raise ConfigError(
                f"{task.describe()}: parallelism {task.parallelism} here, "
                f"{old['parallelism']} in the savepoint at {where!r}; {what}, so it resumes "
                f"at parallelism {old['parallelism']} (operator tasks may change theirs)"
            )
        inputs = [
            {
                "upstream": plan.tasks[e.upstream].name,
                "input": e.input_index,
                "partitioner": e.partitioner,
                "key": e.key,
            }
            for e in task.inputs
        ]
        if inputs != old["inputs"]:
            raise ConfigError(
                f"{task.describe()}: its inputs differ from the savepoint at {where!r} "
                f"({_inputs(inputs)} here, {_inputs(old['inputs'])} there)"
            )


def _inputs(inputs: list[dict]) -> str:
    if not inputs:
        return "none"
    return ", ".join(
        f"{i['upstream']} ({i['partitioner']}{' by ' + i['key'] if i['key'] else ''})"
        for i in inputs
    )


def resume(path: str | os.PathLike, plan: Plan) -> Plan:
    """``plan`` resumed from the savepoint at ``path``: read and verified, checked against
    the plan (:func:`check_compatible`), every replica of every partition given its
    partition's cut (``Plan.resumed``), the partitions of a task whose parallelism
    changed built from the saved ones (:func:`rescale`). ConfigError, before anything
    starts, if it cannot be."""
    sp = Savepoint.read(path, verify=False)
    check_compatible(sp, plan)
    filesystem, root = _open(path)
    local = type(filesystem).__name__ == "LocalFileSystem"
    saved = _saved_shape(sp, plan)
    changed = {t.id for t in plan.tasks if t.parallelism != saved.tasks[t.id].parallelism}
    by_name = {t.name: t for t in plan.tasks}
    parts: dict[tuple[int, int], Resume] = {}
    states: dict[tuple[int, int], bytes] = {}
    for part in sp.partitions:
        task = saved.tasks[by_name[part["task"]].id]
        p = int(part["partition"])
        if not 0 <= p < task.parallelism or (task.id, p) in parts:
            raise ConfigError(f"the savepoint at {sp.path!r} is corrupt: {part['task']}[{p}]")
        try:
            cut = _decode(part["cut"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"the savepoint at {sp.path!r} is corrupt: a cut: {exc}") from exc
        if part.get("log_position") is not None:  # a log source: where its log goes on
            taken = Resume(cut, json.dumps(part["log_position"]).encode(), savepoint=True)
        elif part.get("state") is None:
            taken = Resume(cut, b"", savepoint=True)
        else:
            data = sp._state(filesystem, root, part)  # checked against the manifest
            if task.id in changed:
                states[(task.id, p)] = data
                taken = Resume(cut, b"", savepoint=True)
            else:  # each worker reads it there (never removed: keep_file), not the plan
                file = posixpath.join(root, part["state"])
                on = None if local else filesystem
                taken = Resume(cut, b"", file, keep_file=True, savepoint=True, filesystem=on)
        parts[(task.id, p)] = taken
    missing = [
        f"{t.name}[{p}]"
        for t in saved.tasks
        for p in range(t.parallelism)
        if (t.id, p) not in parts
    ]
    if missing:
        raise ConfigError(
            f"the savepoint at {sp.path!r} is corrupt: it holds no cut of {', '.join(missing)}"
        )
    scratch = None
    if changed:
        parts = rescale(plan, saved, parts, states, sp.path)
        scratch = _to_scratch(filesystem, root, parts, changed)
    cuts: dict[ReplicaId, Resume] = {}
    ordered = set(plan.ordered_partitions())
    for (t, p), taken in parts.items():
        task = plan.tasks[t]
        if task.kind == "sink" and task.sink.restartable and sp.runs:
            # What the lost runs wrote past the cut (a Kafka sink commits as it goes): its
            # writers fenced, their last commit found, for the resumed sink to skip.
            state = task.sink.resumed(p, sp.runs)
            taken = Resume(taken.cut, state, savepoint=True)
        if (t, p) in ordered:
            taken = _new_order_log(taken)
        for r in range(task.replication):
            cuts[(t, p, r)] = taken
    return dataclasses.replace(
        plan, resumed=Resumed(sp.path, sp.epoch, cuts, sp.runs, scratch=scratch)
    )


def _new_order_log(resume: Resume) -> Resume:
    """A KaZoo partition's cut at the start of the resumed run's order log: no leader's
    epoch followed yet, nothing read, its channels ordered through where the cut stands
    (the log's first leader orders on from there)."""
    positions, *merge, _ = resume.cut[2]
    inbox = (positions, *merge, (None, 0, tuple(positions), 0))
    return dataclasses.replace(resume, cut=(*resume.cut[:2], inbox, *resume.cut[3:]))


def _to_scratch(
    filesystem, root: str, parts: dict[tuple[int, int], Resume], changed: set[int]
) -> tuple[Any, str] | None:
    """Write the states of the rescaled tasks' new partitions (``parts``, changed in place)
    to files in a hidden directory beside the savepoint — where every worker reads the
    savepoint, so on a cluster too — for each worker to read its own, rather than every
    worker getting them all in the plan. The directory, or None where none can be made
    (a savepoint store that is read-only): the states then travel in the plan. It goes
    when the run ends (:func:`release`)."""
    parent, name = posixpath.split(root.rstrip("/"))
    scratch = posixpath.join(parent, f".{name}.rescaled-{uuid.uuid4().hex[:12]}")
    try:
        filesystem.create_dir(scratch)
        for (t, q), taken in sorted(parts.items()):
            if t not in changed or not taken.state:
                continue
            file = posixpath.join(scratch, f"{t}-{q}.state")
            with filesystem.open_output_stream(file) as f:
                f.write(taken.state)
            local = type(filesystem).__name__ == "LocalFileSystem"
            parts[(t, q)] = dataclasses.replace(
                taken,
                state=b"",
                state_file=file,
                keep_file=True,
                filesystem=None if local else filesystem,
            )
    except OSError as exc:
        log.warning(
            "the rescaled states go in the plan: no directory for them beside %s (%s)", root, exc
        )
        with contextlib.suppress(OSError):
            filesystem.delete_dir(scratch)
        return None
    return filesystem, scratch


def release(plan: Plan) -> None:
    """The run of a plan resumed at a new parallelism has ended (or never started): its
    rescaled states' files go (:func:`_to_scratch`)."""
    resumed = plan.resumed
    if resumed is None or resumed.scratch is None:
        return
    filesystem, scratch = resumed.scratch
    try:
        filesystem.delete_dir(scratch)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("the rescaled states in %s not removed: %s", scratch, exc)


def _saved_shape(sp: Savepoint, plan: Plan) -> Plan:
    """``plan`` at the parallelism of every task in the savepoint (the two are compatible:
    the same tasks and edges), to read the saved cuts' channels."""
    saved = {t["name"]: int(t["parallelism"]) for t in sp.tasks}
    tasks = tuple(dataclasses.replace(t, parallelism=saved[t.name]) for t in plan.tasks)
    return dataclasses.replace(plan, tasks=tasks, resumed=None)


# -- rescaling: a task resumed at another parallelism ---------------------------------------


def rescale(
    plan: Plan,
    saved: Plan,
    parts: dict[tuple[int, int], Resume],
    states: dict[tuple[int, int], bytes],
    where: str,
) -> dict[tuple[int, int], Resume]:
    """The cuts of ``plan``'s partitions from those of the savepoint (``parts``, in the
    shape of ``saved``; ``states``: the saved states of every task whose parallelism
    changed). A changed task's new partition ``q`` gets every saved key entry whose key
    group it owns (:func:`tandem.plan.key_group_range`), restored into its operator with
    ``restore_keyed`` and snapshotted. Every edge into or out of a changed task starts its
    sequence numbers again, at 0, on both ends: that the saved cut had nothing in flight
    on it (each consumer had taken exactly what its producer had sent through the cut) is
    checked, and ConfigError raised where it had not (or where a state cannot be split)."""
    changed = {t.id for t in plan.tasks if t.parallelism != saved.tasks[t.id].parallelism}
    renumbered = {
        (e.upstream, t.id, e.input_index)
        for t in plan.tasks
        for e in t.inputs
        if e.upstream in changed or t.id in changed
    }
    _check_nothing_in_flight(saved, parts, renumbered, where)
    for t in sorted(changed):
        for down, _ in plan.consumers(t):
            if down.kind == "sink" and down.sink.restartable:
                raise ConfigError(
                    f"{plan.tasks[t].describe()} cannot change its parallelism: it feeds "
                    f"{down.describe()}, whose commits store where its input stood; resume "
                    f"at parallelism {saved.tasks[t].parallelism}"
                )
    epoch = _common_epoch(saved, parts, changed, renumbered, where)
    out = dict(parts)
    for t in changed:
        task = plan.tasks[t]
        for p in range(saved.tasks[t].parallelism):
            del out[(t, p)]
        new_states = _split_states(plan, saved, task, states, where)
        for q in range(task.parallelism):
            out[(t, q)] = Resume(_fresh_cut(plan, t, q, epoch), new_states[q], savepoint=True)
    for (t, p), resume in parts.items():
        if t in changed:
            continue
        cut = resume.cut
        edges = plan.output_edges(t, p)
        outboxes = tuple(
            ((0,) * len(edge.partitions), rows)
            if (t, edge.downstream, edge.input_index) in renumbered
            else (seqs, rows)
            for edge, (seqs, rows) in zip(edges, cut[3], strict=True)
        )
        inbox, epochs = cut[2], cut[1]
        inputs = ((e.upstream, t, e.input_index) for e in plan.tasks[t].inputs)
        if inbox is not None and any(edge in renumbered for edge in inputs):
            inbox, epochs = _renumbered_inbox(plan, saved, t, p, cut, changed, epoch)
        out[(t, p)] = dataclasses.replace(resume, cut=(cut[0], epochs, inbox, outboxes))
    return out


def _sent(saved: Plan, parts: dict, up: int, u: int, down: int, index: int, d: int) -> int:
    """The sequence number saved partition ``up[u]`` had sent through on its channel to
    ``down[d]`` (input ``index``) at its cut."""
    edges = saved.output_edges(up, u)
    e = next(
        i for i, edge in enumerate(edges) if edge.downstream == down and edge.input_index == index
    )
    return parts[(up, u)].cut[3][e][0][edges[e].partitions.index(d)]


def _check_nothing_in_flight(saved: Plan, parts: dict, renumbered: set, where: str) -> None:
    for up, down, index in sorted(renumbered):
        for d in range(saved.tasks[down].parallelism):
            cut = parts[(down, d)].cut
            for c, chan in enumerate(saved.input_channels(down, d)):
                if (chan.task, chan.input_index) != (up, index):
                    continue
                taken = cut[2][0][c]
                sent = _sent(saved, parts, up, chan.partition, down, index, d)
                if taken != sent:
                    raise ConfigError(
                        f"the savepoint at {where!r} cannot resume "
                        f"{saved.tasks[down].describe()} or its input at another "
                        f"parallelism: its partition {d} had taken its input from "
                        f"{saved.tasks[up].name}[{chan.partition}] through sequence number "
                        f"{taken}, which had sent through {sent} at the cut (rows in "
                        "flight); resume at the saved parallelism"
                    )


def _common_epoch(saved: Plan, parts: dict, changed: set, renumbered: set, where: str) -> int:
    """The heartbeat every cut on a renumbered edge was taken after (they must agree: the
    edge's sequence numbers and heartbeats start again there)."""
    touched = changed | {t for edge in renumbered for t in edge[:2]}
    epochs = {parts[(t, p)].cut[0] for t in touched for p in range(saved.tasks[t].parallelism)}
    if len(epochs) != 1:
        raise ConfigError(
            f"the savepoint at {where!r} cannot resume at another parallelism: its cuts "
            f"around the rescaled tasks were taken at heartbeats {sorted(epochs)}, not at one"
        )
    return epochs.pop()


def _fresh_cut(plan: Plan, t: int, q: int, epoch: int) -> tuple:
    """A new partition's cut at heartbeat ``epoch``: every input channel at sequence number
    0 having delivered ``epoch``, every output channel at 0."""
    channels = len(plan.input_channels(t, q))
    inbox = ((0,) * channels, 0, epoch, (False,) * channels, (), None)
    outboxes = tuple(((0,) * len(e.partitions), 0) for e in plan.output_edges(t, q))
    return (epoch, (epoch,) * channels, inbox, outboxes)


def _renumbered_inbox(
    plan: Plan, saved: Plan, t: int, p: int, cut: tuple, changed: set, epoch: int
) -> tuple[tuple, tuple]:
    """An unchanged partition's inbox and per-channel epochs with the channels from a
    changed task replaced by the new partitions' (at 0, having delivered ``epoch``)."""
    old = {
        (c.task, c.partition, c.input_index): i for i, c in enumerate(saved.input_channels(t, p))
    }
    positions, _, gen, ended, orders, log = cut[2]
    new_positions, new_ended, new_epochs = [], [], []
    for chan in plan.input_channels(t, p):
        if chan.task in changed:
            new_positions.append(0)
            new_ended.append(False)
            new_epochs.append(epoch)
        else:
            i = old[(chan.task, chan.partition, chan.input_index)]
            new_positions.append(positions[i])
            new_ended.append(ended[i])
            new_epochs.append(cut[1][i])
    inbox = (tuple(new_positions), 0, gen, tuple(new_ended), tuple(orders), log)
    return inbox, tuple(new_epochs)


def _split_states(plan: Plan, saved: Plan, task: Task, states: dict, where: str) -> list[bytes]:
    """Per new partition of ``task``, its state: the saved partitions' key entries whose
    group it owns (:func:`tandem.rescale.split_entries`), restored with ``restore_keyed``
    and snapshotted."""
    import copy

    was, now = saved.tasks[task.id].parallelism, task.parallelism
    keyed: list[dict] = []
    for p in range(was):
        data = states.get((task.id, p), b"")
        op = copy.deepcopy(task.operator)
        try:
            op.restore(data)
            kv = op.keyed_state()
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(
                f"{task.describe()}: the state of its partition {p} in the savepoint at "
                f"{where!r} does not restore ({type(exc).__name__}: {exc})"
            ) from exc
        if kv is None:
            raise ConfigError(
                f"{task.describe()}: parallelism {now} here, {was} in the savepoint at "
                f"{where!r}, but {op.describe()} keeps a state that is not per key "
                f"(keyed_state() is None), so it resumes only at parallelism {was}; "
                "implement keyed_state() and restore_keyed() to rescale it"
            )
        if kv and not _keyed(task):
            raise ConfigError(
                f"{task.describe()}: parallelism {now} here, {was} in the savepoint at "
                f"{where!r}, but its input is not keyed: its per-key state cannot follow its "
                "keys to other partitions; key_by() its input or keep parallelism "
                f"{was}"
            )
        keyed.append(kv)
    out = []
    for entries in split_entries(task, keyed, plan.max_parallelism, now, "the saved state"):
        op = copy.deepcopy(task.operator)
        op.restore_keyed(entries)
        out.append(op.snapshot())
    return out


# -- durable checkpoints (Job(checkpoint_ms=..., checkpoint_dir=...), replication >= 2) -------

KEEP_CHECKPOINTS = 3
"""Complete checkpoints kept in a job's checkpoint directory; older ones are removed once a
newer one is written."""

_CHECKPOINT_PREFIX = "checkpoint-"


def _join(directory: str | os.PathLike, name: str) -> str:
    text = os.fspath(directory)
    return posixpath.join(text, name) if "://" in text else os.path.join(text, name)


def checkpoint_path(directory: str | os.PathLike, epoch: int) -> str:
    """Where the checkpoint cut at heartbeat ``epoch`` goes in ``directory`` (names sort
    as their epochs do)."""
    return _join(directory, f"{_CHECKPOINT_PREFIX}{epoch:012d}")


def _checkpoints(directory: str | os.PathLike) -> tuple[Any, list[tuple[int, str, bool]]]:
    """The filesystem of ``directory`` and what it holds: ``(epoch, path on it,
    complete)`` per checkpoint directory, oldest first (a directory without a manifest,
    or a temporary one of an interrupted write, is not complete; epoch -1: temporary)."""
    from pyarrow import fs

    filesystem, root = _open(directory)
    if not _exists(filesystem, root):
        return filesystem, []
    found = []
    for info in filesystem.get_file_info(fs.FileSelector(root, recursive=False)):
        name = info.base_name
        if info.type != fs.FileType.Directory:
            continue
        if name.startswith(f".{_CHECKPOINT_PREFIX}") and ".tmp-" in name:
            found.append((-1, info.path, False))
            continue
        if not name.startswith(_CHECKPOINT_PREFIX):
            continue
        try:
            epoch = int(name[len(_CHECKPOINT_PREFIX) :])
        except ValueError:
            continue
        found.append((epoch, info.path, _exists(filesystem, posixpath.join(info.path, MANIFEST))))
    return filesystem, sorted(found)


def latest_checkpoint(directory: str | os.PathLike, job: str) -> Savepoint | None:
    """The newest complete checkpoint of job ``job`` in ``directory`` that reads and
    verifies (None: there is none). One that does not — partial, corrupt — is passed over,
    and a checkpoint of another job is a ConfigError."""
    import logging

    _, found = _checkpoints(directory)
    for _, path, complete in reversed(found):
        if not complete:
            continue
        where = _join(directory, posixpath.basename(path))
        try:
            sp = Savepoint.read(where)
        except ConfigError as exc:
            logging.getLogger("tandem").warning("passing over checkpoint %s: %s", where, exc)
            continue
        if sp.job != job:
            raise ConfigError(
                f"checkpoint_dir {os.fspath(directory)!r} holds checkpoints of job "
                f"{sp.job!r}, not of {job!r}: give each job a directory of its own"
            )
        return sp
    return None


def check_no_checkpoints(directory: str | os.PathLike, job: str) -> None:
    """Raise ConfigError if ``directory`` holds a checkpoint: a run that does not resume
    never writes beside (nor over) an earlier run's."""
    _, found = _checkpoints(directory)
    complete = [path for _, path, done in found if done]
    if complete:
        raise ConfigError(
            f"job {job!r}: checkpoint_dir {os.fspath(directory)!r} holds {len(complete)} "
            f"checkpoint(s) of an earlier run (the newest: {posixpath.basename(complete[-1])}); "
            "resume=True (tandem run --resume) continues from the newest, or remove the "
            "directory to start over"
        )


def clear_checkpoints(directory: str | os.PathLike, after: int | None = None) -> list[str]:
    """Remove what an earlier run left unfinished in ``directory`` — temporary and partial
    checkpoints — and, with ``after``, every checkpoint newer than heartbeat ``after`` (the
    one a run resumes from is the newest kept). The paths removed."""
    filesystem, found = _checkpoints(directory)
    removed = []
    for epoch, path, complete in found:
        if not complete or (after is not None and epoch > after):
            filesystem.delete_dir(path)
            removed.append(path)
    return removed


def prune_checkpoints(directory: str | os.PathLike, keep: int = KEEP_CHECKPOINTS) -> list[str]:
    """Keep the newest ``keep`` complete checkpoints in ``directory``; remove older ones,
    complete or not (never a newer partial one: it may be being written). The paths
    removed."""
    filesystem, found = _checkpoints(directory)
    complete = [epoch for epoch, _, done in found if done]
    if len(complete) <= keep:
        return []
    oldest_kept = complete[-keep]
    removed = []
    for epoch, path, _ in found:
        if 0 <= epoch < oldest_kept:
            filesystem.delete_dir(path)
            removed.append(path)
    return removed


def part_sinks(plan: Plan) -> list:
    """The sink tasks of ``plan`` that commit at durable checkpoints (in parts)."""
    if plan.durable_dir is None:
        return []
    return [t for t in plan.tasks if t.kind == "sink" and t.sink.commits_at_checkpoints]


def publish_parts(plan: Plan, epoch: int, cuts: dict[ReplicaId, Resume]) -> None:
    """The durable checkpoint at heartbeat ``epoch`` is complete: publish, per partition of
    every sink in parts, the parts of the replica it was cut from (``cuts``: one per
    partition), and remove the other replicas' (:meth:`tandem.sinks.Sink.publish_parts`)."""
    for task in part_sinks(plan):
        for t, p, r in sorted(cuts):
            if t == task.id:
                task.sink.publish_parts(p, task.parallelism, epoch, r)


def settle_parts(plan: Plan, checkpoint: Savepoint | None) -> None:
    """Before a run of ``plan`` starts from ``checkpoint`` (None: from the beginning): every
    sink in parts keeps the parts through the checkpoint, publishing its own if the lost
    run had not, and loses everything after it (:meth:`tandem.sinks.Sink.settle_parts`)."""
    epoch = 0 if checkpoint is None else checkpoint.epoch
    for task in part_sinks(plan):
        replicas = {}
        if checkpoint is not None:
            replicas = {
                int(part["partition"]): int(part["replica"])
                for part in checkpoint.partitions
                if part["task"] == task.name
            }
        for p in range(task.parallelism):
            task.sink.settle_parts(p, task.parallelism, epoch, replicas.get(p, 0))


def failed(why: str) -> TandemError:
    """The error a savepoint that could not be taken raises."""
    return TandemError(f"savepoint not taken: {why}")


__all__ = [
    "FORMAT_VERSION",
    "KEEP_CHECKPOINTS",
    "MANIFEST",
    "Resumed",
    "Savepoint",
    "check_compatible",
    "check_no_checkpoints",
    "check_target",
    "checkpoint_path",
    "clear_checkpoints",
    "latest_checkpoint",
    "part_sinks",
    "prune_checkpoints",
    "publish_parts",
    "resume",
    "settle",
    "settle_parts",
    "source_positions",
    "write",
]
