"""The types a windowed view's version keeps while a schema change widens what it stores.

A windowed version's Cassandra table (its key columns, a min or max column, a sum's ``bigint`` or
``double``) and its Spark aggregation state take their types from the fields it reads. Cassandra
changes no column's type in place and Spark refuses a state of other types (measured: a decimal of
more digits, STATE_STORE_VALUE_SCHEMA_NOT_COMPATIBLE), so a schema version that widens such a field
(``int`` to ``long``, ``float`` to ``double``, an integer summed as a float, a decimal's precision)
gives the view a new version built beside the old one (:mod:`lambdalake.view_versions`). Until the
switch, the old version keeps computing as it was made: its inputs are cast to the types it
recorded (:func:`held_types`), which hold every value, since deploy registers the widening schema
only once the new version serves.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import pyarrow as pa

from lambdalake.event_schema import event_schema
from lambdalake.pipeline import LatestView, Pipeline, WindowedView
from lambdalake.views import view_components

#: The field types a version records, besides decimals: the types a column or a Spark state holds
#: as they are (a decimal's precision is part of its state's type: the sum of a decimal(p, s) is kept
#: as a decimal(p + 10, s)).
RECORDED = ("int32", "int64", "float", "double", "string", "binary")
_DECIMAL = re.compile(r"^decimal128\((\d+), (\d+)\)$")
#: Spark's name of each recorded type.
_SPARK = {"int32": "int", "int64": "bigint", "float": "float", "double": "double",
          "string": "string", "binary": "binary"}  # fmt: skip


def parse(kind: str) -> pa.DataType:
    """A recorded type's Arrow type."""
    found = _DECIMAL.match(kind)
    return pa.decimal128(int(found[1]), int(found[2])) if found else pa.type_for_alias(kind)


def spark_type(t: pa.DataType) -> str:
    """The Spark SQL name of a recorded type."""
    return f"decimal({t.precision},{t.scale})" if pa.types.is_decimal(t) else _SPARK[str(t)]


def _recorded(t: pa.DataType) -> bool:
    return str(t) in RECORDED or bool(_DECIMAL.match(str(t)))


def current_types(pipeline: Pipeline) -> dict[str, pa.DataType]:
    """The event fields' types under the pipeline's reader schema."""
    return {f.name: f.type for f in event_schema(pipeline.reader_schema)}


def _exact_fields(view: WindowedView) -> set[str]:
    """Fields whose type is a column's type: the key and what a min or max keeps."""
    return {*view.key, *(c.source for c in view_components(view) if c.fn in ("min", "max") and c.source)}


def _summed_fields(view: WindowedView) -> set[str]:
    return {c.source for c in view_components(view) if c.fn == "sum" and c.source}


def input_types(view: LatestView | WindowedView, types: Mapping[str, pa.DataType]) -> dict[str, str]:
    """What a version of ``view`` records of ``types`` (the fields its table's types follow)."""
    if not isinstance(view, WindowedView):
        return {}
    fields = sorted(_exact_fields(view) | _summed_fields(view))
    return {f: str(types[f]) for f in fields if f in types and _recorded(types[f])}


def held_types(
    pipeline: Pipeline,
    view: LatestView | WindowedView,
    current: Mapping[str, pa.DataType] | None = None,
) -> dict[str, pa.DataType]:
    """The fields ``view`` (a deployed version) computes as the types it recorded, not as the reader
    schema has them now: where the difference would change its table or state. Empty for a version
    made with today's types, and for every ``latest`` view (:class:`lambdalake.cassandra.tables.
    StoredField` keeps a promoted field beside its old values)."""
    if not isinstance(view, WindowedView) or not view.stored_types:
        return {}
    current = current_types(pipeline) if current is None else current
    exact, summed = _exact_fields(view), _summed_fields(view)
    held = {}
    for name, kind in view.stored_types.items():
        was, now = parse(kind), current.get(name)
        if now is None or was.equals(now):
            continue
        decimal = pa.types.is_decimal(was) or pa.types.is_decimal(now)
        floating = pa.types.is_floating(was) != pa.types.is_floating(now)
        if name in exact or (name in summed and (decimal or floating)):
            held[name] = was
    return held
