"""Compatibility rules of the embedded registry, checked with Avro's own resolution rules."""

from __future__ import annotations

import json

import pytest

from lambdalake.infra.registry import compatibility


def record(*fields: dict) -> str:
    return json.dumps({"type": "record", "name": "R", "namespace": "t", "fields": list(fields)})


BASE = record({"name": "id", "type": "string"}, {"name": "n", "type": "int"})
ADD_OPTIONAL = record(
    {"name": "id", "type": "string"},
    {"name": "n", "type": "int"},
    {"name": "note", "type": ["null", "string"], "default": None},
)
ADD_REQUIRED = record(
    {"name": "id", "type": "string"}, {"name": "n", "type": "int"}, {"name": "note", "type": "string"}
)
REMOVE_FIELD = record({"name": "id", "type": "string"})
PROMOTE_INT_TO_LONG = record({"name": "id", "type": "string"}, {"name": "n", "type": "long"})
CHANGE_TYPE = record({"name": "id", "type": "string"}, {"name": "n", "type": "string"})
ENUM_AB = record({"name": "s", "type": {"type": "enum", "name": "S", "symbols": ["A", "B"]}})
ENUM_ABC = record({"name": "s", "type": {"type": "enum", "name": "S", "symbols": ["A", "B", "C"]}})


@pytest.mark.parametrize(
    ("old", "new", "level", "ok"),
    [
        (BASE, ADD_OPTIONAL, "BACKWARD", True),  # new reader fills the default
        (BASE, ADD_REQUIRED, "BACKWARD", False),  # new reader has no value for 'note'
        (BASE, REMOVE_FIELD, "BACKWARD", True),  # new reader ignores 'n'
        (BASE, PROMOTE_INT_TO_LONG, "BACKWARD", True),  # int promotes to long
        (PROMOTE_INT_TO_LONG, BASE, "BACKWARD", False),  # long does not narrow to int
        (BASE, CHANGE_TYPE, "BACKWARD", False),
        (ENUM_AB, ENUM_ABC, "BACKWARD", True),  # reader knows every writer symbol
        (ENUM_ABC, ENUM_AB, "BACKWARD", False),  # 'C' unknown to the new reader
        (BASE, ADD_REQUIRED, "FORWARD", True),  # old reader ignores the new field
        (BASE, REMOVE_FIELD, "FORWARD", False),  # old reader needs 'n', has no default
        (BASE, ADD_OPTIONAL, "FULL", True),
        (BASE, ADD_REQUIRED, "FULL", False),
        (BASE, CHANGE_TYPE, "NONE", True),
    ],
)
def test_pairs(old: str, new: str, level: str, ok: bool) -> None:
    reasons = compatibility.check(new, [old], level)
    assert (reasons == []) is ok, reasons


def test_incompatible_reason_names_the_field() -> None:
    reasons = compatibility.check(ADD_REQUIRED, [BASE], "BACKWARD")
    assert any("note" in r and "reader_field_missing_default_value" in r for r in reasons), reasons


def test_transitive_checks_every_version_not_only_the_latest() -> None:
    # v1 -> v2 drops 'n'; v3 re-adds 'n' as a string: compatible with v2 (no 'n'), not with v1.
    v3 = record({"name": "id", "type": "string"}, {"name": "n", "type": "string", "default": "x"})
    assert compatibility.check(v3, [BASE, REMOVE_FIELD], "BACKWARD") == []
    assert compatibility.check(v3, [BASE, REMOVE_FIELD], "BACKWARD_TRANSITIVE") != []
