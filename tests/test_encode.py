"""Column-at-a-time encoding gives the bytes the driver's own serializers give, value by value."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pytest
from cassandra import cqltypes

from lambdalake.cassandra.encode import ENCODINGS, encode_column, encode_rows, to_arrow

PROTOCOL = 3

#: CQL type -> the driver's serializer and the Python values it is given.
CASES: dict[str, tuple[type, list[Any]]] = {
    "text": (cqltypes.UTF8Type, ["", "Lamp", "Zürich ☕", None, "x" * 300]),
    "blob": (cqltypes.BytesType, [b"", b"\x00\xff", None]),
    "bigint": (cqltypes.LongType, [0, -1, 2**63 - 1, -(2**63), None, 1_700_000_000_000]),
    "int": (cqltypes.Int32Type, [0, -1, 2**31 - 1, -(2**31), None]),
    "double": (cqltypes.DoubleType, [0.0, -1.5, 1e300, float("inf"), None]),
    "float": (cqltypes.FloatType, [0.0, -1.5, 3.25, None]),
    "boolean": (cqltypes.BooleanType, [True, False, None, True]),
    "decimal": (
        cqltypes.DecimalType,
        [Decimal("0E-9"), Decimal("-1.500000000"), None, Decimal("12345678901234567890.123456789")],
    ),
    "timestamp": (
        cqltypes.DateType,
        [
            datetime(2026, 1, 1, tzinfo=UTC),
            datetime(1969, 12, 31, 23, 59, tzinfo=UTC),
            None,
            datetime(2026, 11, 23, 12, 0, 0, 123000, tzinfo=UTC),
        ],
    ),
}


def driver_bytes(kind: type, values: list[Any]) -> list[bytes | None]:
    return [None if v is None else kind.serialize(v, PROTOCOL) for v in values]


@pytest.mark.parametrize("cql", sorted(CASES))
def test_each_type_encodes_as_the_driver_does(cql: str) -> None:
    kind, values = CASES[cql]
    column = pa.array(values, type=ENCODINGS[cql][0])
    assert encode_column(column, cql) == driver_bytes(kind, values)


@pytest.mark.parametrize("cql", sorted(CASES))
def test_chunked_and_sliced_columns_encode_alike(cql: str) -> None:
    kind, values = CASES[cql]
    whole = pa.array(values, type=ENCODINGS[cql][0])
    chunked = pa.chunked_array([whole.slice(0, 2), whole.slice(2)])
    assert encode_column(chunked, cql) == driver_bytes(kind, values)
    assert encode_column(whole.slice(1), cql) == driver_bytes(kind, values[1:])


def test_timestamps_of_any_unit_and_zone_are_milliseconds() -> None:
    when = datetime(2026, 3, 1, 8, 30, 15, 250000, tzinfo=UTC)
    expected = cqltypes.DateType.serialize(when, PROTOCOL)
    for unit in ("s", "ms", "us", "ns"):
        for tz in (None, "UTC"):
            sent = when.replace(microsecond=0) if unit == "s" else when
            column = pa.array([sent], pa.timestamp(unit, tz))
            want = cqltypes.DateType.serialize(sent, PROTOCOL) if unit == "s" else expected
            assert encode_column(column, "timestamp") == [want], (unit, tz)


def test_a_value_that_does_not_fit_its_column_is_an_error() -> None:
    with pytest.raises(pa.ArrowInvalid):
        encode_column(pa.array([2**40]), "int")
    with pytest.raises(KeyError):
        encode_column(pa.array([1]), "smallint")


def test_a_rank_is_a_varint_as_the_driver_encodes_it() -> None:
    """A ``latest`` rank (up to 84 bits) is a Cassandra ``varint``, from an Arrow decimal128(38, 0)."""
    values = [0, 1, -1, 127, 128, -129, 2**63, -(2**63) * 2**20 - 1, 2**83 - 1, None]
    encoded = encode_column(pa.array(values, pa.decimal128(38, 0)), "varint")
    assert encoded == [None if v is None else cqltypes.IntegerType.serialize(v, PROTOCOL) for v in values]


def test_rows_from_python_values_round_trip() -> None:
    columns = [("k", "text"), ("n", "bigint"), ("at", "timestamp")]
    rows = [("a", 1, datetime(2026, 1, 1, tzinfo=UTC)), ("b", None, 1_767_225_600_000)]
    encoded = encode_rows(to_arrow(rows, columns), columns)
    assert encoded == [
        (b"a", cqltypes.LongType.serialize(1, PROTOCOL), cqltypes.DateType.serialize(rows[0][2], PROTOCOL)),
        (b"b", None, cqltypes.DateType.serialize(1_767_225_600_000, PROTOCOL)),
    ]


def test_a_decimal_column_keeps_its_own_scale() -> None:
    values = [Decimal("1.50"), Decimal("-0.07"), None]
    column = pa.array(values, pa.decimal128(9, 2))
    assert encode_column(column, "decimal") == driver_bytes(cqltypes.DecimalType, values)
