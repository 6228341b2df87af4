"""Edge validation over Arrow columns: which rows surely pass, so only the others are checked one by one.

The per-record checks of :mod:`lambdalake.validation` stay the definition of a verdict (rule names,
reasons, DLQ payloads). Over columns every rule and every type check of the writer schema is a
vectorised test that is *conservative*: a row it clears, the per-record path clears too; a row it
cannot vouch for is a suspect, and the per-record path gives its verdict. Both paths therefore give
identical verdicts by construction, and only the rare suspect pays for Python per record.

What cannot be told apart in a column makes a row a suspect: a null (a JSON ``null`` or a missing
field look alike, and the schema treats them differently unless the field defaults to null), a value
Arrow inferred with another type than the field's (``1.0`` for a ``long``, an ISO string read as a
timestamp), a column not in the schema, a number too large to compare exactly as a double.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lambdalake.edge_rules import BoundOp, passes
from lambdalake.pipeline import Rule
from lambdalake.validation import INT32

#: Integers beyond this magnitude lose precision as doubles: comparisons with float bounds defer.
EXACT_DOUBLE = 1 << 53
#: Every character ``str.strip`` removes (``str.isspace``), for the ``required`` rule's blank test.
SPACES = (
    "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007"
    "\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)
_BLANK_START = "^[" + "".join(f"\\x{{{ord(c):x}}}" for c in SPACES) + "]"


@dataclass(frozen=True)
class FieldType:
    """A top-level field of a writer schema as the columnar checks see it."""

    name: str
    avro: Any  # the type without null, resolved
    nullable: bool
    has_default: bool
    default: Any


def _resolve(avro_type: Any, named: dict[str, Any]) -> Any:
    if isinstance(avro_type, str) and avro_type in named:
        return named[avro_type]
    if isinstance(avro_type, dict) and isinstance(avro_type.get("type"), dict | list):
        return _resolve(avro_type["type"], named)
    return avro_type


def schema_fields(schema: Mapping[str, Any]) -> list[FieldType]:
    """The schema's top-level fields, named types resolved (a general union's ``avro`` is None)."""
    named: dict[str, Any] = {}
    out = []
    for f in schema["fields"]:
        t = f["type"]
        if isinstance(t, dict) and "name" in t:
            named[t["name"]] = t
        branches = t if isinstance(t, list) else [t]
        nullable = any(b == "null" or b == {"type": "null"} for b in branches)
        others = [_resolve(b, named) for b in branches if b != "null" and b != {"type": "null"}]
        # A general union is left to the per-record path (None: never vouched for).
        avro = others[0] if len(others) == 1 else None
        out.append(FieldType(f["name"], avro, nullable, "default" in f, f.get("default")))
    return out


def _kind(avro: Any) -> tuple[str | None, str | None]:
    if isinstance(avro, str):
        return avro, None
    if isinstance(avro, dict):
        return avro.get("type"), avro.get("logicalType")
    return None, None


def _is_signed(t: pa.DataType) -> bool:
    return pa.types.is_signed_integer(t)


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_signed_integer(t) or pa.types.is_floating(t)


def _mask(array: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A boolean Arrow array as numpy, null as False."""
    return np.asarray(pc.fill_null(array, False).to_numpy(zero_copy_only=False), dtype=bool)


def _finite_and_exact(column: pa.ChunkedArray) -> np.ndarray:
    """Numbers that compare with float bounds exactly as Python does: finite doubles, and integers
    a double holds exactly."""
    if pa.types.is_floating(column.type):
        return _mask(pc.is_finite(column))
    return _mask(pc.less(pc.abs_checked(pc.cast(column, pa.float64(), safe=False)), float(EXACT_DOUBLE)))


class ColumnarValidator:
    """Finds the rows of an Arrow table that the per-record checks would surely accept.

    Args:
        rules: The pipeline's checked rules (:func:`lambdalake.validation.checked_rules`).
        schema: The writer schema (JSON) records are checked against.
        drop_unknown: Columns not in the schema are dropped (the pipeline's ``unknown_fields =
            "drop"``) rather than making every row a suspect.
        check_shape: Check Avro types. Default True; False for records decoded from Avro (their
            shape is right by construction), as :class:`lambdalake.validation.RecordValidator`.
    """

    def __init__(
        self,
        rules: Sequence[Rule],
        *,
        schema: Mapping[str, Any],
        drop_unknown: bool = False,
        check_shape: bool = True,
    ) -> None:
        self._rules = list(rules)
        self._check_shape = check_shape
        self._fields = schema_fields(schema)
        self._known = frozenset(f.name for f in self._fields)
        self._drop_unknown = drop_unknown

    def known_columns(self, table: pa.Table) -> pa.Table:
        """``table`` without columns the schema lacks when those are dropped, else as it is."""
        if not self._drop_unknown:
            return table
        return table.select([n for n in table.column_names if n in self._known])

    def suspects(self, table: pa.Table | pa.RecordBatch, *, now: float | np.ndarray) -> np.ndarray:
        """Per row, True where only the per-record checks can give the verdict.

        Args:
            table: The records, one row each (columns named as fields; an absent column is a field
                every row lacks).
            now: Reference time in seconds for ``not_future`` rules (as the per-record check gets),
                one for all rows or one per row (the speed layer's Kafka timestamps).
        """
        if isinstance(table, pa.RecordBatch):
            table = pa.Table.from_batches([table])
        n = table.num_rows
        if n == 0:
            return np.zeros(0, dtype=bool)
        if any(name not in self._known for name in table.column_names):
            if not self._drop_unknown:
                return np.ones(n, dtype=bool)
            table = self.known_columns(table)
        ok = np.ones(n, dtype=bool)
        for field in self._fields if self._check_shape else []:
            ok &= self._shape(field, table, n)
        engine = _Columns(table, n, now)
        for rule in self._rules:
            ok &= passes(rule, engine)
        return ~ok

    def _shape(self, field: FieldType, table: pa.Table, n: int) -> np.ndarray:
        if field.name not in table.column_names:
            return np.full(n, field.has_default)
        column = table.column(field.name)
        # A null is a JSON null or a missing field: only a field defaulting to null takes both alike.
        nulls_ok = field.nullable and field.has_default and field.default is None
        valid = _mask(pc.is_valid(column))
        if pa.types.is_null(column.type):
            return np.full(n, nulls_ok)
        fits = self._fits(field.avro, column)
        return np.where(valid, fits, nulls_ok)

    def _fits(self, avro: Any, column: pa.ChunkedArray) -> np.ndarray | bool:
        """Per non-null value, whether it surely has the Avro type (as the per-record test sees it)."""
        t = column.type
        kind, logical = _kind(avro)
        if kind == "long":
            # A timestamp read from an ISO string is a string in the record: the per-record path
            # converts it.
            return _is_signed(t)
        if kind == "int":
            if logical is not None or not _is_signed(t):
                return False
            lo, hi = INT32
            return _mask(pc.and_(pc.greater_equal(column, lo), pc.less_equal(column, hi)))
        if kind in ("float", "double"):
            if pa.types.is_floating(t):
                return _mask(pc.is_finite(column))
            return _is_signed(t)
        if kind == "boolean":
            return pa.types.is_boolean(t)
        if kind == "string" and logical is None:
            return pa.types.is_string(t) or pa.types.is_large_string(t)
        if kind == "enum":
            if not pa.types.is_string(t):
                return False
            return _mask(pc.is_in(column, value_set=pa.array(avro["symbols"], pa.string())))
        return False  # bytes, fixed, records, arrays, maps, uuid strings, general unions


class _Columns:
    """The rules' primitives over one table (:class:`lambdalake.edge_rules.Engine`), as numpy masks
    that err toward False: a row a primitive cannot vouch for is left to the per-record path. Only
    ``is_null`` (exact) and ``blank`` (erring toward True) are ever negated by a rule."""

    def __init__(self, table: pa.Table, n: int, now: float | np.ndarray) -> None:
        self._table = table
        self._n = n
        self._now = now
        self._exact: dict[str, np.ndarray] = {}
        self._doubles: dict[str, pa.ChunkedArray] = {}

    def _exactly(self, field: str, column: pa.ChunkedArray) -> np.ndarray:
        """:func:`_finite_and_exact` once per field (a range checks it for each bound)."""
        if field not in self._exact:
            self._exact[field] = _finite_and_exact(column)
        return self._exact[field]

    def _as_doubles(self, field: str, column: pa.ChunkedArray) -> pa.ChunkedArray:
        """The column cast to doubles once per field (a range compares it with each bound)."""
        if field not in self._doubles:
            self._doubles[field] = pc.cast(column, pa.float64(), safe=False)
        return self._doubles[field]

    def _column(self, field: str) -> pa.ChunkedArray | None:
        """The field's column, or None where every value is None (no column, or a null one)."""
        if field not in self._table.column_names:
            return None
        column = self._table.column(field)
        return None if pa.types.is_null(column.type) else column

    def _none(self) -> np.ndarray:
        return np.zeros(self._n, dtype=bool)

    def is_null(self, field: str) -> np.ndarray:
        column = self._column(field)
        return np.ones(self._n, dtype=bool) if column is None else ~_mask(pc.is_valid(column))

    def blank(self, field: str) -> np.ndarray:
        column = self._column(field)
        if column is None or not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            return self._none()
        # Empty, or starting with a space: a string with more after the space is a suspect.
        blank = pc.or_(pc.equal(pc.utf8_length(column), 0), pc.match_substring_regex(column, _BLANK_START))
        return _mask(blank)

    def finite(self, field: str) -> np.ndarray:
        column = self._column(field)
        if column is None or not _is_number(column.type):
            return self._none()
        return self._exactly(field, column)

    def compare(self, field: str, op: BoundOp, bound: float) -> np.ndarray:
        column = self._column(field)
        if column is None or not _is_number(column.type):
            return self._none()
        # As doubles: exact for the values a double holds exactly, and a bound's rounding cannot
        # move it across one of them.
        compare = {">=": pc.greater_equal, "<=": pc.less_equal, "<": pc.less}[op]
        return self._exactly(field, column) & _mask(compare(self._as_doubles(field, column), float(bound)))

    def one_of(self, field: str, values: Sequence[str | int]) -> np.ndarray:
        column = self._column(field)
        if column is None:
            return self._none()
        if all(isinstance(v, str) for v in values) and pa.types.is_string(column.type):
            return _mask(pc.is_in(column, value_set=pa.array(values, pa.string())))
        if all(type(v) is int for v in values) and _is_signed(column.type):
            return _mask(pc.is_in(column, value_set=pa.array(values, pa.int64())))
        return self._none()

    def not_after_now(self, field: str, skew_s: float) -> np.ndarray:
        column = self._column(field)
        if column is None or not _is_number(column.type):
            return self._none()
        limit = (np.asarray(self._now, dtype=np.float64) + skew_s) * 1000
        if limit.ndim == 0:
            if not math.isfinite(float(limit)):
                return self._none()
            bound: Any = float(limit)
            bounded = np.ones(self._n, dtype=bool)
        else:
            bound = pa.array(limit)
            bounded = np.isfinite(limit)  # a row without a finite bound: per record
        early = _mask(pc.less_equal(self._as_doubles(field, column), bound))
        return bounded & self._exactly(field, column) & early
