"""The nightly rebuild of one pipeline's views from the master dataset.

One run:

1. **pin** the master dataset at its current Delta version and read exactly that version's live files;
2. **horizon**: the newest closed ingest epoch (:mod:`batch.horizon`), or the one asked for;
3. **compute**, with the very view functions the speed layer runs (``lambdalake.spark.views``):
   deduplicate by identity across the whole history (first by ingest time, partition, offset),
   then keep the events of epochs at or before the horizon (dedup first, then the horizon: a copy
   after the horizon of an event before it must not count again later), then every view;
4. **Delta views**: delta-spark writes each view as one overwrite of its table
   (``<storage_root>/views/<pipeline>/<view>``) carrying the run's metadata, so history and time
   travel work;
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
from typing import Any

from deltalake import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_schema

from lambdalake.batch.horizon import Horizon, find_horizon
from lambdalake.batch.identities import EARLIER, KNOWN, IdentityIndex, classify
from lambdalake.batch.incremental import (
    BOUNDARIES,
    FullRunNeeded,
    Increment,
    changed_by,
    files_for,
    find_base,
    in_ranges,
    old_epochs,
    plan,
)
from lambdalake.batch.merge import TOUCHED, merge_latest, merge_windowed, read_view, same_columns
from lambdalake.batch.run import MASTER_VERSION, RUN_ID, BatchRun
from lambdalake.delta import commit_metadata, open_table
from lambdalake.errors import NothingToCover
from lambdalake.latest import OFFSET, PARTITION
from lambdalake.layout import batch_status_file, quality_report, views_path
from lambdalake.master import EPOCH_MS, master_of
from lambdalake.pipeline import LatestView, Pipeline
from lambdalake.settings import Settings
from lambdalake.spark.delta import write_table, write_tables
from lambdalake.spark.master import master_schema, read_events
from lambdalake.spark.session import spark_session
from lambdalake.spark.views import INGEST_EPOCH, deduplicate, latest, windowed
from lambdalake.storage import write_text
from lambdalake.view_versions import public_name

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
        self.master = master_of(settings, pipeline)
        self.spark = spark or spark_session(
            settings, f"lambdalake-batch-{pipeline.name}", workload="batch", events=self.master.num_records()
        )

    def run(
        self,
        *,
        horizon: int | None = None,
        as_of_ms: int | None = None,
        dry_run: bool = False,
        publish: bool = True,
        full: bool = False,
        progress: Progress = lambda _stage: None,
    ) -> BatchRun:
        """Bring every view up to the horizon; write Delta views and publish unless ``dry_run``.

        Incremental when it can (:mod:`batch.incremental`): the rows the master dataset added since the active
        batch, merged into its views; else, and when ``full``, every view rebuilt from all of the master
        dataset.

        Args:
            horizon: Cover epochs up to this one (refused if still open); default the newest closed.
            as_of_ms: Judge "closed" as of this time instead of now.
            dry_run: Compute and count, write nothing.
            publish: Publish to Cassandra after the Delta commits (default True).
            full: Rebuild from all of the master dataset even when an incremental run could (default False).
            progress: Called with each stage's name as it starts.
        """
        run = BatchRun(
            pipeline=self.pipeline.name, run_id=f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
        )
        clock = partial(_stage, run)
        cached: list[DataFrame] = []
        try:
            table, found = self._pin(run, clock, progress, horizon=horizon, as_of_ms=as_of_ms)
            increment, events, outputs, changed = self._outputs(
                found, run, table, cached, clock, progress, full=full
            )
            if dry_run:
                run.outcome = "dry run"
                return run
            self._write(run, increment, events, outputs, changed, clock, progress, publish=publish)
            run.outcome = "published" if publish else "delta only"
            return run
        except BaseException as exc:
            run.outcome = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            raise
        finally:
            _unpersist(cached)
            if not dry_run:
                write_text(
                    batch_status_file(self.settings.storage_root, self.pipeline.name), json.dumps(asdict(run))
                )

    def _pin(
        self, run: BatchRun, clock: Any, progress: Progress, *, horizon: int | None, as_of_ms: int | None
    ) -> tuple[DeltaTable, Horizon]:
        """The master dataset's version this run reads, and the horizon it covers (recorded in ``run``)."""
        with clock("pin"):
            progress("pinning the master dataset")
            table = open_table(self.master.path)
            if table is None:
                raise NothingToCover(
                    f"pipeline {self.pipeline.name!r} has no master dataset at {self.master.path} yet",
                    fix=f"run the speed job first (`lambdalake speed run {self.pipeline.name}`)",
                )
            self.master.check_layers(self.pipeline.layers, pipeline=self.pipeline.name)
            run.master_version = table.version()
        with clock("horizon"):
            progress("finding the horizon")
            found = find_horizon(
                self.settings, self.pipeline, self.master, master_version=run.master_version,
                requested=horizon, now_ms=as_of_ms,
            )  # fmt: skip
            run.horizon, run.horizon_end_ms, run.boundaries = found.epoch, found.end_ms, found.boundaries
        return table, found

    def _outputs(
        self,
        found: Horizon,
        run: BatchRun,
        table: DeltaTable,
        cached: list[DataFrame],
        clock: Any,
        progress: Progress,
        *,
        full: bool,
    ) -> tuple[Increment | None, DataFrame, dict[str, DataFrame], dict[str, DataFrame] | None]:
        """Every view's rows up to the horizon: merged into the active batch's when an increment
        can be (its changed cells too), else computed from all of the master dataset. Returns the increment
        (None: a full run), the events counted, the views' rows and the changed cells."""
        with clock("plan"):
            progress("finding what changed since the active batch")
            increment = self._plan(found, run, table, full=full)
        if increment is not None:
            try:
                events, outputs, changed = self._incremental(increment, found, run, table, cached, clock)
                return increment, events, outputs, changed
            except FullRunNeeded as why:
                run.kind, run.reason = "full", str(why)
                run.new_epochs, run.changed_epochs, run.changed_by = [], [], []
                _unpersist(cached)
                cached.clear()
        outputs: dict[str, DataFrame] = {}
        with clock("read+dedup"):
            files = table.file_uris()
            progress(f"reading {len(files)} master dataset files and deduplicating")
            held_twice = self.master.may_hold_twice(table=table)
            events = self._covered(files, found, run, cached, held_twice=held_twice)
        for view in self.pipeline.views:
            with clock(f"view {view.name}"):
                progress(f"computing {view.name}")
                outputs[view.name] = self.compute(events, view).persist()
                cached.append(outputs[view.name])
                run.rows[view.name] = outputs[view.name].count()
        return None, events, outputs, None

    def _write(
        self,
        run: BatchRun,
        increment: Increment | None,
        events: DataFrame,
        outputs: dict[str, DataFrame],
        changed: dict[str, DataFrame] | None,
        clock: Any,
        progress: Progress,
        *,
        publish: bool,
    ) -> None:
        """The quality gate, then the Delta views, the identity index and (``publish``) Cassandra."""
        with clock("quality gate"):
            progress("checking the quality gate")
            self._gate(events, outputs, run)
        with clock("delta views"):
            progress(f"writing the Delta views ({', '.join(v.name for v in self.pipeline.views)})")
            run.delta_versions.update(self._write_views(outputs, run))
        with clock("identity index"):
            # After the views: index and views of one run, or the previous run's index (the next
            # run, finding them apart, is a full one).
            progress("recording the identities counted")
            IdentityIndex(self.settings, self.pipeline).write(
                events, run, mode="append" if increment is not None else "overwrite"
            )
        if publish:
            from lambdalake.batch.publish import Publisher

            with clock("publish"):
                progress("publishing to Cassandra")
                base = increment.base.active if increment is not None else None
                run.batch_version = Publisher(self.settings, self.pipeline, self.spark).publish(
                    run, changed=changed, base=base, committed=outputs
                )

    def _plan(self, found: Horizon, run: BatchRun, table: DeltaTable, *, full: bool) -> Increment | None:
        """The increment this run merges into the active batch, or None (a full run; ``run.reason``
        says why)."""
        if full:
            run.reason = "asked for (--full)"
            return None
        base = find_base(self.settings, self.pipeline, horizon=found.epoch)
        if isinstance(base, str):
            run.reason = base
            return None
        increment = plan(base, self.master, master_version=run.master_version, boundaries=found.boundaries)
        run.kind = "incremental"
        run.reason = f"merged into batch version {base.active.version} (horizon {base.horizon})"
        run.new_epochs = [base.horizon + 1, found.epoch] if found.epoch > base.horizon else []
        return increment

    def _incremental(
        self,
        increment: Increment,
        found: Horizon,
        run: BatchRun,
        table: DeltaTable,
        cached: list[DataFrame],
        clock: Callable[[str], Any],
    ) -> tuple[DataFrame, dict[str, DataFrame], dict[str, DataFrame]]:
        """The new events (first deliveries of identities the index lacks), each view merged into
        the base's, and each view's changed cells.

        Raises:
            FullRunNeeded: what this run met that only a full run computes exactly.
        """
        with clock("read+dedup"):
            files = files_for(self.master, increment.ranges, table)
            if files:
                held_twice = self.master.may_hold_twice(table=table)
                read = read_events(self.spark, files, self.pipeline, held_twice=held_twice)
                delivered = read.filter(in_ranges(increment.ranges) & (F.col(INGEST_EPOCH) <= found.epoch))
            else:
                delivered = self.spark.createDataFrame([], from_arrow_schema(master_schema(self.pipeline)))
            firsts = deduplicate(delivered, self.pipeline, copies=COPIES).persist()
            cached.append(firsts)
            index = IdentityIndex(self.settings, self.pipeline).read(self.spark)
            classified = classify(firsts, index, self.pipeline, rows=firsts.count()).persist()
            cached.append(classified)
            counts = classified.agg(
                F.sum(COPIES).alias("read"),
                F.sum(F.when(F.col(KNOWN), 0).otherwise(1)).alias("new"),
                F.sum(F.when(F.col(EARLIER), 1).otherwise(0)).alias("earlier"),
            ).first()
            events = classified.filter(~F.col(KNOWN)).drop(COPIES, KNOWN, EARLIER)
            run.changed_epochs, coordinates = old_epochs(events, increment.base.horizon)
            if run.changed_epochs or counts["earlier"]:
                run.changed_by = changed_by(
                    self.master, increment, coordinates, master_version=run.master_version
                )
            if counts["earlier"]:
                raise FullRunNeeded(
                    "records the master dataset archived into epochs the active batch covered (commits "
                    f"{run.changed_by}) precede the counted copies of {counts['earlier']} identities"
                )
            run.events_read = int(counts["read"] or 0)
            run.duplicates = run.events_read - int(counts["new"] or 0)
        outputs, changed = {}, {}
        for view in self.pipeline.views:
            with clock(f"view {view.name}"):
                rows = self.compute(events, view)
                path = views_path(self.settings.storage_root, self.pipeline.name, view.name)
                previous = read_view(self.spark, path, increment.base.delta_versions[view.name], rows.schema)
                if not same_columns(rows, previous):
                    name = public_name(view.name)
                    raise FullRunNeeded(f"the columns of view {name!r} changed (a schema change)")
                merge = merge_latest if isinstance(view, LatestView) else merge_windowed
                out = merge(previous, rows, view).persist()  # type: ignore[arg-type]
                cached.append(out)
                outputs[view.name] = out.drop(TOUCHED)
                changed[view.name] = out.filter(F.col(TOUCHED)).drop(TOUCHED)
                run.rows[view.name] = out.count()
        return events, outputs, changed

    def _covered(
        self, files: list[str], horizon: Horizon, run: BatchRun, cached: list[DataFrame], *, held_twice: bool
    ) -> DataFrame:
        """The master dataset deduplicated across all history, then cut at the horizon (cached for the
        views)."""
        if not files:
            raise NothingToCover(
                f"the master dataset of {self.pipeline.name!r} holds no files", fix="run the speed job first"
            )
        events = read_events(self.spark, files, self.pipeline, held_twice=held_twice)
        firsts = deduplicate(events, self.pipeline, copies=COPIES).persist()
        cached.append(firsts)
        counts = firsts.agg(
            F.sum(COPIES).alias("read"),
            F.count(F.lit(1)).alias("distinct"),
            F.sum(F.when(F.col(INGEST_EPOCH) > horizon.epoch, 1).otherwise(0)).alias("after"),
        ).first()
        run.events_read = int(counts["read"] or 0)
        run.duplicates = run.events_read - int(counts["distinct"] or 0)
        run.after_horizon = int(counts["after"] or 0)
        return firsts.filter(F.col(INGEST_EPOCH) <= horizon.epoch).drop(COPIES)

    def _gate(self, covered: DataFrame, outputs: dict[str, DataFrame], run: BatchRun) -> None:
        """The quality gate on the master dataset slice and every view (raises before anything is written)."""
        from lambdalake.batch.quality import QualityGate, master_expectations, view_expectations

        gate = QualityGate(self.pipeline, self.settings.pipelines_dir)
        gate.check("master", covered, master_expectations(self.pipeline))
        for view in self.pipeline.views:
            previous = self._previous_rows(view.name)
            gate.check(view.name, outputs[view.name], view_expectations(view, previous, gate.tolerance))
        run.quality_report = quality_report(self.settings.storage_root, self.pipeline.name, run.run_id)
        gate.finish(run.quality_report)

    def _previous_rows(self, view: str) -> int | None:
        table = open_table(views_path(self.settings.storage_root, self.pipeline.name, view))
        if table is None:
            return None
        rows = commit_metadata(table.history(1)[0]).get("lambdalake.rows")
        return int(rows) if rows is not None else None

    def compute(self, covered: DataFrame, view) -> DataFrame:
        """One view's batch rows (the speed layer's view functions; ``latest`` rows with their rank)."""
        if isinstance(view, LatestView):
            return latest(covered, self.pipeline, view, carry=(PARTITION, OFFSET), rank=True)
        return windowed(covered, self.pipeline, view)

    def _write_views(self, outputs: dict[str, DataFrame], run: BatchRun) -> dict[str, int]:
        """Every view's Delta overwrite, side by side (:func:`write_tables`); returns their versions."""
        names = [view.name for view in self.pipeline.views]
        return write_tables({name: partial(self._write_view, outputs[name], name, run) for name in names})

    def _write_view(self, out: DataFrame, view: str, run: BatchRun) -> int:
        """Write the rows as one Delta overwrite of the view's table naming the run; returns its version."""
        return write_table(
            out, views_path(self.settings.storage_root, self.pipeline.name, view), mode="overwrite",
            metadata={
                RUN_ID: run.run_id, "lambdalake.horizon": str(run.horizon),
                "lambdalake.horizon_end_ms": str(run.horizon_end_ms),
                MASTER_VERSION: str(run.master_version),
                EPOCH_MS: str(self.pipeline.layers.epoch_ms),
                "lambdalake.rows": str(run.rows[view]), "lambdalake.kind": run.kind,
                BOUNDARIES: json.dumps(run.boundaries, sort_keys=True),
            },
        )  # fmt: skip


def _unpersist(cached: list[DataFrame]) -> None:
    for df in cached:
        df.unpersist()
    cached.clear()


@contextmanager
def _stage(run: BatchRun, name: str) -> Iterator[None]:
    """Times one stage of a run into ``run.stages`` (seconds)."""
    t0 = time.monotonic()
    try:
        yield
    finally:
        run.stages[name] = round(time.monotonic() - t0, 3)
