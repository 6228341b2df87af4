"""How a batch view's overwrite costs with today's writer and with delta-spark (issue 46, item 3).

Today a batch view is written by Spark as Parquet files and committed to Delta by delta-rs
(``batch.job.overwrite_table``, which ``BatchJob`` calls: one ``commit_files`` overwrite).
delta-spark writes and commits in the JVM (``df.write.format("delta").mode("overwrite")``). Both
write the same rows, in turn, into tables of their own, in one Spark session made as a batch run
makes its own (``workload="batch"``, the quick JIT below 1M events), for a small view and a large one.

    python -m bench.delta_writers [--small 2000] [--large 1000000] [--rounds 6]
    # -> bench/results/delta_writers.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid

from batch.job import overwrite_table
from bench.common import write_result
from lambdalake import jars
from lambdalake.settings import Settings
from lambdalake.spark.session import spark_session

DELTA_CONF = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
    # The log's state in one task, not 50: these tables have a few files.
    "spark.databricks.delta.snapshotPartitions": "1",
}


def rows(spark, n: int):
    return spark.range(n).selectExpr(
        "id % 5000 AS merchant",
        "CAST(id AS DECIMAL(20, 2)) AS amount",
        "timestamp_millis(id) AS window_start",
    )


def today(df, path: str) -> float:
    t0 = time.perf_counter()
    overwrite_table(df, path, f"data/{uuid.uuid4().hex}", metadata={"lambdalake.rows": "0"})
    return time.perf_counter() - t0


def delta_spark(df, path: str) -> float:
    t0 = time.perf_counter()
    df.write.format("delta").mode("overwrite").option("userMetadata", '{"lambdalake.rows": "0"}').save(path)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", type=int, default=2_000)
    parser.add_argument("--large", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    settings = Settings()
    delta = ",".join(str(j) for j in jars.classpath(settings.cache_dir, "delta"))
    conf = {**settings.spark.conf, **DELTA_CONF, "spark.jars": delta}
    settings = settings.model_copy(update={"spark": settings.spark.model_copy(update={"conf": conf})})
    spark = spark_session(settings, "bench-delta-writers", workload="batch", events=args.small)
    root = tempfile.mkdtemp(prefix="delta-writers-")
    result: dict = {"rounds": args.rounds, "seconds": {}}
    for size in (args.small, args.large):
        df = rows(spark, size).cache()
        df.count()
        order = [("parquet+delta-rs", today), ("delta-spark", delta_spark)]
        for name, _ in order:
            result["seconds"][f"{name} {size}"] = []
        for r in range(args.rounds):
            for name, write in order if r % 2 == 0 else order[::-1]:
                took = write(df, f"{root}/{name}-{size}")
                result["seconds"][f"{name} {size}"].append(round(took, 3))
                print(f"round {r} {size:>9,} rows {name:<17} {took:6.2f} s", flush=True)
        df.unpersist()
    for key, values in result["seconds"].items():
        later = values[1:] or values
        print(f"{key:<28} first {values[0]:.2f} s, later median {statistics.median(later):.2f} s")
    spark.stop()
    print("->", write_result("delta_writers", result), file=sys.stderr)


if __name__ == "__main__":
    main()
