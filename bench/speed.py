"""Speed-layer throughput and freshness on local[2,4] (telemetry pipeline, all its queries).

The job runs as in production, in its own process (``lambdalake speed run``), so the load generator
and the probes do not share its Python interpreter.

Phases, in this order, on one job:
Freshness: events produced at a steady rate; a probe event every ``1/probe_rate`` s is looked up in
Cassandra (``speed_vehicle_latest`` and ``speed_vehicle_minute``) until visible; p50/p99 of
visible-time minus produce-time. This minute also warms every JVM (Spark's and Cassandra's JIT)
and worker, so the next phase measures a steady job, not its warm-up.
Throughput: N events are produced as fast as the producer goes, on the same cores; the rate is N
over the time from the first produce until every query has reported all of them. The job's own
rate is also given: rows over the summed duration of its micro-batches (from its log).
Backlog: the job stopped, ``--backlog`` events are produced, then the restarted job drains them
alone in micro-batches of its default size.

    python -m bench.speed [--events 300000] [--backlog 600000] [--rate 1000] [--seconds 60]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from bench.common import bench_settings, probe_freshness, write_result
from lambdalake.cassandra.session import connect
from lambdalake.infra.services import running
from lambdalake.layout import speed_status_file
from lambdalake.pipeline import configured_pipeline
from lambdalake.produce.generator import Mix, generate
from lambdalake.produce.producer import EventProducer
from lambdalake.settings import PROJECT_ROOT


def batches(log_file: Path, *, after: int) -> list[tuple[int, int]]:
    """(rows, ms) of the main query's micro-batches numbered above ``after``, from the job's log."""
    pattern = r"telemetry-main batch (\d+): (\d+) rows, lag \d+, (\d+) ms"
    found = re.finditer(pattern, log_file.read_text())
    return [(int(m[2]), int(m[3])) for m in found if int(m[1]) > after]


def rate(batches: list[tuple[int, int]]) -> float | None:
    """Rows per second over the summed duration of ``batches`` (rows, ms); None without any (the
    job's log named none after its first)."""
    ms = sum(ms for _, ms in batches)
    return sum(r for r, _ in batches) / (ms / 1000) if ms else None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=300_000)
    parser.add_argument("--backlog", type=int, default=600_000, help="events the restarted job drains alone")
    parser.add_argument("--rate", type=float, default=1000, help="events/s during the freshness run")
    parser.add_argument("--seconds", type=float, default=60, help="length of the freshness run")
    parser.add_argument("--probe-rate", type=float, default=5, help="probes/s during the freshness run")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    base = bench_settings()
    run = uuid.uuid4().hex[:6]
    settings = base.model_copy(
        update={
            "storage_root": f"{base.storage_root}/{run}",
            "cassandra": base.cassandra.model_copy(update={"keyspace": f"bench_{run}"}),
            "topic_prefix": f"bench-{run}-",
        }
    )
    with running(settings):
        p = configured_pipeline("telemetry", settings)
        producer = EventProducer(settings=settings, pipeline=p)
        status = Path(speed_status_file(settings.storage_root, "telemetry"))

        def start_job(log_file: Path, *options: str) -> subprocess.Popen[bytes]:
            command = ["speed", "run", "telemetry", "--log-level", "DEBUG", *options]
            return subprocess.Popen(
                [sys.executable, "-m", "lambdalake", *command],
                env={**os.environ, **settings.to_env()},
                stdout=log_file.open("wb"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=PROJECT_ROOT,
            )

        Path(settings.storage_root).mkdir(parents=True, exist_ok=True)
        log_file = Path(settings.storage_root) / "speed.log"
        job = start_job(log_file)

        def processed() -> dict[str, int]:
            try:
                return {q: s["rows"] for q, s in json.loads(status.read_text()).items()}
            except (OSError, ValueError):
                return {}

        def wait_processed(
            rows: int, job: subprocess.Popen[bytes], log_file: Path, *, timeout: float
        ) -> None:
            """Until the job's main query has reported ``rows`` records (failing if the job dies)."""
            deadline = time.monotonic() + timeout
            while processed().get("telemetry-main", 0) < rows:
                assert time.monotonic() < deadline and job.poll() is None, log_file.read_text()[-3000:]
                time.sleep(0.2)

        # Warm: one small batch through both queries starts Python workers and compiles plans.
        for r in generate("telemetry", 100, seed=3, mix=Mix(invalid=0)):
            producer.send(r)
        producer.flush()
        wait_processed(100, job, log_file, timeout=300)

        # --- freshness --------------------------------------------------------------------
        session = connect(settings.cassandra, keyspace=settings.cassandra.keyspace)

        def visible(view: str, vids: list[str]) -> set[str]:
            table, column = {
                "latest": ("telemetry__vehicle_latest__speed_latest", "event_time"),
                "windowed": ("telemetry__vehicle_minute__speed", "readings"),
            }[view]
            marks = ", ".join(["%s"] * len(vids))
            query = f"SELECT vehicle_id, {column} FROM {table} WHERE vehicle_id IN ({marks})"
            return {row.vehicle_id for row in session.execute(query, vids)}

        fresh = probe_freshness(
            producer,
            generate("telemetry", int(args.rate * args.seconds), seed=2, mix=Mix(invalid=0, duplicates=0)),
            rate=args.rate,
            probe_rate=args.probe_rate,
            probe=lambda i, r: (
                f"probe-{run}-{i}",
                {**r, "vehicle_id": f"probe-{run}-{i}", "event_time": int(time.time() * 1000)},
            ),
            visible=visible,
            views=["latest", "windowed"],
        )

        # The freshness run warmed every JVM (Spark's, Cassandra's) and worker: now the throughput.
        wait_processed(producer.stats.sent, job, log_file, timeout=300)
        base = processed()
        warm_batch = json.loads(status.read_text())["telemetry-main"]["last_batch"]["batch_id"]

        # --- throughput -------------------------------------------------------------------
        records = list(generate("telemetry", args.events, seed=1, mix=Mix()))
        sent_before = producer.stats.sent
        t0 = time.perf_counter()
        for r in records:
            producer.send(r)
        assert producer.flush().unacknowledged == 0
        produced_s = time.perf_counter() - t0
        on_topic = producer.stats.sent - sent_before  # invalid events went to the DLQ, not the topic
        while min(processed()[q] - base[q] for q in base) < on_topic:
            assert job.poll() is None, log_file.read_text()[-3000:]
            time.sleep(0.1)
        drain_s = time.perf_counter() - t0
        throughput = args.events / drain_s
        # The job's own rate: rows over the time its micro-batches ran (the log's per-batch lines),
        # i.e. without the wait for the first records and the idle time between triggers.
        busy = batches(log_file, after=warm_batch)
        busy_rate = rate(busy)
        print(
            f"throughput: {args.events:,} events in {drain_s:.1f}s = {throughput:,.0f} events/s "
            f"(producing took {produced_s:.1f}s); while its batches ran: {busy_rate or 0:,.0f} rows/s "
            f"({len(busy)} batches: {[r for r, _ in busy]})"
        )

        job.send_signal(signal.SIGTERM)
        job.wait(120)

        # --- the job alone on a backlog ---------------------------------------------------
        # The job stopped, N events wait on the topic, the job restarts and drains them with the
        # cores to itself, in micro-batches of its default size (200k records at most). The first
        # batch after a restart also starts Python workers, compiles and loads state, so the
        # sustained rate is the later batches'.
        status.unlink()
        sent_before = producer.stats.sent
        for r in generate("telemetry", args.backlog, seed=4, mix=Mix()):
            producer.send(r)
        assert producer.flush().unacknowledged == 0
        backlog = producer.stats.sent - sent_before
        log_file = Path(settings.storage_root) / "speed-backlog.log"
        job = start_job(log_file)
        wait_processed(backlog, job, log_file, timeout=600)
        job.send_signal(signal.SIGTERM)
        job.wait(120)
        drained = batches(log_file, after=-1)
        backlog_rate = rate(drained[1:])
        print(
            f"backlog: {backlog:,} records; the restarted job alone sustained {backlog_rate:,.0f} rows/s "
            if backlog_rate is not None
            else f"backlog: {backlog:,} records, drained in one batch "
            f"after its first batch (batches as (rows, ms): {drained})"
        )
    for k, f in fresh.items():
        print(f"freshness {k}: p50 {f['p50_s']:.2f}s p99 {f['p99_s']:.2f}s over {f['probes']} probes")
    path = write_result(
        "speed",
        {
            "events": args.events,
            "throughput_events_per_s": throughput,
            "drain_seconds": drain_s,
            "busy_rows_per_s": busy_rate,
            "busy_batches": [{"rows": r, "ms": ms} for r, ms in busy],
            "backlog_rows_per_s": backlog_rate,
            "backlog_batches": [{"rows": r, "ms": ms} for r, ms in drained],
            "freshness_rate_events_per_s": args.rate,
            "freshness": fresh,
            "targets": {"events_per_s": 30_000, "freshness_p50_s": 2, "freshness_p99_s": 5},
        },
    )
    print(f"-> {path}")


if __name__ == "__main__":
    main()
