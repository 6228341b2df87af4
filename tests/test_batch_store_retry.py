"""`run_batch` when the object store stops answering half way through a run (a narrow unit test: the
run itself is a stand-in that fails as the clients do; tests/test_object_store.py stops a real store
under a real run, where S3A's and delta-rs's own retries outlasted a 61-s outage)."""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from lambdalake.batch import job as batch_job
from lambdalake.batch.run import BatchRun
from lambdalake.control import batch as control
from lambdalake.errors import ServiceUnavailable
from lambdalake.settings import Settings

ENDPOINT = "127.0.0.1:19909"
#: What delta-rs says when the store stops answering (its wording, with the store's address).
DOWN = f"Generic S3 error: error sending request for url (http://{ENDPOINT}/lake/master): Connection refused"


def settings() -> Settings:
    return Settings(storage_root="s3://lake/prefix", object_store={"endpoint": f"http://{ENDPOINT}"})


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[Exception | None]:
    """Each run's outcome in turn (an error it raises, or None: published); the store always answers
    between runs, and the lease and the deployed pipeline are stand-ins."""
    outcomes: list[Exception | None] = []

    class Job:
        def __init__(self, *, settings: Settings, pipeline: Any) -> None:
            pass

        def run(self, **_: Any) -> BatchRun:
            outcome = outcomes.pop(0)
            if outcome is not None:
                raise outcome
            return BatchRun(pipeline="p", run_id="r", outcome="published")

    monkeypatch.setattr(batch_job, "BatchJob", Job)
    monkeypatch.setattr(control, "deployed_pipeline", lambda _settings, name: SimpleNamespace(name=name))
    monkeypatch.setattr(control, "writer_lease", lambda *_a, **_k: contextlib.nullcontext())
    monkeypatch.setattr(control, "wait_for_store", lambda _settings, **_kw: None)
    return outcomes


def test_a_run_the_store_stopped_half_way_runs_again_once_it_answers(
    runs: list[Exception | None], caplog: pytest.LogCaptureFixture
) -> None:
    runs.extend([OSError(DOWN), None])
    told: list[str] = []
    with caplog.at_level(logging.WARNING, logger="lambdalake.batch"):
        run = control.run_batch(settings(), "p", progress=told.append)
    assert run.outcome == "published" and runs == []
    assert any("stopped answering half way" in t for t in told), told
    assert "attempt 2 of 3" in caplog.text


def test_the_store_gone_through_every_attempt_is_raised(runs: list[Exception | None]) -> None:
    runs.extend([OSError(DOWN)] * control.STORE_ATTEMPTS)
    with pytest.raises(OSError, match="Connection refused"):
        control.run_batch(settings(), "p")
    assert runs == []  # every attempt ran
    assert isinstance(control.explain(OSError(DOWN), settings()), ServiceUnavailable)


def test_any_other_failure_is_raised_at_once(runs: list[Exception | None]) -> None:
    runs.extend([ValueError("a view's expectation failed"), None])
    with pytest.raises(ValueError, match="expectation"):
        control.run_batch(settings(), "p")
    assert runs == [None]  # not run again
