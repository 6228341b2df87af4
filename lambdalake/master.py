"""The immutable master dataset: one append-only Delta table of every decoded event per pipeline.

Spark writes the Parquet files (on executors, to any filesystem Spark and Arrow can reach); delta-rs
commits them. Each commit carries a Delta app transaction ``(app_id, batch_id)``, so a micro-batch
that is replayed after a crash, but was already committed, is skipped: every event lands exactly once.
Files of an attempt that crashed before its commit are not in the log, so readers never see them.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from pathlib import PurePosixPath

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.transaction import AddAction
from pyarrow import fs as pafs
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

PARTITION = "event_date"

log = logging.getLogger("lambdalake.master")


def table_path(storage_root: str, pipeline: str) -> str:
    return f"{storage_root.rstrip('/')}/master/{pipeline}"


class MasterDataset:
    """The Delta table of one pipeline's events (bronze), partitioned by event date.

    Delivery guarantee: exactly once per ``(app_id, batch_id)``: :meth:`append` commits a batch at
    most once, and a batch whose commit failed is retried by the caller (the stream's replay).

    Args:
        path: Table location (a local path or an object-store URI).
        event_time: The event-time column the table is partitioned by (as its UTC date).
    """

    def __init__(self, path: str, *, event_time: str) -> None:
        self.path = path
        self.event_time = event_time

    def _table(self) -> DeltaTable | None:
        try:
            return DeltaTable(self.path)
        except Exception:  # TableNotFoundError in recent versions; the type moved between releases
            return None

    def append(self, df: DataFrame, *, app_id: str, batch_id: int) -> int | None:
        """Append a micro-batch unless ``app_id`` already committed ``batch_id``. Returns rows added."""
        table = self._table()
        last = None if table is None else table.transaction_version(app_id)
        if last is not None and last >= batch_id:
            return None
        staging = f"_spark/{batch_id:012d}-{uuid.uuid4().hex[:8]}"
        out = df.withColumn(PARTITION, F.to_date(F.col(self.event_time)))
        t0 = time.monotonic()
        out.write.partitionBy(PARTITION).parquet(f"{self.path.rstrip('/')}/{staging}")
        t1 = time.monotonic()
        actions, schema, rows = self._add_actions(staging)
        log.debug("master append: spark write %.2fs, list %.2fs", t1 - t0, time.monotonic() - t1)
        if not actions:
            return 0
        if table is None:
            DeltaTable.create(
                self.path,
                schema=schema,
                partition_by=[PARTITION],
                mode="ignore",
                name=PurePosixPath(self.path).name,
            )
            table = DeltaTable(self.path)
        table.create_write_transaction(
            actions,
            mode="append",
            schema=schema,
            partition_by=[PARTITION],
            commit_properties=CommitProperties(
                app_transactions=[Transaction(app_id=app_id, version=batch_id)],
                custom_metadata={"lambdalake.batch_id": batch_id, "lambdalake.app_id": app_id},
            ),
        )
        return rows

    def _add_actions(self, staging: str) -> tuple[list[AddAction], pa.Schema, int]:
        filesystem, root = pafs.FileSystem.from_uri(self.path)
        selector = pafs.FileSelector(f"{root.rstrip('/')}/{staging}", recursive=True, allow_not_found=True)
        infos = [
            i for i in filesystem.get_file_info(selector) if i.is_file and i.base_name.endswith(".parquet")
        ]
        actions, schema, total = [], None, 0
        now_ms = int(time.time() * 1000)
        for info in sorted(infos, key=lambda i: i.path):
            relative = info.path[len(root.rstrip("/")) + 1 :]
            partition = next(p.split("=", 1)[1] for p in relative.split("/") if p.startswith(f"{PARTITION}="))
            metadata = pq.read_metadata(info.path, filesystem=filesystem)
            if schema is None:
                schema = metadata.schema.to_arrow_schema().append(pa.field(PARTITION, pa.date32()))
            total += metadata.num_rows
            actions.append(AddAction(
                path=relative, size=info.size, partition_values={PARTITION: partition},
                modification_time=now_ms, data_change=True,
                stats=json.dumps({"numRecords": metadata.num_rows}),
            ))  # fmt: skip
        return actions, schema, total  # type: ignore[return-value]

    def read(self) -> pa.Table:
        """The whole table as Arrow (tests and small tables; Spark reads :meth:`file_uris`)."""
        table = self._table()
        if table is None:
            raise FileNotFoundError(f"no Delta table at {self.path}")
        return table.to_pyarrow_table()

    def file_uris(self) -> list[str]:
        """The live files (never the bare folder: it also holds removed and uncommitted files)."""
        table = self._table()
        return [] if table is None else table.file_uris()
