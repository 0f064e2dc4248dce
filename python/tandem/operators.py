"""Operators: what a task partition does to its ordered input rows.

Every operator is a function of its *ordered input batch sequence* (and, for two-input
operators, of the order in which batches of the two inputs interleave). The batch is the
unit of determinism (DESIGN §2 invariant 1): replicas of one partition are called with the
same batches in the same order, so a function need only be deterministic for a given input
batch — it may compute over its whole batch (a mean, a rank, two filters concatenated), as
a PySpark ``mapInArrow`` function does. What it must not use is anything else that differs
between replicas: clocks, fresh randomness, the replica index, Python's hash seed. The
digest check catches a function that does (``tandem.DeterminismError``).

Life cycle, driven by the engine (and by :mod:`tandem.reference`) through
:class:`tandem.plan.TaskInstance`::

    op = copy of the plan's prototype;  op.open(ctx)
    op.on_batch(batch, input_index) -> batch | None      for every input data batch
    op.on_watermark(wm_ns) -> batch | None               every input passed event time wm_ns
    op.on_watermark(WATERMARK_MAX)                       end of input: flush everything
    op.snapshot() -> bytes  /  op.restore(bytes)         replica recovery (DESIGN §4)

Event time: every source row carries ``event_time_ns`` (int64, its logical release time) and
operators must pass it through. A watermark ``wm_ns`` promises that every row with
``event_time_ns < wm_ns`` has been delivered.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tandem.exceptions import ConfigError

EVENT_TIME = "event_time_ns"
"""Column every row carries: its logical release time at the source, in ns (int64)."""
SOURCE_SEQ = "source_seq"
"""Column source rows carry: the row's index within its source (int64)."""
WATERMARK_MAX = (1 << 63) - 1
"""The watermark of end of input: closes every window."""

AGGREGATES = ("sum", "count", "min", "max", "mean")

BatchFn = Callable[[pa.RecordBatch], Any]


@dataclass(frozen=True)
class OperatorContext:
    """Where an operator instance runs. ``key`` is the column its input is hash-partitioned
    on (``key_by``/``join``/``window`` key), ``t0_ns`` the job's logical time origin."""

    task: str
    task_id: int
    partition: int
    parallelism: int
    replica: int = 0
    key: str | None = None
    t0_ns: int = 0


def empty_batch(schema: pa.Schema) -> pa.RecordBatch:
    """A zero-row batch of ``schema`` (used to infer output schemas)."""
    return pa.RecordBatch.from_pylist([], schema=schema)


def as_batch(value: Any, what: str) -> pa.RecordBatch | None:
    """Normalise an operator's return value: a RecordBatch, a Table (combined into one
    batch) or None. Anything else is a ConfigError naming ``what``."""
    if value is None:
        return None
    if isinstance(value, pa.RecordBatch):
        return value
    if isinstance(value, pa.Table):
        return (
            value.combine_chunks().to_batches()[0] if value.num_rows else empty_batch(value.schema)
        )
    raise ConfigError(
        f"{what} returned {type(value).__name__}; it must return a pyarrow.RecordBatch "
        "(or a pyarrow.Table, or None for no output)"
    )


def check_event_time(schema: pa.Schema, what: str) -> None:
    """Raise ConfigError unless ``schema`` carries the int64 ``event_time_ns`` column."""
    idx = schema.get_field_index(EVENT_TIME)
    if idx < 0:
        raise ConfigError(
            f"{what} drops the {EVENT_TIME!r} column (its output columns are "
            f"{schema.names}); operators must pass {EVENT_TIME!r} through unchanged — "
            "keep it in the batch you return"
        )
    if schema.field(idx).type != pa.int64():
        raise ConfigError(
            f"{what} outputs {EVENT_TIME!r} as {schema.field(idx).type}; it must stay int64"
        )


class Operator:
    """Base class of everything that runs inside an operator task partition.

    Subclasses override :meth:`on_batch` (and :meth:`on_watermark` if they hold rows back
    until event time passes), declare their output with :meth:`output_schema`, and keep
    any state that must survive a replica recovery in what :meth:`snapshot` returns.
    One instance serves exactly one task partition; the plan keeps an unopened prototype
    and hands each partition a deep copy.
    """

    ctx: OperatorContext | None = None

    def output_schema(self, inputs: list[pa.Schema]) -> pa.Schema:
        """The schema of every batch this operator returns, given its input schemas
        (one per input index). The default: the schema of the only input."""
        return inputs[0]

    def open(self, ctx: OperatorContext) -> None:
        """Called once before any input. The default records ``ctx`` as ``self.ctx``."""
        self.ctx = ctx

    def on_batch(self, batch: pa.RecordBatch, input_index: int = 0) -> pa.RecordBatch | None:
        """Process the next rows of input ``input_index``; return output rows or None."""
        raise NotImplementedError(f"{type(self).__name__} must implement on_batch()")

    def on_watermark(self, wm_ns: int) -> pa.RecordBatch | None:
        """Every input has passed event time ``wm_ns``; return rows that became final."""
        return None

    def snapshot(self) -> bytes:
        """The operator's state as bytes (restored by :meth:`restore`)."""
        return b""

    def state_size(self) -> int | None:
        """About how many bytes :meth:`snapshot` would return now, if that is cheap to
        tell (no copy, no walk over a large state); None when it is not. A cut of this
        replica for a rebuilt twin or a savepoint snapshots a state known to be small in
        place, and any other in a forked child (a fork costs the worker a few ms
        whatever the state's size, a copy of a large state much more). The default: 0
        for an operator whose :meth:`snapshot` is this class's (it has no state), else
        None."""
        return 0 if type(self).snapshot is Operator.snapshot else None

    def restore(self, data: bytes) -> None:
        """Reset the state to what :meth:`snapshot` returned."""
        if data:
            raise ConfigError(
                f"{type(self).__name__} is stateless but was asked to restore "
                f"{len(data)} bytes of state; override restore() if it has state"
            )

    def keyed_state(self) -> dict | None:
        """The state as one entry per key of the task's keyed input (key value → what
        the operator keeps for it), so that a task resumed from a savepoint at another
        parallelism can hand each entry to the partition that now owns its key's group.
        Called on a copy the saved state was loaded into with :meth:`restore` (never
        opened). None: the state is not kept per key, and a task with such a state
        resumes only at the parallelism it was saved at — the default for an operator
        with a :meth:`snapshot` of its own; ``{}`` for one without state."""
        return {} if type(self).snapshot is Operator.snapshot else None

    def restore_keyed(self, state: dict) -> None:
        """Start from ``state``: the entries of :meth:`keyed_state` of every saved
        partition whose keys this partition owns now, in saved-partition order. Override
        with :meth:`keyed_state`."""
        if state:
            raise ConfigError(
                f"{self.describe()} was handed {len(state)} keyed state entries but does not "
                "implement restore_keyed(); override it with keyed_state()"
            )

    def describe(self) -> str:
        """Short human name used in error messages."""
        return type(self).__name__


def _fn_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


class _FnOperator(Operator):
    """An operator built from a user function of one batch."""

    kind = "fn"

    def __init__(self, fn: BatchFn, schema: pa.Schema | None = None) -> None:
        if not callable(fn):
            raise ConfigError(
                f"{self.kind}() needs a function of a pyarrow.RecordBatch, got "
                f"{type(fn).__name__} {fn!r}"
            )
        self.fn = fn
        self.schema = schema

    def describe(self) -> str:
        return f"{self.kind}({_fn_name(self.fn)})"

    def output_schema(self, inputs: list[pa.Schema]) -> pa.Schema:
        if self.schema is not None:
            return self.schema
        try:
            out = self.fn(empty_batch(inputs[0]))
        except Exception as exc:
            raise ConfigError(
                f"{self.describe()} failed on an empty batch of its input schema while "
                f"inferring its output schema ({type(exc).__name__}: {exc}); make the "
                "function handle zero rows or declare the output with schema=pa.schema(...)"
            ) from exc
        out = as_batch(out, self.describe())
        if out is None:
            raise ConfigError(
                f"{self.describe()} returned None for an empty batch, so its output schema "
                "cannot be inferred; declare it with schema=pa.schema(...)"
            )
        return out.schema


class Map(_FnOperator):
    """``fn(batch) -> batch`` with the same number of rows (one output row per input row)."""

    kind = "map"

    def on_batch(self, batch: pa.RecordBatch, input_index: int = 0) -> pa.RecordBatch | None:
        out = as_batch(self.fn(batch), self.describe())
        if out is None or out.num_rows != batch.num_rows:
            got = "None" if out is None else f"{out.num_rows} rows"
            raise ConfigError(
                f"{self.describe()} returned {got} for a batch of {batch.num_rows} rows; map "
                "must return one row per input row — use flat_map to change the row count"
            )
        return out


class FlatMap(_FnOperator):
    """``fn(batch) -> batch | None`` with any number of rows (zero included)."""

    kind = "flat_map"

    def on_batch(self, batch: pa.RecordBatch, input_index: int = 0) -> pa.RecordBatch | None:
        return as_batch(self.fn(batch), self.describe())


class Filter(_FnOperator):
    """``fn(batch) -> boolean mask`` (Array or ChunkedArray); keeps rows where the mask
    is true (null counts as false)."""

    kind = "filter"

    def _mask(self, batch: pa.RecordBatch) -> pa.Array:
        mask = self.fn(batch)
        if isinstance(mask, pa.ChunkedArray):
            mask = mask.combine_chunks()
        elif isinstance(mask, np.ndarray):
            mask = pa.array(mask)
        if not isinstance(mask, pa.Array) or mask.type != pa.bool_():
            got = mask.type if isinstance(mask, pa.Array) else type(mask).__name__
            raise ConfigError(
                f"{self.describe()} returned {got}; a filter function must return a boolean "
                "pyarrow array (e.g. pc.greater(batch['value'], 0.5))"
            )
        if len(mask) != batch.num_rows:
            raise ConfigError(
                f"{self.describe()} returned a mask of {len(mask)} values for a batch of "
                f"{batch.num_rows} rows; the mask needs one value per row"
            )
        return mask

    def output_schema(self, inputs: list[pa.Schema]) -> pa.Schema:
        try:
            self._mask(empty_batch(inputs[0]))
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(
                f"{self.describe()} failed on an empty batch of its input schema "
                f"({type(exc).__name__}: {exc}); make the function handle zero rows"
            ) from exc
        return inputs[0]

    def on_batch(self, batch: pa.RecordBatch, input_index: int = 0) -> pa.RecordBatch | None:
        mask = self._mask(batch)
        kept = mask.true_count  # nulls are not counted: they drop, like false
        if kept == batch.num_rows:
            return batch  # the same rows, without a copy
        if kept == 0:
            return None
        return batch.filter(mask, null_selection_behavior="drop")


class Union(Operator):
    """Identity over any number of inputs: the merge decides the interleaving."""

    def output_schema(self, inputs: list[pa.Schema]) -> pa.Schema:
        return inputs[0]

    def on_batch(self, batch: pa.RecordBatch, input_index: int = 0) -> pa.RecordBatch | None:
        return batch


SIZED_KEYS = 4096
"""The most keys :meth:`KeyedProcess.state_size` walks to size a state."""


def _flat_size(x: Any) -> int | None:
    """About the bytes ``x`` pickles to, for a scalar, a string, bytes or a numpy array;
    None for anything else (a container: not walked)."""
    if x is None or isinstance(x, (bool, int, float)):
        return 16
    if isinstance(x, (str, bytes, bytearray)):
        return 16 + len(x)
    if isinstance(x, np.ndarray):
        return 128 + x.nbytes
    return None


class KeyedProcess(Operator):
    """Base class of keyed stateful operators (use after ``key_by``).

    Implement :meth:`process`. ``state`` is a dict owned by this operator instance (one per
    task partition), kept across batches: typically key → per-key value. The batch holds
    the next rows of this partition in input order; all rows of a key land in the same
    partition (the input is hash-partitioned on ``self.ctx.key``). ``process`` may look at
    its whole batch (every replica gets the same batches); carry what must outlive the
    batch in ``state``. The default :meth:`snapshot`/:meth:`restore` pickle ``state``, so
    keep it picklable (or override both).

    The output schema is the class attribute ``schema`` if set, else inferred by calling
    ``process`` on an empty batch with a scratch copy of the operator.
    """

    schema: pa.Schema | None = None

    @property
    def state(self) -> dict:
        """This partition's state (created empty on first use)."""
        st = self.__dict__.get("_state")
        if st is None:
            st = self.__dict__["_state"] = {}
        return st

    def process(self, batch: pa.RecordBatch, state: dict) -> pa.RecordBatch | None:
        """Process the next input rows; return output rows or None."""
        raise NotImplementedError(f"{type(self).__name__} must implement process(batch, state)")

    def on_batch(self, batch: pa.RecordBatch, input_index: int = 0) -> pa.RecordBatch | None:
        return as_batch(self.process(batch, self.state), self.describe())

    def output_schema(self, inputs: list[pa.Schema]) -> pa.Schema:
        if self.schema is not None:
            return self.schema
        scratch = copy.deepcopy(self)
        scratch.__dict__.pop("_state", None)
        if self.ctx is None:
            scratch.ctx = OperatorContext(task="schema", task_id=-1, partition=0, parallelism=1)
        try:
            out = scratch.on_batch(empty_batch(inputs[0]))
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(
                f"{self.describe()}.process failed on an empty batch while inferring its output "
                f"schema ({type(exc).__name__}: {exc}); handle zero rows or set the class "
                "attribute schema = pa.schema(...)"
            ) from exc
        if out is None:
            raise ConfigError(
                f"{self.describe()}.process returned None for an empty batch, so its output "
                "schema cannot be inferred; set the class attribute schema = pa.schema(...)"
            )
        return out.schema

    def snapshot(self) -> bytes:
        return pickle.dumps(self.state, protocol=5)

    def restore(self, data: bytes) -> None:
        self.__dict__["_state"] = pickle.loads(data) if data else {}

    def keyed_state(self) -> dict | None:
        """``state`` itself (its keys must be the input's key values) with the default
        :meth:`snapshot`; None if :meth:`snapshot` is overridden (override this too)."""
        if type(self).snapshot is not KeyedProcess.snapshot:
            return super().keyed_state()
        return self.state

    def restore_keyed(self, state: dict) -> None:
        self.__dict__["_state"] = dict(state)

    def state_size(self) -> int | None:
        """With the default :meth:`snapshot`: the size of a state of at most
        :data:`SIZED_KEYS` keys whose keys and values are scalars, strings, bytes or
        numpy arrays (their data, plus a little per entry); None for anything else, or
        an overridden ``snapshot`` (override ``state_size`` with it)."""
        if type(self).snapshot is not KeyedProcess.snapshot:
            return super().state_size()
        state = self.state
        if len(state) > SIZED_KEYS:
            return None
        total = 0
        for k, v in state.items():
            for x in (k, v):
                n = _flat_size(x)
                if n is None:
                    return None
                total += n
        return total


def _group_codes(keys: pa.Array) -> tuple[np.ndarray, list]:
    """Per row, the index of its key in the returned list of distinct keys (first
    appearance order). Null keys get code -1."""
    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks()
    enc = pc.dictionary_encode(keys)
    codes = enc.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    return codes, enc.dictionary.to_pylist()


# Up to this many rows, a plain loop over the keys beats the vectorised path (one numpy
# call costs about as much as a few dozen dict operations); measured crossing: ~8,000 rows.
_LOOP_ROWS = 4096


def _running_counts(keys: list, state: dict) -> pa.Array:
    """Per key in ``keys``, the running count with ``state`` (updated); null keys → null."""
    get = state.get
    out = []
    append = out.append
    for k in keys:
        if k is None:
            append(None)
            continue
        c = get(k, 0) + 1
        state[k] = c
        append(c)
    return pa.array(out, pa.int64())


class CountPerKey(KeyedProcess):
    """Emits every input row with a running ``count`` (int64) of the rows seen so far for
    its key, this row included. Batch-invariant: the count of a row depends only on the
    rows before it. Rows with a null key get a null count."""

    def __init__(self, column: str = "count") -> None:
        self.column = column

    def process(self, batch: pa.RecordBatch, state: dict) -> pa.RecordBatch:
        key = self.ctx.key if self.ctx is not None and self.ctx.key else None
        if key is None:
            raise ConfigError("CountPerKey needs a keyed input: use it after key_by(column)")
        keys = batch.column(key)
        if len(keys) <= _LOOP_ROWS:
            return batch.append_column(self.column, _running_counts(keys.to_pylist(), state))
        codes, uniques = _group_codes(keys)
        n = len(codes)
        counts = np.zeros(n, dtype=np.int64)
        valid = codes >= 0
        if n and valid.any():
            vcodes = codes[valid]
            order = np.argsort(vcodes, kind="stable")
            sorted_codes = vcodes[order]
            starts = np.flatnonzero(np.r_[True, sorted_codes[1:] != sorted_codes[:-1]])
            sizes = np.diff(np.r_[starts, len(sorted_codes)])
            within = np.arange(len(sorted_codes)) - np.repeat(starts, sizes)
            base = np.array([state.get(u, 0) for u in uniques], dtype=np.int64)
            ranked = np.empty(len(sorted_codes), dtype=np.int64)
            ranked[order] = within + 1 + base[sorted_codes]
            counts[valid] = ranked
            for code, size in zip(sorted_codes[starts].tolist(), sizes.tolist(), strict=True):
                state[uniques[code]] = int(base[code]) + size
        col = pa.array(counts, pa.int64(), mask=~valid if not valid.all() else None)
        return batch.append_column(self.column, col)


class Join(Operator):
    """Events (input 0) enriched with the latest rule (input 1) for their key.

    State: per key, the value columns of the most recent rule row (a later rule row for a
    key replaces the earlier one). Each event row is emitted with the rule columns current
    *at its position in the merged input order*; ``how="inner"`` drops events whose key
    has no rule yet (and events with a null key), ``how="left"`` keeps them with null rule
    columns. Output columns: every event column, then every rule column except the join
    key, ``event_time_ns`` and ``source_seq``. Rule rows produce no output.
    """

    def __init__(self, on: str, how: str = "inner") -> None:
        if how not in ("inner", "left"):
            raise ConfigError(f"join how={how!r} is not supported; use 'inner' or 'left'")
        self.on = on
        self.how = how
        self.rules: dict[Any, tuple] = {}
        self.rule_fields: list[pa.Field] = []

    def describe(self) -> str:
        return f"join(on={self.on!r}, how={self.how!r})"

    def output_schema(self, inputs: list[pa.Schema]) -> pa.Schema:
        events, rules = inputs
        skip = {self.on, EVENT_TIME, SOURCE_SEQ}
        self.rule_fields = [f for f in rules if f.name not in skip]
        clash = [f.name for f in self.rule_fields if f.name in events.names]
        if clash:
            raise ConfigError(
                f"{self.describe()}: rule columns {clash} also exist in the event stream; "
                "rename them on one side (e.g. with a map before the join)"
            )
        fields = list(events) + [f.with_nullable(True) for f in self.rule_fields]
        return pa.schema(fields)

    def on_batch(self, batch: pa.RecordBatch, input_index: int = 0) -> pa.RecordBatch | None:
        if input_index == 1:
            self._update_rules(batch)
            return None
        return self._enrich(batch)

    def _update_rules(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        codes, uniques = _group_codes(batch.column(self.on))
        # Last row of each key wins: scan the codes backwards for the first occurrence.
        rev = codes[::-1]
        valid_codes, first_rev = np.unique(rev, return_index=True)
        last_rows = len(codes) - 1 - first_rev
        cols = [batch.column(f.name) for f in self.rule_fields]
        # Apply in row order so the dict's insertion order is a function of the input.
        for code, row in sorted(
            zip(valid_codes.tolist(), last_rows.tolist(), strict=True), key=lambda cr: cr[1]
        ):
            if code < 0:
                continue
            self.rules[uniques[code]] = tuple(c[row].as_py() for c in cols)

    def _enrich(self, batch: pa.RecordBatch) -> pa.RecordBatch | None:
        codes, uniques = _group_codes(batch.column(self.on))
        slot = {u: i for i, u in enumerate(uniques)}
        matched = [u for u in uniques if u in self.rules]
        has = np.zeros(len(uniques) + 1, dtype=bool)  # last slot: null key
        pos = np.full(len(uniques) + 1, -1, dtype=np.int64)
        for j, u in enumerate(matched):
            has[slot[u]] = True
            pos[slot[u]] = j
        row_slot = np.where(codes >= 0, codes, len(uniques))
        row_has = has[row_slot]
        if self.how == "inner":
            keep = np.flatnonzero(row_has)
            if len(keep) == 0:
                return None
            events = batch.take(pa.array(keep))
            take = pos[row_slot[keep]]
        else:
            events = batch
            take = pos[row_slot]
        idx = pa.array(take, pa.int64(), mask=take < 0)
        cols = list(events.columns)
        for i, f in enumerate(self.rule_fields):
            values = pa.array([self.rules[u][i] for u in matched], f.type)
            cols.append(values.take(idx))
        schema = pa.schema(list(batch.schema) + [f.with_nullable(True) for f in self.rule_fields])
        return pa.RecordBatch.from_arrays(cols, schema=schema)

    def snapshot(self) -> bytes:
        return pickle.dumps(self.rules, protocol=5)

    def restore(self, data: bytes) -> None:
        self.rules = pickle.loads(data) if data else {}

    def keyed_state(self) -> dict | None:
        return self.rules

    def restore_keyed(self, state: dict) -> None:
        self.rules = dict(state)


class Window(Operator):
    """Tumbling event-time window aggregate.

    Windows are ``size_ns`` long and aligned to the job's logical time origin ``t0_ns``
    (window ``w`` covers ``[t0 + w*size, t0 + (w+1)*size)``), so a job's window contents do
    not depend on the wall-clock time it started at. Rows are held until a watermark
    passes the window end; then one row per (window, key) is emitted, ordered by window
    start, then key. Output columns: the key (if any), ``window_start_ns``,
    ``window_end_ns``, ``event_time_ns`` (= window end - 1, so the result is on time for
    downstream windows) and one column per aggregate. Aggregates are computed on the
    window's rows in input order in one pass (no partial sums), so a float sum is the same
    bits however the input was batched. Rows arriving after their window closed (only
    possible if an upstream operator rewrote ``event_time_ns``) are dropped and counted in
    ``late_rows``.
    """

    def __init__(self, size_ms: float, agg: Mapping[str, tuple[str, str]], key: str | None):
        self.size_ms = size_ms
        self.size_ns = round(size_ms * 1_000_000)
        self.agg = dict(agg)
        self.key = key
        self.pending: list[pa.RecordBatch] = []
        self.closed_before = -(1 << 63)  # windows with index < this are closed
        self.late_rows = 0
        self._out_schema: pa.Schema | None = None

    def describe(self) -> str:
        return f"window(size_ms={self.size_ms}, key={self.key!r})"

    def _input_columns(self) -> list[str]:
        cols = [] if self.key is None else [self.key]
        for col, _ in self.agg.values():
            if col not in cols:
                cols.append(col)
        return cols

    def output_schema(self, inputs: list[pa.Schema]) -> pa.Schema:
        schema = inputs[0]
        proj = pa.schema([schema.field(c) for c in self._input_columns()])
        out = self._aggregate(
            pa.Table.from_batches([], schema=proj).append_column("__w", pa.array([], pa.int64())),
            t0_ns=0,
        )
        self._out_schema = out.schema
        return out.schema

    def _window_index(self, event_time: pa.Array) -> np.ndarray:
        t0 = self.ctx.t0_ns if self.ctx is not None else 0
        et = event_time.to_numpy(zero_copy_only=False).astype(np.int64)
        return (et - t0) // self.size_ns

    def on_batch(self, batch: pa.RecordBatch, input_index: int = 0) -> pa.RecordBatch | None:
        if batch.num_rows == 0:
            return None
        w = self._window_index(batch.column(EVENT_TIME))
        late = w < self.closed_before
        cols = [batch.column(c) for c in self._input_columns()]
        names = [*self._input_columns(), "__w"]
        proj = pa.RecordBatch.from_arrays([*cols, pa.array(w, pa.int64())], names=names)
        if late.any():
            self.late_rows += int(late.sum())
            proj = proj.filter(pa.array(~late))
        if proj.num_rows:
            self.pending.append(proj)
        return None

    def on_watermark(self, wm_ns: int) -> pa.RecordBatch | None:
        t0 = self.ctx.t0_ns if self.ctx is not None else 0
        # Window w ends at t0 + (w+1)*size; it is complete once wm >= that end.
        close_before = 1 << 62 if wm_ns >= WATERMARK_MAX else (wm_ns - t0) // self.size_ns
        if close_before <= self.closed_before:
            return None
        self.closed_before = close_before
        if not self.pending:
            return None
        table = pa.Table.from_batches(self.pending).combine_chunks()
        w = table.column("__w").to_numpy()
        done = w < close_before
        if not done.any():
            return None
        keep = table.filter(pa.array(~done))
        self.pending = keep.combine_chunks().to_batches() if keep.num_rows else []
        out = self._aggregate(table.filter(pa.array(done)), t0)
        if self._out_schema is not None:
            out = out.cast(self._out_schema)
        batches = out.combine_chunks().to_batches()
        return batches[0] if batches else None

    def _aggregate(self, table: pa.Table, t0_ns: int) -> pa.Table:
        keys = ["__w"] if self.key is None else ["__w", self.key]
        specs = []
        renames = []
        for out_name, (col, fn) in self.agg.items():
            specs.append((col, fn))
            renames.append(out_name)
        grouped = table.group_by(keys, use_threads=False).aggregate(specs)
        # pyarrow names aggregate columns "<col>_<fn>"; map them to the requested names.
        cols = {}
        for out_name, (col, fn) in zip(renames, specs, strict=True):
            cols[out_name] = grouped.column(f"{col}_{fn}")
        w = grouped.column("__w")
        start = pc.add(pc.multiply(w, self.size_ns), t0_ns)
        end = pc.add(start, self.size_ns)
        arrays = []
        names = []
        if self.key is not None:
            arrays.append(grouped.column(self.key))
            names.append(self.key)
        arrays += [start, end, pc.subtract(end, 1)]
        names += ["window_start_ns", "window_end_ns", EVENT_TIME]
        for name, arr in cols.items():
            arrays.append(arr)
            names.append(name)
        out = pa.Table.from_arrays(arrays, names=names)
        sort = [("window_start_ns", "ascending")]
        if self.key is not None:
            sort.append((self.key, "ascending"))
        return out.sort_by(sort)

    def snapshot(self) -> bytes:
        sink = pa.BufferOutputStream()
        if self.pending:
            with pa.ipc.new_stream(sink, self.pending[0].schema) as w:
                for b in self.pending:
                    w.write_batch(b)
        return pickle.dumps(
            (self.closed_before, self.late_rows, sink.getvalue().to_pybytes()), protocol=5
        )

    def restore(self, data: bytes) -> None:
        self.closed_before, self.late_rows, ipc = pickle.loads(data)
        self.pending = list(pa.ipc.open_stream(ipc)) if ipc else []

    def keyed_state(self) -> dict | None:
        """Per key of the open windows (a keyed window): ``(closed_before, late_rows,
        rows)``, its rows as Arrow IPC, with the window index the task has closed windows
        before (the same in every partition: each sees every heartbeat); the partition's
        late-row count goes with its first key (and is dropped with no open window). Rows
        with a null key are kept under ``None`` (they all reach partition 0). None for a
        window without a key (one global window: nothing to split)."""
        if self.key is None:
            return None
        out: dict = {}
        if not self.pending:
            return out
        table = pa.Table.from_batches(self.pending).combine_chunks()
        if not table.num_rows:
            return out
        codes, keys = _group_codes(table.column(self.key))

        def ipc(rows: pa.Table) -> bytes:
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, rows.schema) as w:
                w.write_table(rows)
            return sink.getvalue().to_pybytes()

        # One stable sort: the null key's rows (code -1) first, then each key's in order of
        # first appearance, each key's rows in their input order.
        order = np.argsort(codes, kind="stable")
        late = self.late_rows
        for rows in np.split(order, np.flatnonzero(np.diff(codes[order])) + 1):
            code = int(codes[rows[0]])
            key = None if code < 0 else keys[code]
            out[key] = (self.closed_before, late, ipc(table.take(pa.array(rows))))
            late = 0
        return out

    def restore_keyed(self, state: dict) -> None:
        """The open windows' rows of the keys this partition owns, in saved-partition
        order (each key's rows in their input order)."""
        closed = [c for c, _, _ in state.values()]
        self.closed_before = max(closed) if closed else -(1 << 63)
        self.late_rows = sum(late for _, late, _ in state.values())
        batches = []
        for _, _, ipc in state.values():
            if ipc:
                batches += [b for b in pa.ipc.open_stream(ipc) if b.num_rows]
        self.pending = batches


def validate_aggregates(agg: Any, schema: pa.Schema, what: str) -> dict[str, tuple[str, str]]:
    """Check a window's ``agg`` mapping against its input schema."""
    if not isinstance(agg, Mapping) or not agg:
        raise ConfigError(
            f"{what}: agg must be a non-empty dict like {{'total': ('value', 'sum')}}, got {agg!r}"
        )
    out = {}
    for name, spec in agg.items():
        if not isinstance(spec, tuple) or len(spec) != 2:
            raise ConfigError(
                f"{what}: agg[{name!r}] must be a (column, function) pair, got {spec!r}"
            )
        col, fn = spec
        if fn not in AGGREGATES:
            raise ConfigError(
                f"{what}: agg[{name!r}] uses unknown function {fn!r}; use one of {AGGREGATES}"
            )
        if col not in schema.names:
            raise ConfigError(
                f"{what}: agg[{name!r}] reads unknown column {col!r}; the input columns are "
                f"{schema.names}"
            )
        typ = schema.field(col).type
        numeric = pa.types.is_integer(typ) or pa.types.is_floating(typ)
        if fn in ("sum", "mean") and not numeric:
            raise ConfigError(
                f"{what}: agg[{name!r}] = {fn} over column {col!r} of type {typ}; {fn} needs "
                "an integer or floating-point column"
            )
        out[str(name)] = (col, fn)
    reserved = {"window_start_ns", "window_end_ns", EVENT_TIME}
    bad = sorted(reserved & set(out))
    if bad:
        raise ConfigError(f"{what}: output names {bad} are reserved; pick other names")
    return out


__all__ = [
    "AGGREGATES",
    "EVENT_TIME",
    "SOURCE_SEQ",
    "WATERMARK_MAX",
    "CountPerKey",
    "Filter",
    "FlatMap",
    "Join",
    "KeyedProcess",
    "Map",
    "Operator",
    "OperatorContext",
    "Union",
    "Window",
    "as_batch",
    "check_event_time",
    "empty_batch",
    "validate_aggregates",
]
