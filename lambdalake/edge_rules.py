"""The edge's rules, each kind written once: what a value must be to pass, over an engine's primitives.

A rule kind (:mod:`lambdalake.pipeline`'s ``required``, ``range``, ``allowed``, ``not_future``) is one
case of :func:`passes`, built from a few primitives on one field. Each engine supplies the
primitives and runs the same tree, as a view's ``where`` does (:func:`lambdalake.filters.lower`):

- per record (:mod:`lambdalake.validation`): the definition of a verdict, and the one engine that
  also says why a record was refused;
- over Arrow columns (:mod:`lambdalake.columnar.validate`): which rows surely pass, so only the
  others are checked one by one. Its primitives err toward "not surely": only ``is_null`` (exact) and
  ``blank`` (erring toward blank) ever appear under ``~``, so the tree keeps that direction;
- as Spark columns (:mod:`lambdalake.spark.rules`): the Real-time path of the ``latest`` views, which
  may use only Spark's expressions; exact, in SQL's three-valued logic (a null verdict is a refusal).

A new rule kind is a case here; it needs a new primitive (one method per engine) only when the
existing ones cannot say it. The cross-engine property tests (``tests/test_validation.py``,
``tests/test_columnar.py``, ``tests/test_spark_rules.py``) draw records and compare the engines.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol, TypeVar

from lambdalake.pipeline import AllowedRule, NotFutureRule, RangeRule, RequiredRule, Rule

#: The comparisons a bound is checked with.
BoundOp = Literal[">=", "<=", "<"]


class Verdict(Protocol):
    """An engine's boolean: Python predicates, numpy masks and Spark columns all combine this way."""

    def __and__(self: V, other: V, /) -> V: ...
    def __or__(self: V, other: V, /) -> V: ...
    def __invert__(self: V) -> V: ...


V = TypeVar("V", bound=Verdict)


class Engine(Protocol[V]):
    """The primitives a rule is built from, each on one field of the record."""

    def is_null(self, field: str) -> V:
        """The field is missing or null (exact)."""
        ...

    def blank(self, field: str) -> V:
        """The field is a string that ``str.strip`` leaves empty (never for another type)."""
        ...

    def finite(self, field: str) -> V:
        """The field is a number that is neither infinite nor NaN (false for anything else)."""
        ...

    def compare(self, field: str, op: BoundOp, bound: float) -> V:
        """The field's number against ``bound``, compared exactly (as Python compares them)."""
        ...

    def one_of(self, field: str, values: Sequence[str | int]) -> V:
        """The field's value equals one of ``values`` (as Python's ``==``: ``True == 1``)."""
        ...

    def not_after_now(self, field: str, skew_s: float) -> V:
        """The field's time (a timestamp, or a number of epoch milliseconds) is at most ``skew_s``
        after the record's reference time; a value that is neither passes."""
        ...


def passes(rule: Rule, engine: Engine[V]) -> V:
    """Whether a record passes ``rule``, in ``engine``'s terms."""
    f = rule.field
    match rule:
        case RequiredRule():
            return ~engine.is_null(f) & ~engine.blank(f)
        case RangeRule(min=lo, max=hi, max_inclusive=inclusive):
            inside = engine.finite(f)
            if lo is not None:
                inside = inside & engine.compare(f, ">=", lo)
            if hi is not None:
                inside = inside & engine.compare(f, "<=" if inclusive else "<", hi)
            return engine.is_null(f) | inside
        case AllowedRule(values=values):
            return engine.is_null(f) | engine.one_of(f, values)
        case NotFutureRule(max_skew_s=skew):
            return engine.is_null(f) | engine.not_after_now(f, skew)
    raise TypeError(f"unknown rule {rule!r}")


def rule_name(rule: Rule) -> str:
    """The rule as a dead letter names it (``price_cents.range``)."""
    return f"{rule.field}.{rule.kind}"
