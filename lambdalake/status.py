"""What a pipeline is doing, gathered from where each layer leaves it: stream lag per partition
(the broker's log end against what the master dataset archived), speed queries' last micro-batches, the
dead-letter topic, the active batch version and the last batch run. Read by ``lambdalake status``
and serving's ``/metrics``; every source that cannot be read is reported, never raised."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from lambdalake.layout import batch_status_file, speed_status_file
from lambdalake.pipeline import LatestView, Pipeline
from lambdalake.settings import Settings
from lambdalake.storage import read_text


@dataclass(frozen=True)
class PartitionLag:
    """One partition: the broker's log end, the next offset the master dataset lacks, the records between."""

    partition: int
    end: int
    archived: int
    lag: int


@dataclass(frozen=True)
class ViewFreshness:
    """A speed view: the query writing it, when its last micro-batch ran, and the lag it saw."""

    view: str
    query: str
    last_batch_at: str | None
    seconds_since: float | None
    lag: int | None


@dataclass
class PipelineStatus:
    pipeline: str
    topic: str
    partitions: list[PartitionLag] = field(default_factory=list)
    views: list[ViewFreshness] = field(default_factory=list)
    dlq_records: int | None = None
    batch_version: int | None = None
    horizon: int | None = None
    published_at_ms: int | None = None
    last_batch: dict[str, Any] | None = None
    #: Per view: its active version, and the one being built (None: none).
    view_versions: dict[str, dict[str, int | None]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def lag(self) -> int:
        return sum(p.lag for p in self.partitions)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"lag": self.lag}


def pipeline_status(settings: Settings, pipeline: Pipeline, *, session: Any = None) -> PipelineStatus:
    """Everything ``status`` shows for one pipeline (``session``: a Cassandra session to reuse)."""
    status = PipelineStatus(pipeline.name, pipeline.topic.name)
    _stream(settings, pipeline, status)
    names = _batch(settings, pipeline, status, session)
    _speed_views(settings, pipeline, status, names)
    return status


def _stream(settings: Settings, pipeline: Pipeline, status: PipelineStatus) -> None:
    from lambdalake.errors import ConfigurationError, ServiceUnavailable
    from lambdalake.kafka.offsets import offset_consumer, watermarks
    from lambdalake.master import master_of

    topic = pipeline.topic.name
    try:
        with offset_consumer(settings) as consumer:
            try:
                marks = watermarks(consumer, topic, settings.kafka.connect_timeout_s)
                ends = {p: hi for p, (_lo, hi) in marks.items()}
            except ConfigurationError:
                status.problems.append(f"topic {topic} does not exist (run `lambdalake deploy`)")
                return
            try:
                dlq = watermarks(consumer, pipeline.topic.dlq, settings.kafka.connect_timeout_s)
                status.dlq_records = sum(hi - lo for lo, hi in dlq.values())
            except ConfigurationError:
                pass  # no dead-letter topic yet: nothing to count
    except ServiceUnavailable as exc:
        status.problems.append(f"Kafka at {settings.kafka.bootstrap_servers} unreachable: {exc.message}")
        return
    master = master_of(settings, pipeline)
    try:
        read = master.read_progress(
            [f"{topic}/{p}" for p in ends], low={f"{topic}/{p}": lo for p, (lo, _hi) in marks.items()}
        )
    except Exception as exc:  # storage unreadable: report, show the broker side anyway
        status.problems.append(f"master dataset unreadable: {exc}")
        read = {}
    for p, end in ends.items():
        archived = read.get(f"{topic}/{p}", -1) + 1
        status.partitions.append(PartitionLag(p, end, archived, max(0, end - archived)))


def _speed_views(
    settings: Settings, pipeline: Pipeline, status: PipelineStatus, names: dict[str, str]
) -> None:
    queries = json.loads(read_text(speed_status_file(settings.storage_root, pipeline.name)) or "{}")
    now = time.time()
    for view in pipeline.views:
        # The main query writes the latest views and the first windowed one; others have their own.
        name = f"{pipeline.name}-{names.get(view.name, view.name)}"
        if name not in queries or isinstance(view, LatestView):
            name = f"{pipeline.name}-main"
        last = queries.get(name, {}).get("last_batch", {})
        at = last.get("at")
        since = None
        if at:
            since = round(now - datetime.fromisoformat(at.replace("Z", "+00:00")).timestamp(), 1)
        status.views.append(ViewFreshness(view.name, name, at, since, last.get("lag")))


def _batch(settings: Settings, pipeline: Pipeline, status: PipelineStatus, session: Any) -> dict[str, str]:
    """The batch and view versions; returns each view's active internal name."""
    from lambdalake.cassandra.active import read_meta
    from lambdalake.cassandra.session import connect

    status.last_batch = json.loads(
        read_text(batch_status_file(settings.storage_root, pipeline.name)) or "null"
    )
    try:
        meta = read_meta(session or connect(settings.cassandra), settings.cassandra.keyspace, pipeline.name)
    except Exception as exc:  # Cassandra down: report it
        status.problems.append(f"Cassandra unreachable: {str(exc).splitlines()[0]}")
        return {}
    names = {}
    for view, state in sorted(meta.registry.views.items()):
        if state.active is None and state.building is None:
            continue  # removed
        status.view_versions[view] = {
            "active": state.active.version if state.active else None,
            "building": state.building.version if state.building else None,
        }
        if state.active is not None:
            names[view] = state.active.name
    active = meta.batch
    if active is not None:
        status.batch_version, status.horizon = active.version, active.horizon
        status.published_at_ms = active.published_at_ms
    return names
