"""Edge validation: a record's shape against the Avro schema, then the pipeline's rules.

Both are compiled once per pipeline into plain closures: fastavro's writer alone is lax (it writes 1.5
into a ``long`` and lets an int overflow), and its ``validate`` is too slow to run per record at the
ingest rates we target. The first failing check wins and names the field, rule and value.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from fastavro.validation import validate as fastavro_validate

from lambdalake.columnar.unions import branch_name, union_value
from lambdalake.edge_rules import BoundOp, passes, rule_name
from lambdalake.event_schema import decimal_of, general_union_fields, largest_decimal
from lambdalake.pipeline import (
    AllowedRule,
    NotFutureRule,
    Pipeline,
    RangeRule,
    RequiredRule,
    Rule,
)

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)


@dataclass(frozen=True)
class Rejection:
    """Why a record was refused: ``rule`` is machine-readable (``schema``, ``price_cents.range``...)."""

    rule: str
    reason: str


#: A check gets the record and the reference time in seconds ("now" for ``not_future``).
Check = Callable[[Mapping[str, Any], float], Rejection | None]


def checked_rules(pipeline: Pipeline) -> list[Rule]:
    """The rules records are checked against, in order: the pipeline's own. (Its views imply none:
    a ``latest`` view ranks any 64-bit version, :mod:`lambdalake.latest`.)"""
    return list(pipeline.rules)


def _int_test(bounds: tuple[int, int]) -> Callable[[Any], bool]:
    lo, hi = bounds

    def test(v: Any) -> bool:
        # `type(v) is int` first: the common case at a fraction of isinstance's cost, per field
        # and record.
        if type(v) is int:
            return lo <= v <= hi
        return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi

    return test


def _number(v: Any) -> bool:
    t = type(v)
    return t is float or t is int or (isinstance(v, int | float) and not isinstance(v, bool))


def _type_test(avro_type: Any, named: dict[str, Any]) -> Callable[[Any], bool] | None:
    """A fast membership test for an Avro type, or None where only fastavro can tell."""
    if isinstance(avro_type, str) and avro_type in named:
        avro_type = named[avro_type]
    if isinstance(avro_type, list):
        branches = [_type_test(t, named) for t in avro_type]
        if any(b is None for b in branches):
            return None
        if len(avro_type) == 2 and "null" in avro_type:  # the common optional field: one test, no loop
            other = branches[1 - avro_type.index("null")]
            return lambda v: v is None or other(v)  # type: ignore[misc]
        # fastavro's tuple notation names the branch: (type or named type's name, value).
        names = [branch_name(named.get(t, t)).rsplit(".", 1)[-1] for t in avro_type]

        def union(v: Any) -> bool:
            if type(v) is tuple and len(v) == 2 and isinstance(v[0], str):
                wanted = v[0].rsplit(".", 1)[-1]
                return any(n == wanted and b(v[1]) for n, b in zip(names, branches, strict=True))  # type: ignore[misc]
            return any(b(v) for b in branches)  # type: ignore[misc]

        return union
    if isinstance(avro_type, dict):
        kind = avro_type["type"]
        if kind == "enum":
            symbols = frozenset(avro_type["symbols"])
            return lambda v: isinstance(v, str) and v in symbols
        decimal = decimal_of(avro_type)
        if decimal is not None:
            return _decimal_test(decimal.precision, decimal.scale)
        if kind in ("long", "int") and avro_type.get("logicalType", "").startswith("timestamp"):
            long_test = _int_test(INT64)
            return lambda v: isinstance(v, datetime) or long_test(v)
        if isinstance(kind, str) and kind not in ("record", "array", "map", "fixed"):
            return _type_test(kind, named)
        return None
    return {
        "null": lambda v: v is None,
        "boolean": lambda v: isinstance(v, bool),
        "int": _int_test(INT32),
        "long": _int_test(INT64),
        "float": _number,
        "double": _number,
        "string": lambda v: isinstance(v, str),
        "bytes": lambda v: isinstance(v, bytes),
    }.get(avro_type)


def _decimal_test(precision: int, scale: int) -> Callable[[Any], bool]:
    """A ``Decimal`` of at most ``scale`` places and ``precision`` digits at that scale (fastavro
    checks the digits as given, so it writes 12345678.9 into a decimal(9, 2) as ten digits), or
    bytes (written as they are, as fastavro does)."""
    largest = largest_decimal(precision, scale)

    def test(v: Any) -> bool:
        if isinstance(v, bytes):
            return True
        if not isinstance(v, Decimal) or not v.is_finite():
            return False
        # Comparisons are exact (only arithmetic rounds to the context's digits).
        return v.as_tuple().exponent >= -scale and -largest <= v <= largest  # type: ignore[operator]

    return test


def _num(bound: float | None, unbounded: str) -> str:
    if bound is None:
        return unbounded
    return str(int(bound)) if float(bound).is_integer() else str(bound)


def _describe(avro_type: Any) -> str:
    decimal = decimal_of(avro_type)
    if decimal is not None:
        return f"a decimal of at most {decimal.precision} digits, {decimal.scale} after the point"
    if isinstance(avro_type, dict):
        return avro_type.get("logicalType") or (
            f"one of {avro_type['symbols']}" if avro_type["type"] == "enum" else str(avro_type["type"])
        )
    if isinstance(avro_type, list):
        return " or ".join(_describe(t) for t in avro_type)
    return str(avro_type)


def compile_schema_check(schema: dict[str, Any], parsed_schema: Any) -> Check:
    """Check that a record has every field of ``schema`` with a value of the right Avro type."""
    named = {}
    for f in schema["fields"]:
        t = f["type"]
        if isinstance(t, dict) and "name" in t:
            named[t["name"]] = t
    fields = []
    for f in schema["fields"]:
        fields.append((f["name"], "default" in f, _type_test(f["type"], named), _describe(f["type"])))
    needs_fastavro = any(test is None for _, _, test, _ in fields)
    known = frozenset(f["name"] for f in schema["fields"])

    def check(record: Mapping[str, Any], _now: float) -> Rejection | None:
        if not known.issuperset(record):
            unknown = sorted(str(k) for k in record if k not in known)
            if unknown:
                return Rejection(
                    "unknown_field",
                    f"field(s) {unknown} are not in the schema (known: {sorted(known)}); a misspelt "
                    "optional field would otherwise be stored as null",
                )
        for name, has_default, test, expected in fields:
            if name not in record:
                if has_default:
                    continue
                return Rejection("schema", f"field {name!r} is missing (expected {expected})")
            if test is not None and not test(record[name]):
                return Rejection("schema", f"field {name!r} is {record[name]!r}, expected {expected}")
        if needs_fastavro:
            try:
                fastavro_validate(record, parsed_schema, raise_errors=True)
            except Exception as exc:  # fastavro's ValidationError carries the list of problems
                return Rejection("schema", str(exc).replace("\n", " "))
        return None

    return check


class _Source:
    """A per-record test as Python source over the field's value ``v`` and the reference time
    ``now``: a rule's tree compiles to one function, as fast as one written by hand (composing
    closures cost twice the time per record)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __and__(self, other: _Source) -> _Source:
        return _Source(f"({self.text} and {other.text})")

    def __or__(self, other: _Source) -> _Source:
        return _Source(f"({self.text} or {other.text})")

    def __invert__(self) -> _Source:
        return _Source(f"(not {self.text})")


def _finite(v: Any) -> bool:
    """Not an infinite or NaN number (what is not a number at all, the comparisons judge)."""
    if isinstance(v, float):
        return v - v == 0  # NaN for infinities and NaN
    if isinstance(v, Decimal):
        return v.is_finite()
    return True


def _epoch_ms(v: Any) -> Any:
    """A time as epoch milliseconds (decoders hand timestamps over as millis already)."""
    return v.timestamp() * 1000 if isinstance(v, datetime) else v


def _not_after(v: Any, now: float, skew_s: float) -> bool:
    ms = _epoch_ms(v)
    return not (isinstance(ms, int | float) and ms > (now + skew_s) * 1000)


class _PerRecord:
    """The rules' primitives on one record's value (:class:`lambdalake.edge_rules.Engine`), as source
    text; what is not text (bounds, value sets, the field's name) is a name in :attr:`names`, so no
    configured value is ever read as code."""

    def __init__(self) -> None:
        self.names: dict[str, Any] = {"_finite": _finite, "_not_after": _not_after}

    def _name(self, value: Any) -> str:
        name = f"_c{len(self.names)}"
        self.names[name] = value
        return name

    def check(self, field: str, test: _Source, refuse: Callable[[Any], Rejection]) -> Check:
        """A check of ``(record, now)``: None where ``test`` holds, else ``refuse`` of the value. One
        function per rule, a call per record and rule."""
        value, refusal = self._name(field), self._name(refuse)
        body = f"    v = r.get({value})\n    return None if {test.text} else {refusal}(v)\n"
        # The names as default arguments: local variables, the fastest lookup per record.
        defaults = "".join(f", {n}={n}" for n in self.names)
        source = f"def check(r, now{defaults}):\n{body}"
        exec(compile(source, "<edge rule>", "exec"), self.names)
        return self.names.pop("check")

    def is_null(self, field: str) -> _Source:
        return _Source("v is None")

    def blank(self, field: str) -> _Source:
        return _Source("(isinstance(v, str) and not v.strip())")

    def finite(self, field: str) -> _Source:
        # The common cases at a fraction of a call's cost, per record (v - v is NaN for infinities
        # and NaN).
        return _Source("(v - v == 0 if type(v) is float else type(v) is int or _finite(v))")

    def compare(self, field: str, op: BoundOp, bound: float) -> _Source:
        return _Source(f"v {op} {self._name(bound)}")

    def one_of(self, field: str, values: Sequence[str | int]) -> _Source:
        return _Source(f"v in {self._name(frozenset(values))}")

    def not_after_now(self, field: str, skew_s: float) -> _Source:
        return _Source(f"_not_after(v, now, {self._name(skew_s)})")


def _reason(rule: Rule, v: Any) -> str:
    """Why ``v`` breaks ``rule``, for the dead letter."""
    field = rule.field
    match rule:
        case RequiredRule():
            return f"{field} is required but is {v!r}"
        case RangeRule(min=lo, max=hi, max_inclusive=incl):
            if not _finite(v):
                return f"{field}={v} is not a finite number"
            bound = f"[{_num(lo, '-inf')}, {_num(hi, 'inf')}{']' if incl else ')'}"
            return f"{field}={v} is outside {bound}"
        case AllowedRule(values=values):
            return f"{field}={v!r} is not one of {sorted(map(str, frozenset(values)))}"
        case NotFutureRule(max_skew_s=skew):
            shown = v if isinstance(v, datetime) else f"{v} ms ({_utc(v)})"
            return f"{field}={shown} is more than {skew:g}s in the future"
    raise TypeError(f"unknown rule {rule!r}")


def compile_rule(rule: Rule) -> Check:
    """``rule`` as a check of one record (:func:`lambdalake.edge_rules.passes` on its values)."""
    engine = _PerRecord()
    name = rule_name(rule)
    return engine.check(rule.field, passes(rule, engine), lambda v: Rejection(name, _reason(rule, v)))


def _utc(ms: float) -> str:
    """Epoch milliseconds as an ISO time, for messages (decoders hand timestamps over as millis)."""
    try:
        return datetime.fromtimestamp(ms / 1000, UTC).isoformat()
    except (OverflowError, OSError, ValueError):
        return "beyond the years 1-9999"


def _on_union_value(rule: Rule, unions: frozenset[str]) -> Check:
    """``rule``'s check; on a general union's field, of the value whatever form it comes in
    (fastavro's tuple notation from producers, the struct of members from decoded rows)."""
    check = compile_rule(rule)
    if rule.field not in unions:
        return check
    field = rule.field
    return lambda r, now: check({**r, field: union_value(r.get(field))}, now)


class RecordValidator:
    """Validates records: Avro shape first (unless already decoded), then the pipeline's rules.

    Args:
        rules: The pipeline's rules (``Pipeline.rules``), checked in file order.
        schema: The writer schema (JSON) records are checked against.
        parsed_schema: The same schema parsed by fastavro, for nested types.
        check_shape: Check Avro types. Default True; False for records that were decoded from Avro
            (their shape is right by construction).
        now: Clock in seconds for ``not_future`` rules when :meth:`check` gets no time. Default
            ``time.time``.
    """

    def __init__(
        self,
        rules: Sequence[Rule],
        *,
        schema: dict[str, Any],
        parsed_schema: Any,
        check_shape: bool = True,
        now: Callable[[], float] = time.time,
    ) -> None:
        # A missing key is reported as such, not as a generic schema error; value rules run only on
        # values of the right type.
        required = [r for r in rules if isinstance(r, RequiredRule)]
        others = [r for r in rules if not isinstance(r, RequiredRule)]
        shape = [compile_schema_check(schema, parsed_schema)] if check_shape else []
        unions = general_union_fields(schema)
        ruled = [_on_union_value(r, unions) for r in [*required, *others]]
        self._checks = [*ruled[: len(required)], *shape, *ruled[len(required) :]]
        self._now = now

    def check(self, record: Mapping[str, Any], *, now: float | None = None) -> Rejection | None:
        """The first rule the record breaks, or None.

        Args:
            record: The record.
            now: Reference time in seconds for ``not_future`` (the speed layer passes the Kafka
                record timestamp, so a replay judges a record as its first reading did).
        """
        if type(record) is not dict and not isinstance(record, Mapping):  # the ABC check is slow
            return Rejection("schema", f"expected a JSON object, got {type(record).__name__}")
        at = self._now() if now is None else now
        for check in self._checks:
            rejection = check(record, at)
            if rejection is not None:
                return rejection
        return None
