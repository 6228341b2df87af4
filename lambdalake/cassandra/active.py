"""The active batch version of a pipeline and its view versions: the one metadata row the batch
layer's publish and deploy's version switches change (lightweight transactions on that row) and
serving reads (all depend on this module, none on another)."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cassandra.cluster import Session
from cassandra.query import SimpleStatement

from lambdalake.cassandra.session import execute_lwt
from lambdalake.cassandra.stored_layout import require_current
from lambdalake.cassandra.tables import BATCH_META, create_keyspace, ensure_table
from lambdalake.errors import LambdalakeError
from lambdalake.pipeline import Pipeline
from lambdalake.settings import CassandraSettings
from lambdalake.view_versions import Registry, deployed_pipeline


@dataclass(frozen=True)
class ActiveBatch:
    """What serving reads: the active version, its horizon epoch and the epoch length.

    Attributes:
        version: The batch version serving reads: per cell, the row of the newest version not above it.
        horizon: The newest ingest epoch the version covers (epochs are ``ingest ms // epoch_ms``).
        epoch_ms: The epoch length the version was computed with.
        master_version: The master dataset's Delta version the run read.
        views: Each view's Delta version that was published (by internal name).
        published_at_ms: When the version became active (epoch ms; 0 if unknown).
        generation: The version whose full run started the tables (``<pipeline>__<view>__b<generation>``)
            holding this version's cells (incremental runs add theirs to their base's).
    """

    version: int
    horizon: int
    epoch_ms: int
    master_version: int
    views: dict[str, int]
    published_at_ms: int
    generation: int


@dataclass(frozen=True)
class PipelineMeta:
    """The metadata row as read: the active batch (None: none published), the view versions, and
    what a lightweight transaction conditions on (``row_version`` None: no row yet)."""

    batch: ActiveBatch | None
    registry: Registry = field(default_factory=Registry)
    row_version: int | None = None
    views_text: str | None = None


def read_meta(session: Session, keyspace: str, pipeline: str) -> PipelineMeta:
    """The pipeline's metadata row (an empty one before the first deploy or publish)."""
    # At the session's consistency (QUORUM): the row is switched by lightweight transactions whose
    # commits a quorum acknowledges, so a quorum read sees the newest switch while a replica is down.
    query = SimpleStatement(f'SELECT * FROM "{keyspace}"."{BATCH_META.name}" WHERE pipeline = %s')
    require_current(session, keyspace)
    try:
        row = session.execute(query, [pipeline]).one()
    except Exception as exc:  # no metadata table yet: nothing published
        if "unconfigured" in str(exc).lower() or "does not exist" in str(exc).lower():
            return PipelineMeta(None)
        raise
    if row is None:
        return PipelineMeta(None)
    text = row.view_versions
    batch = None
    if row.version:
        published = row.published_at
        batch = ActiveBatch(
            row.version, row.horizon, row.epoch_ms, row.master_version, json.loads(row.views),
            int(published.timestamp() * 1000) if published is not None else 0,
            row.generation,
        )  # fmt: skip
    return PipelineMeta(batch, Registry.parse(text), row.version or 0, text)


def active_batch(session: Session, keyspace: str, pipeline: str) -> ActiveBatch | None:
    """The pipeline's active batch version (None before the first publish)."""
    return read_meta(session, keyspace, pipeline).batch


def lwt(cql: str) -> SimpleStatement:
    """A lightweight transaction, at the session's consistency and serial consistency (settings)."""
    return SimpleStatement(cql)


def swap_registry(
    session: Session, settings: CassandraSettings, pipeline: str, seen: PipelineMeta, new: Registry
) -> bool:
    """Write ``new`` if the row is still as ``seen`` (the batch version and the registry): False
    when another writer changed it meanwhile (decide again on a fresh read)."""
    create_keyspace(session, settings)
    ensure_table(session, settings.keyspace, BATCH_META)
    table = f'"{settings.keyspace}"."{BATCH_META.name}"'
    text = new.to_text()

    def mine(row: Any) -> bool:
        return row.view_versions == text

    if seen.row_version is None:
        return execute_lwt(
            session,
            lwt(f"INSERT INTO {table} (pipeline, version, view_versions) VALUES (%s, 0, %s) IF NOT EXISTS"),
            [pipeline, text],
            mine=mine,
        )
    return execute_lwt(
        session,
        lwt(
            f"UPDATE {table} SET view_versions = %s WHERE pipeline = %s "
            "IF version = %s AND view_versions = %s"
        ),
        [text, pipeline, seen.row_version, seen.views_text],
        mine=mine,
    )


#: How often a registry change is decided again after another writer changed the row first.
SWAP_ATTEMPTS = 12
#: The first wait after a lost race (doubled each time, up to :data:`SWAP_MAX_DELAY_S`, jittered).
SWAP_FIRST_DELAY_S = 0.05
SWAP_MAX_DELAY_S = 2.0

T = TypeVar("T")


def swap_until_applied(
    session: Session,
    settings: CassandraSettings,
    pipeline: str,
    decide: Callable[[], tuple[PipelineMeta, Registry | None, T]],
    *,
    attempts: int = SWAP_ATTEMPTS,
) -> T:
    """Decide a registry change on a fresh read and write it with :func:`swap_registry`, again after
    each lost race, at most ``attempts`` times with a jittered, doubling wait between them.

    Args:
        decide: Reads the row and returns (what it read, the registry to write or None for no
            write, the result to return once written).

    Raises:
        LambdalakeError: Another writer won every race.
    """
    delay = SWAP_FIRST_DELAY_S
    for _ in range(attempts):
        seen, new, result = decide()
        if new is None or swap_registry(session, settings, pipeline, seen, new):
            return result
        time.sleep(delay * (0.5 + random.random()))
        delay = min(delay * 2, SWAP_MAX_DELAY_S)
    raise LambdalakeError(
        f"the view registry of {pipeline!r} changed under every one of {attempts} attempts to update it",
        fix="another deploy or view build is running on this pipeline: let it finish, then run the "
        "command again",
    )


def with_deployed_views(session: Session, keyspace: str, pipeline: Pipeline) -> Pipeline:
    """``pipeline`` with the view versions its jobs compute (:func:`deployed_pipeline`)."""
    return deployed_pipeline(pipeline, read_meta(session, keyspace, pipeline.name).registry)
