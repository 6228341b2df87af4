"""The Arrow shape of a pipeline's events, derived from its Avro reader schema.

Engine-free (pyarrow only): the Spark decoder builds its columns from it, and the Cassandra table
definitions their column types, so serving can use the latter without importing Spark.
"""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal
from typing import Any

import pyarrow as pa

PRIMITIVES = {
    "string": pa.string(), "long": pa.int64(), "int": pa.int32(), "double": pa.float64(),
    "float": pa.float32(), "boolean": pa.bool_(), "bytes": pa.binary(),
}  # fmt: skip


def arrow_type(avro_type: Any, named: dict[str, pa.DataType]) -> pa.DataType:
    """Arrow type of an Avro type as fastavro decodes it (enums as strings, timestamps tz-aware)."""
    if isinstance(avro_type, list):
        branches = union_members(avro_type)
        if len(branches) <= 1:
            return arrow_type(branches[0], named) if branches else pa.null()
        # A general union: one member per branch but null (as Spark's Avro reader shapes it), exactly
        # one of them set, the struct itself null where the value is.
        return pa.struct([pa.field(member_name(i), arrow_type(b, named)) for i, b in enumerate(branches)])
    if isinstance(avro_type, str):
        if avro_type in named:
            return named[avro_type]
        return PRIMITIVES[avro_type]
    kind, logical = avro_type["type"], avro_type.get("logicalType")
    if logical == "timestamp-millis" or logical == "timestamp-micros":
        return pa.timestamp("us", tz="UTC")
    decimal = decimal_of(avro_type)
    if decimal is not None:
        if kind == "fixed":
            named[avro_type["name"]] = decimal
        return decimal
    if logical == "date" and kind == "int":
        return pa.date32()
    if kind == "fixed":
        t = pa.binary(int(avro_type["size"]))
        named[avro_type["name"]] = t
        return t
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


def union_members(branches: list[Any]) -> list[Any]:
    """The branches of a union that are not null, in order: a general union's struct members."""
    return [b for b in branches if b != "null" and b != {"type": "null"}]


def logical_type(avro_type: Any) -> str | None:
    """The logical type of ``avro_type``, or of the one branch of a nullable union; None for a general
    union or a type without one."""
    if isinstance(avro_type, list):
        branches = union_members(avro_type)
        return logical_type(branches[0]) if len(branches) == 1 else None
    return avro_type.get("logicalType") if isinstance(avro_type, dict) else None


def is_general_union(avro_type: Any) -> bool:
    """Whether ``avro_type`` is a union of several branches besides null (a struct of members)."""
    return isinstance(avro_type, list) and len(union_members(avro_type)) > 1


def general_union_fields(schema: Mapping[str, Any]) -> frozenset[str]:
    """The top-level fields of a record schema whose type is a general union."""
    return frozenset(f["name"] for f in schema["fields"] if is_general_union(f["type"]))


def member_name(index: int) -> str:
    """The struct member of a general union's ``index``-th branch that is not null."""
    return f"member{index}"


def event_schema(reader_schema: dict[str, Any]) -> pa.Schema:
    named: dict[str, pa.DataType] = {}
    return pa.schema([pa.field(f["name"], arrow_type(f["type"], named)) for f in reader_schema["fields"]])


#: The widest decimal Spark and Arrow's decimal128 hold.
MAX_DECIMAL_PRECISION = 38


def decimal_of(avro_type: Any) -> pa.Decimal128Type | None:
    """The Arrow decimal of a ``bytes`` or ``fixed`` type with the decimal logical type, else None.

    A decimal the Avro specification calls invalid (no precision, a scale above it, more digits
    than a fixed of its size holds) is its underlying type, as the specification says readers treat
    it. A valid one wider than 38 digits is refused: Spark and Arrow's decimal128 stop there.
    """
    if not isinstance(avro_type, dict) or avro_type.get("logicalType") != "decimal":
        return None
    kind, precision, scale = avro_type.get("type"), avro_type.get("precision"), avro_type.get("scale", 0)
    if kind not in ("bytes", "fixed") or not _count(precision) or not _count(scale, zero=True):
        return None
    if precision < 1 or scale > precision:
        return None
    if kind == "fixed" and 10**precision - 1 >= 2 ** (8 * int(avro_type["size"]) - 1):
        return None
    if precision > MAX_DECIMAL_PRECISION:
        raise ValueError(
            f"a decimal of precision {precision} is wider than the {MAX_DECIMAL_PRECISION} digits "
            "Spark and Arrow hold: declare a precision of 38 or less"
        )
    return pa.decimal128(precision, scale)


def largest_decimal(precision: int, scale: int) -> Decimal:
    """The largest decimal of ``precision`` digits at ``scale``, exactly (Decimal arithmetic would
    round to its context's 28 digits)."""
    return Decimal(f"{10**precision - 1}E-{scale}")


def _count(value: Any, *, zero: bool = False) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and (value >= 0 if zero else value > 0)
