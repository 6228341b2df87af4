"""Ingest rate of ``EventProducer`` (validate + Avro + idempotent produce) against a raw producer.

The baseline is a plain confluent-kafka producer with the same settings sending the same keys and
the same pre-encoded bytes, so the ratio is the cost of validation and encoding on this machine.
Runs alternate baseline / candidate to spread machine noise across both.

    python -m bench.produce [--events 200000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

from confluent_kafka import Producer

from bench.common import bench_settings, write_result
from infra.services import running
from lambdalake.kafka.admin import admin_client, ensure_topic
from lambdalake.pipeline import load_pipeline
from lambdalake.produce.generator import generate
from lambdalake.produce.producer import PRODUCER_DEFAULTS, EventProducer


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    settings = bench_settings()
    with running(settings, ["broker", "registry"]):
        base = load_pipeline("offers", pipelines_dir=settings.pipelines_dir, schemas_dir=settings.schemas_dir)
        records = list(generate("offers", args.events, seed=42))
        raw_rates, our_rates = [], []
        for round_no in range(args.rounds):
            run = uuid.uuid4().hex[:6]
            p = base.model_copy(update={"topic": base.topic.model_copy(update={"name": f"bench-{run}"})})
            producer = EventProducer(settings=settings, pipeline=p)
            # The same bytes the candidate will send, encoded up front (valid records only).
            encoded = [
                (r["offer_id"].encode(), producer._encoder.encode(r))
                for r in records
                if producer._validator.check(r) is None
            ]
            raw_topic = f"bench-raw-{run}"
            ensure_topic(
                admin_client(settings),
                raw_topic,
                partitions=p.topic.partitions,
                replication_factor=1,
                config=dict(p.topic.config),
            )
            raw = Producer({**settings.kafka.client_config(), **PRODUCER_DEFAULTS})
            acked = [0]

            def on_delivery(err, _msg, acked=acked):
                if err is None:
                    acked[0] += 1

            t0 = time.perf_counter()
            for key, value in encoded:
                while True:
                    try:
                        raw.produce(raw_topic, value=value, key=key, on_delivery=on_delivery)
                        break
                    except BufferError:
                        raw.poll(0.05)
            raw.flush(120)
            raw_s = time.perf_counter() - t0
            assert acked[0] == len(encoded), "baseline lost records"
            raw_rates.append(len(encoded) / raw_s)

            t0 = time.perf_counter()
            for r in records:
                producer.send(dict(r))
            stats = producer.flush(120)
            ours_s = time.perf_counter() - t0
            assert stats.unacknowledged == 0 and stats.acked == len(encoded)
            our_rates.append(len(records) / ours_s)
            del producer, raw  # disconnect before the broker stops
            print(
                f"round {round_no + 1}: raw {raw_rates[-1]:,.0f} ev/s, lambdalake {our_rates[-1]:,.0f} ev/s "
                f"(ratio {our_rates[-1] / raw_rates[-1]:.2f})"
            )
    ratios = [o / r for o, r in zip(our_rates, raw_rates, strict=True)]
    result = {
        "events_per_round": args.events,
        "valid_per_round": len(encoded),
        "raw_events_per_s": raw_rates,
        "lambdalake_events_per_s": our_rates,
        "ratio_per_round": ratios,
        "median_ratio": statistics.median(ratios),
        "median_lambdalake_events_per_s": statistics.median(our_rates),
        "targets": {"ratio": 0.8, "events_per_s": 50_000},
    }
    path = write_result("produce", result)
    print(
        f"median: lambdalake {result['median_lambdalake_events_per_s']:,.0f} ev/s, "
        f"ratio to raw {result['median_ratio']:.2f}  -> {path}"
    )


if __name__ == "__main__":
    main()
