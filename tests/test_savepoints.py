"""Savepoints: a keyed job stopped with a savepoint and resumed with new code continues
exactly (every input row once, counts going on across the stop); a savepoint taken while
the job runs leaves its output alone; partial, corrupt, foreign and existing savepoints
are refused with their reasons (tandem.savepoints)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import tandem as td
from jobs import reaped, write_events
from tandem import savepoints
from tandem.plan import hash_channels
from tandem.runtime import Resume

ROWS = 6000
KEYS = 40
RATE = 2000  # rows per second of source time: the input lasts 3 s


@pytest.fixture(scope="module")
def input_file(tmp_path_factory) -> str:
    return write_events(tmp_path_factory.mktemp("input") / "events.parquet", ROWS, KEYS, 11)


def keyed_job(
    input_file: str,
    plus: int = 0,
    *,
    name: str = "keyed",
    replication: int = 2,
    count_parallelism: int = 2,
    with_map: bool = True,
    source_parallelism: int = 2,
    max_parallelism: int = 128,
    counter: td.Operator | None = None,
    sink: td.sinks.Sink | None = None,
    sink_parallelism: int = 1,
    evict_after_ms: float | None = 1000,
    workers: int | None = None,
) -> td.Job:
    """source (Parquet, 2 partitions) -> enrich (tag = 10 * key + plus) -> count per key ->
    ``sink`` (default Collect), at ``replication``."""

    def enrich(batch: pa.RecordBatch) -> pa.RecordBatch:
        tag = pc.add(pc.multiply(batch.column("key"), 10), plus)
        return batch.append_column("tag", tag)

    job = td.Job(
        name,
        replication=replication,
        max_parallelism=max_parallelism,
        evict_after_ms=evict_after_ms,
        workers=workers,
    )
    source = td.sources.Parquet(input_file, rate=RATE)
    stream = job.source(source, parallelism=source_parallelism, name="source")
    if with_map:
        stream = stream.map(enrich, name="enrich")
    counted = stream.key_by("key").process(
        counter or td.CountPerKey(), parallelism=count_parallelism, name="count"
    )
    counted.sink(sink or td.sinks.Collect(), parallelism=sink_parallelism)
    return job


def expected_counts(input_file: str) -> pd.DataFrame:
    """Independent of tandem: per key, the counts 1..n a running count gives its n rows."""
    frame = pq.read_table(input_file).to_pandas()
    sizes = frame.groupby("key").size()
    rows = [(k, c) for k, n in sizes.items() for c in range(1, n + 1)]
    return pd.DataFrame(rows, columns=["key", "count"]).sort_values(["key", "count"])


def pairs(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[["key", "count"]].sort_values(["key", "count"]).reset_index(drop=True)


@pytest.fixture(scope="module")
def stopped(input_file, tmp_path_factory):
    """The job at r = 2 stopped with a savepoint as soon as it runs (its stop point is
    a lease ahead of the clock: about a third of the input)."""
    path = str(tmp_path_factory.mktemp("savepoints") / "stop")
    handle = keyed_job(input_file).start(progress=False)
    result = handle.stop(timeout=120, savepoint=path)
    return path, result


def test_stop_with_a_savepoint_then_resume_with_new_code(input_file, stopped):
    path, first = stopped
    saved = td.Savepoint.read(path)
    assert saved.job == "keyed" and saved.epoch > 0
    assert [(t["name"], t["kind"], t["parallelism"], t["replication"]) for t in saved.tasks] == [
        ("source", "source", 2, 2),
        ("enrich", "operator", 2, 2),
        ("count", "operator", 2, 2),
        ("sink", "sink", 1, 2),  # a Collect sink: replicated as the job
    ]
    # Stopped at the cut: the sink holds exactly the rows the sources emitted before it.
    emitted = sum(p["rows"] for p in saved.sources["source"])
    assert 0 < emitted < ROWS
    assert first.events_out == first.output.num_rows == emitted
    assert first.lost == 0 and first.duplicates == 0 and first.digests_match

    # Resumed with a changed map function: it tags the rest of the rows differently.
    second = keyed_job(input_file, plus=1).run(from_savepoint=path, progress=False, timeout=120)
    assert second.digests_match
    before, after = first.output.to_pandas(), second.output.to_pandas()
    assert len(after) == ROWS - emitted

    # Every input row exactly once across the stop, the old code before the cut and the
    # new one after it, the counts per key 1..n over both runs; and every count after the
    # stop is above every count before it.
    check_continues(input_file, before, after)
    last = before.groupby("key")["count"].max()
    first_after = after.groupby("key")["count"].min()
    common = last.index.intersection(first_after.index)
    assert len(common) > 0
    assert (first_after[common] == last[common] + 1).all()


def test_a_stop_is_cut_at_the_twin_of_a_replica_frozen_through_it(input_file, tmp_path, caplog):
    """A stop cannot be asked again at a later heartbeat (the sources end at its own), so
    every live replica is asked for its cut there: count[0] replica 0, frozen from before
    the stop point until after it, gives none (both replicas of enrich[1], in other
    workers, drop it as a straggler, so it ends starved), and its twin's cut makes the
    savepoint. Nothing lost or repeated, and the resumed run goes on
    exactly. Asking one replica a partition, the stop failed whenever that one was the
    straggler: under load, in a burst at the start."""
    path = str(tmp_path / "stop")
    pause = td.Pause("count", partition=0, replica=0, at=0.2, for_s=3.0)
    job = keyed_job(input_file, evict_after_ms=300, workers=2)
    handle = job.start(faults=[pause], progress=False)
    with caplog.at_level("INFO", logger="tandem"):
        first = handle.stop(timeout=120, savepoint=path)
    assert "savepoint written" in caplog.text
    saved = td.Savepoint.read(path)
    emitted = sum(p["rows"] for p in saved.sources["source"])
    assert 0 < emitted < ROWS
    assert first.events_out == first.output.num_rows == emitted
    assert first.lost == 0 and first.duplicates == 0
    # The frozen replica, starved, was not cut: its twin was.
    cut = {(e["task"], e["partition"]): e["replica"] for e in saved.partitions}
    assert cut[("count", 0)] == 1, saved.partitions
    second = keyed_job(input_file, plus=1).run(from_savepoint=path, progress=False, timeout=120)
    assert second.digests_match
    check_continues(input_file, first.output.to_pandas(), second.output.to_pandas())


def test_a_stop_is_cut_at_the_twins_of_a_worker_killed_before_it(input_file, tmp_path, caplog):
    """Worker 0 (source[0], enrich[0], count[0], each replica 0) killed after the stop's
    cuts were asked of it and before its stop point: its replicas are lost before their
    cuts, and their twins' cuts, asked too, make the savepoint (a savepoint used to fail
    on any replica lost before its cut)."""
    path = str(tmp_path / "stop")
    job = keyed_job(input_file, workers=2)
    handle = job.start(faults=[td.KillWorker(0, at=0.6)], progress=False)
    with caplog.at_level("INFO", logger="tandem"):
        first = handle.stop(timeout=120, savepoint=path)
    saved = td.Savepoint.read(path)
    assert "savepoint written" in caplog.text
    assert saved.epoch * saved.heartbeat_ms / 1000 > 0.6  # cut after the kill
    lost = {(r["task"], r["partition"], r["replica"]) for r in first.lost_replicas}
    assert ("count", 0, 0) in lost, first.lost_replicas
    cut = {(e["task"], e["partition"]): e["replica"] for e in saved.partitions}
    assert cut[("source", 0)] == cut[("enrich", 0)] == cut[("count", 0)] == 1
    emitted = sum(p["rows"] for p in saved.sources["source"])
    assert first.events_out == first.output.num_rows == emitted
    assert first.lost == 0 and first.duplicates == 0
    second = keyed_job(input_file, plus=1).run(from_savepoint=path, progress=False, timeout=120)
    assert second.digests_match
    check_continues(input_file, first.output.to_pandas(), second.output.to_pandas())


def check_continues(input_file: str, before: pd.DataFrame, after: pd.DataFrame) -> None:
    """Every input row once across the stop, the old code's tag before it and the new
    code's after, and the counts of every key 1..n over both runs (an expectation from
    pandas over the input, not from tandem)."""
    ids = np.concatenate([before["id"].to_numpy(), after["id"].to_numpy()])
    assert len(ids) == ROWS and set(ids.tolist()) == set(range(ROWS))
    assert (before["tag"] == before["key"] * 10).all()
    assert (after["tag"] == after["key"] * 10 + 1).all()
    assert pairs(pd.concat([before, after])).equals(
        expected_counts(input_file).reset_index(drop=True)
    )


def test_resume_at_a_new_parallelism_and_replication_with_new_code(input_file, tmp_path):
    """Parquet in and out: stopped with a savepoint at r = 2 and 2 partitions of the keyed
    count; resumed with a changed map, 3 partitions and r = 3. Each new partition starts
    with the key groups it owns, so the counts go on."""
    path = str(tmp_path / "stop")
    out1, out2 = tmp_path / "out-1", tmp_path / "out-2"
    handle = keyed_job(input_file, sink=td.sinks.Parquet(out1)).start(progress=False)
    first = handle.stop(timeout=120, savepoint=path)
    saved = td.Savepoint.read(path)
    assert saved.max_parallelism == 128
    owned = [p["key_groups"] for p in saved.partitions if p["task"] == "count"]
    assert owned == [[0, 64], [64, 128]]

    second = keyed_job(
        input_file, plus=1, sink=td.sinks.Parquet(out2), count_parallelism=3, replication=3
    ).run(from_savepoint=path, progress=False, timeout=120)
    assert first.digests_match and second.digests_match
    before, after = pq.read_table(out1).to_pandas(), pq.read_table(out2).to_pandas()
    assert 0 < len(before) < ROWS and len(after) == ROWS - len(before)
    check_continues(input_file, before, after)
    # The keys spread over all three new partitions (each took some saved counts on).
    owners = hash_channels(pa.array(after["key"].unique()), 3)
    assert sorted(set(owners.tolist())) == [0, 1, 2]
    assert sorted(os.listdir(tmp_path)) == ["out-1", "out-2", "stop"]  # no rescaled states


def test_rescaled_states_go_to_the_workers_as_files_not_in_the_plan(input_file, stopped):
    """A resumed plan's new partitions read their states from files beside the savepoint,
    so the plan every worker gets stays small whatever the state's size; the files go
    when the run ends (savepoints.release, which the engine calls)."""
    import cloudpickle

    from tandem import savepoints

    path, _ = stopped
    plan = keyed_job(input_file, count_parallelism=3).plan()
    resumed = savepoints.resume(path, plan)
    count = plan.task("count").id
    cuts = {(t, q): c for (t, q, _), c in resumed.resumed.cuts.items() if t == count}
    assert cuts and all(c.state == b"" and c.state_file for c in cuts.values())
    _, scratch = resumed.resumed.scratch
    assert os.path.dirname(scratch) == os.path.dirname(path) and os.path.isdir(scratch)
    loaded = {c.state_file: c.load() for c in cuts.values()}
    assert len(loaded) == 3 and all(len(state) > 0 for state in loaded.values())
    assert len(cloudpickle.dumps(resumed)) < len(cloudpickle.dumps(plan)) + 64 * 1024
    savepoints.release(resumed)
    assert not os.path.exists(scratch)
    savepoints.release(resumed)  # again: nothing to do


def test_resume_at_fewer_partitions_merges_their_key_groups(input_file, tmp_path):
    """3 partitions saved, resumed at 2 and stopped at once, then the second savepoint
    resumed at 4: each time every key's count goes on."""
    path, again = str(tmp_path / "three"), str(tmp_path / "two")
    first = keyed_job(input_file, count_parallelism=3).start(progress=False)
    first = first.stop(timeout=120, savepoint=path)
    handle = keyed_job(input_file, count_parallelism=2).start(progress=False, from_savepoint=path)
    second = handle.stop(timeout=120, savepoint=again)
    # Stopped before its lease passed the cut it resumed from, the run still went one
    # heartbeat on: its savepoint is a cut it took.
    assert td.Savepoint.read(again).epoch == td.Savepoint.read(path).epoch + 1
    third = keyed_job(input_file, count_parallelism=4, plus=1).run(
        from_savepoint=again, progress=False, timeout=120
    )
    frames = [r.output.to_pandas() for r in (first, second, third)]
    assert all(len(f) for f in frames)
    both = pd.concat(frames)
    ids = both["id"].to_numpy()
    assert len(ids) == ROWS and set(ids.tolist()) == set(range(ROWS))
    assert pairs(both).equals(expected_counts(input_file).reset_index(drop=True))


class Tally(td.KeyedProcess):
    """A keyed count that also keeps a running total under a key of its own: a state that
    is not per key, which a rescale must refuse."""

    schema = None

    def process(self, batch: pa.RecordBatch, state: dict) -> pa.RecordBatch:
        state["__rows__"] = state.get("__rows__", 0) + batch.num_rows
        return batch


class Halves(td.KeyedProcess):
    """A state keyed by floats (half the key): no key column holds those."""

    schema = None

    def process(self, batch: pa.RecordBatch, state: dict) -> pa.RecordBatch:
        for k in batch.column("key").to_pylist():
            state[k / 2] = state.get(k / 2, 0) + 1
        return batch


class Opaque(td.KeyedProcess):
    """A state of its own making (an overridden snapshot, no keyed_state)."""

    def process(self, batch: pa.RecordBatch, state: dict) -> pa.RecordBatch:
        return batch

    def snapshot(self) -> bytes:
        return b"opaque"

    def restore(self, data: bytes) -> None:
        pass


@pytest.mark.parametrize(
    ("counter", "error"),
    [
        (Tally(), r"holds an entry for '__rows__', a key of partition \d"),
        (Opaque(), r"keeps a state that is not per key \(keyed_state\(\) is None\)"),
        (Halves(), r"holds an entry that is no key of its input: [\d.]+ \(float\) cannot"),
    ],
    ids=["not-a-key", "not-keyed", "not-a-key-type"],
)
def test_a_state_that_cannot_be_split_refuses_a_new_parallelism(
    input_file, tmp_path, counter, error
):
    path = str(tmp_path / "sp")
    handle = keyed_job(input_file, counter=counter).start(progress=False)
    handle.stop(timeout=120, savepoint=path)
    # Refused before anything starts, naming the task; the same parallelism resumes.
    with pytest.raises(td.ConfigError, match=r"operator task 'count': .*" + error):
        keyed_job(input_file, counter=counter, count_parallelism=3).run(
            from_savepoint=path, progress=False
        )
    again = keyed_job(input_file, counter=counter).run(
        from_savepoint=path, progress=False, timeout=120
    )
    assert again.digests_match


def test_a_savepoint_while_running_leaves_the_output_alone(input_file, tmp_path):
    path = str(tmp_path / "running")
    handle = keyed_job(input_file).start(progress=False)
    saved = handle.savepoint(path, timeout=60)
    assert handle.running or handle.wait(0) is not None
    result = handle.wait(timeout=120)
    # The run went on to the end of its input, unaffected: checked against the reference.
    assert result.events_out == ROWS
    assert result.lost == 0 and result.duplicates == 0 and result.digests_match
    full = result.output.to_pandas()
    assert pairs(full).equals(expected_counts(input_file).reset_index(drop=True))
    assert saved.epoch > 0 and sum(p["rows"] for p in saved.sources["source"]) < ROWS
    assert td.Savepoint.read(path).epoch == saved.epoch

    # Resumed (at another replication, which a savepoint allows), the same code replays
    # the run after the cut: the same rows with the same counts, a suffix of each key's.
    again = keyed_job(input_file, replication=1).run(
        from_savepoint=path, progress=False, timeout=120
    )
    tail = again.output.to_pandas()
    # Exactly the rows after the cut: a sink cut while the job goes on may have taken
    # rows of a faster input past it (settle() sets it back), which are the resumed run's.
    emitted = sum(p["rows"] for p in saved.sources["source"])
    assert len(tail) == ROWS - emitted > 0
    assert tail["id"].is_unique
    merged = tail.merge(full, on="id", suffixes=("", "_full"))
    assert len(merged) == len(tail)
    assert (merged["count"] == merged["count_full"]).all()
    assert (merged["tag"] == merged["tag_full"]).all()
    for key, counts in tail.groupby("key")["count"]:
        n = int((full["key"] == key).sum())
        assert sorted(counts) == list(range(n - len(counts) + 1, n + 1))


def test_large_states_cut_while_running_are_saved_whole_and_resume_exact(tmp_path):
    """States above ``INLINE_CUT_BYTES`` per partition are snapshotted for a running
    savepoint by forked children, which hash them as they write (the replicas go on at
    once): each is in the savepoint whole, its SHA-256 checked when it is resumed, and the
    resumed run delivers exactly the rows after the cut."""
    from tandem.experiments import recovery
    from tandem.runtime import INLINE_CUT_BYTES

    mb = 2 * INLINE_CUT_BYTES / 2**20
    path = str(tmp_path / "large")
    handle = recovery.savepoint_job(mb, 2000).start(duration=5, progress=False)
    time.sleep(2.5)
    saved = handle.savepoint(path, timeout=60)
    result = handle.result()
    assert result.lost == 0 and result.duplicates == 0 and result.digests_match
    states = [p for p in saved.partitions if p["task"] == "state"]
    assert len(states) == 2 and all(p["bytes"] > INLINE_CUT_BYTES for p in states), states
    assert not [f for f in os.listdir(tmp_path) if f != "large"]  # no staging left
    emitted = sum(p["rows"] for parts in saved.sources.values() for p in parts)
    again = recovery.savepoint_job(mb, 2000).run(duration=5, from_savepoint=path, progress=False)
    assert again.events_out == result.events_out - emitted > 0
    assert again.digests_match, again.determinism_errors


def late_requests(monkeypatch) -> list[int]:
    """Once the returned list holds a number n, the coordinator's first n attempts at a
    running savepoint pick the first heartbeat it may — as if its requests reached the
    workers a run late — which every replica has forwarded already once a savepoint was
    taken. Each attempt's round is appended to the list."""
    from tandem.engines import coordinator

    original = coordinator.Coordinator._start_savepoint
    made: list[int] = []

    def start(self, ask, now_s, round_=1):
        late = made and round_ <= made[0] and not ask.stop and not ask.checkpoint
        made.append(round_)
        return original(self, ask, 0.0 if late else now_s, round_)

    monkeypatch.setattr(coordinator.Coordinator, "_start_savepoint", start)
    return made


def test_a_savepoint_asked_too_late_is_asked_again_at_a_later_heartbeat(
    input_file, tmp_path, monkeypatch, caplog
):
    made = late_requests(monkeypatch)
    handle = keyed_job(input_file).start(progress=False)
    first = handle.savepoint(str(tmp_path / "first"), timeout=60)
    made[:] = [1]  # the next one's first round is late: every replica is past it
    with caplog.at_level("INFO", logger="tandem"):
        saved = handle.savepoint(str(tmp_path / "retried"), timeout=60)
    result = handle.wait(timeout=120)
    assert made == [1, 1, 2]
    assert "asked again later" in caplog.text
    assert saved.epoch > first.epoch
    assert result.lost == 0 and result.duplicates == 0 and result.digests_match
    assert pairs(result.output.to_pandas()).equals(
        expected_counts(input_file).reset_index(drop=True)
    )
    assert td.Savepoint.read(str(tmp_path / "retried")).epoch == saved.epoch
    # No staging folder of the given-up attempt is left beside it.
    assert sorted(os.listdir(tmp_path)) == ["first", "retried"]


def test_a_savepoint_late_every_round_fails_and_the_job_runs_on(input_file, tmp_path, monkeypatch):
    from tandem.engines.coordinator import SAVEPOINT_ROUNDS

    made = late_requests(monkeypatch)
    job = keyed_job(input_file)
    handle = job.start(progress=False)
    # The last round's heartbeat (its lead from 0) is one the replicas have passed too.
    last_s = 4 ** (SAVEPOINT_ROUNDS - 1) * 0.05 + 0.05
    for taken in range(50):
        first = handle.savepoint(str(tmp_path / f"first{taken}"), timeout=60)
        if first.epoch * job.heartbeat_ms / 1000 >= last_s:
            break
        time.sleep(0.2)
    made[:] = [SAVEPOINT_ROUNDS]
    with pytest.raises(td.TandemError, match="could not be cut at heartbeat"):
        handle.savepoint(str(tmp_path / "never"), timeout=60)
    result = handle.wait(timeout=120)
    assert made == [SAVEPOINT_ROUNDS, *range(1, SAVEPOINT_ROUNDS + 1)]
    assert result.events_out == ROWS and result.lost == 0 and result.digests_match
    assert "never" not in os.listdir(tmp_path)
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".")]


# -- refusals -------------------------------------------------------------------------------


def copy_of(stopped, tmp_path, name: str) -> str:
    dest = tmp_path / name
    shutil.copytree(stopped[0], dest)
    return str(dest)


def test_a_partial_savepoint_is_refused(input_file, stopped, tmp_path):
    path = copy_of(stopped, tmp_path, "partial")
    (tmp_path / "partial" / "manifest.json").unlink()
    with pytest.raises(td.ConfigError, match="not a complete savepoint: it has no manifest"):
        keyed_job(input_file).run(from_savepoint=path, progress=False)
    with pytest.raises(td.ConfigError, match=r"no savepoint at .*does not exist"):
        keyed_job(input_file).run(from_savepoint=str(tmp_path / "nowhere"), progress=False)


def test_a_corrupt_savepoint_is_refused(input_file, stopped, tmp_path):
    path = copy_of(stopped, tmp_path, "corrupt")
    manifest = tmp_path / "corrupt" / "manifest.json"
    manifest.write_text(manifest.read_text()[:200])
    with pytest.raises(td.ConfigError, match=r"is corrupt: its manifest\.json"):
        keyed_job(input_file).run(from_savepoint=path, progress=False)

    path = copy_of(stopped, tmp_path, "state")
    doc = json.loads((tmp_path / "state" / "manifest.json").read_text())
    state = next(p["state"] for p in doc["partitions"] if p["state"] is not None)
    with open(tmp_path / "state" / state, "ab") as f:
        f.write(b"x")
    with pytest.raises(
        td.ConfigError, match=r"is corrupt: state file .* differs from its manifest"
    ):
        keyed_job(input_file).run(from_savepoint=path, progress=False)

    doc["format_version"] = savepoints.FORMAT_VERSION + 1
    path = copy_of(stopped, tmp_path, "version")
    (tmp_path / "version" / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(td.ConfigError, match=r"is corrupt: .*format version"):
        keyed_job(input_file).run(from_savepoint=path, progress=False)


def test_another_jobs_or_another_shapes_savepoint_is_refused(input_file, stopped):
    path = stopped[0]
    with pytest.raises(td.ConfigError, match="is of job 'keyed', not of job 'other'"):
        keyed_job(input_file, name="other").run(from_savepoint=path, progress=False)
    with pytest.raises(td.ConfigError, match="source task 'source': parallelism 3 here, 2 in"):
        keyed_job(input_file, source_parallelism=3).run(from_savepoint=path, progress=False)
    refused = r"max_parallelism=64, but the savepoint .* max_parallelism=128"
    with pytest.raises(td.ConfigError, match=refused):
        keyed_job(input_file, max_parallelism=64).run(from_savepoint=path, progress=False)
    with pytest.raises(td.ConfigError, match="task 'enrich' \\(operator\\) of the savepoint"):
        keyed_job(input_file, with_map=False).run(from_savepoint=path, progress=False)
    with pytest.raises(td.ConfigError, match="check=True compares the output"):
        keyed_job(input_file).run(from_savepoint=path, progress=False, check=True)


def test_an_existing_savepoint_is_never_overwritten(input_file, stopped, tmp_path):
    path = stopped[0]
    manifest = (Path(path) / "manifest.json").read_bytes()
    handle = keyed_job(input_file).start(progress=False)
    try:
        with pytest.raises(td.ConfigError, match="holds a savepoint already"):
            handle.savepoint(path)
        with pytest.raises(td.ConfigError, match="holds a savepoint already"):
            handle.stop(savepoint=path)  # refused before the job is stopped
        assert handle.running
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / "file").write_text("not mine")
        with pytest.raises(td.ConfigError, match="no complete savepoint"):
            handle.savepoint(tmp_path / "other")
    finally:
        handle.kill(timeout=60)
    assert (Path(path) / "manifest.json").read_bytes() == manifest


def test_a_channel_ended_at_the_cut_is_opened_again(input_file):
    """A sink consumes first come, first served: cut once both inputs delivered heartbeat
    100, it may have taken count[0]'s end marker already (the job stopped there). The
    savepoint opens that channel again at the seq count[0]'s cut emitted through."""
    plan = keyed_job(input_file).plan()
    count, sink = plan.task("count").id, plan.task("sink").id

    def operator_cut(seq: int) -> Resume:
        inbox = ((335, 330), 1, 100, (False, False), (), None)
        return Resume((100, (100, 100), inbox, (((seq,), seq - 100),)), b"")

    inbox = ((566, 635), 0, 100, (True, False), (), None)
    cuts = {
        (count, 0, 0): operator_cut(565),
        (count, 1, 0): operator_cut(635),
        (sink, 0, 0): Resume((100, (100, 100), inbox, ()), b""),
    }
    settled = savepoints.settle(plan, cuts)
    assert settled[(sink, 0, 0)].cut[2] == ((565, 635), 0, 100, (False, False), (), None)
    assert settled[(count, 0, 0)] is cuts[(count, 0, 0)]


def test_tandem_run_resumes_from_a_savepoint(input_file, stopped, tmp_path):
    from tandem.cli import main

    script = tmp_path / "job.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_savepoints import keyed_job\n"
        f"job = keyed_job({input_file!r}, plus=1)\n"
    )
    out = tmp_path / "result.json"
    args = ["run", str(script), "--from-savepoint", stopped[0], "--no-progress", "--json", str(out)]
    assert main(args) == 0
    emitted = sum(p["rows"] for p in td.Savepoint.read(stopped[0]).sources["source"])
    result = json.loads(out.read_text())
    assert result["events_out"] == ROWS - emitted  # what follows the cut, once
    assert result["lost"] is None  # not checked: the reference would replay from the start


ON_STOP_JOB = """
import tandem as td

job = td.Job("onstop", replication=2)
events = job.source(td.sources.Synthetic(rate=1000, keys=8, seed=3), parallelism=2)
events.key_by("key").process(td.CountPerKey(), parallelism=2, name="count").sink(
    td.sinks.Collect()
)
"""


def check_resumed_run(tmp_path, saved: td.Savepoint, report: Path) -> None:
    """`tandem run` of ON_STOP_JOB from ``saved`` for a second more of source time
    delivers exactly the rows after the cut (the source's 1,000 a second)."""
    from jobs import tandem_run

    emitted = sum(p["rows"] for p in saved.sources["source"])
    duration = saved.source_time_s + 1.0
    flags = ["--no-progress", "--from-savepoint", saved.path, "--duration", f"{duration}"]
    done = tandem_run(tmp_path, ON_STOP_JOB, *flags, "--json", str(report))
    out, err = done.communicate(timeout=120)
    assert done.returncode == 0, out + err
    assert json.loads(report.read_text())["events_out"] == round(1000 * duration) - emitted


def test_tandem_run_stops_at_a_savepoint_on_sigterm_and_resumes_from_it(tmp_path):
    """`tandem run job.py --savepoint-on-stop PATH`, a job with no end: SIGTERM stops it at
    a savepoint in PATH, and the summary says how to go on; `--from-savepoint PATH` then
    runs on from the cut — every row once across the two runs."""
    import signal
    import time

    from jobs import tandem_run

    path = tmp_path / "on-stop"
    first_json, second_json = tmp_path / "first.json", tmp_path / "second.json"
    proc = tandem_run(
        tmp_path,
        ON_STOP_JOB,
        "--no-progress",
        "--savepoint-on-stop",
        str(path),
        "--json",
        str(first_json),
    )
    with reaped(proc):
        assert proc.stdout is not None
        line = proc.stdout.readline()  # printed as the run starts
        assert "until stopped" in line, line
        time.sleep(3.0)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stdout + stderr
    assert f"SIGTERM: stopping job 'onstop' at a savepoint in {path}" in stderr
    assert f"stopped at a savepoint: {path}" in stdout
    assert f"--from-savepoint {path}" in stdout
    saved = td.Savepoint.read(path)
    emitted = sum(p["rows"] for p in saved.sources["source"])
    first = json.loads(first_json.read_text())
    assert first["events_out"] == emitted > 0
    assert first["lost"] == 0 and first["duplicates"] == 0

    # Resumed: source time goes on from the cut to --duration.
    check_resumed_run(tmp_path, saved, second_json)


def test_savepoint_on_stop_needs_a_run_until_stopped(tmp_path):
    job = td.Job("j")
    job.source(td.sources.Synthetic(rate=10)).sink(td.sinks.Collect())
    with pytest.raises(td.ConfigError, match="savepoint_on_stop= is for a run until stopped"):
        job.run(duration=1.0, savepoint_on_stop=str(tmp_path / "sp"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(td.ConfigError):
        job.run(savepoint_on_stop=str(tmp_path / "full"))


def tandem_cli(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """``tandem ARGS`` as a user types it in another shell."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(td.__file__).parents[1]), env.get("PYTHONPATH", "")]
    )
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_tandem_savepoint_asks_the_running_job_from_another_shell(tmp_path):
    """`tandem run job.py` runs until stopped and says it listens; `tandem savepoint PATH`
    from another shell writes a savepoint while it runs, `tandem savepoint PATH --stop`
    stops it at another, `--show` describes it, and `--from-savepoint` goes on from it."""
    from jobs import tandem_run

    running, stopped = tmp_path / "running", tmp_path / "stopped"
    first_json, second_json = tmp_path / "first.json", tmp_path / "second.json"
    # Nothing listens yet: said, with what to do.
    nobody = tandem_cli(tmp_path, "savepoint", str(running), "--job", "onstop")
    assert nobody.returncode == 2 and "no `tandem run` of a job named 'onstop'" in nobody.stderr
    proc = tandem_run(tmp_path, ON_STOP_JOB, "--no-progress", "--json", str(first_json))
    with reaped(proc):
        assert proc.stdout is not None
        assert "until stopped" in proc.stdout.readline()
        assert "tandem savepoint PATH" in proc.stdout.readline()
        time.sleep(1.5)
        taken = tandem_cli(tmp_path, "savepoint", str(running), "--job", "onstop")
        assert taken.returncode == 0, taken.stdout + taken.stderr
        assert f"written to {running}: heartbeat" in taken.stdout
        assert proc.poll() is None  # the job goes on
        # A savepoint is never overwritten: refused, the job untouched.
        again = tandem_cli(tmp_path, "savepoint", str(running))
        assert again.returncode == 2 and "already" in again.stderr, again.stderr
        last = tandem_cli(tmp_path, "savepoint", str(stopped), "--stop")
        assert last.returncode == 0, last.stdout + last.stderr
        stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stdout + stderr
    assert f"stopped at a savepoint: {stopped}" in stdout
    first, second = td.Savepoint.read(running), td.Savepoint.read(stopped)
    assert 0 < first.epoch < second.epoch
    emitted = sum(p["rows"] for p in second.sources["source"])
    assert json.loads(first_json.read_text())["events_out"] == emitted

    shown = tandem_cli(tmp_path, "savepoint", "--show", str(stopped))
    assert shown.returncode == 0, shown.stderr
    assert f"savepoint of job 'onstop' at {stopped}" in shown.stdout
    assert f"cut after heartbeat {second.epoch}" in shown.stdout
    assert f"{emitted:,} rows emitted" in shown.stdout

    check_resumed_run(tmp_path, second, second_json)


@pytest.mark.spark
def test_on_spark_a_running_job_takes_savepoints_and_stops_at_one(input_file, tmp_path):
    """The Spark engine runs a job until stopped: a savepoint while it runs, then a stop at
    another; the stop's resumed on Spark with a changed map, 3 partitions of the count and
    r = 3, the running one's on the local engine — both exact."""
    from tandem_spark import SparkEngine

    running, stopped = str(tmp_path / "running"), str(tmp_path / "stopped")
    handle = keyed_job(input_file).start(engine=SparkEngine(master="local[8,3]"), progress=False)
    with pytest.raises(td.ConfigError, match="spark engine does not rescale a running job"):
        handle.rescale("count", 3, timeout=60)  # (the local engine does: test_rescale.py)
    mid = handle.savepoint(running, timeout=120)
    first = handle.stop(timeout=180, savepoint=stopped)
    assert first.lost == 0 and first.duplicates == 0 and first.digests_match
    assert 0 <= mid.epoch < td.Savepoint.read(stopped).epoch

    second = keyed_job(input_file, plus=1, count_parallelism=3, replication=3).run(
        engine=SparkEngine(master="local[8,3]"), from_savepoint=stopped, progress=False
    )
    assert second.digests_match
    check_continues(input_file, first.output.to_pandas(), second.output.to_pandas())

    # The savepoint Spark took while running resumes on the local engine: the rows after
    # its cut, each key's count going on from the rows of that key before it.
    local = keyed_job(input_file).run(from_savepoint=running, progress=False, timeout=120)
    after = local.output.to_pandas()
    emitted = sum(p["rows"] for p in mid.sources["source"])
    assert len(after) == ROWS - emitted and after["id"].is_unique
    frame = pq.read_table(input_file).to_pandas()
    before = frame[~frame["id"].isin(after["id"])]
    for key, rows in after.groupby("key"):
        n = int((before["key"] == key).sum())
        assert sorted(rows["count"].tolist()) == list(range(n + 1, n + len(rows) + 1)), key


def window_job(input_file: str, parallelism: int) -> td.Job:
    """source (Parquet, 2 partitions) -> per key, 250 ms tumbling windows (rows, sum of
    ids) -> Collect."""
    job = td.Job("windows", replication=2)
    events = job.source(td.sources.Parquet(input_file, rate=RATE), parallelism=2, name="source")
    agg = {"rows": ("id", "count"), "ids": ("id", "sum")}
    events.key_by("key").window(250, agg, parallelism=parallelism, name="win").sink(
        td.sinks.Collect()
    )
    return job


def windows(*results: td.Result) -> pd.DataFrame:
    """Every window's (key, index from the run's t0, rows, sum of ids), sorted: a resumed
    run's t0 is the stopped run's, moved so its source time goes on."""
    frames = []
    for r in results:
        frame = r.output.to_pandas()
        frame["index"] = (frame["window_start_ns"] - r.t0_ns) // 250_000_000
        frames.append(frame[["key", "index", "rows", "ids"]])
    frame = pd.concat(frames).sort_values(["key", "index"])
    return frame.reset_index(drop=True)


def test_a_keyed_window_resumes_at_a_new_parallelism_with_its_open_windows(input_file, tmp_path):
    """The open windows' rows follow their keys to the new partitions: a savepoint taken
    while the job runs on, resumed at 3 partitions, emits every window from the one open
    at the cut on exactly as the run that went on did."""
    path = str(tmp_path / "sp")
    handle = window_job(input_file, 2).start(progress=False)
    saved = handle.savepoint(path)
    whole = handle.wait(120)
    resumed = window_job(input_file, 3).run(from_savepoint=path, progress=False, timeout=120)
    assert whole.lost == 0 and whole.duplicates == 0 and resumed.digests_match

    # The window open at the cut (it ends after it) and every later one.
    first_open = int(saved.source_time_s * 1000) // 250
    want = windows(whole)
    want = want[want["index"] >= first_open].reset_index(drop=True)
    got = windows(resumed)
    assert len(got) > 0 and got.equals(want)
    assert int(got["rows"].sum()) == ROWS


def test_a_stop_at_a_savepoint_leaves_the_open_windows_to_the_resumed_run(input_file, tmp_path):
    """A stop at a savepoint does not drain: the windows open at the stop are emitted once,
    whole, by the resumed run (at 3 partitions) — the two runs' windows are those of one
    run with no stop, none cut short and none twice."""
    path = str(tmp_path / "sp")
    handle = window_job(input_file, 2).start(progress=False)
    time.sleep(0.5)
    first = handle.stop(timeout=120, savepoint=path)
    assert first.lost == 0 and first.duplicates == 0  # against a reference that stops too
    saved = td.Savepoint.read(path)
    assert 0 < saved.source_time_s < ROWS / RATE - 0.5
    resumed = window_job(input_file, 3).run(from_savepoint=path, progress=False, timeout=120)
    whole = window_job(input_file, 2).run(progress=False, timeout=120)
    got = windows(first, resumed)
    assert got.equals(windows(whole)), got.merge(windows(whole), how="outer", indicator=True)
    assert int(got["rows"].sum()) == ROWS
