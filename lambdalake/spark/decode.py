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

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame
from pyspark.sql.pandas.types import from_arrow_schema

from lambdalake.avro import WireDecoder, WireFormatError, parse_schema
from lambdalake.event_schema import event_schema
from lambdalake.pipeline import Pipeline, Rule
from lambdalake.settings import Settings
from lambdalake.spark.views import INGEST_EPOCH, INGEST_TS
from lambdalake.validation import RankRule, RecordValidator, checked_rules

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
    rules: tuple[Rule | RankRule, ...]
    epoch_seconds: int
    #: Writer schemas known up front, as (registry id, schema JSON). Records written with any other
    #: id fetch theirs from the registry; with none, an executor never imports the registry client
    #: (~0.25 s per Python worker).
    writer_schemas: tuple[tuple[int, str], ...] = ()

    @classmethod
    def of(
        cls, pipeline: Pipeline, settings: Settings, *, writer_schemas: Mapping[int, str] | None = None
    ) -> DecodeSpec:
        return cls(
            pipeline=pipeline.name,
            reader_schema=pipeline.schema_text(),
            registry=settings.registry.client_config(),
            rules=tuple(checked_rules(pipeline)),
            epoch_seconds=pipeline.layers.epoch_seconds,
            writer_schemas=tuple(sorted((writer_schemas or {}).items())),
        )

    @property
    def output_schema(self) -> pa.Schema:
        return pa.schema(list(event_schema(json.loads(self.reader_schema))) + META_FIELDS)


_FETCHERS: dict[str, Callable[[int], str]] = {}


def _fetcher(registry: dict[str, Any]) -> Callable[[int], str]:
    """A per-process cached ``schema id -> schema`` lookup (writer schemas never change for an id)."""
    url = registry["url"]
    if url not in _FETCHERS:
        from confluent_kafka.schema_registry import SchemaRegistryClient

        client = SchemaRegistryClient(registry)
        _FETCHERS[url] = lambda schema_id: client.get_schema(schema_id).schema_str
    return _FETCHERS[url]


def _schema_id(raw: bytes | None) -> int | None:
    """The registry id in a record's header (None if it is too short to have one)."""
    return int.from_bytes(raw[1:5], "big") if raw and len(raw) >= 5 else None


class UnknownSchemaId(LookupError):
    pass


def decoder(spec: DecodeSpec) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The ``mapInArrow`` function: Kafka source batches in, decoded events (and failures) out."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        known = dict(spec.writer_schemas)

        def fetch_or_unknown(schema_id: int) -> str:
            if schema_id in known:
                return known[schema_id]
            from confluent_kafka.schema_registry.error import SchemaRegistryError

            try:
                return _fetcher(spec.registry)(schema_id)
            except SchemaRegistryError as exc:
                if exc.http_status_code == 404:
                    raise UnknownSchemaId(f"schema id {schema_id} is not in the registry") from exc
                raise  # the registry is down or failing: fail the task, Spark retries it

        reader = json.loads(spec.reader_schema)
        wire = WireDecoder(reader, fetch_or_unknown, millis_as_int=True)
        validator = RecordValidator(
            spec.rules, schema=reader, parsed_schema=parse_schema(reader), check_shape=False
        )
        schema = spec.output_schema
        # Records carry timestamp-millis fields as epoch milliseconds (the rules take them so too):
        # converted as millisecond timestamps, then cast to the event schema's type.
        millis = set(wire.millis_fields)
        target = list(event_schema(reader))
        events = pa.struct(
            [f.with_type(pa.timestamp("ms", tz="UTC")) if f.name in millis else f for f in target]
        )
        check = validator.check
        epoch_us = spec.epoch_seconds * 1_000_000
        for batch in batches:
            values = batch.column("value").to_pylist()
            stamps = batch.column("timestamp").cast(pa.int64()).to_pylist()  # microseconds
            records: list[dict[str, Any] | None] = []
            failures: dict[int, tuple[str, str]] = {}  # row -> (rule, reason)
            for row, (raw, ts_us) in enumerate(zip(values, stamps, strict=True)):
                if ts_us is None:
                    # No ingest epoch without it: dead-lettered (and counted) rather than archived
                    # where no view's epoch would ever count it.
                    failures[row] = ("no_timestamp", NO_TIMESTAMP_REASON)
                    records.append(None)
                    continue
                try:
                    record = wire.decode(raw)
                except (WireFormatError, UnknownSchemaId) as exc:
                    failures[row] = ("wire_format", str(exc))
                    records.append(None)
                    continue
                except Exception as exc:  # fastavro raises EOFError, ValueError, ... on corrupt bodies
                    failures[row] = ("avro", f"cannot decode with schema id {_schema_id(raw)}: {exc!r}")
                    records.append(None)
                    continue
                rejection = check(record, now=ts_us / 1e6 if ts_us is not None else None)
                if rejection is not None:
                    failures[row] = (rejection.rule, rejection.reason)
                    record = None
                records.append(record)
            ingest = batch.column("timestamp")
            meta = {
                "_topic": batch.column("topic"),
                "_partition": batch.column("partition"),
                "_offset": batch.column("offset"),
                INGEST_TS: ingest,
                # Kafka timestamps are never negative, so integer division is the floor.
                INGEST_EPOCH: pc.divide(ingest.cast(pa.int64()), epoch_us),
                "_schema_id": pa.array([_schema_id(raw) for raw in values], type=pa.int32()),
                **_failures(failures, batch),
            }
            # One conversion of the records as structs (failed rows null), split into columns.
            flat = pa.array(records, type=events).flatten()
            columns = [c.cast(f.type) if f.name in millis else c for c, f in zip(flat, target, strict=True)]
            columns += [meta[f.name].cast(f.type) for f in META_FIELDS]
            yield pa.RecordBatch.from_arrays(columns, schema=schema)

    return run


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
    rows = range(n)
    failed = pa.array([row in failures for row in rows], type=pa.bool_())
    return {
        "_error_rule": pa.array([failures[r][0] if r in failures else None for r in rows], pa.string()),
        "_error_reason": pa.array([failures[r][1] if r in failures else None for r in rows], pa.string()),
        "_raw_key": pc.if_else(failed, batch.column("key"), pa.scalar(None, pa.binary())),
        "_raw_value": pc.if_else(failed, batch.column("value"), pa.scalar(None, pa.binary())),
    }


def decode(df: DataFrame, spec: DecodeSpec) -> DataFrame:
    """Kafka-source rows -> decoded events plus meta columns (see :data:`META_FIELDS`)."""
    return df.mapInArrow(decoder(spec), from_arrow_schema(spec.output_schema))
