"""`lambdalake up --secure --nodes 3`: three KRaft brokers speaking SASL_SSL among themselves and to
their clients, three Cassandra nodes asking for a login over TLS, and the registry over HTTPS, as one
secured cluster on 127.0.0.1-3 with a node of each kind down.

Every role's principal logs in on every Cassandra node (the roles ``up`` creates on the first node
reach the two that join after it), the producer's records are acknowledged by the brokers left with
one killed, the speed job run as its principal writes its views at QUORUM with a Cassandra node
killed, and each node read alone, as serving's principal, holds what a reference of the topic says.
The topic is counted with librdkafka 2.x (kcat 1.7.1 cannot log in with SCRAM-SHA-512)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lambdalake import secure
from lambdalake.cassandra.session import connect
from lambdalake.serving.client import ServingClient
from lambdalake.settings import QUICK_JIT, Settings
from tests.conftest import pipeline_named, port
from tests.helpers import HOSTS, kill_minus_nine, node, pipelines_folder
from tests.reference import differences, merged_differences, topic_events
from tests.test_secure import cli

pytestmark = [pytest.mark.services, pytest.mark.slow]

KAFKA = {"bootstrap_servers": ",".join(f"{h}:{port(14192)}" for h in HOSTS), "heap": "384M",
         "jvm_options": QUICK_JIT}  # fmt: skip
REGISTRY = {"url": f"https://127.0.0.1:{port(14181)}"}
CASSANDRA = {"contact_points": HOSTS, "port": port(14142), "storage_port": port(14100),
             "keyspace": "secure_three", "heap": "768M", "jvm_options": QUICK_JIT}  # fmt: skip
#: The jobs run in a local Spark (the cluster's `--nodes 3` default is a standalone master, not started).
SPARK = {"LAMBDALAKE_SPARK__MASTER": "local[2,4]"}


def run(state: Path, *args: str, pipelines: Path | None = None) -> str:
    """``lambdalake`` as a user of the secured cluster runs it (only the addresses given)."""
    result = cli(
        state,
        *args,
        kafka_given=KAFKA,
        registry_given=REGISTRY,
        pipelines=pipelines,
        extra=SPARK,
        **CASSANDRA,
    )
    out = (result.stdout + result.stderr).decode()
    assert result.returncode == 0, f"{args}: {out[-3000:]}"
    return out


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp("secure-three")
    try:
        run(folder, "up", "--secure", "--nodes", "3", "--only", "broker", "--only", "registry",
            "--only", "cassandra")  # fmt: skip
        yield folder
    finally:
        cli(folder, "down", kafka_given=KAFKA, registry_given=REGISTRY, extra=SPARK, **CASSANDRA)


def test_three_secured_nodes_of_each_kind_serve_every_role_with_a_node_of_each_down(
    state: Path, tmp_path: Path
) -> None:
    settings = Settings(
        kafka=KAFKA, registry=REGISTRY, cassandra=CASSANDRA, spark={"master": "local[2,4]"}, state_dir=state,
        storage_root=str(state / "storage"),
    )  # fmt: skip
    assert settings.secure and settings.cassandra.username == secure.ADMIN
    pipeline = pipeline_named(settings, "offers", topic="offers-three", epoch="10 seconds", grace="1 second")
    folder = pipelines_folder(tmp_path, pipeline)
    settings = settings.model_copy(update={"pipelines_dir": folder})
    run(state, "deploy", "offers", "--no-jobs", pipelines=folder)
    # Every role logs in on every node alone (its role row reached the nodes that joined later).
    for role in secure.ROLES:
        mine = settings.as_role(role)
        for host in HOSTS:
            alone = mine.cassandra.model_copy(update={"contact_points": [host]})
            assert connect(alone, keyspace="system").execute("SELECT release_version FROM system.local").one()
    # A broker and a Cassandra node killed: the producer's records are acknowledged by the two
    # brokers left (min.insync.replicas 2), and the speed job writes at QUORUM to the two nodes left.
    broker, cassandra = node(settings, "broker-2"), node(settings, "cassandra-3")
    kill_minus_nine(broker)
    kill_minus_nine(cassandra)
    try:
        run(state, "produce", "offers", "-n", "600", "--seed", "21", pipelines=folder)
        time.sleep(12)  # the events' ingest epochs close
        run(state, "speed", "run", "offers", "--once", pipelines=folder)
        events, _ = topic_events(settings, pipeline)  # librdkafka 2.x, as the admin
        assert len(events) > 500, len(events)  # the generator's few invalid records go to the DLQ
        assert differences(settings.as_role("serving"), pipeline, events) == []
        client = ServingClient(settings=settings.as_role("serving"))
        assert merged_differences(settings, client, {pipeline.name: pipeline}) == []
    finally:
        broker.start()
        cassandra.start()
    # Back: each node read alone holds the views (hinted handoff gave the returning one what it missed).
    deadline = time.monotonic() + 180
    while True:
        alone = {h: differences(settings.as_role("serving"), pipeline, events, host=h) for h in HOSTS}
        if not any(alone.values()):
            break
        assert time.monotonic() < deadline, {h: p[:3] for h, p in alone.items()}
        time.sleep(5)


def test_a_login_the_nodes_cannot_check_is_their_unavailability_not_wrong_credentials() -> None:
    """With too few nodes up to read the roles at their consistency level, Cassandra answers a right
    login with "Bad credentials ... Unable to perform authentication": the nodes are to blame, not
    the login: connect raises ServiceUnavailable, not an error asking to fix the password."""
    from cassandra import AuthenticationFailed
    from cassandra.cluster import NoHostAvailable

    from lambdalake.cassandra.session import logins_unavailable, refusal

    settings = Settings(cassandra=CASSANDRA).cassandra
    unavailable = NoHostAvailable("Unable to connect to any servers", {"127.0.0.1:9042": AuthenticationFailed(
        "Failed to authenticate to 127.0.0.1:9042: Error from server: code=0100 [Bad credentials] "
        'message="Unable to perform authentication: Cannot achieve consistency level LOCAL_QUORUM"'
    )})  # fmt: skip
    assert logins_unavailable(unavailable) and refusal(unavailable, settings) is None
    wrong = NoHostAvailable("Unable to connect to any servers", {"127.0.0.1:9042": AuthenticationFailed(
        'Failed to authenticate to 127.0.0.1:9042: Error from server: code=0100 [Bad credentials] '
        'message="Provided username lambdalake and/or password are incorrect"'
    )})  # fmt: skip
    refused = refusal(wrong, settings)
    assert not logins_unavailable(wrong) and refused is not None and "refused the login" in refused.message
