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
        "import sys, speed.sinks\n"
        "from lambdalake.spark import decode\n"
        "from lambdalake.writer_schemas import RegistryUnavailable\n"
        "try:\n"
        "    decode._fetcher({'url': 'http://127.0.0.1:9'})(1)\n"
        "except RegistryUnavailable:\n"
        "    print('confluent_kafka.schema_registry' in sys.modules, 'deltalake' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=PROJECT_ROOT, check=True
    )
    assert out.stdout.strip() == "False False", out.stdout + out.stderr


def _imports(path) -> set[str]:
    import ast

    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_layers_depend_on_the_core_never_on_each_other() -> None:
    """speed/, batch/ and serving/ import lambdalake (the core), never one another; the core imports
    no layer except in the CLI modules, which call the operations that span the layers (infra's
    deploy and view build) and import them lazily."""
    layers = {"speed", "batch", "serving"}
    problems = []
    for layer in layers:
        for path in (PROJECT_ROOT / layer).rglob("*.py"):
            wrong = (_imports(path) & layers) - {layer}
            if wrong:
                problems.append(f"{path.relative_to(PROJECT_ROOT)} imports {sorted(wrong)}")
    for path in (PROJECT_ROOT / "lambdalake").rglob("*.py"):
        if "cli" in path.relative_to(PROJECT_ROOT / "lambdalake").parts:
            continue
        wrong = _imports(path) & (layers | {"infra"})
        if wrong:
            problems.append(f"{path.relative_to(PROJECT_ROOT)} imports {sorted(wrong)}")
    assert problems == []
