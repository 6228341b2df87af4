"""Reaching the cluster and creating a pipeline's topics idempotently, reporting config drift."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, NewTopic

from lambdalake.errors import ConfigurationError, ServiceUnavailable
from lambdalake.pipeline import LOG_APPEND_TIME, TIMESTAMP_TYPE, Pipeline
from lambdalake.settings import Settings


def admin_client(settings: Settings) -> AdminClient:
    return AdminClient(settings.kafka.client_config())


def require_broker(settings: Settings, admin: AdminClient | None = None) -> AdminClient:
    """An admin client to a reachable cluster, or :class:`ServiceUnavailable` naming the fix."""
    admin = admin or admin_client(settings)
    try:
        admin.list_topics(timeout=settings.kafka.connect_timeout_s)
    except KafkaException as exc:
        raise ServiceUnavailable(
            f"cannot reach Kafka at {settings.kafka.bootstrap_servers} "
            f"(no answer within {settings.kafka.connect_timeout_s:g}s: {exc.args[0].str()})",
            fix="start the embedded services with `lambdalake up`, or point "
            "LAMBDALAKE_KAFKA__BOOTSTRAP_SERVERS at your cluster",
        ) from exc
    return admin


@dataclass(frozen=True)
class TopicReport:
    topic: str
    action: Literal["created", "exists", "updated"]
    #: (setting, wanted, actual) for every difference between the definition and the cluster.
    drift: list[tuple[str, str, str]] = field(default_factory=list)
    #: (setting, wanted, was) for every config ``apply`` set.
    fixed: list[tuple[str, str, str]] = field(default_factory=list)


def ensure_topic(
    admin: AdminClient,
    name: str,
    *,
    partitions: int,
    replication_factor: int,
    config: dict[str, str],
    apply: bool = False,
) -> TopicReport:
    """Create ``name`` if missing; otherwise compare partitions and configs and report drift.

    Drift is reported, not repaired, unless ``apply`` is set: then the topic configs the definition
    names are set to its values (an operator's decision: e.g. ``message.timestamp.type`` changes
    the timestamps of new records). Partitions are never changed here, since that moves keys.
    """
    futures = admin.create_topics(
        [NewTopic(name, partitions, replication_factor, config=dict(config))], operation_timeout=30
    )
    try:
        futures[name].result()
        return TopicReport(name, "created")
    except KafkaException as exc:
        if exc.args[0].name() != "TOPIC_ALREADY_EXISTS":
            raise
    drift: list[tuple[str, str, str]] = []
    metadata = admin.list_topics(name, timeout=10).topics[name]
    if len(metadata.partitions) != partitions:
        drift.append(("partitions", str(partitions), str(len(metadata.partitions))))
    actual = admin.describe_configs([ConfigResource("topic", name)])
    entries = next(iter(actual.values())).result()
    configs = []
    for key, wanted in sorted(config.items()):
        have = entries[key].value if key in entries else "<unset>"
        if str(have) != str(wanted):
            configs.append((key, str(wanted), str(have)))
    if not (apply and configs):
        return TopicReport(name, "exists", drift + configs)
    resource = ConfigResource(
        "topic", name,
        incremental_configs=[
            ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET) for k, v, _ in configs
        ],
    )  # fmt: skip
    admin.incremental_alter_configs([resource])[resource].result()
    return TopicReport(name, "updated", drift, configs)


def ensure_pipeline_topics(
    settings: Settings, pipeline: Pipeline, *, apply: bool = False
) -> list[TopicReport]:
    """The pipeline's topic and its dead-letter topic (``apply``: fix config drift, see
    :func:`ensure_topic`)."""
    admin = require_broker(settings)
    spec = pipeline.topic
    return [
        ensure_topic(admin, spec.name, partitions=spec.partitions,
                     replication_factor=spec.replication_factor, config=spec.config, apply=apply),
        ensure_topic(admin, spec.dlq, partitions=1,
                     replication_factor=spec.replication_factor, config=spec.dlq_config, apply=apply),
    ]  # fmt: skip


def require_log_append_time(settings: Settings, pipeline: Pipeline, admin: AdminClient | None = None) -> None:
    """Refuse a live topic whose records carry the producer's time (CreateTime): ingest epochs would
    not be offset ranges, and the first delivery not the first in the log. A topic that does not
    exist yet passes (it is created with the definition's LogAppendTime).

    Raises:
        ConfigurationError: naming the topic, its setting and the fix.
    """
    admin = admin or require_broker(settings)
    topic = pipeline.topic.name
    found = admin.list_topics(topic, timeout=10).topics.get(topic)
    if found is None or found.error is not None:
        return
    entries = next(iter(admin.describe_configs([ConfigResource("topic", topic)]).values())).result()
    have = entries[TIMESTAMP_TYPE].value if TIMESTAMP_TYPE in entries else None
    if have is not None and have != LOG_APPEND_TIME:
        raise ConfigurationError(
            f"topic {topic!r} has {TIMESTAMP_TYPE}={have}: its records carry the producer's time, so "
            "ingest epochs are not offset ranges and the first delivery is not the first in the log",
            fix=f"run `lambdalake topics {pipeline.name} --apply` (sets {TIMESTAMP_TYPE}={LOG_APPEND_TIME})",
        )
