"""A speed micro-batch's master dataset commit as the master dataset grows: what the commit costs on the
caller's path.

The speed job commits its micro-batch's files (two a batch for a two-partition topic) to the master dataset
with delta-rs, every batch, and the master dataset keeps them (at 1k events/s: 150k files in about 12 hours).
For each size, a Delta table of that many files (the log only: synthetic add actions of 5,000 a
commit, then a checkpoint) gets ``--commits`` real micro-batch commits of 300 events each through
:meth:`lambdalake.master.MasterDataset.commit`, ``--gap`` seconds apart (the next micro-batch's Spark
job), timed as its caller sees them, for three ways of getting the snapshot a commit decides on:

- ``reopen``: open the table for every commit and bring it up to date inline after it (the code
  this benchmark was written to replace);
- ``kept-inline``: keep the previous commit's snapshot, update it before deciding, inline after;
- ``kept``: the same, with the update after the commit on a thread of its own (the code now).

Also per size: opening the table, and bringing a kept one up to date with one new commit.

    python -m bench.master_commits [--files 1000 50000 150000] [--commits 12] [--gap 0.4]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
from deltalake import DeltaTable
from deltalake.transaction import AddAction

from bench.common import write_result
from lambdalake.delta import open_table
from lambdalake.master import MasterDataset
from lambdalake.master_files import PARTITION, write_event_files
from lambdalake.pipeline import LayersSpec

LAYERS = LayersSpec(epoch="1 hour", dedup_delay="10 minutes")
DAY = "2026-01-01"


class Reopen(MasterDataset):
    """The commit path before the snapshot was kept."""

    def _newest_for_commit(self) -> DeltaTable | None:
        return open_table(self.path)

    def _refresh_later(self, table: DeltaTable) -> None:
        table.update_incremental()


class KeptInline(MasterDataset):
    """The kept snapshot, brought up to date on the caller's path after each commit."""

    def _refresh_later(self, table: DeltaTable) -> None:
        table.update_incremental()


VARIANTS: dict[str, type[MasterDataset]] = {
    "reopen": Reopen,
    "kept-inline": KeptInline,
    "kept": MasterDataset,
}


def events(start: int, n: int) -> pa.Table:
    return pa.table({
        "id": [f"e{o}" for o in range(start, start + n)],
        "event_time": pa.array([datetime(2026, 1, 1, 10, tzinfo=UTC)] * n, type=pa.timestamp("us", tz="UTC")),
        "_topic": ["t"] * n,
        "_partition": pa.array([0] * n, type=pa.int32()),
        "_offset": pa.array(range(start, start + n), type=pa.int64()),
    })  # fmt: skip


def master_of(path: str, files: int) -> None:
    """A master dataset table holding ``files`` files (one real, the rest synthetic add actions)."""
    MasterDataset(path, event_time="event_time").commit(
        write_event_files(events(0, 10), path=path, event_time="event_time", name="seed"),
        app_id="seed", batch_id=0, layers=LAYERS, ranges={"t/0": [(0, 10)]},
    )  # fmt: skip
    table = DeltaTable(path)
    schema = table.schema().to_arrow()
    stats = json.dumps({"numRecords": 300})
    added = 1
    while added < files:
        n = min(5000, files - added)
        adds = [
            AddAction(path=f"{PARTITION}={DAY}/{uuid.uuid4().hex}.parquet", size=1000,
                      partition_values={PARTITION: DAY}, modification_time=0, data_change=True, stats=stats)
            for _ in range(n)
        ]  # fmt: skip
        table.create_write_transaction(adds, mode="append", schema=schema, partition_by=[PARTITION])
        table.update_incremental()
        added += n
    table.create_checkpoint()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--files", type=int, nargs="+", default=[1000, 50000, 150000])
    parser.add_argument("--commits", type=int, default=12, help="commits timed per variant and size")
    parser.add_argument("--gap", type=float, default=0.4, help="seconds between commits")
    args = parser.parse_args()
    sizes = []
    with tempfile.TemporaryDirectory(prefix="master-commits-") as tmp:
        for files in args.files:
            path = str(Path(tmp) / f"master-{files}")
            master_of(path, files)
            t0 = time.perf_counter()
            kept = DeltaTable(path)
            open_ms = (time.perf_counter() - t0) * 1000
            MasterDataset(path, event_time="event_time").commit(
                write_event_files(events(10, 10), path=path, event_time="event_time", name="other"),
                app_id="other", batch_id=0, layers=LAYERS, ranges={"t/0": [(10, 20)]},
            )  # fmt: skip
            t0 = time.perf_counter()
            kept.update_incremental()
            update_ms = (time.perf_counter() - t0) * 1000
            offset = 20
            commit_ms: dict[str, list[float]] = {}
            # Each variant twice, interleaved: the machine's drift falls on all of them.
            for name in [*VARIANTS, *VARIANTS]:
                master = VARIANTS[name](path, event_time="event_time")
                times = []
                for batch in range(args.commits):
                    written = write_event_files(
                        events(offset, 300), path=path, event_time="event_time", name=f"{name}-{offset}"
                    )
                    t0 = time.perf_counter()
                    master.commit(
                        written, app_id=f"speed-{name}-{offset}", batch_id=batch, layers=LAYERS,
                        ranges={"t/0": [(offset, offset + 300)]}, speed=True,
                    )  # fmt: skip
                    times.append((time.perf_counter() - t0) * 1000)
                    offset += 300
                    time.sleep(args.gap)
                # The first commit of a variant opens the table whatever the variant.
                commit_ms.setdefault(name, []).append(statistics.median(times[1:]))
            row = {
                "files": files,
                "open_ms": round(open_ms, 1),
                "update_one_commit_ms": round(update_ms, 1),
                "commit_median_ms": {k: [round(v, 1) for v in vs] for k, vs in commit_ms.items()},
            }
            sizes.append(row)
            print(
                f"{files:>7} files: open {open_ms:.0f} ms, update {update_ms:.0f} ms; commit median "
                + ", ".join(f"{k} {' / '.join(f'{v:.0f}' for v in vs)} ms" for k, vs in commit_ms.items()),
                flush=True,
            )
            shutil.rmtree(path, ignore_errors=True)
    path = write_result("master-commits", {"commits": args.commits, "gap_s": args.gap, "sizes": sizes})
    print(f"-> {path}")


if __name__ == "__main__":
    main()
