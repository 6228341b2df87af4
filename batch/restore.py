"""Republishing Cassandra batch tables from a Delta version of the views: the serving store can
always be rebuilt from the system of record."""

from __future__ import annotations

from collections.abc import Callable

from pyspark.sql import SparkSession

from lambdalake.batch.publish import Publisher
from lambdalake.batch.run import MASTER_VERSION, RUN_ID, BatchRun
from lambdalake.cassandra.active import active_batch
from lambdalake.cassandra.session import connect
from lambdalake.delta import commit_metadata, open_table
from lambdalake.errors import ConfigurationError
from lambdalake.layout import views_path
from lambdalake.pipeline import Pipeline
from lambdalake.settings import Settings


def restore(
    settings: Settings,
    pipeline: Pipeline,
    spark: SparkSession,
    *,
    version: int | None = None,
    rebuild_speed: Callable[[list[int]], object] | None = None,
) -> BatchRun:
    """Publish the views as Delta ``version`` holds them (default the newest) as a new batch version.

    Every run writes every view, so one Delta version names one run across the views; a version
    whose views come from different runs is refused. A version whose horizon is below the active
    one's moves the horizon back: the speed rows of the epochs in between are rebuilt first with
    ``rebuild_speed`` (given the epochs), or the restore is refused when there is none.

    Raises:
        ConfigurationError: no views yet, no such version, or views of different runs.
    """
    commits = {}
    for view in pipeline.views:
        path = views_path(settings.storage_root, pipeline.name, view.name)
        table = open_table(path)
        if table is None:
            raise ConfigurationError(
                f"view {view.name!r} of {pipeline.name!r} has no Delta table at {path}",
                fix=f"run `lambdalake batch run {pipeline.name}` first",
            )
        wanted = table.version() if version is None else version
        entry = next((commit_metadata(e) for e in table.history() if e.get("version") == wanted), None)
        if entry is None or RUN_ID not in entry or MASTER_VERSION not in entry:
            raise ConfigurationError(
                f"view {view.name!r} has no batch run of this release's layout at Delta version {wanted} "
                f"(newest: {table.version()})",
                fix="pick a version from the view's history (deltalake's DeltaTable(path).history()) "
                'written by a run since the last layout change (docs/operations.md, "Upgrading")',
            )
        commits[view.name] = (wanted, entry)
    runs = {entry[RUN_ID] for _, entry in commits.values()}
    if len(runs) != 1:
        raise ConfigurationError(
            f"Delta version {version} holds views of different batch runs ({sorted(runs)})",
            fix="restore a version every view got from the same run",
        )
    _, entry = next(iter(commits.values()))
    run = BatchRun(
        pipeline=pipeline.name,
        run_id=entry[RUN_ID],
        horizon=int(entry["lambdalake.horizon"]),
        horizon_end_ms=int(entry["lambdalake.horizon_end_ms"]),
        master_version=int(entry[MASTER_VERSION]),
        delta_versions={name: v for name, (v, _) in commits.items()},
        outcome="restored",
    )
    active = active_batch(connect(settings.cassandra), settings.cassandra.keyspace, pipeline.name)
    rebuilt = None
    if rebuild_speed is not None and active is not None and run.horizon < active.horizon:
        rebuild_speed(list(range(run.horizon + 1, active.horizon + 1)))
        rebuilt = active.horizon
    run.batch_version = Publisher(settings, pipeline, spark).publish(run, rebuilt_through=rebuilt)
    return run
