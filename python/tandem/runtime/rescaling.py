"""A live rescale of a keyed operator task, as one worker carries it out (the coordinator's
side is in :mod:`tandem.engines.coordinator`; the decisions in :mod:`tandem.rescale`).

Task ``T`` goes from ``n`` to ``m > n`` partitions right after heartbeat ``K``. The
coordinator holds the sources' lease short of ``K`` until every worker is armed, so no
replica can pass ``K`` before then, and the switch is the same point in every replica:

* **prepare** (:meth:`Rescaling.prepare`): a new partition ``T[q]`` (``q >= n``) this
  worker hosts binds a *parked* inbox (it takes nothing until its cut at ``K``); a
  consumer of ``T`` hosted here appends a channel per new partition to its inbox
  (``Worker.join_inputs``), which takes turns from the end of heartbeat cycle ``K``.
* **arm** (:meth:`Rescaling.arm`): on a thread (it dials), every upstream replica of ``T``
  hosted here arms its outbox to route the rows after heartbeat ``K`` over ``m`` channels
  (``Outbox.switch_at``; the channels of the partitions that go on keep their links and
  their sequence numbers), and every new partition dials its consumers. Then, on the
  worker thread, every partition of ``T`` hosted here is asked for an aligned cut at
  ``K``.
* **the switch** (:meth:`Rescaling.on_cut`): each old partition stops right after
  heartbeat ``K``, its input consumed exactly through it, and is held. Once all of them
  are (a worker hosts every partition of its replica group: ``per_group == 1``), their
  states are split by key group (:func:`tandem.rescale.split_entries`): a partition that
  goes on (``q < n``) gets a fresh operator holding its new share and goes on in the same
  slot, inbox and outboxes — its channels continue, nothing is renumbered — and a new
  one unparks its inbox at sequence 0 and takes a slot. No process starts, no state
  leaves the process, the worker thread does it all between two work items.
* **cancel** (:meth:`Rescaling.cancel`), before the lease passes ``K``: everything armed
  is disarmed, the joined channels are taken back, the parked inboxes closed; the job
  runs on exactly as it would have.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from tandem.exceptions import ConfigError
from tandem.plan import Plan
from tandem.runtime.replica import Addresses, Replica, ReplicaId

log = logging.getLogger(__name__)


@dataclass
class RescaleSpec:
    """What the coordinator asks of every worker for one live rescale."""

    id: int
    task: int
    was: int
    now: int
    epoch: int
    """``K``: the switch comes right after this heartbeat."""


@dataclass
class Rescaling:
    """One live rescale in one worker (see the module documentation)."""

    spec: RescaleSpec
    old_plan: Plan
    new_plan: Plan
    built: list[Replica] = field(default_factory=list)
    """The new partitions (``q >= n``) this worker hosts, parked until the switch."""
    olds: list[Replica] = field(default_factory=list)
    """The partitions of ``T`` this worker hosts now: cut at ``K``, then given their share."""
    joined: list[tuple[Replica, list, list]] = field(default_factory=list)
    """Consumers of ``T`` hosted here whose inbox joined the new channels: with their
    inputs and conformers before."""
    switched: list = field(default_factory=list)
    """The outputs (``_Output``) of upstream replicas armed to switch at ``K``."""
    states: dict[int, bytes] = field(default_factory=dict)
    """Old partition -> its operator's state at ``K``, as the cuts come in."""
    armed: bool = False
    done: bool = False
    cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Between the arming thread and a cancel: no switch is armed after a cancel."""
    cut_s: float | None = None
    """When the first old partition stopped at ``K`` (monotonic)."""

    # -- prepare (the worker thread) -------------------------------------------------------

    @classmethod
    def prepare(
        cls, spec: RescaleSpec, plan: Plan, replicas: list[Replica], host: str, make
    ) -> tuple[Rescaling, dict[ReplicaId, int]]:
        """Set up what this worker hosts of the rescale; the new partitions' ports.
        ``make(rid, plan)``: a new :class:`Replica` of this worker."""
        from tandem import rescale

        new_plan = rescale.after(plan, spec.task, spec.now, spec.epoch)
        r = cls(spec, plan, new_plan)
        t, n, m = spec.task, spec.was, spec.now
        try:
            r.olds = [rep for rep in replicas if rep.me[0] == t and not rep.done]
            groups = {rep.me[2] for rep in r.olds}
            for g in sorted(groups):
                have = sorted(rep.me[1] for rep in r.olds if rep.me[2] == g)
                if have != list(range(n)):
                    raise ConfigError(
                        f"a live rescale needs every partition of a replica group in one "
                        f"worker (this one hosts partitions {have} of {n} of replica {g}); "
                        "start the job with fewer workers per replica group"
                    )
            ports = {}
            for g in sorted(groups):
                for q in range(n, m):
                    rep = make((t, q, g), new_plan)
                    ports[rep.me] = rep.bind(host, parked=True)
                    r.built.append(rep)
            appended = [(t, q) for q in range(n, m)]
            for rep in replicas:
                d, p, _ = rep.me
                if rep.done or rep.inbox is None or d == t:
                    continue
                if not any(c.task == t for c in rep.inputs):
                    continue
                before = list(rep.inputs)
                after = new_plan.input_channels(d, p)
                if (
                    after[: len(before)] != before
                    or [(c.task, c.partition) for c in after[len(before) :]] != appended
                ):
                    raise ConfigError(
                        f"{rep.name}: the channels of {plan.tasks[t].name!r} are not the last "
                        "of its inputs, so its new partitions' channels cannot be appended"
                    )
                rep.core.join_inputs(rep.slot, appended, spec.epoch)
                r.joined.append((rep, before, list(rep._conform)))
                rep.inputs = after
                rep._conform = [new_plan.input_conformer(d, c) for c in after]
        except Exception:
            r.cancel()
            raise
        return r, ports

    # -- arm -------------------------------------------------------------------------------

    def arm_links(
        self, replicas: list[Replica], addresses: Addresses, local: dict, t0_ns: int
    ) -> None:
        """Arm the switch of every upstream replica hosted here and dial the new
        partitions' consumers (blocking: on a thread of its own). ``addresses``: every
        replica's, the new partitions' included; ``local``: this worker's inboxes."""
        t, n, m, k = self.spec.task, self.spec.was, self.spec.now, self.spec.epoch
        down = self.new_plan.tasks[t]
        local = {**local, **{rep.me: rep.inbox for rep in self.built}}
        for rep in replicas:
            if rep.done:
                continue
            for o in rep.outputs:
                if o.edge.downstream != t:
                    continue
                targets = [[] for _ in range(n)]
                for q in range(n, m):
                    targets.append(
                        [
                            local.get((t, q, g)) or addresses[(t, q, g)]
                            for g in range(down.replication)
                            if (t, q, g) in local or (t, q, g) in addresses
                        ]
                    )
                with self.lock:
                    if self.cancelled:
                        return
                    o.outbox.switch_at(
                        k,
                        targets,
                        "hash",
                        key=o.edge.key,
                        key_groups=self.new_plan.max_parallelism,
                    )
                    self.switched.append(o)
                new_edge = next(
                    e
                    for e in self.new_plan.output_edges(*rep.me[:2])
                    if e.downstream == t and e.input_index == o.edge.input_index
                )
                for q in range(n, m):
                    for g in range(down.replication):
                        if (t, q, g) not in local and (t, q, g) in addresses:
                            o.peers["{}:{}".format(*addresses[(t, q, g)])] = (t, q, g)
                o.edge = new_edge
        for rep in self.built:
            if self.cancelled:
                return
            rep.connect(addresses, local, t0_ns)

    def ask_cuts(self) -> None:
        """On the worker thread, once armed: every old partition hosted here is cut right
        after it forwards heartbeat ``K``."""
        for rep in self.olds:
            rep.core.request_cut_at(rep.slot, self.spec.epoch)
        self.armed = True

    # -- the switch (the worker thread) ----------------------------------------------------

    def wants(self, rep, item) -> bool:
        """Whether the cut work item ``item`` of ``rep`` is this rescale's."""
        return self.armed and not self.done and item.at == self.spec.epoch and rep in self.olds

    def on_cut(self, rep: Replica, item) -> list[Replica] | None:
        """An old partition stopped right after heartbeat ``K`` (``item.cut`` None: it
        could not be — it had passed ``K`` or finished, which the lease rules out). Held
        until every one is; then the switch: the new partitions to serve, started."""
        if item.cut is None:
            raise ConfigError(
                f"{rep.name} could not be cut at heartbeat {self.spec.epoch} for the live "
                "rescale (it had passed it)"
            )
        if self.cut_s is None:
            self.cut_s = time.monotonic()
        rep.core.hold(rep.slot, True)
        self.states[rep.me[1]] = rep._inst.snapshot()
        if len(self.states) < len({r.me[1] for r in self.olds}):
            return None
        return self._switch()

    def _switch(self) -> list[Replica]:
        from tandem import rescale, savepoints

        t, n, m, k = self.spec.task, self.spec.was, self.spec.now, self.spec.epoch
        plan = self.new_plan
        task = plan.tasks[t]
        states = rescale.split_states(
            self.old_plan.tasks[t],
            [self.states[p] for p in range(n)],
            plan.max_parallelism,
            m,
            k,
        )
        for rep in (*self.olds, *self.built):
            _, q, g = rep.me
            rep._inst = plan.instantiate(t, q, replica=g, t0_ns=rep.t0_ns)
            rep._inst.restore(states[q])
            rep.plan, rep.task = plan, task
        started = []
        for rep in self.built:
            cut = savepoints._fresh_cut(plan, t, rep.me[1], k)
            rep.inbox.unpark(cut[2])
            rep.take_slot(cut)
            started.append(rep)
        for rep in self.olds:
            rep.core.hold(rep.slot, False)
        self.done = True
        return started

    # -- cancel ----------------------------------------------------------------------------

    def cancel(self) -> None:
        """Undo what :meth:`prepare` and the arming did (before the switch): the job goes on
        as if there had been no rescale. A cut at ``K`` still asked is ignored when it
        comes (:meth:`wants` is False once cancelled)."""
        with self.lock:
            self.done = self.cancelled = True
            for o in self.switched:
                o.outbox.cancel_switch()
            self.switched = []
        joined, self.joined = self.joined, []
        for rep, inputs, conform in joined:
            try:
                rep.core.cancel_join(rep.slot)
            except Exception as exc:  # took input already: cannot happen before K
                log.warning("%s: the joined channels stay: %s", rep.name, exc)
                continue
            rep.inputs, rep._conform = inputs, conform
        for rep in self.built:
            try:
                for o in rep.outputs:
                    o.outbox.abort()
                if rep.inbox is not None:
                    rep.inbox.close()
            except Exception:
                log.debug("%s: closing after a cancelled rescale", rep.name, exc_info=True)
        self.built = []
