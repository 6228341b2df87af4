"""A view's ``where``: a small expression language over the event's fields, parsed once and run by
every engine from the same tree.

The language::

    status = 'active' and price_cents >= 1000
    status in ('failed', 'refused') or not (amount < 10.50)
    promo_code is not null and updated_at < '2026-01-01T00:00:00Z'

- A comparison is a field, an operator (``=``, ``!=``, ``<>``, ``<``, ``<=``, ``>``, ``>=``) and a
  literal; ``field [not] in (literal, ...)``; ``field is [not] null``; ``and``, ``or``, ``not`` and
  parentheses (``not`` binds tightest, then ``and``, then ``or``). Keywords are case-insensitive; a
  field whose name is a keyword is written in backquotes.
- A literal is written as the field's type reads it: numbers for numeric fields (whole numbers for
  integer ones; decimals exactly as written, ``19.99``), ``'text'`` for strings and enums (an enum
  literal must be one of its symbols), ``true``/``false`` for booleans, ``'2026-01-01T00:00:00Z'``
  for timestamps (no offset: UTC) and ``'2026-01-01'`` for dates, ``'text'`` for bytes (its UTF-8).
- Nulls follow SQL: a comparison with a null field is unknown, ``not`` of unknown is unknown, and a
  view keeps the events whose filter is true.

:func:`parse` checks a filter against the event schema and names the position and the field of any
mistake; :func:`evaluate` runs it on a Python row (the reference tests, Python callers);
``lambdalake.spark.filters`` runs it on Spark columns (the speed job, the batch, ``replay``) and
:func:`arrow_expression` on Arrow tables (the speed job's ``latest`` pass).
"""

from __future__ import annotations

import math
import operator
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import Decimal, InvalidOperation
from functools import reduce
from typing import Any, Literal

import pyarrow as pa

Op = Literal["=", "!=", "<", "<=", ">", ">="]


@dataclass(frozen=True)
class Compare:
    field: str
    op: Op
    value: Any


@dataclass(frozen=True)
class In:
    field: str
    values: tuple[Any, ...]
    negated: bool = False


@dataclass(frozen=True)
class IsNull:
    field: str
    negated: bool = False


@dataclass(frozen=True)
class Not:
    operand: Node


@dataclass(frozen=True)
class And:
    operands: tuple[Node, ...]


@dataclass(frozen=True)
class Or:
    operands: tuple[Node, ...]


Node = Compare | In | IsNull | Not | And | Or


class FilterError(ValueError):
    """A filter that does not parse or does not fit the event schema (the message names where)."""


_TOKEN = re.compile(
    r"\s*(?:(?P<number>-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)|(?P<string>'(?:[^']|'')*')"
    r"|(?P<quoted>`[^`]+`)|(?P<word>[A-Za-z_][A-Za-z0-9_]*)|(?P<op><>|!=|==|<=|>=|=|<|>)"
    r"|(?P<punct>[(),]))"
)
_KEYWORDS = {"and", "or", "not", "in", "is", "null", "true", "false"}
_OPS: dict[str, Op] = {
    "=": "=",
    "==": "=",
    "!=": "!=",
    "<>": "!=",
    "<": "<",
    "<=": "<=",
    ">": ">",
    ">=": ">=",
}


@dataclass(frozen=True)
class _Token:
    kind: str
    text: str
    position: int  # 1-based character position in the filter


def _tokens(text: str) -> list[_Token]:
    out, at = [], 0
    while at < len(text):
        if text[at:].strip() == "":
            break
        m = _TOKEN.match(text, at)
        if m is None or m.end() == at:
            where = at + len(text[at:]) - len(text[at:].lstrip())
            raise FilterError(f"position {where + 1}: unexpected {text[where : where + 10]!r}")
        kind = m.lastgroup or ""
        value = m.group(kind)
        position = m.start(kind) + 1
        if kind == "word" and value.lower() in _KEYWORDS:
            kind, value = "keyword", value.lower()
        out.append(_Token(kind, value, position))
        at = m.end()
    out.append(_Token("end", "", len(text) + 1))
    return out


class _Parser:
    def __init__(self, text: str, types: Mapping[str, pa.DataType], symbols: Mapping[str, list[str]]) -> None:
        self.tokens = _tokens(text)
        self.at = 0
        self.types = types
        self.symbols = symbols

    def peek(self) -> _Token:
        return self.tokens[self.at]

    def take(self) -> _Token:
        token = self.tokens[self.at]
        self.at += 1
        return token

    def keyword(self, word: str) -> bool:
        token = self.peek()
        if token.kind == "keyword" and token.text == word:
            self.at += 1
            return True
        return False

    def expect(self, text: str) -> _Token:
        token = self.take()
        if token.text != text:
            raise FilterError(f"position {token.position}: expected {text!r}, found {_shown(token)}")
        return token

    def parse(self) -> Node:
        node = self.disjunction()
        token = self.peek()
        if token.kind != "end":
            raise FilterError(
                f"position {token.position}: expected 'and', 'or' or the end, found {_shown(token)}"
            )
        return node

    def disjunction(self) -> Node:
        parts = [self.conjunction()]
        while self.keyword("or"):
            parts.append(self.conjunction())
        return parts[0] if len(parts) == 1 else Or(tuple(parts))

    def conjunction(self) -> Node:
        parts = [self.negation()]
        while self.keyword("and"):
            parts.append(self.negation())
        return parts[0] if len(parts) == 1 else And(tuple(parts))

    def negation(self) -> Node:
        if self.keyword("not"):
            return Not(self.negation())
        if self.peek().text == "(":
            self.take()
            node = self.disjunction()
            self.expect(")")
            return node
        return self.predicate()

    def predicate(self) -> Node:
        token = self.take()
        if token.kind not in ("word", "quoted"):
            raise FilterError(f"position {token.position}: expected a field, found {_shown(token)}")
        name = token.text.strip("`") if token.kind == "quoted" else token.text
        if name not in self.types:
            raise FilterError(
                f"position {token.position}: unknown field {name!r} (fields: {', '.join(sorted(self.types))})"
            )
        kind = value_kind(self.types[name])
        if kind is None:
            raise FilterError(
                f"position {token.position}: field {name!r} is a {self.types[name]}, which a filter cannot "
                "compare (filter on a field of one plain type)"
            )
        if self.keyword("is"):
            negated = self.keyword("not")
            null = self.take()
            if null.text != "null":
                raise FilterError(f"position {null.position}: expected 'null', found {_shown(null)}")
            return IsNull(name, negated)
        negated = self.keyword("not")
        if self.keyword("in"):
            self.expect("(")
            values = [self.literal(name)]
            while self.peek().text == ",":
                self.take()
                values.append(self.literal(name))
            self.expect(")")
            return In(name, tuple(values), negated)
        if negated:
            token = self.peek()
            raise FilterError(f"position {token.position}: expected 'in' after 'not', found {_shown(token)}")
        op_token = self.take()
        if op_token.kind != "op":
            raise FilterError(
                f"position {op_token.position}: expected a comparison (=, !=, <, <=, >, >=, in, is null) "
                f"after field {name!r}, found {_shown(op_token)}"
            )
        op = _OPS[op_token.text]
        if kind == "boolean" and op not in ("=", "!="):
            raise FilterError(
                f"position {op_token.position}: field {name!r} is a boolean: compare it with = or !="
            )
        return Compare(name, op, self.literal(name))

    def literal(self, name: str) -> Any:
        token = self.take()
        t = self.types[name]
        kind = value_kind(t)
        where = f"position {token.position}: field {name!r} is {_described(t)}"
        if token.kind == "keyword" and token.text == "null":
            raise FilterError(f"position {token.position}: compare with null as `{name} is null`")
        try:
            if kind in ("integer", "float", "decimal"):
                if token.kind != "number":
                    raise ValueError
                if kind == "integer":
                    if not re.fullmatch(r"-?\d+", token.text):
                        raise ValueError
                    value = int(token.text)
                    bits = t.bit_width - 1
                    if not -(2**bits) <= value < 2**bits:
                        raise FilterError(f"{where}: {token.text} is out of its range")
                    return value
                if kind == "float":
                    return _float_literal(float(token.text), t, f"{where}: {token.text} is out of its range")
                return _decimal_literal(Decimal(token.text), f"{where}: {token.text}")
            if kind == "boolean":
                if token.kind != "keyword" or token.text not in ("true", "false"):
                    raise ValueError
                return token.text == "true"
            if token.kind != "string":
                raise ValueError
            text = token.text[1:-1].replace("''", "'")
            if kind == "string":
                allowed = self.symbols.get(name)
                if allowed is not None and text not in allowed:
                    raise FilterError(f"{where} with symbols {allowed}: {text!r} is not one of them")
                return text
            if kind == "binary":
                return text.encode()
            if kind == "timestamp":
                moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
                return moment if moment.tzinfo else moment.replace(tzinfo=UTC)
            return date.fromisoformat(text)
        except (ValueError, InvalidOperation) as exc:
            if isinstance(exc, FilterError):
                raise
            raise FilterError(f"{where}: write it as {_EXAMPLES[kind or '']}, not {_shown(token)}") from None


#: Spark's decimals hold at most this many digits (a literal with more cannot be compared there).
MAX_DECIMAL_DIGITS = 38


def _float_literal(value: float, t: pa.DataType, out_of_range: str) -> float:
    """The literal as the field's type reads it: a 32-bit field's nearest 32-bit float (so
    ``temp = 0.1`` holds for a sensor's 0.1, and every engine compares the same two numbers)."""
    if not math.isfinite(value):
        raise FilterError(out_of_range)
    if t.bit_width == 32:
        try:
            return struct.unpack("<f", struct.pack("<f", value))[0]
        except OverflowError:
            raise FilterError(out_of_range) from None
    return value


def _decimal_literal(value: Decimal, where: str) -> Decimal:
    if not value.is_finite():
        raise ValueError
    if decimal_digits(value)[0] > MAX_DECIMAL_DIGITS:
        raise FilterError(
            f"{where} has more than {MAX_DECIMAL_DIGITS} digits, the most a decimal comparison can hold "
            "(write a literal within the field's range)"
        )
    return value


def decimal_digits(value: Decimal) -> tuple[int, int]:
    """The (precision, scale) a decimal literal is written with: ``19.99`` is (4, 2), ``1e3`` (4, 0)."""
    _sign, digits, exponent = value.as_tuple()
    assert isinstance(exponent, int)
    scale = max(-exponent, 0)
    precision = len(digits) + exponent if exponent >= 0 else max(len(digits), scale)
    return precision, scale


_EXAMPLES = {
    "integer": "a whole number (42)", "float": "a number (2.5)", "decimal": "a number (19.99)",
    "boolean": "true or false", "string": "a quoted text ('active')", "binary": "a quoted text ('abc')",
    "timestamp": "a quoted ISO-8601 time ('2026-01-01T00:00:00Z')", "date": "a quoted date ('2026-01-01')",
}  # fmt: skip


def _shown(token: _Token) -> str:
    return "the end" if token.kind == "end" else repr(token.text)


def value_kind(t: pa.DataType) -> str | None:
    """The kind of literal a field of Arrow type ``t`` compares with (None: not a plain type)."""
    if pa.types.is_integer(t):
        return "integer"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_decimal(t):
        return "decimal"
    if pa.types.is_boolean(t):
        return "boolean"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_binary(t) or pa.types.is_fixed_size_binary(t):
        return "binary"
    if pa.types.is_timestamp(t):
        return "timestamp"
    if pa.types.is_date(t):
        return "date"
    return None


def _described(t: pa.DataType) -> str:
    return {
        "integer": "an integer", "float": "a floating-point number",
        "decimal": f"a decimal({getattr(t, 'precision', 0)}, {getattr(t, 'scale', 0)})",
        "boolean": "a boolean", "string": "a string", "binary": "bytes", "timestamp": "a timestamp",
        "date": "a date",
    }.get(value_kind(t) or "", str(t))  # fmt: skip


def parse(
    text: str, types: Mapping[str, pa.DataType], *, symbols: Mapping[str, list[str]] | None = None
) -> Node:
    """The tree of a filter, its literals typed as the fields they compare with.

    Args:
        text: The filter.
        types: The event's fields and their Arrow types (:func:`lambdalake.event_schema.event_schema`).
        symbols: Enum fields' symbols (a literal must be one of them).

    Raises:
        FilterError: Naming the position (1-based) and the field.
    """
    if not text.strip():
        raise FilterError("position 1: the filter is empty (leave `where` out to keep every event)")
    return _Parser(text, types, symbols or {}).parse()


def fields(node: Node) -> list[str]:
    """The fields a filter reads, in order of appearance."""
    if isinstance(node, Compare | In | IsNull):
        return [node.field]
    children = (node.operand,) if isinstance(node, Not) else node.operands
    return list(dict.fromkeys(f for child in children for f in fields(child)))


_COMPARE: dict[str, Callable[[Any, Any], bool]] = {
    "=": operator.eq, "!=": operator.ne, "<": operator.lt,
    "<=": operator.le, ">": operator.gt, ">=": operator.ge,
}  # fmt: skip


#: What holds of a NaN compared with any number: NaN sorts above every number, infinity included,
#: and equals only NaN (Spark's order; a literal is never NaN).
_ABOVE_ANY = frozenset({"!=", ">", ">="})


def evaluate(node: Node, row: Mapping[str, Any]) -> bool | None:
    """The filter on one row, in SQL's three-valued logic (None: unknown). A view keeps the row when
    this is True."""
    if isinstance(node, Compare):
        value = row.get(node.field)
        if value is None:
            return None
        if value != value:  # NaN, of any float type (numpy's too): the one value unequal to itself
            return node.op in _ABOVE_ANY
        return _COMPARE[node.op](_comparable(value), node.value)
    if isinstance(node, In):
        value = row.get(node.field)
        if value is None:
            return None
        found = _comparable(value) in node.values
        return not found if node.negated else found
    if isinstance(node, IsNull):
        return (row.get(node.field) is not None) if node.negated else (row.get(node.field) is None)
    if isinstance(node, Not):
        inner = evaluate(node.operand, row)
        return None if inner is None else not inner
    results = [evaluate(child, row) for child in node.operands]
    if isinstance(node, And):
        return False if False in results else (None if None in results else True)
    return True if True in results else (None if None in results else False)


def _comparable(value: Any) -> Any:
    # Timestamps as decoded may be naive UTC (the Cassandra driver) or aware (fastavro).
    if isinstance(value, datetime) and value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    return value


def keeps(node: Node | None, row: Mapping[str, Any]) -> bool:
    """Whether a view with filter ``node`` (None: no filter) counts ``row``."""
    return node is None or evaluate(node, row) is True


def lower(
    node: Node,
    *,
    field: Callable[[str], Any],
    literal: Callable[[str, Any], Any],
    is_null: Callable[[Any], Any],
    is_nan: Callable[[Any], Any],
) -> Any:
    """The filter built from an engine's expressions: Spark's columns and Arrow's compute
    expressions both overload the comparison operators and ``&``, ``|``, ``~`` with SQL's
    three-valued logic, so one walk of the tree serves both.

    Args:
        node: The filter.
        field: A field's expression.
        literal: The expression of a literal compared with a field (its name, the value).
        is_null: Whether an expression is null.
        is_nan: Whether a floating-point expression is NaN (null for a null).
    """

    def build(n: Node) -> Any:
        if isinstance(n, Compare):
            f, value = field(n.field), literal(n.field, n.value)
            out = {"=": f == value, "!=": f != value, "<": f < value, "<=": f <= value,
                   ">": f > value, ">=": f >= value}[n.op]  # fmt: skip
            if isinstance(n.value, float) and n.op in _ABOVE_ANY:
                # The NaN rule of :func:`evaluate`, once: IEEE says false for NaN > x, Spark true;
                # or-ing NaN in gives every engine Spark's order (for != it changes nothing).
                out = out | is_nan(f)
            return out
        if isinstance(n, In):
            # One equality per value, or-ed: SQL's `in` exactly (unknown for a null), where Arrow's
            # isin says false for a null and wants one type where decimal literals have several.
            found = reduce(operator.or_, [field(n.field) == literal(n.field, v) for v in n.values])
            return ~found if n.negated else found
        if isinstance(n, IsNull):
            null = is_null(field(n.field))
            return ~null if n.negated else null
        if isinstance(n, Not):
            return ~build(n.operand)
        return reduce(operator.and_ if isinstance(n, And) else operator.or_, [build(c) for c in n.operands])

    return build(node)


def arrow_expression(node: Node, schema: pa.Schema) -> Any:
    """The filter as a ``pyarrow.compute`` expression over a table of ``schema`` (``Table.filter``
    keeps the rows where it is true)."""
    import pyarrow.compute as pc

    def compared_as(name: str) -> pa.DataType:
        # Fixed-size bytes as bytes (a literal of another length compares, as in Spark and Python);
        # timestamps to the microsecond a literal may carry.
        t = schema.field(name).type
        if pa.types.is_fixed_size_binary(t):
            return pa.binary()
        if pa.types.is_timestamp(t) and t.unit in ("s", "ms"):
            return pa.timestamp("us", tz=t.tz)
        return t

    def field(name: str) -> pc.Expression:
        t = compared_as(name)
        return pc.field(name) if t == schema.field(name).type else pc.field(name).cast(t)

    def literal(name: str, value: Any) -> pa.Scalar:
        if isinstance(value, Decimal):
            return pa.scalar(value)  # its own precision: Arrow compares decimals of two scales exactly
        # A 32-bit field's literal is already a 32-bit float (parse), so float32 holds it exactly.
        return pa.scalar(value, type=compared_as(name))

    return lower(
        node, field=field, literal=literal, is_null=lambda e: e.is_null(), is_nan=lambda e: e.is_nan()
    )
