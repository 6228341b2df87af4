"""Bulk decoding of Confluent-framed Avro inside ``mapInArrow``.

Each record is decoded with its writer schema (fetched from the registry by id, cached per process)
resolved to the pipeline's reader schema, then checked against the pipeline's rules. A record that
cannot be decoded or breaks a rule comes out with ``_error_rule``/``_error_reason`` and its raw bytes,
for the dead-letter topic; the stream goes on.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame
from pyspark.sql.pandas.types import from_arrow_schema

from lambdalake import writer_schemas
from lambdalake.avro import parse_schema
from lambdalake.columnar import ColumnarDecoder
from lambdalake.columnar.validate import ColumnarValidator
from lambdalake.event_schema import event_schema, logical_type
from lambdalake.pipeline import Pipeline, Rule
from lambdalake.settings import Settings
from lambdalake.spark.views import INGEST_EPOCH, INGEST_TS
from lambdalake.validation import RecordValidator, checked_rules

META_FIELDS = [
    pa.field("_topic", pa.string()),
    pa.field("_partition", pa.int32()),
    pa.field("_offset", pa.int64()),
    pa.field(INGEST_TS, pa.timestamp("us", tz="UTC")),
    pa.field(INGEST_EPOCH, pa.int64()),
    pa.field("_schema_id", pa.int32()),
    pa.field("_error_rule", pa.string()),
    pa.field("_error_reason", pa.string()),
    pa.field("_raw_key", pa.binary()),
    pa.field("_raw_value", pa.binary()),
]
#: Meta columns that describe a failure; dropped from valid events.
NO_TIMESTAMP_REASON = (
    "the Kafka record has no timestamp, so its ingest epoch is unknown (the topic must stamp records "
    "with message.timestamp.type=LogAppendTime)"
)
ERROR_FIELDS = ("_error_rule", "_error_reason", "_raw_key", "_raw_value")


@dataclass(frozen=True)
class DecodeSpec:
    """Everything an executor needs to decode one pipeline's records (picklable)."""

    pipeline: str
    reader_schema: str
    registry: dict[str, Any]
    rules: tuple[Rule, ...]
    epoch_seconds: int
    #: Writer schemas known up front, as (registry id, schema JSON). Records written with any other
    #: id fetch theirs from the registry; with none, an executor never imports the registry client
    #: (a cost paid by each Python worker).
    writer_schemas: tuple[tuple[int, str], ...] = ()

    @classmethod
    def of(
        cls, pipeline: Pipeline, settings: Settings, *, writer_schemas: Mapping[int, str] | None = None
    ) -> DecodeSpec:
        return cls(
            pipeline=pipeline.name,
            reader_schema=pipeline.schema_text(),
            registry=settings.registry.task_config(),
            rules=tuple(checked_rules(pipeline)),
            epoch_seconds=pipeline.layers.epoch_seconds,
            writer_schemas=tuple(sorted((writer_schemas or {}).items())),
        )

    @property
    def output_schema(self) -> pa.Schema:
        return pa.schema(list(event_schema(json.loads(self.reader_schema))) + META_FIELDS)


_FETCHERS: dict[str, Callable[[int], str]] = {}


#: How long a task waits out a registry that does not answer (restarting, say) before it fails.
REGISTRY_PATIENCE_S = 600.0


def _fetcher(registry: dict[str, Any]) -> Callable[[int], str]:
    """A per-process cached ``schema id -> schema`` lookup (writer schemas never change for an id)."""
    url = registry["url"]
    if url not in _FETCHERS:
        _FETCHERS[url] = writer_schemas.fetcher(registry, patience_s=REGISTRY_PATIENCE_S)
    return _FETCHERS[url]


def decoder(spec: DecodeSpec) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The ``mapInArrow`` function: Kafka source batches in, decoded events (and failures) out.

    Values are decoded a batch at a time over columns (:class:`lambdalake.columnar.ColumnarDecoder`)
    and the rules checked over columns too (:class:`lambdalake.columnar.validate.ColumnarValidator`);
    a row those checks cannot clear is checked by the per-record validator, which gives the verdict.
    """

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        known = dict(spec.writer_schemas)

        def fetch_or_unknown(schema_id: int) -> str:
            if schema_id in known:
                return known[schema_id]
            # An id the registry does not hold fails its rows (SchemaIdNotFound); a registry that
            # cannot answer fails the task (RegistryUnavailable), which Spark retries.
            return _fetcher(spec.registry)(schema_id)

        reader = json.loads(spec.reader_schema)
        columnar = ColumnarDecoder(reader, fetch_or_unknown, unknown=(writer_schemas.SchemaIdNotFound,))
        validator = RecordValidator(
            spec.rules, schema=reader, parsed_schema=parse_schema(reader), check_shape=False
        )
        checks = ColumnarValidator(spec.rules, schema=reader, check_shape=False)
        schema = spec.output_schema
        millis = millis_fields(reader)
        events_type = pa.struct(list(event_schema(reader)))
        epoch_us = spec.epoch_seconds * 1_000_000
        for batch in batches:
            n = batch.num_rows
            stamps = batch.column("timestamp").cast(pa.int64())  # microseconds
            stamped = np.asarray(stamps.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
            stamps_us = stamps.fill_null(0).to_numpy()
            # No ingest epoch without a timestamp: dead-lettered (and counted) rather than archived
            # where no view's epoch would ever count it.
            failures = {int(r): ("no_timestamp", NO_TIMESTAMP_REASON) for r in np.flatnonzero(~stamped)}
            decoded = columnar.decode(batch.column("value"))
            ids = decoded.schema_ids
            for r, reason in decoded.errors.items():
                if r not in failures:
                    failures[r] = (
                        ("wire_format", reason) if r in decoded.unframed
                        else ("avro", f"cannot decode with schema id {ids[r].as_py()}: {reason}")
                    )  # fmt: skip
            rows = decoded.rows
            # The rules see timestamp-millis fields as epoch milliseconds, as the records carry them.
            ruled = _millis_as_ints(decoded.batch, millis)
            if len(rows):
                now = stamps_us[rows] / 1e6
                for i in np.flatnonzero(checks.suspects(ruled, now=now) & stamped[rows]).tolist():
                    r = int(rows[i])
                    record = ruled.slice(i, 1).to_pylist()[0]
                    rejection = validator.check(record, now=stamps_us[r] / 1e6)
                    if rejection is not None:
                        failures[r] = (rejection.rule, rejection.reason)
            # Each input row takes its decoded event; failed rows are null.
            index = np.full(n, -1, dtype=np.int64)
            index[rows] = np.arange(len(rows))
            if failures:
                index[np.fromiter(failures, dtype=np.int64, count=len(failures))] = -1
            struct = pa.StructArray.from_arrays(decoded.batch.columns, fields=list(decoded.batch.schema))
            taken = struct.take(pa.array(index, mask=index < 0)).cast(events_type)
            ingest = batch.column("timestamp")
            meta = {
                "_topic": batch.column("topic"),
                "_partition": batch.column("partition"),
                "_offset": batch.column("offset"),
                INGEST_TS: ingest,
                # Kafka timestamps are never negative, so integer division is the floor.
                INGEST_EPOCH: pc.divide(ingest.cast(pa.int64()), epoch_us),
                "_schema_id": ids,
                **_failures(failures, batch),
            }
            columns = [*taken.flatten(), *(meta[f.name].cast(f.type) for f in META_FIELDS)]
            yield pa.RecordBatch.from_arrays(columns, schema=schema)

    return run


def millis_fields(reader: Mapping[str, Any]) -> list[str]:
    """Top-level fields of the reader schema with the timestamp-millis logical type (alone or with
    null: a general union's branch is a struct member, not a column)."""
    return [f["name"] for f in reader["fields"] if logical_type(f["type"]) == "timestamp-millis"]


def _millis_as_ints(batch: pa.RecordBatch, names: list[str]) -> pa.RecordBatch:
    """``batch`` with the ``names`` timestamp columns as int64 epoch milliseconds (floored)."""
    for name in names:
        i = batch.schema.get_field_index(name)
        micros = batch.column(i).cast(pa.int64())
        nulls = np.asarray(micros.is_null().to_numpy(zero_copy_only=False), dtype=bool)
        ms = pa.array(np.floor_divide(micros.fill_null(0).to_numpy(), 1000), mask=nulls)
        batch = batch.set_column(i, name, ms)
    return batch


def _failures(failures: dict[int, tuple[str, str]], batch: pa.RecordBatch) -> dict[str, pa.Array]:
    """The failure columns of a batch: rule, reason and raw bytes of the failed rows, null elsewhere."""
    n = batch.num_rows
    if not failures:  # the common case: no per-row work
        return {
            "_error_rule": pa.nulls(n, pa.string()),
            "_error_reason": pa.nulls(n, pa.string()),
            "_raw_key": pa.nulls(n, pa.binary()),
            "_raw_value": pa.nulls(n, pa.binary()),
        }
    rows = np.fromiter(failures, dtype=np.int64, count=len(failures))
    rule = np.full(n, None, dtype=object)
    reason = np.full(n, None, dtype=object)
    rule[rows] = [r for r, _ in failures.values()]
    reason[rows] = [why for _, why in failures.values()]
    failed = np.zeros(n, dtype=bool)
    failed[rows] = True
    failed_arr = pa.array(failed)
    return {
        "_error_rule": pa.array(rule, pa.string()),
        "_error_reason": pa.array(reason, pa.string()),
        "_raw_key": pc.if_else(failed_arr, batch.column("key"), pa.scalar(None, pa.binary())),
        "_raw_value": pc.if_else(failed_arr, batch.column("value"), pa.scalar(None, pa.binary())),
    }


def decode(df: DataFrame, spec: DecodeSpec) -> DataFrame:
    """Kafka-source rows -> decoded events plus meta columns (see :data:`META_FIELDS`)."""
    return df.mapInArrow(decoder(spec), from_arrow_schema(spec.output_schema))
