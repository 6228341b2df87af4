"""The speed job on a real Spark standalone cluster (master + worker from pyspark's own jars).

Executors run in the worker's processes, so the source, the decoder and the sinks must serialise
and work outside the driver, as on any cluster.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pyspark
import pytest

from lambdalake.infra.process import port_open
from lambdalake.produce.generator import Mix
from lambdalake.produce.producer import EventProducer
from lambdalake.settings import PROJECT_ROOT, Settings
from tests.conftest import isolated, pipeline_named, port
from tests.helpers import send_generated
from tests.test_speed_faults import start_job, wait_equal

pytestmark = [pytest.mark.services, pytest.mark.slow]

MASTER_PORT = port(17077)


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A master and a worker for the module's tests (one start, ~20 s); yields the master's URL and
    the worker's folder, where each application's executors leave their logs."""
    tmp_path = tmp_path_factory.mktemp("standalone")
    home = Path(pyspark.__file__).parent
    env = {
        **os.environ,
        "SPARK_HOME": str(home),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_WORKER_DIR": str(tmp_path / "work"),
        "SPARK_LOG_DIR": str(tmp_path / "logs"),
    }
    spark_class = str(home / "bin" / "spark-class")
    url = f"spark://127.0.0.1:{MASTER_PORT}"
    procs = [
        subprocess.Popen(
            [
                spark_class,
                "org.apache.spark.deploy.master.Master",
                "--host",
                "127.0.0.1",
                "--port",
                str(MASTER_PORT),
                "--webui-port",
                str(port(18180)),
            ],
            env=env,
            stdout=open(tmp_path / "master.log", "wb"),  # noqa: SIM115 - the server outlives this call
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    ]
    try:
        deadline = time.monotonic() + 60
        while not port_open("127.0.0.1", MASTER_PORT):
            assert time.monotonic() < deadline, (tmp_path / "master.log").read_text()[-2000:]
            time.sleep(0.5)
        procs.append(
            subprocess.Popen(
                [
                    spark_class,
                    "org.apache.spark.deploy.worker.Worker",
                    url,
                    "--host",
                    "127.0.0.1",
                    "--cores",
                    "2",
                    "--memory",
                    "3g",
                    "--webui-port",
                    str(port(18181)),
                ],
                env=env,
                stdout=open(tmp_path / "worker.log", "wb"),  # noqa: SIM115
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        deadline = time.monotonic() + 60
        while "Successfully registered with master" not in (tmp_path / "worker.log").read_text():
            assert time.monotonic() < deadline, (tmp_path / "worker.log").read_text()[-2000:]
            time.sleep(0.5)
        yield url, tmp_path / "work"
    finally:
        for p in reversed(procs):
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(30)


def test_speed_job_on_standalone_cluster(
    services: Settings, standalone: tuple[str, Path], tmp_path: Path, unique: str
) -> None:
    master, work = standalone
    settings = isolated(services, tmp_path, unique)
    settings = settings.model_copy(
        update={
            "topic_prefix": f"{unique}-",
            "spark": settings.spark.model_copy(update={"master": master}),
        }
    )
    pipeline = pipeline_named(settings, "telemetry")
    producer = EventProducer(settings=settings, pipeline=pipeline)
    send_generated(producer, "telemetry", 20_000, seed=8, mix=Mix(duplicates=0.03, late=0.03))
    log = tmp_path / "speed.log"
    job = start_job(settings, "telemetry", log)
    try:
        problems = wait_equal(settings, pipeline, timeout=300)
        assert problems == [], f"{problems[:10]}\n{log.read_text()[-3000:]}"
        executors = list(work.glob("app-*/*/stderr"))
        assert executors, "no executor ran on the worker"
    finally:
        job.send_signal(signal.SIGTERM)
        job.wait(90)
    assert job.returncode == 0, log.read_text()[-3000:]


def test_batch_job_on_standalone_cluster(
    services: Settings, standalone: tuple[str, Path], tmp_path: Path, unique: str
) -> None:
    """The speed job archives on the cluster, then `lambdalake batch run` rebuilds and publishes on it:
    the published rows equal the pandas reference for the horizon (as a local run's do, test_batch)."""
    from lambdalake.cassandra.active import active_batch
    from lambdalake.cassandra.session import connect
    from tests.conftest import run_cli
    from tests.reference import batch_differences, batch_rows, batch_views, topic_events

    pipelines = tmp_path / "pipelines"
    pipelines.mkdir()
    text = (PROJECT_ROOT / "pipelines" / "telemetry.toml").read_text()
    text = text.replace('epoch = "1 hour"', 'epoch = "10 seconds"').replace(
        'dedup_delay = "10 minutes"', 'dedup_delay = "10 minutes"\ngrace = "1 second"'
    )
    (pipelines / "telemetry.toml").write_text(text)
    settings = isolated(services, tmp_path, unique)
    settings = settings.model_copy(
        update={
            "topic_prefix": f"{unique}-",
            "pipelines_dir": pipelines,
            "spark": settings.spark.model_copy(update={"master": standalone[0]}),
        }
    )
    pipeline = pipeline_named(settings, "telemetry")
    assert pipeline.layers.epoch_seconds == 10
    producer = EventProducer(settings=settings, pipeline=pipeline)
    send_generated(producer, "telemetry", 10_000, seed=18, mix=Mix(duplicates=0.05, late=0.05))
    log = tmp_path / "speed.log"
    job = start_job(settings, "telemetry", log)
    try:
        assert wait_equal(settings, pipeline, timeout=300) == [], log.read_text()[-3000:]
    finally:
        job.send_signal(signal.SIGTERM)
        job.wait(90)
    time.sleep(12)  # the events' epochs close (10 s epochs, 1 s grace)

    def apps() -> set[str]:
        return {p.parent.parent.name for p in standalone[1].glob("app-*/*/stderr")}

    before = apps()
    result = run_cli(settings, "batch", "run", "telemetry")
    assert result.returncode == 0, (result.stdout + result.stderr).decode()[-3000:]
    active = active_batch(connect(settings.cassandra), settings.cassandra.keyspace, pipeline.name)
    assert active is not None
    events, _ = topic_events(settings, pipeline)
    want = batch_views(events, pipeline, active.horizon)
    rows = {v.name: batch_rows(settings, pipeline, v, active) for v in pipeline.views}
    assert all(rows.values())
    assert batch_differences(pipeline, want, rows) == []
    assert apps() - before, "the batch run's executors did not run on the worker"
