"""Spark sessions fit for worker tasks, and the checks the engine makes before launch.

The engine runs every worker of a job — a process hosting many task replicas, see
:meth:`tandem.plan.Plan.placement` — as one Spark task for the whole run. Active
replication needs things from Spark that are not its defaults:

* **a slot per worker, plus spares.** A non-barrier job does not start its tasks
  together; the replicas of a job only make progress once all of them run, so a worker
  without a slot would leave the others waiting for ever. Spares leave room for Spark's
  retry of a killed task.
* **retries of the failed task only.** ``local[N,F]`` with ``F >= 2`` retries a task up to
  ``F - 1`` times and leaves the other tasks running (``local[N]`` fails the job at the
  first failure); barrier mode would restart every task, so it is never used.
* **no speculation, no dynamic allocation:** a speculative copy of a replica would be a
  third replica nobody asked for, and an executor removed for being "idle" would take
  replicas with it.
* **the driver's interpreter on the executors** (``PYSPARK_PYTHON``), with tandem
  installed, and **no Python worker reuse**: a worker task leaves its Python process when
  it ends, so no thread of a finished replica can outlive it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
import time

from tandem.exceptions import ConfigError
from tandem.plan import Plan

log = logging.getLogger("tandem")

LOCAL_MASTER = re.compile(r"^local(\[(?P<n>\d+|\*)(,(?P<f>\d+))?\])?$")
LOCAL_CLUSTER_MASTER = re.compile(r"^local-cluster\[(?P<w>\d+),\s*(?P<c>\d+),\s*(?P<m>\d+)\]$")

TASK_FAILURES = 8
"""``F`` of :func:`local_session`'s ``local[N,F]``: Spark fails the whole job once one task
has failed ``F`` times. A worker's task fails once for each loss of the worker, and once
more for each of its rebuilds given up and tried again from later cuts (up to
``tandem.engines.exchange.REJOIN_ATTEMPTS`` per loss): at 3 two losses of one worker, or
one on a busy machine, could use them up and end a run whose twins were masking it."""

EXECUTOR_WAIT_S = 60.0
"""How long the check waits for a new cluster's executors to register their cores."""

REQUIRED_CONF = {
    "spark.speculation": "false",
    "spark.dynamicAllocation.enabled": "false",
    "spark.python.worker.reuse": "false",
}


def local_session(workers, master: str | None = None, spare_slots: int = 2, **conf):
    """A SparkSession that can host ``workers`` worker tasks on this machine.

    ``workers``: how many (an int), or the job (a ``td.Job`` or its ``Plan``) whose
    workers (:meth:`tandem.plan.Plan.placement`) the session must host. Without ``master``
    it is ``local[N,F]`` with ``N = workers + spare_slots`` task slots (threads of one JVM)
    and ``F =`` :data:`TASK_FAILURES` (a failed task is retried while the others keep
    running, until it has failed ``F`` times). ``master`` may
    also be ``local-cluster[W,C,MB]`` (W executor JVMs of C cores each) or a cluster URL.
    ``conf`` entries are passed to the builder (``spark.`` prefix and all); the Spark UI
    is off unless ``conf`` turns it on. Spark's warning for each lost task attempt (with
    the Java stack trace of a Python worker that exited) is off too: a lost worker is
    tandem's to report, and does (:func:`quiet_lost_tasks`).
    """
    workers = worker_count(workers)
    master = master or f"local[{workers + spare_slots},{TASK_FAILURES}]"
    # Workers start the interpreter named by PYSPARK_PYTHON (or `python3` from PATH).
    os.environ["PYSPARK_PYTHON"] = sys.executable
    if is_local(master):  # every JVM of the session listens on loopback only
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(master).appName("tandem")
    settings = {
        **REQUIRED_CONF,
        "spark.pyspark.python": sys.executable,
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        # Spark's cleaner removes a finished job's broadcasts from every executor, waiting
        # for each (spark.rpc.askTimeout, 120 s) when blocking; one on a host cut off from
        # the driver — a fault tandem masks — then holds spark.stop(), which joins it.
        "spark.cleaner.referenceTracking.blocking": "false",
        **conf,
    }
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    quiet_lost_tasks(spark)
    return spark


def quiet_lost_tasks(spark) -> None:
    """Quiet what Spark logs, in this JVM, for each task whose Python worker exited: the
    ``TaskSetManager``'s warning (``Lost task ...``) and, in local mode, where the
    executor is this JVM, the ``Executor``'s error (``Exception in task ...``), each with
    a Java stack trace — for a worker SIGKILLed on purpose too. The coordinator logs
    every loss, masked or not, in one line, and a task's own error reaches the job as
    its failure. A job Spark aborts is still logged (``DAGScheduler``, at ERROR)."""
    try:
        jvm = spark.sparkContext._jvm
        levels = jvm.org.apache.logging.log4j.Level
        configurator = jvm.org.apache.logging.log4j.core.config.Configurator
        configurator.setLevel("org.apache.spark.scheduler.TaskSetManager", levels.ERROR)
        configurator.setLevel("org.apache.spark.executor.Executor", levels.FATAL)
    except Exception as exc:  # another logging backend: leave Spark's logging as it is
        log.debug("cannot quiet Spark's lost-task warnings: %s", exc)


def worker_count(workers) -> int:
    """The number of worker tasks of ``workers``: an int, a ``td.Job`` or a ``Plan``."""
    if hasattr(workers, "plan") and callable(workers.plan):  # a td.Job
        workers = workers.plan()
    if isinstance(workers, Plan):
        return len(workers.placement())
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"workers must be an int >= 1, a td.Job or a Plan; got {workers!r}")
    return workers


def is_local(master: str) -> bool:
    """Whether every executor of ``master`` runs on this machine (so the driver can see,
    and kill, their processes)."""
    return bool(LOCAL_MASTER.match(master) or LOCAL_CLUSTER_MASTER.match(master))


def task_slots(spark) -> int:
    """Tasks the cluster can run at once: the executors' cores over ``spark.task.cpus``."""
    sc = spark.sparkContext
    cpus = int(sc.getConf().get("spark.task.cpus", "1"))
    return sc.defaultParallelism // cpus


def check_cluster(spark, workers: int, spare_slots: int) -> None:
    """Raise ConfigError unless ``spark`` can host ``workers`` worker tasks at once, with
    ``spare_slots`` to spare, and is configured as the module documentation says. On a
    cluster master it first waits (up to EXECUTOR_WAIT_S) for enough executor cores — on
    ``local-cluster[W,C,MB]`` for all W executors, so that the workers of different
    replica groups can be spread over them."""
    sc = spark.sparkContext
    conf = sc.getConf()
    master = sc.master
    for key, want in REQUIRED_CONF.items():
        got = conf.get(key, "true" if key == "spark.python.worker.reuse" else "false")
        if got.lower() != want:
            raise ConfigError(
                f"the Spark engine needs {key}={want}, but the session has {key}={got}; "
                f"create the session with .config({key!r}, {want!r}) or with "
                "tandem_spark.local_session(...)"
            )
    needed = workers + spare_slots
    wanted = needed
    if m := LOCAL_CLUSTER_MASTER.match(master):
        wanted = max(needed, int(m["w"]) * int(m["c"]) // int(conf.get("spark.task.cpus", "1")))
    slots = task_slots(spark)
    deadline = time.monotonic() + EXECUTOR_WAIT_S
    while slots < wanted and not LOCAL_MASTER.match(master) and time.monotonic() < deadline:
        time.sleep(0.2)  # executors of a new session register one by one
        slots = task_slots(spark)
    if slots < needed:
        if LOCAL_MASTER.match(master):
            fix = (
                f"use master local[{needed},{TASK_FAILURES}] "
                f"(or tandem_spark.local_session({workers}))"
            )
        elif LOCAL_CLUSTER_MASTER.match(master):
            fix = f"use master local-cluster[W,C,MB] with W x C >= {needed}"
        else:
            fix = "add executors or cores (spark.executor.instances, spark.executor.cores)"
        raise ConfigError(
            f"the job runs {workers} workers and each needs a Spark task slot for the whole "
            f"run, plus {spare_slots} spare for retries: {needed} slots, but master {master!r} "
            f"offers {slots}; {fix}"
        )
    m = LOCAL_MASTER.match(master)
    if m and int(m["f"] or 1) < 2:
        raise ConfigError(
            f"master {master!r} fails the whole job at the first task failure, so a killed "
            f"worker would stop the run; use local[{m['n'] or needed},{TASK_FAILURES}] (the "
            "second number is how many times a task may fail)"
        )
    if is_local(master):
        python = shutil.which(sc.pythonExec) or sc.pythonExec
        if os.path.abspath(python) != sys.executable:
            raise ConfigError(
                f"Spark's Python workers run {sc.pythonExec!r} but this driver runs "
                f"{sys.executable!r}; set PYSPARK_PYTHON={sys.executable} before creating the "
                "session (tandem_spark.local_session does)"
            )
