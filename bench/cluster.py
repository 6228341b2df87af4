"""One node of each service against three, in one run: the same benchmarks on both, and their ratios.

For each node count (1, then 3; ``LAMBDALAKE_BENCH_NODES`` switches ``bench.common``'s settings),
in turn, each benchmark runs in its own process on services it starts and stops:

- ``bench.produce``: the producer's rate at ``acks=all`` (idempotent), events/s;
- ``bench.speed``: the speed job's freshness at ``--rate`` events/s (p50/p99 of the latest and
  windowed views) and its throughput on a burst;
- ``bench.serving``: a merged query's p99 (8 threads) and over HTTP;
- ``bench.batch``: a full batch run of ``--batch-events`` events (rebuild and publish).

On three nodes the speed job and the batch run on the Spark standalone cluster (two workers), and
every Kafka write waits for two replicas, every Cassandra read and write for two of three: on one
machine of two cores the cluster is slower, and the ratio (three over one) is the figure.

    python -m bench.cluster [--produce-events 100000] [--speed-events 100000] [--batch-events 1000000]
                            [--only produce,speed,serving,batch]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import NODES_ENV, RESULTS_ENV, write_result
from lambdalake.settings import PROJECT_ROOT


def run(module: str, args: list[str], nodes: int, folder: Path) -> float:
    """Run one benchmark on ``nodes`` nodes; returns its wall time (s)."""
    env = {**os.environ, NODES_ENV: str(nodes), RESULTS_ENV: str(folder)}
    t0 = time.monotonic()
    print(f"== {module} on {nodes} node(s) {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", module, *args], env=env, cwd=PROJECT_ROOT, check=True)
    return time.monotonic() - t0


def services_up(nodes: int) -> dict[str, Any]:
    """Start every service node (as ``lambdalake up`` does) on fresh state: seconds until all are
    healthy, and their summed resident memory once up and after 30 s idle."""
    env = {**os.environ, NODES_ENV: str(nodes)}
    code = (
        "import json, time\n"
        "from bench.common import bench_settings\n"
        "from lambdalake.infra.services import all_services, start_all, stop_all\n"
        "from lambdalake.procs import process_tree\n"
        "services = all_services(bench_settings())\n"
        "t0 = time.monotonic(); start_all(services); up_s = time.monotonic() - t0\n"
        "def rss():\n"
        "    total = 0\n"
        "    for s in services:\n"
        "        for pid in process_tree(s.proc.pid()):\n"
        "            try: total += int(open(f'/proc/{pid}/statm').read().split()[1]) * 4096\n"
        "            except OSError: pass\n"
        "    return round(total / 2**30, 2)\n"
        "at_start = rss(); time.sleep(30); idle = rss()\n"
        "stop_all(services)\n"
        "print(json.dumps({'start_s': round(up_s, 1), 'rss_gib': at_start, 'rss_gib_idle_30s': idle,"
        " 'nodes': [s.name for s in services]}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=PROJECT_ROOT, check=True,
                         capture_output=True, text=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def figures(folder: Path, ran: set[str]) -> dict[str, Any]:
    """The figures compared, from the result files of the benchmarks that ran."""

    def load(name: str) -> dict[str, Any]:
        return json.loads((folder / f"{name}.json").read_text())

    out: dict[str, Any] = {}
    if "produce" in ran:
        produce = load("produce")
        out["produce_events_per_s"] = round(produce["median_events_per_s"]["send"])
        out["produce_table_events_per_s"] = round(produce["median_events_per_s"]["batch_table"])
    if "speed" in ran:
        speed = load("speed")
        fresh = speed["freshness"]
        out["speed_events_per_s"] = round(speed["throughput_events_per_s"])
        for view in ("latest", "windowed"):
            out[f"{view}_p50_s"] = round(fresh[view]["p50_s"], 2)
            out[f"{view}_p99_s"] = round(fresh[view]["p99_s"], 2)
    if "serving" in ran:
        serving = load("serving")
        out["merged_query_p99_ms"] = serving["python"]["p99_ms"]
        out["http_query_p99_ms"] = serving["http_1_workers"]["p99_ms"]
    if "batch" in ran:
        run = load("batch")["runs"][-1]
        out["batch_events"] = run["events"]
        out["batch_s"] = run["end_to_end_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--produce-events", type=int, default=100_000)
    parser.add_argument("--speed-events", type=int, default=100_000)
    parser.add_argument("--rate", type=int, default=1000)
    parser.add_argument("--batch-events", type=int, default=1_000_000)
    parser.add_argument(
        "--only", default="produce,speed,serving,batch", help="the benchmarks to run, comma-separated"
    )
    args = parser.parse_args()
    only = set(args.only.split(","))
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        for nodes in (1, 3):
            folder = Path(tmp) / f"nodes-{nodes}"
            services = services_up(nodes)
            print(f"services on {nodes} node(s): {services}", flush=True)
            commands = {
                "produce": ("bench.produce", ["--events", str(args.produce_events), "--rounds", "1"]),
                "speed": ("bench.speed", ["--events", str(args.speed_events), "--backlog", "20000",
                                          "--rate", str(args.rate), "--seconds", "40"]),
                "serving": ("bench.serving", ["--queries", "2000", "--seconds", "10", "--replay", "20000"]),
                "batch": ("bench.batch", ["--events", str(args.batch_events), "--history"]),
            }  # fmt: skip
            walls = {name: run(*commands[name], nodes, folder) for name in commands if name in only}
            results[f"nodes_{nodes}"] = {
                "services": services,
                **figures(folder, only),
                "wall_s": {k: round(v) for k, v in walls.items()},
            }
            print(f"{nodes} node(s): {results[f'nodes_{nodes}']}", flush=True)
    one, three = results["nodes_1"], results["nodes_3"]
    results["services_three_over_one"] = {
        k: round(three["services"][k] / one["services"][k], 2)
        for k in ("start_s", "rss_gib", "rss_gib_idle_30s")
    }
    results["three_over_one"] = {
        k: round(three[k] / one[k], 2)
        for k in one
        if k not in ("services", "wall_s", "batch_events") and one[k]
    }
    print(f"three nodes over one: {results['three_over_one']}", flush=True)
    print(f"-> {write_result('cluster', results)}")


if __name__ == "__main__":
    main()
