"""The driver JVM's options follow the workload and its size; clusters elsewhere keep the JVM's defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from lambdalake.settings import Settings
from lambdalake.spark.session import QUICK_JIT_EVENTS, driver_java_options, executor_java_options

QUICK = "-XX:TieredStopAtLevel=1"


@pytest.mark.parametrize("workload", ["batch", "replay"])
def test_a_small_local_batch_or_replay_starts_with_the_quick_jit(tmp_path: Path, workload: str) -> None:
    local = Settings(cache_dir=tmp_path)
    small = driver_java_options(local, workload, events=QUICK_JIT_EVENTS - 1)  # type: ignore[arg-type]
    assert QUICK in small.split() and "-XX:+UseSerialGC" in small.split()
    for events in (QUICK_JIT_EVENTS, None):  # large, or of unknown size: the full JIT
        assert QUICK not in driver_java_options(local, workload, events=events).split()  # type: ignore[arg-type]
    cluster = local.model_copy(update={"spark": local.spark.model_copy(update={"master": "spark://m:7077"})})
    assert QUICK not in driver_java_options(cluster, workload, events=10).split()  # type: ignore[arg-type]


def test_the_stream_keeps_its_options_whatever_the_size(tmp_path: Path) -> None:
    local = Settings(cache_dir=tmp_path)
    assert driver_java_options(local, "stream") == driver_java_options(local, "stream", events=10)
    assert QUICK in driver_java_options(local, "stream").split()


def test_a_standalone_master_on_this_machine_counts_as_local(tmp_path: Path) -> None:
    """`lambdalake up --nodes 3`'s master shares this machine's cores with the driver: the driver
    compiles as a local one does; a master elsewhere keeps the JVM's defaults."""
    settings = Settings(cache_dir=tmp_path)
    for master, quick in (("spark://127.0.0.1:7077", True), ("spark://localhost:7077", True),
                          ("spark://spark-master:7077", False), ("k8s://https://k:443", False)):  # fmt: skip
        here = settings.model_copy(update={"spark": settings.spark.model_copy(update={"master": master})})
        assert (QUICK in driver_java_options(here, "stream").split()) is quick, master
        # Its executors too (a local master's tasks run in the driver: nothing of their own).
        executors = executor_java_options(here, "stream")
        assert (QUICK in (executors or "").split()) is quick, master
        assert executors is None or ("log4j" not in executors and "SharedArchive" not in executors)
    assert executor_java_options(settings, "stream") is None  # local[...]


def test_executors_on_this_machine_follow_the_workload(tmp_path: Path) -> None:
    """A standalone master on loopback: a small batch's executors start with the quick JIT, a large
    replay's with the throughput collector, a large batch's with the JVM's defaults (no option set)."""
    spark = {"master": "spark://127.0.0.1:7077"}
    here = Settings(cache_dir=tmp_path, spark=spark)
    small = (executor_java_options(here, "batch", events=10) or "").split()
    assert QUICK in small and "-XX:+UseSerialGC" in small, small
    assert executor_java_options(here, "replay", events=QUICK_JIT_EVENTS) == "-XX:+UseParallelGC"
    assert executor_java_options(here, "batch", events=None) is None
