"""An event's identity as one canonical encoding and one 128-bit hash, the same in every engine.

Identity decides what counts once: the speed layer's deduplication (:mod:`speed.dedup`), the batch
layer's identity index (:mod:`batch.identities`) and a ``distinct`` aggregate's sketch input all
compare identities by this hash, so they agree on every value whatever engine meets it.

**The encoding.** Each part of an identity is a *kind* and a canonical *payload*:

====================  =====  ==========================================================
value                 kind   payload
====================  =====  ==========================================================
null                  0      none (a null never moves between parts: its kind marks it)
a whole number        1      the number as a long: int 5, long 5 and double 5.0 are one
                             number, as Avro's promotions require (``-0.0`` is ``0``)
any other double      2      its IEEE-754 bits as a long (every NaN as one NaN; floats
                             as the double they widen to, exactly)
string, bytes, fixed,  3      the bytes (text as UTF-8): Avro promotes string and bytes
enum, uuid                   into each other; an enum as its symbol, a uuid as its text
decimal               4      its digits as text, without trailing zeros (``5.00`` is ``5``)
date                  5      days since 1970-01-01, a long
timestamp             6      microseconds since the epoch (UTC), a long
boolean               7      0 or 1, a long
====================  =====  ==========================================================

**The hash** is Spark's ``xxhash64`` over those parts in turn (each kind hashed as an int, each
payload as a long or as bytes, a null payload skipped, each hash seeding the next), computed twice:
from Spark's seed 42 (``h1``), and from the hash of :data:`SECOND_SEED_TEXT` (``h2``). Spark runs it
natively (:func:`spark_hashes`); Arrow tables are hashed by a vectorised copy of the same arithmetic
(:func:`arrow_hashes`); single values by the reference implementation of XXH64 (:func:`value_hashes`).
Tests check the three against each other on generated values of every type. Two identities are taken
for one only on a 128-bit collision.

:data:`ENCODING` names this encoding where hashes are stored (the identity index's commits, the
speed layer's dedup segments), so a reader never compares hashes of two encodings.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any
from uuid import UUID

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame
    from pyspark.sql.types import DataType

#: The encoding's version, stored beside hashes made with it (version 1: the hashes before it, each
#: layer's own).
ENCODING = 2

NULL, NUMBER, FLOAT, BYTES, DECIMAL, DATE, TIMESTAMP, BOOLEAN = range(8)

#: Spark's ``xxhash64`` seed, and the text hashed before the parts for the second hash.
SEED = 42
SECOND_SEED_TEXT = "lambdalake-id"

_P1, _P2, _P3 = 11400714785074694791, 14029467366897019727, 1609587929392839161
_P4, _P5 = 9650029242287828579, 2870177450012600261
_MASK = (1 << 64) - 1
#: Doubles in [-2^63, 2^63) that are whole are numbers (kind 1); others keep their bits (kind 2).
_LONG_RANGE = 2.0**63
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_EPOCH_DAY = date(1970, 1, 1)
_CANONICAL_NAN = 0x7FF8000000000000


# --- One value (the reference) ---------------------------------------------------------------


def canonical_part(value: Any) -> tuple[int, int | bytes | None]:
    """The kind and canonical payload of one value (see the module's table)."""
    if value is None:
        return NULL, None
    if isinstance(value, bool):
        return BOOLEAN, int(value)
    if isinstance(value, int):
        return NUMBER, value
    if isinstance(value, float):
        if value == value and -_LONG_RANGE <= value < _LONG_RANGE and value == int(value):
            return NUMBER, int(value)
        bits = _CANONICAL_NAN if value != value else struct.unpack("<q", struct.pack("<d", value))[0]
        return FLOAT, bits
    if isinstance(value, Decimal):
        return DECIMAL, decimal_text(value).encode()
    if isinstance(value, str):
        return BYTES, value.encode()
    if isinstance(value, bytes | bytearray | memoryview):
        return BYTES, bytes(value)
    if isinstance(value, UUID):
        return BYTES, str(value).encode()
    if isinstance(value, datetime):
        aware = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
        return TIMESTAMP, (aware - _EPOCH) // timedelta(microseconds=1)
    if isinstance(value, date):
        return DATE, (value - _EPOCH_DAY).days
    raise TypeError(f"an identity cannot hold a {type(value).__name__} ({value!r})")


def decimal_text(value: Decimal) -> str:
    """A decimal's digits without exponent or trailing zeros (``-0`` and ``0.00`` are ``0``)."""
    if value == 0:
        return "0"
    text = format(value, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text


def _xxh64(data: bytes, seed: int) -> int:
    return xxhash.xxh64_intdigest(data, seed=seed & _MASK)


def _fold(seed: int, kind: int, payload: int | bytes | None) -> int:
    seed = _xxh64(struct.pack("<i", kind), seed)
    if payload is None:
        return seed
    if isinstance(payload, bytes):
        return _xxh64(payload, seed)
    return _xxh64(struct.pack("<q", payload), seed)


def _signed(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


def value_hashes(values: Sequence[Any]) -> tuple[int, int]:
    """``(h1, h2)`` of one identity (its parts' values in order), as signed longs."""
    h1, h2 = SEED, _SECOND_SEED
    for value in values:
        kind, payload = canonical_part(value)
        h1, h2 = _fold(h1, kind, payload), _fold(h2, kind, payload)
    return _signed(h1), _signed(h2)


_SECOND_SEED = _xxh64(SECOND_SEED_TEXT.encode(), SEED)


# --- Arrow columns (vectorised) ----------------------------------------------------------------


def _u64(x: int) -> np.uint64:
    return np.uint64(x & _MASK)


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


def _fmix(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint64(33))
    h = h * _u64(_P2)
    h = h ^ (h >> np.uint64(29))
    h = h * _u64(_P3)
    return h ^ (h >> np.uint64(32))


def _hash_int(i: np.ndarray, seed: np.ndarray) -> np.ndarray:
    """XXH64 of a 4-byte little-endian int (Spark's ``hashInt``)."""
    with np.errstate(over="ignore"):
        h = seed + _u64(_P5 + 4)
        h = h ^ ((i.astype(np.int64).astype(np.uint64) & np.uint64(0xFFFFFFFF)) * _u64(_P1))
        h = _rotl(h, 23) * _u64(_P2) + _u64(_P3)
        return _fmix(h)


def _hash_long(v: np.ndarray, seed: np.ndarray) -> np.ndarray:
    """XXH64 of an 8-byte little-endian long (Spark's ``hashLong``)."""
    with np.errstate(over="ignore"):
        h = seed + _u64(_P5 + 8)
        k = _rotl(v.astype(np.int64).view(np.uint64) * _u64(_P2), 31) * _u64(_P1)
        h = h ^ k
        h = _rotl(h, 27) * _u64(_P1) + _u64(_P4)
        return _fmix(h)


def _fold_arrays(
    seed: np.ndarray, kind: np.ndarray, longs: np.ndarray | None, data: pa.Array | None
) -> np.ndarray:
    """Each row's seed folded with its part: the kind, then its payload (a long where ``kind`` is
    neither null nor bytes, else the row's bytes of ``data``, a binary array, if any)."""
    seed = _hash_int(kind, seed)
    if longs is not None:
        has = (kind != NULL) & (kind != BYTES) & (kind != DECIMAL)
        seed = np.where(has, _hash_long(longs, seed), seed)
    if data is not None:
        seed = _fold_bytes(seed, data)
    return seed


def _fold_bytes(seed: np.ndarray, data: pa.Array) -> np.ndarray:
    """XXH64 of each row's bytes under its seed (a null row keeps its seed). No vectorised XXH64 of
    variable-length bytes exists here: one call a row, in a list comprehension (5x a loop that
    indexes arrays), or one a distinct value where every row has the same seed (an identity's first
    part)."""
    digest = xxhash.xxh64_intdigest
    if len(seed) and seed.min() == seed.max():
        first = int(seed[0])
        encoded = pc.dictionary_encode(data)
        hashed = np.array([digest(v, first) for v in encoded.dictionary.to_pylist()], dtype=np.uint64)
        at = pc.fill_null(encoded.indices, 0).to_numpy(zero_copy_only=False)
        out = hashed[at] if len(hashed) else np.full(len(seed), first, dtype=np.uint64)
        return np.where(pc.is_null(data).to_numpy(zero_copy_only=False), np.uint64(first), out)
    rows = data.to_pylist()
    folded = [s if p is None else digest(p, s) for p, s in zip(rows, seed.tolist(), strict=True)]
    return np.array(folded, dtype=np.uint64)


def arrow_parts(column: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray | None, pa.Array | None]:
    """A column's kinds per row, with its long payloads or its bytes payloads (see the module)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    t = column.type
    if pa.types.is_dictionary(t):
        column, t = column.dictionary_decode(), t.value_type
    null = pc.is_null(column).to_numpy(zero_copy_only=False)
    n = len(column)

    def kinds(k: int) -> np.ndarray:
        return np.where(null, NULL, k).astype(np.int32)

    def longs(c: pa.Array) -> np.ndarray:
        return pc.fill_null(c, 0).to_numpy(zero_copy_only=False).astype(np.int64)

    if pa.types.is_boolean(t):
        return kinds(BOOLEAN), longs(pc.cast(column, pa.int64())), None
    if pa.types.is_integer(t):
        return kinds(NUMBER), longs(pc.cast(column, pa.int64())), None
    if pa.types.is_floating(t):
        d = pc.fill_null(pc.cast(column, pa.float64()), 0.0).to_numpy(zero_copy_only=False)
        with np.errstate(invalid="ignore"):
            whole = (d == np.floor(d)) & (d >= -_LONG_RANGE) & (d < _LONG_RANGE)
        bits = np.where(np.isnan(d), np.int64(_CANONICAL_NAN), d.view(np.int64))
        as_long = np.where(whole, d, 0.0).astype(np.int64)
        kind = np.where(null, NULL, np.where(whole, NUMBER, FLOAT)).astype(np.int32)
        return kind, np.where(whole, as_long, bits), None
    if pa.types.is_timestamp(t):
        micros = pc.cast(pc.cast(column, pa.timestamp("us", tz=t.tz)), pa.int64())
        return kinds(TIMESTAMP), longs(micros), None
    if pa.types.is_date(t):
        days = pc.cast(pc.cast(column, pa.date32()), pa.int32())
        return kinds(DATE), longs(pc.cast(days, pa.int64())), None
    if pa.types.is_decimal(t):
        texts = [None if v is None else decimal_text(v).encode() for v in column.to_pylist()]
        return kinds(DECIMAL), None, pa.array(texts, pa.binary())
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t):
        return kinds(BYTES), None, pc.cast(column, pa.binary())
    if pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return kinds(BYTES), None, pa.array(column.to_pylist(), pa.binary())
    if t == pa.null():
        return np.zeros(n, dtype=np.int32), None, None
    raise TypeError(f"an identity cannot hold a column of type {t}")


def arrow_hashes(table: pa.Table | pa.RecordBatch, columns: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """``(h1, h2)`` of each row's identity (the values of ``columns``), as signed 64-bit arrays."""
    n = table.num_rows
    h1 = np.full(n, SEED, dtype=np.uint64)
    h2 = np.full(n, _SECOND_SEED, dtype=np.uint64)
    for name in columns:
        kind, longs, data = arrow_parts(table.column(name))
        h1 = _fold_arrays(h1, kind, longs, data)
        h2 = _fold_arrays(h2, kind, longs, data)
    return h1.view(np.int64), h2.view(np.int64)


# --- Spark columns ---------------------------------------------------------------------------


def spark_parts(col: Column, t: DataType) -> list[Column]:
    """The Spark columns ``xxhash64`` folds for one part (``col``, of type ``t``): its kind, then its
    payload(s) (a payload that does not apply to a row is null there, which ``xxhash64`` skips)."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    def kind(k: int) -> Column:
        return F.when(col.isNull(), F.lit(NULL)).otherwise(F.lit(k)).cast("int")

    if isinstance(t, T.BooleanType):
        return [kind(BOOLEAN), col.cast("long")]
    if isinstance(t, T.IntegralType):
        return [kind(NUMBER), col.cast("long")]
    if isinstance(t, T.FloatType | T.DoubleType):
        d = col.cast("double")
        whole = (d == F.floor(d)) & (d >= F.lit(-_LONG_RANGE)) & (d < F.lit(_LONG_RANGE))
        k = F.when(col.isNull(), F.lit(NULL)).when(whole, F.lit(NUMBER)).otherwise(F.lit(FLOAT)).cast("int")
        # Spark hashes a double as the long of its bits (every NaN as one NaN), as the others do.
        return [k, F.when(whole, d.cast("long")), F.when(~whole, d)]
    if isinstance(t, T.TimestampType | T.TimestampNTZType):
        return [kind(TIMESTAMP), F.unix_micros(col.cast("timestamp"))]
    if isinstance(t, T.DateType):
        return [kind(DATE), F.unix_date(col).cast("long")]
    if isinstance(t, T.DecimalType):
        text = F.regexp_replace(F.regexp_replace(col.cast("string"), r"(\.\d*?)0+$", "$1"), r"\.$", "")
        text = F.when(col == 0, F.lit("0")).otherwise(text)
        return [kind(DECIMAL), text.cast("binary")]
    if isinstance(t, T.StringType | T.BinaryType):
        return [kind(BYTES), col.cast("binary")]
    raise TypeError(f"an identity cannot hold a column of type {t.simpleString()}")


def spark_value_hash(col: Column, t: DataType) -> Column:
    """The first identity hash of one value (null for a null): what a ``distinct`` sketch counts, so
    two values are one exactly when they are one identity (int 5 and double 5.0, text and its bytes)."""
    from pyspark.sql import functions as F

    return F.when(col.isNotNull(), F.xxhash64(*spark_parts(col, t)))


def spark_hashes(df: DataFrame, columns: Sequence[str]) -> tuple[Column, Column]:
    """``(h1, h2)`` of each row's identity, as Spark long columns."""
    from pyspark.sql import functions as F

    parts = [p for name in columns for p in spark_parts(F.col(name), df.schema[name].dataType)]
    return F.xxhash64(*parts), F.xxhash64(F.lit(SECOND_SEED_TEXT), *parts)
