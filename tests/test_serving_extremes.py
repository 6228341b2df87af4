"""The HTTP API at the edges of what its parameters admit, for a pipeline no shipped code knows: keys
of every column type at and beyond their extremes, times before 1970 and before year 1000, epoch
milliseconds at the document's bounds, and a pipeline whose views are not deployed. Every answer is
a documented one (200, 400, 404, 422, 503), never a server error."""

from __future__ import annotations

import json
import time
from decimal import Decimal
from typing import Any

import httpx
import pytest

from lambdalake.cassandra.session import connect
from lambdalake.cassandra.tables import create_keyspace, ensure_table, speed_table_def
from lambdalake.pipeline import configured_pipeline
from lambdalake.settings import Settings
from tests.conftest import isolated
from tests.helpers import assert_schemathesis_passes, schemathesis_seed, serving_app

pytestmark = pytest.mark.services

SCHEMA = {
    "type": "record", "name": "Reading", "namespace": "test.extremes",
    "fields": [
        {"name": "i32", "type": "int"},
        {"name": "i64", "type": "long"},
        {"name": "f32", "type": "float"},
        {"name": "f64", "type": "double"},
        {"name": "amount", "type": {"type": "bytes", "logicalType": "decimal", "precision": 9, "scale": 2}},
        {"name": "flag", "type": "boolean"},
        {"name": "at", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "name", "type": "string"},
        {"name": "value", "type": "double"},
    ],
}  # fmt: skip
KEY = ["i32", "i64", "f32", "f64", "amount", "flag", "at", "name"]
PIPELINE = f"""
name = "extremes"
[topic]
name = "extremes"
partitions = 1
[schema]
subject = "extremes-value"
versions = ["extremes/v1.avsc"]
[event]
key = "name"
time = "at"
identity = ["name", "at"]
[[views]]
name = "every_key"
kind = "latest"
key = {json.dumps(KEY)}
version = "at"
[[views]]
name = "per_amount"
kind = "windowed"
key = ["amount"]
window = "1 minute"
aggregates = [{{ name = "n", fn = "count" }}, {{ name = "total", fn = "sum", column = "value" }}]
"""

#: A valid key value per column, then values at and beyond each column's extremes.
VALID = {"i32": "1", "i64": "1", "f32": "1.5", "f64": "1.5", "amount": "12.5", "flag": "true",
         "at": "2026-01-01T00:00:00Z", "name": "x"}  # fmt: skip
EXTREMES = {
    "i32": ["2147483647", "-2147483648", "2147483648", "-2147483649", "1" * 5000, "1.0", ""],
    "i64": ["9223372036854775807", "-9223372036854775808", "9223372036854775808", "-1e30", "0x10"],
    "f32": ["3.4028234e38", "3.5e38", "-1e39", "inf", "-inf", "nan", "1e-50"],
    "f64": ["1.7976931348623157e308", "1e309", "-inf", "nan", "5e-324"],
    "amount": ["9999999.99", "-9999999.99", "99999999.99", "0.001", "1e999999999", "NaN", "-0", "abc"],
    "flag": ["TRUE", "false", "1", "yes"],
    "at": ["0934-08-09T19:13:17Z", "0001-01-01T00:00:00Z", "9999-12-31T23:59:59.999Z", "-1",
           "-62135596800001", str(-(2**62)), str(2**62), str(2**62 + 1), "1969-12-31T23:59:59Z"],
    "name": ["", " ", "é" * 3000, "a%2Cb"],
}  # fmt: skip
TIMES = ["0934-08-09T19:13:17Z", "0001-01-01T00:00:00Z", "9999-12-31T23:59:59Z", "-1", "0",
         str(-(2**62)), str(2**62), str(-(2**62) - 1), str(2**63), "1969-07-20T20:17:00+14:00",
         "2026-13-01T00:00:00Z", ""]  # fmt: skip
DOCUMENTED = {200, 400, 404, 422, 503}
TOKEN = "extremes-token"


@pytest.fixture(scope="module")
def api(services: Settings, tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("extremes")
    (tmp / "pipelines").mkdir()
    (tmp / "schemas" / "extremes").mkdir(parents=True)
    (tmp / "pipelines" / "extremes.toml").write_text(PIPELINE)
    (tmp / "schemas" / "extremes" / "v1.avsc").write_text(json.dumps(SCHEMA))
    # A second pipeline, never deployed: its keyspace has no tables of it.
    (tmp / "pipelines" / "undeployed.toml").write_text(
        PIPELINE.replace('name = "extremes"\n[topic]', 'name = "undeployed"\n[topic]', 1)
    )
    settings = isolated(services, tmp, f"x{int(time.time() * 1000) % 10**8}").model_copy(
        update={"pipelines_dir": tmp / "pipelines", "schemas_dir": tmp / "schemas"}
    )
    pipeline = configured_pipeline("extremes", settings)
    session = connect(settings.cassandra)
    create_keyspace(session, settings.cassandra)
    keyspace = settings.cassandra.keyspace
    for view in pipeline.views:
        ensure_table(session, keyspace, speed_table_def(pipeline, view))
    # One stored window, keyed by a decimal stored at its scale (12.50), as the speed layer writes it.
    windowed = speed_table_def(pipeline, pipeline.views[1])
    insert = session.prepare(
        f'INSERT INTO "{keyspace}"."{windowed.name}" ("amount", "window_start", "epoch", "n", "total") '
        "VALUES (?, ?, ?, ?, ?)"
    )  # prepared, as the layers write (a literal would be stored as 12.5, another partition)
    session.execute(insert, [Decimal("12.50"), -32673905220000, 1, 1, 2.5])  # a window in the year 934
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with (
        serving_app(settings, token=TOKEN) as root,
        httpx.Client(base_url=f"{root}/v1/pipelines", headers=auth, timeout=30) as http,
    ):
        http.root = root  # type: ignore[attr-defined]
        yield http


def test_every_key_column_at_and_beyond_its_extremes_gets_a_documented_answer(api: httpx.Client) -> None:
    seen = {}
    for column, values in EXTREMES.items():
        for value in values:
            key = ",".join(value if c == column else VALID[c] for c in KEY)
            answer = api.get(f"/extremes/views/every_key/keys/{key}")
            assert answer.status_code in (404, 422), (column, value, answer.status_code, answer.text)
            assert "detail" in answer.json()
            seen[(column, value)] = answer.status_code
    # Values inside each column's range are looked up (no rows: 404); values beyond it are refused.
    assert seen[("i32", "2147483647")] == 404 and seen[("i32", "2147483648")] == 422
    assert seen[("i64", "-9223372036854775808")] == 404 and seen[("i64", "9223372036854775808")] == 422
    assert seen[("f32", "3.4028234e38")] == 404 and seen[("f32", "3.5e38")] == 422
    assert seen[("amount", "9999999.99")] == 404 and seen[("amount", "99999999.99")] == 422
    assert seen[("amount", "0.001")] == 422 and seen[("at", "0934-08-09T19:13:17Z")] == 404
    assert seen[("at", str(2**62 + 1))] == 422


def test_times_before_1970_and_at_the_documented_bounds(api: httpx.Client) -> None:
    for start in TIMES:
        for end in TIMES:
            answer = api.get("/extremes/views/per_amount/keys/12.5", params={"from": start, "to": end})
            assert answer.status_code in DOCUMENTED, (start, end, answer.status_code, answer.text)
    # The window of the year 934 is answered, at the key's scale (12.5 finds the row stored as 12.50).
    answer = api.get(
        "/extremes/views/per_amount/keys/12.5", params={"from": "0934-08-09T19:13:00Z", "to": ""}
    )
    assert answer.status_code == 200, answer.text
    windows = answer.json()["windows"]
    assert [w["window_start"] for w in windows] == ["0934-08-09T19:13:00Z"]
    assert windows[0]["values"] == {"n": 1, "total": 2.5}
    assert (
        api.get("/extremes/views/per_amount/keys/12.5", params={"from": "0934-08-09T19:14:00Z"}).status_code
        == 404
    )


def test_a_pipeline_whose_views_are_not_deployed_answers_503_naming_the_fix(api: httpx.Client) -> None:
    answer = api.get("/undeployed/views/per_amount/keys/12.5", params={"from": "0934-08-09T19:13:17Z"})
    assert answer.status_code == 503, answer.text
    assert "lambdalake deploy --pipeline undeployed" in answer.json()["fix"]
    assert answer.headers["Retry-After"]


def test_schemathesis_finds_no_server_error_for_every_key_type(api: httpx.Client) -> None:
    """schemathesis generates keys and times from the document for a pipeline keyed by every column
    type (and one not deployed); each answer must be a documented one. The seed is printed."""
    assert_schemathesis_passes(api.root, token=TOKEN, seed=schemathesis_seed(), examples=60)  # type: ignore[attr-defined]
