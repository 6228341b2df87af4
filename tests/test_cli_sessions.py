"""The operations stop the Spark sessions they start, however the command ends (measured before: restore,
replay, speed reset and the batch scheduler left their driver JVM to the process's exit). Narrow unit
tests: the session and the work are stand-ins; tests/test_cli.py runs the commands for real."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import pytest

import lambdalake.cli.batch as cli_batch
import lambdalake.control.batch as control_batch
import lambdalake.spark.session as session_module
from lambdalake.settings import Settings


class FakeSession:
    def __init__(self) -> None:
        self.stopped = 0

    def stop(self) -> None:
        self.stopped += 1


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[FakeSession]:
    sessions: list[FakeSession] = []

    def spark_session(*_args: Any, **_kwargs: Any) -> FakeSession:
        sessions.append(FakeSession())
        return sessions[-1]

    monkeypatch.setattr(session_module, "spark_session", spark_session)
    monkeypatch.setattr(cli_batch, "get_settings", lambda: Settings())
    monkeypatch.setattr(control_batch, "writer_lease", lambda *_a, **_k: contextlib.nullcontext())
    return sessions


def test_a_failed_restore_stops_its_session(
    started: list[FakeSession], monkeypatch: pytest.MonkeyPatch
) -> None:
    import lambdalake.batch.restore
    import lambdalake.master
    import lambdalake.speed.replay

    monkeypatch.setattr(control_batch, "deployed_pipeline", lambda _s, name: SimpleNamespace(name=name))
    monkeypatch.setattr(lambdalake.master, "master_of", lambda *_a: SimpleNamespace(num_records=lambda: 10))
    monkeypatch.setattr(lambdalake.speed.replay, "Replayer", lambda **_k: SimpleNamespace(recompute=None))

    def failing(*_a: Any, **_k: Any) -> None:
        raise RuntimeError("the Delta views are gone")

    monkeypatch.setattr(lambdalake.batch.restore, "restore", failing)
    with pytest.raises(RuntimeError, match="Delta views are gone"):
        cli_batch.batch_restore("p", version=None)
    assert [s.stopped for s in started] == [1]


def test_the_scheduler_stops_the_session_its_runs_shared(
    started: list[FakeSession], monkeypatch: pytest.MonkeyPatch
) -> None:
    import lambdalake.batch.job
    import lambdalake.batch.schedule
    import lambdalake.master

    monkeypatch.setattr(control_batch, "configured_pipeline", lambda name, _s: SimpleNamespace(name=name))
    monkeypatch.setattr(control_batch, "deployed_pipeline", lambda _s, name: SimpleNamespace(name=name))
    monkeypatch.setattr(lambdalake.master, "master_of", lambda *_a: SimpleNamespace(num_records=lambda: 10))
    ran = SimpleNamespace(outcome="published")
    monkeypatch.setattr(lambdalake.batch.job, "BatchJob", lambda **_k: SimpleNamespace(run=lambda: ran))

    class Scheduler:
        def __init__(self, *, runner: Any, pipelines: list[Any], **_kwargs: Any) -> None:
            self.runner, self.pipelines = runner, pipelines

        def run_due(self) -> dict[str, str]:
            return {p.name: self.runner(p) for p in self.pipelines}

    monkeypatch.setattr(lambdalake.batch.schedule, "Scheduler", Scheduler)
    cli_batch.batch_schedule(pipeline=["a", "b"], once=True)
    assert [s.stopped for s in started] == [1], "one session for both runs, stopped at the end"
