"""The lake on the object store against the local disk: a full batch run over N events of the master
dataset with its storage root on each, in one run, the order alternating by round.

Both sides share one Spark session (made for the store, so S3A is on its classpath; a local root
does not use it) and the same Cassandra; the store is the embedded s3proxy `up` starts for an
``s3://`` root, on the same disk, so the ratio is the cost of the S3 protocol and its clients
(S3A, delta-rs, pyarrow), not of a network. Each run's stages say where the time goes.

With ``--secure`` a third side keeps its lake on the disk and runs on the bench's secured services
(`lambdalake up --secure`'s: Kafka SASL_SSL, Cassandra's login over TLS, the registry's HTTPS), the
run logging in as the batch role's principal: secured against open services.

    python -m bench.lake [--events 1000000] [--rounds 2] [--secure]
"""

from __future__ import annotations

import argparse
import contextlib
import time

from bench.batch import offers_run, synthetic_master
from bench.common import bench_settings, secure_settings, store_settings, write_result
from lambdalake.batch.job import BatchJob
from lambdalake.control.resources import Resources
from lambdalake.infra.services import running
from lambdalake.master_files import write_event_files
from lambdalake.object_store import use
from lambdalake.settings import Settings
from lambdalake.spark.session import spark_session
from lambdalake.storage import delete_folder


def one_run(settings: Settings, root: str, spark, n: int) -> dict:
    """The master dataset of ``n`` synthetic events under ``root``, then a timed full batch run (on
    secured services: the admin makes the pipeline's topics, tables and grants first, as `deploy`
    does, and the run logs in as the batch role's principal)."""
    pipeline, run_settings, schema, master = offers_run(settings, root, "lake")
    if run_settings.secure:
        Resources(run_settings).make(pipeline)
        run_settings = run_settings.as_role("batch")
    t0 = time.perf_counter()
    for i, chunk in enumerate(synthetic_master(n, schema, pipeline.topic.name, seed=n)):
        files = write_event_files(chunk, path=master.path, event_time="updated_at", name=f"bench-{i}")
        master.commit(files, app_id="bench", batch_id=i, layers=pipeline.layers)
    written_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    run = BatchJob(settings=run_settings, pipeline=pipeline, spark=spark).run()
    total_s = time.perf_counter() - t0
    assert run.outcome == "published", run
    delete_folder(run_settings.storage_root)
    return {
        "master_written_s": round(written_s, 1),
        "batch_s": round(total_s, 1),
        "events_per_s": round(run.events_read / total_s),
        "stages_s": {k: round(v, 1) for k, v in run.stages.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--secure", action="store_true",
        help="a third side: the lake on the disk, Kafka, the registry and Cassandra secured as `up --secure`",
    )  # fmt: skip
    args = parser.parse_args()
    disk = bench_settings()
    store = store_settings(disk, "bench")
    secured = secure_settings(disk)
    # Each side: the settings its run starts from, and the storage root its lake goes under.
    sides = {"disk": (store, disk.storage_root), "store": (store, store.storage_root)}
    if args.secure:
        sides["secure"] = (secured, disk.storage_root)
    rounds = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(running(disk))
        stack.enter_context(running(store, only=["object-store"]))
        if args.secure:
            stack.enter_context(running(secured))
        use(store)
        spark = spark_session(store, "lambdalake-bench-lake", workload="batch", events=args.events)
        for side in sides:  # warm: JIT, each Cassandra, Python workers
            one_run(*sides[side], spark, 100_000)
        for r in range(args.rounds):
            order = list(sides)[r % len(sides) :] + list(sides)[: r % len(sides)]
            result: dict = {side: one_run(*sides[side], spark, args.events) for side in order}
            result["order"] = order
            for side in [s for s in order if s != "disk"]:
                result[f"{side}_vs_disk"] = round(result[side]["batch_s"] / result["disk"]["batch_s"], 2)
            print(
                f"round {r + 1} ({' then '.join(order)}): "
                + ", ".join(f"{side} {result[side]['batch_s']}s {result[side]['stages_s']}" for side in order)
                + "; "
                + ", ".join(f"{k} x{v}" for k, v in result.items() if k.endswith("_vs_disk")),
                flush=True,
            )
            rounds.append(result)
        spark.stop()
    path = write_result("lake", {"events": args.events, "rounds": rounds})
    print(f"-> {path}")


if __name__ == "__main__":
    main()
