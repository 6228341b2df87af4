"""The quality gate's one-pass expectations give Great Expectations' answer on the same data.

Drawn rows (nulls, NaN, infinities, -0.0, repeated keys) and drawn expectations of every kind
:mod:`batch.expectations` evaluates: each verdict and unexpected count equals the one Great
Expectations computes on the same Spark DataFrame. Then a file's extra of another kind still runs
through Great Expectations, and a failed expectation's report names it with samples.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pyspark.sql.types import DoubleType, LongType, StringType, StructField, StructType

from lambdalake.batch.expectations import evaluate, identify, is_native
from lambdalake.batch.quality import QualityGate, QualityGateFailed
from lambdalake.pipeline import configured_pipeline
from lambdalake.settings import Settings

SCHEMA = StructType(
    [
        StructField("k", LongType()),
        StructField("x", DoubleType()),
        StructField("s", StringType()),
    ]
)
COLUMNS = ["k", "x", "s"]
NUMBERS = st.one_of(
    st.none(),
    st.sampled_from([0.0, -0.0, 1.0, -1.5, 2.5, math.nan, math.inf, -math.inf]),
    st.floats(-10, 10, allow_nan=False),
)
rows = st.fixed_dictionaries(
    {
        "k": st.one_of(st.none(), st.integers(0, 6)),
        "x": NUMBERS,
        "s": st.one_of(st.none(), st.sampled_from(["a", "b", "c", ""])),
    }
)


@st.composite
def expectation(draw: st.DrawFn) -> dict:
    kind = draw(
        st.sampled_from(
            [
                "expect_column_values_to_not_be_null",
                "expect_column_values_to_be_between",
                "expect_column_values_to_be_in_set",
                "expect_column_values_to_be_unique",
                "expect_compound_columns_to_be_unique",
                "expect_table_row_count_to_be_between",
                "expect_column_to_exist",
            ]
        )
    )
    if kind == "expect_compound_columns_to_be_unique":
        return {
            "type": kind,
            "kwargs": {
                "column_list": draw(st.lists(st.sampled_from(COLUMNS), min_size=2, max_size=3, unique=True))
            },
        }
    if kind == "expect_table_row_count_to_be_between":
        low = draw(st.one_of(st.none(), st.integers(0, 20)))
        high = draw(st.one_of(st.none(), st.integers(low or 0, 25)))
        return {"type": kind, "kwargs": {"min_value": low, "max_value": high}}
    if kind == "expect_column_to_exist":
        return {"type": kind, "kwargs": {"column": draw(st.sampled_from([*COLUMNS, "absent"]))}}
    if kind == "expect_column_values_to_be_in_set":
        column = draw(st.sampled_from(["k", "s"]))
        pool = [0, 1, 2, 3] if column == "k" else ["a", "b", ""]
        return {
            "type": kind,
            "kwargs": {
                "column": column,
                "value_set": draw(st.lists(st.sampled_from(pool), max_size=3, unique=True)),
            },
        }
    if kind == "expect_column_values_to_be_between":
        column = draw(st.sampled_from(["k", "x"]))
        low = draw(st.one_of(st.none(), st.integers(-2, 3)))
        high = draw(st.one_of(st.none(), st.integers(low if low is not None else -2, 6)))
        kwargs: dict = {"column": column, "min_value": low, "max_value": high}
        if draw(st.booleans()):
            kwargs["strict_min"] = True
        if draw(st.booleans()):
            kwargs["strict_max"] = True
        if low is None and high is None:
            kwargs["min_value"] = 0
        return {"type": kind, "kwargs": kwargs}
    return {"type": kind, "kwargs": {"column": draw(st.sampled_from(COLUMNS))}}


def _great_expectations(df, specs: list[dict]) -> list[tuple[bool, int | None]]:
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig
    from great_expectations.expectations.expectation_configuration import ExpectationConfiguration

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    batch = (
        context.data_sources.add_spark(name="reference", persist=False)
        .add_dataframe_asset(name="drawn")
        .add_batch_definition_whole_dataframe("all")
        .get_batch(batch_parameters={"dataframe": df})
    )
    suite = gx.ExpectationSuite(name="drawn")
    for spec in specs:
        suite.add_expectation(
            ExpectationConfiguration(type=spec["type"], kwargs=spec["kwargs"]).to_domain_obj()
        )
    results = batch.validate(suite, result_format="BASIC").results
    configs = [(r.expectation_config, r) for r in results]
    by_spec = {identify({"type": c.type, "kwargs": c.kwargs}): r for c, r in configs}
    assert len(by_spec) == len(specs)
    return [
        (bool(by_spec[identify(s)].success), (by_spec[identify(s)].result or {}).get("unexpected_count"))
        for s in specs
    ]


@settings(
    max_examples=int(os.environ.get("LAMBDALAKE_PROPERTY_EXAMPLES", "10")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    # An example costs a few Spark jobs: shrink little, report the first failure found.
    report_multiple_bugs=False,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target],
)
@given(data=st.lists(rows, max_size=20), specs=st.lists(expectation(), min_size=1, max_size=8))
def test_one_pass_verdicts_equal_great_expectations(spark, data: list[dict], specs: list[dict]) -> None:
    assert all(is_native(spec) for spec in specs)
    specs = list({identify(spec): spec for spec in specs}.values())  # a suite keeps one of equal ones
    df = spark.createDataFrame(data, SCHEMA).cache()
    try:
        ours = evaluate(df, specs)
        theirs = _great_expectations(df, specs)
    finally:
        df.unpersist()
    for spec, verdict, (success, unexpected) in zip(specs, ours, theirs, strict=True):
        assert verdict.success == success, (spec, verdict, success, unexpected, data)
        if unexpected is not None and "unexpected_count" in verdict.result:
            assert verdict.result["unexpected_count"] == unexpected, (spec, verdict, unexpected, data)


def test_a_kind_of_its_own_runs_through_great_expectations_and_failures_are_reported(
    spark, tmp_path: Path
) -> None:
    pipelines = tmp_path / "pipelines"
    pipelines.mkdir()
    pipeline = configured_pipeline("offers", Settings(state_dir=tmp_path))
    extra = {
        "master": [
            # A kind the one pass does not know, and a known kind with a keyword it does not take.
            {"type": "expect_column_value_lengths_to_be_between", "kwargs": {"column": "s", "max_value": 1}},
            {"type": "expect_column_values_to_not_be_null", "kwargs": {"column": "x", "mostly": 0.5}},
        ]
    }
    (pipelines / "offers.expectations.json").write_text(json.dumps(extra))
    df = spark.createDataFrame(
        [{"k": 1, "x": None, "s": "long"}, {"k": 1, "x": 2.0, "s": "a"}, {"k": 2, "x": -1.0, "s": None}],
        SCHEMA,
    )
    gate = QualityGate(pipeline, pipelines)
    gate.check(
        "master",
        df,
        [
            {"type": "expect_column_values_to_be_unique", "kwargs": {"column": "k"}},
            {"type": "expect_column_values_to_be_between", "kwargs": {"column": "x", "min_value": 0}},
        ],
    )
    verdicts = {(o.expectation, o.column): o for o in gate.report.outcomes}
    assert len(verdicts) == 4
    assert not verdicts[("expect_column_values_to_be_unique", "k")].success
    assert json.loads(verdicts[("expect_column_values_to_be_unique", "k")].detail)[
        "partial_unexpected_list"
    ] == [1]
    between = json.loads(verdicts[("expect_column_values_to_be_between", "x")].detail)
    assert between == {"unexpected_count": 1, "partial_unexpected_list": [-1.0]}
    lengths = verdicts[("expect_column_value_lengths_to_be_between", "s")]
    assert not lengths.success and json.loads(lengths.detail)["unexpected_count"] == 1
    assert verdicts[("expect_column_values_to_not_be_null", "x")].success  # 1 null of 3, mostly 0.5
    with pytest.raises(QualityGateFailed) as failed:
        gate.finish(str(tmp_path / "report.md"))
    message = str(failed.value)
    assert "3 expectation(s)" in message and "expect_column_value_lengths_to_be_between(s)" in message
    assert "**FAIL**" in (tmp_path / "report.md").read_text()
