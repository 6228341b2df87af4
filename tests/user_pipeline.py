"""A pipeline no shipped code knows, written the way the README tells a user to: card payments with a
decimal amount, an enum, a nullable string, a composite key and three partitions. Tests write it into
a temporary folder and compare its answers with a plain-Python reference built here, from the
records read back with confluent-kafka's own Avro deserializer."""

from __future__ import annotations

import json
import random
import time
from collections import defaultdict
from decimal import ROUND_HALF_UP, Context, Decimal
from pathlib import Path
from typing import Any

from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from lambdalake.settings import Settings
from tests.helpers import consume_all

STATUSES = ["AUTHORIZED", "DECLINED", "SETTLED"]
AMOUNT = {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2}
SCHEMA_V1: dict[str, Any] = {
    "type": "record", "name": "Payment", "namespace": "test.payments",
    "fields": [
        {"name": "payment_id", "type": "string"},
        {"name": "account_id", "type": "string"},
        {"name": "region", "type": "string"},
        {"name": "amount", "type": AMOUNT},
        {"name": "status", "type": {"type": "enum", "name": "Status", "symbols": STATUSES}},
        {"name": "note", "type": ["null", "string"], "default": None},
        {"name": "attempt", "type": "int"},
        {"name": "paid_at", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    ],
}  # fmt: skip
WINDOW_MS = 5 * 60_000

PIPELINE = """# Card payments: the latest attempt of each payment, and money per account and region.
name = "payments"

[topic]
name = "{topic}"
partitions = 3

[topic.config]
"message.timestamp.type" = "LogAppendTime"

[schema]
subject = "{topic}-value"
versions = {versions}

[event]
key = "payment_id"
time = "paid_at"
identity = ["payment_id", "attempt"]

[[rules]]
kind = "required"
field = "account_id"

[[rules]]
kind = "not_future"
field = "paid_at"
max_skew_s = 300

[layers]
epoch = "5 seconds"
dedup_delay = "3 seconds"
grace = "1 second"
speed_ttl = "1 day"

[[views]]
name = "payment_latest"
kind = "latest"
key = ["payment_id"]
version = "attempt"{columns}

[[views]]
name = "account_region_5m"
kind = "windowed"
key = ["account_id", "region"]
window = "5 minutes"
aggregates = [
  {{ name = "payments", fn = "count" }},
  {{ name = "total", fn = "sum", column = "amount" }},
  {{ name = "smallest", fn = "min", column = "amount" }},
  {{ name = "largest", fn = "max", column = "amount" }},
  {{ name = "mean", fn = "avg", column = "amount" }},{extra}
]
"""


def write_pipeline(
    settings: Settings,
    root: Path,
    topic: str,
    schemas: list[dict[str, Any]],
    *,
    sums: tuple[str, ...] = (),
    distincts: tuple[str, ...] = (),
    latest_columns: list[str] | None = None,
) -> Settings:
    """Settings whose pipelines and schemas folders (under ``root``) hold the payments pipeline with
    ``schemas`` as its versions, oldest first; the windowed view also sums ``sums`` (each as
    ``<field>_total``) and counts the distinct values of ``distincts`` (as ``<field>_kinds``), and the
    latest view keeps ``latest_columns`` (default: every field)."""
    (root / "pipelines").mkdir(parents=True, exist_ok=True)
    (root / "schemas" / "payments").mkdir(parents=True, exist_ok=True)
    versions = []
    for i, schema in enumerate(schemas, start=1):
        (root / "schemas" / "payments" / f"v{i}.avsc").write_text(json.dumps(schema, indent=2))
        versions.append(f"payments/v{i}.avsc")
    extra = "".join(f'\n  {{ name = "{f}_total", fn = "sum", column = "{f}" }},' for f in sums)
    extra += "".join(f'\n  {{ name = "{f}_kinds", fn = "distinct", column = "{f}" }},' for f in distincts)
    columns = f"\ncolumns = {json.dumps(latest_columns)}" if latest_columns is not None else ""
    text = PIPELINE.format(topic=topic, versions=json.dumps(versions), extra=extra, columns=columns)
    (root / "pipelines" / "payments.toml").write_text(text)
    return settings.model_copy(update={"pipelines_dir": root / "pipelines", "schemas_dir": root / "schemas"})


def payments(n: int, *, seed: int, start: int = 0, now_ms: int | None = None) -> list[dict[str, Any]]:
    """``n`` valid payments over 40 accounts and 4 regions (160 composite keys), amounts of two places
    both signs (refunds), paid within the last 20 minutes; about 5 % are a second attempt."""
    rng = random.Random(seed)
    now_ms = now_ms or int(time.time() * 1000)
    out = []
    for i in range(start, start + n):
        cents = rng.randint(-50_000, 9_999_999)
        out.append({
            "payment_id": f"pay-{i:06d}",
            "account_id": f"acct-{rng.randrange(40):02d}",
            "region": rng.choice(["eu", "us", "apac", "latam"]),
            "amount": Decimal(cents).scaleb(-2),
            "status": rng.choice(["AUTHORIZED", "DECLINED", "SETTLED"]),
            "note": rng.choice([None, "", "3ds", "retry ✓"]),
            "attempt": 2 if rng.random() < 0.05 else 1,
            "paid_at": now_ms - rng.randrange(20 * 60_000),
        })  # fmt: skip
    return out


def read_back(settings: Settings, topic: str) -> list[dict[str, Any]]:
    """Every record of ``topic`` decoded by confluent-kafka's AvroDeserializer, with its coordinates."""
    deserializer = AvroDeserializer(SchemaRegistryClient(settings.registry.client_config()))
    out = []
    for msg in consume_all(settings, topic):
        value = deserializer(msg.value(), SerializationContext(topic, MessageField.VALUE))
        value["paid_at"] = round(value["paid_at"].timestamp() * 1000)
        value.update(_ts=msg.timestamp()[1], _partition=msg.partition(), _offset=msg.offset())
        out.append(value)
    return out


_WIDE = Context(prec=100)


def _latest_order(r: dict[str, Any]) -> tuple:
    """The highest attempt; of one attempt, the first delivery."""
    return (r["attempt"], -r["_ts"], -r["_partition"], -r["_offset"])


def reference(
    records: list[dict[str, Any]], *, sums: tuple[str, ...] = ()
) -> tuple[dict[tuple, dict], dict[str, dict]]:
    """(windowed rows by (account, region, window start ms), latest rows by payment id) over the
    first copy of each identity by (ingest time, partition, offset). ``sums``: fields the windowed
    view also sums (as ``<field>_total``; a record without the field counts as null)."""
    firsts: dict[tuple, dict] = {}
    for r in sorted(records, key=lambda r: (r["_ts"], r["_partition"], r["_offset"])):
        firsts.setdefault((r["payment_id"], r["attempt"]), r)
    cells: dict[tuple, list[dict]] = defaultdict(list)
    latest: dict[str, dict] = {}
    for r in firsts.values():
        cells[(r["account_id"], r["region"], r["paid_at"] // WINDOW_MS * WINDOW_MS)].append(r)
        best = latest.get(r["payment_id"])
        if best is None or _latest_order(r) > _latest_order(best):
            latest[r["payment_id"]] = r
    windowed = {}
    for cell, rows in cells.items():
        amounts = [r["amount"] for r in rows]
        total = sum(amounts, Decimal(0))
        mean = _WIDE.divide(total, len(amounts)).quantize(Decimal("0.000001"), rounding=ROUND_HALF_UP)
        windowed[cell] = {
            "payments": len(amounts), "total": total, "smallest": min(amounts), "largest": max(amounts),
            "mean": mean,
        }  # fmt: skip
        for name in sums:
            values = [r[name] for r in rows if r.get(name) is not None]
            windowed[cell][f"{name}_total"] = sum(values) if values else None
    return windowed, latest
