"""Edge validation of single records (no services: the rules and the schema check alone)."""

from __future__ import annotations

import json

import pytest

from lambdalake.avro import parse_schema
from lambdalake.pipeline import AllowedRule, RequiredRule
from lambdalake.settings import Settings
from lambdalake.validation import RecordValidator
from tests.conftest import pipeline_named

NOW = 1_800_000_000.0


def validator(name: str) -> RecordValidator:
    p = pipeline_named(Settings(), name)
    schema = json.loads(p.schema_text())
    return RecordValidator(p.rules, schema=schema, parsed_schema=parse_schema(schema), now=lambda: NOW)


OFFER = {
    "offer_id": "o-1", "merchant_id": "m-1", "title": "Lamp", "price_cents": 1999, "currency": "EUR",
    "stock": 3, "status": "active", "version": 7, "updated_at": int(NOW * 1000) - 5000, "promo_code": None,
}  # fmt: skip
READING = {
    "vehicle_id": "v-1", "event_time": int(NOW * 1000), "speed_kmh": 88.5, "heading_deg": 359.99,
    "latitude": 52.5, "longitude": 13.4, "engine_state": "running", "odometer_km": 12345.6,
}  # fmt: skip


def test_valid_records_pass() -> None:
    assert validator("offers").check(OFFER) is None
    assert validator("telemetry").check(READING) is None
    no_optional = {k: v for k, v in OFFER.items() if k != "promo_code"}
    assert validator("offers").check(no_optional) is None


@pytest.mark.parametrize(
    ("change", "rule", "mentions"),
    [
        ({"price_cents": -1}, "price_cents.range", "-1"),
        ({"currency": "XXX"}, "currency.allowed", "XXX"),
        ({"offer_id": "  "}, "offer_id.required", "offer_id"),
        ({"offer_id": None}, "offer_id.required", "offer_id"),
        ({"updated_at": int(NOW * 1000) + 301_000}, "updated_at.not_future", "future"),
        # Epoch milliseconds (as decoders hand them over) are shown as a time too.
        ({"updated_at": int(NOW * 1000) + 301_000}, "updated_at.not_future", "+00:00)"),
        ({"price_cents": "12.99"}, "schema", "price_cents"),
        ({"price_cents": 12.5}, "schema", "price_cents"),  # fastavro alone would write this
        ({"stock": 2**40}, "schema", "stock"),  # int overflow
        ({"status": "deleted"}, "schema", "status"),
        ({"version": True}, "schema", "version"),
        ({"version": 0}, "version.range", "version"),
    ],
)
def test_invalid_offers_name_rule_and_value(change: dict, rule: str, mentions: str) -> None:
    rejection = validator("offers").check({**OFFER, **change})
    assert rejection is not None and rejection.rule == rule
    assert mentions in rejection.reason


def test_missing_field_is_named() -> None:
    record = {k: v for k, v in OFFER.items() if k != "title"}
    rejection = validator("offers").check(record)
    assert rejection is not None and rejection.rule == "schema" and "'title'" in rejection.reason


@pytest.mark.parametrize(
    ("change", "rule"),
    [
        ({"heading_deg": 360.0}, "heading_deg.range"),  # max is exclusive
        ({"speed_kmh": float("nan")}, "speed_kmh.range"),
        ({"latitude": -90.5}, "latitude.range"),
        ({"engine_state": "flying"}, "schema"),
        ({"vehicle_id": ""}, "vehicle_id.required"),
    ],
)
def test_invalid_readings(change: dict, rule: str) -> None:
    rejection = validator("telemetry").check({**READING, **change})
    assert rejection is not None and rejection.rule == rule


def test_not_an_object() -> None:
    rejection = validator("offers").check([1, 2])  # type: ignore[arg-type]
    assert rejection is not None and rejection.rule == "schema"


def test_identity_must_include_the_key() -> None:
    from pydantic import ValidationError

    from lambdalake.pipeline import EventSpec

    assert EventSpec(key="offer_id", time="updated_at", identity=["offer_id", "version"])
    with pytest.raises(ValidationError, match="must include the key 'offer_id'"):
        EventSpec(key="offer_id", time="updated_at", identity=["version"])


@pytest.mark.parametrize(
    "bounds",
    [
        {"min": 0, "max": 360, "max_inclusive": False},
        {"min": 0, "max": 360},
        {"min": -1.5},
        {"max": 2**40},
    ],
)
def test_range_rule_fast_path_agrees_with_the_rule(bounds: dict) -> None:
    """The numeric fast path of a range rule accepts exactly what the rule's bounds allow."""
    from lambdalake.pipeline import RangeRule
    from lambdalake.validation import compile_rule

    rule = RangeRule.model_validate({"kind": "range", "field": "x", **bounds})
    check = compile_rule(rule)
    lo, hi, incl = bounds.get("min"), bounds.get("max"), bounds.get("max_inclusive", True)
    nan, inf = float("nan"), float("inf")
    for v in [0, 0.0, -0.0, 1, 359, 359.999, 360, 360.0, 361, -1, -1.5, -1.6, 2**40, 2**40 + 1, 2**70,
              -(2**70), inf, -inf, nan, 1e308, True, False]:  # fmt: skip
        finite = not isinstance(v, float) or (v == v and v not in (inf, -inf))
        inside = (lo is None or v >= lo) and (hi is None or (v <= hi if incl else v < hi))
        assert (check({"x": v}, 0.0) is None) == (finite and inside), v


@pytest.mark.parametrize(
    ("plain", "branch", "member", "verdict"),
    [("a", "string", "member0", None), (7, "long", "member1", None), ("b", "string", "member0", "v.allowed"),
     (8, "long", "member1", "v.allowed"), (None, None, None, "v.required")],
)  # fmt: skip
def test_rules_on_a_general_union_judge_its_value_in_whichever_form_it_comes(
    plain: object, branch: str | None, member: str | None, verdict: str | None
) -> None:
    """Producers hand a general union's value over plain, or in fastavro's ``(branch, value)``
    notation (an Arrow table's struct, converted); decoded rows hold the struct of members. A rule
    on the field judges the value itself in every form."""
    schema = {"type": "record", "name": "r", "fields": [{"name": "v", "type": ["null", "string", "long"]}]}
    rules = [
        RequiredRule(kind="required", field="v"),
        AllowedRule(kind="allowed", field="v", values=["a", 7]),
    ]
    edge = RecordValidator(rules, schema=schema, parsed_schema=parse_schema(schema))
    decoded = RecordValidator(rules, schema=schema, parsed_schema=None, check_shape=False)
    tagged = None if branch is None else (branch, plain)
    members = None if member is None else {"member0": None, "member1": None, member: plain}
    for record, validator in [({"v": plain}, edge), ({"v": tagged}, edge), ({"v": members}, decoded)]:
        rejection = validator.check(record, now=0)
        assert (rejection.rule if rejection else None) == verdict, (record, rejection)
