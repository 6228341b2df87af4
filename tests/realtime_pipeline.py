"""A pipeline of many field types for the latest views' two paths (tests/test_spark_rules.py and
tests/test_realtime.py): every type a latest view can keep, a rule of each kind on fields of several
types, two writer schemas, and two latest views (one filtered, one versioned by a timestamp)."""

from __future__ import annotations

import copy
import json
import random
from decimal import Decimal
from pathlib import Path
from typing import Any

from lambdalake.settings import Settings

DECIMAL = {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2}
SCHEMA_V1: dict[str, Any] = {
    "type": "record", "name": "Kinds", "namespace": "test.kinds",
    "fields": [
        {"name": "id", "type": "string"},
        {"name": "rev", "type": ["null", "long"], "default": None},
        {"name": "name", "type": "string"},
        {"name": "qty", "type": "int"},
        {"name": "price", "type": "double"},
        {"name": "ratio", "type": "float"},
        {"name": "amount", "type": DECIMAL},
        {"name": "kind", "type": {"type": "enum", "name": "Kind", "symbols": ["A", "B", "C"]}},
        {"name": "level", "type": "long"},
        {"name": "flag", "type": "boolean"},
        {"name": "at", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "at_us", "type": {"type": "long", "logicalType": "timestamp-micros"}},
        {"name": "raw", "type": "bytes"},
        {"name": "fx", "type": {"type": "fixed", "name": "Four", "size": 4}},
        {"name": "uid", "type": {"type": "string", "logicalType": "uuid"}},
        {"name": "local", "type": {"type": "long", "logicalType": "local-timestamp-millis"}},
        {"name": "note", "type": ["null", "string"], "default": None},
    ],
}  # fmt: skip
SCHEMA_V2 = copy.deepcopy(SCHEMA_V1)
SCHEMA_V2["fields"].append({"name": "channel", "type": "string", "default": "web"})

PIPELINE = """name = "kinds"

[topic]
name = "{topic}"
partitions = 2

[topic.config]
"message.timestamp.type" = "LogAppendTime"

[schema]
subject = "{topic}-value"
versions = {versions}

[event]
key = "id"
time = "at"
identity = ["id", "rev"]

[[rules]]
kind = "required"
field = "name"

[[rules]]
kind = "required"
field = "note"

[[rules]]
kind = "range"
field = "qty"
min = 0.5
max = 100
max_inclusive = false

[[rules]]
kind = "range"
field = "price"
min = -1e6
max = 1e6

[[rules]]
kind = "range"
field = "ratio"
min = -1
max = 1

[[rules]]
kind = "range"
field = "amount"
min = 0.5
max = 99999.5

[[rules]]
kind = "allowed"
field = "kind"
values = ["A", "B"]

[[rules]]
kind = "allowed"
field = "level"
values = [1, 2, 3, 9007199254740993]

[[rules]]
kind = "not_future"
field = "at"
max_skew_s = 300

[[rules]]
kind = "not_future"
field = "at_us"
max_skew_s = 0.5

[layers]
epoch = "10 seconds"
dedup_delay = "3 seconds"
grace = "1 second"
speed_ttl = "1 day"

[[views]]
name = "kinds_latest"
kind = "latest"
key = ["id"]
version = "rev"

[[views]]
name = "cheap_latest"
kind = "latest"
key = ["kind", "id"]
version = "at"
columns = ["price", "amount", "flag", "note"]
where = "price < 100 and flag = true"

[[views]]
name = "per_kind"
kind = "windowed"
key = ["kind"]
window = "1 minute"
aggregates = [{{ name = "n", fn = "count" }}]
"""


def write_kinds(settings: Settings, root: Path, topic: str, *, versions: int = 2) -> Settings:
    """Settings whose pipelines and schemas folders (under ``root``) hold the kinds pipeline with
    its first ``versions`` schemas."""
    (root / "pipelines").mkdir(parents=True, exist_ok=True)
    (root / "schemas" / "kinds").mkdir(parents=True, exist_ok=True)
    names = []
    for i, schema in enumerate([SCHEMA_V1, SCHEMA_V2][:versions], start=1):
        (root / "schemas" / "kinds" / f"v{i}.avsc").write_text(json.dumps(schema))
        names.append(f"kinds/v{i}.avsc")
    (root / "pipelines" / "kinds.toml").write_text(PIPELINE.format(topic=topic, versions=json.dumps(names)))
    return settings.model_copy(update={"pipelines_dir": root / "pipelines", "schemas_dir": root / "schemas"})


SPACES = ["", " ", "\t", "\x1c", "\u3000", " x ", "\x1cx"]


def kinds_records(
    n: int, *, seed: int, now_ms: int, keys: int = 40, invalid: float = 0.2
) -> list[dict[str, Any]]:
    """``n`` records of the v1 shape, about ``invalid`` of them breaking a rule, with values at the
    rules' edges (bounds, blanks of every kind, NaN and infinities, far future and past times),
    few keys and few versions, so keys collide and versions tie."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        r: dict[str, Any] = {
            "id": f"k{rng.randrange(keys):03d}",
            "rev": rng.choice([None, 0, 1, 2, -(2**63), 2**63 - 1]),
            "name": rng.choice(["alpha", "β", " y"]),
            "qty": rng.choice([1, 5, 99]),
            "price": rng.choice([0.0, 5.5, 99.99, 150.0, -3.25]),
            "ratio": rng.choice([0.5, -0.25, 1.0, -1.0]),
            "amount": rng.choice([Decimal("0.50"), Decimal("12.34"), Decimal("99999.50")]),
            "kind": rng.choice(["A", "B"]),
            "level": rng.choice([1, 2, 3, 9007199254740993]),
            "flag": rng.random() < 0.6,
            "at": now_ms - rng.randrange(0, 86_400_000),
            "at_us": (now_ms - rng.randrange(0, 10_000)) * 1000 + rng.randrange(1000),
            "raw": rng.randbytes(rng.randrange(4)),
            "fx": rng.randbytes(4),
            "uid": f"00000000-0000-4000-8000-{i:012d}",
            "local": now_ms + rng.randrange(-(10**9), 10**9),
            "note": rng.choice(["n", "note ✓", "x y"]),
        }
        if rng.random() < invalid:
            field, value = rng.choice([
                ("name", rng.choice(SPACES)), ("note", None), ("note", rng.choice(SPACES)),
                ("qty", rng.choice([0, 100, -5])), ("price", rng.choice([float("nan"), float("inf"), 2e6])),
                ("ratio", rng.choice([float("nan"), float("-inf"), 1.5])),
                ("amount", rng.choice([Decimal("0.49"), Decimal("99999.51")])), ("kind", "C"),
                ("level", rng.choice([4, 9007199254740992])), ("at", now_ms + 400_000),
                ("at_us", (now_ms + 2_000) * 1000),
            ])  # fmt: skip
            r[field] = value
        elif rng.random() < 0.1:
            # Valid values at the rules' edges.
            field, value = rng.choice([
                ("name", " x "), ("qty", rng.choice([1, 99])), ("amount", Decimal("0.50")),
                ("price", rng.choice([-1e6, 1e6])), ("at", now_ms + 299_000), ("local", -1500),
                ("at_us", -1_500), ("ratio", 1.0),
            ])  # fmt: skip
            r[field] = value
        out.append(r)
    return out
