"""Ingest rate of ``EventProducer`` against the clients a user would otherwise pick.

Per round, on the same generated records and the same broker, in turn:

- raw: a plain confluent-kafka producer with the same settings sending the same keys and the same
  pre-encoded bytes of the valid records (the floor: no validation, no encoding; like
  ``EventProducer``, failures reported and the acknowledged counted at flush);
- confluent: confluent-kafka's own ``AvroSerializer`` + ``Producer`` on the valid records (encoding,
  no validation; a delivery report per record, as its documentation counts acknowledgements);
- send: ``EventProducer.send`` per record (validation, fastavro encoding, invalid ones to the DLQ);
- send_batch(dicts) and send_batch(table): the columnar path, 10,000 records a call, from dicts and
  from Arrow tables built beforehand.

    python -m bench.produce [--events 200000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections.abc import Callable

import pyarrow as pa
from confluent_kafka import Producer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from bench.common import bench_settings, write_result
from lambdalake.infra.services import running
from lambdalake.kafka.admin import admin_client, ensure_topic
from lambdalake.pipeline import Pipeline, load_pipeline
from lambdalake.produce.generator import generate
from lambdalake.produce.producer import PRODUCER_DEFAULTS, EventProducer
from lambdalake.settings import Settings

BATCH = 10_000


def _raw_producer(settings: Settings, *, report_each: bool) -> tuple[Producer, list[int], Callable]:
    """A plain producer with the project's settings and a delivery count: ``[acked, failed]``.

    ``report_each``: a delivery report per record (confluent-kafka's documented way of knowing what
    was acknowledged, and what a user of it writes); without, as ``EventProducer`` does, only
    failures are reported and the acknowledged are what a flush leaves of the rest."""
    raw = Producer(
        {**settings.kafka.client_config(), **PRODUCER_DEFAULTS, "delivery.report.only.error": not report_each}
    )
    counts = [0, 0]

    def on_delivery(err, _msg) -> None:
        counts[0 if err is None else 1] += 1

    return raw, counts, on_delivery


def _produce_all(raw: Producer, topic: str, pairs, on_delivery) -> None:
    for key, value in pairs:
        while True:
            try:
                raw.produce(topic, value=value, key=key, on_delivery=on_delivery)
                break
            except BufferError:
                raw.poll(0.05)


def _topic(settings: Settings, p: Pipeline, name: str) -> str:
    ensure_topic(admin_client(settings), name, partitions=p.topic.partitions, replication_factor=1,
                 config=dict(p.topic.config))  # fmt: skip
    return name


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    settings = bench_settings()
    rates: dict[str, list[float]] = {
        k: [] for k in ("raw", "confluent", "send", "batch_dicts", "batch_table")
    }
    with running(settings, ["broker", "registry"]):
        base = load_pipeline("offers", pipelines_dir=settings.pipelines_dir, schemas_dir=settings.schemas_dir)
        records = list(generate("offers", args.events, seed=42))
        registry = SchemaRegistryClient({"url": settings.registry.url})
        for round_no in range(args.rounds):
            run = uuid.uuid4().hex[:6]

            def pipeline(kind: str, run: str = run) -> Pipeline:
                topic = base.topic.model_copy(update={"name": f"bench-{kind}-{run}"})
                return base.model_copy(update={"topic": topic})

            producers = {k: EventProducer(settings=settings, pipeline=pipeline(k))
                         for k in ("send", "batch_dicts", "batch_table")}  # fmt: skip
            check = producers["send"]
            valid = [r for r in records if check._validator.check(r) is None]
            encoded = [(r["offer_id"].encode(), check._encoder.encode(r)) for r in valid]
            dict_batches = [records[i : i + BATCH] for i in range(0, len(records), BATCH)]
            tables = [pa.Table.from_pylist(valid[i : i + BATCH]) for i in range(0, len(valid), BATCH)]

            raw_topic = _topic(settings, base, f"bench-raw-{run}")
            raw, counts, on_delivery = _raw_producer(settings, report_each=False)
            t0 = time.perf_counter()
            _produce_all(raw, raw_topic, encoded, on_delivery)
            left = raw.flush(120)
            rates["raw"].append(len(encoded) / (time.perf_counter() - t0))
            assert counts[1] == left == 0, "baseline lost records"

            topic = _topic(settings, base, f"bench-confluent-{run}")
            serializer = AvroSerializer(registry, base.schema_text(len(base.schema_.versions)))
            context = SerializationContext(topic, MessageField.VALUE)
            confluent, counts, on_delivery = _raw_producer(settings, report_each=True)
            t0 = time.perf_counter()
            pairs = ((r["offer_id"].encode(), serializer(r, context)) for r in valid)
            _produce_all(confluent, topic, pairs, on_delivery)
            confluent.flush(120)
            rates["confluent"].append(len(valid) / (time.perf_counter() - t0))
            assert counts[0] == len(valid), "confluent-kafka lost records"

            candidates = {
                "send": (lambda p: [p.send(dict(r)) for r in records], len(records)),
                "batch_dicts": (
                    lambda p, batches=dict_batches: [p.send_batch(b) for b in batches],
                    len(records),
                ),
                "batch_table": (lambda p, tables=tables: [p.send_batch(t) for t in tables], len(valid)),
            }
            for kind, (send_all, count) in candidates.items():
                t0 = time.perf_counter()
                send_all(producers[kind])
                stats = producers[kind].flush(120)
                rates[kind].append(count / (time.perf_counter() - t0))
                assert stats.unacknowledged == 0 and stats.acked == len(valid)
            del producers, raw, confluent, check  # disconnect before the broker stops
            print(f"round {round_no + 1}: " + ", ".join(f"{k} {v[-1]:,.0f} ev/s" for k, v in rates.items()))

    def ratios(a: str, b: str) -> list[float]:
        return [x / y for x, y in zip(rates[a], rates[b], strict=True)]

    result = {
        "events_per_round": args.events,
        "valid_per_round": len(valid),
        "events_per_s": rates,
        "median_events_per_s": {k: statistics.median(v) for k, v in rates.items()},
        "ratios_per_round": {
            "send / raw": ratios("send", "raw"),
            "batch_table / raw": ratios("batch_table", "raw"),
            "batch_dicts / raw": ratios("batch_dicts", "raw"),
            "batch_table / confluent": ratios("batch_table", "confluent"),
            "batch_dicts / confluent": ratios("batch_dicts", "confluent"),
        },
        "targets": {"batch / confluent": 3.0, "batch / raw": 0.6},
    }
    path = write_result("produce", result)
    medians = {k: statistics.median(v) for k, v in result["ratios_per_round"].items()}
    print("median ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in medians.items()) + f"  -> {path}")


if __name__ == "__main__":
    main()
