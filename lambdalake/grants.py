"""Least privilege: what each role's principal may do on Kafka, Cassandra and the registry, written
once. ``deploy`` grants it on the secured embedded services (``up --secure``); ``lambdalake grants``
prints it as the commands to hand a company's administrators for their own clusters.

The roles (:data:`lambdalake.secure.ROLES`):

- **producer** (``lambdalake produce``, a user's producer): writes its pipeline's topic and
  dead-letter topic; reads schemas.
- **speed** (``speed run``, ``replay``): reads the topic, writes dead letters (records it cannot
  decode), commits offsets only under the ``lambdalake-`` consumer group prefix; selects and
  modifies the keyspace's rows; reads schemas.
- **batch** (``batch run``, ``batch schedule``): describes the topic (its partitions' ends set the
  horizon of quiet partitions); creates, alters and drops the keyspace's version tables and writes
  them; reads schemas.
- **serving** (``serve``, ``query``): selects from the keyspace; describes the topic (the metrics'
  lag); reads schemas.

The admin (``deploy``, ``topics``, ``schemas``, ``restore``, ``speed reset``) is a superuser.
Cassandra grants are on the keyspace: a batch makes new version tables each run, which a grant per
table would not cover. Each role reads the registry; only the admin registers schemas.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lambdalake.errors import ConfigurationError
from lambdalake.pipeline import Pipeline
from lambdalake.secure import Role, username
from lambdalake.settings import Settings

#: The prefix of every consumer group the platform's clients use (Spark's Kafka source is given it
#: as ``groupIdPrefix``; offset lookups use ``lambdalake-offsets-*``).
GROUP_PREFIX = "lambdalake-"


@dataclass(frozen=True)
class KafkaAcl:
    """One allow rule: ``role`` may ``operation`` on ``resource`` ``name`` (``prefixed``: every
    name starting so)."""

    role: Role
    resource: str  # "topic" or "group"
    name: str
    operation: str  # Kafka's operation names: READ, WRITE, DESCRIBE, DESCRIBE_CONFIGS
    prefixed: bool = False

    @property
    def principal(self) -> str:
        return f"User:{username(self.role)}"

    def command(self) -> str:
        """The ``kafka-acls.sh`` line that grants it."""
        pattern = "PREFIXED" if self.prefixed else "LITERAL"
        return (
            f"kafka-acls.sh --add --allow-principal {self.principal} "
            f"--operation {self.operation.title().replace('_', '')} --{self.resource} '{self.name}' "
            f"--resource-pattern-type {pattern}"
        )


@dataclass(frozen=True)
class CqlGrant:
    role: Role
    permission: str  # SELECT, MODIFY, CREATE, ALTER, DROP
    keyspace: str

    def statement(self) -> str:
        return f'GRANT {self.permission} ON KEYSPACE "{self.keyspace}" TO {username(self.role)}'


def kafka_acls(pipeline: Pipeline) -> list[KafkaAcl]:
    """The rules on Kafka each role needs for ``pipeline``."""
    topic, dlq = pipeline.topic.name, pipeline.topic.dlq
    rules: list[KafkaAcl] = []
    for name in (topic, dlq):
        rules += [
            KafkaAcl("producer", "topic", name, "WRITE"),
            KafkaAcl("producer", "topic", name, "DESCRIBE"),
        ]
    rules += [
        KafkaAcl("speed", "topic", topic, "READ"),
        KafkaAcl("speed", "topic", topic, "DESCRIBE"),
        # The job checks the topic's timestamps are the broker's (message.timestamp.type).
        KafkaAcl("speed", "topic", topic, "DESCRIBE_CONFIGS"),
        KafkaAcl("speed", "topic", dlq, "WRITE"),
        KafkaAcl("speed", "topic", dlq, "DESCRIBE"),
        KafkaAcl("speed", "group", GROUP_PREFIX, "READ", prefixed=True),
    ]
    for role in ("batch", "serving"):
        rules += [KafkaAcl(role, "topic", name, "DESCRIBE") for name in (topic, dlq)]  # type: ignore[arg-type]
    return rules


def cql_grants(settings: Settings) -> list[CqlGrant]:
    """The keyspace's grants each role needs (every pipeline's tables live in one keyspace)."""
    keyspace = settings.cassandra.keyspace
    wanted: dict[Role, tuple[str, ...]] = {
        "speed": ("SELECT", "MODIFY"),
        "batch": ("SELECT", "MODIFY", "CREATE", "ALTER", "DROP"),
        "serving": ("SELECT",),
    }
    return [CqlGrant(role, permission, keyspace) for role, perms in wanted.items() for permission in perms]


def apply(settings: Settings, pipeline: Pipeline) -> tuple[int, int]:
    """Grant, as the admin, every rule for ``pipeline`` that Kafka or Cassandra does not hold yet
    (idempotent). Returns (rules granted now, rules in all)."""
    from confluent_kafka.admin import (
        AclBinding,
        AclBindingFilter,
        AclOperation,
        AclPermissionType,
        ResourcePatternType,
        ResourceType,
    )

    from lambdalake.cassandra.session import connect, execute_ddl
    from lambdalake.kafka.admin import require_broker

    bindings = [
        AclBinding(
            ResourceType[a.resource.upper()],
            a.name,
            ResourcePatternType.PREFIXED if a.prefixed else ResourcePatternType.LITERAL,
            a.principal,
            "*",
            AclOperation[a.operation],
            AclPermissionType.ALLOW,
        )
        for a in kafka_acls(pipeline)
    ]
    admin = require_broker(settings)
    every = AclBindingFilter(
        ResourceType.ANY, None, ResourcePatternType.ANY, None, None, AclOperation.ANY, AclPermissionType.ANY
    )
    held = set(admin.describe_acls(every, request_timeout=30).result())
    missing = [b for b in bindings if b not in held]
    if missing:
        for future in admin.create_acls(missing, request_timeout=30).values():
            future.result()
    session = connect(settings.cassandra)
    rows = session.execute("SELECT role, resource, permissions FROM system_auth.role_permissions")
    granted = {(r.role, r.resource, p) for r in rows for p in r.permissions or ()}
    grants = cql_grants(settings)
    new = [g for g in grants if (username(g.role), f"data/{g.keyspace}", g.permission) not in granted]
    for grant in new:
        execute_ddl(session, grant.statement())
    return len(missing) + len(new), len(bindings) + len(grants)


def describe(settings: Settings, pipelines: list[Pipeline]) -> list[str]:
    """Every rule as the command an administrator runs: ``kafka-acls.sh`` lines, then CQL."""
    lines = [a.command() for p in pipelines for a in kafka_acls(p)]
    lines += [f"{g.statement()};" for g in cql_grants(settings)]
    return lines


#: Cassandra's refusal: 'User lambdalake_serving has no MODIFY permission on <table ks.t> or any of
#: its parents'.
_CQL_REFUSED = re.compile(r"User (?P<user>\S+) has no (?P<perm>\w+) permission on <(?P<on>[^>]+)>")
#: Kafka's refusals, as librdkafka names them and as the Java client's exceptions do.
_KAFKA_REFUSED = re.compile(
    r"(?P<what>TOPIC|GROUP|CLUSTER|TRANSACTIONAL_ID)_AUTHORIZATION_FAILED|"
    r"(?P<plain>Topic|Group|Cluster) authorization failed|"
    r"(?P<java>Topic|Group|Cluster|TransactionalId)AuthorizationException:?(?P<detail>[^\n]*)"
)
_FIX = (
    "grant it to that principal (`lambdalake grants` prints every role's rights as the commands to "
    "run), or run this with the login of the role that holds it"
)


def refused(error: BaseException | str, settings: Settings | None = None) -> ConfigurationError | None:
    """A service's refusal of a right the principal lacks (not of its login), as one error naming
    the principal and the missing grant; None for any other error."""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    found = _CQL_REFUSED.search(text)
    if found is not None:
        on = found["on"]
        keyspace = on.split(" ")[-1].split(".")[0] if " " in on else on
        return ConfigurationError(
            f"Cassandra refused user {found['user']} {found['perm']} on {on}",
            fix=f'{_FIX} (for the platform\'s roles: GRANT {found["perm"]} ON KEYSPACE "{keyspace}" '
            f"TO {found['user']})",
        )
    found = _KAFKA_REFUSED.search(text)
    if found is not None:
        user = settings.kafka.sasl_username if settings is not None else None
        who = f"user {user}" if user else "this login"
        kind = (found["what"] or found["plain"] or found["java"] or "").lower()
        kind = kind.replace("transactionalid", "transactional id").replace("_", " ")
        detail = (found["detail"] or "").strip() or text.strip().splitlines()[0][:200]
        why = " (a producer's login needs WRITE on the topic it writes)" if kind == "cluster" else ""
        message = f"Kafka refused {who} a right ({kind} authorization){why}: {detail}"
        return ConfigurationError(message, fix=_FIX)
    return None
