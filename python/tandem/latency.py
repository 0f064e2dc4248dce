"""Latency and output gaps measured at the sinks, in memory that does not grow with the
number of events.

Every sink replica whose rows carry ``event_time_ns`` keeps a :class:`LatencyRecorder`.
For each second of run time (``(receive time - t0) // 1 s``) it keeps

* an HDR histogram (the ``hdrhistogram`` package, :mod:`hdrh`) of its rows' latencies,
  receive time - event time, in nanoseconds with 2 significant figures: a recorded value
  lies in a bucket at most 1/128 (0.8 %) of its size wide, from 1 ns to one hour
  (:data:`HIGHEST_NS`; longer latencies count as one hour, negative ones — clocks of
  different machines — as 0);
* a bitmap of the milliseconds of that second in which it received output (125 bytes).

A second is encoded when the next one begins (the histogram in HdrHistogram's compressed
format, typically a few hundred bytes), so a sink holds one live histogram however long it
runs and however many rows it gets, and its report grows by a few hundred bytes per
second of run time, not per event. Rows received before ``t0 + warmup`` are not recorded
at all (the engine gives the worker ``warmup``), so the split is exact however the
warm-up falls within a second.

At the driver, :func:`summarize` merges the seconds of every sink replica:

* ``p50_ms``, ``p99_ms``, ``max_ms`` come from the merged histogram of all seconds,
  ``per_second_p99_ms`` from each second's merged histogram. A percentile ``p`` is the
  value of rank ``max(1, round(p·n/100))`` among the ``n`` recorded values, reported as
  the upper end of its histogram bucket, so at most 0.8 % above the exact value; ``max_ms``
  likewise.
* ``max_gap_ms``, the longest time without output at any sink, is the largest distance
  between two consecutive milliseconds in which some sink received output (the sinks'
  bitmaps OR'd). Outputs at ``a`` and ``b`` ms (``b`` the next one) were between
  ``b - a - 1`` and ``b - a + 1`` ms apart, so the figure is within 1 ms of the exact
  gap; output in a single millisecond gives 0.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
from hdrh.histogram import HdrHistogram

LOWEST_NS = 1
HIGHEST_NS = 3_600 * 10**9
"""The longest latency told apart: one hour (longer ones are recorded as one hour)."""
SIGNIFICANT_FIGURES = 2
FLUSH_ROWS = 1 << 16
"""Latencies wait in a buffer of at most this many values before they are counted (at
the end of a second at the latest): one vectorised pass per many small batches."""

METRIC_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
"""Upper bounds of the latency histogram the metrics endpoint serves
(``tandem_latency_seconds``, :mod:`tandem.metrics`); a last bucket takes the rest."""

_NS_PER_S = 1_000_000_000
_NS_PER_MS = 1_000_000
_MS_PER_S = 1_000


def new_histogram() -> HdrHistogram:
    """An empty histogram with the layout every sink uses."""
    return HdrHistogram(LOWEST_NS, HIGHEST_NS, SIGNIFICANT_FIGURES, b64_wrap=False)


class _Layout:
    """HdrHistogram's bucket layout, read from an instance, and the counts index of many
    values at once (the package indexes one value per Python call, several microseconds
    each)."""

    def __init__(self) -> None:
        h = new_histogram()
        self.counts_len = h.counts_len
        self.mask = h.sub_bucket_mask
        self.unit = h.unit_magnitude
        self.half_mag = h.sub_bucket_half_count_magnitude
        self.half = h.sub_bucket_half_count
        # bit_length(x) of a positive int64 below 2**53 is its float64 exponent field - 1022.
        self._bucket_bias = 1022 + self.unit + self.half_mag + 1

    def index(self, values: np.ndarray) -> np.ndarray:
        """The counts index of each value (int64, in ``[0, HIGHEST_NS]``): the index
        ``HdrHistogram.record_value`` would increment."""
        exponent = (values | self.mask).astype(np.float64).view(np.int64) >> 52
        bucket = exponent - self._bucket_bias
        return (values >> (bucket + self.unit)) + ((bucket + 1) << self.half_mag) - self.half


_LAYOUT = _Layout()
_METRIC_BOUNDS_NS = np.array([round(b * 1e9) for b in METRIC_BUCKETS_S], dtype=np.int64)


@dataclass
class SinkLatency:
    """What a sink replica measured, per second of run time since ``t0``: its encoded
    latency histogram (:func:`new_histogram` layout, nanoseconds) and the bitmap of the
    milliseconds of that second in which it received output (``numpy.packbits`` order)."""

    histograms: dict[int, bytes] = field(default_factory=dict)
    output_ms: dict[int, bytes] = field(default_factory=dict)


class LatencyRecorder:
    """A sink replica's latency and output-time record (see the module documentation).
    Rows received before ``from_ns`` (``t0 + warmup``) are left out."""

    def __init__(self, t0_ns: int, from_ns: int | None = None) -> None:
        self.t0_ns = t0_ns
        self.from_ns = t0_ns if from_ns is None else from_ns
        self.out = SinkLatency()
        self._second: int | None = None
        self._last_ns = 0
        self._counts = np.zeros(_LAYOUT.counts_len, dtype=np.int64)
        self._bits = bytearray(_MS_PER_S // 8)
        self._pending: list[np.ndarray] = []
        self._pending_rows = 0
        self.buckets = np.zeros(len(METRIC_BUCKETS_S) + 1, dtype=np.int64)
        """Rows recorded so far per bucket of :data:`METRIC_BUCKETS_S` (not cumulative; the
        last: above the largest bound), up to the last :meth:`flush`."""
        self.sum_ns = 0
        """The sum of every latency in :attr:`buckets`."""

    def record(self, now_ns: int, event_time_ns: np.ndarray) -> None:
        """Rows received at ``now_ns`` with these event times (NaN, from a null: not
        measured)."""
        # Receive times never go back (a wall clock may): a row is never put in a second
        # already encoded.
        now_ns = max(now_ns, self._last_ns)
        self._last_ns = now_ns
        if now_ns < self.from_ns:
            return
        if event_time_ns.dtype.kind == "f":
            event_time_ns = event_time_ns[~np.isnan(event_time_ns)].astype(np.int64)
        if not len(event_time_ns):
            return
        ms = (now_ns - self.t0_ns) // _NS_PER_MS
        second, slot = divmod(ms, _MS_PER_S)
        if second != self._second:
            self._seal()
            self._second = second
        self._bits[slot >> 3] |= 0x80 >> (slot & 7)
        self._pending.append(now_ns - event_time_ns)
        self._pending_rows += len(event_time_ns)
        if self._pending_rows >= FLUSH_ROWS:
            self.flush()

    def finish(self) -> SinkLatency:
        """Encode the last second; what was recorded."""
        self._seal()
        self._second = None
        return self.out

    def flush(self) -> None:
        """Count the latencies waiting in the buffer (in this second's histogram and in
        :attr:`buckets`): a sealed second or a metrics snapshot needs them."""
        if not self._pending:
            return
        values = np.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]
        self._pending, self._pending_rows = [], 0
        np.clip(values, 0, HIGHEST_NS, out=values)
        self._counts += np.bincount(_LAYOUT.index(values), minlength=_LAYOUT.counts_len)
        # A value equal to a bound belongs to that bucket (Prometheus' ``le``).
        where = np.searchsorted(_METRIC_BOUNDS_NS, values, side="left")
        self.buckets += np.bincount(where, minlength=len(self.buckets))
        self.sum_ns += int(values.sum())

    def _seal(self) -> None:
        """Encode the second in progress, and start afresh."""
        if self._second is None:
            return
        self.flush()
        hist = new_histogram()
        for i in np.flatnonzero(self._counts):
            hist.record_value(hist.get_value_from_index(int(i)), int(self._counts[i]))
        self.out.histograms[self._second] = bytes(hist.encode())
        self.out.output_ms[self._second] = bytes(self._bits)
        self._counts[:] = 0
        self._bits = bytearray(len(self._bits))


@dataclass
class Summary:
    """The latency figures of a run, in ms (see the module documentation)."""

    p50_ms: float
    p99_ms: float
    max_ms: float
    per_second_p99_ms: list[float | None]
    max_gap_ms: float


def summarize(logs: Iterable[SinkLatency], skip_ns: int = 0) -> Summary | None:
    """Merge the sink replicas' records; None if they recorded no row. Seconds that end by
    ``skip_ns`` after t0, and milliseconds that end by it, are left out (a guard for a
    worker that was not told the warm-up: the sinks leave it out themselves, exactly)."""
    seconds: dict[int, HdrHistogram] = {}
    bits: dict[int, np.ndarray] = {}
    for log in logs:
        for s, blob in log.histograms.items():
            if (s + 1) * _NS_PER_S <= skip_ns:
                continue
            seconds.setdefault(s, new_histogram()).add(HdrHistogram.decode(blob, b64_wrap=False))
        for s, blob in log.output_ms.items():
            got = np.frombuffer(blob, dtype=np.uint8)
            bits[s] = bits[s] | got if s in bits else got.copy()
    total = new_histogram()
    for h in seconds.values():
        total.add(h)
    if not total.get_total_count():
        return None
    p = total.get_percentile_to_value_dict([50, 99])
    return Summary(
        p50_ms=p[50] / _NS_PER_MS,
        p99_ms=p[99] / _NS_PER_MS,
        max_ms=total.get_max_value() / _NS_PER_MS,
        per_second_p99_ms=[
            seconds[s].get_value_at_percentile(99) / _NS_PER_MS
            if s in seconds and seconds[s].get_total_count()
            else None
            for s in range(max(seconds) + 1)
        ],
        max_gap_ms=_longest_gap_ms(bits, skip_ns),
    )


def longest_gap_ms(log: SinkLatency, skip_ns: int = 0) -> float:
    """The longest stretch, in ms, between two milliseconds in which one sink replica
    received output (0.0 if it received output in fewer than two)."""
    bits = {s: np.frombuffer(b, dtype=np.uint8) for s, b in log.output_ms.items()}
    return _longest_gap_ms(bits, skip_ns)


def _longest_gap_ms(bits: dict[int, np.ndarray], skip_ns: int) -> float:
    if not bits:
        return 0.0
    first, last = min(bits), max(bits)
    timeline = np.zeros((last - first + 1, _MS_PER_S // 8), dtype=np.uint8)
    for s, b in bits.items():
        timeline[s - first] = b
    ms = np.flatnonzero(np.unpackbits(timeline.ravel())) + first * _MS_PER_S
    ms = ms[(ms + 1) * _NS_PER_MS > skip_ns]
    return float(np.diff(ms).max()) if len(ms) > 1 else 0.0
