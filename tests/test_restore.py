"""Restoring r (DESIGN §4): a lost worker's replicas are rebuilt from live twins while the
job runs, so a later loss of those twins is masked too.

Every run is checked against the reference executor (lost and duplicated rows as
multisets, stateful counts included) and the replicas' per-cycle digests are compared,
the rebuilt replicas' from their first complete cycle.
"""

from __future__ import annotations

import glob
import itertools
import os
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.compute as pc
import pytest

import tandem as td
from tandem import testing
from tandem.engines import local
from tandem.engines.process import child_env
from tandem.exceptions import TandemError

RATE = 1500


def batch_mean(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A function of the whole batch: replicas agree only if their batches do."""
    mean = pc.mean(batch.column("value")).as_py()
    return batch.append_column("batch_mean", pa.array([mean] * batch.num_rows, pa.float64()))


def counting_job(restore: bool, replay_ms: float = 3000) -> td.Job:
    job = td.Job("restore", replication=2, restore=restore, replay_ms=replay_ms)
    ev = job.source(td.sources.Synthetic(rate=RATE, keys=40, seed=11), parallelism=2)
    (
        ev.map(testing.bucket, parallelism=2, name="enrich")
        .map(batch_mean, parallelism=2, name="mean")
        .key_by("key")
        .process(td.CountPerKey(), parallelism=2, name="count")
        .sink(td.sinks.Collect())
    )
    return job


def killed_workers(res: td.Result) -> list[int]:
    return [f["worker"] for f in res.faults]


def test_a_lost_worker_is_rebuilt_from_twins_and_then_masks_the_loss_of_those_twins():
    faults = [td.Kill("count", 0, 0, at=1.5), td.Kill("count", 0, 1, at=5.0)]
    res = counting_job(restore=True).run(duration=8, faults=faults)
    assert res.lost == 0 and res.duplicates == 0
    assert res.digests_match, res.determinism_errors
    assert killed_workers(res)[0] != killed_workers(res)[1]
    rebuilt = {(r["task"], r["partition"], r["replica"]) for r in res.restored_replicas}
    lost = {(r["task"], r["partition"], r["replica"]) for r in res.lost_replicas}
    # Both kills took a whole replica group down; both were rebuilt (the second from the
    # replicas rebuilt after the first).
    assert rebuilt == lost
    assert {("count", 0, 0), ("count", 0, 1), ("source", 1, 0), ("mean", 1, 1)} <= rebuilt
    for r in res.restored_replicas:
        assert r["lost_s"] < r["restored_s"] < r["lost_s"] + 10, r
        assert r["epoch"] > 0 and r["twin"] != r["replica"]
        # Each rebuild ran in the spare process started ahead of it (the second in the one
        # started after the first rebuild), and these small states came inline.
        assert r["warm"] and not r["state_file"], r
    assert res.max_gap_ms is not None and res.max_gap_ms < 1000
    # What the workers said they used (the killed ones up to their last keepalive) is
    # part of what the engine measured of every process it started (spares included).
    assert res.workers_cpu_s is not None and 0 < res.workers_cpu_s <= res.cpu_s


def test_a_lost_collect_sink_copy_is_rebuilt_from_its_twin_and_then_masks_the_twins_loss():
    """The worker of the sink's replica 1 killed: the copy is rebuilt from replica 0's
    (its rows so far, handed over at a heartbeat-cycle boundary; the rest replayed from
    there), then the worker of replica 0 killed — the last copy that ran from the start
    — and a worker of replica group 0 beside it: the rebuilt copy is published, with
    every row once."""
    job = counting_job(restore=True)
    placement = job.plan().placement()
    sink_workers = [w for w, rids in enumerate(placement) if rids[0][0] == 4]
    assert len(sink_workers) == 2, placement
    faults = [
        td.KillWorker(sink_workers[1], at=1.0),
        td.KillWorker(sink_workers[0], at=3.0),
        td.Kill("count", 0, 0, at=3.0),
    ]
    res = job.run(duration=7, faults=faults)
    assert res.lost == 0 and res.duplicates == 0 and res.digests_match
    assert res.output.num_rows == res.events_in
    lost = {(r["task"], r["partition"], r["replica"]) for r in res.lost_replicas}
    rebuilt = {(r["task"], r["partition"], r["replica"]) for r in res.restored_replicas}
    assert {("sink", 0, 0), ("sink", 0, 1), ("count", 0, 0)} <= lost
    assert rebuilt == lost, (rebuilt, lost)
    (first,) = [r for r in res.restored_replicas if r["task"] == "sink" and r["replica"] == 1]
    assert first["restored_s"] < 3.0, first  # back before its twin's loss
    for r in res.restored_replicas:
        assert r["restored_s"] < r["lost_s"] + 5, r
    assert res.max_gap_ms < 1000


def test_a_kill_of_the_last_live_replica_waits_for_its_twins_rebuild():
    # Both due at once: the first loss cannot be rebuilt yet when the second kill is due,
    # however fast a rebuild is (a warm one takes about 40 ms).
    faults = [td.Kill("count", 0, 0, at=1.5), td.Kill("count", 0, 1, at=1.5)]
    res = counting_job(restore=True).run(duration=6, faults=faults)
    assert res.lost == 0 and res.duplicates == 0
    assert res.digests_match, res.determinism_errors
    first, second = res.faults
    assert "waited_for_rebuild_s" not in first
    assert second["waited_for_rebuild_s"] > 0
    back = max(
        r["restored_s"] for r in res.restored_replicas if r["lost_s"] == first["injected_at"]
    )
    assert (
        back
        <= second["injected_at"]
        == pytest.approx(1.5 + second["waited_for_rebuild_s"], abs=0.01)
    )
    assert res.max_gap_ms is not None and res.max_gap_ms < 1000


def test_without_restore_the_second_kill_loses_the_partition():
    faults = [td.Kill("count", 0, 0, at=1.5), td.Kill("count", 0, 1, at=3.0)]
    with pytest.raises(TandemError, match=r"every replica of .* is gone \(worker \d+ was killed\)"):
        counting_job(restore=False).run(duration=4.5, faults=faults)


def test_a_frozen_worker_is_declared_lost_fenced_and_rebuilt_while_its_twins_go_on():
    # SIGSTOP for longer than the run: without keepalives it would never be replaced.
    job = counting_job(restore=True)
    job.failure_timeout_ms = 1000
    res = job.run(duration=7, faults=[td.Pause("count", 0, 1, at=1.5, for_s=10)])
    assert res.lost == 0 and res.duplicates == 0
    assert res.digests_match, res.determinism_errors
    # Its keepalives stopped, and its upstream replicas dropped it as a straggler: either
    # declares it lost.
    causes = {r["cause"] for r in res.lost_replicas}
    assert len(causes) == 1 and causes <= {"silent", "evicted"}, res.lost_replicas
    # Both sink copies end: neither is taken for a straggler while its Done is on the way.
    assert all(r["task"] != "sink" for r in res.lost_replicas), res.lost_replicas
    rebuilt = {(r["task"], r["partition"], r["replica"]) for r in res.restored_replicas}
    assert ("count", 0, 1) in rebuilt
    # The twins never waited for the frozen worker (eviction), nor for its rebuild.
    assert res.max_gap_ms is not None and res.max_gap_ms < 500, res.max_gap_ms


def test_chaos_kills_worker_after_worker_and_r_is_restored_before_each_next_kill():
    """Chaos picks any worker, the sinks' too (a Collect copy is rebuilt from its twin's):
    seed 7 draws the worker of the sink's replica 0 first."""
    chaos = td.Chaos(at=1.0, every_s=(2.5, 3.5), seed=7)
    res = counting_job(restore=True).run(duration=12, faults=[chaos])
    assert res.lost == 0 and res.duplicates == 0
    assert res.digests_match, res.determinism_errors
    kills = [f for f in res.faults if f["kind"] == "chaos"]
    assert len(kills) >= 2, res.faults
    assert kills[0]["replicas"] == [{"task": "sink", "partition": 0, "replica": 0}], kills
    assert res.output.num_rows == res.events_in
    restored = sorted({r["lost_s"] for r in res.restored_replicas})
    assert restored == sorted(f["injected_at"] for f in kills), (restored, kills)
    # Each kill came after the previous loss was rebuilt.
    for prev, nxt in itertools.pairwise(kills):
        back = max(
            r["restored_s"] for r in res.restored_replicas if r["lost_s"] == prev["injected_at"]
        )
        assert back <= nxt["injected_at"]
    assert res.max_gap_ms is not None and res.max_gap_ms < 1000


def test_chaos_needs_restore():
    with pytest.raises(td.ConfigError, match="set restore=True"):
        counting_job(restore=False).run(duration=3, faults=[td.Chaos()])


def test_restore_is_a_checked_knob():
    with pytest.raises(td.ConfigError, match="restore must be True or False"):
        td.Job("j", restore="yes")
    with pytest.raises(td.ConfigError, match="replay_ms must be > 0"):
        td.Job("j", restore=True, replay_ms=0)
    with pytest.raises(td.ConfigError, match="failure_timeout_ms must be > 0"):
        td.Job("j", restore=True, failure_timeout_ms=-1)
    plan = counting_job(restore=True, replay_ms=95).plan()
    assert plan.replay_cycles == 10  # whole heartbeat cycles of 10 ms
    assert counting_job(restore=False).plan().replay_cycles is None


def test_bench_recovery_rebuilds_a_stateful_replica_and_reports_its_cost():
    from tandem.experiments import recovery

    (row,) = recovery.restore(sizes=(4,), rate=1000, duration=7, kill_at=2.5)
    assert row.lost == 0 and row.duplicates == 0 and row.digests_match
    # The killed worker hosted replica 0 of both source and both state partitions.
    assert row.rebuilt == 4
    assert row.restore_ms is not None and 0 < row.restore_ms < 10_000
    assert row.p99_before_ms > 0 and row.during_vs_before > 0


def test_a_large_state_goes_from_twin_to_newcomer_as_a_file_removed_after_the_run():
    from tandem.engines import exchange
    from tandem.experiments import recovery

    before = set(glob.glob("/dev/shm/tandem-state-*")) | set(glob.glob("/tmp/tandem-state-*"))
    mb = 2 * exchange.SPILL_BYTES / 2**20
    res = recovery.recovery_job(mb, 1000).run(
        duration=6, faults=[td.Kill("state", 0, 0, at=2.0)], progress=False
    )
    assert res.lost == 0 and res.duplicates == 0
    assert res.digests_match, res.determinism_errors
    by_task = {(r["task"], r["partition"]): r for r in res.restored_replicas}
    # The stateful replicas' states (2 MiB each) came as files, the sources' inline.
    assert by_task[("state", 0)]["state_file"] and by_task[("state", 1)]["state_file"]
    assert not by_task[("source", 0)]["state_file"]
    after = set(glob.glob("/dev/shm/tandem-state-*")) | set(glob.glob("/tmp/tandem-state-*"))
    assert after <= before, "the run left its state folder behind"


def test_a_spilled_resume_reads_back_the_same_state(tmp_path):
    from tandem.runtime import Resume

    state = bytes(range(256)) * 4096
    spilled = Resume((7, ()), state).spilled(str(tmp_path))
    assert spilled.state == b"" and spilled.epoch == 7
    assert spilled.load() == state
    assert Resume((7, ()), b"abc").load() == b"abc"


def test_ballast_state_survives_a_snapshot_and_restore():
    from tandem.experiments import recovery

    a = recovery.Ballast(0.01)
    rows = pa.RecordBatch.from_pydict({"key": [1, 2, 3]})
    for _ in range(5):
        a.on_batch(rows)
    b = recovery.Ballast(0.01)
    b.restore(a.snapshot())
    assert b.state["batches"] == 5
    assert b.state["bytes"].tobytes() == a.state["bytes"].tobytes()
    assert a.state["bytes"][:5].tolist() == [1, 1, 1, 1, 1]


def _child_writes(path: str, data: bytes | None) -> int:
    """Fork a child that writes ``data`` as a cut's state file (None: it fails)."""
    from tandem.runtime import Resume

    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if data is not None:
                Resume((0,), data)._to_file(path, keep=False)
                code = 0
        finally:
            os._exit(code)
    return pid


def test_a_cut_written_by_a_child_comes_back_inline_as_a_file_or_not_at_all(tmp_path):
    """The twin's side of a rebuild (Replica.cut_in_child): a forked child writes the
    state; the cut is sent once it is done — a small state read back inline, a large one
    as the file — and a child that failed makes it a cut not taken (a later one is tried)."""
    from tandem.runtime import CutWriter, Resume

    def writes(path, data):
        return CutWriter(_child_writes(path, data))

    small, large = tmp_path / "small.state", tmp_path / "large.state"
    pending = Resume((7,), b"", str(small), writer=writes(str(small), b"x" * 10))
    done = pending.written(inline_below=1 << 20)
    assert done == Resume((7,), b"x" * 10) and not small.exists()
    pending = Resume((7,), b"", str(large), writer=writes(str(large), b"y" * 100))
    done = pending.written(inline_below=50)
    assert done.writer is None and done.state_file == str(large) and done.load() == b"y" * 100
    failed = tmp_path / "failed.state"
    failed.write_bytes(b"")
    pending = Resume((7,), b"", str(failed), writer=writes(str(failed), None))
    assert pending.written() is None and not failed.exists()


def _threads(pid: int) -> dict[int, tuple[str, int]]:
    """Per thread of ``pid``: its state letter and niceness (``/proc/PID/task/TID/stat``)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        out[int(tid)] = (fields[0], int(fields[16]))  # state, nice (fields 3 and 19)
    return out


def test_a_spare_loads_at_the_lowest_priority_and_then_runs_every_thread_at_normal():
    proc = local._Process(None, child_env(), "spare", relay=False)
    try:
        seen_niced, deadline = False, time.monotonic() + 30
        while True:
            threads = _threads(proc.pid)
            niced = {t for t, (_, nice) in threads.items() if nice == local.SPARE_NICE}
            seen_niced |= bool(niced)
            # Loaded: no niced thread left, and the main thread waits for its payload.
            if seen_niced and not niced and threads[proc.pid][0] == "S":
                break
            assert time.monotonic() < deadline, (
                f"after 30 s the spare still loads, or a thread kept the loader's niceness "
                f"(thread: (state, nice)): {threads}"
            )
            time.sleep(0.01)
        assert proc.is_alive()
        # Every thread the spare has now (numpy's, pyarrow's, the main one) will run the
        # rebuilt worker: none may have inherited the loader's niceness.
        assert {nice for _, nice in _threads(proc.pid).values()} == {0}
    finally:
        proc.kill()
        proc.join(10)


def _await_loaded(pid: int, nice: int) -> dict[int, tuple[str, int]]:
    """Wait until the spare ``pid`` has loaded (a thread was seen at niceness ``nice``, none
    is left at it, and the main thread sleeps: it waits for its payload); its threads."""
    seen_niced, deadline = False, time.monotonic() + 30
    while True:
        threads = _threads(pid)
        niced = {t for t, (_, n) in threads.items() if n == nice}
        seen_niced |= bool(niced)
        if seen_niced and not niced and threads[pid][0] == "S":
            return threads
        assert time.monotonic() < deadline, (
            f"after 30 s the spare still loads, or a thread kept the loader's niceness "
            f"(thread: (state, nice)): {threads}"
        )
        time.sleep(0.01)


def test_the_spare_module_loads_at_the_lowest_priority_then_becomes_a_worker():
    """``tandem.engines.spare`` started as the local engine starts a spare (its file, a
    socket pair's end, the parent's pid, the lowest niceness): every thread it has once
    loaded runs at normal priority, and it is a worker process waiting for its payload
    (which exits when the link closes before one came)."""
    import socket

    from tandem.engines import spare

    mine, theirs = socket.socketpair()
    args = [str(theirs.fileno()), str(os.getpid()), "spare", str(local.SPARE_NICE)]
    try:
        proc = subprocess.Popen(
            [sys.executable, spare.PATH, *args], pass_fds=(theirs.fileno(),), env=child_env()
        )
    finally:
        theirs.close()
    try:
        _await_loaded(proc.pid, local.SPARE_NICE)
        assert proc.poll() is None
        assert {nice for _, nice in _threads(proc.pid).values()} == {0}
        mine.close()  # no payload will come: the worker's recv ends
        assert proc.wait(30) == 1
    finally:
        mine.close()
        proc.kill()
        proc.wait(10)


def test_the_spare_imports_only_the_standard_library_before_its_priority_drops():
    """Run by its file, the spare has loaded nothing but what the interpreter starts with
    and the standard library when it lowers its priority: tandem loads after (and numpy
    and pyarrow, but where the process could not raise the priority back: they load
    first, at normal priority). ``python -m tandem.engines.spare`` would import the
    tandem package first."""
    import json

    from tandem.engines import spare
    from tandem.runtime import may_raise_priority

    code = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("spare_under_test", sys.argv[1])
spare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(spare)
seen, load = [], spare._priority

def priority():
    module = load()
    lowest = module.lowest_priority

    def record(tid, nice):
        seen.append(sorted(sys.modules))
        lowest(tid, nice)

    module.lowest_priority = record
    return module

spare._priority = priority
spare.boot(19)
print(json.dumps(seen))
"""

    def modules(*argv: str) -> list:
        done = subprocess.run(
            [sys.executable, *argv],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
            env=child_env(),
        )
        return json.loads(done.stdout.splitlines()[-1])

    startup = set(modules("-c", "import json, sys; print(json.dumps(sorted(sys.modules)))"))
    drops = modules("-c", code, spare.PATH)
    assert drops, "the spare never lowered its priority"
    loaded = {m.split(".")[0] for m in drops[0]} - startup - {"spare_under_test"}
    assert "tandem" not in loaded
    if may_raise_priority():
        extra = sorted(m for m in loaded if m not in sys.stdlib_module_names)
        assert not extra, f"loaded before the priority drop: {extra}"


def test_a_rebuilt_workers_threads_get_their_priority_back_once_it_caught_up():
    """The rebuilt worker's thread loads and catches up at a lower priority; the threads
    it starts meanwhile inherit it, and all of them get the normal one back."""
    code = """
import os, threading
from tandem.runtime import renice_threads, thread_nice
base = thread_nice(5)
assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base + 5
stop = threading.Event()
t = threading.Thread(target=stop.wait)
t.start()
assert os.getpriority(os.PRIO_PROCESS, t.native_id) == base + 5  # inherited
renice_threads(base)
tids = [int(x) for x in os.listdir("/proc/self/task")]
print(sorted({os.getpriority(os.PRIO_PROCESS, tid) for tid in tids}), base)
stop.set()
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    assert out == ["[0]", "0"], out


class _Nested(td.KeyedProcess):
    def process(self, batch, state):
        state.setdefault("seen", []).append(batch.num_rows)  # a list: not sized
        return batch


class _Custom(td.KeyedProcess):
    def process(self, batch, state):
        return batch

    def snapshot(self) -> bytes:
        return b"custom"


def test_state_size_is_known_only_where_it_is_cheap_and_sure():
    import numpy as np

    assert td.operators.Map(lambda b: b).state_size() == 0  # stateless
    counts = td.CountPerKey()
    assert counts.state_size() == 0
    counts.state.update({"a": 1, "b": 2})
    assert 0 < counts.state_size() < 200
    counts.state.update({i: i for i in range(td.operators.SIZED_KEYS)})
    assert counts.state_size() is None  # too many keys to walk
    arrays = td.CountPerKey()
    arrays.state["x"] = np.zeros(1 << 20, np.uint8)
    assert arrays.state_size() >= 1 << 20
    nested = _Nested()
    nested.process(pa.record_batch({"v": [1]}), nested.state)
    assert nested.state_size() is None
    assert _Custom().state_size() is None  # its own snapshot, no state_size of its own


def test_one_fork_writes_every_large_state_a_rebuild_cuts_in_a_worker():
    """A worker hosting the twins of two large states cut for one rebuild forks once: the
    slot cut first is held until the other is cut too, and one child writes both."""
    from tandem.experiments import recovery

    job = recovery.recovery_job(3, 2000)
    job.workers = 1  # both partitions of each replica group in one worker
    res = job.run(duration=5, faults=[td.Kill("state", 0, 0, at=2.0)], progress=False)
    assert res.lost == 0 and res.duplicates == 0
    assert res.digests_match, res.determinism_errors
    states = [r for r in res.restored_replicas if r["task"] == "state"]
    assert len(states) == 2, res.restored_replicas
    assert all(r["forked_with"] == 2 and r["state_file"] for r in states), states
    others = [r for r in res.restored_replicas if r["task"] != "state"]
    assert others and all(r["forked_with"] == 0 for r in others), others


def test_a_rebuilds_cut_forks_only_for_a_state_that_may_be_large(tmp_path):
    """The twin's side of a rebuild: a state known to be small (``state_size``) is
    snapshotted in place — no fork of the worker — and one that may be large in a forked
    child (``Resume.writer``); both give the same state back."""
    from tandem import _core
    from tandem.experiments import recovery
    from tandem.operators import empty_batch
    from tandem.runtime import INLINE_CUT_BYTES, Replica

    cut = (7, [7], None, [])

    def cut_of(mb: float) -> tuple:
        plan = recovery.recovery_job(mb, 1000).plan()
        task = next(t for t in plan.tasks if t.name == "state")
        source = next(t for t in plan.tasks if t.name != "state" and t.kind == "source")
        rep = Replica(plan, task.id, 0, 0, b"s" * 32, _core.Worker())
        rep._inst = plan.instantiate(task.id, 0)
        rep._inst.batch(empty_batch(source.schema), 0)  # the ballast is made
        return rep._inst, rep.cut_in_child(cut, str(tmp_path))

    small_mb = (INLINE_CUT_BYTES - 8) / 2**20
    inst, taken = cut_of(small_mb)
    assert inst.state_size() == INLINE_CUT_BYTES
    assert taken.writer is None and taken.state == inst.snapshot()
    inst, taken = cut_of(2 * small_mb)
    assert inst.state_size() > INLINE_CUT_BYTES
    assert taken.writer is not None  # a forked child writes it
    done = taken.written(inline_below=1)
    assert done.state_file is not None and done.load() == inst.snapshot()


def test_a_savepoints_large_state_is_hashed_by_its_forked_child_and_moved_into_place(tmp_path):
    """A savepoint's cut of a state that may be large is written as a rebuild's is, by a
    forked child (``SlotCuts.take``), which also hashes it: the writer thread then only
    moves the file to its name in the savepoint, its SHA-256 the child's, nothing left
    beside it."""
    import hashlib

    from tandem import _core
    from tandem.experiments import recovery
    from tandem.operators import empty_batch
    from tandem.runtime import INLINE_CUT_BYTES, Replica, fork_cuts

    plan = recovery.recovery_job(2 * INLINE_CUT_BYTES / 2**20, 1000).plan()
    task = next(t for t in plan.tasks if t.name == "state")
    source = next(t for t in plan.tasks if t.name != "state" and t.kind == "source")
    rep = Replica(plan, task.id, 0, 0, b"s" * 32, _core.Worker())
    rep._inst = plan.instantiate(task.id, 0)
    rep._inst.batch(empty_batch(source.schema), 0)
    cut = (7, [7], None, [])
    assert rep.forks(cut)

    folder = tmp_path / "savepoint"  # not made yet on this host: fork_cuts makes it
    taken = fork_cuts([(rep, cut, str(folder))], digest=True)[0]
    assert taken.writer is not None
    done = taken.written()
    state = rep._inst.snapshot()
    assert done.sha256 == hashlib.sha256(state).hexdigest()
    final = done.checkpointed(str(folder / "1-0-0.state"), digest=True)
    assert final.sha256 == done.sha256 and final.keep_file
    assert final.load() == state
    assert os.listdir(folder) == ["1-0-0.state"]  # no temporary file, no digest file

    # A child that fails leaves nothing behind, and the cut is not taken.
    def fails() -> bytes:
        raise RuntimeError("snapshot failed")

    rep._inst.snapshot = fails
    assert fork_cuts([(rep, cut, str(folder))], digest=True)[0].written() is None
    assert os.listdir(folder) == ["1-0-0.state"]
