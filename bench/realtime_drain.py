"""What the Real-time latest query costs on its own: the offers backlog drained by that query alone,
once computing every candidate and writing none (``write=False``), once writing them to Cassandra.

The two split the query's cost between the second read and decode (Kafka source, wire header,
``from_avro``, rules, ranks) and the writes, which the speed job's drain beside the micro-batch
query (``bench.peers``, side ``lambdalake-realtime``) cannot. Per mode, a topic of its own holding
the same generated offers as ``bench.peers`` (2 % copies); the clock runs from the query's start
until its reported progress has read the whole topic (1 s batches: the figure is late by up to one
batch). Reported: events/s, and the process tree's CPU (this driver, its JVM) as
cores and as CPU ms per 1,000 events, with the whole machine's busy share over the same time.

    python -m bench.realtime_drain [--events 300000] [--services-running]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid

from bench.sampling import RssSampler, machine_cpu
from lambdalake.cassandra.session import connect
from lambdalake.cassandra.tables import deploy_speed_tables
from lambdalake.kafka.offsets import offset_consumer, watermarks
from lambdalake.pipeline import Pipeline, configured_pipeline
from lambdalake.produce.generator import Mix, generate
from lambdalake.produce.producer import EventProducer
from lambdalake.registry import subject_schemas
from lambdalake.settings import Settings
from lambdalake.spark.kafka import source_options
from lambdalake.speed.progress import progress_end as _progress_end

MODES = ("decode", "write")


def drain(
    settings: Settings, pipeline: Pipeline, records: list[dict], *, write: bool
) -> dict[str, float | None]:
    """Produce ``records`` to a fresh topic and drain it with the latest views' Real-time query."""
    from lambdalake.spark.realtime import start_latest_query
    from lambdalake.spark.session import spark_session
    from lambdalake.spark.stopping import stop_quietly

    producer = EventProducer(settings=settings, pipeline=pipeline)
    for i in range(0, len(records), 10_000):
        producer.send_batch(records[i : i + 10_000])
    stats = producer.flush()
    assert stats.unacknowledged == 0 and stats.rejected == 0, stats
    deploy_speed_tables(connect(settings.cassandra), settings.cassandra, pipeline)
    spark = spark_session(settings, "lambdalake-realtime-drain", extra_slots=pipeline.topic.partitions)
    source = (
        spark.readStream.format("kafka")
        .options(**source_options(settings, broker_wait_s=120))
        .option("subscribe", pipeline.topic.name)
        .option("startingOffsets", "earliest")
        .load()
    )
    writers = subject_schemas(settings, pipeline.schema_.subject)
    with offset_consumer(settings) as consumer:
        # The log's end, not the records sent: a transaction's commit marker takes an offset too.
        total = sum(end for _, end in watermarks(consumer, pipeline.topic.name).values())
    sampler = RssSampler(os.getpid())
    machine_start = machine_cpu()
    cpu_start = sampler.cpu_seconds()
    t0 = time.perf_counter()
    query = start_latest_query(
        spark, settings, pipeline, source,
        checkpoint=tempfile.mkdtemp(prefix="realtime-drain-"), writers=writers, write=write,
    )  # fmt: skip
    first: float | None = None
    read_first = 0
    deadline = time.monotonic() + 900
    while True:
        progress = query.lastProgress
        read = 0 if progress is None else sum(_progress_end(progress).values())
        if read and first is None:
            first, read_first = time.perf_counter(), read
        if read >= total:
            break
        if query.exception() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the Real-time query stopped or timed out: {query.exception()}")
        time.sleep(0.05)
    t_done = time.perf_counter()
    cpu_s = sampler.cpu_seconds() - cpu_start
    busy, every = (b - a for a, b in zip(machine_start, machine_cpu(), strict=True))
    sampler.stop()
    stop_quietly(spark, query)
    return {
        "events": len(records),
        "seconds": t_done - t0,
        "events_per_s": len(records) / (t_done - t0),
        # The offsets read after the first reported batch, over the time after it (None when that
        # batch read everything).
        "events_per_s_after_first_progress": (total - read_first) / (t_done - first)
        if first and read_first < total
        else None,
        "cores": cpu_s / (t_done - t0),
        "cpu_ms_per_1k_events": 1e6 * cpu_s / len(records),
        "machine_busy": busy / every,
    }


def run_mode(settings: Settings, *, events: int, mode: str) -> dict[str, float]:
    """One mode's drain of the generated offers, on a topic and keyspace of its own."""
    records = list(generate("offers", events, seed=21, mix=Mix(invalid=0, duplicates=0.02, late=0)))
    tag = f"{mode[:3]}{uuid.uuid4().hex[:6]}"
    mine = settings.model_copy(
        update={
            "speed": settings.speed.model_copy(update={"latest": "realtime", "realtime_batch_s": 1}),
            "cassandra": settings.cassandra.model_copy(update={"keyspace": f"rtdrain_{tag}"}),
            "topic_prefix": f"rtdrain-{tag}-",
        }
    )
    return drain(mine, configured_pipeline("offers", mine), records, write=mode == "write")


def run(*, events: int, modes: tuple[str, ...] = MODES) -> dict[str, dict[str, float]]:
    """Each mode in a process of its own (a fresh JVM each, as the speed job has), on the bench
    services as they run."""
    out = {}
    for mode in modes:
        done = subprocess.run(
            [sys.executable, "-m", "bench.realtime_drain", "--services-running", "--events", str(events),
             "--modes", mode],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if done.returncode:
            raise SystemExit(
                f"bench.realtime_drain {mode} exited with {done.returncode}:\n{done.stderr[-3000:]}"
            )
        out[mode] = json.loads(done.stdout.strip().splitlines()[-1])[mode]
    return out


def main() -> None:
    from bench.common import bench_settings
    from lambdalake.infra.services import running

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=300_000)
    parser.add_argument("--modes", default=",".join(MODES), help=f"a comma-separated subset of {MODES}")
    parser.add_argument("--services-running", action="store_true", help="use the bench services as they run")
    args = parser.parse_args()
    settings = bench_settings(fresh=not args.services_running)
    with contextlib.nullcontext() if args.services_running else running(settings):
        modes = tuple(args.modes.split(","))
        if len(modes) == 1:
            result = {modes[0]: run_mode(settings, events=args.events, mode=modes[0])}
        else:
            result = run(events=args.events, modes=modes)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
