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

from infra.services import all_services
from lambdalake.pipeline import Pipeline, load_pipeline
from lambdalake.settings import PROJECT_ROOT, Settings

TEST_PORTS = {"broker": 19092, "registry": 18081, "cassandra": 19042, "storage": 17000}


def settings_for(state_dir: Path, ports: dict[str, int] = TEST_PORTS) -> Settings:
    return Settings(
        kafka={"bootstrap_servers": f"127.0.0.1:{ports['broker']}"},
        registry={"url": f"http://127.0.0.1:{ports['registry']}"},
        cassandra={
            "contact_points": ["127.0.0.1"],
            "port": ports["cassandra"],
            "storage_port": ports["storage"],
            "keyspace": "lambdalake_test",
        },
        state_dir=state_dir,
        storage_root=str(state_dir / "storage"),
    )


def env_for(settings: Settings) -> dict[str, str]:
    """Environment that points the CLI at ``settings``' services."""
    return {
        **os.environ,
        "LAMBDALAKE_KAFKA__BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers,
        "LAMBDALAKE_REGISTRY__URL": settings.registry.url,
        "LAMBDALAKE_CASSANDRA__PORT": str(settings.cassandra.port),
        "LAMBDALAKE_CASSANDRA__STORAGE_PORT": str(settings.cassandra.storage_port),
        "LAMBDALAKE_CASSANDRA__KEYSPACE": settings.cassandra.keyspace,
        "LAMBDALAKE_STATE_DIR": str(settings.state_dir),
        "LAMBDALAKE_STORAGE_ROOT": settings.storage_root,
        "COLUMNS": "200",
    }


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
    started = all_services(settings)
    try:
        for service in started:
            service.start()
        yield settings
    finally:
        for service in reversed(started):
            service.stop()


@pytest.fixture
def unique() -> str:
    return uuid.uuid4().hex[:8]


def pipeline_named(settings: Settings, name: str, *, topic: str | None = None) -> Pipeline:
    """A pipeline definition, optionally on its own topic so tests do not share records."""
    p = load_pipeline(name, pipelines_dir=settings.pipelines_dir, schemas_dir=settings.schemas_dir)
    if topic is not None:
        p = p.model_copy(update={"topic": p.topic.model_copy(update={"name": topic})})
    return p
