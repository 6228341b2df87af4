"""Build the Spark session from settings (``local[2,4]`` here, ``spark://`` or ``k8s://`` on clusters)."""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from pyspark.sql import SparkSession

from lambdalake import jars
from lambdalake.object_store import client_env, on_object_store
from lambdalake.settings import QUICK_JIT, Settings
from lambdalake.spark.delta import DELTA_CONF

LOG4J = Path(__file__).with_name("log4j2.properties")

#: Defaults sized for small micro-batches on a few cores; every one can be overridden by
#: ``LAMBDALAKE_SPARK__CONF``.
SPARK_DEFAULTS = {
    "spark.sql.session.timeZone": "UTC",
    # ANSI arithmetic (Spark 4's default, pinned here): a decimal sum beyond its type fails the
    # query naming the overflow, where the non-ANSI mode would store a silent null.
    "spark.sql.ansi.enabled": "true",
    # Few, larger tasks: each shuffle partition of a stateful query is a state store to commit per
    # micro-batch. One instead of two: fresher, and the job alone drains as fast (BENCHMARKS.md). Fixed in a
    # query's checkpoint (an existing one keeps its own): raise it before a query first runs on a cluster.
    "spark.sql.shuffle.partitions": "1",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    # RocksDB state with changelog checkpoints: the default in-memory store copies a partition's
    # whole map every micro-batch (10 minutes of dedup identities), RocksDB writes only the changes.
    # Fixed in a query's checkpoint, like the shuffle partitions.
    "spark.sql.streaming.stateStore.providerClass": (
        "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
    ),
    "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": "true",
    # Counting the store's rows costs a RocksDB read before every write; its only use is the
    # numRowsTotal metric, which nothing here reads.
    "spark.sql.streaming.stateStore.rocksdb.trackTotalNumberOfRows": "false",
    "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
    "spark.hadoop.mapreduce.fileoutputcommitter.marksuccessfuljobs": "false",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.python.worker.reuse": "true",
    # PySpark's daemon, its reused workers collecting only young garbage between tasks (a full
    # collection after every task was 70 % of their CPU in a speed job: lambdalake.spark.pydaemon).
    "spark.python.daemon.module": "lambdalake.spark.pydaemon",
    "spark.sql.streaming.stopTimeout": "60s",
    # How long a query without new records waits before asking the source again (Spark's 10 ms
    # default asks the broker for its log ends 100 times a second, which cost an idle job and its
    # broker several times the CPU of 100 ms). A record arriving at an idle job waits 50 ms more on
    # average; the Real-time query never polls so.
    "spark.sql.streaming.pollingDelay": "100ms",
    # No micro-batch without records. After each batch with records the watermark has moved, and
    # Spark would run one more batch only to evict the windows' state behind it: in update mode it
    # writes nothing and reads nothing, but it costs a planned batch and a state commit. The next
    # batch with records evicts the same state. Under a trickle (20 events every ~3.5 s) the job's JVM
    # took 22-31 % less CPU (three pairs of 70-second runs).
    "spark.sql.streaming.noDataMicroBatches.enabled": "false",
    # The speed job's driver heap: its micro-batches hold few columns and its state lives off the
    # heap (RocksDB). At 2g the JVM grew larger resident than at 1g, and was no faster
    # (BENCHMARKS.md, bench.peers); LAMBDALAKE_SPARK__CONF sets it for larger batches.
    "spark.driver.memory": "1g",
    # delta-spark writes and reads the Delta tables Spark makes (views, identity index).
    **DELTA_CONF,
}

#: Spark's bound on the idle Python workers an executor keeps (``settings.spark.idle_python_workers``).
IDLE_WORKERS_CONF = "spark.python.factory.idleWorkerMaxPoolSize"

#: A batch rebuild is one large query instead of many small ones: it wants shuffle partitions that
#: fit in memory (AQE coalesces the small ones), the full JIT, and room to cache the master dataset.
BATCH_DEFAULTS = {
    "spark.sql.shuffle.partitions": "16",
    "spark.sql.adaptive.enabled": "true",
    "spark.sql.adaptive.coalescePartitions.enabled": "true",
    # A cached result (the deduplicated events, each view's rows) coalesced as any other: Spark's
    # default keeps its 16 shuffle partitions, so a few hundred rows became 16 tasks in every job
    # that read them and 16 files in every Delta view written.
    "spark.sql.optimizer.canChangeCachedPlanOutputPartitioning": "true",
    # The identities delivered more than once are few: broadcast them instead of shuffling every event.
    "spark.sql.adaptive.autoBroadcastJoinThreshold": "64MB",
    "spark.driver.memory": "6g",
}

#: A replay is a batch in a short process: it caches the replayed epochs' events once for its two
#: or so view jobs, where compressing the cache costs more than it saves.
REPLAY_DEFAULTS = {**BATCH_DEFAULTS, "spark.sql.inMemoryColumnarStorage.compressed": "false"}

Workload = Literal["stream", "batch", "replay"]

#: Below this many events a local batch or replay compiles with C1 alone and collects with the serial
#: collector: its few short jobs end before C2's compilations pay back, and on two cores the compiler
#: threads take the tasks' CPU (faster than the JVM's defaults for small runs; a replay of 2M events
#: was slower on C1 alone, 1M as fast; BENCHMARKS.md).
QUICK_JIT_EVENTS = 1_000_000


def on_this_machine(master: str) -> bool:
    """Whether ``master`` runs its executors on this machine, sharing its cores with the driver:
    ``local[...]``, or a standalone master on a loopback address (``lambdalake up --nodes 3``)."""
    if master.startswith("local"):
        return True
    host = master.removeprefix("spark://").split(":")[0]
    return master.startswith("spark://") and (host == "localhost" or host.startswith("127."))


def jvm_policy(settings: Settings, workload: Workload, *, events: int | None = None) -> list[str]:
    """The JIT and collector options of a JVM running ``workload``'s tasks on this machine (the local
    driver, or the executors of a standalone master on loopback); none on other machines' clusters."""
    if not on_this_machine(settings.spark.master):
        return []
    small = events is not None and events < QUICK_JIT_EVENTS
    if workload == "stream" or small:
        # C1 alone: a small batch's few short jobs end before C2's compilations pay back, and every
        # micro-batch runs freshly generated code; with C2 on, JIT compiling took a large share of
        # the JVM's CPU on a 2-core machine. The serial collector: the garbage is young and small,
        # and G1's remembered sets and concurrent threads cost memory and a share of two cores
        # (bench.peers, four runs each: less resident memory than with G1, as fast and as fresh).
        return [*QUICK_JIT, "-XX:+UseSerialGC"]
    if workload == "replay":
        # The throughput collector: G1's concurrent threads take a share of two cores from the tasks
        # (a new process replaying 1M events was faster with it). C2 stays on: C1 alone was a little
        # faster at 1M events but slower at 2M (BENCHMARKS.md).
        return ["-XX:+UseParallelGC"]
    return []


def driver_java_options(settings: Settings, workload: Workload, *, events: int | None = None) -> str:
    """The driver JVM's options for ``workload`` reading about ``events`` events (None: unknown);
    ``spark.driver.extraJavaOptions`` in the settings' conf replaces them."""
    opts = [f"-Dlog4j.configurationFile=file:{LOG4J}", *jvm_policy(settings, workload, events=events)]
    if settings.spark.cds:
        from lambdalake.spark.cds_archive import archive_options

        opts.extend(archive_options(settings))
    return " ".join(opts)


def executor_java_options(settings: Settings, workload: Workload, *, events: int | None = None) -> str | None:
    """A standalone master's executors on this machine (``up --nodes 3``) share its cores with the
    driver as a local master's tasks do: they take the driver's JIT and collector. None elsewhere
    (a local master's tasks run in the driver; other machines' executors keep the JVM's defaults);
    ``spark.executor.extraJavaOptions`` in the settings' conf replaces them."""
    if not settings.spark.master.startswith("spark://"):
        return None
    return " ".join(jvm_policy(settings, workload, events=events)) or None


def spark_session(
    settings: Settings,
    app_name: str = "lambdalake",
    *,
    workload: Workload = "stream",
    events: int | None = None,
    extra_slots: int = 0,
) -> SparkSession:
    """The active session, created with the settings' master and conf if there is none.

    Args:
        settings: Master and ``spark.conf`` overrides (applied last, so they win).
        app_name: The application's name.
        workload: ``"stream"`` (default: small micro-batches, few shuffle partitions, cheap JIT),
            ``"batch"`` (:data:`BATCH_DEFAULTS`: one large query) or ``"replay"``
            (:data:`REPLAY_DEFAULTS`: a batch in a short process, with the throughput collector).
            Only a new session takes it.
        events: About how many events a batch or replay reads, when known (default None: unknown);
            below :data:`QUICK_JIT_EVENTS` a local driver starts with the quick JIT.
        extra_slots: Task slots a local master gets beyond its own (default 0): a Real-time query
            holds one per Kafka partition for as long as it runs. A cluster's executors must offer
            them (``spark.executor.cores``).
    """
    # Executors must run the interpreter that has lambdalake installed (the venv's).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if settings.spark.master.startswith("local"):
        # One machine: bind to loopback instead of guessing an interface (and warning about it).
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = SparkSession.builder.appName(app_name).master(with_slots(settings.spark.master, extra_slots))
    derived = {"spark.driver.extraJavaOptions": driver_java_options(settings, workload, events=events)}
    executor_options = executor_java_options(settings, workload, events=events)
    if executor_options:
        derived["spark.executor.extraJavaOptions"] = executor_options
    if settings.spark.idle_python_workers is not None:
        derived[IDLE_WORKERS_CONF] = str(settings.spark.idle_python_workers)
    workload_defaults = {"stream": {}, "batch": BATCH_DEFAULTS, "replay": REPLAY_DEFAULTS}[workload]
    defaults = {**SPARK_DEFAULTS, **workload_defaults}
    conf = {**defaults, **derived, **object_store_conf(settings), **settings.spark.conf}
    conf["spark.jars"] = ",".join(filter(None, [*connector_jars(settings), conf.get("spark.jars")]))
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


def with_slots(master: str, extra: int) -> str:
    """A ``local[N]`` or ``local[N,F]`` master with ``extra`` more task slots (threads: a slot held by
    a Real-time task that waits for records costs no core). Other masters are left as they are."""
    found = re.fullmatch(r"local(?:\[(\d+|\*)(,\d+)?\])?", master)
    if not extra or found is None:
        return master
    given = found.group(1) or "1"
    threads = (os.cpu_count() or 1) if given == "*" else int(given)
    return f"local[{threads + extra}{found.group(2) or ''}]"


@contextlib.contextmanager
def command_session(
    settings: Settings, app_name: str, *, workload: Workload = "stream", events: int | None = None
) -> Iterator[SparkSession]:
    """A session for one command (:func:`spark_session`), stopped when the block ends however it
    ends, so the command's driver JVM and Python workers go with it."""
    spark = spark_session(settings, app_name, workload=workload, events=events)
    try:
        yield spark
    finally:
        spark.stop()


def object_store_conf(settings: Settings) -> dict[str, str]:
    """For an ``s3://`` storage root: S3A as ``s3://``'s filesystem, pointed at the settings' store.

    The keys reach the driver and the executors as environment variables (S3A's environment
    credentials provider, and delta-rs in the executors' Python tasks), never as ``spark.hadoop.*``
    values; Spark redacts ``spark.executorEnv.*`` names holding "secret" or "key" in its UI and event
    logs. delta-spark writes S3 through a single-driver log store: one writing driver per table,
    which the one-writer leases keep (docs/production.md)."""
    env = client_env(settings)
    if not env:
        return {}
    store = settings.object_store
    hadoop = {
        "fs.s3.impl": "org.apache.hadoop.fs.s3a.S3AFileSystem",
        "fs.AbstractFileSystem.s3.impl": "org.apache.hadoop.fs.s3a.S3A",
        "fs.s3a.endpoint": store.endpoint,
        "fs.s3a.endpoint.region": store.region,
        "fs.s3a.path.style.access": "true",
        "fs.s3a.connection.ssl.enabled": str(store.endpoint.startswith("https://")).lower(),
        "fs.s3a.aws.credentials.provider":
            "software.amazon.awssdk.auth.credentials.EnvironmentVariableCredentialsProvider",
    }  # fmt: skip
    conf = {f"spark.hadoop.{k}": v for k, v in hadoop.items()}
    conf.update({f"spark.executorEnv.{k}": v for k, v in env.items()})
    os.environ.update(env)  # the driver's JVM, started next, inherits them
    return conf


def connector_jars(settings: Settings) -> list[str]:
    """Spark's own Kafka source and Avro functions at pyspark's version, delta-spark (pyspark ships
    none of them) and the latest views' Real-time writer with its Cassandra driver, from the cache
    ``make setup`` fills; Spark sends them to a cluster's executors itself."""
    bundles: tuple[jars.Bundle, ...] = ("spark", "delta", "writer")
    if on_object_store(settings.storage_root):
        bundles += ("s3a",)
    return [str(jar) for bundle in bundles for jar in jars.classpath(settings.cache_dir, bundle)]
