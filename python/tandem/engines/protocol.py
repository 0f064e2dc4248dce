"""The messages between a coordinator and its workers, every engine's: one frozen dataclass
each, in this one module.

A coordinator (:mod:`tandem.engines.coordinator`) and a worker
(:func:`tandem.engines.exchange.serve`) speak over a
:class:`multiprocessing.connection.Connection` — a socket pair on the local engine, an
HMAC-authenticated TCP connection to the driver's registry on Spark — and the messages
travel as pickles of these classes. A message that is not one of them, or not the one the
receiver can take at that point, is a :class:`tandem.ProtocolError` naming what came and
what was expected (:func:`expect`); the first message a worker gets (:class:`Assign`) and
the first a Spark task sends (:class:`Hello`) carry :data:`VERSION`, and a peer of another
version is refused with both versions named.

The exchange, in order:

- coordinator → worker: :class:`Assign` (which worker it runs; on the local engine the
  job itself), then for a rebuilt worker :class:`Restore` (its twins' cuts), then
  :class:`Go` (every address and ``t0``); :class:`Exit` at any point (fenced or not
  needed: it leaves at once);
- worker → coordinator: :class:`Waiting` (a rebuilt worker, for its cuts), :class:`Ready`
  (the port of every hosted replica's inbox) or :class:`StartFailed`;
- during the run, coordinator → worker: :class:`CutRequest`, :class:`Link`,
  :class:`Until`, :class:`MetricsEvery`, :class:`CheckpointRequest`,
  :class:`SavepointRequest`, :class:`TakeOver`, a live rescale's
  :class:`RescalePrepare`, :class:`RescaleArm` and :class:`RescaleCancel`, and the faults
  :class:`Crash` and :class:`Freeze` (where the worker cannot be signalled); worker →
  coordinator: :class:`CutTaken`, :class:`Linked`, :class:`Started`, :class:`Evicted`,
  :class:`Starved`, :class:`Failed`, :class:`Metrics`, :class:`Checkpointed`,
  :class:`Savepointed`, :class:`Rescaled` (each step of a live rescale), :class:`Leads`
  (a KaZoo replica won its partition's election), :class:`Alive`
  (a keepalive);
- last, worker → coordinator: :class:`Done`.

Why dataclasses and not msgspec or pydantic structs: a message is one pickle on a
connection at control-path rates (a keepalive every ``failure_timeout_ms / 4``, a metrics
snapshot a second, a handful per rebuild); a frozen slotted dataclass pickles in about
1.3 µs and a tuple in 0.5 µs (``python -m tandem.engines.protocol`` measures both), far
below the connection's own cost, and needs no dependency.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from tandem.exceptions import ProtocolError

VERSION = 4
"""The version of this protocol; a coordinator and a worker of different versions refuse
each other (a cluster whose executors run another tandem than the driver)."""

ReplicaId = tuple[int, int, int]


class Message:
    """The base of every message (for ``isinstance`` checks and :func:`expect`)."""

    __slots__ = ()


# -- before the run -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello(Message):
    """A Spark worker task checking in with the registry: its placement row (``slot``),
    Spark's attempt number, its PID and node, its executor's JVM PID and id."""

    slot: int
    attempt: int
    pid: int
    node: str
    executor_pid: int | None
    executor_id: str | None
    version: int = VERSION


@dataclass(frozen=True, slots=True)
class Assign(Message):
    """The worker a process or task runs: its index, the replicas it hosts, and whether it
    rebuilds lost ones (``rejoin``: it says :class:`Waiting` and gets :class:`Restore`).
    The local engine also sends the job: the coordinator's ``sys.path``, the plan as a
    cloudpickle blob, the job secret and the KaZoo run (Spark tasks have them in the
    UDF's closure)."""

    worker: int
    replicas: tuple[ReplicaId, ...]
    rejoin: bool = False
    path: tuple[str, ...] = ()
    plan: bytes | None = None
    secret: bytes | None = None
    kazoo: Any = None
    version: int = VERSION


@dataclass(frozen=True, slots=True)
class Retire(Message):
    """A Spark task attempt that runs no worker (a retry that does not rejoin)."""

    why: str


@dataclass(frozen=True, slots=True)
class Waiting(Message):
    """A rebuilt worker has loaded the job and waits for its replicas' cuts."""


@dataclass(frozen=True, slots=True)
class Restore(Message):
    """The cuts a rebuilt worker's replicas resume from (replica → ``runtime.Resume``)."""

    cuts: dict
    t0_ns: int


@dataclass(frozen=True, slots=True)
class Ready(Message):
    """Every hosted replica's inbox port (None: a replica with no inbox, a source)."""

    ports: dict


@dataclass(frozen=True, slots=True)
class StartFailed(Message):
    """The worker could not start (the job did not load, a bind failed): why."""

    why: str


@dataclass(frozen=True, slots=True)
class Go(Message):
    """Start: every replica's address, the logical time origin, the run's length (None:
    until :class:`Until` says final) and warm-up."""

    addresses: dict
    t0_ns: int
    duration: float | None
    warmup: float


@dataclass(frozen=True, slots=True)
class Exit(Message):
    """Leave at once: fenced (declared lost; its replicas are rebuilt elsewhere) or not
    needed (a rebuild given up before it ran). A fenced worker must never send another
    row."""

    why: str


# -- during the run: coordinator -> worker ------------------------------------------------


@dataclass(frozen=True, slots=True)
class CutRequest(Message):
    """Cut replica ``twin`` at its next heartbeat boundary for a rebuild (``token``
    comes back with the cut); a large state goes to a file in ``folder`` if given."""

    twin: ReplicaId
    token: tuple
    folder: str | None = None


@dataclass(frozen=True, slots=True)
class Link(Message):
    """Feed rebuilt replica ``down`` (listening at ``address``) from ``up``'s replay
    window, from heartbeat ``epoch`` on."""

    up: ReplicaId
    down: ReplicaId
    address: tuple[str, int]
    epoch: int


@dataclass(frozen=True, slots=True)
class Until(Message):
    """A run with no duration: the sources may go up to ``until_ns`` of source time
    (``final``: and end there; ``drain``: and the operators emit their final output at
    the end — not at a stop at a savepoint)."""

    until_ns: int
    final: bool
    drain: bool = True


@dataclass(frozen=True, slots=True)
class MetricsEvery(Message):
    """Send a :class:`Metrics` snapshot every ``every_s`` seconds."""

    every_s: float


@dataclass(frozen=True, slots=True)
class CheckpointRequest(Message):
    """Cut every replica but the sinks right after heartbeat ``epoch`` and write each
    state into ``folder``."""

    epoch: int
    folder: str


@dataclass(frozen=True, slots=True)
class SavepointRequest(Message):
    """Cut ``replicas`` (those of them this worker hosts; sinks too) right after heartbeat
    ``epoch`` for a savepoint (:mod:`tandem.savepoints`) and write each state into
    ``folder``. ``roll``: a durable checkpoint's — a sink that commits at checkpoints
    (:attr:`tandem.sinks.Sink.commits_at_checkpoints`) closes its part there too.
    ``leaders_hold``: KaZoo replicas of ``replicas`` that, leading their partition when
    asked, only hold their orders at ``epoch`` and are not cut (answered with no cut): a
    twin, asked too, is cut there while the leader orders on — a leader paused by its
    own cut would pause its partition's orders."""

    epoch: int
    folder: str
    replicas: tuple[ReplicaId, ...]
    roll: bool = False
    leaders_hold: tuple[ReplicaId, ...] = ()


@dataclass(frozen=True, slots=True)
class RescalePrepare(Message):
    """A live rescale (:mod:`tandem.runtime.rescaling`): task ``task`` goes from ``was`` to
    ``now`` partitions right after heartbeat ``epoch``; set up what this worker hosts of
    it (answered by :class:`Rescaled` ``"prepared"``)."""

    id: int
    task: int
    was: int
    now: int
    epoch: int


@dataclass(frozen=True, slots=True)
class RescaleArm(Message):
    """Every worker is prepared: arm the switch, with the new partitions' ``addresses``
    (answered by :class:`Rescaled` ``"armed"``, and ``"started"`` after the switch)."""

    id: int
    addresses: dict


@dataclass(frozen=True, slots=True)
class RescaleCancel(Message):
    """Give the live rescale up (before the lease passes its heartbeat): undo it all
    (answered by :class:`Rescaled` ``"cancelled"``)."""

    id: int


@dataclass(frozen=True, slots=True)
class Crash(Message):
    """A fault injected where the coordinator cannot signal the worker's process (a
    cluster's executors): SIGKILL yourself — ``unit="executor"``: the executor JVM above
    you first, every worker on it with it."""

    unit: str = "worker"


@dataclass(frozen=True, slots=True)
class Freeze(Message):
    """A ``td.Pause`` where the coordinator cannot signal the worker: SIGSTOP yourself for
    ``for_s`` seconds (a child process you leave behind sends the SIGCONT)."""

    for_s: float


@dataclass(frozen=True, slots=True)
class TakeOver(Message):
    """Replica ``rid`` of an owned sink (a Kafka sink's twin) becomes its partition's owner:
    the owner was lost."""

    rid: ReplicaId


# -- during the run: worker -> coordinator ------------------------------------------------


@dataclass(frozen=True, slots=True)
class CutTaken(Message):
    """The cut of ``twin`` asked with ``token`` (``taken`` None: it could not be taken —
    the replica finished, failed or was going by)."""

    twin: ReplicaId
    taken: Any
    token: tuple


@dataclass(frozen=True, slots=True)
class Linked(Message):
    """``up`` answered the request to feed ``down`` (``error``: why it could not)."""

    up: ReplicaId
    down: ReplicaId
    error: str | None


@dataclass(frozen=True, slots=True)
class Started(Message):
    """A rebuilt worker's replicas have dialled their downstream replicas."""


@dataclass(frozen=True, slots=True)
class Evicted(Message):
    """``up`` dropped ``down`` as a straggler: ``down``'s input is incomplete from now."""

    up: ReplicaId
    down: ReplicaId


@dataclass(frozen=True, slots=True)
class Starved(Message):
    """``rid`` stopped: an input channel lost every upstream replica feeding it before its
    end (``why``), so the rest of its input will never come."""

    rid: ReplicaId
    why: str


@dataclass(frozen=True, slots=True)
class Failed(Message):
    """A hosted replica failed the job (``failures`` as :class:`Done`'s), said before the
    worker closes its links: replicas downstream then starve (:class:`Starved`), and the
    run must fail for the cause, not for them."""

    failures: tuple[tuple[ReplicaId, str, bool], ...]


@dataclass(frozen=True, slots=True)
class Metrics(Message):
    """A metrics snapshot of the worker (:mod:`tandem.metrics`)."""

    snapshot: dict


@dataclass(frozen=True, slots=True)
class Checkpointed(Message):
    """``rid``'s cut for checkpoint ``epoch`` is on disk (``taken`` None: too late)."""

    epoch: int
    rid: ReplicaId
    taken: Any


@dataclass(frozen=True, slots=True)
class Savepointed(Message):
    """``rid``'s cut for the savepoint at heartbeat ``epoch`` is on disk (``taken`` None:
    it could not be taken — the replica had passed the epoch, or finished)."""

    epoch: int
    rid: ReplicaId
    taken: Any


@dataclass(frozen=True, slots=True)
class Rescaled(Message):
    """A step of live rescale ``id`` done by the worker: ``what`` is ``"prepared"``
    (``details["ports"]``: the new partitions' inbox ports), ``"armed"``, ``"started"``
    (``details["rids"]``, ``details["switch_ms"]``) or ``"cancelled"``;
    ``details["error"]`` if the step failed."""

    id: int
    what: str
    details: dict


@dataclass(frozen=True, slots=True)
class Leads(Message):
    """KaZoo: replica ``rid`` leads its partition with ``epoch`` since ``since_ns`` (wall
    clock), sent the moment it won the election. A replica's own report names the terms
    it led too, but a replica lost while leading reports nothing: this is how its term is
    known."""

    rid: ReplicaId
    epoch: int
    since_ns: int


@dataclass(frozen=True, slots=True)
class Alive(Message):
    """A keepalive (sent every ``failure_timeout_ms / 4`` when the job rebuilds), with the
    CPU-seconds the worker's process has used since it was assigned."""

    cpu_s: float | None = None


@dataclass(frozen=True, slots=True)
class Done(Message):
    """The worker finished: its replicas' reports (None where they travel another way, as
    Spark output rows), the replicas whose operator failed, with the error and whether
    it was a divergence, and the CPU-seconds the worker's process used since it was
    assigned (user + system, every thread: the replicas' work wherever it runs)."""

    reports: dict | None = None
    failures: tuple[tuple[ReplicaId, str, bool], ...] = field(default_factory=tuple)
    cpu_s: float | None = None


M = TypeVar("M", bound=Message)


def expect(message: object, *kinds: type[M], what: str = "") -> M:
    """``message`` if it is one of ``kinds``, else a :class:`tandem.ProtocolError` naming
    what came and what was expected (``what``: at which point)."""
    if isinstance(message, kinds):
        return message
    names = " or ".join(k.__name__ for k in kinds)
    where = f" {what}" if what else ""
    if isinstance(message, Message):
        got = f"{type(message).__name__} {message!r}"
    else:
        got = f"{type(message).__name__} {message!r:.200}, which is no tandem message"
    raise ProtocolError(f"expected {names}{where}, got {got}")


def check_version(version: int, peer: str) -> None:
    """Refuse a peer of another protocol version, naming both."""
    if version != VERSION:
        raise ProtocolError(
            f"{peer} speaks tandem protocol version {version}, this process {VERSION}: "
            "install the same tandem on the driver and every executor"
        )


def _measure() -> None:  # pragma: no cover - a measurement, run by hand
    import pickle
    import timeit

    rid = (1, 0, 1)
    msg = Linked(rid, (2, 0, 0), None)
    tup = ("linked", rid, (2, 0, 0), None)
    for name, obj in (("dataclass", msg), ("tuple", tup)):
        n = 200_000
        s = timeit.timeit(lambda o=obj: pickle.loads(pickle.dumps(o, 5)), number=n)
        print(f"{name:10s} dumps+loads {s / n * 1e6:.2f} us, {len(pickle.dumps(obj, 5))} bytes")


if __name__ == "__main__":  # pragma: no cover
    _measure()
