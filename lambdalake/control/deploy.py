"""``deploy``: make the platform match the pipeline definitions, idempotently. Resources first
(:mod:`lambdalake.control.resources`: topics and their configs, schema versions, the view versions'
record, Cassandra tables, grants; all checked before anything changes), then the processes that run
them (:mod:`lambdalake.control.processes`: the speed jobs, the batch scheduler, the serving API), then
the view versions a changed definition records (:mod:`lambdalake.control.view_build`).

Each step reports what it changed; a second deploy of the same definitions reports no changes. A
running job is restarted only when what it runs changed: the pipeline's files (definition, schemas,
expectations) or the settings it was started with. Jobs run as ``lambdalake speed run <pipeline>``,
the Spark driver in this machine's process and the executors on ``settings.spark.master`` (``local``
by default; ``spark://`` or ``k8s://`` by setting), with PID files and logs beside the services'.
"""

from __future__ import annotations

from collections.abc import Callable

from lambdalake.control.changes import Change
from lambdalake.control.processes import Processes
from lambdalake.control.resources import Resources
from lambdalake.control.view_build import build_views
from lambdalake.settings import Settings


def deploy(
    settings: Settings,
    pipelines: list[str] | None = None,
    *,
    apply_topic_configs: bool = True,
    start_jobs: bool = True,
    progress: Callable[[str, str], None] = lambda _pipeline, _step: None,
) -> list[Change]:
    """Make the platform match the pipeline definitions, idempotently, and build the view versions a
    changed definition records (:mod:`lambdalake.control.view_build`), switching serving to them.

    Args:
        pipelines: the pipelines to deploy (default: every file of the pipelines folder); all are
            validated before anything changes.
        apply_topic_configs: set topic configs that differ from the definitions (never partitions).
        start_jobs: start or restart the speed jobs, the batch scheduler and the serving API, and
            build changed views (which needs the jobs); without it, topics, schemas and tables only.
        progress: told (pipeline, step) as a view build moves on.

    Returns:
        Every change, unchanged ones too; a second call reports none changed.
    """
    from lambdalake.pipeline import configured_pipeline, list_pipelines

    names = pipelines or list_pipelines(settings.pipelines_dir)
    chosen = [configured_pipeline(name, settings) for name in dict.fromkeys(names)]
    resources = Resources(settings, apply_topic_configs=apply_topic_configs)
    processes = Processes(settings)
    resources.check(chosen)
    changes: list[Change] = []
    for p in chosen:
        deployed, made = resources.make(p)
        changes += made
        if start_jobs:
            changes.append(processes.ensure_speed_job(deployed))
    if start_jobs:
        changes.append(processes.ensure_scheduler())
        changes.append(processes.ensure_serving())
        for p in chosen:  # a view version is built while the jobs run it
            step = lambda text, name=p.name: progress(name, text)  # noqa: E731
            changes += build_views(settings, p, resources, processes, step)
    return changes
