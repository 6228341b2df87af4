"""A user's ledger, end to end on the real services: its identity is an account and a nullable ``long``
reference near 2^60, its latest view is versioned by nanoseconds and stores a ``fixed`` digest and
``bytes``. Measured before: the speed layer answered 32 entries per account where 41 were sent
(adjacent references taken for one, repeats beside a null counted twice), the nightly batch refused
the null references its own edge took, a version in nanoseconds was dead-lettered, and every query of
a view storing a ``fixed`` answered HTTP 500.

The reference is computed here from what was sent, with plain Python."""

from __future__ import annotations

import base64
import json
import math
import os
import random
import time
from collections import defaultdict
from decimal import Decimal
from pathlib import Path

import httpx
import pytest

from lambdalake.batch.job import BatchJob
from lambdalake.pipeline import configured_pipeline
from lambdalake.produce.producer import EventProducer
from lambdalake.serving import ServingClient
from lambdalake.settings import Settings
from tests.conftest import isolated
from tests.helpers import run_speed_once, serving_app
from tests.test_user_pipeline import send

pytestmark = [pytest.mark.services, pytest.mark.slow]

SCHEMA = {
    "type": "record", "name": "Entry", "namespace": "test.ledger",
    "fields": [
        {"name": "account", "type": "string"},
        {"name": "ref", "type": ["null", "long"], "default": None},
        {"name": "seq_ns", "type": "long"},
        {"name": "digest", "type": {"type": "fixed", "name": "Digest", "size": 8}},
        {"name": "memo", "type": ["null", "bytes"], "default": None},
        {"name": "amount", "type": {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2}},
        {"name": "score", "type": "double"},
        {"name": "at", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    ],
}  # fmt: skip
PIPELINE = """name = "ledger"

[topic]
name = "{topic}"
partitions = 2

[topic.config]
"message.timestamp.type" = "LogAppendTime"

[schema]
subject = "{topic}-value"
versions = ["ledger/v1.avsc"]

[event]
key = "account"
time = "at"
identity = ["account", "ref"]

[layers]
epoch = "2 seconds"
dedup_delay = "5 minutes"
grace = "1 second"

[[views]]
name = "entries"
kind = "windowed"
key = ["account"]
window = "1 day"
aggregates = [
  {{ name = "entries", fn = "count" }},
  {{ name = "total", fn = "sum", column = "amount" }},
]

[[views]]
name = "newest"
kind = "latest"
key = ["account"]
version = "seq_ns"
columns = ["seq_ns", "ref", "digest", "memo", "amount", "score"]
"""
ACCOUNTS = [f"acct-{i}" for i in range(5)]
BASE_REF = 2**60
BASE_NS = 1_800_000_000_000_000_000  # nanoseconds since the epoch: far beyond 2^43


def _entry(account: int, ref: int | None, seq_ns: int, rng: random.Random, *, score: float = 1.5) -> dict:
    return {
        "account": ACCOUNTS[account], "ref": ref, "seq_ns": seq_ns,
        "digest": rng.randbytes(8), "memo": rng.choice([None, b"", rng.randbytes(5)]),
        "amount": Decimal(rng.randint(-10_000, 10_000)).scaleb(-2), "score": score,
        "at": int(time.time() * 1000) - rng.randrange(60_000),
    }  # fmt: skip


def _reference(sent: list[dict]) -> tuple[dict[str, tuple[int, Decimal]], dict[str, dict]]:
    """Per account: (entries, total) over distinct identities, and the row of the highest seq_ns
    (every repeat here is the same record, so which copy counts does not matter)."""
    firsts: dict[tuple, dict] = {}
    for r in sent:
        firsts.setdefault((r["account"], r["ref"]), r)
    counts: dict[str, list] = defaultdict(lambda: [0, Decimal(0)])
    newest: dict[str, dict] = {}
    for r in firsts.values():
        counts[r["account"]][0] += 1
        counts[r["account"]][1] += r["amount"]
        if r["account"] not in newest or r["seq_ns"] > newest[r["account"]]["seq_ns"]:
            newest[r["account"]] = r
    return {a: (n, t) for a, (n, t) in counts.items()}, newest


def _problems(settings: Settings, sent: list[dict]) -> list[str]:
    counts, newest = _reference(sent)
    client = ServingClient(settings=settings, meta_ttl_s=0)
    out = []
    for account in ACCOUNTS:
        windows = client.query("ledger", "entries", account).windows
        got = (
            sum(w.values["entries"] for w in windows),
            sum((w.values["total"] for w in windows), Decimal(0)),
        )
        if got != counts[account]:
            out.append(f"{account}: (entries, total) {got} != {counts[account]}")
        latest = client.query("ledger", "newest", account).latest
        want = newest[account]
        for column in ("seq_ns", "ref", "digest", "memo", "amount"):
            value = latest.values.get(column) if latest else None
            if value != want[column]:
                out.append(f"{account} newest {column}: {value!r} != {want[column]!r}")
    return out


def test_a_nullable_long_identity_counts_once_in_both_layers_and_every_type_answers(
    services: Settings, spark, tmp_path: Path
) -> None:
    unique = os.urandom(4).hex()
    topic = f"ledger-{unique}"
    (tmp_path / "pipelines").mkdir()
    (tmp_path / "schemas" / "ledger").mkdir(parents=True)
    (tmp_path / "schemas" / "ledger" / "v1.avsc").write_text(json.dumps(SCHEMA))
    (tmp_path / "pipelines" / "ledger.toml").write_text(PIPELINE.format(topic=topic))
    settings = isolated(services, tmp_path, unique).model_copy(
        update={"pipelines_dir": tmp_path / "pipelines", "schemas_dir": tmp_path / "schemas"}
    )
    pipeline = configured_pipeline("ledger", settings)
    producer = EventProducer(settings=settings, pipeline=pipeline)
    rng = random.Random(61)

    # Micro-batch 1: eight entries per account, no null reference.
    first = [_entry(a, BASE_REF + 2 * j, BASE_NS + 10 * j, rng) for a in range(5) for j in range(8)]
    first[15]["score"] = math.nan  # acct-1's newest row: nothing later outranks it
    send(producer, first)
    run_speed_once(settings, pipeline, spark)
    # Micro-batch 2, made differently: every entry of the first again, the adjacent references, and
    # one null reference per account; even accounts get newer nanoseconds, odd ones older.
    adjacent = [
        _entry(a, BASE_REF + 2 * j + 1, BASE_NS + (1000 + j if a % 2 == 0 else -1000 - j), rng)
        for a in range(5) for j in range(8)
    ]  # fmt: skip
    nulls = [_entry(a, None, BASE_NS - 5000, rng, score=-math.inf) for a in range(5)]
    second = [*first, *adjacent, *nulls]
    rng.shuffle(second)
    send(producer, second)
    run_speed_once(settings, pipeline, spark)
    sent = [*first, *second]
    counts, newest = _reference(sent)
    assert all(n == 17 for n, _ in counts.values()), counts
    assert newest["acct-1"]["score"] != newest["acct-1"]["score"], "acct-1's newest is the NaN row"
    # The speed layer alone, before any batch.
    assert _problems(settings, sent) == []

    # Every type answers over HTTP in its one JSON form: fixed and bytes as base64, NaN as a string.
    token = "t0ken"
    with serving_app(settings, token=token, meta_ttl_s=0) as url, httpx.Client(base_url=url) as http:
        for account in ACCOUNTS:
            response = http.get(f"/v1/pipelines/ledger/views/newest/keys/{account}",
                                headers={"Authorization": f"Bearer {token}"})  # fmt: skip
            assert response.status_code == 200, response.text
            values, want = response.json()["latest"]["values"], newest[account]
            assert values["digest"] == base64.b64encode(want["digest"]).decode()
            assert values["memo"] == (
                None if want["memo"] is None else base64.b64encode(want["memo"]).decode()
            )
            assert values["amount"] == format(want["amount"], "f")
            assert values["seq_ns"] == want["seq_ns"]
            score = want["score"]
            assert values["score"] == ("NaN" if score != score else score)
            entries = http.get(f"/v1/pipelines/ledger/views/entries/keys/{account}",
                               headers={"Authorization": f"Bearer {token}"})  # fmt: skip
            assert entries.status_code == 200, entries.text
            assert sum(w["values"]["entries"] for w in entries.json()["windows"]) == counts[account][0]

    # The nightly batch takes the null references the edge took, and answers the same.
    time.sleep(pipeline.layers.epoch_seconds + 2)
    run = BatchJob(settings=settings, pipeline=pipeline, spark=spark).run()
    assert run.outcome == "published", run
    answer = ServingClient(settings=settings, meta_ttl_s=0).query("ledger", "newest", "acct-0")
    assert answer.latest is not None and answer.latest.source == "batch"
    assert _problems(settings, sent) == []

    # More deliveries, copies among them: an incremental run merges them into the published views.
    more = [_entry(a, BASE_REF + 100 + a, BASE_NS + 9000, rng) for a in range(5)]
    send(producer, [*more, *more[:2]])
    run_speed_once(settings, pipeline, spark)
    sent += [*more, *more[:2]]
    time.sleep(pipeline.layers.epoch_seconds + 2)
    run = BatchJob(settings=settings, pipeline=pipeline, spark=spark).run()
    assert run.outcome == "published", run
    assert run.kind == "incremental", run
    assert _problems(settings, sent) == []
