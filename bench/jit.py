"""A small batch run as a whole process: the driver's quick JIT against the JVM's defaults.

Offers' bronze of ``--events`` synthetic events, then ``lambdalake batch run offers --full`` in a new
process per round, the two sides alternating: the default (below
:data:`lambdalake.spark.session.QUICK_JIT_EVENTS` the driver starts with C1 alone and the serial
collector) and the JVM's own JIT and collector (``spark.driver.extraJavaOptions`` set to what a run of
unknown size gets). Each round prints the process's wall time and the run's stages.

    python -m bench.jit [--events 20000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import pyarrow as pa

from bench.batch import synthetic_bronze
from bench.common import bench_settings, write_result
from lambdalake.infra.services import running
from lambdalake.kafka.admin import ensure_pipeline_topics
from lambdalake.master import bronze_of
from lambdalake.master_files import write_event_files
from lambdalake.pipeline import configured_pipeline
from lambdalake.settings import PROJECT_ROOT
from lambdalake.spark.decode import ERROR_FIELDS, DecodeSpec
from lambdalake.spark.session import driver_java_options


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    settings = bench_settings()
    rounds = []
    with running(settings):
        pipeline = configured_pipeline("offers", settings)
        ensure_pipeline_topics(settings, pipeline)
        schema = DecodeSpec.of(pipeline, settings).output_schema
        schema = pa.schema([f for f in schema if f.name not in ERROR_FIELDS])
        bronze = bronze_of(settings, pipeline)
        chunks = synthetic_bronze(args.events, schema, pipeline.topic.name, seed=args.events)
        for i, chunk in enumerate(chunks):
            files = write_event_files(chunk, path=bronze.path, event_time=pipeline.event.time, name=f"b-{i}")
            bronze.commit(files, app_id="bench-jit", batch_id=i, layers=pipeline.layers)
        full_jit = json.dumps({"spark.driver.extraJavaOptions": driver_java_options(settings, "batch")})
        sides = {"quick JIT (default)": "{}", "JVM defaults": full_jit}
        env = {**os.environ, **settings.to_env()}
        for i in range(args.rounds):
            for side, conf in sides.items():
                t0 = time.perf_counter()
                out = subprocess.run(
                    [sys.executable, "-m", "lambdalake", "batch", "run", "offers", "--full"],
                    env={**env, "LAMBDALAKE_SPARK__CONF": conf},
                    capture_output=True,
                    text=True,
                    cwd=PROJECT_ROOT,
                )
                seconds = round(time.perf_counter() - t0, 1)
                if out.returncode:
                    tail = f"{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
                    raise SystemExit(f"{side}: the batch run failed:\n{tail}")
                rounds.append({"round": i, "side": side, "seconds": seconds})
                print(f"round {i} {side}: {seconds} s", flush=True)
    path = write_result("jit", {"events": args.events, "rounds": rounds})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
