"""The quality gate's usual expectations, evaluated in one Spark aggregation per dataset.

Great Expectations runs a Spark job or more per metric (about ten for a master dataset slice, at ~0.3 s of
fixed cost each on two cores): the gate cost more than the views it checked. The kinds the suite
derives from a pipeline, and the same kinds in ``<pipeline>.expectations.json``, are evaluated here
with Great Expectations' own Spark semantics (the conditions of its Spark metrics, nulls skipped by
the map expectations, NaN kept, ``all_values_are_missing`` rows skipped by compound uniqueness); any
other kind or keyword goes to Great Expectations. ``tests/test_quality_gate.py`` holds the two to
one answer on drawn data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import reduce
from typing import Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

Spec = dict[str, Any]

#: The kinds evaluated here, and the keywords each takes (any other keyword: Great Expectations).
NATIVE: dict[str, frozenset[str]] = {
    "expect_column_to_exist": frozenset({"column"}),
    "expect_column_values_to_not_be_null": frozenset({"column"}),
    "expect_column_values_to_be_between": frozenset(
        {"column", "min_value", "max_value", "strict_min", "strict_max"}
    ),
    "expect_column_values_to_be_in_set": frozenset({"column", "value_set"}),
    "expect_column_values_to_be_unique": frozenset({"column"}),
    "expect_compound_columns_to_be_unique": frozenset({"column_list"}),
    "expect_table_row_count_to_be_between": frozenset({"min_value", "max_value"}),
}

#: Values sampled into a failed expectation's detail.
SAMPLE = 20


@dataclass(frozen=True)
class Verdict:
    spec: Spec
    success: bool
    #: ``unexpected_count`` (map and uniqueness kinds) or ``observed_value``, and for a failed map
    #: kind ``partial_unexpected_list``: the report's detail.
    result: dict[str, Any]


def is_native(spec: Spec) -> bool:
    """Whether ``spec`` is evaluated here (a known kind with only the keywords it takes)."""
    allowed = NATIVE.get(spec["type"])
    return allowed is not None and set(spec["kwargs"]) <= allowed


def _condition(spec: Spec) -> Column | None:
    """The row condition of a map kind (True: the value is expected), as Great Expectations' Spark
    metric writes it; None for the other kinds."""
    kind, kw = spec["type"], spec["kwargs"]
    col = F.col(kw["column"]) if "column" in kw else None
    if kind == "expect_column_values_to_be_in_set":
        return F.lit(True) if kw.get("value_set") is None else col.isin(list(kw["value_set"]))
    if kind == "expect_column_values_to_be_between":
        low, high = kw.get("min_value"), kw.get("max_value")
        if low is not None and high is not None and low > high:
            raise ValueError(f"min_value {low!r} is above max_value {high!r}")
        parts = []
        if low is not None:
            parts.append(col > F.lit(low) if kw.get("strict_min") else col >= F.lit(low))
        if high is not None:
            parts.append(col < F.lit(high) if kw.get("strict_max") else col <= F.lit(high))
        return reduce(lambda a, b: a & b, parts) if parts else F.lit(True)
    return None


def _counted(spec: Spec) -> Column | None:
    """The rows the kind judges (its domain): non-null values, or rows not all null."""
    kind, kw = spec["type"], spec["kwargs"]
    if kind == "expect_column_values_to_not_be_null":
        return F.lit(True)
    if kind == "expect_compound_columns_to_be_unique":
        return ~reduce(lambda a, b: a & b, [F.col(c).isNull() for c in kw["column_list"]])
    if "column" in kw and kind != "expect_column_to_exist":
        return F.col(kw["column"]).isNotNull()
    return None


def _ones(cond: Column) -> Column:
    return F.sum(F.when(cond, 1).otherwise(0))


def evaluate(df: DataFrame, specs: list[Spec]) -> list[Verdict]:
    """Every spec (each :func:`is_native`) judged on ``df`` by one aggregation (plus a small job per
    failed map or uniqueness kind, for its sample of unexpected values)."""
    present = set(df.columns)
    aggs: dict[str, Column] = {"rows": F.count(F.lit(1))}
    for i, spec in enumerate(specs):
        kind, kw = spec["type"], spec["kwargs"]
        if kind in ("expect_column_to_exist", "expect_table_row_count_to_be_between"):
            continue
        if any(c not in present for c in kw.get("column_list", [kw.get("column")])):
            continue  # judged below: a missing column fails, as in Great Expectations
        domain = _counted(spec)
        if kind == "expect_column_values_to_not_be_null":
            aggs[f"u{i}"] = _ones(F.col(kw["column"]).isNull())
        elif kind == "expect_column_values_to_be_unique":
            aggs[f"n{i}"] = _ones(domain)
            aggs[f"d{i}"] = F.count_distinct(F.col(kw["column"]))
        elif kind == "expect_compound_columns_to_be_unique":
            aggs[f"n{i}"] = _ones(domain)
            aggs[f"d{i}"] = F.count_distinct(F.when(domain, F.struct(*kw["column_list"])))
        else:
            aggs[f"u{i}"] = _ones(domain & ~_condition(spec))
    got = df.agg(*[value.alias(name) for name, value in aggs.items()]).first().asDict()
    out = []
    for i, spec in enumerate(specs):
        kind, kw = spec["type"], spec["kwargs"]
        columns = kw.get("column_list", [kw.get("column")])
        if kind == "expect_column_to_exist":
            out.append(Verdict(spec, kw["column"] in present, {}))
        elif kind == "expect_table_row_count_to_be_between":
            rows = int(got["rows"])
            low, high = kw.get("min_value"), kw.get("max_value")
            ok = (low is None or rows >= low) and (high is None or rows <= high)
            out.append(Verdict(spec, ok, {"observed_value": rows}))
        elif any(c not in present for c in columns):
            out.append(Verdict(spec, False, {"observed_value": f"no column {columns!r}"}))
        elif f"u{i}" in got:
            unexpected = int(got[f"u{i}"] or 0)
            result: dict[str, Any] = {"unexpected_count": unexpected}
            if unexpected:
                result["partial_unexpected_list"] = _sample_unexpected(df, spec)
            out.append(Verdict(spec, unexpected == 0, result))
        else:
            judged, distinct = int(got[f"n{i}"] or 0), int(got[f"d{i}"] or 0)
            result = {"unexpected_count": 0}
            if judged != distinct:
                result = _repeated(df, spec)
            out.append(Verdict(spec, judged == distinct, result))
    return out


def _sample_unexpected(df: DataFrame, spec: Spec) -> list[Any]:
    column = spec["kwargs"]["column"]
    if spec["type"] == "expect_column_values_to_not_be_null":
        return []  # the unexpected values are nulls: their count says it all
    rows = df.filter(_counted(spec) & ~_condition(spec)).select(column).limit(SAMPLE).collect()
    return [_plain(r[0]) for r in rows]


def _repeated(df: DataFrame, spec: Spec) -> dict[str, Any]:
    """The rows whose value (or values) another row repeats, counted as Great Expectations counts
    them (every row of a repeated value), and a sample of the values."""
    columns = spec["kwargs"].get("column_list") or [spec["kwargs"]["column"]]
    groups = df.filter(_counted(spec)).groupBy(*columns).count().filter(F.col("count") > 1).cache()
    try:
        rows = groups.agg(F.sum("count")).first()[0]
        sample = groups.limit(SAMPLE).collect()
    finally:
        groups.unpersist()
    values = [_plain(r[0]) if len(columns) == 1 else [_plain(v) for v in r[:-1]] for r in sample]
    return {"unexpected_count": int(rows or 0), "partial_unexpected_list": values}


def _plain(value: Any) -> Any:
    return value if isinstance(value, str | int | float | bool) or value is None else str(value)


def identify(spec: Spec) -> str:
    """One text per expectation, as Great Expectations tells them apart: its results' kwargs gain a
    ``batch_id``, drop None values and carry numbers as floats (and a suite keeps one of two equal
    expectations)."""
    kwargs = {k: _number(v) for k, v in spec["kwargs"].items() if k != "batch_id" and v is not None}
    return json.dumps([spec["type"], kwargs], sort_keys=True, default=str)


def _number(value: Any) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, list | tuple):
        return [_number(v) for v in value]
    return value
