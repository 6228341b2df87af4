"""The one typed settings model of the platform.

Every value has an embedded default that works on one machine (see README: "What runs locally") and
is overridden by environment variables with the ``LAMBDALAKE_`` prefix; nested groups use ``__``::

    LAMBDALAKE_KAFKA__BOOTSTRAP_SERVERS=broker-1:9092,broker-2:9092
    LAMBDALAKE_KAFKA__SECURITY_PROTOCOL=SASL_SSL
    LAMBDALAKE_KAFKA__SASL_PASSWORD=...          # a SecretStr: never printed or logged
    LAMBDALAKE_CASSANDRA__CONTACT_POINTS='["cass-1","cass-2"]'

The same code talks to the embedded services or to real clusters by configuration alone.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

PROJECT_ROOT = Path(__file__).resolve().parent.parent


class KafkaSettings(BaseModel):
    """Connection to the Kafka cluster (librdkafka names in ``client_config``)."""

    bootstrap_servers: str = "127.0.0.1:9092"
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
    #: Seconds to wait for the cluster before a command gives up with an error naming the fix.
    connect_timeout_s: float = 5.0

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


class RegistrySettings(BaseModel):
    """Confluent-compatible schema registry."""

    url: str = "http://127.0.0.1:8081"
    basic_auth_user_info: SecretStr | None = None
    #: Compacted topic where the embedded registry keeps its state (as Confluent's does).
    schemas_topic: str = "_schemas"
    default_compatibility: str = "BACKWARD"

    def client_config(self) -> dict[str, Any]:
        conf: dict[str, Any] = {"url": self.url}
        if self.basic_auth_user_info is not None:
            conf["basic.auth.user.info"] = self.basic_auth_user_info.get_secret_value()
        return conf


class CassandraSettings(BaseModel):
    """Cassandra cluster holding speed and batch views."""

    contact_points: list[str] = Field(default_factory=lambda: ["127.0.0.1"])
    port: int = 9042
    keyspace: str = "lambdalake"
    #: v3 is the newest protocol Cassandra 2.1 speaks, and 4.x/5.x still accept it.
    protocol_version: int = 3
    username: str | None = None
    password: SecretStr | None = None
    #: CQL replication map used when the deploy step creates the keyspace.
    replication: dict[str, str | int] = Field(
        default_factory=lambda: {"class": "SimpleStrategy", "replication_factor": 1}
    )
    #: Rows per unlogged batch when writing views (rows of one partition are kept together). A
    #: request per row cost ~9x more here (4.4k vs 38.7k rows/s, Cassandra 2.1 on 2 cores); 1 sends
    #: every row alone.
    batch_rows: int = Field(default=32, ge=1, le=500)
    #: Embedded server only.
    heap: str = "512M"
    storage_port: int = 7000


class SparkSettings(BaseModel):
    #: ``local[2,4]``: two cores, and a failed task (a broker or registry hiccup) is retried up to
    #: 4 times instead of failing the query at once, as on a cluster.
    master: str = "local[2,4]"
    #: Extra Spark conf, e.g. ``{"spark.executor.memory": "4g"}``.
    conf: dict[str, str] = Field(default_factory=dict)


class Settings(BaseSettings):
    """All of lambdalake's configuration. Build it with :func:`get_settings` or directly in tests."""

    model_config = SettingsConfigDict(
        env_prefix="LAMBDALAKE_", env_nested_delimiter="__", extra="ignore", validate_default=True
    )

    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    registry: RegistrySettings = Field(default_factory=RegistrySettings)
    cassandra: CassandraSettings = Field(default_factory=CassandraSettings)
    spark: SparkSettings = Field(default_factory=SparkSettings)
    #: Where embedded services keep data, PID files and logs.
    state_dir: Path = PROJECT_ROOT / ".lambdalake"
    #: Installed service files (Cassandra's distribution), shared by every state folder.
    cache_dir: Path = PROJECT_ROOT / ".lambdalake" / "cache"
    #: Root for Delta tables and streaming checkpoints (a local path or an object-store URI).
    storage_root: str = str(PROJECT_ROOT / ".lambdalake" / "storage")
    pipelines_dir: Path = PROJECT_ROOT / "pipelines"
    schemas_dir: Path = PROJECT_ROOT / "schemas"
    #: Length of an ingest epoch: the unit the batch layer covers and serving merges on.
    epoch_seconds: int = 3600
    #: Put before every pipeline's topic name (and so its dead-letter topic), e.g. ``staging.``, so
    #: several environments or runs can share one Kafka cluster. Schema subjects are not prefixed.
    topic_prefix: str = ""

    @field_validator("storage_root")
    @classmethod
    def _absolute_storage_root(cls, value: str) -> str:
        # Executors and pyarrow's filesystems resolve paths on their own: a relative local root would
        # point elsewhere for each of them, so it is made absolute once, here.
        return value if "://" in value else str(Path(value).expanduser().absolute())

    def safe_dump(self) -> dict[str, Any]:
        """The settings as a dict with every secret masked, for ``status`` and logs."""
        return self.model_dump(mode="json")

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
            env[f"LAMBDALAKE_{name.upper()}"] = json.dumps(value) if isinstance(value, dict) else str(value)
        return env


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
