"""The engine-free half of view definitions: stored components and their exact merge."""

from __future__ import annotations

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
