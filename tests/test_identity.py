"""One identity encoding (lambdalake.identity): Python, Arrow and Spark give every value of every type
the same 128-bit hash; a row hashes the same whatever batch it is in; Avro's promotions keep hashes;
distinct values do not collide; an identity index of the encoding before is rewritten, never compared."""

from __future__ import annotations

import math
import os
import random
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lambdalake.identity import arrow_hashes, canonical_part, spark_hashes, value_hashes

EXAMPLES = int(os.environ.get("LAMBDALAKE_PROPERTY_EXAMPLES", "40"))

#: Every type an identity may hold, as Arrow (and so Spark) holds it, with values drawn for it.
TYPES: dict[str, tuple[pa.DataType, st.SearchStrategy]] = {
    "int": (pa.int32(), st.integers(-(2**31), 2**31 - 1)),
    "long": (pa.int64(), st.integers(-(2**63), 2**63 - 1) | st.sampled_from([2**60, 2**60 + 1, 2**53 + 1])),
    "float": (pa.float32(), st.floats(width=32)),
    "double": (pa.float64(), st.floats() | st.sampled_from([0.0, -0.0, 2.0**63, -(2.0**63), 5.0])),
    "decimal": (pa.decimal128(20, 4), st.decimals(min_value=-(10**15), max_value=10**15, places=4)),
    "string": (pa.string(), st.text(max_size=40)),
    "bytes": (pa.binary(), st.binary(max_size=70)),
    "fixed": (pa.binary(4), st.binary(min_size=4, max_size=4)),
    "date": (pa.date32(), st.dates(min_value=date(1, 1, 1), max_value=date(9999, 12, 31))),
    "timestamp": (
        pa.timestamp("us", tz="UTC"),
        st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30), timezones=st.just(UTC)),
    ),
    "boolean": (pa.bool_(), st.booleans()),
}
NAMES = list(TYPES)


def _row() -> st.SearchStrategy[dict]:
    """A record with a value (or a null: every field is a nullable union) of every type."""
    return st.fixed_dictionaries({n: st.none() | strategy for n, (_, strategy) in TYPES.items()})


def _table(rows: list[dict]) -> pa.Table:
    return pa.table({n: pa.array([r[n] for r in rows], type=TYPES[n][0]) for n in NAMES})


def _pairs(h: tuple) -> list[tuple[int, int]]:
    return list(zip(h[0].tolist(), h[1].tolist(), strict=True))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    rows=st.lists(_row(), min_size=1, max_size=30),
    parts=st.lists(st.sampled_from(NAMES), min_size=1, max_size=4),
)
def test_python_arrow_and_spark_hash_every_type_alike(spark, rows: list[dict], parts: list[str]) -> None:
    table = _table(rows)
    python = [value_hashes([r[p] for p in parts]) for r in rows]
    assert _pairs(arrow_hashes(table, parts)) == python
    # Spark holds a fixed as binary: what it is once Spark's Avro reader and Delta have it.
    df = spark.createDataFrame(
        table.set_column(NAMES.index("fixed"), "fixed", table["fixed"].cast(pa.binary()))
    )
    h1, h2 = spark_hashes(df, parts)
    assert [tuple(r) for r in df.select(h1, h2).collect()] == python


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(rows=st.lists(_row(), min_size=2, max_size=40), seed=st.integers(0, 2**32))
def test_a_row_hashes_the_same_in_a_batch_of_any_make_up(rows: list[dict], seed: int) -> None:
    """Measured before: a nullable long went through pandas as float64 when the batch held a null,
    so ('x', 1) hashed one way alone and another beside a null, and 2^60 and 2^60+1 hashed equal."""
    parts = ["string", "long", "double", "decimal", "timestamp"]
    alone = [_pairs(arrow_hashes(_table([r]), parts))[0] for r in rows]
    assert _pairs(arrow_hashes(_table(rows), parts)) == alone
    rng = random.Random(seed)
    order = list(range(len(rows)))
    rng.shuffle(order)
    cut = rng.randrange(1, len(rows))
    shuffled = _pairs(arrow_hashes(_table([rows[i] for i in order[:cut]]), parts))
    shuffled += _pairs(arrow_hashes(_table([rows[i] for i in order[cut:]]), parts))
    assert shuffled == [alone[i] for i in order]
    with_null = [{**r, "long": None} for r in rows[:1]] + rows
    assert _pairs(arrow_hashes(_table(with_null), parts))[1:] == alone


def test_avros_promotions_keep_a_value_one_identity() -> None:
    """int 5, long 5, float 5.0 and double 5.0 are one number; text and its bytes are one value;
    decimal scale and a timestamp's zone do not matter; -0.0 is 0, every NaN one NaN."""
    assert len({value_hashes([v]) for v in (5, 5.0, 5.0)}) == 1
    assert value_hashes(["ab"]) == value_hashes([b"ab"])
    assert value_hashes([Decimal("5.00")]) == value_hashes([Decimal("5")])
    assert value_hashes([-0.0]) == value_hashes([0])
    assert value_hashes([float("nan")]) == value_hashes([-float("nan")])
    at = datetime(2026, 12, 1, 10, tzinfo=UTC)
    assert value_hashes([at]) == value_hashes([at.astimezone(datetime.now().astimezone().tzinfo)])
    arrow = pa.table({
        "i": pa.array([5, None], pa.int32()), "l": pa.array([5, None], pa.int64()),
        "f": pa.array([5.0, None], pa.float32()), "d": pa.array([5.0, None], pa.float64()),
        "s": pa.array(["ab", None]), "b": pa.array([b"ab", None]),
    })  # fmt: skip
    assert len({tuple(_pairs(arrow_hashes(arrow, [c]))) for c in ("i", "l", "f", "d")}) == 1
    assert _pairs(arrow_hashes(arrow, ["s"])) == _pairs(arrow_hashes(arrow, ["b"]))


def test_a_null_never_moves_between_parts_and_no_type_meets_another() -> None:
    assert value_hashes([None, "a"]) != value_hashes(["a", None])
    assert value_hashes(["", None]) != value_hashes([None, ""])
    assert value_hashes([1]) != value_hashes([True]) != value_hashes([Decimal(1)])
    assert value_hashes([date(1970, 1, 2)]) != value_hashes([1])
    assert value_hashes([datetime(1970, 1, 1, 0, 0, 0, 1, tzinfo=UTC)]) != value_hashes([1])


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(values=st.lists(st.one_of(*(s for _, s in TYPES.values())), min_size=2, max_size=200))
def test_distinct_values_do_not_collide(values: list) -> None:
    """Two values whose canonical parts differ get different hashes (the bound: 2^-128 a pair)."""
    canonical = {canonical_part(v): v for v in values}
    hashes = {value_hashes([v]) for v in canonical.values()}
    assert len(hashes) == len(canonical)
    assert len({h for h, _ in hashes}) == len(canonical), "even 64 bits alone do not collide here"


def test_adjacent_longs_beyond_53_bits_are_distinct_beside_nulls() -> None:
    refs = [2**60 + k for k in range(1000)] + [None]
    table = pa.table({"account": ["a"] * len(refs), "ref": pa.array(refs, pa.int64())})
    hashes = _pairs(arrow_hashes(table, ["account", "ref"]))
    assert len(set(hashes)) == len(refs)
    assert hashes[:-1] == _pairs(arrow_hashes(table.slice(0, 1000), ["account", "ref"]))


def test_every_value_has_one_canonical_part() -> None:
    assert canonical_part(None) == (0, None)
    assert canonical_part(2**62) == canonical_part(float(2**62)) == (1, 2**62)
    assert canonical_part(0.5)[0] == 2 and canonical_part(math.inf)[0] == 2
    assert canonical_part(datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=3)) == (6, 3)
    with pytest.raises(TypeError):
        canonical_part(object())
