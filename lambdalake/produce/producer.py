"""The edge of the trusted domain: validate, encode as registered Avro, produce idempotently."""

from __future__ import annotations

import contextlib
import json
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from confluent_kafka import KafkaError, Message, Producer

from lambdalake.avro import WireEncoder, parse_schema
from lambdalake.kafka import dlq
from lambdalake.kafka.admin import ensure_pipeline_topics
from lambdalake.pipeline import Pipeline
from lambdalake.registry import register_pipeline
from lambdalake.settings import Settings
from lambdalake.validation import RecordValidator, Rejection

#: Safe defaults: no loss (acks=all), no duplicates or reordering from retries (idempotence).
PRODUCER_DEFAULTS: dict[str, Any] = {
    "enable.idempotence": True,
    "acks": "all",
    "compression.type": "lz4",
    "linger.ms": 20,
    "batch.num.messages": 10000,
    "queue.buffering.max.messages": 500_000,
    "queue.buffering.max.kbytes": 512 * 1024,
    "message.timeout.ms": 120_000,
}


@dataclass
class ProduceStats:
    """What happened to every record handed to :class:`EventProducer`."""

    sent: int = 0
    acked: int = 0
    failed: int = 0
    rejected: int = 0
    dlq_acked: int = 0
    dlq_failed: int = 0
    rejected_by_rule: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)

    @property
    def unacknowledged(self) -> int:
        """Records (valid or dead-lettered) the broker did not confirm."""
        return (self.sent - self.acked) + (self.rejected - self.dlq_acked)


def _timestamp_fields(schema: Mapping[str, Any]) -> list[str]:
    return [
        f["name"] for f in schema["fields"]
        if isinstance(f["type"], dict) and str(f["type"].get("logicalType", "")).startswith("timestamp")
    ]  # fmt: skip


class EventProducer:
    """Produces one pipeline's events to its topic, refusing invalid ones to ``<topic>.dlq``.

    Delivery guarantee: at least once per call of :meth:`send`, and exactly once per record within
    a producer session (idempotent producer, ``acks=all``). A record counts as acknowledged only
    when its delivery report arrives; :meth:`flush` returns the counts, and anything not
    acknowledged is reported there, never dropped silently.

    Args:
        settings: Cluster addresses and credentials.
        pipeline: The pipeline whose topic, schema and rules apply.
        schema_version: Which of the pipeline's schema versions to write with (1-based).
            Default: the newest.
        producer_config: librdkafka overrides on top of :data:`PRODUCER_DEFAULTS`.
        clock: Seconds since the epoch, for the ``not_future`` rules. Default ``time.time``.
        prepare: Create topics and register schemas first (both idempotent). Default True.
    """

    def __init__(
        self,
        *,
        settings: Settings,
        pipeline: Pipeline,
        schema_version: int | None = None,
        producer_config: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.time,
        prepare: bool = True,
    ) -> None:
        self.pipeline = pipeline
        self.stats = ProduceStats()
        if prepare:
            ensure_pipeline_topics(settings, pipeline)
        registered = register_pipeline(settings, pipeline)
        index = (schema_version or len(registered)) - 1
        schema_text = pipeline.schema_text(index + 1)
        schema = json.loads(schema_text)
        parsed = parse_schema(schema)
        self.schema_id = registered[index].schema_id
        self._encoder = WireEncoder(self.schema_id, parsed)
        self._validator = RecordValidator(pipeline.rules, schema=schema, parsed_schema=parsed, now=clock)
        self._ts_fields = _timestamp_fields(schema)
        self._topic = pipeline.topic.name
        self._dlq = pipeline.topic.dlq
        self._key = pipeline.event.key
        self._producer = Producer(
            {**settings.kafka.client_config(), **PRODUCER_DEFAULTS, **(producer_config or {})}
        )

    # --- delivery reports (called from poll/flush on this thread) ------------------------------

    def _on_delivery(self, err: KafkaError | None, _msg: Message) -> None:
        if err is None:
            self.stats.acked += 1
        else:
            self.stats.failed += 1
            self.stats.errors[err.str()] += 1

    def _on_dlq_delivery(self, err: KafkaError | None, _msg: Message) -> None:
        if err is None:
            self.stats.dlq_acked += 1
        else:
            self.stats.dlq_failed += 1
            self.stats.errors[f"dlq: {err.str()}"] += 1

    def _produce(
        self, topic: str, key: bytes | None, value: bytes, callback: Any, headers: Any = None
    ) -> None:
        while True:
            try:
                self._producer.produce(topic, value=value, key=key, headers=headers, on_delivery=callback)
                return
            except BufferError:
                # Local queue full: serve delivery reports until there is room (back-pressure).
                self._producer.poll(0.05)

    # --- public API --------------------------------------------------------------------------

    def _coerce(self, record: dict[str, Any]) -> None:
        """JSON input may carry ISO-8601 times; Avro wants epoch milliseconds."""
        for name in self._ts_fields:
            value = record.get(name)
            if isinstance(value, str):
                # An unparsable string is left as is: the schema check then names the field and value.
                with contextlib.suppress(ValueError):
                    parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
                    record[name] = int(parsed.timestamp() * 1000)

    def send(self, record: dict[str, Any], *, original: bytes | None = None) -> Rejection | None:
        """Validate and produce one record. Returns the rejection if it went to the DLQ.

        Args:
            record: The event as a dict of the schema's fields.
            original: The record's original bytes (e.g. its JSON line), kept verbatim in the DLQ.
        """
        if isinstance(record, dict):
            self._coerce(record)
        rejection = self._validator.check(record)
        if rejection is None:
            try:
                value = self._encoder.encode(record)
            except (TypeError, ValueError, OverflowError) as exc:
                rejection = Rejection("schema", f"cannot encode as Avro: {exc}")
        if rejection is not None:
            self.reject(record, rejection, original=original)
            return rejection
        key = record[self._key]
        self._produce(
            self._topic, key.encode() if isinstance(key, str) else str(key).encode(), value, self._on_delivery
        )
        self.stats.sent += 1
        if self.stats.sent % 1000 == 0:
            self._producer.poll(0)
        return None

    def reject(self, record: Any, rejection: Rejection, *, original: bytes | None = None) -> None:
        """Send a refused record to the DLQ with the rule and reason in its headers."""
        if original is None:
            original = json.dumps(record, default=str).encode()
        key = record.get(self._key) if isinstance(record, dict) else None
        self._produce(
            self._dlq,
            str(key).encode() if key is not None else None,
            original,
            self._on_dlq_delivery,
            dlq.headers(pipeline=self.pipeline.name, stage="producer", rule=rejection.rule,
                        reason=rejection.reason),
        )  # fmt: skip
        self.stats.rejected += 1
        self.stats.rejected_by_rule[rejection.rule] += 1

    def send_json_line(self, line: bytes) -> Rejection | None:
        """Parse one JSON line and :meth:`send` it; unparsable lines go to the DLQ as ``json``."""
        try:
            record = json.loads(line)
        except ValueError as exc:
            rejection = Rejection("json", f"not valid JSON: {exc}")
            self.reject(None, rejection, original=line)
            return rejection
        return self.send(record, original=line)

    def poll(self, timeout: float = 0) -> None:
        self._producer.poll(timeout)

    def flush(self, timeout: float = 120.0) -> ProduceStats:
        """Wait for every delivery report (up to ``timeout``); what is still queued counts as failed."""
        remaining = self._producer.flush(timeout)
        if remaining:
            self.stats.errors[f"{remaining} record(s) still queued after {timeout:g}s"] += 1
        return self.stats
