"""Summarise a pytest-benchmark JSON file: rows/s per benchmark and Rust/Python per group.

Usage: ``python benches/report.py out/bench.json`` — prints a Markdown table (the one in
the README). Every benchmark must set ``benchmark.extra_info["rows"]`` (rows per call);
a group's ratio is the ``*_rust`` benchmark's rows/s over the ``*_python`` one's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows_per_second(bench: dict) -> float:
    rows = bench.get("extra_info", {}).get("rows")
    if rows is None:
        raise SystemExit(
            f"{bench['name']}: no extra_info['rows'] in the JSON; cannot compute rows/s"
        )
    return rows / bench["stats"]["mean"]


def fmt_rate(r: float) -> str:
    return f"{r / 1e6:,.1f} M rows/s" if r >= 1e6 else f"{r / 1e3:,.1f} k rows/s"


def report(data: dict) -> str:
    benches = sorted(data["benchmarks"], key=lambda b: (b.get("group") or "", b["name"]))
    lines = [
        "| group | benchmark | rows/call | mean | rows/s |",
        "|---|---|---:|---:|---:|",
    ]
    by_group: dict[str, dict[str, float]] = {}
    for b in benches:
        rate = rows_per_second(b)
        group = b.get("group") or "-"
        lines.append(
            f"| {group} | {b['name']} | {b['extra_info']['rows']:,} | "
            f"{b['stats']['mean'] * 1e3:,.2f} ms | {fmt_rate(rate)} |"
        )
        for kind in ("rust", "python"):
            if b["name"].endswith("_" + kind):
                by_group.setdefault(group, {})[kind] = rate
    lines.append("")
    lines.append("| group | Rust / Python |")
    lines.append("|---|---:|")
    for group, rates in sorted(by_group.items()):
        if "rust" in rates and "python" in rates:
            lines.append(f"| {group} | {rates['rust'] / rates['python']:,.0f}x |")
    machine = data.get("machine_info", {})
    cpu = machine.get("cpu", {}).get("brand_raw") or machine.get("processor") or "unknown CPU"
    lines.append("")
    lines.append(f"Measured on {cpu}, Python {machine.get('python_version', '?')}.")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    print(report(json.loads(Path(argv[1]).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
