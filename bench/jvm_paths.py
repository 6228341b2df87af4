"""The JVM engine path against the Python one, in one Spark session (local[2]), rounds alternating.

- Read: a whole-topic batch read of the same records (a 3-partition topic on the bench broker) to
  Spark's ``noop`` sink with Spark's own ``kafka`` source (the Python twin it was measured against
  is gone); and the floor of Spark's: a streaming query's micro-batch of one record.
- Decode: the same Confluent-wire records (``offers``, 10 % written with its first schema version),
  cached in Spark, decoded by today's Python path (columnar decode, rules checked, failures kept
  with their reasons), by Spark's ``from_avro`` in the JVM, one per writer schema id with the
  reader schema as ``avroSchema`` (decode only: no rules, no reasons), and by ``from_avro`` followed
  by today's rule checks over the decoded columns in a Python worker (``jvm+rules``: what a JVM
  decode would still need before the archive pass; decode failures without their reasons).

Spark's connectors at pyspark's version are fetched with Maven into the state cache (the ``spark``
profile of ``lambdalake/maven/pom.xml``).

    python -m bench.jvm_paths [--events 400000] [--rounds 3]   # -> bench/results/jvm_paths.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.avro.functions import from_avro
from pyspark.sql.types import StringType, StructField, StructType

from bench.common import bench_settings, write_result
from bench.decode import source_batches
from lambdalake import jars
from lambdalake.avro import parse_schema
from lambdalake.columnar.validate import ColumnarValidator
from lambdalake.infra.services import running
from lambdalake.spark import decode
from lambdalake.validation import RecordValidator

SOURCES = ("kafka",)


def create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})  # kept: a dropped client ends its requests
    admin.create_topics([NewTopic(topic, partitions, 1)])[topic].result()


def produce(bootstrap: str, topic: str, values: list[bytes]) -> None:
    create_topic(bootstrap, topic, 3)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 50, "compression.type": "lz4"})
    for i, value in enumerate(values):
        while True:
            try:
                producer.produce(topic, value, key=str(i % 1000).encode())
                break
            except BufferError:
                producer.poll(0.1)
    assert producer.flush(60) == 0


def read(spark: SparkSession, source: str, bootstrap: str, topic: str) -> DataFrame:
    return (
        spark.read.format(source).option("kafka.bootstrap.servers", bootstrap).option("subscribe", topic)
        .option("startingOffsets", "earliest").option("endingOffsets", "latest").load()
    )  # fmt: skip


def floor_ms(spark: SparkSession, source: str, bootstrap: str, topic: str, seconds: float) -> list[int]:
    """Durations of a streaming query's micro-batches of one record each (one sent every 2 s)."""
    create_topic(bootstrap, topic, 1)
    folder = tempfile.mkdtemp(prefix="lambdalake-floor-")
    query = (
        spark.readStream.format(source).option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic).option("startingOffsets", "latest").load()
        .writeStream.format("noop").option("checkpointLocation", folder).trigger(processingTime="0 seconds")
        .start()
    )  # fmt: skip
    producer = Producer({"bootstrap.servers": bootstrap})
    try:
        time.sleep(5)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            producer.produce(topic, b"\x00\x00\x00\x00\x01x")
            producer.flush(10)
            time.sleep(2)
        progress = query.recentProgress
        return [p["durationMs"]["triggerExecution"] for p in progress if p["numInputRows"] > 0][1:]
    finally:
        query.stop()
        shutil.rmtree(folder, ignore_errors=True)


def jvm_decode(df: DataFrame, writers: dict[int, str], reader: str) -> DataFrame:
    schema_id = F.conv(F.hex(F.substring("value", 2, 4)), 16, 10).cast("int")
    body = F.expr("substring(value, 6, length(value) - 5)")
    parts = [
        df.filter(schema_id == sid)
        .select(from_avro(body, writer, {"avroSchema": reader, "mode": "PERMISSIVE"}).alias("e"),
                "topic", "partition", "offset", "timestamp")
        .select("e.*", "topic", "partition", "offset", "timestamp")
        for sid, writer in writers.items()
    ]  # fmt: skip
    out = parts[0]
    for part in parts[1:]:
        out = out.unionByName(part)
    return out


def jvm_checked(df: DataFrame, spec: decode.DecodeSpec) -> DataFrame:
    """:func:`jvm_decode`, then the pipeline's rules over its columns in a Python worker, as the
    Python path checks them: the rows the columnar checks cannot clear get the per-record verdict."""
    decoded = jvm_decode(df, dict(spec.writer_schemas), spec.reader_schema)
    reader = json.loads(spec.reader_schema)
    names = [f["name"] for f in reader["fields"]]
    rules = spec.rules

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        parsed = parse_schema(reader)
        validator = RecordValidator(rules, schema=reader, parsed_schema=parsed, check_shape=False)
        checks = ColumnarValidator(rules, schema=reader, check_shape=False)
        millis = decode.millis_fields(reader)
        for batch in batches:
            ruled = decode._millis_as_ints(batch.select(names), millis)
            now = batch.column("timestamp").cast(pa.int64()).to_numpy(zero_copy_only=False) / 1e6
            rule: list[str | None] = [None] * batch.num_rows
            reason: list[str | None] = [None] * batch.num_rows
            for i in np.flatnonzero(checks.suspects(ruled, now=now)).tolist():
                rejection = validator.check(ruled.slice(i, 1).to_pylist()[0], now=now[i])
                if rejection is not None:
                    rule[i], reason[i] = rejection.rule, rejection.reason
            yield batch.append_column("_error_rule", pa.array(rule, pa.string())).append_column(
                "_error_reason", pa.array(reason, pa.string())
            )

    failure = [StructField("_error_rule", StringType()), StructField("_error_reason", StringType())]
    schema = StructType([*decoded.schema.fields, *failure])  # a new one: the frame's own is cached
    return decoded.mapInArrow(run, schema)


def timed(df: DataFrame) -> float:
    t0 = time.perf_counter()
    df.write.format("noop").mode("overwrite").save()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=400_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--floor-seconds", type=float, default=30.0)
    args = parser.parse_args()
    settings = bench_settings()
    connectors = [str(j) for j in jars.classpath(settings.cache_dir, "spark")]
    spec, batches = source_batches("offers", args.events, 50_000)
    values = [v for b in batches for v in b.column("value").to_pylist()]
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    result: dict = {"events": args.events, "read_s": {s: [] for s in SOURCES}, "floor_ms": {},
                    "decode_s": {"python": [], "jvm": [], "jvm+rules": []}}  # fmt: skip
    with running(settings, only=["broker"]):
        bootstrap = settings.kafka.bootstrap_servers
        topic = f"jvm-paths-{uuid.uuid4().hex[:8]}"
        produce(bootstrap, topic, values)
        spark = (
            SparkSession.builder.master("local[2]").config("spark.jars", ",".join(connectors))
            .config("spark.sql.shuffle.partitions", "2").config("spark.ui.enabled", "false").getOrCreate()
        )  # fmt: skip
        spark.sparkContext.setLogLevel("ERROR")
        for r in range(args.rounds):
            for source in SOURCES:
                seconds = timed(read(spark, source, bootstrap, topic))
                result["read_s"][source].append(seconds)
                print(f"round {r} read {source}: {seconds:.2f} s ({args.events / seconds:,.0f} records/s)")
        for source in SOURCES:
            floor = floor_ms(spark, source, bootstrap, f"{topic}-floor-{source}", args.floor_seconds)
            result["floor_ms"][source] = floor
            print(f"floor {source}: micro-batches of one record {floor} ms")
        with tempfile.TemporaryDirectory() as folder:
            pq.write_table(pa.Table.from_batches(batches), f"{folder}/records.parquet")
            records = spark.read.parquet(f"{folder}/records.parquet").repartition(4).cache()
            records.count()
            writers = dict(spec.writer_schemas)
            plans = {
                "python": lambda: decode.decode(records, spec),
                "jvm": lambda: jvm_decode(records, writers, spec.reader_schema),
                "jvm+rules": lambda: jvm_checked(records, spec),
            }
            for r in range(args.rounds):
                for name, plan in plans.items():
                    seconds = timed(plan())
                    result["decode_s"][name].append(seconds)
                    rate = args.events / seconds
                    print(f"round {r} decode {name}: {seconds:.2f} s ({rate:,.0f} records/s)")
        spark.stop()
    for key in ("read_s", "decode_s"):
        medians = {k: statistics.median(v[1:] or v) for k, v in result[key].items()}
        print(f"{key} medians after the first round: {medians}")
    print("->", write_result("jvm_paths", result))


if __name__ == "__main__":
    main()
