"""The exact merge of batch and speed rows (pure functions: no I/O, no engine).

A batch row covers every ingest epoch up to the horizon H; a speed row covers one (key, window,
epoch). Combining the batch row with the speed rows of epochs > H, by each component's own merge,
counts every event exactly once: events of epochs <= H only in the batch, later ones only in speed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from lambdalake.pipeline import WindowedView
from lambdalake.views import EPOCH, WINDOW_START, Merger
from serving.answers import LatestRow, WindowRow


def merge_windows(
    batch_rows: Iterable[Mapping[str, Any]],
    speed_rows: Iterable[Mapping[str, Any]],
    view: WindowedView,
    *,
    horizon: int | None,
) -> list[WindowRow]:
    """Windows in start order: each the batch row combined with the speed rows of later epochs.

    Args:
        batch_rows: Batch rows of one key (``window_start`` plus components).
        speed_rows: Speed rows of the same key (``window_start``, ``epoch`` plus components).
        view: The view (its components say how to merge).
        horizon: The batch's horizon epoch; None when no batch is published (every speed row counts).
    """
    merger = Merger(view)
    acc: dict[datetime, dict[str, Any]] = {}
    epochs: dict[datetime, list[int]] = {}

    def fold(row: Mapping[str, Any]) -> datetime:
        start = row[WINDOW_START]
        into = acc.get(start)
        if into is None:
            acc[start] = merger.start(row)
        else:
            merger.add(into, row)
        return start

    for row in batch_rows:
        fold(row)
    in_batch = set(acc)
    for row in speed_rows:
        epoch = row[EPOCH]
        if horizon is not None and epoch <= horizon:
            continue  # the batch holds this epoch's events
        epochs.setdefault(fold(row), []).append(epoch)
    return [
        WindowRow(start, merger.finish(acc[start]), start in in_batch, tuple(sorted(epochs.get(start, ()))))
        for start in sorted(acc)
    ]


def pick_latest(batch: LatestRow | None, speed: LatestRow | None) -> LatestRow | None:
    """The higher-ranked of the two (the batch's on a tie: the same delivery)."""
    if batch is None or speed is None:
        return batch or speed
    return speed if speed.rank > batch.rank else batch
