"""Pipeline definitions: one TOML file per pipeline in ``pipelines/``.

A definition names the topic, the schema subject and its versions, the event's key, time and identity,
the edge validation rules, the synthetic generator, and the views the speed and batch layers build from
the same declaration. Later layers add sections; unknown keys are refused so a typo is caught early.
"""

from __future__ import annotations

import json
import tomllib
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from lambdalake.errors import ConfigurationError
from lambdalake.settings import Settings

_UNIT_SECONDS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400}


def interval_seconds(text: str) -> int:
    """Seconds in an interval written as Spark writes one: ``"<n> <second|minute|hour|day>[s]"``."""
    try:
        amount, unit = text.split()
        return int(amount) * _UNIT_SECONDS[unit.rstrip("s")]
    except (ValueError, KeyError):
        raise ConfigurationError(
            f"interval {text!r} is not '<number> <unit>'",
            fix="write it as '<number> <second|minute|hour|day>[s]', e.g. '10 minutes'",
        ) from None


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TopicSpec(Strict):
    name: str
    partitions: int = Field(3, ge=1)
    replication_factor: int = Field(1, ge=1)
    #: Topic configs. ``min.compaction.lag.ms`` must outlast the archiving of every event into the
    #: Delta master dataset, since compaction drops superseded versions of a key.
    config: dict[str, str] = Field(default_factory=dict)
    dlq_config: dict[str, str] = Field(
        default_factory=lambda: {"cleanup.policy": "delete", "retention.ms": str(30 * 24 * 3600 * 1000)}
    )

    @property
    def dlq(self) -> str:
        return f"{self.name}.dlq"


class SchemaSpec(Strict):
    subject: str
    #: Schema files relative to ``schemas/``, oldest first; the last is the reader schema.
    versions: list[str] = Field(min_length=1)


class EventSpec(Strict):
    key: str
    time: str
    #: Fields that identify one event: a second delivery with the same identity counts once, and the
    #: first delivery is the first in the partition's log. The key must be one of them, so every copy
    #: of an event lands in the same partition and both layers agree which copy is first.
    identity: list[str] = Field(min_length=1)

    @model_validator(mode="after")
    def _identity_has_key(self) -> EventSpec:
        if self.key not in self.identity:
            raise ValueError(
                f"event.identity {self.identity} must include the key {self.key!r}: copies of an event "
                "with different keys could land in different partitions, where no order says which "
                f"came first (add {self.key!r} to identity)"
            )
        return self


class RequiredRule(Strict):
    kind: Literal["required"]
    field: str


class RangeRule(Strict):
    kind: Literal["range"]
    field: str
    min: float | None = None
    max: float | None = None
    #: Whether ``max`` itself is allowed (e.g. a heading of 360 degrees is not).
    max_inclusive: bool = True


class AllowedRule(Strict):
    kind: Literal["allowed"]
    field: str
    values: list[str | int] = Field(min_length=1)


class NotFutureRule(Strict):
    kind: Literal["not_future"]
    field: str
    #: How far ahead of the producer's clock an event time may be (clock skew), in seconds.
    max_skew_s: float = 300.0


Rule = Annotated[RequiredRule | RangeRule | AllowedRule | NotFutureRule, Field(discriminator="kind")]


class Aggregate(Strict):
    name: str
    fn: Literal["count", "sum", "min", "max", "avg"]
    column: str | None = None

    @model_validator(mode="after")
    def _column_needed(self) -> Aggregate:
        if self.fn != "count" and not self.column:
            raise ValueError(f"aggregate {self.name!r}: {self.fn} needs a column")
        return self


class LatestView(Strict):
    """The current state per key: the row with the highest ``version`` wins, whatever the order."""

    name: str
    kind: Literal["latest"]
    key: list[str] = Field(min_length=1)
    version: str
    #: Columns kept (default: every field of the reader schema).
    columns: list[str] | None = None


class WindowedView(Strict):
    """Mergeable aggregates per key and tumbling event-time window."""

    name: str
    kind: Literal["windowed"]
    key: list[str] = Field(min_length=1)
    window: str = Field(pattern=r"^\d+ (second|minute|hour|day)s?$")
    #: Event-time column windows are cut on (default: the event's time field).
    time: str | None = None
    aggregates: list[Aggregate] = Field(min_length=1)

    @property
    def window_seconds(self) -> int:
        return interval_seconds(self.window)


View = Annotated[LatestView | WindowedView, Field(discriminator="kind")]


class GeneratorSpec(Strict):
    kind: Literal["offers", "telemetry"]


class Pipeline(Strict):
    name: str
    description: str = ""
    topic: TopicSpec
    schema_: SchemaSpec = Field(alias="schema")
    event: EventSpec
    rules: list[Rule] = Field(default_factory=list)
    generator: GeneratorSpec | None = None
    views: list[View] = Field(default_factory=list)
    #: Where the schema files live (set by the loader, not the file).
    schemas_dir: Path = Field(default=Path("schemas"), exclude=True)

    @model_validator(mode="after")
    def _check_fields(self) -> Pipeline:
        fields = set(self.reader_fields)
        named = {self.event.key, self.event.time, *self.event.identity}
        named |= {r.field for r in self.rules}
        for view in self.views:
            named |= set(view.key)
            if isinstance(view, LatestView):
                named |= {view.version, *(view.columns or [])}
            else:
                named |= {a.column for a in view.aggregates if a.column} | (
                    {view.time} if view.time else set()
                )
        unknown = named - fields
        if unknown:
            raise ValueError(
                f"fields not in the reader schema {self.schema_.versions[-1]}: {sorted(unknown)}"
            )
        if len({v.name for v in self.views}) != len(self.views):
            raise ValueError("view names must be unique")
        return self

    def schema_text(self, version: int | None = None) -> str:
        """The Avro schema JSON of ``version`` (1-based; default the reader schema, i.e. the last)."""
        path = self.schemas_dir / self.schema_.versions[(version or len(self.schema_.versions)) - 1]
        return path.read_text()

    @cached_property
    def reader_schema(self) -> dict[str, Any]:
        return json.loads(self.schema_text())

    @cached_property
    def reader_fields(self) -> list[str]:
        return [f["name"] for f in self.reader_schema["fields"]]

    def view(self, name: str) -> View:
        for v in self.views:
            if v.name == name:
                return v
        raise ConfigurationError(
            f"pipeline {self.name!r} has no view {name!r}", fix=f"use one of {[v.name for v in self.views]}"
        )


def load(path: Path, *, schemas_dir: Path) -> Pipeline:
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigurationError(
            f"cannot read pipeline file {path}: {exc}", fix="fix the TOML syntax"
        ) from exc
    try:
        return Pipeline.model_validate({**raw, "schemas_dir": schemas_dir})
    except (ValidationError, OSError) as exc:
        raise ConfigurationError(
            f"invalid pipeline file {path}:\n{exc}", fix="correct the fields named above"
        ) from exc


def load_pipeline(name: str, *, pipelines_dir: Path, schemas_dir: Path, topic_prefix: str = "") -> Pipeline:
    """The pipeline ``name`` from ``pipelines_dir``, its topic named ``topic_prefix`` + the file's."""
    path = pipelines_dir / f"{name}.toml"
    if not path.exists():
        available = sorted(p.stem for p in pipelines_dir.glob("*.toml"))
        raise ConfigurationError(
            f"no pipeline named {name!r} in {pipelines_dir}", fix=f"use one of {available} or add {path}"
        )
    pipeline = load(path, schemas_dir=schemas_dir)
    if topic_prefix:
        topic = pipeline.topic.model_copy(update={"name": f"{topic_prefix}{pipeline.topic.name}"})
        pipeline = pipeline.model_copy(update={"topic": topic})
    return pipeline


def configured_pipeline(name: str, settings: Settings) -> Pipeline:
    """The pipeline ``name`` as ``settings`` place it: their pipelines and schemas folders, and their
    topic prefix."""
    return load_pipeline(
        name, pipelines_dir=settings.pipelines_dir, schemas_dir=settings.schemas_dir,
        topic_prefix=settings.topic_prefix,
    )  # fmt: skip


def list_pipelines(pipelines_dir: Path) -> list[str]:
    return sorted(p.stem for p in pipelines_dir.glob("*.toml"))
