"""Bulk decoding of Confluent-framed Avro inside ``mapInArrow``.

Each record is decoded with its writer schema (fetched from the registry by id, cached per process)
resolved to the pipeline's reader schema, then checked against the pipeline's rules. A record that
cannot be decoded or breaks a rule comes out with ``_error_rule``/``_error_reason`` and its raw bytes,
for the dead-letter topic; the stream goes on.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql.pandas.types import from_arrow_schema

from lambdalake.avro import WireDecoder, WireFormatError, parse_schema
from lambdalake.pipeline import Pipeline, Rule
from lambdalake.settings import Settings
from lambdalake.spark.views import INGEST_EPOCH, INGEST_TS
from lambdalake.validation import RecordValidator

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
ERROR_FIELDS = ("_error_rule", "_error_reason", "_raw_key", "_raw_value")

PRIMITIVES = {
    "string": pa.string(), "long": pa.int64(), "int": pa.int32(), "double": pa.float64(),
    "float": pa.float32(), "boolean": pa.bool_(), "bytes": pa.binary(),
}  # fmt: skip


def arrow_type(avro_type: Any, named: dict[str, pa.DataType]) -> pa.DataType:
    """Arrow type of an Avro type as fastavro decodes it (enums as strings, timestamps tz-aware)."""
    if isinstance(avro_type, list):
        branches = [t for t in avro_type if t != "null"]
        if len(branches) != 1:
            raise ValueError(f"only [null, T] unions are supported, not {avro_type}")
        return arrow_type(branches[0], named)
    if isinstance(avro_type, str):
        if avro_type in named:
            return named[avro_type]
        return PRIMITIVES[avro_type]
    kind, logical = avro_type["type"], avro_type.get("logicalType")
    if logical == "timestamp-millis" or logical == "timestamp-micros":
        return pa.timestamp("us", tz="UTC")
    if kind == "enum":
        named[avro_type["name"]] = pa.string()
        return pa.string()
    if kind == "record":
        t = pa.struct([pa.field(f["name"], arrow_type(f["type"], named)) for f in avro_type["fields"]])
        named[avro_type["name"]] = t
        return t
    if kind == "array":
        return pa.list_(arrow_type(avro_type["items"], named))
    if kind == "map":
        return pa.map_(pa.string(), arrow_type(avro_type["values"], named))
    return arrow_type(kind, named)


def event_schema(reader_schema: dict[str, Any]) -> pa.Schema:
    named: dict[str, pa.DataType] = {}
    return pa.schema([pa.field(f["name"], arrow_type(f["type"], named)) for f in reader_schema["fields"]])


@dataclass(frozen=True)
class DecodeSpec:
    """Everything an executor needs to decode one pipeline's records (picklable)."""

    pipeline: str
    reader_schema: str
    registry: dict[str, Any]
    rules: tuple[Rule, ...]
    epoch_seconds: int

    @classmethod
    def of(cls, pipeline: Pipeline, settings: Settings) -> DecodeSpec:
        return cls(
            pipeline=pipeline.name,
            reader_schema=pipeline.schema_text(),
            registry=settings.registry.client_config(),
            rules=tuple(pipeline.rules),
            epoch_seconds=settings.epoch_seconds,
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


class UnknownSchemaId(LookupError):
    pass


def decoder(spec: DecodeSpec) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The ``mapInArrow`` function: Kafka source batches in, decoded events (and failures) out."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from confluent_kafka.schema_registry.error import SchemaRegistryError

        fetch = _fetcher(spec.registry)

        def fetch_or_unknown(schema_id: int) -> str:
            try:
                return fetch(schema_id)
            except SchemaRegistryError as exc:
                if exc.http_status_code == 404:
                    raise UnknownSchemaId(f"schema id {schema_id} is not in the registry") from exc
                raise  # the registry is down or failing: fail the task, Spark retries it

        reader = json.loads(spec.reader_schema)
        wire = WireDecoder(reader, fetch_or_unknown)
        validator = RecordValidator(
            spec.rules, schema=reader, parsed_schema=parse_schema(reader), check_shape=False
        )
        schema = spec.output_schema
        fields = [f.name for f in event_schema(reader)]
        epoch_us = spec.epoch_seconds * 1_000_000
        for batch in batches:
            keys = batch.column("key").to_pylist()
            values = batch.column("value").to_pylist()
            topics = batch.column("topic").to_pylist()
            parts = batch.column("partition").to_pylist()
            offsets = batch.column("offset").to_pylist()
            stamps = batch.column("timestamp").cast(pa.int64()).to_pylist()  # microseconds
            cols: dict[str, list[Any]] = {name: [] for name in schema.names}
            for i, raw in enumerate(values):
                ts_us = stamps[i]
                rule = reason = None
                record: dict[str, Any] | None = None
                schema_id = None
                try:
                    schema_id = int.from_bytes(raw[1:5], "big") if raw and len(raw) >= 5 else None
                    record = wire.decode(raw)
                except (WireFormatError, UnknownSchemaId) as exc:
                    rule, reason = "wire_format", str(exc)
                except Exception as exc:  # fastavro raises EOFError, ValueError, ... on corrupt bodies
                    rule, reason = "avro", f"cannot decode with schema id {schema_id}: {exc!r}"
                if record is not None:
                    rejection = validator.check(record, now=ts_us / 1e6 if ts_us is not None else None)
                    if rejection is not None:
                        rule, reason = rejection.rule, rejection.reason
                ok = rule is None
                for name in fields:
                    cols[name].append(record.get(name) if ok and record is not None else None)
                cols["_topic"].append(topics[i])
                cols["_partition"].append(parts[i])
                cols["_offset"].append(offsets[i])
                cols[INGEST_TS].append(ts_us)
                cols[INGEST_EPOCH].append(ts_us // epoch_us if ts_us is not None else None)
                cols["_schema_id"].append(schema_id)
                cols["_error_rule"].append(rule)
                cols["_error_reason"].append(reason)
                cols["_raw_key"].append(None if ok else keys[i])
                cols["_raw_value"].append(None if ok else raw)
            yield pa.RecordBatch.from_arrays(
                [pa.array(cols[f.name], type=f.type) for f in schema], schema=schema
            )

    return run


def decode(df: DataFrame, spec: DecodeSpec) -> DataFrame:
    """Kafka-source rows -> decoded events plus meta columns (see :data:`META_FIELDS`)."""
    return df.mapInArrow(decoder(spec), from_arrow_schema(spec.output_schema))
