"""How a batch view's overwrite costs with delta-spark and with the writer it replaced (issue 46, item 3).

A batch view is written by delta-spark (``lambdalake.spark.delta.write_table``, which ``BatchJob``
calls: Spark writes and commits in the JVM). Until 2026-11-29 Spark wrote Parquet files that delta-rs
committed (one ``commit_files`` overwrite): kept here as the baseline. Both write the same rows, in
turn, into tables of their own, in one Spark session made as a batch run makes its own
(``workload="batch"``, the quick JIT below 1M events), for a small view and a large one. With
``--index N``, instead, an identity index of N rows is written with column statistics and without
(``batch.identities.TABLE_PROPERTIES``), in turn, in a session made for N events
(-> bench/results/delta_index.json). With ``--together K``, instead, K small views (the first
``--small`` rows, the next twice that, ...) are overwritten one after another and side by side
(``write_tables``, as a batch run writes its views), in turn (-> bench/results/delta_views.json).

    python -m bench.delta_writers [--small 2000] [--large 1000000] [--rounds 6]
    python -m bench.delta_writers --index 10000000 | --together 3
    # -> bench/results/delta_writers.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from functools import partial

from pyspark.sql.pandas.types import to_arrow_schema

from bench.common import write_result
from lambdalake.batch.identities import TABLE_PROPERTIES
from lambdalake.delta import commit_files
from lambdalake.settings import Settings
from lambdalake.spark.delta import write_table, write_tables
from lambdalake.spark.session import spark_session
from lambdalake.storage import list_files


def rows(spark, n: int):
    return spark.range(n).selectExpr(
        "id % 5000 AS merchant",
        "CAST(id AS DECIMAL(20, 2)) AS amount",
        "timestamp_millis(id) AS window_start",
    )


def parquet_then_delta_rs(df, path: str) -> float:
    """The replaced writer: Spark's Parquet files, then one delta-rs overwrite adopting them."""
    t0 = time.perf_counter()
    folder = f"data/{uuid.uuid4().hex}"
    df.write.mode("errorifexists").parquet(f"{path}/{folder}")
    files = [f"{folder}/{uri.rsplit('/', 1)[1]}" for uri in list_files(f"{path}/{folder}", suffix=".parquet")]
    schema = to_arrow_schema(df.schema, timezone="UTC")
    commit_files(path, files, mode="overwrite", schema=schema, metadata={"lambdalake.run_id": folder})
    return time.perf_counter() - t0


def index_rows(spark, n: int):
    """Rows shaped as the identity index's (two hashes, then the coordinate of the first delivery)."""
    return spark.range(n).selectExpr(
        "xxhash64(id) AS _id_h1", "xxhash64('lambdalake-id', id) AS _id_h2", "'offers' AS _topic",
        "CAST(id % 4 AS INT) AS _partition", "id AS _offset",
        "timestamp_millis(1700000000000 + id) AS _ingest_ts",
    )  # fmt: skip


def index_write(df, path: str, *, properties: dict | None) -> float:
    """One full run's index write: a new table (as a first full run makes), then its overwrite."""
    write_table(df.limit(10), path, mode="overwrite", metadata={"run": "seed"}, properties=properties)
    t0 = time.perf_counter()
    write_table(df, path, mode="overwrite", metadata={"run": uuid.uuid4().hex}, properties=properties)
    return time.perf_counter() - t0


def views_one_by_one(dfs: list, root: str) -> float:
    t0 = time.perf_counter()
    for i, df in enumerate(dfs):
        write_table(df, f"{root}/view{i}", mode="overwrite", metadata={"run": uuid.uuid4().hex})
    return time.perf_counter() - t0


def views_side_by_side(dfs: list, root: str) -> float:
    t0 = time.perf_counter()
    write_tables(
        {
            str(i): partial(
                write_table, df, f"{root}/view{i}", mode="overwrite", metadata={"run": uuid.uuid4().hex}
            )
            for i, df in enumerate(dfs)
        }
    )
    return time.perf_counter() - t0


def delta_spark(df, path: str) -> float:
    t0 = time.perf_counter()
    write_table(df, path, mode="overwrite", metadata={"lambdalake.run_id": uuid.uuid4().hex})
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", type=int, default=2_000)
    parser.add_argument("--large", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument(
        "--index", type=int, default=0,
        help="time an identity index of this many rows written with statistics and without, instead",
    )  # fmt: skip
    parser.add_argument(
        "--together", type=int, default=0,
        help="time this many small views written one after another and side by side, instead",
    )  # fmt: skip
    args = parser.parse_args()
    settings = Settings()
    # A session as a batch run of that many events makes (the quick JIT below 1M, C2 above).
    events = args.index or args.small
    spark = spark_session(settings, "bench-delta-writers", workload="batch", events=events)
    root = tempfile.mkdtemp(prefix="delta-writers-")
    result: dict = {"rounds": args.rounds, "seconds": {}}
    for size in () if args.index or args.together else (args.small, args.large):
        df = rows(spark, size).cache()
        df.count()
        order = [("parquet+delta-rs", parquet_then_delta_rs), ("delta-spark", delta_spark)]
        for name, _ in order:
            result["seconds"][f"{name} {size}"] = []
        for r in range(args.rounds):
            for name, write in order if r % 2 == 0 else order[::-1]:
                took = write(df, f"{root}/{name}-{size}")
                result["seconds"][f"{name} {size}"].append(round(took, 3))
                print(f"round {r} {size:>9,} rows {name:<17} {took:6.2f} s", flush=True)
        df.unpersist()
    if args.index:
        df = index_rows(spark, args.index).cache()
        df.count()
        order = [("index with statistics", None), ("index without", TABLE_PROPERTIES)]
        for r in range(args.rounds):
            for name, properties in order if r % 2 == 0 else order[::-1]:
                took = index_write(df, f"{root}/{uuid.uuid4().hex}", properties=properties)
                result["seconds"].setdefault(f"{name} {args.index}", []).append(round(took, 3))
                print(f"round {r} {args.index:>9,} rows {name:<22} {took:6.2f} s", flush=True)
        df.unpersist()
    if args.together:
        dfs = [rows(spark, args.small * (i + 1)).cache() for i in range(args.together)]
        for df in dfs:
            df.count()
        order = [("views one by one", views_one_by_one), ("views side by side", views_side_by_side)]
        for r in range(args.rounds):
            for name, write in order if r % 2 == 0 else order[::-1]:
                took = write(dfs, f"{root}/{name.replace(' ', '-')}")
                result["seconds"].setdefault(f"{name} {args.together}", []).append(round(took, 3))
                print(f"round {r} {args.together} views {name:<19} {took:6.2f} s", flush=True)
    for key, values in result["seconds"].items():
        later = values[1:] or values
        print(f"{key:<28} first {values[0]:.2f} s, later median {statistics.median(later):.2f} s")
    spark.stop()
    name = "delta_index" if args.index else "delta_views" if args.together else "delta_writers"
    print("->", write_result(name, result), file=sys.stderr)


if __name__ == "__main__":
    main()
