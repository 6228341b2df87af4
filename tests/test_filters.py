"""A view's ``where``: parsed once, refused with the position and the field when wrong, and the same
rows kept by each engine that runs it (Python, Spark, Arrow) on rows with nulls, decimals and times."""

from __future__ import annotations

import os
import struct
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lambdalake import filters
from lambdalake.errors import ConfigurationError
from lambdalake.pipeline import load
from lambdalake.spark.filters import column

TYPES = {
    "status": pa.string(),
    "amount": pa.decimal128(12, 2),
    "attempt": pa.int32(),
    "score": pa.float64(),
    "paid_at": pa.timestamp("us", tz="UTC"),
    "day": pa.date32(),
    "flag": pa.bool_(),
    "tag": pa.binary(),
    "temp": pa.float32(),
    "load": pa.float64(),
    "code": pa.binary(4),
    "tiny": pa.decimal128(38, 30),
}
SCHEMA = pa.schema([pa.field(n, t) for n, t in TYPES.items()])
START = datetime(2026, 1, 1, tzinfo=UTC)


def test_mistakes_name_the_position_and_the_field() -> None:
    cases = {
        "stauts = 'x'": "position 1: unknown field 'stauts'",
        "attempt = 1.5": "position 11: field 'attempt' is an integer",
        "status = 'a' and": "position 17: expected a field, found the end",
        "flag > true": "position 6: field 'flag' is a boolean",
        "amount = 'ten'": "position 10: field 'amount' is a decimal(12, 2)",
        "paid_at < 'yesterday'": "position 11: field 'paid_at' is a timestamp",
        "status = 'x' extra": "position 14: expected 'and', 'or' or the end",
        "(attempt = 1": "position 13: expected ')'",
        "status = null": "position 10: compare with null as `status is null`",
        "status ~ 'x'": "position 8: unexpected \"~ 'x'\"",
        "amount < 1e50": "position 10: field 'amount' is a decimal(12, 2): 1e50 has more than 38 digits",
        "temp < 1e39": "position 8: field 'temp' is a floating-point number: 1e39 is out of its range",
        "load > 1e400": "position 8: field 'load' is a floating-point number: 1e400 is out of its range",
    }
    for text, message in cases.items():
        with pytest.raises(filters.FilterError) as caught:
            filters.parse(text, TYPES)
        assert message in str(caught.value), (text, str(caught.value))
    with pytest.raises(filters.FilterError, match="'pending' is not one of them"):
        filters.parse("status = 'pending'", TYPES, symbols={"status": ["active", "withdrawn"]})


def test_a_bad_filter_is_refused_when_the_pipeline_loads(tmp_path: Path) -> None:
    shipped = Path("pipelines/offers.toml").read_text()
    text = shipped.replace('window = "1 hour"', 'window = "1 hour"\nwhere = "stauts = \'active\'"', 1)
    (tmp_path / "offers.toml").write_text(text)
    with pytest.raises(ConfigurationError) as caught:
        load(tmp_path / "offers.toml", schemas_dir=Path("schemas"))
    message = str(caught.value)
    assert "merchant_offers_hourly" in message and "position 1: unknown field 'stauts'" in message
    text = shipped.replace('window = "1 hour"', 'window = "1 hour"\nwhere = "status = \'sold\'"', 1)
    (tmp_path / "offers.toml").write_text(text)
    with pytest.raises(ConfigurationError, match="'sold' is not one of them"):
        load(tmp_path / "offers.toml", schemas_dir=Path("schemas"))


def test_a_filter_is_part_of_the_definition_and_absent_filters_keep_fingerprints() -> None:
    from lambdalake.view_versions import fingerprint

    pipeline = load(Path("pipelines/offers.toml"), schemas_dir=Path("schemas"))
    view = pipeline.views[1]
    assert "where" not in view.model_dump() and "lg_k" not in view.model_dump()["aggregates"][0]
    filtered = view.model_copy(update={"where": "status = 'active'"})
    assert fingerprint(filtered) != fingerprint(view)


#: Floats at the edges: 0.1 as double and as 32-bit float, signed zeros, infinities, NaN, extremes.
_EDGES = [0.1, 0.10000000149011612, 0.09999999403953552, 0.0, -0.0, 100.0, 100.5, float("inf"),
          float("-inf"), float("nan"), 3.4028234663852886e38, -1e308, 5e-324]  # fmt: skip


def _float32(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", value))[0] if abs(value) < 3.5e38 else value


rows = st.fixed_dictionaries(
    {
        "status": st.none() | st.sampled_from(["active", "withdrawn", "it's"]),
        "amount": st.none() | st.integers(-2000, 2000).map(lambda c: Decimal(c).scaleb(-2)),
        "attempt": st.none() | st.integers(-3, 3),
        "score": st.none() | st.floats(-5, 5, allow_nan=False),
        "paid_at": st.none() | st.integers(0, 48).map(lambda h: START + timedelta(hours=h)),
        "day": st.none() | st.integers(0, 4).map(lambda d: date(2026, 1, 1) + timedelta(days=d)),
        "flag": st.none() | st.booleans(),
        "tag": st.none() | st.sampled_from([b"a", b"b"]),
        "temp": st.none() | st.sampled_from(_EDGES).map(_float32) | st.floats(width=32),
        "load": st.none() | st.sampled_from(_EDGES) | st.floats(),
        "code": st.none() | st.sampled_from([b"abcd", b"abce", b"\x00\xff\x00\x01", b"ab\x00\x00"]),
        "tiny": st.none() | st.integers(-(10**8), 10**8).map(lambda c: Decimal(c).scaleb(-30)),
    }
)
comparisons = st.sampled_from(
    [
        "status = 'active'", "status != 'withdrawn'", "status in ('active', 'it''s')",
        "status not in ('active')", "status is null", "amount >= 0.5", "amount < -3.755",
        "amount = 1.50", "amount in (0, 1.5, -2)", "attempt > 1", "attempt <= -1", "attempt != 0",
        "score > 0.25", "score <= -1e0", "paid_at < '2026-01-02T00:00:00Z'",
        "paid_at >= '2026-01-01T12:00:00+02:00'", "day = '2026-01-03'", "day > '2026-01-02'",
        "flag = true", "flag != false", "flag is not null", "tag = 'a'", "tag in ('b')",
        "temp <= 0.1", "temp = 0.1", "temp != 0.1", "temp > 100", "temp >= 3.4028234e38", "temp < -0.0",
        "temp in (0.1, 100.5)", "temp is null", "load > 100", "load <= 0.1", "load = 0", "load >= -0.0",
        "load < 1e308", "load not in (0.1, 100)", "load != 5e-324", "code = 'abcd'", "code < 'abcdz'",
        "code >= 'ab'", "code in ('abce', 'x')", "code != 'ab'", "tiny > 0.000000000000000000000000000001",
        "tiny <= -0.000000000000000000000012345678", "tiny = 0",
    ]
)  # fmt: skip


def _combined(draw: st.DrawFn, depth: int = 0) -> str:
    if depth >= 2 or draw(st.booleans()):
        return draw(comparisons)
    op = draw(st.sampled_from(["and", "or", "not"]))
    if op == "not":
        return f"not ({_combined(draw, depth + 1)})"
    return f"({_combined(draw, depth + 1)}) {op} ({_combined(draw, depth + 1)})"


expressions = st.composite(_combined)()


@settings(
    max_examples=int(os.environ.get("LAMBDALAKE_PROPERTY_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(text=expressions, data=st.lists(rows, min_size=1, max_size=30))
def test_python_spark_and_arrow_keep_the_same_rows(spark, text: str, data: list[dict]) -> None:
    _same_rows_everywhere(spark, text, data)


def test_a_32_bit_float_and_a_nan_filter_the_same_in_every_engine(spark) -> None:
    """The report's sensors view: a 32-bit 0.1 is <= 0.1 (the literal is read as the field's type) and
    a NaN load is above 100 (NaN sorts above every number), in Python, Arrow and Spark alike."""
    none = dict.fromkeys(TYPES)
    data = [
        {**none, "temp": _float32(0.1), "load": float("nan")},
        {**none, "temp": _float32(0.1), "load": 100.0},
        {**none, "temp": _float32(0.10000001), "load": float("inf")},
        {**none, "temp": float("nan"), "load": 101.0},
    ]
    assert _same_rows_everywhere(spark, "temp <= 0.1 and load > 100", data) == [0]
    assert _same_rows_everywhere(spark, "temp = 0.1", data) == [0, 1]
    assert _same_rows_everywhere(spark, "temp > 1e38 or load >= 1e308", data) == [0, 2, 3]


def _same_rows_everywhere(spark, text: str, data: list[dict]) -> list[int]:
    """The rows of ``data`` the filter keeps, asserted the same in Python, Arrow and Spark."""
    node = filters.parse(text, TYPES)
    table = pa.Table.from_pylist(data, schema=SCHEMA).append_column("i", pa.array(range(len(data))))
    want = [i for i, row in enumerate(data) if filters.keeps(node, row)]
    arrow = table.filter(filters.arrow_expression(node, SCHEMA)).column("i").to_pylist()
    spark_schema = (
        "status string, amount decimal(12,2), attempt int, score double, paid_at timestamp, day date, "
        "flag boolean, tag binary, temp float, load double, code binary, tiny decimal(38,30), i long"
    )
    df = spark.createDataFrame([(*[row[c] for c in TYPES], i) for i, row in enumerate(data)], spark_schema)
    got = sorted(r["i"] for r in df.filter(column(node)).select("i").collect())
    assert arrow == want, (text, arrow, want)
    assert got == want, (text, got, want)
    return want
