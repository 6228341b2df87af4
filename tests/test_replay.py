"""Replay and speed reset restore exact answers: a slice of the master dataset and of the speed rows deleted,
then `replay` of that range (with the batch run it offers) gives answers equal to the reference;
the same replay again changes nothing; `--dry-run` changes nothing; `speed reset` after deleting the
checkpoint rebuilds the speed layer from the master dataset."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from lambdalake.batch.job import BatchJob
from lambdalake.cassandra.session import connect
from lambdalake.layout import master_path
from lambdalake.pipeline import LatestView
from lambdalake.produce.generator import Mix, generate
from lambdalake.produce.producer import EventProducer
from lambdalake.serving import ServingClient
from lambdalake.settings import Settings
from lambdalake.speed.job import SpeedJob
from lambdalake.speed.replay import Replayer, plan_replay
from lambdalake.speed.supervisor import Supervisor
from lambdalake.views import speed_table
from tests.conftest import isolated, pipeline_named, run_cli
from tests.helpers import master_coordinates, pipelines_folder, run_speed_once
from tests.reference import cassandra_rows, merged_differences, topic_events

pytestmark = [pytest.mark.services, pytest.mark.slow]


def sleep_until(ms: float) -> None:
    time.sleep(max(0.0, (ms - time.time() * 1000) / 1000))


def fresh(records: list[dict[str, Any]], shift: int) -> list[dict[str, Any]]:
    """Offers with versions no other wave used (the generator starts versions at 1 in every run)."""
    return [{**r, "version": r["version"] + shift} for r in records if isinstance(r.get("version"), int)]


@pytest.fixture(scope="module")
def replayed(services: Settings, spark, tmp_path_factory: pytest.TempPathFactory) -> Any:
    unique = f"r{int(time.time() * 1000) % 10**8}"
    tmp = tmp_path_factory.mktemp("replay")
    base = isolated(services, tmp, unique)
    pipeline = pipeline_named(
        base,
        "offers",
        topic=f"offers-{unique}",
        epoch="10 seconds",
        dedup_delay="3 seconds",
        grace="1 second",
    )
    folder = pipelines_folder(tmp, pipeline)
    # The waves of this test double the views from one batch to the next: not an anomaly here.
    suite = json.loads((folder / "offers.expectations.json").read_text())
    (folder / "offers.expectations.json").write_text(json.dumps({**suite, "row_count_tolerance": 10}))
    settings = base.model_copy(update={"pipelines_dir": folder})
    producer = EventProducer(settings=settings, pipeline=pipeline)
    job = SpeedJob(settings=settings, pipeline=pipeline, spark=spark)
    job.start()
    epoch_ms = pipeline.layers.epoch_ms

    def wave(n: int, seed: int, shift: int) -> int:
        """Send a wave in an epoch of its own; returns that epoch."""
        sleep_until((time.time() * 1000 // epoch_ms + 1) * epoch_ms + 200)
        epoch = int(time.time() * 1000 // epoch_ms)
        for r in fresh(list(generate("offers", n, seed=seed, mix=Mix(0.05, 0.01, 0.05))), shift):
            producer.send(r)
        assert producer.flush().unacknowledged == 0
        assert int(time.time() * 1000 // epoch_ms) == epoch, "a wave spilled into the next epoch"
        Supervisor(job).catch_up()
        return epoch

    first = wave(1200, 81, 0)
    sleep_until((first + 1) * epoch_ms + 1500)
    batch = BatchJob(settings=settings, pipeline=pipeline, spark=spark).run()
    assert batch.outcome == "published" and batch.horizon >= first, batch
    second = wave(800, 82, 1_000_000)
    sleep_until((second + 1) * epoch_ms + 1500)  # closed: replay may recompute it
    job.stop()
    yield {"settings": settings, "pipeline": pipeline, "first": first, "second": second,
           "horizon": batch.horizon, "spark": spark}  # fmt: skip


def master_version(settings: Settings, pipeline) -> int:
    return DeltaTable(master_path(settings.storage_root, pipeline.name)).version()


def test_replay_restores_a_deleted_slice_and_is_idempotent(replayed: Any) -> None:
    settings, pipeline = replayed["settings"], replayed["pipeline"]
    first, second, epoch_ms = replayed["first"], replayed["second"], pipeline.layers.epoch_ms
    client = ServingClient(settings=settings, meta_ttl_s=0)
    pipelines = {pipeline.name: pipeline}
    assert merged_differences(settings, client, pipelines) == []
    complete = sorted(master_coordinates(settings, pipeline))

    # Lose a slice: the master dataset of both waves' epochs (one covered by the batch, one after it) and the
    # speed rows of the later one.
    DeltaTable(master_path(settings.storage_root, pipeline.name)).delete(
        f"_epoch = {first} OR _epoch = {second}"
    )
    session = connect(settings.cassandra)
    for view in pipeline.views:
        if isinstance(view, LatestView):
            continue
        table = speed_table(pipeline, view)
        for row in cassandra_rows(settings, table):
            if row["epoch"] == second:
                session.execute(
                    f'DELETE FROM "{settings.cassandra.keyspace}"."{table}" WHERE "{view.key[0]}" = %s '
                    "AND window_start = %s AND epoch = %s",
                    [row[view.key[0]], row["window_start"], row["epoch"]],
                )
    broken = merged_differences(settings, client, pipelines)
    assert broken != []
    assert len(master_coordinates(settings, pipeline)) < len(complete)
    window = ["--from-timestamp", str(first * epoch_ms), "--to-timestamp", str((second + 1) * epoch_ms)]

    version = master_version(settings, pipeline)
    dry = run_cli(settings, "replay", "offers", *window, "--dry-run")
    assert dry.returncode == 0, dry.stdout.decode() + dry.stderr.decode()
    assert "dry run" in dry.stdout.decode()
    assert master_version(settings, pipeline) == version
    assert merged_differences(settings, client, pipelines) == broken

    replay = run_cli(settings, "replay", "offers", *window, "--run-batch")
    output = replay.stdout.decode() + replay.stderr.decode()
    assert replay.returncode == 0, output
    assert "archived now" in output and "batch: published" in output, output
    assert sorted(master_coordinates(settings, pipeline)) == complete
    assert merged_differences(settings, client, pipelines) == []

    # The same replay again changes nothing: nothing archived, the same answers. (In the module's
    # Spark session: the command's own driver would cost ~20 CPU-s and adds nothing to the above.)
    version = master_version(settings, pipeline)
    plan = plan_replay(settings, pipeline, from_ms=first * epoch_ms, to_ms=(second + 1) * epoch_ms)
    again = Replayer(settings=settings, pipeline=pipeline, spark=replayed["spark"]).run(plan)
    assert again.read > 0 and again.archived == 0, again
    assert master_version(settings, pipeline) == version
    assert merged_differences(settings, client, pipelines) == []
    events, _ = topic_events(settings, pipeline)
    assert len(events) == len(complete)


def test_speed_reset_after_losing_the_checkpoint(replayed: Any, spark) -> None:
    """Events of a closed epoch after the horizon are in the master dataset and the speed rows; the checkpoint
    is lost; `speed reset` rebuilds their rows from the master dataset, and the restarted job goes on from the
    oldest open epoch without archiving anything twice."""
    settings, pipeline = replayed["settings"], replayed["pipeline"]
    epoch_ms = pipeline.layers.epoch_ms
    client = ServingClient(settings=settings, meta_ttl_s=0)
    producer = EventProducer(settings=settings, pipeline=pipeline)

    def send(seed: int, shift: int) -> None:
        for r in fresh(list(generate("offers", 300, seed=seed, mix=Mix(0.05, 0.0, 0.0))), shift):
            producer.send(r)
        assert producer.flush().unacknowledged == 0

    send(83, 2_000_000)
    run_speed_once(settings, pipeline, spark)
    sleep_until((time.time() * 1000 // epoch_ms + 1) * epoch_ms + 1500)  # that epoch closes
    shutil.rmtree(Path(settings.storage_root) / "checkpoints" / pipeline.name)
    reset = run_cli(settings, "speed", "reset", "offers", "--yes")
    output = reset.stdout.decode() + reset.stderr.decode()
    assert reset.returncode == 0, output
    assert "rebuilt epochs from the master dataset: [" in output, output  # at least the closed epoch above
    assert merged_differences(settings, client, {pipeline.name: pipeline}) == []
    before = len(master_coordinates(settings, pipeline))
    send(84, 3_000_000)
    run_speed_once(settings, pipeline, spark)
    coordinates = master_coordinates(settings, pipeline)
    assert len(coordinates) == len(set(coordinates)), "records archived twice"
    assert len(coordinates) > before
    assert merged_differences(settings, client, {pipeline.name: pipeline}) == []
