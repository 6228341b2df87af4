"""The exact merge of batch and speed rows (pure functions: no I/O, no engine).

A batch row covers every ingest epoch up to the horizon H; a speed row covers one (key, window,
epoch). Combining the batch row with the speed rows of epochs > H, by each component's own merge,
counts every event exactly once: events of epochs <= H only in the batch, later ones only in speed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from lambdalake.pipeline import WindowedView
from lambdalake.serving.answers import LatestRow, WindowRow
from lambdalake.views import EPOCH, WINDOW_START, Merger

#: A query's rows: its column names and the rows as tuples in that order.
RowSet = tuple[Sequence[str], Iterable[Sequence[Any]]]


def merge_windows(
    batch: RowSet,
    speed: RowSet,
    view: WindowedView,
    *,
    horizon: int | None,
    quantiles: Sequence[float] | None = None,
) -> list[WindowRow]:
    """Windows in start order: each the batch row combined with the speed rows of later epochs.

    Args:
        batch: Batch rows of one key (``window_start`` plus components).
        speed: Speed rows of the same key (``window_start``, ``epoch`` plus components).
        view: The view (its components say how to merge).
        horizon: The batch's horizon epoch; None when no batch is published (every speed row counts).
        quantiles: What ``quantiles`` aggregates answer (default: each one's ``q``).
    """
    merger = Merger(view, quantiles=quantiles)
    acc: dict[datetime, list[Any]] = {}
    epochs: dict[datetime, list[int]] = {}

    def fold(start: datetime, components: Sequence[Any]) -> None:
        into = acc.get(start)
        if into is None:
            acc[start] = list(components)
        else:
            merger.add(into, components)

    names, rows = batch
    if names:
        at, pick = names.index(WINDOW_START), merger.picker(names)
        for row in rows:
            fold(row[at], pick(row))
    in_batch = set(acc)
    names, rows = speed
    if names:
        at, at_epoch, pick = names.index(WINDOW_START), names.index(EPOCH), merger.picker(names)
        for row in rows:
            epoch = row[at_epoch]
            if horizon is not None and epoch <= horizon:
                continue  # the batch holds this epoch's events
            fold(row[at], pick(row))
            epochs.setdefault(row[at], []).append(epoch)
    return [
        WindowRow(
            aware_utc(start), aware_utc_values(merger.finish(acc[start])), start in in_batch,
            tuple(sorted(epochs.get(start, ()))),
        )
        for start in sorted(acc)
    ]  # fmt: skip


def aware_utc(value: Any) -> Any:
    """The driver returns timestamps as naive UTC datetimes: made aware (other values as they are)."""
    return value.replace(tzinfo=UTC) if isinstance(value, datetime) and value.tzinfo is None else value


def aware_utc_values(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with each timestamp made aware (in place)."""
    for column, value in values.items():
        if isinstance(value, datetime):
            values[column] = aware_utc(value)
    return values


def pick_latest(batch: LatestRow | None, speed: LatestRow | None) -> LatestRow | None:
    """The higher-ranked of the two by the latest rule (:mod:`lambdalake.latest`; the batch's on a tie
    of ranks: deliveries of one rank share an ingest second, so an epoch, and the batch covers that
    epoch whole or not at all)."""
    if batch is None or speed is None:
        return batch or speed
    return speed if speed.rank > batch.rank else batch
