"""The Spark engine: every worker of a job is one long-running task of one Spark job.

A worker is what the local engine runs as one OS process — the fault domain, hosting many
task replicas (:meth:`tandem.plan.Plan.placement`: the replica groups, split by partition,
and one worker for the sinks). The driver (this module, where
``job.run(engine=SparkEngine(spark))`` is called):

1. checks the session (:func:`tandem_spark.session.check_cluster`): a task slot per
   worker plus spares, retries on, speculation and dynamic allocation off;
2. builds the *placement* DataFrame, one row per worker — ``slot`` (its Spark partition,
   and the worker's index) and ``replicas`` (the ``task``/``partition``/``replica`` of
   each replica it hosts) — in exactly as many Spark partitions as rows (``spark.range``
   with one slice per row puts row ``i`` alone in partition ``i``);
3. starts the :class:`~tandem_spark.registry.Registry`, runs
   ``placement.mapInArrow(worker_main, schema)`` as one non-barrier job on a thread, and
   the run's :class:`~tandem.engines.coordinator.Coordinator` — the local engine's — on
   the caller's, with the registry as its host of workers.

On an executor, :func:`worker_main` — the Arrow-backed UDF — reads its placement row,
checks in with the registry (which confirms the row's worker, or on a cluster swaps
workers between tasks so that twins run on different executors), then serves the worker
as a local engine's worker process does (:func:`tandem.engines.exchange.serve`): binds the
inboxes of every replica the worker hosts, waits for every peer's address and ``t0``,
runs a :class:`tandem.runtime.Worker` hosting them (the Rust event loop behind a Python
operator loop) and sends its replicas' :class:`~tandem.runtime.ReplicaReport` s to the
driver in its ``Done``, the rows of a ``td.sinks.Collect`` sink with them.

The coordinator hands the reports to :func:`tandem.engines.common.assemble_result` —
exactly what the local engine does — and the Collect sink's rows are
:meth:`SparkEngine.output_df`. The run ends once every report is in, whatever the Spark
job still runs: a task of a worker cut off from the driver (fenced, and rebuilt
elsewhere) is cancelled, not waited for until Spark declares its executor lost.

A killed worker's task fails; ``local[N,F]`` (``F >= 2``) and clusters retry only that
task. The retry checks in with the registry with its placement row. Under
``Job(restore=True)`` it rejoins: it gets cuts of its worker's replicas from their live
twins and runs them, fed by the upstream replicas from those cuts (DESIGN §4; see
:mod:`tandem_spark.registry`), so ``r`` is restored; otherwise it ends at once without
output, and the twins of its replicas carry their partitions alone.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from tandem import logs
from tandem.engines.common import Stop, check_options, stop_points
from tandem.engines.coordinator import Coordinator
from tandem.engines.exchange import REJOIN_TIMEOUT_S, serve
from tandem.engines.process import child_env
from tandem.engines.protocol import Assign, Retire, expect
from tandem.exceptions import ConfigError, TandemError
from tandem.faults import Kill, KillWorker, Pause
from tandem.heartbeat import Generators
from tandem.ordering import kazoo
from tandem.plan import Plan, Task
from tandem.result import Result
from tandem.runtime import ReplicaId
from tandem.sinks import Collect
from tandem_spark import registry as reg
from tandem_spark.session import (
    LOCAL_MASTER,
    check_cluster,
    is_local,
    local_session,
)

log = logging.getLogger("tandem")

SLOT = "slot"
"""The placement DataFrame's row index: the Spark partition, and the worker it runs."""
OUTPUT = pa.schema([pa.field(SLOT, pa.int64())])
"""The schema of ``worker_main``'s output, which has no rows: the reports come through
the registry."""

END_GRACE_S = 1.0
"""How long the Spark job may go on once the coordinator has every report (a task of a
worker cut off from the driver: Spark waits for it until it declares the executor lost)."""
END_WAIT_S = 3.0
"""How long a cancelled Spark job may take to end before the run returns without it."""

KILL_UNITS = ("worker", "executor")


class SparkEngine:
    """Runs a plan with one Spark task per worker on the cluster of ``spark``.

    Without ``spark``, each run uses a session sized for the plan
    (:func:`~tandem_spark.session.local_session`, on ``master`` if given), stopped
    afterwards unless it was running before; the output is then in ``Result.output`` only.
    The workers are those of :meth:`tandem.plan.Plan.placement` — as on the local engine,
    the job's ``workers=`` per replica group (default: the driver's cores ÷ replication)
    plus one for the sinks — and each is one Spark task for the whole run.
    ``spare_slots``: task slots the cluster must have beyond one per worker (room for
    retries). ``host``: the address replicas bind and advertise — by default 127.0.0.1
    on a local master, else the executor's own host name. ``kill``: what a ``td.Kill``
    or ``td.KillWorker`` SIGKILLs — the Python ``"worker"`` process of the worker task
    hosting the replica, with every replica in it, or the whole ``"executor"`` JVM with
    every worker on it (a node crash; ``local-cluster[...]`` only, as the driver must see
    the executor's processes). A ``td.Pause`` freezes (SIGSTOP) the Python worker process.

    After a run, ``last_run`` (:class:`~tandem_spark.registry.RunLog`) holds every task
    attempt the registry saw, and :meth:`output_df` the job's output as a DataFrame.
    """

    name = "spark"
    savepoints = True  # a run may resume from a savepoint and write durable checkpoints
    until_stopped = True  # run(duration=None, stop=...): until stopped, savepoints meanwhile

    def __init__(
        self,
        spark=None,
        *,
        master: str | None = None,
        spare_slots: int = 1,
        host: str | None = None,
        kill: str = "worker",
    ) -> None:
        if kill not in KILL_UNITS:
            raise ConfigError(f"SparkEngine: kill must be one of {KILL_UNITS}, got {kill!r}")
        if spark is not None and master is not None:
            raise ConfigError("SparkEngine: give a session or a master URL, not both")
        self.spark, self.master, self.spare_slots = spark, master, spare_slots
        self.host, self.kill = host, kill
        self.last_run: reg.RunLog | None = None
        self._output: pa.Table | None = None

    def run(
        self,
        plan: Plan,
        duration: float | None,
        faults: list[Any] = (),
        *,
        progress: bool | None = None,
        warmup: float = 0.0,
        check: bool = True,
        timeout: float | None = None,
        stop: Stop | None = None,
    ) -> Result:
        """Run ``plan`` for ``duration`` seconds of source time, or (None) until ``stop``
        is requested — its savepoints taken meanwhile — or the bounded sources end; the
        options mean what they mean for the local engine (``progress`` is Spark's own
        console progress bar, ``spark.ui.showConsoleProgress``, so it is not drawn again
        here)."""
        del progress
        if duration is None and stop is None and plan.natural_end_ns() is None:
            raise ConfigError(
                "the spark engine runs a job with no duration until it is stopped: give "
                "stop= (job.start() and handle.stop() do), or a duration"
            )
        faults = list(faults)
        self.check(plan, duration, faults, warmup=warmup)
        if self.spark is not None:
            return self._run(plan, duration, faults, warmup, check, timeout, stop)
        from pyspark import SparkContext

        owned = SparkContext._active_spark_context is None  # else getOrCreate reuses it
        self.spark = local_session(len(plan.placement()), self.master, self.spare_slots)
        try:
            return self._run(plan, duration, faults, warmup, check, timeout, stop)
        finally:
            if owned:
                self.spark.stop()
            self.spark, self._output = None, None

    def check(
        self,
        plan: Plan,
        duration: float | None,
        faults: list[Any] = (),
        *,
        progress: bool | None = None,
        warmup: float = 0.0,
        check: bool = True,
        timeout: float | None = None,
        stop: Stop | None = None,
    ) -> None:
        """Raise ConfigError for arguments :meth:`run` cannot honour, before anything
        starts (``Job.start`` calls it before its thread does)."""
        faults = list(faults)
        check_options(self.name, duration, warmup, faults, kinds=(Kill, KillWorker, Pause))
        if plan.checkpointing:
            durable = (
                " (at replication=1 checkpoint_dir= comes with it; durable checkpoints alone "
                "run on Spark at replication >= 2)"
                if plan.durable_dir is not None
                else ""
            )
            raise ConfigError(
                "the spark engine does not run Job(checkpoint_ms=...) at replication=1 (the "
                f"passive configuration: checkpoints and rollback){durable}; use the local "
                "engine"
            )
        for f in faults:
            task = plan.task(f.task) if isinstance(f, Kill) else None
            if task is not None and task.kind == "sink" and task.replication < 2:
                raise ConfigError(
                    f"the spark engine does not restart a lost sink ({f}); the local engine "
                    "restarts a Kafka sink from its last commit"
                )

    def _run(self, plan, duration, faults, warmup, check, timeout, stop) -> Result:
        # KaZoo: the run's order topics, deleted once the result (which reads them) is in.
        zoo = kazoo.prepare(plan) if plan.ordered_partitions() else None
        # Kafka sources: their heartbeat generators run on the driver, for the whole job.
        generators = Generators(plan, env=child_env())
        try:
            generators.start()
            return self._run_with(plan, duration, faults, warmup, check, timeout, zoo, stop)
        finally:
            generators.stop()
            if zoo is not None:
                kazoo.cleanup(zoo)

    def _run_with(self, plan, duration, faults, warmup, check, timeout, zoo, stop) -> Result:
        sc = self.spark.sparkContext
        placement = plan.placement()
        check_cluster(self.spark, len(placement), self.spare_slots)
        for task in plan.tasks:  # e.g. a staging directory only this machine can see
            check_master = getattr(task.source or task.sink, "check_master", None)
            if check_master is not None:
                check_master(sc.master)
        if faults and self.kill == "executor" and LOCAL_MASTER.match(sc.master):
            raise ConfigError(
                f"kill='executor' needs separate executor JVMs (a cluster, or master "
                f"local-cluster[W,C,MB]); with {sc.master!r} the executor is the driver itself"
            )
        from pyspark import cloudpickle

        plan.check_picklable(cloudpickle.dumps)
        collect = _collect_sink(plan)
        if collect is not None:  # output_df() will need it as a Spark DataFrame
            _spark_schema(collect.schema)
        local = is_local(sc.master)
        host = self.host or ("127.0.0.1" if local else None)
        secret = secrets.token_bytes(32)
        tag = f"tandem-{plan.job}-{secret.hex()[:8]}"
        rebuilds = _Rebuilds(self.spark, tag)
        registry = reg.Registry(
            plan,
            placement,
            secret,
            host="127.0.0.1" if local else sc.getConf().get("spark.driver.host"),
            kill=self.kill,
            on_failure=lambda _: sc.cancelJobsWithTag(tag),
            local=local,
            relaunch=rebuilds,
        )
        # The caller's stop, if any, is the job's too: a Spark job that fails kills the run.
        job = _SparkJob(sc, tag, stop)
        length, cap_ns = stop_points(duration, stop)
        coordinator = Coordinator(
            plan,
            registry,
            length,
            faults,
            secret=secret,
            zoo=zoo,
            warmup=warmup,
            startup_timeout=reg.REGISTER_TIMEOUT_S,
            stop=job.stop,
            cap_ns=cap_ns,
        )
        registry.coordinator = coordinator
        udf = _worker_main(plan, secret, registry.address, host, zoo, logs.driver_level())
        spark_schema = _spark_schema(OUTPUT)
        rebuilds.job = lambda slot, executor: self._placement(
            plan, placement, (slot, executor)
        ).mapInArrow(udf, spark_schema)
        with registry, _driver_path_on_workers(sc, local):
            job.start(
                self._placement(plan, placement).mapInArrow(udf, spark_schema),
                f"tandem {plan.job}: {len(placement)} workers hosting "
                f"{len(plan.replicas())} replicas "
                + (f"for {duration} s" if duration is not None else "until stopped"),
            )
            try:
                coordinator.start()
                rebuilds.warm(plan, zoo, registry.executors())
                if timeout is None:
                    timeout = 60.0 if coordinator.duration is None else duration + 60.0
                coordinator.watch(timeout)
            except TandemError as exc:
                failure = registry.log.failure or job.failure(plan.job)
                registry.fail(failure or exc)
                raise (failure or exc) from None
            finally:
                coordinator.close()
                job.end(cancel=registry.log.failure is not None)
                rebuilds.close(cancel=True)
        registry.log.t0_ns = coordinator.t0_ns
        registry.log.killed = {
            rid: coordinator.killed[rid] for rid, cause in coordinator.lost if cause == "killed"
        }
        self.last_run = registry.log
        if registry.log.failure is not None:
            raise registry.log.failure
        reports = coordinator.reports
        lost = coordinator.lost
        missing = sorted(set(plan.replicas()) - set(reports) - {rid for rid, _ in lost})
        if missing:
            raise TandemError(f"replicas {missing} of {plan.job!r} never reported; see the log")
        result = coordinator.result(check)
        self._output = None if collect is None else result.outputs[collect.name]
        return result

    def output_df(self):
        """The rows of the last run's first ``td.sinks.Collect`` sink as a Spark DataFrame
        (partition 0 first, each in consumption order), to write with any Spark writer."""
        if self._output is None:
            raise TandemError(
                "SparkEngine.output_df(): no output yet; run a job with a td.sinks.Collect() "
                "sink on this engine first"
            )
        return self.spark.createDataFrame(self._output)

    def _placement(
        self, plan: Plan, placement: list[list[ReplicaId]], only: tuple[int, tuple] | None = None
    ):
        """The placement DataFrame: row ``i`` (worker ``i`` and its replicas) alone in
        Spark partition ``i`` — or, with ``only`` = (row, executor), that one row alone,
        preferring that executor (``(id, host)``). On a cluster of several executors each
        partition also *prefers* an executor (a Spark task location): the workers of
        replica group ``g`` the ``g``-th executor, the sinks' worker the first. Spark
        would otherwise place tasks wherever cores are free at the instant the job is
        submitted — on an executor that has registered but not yet launched, none are —
        and could put twins on one executor; delay scheduling (``spark.locality.wait``)
        holds a task for its executor instead. The registry still checks where each task really ran
        (:meth:`tandem_spark.registry.Registry._assign`)."""
        from pyspark.sql import functions as F

        n = len(placement)
        executors = (
            [] if LOCAL_MASTER.match(self.spark.sparkContext.master) else _executors(self.spark)
        )
        if only is None and len(executors) < 2:
            df = self.spark.range(0, n, 1, numPartitions=n)  # one slice per element
        else:
            tasks = plan.tasks
            located = (
                [only]
                if only is not None
                else [
                    (
                        w,
                        executors[rids[0][2] % len(executors)]
                        if any(tasks[t].replication > 1 for t, _, _ in rids)
                        else executors[0],
                    )
                    for w, rids in enumerate(placement)
                ]
            )
            df = _located(self.spark, located)
        df = df.withColumnRenamed("id", SLOT)
        rows = [
            F.array(
                *(
                    F.struct(
                        F.lit(t).alias("task"),
                        F.lit(p).alias("partition"),
                        F.lit(r).alias("replica"),
                    )
                    for t, p, r in rids
                )
            )
            for rids in placement
        ]
        return df.withColumn("replicas", F.array(*rows)[F.col(SLOT)])


class _SparkJob:
    """The Spark job of a run, on a thread of its own (``toArrow`` blocks) while the
    coordinator runs on the caller's. Every report comes through the registry (each
    worker's ``Done``), so the run need not wait for the job: once the coordinator has
    them all, a task still running — a worker cut off from the driver, fenced and
    rebuilt elsewhere, which Spark would otherwise wait for until it declared its
    executor lost — is cancelled with the job after ``END_GRACE_S``. A job that fails
    first stops the coordinator (``stop``)."""

    def __init__(self, sc, tag: str, stop: Stop | None = None) -> None:
        self.sc, self.tag = sc, tag
        self.stop = stop if stop is not None else Stop()
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def start(self, df, description: str) -> None:
        def run() -> None:
            self.sc.addJobTag(self.tag)  # tags and descriptions are per thread
            self.sc.setJobDescription(description)
            try:
                df.toArrow()
            except BaseException as exc:
                self.error = exc
                self.stop.kill()
            finally:
                self.sc.removeJobTag(self.tag)
                self.sc.setJobDescription(None)

        self.thread = threading.Thread(target=run, name="tandem-spark-job", daemon=True)
        self.thread.start()

    def failure(self, job: str) -> TandemError | None:
        """Why the Spark job failed, if it did: Spark's reason (a task that failed too
        often, and its last failure), not the Py4J call's stack; the whole of it at
        debug level."""
        if self.error is None:
            return None
        log.debug("the Spark job of %r failed: %s", job, self.error)
        return TandemError(f"the Spark job of {job!r} failed: {spark_reason(self.error)}")

    def end(self, cancel: bool) -> None:
        """Wait for the job to end (``cancel``: cancel it first); cancel it anyway if a
        task still runs ``END_GRACE_S`` after the last report."""
        if self.thread is None:
            return
        if not cancel:
            self.thread.join(END_GRACE_S)
        if self.thread.is_alive():
            if not cancel:
                log.info(
                    "every report is in, but the Spark job still runs a task (a worker lost "
                    "and fenced, cut off from the driver): cancelled"
                )
            self.sc.cancelJobsWithTag(self.tag)
            self.thread.join(END_WAIT_S)
            if self.thread.is_alive():  # its task is on an executor the driver cannot reach
                log.warning(
                    "the cancelled Spark job has not ended %g s later (a task on an executor "
                    "cut off from the driver); the run's result does not wait for it",
                    END_WAIT_S,
                )


SPARK_REASONS = ("Job aborted due to stage failure:", "cancelled", "SparkException:")
"""What starts the line of a failed Spark job's error that says why, most telling first."""


def spark_reason(error: BaseException, most: int = 12) -> str:
    """What of a failed Spark job's ``error`` says why: the line that does — for a job
    aborted, which task failed how often and its last failure, found deep in the Java
    stack — and the lines after it up to the next stack frame (a Python worker's
    traceback), ``most`` at most; the first line of the error when no line says why."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for reason in SPARK_REASONS:
        for i, line in enumerate(lines):
            at = line.find(reason)
            if at < 0 or line.startswith("at "):
                continue
            if reason == "SparkException:" and "awaitResult" in line:
                continue  # the Py4J call's wrapper, not the reason
            said = [line[at:] if reason.startswith("Job") else line]
            for more in lines[i + 1 : i + most]:
                if more.startswith(("at ", "Caused by:", "Driver stacktrace:")):
                    break
                said.append(more)
            return "\n".join(said)
    return lines[0] if lines else type(error).__name__


class _Rebuilds:
    """Worker tasks started again in a Spark job of their own, each on an executor
    running none of its replicas' twins — the registry's ``relaunch``, for a worker lost
    with its executor whose task Spark retried beside the twins, or fenced where it could
    not be killed (cut off from the driver: no retry comes). ``job(slot,
    executor)``: the DataFrame of that one task."""

    def __init__(self, spark, tag: str) -> None:
        self.spark, self.tag = spark, tag
        self.job = None
        self._threads: list[threading.Thread] = []
        self._closed = threading.Event()

    def __call__(self, slot: int, avoid: set[str]) -> None:
        t = threading.Thread(
            target=self._run, args=(slot, avoid), name=f"tandem-relaunch-{slot}", daemon=True
        )
        t.start()
        self._threads.append(t)

    def _run(self, slot: int, avoid: set[str]) -> None:
        # The lost executor's replacement registers seconds after the crash.
        deadline = time.monotonic() + REJOIN_TIMEOUT_S
        while not (free := _free_first(self.spark, avoid)):
            if time.monotonic() > deadline or self._closed.wait(0.2):
                log.warning(
                    "placement row %d is not started again: no executor without twins of "
                    "its replicas registered within %.0f s",
                    slot,
                    REJOIN_TIMEOUT_S,
                )
                return
        log.info("placement row %d: started again on executor %s", slot, free[0][0])
        sc = self.spark.sparkContext
        sc.addJobTag(self.tag)  # cancelled with the run
        sc.setJobDescription(f"tandem: placement row {slot} again, on executor {free[0][0]}")
        try:
            self.job(slot, free[0]).toArrow()  # no rows: its reports reach the registry
        except Exception as exc:  # its replicas stay lost; the registry logged why
            log.warning("the Spark job running placement row %d again failed: %s", slot, exc)
        finally:
            sc.removeJobTag(self.tag)
            sc.setJobDescription(None)

    def warm(self, plan: Plan, zoo, busy: set[str]) -> None:
        """Run one tiny Python task on every executor running no worker (``busy``: those
        that do), once the run's workers are up, so that a rebuild placed there later
        finds the executor's Python daemon started and its ``mapInArrow`` path loaded,
        and starts in 1-4 s rather than 5-8 s (17 s on a loaded two-core cluster). The
        task unpickles the plan and imports what a worker does; with Python worker reuse
        off (required) the daemon is what stays, for the executor's life."""
        spares = [e for e in _executors(self.spark) if e[0] not in busy]
        if not spares or LOCAL_MASTER.match(self.spark.sparkContext.master):
            return
        df = _located(self.spark, list(enumerate(spares))).mapInArrow(
            _warm_main(plan, zoo is not None), _spark_schema(OUTPUT)
        )

        def run() -> None:
            sc = self.spark.sparkContext
            sc.addJobTag(self.tag)  # cancelled with the run
            sc.setJobDescription(f"tandem: Python started on {len(spares)} spare executors")
            try:
                df.toArrow()
                log.debug("Python started on spare executors %s", [e for e, _ in spares])
            except Exception as exc:  # it only saves time: a rebuild there starts cold
                if not self._closed.is_set():
                    log.info("spare executors not warmed: %s", exc)
            finally:
                sc.removeJobTag(self.tag)
                sc.setJobDescription(None)

        t = threading.Thread(target=run, name="tandem-warm-spares", daemon=True)
        t.start()
        self._threads.append(t)

    def close(self, cancel: bool) -> None:
        """Start no more jobs and wait for those running (``cancel``: cancel them first)."""
        self._closed.set()
        if cancel:
            self.spark.sparkContext.cancelJobsWithTag(self.tag)
        for t in self._threads:
            t.join()


def _located(spark, located: list[tuple[int, tuple[str, str]]]):
    """A DataFrame of one ``id`` column, row ``i`` alone in Spark partition ``i`` and
    preferring its executor: ``located`` = [(id, (executor, host)), ...]."""
    from pyspark.sql import DataFrame
    from pyspark.sql import functions as F

    jvm = spark.sparkContext._jvm
    utils = jvm.org.apache.spark.api.python.PythonUtils
    rows = jvm.java.util.ArrayList()
    for w, (executor, host) in located:
        where = jvm.java.util.ArrayList()
        where.add(f"executor_{host}_{executor}")  # Spark's TaskLocation syntax
        rows.add(jvm.scala.Tuple2(str(w), utils.toSeq(where)))
    strings = jvm.scala.reflect.ClassTag.apply(jvm.java.lang.Class.forName("java.lang.String"))
    rdd = spark.sparkContext._jsc.sc().makeRDD(utils.toSeq(rows), strings)
    ds = spark._jsparkSession.createDataset(rdd, jvm.org.apache.spark.sql.Encoders.STRING())
    return DataFrame(ds.toDF(), spark).select(F.col("value").cast("long").alias("id"))


def _free_first(spark, avoid: set[str]) -> list[tuple[str, str]]:
    """The live executors whose id is not in ``avoid``, those with a free task slot first
    (a task placed on a full executor waits there for ``spark.locality.wait``)."""
    store = spark.sparkContext._jsc.sc().statusStore()
    found = store.executorList(True)
    busy = {}
    for i in range(found.size()):
        e = found.apply(i)
        busy[str(e.id())] = e.activeTasks() >= e.totalCores()
    return sorted(
        (e for e in _executors(spark) if e[0] not in avoid), key=lambda e: busy.get(e[0], True)
    )


def _executors(spark) -> list[tuple[str, str]]:
    """The live executors of ``spark`` other than the driver, as (id, host), by id."""
    found = spark.sparkContext._jsc.sc().statusStore().executorList(True)
    executors = []
    for i in range(found.size()):
        e = found.apply(i)
        if e.id() != "driver":
            executors.append((str(e.id()), str(e.hostPort()).rsplit(":", 1)[0]))
    return sorted(executors, key=lambda e: (len(e[0]), e[0]))


def _collect_sink(plan: Plan) -> Task | None:
    """The sink whose rows become the output DataFrame: the first ``Collect`` sink."""
    return next((t for t in plan.sinks() if isinstance(t.sink, Collect)), None)


def _spark_schema(schema: pa.Schema):
    from pyspark.sql.pandas.types import from_arrow_schema

    try:
        return from_arrow_schema(schema)
    except TypeError as exc:
        raise ConfigError(
            f"the Collect sink's rows cannot become a Spark DataFrame: {exc}; schema {schema}. "
            "Cast the column to a type Spark has (e.g. binary instead of fixed_size_binary) "
            "in the last operator"
        ) from exc


def _worker_main(plan, secret, registry_address, host, zoo, log_level):
    """The Arrow-backed UDF for ``mapInArrow``; everything it needs travels in its closure
    (cloudpickle), the job secret included. The worker logs to its executor's stderr (the
    driver's console on a local master) at the driver's ``log_level``, as ``tandem[worker
    N] LEVEL logger: message``. Its reports go to the driver through the registry (in
    its ``Done``); the task returns no rows."""

    def worker_main(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        rows = pa.Table.from_batches(list(batches))
        if rows.num_rows != 1:
            raise RuntimeError(f"a worker task got {rows.num_rows} placement rows, not 1")
        slot = rows.column(SLOT)[0].as_py()
        bind_host = host or _own_address()
        attempt = TaskContext.get().attemptNumber()
        with reg.register(registry_address, secret, slot, attempt, bind_host) as conn:
            answer = expect(
                reg.receive(conn, "worker identity"), Assign, Retire, what="after checking in"
            )
            if isinstance(answer, Retire):
                return
            logs.configure_worker(answer.worker, log_level)
            serve(
                plan,
                [tuple(rid) for rid in answer.replicas],
                secret,
                conn,
                zoo,
                answer.rejoin,
                host=bind_host,
                receive=lambda what: reg.receive(conn, what),
                sigterm=False,
            )
        yield from ()

    return worker_main


def _warm_main(plan, kazoo_clients: bool):
    """The ``mapInArrow`` function of :meth:`_Rebuilds.warm`: it returns no rows; what it
    is for is what unpickling it and running it import in the executor's Python worker
    (the plan's modules, this module and the worker's, pulled in by reference)."""

    def warm(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import tandem.engines.worker  # noqa: F401

        if kazoo_clients:
            import confluent_kafka  # noqa: F401
            import kazoo.client  # noqa: F401
        for _ in batches:
            pass
        assert plan is not None and serve is not None and reg.register is not None
        yield from ()

    return warm


def _own_address() -> str:
    """This executor's address as peers on other nodes reach it."""
    import socket

    return os.environ.get("SPARK_LOCAL_IP") or socket.gethostbyname(socket.gethostname())


class _driver_path_on_workers:
    """On a local master, let the Python workers import what the driver can (its
    ``sys.path``: a job file's folder, the tests, ...): the plan's functions are pickled by
    reference to their modules. A real cluster ships them with ``--py-files`` instead."""

    def __init__(self, sc, local: bool) -> None:
        self.sc, self.local = sc, local
        self.saved = sc.environment.get("PYTHONPATH")

    def __enter__(self) -> None:
        if self.local:
            paths = [p for p in sys.path if p] + ([self.saved] if self.saved else [])
            self.sc.environment["PYTHONPATH"] = os.pathsep.join(paths)

    def __exit__(self, *exc) -> None:
        if not self.local:
            return
        if self.saved is None:
            self.sc.environment.pop("PYTHONPATH", None)
        else:
            self.sc.environment["PYTHONPATH"] = self.saved
