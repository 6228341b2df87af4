"""Pipeline definitions: one TOML file per pipeline in ``pipelines/``.

A definition names the topic, the schema subject and its versions, the event's key, time and identity,
the edge validation rules, the synthetic generator, and the views the speed and batch layers build from
the same declaration. Later layers add sections; unknown keys are refused so a typo is caught early.
"""

from __future__ import annotations

import json
import math
import tomllib
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal

import fastavro
import pyarrow as pa
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from lambdalake import filters
from lambdalake.errors import ConfigurationError
from lambdalake.event_schema import (
    MAX_DECIMAL_PRECISION,
    arrow_type,
    decimal_of,
    event_schema,
    general_union_fields,
)
from lambdalake.settings import Settings

_UNIT_SECONDS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400}
#: Longest window a view may have: beyond a month a "window" is a table scan, not a view.
MAX_WINDOW_SECONDS = 31 * 86400
_NUMERIC = {"int", "long", "float", "double"}
#: Pipeline and view names become parts of Cassandra table names (``<pipeline>__<view>__speed``):
#: lower-case words joined by single underscores, and 48 characters at most together.
NAME_PATTERN = r"^[a-z][a-z0-9]*(_[a-z0-9]+)*$"
MAX_TABLE_NAME = 48

#: The topic config every pipeline's topic has: the broker's append time is each record's timestamp.
TIMESTAMP_TYPE, LOG_APPEND_TIME = "message.timestamp.type", "LogAppendTime"

#: Topic-level configs Apache Kafka (3.x) accepts; anything else is a typo caught before Kafka is asked.
KAFKA_TOPIC_CONFIGS = frozenset(
    {
        "cleanup.policy", "compression.type", "compression.gzip.level", "compression.lz4.level",
        "compression.zstd.level", "delete.retention.ms", "file.delete.delay.ms", "flush.messages",
        "flush.ms", "follower.replication.throttled.replicas", "index.interval.bytes",
        "leader.replication.throttled.replicas", "local.retention.bytes", "local.retention.ms",
        "max.compaction.lag.ms", "max.message.bytes", "message.downconversion.enable",
        "message.format.version", "message.timestamp.after.max.ms", "message.timestamp.before.max.ms",
        "message.timestamp.difference.max.ms", "message.timestamp.type", "min.cleanable.dirty.ratio",
        "min.compaction.lag.ms", "min.insync.replicas", "preallocate", "remote.storage.enable",
        "retention.bytes", "retention.ms", "segment.bytes", "segment.index.bytes", "segment.jitter.ms",
        "segment.ms", "unclean.leader.election.enable",
    }
)  # fmt: skip


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


def _check_topic_config(config: dict[str, str], where: str) -> dict[str, str]:
    unknown = sorted(set(config) - KAFKA_TOPIC_CONFIGS)
    if unknown:
        raise ValueError(
            f"{where}: unknown Kafka topic config(s) {unknown}; known ones include "
            "cleanup.policy, retention.ms, min.compaction.lag.ms, max.message.bytes (fix the spelling)"
        )
    return config


class TopicSpec(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9._-]{1,200}$")
    partitions: int = Field(3, ge=1)
    #: None: ``kafka.replication_factor`` (3, or the brokers there are if fewer).
    replication_factor: int | None = Field(None, ge=1)
    #: Topic configs. ``min.compaction.lag.ms`` must outlast the archiving of every event into the
    #: Delta master dataset, since compaction drops superseded versions of a key.
    config: dict[str, str] = Field(default_factory=dict, validate_default=True)
    dlq_config: dict[str, str] = Field(
        default_factory=lambda: {"cleanup.policy": "delete", "retention.ms": str(30 * 24 * 3600 * 1000)}
    )

    @field_validator("config")
    @classmethod
    def _config(cls, value: dict[str, str]) -> dict[str, str]:
        stamping = value.get(TIMESTAMP_TYPE, LOG_APPEND_TIME)
        if stamping != LOG_APPEND_TIME:
            raise ValueError(
                f"topic.config: {TIMESTAMP_TYPE} = {stamping!r} is not supported: ingest epochs are offset "
                "ranges and the first delivery is the first in the log only when the broker stamps each "
                f"record as it appends it (fix: set {TIMESTAMP_TYPE} = {LOG_APPEND_TIME!r}, or leave it out)"
            )
        return _check_topic_config({**value, TIMESTAMP_TYPE: LOG_APPEND_TIME}, "topic.config")

    @field_validator("dlq_config")
    @classmethod
    def _dlq_config(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_topic_config(value, "topic.dlq_config")

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
    #: What the producer does with a field the writer schema does not have: ``reject`` sends the
    #: record to the DLQ (rule ``unknown_field``, naming it: usually a misspelt optional field), ``drop``
    #: removes the field and produces the rest. Default ``reject``.
    unknown_fields: Literal["reject", "drop"] = "reject"

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

    @model_validator(mode="after")
    def _bounds(self) -> RangeRule:
        if self.min is None and self.max is None:
            raise ValueError(f"range rule on {self.field!r} has neither min nor max (give at least one)")
        for bound in (self.min, self.max):
            if bound is not None and not math.isfinite(bound):
                raise ValueError(f"range rule on {self.field!r}: bounds must be finite, not {bound}")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(
                f"range rule on {self.field!r}: min {self.min:g} exceeds max {self.max:g} (swap them)"
            )
        return self


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


#: ``distinct``'s HLL sketch size (log2 of its buckets) when the aggregate does not set ``lg_k``: 2^12
#: buckets, a relative standard error of about 1.6 %, about 2.1 kB a cell at most (measured).
DEFAULT_LG_K = 12
#: ``quantiles``' KLL sketch accuracy parameter when the aggregate does not set ``k`` (Spark's and
#: DataSketches' default): a normalized rank error of about 1.3 % (99 % confidence).
DEFAULT_KLL_K = 200
#: The quantiles a ``quantiles`` aggregate answers when it does not list ``q``.
DEFAULT_QUANTILES = (0.5, 0.95, 0.99)


class Aggregate(Strict):
    """One aggregate of a windowed view.

    Attributes:
        name: Its name in the view's rows and answers.
        fn: ``count`` (events, or non-null values of ``column``), ``sum``, ``min``, ``max``, ``avg``,
            ``distinct`` (distinct values of ``column``, an HLL sketch) or ``quantiles`` (of a numeric
            ``column``, a KLL sketch).
        column: The field aggregated (every fn but ``count`` needs one).
        lg_k: ``distinct`` only: log2 of the sketch's buckets, 4 to 21 (default :data:`DEFAULT_LG_K`).
        k: ``quantiles`` only: the KLL sketch's accuracy, 8 to 65535 (default :data:`DEFAULT_KLL_K`).
        q: ``quantiles`` only: the quantiles answered by default, each in [0, 1] (default
            :data:`DEFAULT_QUANTILES`; a query may ask for others).
    """

    name: str
    fn: Literal["count", "sum", "min", "max", "avg", "distinct", "quantiles"]
    column: str | None = None
    lg_k: int | None = Field(None, ge=4, le=21)
    k: int | None = Field(None, ge=8, le=65535)
    q: list[float] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _column_needed(self) -> Aggregate:
        if self.fn != "count" and not self.column:
            raise ValueError(f"aggregate {self.name!r}: {self.fn} needs a column")
        if self.lg_k is not None and self.fn != "distinct":
            raise ValueError(f"aggregate {self.name!r}: lg_k belongs to distinct, not {self.fn}")
        if (self.k is not None or self.q is not None) and self.fn != "quantiles":
            raise ValueError(f"aggregate {self.name!r}: k and q belong to quantiles, not {self.fn}")
        if self.q is not None and not all(0.0 <= x <= 1.0 for x in self.q):
            raise ValueError(f"aggregate {self.name!r}: every q must be between 0 and 1, not {self.q}")
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> dict[str, Any]:
        # Settings left out stay out of the dump, so a definition written before they existed keeps
        # its fingerprint (a changed fingerprint is a view change: a rebuild).
        return {k: v for k, v in handler(self).items() if not (k in ("lg_k", "k", "q") and v is None)}

    @property
    def sketch_lg_k(self) -> int:
        return self.lg_k if self.lg_k is not None else DEFAULT_LG_K

    @property
    def sketch_k(self) -> int:
        return self.k if self.k is not None else DEFAULT_KLL_K

    @property
    def quantiles(self) -> tuple[float, ...]:
        return tuple(self.q) if self.q is not None else DEFAULT_QUANTILES


def _without_unset_where(value: dict[str, Any]) -> dict[str, Any]:
    """A view's dump without ``where`` when it has none (fingerprints of views defined before
    filters existed stay what they were)."""
    return {k: v for k, v in value.items() if not (k == "where" and v is None)}


class LatestView(Strict):
    """The current state per key: the row with the highest ``version`` wins, whatever the order."""

    name: str = Field(pattern=NAME_PATTERN)
    kind: Literal["latest"]
    key: list[str] = Field(min_length=1)
    version: str
    #: Columns kept (default: every field of the reader schema).
    columns: list[str] | None = None
    #: Only events this filter keeps count (:mod:`lambdalake.filters`); default every event.
    where: str | None = None

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> dict[str, Any]:
        return _without_unset_where(handler(self))


class WindowedView(Strict):
    """Mergeable aggregates per key and tumbling event-time window."""

    name: str = Field(pattern=NAME_PATTERN)
    kind: Literal["windowed"]
    key: list[str] = Field(min_length=1)
    window: str = Field(pattern=r"^\d+ (second|minute|hour|day)s?$")
    #: Event-time column windows are cut on (default: the event's time field).
    time: str | None = None
    aggregates: list[Aggregate] = Field(min_length=1)
    #: Only events this filter keeps count (:mod:`lambdalake.filters`); default every event.
    where: str | None = None
    # A deployed version's record of the types its table and Spark state were made with (by field;
    # :mod:`lambdalake.view_types`): set by the view registry, never by a pipeline file.
    _stored_types: dict[str, str] = PrivateAttr(default_factory=dict)

    @property
    def stored_types(self) -> dict[str, str]:
        return dict(self._stored_types)

    def with_stored_types(self, types: dict[str, str]) -> WindowedView:
        copy = self.model_copy()
        copy._stored_types = dict(types)
        return copy

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> dict[str, Any]:
        return _without_unset_where(handler(self))

    @field_validator("window")
    @classmethod
    def _window_length(cls, value: str) -> str:
        seconds = interval_seconds(value)
        if not 1 <= seconds <= MAX_WINDOW_SECONDS:
            raise ValueError(
                f"window {value!r} must be between 1 second and {MAX_WINDOW_SECONDS // 86400} days "
                "(e.g. '1 hour')"
            )
        return value

    @property
    def window_seconds(self) -> int:
        return interval_seconds(self.window)


View = Annotated[LatestView | WindowedView, Field(discriminator="kind")]


class GeneratorSpec(Strict):
    kind: Literal["offers", "telemetry"]


_INTERVAL = r"^\d+ (second|minute|hour|day)s?$"


class LayersSpec(Strict):
    """How the speed and batch layers cut time. The master dataset records ``epoch`` and ``dedup_delay`` with
    every commit, and a job whose values differ refuses to start: views built with two epoch lengths or
    two dedup delays would not merge exactly."""

    #: Length of an ingest epoch (the unit the batch layer covers and serving merges on).
    epoch: str = Field("1 hour", pattern=_INTERVAL)
    #: How far apart (in ingest time) two copies of an event are still recognised as one by the speed
    #: layer, which also keeps windowed state this long (its watermark delay).
    dedup_delay: str = Field("10 minutes", pattern=_INTERVAL)
    #: How long speed rows of windowed views live in Cassandra: longer than two batch periods, so an
    #: epoch is covered by a batch before its speed rows expire.
    speed_ttl: str = Field("3 days", pattern=_INTERVAL)
    #: How long after an epoch's end the batch layer waits before it counts the epoch as closed
    #: (default: the dedup delay).
    grace: str | None = Field(None, pattern=_INTERVAL)

    @model_validator(mode="after")
    def _lengths(self) -> LayersSpec:
        if not 1 <= self.epoch_seconds <= 7 * 86400:
            raise ValueError(f"layers.epoch {self.epoch!r} must be between 1 second and 7 days")
        if self.speed_ttl_seconds < 2 * self.epoch_seconds:
            raise ValueError(
                f"layers.speed_ttl {self.speed_ttl!r} must be at least two epochs ({self.epoch!r} each)"
            )
        return self

    @property
    def epoch_seconds(self) -> int:
        return interval_seconds(self.epoch)

    @property
    def epoch_ms(self) -> int:
        return self.epoch_seconds * 1000

    @property
    def dedup_delay_seconds(self) -> int:
        return interval_seconds(self.dedup_delay)

    @property
    def speed_ttl_seconds(self) -> int:
        return interval_seconds(self.speed_ttl)

    @property
    def grace_seconds(self) -> int:
        return interval_seconds(self.grace) if self.grace is not None else self.dedup_delay_seconds


class BatchSpec(Strict):
    """When the batch layer rebuilds the views (``lambdalake batch schedule``)."""

    #: A cron expression in UTC (minute hour day-of-month month day-of-week). Default: nightly.
    schedule: str = "30 2 * * *"

    @field_validator("schedule")
    @classmethod
    def _cron(cls, value: str) -> str:
        from croniter import croniter

        if not croniter.is_valid(value):
            raise ValueError(f"batch.schedule {value!r} is not a cron expression (e.g. '30 2 * * *')")
        return value


class Pipeline(Strict):
    name: str = Field(pattern=NAME_PATTERN, max_length=30)
    description: str = ""
    topic: TopicSpec
    schema_: SchemaSpec = Field(alias="schema")
    event: EventSpec
    rules: list[Rule] = Field(default_factory=list)
    generator: GeneratorSpec | None = None
    layers: LayersSpec = Field(default_factory=LayersSpec)
    batch: BatchSpec = Field(default_factory=BatchSpec)
    views: list[View] = Field(default_factory=list)
    #: Where the schema files live (set by the loader, not the file).
    schemas_dir: Path = Field(default=Path("schemas"), exclude=True)

    @model_validator(mode="after")
    def _check_schemas(self) -> Pipeline:
        for i, file in enumerate(self.schema_.versions, start=1):
            path = self.schemas_dir / file
            try:
                text = path.read_bytes()
            except OSError as exc:
                raise ValueError(
                    f"schema.versions[{i - 1}]: cannot read {path}: {exc.strerror} "
                    "(fix the path: it is relative to the schemas folder)"
                ) from None
            try:
                schema = json.loads(text)
            except ValueError as exc:
                raise ValueError(
                    f"{path} is not JSON: {exc} (an .avsc holds one Avro schema as JSON)"
                ) from None
            try:
                fastavro.parse_schema(schema)
            except Exception as exc:  # fastavro raises several error types for bad schemas
                raise ValueError(
                    f"{path} is not a valid Avro schema: {exc} (see the Avro specification)"
                ) from None
            if not isinstance(schema, dict) or schema.get("type") != "record":
                raise ValueError(f"{path}: an event schema must be an Avro record, not {schema!r:.60}")
            if i == len(self.schema_.versions):
                _check_shape(path, schema)
        return self

    @model_validator(mode="after")
    def _check_fields(self) -> Pipeline:
        types = {f["name"]: f["type"] for f in self.reader_schema["fields"]}
        reader = self.schema_.versions[-1]
        uses = [("event.key", self.event.key), ("event.time", self.event.time)]
        uses += [("event.identity", f) for f in self.event.identity]
        uses += [(f"rules ({r.kind})", r.field) for r in self.rules]
        for view in self.views:
            uses += [(f"view {view.name!r} key", k) for k in view.key]
            if isinstance(view, LatestView):
                uses += [(f"view {view.name!r} version", view.version)]
                uses += [(f"view {view.name!r} columns", c) for c in view.columns or []]
            else:
                uses += [(f"view {view.name!r} time", view.time)] if view.time else []
                for a in view.aggregates:
                    if a.column is None:
                        continue
                    where = f"view {view.name!r} aggregate {a.name!r}"
                    uses.append((where, a.column))
                    problem = (
                        _aggregate_problem(types[a.column], a.fn, self.field_types[a.column])
                        if a.column in types
                        else None
                    )
                    if problem is not None:
                        reason = problem.format(reader=reader)
                        raise ValueError(f"{where}: {a.fn} over {a.column!r}, {reason}")
        missing = [f"{where}: {name!r}" for where, name in uses if name not in types]
        if missing:
            raise ValueError(
                f"fields not in the reader schema {reader}: {'; '.join(missing)} "
                f"(fields there: {sorted(types)})"
            )
        # A general union is a struct of members in Spark, Delta and Arrow: rules judge its value,
        # but it cannot key, time, version or be aggregated, and Cassandra has no column for it.
        unions = general_union_fields(self.reader_schema)
        for view in self.views:
            if isinstance(view, LatestView) and view.columns is None:
                uses += [(f"view {view.name!r} columns (all fields by default)", n) for n in sorted(unions)]
        several = [
            f"{where}: {name!r}" for where, name in uses if not where.startswith("rules") and name in unions
        ]
        if several:
            raise ValueError(
                f"fields of several types (general unions) in {reader} used where one type is needed: "
                f"{'; '.join(several)} (use a field of one type, or of one type or null; a latest view "
                "keeps such a field out through its columns)"
            )
        if len({v.name for v in self.views}) != len(self.views):
            raise ValueError("view names must be unique")
        for view in self.views:
            self.view_filter(view)  # raises naming the position and the field
        for view in self.views:
            # The longest of its tables' names: a batch version table (up to a million versions).
            longest = f"{self.name}__{view.name}__b999999"
            if len(longest) > MAX_TABLE_NAME:
                raise ValueError(
                    f"view {view.name!r}: its table names ({longest}) would exceed Cassandra's "
                    f"{MAX_TABLE_NAME} characters (shorten the pipeline or view name)"
                )
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

    @cached_property
    def field_types(self) -> dict[str, Any]:
        """Each field of the reader schema and its Arrow type (as the layers hold it)."""
        return {f.name: f.type for f in event_schema(self.reader_schema)}

    @cached_property
    def field_type_history(self) -> dict[str, list[pa.DataType]]:
        """Each field's Arrow type in every schema version that has it, oldest first."""
        out: dict[str, list[pa.DataType]] = {}
        for i in range(1, len(self.schema_.versions) + 1):
            for f in event_schema(json.loads(self.schema_text(i))):
                out.setdefault(f.name, []).append(f.type)
        return out

    @cached_property
    def _filters(self) -> dict[tuple[str, str], Any]:
        return {}

    def view_filter(self, view: LatestView | WindowedView) -> Any:
        """The parsed ``where`` of ``view`` (a :data:`lambdalake.filters.Node`), or None.

        Raises:
            ValueError: The filter does not parse or does not fit the reader schema (naming where).
        """
        if view.where is None:
            return None
        # Keyed by the reader schema too: a copy of this model (``model_copy``) shares the cache.
        cache_key = (view.where, self.schema_.versions[-1])
        found = self._filters.get(cache_key)
        if found is None:
            symbols = {
                f["name"]: t["symbols"]
                for f in self.reader_schema["fields"]
                for t in (f["type"] if isinstance(f["type"], list) else [f["type"]])
                if isinstance(t, dict) and t.get("type") == "enum"
            }
            try:
                found = filters.parse(view.where, self.field_types, symbols=symbols)
            except filters.FilterError as exc:
                raise ValueError(f"view {view.name!r}: where {view.where!r}: {exc}") from None
            self._filters[cache_key] = found
        return found

    def view(self, name: str) -> View:
        for v in self.views:
            if v.name == name:
                return v
        raise ConfigurationError(
            f"pipeline {self.name!r} has no view {name!r}", fix=f"use one of {[v.name for v in self.views]}"
        )


#: Digits Spark's ``sum`` adds to a decimal's precision (``decimal(p + 10, s)``, 38 at most).
DECIMAL_SUM_DIGITS = 10


def _aggregate_problem(avro_type: Any, fn: str, arrow: Any) -> str | None:
    """Why ``fn`` cannot aggregate a field of ``avro_type`` (Arrow type ``arrow``; a ``{reader}``
    placeholder in the reason), or None. Numbers and decimals can be summed, averaged, compared and
    sketched for quantiles; a decimal's sum is ``decimal(p + 10, s)``, so a decimal of more than 28
    digits would leave its sum fewer than ten digits to grow in (Spark keeps 38 at most) and is
    refused for ``sum`` and ``avg``. ``distinct`` counts values of any plain type."""
    if fn == "distinct":
        return None if filters.value_kind(arrow) is not None else "which is not of one plain type in {reader}"
    if fn == "count" or _is_numeric(avro_type):
        return None
    branches = [t for t in avro_type if t != "null"] if isinstance(avro_type, list) else [avro_type]
    decimals = [decimal_of(t) for t in branches]
    if not branches or any(d is None for d in decimals):
        return "which is not numeric in {reader} (aggregate a number or a decimal, or use count)"
    widest = max(d.precision for d in decimals)  # type: ignore[union-attr]
    if fn in ("sum", "avg") and widest + DECIMAL_SUM_DIGITS > MAX_DECIMAL_PRECISION:
        return (
            f"a decimal of {widest} digits in {{reader}}: its {fn} is a decimal of at most "
            f"{MAX_DECIMAL_PRECISION} digits, which would leave fewer than {DECIMAL_SUM_DIGITS} digits "
            f"to grow in (declare a precision of {MAX_DECIMAL_PRECISION - DECIMAL_SUM_DIGITS} or less, "
            "or aggregate it with min or max)"
        )
    return None


def _is_numeric(avro_type: Any) -> bool:
    if isinstance(avro_type, list):
        branches = [t for t in avro_type if t != "null"]
        return bool(branches) and all(_is_numeric(t) for t in branches)
    if isinstance(avro_type, dict):
        return avro_type.get("type") in _NUMERIC and "logicalType" not in avro_type
    return avro_type in _NUMERIC


def _describe(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(file)"
        lines.append(f"  {where}: {err['msg'].removeprefix('Value error, ')}")
    return "\n".join(lines)


def _check_shape(path: Path, schema: dict[str, Any]) -> None:
    """Every field of the reader schema has a column type in Spark, Delta and Cassandra's tables."""
    named: dict[str, Any] = {}
    for f in schema["fields"]:
        try:
            arrow_type(f["type"], named)
        except ValueError as exc:  # it names the fix
            raise ValueError(f"{path}: field {f['name']!r}: {exc}") from None


def load(path: Path, *, schemas_dir: Path) -> Pipeline:
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigurationError(f"cannot read pipeline file {path}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigurationError(
            f"pipeline file {path} is not valid TOML: {exc}", fix="fix the TOML syntax at the place named"
        ) from None
    try:
        return Pipeline.model_validate({**raw, "schemas_dir": schemas_dir})
    except ValidationError as exc:
        raise ConfigurationError(
            f"invalid pipeline file {path}:\n{_describe(exc)}",
            fix=f"correct the fields named above in {path}",
        ) from None


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
