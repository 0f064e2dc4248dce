"""The keyed, stateful job the engine tests share.

It lives beside the tests, not in :mod:`tandem.testing`: building a job imports
:mod:`tandem`, and the reference executor (which the engines import) imports
:mod:`tandem.testing`, so a job builder there would close an import cycle.
"""

from __future__ import annotations

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
