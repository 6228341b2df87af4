"""The embedded registry through confluent-kafka's own SchemaRegistryClient."""

from __future__ import annotations

import json

import httpx
import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError

from lambdalake.infra.services import RegistryService
from lambdalake.settings import Settings

pytestmark = pytest.mark.services


def schema(*extra: dict) -> Schema:
    fields = [{"name": "id", "type": "string"}, {"name": "n", "type": "int"}, *extra]
    return Schema(json.dumps({"type": "record", "name": "R", "namespace": "t", "fields": fields}), "AVRO")


OPTIONAL = {"name": "note", "type": ["null", "string"], "default": None}
REQUIRED = {"name": "note", "type": "string"}


@pytest.fixture
def sr(services: Settings) -> SchemaRegistryClient:
    return SchemaRegistryClient({"url": services.registry.url})


def test_incompatible_refused_with_reason_compatible_gets_new_id(
    sr: SchemaRegistryClient, unique: str
) -> None:
    subject = f"s-{unique}-value"
    v1 = sr.register_schema(subject, schema())
    with pytest.raises(SchemaRegistryError) as refused:
        sr.register_schema(subject, schema(REQUIRED))
    assert refused.value.http_status_code == 409
    assert "note" in refused.value.error_message and "BACKWARD" in refused.value.error_message
    v2 = sr.register_schema(subject, schema(OPTIONAL))
    assert v2 != v1
    assert sr.get_versions(subject) == [1, 2]
    assert sr.get_latest_version(subject).schema_id == v2
    # Registering the same schema again is idempotent: same id, no new version.
    assert sr.register_schema(subject, schema(OPTIONAL)) == v2
    assert sr.get_versions(subject) == [1, 2]


def test_same_schema_same_id_across_subjects(sr: SchemaRegistryClient, unique: str) -> None:
    s = schema({"name": f"f{unique}", "type": "long", "default": 0})
    assert sr.register_schema(f"a-{unique}", s) == sr.register_schema(f"b-{unique}", s)


def test_subject_config_and_compatibility_endpoint(
    services: Settings, sr: SchemaRegistryClient, unique: str
) -> None:
    subject = f"c-{unique}"
    sr.register_schema(subject, schema())
    assert sr.test_compatibility(subject, schema(REQUIRED)) is False
    answer = httpx.post(
        f"{services.registry.url}/compatibility/subjects/{subject}/versions/latest?verbose=true",
        json={"schema": schema(REQUIRED).schema_str},
    ).json()
    assert answer["is_compatible"] is False and any("note" in m for m in answer["messages"])
    sr.set_compatibility(subject, "NONE")
    assert sr.get_compatibility(subject) == "NONE"
    assert sr.test_compatibility(subject, schema(REQUIRED)) is True
    sr.register_schema(subject, schema(REQUIRED))
    assert sr.get_versions(subject) == [1, 2]
    assert sr.get_compatibility() == "BACKWARD"  # the global level is untouched


def test_invalid_schema_and_unknown_id(sr: SchemaRegistryClient, unique: str) -> None:
    with pytest.raises(SchemaRegistryError) as bad:
        sr.register_schema(f"bad-{unique}", Schema('{"type": "record", "name": "X"}', "AVRO"))
    assert bad.value.http_status_code == 422
    with pytest.raises(SchemaRegistryError) as missing:
        sr.get_schema(987654)
    assert missing.value.error_code == 40403


def test_soft_and_hard_delete(sr: SchemaRegistryClient, unique: str) -> None:
    subject = f"d-{unique}"
    sr.register_schema(subject, schema())
    assert sr.delete_subject(subject) == [1]
    assert subject not in sr.get_subjects()
    assert sr.delete_subject(subject, permanent=True) == [1]


def test_restart_keeps_ids_versions_and_config(services: Settings, unique: str) -> None:
    subject = f"r-{unique}"
    sr = SchemaRegistryClient({"url": services.registry.url})
    id1 = sr.register_schema(subject, schema())
    id2 = sr.register_schema(subject, schema(OPTIONAL))
    sr.set_compatibility(subject, "FULL")
    registry = RegistryService(services)
    assert registry.stop()
    assert registry.start()
    fresh = SchemaRegistryClient({"url": services.registry.url})  # no client-side cache
    assert fresh.get_version(subject, 1).schema_id == id1
    assert fresh.get_version(subject, 2).schema_id == id2
    assert json.loads(fresh.get_schema(id2).schema_str)["fields"][-1]["name"] == "note"
    assert fresh.get_compatibility(subject) == "FULL"
    # A new schema after the restart gets an id not yet used (the counter was restored too).
    id3 = fresh.register_schema(f"{subject}-other", schema({"name": "z", "type": "int", "default": 1}))
    assert id3 > id2
