"""The Spark driver's class-data-sharing archive: mapped when built, never half-built."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from lambdalake.settings import Settings
from lambdalake.spark import cds
from lambdalake.spark.session import driver_java_options


def test_sessions_map_the_archive_only_once_it_is_built(tmp_path: Path) -> None:
    settings = Settings(cache_dir=tmp_path)
    assert cds.archive_options(settings) == []
    assert "SharedArchiveFile" not in driver_java_options(settings, "batch")
    path = cds.archive_path(settings)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"built")
    assert f"-XX:SharedArchiveFile={path}" in driver_java_options(settings, "replay")
    off = settings.model_copy(update={"spark": settings.spark.model_copy(update={"cds": False})})
    assert "SharedArchiveFile" not in driver_java_options(off, "replay")


@pytest.mark.parametrize("outcome", ["failed", "no file", "empty file"])
def test_a_failed_build_leaves_no_archive(tmp_path: Path, monkeypatch: Any, outcome: str) -> None:
    """A truncated archive crashes the JVM that maps it: only a clean build is moved into place."""

    def child(args: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        dump = Path(args[-1])
        if outcome != "no file":
            dump.write_bytes(b"" if outcome == "empty file" else b"half")
        return subprocess.CompletedProcess(args, 1 if outcome == "failed" else 0, "", "killed")

    monkeypatch.setattr(cds.subprocess, "run", child)
    settings = Settings(cache_dir=tmp_path)
    assert cds.build(settings) is None
    assert not cds.archive_path(settings).exists()
    assert list(cds.archive_path(settings).parent.iterdir()) == []  # the build folder is gone too


def test_the_test_session_runs_from_the_archive(spark: Any, services: Settings) -> None:
    """`make setup` built the archive, and a session's driver JVM maps it (as `jcmd` reports)."""
    path = cds.archive_path(services)
    if not path.is_file():
        pytest.skip(f"no archive at {path}: `make setup` builds it")
    jvm = spark.sparkContext._jvm
    args = list(jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments())
    assert f"-XX:SharedArchiveFile={path}" in args
    pid = jvm.java.lang.ProcessHandle.current().pid()
    info = subprocess.run(["jcmd", str(pid), "VM.info"], capture_output=True, text=True, timeout=60).stdout
    # Mapped into memory (the command line names it whether or not it mapped): a memory-map line,
    # which names the file by its real path (a cache folder may be a symlink).
    mapped = [
        line
        for line in info.splitlines()
        if re.match(rf"[0-9a-f]+-[0-9a-f]+ .* {re.escape(str(path.resolve()))}$", line)
    ]
    assert mapped, f"{path} is not mapped by the driver JVM"
    assert spark.range(10).count() == 10
