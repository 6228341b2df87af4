"""Benchmark scaffolding: an own set of embedded services on bench ports, results to bench/results/."""

from __future__ import annotations

import json
import os
import platform
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from lambdalake import secure
from lambdalake.infra.services import all_services
from lambdalake.settings import PROJECT_ROOT, Settings

RESULTS = PROJECT_ROOT / "bench" / "results"
# Below the kernel's ephemeral range (32768+), where Spark's and clients' random ports could take them.
BENCH_PORTS = {"broker": 24092, "registry": 24081, "cassandra": 24042, "storage": 24000}
#: The bench's secured services (`lambdalake up --secure`'s: SASL_SSL with SCRAM-SHA-512 and ACLs,
#: Cassandra's login over TLS, the registry's HTTPS with basic auth), beside the open ones.
SECURE_PORTS = {"broker": 25092, "registry": 25081, "cassandra": 25042, "storage": 25000}
#: The bench's object store: the embedded s3proxy `up` starts for an ``s3://`` root (on the same
#: disk: the cost of the S3 protocol and its clients, not of a network).
STORE_BUCKET = "lake-bench"
STORE_ENDPOINT = "http://127.0.0.1:24900"


#: ``LAMBDALAKE_BENCH_NODES=3``: every bench runs on three nodes of each service (``lambdalake up
#: --nodes 3`` on the bench ports: three brokers, three Cassandra nodes, a Spark standalone master
#: with two workers), as ``bench.cluster`` does beside the one-node services.
NODES_ENV = "LAMBDALAKE_BENCH_NODES"
#: Where :func:`write_result` writes instead of ``bench/results`` (``bench.cluster``'s runs).
RESULTS_ENV = "LAMBDALAKE_BENCH_RESULTS"


def bench_settings(*, fresh: bool = True) -> Settings:
    """Settings of the bench services; ``fresh`` wipes their state first when none of them runs (the
    embedded broker keeps every record of earlier runs in memory, which would slow later runs)."""
    nodes = int(os.environ.get(NODES_ENV) or 1)
    state = PROJECT_ROOT / ".lambdalake" / ("bench" if nodes == 1 else f"bench-{nodes}")
    hosts = [f"127.0.0.{i}" for i in range(1, nodes + 1)]
    settings = Settings(
        kafka={"bootstrap_servers": ",".join(f"{h}:{BENCH_PORTS['broker']}" for h in hosts)},
        registry={"url": f"http://127.0.0.1:{BENCH_PORTS['registry']}"},
        cassandra={"contact_points": hosts, "port": BENCH_PORTS["cassandra"],
                   "storage_port": BENCH_PORTS["storage"], "keyspace": "lambdalake_bench"},
        **({"nodes": nodes, "spark": {"master": "spark://127.0.0.1:24077"}} if nodes > 1 else {}),
        state_dir=state,
        storage_root=str(state / "storage"),
    )  # fmt: skip
    if fresh and not any(service.proc.pid() for service in all_services(settings)):
        shutil.rmtree(state, ignore_errors=True)
    return settings


def store_settings(base: Settings, prefix: str) -> Settings:
    """``base`` with its lake under ``s3://<the bench's bucket>/<prefix>`` on the bench's store."""
    return base.model_copy(
        update={
            "storage_root": f"s3://{STORE_BUCKET}/{prefix}",
            "object_store": base.object_store.model_copy(update={"endpoint": STORE_ENDPOINT}),
        }
    )


def secure_settings(base: Settings) -> Settings:
    """Settings of the bench's secured services (a state folder of their own beside ``base``'s),
    recording the principals `up --secure` makes the first time."""
    state = base.state_dir.parent / "bench-secure"
    if not secure.recorded(state):
        shutil.rmtree(state, ignore_errors=True)
        secure.ensure_principals(state)
    return Settings(
        kafka={"bootstrap_servers": f"127.0.0.1:{SECURE_PORTS['broker']}"},
        registry={"url": f"https://127.0.0.1:{SECURE_PORTS['registry']}"},
        cassandra={"contact_points": ["127.0.0.1"], "port": SECURE_PORTS["cassandra"],
                   "storage_port": SECURE_PORTS["storage"], "keyspace": "lambdalake_bench"},
        state_dir=state,
        storage_root=str(state / "storage"),
    )  # fmt: skip


def write_result(name: str, result: dict) -> Path:
    folder = Path(os.environ.get(RESULTS_ENV) or RESULTS)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    result = {
        "benchmark": name,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        **result,
    }
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def probe_freshness(
    producer: Any,
    stream: Iterable[dict],
    *,
    rate: float,
    probe_rate: float,
    probe: Callable[[int, dict], tuple[str, dict]],
    visible: Callable[[str, list[str]], set[str]],
    views: list[str],
) -> dict[str, dict[str, float]]:
    """Sends ``stream`` through ``producer`` at ``rate``/s with a probe every ``1/probe_rate`` s, and
    per view the p50/p99 seconds from a probe's produce call until ``visible(view, keys)`` finds it.

    Args:
        probe: ``(i, record) -> (key, probe record)``: a record only the probe's key leads to.
        visible: The keys among those asked that a view shows now.
        views: The views to watch; a probe counts once every one shows it.
    """
    probes: list[tuple[str, float]] = []
    results: dict[str, list[float]] = {v: [] for v in views}
    stop = threading.Event()

    def watch() -> None:
        pending: dict[str, dict[str, Any]] = {}
        while not stop.is_set() or pending:
            while probes:
                key, t = probes.pop(0)
                pending[key] = {"t": t, **dict.fromkeys(views)}
            for view in views:
                waiting = [k for k, s in pending.items() if s[view] is None]
                if waiting:
                    seen = visible(view, waiting)
                    now = time.perf_counter()
                    for k in seen:
                        pending[k][view] = now - pending[k]["t"]
            now = time.perf_counter()
            for k, s in list(pending.items()):
                if all(s[v] is not None for v in views):
                    for v in views:
                        results[v].append(s[v])
                    del pending[k]
                elif now - s["t"] > 120:
                    del pending[k]
            # A query per view every 50 ms whatever the number of probes in flight: the watcher must
            # not become the load it measures.
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    next_probe = t0
    for i, record in enumerate(stream):
        if time.perf_counter() >= next_probe:
            key, special = probe(i, record)
            producer.send(special)
            producer.poll(0)
            producer._producer.flush(5)  # the probe leaves now, not after linger
            probes.append((key, time.perf_counter()))
            next_probe += 1 / probe_rate
        producer.send(record)
        ahead = (i + 1) / rate - (time.perf_counter() - t0)
        if ahead > 0:
            producer.poll(ahead)
    producer.flush()
    stop.set()
    watcher.join(180)
    return {
        v: {"p50_s": percentile(r, 0.5), "p99_s": percentile(r, 0.99), "probes": len(r)}
        for v, r in results.items()
        if r
    }
