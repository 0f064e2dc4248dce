"""The ``tandem`` command line: ``tandem demo``, ``tandem run path/to/job.py`` (each on the
local or the Spark engine), ``tandem bench`` (the paper's experiments, and ``cost``: what
replication costs the machine) and ``tandem heartbeats`` (a heartbeat generator for jobs
reading Kafka)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
from pathlib import Path

import tandem
from tandem import engines, heartbeat

KILL_RE = re.compile(
    r"^(?P<task>[^:@]+):(?P<partition>\d+):(?P<replica>\d+|leader|follower)"
    r"@(?P<at>\d+(\.\d*)?)$"
)


def _log_level(value: str) -> int:
    try:
        return tandem.logs.parse_level(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def configure_logging(verbose: int = 0, log_level: int | str | None = None) -> int:
    """Log to stderr at the level ``-v``/``--log-level`` ask for (else
    ``$TANDEM_LOG_LEVEL``, else WARNING): tandem's own loggers at that level, other
    libraries' at WARNING; worker processes inherit it through ``$TANDEM_LOG_LEVEL``.
    Returns the level."""
    if log_level is None and not verbose:
        log_level = os.environ.get(tandem.logs.LEVEL_ENV) or None
    try:
        level = tandem.logs.cli_level(verbose, log_level)
    except ValueError:  # a bad $TANDEM_LOG_LEVEL: the default
        level = logging.WARNING
    logging.basicConfig(level=logging.WARNING, format="tandem: %(levelname)s %(message)s")
    logging.getLogger("tandem").setLevel(level)
    os.environ[tandem.logs.LEVEL_ENV] = logging.getLevelName(level)
    tandem.logs.sync_level()
    return level


def parse_kill(spec: str) -> tandem.Kill:
    """``TASK:PARTITION:REPLICA@SECONDS`` → ``td.Kill``."""
    m = KILL_RE.match(spec)
    if not m:
        raise argparse.ArgumentTypeError(
            f"--kill {spec!r}: expected TASK:PARTITION:REPLICA@SECONDS, e.g. count:0:1@10, "
            "or 'none'"
        )
    replica = m["replica"]
    return tandem.Kill(
        m["task"],
        partition=int(m["partition"]),
        replica=replica if replica in ("leader", "follower") else int(replica),
        at=float(m["at"]),
    )


def _add_run_flags(p: argparse.ArgumentParser, demo: bool) -> None:
    p.add_argument(
        "--engine",
        default=engines.DEFAULT,
        metavar="NAME",
        help=f"the engine to run on (installed: {', '.join(engines.available())}; "
        f"default {engines.DEFAULT})",
    )
    p.add_argument(
        "--master",
        metavar="URL",
        help="Spark master for --engine spark (default: local[N,3], N = workers + spares)",
    )
    p.add_argument("--duration", type=float, default=20.0 if demo else None, metavar="S")
    p.add_argument(
        "--kill",
        action="append",
        metavar="TASK:PARTITION:REPLICA@SECONDS",
        help="SIGKILL a replica (repeatable); 'none' for a fault-free run",
    )
    p.add_argument("--warmup", type=float, default=0.0, metavar="S")
    p.add_argument("--json", metavar="PATH", help="write the result as JSON")
    p.add_argument("--plot", metavar="PATH", help="write per-second p99 latency as a PNG")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics of every worker on 127.0.0.1:PORT while the job runs "
        "(local engine; 0: a free port)",
    )


def _faults(args, default: list) -> list:
    if not args.kill:
        return default
    if args.kill == ["none"]:
        return []
    return [parse_kill(k) for k in args.kill]


def _demo(args: argparse.Namespace) -> int:
    from tandem import demo

    with _kazoo_services(args.ordering == "kazoo", args.session_timeout) as kazoo:
        return _demo_job(args, demo, kazoo)


@contextlib.contextmanager
def _kazoo_services(needed: bool, session_timeout: float):
    """The KazooConfig of the local ZooKeeper and Kafka (None if not ``needed``), started
    for the command if they are not running, and stopped again afterwards if so."""
    if not needed:
        yield None
        return
    from tandem._services import ensure_running

    print("KaZoo needs ZooKeeper and Kafka: starting what is not running ...", flush=True)
    services = ensure_running()
    try:
        yield tandem.KazooConfig(
            zk_hosts=services.zk_hosts,
            kafka_bootstrap=services.kafka_bootstrap,
            session_timeout_s=session_timeout,
        )
    finally:
        if services.started:
            started = services.started  # stop() empties it
            services.stop()
            print(
                f"stopped {', '.join(started)} (started for this command; "
                "`make services` keeps them running between runs)"
            )


def _demo_job(args: argparse.Namespace, demo, kazoo) -> int:
    job = demo.build(
        rate=args.rate,
        replication=args.replication,
        ordering=args.ordering,
        heartbeat_ms=args.heartbeat_ms,
        buffer_timeout_ms=args.buffer_timeout_ms,
        kazoo=kazoo,
        restore=args.restore or args.chaos is not None,
    )
    victim = "leader" if args.ordering == "kazoo" else 0
    default = [tandem.Kill("count", partition=0, replica=victim, at=args.duration / 2)]
    if args.chaos is not None:
        default = [tandem.Chaos(at=2.0, every_s=(5.0, 10.0), seed=args.chaos)]
    faults = _faults(args, default if args.replication > 1 else [])
    print(
        f"tandem {tandem.__version__} ({tandem.build_profile} build) demo: "
        f"source → enrich → count (keyed, stateful) → alert → sink, 2 partitions each, "
        f"replication {args.replication}, {args.ordering}, {args.rate} ev/s for "
        f"{args.duration:g} s"
    )
    for f in faults:
        if isinstance(f, tandem.Chaos):
            low, high = f.every_s
            print(
                f"  chaos: SIGKILL a random worker every {low:g}-{high:g} s from {f.at:g} s, "
                "each once every partition is back at full replication"
            )
        else:
            print(f"  fault: SIGKILL {f.task}[{f.partition}] replica {f.replica} at {f.at:g} s")
    if kazoo is not None:
        print(
            f"  KaZoo: ZooKeeper {kazoo.zk_hosts}, Kafka {kazoo.kafka_bootstrap}, session "
            f"timeout {kazoo.session_timeout_s:g} s"
        )
    return _run_and_report(job, args, faults, plot_path=args.plot or "out/demo_p99.png")


def _run_file(args: argparse.Namespace) -> int:
    """``tandem run job.py``: run the script as ``__main__`` (as ``python job.py`` would,
    so it needs no ``if __name__ == "__main__":`` guard and its functions travel to the
    workers by value; its folder is on ``sys.path`` for the modules beside it). A script
    that runs its jobs itself (``job.run()``) gets their summaries printed; otherwise its
    module-level ``job`` is run here: for ``--duration`` (else a module-level ``duration``)
    seconds, or until Ctrl-C/SIGTERM when neither is given (bounded sources end it by
    themselves), with ``--kill`` (else a module-level ``faults``)."""
    import runpy
    import signal

    path = Path(args.path).resolve()
    if not path.is_file():
        raise tandem.ConfigError(f"tandem run: no such file {str(path)!r}")
    if args.duration is not None and args.duration <= 0:
        raise tandem.ConfigError(f"--duration must be > 0 seconds, got {args.duration}")
    sys.path.insert(0, str(path.parent))
    runs: list[tuple[tandem.Job, tandem.Result]] = []

    def interrupt(_signo, _frame) -> None:  # SIGTERM outside a run: as Ctrl-C
        raise KeyboardInterrupt

    def observe(job: tandem.Job, result: tandem.Result) -> None:
        runs.append((job, result))

    tandem.api.RUN_OBSERVERS.append(observe)
    previous = signal.signal(signal.SIGTERM, interrupt)
    if args.metrics_port is not None and args.engine == "local":
        # The runs the script makes itself serve them too.
        tandem.api.LOCAL_DEFAULTS["metrics_port"] = args.metrics_port
    try:
        namespace = runpy.run_path(str(path), run_name="__main__")
        if runs:
            return _report_script_runs(runs, args)
        job = namespace.get("job")
        if not isinstance(job, tandem.Job):
            jobs = [v for v in namespace.values() if isinstance(v, tandem.Job)]
            if len(jobs) != 1:
                raise tandem.ConfigError(
                    f"tandem run: {path.name} must define a module-level `job = td.Job(...)` "
                    f"(found {type(job).__name__}), or run its job itself (job.run())"
                )
            job = jobs[0]
        if args.duration is None:
            args.duration = namespace.get("duration")
        faults = _faults(args, list(namespace.get("faults", [])))
        return _run_and_report(job, args, faults, plot_path=args.plot)
    finally:
        signal.signal(signal.SIGTERM, previous)
        tandem.api.RUN_OBSERVERS.remove(observe)
        tandem.api.LOCAL_DEFAULTS.pop("metrics_port", None)


def _report_script_runs(runs: list, args: argparse.Namespace) -> int:
    """The summary of every run a script made itself; 0 if each one's output checked."""
    given = [
        flag
        for flag, value in (("--duration", args.duration), ("--kill", args.kill))
        if value is not None
    ]
    if given:
        print(
            f"tandem run: {', '.join(given)} not applied: the script runs its jobs itself, "
            "with the arguments of its job.run() calls",
            file=sys.stderr,
        )
    for job, result in runs:
        print(f"\njob {job.name!r}:", end="")
        print_summary(result)
    if args.json:
        _write_result(args.json, runs[-1][1])
    return 0 if all(_checked(result) for _, result in runs) else 1


def _checked(result: tandem.Result) -> bool:
    """Nothing lost, nothing duplicated (or not checked: --no-check), replicas agreed."""
    return result.lost in (0, None) and result.duplicates in (0, None) and result.digests_match


def _write_result(path: str, result: tandem.Result) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(result.to_json())
    print(f"wrote {path}")


def _run_and_report(job: tandem.Job, args, faults: list, plot_path: str | None) -> int:
    """Run ``job`` as the flags say (``args.duration`` None: until Ctrl-C/SIGTERM, or the
    end of its bounded sources), print the summary; 0 if its output checked."""
    if args.duration is not None and args.duration <= 0:
        raise tandem.ConfigError(f"--duration must be > 0 seconds, got {args.duration}")
    if args.master and args.engine != "spark":
        raise tandem.ConfigError(f"--master is for --engine spark, not --engine {args.engine}")
    options = {"master": args.master} if args.master else {}
    run_options: dict = {"check": False} if getattr(args, "no_check", False) else {}
    if args.metrics_port is not None:
        if args.engine != "local":
            raise tandem.ConfigError(
                f"--metrics-port is served by the local engine, not --engine {args.engine}"
            )
        run_options["metrics_port"] = args.metrics_port
        if args.metrics_port:
            print(f"  metrics: http://127.0.0.1:{args.metrics_port}/metrics")
    if args.duration is None:
        print(
            f"running job {job.name!r} until stopped (Ctrl-C or SIGTERM stops it and drains "
            "what is in flight; bounded sources end it by themselves)",
            flush=True,
        )
    result = job.run(
        duration=args.duration,
        faults=faults,
        engine=engines.get(args.engine, **options),
        warmup=args.warmup,
        progress=not args.no_progress,
        **run_options,
    )
    print_summary(result)
    if args.json:
        _write_result(args.json, result)
    if plot_path and result.per_second_p99_ms:
        from tandem import demo

        Path(plot_path).parent.mkdir(parents=True, exist_ok=True)
        try:
            demo.plot(result, plot_path, title=job.name)
            print(f"wrote {plot_path}")
        except ImportError:
            print("(no plot: matplotlib is not installed; pip install 'tandem-stream[plot]')")
    return 0 if _checked(result) else 1


def _fmt(v, unit: str = "") -> str:
    return "-" if v is None else (f"{v:.1f}{unit}" if isinstance(v, float) else f"{v}{unit}")


def _lost_replicas(lost: list[dict]) -> str:
    """Each lost replica, or, when there are many (repeated kills), how many per cause."""
    if len(lost) <= 8:
        names = [f"{x['task']}[{x['partition']}] r{x['replica']} ({x['cause']})" for x in lost]
        return ", ".join(names) or "none"
    causes: dict[str, int] = {}
    for x in lost:
        causes[x["cause"]] = causes.get(x["cause"], 0) + 1
    return f"{len(lost)}: " + ", ".join(f"{n} {cause}" for cause, n in sorted(causes.items()))


def print_summary(r: tandem.Result) -> None:
    rows = [
        ("source time", _fmt(r.duration_s, " s")),
        ("events in / out", f"{r.events_in} / {r.events_out}"),
        ("lost", _fmt(r.lost)),
        ("duplicates", _fmt(r.duplicates)),
        ("latency p50 / p99 / max", f"{_fmt(r.p50_ms)} / {_fmt(r.p99_ms)} / {_fmt(r.max_ms)} ms"),
        ("max gap between outputs", _fmt(r.max_gap_ms, " ms")),
        ("replica digests", "match" if r.digests_match else "DIFFER"),
        ("lost replicas", _lost_replicas(r.lost_replicas)),
    ]
    if r.restored_replicas:
        by_loss: dict[float, list[dict]] = {}
        for x in r.restored_replicas:
            by_loss.setdefault(x["lost_s"], []).append(x)
        rows.append(
            (
                "replicas rebuilt",
                "; ".join(
                    f"{len(xs)} lost at {lost:.1f} s, back at {xs[0]['restored_s']:.1f} s "
                    f"({xs[0]['restore_ms']:.0f} ms)"
                    for lost, xs in sorted(by_loss.items())
                ),
            )
        )
    width = max(len(k) for k, _ in rows)
    print()
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    for name, terms in r.leaders.items():
        led = ", ".join(
            f"r{t['replica']} (epoch {t['epoch']}, from {t['from_s']:.2f} s)" for t in terms
        )
        print(f"  leaders of {name}: {led}")
    for e in r.determinism_errors:
        print(f"  DeterminismError: {e}")
    masked = r.lost == 0 and r.duplicates == 0 and r.digests_match
    if r.faults:
        print("\n  " + ("fault masked." if masked else "fault NOT masked."))


COST_ONLY_FLAGS = ("quick", "idle_rate", "idle_duration", "workloads", "busy_neighbour")

COST_DEFAULTS = {
    "rate": 5_000,
    "duration": 15.0,
    "warmup": 5.0,
    "idle_rate": 10,
    "idle_duration": 10.0,
}
COST_QUICK = {"rate": 1_000, "duration": 3.0, "warmup": 1.0, "idle_rate": 10, "idle_duration": 3.0}
"""``tandem bench cost`` and ``tandem bench cost --quick`` (short runs, for CI: 16 runs of
3 s, about 3 minutes on 2 cores, mostly process start-up); flags given explicitly win over
both."""


def _bench(args: argparse.Namespace) -> int:
    from tandem import bench

    if args.experiment == "kafka":
        return _bench_kafka(args)
    if args.rounds is not None:
        raise tandem.ConfigError(
            f"--rounds: for `tandem bench kafka` only, not `tandem bench {args.experiment}`"
        )
    if args.experiment == "paper":
        return _bench_paper(args)
    if args.experiment == "recovery":
        return _bench_recovery(args)
    given = [f"--{f}" for f in PAPER_ONLY_FLAGS if getattr(args, f) is not None]
    if given:
        where = "paper` or `tandem bench recovery" if given == ["--experiments"] else "paper"
        raise tandem.ConfigError(
            f"{', '.join(given)}: for `tandem bench {where}` only, not `tandem bench "
            f"{args.experiment}`"
        )
    if args.experiment == "cost":
        return _bench_cost(args, bench)
    given = [
        f"--{f.replace('_', '-')}" for f in COST_ONLY_FLAGS if getattr(args, f) not in (None, False)
    ]
    if given:
        where = (
            "cost`, `tandem bench paper` or `tandem bench recovery"
            if given == ["--quick"]
            else "cost"
        )
        raise tandem.ConfigError(
            f"{', '.join(given)}: for `tandem bench {where}` only, not `tandem bench "
            f"{args.experiment}`"
        )
    args.rate = 5_000 if args.rate is None else args.rate
    args.warmup = 30.0 if args.warmup is None else args.warmup
    args.measure = 30.0 if args.measure is None else args.measure
    if args.experiment == "spark":
        # An engine package's own benchmark, found through its entry point.
        spark_bench = engines.load(engines.BENCHMARK_GROUP, "spark", "benchmark")
        out = spark_bench.run(
            rate=args.rate, warmup=args.warmup, measure=args.measure, master=args.master
        )
        print(spark_bench.table(out))
        _write_json(args.json, out)
        return 0
    configs = tuple(args.configs.split(",")) if args.configs else tuple(bench.CONFIGS)
    unknown = sorted(set(configs) - set(bench.CONFIGS))
    if unknown:
        raise tandem.ConfigError(
            f"--configs: unknown {unknown}; choose from {', '.join(bench.CONFIGS)}"
        )
    needed = args.experiment == "failover" or (args.experiment == "mib1" and "kazoo" in configs)
    with _kazoo_services(needed, args.session_timeout) as kazoo:
        return _bench_run(args, bench, configs, kazoo)


def _bench_run(args: argparse.Namespace, bench, configs: tuple, kazoo) -> int:

    if args.experiment == "mib1":
        lengths = [int(x) for x in args.lengths.split(",")]
        rows = bench.mib1(
            lengths=lengths,
            configs=configs,
            rate=args.rate,
            warmup=args.warmup,
            measure=args.measure,
            kazoo=kazoo,
        )
        out = {
            "experiment": "mib1",
            "rows": [vars(r) for r in rows],
            "paper_liverobin_ms": bench.PAPER_LIVEROBIN,
        }
    elif args.experiment == "failover":
        duration = args.duration or 100.0
        kill_at = duration / 2
        rows = bench.failover(rate=args.rate, duration=duration, kill_at=kill_at, kazoo=kazoo)
        out = {
            "experiment": "failover",
            "rate": args.rate,
            "duration_s": duration,
            "kill_at_s": kill_at,
            "session_timeout_s": args.session_timeout,
            "rows": [vars(r) for r in rows],
            "paper_kazoo_leader_peak_ms": bench.PAPER_KAZOO_LEADER_PEAK_MS,
        }
        plot = Path(args.plot or "out/failover_p99.png")
        plot.parent.mkdir(parents=True, exist_ok=True)
        try:
            bench.plot_failover(rows, kill_at, str(plot))
            print(f"wrote {plot}")
        except ImportError:
            print("(no plot: matplotlib is not installed; pip install 'tandem-stream[plot]')")
        rows = [{k: v for k, v in vars(r).items() if k != "per_second_p99_ms"} for r in rows]
    else:
        best, rows = bench.throughput(duration=args.measure)
        out = {
            "experiment": "throughput",
            "max_sustained_ev_per_s": best,
            "rows": [vars(r) for r in rows],
        }
        print(f"highest sustained rate (r=2, liverobin, length 1): {best} ev/s")
    print(bench.table(rows))
    _write_json(args.json, out)
    return 0


def _bench_cost(args: argparse.Namespace, bench) -> int:
    defaults = COST_QUICK if args.quick else COST_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    configs = tuple(args.configs.split(",")) if args.configs else tuple(bench.COST_CONFIGS)
    workloads = tuple(args.workloads.split(",")) if args.workloads else bench.COST_WORKLOADS
    # Every option checked before the services start or anything runs.
    bench.check_cost_options(
        configs,
        workloads,
        args.rate,
        args.duration,
        args.warmup,
        args.idle_rate,
        args.idle_duration,
    )
    print(
        f"tandem {tandem.__version__} ({tandem.build_profile} build) bench cost: "
        f"{', '.join(workloads)} x {', '.join(configs)}; {args.rate} ev/s for "
        f"{args.duration:g} s (warm-up {args.warmup:g} s), then {args.idle_rate} ev/s for "
        f"{args.idle_duration:g} s"
        + (", beside a process spinning on one core" if args.busy_neighbour else ""),
        flush=True,
    )
    if tandem.build_profile != "release":
        print("warning: a debug build: its costs say nothing about a release build", flush=True)
    with _kazoo_services("r2-kazoo" in configs, args.session_timeout) as kazoo:
        rows = bench.cost(
            configs=configs,
            workloads=workloads,
            rate=args.rate,
            duration=args.duration,
            warmup=args.warmup,
            idle_rate=args.idle_rate,
            idle_duration=args.idle_duration,
            kazoo=kazoo,
            busy_neighbour=args.busy_neighbour,
        )
    print()
    print(bench.cost_markdown(rows))
    out = {
        "experiment": "cost",
        "tandem": tandem.__version__,
        "build": tandem.build_profile,
        "cpus": os.cpu_count(),
        "settings": {
            "rate": args.rate,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "idle_rate": args.idle_rate,
            "idle_duration_s": args.idle_duration,
            "session_timeout_s": args.session_timeout,
            "busy_neighbour": args.busy_neighbour,
        },
        "targets": bench.COST_TARGETS,
        "rows": [vars(r) for r in rows],
        "checks": bench.cost_targets(rows),
    }
    _write_json(args.json, out)
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        try:
            bench.plot_cost(rows, args.plot)
            print(f"wrote {args.plot}")
        except ImportError:
            print("(no plot: matplotlib is not installed; pip install 'tandem-stream[plot]')")
    return 0


PAPER_ONLY_FLAGS = ("out", "experiments")


def _bench_paper(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from tandem import bench_paper

    _reject(
        args,
        ("json", "plot", "master"),
        "not for `tandem bench paper` (it writes JSON, Markdown and figures into --out DIR)",
    )
    settings = bench_paper.QUICK if args.quick else bench_paper.FULL
    if args.rate is not None:
        settings = replace(settings, rate=args.rate)
    if args.duration is not None:
        settings = replace(settings, duration_s=args.duration, fault_duration_s=2 * args.duration)
    if args.warmup is not None:
        settings = replace(
            settings, warmup_s=args.warmup, fault_warmup_s=args.warmup, spark_warmup_s=args.warmup
        )
    settings = replace(settings, session_timeout_s=args.session_timeout)
    experiments = _csv(args.experiments) or bench_paper.EXPERIMENTS
    configs = _csv(args.configs) or bench_paper.ALL_CONFIGS
    bench_paper.check_selection(experiments, configs)
    if not args.configs and "spark" not in engines.entry_points(engines.BENCHMARK_GROUP):
        # All by default: Spark Structured Streaming only where its package is installed.
        print(
            f"({bench_paper.SSS}: Spark Structured Streaming is not installed; left out. "
            "`pip install ./spark_integration` from a tandem checkout brings it)"
        )
        configs = tuple(c for c in configs if c != bench_paper.SSS)
    cases = bench_paper.cases(settings, experiments, configs)
    if not args.experiments:  # all by default: leave out those the configurations cannot run
        idle = [e for e in experiments if not any(c.experiment == e for c in cases)]
        if idle:
            print(f"({', '.join(idle)}: nothing to run with --configs {args.configs}; left out)")
            experiments = tuple(e for e in experiments if e not in idle)
    out_dir = args.out or "out/paper"
    command = _command(args, "paper", "quick", "experiments", "configs", "rate", "duration")
    command += _command(args, "", "warmup", "out")
    expected = sum(bench_paper.estimate_s(c) for c in cases)
    print(
        f"tandem {tandem.__version__} ({tandem.build_profile} build) bench paper"
        f"{' --quick' if args.quick else ''}: {', '.join(experiments)} x "
        f"{', '.join(configs)}; {len(cases)} runs, about {expected / 60:.0f} min; "
        f"writing to {out_dir}/",
        flush=True,
    )
    if tandem.build_profile != "release":
        print("warning: a debug build: its timings say nothing about a release build", flush=True)
    needed = "kazoo" in configs and any(c.config == "kazoo" for c in cases)
    with _kazoo_services(needed, args.session_timeout) as kazoo:
        doc = bench_paper.paper(
            settings, experiments, configs, out_dir=out_dir, kazoo=kazoo, command=command
        )
    print()
    print(Path(out_dir, "paper.md").read_text())
    print(f"wrote {out_dir}/paper.json, {out_dir}/paper.md", flush=True)
    return _report_written(doc)


def _reject(args: argparse.Namespace, flags: tuple[str, ...], why: str) -> None:
    """Raise ConfigError naming every flag given that this bench does not take: ``flags``
    and those of `tandem bench cost` only (``why`` says why)."""
    not_here = [
        f for f in COST_ONLY_FLAGS if f != "quick" and getattr(args, f) not in (None, False)
    ]
    not_here += [f for f in flags if getattr(args, f) is not None]
    if args.lengths != "1,2,3,4":
        not_here.append("lengths")
    if not_here:
        given = ", ".join(f"--{f.replace('_', '-')}" for f in not_here)
        raise tandem.ConfigError(f"{given}: {why}")


def _command(args: argparse.Namespace, experiment: str, *flags: str) -> str:
    """``tandem bench EXPERIMENT`` (nothing if empty) and the ``flags`` given, as typed."""
    out = f"tandem bench {experiment}" if experiment else ""
    for flag in flags:
        value = getattr(args, flag)
        if value is not None and value is not False:
            out += f" --{flag}" + ("" if value is True else f" {value}")
    return out


def _report_written(doc: dict) -> int:
    """Print the figures written and what failed; 1 if anything did, else 0."""
    for f in doc["figures"]:
        print(f"wrote {f}")
    if doc["failures"]:
        print("\nFAILED:", file=sys.stderr)
        for f in doc["failures"]:
            print(f"  {f}", file=sys.stderr)
        return 1
    return 0


def _bench_recovery(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from tandem import bench_recovery as br

    _reject(
        args,
        ("out", "master"),
        "not for `tandem bench recovery` (its options: --experiments, --sizes, --configs, "
        "--rate, --duration, --warmup, --session-timeout, --quick, --json, --plot)",
    )
    settings = (br.QUICK if args.quick else br.FULL).with_flags(
        args.rate, args.duration, args.warmup, args.session_timeout
    )
    if args.sizes:
        try:
            sizes = tuple(float(x) for x in _csv(args.sizes))
        except ValueError:
            sizes = ()
        if not sizes or min(sizes) <= 0:
            raise tandem.ConfigError(
                f"--sizes {args.sizes!r}: MiB of state per partition, positive numbers "
                "separated by commas (e.g. 1,10,100)"
            )
        settings = replace(settings, sizes=sizes)
    experiments = _csv(args.experiments) or br.EXPERIMENTS
    configs = _csv(args.configs) or br.FAULT_CONFIGS
    br.check_selection(experiments, configs)
    json_path = args.json or "out/recovery.json"
    plot_path = args.plot or "out/recovery_fault_p99.png"
    command = _command(args, "recovery", "quick", "experiments", "sizes", "configs", "rate")
    command += _command(args, "", "duration", "warmup", "json", "plot")
    parts = []
    if "restore" in experiments:
        parts.append(f"restore r with {', '.join(f'{mb:g}' for mb in settings.sizes)} MiB")
    if "fault" in experiments:
        parts.append(f"the fault experiment in {', '.join(configs)}")
    expected = br.estimate_s(settings, experiments, configs)
    about = f"{expected / 60:.0f} min" if expected >= 90 else f"{expected:.0f} s"
    print(
        f"tandem {tandem.__version__} ({tandem.build_profile} build) bench recovery: "
        f"{'; '.join(parts)}; about {about}",
        flush=True,
    )
    if tandem.build_profile != "release":
        print("warning: a debug build: its timings say nothing about a release build", flush=True)
    needed = "fault" in experiments and "kazoo" in configs
    with _kazoo_services(needed, args.session_timeout) as kazoo:
        doc = br.recovery(
            settings,
            experiments,
            configs,
            kazoo=kazoo,
            json_path=json_path,
            plot_path=plot_path,
            command=command,
        )
    print()
    print(doc["markdown"])
    print(f"wrote {json_path}", flush=True)
    return _report_written(doc)


def _bench_kafka(args: argparse.Namespace) -> int:
    from tandem import bench, bench_kafka

    _reject(
        args,
        ("out", "master", "configs", "experiments", "sizes", "duration", "plot"),
        "not for `tandem bench kafka` (its options: --rate, --warmup, --measure, --rounds, --json)",
    )
    if args.quick:
        raise tandem.ConfigError("--quick: not for `tandem bench kafka` (give --measure)")
    rate = bench_kafka.RATE if args.rate is None else args.rate
    warmup = 3.0 if args.warmup is None else args.warmup
    measure = 10.0 if args.measure is None else args.measure
    rounds = 1 if args.rounds is None else args.rounds
    bench_kafka.check_options(rate, warmup, measure, rounds)
    print(
        f"tandem {tandem.__version__} ({tandem.build_profile} build) bench kafka: filter -> "
        f"keyed count -> Kafka sink, r = 2 LiveRobin, {rate} ev/s, warm-up {warmup:g} s, "
        f"measured {measure:g} s; a synthetic source, Kafka's delivery alone, then a Kafka "
        "source" + (f", {rounds} rounds" if rounds > 1 else ""),
        flush=True,
    )
    if tandem.build_profile != "release":
        print("warning: a debug build: its timings say nothing about a release build", flush=True)
    from tandem._services import ensure_running

    services = ensure_running(zookeeper=False, kafka=True)
    try:
        rows = bench_kafka.kafka(services.kafka_bootstrap, rate, warmup, measure, rounds=rounds)
    finally:
        if services.started:
            services.stop()
            print("stopped kafka (started for this command)")
    print(bench.table(bench_kafka.summary(rows)))
    print(bench_kafka.verdict(rows))
    _write_json(
        args.json,
        {
            "experiment": "kafka",
            "tandem": tandem.__version__,
            "build": tandem.build_profile,
            "cpus": os.cpu_count(),
            "target_p99_ratio": bench_kafka.TARGET_P99_RATIO,
            "median_p99_ratio": bench_kafka.median_ratio(rows),
            "delivery_median_p99_ratio": bench_kafka.median_ratio(rows, "delivery"),
            "rows": bench_kafka.rows_json(rows),
        },
    )
    return 0 if all(r.lost == 0 and r.duplicates == 0 and r.digests_match for r in rows) else 1


def _csv(value: str | None) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip()) if value else ()


def _write_json(path: str | None, out: dict) -> None:
    import json

    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(out, indent=2))
        print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description=tandem.__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"tandem {tandem.__version__}")
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="log more: -v info (faults injected, connections lost), -vv debug (every link "
        "dropped); workers too",
    )
    parser.add_argument(
        "--log-level",
        type=_log_level,
        metavar="LEVEL",
        help="debug, info, warning (the default), error or critical; overrides -v. Also "
        f"read from ${tandem.logs.LEVEL_ENV}",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the replicated demo pipeline and kill a replica")
    demo.add_argument("--ordering", choices=["liverobin", "kazoo", "none"], default="liverobin")
    demo.add_argument(
        "--session-timeout",
        type=float,
        default=0.5,
        metavar="S",
        help="KaZoo: ZooKeeper session timeout (a crashed leader is replaced after about "
        "this; default 0.5, as for the benchmarks)",
    )
    demo.add_argument("--replication", type=int, default=2, metavar="N")
    demo.add_argument(
        "--restore",
        action="store_true",
        help="rebuild a killed replica group from its twins while the job runs",
    )
    demo.add_argument(
        "--chaos",
        type=int,
        nargs="?",
        const=0,
        default=None,
        metavar="SEED",
        help="kill a random worker every 5-10 s, each once r is restored (implies --restore)",
    )
    demo.add_argument("--rate", type=int, default=5_000, metavar="EV_PER_S")
    demo.add_argument("--heartbeat-ms", type=float, default=10.0)
    demo.add_argument("--buffer-timeout-ms", type=float, default=5.0)
    _add_run_flags(demo, demo=True)
    demo.set_defaults(func=_demo)

    run = sub.add_parser(
        "run",
        help="run a job script: until Ctrl-C/SIGTERM unless --duration (it defines "
        "`job = td.Job(...)`, or runs its job itself)",
    )
    run.add_argument("path")
    _add_run_flags(run, demo=False)
    run.add_argument(
        "--no-check",
        action="store_true",
        help="skip comparing the output with the reference executor at the end (it replays "
        "the whole run in this process: long for a long run)",
    )
    run.set_defaults(func=_run_file)

    beats = sub.add_parser(
        "heartbeats",
        help="write heartbeat markers into every partition of Kafka topics (run two or more)",
        description="A heartbeat generator for jobs reading Kafka: every --heartbeat-ms it "
        "writes a marker (header tandem-heartbeat: <epoch>/<period_ns>, epoch = wall clock "
        "// period) into every partition of every --topic, until Ctrl-C, SIGTERM or "
        "--duration. Generators need no coordination: run several, any may die.",
    )
    heartbeat.add_arguments(beats)
    beats.set_defaults(func=heartbeat.run_from_args)

    bench = sub.add_parser("bench", help="end-to-end experiments of the paper (§VII)")
    bench.add_argument(
        "experiment",
        choices=["mib1", "throughput", "failover", "recovery", "spark", "cost", "paper", "kafka"],
        help="failover: the paper's fault experiment (passive with checkpoints, LiveRobin, KaZoo "
        "leader and follower kills: downtime, lost, duplicates, peak p99); spark: MiB1 "
        "length 3 on the local engine, the Spark engine (with a replica kill) and Spark "
        "Structured Streaming (with a driver kill); cost: CPU, memory and "
        "time to first output of the demo and MiB1 length 3 at r = 1, 2 (LiveRobin, KaZoo) "
        "and 3, under load and idle; recovery: time to restore r against state size, and "
        "the fault experiment (passive, LiveRobin, KaZoo) in the same run: a Markdown table, "
        "JSON (--json) and a PNG (--plot); paper: the paper's whole evaluation (MiB1-3, the "
        "heartbeat sweep, the fault run, the BetterCloud-like application) in every "
        "configuration side by side, into --out DIR (JSON, Markdown, PNG figures); kafka: "
        "filter -> keyed count -> Kafka sink (r = 2 LiveRobin) on a synthetic source, then "
        "on a Kafka source fed at the same rate by a producer: p50/p99 of both, the p99 "
        "ratio, CPU",
    )
    bench.add_argument(
        "--configs",
        help="mib1 or cost configurations, comma-separated (default: all; cost: r1,r2,r2-kazoo,r3; "
        "paper: r1,passive,none,liverobin,kazoo,sss (sss: Spark Structured Streaming, in mib1 "
        "and fault); recovery, its fault runs: r1,passive,liverobin,kazoo)",
    )
    bench.add_argument(
        "--experiments",
        help="paper: comma-separated, from mib1,mib2,mib3,heartbeat,fault,bettercloud "
        "(default: all); recovery: from restore,fault (default: both)",
    )
    bench.add_argument("--out", metavar="DIR", help="paper: output folder (default out/paper)")
    bench.add_argument(
        "--duration",
        type=float,
        metavar="S",
        help="failover run length (default 100; kill at half); cost: the loaded runs' "
        "length (default 15); paper: each run's (default 15, fault and sss runs twice that); "
        "recovery: every run's (default 12 for the state sizes, kill at 4 s or a third; 30 "
        "for the fault runs, kill at half)",
    )
    bench.add_argument(
        "--session-timeout",
        type=float,
        default=0.5,
        metavar="S",
        help="KaZoo ZooKeeper session timeout for the benchmarks (default 0.5)",
    )
    bench.add_argument(
        "--plot",
        metavar="PATH",
        help="failover, cost, recovery: PNG path (recovery: default out/recovery_fault_p99.png)",
    )
    bench.add_argument("--lengths", default="1,2,3,4", help="mib1 pipeline lengths")
    bench.add_argument(
        "--rounds",
        type=int,
        metavar="N",
        help="kafka: N pairs of runs, synthetic then Kafka, alternating (default 1); the "
        "ratio reported is the median of the pairs'",
    )
    bench.add_argument(
        "--sizes", help="recovery: MiB of state per partition, comma-separated (default 1,10,100)"
    )
    bench.add_argument("--rate", type=int, metavar="EV_PER_S", help="default 5000")
    bench.add_argument(
        "--warmup",
        type=float,
        metavar="S",
        help="default 30; cost: 5; paper: 5, sss 10 (left out of latency); recovery: the "
        "fault runs' (5); kafka: 3",
    )
    bench.add_argument(
        "--idle-rate", type=int, metavar="EV_PER_S", help="cost: the idle runs' rate (10)"
    )
    bench.add_argument(
        "--idle-duration", type=float, metavar="S", help="cost: the idle runs' length (10)"
    )
    bench.add_argument("--workloads", help="cost: comma-separated, from demo,mib1 (default: both)")
    bench.add_argument(
        "--busy-neighbour",
        action="store_true",
        help="cost: run a process spinning on one core beside every run",
    )
    bench.add_argument(
        "--quick",
        action="store_true",
        help="cost: 1000 ev/s for 3 s (warm-up 1 s), idle 3 s: short runs for CI (about "
        "3 min on 2 cores, mostly process start-up); paper: every experiment briefly, one "
        "point each, 1.5 s runs (3 s with a fault), Spark Structured Streaming in mib1 "
        "only: for CI, a few minutes; recovery: 1 MiB (6 s) and the fault runs of paper "
        "--quick",
    )
    bench.add_argument(
        "--measure",
        type=float,
        metavar="S",
        help="seconds measured after the warm-up (default 30; kafka: 10)",
    )
    bench.add_argument("--master", metavar="URL", help="Spark master for the spark experiment")
    bench.add_argument(
        "--json",
        metavar="PATH",
        help="write the rows as JSON (recovery: default out/recovery.json)",
    )
    bench.set_defaults(func=_bench)

    args = parser.parse_args(argv)
    configure_logging(args.verbose, args.log_level)
    try:
        return args.func(args)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    except tandem.TandemError as exc:
        print(f"\ntandem: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ntandem: interrupted; every replica process was stopped", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
