"""Writing Spark DataFrames to Cassandra view tables from the executors (speed and batch layers)."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
from pyspark.sql import DataFrame

from lambdalake.cassandra.tables import TableDef
from lambdalake.settings import CassandraSettings


def upsert_view(
    df: DataFrame,
    *,
    table: TableDef,
    cassandra: CassandraSettings,
    batch_rows: int | None = None,
    concurrency: int = 16,
) -> int:
    """Upsert ``df``'s rows (absolute values) into ``table`` from the executors; returns rows written.

    Args:
        df: Rows with (at least) the table's columns.
        table: The target table.
        cassandra: The cluster.
        batch_rows: Rows per unlogged batch (default ``cassandra.batch_rows``).
        concurrency: Requests in flight per task (default 16).
    """

    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from lambdalake.cassandra.writer import upsert_arrow
        from lambdalake.procs import LIGHT_TASK_ROWS, release_freed_memory

        written = 0
        for batch in batches:
            written += upsert_arrow(
                batch, table=table, settings=cassandra, batch_rows=batch_rows, concurrency=concurrency
            )
        if written <= LIGHT_TASK_ROWS:
            release_freed_memory()
        yield pa.RecordBatch.from_pydict({"rows": [written]})

    return sum(r["rows"] for r in df.select(*table.source_columns).mapInArrow(write, "rows long").collect())
