"""The nightly rebuild of one pipeline's views from the master dataset (bronze).

One run:

1. **pin** bronze at its current Delta version and read exactly that version's live files;
2. **horizon**: the newest closed ingest epoch (:mod:`batch.horizon`), or the one asked for;
3. **compute**, with the very view functions the speed layer runs (``lambdalake.spark.views``):
   deduplicate by identity across the whole history (first by ingest time, partition, offset),
   then keep the events of epochs at or before the horizon (dedup first, then the horizon: a copy
   after the horizon of an event before it must not count again later), then every view;
4. **Delta views**: Spark writes each view's Parquet files in parallel under
   ``<storage_root>/views/<pipeline>/<view>/data/<run>/``; delta-rs commits them as one overwrite
   carrying the run's metadata, so history and time travel work;
5. **publish** (:mod:`batch.publish`): rows go to a new Cassandra table per view and version; one
   metadata row then switches serving to it (the atomic swap).

Nothing is collected to the driver but counts. A run killed anywhere leaves the previous Delta
versions and the previous active batch version in place; the next run starts over cleanly.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from functools import partial

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from batch.horizon import Horizon, find_horizon
from batch.run import BatchRun, views_path
from lambdalake.delta import commit_files, open_table
from lambdalake.errors import ConfigurationError
from lambdalake.master import EPOCH_MS, MasterDataset
from lambdalake.master_files import table_path
from lambdalake.pipeline import LatestView, Pipeline
from lambdalake.settings import Settings
from lambdalake.spark.bronze import read_events
from lambdalake.spark.session import spark_session
from lambdalake.spark.views import INGEST_EPOCH, deduplicate, latest, latest_order, windowed
from lambdalake.status import batch_status_file
from lambdalake.storage import list_files, write_text
from lambdalake.views import RANK

log = logging.getLogger("lambdalake.batch")

COPIES = "_copies"


Progress = Callable[[str], None]


class BatchJob:
    """The batch layer of one pipeline.

    Args:
        settings: Cluster addresses and the storage root.
        pipeline: The pipeline definition.
        spark: An existing session; default one built from ``settings.spark``.
    """

    def __init__(self, *, settings: Settings, pipeline: Pipeline, spark: SparkSession | None = None) -> None:
        self.settings = settings
        self.pipeline = pipeline
        self.spark = spark or spark_session(settings, f"lambdalake-batch-{pipeline.name}", workload="batch")
        self.bronze = MasterDataset(
            table_path(settings.storage_root, pipeline.name), event_time=pipeline.event.time
        )

    def run(
        self,
        *,
        horizon: int | None = None,
        as_of_ms: int | None = None,
        dry_run: bool = False,
        publish: bool = True,
        progress: Progress = lambda _stage: None,
    ) -> BatchRun:
        """Rebuild every view up to the horizon; write Delta views and publish unless ``dry_run``.

        Args:
            horizon: Cover epochs up to this one (refused if still open); default the newest closed.
            as_of_ms: Judge "closed" as of this time instead of now.
            dry_run: Compute and count, write nothing.
            publish: Publish to Cassandra after the Delta commits (default True).
            progress: Called with each stage's name as it starts.
        """
        run = BatchRun(
            pipeline=self.pipeline.name, run_id=f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
        )
        clock = partial(_stage, run)
        try:
            with clock("pin"):
                progress("pinning bronze")
                table = open_table(self.bronze.path)
                if table is None:
                    raise ConfigurationError(
                        f"pipeline {self.pipeline.name!r} has no master dataset at {self.bronze.path} yet",
                        fix=f"run the speed job first (`lambdalake speed run {self.pipeline.name}`)",
                    )
                self.bronze.check_layers(self.pipeline.layers, pipeline=self.pipeline.name)
                run.bronze_version = table.version()
                files = table.file_uris()
            with clock("horizon"):
                progress("finding the horizon")
                found = find_horizon(
                    self.settings, self.pipeline, self.bronze, bronze_version=run.bronze_version,
                    requested=horizon, now_ms=as_of_ms,
                )  # fmt: skip
                run.horizon, run.horizon_end_ms, run.boundaries = found.epoch, found.end_ms, found.boundaries
            with clock("read+dedup"):
                progress(f"reading {len(files)} bronze files and deduplicating")
                covered = self._covered(files, found, run, held_twice=self.bronze.may_hold_twice(table=table))
            outputs = {}
            for view in self.pipeline.views:
                with clock(f"view {view.name}"):
                    progress(f"computing {view.name}")
                    outputs[view.name] = self.compute(covered, view).persist()
                    run.rows[view.name] = outputs[view.name].count()
            if dry_run:
                covered.unpersist()
                run.outcome = "dry run"
                return run
            with clock("quality gate"):
                progress("checking the quality gate")
                self._gate(covered, outputs, run)
            for view in self.pipeline.views:
                with clock(f"delta {view.name}"):
                    progress(f"writing the Delta view {view.name}")
                    run.delta_versions[view.name], _ = self._write_view(outputs[view.name], view.name, run)
                outputs[view.name].unpersist()
            covered.unpersist()
            if publish:
                from batch.publish import Publisher

                with clock("publish"):
                    progress("publishing to Cassandra")
                    run.batch_version = Publisher(self.settings, self.pipeline, self.spark).publish(run)
            run.outcome = "published" if publish else "delta only"
            return run
        except BaseException as exc:
            run.outcome = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            raise
        finally:
            if not dry_run:
                write_text(
                    batch_status_file(self.settings.storage_root, self.pipeline.name), json.dumps(asdict(run))
                )

    def _covered(self, files: list[str], horizon: Horizon, run: BatchRun, *, held_twice: bool) -> DataFrame:
        """Bronze deduplicated across all history, then cut at the horizon (cached for the views)."""
        if not files:
            raise ConfigurationError(
                f"the master dataset of {self.pipeline.name!r} holds no files", fix="run the speed job first"
            )
        events = read_events(self.spark, files, self.pipeline, held_twice=held_twice)
        firsts = deduplicate(events, self.pipeline, copies=COPIES).persist()
        counts = firsts.agg(
            F.sum(COPIES).alias("read"),
            F.count(F.lit(1)).alias("distinct"),
            F.sum(F.when(F.col(INGEST_EPOCH) > horizon.epoch, 1).otherwise(0)).alias("after"),
        ).first()
        run.events_read = int(counts["read"] or 0)
        run.duplicates = run.events_read - int(counts["distinct"] or 0)
        run.after_horizon = int(counts["after"] or 0)
        covered = firsts.filter(F.col(INGEST_EPOCH) <= horizon.epoch).drop(COPIES)
        return covered

    def _gate(self, covered: DataFrame, outputs: dict[str, DataFrame], run: BatchRun) -> None:
        """The quality gate on the bronze slice and every view (raises before anything is written)."""
        from batch.quality import QualityGate, bronze_expectations, view_expectations

        gate = QualityGate(self.pipeline, self.settings.pipelines_dir)
        gate.check("bronze", covered, bronze_expectations(self.pipeline))
        for view in self.pipeline.views:
            previous = self._previous_rows(view.name)
            gate.check(view.name, outputs[view.name], view_expectations(view, previous, gate.tolerance))
        root = self.settings.storage_root.rstrip("/")
        run.quality_report = f"{root}/reports/{self.pipeline.name}/{run.run_id}-quality.md"
        gate.finish(run.quality_report)

    def _previous_rows(self, view: str) -> int | None:
        table = open_table(views_path(self.settings.storage_root, self.pipeline.name, view))
        if table is None:
            return None
        rows = table.history(1)[0].get("lambdalake.rows")
        return int(rows) if rows is not None else None

    def compute(self, covered: DataFrame, view) -> DataFrame:
        """One view's batch rows (the speed layer's view functions; ``latest`` rows with their rank)."""
        if isinstance(view, LatestView):
            out = latest(covered, self.pipeline, view)
            return out.withColumn(RANK, latest_order(out, view).cast("long"))
        return windowed(covered, self.pipeline, view)

    def _write_view(self, out: DataFrame, view: str, run: BatchRun) -> tuple[int, int]:
        """Write the rows as Parquet (in parallel, by Spark) and commit them as one Delta overwrite."""
        path = views_path(self.settings.storage_root, self.pipeline.name, view)
        folder = f"data/{run.run_id}"
        out.write.mode("errorifexists").parquet(f"{path}/{folder}")
        written = list_files(f"{path}/{folder}", suffix=".parquet")
        relative = [f"{folder}/{uri.rsplit('/', 1)[1]}" for uri in written]
        version, rows = commit_files(
            path, relative, mode="overwrite", schema=_arrow_schema(out),
            metadata={
                "lambdalake.run_id": run.run_id, "lambdalake.horizon": str(run.horizon),
                "lambdalake.horizon_end_ms": str(run.horizon_end_ms),
                "lambdalake.bronze_version": str(run.bronze_version),
                EPOCH_MS: str(self.pipeline.layers.epoch_ms),
                "lambdalake.rows": str(run.rows[view]),
            },
        )  # fmt: skip
        return version, rows


def _arrow_schema(df: DataFrame):
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(df.schema, timezone="UTC")


@contextmanager
def _stage(run: BatchRun, name: str) -> Iterator[None]:
    """Times one stage of a run into ``run.stages`` (seconds)."""
    t0 = time.monotonic()
    try:
        yield
    finally:
        run.stages[name] = round(time.monotonic() - t0, 3)
