"""Delta tables through delta-rs: commits of Parquet files someone else wrote (Arrow on executors),
adopted where they lie (no copy), and every reader that runs without Spark.

The master dataset is committed this way: Python tasks write its files, and each commit
carries app transactions and a coverage record. The tables Spark writes itself (batch views, the
identity index) are delta-spark's (:mod:`lambdalake.spark.delta`); every table is read here too.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath
from typing import Literal, overload

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake import Field as DeltaField
from deltalake.exceptions import CommitFailedError, TableNotFoundError
from deltalake.transaction import AddAction
from pyarrow import fs as pafs

from lambdalake.master_files import NULL_PARTITION
from lambdalake.storage import list_files, read_text

#: Hive's name for the partition of a null value.


def open_table(uri: str, *, version: int | None = None) -> DeltaTable | None:
    """The table at ``uri``, or None when there is none yet.

    Any other storage error raises: an unreadable log or a denied path must not read as empty.
    delta-rs says "not found" for a denied path too, so only a location without a Delta log (or
    with a log folder and no commit in it, as a first commit killed early leaves) is "no table".
    """
    try:
        return DeltaTable(uri, version=version)
    except TableNotFoundError:
        if not list_files(f"{uri.rstrip('/')}/_delta_log", suffix=".json"):
            return None
        raise


def _integer_stats(metadata: pq.FileMetaData, columns: Sequence[str]) -> dict[str, dict[str, int]]:
    """Delta ``minValues``/``maxValues``/``nullCount`` of the integer ``columns`` of one file, from its
    row groups' statistics (a column some row group has no statistics for is left out: Delta stats
    may cover any subset of columns, and readers then scan the file)."""
    stats: dict[str, dict[str, int]] = {"minValues": {}, "maxValues": {}, "nullCount": {}}
    names = metadata.schema.names
    for name in columns:
        if name not in names or metadata.num_row_groups == 0:
            continue
        index = names.index(name)
        groups = [metadata.row_group(g).column(index).statistics for g in range(metadata.num_row_groups)]
        if any(g is None or not g.has_min_max or not isinstance(g.min, int) for g in groups):
            continue
        stats["minValues"][name] = min(g.min for g in groups)
        stats["maxValues"][name] = max(g.max for g in groups)
        stats["nullCount"][name] = sum(g.null_count for g in groups)
    return {k: v for k, v in stats.items() if v}


def add_actions(
    uri: str,
    files: Sequence[str],
    *,
    partition: tuple[str, pa.DataType] | None = None,
    stats_columns: Sequence[str] = (),
    data_change: bool = True,
) -> tuple[list[AddAction], pa.Schema | None, int]:
    """Add actions for ``files`` (paths relative to the table), the schema and the total rows.

    ``partition`` names the Hive-style partition column of the paths (``name=value/...``) and its type.
    ``stats_columns`` names integer columns whose min, max and null count go into each file's stats
    (readers skip files by them); every file's row count always does. ``data_change`` is False for
    files that hold rows already in the table (a compaction's).
    """
    filesystem, root = pafs.FileSystem.from_uri(uri)
    root = root.rstrip("/")
    actions, schema, total = [], None, 0
    now_ms = int(time.time() * 1000)
    for relative in files:
        target = f"{root}/{relative}"
        metadata = pq.read_metadata(target, filesystem=filesystem)
        if schema is None:
            schema = metadata.schema.to_arrow_schema()
            if partition is not None:
                schema = schema.append(pa.field(*partition))
        values = {}
        if partition is not None:
            value = relative.split("/", 1)[0].split("=", 1)[1]
            values = {partition[0]: None if value == NULL_PARTITION else value}
        total += metadata.num_rows
        stats = {"numRecords": metadata.num_rows, **_integer_stats(metadata, stats_columns)}
        actions.append(AddAction(
            path=relative, size=filesystem.get_file_info(target).size, partition_values=values,
            modification_time=now_ms, data_change=data_change, stats=json.dumps(stats),
        ))  # fmt: skip
    return actions, schema, total


@overload
def commit_files(
    uri: str,
    files: Sequence[str],
    *,
    mode: Literal["append", "overwrite"],
    metadata: Mapping[str, str],
    partition: tuple[str, pa.DataType] | None = ...,
    app_transactions: Sequence[tuple[str, int]] = ...,
    schema_guard: Sequence[tuple[str, int]] = ...,
    schema: pa.Schema | None = ...,
    stats_columns: Sequence[str] = ...,
    table: DeltaTable | None = ...,
    refresh: Literal[True] = ...,
) -> tuple[int, int]: ...
@overload
def commit_files(
    uri: str,
    files: Sequence[str],
    *,
    mode: Literal["append", "overwrite"],
    metadata: Mapping[str, str],
    partition: tuple[str, pa.DataType] | None = ...,
    app_transactions: Sequence[tuple[str, int]] = ...,
    schema_guard: Sequence[tuple[str, int]] = ...,
    schema: pa.Schema | None = ...,
    stats_columns: Sequence[str] = ...,
    table: DeltaTable | None = ...,
    refresh: Literal[False],
) -> tuple[None, int]: ...
def commit_files(
    uri: str,
    files: Sequence[str],
    *,
    mode: Literal["append", "overwrite"],
    metadata: Mapping[str, str],
    partition: tuple[str, pa.DataType] | None = None,
    app_transactions: Sequence[tuple[str, int]] = (),
    schema_guard: Sequence[tuple[str, int]] = (),
    schema: pa.Schema | None = None,
    stats_columns: Sequence[str] = (),
    table: DeltaTable | None = None,
    refresh: bool = True,
) -> tuple[int | None, int]:
    """Commit ``files`` in one Delta commit (creating the table if needed); returns (version, rows).

    Args:
        uri: The table.
        files: Parquet files below ``uri``, relative to it.
        mode: ``append``, or ``overwrite`` (the new files replace every live one, atomically).
        metadata: Commit metadata (kept in the table's history).
        partition: The partition column of the paths and its type, if any.
        app_transactions: ``(app_id, version)`` pairs recorded with the commit (exactly-once
            appends; two commits made on one snapshot with the same app id conflict).
        schema_guard: App transactions the commit adding new columns to the schema carries (see
            :func:`added_columns`): those a concurrent writer shares, so that its commit landing
            after ``table``'s snapshot fails this one instead of being rebased over.
        schema: The table schema when ``files`` is empty and there is no table yet.
        stats_columns: Integer columns whose min and max each file's stats record.
        table: The snapshot the caller decided on: the commit fails with a conflict if a commit
            since then recorded one of ``app_transactions``' ids (default: the newest snapshot).
        refresh: Bring ``table`` up to date after the commit and return the new version (default).
            False leaves ``table`` on the snapshot it was and returns no version: delta-rs rebuilds
            the table's file list to update it (~180 ms at 150k files), which a caller keeping the
            table can do when it suits it.
    """
    actions, found, rows = add_actions(uri, list(files), partition=partition, stats_columns=stats_columns)
    table = table if table is not None else open_table(uri)
    schema = found or schema
    if schema is None and table is not None:
        schema = table.schema()
    if schema is None:
        raise ValueError(f"no files to commit to {uri} and no schema given")
    partition_by = [partition[0]] if partition is not None else None
    if table is None:
        DeltaTable.create(
            uri, schema=schema, partition_by=partition_by, mode="ignore", name=PurePosixPath(uri).name
        )
        table = DeltaTable(uri)
    elif mode == "append" and found is not None:
        added_columns(table, found, guard=schema_guard)
    transactions = [Transaction(app_id=app, version=version) for app, version in app_transactions] or None
    table.create_write_transaction(
        actions,
        mode=mode,
        schema=schema,
        partition_by=partition_by,
        commit_properties=CommitProperties(app_transactions=transactions, custom_metadata=dict(metadata)),
    )
    if not refresh:
        return None, rows
    table.update_incremental()
    return table.version(), rows


def added_columns(table: DeltaTable, schema: pa.Schema, *, guard: Sequence[tuple[str, int]] = ()) -> None:
    """Add to ``table``'s schema the columns of ``schema`` it lacks (nullable: the files it holds
    have none of them), in one commit of their own before the files that first hold them. delta-rs
    leaves the schema of an appending commit as it was, so without this a Delta reader would never
    see a field that a newer reader schema added (the files hold it).

    The commit moves ``table`` to its own version: without ``guard`` a concurrent commit landing in
    between would be rebased over silently, and the caller's next commit would land on a decision
    made without it. With the app transactions that writer shares, that commit fails here instead.
    """
    known = {f.name for f in table.schema().fields}
    new = [f for f in schema if f.name not in known]
    if new:
        transactions = [Transaction(app_id=app, version=version) for app, version in guard] or None
        table.alter.add_columns(
            [DeltaField.from_arrow(f.with_nullable(True)) for f in new],
            commit_properties=CommitProperties(app_transactions=transactions),
        )


#: What delta-rs says when a commit lost to one that landed after its snapshot: another writer's
#: data, or its change of the table's metadata (a column added).
_CONFLICTS = ("Concurrent", "Metadata changed since last commit")


def lost_to_another_commit(exc: CommitFailedError) -> bool:
    """Whether ``exc`` is a conflict with a commit since the snapshot (decide again and retry)."""
    return any(marker in str(exc) for marker in _CONFLICTS)


def commit_info(uri: str, version: int) -> dict | None:
    """The commit information of one version, read from its log file (None: the file is gone).

    delta-rs's ``history()`` of a table loaded at an older version returns the *newest* commits,
    numbered down from the loaded version (measured with deltalake 1.6): a reader pinned to a version
    must read that version's commit itself.
    """
    text = read_text(f"{uri.rstrip('/')}/_delta_log/{version:020d}.json")
    if text is None:
        return None
    for line in text.splitlines():
        if line.startswith('{"commitInfo"'):
            return json.loads(line)["commitInfo"]
    return {}


def commit_metadata(entry: dict) -> dict:
    """A commit's information with the metadata its writer gave merged in: delta-rs writes it as keys
    of the commit (the master dataset, and views written before delta-spark), delta-spark as one JSON object
    in ``userMetadata`` (:mod:`lambdalake.spark.delta`)."""
    text = entry.get("userMetadata")
    if not text:
        return entry
    try:
        given = json.loads(text)
    except ValueError:
        return entry
    return {**entry, **given} if isinstance(given, dict) else entry
