"""The ``tandem`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import tandem


def _demo(args: argparse.Namespace) -> int:
    from tandem import showcase

    cfg = showcase.ShowcaseConfig(
        rate=args.rate,
        duration=args.duration,
        heartbeat_ms=args.heartbeat_ms,
        buffer_timeout_ms=args.buffer_timeout_ms,
        ordering=args.ordering,
        kill=not args.no_kill,
        replicas=args.replication,
    )
    print(
        f"tandem {tandem.__version__} ({tandem.build_profile} build): "
        f"{cfg.partitions} source partitions x {cfg.replicas} replicas -> "
        f"{cfg.replicas} {cfg.ordering} replicas, {cfg.rate} ev/s for {cfg.duration:g} s"
        + (", killing source p0/r0 halfway" if cfg.kill and cfg.replicas > 1 else "")
    )
    result = showcase.run(cfg)
    _print_summary(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    masked = result["lost"] == 0 and result["duplicates"] == 0
    ok = masked and (result["digests_match"] or cfg.ordering == "none")
    return 0 if ok else 1


def _print_summary(result: dict) -> None:
    rows = result["replicas"]
    head = (
        f"{'replica':>7} {'rows':>8} {'lost':>5} {'dups':>5} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'max ms':>8} {'max gap ms':>10}  order digest"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['replica']:>7} {r['rows']:>8} {r['missing']:>5} {r['duplicates']:>5} "
            f"{r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {r['max_ms']:>8.2f} "
            f"{r['max_gap_ms']:>10.2f}  {r['order_digest'][:16]}"
        )
    fault = result["fault"]
    print("fault: " + (f"SIGKILL source p0/r0 at {fault['at_s']:.1f} s" if fault else "none"))
    verdict = "identical" if result["digests_match"] else "DIFFERENT"
    print(
        f"lost {result['lost']}, duplicates {result['duplicates']}, "
        f"replica consumption orders {verdict}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description=tandem.__doc__)
    parser.add_argument("--version", action="version", version=f"tandem {tandem.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="replicated sources -> replicated merge, one crash masked")
    demo.add_argument("--ordering", choices=["liverobin", "none"], default="liverobin")
    demo.add_argument("--replication", type=int, default=2, metavar="N")
    demo.add_argument("--rate", type=int, default=5_000, metavar="EV_PER_S")
    demo.add_argument("--duration", type=float, default=10.0, metavar="S")
    demo.add_argument("--heartbeat-ms", type=float, default=10.0)
    demo.add_argument("--buffer-timeout-ms", type=float, default=5.0)
    demo.add_argument("--no-kill", action="store_true", help="run without the fault")
    demo.add_argument("--json", metavar="PATH", help="write the result as JSON")
    demo.set_defaults(func=_demo)

    args = parser.parse_args(argv)
    for name in ("rate", "duration", "heartbeat_ms", "buffer_timeout_ms", "replication"):
        value = getattr(args, name, None)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0 (got {value})")
    try:
        return args.func(args)
    except tandem.TandemError as exc:
        print(f"tandem: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ntandem: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
