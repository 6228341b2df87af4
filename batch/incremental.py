"""Incremental runs: what changed since the active batch, merged into its views.

An incremental run builds on the active batch (its *base*) and reads only the bronze rows at the
Kafka coordinates the base did not cover:

- per partition, the offsets from the base's horizon boundary to this run's: the epochs after the
  base's horizon (with LogAppendTime an epoch is a contiguous offset range, :mod:`batch.horizon`);
- every offset bronze had not covered at the base's pinned version: rows of epochs the base covered
  found there (a replay archived records bronze lacked; rare, as the horizon waits for a gap-free
  archive) are counted too, and named with the bronze commits that added them.

Deduplication stays exact over the whole history through the identity index
(:class:`IdentityIndex`): every identity the views count, with the coordinate of its first delivery.
A delivery of a known identity is a later copy and does not count; the first copies of new identities
are the run's events. Their views are merged into the base's by each aggregate's merge (counts and
sums add, minimums and maximums compare, ``latest`` keeps the higher rank, then the lower offset):
the views are monoids over the events, so the result is the full rebuild's. An old epoch's new record
that precedes an identity's counted copy would move that count between cells: the run becomes full.

A run is full instead, and says why, when asked (``--full``), on a pipeline's first run, when a view's
definition or the ``[layers]`` changed, when the active batch is not the newest Delta version of every
view (a restore, a run killed before its publish), when the index does not match it, and when the
horizon moves back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import reduce
from typing import Literal

import pyarrow as pa
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import DecimalType, DoubleType, FloatType, IntegralType, StringType, StructType

from batch.run import BatchRun, identities_path, views_path
from lambdalake.cassandra.active import ActiveBatch, read_meta
from lambdalake.cassandra.session import connect
from lambdalake.coverage import Coverage, difference, from_json, intersection, normalized
from lambdalake.delta import commit_files, commit_info, open_table
from lambdalake.master import EPOCH_MS, RANGES, MasterDataset
from lambdalake.pipeline import LatestView, Pipeline, WindowedView
from lambdalake.settings import Settings
from lambdalake.spark.views import INGEST_EPOCH, INGEST_TS
from lambdalake.storage import list_files
from lambdalake.view_versions import public_name
from lambdalake.views import RANK, WINDOW_START, view_components

#: Commit metadata of the Delta views and the index: the run that wrote them, and the offsets per
#: ``"topic/partition"`` the run's horizon ends at.
RUN_ID = "lambdalake.run_id"
BOUNDARIES = "lambdalake.boundaries"
#: What the index keeps of each identity's first delivery (its coordinate).
COORDINATE = ("_topic", "_partition", "_offset", INGEST_TS)
#: The ``latest`` rows' column the merge breaks a tie of ranks with (the lower offset wins, as in
#: :func:`lambdalake.spark.views.latest`).
OFFSET = "_offset"
#: The merged rows' column marking the cells the new events touched.
TOUCHED = "_touched"


class FullRunNeeded(Exception):
    """What makes this run a full one (found while computing it)."""


@dataclass(frozen=True)
class Base:
    """The active batch an incremental run merges into, as its Delta views recorded it."""

    active: ActiveBatch
    run_id: str
    horizon: int
    bronze_version: int
    boundaries: dict[str, int]
    delta_versions: dict[str, int]


@dataclass
class Increment:
    """What an incremental run reads: per ``"topic/partition"``, the offset ranges whose rows the
    base may not have counted: from the base's boundaries to this run's, and every offset bronze had
    not covered at the base's pinned version. Reading more is harmless (a row the base counted is its
    identity's indexed first delivery); reading less is not."""

    base: Base
    ranges: Coverage


def find_base(settings: Settings, pipeline: Pipeline, *, horizon: int) -> Base | str:
    """The active batch to merge into, or why this run must be full."""
    session = connect(settings.cassandra)
    active = read_meta(session, settings.cassandra.keyspace, pipeline.name).batch
    if active is None:
        return "the pipeline's first run (no batch published yet)"
    entries = {}
    for view in pipeline.views:
        name = public_name(view.name)
        if view.name not in active.views:
            return f"view {name!r} is new or its definition changed (no published version to merge into)"
        table = open_table(views_path(settings.storage_root, pipeline.name, view.name))
        if table is None or table.version() != active.views[view.name]:
            return (
                f"the active batch is not the newest Delta version of view {name!r} (a restore, or a run "
                "that did not publish)"
            )
        entry = table.history(1)[0]
        if BOUNDARIES not in entry:
            return "the active batch was written before incremental runs"
        entries[view.name] = entry
    runs = {e.get(RUN_ID) for e in entries.values()}
    if len(runs) != 1:
        return "the active views were written by different runs"
    entry = next(iter(entries.values()))
    if int(entry.get(EPOCH_MS, 0)) != pipeline.layers.epoch_ms:
        return "the [layers] epoch changed"
    run_id = str(entry[RUN_ID])
    if IdentityIndex(settings, pipeline).run_id() != run_id:
        return "the identity index does not match the active batch"
    base_horizon = int(entry["lambdalake.horizon"])
    if horizon < base_horizon:
        return f"the horizon moves back (from {base_horizon} to {horizon})"
    return Base(
        active=active, run_id=run_id, horizon=base_horizon,
        bronze_version=int(entry["lambdalake.bronze_version"]),
        boundaries={k: int(v) for k, v in json.loads(entry[BOUNDARIES]).items()},
        delta_versions={v: int(active.views[v]) for v in entries},
    )  # fmt: skip


#: Beyond any offset (the open end of the ranges bronze had not covered).
NO_END = 1 << 62


def plan(base: Base, bronze: MasterDataset, *, bronze_version: int, boundaries: dict[str, int]) -> Increment:
    """The coordinates an incremental run to ``boundaries`` reads (module doc)."""
    covered = bronze.read_coverage(version=base.bronze_version)
    keys = {*boundaries, *base.boundaries, *covered}
    uncovered = difference({k: [(0, NO_END)] for k in keys}, covered)
    ranges: Coverage = {}
    for key in keys:
        start, end = base.boundaries.get(key, 0), boundaries.get(key, 0)
        after = [(start, end)] if end > start else []
        ranges[key] = normalized([*after, *uncovered.get(key, [])])
    return Increment(base, {k: v for k, v in ranges.items() if v})


def changed_by(
    bronze: MasterDataset, increment: Increment, coordinates: Coverage, *, bronze_version: int
) -> list[int]:
    """The bronze commits after the base's version that added rows at ``coordinates`` (each
    commit's own log entry: read only when a run found rows of old epochs, which is rare)."""
    found = []
    for version in range(increment.base.bronze_version + 1, bronze_version + 1):
        entry = commit_info(bronze.path, version) or {}
        if intersection(coordinates, from_json(json.loads(entry.get(RANGES) or "{}"))):
            found.append(version)
    return found


def in_ranges(ranges: Coverage) -> Column:
    """Rows at the coordinates of ``ranges``."""
    terms = []
    for key, parts in ranges.items():
        topic, _, partition = key.rpartition("/")
        offsets = reduce(
            lambda a, b: a | b, [(F.col("_offset") >= s) & (F.col("_offset") < e) for s, e in parts]
        )
        terms.append((F.col("_topic") == topic) & (F.col("_partition") == int(partition)) & offsets)
    return reduce(lambda a, b: a | b, terms) if terms else F.lit(False)


def files_for(bronze: MasterDataset, ranges: Coverage, table) -> list[str]:
    """The live files of ``table``'s snapshot that may hold rows of ``ranges``."""
    wanted = [(int(k.rpartition("/")[2]), s, e) for k, parts in ranges.items() for s, e in parts]
    return sorted({uri for found in bronze.files_holding(wanted, table=table) for uri in found})


#: The index's identity: 128 bits, two 64-bit xxhash64 of the identity's values (under two
#: prefixes), as the speed layer's deduplication compares identities by 128-bit hashes: two identities
#: are taken for one only on a 128-bit collision.
HASHES = ("_id_h1", "_id_h2")


def identity_hashes(df: DataFrame, pipeline: Pipeline) -> list[Column]:
    """:data:`HASHES` of each row's identity. Each part is hashed with its null flag (so a null
    cannot move between parts) and as a canonical type (integers as long, floats as double, text as
    bytes, decimals at 38 digits), so a promotion of the field's type keeps its identities' hashes."""
    parts: list[Column] = []
    for name in pipeline.event.identity:
        col, kind = F.col(name), df.schema[name].dataType
        if isinstance(kind, IntegralType):
            col = col.cast("long")
        elif isinstance(kind, FloatType | DoubleType):
            col = col.cast("double")
        elif isinstance(kind, StringType):
            col = col.cast("binary")
        elif isinstance(kind, DecimalType):
            col = col.cast(DecimalType(38, kind.scale))
        parts += [F.col(name).isNull(), col]
    return [F.xxhash64(*parts).alias(HASHES[0]), F.xxhash64(F.lit("lambdalake-id"), *parts).alias(HASHES[1])]


class IdentityIndex:
    """Every identity the published views count (:data:`HASHES`), with the coordinate of its first
    delivery: a Delta table beside the views (``<storage_root>/identities/<pipeline>``), rewritten by
    a full run and appended to by an incremental one, each commit naming its run.

    Args:
        settings: The storage root.
        pipeline: The pipeline (its identity columns).
    """

    def __init__(self, settings: Settings, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.path = identities_path(settings.storage_root, pipeline.name)

    def run_id(self) -> str | None:
        """The run whose commit is the newest (None: no index)."""
        table = open_table(self.path)
        return None if table is None else table.history(1)[0].get(RUN_ID)

    def read(self, spark: SparkSession) -> DataFrame | None:
        table = open_table(self.path)
        files = table.file_uris() if table is not None else []
        return spark.read.parquet(*files) if files else None

    def stage(self, firsts: DataFrame, run: BatchRun) -> Staged:
        """Write the first deliveries ``firsts`` as the run's index files, not yet committed (no
        reader sees them; :meth:`commit` makes them the index)."""
        from pyspark.sql.pandas.types import to_arrow_schema

        rows = firsts.select(*identity_hashes(firsts, self.pipeline), *COORDINATE)
        folder = f"data/{run.run_id}"
        rows.write.mode("errorifexists").parquet(f"{self.path}/{folder}")
        written = list_files(f"{self.path}/{folder}", suffix=".parquet")
        files = [f"{folder}/{uri.rsplit('/', 1)[1]}" for uri in written]
        return Staged(files, to_arrow_schema(rows.schema, timezone="UTC"))

    def commit(self, staged: Staged, run: BatchRun, *, mode: Literal["append", "overwrite"]) -> None:
        """Commit staged files (``overwrite``: they are the whole index)."""
        commit_files(
            self.path, staged.files, mode=mode, schema=staged.schema,
            metadata={RUN_ID: run.run_id, "lambdalake.horizon": str(run.horizon)},
        )  # fmt: skip


@dataclass(frozen=True)
class Staged:
    """Index files a run wrote and has not committed yet, and their schema."""

    files: list[str]
    schema: pa.Schema


#: Columns :func:`classify` adds: the identity is in the index; and the delivery precedes the
#: indexed first delivery.
KNOWN = "_known"
EARLIER = "_earlier"


#: The most first deliveries whose identities are sent to every task reading the index (a hash
#: table of identities per executor); more are joined by shuffling both sides.
BROADCAST_IDENTITIES = 4_000_000


def classify(firsts: DataFrame, index: DataFrame | None, pipeline: Pipeline, *, rows: int) -> DataFrame:
    """``firsts`` (first deliveries per identity of the rows read, ``rows`` of them) with
    :data:`KNOWN` and :data:`EARLIER`. Unknown identities are new events; a known one is a copy the
    views counted (or the very delivery they counted), unless it is earlier.

    The index is read once, two longs a row, streamed past the hashes of the identities read
    (broadcast when they are few): only the index rows of those identities (copies: few) are kept,
    with their coordinates, and joined back."""
    if index is None:
        return firsts.withColumn(KNOWN, F.lit(False)).withColumn(EARLIER, F.lit(False))
    order = ("_ingest_ts", "_partition", "_offset", "_topic")
    hashed = firsts.select("*", *identity_hashes(firsts, pipeline))
    wanted = hashed.select(*HASHES)
    wanted = F.broadcast(wanted) if rows <= BROADCAST_IDENTITIES else wanted
    matched = index.join(wanted, list(HASHES), "left_semi").select(
        *HASHES, *[F.col(c).alias(f"_i{c}") for c in order], F.lit(True).alias(KNOWN)
    )
    joined = hashed.alias("_f").join(matched.alias("_i"), list(HASHES), "left")
    known = F.coalesce(F.col(f"_i.{KNOWN}"), F.lit(False))
    earlier = F.struct(*[F.col(f"_f.{c}") for c in order]) < F.struct(*[F.col(f"_i._i{c}") for c in order])
    return joined.select(
        *[F.col(f"_f.{c}") for c in firsts.columns], known.alias(KNOWN), (known & earlier).alias(EARLIER)
    )


def read_view(spark: SparkSession, path: str, version: int, schema: StructType) -> DataFrame:
    """A Delta view's rows at ``version`` (``schema``: the columns of an empty one)."""
    table = open_table(path, version=version)
    uris = table.file_uris() if table is not None else []
    return spark.read.parquet(*uris) if uris else spark.createDataFrame([], schema)


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
        else:
            out = (F.least if c.merge == "min" else F.greatest)(a, b)
        return out.cast(types[c.column]).alias(c.column)

    cols = [F.when(touched, F.col(f"_n.{c}")).otherwise(F.col(f"_p.{c}")).alias(c) for c in cell]
    out = joined.select(*cols, *[merged(c) for c in view_components(view)], touched.alias(TOUCHED))
    return out.select(*previous.columns, TOUCHED)


def merge_latest(previous: DataFrame, new: DataFrame, view: LatestView) -> DataFrame:
    """The base's ``latest`` rows with the new events' rows merged in: per key the higher rank, then
    the lower offset (:func:`lambdalake.spark.views.latest`'s order); :data:`TOUCHED` marks the keys
    whose row the new events replaced."""
    both = previous.withColumn(TOUCHED, F.lit(False)).unionByName(new.withColumn(TOUCHED, F.lit(True)))
    rest = [c for c in both.columns if c not in view.key]
    winner = F.max_by(F.struct(*[F.col(c) for c in rest]), F.struct(F.col(RANK), -F.col(OFFSET)))
    out = both.groupBy(*view.key).agg(winner.alias("_w")).select(*view.key, *[F.col(f"_w.{c}") for c in rest])
    return out.select(*previous.columns, TOUCHED)


def old_epochs(delivered: DataFrame, horizon: int) -> tuple[list[int], Coverage]:
    """The epochs up to the base's ``horizon`` that rows of ``delivered`` (not counted by the base)
    fall in, and per partition the span of their offsets: rows bronze added into epochs the base
    covered (rare: the horizon waits for a gap-free archive)."""
    rows = delivered.filter(F.col(INGEST_EPOCH) <= horizon)
    spans = rows.groupBy("_topic", "_partition").agg(
        F.min("_offset").alias("low"), F.max("_offset").alias("high"),
        F.collect_set(INGEST_EPOCH).alias("epochs"),
    ).collect()  # fmt: skip
    epochs = sorted({int(e) for r in spans for e in r["epochs"]})
    return epochs, {f"{r['_topic']}/{r['_partition']}": [(r["low"], r["high"] + 1)] for r in spans}
