"""The exact merge of batch and speed rows (pure functions: no I/O, no engine).

A batch row covers every ingest epoch up to the horizon H; a speed row covers one (key, window,
epoch). Combining the batch row with the speed rows of epochs > H, by each component's own merge,
counts every event exactly once: events of epochs <= H only in the batch, later ones only in speed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from lambdalake.pipeline import WindowedView
from lambdalake.views import EPOCH, WINDOW_START, merge, view_components
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
    parts: dict[datetime, list[Mapping[str, Any]]] = defaultdict(list)
    in_batch: set[datetime] = set()
    epochs: dict[datetime, list[int]] = defaultdict(list)
    for row in batch_rows:
        parts[row[WINDOW_START]].append(row)
        in_batch.add(row[WINDOW_START])
    for row in speed_rows:
        if horizon is not None and row[EPOCH] <= horizon:
            continue  # the batch holds this epoch's events
        parts[row[WINDOW_START]].append(row)
        epochs[row[WINDOW_START]].append(row[EPOCH])
    out = []
    comps = view_components(view)
    for start in sorted(parts):
        merged = merge(parts[start], view, comps=comps)
        assert merged is not None
        out.append(WindowRow(start, merged, start in in_batch, tuple(sorted(epochs[start]))))
    return out


def pick_latest(batch: LatestRow | None, speed: LatestRow | None) -> LatestRow | None:
    """The higher-ranked of the two (the batch's on a tie: the same delivery)."""
    if batch is None or speed is None:
        return batch or speed
    return speed if speed.rank > batch.rank else batch
