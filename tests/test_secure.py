"""`lambdalake up --secure` against the real servers: Kafka speaks SASL_SSL (SCRAM-SHA-512) with ACLs
enforced, Cassandra asks for a login over TLS, and the schema registry serves HTTPS with basic auth,
all with certificates of a CA made in the state folder; the commands that follow find the CA and the
logins. A wrong password (each service) and a certificate of another CA (Cassandra, the registry) are
one clear error naming the setting to fix (exit 2, no stack trace), and no secret is written to a
log or printed by `lambdalake config`."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lambdalake import secure
from lambdalake.cassandra.session import connect
from lambdalake.errors import ConfigurationError
from lambdalake.infra import tls
from lambdalake.pipeline import configured_pipeline
from lambdalake.settings import QUICK_JIT, Settings
from lambdalake.writer_schemas import fetcher
from tests.conftest import PROJECT_ROOT, port

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


def cli(
    state: Path,
    *args: str,
    kafka_given: dict | None = None,
    registry_given: dict | None = None,
    **cassandra: object,
) -> subprocess.CompletedProcess:
    """``lambdalake`` in the state folder, with only the settings a user would set (so the recorded
    ``--secure`` defaults apply)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAMBDALAKE_")}
    env |= {
        "LAMBDALAKE_STATE_DIR": str(state),
        "LAMBDALAKE_STORAGE_ROOT": str(state / "storage"),
        "LAMBDALAKE_KAFKA": json.dumps(kafka_given or KAFKA),
        "LAMBDALAKE_REGISTRY": json.dumps(registry_given or registry()),
        "LAMBDALAKE_CASSANDRA": json.dumps(given(**cassandra)),
        "COLUMNS": "200",
    }
    return subprocess.run(
        [sys.executable, "-m", "lambdalake", *args],
        env=env,
        capture_output=True,
        timeout=600,
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


def test_kafka_speaks_sasl_ssl_to_its_login_only(state: Path, tmp_path: Path) -> None:
    settings = secured_settings(state)
    assert settings.kafka.security_protocol == "SASL_SSL" and settings.kafka.sasl_mechanism == "SCRAM-SHA-512"
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


def test_no_secret_is_logged_or_printed(state: Path) -> None:
    passwords = [login["password"] for login in secure.principals(state).values()]
    assert len(passwords) == 3
    shown = cli(state, "config")
    assert shown.returncode == 0, shown.stderr.decode()
    assert "cassandra" in shown.stdout.decode()
    written = [state / "logs", state / "cassandra" / "conf", state / "broker" / "logs"]
    for path in [p for folder in written for p in folder.rglob("*") if p.is_file()]:
        text = path.read_text(errors="replace")
        assert not any(password in text for password in passwords), path
    for password in passwords:
        assert password not in (shown.stdout + shown.stderr).decode()
