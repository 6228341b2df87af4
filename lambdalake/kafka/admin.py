"""Reaching the cluster and creating a pipeline's topics idempotently, reporting config drift."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, NewTopic

from lambdalake.errors import ConfigurationError, ServiceUnavailable
from lambdalake.pipeline import LOG_APPEND_TIME, TIMESTAMP_TYPE, Pipeline
from lambdalake.secure import certificate_fault, server_certificate_fault
from lambdalake.settings import Settings


def admin_client(settings: Settings) -> AdminClient:
    return AdminClient(settings.kafka.client_config())


def refusal(settings: Settings, errors: list[KafkaError]) -> ConfigurationError | None:
    """The settings' fault the client's errors show (a refused login, a certificate it could not
    check), naming the setting to fix; None for anything else."""
    kafka = settings.kafka
    text = " ".join(e.str() for e in errors).lower()
    if any(e.code() == KafkaError._AUTHENTICATION for e in errors) or "authentication failed" in text:
        who = f"user {kafka.sasl_username!r}" if kafka.sasl_username else "no login"
        return ConfigurationError(
            f"Kafka at {kafka.bootstrap_servers} refused the login "
            f"({who}, {kafka.sasl_mechanism or 'no SASL mechanism'})",
            fix="set LAMBDALAKE_KAFKA__SASL_USERNAME and LAMBDALAKE_KAFKA__SASL_PASSWORD to a user of the "
            "cluster (and LAMBDALAKE_KAFKA__SASL_MECHANISM to its mechanism)",
        )
    fault = certificate_fault(text)
    if fault == "untrusted" and kafka.ssl_ca_location is not None:
        # librdkafka says only that the verification failed: ask the brokers' TLS why.
        for address in kafka.bootstrap_servers.split(","):
            found = server_certificate_fault(address.strip(), kafka.ssl_ca_location)
            if found is not None:
                fault = found
                break
    if fault == "names another host":
        return ConfigurationError(
            "a Kafka broker's certificate does not name the address it was reached at "
            f"({kafka.bootstrap_servers})",
            fix="set LAMBDALAKE_KAFKA__BOOTSTRAP_SERVERS to names its certificates hold (and the brokers' "
            "advertised listeners to them), or reissue the certificates",
        )
    if fault == "expired":
        return ConfigurationError(
            "a Kafka broker's certificate has expired",
            fix="reissue the brokers' certificates (the embedded ones: `lambdalake up --secure` renews them)",
        )
    if fault == "untrusted":
        return ConfigurationError(
            "a Kafka broker's certificate is not signed by the CA in "
            f"{kafka.ssl_ca_location or 'the system store'}",
            fix="set LAMBDALAKE_KAFKA__SSL_CA_LOCATION to the PEM file of the CA that signed the brokers' "
            "certificates",
        )
    return None


def require_broker(settings: Settings, admin: AdminClient | None = None) -> AdminClient:
    """An admin client to a reachable cluster, or :class:`ServiceUnavailable` naming the fix (a
    :class:`ConfigurationError` when the cluster refused the login or its certificate)."""
    seen: list[KafkaError] = []
    # Its errors are gathered (and said once, below), not logged by librdkafka line by line.
    admin = admin or AdminClient({**settings.kafka.client_config(), "error_cb": seen.append, "log_level": 0})
    try:
        admin.list_topics(timeout=settings.kafka.connect_timeout_s)
    except KafkaException as exc:
        admin.poll(0)  # serves the error callbacks queued meanwhile (a refused login is one)
        refused = refusal(settings, [exc.args[0], *seen])
        if refused is not None:
            raise refused from None
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
    settings: Settings, pipeline: Pipeline, *, apply: bool = False, admin: AdminClient | None = None
) -> list[TopicReport]:
    """The pipeline's topic and its dead-letter topic (``apply``: fix config drift, see
    :func:`ensure_topic`; ``admin``: the caller's client)."""
    admin = admin or require_broker(settings)
    spec = pipeline.topic
    replicas, in_sync = topic_replication(settings, pipeline, admin)
    config = {"min.insync.replicas": str(in_sync), **spec.config}
    dlq_config = {"min.insync.replicas": str(in_sync), **spec.dlq_config}
    return [
        ensure_topic(admin, spec.name, partitions=spec.partitions, replication_factor=replicas,
                     config=config, apply=apply),
        ensure_topic(admin, spec.dlq, partitions=1, replication_factor=replicas, config=dlq_config,
                     apply=apply),
    ]  # fmt: skip


def require_pipeline_topics(settings: Settings, pipeline: Pipeline) -> None:
    """Refuse, naming the fix, unless the pipeline's topic and dead-letter topic exist: what a role
    without the right to create topics (the producer's) checks instead of creating them."""
    admin = require_broker(settings)
    wanted = [pipeline.topic.name, pipeline.topic.dlq]
    topics = admin.list_topics(timeout=settings.kafka.connect_timeout_s).topics
    missing = [t for t in wanted if t not in topics or topics[t].error is not None]
    if missing:
        raise ConfigurationError(
            f"pipeline {pipeline.name!r}: topic(s) {', '.join(missing)} do not exist, or user "
            f"{settings.kafka.sasl_username or '(none)'} may not describe them",
            fix=f"`lambdalake deploy --pipeline {pipeline.name}` creates them and grants the roles theirs",
        )


def default_replication(brokers: int) -> tuple[int, int]:
    """(replication factor, ``min.insync.replicas``) a topic gets by default on ``brokers`` brokers:
    3 replicas (fewer with fewer brokers), 2 in sync from 3 (one replica may be down with no
    acknowledged write lost), else 1. Pipelines' topics, ``_schemas`` and Kafka's own internal
    topics all follow it."""
    replicas = max(1, min(3, brokers))
    return replicas, 2 if replicas >= 3 else 1


def topic_replication(settings: Settings, pipeline: Pipeline, admin: AdminClient) -> tuple[int, int]:
    """(replication factor, ``min.insync.replicas``) of the pipeline's topics: the pipeline's
    ``topic.replication_factor``, else ``kafka.replication_factor``, else 3 (the brokers there are,
    if fewer); ``kafka.min_insync_replicas``, else 2 from a factor of 3 (one replica may be down
    with no acknowledged write lost), else 1.

    Raises:
        ConfigurationError: A factor above the brokers there are, or a minimum above the factor.
    """
    brokers = len(admin.list_topics(timeout=10).brokers)
    replicas = (
        pipeline.topic.replication_factor
        or settings.kafka.replication_factor
        or default_replication(brokers)[0]
    )
    if replicas > brokers:
        raise ConfigurationError(
            f"topic {pipeline.topic.name!r}: replication factor {replicas}, but the Kafka cluster has "
            f"{brokers} broker(s) up",
            fix="lower topic.replication_factor in the pipeline or LAMBDALAKE_KAFKA__REPLICATION_FACTOR "
            "(unset: 3, or the brokers there are), or start the missing brokers",
        )
    in_sync = settings.kafka.min_insync_replicas or default_replication(replicas)[1]
    in_sync = int(pipeline.topic.config.get("min.insync.replicas", in_sync))
    if in_sync > replicas:
        raise ConfigurationError(
            f"topic {pipeline.topic.name!r}: min.insync.replicas {in_sync} above its replication factor "
            f"{replicas}: no write with acks=all could succeed",
            fix="lower LAMBDALAKE_KAFKA__MIN_INSYNC_REPLICAS (or the topic's min.insync.replicas)",
        )
    return replicas, in_sync


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
