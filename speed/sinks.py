"""What the speed job writes: dead letters, the master dataset, speed views in Cassandra.

Every sink runs on executors over Arrow batches (``mapInArrow``), so it works the same on ``local[2]``
and on a cluster, costs no row-by-row pickling, and every write is idempotent so a replayed
micro-batch changes nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark import Accumulator
from pyspark.accumulators import AccumulatorParam
from pyspark.sql import DataFrame

from lambdalake.cassandra.tables import TableDef
from lambdalake.kafka import dlq
from lambdalake.master import write_event_files
from lambdalake.settings import CassandraSettings
from lambdalake.spark.decode import ERROR_FIELDS


def cassandra_values(table: pa.Table | pa.RecordBatch, columns: list[str]) -> list[list[Any]]:
    """Column values as the Cassandra driver takes them (timestamps as epoch milliseconds)."""
    out = []
    for name in columns:
        col = table.column(name)
        if pa.types.is_timestamp(col.type):
            col = pc.divide(pc.cast(pc.cast(col, pa.timestamp("us")), pa.int64()), 1000)
        out.append(col.to_pylist())
    return out


_producers: dict[str, Any] = {}


def _dlq_producer(kafka_config: dict[str, Any]) -> Any:
    """One idempotent producer per executor process and cluster (creating one per task cost more
    than sending a task's few failures)."""
    from confluent_kafka import Producer

    key = repr(sorted(kafka_config.items()))
    if key not in _producers:
        _producers[key] = Producer({**kafka_config, "enable.idempotence": True, "acks": "all"})
    return _producers[key]


def send_dead_letters(failures: pa.Table, *, kafka_config: dict[str, Any], topic: str, pipeline: str) -> None:
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
            pipeline=pipeline, stage="speed", rule=rule, reason=reason,
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


@dataclass(frozen=True)
class LatestSink:
    """A ``latest`` view's table, its key, and the column holding each row's write timestamp."""

    table: TableDef
    key: tuple[str, ...]
    order: str


def order_column(view_name: str) -> str:
    return f"_order_{view_name}"


@dataclass(frozen=True)
class ArchiveSink:
    """The ``mapInArrow`` function of the speed job's one pass over each Kafka partition's records.

    Per task (one Kafka partition's range of a micro-batch): failures go to the DLQ; valid events are
    written as master-dataset files named by their Kafka coordinates (reported through ``files`` for
    the driver to commit); each ``latest`` view gets the winning row per key (highest write
    timestamp; among equals the earliest offset), upserted ``USING TIMESTAMP`` so Cassandra keeps
    the highest version across tasks and batches. Yields the valid events (without error and order
    columns) when ``passthrough``, for the windowed view downstream.

    Delivery guarantees: DLQ at least once; master files exactly once once committed by the driver
    (:meth:`lambdalake.master.MasterDataset.commit`); latest rows idempotent.
    """

    pipeline: str
    dlq_topic: str
    kafka_config: dict[str, Any]
    master_path: str
    event_time: str
    file_prefix: str
    latest: tuple[LatestSink, ...]
    cassandra: CassandraSettings
    files: Accumulator
    passthrough: bool

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from lambdalake.cassandra.writer import upsert

        batches = list(batches)
        if not batches:
            return
        table = pa.Table.from_batches(batches)
        failed = pc.is_valid(table.column("_error_rule"))
        send_dead_letters(
            table.filter(failed), kafka_config=self.kafka_config, topic=self.dlq_topic, pipeline=self.pipeline
        )
        drop = [*ERROR_FIELDS, *(s.order for s in self.latest)]
        valid = table.filter(pc.invert(failed))
        events = valid.drop_columns(drop)
        self.files.add(
            frozenset(
                write_event_files(
                    events, path=self.master_path, event_time=self.event_time, name=self._file_name(table)
                )
            )
        )
        for sink in self.latest:
            keys = list(zip(*cassandra_values(valid, list(sink.key)), strict=True))
            order = valid.column(sink.order).to_pylist()
            best: dict[tuple[Any, ...], int] = {}
            for i, (k, o) in enumerate(zip(keys, order, strict=True)):
                if o is not None and (k not in best or o > order[best[k]]):
                    best[k] = i
            rows = valid.take(pa.array(sorted(best.values()), type=pa.int64()))
            values = cassandra_values(rows, [*sink.table.column_names, sink.order])
            upsert(zip(*values, strict=True), table=sink.table, settings=self.cassandra,
                   write_timestamp_index=len(sink.table.column_names))  # fmt: skip
        if self.passthrough:
            yield from events.to_batches()

    def _file_name(self, table: pa.Table) -> str:
        """Unique to the records: the run, the Kafka partition and the task's offset range."""
        topics = pc.unique(table.column("_topic")).to_pylist()
        parts = pc.unique(table.column("_partition")).to_pylist()
        bounds = pc.min_max(table.column("_offset")).as_py()
        if len(topics) == 1 and len(parts) == 1:
            return f"{self.file_prefix}-{topics[0]}-{parts[0]}-{bounds['min']}-{bounds['max']}"
        coords = table.select(["_topic", "_partition", "_offset"]).to_pydict()
        return f"{self.file_prefix}-{hashlib.sha1(repr(coords).encode()).hexdigest()}"


def upsert_view(df: DataFrame, *, table: TableDef, cassandra: CassandraSettings) -> int:
    """Upsert ``df``'s rows (absolute values) into ``table`` from the executors; returns rows written."""

    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from lambdalake.cassandra.writer import upsert

        written = 0
        for batch in batches:
            rows = zip(*cassandra_values(batch, table.column_names), strict=True)
            written += upsert(rows, table=table, settings=cassandra)
        yield pa.RecordBatch.from_pydict({"rows": [written]})

    return sum(r["rows"] for r in df.select(*table.column_names).mapInArrow(write, "rows long").collect())


def drain(df: DataFrame) -> None:
    """Run ``df``'s plan for its side effects (a micro-batch without a windowed view)."""

    def consume(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        yield pa.RecordBatch.from_pydict({"rows": [sum(b.num_rows for b in batches)]})

    df.mapInArrow(consume, "rows long").collect()
