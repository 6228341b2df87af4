"""Avro compatibility levels, checked with Apache Avro's own reader/writer resolution rules."""

from __future__ import annotations

from typing import Literal

import avro.schema
from avro.compatibility import ReaderWriterCompatibilityChecker, SchemaCompatibilityType

Level = Literal[
    "NONE", "BACKWARD", "BACKWARD_TRANSITIVE", "FORWARD", "FORWARD_TRANSITIVE", "FULL", "FULL_TRANSITIVE"
]
LEVELS: tuple[str, ...] = Level.__args__  # type: ignore[attr-defined]


def parse(schema_str: str) -> avro.schema.Schema:
    """Parse an Avro schema; raises ``avro.errors.SchemaParseException`` (or ValueError) if invalid."""
    return avro.schema.parse(schema_str)


def _can_read(reader: avro.schema.Schema, writer: avro.schema.Schema) -> list[str]:
    result = ReaderWriterCompatibilityChecker().get_compatibility(reader, writer)
    if result.compatibility is SchemaCompatibilityType.compatible:
        return []
    return [
        f"{kind.value}: {msg} at {loc}"
        for kind, msg, loc in zip(
            result.incompatibilities, sorted(result.messages), sorted(result.locations), strict=False
        )
    ] or ["incompatible"]


def check(new: str, existing: list[str], level: str) -> list[str]:
    """Reasons ``new`` may not follow ``existing`` (oldest first) under ``level``; empty if it may.

    BACKWARD: the new schema reads data written with the latest one. FORWARD: the latest reads data
    written with the new one. FULL: both. ``*_TRANSITIVE`` checks every earlier version, not just
    the latest.
    """
    if level == "NONE" or not existing:
        return []
    new_schema = parse(new)
    against = existing if level.endswith("_TRANSITIVE") else existing[-1:]
    base = level.removesuffix("_TRANSITIVE")
    reasons: list[str] = []
    for old_str in against:
        old = parse(old_str)
        if base in ("BACKWARD", "FULL"):
            reasons += [
                f"new schema cannot read data written with an existing version ({r})"
                for r in _can_read(new_schema, old)
            ]
        if base in ("FORWARD", "FULL"):
            reasons += [
                f"an existing version cannot read data written with the new schema ({r})"
                for r in _can_read(old, new_schema)
            ]
    return reasons
