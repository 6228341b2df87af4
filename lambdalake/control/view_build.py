"""Building the view versions ``deploy`` recorded (:mod:`lambdalake.view_versions`), switching serving
to them, and dropping what the versions they replaced leave behind.

A building version is computed beside the active one, as the layers compute every view:

1. open epochs by the speed job (deploy restarted it with the version): its main query moves to
   a new checkpoint that counts a windowed version from the oldest epoch open then
   (``speed.job.START_FILE``); a ``latest`` version is upserted by the main query from its restart on;
2. closed epochs after the active batch's horizon recomputed from the master dataset as ``replay`` does (for a
   ``latest`` version, every epoch after the horizon: its upserts are ranked, so they commute
   with the job's);
3. epochs up to a new horizon by a batch run of every deployed version, published as usual.

A version made because the reader schema widens the old one's stored types
(:mod:`lambdalake.view_types`) is built while the widening schema is held back, and registered
right after the switch, before the speed job restarts without the old version.

Then one lightweight transaction on the metadata row makes it active, conditioned on the active
batch holding it, so serving moves from the old version to the new one between two reads, never
to a mix. The speed job is restarted without the old version, whose tables, Delta view and
checkpoint are then dropped.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pyspark.sql import SparkSession

from lambdalake.cassandra.active import PipelineMeta, read_meta, swap_until_applied, with_deployed_views
from lambdalake.cassandra.session import connect, execute_ddl
from lambdalake.control.changes import Change
from lambdalake.control.processes import Processes
from lambdalake.control.resources import Resources
from lambdalake.errors import LambdalakeError, NothingToCover
from lambdalake.lease import writer_lease
from lambdalake.pipeline import Pipeline, WindowedView
from lambdalake.settings import Settings
from lambdalake.storage import delete_folder
from lambdalake.view_versions import Registry, ViewVersion, retype_pending

Progress = Callable[[str], None]

#: How long the build waits for the speed job to start a version's query, and for the master dataset.
WAIT_S = 300.0


def build_views(
    settings: Settings, pipeline: Pipeline, resources: Resources, processes: Processes, progress: Progress
) -> list[Change]:
    """Build every building version of ``pipeline``'s views and switch serving to them; then drop
    the retired versions. Needs the speed job running with the building versions (deploy started it).
    """
    session = connect(settings.cassandra)
    keyspace = settings.cassandra.keyspace
    registry = read_meta(session, keyspace, pipeline.name).registry
    building = registry.building()
    held = retype_pending(pipeline, registry)
    changes: list[Change] = []
    if building:
        from lambdalake.master import master_of
        from lambdalake.spark.session import spark_session

        with writer_lease(settings, pipeline.name, "view build"):
            spark = spark_session(
                settings, f"lambdalake-build-{pipeline.name}", workload="batch",
                events=master_of(settings, pipeline).num_records(),
            )  # fmt: skip
            try:
                for version in building:
                    cells = _recompute(settings, pipeline, version, spark, progress)
                    detail = f"v{version.version}: {cells:,} speed cells from the master dataset"
                    changes.append(Change(f"view {pipeline.name}.{version.view}", "updated", detail))
                switched = _batch_and_switch(settings, pipeline, building, spark, progress)
            finally:
                spark.stop()
        for version in switched:
            changes.append(Change(f"view {pipeline.name}.{version.view}", "updated",
                                  f"v{version.version} active (serving switched)"))  # fmt: skip
        if held:  # the schema versions that widen their stored types, held back until now
            changes += resources.register_schemas(pipeline)
        progress("restarting the speed job without the versions replaced")
        changes.append(processes.ensure_speed_job(with_deployed_views(session, keyspace, pipeline)))
    changes += drop_retired(settings, pipeline, progress)
    return changes


def _recompute(
    settings: Settings, pipeline: Pipeline, version: ViewVersion, spark: SparkSession, progress: Progress
) -> int:
    """Step 2: the closed epochs after the horizon the speed job's query does not count."""
    from lambdalake.batch.horizon import boundaries
    from lambdalake.master import master_of
    from lambdalake.speed.checkpoints import Checkpoints
    from lambdalake.speed.replay import Replayer

    checkpoints = Checkpoints(settings.storage_root, pipeline.name)
    first_open = None
    if isinstance(version.definition, WindowedView):
        progress(f"{version.name}: waiting for the speed job's query")

        _wait(
            lambda: checkpoints.main_counts(version.name),
            f"the speed job of {pipeline.name!r} to start the query of {version.name}",
        )
        start = checkpoints.view_start(version.name)
        if start is None:  # counted with the job's first checkpoint (a new pipeline, a reset): all counted
            return 0
        first_open = start.epoch
        master = master_of(settings, pipeline)
        needed = boundaries(settings, pipeline, first_open * pipeline.layers.epoch_ms)
        progress(f"{version.name}: waiting for the master dataset to archive every epoch before {first_open}")

        def archived() -> bool:
            read = master.read_progress(list(needed))
            return all(read.get(p, -1) >= o - 1 for p, o in needed.items())

        _wait(
            archived,
            f"the master dataset of {pipeline.name!r} to archive every record before epoch {first_open}",
        )
    active = read_meta(connect(settings.cassandra), settings.cassandra.keyspace, pipeline.name).batch
    replayer = Replayer(
        settings=settings, pipeline=pipeline.model_copy(update={"views": [version.definition]}), spark=spark
    )
    wanted = replayer.master_epochs(after=active.horizon if active else None, before=first_open)
    if not wanted:
        return 0
    progress(f"{version.name}: recomputing {len(wanted)} closed epochs from the master dataset")
    return sum(replayer.recompute(wanted).values())


def _batch_and_switch(
    settings: Settings,
    pipeline: Pipeline,
    building: list[ViewVersion],
    spark: SparkSession,
    progress: Progress,
) -> list[ViewVersion]:
    """Step 3 and the switch: a batch of every deployed version, then the versions made active in
    one conditional write naming the batch that holds them. Returns the versions switched."""
    from lambdalake.batch.job import BatchJob

    session = connect(settings.cassandra)
    keyspace = settings.cassandra.keyspace
    for _attempt in range(3):
        deployed = with_deployed_views(session, keyspace, pipeline)
        progress("running the batch with the new versions")
        try:
            with writer_lease(settings, pipeline.name, "batch run", wait_s=WAIT_S):
                BatchJob(settings=settings, pipeline=deployed, spark=spark).run(progress=progress)
        except NothingToCover:
            if read_meta(session, keyspace, pipeline.name).batch is not None:
                raise
            # No batch is active and none can run yet (no epoch archived whole): the speed rows
            # hold every epoch. Any other refusal (a quality gate, a bad setting) is the user's to see.
        switched = _switch(settings, pipeline.name, {v.name for v in building})
        if switched is not None:
            return switched
        progress("a batch without the new versions was published meanwhile; running the batch again")
    raise LambdalakeError(
        f"the views of {pipeline.name!r} were not switched: every batch published meanwhile lacked them",
        fix=f"run `lambdalake deploy --pipeline {pipeline.name}` again: it resumes the build",
    )


def _switch(settings: Settings, pipeline: str, names: set[str]) -> list[ViewVersion] | None:
    """Make the building versions ``names`` active, if the active batch holds them (None if not)."""
    session = connect(settings.cassandra)

    def decide() -> tuple[PipelineMeta, Registry | None, list[ViewVersion] | None]:
        meta = read_meta(session, settings.cassandra.keyspace, pipeline)
        new = Registry.parse(meta.views_text)
        switched = []
        for state in new.views.values():
            if state.building is None or state.building.name not in names:
                continue  # replaced by a later deploy meanwhile: that deploy builds it
            if meta.batch is not None and state.building.name not in meta.batch.views:
                return meta, None, None
            if state.active is not None:
                new.retired.append(state.active.name)
            state.active, state.building = state.building, None
            switched.append(state.active)
        return meta, new if switched else None, switched

    return swap_until_applied(session, settings.cassandra, pipeline, decide)


def drop_retired(settings: Settings, pipeline: Pipeline, progress: Progress) -> list[Change]:
    """Drop the tables, Delta views and checkpoints of retired versions (the jobs no longer run
    them), and the main query's checkpoints that a move left behind."""
    from lambdalake.layout import view_tables, views_path
    from lambdalake.speed.checkpoints import Checkpoints

    session = connect(settings.cassandra)
    keyspace = settings.cassandra.keyspace
    checkpoints = Checkpoints(settings.storage_root, pipeline.name)
    changes = []
    main = checkpoints.main()
    if main is not None:
        for old in main.earlier_dirs():
            if delete_folder(checkpoints.folder(old)):
                changes.append(Change(f"checkpoint {pipeline.name}/{old}", "removed", "the main query moved"))
    meta = read_meta(session, keyspace, pipeline.name)
    retired = [n for n in meta.registry.retired if n not in {v.name for v in meta.registry.deployed()}]
    if not retired:
        return changes
    session.cluster.refresh_schema_metadata()
    tables = set(session.cluster.metadata.keyspaces[keyspace].tables)
    for name in retired:
        progress(f"dropping version {name}")
        pattern = view_tables(pipeline.name, name)
        for table in sorted(t for t in tables if pattern.match(t)):
            execute_ddl(session, f'DROP TABLE IF EXISTS "{keyspace}"."{table}"', timeout=120)
        delete_folder(checkpoints.folder(name))
        delete_folder(views_path(settings.storage_root, pipeline.name, name))
        changes.append(
            Change(f"view version {pipeline.name}.{name}", "removed", "tables, Delta view, checkpoint")
        )

    def decide() -> tuple[PipelineMeta, Registry, list[Change]]:
        meta = read_meta(session, keyspace, pipeline.name)
        new = Registry.parse(meta.views_text)
        new.retired = [n for n in new.retired if n not in retired]
        return meta, new, changes

    return swap_until_applied(session, settings.cassandra, pipeline.name, decide)


def _wait(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        if time.monotonic() > deadline:
            raise LambdalakeError(
                f"gave up waiting {WAIT_S:.0f} s for {what}",
                fix="check `lambdalake status` and the speed job's log; `lambdalake deploy` again resumes",
            )
        time.sleep(1.0)
