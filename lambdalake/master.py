"""The immutable master dataset: one append-only Delta table of every decoded event per pipeline.

Executors write Parquet files with Arrow (:func:`write_event_files`, to any filesystem Arrow reaches)
under names derived from the Kafka records they hold; the driver commits them with delta-rs
(:meth:`MasterDataset.commit`). Each commit carries a Delta app transaction ``(app_id, batch_id)``, so
a micro-batch that is replayed after a crash, but was already committed, is skipped: every event lands
exactly once. Files of an attempt that crashed before its commit are not in the log, so readers never
see them, and the replay writes the same names again.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq
from deltalake import DeltaTable
from pyarrow import fs as pafs

from lambdalake.delta import NULL_PARTITION, commit_files, open_table
from lambdalake.errors import ConfigurationError
from lambdalake.pipeline import LayersSpec
from lambdalake.storage import delete_file, list_files

PARTITION = "event_date"
#: Commit metadata keys: what the views depend on, and how far each partition was read.
EPOCH_MS = "lambdalake.epoch_ms"
DEDUP_DELAY_MS = "lambdalake.dedup_delay_ms"
PARTITIONS = "lambdalake.partitions"
#: An event's Kafka coordinates in its topic; each file's stats record their range.
COORDINATES = ("_partition", "_offset")

log = logging.getLogger("lambdalake.master")


def recorded_values(layers: LayersSpec) -> dict[str, int]:
    """What each bronze commit records of the layers (and :meth:`MasterDataset.check_layers` compares)."""
    return {EPOCH_MS: layers.epoch_ms, DEDUP_DELAY_MS: layers.dedup_delay_seconds * 1000}


def table_path(storage_root: str, pipeline: str) -> str:
    return f"{storage_root.rstrip('/')}/master/{pipeline}"


def write_event_files(events: pa.Table, *, path: str, event_time: str, name: str) -> list[str]:
    """Write ``events`` as one Parquet file per event date; return their paths relative to ``path``.

    Runs on executors. ``name`` must be unique to the records (e.g. their Kafka coordinates): a file
    that already exists under that name holds the same records (an earlier attempt of the same
    micro-batch) and is left as it is, so a committed file is never rewritten. Each file appears
    whole or not at all (written aside, then moved into place).
    """
    if events.num_rows == 0:
        return []
    filesystem, root = pafs.FileSystem.from_uri(path)
    root = root.rstrip("/")
    dates = pc.cast(pc.cast(events.column(event_time), pa.timestamp("us", tz="UTC")), pa.date32())
    filesystem.create_dir(f"{root}/_staging", recursive=True)
    written = []
    for date in pc.unique(dates).to_pylist():
        value = NULL_PARTITION if date is None else date.isoformat()
        relative = f"{PARTITION}={value}/{name}.parquet"
        target = f"{root}/{relative}"
        written.append(relative)
        if filesystem.get_file_info(target).type != pafs.FileType.NotFound:
            continue
        rows = events.filter(pc.is_null(dates) if date is None else pc.equal(dates, pa.scalar(date)))
        filesystem.create_dir(target.rsplit("/", 1)[0], recursive=True)
        # Named after the file (so the run id leads) to let the run's next start clear what a killed
        # attempt left half-written: see MasterDataset.clear_staging.
        staging = f"{root}/_staging/{name}.{value}.{uuid.uuid4().hex}.parquet"
        pq.write_table(rows, staging, filesystem=filesystem, compression="snappy")
        filesystem.move(staging, target)
    return written


def offsets_present(uris: Sequence[str], *, partition: int, start: int, end: int) -> pa.Array:
    """The offsets ``[start, end)`` of ``partition`` that the files ``uris`` hold (runs on executors;
    only the two coordinate columns are read)."""
    if not uris:
        return pa.array([], pa.int64())
    filesystem, _ = pafs.FileSystem.from_uri(uris[0])
    paths = [pafs.FileSystem.from_uri(u)[1] for u in uris]
    offset = pc.field("_offset")
    wanted = (pc.field("_partition") == partition) & (offset >= start) & (offset < end)
    found = pads.dataset(paths, format="parquet", filesystem=filesystem).to_table(
        columns=["_offset"], filter=wanted
    )
    return found.column("_offset").combine_chunks().cast(pa.int64())


class MasterDataset:
    """The Delta table of one pipeline's events (bronze), partitioned by event date.

    Delivery guarantee: exactly once per ``(app_id, batch_id)``: :meth:`commit` commits a batch at
    most once, and a batch whose commit failed is retried by the caller (the stream's replay).

    Args:
        path: Table location (a local path or an object-store URI).
        event_time: The event-time column the table is partitioned by (as its UTC date).
    """

    def __init__(self, path: str, *, event_time: str) -> None:
        self.path = path
        self.event_time = event_time

    def _table(self) -> DeltaTable | None:
        return open_table(self.path)

    def commit(
        self,
        files: Iterable[str],
        *,
        app_id: str,
        batch_id: int,
        layers: LayersSpec,
        partitions: Mapping[str, list[int]] | None = None,
    ) -> int | None:
        """Add ``files`` (relative paths written by :func:`write_event_files`) in one commit, unless
        ``app_id`` already committed ``batch_id``. Returns the rows added, or None if skipped.

        The commit records what the views depend on (the epoch length and dedup delay, see
        :meth:`check_layers`) and, per ``"topic/partition"``, the highest offset read and ingest time
        (ms) of the batch (``partitions``), for the batch layer's horizon."""
        table = self._table()
        last = None if table is None else table.transaction_version(app_id)
        if last is not None and last >= batch_id:
            return None
        t0 = time.monotonic()
        files = sorted(set(files))
        if not files:
            return 0
        _version, rows = commit_files(
            self.path, files, mode="append", partition=(PARTITION, pa.date32()),
            app_transaction=(app_id, batch_id), stats_columns=COORDINATES,
            metadata={
                "lambdalake.batch_id": str(batch_id),
                "lambdalake.app_id": app_id,
                **{k: str(v) for k, v in recorded_values(layers).items()},
                PARTITIONS: json.dumps(dict(partitions or {}), sort_keys=True),
            },
        )  # fmt: skip
        log.debug("master commit of %d files: %.2fs", len(files), time.monotonic() - t0)
        return rows

    def recorded_layers(self) -> dict[str, int] | None:
        """The epoch length and dedup delay (ms) the newest commit recorded (None: no table, or a table
        written before they were recorded)."""
        table = self._table()
        if table is None:
            return None
        for entry in table.history(10):
            if EPOCH_MS in entry:
                return {EPOCH_MS: int(entry[EPOCH_MS]), DEDUP_DELAY_MS: int(entry[DEDUP_DELAY_MS])}
        return None

    def check_layers(self, layers: LayersSpec, *, pipeline: str) -> None:
        """Refuse to build on bronze written with another epoch length or dedup delay.

        Raises:
            ConfigurationError: naming both values and the fix.
        """
        recorded = self.recorded_layers()
        if recorded is None:
            return
        wanted = recorded_values(layers)
        differ = {k: (recorded[k], wanted[k]) for k in wanted if recorded[k] != wanted[k]}
        if differ:
            names = {EPOCH_MS: "epoch", DEDUP_DELAY_MS: "dedup_delay"}
            detail = "; ".join(
                f"{names[k]}: bronze {was // 1000} s, pipeline {now // 1000} s"
                for k, (was, now) in differ.items()
            )
            raise ConfigurationError(
                f"pipeline {pipeline!r} does not match the master dataset at {self.path} ({detail}): views "
                "built with two epoch lengths or dedup delays would not merge exactly",
                fix=f"set [layers] back to the recorded values in pipelines/{pipeline}.toml, or build the "
                "new values as a new pipeline (another name, so another master dataset and views)",
            )

    def read_progress(
        self, partitions: Iterable[str] | None = None, *, version: int | None = None
    ) -> dict[str, int]:
        """The highest offset the speed job had read, per ``"topic/partition"``, as of ``version``
        (default the newest): from the commits' metadata, newest first, until every one of
        ``partitions`` is found (None: every partition any commit recorded, the whole history)."""
        table = open_table(self.path, version=version)
        if table is None:
            return {}
        wanted, found = (None if partitions is None else set(partitions)), {}
        for entry in table.history():
            if version is not None and entry.get("version", 0) > version:
                continue
            for key, (offset, _ingest) in json.loads(entry.get(PARTITIONS) or "{}").items():
                found[key] = max(found.get(key, -1), offset)
            if wanted is not None and wanted <= set(found):
                break
        return found

    def clear_staging(self, prefix: str) -> int:
        """Delete the staging files whose names start with ``prefix`` (a run id: files of attempts
        killed mid-write; a live attempt moves its file out at once). Call it before the run's
        tasks start. Returns how many were deleted."""
        left = list_files(f"{self.path.rstrip('/')}/_staging", prefix=prefix)
        for uri in left:
            delete_file(uri)
        if left:
            log.info("deleted %d half-written master files of earlier attempts", len(left))
        return len(left)

    def read(self) -> pa.Table:
        """The whole table as Arrow (tests and small tables; Spark reads :meth:`file_uris`)."""
        table = self._table()
        if table is None:
            raise FileNotFoundError(f"no Delta table at {self.path}")
        return table.to_pyarrow_table()

    def num_records(self) -> int | None:
        """How many events the live files hold, from the Delta log (None: no table, or a file
        committed without its row count)."""
        table = self._table()
        if table is None:
            return None
        counts = pa.table(table.get_add_actions(flatten=True)).column("num_records")
        return None if counts.null_count else int(pc.sum(counts).as_py() or 0)

    def files_holding(self, ranges: Sequence[tuple[int, int, int]]) -> list[list[str]]:
        """Per ``(partition, start, end)``, the live files that may hold offsets ``[start, end)`` of
        that partition: those whose stats overlap it, and every file committed without them."""
        table = self._table()
        if table is None:
            return [[] for _ in ranges]
        actions = pa.table(table.get_add_actions(flatten=True))
        root = self.path.rstrip("/")
        uris = [f"{root}/{p}" if "://" not in p else p for p in actions.column("path").to_pylist()]
        bounds = [f"{edge}.{c}" for c in COORDINATES for edge in ("min", "max")]
        if not all(b in actions.column_names for b in bounds):
            return [list(uris) for _ in ranges]
        rows = list(zip(uris, *(actions.column(b).to_pylist() for b in bounds), strict=True))
        return [
            [
                uri
                for uri, p_min, p_max, o_min, o_max in rows
                if p_min is None or (p_min <= partition <= p_max and o_min < end and o_max >= start)
            ]
            for partition, start, end in ranges
        ]

    def file_uris(self) -> list[str]:
        """The live files (never the bare folder: it also holds removed and uncommitted files)."""
        table = self._table()
        return [] if table is None else table.file_uris()
