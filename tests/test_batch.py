"""The batch layer end to end: events with duplicates (inside and beyond the dedup delay, in another
partition), late and out-of-order ones, and events the speed layer dropped behind its watermark,
archived by the speed job; the rebuilt Delta views and the
published Cassandra rows equal an independent reference (pandas over what the topic holds) for
exactly the events with ingest epoch <= horizon."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pytest
from confluent_kafka import Producer
from deltalake import DeltaTable

from lambdalake.avro import WireEncoder, parse_schema
from lambdalake.batch.job import BatchJob
from lambdalake.batch.run import RUN_ID
from lambdalake.cassandra.active import active_batch
from lambdalake.cassandra.session import connect
from lambdalake.cassandra.tables import batch_table_def
from lambdalake.delta import commit_metadata
from lambdalake.errors import ConfigurationError
from lambdalake.layout import identities_path, views_path
from lambdalake.pipeline import Pipeline
from lambdalake.produce.generator import Mix, generate
from lambdalake.produce.producer import EventProducer
from lambdalake.settings import PROJECT_ROOT, Settings
from lambdalake.speed.job import SpeedJob
from lambdalake.speed.options import SpeedOptions
from lambdalake.speed.supervisor import Supervisor
from tests.conftest import env_for, isolated, pipeline_named
from tests.helpers import kill_publish_half_way, pipelines_folder
from tests.reference import batch_differences, batch_rows, batch_views, topic_events

pytestmark = [pytest.mark.services, pytest.mark.slow]


def as_ms(value: Any) -> Any:
    if isinstance(value, pd.Timestamp):
        return int(value.value // 1_000_000)
    return None if value is not None and not isinstance(value, str) and pd.isna(value) else value


def delta_rows(
    settings: Settings, pipeline: Pipeline, *, version: int | None = None
) -> dict[str, list[dict]]:
    """Every view's rows read by delta-rs (an independent Delta reader), timestamps as epoch ms."""
    out = {}
    for view in pipeline.views:
        table = DeltaTable(views_path(settings.storage_root, pipeline.name, view.name), version=version)
        frame = table.to_pandas()
        out[view.name] = [{k: as_ms(v) for k, v in row.items()} for row in frame.to_dict("records")]
    return out


def published_rows(settings: Settings, pipeline: Pipeline) -> tuple[int, dict[str, list[dict]]]:
    active = active_batch(connect(settings.cassandra), settings.cassandra.keyspace, pipeline.name)
    assert active is not None
    return active.version, {v.name: batch_rows(settings, pipeline, v, active) for v in pipeline.views}


def wait_for_epoch_end(pipeline: Pipeline) -> None:
    """Sleep until the current ingest epoch has ended and its grace has passed."""
    epoch_ms = pipeline.layers.epoch_seconds * 1000
    now = time.time() * 1000
    time.sleep(((now // epoch_ms + 1) * epoch_ms + pipeline.layers.grace_seconds * 1000 + 500 - now) / 1000)


@pytest.fixture(scope="module")
def archived(services: Settings, spark, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two waves of offers archived by the speed job, the second in an epoch still open."""
    unique = f"b{int(time.time() * 1000) % 10**8}"
    settings = isolated(services, tmp_path_factory.mktemp("batch"), unique)
    pipeline = pipeline_named(
        settings,
        "offers",
        topic=f"offers-{unique}",
        epoch="10 seconds",
        dedup_delay="3 seconds",
        grace="1 second",
    )
    producer = EventProducer(settings=settings, pipeline=pipeline)
    encoder = WireEncoder(producer.schema_id, parse_schema(pipeline.reader_schema))
    raw = Producer(settings.kafka.client_config())
    # Stragglers: a backlog in partition 0 appended well before everything else. The speed job reads
    # it a little per trigger (max_offsets_per_trigger below) while the other partition moves its
    # watermark past it, so it drops most of them from its windowed rows; the batch counts them all.
    # Versions of their own: the generator starts every run's versions at 1, and identities shared
    # with the other waves would make them copies instead of events.
    stragglers = [
        {**r, "version": r["version"] + 5_000_000}
        for r in generate("offers", 700, seed=33, mix=Mix(duplicates=0.0, invalid=0.0, late=0.0))
        if producer._validator.check(dict(r)) is None
    ][:600]  # fmt: skip
    for r in stragglers:
        raw.produce(pipeline.topic.name, key=r["offer_id"].encode(), value=encoder.encode(r), partition=0)
    assert raw.flush(10) == 0
    # The speed layer's epoch windows close when the watermark (newest ingest time less the dedup
    # delay) passes their end: everything else is sent after that point.
    epoch_ms = pipeline.layers.epoch_ms
    straggler_epoch_end = (time.time() * 1000 // epoch_ms + 1) * epoch_ms
    time.sleep((straggler_epoch_end + pipeline.layers.dedup_delay_seconds * 1000 + 1500) / 1000 - time.time())
    records = list(generate("offers", 4000, seed=31, mix=Mix(duplicates=0.05, invalid=0.01, late=0.05)))
    for r in records:
        producer.send(dict(r))
    assert producer.flush().unacknowledged == 0
    time.sleep(4)  # further apart than the dedup delay: the speed layer counts these copies twice
    for r in records[:200]:
        producer.send(dict(r))
    assert producer.flush().unacknowledged == 0
    # A copy in each partition (as after partitions were added): one of them is in another partition.
    valid = next(r for r in records[300:] if producer._validator.check(dict(r)) is None)
    for partition in range(pipeline.topic.partitions):
        raw.produce(
            pipeline.topic.name,
            key=valid["offer_id"].encode(),
            value=encoder.encode(valid),
            partition=partition,
        )
    assert raw.flush(10) == 0
    job = SpeedJob(
        settings=settings, pipeline=pipeline, spark=spark, options=SpeedOptions(max_offsets_per_trigger=400)
    )
    job.start()
    Supervisor(job).catch_up()
    dropped = sum(s.dropped_behind_watermark for s in job.progress.stats.values())
    # Spark counts after its partial aggregation: (merchant, hour, epoch) groups of stragglers.
    assert dropped > 0, job.progress.stats  # the stragglers the speed layer left to the batch
    wait_for_epoch_end(pipeline)
    # The second wave lands in an epoch still open at `second_wave_ms`: a batch as of then leaves it
    # to the speed layer.
    second_wave_ms = int(time.time() * 1000)
    for r in generate("offers", 500, seed=32, mix=Mix(duplicates=0.05, invalid=0.0, late=0.1)):
        producer.send(dict(r))
    assert producer.flush().unacknowledged == 0
    Supervisor(job).catch_up()
    yield {"settings": settings, "pipeline": pipeline, "job": job, "second_wave_ms": second_wave_ms}
    job.stop()


def test_batch_views_equal_the_reference_up_to_the_horizon(archived: dict, spark) -> None:
    settings, pipeline = archived["settings"], archived["pipeline"]
    as_of = archived["second_wave_ms"]
    first = BatchJob(settings=settings, pipeline=pipeline, spark=spark).run(as_of_ms=as_of)
    assert first.outcome == "published", first
    assert first.horizon == as_of // (pipeline.layers.epoch_seconds * 1000) - 1
    assert first.duplicates > 200 and first.after_horizon > 0, first
    events, _ = topic_events(settings, pipeline)
    want = batch_views(events, pipeline, first.horizon)
    assert all(len(want[v.name]) == first.rows[v.name] > 100 for v in pipeline.views), first.rows
    assert batch_differences(pipeline, want, delta_rows(settings, pipeline)) == []
    # delta-spark wrote the views and the identity index (no Parquet files committed by delta-rs),
    # each commit naming the run, and delta-rs reads them (above) and their run back.
    tables = [views_path(settings.storage_root, pipeline.name, v.name) for v in pipeline.views]
    for path in [*tables, identities_path(settings.storage_root, pipeline.name)]:
        newest = DeltaTable(path).history(1)[0]
        assert "Delta-Lake/" in newest.get("engineInfo", ""), (path, newest)
        assert commit_metadata(newest)[RUN_ID] == first.run_id, (path, newest)
    version, rows = published_rows(settings, pipeline)
    assert version == first.batch_version
    assert batch_differences(pipeline, want, rows) == []
    # Events after the horizon exist and are not in the batch.
    assert (events["_ts"] // (pipeline.layers.epoch_seconds * 1000) > first.horizon).any()

    # Two runs over the same master dataset: identical rows, a new Delta version and batch version.
    second = BatchJob(settings=settings, pipeline=pipeline, spark=spark).run(horizon=first.horizon)
    assert second.batch_version == first.batch_version + 1
    assert all(second.delta_versions[v] == first.delta_versions[v] + 1 for v in first.delta_versions)
    assert second.rows == first.rows
    assert batch_differences(pipeline, want, delta_rows(settings, pipeline)) == []
    assert batch_differences(pipeline, want, published_rows(settings, pipeline)[1]) == []
    # Time travel to the first version returns the first run's rows.
    view = pipeline.views[0].name
    before = delta_rows(settings, pipeline, version=first.delta_versions[view])[view]
    after = delta_rows(settings, pipeline)[view]
    key = lambda r: tuple(str(r[c]) for c in sorted(r))  # noqa: E731
    assert sorted(before, key=key) == sorted(after, key=key)


def test_an_open_epoch_is_refused_as_horizon(archived: dict, spark) -> None:
    settings, pipeline = archived["settings"], archived["pipeline"]
    open_epoch = int(time.time()) // pipeline.layers.epoch_seconds
    with pytest.raises(ConfigurationError) as refused:
        BatchJob(settings=settings, pipeline=pipeline, spark=spark).run(horizon=open_epoch, dry_run=True)
    assert "still open" in str(refused.value)


def test_dry_run_writes_nothing(archived: dict, spark, tmp_path: Path) -> None:
    settings, pipeline = archived["settings"], archived["pipeline"]
    view = pipeline.views[0].name
    before = DeltaTable(views_path(settings.storage_root, pipeline.name, view)).version()
    result = BatchJob(settings=settings, pipeline=pipeline, spark=spark).run(dry_run=True)
    assert result.outcome == "dry run" and result.rows[view] > 0
    assert DeltaTable(views_path(settings.storage_root, pipeline.name, view)).version() == before


def test_restore_republishes_the_cassandra_rows_from_delta(archived: dict, spark) -> None:
    """The serving store can be rebuilt from the system of record: drop the active tables, restore."""
    from lambdalake.batch.restore import restore

    settings, pipeline = archived["settings"], archived["pipeline"]
    session = connect(settings.cassandra)
    active = active_batch(session, settings.cassandra.keyspace, pipeline.name)
    assert active is not None
    for view in pipeline.views:
        table = batch_table_def(pipeline, view, active.generation).name
        session.execute(f'DROP TABLE "{settings.cassandra.keyspace}"."{table}"')
    restored = restore(settings, pipeline, spark)
    assert restored.batch_version == active.version + 1 and restored.horizon == active.horizon
    events, _ = topic_events(settings, pipeline)
    want = batch_views(events, pipeline, restored.horizon)
    assert batch_differences(pipeline, want, published_rows(settings, pipeline)[1]) == []


def test_a_publish_killed_half_way_leaves_serving_on_the_previous_version(
    archived: dict, spark, tmp_path: Path
) -> None:
    """kill -9 of `lambdalake batch run` while it writes the new version's rows: the active version
    is still the previous complete one; the next run publishes cleanly."""
    settings, pipeline = archived["settings"], archived["pipeline"]
    session = connect(settings.cassandra)
    keyspace = settings.cassandra.keyspace
    before = active_batch(session, keyspace, pipeline.name)
    assert before is not None
    env = {**env_for(settings), "LAMBDALAKE_PIPELINES_DIR": str(pipelines_folder(tmp_path, pipeline))}
    kill_publish_half_way(settings, pipeline, "--full", "--horizon", str(before.horizon), env=env)
    after = active_batch(session, keyspace, pipeline.name)
    assert after == before, "a half-written version became active"
    events, _ = topic_events(settings, pipeline)
    want = batch_views(events, pipeline, before.horizon)
    assert batch_differences(pipeline, want, published_rows(settings, pipeline)[1]) == []
    # The next run takes a higher version than the killed one and publishes cleanly.
    rerun = BatchJob(settings=settings, pipeline=pipeline, spark=spark).run(horizon=before.horizon)
    assert rerun.batch_version == before.version + 2
    assert batch_differences(pipeline, want, published_rows(settings, pipeline)[1]) == []


def test_the_schedule_runs_a_due_pipeline(archived: dict, tmp_path: Path) -> None:
    settings, pipeline = archived["settings"], archived["pipeline"]
    session = connect(settings.cassandra)
    before = active_batch(session, settings.cassandra.keyspace, pipeline.name)
    assert before is not None
    env = {
        **env_for(settings),
        "LAMBDALAKE_PIPELINES_DIR": str(pipelines_folder(tmp_path, pipeline, schedule="* * * * *")),
    }
    result = subprocess.run(
        [sys.executable, "-m", "lambdalake", "batch", "schedule", "--once", "--pipeline", "offers"],
        env=env, cwd=PROJECT_ROOT, capture_output=True, timeout=600,
    )  # fmt: skip
    out = (result.stdout + result.stderr).decode()
    assert result.returncode == 0 and "offers: published" in out, out[-3000:]
    after = active_batch(session, settings.cassandra.keyspace, pipeline.name)
    assert after is not None and after.version > before.version


def test_a_planted_fault_fails_the_gate_and_serving_keeps_the_previous_version(archived: dict, spark) -> None:
    """A negative price written straight into the master dataset (around the producer's and the speed layer's
    checks): the run stops naming the expectation, and the active batch version does not move.
    Last in the module: it leaves the master dataset faulty."""
    from lambdalake.batch.quality import QualityGateFailed
    from lambdalake.layout import master_path
    from lambdalake.master import MasterDataset
    from lambdalake.master_files import write_event_files

    settings, pipeline = archived["settings"], archived["pipeline"]
    session = connect(settings.cassandra)
    before = active_batch(session, settings.cassandra.keyspace, pipeline.name)
    assert before is not None
    master = MasterDataset(master_path(settings.storage_root, pipeline.name), event_time=pipeline.event.time)
    existing = master.read().drop_columns(["event_date"])
    row = existing.slice(0, 1).to_pylist()[0]
    epoch_ms = pipeline.layers.epoch_seconds * 1000
    ingest = datetime.fromtimestamp(((before.horizon + 1) * epoch_ms - 1000) / 1000, tz=UTC)
    row.update(offer_id="planted-fault", version=1, price_cents=-5, _offset=10**12, _ingest_ts=ingest)
    row["_epoch"] = before.horizon  # inside the horizon the next run covers
    planted = pa.Table.from_pylist([row], schema=existing.schema)
    files = write_event_files(planted, path=master.path, event_time=pipeline.event.time, name="planted-fault")
    master.commit(files, app_id="test-planted-fault", batch_id=0, layers=pipeline.layers)
    with pytest.raises(QualityGateFailed) as failed:
        BatchJob(settings=settings, pipeline=pipeline, spark=spark).run(horizon=before.horizon)
    message = str(failed.value)
    assert "master: expect_column_values_to_be_between(price_cents)" in message, message
    assert active_batch(session, settings.cassandra.keyspace, pipeline.name) == before
    report = Path(message.split("read ", 1)[1].split(";", 1)[0])
    assert "**FAIL**" in report.read_text() and "price_cents" in report.read_text()
