"""Settings a user gives: the storage root and the topic prefix."""

from __future__ import annotations

from pathlib import Path

import pytest

from lambdalake.pipeline import configured_pipeline
from lambdalake.settings import Settings


def test_relative_storage_root_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert Settings(storage_root="data/lake").storage_root == str(tmp_path / "data" / "lake")
    assert Settings(storage_root="s3://bucket/lake").storage_root == "s3://bucket/lake"


def test_topic_prefix_names_every_pipeline_topic_and_its_dlq(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAMBDALAKE_TOPIC_PREFIX", "staging.")
    pipeline = configured_pipeline("offers", Settings())
    assert (pipeline.topic.name, pipeline.topic.dlq) == ("staging.offers", "staging.offers.dlq")
    assert pipeline.schema_.subject == "offers-value"  # subjects are not prefixed


def test_the_embedded_controller_port_moves_with_the_broker_port(tmp_path) -> None:
    from lambdalake.infra.kafka_dist import server_properties

    def listeners(**kafka: object) -> str:
        settings = Settings(kafka=kafka)
        port = int(settings.kafka.bootstrap_servers.rsplit(":", 1)[1])
        props = server_properties(settings.kafka, host="127.0.0.1", port=port, log_dir=tmp_path)
        assert props["controller.quorum.voters"] == "1@" + props["listeners"].split("CONTROLLER://")[1]
        return props["listeners"]

    assert listeners() == "PLAINTEXT://127.0.0.1:9092,CONTROLLER://127.0.0.1:9093"
    assert listeners(bootstrap_servers="127.0.0.1:19092") == (
        "PLAINTEXT://127.0.0.1:19092,CONTROLLER://127.0.0.1:19093"
    )
    assert listeners(bootstrap_servers="127.0.0.1:29092", controller_port=31000) == (
        "PLAINTEXT://127.0.0.1:29092,CONTROLLER://127.0.0.1:31000"
    )


def test_the_cql_protocol_is_negotiated_unless_pinned() -> None:
    assert Settings().cassandra.driver_options() == {}
    assert Settings(cassandra={"protocol_version": 4}).cassandra.driver_options() == {"protocol_version": 4}


def test_the_java_client_config_carries_the_same_connection(tmp_path: Path) -> None:
    """Spark's Kafka source takes Java client properties: SASL as a JAAS line, certificates as PEM."""
    cert, key = tmp_path / "client.pem", tmp_path / "client.key"
    cert.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    key.write_text("-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n")
    settings = Settings(
        kafka={
            "bootstrap_servers": "b1:9093,b2:9093", "security_protocol": "SASL_SSL",
            "sasl_mechanism": "SCRAM-SHA-512", "sasl_username": "svc", "sasl_password": 'pa"ss',
            "ssl_ca_location": "/etc/ca.pem", "ssl_certificate_location": str(cert),
            "ssl_key_location": str(key), "java_extra": {"client.rack": "a"},
        }
    )  # fmt: skip
    conf = settings.kafka.java_client_config()
    assert conf["bootstrap.servers"] == "b1:9093,b2:9093" and conf["security.protocol"] == "SASL_SSL"
    assert conf["sasl.mechanism"] == "SCRAM-SHA-512"
    assert conf["sasl.jaas.config"] == (
        'org.apache.kafka.common.security.scram.ScramLoginModule required username="svc" password="pa\\"ss";'
    )
    assert conf["ssl.truststore.type"] == "PEM" and conf["ssl.truststore.location"] == "/etc/ca.pem"
    assert conf["ssl.keystore.type"] == "PEM"
    assert "BEGIN CERTIFICATE" in conf["ssl.keystore.certificate.chain"]
    assert "BEGIN PRIVATE KEY" in conf["ssl.keystore.key"] and conf["client.rack"] == "a"
    plain = Settings(kafka={"sasl_mechanism": "PLAIN", "sasl_username": "u", "sasl_password": "p"})
    assert plain.kafka.java_client_config()["sasl.jaas.config"].startswith(
        "org.apache.kafka.common.security.plain.PlainLoginModule required"
    )
    # The JAAS line carries the password: masked where settings are shown.
    shown = Settings(kafka={"java_extra": {"sasl.jaas.config": "x password=y;"}}).safe_dump()
    assert shown["kafka"]["java_extra"]["sasl.jaas.config"] != "x password=y;"


def test_nodes_change_only_the_defaults_of_the_settings_that_describe_a_cluster(tmp_path) -> None:
    """`lambdalake up --nodes 3` records 3 in the state folder: the commands that follow default to
    three brokers and Cassandra nodes on 127.0.0.1-3 and a standalone Spark master, and every
    setting given explicitly still wins."""
    from lambdalake.settings import NODES_FILE, Settings

    one = Settings(state_dir=tmp_path)
    assert one.nodes == 1 and one.kafka.bootstrap_servers == "127.0.0.1:9092"
    (tmp_path / NODES_FILE).write_text("3\n")
    three = Settings(state_dir=tmp_path)
    assert three.nodes == 3
    assert three.kafka.bootstrap_servers == "127.0.0.1:9092,127.0.0.2:9092,127.0.0.3:9092"
    assert three.cassandra.contact_points == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    assert three.spark.master == "spark://127.0.0.1:7077"
    assert (three.kafka.heap, three.cassandra.heap) == ("512M", "1G")
    mine = Settings(state_dir=tmp_path, kafka={"bootstrap_servers": "b:9092"}, spark={"master": "local[2]"})
    assert mine.kafka.bootstrap_servers == "b:9092" and mine.spark.master == "local[2]"
    assert mine.cassandra.contact_points == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    # A child process rebuilt from the environment is the same cluster.
    env = three.to_env()
    assert env["LAMBDALAKE_NODES"] == "3"
