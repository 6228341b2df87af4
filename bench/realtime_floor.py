"""The floor under the Real-time latest views' freshness: a Kafka-to-Kafka Real-time Mode query on
this machine, with nothing of lambdalake in it.

A producer sends ``--rate`` records/s for ``--seconds`` s, each carrying its send time; a Real-time
query (``trigger(realTime=...)``, the ``kafka`` source and sink, a local session with a slot per
partition more than its cores) copies them to a second topic; a consumer reads them there. Reported:
p50/p99 of receive time minus send time, over the second half of the run. Run beside
``bench.peers`` (``--floor``) it measures what Spark and Kafka alone cost in the same run.

    python -m bench.realtime_floor [--rate 1000] [--seconds 30] [--partitions 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import threading
import time
import uuid

from confluent_kafka import Consumer, Producer

from lambdalake.kafka.admin import admin_client, ensure_topic
from lambdalake.settings import Settings


def kafka_to_kafka(
    settings: Settings, *, rate: float, seconds: float, partitions: int = 2
) -> dict[str, float]:
    """p50/p99 seconds from a record's send to its copy's receipt through a Real-time query."""
    from lambdalake.spark.session import spark_session

    tag = uuid.uuid4().hex[:8]
    source, sink = f"floor-in-{tag}", f"floor-out-{tag}"
    admin = admin_client(settings)
    for topic in (source, sink):
        ensure_topic(admin, topic, partitions=partitions, replication_factor=1, config={})
    spark = spark_session(settings, "lambdalake-floor", extra_slots=partitions)
    bootstrap = settings.kafka.bootstrap_servers
    query = (
        spark.readStream.format("kafka").option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", source).option("startingOffsets", "latest").load().selectExpr("key", "value")
        .writeStream.format("kafka").option("kafka.bootstrap.servers", bootstrap).option("topic", sink)
        .option("checkpointLocation", tempfile.mkdtemp(prefix="floor-")).outputMode("update")
        .trigger(realTime="5 seconds").start()
    )  # fmt: skip
    latencies: list[tuple[float, float]] = []
    stop = threading.Event()

    def consume() -> None:
        consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"floor-{tag}",
                             "auto.offset.reset": "earliest", "fetch.wait.max.ms": 5})  # fmt: skip
        consumer.subscribe([sink])
        while not stop.is_set():
            msg = consumer.poll(0.05)
            if msg is not None and msg.error() is None:
                sent = json.loads(msg.value())["t"]
                latencies.append((sent, time.time() - sent))
        consumer.close()

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    time.sleep(10)  # the query's first batch planned and its tasks running
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})
    t0 = time.time()
    i = 0
    while time.time() - t0 < seconds:
        producer.produce(source, value=json.dumps({"t": time.time(), "i": i}).encode())
        producer.poll(0)
        i += 1
        ahead = i / rate - (time.time() - t0)
        if ahead > 0:
            time.sleep(ahead)
    producer.flush(10)
    time.sleep(3)
    stop.set()
    reader.join(10)
    query.stop()
    spark.stop()
    steady = sorted(lat for sent, lat in latencies if sent >= t0 + seconds / 2)
    if not steady:
        raise SystemExit("the Kafka-to-Kafka query delivered nothing")
    return {
        "p50_s": statistics.median(steady),
        "p99_s": steady[min(len(steady) - 1, int(len(steady) * 0.99))],
        "records": len(latencies),
        "sent": i,
    }


def main() -> None:
    from bench.common import bench_settings
    from lambdalake.infra.services import running

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", type=float, default=1000)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--services-running", action="store_true", help="use the bench services as they run")
    args = parser.parse_args()
    settings = bench_settings(fresh=not args.services_running)
    with contextlib.nullcontext() if args.services_running else running(settings):
        result = kafka_to_kafka(settings, rate=args.rate, seconds=args.seconds, partitions=args.partitions)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
