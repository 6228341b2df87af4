"""A value's one JSON form, whatever layer, engine or client meets it.

The HTTP API, the CLI and :meth:`serving.answers.Answer.to_dict` all answer through
:func:`json_value`:

- bytes (``bytes`` and ``fixed`` fields) as standard base64 text with padding;
- decimals as the text of their exact digits at the field's scale (``"12.50"``): a JSON number
  would pass through a float in most readers;
- NaN and the infinities as the strings ``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` (JSON has
  no such numbers; null would read as "no value");
- timestamps as RFC 3339 text in UTC (``2026-12-01T10:00:00Z``), dates as ``YYYY-MM-DD``;
- uuids as their text; integers of any size, finite floats, strings, booleans and null as JSON has them.
"""

from __future__ import annotations

import base64
import math
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any
from uuid import UUID

#: The stated form, for the OpenAPI document's descriptions.
DESCRIPTION = (
    "Each column by name: timestamps as RFC 3339 text in UTC, dates as YYYY-MM-DD, decimals as the "
    'text of their exact digits ("12.50"), bytes and fixed as base64 text, NaN and infinities as the '
    'strings "NaN", "Infinity" and "-Infinity", other values as JSON numbers, strings, booleans or null.'
)


def json_value(value: Any) -> Any:
    """``value`` in its JSON form (dicts, lists and tuples converted throughout)."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_value(v) for v in value]
    if isinstance(value, datetime):
        aware = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
        return aware.astimezone(UTC).isoformat().replace("+00:00", "Z")
    if isinstance(value, date):
        return value.isoformat()
    return json_default(value)


def json_default(value: Any) -> str:
    """The JSON form of a value JSON has no type for: a decimal, bytes, a uuid (the ``default`` of a
    serializer that writes the other types itself, as orjson does on serving's hot path)."""
    if isinstance(value, Decimal):
        return decimal_digits(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, UUID):
        return str(value)
    raise TypeError(f"no JSON form for a {type(value).__name__}")


def finite(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with each NaN and infinity in its JSON form (in nested dicts too), for a serializer
    that would write them as null; ``values`` itself when it holds none (one scan, no copy)."""
    for v in values.values():
        t = type(v)
        # ``v - v`` is 0.0 for every finite float, NaN for NaN and the infinities.
        if t is dict or (t is float and v - v != 0.0):
            break
    else:
        return values
    out = {}
    for k, v in values.items():
        out[k] = finite(v) if type(v) is dict else json_value(v) if type(v) is float else v
    return out


def decimal_digits(value: Decimal) -> str:
    """A decimal's exact digits at its own scale, never in exponent notation (``"12.50"``)."""
    return format(value, "f")
