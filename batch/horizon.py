"""The batch horizon: the newest ingest epoch that is closed, so a batch covers it whole.

An epoch ``E`` (ingest ms // epoch ms) is closed when

- its end plus the grace period has passed: ``(E + 1) * epoch_ms + grace_ms <= now``, and
- the master dataset has archived, on every partition, everything before the epoch's end: its commits have
read,
  without a gap from the log's first offset, up to the first offset whose (LogAppendTime) timestamp
  is at or after ``(E + 1) * epoch_ms`` (:mod:`lambdalake.coverage`).
  That offset comes from the broker (offsets-for-times); a partition with no record after the
  epoch (idle) needs everything up to its end offset read, and so never blocks the horizon by
  being idle, only by being behind.

With LogAppendTime an epoch is a contiguous offset range of each partition, so this boundary is exact.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from lambdalake.errors import ConfigurationError, NothingToCover
from lambdalake.kafka.offsets import offset_consumer, offsets_at, watermarks
from lambdalake.master import MasterDataset
from lambdalake.pipeline import Pipeline
from lambdalake.settings import Settings


@dataclass(frozen=True)
class Horizon:
    """The epochs a batch covers (``<= epoch``), and per ``"topic/partition"`` the offsets before
    the next epoch's first offset (``[0, boundary)``), which the master dataset has archived."""

    epoch: int
    epoch_ms: int
    boundaries: dict[str, int] = field(default_factory=dict)

    @property
    def end_ms(self) -> int:
        """Ingest time (ms) where the covered epochs end."""
        return (self.epoch + 1) * self.epoch_ms


def newest_closed_by_time(pipeline: Pipeline, now_ms: int) -> int:
    """The newest epoch whose end plus grace has passed at ``now_ms``."""
    epoch_ms = pipeline.layers.epoch_ms
    return (now_ms - pipeline.layers.grace_seconds * 1000) // epoch_ms - 1


def boundaries(settings: Settings, pipeline: Pipeline, end_ms: int) -> dict[str, int]:
    """Per ``"topic/partition"``: the first offset at or after ``end_ms`` (ingest time), or the end
    offset where no record is that recent."""
    topic = pipeline.topic.name
    with offset_consumer(settings) as consumer:
        return {f"{topic}/{p}": o for p, o in offsets_at(consumer, topic, end_ms).items()}


def first_offsets(settings: Settings, pipeline: Pipeline) -> dict[str, int]:
    """Per ``"topic/partition"``, the log's first offset (earlier ones were removed: no one can
    archive them any more)."""
    topic = pipeline.topic.name
    with offset_consumer(settings) as consumer:
        return {f"{topic}/{p}": low for p, (low, _) in watermarks(consumer, topic).items()}


def lagging(bounds: dict[str, int], read: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Partitions whose records before the boundary the master dataset has not all read: {p: (read,
    needed)}."""
    return {
        p: (read.get(p, -1), boundary - 1)
        for p, boundary in bounds.items()
        if boundary > 0 and read.get(p, -1) < boundary - 1
    }


def find_horizon(
    settings: Settings,
    pipeline: Pipeline,
    master: MasterDataset,
    *,
    master_version: int,
    requested: int | None = None,
    now_ms: int | None = None,
    lookback: int = 48,
) -> Horizon:
    """The horizon for a run: ``requested`` (refused if open or not archived yet) or the newest
    closed epoch, stepping back over epochs the master dataset has not archived whole (at most ``lookback``).

    Raises:
        ConfigurationError: ``requested`` is open, or not archived; or no epoch is closed yet.
    """
    real_now = int(time.time() * 1000)
    if now_ms is not None and now_ms > real_now:
        raise ConfigurationError(
            f"--as-of {now_ms} is in the future: an epoch closed then may still take events now",
            fix="give a time in the past, or leave --as-of out to take the newest epoch closed now",
        )
    now_ms = real_now if now_ms is None else now_ms
    epoch_ms = pipeline.layers.epoch_ms
    newest = newest_closed_by_time(pipeline, now_ms)
    if requested is not None and requested > newest:
        raise ConfigurationError(
            f"epoch {requested} is still open: it ends at {(requested + 1) * epoch_ms} ms, plus a grace of "
            f"{pipeline.layers.grace_seconds} s; the newest closed epoch is {newest}",
            fix=f"use --horizon {newest} or less, or wait until the epoch has closed",
        )
    candidates = [requested] if requested is not None else range(newest, newest - lookback, -1)
    problems = {}
    low = first_offsets(settings, pipeline)
    for epoch in candidates:
        bounds = boundaries(settings, pipeline, (epoch + 1) * epoch_ms)
        # Archived means read without a gap from the log's start (a replay's range read ahead of the
        # speed job does not count until the gap before it is read too).
        read = master.read_progress(bounds, version=master_version, low=low)
        behind = lagging(bounds, read)
        if not behind:
            return Horizon(epoch, epoch_ms, bounds)
        problems[epoch] = behind
    worst = problems[next(iter(problems))]
    detail = ", ".join(f"{p}: read up to {r}, needs {n}" for p, (r, n) in sorted(worst.items()))
    raise NothingToCover(
        f"the master dataset has not archived epoch {next(iter(problems))} of {pipeline.name!r} whole "
        f"({detail})",
        fix=f"let the speed job catch up (`lambdalake speed run {pipeline.name}`), then run the batch again",
    )
