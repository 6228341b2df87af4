"""A value's one JSON form (lambdalake/json_form.py), for every type a view may answer, through the
Python client's dict, the HTTP body and the CLI's rows alike. Measured before: a view storing a
``fixed`` or ``bytes`` field answered HTTP 500 for every key (neither orjson nor the standard
library encodes bytes), and NaN went out as null or as bare ``NaN`` (not JSON)."""

from __future__ import annotations

import base64
import json
import math
from datetime import UTC, date, datetime
from decimal import Decimal
from uuid import UUID

import pytest

from lambdalake.json_form import DESCRIPTION, json_value
from lambdalake.serving.answers import Answer, LatestRow, Provenance, WindowRow

EVERY_TYPE = {
    "int": (7, 7),
    "long": (2**63 - 1, 2**63 - 1),
    "beyond 64 bits (a rank)": (2**83, 2**83),
    "double": (0.1, 0.1),
    "nan": (math.nan, "NaN"),
    "infinity": (math.inf, "Infinity"),
    "-infinity": (-math.inf, "-Infinity"),
    "decimal": (Decimal("12.50"), "12.50"),
    "decimal exponent": (Decimal("1E+3"), "1000"),
    "decimal small": (Decimal("-0.000001"), "-0.000001"),
    "string": ("naïve ✓", "naïve ✓"),
    "bytes": (b"\x00\xffab", base64.b64encode(b"\x00\xffab").decode()),
    "fixed": (bytes(range(8)), "AAECAwQFBgc="),
    "empty bytes": (b"", ""),
    "boolean": (True, True),
    "null": (None, None),
    "timestamp": (datetime(2026, 12, 1, 10, 0, 0, 123000, tzinfo=UTC), "2026-12-01T10:00:00.123000Z"),
    "naive timestamp (UTC, as the driver returns it)": (datetime(2026, 12, 1, 10), "2026-12-01T10:00:00Z"),
    "date": (date(2026, 12, 1), "2026-12-01"),
    "uuid": (UUID(int=1), "00000000-0000-0000-0000-000000000001"),
}


@pytest.mark.parametrize("name", list(EVERY_TYPE))
def test_every_type_has_one_json_form(name: str) -> None:
    value, form = EVERY_TYPE[name]
    assert json_value(value) == form
    json.dumps(json_value({"v": [value]}), allow_nan=False)  # valid JSON, no bare NaN


def _answer(values: dict, rank: int) -> Answer:
    provenance = Provenance(
        batch_version=3, horizon=9, horizon_end_ms=10_000, epoch_ms=1000, speed_epochs=(10,)
    )
    window = WindowRow(datetime(2026, 12, 1, tzinfo=UTC), dict(values), True, (10,))
    latest = LatestRow(dict(values), rank, "speed")
    return Answer("p", "v", "latest", {"id": b"\x01\x02"}, provenance, latest=latest, windows=[window])


#: A sketch's answer, nested in a windowed row's values.
SKETCH = (
    {"estimate": math.nan, "lower": 1.0, "q": {"0.5": math.inf}},
    {"estimate": "NaN", "lower": 1.0, "q": {"0.5": "Infinity"}},
)


@pytest.mark.parametrize("wide", [True, False], ids=["an integer beyond 64 bits", "64-bit integers"])
def test_an_answer_of_every_type_reads_the_same_from_python_http_and_the_cli(wide: bool) -> None:
    """With an integer beyond 64 bits the standard library writes the body, else orjson: one form."""
    from lambdalake.cli.serving import answer_rows

    types = {n: t for n, t in EVERY_TYPE.items() if wide or n != "beyond 64 bits (a rank)"}
    types["sketch"] = SKETCH
    rank = 2**83 + 5 if wide else 2**62
    answer = _answer({name: value for name, (value, _) in types.items()}, rank)
    body = json.loads(answer.to_json())
    assert body == answer.to_dict()
    want = {name: form for name, (_, form) in types.items()}
    assert body["latest"]["values"] == want
    assert body["windows"][0]["values"] == want
    assert body["latest"]["rank"] == rank
    assert body["key"] == {"id": "AQI="}
    row = answer_rows(answer)[0]
    assert {name: row[name] for name in want if name != "sketch"} == {
        n: f for n, f in want.items() if n != "sketch"
    }


def test_the_openapi_document_states_the_form() -> None:
    from lambdalake.serving.contract import VALUES

    assert VALUES == DESCRIPTION
    for words in ("base64", '"NaN"', "RFC 3339", "digits"):
        assert words in DESCRIPTION
