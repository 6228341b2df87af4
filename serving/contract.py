"""The HTTP API's bodies and parameters as OpenAPI documents them (``/openapi.json``): each route
declares every answer it gives, so a client generated from the document handles every error."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from lambdalake.json_form import DESCRIPTION

#: Times a view stores (epoch ms): a ``from``/``to`` outside them is a 422.
EARLIEST_MS, LATEST_MS = -(2**62), 2**62

#: ``from``/``to``: an RFC 3339 date-time, epoch milliseconds, or empty (absent).
TIME_PARAMETER: dict[str, Any] = {
    "anyOf": [
        {"type": "string", "format": "date-time"},
        {"type": "integer", "minimum": EARLIEST_MS, "maximum": LATEST_MS},
        {"type": "string", "maxLength": 0},
    ]
}


class Provenance(BaseModel):
    batch_version: int | None = Field(description="The active batch version (null: speed layer only).")
    horizon: int | None = Field(description="The newest ingest epoch the batch covers.")
    horizon_end_ms: int | None
    epoch_ms: int
    speed_epochs: list[int] = Field(description="Ingest epochs merged from the speed layer.")
    summary: str


#: What a ``values`` object holds.
VALUES = DESCRIPTION


class LatestBody(BaseModel):
    values: dict[str, Any] = Field(description=VALUES)
    rank: int
    source: Literal["batch", "speed"]


class WindowBody(BaseModel):
    window_start: datetime
    values: dict[str, Any] = Field(description=VALUES)
    from_batch: bool
    speed_epochs: list[int]


class AnswerBody(BaseModel):
    """The merged answer for one key."""

    pipeline: str
    view: str
    kind: Literal["latest", "windowed"]
    key: dict[str, Any]
    provenance: Provenance
    latest: LatestBody | None
    windows: list[WindowBody]


class ErrorBody(BaseModel):
    """What went wrong, and the fix where there is one."""

    detail: str
    fix: str | None = None


class NotFoundBody(ErrorBody):
    """An unknown pipeline, view or key (a key without rows carries the provenance it was read with)."""

    provenance: Provenance | None = None


class HealthBody(BaseModel):
    status: Literal["ok", "unavailable"]
    detail: str | None = None


def answers(*statuses: int, media_type: str | None = None) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for the error ``statuses`` a route gives (``media_type``: when the
    route's own answers are of another type, e.g. ``/metrics``' text)."""
    described = {
        400: ("`from` is after `to`", ErrorBody),
        401: ("The bearer token is missing or wrong", ErrorBody),
        404: ("Unknown pipeline, view or key", NotFoundBody),
        422: ("A key or time the view cannot take", ErrorBody),
        503: (
            "Cassandra is unavailable, or the pipeline's views are not deployed in its keyspace "
            "(the body's `fix` says which): retry after `Retry-After` seconds",
            ErrorBody,
        ),
    }
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        text, model = described[status]
        if media_type is None:
            out[status] = {"description": text, "model": model}
        else:  # the model is in the document through the routes that answer JSON
            schema = {"$ref": f"#/components/schemas/{model.__name__}"}
            out[status] = {"description": text, "content": {media_type: {"schema": schema}}}
        if status == 503:
            out[status]["headers"] = {
                "Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}
            }
        if status == 401:
            out[status]["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
    return out
