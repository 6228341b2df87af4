"""`lambdalake deploy` makes the platform match the definitions: a second run reports no changes, an
incompatible schema version is refused before anything changes, `undeploy` stops the jobs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from confluent_kafka.admin import AdminClient

from lambdalake.cassandra.session import connect
from lambdalake.cassandra.tables import create_keyspace, ensure_table, speed_table_def
from lambdalake.control.processes import scheduler_process, serving_process, speed_process
from lambdalake.lease import LEASES, Lease, writer_lease
from lambdalake.produce.generator import Mix
from lambdalake.produce.producer import EventProducer
from lambdalake.registry import client
from lambdalake.settings import PROJECT_ROOT, Settings
from tests.conftest import env_for, isolated, pipeline_named, port, run_cli
from tests.helpers import pipelines_folder, send_generated
from tests.reference import differences, topic_events

pytestmark = [pytest.mark.services, pytest.mark.slow]


def incompatible_version(schemas: Path) -> str:
    """A telemetry v3 that adds a field without a default: old records cannot be read with it."""
    v2 = json.loads((schemas / "telemetry" / "v2.avsc").read_text())
    v2["fields"].append({"name": "recall_code", "type": "string"})
    (schemas / "telemetry" / "v3.avsc").write_text(json.dumps(v2))
    return "telemetry/v3.avsc"


def test_deploy_twice_then_an_incompatible_schema_then_undeploy(services: Settings, tmp_path: Path) -> None:
    unique = f"d{int(time.time() * 1000) % 10**8}"
    base = isolated(services, tmp_path, unique)
    pipeline = pipeline_named(base, "telemetry", topic=f"telemetry-{unique}")
    schemas = tmp_path / "schemas"
    shutil.copytree(PROJECT_ROOT / "schemas", schemas)
    settings = base.model_copy(
        update={"pipelines_dir": pipelines_folder(tmp_path, pipeline), "schemas_dir": schemas,
                "state_dir": tmp_path / "state",
                "serving": base.serving.model_copy(update={"port": port(18480)})}
    )  # fmt: skip
    subject = f"telemetry-{unique}-value"
    # The subject is the pipeline file's: give this test its own so other tests' versions do not count.
    toml = settings.pipelines_dir / "telemetry.toml"
    toml.write_text(
        toml.read_text().replace('subject = "telemetry-value"', f'subject = "telemetry-{unique}-value"')
    )
    try:
        first = run_cli(settings, "deploy", "telemetry")
        assert first.returncode == 0, first.stdout.decode() + first.stderr.decode()
        text = first.stdout.decode()
        assert "created" in text and "started" in text, text
        job = speed_process(settings, "telemetry")
        pid = job.pid()
        assert pid is not None and scheduler_process(settings).pid() is not None
        assert serving_process(settings).pid() is not None
        health = httpx.get(f"http://127.0.0.1:{port(18480)}/health", timeout=30)
        assert health.status_code == 200, health.text
        topics = AdminClient(settings.kafka.client_config()).list_topics(timeout=10).topics
        assert pipeline.topic.name in topics and pipeline.topic.dlq in topics
        session = connect(settings.cassandra)
        for view in pipeline.views:
            table = speed_table_def(pipeline, view).name
            session.execute(f'SELECT * FROM "{settings.cassandra.keyspace}"."{table}" LIMIT 1')

        second = run_cli(settings, "deploy", "telemetry")
        assert second.returncode == 0, second.stdout.decode() + second.stderr.decode()
        assert "no changes" in second.stdout.decode(), second.stdout.decode()
        assert job.pid() == pid

        # A manual run beside the deployed job: refused at once (no Spark JVM), naming the holder.
        manual = run_cli(settings, "speed", "run", "telemetry", "--once")
        output = manual.stdout.decode() + manual.stderr.decode()
        assert manual.returncode == 2, output
        assert f"held by speed job on {socket.gethostname()}" in output and "undeploy" in output, output
        assert "incubator" not in output, output
        assert job.pid() == pid

        # An incompatible version: refused with the reason, before anything changes.
        versions = client(settings).get_versions(subject)
        v3 = incompatible_version(schemas)
        toml.write_text(toml.read_text().replace('"telemetry/v2.avsc"]', f'"telemetry/v2.avsc", "{v3}"]'))
        refused = run_cli(settings, "deploy", "telemetry")
        output = refused.stdout.decode() + refused.stderr.decode()
        assert refused.returncode == 2, output
        assert "incompatible" in output and "v3.avsc" in output and "Traceback" not in output, output
        assert client(settings).get_versions(subject) == versions
        assert job.pid() == pid, "the job was restarted by a refused deploy"
    finally:
        stopped = run_cli(settings, "undeploy")
    assert stopped.returncode == 0, stopped.stdout.decode() + stopped.stderr.decode()
    assert "stopped" in stopped.stdout.decode()
    assert speed_process(settings, "telemetry").pid() is None
    assert scheduler_process(settings).pid() is None
    assert serving_process(settings).pid() is None
    # Undeploy released the lease: a manual run would now start (the lease it takes first is free; a
    # run itself would cost a driver JVM, and the next test runs one after a kill).
    with writer_lease(settings, "telemetry", "speed job") as taken:
        holder = taken.current()
        assert holder is not None and holder.pid == os.getpid(), holder


def test_a_job_killed_with_minus_nine_is_followed_at_once_by_the_next_one_on_its_machine(
    services: Settings, tmp_path: Path
) -> None:
    unique = f"k{int(time.time() * 1000) % 10**8}"
    base = isolated(services, tmp_path, unique)
    pipeline = pipeline_named(base, "offers", topic=f"offers-{unique}")
    settings = base.model_copy(update={
        "pipelines_dir": pipelines_folder(tmp_path, pipeline), "state_dir": tmp_path / "state",
        "cassandra": base.cassandra.model_copy(update={"lease_ttl_s": 10}),
    })  # fmt: skip
    run_cli(settings, "topics", "offers", "--apply")
    producer = EventProducer(settings=settings, pipeline=pipeline)
    send_generated(producer, "offers", 3000, seed=21, mix=Mix())
    env = env_for(settings)
    job = subprocess.Popen(
        [sys.executable, "-m", "lambdalake", "speed", "run", "offers"], env=env, cwd=PROJECT_ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        probe = Lease(session=connect(settings.cassandra), cassandra=settings.cassandra, pipeline="offers",
                      role="speed job")  # fmt: skip
        create_keyspace(probe.session, settings.cassandra)
        ensure_table(probe.session, settings.cassandra.keyspace, LEASES)
        while probe.current() is None:  # until the job holds its lease
            assert time.monotonic() < deadline and job.poll() is None, "the job did not take its lease"
            time.sleep(0.5)
        holder = probe.current()
        assert holder is not None and holder.pid == job.pid, holder
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(30)
        # No --lease-wait: the dead holder's lease (10 s TTL) is taken over, not waited for.
        again = run_cli(settings, "speed", "run", "offers", "--once")
        assert again.returncode == 0, again.stdout.decode() + again.stderr.decode()
        # The job killed half way and its successor counted every event once.
        (events, _invalid) = topic_events(settings, pipeline)
        assert len(events) > 2000 and differences(settings, pipeline, events) == []
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
