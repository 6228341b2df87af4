"""The embedded services are Apache Kafka and Apache Cassandra, and keep what they acknowledged.

Compaction is the broker's own: a topic with a short ``min.compaction.lag.ms`` loses superseded
records of a key, a pipeline's topic (7 days) keeps every record for the archive. A broker or a
Cassandra node killed with -9 and started again has every write it acknowledged. Those tests run a
broker and a Cassandra of their own (ports of their own), so the session's services are not touched.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from cassandra import ConsistencyLevel
from cassandra.cluster import Cluster
from cassandra.query import SimpleStatement
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from lambdalake.infra.services import BrokerService, CassandraService, running
from lambdalake.kafka.admin import ensure_topic
from lambdalake.settings import Settings
from lambdalake.spark.kafka import read_ranges
from tests.conftest import pipeline_named, port, settings_for
from tests.helpers import kill_minus_nine, topic_ends

pytestmark = [pytest.mark.services, pytest.mark.slow]

OWN_PORTS = {
    name: port(base)
    for name, base in {"broker": 29292, "registry": 28281, "cassandra": 29242, "storage": 27200}.items()
}


def read_topic(settings: Settings, topic: str) -> list[tuple[bytes | None, bytes | None, int]]:
    """Every record the topic holds now, as (key, value, offset): read up to the end offset, so
    the holes compaction leaves in the offsets are passed over."""
    consumer = Consumer({**settings.kafka.client_config(), "group.id": "tests", "enable.auto.commit": False})
    try:
        lo, hi = topic_ends(settings, topic)[0]
        consumer.assign([TopicPartition(topic, 0, lo)])
        out: list[tuple[bytes | None, bytes | None, int]] = []
        while hi > lo and (not out or out[-1][2] < hi - 1):
            msg = consumer.poll(10)
            assert msg is not None, f"timed out reading {topic} at {out[-1][2] if out else lo} of {hi}"
            assert msg.error() is None, msg.error()
            out.append((msg.key(), msg.value(), msg.offset()))
        return out
    finally:
        consumer.close()


def test_reads_skip_aborted_transactions_and_their_markers(
    services: Settings, unique: str, spark: Any
) -> None:
    """A transactional producer's aborted records, and the markers every transaction leaves, take
    offsets no read returns: Spark's Kafka source as the platform configures it reads committed
    records only, whole or cut into tasks."""
    topic = f"transactions-{unique}"
    admin = AdminClient(services.kafka.client_config())
    ensure_topic(admin, topic, partitions=1, replication_factor=1, config={})
    producer = Producer({**services.kafka.client_config(), "transactional.id": f"tx-{unique}"})
    producer.init_transactions(30)
    for commit, values in ((True, [b"a", b"b"]), (False, [b"x", b"y"]), (True, [b"c"])):
        producer.begin_transaction()
        for value in values:
            producer.produce(topic, value=value, partition=0)
        producer.flush(30)  # in the log before the abort (unsent records an abort drops unwritten)
        (producer.commit_transaction if commit else producer.abort_transaction)(30)
    # The coordinator writes the last commit's markers after the commit returns: wait for them.
    consumer = Consumer({**services.kafka.client_config(), "group.id": "tests"})
    deadline = time.monotonic() + 30
    while (high := consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)[1]) < 8:
        assert time.monotonic() < deadline, f"the last commit's marker not written after 30 s (end {high})"
        time.sleep(0.2)
    consumer.close()
    assert high == 8  # 5 records, 3 markers
    for tasks in (None, 3):
        rows = read_ranges(spark, services, topic, {0: (0, high)}, min_partitions=tasks).collect()
        assert [(r.value, r.offset) for r in rows] == [(b"a", 0), (b"b", 1), (b"c", 6)]


def produce(settings: Settings, topic: str, records: list[tuple[bytes, bytes]]) -> None:
    """Send with acks=all and an idempotent producer; every record must be acknowledged."""
    failed: list[str] = []
    producer = Producer({**settings.kafka.client_config(), "acks": "all", "enable.idempotence": True})
    for key, value in records:
        producer.produce(topic, value, key, on_delivery=lambda err, _m: err and failed.append(str(err)))
    assert producer.flush(60) == 0 and not failed, failed[:3]


def test_compaction_drops_superseded_records_and_pipeline_topics_keep_every_record(
    services: Settings, unique: str, spark: Any
) -> None:
    admin = AdminClient(services.kafka.client_config())
    # Segments roll every 200 ms (on the next append) and the cleaner takes any dirty log.
    small = {"segment.ms": "200", "min.cleanable.dirty.ratio": "0.01", "delete.retention.ms": "0"}
    compacted = f"compacted-{unique}"
    ensure_topic(admin, compacted, partitions=1, replication_factor=1,
                 config={"cleanup.policy": "compact", "min.compaction.lag.ms": "500", **small})  # fmt: skip
    pipeline = pipeline_named(services, "offers", topic=f"{unique}-offers")
    spec = pipeline.topic
    assert (
        spec.config["cleanup.policy"] == "compact" and int(spec.config["min.compaction.lag.ms"]) >= 86_400_000
    )
    ensure_topic(admin, spec.name, partitions=1, replication_factor=1, config={**spec.config, **small})
    versions = [(f"k{k}".encode(), f"v{v}".encode()) for v in range(20) for k in range(10)]
    for topic in (compacted, spec.name):
        produce(services, topic, versions)
    sent = len(versions)
    deadline = time.monotonic() + 180
    while len(held := read_topic(services, compacted)) >= sent:
        assert time.monotonic() < deadline, f"{compacted} still holds {len(held)} records after 180 s"
        # A segment rolls only on an append: one record of a key of its own each round.
        for topic in (compacted, spec.name):
            produce(services, topic, [(f"filler-{sent}".encode(), b"x")])
        sent += 1
        time.sleep(1)
    latest = {key: value for key, value, _ in held}
    assert {k: v for k, v in latest.items() if not k.startswith(b"filler")} == {
        f"k{k}".encode(): b"v19" for k in range(10)
    }
    assert len([r for r in held if r[0].startswith(b"k")]) < len(versions)
    # Spark's Kafka source (the speed job's and replay's) steps over the gaps compaction left.
    for _ in range(3):  # the cleaner may take another round between two reads: read again
        before = read_topic(services, compacted)
        rows = read_ranges(spark, services, compacted, {0: (0, before[-1][2] + 1)}).collect()
        if read_topic(services, compacted) == before:
            break
    assert [(r.key, r.value, r.offset) for r in rows] == before
    # The pipeline's topic, with the same small segments but its own lag, kept every record.
    kept = read_topic(services, spec.name)
    assert len(kept) == sent and [(k, v) for k, v, _ in kept[: len(versions)]] == versions


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[Settings]:
    settings = settings_for(tmp_path / "state", OWN_PORTS)
    with running(settings, only=["broker"]):
        yield settings


#: Seconds between the producer's flush returning and the kill -9 (the README's loss table).
KILL_DELAYS = (0.0, 0.05, 0.3, 1.0)


def test_broker_killed_after_acks_keeps_every_acknowledged_record(own_broker: Settings) -> None:
    """For each delay, 1,000 records of 100 B acknowledged with acks=all into a topic of its own,
    then kill -9 that long after the flush returned, then a restart: every topic holds all of its
    records. Then a clean stop and start: the same."""
    admin = AdminClient(own_broker.kafka.client_config())
    broker = BrokerService(own_broker)
    sent: dict[str, list[tuple[bytes, bytes]]] = {}
    for delay in KILL_DELAYS:
        topic = f"acked-{int(delay * 1000)}ms"
        ensure_topic(admin, topic, partitions=1, replication_factor=1, config={})
        sent[topic] = [(f"{i}".encode(), os.urandom(50).hex().encode()) for i in range(1000)]
        produce(own_broker, topic, sent[topic])
        time.sleep(delay)
        kill_minus_nine(broker)
        broker.start()
        admin = AdminClient(own_broker.kafka.client_config())
    held = {topic: [(k, v) for k, v, _ in read_topic(own_broker, topic)] for topic in sent}
    assert {t: len(r) for t, r in held.items()} == {t: 1000 for t in sent} and held == sent
    assert broker.stop()
    broker.start()
    assert {topic: [(k, v) for k, v, _ in read_topic(own_broker, topic)] for topic in sent} == sent


def test_cassandra_killed_keeps_every_acknowledged_write(tmp_path: Path) -> None:
    """Rows, an LWT, a TTL, a logged and an unlogged batch, blobs and decimals written at QUORUM
    (the layers' consistency for views and leases), then kill -9 of Cassandra and a restart."""
    settings = settings_for(tmp_path / "state", OWN_PORTS)
    settings = settings.model_copy(update={"cassandra": settings.cassandra.model_copy(update={"heap": "1G"})})
    node = CassandraService(settings)
    with running(settings, only=["cassandra"]):
        cluster = Cluster([node.host], port=node.port, **settings.cassandra.driver_options())
        try:
            session = cluster.connect()
            assert session.cluster.protocol_version >= 5, "the newest protocol both speak is 5"
            release = session.execute("SELECT release_version FROM system.local").one().release_version
            assert release.startswith("5.0"), release
            session.execute(
                "CREATE KEYSPACE k WITH replication = {'class': 'SimpleStrategy', 'replication_factor': 1}"
            )
            session.execute("CREATE TABLE k.t (id int PRIMARY KEY, b blob, d decimal, note text)")
            insert = session.prepare("INSERT INTO k.t (id, b, d, note) VALUES (?, ?, ?, ?)")
            insert.consistency_level = ConsistencyLevel.QUORUM
            rows = {
                i: (uuid.uuid4().bytes, Decimal(f"{i}.{i:04d}") * Decimal("1e-20"), None) for i in range(2000)
            }
            for i, (b, d, note) in rows.items():
                session.execute(insert, (i, b, d, note))
            lwt = SimpleStatement(
                "INSERT INTO k.t (id, note) VALUES (5000, 'leased') IF NOT EXISTS",
                consistency_level=ConsistencyLevel.QUORUM,
                serial_consistency_level=ConsistencyLevel.SERIAL,
            )
            assert session.execute(lwt).one()[0] is True
            assert session.execute(lwt).one()[0] is False  # the second claim sees the first
            session.execute("INSERT INTO k.t (id, note) VALUES (6000, 'short') USING TTL 2")
            assert 0 < session.execute("SELECT TTL(note) FROM k.t WHERE id = 6000").one()[0] <= 2
            session.execute(
                "BEGIN UNLOGGED BATCH INSERT INTO k.t (id, note) VALUES (7000, 'a'); "
                "INSERT INTO k.t (id, note) VALUES (7001, 'b'); APPLY BATCH"
            )
            session.execute(
                "BEGIN BATCH INSERT INTO k.t (id, note) VALUES (7002, 'c'); "
                "INSERT INTO k.t (id, note) VALUES (7003, 'd'); APPLY BATCH"
            )
        finally:
            cluster.shutdown()
        kill_minus_nine(node)
        node.start()
        cluster = Cluster([node.host], port=node.port, **settings.cassandra.driver_options())
        try:
            session = cluster.connect()
            got = {r.id: (r.b, r.d, r.note) for r in session.execute("SELECT * FROM k.t", timeout=60)}
        finally:
            cluster.shutdown()
    assert {i: got.get(i) for i in rows} == rows
    assert got[5000][2] == "leased"
    assert 6000 not in got  # its TTL of 2 s ran out during the restart
    assert [got.get(i, (None,) * 3)[2] for i in (7000, 7001, 7002, 7003)] == ["a", "b", "c", "d"]
