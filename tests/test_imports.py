"""Serving's building blocks import without Spark."""

from __future__ import annotations

import subprocess
import sys

from lambdalake.settings import PROJECT_ROOT


def test_table_definitions_and_views_do_not_import_pyspark() -> None:
    code = (
        "import sys, lambdalake.cassandra.tables, lambdalake.cassandra.writer, lambdalake.views, "
        "lambdalake.event_schema; print('pyspark' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=PROJECT_ROOT, check=True
    )
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_the_speed_tasks_import_neither_the_registry_client_nor_delta_rs() -> None:
    """Measured in each Python worker: confluent-kafka's registry client 18 MB and 0.2-0.5 s of CPU,
    delta-rs 17 MB (the tasks write Parquet files; the driver commits them)."""
    code = (
        "import sys, lambdalake.speed.sinks\n"
        "from lambdalake.spark import decode\n"
        "from lambdalake.writer_schemas import RegistryUnavailable\n"
        "decode.REGISTRY_PATIENCE_S = 0  # a task waits out a registry's restart; here none comes\n"
        "try:\n"
        "    decode._fetcher({'url': 'http://127.0.0.1:9'})(1)\n"
        "except RegistryUnavailable:\n"
        "    print('confluent_kafka.schema_registry' in sys.modules, 'deltalake' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=PROJECT_ROOT, check=True
    )
    assert out.stdout.strip() == "False False", out.stdout + out.stderr
