"""Records given as dicts turned into one Arrow table, with the rows Arrow cannot hold set apart."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from itertools import repeat
from typing import Any

import numpy as np
import pyarrow as pa

from lambdalake.columnar.validate import FieldType, schema_fields
from lambdalake.produce.nesting import deeper_than

_INT64 = (-(1 << 63), 1 << 63)
_NESTED = frozenset({list, dict, tuple})


def _python_types(field: FieldType) -> frozenset[type]:
    """The Python types a value of the field is taken from as it is; any other (``bool`` for a
    ``long``, a ``datetime`` or ISO string for a timestamp, a ``Decimal``) goes per record."""
    avro = field.avro
    kind = avro.get("type") if isinstance(avro, dict) else avro
    return frozenset(
        {
            "boolean": (bool,), "int": (int,), "long": (int,), "float": (int, float),
            "double": (int, float), "string": (str,), "enum": (str,), "bytes": (bytes,),
            "fixed": (bytes,), "array": (list,), "map": (dict,), "record": (dict,),
        }.get(kind, ())  # type: ignore[arg-type]
    )  # fmt: skip


class DictRows:
    """Builds the table :meth:`EventProducer.send_batch` checks and encodes from dicts.

    ``pa.Table.from_pylist`` fails the whole batch at one odd record (a string price, a field of
    another type), so one bad record in ten thousand would send them all one by one. Here each field
    is a column of its own, and a record whose value is not of a type the field takes as it is, that
    is not a dict, or that holds a key the schema lacks (unless those are dropped) is set apart for
    the per-record path, which names what is wrong with it.

    Args:
        schema: The writer schema.
        drop_unknown: Keys the schema lacks are dropped (the pipeline's ``unknown_fields``).
    """

    def __init__(self, schema: Mapping[str, Any], *, drop_unknown: bool) -> None:
        self._fields = [(f, _python_types(f)) for f in schema_fields(schema)]
        self._known = frozenset(f.name for f in schema_fields(schema))
        self._drop_unknown = drop_unknown

    def read(self, rows: Sequence[Any]) -> tuple[np.ndarray, pa.Table] | None:
        """``(positions, table)``: row ``i`` of the table is ``rows[positions[i]]``; a record in no
        row is to be sent on its own. None when no record can go as a column."""
        n = len(rows)
        alone = np.fromiter((type(r) is not dict for r in rows), dtype=bool, count=n)
        if alone.any():
            rows = [r if type(r) is dict else {} for r in rows]
        if not self._drop_unknown and not set().union(*rows) <= self._known:
            alone |= np.fromiter((not r.keys() <= self._known for r in rows), dtype=bool, count=n)
        arrays: list[pa.Array] = []
        for field, types in self._fields:
            values = list(map(dict.get, rows, repeat(field.name)))  # no Python frame a row
            found = set(map(type, values))
            found.discard(type(None))
            if not found <= types:
                values = self._set_apart(values, alone, lambda v, ok=types: type(v) in ok)
            if found & _NESTED:  # pa.array recurses on the C stack: a deep value would kill us
                values = self._set_apart(values, alone, lambda v: not deeper_than(v))
            try:
                arrays.append(pa.array(values))
                continue
            except OverflowError:  # an integer beyond 64 bits: that record goes alone
                values = self._set_apart(values, alone, lambda v: type(v) is not int or _fits(v))
            except (pa.ArrowException, TypeError, ValueError):
                values = self._set_apart(values, alone, lambda v: False)
            try:
                arrays.append(pa.array(values))
            except (pa.ArrowException, TypeError, ValueError, OverflowError):
                # A nested value Arrow cannot take (mixed items...): those records go per record.
                arrays.append(pa.array(self._set_apart(values, alone, lambda v: False)))
        positions = np.flatnonzero(~alone)
        if not len(positions):
            return None
        table = pa.Table.from_arrays(arrays, names=[f.name for f, _ in self._fields])
        return positions, table if len(positions) == n else table.take(pa.array(positions))

    @staticmethod
    def _set_apart(values: list[Any], alone: np.ndarray, fine: Callable[[Any], bool]) -> list[Any]:
        """``values`` with each non-null one that is not ``fine`` replaced by null and its record
        marked in ``alone``."""
        odd = [v is not None and not fine(v) for v in values]
        alone |= np.asarray(odd, dtype=bool)
        return [None if o else v for v, o in zip(values, odd, strict=True)]


def _fits(value: int) -> bool:
    return _INT64[0] <= value < _INT64[1]
