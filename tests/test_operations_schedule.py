"""A seeded schedule of operations against a running producer: speed-job runs stopped by SIGTERM or
kill -9, replays of random ranges (beside the running job too), ``speed reset`` after deleting the
checkpoint, batch runs and restores. At the end the merged answer of every key equals the reference
folded from the topic, and the master dataset holds each valid record once.

The seed is printed; ``LAMBDALAKE_SCHEDULE_SEED`` replays a schedule, ``LAMBDALAKE_SCHEDULE_STEPS``
sets its length (``make soak`` runs a long one).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from lambdalake.batch.job import BatchJob
from lambdalake.batch.restore import restore
from lambdalake.errors import ConfigurationError
from lambdalake.layout import views_path
from lambdalake.produce.generator import Mix, generate
from lambdalake.produce.producer import EventProducer
from lambdalake.serving import ServingClient
from lambdalake.settings import PROJECT_ROOT, Settings
from lambdalake.speed.replay import Replayer, plan_replay
from lambdalake.speed.reset import reset_speed
from tests.conftest import env_for, isolated, pipeline_named, run_cli
from tests.helpers import master_coordinates, pipelines_folder, run_speed_once, stop_job
from tests.reference import merged_differences, topic_events

pytestmark = [pytest.mark.services, pytest.mark.slow]

OPERATIONS = ("job", "job", "replay", "replay_beside_job", "reset", "batch", "restore")


class Producing:
    """Generated offers at about ``rate``/s in a thread, each version used once (no far copies:
    those the speed layer counts twice by design until a batch covers them)."""

    def __init__(self, settings: Settings, pipeline: Any, *, rate: float, seed: int) -> None:
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, args=(settings, pipeline, rate, seed), daemon=True)
        self.thread.start()

    def _run(self, settings: Settings, pipeline: Any, rate: float, seed: int) -> None:
        try:
            producer = EventProducer(settings=settings, pipeline=pipeline, prepare=False)
            t0 = time.monotonic()
            mix = Mix(duplicates=0.0, invalid=0.02, late=0.02)
            for sent, record in enumerate(generate("offers", 10**7, seed=seed, mix=mix), start=1):
                if self.stop.is_set():
                    break
                producer.send(record)
                ahead = sent / rate - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)
            assert producer.flush().unacknowledged == 0
        except BaseException as exc:  # reported by finish()
            self.errors.append(exc)

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(60)
        assert not self.errors, self.errors


def start_job(settings: Settings, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        # After a kill -9 the next job waits out its predecessor's lease, as a supervisor's restart would.
        [sys.executable, "-m", "lambdalake", "speed", "run", "offers", "--lease-wait", "60"],
        env=env_for(settings), stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True,
        cwd=PROJECT_ROOT,
    )  # fmt: skip


def end_job(job: subprocess.Popen | None, rng: random.Random, say: Any) -> None:
    if job is None:
        return
    if rng.random() < 0.5:
        say("kill -9 of the speed job")
        os.killpg(job.pid, 9)
        job.wait(30)
    else:
        say("SIGTERM of the speed job")
        stop_job(job)


def test_a_seeded_schedule_of_operations_keeps_every_answer_exact(
    services: Settings, spark: Any, tmp_path: Path, unique: str
) -> None:
    seed = int(os.environ.get("LAMBDALAKE_SCHEDULE_SEED") or random.SystemRandom().randrange(10**6))
    steps = int(os.environ.get("LAMBDALAKE_SCHEDULE_STEPS") or 6)
    rng = random.Random(seed)
    print(f"operations schedule: seed {seed}, {steps} steps (replay: LAMBDALAKE_SCHEDULE_SEED={seed})")
    # Drawn as the schedule goes (a seed replays the draws in their order).
    ops = (rng.choice(OPERATIONS) for _ in range(steps))
    run_schedule(services, spark, tmp_path, unique, seed=seed, ops=ops, rng=rng)


def test_a_reset_on_the_real_time_path_leaves_no_latest_candidate_out(
    services: Settings, spark: Any, tmp_path: Path, unique: str
) -> None:
    """``speed reset`` empties the latest views' speed rows; the restarted job's new Real-time
    checkpoint starts where its main query starts, not where the master dataset's coverage ends (a schedule of
    kill -9, reset, replay, restores and a batch left 123-316 latest rows missing before)."""
    realtime = services.speed.model_copy(update={"latest": "realtime", "realtime_batch_s": 2})
    rng = random.Random(385398)
    ops = (rng.choice(OPERATIONS) for _ in range(6))
    mine = services.model_copy(update={"speed": realtime})
    run_schedule(mine, spark, tmp_path, unique, seed=385398, ops=ops, rng=rng)


def run_schedule(
    services: Settings,
    spark: Any,
    tmp_path: Path,
    unique: str,
    *,
    seed: int,
    ops: Iterable[str],
    rng: random.Random,
) -> None:
    """Run ``ops`` against a producer of offers (``seed``), then check the master dataset and every merged
    answer against the reference folded from the topic."""
    log: list[str] = []

    def say(what: str) -> None:
        log.append(f"{time.strftime('%H:%M:%S')} {what}")
        print(log[-1])

    base = isolated(services, tmp_path, unique)
    pipeline = pipeline_named(
        base, "offers", topic=f"offers-{unique}", epoch="5 seconds", dedup_delay="2 seconds", grace="1 second"
    )
    settings = base.model_copy(update={"pipelines_dir": pipelines_folder(tmp_path, pipeline)})
    folder = settings.pipelines_dir
    # Views grow many times over from one batch run to the next here: not an anomaly.
    suite = json.loads((folder / "offers.expectations.json").read_text())
    (folder / "offers.expectations.json").write_text(json.dumps({**suite, "row_count_tolerance": 1000}))
    job_log = tmp_path / "speed.log"

    assert run_cli(settings, "topics", "offers", "--apply").returncode == 0
    producing = Producing(settings, pipeline, rate=300, seed=seed)
    t0 = time.time() * 1000
    job: subprocess.Popen | None = None
    try:
        for step, op in enumerate(ops):
            say(f"step {step}: {op}")
            if op in ("job", "replay_beside_job"):
                end_job(job, rng, say)
                job = start_job(settings, job_log)
                time.sleep(rng.uniform(6, 14))
            if op in ("replay", "replay_beside_job"):
                start = int(rng.uniform(t0, time.time() * 1000))
                plan = plan_replay(settings, pipeline, from_ms=start)
                result = Replayer(settings=settings, pipeline=pipeline, spark=spark).run(plan)
                say(f"replay from {start}: read {result.read}, archived {result.archived}, "
                    f"recomputed {plan.speed_epochs}")  # fmt: skip
            if op == "job":
                end_job(job, rng, say)
                job = None
            if op == "reset":
                end_job(job, rng, say)
                job = None
                shutil.rmtree(Path(settings.storage_root) / "checkpoints" / pipeline.name, ignore_errors=True)
                result = reset_speed(settings, pipeline, spark)
                say(f"reset: rebuilt {result.rebuilt_epochs}, gap archived {result.archived}")
            if op == "batch":
                try:
                    run = BatchJob(settings=settings, pipeline=pipeline, spark=spark).run()
                    say(f"batch: {run.outcome}, horizon {run.horizon}")
                except ConfigurationError as exc:
                    say(f"batch refused: {exc.message}")
            if op == "restore":
                try:
                    newest = DeltaTable(
                        views_path(settings.storage_root, pipeline.name, pipeline.views[0].name)
                    ).version()
                    version = rng.randrange(0, newest + 1)
                    replayer = Replayer(settings=settings, pipeline=pipeline, spark=spark)
                    run = restore(
                        settings, pipeline, spark, version=version, rebuild_speed=replayer.recompute
                    )
                    say(f"restore of Delta version {version}: horizon {run.horizon}")
                except Exception as exc:  # no views yet, or a version that is not a run's
                    say(f"restore refused: {exc}")
        end_job(job, rng, say)
        job = None
    finally:
        producing.finish()
        if job is not None:
            stop_job(job)
    if settings.speed.latest == "realtime":
        # Its Real-time query holds task slots the shared session may not have (make test).
        caught_up = run_cli(settings, "speed", "run", "offers", "--once", "--lease-wait", "60")
        assert caught_up.returncode == 0, caught_up.stderr.decode()[-2000:]
    else:
        run_speed_once(settings, pipeline, spark)
    coordinates = master_coordinates(settings, pipeline)
    events, _ = topic_events(settings, pipeline)
    assert len(coordinates) == len(set(coordinates)), f"seed {seed}: a coordinate held twice"
    assert set(coordinates) == set(zip(events["_partition"], events["_offset"], strict=True)), f"seed {seed}"
    client = ServingClient(settings=settings, meta_ttl_s=0)
    problems = merged_differences(settings, client, {pipeline.name: pipeline})
    assert problems == [], f"seed {seed}: {problems[:5]}\n" + "\n".join(log)
