"""``lambdalake speed reset``: rebuild the speed layer after its checkpoint was lost, from the master dataset
first and the topic only for what the master dataset cannot hold yet.

A compacted topic may have lost older records that master dataset still holds, so closed epochs are never
rebuilt from the topic: every closed epoch after the batch horizon is recomputed from the master dataset (as
``replay`` does). Epochs not closed yet are re-read from the topic by the restarted job, which keeps
them in its state; the records of those epochs the master dataset already holds are not archived again.

Records between what the master dataset has read without a gap and the new start are archived from the topic
first (dead-lettering the invalid ones: nobody read them before).

Steps: the speed tables are truncated (no tombstones: ``latest`` rows written with their rank as the
write timestamp stay writable), the old checkpoints are deleted, the start offsets of the new ones
are written beside them (one deduplication window before the oldest open epoch, per partition: the
windowed views count from the epoch's start, and the records before it only teach the
deduplication which identities it has seen), and the closed
epochs after the horizon are recomputed from the master dataset. The next ``speed run`` (or ``deploy``) starts
there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pyspark.sql import SparkSession

from lambdalake.cassandra.active import active_batch
from lambdalake.cassandra.session import connect
from lambdalake.cassandra.tables import deploy_speed_tables
from lambdalake.kafka.offsets import offset_consumer, offsets_at, watermarks
from lambdalake.pipeline import Pipeline
from lambdalake.settings import Settings
from lambdalake.speed.checkpoints import Checkpoints, Reset
from lambdalake.speed.replay import Replayer, ReplayPlan


@dataclass
class ResetResult:
    horizon: int | None
    first_open_epoch: int
    starting_offsets: dict[int, int]
    rebuilt_epochs: list[int] = field(default_factory=list)
    cells: dict[str, int] = field(default_factory=dict)
    #: Valid records read from the gap between the master dataset's progress and the new start, and archived.
    gap_records: int = 0
    archived: int = 0


def reset_speed(
    settings: Settings, pipeline: Pipeline, spark: SparkSession, *, now_ms: int | None = None
) -> ResetResult:
    """Rebuild the speed layer's rows and checkpoints (the speed job must be stopped)."""
    now_ms = now_ms if now_ms is not None else int(time.time() * 1000)
    layers = pipeline.layers
    first_open = (now_ms - layers.grace_seconds * 1000) // layers.epoch_ms
    session = connect(settings.cassandra)
    active = active_batch(session, settings.cassandra.keyspace, pipeline.name)
    horizon = active.horizon if active is not None else None
    topic = pipeline.topic.name
    with offset_consumer(settings) as consumer:
        starts = offsets_at(consumer, topic, first_open * layers.epoch_ms)
        # The queries read one deduplication window before it, so a repeat in the oldest open epoch
        # of a record delivered just before is known as one (the windowed views count from it).
        early = offsets_at(consumer, topic, first_open * layers.epoch_ms - layers.dedup_delay_seconds * 1000)
        lows = {p: low for p, (low, _) in watermarks(consumer, topic).items()}
    tables = deploy_speed_tables(session, settings.cassandra, pipeline)
    for table in tables:
        session.execute(f'TRUNCATE "{settings.cassandra.keyspace}"."{table.name}"', timeout=120)
    offsets = {pipeline.topic.name: {str(p): o for p, o in early.items()}}
    Checkpoints(settings.storage_root, pipeline.name).start_over(Reset(offsets, first_open * layers.epoch_ms))
    result = ResetResult(horizon, first_open, starts)
    replayer = Replayer(settings=settings, pipeline=pipeline, spark=spark)
    # The new checkpoints start at the oldest open epoch: what the master dataset has not read before that
    # (the old job's progress may stop short of it) is archived from the topic first, so no record falls
    # between the two and the closed epochs are recomputed whole.
    read = replayer.master.read_progress(
        [f"{topic}/{p}" for p in starts], low={f"{topic}/{p}": low for p, low in lows.items()}
    )
    gaps = {
        p: (read[f"{topic}/{p}"] + 1, start)
        for p, start in starts.items()
        if start > read[f"{topic}/{p}"] + 1
    }
    if gaps:
        plan = ReplayPlan(gaps, gaps, [], horizon, speed_end={p: s for p, (s, _) in gaps.items()})
        result.gap_records, result.archived = replayer.archive(plan)
    result.rebuilt_epochs = replayer.master_epochs(after=horizon, before=first_open)
    if result.rebuilt_epochs:
        result.cells = replayer.recompute(result.rebuilt_epochs)
    return result
