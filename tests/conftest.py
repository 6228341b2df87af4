"""Shared fixtures: one set of real embedded services per test session, on ports of its own.

The services run in a temporary state folder on non-default ports, so a developer's own
``lambdalake up`` on the conventional ports is not disturbed and never interferes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from lambdalake.infra.services import running
from lambdalake.pipeline import LayersSpec, Pipeline, configured_pipeline
from lambdalake.settings import PROJECT_ROOT, QUICK_JIT, Settings

if os.environ.get("PYTEST_XDIST_WORKER") is not None:
    # An xdist worker's __main__ is execnet's, without a file: pyspark.sql.connect (which Great
    # Expectations imports) takes such a process for a doctest run and exits it.
    main = sys.modules["__main__"]
    if getattr(main, "__spec__", None) is None and not hasattr(main, "__file__"):
        main.__file__ = "<pytest-xdist worker>"


def _worker() -> int:
    """The pytest-xdist worker's number (``gw0``, ``gw1``, ...; 0 without xdist)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)


#: ``LAMBDALAKE_TEST_PORT_OFFSET`` moves them all (a second suite beside a running one); each
#: pytest-xdist worker runs services of its own, 1000 ports further on.
_OFFSET = int(os.environ.get("LAMBDALAKE_TEST_PORT_OFFSET", "0")) + 1000 * _worker()


def port(base: int) -> int:
    """A port of this test process's own (every fixed port a test listens on goes through it)."""
    return base + _OFFSET


TEST_PORTS = {
    name: port(base)
    for name, base in {"broker": 19092, "registry": 18081, "cassandra": 19042, "storage": 17000}.items()
}


#: The slowest files first (seconds each, measured alone in one process), so that workers taking
#: whole files in turn end together instead of one waiting on a long last file.
_SLOW_FILES = (
    "test_cluster.py",  # ~1,700 s in the suite: three nodes of each, one speed job, the 10-minute soak
    "test_view_versions.py",  # 509 s
    "test_exactness.py",  # 320
    "test_incremental_batch.py",  # 294
    "test_speed.py",  # 288
    "test_user_pipeline.py",  # 285
    "test_broker_faults.py",  # 265
    "test_speed_faults.py",  # 263
    "test_batch.py",  # 260
    "test_secure.py",  # 330: the services secured, a pipeline run by each role's principal
    "test_serving.py",  # 206
    "test_replay.py",  # 175
    "test_realtime.py",  # 136
    "test_restart_one.py",  # 140
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A stable sort: tests keep their order within a file, and the other files theirs.
    rank = {name: i for i, name in enumerate(_SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def settings_for(state_dir: Path, ports: dict[str, int] = TEST_PORTS) -> Settings:
    # The services' JVMs compile with C1 alone: they are short-lived and lightly loaded here, and
    # C2's compiler threads took their CPU from the tests on two cores (BENCHMARKS.md).
    return Settings(
        kafka={"bootstrap_servers": f"127.0.0.1:{ports['broker']}", "jvm_options": QUICK_JIT},
        registry={"url": f"http://127.0.0.1:{ports['registry']}"},
        cassandra={
            "contact_points": ["127.0.0.1"],
            "port": ports["cassandra"],
            "storage_port": ports["storage"],
            "keyspace": "lambdalake_test",
            # A writer killed with -9 on this machine is replaced at once; the TTL is what a renewal
            # may be late by (an LWT on two loaded cores has taken more than 6 s).
            "lease_ttl_s": 15,
            "jvm_options": QUICK_JIT,
            # 1 GB, not the 3 GB default: the tests' tables are small, and three workers' nodes at 3.5 GB
            # resident each, beside the three-node cluster, ran a 24 GiB machine out of memory (the
            # kernel killed a worker's node; docs/benchmarks-log.md).
            "heap": "1G",
        },
        serving={"port": port(18080)},
        # Deployed speed jobs 2 s apart: back to back, a job under a test's trickling producer kept a
        # core busy (a micro-batch costs ~1 s of CPU however few its records), on two cores shared by
        # three workers. The tests' waits are for answers, never for a micro-batch count.
        speed={"trigger_s": 2},
        state_dir=state_dir,
        storage_root=str(state_dir / "storage"),
    )


def env_for(settings: Settings) -> dict[str, str]:
    """Environment that points the CLI at ``settings``' services."""
    return {**os.environ, **settings.to_env(), "COLUMNS": "200"}


def run_cli(
    settings: Settings, *args: str, input: bytes | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lambdalake", *args],
        env=env_for(settings),
        input=input,
        capture_output=True,
        timeout=timeout,
        cwd=PROJECT_ROOT,
    )


@pytest.fixture(scope="session")
def settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    return settings_for(tmp_path_factory.mktemp("lambdalake-state"))


@pytest.fixture(scope="session")
def services(settings: Settings) -> Iterator[Settings]:
    """Broker, registry and Cassandra, started once for the session and stopped at its end."""
    with running(settings):
        yield settings


@pytest.fixture
def unique() -> str:
    return uuid.uuid4().hex[:8]


def pipeline_named(
    settings: Settings, name: str, *, topic: str | None = None, epoch: str | None = None, **layers: str
) -> Pipeline:
    """A pipeline definition, optionally on its own topic so tests do not share records, and with
    other ``[layers]`` (short epochs, so a test of a few minutes spans several ingest epochs)."""
    p = configured_pipeline(name, settings)
    if topic is not None:
        p = p.model_copy(update={"topic": p.topic.model_copy(update={"name": topic})})
    if epoch is not None:
        layers["epoch"] = epoch
    if layers:
        p = p.model_copy(update={"layers": LayersSpec.model_validate({**p.layers.model_dump(), **layers})})
    return p


def isolated(settings: Settings, tmp_path: Path, unique: str) -> Settings:
    """The session's services with a storage root and keyspace of the test's own."""
    cassandra = settings.cassandra.model_copy(update={"keyspace": f"t_{unique}"})
    return settings.model_copy(
        update={
            "storage_root": str(tmp_path / "storage"),
            "cassandra": cassandra,
        }
    )


#: Task slots the session's Spark gets beyond local[2] when the latest views run as Real-time
#: queries (``LAMBDALAKE_SPEED__LATEST=realtime``, ``make test-realtime``): one in-process speed
#: job's Real-time query holds a slot per partition of its topic (2-3 here) while it runs.
REALTIME_SLOTS = 4


@pytest.fixture(scope="session")
def spark(services: Settings):
    """One local[2,4] Spark session for the test session (7-10 s to start)."""
    from lambdalake.spark.session import spark_session

    extra = REALTIME_SLOTS if services.speed.latest == "realtime" else 0
    session = spark_session(services, "lambdalake-tests", extra_slots=extra)
    yield session
    session.stop()
