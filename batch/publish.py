"""Publishing batch views to Cassandra: a new table per view and version, then one atomic swap.

Every row of the new version is written to tables of its own (``<pipeline>__<view>__b<version>``)
while serving keeps reading the active version. Only when every row is written does one row of
``lambdalake_batch`` (one partition: an atomic write) switch the active version and horizon. A
publish killed half-way leaves serving on the previous version; its half-written tables are never
activated (the next run takes a higher version number) and are dropped by a later run's retention.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import TYPE_CHECKING, Any

from cassandra.cluster import Session
from pyspark.sql import SparkSession

from lambdalake.cassandra.active import active_batch
from lambdalake.cassandra.session import connect
from lambdalake.cassandra.tables import BATCH_META, batch_table_def, create_keyspace, ensure_table
from lambdalake.cassandra.writer import bulk_options
from lambdalake.delta import open_table
from lambdalake.pipeline import Pipeline
from lambdalake.settings import Settings
from lambdalake.spark.sinks import upsert_view

if TYPE_CHECKING:
    from batch.job import BatchRun

log = logging.getLogger("lambdalake.batch")

#: Published versions kept besides the active one (older ones are dropped).
KEEP_PREVIOUS = 1


class Publisher:
    """Writes a run's Delta views to Cassandra under a new batch version and activates it.

    Delivery guarantee: all or nothing for serving. Rows are written idempotently (absolute values),
    and the version becomes active only after every row of every view was acknowledged.
    """

    def __init__(self, settings: Settings, pipeline: Pipeline, spark: SparkSession) -> None:
        self.settings = settings
        self.pipeline = pipeline
        self.spark = spark
        self.keyspace = settings.cassandra.keyspace

    def _versions_in_use(self, session: Session) -> list[int]:
        """Every batch version that has a table, activated or not (a killed publish's too)."""
        session.cluster.refresh_schema_metadata()
        tables = session.cluster.metadata.keyspaces[self.keyspace].tables
        pattern = re.compile(rf"^{re.escape(self.pipeline.name)}__[a-z0-9_]+__b(\d+)$")
        return sorted({int(m.group(1)) for name in tables if (m := pattern.match(name))})

    def publish(self, run: BatchRun) -> int:
        """Write every view of ``run`` (as committed to Delta) under a new version; activate it.

        Records its steps' seconds in ``run.stages``: ``publish ddl``, ``publish rows``, ``publish
        swap`` (the activation) and ``publish retire`` (dropping versions beyond the retention, after
        serving has moved to the new one: a kill there leaves tables the next run drops)."""
        from batch.job import views_path

        t0 = time.monotonic()
        session = connect(self.settings.cassandra)
        create_keyspace(session, self.settings.cassandra)
        ensure_table(session, self.keyspace, BATCH_META)
        active = active_batch(session, self.keyspace, self.pipeline.name)
        version = max([active.version if active else 0, *self._versions_in_use(session)]) + 1
        tables = {view.name: batch_table_def(self.pipeline, view, version) for view in self.pipeline.views}
        for table in tables.values():
            ensure_table(session, self.keyspace, table)
        t1 = time.monotonic()
        for view in self.pipeline.views:
            delta = open_table(views_path(self.settings.storage_root, self.pipeline.name, view.name),
                               version=run.delta_versions[view.name])  # fmt: skip
            assert delta is not None
            files = delta.file_uris()
            written = 0
            if files:
                # Rows of a version are written once, in bulk, while Cassandra serves nothing from
                # them yet, from as many Python workers as the cluster has cores (a view is often
                # one file).
                rows = self.spark.read.parquet(*files)
                rows = rows.repartition(max(1, self.spark.sparkContext.defaultParallelism))
                cassandra = self.settings.cassandra
                written = upsert_view(
                    rows, table=tables[view.name], cassandra=cassandra, **bulk_options(cassandra)
                )
            log.info("batch v%d: %d rows to %s", version, written, tables[view.name].name)
        t2 = time.monotonic()
        self._activate(session, version, run)
        t3 = time.monotonic()
        self._retire(session, version)
        run.stages.update({"publish ddl": round(t1 - t0, 3), "publish rows": round(t2 - t1, 3),
                           "publish swap": round(t3 - t2, 3),
                           "publish retire": round(time.monotonic() - t3, 3)})  # fmt: skip
        return version

    def _activate(self, session: Session, version: int, run: BatchRun) -> None:
        values: dict[str, Any] = {
            "pipeline": self.pipeline.name, "version": version, "horizon": run.horizon,
            "epoch_ms": self.pipeline.layers.epoch_ms, "bronze_version": run.bronze_version,
            "views": json.dumps(run.delta_versions, sort_keys=True), "published_at": int(time.time() * 1000),
        }  # fmt: skip
        cols = ", ".join(f'"{c}"' for c in values)
        marks = ", ".join("%s" for _ in values)
        session.execute(
            f'INSERT INTO "{self.keyspace}"."{BATCH_META.name}" ({cols}) VALUES ({marks})',
            list(values.values()),
        )

    def _retire(self, session: Session, active: int) -> None:
        """Drop the tables of versions older than the ones kept (never the active one's)."""
        keep = {active, *range(active - KEEP_PREVIOUS, active)}
        for version in self._versions_in_use(session):
            if version in keep or version > active:
                continue
            for view in self.pipeline.views:
                name = batch_table_def(self.pipeline, view, version).name
                session.execute(f'DROP TABLE IF EXISTS "{self.keyspace}"."{name}"', timeout=60)
            log.info("dropped batch version %d of %s", version, self.pipeline.name)
