"""Decode and validation of the speed job's archive pass, per record, outside Spark.

The function the archive pass (and replay) runs on each Kafka partition's batch,
``lambdalake.spark.decode.decoder``, timed over the same generated records: ``--events`` offers and
telemetry events, 10 % written with the pipeline's first schema version (resolved to the newest),
1 % invalid, in source batches of ``--batch`` records. No services: writer schemas are given.

    python -m bench.decode [--events 200000] [--batch 50000] [--rounds 3]

To time other code on the same records (a work tree of it that lacks this file), run this file
with that tree first on the path; ``--no-write`` leaves the results file alone:

    PYTHONPATH=../base python bench/decode.py --no-write
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import time
from pathlib import Path

import pyarrow as pa

import lambdalake
from lambdalake.avro import WireEncoder, parse_schema
from lambdalake.pipeline import configured_pipeline
from lambdalake.produce.generator import Mix, generate
from lambdalake.settings import Settings
from lambdalake.spark import decode


def source_batches(name: str, events: int, batch: int) -> tuple[object, list[pa.RecordBatch]]:
    settings = Settings(registry={"url": "http://registry.invalid:1"})
    pipeline = configured_pipeline(name, settings)
    versions = len(pipeline.schema_.versions)
    schemas = {i: pipeline.schema_text(i) for i in range(1, versions + 1)}
    encoders = {i: WireEncoder(i, parse_schema(json.loads(t))) for i, t in schemas.items()}
    fields = {i: {f["name"] for f in json.loads(t)["fields"]} for i, t in schemas.items()}
    rng = random.Random(7)
    now = time.time()
    values = []
    for record in generate(name, events, seed=11, mix=Mix(invalid=0.01), clock=lambda: now):
        version = 1 if rng.random() < 0.1 else versions
        try:
            values.append(encoders[version].encode({k: v for k, v in record.items() if k in fields[version]}))
        except (TypeError, ValueError, OverflowError):
            values.append(b"\x00\x00\x00\x00\x01garbage")  # an invalid record fastavro cannot write
    stamp = int(now * 1e6)
    batches = []
    for start in range(0, len(values), batch):
        part = values[start : start + batch]
        n = len(part)
        batches.append(
            pa.RecordBatch.from_pydict(
                {
                    "key": pa.array([b"k"] * n, pa.binary()),
                    "value": pa.array(part, pa.binary()),
                    "topic": [name] * n,
                    "partition": pa.array([0] * n, pa.int32()),
                    "offset": pa.array(range(start, start + n), pa.int64()),
                    "timestamp": pa.array([stamp] * n, pa.timestamp("us", tz="UTC")),
                    "timestampType": pa.array([1] * n, pa.int32()),
                }
            )
        )
    spec = decode.DecodeSpec.of(pipeline, settings, writer_schemas=schemas)
    return spec, batches


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print only (for another tree's code)")
    args = parser.parse_args()
    tree = Path(lambdalake.__file__).resolve().parent.parent
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True)
    result: dict = {"code": f"{tree} at {rev.stdout.strip()}", "events": args.events, "us_per_record": {}}
    for name in ("offers", "telemetry"):
        spec, batches = source_batches(name, args.events, args.batch)
        timings = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            rows = sum(b.num_rows for b in decode.decoder(spec)(iter(batches)))
            timings.append((time.perf_counter() - t0) / rows * 1e6)
        result["us_per_record"][name] = timings
        shown = ", ".join(f"{t:.2f}" for t in timings)
        print(f"{name}: {shown} us/record (median {statistics.median(timings):.2f})")
    if not args.no_write:
        from bench.common import write_result

        print("->", write_result("decode", result))


if __name__ == "__main__":
    main()
