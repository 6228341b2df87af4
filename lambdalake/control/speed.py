"""The speed layer's repair: rebuild its rows and checkpoints from the master dataset."""

from __future__ import annotations

from lambdalake.control.pipelines import deployed_pipeline
from lambdalake.errors import LambdalakeError
from lambdalake.lease import writer_lease
from lambdalake.settings import Settings
from lambdalake.speed.reset import ResetResult


def reset_speed(settings: Settings, pipeline: str) -> ResetResult:
    """Rebuild the speed layer of ``pipeline`` after its checkpoint was lost or broken: truncate its
    tables, delete its checkpoints, recompute the closed epochs after the batch horizon from the master
    dataset (never from the topic, which compaction may have thinned), and start the next run at the oldest
    open epoch. Under the pipeline's speed-reset lease.

    Raises:
        LambdalakeError: the pipeline's speed job runs here (stop it first, the error says how).
    """
    from lambdalake.master import master_of
    from lambdalake.spark.session import command_session
    from lambdalake.speed.reset import reset_speed as rebuild

    p = deployed_pipeline(settings, pipeline)
    refuse_running_job(settings, p.name, "a reset")
    with writer_lease(settings, p.name, "speed reset"):
        events = master_of(settings, p).num_records()
        name = f"lambdalake-speed-reset-{p.name}"
        with command_session(settings, name, workload="replay", events=events) as spark:
            return rebuild(settings, p, spark)


def refuse_running_job(settings: Settings, pipeline: str, action: str) -> None:
    """Refuse ``action`` while the pipeline's managed speed job runs on this machine."""
    from lambdalake.control.processes import speed_process

    pid = speed_process(settings, pipeline).pid()
    if pid is not None:
        raise LambdalakeError(
            f"the speed job of {pipeline!r} runs (pid {pid}): {action} would race its state",
            fix=f"stop it first (`lambdalake undeploy --pipeline {pipeline}`), `lambdalake deploy` after",
        )
