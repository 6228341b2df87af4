"""Replay a range of a pipeline's topic into the master dataset and the speed views, then the batch it
leaves."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lambdalake.batch.run import BatchRun
from lambdalake.control.pipelines import deployed_pipeline, quiet
from lambdalake.lease import writer_lease
from lambdalake.object_store import wait_for_store
from lambdalake.settings import Settings
from lambdalake.speed.replay import ReplayPlan, ReplayResult


@dataclass(frozen=True)
class ReplayRange:
    """What to re-read: a start and an end, each per partition offsets or an ingest time (epoch ms),
    or neither (the topic's first record; its end). Widened to whole ingest epochs when planned."""

    from_offsets: dict[int, int] | None = None
    from_ms: int | None = None
    to_offsets: dict[int, int] | None = None
    to_ms: int | None = None


@dataclass(frozen=True)
class ReplayOutcome:
    """What a replay did: the speed epochs it recomputed and, if asked for, the batch it ran."""

    result: ReplayResult
    batch: BatchRun | None


def plan(settings: Settings, pipeline: str, span: ReplayRange) -> ReplayPlan:
    """The replay of ``span`` widened to whole epochs, with its epochs sorted by who owns them
    (recomputed from the master dataset, left to the batch, left to the running speed job). Changes
    nothing."""
    from lambdalake.speed.replay import plan_replay

    return plan_replay(
        settings,
        deployed_pipeline(settings, pipeline),
        from_offsets=span.from_offsets,
        from_ms=span.from_ms,
        to_offsets=span.to_offsets,
        to_ms=span.to_ms,
    )


def replay(
    settings: Settings,
    pipeline: str,
    planned: ReplayPlan,
    *,
    run_batch: bool | Callable[[ReplayPlan, ReplayResult], bool] = False,
    progress: Callable[[str], None] = quiet,
) -> ReplayOutcome:
    """Run ``planned`` under the pipeline's replay lease: re-archive what the master dataset lacks and
    recompute the speed cells of its closed epochs after the batch horizon. Then, when the plan leaves epochs
    to the batch layer and ``run_batch`` says so (a bool, or a function asked with the plan and the
    replay's result, which may show the result before it answers), a batch
    run under the batch lease, as the batch's principal, in the same Spark session. Running it twice changes
    nothing.

    Raises:
        LeaseHeld: another replay (or batch run) of the pipeline holds the lease, named in the error.
    """
    from lambdalake.batch.job import BatchJob
    from lambdalake.spark.session import command_session
    from lambdalake.speed.replay import Replayer

    wait_for_store(settings, patience_s=settings.object_store.patience_s)
    p = deployed_pipeline(settings, pipeline)
    with command_session(
        settings, f"lambdalake-replay-{p.name}", workload="replay", events=planned.records
    ) as spark:
        with writer_lease(settings, p.name, "replay"):
            progress(f"replaying {planned.records:,} records")
            result = Replayer(settings=settings, pipeline=p, spark=spark).run(planned)
        batch = None
        if planned.batch_epochs and (run_batch(planned, result) if callable(run_batch) else run_batch):
            # The batch writes as the batch's principal (it creates version tables the replay's
            # principal may not): on open services the same settings.
            batch_settings = settings.as_role("batch")
            with writer_lease(batch_settings, p.name, "batch run"):
                progress("running the batch")
                batch = BatchJob(settings=batch_settings, pipeline=p, spark=spark).run()
    return ReplayOutcome(result=result, batch=batch)
