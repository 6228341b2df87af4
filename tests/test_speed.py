"""The speed layer end to end: real broker, registry, Cassandra and a local[2,4] Spark session.

Views are compared with an independent reference (tests/reference.py) computed from what Kafka holds.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from confluent_kafka import Producer
from pyspark.sql import functions as F

from lambdalake.avro import HEADER, MAGIC, WireEncoder, parse_schema
from lambdalake.errors import ConfigurationError
from lambdalake.kafka import dlq
from lambdalake.layout import master_path
from lambdalake.master import MasterDataset
from lambdalake.pipeline import Pipeline, WindowedView
from lambdalake.produce.generator import Mix, generate
from lambdalake.produce.producer import EventProducer
from lambdalake.settings import Settings
from lambdalake.speed.job import SpeedJob
from lambdalake.speed.supervisor import Supervisor
from lambdalake.views import speed_table
from tests.conftest import isolated, pipeline_named
from tests.helpers import consume_all, master_coordinates, run_speed_once, send_generated
from tests.reference import cassandra_rows, compare, differences, topic_events, windowed_view

pytestmark = [pytest.mark.services, pytest.mark.slow]

EVENTS = int(os.environ.get("LAMBDALAKE_TEST_EVENTS", "200000"))


def produce_mixed(settings: Settings, pipeline: Pipeline, n: int, seed: int) -> None:
    """n generated events, the first quarter with the older schema version (v1), the rest with v2."""
    records = list(generate(pipeline.name, n, seed=seed, mix=Mix(duplicates=0.03, invalid=0.01, late=0.03)))
    old = EventProducer(settings=settings, pipeline=pipeline, schema_version=1)
    new = EventProducer(settings=settings, pipeline=pipeline, prepare=False)
    split = n // 4
    # A v1 writer knows only v1's fields (the producer refuses unknown ones).
    v1_fields = {f["name"] for f in json.loads(pipeline.schema_text(1))["fields"]}
    for r in records[:split]:
        old.send({k: v for k, v in r.items() if k in v1_fields})
    for r in records[split:]:
        new.send(r)
    for p in (old, new):
        stats = p.flush()
        assert stats.unacknowledged == 0


def own_pipeline(
    services: Settings, tmp_path: Path, shipped: str, name: str, **kw: str
) -> tuple[Settings, Pipeline]:
    """A shipped pipeline under a name of its own (query names are unique per Spark session, and the
    module's jobs still run), on a topic, storage root and keyspace of the test's own."""
    unique = os.urandom(4).hex()
    settings = isolated(services, tmp_path, unique)
    pipeline = pipeline_named(settings, shipped, topic=f"{name}-{unique}", **kw)
    return settings, pipeline.model_copy(update={"name": name})


def records_in(settings: Settings, topic: str) -> int:
    """How many records ``topic`` holds (a new topic: its offsets have no gaps)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({**settings.kafka.client_config(), "group.id": f"count-{os.urandom(4).hex()}"})
    try:
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        marks = [consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10) for p in parts]
    finally:
        consumer.close()
    return sum(high - low for low, high in marks)


def inject_bad_records(settings: Settings, pipeline: Pipeline) -> int:
    """Records the producer would have refused, written around it: the speed layer must dead-letter them."""
    producer = EventProducer(settings=settings, pipeline=pipeline, prepare=False)
    schema = parse_schema(pipeline.reader_schema)
    encoder = WireEncoder(producer.schema_id, schema)
    kind = pipeline.generator.kind if pipeline.generator else pipeline.name
    good = next(generate(kind, 1, seed=99, mix=Mix(duplicates=0, invalid=0, late=0)))
    breaks_rule = {**good, "price_cents": -5} if kind == "offers" else {**good, "speed_kmh": -5.0}
    raw = Producer(settings.kafka.client_config())
    bad = [b"not avro at all", HEADER.pack(MAGIC, 987654) + b"\x02", encoder.encode(breaks_rule)]
    for value in bad:
        raw.produce(pipeline.topic.name, key=b"bad", value=value)
    assert raw.flush(10) == 0
    return len(bad)


@pytest.fixture(scope="module")
def speed_run(services: Settings, spark, tmp_path_factory) -> dict:
    """Both example pipelines produced, then processed by one speed job each until caught up."""
    unique = os.urandom(4).hex()
    settings = isolated(services, tmp_path_factory.mktemp("speed"), unique)
    pipelines = {
        name: pipeline_named(settings, name, topic=f"{name}-{unique}", epoch="10 seconds")
        for name in ("offers", "telemetry")
    }
    for seed, p in enumerate(pipelines.values()):
        produce_mixed(settings, p, EVENTS, seed)
        inject_bad_records(settings, p)
    jobs = {name: SpeedJob(settings=settings, pipeline=p, spark=spark) for name, p in pipelines.items()}
    t0 = time.monotonic()
    for job in jobs.values():
        job.start()
    for job in jobs.values():
        Supervisor(job).catch_up()
    elapsed = time.monotonic() - t0
    yield {"settings": settings, "pipelines": pipelines, "jobs": jobs, "elapsed": elapsed}
    for job in jobs.values():
        job.stop()


@pytest.mark.parametrize("name", ["offers", "telemetry"])
def test_views_equal_reference(speed_run: dict, name: str) -> None:
    settings, pipeline = speed_run["settings"], speed_run["pipelines"][name]
    events, invalid = topic_events(settings, pipeline)
    assert len(events) > 0.9 * EVENTS and invalid == 3
    assert events["_ts"].nunique() > 1
    assert differences(settings, pipeline, events) == []


@pytest.mark.parametrize("name", ["offers", "telemetry"])
def test_master_dataset_holds_each_valid_event_once(speed_run: dict, name: str) -> None:
    settings, pipeline = speed_run["settings"], speed_run["pipelines"][name]
    events, _ = topic_events(settings, pipeline)
    master = MasterDataset(master_path(settings.storage_root, name), event_time=pipeline.event.time).read()
    coords = list(
        zip(master.column("_partition").to_pylist(), master.column("_offset").to_pylist(), strict=True)
    )
    assert len(coords) == len(set(coords)) == len(events)
    assert set(coords) == set(zip(events["_partition"], events["_offset"], strict=True))
    # Old and new schema versions were both written and decode into the one reader shape.
    assert len(set(master.column("_schema_id").to_pylist())) == 2


@pytest.mark.parametrize("name", ["offers", "telemetry"])
def test_bad_records_are_dead_lettered_with_reasons(speed_run: dict, name: str) -> None:
    settings, pipeline = speed_run["settings"], speed_run["pipelines"][name]
    letters = [
        m for m in consume_all(settings, pipeline.topic.dlq) if dict(m.headers())[dlq.STAGE] == b"speed"
    ]
    rules = sorted(dict(m.headers())[dlq.RULE].decode() for m in letters)
    expected_rule = "price_cents.range" if name == "offers" else "speed_kmh.range"
    assert rules == sorted(["wire_format", "wire_format", expected_rule])
    assert all(dict(m.headers())[dlq.REASON] and dict(m.headers())[dlq.SOURCE] for m in letters)
    assert b"not avro at all" in [m.value() for m in letters]


def test_days_late_event_counts_at_once_in_current_epoch(speed_run: dict) -> None:
    settings, pipeline, job = (
        speed_run["settings"],
        speed_run["pipelines"]["offers"],
        speed_run["jobs"]["offers"],
    )
    now_ms = int(time.time() * 1000)
    late = {
        "offer_id": "late-offer",
        "merchant_id": "merchant-late",
        "title": "Old news",
        "price_cents": 4200,
        "currency": "EUR",
        "stock": 1,
        "status": "active",
        "version": 1,
        "updated_at": now_ms - 3 * 86_400_000,
    }
    producer = EventProducer(settings=settings, pipeline=pipeline, prepare=False)
    assert producer.send(late) is None and producer.flush().acked == 1
    msg = next(m for m in consume_all(settings, pipeline.topic.name) if m.key() == b"late-offer")
    Supervisor(job).catch_up()
    rows = [
        r
        for r in cassandra_rows(settings, speed_table(pipeline, pipeline.view("merchant_offers_hourly")))
        if r["merchant_id"] == "merchant-late"
    ]
    window = late["updated_at"] // 3_600_000 * 3_600_000
    assert rows == [
        {
            **rows[0],
            "window_start": window,
            "epoch": msg.timestamp()[1] // (pipeline.layers.epoch_seconds * 1000),
            "updates": 1,
            "price_sum": 4200,
        }
    ]
    status = Path(settings.storage_root, "status", "speed-offers.json").read_text()
    assert '"dropped_behind_watermark": 0' in status


def test_a_record_with_an_old_create_time_lands_in_the_current_ingest_epoch(speed_run: dict) -> None:
    """The topics use LogAppendTime: the broker stamps each record as it appends it, so a producer's
    clock (or an explicit 2001 timestamp) cannot put a record into an epoch a batch already covers."""
    settings, pipeline, job = (
        speed_run["settings"], speed_run["pipelines"]["offers"], speed_run["jobs"]["offers"],
    )  # fmt: skip
    producer = EventProducer(settings=settings, pipeline=pipeline, prepare=False)
    offer = {
        "offer_id": "offer-from-2001", "merchant_id": "m-2001", "title": "Old clock", "price_cents": 1,
        "currency": "EUR", "stock": 1, "status": "active", "version": 1,
        "updated_at": int(time.time() * 1000) - 1000, "promo_code": None,
    }  # fmt: skip
    encoder = WireEncoder(producer.schema_id, parse_schema(pipeline.reader_schema))
    raw = Producer(settings.kafka.client_config())
    before = int(time.time() * 1000)
    raw.produce(
        pipeline.topic.name, key=b"offer-from-2001", value=encoder.encode(offer), timestamp=978_307_200_000
    )
    assert raw.flush(10) == 0
    after = int(time.time() * 1000)
    Supervisor(job).catch_up()
    master = MasterDataset(master_path(settings.storage_root, pipeline.name), event_time=pipeline.event.time)
    table = master.read().to_pylist()
    (row,) = [r for r in table if r["offer_id"] == "offer-from-2001"]
    ingest_ms = int(row["_ingest_ts"].timestamp() * 1000)
    assert before - 1000 <= ingest_ms <= after + 1000
    assert row["_epoch"] == ingest_ms // (pipeline.layers.epoch_seconds * 1000)


def query_names(settings: Settings, pipeline: Pipeline) -> list[str]:
    """The streaming queries a speed job of ``pipeline`` runs: the main one, and the latest views'
    Real-time query when ``speed.latest`` is ``realtime``."""
    from lambdalake.speed.options import runs_realtime_query

    realtime = runs_realtime_query(settings, pipeline)
    return [f"{pipeline.name}-main", *([f"{pipeline.name}-latest"] if realtime else [])]


def test_speed_status_reports_every_query(speed_run: dict) -> None:
    from tests.conftest import run_cli

    settings = speed_run["settings"]
    result = run_cli(settings, "speed", "status", "--json")
    assert result.returncode == 0, result.stderr.decode()
    import json

    queries = json.loads(result.stdout)
    # One query per pipeline: it reads the topic once for every view (and with speed.latest =
    # realtime, the latest views' Real-time query reads it a second time).
    assert set(queries) == {q for p in speed_run["pipelines"].values() for q in query_names(settings, p)}
    for name, stats in queries.items():
        # Every record read (copies and records that fail decoding too), not what the archive pass
        # passed on to the windowed view: the source of the main query yields the latter.
        topic = speed_run["pipelines"][name.split("-")[0]].topic.name
        assert stats["rows"] == records_in(settings, topic), (name, stats)
        assert stats["last_batch"]["lag"] == 0 and stats["dropped_behind_watermark"] == 0
        # The driver's process and its JVM at least (Spark's Python workers when they run).
        assert stats["last_batch"]["job_processes"] >= 2 and stats["last_batch"]["job_rss_mb"] > 100, stats


def test_every_windowed_view_is_counted_by_the_one_read_of_the_topic(
    services: Settings, spark, tmp_path: Path
) -> None:
    """Three windowed views are counted by the main query alone (one read and one decode of the
    topic), and every view equals the reference."""
    unique = os.urandom(4).hex()
    settings = isolated(services, tmp_path, unique)
    base = pipeline_named(settings, "telemetry", topic=f"telemetry2-{unique}")
    hourly = WindowedView.model_validate({
        "name": f"vehicle_hourly_{unique}", "kind": "windowed", "key": ["vehicle_id"], "window": "1 hour",
        "aggregates": [{"name": "readings", "fn": "count"},
                       {"name": "top", "fn": "max", "column": "speed_kmh"},
                       {"name": "odo", "fn": "avg", "column": "odometer_km"}],
    })  # fmt: skip
    # Its own name too: query names are unique per Spark session, and the module's jobs still run.
    pipeline = base.model_copy(update={"name": "telemetry_two", "views": [*base.views, hourly]})
    producer = EventProducer(settings=settings, pipeline=pipeline)
    send_generated(producer, "telemetry", 20_000, seed=11, mix=Mix(duplicates=0.03, invalid=0.01, late=0.03))
    job = SpeedJob(settings=settings, pipeline=pipeline, spark=spark)
    job.start()
    try:
        Supervisor(job).catch_up()
        assert [q.name for q in job.queries] == query_names(settings, pipeline)
        assert len([v for v in pipeline.views if isinstance(v, WindowedView)]) == 3
        events, _ = topic_events(settings, pipeline)
        problems = differences(settings, pipeline, events)
        assert problems == [], problems[:10]
        assert len(cassandra_rows(settings, speed_table(pipeline, hourly))) > 0
    finally:
        job.stop()


def test_windowed_views_added_and_removed_on_a_live_pipeline_move_the_one_query_exactly(
    services: Settings, spark, tmp_path: Path
) -> None:
    """The main query's state is made for its windowed views: when they change it moves to a new
    checkpoint. Here the job stopped with records it had not read, whose epochs closed meanwhile, so
    the new checkpoint recounts from the epoch of the first one: the view kept equals the reference
    in every epoch, the views added equal it from the epoch they start at (the view build
    recomputes the ones before), and the master dataset holds each valid event once."""
    from lambdalake.speed.checkpoints import MAIN_FILE, START_FILE

    unique = os.urandom(4).hex()
    settings = isolated(services, tmp_path, unique)
    full = pipeline_named(
        settings, "telemetry", topic=f"telemetry-move-{unique}", epoch="5 seconds", grace="1 second"
    )
    full = full.model_copy(update={"name": "telemetry_move"})
    minute, state = [v for v in full.views if isinstance(v, WindowedView)]
    hourly = WindowedView.model_validate({
        "name": "vehicle_hourly", "kind": "windowed", "key": ["vehicle_id"], "window": "1 hour",
        "aggregates": [{"name": "readings", "fn": "count"},
                       {"name": "top", "fn": "max", "column": "speed_kmh"}],
    })  # fmt: skip
    latest = [v for v in full.views if not isinstance(v, WindowedView)]
    first = full.model_copy(update={"views": [*latest, minute]})
    second = full.model_copy(update={"views": [*latest, minute, state, hourly]})
    third = full.model_copy(update={"views": [*latest, state, hourly]})
    producer = EventProducer(settings=settings, pipeline=first)
    mix = Mix(duplicates=0.03, invalid=0.01, late=0.03)
    send_generated(producer, "telemetry", 4_000, seed=31, mix=mix)
    run_speed_once(settings, first, spark)
    send_generated(producer, "telemetry", 4_000, seed=32, mix=mix)  # not read before the move
    time.sleep(7)  # their epochs close (5 s epochs, 1 s grace)
    moved_at = int(time.time() * 1000)
    run_speed_once(settings, second, spark)
    checkpoints = f"{settings.storage_root}/checkpoints/{second.name}"
    record = json.loads(Path(f"{checkpoints}/{MAIN_FILE}").read_text())
    assert record["dir"] == "main-g1" and [n for n, _ in record["views"]] == [
        minute.name,
        state.name,
        hourly.name,
    ]
    first_open_ms = (moved_at - 1000) // 5000 * 5000
    assert record["from_ms"] < first_open_ms, "the unread records' closed epochs are counted again, whole"
    starts = {
        v.name: json.loads(Path(f"{checkpoints}/{v.name}/{START_FILE}").read_text()) for v in (state, hourly)
    }
    assert {s["from_ms"] for s in starts.values()} == {record["from_ms"]}
    assert not Path(f"{checkpoints}/{minute.name}/{START_FILE}").exists()
    events, _ = topic_events(settings, full)
    assert differences(settings, first, events) == []  # the latest views and the minute view, whole
    send_generated(producer, "telemetry", 3_000, seed=33, mix=mix)
    run_speed_once(settings, third, spark)
    assert json.loads(Path(f"{checkpoints}/{MAIN_FILE}").read_text())["dir"] == "main-g2"
    send_generated(producer, "telemetry", 2_000, seed=34, mix=mix)
    run_speed_once(settings, third, spark)

    events, _ = topic_events(settings, full)
    assert differences(settings, first.model_copy(update={"views": latest}), events) == []
    for view in (state, hourly):
        start_epoch = starts[view.name]["epoch"]
        want = {k: v for k, v in windowed_view(events, full, view, 5).items() if k[-1] >= start_epoch}
        rows = [r for r in cassandra_rows(settings, speed_table(full, view)) if r["epoch"] >= start_epoch]
        assert want and compare(full, view, want, rows, epoch=True) == [], view.name
    master = MasterDataset(master_path(settings.storage_root, full.name), event_time=full.event.time).read()
    coordinates = list(zip(master["_partition"].to_pylist(), master["_offset"].to_pylist(), strict=True))
    assert len(coordinates) == len(set(coordinates)) == len(events)
    assert set(coordinates) == set(zip(events["_partition"], events["_offset"], strict=True))


def test_a_view_added_before_a_moved_checkpoint_first_ran_records_where_it_starts(
    services: Settings, spark, tmp_path: Path
) -> None:
    """A move left a checkpoint counting from an open epoch, and the job stopped before its first
    batch; a view added meanwhile starts with that checkpoint, so it records the epoch it is counted
    from (the view build recomputes the closed ones before it), as a view added at a move does."""
    from lambdalake.speed.checkpoints import MAIN_FILE, START_FILE
    from lambdalake.speed.starts import view_signature

    unique = os.urandom(4).hex()
    settings = isolated(services, tmp_path, unique)
    pipeline = pipeline_named(settings, "telemetry", topic=f"telemetry-pending-{unique}", epoch="5 seconds")
    minute, state = [v for v in pipeline.views if isinstance(v, WindowedView)]
    checkpoints = f"{settings.storage_root}/checkpoints/{pipeline.name}"
    from_ms = 1_790_000_000_000
    record = {"dir": "main-g1", "views": [[minute.name, view_signature(minute)]], "generation": 1,
              "offsets": {pipeline.topic.name: {"0": 5}}, "from_ms": from_ms}  # fmt: skip
    Path(checkpoints).mkdir(parents=True)
    Path(f"{checkpoints}/{MAIN_FILE}").write_text(json.dumps(record))
    job = SpeedJob(settings=settings, pipeline=pipeline, spark=spark)
    job._choose_main()
    assert [v.name for v in job.counted] == [minute.name, state.name]
    assert job.main_dir.endswith("/main-g1") and job._from_ms == from_ms
    started = json.loads(Path(f"{checkpoints}/{state.name}/{START_FILE}").read_text())
    assert started == {"epoch": from_ms // 5000, "from_ms": from_ms}
    assert not Path(f"{checkpoints}/{minute.name}/{START_FILE}").exists()


def test_a_checkpoint_with_other_stateful_steps_fails_naming_the_rebuild(
    services: Settings, spark, tmp_path: Path
) -> None:
    """A checkpoint written by a plan with other stateful operators (e.g. before deduplication left
    Spark state) cannot be resumed by Spark: the job says so and names the fix."""
    settings, pipeline = own_pipeline(services, tmp_path, "telemetry", "telemetry_old")
    producer = EventProducer(settings=settings, pipeline=pipeline)
    for r in generate("telemetry", 200, seed=5, mix=Mix(invalid=0)):
        producer.send(r)
    assert producer.flush().unacknowledged == 0
    job = SpeedJob(settings=settings, pipeline=pipeline, spark=spark)
    earlier = (
        job.records().withWatermark("timestamp", "10 minutes").dropDuplicatesWithinWatermark(["key"])
        .groupBy(F.window("timestamp", "1 hour")).count()
    )  # fmt: skip
    query = (
        earlier.writeStream.queryName("telemetry_old-earlier").outputMode("update")
        .option("checkpointLocation", job.checkpoints.folder("main"))
        .foreachBatch(lambda df, _i: df.collect()).start()
    )  # fmt: skip
    query.processAllAvailable()
    query.stop()
    for r in generate("telemetry", 100, seed=6, mix=Mix(invalid=0)):  # something for a new batch
        producer.send(r)
    assert producer.flush().unacknowledged == 0
    job.start()
    try:
        with pytest.raises(ConfigurationError, match="cannot resume its checkpoint") as failure:
            Supervisor(job).catch_up()
        fix = failure.value.fix or ""
        # The rebuild keeps the master dataset (it may hold records compaction removed from the topic).
        assert f"lambdalake speed reset {pipeline.name}" in fix and "master dataset" in fix
    finally:
        job.stop()


def test_speed_status_counts_every_row_across_restarts(services: Settings, spark, tmp_path: Path) -> None:
    """Measured before: `speed status` showed 15 rows after a 4,950-row batch (the counts restarted
    with each run of the job)."""
    from tests.conftest import run_cli

    settings, pipeline = own_pipeline(services, tmp_path, "telemetry", "telemetry_status")
    producer = EventProducer(settings=settings, pipeline=pipeline)
    for n, seed in ((4950, 1), (15, 2)):
        send_generated(producer, "telemetry", n, seed=seed, mix=Mix(duplicates=0, invalid=0, late=0))
        run_speed_once(settings, pipeline, spark)
    result = run_cli(settings, "speed", "status", "--json")
    assert result.returncode == 0, result.stderr.decode()
    main = json.loads(result.stdout)["telemetry_status-main"]
    assert main["rows"] == 4965, main


def test_small_micro_batches_give_the_same_views_master_and_dead_letters(
    services: Settings, spark, tmp_path: Path
) -> None:
    """Micro-batches of 400 records: copies across tasks and batches still count once, and every
    record is archived or dead-lettered once."""
    settings, pipeline = own_pipeline(services, tmp_path, "offers", "offers_small", epoch="10 seconds")
    producer = EventProducer(settings=settings, pipeline=pipeline)
    send_generated(producer, "offers", 3000, seed=41, mix=Mix(duplicates=0.05, invalid=0.01, late=0.03))
    bad = inject_bad_records(settings, pipeline)
    run_speed_once(settings, pipeline, spark, max_offsets_per_trigger=400)

    events, invalid = topic_events(settings, pipeline)
    assert invalid == bad and len(events) > 2800
    assert differences(settings, pipeline, events) == []
    coords = master_coordinates(settings, pipeline)
    assert len(coords) == len(set(coords)) == len(events)
