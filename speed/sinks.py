"""What each micro-batch writes: dead letters, the master dataset, speed views in Cassandra.

Every sink runs its writes on executors (``foreachPartition``), so it works the same on ``local[2]``
and on a cluster, and every write is idempotent so a replayed micro-batch changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pyspark.sql import Column, DataFrame, Row
from pyspark.sql import functions as F
from pyspark.sql.types import TimestampType

from lambdalake.cassandra.tables import TableDef
from lambdalake.kafka import dlq
from lambdalake.settings import CassandraSettings
from lambdalake.spark.views import INGEST_TS


def dead_letters(df: DataFrame, *, kafka_config: dict[str, Any], topic: str, pipeline: str) -> None:
    """Send failed records to the DLQ with rule and reason. At least once: a replay may repeat some."""

    def send(rows: Iterator[Row]) -> None:
        from confluent_kafka import Producer

        producer = None  # created on the first failed record: most partitions of most batches have none
        failures: list[str] = []

        def delivered(err: Any, _msg: Any) -> None:
            if err is not None:
                failures.append(err.str())

        for r in rows:
            if producer is None:
                producer = Producer({**kafka_config, "enable.idempotence": True, "acks": "all"})
            headers = dlq.headers(
                pipeline=pipeline,
                stage="speed",
                rule=r["_error_rule"],
                reason=r["_error_reason"],
                source=f"{r['_topic']}/{r['_partition']}/{r['_offset']}",
            )
            producer.produce(
                topic, key=r["_raw_key"], value=r["_raw_value"], headers=headers, on_delivery=delivered
            )
            producer.poll(0)
        if producer is None:
            return
        remaining = producer.flush(120)
        if failures or remaining:
            raise RuntimeError(
                f"dead-letter topic {topic}: {len(failures)} failed, {remaining} unsent ({failures[:1]})"
            )

    df.select(
        "_raw_key", "_raw_value", "_error_rule", "_error_reason", "_topic", "_partition", "_offset"
    ).foreachPartition(send)


TIEBREAK_BITS = 20


def version_write_timestamp(df: DataFrame, version: str) -> Column:
    """Cassandra write timestamp of a ``latest`` row: the version, then the earlier delivery.

    ``version * 2^20 + (2^20 - 1 - ingest second mod 2^20)``: the highest version wins whatever the
    order of writes, and between two deliveries of one version the first wins (as in the batch
    layer) when they are less than 2^20 s (12 days) apart. Versions must stay below 8.7e12 (epoch
    milliseconds qualify until the year 2248).
    """
    v = F.col(version)
    v = F.unix_millis(v) if isinstance(df.schema[version].dataType, TimestampType) else v.cast("long")
    span = 1 << TIEBREAK_BITS
    tiebreak = F.lit(span - 1) - F.pmod(F.unix_seconds(F.col(INGEST_TS)), F.lit(span))
    return v * F.lit(span) + tiebreak


def upsert_view(
    df: DataFrame, *, table: TableDef, cassandra: CassandraSettings, write_timestamp: str | None = None
) -> None:
    """Upsert ``df``'s rows into ``table`` from the executors.

    Args:
        df: Rows with at least ``table``'s columns.
        table: Target table.
        cassandra: Cluster settings (travel to executors inside the closure).
        write_timestamp: Column whose value becomes the write timestamp (``latest`` views: the
            version), so the highest version wins whatever the order of writes.
    """
    cols = []
    for name in table.column_names:
        col = F.col(name)
        cols.append(
            F.unix_millis(col).alias(name) if isinstance(df.schema[name].dataType, TimestampType) else col
        )
    if write_timestamp is not None:
        cols.append(version_write_timestamp(df, write_timestamp).alias("_write_ts"))
    index = len(table.column_names) if write_timestamp is not None else None

    def write(rows: Iterator[Row]) -> None:
        from lambdalake.cassandra.writer import upsert

        upsert((tuple(r) for r in rows), table=table, settings=cassandra, write_timestamp_index=index)

    df.select(*cols).foreachPartition(write)
