"""Merging an incremental run's rows into its base's batch views, cell by cell, by each aggregate's
own merge: the views are monoids over the events, so the merge of the base's view with the view of
the new events is the view of all of them (:mod:`batch.incremental`)."""

from __future__ import annotations

from functools import reduce

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from lambdalake.latest import spark_merge_order
from lambdalake.pipeline import LatestView, WindowedView
from lambdalake.spark.delta import read_table
from lambdalake.views import WINDOW_START, view_components

#: The merged rows' column marking the cells the new events touched.
TOUCHED = "_touched"


def read_view(spark: SparkSession, path: str, version: int, schema: StructType) -> DataFrame:
    """A Delta view's rows at ``version`` (``schema``: the columns of an empty one)."""
    rows = read_table(spark, path, version=version)
    return rows if rows is not None else spark.createDataFrame([], schema)


def same_columns(a: DataFrame, b: DataFrame) -> bool:
    """Whether two results have the same column names and types (nullability aside)."""
    return [(f.name, f.dataType) for f in a.schema] == [(f.name, f.dataType) for f in b.schema]


def merge_windowed(previous: DataFrame, new: DataFrame, view: WindowedView) -> DataFrame:
    """The base's rows of a windowed view with the new events' rows merged in, per cell (key and
    window) by each component's merge; :data:`TOUCHED` marks the cells the new events touched."""
    cell = [*view.key, WINDOW_START]
    p = previous.withColumn("_in_p", F.lit(True)).alias("_p")
    n = new.withColumn("_in_n", F.lit(True)).alias("_n")
    on = reduce(lambda a, b: a & b, [F.col(f"_p.{c}").eqNullSafe(F.col(f"_n.{c}")) for c in cell])
    joined = p.join(n, on, "full")
    touched = F.col("_n._in_n").isNotNull()
    types = {f.name: f.dataType for f in previous.schema}

    def merged(c) -> Column:
        a, b = F.col(f"_p.{c.column}"), F.col(f"_n.{c.column}")
        if c.merge == "add":
            out = F.coalesce(a + b, a, b)
        elif c.merge == "hll":
            out = F.coalesce(F.hll_union(a, b, True), a, b)
        elif c.merge == "kll":
            out = F.coalesce(F.kll_sketch_merge_double(a, b), a, b)
        else:
            out = (F.least if c.merge == "min" else F.greatest)(a, b)
        return out.cast(types[c.column]).alias(c.column)

    cols = [F.when(touched, F.col(f"_n.{c}")).otherwise(F.col(f"_p.{c}")).alias(c) for c in cell]
    out = joined.select(*cols, *[merged(c) for c in view_components(view)], touched.alias(TOUCHED))
    return out.select(*previous.columns, TOUCHED)


def merge_latest(previous: DataFrame, new: DataFrame, view: LatestView) -> DataFrame:
    """The base's ``latest`` rows with the new events' rows merged in: per key the latest rule's winner
    (:func:`lambdalake.latest.spark_merge_order`); :data:`TOUCHED`
    marks the keys whose row the new events replaced."""
    both = previous.withColumn(TOUCHED, F.lit(False)).unionByName(new.withColumn(TOUCHED, F.lit(True)))
    rest = [c for c in both.columns if c not in view.key]
    winner = F.max_by(F.struct(*[F.col(c) for c in rest]), spark_merge_order())
    out = both.groupBy(*view.key).agg(winner.alias("_w")).select(*view.key, *[F.col(f"_w.{c}") for c in rest])
    return out.select(*previous.columns, TOUCHED)
