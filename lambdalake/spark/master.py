"""Master dataset read as the pipeline's current reader schema, whatever schema each file was written under.

The speed job writes each file in the reader schema it ran with, so a pipeline that evolved holds
files of several shapes. Spark would take one file's shape for all of them (a field added later
then "cannot be resolved"); read here with the current reader schema, a file lacking a field gives
null for it, a narrower type is widened by Spark's Parquet reader (``int`` to ``long`` or
``double``, ``float`` to ``double``), a field the reader no longer has is not read, and a field
added with a non-null default on a non-nullable type reads that default in the files written
before it, as Avro's resolution rules say.

The promotions Avro allows that Spark's reader refuses (``int`` to ``float``, ``long`` to ``float``
or ``double``) are read file by file as written and cast: a pipeline whose history has one reads the
footers of the master dataset's files to group them by the types they hold (only then: the others read as
one). The cast rounds once to the nearest value of the new type, as the speed layer's decode does (Arrow's
cast) and as Avro's Java resolver does.
"""

from __future__ import annotations

from collections import defaultdict
from functools import reduce
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_schema

from lambdalake.event_schema import event_schema
from lambdalake.pipeline import Pipeline
from lambdalake.spark.decode import ERROR_FIELDS, META_FIELDS
from lambdalake.spark.views import read_master

#: Parquet column types Spark's reader reads as the second type (its own widenings).
_SPARK_WIDENS = {
    (pa.int32(), pa.int64()), (pa.int32(), pa.float64()), (pa.float32(), pa.float64()),
}  # fmt: skip

#: Avro types whose JSON default Spark takes as a literal of the column's type.
_LITERAL_DEFAULTS = {"int", "long", "float", "double", "string", "boolean", "enum"}


def master_schema(pipeline: Pipeline) -> pa.Schema:
    """The columns of a master dataset file written under the pipeline's current reader schema."""
    meta = [f for f in META_FIELDS if f.name not in ERROR_FIELDS]
    return pa.schema([*event_schema(pipeline.reader_schema), *meta])


def read_events(
    spark: SparkSession, uris: list[str], pipeline: Pipeline, *, held_twice: bool = True
) -> DataFrame:
    """The master dataset's live files ``uris`` as events of the current reader schema (module doc)."""
    current = master_schema(pipeline)
    schema = from_arrow_schema(current)
    cast = cast_fields(pipeline)
    if not cast or not uris:
        events = read_master(spark, uris, held_twice=held_twice, schema=schema)
    else:
        groups: dict[tuple[tuple[str, pa.DataType], ...], list[str]] = defaultdict(list)
        for uri in uris:
            groups[_written_types(uri, cast)].append(uri)
        parts = []
        for written, members in groups.items():
            as_written = dict(written)
            fields = [pa.field(f.name, as_written.get(f.name, f.type)) for f in current]
            part = read_master(
                spark, members, held_twice=held_twice, schema=from_arrow_schema(pa.schema(fields))
            )
            for name in as_written:
                part = part.withColumn(name, F.col(name).cast(schema[name].dataType))
            parts.append(part)
        events = reduce(lambda a, b: a.unionByName(b), parts)
    for name, value in filled_defaults(pipeline).items():
        default = F.lit(value).cast(schema[name].dataType)
        events = events.withColumn(name, F.coalesce(F.col(name), default))
    return events


def cast_fields(pipeline: Pipeline) -> dict[str, pa.DataType]:
    """Fields an older schema version gave a numeric type Spark's reader cannot read as the current
    one (``int`` to ``float``, ``long`` to ``float`` or ``double``), with their current type."""
    current = {f.name: f.type for f in event_schema(pipeline.reader_schema)}
    out = {}
    for name, kinds in pipeline.field_type_history.items():
        now = current.get(name)
        if now is None or not pa.types.is_floating(now):
            continue
        if any(pa.types.is_integer(k) and (k, now) not in _SPARK_WIDENS for k in kinds):
            out[name] = now
    return out


def _written_types(uri: str, fields: dict[str, pa.DataType]) -> tuple[tuple[str, pa.DataType], ...]:
    """The types a master dataset file holds ``fields`` in, where it differs from the current one (its
    footer)."""
    filesystem, path = pafs.FileSystem.from_uri(uri)
    written = pq.read_schema(path, filesystem=filesystem)
    out = []
    for name, now in fields.items():
        i = written.get_field_index(name)
        if i >= 0 and not written.field(i).type.equals(now):
            out.append((name, written.field(i).type))
    return tuple(out)


def filled_defaults(pipeline: Pipeline) -> dict[str, Any]:
    """Fields whose null in the master dataset can only mean a file written before they were added: a non-null
    default on a type without null. (A nullable field with a non-null default reads null in such
    files: a null there cannot be told from a null sent.)"""
    out = {}
    for field in pipeline.reader_schema["fields"]:
        kind = field["type"]
        kind = kind.get("type") if isinstance(kind, dict) and "logicalType" not in kind else kind
        if field.get("default") is not None and isinstance(kind, str) and kind in _LITERAL_DEFAULTS:
            out[field["name"]] = field["default"]
    return out
