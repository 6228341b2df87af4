"""When `batch schedule` runs a pipeline (a recording runner stands in for the Spark job here; the
real job runs from the schedule in test_batch)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from lambdalake.batch.schedule import Scheduler
from lambdalake.pipeline import BatchSpec, configured_pipeline
from lambdalake.settings import Settings


def test_each_scheduled_time_runs_once_and_missed_ones_once(tmp_path: Path) -> None:
    settings = Settings(storage_root=str(tmp_path))
    hourly = configured_pipeline("offers", settings).model_copy(
        update={"batch": BatchSpec(schedule="0 * * * *")}
    )
    now = [datetime(2026, 11, 23, 10, 30, tzinfo=UTC).timestamp()]
    ran: list[float] = []

    def runner(_pipeline) -> str:
        ran.append(now[0])
        return "published"

    def scheduler() -> Scheduler:
        return Scheduler(settings=settings, pipelines=[hourly], runner=runner, clock=lambda: now[0])

    assert scheduler().run_due() == {"offers": "published"}  # never run: the 10:00 run is due at once
    assert scheduler().run_due() == {}  # a restarted scheduler knows it ran
    now[0] += 20 * 60  # 10:50
    assert scheduler().run_due() == {}
    now[0] += 3 * 3600  # 13:50: 11:00, 12:00 and 13:00 passed while it was down: one run catches up
    assert scheduler().run_due() == {"offers": "published"}
    assert scheduler().run_due() == {}
    assert len(ran) == 2


def test_a_failing_run_is_logged_and_does_not_stop_the_others(tmp_path: Path) -> None:
    settings = Settings(storage_root=str(tmp_path))
    pipelines = [configured_pipeline(name, settings) for name in ("offers", "telemetry")]

    def runner(pipeline) -> str:
        if pipeline.name == "offers":
            raise RuntimeError("Cassandra is down")
        return "published"

    outcomes = Scheduler(settings=settings, pipelines=pipelines, runner=runner).run_due()
    assert outcomes == {"offers": "failed: RuntimeError: Cassandra is down", "telemetry": "published"}


def test_a_bad_cron_expression_is_refused_when_the_pipeline_loads() -> None:
    import pytest
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="not a cron expression"):
        BatchSpec(schedule="every night")


def test_a_long_running_scheduler_starts_a_new_pipeline_at_its_next_time(tmp_path: Path) -> None:
    """`deploy` starts the scheduler with first_run_now=False: a new deployment does not rebuild at once."""
    settings = Settings(storage_root=str(tmp_path))
    hourly = configured_pipeline("offers", settings).model_copy(
        update={"batch": BatchSpec(schedule="0 * * * *")}
    )
    now = [datetime(2026, 11, 23, 10, 30, tzinfo=UTC).timestamp()]

    def scheduler() -> Scheduler:
        return Scheduler(
            settings=settings, pipelines=[hourly], runner=lambda _p: "published", clock=lambda: now[0],
            first_run_now=False,
        )  # fmt: skip

    assert scheduler().run_due() == {}  # first seen at 10:30: waits for 11:00
    now[0] += 40 * 60  # 11:10
    assert scheduler().run_due() == {"offers": "published"}
    assert scheduler().run_due() == {}
