"""Synthetic events for any pipeline, drawn from its writer schema and rules.

A pipeline without a ``[generator]`` of its own (a user's) still gets a stream with what real feeds
have (see :mod:`lambdalake.produce.generator`: skewed keys, many updates of a key, late and
out-of-order times, duplicates, invalid records): every field gets a value of its type inside the
pipeline's rules, each ``latest`` view's version grows per key, and an invalid record breaks one rule
or one type.
"""

from __future__ import annotations

import math
import random
import string
import uuid
from collections.abc import Callable
from decimal import Decimal
from typing import Any

from lambdalake.pipeline import AllowedRule, LatestView, NotFutureRule, Pipeline, RangeRule, RequiredRule
from lambdalake.produce.generator import DAY_MS, EventStream, Mix, Zipf, future_field, set_field

#: Keys a stream draws from (Zipf-skewed: a few are hot).
KEYS = 1000


class SchemaStream(EventStream):
    """Records of ``pipeline``'s writer ``schema`` (its newest version unless given)."""

    def __init__(
        self,
        n: int,
        *,
        seed: int,
        mix: Mix,
        clock: Callable[[], float],
        pipeline: Pipeline,
        schema: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(n, seed=seed, mix=mix, clock=clock)
        self.schema = schema or pipeline.reader_schema
        self.pipeline = pipeline
        self.time_field = pipeline.event.time
        self._key = Zipf(KEYS, 1.1, self.rng)
        self._versions: dict[Any, int] = {}
        self._version_fields = {v.version for v in pipeline.views if isinstance(v, LatestView)}
        self._bounds = {r.field: r for r in pipeline.rules if isinstance(r, RangeRule)}
        self._allowed = {r.field: r.values for r in pipeline.rules if isinstance(r, AllowedRule)}
        self._required = {r.field for r in pipeline.rules if isinstance(r, RequiredRule)}
        self.corruptions = self._corruptions()

    def valid(self, now_ms: int, late: bool) -> dict[str, Any]:
        rng, event = self.rng, self.pipeline.event
        record: dict[str, Any] = {}
        for field in self.schema["fields"]:
            name = field["name"]
            if name == event.time:
                record[name] = self.event_time(now_ms, late)
            elif name in self._allowed:
                record[name] = rng.choice(self._allowed[name])
            else:
                record[name] = self._value(field["type"], name, now_ms, optional=name not in self._required)
        key = record.get(event.key)
        if isinstance(key, str):
            record[event.key] = f"{event.key}-{self._key():05d}"
        elif isinstance(key, int) and not isinstance(key, bool):
            record[event.key] = self._key()
        for name in self._version_fields:
            if name in record and isinstance(record[name], int) and not isinstance(record[name], bool):
                # Each update of a key carries the next version, so the latest view has one winner.
                version = self._versions.get(record[event.key], 0) + 1
                self._versions[record[event.key]] = version
                record[name] = version
        return record

    def _value(self, avro: Any, name: str, now_ms: int, *, optional: bool) -> Any:
        rng = self.rng
        if isinstance(avro, list):
            branches = [t for t in avro if t != "null"]
            if (optional and "null" in avro and rng.random() < 0.2) or not branches:
                return None
            return self._value(branches[0], name, now_ms, optional=optional)
        if isinstance(avro, dict):
            kind, logical = avro.get("type"), avro.get("logicalType")
            if logical == "decimal" and kind in ("bytes", "fixed"):
                digits = min(int(avro["precision"]), 12)
                scale = int(avro.get("scale", 0))
                return Decimal(rng.randint(-(10 ** (digits - 1)), 10**digits - 1)).scaleb(-scale)
            if logical in ("timestamp-millis", "local-timestamp-millis"):
                return now_ms - rng.randint(0, DAY_MS)
            if logical in ("timestamp-micros", "local-timestamp-micros"):
                return (now_ms - rng.randint(0, DAY_MS)) * 1000
            if logical == "date":
                return now_ms // DAY_MS - rng.randint(0, 365)
            if logical == "uuid":
                return str(uuid.UUID(int=rng.getrandbits(128)))
            if kind == "enum":
                return rng.choice(avro["symbols"])
            if kind == "fixed":
                return rng.randbytes(int(avro["size"]))
            if kind == "array":
                items = avro["items"]
                return [self._value(items, name, now_ms, optional=False) for _ in range(rng.randint(0, 3))]
            if kind == "map":
                values = avro["values"]
                return {
                    f"k{i}": self._value(values, name, now_ms, optional=False)
                    for i in range(rng.randint(0, 3))
                }
            if kind == "record":
                fields = avro["fields"]
                return {f["name"]: self._value(f["type"], f["name"], now_ms, optional=True) for f in fields}
            return self._value(kind, name, now_ms, optional=optional)
        bound = self._bounds.get(name)
        lo = bound.min if bound is not None and bound.min is not None else 0
        hi = bound.max if bound is not None and bound.max is not None else max(lo, 0) + 10_000
        if avro in ("int", "long"):
            top = int(hi) - (0 if bound is None or bound.max_inclusive or hi != int(hi) else 1)
            return rng.randint(math.ceil(lo), max(math.ceil(lo), top))
        if avro in ("float", "double"):
            value = round(rng.uniform(lo, hi), 3)
            return lo if value >= hi and bound is not None and not bound.max_inclusive else value
        if avro == "boolean":
            return rng.random() < 0.5
        if avro == "string":
            return "".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 12)))
        if avro == "bytes":
            return rng.randbytes(rng.randint(0, 8))
        return None

    def _corruptions(self) -> list[tuple[str, Callable[[dict[str, Any], random.Random, int], None]]]:
        out: list[tuple[str, Callable[[dict[str, Any], random.Random, int], None]]] = []
        for rule in self.pipeline.rules:
            field = rule.field
            if isinstance(rule, RequiredRule):
                out.append((f"{field} missing", set_field(field, "")))
            elif isinstance(rule, RangeRule):
                value = (rule.min - 1) if rule.min is not None else (rule.max or 0) + 1
                out.append((f"{field} out of range", set_field(field, value)))
            elif isinstance(rule, AllowedRule):
                out.append((f"{field} not allowed", set_field(field, "not-a-listed-value")))
            elif isinstance(rule, NotFutureRule):
                out.append((f"{field} in the future", future_field(field)))
        plain = ("int", "long", "float", "double")
        numbers = [f["name"] for f in self.schema["fields"] if f["type"] in plain]
        if numbers:
            out.append(("wrong type", set_field(numbers[0], "12.5 as text")))
        out.append(("unknown field", set_field("not_in_the_schema", 1)))
        return out
