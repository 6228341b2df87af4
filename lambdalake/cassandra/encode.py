"""Column values serialized for Cassandra's native protocol, a whole Arrow column at a time.

The driver binds a prepared statement value by value in Python: in a bulk publish that cost more
than Cassandra's own work. The
encodings of the CQL types views use are fixed by the protocol (big-endian integers and IEEE
floats, UTF-8 text, raw blobs, a decimal's scale and varint; a null is sent as no value), the same
in protocol versions 3 and 4, so they are produced here with Arrow and NumPy per column (decimals
by the driver's serializer, value by value) and handed to the driver as bound values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

#: CQL type -> (Arrow type the column is cast to, big-endian NumPy dtype; None: variable width).
ENCODINGS: dict[str, tuple[pa.DataType, str | None]] = {
    "text": (pa.string(), None),
    "blob": (pa.binary(), None),
    "bigint": (pa.int64(), ">i8"),
    "int": (pa.int32(), ">i4"),
    "double": (pa.float64(), ">f8"),
    "float": (pa.float32(), ">f4"),
    "boolean": (pa.bool_(), "u1"),
    "timestamp": (pa.timestamp("ms"), ">i8"),
    # Each value its unscaled digits and its own scale: the column's scale when it is an Arrow
    # decimal (an event's decimal field), this one for other values cast to it.
    "decimal": (pa.decimal128(38, 9), None),
    # An integer of any size (a ``latest`` rank): two's complement, big-endian, as few bytes as hold it.
    "varint": (pa.decimal128(38, 0), None),
}


def arrow_type(cql: str) -> pa.DataType:
    """The Arrow type whose values are written to a column of CQL type ``cql``."""
    return ENCODINGS[cql][0]


def encode_column(values: pa.Array | pa.ChunkedArray, cql: str) -> list[bytes | None]:
    """``values`` as the protocol's bytes for CQL type ``cql`` (None where null).

    Raises:
        KeyError: ``cql`` is not a type views use.
        pyarrow.ArrowInvalid: a value does not fit the column's type (e.g. an int overflowing int).
    """
    target, dtype = ENCODINGS[cql]
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if pa.types.is_timestamp(values.type):
        # Milliseconds since the epoch, truncated as the driver truncates a datetime's microseconds.
        micros = pc.cast(pc.cast(values, pa.timestamp("us", tz=values.type.tz)), pa.int64())
        values = pc.divide(micros, 1000)
        target = pa.int64()
    if cql == "decimal":
        # A variable scale and varint per value: the driver's own serializer (decimals are rare).
        from cassandra.cqltypes import DecimalType

        values = values if pa.types.is_decimal(values.type) else values.cast(target)
        return [None if v is None else DecimalType.serialize(v, 3) for v in values.to_pylist()]
    if cql == "varint":
        from cassandra.cqltypes import IntegerType

        values = values if pa.types.is_decimal(values.type) else values.cast(target)
        return [None if v is None else IntegerType.serialize(int(v), 3) for v in values.to_pylist()]
    values = values.cast(target) if values.type != target else values
    if dtype is None:
        return (values.cast(pa.binary()) if cql == "text" else values).to_pylist()
    filled = values.fill_null(False if cql == "boolean" else 0).to_numpy(zero_copy_only=False)
    width = np.dtype(dtype).itemsize
    data = pa.py_buffer(np.ascontiguousarray(filled.astype(dtype)).tobytes())
    fixed = pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), len(values), [None, data])
    if values.null_count:
        fixed = pc.if_else(values.is_null(), pa.scalar(None, pa.binary(width)), fixed)
    return fixed.to_pylist()


def encode_rows(
    data: pa.Table | pa.RecordBatch, columns: Sequence[tuple[str, str]]
) -> list[tuple[bytes | None, ...]]:
    """Rows of ``data``'s ``columns`` ((name, CQL type) pairs, in that order) as encoded values."""
    encoded = [encode_column(data.column(name), cql) for name, cql in columns]
    return list(zip(*encoded, strict=True))


def to_arrow(rows: Sequence[Sequence[Any]], columns: Sequence[tuple[str, str]]) -> pa.Table:
    """Python row values (timestamps as datetimes or epoch ms) as an Arrow table of ``columns``."""
    by_column = list(zip(*rows, strict=True)) if rows else [() for _ in columns]
    pairs = zip(columns, by_column, strict=True)
    return pa.table({name: pa.array(list(col), type=arrow_type(cql)) for (name, cql), col in pairs})
