"""The embedded services, one node each or a cluster of several on loopback, and how to bring them
up, check them and take them down.

Which nodes run follows from the settings alone: each address of the bootstrap list and each
Cassandra contact point on this machine (``127.x.y.z``) is one node, and a ``spark://`` master here
is a standalone master with ``spark.workers`` workers. ``lambdalake up --nodes 3`` only changes
those settings' defaults (:class:`lambdalake.settings.Settings`).
"""

from __future__ import annotations

import secrets
import shutil
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
from pydantic import SecretStr

from lambdalake import secure
from lambdalake.errors import LambdalakeError
from lambdalake.infra import cassandra_dist, kafka_dist, s3proxy_dist, tls
from lambdalake.infra.addresses import host_port, joined
from lambdalake.infra.process import ManagedProcess, port_open
from lambdalake.object_store import bucket, on_object_store
from lambdalake.settings import CassandraSettings, Settings

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}
#: A secured Cassandra node's probe: it answers, but too few replicas of the roles are up to check a login.
LOGINS_WAIT = "answers, but too few nodes are up to check a login at the roles' consistency level"


def is_local(host: str) -> bool:
    """Whether ``host`` is this machine (every 127.x.y.z address is loopback on Linux)."""
    return host in LOCAL_HOSTS or host.startswith("127.")


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
    #: What kind of service (``--only`` selects by it): the nodes of one kind share it.
    kind: str = ""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        #: Services that must be healthy before this one starts (a seed, the master).
        self.needs: list[EmbeddedService] = []
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
        return is_local(self.host)

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
        """Start if not running and wait until healthy (idempotent). Returns whether a process was
        started."""
        started = self.launch()
        self.wait_healthy()
        return started

    def launch(self) -> bool:
        """Spawn the process unless it runs, without waiting for it. Returns whether it spawned."""
        if not self.embedded or self.proc.pid() is not None:
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
        return True

    def wait_healthy(self) -> None:
        """Wait until the probe passes; an error naming the node, its log and its last lines if the
        process exits or the start timeout passes."""
        if not self.embedded:
            return
        self.proc.wait_until(lambda: self.probe() is None, timeout=self.start_timeout, what="healthy")

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


def _node_name(kind: str, node: int, nodes: int) -> str:
    return kind if nodes == 1 else f"{kind}-{node}"


class BrokerService(EmbeddedService):
    """Apache Kafka, one KRaft node (broker and controller) of the bootstrap list's, from Maven
    Central's server JARs."""

    kind = "broker"
    marker = "kafka.Kafka"
    start_timeout = 90.0

    def __init__(self, settings: Settings, node: int = 1) -> None:
        self.node = node
        self.addresses = [host_port(a, 9092) for a in settings.kafka.bootstrap_servers.split(",")]
        self.name = _node_name(self.kind, node, len(self.addresses))
        super().__init__(settings)

    @cached_property
    def _hostport(self) -> tuple[str, int]:
        return self.addresses[self.node - 1]

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
        return self.settings.state_dir / self.name

    def _secured(self) -> kafka_dist.Secured | None:
        if not self.settings.secure:
            return None
        files = tls.ensure(self.settings.state_dir)
        logins = secure.principals(self.settings.state_dir)
        return kafka_dist.Secured(
            keystore=files.keystore, keystore_password=files.keystore_password.read_text(), ca=files.ca,
            username=logins["admin"]["username"], password=logins["admin"]["password"],
            users=tuple((login["username"], login["password"]) for login in logins.values()),
        )  # fmt: skip

    def prepare(self) -> None:
        kafka = self.settings.kafka
        secured = self._secured()
        kafka_dist.write_config(
            self.data_dir, kafka, host=self.host, port=self.port, node_id=self.node, nodes=self.addresses,
            secured=secured,
        )  # fmt: skip
        cluster_id = None
        if len(self.addresses) > 1:  # the nodes of one cluster are formatted with one id
            id_file = self.settings.state_dir / "kafka-cluster-id"
            if not id_file.exists():
                id_file.parent.mkdir(parents=True, exist_ok=True)
                id_file.write_text(kafka_dist.new_cluster_id())
            cluster_id = id_file.read_text().strip()
        scram = list(secured.users) if secured else []
        kafka_dist.format_once(self.data_dir, self.settings.cache_dir, options=kafka.jvm_options,
                               cluster_id=cluster_id, scram=scram)  # fmt: skip

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

        config = {**self.settings.kafka.client_config(), "socket.timeout.ms": 2000}
        if self.embedded:  # this node's own view, not any node's
            config["bootstrap.servers"] = self.address
        try:
            meta = AdminClient(config).list_topics(timeout=3)
        except Exception as exc:  # any client error means "not healthy", with its text
            return f"metadata request failed: {exc}"
        # Listening comes before the broker has registered with its controller.
        if not meta.brokers:
            return "no broker registered yet"
        if self.embedded and self.node not in meta.brokers:
            return f"node {self.node} not registered yet"
        return None


class RegistryService(EmbeddedService):
    """lambdalake's own Confluent-API schema registry (``lambdalake.infra.registry``), its state in
    ``_schemas``."""

    name = "registry"
    kind = "registry"
    marker = "lambdalake.infra.registry"
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
        return [sys.executable, "-m", self.marker, "--host", self.host, "--port", str(self.port)]

    def env(self) -> dict[str, str]:
        return self.settings.to_env()

    def probe(self) -> str | None:
        registry = self.settings.registry
        auth = None
        if registry.basic_auth_user_info is not None:
            name, _, password = registry.basic_auth_user_info.get_secret_value().partition(":")
            auth = (name, password)
        verify: Any = True
        if registry.url.startswith("https:"):
            from lambdalake.writer_schemas import tls_context

            verify = tls_context(registry.client_config())
        try:
            resp = httpx.get(f"{registry.url}/subjects", timeout=2, auth=auth, verify=verify)
        except httpx.HTTPError as exc:
            return f"not answering: {exc.__class__.__name__}"
        return None if resp.status_code == 200 else f"HTTP {resp.status_code}"


class CassandraService(EmbeddedService):
    """Apache Cassandra 5.0 from Maven Central's ``cassandra-all``, run on Java 17 directly: one node
    per contact point, all on the same ports (each on a loopback address of its own)."""

    kind = "cassandra"
    marker = "org.apache.cassandra.service.CassandraDaemon"
    start_timeout = 180.0

    def __init__(self, settings: Settings, node: int = 1) -> None:
        self.node = node
        self.hosts = settings.cassandra.contact_points
        self.name = _node_name(self.kind, node, len(self.hosts))
        super().__init__(settings)
        # A new ring's nodes join with nothing to stream (at once); a node added to a ring that
        # holds data streams its share first.
        self.new_ring = not any(
            (settings.state_dir / _node_name(self.kind, i, len(self.hosts)) / "data").exists()
            for i in range(1, len(self.hosts) + 1)
        )

    @property
    def host(self) -> str:
        return self.hosts[self.node - 1]

    @property
    def port(self) -> int:
        return self.settings.cassandra.port

    def port_setting_hint(self) -> str:
        return "LAMBDALAKE_CASSANDRA__PORT=<port>, LAMBDALAKE_CASSANDRA__STORAGE_PORT=<port>"

    def ports(self) -> list[int]:
        return [self.port, self.settings.cassandra.storage_port]

    @property
    def home(self) -> Path:
        return self.settings.state_dir / self.name

    def prepare(self) -> None:
        keystore = tls.ensure(self.settings.state_dir).bundle if self.settings.secure else None
        cassandra_dist.write_config(
            self.home, self.settings.cassandra, host=self.host, seed=self.hosts[0],
            # A secured ring's later nodes stream what they replicate: the roles the first node made.
            bootstrap=len(self.hosts) == 1 or not self.new_ring or self.settings.secure, keystore=keystore,
            ring=len(self.hosts) > 1,
        )  # fmt: skip

    def argv(self) -> list[str]:
        return cassandra_dist.java_argv(
            self.home,
            self.settings.cache_dir,
            heap=self.settings.cassandra.heap,
            options=self.settings.cassandra.jvm_options,
            ring=len(self.hosts) > 1,
        )

    def probe(self) -> str | None:
        if not port_open(self.host, self.port):
            return "not listening"
        reason = self._query(self.settings.cassandra, "SELECT release_version FROM system.local")
        if reason is not None and self.settings.secure and self.node == 1:
            if "refused the login" in reason:
                return self._first_login()
            if reason == LOGINS_WAIT and len(self.hosts) > 1:
                # The roles are replicated on every node: the first one alone cannot check a login at
                # their quorum, and the nodes that can start after it.
                return None
        return reason

    def _query(self, cassandra: CassandraSettings, *statements: str) -> str | None:
        """Run ``statements`` on this node as ``cassandra``'s login: None, or why they failed."""
        from cassandra.cluster import Cluster

        from lambdalake.cassandra.session import logins_unavailable, refusal

        cluster = Cluster(
            [self.host], port=self.port, **cassandra.driver_options(),
            connect_timeout=3, control_connection_timeout=3,
        )  # fmt: skip
        try:
            session = cluster.connect()
            for statement in statements:
                session.execute(statement, timeout=10)
        except Exception as exc:  # the driver raises many types; all mean "not yet"
            refused = refusal(exc, cassandra)  # the clients' own reading of a refused login or certificate
            if refused is not None:
                return refused.message
            if logins_unavailable(exc):
                return LOGINS_WAIT
            return f"CQL query failed: {exc.__class__.__name__}"
        finally:
            cluster.shutdown()
        return None

    def _first_login(self) -> str | None:
        """A secured node's first start: as Cassandra's default superuser, create the platform's
        role (``principals.json``), replicate the roles to every node, and retire the default
        login (its password replaced by one nobody keeps)."""
        logins = secure.principals(self.settings.state_dir)
        if "admin" not in logins:
            return "no login recorded: run `lambdalake up --secure`"
        default = self.settings.cassandra.model_copy(
            update={"username": "cassandra", "password": SecretStr("cassandra")}
        )
        nodes = len(self.hosts)
        # The admin a superuser; the other roles log in with no rights until deploy grants them theirs.
        roles = [
            f"CREATE ROLE IF NOT EXISTS {login['username']} WITH PASSWORD = '{login['password']}' "
            f"AND LOGIN = true AND SUPERUSER = {str(role == 'admin').lower()}"
            for role, login in logins.items()
        ]
        # The default login retired before the roles are replicated at the node count: on a ring of
        # several, this node alone cannot read a role at their quorum (the later nodes stream them).
        failed = self._query(
            default,
            *roles,
            f"ALTER ROLE cassandra WITH PASSWORD = '{secrets.token_urlsafe(24)}'",
            "ALTER KEYSPACE system_auth WITH replication = "
            f"{{'class': 'NetworkTopologyStrategy', 'datacenter1': {nodes}}}",
        )
        if failed is not None:
            return failed
        # The node's credentials cache (credentials_validity, 2 s) may take the old password a
        # little longer: `up` returns once the default login is refused.
        deadline = time.monotonic() + 30
        while (still := self._query(default, "SELECT release_version FROM system.local")) is None:
            if time.monotonic() > deadline:
                return "the default login 'cassandra' is still accepted after its password changed"
            time.sleep(0.5)
        return None if "refused the login" in still or (still == LOGINS_WAIT and nodes > 1) else still


class ObjectStoreService(EmbeddedService):
    """The S3-compatible store of an ``s3://`` storage root (s3proxy, ``infra.s3proxy_dist``) when
    ``object_store.endpoint`` is on this machine; its buckets are folders under the state folder."""

    name = "object-store"
    kind = "object-store"
    marker = "org.gaul.s3proxy.Main"
    start_timeout = 60.0

    @cached_property
    def _url(self):
        return urlparse(self.settings.object_store.endpoint)

    @property
    def host(self) -> str:
        return self._url.hostname or "127.0.0.1"

    @property
    def port(self) -> int:
        return self._url.port or (443 if self._url.scheme == "https" else 80)

    @property
    def home(self) -> Path:
        return self.settings.state_dir / self.name

    def port_setting_hint(self) -> str:
        return "LAMBDALAKE_OBJECT_STORE__ENDPOINT=http://127.0.0.1:<port>"

    def prepare(self) -> None:
        s3proxy_dist.write_config(self.home, self.settings.object_store, host=self.host, port=self.port,
                                  bucket=bucket(self.settings.storage_root))  # fmt: skip

    def argv(self) -> list[str]:
        return s3proxy_dist.java_argv(self.home, self.settings.cache_dir)

    def probe(self) -> str | None:
        # Any S3 answer means it serves (anonymous requests are refused with 403).
        try:
            resp = httpx.get(self.settings.object_store.endpoint, timeout=2)
        except httpx.HTTPError as exc:
            return f"not answering: {exc.__class__.__name__}"
        return None if resp.status_code < 500 else f"HTTP {resp.status_code}"


def _spark_master(settings: Settings) -> tuple[str, int] | None:
    """The standalone master's (host, port) when ``spark.master`` is a ``spark://`` address."""
    master = settings.spark.master
    if not master.startswith("spark://") or "," in master:
        return None
    return host_port(master.removeprefix("spark://"), 7077)


class SparkService(EmbeddedService):
    """A daemon of a Spark standalone cluster, from pyspark's own JARs (``spark-class``)."""

    kind = "spark"
    start_timeout = 90.0

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.master = _spark_master(settings) or ("127.0.0.1", 7077)

    @property
    def master_url(self) -> str:
        return f"spark://{joined(*self.master)}"

    @property
    def master_ui(self) -> str:
        return f"http://{joined(self.master[0], self.master[1] + 1)}"

    @property
    def embedded(self) -> bool:
        return _spark_master(self.settings) is not None and is_local(self.master[0])

    def env(self) -> dict[str, str]:
        import pyspark

        return {
            "SPARK_HOME": str(Path(pyspark.__file__).parent),
            "SPARK_LOCAL_IP": self.host,
            "SPARK_LOG_DIR": str(self.settings.state_dir / self.name / "logs"),
            # The daemons only schedule; executors get the worker's memory.
            "SPARK_DAEMON_MEMORY": "256m",
            "PYSPARK_PYTHON": sys.executable,
        }

    def spark_class(self) -> str:
        import pyspark

        return str(Path(pyspark.__file__).parent / "bin" / "spark-class")

    def cluster_state(self) -> dict | str:
        """The master's JSON state, or why it cannot be read."""
        try:
            resp = httpx.get(f"{self.master_ui}/json/", timeout=2)
        except httpx.HTTPError as exc:
            return f"master not answering: {exc.__class__.__name__}"
        if resp.status_code != 200:
            return f"master answered HTTP {resp.status_code}"
        try:
            return resp.json()
        except ValueError:  # its web UI answers before the JSON API does
            return "master not ready"


class SparkMasterService(SparkService):
    """The standalone master of ``spark.master``; each application takes 2 cores unless it asks
    for others (``spark.cores.max``), so the speed job and a batch run share the workers. They are
    given as one executor on one worker rather than one core on each (``spreadOut``): on one machine
    a second executor JVM, with its Python workers, buys no cores and costs its start and memory."""

    name = "spark-master"
    marker = "org.apache.spark.deploy.master.Master"

    @property
    def host(self) -> str:
        return self.master[0]

    @property
    def port(self) -> int:
        return self.master[1]

    def ports(self) -> list[int]:
        return [self.port, self.port + 1]

    def port_setting_hint(self) -> str:
        return "LAMBDALAKE_SPARK__MASTER=spark://127.0.0.1:<port> (its web UI takes the next port)"

    @property
    def recovery_dir(self) -> Path:
        return self.settings.state_dir / self.name / "recovery"

    def prepare(self) -> None:
        # What the master recovers from is only worth its wait while a worker of it runs: recovery
        # waits for every recorded worker and application to answer, and a stopped worker comes
        # back under a new id, so a whole cluster's start would wait the recovery timeout for nothing.
        workers = [SparkWorkerService(self.settings, i) for i in range(1, self.settings.spark.workers + 1)]
        if not any(w.proc.pid() is not None for w in workers) and self.recovery_dir.exists():
            shutil.rmtree(self.recovery_dir)
        self.recovery_dir.mkdir(parents=True, exist_ok=True)

    def env(self) -> dict[str, str]:
        # FILESYSTEM recovery: a master restarted alone (`up --only spark-master`) takes back its
        # workers and running applications. Without it the workers re-register, the new master
        # kills the executors it does not know, and a running speed job is left without any.
        opts = (
            "-Dspark.deploy.defaultCores=2 -Dspark.deploy.spreadOut=false "
            f"-Dspark.deploy.recoveryMode=FILESYSTEM -Dspark.deploy.recoveryDirectory={self.recovery_dir} "
            "-Dspark.deploy.recoveryTimeout=20s"
        )
        return {**super().env(), "SPARK_MASTER_OPTS": opts}

    def argv(self) -> list[str]:
        return [self.spark_class(), "org.apache.spark.deploy.master.Master", "--host", self.host,
                "--port", str(self.port), "--webui-port", str(self.port + 1)]  # fmt: skip

    def probe(self) -> str | None:
        state = self.cluster_state()
        if isinstance(state, str):
            return state
        return None if state.get("status") == "ALIVE" else f"master {state.get('status', '?')}"


class SparkWorkerService(SparkService):
    """Worker ``node`` of the standalone cluster, on loopback address 127.0.0.<node + 1>."""

    marker = "org.apache.spark.deploy.worker.Worker"

    def __init__(self, settings: Settings, node: int) -> None:
        self.node = node
        self.name = f"spark-worker-{node}"
        super().__init__(settings)

    @property
    def host(self) -> str:
        return f"127.0.0.{self.node + 1}"

    @property
    def port(self) -> int:
        return self.master[1] + 1 + self.node  # its web UI (the worker's own port is chosen free)

    def argv(self) -> list[str]:
        spark = self.settings.spark
        work = self.settings.state_dir / self.name / "work"
        return [self.spark_class(), "org.apache.spark.deploy.worker.Worker", self.master_url,
                "--host", self.host, "--cores", str(spark.worker_cores), "--memory", spark.worker_memory,
                "--webui-port", str(self.port), "--work-dir", str(work)]  # fmt: skip

    def probe(self) -> str | None:
        state = self.cluster_state()
        if isinstance(state, str):
            return state
        mine = [w for w in state.get("workers", []) if w.get("host") == self.host]
        if any(w.get("state") == "ALIVE" for w in mine):
            return None
        return "not registered with the master" if not mine else f"worker {mine[-1].get('state')}"


def all_services(settings: Settings) -> list[EmbeddedService]:
    """Every node, in start order: the brokers (together: a KRaft quorum needs two of three), the
    registry (its state is on the brokers), the Cassandra seed then the other nodes, the object store
    when the storage root is an ``s3://`` one, and the Spark master then its workers when
    ``spark.master`` is a standalone master of this machine."""
    brokers: list[EmbeddedService] = [
        BrokerService(settings, i) for i in range(1, len(settings.kafka.bootstrap_servers.split(",")) + 1)
    ]
    registry = RegistryService(settings)
    registry.needs = brokers
    cassandra: list[EmbeddedService] = [
        CassandraService(settings, i) for i in range(1, len(settings.cassandra.contact_points) + 1)
    ]
    for node in cassandra[1:]:
        node.needs = cassandra[:1]
    services = [*brokers, registry, *cassandra]
    if on_object_store(settings.storage_root):
        services.append(ObjectStoreService(settings))
    master = SparkMasterService(settings)
    if master.embedded:
        workers: list[EmbeddedService] = [
            SparkWorkerService(settings, i) for i in range(1, settings.spark.workers + 1)
        ]
        for worker in workers:
            worker.needs = [master]
        services += [master, *workers]
    return services


def select(settings: Settings, only: list[str] | None) -> list[EmbeddedService]:
    """Every service, or those ``only`` names (a node's name, or its kind for all its nodes)."""
    services = all_services(settings)
    if not only:
        return services
    names = {s.name for s in services} | {s.kind for s in services}
    unknown = set(only) - names
    if unknown:
        raise LambdalakeError(f"unknown service(s): {', '.join(sorted(unknown))}", fix=f"use {sorted(names)}")
    return [s for s in services if s.name in only or s.kind in only]


def start_all(
    services: list[EmbeddedService], *, progress: Callable[[EmbeddedService, bool, float], None] | None = None
) -> list[EmbeddedService]:
    """Start every service whose needs are healthy, together, and wait until all are healthy.

    Returns the services it spawned. ``progress(service, spawned, seconds)`` is called as each
    becomes healthy.

    Raises:
        LambdalakeError: A node exited or was not healthy in its time, naming it, its log and the
            log's last lines; whatever this call spawned is stopped first.
    """
    t0 = time.monotonic()
    pending = list(services)
    starting: dict[str, tuple[EmbeddedService, bool, float]] = {}
    # A need outside the selection (``up --only registry`` while the brokers run) is met by the
    # node that already runs: it is probed, never started from here.
    healthy: set[str] = _unselected_needs_healthy(services)
    spawned: list[EmbeddedService] = []
    try:
        while pending or starting:
            for service in [s for s in pending if all(n.name in healthy for n in s.needs)]:
                pending.remove(service)
                if not service.embedded:
                    healthy.add(service.name)
                    continue
                launched = service.launch()
                if launched:
                    spawned.append(service)
                starting[service.name] = (service, launched, time.monotonic())
            for name, (service, launched, since) in list(starting.items()):
                if service.probe() is None:
                    healthy.add(name)
                    del starting[name]
                    if progress is not None:
                        progress(service, launched, time.monotonic() - t0)
                elif not launched and time.monotonic() - since > service.start_timeout:
                    raise LambdalakeError(
                        f"{service.name} runs (pid {service.proc.pid()}) but does not answer on "
                        f"{service.address}: {service.probe()}",
                        fix="it may run with other settings: `lambdalake down`, then `lambdalake up`",
                    )
                elif service.proc.exited() or time.monotonic() - since > service.start_timeout:
                    proc = service.proc
                    why = (
                        "exited while starting"
                        if proc.exited()
                        else (f"was not healthy within {service.start_timeout:.0f}s ({service.probe()})")
                    )
                    raise LambdalakeError(
                        f"{service.name} on {service.address} {why}. Last lines of {proc.log_file}:\n"
                        f"{proc.log_tail()}",
                        fix=f"read {proc.log_file}; `lambdalake down`, then `lambdalake up` retries",
                    )  # fmt: skip
            if pending and not starting and not any(all(n.name in healthy for n in s.needs) for s in pending):
                blocked = ", ".join(s.name for s in pending)
                raise LambdalakeError(f"{blocked} cannot start: what they need did not start",
                                      fix="`lambdalake status`, then `lambdalake up` again")  # fmt: skip
            time.sleep(0.5)
    except BaseException:
        for service in reversed(spawned):
            service.stop()
        raise
    return spawned


def _unselected_needs_healthy(services: list[EmbeddedService], *, patience: float = 20.0) -> set[str]:
    """The names of the needs outside ``services``, each checked healthy.

    A node that runs but does not answer yet (just started by another ``up``) gets ``patience``
    seconds; one that answers by then counts as healthy.

    Raises:
        LambdalakeError: A need is not running or does not answer, naming it and the command that
            starts it.
    """
    selected = {s.name for s in services}
    outside = {n.name: n for s in services for n in s.needs if n.name not in selected}
    deadline = time.monotonic() + patience
    down: dict[str, str] = {}
    for name, need in outside.items():
        if not need.embedded:
            continue  # a configured cluster's node: not this machine's to check or start
        while (reason := need.probe()) is not None:
            if need.proc.pid() is None:
                reason = "not running"
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if reason is not None:
            down[name] = reason
    if down:
        needers = sorted({s.name for s in services if any(n.name in down for n in s.needs)})
        what = "; ".join(
            f"{name} is {reason}" if reason == "not running" else f"{name} does not answer ({reason})"
            for name, reason in down.items()
        )
        raise LambdalakeError(
            f"{', '.join(needers)} cannot start: {what}",
            fix=" or ".join(f"`lambdalake up --only {name}`" for name in down) + ", or `lambdalake up`",
        )
    return set(outside)


def stop_all(services: list[EmbeddedService]) -> list[EmbeddedService]:
    """Stop the services in reverse start order, the nodes of one kind together (a KRaft broker
    stopped after the others waits for a controller quorum that is gone). Returns those stopped."""
    from concurrent.futures import ThreadPoolExecutor

    kinds = list(dict.fromkeys(s.kind for s in services))
    stopped: list[EmbeddedService] = []
    for kind in reversed(kinds):
        nodes = [s for s in services if s.kind == kind]
        with ThreadPoolExecutor(max_workers=len(nodes)) as pool:
            results = list(pool.map(lambda s: s.stop(), nodes))
        stopped += [s for s, was in zip(nodes, results, strict=True) if was]
    return stopped


@contextmanager
def running(settings: Settings, only: list[str] | None = None) -> Iterator[list[EmbeddedService]]:
    """Start the services (all, or ``only`` these) for the block, and stop after it those it started."""
    services = select(settings, only)
    started: list[EmbeddedService] = []
    try:
        started = start_all(services)
        yield services
    finally:
        # Only what this block started: a service that ran before it (another state folder's, or
        # `lambdalake up`'s) keeps running.
        stop_all(started)
