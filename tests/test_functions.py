"""Python functions as users write them: a plain script without a ``__main__`` guard,
lambdas, closures and ``functools.partial`` as operators, what cannot be shipped to the
worker processes, and ``union`` of streams whose schemas differ in nullability only."""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import textwrap
import threading
import types
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

import tandem as td
from tandem.reference import canonical

RATE = 600
DURATION = 1.5


pytestmark = pytest.mark.usefixtures("no_orphans")


def _env() -> dict[str, str]:
    """This environment, with the folder tandem is imported from on PYTHONPATH."""
    root = str(Path(td.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


def test_a_plain_script_without_a_main_guard_runs(tmp_path):
    # multiprocessing's spawn re-imports the main script in every worker, which would run
    # the job again there; the workers must never import it.
    script = tmp_path / "plain_job.py"
    script.write_text(
        textwrap.dedent(
            """
            import pyarrow.compute as pc
            import tandem as td

            print("script body ran", flush=True)
            factor = 3

            def enrich(batch):
                return batch.append_column("k3", pc.multiply(batch.column("key"), factor))

            job = td.Job("plain", replication=2, ordering="liverobin", heartbeat_ms=10)
            events = job.source(td.sources.Synthetic(rate=500, keys=20, seed=7))
            events.map(lambda b: b, name="same").map(enrich).sink(td.sinks.Collect())
            res = job.run(duration=1.5, progress=False)
            print("result", res.lost, res.duplicates, res.events_out, res.output.num_rows)
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines.count("script body ran") == 1, proc.stdout
    result = [line.split()[1:] for line in lines if line.startswith("result ")]
    assert len(result) == 1, proc.stdout
    lost, duplicates, events_out, rows = map(int, result[0])
    assert (lost, duplicates) == (0, 0)
    assert events_out == rows > 0


def _rows(result: td.Result) -> pa.Table:
    """The output as a sorted multiset, without event times (the reference's run from t0 = 0;
    ``lost``/``duplicates`` compare a run with the reference run at the same t0)."""
    return canonical(result.output.drop_columns(["event_time_ns"])).to_pylist()


def _assert_like_the_reference(job: td.Job) -> None:
    ref = job.run_reference(DURATION)
    assert ref.events_out > 0
    res = job.run(duration=DURATION, progress=False)
    assert (res.lost, res.duplicates) == (0, 0)
    assert res.digests_match
    assert _rows(res) == _rows(ref)


def _scale(batch: pa.RecordBatch, by: int) -> pa.RecordBatch:
    return batch.append_column("scaled", pc.multiply(batch.column("key"), by))


def test_lambdas_closures_and_partials_are_operators_of_a_replicated_job():
    threshold = 4  # a local variable the closure captures
    offset = {"by": 10}

    def above(batch):
        return pc.greater(batch.column("key"), threshold)

    def shifted(batch):
        return batch.append_column("shifted", pc.add(batch.column("key"), offset["by"]))

    job = td.Job("functions", replication=2, ordering="liverobin", heartbeat_ms=10)
    events = job.source(td.sources.Synthetic(rate=RATE, keys=20, seed=3), parallelism=2)
    (
        events.filter(above)
        .map(lambda b: b.append_column("double", pc.multiply(b.column("key"), 2)))
        .map(shifted)
        .map(functools.partial(_scale, by=3))
        .key_by("key")
        .process(td.CountPerKey(), parallelism=2)
        .sink(td.sinks.Collect())
    )
    _assert_like_the_reference(job)


def test_closure_columns_arrive_computed_by_the_workers():
    threshold = 5

    def above(batch):
        return pc.greater(batch.column("key"), threshold)

    job = td.Job("closure", replication=2, ordering="liverobin", heartbeat_ms=10)
    (
        job.source(td.sources.Synthetic(rate=RATE, keys=20, seed=4))
        .filter(above)
        .map(lambda b: b.append_column("k2", pc.multiply(b.column("key"), 2)))
        .sink(td.sinks.Collect())
    )
    res = job.run(duration=DURATION, progress=False)
    assert (res.lost, res.duplicates) == (0, 0)
    out = res.output
    assert out.num_rows > 0
    assert pc.min(out.column("key")).as_py() > threshold
    assert out.column("k2").to_pylist() == [2 * k for k in out.column("key").to_pylist()]


def _locked_job(name: str, capture) -> td.Job:
    job = td.Job("unshippable", replication=2)
    job.source(td.sources.Synthetic(rate=100, keys=5, seed=1)).map(capture, name=name).sink(
        td.sinks.Collect()
    )
    return job


def test_an_operator_that_captures_a_lock_fails_at_plan_naming_it():
    lock = threading.Lock()

    def guarded(batch):
        with lock:
            return batch

    job = _locked_job("guarded", guarded)
    with pytest.raises(
        td.ConfigError,
        match=r"operator task 'guarded' cannot be sent to a worker process \(operator fn -> "
        r"lock \(a _thread\.lock\)\): TypeError: cannot pickle '_thread\.lock'",
    ):
        job.plan()
    with pytest.raises(td.ConfigError, match=r"operator task 'guarded' cannot be sent"):
        job.run(duration=1.0, progress=False)  # before any process starts


def test_an_operator_that_captures_a_socket_fails_at_plan_naming_it():
    with socket.socket() as sock:

        def send(batch):
            if batch.num_rows:
                sock.sendall(b"x")
            return batch

        job = _locked_job("sender", send)
        with pytest.raises(
            td.ConfigError, match=r"operator task 'sender' cannot be sent.*fn -> sock"
        ):
            job.plan()


def test_a_function_from_a_module_the_workers_cannot_import_fails_with_its_name(monkeypatch):
    # An importable module's functions travel by name; a module that exists only in this
    # process (registered at run time, with no file) cannot be imported by a worker.
    ghost = types.ModuleType("tandem_ghost_module")
    ghost.__file__ = "/nonexistent/tandem_ghost_module.py"
    exec("def same(batch):\n    return batch\n", ghost.__dict__)
    monkeypatch.setitem(sys.modules, "tandem_ghost_module", ghost)
    job = _locked_job("ghostly", ghost.same)
    with pytest.raises(
        td.ConfigError,
        match=r"could not load the job: ModuleNotFoundError: No module named "
        r"'tandem_ghost_module'",
    ):
        job.run(duration=1.0, progress=False)


# -- union ------------------------------------------------------------------------------


def _nullable(batch: pa.RecordBatch) -> pa.RecordBatch:
    schema = pa.schema([f.with_nullable(True) for f in batch.schema])
    return pa.RecordBatch.from_arrays(batch.columns, schema=schema)


def test_union_of_schemas_differing_in_nullability_only():
    job = td.Job("nullable", replication=2, ordering="liverobin", heartbeat_ms=10)
    strict = job.source(td.sources.Synthetic(rate=RATE, keys=20, seed=5), name="strict")
    loose = job.source(td.sources.Synthetic(rate=RATE // 2, keys=20, seed=6), name="src2").map(
        _nullable, name="loose"
    )
    assert not strict.schema.field("key").nullable
    assert loose.schema.field("key").nullable
    both = strict.union(loose)
    assert both.schema.equals(loose.schema)  # nullable wherever one of them is
    both.filter(lambda b: pc.greater(b.column("key"), 2)).key_by("key").process(
        td.CountPerKey(), parallelism=2
    ).sink(td.sinks.Collect())
    _assert_like_the_reference(job)


def test_union_of_nested_nullability_and_straight_into_a_sink():
    def tagged(nullable: bool):
        item = pa.field("item", pa.int64(), nullable=nullable)

        def fn(batch):
            tags = pa.array([[k] for k in batch.column("key").to_pylist()], pa.list_(item))
            return batch.append_column(pa.field("tags", pa.list_(item), nullable=False), tags)

        return fn

    job = td.Job("nested", replication=2, heartbeat_ms=10)
    a = job.source(td.sources.Synthetic(rate=RATE, keys=20, seed=7), name="a")
    b = job.source(td.sources.Synthetic(rate=RATE, keys=20, seed=8), name="b")
    both = a.map(tagged(False), name="ta").union(b.map(tagged(True), name="tb"))
    assert both.schema.field("tags").type.value_field.nullable
    both.sink(td.sinks.Collect())
    ref = job.run_reference(DURATION)
    # check=False: the lost/duplicate check groups rows by every column, and Arrow cannot
    # group by a list column.
    res = job.run(duration=DURATION, progress=False, check=False)
    out = res.output
    assert out.num_rows == ref.output.num_rows > 0
    assert out.schema.equals(both.schema)
    assert out.column("tags").to_pylist() == [[k] for k in out.column("key").to_pylist()]


def test_union_of_different_schemas_names_the_fields_and_types():
    job = td.Job("mismatch")
    a = job.source(td.sources.Synthetic(rate=100, keys=5, seed=1), name="a")
    as_float = a.map(
        lambda b: b.set_column(3, "value", pc.cast(b.column("value"), pa.float32())), name="f32"
    )
    renamed = a.map(lambda b: b.rename_columns([*b.schema.names[:3], "amount"]), name="ren")
    src2 = job.source(td.sources.Synthetic(rate=100, keys=5, seed=2), name="b")
    with pytest.raises(
        td.ConfigError,
        match=r"union\(\) of 'f32' and 'b': schemas differ: 'value' is float vs double",
    ):
        as_float.union(src2)
    with pytest.raises(
        td.ConfigError,
        match=r"union\(\) of 'ren' and 'b': schemas differ: only the first has \['amount'\]; "
        r"only the second has \['value'\]",
    ):
        renamed.union(src2)


class _ExitOnLoad:
    """Unpickles as a call to ``os._exit(3)``: a worker that dies while loading the job."""

    def __reduce__(self):
        return (os._exit, (3,))


def test_a_worker_that_dies_while_starting_is_named_with_its_exit_code():
    bomb = _ExitOnLoad()

    def same(batch):
        assert bomb is not None
        return batch

    job = _locked_job("doomed", same)
    with pytest.raises(td.TandemError, match=r"worker \d+ exited while starting \(exit code 3\)"):
        job.run(duration=1.0, progress=False)
