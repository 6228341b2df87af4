"""Values of general unions between fastavro's form and the Arrow shape.

fastavro reads and writes a union value as the plain value of its branch; the Arrow shape of a union
of several branches but null is a struct of one member per such branch with exactly one set
(:func:`lambdalake.event_schema.arrow_type`). The columnar codec never needs these: they serve the
row-by-row paths, where fastavro does the reading or writing. Schemas here are fastavro-expanded.
"""

from __future__ import annotations

import datetime as dt
import re
import uuid
from decimal import Decimal
from typing import Any

import fastavro.validation

from lambdalake.event_schema import is_general_union, member_name, union_members

_MEMBER = re.compile(r"member\d+")
_NATURAL: dict[type, tuple[str, ...]] = {
    bool: ("boolean",), int: ("int", "long"), float: ("float", "double"), str: ("string", "enum"),
    bytes: ("bytes", "fixed"), dict: ("record", "map"), list: ("array",),
}  # fmt: skip
_LOGICAL: dict[type, tuple[str, ...]] = {
    Decimal: ("decimal",), dt.datetime: ("timestamp-millis", "timestamp-micros"), dt.date: ("date",),
    uuid.UUID: ("uuid",),
}  # fmt: skip


def _kind(schema: Any) -> tuple[str, str | None]:
    if isinstance(schema, str):
        return schema, None
    if isinstance(schema.get("type"), dict):
        return _kind(schema["type"])
    return schema["type"], schema.get("logicalType")


def _natural(value: Any, schema: Any) -> bool:
    """Whether ``value`` is what fastavro reads for ``schema`` (its Python type, not a conversion)."""
    kind, logical = _kind(schema)
    if type(value) in _LOGICAL:
        return logical in _LOGICAL[type(value)]
    return logical in (None, "uuid") and kind in _NATURAL.get(type(value), ())


def to_members(value: Any, schema: Any) -> Any:
    """A value as fastavro reads it, in the Arrow shape of ``schema`` (a uuid as its text)."""
    if value is None:
        return None
    if isinstance(schema, dict) and isinstance(schema.get("type"), dict | list):
        return to_members(value, schema["type"])
    if isinstance(schema, list):
        members = union_members(schema)
        if len(members) == 1:
            return to_members(value, members[0])
        exact = [i for i, m in enumerate(members) if _natural(value, m)]
        valid = exact or [
            i for i, m in enumerate(members) if fastavro.validation.validate(value, m, raise_errors=False)
        ]
        if not valid:
            raise ValueError(f"{value!r:.60} is none of the union's branches")
        out = {member_name(i): None for i in range(len(members))}
        out[member_name(valid[0])] = to_members(value, members[valid[0]])
        return out
    kind, _ = _kind(schema)
    if kind == "record":
        return {f["name"]: to_members(value.get(f["name"]), f["type"]) for f in schema["fields"]}
    if kind == "array":
        return [to_members(v, schema["items"]) for v in value]
    if kind == "map":
        return {k: to_members(v, schema["values"]) for k, v in value.items()}
    return str(value) if isinstance(value, uuid.UUID) else value


def branch_name(schema: Any) -> str:
    """The name fastavro's tuple notation picks a union branch by (a named type's full name)."""
    kind, _ = _kind(schema)
    if kind in ("record", "enum", "fixed"):
        return schema["name"] if isinstance(schema.get("type"), str) else branch_name(schema["type"])
    return kind


def from_members(value: Any, schema: Any) -> Any:
    """A value in the Arrow shape of ``schema``, as fastavro writes it (a general union's set member
    as ``(branch, value)``, fastavro's tuple notation, so the branch is the member's)."""
    if value is None:
        return None
    if isinstance(schema, dict) and isinstance(schema.get("type"), dict | list):
        return from_members(value, schema["type"])
    if isinstance(schema, list):
        members = union_members(schema)
        if len(members) == 1:
            return from_members(value, members[0])
        if not isinstance(value, dict):
            return value  # a plain value: fastavro picks its branch
        chosen = [i for i in range(len(members)) if value.get(member_name(i)) is not None]
        if len(chosen) != 1:
            # None or several members set: left as it is, for fastavro to refuse with its reason.
            return value
        member = members[chosen[0]]
        return (branch_name(member), from_members(value[member_name(chosen[0])], member))
    kind, _ = _kind(schema)
    if kind == "record" and isinstance(value, dict):
        return {f["name"]: from_members(value.get(f["name"]), f["type"]) for f in schema["fields"]}
    if kind == "array" and isinstance(value, list):
        return [from_members(v, schema["items"]) for v in value]
    if kind == "map" and isinstance(value, dict | list):
        pairs = value.items() if isinstance(value, dict) else value
        return {k: from_members(v, schema["values"]) for k, v in pairs}
    return value


def union_value(value: Any) -> Any:
    """The value of a general union given in either form: fastavro's ``(branch, value)`` or the
    Arrow shape's struct with one member set (anything else as it is: a plain value)."""
    if type(value) is tuple and len(value) == 2 and isinstance(value[0], str):
        return value[1]
    if isinstance(value, dict) and value and all(_MEMBER.fullmatch(str(k)) for k in value):
        chosen = [v for v in value.values() if v is not None]
        if len(chosen) == 1:
            return chosen[0]
    return value


def has_general_union(schema: Any) -> bool:
    """Whether an expanded schema holds a union of several branches but null anywhere."""
    if isinstance(schema, list):
        return is_general_union(schema) or any(has_general_union(b) for b in schema)
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    if isinstance(kind, dict | list):
        return has_general_union(kind)
    if kind == "record":
        return any(has_general_union(f["type"]) for f in schema["fields"])
    if kind == "array":
        return has_general_union(schema["items"])
    if kind == "map":
        return has_general_union(schema["values"])
    return False
