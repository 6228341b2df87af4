"""Delta tables Spark writes and reads itself, with delta-spark: the batch views and the identity index.

Spark writes the files and commits them in the JVM, in one Delta commit per write, so a reader sees
the whole write or none of it. The commit carries the caller's metadata as Delta's ``userMetadata``
(one JSON object), which :func:`lambdalake.delta.commit_metadata` reads back for delta-rs readers.
Every table written here stays readable by delta-rs: no reader or writer feature is turned on.

Guarantee: a write is atomic; it is not idempotent by itself (the caller's run names its commit).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Literal

from pyspark import InheritableThread
from pyspark.sql import DataFrame, SparkSession

from lambdalake.delta import open_table
from lambdalake.errors import LambdalakeError

#: What a session needs to write and read Delta tables with delta-spark (its JARs are on the session's
#: classpath: :func:`lambdalake.spark.session.connector_jars`).
DELTA_CONF = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
    # The log's state in one task, not 50: the tables Spark writes have a few files a version.
    "spark.databricks.delta.snapshotPartitions": "1",
    # A write that adds no rows still commits: its commit names the run (an incremental batch run with
    # no new identities is the index's newest run all the same).
    "spark.databricks.delta.skipRecordingEmptyCommits": "false",
}

#: How many commits back a write looks for its own commit (one writer per pipeline and role: it is
#: the newest, unless a restore or a second table writer committed in between).
_OWN_COMMIT_SCAN = 20


def write_table(
    df: DataFrame,
    path: str,
    *,
    mode: Literal["append", "overwrite"],
    metadata: Mapping[str, str],
    properties: Mapping[str, str] | None = None,
) -> int:
    """Write ``df`` to the Delta table at ``path`` (created if needed) in one commit; returns its version.

    Args:
        df: The rows.
        path: The table.
        mode: ``append``, or ``overwrite`` (the rows replace every live one, atomically, and the table's
            columns become ``df``'s: a view whose definition changed replaces its schema).
        metadata: Commit metadata, kept in the table's history; it must name the write (a run id), so
            the commit can be found again.
        properties: Delta table properties the table must have (default None: none). A new table is
            created with them; a table made before they were asked for gets them in a commit of their
            own, before the write (delta-spark takes a writer's table properties only at creation).
    """
    text = json.dumps(dict(metadata), sort_keys=True)
    writer = df.write.format("delta").mode(mode).option("userMetadata", text)
    if properties:
        _set_properties(df.sparkSession, path, properties)
        for key, value in properties.items():
            writer = writer.option(key, value)
    if mode == "overwrite":
        writer = writer.option("overwriteSchema", "true")
    else:
        writer = writer.option("mergeSchema", "true")
    writer.save(path)
    return _version_of(path, text)


def write_tables(writes: Mapping[str, Callable[[], int]]) -> dict[str, int]:
    """Run the writes of several tables side by side; returns each one's version.

    Most of a small write's seconds are the driver waiting on the few small jobs delta-spark runs over
    the table's log, so writes of different tables overlap well (BENCHMARKS.md). Each write must be to
    a table of its own. A failed write is raised once every other one has ended, as it would be
    one after another.

    Args:
        writes: Per table (any name), a call that writes it and returns its version
            (:func:`write_table`).
    """
    if len(writes) <= 1:
        return {name: write() for name, write in writes.items()}
    versions: dict[str, int] = {}
    failed: list[BaseException] = []

    def run(name: str, write: Callable[[], int]) -> None:
        try:
            versions[name] = write()
        except BaseException as exc:  # raised in the caller's thread, below
            failed.append(exc)

    # InheritableThread: each thread's jobs carry the caller's Spark local properties.
    threads = [
        InheritableThread(run, args=(name, write), name=f"delta-write-{name}", daemon=True)
        for name, write in writes.items()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failed:
        raise failed[0]
    return {name: versions[name] for name in writes}


def read_table(spark: SparkSession, path: str, *, version: int | None = None) -> DataFrame | None:
    """The rows of the Delta table at ``path`` at ``version`` (default the newest now), or None when
    there is no table there.

    The DataFrame is pinned to that version: Spark recomputes a cached DataFrame whose plan reads a
    table it then writes (delta-spark refreshes the cache by path), and a run's later write to the
    same table must not change what it already read.
    """
    table = open_table(path, version=version)
    if table is None:
        return None
    return spark.read.format("delta").option("versionAsOf", table.version()).load(path)


def _set_properties(spark: SparkSession, path: str, properties: Mapping[str, str]) -> None:
    """Give the existing table at ``path`` the ``properties`` it lacks (nothing when there is no table)."""
    table = open_table(path)
    if table is None:
        return
    have = table.metadata().configuration
    missing = {k: v for k, v in properties.items() if have.get(k) != v}
    if not missing:
        return
    pairs = ", ".join(f"'{k}' = '{v}'" for k, v in sorted(missing.items()))
    quoted = path.replace("`", "``")
    spark.sql(f"ALTER TABLE delta.`{quoted}` SET TBLPROPERTIES ({pairs})")


def _version_of(path: str, text: str) -> int:
    """The version of the newest commit of ``path`` whose user metadata is ``text``."""
    table = open_table(path)
    history = table.history(_OWN_COMMIT_SCAN) if table is not None else []
    for entry in history:
        if entry.get("userMetadata") == text:
            return int(entry["version"])
    raise LambdalakeError(
        f"the Delta write to {path} committed, but its commit is not among the newest {_OWN_COMMIT_SCAN}",
        fix="another writer is writing this table: stop it, then run again",
    )
