"""Incremental runs: what changed since the active batch, merged into its views.

An incremental run builds on the active batch (its *base*) and reads only the master dataset rows at the
Kafka coordinates the base did not cover:

- per partition, the offsets from the base's horizon boundary to this run's: the epochs after the
  base's horizon (with LogAppendTime an epoch is a contiguous offset range, :mod:`batch.horizon`);
- every offset the master dataset had not covered at the base's pinned version: rows of epochs the base
covered
  found there (a replay archived records the master dataset lacked; rare, as the horizon waits for a gap-free
  archive) are counted too, and named with the master dataset commits that added them.

Deduplication stays exact over the whole history through the identity index
(:mod:`batch.identities`): every identity the views count, with the coordinate of its first delivery.
A delivery of a known identity is a later copy and does not count; the first copies of new identities
are the run's events. Their views are merged into the base's by each aggregate's merge
(:mod:`batch.merge`: counts and
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

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from lambdalake.batch.identities import IdentityIndex
from lambdalake.batch.run import MASTER_VERSION, RUN_ID
from lambdalake.cassandra.active import ActiveBatch, read_meta
from lambdalake.cassandra.session import connect
from lambdalake.coverage import Coverage, difference, from_json, intersection, normalized
from lambdalake.delta import commit_info, commit_metadata, open_table
from lambdalake.layout import views_path
from lambdalake.master import EPOCH_MS, RANGES, MasterDataset
from lambdalake.pipeline import Pipeline
from lambdalake.settings import Settings
from lambdalake.spark.views import INGEST_EPOCH
from lambdalake.view_versions import public_name

#: Commit metadata of the Delta views: the offsets per ``"topic/partition"`` the run's horizon ends at.
BOUNDARIES = "lambdalake.boundaries"


class FullRunNeeded(Exception):
    """What makes this run a full one (found while computing it)."""


@dataclass(frozen=True)
class Base:
    """The active batch an incremental run merges into, as its Delta views recorded it."""

    active: ActiveBatch
    run_id: str
    horizon: int
    master_version: int
    boundaries: dict[str, int]
    delta_versions: dict[str, int]


@dataclass
class Increment:
    """What an incremental run reads: per ``"topic/partition"``, the offset ranges whose rows the
    base may not have counted: from the base's boundaries to this run's, and every offset the master dataset
    had not covered at the base's pinned version. Reading more is harmless (a row the base counted is its
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
        entry = commit_metadata(table.history(1)[0])
        entries[view.name] = entry
    runs = {e.get(RUN_ID) for e in entries.values()}
    if len(runs) != 1:
        return "the active views were written by different runs"
    entry = next(iter(entries.values()))
    if int(entry.get(EPOCH_MS, 0)) != pipeline.layers.epoch_ms:
        return "the [layers] epoch changed"
    run_id = str(entry[RUN_ID])
    index = IdentityIndex(settings, pipeline)
    if index.run_id() != run_id:
        return "the identity index does not match the active batch"
    if MASTER_VERSION not in entry:
        return "the active views' commits do not name the master dataset version they read"
    base_horizon = int(entry["lambdalake.horizon"])
    if horizon < base_horizon:
        return f"the horizon moves back (from {base_horizon} to {horizon})"
    return Base(
        active=active, run_id=run_id, horizon=base_horizon,
        master_version=int(entry[MASTER_VERSION]),
        boundaries={k: int(v) for k, v in json.loads(entry[BOUNDARIES]).items()},
        delta_versions={v: int(active.views[v]) for v in entries},
    )  # fmt: skip


#: Beyond any offset (the open end of the ranges the master dataset had not covered).
NO_END = 1 << 62


def plan(base: Base, master: MasterDataset, *, master_version: int, boundaries: dict[str, int]) -> Increment:
    """The coordinates an incremental run to ``boundaries`` reads (module doc)."""
    covered = master.read_coverage(version=base.master_version)
    keys = {*boundaries, *base.boundaries, *covered}
    uncovered = difference({k: [(0, NO_END)] for k in keys}, covered)
    ranges: Coverage = {}
    for key in keys:
        start, end = base.boundaries.get(key, 0), boundaries.get(key, 0)
        after = [(start, end)] if end > start else []
        ranges[key] = normalized([*after, *uncovered.get(key, [])])
    return Increment(base, {k: v for k, v in ranges.items() if v})


def changed_by(
    master: MasterDataset, increment: Increment, coordinates: Coverage, *, master_version: int
) -> list[int]:
    """The master dataset commits after the base's version that added rows at ``coordinates`` (each
    commit's own log entry: read only when a run found rows of old epochs, which is rare)."""
    found = []
    for version in range(increment.base.master_version + 1, master_version + 1):
        entry = commit_info(master.path, version) or {}
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


def files_for(master: MasterDataset, ranges: Coverage, table) -> list[str]:
    """The live files of ``table``'s snapshot that may hold rows of ``ranges``."""
    wanted = [(int(k.rpartition("/")[2]), s, e) for k, parts in ranges.items() for s, e in parts]
    return sorted({uri for found in master.files_holding(wanted, table=table) for uri in found})


def old_epochs(delivered: DataFrame, horizon: int) -> tuple[list[int], Coverage]:
    """The epochs up to the base's ``horizon`` that rows of ``delivered`` (not counted by the base)
    fall in, and per partition the span of their offsets: rows the master dataset added into epochs the base
    covered (rare: the horizon waits for a gap-free archive)."""
    rows = delivered.filter(F.col(INGEST_EPOCH) <= horizon)
    spans = rows.groupBy("_topic", "_partition").agg(
        F.min("_offset").alias("low"), F.max("_offset").alias("high"),
        F.collect_set(INGEST_EPOCH).alias("epochs"),
    ).collect()  # fmt: skip
    epochs = sorted({int(e) for r in spans for e in r["epochs"]})
    return epochs, {f"{r['_topic']}/{r['_partition']}": [(r["low"], r["high"] + 1)] for r in spans}
