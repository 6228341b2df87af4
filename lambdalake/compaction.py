"""Compaction of the master dataset: a running speed job adds a few small files to the master dataset with
every micro-batch (~3 a second at 1k events/s, 150k in about 12 hours), and delta-rs's open, commit and
update, the batch layer's file listing and replay's file choice all grow with the live files.

Compaction rewrites small files of one event date and one Kafka partition into one file, in offset
order, and swaps them in one Delta commit (``dataChange=false`` adds and removes: the rows, their
coordinates and every commit's recorded coverage stay as they were). Files of one size class are
rewritten together only when ``fan_in`` of them have gathered, so a row is rewritten about once per
size class (a factor of ``fan_in`` each), never once per round; files of ``max_bytes`` or more are
never rewritten.

Concurrency: the decision a round depends on is which files are live, and only a commit that
removes files can change it: writers only append, and what they decide (which coordinates the master dataset
holds) a compaction leaves as it was. So rounds carry an app transaction of their own
(:data:`COMPACTION_APP`; every commit that removes master dataset files must): a round landing between
another's snapshot and its commit fails it (delta-rs alone does not: measured, two rounds then
removed the same files and both outputs stayed live), and it is checked again on the newest
snapshot (are the files it replaces still live?) and committed, or given up for that group. The
writers' commits neither wait for rounds nor fail because of them. Whatever the outcome, each row
is held by exactly one live file. The files it removes stay on storage (readers
pinned to an earlier version still read them) until :func:`vacuum` deletes those removed longer
ago than its retention (files never committed are never touched by it).

Delivery guarantee: none needed; the rows are unchanged. A compaction killed at any point leaves
either its commit or nothing live (an output written but not committed is adopted by the next round
with the same inputs: its name is derived from them).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.exceptions import CommitFailedError
from deltalake.transaction import RemoveAction
from pyarrow import fs as pafs

from lambdalake.delta import add_actions, lost_to_another_commit, open_table
from lambdalake.master import COORDINATES
from lambdalake.master_files import NULL_PARTITION, PARTITION
from lambdalake.procs import release_freed_memory
from lambdalake.settings import MasterSettings

log = logging.getLogger("lambdalake.compaction")

#: The app transaction every commit that removes master dataset files carries: two made on one snapshot
# conflict.
COMPACTION_APP = "lambdalake.master-compaction"
#: Commit metadata: what a compaction commit did (the master dataset's own keys are left to its writers).
OPERATION = "lambdalake.operation"
COMMIT_ATTEMPTS = 20
#: Rows per row group of a compacted file (a whole micro-batch file is often a few hundred).
ROW_GROUP_ROWS = 128 * 1024


@dataclass(frozen=True, kw_only=True)
class CompactionPolicy:
    """Which small files are rewritten together.

    Attributes:
        fan_in: How many files of one event date, Kafka partition and size class must gather before
            they are rewritten into one (default 10).
        base_bytes: The upper bound of the smallest size class (default 1 MiB); each class above it
            is ``fan_in`` times wider.
        max_bytes: Files this large or larger are never rewritten, and an output stops growing at
            it (default 1 GiB, Delta's own target for optimized files).
    """

    fan_in: int = 10
    base_bytes: int = 1 << 20
    max_bytes: int = 1 << 30

    @classmethod
    def of(cls, settings: MasterSettings) -> CompactionPolicy:
        """The policy ``LAMBDALAKE_MASTER__*`` sets."""
        return cls(fan_in=settings.compact_fan_in, max_bytes=settings.compact_max_mb << 20)

    def __post_init__(self) -> None:
        if self.fan_in < 2 or self.base_bytes < 1 or self.max_bytes <= self.base_bytes:
            raise ValueError(f"a compaction policy needs fan_in >= 2 and 0 < base_bytes < max_bytes: {self}")

    def size_class(self, size: int) -> int:
        """0 below ``base_bytes``, then one more for each factor of ``fan_in``."""
        klass, bound = 0, self.base_bytes
        while size >= bound:  # integers: a float logarithm puts 1000 MiB below 10^3 MiB
            klass, bound = klass + 1, bound * self.fan_in
        return klass


@dataclass(frozen=True)
class LiveFile:
    path: str
    size: int
    first_offset: int
    last_offset: int


@dataclass(frozen=True)
class Group:
    """Live files of one event date (its Hive value) and Kafka partition, rewritten into one file."""

    date: str
    partition: int
    files: tuple[LiveFile, ...]

    @property
    def name(self) -> str:
        """The output's name: derived from the inputs, so a rerun writes the same file."""
        digest = hashlib.sha1("\n".join(sorted(f.path for f in self.files)).encode()).hexdigest()[:16]
        return f"compact-p{self.partition}-o{self.files[0].first_offset}-{digest}"

    @property
    def relative(self) -> str:
        return f"{PARTITION}={self.date}/{self.name}.parquet"


def plan(table: DeltaTable, policy: CompactionPolicy, *, actions: pa.Table | None = None) -> list[Group]:
    """The groups worth rewriting in ``table``'s snapshot: per event date, Kafka partition and size
    class, ``policy.fan_in`` files or more, in offset order, cut so no output passes ``max_bytes``.
    Files without coordinate stats, or spanning Kafka partitions, are left alone, and so are files
    whose offset spans overlap another candidate's: the master dataset written before commits left out what it
    held may hold a coordinate in two files, and one file holding it twice could not be told apart
    from itself (readers keep exactly one copy by the file it lies in).

    ``actions``: the snapshot's add actions (flattened) where the caller has read them already."""
    if actions is None:
        actions = pa.table(table.get_add_actions(flatten=True))
    bounds = [f"{edge}.{c}" for c in COORDINATES for edge in ("min", "max")]
    date_column = f"partition.{PARTITION}"
    if actions.num_rows == 0 or not all(b in actions.column_names for b in [*bounds, date_column]):
        return []
    gathered: dict[tuple[str, int, int], list[LiveFile]] = {}
    columns = [actions.column(c).to_pylist() for c in ("path", "size_bytes", date_column, *bounds)]
    for path, size, date, p_min, p_max, o_min, o_max in zip(*columns, strict=True):
        if p_min is None or p_min != p_max or o_min is None or o_max is None or size >= policy.max_bytes:
            continue
        value = NULL_PARTITION if date is None else str(date)
        key = (value, int(p_min), policy.size_class(size))
        gathered.setdefault(key, []).append(LiveFile(path, size, int(o_min), int(o_max)))
    groups = []
    for (date, partition, _), candidates in sorted(gathered.items()):
        files = _apart(candidates)
        if len(files) < policy.fan_in:
            continue
        chunk: list[LiveFile] = []
        size = 0
        for f in [*files, None]:
            if f is None or (chunk and size + f.size > policy.max_bytes):
                if len(chunk) > 1:
                    groups.append(Group(date, partition, tuple(chunk)))
                chunk, size = [], 0
            if f is not None:
                chunk.append(f)
                size += f.size
    return groups


def _apart(files: list[LiveFile]) -> list[LiveFile]:
    """``files`` in offset order without those whose offset span overlaps another's."""
    files = sorted(files, key=lambda f: (f.first_offset, f.last_offset, f.path))
    kept: list[LiveFile] = []
    cluster: list[LiveFile] = []
    end = -1
    for f in [*files, None]:
        if f is None or f.first_offset > end:
            if len(cluster) == 1:
                kept.extend(cluster)
            cluster = []
        if f is not None:
            cluster.append(f)
            end = max(end, f.last_offset)
    return kept


def _hive_value(date: str) -> str | None:
    return None if date == NULL_PARTITION else date


class Compaction:
    """One round of compaction of the master dataset at ``path``.

    :meth:`write` writes each planned group's file (on storage, not yet live); :meth:`commit` swaps
    them in. :meth:`run` does both. One object per round.

    Args:
        path: The master dataset (a local path or an object-store URI).
        policy: Which files are rewritten together (default :class:`CompactionPolicy`'s defaults).
        staging_prefix: Starts the names of files being written (default none): a killed round's
            are cleared by :meth:`lambdalake.master.MasterDataset.clear_staging` with it.
    """

    def __init__(
        self, path: str, *, policy: CompactionPolicy | None = None, staging_prefix: str = ""
    ) -> None:
        self.path = path.rstrip("/")
        self.policy = policy or CompactionPolicy()
        self.staging_prefix = staging_prefix
        self.groups: list[Group] = []
        self._input_rows: dict[str, int] = {}
        self._filesystem, root = pafs.FileSystem.from_uri(self.path)
        self._root = root.rstrip("/")

    def run(self) -> int:
        """Plan, write and commit; returns how many files were replaced (0: nothing worth it)."""
        if not self.write():
            return 0
        return self.commit()

    def write(self, table: DeltaTable | None = None, *, groups: list[Group] | None = None) -> list[Group]:
        """Plan on ``table``'s snapshot (default the newest) and write each group's file.

        Args:
            table: The snapshot to plan on (default: the newest).
            groups: What :func:`plan` gave with this round's policy, when the caller planned already
                (then ``table`` is not read). :meth:`commit` checks their inputs on the newest
                snapshot either way.
        """
        if groups is None:
            table = table if table is not None else open_table(self.path)
            if table is None:
                return []
            groups = plan(table, self.policy)
        self.groups = []
        for group in groups:
            if self._write(group):
                self.groups.append(group)
        return self.groups

    def _write(self, group: Group) -> bool:
        """Write ``group``'s file (kept as it is if it exists: the same inputs' rows). False when its
        inputs do not share one schema (written by pipelines of different versions: left alone)."""
        target = f"{self._root}/{group.relative}"
        if self._filesystem.get_file_info(target).type != pafs.FileType.NotFound:
            return True
        staging = f"{self._root}/_staging/{self.staging_prefix}{group.name}.{uuid.uuid4().hex}.parquet"
        self._filesystem.create_dir(f"{self._root}/_staging", recursive=True)
        self._filesystem.create_dir(target.rsplit("/", 1)[0], recursive=True)
        # Each input's footer is read once (the schema check, the copy and the rows the commit checks
        # against), and the inputs are opened one at a time: a group may hold more files than a
        # process may keep open.
        rows: dict[str, int] = {}
        out: pq.ParquetWriter | None = None
        pending: list[pa.RecordBatch] = []
        buffered = 0
        try:
            for f in group.files:
                source = pq.ParquetFile(f"{self._root}/{f.path}", filesystem=self._filesystem)
                try:
                    if out is None:
                        out = pq.ParquetWriter(
                            staging, source.schema_arrow, filesystem=self._filesystem, compression="snappy"
                        )
                    elif not source.schema_arrow.equals(out.schema):
                        log.info("left %d files of %s alone: they hold different schemas",
                                 len(group.files), group.relative)  # fmt: skip
                        out.close()
                        self._filesystem.delete_file(staging)
                        return False
                    rows[f.path] = source.metadata.num_rows
                    # One row group at a time: memory stays at a row group, whatever the group's size.
                    for batch in source.iter_batches(batch_size=ROW_GROUP_ROWS):
                        pending.append(batch)
                        buffered += batch.num_rows
                        if buffered >= ROW_GROUP_ROWS:
                            out.write_table(
                                pa.Table.from_batches(pending, out.schema), row_group_size=ROW_GROUP_ROWS
                            )
                            pending, buffered = [], 0
                finally:
                    source.close()
            assert out is not None  # a group holds two files or more
            if pending:
                out.write_table(pa.Table.from_batches(pending, out.schema), row_group_size=ROW_GROUP_ROWS)
        finally:
            if out is not None:
                out.close()
        self._filesystem.move(staging, target)
        self._input_rows.update(rows)
        return True

    def commit(self) -> int:
        """Swap the written groups in, in one commit decided on the newest snapshot; returns how many
        files were replaced. A group whose inputs another commit removed meanwhile is left out."""
        for attempt in range(COMMIT_ATTEMPTS):
            table = open_table(self.path)
            if table is None:
                return 0
            live = set(pa.table(table.get_add_actions(flatten=True)).column("path").to_pylist())
            groups = [g for g in self.groups if all(f.path in live for f in g.files)]
            if len(groups) < len(self.groups):
                lost = len(self.groups) - len(groups)
                log.info("%d compaction groups lost their inputs to another commit: left out", lost)
            self.groups = groups
            if not groups:
                return 0
            try:
                self._commit(table, groups)
            except CommitFailedError as exc:
                if not lost_to_another_commit(exc) or attempt == COMMIT_ATTEMPTS - 1:
                    raise
                log.info("master dataset compaction met a concurrent commit; checking its files again")
                continue
            replaced = sum(len(g.files) for g in groups)
            log.info("compacted %d master dataset files into %d", replaced, len(groups))
            return replaced
        raise AssertionError("unreachable")

    def _commit(self, table: DeltaTable, groups: list[Group]) -> None:
        adds, _, rows = add_actions(
            self.path, [g.relative for g in groups], partition=(PARTITION, pa.date32()),
            stats_columns=COORDINATES, data_change=False,
        )  # fmt: skip
        expected = sum(self._rows(f.path) for g in groups for f in g.files)
        if rows != expected:
            raise AssertionError(f"compacted files hold {rows} rows, their inputs {expected}: not committed")
        now_ms = int(time.time() * 1000)
        # Positional (path, data_change, deletion_timestamp, size, partition_values): the binding
        # takes no keywords.
        removes = [
            RemoveAction(f.path, False, now_ms, f.size, {PARTITION: _hive_value(g.date)})
            for g in groups
            for f in g.files
        ]
        table.create_write_transaction(
            [*adds, *removes],
            mode="append",
            schema=table.schema(),
            partition_by=[PARTITION],
            commit_properties=CommitProperties(
                app_transactions=[Transaction(app_id=COMPACTION_APP, version=table.version() + 1)],
                custom_metadata={OPERATION: "compact", "lambdalake.files_replaced": str(len(removes))},
            ),
        )

    def _rows(self, relative: str) -> int:
        """An input's rows: read when its group's file was written, or now (a killed round's output
        adopted as it was)."""
        if relative in self._input_rows:
            return self._input_rows[relative]
        return pq.read_metadata(f"{self._root}/{relative}", filesystem=self._filesystem).num_rows


#: Commits of the master dataset's history searched for the last compaction round (a round every 100 at
# default).
HISTORY_SCAN = 1000


def summary(table: DeltaTable, policy: CompactionPolicy) -> dict[str, Any]:
    """What ``table``'s snapshot holds and what compaction did to it: live files, their bytes and
    rows, those below the smallest size class, those a round would rewrite now, and the newest
    compaction commit among the last :data:`HISTORY_SCAN` (None: none)."""
    actions = pa.table(table.get_add_actions(flatten=True))
    sizes = actions.column("size_bytes").to_pylist()
    records = actions.column("num_records") if "num_records" in actions.column_names else None
    last = next((e for e in table.history(HISTORY_SCAN) if e.get(OPERATION) == "compact"), None)
    return {
        "version": table.version(),
        "live_files": len(sizes),
        "bytes": sum(sizes),
        "records": None if records is None or records.null_count else sum(records.to_pylist()),
        "small_files": sum(1 for size in sizes if size < policy.base_bytes),
        "would_rewrite": sum(len(g.files) for g in plan(table, policy, actions=actions)),
        "last_round": None
        if last is None
        else {
            "version": last.get("version"),
            "at_ms": last.get("timestamp"),
            "files_replaced": int(last.get("lambdalake.files_replaced", 0)),
        },
    }


def vacuum(path: str, *, retention_hours: int) -> int:
    """Delete the files of ``path`` that a commit removed more than ``retention_hours`` ago (delta-rs's
    lite vacuum: removed files only, never one that no commit named, such as a micro-batch's file
    written but not committed yet); returns how many. A reader pinned to a version older than the
    retention (a batch run longer than it) would miss them: keep the retention above the longest."""
    table = open_table(path)
    if table is None:
        return 0
    return len(table.vacuum(retention_hours=retention_hours, dry_run=False, enforce_retention_duration=False))


class Compactor:
    """Runs a :class:`Compaction` on a thread of its own every ``every_commits`` master dataset commits of its
    owner (the speed job), one at a time, so the stream never waits for it.

    Args:
        path: The master dataset.
        policy: Which files are rewritten together.
        every_commits: Commits between rounds (default 100, about a minute of micro-batches).
        staging_prefix: See :class:`Compaction`.
        vacuum_retention_hours: After every ``vacuum_every_rounds``-th round, :func:`vacuum` with this
            retention (default 168, a week, Delta's own default); None never vacuums.
        vacuum_every_rounds: Rounds between vacuums (default 10: a vacuum writes two commits to
            the log, files to delete or not).
        on_error: Called with a round's exception (default: logged); the next round tries again.
    """

    def __init__(
        self,
        path: str,
        *,
        policy: CompactionPolicy | None = None,
        every_commits: int = 100,
        staging_prefix: str = "",
        vacuum_retention_hours: int | None = 168,
        vacuum_every_rounds: int = 10,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.path = path
        self.staging_prefix = staging_prefix
        self.vacuum_retention_hours = vacuum_retention_hours
        self.vacuum_every_rounds = vacuum_every_rounds
        self.vacuumed = 0
        self.policy = policy or CompactionPolicy()
        self.every_commits = every_commits
        self.on_error = on_error or (lambda exc: log.warning("master dataset compaction failed: %s", exc))
        self.rounds = 0
        self.replaced = 0
        self._commits = 0
        self._thread: threading.Thread | None = None

    @classmethod
    def of(cls, settings: MasterSettings, path: str, *, staging_prefix: str) -> Compactor | None:
        """The compaction ``LAMBDALAKE_MASTER__*`` sets for the master dataset at ``path`` (None when
        ``the master dataset.compact`` is off); what a killed round staged starts with ``staging_prefix``."""
        if not settings.compact:
            return None
        return cls(
            path, policy=CompactionPolicy.of(settings), every_commits=settings.compact_every_commits,
            staging_prefix=staging_prefix, vacuum_retention_hours=settings.vacuum_retention_hours,
        )  # fmt: skip

    def committed(self) -> None:
        """Count one commit; start a round when it is due and none is running."""
        self._commits += 1
        if self._commits < self.every_commits or (self._thread is not None and self._thread.is_alive()):
            return
        self._commits = 0
        self._thread = threading.Thread(target=self._round, name="master-compaction", daemon=True)
        self._thread.start()

    def _round(self) -> None:
        try:
            round_ = Compaction(self.path, policy=self.policy, staging_prefix=self.staging_prefix)
            self.replaced += round_.run()
            self.rounds += 1
            if self.vacuum_retention_hours is not None and self.rounds % self.vacuum_every_rounds == 0:
                self.vacuumed += vacuum(self.path, retention_hours=self.vacuum_retention_hours)
        except (
            Exception
        ) as exc:  # a failed round leaves the master dataset as it was; the next one tries again
            self.on_error(exc)
        finally:
            # On its own thread, so that thread's allocations: the memory a round read and wrote stayed
            # with the speed job's driver otherwise.
            release_freed_memory()

    def close(self, timeout: float | None = None) -> None:
        """Wait for a running round to end."""
        if self._thread is not None:
            self._thread.join(timeout)
