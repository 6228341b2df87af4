"""Idempotent upserts of view rows, concurrent, retried through Cassandra outages.

Rows carry absolute values (never increments or counters), so writing a row twice leaves the same
table: a replayed micro-batch is harmless. ``latest`` rows are written ``USING TIMESTAMP`` derived
from the event version, so the highest version wins whatever order writes arrive in.
"""

from __future__ import annotations

import logging
import re
import struct
import time
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from cassandra import AuthenticationFailed, InvalidRequest, Unauthorized
from cassandra.cluster import Session
from cassandra.concurrent import execute_concurrent
from cassandra.protocol import RequestValidationException
from cassandra.query import BatchStatement, BatchType, PreparedStatement

from lambdalake.cassandra.session import connect
from lambdalake.cassandra.tables import TableDef
from lambdalake.errors import LambdalakeError
from lambdalake.settings import CassandraSettings

log = logging.getLogger("lambdalake.cassandra")

#: Batches handed to the driver at once (bounds its memory, not the rows per call).
CHUNK = 500

#: Errors that retrying cannot fix: the request itself is wrong (a column the table lacks after a
#: schema change, a value of the wrong type, no permission). Timeouts and unavailability are retried.
PERMANENT = (
    InvalidRequest, Unauthorized, AuthenticationFailed, RequestValidationException,
    TypeError, ValueError, KeyError, struct.error,
)  # fmt: skip


class WriteRefused(LambdalakeError):
    """Cassandra refused a write for a reason retrying cannot fix."""

    def __init__(self, table: TableDef, error: BaseException) -> None:
        text = str(error)
        column = re.search(r"(?:Unknown identifier|Undefined column name|column) \"?(\w+)", text)
        where = f" (column {column.group(1)!r})" if column else ""
        super().__init__(
            f"Cassandra refused writes to {table.name}{where}: {type(error).__name__}: {text}",
            fix="if the pipeline's schema gained a field, run `lambdalake deploy <pipeline>` to add the "
            "new columns to the view tables, then restart the job; a wrong value type means the table "
            "was created by another version of the pipeline (compare it with `lambdalake pipelines`)",
        )


# Preparing is a round trip to the server: once per process, session and statement.
_prepared: dict[tuple[int, str], PreparedStatement] = {}


def _prepare(session: Session, cql: str) -> PreparedStatement:
    key = (id(session), cql)
    if key not in _prepared:
        _prepared[key] = session.prepare(cql)
    return _prepared[key]


def upsert(
    rows: Iterable[Sequence[Any]],
    *,
    table: TableDef,
    settings: CassandraSettings,
    write_timestamp_index: int | None = None,
    batch_rows: int | None = None,
    concurrency: int = 16,
    give_up_after_s: float = 900.0,
) -> int:
    """Write ``rows`` (values in ``table.column_names`` order) and return how many were written.

    Rows go in unlogged batches of ``settings.batch_rows``, sorted by partition key so a batch spans
    few partitions. Unlogged batches are not atomic, which is harmless here: every write is an
    idempotent upsert, and a failed batch is sent again whole.

    Args:
        rows: Row values; timestamps as datetimes or epoch milliseconds.
        table: Target table.
        settings: Cluster settings.
        write_timestamp_index: Position in each row of the value to use as the write timestamp
            (``USING TIMESTAMP``); the value itself is not a column.
        batch_rows: Rows per unlogged batch (default ``settings.batch_rows``). A batch the cluster
            refuses as too large is split in halves and sent again.
        concurrency: Requests (batches) in flight.
        give_up_after_s: Keep retrying failed writes (e.g. Cassandra restarting) this long, then
            raise so the micro-batch fails and is retried from the checkpoint. Default 15 minutes.
    """
    params = [_params(row, write_timestamp_index) for row in rows]
    if not params:
        return 0
    key = [table.column_names.index(c) for c in table.partition_key]
    params.sort(key=lambda p: tuple(_sortable(p[i]) for i in key))
    size = batch_rows or settings.batch_rows
    groups = [params[i : i + size] for i in range(0, len(params), size)]
    for start in range(0, len(groups), CHUNK):
        _write_groups(
            groups[start : start + CHUNK],
            table,
            settings,
            write_timestamp_index is not None,
            concurrency,
            give_up_after_s,
        )
    return len(params)


def _sortable(value: Any) -> tuple[bool, Any]:
    return (value is None, "" if value is None else value)


def _params(row: Sequence[Any], ts_index: int | None) -> tuple[Any, ...]:
    values = list(row)
    if ts_index is not None:
        ts = values.pop(ts_index)
        values.append(int(ts.timestamp() * 1000) if isinstance(ts, datetime) else int(ts))
    return tuple(values)


def _request(stmt: PreparedStatement, group: list[tuple[Any, ...]]) -> tuple[Any, tuple[Any, ...]]:
    if len(group) == 1:
        return stmt, group[0]
    batch = BatchStatement(batch_type=BatchType.UNLOGGED)
    for values in group:
        batch.add(stmt, values)
    return batch, ()


def _write_groups(
    groups: list[list[tuple[Any, ...]]],
    table: TableDef,
    settings: CassandraSettings,
    with_timestamp: bool,
    concurrency: int,
    give_up_after_s: float,
) -> None:
    deadline = time.monotonic() + give_up_after_s
    pending = groups
    delay = 0.5
    while True:
        try:
            session = connect(settings)
            stmt = _prepare(session, table.insert_cql(settings.keyspace, with_timestamp=with_timestamp))
            results = execute_concurrent(
                session,
                [_request(stmt, g) for g in pending],
                concurrency=concurrency,
                raise_on_first_error=False,
            )
            failed = [g for g, (ok, _) in zip(pending, results, strict=True) if not ok]
            errors = [res for ok, res in results if not ok]
        except Exception as exc:  # no host available, session failures: retry below
            failed, errors = pending, [exc]
        if not failed:
            return
        refused = next((e for e in errors if isinstance(e, PERMANENT)), None)
        if refused is not None and "too large" in str(refused).lower() and any(len(g) > 1 for g in failed):
            # Over the cluster's batch_size_fail_threshold: the same rows in smaller batches.
            log.warning("batches to %s too large for the cluster; halving them", table.name)
            pending = [
                half for g in failed for half in (g[: (len(g) + 1) // 2], g[(len(g) + 1) // 2 :]) if half
            ]
            continue
        if refused is not None:
            raise WriteRefused(table, refused)
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{sum(map(len, failed))} writes to {table.name} still failing after "
                f"{give_up_after_s:.0f}s: {errors[0]!r}"
            )
        log.warning(
            "%d of %d write batches to %s failed (%r); retrying in %.1fs",
            len(failed),
            len(pending),
            table.name,
            errors[0],
            delay,
        )
        time.sleep(delay)
        delay = min(delay * 2, 10.0)
        pending = failed


def _halves(group: list[tuple[Any, ...]]) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    middle = (len(group) + 1) // 2
    return group[:middle], group[middle:]


def cassandra_values(table: pa.Table | pa.RecordBatch, columns: list[str]) -> list[list[Any]]:
    """Column values as the Cassandra driver takes them (timestamps as epoch milliseconds)."""
    out = []
    for name in columns:
        col = table.column(name)
        if pa.types.is_timestamp(col.type):
            col = pc.divide(pc.cast(pc.cast(col, pa.timestamp("us")), pa.int64()), 1000)
        out.append(col.to_pylist())
    return out
