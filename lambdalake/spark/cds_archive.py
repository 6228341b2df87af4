"""Where the Spark driver's class-data-sharing archive is and the JVM options that map it: what a
session needs of it (:mod:`lambdalake.spark.cds` builds the archive, with a session of its own)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from lambdalake.settings import Settings


def _java() -> str:
    """The java binary Spark starts (``$JAVA_HOME/bin/java``, else the one on ``PATH``)."""
    home = os.environ.get("JAVA_HOME")
    found = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    return os.path.realpath(found) if found else "java"


def _jars(pyspark_file: str) -> str:
    """Spark's JARs as the JVM checks an archive against them: each one's name, size and time. A
    reinstalled pyspark (a venv made again) has new times, and the JVM would refuse the archive
    made from the old ones without a word: the new JARs get an archive of their own."""
    folder = Path(pyspark_file).parent / "jars"
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.glob("*.jar"))]
    return repr(stats)


def archive_path(settings: Settings) -> Path:
    """Where the archive for this JVM and this Spark lives (under the settings' cache folder)."""
    import pyspark

    key = hashlib.sha1(f"{_java()}|{pyspark.__file__}|{_jars(pyspark.__file__)}".encode()).hexdigest()[:12]
    return settings.cache_dir / "spark-cds" / f"spark-{pyspark.__version__}-{key}.jsa"


def archive_options(settings: Settings) -> list[str]:
    """The JVM options that map the archive, or none when it has not been built."""
    path = archive_path(settings)
    if not path.is_file():
        return []
    # A mismatched archive is skipped with a warning per JVM start: quiet, it is not the user's to fix.
    return [f"-XX:SharedArchiveFile={path}", "-Xlog:cds=off", "-Xlog:cds+dynamic=off"]
