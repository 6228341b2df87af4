"""The nesting bounds that keep deep input away from native parsers (no services needed)."""

from __future__ import annotations

from lambdalake.produce.nesting import MAX_DEPTH, deep_lines, deeper_than, json_depth


def test_json_depth_counts_brackets_outside_strings_only() -> None:
    assert json_depth(b'{"a": 1}') == 1
    assert json_depth(b'{"a": [[1], {"b": [2]}]}') == 4
    assert json_depth(b'{"a": "[[[[{{{{", "b": [1]}') == 2
    assert json_depth(b'{"a": "\\"[[[[", "b": "]]]]\\\\", "c": [[[]]]}') == 4
    assert json_depth(b"") == 0


def test_deep_lines_finds_exactly_the_lines_past_the_bound() -> None:
    at_bound = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    past = b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1)
    wide = b'{"a": [' + b", ".join([b"{}"] * 5000) + b"]}"  # many brackets, depth 3
    in_strings = b'{"a": "' + b"[" * 10_000 + b'"}'
    lines = [b'{"x": 1}\n', at_bound, past, wide, in_strings, b'{"a": "x\\"' + past + b'"}', past[:-3]]
    assert deep_lines(lines) == [2, 6]
    assert deep_lines([b'{"x": 1}'] * 1000) == []


def test_deeper_than_stops_at_the_bound() -> None:
    value: list = []
    inner = value
    for _ in range(1_000_000):
        inner.append([])
        inner = inner[0]
    assert deeper_than(value, 10)
    assert not deeper_than({"a": [1, {"b": (2, 3)}]}, 4)
    assert deeper_than({"a": [1, {"b": (2, [3])}]}, 4)
    assert not deeper_than("[[[[[[", 1)


def test_has_nested_types() -> None:
    from lambdalake.produce.nesting import has_nested_types

    def record(*types: object) -> dict:
        fields = [{"name": f"f{i}", "type": t} for i, t in enumerate(types)]
        return {"type": "record", "name": "R", "namespace": "n", "fields": fields}

    assert not has_nested_types(
        record("string", ["null", "long"], {"type": "enum", "name": "E", "symbols": ["a"]}, "E")
    )
    assert has_nested_types(record("string", {"type": "array", "items": "long"}))
    assert has_nested_types(record(["null", {"type": "map", "values": "string"}]))
    assert has_nested_types(record(["null", "n.R"]))  # recursive
