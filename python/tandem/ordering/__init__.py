"""Consumption orders (DESIGN §2, invariant 3): how the replicas of a task partition agree
on the order in which they consume their deduplicated input channels.

* ``none`` and ``liverobin`` run entirely inside the Rust inbox (``tandem._core.Inbox``):
  first come, first served, and the leaderless deterministic merge of the paper's §V.
* ``kazoo`` (:mod:`tandem.ordering.kazoo`): the replicas elect a leader in ZooKeeper; the
  leader publishes positional orders to a Kafka topic that every replica, leader included,
  follows through the inbox's order feed (the paper's §IV, with fencing); where ZooKeeper
  and Kafka are by default, and the probes of both, are in :mod:`tandem.endpoints`.

Only a replicated operator partition with two or more input channels has anything to
order: a single channel has one order, and a sink is an unreplicated consumer. Such
partitions consume first come, first served whatever the job's ordering
(:meth:`tandem.plan.Plan.inbox_ordering`).
"""

from __future__ import annotations
