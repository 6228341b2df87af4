"""Idempotent upserts of view rows, concurrent, retried through Cassandra outages.

Rows carry absolute values (never increments or counters), so writing a row twice leaves the same
table: a replayed micro-batch is harmless. ``latest`` rows are candidates clustered in the latest
rule's order (:mod:`lambdalake.latest`), so the winner is the first whatever order writes arrive in.
"""

from __future__ import annotations

import logging
import re
import struct
import time
from collections.abc import Iterable, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from cassandra import AuthenticationFailed, DriverException, InvalidRequest, Unauthorized
from cassandra.cluster import Session
from cassandra.concurrent import execute_concurrent
from cassandra.protocol import RequestValidationException
from cassandra.query import BatchStatement, BatchType, BoundStatement, PreparedStatement

from lambdalake.cassandra.encode import arrow_type, encode_rows, to_arrow
from lambdalake.cassandra.routing import lags_schema, table_known
from lambdalake.cassandra.session import connect, refresh_metadata
from lambdalake.cassandra.tables import TableDef
from lambdalake.errors import LambdalakeError
from lambdalake.latest import RANK
from lambdalake.settings import CassandraSettings

log = logging.getLogger("lambdalake.cassandra")

#: One row's values, encoded for the protocol.
Encoded = tuple[bytes | None, ...]

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


def bulk_options(settings: CassandraSettings) -> dict[str, int]:
    """``batch_rows`` and ``concurrency`` for bulk writes (a batch publish, a replay's rewrite of
    whole epochs), as opposed to the speed layer's small micro-batches: larger batches and fewer
    requests in flight (faster on few cores; docs/benchmarks-log.md)."""
    return {"batch_rows": settings.publish_batch_rows, "concurrency": 8}


#: How long a write Cassandra failed (a replica down, a timeout) is retried before the write fails:
#: long enough to ride out a node's restart, short enough that a lost cluster stops the job.
GIVE_UP_AFTER_S = 900.0


def upsert(
    rows: Iterable[Sequence[Any]],
    *,
    table: TableDef,
    settings: CassandraSettings,
    batch_rows: int | None = None,
    concurrency: int = 16,
    give_up_after_s: float = GIVE_UP_AFTER_S,
) -> int:
    """Write Python ``rows`` (values in ``table.column_names`` order); see :func:`upsert_arrow`.

    Args:
        rows: Row values; timestamps as datetimes or epoch milliseconds.
        table: Target table.
        settings: Cluster settings.
        batch_rows: Rows per unlogged batch (default ``settings.batch_rows``).
        concurrency: Requests (batches) in flight.
        give_up_after_s: How long failed writes are retried (default 15 minutes).
    """
    try:
        data = to_arrow(list(rows), table.columns)
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
        raise WriteRefused(table, exc) from exc
    return upsert_arrow(
        data, table=table, settings=settings,
        batch_rows=batch_rows, concurrency=concurrency, give_up_after_s=give_up_after_s,
    )  # fmt: skip


def upsert_arrow(
    data: pa.Table | pa.RecordBatch,
    *,
    table: TableDef,
    settings: CassandraSettings,
    batch_rows: int | None = None,
    concurrency: int = 16,
    give_up_after_s: float = GIVE_UP_AFTER_S,
) -> int:
    """Write the rows of ``data`` (at least ``table``'s columns) and return how many were written.

    Rows go in unlogged batches, sorted by partition key so a batch spans few partitions, with
    their values encoded a column at a time (:mod:`lambdalake.cassandra.encode`). Unlogged batches
    are not atomic, which is harmless here: every write is an idempotent upsert, and a failed batch
    is sent again whole.

    Args:
        data: The rows; timestamps as Arrow timestamps.
        table: Target table.
        settings: Cluster settings.
        batch_rows: Rows per unlogged batch (default ``settings.batch_rows``). A batch the cluster
            refuses as too large is split in halves and sent again.
        concurrency: Requests (batches) in flight.
        give_up_after_s: Keep retrying failed writes (e.g. Cassandra restarting) this long, then
            raise so the micro-batch fails and is retried from the checkpoint. Default 15 minutes.
    """
    if data.num_rows == 0:
        return 0
    if isinstance(data, pa.RecordBatch):
        data = pa.Table.from_batches([data])
    data = _stored_columns(data, table)
    if table.ranked and RANK not in data.column_names:
        raise ValueError(f"{table.name} holds ranked candidates: each row needs its rank ({RANK})")
    order = pc.sort_indices(data, sort_keys=[(k, "ascending") for k in table.partition_key])
    data = data.take(order)
    try:
        params = encode_rows(data, table.columns)
    except (pa.ArrowException, KeyError) as exc:
        raise WriteRefused(table, exc) from exc
    size = batch_rows or settings.batch_rows
    groups = [params[i : i + size] for i in range(0, len(params), size)]
    for start in range(0, len(groups), CHUNK):
        _write_groups(groups[start : start + CHUNK], table, settings, concurrency, give_up_after_s)
    return len(params)


def _stored_columns(data: pa.Table, table: TableDef) -> pa.Table:
    """``data`` with each stored field (:class:`lambdalake.cassandra.tables.StoredField`) in the
    column of its current type and a null in the columns of the types it had before."""
    for s in table.stored:
        if s.field not in data.column_names or all(c in data.column_names for c, _ in s.columns):
            continue  # not written, or in the table's own shape already
        values = data.column(s.field)
        data = data.drop_columns([s.field])
        for column, cql in s.columns:
            if column == s.current:
                data = data.append_column(column, values)
            else:
                data = data.append_column(column, pa.nulls(data.num_rows, type=arrow_type(cql)))
    return data


def _request(
    stmt: PreparedStatement, group: list[Encoded], lower: tuple[PreparedStatement, list[int]] | None = None
) -> BoundStatement | BatchStatement:
    """One request for ``group``'s rows, whose values are already encoded (never bound again).
    ``lower``: for a ranked table, the delete of lower candidates and where its values are in a row."""
    bound = BoundStatement(stmt)
    bound.values = list(group[0])
    if len(group) == 1 and lower is None:
        return bound
    batch = BatchStatement(batch_type=BatchType.UNLOGGED)
    batch.add(bound)  # sets the batch's routing key and keyspace from the first row
    # The driver has no public way to add rows it need not bind: its add() appends exactly this
    # (prepared?, query id, encoded values) for a bound statement, which would cost one per row.
    # cassandra-driver is pinned below 4; every writer test reads rows written this way back.
    batch._statements_and_parameters.extend((True, stmt.query_id, values) for values in group[1:])
    if lower is not None:
        delete, at = lower
        batch._statements_and_parameters.extend(
            (True, delete.query_id, [values[i] for i in at]) for values in group
        )
    return batch


def _write_groups(
    groups: list[list[Encoded]],
    table: TableDef,
    settings: CassandraSettings,
    concurrency: int,
    give_up_after_s: float,
) -> None:
    deadline = time.monotonic() + give_up_after_s
    pending = groups
    delay = 0.5
    while True:
        try:
            session = connect(settings)
            stmt = _prepare(session, table.insert_cql(settings.keyspace))
            lower = None
            if table.ranked:
                lower = (_prepare(session, table.delete_lower_cql(settings.keyspace)), table.delete_lower_at)
            results = execute_concurrent(
                session,
                [(_request(stmt, g, lower), None) for g in pending],
                concurrency=concurrency,
                raise_on_first_error=False,
            )
            failed = [g for g, (ok, _) in zip(pending, results, strict=True) if not ok]
            errors = [res for ok, res in results if not ok]
        except Exception as exc:  # no host available, session failures: retry below
            failed, errors = pending, [exc]
        if not failed:
            return
        # Whether the cluster has the table is asked once for all the errors (a refresh may wait).
        lagging = [e for e in errors if lags_schema(e, {table.name})]
        if lagging and not _cluster_has(settings, table.name):
            lagging = []
        refused = next((e for e in errors if isinstance(e, PERMANENT) and e not in lagging), None)
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
        if lagging and len(lagging) == len(errors):
            # Not a failed write: a node back from an outage before it pulled this table's schema.
            log.info("%d write batches to %s met a coordinator that has not seen the table yet; sending "
                     "them again (that node is tried last)", len(failed), table.name)  # fmt: skip
            time.sleep(0.2)
            pending = failed
            continue
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


def _cluster_has(settings: CassandraSettings, table: str) -> bool:
    """Whether the cluster has ``table`` by the driver's schema (read again when it lacks it): then
    a coordinator saying it does not exist lags the schema, and the write is not refused."""
    session = connect(settings)
    if table_known(session, settings.keyspace, table):
        return True
    try:
        refresh_metadata(session, settings.keyspace, table, wait_s=5)
    except DriverException:
        return False  # the cluster has no such table: the request's error
    return True


def cassandra_values(table: pa.Table | pa.RecordBatch, columns: list[str]) -> list[list[Any]]:
    """Column values as the Cassandra driver takes them (timestamps as epoch milliseconds)."""
    out = []
    for name in columns:
        col = table.column(name)
        if pa.types.is_timestamp(col.type):
            col = pc.divide(pc.cast(pc.cast(col, pa.timestamp("us")), pa.int64()), 1000)
        out.append(col.to_pylist())
    return out
