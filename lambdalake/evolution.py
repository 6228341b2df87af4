"""Which changes of a live pipeline's reader schema the layers cannot apply in place.

The registry judges a new version by Avro's resolution rules alone; the layers hold more than Avro
does. The event's key, time and identity partition the topic, window the views and deduplicate
every layer: a value of another type would not be the same key, window or identity as before. A
column keeps its Cassandra type for the table's life (Cassandra changes no column type in place): a
``latest`` view keeps a promoted field in a column per type it has had
(:class:`lambdalake.cassandra.tables.StoredField`), but not in its key, the primary key. A windowed
view whose key or ``sum``/``min``/``max`` a widening retypes (``int`` to ``long``, ``float`` to
``double``, ``string`` to ``bytes``...) gets a new version of the same definition built beside the
old one, which keeps its types until the switch (:mod:`lambdalake.view_types`): its table cannot
change a column's type and the speed job's aggregation state keeps the aggregate's type (Spark
refuses a query whose state value schema changed: measured, STATE_STORE_VALUE_SCHEMA_NOT_COMPATIBLE).

The master dataset's Parquet files keep the type each was written with: Spark's Parquet reader widens ``int``
to ``long`` or ``double``, ``float`` to ``double``, ``string`` to ``bytes`` and back, and a decimal
to more digits at the same scale; ``int`` to ``float`` and ``long`` to ``float``/``double`` are read
as written and cast (:mod:`lambdalake.spark.master`). Any other change of a field's column type (a
union branch added, which makes the column a struct of members) would leave files the batch cannot
read. Everything else the registry accepts (a field added or removed with a default, an enum symbol
added, the widenings above of a field no view stores) the layers take as it comes.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from lambdalake.cassandra.tables import speed_table_def
from lambdalake.errors import ConfigurationError
from lambdalake.event_schema import event_schema
from lambdalake.pipeline import LatestView, Pipeline


def unappliable_changes(pipeline: Pipeline, deployed: dict[str, Any]) -> list[str]:
    """Why the layers cannot move from ``deployed`` (the reader schema the platform runs) to the
    pipeline's reader schema; empty when they can."""
    before = {f["name"]: f["type"] for f in deployed["fields"]}
    after = {f["name"]: f["type"] for f in pipeline.reader_schema["fields"]}
    problems = []
    event = pipeline.event
    roles = [("key", event.key), ("time", event.time), *[("identity", f) for f in event.identity]]
    for role, name in dict.fromkeys(roles):
        if name in before and name in after and _canonical(before[name]) != _canonical(after[name]):
            problems.append(
                f"the event's {role} field {name!r} changes type from {_text(before[name])} to "
                f"{_text(after[name])}: every layer partitions, windows and deduplicates by it as it was"
            )
    old_types = {f.name: f.type for f in event_schema(deployed)}
    new_types = {f.name: f.type for f in event_schema(pipeline.reader_schema)}
    for name, new in new_types.items():
        old = old_types.get(name)
        if old is not None and not old.equals(new) and not _reads_as(old, new):
            problems.append(
                f"field {name!r} changes its column type from {old} to {new}: the master dataset's files "
                "hold it as before, and the batch reads them only as int to long, float or double, long to "
                "float or double, float to double, string to bytes and back, and a decimal to more "
                "digits at the same scale"
            )
    # A windowed view whose table or state a widening changes gets a new version built beside
    # (lambdalake.view_types); a latest view keeps a promoted field beside its old values, except
    # in its key.
    for view in pipeline.views:
        if not isinstance(view, LatestView):
            continue
        stored = dict(speed_table_def(pipeline, view, types={**new_types, **old_types}).columns)
        for column, cql in speed_table_def(pipeline, view).columns:
            if column in stored and stored[column] != cql:
                problems.append(
                    f"view {view.name!r} is keyed by {column!r}, stored as Cassandra {stored[column]}, "
                    f"and the new schema makes it {cql}: Cassandra changes no key column's type"
                )
    return problems


#: Column type changes the batch makes when it reads a master dataset file of the first type as the second
#: (Spark's Parquet reader's own widenings, and the numeric promotions read as written and cast).
_READ_WIDENS = {
    ("int32", "int64"), ("int32", "float64"), ("float32", "float64"),
    ("int32", "float32"), ("int64", "float32"), ("int64", "float64"),
    ("string", "binary"), ("binary", "string"),
}  # fmt: skip


def _reads_as(old: pa.DataType, new: pa.DataType) -> bool:
    """Whether Spark reads a Parquet column written as ``old`` as ``new`` with the same values (a
    decimal of more digits at the same scale too: Avro reads its unscaled integer at the new scale)."""
    if pa.types.is_decimal(old) and pa.types.is_decimal(new):
        return new.scale == old.scale and new.precision >= old.precision
    return (_kind(old), _kind(new)) in _READ_WIDENS


def _kind(t: pa.DataType) -> str:
    for kind in ("int32", "int64", "float32", "float64", "string", "binary"):
        if t.equals(pa.type_for_alias(kind)):
            return kind
    return str(t)


def require_appliable(pipeline: Pipeline, deployed: dict[str, Any]) -> None:
    """Raise naming every change the layers cannot apply, and the ways forward."""
    problems = unappliable_changes(pipeline, deployed)
    if problems:
        raise ConfigurationError(
            f"pipeline {pipeline.name!r}: schema {pipeline.schema_.versions[-1]} changes what the layers "
            f"hold: {'; '.join(problems)}. Nothing was deployed.",
            fix="keep those types (or add a field of the new type beside the old one); for another key, "
            "time or identity write a new pipeline (its own name and topic) and backfill it with "
            "`lambdalake replay`; for a stored column of another type, "
            "give the view a new name (a view added: deploy builds it from the master dataset) or keep that "
            "field out of it",
        )


def _canonical(avro_type: Any) -> str:
    """A type as comparable text (named types by their definition; docs and defaults left out)."""

    def strip(t: Any) -> Any:
        if isinstance(t, dict):
            return {k: strip(v) for k, v in t.items() if k not in ("doc", "default", "aliases")}
        if isinstance(t, list):
            return [strip(v) for v in t]
        return t

    return json.dumps(strip(avro_type), sort_keys=True)


def _text(avro_type: Any) -> str:
    return json.dumps(avro_type)[:80]
