"""Bounded reads of Kafka ranges (replay's pieces), against the real broker (no Spark needed)."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import NewTopic

from lambdalake.kafka.admin import admin_client
from lambdalake.settings import Settings
from lambdalake.spark.kafka_source import (
    KafkaBatchReader,
    KafkaPartition,
    KafkaSourceError,
    SourceOptions,
    plan,
)

pytestmark = pytest.mark.services


def make_topic(settings: Settings, name: str, partitions: int = 3) -> None:
    admin = admin_client(settings)  # kept alive until the future resolves
    admin.create_topics([NewTopic(name, partitions, 1)])[name].result()


def produce(settings: Settings, topic: str, n: int, partition: int | None = None, prefix: str = "v") -> None:
    p = Producer({**settings.kafka.client_config(), "enable.idempotence": True, "linger.ms": 5})
    for i in range(n):
        kwargs = {"partition": partition} if partition is not None else {}
        p.produce(topic, key=f"k{i % 7}".encode(), value=f"{prefix}{i}".encode(), **kwargs)
    assert p.flush(30) == 0


def options(settings: Settings, topic: str, **extra: str) -> SourceOptions:
    return SourceOptions.parse(
        {"kafka.bootstrap.servers": settings.kafka.bootstrap_servers, "subscribe": topic, **extra}
    )


def read_all(opts: SourceOptions, parts: list[KafkaPartition]) -> list[tuple[int, int, bytes]]:
    from lambdalake.spark.kafka_source import read_partition

    out = []
    for part in parts:
        for batch in read_partition(opts, part):
            d = batch.to_pydict()
            out += list(zip(d["partition"], d["offset"], d["value"], strict=True))
    return out


def test_starting_and_ending_offsets(services: Settings, unique: str) -> None:
    topic = f"src-{unique}"
    make_topic(services, topic, 2)
    produce(services, topic, 10, partition=0)
    produce(services, topic, 4, partition=1)
    earliest = KafkaBatchReader(options(services, topic, startingOffsets="earliest"))
    assert earliest.start == {topic: {"0": 0, "1": 0}} and earliest.end == {topic: {"0": 10, "1": 4}}
    assert len(read_all(earliest.opts, earliest.partitions())) == 14
    bounded = KafkaBatchReader(
        options(
            services,
            topic,
            startingOffsets=json.dumps({topic: {"0": 3, "1": -2}}),
            endingOffsets=json.dumps({topic: {"0": 7, "1": -1}}),
        )
    )
    rows = read_all(bounded.opts, bounded.partitions())
    assert sorted((p, o) for p, o, _ in rows) == [
        (0, 3),
        (0, 4),
        (0, 5),
        (0, 6),
        (1, 0),
        (1, 1),
        (1, 2),
        (1, 3),
    ]


def test_starting_timestamp(services: Settings, unique: str) -> None:
    topic = f"ts-{unique}"
    make_topic(services, topic, 1)
    produce(services, topic, 5, partition=0, prefix="old")
    import time

    time.sleep(0.05)
    cut = int(time.time() * 1000)
    time.sleep(0.05)
    produce(services, topic, 3, partition=0, prefix="new")
    reader = KafkaBatchReader(options(services, topic, startingTimestamp=str(cut)))
    values = [v for _, _, v in read_all(reader.opts, reader.partitions())]
    assert values == [b"new0", b"new1", b"new2"]


def test_plan_reads_an_added_partition_from_its_beginning() -> None:
    parts = plan({"t": {"0": 5}}, {"t": {"0": 8, "1": 3}})
    assert [(p.partition, p.start, p.until, p.new) for p in parts] == [(0, 5, 8, False), (1, 0, 3, True)]


@pytest.mark.parametrize("max_records", [1, 3, 10, 37, 100])
def test_plan_cuts_long_ranges_into_contiguous_pieces(max_records: int) -> None:
    start, end = {"t": {"0": 5, "1": 100}}, {"t": {"0": 105, "1": 120}, "u": {"0": 7}}
    parts = plan(start, end, max_records=max_records)
    for topic, partition, begin in (("t", 0, 5), ("t", 1, 100), ("u", 0, 0)):
        mine = [p for p in parts if (p.topic, p.partition) == (topic, partition)]
        until = end[topic][str(partition)]
        assert [p.start for p in mine] == [begin, *(p.until for p in mine[:-1])]  # no gap, no overlap
        assert mine[-1].until == until
        sizes = [p.until - p.start for p in mine]
        assert max(sizes) <= max_records and max(sizes) - min(sizes) <= 1
    assert len(plan(start, end)) == 3  # without a limit: one per topic partition


def test_gaps_and_control_records(services: Settings, unique: str) -> None:
    """Transactions leave offsets no consumer sees (markers, aborted records): reads end anyway."""
    topic = f"gaps-{unique}"
    make_topic(services, topic, 1)
    p = Producer({**services.kafka.client_config(), "transactional.id": f"tx-{unique}"})
    p.init_transactions(10)
    for commit, values in ((True, [b"a", b"b"]), (False, [b"x", b"y"]), (True, [b"c"])):
        p.begin_transaction()
        for v in values:
            p.produce(topic, value=v, partition=0)
        (p.commit_transaction if commit else p.abort_transaction)(10)
    reader = KafkaBatchReader(options(services, topic))
    (part,) = reader.partitions()
    rows = read_all(reader.opts, [part])
    assert [v for _, _, v in rows] == [b"a", b"b", b"c"]
    offsets = [o for _, o, _ in rows]
    assert offsets != list(range(offsets[0], offsets[0] + 3)), "expected gaps between offsets"
    assert part.until > offsets[-1] + 1  # the last offset is a marker no consumer receives
    # Cut into pieces (maxRecordsPerPartition), including pieces that hold only markers or aborted
    # records: every record is read once.
    for max_records in (1, 2, 3, 4):
        split = KafkaBatchReader(options(services, topic, maxRecordsPerPartition=str(max_records)))
        assert read_all(split.opts, split.partitions()) == rows


def test_data_loss_fails_or_skips(services: Settings, unique: str) -> None:
    topic = f"loss-{unique}"
    make_topic(services, topic, 1)
    produce(services, topic, 10, partition=0)
    admin = admin_client(services)
    for fut in admin.delete_records([TopicPartition(topic, 0, 4)]).values():
        fut.result()
    part = KafkaPartition(topic, 0, 1, 10)
    with pytest.raises(KafkaSourceError, match="removed"):
        read_all(options(services, topic), [part])
    rows = read_all(options(services, topic, failOnDataLoss="false"), [part])
    assert [o for _, o, _ in rows] == list(range(4, 10))


def test_headers_column(services: Settings, unique: str) -> None:
    topic = f"hdr-{unique}"
    make_topic(services, topic, 1)
    p = Producer(services.kafka.client_config())
    p.produce(topic, value=b"v", headers=[("h1", b"x")])
    p.flush(10)
    reader = KafkaBatchReader(options(services, topic, includeHeaders="true"))
    from lambdalake.spark.kafka_source import read_partition

    (batch,) = list(read_partition(reader.opts, reader.partitions()[0]))
    assert batch.schema.field("headers").type == pa.list_(
        pa.struct([("key", pa.string()), ("value", pa.binary())])
    )
    assert batch.column("headers").to_pylist() == [[{"key": "h1", "value": b"x"}]]
    assert batch.column("timestampType").to_pylist() == [0]  # CreateTime, as Spark's source reports it
