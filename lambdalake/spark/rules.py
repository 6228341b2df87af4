"""The edge's rules (:mod:`lambdalake.validation`) as one Spark column over decoded events: whether a
record passes every rule, for the Real-time path of the ``latest`` views (:mod:`lambdalake.spark.realtime`),
which may only use Spark's own expressions.

The per-record checks stay the definition; each rule here is written to give the same verdict on the
values the speed job's decode hands them, and ``tests/test_spark_rules.py`` checks the two on drawn
records. Comparisons are exact: an integer field is compared with its bounds rounded inward to
integers (never as a double), a decimal with the bound's own digits.
"""

from __future__ import annotations

import math
from decimal import Decimal

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BooleanType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    StringType,
    TimestampType,
)

from lambdalake.columnar.validate import SPACES
from lambdalake.errors import ConfigurationError
from lambdalake.event_schema import general_union_fields
from lambdalake.filters import decimal_digits
from lambdalake.pipeline import AllowedRule, NotFutureRule, Pipeline, RangeRule, RequiredRule, Rule
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
    millis = set(millis_fields(pipeline.reader_schema))
    ok = F.lit(True)
    for rule in checked_rules(pipeline):
        if rule.field in unions:
            raise _unsupported(pipeline, rule, "its field is a general union")
        ok = ok & F.coalesce(
            _passes(rule, events, now=now, millis=rule.field in millis, pipeline=pipeline), F.lit(False)
        )
    return ok


def _unsupported(pipeline: Pipeline, rule: Rule, why: str) -> ConfigurationError:
    return ConfigurationError(
        f"rule {rule.field}.{rule.kind} of pipeline {pipeline.name!r} has no Real-time form: {why}",
        fix='set speed.latest = "microbatch" (LAMBDALAKE_SPEED__LATEST=microbatch)',
    )


def _passes(rule: Rule, events: DataFrame, *, now: Column, millis: bool, pipeline: Pipeline) -> Column:
    col = F.col(rule.field)
    kind = events.schema[rule.field].dataType
    if millis:
        # As the decode floors a timestamp-millis field to epoch milliseconds for the rules.
        col, kind = F.floor(F.unix_micros(col) / 1000).cast("long"), LongType()
    match rule:
        case RequiredRule():
            if isinstance(kind, StringType):
                return col.isNotNull() & ~col.rlike(_BLANK)
            return col.isNotNull()
        case RangeRule(min=lo, max=hi, max_inclusive=incl):
            if isinstance(kind, _INTEGERS):
                return col.isNull() | _integer_range(col, lo, hi, incl)
            if isinstance(kind, FloatType | DoubleType):
                finite = ~F.isnan(col) & (F.abs(col) != F.lit(math.inf))
                return col.isNull() | (finite & _bounds(col, _as_float(lo), _as_float(hi), incl))
            if isinstance(kind, DecimalType):
                return col.isNull() | _bounds(col, _as_decimal(lo), _as_decimal(hi), incl)
            raise _unsupported(pipeline, rule, f"a range over {kind.simpleString()}")
        case AllowedRule(values=values):
            if isinstance(kind, StringType):
                allowed = [v for v in values if isinstance(v, str)]
            elif isinstance(kind, _INTEGERS | DecimalType | BooleanType):
                allowed = [v for v in values if isinstance(v, int)]
                if isinstance(kind, BooleanType):
                    # Python's True == 1 and False == 0.
                    allowed = [v == 1 for v in allowed if v in (0, 1)]
            else:
                raise _unsupported(pipeline, rule, f"allowed values of a {kind.simpleString()}")
            return col.isNull() | (col.isin(allowed) if allowed else F.lit(False))
        case NotFutureRule(max_skew_s=skew):
            limit = (F.unix_micros(now) / 1e6 + F.lit(float(skew))) * 1000.0
            if isinstance(kind, TimestampType):
                ms = F.unix_micros(col) / 1e6 * 1000.0
            elif isinstance(kind, _INTEGERS | FloatType | DoubleType):
                ms = col.cast("double") if isinstance(kind, FloatType | DoubleType) else col
            else:
                return F.lit(True)  # neither a time nor a number: the rule lets it pass
            if isinstance(kind, _INTEGERS) or millis:
                # An integer against a double, exactly: above the limit iff above its floor.
                return col.isNull() | (ms <= F.floor(limit).cast("long"))
            # Python's NaN is above no limit; Spark's NaN is above every number.
            return col.isNull() | F.isnan(ms) | (ms <= limit)
    raise TypeError(f"unknown rule {rule!r}")


def _integer_range(col: Column, lo: float | None, hi: float | None, incl: bool) -> Column:
    """``lo <= col <= hi`` (``< hi`` unless ``incl``) for an integer column, exactly."""
    ok = F.lit(True)
    if lo is not None:
        bound = math.ceil(lo)
        if bound > _LONG[1]:
            return F.lit(False)
        if bound > _LONG[0]:
            ok = ok & (col >= F.lit(bound))
    if hi is not None:
        bound = math.floor(hi) if incl or hi != math.floor(hi) else int(hi) - 1
        if bound < _LONG[0]:
            return F.lit(False)
        if bound < _LONG[1]:
            ok = ok & (col <= F.lit(bound))
    return ok


def _bounds(col: Column, lo: Column | None, hi: Column | None, incl: bool) -> Column:
    ok = F.lit(True)
    if lo is not None:
        ok = ok & (col >= lo)
    if hi is not None:
        ok = ok & ((col <= hi) if incl else (col < hi))
    return ok


def _as_float(bound: float | None) -> Column | None:
    return None if bound is None else F.lit(float(bound))


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
