"""`lambdalake offsets reset` moves a plain consumer group by offset or time, as Kafka's own tooling
does; `--dry-run` changes nothing; bad input exits 2 with the fix."""

from __future__ import annotations

import time
import uuid

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from lambdalake.kafka.admin import admin_client, ensure_topic
from lambdalake.settings import Settings
from tests.conftest import run_cli

pytestmark = [pytest.mark.services]


def committed(settings: Settings, group: str, topic: str) -> dict[int, int]:
    consumer = Consumer({**settings.kafka.client_config(), "group.id": group, "enable.auto.commit": False})
    try:
        tps = consumer.committed([TopicPartition(topic, p) for p in (0, 1)], timeout=30)
        return {tp.partition: tp.offset for tp in tps}
    finally:
        consumer.close()


def test_offsets_reset_by_offset_and_by_time(services: Settings) -> None:
    topic, group = f"offsets-{uuid.uuid4().hex[:8]}", f"group-{uuid.uuid4().hex[:8]}"
    ensure_topic(admin_client(services), topic, partitions=2, replication_factor=1,
                 config={"message.timestamp.type": "LogAppendTime"})  # fmt: skip
    producer = Producer(services.kafka.client_config())
    for i in range(10):
        for p in (0, 1):
            producer.produce(topic, value=f"{p}-{i}".encode(), partition=p)
        producer.flush(10)
        if i == 6:
            time.sleep(0.3)
            middle = int(time.time() * 1000)
            time.sleep(0.3)
    assert producer.flush(10) == 0
    nothing = committed(services, group, topic)

    dry = run_cli(services, "offsets", "reset", group, topic, "--to-offsets", "0:3,1:5", "--dry-run")
    assert dry.returncode == 0, dry.stdout.decode() + dry.stderr.decode()
    assert committed(services, group, topic) == nothing

    moved = run_cli(services, "offsets", "reset", group, topic, "--to-offsets", "0:3,1:999")
    assert moved.returncode == 0, moved.stdout.decode() + moved.stderr.decode()
    assert committed(services, group, topic) == {0: 3, 1: 10}  # clamped to the end

    by_time = run_cli(services, "offsets", "reset", group, topic, "--to-timestamp", str(middle))
    assert by_time.returncode == 0, by_time.stdout.decode() + by_time.stderr.decode()
    assert committed(services, group, topic) == {0: 7, 1: 7}

    bad = run_cli(services, "offsets", "reset", group, topic, "--to-offsets", "zero:3")
    output = bad.stdout.decode() + bad.stderr.decode()
    assert bad.returncode == 2 and "PARTITION:OFFSET" in output and "Traceback" not in output, output
