"""Exactness on the operational paths: replay beside the speed job, speed reset, quiet partitions,
restore below the horizon, concurrent publishes. Every check compares against the reference folded
from the topic (tests.reference), or counts coordinates in the master dataset."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from lambdalake.batch.job import BatchJob, BatchRun
from lambdalake.batch.publish import Publisher
from lambdalake.batch.restore import restore
from lambdalake.cassandra.active import active_batch
from lambdalake.cassandra.session import connect
from lambdalake.errors import ConfigurationError
from lambdalake.pipeline import LatestView
from lambdalake.produce.generator import Mix, generate
from lambdalake.produce.producer import EventProducer
from lambdalake.serving import ServingClient
from lambdalake.settings import Settings
from lambdalake.speed.replay import Replayer, plan_replay
from lambdalake.speed.reset import reset_speed
from lambdalake.views import speed_table
from tests.conftest import isolated, pipeline_named, run_cli
from tests.helpers import kcat_count, master_coordinates, pipelines_folder, run_speed_once
from tests.reference import cassandra_rows, merged_differences

pytestmark = [pytest.mark.services, pytest.mark.slow]

EPOCH_S = 10


def now_ms() -> int:
    return int(time.time() * 1000)


def sleep_until(ms: float) -> None:
    time.sleep(max(0.0, (ms - now_ms()) / 1000))


def next_epoch(epoch_ms: int) -> int:
    """Wait for the start of the next epoch (plus a margin) and return it."""
    sleep_until((now_ms() // epoch_ms + 1) * epoch_ms + 300)
    return now_ms() // epoch_ms


def setup(services: Settings, tmp_path: Path, unique: str) -> tuple[Settings, Any]:
    base = isolated(services, tmp_path, unique)
    pipeline = pipeline_named(
        base, "offers", topic=f"offers-{unique}", epoch=f"{EPOCH_S} seconds", dedup_delay="3 seconds",
        grace="1 second",
    )  # fmt: skip
    folder = pipelines_folder(tmp_path, pipeline)
    suite = json.loads((folder / "offers.expectations.json").read_text())
    (folder / "offers.expectations.json").write_text(json.dumps({**suite, "row_count_tolerance": 100}))
    return base.model_copy(update={"pipelines_dir": folder}), pipeline


def offer(offer_id: str, merchant: str, version: int, *, price: int = 1000) -> dict[str, Any]:
    return {
        "offer_id": offer_id, "merchant_id": merchant, "title": "a far copy", "price_cents": price,
        "currency": "EUR", "stock": 3, "status": "active", "version": version,
        "updated_at": now_ms() - 60_000, "promo_code": None,
    }  # fmt: skip


def send(producer: EventProducer, records: list[dict[str, Any]], *, valid: bool = False) -> None:
    for r in records:
        rejection = producer.send(r)
        assert not valid or rejection is None, rejection
    assert producer.flush().unacknowledged == 0


def wave(producer: EventProducer, n: int, seed: int, shift: int) -> None:
    """Generated offers whose versions no other wave uses (the generator starts at 1 every run)."""
    records = [
        r
        for r in generate("offers", n, seed=seed, mix=Mix(0.05, 0.0, 0.0))
        if isinstance(r.get("version"), int)
    ]
    send(producer, [{**r, "version": r["version"] + shift} for r in records])


def garbage(settings: Settings, topic: str, per_partition: int) -> None:
    """Records that are not Confluent-framed Avro, on every partition (a plain client, no validation)."""
    from confluent_kafka import Producer

    raw = Producer(settings.kafka.client_config())
    for p in (0, 1):
        for i in range(per_partition):
            raw.produce(topic, value=b"not avro %d" % i, key=b"bad", partition=p)
    assert raw.flush(30) == 0


def assert_once(settings: Settings, pipeline: Any) -> list[tuple[int, int]]:
    coordinates = master_coordinates(settings, pipeline)
    assert len(coordinates) == len(set(coordinates)), "the master dataset holds a coordinate twice"
    return coordinates


def test_replay_beside_the_speed_job_archives_each_record_once_and_empties_stale_cells(
    services: Settings, spark: Any, tmp_path: Path, unique: str
) -> None:
    settings, pipeline = setup(services, tmp_path, unique)
    epoch_ms = pipeline.layers.epoch_ms
    producer = EventProducer(settings=settings, pipeline=pipeline)
    client = ServingClient(settings=settings, meta_ttl_s=0)
    run_cli(settings, "topics", "offers", "--apply")

    first = next_epoch(epoch_ms)
    wave(producer, 400, 91, 0)
    # One event delivered again far apart (beyond the dedup delay): the speed layer counts both copies
    # until the replay recomputes the later copy's epoch; its merchant has no other event.
    far = offer("far-copy", "m-far-copy", 1)
    send(producer, [far], valid=True)
    assert now_ms() // epoch_ms == first, "the wave spilled into the next epoch"

    # Closed by the clock, but the speed job has not read it: not the replay's to recompute (the
    # job would later overwrite the recompute with its own partial value).
    sleep_until((first + 1) * epoch_ms + 1500)
    plan = plan_replay(settings, pipeline, from_offsets={0: 0, 1: 0})
    assert first in plan.open_epochs and first not in plan.speed_epochs, plan

    # The replay decides what the master dataset lacks, then the speed job archives the same records before
    # the replay's commit: the commit leaves them out.
    replayer = Replayer(settings=settings, pipeline=pipeline, spark=spark)
    commit = replayer.master.commit

    def speed_job_first(*args: Any, **kwargs: Any) -> Any:
        run_speed_once(settings, pipeline, spark)
        assert master_coordinates(settings, pipeline), "the speed job archived nothing"
        return commit(*args, **kwargs)

    replayer.master.commit = speed_job_first  # type: ignore[method-assign]
    result = replayer.run(plan)
    assert result.read > 0 and result.archived == 0, result
    held = assert_once(settings, pipeline)

    second = next_epoch(epoch_ms)
    send(producer, [far], valid=True)
    wave(producer, 200, 92, 1_000_000)
    starts = {p: o for p, o in _ends(held).items()}
    run_speed_once(settings, pipeline, spark)
    sleep_until((second + 1) * epoch_ms + 1500)
    run_speed_once(settings, pipeline, spark)  # nothing new: the job has read past the epoch's end
    assert merged_differences(settings, client, {pipeline.name: pipeline}) != []  # the far copy counts twice

    # --from-offsets, through the CLI: the second wave's epoch is recomputed, the stale cell emptied.
    offsets = ",".join(f"{p}:{o + 1}" for p, o in sorted(starts.items()))
    replay = run_cli(settings, "replay", "offers", "--from-offsets", offsets, "--no-run-batch")
    output = replay.stdout.decode() + replay.stderr.decode()
    assert replay.returncode == 0, output
    assert "emptied" in output, output
    assert merged_differences(settings, client, {pipeline.name: pipeline}) == []
    assert_once(settings, pipeline)

    batch = BatchJob(settings=settings, pipeline=pipeline, spark=spark).run()
    assert batch.outcome == "published" and batch.horizon >= second, batch
    assert merged_differences(settings, client, {pipeline.name: pipeline}) == []

    # Every documented form of the range, planned by the command: offsets to offsets, timestamps, a
    # partition's offset alone.
    to = ",".join(f"{p}:{o + 1}" for p, o in sorted(starts.items()))
    for args in (
        ["--from-offsets", "0:0,1:0", "--to-offsets", to],
        ["--from-timestamp", str(first * epoch_ms), "--to-timestamp", str((second + 1) * epoch_ms)],
        ["--from-offsets", "0:0"],
    ):
        answer = run_cli(settings, "replay", "offers", *args, "--dry-run")
        assert answer.returncode == 0, answer.stdout.decode() + answer.stderr.decode()
    # The last one run, in this test's Spark session (a command's own driver would cost ~20 CPU-s;
    # the replay command itself runs in tests/test_replay.py and tests/test_secure.py): a partition
    # replayed whole again archives nothing twice, and every answer stays exact.
    Replayer(settings=settings, pipeline=pipeline, spark=spark).run(
        plan_replay(settings, pipeline, from_offsets={0: 0})
    )
    unknown = run_cli(settings, "replay", "offers", "--from-offsets", "7:0", "--dry-run")
    assert unknown.returncode == 2 and "no partition [7]" in unknown.stdout.decode() + unknown.stderr.decode()
    assert_once(settings, pipeline)
    assert merged_differences(settings, client, {pipeline.name: pipeline}) == []


def _ends(coordinates: list[tuple[int, int]]) -> dict[int, int]:
    out: dict[int, int] = {}
    for p, o in coordinates:
        out[p] = max(out.get(p, -1), o)
    return out


def test_reset_fills_the_gap_and_quiet_partitions_move_the_horizon_and_restore_rebuilds_speed_rows(
    services: Settings, spark: Any, tmp_path: Path, unique: str
) -> None:
    settings, pipeline = setup(services, tmp_path, unique)
    epoch_ms = pipeline.layers.epoch_ms
    producer = EventProducer(settings=settings, pipeline=pipeline)
    client = ServingClient(settings=settings, meta_ttl_s=0)
    run_cli(settings, "topics", "offers", "--apply")

    next_epoch(epoch_ms)
    wave(producer, 300, 93, 0)
    run_speed_once(settings, pipeline, spark)
    # The next epoch holds dead letters only, on every partition: its micro-batch archives nothing.
    quiet = next_epoch(epoch_ms)
    garbage(settings, pipeline.topic.name, 20)
    run_speed_once(settings, pipeline, spark)
    assert kcat_count(settings, pipeline.topic.dlq) >= 40
    sleep_until((quiet + 1) * epoch_ms + 1500)
    early = BatchJob(settings=settings, pipeline=pipeline, spark=spark).run()
    assert early.outcome == "published" and early.horizon >= quiet, early  # not stalled at `first`

    # Records the job never reads: the checkpoint is lost, and the reset starts the new one at the
    # oldest open epoch, after them. The reset archives them first.
    missed = next_epoch(epoch_ms)
    wave(producer, 300, 94, 1_000_000)
    before = len(master_coordinates(settings, pipeline))
    sleep_until((missed + 1) * epoch_ms + 1500)
    next_epoch(epoch_ms)
    shutil.rmtree(Path(settings.storage_root) / "checkpoints" / pipeline.name)
    # In this test's Spark session (the `speed reset` command runs in tests/test_replay.py and
    # tests/test_secure.py).
    reset_speed(settings, pipeline, spark)
    coordinates = assert_once(settings, pipeline)
    assert len(coordinates) >= before + 280, (before, len(coordinates))
    assert merged_differences(settings, client, {pipeline.name: pipeline}) == []
    run_speed_once(settings, pipeline, spark)
    late = BatchJob(settings=settings, pipeline=pipeline, spark=spark).run()
    assert late.outcome == "published" and late.horizon >= missed, late
    assert merged_differences(settings, client, {pipeline.name: pipeline}) == []

    # A batch below the active horizon is refused; a restore of the early version rebuilds the speed
    # rows of the epochs in between first (here: deleted, as their TTL would).
    # Both in this process's session: a command's own driver JVM costs ~20 CPU-seconds, and the
    # commands `batch run` and `batch restore` have tests of their own (tests/test_secure.py).
    with pytest.raises(ConfigurationError, match="is older"):
        BatchJob(settings=settings, pipeline=pipeline, spark=spark).run(horizon=early.horizon)
    session = connect(settings.cassandra)
    for view in pipeline.views:
        if not isinstance(view, LatestView):
            table = speed_table(pipeline, view)
            for row in cassandra_rows(settings, table):
                if early.horizon < row["epoch"] <= late.horizon:
                    session.execute(
                        f'DELETE FROM "{settings.cassandra.keyspace}"."{table}" WHERE "{view.key[0]}" = %s '
                        "AND window_start = %s AND epoch = %s",
                        [row[view.key[0]], row["window_start"], row["epoch"]],
                    )
    assert merged_differences(settings, client, {pipeline.name: pipeline}) == []  # the batch covers them
    early_version = early.delta_versions[pipeline.views[0].name]
    replayer = Replayer(settings=settings, pipeline=pipeline, spark=spark)
    restore(settings, pipeline, spark, version=early_version, rebuild_speed=replayer.recompute)
    active = active_batch(session, settings.cassandra.keyspace, pipeline.name)
    assert active is not None and active.horizon == early.horizon
    assert merged_differences(settings, client, {pipeline.name: pipeline}) == []


def test_concurrent_publishes_claim_distinct_versions_and_never_move_the_horizon_back(
    services: Settings, spark: Any, tmp_path: Path, unique: str
) -> None:
    settings, pipeline = setup(services, tmp_path, unique)
    publisher = Publisher(settings, pipeline, spark)
    session = connect(settings.cassandra)
    from lambdalake.cassandra.tables import BATCH_CLAIMS, BATCH_META, create_keyspace, ensure_table

    create_keyspace(session, settings.cassandra)
    ensure_table(session, settings.cassandra.keyspace, BATCH_META)
    ensure_table(session, settings.cassandra.keyspace, BATCH_CLAIMS)
    claimed: list[int] = []
    barrier = threading.Barrier(6)

    def claim(i: int) -> None:
        barrier.wait()
        claimed.append(publisher._claim(session, None, BatchRun(pipeline=pipeline.name, run_id=f"r{i}")))

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(claimed) == list(range(1, 7)), claimed

    def run(horizon: int, version: int) -> None:
        batch = BatchRun(pipeline=pipeline.name, run_id="x", horizon=horizon)
        publisher._activate(session, version, version, batch, None)

    run(10, 2)
    run(12, 3)
    with pytest.raises(ConfigurationError, match="is older"):
        run(11, 4)
    active = active_batch(session, settings.cassandra.keyspace, pipeline.name)
    assert active is not None and (active.version, active.horizon) == (3, 12)
