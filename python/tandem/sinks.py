"""Sinks: the consumers at the end of a job.

A sink task partition deduplicates its input like any receiver (the engine's job) and then
hands every row exactly once, in consumption order, to its sink instance::

    sink.open(partition, parallelism, schema)
    sink.write(batch)            # any number of times
    part = sink.close()          # what this partition contributes to the job's Result

The plan keeps an unopened prototype of each sink; every sink partition gets its own deep
copy, so a sink keeps per-partition state in ``self``. ``close()`` returns a picklable value
(or None) that the engine ships back to the coordinator; :meth:`Sink.combine` merges the
partitions' values, in partition order, into what the Result exposes, and
:meth:`Sink.rows` reads the rows back out of that value (from the files a file sink wrote),
so that the engines can compare them with the reference executor's, row by row.

A sink that is :attr:`Sink.replicable` runs, like every other task, as r replicas on
different workers (``Stream.sink(..., replication=)``; by default the job's): each replica
receives every row of its partition once (first come, first served across its input
channels, so the replicas hold the same rows, maybe interleaved differently) and keeps a
copy of its own that nothing outside sees yet. When the run ends, the engine takes one
complete copy per partition — the least interrupted of those that finished — into
:meth:`Sink.combine`, which publishes it (a file sink renames its staged file into place),
and hands every other replica's copy to :meth:`Sink.discard`, a lost replica's included.
Losing a sink replica then loses nothing while a twin of it lives.

A sink that writes outside as it goes can still be replicated if it is :attr:`Sink.owned`
(``Kafka``): one replica of each partition writes, its twins hold what came since its last
commit, and when it is lost a twin fences it and writes on from that commit
(:meth:`Sink.take_over`).
"""

from __future__ import annotations

import abc
import contextlib
import os
import re
import time
from typing import Any

import pyarrow as pa

from tandem.exceptions import ConfigError, TandemError
from tandem.operators import EVENT_TIME


def _not_restartable(sink: Sink) -> str:
    return (
        f"{sink.describe()} is not restartable: only a sink that stores its input position "
        "with its output (keep_positions, as td.sinks.Kafka does) can be restarted"
    )


class Sink(abc.ABC):
    """Base class of sinks."""

    partition: int = 0
    parallelism: int = 1
    schema: pa.Schema | None = None
    restartable: bool = False
    """Whether the engine can restart a lost partition of this sink, without loss or
    duplicates: the sink stores, atomically with the rows it makes durable, where its
    input stood after them (:meth:`mark`), and gives the last position stored back after
    a loss (:meth:`recover`), from which the engine replays its input. A sink that cannot
    fails the job when its worker is lost."""
    keep_positions: bool = False
    """Set by the engine before :meth:`open` when it will restart this restartable sink
    after a loss (``Job(restore=True)`` or ``checkpoint_ms``): store positions."""
    run: int = 0
    """Set by the engine before :meth:`open`: which run of the job this is (its t0),
    stored with the positions so that a restart never takes an earlier run's."""
    replicable: bool = False
    """Whether the job may run r replicas of this sink (the module documentation says
    how): each replica keeps a copy of its partition's rows that nothing outside sees
    before :meth:`combine` publishes one, and :meth:`discard` removes the others. A sink
    with an effect outside as it writes (a database, a topic) is not."""
    rebuildable: bool = False
    """Whether a lost replica of this replicated sink is rebuilt from a live twin while the
    job runs (``Job(restore=True)``), like an operator's: the twin, stopped at a
    heartbeat-cycle boundary, hands its copy so far (:meth:`snapshot`) to the new replica
    (:meth:`restore`), whose upstream replicas replay the rest from there. A sink whose
    copy lives outside the process as it writes (staged files, a topic) is not: its
    lost replica's partitions run on with their twins."""
    replica: int = 0
    """Set by the engine before :meth:`open`: which replica of its partition this is."""
    replicas: int = 1
    """Set by the engine before :meth:`open`: how many replicas its partition runs."""
    owned: bool = False
    """Whether one replica of a replicated partition writes — its *owner*, replica 0 to
    begin with — while its twins stand by with the rows since the owner's last commit,
    each able to :meth:`take_over` when the owner is lost (a sink with an effect outside
    as it writes, that fences a lost writer: ``td.sinks.Kafka``). Such a sink is
    replicable; the copy published is the last owner's."""
    in_result: bool = False
    """Whether the rows go nowhere but the job's Result (kept in memory, or counted). A
    job with durable checkpoints (``Job(checkpoint_dir=...)``) takes such a sink, or one
    that :attr:`commits_at_checkpoints`; a sink with another effect outside (a topic)
    would write again, after the driver's loss, the rows between the newest checkpoint
    and the loss."""
    commits_at_checkpoints: bool = False
    """Whether the sink writes in parts, one per durable checkpoint: every replica of a
    partition closes the part holding its rows through each checkpoint's cut
    (:meth:`roll`), and once the checkpoint is complete the driver publishes one
    replica's part and removes the others (:meth:`publish_parts`). A job resumed from
    the newest checkpoint after its driver was lost removes what came after it
    (:meth:`settle_parts`) and writes on from there: every row once."""
    parts_from: int | None = None
    """Set by the engine before :meth:`open` in a job with durable checkpoints, for a sink
    that :attr:`commits_at_checkpoints`: the heartbeat epoch the run starts from (0, or
    its checkpoint's); the sink then writes in parts."""

    def describe(self) -> str:
        return type(self).__name__

    def check(self, schema: pa.Schema) -> None:
        """Raise ConfigError if this sink cannot take a stream of ``schema`` (e.g. a
        column it names is missing). ``Stream.sink()`` calls it, before anything runs."""
        return None

    def open(self, partition: int, parallelism: int = 1, schema: pa.Schema | None = None) -> None:
        """Start writing partition ``partition`` of ``parallelism``."""
        self.partition = partition
        self.parallelism = parallelism
        self.schema = schema

    @abc.abstractmethod
    def write(self, batch: pa.RecordBatch) -> None:
        """Consume the next rows (each row is written exactly once)."""

    def receive(self, channel: int, first_seq: int, batch: pa.RecordBatch) -> None:
        """The next rows, from input channel ``channel``, where they are sequence numbers
        ``first_seq`` on (what an :attr:`owned` sink's standby needs to know which rows
        its owner had committed); by default :meth:`write`."""
        self.write(batch)

    def take_over(self) -> None:
        """An :attr:`owned` sink's replica standing by: become the owner of its partition,
        its lost owner fenced (the engine calls it once that owner is lost)."""
        raise TandemError(f"{self.describe()} has no owner to take over from")

    def commit_through(self, cut: tuple, then) -> None:
        """A durable checkpoint's cut of this sink (every input channel through its
        heartbeat): call ``then`` once what it wrote through ``cut`` is durable outside —
        at once, by default (a sink whose rows live in the Result, or that commits files
        at checkpoints); a Kafka sink, once a transaction through it has committed."""
        then()

    def close(self) -> Any:
        """Finish; return this partition's contribution to the Result (or None)."""
        return None

    def mark(self, cut: tuple) -> None:
        """Restartable sinks (with :attr:`keep_positions`): the rows written so far are
        this partition's input through ``cut`` (a heartbeat-cycle boundary of its input:
        every input channel's position; picklable, JSON-able). Make them durable together
        with ``cut``, atomically."""
        raise ConfigError(_not_restartable(self))

    def recover(self, partition: int, run: int) -> tuple[tuple | None, bytes]:
        """Restartable sinks: after partition ``partition`` was lost in ``run`` (called
        where the engine runs, before the partition is opened again), fence whatever may
        still write for it and return the last position it made durable with its rows in
        that run (None: none, it starts over from its first input) and what
        :meth:`restore` needs."""
        raise ConfigError(_not_restartable(self))

    def resumed(self, partition: int, runs: tuple[int, ...]) -> bytes:
        """Restartable sinks, where the engine runs, before a job resumed from a
        checkpoint starts: fence whatever of ``runs`` (the lost ones) may still write for
        ``partition``, and return what :meth:`restore` needs to skip what they had made
        durable past the checkpoint (b"": nothing)."""
        raise ConfigError(_not_restartable(self))

    def restore(self, state: bytes) -> int:
        """Restartable sinks, restarted (after :meth:`open`, before any write): take
        ``state`` from :meth:`recover`; returns the rows the lost partition had made
        durable (they count as written by this one)."""
        raise ConfigError(_not_restartable(self))

    def snapshot(self) -> bytes:
        """A :attr:`rebuildable` sink: its copy so far (every row written), for a replica
        rebuilt from this one to :meth:`restore` after its :meth:`open`."""
        raise TandemError(f"{self.describe()} cannot be rebuilt from a twin's copy")

    def roll(self, epoch: int) -> None:
        """A sink that :attr:`commits_at_checkpoints`: the rows written so far are this
        replica's rows through the durable checkpoint at heartbeat ``epoch``; close them as
        a part of their own, which :meth:`publish_parts` publishes or removes."""
        raise ConfigError(f"{self.describe()} does not commit at checkpoints")

    def publish_parts(
        self, partition: int, parallelism: int, through: int, replica: int
    ) -> list[str]:
        """A sink that :attr:`commits_at_checkpoints`, on the driver, once the checkpoint
        at heartbeat ``through`` is complete: publish replica ``replica``'s parts of
        ``partition`` rolled at or before it, and remove every other replica's; the
        published parts' names."""
        return []

    def settle_parts(self, partition: int, parallelism: int, epoch: int, replica: int) -> None:
        """A sink that :attr:`commits_at_checkpoints`, before a run resumes from the
        checkpoint at heartbeat ``epoch`` (whose sink cut is replica ``replica``'s):
        publish that checkpoint's parts if the lost run had not, and remove every part,
        published or not, of what came after it."""
        return None

    def combine(self, parts: list[Any], schema: pa.Schema | None = None) -> Any:
        """Merge the partitions' ``close()`` values (in partition order; one replica's
        per partition) and publish them; ``schema`` is the sink's input schema. Runs
        wherever the Result is assembled."""
        return None

    def discard(
        self, part: Any, *, partition: int, replica: int, parallelism: int, run: int
    ) -> None:
        """A replicable sink: remove the copy of replica ``replica`` of ``partition`` (of
        ``parallelism``, in ``run``), which the job does not publish. ``part`` is its
        ``close()`` value, or None when the replica was lost before it closed (its copy
        may then be partial). Runs where the Result is assembled, after :meth:`combine`;
        the default keeps nothing to remove."""
        return None

    def rows(self, value: Any, schema: pa.Schema | None = None) -> pa.Table | None:
        """The rows ``value`` (what :meth:`combine` returned) holds, read back from wherever
        the sink put them, as a table of some of the input's columns (``schema``); None if
        the sink keeps nothing to read back. The engines' reference check compares them, as
        a multiset, with the reference run's rows projected onto the same columns; a sink
        without rows is checked by row counts only. The default: ``value`` itself if it is
        a table."""
        return value if isinstance(value, pa.Table) else None


def _concat(parts: list[pa.Table | None], schema: pa.Schema | None) -> pa.Table | None:
    tables = [p for p in parts if p is not None]
    if not tables:
        return None if schema is None else schema.empty_table()
    return pa.concat_tables(tables)


class Collect(Sink):
    """Keeps every row in memory; the Result's ``output`` is the rows of all partitions
    (partition 0 first, each in consumption order) as one ``pyarrow.Table``. Replicable:
    the driver takes one replica's rows per partition."""

    replicable = True
    rebuildable = True
    in_result = True

    def open(self, partition: int, parallelism: int = 1, schema: pa.Schema | None = None) -> None:
        super().open(partition, parallelism, schema)
        self.batches: list[pa.RecordBatch] = []

    def write(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows:
            self.batches.append(batch)

    def snapshot(self) -> bytes:
        """The rows so far, as an Arrow IPC stream (no batches: no stream)."""
        if not self.batches:
            return b""
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, self.batches[0].schema) as writer:
            for batch in self.batches:
                writer.write_batch(batch)
        return sink.getvalue().to_pybytes()

    def restore(self, state: bytes) -> int:
        """A replica rebuilt from a twin: its copy starts with the twin's rows so far."""
        self.batches = list(pa.ipc.open_stream(state)) if state else []
        return sum(b.num_rows for b in self.batches)

    def close(self) -> pa.Table:
        if self.batches:
            return pa.Table.from_batches(self.batches)
        if self.schema is not None:
            return self.schema.empty_table()
        return pa.table({})

    def combine(self, parts: list[Any], schema: pa.Schema | None = None) -> pa.Table | None:
        return _concat(parts, schema)


class _FileSink(Sink):
    """A file per partition, written to a staged name beside it (a dot file, which
    Spark's and Arrow's dataset readers skip) by each replica, and renamed into place by
    :meth:`combine`: a file appears whole, once, when the run has ended.

    In a job with durable checkpoints, a partition is written in parts instead, one per
    checkpoint, each named by the heartbeat after which its rows start
    (``<name>-<epoch, 12 digits><ext>``, :meth:`_part`): at a checkpoint's cut every
    replica renames its staged part to ``.<part>.r<replica>.upto-<epoch>`` and starts the
    next (:meth:`roll`); once the checkpoint is complete the driver renames one replica's
    into place and removes the others' (:meth:`publish_parts`); the last part is
    published by :meth:`combine` as the run ends."""

    replicable = True
    commits_at_checkpoints = True

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        if not self.path:
            raise ConfigError(f"sinks.{type(self).__name__}: path must not be empty")

    def describe(self) -> str:
        return f"{type(self).__name__}({self.path!r})"

    @abc.abstractmethod
    def _final(self, partition: int, parallelism: int) -> str:
        """Where partition ``partition``'s file goes."""

    def _staged(self, partition: int, parallelism: int, replica: int) -> str:
        return self._staged_of(self._final(partition, parallelism), replica)

    @staticmethod
    def _staged_of(file: str, replica: int) -> str:
        folder, name = os.path.split(file)
        return os.path.join(folder, f".{name}.r{replica}.staging")

    # -- parts (a job with durable checkpoints) --------------------------------------------

    def _part_name(self, partition: int, parallelism: int) -> tuple[str, str, str]:
        """The folder, stem and extension of a partition's parts."""
        stem, ext = os.path.splitext(self._final(partition, max(parallelism, 2)))
        folder, name = os.path.split(stem)
        return folder, name, ext

    def _part(self, partition: int, parallelism: int, start: int) -> str:
        """Where the part of ``partition``'s rows after heartbeat ``start`` goes."""
        folder, name, ext = self._part_name(partition, parallelism)
        return os.path.join(folder, f"{name}-{start:012d}{ext}")

    def _parts(self, partition: int, parallelism: int) -> dict[str, list]:
        """What the folder holds of ``partition``'s parts: ``published`` ``(start, path)``,
        ``rolled`` ``(start, replica, upto, path)``, ``staged`` ``(start, replica, path)``."""
        folder, name, ext = self._part_name(partition, parallelism)
        stem = re.escape(name) + r"-(\d{12})" + re.escape(ext)
        published = re.compile(rf"^{stem}$")
        rolled = re.compile(rf"^\.{stem}\.r(\d+)\.upto-(\d{{12}})$")
        staged = re.compile(rf"^\.{stem}\.r(\d+)\.staging$")
        found: dict[str, list] = {"published": [], "rolled": [], "staged": []}
        try:
            names = os.listdir(folder or ".")
        except FileNotFoundError:
            return found
        for entry in sorted(names):
            path = os.path.join(folder, entry)
            if m := published.match(entry):
                found["published"].append((int(m[1]), path))
            elif m := rolled.match(entry):
                found["rolled"].append((int(m[1]), int(m[2]), int(m[3]), path))
            elif m := staged.match(entry):
                found["staged"].append((int(m[1]), int(m[2]), path))
        return found

    def roll(self, epoch: int) -> None:
        if self.writer is None and self.schema is not None:
            self._writer(self.schema)  # an empty part: the chain of parts has no hole
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        os.replace(self.staged, self.staged.removesuffix(".staging") + f".upto-{epoch:012d}")
        self.file = self._part(self.partition, self.parallelism, epoch)
        self.staged = self._staged_of(self.file, self.replica)

    def publish_parts(
        self, partition: int, parallelism: int, through: int, replica: int
    ) -> list[str]:
        published = []
        found = self._parts(partition, parallelism)
        for start, r, upto, path in found["rolled"]:
            if upto > through:
                continue
            if r != replica:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
                continue
            # A replica that missed a roll (its cut refused) has a longer part, which
            # covers any published since its start: those go, it replaces them.
            for other, done in found["published"]:
                if start < other < upto:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(done)
            target = self._part(partition, parallelism, start)
            os.replace(path, target)
            published.append(target)
        return published

    def settle_parts(self, partition: int, parallelism: int, epoch: int, replica: int) -> None:
        self.publish_parts(partition, parallelism, epoch, replica)
        found = self._parts(partition, parallelism)
        for start, path in found["published"]:
            if start >= epoch:  # rows after the checkpoint: the resumed run writes them
                os.remove(path)
        for *_, path in found["rolled"] + found["staged"]:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    def open(self, partition: int, parallelism: int = 1, schema: pa.Schema | None = None) -> None:
        super().open(partition, parallelism, schema)
        if self.parts_from is None:
            self.file = self._final(partition, parallelism)
        else:
            self.file = self._part(partition, parallelism, self.parts_from)
        self.staged = self._staged_of(self.file, self.replica)
        parent = os.path.dirname(self.file)
        if parent:
            os.makedirs(parent, exist_ok=True)
        self.writer = None

    def combine(self, parts: list[Any], schema: pa.Schema | None = None) -> list[str]:
        """Publish each partition's staged file under its name (an atomic rename); in
        parts, the run's last part, and list every part the run published."""
        files = []
        for part in parts:
            if not part:
                continue
            if part.get("parts_from") is not None:
                # Its parts rolled at a checkpoint that did not complete (the stream ended
                # first): published with the last one, which starts where they end.
                self.publish_parts(part["partition"], part["parallelism"], 1 << 62, part["replica"])
            try:
                os.replace(part["staged"], part["file"])
            except FileNotFoundError as exc:
                raise TandemError(
                    f"{self.describe()}: the staged file {part['staged']!r} is missing, so "
                    f"{part['file']!r} cannot be published; on a cluster the path must be "
                    "on a file system every executor and the driver share"
                ) from exc
            if part.get("parts_from") is None:
                files.append(part["file"])
                continue
            published = self._parts(part["partition"], part["parallelism"])["published"]
            files += [path for start, path in published if start >= part["parts_from"]]
        return files

    def discard(
        self, part: Any, *, partition: int, replica: int, parallelism: int, run: int
    ) -> None:
        staged = part["staged"] if part else self._staged(partition, parallelism, replica)
        with contextlib.suppress(FileNotFoundError):
            os.remove(staged)
        # In parts: whatever this replica left (a lost one's rolled parts too).
        found = self._parts(partition, parallelism)
        for _, r, *rest in found["rolled"] + found["staged"]:
            if r == replica:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(rest[-1])

    def rows(self, value: Any, schema: pa.Schema | None = None) -> pa.Table:
        """Every row of the files ``value`` lists (in that order), read back with the
        column types of ``schema``."""
        tables = [self._read(f, schema) for f in value]
        if not tables:
            return pa.table({}) if schema is None else schema.empty_table()
        return pa.concat_tables(tables)

    @abc.abstractmethod
    def _read(self, file: str, schema: pa.Schema | None) -> pa.Table:
        """The rows of one file this sink wrote."""

    @abc.abstractmethod
    def _writer(self, schema: pa.Schema):
        """The open writer of ``self.staged``, created on first use."""

    def write(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows:
            self._writer(batch.schema).write_batch(batch)

    def close(self) -> dict:
        if self.writer is None and self.schema is not None:
            self._writer(self.schema)
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        return {
            "file": self.file,
            "staged": self.staged,
            "partition": self.partition,
            "parallelism": self.parallelism,
            "replica": self.replica,
            "parts_from": self.parts_from,
        }


class Parquet(_FileSink):
    """Writes partition ``p`` to ``<dir>/part-<p:05d>.parquet`` (directory created)."""

    def _final(self, partition: int, parallelism: int) -> str:
        return os.path.join(self.path, f"part-{partition:05d}.parquet")

    def _writer(self, schema: pa.Schema):
        import pyarrow.parquet as pq

        if self.writer is None:
            self.writer = pq.ParquetWriter(self.staged, schema)
        return self.writer

    def _read(self, file: str, schema: pa.Schema | None) -> pa.Table:
        import pyarrow.parquet as pq

        return pq.read_table(file, schema=schema)


class Csv(_FileSink):
    """Writes CSV with a header: to ``path`` itself when the sink has one partition, else
    partition ``p`` to ``<stem>-<p:05d><suffix>`` next to it."""

    def _final(self, partition: int, parallelism: int) -> str:
        if parallelism == 1:
            return self.path
        stem, ext = os.path.splitext(self.path)
        return f"{stem}-{partition:05d}{ext}"

    def _writer(self, schema: pa.Schema):
        import pyarrow.csv as pacsv

        if self.writer is None:
            self.writer = pacsv.CSVWriter(self.staged, schema)
        return self.writer

    def _read(self, file: str, schema: pa.Schema | None) -> pa.Table:
        import pyarrow.csv as pacsv

        # The writer quotes every string and leaves nulls empty and unquoted.
        convert = pacsv.ConvertOptions(
            column_types=schema,
            strings_can_be_null=True,
            quoted_strings_can_be_null=False,
        )
        table = pacsv.read_csv(file, convert_options=convert)
        return table if schema is None else table.select(schema.names).cast(schema)


def _json_type(typ: pa.DataType) -> bool:
    return (
        pa.types.is_integer(typ)
        or pa.types.is_floating(typ)
        or pa.types.is_boolean(typ)
        or pa.types.is_string(typ)
        or pa.types.is_large_string(typ)
        or pa.types.is_null(typ)
    )


def _key_type(typ: pa.DataType) -> bool:
    return (
        pa.types.is_integer(typ)
        or pa.types.is_string(typ)
        or pa.types.is_large_string(typ)
        or pa.types.is_binary(typ)
        or pa.types.is_large_binary(typ)
    )


class Kafka(Sink):
    """Writes every row to a Kafka topic as one record, **exactly once for a
    ``read_committed`` consumer**: the value is a JSON object of the row's ``columns``
    (default: all of them; integers, floats, booleans and strings), the key the ``key``
    column's value (a string as UTF-8, an integer in decimal, binary as is; no key: none).

    Sink partition ``p`` writes with a transactional producer of its own, whose
    ``transactional.id`` is ``f"{transactional_id}.{p}"`` (default prefix:
    ``f"tandem.{topic}"``): fixed per sink partition, so a producer started again for that
    partition fences the one before (whose open transaction the broker then aborts) and
    only one of them can ever commit. Transactions are committed from a thread of their
    own, one in flight: each holds the rows that came while the previous one committed,
    so a row becomes visible to ``read_committed`` consumers one commit after it arrives,
    and the worker never waits for the broker. ``commit_ms`` spaces transactions at least
    that far apart (default 0: one after another): fewer, larger transactions cost the
    broker less (one after another took about 40 % of its CPU in ``tandem bench kafka``),
    and rows wait up to that long more before ``read_committed`` consumers see them (Kafka
    Streams' ``commit.interval.ms`` under exactly-once is 100 ms). Records go to
    Kafka partition ``p % n`` of
    the topic's ``n``, or, with a ``key``, to the partition of their key (murmur2, as the
    Java clients choose). Two jobs writing one topic at the same time need different
    ``transactional_id`` prefixes.

    The engine's check reads back, ``read_committed``, the offset ranges the sink
    committed (other writers into those partitions meanwhile would show as extra rows).

    Replicated (the job's replication, unless ``stream.sink(..., replication=1)``), one
    replica of each sink partition — its *owner*, replica 0 to begin with — writes,
    while its twins stand by, each holding the rows of its last 10 s with their input
    positions. When the owner is lost, a twin takes the ``transactional.id`` (fencing the
    lost owner: a zombie's commit fails), reads the positions record the owner committed
    last, and writes on from there: the rows after that position, from what it holds,
    and then its own input (:class:`tandem.kafka.TransactionalWriter`, ``standby``).

    The sink is restartable: with ``Job(restore=True)`` (or ``checkpoint_ms``) every
    transaction also writes, to partition ``p`` of ``positions_topic`` (default
    ``f"{transactional_id}.positions"``, created compacted with the sink's partition count
    if missing), where the partition's input stood after the rows it commits. After a
    loss the engine fences the lost producer, reads that record back ``read_committed``
    and restarts the partition from it, its upstream replicas replaying the rest from
    their replay windows: a ``read_committed`` consumer sees every row once.
    """

    restartable = True
    replicable = True
    owned = True

    def __init__(
        self,
        topic: str,
        bootstrap: str | None = None,
        columns: list[str] | None = None,
        key: str | None = None,
        config: dict | None = None,
        transactional_id: str | None = None,
        positions_topic: str | None = None,
        commit_ms: float = 0,
    ) -> None:
        if not isinstance(topic, str) or not topic:
            raise ConfigError(f"sinks.Kafka: topic must be a non-empty string, got {topic!r}")
        if (
            isinstance(commit_ms, bool)
            or not isinstance(commit_ms, int | float)
            or not 0 <= commit_ms < float("inf")
        ):
            raise ConfigError(
                f"sinks.Kafka({topic!r}): commit_ms must be a number of milliseconds >= 0, "
                f"got {commit_ms!r}"
            )
        if bootstrap is not None and (not isinstance(bootstrap, str) or not bootstrap):
            raise ConfigError(f"sinks.Kafka({topic!r}): bootstrap must be 'host:port[,...]'")
        if columns is not None and (
            isinstance(columns, str) or not all(isinstance(c, str) for c in columns)
        ):
            raise ConfigError(f"sinks.Kafka({topic!r}): columns must be a list of names")
        self.topic = topic
        self.bootstrap = bootstrap
        self.columns = None if columns is None else list(columns)
        self.key = key
        self.config = dict(config or {})
        self.transactional_id = transactional_id or f"tandem.{topic}"
        self.positions_topic = positions_topic or f"{self.transactional_id}.positions"
        self.commit_ms = commit_ms
        self._writer = None

    def describe(self) -> str:
        return f"Kafka({self.topic!r})"

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_writer"] = None
        return state

    def _bootstrap(self) -> str:
        from tandem.kafka import default_bootstrap

        if self.bootstrap is None:
            self.bootstrap = default_bootstrap()
        return self.bootstrap

    def _names(self, schema: pa.Schema) -> list[str]:
        return list(schema.names) if self.columns is None else self.columns

    def check(self, schema: pa.Schema) -> None:
        what = f"sinks.Kafka({self.topic!r})"
        for name in self._names(schema):
            if name not in schema.names:
                raise ConfigError(f"{what}: column {name!r} is not in its input {schema.names}")
            typ = schema.field(name).type
            if not _json_type(typ):
                raise ConfigError(
                    f"{what}: column {name!r} is {typ}, which a JSON value cannot hold "
                    "exactly; convert it in a map, or leave it out with columns="
                )
        if self.key is not None:
            if self.key not in schema.names:
                raise ConfigError(f"{what}: key {self.key!r} is not in its input {schema.names}")
            if not _key_type(schema.field(self.key).type):
                raise ConfigError(
                    f"{what}: key {self.key!r} is {schema.field(self.key).type}; use an "
                    "integer, string or binary column"
                )

    def open(self, partition: int, parallelism: int = 1, schema: pa.Schema | None = None) -> None:
        super().open(partition, parallelism, schema)
        from tandem.kafka import TransactionalWriter, ensure_positions_topic, partition_count

        self.partitions = partition_count(self._bootstrap(), self.topic, self.config)
        positions = None
        if self.keep_positions:
            ensure_positions_topic(
                self._bootstrap(), self.positions_topic, parallelism, self.config
            )
            positions = (self.positions_topic, partition, self.run)
        standby = self.replicas > 1 and self.replica != 0
        self._writer = TransactionalWriter(
            self._bootstrap(),
            self.topic,
            f"{self.transactional_id}.{partition}",
            self.config,
            positions=positions,
            commit_s=self.commit_ms / 1000,
            encode=self._records,
            standby=standby,
        )

    def mark(self, cut: tuple) -> None:
        self._writer.mark(cut)

    def _last_commit(self, partition: int, runs: int | tuple[int, ...]) -> dict | None:
        """Fence every writer of ``partition`` and read their last positions record, if
        it is of ``runs`` (:func:`tandem.kafka.recover_positions`)."""
        from tandem.kafka import recover_positions

        return recover_positions(
            self._bootstrap(),
            f"{self.transactional_id}.{partition}",
            self.positions_topic,
            partition,
            runs,
            self.config,
        )

    def recover(self, partition: int, run: int) -> tuple[tuple | None, bytes]:
        import json

        found = self._last_commit(partition, run)
        if found is None:
            return None, b""
        if found["cut"] is None:
            raise TandemError(
                f"sinks.Kafka({self.topic!r}) partition {partition} was lost after it had "
                f"committed its last transaction ({found['rows']} rows, complete in the "
                "topic): it has nothing left to write, but its report to the job is lost"
            )
        return found["cut"], json.dumps(found).encode()

    def restore(self, state: bytes) -> int:
        import json

        committed = json.loads(state)
        self._writer.resume(committed, committed.get("floor"))
        return committed["rows"]

    def resumed(self, partition: int, runs: tuple[int, ...]) -> bytes:
        """A run resumed from a checkpoint of the runs ``runs`` (the lost one last): fence
        their writers of ``partition`` and return what :meth:`restore` needs to go on from
        their last commit — their totals and the input position they had committed
        through (every row below it was written; a checkpoint completes only once the
        sink has committed through its cut, so that position is at or past it)."""
        import json

        found = self._last_commit(partition, runs)
        if found is None:
            return b""
        if found["cut"] is None:  # the lost run wrote its last transaction: everything
            return json.dumps({**found, "floor": None, "ended": True}).encode()
        return json.dumps({**found, "floor": list(found["cut"][2][0])}).encode()

    def write(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows:
            self._writer.put(self._records(batch))

    def receive(self, channel: int, first_seq: int, batch: pa.RecordBatch) -> None:
        # With positions, the writer sees where every row stands in its input: a twin
        # holds them, and a resumed or taken-over owner drops those committed before.
        if not self.keep_positions:
            self.write(batch)
        elif batch.num_rows:
            self._writer.receive(channel, first_seq, batch)

    def take_over(self) -> None:
        self._writer.take_over()

    def commit_through(self, cut: tuple, then) -> None:
        self._writer.mark(cut)
        self._writer.when_committed(cut, then)

    def _records(self, batch: pa.RecordBatch) -> list[tuple[bytes, bytes | None, int | None]]:
        """The rows of ``batch`` as the writer's ``(value, key, partition)`` records."""
        import json

        names = self._names(batch.schema)
        rows = batch.select(names).to_pylist()
        if self.key is None:
            keys: list = [None] * len(rows)
            target = self.partition % self.partitions
        else:
            keys = [_key_bytes(k) for k in batch.column(self.key).to_pylist()]
            target = None
        dumps = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
        return [(dumps(r).encode(), k, target) for r, k in zip(rows, keys, strict=True)]

    def close(self) -> dict | None:
        writer, self._writer = self._writer, None
        standing_by = writer.standing_by
        ranges = writer.close()
        if standing_by:
            return None  # a twin of the owner, never asked to take over: it wrote nothing
        return {
            "topic": self.topic,
            "bootstrap": self._bootstrap(),
            "transactional_id": writer.transactional_id,
            "rows": writer.committed_rows,
            "transactions": writer.transactions,
            "ranges": ranges,
            "took_over_s": writer.took_over_s,
        }

    def combine(self, parts: list[Any], schema: pa.Schema | None = None) -> list[dict]:
        return [p for p in parts if p]

    def rows(self, value: Any, schema: pa.Schema | None = None) -> pa.Table | None:
        """The rows the sink committed, read back ``read_committed`` from the offset
        ranges it wrote, decoded with the input's column types."""
        if schema is None:
            return None
        import io

        import pyarrow.json as pajson

        from tandem.kafka import read_log

        spans: dict[int, tuple[int, int]] = {}
        for part in value or []:
            for p, (lo, hi) in part["ranges"].items():
                old = spans.get(p)
                spans[p] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))
        want = pa.schema([schema.field(n) for n in self._names(schema)])
        values: list[bytes] = []
        for p, (lo, hi) in sorted(spans.items()):
            chunks = read_log(self._bootstrap(), self.topic, p, lo, self.config)
            try:
                for records in chunks:
                    values += [m.value() for m in records if m.offset() <= hi]
                    if records[-1].offset() >= hi:
                        break
            finally:
                chunks.close()
        if not values:
            return want.empty_table()
        data = b"\n".join(values)
        table = pajson.read_json(
            io.BytesIO(data),
            read_options=pajson.ReadOptions(use_threads=False, block_size=len(data) + 1),
            parse_options=pajson.ParseOptions(explicit_schema=want),
        )
        return table.cast(want)


def _key_bytes(value: Any) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    return str(value).encode()


LATENCY_SCHEMA = pa.schema(
    [
        pa.field(EVENT_TIME, pa.int64(), nullable=False),
        pa.field("receive_ns", pa.int64(), nullable=False),
    ]
)


class Latency(Sink):
    """Records, per row, ``receive_ns`` (wall clock when the sink got it) next to its
    ``event_time_ns``; latency = ``receive_ns - event_time_ns`` on one clock (every process
    of the local engine reads the same system clock). ``clock`` is injectable for tests."""

    replicable = True
    in_result = True

    def __init__(self, clock=time.time_ns) -> None:
        self.clock = clock

    def open(self, partition: int, parallelism: int = 1, schema: pa.Schema | None = None) -> None:
        super().open(partition, parallelism, schema)
        if schema is not None and EVENT_TIME not in schema.names:
            raise ConfigError(
                f"sinks.Latency: its input has no {EVENT_TIME!r} column (columns: "
                f"{schema.names}); keep the column through every operator"
            )
        self.batches: list[pa.RecordBatch] = []

    def write(self, batch: pa.RecordBatch) -> None:
        if not batch.num_rows:
            return
        now = self.clock()
        et = batch.column(EVENT_TIME)
        recv = pa.repeat(pa.scalar(now, pa.int64()), batch.num_rows)
        self.batches.append(pa.RecordBatch.from_arrays([et, recv], schema=LATENCY_SCHEMA))

    def close(self) -> pa.Table:
        return pa.Table.from_batches(self.batches, schema=LATENCY_SCHEMA)

    def combine(self, parts: list[Any], schema: pa.Schema | None = None) -> pa.Table:
        return _concat(parts, LATENCY_SCHEMA)

    def rows(self, value: Any, schema: pa.Schema | None = None) -> pa.Table:
        """The event times of the rows received (the only input column it keeps)."""
        return value.select([EVENT_TIME])


__all__ = ["LATENCY_SCHEMA", "Collect", "Csv", "Kafka", "Latency", "Parquet", "Sink"]
