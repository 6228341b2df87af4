"""What the speed job writes: dead letters, the master dataset, speed views in Cassandra.

Every sink runs on executors over Arrow batches (``mapInArrow``), so it works the same on ``local[2]``
and on a cluster, costs no row-by-row pickling, and every write is idempotent so a replayed
micro-batch changes nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark import Accumulator
from pyspark.accumulators import AccumulatorParam
from pyspark.sql import DataFrame

from lambdalake.cassandra.tables import TableDef
from lambdalake.cassandra.writer import cassandra_values, upsert_arrow
from lambdalake.filters import Node, arrow_expression
from lambdalake.kafka import dlq
from lambdalake.latest import RANK, arrow_winners, rank_array
from lambdalake.master_files import write_event_files
from lambdalake.procs import LIGHT_TASK_ROWS, release_freed_memory
from lambdalake.settings import CassandraSettings
from lambdalake.spark.decode import ERROR_FIELDS, DecodeSpec, decoder
from lambdalake.spark.views import INGEST_TS
from lambdalake.speed.dedup import DedupLog
from lambdalake.speed.last_read import Fingerprints, noting_last

_producers: dict[str, Any] = {}


def _dlq_producer(kafka_config: dict[str, Any]) -> Any:
    """One idempotent producer per executor process and cluster (creating one per task cost more
    than sending a task's few failures)."""
    from confluent_kafka import Producer

    key = repr(sorted(kafka_config.items()))
    if key not in _producers:
        _producers[key] = Producer({**kafka_config, "enable.idempotence": True, "acks": "all"})
    return _producers[key]


def send_dead_letters(
    failures: pa.Table, *, kafka_config: dict[str, Any], topic: str, pipeline: str, stage: str = "speed"
) -> None:
    """Send failed records to the DLQ with rule, reason and source. At least once: a replay may
    repeat some. Raises (failing the task, so Spark retries it) if any is not acknowledged."""
    if failures.num_rows == 0:
        return
    producer = _dlq_producer(kafka_config)
    errors: list[str] = []

    def delivered(err: Any, _msg: Any) -> None:
        if err is not None:
            errors.append(err.str())

    cols = ["_raw_key", "_raw_value", "_error_rule", "_error_reason", "_topic", "_partition", "_offset"]
    for key, value, rule, reason, src_topic, partition, offset in zip(
        *(failures.column(c).to_pylist() for c in cols), strict=True
    ):
        headers = dlq.headers(
            pipeline=pipeline, stage=stage, rule=rule, reason=reason,
            source=f"{src_topic}/{partition}/{offset}",
        )  # fmt: skip
        producer.produce(topic, key=key, value=value, headers=headers, on_delivery=delivered)
        producer.poll(0)
    remaining = producer.flush(120)
    if errors or remaining:
        raise RuntimeError(
            f"dead-letter topic {topic}: {len(errors)} failed, {remaining} unsent ({errors[:1]})"
        )


class FileSet(AccumulatorParam):
    """Accumulates the master-dataset files the tasks of a micro-batch wrote (a set: a task that
    ran twice reports the same names twice)."""

    def zero(self, value: frozenset[str]) -> frozenset[str]:
        return frozenset()

    def addInPlace(self, a: frozenset[str], b: frozenset[str]) -> frozenset[str]:
        return a | b


class PartitionProgress(AccumulatorParam):
    """Accumulates, per ``"topic/partition"``, the highest offset a micro-batch read (valid or not)
    and the highest ingest time in ms: ``[offset, ingest_ms]``, merged by maximum (a task that ran
    twice reports the same values)."""

    def zero(self, value: dict[str, list[int]]) -> dict[str, list[int]]:
        return {}

    def addInPlace(self, a: dict[str, list[int]], b: dict[str, list[int]]) -> dict[str, list[int]]:
        out = dict(a)
        for k, (offset, ingest) in b.items():
            have = out.get(k)
            out[k] = [offset, ingest] if have is None else [max(have[0], offset), max(have[1], ingest)]
        return out


class RecordCounts(AccumulatorParam):
    """Accumulates how many Kafka records each task read, keyed by ``"topic/partition/first offset"``
    (a task that ran twice reports the same count under the same key, which replaces it)."""

    def zero(self, value: dict[str, int]) -> dict[str, int]:
        return {}

    def addInPlace(self, a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
        return {**a, **b}


def partition_reads(table: pa.Table) -> tuple[dict[str, list[int]], dict[str, int]]:
    """:class:`PartitionProgress` and :class:`RecordCounts` of one task's decoded records."""
    ingest_ms = pc.divide(pc.cast(pc.cast(table.column(INGEST_TS), pa.timestamp("us")), pa.int64()), 1000)
    grouped = pa.table(
        {"t": table.column("_topic"), "p": table.column("_partition"), "o": table.column("_offset"),
         "i": ingest_ms}
    ).group_by(["t", "p"]).aggregate([("o", "max"), ("i", "max"), ("o", "min"), ("o", "count")])  # fmt: skip
    columns = (grouped.column(c).to_pylist() for c in ("t", "p", "o_max", "i_max", "o_min", "o_count"))
    progress, counts = {}, {}
    for t, p, last, ingest, first, n in zip(*columns, strict=True):
        progress[f"{t}/{p}"] = [last, -1 if ingest is None else ingest]
        counts[f"{t}/{p}/{first}"] = n
    return progress, counts


@dataclass(frozen=True)
class LatestSink:
    """A ``latest`` view's table, its key, its version column and its filter."""

    table: TableDef
    key: tuple[str, ...]
    version: str
    #: The view's parsed ``where`` (:mod:`lambdalake.filters`); None keeps every event.
    where: Node | None = None


@dataclass(frozen=True)
class ArchiveSink:
    """The speed job's one pass over each Kafka partition's records: a ``mapInArrow`` function over
    Spark's Kafka source's records.

    Per task (one Kafka partition's range of a micro-batch): records are decoded
    (:func:`lambdalake.spark.decode.decoder`); failures go to the DLQ; valid events are written as
    master-dataset files named by their Kafka coordinates (reported through ``files`` for the driver
    to commit); each ``latest`` view gets the winning row per key (the latest rule,
    :func:`lambdalake.latest.arrow_winners`) as a candidate, which Cassandra keeps in the rule's order
    across tasks and batches. Yields the
    ``passthrough`` columns (those the windowed view downstream reads; none without one) of the
    valid events that are first deliveries (``dedup``: :class:`speed.dedup.DedupLog`).

    Decoding here rather than in a step of its own saves a Python worker per task and a round trip
    of every decoded row through the JVM; deduplicating here saves a shuffle and Spark's state
    store; passing on only the columns needed shrinks what the JVM converts, shuffles and keeps.

    Delivery guarantees: DLQ at least once; master files exactly once once committed by the driver
    (:meth:`lambdalake.master.MasterDataset.commit`); latest rows idempotent.
    """

    decode: DecodeSpec
    dlq_topic: str
    kafka_config: dict[str, Any]
    master_path: str
    event_time: str
    file_prefix: str
    latest: tuple[LatestSink, ...]
    cassandra: CassandraSettings
    files: Accumulator
    passthrough: tuple[str, ...]
    dedup: DedupLog | None = None
    progress: Accumulator | None = None
    #: :class:`RecordCounts`: what the query read (its source yields this sink's output, so Spark's
    #: input row count is what the sink passed on, not the records read).
    read: Accumulator | None = None
    #: Per partition, the highest offset the master dataset holds already (a checkpoint rebuilt by ``speed
    # reset``
    #: re-reads records the master dataset archived): those are not archived or dead-lettered again.
    archived: dict[int, int] = field(default_factory=dict)
    #: :class:`speed.last_read.LastRecords`: the last record read of each partition.
    last_read: Accumulator | None = None

    @property
    def output_schema(self) -> pa.Schema:
        """What the sink yields: the ``passthrough`` columns of valid events."""
        schema = self.decode.output_schema
        return pa.schema([schema.field(name) for name in self.passthrough])

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        last: Fingerprints = {}
        decoded = list(decoder(self.decode)(noting_last(batches, last)))
        if self.last_read is not None and last:
            self.last_read.add(last)
        if not decoded:
            return
        table = pa.Table.from_batches(decoded)
        progress, counts = partition_reads(table)
        if self.progress is not None:
            self.progress.add(progress)
        if self.read is not None:
            self.read.add(counts)
        failed = pc.is_valid(table.column("_error_rule"))
        new = self._not_archived(table)
        send_dead_letters(
            table.filter(pc.and_(failed, new)), kafka_config=self.kafka_config, topic=self.dlq_topic,
            pipeline=self.decode.pipeline,
        )  # fmt: skip
        events = table.filter(pc.invert(failed)).drop_columns(list(ERROR_FIELDS))
        to_archive = events.filter(self._not_archived(events)) if self.archived else events
        self.files.add(
            frozenset(
                write_event_files(
                    to_archive, path=self.master_path, event_time=self.event_time, name=self._file_name(table)
                )
            )
        )
        for sink in self.latest:
            kept = events
            if sink.where is not None:
                kept = events.filter(arrow_expression(sink.where, events.schema))
            if kept.num_rows == 0:
                continue
            keys = list(zip(*cassandra_values(kept, list(sink.key)), strict=True))
            rows, ranks = arrow_winners(kept, keys, sink.version)
            chosen = kept.take(pa.array(rows, type=pa.int64()))
            upsert_arrow(
                chosen.append_column(RANK, rank_array(ranks)), table=sink.table, settings=self.cassandra
            )
        if self.passthrough:
            if self.dedup is not None:
                events = events.filter(pa.array(self.dedup.fresh(events)))
            yield from events.select(list(self.passthrough)).to_batches()
        if table.num_rows <= LIGHT_TASK_ROWS:
            release_freed_memory()

    def _not_archived(self, table: pa.Table) -> pa.Array:
        """Which rows are past what the master dataset holds for their partition."""
        if not self.archived:
            return pa.array(np.ones(table.num_rows, dtype=bool))
        parts = table.column("_partition").to_numpy(zero_copy_only=False)
        limits = np.array([self.archived.get(int(p), -1) for p in parts], dtype=np.int64)
        return pa.array(table.column("_offset").to_numpy(zero_copy_only=False) > limits)

    def _file_name(self, table: pa.Table) -> str:
        """Unique to the records: the run, the Kafka partition and the task's offset range."""
        topics = pc.unique(table.column("_topic")).to_pylist()
        parts = pc.unique(table.column("_partition")).to_pylist()
        bounds = pc.min_max(table.column("_offset")).as_py()
        if len(topics) == 1 and len(parts) == 1:
            return f"{self.file_prefix}-{topics[0]}-{parts[0]}-{bounds['min']}-{bounds['max']}"
        coords = table.select(["_topic", "_partition", "_offset"]).to_pydict()
        return f"{self.file_prefix}-{hashlib.sha1(repr(coords).encode()).hexdigest()}"


def drain(df: DataFrame) -> None:
    """Run ``df``'s plan for its side effects (a micro-batch without a windowed view)."""

    def consume(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        yield pa.RecordBatch.from_pydict({"rows": [sum(b.num_rows for b in batches)]})

    df.mapInArrow(consume, "rows long").collect()
