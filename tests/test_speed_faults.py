"""Fault tests: kill -9 the speed job repeatedly, stop Cassandra; views still equal the reference."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError

from lambdalake.compaction import OPERATION
from lambdalake.infra.services import CassandraService
from lambdalake.layout import master_path
from lambdalake.produce.generator import Mix, generate
from lambdalake.produce.producer import EventProducer
from lambdalake.settings import PROJECT_ROOT, MasterSettings, Settings
from lambdalake.speed.job import SpeedJob
from lambdalake.speed.supervisor import Supervisor
from tests.conftest import env_for, isolated, pipeline_named
from tests.helpers import master_coordinates, stop_job
from tests.reference import differences, topic_events

pytestmark = [pytest.mark.services, pytest.mark.slow]


def produce_steadily(settings: Settings, pipeline, n: int, rate: float, seed: int) -> threading.Thread:
    """Produce ``n`` generated events at about ``rate``/s in a background thread."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            producer = EventProducer(settings=settings, pipeline=pipeline, prepare=False)
            t0 = time.monotonic()
            for i, record in enumerate(
                generate(pipeline.name, n, seed=seed, mix=Mix(duplicates=0.03, late=0.03))
            ):
                producer.send(record)
                if i % 500 == 0:
                    ahead = i / rate - (time.monotonic() - t0)
                    if ahead > 0:
                        time.sleep(ahead)
            assert producer.flush().unacknowledged == 0
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.errors = errors  # type: ignore[attr-defined]
    thread.start()
    return thread


def wait_equal(settings: Settings, pipeline, timeout: float) -> list[str]:
    """Poll until the speed views equal the reference (which is fixed: production has ended)."""
    events, _ = topic_events(settings, pipeline)
    deadline = time.monotonic() + timeout
    problems = ["not checked"]
    while time.monotonic() < deadline:
        try:
            problems = differences(settings, pipeline, events)
        except Exception as exc:  # e.g. the job has not created its keyspace yet
            problems = [f"cannot read the views yet: {exc!r}"]
        coords = master_coordinates(settings, pipeline)
        want = set(zip(events["_partition"], events["_offset"], strict=True))
        if len(coords) != len(set(coords)) or set(coords) != want:
            problems.append(
                f"the master dataset: {len(coords)} rows, {len(set(coords))} distinct, want {len(want)}"
            )
        if not problems:
            return []
        time.sleep(5)
    return problems


def wait_for_log(log: Path, text: str, *, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while log.read_text(errors="replace").count(text) < count:
        assert time.monotonic() < deadline, f"{text!r} not logged {count} times: {log.read_text()[-2000:]}"
        time.sleep(0.5)


def start_job(settings: Settings, name: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        # A restart after kill -9 waits out the killed job's lease, as a supervisor's restart would.
        [sys.executable, "-m", "lambdalake", "speed", "run", name, "--lease-wait", "60"],
        env=env_for(settings),
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=PROJECT_ROOT,
    )


def test_kill_minus_nine_three_times(services: Settings, tmp_path: Path, unique: str) -> None:
    # Master dataset compaction every 3 micro-batches, 3 files at a time: rounds run all through, so a kill
    # may land inside one (the job's next start clears what it staged).
    compacting = MasterSettings(compact_every_commits=3, compact_fan_in=3)
    settings = isolated(services, tmp_path, unique).model_copy(
        update={"topic_prefix": f"{unique}-", "master": compacting}
    )
    pipeline = pipeline_named(settings, "offers")  # the job finds the same topic through the prefix
    assert pipeline.topic.name == f"{unique}-offers"
    EventProducer(settings=settings, pipeline=pipeline)  # topics and schemas exist before the job
    log = tmp_path / "speed.log"
    rng = random.Random(int(unique, 16))
    producer = produce_steadily(settings, pipeline, 80_000, rate=1000, seed=5)
    job = start_job(settings, "offers", log)
    kills = 0
    try:
        while kills < 3:
            # Kill at a random point after the queries run (startup alone takes 10-20 s here).
            wait_for_log(log, "offers-main started", count=kills + 1, timeout=180)
            time.sleep(rng.uniform(1, 12))
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(30)
            kills += 1
            job = start_job(settings, "offers", log)
        producer.join(120)
        assert not producer.is_alive() and not producer.errors, producer.errors
        # The job compacts after every third micro-batch; on a slow machine micro-batches are fewer
        # and larger, so more input is fed (not a longer sleep) until the rounds this test is about
        # have run, within a bound.
        deadline = time.monotonic() + 300
        more = 0
        while compaction_rounds(settings, pipeline) < 3:
            assert time.monotonic() < deadline, (
                f"the master dataset saw {compaction_rounds(settings, pipeline)} compaction rounds, not 3, "
                f"within 300 s of {more} more small waves of input (a round every 3 micro-batches)"
            )
            more += 1
            produce_steadily(settings, pipeline, 200, rate=1000, seed=100 + more).join(60)
            time.sleep(3)
        problems = wait_equal(settings, pipeline, timeout=300)
        assert problems == [], problems[:10]
    finally:
        stop_job(job)
    assert job.returncode == 0, f"graceful stop failed; log: {log.read_text()[-2000:]}"
    assert log.read_text().count("offers-main started") == 4  # one start and three restarts
    # A kill mid-write leaves a half-written file in _staging/; the next start clears it.
    staging = Path(master_path(settings.storage_root, pipeline.name)) / "_staging"
    assert not staging.exists() or sorted(staging.iterdir()) == []
    assert compaction_rounds(settings, pipeline) >= 3, "the master dataset was not compacted"


def compaction_rounds(settings: Settings, pipeline) -> int:
    try:
        history = DeltaTable(master_path(settings.storage_root, pipeline.name)).history()
    except TableNotFoundError:  # no micro-batch committed yet
        return 0
    return sum(1 for e in history if e.get(OPERATION) == "compact")


def test_cassandra_stopped_for_30s(services: Settings, spark, tmp_path: Path, unique: str) -> None:
    settings = isolated(services, tmp_path, unique)
    pipeline = pipeline_named(settings, "telemetry", topic=f"telemetry-{unique}")
    EventProducer(settings=settings, pipeline=pipeline)
    job = SpeedJob(settings=settings, pipeline=pipeline, spark=spark)
    job.start()
    producer = produce_steadily(settings, pipeline, 40_000, rate=800, seed=6)
    cassandra = CassandraService(services)
    try:
        time.sleep(10)
        assert cassandra.stop()
        time.sleep(30)
        assert all(q.isActive for q in job.queries), "the job must wait for Cassandra, not die"
        cassandra.start()
        producer.join(120)
        assert not producer.is_alive() and not producer.errors, producer.errors
        Supervisor(job).catch_up()
        assert wait_equal(settings, pipeline, timeout=120) == []
    finally:
        job.stop()
        cassandra.start()


def test_a_main_checkpoint_killed_in_its_first_offset_log_entry_starts_again(
    services: Settings, spark, tmp_path: Path, unique: str
) -> None:
    """A kill -9 in a job's first micro-batch, as it wrote the offset log's first entry (seen in the
    seeded operations schedule), leaves the main query's checkpoint with its metadata, its initial
    offsets and a temporary offsets file but no entry; Spark refuses such a checkpoint for good
    ("should be empty on batch 0"). The next start removes the stray file, runs the first batch
    again from the initial offsets, and the views equal the reference."""
    settings = isolated(services, tmp_path, unique)
    pipeline = pipeline_named(settings, "telemetry", topic=f"telemetry-{unique}")
    EventProducer(settings=settings, pipeline=pipeline)
    job = SpeedJob(settings=settings, pipeline=pipeline, spark=spark)
    job.start()
    try:
        Supervisor(job).catch_up()  # no records yet: the initial offsets and an empty first batch
    finally:
        job.stop()
    # What the kill left: the query's metadata and initial offsets, and of its first batch (which
    # ran here, empty) only the offset log entry's temporary file, empty.
    folder = Path(job.main_dir)
    assert (folder / "metadata").exists() and (folder / "sources" / "0" / "0").exists()
    for sub in ("offsets", "commits", "state"):
        shutil.rmtree(folder / sub)
    (folder / "offsets").mkdir()
    stray = folder / "offsets" / ".0.327f4c00-de06-483f-96a4-d5b879483d89.tmp"
    stray.write_bytes(b"")
    producer = produce_steadily(settings, pipeline, 3_000, rate=5_000, seed=9)
    producer.join(60)
    assert not producer.is_alive() and not producer.errors, producer.errors
    job = SpeedJob(settings=settings, pipeline=pipeline, spark=spark)
    job.start()
    try:
        Supervisor(job).catch_up()
        assert not stray.exists()
        assert wait_equal(settings, pipeline, timeout=120) == []
    finally:
        job.stop()


def busy_python_worker(job: subprocess.Popen, timeout: float = 60) -> int:
    """A Python worker of the job (a child of the Python daemon) caught running a task: its CPU time
    grew within the last 50 ms (an idle worker killed would just be replaced before the next task)."""
    from lambdalake.procs import process_tree

    def cpu(pid: int) -> int:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])

    seen: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tree = process_tree(job.pid)
        for pid, parent in tree.items():
            try:
                daemon_child = b"\0pyspark.worker\0" in Path(f"/proc/{parent}/cmdline").read_bytes()
                if not daemon_child or b"\0pyspark.worker\0" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                    continue
                now = cpu(pid)
            except OSError:
                continue
            if pid in seen and now > seen[pid]:
                return pid
            seen[pid] = now
        time.sleep(0.05)
    raise AssertionError(f"no Python worker of the job ran a task within {timeout:.0f}s")


def test_a_python_worker_killed_mid_task_is_retried_and_the_views_stay_exact(
    services: Settings, tmp_path: Path, unique: str
) -> None:
    """kill -9 of the Python worker running the archive pass (as on a loaded machine, a worker that
    dies) fails its task; Spark runs the task again (``local[2,4]``: four tries, as on a cluster;
    a query that still fails is restarted by the job from its checkpoint), the job never exits, and
    the views still equal the reference."""
    settings = isolated(services, tmp_path, unique).model_copy(update={"topic_prefix": f"{unique}-"})
    pipeline = pipeline_named(settings, "offers")
    EventProducer(settings=settings, pipeline=pipeline)
    log = tmp_path / "speed.log"
    producer = produce_steadily(settings, pipeline, 20_000, rate=1000, seed=8)
    job = start_job(settings, "offers", log)
    try:
        wait_for_log(log, "offers-main started", count=1, timeout=180)
        time.sleep(3)
        os.kill(busy_python_worker(job), signal.SIGKILL)
        wait_for_log(log, "Python worker exited unexpectedly", count=1, timeout=120)  # a task it ran
        producer.join(120)
        assert not producer.is_alive() and not producer.errors, producer.errors
        problems = wait_equal(settings, pipeline, timeout=300)
        assert problems == [], problems[:10]
        assert job.poll() is None, f"the job exited: {log.read_text()[-3000:]}"
    finally:
        stop_job(job)
    assert job.returncode == 0, f"graceful stop failed; log: {log.read_text()[-2000:]}"


def test_spark_sources_offset_change_reads_as_the_data_loss_it_is() -> None:
    """Spark's words for a log whose end went behind the checkpoint become the job's own error."""
    from lambdalake.speed.last_read import offset_changed

    text = (
        "[KAFKA_DATA_LOSS.PARTITION_OFFSET_CHANGED] Some data may have been lost ... Reason: Partition "
        "offers-v2-1 offset was changed from 600 to 350. This could be either 1) a user error"
    )
    error = offset_changed(text)
    assert error is not None
    assert error.message == (
        "DATA LOSS: offers-v2-1: the log ends at offset 350 but the checkpoint has read up to 599: "
        "offsets 350..599 were lost by the broker"
    )
    assert "--no-fail-on-data-loss" in (error.fix or "")
    assert offset_changed("org.apache.kafka.common.errors.TimeoutException: no node") is None
