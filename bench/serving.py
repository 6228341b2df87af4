"""Serving: merged query latency through the Python API and the HTTP API under concurrent load,
beside a raw cassandra-driver read of the same rows in the same run; and replay throughput.

Rows are written straight into Cassandra (a published batch version with its metadata row and
speed rows of three later epochs per window, for 1,000 merchants x 24 hourly windows), so the
bench measures reading and merging, not producing. Then, in this order:

- raw: the two prepared SELECTs serving issues per query (batch rows, speed rows of the key, both
  in flight at once, rows as plain tuples), run by ``--threads`` threads with the same driver
  session, no merge: the floor;
- python: ``ServingClient.query`` by the same threads;
- the same two paced and in turn: ``--rate`` calls/s in all (half each) offered by the same
  threads (open loop: latency from each call's due time), the concurrent load the targets speak
  of, below the saturation the first two show, both paths under the same load at the same moments;
- the same two at one thread (latency without queueing);
- http: ``lambdalake serve`` (1, then 2 worker processes) driven by ``bench.http_load`` in a process
  of its own at a fixed offered rate (``--rate`` requests/s) for ``--seconds``; latency counted from
  each request's scheduled start, so a server that falls behind shows it;
- replay: ``--replay`` events produced to a fresh topic, then ``Replayer.run`` over the whole range
  (bounded Kafka read, decode, master dataset commit, recompute of every closed epoch) into an empty master
  dataset (cold: the session's first jobs, as a ``lambdalake replay`` process meets them), then three times
  again (warm): events/s of each, and the seconds the new Spark session took to start (a
  ``lambdalake replay`` process pays them before its first job).

    python -m bench.serving [--threads 8] [--queries 4000] [--rate 500] [--seconds 20] [--replay 1000000]
    python -m bench.serving --replay-only --replay 2000000   # -> bench/results/replay-2000000.json
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime
from typing import Any

from bench.common import bench_settings, write_result
from lambdalake.cassandra.session import connect
from lambdalake.cassandra.tables import (
    BATCH_META,
    batch_table_def,
    create_keyspace,
    ensure_table,
    speed_table_def,
)
from lambdalake.cassandra.writer import upsert
from lambdalake.infra.services import running
from lambdalake.pipeline import configured_pipeline
from lambdalake.settings import PROJECT_ROOT, Settings

MERCHANTS = 1000
WINDOWS = 24
SPEED_EPOCHS = 3
VERSION = 1


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(latencies_s: list[float], seconds: float) -> dict[str, float]:
    return {
        "requests": len(latencies_s),
        "per_s": round(len(latencies_s) / seconds),
        "p50_ms": round(percentile(latencies_s, 0.5) * 1000, 2),
        "p99_ms": round(percentile(latencies_s, 0.99) * 1000, 2),
    }


def load_rows(settings: Settings, pipeline) -> None:
    """A published batch version and speed rows of later epochs for every merchant and hour."""
    session = connect(settings.cassandra)
    create_keyspace(session, settings.cassandra)
    view = pipeline.view("merchant_offers_hourly")
    batch, speed = batch_table_def(pipeline, view, VERSION), speed_table_def(pipeline, view)
    for table in (BATCH_META, batch, speed):
        ensure_table(session, settings.cassandra.keyspace, table)
    epoch_ms = pipeline.layers.epoch_ms
    horizon = int(time.time() * 1000) // epoch_ms - SPEED_EPOCHS - 1
    start_hour = (horizon - WINDOWS) * 3600
    rng = random.Random(1)
    batch_rows, speed_rows = [], []
    for m in range(MERCHANTS):
        key = f"merchant-{m:04d}"
        for w in range(WINDOWS):
            ws = (start_hour + w * 3600) * 1000
            n = rng.randint(1, 50)
            # The last column: the batch version that wrote the cell (serving reads the newest not above
            # the active one).
            batch_rows.append([key, ws, n, n * 1000, 100, 5000, n * 1000, n, n * 10, VERSION])
            for e in range(SPEED_EPOCHS):
                k = rng.randint(1, 5)
                speed_rows.append([key, ws, horizon + 1 + e, k, k * 900, 90, 4000, k * 900, k, k * 3])
    upsert(batch_rows, table=batch, settings=settings.cassandra)
    upsert(speed_rows, table=speed, settings=settings.cassandra)
    session.execute(
        f'INSERT INTO "{settings.cassandra.keyspace}"."{BATCH_META.name}" (pipeline, version, horizon, '
        "epoch_ms, master_version, views, published_at) VALUES (%s, %s, %s, %s, %s, %s, %s)",
        [pipeline.name, VERSION, horizon, epoch_ms, 0, '{"merchant_offers_hourly": 0}', datetime.now(UTC)],
    )


def threaded(call: Any, threads: int, queries: int) -> tuple[list[float], float]:
    """``queries`` calls of ``call(key)`` spread over ``threads`` threads: latencies and wall time."""
    latencies: list[float] = []
    lock = threading.Lock()

    def work(n: int, seed: int) -> None:
        rng = random.Random(seed)
        mine = []
        for _ in range(n):
            key = f"merchant-{rng.randrange(MERCHANTS):04d}"
            t0 = time.perf_counter()
            call(key)
            mine.append(time.perf_counter() - t0)
        with lock:
            latencies.extend(mine)

    workers = [threading.Thread(target=work, args=(queries // threads, i)) for i in range(threads)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return latencies, time.perf_counter() - t0


def paced(
    calls: dict[str, Any], threads: int, rate: int, seconds: float
) -> tuple[dict[str, list[float]], float]:
    """The ``calls`` (``call(key)`` by name) in turn, ``rate`` calls/s in all, for ``seconds`` from
    ``threads`` threads (open loop): each call has a due time and its latency counts from then, so a
    call that waits for a free thread (or the GIL) shows it instead of lowering the rate. Taking the
    paths in turn puts them under the same load at the same moments (the machine is shared)."""
    names = list(calls)
    latencies: dict[str, list[float]] = {name: [] for name in names}
    lock = threading.Lock()
    total = int(rate * seconds)
    start = time.perf_counter() + 0.05
    counter = iter(range(total))

    def work(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[tuple[str, float]] = []
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                break
            due = start + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            name = names[i % len(names)]
            calls[name](f"merchant-{rng.randrange(MERCHANTS):04d}")
            mine.append((name, time.perf_counter() - due))
        with lock:
            for name, latency in mine:
                latencies[name].append(latency)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return latencies, time.perf_counter() - start


def bench_http(settings: Settings, rate: int, seconds: float, workers: int) -> dict[str, Any]:
    """``lambdalake serve`` with ``workers`` processes, driven by bench.http_load (its own process)."""
    import json

    import httpx

    port = 24080
    env = {**os.environ, **settings.to_env(), "LAMBDALAKE_SERVING__PORT": str(port),
           "LAMBDALAKE_SERVING__WORKERS": str(workers)}  # fmt: skip
    server = subprocess.Popen([sys.executable, "-m", "lambdalake", "serve"], env=env, cwd=PROJECT_ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the serving API did not start")
            time.sleep(0.2)

        def load(rate: int, seconds: float) -> dict[str, Any]:
            out = subprocess.run(
                [sys.executable, "-m", "bench.http_load", url, "--rate", str(rate), "--seconds", str(seconds),
                 "--keys", str(MERCHANTS)],
                cwd=PROJECT_ROOT, capture_output=True, check=True, timeout=seconds * 20 + 60,
            )  # fmt: skip
            return json.loads(out.stdout)

        load(rate, 3)  # warm-up
        return {**load(rate, seconds), "workers": workers}
    finally:
        server.terminate()
        server.wait(30)


def bench_replay(settings: Settings, events: int) -> dict[str, Any]:
    """Produce ``events`` to a fresh topic, then replay the whole range into an empty master dataset."""
    from lambdalake.kafka.admin import ensure_pipeline_topics
    from lambdalake.kafka.offsets import offset_consumer, watermarks
    from lambdalake.produce.generator import Mix, generate
    from lambdalake.produce.producer import EventProducer
    from lambdalake.spark.session import spark_session
    from lambdalake.speed.replay import Replayer, plan_replay

    run = uuid.uuid4().hex[:6]
    base = configured_pipeline("telemetry", settings)
    pipeline = base.model_copy(
        update={"topic": base.topic.model_copy(update={"name": f"bench-replay-{run}"})}
    )
    root = f"{settings.storage_root}/replay-{run}"
    run_settings = settings.model_copy(update={"storage_root": root})
    ensure_pipeline_topics(run_settings, pipeline)
    producer = EventProducer(settings=run_settings, pipeline=pipeline)
    for r in generate("telemetry", events, seed=5, mix=Mix(0.02, 0.0, 0.0)):
        producer.send(r)
    assert producer.flush().unacknowledged == 0
    started = time.perf_counter()
    spark = spark_session(run_settings, "lambdalake-bench-replay", workload="replay")
    session_s = round(time.perf_counter() - started, 1)
    # The events' epoch closes an hour from now: judge "closed" as of then, as a later replay would.
    later = int(time.time() * 1000) + 2 * pipeline.layers.epoch_ms
    # And as if the speed job had read the whole topic (a replay recomputes only epochs it has passed).
    with offset_consumer(run_settings) as consumer:
        ends = {p: high for p, (_, high) in watermarks(consumer, pipeline.topic.name).items()}
    plan = plan_replay(run_settings, pipeline, from_ms=0, now_ms=later, speed_end=ends)
    from lambdalake.speed.job import SpeedJob

    SpeedJob(settings=run_settings, pipeline=pipeline, spark=spark).deploy()  # the speed tables
    runs = {}
    # First into an empty master dataset (everything archived; the session's first jobs pay the Python
    # workers' start and code generation), then the same range again three times (nothing to
    # archive: the repeat a backfill script would run, on a warm session; the first of them still
    # pays the JIT compiling the plans' hot code).
    for name in ("cold", "warm 1", "warm 2", "warm 3"):
        t0 = time.perf_counter()
        result = Replayer(settings=run_settings, pipeline=pipeline, spark=spark).run(plan)
        seconds = time.perf_counter() - t0
        runs[name] = {
            "events": plan.records, "valid": result.read, "archived": result.archived, "cells": result.cells,
            "seconds": round(seconds, 1), "events_per_s": round(plan.records / seconds),
            "stages_s": result.stages,
        }  # fmt: skip
    spark.stop()
    return {"session_start_s": session_s, **runs}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--queries", type=int, default=4000)
    parser.add_argument("--rate", type=int, default=500)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--replay", type=int, default=1_000_000)
    parser.add_argument("--replay-only", action="store_true", help="measure the replay alone")
    args = parser.parse_args()
    settings = bench_settings()
    if args.replay_only:
        with running(settings):
            replay = bench_replay(settings, args.replay)
        print(f"replay: {replay}", flush=True)
        path = write_result(f"replay-{args.replay}", {"replay": replay, "targets": {"events_per_s": 50_000}})
        print(f"-> {path}")
        return
    settings = settings.model_copy(
        update={
            "cassandra": settings.cassandra.model_copy(
                update={"keyspace": f"bench_serving_{uuid.uuid4().hex[:6]}"}
            )
        }
    )
    with running(settings):
        pipeline = configured_pipeline("offers", settings)
        load_rows(settings, pipeline)
        from lambdalake.serving import ServingClient

        client = ServingClient(settings=settings)
        session = client.session
        keyspace = settings.cassandra.keyspace
        view = pipeline.view("merchant_offers_hourly")
        window = '"window_start" >= ? AND "window_start" < ?'
        raw_batch = session.prepare(
            f'SELECT * FROM "{keyspace}"."{batch_table_def(pipeline, view, VERSION).name}" '
            f'WHERE "merchant_id" = ? AND {window}'
        )
        raw_speed = session.prepare(
            f'SELECT * FROM "{keyspace}"."{speed_table_def(pipeline, view).name}" '
            f'WHERE "merchant_id" = ? AND {window}'
        )
        bounds = [-(2**62), 2**62]

        profile = client.profile  # plain tuples, as serving reads them

        def raw(key: str) -> None:
            a = session.execute_async(raw_batch, [key, *bounds], execution_profile=profile)
            b = session.execute_async(raw_speed, [key, *bounds], execution_profile=profile)
            list(a.result()), list(b.result())

        def merged(key: str) -> None:
            client.query("offers", "merchant_offers_hourly", key)

        threaded(raw, args.threads, args.queries // 4)  # warm-up of both paths
        threaded(merged, args.threads, args.queries // 4)
        # As a serving process does after startup (lambdalake.api.http.create_app): what setup built stays
        # out of the collector's full passes, which would otherwise walk this process's bench data.
        gc.collect()
        gc.freeze()
        results: dict[str, Any] = {}
        for name, call in (("raw", raw), ("python", merged), ("raw_again", raw)):
            latencies, seconds = threaded(call, args.threads, args.queries)
            results[name] = summary(latencies, seconds)
            print(f"{name}: {results[name]}", flush=True)
        # Both paths in turn, --rate queries/s in all (half each), as Cassandra sees the HTTP run's.
        both, seconds = paced({"raw": raw, "python": merged}, args.threads, args.rate, args.seconds)
        for name, latencies in both.items():
            results[f"{name}_paced"] = {**summary(latencies, seconds), "offered_per_s": args.rate // 2}
        print(f"paced, {args.rate}/s in all: python {results['python_paced']}, raw {results['raw_paced']}",
              flush=True)  # fmt: skip
        results["python_1_thread"] = summary(*threaded(merged, 1, args.queries // 4))
        results["raw_1_thread"] = summary(*threaded(raw, 1, args.queries // 4))
        print(f"1 thread: python {results['python_1_thread']}, raw {results['raw_1_thread']}", flush=True)
        for workers in (1, 2):
            results[f"http_{workers}_workers"] = bench_http(settings, args.rate, args.seconds, workers)
            print(f"http ({workers} workers): {results[f'http_{workers}_workers']}", flush=True)
        results["replay"] = bench_replay(settings, args.replay)
        print(f"replay: {results['replay']}", flush=True)
    raw_p99 = min(results["raw"]["p99_ms"], results["raw_again"]["p99_ms"])
    results["python_p99_vs_raw"] = round(results["python"]["p99_ms"] / raw_p99, 2)
    results["python_paced_p99_vs_raw"] = round(
        results["python_paced"]["p99_ms"] / results["raw_paced"]["p99_ms"], 2
    )
    path = write_result(
        "serving",
        {
            "threads": args.threads,
            "rows": {"merchants": MERCHANTS, "windows": WINDOWS, "speed_epochs": SPEED_EPOCHS},
            **results,
            "targets": {"python_p99_vs_raw": 1.5, "python_p99_ms": 5, "http_p99_ms": 15, "http_per_s": 500,
                        "replay_events_per_s": 50_000},
        },
    )  # fmt: skip
    print(f"-> {path}")


if __name__ == "__main__":
    main()
