"""Batch rebuild rate: ``BatchJob.run`` over N events in the master dataset, against a plain Spark job doing
the same dedup and aggregations straight to Parquet (the compute stage's overhead), in one run.

The master dataset is written directly (synthetic offers with 2 % duplicates, ingest times spread over the
last two days, so every epoch but the newest is closed): producing 10M events through Kafka and the speed
job would take most of the bench's time without telling anything about the batch layer. A 200k-event
rebuild runs first, unreported, so the timed publishes meet a warm Cassandra, as a nightly job does.

Then the incremental run: a full run over 10M (and 20M) events of history, 0.5M new events in the
next two epochs, and the incremental run over them, each timed end to end.

    python -m bench.batch [--events 2000000 10000000] [--history 10000000 20000000] [--new 500000]
"""

from __future__ import annotations

import argparse
import shutil
import time
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from bench.common import bench_settings, write_result
from lambdalake.batch.job import BatchJob
from lambdalake.infra.services import running
from lambdalake.kafka.admin import ensure_pipeline_topics
from lambdalake.layout import master_path
from lambdalake.master import MasterDataset
from lambdalake.master_files import write_event_files
from lambdalake.pipeline import Pipeline, load_pipeline
from lambdalake.settings import Settings
from lambdalake.spark.decode import ERROR_FIELDS, DecodeSpec
from lambdalake.spark.session import spark_session

CHUNK = 1_000_000
KEYS = 200_000
EPOCH_MS = 3_600_000


def synthetic_master(
    n: int, schema: pa.Schema, topic: str, seed: int, *, first: int = 0, epochs: tuple[int, int] | None = None
) -> list[pa.Table]:
    """``n`` offers events as master dataset rows, in chunks; 2 % are later copies of earlier events.
    ``first``: the first event's number (and offset); ``epochs``: the ingest epochs they spread
    over, ``[start, end)`` (default the 46 closed epochs before the last two)."""
    rng = np.random.default_rng(seed)
    now_epoch = int(time.time() * 1000) // EPOCH_MS
    start, end = epochs or (now_epoch - 48, now_epoch - 2)
    start_ms, span = start * EPOCH_MS, (end - start) * EPOCH_MS - 1  # every event in a closed epoch
    chunks = []
    for lo in range(first, first + n, CHUNK):
        size = min(CHUNK, first + n - lo)
        idx = np.arange(lo, lo + size)
        copies = rng.random(size) < 0.02
        original = np.where(copies, np.maximum(idx - rng.integers(1, 5000, size), 0), idx)
        key = original % KEYS
        ingest = start_ms + ((idx - first) * span // n)
        cols = {
            "offer_id": pa.array([f"offer-{k:06d}" for k in key]),
            "merchant_id": pa.array([f"merchant-{k % 500:04d}" for k in key]),
            "title": pa.array(["Lamp"] * size),
            "price_cents": pa.array(rng.integers(100, 1_000_000, size)),
            "currency": pa.array(["EUR"] * size),
            "stock": pa.array(rng.integers(0, 500, size).astype(np.int32)),
            "status": pa.array(["active"] * size),
            "version": pa.array(original // KEYS + 1),
            "updated_at": pa.array(ingest - rng.integers(0, 60_000, size), pa.timestamp("ms", tz="UTC")),
            "promo_code": pa.nulls(size, pa.string()),
            "_topic": pa.array([topic] * size),
            "_partition": pa.array((key % 2).astype(np.int32)),
            "_offset": pa.array(idx),
            "_ingest_ts": pa.array(ingest, pa.timestamp("ms", tz="UTC")),
            "_epoch": pa.array(ingest // EPOCH_MS),
            "_schema_id": pa.array(np.ones(size, np.int32)),
        }
        chunks.append(pa.table({f.name: pa.array(cols[f.name]).cast(f.type) for f in schema}))
    return chunks


def plain_spark(spark, files: list[str], out: str) -> float:
    """The same dedup and aggregations, written the plain way, straight to Parquet (seconds)."""
    t0 = time.perf_counter()
    df = spark.read.parquet(*files)
    first = F.min_by(
        F.struct(*[F.col(c) for c in df.columns]), F.struct("_ingest_ts", "_partition", "_offset")
    )
    events = df.groupBy("offer_id", "version").agg(first.alias("e")).select("e.*")
    events.cache()
    winner = F.max_by(
        F.struct(*[F.col(c) for c in events.columns]), F.struct("version", F.col("_offset") * -1)
    )
    events.groupBy("offer_id").agg(winner.alias("w")).select("w.*").write.parquet(f"{out}/latest")
    window = F.timestamp_seconds(F.floor(F.unix_seconds("updated_at") / 3600) * 3600).alias("window_start")
    events.groupBy("merchant_id", window).agg(
        F.count(F.lit(1)).alias("updates"), F.sum("price_cents").alias("price_sum"),
        F.min("price_cents").alias("price_min"), F.max("price_cents").alias("price_max"),
        F.count("price_cents").alias("price_avg_count"), F.sum("stock").alias("stock_sum"),
    ).write.parquet(f"{out}/hourly")  # fmt: skip
    events.unpersist()
    return time.perf_counter() - t0


def rebuild(settings: Settings, spark: SparkSession, n: int, *, report: bool = True) -> dict | None:
    """The master dataset of ``n`` synthetic events, then ``BatchJob.run`` between two plain Spark runs
    (``report``
    False: the job alone, a warm-up)."""
    run_id = uuid.uuid4().hex[:6]
    base = load_pipeline("offers", pipelines_dir=settings.pipelines_dir, schemas_dir=settings.schemas_dir)
    topic = base.topic.model_copy(update={"name": f"bench-batch-{run_id}"})
    pipeline = base.model_copy(update={"topic": topic})
    ensure_pipeline_topics(settings, pipeline)
    root = f"{settings.storage_root}/batch-{run_id}"
    run_settings = settings.model_copy(update={"storage_root": root})
    schema = DecodeSpec.of(pipeline, settings).output_schema
    schema = pa.schema([f for f in schema if f.name not in ERROR_FIELDS])
    master = MasterDataset(master_path(root, pipeline.name), event_time=pipeline.event.time)
    t0 = time.perf_counter()
    for i, chunk in enumerate(synthetic_master(n, schema, topic.name, seed=n)):
        files = write_event_files(chunk, path=master.path, event_time="updated_at", name=f"bench-{i}")
        master.commit(files, app_id="bench", batch_id=i, layers=pipeline.layers)
    written_s = time.perf_counter() - t0
    files = master.file_uris()
    # Plain Spark before and after the job (the first query of a session pays JVM warm-up):
    # the faster of the two is the baseline.
    if not report:
        BatchJob(settings=run_settings, pipeline=pipeline, spark=spark).run()
        shutil.rmtree(root, ignore_errors=True)
        return None
    plain_first = plain_spark(spark, files, f"{root}/plain-1")
    t0 = time.perf_counter()
    run = BatchJob(settings=run_settings, pipeline=pipeline, spark=spark).run()
    total_s = time.perf_counter() - t0
    plain_s = min(plain_first, plain_spark(spark, files, f"{root}/plain-2"))
    stages = run.stages
    compute_s = sum(v for k, v in stages.items() if k.startswith(("read", "view", "delta")))
    published = sum(run.rows.values())
    result = {
        "events": n,
        "outcome": run.outcome,
        "events_read": run.events_read,
        "duplicates": run.duplicates,
        "rows": run.rows,
        "master_written_s": round(written_s, 1),
        "end_to_end_s": round(total_s, 1),
        "end_to_end_events_per_s": round(run.events_read / total_s),
        "stages_s": stages,
        "compute_s": round(compute_s, 1),
        "plain_spark_s": round(plain_s, 1),
        "compute_overhead": round(compute_s / plain_s, 2),
        # Until the swap: the retired versions' drops come after serving has moved (reported apart).
        "publish_rows_per_s": (
            round(published / (stages["publish"] - stages.get("publish retire", 0)))
            if stages.get("publish")
            else None
        ),
        "publish_retire_s": stages.get("publish retire"),
        # The rows alone, without the DDL (new tables) and the swap (activation, drops).
        "publish_rows_only_per_s": (
            round(published / stages["publish rows"]) if stages.get("publish rows") else None
        ),
    }
    print(
        f"{n:,} events: end to end {total_s:.1f}s ({result['end_to_end_events_per_s']:,} ev/s); "
        f"compute {compute_s:.1f}s vs plain Spark {plain_s:.1f}s (x{result['compute_overhead']}); "
        f"gate {stages.get('quality gate', 0):.1f}s; publish {published:,} rows in "
        f"{stages.get('publish', 0):.1f}s ({result['publish_rows_per_s']:,} rows/s to the swap; rows alone "
        f"{result['publish_rows_only_per_s'] or 0:,} rows/s; retiring old versions "
        f"{stages.get('publish retire', 0):.1f}s)",
        flush=True,
    )
    shutil.rmtree(root, ignore_errors=True)
    return result


def write_master(master: MasterDataset, pipeline, schema: pa.Schema, n: int, *, first: int,
                 epochs: tuple[int, int], seed: int) -> float:  # fmt: skip
    """Commit ``n`` synthetic events to the master dataset, each chunk recording the offsets it read (as the
    speed job's commits do); returns seconds."""
    t0 = time.perf_counter()
    topic = pipeline.topic.name
    for i, chunk in enumerate(synthetic_master(n, schema, topic, seed, first=first, epochs=epochs)):
        lo, hi = pc.min_max(chunk.column("_offset")).values()
        ranges = {f"{topic}/{p}": [(lo.as_py(), hi.as_py() + 1)] for p in range(pipeline.topic.partitions)}
        files = write_event_files(chunk, path=master.path, event_time="updated_at", name=f"bench-{first}-{i}")
        master.commit(files, app_id="bench", batch_id=first + i, layers=pipeline.layers, ranges=ranges)
    return time.perf_counter() - t0


def offers_run(
    settings: Settings, under: str, kind: str
) -> tuple[Pipeline, Settings, pa.Schema, MasterDataset]:
    """A bench run of ``offers`` of its own: its topic, a storage root under ``under`` and a keyspace
    named for ``kind``; the master dataset's row schema and the (empty) master dataset."""
    run_id = uuid.uuid4().hex[:6]
    base = load_pipeline("offers", pipelines_dir=settings.pipelines_dir, schemas_dir=settings.schemas_dir)
    pipeline = base.model_copy(
        update={"topic": base.topic.model_copy(update={"name": f"bench-{kind}-{run_id}"})}
    )
    ensure_pipeline_topics(settings, pipeline)
    root = f"{under}/{kind}-{run_id}"
    keyspace = settings.cassandra.model_copy(update={"keyspace": f"bench_{kind}_{run_id}"})
    run_settings = settings.model_copy(update={"storage_root": root, "cassandra": keyspace})
    schema = DecodeSpec.of(pipeline, settings).output_schema
    schema = pa.schema([f for f in schema if f.name not in ERROR_FIELDS])
    master = MasterDataset(master_path(root, pipeline.name), event_time=pipeline.event.time)
    return pipeline, run_settings, schema, master


def incremental(settings: Settings, spark: SparkSession, history: int, new: int) -> dict:
    """A full run over ``history`` events, then ``new`` more events in the next two epochs and an
    incremental run over them: both timed end to end (compute, Delta, publish)."""
    pipeline, run_settings, schema, master = offers_run(settings, settings.storage_root, "inc")
    root = run_settings.storage_root
    now_epoch = int(time.time() * 1000) // EPOCH_MS
    write_master(
        master, pipeline, schema, history, first=0, epochs=(now_epoch - 52, now_epoch - 4), seed=history
    )
    t0 = time.perf_counter()
    full = BatchJob(settings=run_settings, pipeline=pipeline, spark=spark).run(horizon=now_epoch - 5)
    full_s = time.perf_counter() - t0
    write_master(
        master, pipeline, schema, new, first=history, epochs=(now_epoch - 4, now_epoch - 2), seed=new
    )
    t0 = time.perf_counter()
    inc = BatchJob(settings=run_settings, pipeline=pipeline, spark=spark).run(horizon=now_epoch - 3)
    inc_s = time.perf_counter() - t0
    assert full.kind == "full" and inc.kind == "incremental", (full.reason, inc.reason)
    result = {
        "history": history, "new": new, "full_s": round(full_s, 1), "incremental_s": round(inc_s, 1),
        "incremental_vs_full": round(inc_s / full_s, 3), "full_stages_s": full.stages,
        "incremental_stages_s": inc.stages, "rows": inc.rows, "rows_written": inc.rows_written,
        "full_rows_written": full.rows_written, "events_read": inc.events_read,
        "duplicates": inc.duplicates,
    }  # fmt: skip
    print(
        f"{history:,} events of history + {new:,} new: full run {full_s:.1f}s, incremental {inc_s:.1f}s "
        f"(x{result['incremental_vs_full']}); rows written {inc.rows_written} of {inc.rows}",
        flush=True,
    )
    shutil.rmtree(root, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, nargs="*", default=[2_000_000, 10_000_000])
    parser.add_argument(
        "--history", type=int, nargs="*", default=[10_000_000, 20_000_000],
        help="Histories for the incremental runs (each then takes --new more events).",
    )  # fmt: skip
    parser.add_argument("--new", type=int, default=500_000)
    args = parser.parse_args()
    settings = bench_settings()
    results = []
    with running(settings):
        spark = spark_session(settings, "lambdalake-bench-batch", workload="batch")
        # A small rebuild first, not reported: the nightly job meets a running Cassandra and the
        # publish should not be timed against a JVM that has just started (JIT, empty memtables).
        rebuild(settings, spark, 200_000, report=False)
        for n in args.events:
            results.append(rebuild(settings, spark, n))
        increments = [incremental(settings, spark, h, args.new) for h in args.history]
        spark.stop()
    growth = None
    if len(increments) >= 2:
        growth = round(increments[-1]["incremental_s"] / increments[0]["incremental_s"], 2)
        print(f"incremental run at {args.history[-1]:,} vs {args.history[0]:,} events of history: x{growth}")
    path = write_result(
        "batch",
        {
            "runs": results,
            "incremental": increments,
            "incremental_growth": growth,
            "targets": {
                "events_per_s": 100_000,
                "compute_overhead": 1.3,
                "publish_rows_per_s": 30_000,
                "incremental_vs_full": 0.1,
                "incremental_growth": 1.3,
            },
        },
    )
    print(f"-> {path}")


if __name__ == "__main__":
    main()
