"""The one typed settings model of the platform.

Every value has an embedded default that works on one machine (docs/production.md: "What runs locally") and
is overridden by environment variables with the ``LAMBDALAKE_`` prefix; nested groups use ``__``::

    LAMBDALAKE_KAFKA__BOOTSTRAP_SERVERS=broker-1:9092,broker-2:9092
    LAMBDALAKE_KAFKA__SECURITY_PROTOCOL=SASL_SSL
    LAMBDALAKE_KAFKA__SASL_PASSWORD=...          # a SecretStr: never printed or logged
    LAMBDALAKE_CASSANDRA__CONTACT_POINTS='["cass-1","cass-2"]'

The same code talks to the embedded services or to real clusters by configuration alone.
"""

from __future__ import annotations

import json
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import (
    BaseModel,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict
from pydantic_settings.exceptions import SettingsError

from lambdalake import secure
from lambdalake.errors import ConfigurationError
from lambdalake.secure import Role

PROJECT_ROOT = Path(__file__).resolve().parent.parent
MASK = "**********"
#: Words that mark a free-form setting (``LAMBDALAKE_KAFKA__EXTRA``) as a secret.
SECRET_WORDS = ("password", "secret", "token", "key", "credential", "jaas")
_HOST = r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+)"
_HOSTPORT = re.compile(rf"^{_HOST}:(\d{{1,5}})$")
_SPARK_MASTER = re.compile(r"^(local(\[(\*|\d+)(,\d+)?\])?|yarn|(spark|k8s|mesos)://.+)$")


def mask_url(url: str) -> str:
    """``url`` with any user info (``user:password@``) masked, for logs and error messages."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=f"{MASK}@{parts.netloc.rpartition('@')[2]}"))


def is_secret_name(name: str) -> bool:
    return any(word in name.lower() for word in SECRET_WORDS)


def _jaas_quoted(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def _port(value: str) -> bool:
    return value.isdigit() and 1 <= int(value) <= 65535


#: The JVM options of the quick JIT: C1 alone, no C2 compilations (cheaper for short or lightly
#: loaded JVMs on few cores; measured in BENCHMARKS.md). C1 alone shrinks the code cache to 48 MB,
#: which a driver running many queries filled ("Out of space in CodeCache for adapters", the test
#: process after ~200 tests): the size the full JIT reserves is kept.
QUICK_JIT = ["-XX:TieredStopAtLevel=1", "-XX:ReservedCodeCacheSize=240m"]


class KafkaSettings(BaseModel):
    """Connection to the Kafka cluster (librdkafka names in ``client_config``)."""

    bootstrap_servers: str = Field(
        "127.0.0.1:9092",
        description="comma-separated host:port pairs",
        examples=["broker-1:9092,broker-2:9092"],
    )
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_ca_location: str | None = None
    ssl_certificate_location: str | None = None
    ssl_key_location: str | None = None
    ssl_key_password: SecretStr | None = None
    #: Any further librdkafka properties, passed through unchanged (e.g. ``{"client.rack": "a"}``).
    extra: dict[str, str] = Field(default_factory=dict)
    #: Any further Java client properties for Spark's Kafka source (``java_client_config``).
    java_extra: dict[str, str] = Field(default_factory=dict)
    #: Seconds to wait for the cluster before a command gives up with an error naming the fix.
    connect_timeout_s: float = Field(5.0, gt=0, description="seconds, above 0", examples=["10"])
    #: Embedded broker only: the port of its KRaft controller. None: the broker's port plus one, so
    #: two platforms on one machine with other broker ports never clash.
    controller_port: int | None = Field(
        None, ge=1, le=65535, description="a port number 1-65535", examples=["9093"]
    )
    #: Replicas of each topic ``deploy`` creates (a pipeline's ``topic.replication_factor`` wins).
    #: None: 3, or the brokers the cluster has if fewer. Above the brokers there are: refused.
    replication_factor: int | None = Field(None, ge=1, description="replicas, 1 or more", examples=["3"])
    #: ``min.insync.replicas`` of the topics ``deploy`` creates (a pipeline's ``topic.config`` wins):
    #: with acks=all a write is acknowledged once this many replicas hold it. None: 2 when the
    #: replication factor is 3 or more (one broker may be down and no acknowledged write is lost),
    #: else 1.
    min_insync_replicas: int | None = Field(None, ge=1, description="replicas, 1 or more", examples=["2"])
    #: Embedded broker only: its JVM heap (Kafka's own launcher uses 1G; 512M per node of three).
    heap: str = "1G"
    #: Embedded broker only: more JVM options, after the launcher's own (e.g. :data:`QUICK_JIT`, which
    #: the test suite gives its services, see BENCHMARKS.md).
    jvm_options: list[str] = Field(default_factory=list)

    @field_validator("bootstrap_servers")
    @classmethod
    def _bootstrap(cls, value: str) -> str:
        addresses = [a.strip() for a in value.split(",") if a.strip()]
        bad = [a for a in addresses if not (m := _HOSTPORT.match(a)) or not _port(m.group(2))]
        if not addresses or bad:
            raise ValueError(f"{bad or value!r} is not a list of host:port with ports 1-65535")
        return ",".join(addresses)

    def embedded_controller_port(self, broker_port: int) -> int:
        if self.controller_port is not None:
            return self.controller_port
        return broker_port + 1 if broker_port < 65535 else broker_port - 1

    def client_config(self) -> dict[str, Any]:
        """librdkafka configuration shared by every producer, consumer and admin client."""
        conf: dict[str, Any] = {
            "bootstrap.servers": self.bootstrap_servers,
            "security.protocol": self.security_protocol,
        }
        optional = {
            "sasl.mechanism": self.sasl_mechanism,
            "sasl.username": self.sasl_username,
            "sasl.password": self.sasl_password.get_secret_value() if self.sasl_password else None,
            "ssl.ca.location": self.ssl_ca_location,
            "ssl.certificate.location": self.ssl_certificate_location,
            "ssl.key.location": self.ssl_key_location,
            "ssl.key.password": self.ssl_key_password.get_secret_value() if self.ssl_key_password else None,
        }
        conf.update({k: v for k, v in optional.items() if v is not None})
        conf.update(self.extra)
        return conf

    def java_client_config(self) -> dict[str, str]:
        """The same connection as Java client properties (Spark's Kafka source takes them as
        ``kafka.<name>``): SASL credentials as a JAAS line, certificates as PEM."""
        conf = {"bootstrap.servers": self.bootstrap_servers, "security.protocol": self.security_protocol}
        if self.sasl_mechanism is not None:
            conf["sasl.mechanism"] = self.sasl_mechanism
        if self.sasl_username is not None:
            module = (
                "org.apache.kafka.common.security.scram.ScramLoginModule"
                if (self.sasl_mechanism or "").upper().startswith("SCRAM")
                else "org.apache.kafka.common.security.plain.PlainLoginModule"
            )
            password = self.sasl_password.get_secret_value() if self.sasl_password else ""
            conf["sasl.jaas.config"] = (
                f'{module} required username="{_jaas_quoted(self.sasl_username)}" '
                f'password="{_jaas_quoted(password)}";'
            )
        if self.ssl_ca_location is not None:
            conf |= {"ssl.truststore.type": "PEM", "ssl.truststore.location": self.ssl_ca_location}
        if self.ssl_certificate_location is not None and self.ssl_key_location is not None:
            # Java takes a PEM key and chain by value, not by path (KIP-651).
            conf |= {
                "ssl.keystore.type": "PEM",
                "ssl.keystore.certificate.chain": Path(self.ssl_certificate_location).read_text(),
                "ssl.keystore.key": Path(self.ssl_key_location).read_text(),
            }
            if self.ssl_key_password is not None:
                conf["ssl.key.password"] = self.ssl_key_password.get_secret_value()
        conf.update(self.java_extra)
        return conf


class RegistrySettings(BaseModel):
    """Confluent-compatible schema registry."""

    url: str = Field(
        "http://127.0.0.1:8081", description="an http(s) URL", examples=["https://registry.example.com:8081"]
    )
    basic_auth_user_info: SecretStr | None = None
    #: A PEM file of the CA that signed the registry's certificate (an https URL); None: the
    #: system's trusted CAs.
    ssl_ca_location: str | None = None
    #: Compacted topic where the embedded registry keeps its state (as Confluent's does).
    schemas_topic: str = "_schemas"
    default_compatibility: Literal[
        "NONE", "BACKWARD", "BACKWARD_TRANSITIVE", "FORWARD", "FORWARD_TRANSITIVE", "FULL", "FULL_TRANSITIVE"
    ] = "BACKWARD"

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        parts = urlsplit(value)
        try:
            port_ok = parts.port is None or 1 <= parts.port <= 65535
        except ValueError:
            port_ok = False
        if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
            raise ValueError(f"{mask_url(value)!r} is not an http(s) URL with a host and a valid port")
        return value.rstrip("/")

    def client_config(self) -> dict[str, Any]:
        conf: dict[str, Any] = {"url": self.url}
        if self.basic_auth_user_info is not None:
            conf["basic.auth.user.info"] = self.basic_auth_user_info.get_secret_value()
        if self.ssl_ca_location is not None:
            conf["ssl.ca.location"] = self.ssl_ca_location
        return conf

    def task_config(self) -> dict[str, Any]:
        """:meth:`client_config` for Spark tasks, which may run on hosts without this one's files:
        the CA travels as its PEM text (``ssl.ca.pem``) instead of a path."""
        conf = self.client_config()
        location = conf.pop("ssl.ca.location", None)
        if location is not None:
            conf["ssl.ca.pem"] = Path(location).read_text()
        return conf


class CassandraSettings(BaseModel):
    """Cassandra cluster holding speed and batch views."""

    contact_points: list[str] = Field(
        default_factory=lambda: ["127.0.0.1"],
        min_length=1,
        description="a JSON list of host names",
        examples=['["cass-1","cass-2"]'],
    )
    port: int = Field(9042, ge=1, le=65535, description="a port number 1-65535", examples=["9042"])
    keyspace: str = "lambdalake"
    #: None: the newest version both the cluster and the driver speak (v5 with Cassandra 4.x/5.x).
    protocol_version: int | None = Field(
        None, ge=3, le=6, description="a CQL protocol version 3-6", examples=["4"]
    )
    username: str | None = None
    password: SecretStr | None = None
    #: A PEM file of the CA that signed the nodes' certificates: set, every connection (the Python
    #: driver's and the Real-time JVM writer's) speaks TLS and checks the node's certificate.
    ssl_ca_location: str | None = None
    #: With TLS: check that a node's certificate names the address it was reached at. Off only for
    #: clusters whose certificates do not name their nodes (the chain is still checked).
    ssl_check_hostname: bool = True
    #: CQL replication map used when the deploy step creates the keyspace. None:
    #: NetworkTopologyStrategy with 3 replicas in each datacenter, or its nodes if fewer. A factor
    #: above a datacenter's nodes is refused.
    replication: dict[str, str | int] | None = Field(
        None,
        description="a JSON CQL replication map",
        examples=['{"class": "NetworkTopologyStrategy", "dc1": 3}'],
    )
    #: The consistency level of every read and write the layers make (one execution profile):
    #: QUORUM reads and QUORUM writes overlap in at least one replica whatever the replication
    #: factor, so a merged answer reflects every acknowledged speed write and every published batch
    #: version while a minority of replicas is down.
    consistency: Literal["ONE", "TWO", "THREE", "QUORUM", "LOCAL_QUORUM", "EACH_QUORUM", "ALL"] = Field(
        "QUORUM", description="a CQL consistency level", examples=["LOCAL_QUORUM"]
    )
    #: The serial consistency of lightweight transactions (leases, the active-version switch).
    serial_consistency: Literal["SERIAL", "LOCAL_SERIAL"] = Field(
        "SERIAL", description="SERIAL or LOCAL_SERIAL", examples=["LOCAL_SERIAL"]
    )
    #: Rows per unlogged batch when writing views (rows of one partition are kept together). A
    #: request per row cost ~9x more here (4.4k vs 38.7k rows/s, Cassandra 2.1 on 2 cores); 1 sends
    #: every row alone.
    batch_rows: int = Field(default=32, ge=1, le=500)
    #: Rows per unlogged batch in bulk writes: a batch publish, a replay's rewrite of whole epochs
    #: (larger batches pay off; a batch over the cluster's size limit is split and sent again).
    publish_batch_rows: int = Field(default=100, ge=1, le=1000)
    #: Seconds a writer's lease (lambdalake.lease) lasts without a renewal: how long a writer killed
    #: with -9 blocks the next one at most. Renewed every third of it.
    lease_ttl_s: int = Field(default=30, ge=3, le=3600, description="seconds, 3-3600", examples=["30"])
    #: Seconds a schema change (CREATE/ALTER/DROP TABLE) waits for the nodes that are up to agree on
    #: the schema before the next step goes on; a node that is down takes it when it returns.
    schema_agreement_wait_s: int = Field(
        default=30, ge=1, le=600, description="seconds, 1-600", examples=["30"]
    )
    #: Embedded server only. Memtables (off the heap) get a quarter of it: a small heap makes a bulk
    #: publish flush its memtables over and over, each row costing Cassandra more CPU (the figures
    #: are in docs/benchmarks-log.md). 1G per node of three.
    heap: str = "3G"
    #: Embedded server only: more JVM options, after the launcher's own (as the broker's).
    jvm_options: list[str] = Field(default_factory=list)
    storage_port: int = Field(7000, ge=1, le=65535, description="a port number 1-65535", examples=["7000"])

    def driver_options(self) -> dict[str, Any]:
        """``Cluster`` arguments every session shares: the protocol version when one is pinned (the
        driver negotiates the newest otherwise), the login, and TLS with the CA to trust."""
        options: dict[str, Any] = {}
        if self.protocol_version is not None:
            options["protocol_version"] = self.protocol_version
        if self.username and self.password:
            from cassandra.auth import PlainTextAuthProvider

            options["auth_provider"] = PlainTextAuthProvider(self.username, self.password.get_secret_value())
        if self.ssl_ca_location:
            import ssl

            context = ssl.create_default_context(cafile=self.ssl_ca_location)
            context.check_hostname = self.ssl_check_hostname
            options["ssl_context"] = context
        return options


class SparkSettings(BaseModel):
    #: ``local[2,4]``: two cores, and a failed task (a broker or registry hiccup) is retried up to
    #: 4 times instead of failing the query at once, as on a cluster.
    master: str = Field(
        "local[2,4]",
        description="local[N], local[N,F], spark://host:port, k8s://https://host:port or yarn",
        examples=["spark://spark-master:7077"],
    )
    #: Extra Spark conf, e.g. ``{"spark.executor.memory": "4g"}``.
    conf: dict[str, str] = Field(default_factory=dict)
    #: Start the driver JVM from the class-data-sharing archive ``make setup`` builds, if there is one
    #: (see :mod:`lambdalake.spark.cds`).
    cds: bool = True
    #: Idle Python workers an executor keeps (unset: every one it forked, Spark's default). 1 keeps
    #: a caught-up speed job to one worker (less memory) at the cost of a fresh worker for a
    #: backlog's second task each micro-batch (slower draining it alone; the benchmarks log).
    #: ``spark.python.factory.idleWorkerMaxPoolSize`` in ``conf`` wins.
    idle_python_workers: int | None = Field(None, ge=1, description="workers, 1 or more", examples=["1"])
    #: Embedded standalone cluster only (``master`` a ``spark://`` address of this machine): the
    #: workers ``lambdalake up`` starts beside the master, each on a loopback address of its own.
    workers: int = Field(2, ge=1, le=8, description="workers, 1-8", examples=["2"])
    #: Embedded standalone cluster only: cores each worker offers (an application takes 2 at most,
    #: so the speed job and a batch run share the cluster).
    worker_cores: int = Field(2, ge=1, description="cores, 1 or more", examples=["2"])
    #: Embedded standalone cluster only: memory each worker offers its executors.
    worker_memory: str = "2g"

    @field_validator("master")
    @classmethod
    def _master(cls, value: str) -> str:
        if not _SPARK_MASTER.match(value):
            raise ValueError(f"{value!r} is not a Spark master URL")
        return value


class MasterSettings(BaseModel):
    """Compaction of the master dataset's small files by the speed job (:mod:`lambdalake.compaction`)."""

    #: Rewrite small files into large ones on a thread of the speed job (the rows stay as they are).
    compact: bool = Field(True, description="true or false", examples=["false"])
    #: Master dataset commits (micro-batches) between two rounds: 100 is about a minute at 1k events/s.
    compact_every_commits: int = Field(100, ge=1, description="commits, 1 or more", examples=["100"])
    #: Files of one event date, Kafka partition and size class rewritten together once this many gathered.
    compact_fan_in: int = Field(10, ge=2, le=10_000, description="files, 2-10000", examples=["10"])
    #: Files this large (MiB) are never rewritten (Delta's own target for optimized files: 1 GiB).
    compact_max_mb: int = Field(1024, ge=2, description="MiB, 2 or more", examples=["512"])
    #: Every 10th round deletes the files rounds removed longer ago than this (hours). A batch run
    #: reads the files of the master dataset version it started on: keep this above the longest run.
    vacuum_retention_hours: int = Field(168, ge=0, description="hours, 0 or more", examples=["168"])


class SpeedSettings(BaseModel):
    """The speed layer's jobs."""

    #: Which query writes the ``latest`` views: ``microbatch``, the speed job's archive pass (a
    #: processing-time micro-batch has a fixed cost even for one record), or ``realtime``, a
    #: Real-time Mode query of its own whose tasks run as long as a batch and write each record's
    #: candidates from the JVM as it arrives (:mod:`lambdalake.spark.realtime`). Both leave the same
    #: rows; the rest of the speed job (the master dataset, dead letters, windowed views) is the
    # micro-batch's.
    latest: Literal["microbatch", "realtime"] = Field(
        "microbatch", description="microbatch or realtime", examples=["realtime"]
    )
    #: Real-time Mode's batch duration: how often the query checkpoints its offsets, and so how much
    #: it reads again after a restart. Its tasks hold a core slot each for as long.
    realtime_batch_s: int = Field(5, ge=1, le=600, description="seconds, 1-600", examples=["5"])
    #: Seconds between the micro-batches of a speed job started without ``--trigger`` (``deploy``
    #: starts them so). 0, the default, starts the next as soon as one ends: the freshest answers. A
    #: micro-batch has a fixed cost (~1 s of a core here for 100 records), so under a trickle of events
    #: a job at 0 keeps a core busy; a few seconds cost a few seconds of freshness and far less CPU.
    trigger_s: float = Field(0.0, ge=0, le=3600, description="seconds, 0-3600", examples=["2"])


class ServingSettings(BaseModel):
    """The HTTP API (``lambdalake serve``)."""

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=1, le=65535, description="a port number 1-65535", examples=["8080"])
    #: Bearer token every request but ``/health`` must carry; None (default) leaves the API open.
    token: SecretStr | None = None
    #: Seconds the active-batch row is cached before it is read again.
    meta_ttl_s: float = Field(1.0, ge=0, description="seconds, 0 or more", examples=["1.0"])
    #: Worker processes of ``lambdalake serve`` (each with its own Cassandra session).
    workers: int = Field(1, ge=1, le=64, description="a number of processes 1-64", examples=["2"])
    #: HTTPS: the PEM certificate (chain) the API presents, and its private key. None (default):
    #: plain HTTP. ``up --secure`` makes them default to the embedded CA's server certificate.
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None

    @model_validator(mode="after")
    def _both_or_neither(self) -> ServingSettings:
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("give both serving.ssl_certfile and serving.ssl_keyfile, or neither")
        return self

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile is not None else "http"


class ObjectStoreSettings(BaseModel):
    """The S3-compatible store an ``s3://`` storage root lives on. ``lambdalake up`` runs one on this
    machine (s3proxy, its files under the state folder) when the endpoint is a local address."""

    endpoint: str = Field(
        "http://127.0.0.1:9000", description="an http(s) URL", examples=["https://s3.eu-west-1.amazonaws.com"]
    )
    region: str = "us-east-1"
    access_key: str = "lambdalake"
    #: The embedded store's own key by default; a real store's is a secret of the deployment.
    secret_key: SecretStr = SecretStr("lambdalake-embedded")
    #: Seconds a batch run (before it starts, and before it starts over when the store stopped it half
    #: way) and a speed job (before it restarts its queries) wait for a store that does not answer (one
    #: restarting, or down for a minute), then give up naming it.
    patience_s: float = Field(120.0, ge=0, le=3600, description="seconds, 0-3600", examples=["120"])


class Settings(BaseSettings):
    """All of lambdalake's configuration. Build it with :func:`get_settings` or directly in tests."""

    model_config = SettingsConfigDict(
        env_prefix="LAMBDALAKE_", env_nested_delimiter="__", extra="ignore", validate_default=True
    )

    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    registry: RegistrySettings = Field(default_factory=RegistrySettings)
    cassandra: CassandraSettings = Field(default_factory=CassandraSettings)
    spark: SparkSettings = Field(default_factory=SparkSettings)
    master: MasterSettings = Field(default_factory=MasterSettings)
    speed: SpeedSettings = Field(default_factory=SpeedSettings)
    serving: ServingSettings = Field(default_factory=ServingSettings)
    object_store: ObjectStoreSettings = Field(default_factory=ObjectStoreSettings)
    #: Where embedded services keep data, PID files and logs.
    state_dir: Path = PROJECT_ROOT / ".lambdalake"
    #: Installed service files (Cassandra's distribution), shared by every state folder.
    cache_dir: Path = PROJECT_ROOT / ".lambdalake" / "cache"
    #: Root for Delta tables and streaming checkpoints (a local path or an object-store URI).
    storage_root: str = str(PROJECT_ROOT / ".lambdalake" / "storage")
    pipelines_dir: Path = PROJECT_ROOT / "pipelines"
    schemas_dir: Path = PROJECT_ROOT / "schemas"
    #: Put before every pipeline's topic name (and so its dead-letter topic), e.g. ``staging.``, so
    #: several environments or runs can share one Kafka cluster. Schema subjects are not prefixed.
    topic_prefix: str = ""
    #: Nodes of each embedded service (``lambdalake up --nodes 3``, which records it in the state
    #: folder for the commands that follow). 3: three brokers, three Cassandra nodes on 127.0.0.1-3,
    #: a Spark standalone master and its workers; it only changes the defaults of the settings that
    #: describe a cluster (bootstrap list, contact points, Spark master, heaps), which win when set.
    nodes: int = Field(1, ge=1, le=9, description="a number of nodes 1-9", examples=["3"])
    #: The embedded services are secured (``lambdalake up --secure``, which records it in the state
    #: folder): Kafka speaks SASL_SSL (SCRAM-SHA-512), Cassandra asks for a login over TLS, the
    #: registry serves HTTPS with basic auth. It only changes the defaults of the settings that say
    #: how to reach them (the CA, the logins), which win when set.
    secure: bool = False
    #: Whose login a command of the secured embedded services uses (``up --secure`` made one
    #: principal per role, :mod:`lambdalake.grants` says what each may do): each command sets its
    #: own (``speed run``: speed, ``batch run``: batch, ``serve``: serving, ``produce``: producer);
    #: the set-up commands are the admin's. Logins given in the settings win over it.
    role: Role = "admin"
    #: The (service, field) pairs the secured defaults filled in: a child process derives them again
    #: for its own role, so :meth:`to_env` leaves them out.
    _from_state: set[tuple[str, str]] = PrivateAttr(default_factory=set)

    @model_validator(mode="after")
    def _secured_defaults(self) -> Settings:
        if "secure" not in self.model_fields_set and secure.recorded(self.state_dir):
            self.secure = True
        if not self.secure:
            return self
        self._fill_secured(
            secure.principals(self.state_dir).get(self.role), str(secure.ca_file(self.state_dir))
        )
        return self

    def _fill_secured(self, login: dict[str, str] | None, ca: str) -> None:
        """Fill the fields that say how to reach the secured services, unless set: TLS with the
        embedded CA, and ``login`` (a role's, from ``principals.json``) on each service."""
        filled = self._from_state

        def fill(service: BaseModel, field: str, value: Any) -> None:
            setattr(service, field, value)
            filled.add((type(service).__name__, field))

        kafka, cassandra, registry = self.kafka, self.cassandra, self.registry

        def set_by_user(service: BaseModel, *fields: str) -> bool:
            given = {f for f in fields if (type(service).__name__, f) not in filled}
            return bool(given & service.model_fields_set)

        if login and not set_by_user(kafka, "security_protocol", "sasl_username"):
            fill(kafka, "security_protocol", "SASL_SSL")
            fill(kafka, "sasl_mechanism", "SCRAM-SHA-512")
            fill(kafka, "sasl_username", login["username"])
            fill(kafka, "sasl_password", SecretStr(login["password"]))
            if not set_by_user(kafka, "ssl_ca_location"):
                fill(kafka, "ssl_ca_location", ca)
        if not set_by_user(cassandra, "ssl_ca_location"):
            fill(cassandra, "ssl_ca_location", ca)
        if login and not set_by_user(cassandra, "username"):
            fill(cassandra, "username", login["username"])
            fill(cassandra, "password", SecretStr(login["password"]))
        if not set_by_user(registry, "url") and registry.url.startswith("http:"):
            fill(registry, "url", "https:" + registry.url[len("http:") :])
        if not set_by_user(registry, "ssl_ca_location"):
            fill(registry, "ssl_ca_location", ca)
        serving = self.serving
        if not set_by_user(serving, "ssl_certfile", "ssl_keyfile"):
            fill(serving, "ssl_certfile", secure.server_cert(self.state_dir))
            fill(serving, "ssl_keyfile", secure.server_key(self.state_dir))
        if login and not set_by_user(registry, "basic_auth_user_info"):
            fill(registry, "basic_auth_user_info", SecretStr(f"{login['username']}:{login['password']}"))

    @property
    def provisions(self) -> bool:
        """Whether a command creates what a pipeline needs when it is missing (its topics, its schema
        subject's versions): the admin always, and every role on open services, where one login does
        all. A secured role's principal has no such right: deploy made them, it only looks them up."""
        return not (self.secure and self.role != "admin")

    def as_role(self, role: Role) -> Settings:
        """These settings for a command of ``role``: on the secured embedded services, the logins the
        secured defaults filled in become that role's principal's; logins set by hand stay."""
        if role == self.role:
            return self
        out = self.model_copy(deep=True, update={"role": role})
        out._from_state = set()
        if out.secure:
            models = {type(m).__name__: m for m in (out.kafka, out.cassandra, out.registry, out.serving)}
            for service, field in self._from_state:  # back to unset, then filled for the role
                models[service].model_fields_set.discard(field)
            out._fill_secured(secure.principals(out.state_dir).get(role), str(secure.ca_file(out.state_dir)))
        return out

    @model_validator(mode="after")
    def _cluster_defaults(self) -> Settings:
        if "nodes" not in self.model_fields_set:
            recorded = recorded_nodes(self.state_dir)
            if recorded is not None:
                self.nodes = recorded
        if self.nodes == 1:
            return self
        hosts = [f"127.0.0.{i}" for i in range(1, self.nodes + 1)]
        kafka, cassandra, spark = self.kafka, self.cassandra, self.spark
        if "bootstrap_servers" not in kafka.model_fields_set:
            port = int(kafka.bootstrap_servers.rsplit(":", 1)[1])
            kafka.bootstrap_servers = ",".join(f"{h}:{port}" for h in hosts)
        if "heap" not in kafka.model_fields_set:
            kafka.heap = "512M"
        if "contact_points" not in cassandra.model_fields_set:
            cassandra.contact_points = hosts
        if "heap" not in cassandra.model_fields_set:
            cassandra.heap = "1G"
        if "master" not in spark.model_fields_set:
            spark.master = "spark://127.0.0.1:7077"
        return self

    @field_validator("storage_root")
    @classmethod
    def _absolute_storage_root(cls, value: str) -> str:
        # Executors and pyarrow's filesystems resolve paths on their own: a relative local root would
        # point elsewhere for each of them, so it is made absolute once, here.
        return value if "://" in value else str(Path(value).expanduser().absolute())

    def safe_dump(self) -> dict[str, Any]:
        """The settings as a dict with every secret masked, for ``status`` and logs: ``SecretStr``
        fields, free-form values whose names mark them as secrets, and user info inside URLs."""
        dump = self.model_dump(mode="json")
        for group, field in (("kafka", "extra"), ("kafka", "java_extra"), ("spark", "conf")):
            free = dump[group][field]
            for name in free:
                if is_secret_name(name):
                    free[name] = MASK
        dump["registry"]["url"] = mask_url(dump["registry"]["url"])
        dump["storage_root"] = mask_url(dump["storage_root"])
        return dump

    def to_env(self) -> dict[str, str]:
        """Environment variables that rebuild these settings in a child process (secrets included:
        they travel in the child's environment, never on its command line or in a log)."""

        def reveal(value: Any) -> Any:
            if isinstance(value, SecretStr):
                return value.get_secret_value()
            if isinstance(value, BaseModel):
                return {k: reveal(getattr(value, k)) for k in type(value).model_fields}
            if isinstance(value, dict):
                return {k: reveal(v) for k, v in value.items()}
            if isinstance(value, Path):
                return str(value)
            return value

        env = {}
        for name in type(self).model_fields:
            value = reveal(getattr(self, name))
            if isinstance(value, dict):  # what the child derives again for its own role
                kind = type(getattr(self, name)).__name__
                value = {k: v for k, v in value.items() if (kind, k) not in self._from_state}
            env[f"LAMBDALAKE_{name.upper()}"] = json.dumps(value) if isinstance(value, dict) else str(value)
        return env


#: The file in the state folder where ``lambdalake up --nodes N`` records N.
NODES_FILE = "nodes"


def recorded_nodes(state_dir: Path) -> int | None:
    """The node count ``lambdalake up --nodes`` recorded in ``state_dir`` (None: none recorded)."""
    try:
        text = (state_dir / NODES_FILE).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and 1 <= int(text) <= 9 else None


def _field_info(loc: tuple[Any, ...]) -> Any:
    model: Any = Settings
    info = None
    for part in loc:
        fields = getattr(model, "model_fields", {})
        if part not in fields:
            break
        info = fields[part]
        model = info.annotation
    return info


def _json(value: str) -> bool:
    try:
        json.loads(value)
    except ValueError:
        return False
    return True


def settings_error(exc: ValidationError | SettingsError) -> ConfigurationError:
    """A settings error as the user should see it: each variable, the expected form and an example."""
    if isinstance(exc, SettingsError):
        # pydantic-settings fails this way on a value that must be JSON (lists, dicts) and is not.
        match = re.search(r'field "([^"]+)"', str(exc))
        prefix = f"LAMBDALAKE_{(match.group(1) if match else '').upper()}"
        bad = sorted(n for n, value in os.environ.items() if n.startswith(prefix) and not _json(value))
        variable = " / ".join(bad) or prefix
        return ConfigurationError(
            f"setting {variable} must be JSON (a list or an object) and is not",
            fix='e.g. LAMBDALAKE_KAFKA__EXTRA=\'{"client.rack": "a"}\', '
            'LAMBDALAKE_CASSANDRA__CONTACT_POINTS=\'["cass-1", "cass-2"]\'',
        )
    lines, fixes = [], []
    for err in exc.errors():
        loc = tuple(str(part) for part in err["loc"] if not isinstance(part, int))
        variable = "LAMBDALAKE_" + "__".join(loc).upper()
        info = _field_info(loc)
        expected = (info.description if info is not None else None) or err["msg"]
        example = (info.examples or [None])[0] if info is not None and info.examples else None
        given = err.get("input")
        if isinstance(given, str):
            given = mask_url(given)
        shown = MASK if is_secret_name(variable) else repr(given)
        message = err["msg"].removeprefix("Value error, ")
        lines.append(f"{variable}={shown[:80]}: {message} (expected {expected})")
        fixes.append(f"{variable}={example}" if example is not None else f"{variable} as {expected}")
    return ConfigurationError("invalid settings:\n  " + "\n  ".join(lines), fix="set " + "; ".join(fixes))


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The settings from the environment; a bad value raises :class:`ConfigurationError` naming the
    variable, the form it expects and an example."""
    try:
        return Settings()
    except (ValidationError, SettingsError) as exc:
        raise settings_error(exc) from None
