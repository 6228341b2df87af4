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
