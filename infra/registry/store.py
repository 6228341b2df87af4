"""Registry state, replayed from and persisted to a compacted Kafka topic.

Record layout follows Confluent Schema Registry's ``_schemas`` topic: JSON keys
``{"keytype": "SCHEMA", "subject", "version", "magic": 1}`` with the registered schema as value,
``{"keytype": "CONFIG", "subject", "magic": 0}`` with ``{"compatibilityLevel"}``, and a null value
(tombstone) for a permanent delete.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from lambdalake.infra.registry import compatibility
from lambdalake.kafka.admin import default_replication
from lambdalake.kafka.offsets import while_electing

log = logging.getLogger("lambdalake.registry")


class RegistryError(Exception):
    """An error answered to the client in Confluent's form: HTTP status, error_code, message."""

    def __init__(self, status: int, code: int, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def subject_not_found(subject: str) -> RegistryError:
    return RegistryError(404, 40401, f"Subject '{subject}' not found.")


def version_not_found(subject: str, version: object) -> RegistryError:
    return RegistryError(404, 40402, f"Version {version} not found for subject '{subject}'.")


def canonical(schema_str: str) -> str:
    """Whitespace- and key-order-insensitive form used to recognise the same schema."""
    return json.dumps(json.loads(schema_str), sort_keys=True, separators=(",", ":"))


@dataclass
class Version:
    id: int
    schema: str
    deleted: bool = False


@dataclass
class State:
    schemas: dict[int, str] = field(default_factory=dict)
    ids_by_canonical: dict[str, int] = field(default_factory=dict)
    subjects: dict[str, dict[int, Version]] = field(default_factory=dict)
    configs: dict[str | None, str] = field(default_factory=dict)

    def apply(self, key: dict[str, Any], value: dict[str, Any] | None) -> None:
        """Apply one ``_schemas`` record (the same path on replay and on a live write)."""
        if key["keytype"] == "SCHEMA":
            subject, version = key["subject"], key["version"]
            if value is None:
                self.subjects.get(subject, {}).pop(version, None)
                return
            sid, schema = value["id"], value["schema"]
            taken = self.schemas.get(sid)
            if taken is not None and canonical(taken) != canonical(schema):
                # An id already names another schema earlier in the log (a write that raced or was
                # retried past a timeout): the first record wins, in every replay, so an id always
                # resolves to one schema. The writer of this one sees it lost and retries.
                return
            existing = self.subjects.get(subject, {}).get(version)
            if existing is not None and existing.id != sid:
                return  # the same rule for a version number taken by another schema
            self.schemas[sid] = schema
            self.ids_by_canonical.setdefault(canonical(schema), sid)
            self.subjects.setdefault(subject, {})[version] = Version(sid, schema, bool(value.get("deleted")))
        elif key["keytype"] == "CONFIG":
            if value is None:
                self.configs.pop(key.get("subject"), None)
            else:
                self.configs[key.get("subject")] = value["compatibilityLevel"]


class KafkaBackedStore:
    """The registry's state, changed only by what the compacted ``topic`` holds.

    The state is built by reading the topic: at start, and before every write, the registry reads it
    to its end (so ids and versions are assigned from everything the log holds, including a write
    that timed out earlier but reached the broker); a write then produces its record and reads on
    until it has applied that record. The answer comes from the state the log built, as with
    Confluent's registry: a write is complete only when the registry's own reader has consumed it.
    Between reads the partition is paused, so an idle registry sends the broker no fetch requests
    (the embedded broker answers fetches at once rather than long-polling: a consumer left running
    kept it and the registry busy).

    Delivery guarantee: an id or version is answered only after its record is acknowledged by the
    broker (``acks=all``, idempotent producer) and applied from the log; since the first record for
    an id wins in every replay, one id names one schema before and after any restart.

    Args:
        kafka_config: librdkafka client config (bootstrap servers and security).
        topic: The compacted state topic. Default in settings: ``_schemas``.
        default_level: Global compatibility level when none was set. Default ``BACKWARD``.
        timeout_s: How long a write waits for the broker (read to the end, acknowledge, apply) before
            it fails with a 5xx answer and nothing assigned. Default 20.
    """

    def __init__(
        self,
        *,
        kafka_config: dict[str, Any],
        topic: str,
        default_level: str = "BACKWARD",
        timeout_s: float = 20.0,
    ) -> None:
        self.topic = topic
        self.default_level = default_level
        self.timeout_s = timeout_s
        self.state = State()
        self._lock = threading.RLock()  # one reader or writer of the log at a time
        self._position = 0  # next offset to apply
        self._kafka_config = kafka_config
        self._ensure_topic()
        self._tp = TopicPartition(self.topic, 0)
        self._consumer = Consumer(
            {
                **kafka_config,
                "group.id": "lambdalake-registry-reader",
                "enable.auto.commit": False,
                "enable.partition.eof": True,
                "auto.offset.reset": "earliest",
            }
        )
        self._consumer.assign([TopicPartition(self.topic, 0, OFFSET_BEGINNING)])
        self._consumer.pause([self._tp])
        self.catch_up()
        # message.timeout.ms below the write timeout: a record librdkafka gave up on is never sent
        # later behind the registry's back (and were it, the log's first-wins rule keeps ids unique).
        self._producer = Producer(
            {
                **kafka_config,
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 0,
                "message.timeout.ms": int(timeout_s * 1000 * 0.75),
            }
        )

    def _ensure_topic(self) -> None:
        admin = AdminClient(self._kafka_config)
        replicas, in_sync = default_replication(len(admin.list_topics(timeout=10).brokers))
        config = {"cleanup.policy": "compact", "min.insync.replicas": str(in_sync)}
        futures = admin.create_topics(
            [NewTopic(self.topic, 1, replicas, config=config)], operation_timeout=10
        )
        for fut in futures.values():
            try:
                fut.result()
            except KafkaException as exc:
                if exc.args[0].name() != "TOPIC_ALREADY_EXISTS":
                    raise

    def _read_to(self, offset: int) -> None:
        """Apply records until the next offset to apply is at least ``offset``."""
        if self._position >= offset:
            return
        deadline = time.monotonic() + self.timeout_s
        self._consumer.resume([self._tp])
        try:
            while self._position < offset:
                if time.monotonic() > deadline:
                    raise RegistryError(
                        500, 50002,
                        f"the registry could not read {self.topic} up to offset {offset} within "
                        f"{self.timeout_s:g}s (is the Kafka broker up?); nothing was changed",
                    )  # fmt: skip
                msg = self._consumer.poll(0.2)
                if msg is None:
                    continue
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        self._position = max(self._position, msg.offset())
                    else:
                        log.warning("reading %s: %s", self.topic, err.str())
                    continue
                try:
                    value = msg.value()
                    self.state.apply(json.loads(msg.key()), json.loads(value) if value is not None else None)
                except (ValueError, KeyError, TypeError) as exc:
                    # A record another writer put there that is not ours to read: skip it, say so.
                    log.error("skipping unreadable record at %s offset %d: %r", self.topic, msg.offset(), exc)
                self._position = msg.offset() + 1
        finally:
            self._consumer.pause([self._tp])

    def catch_up(self) -> None:
        """Apply everything the topic holds now."""
        with self._lock:
            try:
                _low, high = while_electing(
                    lambda: self._consumer.get_watermark_offsets(self._tp, timeout=self.timeout_s),
                    timeout=self.timeout_s,
                )
            except KafkaException as exc:
                raise RegistryError(
                    500, 50002, f"cannot read the end of {self.topic} (is the Kafka broker up?): {exc}"
                ) from None
            self._read_to(high)

    def _write(self, key: dict[str, Any], value: dict[str, Any] | None) -> None:
        """Append one record and read on until it is applied (the caller holds the lock)."""
        reports: list[tuple[Any, int]] = []
        self._producer.produce(
            self.topic,
            key=json.dumps(key, separators=(",", ":")).encode(),
            value=None if value is None else json.dumps(value, separators=(",", ":")).encode(),
            on_delivery=lambda err, msg: reports.append((err, msg.offset())),
        )
        self._producer.flush(self.timeout_s)
        if not reports or reports[0][0] is not None:
            problem = reports[0][0].str() if reports else f"no acknowledgement within {self.timeout_s:g}s"
            raise RegistryError(
                500, 50001, f"could not persist to {self.topic}: {problem} (is the Kafka broker up?)"
            )
        self._read_to(reports[0][1] + 1)

    # --- reads -----------------------------------------------------------------------------

    def level(self, subject: str | None) -> str:
        return self.state.configs.get(subject) or self.state.configs.get(None) or self.default_level

    def live_versions(self, subject: str, *, include_deleted: bool = False) -> dict[int, Version]:
        versions = self.state.subjects.get(subject) or {}
        live = {v: ver for v, ver in sorted(versions.items()) if include_deleted or not ver.deleted}
        if not live:
            raise subject_not_found(subject)
        return live

    def version(
        self, subject: str, version: str | int, *, include_deleted: bool = False
    ) -> tuple[int, Version]:
        live = self.live_versions(subject, include_deleted=include_deleted)
        if str(version) in ("latest", "-1"):
            v = max(live)
            return v, live[v]
        try:
            v = int(version)
        except ValueError:
            raise RegistryError(
                422, 42202, f"The specified version '{version}' is not a valid version id."
            ) from None
        if v not in live:
            raise version_not_found(subject, version)
        return v, live[v]

    def subjects(self, *, include_deleted: bool = False) -> list[str]:
        return sorted(
            s
            for s, vs in self.state.subjects.items()
            if any(include_deleted or not v.deleted for v in vs.values())
        )

    def schema(self, schema_id: int) -> str:
        try:
            return self.state.schemas[schema_id]
        except KeyError:
            raise RegistryError(404, 40403, f"Schema {schema_id} not found") from None

    def lookup(self, subject: str, schema_str: str) -> tuple[int, Version]:
        """The live version of ``subject`` holding this schema (42201 if it is not valid Avro)."""
        validate(schema_str)
        want = canonical(schema_str)
        for v, ver in self.live_versions(subject).items():
            if canonical(ver.schema) == want:
                return v, ver
        raise RegistryError(404, 40403, "Schema not found")

    def compatibility_errors(
        self, subject: str, schema_str: str, version: str | int | None = None
    ) -> list[str]:
        """Reasons the schema is incompatible with ``version`` (or with what the level requires)."""
        validate(schema_str)
        level = self.level(subject)
        if version is None:
            try:
                existing = [v.schema for v in self.live_versions(subject).values()]
            except RegistryError:
                return []
        else:
            existing = [self.version(subject, version)[1].schema]
            level = level.removesuffix("_TRANSITIVE")
        return compatibility.check(schema_str, existing, level)

    # --- writes ----------------------------------------------------------------------------

    def register(self, subject: str, schema_str: str) -> tuple[int, int]:
        """Register under ``subject``; returns (id, version). Idempotent for an already-live schema."""
        validate(schema_str)
        with self._lock:
            self.catch_up()
            try:
                v, ver = self.lookup(subject, schema_str)
                return ver.id, v
            except RegistryError:
                pass
            reasons = self.compatibility_errors(subject, schema_str)
            if reasons:
                raise RegistryError(
                    409, 409,
                    f"Schema being registered is incompatible with an earlier schema for subject "
                    f"\"{subject}\" (compatibility {self.level(subject)}), details: {reasons}",
                )  # fmt: skip
            for _attempt in range(5):
                sid = self.state.ids_by_canonical.get(canonical(schema_str))
                if sid is None:
                    sid = max(self.state.schemas, default=0) + 1
                version = max(self.state.subjects.get(subject, {}), default=0) + 1
                self._write(
                    {"keytype": "SCHEMA", "subject": subject, "version": version, "magic": 1},
                    {"subject": subject, "version": version, "id": sid, "schema": schema_str,
                     "deleted": False},
                )  # fmt: skip
                won = self.state.subjects.get(subject, {}).get(version)
                if won is not None and won.id == sid:
                    return sid, version
                # Another record took the id or version first in the log: assign again from it.
            raise RegistryError(500, 50001, f"could not assign an id to a schema of {subject!r}; retry")

    def delete_version(self, subject: str, version: str | int, *, permanent: bool) -> int:
        with self._lock:
            self.catch_up()
            v, ver = self.version(subject, version, include_deleted=permanent)
            if permanent and not ver.deleted:
                raise RegistryError(
                    404,
                    40407,
                    f"Subject '{subject}' Version {v} was not deleted first before being permanently deleted",
                )
            key = {"keytype": "SCHEMA", "subject": subject, "version": v, "magic": 1}
            if permanent:
                self._write(key, None)
            else:
                self._write(
                    key,
                    {"subject": subject, "version": v, "id": ver.id, "schema": ver.schema, "deleted": True},
                )
            return v

    def delete_subject(self, subject: str, *, permanent: bool) -> list[int]:
        with self._lock:
            versions = list(self.live_versions(subject, include_deleted=permanent))
            return [self.delete_version(subject, v, permanent=permanent) for v in versions]

    def set_level(self, subject: str | None, level: str) -> None:
        level = level.upper()
        if level not in compatibility.LEVELS:
            raise RegistryError(
                422, 42203, f"Invalid compatibility level {level}; use one of {compatibility.LEVELS}"
            )
        with self._lock:
            self.catch_up()
            self._write({"keytype": "CONFIG", "subject": subject, "magic": 0}, {"compatibilityLevel": level})

    def delete_level(self, subject: str) -> str:
        with self._lock:
            self.catch_up()
            previous = self.level(subject)
            self._write({"keytype": "CONFIG", "subject": subject, "magic": 0}, None)
            return previous

    def close(self) -> None:
        self._producer.flush(10)
        self._consumer.close()


def validate(schema_str: str) -> None:
    try:
        compatibility.parse(schema_str)
    except Exception as exc:  # avro raises several parse error types
        raise RegistryError(422, 42201, f"Invalid schema: {exc}") from None
