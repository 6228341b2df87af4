"""A corpus of malformed input: registry requests, `produce` lines, pipeline files, schemas and
settings. Every command ends with a clear message and its documented exit code, nothing prints a
traceback, and the valid records sent alongside the bad ones all reach the topic.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from lambdalake.settings import PROJECT_ROOT, Settings
from tests.conftest import env_for
from tests.helpers import consume_all

pytestmark = pytest.mark.services

SUBJECT_OK = {"type": "record", "name": "R", "namespace": "t", "fields": [{"name": "id", "type": "string"}]}


def cli(settings: Settings, *args: str, env: dict[str, str] | None = None, timeout: float = 300):
    return subprocess.run(
        [sys.executable, "-m", "lambdalake", *args],
        env={**env_for(settings), **(env or {})},
        capture_output=True,
        timeout=timeout,
        cwd=PROJECT_ROOT,
    )


def output(result: subprocess.CompletedProcess) -> str:
    return (result.stdout + result.stderr).decode(errors="replace")


# --- registry requests ----------------------------------------------------------------------------

BIG_SCHEMA = json.dumps(
    {
        **SUBJECT_OK,
        "fields": [{"name": f"f{i:06d}", "type": "string", "default": "x" * 40} for i in range(20_000)],
    }
)
NESTED = ("[" * 100_000 + "]" * 100_000).encode()

#: (method, path, body bytes or JSON-able, content type, expected status, expected error_code or None)
REQUESTS = [
    ("POST", "/subjects/{s}/versions", [1, 2], None, 422, 422),
    ("POST", "/subjects/{s}/versions", "a string", None, 422, 422),
    ("POST", "/subjects/{s}/versions", {"schema": 5}, None, 422, 42201),
    ("POST", "/subjects/{s}/versions", {"schema": "not json"}, None, 422, 42201),
    ("POST", "/subjects/{s}/versions", {"schema": '{"type": "nope"}'}, None, 422, 42201),
    ("POST", "/subjects/{s}/versions", {}, None, 422, 42201),
    (
        "POST",
        "/subjects/{s}/versions",
        {"schema": json.dumps(SUBJECT_OK), "schemaType": "PROTOBUF"},
        None,
        422,
        42201,
    ),
    ("POST", "/subjects/{s}/versions", b"{{{", None, 400, 400),
    ("POST", "/subjects/{s}/versions", NESTED, None, 400, 400),
    ("POST", "/subjects/{s}/versions", {"schema": json.dumps(SUBJECT_OK)}, "text/plain", 415, 415),
    ("POST", "/subjects/{s}/versions", {"schema": BIG_SCHEMA}, None, 422, 42209),
    ("POST", "/subjects/{s}/versions", b"x" * 5_000_000, None, 413, 413),
    ("POST", "/subjects/a%01b/versions", {"schema": json.dumps(SUBJECT_OK)}, None, 422, 42208),
    ("POST", "/subjects/a%0Ab/versions", {"schema": json.dumps(SUBJECT_OK)}, None, 422, 42208),
    ("POST", "/subjects/{s}", {"schema": "not avro"}, None, 422, 42201),
    ("POST", "/compatibility/subjects/{s}/versions", {"schema": 1}, None, 422, 42201),
    ("PUT", "/config", {"compatibility": 5}, None, 422, 42203),
    ("PUT", "/config/{s}", {"compatibility": "SOMETIMES"}, None, 422, 42203),
    ("PUT", "/config/{s}", [], None, 422, 422),
    ("GET", "/schemas/ids/notanumber", None, None, 422, 422),
    ("GET", "/schemas/ids/987654321", None, None, 404, 40403),
    ("GET", "/subjects/{s}-missing/versions/1", None, None, 404, 40401),
    ("DELETE", "/subjects/{s}-missing", None, None, 404, 40401),
    ("GET", "/no/such/route", None, None, 404, 404),
]


@pytest.mark.parametrize(
    "method,path,body,kind,status,code", REQUESTS, ids=[str(i) for i in range(len(REQUESTS))]
)
def test_registry_answers_wrong_requests_with_4xx(
    services: Settings, unique: str, method: str, path: str, body, kind, status: int, code: int
) -> None:
    subject = f"bad-{unique}"
    content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    headers = {"Content-Type": kind or "application/vnd.schemaregistry.v1+json"}
    r = httpx.request(
        method, services.registry.url + path.format(s=subject), content=content, headers=headers, timeout=30
    )
    assert r.status_code == status, r.text[:500]
    assert r.json()["error_code"] == code, r.text[:500]
    assert "Traceback" not in r.text
    # Nothing was registered by a refused request.
    assert httpx.get(f"{services.registry.url}/subjects/{subject}/versions", timeout=10).status_code == 404


@pytest.mark.parametrize(
    "head",
    [
        b"POST /subjects/x/versions HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n",
        b"POST /subjects/x/versions HTTP/1.1\r\nHost: a\r\nContent-Length: lots\r\n\r\n",
        b"POST /subjects/x/versions HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        b"\x16\x03\x01\x02\x00garbage that is not HTTP\r\n\r\n",
    ],
    ids=["negative-length", "garbage-length", "two-lengths", "not-http"],
)
def test_registry_refuses_broken_http_without_hanging(services: Settings, head: bytes) -> None:
    host, port = "127.0.0.1", int(services.registry.url.rsplit(":", 1)[1])
    with socket.create_connection((host, port), timeout=10) as conn:
        conn.sendall(head)
        answer = conn.recv(4096)
    assert answer.startswith(b"HTTP/1.1 4"), answer[:200]
    # The registry still serves everyone else.
    assert httpx.get(f"{services.registry.url}/subjects", timeout=10).status_code == 200


# --- produce lines -------------------------------------------------------------------------------


def offer(i: int, **changes) -> dict:
    record = {
        "offer_id": f"o-{i}", "merchant_id": f"m-{i % 7}", "title": "Lamp", "price_cents": 1000 + i,
        "currency": "EUR", "stock": 3, "status": "active", "version": 1,
        "updated_at": int(time.time() * 1000) - 60_000, "promo_code": None,
    }  # fmt: skip
    record.update(changes)
    return record


BAD_LINES: list[bytes] = [
    json.dumps(offer(9001, title="x" * 5_000_000)).encode(),  # valid, but above the broker's size
    b"{" + b"y" * 5_000_000,  # 5 MB of garbage
    NESTED,  # nested too deeply for any JSON parser's stack
    b'{"offer_id": "\\ud800", "merchant_id": "m", "title": "t", "price_cents": 1, "currency": "EUR", '
    b'"stock": 1, "status": "active", "version": 1, "updated_at": 1}',  # a lone surrogate
    b"[1, 2]",
    b'"hello"',
    b"42",
    b"null",
    b"{}",
    json.dumps({**offer(9002), "promocode": "SPRING10"}).encode(),  # misspelt optional field
    json.dumps(offer(9003, price_cents="100")).encode(),
    json.dumps(offer(9004, price_cents=1.5)).encode(),
    json.dumps(offer(9005, version=2**70)).encode(),
    json.dumps(offer(9006)).replace('"price_cents": 10006', '"price_cents": NaN').encode(),
    json.dumps(offer(9007, currency="XXX")).encode(),
    b"\xff\xfe\x00garbage",
    b'{"offer_id": "o',
    json.dumps(offer(9008, updated_at=int(time.time() * 1000) + 86_400_000)).encode(),
    json.dumps(offer(9009, updated_at="not a date")).encode(),
]
#: Odd but valid: a UTF-8 byte-order mark before a record, an ISO-8601 time, padding around it.
ODD_VALID_LINES = [
    b"\xef\xbb\xbf" + json.dumps(offer(9010)).encode(),
    json.dumps(offer(9011, updated_at="2026-01-01T00:00:00Z")).encode(),
    b"   " + json.dumps(offer(9012)).encode() + b"\t ",
]


def test_produce_survives_every_bad_line_and_delivers_every_valid_one(
    services: Settings, tmp_path: Path, unique: str
) -> None:
    settings = services.model_copy(update={"topic_prefix": f"{unique}-", "state_dir": tmp_path / "state"})
    valid = [offer(i) for i in range(3000)]
    lines = [json.dumps(record).encode() for record in valid] + ODD_VALID_LINES
    # The bad lines spread through the valid ones.
    step = len(lines) // (len(BAD_LINES) + 1)
    for k, bad in enumerate(BAD_LINES):
        lines.insert((k + 1) * step + k, bad)
    source = tmp_path / "input.jsonl"
    source.write_bytes(b"\n".join(lines) + b"\n")
    result = cli(settings, "produce", "offers", "--file", str(source))
    text = output(result)
    assert result.returncode == 0, text[-3000:]
    assert "Traceback" not in text
    assert "acknowledged" in text and f"{len(BAD_LINES)}" in text
    topic = f"{unique}-offers"
    on_topic = {m.key().decode() for m in consume_all(settings, topic)}
    assert on_topic == {r["offer_id"] for r in valid} | {"o-9010", "o-9011", "o-9012"}
    dead = consume_all(settings, f"{topic}.dlq")
    rules = [dict(m.headers())["lambdalake.rule"].decode() for m in dead]
    rejects = list((tmp_path / "state" / "rejects").glob("offers-*.jsonl"))
    kept = [json.loads(line) for f in rejects for line in f.read_text().splitlines()]
    assert len(dead) + len(kept) == len(BAD_LINES), (rules, kept)
    assert len(kept) == 2 and str(rejects[0]) in text.replace("\n", "")
    assert {k["rule"] for k in kept} == {"json", "too_large"}
    assert "unknown_field" in rules and "json" in rules


def test_produce_missing_file_exits_2_naming_it(services: Settings, tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    result = cli(services, "produce", "offers", "--file", str(missing))
    assert result.returncode == 2 and str(missing) in output(result).replace("\n", "")
    assert "Traceback" not in output(result)


def test_unknown_fields_can_be_dropped_by_the_pipeline(services: Settings, unique: str) -> None:
    from lambdalake.produce.producer import EventProducer
    from tests.conftest import pipeline_named

    pipeline = pipeline_named(services, "offers", topic=f"offers-{unique}")
    pipeline = pipeline.model_copy(
        update={"event": pipeline.event.model_copy(update={"unknown_fields": "drop"})}
    )
    producer = EventProducer(settings=services, pipeline=pipeline)
    assert producer.send({**offer(1), "promocode": "SPRING10"}) is None
    assert producer.flush().acked == 1


# --- pipeline files and schemas -------------------------------------------------------------------

OFFERS = (PROJECT_ROOT / "pipelines" / "offers.toml").read_text()

#: (name, a change to offers.toml, text the error must contain)
PIPELINES = [
    ("zero_window", lambda t: t.replace('window = "1 hour"', 'window = "0 minutes"'), "window"),
    ("huge_window", lambda t: t.replace('window = "1 hour"', 'window = "100000 days"'), "window"),
    ("odd_window", lambda t: t.replace('window = "1 hour"', 'window = "1 fortnight"'), "window"),
    ("min_over_max", lambda t: t.replace("min = 0\nmax = 100_000_000_00", "min = 10\nmax = 1"), "min 10 exceeds max 1"),
    ("topic_config", lambda t: t.replace('"cleanup.policy" = "compact"', '"cleanup.polcy" = "compact"'), "cleanup.polcy"),
    ("missing_column", lambda t: t.replace('column = "stock"', 'column = "stok"'), "merchant_offers_hourly"),
    ("text_sum", lambda t: t.replace('column = "stock"', 'column = "title"'), "not numeric"),
    ("not_toml", lambda t: t + "\n[[[ broken", "not valid TOML"),
    ("unknown_key", lambda t: t.replace('key = "offer_id"\ntime', 'kee = "offer_id"\ntime'), "kee"),
    ("identity_without_key", lambda t: t.replace('identity = ["offer_id", "version"]', 'identity = ["version"]'), "identity"),
    ("rule_on_missing_field", lambda t: t.replace('field = "merchant_id"', 'field = "merchant"'), "rules (required): 'merchant'"),
    ("duplicate_views", lambda t: t.replace('name = "merchant_offers_hourly"', 'name = "offer_latest"'), "unique"),
    ("no_partitions", lambda t: t.replace("partitions = 2", "partitions = 0"), "partitions"),
    ("zero_epoch", lambda t: t.replace('epoch = "1 hour"', 'epoch = "0 hours"'), "layers.epoch"),
    ("short_ttl", lambda t: t.replace('speed_ttl = "3 days"', 'speed_ttl = "1 hour"'), "at least two epochs"),
    ("bad_name", lambda t: t.replace('name = "offer_latest"', 'name = "Offer-Latest"'), "views.0.latest.name"),
    ("range_without_bounds", lambda t: t.replace("min = 0\n\n[[rules]]\nkind = \"range\"\nfield = \"version\"", "\n[[rules]]\nkind = \"range\"\nfield = \"version\""), "neither min nor max"),
]  # fmt: skip

SCHEMAS = [
    ("avsc_not_json", b"{ this is not json", "is not JSON"),
    ("avsc_not_avro", b'{"type": "recrod", "name": "R", "fields": []}', "not a valid Avro schema"),
    ("avsc_empty", b"", "is not JSON"),
    ("avsc_union", b'["null", "string"]', "must be an Avro record"),
    ("avsc_bad_field_type", b'{"type": "record", "name": "R", "fields": [{"name": "a", "type": "strng"}]}', "not a valid Avro schema"),
    ("avsc_missing", None, "cannot read"),
    ("avsc_not_utf8", b"\xff\xfe\xfa", "is not JSON"),
]  # fmt: skip


@pytest.fixture(scope="module")
def broken_pipelines(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("broken")
    (root / "pipelines").mkdir()
    schemas = root / "schemas"
    (schemas / "offers").mkdir(parents=True)
    for f in (PROJECT_ROOT / "schemas" / "offers").iterdir():
        (schemas / "offers" / f.name).write_bytes(f.read_bytes())
    (root / "pipelines" / "offers.toml").write_text(OFFERS)  # one good file among the broken
    for name, change, _ in PIPELINES:
        text = change(OFFERS).replace('name = "offers"\ndescription', f'name = "{name}"\ndescription', 1)
        assert text != OFFERS.replace('name = "offers"\ndescription', f'name = "{name}"\ndescription', 1), (
            name
        )
        (root / "pipelines" / f"{name}.toml").write_text(text)
    for name, content, _ in SCHEMAS:
        if content is not None:
            (schemas / f"{name}.avsc").write_bytes(content)
        text = OFFERS.replace('"offers/v1.avsc", "offers/v2.avsc"', f'"offers/v1.avsc", "{name}.avsc"')
        (root / "pipelines" / f"{name}.toml").write_text(text)
    return root


def _broken_env(root: Path) -> dict[str, str]:
    return {
        "LAMBDALAKE_PIPELINES_DIR": str(root / "pipelines"),
        "LAMBDALAKE_SCHEMAS_DIR": str(root / "schemas"),
    }


@pytest.mark.parametrize(
    "name,expected",
    [(n, e) for n, _, e in PIPELINES] + [(n, e) for n, _, e in SCHEMAS],
    ids=lambda v: str(v)[:30],
)
def test_broken_pipeline_is_refused_with_file_field_and_fix(
    settings: Settings, broken_pipelines: Path, name: str, expected: str
) -> None:
    # `topics` loads the file before it contacts Kafka: no services are needed to refuse it.
    result = cli(settings, "topics", name, env=_broken_env(broken_pipelines))
    text = " ".join(output(result).split())
    assert result.returncode == 2, text
    assert "Traceback" not in text
    assert f"{name}.toml" in text or f"{name}.avsc" in text, text
    assert expected in text, text
    assert "fix:" in text


def test_one_broken_pipeline_does_not_hide_the_others(settings: Settings, broken_pipelines: Path) -> None:
    result = cli(settings, "pipelines", env={**_broken_env(broken_pipelines), "COLUMNS": "300"})
    text = output(result)
    assert result.returncode == 2 and "Traceback" not in text
    assert "offer_latest" in text  # the good one is listed with its views
    for name, *_ in PIPELINES + SCHEMAS:
        assert f"✘ {name}:" in text, name


def test_schema_check_of_a_file_that_is_not_avro(services: Settings, tmp_path: Path) -> None:
    candidate = tmp_path / "candidate.avsc"
    candidate.write_text("{ not json")
    result = cli(services, "schemas", "check", "offers", str(candidate))
    assert result.returncode == 2 and "Traceback" not in output(result)
    assert "candidate.avsc" in output(result).replace("\n", "")


# --- settings ------------------------------------------------------------------------------------

SETTINGS = [
    ("LAMBDALAKE_CASSANDRA__PORT", "abc"),
    ("LAMBDALAKE_CASSANDRA__PORT", "70000"),
    ("LAMBDALAKE_CASSANDRA__STORAGE_PORT", "0"),
    ("LAMBDALAKE_CASSANDRA__PROTOCOL_VERSION", "2"),
    ("LAMBDALAKE_CASSANDRA__BATCH_ROWS", "0"),
    ("LAMBDALAKE_KAFKA__EXTRA", "notjson"),
    ("LAMBDALAKE_CASSANDRA__CONTACT_POINTS", "a,b"),
    ("LAMBDALAKE_REGISTRY__URL", "ftp://x"),
    ("LAMBDALAKE_REGISTRY__URL", "http://"),
    ("LAMBDALAKE_REGISTRY__URL", "http://user:hunter2@host:99999"),
    ("LAMBDALAKE_KAFKA__BOOTSTRAP_SERVERS", "nohostport"),
    ("LAMBDALAKE_KAFKA__BOOTSTRAP_SERVERS", "host:99999"),
    ("LAMBDALAKE_SPARK__MASTER", "foo://bar"),
    ("LAMBDALAKE_KAFKA__SECURITY_PROTOCOL", "TLS"),
    ("LAMBDALAKE_KAFKA__CONNECT_TIMEOUT_S", "-1"),
]


@pytest.mark.parametrize("variable,value", SETTINGS, ids=[f"{k}={v}" for k, v in SETTINGS])
def test_bad_setting_exits_2_naming_the_variable(settings: Settings, variable: str, value: str) -> None:
    result = cli(settings, "config", env={variable: value})
    text = " ".join(output(result).split())
    assert result.returncode == 2, text
    assert "Traceback" not in text
    assert variable in text and "fix:" in text, text
    assert "hunter2" not in text


def test_secrets_are_masked_in_config(settings: Settings) -> None:
    env = {
        "LAMBDALAKE_KAFKA__SASL_PASSWORD": "pw-one",
        "LAMBDALAKE_KAFKA__EXTRA": json.dumps(
            {"sasl.oauthbearer.client.secret": "pw-two", "client.rack": "r1"}
        ),
        "LAMBDALAKE_REGISTRY__URL": "https://reader:pw-three@registry.example.com:8081",
        "LAMBDALAKE_CASSANDRA__PASSWORD": "pw-four",
    }
    result = cli(settings, "config", env=env)
    text = output(result)
    assert result.returncode == 0, text
    assert "pw-" not in text and "r1" in text and "registry.example.com" in text
    assert os.environ.get("LAMBDALAKE_KAFKA__SASL_PASSWORD") is None
