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
    columns = table.source_columns
    return upsert_views(
        df.select(*columns), tables=[(table, {c: c for c in columns}, None)], cassandra=cassandra,
        batch_rows=batch_rows, concurrency=concurrency,
    )  # fmt: skip


def upsert_views(
    df: DataFrame,
    *,
    tables: list[tuple[TableDef, dict[str, str], str | None]],
    cassandra: CassandraSettings,
    batch_rows: int | None = None,
    concurrency: int = 16,
) -> int:
    """Upsert the rows of several views held in one DataFrame (absolute values), in one pass from
    the executors; returns rows written.

    Args:
        df: Rows of every view.
        tables: Per view, its table, per table column the column of ``df`` holding it, and a
            boolean column of ``df`` true in the view's rows (None: every row is one).
        cassandra: The cluster.
        batch_rows: Rows per unlogged batch (default ``cassandra.batch_rows``).
        concurrency: Requests in flight per task (default 16).
    """

    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow.compute as pc

        from lambdalake.cassandra.writer import upsert_arrow
        from lambdalake.procs import LIGHT_TASK_ROWS, release_freed_memory

        written = 0
        for batch in batches:
            for table, columns, selected in tables:
                mine = (
                    batch if selected is None else batch.filter(pc.fill_null(batch.column(selected), False))
                )
                if mine.num_rows:
                    names = table.source_columns
                    rows = pa.RecordBatch.from_arrays([mine.column(columns[c]) for c in names], names=names)
                    written += upsert_arrow(
                        rows, table=table, settings=cassandra, batch_rows=batch_rows, concurrency=concurrency
                    )
        if written <= LIGHT_TASK_ROWS:
            release_freed_memory()
        yield pa.RecordBatch.from_pydict({"rows": [written]})

    return sum(r["rows"] for r in df.mapInArrow(write, "rows long").collect())
