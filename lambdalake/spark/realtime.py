"""The ``latest`` views as a Real-time Mode query of their own (``speed.latest = "realtime"``).

Real-time Mode runs a stateless query in tasks that last a whole batch (``speed.realtime_batch_s``)
and hand each record on as it arrives, but only through operators on its allowlist: no Python UDF,
no ``mapInArrow``, no ``foreachBatch``. So this path is made of Spark's own expressions, ending in a
writer in the JVM (``lambdalake/maven/writer``, built by ``make setup``):

1. the Kafka source (committed records only, as the speed job reads);
2. the Confluent wire header read with expressions: magic byte, writer schema id;
3. ``from_avro`` per writer schema id, resolved to the reader schema (``avroSchema``), each field
   then in the form the micro-batch path's decode gives it (:func:`event_columns`);
4. the edge's rules as expressions (:mod:`lambdalake.spark.rules`): a record the speed job would
   dead-letter never reaches a latest view (its dead letter stays the speed job's);
5. per view its filter (:mod:`lambdalake.spark.filters`) and its rank (:func:`lambdalake.latest.spark_rank`),
   then the candidate's columns as its table holds them;
6. ``lambdalake.realtime.CandidateWriter``: the INSERT and the DELETE of lower candidates the
   micro-batch writer sends, at the settings' consistency; a candidate as it arrives when the writer
   is idle, those that waited meanwhile (a key's best only) ``cassandra.batch_rows`` a request.

A record written with a writer schema id the query does not know stops it
(``UnknownWriterSchema``): the speed job starts it again from its checkpoint knowing that id.

Delivery: at least once into idempotent candidate rows. Offsets are checkpointed at the end of each
batch, after the writer has every write of the batch acknowledged.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.avro.functions import from_avro
from pyspark.sql.pandas.types import from_arrow_type
from pyspark.sql.streaming import StreamingQuery
from pyspark.sql.types import DataType

from lambdalake.cassandra.tables import TableDef, speed_table_def
from lambdalake.cassandra.writer import GIVE_UP_AFTER_S
from lambdalake.errors import ConfigurationError
from lambdalake.event_schema import event_schema, general_union_fields, logical_type
from lambdalake.filters import fields as filter_fields
from lambdalake.latest import CANDIDATE, OFFSET, PARTITION, RANK, RANK_SPARK, spark_rank
from lambdalake.pipeline import LatestView, Pipeline
from lambdalake.settings import Settings
from lambdalake.spark.filters import column as filter_column
from lambdalake.spark.rules import valid
from lambdalake.spark.views import INGEST_EPOCH, INGEST_TS
from lambdalake.views import latest_columns

#: The message the writer stops a task with on a record of an unknown writer schema id.
UNKNOWN_PREFIX = "lambdalake: unknown writer schema id "

#: Spark's shortest Real-time batch unless :data:`MIN_BATCH_CONF` says otherwise.
MIN_BATCH_CONF = "spark.sql.streaming.realTimeMode.minBatchDuration"
SPARK_MIN_BATCH_MS = 5000

#: CQL type -> the Spark type a candidate's column is cast to before the writer binds it.
SPARK_TYPES = {
    "text": "string", "blob": "binary", "bigint": "bigint", "int": "int", "double": "double",
    "float": "float", "boolean": "boolean", "timestamp": "timestamp", "varint": RANK_SPARK,
}  # fmt: skip


def unknown_schema_id(error: BaseException | str | None) -> int | None:
    """The writer schema id a Real-time query stopped on, from its error (None: another error)."""
    found = re.search(re.escape(UNKNOWN_PREFIX) + r"(-?\d+)", str(error or ""))
    return int(found.group(1)) if found else None


def _schema_id(value: Column) -> Column:
    """The writer schema id of a framed value: bytes 2-5, a big-endian signed 32-bit integer. Costly
    (``conv`` parses a hex string: 7 % of the query's CPU when every record had it computed), so only
    a record whose id is unknown has it; the others compare :func:`_id_bytes`."""
    unsigned = F.conv(F.hex(_id_bytes(value)), 16, 10).cast("long")
    return F.when(unsigned >= 1 << 31, unsigned - (1 << 32)).otherwise(unsigned)


def _id_bytes(value: Column) -> Column:
    """A framed value's writer schema id as its four bytes."""
    return F.substring(value, 2, 4)


def _is_id(id_bytes: Column, schema_id: int) -> Column:
    """Whether a header's four id bytes are ``schema_id``'s (a binary comparison, no parsing)."""
    return id_bytes == F.lit(bytearray(schema_id.to_bytes(4, "big", signed=True)))


def _millis(ts: Column) -> Column:
    """A timestamp cut to milliseconds as the micro-batch path cuts it (toward zero, as Arrow's
    integer division does) and as Cassandra's ``timestamp`` holds it."""
    micros = F.unix_micros(ts)
    return F.timestamp_millis(((micros - micros % 1000) / 1000).cast("long"))


def event_columns(decoded: Column, reader: Mapping[str, Any], types: Mapping[str, DataType]) -> list[Column]:
    """The decoded struct's fields in the form the micro-batch path's decode gives them
    (:func:`lambdalake.event_schema.event_schema`): ``from_avro`` reads a ``local-timestamp-*`` as
    a timestamp without zone where that decode keeps the long the record carries."""
    out = []
    for field in reader["fields"]:
        name = field["name"]
        col = decoded.getField(name)
        logical = logical_type(field["type"])
        if logical == "local-timestamp-millis":
            col = F.unix_millis(col.cast("timestamp"))
        elif logical == "local-timestamp-micros":
            col = F.unix_micros(col.cast("timestamp"))
        out.append(col.cast(types[name]).alias(name))
    return out


@dataclass(frozen=True)
class LatestTarget:
    """One latest view's table and its candidate's columns."""

    view: LatestView
    table: TableDef

    def candidate(self, events: DataFrame, pipeline: Pipeline) -> Column:
        """The view's candidate of each record as a struct of its table's columns, null where the
        view's filter does not keep it."""
        stored = {c: s for s in self.table.stored for c, _ in s.columns}
        values = []
        for name, cql in self.table.columns:
            spark_type = SPARK_TYPES.get(cql)
            if name in stored:
                s = stored[name]
                col = F.col(s.field) if name == s.current else F.lit(None)
            elif name == RANK:
                col = spark_rank(events, self.view.version)
            else:
                col = F.col(name)
            if cql == "timestamp":
                col = _millis(col.cast("timestamp"))
            # A decimal keeps its own type and scale, as the micro-batch writer sends it.
            if spark_type is not None:
                col = col.cast(spark_type)
            values.append(col.alias(name))
        keep = F.lit(True)
        where = pipeline.view_filter(self.view)
        if where is not None:
            keep = F.coalesce(filter_column(where), F.lit(False))
        return F.when(keep, F.struct(*values))


def latest_targets(pipeline: Pipeline) -> list[LatestTarget]:
    """The pipeline's latest views and their speed tables, checked for what this path can write."""
    targets = [
        LatestTarget(view, speed_table_def(pipeline, view))
        for view in pipeline.views
        if isinstance(view, LatestView)
    ]
    unions = general_union_fields(pipeline.reader_schema)
    for t in targets:
        used = {*latest_columns(pipeline, t.view), t.view.version}
        where = pipeline.view_filter(t.view)
        if where is not None:
            used |= set(filter_fields(where))
        kept = sorted(used & unions)
        if kept:
            raise ConfigurationError(
                f"view {t.view.name!r} of pipeline {pipeline.name!r} reads the general union "
                f"field(s) {kept}, which the Real-time path does not decode as the micro-batch path does",
                fix='set speed.latest = "microbatch" (LAMBDALAKE_SPEED__LATEST=microbatch) for it',
            )
    return targets


def decoded_records(
    records: DataFrame,
    pipeline: Pipeline,
    *,
    writers: Mapping[int, str],
    missing: frozenset[int] = frozenset(),
) -> tuple[DataFrame, Column]:
    """``records`` (Kafka source rows) decoded: the event columns, the Kafka coordinates, the ingest
    time and epoch, and ``_unknown`` (a writer schema id neither in ``writers`` nor in ``missing``,
    the ids the registry does not hold). Also returns the column that says a record is valid."""
    reader = pipeline.reader_schema
    reader_text = pipeline.schema_text()
    types = {f.name: from_arrow_type(f.type) for f in event_schema(reader)}
    value = F.col("value")
    header_id = _id_bytes(value)
    framed = (F.length(value) >= 5) & (F.substring(value, 1, 1) == F.lit(bytearray(b"\x00")))
    payload = F.expr("substring(value, 6, length(value) - 5)")
    options = {"avroSchema": reader_text, "mode": "PERMISSIVE"}
    branches = [
        F.when(_is_id(header_id, k), from_avro(payload, text, options)) for k, text in sorted(writers.items())
    ]
    event = F.coalesce(*branches) if len(branches) > 1 else branches[0] if branches else F.lit(None)
    known = F.lit(False)
    for k in [*writers, *missing]:
        known = known | _is_id(header_id, k)
    unknown = F.when(framed & ~known, _schema_id(value).cast("int"))
    epoch_us = pipeline.layers.epoch_seconds * 1_000_000
    staged = records.select(
        event.alias("_event"),
        unknown.alias("_unknown"),
        framed.alias("_framed"),
        F.col("partition").alias(PARTITION),
        F.col("offset").alias(OFFSET),
        F.col("timestamp").alias(INGEST_TS),
    )
    ts = F.col(INGEST_TS)
    events = staged.select(
        *event_columns(F.col("_event"), reader, types),
        "_unknown", "_framed", F.col("_event").isNotNull().alias("_decoded"), PARTITION, OFFSET, INGEST_TS,
        F.expr(f"unix_micros({INGEST_TS}) div {epoch_us}").alias(INGEST_EPOCH),
    )  # fmt: skip
    ok = F.col("_framed") & F.col("_decoded") & ts.isNotNull() & valid(pipeline, events, now=ts)
    return events, ok


def latest_stream(
    records: DataFrame,
    pipeline: Pipeline,
    *,
    writers: Mapping[int, str],
    missing: frozenset[int] = frozenset(),
) -> tuple[DataFrame, list[LatestTarget]]:
    """The rows the writer takes: ``_unknown``, then per latest view its candidate (or null)."""
    targets = latest_targets(pipeline)
    events, ok = decoded_records(records, pipeline, writers=writers, missing=missing)
    candidates = [F.when(ok, t.candidate(events, pipeline)).alias(f"_view{i}") for i, t in enumerate(targets)]
    rows = events.select(F.col("_unknown"), *candidates)
    keep = F.col("_unknown").isNotNull()
    for i in range(len(targets)):
        keep = keep | F.col(f"_view{i}").isNotNull()
    return rows.filter(keep), targets


def jvm_writer(spark: SparkSession, settings: Settings, targets: list[LatestTarget]) -> Any:
    """The JVM writer for ``targets``, configured from the settings (the password travels inside
    it to the executors, as Spark's own conf does, and is never logged)."""
    cas = settings.cassandra
    jvm = spark.sparkContext._jvm  # type: ignore[attr-defined]
    password = cas.password.get_secret_value() if cas.password else None
    protocol = None if cas.protocol_version is None else f"V{cas.protocol_version}"
    # The CA's text, not its path: the executors may run on hosts without the driver's files.
    ca = Path(cas.ssl_ca_location).read_text() if cas.ssl_ca_location else None
    cluster = jvm.lambdalake.realtime.Cluster(
        list(cas.contact_points), cas.port, cas.username, password, protocol, 30_000, ca,
        cas.ssl_check_hostname,
    )  # fmt: skip
    keyspace = cas.keyspace
    return jvm.lambdalake.realtime.CandidateWriter(
        cluster,
        [t.table.insert_cql(keyspace) for t in targets],
        [t.table.delete_lower_cql(keyspace) for t in targets],
        [t.table.delete_lower_at for t in targets],
        [[t.table.column_names.index(c) for c in CANDIDATE] for t in targets],
        cas.consistency,
        cas.batch_rows,
        # As long as the micro-batch writer; the task then fails and the query restarts from its
        # checkpoint.
        int(GIVE_UP_AFTER_S * 1000),
    )


def start_latest_query(
    spark: SparkSession,
    settings: Settings,
    pipeline: Pipeline,
    records: DataFrame,
    *,
    checkpoint: str,
    writers: Mapping[int, str],
    missing: frozenset[int] = frozenset(),
    write: bool = True,
) -> StreamingQuery:
    """Start the pipeline's latest views' Real-time query over ``records`` (the Kafka source).
    ``write``: False computes every candidate as the query does and writes none (what the writes
    cost, measured: ``bench.realtime_drain``)."""
    rows, targets = latest_stream(records, pipeline, writers=writers, missing=missing)
    # Spark refuses batches shorter than its minimum (5 s unless set): the setting's batch length
    # is the user's choice, so it lowers that minimum where it is shorter.
    batch_ms = settings.speed.realtime_batch_s * 1000
    spark.conf.set(MIN_BATCH_CONF, f"{min(batch_ms, SPARK_MIN_BATCH_MS)}ms")
    writer = (
        rows.writeStream.queryName(f"{pipeline.name}-latest")
        .outputMode("update")
        .option("checkpointLocation", checkpoint)
        .trigger(realTime=f"{settings.speed.realtime_batch_s} seconds")
    )
    writer._jwrite = writer._jwrite.foreach(jvm_writer(spark, settings, targets if write else []))
    # The driver logs a failed task's report too (the executors install it as their writer opens).
    spark.sparkContext._jvm.lambdalake.realtime.ExpectedFailures.install()  # type: ignore[attr-defined]
    return writer.start()
