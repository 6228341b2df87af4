"""A view's ``where`` (:mod:`lambdalake.filters`) as a Spark column: the speed job, the batch and
``replay`` filter with the same tree the reference evaluates."""

from __future__ import annotations

from decimal import Decimal

from pyspark.sql import Column
from pyspark.sql import functions as F

from lambdalake.filters import Node, decimal_digits, lower


def _literal(value: object) -> Column:
    if isinstance(value, bytes):
        return F.lit(bytearray(value))
    if isinstance(value, Decimal):
        # Its own digits: Spark widens both sides to a common decimal, so the comparison is exact.
        precision, scale = decimal_digits(value)
        return F.lit(str(value)).cast(f"decimal({precision},{scale})")
    return F.lit(value)


def column(node: Node) -> Column:
    """The filter as a boolean column (null where SQL's logic says unknown: ``filter`` drops it)."""
    return lower(
        node, field=F.col, literal=lambda _name, value: _literal(value), is_null=Column.isNull, is_nan=F.isnan
    )
