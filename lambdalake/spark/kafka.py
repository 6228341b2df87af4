"""Reading the pipelines' topics with Spark's own Kafka source (spark-sql-kafka-0-10, on every
session's classpath): the options the speed job's stream and replay's bounded reads share.

Delivery: what the source reads is what the broker committed. Records of aborted transactions and
transaction markers are never read (``isolation.level=read_committed``, as librdkafka's consumers
read); the offsets they take, like those compaction removed, are gaps the source steps over.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from lambdalake.grants import GROUP_PREFIX
from lambdalake.settings import Settings

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

#: Offsets as Spark's Kafka source logs them: {"topic": {"partition": offset}}.
Offsets = dict[str, dict[str, int]]


#: Bounded reads fetch more than the Java consumer's defaults (500 records a poll, 1 MB a
#: partition): a bounded read into Python is faster with fewer, larger fetches. The speed job keeps
#: the defaults: with these it drained a backlog no faster and held more memory (bench.peers; the
#: benchmarks log).
FETCH = {
    "kafka.max.poll.records": "20000",
    "kafka.max.partition.fetch.bytes": str(8 << 20),
    "kafka.fetch.max.bytes": str(64 << 20),
    "kafka.receive.buffer.bytes": str(4 << 20),
}


def source_options(settings: Settings, *, broker_wait_s: float) -> dict[str, str]:
    """The source's options for the platform's broker.

    Args:
        settings: The connection (``KafkaSettings.java_client_config``: SASL, TLS, extra properties).
        broker_wait_s: How long a broker that does not answer (a restart) is waited for before the
            read fails: each offset request waits a third of it, three times. A log end behind
            what was planned is also asked again that often before it counts as a loss.
    """
    options = {f"kafka.{key}": value for key, value in settings.kafka.java_client_config().items()}
    return {
        **options,
        # Not the user's to change: an aborted record read would count in the views.
        "kafka.isolation.level": "read_committed",
        "kafka.default.api.timeout.ms": str(max(10_000, int(broker_wait_s * 333))),
        "fetchOffset.numRetries": "3",
        "fetchOffset.retryIntervalMs": "1000",
        # Any consumer group the source uses is under the prefix a secured cluster grants the speed
        # role (lambdalake.grants), not Spark's default "spark-kafka-source-".
        "groupIdPrefix": f"{GROUP_PREFIX}spark",
    }


def read_ranges(
    spark: SparkSession,
    settings: Settings,
    topic: str,
    ranges: dict[int, tuple[int, int]],
    *,
    min_partitions: int | None = None,
    broker_wait_s: float = 120.0,
) -> DataFrame:
    """The records ``[start, end)`` of each partition of ``topic`` (a bounded read).

    Args:
        ranges: Per partition, the offsets to read; partitions not given are not read.
        min_partitions: Cut the ranges into at least this many tasks (default None: one task per
            partition).
        broker_wait_s: See :func:`source_options`. Default 120 s.

    Records removed from a range after it was planned (retention, or a broker that lost them) fail
    the read, naming the offsets; the gaps compaction leaves do not.
    """
    options = {**FETCH, **source_options(settings, broker_wait_s=broker_wait_s)}  # the user's settings win
    reader = spark.read.format("kafka").options(**options)
    reader = (
        reader.option("assign", json.dumps({topic: sorted(ranges)}))
        .option("startingOffsets", json.dumps({topic: {str(p): s for p, (s, _) in ranges.items()}}))
        .option("endingOffsets", json.dumps({topic: {str(p): e for p, (_, e) in ranges.items()}}))
        .option("failOnDataLoss", "true")
    )
    if min_partitions is not None:
        reader = reader.option("minPartitions", str(min_partitions))
    return reader.load()
