"""One service restarted alone (`lambdalake down --only` / `up --only`) while the others and a speed
job run: each comes back healthy, a service whose need is down is refused naming it, and the views
equal the reference of what the topic holds. The three-node case is in ``test_cluster.py``."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from lambdalake.produce.producer import EventProducer
from lambdalake.settings import Settings
from tests.conftest import isolated, pipeline_named, run_cli
from tests.helpers import pipelines_folder, stop_job
from tests.test_speed_faults import produce_steadily, start_job, wait_equal, wait_for_log

pytestmark = [pytest.mark.services, pytest.mark.slow]


def output(result) -> str:
    return result.stdout.decode() + result.stderr.decode()


def restart_alone(settings: Settings, name: str) -> None:
    """`down --only name`, then `up --only name`; asserts both, and that every service is healthy after."""
    down = run_cli(settings, "down", "--only", name, timeout=300)
    assert down.returncode == 0 and f"stopped {name}" in output(down), output(down)
    up = run_cli(settings, "up", "--only", name, timeout=300)
    assert up.returncode == 0 and "started in" in output(up), output(up)
    wait_all_healthy(settings)


def wait_all_healthy(settings: Settings, timeout: float = 180) -> None:
    """Every service of ``settings`` healthy (a Spark worker re-registers with a restarted master on
    its own, some seconds after the master answers)."""
    deadline = time.monotonic() + timeout
    while True:
        status = run_cli(settings, "status", "--services", "--json")
        services = json.loads(status.stdout)
        if status.returncode == 0 and all(s["healthy"] for s in services):
            return
        assert time.monotonic() < deadline, [s for s in services if not s["healthy"]]
        time.sleep(2)


def test_each_service_restarted_alone_while_the_others_and_a_speed_job_run(
    services: Settings, tmp_path: Path, unique: str
) -> None:
    base = isolated(services, tmp_path, unique)
    pipeline = pipeline_named(base, "offers", topic=f"offers-{unique}", epoch="10 seconds", grace="1 second")
    settings = base.model_copy(update={"pipelines_dir": pipelines_folder(tmp_path, pipeline)})
    EventProducer(settings=settings, pipeline=pipeline)  # topics and schemas before the job
    log = tmp_path / "speed.log"
    job = start_job(settings, pipeline.name, log)
    try:
        wait_for_log(log, "offers-main started", count=1, timeout=300)
        sender = produce_steadily(settings, pipeline, 8_000, rate=80, seed=41)
        # The regression: the registry alone, while the brokers it needs run.
        restart_alone(settings, "registry")
        assert run_cli(settings, "down", "--only", "registry").returncode == 0
        # `status` reads a pipeline from Kafka, the lake and Cassandra: the registry down hides nothing,
        # a kind it reads with no node answering is named instead of an empty list.
        shown = json.loads(run_cli(settings, "status", "--json").stdout)
        assert [p["pipeline"] for p in shown["pipelines"]] == [pipeline.name], shown
        assert shown["pipelines"][0]["partitions"] and "pipelines_unavailable" not in shown, shown
        assert run_cli(settings, "down", "--only", "broker").returncode == 0
        shown = json.loads(run_cli(settings, "status", "--json").stdout)
        assert shown["pipelines"] == [] and "no broker node answers" in shown["pipelines_unavailable"], shown
        # A need that is down is named, with the command that starts it; nothing else is started.
        refused = run_cli(settings, "up", "--only", "registry", timeout=120)
        text = output(refused)
        assert refused.returncode == 2, text
        assert "registry cannot start: broker is not running" in text, text
        assert "lambdalake up --only broker" in text and "Traceback" not in text, text
        for name in ("broker", "registry"):  # the broker alone, then the registry alone
            up = run_cli(settings, "up", "--only", name, timeout=300)
            assert up.returncode == 0 and "started in" in output(up), output(up)
        wait_all_healthy(settings)
        restart_alone(settings, "cassandra")
        restart_alone(settings, "broker")
        sender.join(600)
        assert not sender.errors, sender.errors  # type: ignore[attr-defined]
        assert job.poll() is None, log.read_text()[-3000:]
        assert wait_equal(settings, pipeline, timeout=300) == [], log.read_text()[-3000:]
    finally:
        run_cli(settings, "up", timeout=300)  # whatever a failed step left down, for the next tests
        stop_job(job)
