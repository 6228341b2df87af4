"""Confluent wire format (magic byte 0, 4-byte big-endian schema id, Avro binary) with fastavro.

confluent-kafka's ``AvroSerializer`` writes the same bytes but runs at ~10k records/s per call here;
resolving the schema once and encoding with fastavro's schemaless writer is an order faster.
``AvroDeserializer`` reads what :class:`WireEncoder` writes (tested).
"""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import fastavro

MAGIC = 0
HEADER = struct.Struct(">bI")


class WireFormatError(ValueError):
    """Bytes that are not a Confluent-framed Avro record."""


def parse_schema(schema: str | Mapping[str, Any]) -> Any:
    return fastavro.parse_schema(json.loads(schema) if isinstance(schema, str) else dict(schema))


def unframe(data: bytes) -> tuple[int, memoryview]:
    """Split a framed record into (schema id, Avro body)."""
    if data is None or len(data) < HEADER.size:
        raise WireFormatError(
            f"record of {0 if data is None else len(data)} bytes is too short to be framed Avro"
        )
    magic, schema_id = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise WireFormatError(f"unknown magic byte {magic} (expected {MAGIC}: Confluent wire format)")
    return schema_id, memoryview(data)[HEADER.size :]


@dataclass
class WireEncoder:
    """Encodes records with one registered schema into the Confluent wire format.

    Args:
        schema_id: The registry's id of ``parsed_schema``.
        parsed_schema: The writer schema, parsed by fastavro.
    """

    schema_id: int
    parsed_schema: Any

    def __post_init__(self) -> None:
        self._header = HEADER.pack(MAGIC, self.schema_id)
        self._buf = io.BytesIO()

    def encode(self, record: Mapping[str, Any]) -> bytes:
        buf = self._buf
        buf.seek(0)
        buf.truncate()
        buf.write(self._header)
        fastavro.schemaless_writer(buf, self.parsed_schema, record)
        return buf.getvalue()


class WireDecoder:
    """Decodes framed records into the reader schema's shape, whatever compatible schema wrote them.

    Writer schemas are fetched by id through ``fetch_schema`` once and cached, so records written
    with older or newer compatible versions resolve to one shape (Avro schema resolution).

    Args:
        reader_schema: The pipeline's reader schema (JSON text or dict).
        fetch_schema: Returns the schema JSON text for a registry id.
    """

    def __init__(self, reader_schema: str | Mapping[str, Any], fetch_schema: Callable[[int], str]) -> None:
        self.reader = parse_schema(reader_schema)
        self._fetch = fetch_schema
        self._writers: dict[int, tuple[Any, Any]] = {}

    def writer(self, schema_id: int) -> tuple[Any, Any]:
        """(writer schema, reader schema to resolve to, or None when they are the same)."""
        schemas = self._writers.get(schema_id)
        if schemas is None:
            parsed = parse_schema(self._fetch(schema_id))
            # fastavro compares the two schemas on every record (2-3 µs for a dozen fields): when
            # they are equal, resolution is a no-op and the comparison can be skipped.
            schemas = self._writers[schema_id] = (parsed, None if parsed == self.reader else self.reader)
        return schemas

    def decode(self, data: bytes) -> dict[str, Any]:
        schema_id, body = unframe(data)
        writer, reader = self.writer(schema_id)
        return fastavro.schemaless_reader(io.BytesIO(body), writer, reader)
