"""Apache Cassandra 5.0 as the embedded store: ``cassandra-all`` and its dependencies from Maven Central.

Maven's artifacts carry no launcher and no ``conf/``: this module writes the node's ``cassandra.yaml``
and logback config, and starts ``CassandraDaemon`` with java directly, with the options that
Cassandra's own ``jvm17-server.options`` gives Java 17 (every ``java.base`` package opened).
"""

from __future__ import annotations

import functools
import json
import subprocess
from collections.abc import Sequence
from pathlib import Path

from lambdalake import jars
from lambdalake.settings import CassandraSettings

LOGBACK = """<configuration scan="false">
  <appender name="STDOUT" class="ch.qos.logback.core.ConsoleAppender">
    <encoder><pattern>%-5level %date{ISO8601} %F:%L - %msg%n</pattern></encoder>
  </appender>
  <root level="INFO"><appender-ref ref="STDOUT" /></root>
</configuration>
"""

#: Besides every java.base package opened: what jvm17-server.options exports and opens elsewhere.
_JAVA17_OPTIONS = (
    "--add-exports=java.base/sun.nio.ch=ALL-UNNAMED",
    "--add-exports=java.base/jdk.internal.ref=ALL-UNNAMED",
    "--add-exports=java.base/jdk.internal.misc=ALL-UNNAMED",
    "--add-exports=java.management.rmi/com.sun.jmx.remote.internal.rmi=ALL-UNNAMED",
    "--add-exports=java.rmi/sun.rmi.registry=ALL-UNNAMED",
    "--add-exports=java.rmi/sun.rmi.server=ALL-UNNAMED",
    "--add-exports=java.sql/java.sql=ALL-UNNAMED",
    "--add-exports=jdk.unsupported/sun.misc=ALL-UNNAMED",
    "--add-opens=jdk.management/com.sun.management.internal=ALL-UNNAMED",
)


def write_config(
    home: Path,
    settings: CassandraSettings,
    *,
    host: str,
    seed: str | None = None,
    bootstrap: bool = True,
    keystore: Path | None = None,
    ring: bool = False,
) -> Path:
    """Write ``cassandra.yaml`` (JSON is valid YAML) and an INFO logback under ``home``.

    Args:
        seed: The node the others join through (default: this one, a node alone).
        bootstrap: Stream this node's share of the data when it first joins; False for the nodes of
            a new, empty cluster (there is nothing to stream, and they join at once).
        keystore: Secured (``up --secure``): the PEM file holding the node's key and certificate.
            Clients then log in (roles with passwords, permissions enforced) over TLS only.
        ring: A node of several (``up --nodes 3``).
    """
    conf_dir = home / "conf"
    conf_dir.mkdir(parents=True, exist_ok=True)
    data = home / "data"
    config = {
        "cluster_name": "lambdalake",
        "num_tokens": 16,
        "partitioner": "org.apache.cassandra.dht.Murmur3Partitioner",
        "endpoint_snitch": "SimpleSnitch",
        # A write is acknowledged once its commit log section is synced (concurrent writes share a
        # sync). In periodic mode (Cassandra's default, which a cluster's replicas make safe) a
        # kill -9 lost the writes acknowledged since the last sync: replay stops at the last synced
        # section. Batch mode writes slower than periodic (the benchmarks log has the figures).
        "commitlog_sync": "batch",
        "commitlog_segment_size": "32MiB",
        "seed_provider": [
            {
                "class_name": "org.apache.cassandra.locator.SimpleSeedProvider",
                "parameters": [{"seeds": seed or host}],
            }
        ],
        "auto_bootstrap": bootstrap,
        "listen_address": host,
        "rpc_address": host,
        "start_native_transport": True,
        "native_transport_port": settings.port,
        "storage_port": settings.storage_port,
        "data_file_directories": [str(data / "data")],
        "commitlog_directory": str(data / "commitlog"),
        "saved_caches_directory": str(data / "saved_caches"),
        "hints_directory": str(data / "hints"),
        "cdc_raw_directory": str(data / "cdc_raw"),
        "concurrent_reads": 8,
        "concurrent_writes": 16,
        "auto_snapshot": False,
        "batch_size_warn_threshold": "64KiB",
        # Memtable cells off the Java heap: with cells on it, a 200k-row publish filled the
        # memtable space every half second, and flushes plus their compactions took 1.5 cores.
        "memtable_allocation_type": "offheap_objects",
        # A new single-node cluster has no older nodes to stay compatible with: 5.0's own formats.
        "storage_compatibility_mode": "NONE",
    }
    if not ring:
        # A node alone has no other replica to rank: the dynamic snitch's scoring, ten times a
        # second, is idle work.
        config["dynamic_snitch"] = False
    if keystore is not None:
        pem = "org.apache.cassandra.security.PEMBasedSslContextFactory"
        config |= {
            "authenticator": "PasswordAuthenticator",
            "authorizer": "CassandraAuthorizer",
            "role_manager": "CassandraRoleManager",
            "client_encryption_options": {
                "enabled": True,
                "optional": False,  # TLS only on the native port
                "ssl_context_factory": {"class_name": pem},
                "keystore": str(keystore),
                "require_client_auth": False,
            },
        }
    (conf_dir / "cassandra.yaml").write_text(json.dumps(config, indent=2))
    (conf_dir / "logback.xml").write_text(LOGBACK)
    return conf_dir


@functools.cache
def _java_base_packages() -> tuple[str, ...]:
    out = subprocess.run(
        [jars.java(), "--describe-module", "java.base"], capture_output=True, text=True, check=True
    )
    pkgs = set()
    for line in out.stdout.splitlines():
        parts = line.split()
        if parts[:1] in (["exports"], ["contains"]):
            pkgs.add(parts[1])
        elif parts[:2] == ["qualified", "exports"]:
            pkgs.add(parts[2])
    return tuple(sorted(pkgs))


def java_argv(
    home: Path, cache_dir: Path, *, heap: str, options: Sequence[str] = (), ring: bool = False
) -> list[str]:
    """The node's command line; ``options``: more JVM options (``CassandraSettings.jvm_options``);
    ``ring``: a node of several on loopback (gossip settles in milliseconds, not the 30 s a network
    is given)."""
    lib = jars.classpath(cache_dir, "cassandra")
    jamm = next((j for j in lib if j.name.startswith("jamm-")), None)
    opens = [f"--add-opens=java.base/{p}=ALL-UNNAMED" for p in _java_base_packages()]
    return [
        jars.java(),
        f"-Xms{heap}", f"-Xmx{heap}", "-Xss512k",
        "-XX:+UseG1GC", "-XX:+ExitOnOutOfMemoryError",
        *([f"-javaagent:{jamm}"] if jamm else []),
        "-Djdk.attach.allowAttachSelf=true",
        "-Djava.net.preferIPv4Stack=true",
        "-Dcassandra-foreground=yes",
        # The approximate clock (when a request or message expires) ticks every 50 ms, not 2: its 500
        # wake-ups a second were 70 % of an idle node's CPU (1.05 CPU-s a minute; 0.23 at 100 ms), and
        # timeouts of seconds lose nothing to 50 ms.
        "-Dcassandra.approximate_time_precision_ms=50",
        # One node: no gossip to wait for before it serves.
        "-Dcassandra.skip_wait_for_gossip_to_settle=0",
        *(["-Dcassandra.ring_delay_ms=5000", "-Dcassandra.consistent.rangemovement=false"] if ring else []),
        f"-Dcassandra.config=file://{home / 'conf' / 'cassandra.yaml'}",
        f"-Dlogback.configurationFile={home / 'conf' / 'logback.xml'}",
        f"-Dcassandra.logdir={home / 'logs'}",
        f"-Dcassandra.storagedir={home / 'data'}",
        *opens, *_JAVA17_OPTIONS, *options,
        "-cp", ":".join([str(home / "conf"), *(str(j) for j in lib)]),
        "org.apache.cassandra.service.CassandraDaemon",
    ]  # fmt: skip
