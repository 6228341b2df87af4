"""Incremental batch runs end to end, against the real services, on a pipeline of the test's own
(tests/user_pipeline.py: card payments, decimal aggregates, a composite key, three partitions).

A property-based test (hypothesis) draws sequences of steps: waves of payments with copies, far
copies of earlier payments, replays, ``speed reset``, restores of older Delta versions and a schema
change. After every step the nightly run (incremental where it can be) must give Delta views equal
to a full rebuild's over a copy of the same master dataset, and every merged answer must equal the
plain-Python reference built from the records read back with confluent-kafka's deserializer. CI runs
the explicit sequence below; ``LAMBDALAKE_INCREMENTAL_EXAMPLES=N`` (``make soak``) draws N more.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from lambdalake.batch.job import BatchJob
from lambdalake.batch.restore import restore
from lambdalake.cassandra.active import active_batch
from lambdalake.cassandra.session import connect
from lambdalake.delta import commit_metadata
from lambdalake.layout import master_path, views_path
from lambdalake.pipeline import Pipeline, configured_pipeline
from lambdalake.produce.producer import EventProducer
from lambdalake.settings import Settings
from lambdalake.speed.replay import Replayer, plan_replay
from lambdalake.speed.reset import reset_speed
from tests.conftest import env_for, isolated
from tests.helpers import kill_publish_half_way, run_speed_once
from tests.test_user_pipeline import merged_problems, send
from tests.user_pipeline import SCHEMA_V1, payments, write_pipeline

pytestmark = [pytest.mark.services, pytest.mark.slow]

STEPS = ("wave", "far_copies", "replay", "reset", "restore", "schema")
EXAMPLES = int(os.environ.get("LAMBDALAKE_INCREMENTAL_EXAMPLES") or 0)
#: The latest view keeps the first schema's fields, so a field added later changes no view.
KEPT = ["account_id", "region", "amount", "status", "note", "attempt"]
SCHEMA_V2 = {**SCHEMA_V1, "fields": [*SCHEMA_V1["fields"], {"name": "channel", "type": ["null", "string"],
                                                             "default": None}]}  # fmt: skip


class World:
    """One pipeline of the test's own, the payments sent to it, and the steps taken."""

    def __init__(self, services: Settings, root: Path) -> None:
        self.root = root
        unique = os.urandom(4).hex()
        self.topic = f"payments-{unique}"
        self.settings = self._write(isolated(services, root, unique), [SCHEMA_V1])
        self.pipeline = configured_pipeline("payments", self.settings)
        self.producer = EventProducer(settings=self.settings, pipeline=self.pipeline)
        self.sent: list[dict[str, Any]] = []
        self.next_id = 0
        self.rng = random.Random(7)
        self.log: list[str] = []
        self.versions = 1

    def _write(self, base: Settings, schemas: list[dict[str, Any]]) -> Settings:
        cfg = write_pipeline(base, self.root, self.topic, schemas, latest_columns=KEPT)
        path = cfg.pipelines_dir / "payments.toml"
        # Short epochs: each step waits for one to close.
        path.write_text(path.read_text().replace('epoch = "5 seconds"', 'epoch = "2 seconds"').replace(
            'dedup_delay = "3 seconds"', 'dedup_delay = "1 second"'))  # fmt: skip
        return cfg

    def wave(self, n: int) -> None:
        records = payments(n, seed=self.next_id + 1, start=self.next_id)
        self.next_id += n
        copies = self.rng.sample(records, max(1, n // 20))  # sent again at once: one delivery counts
        send(self.producer, [*records, *copies])
        self.sent += records

    def settle(self, spark: Any) -> None:
        """Archive what the topic holds, once the epoch of the newest record has closed."""
        epoch_ms = self.pipeline.layers.epoch_ms
        now = time.time() * 1000
        time.sleep(
            ((now // epoch_ms + 1) * epoch_ms + self.pipeline.layers.grace_seconds * 1000 + 300 - now) / 1000
        )
        run_speed_once(self.settings, self.pipeline, spark)


def take(world: World, step: str, spark: Any) -> str | None:
    """Take one step; returns the reason the next run must be full, if the step makes it one."""
    if step == "wave":
        world.wave(200)
    elif step == "far_copies":
        send(world.producer, world.rng.sample(world.sent, 40))  # copies of events counted long ago
    elif step == "replay":
        plan = plan_replay(world.settings, world.pipeline, from_offsets={0: 0, 1: 0, 2: 0})
        Replayer(settings=world.settings, pipeline=world.pipeline, spark=spark).run(plan)
    elif step == "reset":
        world.wave(50)
        reset_speed(world.settings, world.pipeline, spark)
    elif step == "restore":
        path = views_path(world.settings.storage_root, world.pipeline.name, world.pipeline.views[0].name)
        runs = [e["version"] for e in DeltaTable(path).history() if "lambdalake.run_id" in commit_metadata(e)]
        version = world.rng.choice(sorted(runs)[:-1] or runs)
        replayer = Replayer(settings=world.settings, pipeline=world.pipeline, spark=spark)
        restore(world.settings, world.pipeline, spark, version=version, rebuild_speed=replayer.recompute)
        return "not the newest Delta version" if version != max(runs) else None
    elif step == "schema":
        if world.versions == 1:
            world.settings = world._write(world.settings, [SCHEMA_V1, SCHEMA_V2])
            world.pipeline = configured_pipeline("payments", world.settings)
            world.producer = EventProducer(settings=world.settings, pipeline=world.pipeline)
            world.versions = 2
        records = [{**r, "channel": "web"} for r in payments(100, seed=99, start=world.next_id)]
        world.next_id += 100
        send(world.producer, records)
        world.sent += records
    return None


def delta_views(settings: Settings, pipeline: Pipeline) -> dict[str, list[tuple]]:
    """Every view's rows as delta-rs (another Delta reader) reads them."""
    out = {}
    for view in pipeline.views:
        table = DeltaTable(views_path(settings.storage_root, pipeline.name, view.name)).to_pyarrow_table()
        out[view.name] = sorted((tuple(r.values()) for r in table.to_pylist()), key=repr)
    return out


def full_rebuild(world: World, spark: Any, horizon: int) -> dict[str, list[tuple]]:
    """The views a full run computes over a copy of the same master dataset (to the same horizon), beside
    the pipeline's own storage: nothing of the incremental chain is touched."""
    other = world.settings.model_copy(update={"storage_root": str(world.root / f"full-{time.time_ns()}")})
    shutil.copytree(master_path(world.settings.storage_root, world.pipeline.name),
                    master_path(other.storage_root, world.pipeline.name))  # fmt: skip
    run = BatchJob(settings=other, pipeline=world.pipeline, spark=spark).run(
        full=True, horizon=horizon, publish=False
    )
    assert run.outcome == "delta only" and run.kind == "full", run
    views = delta_views(other, world.pipeline)
    shutil.rmtree(other.storage_root, ignore_errors=True)
    return views


def nightly(world: World, spark: Any, full_because: str | None) -> None:
    """The nightly run after a step: incremental unless the step made a full one necessary; then the
    same views as a full rebuild, and exact merged answers."""
    run = BatchJob(settings=world.settings, pipeline=world.pipeline, spark=spark).run()
    world.log.append(f"{run.kind} ({run.reason}): rows written {run.rows_written}, epochs {run.new_epochs}")
    assert run.outcome == "published", (world.log, run)
    if full_because is None:
        assert run.kind == "incremental", world.log
        assert sum(run.rows_written.values()) < sum(run.rows.values()), world.log  # the changed cells only
    else:
        assert run.kind == "full" and full_because in run.reason, world.log
    assert delta_views(world.settings, world.pipeline) == full_rebuild(world, spark, run.horizon), world.log
    problems = merged_problems(world.settings, world.pipeline)
    assert problems == [], (world.log, problems[:5])


@settings(
    max_examples=max(EXAMPLES, 1),
    phases=[Phase.explicit, Phase.generate] if EXAMPLES else [Phase.explicit],
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
@given(steps=st.lists(st.sampled_from(STEPS), min_size=3, max_size=6))
@example(steps=["far_copies", "schema", "replay", "reset", "restore", "wave"])
def test_incremental_runs_equal_a_full_rebuild_after_every_step(
    services: Settings, spark: Any, tmp_path_factory: pytest.TempPathFactory, steps: list[str]
) -> None:
    world = World(services, tmp_path_factory.mktemp("incremental"))
    world.wave(600)  # nearly all 160 composite keys
    world.settle(spark)
    first = BatchJob(settings=world.settings, pipeline=world.pipeline, spark=spark).run()
    assert first.kind == "full" and "first run" in first.reason, first
    for step in steps:
        world.log.append(step)
        full_because = take(world, step, spark)
        world.settle(spark)
        nightly(world, spark, full_because)


def test_a_kill_during_an_incremental_publish_leaves_serving_on_the_previous_version(
    services: Settings, spark: Any, tmp_path: Path
) -> None:
    world = World(services, tmp_path)
    world.wave(600)
    world.settle(spark)
    assert BatchJob(settings=world.settings, pipeline=world.pipeline, spark=spark).run().kind == "full"
    world.wave(300)
    world.settle(spark)
    session = connect(world.settings.cassandra)
    keyspace = world.settings.cassandra.keyspace
    before = active_batch(session, keyspace, "payments")
    env = {**env_for(world.settings), "LAMBDALAKE_PIPELINES_DIR": str(world.settings.pipelines_dir),
           "LAMBDALAKE_SCHEMAS_DIR": str(world.settings.schemas_dir)}  # fmt: skip
    kill_publish_half_way(world.settings, world.pipeline, env=env)
    assert active_batch(session, keyspace, "payments") == before, "a half-written version became active"
    # Serving reads the previous version's cells (the killed version's rows are above it) and the
    # speed rows of the later epochs: every answer stays exact.
    assert merged_problems(world.settings, world.pipeline) == []
    # The next run cannot merge into the active batch (its Delta views are not the newest): full.
    rerun = BatchJob(settings=world.settings, pipeline=world.pipeline, spark=spark).run()
    assert rerun.kind == "full" and "not the newest Delta version" in rerun.reason, rerun
    assert merged_problems(world.settings, world.pipeline) == []
    after = BatchJob(settings=world.settings, pipeline=world.pipeline, spark=spark).run()
    assert after.kind == "incremental", after
