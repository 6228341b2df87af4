"""Idempotent topic creation and drift reports, against the embedded broker."""

from __future__ import annotations

import pytest

from lambdalake.kafka.admin import admin_client, ensure_pipeline_topics, ensure_topic
from lambdalake.settings import Settings
from tests.conftest import pipeline_named

pytestmark = pytest.mark.services


def test_pipeline_topics_are_created_once_then_reported_clean(services: Settings, unique: str) -> None:
    pipeline = pipeline_named(services, "offers", topic=f"offers-{unique}")
    first = ensure_pipeline_topics(services, pipeline)
    assert [(r.topic, r.action) for r in first] == [
        (pipeline.topic.name, "created"),
        (pipeline.topic.dlq, "created"),
    ]
    second = ensure_pipeline_topics(services, pipeline)
    assert [(r.action, r.drift) for r in second] == [("exists", []), ("exists", [])]
    metadata = admin_client(services).list_topics(pipeline.topic.name, timeout=10)
    assert len(metadata.topics[pipeline.topic.name].partitions) == pipeline.topic.partitions


def test_drift_is_reported_not_repaired(services: Settings, unique: str) -> None:
    admin = admin_client(services)
    name = f"drift-{unique}"
    ensure_topic(admin, name, partitions=1, replication_factor=1, config={"cleanup.policy": "delete"})
    report = ensure_topic(
        admin,
        name,
        partitions=3,
        replication_factor=1,
        config={"cleanup.policy": "compact", "min.compaction.lag.ms": "604800000"},
    )
    assert report.action == "exists"
    drift = {key: (wanted, actual) for key, wanted, actual in report.drift}
    assert drift["partitions"] == ("3", "1")
    assert drift["cleanup.policy"] == ("compact", "delete")
    assert drift["min.compaction.lag.ms"][0] == "604800000"


def test_config_drift_is_set_with_apply(services: Settings, unique: str) -> None:
    """A topic made before LogAppendTime was in the definition: reported, then set with --apply."""
    pipeline = pipeline_named(services, "offers", topic=f"offers-{unique}")
    admin = admin_client(services)
    ensure_topic(admin, pipeline.topic.name, partitions=2, replication_factor=1, config={})
    (report, _) = ensure_pipeline_topics(services, pipeline)
    assert ("message.timestamp.type", "LogAppendTime", "CreateTime") in report.drift
    (report, _) = ensure_pipeline_topics(services, pipeline, apply=True)
    assert report.action == "updated" and report.drift == []
    assert ("message.timestamp.type", "LogAppendTime", "CreateTime") in report.fixed
    (report, _) = ensure_pipeline_topics(services, pipeline)
    assert (report.action, report.drift, report.fixed) == ("exists", [], [])


def test_producer_time_is_refused_in_a_definition_and_on_a_live_topic(
    services: Settings, unique: str
) -> None:
    """Ingest epochs are offset ranges only when the broker stamps records: CreateTime is refused in
    a pipeline file, and a live topic set to it stops the speed job and deploy, naming the fix."""
    from confluent_kafka.admin import AdminClient, NewTopic
    from pydantic import ValidationError

    from lambdalake.errors import ConfigurationError
    from lambdalake.kafka.admin import require_log_append_time
    from lambdalake.pipeline import TopicSpec

    with pytest.raises(ValidationError, match="LogAppendTime"):
        TopicSpec(name="t", config={"message.timestamp.type": "CreateTime"})
    assert TopicSpec(name="t").config["message.timestamp.type"] == "LogAppendTime"
    pipeline = pipeline_named(services, "offers", topic=f"offers-ct-{unique}")
    admin = AdminClient(services.kafka.client_config())
    new = NewTopic(pipeline.topic.name, 1, 1, config={"message.timestamp.type": "CreateTime"})
    admin.create_topics([new])[pipeline.topic.name].result()
    with pytest.raises(ConfigurationError) as refused:
        require_log_append_time(services, pipeline)
    assert "CreateTime" in refused.value.message and "--apply" in (refused.value.fix or "")
