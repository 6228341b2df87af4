"""What sketch aggregates cost against plain ones, in one run: a windowed view with a ``distinct``
and a ``quantiles`` aggregate against the same view (key, window) with ``count`` and ``sum`` only.

Two pipelines, copies of ``offers`` whose only view is ``merchant_hourly`` (per merchant and hour):

- ``plain``: ``count``, ``sum`` of ``price_cents``;
- ``sketch``: ``distinct`` of ``offer_id`` (HLL, lg_k 12), ``quantiles`` of ``price_cents`` (KLL, k 200).

Batch: a synthetic master dataset of ``--events`` events per pipeline (``bench.batch``'s: 500 merchants, 400
offers each, over 46 closed hours), then ``--rounds`` full batch runs of each, alternating; the view
stage (the aggregation, cached input) and the whole run are timed.
Speed: ``--speed-events`` generated offers sent to each pipeline's topic, then ``lambdalake speed run
<p> --once`` on a fresh checkpoint, alternating; the job's own rate (rows over its micro-batches'
summed durations, from its log) and the whole process are timed.
Serving: after the last runs, ``--queries`` merged answers per pipeline (every window of a merchant,
batch and speed rows; the Python API, one thread), alternating; p50 and p99.

    python -m bench.sketches [--events 2000000] [--speed-events 200000] [--rounds 2] [--queries 2000]
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pyarrow as pa

from bench.batch import synthetic_master
from bench.common import bench_settings, percentile, write_result
from lambdalake.batch.job import BatchJob
from lambdalake.infra.services import running
from lambdalake.kafka.admin import ensure_pipeline_topics
from lambdalake.layout import master_path
from lambdalake.master import MasterDataset
from lambdalake.master_files import write_event_files
from lambdalake.pipeline import configured_pipeline
from lambdalake.produce.generator import Mix, generate
from lambdalake.produce.producer import EventProducer
from lambdalake.settings import PROJECT_ROOT, Settings
from lambdalake.spark.decode import ERROR_FIELDS, DecodeSpec
from lambdalake.spark.session import spark_session

AGGREGATES = {
    "plain": """  { name = "updates", fn = "count" },
  { name = "price_sum", fn = "sum", column = "price_cents" },""",
    "sketch": """  { name = "offers", fn = "distinct", column = "offer_id" },
  { name = "price", fn = "quantiles", column = "price_cents" },""",
}


def write_pipelines(settings: Settings, folder: Path, run: str) -> Settings:
    """``plain`` and ``sketch``: offers with ``merchant_hourly`` as their only view."""
    folder.mkdir(parents=True, exist_ok=True)
    shipped = (settings.pipelines_dir / "offers.toml").read_text()
    head = shipped[: shipped.index("[[views]]")]
    for name, aggregates in AGGREGATES.items():
        text = head.replace('name = "offers"', f'name = "{name}"', 1)
        text = re.sub(r'(\[topic\]\s*\nname = )"[^"]*"', rf'\1"bench-sk-{run}-{name}"', text, count=1)
        text += (
            '[[views]]\nname = "merchant_hourly"\nkind = "windowed"\nkey = ["merchant_id"]\n'
            f'window = "1 hour"\naggregates = [\n{aggregates}\n]\n'
        )
        (folder / f"{name}.toml").write_text(text)
    return settings.model_copy(update={"pipelines_dir": folder})


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=2_000_000)
    parser.add_argument("--speed-events", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--queries", type=int, default=2000)
    args = parser.parse_args()
    run = uuid.uuid4().hex[:6]
    base = bench_settings()
    root = f"{base.storage_root}/sketches-{run}"
    settings = write_pipelines(base, Path(root) / "pipelines", run)
    roots = {
        name: settings.model_copy(
            update={
                "storage_root": f"{root}/{name}",
                "cassandra": settings.cassandra.model_copy(update={"keyspace": f"bench_sk_{run}_{name}"}),
            }
        )
        for name in AGGREGATES
    }
    batch: dict[str, list[dict]] = {n: [] for n in AGGREGATES}
    speed: dict[str, list[dict]] = {n: [] for n in AGGREGATES}
    serving: dict[str, list[float]] = {n: [] for n in AGGREGATES}
    with running(settings):
        pipelines = {n: configured_pipeline(n, roots[n]) for n in AGGREGATES}
        for name, p in pipelines.items():
            ensure_pipeline_topics(roots[name], p)
            schema = DecodeSpec.of(p, roots[name]).output_schema
            schema = pa.schema([f for f in schema if f.name not in ERROR_FIELDS])
            master = MasterDataset(master_path(roots[name].storage_root, p.name), event_time=p.event.time)
            for i, chunk in enumerate(synthetic_master(args.events, schema, f"synthetic-{run}", seed=7)):
                files = write_event_files(chunk, path=master.path, event_time="updated_at", name=f"b-{i}")
                master.commit(files, app_id="bench", batch_id=i, layers=p.layers)
            producer = EventProducer(settings=roots[name], pipeline=p)
            for record in generate("offers", args.speed_events, seed=5, mix=Mix(invalid=0, duplicates=0)):
                producer.send(record)
            producer.flush()

        spark = spark_session(settings, "lambdalake-bench-sketches", workload="batch")
        for name in AGGREGATES:  # warm-up, not reported
            BatchJob(settings=roots[name], pipeline=pipelines[name], spark=spark).run(full=True)
        for r in range(args.rounds):
            order = list(AGGREGATES) if r % 2 == 0 else list(reversed(AGGREGATES))
            for name in order:
                t0 = time.perf_counter()
                result = BatchJob(settings=roots[name], pipeline=pipelines[name], spark=spark).run(full=True)
                total = time.perf_counter() - t0
                view_s = result.stages["view merchant_hourly"]
                batch[name].append({"end_to_end_s": round(total, 2), "view_s": round(view_s, 2)})
                print(f"batch {name}: end to end {total:.1f}s, view {view_s:.2f}s", flush=True)
        spark.stop()

        for r in range(args.rounds):
            order = list(AGGREGATES) if r % 2 == 0 else list(reversed(AGGREGATES))
            for name in order:
                fresh = roots[name].model_copy(update={"storage_root": f"{root}/{name}-speed-{r}"})
                speed[name].append(speed_run(fresh, name))
                print(f"speed {name}: {speed[name][-1]}", flush=True)

        from lambdalake.serving import ServingClient

        clients = {n: ServingClient(settings=roots[n]) for n in AGGREGATES}
        merchants = [f"merchant-{k:04d}" for k in range(500)]
        rng = random.Random(1)
        for name in AGGREGATES:  # warm: prepared statements, the driver's pools
            clients[name].query(name, "merchant_hourly", merchants[0])
        for _ in range(args.queries):
            key = rng.choice(merchants)
            for name in AGGREGATES:
                t0 = time.perf_counter()
                answer = clients[name].query(name, "merchant_hourly", key)
                serving[name].append(time.perf_counter() - t0)
                assert answer.windows, (name, key)
    summary = summarize(batch, speed, serving)
    print(summary, flush=True)
    path = write_result("sketches", {"batch": batch, "speed": speed, "summary": summary})
    print(f"-> {path}")
    shutil.rmtree(root, ignore_errors=True)


def speed_run(settings: Settings, name: str) -> dict:
    """``speed run <name> --once`` in its own process: the whole process and the job's own rate."""
    Path(settings.storage_root).mkdir(parents=True, exist_ok=True)
    log_file = Path(settings.storage_root) / "speed.log"
    t0 = time.perf_counter()
    with log_file.open("wb") as out:
        subprocess.run(
            [sys.executable, "-m", "lambdalake", "speed", "run", name, "--once", "--log-level", "DEBUG"],
            env={**os.environ, **settings.to_env()}, stdout=out, stderr=subprocess.STDOUT, cwd=PROJECT_ROOT,
            check=True,
        )  # fmt: skip
    total = time.perf_counter() - t0
    found = re.findall(rf"{name}-main batch \d+: (\d+) rows, lag \d+, (\d+) ms", log_file.read_text())
    rows, ms = sum(int(r) for r, _ in found), sum(int(m) for _, m in found)
    return {"process_s": round(total, 2), "rows": rows, "batches_s": round(ms / 1000, 2),
            "rows_per_s": round(rows / (ms / 1000)) if ms else None}  # fmt: skip


def summarize(batch: dict, speed: dict, serving: dict) -> dict:
    def mean(rows: list[dict], key: str) -> float:
        return sum(r[key] for r in rows) / len(rows)

    out = {
        "batch_view_ratio": round(mean(batch["sketch"], "view_s") / mean(batch["plain"], "view_s"), 2),
        "batch_run_ratio": round(
            mean(batch["sketch"], "end_to_end_s") / mean(batch["plain"], "end_to_end_s"), 2
        ),
        "speed_batches_ratio": round(
            mean(speed["sketch"], "batches_s") / mean(speed["plain"], "batches_s"), 2
        ),
        "speed_process_ratio": round(
            mean(speed["sketch"], "process_s") / mean(speed["plain"], "process_s"), 2
        ),
        "serving": {
            n: {"p50": round(percentile(v, 0.5) * 1000, 2), "p99": round(percentile(v, 0.99) * 1000, 2)}
            for n, v in serving.items()
        },
    }
    out["serving_p99_ratio"] = round(out["serving"]["sketch"]["p99"] / out["serving"]["plain"]["p99"], 2)
    return out


if __name__ == "__main__":
    main()
