"""The speed layer's one aggregation of every windowed view gives each view what its own gives."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

from pyspark.sql import functions as F

from lambdalake.pipeline import WindowedView, load
from lambdalake.sketches import hll_answer, kll_answer
from lambdalake.views import Component, view_components

FIELDS = [
    {"name": "id", "type": "string"},
    {"name": "at", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    {"name": "region", "type": ["null", "string"], "default": None},
    {"name": "amount", "type": {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2}},
    {"name": "speed", "type": "double"},
]

VIEWS = """
[[views]]
name = "by_region"
kind = "windowed"
key = ["region"]
window = "1 minute"
aggregates = [{ name = "n", fn = "count" }, { name = "total", fn = "sum", column = "amount" },
              { name = "low", fn = "min", column = "level" }, { name = "top", fn = "max", column = "speed" },
              { name = "mean", fn = "avg", column = "amount" }]

[[views]]
name = "levels_by_id"
kind = "windowed"
key = ["id"]
window = "1 hour"
where = "level > 2"
aggregates = [{ name = "levels", fn = "distinct", column = "level" },
              { name = "speeds", fn = "quantiles", column = "speed" }]

[[views]]
name = "by_level"
kind = "windowed"
key = ["level", "region"]
window = "10 seconds"
aggregates = [{ name = "n", fn = "count", column = "speed" },
              { name = "total", fn = "sum", column = "level" }]

# Cut as by_region (its key, its window): one cell of the aggregation, counted where it keeps events.
[[views]]
name = "ids_by_region"
kind = "windowed"
key = ["region"]
window = "1 minute"
where = "level > 4"
aggregates = [{ name = "n", fn = "count" }, { name = "ids", fn = "distinct", column = "id" }]
"""


def _pipeline(tmp_path: Path):
    for i, level in enumerate(["int", "long"], start=1):
        fields = [*FIELDS, {"name": "level", "type": level}]
        (tmp_path / f"v{i}.avsc").write_text(json.dumps({"type": "record", "name": "R", "fields": fields}))
    (tmp_path / "p.toml").write_text(
        'name = "together"\n[topic]\nname = "together"\n[schema]\nsubject = "together-value"\n'
        'versions = ["v1.avsc", "v2.avsc"]\n[event]\nkey = "id"\ntime = "at"\nidentity = ["id", "at"]\n'
        + VIEWS
    )
    pipeline = load(tmp_path / "p.toml", schemas_dir=tmp_path)
    # The last view as a version made before `level` widened to long: it keys and sums it as an int.
    held = pipeline.views[2].with_stored_types({"level": "int32", "region": "string", "speed": "double"})
    return pipeline.model_copy(update={"views": [*pipeline.views[:2], held, *pipeline.views[3:]]})


def answer(c: Component, sketch: bytes) -> dict:
    return hll_answer(sketch, c.size) if c.fn == "hll" else kll_answer(sketch, [0.0, 0.25, 0.5, 0.9, 1.0])


def test_each_view_of_the_one_aggregation_equals_its_own(spark, tmp_path: Path) -> None:
    """Keys, windows, epochs, counts, decimal sums, min/max, sketches, filters, a version holding a
    narrower type (a key beyond it left out) and two views cut alike (one keeping fewer events, so
    some of their shared groups are the other's only) are the same whichever way computed
    (sketches by what they answer)."""
    from lambdalake.spark.views import INGEST_TS, together_column, together_row, windowed, windowed_together

    pipeline = _pipeline(tmp_path)
    rng = random.Random(7)
    start = datetime(2026, 3, 1, tzinfo=UTC)
    rows = []
    for _ in range(3_000):
        at = start + timedelta(seconds=rng.randrange(600))
        level = rng.choice([0, 1, 3, 5, 2**33, None])
        rows.append((
            f"id{rng.randrange(40)}", at, rng.choice(["eu", "us", None]),
            Decimal(rng.randrange(-10**6, 10**9)) / 100, rng.uniform(0, 200), level,
            at + timedelta(seconds=rng.randrange(90)),
        ))  # fmt: skip
    columns = "id string, at timestamp, region string, amount decimal(12,2), speed double, level bigint"
    df = spark.createDataFrame(rows, f"{columns}, {INGEST_TS} timestamp")
    epoch = F.window(F.col(INGEST_TS), "30 seconds")
    views = [v for v in pipeline.views if isinstance(v, WindowedView)]
    together = windowed_together(df, pipeline, views, epoch=epoch).collect()
    for i, view in enumerate(views):
        alone = windowed(df, pipeline, view, epoch=epoch)
        columns = alone.columns
        sketches = {c.column: c for c in view_components(view) if c.fn in ("hll", "kll")}

        def comparable(values: list, columns: list[str] = columns, sketches: dict = sketches) -> tuple:
            # A sketch's bytes follow the order its values came in (an HLL of few values lists
            # them); what it answers does not.
            return tuple(
                answer(sketches[c], v) if c in sketches else v for c, v in zip(columns, values, strict=True)
            )

        expected = sorted((comparable(list(r)) for r in alone.collect()), key=repr)
        mine = [r for r in together if r[together_row(i)]]
        got = sorted((comparable([r[together_column(i, c)] for c in columns]) for r in mine), key=repr)
        assert got == expected, (view.name, [g for g in got if g not in expected][:2])
        assert len(got) > 10, view.name
    components = [c.column for c in view_components(views[2])]
    assert components == ["n", "total"]
    # The held view left out the keys beyond an int: no row of it has one.
    held_levels = {r[together_column(2, "level")] for r in together if r[together_row(2)]}
    assert 2**33 not in held_levels and {0, 1, 3, 5, None} <= held_levels
