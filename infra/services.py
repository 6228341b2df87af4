"""The three embedded services and how to bring them up, check them and take them down."""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from urllib.parse import urlparse

import httpx

from infra import cassandra_dist, kafka_dist
from infra.addresses import host_port, joined
from infra.process import ManagedProcess, port_open
from lambdalake.errors import LambdalakeError
from lambdalake.settings import Settings

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}


@dataclass(frozen=True)
class ServiceStatus:
    name: str
    address: str
    embedded: bool
    running: bool
    healthy: bool
    pid: int | None
    detail: str

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class EmbeddedService(ABC):
    """One service the platform can start on this machine.

    Subclasses say how to start it (``argv``) and how to tell it is healthy (``probe``).
    """

    name: str
    marker: str
    start_timeout: float = 60.0

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.proc = ManagedProcess(
            name=self.name,
            run_dir=settings.state_dir / "run",
            log_dir=settings.state_dir / "logs",
            marker=self.marker,
        )

    @property
    @abstractmethod
    def host(self) -> str: ...

    @property
    @abstractmethod
    def port(self) -> int: ...

    @property
    def address(self) -> str:
        return joined(self.host, self.port)

    @property
    def embedded(self) -> bool:
        """Whether the settings point at this machine (else a real cluster is configured)."""
        return self.host in LOCAL_HOSTS

    @abstractmethod
    def argv(self) -> list[str]: ...

    def env(self) -> dict[str, str]:
        return {}

    def cwd(self) -> Path | None:
        return None

    def prepare(self) -> None:  # noqa: B027 - optional hook, most services need nothing
        """Install files and write config before the first start."""

    @abstractmethod
    def probe(self) -> str | None:
        """None when healthy, else a short reason."""

    def start(self) -> bool:
        """Start if not running (idempotent). Returns whether a process was started."""
        if not self.embedded:
            return False
        pid = self.proc.pid()
        if pid is not None:
            try:
                self.proc.wait_until(lambda: self.probe() is None, timeout=self.start_timeout, what="healthy")
            except LambdalakeError as exc:
                raise LambdalakeError(
                    f"{self.name} runs (pid {pid}) but does not answer on {self.address}: {exc.message}",
                    fix="it may run with other settings: `lambdalake down`, then `lambdalake up`",
                ) from exc
            return False
        taken = [port for port in self.ports() if port_open(self.host, port)]
        if taken:
            raise LambdalakeError(
                f"cannot start the embedded {self.name}: {self.host}:{taken[0]} is already in use by a "
                "process lambdalake did not start",
                fix=f"stop whatever listens on port {taken[0]}, or move the {self.name} to a free port "
                f"({self.port_setting_hint()})",
            )
        self.prepare()
        self.proc.spawn(self.argv(), env=self.env(), cwd=self.cwd())
        self.proc.wait_until(lambda: self.probe() is None, timeout=self.start_timeout, what="healthy")
        return True

    def stop(self) -> bool:
        return self.proc.stop()

    def port_setting_hint(self) -> str:
        return ""

    def ports(self) -> list[int]:
        """Every port the service listens on (checked free before a start)."""
        return [self.port]

    def status(self) -> ServiceStatus:
        pid = self.proc.pid() if self.embedded else None
        reason = self.probe()
        return ServiceStatus(
            name=self.name,
            address=self.address,
            embedded=self.embedded,
            running=pid is not None if self.embedded else reason is None,
            healthy=reason is None,
            pid=pid,
            detail=reason or "ok",
        )


class BrokerService(EmbeddedService):
    """Apache Kafka, one KRaft node (broker and controller), from Maven Central's server JARs."""

    name = "broker"
    marker = "kafka.Kafka"
    start_timeout = 90.0

    @cached_property
    def _hostport(self) -> tuple[str, int]:
        return host_port(self.settings.kafka.bootstrap_servers.split(",")[0], 9092)

    @property
    def host(self) -> str:
        return self._hostport[0]

    @property
    def port(self) -> int:
        return self._hostport[1]

    @property
    def controller_port(self) -> int:
        return self.settings.kafka.embedded_controller_port(self.port)

    def port_setting_hint(self) -> str:
        return (
            "LAMBDALAKE_KAFKA__BOOTSTRAP_SERVERS=127.0.0.1:<port>, LAMBDALAKE_KAFKA__CONTROLLER_PORT=<port>"
        )

    def ports(self) -> list[int]:
        return [self.port, self.controller_port]

    @property
    def data_dir(self) -> Path:
        """Everything the node keeps: its config, and its logs (records and KRaft metadata) in ``data/``."""
        return self.settings.state_dir / "broker"

    def prepare(self) -> None:
        kafka_dist.write_config(self.data_dir, self.settings.kafka, host=self.host, port=self.port)
        kafka = self.settings.kafka
        kafka_dist.format_once(self.data_dir, self.settings.cache_dir, options=kafka.jvm_options)

    def argv(self) -> list[str]:
        return kafka_dist.java_argv(
            self.data_dir,
            self.settings.cache_dir,
            heap=self.settings.kafka.heap,
            options=self.settings.kafka.jvm_options,
        )

    def probe(self) -> str | None:
        if not port_open(self.host, self.port):
            return "not listening"
        from confluent_kafka.admin import AdminClient

        try:
            meta = AdminClient(
                {**self.settings.kafka.client_config(), "socket.timeout.ms": 2000}
            ).list_topics(timeout=3)
        except Exception as exc:  # any client error means "not healthy", with its text
            return f"metadata request failed: {exc}"
        # Listening comes before the broker has registered with its controller.
        return None if meta.brokers else "no broker registered yet"


class RegistryService(EmbeddedService):
    """lambdalake's own Confluent-API schema registry (``infra.registry``), state in ``_schemas``."""

    name = "registry"
    marker = "infra.registry"
    start_timeout = 30.0

    @cached_property
    def _url(self):
        return urlparse(self.settings.registry.url)

    @property
    def host(self) -> str:
        return self._url.hostname or "127.0.0.1"

    @property
    def port(self) -> int:
        return self._url.port or 8081

    def port_setting_hint(self) -> str:
        return "LAMBDALAKE_REGISTRY__URL=http://127.0.0.1:<port>"

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "infra.registry", "--host", self.host, "--port", str(self.port)]

    def cwd(self) -> Path | None:
        return Path(__file__).resolve().parent.parent

    def env(self) -> dict[str, str]:
        return self.settings.to_env()

    def probe(self) -> str | None:
        try:
            resp = httpx.get(f"{self.settings.registry.url}/subjects", timeout=2)
        except httpx.HTTPError as exc:
            return f"not answering: {exc.__class__.__name__}"
        return None if resp.status_code == 200 else f"HTTP {resp.status_code}"


class CassandraService(EmbeddedService):
    """Apache Cassandra 5.0 from Maven Central's ``cassandra-all``, run on Java 17 directly."""

    name = "cassandra"
    marker = "org.apache.cassandra.service.CassandraDaemon"
    start_timeout = 120.0

    @property
    def host(self) -> str:
        return self.settings.cassandra.contact_points[0]

    @property
    def port(self) -> int:
        return self.settings.cassandra.port

    def port_setting_hint(self) -> str:
        return "LAMBDALAKE_CASSANDRA__PORT=<port>, LAMBDALAKE_CASSANDRA__STORAGE_PORT=<port>"

    def ports(self) -> list[int]:
        return [self.port, self.settings.cassandra.storage_port]

    @property
    def home(self) -> Path:
        return self.settings.state_dir / "cassandra"

    def prepare(self) -> None:
        cassandra_dist.write_config(self.home, self.settings.cassandra, host=self.host)

    def argv(self) -> list[str]:
        return cassandra_dist.java_argv(
            self.home,
            self.settings.cache_dir,
            heap=self.settings.cassandra.heap,
            options=self.settings.cassandra.jvm_options,
        )

    def probe(self) -> str | None:
        if not port_open(self.host, self.port):
            return "not listening"
        from cassandra.cluster import Cluster

        cluster = Cluster(
            [self.host], port=self.port, **self.settings.cassandra.driver_options(),
            connect_timeout=3, control_connection_timeout=3,
        )  # fmt: skip
        try:
            session = cluster.connect()
            session.execute("SELECT release_version FROM system.local", timeout=3)
        except Exception as exc:  # the driver raises many types; all mean "not yet"
            return f"CQL query failed: {exc.__class__.__name__}"
        finally:
            cluster.shutdown()
        return None


def all_services(settings: Settings) -> list[EmbeddedService]:
    """In start order: the registry keeps its state on the broker."""
    return [BrokerService(settings), RegistryService(settings), CassandraService(settings)]


def select(settings: Settings, only: list[str] | None) -> list[EmbeddedService]:
    services = all_services(settings)
    if not only:
        return services
    names = {s.name for s in services}
    unknown = set(only) - names
    if unknown:
        raise LambdalakeError(f"unknown service(s): {', '.join(sorted(unknown))}", fix=f"use {sorted(names)}")
    return [s for s in services if s.name in only]


@contextmanager
def running(settings: Settings, only: list[str] | None = None) -> Iterator[list[EmbeddedService]]:
    """Start the services (all, or ``only`` these) for the block, and stop after it those it started."""
    services = select(settings, only)
    started = []
    try:
        for service in services:
            if service.start():
                started.append(service)
        yield services
    finally:
        # Only what this block started: a service that ran before it (another state folder's, or
        # `lambdalake up`'s) keeps running.
        for service in reversed(started):
            service.stop()
