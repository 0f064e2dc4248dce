"""A worker: the replicas one OS process hosts, served from one thread (see
:mod:`tandem.runtime`)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque

import pyarrow as pa

from tandem import _core
from tandem.exceptions import ConfigError
from tandem.ordering.kazoo import KazooRun, KazooSession
from tandem.plan import Plan
from tandem.runtime.cuts import Resume, SlotCuts
from tandem.runtime.priority import renice_threads
from tandem.runtime.pumps import CREDIT_POLL_S, _LogSource, _Source
from tandem.runtime.replica import Addresses, Replica, ReplicaId, ReplicaReport, failures
from tandem.runtime.rescaling import RescaleSpec, Rescaling

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05
"""How long a worker waits for input before checking on its KaZoo orderers again."""

METRICS_EVERY_S = 1.0
"""How often a worker hands :attr:`Worker.on_metrics` a snapshot, when the engine asks for
them (:mod:`tandem.metrics`)."""
#: Added to the niceness of a rebuilt worker's thread while it loads its states and
#: catches up (:attr:`Worker.caught_up_nice`).
CATCH_UP_NICE = 10

DRAIN_WORD_S = 30.0
"""How long an operator whose input ended waits for the engine's word on whether the stop
drains (:meth:`Worker.drains`); it comes before the end, but by another connection."""


def _warm_up() -> None:
    """Pay pyarrow's lazy imports now, while the job starts, not on the first batch after
    t0: building any array loads pyarrow's pandas shim, which imports pandas when it is
    installed (pyspark brings it) — about a CPU-second per process, enough for a job's
    replica processes to stall the first seconds of the stream on a small machine."""
    pa.array([0])


class Worker:
    """One worker process's replicas, served from one thread (see the module
    documentation). ``rids``: the ``(task, partition, replica)`` it hosts."""

    def __init__(
        self,
        plan: Plan,
        rids: list[ReplicaId],
        secret: bytes,
        kazoo: KazooRun | None = None,
        resume: dict[ReplicaId, Resume] | None = None,
    ) -> None:
        self.plan = plan
        self.core = _core.Worker()
        self.control: deque[tuple] = deque()
        """Requests from the engine, taken by the worker thread between work items
        (:meth:`request_cut`, :meth:`link`); any thread may add to it."""
        self.cuts = SlotCuts(self.core)
        """The cuts asked of the hosted replicas, taken as the core stops each at its
        boundary (its callbacks: :attr:`on_cut`, :attr:`state_folder`,
        :attr:`on_checkpoint`)."""
        self.on_link = None
        """Called with ``(upstream rid, downstream rid, error or None)`` after a link."""
        self.on_started = None
        """Called once every replica has started (its downstream replicas dialled): a
        rebuilt worker is not a twin to count on before."""
        self.caught_up_nice: int | None = None
        """A rebuilt worker whose thread set itself a lower priority for the rebuild
        (:data:`CATCH_UP_NICE`, by the exchange where the process may raise it back:
        :func:`may_raise_priority`): the niceness the worker thread goes back to once it
        has consumed its replay — the first time it finds nothing to do after some
        input. Loading the states and catching up take the CPU the survivors leave, not
        theirs."""
        self.on_evicted = None
        """Called with ``(upstream rid, downstream rid)`` when an outbox dropped a
        downstream replica as a straggler (checked every ``IDLE_WAIT_S``)."""
        self.on_failed = None
        """Called with the failures (``(rid, error, diverged)``) of a worker a replica of
        which failed the job, before it closes its links: the cause reaches the engine
        before the replicas downstream starve."""
        self.on_starved = None
        """Called with ``(rid, why)`` as soon as a hosted replica stops because an input
        channel lost every upstream replica feeding it (:class:`tandem.InputStarved`)."""
        ordered = set(plan.ordered_partitions()) if kazoo is not None else set()
        # One ZooKeeper session and one Kafka producer/consumer for every ordered partition
        # the worker hosts.
        self.kazoo = (
            KazooSession(kazoo, self.core, name="w{}.{}.{}-pid{}".format(*rids[0], os.getpid()))
            if any((t, p) in ordered for t, p, _ in rids)
            else None
        )
        self.replicas = [Replica(plan, *rid, secret, self.core, kazoo=self.kazoo) for rid in rids]
        # A job resumed from a savepoint (Plan.resumed): every replica from its cut, unless
        # rebuilt from a twin's or a checkpoint's.
        saved = plan.resumed.cuts if plan.resumed is not None else {}
        for r in self.replicas:
            r.resume = (resume or {}).get(r.me) or saved.get(r.me)
        if self.kazoo is not None and resume:
            # Rebuilt from twins: read the order log from the earliest place their cuts
            # stood at (each replica's log skips what it had read already).
            offsets = [
                (resume.get(r.me) and resume[r.me].order_log_offset)
                for r in self.replicas
                if (r.me[0], r.me[1]) in ordered
            ]
            if offsets and all(o is not None for o in offsets):
                self.kazoo.start_offset = min(offsets)
        self.until: tuple[int, bool] | None = None
        """A run with no duration: the source time its sources may emit through (ns after
        t0) and whether the run stops there (:meth:`extend`)."""
        self._stopping = threading.Event()
        self._drains = True
        self._until_mode = False
        self._sources: list[_Source | _LogSource] = []
        self.on_metrics = None
        """Called (from the worker thread) with a :meth:`metrics` snapshot every
        :attr:`metrics_every` seconds while the replicas run."""
        self.metrics_every: float | None = None
        """Set (from any thread) to have :attr:`on_metrics` called; None: never."""
        self.on_rescale = None
        """Called with ``(what, rescale id, details)`` as a live rescale goes
        (:mod:`tandem.runtime.rescaling`): ``"prepared"`` (details: the new partitions'
        ports, or ``{"error": ...}``), ``"armed"`` (``{}`` or ``{"error": ...}``),
        ``"started"`` (the new partitions, the time the switch took)."""
        self._rescaling: Rescaling | None = None
        self._adopted: list[Replica] = []  # started by a rescale, for the loop to serve
        self._secret = secret
        self._host = "127.0.0.1"
        self._addresses: Addresses = {}
        self._t0_ns = 0

    @property
    def on_cut(self):
        """Called with every cut taken on the engine's request (:attr:`SlotCuts.on_cut`)."""
        return self.cuts.on_cut

    @on_cut.setter
    def on_cut(self, fn) -> None:
        self.cuts.on_cut = fn

    @property
    def state_folder(self):
        """Where a cut's state should be written (:attr:`SlotCuts.state_folder`)."""
        return self.cuts.state_folder

    @state_folder.setter
    def state_folder(self, fn) -> None:
        self.cuts.state_folder = fn

    @property
    def on_checkpoint(self):
        """Called with every replica cut for a checkpoint (:attr:`SlotCuts.on_checkpoint`)."""
        return self.cuts.on_checkpoint

    @on_checkpoint.setter
    def on_checkpoint(self, fn) -> None:
        self.cuts.on_checkpoint = fn

    @property
    def on_savepoint(self):
        """Called with every replica cut for a savepoint (:attr:`SlotCuts.on_savepoint`)."""
        return self.cuts.on_savepoint

    @on_savepoint.setter
    def on_savepoint(self, fn) -> None:
        self.cuts.on_savepoint = fn

    # -- requests from the engine (any thread) ------------------------------------------

    def request_cut(self, rid: ReplicaId, token) -> None:
        """Take a cut of replica ``rid`` at its next heartbeat-cycle boundary and hand it to
        :attr:`on_cut` with ``token``."""
        self.control.append(("cut", rid, token))
        self.core.wake()

    def take_over(self, rid: ReplicaId) -> None:
        """Replica ``rid`` of an owned sink (:attr:`tandem.sinks.Sink.owned`) becomes its
        partition's owner: its lost owner's writer is fenced and it writes on from the
        owner's last commit."""
        self.control.append(("take_over", rid, None))
        self.core.wake()

    def request_checkpoint(self, epoch: int) -> None:
        """Cut every hosted replica but the sinks right after it forwards heartbeat
        ``epoch`` (an aligned cut: ``_core.Worker.request_cut_at``) and hand each to
        :attr:`on_checkpoint`."""
        self.control.append(("checkpoint", None, epoch))
        self.core.wake()

    def request_savepoint(
        self, epoch: int, rids, roll: bool = False, leaders_hold=(), folder: str | None = None
    ) -> None:
        """Cut the hosted replicas among ``rids`` (sinks too) right after each forwards
        heartbeat ``epoch`` and hand each to :attr:`on_savepoint`; ``roll``: a sink that
        commits at checkpoints closes its part there (:meth:`Replica.roll`);
        ``leaders_hold``: those that, leading a KaZoo partition, only hold their orders
        there; ``folder``: where the states go, a large one written there by a forked
        child (:meth:`SlotCuts.ask_savepoint`)."""
        self.control.append(
            ("savepoint", tuple(rids), epoch, roll, frozenset(leaders_hold), folder)
        )
        self.core.wake()

    def link(self, up: ReplicaId, down: ReplicaId, address: tuple[str, int], epoch: int) -> None:
        """Have replica ``up`` send to ``down``, rebuilt from a cut at heartbeat ``epoch``
        and listening at ``address`` (:meth:`Replica.attach`); the outcome goes to
        :attr:`on_link`. The connection is dialled on a thread of its own, the links of
        one rebuild in parallel: the new process answers the handshakes while it is still
        setting up its replicas, and the worker thread, which serves the replicas that
        mask the loss meanwhile, only attaches the dialled link (:meth:`Replica.attach`)."""
        rep = next((r for r in self.replicas if r.me == up), None)

        def dial() -> None:
            try:
                if rep is None:
                    raise ConfigError(f"this worker hosts no replica {up}")
                output, _ = rep.output_to(down)
                dialed = output.outbox.dial(address)
            except Exception as exc:
                self.control.append(("linked", up, down, exc))
            else:
                self.control.append(("linked", up, down, (dialed, address, epoch)))
            self.core.wake()

        name = "tandem-dial-{}.{}.{}".format(*down)
        threading.Thread(target=dial, name=name, daemon=True).start()

    def rescale(self, what: str, *args) -> None:
        """A step of a live rescale (:mod:`tandem.runtime.rescaling`), from the engine:
        ``("prepare", RescaleSpec)``, ``("arm", rescale id, addresses)`` or
        ``("cancel", rescale id)``; answered through :attr:`on_rescale`."""
        self.control.append(("rescale_" + what, *args))
        self.core.wake()

    def extend(self, until_ns: int, final: bool, drain: bool = True) -> None:
        """A run with no duration (``run(duration=None)``): the hosted sources may emit
        what falls due through ``until_ns`` ns after t0; ``final``: the run stops there
        (see :class:`_Source`). The engine only ever moves it forward. ``drain`` (with
        ``final``): the operators' final output is emitted at the end, as at the end of
        a stream; False at a stop at a savepoint, whose resumed run goes on with the
        state that output would have come from (:meth:`drains`)."""
        if final:
            self._drains = drain
            self._stopping.set()
        self.control.append(("until", until_ns, final))
        self.core.wake()

    def drains(self) -> bool:
        """Whether an operator's end emits its final output (``finish()``). The same for
        every replica of the run: the end reaches an operator only after its sources had
        the final word of :meth:`extend`, and the engine sends that word to every worker
        with the same ``drain`` — so in a run with no duration this waits for it, should
        the end have come first by another connection."""
        if not self._until_mode:
            return True
        if not self._stopping.wait(DRAIN_WORD_S):
            log.warning(
                "an operator's input ended with no word of the stop from the engine in "
                "%.0f s: its final output is emitted",
                DRAIN_WORD_S,
            )
            return True
        return self._drains

    def _serve_control(self, by_rid: dict[ReplicaId, Replica]) -> None:
        while self.control:
            req = self.control.popleft()
            if req[0] == "until":
                self.until = req[1:]
                for src in self._sources:
                    src.extend(*self.until)
                continue
            if req[0] == "checkpoint":
                self.cuts.ask_checkpoint(self.replicas, req[2])
                continue
            if req[0] == "savepoint":
                asked = set(req[1])
                self.cuts.ask_savepoint(
                    [r for r in self.replicas if r.me in asked], req[2], req[3], req[4], req[5]
                )
                continue
            if req[0].startswith("rescale_"):
                self._rescale_control(req)
                continue
            rep = by_rid.get(req[1])
            if req[0] == "cut":
                self.cuts.ask(req[1], rep, req[2])
            elif req[0] == "take_over":
                if rep is None or rep.done:
                    log.warning("%s cannot take over: it has finished", req[1])
                else:
                    rep.take_over()
            else:  # "linked": dialled (or not) by the thread :meth:`link` started
                _, up, down, dialed = req
                try:
                    if isinstance(dialed, Exception):
                        raise dialed
                    if rep is None:
                        raise ConfigError(f"this worker hosts no replica {up}")
                    rep.attach(down, *dialed)
                except Exception as exc:
                    self.on_link(up, down, f"{type(exc).__name__}: {exc}")
                else:
                    self.on_link(up, down, None)

    # -- a live rescale (the worker thread) ----------------------------------------------

    def _rescale_control(self, req: tuple) -> None:
        what, rs = req[0], self._rescaling
        if what == "rescale_prepare":
            spec: RescaleSpec = req[1]
            if rs is not None and not rs.done:
                rs.cancel()
            try:
                self._rescaling, ports = Rescaling.prepare(
                    spec,
                    self.plan,
                    self.replicas,
                    self._host,
                    lambda rid, plan: Replica(plan, *rid, self._secret, self.core),
                )
            except Exception as exc:
                self._rescaling = None
                self.on_rescale("prepared", spec.id, {"error": f"{type(exc).__name__}: {exc}"})
            else:
                olds = len(self._rescaling.olds)
                self.on_rescale("prepared", spec.id, {"ports": ports, "olds": olds})
            return
        if rs is None or rs.spec.id != req[1]:
            if what == "rescale_cancel":
                self.on_rescale("cancelled", req[1], {})
            return
        if what == "rescale_arm":
            addresses = self._addresses = {**self._addresses, **req[2]}
            local = {r.me: r.inbox for r in self.replicas if r.inbox is not None}
            replicas = list(self.replicas)

            def arm() -> None:  # it dials: off the worker thread
                try:
                    rs.arm_links(replicas, addresses, local, self._t0_ns)
                except Exception as exc:
                    self.control.append(("rescale_armed", rs.spec.id, exc))
                else:
                    self.control.append(("rescale_armed", rs.spec.id, None))
                self.core.wake()

            threading.Thread(target=arm, name="tandem-rescale-arm", daemon=True).start()
        elif what == "rescale_armed":
            error = req[2]
            if rs.cancelled:  # cancelled while it dialled: it armed nothing after that
                return
            if error is None and not rs.done:
                try:
                    rs.ask_cuts()
                except Exception as exc:
                    error = exc
            if error is not None:
                self.on_rescale("armed", rs.spec.id, {"error": f"{type(error).__name__}: {error}"})
            else:
                self.on_rescale("armed", rs.spec.id, {})
        elif what == "rescale_cancel":
            if not rs.done:
                rs.cancel()
            self.on_rescale("cancelled", rs.spec.id, {})

    def _rescale_cut(self, rep: Replica, item) -> bool:
        """An old partition's cut at the rescale's heartbeat; False if it failed the job."""
        rs = self._rescaling
        try:
            started = rs.on_cut(rep, item)
        except Exception as exc:
            rep.fail(exc)
            return rep.report.error is None
        if started is None:
            return True
        self.plan = rs.new_plan
        for r in self.replicas:
            r.plan = rs.new_plan
        self._adopted += started
        self.replicas += started
        took_ms = (time.monotonic() - rs.cut_s) * 1e3
        self._rescaling = None
        self.on_rescale(
            "started", rs.spec.id, {"rids": [r.me for r in started], "switch_ms": took_ms}
        )
        return True

    def metrics(self) -> dict:
        """A snapshot of every hosted replica's counters (:meth:`Replica.metrics`), taken on
        the worker thread (or after :meth:`run`): ``{"pid", "replicas": {rid: {...}}}``."""
        now = time.time_ns()
        slots = self.core.slot_stats()
        return {
            "pid": os.getpid(),
            "replicas": {r.me: r.metrics(slots, now) for r in self.replicas},
        }

    def bind(self, host: str = "127.0.0.1") -> dict[ReplicaId, int | None]:
        """Create every hosted replica's inbox, and start contending for the leadership of
        its ordered partitions; each replica's port (None for a source)."""
        _warm_up()
        self._host = host
        ports = {r.me: r.bind(host) for r in self.replicas}
        if self.kazoo is not None:
            self.kazoo.start()
            for r in self.replicas:
                if r.orderer is not None:
                    r.orderer.start()
        return ports

    def restore(self, t0_ns: int) -> None:
        """Load every rebuilt replica's operator state (see :meth:`Replica.restore`)."""
        for r in self.replicas:
            r.restore(t0_ns)

    def release(self) -> None:
        """Give up every KaZoo leadership at once (a graceful stop: SIGTERM)."""
        if self.kazoo is not None:
            self.kazoo.stop()

    def run(
        self, addresses: Addresses, t0_ns: int, duration: float | None, warmup: float = 0.0
    ) -> dict[ReplicaId, ReplicaReport]:
        """Run every hosted replica to the end of its input; never raises (errors are in
        the reports). The first replica that fails stops the worker: the job fails.
        ``duration``: seconds of source time; None: until the engine says where the run
        stops (:meth:`extend`). ``warmup``: seconds after ``t0_ns`` the sinks leave out of
        their latency record."""
        local = {r.me: r.inbox for r in self.replicas if r.inbox is not None}
        self._until_mode = duration is None
        self._addresses, self._t0_ns = dict(addresses), t0_ns
        try:
            for r in self.replicas:
                try:
                    r.start(addresses, t0_ns, local, warmup)
                except Exception as exc:
                    r.fail(exc)
                    if r.report.error:
                        return self._finish()
            if self.on_started is not None:
                self.on_started()
            self._loop(duration)
            self._serve_control({r.me: r for r in self.replicas})
            self._drain_savepoint_cuts()
        except Exception as exc:  # a fault of the worker itself: blame every live replica
            for r in self.replicas:
                if not r.done:
                    r.fail(exc)
        return self._finish()

    def _finish(self) -> dict[ReplicaId, ReplicaReport]:
        failed = failures({r.me: r.report for r in self.replicas})
        if failed and self.on_failed is not None:
            self.on_failed(failed)  # before the links close
        reports = {}
        for r in self.replicas:
            try:
                reports[r.me] = r.finish()
            except Exception as exc:
                r.fail(exc)
                reports[r.me] = r.report
        if self.kazoo is not None:
            self.kazoo.stop()
        return reports

    def _loop(self, duration: float | None) -> None:
        core = self.core
        by_slot = {r.slot: r for r in self.replicas if not r.done}
        sources, logs = [], []
        for r in by_slot.values():
            if r.task.kind == "source":
                if r.log_reader is not None:
                    logs.append(_LogSource(r, duration))
                else:
                    sources.append(_Source(r, duration))
        self._sources = [*sources, *logs]
        if self.until is not None:
            for src in self._sources:
                src.extend(*self.until)
        orderers = [r.orderer for r in self.replicas if r.orderer is not None]
        by_rid = {r.me: r for r in self.replicas}
        control = self.control
        live = len(by_slot)
        served = 0  # work items served, while catching up
        checked = measured = time.monotonic()
        while live:
            if control:
                self._serve_control(by_rid)
            while self._adopted:  # a live rescale's new partitions
                rep = self._adopted.pop()
                by_slot[rep.slot], by_rid[rep.me] = rep, rep
                live += 1
            wait = IDLE_WAIT_S
            if self.cuts.held:
                wait = min(wait, self.cuts.release_held())
            if sources:
                now = time.time_ns()
                finished = False
                for src in sources:
                    rep = src.replica
                    blocked = False
                    while src.step is not None and src.due_ns() <= now:
                        if not core.ready(rep.slot):
                            blocked = True  # its links are backed up: look again soon
                            break
                        if not self._guard(rep, src.run_step):
                            return
                        if rep.done:
                            live -= 1
                            self._retire(rep)
                            break
                    if src.step is not None and not rep.done:
                        due_s = CREDIT_POLL_S if blocked else (src.due_ns() - now) / 1e9
                        wait = min(wait, max(0.0, due_s))
                    elif rep.done:
                        finished = True
                    # else: waiting for the engine's word (a run with no duration)
                if finished:
                    sources = [s for s in sources if not s.replica.done]
                if not live:
                    return
            if logs:
                now = time.time_ns()
                for src in logs:
                    rep = src.replica
                    try:
                        again = src.pump(now)
                    except Exception as exc:
                        rep.fail(exc)
                        if rep.report.error is not None:
                            return
                        again = None
                    if rep.done:
                        live -= 1
                        self._retire(rep)
                    elif again is not None:
                        wait = min(wait, max(0.0, again))
                logs = [s for s in logs if not s.replica.done]
                if not live:
                    return
            item = core.next(timeout=wait)
            if self.caught_up_nice is not None:
                if item is None and served and wait > 0:  # caught up
                    renice_threads(self.caught_up_nice)
                    self.caught_up_nice = None
                served += item is not None
            if item is not None:
                rep = by_slot[item.slot]
                if item.kind == "cut":
                    rs = self._rescaling
                    if rs is not None and rs.wants(rep, item):
                        if not self._rescale_cut(rep, item):
                            return
                        continue
                    self.cuts.take(rep, item)
                    continue
                if not self._dispatch(rep, item):
                    return
                if rep.done:
                    live -= 1
                    self._retire(rep)
            if time.monotonic() - checked >= IDLE_WAIT_S:
                checked = time.monotonic()
                for o in orderers:
                    o.check()
                if self.on_evicted is not None:
                    for r in self.replicas:
                        for down in r.evicted():
                            self.on_evicted(r.me, down)
                every = self.metrics_every
                if every is not None and checked - measured >= every:
                    measured = checked
                    self.on_metrics(self.metrics())

    def _drain_savepoint_cuts(self) -> None:
        """Every replica has finished: hand out the savepoint cuts the core took as the
        last of them ended (a source's cut follows its last heartbeat, right before its
        end, with no work item between)."""
        by_slot = {r.slot: r for r in self.replicas if r.slot is not None}
        while self.cuts.savepoints:
            item = self.core.next(timeout=0.05)
            if item is None:
                break
            if item.kind == "cut" and item.slot in by_slot:
                self.cuts.take(by_slot[item.slot], item)
        for slot, epoch in list(self.cuts.savepoints.items()):  # never came: not taken
            del self.cuts.savepoints[slot]
            self.cuts.on_savepoint(by_slot[slot].me, epoch, None)

    def _retire(self, rep: Replica) -> None:
        if rep.report.starved is not None:
            # Lost, not finished: downstream sees its links go as a crash's would (open
            # and silent, they would wait on it), and with KaZoo a twin leads now.
            rep.cut_outputs()
            if rep.orderer is not None:
                rep.orderer.stop()
            if self.on_starved is not None:
                self.on_starved(rep.me, rep.report.starved)
        elif rep.report.abandoned is not None and rep.orderer is not None:
            # Its output reaches no one, but its twins may still be on their way: a KaZoo
            # leader resigns now, or its followers would wait for its orders while its
            # worker runs on (its session alive) for the other replicas it hosts.
            rep.orderer.stop()
        self.core.retire(rep.slot)
        self.cuts.retire(rep)

    def _dispatch(self, rep: Replica, item) -> bool:
        """Run ``item`` for ``rep``; False if it failed the job (the worker stops)."""
        try:
            if item.kind == "data":
                rep.on_data(item.channel, item.batch, item.first_seq)
            elif item.kind == "watermark":
                rep.on_watermark(item.epoch)
            elif item.kind == "end":
                rep.on_end(drain=self.drains())
            else:
                rep.fail(item.error)
        except Exception as exc:
            rep.fail(exc)
        return rep.report.error is None

    @staticmethod
    def _guard(rep: Replica, fn) -> bool:
        """Run ``fn`` for ``rep``; False if it failed the job (the worker stops)."""
        try:
            fn()
        except Exception as exc:
            rep.fail(exc)
            return rep.report.error is None
        return True
