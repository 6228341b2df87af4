"""Benchmark scaffolding: an own set of embedded services on bench ports, results to bench/results/."""

from __future__ import annotations

import json
import os
import platform
import shutil
import time
from pathlib import Path

from infra.services import all_services
from lambdalake.settings import PROJECT_ROOT, Settings

RESULTS = PROJECT_ROOT / "bench" / "results"
# Below the kernel's ephemeral range (32768+), where Spark's and clients' random ports could take them.
BENCH_PORTS = {"broker": 24092, "registry": 24081, "cassandra": 24042, "storage": 24000}


def bench_settings(*, fresh: bool = True) -> Settings:
    """Settings of the bench services; ``fresh`` wipes their state first when none of them runs (the
    embedded broker keeps every record of earlier runs in memory, which would slow later runs)."""
    state = PROJECT_ROOT / ".lambdalake" / "bench"
    settings = Settings(
        kafka={"bootstrap_servers": f"127.0.0.1:{BENCH_PORTS['broker']}"},
        registry={"url": f"http://127.0.0.1:{BENCH_PORTS['registry']}"},
        cassandra={"port": BENCH_PORTS["cassandra"], "storage_port": BENCH_PORTS["storage"],
                   "keyspace": "lambdalake_bench"},
        state_dir=state,
        storage_root=str(state / "storage"),
    )  # fmt: skip
    if fresh and not any(service.proc.pid() for service in all_services(settings)):
        shutil.rmtree(state, ignore_errors=True)
    return settings


def write_result(name: str, result: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    result = {
        "benchmark": name,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        **result,
    }
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
