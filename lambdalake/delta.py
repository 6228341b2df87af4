"""Delta tables whose Parquet files someone else wrote (Arrow on executors, Spark), committed with
delta-rs: no Delta JARs are needed, and a commit adopts the files where they lie (no copy).

Shared by the master dataset (appends, one app transaction per micro-batch) and the batch views
(one overwrite per rebuild, so history and time travel work).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath
from typing import Literal

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.exceptions import TableNotFoundError
from deltalake.transaction import AddAction
from pyarrow import fs as pafs

from lambdalake.storage import list_files

#: Hive's name for the partition of a null value.
NULL_PARTITION = "__HIVE_DEFAULT_PARTITION__"


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


def add_actions(
    uri: str, files: Sequence[str], *, partition: tuple[str, pa.DataType] | None = None
) -> tuple[list[AddAction], pa.Schema | None, int]:
    """Add actions for ``files`` (paths relative to the table), the schema and the total rows.

    ``partition`` names the Hive-style partition column of the paths (``name=value/...``) and its type.
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
        actions.append(AddAction(
            path=relative, size=filesystem.get_file_info(target).size, partition_values=values,
            modification_time=now_ms, data_change=True, stats=json.dumps({"numRecords": metadata.num_rows}),
        ))  # fmt: skip
    return actions, schema, total


def commit_files(
    uri: str,
    files: Sequence[str],
    *,
    mode: Literal["append", "overwrite"],
    metadata: Mapping[str, str],
    partition: tuple[str, pa.DataType] | None = None,
    app_transaction: tuple[str, int] | None = None,
    schema: pa.Schema | None = None,
) -> tuple[int, int]:
    """Commit ``files`` in one Delta commit (creating the table if needed); returns (version, rows).

    Args:
        uri: The table.
        files: Parquet files below ``uri``, relative to it.
        mode: ``append``, or ``overwrite`` (the new files replace every live one, atomically).
        metadata: Commit metadata (kept in the table's history).
        partition: The partition column of the paths and its type, if any.
        app_transaction: ``(app_id, version)`` recorded with the commit (exactly-once appends).
        schema: The table schema when ``files`` is empty (an overwrite to no rows).
    """
    actions, found, rows = add_actions(uri, list(files), partition=partition)
    schema = found or schema
    if schema is None:
        raise ValueError(f"no files to commit to {uri} and no schema given")
    partition_by = [partition[0]] if partition is not None else None
    table = open_table(uri)
    if table is None:
        DeltaTable.create(
            uri, schema=schema, partition_by=partition_by, mode="ignore", name=PurePosixPath(uri).name
        )
        table = DeltaTable(uri)
    transactions = (
        [Transaction(app_id=app_transaction[0], version=app_transaction[1])] if app_transaction else None
    )
    table.create_write_transaction(
        actions,
        mode=mode,
        schema=schema,
        partition_by=partition_by,
        commit_properties=CommitProperties(app_transactions=transactions, custom_metadata=dict(metadata)),
    )
    table.update_incremental()
    return table.version(), rows
