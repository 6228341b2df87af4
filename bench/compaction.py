"""Master dataset compaction: a speed micro-batch's master dataset commit before and after a compaction round,
on a the master dataset of real small files, and what the round itself costs.

For each size: a master dataset of that many Parquet files of ``--rows`` events each (two Kafka partitions,
one event date, one file per partition and micro-batch, as the speed job writes them), committed
5,000 files at a time; then ``--commits`` micro-batch commits of two such files through
:meth:`lambdalake.master.MasterDataset.commit` (the speed job's path: its kept snapshot), ``--gap``
seconds apart, timed as the caller sees them; then one :class:`lambdalake.compaction.Compaction`
round with the default policy (wall time, and the process's CPU time over it); then the same
commits again. Every row is read back before and after the round and compared.

With ``--spark-read``, a batch-layer Spark session (``workload="batch"``) also reads the live files
before and after the round, as the batch job's first stage does (`read_master`, then a count per
identity: the narrow part of its deduplication), twice each, interleaved.

    python -m bench.compaction [--files 1000 20000 50000] [--rows 300] [--commits 12] [--gap 0.4]
                               [--spark-read]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable

from bench.common import write_result
from lambdalake.compaction import Compaction
from lambdalake.master import MasterDataset
from lambdalake.master_files import PARTITION
from lambdalake.pipeline import LayersSpec

LAYERS = LayersSpec(epoch="1 hour", dedup_delay="10 minutes")
DAY = "2026-01-01"
PARTITIONS = (0, 1)


def events(rows: int) -> pa.Table:
    """``rows`` events of offsets 0..rows-1 (shifted per file, and their ids with them)."""
    at = pa.array([datetime(2026, 1, 1, 10, tzinfo=UTC)] * rows, type=pa.timestamp("us", tz="UTC"))
    return pa.table({
        "id": [f"e{i}" for i in range(rows)],
        "event_time": at,
        "merchant": [f"m{i % 97}" for i in range(rows)],
        "price_cents": pa.array(range(rows), type=pa.int64()),
        "_topic": ["t"] * rows,
        "_partition": pa.array([0] * rows, type=pa.int32()),
        "_offset": pa.array(range(rows), type=pa.int64()),
        "_ingest_ts": at,
    })  # fmt: skip


class Master:
    """A master dataset being filled the way the speed job fills it."""

    def __init__(self, path: str, rows: int) -> None:
        self.path = path
        self.template = events(rows)
        self.rows = rows
        self.next_offset = dict.fromkeys(PARTITIONS, 0)
        self.batch = 0

    def write(self, partition: int) -> tuple[str, tuple[int, int]]:
        """One micro-batch file of ``partition``; its path (relative) and offset range."""
        start = self.next_offset[partition]
        self.next_offset[partition] += self.rows
        table = self.template.set_column(5, "_partition", pa.array([partition] * self.rows, type=pa.int32()))
        offsets = pc.add(self.template.column("_offset"), start)
        table = table.set_column(6, "_offset", offsets)
        # Every event its own identity, as in a real topic (copies aside).
        table = table.set_column(
            0, "id", pc.binary_join_element_wise(f"e{partition}-", pc.cast(offsets, pa.string()), "")
        )
        relative = f"{PARTITION}={DAY}/b{self.batch}-p{partition}-{start}.parquet"
        Path(self.path, relative).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, f"{self.path}/{relative}", compression="snappy")
        return relative, (start, start + self.rows)

    def micro_batch(self) -> tuple[list[str], dict[str, list[tuple[int, int]]]]:
        files, ranges = [], {}
        for p in PARTITIONS:
            relative, span = self.write(p)
            files.append(relative)
            ranges[f"t/{p}"] = [span]
        self.batch += 1
        return files, ranges

    def seed(self, files: int) -> None:
        """``files`` files, committed 5,000 at a time."""
        master = MasterDataset(self.path, event_time="event_time")
        while self.batch * len(PARTITIONS) < files:
            chunk, ranges = [], {}
            for _ in range(min(5000, files - self.batch * len(PARTITIONS)) // len(PARTITIONS)):
                batch_files, batch_ranges = self.micro_batch()
                chunk += batch_files
                for key, spans in batch_ranges.items():
                    ranges.setdefault(key, []).extend(spans)
            master.commit(chunk, app_id="seed", batch_id=self.batch, layers=LAYERS, ranges=ranges, speed=True)

    def timed_commits(self, n: int, gap: float) -> list[float]:
        """``n`` micro-batch commits by one writer keeping its snapshot (ms each, the first left out:
        it opens the table)."""
        master = MasterDataset(self.path, event_time="event_time")
        times = []
        for _ in range(n + 1):
            files, ranges = self.micro_batch()
            t0 = time.perf_counter()
            master.commit(
                files, app_id="speed", batch_id=self.batch, layers=LAYERS, ranges=ranges, speed=True
            )
            times.append((time.perf_counter() - t0) * 1000)
            time.sleep(gap)
        return times[1:]


def spark_read(spark, path: str) -> float:
    """Seconds to read the live files and count deliveries per identity (the batch job's read)."""
    from pyspark.sql import functions as F

    from lambdalake.spark.views import read_master

    t0 = time.perf_counter()
    master = read_master(spark, DeltaTable(path).file_uris(), held_twice=False)
    master.groupBy("id", "_partition").agg(F.count(F.lit(1)).alias("n")).filter("n > 1").count()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--files", type=int, nargs="+", default=[1000, 20000, 50000])
    parser.add_argument("--rows", type=int, default=300, help="events a micro-batch file holds")
    parser.add_argument("--commits", type=int, default=12, help="commits timed before and after the round")
    parser.add_argument("--gap", type=float, default=0.4, help="seconds between commits")
    parser.add_argument("--spark-read", action="store_true", help="also time the batch layer's read")
    args = parser.parse_args()
    spark = None
    if args.spark_read:
        from bench.common import bench_settings
        from lambdalake.spark.session import spark_session

        spark = spark_session(bench_settings(fresh=False), "lambdalake-bench-compaction", workload="batch")
    sizes = []
    with tempfile.TemporaryDirectory(prefix="bench-compaction-") as tmp:
        for files in args.files:
            path = str(Path(tmp) / f"master-{files}")
            master = Master(path, args.rows)
            master.seed(files)
            before = master.timed_commits(args.commits, args.gap)
            rows_before = (
                DeltaTable(path)
                .to_pyarrow_table()
                .sort_by([("_partition", "ascending"), ("_offset", "ascending")])
            )
            live_before = len(DeltaTable(path).file_uris())
            reads: dict[str, list[float]] = {"before": [], "after": []}
            if spark is not None:
                spark_read(spark, path)  # warm: the session's first job pays for its classes
                reads["before"] = [spark_read(spark, path) for _ in range(2)]
            wall0, cpu0 = time.perf_counter(), time.process_time()
            replaced = Compaction(path).run()
            wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
            live_after = len(DeltaTable(path).file_uris())
            rows_after = (
                DeltaTable(path)
                .to_pyarrow_table()
                .sort_by([("_partition", "ascending"), ("_offset", "ascending")])
            )
            if not rows_after.equals(rows_before):
                raise SystemExit(f"{files} files: the compacted master dataset does not hold the same rows")
            if spark is not None:
                reads["after"] = [spark_read(spark, path) for _ in range(2)]
            after = master.timed_commits(args.commits, args.gap)
            row = {
                "files": files,
                "rows_per_file": args.rows,
                "events": rows_before.num_rows,
                "live_files_before": live_before,
                "live_files_after": live_after,
                "replaced": replaced,
                "round_s": round(wall, 2),
                "round_cpu_s": round(cpu, 2),
                "round_us_per_event": round(wall / rows_before.num_rows * 1e6, 2),
                "commit_median_ms_before": round(statistics.median(before), 1),
                "commit_median_ms_after": round(statistics.median(after), 1),
                "spark_read_s": {k: [round(v, 2) for v in vs] for k, vs in reads.items()},
            }
            sizes.append(row)
            print(
                f"{files:>6} files ({rows_before.num_rows:,} events): commit median "
                f"{row['commit_median_ms_before']:.0f} ms -> {row['commit_median_ms_after']:.0f} ms; round: "
                f"{replaced} files into {live_after - (live_before - replaced)} in {wall:.1f} s "
                f"({cpu:.1f} s CPU), live files {live_before} -> {live_after}"
                + (
                    f"; Spark read {' / '.join(f'{v:.2f}' for v in reads['before'])} s -> "
                    f"{' / '.join(f'{v:.2f}' for v in reads['after'])} s"
                    if spark is not None
                    else ""
                ),
                flush=True,
            )
            shutil.rmtree(path, ignore_errors=True)
    if spark is not None:
        spark.stop()
    path = write_result(
        "compaction" + ("-spark-read" if spark is not None else ""),
        {"commits": args.commits, "gap_s": args.gap, "sizes": sizes},
    )
    print(f"-> {path}")


if __name__ == "__main__":
    main()
