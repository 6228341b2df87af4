"""Views compiled into Spark transformations that run unchanged on streaming and batch DataFrames.

The speed layer applies ``windowed`` to the stream with a watermark (grouped by ingest epoch too) and
writes each task's ``latest`` winners as candidates that Cassandra keeps in the latest rule's order
(:mod:`lambdalake.latest`), so the first is the row ``latest`` would pick; the batch layer applies the
very same functions to the whole master dataset. No view logic exists anywhere else.
"""

from __future__ import annotations

from functools import reduce

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import DataType, StructType

from lambdalake.identity import spark_value_hash
from lambdalake.latest import RANK, spark_order, spark_rank
from lambdalake.pipeline import LatestView, Pipeline, WindowedView
from lambdalake.spark.filters import column as filter_column
from lambdalake.view_types import held_types, spark_type
from lambdalake.views import (
    EPOCH,
    WINDOW_START,
    Component,
    latest_columns,
    view_components,
)

#: Columns the decoder adds to every event (its Kafka coordinates and ingest time).
INGEST_TS = "_ingest_ts"
INGEST_EPOCH = "_epoch"
#: The master dataset file a row was read from (:func:`read_master`).
FILE = "_file"


def latest_order(df: DataFrame, view: LatestView) -> Column:
    """Each delivery's rank (:func:`lambdalake.latest.spark_rank`), as ``decimal(38,0)``."""
    return spark_rank(df, view.version)


def latest(
    df: DataFrame, pipeline: Pipeline, view: LatestView, *, carry: tuple[str, ...] = (), rank: bool = False
) -> DataFrame:
    """One row per key: the delivery the latest rule picks (:mod:`lambdalake.latest`), so the result
    never depends on arrival order. ``carry``: more columns of the winning delivery to keep (the
    batch layer keeps its coordinates, to merge two results as one). ``rank``: the winner's rank
    too (column ``RANK``: :func:`lambdalake.latest.spark_rank`), from its version, which need not
    be one of the view's columns."""
    df = only_kept(df, pipeline, view)
    cols = latest_columns(pipeline, view)
    keep = list(dict.fromkeys([*(c for c in cols if c not in view.key), INGEST_TS, INGEST_EPOCH, *carry]))
    # The rank needs the winner's version: carried through the grouping when the view lacks it.
    extra = [view.version] if rank and view.version not in {*keep, *view.key} else []
    winner = F.max_by(F.struct(*[F.col(c) for c in [*keep, *extra]]), spark_order(df, view.version))
    out = (
        df.groupBy(*view.key)
        .agg(winner.alias("_w"))
        .select(*view.key, *[F.col(f"_w.{c}").alias(c) for c in [*keep, *extra]])
    )
    return out.withColumn(RANK, latest_order(out, view)).drop(*extra) if rank else out


def only_kept(df: DataFrame, pipeline: Pipeline, view: LatestView | WindowedView) -> DataFrame:
    """``df``'s events the view's ``where`` keeps (all of them without one)."""
    node = pipeline.view_filter(view)
    return df if node is None else df.filter(filter_column(node))


def _component(c: Component, col: Column, kind: DataType | None) -> Column:
    """Component ``c`` of a windowed view over ``col`` (its source's values, or a count's ones)
    whose Spark type is ``kind`` (None without a source)."""
    if c.fn == "count":
        return F.count(col).cast("long").alias(c.column)
    if c.fn == "hll":
        assert kind is not None
        # Each value as its identity hash: equal values across promotions are one item.
        return F.hll_sketch_agg(spark_value_hash(col, kind), c.size).alias(c.column)
    if c.fn == "kll":
        return F.kll_sketch_agg_double(col.cast("double"), c.size).alias(c.column)
    return {"sum": F.sum, "min": F.min, "max": F.max}[c.fn](col).alias(c.column)


def _source(c: Component) -> Column:
    return F.col(c.source) if c.source else F.lit(1)


def windowed(
    df: DataFrame, pipeline: Pipeline, view: WindowedView, *, epoch: Column | None = None
) -> DataFrame:
    """Mergeable aggregates per key and tumbling event-time window.

    Args:
        df: Decoded, deduplicated events.
        pipeline: The pipeline (for the default time column).
        view: The view definition.
        epoch: A grouping column for the ingest epoch (the speed layer's ``window`` on the
            watermarked ingest time). None aggregates across epochs (the batch layer).
    """
    df = as_recorded(only_kept(df, pipeline, view), pipeline, view)
    types = {f.name: f.dataType for f in df.schema}
    out = df.groupBy(*_cell(pipeline, view, epoch)).agg(*[
        _component(c, _source(c), types.get(c.source or ""))
        for c in view_components(view)
    ])  # fmt: skip
    return _epoch_number(out) if epoch is not None else out


def together_column(index: int, column: str) -> str:
    """The column of :func:`windowed_together`'s rows that holds view ``index``'s ``column`` (the
    window start and epoch are shared)."""
    return column if column in (WINDOW_START, EPOCH) else f"_v{index}_{column}"


def together_row(index: int) -> str:
    """The column of :func:`windowed_together`'s rows saying whether a row is one of view ``index``."""
    return f"_v{index}__row"


def windowed_together(
    df: DataFrame, pipeline: Pipeline, views: list[WindowedView], *, epoch: Column
) -> DataFrame:
    """:func:`windowed` of every view of ``views`` in one stateful step, for the speed layer.

    Spark runs one streaming aggregation per query in update mode, so one read of the topic feeds
    every windowed view this way. Views cut alike (the same key at the same types, the same window)
    share a *cell*: each event becomes one row per cell that a view keeps it in, grouped by (cell,
    key, window, ingest epoch), and each view's aggregates read the rows it keeps. A row is one of
    view ``i`` where :func:`together_row` says so (the view kept an event in it); its columns are
    named by :func:`together_column` and hold what :func:`windowed` gives (tested equal).
    """
    typed: list[dict[str, Column]] = []
    keeps: list[Column] = []
    cells: dict[tuple, int] = {}
    cell_of: list[int] = []
    for view in views:
        held, keep = _recorded(pipeline, view)
        typed.append({n: held.get(n, F.col(n)) for n in _reads(pipeline, view)})
        node = pipeline.view_filter(view)
        keeps.append(keep if node is None else filter_column(node) & keep)
        key = tuple((k, str(held_types(pipeline, view).get(k))) for k in view.key)
        cut = (key, view.time or pipeline.event.time, view.window_seconds)
        cell_of.append(cells.setdefault(cut, len(cells)))
    first = {c: cell_of.index(c) for c in range(len(cells))}  # a view of each cell: its key and window
    # Every element of the array has one type: the other cells' keys as typed nulls.
    key_structs = [F.struct(*[typed[i][k].alias(k) for k in views[i].key]) for i in first.values()]
    array = F.array(*[
        F.when(reduce(lambda a, b: a | b, [keeps[i] for i in range(len(views)) if cell_of[i] == c]), F.struct(
            F.lit(c).alias("_cell"),
            *[(key_structs[d] if d == c else F.when(F.lit(False), key_structs[d])).alias(f"_k{d}")
              for d in range(len(cells))],
            _window_start(pipeline, views[first[c]]).alias(WINDOW_START),
            *[(F.coalesce(keeps[i], F.lit(False)) if cell_of[i] == c else F.lit(False)).alias(f"_keep{i}")
              for i in range(len(views))],
        ))
        for c in range(len(cells))
    ])  # fmt: skip
    rows = df.select("*", F.explode(F.filter(array, lambda e: e.isNotNull())).alias("_e")).select("*", "_e.*")
    kinds = [{f.name: f.dataType for f in df.select(*[c.alias(n) for n, c in cols.items()]).schema}
             for cols in typed]  # fmt: skip
    aggregates = []
    for i, view in enumerate(views):
        mine = F.col(f"_keep{i}")
        aggregates.append(F.count(F.when(mine, F.lit(1))).alias(f"_v{i}__n"))
        for c in view_components(view):
            source = typed[i][c.source] if c.source else F.lit(1)
            agg = _component(c, F.when(mine, source), kinds[i].get(c.source or ""))
            aggregates.append(agg.alias(together_column(i, c.column)))
    out = rows.groupBy(
        F.col("_cell"), *[F.col(f"_k{d}") for d in range(len(cells))], F.col(WINDOW_START),
        epoch.alias("_epoch_window"),
    ).agg(*aggregates)  # fmt: skip
    columns = []
    for i, view in enumerate(views):
        columns.append(((F.col("_cell") == cell_of[i]) & (F.col(f"_v{i}__n") > 0)).alias(together_row(i)))
        columns += [F.col(f"_k{cell_of[i]}.{k}").alias(together_column(i, k)) for k in view.key]
        columns += [F.col(together_column(i, c.column)) for c in view_components(view)]
    return _epoch_number(out.select(*columns, WINDOW_START, "_epoch_window"))


def _reads(pipeline: Pipeline, view: WindowedView) -> list[str]:
    """The fields a windowed view's key and aggregates read."""
    return list(dict.fromkeys([*view.key, *(c.source for c in view_components(view) if c.source)]))


def as_recorded(df: DataFrame, pipeline: Pipeline, view: WindowedView) -> DataFrame:
    """``df`` with the fields ``view`` holds at the types its version was made with
    (:func:`lambdalake.view_types.held_types`). Every value fits while deploy holds the widening
    schema back; one that does not (a producer registered it meanwhile) is left out of this version
    only (a key) or counts as null (an aggregate's input): the new version counts it."""
    held, fits = _recorded(pipeline, view)
    return df.filter(fits).withColumns(held) if held else df


def _recorded(pipeline: Pipeline, view: WindowedView) -> tuple[dict[str, Column], Column]:
    """The fields ``view`` holds at other types than the event's, cast to them, and whether an
    event's key fits them (see :func:`as_recorded`)."""
    held = {n: F.col(n).try_cast(spark_type(t)) for n, t in held_types(pipeline, view).items()}
    fits = [F.col(k).isNull() | held[k].isNotNull() for k in view.key if k in held]
    return held, reduce(lambda a, b: a & b, fits, F.lit(True))


def window_cells(df: DataFrame, pipeline: Pipeline, view: WindowedView, *, epoch: Column) -> DataFrame:
    """The cells (key, window start, ingest epoch) of :func:`windowed` that ``df``'s events fall in,
    without aggregating (``df`` needs only the key, time and ingest time columns)."""
    return _epoch_number(df.select(*_cell(pipeline, view, epoch)).distinct())


def _cell(pipeline: Pipeline, view: WindowedView, epoch: Column | None) -> list[Column]:
    """The grouping columns of a windowed view: key, event-time window and (speed) ingest epoch."""
    groups = [*[F.col(k) for k in view.key], _window_start(pipeline, view).alias(WINDOW_START)]
    if epoch is not None:
        groups.append(epoch.alias("_epoch_window"))
    return groups


def _window_start(pipeline: Pipeline, view: WindowedView) -> Column:
    """The start of an event's event-time window."""
    # Spark allows one window() per aggregation and the speed layer spends it on the ingest epoch
    # (state eviction needs it), so the event-time window is plain arithmetic (epoch-aligned, UTC).
    size = view.window_seconds
    return F.timestamp_seconds(F.floor(F.unix_seconds(F.col(view.time or pipeline.event.time)) / size) * size)


def _epoch_number(df: DataFrame) -> DataFrame:
    """The ingest epoch's window as its number (start / length)."""
    seconds = F.col("_epoch_window.start").cast("long")
    duration = F.col("_epoch_window.end").cast("long") - seconds
    return df.withColumn(EPOCH, (seconds / duration).cast("long")).drop("_epoch_window")


def cell_columns(pipeline: Pipeline, view: WindowedView) -> list[str]:
    """The event columns :func:`window_cells` reads (besides the ingest time)."""
    return [*view.key, view.time or pipeline.event.time]


def deduplicate(df: DataFrame, pipeline: Pipeline, *, copies: str | None = None) -> DataFrame:
    """Batch form of event identity, across the whole history: keep each identity's first delivery
    by (ingest time, partition, offset). Ingest time is the broker's append time (LogAppendTime), so
    within a partition this is the first in its log, the copy the speed layer keeps; across
    partitions (copies written before partitions were added) the earlier ingest time wins.
    ``copies`` names a column to count each identity's deliveries in (none by default).
    """
    return split_deliveries(df, pipeline, copies=copies)[0]


def split_deliveries(
    df: DataFrame, pipeline: Pipeline, *, copies: str | None = None, carry: tuple[str, ...] = ()
) -> tuple[DataFrame, DataFrame]:
    """:func:`deduplicate`'s first deliveries, and the deliveries that lose to them.

    Copies are rare, so only they are sorted: a narrow count per identity finds the identities
    delivered more than once; their deliveries' coordinates alone (a narrow read) rank them; and the
    events pass once through a (usually broadcast) anti-join with the coordinates of the copies that
    lose. No whole row is picked by an aggregation (``min_by`` over a struct cannot use Spark's hash
    aggregation), and the events keep their partitioning (no union of two plans).

    Args:
        df: Decoded events, with :data:`FILE` when read by :func:`read_master`.
        pipeline: The pipeline (its event identity).
        copies: A column to count each identity's deliveries in (none by default).
        carry: Columns the losers carry besides their identity and coordinates, each also as its
            value in the identity's first delivery (``_first_<column>``). They stay narrow: only
            the deliveries of repeated identities are sorted. A caller that persists the losers
            before running the firsts computes them once.

    Returns:
        (firsts, losers).
    """
    identity = list(pipeline.event.identity)
    n = copies or "_copies"
    coordinates = [INGEST_TS, "_partition", "_offset"]
    # A coordinate the master dataset holds twice (archived twice before commits left held ones out) is one
    # delivery: its copies are told apart by the file they lie in, so exactly one of them is kept,
    # and a loser's coordinate never takes the winner's row with it.
    apart = [FILE] if FILE in df.columns else []
    repeated = df.groupBy(*identity).agg(F.count(F.lit(1)).alias(n)).filter(F.col(n) > 1)

    def on(left: str, right: str) -> Column:
        # Null-safe: a null identity component is one value, as groupBy treats it.
        return reduce(
            lambda a, b: a & b, [F.col(f"{left}.{c}").eqNullSafe(F.col(f"{right}.{c}")) for c in identity]
        )

    kept = [*identity, "_topic", *coordinates, *apart]
    narrow = df.select(*kept, *[c for c in dict.fromkeys(carry) if c not in kept])
    deliveries = narrow.alias("_d").join(repeated.alias("_r"), on("_d", "_r"), "left_semi")
    # Window partitions group nulls together, as groupBy does. Without the file column a held-twice
    # coordinate shares its rank (dense): it may count twice, but is never dropped whole.
    order = Window.partitionBy(*identity).orderBy(*coordinates, "_topic", *apart)
    rank = F.row_number().over(order) if apart else F.dense_rank().over(order)
    firsts_of = [F.first(c).over(order).alias(f"_first_{c}") for c in dict.fromkeys(carry)]
    # The anti-join reads the very plan returned, so a caller's persisted losers serve both.
    losers = deliveries.select("*", rank.alias("_rank"), *firsts_of).filter(F.col("_rank") > 1).drop("_rank")
    key = ["_topic", "_partition", "_offset", *apart]
    out = df.join(losers.select(*key), key, "left_anti")
    if copies:
        counted = out.alias("_e").join(repeated.alias("_r"), on("_e", "_r"), "left")
        out = counted.select("_e.*", F.coalesce(F.col(f"_r.{n}"), F.lit(1).cast("long")).alias(copies))
    return out.drop(*apart), losers


def read_master(
    spark: SparkSession, uris: list[str], *, held_twice: bool = True, schema: StructType | None = None
) -> DataFrame:
    """The master dataset's live files as events.

    Args:
        spark: The session.
        uris: The live files.
        held_twice: Whether a coordinate may lie in two files
            (:meth:`lambdalake.master.MasterDataset.may_hold_twice`): then each row carries the file it
            lies in (``FILE``), for :func:`deduplicate` to keep exactly one copy. Reading it costs a
            string a row (a quarter of deduplication's time on 1M events), so it is left out when no
            two files overlap.
        schema: The columns to read (each file's missing ones as null, narrower types widened);
            default: as the files say (:func:`lambdalake.spark.master.read_events` passes the
            pipeline's current reader schema).
    """
    reader = spark.read if schema is None else spark.read.schema(schema)
    events = reader.parquet(*uris)
    return events.withColumn(FILE, F.col("_metadata.file_path")) if held_twice else events
