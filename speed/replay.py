"""Replay and backfill: re-read a range of the topic, re-archive what the master dataset lacks, and bring the
speed rows of the epochs it touches back to exact.

The range is widened to whole ingest epochs on every partition (with LogAppendTime an epoch is a
contiguous offset range per partition, found exactly with offsets-for-times), because a speed cell
(key, window, epoch) holds events of every partition. Then:

1. Records of the range that master dataset lacks (by Kafka coordinates) are decoded and committed to the
master dataset
   in one commit; valid records only (invalid ones reached the dead-letter topic on their first read).
   Spark's Kafka source reads the range (a task per core at least); each task checks its records
   against the master dataset's coordinates (files picked by their offset stats), decodes the rest and writes
   them in one Python pass.
2. For each touched epoch after the batch horizon that has closed, every cell is recomputed from all
   of the master dataset for that epoch, deduplicated over the whole history as the batch layer does, with the
   shared view definitions, and written as absolute values (a partial range never overwrites a
   complete value with a partial one). ``latest`` rows are written with their rank as the write
   timestamp, so a higher version already stored keeps winning.
3. Epochs at or before the horizon are left to the next batch run; epochs not closed yet are left to
   the running speed job, whose state holds them.

Delivery guarantee: idempotent. Running the same replay twice changes nothing the second time.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import reduce
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_schema

from lambdalake.cassandra.active import active_batch
from lambdalake.cassandra.session import connect
from lambdalake.cassandra.tables import speed_table_def
from lambdalake.cassandra.writer import bulk_options, upsert_arrow
from lambdalake.errors import ConfigurationError
from lambdalake.kafka.offsets import offset_consumer, offsets_at, record_time, watermarks
from lambdalake.latest import CANDIDATE, RANK
from lambdalake.master import master_of
from lambdalake.master_files import offsets_present, write_event_files
from lambdalake.pipeline import LatestView, Pipeline, WindowedView
from lambdalake.settings import Settings
from lambdalake.spark.decode import ERROR_FIELDS, DecodeSpec, decoder
from lambdalake.spark.kafka import read_ranges
from lambdalake.spark.master import read_events
from lambdalake.spark.sinks import upsert_view
from lambdalake.spark.views import (
    INGEST_EPOCH,
    INGEST_TS,
    cell_columns,
    latest,
    split_deliveries,
    window_cells,
    windowed,
)
from lambdalake.speed.sinks import send_dead_letters
from lambdalake.views import EPOCH, WINDOW_START

log = logging.getLogger("lambdalake.replay")


@dataclass
class ReplayPlan:
    """What a replay reads and touches.

    Attributes:
        asked: Per partition, the [start, end) offsets asked for.
        ranges: Per partition, the [start, end) offsets read: the asked range widened to whole epochs.
        epochs: The ingest epochs the range holds.
        horizon: The active batch's horizon (None: no batch yet).
        speed_end: Per partition, the offset up to which the speed job has read (its commits).
        batch_epochs: Touched epochs at or before the horizon: left to the next batch run.
        speed_epochs: Touched epochs after the horizon that have closed: their end plus grace has
            passed and the speed job has read past their end on every partition. Recomputed.
        open_epochs: Touched epochs not closed yet: left to the speed job, whose state holds them.
    """

    asked: dict[int, tuple[int, int]]
    ranges: dict[int, tuple[int, int]]
    epochs: list[int]
    horizon: int | None
    speed_end: dict[int, int] = field(default_factory=dict)
    batch_epochs: list[int] = field(default_factory=list)
    speed_epochs: list[int] = field(default_factory=list)
    open_epochs: list[int] = field(default_factory=list)

    @property
    def records(self) -> int:
        return sum(end - start for start, end in self.ranges.values())

    @property
    def widened(self) -> bool:
        return self.ranges != self.asked


@dataclass
class ReplayResult:
    plan: ReplayPlan
    read: int = 0
    archived: int = 0
    cells: dict[str, int] = field(default_factory=dict)
    #: Stored cells of the recomputed epochs that the recompute no longer yields, deleted.
    emptied: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    #: Seconds per stage: read+archive (Kafka, decode, master dataset files and commit), recompute.
    stages: dict[str, float] = field(default_factory=dict)


def plan_replay(
    settings: Settings,
    pipeline: Pipeline,
    *,
    from_offsets: dict[int, int] | None = None,
    from_ms: int | None = None,
    to_offsets: dict[int, int] | None = None,
    to_ms: int | None = None,
    now_ms: int | None = None,
    speed_end: dict[int, int] | None = None,
) -> ReplayPlan:
    """Resolve the asked range, widen it to whole epochs and sort the epochs by who owns them.

    ``now_ms`` and ``speed_end`` (per partition, the offset the speed job has read up to) judge
    "closed" as of another moment; by default now, and what the master dataset's commits record."""
    if (from_offsets is None) == (from_ms is None):
        raise ConfigurationError("give exactly one of --from-offsets and --from-timestamp")
    if to_offsets is not None and to_ms is not None:
        raise ConfigurationError("give at most one of --to-offsets and --to-timestamp")
    topic, epoch_ms = pipeline.topic.name, pipeline.layers.epoch_ms
    now_ms = now_ms if now_ms is not None else int(time.time() * 1000)
    with offset_consumer(settings) as consumer:
        bounds = watermarks(consumer, topic)
        unknown = sorted((set(from_offsets or {}) | set(to_offsets or {})) - set(bounds))
        if unknown:
            raise ConfigurationError(
                f"{topic} has no partition {unknown}", fix=f"partitions are {sorted(bounds)}"
            )
        starts = from_offsets if from_offsets is not None else offsets_at(consumer, topic, int(from_ms or 0))
        if to_offsets is not None:
            ends = to_offsets
        elif to_ms is not None:
            ends = offsets_at(consumer, topic, to_ms)
        else:
            ends = {p: hi for p, (_, hi) in bounds.items()}
        asked = {}
        for p, start in starts.items():
            low, high = bounds[p]
            start, end = max(start, low), min(ends.get(p, high), high)
            if end > start:
                asked[p] = (start, end)
        if not asked:
            active = _horizon(settings, pipeline)
            return ReplayPlan({}, {}, [], active)
        first = min(record_time(consumer, topic, p, s) for p, (s, _) in asked.items())
        last = max(record_time(consumer, topic, p, e - 1) for p, (_, e) in asked.items())
        epochs = list(range(first // epoch_ms, last // epoch_ms + 1))
        begin = offsets_at(consumer, topic, epochs[0] * epoch_ms)
        finish = offsets_at(consumer, topic, (epochs[-1] + 1) * epoch_ms)
        ranges = {p: (begin[p], finish[p]) for p in bounds if finish[p] > begin[p]}
        horizon = _horizon(settings, pipeline)
        grace_ms = pipeline.layers.grace_seconds * 1000
        if speed_end is None:
            recorded = master_of(settings, pipeline).read_speed_end()
            speed_end = {p: recorded.get(f"{topic}/{p}", low) for p, (low, _) in bounds.items()}
        out = ReplayPlan(asked, ranges, epochs, horizon, speed_end=dict(speed_end))
        for e in epochs:
            if horizon is not None and e <= horizon:
                out.batch_epochs.append(e)
            elif (e + 1) * epoch_ms + grace_ms <= now_ms and _speed_passed(
                out.speed_end, offsets_at(consumer, topic, (e + 1) * epoch_ms), bounds
            ):
                out.speed_epochs.append(e)
            else:
                out.open_epochs.append(e)
    return out


def _speed_passed(
    speed_end: dict[int, int], boundary: dict[int, int], bounds: dict[int, tuple[int, int]]
) -> bool:
    """Whether the speed job has read every partition up to ``boundary`` (an epoch's end): it never
    writes that epoch's rows again, so a recompute of it is not overwritten by a partial value."""
    return all(speed_end.get(p, low) >= boundary[p] or boundary[p] <= low for p, (low, _) in bounds.items())


def _horizon(settings: Settings, pipeline: Pipeline) -> int | None:
    active = active_batch(connect(settings.cassandra), settings.cassandra.keyspace, pipeline.name)
    return active.horizon if active is not None else None


#: A replay whose range holds at least 1/SHARE_DEDUP_ALL of the master dataset deduplicates all of the master
# dataset.
SHARE_DEDUP_ALL = 4
#: A range is cut into one task per core, but no task under this many offsets.
MIN_PIECE = 50_000
#: Rows per master dataset file a task writes (bounds a task's memory).
FILE_ROWS = 250_000
#: Offsets of the master dataset's coordinates a task holds at a time, to tell which records the master
# dataset lacks.
HELD_WINDOW = 1_000_000


#: What each archive task returns.
PIECE_DONE = pa.schema([("files", pa.list_(pa.string())), ("valid", pa.int64())])


class _Held:
    """The offsets the master dataset holds, per partition, read from its files a window at a time as a task's
    records go by (a task reads one contiguous range of a partition, in order)."""

    def __init__(self, holding: dict[int, tuple[str, ...]]) -> None:
        self.holding = holding
        self.windows: dict[int, tuple[int, int, np.ndarray]] = {}

    def among(self, partition: int, offsets: pa.Array) -> pa.Array:
        """Whether the master dataset holds each of ``offsets`` (of ``partition``)."""
        files = self.holding.get(partition, ())
        if not files or not len(offsets):
            return pa.array(np.zeros(len(offsets), dtype=bool))
        wanted = offsets.to_numpy(zero_copy_only=False)
        low, high = int(wanted.min()), int(wanted.max()) + 1
        start, end, held = self.windows.get(partition, (0, 0, None))
        if held is None or low < start or high > end:
            start, end = low, max(high, low + HELD_WINDOW)
            found = offsets_present(files, partition=partition, start=start, end=end)
            held = np.sort(found.to_numpy(zero_copy_only=False))
            self.windows[partition] = (start, end, held)
        # A binary search in the sorted window: no hash set built per batch.
        at = np.minimum(np.searchsorted(held, wanted), max(len(held) - 1, 0))
        return pa.array(held[at] == wanted if len(held) else np.zeros(len(wanted), dtype=bool))


@dataclass(frozen=True)
class _ArchiveJob:
    """Archives a range on executors, over Spark's Kafka source's records: drop what the master dataset holds,
    decode, write files.

    Attributes:
        holding: Per partition, the master dataset files that may hold some offsets of the range.
    """

    holding: dict[int, tuple[str, ...]]
    spec: DecodeSpec
    path: str
    event_time: str
    run_id: str
    #: Where invalid records go when the speed job has not read them yet (per partition, offsets
    #: from its read end on): a replay ahead of the job is their first read.
    dlq_topic: str = ""
    kafka_config: dict[str, Any] = field(default_factory=dict)
    speed_end: dict[int, int] = field(default_factory=dict)

    def run(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """The ``mapInArrow`` function: one task's records in, the files it wrote and the valid
        events its records hold out (one row)."""
        held = _Held(self.holding)
        present = 0  # the master dataset holds valid events only

        def lacking() -> Iterator[pa.RecordBatch]:
            nonlocal present
            for batch in batches:
                for part in _by_partition(batch):
                    known = held.among(part.column("partition")[0].as_py(), part.column("offset"))
                    present += pc.sum(known).as_py() or 0
                    part = part.filter(pc.invert(known))
                    if part.num_rows:
                        yield part  # only these are decoded again

        files, valid = self.archive(decoder(self.spec)(lacking()))
        yield pa.RecordBatch.from_pydict({"files": [files], "valid": [valid + present]}, schema=PIECE_DONE)

    def archive(self, decoded: Iterator[pa.RecordBatch]) -> tuple[list[str], int]:
        """Write the valid events of ``decoded`` (batches of one partition each) to master dataset files;
        returns the files written and how many valid events there were."""
        valid = 0
        files: list[str] = []
        pending: dict[int, list[pa.Table]] = {}

        def write(partition: int) -> None:
            table = pa.concat_tables(pending.pop(partition))
            name = f"{self.run_id}-{partition}-{table.column('_offset')[0].as_py()}"
            files.extend(write_event_files(table, path=self.path, event_time=self.event_time, name=name))

        for batch in decoded:
            partition = batch.column("_partition")[0].as_py()
            failed = pc.is_valid(batch.column("_error_rule"))
            # Invalid records reached the dead-letter topic on their first read, if the speed job
            # has made it (at least once: the job may yet read some of these too).
            unread = self.speed_end.get(partition, 0)
            first_read = pc.and_(failed, pc.greater_equal(batch.column("_offset"), unread))
            if self.dlq_topic and pc.any(first_read).as_py():
                send_dead_letters(
                    pa.Table.from_batches([batch]).filter(first_read), kafka_config=self.kafka_config,
                    topic=self.dlq_topic, pipeline=self.spec.pipeline, stage="replay",
                )  # fmt: skip
            table = pa.Table.from_batches([batch]).filter(pc.invert(failed))
            valid += table.num_rows
            if table.num_rows:
                pending.setdefault(partition, []).append(table.drop_columns(list(ERROR_FIELDS)))
            if sum(t.num_rows for t in pending.get(partition, [])) >= FILE_ROWS:
                write(partition)
        for partition in list(pending):
            write(partition)
        return files, valid


def _by_partition(batch: pa.RecordBatch) -> Iterator[pa.RecordBatch]:
    """``batch``'s records a Kafka partition at a time (a batch of Spark's source holds one)."""
    partitions = pc.unique(batch.column("partition"))
    if len(partitions) == 1:
        yield batch
        return
    for p in partitions:
        yield batch.filter(pc.equal(batch.column("partition"), p))


class Replayer:
    """Runs a :class:`ReplayPlan` with Spark (bounded Kafka read, master dataset commit, cell rewrite)."""

    def __init__(self, *, settings: Settings, pipeline: Pipeline, spark: SparkSession) -> None:
        self.settings = settings
        self.pipeline = pipeline
        self.spark = spark
        self.master = master_of(settings, pipeline)
        #: Per windowed view, the stored cells the last recompute emptied.
        self.emptied: dict[str, int] = {}

    def run(self, plan: ReplayPlan) -> ReplayResult:
        t0 = time.monotonic()
        result = ReplayResult(plan)
        if not plan.ranges:
            return result
        self.master.check_layers(self.pipeline.layers, pipeline=self.pipeline.name)
        result.read, result.archived = self.archive(plan)
        t1 = time.monotonic()
        if plan.speed_epochs:
            result.cells = self.recompute(plan.speed_epochs, records=plan.records)
            result.emptied = dict(self.emptied)
        t2 = time.monotonic()
        result.stages = {"read+archive": round(t1 - t0, 2), "recompute": round(t2 - t1, 2)}
        result.seconds = t2 - t0
        return result

    def archive(self, plan: ReplayPlan) -> tuple[int, int]:
        """Read the range, decode it and commit what the master dataset lacks (by coordinates); returns the
        valid events read and how many were archived.

        Spark's Kafka source reads the range, cut into a task per core at least; each task drops
        what the master dataset holds, decodes the rest and writes its files in one Python pass.
        """
        topic = self.pipeline.topic.name
        cores = max(1, self.spark.sparkContext.defaultParallelism)
        tasks = max(1, min(cores, plan.records // MIN_PIECE))
        partitions = sorted(plan.ranges)
        holding = self.master.files_holding([(p, *plan.ranges[p]) for p in partitions])
        run_id = f"replay-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
        # Imported here: the tasks import this module, and must not import the registry client.
        from lambdalake.registry import subject_schemas

        writers = subject_schemas(self.settings, self.pipeline.schema_.subject)
        job = _ArchiveJob(
            holding={p: tuple(files) for p, files in zip(partitions, holding, strict=True)},
            spec=DecodeSpec.of(self.pipeline, self.settings, writer_schemas=writers),
            path=self.master.path,
            event_time=self.pipeline.event.time,
            run_id=run_id,
            dlq_topic=self.pipeline.topic.dlq,
            kafka_config=self.settings.kafka.client_config(),
            speed_end=dict(plan.speed_end),
        )
        records = read_ranges(self.spark, self.settings, topic, plan.ranges, min_partitions=tasks)
        # mapInArrow, not an RDD: the Cassandra writes after it then reuse the same warm Python workers.
        done = records.mapInArrow(job.run, from_arrow_schema(PIECE_DONE)).collect()
        files = [f for row in done for f in row["files"]]
        read = sum(row["valid"] for row in done)
        # The commit records the range as read (so a gap it fills counts as archived) and leaves out
        # whatever a concurrent writer archived since the tasks looked (decided in the commit).
        ranges = {f"{topic}/{p}": [(start, end)] for p, (start, end) in plan.ranges.items()}
        rows = self.master.commit(
            files, app_id=run_id, batch_id=0, layers=self.pipeline.layers, ranges=ranges
        )
        return read, int(rows or 0)

    def master_epochs(self, *, after: int | None, before: int | None) -> list[int]:
        """The ingest epochs the master dataset holds events of, after ``after`` and before ``before`` (None:
        no bound): what a rebuild of the closed epochs after a horizon recomputes."""
        uris = self.master.file_uris()
        if not uris:
            return []
        epochs = self.spark.read.parquet(*uris).select(INGEST_EPOCH).distinct()
        if after is not None:
            epochs = epochs.filter(F.col(INGEST_EPOCH) > after)
        if before is not None:
            epochs = epochs.filter(F.col(INGEST_EPOCH) < before)
        return sorted(r[0] for r in epochs.collect())

    def recompute(self, epochs: list[int], *, records: int | None = None) -> dict[str, int]:
        """Every cell of ``epochs``, from all of the master dataset, written as absolute values.

        Args:
            epochs: The ingest epochs to rebuild.
            records: About how many events those epochs hold (a replay's range), if known.
        """
        uris = self.master.file_uris()
        # Checked on a snapshot at least as new as the files': the master dataset only grows, so no overlap
        # there means none among them.
        master = read_events(self.spark, uris, self.pipeline, held_twice=self.master.may_hold_twice())
        # Copies of these events anywhere in history decide which delivery counts (as in the batch).
        candidates = master
        total = self.master.num_records()
        if records is None or total is None or records * SHARE_DEDUP_ALL < total:
            # A small share of history: first narrow the master dataset to the identities the epochs hold (a
            # join Spark can broadcast). For a large share, deduplicating all of the master dataset costs less
            # than that join (the benchmarks log); same result.
            identity = list(self.pipeline.event.identity)
            touched = master.filter(F.col(INGEST_EPOCH).isin(epochs))
            candidates = master.join(touched.select(*identity).distinct(), identity, "left_semi")
        # The losers (narrow: what their cells need) are persisted first so that computing the
        # firsts fills them in one pass.
        carry = [INGEST_EPOCH]
        for view in self.pipeline.views:
            if isinstance(view, WindowedView):
                carry += cell_columns(self.pipeline, view)
        (firsts, losers) = split_deliveries(candidates, self.pipeline, carry=tuple(carry))
        losers = losers.persist()
        firsts = firsts.filter(F.col(INGEST_EPOCH).isin(epochs)).persist()
        cells = {}
        cassandra = self.settings.cassandra
        bulk = bulk_options(cassandra)
        epoch = F.window(F.col(INGEST_TS), f"{self.pipeline.layers.epoch_seconds} seconds")
        try:
            for view in self.pipeline.views:
                table = speed_table_def(self.pipeline, view)
                if isinstance(view, WindowedView):
                    moved = _moved(losers.filter(F.col(INGEST_EPOCH).isin(epochs)), self.pipeline, view)
                    rows = windowed(firsts, self.pipeline, view, epoch=epoch)
                    if moved is None:
                        cells[view.name] = upsert_view(rows, table=table, cassandra=cassandra, **bulk)
                        stale = []
                    else:
                        # Kept for the stale-cell check (a few cells a key, not the events).
                        rows = rows.persist()
                        try:
                            cells[view.name] = upsert_view(rows, table=table, cassandra=cassandra, **bulk)
                            stale = _stale_cells(rows, moved, self.pipeline, view, epoch)
                        finally:
                            rows.unpersist()
                    _delete_cells(self.settings, table, [*view.key, WINDOW_START, EPOCH], stale)
                    self.emptied[view.name] = len(stale)
                else:
                    cells[view.name] = _upsert_latest(firsts, self.pipeline, view, table, cassandra)
        finally:
            firsts.unpersist()
            losers.unpersist()
        return cells


def _moved(losers: DataFrame, pipeline: Pipeline, view: WindowedView) -> DataFrame | None:
    """The losing deliveries outside their first delivery's cell, or None if there are none.

    Only a losing delivery can have made a stored cell that the recompute no longer yields (a cell
    with a first delivery in it is yielded), and one in its first delivery's cell (the same key,
    time and epoch: a copy of the same event in the same epoch, nearly every copy) cannot.
    """
    elsewhere = [*cell_columns(pipeline, view), INGEST_EPOCH]
    moved = losers.filter(
        reduce(lambda a, b: a | b, [~F.col(c).eqNullSafe(F.col(f"_first_{c}")) for c in elsewhere])
    )
    return moved if moved.take(1) else None


def _stale_cells(
    rows: DataFrame, moved: DataFrame, pipeline: Pipeline, view: WindowedView, epoch: Any
) -> list[Any]:
    """Cells a delivery of the recomputed epochs once made (any copy the speed job counted) that the
    recompute no longer yields (``rows``), e.g. a far copy deduplication now drops: the cells of
    the ``moved`` losers (:func:`_moved`) that ``rows`` lacks."""
    cell = [*view.key, WINDOW_START, EPOCH]
    lost = window_cells(moved, pipeline, view, epoch=epoch)
    gone = lost.join(rows.select(*cell), cell, "left_anti").collect()
    # A null key component makes no stored cell (it is part of the Cassandra primary key).
    return sorted(tuple(r) for r in gone if None not in tuple(r))


def _delete_cells(settings: Settings, table: Any, cell: list[str], rows: list[Any]) -> None:
    """Delete the speed cells ``rows`` (values of the ``cell`` columns, its primary key)."""
    if not rows:
        return
    session = connect(settings.cassandra)
    where = " AND ".join(f'"{c}" = ?' for c in cell)
    delete = session.prepare(f'DELETE FROM "{settings.cassandra.keyspace}"."{table.name}" WHERE {where}')
    for row in rows:
        session.execute(delete, list(row))
    log.info("emptied %d speed cells of %s that the recompute no longer yields", len(rows), table.name)


def _upsert_latest(
    events: DataFrame, pipeline: Pipeline, view: LatestView, table: Any, cassandra: Any
) -> int:
    """The epochs' winners per key, written as candidates with their rank (a stored candidate the
    latest rule ranks higher keeps winning)."""
    rows = latest(events, pipeline, view, carry=CANDIDATE[1:], rank=True)
    columns = list(dict.fromkeys([*table.source_columns, RANK]))

    bulk = bulk_options(cassandra)

    def write(batches: Any) -> Any:
        written = 0
        for batch in batches:
            written += upsert_arrow(batch, table=table, settings=cassandra, **bulk)
        yield pa.RecordBatch.from_pydict({"rows": [written]})

    return sum(r["rows"] for r in rows.select(*columns).mapInArrow(write, "rows long").collect())
