"""Apache Kafka as the embedded brokers: KRaft nodes, each broker and controller in one JVM.

The server JARs come from Maven Central (``lambdalake/jars.py``); this module writes the node's
``server.properties`` and log4j2 config, formats its log folder once (as ``kafka-storage format``
does) and builds the java command line that ``kafka-server-start`` would run.
"""

from __future__ import annotations

import base64
import subprocess
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lambdalake import jars
from lambdalake.errors import LambdalakeError
from lambdalake.infra.addresses import joined
from lambdalake.kafka.admin import default_replication
from lambdalake.settings import KafkaSettings

LOG4J2 = """status = warn
appender.out.type = Console
appender.out.name = STDOUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = STDOUT
# Every request and partition state change at INFO would fill the log.
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.state.name = state.change.logger
logger.state.level = WARN
"""


def server_properties(
    settings: KafkaSettings,
    *,
    host: str,
    port: int,
    log_dir: Path,
    node_id: int = 1,
    nodes: Sequence[tuple[str, int]] = (),
) -> dict[str, str]:
    """Node ``node_id`` of ``nodes`` (every node's (host, broker port); default: this one alone), each
    a broker and a voting controller. Internal topics get 3 replicas (the nodes there are, if
    fewer) and, from 3, 2 in sync, as the pipelines' topics do."""
    controller = settings.embedded_controller_port(port)
    nodes = list(nodes) or [(host, port)]
    voters = ",".join(
        f"{i}@{joined(h, settings.embedded_controller_port(p))}" for i, (h, p) in enumerate(nodes, 1)
    )
    replicas, in_sync = (str(n) for n in default_replication(len(nodes)))
    return {
        "process.roles": "broker,controller",
        "node.id": str(node_id),
        "controller.quorum.voters": voters,
        "listeners": f"PLAINTEXT://{joined(host, port)},CONTROLLER://{joined(host, controller)}",
        "advertised.listeners": f"PLAINTEXT://{joined(host, port)}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "log.dirs": str(log_dir),
        "num.partitions": "1",
        "offsets.topic.replication.factor": replicas,
        # 50 partitions by default: each a log folder and file handles, for one consumer group at a time.
        "offsets.topic.num.partitions": "8",
        "transaction.state.log.replication.factor": replicas,
        "transaction.state.log.min.isr": in_sync,
        "transaction.state.log.num.partitions": "8",
        "share.coordinator.state.topic.replication.factor": replicas,
        "share.coordinator.state.topic.min.isr": in_sync,
        # A consumer group of one member need not wait 3 s for others to join.
        "group.initial.rebalance.delay.ms": "0",
        # The cleaner looks for dirty compacted logs every second instead of every 15 (cheap on a node
        # this small, and a compaction a test asks for happens while it waits).
        "log.cleaner.backoff.ms": "1000",
    }


@dataclass(frozen=True)
class Secured:
    """What a secured broker (``up --secure``) needs: its key store, the CA it trusts, and the login
    its brokers use between themselves (a superuser), and every principal's SCRAM login, created at
    format time."""

    keystore: Path
    keystore_password: str
    ca: Path
    username: str
    password: str
    users: tuple[tuple[str, str], ...] = ()


def secured_properties(host: str, port: int, controller: int, secured: Secured) -> dict[str, str]:
    """The client listener as SASL_SSL with SCRAM-SHA-512 (the brokers among themselves too), and
    ACLs enforced. The controller listener stays plain on this machine's loopback address: its
    anonymous principal is a superuser, as KRaft's own requests need."""
    jaas = (
        "org.apache.kafka.common.security.scram.ScramLoginModule required "
        f'username="{secured.username}" password="{secured.password}";'
    )
    return {
        "listeners": f"SASL_SSL://{joined(host, port)},CONTROLLER://{joined(host, controller)}",
        "advertised.listeners": f"SASL_SSL://{joined(host, port)}",
        "inter.broker.listener.name": "SASL_SSL",
        "listener.security.protocol.map": "SASL_SSL:SASL_SSL,CONTROLLER:PLAINTEXT",
        "sasl.enabled.mechanisms": "SCRAM-SHA-512",
        "sasl.mechanism.inter.broker.protocol": "SCRAM-SHA-512",
        "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config": jaas,
        "ssl.keystore.type": "PKCS12",
        "ssl.keystore.location": str(secured.keystore),
        "ssl.keystore.password": secured.keystore_password,
        "ssl.key.password": secured.keystore_password,
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(secured.ca),
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "super.users": f"User:{secured.username};User:ANONYMOUS",
    }


def write_config(
    home: Path,
    settings: KafkaSettings,
    *,
    host: str,
    port: int,
    node_id: int = 1,
    nodes: Sequence[tuple[str, int]] = (),
    secured: Secured | None = None,
) -> Path:
    """Write ``server.properties`` (owner-only: a secured broker's holds its login) and
    ``log4j2.properties`` under ``home``; returns the first."""
    home.mkdir(parents=True, exist_ok=True)
    props = server_properties(
        settings, host=host, port=port, log_dir=log_dir(home), node_id=node_id, nodes=nodes
    )
    if secured is not None:
        props |= secured_properties(host, port, settings.embedded_controller_port(port), secured)
    path = home / "server.properties"
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
    (home / "log4j2.properties").write_text(LOG4J2)
    return path


def log_dir(home: Path) -> Path:
    return home / "data"


def _java(home: Path, cache_dir: Path, heap: str, options: Sequence[str] = ()) -> list[str]:
    cp = ":".join(str(j) for j in jars.classpath(cache_dir, "kafka"))
    return [
        jars.java(), f"-Xms{heap}", f"-Xmx{heap}",
        # Kafka's own launcher's GC settings (kafka-run-class.sh).
        "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-XX:InitiatingHeapOccupancyPercent=35",
        "-XX:+ExplicitGCInvokesConcurrent", "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={home / 'log4j2.properties'}",
        f"-Dkafka.logs.dir={home / 'logs'}",
        *options,
        "-cp", cp,
    ]  # fmt: skip


def new_cluster_id() -> str:
    cluster_id = "-"
    while cluster_id.startswith("-"):  # one in 64 would be read as an option (Kafka's own ids avoid it)
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
    return cluster_id


def format_once(
    home: Path,
    cache_dir: Path,
    *,
    options: Sequence[str] = (),
    cluster_id: str | None = None,
    scram: Sequence[tuple[str, str]] = (),
) -> None:
    """Format the log folder for KRaft, unless it was (``kafka-storage format``; ~5 s). The nodes of
    one cluster share ``cluster_id`` (default: a new one, for a node alone); ``scram``: (user,
    password) logins created with it (SCRAM-SHA-512), before any broker needs one."""
    if (log_dir(home) / "meta.properties").exists():
        return
    cluster_id = cluster_id or new_cluster_id()
    argv = [
        *_java(home, cache_dir, "256m", options), "kafka.tools.StorageTool", "format",
        "-t", cluster_id, "-c", str(home / "server.properties"), "--ignore-formatted",
    ]  # fmt: skip
    for user, password in scram:
        argv += ["--add-scram", f"SCRAM-SHA-512=[name={user},password={password}]"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    if out.returncode != 0:
        tail = "\n".join((out.stdout + out.stderr).strip().splitlines()[-8:])
        raise LambdalakeError(
            f"formatting the embedded Kafka broker's log folder {log_dir(home)} failed:\n{tail}",
            fix=f"remove {log_dir(home)} if it holds nothing you need, then `lambdalake up`",
        )


def java_argv(home: Path, cache_dir: Path, *, heap: str, options: Sequence[str] = ()) -> list[str]:
    """The broker's command line; ``options``: more JVM options (``KafkaSettings.jvm_options``)."""
    return [*_java(home, cache_dir, heap, options), "kafka.Kafka", str(home / "server.properties")]
