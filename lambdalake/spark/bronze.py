"""Bronze read as the pipeline's current reader schema, whatever schema each file was written under.

The speed job writes each file in the reader schema it ran with, so a pipeline that evolved holds
files of several shapes. Spark would take one file's shape for all of them (a field added later
then "cannot be resolved"); read here with the current reader schema, a file lacking a field gives
null for it, a narrower type is widened by Spark's Parquet reader (``int`` to ``long`` or
``double``, ``float`` to ``double``), a field the reader no longer has is not read, and a field
added with a non-null default on a non-nullable type reads that default in the files written
before it, as Avro's resolution rules say.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_schema

from lambdalake.event_schema import event_schema
from lambdalake.pipeline import Pipeline
from lambdalake.spark.decode import ERROR_FIELDS, META_FIELDS
from lambdalake.spark.views import read_bronze

#: Avro types whose JSON default Spark takes as a literal of the column's type.
_LITERAL_DEFAULTS = {"int", "long", "float", "double", "string", "boolean", "enum"}


def bronze_schema(pipeline: Pipeline) -> pa.Schema:
    """The columns of a bronze file written under the pipeline's current reader schema."""
    meta = [f for f in META_FIELDS if f.name not in ERROR_FIELDS]
    return pa.schema([*event_schema(pipeline.reader_schema), *meta])


def read_events(
    spark: SparkSession, uris: list[str], pipeline: Pipeline, *, held_twice: bool = True
) -> DataFrame:
    """Bronze's live files ``uris`` as events of the current reader schema (module doc)."""
    schema = from_arrow_schema(bronze_schema(pipeline))
    events = read_bronze(spark, uris, held_twice=held_twice, schema=schema)
    for name, value in filled_defaults(pipeline).items():
        default = F.lit(value).cast(schema[name].dataType)
        events = events.withColumn(name, F.coalesce(F.col(name), default))
    return events


def filled_defaults(pipeline: Pipeline) -> dict[str, Any]:
    """Fields whose null in bronze can only mean a file written before they were added: a non-null
    default on a type without null. (A nullable field with a non-null default reads null in such
    files: a null there cannot be told from a null sent.)"""
    out = {}
    for field in pipeline.reader_schema["fields"]:
        kind = field["type"]
        kind = kind.get("type") if isinstance(kind, dict) and "logicalType" not in kind else kind
        if field.get("default") is not None and isinstance(kind, str) and kind in _LITERAL_DEFAULTS:
            out[field["name"]] = field["default"]
    return out
