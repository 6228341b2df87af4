"""What a merged query returns: typed rows with their provenance (which layer gave which epochs)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

import orjson

from lambdalake.json_form import finite, json_default, json_value

#: Timestamps as serving reads them (the driver's naive UTC, or aware UTC) in RFC 3339 with ``Z``.
_ORJSON = orjson.OPT_UTC_Z | orjson.OPT_NAIVE_UTC


@dataclass(frozen=True)
class Provenance:
    """Where an answer came from.

    Attributes:
        batch_version: The active batch version read (None: no batch published yet, speed alone).
        horizon: The newest ingest epoch the batch covers (None without a batch).
        horizon_end_ms: When the horizon epoch ended (epoch ms): events ingested before it come from
            the batch, later ones from the speed layer.
        epoch_ms: The ingest epoch length.
        speed_epochs: The ingest epochs (> horizon) whose speed rows were merged in.
    """

    batch_version: int | None
    horizon: int | None
    horizon_end_ms: int | None
    epoch_ms: int
    speed_epochs: tuple[int, ...] = ()

    @property
    def summary(self) -> str:
        speed = (
            f"speed epochs {', '.join(map(str, self.speed_epochs))}" if self.speed_epochs else "no speed rows"
        )
        if self.batch_version is None:
            return f"speed layer only (no batch published yet); {speed}"
        return f"batch v{self.batch_version} (epochs <= {self.horizon}) + {speed}"


@dataclass(frozen=True)
class WindowRow:
    """One (key, window) of a windowed view: merged aggregates and what contributed.

    Attributes:
        window_start: The window's start (UTC).
        values: Each aggregate by name (averages derived from the merged sum and count), plus the
            stored components (``<avg>_sum``, ``<avg>_count``).
        from_batch: Whether the batch row contributed.
        speed_epochs: The ingest epochs whose speed rows contributed.
    """

    window_start: datetime
    values: dict[str, Any]
    from_batch: bool
    speed_epochs: tuple[int, ...]


@dataclass(frozen=True)
class LatestRow:
    """The winning row of a ``latest`` view and the layer it came from.

    Attributes:
        values: The row's columns.
        rank: Its rank by the latest rule (:mod:`lambdalake.latest`; the higher wins).
        source: ``"batch"`` or ``"speed"``.
    """

    values: dict[str, Any]
    rank: int
    source: Literal["batch", "speed"]


@dataclass(frozen=True)
class Answer:
    """The merged answer for one key of one view."""

    pipeline: str
    view: str
    kind: Literal["latest", "windowed"]
    key: dict[str, Any]
    provenance: Provenance
    latest: LatestRow | None = None
    windows: list[WindowRow] = field(default_factory=list)

    @property
    def found(self) -> bool:
        return self.latest is not None or bool(self.windows)

    def to_dict(self) -> dict[str, Any]:
        """The answer in its JSON form (:mod:`lambdalake.json_form`)."""
        return json_value(self._plain())

    def to_json(self) -> bytes:
        """:meth:`to_dict` serialized. The HTTP API's hot path: orjson writes the JSON types itself
        (timestamps as naive or aware UTC, with ``Z``), :func:`lambdalake.json_form.json_default`
        the others, and only non-finite floats are replaced first (a walk of every value in Python
        cost far more than the serialization itself)."""
        try:
            return orjson.dumps(self._plain(finite), default=json_default, option=_ORJSON)
        except orjson.JSONEncodeError:  # an integer beyond 64 bits (a rank): the standard library takes it
            return json.dumps(self.to_dict()).encode()

    def _plain(self, values: Callable[[dict[str, Any]], dict[str, Any]] = lambda v: v) -> dict[str, Any]:
        """The answer as dicts and lists, values as read. Built by hand: ``dataclasses.asdict``
        deep-copies every value and cost more than the query itself."""
        p = self.provenance
        out: dict[str, Any] = {
            "pipeline": self.pipeline, "view": self.view, "kind": self.kind, "key": self.key,
            "provenance": {
                "batch_version": p.batch_version, "horizon": p.horizon, "horizon_end_ms": p.horizon_end_ms,
                "epoch_ms": p.epoch_ms, "speed_epochs": list(p.speed_epochs), "summary": p.summary,
            },
            "latest": None, "windows": [],
        }  # fmt: skip
        if self.latest is not None:
            out["latest"] = {"values": values(self.latest.values), "rank": self.latest.rank,
                             "source": self.latest.source}  # fmt: skip
        out["windows"] = [
            {"window_start": w.window_start, "values": values(w.values), "from_batch": w.from_batch,
             "speed_epochs": list(w.speed_epochs)}
            for w in self.windows
        ]  # fmt: skip
        return out
