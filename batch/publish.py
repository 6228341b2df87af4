"""Publishing batch views to Cassandra: cells versioned in generation tables, then one atomic swap.

A full run starts a *generation*: every row of its views goes to tables of their own
(``<pipeline>__<view>__b<version>``) while serving keeps reading the active version. An incremental
run writes only the cells it changed, into its base's generation tables, each row marked with its
batch version (:data:`lambdalake.views.CELL_VERSION`): a reader of version ``N`` takes, per cell, the
newest row not above ``N`` (as Druid's segment versions overshadow per time chunk), so rows of a
version not yet active are never read. Only when every row is written does one row of
``lambdalake_batch`` (one partition: an atomic write) switch the active version, generation and
horizon; an incremental swap is conditioned on its base still being active.

Publishes need no lock of their own: the version number is claimed with ``INSERT ... IF NOT EXISTS``,
the switch is a lightweight transaction conditioned on the version it replaces (and refuses a horizon
below that version's), and only generations older than the one replaced are dropped. A publish killed
half-way leaves serving on the previous version: its rows are never activated (the next run takes a
higher version number, and, its Delta views being newer than the active batch's, is a full run in a
new generation), and its tables are dropped by a later run's retention. A generation takes at most
:data:`REGENERATE_EVERY` versions, so a cell holds a bounded number of rows; then a publish writes
every row of the views into a new one.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from cassandra.cluster import Session
from cassandra.query import SimpleStatement
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from lambdalake.batch.run import BatchRun
from lambdalake.cassandra.active import ActiveBatch, active_batch, lwt, read_meta
from lambdalake.cassandra.session import connect, execute_ddl, execute_lwt, hosts_down, refresh_metadata
from lambdalake.cassandra.tables import (
    BATCH_CLAIMS,
    BATCH_META,
    batch_table_def,
    create_keyspace,
    ensure_table,
)
from lambdalake.cassandra.writer import bulk_options
from lambdalake.errors import ConfigurationError
from lambdalake.layout import batch_generation, views_path
from lambdalake.pipeline import Pipeline
from lambdalake.settings import Settings
from lambdalake.spark.delta import read_table
from lambdalake.spark.sinks import upsert_view
from lambdalake.views import CELL_VERSION

log = logging.getLogger("lambdalake.batch")

#: Published versions kept besides the active one (older generations are dropped).
KEEP_PREVIOUS = 1
#: Versions one generation takes before a publish starts a new one (every row written again).
REGENERATE_EVERY = 7


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
        """Every generation that has a table, activated or not (a killed publish's too)."""
        refresh_metadata(session, self.keyspace)
        tables = session.cluster.metadata.keyspaces[self.keyspace].tables
        generations = (batch_generation(self.pipeline.name, name) for name in tables)
        return sorted({g for g in generations if g is not None})

    def publish(
        self,
        run: BatchRun,
        *,
        rebuilt_through: int | None = None,
        changed: Mapping[str, DataFrame] | None = None,
        base: ActiveBatch | None = None,
        committed: Mapping[str, DataFrame] | None = None,
    ) -> int:
        """Write the views of ``run`` under a new version; activate it.

        Records its steps' seconds in ``run.stages``: ``publish ddl``, ``publish rows``, ``publish
        swap`` (the activation) and ``publish retire`` (dropping generations beyond the retention,
        after serving has moved to the new one: a kill there leaves tables the next run drops), and
        the rows it wrote per view in ``run.rows_written``.

        Args:
            run: The run whose Delta views are published.
            rebuilt_through: The speed rows of epochs after ``run.horizon`` up to this one were
                rebuilt from the master dataset (a restore of an older version): the horizon may move back
                that far. Default None: a horizon below the active one's is refused.
            changed: An incremental run's changed cells: per view (internal name), their rows as the
                run's Delta view holds them. They join ``base``'s generation, unless it is full
                (:data:`REGENERATE_EVERY`). None (default): every row of the Delta views, in a new
                generation.
            base: The active version an incremental run merged into; the swap requires it active.
            committed: Per view (internal name), every row the run committed to its Delta view, as the run
                still holds them (cached). None (default): read back from each Delta view at the
                run's version (a restore, which computed none). The run's own rows spare two
                reconstructions of each view's Delta log state per publish.
        """
        t0 = time.monotonic()
        session = connect(self.settings.cassandra)
        create_keyspace(session, self.settings.cassandra)
        ensure_table(session, self.keyspace, BATCH_META)
        ensure_table(session, self.keyspace, BATCH_CLAIMS)
        active = active_batch(session, self.keyspace, self.pipeline.name)
        self._refuse_below(active, run, rebuilt_through)  # early; decided again at the swap
        version = self._claim(session, active, run)
        cells = changed is not None and base is not None and version - base.generation < REGENERATE_EVERY
        generation = base.generation if cells and base is not None else version
        tables = {view.name: batch_table_def(self.pipeline, view, generation) for view in self.pipeline.views}
        if not cells:
            for table in tables.values():
                ensure_table(session, self.keyspace, table)
        # A node down now takes this version's tables from the others when it returns; until it
        # has them, serving and writers route around it (lambdalake.cassandra.routing).
        run.cassandra_down = hosts_down(session)
        if run.cassandra_down:
            log.warning(
                "batch v%d published with Cassandra node(s) %s down", version, ", ".join(run.cassandra_down)
            )
        run.publish = "changed cells" if cells else "new generation"
        t1 = time.monotonic()
        for view in self.pipeline.views:
            if cells and changed is not None:
                rows = changed[view.name]
            elif committed is not None:
                rows = committed[view.name]
            else:
                rows = self._delta_rows(run, view.name)
            written = 0
            if rows is not None:
                # Rows of a version are written once, in bulk, while Cassandra serves nothing from
                # them yet, from as many Python workers as the cluster has cores (a view is often
                # one file).
                rows = rows.withColumn(CELL_VERSION, F.lit(version).cast("long"))
                rows = rows.repartition(max(1, self.spark.sparkContext.defaultParallelism))
                cassandra = self.settings.cassandra
                written = upsert_view(
                    rows, table=tables[view.name], cassandra=cassandra, **bulk_options(cassandra)
                )
            run.rows_written[view.name] = written
            log.info("batch v%d: %d rows to %s", version, written, tables[view.name].name)
        t2 = time.monotonic()
        expect = base.version if cells and base is not None else None
        replaced = self._activate(session, version, generation, run, rebuilt_through, expect=expect)
        t3 = time.monotonic()
        self._retire(session, generation, replaced)
        run.stages.update({"publish ddl": round(t1 - t0, 3), "publish rows": round(t2 - t1, 3),
                           "publish swap": round(t3 - t2, 3),
                           "publish retire": round(time.monotonic() - t3, 3)})  # fmt: skip
        return version

    def _delta_rows(self, run: BatchRun, view: str) -> DataFrame | None:
        """Every row of ``view`` as the run committed it to Delta (None: no rows)."""
        path = views_path(self.settings.storage_root, self.pipeline.name, view)
        return read_table(self.spark, path, version=run.delta_versions[view])

    def _refuse_below(self, active: ActiveBatch | None, run: BatchRun, rebuilt_through: int | None) -> None:
        """A version whose horizon is below the active one's would move the horizon back with no
        speed rows for the epochs in between (the speed layer left them to the batch): refused,
        unless those rows were rebuilt."""
        if active is None or run.horizon >= active.horizon:
            return
        if rebuilt_through is not None and rebuilt_through >= active.horizon:
            return
        raise ConfigurationError(
            f"batch version {active.version} of {self.pipeline.name!r} is active with horizon "
            f"{active.horizon}; this run's horizon {run.horizon} is older: serving would count the "
            f"events of epochs {run.horizon + 1}..{active.horizon} nowhere",
            fix=f"run `lambdalake batch run {self.pipeline.name}` (the newest closed epoch); "
            f"`lambdalake batch restore {self.pipeline.name}` of an older version rebuilds those "
            "epochs' speed rows from the master dataset first",
        )

    def _claim(self, session: Session, active: ActiveBatch | None, run: BatchRun) -> int:
        """A version number no other publish has or will have (``INSERT ... IF NOT EXISTS``)."""
        claim = SimpleStatement(
            f'INSERT INTO "{self.keyspace}"."{BATCH_CLAIMS.name}" (pipeline, version, run_id, claimed_at) '
            "VALUES (%s, %s, %s, %s) IF NOT EXISTS",
        )  # fmt: skip
        claimed = [
            r.version
            for r in session.execute(
                SimpleStatement(
                    f'SELECT version FROM "{self.keyspace}"."{BATCH_CLAIMS.name}" WHERE pipeline = %s'
                ),
                [self.pipeline.name],
            )
        ]
        version = max([active.version if active else 0, *self._versions_in_use(session), *claimed]) + 1
        while not execute_lwt(
            session, claim, [self.pipeline.name, version, run.run_id, int(time.time() * 1000)],
            mine=lambda row: row.run_id == run.run_id,
        ):  # fmt: skip
            version += 1
        return version

    def _activate(
        self,
        session: Session,
        version: int,
        generation: int,
        run: BatchRun,
        rebuilt_through: int | None,
        *,
        expect: int | None = None,
    ) -> ActiveBatch | None:
        """Switch the active pointer to ``version`` with a lightweight transaction conditioned on
        the version it replaces, so two publishes never both believe they won, and the horizon
        check is made against exactly the version replaced. Returns that version (None: none).

        Raises:
            ConfigurationError: the active version moved to a horizon above this run's meanwhile, or
                away from ``expect`` (the base an incremental run's cells were merged into).
        """
        values: dict[str, Any] = {
            "version": version, "generation": generation, "horizon": run.horizon,
            "epoch_ms": self.pipeline.layers.epoch_ms,
            "master_version": run.master_version, "views": json.dumps(run.delta_versions, sort_keys=True),
            "published_at": int(time.time() * 1000),
        }  # fmt: skip
        table = f'"{self.keyspace}"."{BATCH_META.name}"'
        sets = ", ".join(f'"{c}" = %s' for c in values)
        where = 'WHERE pipeline = %s IF "version" = %s AND view_versions = %s'
        update = lwt(f"UPDATE {table} SET {sets} {where}")
        cols = ", ".join(f'"{c}"' for c in ["pipeline", *values])
        marks = ", ".join("%s" for _ in range(len(values) + 1))
        insert = lwt(f"INSERT INTO {table} ({cols}) VALUES ({marks}) IF NOT EXISTS")
        while True:
            meta = read_meta(session, self.keyspace, self.pipeline.name)
            active = meta.batch
            self._refuse_below(active, run, rebuilt_through)
            if expect is not None and (active is None or active.version != expect):
                raise ConfigurationError(
                    f"batch version {active.version if active else None} of {self.pipeline.name!r} became "
                    f"active while this incremental run merged into version {expect}; nothing was activated",
                    fix=f"run `lambdalake batch run {self.pipeline.name}` again",
                )
            # Serving reads each view's active version from this row's batch: one this run did not
            # build (a version switched while it ran) would have no rows in it.
            missing = sorted(meta.registry.active_names() - set(run.delta_versions))
            if missing:
                raise ConfigurationError(
                    f"the active versions of views of {self.pipeline.name!r} changed while this run ran: "
                    f"it did not build {', '.join(missing)}; nothing was activated",
                    fix=f"run `lambdalake batch run {self.pipeline.name}` again",
                )

            def mine(row: Any) -> bool:  # an attempt whose answer was lost applied this very version
                return row.version == version

            if meta.row_version is None:
                applied = execute_lwt(session, insert, [self.pipeline.name, *values.values()], mine=mine)
            else:
                where_values = [self.pipeline.name, meta.row_version, meta.views_text]
                applied = execute_lwt(session, update, [*values.values(), *where_values], mine=mine)
            if applied:
                return active
            log.info("the metadata row of %s moved meanwhile; deciding again", self.pipeline.name)

    def _retire(self, session: Session, generation: int, replaced: ActiveBatch | None) -> None:
        """Drop the tables of generations older than the one of the version this publish replaced
        (kept one more run: serving may still read it for a moment, and it may be restored).
        Generations above it are left alone: another run may be writing or activating them."""
        if replaced is None:
            return
        for old in self._versions_in_use(session):
            if old >= replaced.generation - (KEEP_PREVIOUS - 1) or old == generation:
                continue
            for view in self.pipeline.views:
                name = batch_table_def(self.pipeline, view, old).name
                execute_ddl(session, f'DROP TABLE IF EXISTS "{self.keyspace}"."{name}"')
            log.info("dropped batch generation %d of %s", old, self.pipeline.name)
