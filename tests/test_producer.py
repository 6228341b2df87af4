"""Producers against the real embedded broker and registry."""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from lambdalake.kafka import dlq
from lambdalake.produce.generator import Mix, generate
from lambdalake.produce.producer import EventProducer
from lambdalake.settings import Settings
from tests.conftest import pipeline_named
from tests.helpers import REFERENCE_VALID, consume_all, kcat_count

pytestmark = pytest.mark.services


@pytest.mark.parametrize("name", ["offers", "telemetry"])
def test_valid_to_topic_invalid_to_dlq(services: Settings, unique: str, name: str) -> None:
    pipeline = pipeline_named(services, name, topic=f"{name}-{unique}")
    records = list(generate(name, 5000, seed=7, mix=Mix(duplicates=0.05, invalid=0.05, late=0.05)))
    producer = EventProducer(settings=services, pipeline=pipeline)
    for r in records:
        producer.send(dict(r))
    stats = producer.flush()
    now_ms = int(time.time() * 1000)
    valid = [r for r in records if REFERENCE_VALID[name](r, now_ms)]
    invalid = len(records) - len(valid)
    assert invalid > 100, "the generator should have made a share of invalid records"
    assert stats.unacknowledged == 0
    assert (stats.sent, stats.rejected) == (len(valid), invalid)
    assert kcat_count(services, pipeline.topic.name) == len(valid)
    assert kcat_count(services, pipeline.topic.dlq) == invalid

    # Every dead letter names its rule and reason and keeps the original payload.
    letters = consume_all(services, pipeline.topic.dlq)
    rules = Counter()
    for msg in letters:
        headers = dict(msg.headers())
        assert headers[dlq.STAGE] == b"producer" and headers[dlq.PIPELINE] == name.encode()
        assert headers[dlq.REASON]
        rules[headers[dlq.RULE].decode()] += 1
        assert not REFERENCE_VALID[name](json.loads(msg.value()), now_ms)
    assert len(rules) >= 4, rules  # several kinds of invalid record were generated and caught


def test_avro_deserializer_decodes_what_we_wrote(services: Settings, unique: str) -> None:
    pipeline = pipeline_named(services, "offers", topic=f"offers-{unique}")
    records = list(generate("offers", 300, seed=3, mix=Mix(duplicates=0, invalid=0, late=0)))
    producer = EventProducer(settings=services, pipeline=pipeline)
    for r in records:
        assert producer.send(dict(r)) is None
    assert producer.flush().acked == len(records)

    deserializer = AvroDeserializer(SchemaRegistryClient(services.registry.client_config()))
    decoded = []
    for msg in consume_all(services, pipeline.topic.name):
        value = deserializer(msg.value(), SerializationContext(msg.topic(), MessageField.VALUE))
        assert msg.key().decode() == value["offer_id"]
        value["updated_at"] = int(value["updated_at"].timestamp() * 1000)
        decoded.append(value)
    key = lambda r: (r["offer_id"], r["version"])  # noqa: E731
    assert sorted(decoded, key=key) == sorted(records, key=key)


def test_older_schema_version_is_registered_and_used(services: Settings, unique: str) -> None:
    pipeline = pipeline_named(services, "telemetry", topic=f"telemetry-{unique}")
    v1 = EventProducer(settings=services, pipeline=pipeline, schema_version=1)
    v2 = EventProducer(settings=services, pipeline=pipeline, prepare=False)
    assert v1.schema_id != v2.schema_id
    record = next(generate("telemetry", 1, seed=1, mix=Mix(duplicates=0, invalid=0, late=0)))
    v1_fields = {f["name"] for f in json.loads(pipeline.schema_text(1))["fields"]}
    assert v1.send({k: v for k, v in record.items() if k in v1_fields}) is None and v1.flush().acked == 1
    msg = consume_all(services, pipeline.topic.name)[0]
    assert int.from_bytes(msg.value()[1:5], "big") == v1.schema_id


def test_json_lines_with_bad_json_and_iso_times(services: Settings, unique: str) -> None:
    pipeline = pipeline_named(services, "offers", topic=f"offers-{unique}")
    producer = EventProducer(settings=services, pipeline=pipeline)
    good = {
        "offer_id": "o-1",
        "merchant_id": "m-1",
        "title": "Lamp",
        "price_cents": 100,
        "currency": "EUR",
        "stock": 1,
        "status": "active",
        "version": 1,
        "updated_at": "2026-01-02T03:04:05Z",
    }
    assert producer.send_json_line(json.dumps(good).encode()) is None
    rejection = producer.send_json_line(b'{"offer_id": "o-2", oops}')
    assert rejection is not None and rejection.rule == "json"
    stats = producer.flush()
    assert (stats.acked, stats.dlq_acked) == (1, 1)
    letter = consume_all(services, pipeline.topic.dlq)[0]
    assert letter.value() == b'{"offer_id": "o-2", oops}'  # the original bytes, verbatim


def test_two_waves_of_generated_readings_never_share_an_identity() -> None:
    """Distinct readings of one vehicle never share (vehicle_id, event_time), across waves too: a
    second wave's out-of-order readings land on the first wave's times, and a shared identity there
    would read as a copy ingested later than the dedup delay (README: it counts twice in speed rows
    until the next batch)."""
    clock = lambda: 1_800_000_000.0  # noqa: E731  (both waves at once: the worst case)

    def identities(seed: int) -> Counter:
        stream = generate("telemetry", 5_000, seed=seed, mix=Mix(duplicates=0.0, invalid=0.0), clock=clock)
        return Counter((r["vehicle_id"], r["event_time"]) for r in stream)

    first, second = identities(2), identities(4)
    assert max(first.values()) == max(second.values()) == 1
    assert not set(first) & set(second)


def test_records_the_broker_never_acknowledged_are_counted_as_such(services: Settings, unique: str) -> None:
    """Acknowledgements are counted at flush from what was not reported failed (the topic's producer
    reports failures only): a broker that never answers leaves every record, valid or dead-lettered,
    counted as not acknowledged, none as acknowledged."""
    pipeline = pipeline_named(services, "offers", topic=f"offers-{unique}")
    nowhere = services.model_copy(
        update={"kafka": services.kafka.model_copy(update={"bootstrap_servers": "127.0.0.1:9"})}
    )
    producer = EventProducer(
        settings=nowhere, pipeline=pipeline, prepare=False, producer_config={"message.timeout.ms": 1500}
    )
    records = list(generate("offers", 5, seed=3, mix=Mix(duplicates=0.0, invalid=0.0, late=0.0)))
    outcome = producer.send_batch([dict(r) for r in records])
    assert outcome.accepted == 5
    assert producer.send({"offer_id": "no-merchant"}) is not None  # to the DLQ, which fails too
    stats = producer.flush(30)
    assert (stats.sent, stats.acked, stats.failed) == (5, 0, 5)
    assert (stats.rejected, stats.dlq_acked, stats.dlq_failed) == (1, 0, 1)
    assert stats.unacknowledged == 6
