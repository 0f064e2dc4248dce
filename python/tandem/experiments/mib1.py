"""``tandem bench mib1``: the paper's MiB1 (§VII), latency against the pipeline's length.

A pipeline of 1 to 4 identity map tasks of 2 partitions each at 5,000 ev/s, heartbeat
10 ms, buffer timeout 5 ms (:func:`tandem.experiments.workloads.mib1_job`); latency
measured after a warm-up; configurations side by side in the same run: no replication,
``none``, ``liverobin``, ``kazoo``. As in the paper, every task partition reads both
upstream partitions (the stream is keyed between tasks), so the replicas of each partition
have two inputs to order. Every row says whether its output was complete and unrepeated
(``lost``, ``duplicates``), by a sequence check at the sink
(:class:`~tandem.experiments.workloads.SequenceSink`: every source row exactly once).
"""

from __future__ import annotations

import argparse
import sys

import tandem as td
from tandem.experiments import common
from tandem.experiments.workloads import (
    PAPER_LIVEROBIN,
    Row,
    SequenceSink,
    latency_row,
    mib1_job,
    named,
)

HELP = "the paper's MiB1: latency of 1 to 4 identity maps, in every configuration"

CONFIGS = named({"replication=1": "r1", "none": "none", "liverobin": "liverobin", "kazoo": "kazoo"})
"""The configurations of ``mib1``; no replication is named ``replication=1`` here."""


def mib1(
    lengths=(1, 2, 3, 4),
    configs=tuple(CONFIGS),
    rate: int = 5_000,
    warmup: float = 30.0,
    measure: float = 30.0,
    log=None,
    kazoo: td.KazooConfig | None = None,
) -> list[Row]:
    log = log or sys.stderr  # at call time: sys.stderr may have been replaced
    rows = []
    for length in lengths:
        for config in configs:
            opts = CONFIGS[config]
            sink = SequenceSink()  # checks the output: the reference would take too long
            job = mib1_job(length, opts["replication"], opts["ordering"], rate, kazoo, sink)
            print(f"mib1: length {length}, {config} ...", file=log, flush=True)
            res = job.run(duration=warmup + measure, warmup=warmup, progress=False, check=False)
            rows.append(latency_row(config, length, rate, res))
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_names(p, "--configs", CONFIGS)
    p.add_argument(
        "--lengths",
        default="1,2,3,4",
        metavar="N,...",
        help="pipeline lengths, comma-separated (default 1,2,3,4)",
    )
    common.add_rate(p, 5_000, "the source's events per second (default 5000)")
    common.add_seconds(p, "--warmup", 30.0, "left out of latency at every run's start (default 30)")
    common.add_seconds(p, "--measure", 30.0, "measured after the warm-up (default 30)")
    common.add_session_timeout(p)
    common.add_json(p)


def main(args: argparse.Namespace) -> int:
    configs = common.csv(args.configs) or tuple(CONFIGS)
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        raise td.ConfigError(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    lengths = [int(x) for x in args.lengths.split(",")]
    with common.kazoo_services("kazoo" in configs, args.session_timeout) as kazoo:
        rows = mib1(
            lengths=lengths,
            configs=configs,
            rate=args.rate,
            warmup=args.warmup,
            measure=args.measure,
            kazoo=kazoo,
        )
        print(common.table(rows))
        out = {"experiment": "mib1", "rows": [vars(r) for r in rows]}
        common.write_json(args.json, {**out, "paper_liverobin_ms": PAPER_LIVEROBIN})
    return 0
