"""The local engine end to end: real replica processes, real TCP on 127.0.0.1.

Every run is compared with the single-process reference executor of the same job.
"""

from __future__ import annotations

import os
import random
import socket

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import jobs
import tandem as td
from tandem import testing
from tandem.engines.common import multiset_diff
from tandem.exceptions import TaskFailed
from tandem.reference import canonical

RATE = 800
DURATION = 2.5


def boom(batch: pa.RecordBatch) -> pa.RecordBatch:
    if pc.any(pc.greater(batch.column("source_seq"), 300)).as_py():
        raise ValueError("boom: a user bug")
    return batch


def pipeline(
    replication: int, ordering: str = "liverobin", fn=testing.bucket, workers: int | None = None
) -> td.Job:
    return jobs.counting_job("pipe", RATE, replication, fn=fn, ordering=ordering, workers=workers)


def stateless_pipeline(replication: int, ordering: str) -> td.Job:
    """source -> enrich -> tag -> sink over forward edges: every replicated task has a
    single input channel, the only shape `none` keeps correct under replication (with two
    input channels the replicas' output sequences differ and downstream dedup mixes them)."""
    job = td.Job("stateless", replication=replication, ordering=ordering)
    ev = job.source(td.sources.Synthetic(rate=RATE, keys=50, seed=3), parallelism=2)
    tagged = ev.map(testing.bucket, parallelism=2, name="enrich").map(
        bucket_again, parallelism=2, name="tag"
    )
    tagged.sink(td.sinks.Collect())
    return job


def bucket_again(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch.append_column("tag", pc.multiply(batch.column("bucket"), 2))


def union_job(ordering: str, spread: bool = False) -> td.Job:
    """Two sources merged into one stateful task: its per-key counts depend on the order
    in which the replicas consume the two inputs. ``spread``: source ``b`` has a second
    partition, in a second worker of each replica group, so part of the input reaches the
    task over TCP (within one worker, batches pass in memory in the worker's own order)."""
    job = td.Job("union", replication=2, ordering=ordering, workers=2 if spread else None)
    a = job.source(td.sources.Synthetic(rate=RATE, keys=5, seed=1), name="a")
    b = job.source(
        td.sources.Synthetic(rate=RATE, keys=5, seed=2), name="b", parallelism=2 if spread else 1
    )
    a.union(b).key_by("key").process(td.CountPerKey(), parallelism=1, name="count").sink(
        td.sinks.Collect()
    )
    return job


pytestmark = pytest.mark.usefixtures("no_orphans")


def assert_same_as_reference(job: td.Job, res: td.Result) -> None:
    ref = job.run_reference(duration=DURATION, t0_ns=res.t0_ns)
    assert res.output is not None and ref.output is not None
    assert res.output.num_rows == ref.output.num_rows > 0
    assert canonical(res.output).equals(canonical(ref.output))
    assert multiset_diff(ref.output, res.output) == (0, 0)
    assert res.lost == 0 and res.duplicates == 0


@pytest.mark.parametrize("ordering", ["none", "liverobin"])
@pytest.mark.parametrize("replication", [1, 2, 3])
def test_output_equals_reference(replication, ordering):
    # Under `none` only order-insensitive jobs are guaranteed to match the reference.
    job = (
        pipeline(replication)
        if ordering == "liverobin"
        else stateless_pipeline(replication, ordering)
    )
    res = job.run(duration=DURATION, progress=False)
    assert_same_as_reference(job, res)
    assert res.events_in == ref_events_in(job)
    assert res.digests_match
    assert res.p50_ms is not None and 0 < res.p50_ms < 1_000


def ref_events_in(job: td.Job) -> int:
    return job.run_reference(duration=DURATION).events_in


@pytest.mark.parametrize("replication", [2, 3])
def test_killed_replica_is_masked(replication):
    rng = random.Random(replication)
    job = pipeline(replication)
    task = rng.choice(["source", "enrich", "count"])
    fault = td.Kill(
        task,
        partition=rng.randrange(2),
        replica=rng.randrange(replication),
        at=rng.uniform(0.3, DURATION - 0.3),
    )
    res = job.run(duration=DURATION, faults=[fault], progress=False)
    assert_same_as_reference(job, res)
    assert res.digests_match
    # The fault domain is the worker: every replica it hosted is lost, the named one too,
    # and only replicas of the named replica's group.
    lost = testing.lost_replicas(res)
    assert lost == testing.killed_replicas(res)
    assert (task, fault.partition, fault.replica) in lost
    assert {r for _, _, r in lost} == {fault.replica}
    assert res.faults and res.faults[0]["task"] == task
    # masked: no stall longer than a few heartbeat periods plus scheduling noise
    assert res.max_gap_ms < 500


def test_a_kill_may_name_the_worker():
    job = pipeline(2, workers=2)  # two workers per replica group, split by partition
    placement = job.plan().placement()
    assert len(placement) == 2 * 2 + 2  # and a worker per replica of the sink
    res = job.run(duration=DURATION, faults=[td.KillWorker(3, at=1.0)], progress=False)
    assert_same_as_reference(job, res)
    (fault,) = res.faults
    assert (fault["kind"], fault["worker"]) == ("killworker", 3)
    names = {t.id: t.name for t in job.plan().tasks}
    hosted = {(names[t], p, r) for t, p, r in placement[3]}
    assert testing.lost_replicas(res) == testing.killed_replicas(res) == hosted
    lone = jobs.counting_job("pipe", RATE, 2, workers=2, sink_replication=1)
    assert len(lone.plan().placement()) == 2 * 2 + 1
    with pytest.raises(td.ConfigError, match="unreplicated sinks"):
        lone.run(duration=DURATION, faults=[td.KillWorker(4, at=1.0)], progress=False)
    with pytest.raises(td.ConfigError, match="worker must be"):
        td.KillWorker(-1, at=1.0)


def test_file_and_latency_sinks_are_checked_row_by_row(tmp_path):
    """Replicated keyed pipeline into two file sinks and a latency sink: the check reads
    the files back and finds every reference row exactly once in each."""
    import pyarrow.parquet as pq

    job = td.Job("files", replication=2)
    ev = job.source(td.sources.Synthetic(rate=RATE, keys=50, seed=3), parallelism=2)
    out = ev.map(testing.bucket, parallelism=2, name="enrich").key_by("key")
    out.sink(td.sinks.Parquet(tmp_path / "pq"), parallelism=2, name="pq")
    out.sink(td.sinks.Csv(tmp_path / "out.csv"), name="csv")
    out.sink(td.sinks.Latency(), name="latency")
    res = job.run(duration=DURATION, faults=[td.Kill("enrich", 1, 0, at=1.0)], progress=False)
    assert (res.lost, res.duplicates) == (0, 0)
    n = res.events_in
    assert n > 0 and res.events_out == 3 * n
    rows = pa.concat_tables([pq.read_table(f) for f in res.outputs["pq"]])
    assert sorted(rows["source_seq"].to_pylist()) == list(range(n))


@pytest.mark.parametrize("replica", [0, 1])
def test_a_killed_sink_worker_is_masked_by_its_twin(tmp_path, replica):
    """Replicated sinks (r = 2, each replica of every sink partition on a sink worker of
    its own): SIGKILL one sink worker halfway. Every sink's output is whole and once —
    the Collect rows, the Parquet and CSV files read back — the output never stops for
    long, and nothing a replica staged is left behind."""
    job = td.Job("sinks", replication=2)
    ev = job.source(td.sources.Synthetic(rate=RATE, keys=50, seed=3), parallelism=2)
    out = ev.map(testing.bucket, parallelism=2, name="enrich").key_by("key")
    out.sink(td.sinks.Collect(), name="collect")
    out.sink(td.sinks.Parquet(tmp_path / "pq"), parallelism=2, name="pq")
    out.sink(td.sinks.Csv(tmp_path / "out.csv"), name="csv")
    plan = job.plan()
    placement = plan.placement()
    sink_workers = [
        w
        for w, rids in enumerate(placement)
        if {plan.tasks[t].kind for t, _, _ in rids} == {"sink"}
    ]
    assert len(sink_workers) == 2
    victim = sink_workers[replica]
    res = job.run(duration=DURATION, faults=[td.KillWorker(victim, at=1.2)], progress=False)
    assert (res.lost, res.duplicates) == (0, 0) and res.digests_match
    assert testing.lost_replicas(res) == {
        ("collect", 0, replica),
        ("pq", 0, replica),
        ("pq", 1, replica),
        ("csv", 0, replica),
    }
    n = res.events_in
    assert n > 0 and res.output.num_rows == n and res.events_out == 3 * n
    assert sorted(res.output["source_seq"].to_pylist()) == sorted(
        job.run_reference(duration=DURATION, t0_ns=res.t0_ns).output["source_seq"].to_pylist()
    )
    assert sorted(os.listdir(tmp_path / "pq")) == ["part-00000.parquet", "part-00001.parquet"]
    assert sorted(os.listdir(tmp_path)) == ["out.csv", "pq"]  # no staged copy left
    assert res.max_gap_ms < 100, res.max_gap_ms


def with_nested(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Adds a list column (the key and its bucket) and a struct column."""
    key = batch.column("key")
    low = pc.bit_wise_and(key, 7)
    flat = np.column_stack([key.to_numpy(), low.to_numpy()]).ravel()
    pairs = pa.ListArray.from_arrays(pa.array(np.arange(0, flat.size + 1, 2, np.int32)), flat)
    batch = batch.append_column("pair", pairs)
    return batch.append_column("kv", pa.StructArray.from_arrays([key, low], ["key", "low"]))


def test_list_and_struct_columns_are_checked_row_by_row(tmp_path):
    """The lost/duplicates oracle compares rows holding lists and structs by value, in
    memory and read back from Parquet files."""
    job = td.Job("nested", replication=2)
    ev = job.source(td.sources.Synthetic(rate=RATE, keys=50, seed=3), parallelism=2)
    out = ev.key_by("key").map(with_nested, parallelism=2, name="nest")
    out.sink(td.sinks.Collect(), name="collect")
    out.sink(td.sinks.Parquet(tmp_path / "pq"), parallelism=2, name="pq")
    res = job.run(duration=DURATION, faults=[td.Kill("nest", 0, 1, at=1.0)], progress=False)
    assert (res.lost, res.duplicates) == (0, 0)
    assert res.output.schema.field("pair").type == pa.list_(pa.int64())
    assert res.output.num_rows == res.events_in > 0
    ref = job.run_reference(duration=DURATION, t0_ns=res.t0_ns)
    assert canonical(res.output).equals(canonical(ref.output))
    # A row whose list alone differs is one lost and one extra row, not a match.
    tampered = res.output.set_column(
        res.output.schema.get_field_index("pair"),
        "pair",
        pa.array([[-1, -1], *res.output["pair"].to_pylist()[1:]], pa.list_(pa.int64())),
    )
    assert multiset_diff(ref.output, tampered) == (1, 1)


@pytest.mark.parametrize("spread", [False, True])
def test_multi_input_liverobin_replicas_agree(spread):
    job = union_job("liverobin", spread=spread)
    res = job.run(duration=DURATION, progress=False)
    assert res.digests_match, res.determinism_errors
    assert_same_as_reference(job, res)


def test_multi_input_none_divergence_is_detected():
    """Without ordering, the two replicas of the union task consume the inputs in
    different orders sooner or later; the receivers' digest check must notice and, by
    default, stop the job."""
    for _ in range(3):
        try:
            union_job("none", spread=True).run(duration=DURATION, progress=False)
        except td.DeterminismError as exc:
            assert "'count' partition 0: replicas" in str(exc)
            return
    pytest.fail("three unordered runs of a two-input task never diverged")


def test_operator_exception_names_the_replica_and_stops_cleanly():
    job = pipeline(2, fn=boom)
    with pytest.raises(TaskFailed, match=r"enrich.*partition \d replica \d.*ValueError: boom"):
        job.run(duration=DURATION, progress=False)


def test_garbage_and_wrong_secret_clients_are_rejected(monkeypatch):
    """Connect to every worker port with garbage and with a forged handshake mid-run; the
    output must equal the reference all the same."""
    from tandem.engines import local

    seen = {}

    def intrude(addresses):
        for host, port in addresses.values():
            with socket.create_connection((host, port), timeout=2) as s:
                s.sendall(os.urandom(64))
            with socket.create_connection((host, port), timeout=2) as s:
                s.sendall(b"TNDM" + bytes(28))
        seen["n"] = len(addresses)

    monkeypatch.setattr(local, "ON_READY", intrude)
    job = pipeline(2)
    res = job.run(duration=DURATION, progress=False)
    assert seen["n"] > 0
    assert_same_as_reference(job, res)


def test_the_progress_bar_shows_source_time_and_the_workers_killed(capsys):
    job = pipeline(2)
    res = job.run(duration=2.0, faults=[td.KillWorker(0, at=1.0)], progress=True, check=False)
    err = capsys.readouterr().err
    assert "2.0/2s" in err  # drawn to the end of the stream
    assert "killed worker 0 at 1.0s" in err
    assert res.lost_replicas  # the kill the bar reports happened


def test_a_replica_every_upstream_replica_dropped_is_starved_and_lost():
    """count[0] replica 1 frozen, its replica group over two workers: both replicas of
    enrich[1], in other workers, drop it as a straggler, so once it wakes that input can
    never be whole. It stops *starved* and is counted lost — not a quiet early finish, its
    links cut at once — while its twin carries the partition: nothing lost or repeated."""
    job = jobs.counting_job("starve", 3_000, evict_after_ms=300, workers=2)
    owners = {rid: w for w, rids in enumerate(job.plan().placement()) for rid in rids}
    names = {t.name: t.id for t in job.plan().tasks}
    count, enrich = names["count"], names["enrich"]
    # The frozen replica shares its worker with no replica of enrich[1].
    assert owners[(count, 0, 1)] not in {owners[(enrich, 1, r)] for r in (0, 1)}
    pause = td.Pause("count", partition=0, replica=1, at=1.5, for_s=2.0)
    res = job.run(duration=5, faults=[pause], progress=False)
    assert (res.lost, res.duplicates, res.digests_match) == (0, 0, True)
    lost = {(r["task"], r["partition"], r["replica"]): r["cause"] for r in res.lost_replicas}
    assert lost.get(("count", 0, 1)) == "starved", res.lost_replicas
    # Nothing else but what it fed in its own worker (a sink copy there, whose only feed
    # of count[0] left with it), each starved in turn; never a healthy worker's replica.
    frozen = {
        (t.name, p, r)
        for t in job.plan().tasks
        for p in range(t.parallelism)
        for r in range(t.replication)
        if owners.get((t.id, p, r)) == owners[(count, 0, 1)]
    }
    assert set(lost) <= frozen and set(lost.values()) == {"starved"}, res.lost_replicas


def test_a_frozen_replica_is_dropped_and_never_holds_its_twin_back():
    """A replica frozen for seconds (SIGSTOP) stops reading; its upstream replicas drop it
    once their frames to it have waited evict_after_ms, and until then never wait for it:
    the twin it shares them with keeps the output flowing, with nothing lost or repeated."""
    job = td.Job("freeze", replication=2, evict_after_ms=300)
    src = job.source(td.sources.Synthetic(rate=3_000, keys=100, seed=3), parallelism=1)
    counted = src.key_by("key").process(td.CountPerKey(), parallelism=2, name="count")
    counted.sink(td.sinks.Collect())
    pause = td.Pause("count", partition=0, replica=1, at=2.0, for_s=4.0)
    res = job.run(duration=8, faults=[pause], progress=False)
    assert (res.lost, res.duplicates, res.digests_match) == (0, 0, True)
    # Waiting for the frozen replica would leave a gap of about the pause.
    assert res.max_gap_ms is not None and res.max_gap_ms < 500, res.max_gap_ms


def test_a_run_that_times_out_says_where_each_replica_not_done_stands():
    """The timeout's error names, for every replica not done, what it took in and sent
    and what its merge holds, from a snapshot its worker sends on the coordinator's ask; a
    worker that cannot answer (here: frozen) is named as silent."""
    job = td.Job("stuck", replication=1)
    src = job.source(td.sources.Synthetic(rate=2_000, keys=10, seed=1), parallelism=1)
    src.key_by("key").process(td.CountPerKey(), parallelism=1, name="count").sink(
        td.sinks.Collect()
    )
    owners = {rid: w for w, rids in enumerate(job.plan().placement()) for rid in rids}
    names = {t.name: t.id for t in job.plan().tasks}
    frozen = owners[(names["count"], 0, 0)]
    waiting = owners[(names["sink"], 0, 0)]
    assert frozen != waiting
    pause = td.Pause("count", partition=0, replica=0, at=0.5, for_s=30.0)
    with pytest.raises(td.TandemError, match="did not finish") as err:
        job.run(duration=1.0, faults=[pause], timeout=1.0, progress=False)
    text = str(err.value)
    assert "Where the replicas not done stand" in text, text
    assert f"worker {frozen}: no answer" in text, text
    assert f"sink[0] replica 0 on worker {waiting}: " in text, text
    assert "rows in" in text, text
