"""Entry point for ``spark-submit``: run one pipeline's batch on the cluster spark-submit names.

    spark-submit --master spark://spark-master:7077 batch/submit.py offers [--horizon E]

spark-submit owns the session (its ``--master`` and ``--conf`` apply); everything else comes from the
``LAMBDALAKE_*`` settings, as with ``lambdalake batch run``. Executors need lambdalake installed in the
Python that ``PYSPARK_PYTHON`` names.
"""

from __future__ import annotations

import argparse
import sys

from pyspark.sql import SparkSession


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one pipeline's batch under spark-submit.")
    parser.add_argument("pipeline")
    parser.add_argument("--horizon", type=int, default=None)
    args = parser.parse_args(argv)
    from lambdalake.batch.job import BatchJob
    from lambdalake.pipeline import configured_pipeline
    from lambdalake.settings import get_settings

    settings = get_settings()
    spark = SparkSession.builder.getOrCreate()  # spark-submit's master and conf
    run = BatchJob(settings=settings, pipeline=configured_pipeline(args.pipeline, settings), spark=spark).run(
        horizon=args.horizon
    )
    print(f"{run.pipeline}: {run.outcome}, horizon {run.horizon}, batch version {run.batch_version}")
    return 0 if run.outcome in ("published", "delta only") else 1


if __name__ == "__main__":
    sys.exit(main())
