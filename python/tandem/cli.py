"""The ``tandem`` command line: ``tandem demo``, ``tandem run path/to/job.py`` (each on the
local or the Spark engine), ``tandem bench EXPERIMENT`` (the experiments of
:mod:`tandem.experiments`, each a subcommand with its own flags), ``tandem heartbeats``
(a heartbeat generator for jobs reading Kafka) and ``tandem services`` (a local ZooKeeper
and Kafka: :mod:`tandem._services.control`).

Exit codes: 0 a clean run (nothing lost or duplicated, the replicas agreed), 1 the job
failed or its check did, 2 a usage error (a bad option, a ``ConfigError``), 130 a second
Ctrl-C; ``tandem services``: 0 ok, 1 a server failed, 2 usage, 3 ``status`` of a server
that is not running."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path

import tandem
from tandem import engines, experiments, heartbeat
from tandem._services import control as services_control

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


EXIT_CODES = (
    "exit codes: 0 a clean run (nothing lost or duplicated, the replicas agreed); 1 the job "
    "failed or its check did; 2 a usage error (a bad option, a ConfigError); 130 a second "
    "Ctrl-C"
)


def _seconds(value: str) -> float:
    """``--duration``: seconds > 0 (argparse reports a bad one as its subcommand's)."""
    try:
        s = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {value!r}") from None
    if not (s > 0 and s != float("inf")):
        raise argparse.ArgumentTypeError(f"must be seconds > 0, got {value}")
    return s


def _seconds_or_zero(value: str) -> float:
    try:
        s = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {value!r}") from None
    if not (s >= 0 and s != float("inf")):
        raise argparse.ArgumentTypeError(f"must be seconds >= 0, got {value}")
    return s


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _kill(spec: str) -> tandem.Kill | str:
    """``--kill``: a spec, or ``none``; checked by the subcommand's parser."""
    if spec == "none":
        return spec
    try:
        return parse_kill(spec)
    except tandem.ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
        help=f"the engine to run on (installed: {', '.join(engines.available())})",
    )
    p.add_argument(
        "--master",
        metavar="URL",
        help="Spark master for --engine spark (default: local[N,8], N = workers + spares)",
    )
    p.add_argument(
        "--duration",
        type=_seconds,
        default=20.0 if demo else None,
        metavar="S",
        help="seconds of source time to run"
        + (
            ""
            if demo
            else " (default: a module-level `duration` of the script, else until Ctrl-C or "
            "SIGTERM; bounded sources end the run by themselves)"
        ),
    )
    p.add_argument(
        "--kill",
        action="append",
        type=_kill,
        metavar="TASK:PARTITION:REPLICA@SECONDS",
        help="SIGKILL the worker hosting a replica at SECONDS (repeatable; REPLICA an index, "
        "or leader/follower under KaZoo); 'none' for a fault-free run (default: "
        + (
            "count:0:0@DURATION/2, the KaZoo leader's with --ordering kazoo"
            if demo
            else "a module-level `faults` of the script, else none"
        )
        + ")",
    )
    p.add_argument(
        "--warmup",
        type=_seconds_or_zero,
        default=0.0,
        metavar="S",
        help="seconds of output left out of the latency figures",
    )
    p.add_argument("--json", metavar="PATH", help="write the result as JSON (default: none)")
    p.add_argument(
        "--plot",
        metavar="PATH",
        type=lambda path: None if path == "none" else path,
        default="out/demo_p99.png" if demo else None,
        help="write per-second p99 latency as a PNG, faults marked (needs matplotlib); "
        "'none' for no plot" + (" (default: %(default)s)" if demo else " (default: none)"),
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (it is drawn only when stderr is a terminal anyway)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics of every worker on 127.0.0.1:PORT while the job runs "
        "(local engine; 0: a free port; default: none)",
    )


def _faults(args, default: list) -> list:
    if not args.kill:
        return default
    return [k for k in args.kill if k != "none"]


def _demo(args: argparse.Namespace) -> int:
    from tandem.experiments import common, demo

    with common.kazoo_services(args.ordering == "kazoo", args.session_timeout) as kazoo:
        return _demo_job(args, demo, kazoo)


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
    return _run_and_report(job, args, faults, plot_path=args.plot)


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


def _savepoint(args: argparse.Namespace) -> int:
    """`tandem savepoint PATH`: ask the running job for one; `--show`: describe one."""
    if args.show:
        if args.stop or args.job:
            raise tandem.ConfigError("--show reads a savepoint; --stop and --job ask a job")
        print(describe_savepoint(tandem.Savepoint.read(args.path)))
        return 0
    from tandem import control, savepoints

    savepoints.check_target(args.path)  # here first: a usage error, the job untouched
    what = "and stopping it there" if args.stop else "while it runs"
    print(f"asking for a savepoint at {args.path} {what} ...", flush=True)
    reply = control.ask(args.path, job=args.job, stop=args.stop)
    print(
        f"savepoint of job {reply['job']!r} (pid {reply['pid']}) written to {reply['path']}: "
        f"heartbeat {reply['epoch']}, {reply['source_time_s']:.2f} s of source time"
    )
    print(f"continue from it with: tandem run JOB.py --from-savepoint {reply['path']}")
    return 0


def describe_savepoint(sp: tandem.Savepoint) -> str:
    """What ``tandem savepoint --show`` prints: the job, the cut, and per task its shape,
    its state and, a keyed task, the key groups of each partition."""
    lines = [
        f"savepoint of job {sp.job!r} at {sp.path}",
        f"  cut after heartbeat {sp.epoch} ({sp.source_time_s:.2f} s of source time, "
        f"heartbeat {sp.heartbeat_ms:g} ms); written {sp.created} by tandem {sp.tandem_version}",
        f"  max_parallelism {sp.max_parallelism}",
    ]
    width = max(len(t["name"]) for t in sp.tasks)
    for t in sp.tasks:
        parts = [p for p in sp.partitions if p["task"] == t["name"]]
        state = sum(p.get("bytes", 0) for p in parts)
        line = (
            f"  {t['name']:<{width}}  {t['kind']:<8}  parallelism {t['parallelism']}, "
            f"replication {t['replication']}"
        )
        if t["kind"] == "operator":
            line += f", state {_size(state)}"
        groups = [p.get("key_groups") for p in sorted(parts, key=lambda p: p["partition"])]
        if any(groups):
            line += ", key groups " + " ".join(f"[{g[0]},{g[1]})" for g in groups if g)
        if t["kind"] == "source":
            rows = sum(p["rows"] for p in sp.sources.get(t["name"], []))
            line += f", {rows:,} rows emitted"
        lines.append(line)
    return "\n".join(lines)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _report_script_runs(runs: list, args: argparse.Namespace) -> int:
    """The summary of every run a script made itself; 0 if each one's output checked."""
    given = [
        flag
        for flag, value in (
            ("--duration", args.duration),
            ("--kill", args.kill),
            ("--from-savepoint", getattr(args, "from_savepoint", None)),
            ("--savepoint-on-stop", getattr(args, "savepoint_on_stop", None)),
            ("--resume", getattr(args, "resume", None) or None),
        )
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


def _announce_resume(job: tandem.Job) -> None:
    """Say where ``tandem run --resume`` starts ``job`` from (the run itself refuses a job
    without a checkpoint_dir)."""
    from tandem import savepoints

    if job.checkpoint_dir is None:
        return
    latest = savepoints.latest_checkpoint(job.checkpoint_dir, job.name)
    if latest is None:
        print(
            f"no checkpoint of job {job.name!r} in {job.checkpoint_dir} yet: starting it "
            "from the beginning",
            flush=True,
        )
    else:
        print(
            f"resuming job {job.name!r} from {latest.path} (heartbeat {latest.epoch}, "
            f"{latest.source_time_s:.2f} s of source time)",
            flush=True,
        )


def _run_and_report(job: tandem.Job, args, faults: list, plot_path: str | None) -> int:
    """Run ``job`` as the flags say (``args.duration`` None: until Ctrl-C/SIGTERM, or the
    end of its bounded sources), print the summary; 0 if its output checked."""
    if args.duration is not None and args.duration <= 0:
        raise tandem.ConfigError(f"--duration must be > 0 seconds, got {args.duration}")
    if args.master and args.engine != "spark":
        raise tandem.ConfigError(f"--master is for --engine spark, not --engine {args.engine}")
    options = {"master": args.master} if args.master else {}
    engine = engines.get(args.engine, **options)
    run_options: dict = {"check": False} if getattr(args, "no_check", False) else {}
    from_savepoint = getattr(args, "from_savepoint", None)
    if from_savepoint is not None:
        run_options["from_savepoint"] = from_savepoint
        run_options.pop("check", None)  # off: the output follows the cut
    savepoint_on_stop = getattr(args, "savepoint_on_stop", None)
    if savepoint_on_stop is not None:
        if args.duration is not None:
            raise tandem.ConfigError(
                f"--savepoint-on-stop is for a run until stopped; --duration {args.duration} "
                "ends it by itself (leave --duration out, and stop it with Ctrl-C or SIGTERM)"
            )
        run_options["savepoint_on_stop"] = savepoint_on_stop
    if getattr(args, "resume", False):
        _announce_resume(job)
        run_options["resume"] = True
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
        if engines.stoppable(engine):
            run_options["control"] = True
            print(
                "  savepoints: `tandem savepoint PATH` from another shell (--stop: and stop here)",
                flush=True,
            )
    if job.checkpoint_dir is not None:
        print(
            f"  checkpoints every {job.checkpoint_ms / 1000:g} s into {job.checkpoint_dir} "
            f"(tandem run {getattr(args, 'path', 'JOB.py')} --resume continues from the newest)",
            flush=True,
        )
    result = job.run(
        duration=args.duration,
        faults=faults,
        engine=engine,
        warmup=args.warmup,
        progress=False if args.no_progress else None,  # None: when stderr is a terminal
        **run_options,
    )
    print_summary(result)
    if result.savepoint is not None:
        print(
            f"\nstopped at a savepoint: {result.savepoint.path} (source time "
            f"{result.savepoint.source_time_s:.2f} s); continue it with\n"
            f"  tandem run {getattr(args, 'path', 'JOB.py')} --from-savepoint "
            f"{result.savepoint.path}"
        )
    if args.json:
        _write_result(args.json, result)
    if plot_path and result.per_second_p99_ms:
        from tandem.experiments import demo

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
            f"r{t['replica']} (epoch {t['epoch']}, from {t['from_s']:.2f} s"
            + (", lost while leading)" if t["until_s"] is None else ")")
            for t in terms
        )
        print(f"  leaders of {name}: {led}")
    for e in r.determinism_errors:
        print(f"  DeterminismError: {e}")
    masked = r.lost == 0 and r.duplicates == 0 and r.digests_match
    if r.faults:
        print("\n  " + ("fault masked." if masked else "fault NOT masked."))


class _Help(argparse.HelpFormatter):
    """Help that ends each option with its default, unless it has none (None, a flag off)
    or says it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default is None
            or default is False
            or default is argparse.SUPPRESS
            or not action.option_strings
        ):
            return text
        return f"{text} (default: %(default)s)"


class _Experiment(argparse.ArgumentParser):
    """The parser of one ``tandem bench`` experiment: a flag it does not take is an error
    with its own usage (argparse would give ``tandem``'s)."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def build_parser() -> argparse.ArgumentParser:
    """The ``tandem`` command's parser, every subcommand in it."""
    parser = argparse.ArgumentParser(
        prog="tandem", description=tandem.__doc__.splitlines()[0], epilog=EXIT_CODES
    )
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

    demo = sub.add_parser(
        "demo",
        help="run the replicated demo pipeline and kill a replica",
        description="Run a replicated pipeline on worker processes of this machine — source "
        "→ enrich → count (keyed, stateful) → alert → sink, 2 partitions per task — SIGKILL "
        "the worker hosting one replica of `count` halfway through, and print a summary: "
        "events in and out, rows lost and duplicated (checked against a single-process "
        "reference run), latency, the longest gap between outputs, whether the replicas "
        "agreed.",
        epilog=EXIT_CODES,
        formatter_class=_Help,
    )
    demo.add_argument(
        "--ordering",
        choices=["liverobin", "kazoo", "none"],
        default="liverobin",
        help="how replicas order their inputs: LiveRobin (leaderless), KaZoo (a leader, "
        "over ZooKeeper and Kafka, started here when not running) or none (the unordered "
        "baseline: replicas diverge)",
    )
    demo.add_argument(
        "--session-timeout",
        type=float,
        default=0.5,
        metavar="S",
        help="KaZoo: ZooKeeper session timeout; a crashed leader is replaced after about "
        "this (default: %(default)s, as for the benchmarks)",
    )
    demo.add_argument(
        "--replication",
        type=_positive_int,
        default=2,
        metavar="N",
        help="replicas per task partition (1: no replication, and no default kill)",
    )
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
        help="kill a random worker every 5-10 s, each once r is restored (implies "
        "--restore; SEED defaults to 0)",
    )
    demo.add_argument(
        "--rate",
        type=_positive_int,
        default=5_000,
        metavar="EV_PER_S",
        help="events per second from the source",
    )
    demo.add_argument(
        "--heartbeat-ms",
        type=float,
        default=10.0,
        metavar="MS",
        help="heartbeat period: how long merges and windows wait at most",
    )
    demo.add_argument(
        "--buffer-timeout-ms",
        type=float,
        default=5.0,
        metavar="MS",
        help="sources cut batches at windows of this much source time",
    )
    _add_run_flags(demo, demo=True)
    demo.set_defaults(func=_demo)

    run = sub.add_parser(
        "run",
        help="run a job script: until Ctrl-C/SIGTERM unless --duration (it defines "
        "`job = td.Job(...)`, or runs its job itself)",
        description="Run a job script as `python PATH` would, as __main__. A script that "
        "calls job.run() itself has each run's summary printed; a script that only builds a "
        "module-level `job = td.Job(...)` has it run here, for --duration seconds (or a "
        "module-level `duration`), else until Ctrl-C or SIGTERM, which stop it gracefully.",
        epilog=EXIT_CODES,
        formatter_class=_Help,
    )
    run.add_argument("path", help="the job script (a Python file)")
    _add_run_flags(run, demo=False)
    run.add_argument(
        "--no-check",
        action="store_true",
        help="skip comparing the output with the reference executor at the end (it replays "
        "the whole run in this process: long for a long run)",
    )
    run.add_argument(
        "--from-savepoint",
        metavar="PATH",
        help="resume the job from the savepoint at PATH (a directory or a URI) written by "
        "RunningJob.savepoint() or stop(savepoint=...): every task starts from its state "
        "there and the sources continue after the cut (the output is not checked)",
    )
    run.add_argument(
        "--savepoint-on-stop",
        metavar="PATH",
        help="with no --duration: Ctrl-C or SIGTERM stops the job at a savepoint written to "
        "PATH (an empty or new directory, or a URI); --from-savepoint PATH continues it, "
        "with new code if need be",
    )
    run.add_argument(
        "--resume",
        action="store_true",
        help="a job with durable checkpoints (Job(checkpoint_ms=..., checkpoint_dir=PATH)): "
        "start from the newest complete checkpoint in PATH — after the process running it "
        "was killed, say — or from the beginning when there is none yet",
    )
    run.set_defaults(func=_run_file)

    sp = sub.add_parser(
        "savepoint",
        help="write a savepoint of a job `tandem run` runs until stopped, or --show one",
        description="Ask the job that `tandem run job.py` (no --duration) runs on this "
        "machine for a savepoint at PATH while it goes on (--stop: and stop it there); "
        "`tandem run job.py --from-savepoint PATH` continues from it, with new code, "
        "replication or parallelism of its keyed tasks. --show prints what a savepoint at "
        "PATH holds.",
        epilog=EXIT_CODES,
        formatter_class=_Help,
    )
    sp.add_argument("path", help="where the savepoint goes (a new directory or a URI)")
    sp.add_argument("--job", metavar="NAME", help="the job, when several run (default: the one)")
    sp.add_argument("--stop", action="store_true", help="stop the job at the savepoint")
    sp.add_argument(
        "--show", action="store_true", help="print what the savepoint at PATH holds instead"
    )
    sp.set_defaults(func=_savepoint)

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

    services = sub.add_parser(
        "services",
        help="start, stop or check a local ZooKeeper and Kafka (for KaZoo and Kafka jobs)",
        description="A real ZooKeeper and a single-node KRaft Kafka on this machine, bound to "
        "127.0.0.1 at the addresses tandem uses by default (ZooKeeper 127.0.0.1:21810, Kafka "
        "127.0.0.1:19092), for `tandem demo --ordering kazoo`, KaZoo jobs and the Kafka "
        "sources and sinks. Needs Java 17+; the servers' jars are downloaded from Maven "
        "Central on the first start and cached. `tandem services COMMAND --help` for each.",
        epilog=services_control.epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    services_control.add_commands(services)
    services.set_defaults(func=services_control.run)

    bench = sub.add_parser(
        "bench",
        help="experiments: the paper's (§VII), what replication costs, recovery, Kafka, Spark",
        description="Experiments on this machine, each a subcommand with its own flags "
        "(`tandem bench EXPERIMENT --help`).",
    )
    experiments.add_commands(
        bench.add_subparsers(dest="experiment", required=True, parser_class=_Experiment)
    )

    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.verbose, args.log_level)
    try:
        return args.func(args)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    except tandem.ConfigError as exc:  # a usage error, found before anything ran
        print(f"\ntandem: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except tandem.TandemError as exc:  # the job failed
        print(f"\ntandem: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ntandem: interrupted; every replica process was stopped", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
