"""The edge's rules (:mod:`lambdalake.edge_rules`) as one Spark column over decoded events: whether a
record passes every rule, for the Real-time path of the ``latest`` views (:mod:`lambdalake.spark.realtime`),
which may only use Spark's own expressions.

The rules are built once, in :mod:`lambdalake.edge_rules`; this module gives their primitives in
Spark's terms, each with the per-record verdict on the values the speed job's decode hands them
(``tests/test_spark_rules.py`` checks the two on drawn records). Comparisons are exact: an integer
field is compared with its bounds rounded inward to integers (never as a double), a decimal with the
bound's own digits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BooleanType,
    DataType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    StringType,
    TimestampType,
)

from lambdalake.columnar.validate import SPACES
from lambdalake.edge_rules import BoundOp, passes
from lambdalake.errors import ConfigurationError
from lambdalake.event_schema import general_union_fields
from lambdalake.filters import decimal_digits
from lambdalake.pipeline import Pipeline, Rule
from lambdalake.spark.decode import millis_fields
from lambdalake.validation import checked_rules

#: A string ``str.strip`` leaves empty: only the characters it removes, from start to end.
_BLANK = "\\A[" + "".join(f"\\x{{{ord(c):x}}}" for c in SPACES) + "]*\\z"
_INTEGERS = IntegerType | LongType
_LONG = (-(1 << 63), (1 << 63) - 1)


def valid(pipeline: Pipeline, events: DataFrame, *, now: Column) -> Column:
    """True where a decoded event passes every rule of ``pipeline`` (``now``: the Kafka record's
    timestamp, the time a ``not_future`` rule judges by, as the speed job's decode takes it).

    Raises:
        ConfigurationError: A rule this lowering does not write (a general union's field, or a type
            the rule's kind does not fit), naming it and the fix.
    """
    unions = general_union_fields(pipeline.reader_schema)
    engine = _Columns(events, now=now, millis=set(millis_fields(pipeline.reader_schema)))
    ok = F.lit(True)
    for rule in checked_rules(pipeline):
        if rule.field in unions:
            raise _unsupported(pipeline, rule, "its field is a general union")
        try:
            verdict = passes(rule, engine)
        except _NoForm as exc:
            raise _unsupported(pipeline, rule, str(exc)) from None
        # SQL's unknown is a refusal.
        ok = ok & F.coalesce(verdict, F.lit(False))
    return ok


def _unsupported(pipeline: Pipeline, rule: Rule, why: str) -> ConfigurationError:
    return ConfigurationError(
        f"rule {rule.field}.{rule.kind} of pipeline {pipeline.name!r} has no Real-time form: {why}",
        fix='set speed.latest = "microbatch" (LAMBDALAKE_SPEED__LATEST=microbatch)',
    )


class _NoForm(Exception):
    """A primitive has no Spark form for the field's type (the message says which)."""


class _Columns:
    """The rules' primitives as Spark columns (:class:`lambdalake.edge_rules.Engine`), each giving the
    per-record verdict on the values the speed job's decode hands the rules."""

    def __init__(self, events: DataFrame, *, now: Column, millis: set[str]) -> None:
        self._schema = events.schema
        self._now = now
        self._millis = millis

    def _field(self, field: str) -> tuple[Column, DataType]:
        if field in self._millis:
            # As the decode floors a timestamp-millis field to epoch milliseconds for the rules.
            return F.floor(F.unix_micros(F.col(field)) / 1000).cast("long"), LongType()
        return F.col(field), self._schema[field].dataType

    def is_null(self, field: str) -> Column:
        return self._field(field)[0].isNull()

    def blank(self, field: str) -> Column:
        col, kind = self._field(field)
        return col.rlike(_BLANK) if isinstance(kind, StringType) else F.lit(False)

    def finite(self, field: str) -> Column:
        col, kind = self._field(field)
        if isinstance(kind, FloatType | DoubleType):
            return ~F.isnan(col) & (F.abs(col) != F.lit(math.inf))
        if isinstance(kind, _INTEGERS | DecimalType):
            return F.lit(True)
        raise _NoForm(f"a range over {kind.simpleString()}")

    def compare(self, field: str, op: BoundOp, bound: float) -> Column:
        col, kind = self._field(field)
        if isinstance(kind, _INTEGERS):
            return _integer_bound(col, op, bound)
        if isinstance(kind, FloatType | DoubleType):
            literal = F.lit(float(bound))
        elif isinstance(kind, DecimalType):
            literal = _as_decimal(bound)
        else:
            raise _NoForm(f"a range over {kind.simpleString()}")
        return {">=": col >= literal, "<=": col <= literal, "<": col < literal}[op]

    def one_of(self, field: str, values: Sequence[str | int]) -> Column:
        col, kind = self._field(field)
        if isinstance(kind, StringType):
            allowed: list[Any] = [v for v in values if isinstance(v, str)]
        elif isinstance(kind, _INTEGERS | DecimalType | BooleanType):
            allowed = [v for v in values if isinstance(v, int)]
            if isinstance(kind, BooleanType):
                # Python's True == 1 and False == 0.
                allowed = [v == 1 for v in allowed if v in (0, 1)]
        else:
            raise _NoForm(f"allowed values of a {kind.simpleString()}")
        return col.isin(allowed) if allowed else F.lit(False)

    def not_after_now(self, field: str, skew_s: float) -> Column:
        col, kind = self._field(field)
        limit = (F.unix_micros(self._now) / 1e6 + F.lit(float(skew_s))) * 1000.0
        if isinstance(kind, TimestampType):
            ms = F.unix_micros(col) / 1e6 * 1000.0
        elif isinstance(kind, FloatType | DoubleType):
            ms = col.cast("double")
        elif isinstance(kind, _INTEGERS):
            # An integer against a double, exactly: above the limit iff above its floor.
            return col <= F.floor(limit).cast("long")
        else:
            return F.lit(True)  # neither a time nor a number: the rule lets it pass
        # Python's NaN is above no limit; Spark's NaN is above every number.
        return F.isnan(ms) | (ms <= limit)


def _integer_bound(col: Column, op: BoundOp, bound: float) -> Column:
    """``col op bound`` for an integer column, exactly: the bound rounded inward to an integer (never
    compared as a double), and a bound beyond a long's range decided outright."""
    if op == ">=":
        least = math.ceil(bound)
        if least > _LONG[1]:
            return F.lit(False)
        return col >= F.lit(least) if least > _LONG[0] else F.lit(True)
    most = math.floor(bound) if op == "<=" or bound != math.floor(bound) else int(bound) - 1
    if most < _LONG[0]:
        return F.lit(False)
    return col <= F.lit(most) if most < _LONG[1] else F.lit(True)


def _as_decimal(bound: float | None) -> Column | None:
    """A bound as a decimal of its exact binary value (as Python compares a ``Decimal`` with a float)."""
    if bound is None:
        return None
    exact = Decimal(bound)
    precision, scale = decimal_digits(exact)
    if precision > 38:
        raise ConfigurationError(
            f"the range bound {bound!r} has {precision} decimal digits, more than a Spark decimal holds",
            fix='give the bound with fewer digits, or set speed.latest = "microbatch"',
        )
    return F.lit(str(exact)).cast(f"decimal({precision},{scale})")
