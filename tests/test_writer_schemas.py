"""Writer schemas by id over the registry's REST API (what the decoding tasks call)."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient

from lambdalake.settings import Settings
from lambdalake.writer_schemas import RegistryUnavailable, SchemaIdNotFound, fetcher

SCHEMA = {"type": "record", "name": "W", "fields": [{"name": "a", "type": "long"}]}


def test_reads_what_the_registry_holds_and_tells_an_unknown_id(services: Settings, unique: str) -> None:
    registry = services.registry.client_config()
    schema = Schema(json.dumps(SCHEMA), "AVRO")
    schema_id = SchemaRegistryClient(registry).register_schema(f"w-{unique}", schema)
    get = fetcher(registry)
    assert json.loads(get(schema_id)) == SCHEMA
    with pytest.raises(SchemaIdNotFound, match="schema id 987654 is not in the registry"):
        get(987654)


class _Registry(BaseHTTPRequestHandler):
    """Answers /schemas/ids/1 to ``alice:s3cret`` only, after ``failures`` 503 answers."""

    failures = 0
    calls: list[str | None] = []

    def do_GET(self) -> None:
        type(self).calls.append(self.headers.get("Authorization"))
        if type(self).failures > 0:
            type(self).failures -= 1
            self._answer(503, {"error_code": 50301, "message": "busy"})
        elif self.headers.get("Authorization") != "Basic " + base64.b64encode(b"alice:s3cret").decode():
            self._answer(401, {"error_code": 401, "message": "unauthorized"})
        elif self.path == "/schemas/ids/1":
            self._answer(200, {"schema": json.dumps(SCHEMA)})
        else:
            self._answer(404, {"error_code": 40403, "message": "Schema not found"})

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def guarded() -> Iterator[str]:
    _Registry.failures, _Registry.calls = 0, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Registry)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize(
    "config",
    [
        {"url": "http://{host}", "basic.auth.user.info": "alice:s3cret"},
        {"url": "http://alice:s3cret@{host}"},
        {"url": "http://mallory:x@{host}", "basic.auth.user.info": "alice:s3cret"},
    ],
    ids=["user-info-setting", "in-the-url", "setting-wins"],
)
def test_credentials_as_confluent_kafka_takes_them(guarded: str, config: dict[str, str]) -> None:
    get = fetcher({k: v.format(host=guarded) for k, v in config.items()}, backoff_s=0.01)
    assert json.loads(get(1)) == SCHEMA
    assert get(1) and len(_Registry.calls) == 1  # cached: an id's schema never changes


def test_wrong_credentials_fail_at_once_naming_the_registry_without_them(guarded: str) -> None:
    get = fetcher({"url": f"http://alice:wrong@{guarded}"}, backoff_s=0.01)
    with pytest.raises(RegistryUnavailable, match="401") as failure:
        get(1)
    assert "wrong" not in str(failure.value) and guarded in str(failure.value)
    assert len(_Registry.calls) == 1


def test_a_busy_registry_is_asked_again_then_reported(guarded: str) -> None:
    config = {"url": f"http://{guarded}", "basic.auth.user.info": "alice:s3cret"}
    _Registry.failures = 2
    assert json.loads(fetcher(config, attempts=3, backoff_s=0.01)(1)) == SCHEMA
    _Registry.failures = 5
    with pytest.raises(RegistryUnavailable, match="503"):
        fetcher(config, attempts=3, backoff_s=0.01)(1)


def test_no_registry_is_reported_naming_it() -> None:
    with pytest.raises(RegistryUnavailable, match=r"127\.0\.0\.1:9: .*refused"):
        fetcher({"url": "http://127.0.0.1:9"}, attempts=2, backoff_s=0.01, timeout_s=2)(1)
