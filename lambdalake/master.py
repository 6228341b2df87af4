"""The immutable master dataset: one append-only Delta table of every decoded event per pipeline.

Executors write Parquet files with Arrow (:func:`write_event_files`, to any filesystem Arrow reaches)
under names derived from the Kafka records they hold; the driver commits them with delta-rs
(:meth:`MasterDataset.commit`). Each commit carries a Delta app transaction ``(app_id, batch_id)``, so
a micro-batch that is replayed after a crash, but was already committed, is skipped: every event lands
exactly once. Files of an attempt that crashed before its commit are not in the log, so readers never
see them, and the replay writes the same names again.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError
from pyarrow import fs as pafs

from lambdalake.coverage import (
    Coverage,
    covered_until,
    from_json,
    intersection,
    merged,
    normalized,
    runs,
    to_json,
)
from lambdalake.delta import commit_files, commit_info, lost_to_another_commit, open_table
from lambdalake.errors import ConfigurationError
from lambdalake.layout import master_path
from lambdalake.master_files import PARTITION, offsets_present, write_event_files
from lambdalake.pipeline import LayersSpec, Pipeline
from lambdalake.settings import Settings
from lambdalake.storage import delete_file, list_files

#: Commit metadata keys: what the views depend on, and how far each partition was read.
EPOCH_MS = "lambdalake.epoch_ms"
DEDUP_DELAY_MS = "lambdalake.dedup_delay_ms"
PARTITIONS = "lambdalake.partitions"
#: Per "topic/partition": the [start, end) ranges this commit read, and those every commit so far
#: read (lambdalake.coverage), and the speed job's read end (exclusive).
RANGES = "lambdalake.ranges"
COVERAGE = "lambdalake.coverage"
SPEED_END = "lambdalake.speed_end"
#: The app transaction every master dataset commit carries: two commits made on one snapshot conflict.
WRITER_APP = "lambdalake.master-writer"
COMMIT_ATTEMPTS = 20
RECENT = 20
#: An event's Kafka coordinates in its topic; each file's stats record their range.
COORDINATES = ("_partition", "_offset")

log = logging.getLogger("lambdalake.master")


def recorded_values(layers: LayersSpec) -> dict[str, int]:
    """What each master dataset commit records of the layers (and :meth:`MasterDataset.check_layers`
    compares)."""
    return {EPOCH_MS: layers.epoch_ms, DEDUP_DELAY_MS: layers.dedup_delay_seconds * 1000}


class MasterDataset:
    """The Delta table of one pipeline's events (the master dataset), partitioned by event date.

    Delivery guarantee: exactly once per ``(app_id, batch_id)``: :meth:`commit` commits a batch at
    most once, and a batch whose commit failed is retried by the caller (the stream's replay). An
    object keeps the snapshot its commits decide on: one object per writing thread.

    Args:
        path: Table location (a local path or an object-store URI).
        event_time: The event-time column the table is partitioned by (as its UTC date).
    """

    def __init__(self, path: str, *, event_time: str) -> None:
        self.path = path
        self.event_time = event_time
        self._committing: DeltaTable | None = None
        self._refreshing: threading.Thread | None = None
        self._refresh_failed = False

    def _table(self) -> DeltaTable | None:
        return open_table(self.path)

    def _newest_for_commit(self) -> DeltaTable | None:
        """The newest snapshot, to decide a commit on: the table of this object's previous commit
        brought up to date with the commits since (anyone's), instead of opened again. Opening reads
        the log from its last checkpoint, every live file included: its cost grows with the files, and
        the speed job adds a few every micro-batch (bench.master_commits).
        The snapshot is this object's: one object per writing thread."""
        if self._refreshing is not None:
            self._refreshing.join()
            self._refreshing = None
            if self._refresh_failed:
                self._committing, self._refresh_failed = None, False
        if self._committing is None:
            self._committing = open_table(self.path)
        else:
            try:
                self._committing.update_incremental()
            except BaseException:
                self._committing = None  # opened afresh next time, whatever state the failure left
                raise
        return self._committing

    def _refresh_later(self, table: DeltaTable) -> None:
        """Bring ``table`` up to date with the commit just made while the caller goes on (the speed
        job: its next micro-batch). delta-rs rebuilds the table's file list to do it, ~180 ms at 150k
        files, without holding the GIL; the next commit waits for it before it decides."""

        def refresh() -> None:
            try:
                table.update_incremental()
            except BaseException:  # reopened by the next commit, which reports what still fails
                self._refresh_failed = True

        self._refreshing = threading.Thread(target=refresh, name="master-snapshot-refresh")
        self._refreshing.start()

    def commit(
        self,
        files: Iterable[str],
        *,
        app_id: str,
        batch_id: int,
        layers: LayersSpec,
        ranges: Mapping[str, list[tuple[int, int]]] | None = None,
        partitions: Mapping[str, list[int]] | None = None,
        speed: bool = False,
    ) -> int | None:
        """Add ``files`` (relative paths written by :func:`write_event_files`) in one commit, unless
        ``app_id`` already committed ``batch_id``. Returns the rows added, or None if skipped.

        The commit records what the views depend on (the epoch length and dedup delay, see
        :meth:`check_layers`), the offset ``ranges`` it read per ``"topic/partition"`` (``[start,
        end)``, valid records or not) and the coverage of every commit so far with them (see
        :meth:`read_coverage`); ``speed`` marks the speed job's reads (:meth:`read_speed_end`).
        ``partitions`` (per partition ``[highest offset, highest ingest ms]``) is kept as it was.
        A commit with no files still records its ranges (a micro-batch of dead letters only).

        The master dataset never holds a coordinate twice: rows of ``files`` whose offsets the coverage
        already holds (a replay archived them ahead of the speed job, or the other way round) are left out,
        decided against the snapshot the commit is made on. Every commit carries the shared app
        transaction :data:`WRITER_APP`, so a commit that lands in between makes this one fail with
        a conflict instead of landing on a stale decision; it is then decided again.
        """
        files = sorted(set(files))
        ranges = {k: normalized(list(v)) for k, v in (ranges or {}).items()}
        for attempt in range(COMMIT_ATTEMPTS):
            table = self._newest_for_commit()
            if table is not None and (table.transaction_version(app_id) or -1) >= batch_id:
                return None
            if table is None and not files:
                return 0  # nothing to record progress on yet
            coverage, speed_end = self._recorded(table)
            # Only offsets some commit read can be held (every lambdalake commit records its ranges):
            # a speed micro-batch past everything archived reads no file here.
            held = self._held(table, intersection(coverage, ranges)) if files else {}
            keep = self._without(files, held) if held else files
            recorded = speed_end
            if speed:
                speed_end = {**speed_end}
                for key, parts in ranges.items():
                    speed_end[key] = max(speed_end.get(key, 0), parts[-1][1])
            if not keep and merged(coverage, ranges) == coverage and speed_end == recorded:
                return 0  # nothing new to add or record (a replay run again)
            version = -1 if table is None else table.version()
            t0 = time.monotonic()
            try:
                _version, rows = commit_files(
                    self.path, keep, mode="append", partition=(PARTITION, pa.date32()), table=table,
                    refresh=False,
                    app_transactions=[(app_id, batch_id), (WRITER_APP, version + 1)],
                    schema_guard=[(WRITER_APP, version + 1)],
                    stats_columns=COORDINATES,
                    metadata={
                        "lambdalake.batch_id": str(batch_id),
                        "lambdalake.app_id": app_id,
                        **{k: str(v) for k, v in recorded_values(layers).items()},
                        PARTITIONS: json.dumps(dict(partitions or {}), sort_keys=True),
                        RANGES: json.dumps(to_json(ranges)),
                        COVERAGE: json.dumps(to_json(merged(coverage, ranges))),
                        SPEED_END: json.dumps(dict(sorted(speed_end.items()))),
                    },
                )  # fmt: skip
            except CommitFailedError as exc:
                if not lost_to_another_commit(exc) or attempt == COMMIT_ATTEMPTS - 1:
                    raise
                log.info("master dataset commit of %s met a concurrent commit; deciding again", app_id)
                continue
            if table is not None:
                self._refresh_later(table)
            if held:
                log.info("left out offsets the master dataset already held: %s", to_json(held))
            log.debug("master commit of %d files: %.2fs", len(keep), time.monotonic() - t0)
            return rows
        raise AssertionError("unreachable")

    def _recorded(self, table: DeltaTable | None) -> tuple[Coverage, dict[str, int]]:
        """The coverage and the speed job's read ends as of ``table``'s snapshot."""
        if table is None:
            return {}, {}
        version = table.version()
        # The newest lambdalake commit at or below the snapshot's version is nearly always among its
        # last few: read those commits' own log entries (history() of a snapshot pinned below the
        # newest version returns the newest commits instead, see commit_info).
        for at in range(version, max(-1, version - RECENT), -1):
            entry = commit_info(self.path, at)
            if entry is None:
                break  # the log was cleaned up below here
            if COVERAGE in entry:
                return self._parse_recorded(entry)
        # Further back (the last commits were others', a compaction's): all of its history.
        for entry in table.history():
            if entry.get("version", 0) <= version and COVERAGE in entry:
                return self._parse_recorded(entry)
        return {}, {}

    @staticmethod
    def _parse_recorded(entry: Mapping) -> tuple[Coverage, dict[str, int]]:
        coverage = from_json(json.loads(entry[COVERAGE]))
        return coverage, {k: int(v) for k, v in json.loads(entry.get(SPEED_END) or "{}").items()}

    def _held(self, table: DeltaTable | None, ranges: Coverage) -> Coverage:
        """The offsets of ``ranges`` that ``table``'s snapshot holds (read from the files whose
        offset stats overlap them: none, for a speed micro-batch past everything archived)."""
        if table is None or not ranges:
            return {}
        wanted = [(key, start, end) for key, parts in ranges.items() for start, end in parts]
        holding = self.files_holding([(int(k.rpartition("/")[2]), s, e) for k, s, e in wanted], table=table)
        found: dict[str, list[np.ndarray]] = {}
        for (key, start, end), uris in zip(wanted, holding, strict=True):
            offsets = offsets_present(uris, partition=int(key.rpartition("/")[2]), start=start, end=end)
            if len(offsets):
                found.setdefault(key, []).append(offsets.to_numpy())
        return {key: runs(np.concatenate(parts)) for key, parts in found.items()}

    def _without(self, files: list[str], held: Coverage) -> list[str]:
        """``files`` with the rows at ``held`` offsets left out: a file that holds some is written
        again under a name derived from what it leaves out (idempotent), one that holds only those
        is dropped."""
        filesystem, root = pafs.FileSystem.from_uri(self.path)
        root = root.rstrip("/")
        digest = hashlib.sha1(json.dumps(to_json(held)).encode()).hexdigest()[:12]
        out = []
        for relative in files:
            rows = pq.read_table(f"{root}/{relative}", filesystem=filesystem)
            drop = pa.array(np.zeros(rows.num_rows, dtype=bool))
            for key, parts in held.items():
                topic, _, partition = key.rpartition("/")
                here = pc.and_(pc.equal(rows.column("_topic"), topic),
                               pc.equal(rows.column("_partition"), int(partition)))  # fmt: skip
                offsets = rows.column("_offset")
                for start, end in parts:
                    inside = pc.and_(pc.greater_equal(offsets, start), pc.less(offsets, end))
                    drop = pc.or_(drop, pc.and_(here, inside))
            dropped = pc.sum(drop).as_py() or 0
            if dropped == 0:
                out.append(relative)
                continue
            kept = rows.filter(pc.invert(drop))
            if kept.num_rows == 0:
                continue
            name = relative.rsplit("/", 1)[1].removesuffix(".parquet")
            out.extend(
                write_event_files(kept, path=self.path, event_time=self.event_time, name=f"{name}.x{digest}")
            )
        return out

    def read_coverage(self, *, version: int | None = None) -> Coverage:
        """The offsets the master dataset has covered, per ``"topic/partition"``, as of ``version`` (default
        the newest): the newest lambdalake commit records all of it (so log cleanup, which keeps the
        newest commits, never loses it)."""
        table = open_table(self.path, version=version)
        return self._recorded(table)[0]

    def read_speed_end(self, *, version: int | None = None) -> dict[str, int]:
        """Per ``"topic/partition"``, the offset before which the speed job has read everything and
        written its views (its commits' ranges; a replay's do not count)."""
        return self._recorded(open_table(self.path, version=version))[1]

    def recorded_layers(self) -> dict[str, int] | None:
        """The epoch length and dedup delay (ms) the newest commit recorded (None: no table, or a table
        written before they were recorded)."""
        table = self._table()
        if table is None:
            return None
        # Compaction and vacuum commits record none: look past them, into all of history if need be.
        recent = table.history(RECENT)
        for entry in recent if any(EPOCH_MS in e for e in recent) else table.history():
            if EPOCH_MS in entry:
                return {EPOCH_MS: int(entry[EPOCH_MS]), DEDUP_DELAY_MS: int(entry[DEDUP_DELAY_MS])}
        return None

    def check_layers(self, layers: LayersSpec, *, pipeline: str) -> None:
        """Refuse to build on the master dataset written with another epoch length or dedup delay.

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
                f"{names[k]}: the master dataset {was // 1000} s, pipeline {now // 1000} s"
                for k, (was, now) in differ.items()
            )
            raise ConfigurationError(
                f"pipeline {pipeline!r} does not match the master dataset at {self.path} ({detail}): views "
                "built with two epoch lengths or dedup delays would not merge exactly",
                fix=f"set [layers] back to the recorded values in pipelines/{pipeline}.toml, or build the "
                "new values as a new pipeline (another name, so another master dataset and views)",
            )

    def read_progress(
        self,
        partitions: Iterable[str] | None = None,
        *,
        version: int | None = None,
        low: Mapping[str, int] | None = None,
    ) -> dict[str, int]:
        """Per ``"topic/partition"``, the highest offset up to which the master dataset has covered every
        offset from the log's first (``low``, default 0): the end of the gap-free run of ranges, minus one
        (``low - 1``: nothing). ``partitions`` limits the answer (None: every partition recorded)."""
        coverage = self.read_coverage(version=version)
        keys = coverage if partitions is None else partitions
        low = low or {}
        return {key: covered_until(coverage.get(key, []), low.get(key, 0)) - 1 for key in keys}

    def clear_staging(self, prefix: str, *, older_than_s: float = 0) -> int:
        """Delete the staging files whose names start with ``prefix`` (a run id: files of attempts
        killed mid-write; a live attempt moves its file out at once). Call it before the run's
        tasks start; a writer that cannot tell whether another with the same prefix still writes
        (``lambdalake master compact``) deletes only files older than ``older_than_s``. Returns
        how many were deleted."""
        left = list_files(f"{self.path.rstrip('/')}/_staging", prefix=prefix)
        if older_than_s > 0:
            filesystem, _ = pafs.FileSystem.from_uri(self.path)
            cutoff = time.time() - older_than_s
            infos = [filesystem.get_file_info(pafs.FileSystem.from_uri(uri)[1]) for uri in left]
            left = [
                u
                for u, i in zip(left, infos, strict=True)
                if i.mtime is not None and i.mtime.timestamp() < cutoff
            ]
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

    def files_holding(
        self, ranges: Sequence[tuple[int, int, int]], *, table: DeltaTable | None = None
    ) -> list[list[str]]:
        """Per ``(partition, start, end)``, the live files that may hold offsets ``[start, end)`` of
        that partition: those whose stats overlap it, and every file committed without them (of
        ``table``'s snapshot; default the newest)."""
        table = table if table is not None else self._table()
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

    def may_hold_twice(self, *, table: DeltaTable | None = None) -> bool:
        """Whether two live files of ``table``'s snapshot (default the newest) may hold one Kafka
        coordinate: their offset stats overlap within a partition, or a file has no stats or spans
        partitions. Commits leave out what the master dataset holds, so only a table written before that (or
        touched by hand) can; readers then tell the copies apart by file (:func:`read_master`)."""
        table = table if table is not None else self._table()
        if table is None:
            return False
        actions = pa.table(table.get_add_actions(flatten=True))
        bounds = [f"{edge}.{c}" for c in COORDINATES for edge in ("min", "max")]
        if not all(b in actions.column_names for b in bounds):
            return actions.num_rows > 1
        ranges: dict[int, list[tuple[int, int]]] = {}
        for p_min, p_max, o_min, o_max in zip(*(actions.column(b).to_pylist() for b in bounds), strict=True):
            if p_min is None or p_min != p_max or o_min is None or o_max is None:
                return True
            ranges.setdefault(p_min, []).append((o_min, o_max))
        for spans in ranges.values():
            spans.sort()
            if any(start <= end for (_, end), (start, _) in itertools.pairwise(spans)):
                return True
        return False

    def file_uris(self) -> list[str]:
        """The live files (never the bare folder: it also holds removed and uncommitted files)."""
        table = self._table()
        return [] if table is None else table.file_uris()


def master_of(settings: Settings, pipeline: Pipeline) -> MasterDataset:
    """``pipeline``'s master dataset under the settings' storage root."""
    return MasterDataset(master_path(settings.storage_root, pipeline.name), event_time=pipeline.event.time)
