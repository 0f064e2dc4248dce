"""Rust core vs the plain-Python reference (tandem.testing), in the same run.

Workload (DESIGN §6 scale, one downstream replica's view):

* ``dedup``: one logical channel of 1,000 batches of 1,024 rows, sent by two upstream
  replicas with different batch boundaries (replica B is offset by 512 rows), so every
  logical row arrives twice and half the batches are trimmed. Arrivals are in seq order.
* ``liverobin``: the merge of 4 deduplicated channels, each 256 batches of 1,024 rows with
  a heartbeat after every 8 batches (every channel sees every epoch), ending with End. Both
  sides produce the merged sequence with every batch's rows (the reference copies them
  into lists; Rust into one record batch), and the Rust output is checked equal to the
  reference's. Each side starts from its input as its callers hold it: the reference from
  ``Data`` lists, Rust from each channel's rows in one Arrow record batch, which
  ``push_many`` cuts into the 256 batches (zero-copy slices) by their seqs. The runtime
  merges batches that are already in Rust (decoded from the wire, never crossing into
  Python on the way to the merge), so the benchmark does not cross pyarrow's C Data
  Interface once per batch either (docs/architecture.md, "Merge microbenchmark").

``extra_info["rows"]`` is the number of *logical* rows per call (each delivered once),
so rows/s = rows / mean time. Run with ``make bench`` or::

    maturin develop --release
    pytest benches --benchmark-only --benchmark-json=out/bench.json
    python benches/report.py out/bench.json
"""

from __future__ import annotations

import pyarrow as pa
import pytest

from tandem import _core
from tandem.testing import (
    Data,
    End,
    Heartbeat,
    ReferenceDedup,
    ReferenceLiveRobin,
    bulk_batches,
)

BATCH_ROWS = 1024
DEDUP_BATCHES = 1000
LR_CHANNELS = 4
LR_BATCHES = 256
LR_BATCHES_PER_CYCLE = 8


def _batch(start: int, n: int) -> pa.RecordBatch:
    return pa.record_batch({"seq": pa.array(range(start, start + n), pa.int64())})


def _dedup_arrivals() -> list[tuple[int, int]]:
    """``(first_seq, rows)`` of both replicas' batches, in arrival (seq) order."""
    total = DEDUP_BATCHES * BATCH_ROWS
    a = [(s, BATCH_ROWS) for s in range(0, total, BATCH_ROWS)]
    b = [(0, BATCH_ROWS // 2)] + [
        (s, min(BATCH_ROWS, total - s)) for s in range(BATCH_ROWS // 2, total, BATCH_ROWS)
    ]
    return sorted(a + b, key=lambda x: x[0])


@pytest.fixture(scope="module")
def dedup_rust_input():
    arrivals = _dedup_arrivals()
    # A Table keeps each batch as a chunk: one Arrow stream, one schema import.
    table = pa.Table.from_batches([_batch(s, n) for s, n in arrivals])
    return [s for s, _ in arrivals], table


@pytest.fixture(scope="module")
def dedup_python_input():
    return [(s, list(range(s, s + n))) for s, n in _dedup_arrivals()]


@pytest.mark.benchmark(group="dedup")
def test_dedup_rust(benchmark, dedup_rust_input):
    def run():
        return _core.Dedup(1).offer_many(0, *dedup_rust_input)

    rows = benchmark(run)
    assert rows == DEDUP_BATCHES * BATCH_ROWS
    benchmark.extra_info["rows"] = rows


@pytest.mark.benchmark(group="dedup")
def test_dedup_python(benchmark, dedup_python_input):
    def run():
        ref = ReferenceDedup(1)
        return sum(len(ref.offer(0, s, rows)) for s, rows in dedup_python_input)

    rows = benchmark.pedantic(run, rounds=3, iterations=1)
    assert rows == DEDUP_BATCHES * BATCH_ROWS
    benchmark.extra_info["rows"] = rows


def _lr_channel(c: int):
    """One channel's elements: (kind, first_seq, start_value, n)."""
    out = []
    seq = 0
    for i in range(LR_BATCHES):
        out.append(("data", seq, c * 10**9 + seq, BATCH_ROWS))
        seq += BATCH_ROWS
        if (i + 1) % LR_BATCHES_PER_CYCLE == 0:
            out.append(("heartbeat", seq, (i + 1) // LR_BATCHES_PER_CYCLE))
            seq += 1
    out.append(("end", seq))
    return out


LR_ROWS = LR_CHANNELS * LR_BATCHES * BATCH_ROWS


@pytest.fixture(scope="module")
def lr_rust_input():
    """Per channel: the data batches' first seqs, their rows back to back in one record
    batch, the heartbeats ``(seq, epoch)`` and the end marker's seq."""
    out = []
    for c in range(LR_CHANNELS):
        elems = _lr_channel(c)
        data = [e for e in elems if e[0] == "data"]
        rows = pa.Table.from_batches([_batch(e[2], e[3]) for e in data]).combine_chunks()
        out.append(
            (
                [e[1] for e in data],
                rows.to_batches()[0],
                [(e[1], e[2]) for e in elems if e[0] == "heartbeat"],
                next(e[1] for e in elems if e[0] == "end"),
            )
        )
    return out


@pytest.fixture(scope="module")
def lr_python_input():
    chans = []
    for c in range(LR_CHANNELS):
        elems = []
        for e in _lr_channel(c):
            if e[0] == "data":
                elems.append(Data(e[1], list(range(e[2], e[2] + e[3]))))
            elif e[0] == "heartbeat":
                elems.append(Heartbeat(e[1], e[2]))
            else:
                elems.append(End(e[1]))
        chans.append(elems)
    return chans


@pytest.fixture(scope="module")
def lr_expected(lr_python_input):
    """The reference's merged sequence, computed once outside any timing."""
    return ReferenceLiveRobin(LR_CHANNELS).run(lr_python_input)


@pytest.mark.benchmark(group="liverobin")
def test_liverobin_rust(benchmark, lr_rust_input, lr_expected):
    def run():
        lr = _core.LiveRobin(LR_CHANNELS)
        for c, (first_seqs, rows, heartbeats, end) in enumerate(lr_rust_input):
            lr.push_many(c, first_seqs, rows, heartbeats, end)
        return lr.drain_many()

    deliveries, rows = benchmark(run)
    assert rows.num_rows == LR_ROWS
    merged = bulk_batches((deliveries, rows))  # in the shape ReferenceLiveRobin.run returns
    assert merged == lr_expected, "Rust and the reference disagree"
    benchmark.extra_info["rows"] = rows.num_rows


@pytest.mark.benchmark(group="liverobin")
def test_liverobin_python(benchmark, lr_python_input, lr_expected):
    def run():
        return ReferenceLiveRobin(LR_CHANNELS).run(lr_python_input)

    out = benchmark.pedantic(run, rounds=3, iterations=1)
    assert out == lr_expected
    rows = sum(len(ev[3]) for ev in out if ev[0] == "data")
    assert rows == LR_ROWS
    benchmark.extra_info["rows"] = rows
