"""Input nested 10^3 to 10^6 levels deep, in every form `produce` and the producer API take.

pyarrow's JSON reader and ``pa.array`` recurse on the C stack and kill the process (SIGSEGV) on
such input; none of it may reach them. Each test surrounds the deep records with valid ones and
counts what reached the topic and the dead-letter topic with kcat, an independent client.
"""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lambdalake.settings import PROJECT_ROOT, Settings
from tests.conftest import env_for, pipeline_named
from tests.helpers import consume_all, kcat_count
from tests.test_bad_input import offer

pytestmark = pytest.mark.services

DEPTHS = [10**3, 10**4, 10**5, 10**6]
VALID = 3000


def nested_text(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def deep_lines() -> list[bytes]:
    """Per depth: an unknown field nested that deep, and a known field (``title``) holding it."""
    out = []
    for d in DEPTHS:
        out.append(b'{"offer_id": "deep-x-%d", "x": %s}' % (d, nested_text(d)))
        line = json.dumps(offer(d, title="@")).encode()
        out.append(line.replace(b'"@"', nested_text(d)))
    return out


def mixed(valid: list[bytes], bad: list[bytes]) -> list[bytes]:
    """``bad`` spread evenly through ``valid``."""
    lines = list(valid)
    step = len(lines) // (len(bad) + 1)
    for k, line in enumerate(bad):
        lines.insert((k + 1) * step + k, line)
    return lines


def kept_locally(tmp_path: Path) -> list[dict]:
    """The entries of the local rejects files (what even the DLQ could not take)."""
    return [json.loads(x) for f in (tmp_path / "state" / "rejects").glob("offers-*.jsonl") for x in f.open()]


def produce(settings: Settings, *args: str, stdin: bytes | None = None) -> tuple[int, str]:
    result = subprocess.run(
        [sys.executable, "-m", "lambdalake", "produce", "offers", *args],
        env=env_for(settings), input=stdin, capture_output=True, timeout=600, cwd=PROJECT_ROOT,
    )  # fmt: skip
    return result.returncode, (result.stdout + result.stderr).decode(errors="replace")


@pytest.mark.parametrize("source", ["file", "stdin"])
def test_json_lines_nested_deep_are_dead_lettered_and_the_rest_delivered(
    services: Settings, tmp_path: Path, unique: str, source: str
) -> None:
    settings = services.model_copy(update={"topic_prefix": f"{unique}-", "state_dir": tmp_path / "state"})
    valid = [json.dumps(offer(i)).encode() for i in range(VALID)]
    bad = deep_lines()
    data = b"\n".join(mixed(valid, bad)) + b"\n"
    if source == "file":
        path = tmp_path / "deep.jsonl"
        path.write_bytes(data)
        code, text = produce(settings, "--file", str(path))
    else:
        code, text = produce(settings, "--file", "-", stdin=data)
    assert code == 0, text[-3000:]
    assert "Traceback" not in text
    summary = " ".join(text.split())
    assert f"acknowledged {VALID:,} rejected (DLQ) {2 * len(DEPTHS)}" in summary, summary
    assert f"rejected by json: {2 * len(DEPTHS)}" in summary, summary
    assert kcat_count(settings, f"{unique}-offers") == VALID
    # The lines of 10^6 levels (2 MB) exceed the broker's message size: the DLQ cannot take them, so
    # they are kept, with their reason, in the local rejects file the summary names.
    assert kcat_count(settings, f"{unique}-offers.dlq") == 2 * len(DEPTHS) - 2
    dead = consume_all(settings, f"{unique}-offers.dlq")
    assert {dict(m.headers())["lambdalake.rule"] for m in dead} == {b"json"}
    rejects = kept_locally(tmp_path)
    assert {r["rule"] for r in rejects} == {"json"} and len(rejects) == 2
    kept = {m.value().rstrip() for m in dead} | {r["payload"].encode().rstrip() for r in rejects}
    assert kept == set(bad)  # each kept verbatim


def test_csv_cells_nested_deep_are_text_and_never_parsed(
    services: Settings, tmp_path: Path, unique: str
) -> None:
    settings = services.model_copy(update={"topic_prefix": f"{unique}-", "state_dir": tmp_path / "state"})
    rows = [offer(i) for i in range(VALID)]
    deep = [offer(100_000 + d, title=nested_text(d).decode()) for d in DEPTHS]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]))
    writer.writeheader()
    for row in mixed(rows, deep):  # type: ignore[arg-type]
        writer.writerow(row)
    path = tmp_path / "deep.csv"
    path.write_text(buffer.getvalue())
    code, text = produce(settings, "--file", str(path))
    assert code == 0, text[-3000:]
    assert "Traceback" not in text
    # A cell is a string: the titles of 2e3 to 2e5 brackets are valid offers; 2e6 bytes exceed the
    # broker's message size and are kept in the local rejects file (the DLQ cannot take them either).
    assert kcat_count(settings, f"{unique}-offers") == VALID + 3
    on_topic = {m.key().decode() for m in consume_all(settings, f"{unique}-offers")}
    assert {f"o-{100_000 + d}" for d in DEPTHS[:3]} <= on_topic
    rejects = kept_locally(tmp_path)
    assert [r["rule"] for r in rejects] == ["too_large"]


def deep_list(depth: int) -> list:
    top: list = []
    inner = top
    for _ in range(depth - 1):
        inner.append([])
        inner = inner[0]
    return top


def deep_dict(depth: int) -> dict:
    top: dict = {}
    inner = top
    for _ in range(depth - 1):
        inner["a"] = {}
        inner = inner["a"]
    return top


def test_send_batch_of_deep_dicts_dead_letters_them_and_delivers_the_rest(
    services: Settings, unique: str
) -> None:
    from lambdalake.produce.producer import EventProducer

    pipeline = pipeline_named(services, "offers", topic=f"offers-{unique}")
    producer = EventProducer(settings=services, pipeline=pipeline)
    deep: list[Any] = []
    for d in DEPTHS:
        deep += [offer(200_000 + d, title=deep_list(d)), offer(300_000 + d, promo_code=deep_dict(d))]
        deep.append({**offer(400_000 + d), "x": deep_list(d)})
    records = mixed([offer(i) for i in range(VALID)], deep)  # type: ignore[arg-type]
    outcome = producer.send_batch(records)
    stats = producer.flush()
    assert stats.acked == VALID
    assert sorted(records[i]["offer_id"] for i, _ in outcome.refused) == sorted(r["offer_id"] for r in deep)
    # A known field holding a deep value: too deep to name in a message; an unknown one: named.
    rules = {records[i]["offer_id"]: r.rule for i, r in outcome.refused}
    unknown = {r["offer_id"] for r in deep if "x" in r}
    assert {rule for key, rule in rules.items() if key not in unknown} == {"too_deep"}
    assert {rule for key, rule in rules.items() if key in unknown} == {"unknown_field"}
    assert kcat_count(services, f"offers-{unique}") == VALID
    assert kcat_count(services, f"offers-{unique}.dlq") == len(deep)
    dead = consume_all(services, f"offers-{unique}.dlq")
    assert {m.key().decode() for m in dead} == {r["offer_id"] for r in deep}
    assert {m.key().decode(): dict(m.headers())["lambdalake.rule"].decode() for m in dead} == rules
