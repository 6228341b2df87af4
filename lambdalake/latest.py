"""The latest rule: which delivery of a key a ``latest`` view answers, defined once.

Deliveries of a key are ordered, the winner first, by

1. the **version**: the view's version field as a long, a timestamp as epoch microseconds; a null
   version ranks below every long (:data:`NULL_VERSION`), so a key whose versions are all null still
   has a row and any delivery with a version outranks it;
2. the **ingest tiebreak**: the earlier ingest second (:func:`latest_tiebreak`, exact for deliveries
   less than 2^20 s, about 12 days, apart);
3. the lower **Kafka partition**, then 4. the lower **offset**: the first copy.

(1) and (2) together are the **rank**, ``version * 2^20 + tiebreak``: an exact integer of up to 84
bits, so any 64-bit version ranks without overflow. Each engine holds it in a type that takes it
whole: a Python ``int``, Spark ``decimal(38,0)``, Arrow ``decimal128(38,0)``, Cassandra ``varint``.

The adapters here are the only places the rule is written: :func:`rank` and :func:`winner_key` (Python,
serving), :func:`spark_order` and :func:`spark_rank` (Spark's ``latest`` and the batch's rank column),
:func:`spark_merge_order` (the incremental merge), :func:`arrow_winners` (the speed layer's tasks) and
:data:`CANDIDATE` with :data:`CANDIDATE_ORDER` (the Cassandra clustering that keeps a key's candidates
in the rule's order, so the first row is the winner whatever order they were written in). A property
test draws deliveries and checks every adapter, and the Cassandra table, against the others.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

#: Low bits of a rank that order deliveries of one version (2^20 s: about 12 days).
TIEBREAK_BITS = 20
#: The version a delivery without one ranks with: below every long.
NULL_VERSION = -(1 << 63) - 1

#: The column holding a row's rank (speed candidates and batch rows).
RANK = "_latest_rank"
#: The rank's type in each engine.
RANK_CQL = "varint"
RANK_SPARK = "decimal(38,0)"
RANK_ARROW = pa.decimal128(38, 0)
#: Kafka coordinates that order deliveries of one rank.
PARTITION, OFFSET = "_partition", "_offset"
#: A ``latest`` speed row's clustering columns, and their order: per key the winner first.
CANDIDATE = (RANK, PARTITION, OFFSET)
CANDIDATE_ORDER = {RANK: "DESC", PARTITION: "ASC", OFFSET: "ASC"}

Numeric = TypeVar("Numeric")


def latest_tiebreak(ingest_seconds: Numeric) -> Numeric:
    """The low part of a rank, in ``[0, 2^20)``: higher for the earlier delivery (ingest time as
    non-negative epoch seconds, so ``%`` is the floor modulo in every engine)."""
    span = 1 << TIEBREAK_BITS
    return span - 1 - ingest_seconds % span  # type: ignore[operator]


def latest_rank(version: Numeric, ingest_seconds: Numeric) -> Numeric:
    """``version * 2^20 + tiebreak`` (the caller puts :data:`NULL_VERSION` for a null version).
    Arithmetic operators only: the same formula runs on Python ints and Spark decimal columns."""
    return version * (1 << TIEBREAK_BITS) + latest_tiebreak(ingest_seconds)  # type: ignore[operator]


def rank(version: int | None, ingest_seconds: int) -> int:
    """A delivery's rank as a Python int (``version`` as a long; None for a null version)."""
    return latest_rank(NULL_VERSION if version is None else version, ingest_seconds)


def winner_key(rank: int, partition: int, offset: int) -> tuple[int, int, int]:
    """Sorts deliveries so that the highest key is the winner (rank, then the first copy)."""
    return (rank, -partition, -offset)


# --- Spark ------------------------------------------------------------------------------------


def _spark_version(df: DataFrame, version: str) -> Column:
    """The version as a long (a timestamp as epoch microseconds), null where absent."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import TimestampNTZType, TimestampType

    v = F.col(version)
    if isinstance(df.schema[version].dataType, TimestampType | TimestampNTZType):
        return F.unix_micros(v.cast("timestamp"))
    return v.cast("long")


def _spark_tiebreak(ingest: str) -> Column:
    from pyspark.sql import functions as F

    return latest_tiebreak(F.unix_seconds(F.col(ingest)))


def spark_order(df: DataFrame, version: str, *, ingest: str = "_ingest_ts") -> Column:
    """The rule as a Spark struct whose greatest value is the winner (longs only: the rank's 84
    bits are costly to compute for every delivery)."""
    from pyspark.sql import functions as F

    v = _spark_version(df, version)
    return F.struct(
        v.isNotNull(), F.coalesce(v, F.lit(0)), _spark_tiebreak(ingest), -F.col(PARTITION), -F.col(OFFSET)
    )


def spark_rank(df: DataFrame, version: str, *, ingest: str = "_ingest_ts") -> Column:
    """Each delivery's rank, as ``decimal(38,0)``."""
    from decimal import Decimal

    from pyspark.sql import functions as F

    v = F.coalesce(
        _spark_version(df, version).cast(RANK_SPARK), F.lit(Decimal(NULL_VERSION)).cast(RANK_SPARK)
    )
    tiebreak = _spark_tiebreak(ingest).cast(RANK_SPARK)
    return (v * F.lit(1 << TIEBREAK_BITS).cast(RANK_SPARK) + tiebreak).cast(RANK_SPARK)


def spark_merge_order() -> Column:
    """The rule over rows that carry their rank (the incremental merge of two results)."""
    from pyspark.sql import functions as F

    return F.struct(F.col(RANK).cast(RANK_SPARK), -F.col(PARTITION), -F.col(OFFSET))


# --- Arrow / NumPy ----------------------------------------------------------------------------


def _longs(col: pa.ChunkedArray | pa.Array, *, per: int = 1) -> np.ndarray:
    """Integers (timestamps as microseconds) floor-divided by ``per``, nulls as 0."""
    if pa.types.is_timestamp(col.type):
        col = pc.cast(pc.cast(col, pa.timestamp("us", tz=col.type.tz)), pa.int64())
    ints = pc.fill_null(pc.cast(col, pa.int64(), safe=False), 0).to_numpy()
    return np.floor_divide(ints, per) if per != 1 else ints


def arrow_winners(
    table: pa.Table, keys: Sequence[Hashable], version: str, *, ingest: str = "_ingest_ts"
) -> tuple[list[int], list[int]]:
    """Per key (``keys``: one per row), the row the rule picks and its rank, whatever the rows'
    order; rows without an ingest time take no part.

    Returns:
        The winning rows' indices (ascending) and their ranks (Python ints), in that order.
    """
    v = table.column(version)
    has = pc.is_valid(v).to_numpy(zero_copy_only=False)
    versions = np.where(has, _longs(v), 0)
    seconds = _longs(table.column(ingest), per=1_000_000)
    tiebreaks = latest_tiebreak(seconds)
    partitions, offsets = _longs(table.column(PARTITION)), _longs(table.column(OFFSET))
    timed = pc.is_valid(table.column(ingest)).to_numpy(zero_copy_only=False)
    # Ascending by each key from the last: the winner of a key is its first row in this order.
    # ``~x`` orders longs descending without the overflow of ``-x``.
    order = np.lexsort((offsets, partitions, ~tiebreaks, ~versions, ~has))
    best: dict[Hashable, int] = {}
    for i in order.tolist():
        if timed[i]:
            best.setdefault(keys[i], i)
    rows = sorted(best.values())
    ranks = [rank(int(versions[i]) if has[i] else None, int(seconds[i])) for i in rows]
    return rows, ranks


def rank_array(ranks: Sequence[int]) -> pa.Array:
    """Ranks as an Arrow column of their type."""
    from decimal import Decimal

    return pa.array([Decimal(r) for r in ranks], type=RANK_ARROW)
