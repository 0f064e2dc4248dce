"""The keyed, stateful job the engine tests share.

It lives beside the tests, not in :mod:`tandem.testing`: building a job imports
:mod:`tandem`, and the reference executor (which the engines import) imports
:mod:`tandem.testing`, so a job builder there would close an import cycle.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import tandem as td
from tandem import testing


def counting_job(
    name: str,
    rate: int,
    replication: int = 2,
    fn=testing.bucket,
    sink_replication: int | None = None,
    **job_options,
):
    """The keyed, stateful job the engine tests share: ``Synthetic(rate, keys=50, seed=3)``
    in 2 partitions → ``map(fn)`` named ``enrich`` → ``key_by("key")`` →
    ``CountPerKey`` named ``count`` → ``Collect`` (replicated as the job, or
    ``sink_replication``), 2 partitions each; ``job_options`` go to ``td.Job``."""
    job = td.Job(name, replication=replication, **job_options)
    ev = job.source(td.sources.Synthetic(rate=rate, keys=50, seed=3), parallelism=2)
    counted = (
        ev.map(fn, parallelism=2, name="enrich")
        .key_by("key")
        .process(td.CountPerKey(), parallelism=2, name="count")
    )
    counted.sink(td.sinks.Collect(), replication=sink_replication)
    return job


def write_events(path: Path, rows: int, keys: int, seed: int) -> str:
    """A Parquet file of ``rows`` rows ``(id, key)``: ids 0..rows-1, keys drawn from
    ``0..keys-1`` with ``seed``; its path."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    table = pa.table(
        {
            "id": pa.array(np.arange(rows), pa.int64()),
            "key": pa.array(rng.integers(0, keys, rows), pa.int64()),
        }
    )
    pq.write_table(table, path)
    return str(path)


@contextlib.contextmanager
def reaped(proc: subprocess.Popen):
    """``proc`` for the block; killed and waited for if it still runs when the block ends
    (an assertion failed, a timeout expired), so no test leaves a job running."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def tandem_run(tmp_path: Path, script: str, *flags: str) -> subprocess.Popen:
    """``tandem run job.py FLAGS`` as a user starts it, in a process of its own: ``script``
    written to ``tmp_path/job.py``, the tandem under test on its path, its output piped."""
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(script))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(td.__file__).parents[1]), env.get("PYTHONPATH", "")]
    )
    return subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "run", str(path), *flags],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
