"""A class-data-sharing (CDS) archive of the Spark driver JVM's classes.

A new driver JVM loads and verifies thousands of Spark, Scala and Hadoop classes before its first job
finishes. From a CDS archive it maps them from one file instead. Measured on a 2-core machine: a
session starts in 2.3-3.1 s instead of 5.1 s, and a new process replays 1M events ~2.5 s faster
(BENCHMARKS.md).

``make setup`` builds the archive once per machine (``python -m lambdalake.spark.cds``). A child process
runs a small Spark workload through the code paths the jobs use, and its JVM writes the archive when
it exits (``-XX:ArchiveClassesAtExit``). The file is moved into place only after that JVM has exited
cleanly, because a truncated archive crashes the JVM that maps it.

The JVM checks that an archive matches its own build and the classpath. It starts without an
archive that does not match, so a stale one costs only its gain. Only the local driver JVM uses it:
executors on a cluster start as usual. ``LAMBDALAKE_SPARK__CDS=false`` turns it off.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from lambdalake.settings import Settings
from lambdalake.spark.cds_archive import archive_options, archive_path

__all__ = ["archive_options", "archive_path", "build"]


def build(settings: Settings, *, timeout_s: float = 600) -> Path | None:
    """Build the archive unless it exists; returns its path, or None when the build failed (the jobs
    then run as they would without it)."""
    target = archive_path(settings)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        dump = Path(tmp) / "spark.jsa"
        env = {**os.environ, "LAMBDALAKE_SPARK__CDS": "false", "LAMBDALAKE_SPARK__MASTER": "local[2]"}
        env.pop("LAMBDALAKE_SPARK__CONF", None)
        try:
            done = subprocess.run(
                [sys.executable, "-m", "lambdalake.spark.cds", "--train", str(dump)],
                env=env, capture_output=True, text=True, timeout=timeout_s,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            print(f"the Spark CDS archive was not built: no answer within {timeout_s:g} s", file=sys.stderr)
            return None
        if done.returncode != 0 or not dump.is_file() or dump.stat().st_size == 0:
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
            print(f"the Spark CDS archive was not built (exit {done.returncode}):\n{tail}", file=sys.stderr)
            return None
        dump.replace(target)  # same folder: atomic, so a reader sees no archive or a whole one
    return target


def _train(dump: Path) -> None:
    """Run the code paths the jobs take (runs in the child whose JVM writes ``dump`` at exit)."""
    import pyarrow as pa
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    from lambdalake.settings import get_settings
    from lambdalake.spark.session import driver_java_options, spark_session

    settings = get_settings()
    options = f"{driver_java_options(settings, 'batch')} -XX:ArchiveClassesAtExit={dump}"
    spark_settings = settings.spark.model_copy(update={"conf": {"spark.driver.extraJavaOptions": options}})
    settings = settings.model_copy(update={"spark": spark_settings})
    spark = spark_session(settings, "lambdalake-cds", workload="batch")
    with tempfile.TemporaryDirectory() as tmp:
        events = spark.range(0, 50_000, 1, 2).select(
            F.col("id"),
            (F.col("id") % 500).cast("string").alias("key"),
            F.timestamp_seconds(F.col("id")).alias("ts"),
            (F.rand(1) * 100).alias("value"),
            F.lit(None).cast("decimal(38,0)").alias("rank"),
        )
        events.write.mode("overwrite").parquet(f"{tmp}/events")
        read = spark.read.parquet(f"{tmp}/events").persist()
        repeated = read.groupBy("key").agg(F.count(F.lit(1)).alias("n")).filter("n > 1")
        singles = read.join(repeated, "key", "left_anti")
        picked = (
            read.join(F.broadcast(repeated), "key", "left_semi")
            .groupBy("key")
            .agg(F.min_by(F.struct(*read.columns), F.struct("ts", "id")).alias("e"))
            .select("e.*")
        )
        firsts = singles.unionByName(picked)
        by_window = firsts.groupBy("key", F.window("ts", "1 minute")).agg(
            F.count(F.lit(1)), F.sum("value"), F.min("value"), F.max("value"),
            F.max_by(F.struct("value", "id"), F.struct("ts", -F.col("id"))),
        )  # fmt: skip
        by_window.collect()
        ranked = read.withColumn("r", F.row_number().over(Window.partitionBy("key").orderBy("ts")))
        ranked.filter("r = 1").toArrow()

        def passthrough(batches):  # type: ignore[no-untyped-def]
            for batch in batches:
                yield pa.RecordBatch.from_pydict({"rows": [batch.num_rows]})

        read.mapInArrow(passthrough, "rows long").collect()
        stream = (
            spark.readStream.schema(read.schema)
            .parquet(f"{tmp}/events")
            .withWatermark("ts", "1 minute")
            .dropDuplicatesWithinWatermark(["key", "ts"])
            .writeStream.trigger(availableNow=True)
            .option("checkpointLocation", f"{tmp}/checkpoint")
            .foreachBatch(lambda df, _: df.count())
            .start()
        )
        stream.awaitTermination(300)
        read.unpersist()
    spark.stop()


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--train":
        _train(Path(sys.argv[2]))
        return
    from lambdalake.settings import get_settings

    settings = get_settings()
    path = archive_path(settings)
    if path.is_file():
        print(f"Spark CDS archive: {path} (exists)")
        return
    print("building the Spark driver's class-data-sharing archive (once per machine, ~1 minute)...")
    built = build(settings)
    print(f"Spark CDS archive: {built}" if built else "Spark CDS archive: not built (Spark runs without it)")


if __name__ == "__main__":
    main()
