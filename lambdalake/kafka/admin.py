"""Reaching the cluster and creating a pipeline's topics idempotently, reporting config drift."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from lambdalake.errors import ServiceUnavailable
from lambdalake.pipeline import Pipeline
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
    action: Literal["created", "exists"]
    #: (setting, wanted, actual) for every difference between the definition and the cluster.
    drift: list[tuple[str, str, str]] = field(default_factory=list)


def ensure_topic(
    admin: AdminClient, name: str, *, partitions: int, replication_factor: int, config: dict[str, str]
) -> TopicReport:
    """Create ``name`` if missing; otherwise compare partitions and configs and report drift.

    Drift is reported, not repaired: changing a live topic's partitions or cleanup policy changes
    key placement or retention, which an operator must decide.
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
    for key, wanted in sorted(config.items()):
        have = entries[key].value if key in entries else "<unset>"
        if str(have) != str(wanted):
            drift.append((key, str(wanted), str(have)))
    return TopicReport(name, "exists", drift)


def ensure_pipeline_topics(settings: Settings, pipeline: Pipeline) -> list[TopicReport]:
    """The pipeline's topic and its dead-letter topic."""
    admin = require_broker(settings)
    spec = pipeline.topic
    return [
        ensure_topic(admin, spec.name, partitions=spec.partitions,
                     replication_factor=spec.replication_factor, config=spec.config),
        ensure_topic(admin, spec.dlq, partitions=1,
                     replication_factor=spec.replication_factor, config=spec.dlq_config),
    ]  # fmt: skip
