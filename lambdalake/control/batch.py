"""The batch layer's operations: a run, a restore from a Delta version, and the scheduler's runner."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING

from lambdalake.batch.run import BatchRun
from lambdalake.control.pipelines import deployed_pipeline, quiet
from lambdalake.errors import LambdalakeError, ServiceUnavailable
from lambdalake.lease import writer_lease
from lambdalake.object_store import explain, wait_for_store
from lambdalake.pipeline import Pipeline, configured_pipeline, list_pipelines
from lambdalake.settings import Settings

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger("lambdalake.batch")


#: How many times a batch run starts when the object store stops answering half way through it.
STORE_ATTEMPTS = 3


def run_batch(
    settings: Settings,
    pipeline: str,
    *,
    horizon: int | None = None,
    as_of_ms: int | None = None,
    dry_run: bool = False,
    full: bool = False,
    progress: Callable[[str], None] = quiet,
) -> BatchRun:
    """Bring every view of ``pipeline`` up to the horizon, write the Delta views and publish them as
    a new batch version, under the pipeline's batch lease (a dry run writes nothing and takes none).

    Args:
        horizon: the last ingest epoch to cover (default: the newest closed one); refused while open.
        as_of_ms: take the newest epoch closed at this time instead.
        dry_run: compute and count; write nothing.
        full: rebuild every view from all of the master dataset, though the run could merge.
        progress: told each stage as it starts.

    Raises:
        LambdalakeError: both ``horizon`` and ``as_of_ms``; the lease held (its holder named).
    """
    from lambdalake.batch.job import BatchJob

    if horizon is not None and as_of_ms is not None:
        raise LambdalakeError("give a horizon or an as-of time, not both", fix="drop one of them")
    store = settings.object_store
    wait_for_store(settings, patience_s=store.patience_s,
                   on_wait=lambda: progress(f"waiting for the object store at {store.endpoint}"))  # fmt: skip
    p = deployed_pipeline(settings, pipeline)
    with writer_lease(settings, p.name, "batch run") if not dry_run else nullcontext():
        attempt = 1
        while True:
            try:
                return BatchJob(settings=settings, pipeline=p).run(
                    horizon=horizon, as_of_ms=as_of_ms, dry_run=dry_run, full=full, progress=progress
                )
            except Exception as exc:
                # The store stopped answering half way: what the run wrote is not active (a Delta
                # commit and the batch switch are each atomic, as after a kill), so once the store
                # answers again the run starts over, under the same lease, and its horizon is
                # decided again. Any other failure, or the store gone past the patience, is raised.
                if attempt >= STORE_ATTEMPTS or not isinstance(explain(exc, settings), ServiceUnavailable):
                    raise
            attempt += 1
            told = f"the object store at {store.endpoint} stopped answering half way; waiting to run again"
            log.warning("%s (attempt %d of %d)", told, attempt, STORE_ATTEMPTS)
            progress(told)
            wait_for_store(settings, patience_s=store.patience_s)


def restore(settings: Settings, pipeline: str, *, version: int | None = None) -> BatchRun:
    """Republish the Cassandra batch tables from Delta ``version`` of the views (default the newest)
    as a new batch version, under the batch lease. An older version's horizon is older: the speed
    rows of the epochs in between are rebuilt from the master dataset first, so serving counts every
    event once.

    Raises:
        ConfigurationError: no views yet, no such version, or views of different runs.
    """
    from lambdalake.batch.restore import restore as restore_views
    from lambdalake.master import master_of
    from lambdalake.spark.session import command_session
    from lambdalake.speed.replay import Replayer

    wait_for_store(settings, patience_s=settings.object_store.patience_s)
    p = deployed_pipeline(settings, pipeline)
    with writer_lease(settings, p.name, "batch restore"):
        events = master_of(settings, p).num_records()
        name = f"lambdalake-restore-{p.name}"
        with command_session(settings, name, workload="batch", events=events) as spark:
            replayer = Replayer(settings=settings, pipeline=p, spark=spark)
            return restore_views(settings, p, spark, version=version, rebuild_speed=replayer.recompute)


def schedule(
    settings: Settings,
    pipelines: list[str] | None = None,
    *,
    stop: threading.Event | None = None,
    started: Callable[[list[Pipeline]], None] = lambda _chosen: None,
) -> dict[str, str]:
    """Run each pipeline's batch when its ``[batch] schedule`` (cron, UTC) comes due, each under its
    batch lease, all in one Spark session that ends with the call.

    Args:
        pipelines: the pipelines to schedule (default: every pipeline file).
        stop: run until it is set; without one, run what is due now once and return.
        started: told the pipelines scheduled, once, before the first run.

    Returns:
        Each pipeline's outcome of the runs made (without ``stop``: this call's).
    """
    from lambdalake.batch.job import BatchJob
    from lambdalake.batch.schedule import Scheduler
    from lambdalake.master import master_of
    from lambdalake.spark.session import spark_session

    once = stop is None
    chosen = [configured_pipeline(n, settings) for n in (pipelines or list_pipelines(settings.pipelines_dir))]
    spark: SparkSession | None = None

    def run(p: Pipeline) -> str:
        nonlocal spark
        with writer_lease(settings, p.name, "batch run"):
            if spark is None:
                # A single pass runs what is due and ends: its driver is sized by the largest master dataset
                # it may read. A long-running one keeps the JVM's defaults (the master dataset grows).
                events = None
                if once:
                    counts = [master_of(settings, c).num_records() for c in chosen]
                    events = None if None in counts else max((n or 0 for n in counts), default=0)
                spark = spark_session(settings, "lambdalake-batch-schedule", workload="batch", events=events)
            deployed = deployed_pipeline(settings, p.name)  # the view versions as of this run
            return BatchJob(settings=settings, pipeline=deployed, spark=spark).run().outcome

    scheduler = Scheduler(settings=settings, pipelines=chosen, runner=run, first_run_now=once)
    started(chosen)
    try:
        if stop is None:
            return scheduler.run_due()
        scheduler.run_forever(stop)
        return {}
    finally:
        if spark is not None:  # the session the runs shared: its driver JVM goes with the call
            spark.stop()
