"""The quality gate's cost: one aggregation per dataset against Great Expectations, in one session.

Offers' suite (bronze and its three views, with ``pipelines/offers.expectations.json``) on synthetic
cached frames: ``--rows`` bronze-like rows and views of a twentieth of that. The two paths alternate for
``--rounds`` rounds; each prints its seconds, its Spark jobs and its failed expectations (the same on
both: a view frame lacks one aggregate column on purpose, so a failure is judged too). The first round
is what a batch process pays (each run is a new process: Great Expectations' import and context).

    python -m bench.gate [--rows 200000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

from pyspark.sql import functions as F

from bench.common import bench_settings, write_result
from lambdalake.batch.expectations import evaluate
from lambdalake.batch.quality import QualityGate, bronze_expectations, view_expectations
from lambdalake.pipeline import configured_pipeline
from lambdalake.spark.session import spark_session

NUMBERS = ("price_cents", "stock", "version")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    settings = bench_settings()
    spark = spark_session(settings, "lambdalake-bench-gate", workload="batch")
    pipeline = configured_pipeline("offers", settings)
    text = F.concat(F.lit("v"), (F.col("id") % 7).cast("string"))
    bronze = (
        spark.range(args.rows)
        .select(
            *[(F.col("id") % 500 + 1 if c in NUMBERS else text).alias(c) for c in pipeline.reader_fields],
            F.current_timestamp().alias("_ingest_ts"),
            (F.col("id") % 2).cast("int").alias("_partition"),
            F.col("id").alias("_offset"),
        )
        .withColumns({"status": F.lit("active"), "currency": F.lit("EUR")})
        .withColumn("updated_at", F.current_timestamp())
        .persist()
    )
    bronze.count()
    datasets = [("bronze", bronze, bronze_expectations(pipeline))]
    for view in pipeline.views:
        frame = spark.range(args.rows // 20).select(
            *[F.col("id").cast("string").alias(k) for k in view.key],
            F.current_timestamp().alias("window_start"),
            F.lit(3).alias("updates"),
        )
        frame = frame.persist()
        frame.count()
        datasets.append((view.name, frame, view_expectations(view, args.rows // 20, 0.5)))
    tracker = spark.sparkContext.statusTracker()
    gate = QualityGate(pipeline, settings.pipelines_dir)
    rounds = []
    for i in range(args.rounds):
        for side in ("great_expectations", "one_pass"):
            jobs0, t0, failed = len(tracker.getJobIdsForGroup(None)), time.perf_counter(), []
            for name, frame, specs in datasets:
                if side == "one_pass":
                    verdicts = evaluate(frame, specs)
                else:
                    verdicts = gate._great_expectations(f"{name}-{i}", frame, specs)
                failed += [f"{name}: {v.spec['type']}({v.spec['kwargs']})" for v in verdicts if not v.success]
            seconds = round(time.perf_counter() - t0, 2)
            jobs = len(tracker.getJobIdsForGroup(None)) - jobs0
            failed.sort()
            rounds.append({"round": i, "side": side, "seconds": seconds, "jobs": jobs, "failed": failed})
            print(f"round {i} {side}: {seconds:.2f} s, {jobs} Spark jobs, failed {failed}", flush=True)
    spark.stop()
    path = write_result("gate", {"rows": args.rows, "rounds": rounds})
    print(f"-> {path}")


if __name__ == "__main__":
    main()
