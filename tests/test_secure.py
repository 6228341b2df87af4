"""`lambdalake up --secure` against the real servers: Kafka speaks SASL_SSL (SCRAM-SHA-512) with ACLs
enforced, Cassandra asks for a login over TLS, and the schema registry serves HTTPS with basic auth,
all with certificates of a CA made in the state folder; the commands that follow find the CA and the
logins. A wrong password (each service) and a certificate of another CA (Cassandra, the registry) are
one clear error naming the setting to fix (exit 2, no stack trace), and no secret is written to a
log or printed by `lambdalake config`."""

from __future__ import annotations

import json
import os
import re
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lambdalake import secure
from lambdalake.cassandra.session import connect
from lambdalake.errors import ConfigurationError
from lambdalake.infra import tls
from lambdalake.pipeline import Pipeline, configured_pipeline
from lambdalake.produce.generator import Mix
from lambdalake.settings import QUICK_JIT, Settings
from lambdalake.writer_schemas import fetcher
from tests.conftest import PROJECT_ROOT, pipeline_named, port
from tests.helpers import pipelines_folder

pytestmark = [pytest.mark.services, pytest.mark.slow]


def given(**cassandra: object) -> dict[str, object]:
    """The Cassandra settings a user of the test's node sets (``cassandra``: more of them)."""
    return {
        "contact_points": ["127.0.0.1"], "port": port(14042), "storage_port": port(14000),
        "keyspace": "secure_test", "heap": "768M", "jvm_options": QUICK_JIT, **cassandra,
    }  # fmt: skip


KAFKA = {"bootstrap_servers": f"127.0.0.1:{port(14092)}", "jvm_options": QUICK_JIT}


def registry(**more: object) -> dict[str, object]:
    return {"url": f"https://127.0.0.1:{port(14081)}", **more}


def secured_settings(state: Path, registry_given: dict | None = None, **cassandra: object) -> Settings:
    """Settings of the test's state folder as a command started there builds them: the logins and
    the CA come from what `up --secure` recorded unless ``cassandra`` (or ``registry_given``) names them."""
    return Settings(
        kafka=KAFKA, registry=registry_given or registry(), cassandra=given(**cassandra), state_dir=state,
        storage_root=str(state / "storage"),
    )  # fmt: skip


def cli_env(
    state: Path,
    kafka_given: dict | None = None,
    registry_given: dict | None = None,
    pipelines: Path | None = None,
    extra: dict[str, str] | None = None,
    **cassandra: object,
) -> dict[str, str]:
    """The environment of a ``lambdalake`` command in the state folder, with only the settings a
    user would set (so the recorded ``--secure`` defaults apply)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAMBDALAKE_")}
    env |= {
        "LAMBDALAKE_STATE_DIR": str(state),
        "LAMBDALAKE_STORAGE_ROOT": str(state / "storage"),
        "LAMBDALAKE_KAFKA": json.dumps(kafka_given or KAFKA),
        "LAMBDALAKE_REGISTRY": json.dumps(registry_given or registry()),
        "LAMBDALAKE_CASSANDRA": json.dumps(given(**cassandra)),
        "LAMBDALAKE_SERVING__PORT": str(port(14080)),
        "COLUMNS": "200",
    }
    if pipelines is not None:
        env["LAMBDALAKE_PIPELINES_DIR"] = str(pipelines)
    return env | (extra or {})


def cli(
    state: Path,
    *args: str,
    kafka_given: dict | None = None,
    registry_given: dict | None = None,
    pipelines: Path | None = None,
    extra: dict[str, str] | None = None,
    **cassandra: object,
) -> subprocess.CompletedProcess:
    """``lambdalake`` in the state folder (:func:`cli_env`; ``extra``: more of its environment)."""
    return subprocess.run(
        [sys.executable, "-m", "lambdalake", *args],
        env=cli_env(state, kafka_given, registry_given, pipelines, extra, **cassandra),
        capture_output=True,
        timeout=900,
        cwd=PROJECT_ROOT,
    )


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp("secure")
    started = cli(folder, "up", "--secure", "--only", "broker", "--only", "registry", "--only", "cassandra")
    out = (started.stdout + started.stderr).decode()
    try:
        assert started.returncode == 0, out
        yield folder
    finally:
        cli(folder, "down")


def test_the_commands_that_follow_log_in_over_tls_with_what_up_recorded(state: Path) -> None:
    settings = secured_settings(state)
    assert settings.secure and settings.cassandra.username == secure.ADMIN
    assert settings.cassandra.ssl_ca_location == str(secure.ca_file(state))
    rows = connect(settings.cassandra).execute("SELECT role, is_superuser FROM system_auth.roles")
    roles = {r.role: r.is_superuser for r in rows}
    assert roles.get(secure.ADMIN) is True, roles
    # The default superuser's login is retired.
    with pytest.raises(ConfigurationError, match="LAMBDALAKE_CASSANDRA__PASSWORD"):
        connect(secured_settings(state, username="cassandra", password="cassandra").cassandra)
    # Without TLS the node does not answer CQL at all.
    plain = secured_settings(state, ssl_ca_location=None)
    with pytest.raises(Exception):  # noqa: B017 - any failure: the point is that none answers
        connect(plain.cassandra, keyspace="system")


def test_a_wrong_password_is_one_clear_error_naming_the_setting(state: Path) -> None:
    result = cli(
        state,
        "query",
        "offers",
        "offer_latest",
        "--key",
        "k",
        username=secure.ADMIN,
        password="not-the-password",
    )
    out = (result.stdout + result.stderr).decode()
    assert result.returncode == 2, out
    assert "refused the login" in out and "LAMBDALAKE_CASSANDRA__PASSWORD" in out, out
    assert "Traceback" not in out, out


def test_a_certificate_of_another_ca_is_one_clear_error_naming_the_setting(
    state: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other-ca.pem"
    other.write_bytes(tls.new_ca("another CA").cert)
    result = cli(state, "query", "offers", "offer_latest", "--key", "k", ssl_ca_location=str(other))
    out = (result.stdout + result.stderr).decode()
    assert result.returncode == 2, out
    assert "not signed by the CA" in out and "LAMBDALAKE_CASSANDRA__SSL_CA_LOCATION" in out, out
    assert "Traceback" not in out, out


def test_the_registry_serves_https_to_its_login_only(state: Path) -> None:
    settings = secured_settings(state)
    assert settings.registry.url.startswith("https:") and settings.registry.basic_auth_user_info is not None
    registered = cli(state, "schemas", "register", "offers")  # confluent's registry client
    out = (registered.stdout + registered.stderr).decode()
    assert registered.returncode == 0 and "= id " in out, out
    schema_id = int(out.split("= id ")[1].split()[0])
    # A Spark task's lookup: the CA as its text, no file of this host's.
    assert "ssl.ca.location" not in settings.registry.task_config()
    assert '"type"' in fetcher(settings.registry.task_config())(schema_id)
    plain = httpx.get(
        f"https://127.0.0.1:{port(14081)}/subjects",
        verify=ssl.create_default_context(cafile=secure.ca_file(state)),
    )
    assert plain.status_code == 401 and plain.json()["error_code"] == 40101, plain.text
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port(14081)}/subjects", timeout=5)


def test_a_wrong_registry_login_or_ca_is_one_clear_error_naming_the_setting(
    state: Path, tmp_path: Path
) -> None:
    wrong = cli(
        state, "schemas", "register", "offers", registry_given=registry(basic_auth_user_info="lambdalake:no")
    )
    out = (wrong.stdout + wrong.stderr).decode()
    assert wrong.returncode == 2 and "refused the login" in out, out
    assert "LAMBDALAKE_REGISTRY__BASIC_AUTH_USER_INFO" in out and "Traceback" not in out, out
    other = tmp_path / "other-ca.pem"
    other.write_bytes(tls.new_ca("another CA").cert)
    wrong = cli(state, "schemas", "register", "offers", registry_given=registry(ssl_ca_location=str(other)))
    out = (wrong.stdout + wrong.stderr).decode()
    assert wrong.returncode == 2 and "not signed by the CA" in out, out
    assert "LAMBDALAKE_REGISTRY__SSL_CA_LOCATION" in out and "Traceback" not in out, out


def test_a_registry_certificate_expired_or_for_another_host_is_one_clear_error_naming_the_fix(
    state: Path, tmp_path: Path
) -> None:
    """The embedded registry's own server, started on a port of the test's over the secured Kafka,
    serving a certificate the CA signed but (a) for another host only, (b) expired: a command exits
    2 naming the fix, with no traceback, and registers nothing (the handshake fails first). `up`
    itself never serves these: it issues the certificate again before it expires."""
    import datetime as dt
    import threading

    from lambdalake.infra.process import port_open
    from lambdalake.infra.registry.server import make_server
    from lambdalake.infra.registry.store import KafkaBackedStore

    settings = secured_settings(state)
    files = tls.TlsFiles(secure.folder(state))
    ca = tls.Issued(files.ca.read_bytes(), files.ca_key.read_bytes())
    long_ago = dt.datetime.now(dt.UTC) - dt.timedelta(days=30)
    bad = {
        "does not name the host": (tls.issue(ca, ("10.9.9.9",)), "LAMBDALAKE_REGISTRY__URL"),
        "has expired": (tls.issue(ca, days=10, not_before=long_ago), "reissue"),
    }
    logins = secure.principals(state)
    users = {login["username"]: login["password"] for login in logins.values()}
    subjects = registry_subjects(settings)
    for i, (said, (issued, fix)) in enumerate(bad.items()):
        cert, key = tmp_path / f"server-{i}.pem", tmp_path / f"server-{i}.key"
        cert.write_bytes(issued.cert)
        key.write_bytes(issued.key)
        store = KafkaBackedStore(
            kafka_config=settings.kafka.client_config(), topic=settings.registry.schemas_topic,
            default_level=settings.registry.default_compatibility,
        )  # fmt: skip
        there = port(14181 + i)
        server = make_server(
            store,
            "127.0.0.1",
            there,
            users=users,
            writers=frozenset({secure.ADMIN}),
            tls=(str(cert), str(key)),
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 60
            while not port_open("127.0.0.1", there):
                assert thread.is_alive() and time.monotonic() < deadline, "the registry did not start"
                time.sleep(0.2)
            wrong = cli(
                state,
                "schemas",
                "register",
                "offers",
                registry_given=registry(url=f"https://127.0.0.1:{there}"),
            )
            out = (wrong.stdout + wrong.stderr).decode()
            assert wrong.returncode == 2 and said in out and fix in out, out
            assert "Traceback" not in out, out
        finally:
            server.should_exit = True
            thread.join(30)
            store.close()
    assert registry_subjects(settings) == subjects


class BadCertificateServer:
    """A TLS endpoint on a port of the test's presenting ``issued`` (a certificate a client must
    refuse) and nothing behind it: the client's handshake is what is under test."""

    def __init__(self, issued: tls.Issued, folder: Path, there: int) -> None:
        import socket
        import threading

        cert, key = folder / f"bad-{there}.pem", folder / f"bad-{there}.key"
        cert.write_bytes(issued.cert)
        key.write_bytes(issued.key)
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(cert, key)
        self.sock = socket.create_server(("127.0.0.1", there))
        self.sock.settimeout(0.5)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            try:
                with self.context.wrap_socket(conn, server_side=True) as tls_conn:
                    tls_conn.recv(1)
            except (OSError, ssl.SSLError):
                pass  # the client refused the certificate: the point
            finally:
                conn.close()

    def __enter__(self) -> BadCertificateServer:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


@pytest.mark.parametrize("service", ["kafka", "cassandra"])
def test_a_broker_or_node_certificate_expired_for_another_host_or_of_another_ca_is_one_clear_error(
    state: Path, tmp_path: Path, service: str
) -> None:
    """Kafka's and Cassandra's clients, as every command makes them, meeting a server certificate
    the CA signed for another host, one that has expired, and one of another CA: exit 2, one error
    naming what is wrong and the setting or step that fixes it, no stack trace."""
    import datetime as dt

    files = tls.TlsFiles(secure.folder(state))
    ca = tls.Issued(files.ca.read_bytes(), files.ca_key.read_bytes())
    long_ago = dt.datetime.now(dt.UTC) - dt.timedelta(days=30)
    setting = (
        "LAMBDALAKE_KAFKA__SSL_CA_LOCATION" if service == "kafka" else "LAMBDALAKE_CASSANDRA__SSL_CA_LOCATION"
    )
    hosts = "LAMBDALAKE_KAFKA__BOOTSTRAP_SERVERS" if service == "kafka" else "SSL_CHECK_HOSTNAME"
    bad = {
        "does not name the address": (tls.issue(ca, ("10.9.9.9",)), hosts),
        "has expired": (tls.issue(ca, days=10, not_before=long_ago), "reissue"),
        "is not signed by the CA": (tls.issue(tls.new_ca("another CA")), setting),
    }
    login = {**KAFKA, "security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
             "sasl_username": secure.ADMIN, "sasl_password": "unused", "ssl_ca_location": str(files.ca),
             "connect_timeout_s": 15}  # fmt: skip
    for i, (said, (issued, fix)) in enumerate(bad.items()):
        there = port(14281 + i + (10 if service == "cassandra" else 0))
        with BadCertificateServer(issued, tmp_path, there):
            if service == "kafka":
                result = cli(state, "produce", "offers", "-n", "1",
                             kafka_given={**login, "bootstrap_servers": f"127.0.0.1:{there}"})  # fmt: skip
            else:
                result = cli(state, "query", "offers", "offer_latest", "--key", "k", port=there)
        out = " ".join((result.stdout + result.stderr).decode().split())
        assert result.returncode == 2, (said, out[-3000:])
        assert said in out and fix in out and "Traceback" not in out, (said, out[-3000:])


def registry_subjects(settings: Settings) -> dict[str, list[int]]:
    """Every subject of the test's registry and its versions, read as the admin."""
    assert settings.registry.basic_auth_user_info is not None
    user, _, password = settings.registry.basic_auth_user_info.get_secret_value().partition(":")
    with httpx.Client(verify=ssl.create_default_context(cafile=settings.registry.ssl_ca_location),
                      auth=(user, password), base_url=settings.registry.url, timeout=30) as http:  # fmt: skip
        names = http.get("/subjects").json()
        return {name: http.get(f"/subjects/{name}/versions").json() for name in names}


def test_kafka_speaks_sasl_ssl_to_its_login_only(state: Path, tmp_path: Path) -> None:
    settings = secured_settings(state)
    assert settings.kafka.security_protocol == "SASL_SSL" and settings.kafka.sasl_mechanism == "SCRAM-SHA-512"
    # The producer's principal may not create topics: deploy (the admin's) makes them.
    deployed = cli(state, "deploy", "offers", "--no-jobs")
    assert deployed.returncode == 0, (deployed.stdout + deployed.stderr).decode()[-3000:]
    produced = cli(state, "produce", "offers", "-n", "40", "--seed", "3")
    out = (produced.stdout + produced.stderr).decode()
    assert produced.returncode == 0, out
    topic = configured_pipeline("offers", settings).topic.name
    # Counted by Kafka's own Java client, with the properties Spark's Kafka source is given (kcat's
    # librdkafka 2.0.2 fails SCRAM-SHA-512 logins that newer clients pass).
    assert java_count(settings, topic, tmp_path) + java_count(settings, f"{topic}.dlq", tmp_path) == 40
    login = {
        **KAFKA, "security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_username": secure.ADMIN, "ssl_ca_location": str(secure.ca_file(state)),
    }  # fmt: skip
    wrong = cli(state, "produce", "offers", "-n", "1", kafka_given={**login, "sasl_password": "not-it"})
    out = (wrong.stdout + wrong.stderr).decode()
    assert wrong.returncode == 2 and "refused the login" in out, out
    assert "LAMBDALAKE_KAFKA__SASL_PASSWORD" in out and "Traceback" not in out, out
    plain = cli(
        state, "produce", "offers", "-n", "1", kafka_given={**KAFKA, "security_protocol": "PLAINTEXT"}
    )
    out = (plain.stdout + plain.stderr).decode()
    assert plain.returncode != 0 and "Traceback" not in out, out


#: Kafka's Java consumer counting a topic's records (launched from source: Java 17 compiles a single
#: file at start), with the client properties Spark's Kafka source is given.
JAVA_COUNT = """
import java.io.FileReader;
import java.time.Duration;
import java.util.*;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;

public class Count {
  public static void main(String[] args) throws Exception {
    Properties props = new Properties();
    try (FileReader in = new FileReader(args[0])) { props.load(in); }
    var bytes = new ByteArrayDeserializer();
    try (var consumer = new KafkaConsumer<>(props, bytes, bytes)) {
      List<TopicPartition> parts = new ArrayList<>();
      for (var p : consumer.partitionsFor(args[1], Duration.ofSeconds(60))) {
        parts.add(new TopicPartition(p.topic(), p.partition()));
      }
      consumer.assign(parts);
      consumer.seekToBeginning(parts);
      Map<TopicPartition, Long> ends = consumer.endOffsets(parts, Duration.ofSeconds(60));
      long count = 0;
      while (parts.stream().anyMatch(p -> consumer.position(p) < ends.get(p))) {
        count += consumer.poll(Duration.ofSeconds(5)).count();
      }
      System.out.println(count);
    }
  }
}
"""


def java_count(settings: Settings, topic: str, folder: Path) -> int:
    from lambdalake import jars

    (folder / "Count.java").write_text(JAVA_COUNT)
    conf = folder / "client.properties"
    conf.touch(mode=0o600)
    conf.write_text("".join(f"{k}={v}\n" for k, v in settings.kafka.java_client_config().items()))
    classpath = ":".join(map(str, jars.classpath(settings.cache_dir, "kafka")))
    out = subprocess.run(
        [jars.java(), "-cp", classpath, str(folder / "Count.java"), str(conf), topic],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return int(out.stdout.split()[-1])


def given_login(state: Path, role: str) -> dict[str, dict[str, object]]:
    """The settings a user of ``role``'s login gives for each service (as one running that role's
    process on a host of its own would), keyed by the ``cli`` argument that takes them."""
    login = secure.principals(state)[role]
    ca = str(secure.ca_file(state))
    return {
        "kafka_given": {**KAFKA, "security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
                        "sasl_username": login["username"], "sasl_password": login["password"],
                        "ssl_ca_location": ca},
        "registry_given": registry(basic_auth_user_info=f"{login['username']}:{login['password']}"),
        "cassandra": {"username": login["username"], "password": login["password"]},
    }  # fmt: skip


@pytest.fixture(scope="module")
def roles_pipeline(state: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Settings, Pipeline]:
    """A pipeline of the test's own (10-second epochs, a topic of its own), deployed by the admin:
    topics, schemas, tables, and every role's grants."""
    base = secured_settings(state)
    pipeline = pipeline_named(base, "offers", topic="offers-roles", epoch="10 seconds", grace="1 second")
    folder = pipelines_folder(tmp_path_factory.mktemp("roles"), pipeline)
    deployed = cli(state, "deploy", "offers", "--no-jobs", pipelines=folder)
    out = (deployed.stdout + deployed.stderr).decode()
    assert deployed.returncode == 0 and re.search(r"grants offers\W+created", out), out[-3000:]
    again = cli(state, "deploy", "offers", "--no-jobs", pipelines=folder)
    out = (again.stdout + again.stderr).decode()
    assert again.returncode == 0 and re.search(r"grants offers\W+unchanged", out), out[-3000:]
    return base.model_copy(update={"pipelines_dir": folder}), pipeline


def test_each_role_s_settings_name_its_own_principal_and_a_login_set_by_hand_wins(
    state: Path, roles_pipeline: tuple[Settings, Pipeline]
) -> None:
    """Each command's settings log in as its role's principal on every service (each role running its
    part with them, and the merged answers exact: the whole-life test below, on the same services)."""
    settings, _ = roles_pipeline
    # Each command's settings name its role's principal on every service, and no login set by
    # hand is replaced (a user's own login wins).
    for role in ("producer", "speed", "batch", "serving"):
        mine = settings.as_role(role)  # type: ignore[arg-type]
        name = secure.username(role)  # type: ignore[arg-type]
        assert mine.kafka.sasl_username == mine.cassandra.username == name, role
        assert mine.registry.basic_auth_user_info.get_secret_value().startswith(f"{name}:"), role
        assert "LAMBDALAKE_KAFKA" in mine.to_env() and name not in mine.to_env()["LAMBDALAKE_KAFKA"]
    given = secured_settings(state, username="someone", password="x").as_role("serving")
    assert given.cassandra.username == "someone" and given.kafka.sasl_username == "lambdalake_serving"


def test_each_role_is_refused_beyond_its_rights_naming_the_principal_and_the_grant(
    state: Path, roles_pipeline: tuple[Settings, Pipeline]
) -> None:
    """Run as a user of each role's login would: one clear error (exit 2, no stack trace) naming
    the principal and the right it lacks, and how to grant it."""
    folder = roles_pipeline[0].pipelines_dir

    def refused(role: str, *args: str, only: str, says: tuple[str, ...], ours: bool = True) -> None:
        login = given_login(state, role)
        given = {"kafka_given": login["kafka_given"]} if only == "kafka" else (
            {"registry_given": login["registry_given"]} if only == "registry" else login["cassandra"]
        )  # fmt: skip
        result = cli(state, *args, pipelines=folder if ours else None, **given)  # type: ignore[arg-type]
        out = " ".join((result.stdout + result.stderr).decode().split())  # as one line: rich wraps it
        assert result.returncode == 2, out[-3000:]
        assert all(s in out for s in says) and "Traceback" not in out, out[-3000:]

    # The producer may not change the registry (only the admin registers schemas).
    refused(
        "producer",
        "schemas",
        "register",
        "offers",
        only="registry",
        says=("refused user 'lambdalake_producer' a change", "lambdalake deploy"),
    )
    # The batch may not write the topic.
    refused(
        "batch",
        "produce",
        "offers",
        "-n",
        "5",
        only="kafka",
        says=("Kafka refused user lambdalake_batch", "lambdalake grants"),
    )
    # Serving may only read: a batch's lease (an LWT) is refused.
    refused(
        "serving",
        "batch",
        "run",
        "offers",
        only="cassandra",
        says=("Cassandra refused user lambdalake_serving MODIFY", "GRANT MODIFY ON KEYSPACE"),
    )
    # The speed job may write rows, not create tables (another pipeline's deploy).
    refused(
        "speed",
        "deploy",
        "telemetry",
        "--no-jobs",
        only="cassandra",
        says=("Cassandra refused user lambdalake_speed CREATE", "GRANT CREATE ON KEYSPACE"),
        ours=False,  # the shipped telemetry pipeline: tables the speed role may not create
    )


#: The lake of the whole-life test: on the embedded object store, beside the secured services.
LAKE_BUCKET = "lake-secure"
STORE_SECRET = "store-secret-of-the-secure-test"


@pytest.fixture(scope="module")
def lake(state: Path) -> Iterator[dict[str, str]]:
    """The object store started in the secured services' state folder (`up --only object-store`);
    returns the environment that puts a command's lake there."""
    env = {
        "LAMBDALAKE_STORAGE_ROOT": f"s3://{LAKE_BUCKET}/life",
        "LAMBDALAKE_OBJECT_STORE__ENDPOINT": f"http://127.0.0.1:{port(14900)}",
        "LAMBDALAKE_OBJECT_STORE__SECRET_KEY": STORE_SECRET,
    }
    started = cli(state, "up", "--only", "object-store", extra=env)
    try:
        assert started.returncode == 0, (started.stdout + started.stderr).decode()[-3000:]
        yield env
    finally:
        cli(state, "down", "--only", "object-store", extra=env)


def confluent_send(settings: Settings, pipeline: Pipeline, records: list[dict]) -> None:
    """``records`` produced with confluent-kafka's own SerializingProducer and AvroSerializer, as the
    producer's principal (SASL_SSL; the registry's login over HTTPS), the latest registered schema."""
    from confluent_kafka import SerializingProducer
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroSerializer
    from confluent_kafka.serialization import StringSerializer

    mine = settings.as_role("producer")
    registry_client = SchemaRegistryClient(mine.registry.client_config())
    schema = registry_client.get_latest_version(pipeline.schema_.subject).schema
    # The pipeline names its subject (not confluent's default, "<topic>-value"): the serializer is told it.
    subject = pipeline.schema_.subject
    value = AvroSerializer(
        registry_client, schema.schema_str,
        conf={"auto.register.schemas": False, "subject.name.strategy": lambda _ctx, _name: subject},
    )  # fmt: skip
    producer = SerializingProducer({
        **mine.kafka.client_config(), "key.serializer": StringSerializer(), "value.serializer": value,
        "acks": "all", "enable.idempotence": True,
    })  # fmt: skip
    failed: list[str] = []
    for record in records:
        producer.produce(
            pipeline.topic.name, key=str(record[pipeline.event.key]), value=record,
            on_delivery=lambda err, _msg: failed.append(str(err)) if err is not None else None,
        )  # fmt: skip
        producer.poll(0)
    assert producer.flush(120) == 0 and failed == [], failed[:3]


#: Records confluent's serializer can write: none breaking a schema type (the CLI's producer sends
#: those to the DLQ; a serializer refuses them before sending).
SCHEMA_VALID = Mix(invalid=0.0)

#: A view added on the live pipeline of the whole-life test.
ADDED_VIEW = """
[[views]]
name = "currency_stock_1m"
kind = "windowed"
key = ["currency"]
window = "1 minute"
aggregates = [{ name = "updates", fn = "count" }, { name = "stock_sum", fn = "sum", column = "stock" }]
"""


def test_a_pipeline_s_whole_life_on_the_secured_services_with_the_lake_on_the_store(
    state: Path, lake: dict[str, str], tmp_path: Path
) -> None:
    """A pipeline of the test's own, its lake wholly on the object store, every command on the
    secured services with its role's principal: deploy (jobs, scheduler, HTTPS serving), produce
    with the CLI and with confluent's serializer, the deployed speed job, a batch, merged answers
    over HTTPS, a replay and the second batch it runs, a restore of the first, a view added on the
    live pipeline, and a `speed reset`. After each step every merged answer equals the reference of
    what the topic holds; the store holds the master dataset, checkpoints, views and status."""
    from lambdalake.cassandra.active import active_batch
    from lambdalake.produce.generator import generate
    from lambdalake.serving.client import ServingClient
    from lambdalake.settings import ObjectStoreSettings
    from tests.reference import differences, merged_differences, topic_events
    from tests.test_view_versions import eventually

    keyspace = {"keyspace": "secure_life"}
    store = ObjectStoreSettings(endpoint=lake["LAMBDALAKE_OBJECT_STORE__ENDPOINT"], secret_key=STORE_SECRET)
    base = secured_settings(state, **keyspace).model_copy(
        update={"storage_root": lake["LAMBDALAKE_STORAGE_ROOT"], "object_store": store}
    )
    pipeline = pipeline_named(base, "offers", topic="offers-life", epoch="10 seconds", grace="1 second")
    folder = pipelines_folder(tmp_path, pipeline)
    settings = base.model_copy(update={"pipelines_dir": folder})
    env = {**lake, "LAMBDALAKE_SERVING__TOKEN": "t0ken"}

    def run(*args: str) -> str:
        result = cli(state, *args, pipelines=folder, extra=env, **keyspace)
        out = (result.stdout + result.stderr).decode()
        assert result.returncode == 0, f"{args}: {out[-3000:]}"
        return out

    def exact(current: Pipeline = pipeline) -> list[str]:
        client = ServingClient(settings=settings.as_role("serving"))
        return merged_differences(settings, client, {current.name: current})

    try:
        run("deploy", "offers")
        run("produce", "offers", "-n", "400", "--seed", "11")
        confluent_send(settings, pipeline, list(generate("offers", 300, seed=12, mix=SCHEMA_VALID)))
        assert eventually(lambda: differences(settings, pipeline, topic_events(settings, pipeline)[0])) == []
        time.sleep(pipeline.layers.epoch_seconds + 2)  # the events' ingest epochs close
        assert "published" in run("batch", "run", "offers")
        assert eventually(exact) == []
        https_answers_match(state, settings, pipeline)

        # More events, a replay of the whole topic beside the running job (nothing counts twice) and
        # the batch it runs after it, a second version; then the first one restored (its horizon
        # moves back: the speed rows of the epochs between are rebuilt from the master dataset first).
        session = connect(settings.cassandra)
        first = active_batch(session, "secure_life", "offers")
        assert first is not None
        confluent_send(settings, pipeline, list(generate("offers", 200, seed=13, mix=SCHEMA_VALID)))
        time.sleep(pipeline.layers.epoch_seconds + 2)
        assert eventually(lambda: differences(settings, pipeline, topic_events(settings, pipeline)[0])) == []
        events, _ = topic_events(settings, pipeline)
        run("replay", "offers", "--from-timestamp", str(int(events["_ts"].min())),
            "--to-timestamp", str(int(events["_ts"].max()) + 1), "--run-batch")  # fmt: skip
        assert eventually(exact) == []
        second = active_batch(session, "secure_life", "offers")
        assert second is not None and second.horizon > first.horizon, (second, first)
        run("batch", "restore", "offers", "--version", str(first.views[pipeline.views[0].name]))
        restored = active_batch(session, "secure_life", "offers")
        assert restored is not None and restored.horizon == first.horizon, (restored, first)
        assert eventually(exact) == []

        # A view added on the live pipeline: built from the master dataset, then served.
        (folder / "offers.toml").write_text((folder / "offers.toml").read_text() + ADDED_VIEW)
        assert "currency_stock_1m" in run("deploy", "offers")
        changed = configured_pipeline("offers", settings)
        run("produce", "offers", "-n", "150", "--seed", "14")
        assert eventually(lambda: exact(changed)) == []

        # The speed layer rebuilt after losing its checkpoints.
        run("undeploy")
        run("speed", "reset", "offers", "--yes")
        run("deploy", "offers")
        confluent_send(settings, changed, list(generate("offers", 100, seed=15, mix=SCHEMA_VALID)))
        assert eventually(lambda: exact(changed)) == []
    finally:
        cli(state, "undeploy", pipelines=folder, extra=env, **keyspace)
    lake_files = state / "object-store" / "data" / LAKE_BUCKET / "life"
    held = {p.relative_to(lake_files).parts[0] for p in lake_files.rglob("*") if p.is_file()}
    assert {"master", "checkpoints", "views", "status"} <= held, held


def https_answers_match(state: Path, settings: Settings, pipeline: Pipeline) -> None:
    """The deployed serving API answers over HTTPS (the embedded CA's certificate, the token) what
    the Python client answers as the serving principal, for a key of every view; without the token it
    answers 401, and nothing answers plain HTTP beside it."""
    from lambdalake.serving.client import ServingClient
    from tests.reference import stored_keys

    trusted = ssl.create_default_context(cafile=secure.ca_file(state))
    client = ServingClient(settings=settings.as_role("serving"))
    url = f"https://127.0.0.1:{port(14080)}"
    for view in pipeline.views:
        key = sorted(stored_keys(settings, pipeline, view))[0]
        shown = ",".join(map(str, key))
        answer = httpx.get(f"{url}/v1/pipelines/{pipeline.name}/views/{view.name}/keys/{shown}",
                           verify=trusted, headers={"Authorization": "Bearer t0ken"}, timeout=30)  # fmt: skip
        assert answer.status_code == 200, answer.text
        want = client.query(pipeline.name, view.name, list(key) if len(key) > 1 else key[0]).to_dict()
        got = answer.json()

        def values(a: dict) -> tuple:
            return a["latest"], [(w["window_start"], w["values"]) for w in a["windows"]]

        assert values(got) == values(want) and (got["latest"] or got["windows"]), (view.name, answer.text)
    path = f"/v1/pipelines/{pipeline.name}/views/{view.name}/keys/{shown}"  # the last view's
    assert httpx.get(url + path, verify=trusted, timeout=30).status_code == 401  # no token
    with pytest.raises(httpx.TransportError):  # no plain HTTP beside it
        httpx.get(f"http://127.0.0.1:{port(14080)}{path}", timeout=5)


def test_no_secret_is_logged_or_printed(
    state: Path, roles_pipeline: tuple[Settings, Pipeline], lake: dict[str, str]
) -> None:
    """After every command above (a pipeline's whole run among them): no principal's password in
    any file of the state folder (logs, status and run files, the lake, the services' data and
    logs, read as bytes), but the two that must hold them, nor in `lambdalake config`'s output."""
    passwords = [login["password"] for login in secure.principals(state).values()]
    assert len(passwords) == len(secure.ROLES) == 5
    passwords.append(STORE_SECRET)  # the object store's key: only its own config holds it
    shown = cli(state, "config")
    assert shown.returncode == 0, shown.stderr.decode()
    assert "cassandra" in shown.stdout.decode()
    for password in passwords:
        assert password not in (shown.stdout + shown.stderr).decode()
    # The logins' file, and the broker's own login among brokers (Kafka reads it from its config).
    holders = {secure.folder(state) / secure.PRINCIPALS, state / "broker" / "server.properties",
               state / "object-store" / "s3proxy.conf"}  # fmt: skip
    files = [p for p in state.rglob("*") if p.is_file() and p not in holders]
    assert len(files) > 100 and any(LAKE_BUCKET in p.parts for p in files), len(files)  # the lake too
    for path in files:
        data = path.read_bytes()
        assert not any(password.encode() in data for password in passwords), path
