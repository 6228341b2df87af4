"""Adopting the speed rows of a ``latest`` view's tables of earlier layouts.

Two layouts came before the candidates of :mod:`lambdalake.latest`
(:func:`lambdalake.views.legacy_latest_tables`):

- one row per key, its 64-bit rank the write timestamp (``__speed``);
- candidates clustered by a 64-bit rank (``__speed_ranked``, :data:`lambdalake.latest.LEGACY_RANK`).

Cassandra cannot change a primary key or a column's type, so today's table has a name of its own and
the old rows are copied into it, their ranks converted exactly (:func:`lambdalake.latest.from_legacy_rank`).
Rows of the first layout carry no Kafka coordinates: they get partition and offset -1, so among
candidates of one rank the copy stays first.
"""

from __future__ import annotations

from typing import Any

from cassandra.cluster import Session

from lambdalake.cassandra.tables import speed_table_def
from lambdalake.cassandra.writer import upsert
from lambdalake.latest import (
    CANDIDATE,
    LEGACY_RANK,
    OFFSET,
    PARTITION,
    RANK,
    from_legacy_rank,
    timestamp_version,
)
from lambdalake.pipeline import LatestView, Pipeline
from lambdalake.settings import CassandraSettings
from lambdalake.views import legacy_latest_tables

#: The ingest time column, written with the rank as timestamp like every cell of the first layout's rows.
_RANKED = "_ingest_ts"


def adopt_legacy_latest(
    session: Session, settings: CassandraSettings, pipeline: Pipeline, *, drop: bool
) -> dict[str, int]:
    """Copy each ``latest`` view's rows of its earlier layouts' speed tables into today's table.

    Idempotent: a row copied twice is the same candidate. Call it after today's tables exist.

    Args:
        session: A session of the cluster.
        settings: The cluster's settings (the keyspace).
        pipeline: The pipeline whose views to look at.
        drop: Drop an old table once copied: only where no writer of the old layout can still
            write it (the speed job holding its lease, a speed reset).

    Returns:
        Rows copied per old table.
    """
    keyspace = session.cluster.metadata.keyspaces.get(settings.keyspace)
    if keyspace is None:
        return {}
    copied = {}
    for view in pipeline.views:
        if not isinstance(view, LatestView):
            continue
        table = speed_table_def(pipeline, view)
        in_ms = timestamp_version(pipeline, view)
        for name in legacy_latest_tables(pipeline, view):
            meta = keyspace.tables.get(name)
            if meta is None:
                continue
            candidates = LEGACY_RANK in meta.columns
            have = [c for c in table.column_names if c in meta.columns and c not in CANDIDATE]
            have += [PARTITION, OFFSET, LEGACY_RANK] if candidates else [f'WRITETIME("{_RANKED}")']
            cols = ", ".join(c if c.startswith("WRITETIME") else f'"{c}"' for c in have)
            rows: list[list[Any]] = []
            for found in session.execute(f'SELECT {cols} FROM "{settings.keyspace}"."{name}"', timeout=120):
                values = dict(zip(have, found, strict=True))
                old = found[-1]
                values[RANK] = from_legacy_rank(old, timestamp_version=in_ms)
                if not candidates:
                    values.update(dict.fromkeys(CANDIDATE[1:], -1))
                rows.append([values.get(c) for c in table.column_names])
            upsert(rows, table=table, settings=settings)
            copied[name] = len(rows)
            if drop:
                session.execute(f'DROP TABLE IF EXISTS "{settings.keyspace}"."{name}"', timeout=120)
    return copied
