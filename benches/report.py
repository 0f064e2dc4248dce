"""Summarise a pytest-benchmark JSON file: rows/s per benchmark and Rust/Python per group.

Usage: ``python benches/report.py [--min-ratio X [--min-ratio-for GROUP=Y]... [--known-short
GROUP]...] out/bench.json``
— prints a Markdown table (the one in docs/performance.md). Every benchmark must set
``benchmark.extra_info["rows"]`` (rows per call); a group's ratio is the ``*_rust``
benchmark's rows/s over the ``*_python`` one's (mean times).

``--min-ratio X`` (``make bench-check``, which ``make test`` and so CI run) then checks
every group on best-of-rounds times (the rounds least disturbed by a busy neighbour, on
both sides) and exits with status 1 unless each has both benchmarks and Rust is at least
``X`` times the Python reference (``--min-ratio-for GROUP=Y``: ``Y`` times for that group).
A ``--known-short`` group is reported as falling short
instead of failing — and fails the check the day it reaches ``X``, so that its exception
is removed rather than forgotten.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def rows_per_second(bench: dict, stat: str = "mean") -> float:
    """Rows per second of one benchmark, from its ``stat`` time (``mean`` or ``min``)."""
    rows = bench.get("extra_info", {}).get("rows")
    if rows is None:
        raise SystemExit(
            f"{bench['name']}: no extra_info['rows'] in the JSON; cannot compute rows/s"
        )
    return rows / bench["stats"][stat]


def fmt_rate(r: float) -> str:
    return f"{r / 1e6:,.1f} M rows/s" if r >= 1e6 else f"{r / 1e3:,.1f} k rows/s"


def rates(data: dict, stat: str = "mean") -> dict[str, dict[str, float]]:
    """rows/s by group, then by kind (``rust`` / ``python``: the benchmark name's suffix)."""
    by_group: dict[str, dict[str, float]] = {}
    for b in data["benchmarks"]:
        for kind in ("rust", "python"):
            if b["name"].endswith("_" + kind):
                rate = rows_per_second(b, stat)
                by_group.setdefault(b.get("group") or "-", {})[kind] = rate
    return by_group


def ratios(data: dict, stat: str = "mean") -> dict[str, float | None]:
    """Rust rows/s over Python rows/s by group; None for a group that lacks either."""
    return {
        group: r["rust"] / r["python"] if "rust" in r and "python" in r else None
        for group, r in sorted(rates(data, stat).items())
    }


def report(data: dict) -> str:
    benches = sorted(data["benchmarks"], key=lambda b: (b.get("group") or "", b["name"]))
    lines = [
        "| group | benchmark | rows/call | mean | rows/s |",
        "|---|---|---:|---:|---:|",
    ]
    for b in benches:
        lines.append(
            f"| {b.get('group') or '-'} | {b['name']} | {b['extra_info']['rows']:,} | "
            f"{b['stats']['mean'] * 1e3:,.2f} ms | {fmt_rate(rows_per_second(b))} |"
        )
    lines.append("")
    lines.append("| group | Rust / Python |")
    lines.append("|---|---:|")
    for group, ratio in ratios(data).items():
        if ratio is not None:
            lines.append(f"| {group} | {ratio:,.0f}x |")
    machine = data.get("machine_info", {})
    cpu = machine.get("cpu", {}).get("brand_raw") or machine.get("processor") or "unknown CPU"
    lines.append("")
    lines.append(f"Measured on {cpu}, Python {machine.get('python_version', '?')}.")
    return "\n".join(lines)


def check(
    data: dict,
    min_ratio: float,
    known_short: set[str] = frozenset(),
    group_ratios: dict[str, float] | None = None,
) -> list[str]:
    """One line per group: ``ok``, ``known short`` or ``FAIL`` and why, on best-of-rounds
    times (see the module documentation); ``group_ratios``: a group's own minimum."""
    group_ratios = group_ratios or {}
    found = ratios(data, stat="min")
    if not found:
        return ["FAIL no Rust/Python benchmark pairs in the JSON"]
    out = []
    for group in sorted(known_short - found.keys()):
        out.append(f"FAIL {group}: named --known-short, but there is no such group")
    for group in sorted(group_ratios.keys() - found.keys()):
        out.append(f"FAIL {group}: named --min-ratio-for, but there is no such group")
    for group, ratio in found.items():
        minimum = group_ratios.get(group, min_ratio)
        if ratio is None:
            out.append(f"FAIL {group}: needs both a *_rust and a *_python benchmark")
            continue
        line = f"{group}: Rust is {ratio:.1f}x the Python reference (best of rounds)"
        if group in known_short:
            verdict = "FAIL" if ratio >= minimum else "known short"
            line += f"; listed as known short of {minimum:g}x"
        else:
            verdict = "ok" if ratio >= minimum else "FAIL"
            line += f", {'at least' if verdict == 'ok' else 'below'} {minimum:g}x"
        out.append(f"{verdict} {line}")
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", help="pytest-benchmark's --benchmark-json output")
    p.add_argument(
        "--min-ratio",
        type=float,
        help="fail unless Rust is at least this many times the Python reference per group",
    )
    p.add_argument(
        "--known-short",
        action="append",
        default=[],
        metavar="GROUP",
        help="a group known to fall short of --min-ratio (fails once it reaches it); repeat",
    )
    p.add_argument(
        "--min-ratio-for",
        action="append",
        default=[],
        metavar="GROUP=Y",
        help="this group's own minimum instead of --min-ratio; repeat",
    )
    args = p.parse_args(argv[1:])
    group_ratios = {}
    for spec in args.min_ratio_for:
        group, _, value = spec.partition("=")
        try:
            group_ratios[group] = float(value)
        except ValueError:
            p.error(f"--min-ratio-for {spec!r}: give GROUP=RATIO, e.g. liverobin=6")
    data = json.loads(Path(args.json).read_text())
    print(report(data))
    if args.min_ratio is None:
        return 0
    lines = check(data, args.min_ratio, set(args.known_short), group_ratios)
    print()
    for line in lines:
        print(line)
    return 1 if any(line.startswith("FAIL") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
