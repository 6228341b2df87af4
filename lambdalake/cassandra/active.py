"""The active batch version of a pipeline: the one metadata row the batch layer's publish switches
and serving reads (both depend on this module, neither on the other)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from cassandra import ConsistencyLevel
from cassandra.cluster import Session
from cassandra.query import SimpleStatement

from lambdalake.cassandra.tables import BATCH_META


@dataclass(frozen=True)
class ActiveBatch:
    """What serving reads: the active version, its horizon epoch and the epoch length.

    Attributes:
        version: The batch version whose tables (``<pipeline>__<view>__b<version>``) serving reads.
        horizon: The newest ingest epoch the version covers (epochs are ``ingest ms // epoch_ms``).
        epoch_ms: The epoch length the version was computed with.
        bronze_version: The master dataset's Delta version the run read.
        views: Each view's Delta version that was published.
        published_at_ms: When the version became active (epoch ms; 0 if unknown).
    """

    version: int
    horizon: int
    epoch_ms: int
    bronze_version: int
    views: dict[str, int]
    published_at_ms: int = 0


def active_batch(session: Session, keyspace: str, pipeline: str) -> ActiveBatch | None:
    """The pipeline's active batch version (None before the first publish)."""
    # QUORUM: the pointer is switched by a lightweight transaction whose commit is acknowledged by
    # a quorum, so a quorum read sees the newest switch on a cluster with replication factor 3.
    query = SimpleStatement(
        f'SELECT * FROM "{keyspace}"."{BATCH_META.name}" WHERE pipeline = %s',
        consistency_level=ConsistencyLevel.QUORUM,
    )
    try:
        row = session.execute(query, [pipeline]).one()
    except Exception as exc:  # no metadata table yet: nothing published
        if "unconfigured" in str(exc).lower() or "does not exist" in str(exc).lower():
            return None
        raise
    if row is None:
        return None
    published = row.published_at
    return ActiveBatch(
        row.version, row.horizon, row.epoch_ms, row.bronze_version, json.loads(row.views),
        int(published.timestamp() * 1000) if published is not None else 0,
    )  # fmt: skip
