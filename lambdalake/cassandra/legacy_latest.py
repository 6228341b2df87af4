"""Adopting the speed rows of a ``latest`` table of the layout before ranked candidates.

That table (:func:`lambdalake.views.legacy_latest_table`) kept one row per key, its rank the write
timestamp; Cassandra cannot change a primary key, so the ranked table has a name of its own and the
old rows are copied into it, ranked by their write timestamp. They carry no Kafka coordinates: they
get partition and offset -1, so among candidates of one rank the copy (written first) stays first.
"""

from __future__ import annotations

from cassandra.cluster import Session

from lambdalake.cassandra.tables import speed_table_def
from lambdalake.cassandra.writer import upsert
from lambdalake.pipeline import LatestView, Pipeline
from lambdalake.settings import CassandraSettings
from lambdalake.views import CANDIDATE, RANK, legacy_latest_table

#: The ingest time column, written with the rank as timestamp like every cell of the old rows.
_RANKED = "_ingest_ts"


def adopt_legacy_latest(
    session: Session, settings: CassandraSettings, pipeline: Pipeline, *, drop: bool
) -> dict[str, int]:
    """Copy each ``latest`` view's rows of an old-layout speed table into its ranked table.

    Idempotent: a row copied twice is the same candidate. Call it after the ranked tables exist.

    Args:
        session: A session of the cluster.
        settings: The cluster's settings (the keyspace).
        pipeline: The pipeline whose views to look at.
        drop: Drop the old table once copied: only where no writer of the old layout can still
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
        name = legacy_latest_table(pipeline, view)
        meta = keyspace.tables.get(name)
        if meta is None or RANK in meta.columns:
            continue
        table = speed_table_def(pipeline, view)
        have = [c for c in table.column_names if c in meta.columns and c not in CANDIDATE]
        cols = ", ".join(f'"{c}"' for c in have)
        cql = f'SELECT {cols}, WRITETIME("{_RANKED}") FROM "{settings.keyspace}"."{name}"'
        rows = []
        for found in session.execute(cql, timeout=120):
            values = dict(zip(have, found, strict=False))
            rank = found[-1]
            values.update({RANK: rank, **dict.fromkeys(CANDIDATE[1:], -1)})
            rows.append([*(values.get(c) for c in table.column_names), rank])
        upsert(rows, table=table, settings=settings, write_timestamp_index=len(table.column_names))
        copied[name] = len(rows)
        if drop:
            session.execute(f'DROP TABLE IF EXISTS "{settings.keyspace}"."{name}"', timeout=120)
    return copied
