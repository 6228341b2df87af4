"""The engine-free half of view definitions: stored components and their exact merge."""

from __future__ import annotations

import pyarrow as pa
import pytest

from lambdalake.pipeline import WindowedView
from lambdalake.views import merge, view_components

VIEW = WindowedView.model_validate({
    "name": "v", "kind": "windowed", "key": ["k"], "window": "1 hour",
    "aggregates": [{"name": "n", "fn": "count"}, {"name": "s", "fn": "sum", "column": "x"},
                   {"name": "lo", "fn": "min", "column": "x"}, {"name": "hi", "fn": "max", "column": "x"},
                   {"name": "avg", "fn": "avg", "column": "x"}],
})  # fmt: skip


def row(xs: list[float]) -> dict:
    return {
        "n": len(xs),
        "s": sum(xs),
        "lo": min(xs),
        "hi": max(xs),
        "avg_sum": sum(xs),
        "avg_count": len(xs),
    }


def test_average_is_stored_as_sum_and_count() -> None:
    assert [c.column for c in view_components(VIEW)] == ["n", "s", "lo", "hi", "avg_sum", "avg_count"]


def test_merge_of_parts_equals_aggregate_of_whole() -> None:
    parts = [[1.0, 5.0], [2.0], [10.0, -3.0, 4.0]]
    merged = merge([row(p) for p in parts], VIEW)
    whole = [x for p in parts for x in p]
    assert merged == {**row(whole), "avg": sum(whole) / len(whole)}


def test_merge_of_nothing_and_of_missing_values() -> None:
    assert merge([], VIEW) is None
    merged = merge(
        [row([2.0]), {"n": 1, "s": None, "lo": None, "hi": None, "avg_sum": None, "avg_count": 0}], VIEW
    )
    assert merged["n"] == 2 and merged["lo"] == 2.0 and merged["avg"] == 2.0


@pytest.mark.parametrize("version_type", [pa.timestamp("us", tz="UTC"), pa.int64()])
def test_latest_order_is_the_same_in_spark_and_in_the_archive_pass(spark, version_type) -> None:
    """The speed layer ranks ``latest`` deliveries over Arrow, the batch layer in Spark: one
    rule (``lambdalake.latest``), so both must give every row the same rank."""
    from lambdalake.latest import arrow_winners
    from lambdalake.pipeline import LatestView
    from lambdalake.spark.views import INGEST_TS, latest_order

    ingest = [1_700_000_000_123_456, 1_700_000_000_999_999, 1_800_000_001_000_000, 5, None, 1_700_000_000]
    version = [1_700_000_000_500_000, 1_700_000_000_500_999, 42_000, None, 7_000, 8_600_000_000_000_000]
    if version_type == pa.int64():
        version = [None if v is None else v // 1000 for v in version]
    table = pa.table({
        "v": pa.array(version, type=version_type),
        INGEST_TS: pa.array(ingest, type=pa.timestamp("us", tz="UTC")),
        "_partition": pa.array([0] * len(ingest), pa.int32()),
        "_offset": pa.array(range(len(ingest)), pa.int64()),
    })  # fmt: skip
    view = LatestView.model_validate({"name": "l", "kind": "latest", "key": ["v"], "version": "v"})
    df = spark.createDataFrame(table)
    in_spark = [r[0] for r in df.select(latest_order(df, view)).collect()]
    rows, ranks = arrow_winners(table, list(range(len(ingest))), "v")  # each row a key of its own
    # A null version ranks (below every version); a delivery without an ingest time cannot.
    assert [r is None for r in in_spark] == [False, False, False, False, True, False]
    assert rows == [0, 1, 2, 3, 5]
    assert ranks == [int(in_spark[i]) for i in rows]


def test_the_batch_rank_of_an_unbounded_version_is_exact_not_an_overflow(spark) -> None:
    """Any long version: Spark ranks it exactly (a 38-digit decimal, no overflow)."""
    from lambdalake.latest import latest_rank
    from lambdalake.pipeline import LatestView
    from lambdalake.spark.views import INGEST_TS, latest_order

    table = pa.table({
        "v": pa.array([2**63 - 1, -(2**63), 3], type=pa.int64()),
        INGEST_TS: pa.array([1_700_000_000_000_000] * 3, type=pa.timestamp("us", tz="UTC")),
    })  # fmt: skip
    view = LatestView.model_validate({"name": "l", "kind": "latest", "key": ["v"], "version": "v"})
    df = spark.createDataFrame(table)
    ranks = [r[0] for r in df.select(latest_order(df, view)).collect()]
    assert ranks == [latest_rank(v, 1_700_000_000) for v in (2**63 - 1, -(2**63), 3)]


def test_merged_windows_count_each_epoch_once_from_query_tuples() -> None:
    """Serving's fold over query tuples (columns in any order, naive UTC timestamps as the driver
    returns them): the batch row holds epochs <= horizon, speed rows of those epochs are skipped."""
    from datetime import UTC, datetime

    from lambdalake.serving.merge import merge_windows

    w1, w2, w3 = (datetime(2026, 11, 23, h) for h in (1, 2, 3))
    batch_names = ("k", "window_start", *row([0.0]))
    batch = [("a", w1, *row([1.0, 5.0]).values()), ("a", w2, *row([2.0]).values())]
    speed_names = ("avg_count", "avg_sum", "hi", "lo", "s", "n", "epoch", "window_start", "k")

    def speed_row(xs: list[float], epoch: int, start: datetime) -> tuple:
        r = row(xs)
        return (r["avg_count"], r["avg_sum"], r["hi"], r["lo"], r["s"], r["n"], epoch, start, "a")

    speed = [speed_row([100.0], 7, w1), speed_row([4.0], 8, w1), speed_row([-1.0, 3.0], 9, w3)]
    windows = merge_windows((batch_names, batch), (speed_names, speed), VIEW, horizon=7)
    assert [w.window_start for w in windows] == [t.replace(tzinfo=UTC) for t in (w1, w2, w3)]
    assert [(w.from_batch, w.speed_epochs) for w in windows] == [(True, (8,)), (True, ()), (False, (9,))]
    for w, xs in zip(windows, [[1.0, 5.0, 4.0], [2.0], [-1.0, 3.0]], strict=True):
        assert w.values == {**row(xs), "avg": sum(xs) / len(xs)}
    alone = merge_windows(((), ()), (speed_names, speed), VIEW, horizon=None)
    assert [w.values["n"] for w in alone] == [2, 2] and alone[0].speed_epochs == (7, 8)


def test_a_float_promoted_to_double_keeps_its_distinct_values(spark) -> None:
    """The same values as float (before a promotion) and as double (master dataset read after it) build
    sketches that count them as the same values: their union counts each once."""
    from lambdalake import sketches
    from lambdalake.pipeline import configured_pipeline
    from lambdalake.settings import Settings
    from lambdalake.spark.views import windowed

    pipeline = configured_pipeline("telemetry", Settings())
    view = WindowedView.model_validate({
        "name": "v", "kind": "windowed", "key": ["vehicle_id"], "window": "1 hour",
        "aggregates": [{"name": "speeds", "fn": "distinct", "column": "speed_kmh"}],
    })  # fmt: skip
    values = [0.1, 1.7, 33.3, 88.8, 120.25]
    rows = [("v1", v, 0) for v in values]
    as_float = spark.createDataFrame(rows, "vehicle_id string, speed_kmh float, t long")
    as_double = as_float.withColumn("speed_kmh", as_float["speed_kmh"].cast("double"))
    sketch = []
    for df in (as_float, as_double):
        df = df.selectExpr("vehicle_id", "speed_kmh", "timestamp_seconds(t) AS event_time")
        sketch.append(windowed(df, pipeline, view).first()["speeds"])
    merged = sketches.hll_merge(sketch[0], sketch[1], 12)
    assert sketches.hll_answer(merged, 12)["estimate"] == pytest.approx(len(values))


def test_an_int_promoted_to_double_keeps_its_distinct_values(spark, tmp_path) -> None:
    """A ``distinct`` over an int later promoted to double: the sketches built before the promotion
    (ints) and after it (doubles, the master dataset's old ints read as doubles too) count 5 and 5.0 once."""
    import json

    from lambdalake import sketches
    from lambdalake.pipeline import load
    from lambdalake.spark.views import windowed

    at = {"type": "long", "logicalType": "timestamp-millis"}
    fields = [{"name": "id", "type": "string"}, {"name": "at", "type": at}]
    for i, level in enumerate(["int", "double"], start=1):
        schema = {"type": "record", "name": "R", "fields": [*fields, {"name": "level", "type": level}]}
        (tmp_path / f"v{i}.avsc").write_text(json.dumps(schema))
    (tmp_path / "levels.toml").write_text(
        'name = "levels"\n[topic]\nname = "levels"\n[schema]\nsubject = "levels-value"\n'
        'versions = ["v1.avsc", "v2.avsc"]\n[event]\nkey = "id"\ntime = "at"\nidentity = ["id", "at"]\n'
        '[[views]]\nname = "v"\nkind = "windowed"\nkey = ["id"]\nwindow = "1 hour"\n'
        'aggregates = [{ name = "levels", fn = "distinct", column = "level" }]\n'
    )
    pipeline = load(tmp_path / "levels.toml", schemas_dir=tmp_path)
    before, after = [5, 7, -3, 0], [5.0, 7.0, 2.5, float("nan"), -0.0, 1e300]
    sketch = []
    for values, kind in ((before, "int"), (after, "double")):
        df = spark.createDataFrame([("a", v, 0) for v in values], f"id string, level {kind}, t long")
        df = df.selectExpr("id", "level", "timestamp_seconds(t) AS at")
        sketch.append(windowed(df, pipeline, pipeline.views[0]).first()["levels"])
    distinct = {5, 7, -3, 0, 2.5, "nan", 1e300}
    merged = sketches.hll_merge(sketch[0], sketch[1], 12)
    assert sketches.hll_answer(merged, 12)["estimate"] == pytest.approx(len(distinct))


def test_a_latest_view_ranks_its_winner_by_a_version_it_does_not_keep(spark, tmp_path) -> None:
    """A ``latest`` view's version need not be one of its columns (the batch layer and a replay
    rank the winner after grouping): the winner is the highest version's delivery, its rank that
    version's, and the version does not become a column of the view."""
    from datetime import UTC, datetime

    from lambdalake.latest import RANK, rank
    from lambdalake.pipeline import configured_pipeline
    from lambdalake.settings import Settings
    from lambdalake.spark.views import INGEST_EPOCH, INGEST_TS, latest
    from tests.realtime_pipeline import write_kinds

    settings = write_kinds(Settings(registry={"url": "http://registry.invalid:3"}), tmp_path, "kinds")
    pipeline = configured_pipeline("kinds", settings)
    (view,) = [v for v in pipeline.views if v.name == "cheap_latest"]
    assert view.version == "at" and "at" not in view.columns
    ingest = datetime(2026, 12, 1, tzinfo=UTC)
    at_us = [1_700_000_000_000_000, 1_700_000_005_000_000, 1_700_000_001_000_000]
    rows = [("A", "k", datetime.fromtimestamp(us / 1e6, UTC), 5.0, None, True, f"n{i}", ingest, 1, 0, i)
            for i, us in enumerate(at_us)]  # fmt: skip
    schema = (f"kind string, id string, at timestamp, price double, amount decimal(12,2), "
              f"flag boolean, note string, {INGEST_TS} timestamp, {INGEST_EPOCH} long, "
              "_partition int, _offset long")  # fmt: skip
    out = latest(
        spark.createDataFrame(rows, schema), pipeline, view, carry=("_partition", "_offset"), rank=True
    )
    assert "at" not in out.columns
    (winner,) = out.collect()
    assert winner["note"] == "n1"
    assert int(winner[RANK]) == rank(at_us[1], int(ingest.timestamp()))
