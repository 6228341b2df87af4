"""Where the speed job's queries start: the main query's checkpoint (resumed, or a new one when its
windowed views changed) and where a new Real-time checkpoint of the latest views starts.

The main query's Spark state is made for the windowed views it started with. When they change (a
view added, a version built or retired, a widening held), it moves to a new checkpoint that starts
one deduplication window before the oldest epoch it must count whole (the oldest open one, or an
older one the old checkpoint had not finished); records the master dataset holds are neither archived nor
dead-lettered again, and every epoch it counts is counted whole, so the absolute upserts are exact.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from lambdalake.kafka.offsets import offset_consumer, offsets_at, record_time, watermarks
from lambdalake.pipeline import Pipeline, WindowedView
from lambdalake.settings import Settings
from lambdalake.speed.checkpoints import Checkpoints, MainRecord, ViewStart

log = logging.getLogger("lambdalake.speed")


def view_signature(view: WindowedView) -> str:
    """What a windowed view's Spark state depends on: its definition and the types it holds."""
    text = view.model_dump_json() + json.dumps(sorted(view.stored_types.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class MainStart:
    """The main query's checkpoint as chosen: its record, the windowed views it aggregates (in its
    state's order), the offsets a new checkpoint starts at (JSON; None: it resumes, or starts where
    ``fresh_start`` says), and where it starts when it has no checkpoint yet (None: it resumes one)."""

    record: MainRecord
    counted: list[WindowedView]
    offsets: str | None
    fresh_start: str | None


def choose_main(
    settings: Settings,
    pipeline: Pipeline,
    checkpoints: Checkpoints,
    windowed: list[WindowedView],
    *,
    archived: Callable[[], dict[int, int]],
    reset_from_ms: int | None,
    default: str,
) -> MainStart:
    """The main query's checkpoint and the windowed views it aggregates (its stateful step), recorded.

    A checkpoint keeps the views it started with: others would not match Spark's state. While they
    are the deployed windowed views (by :func:`view_signature`), it resumes. Otherwise the main
    query moves to a new checkpoint folder (:func:`_move`). ``speed reset`` starts afresh.

    Args:
        windowed: The windowed views deployed.
        archived: Per partition, the offset before which the master dataset covers every offset.
        reset_from_ms: Where ``speed reset`` left the views to count from (None: no reset).
        default: Where a query without a checkpoint starts.
    """
    record = checkpoints.main()
    wanted = {v.name: view_signature(v) for v in windowed}
    if record is None:  # a new pipeline, or a reset one
        record = MainRecord(views=tuple(wanted.items()), from_ms=reset_from_ms)
    else:
        held = dict(record.views)
        same = held.keys() == wanted.keys() and all(s in (None, wanted[n]) for n, s in held.items())
        if same:  # in its order: the state's
            record = replace(record, views=tuple((n, wanted[n]) for n in held))
        elif not checkpoints.has_run(record.dir):
            # Never ran (a move, then a stop before its first batch): it starts with these views,
            # from where the move put it.
            _mark_starts(pipeline, checkpoints, set(held), wanted, record.from_ms)
            record = replace(record, views=tuple(wanted.items()))
        else:
            record = _move(settings, pipeline, checkpoints, record, wanted, archived())
    checkpoints.write_main(record)
    by_name = {v.name: v for v in windowed}
    fresh = not checkpoints.has_run(record.dir)
    offsets = json.dumps(record.offsets) if record.offsets and fresh else None
    # Decided before the main query starts (it writes its checkpoint then).
    return MainStart(
        record, [by_name[n] for n in record.view_names], offsets, (offsets or default) if fresh else None
    )


def _move(
    settings: Settings,
    pipeline: Pipeline,
    checkpoints: Checkpoints,
    record: MainRecord,
    wanted: dict[str, str],
    archived: dict[int, int],
) -> MainRecord:
    """A new checkpoint for the main query, whose windowed views changed.

    Without windowed views it starts where the master dataset has archived every offset. With them, it counts
    every epoch from the oldest one not yet counted whole (the oldest open one, or the epoch of the
    first record the old checkpoint had not read), reading from one deduplication window before it:
    the epochs it recounts are counted whole again from the topic (whose compaction lag outlasts
    archiving), and what the master dataset holds is not archived again. A view new to the main query, never
    counted anywhere, records that epoch (:class:`ViewStart`): the view build recomputes the closed
    ones before it from the master dataset.
    """
    generation = record.generation + 1
    topic = pipeline.topic.name
    layers = pipeline.layers
    from_ms = None
    with offset_consumer(settings) as consumer:
        ends = watermarks(consumer, topic)
        unread = {p: max(archived.get(p, -1) + 1, low) for p, (low, _) in ends.items()}
        offsets = dict(unread)
        if wanted:
            now_ms = int(time.time() * 1000)
            from_ms = (now_ms - layers.grace_seconds * 1000) // layers.epoch_ms * layers.epoch_ms
            for p, (_, high) in ends.items():
                if unread[p] < high:
                    first = record_time(consumer, topic, p, unread[p])
                    from_ms = min(from_ms, first // layers.epoch_ms * layers.epoch_ms)
            early = offsets_at(consumer, topic, from_ms - layers.dedup_delay_seconds * 1000)
            offsets = {p: max(min(early[p], unread[p]), ends[p][0]) for p in ends}
    held = set(record.view_names)
    _mark_starts(pipeline, checkpoints, held, wanted, from_ms)
    why = f"its windowed views changed ({sorted(held)} to {sorted(wanted)})"
    log.info("the main query moves to checkpoint main-g%d at %s, counting from %s: %s",
             generation, offsets, from_ms, why)  # fmt: skip
    return MainRecord(
        dir=f"main-g{generation}", views=tuple(wanted.items()), generation=generation,
        offsets={topic: {str(p): o for p, o in offsets.items()}}, from_ms=from_ms,
    )  # fmt: skip


def _mark_starts(
    pipeline: Pipeline, checkpoints: Checkpoints, held: set[str], wanted: dict[str, str], from_ms: int | None
) -> None:
    """Record ``from_ms``'s epoch as the start of each view of ``wanted`` a checkpoint counting from
    ``from_ms`` has that was never counted before (neither by ``held``, the views of the checkpoint
    it follows, nor by a query of its own): the view build recomputes the epochs before it from
    the master dataset."""
    if from_ms is None:
        return
    for name in wanted:
        if name not in held and not checkpoints.counted_before(name):
            checkpoints.mark_start(name, ViewStart(from_ms // pipeline.layers.epoch_ms, from_ms))


def latest_start(
    pipeline: Pipeline, archived: dict[int, int], default: str, *, main_fresh: str | None
) -> str:
    """Where a new Real-time checkpoint starts: where the master dataset's coverage (``archived``) ends, when
    the master dataset has any, or where a main query without a checkpoint starts (``main_fresh``), where that
    is earlier; ``default`` without coverage.

    The Real-time query reads ahead of the master dataset, and a view version built beside the old one is
    recomputed from the master dataset (:mod:`lambdalake.control.view_build`): starting at the checkpoint it
    had would leave the records between the two out of the new version. After ``speed reset`` (its
    latest rows emptied, the epochs before its start recomputed from the master dataset) the main query starts
    afresh where the reset chose, and the records from there on are the Real-time query's to write,
    though the master dataset may hold them already."""
    if not archived:
        return default
    # The master dataset's coverage only grows: read before the query starts, it can only make the query
    # re-read (idempotently) what the master dataset took meanwhile, never skip it. A partition the master
    # dataset holds nothing of (one the topic gained) starts at its earliest offset (-2).
    topic = pipeline.topic.name
    partitions = sorted({*archived, *range(pipeline.topic.partitions)})
    start = {p: archived.get(p, -2) for p in partitions}
    if main_fresh == "earliest":
        return main_fresh
    if main_fresh and main_fresh != "latest":
        for p, offset in json.loads(main_fresh).get(topic, {}).items():
            here = start.get(int(p), -2)
            # -2 is the log's start, earlier than any offset; -1 its end, never earlier.
            if here != -2 and offset != -1 and (offset == -2 or offset < here):
                start[int(p)] = offset
    return json.dumps({topic: {str(p): o for p, o in start.items()}})
