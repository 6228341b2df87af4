"""The columnar producing path (validation over Arrow columns, columnar encoding, JSON lines read as
tables) gives exactly the per-record path's verdicts, reasons, keys, values and DLQ payloads, in the
same order: on the bad-input corpus, on generated streams with invalid records, and on hypothesis'
records. The client is a recorder here (a narrow fake: what is compared is what would be handed to
librdkafka); the real broker takes the columnar path in the CLI tests below and in test_bad_input.
"""

from __future__ import annotations

import copy
import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from lambdalake.produce.generator import Mix, generate
from lambdalake.produce.producer import EventProducer
from lambdalake.settings import Settings
from tests.conftest import pipeline_named, run_cli
from tests.helpers import consume_all
from tests.test_bad_input import BAD_LINES, ODD_VALID_LINES
from tests.test_bad_input import offer as offer_now

pytestmark = pytest.mark.services

NOW = time.time()


def offer(i: int, **changes: Any) -> dict:
    """A valid offer a minute before NOW, the producers' clock here: made with the real clock, one
    would be "in the future" to them once the suite has run five minutes past this module's import."""
    return offer_now(i, **{"updated_at": int(NOW * 1000) - 60_000, **changes})


class Recorder:
    """Stands in for confluent_kafka.Producer: records what would be produced, acknowledges all."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Any, Any, Any]] = []

    def produce(self, topic, value=None, key=None, headers=None, on_delivery=None) -> None:
        self.sent.append((topic, key, value, headers))
        if on_delivery is not None:
            on_delivery(None, None)

    def poll(self, _timeout: float = 0) -> int:
        return 0

    def flush(self, _timeout: float = 0) -> int:
        return 0

    def __len__(self) -> int:
        return 0


def recording(services: Settings, name: str, **event: Any) -> tuple[EventProducer, Recorder]:
    pipeline = pipeline_named(services, name)
    if event:
        pipeline = pipeline.model_copy(update={"event": pipeline.event.model_copy(update=event)})
    producer = EventProducer(settings=services, pipeline=pipeline, clock=lambda: NOW)
    recorder = Recorder()
    producer._producer = producer._dlq_producer = recorder  # type: ignore[assignment]
    return producer, recorder


@pytest.fixture(scope="module", params=["offers", "telemetry"])
def pair(request: pytest.FixtureRequest, services: Settings) -> tuple[str, tuple, tuple]:
    """Two producers of one pipeline: one for the per-record path, one for the columnar path."""
    return request.param, recording(services, request.param), recording(services, request.param)


def both_paths(pair: tuple, lines: list[bytes]) -> tuple[list, list]:
    _, (one, one_rec), (many, many_rec) = pair
    one_rec.sent.clear()
    many_rec.sent.clear()
    verdicts = [one.send_json_line(line) for line in lines]
    outcome = many.send_json_lines(lines)
    refused = dict(outcome.refused)
    assert [refused.get(i) for i in range(len(lines))] == verdicts
    assert outcome.accepted == sum(v is None for v in verdicts)
    return one_rec.sent, many_rec.sent


def test_the_bad_input_corpus_gets_the_same_verdicts_and_payloads(services: Settings) -> None:
    pair = ("offers", recording(services, "offers"), recording(services, "offers"))  # offers' corpus
    valid = [json.dumps(offer(i)).encode() + b"\n" for i in range(500)]
    lines = list(valid)
    for k, bad in enumerate([*BAD_LINES, *ODD_VALID_LINES]):
        lines.insert(k * 20 + 7, bad + b"\n")
    (expected, got) = both_paths(pair, lines)
    assert got == expected
    assert sum(1 for t, *_ in got if t.endswith(".dlq")) >= len(BAD_LINES) - 1  # one is only too large


def test_generated_streams_with_invalid_records_match(pair: tuple) -> None:
    name = pair[0]
    mix = Mix(duplicates=0.05, invalid=0.2, late=0.05)
    records = list(generate(name, 3000, seed=7, mix=mix, clock=lambda: NOW))
    lines = [json.dumps(r).encode() + b"\n" for r in records]
    (expected, got) = both_paths(pair, lines)
    assert got == expected
    dead = [s for s in got if s[0].endswith(".dlq")]
    assert 300 < len(dead) < 1000  # the mix's invalid share reached the DLQ, the rest the topic


def test_most_valid_records_are_cleared_over_columns(pair: tuple) -> None:
    name, _, (many, _) = pair
    records = list(generate(name, 2000, seed=3, mix=Mix(invalid=0.0), clock=lambda: NOW))
    outcome = many.send_json_lines([json.dumps(r).encode() + b"\n" for r in records])
    assert outcome.accepted == 2000 and outcome.one_by_one < 100


# Values of every kind a JSON line may hold, for fields of every type.
ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**65), max_value=2**65),
    st.integers(min_value=-10, max_value=10),
    st.floats(allow_nan=True, allow_infinity=False),
    st.text(max_size=6),
    st.sampled_from(["", " ", "\u00a0x", "EUR", "USD", "XXX", "running", "2026-01-01T00:00:00Z"]),
    st.lists(st.integers(), max_size=2),
)


@st.composite
def mutated_record(draw: st.DrawFn, base: list[dict], values: st.SearchStrategy, odd: list[Any]) -> Any:
    """A valid record with some fields changed to ``values``, removed or added; now and then one of
    ``odd`` instead (not a record at all)."""
    if odd and draw(st.integers(0, 29)) == 0:
        return draw(st.sampled_from(odd))
    record = dict(draw(st.sampled_from(base)))
    for name in draw(st.lists(st.sampled_from(sorted(record)), max_size=3)):
        if draw(st.booleans()):
            record[name] = draw(values)
        else:
            record.pop(name, None)
    if draw(st.integers(0, 9)) == 0:
        record[draw(st.sampled_from(["extra", "promocode"]))] = draw(values)
    return record


def mutated(base: list[dict]) -> st.SearchStrategy[bytes]:
    """A mutated record as a JSON line."""
    return mutated_record(base, ANY_VALUE, []).map(lambda r: json.dumps(r).encode() + b"\n")


@hsettings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_generated_records_get_the_same_verdicts(pair: tuple, data: st.DataObject) -> None:
    name = pair[0]
    base = list(generate(name, 20, seed=1, mix=Mix(invalid=0.0, duplicates=0.0), clock=lambda: NOW))
    lines = data.draw(st.lists(mutated(base), min_size=1, max_size=40))
    (expected, got) = both_paths(pair, lines)
    assert got == expected


def test_send_batch_of_dicts_and_of_a_table_match_send(services: Settings) -> None:
    one, one_rec = recording(services, "offers")
    many, many_rec = recording(services, "offers")
    records = list(generate("offers", 1000, seed=5, mix=Mix(invalid=0.1), clock=lambda: NOW))
    verdicts = [one.send(dict(r)) for r in records]
    outcome = many.send_batch([dict(r) for r in records])
    assert [dict(outcome.refused).get(i) for i in range(len(records))] == verdicts
    assert many_rec.sent == one_rec.sent
    valid = [r for r, v in zip(records, verdicts, strict=True) if v is None]
    many_rec.sent.clear()
    table = pa.Table.from_pylist(valid)
    outcome = many.send_batch(table)
    assert outcome.accepted == len(valid) and not outcome.refused
    assert many_rec.sent == [s for s in one_rec.sent if not s[0].endswith(".dlq")]


# Python values a caller's dict may hold, beyond what JSON gives.
ANY_PYTHON_VALUE = st.one_of(
    ANY_VALUE,
    st.binary(max_size=4),
    st.just(datetime(2026, 1, 1, tzinfo=UTC)),
    st.decimals(allow_nan=False, places=2, min_value=-100, max_value=100),
    st.dictionaries(st.sampled_from(["a", "b"]), st.integers(), max_size=2),
    st.lists(st.one_of(st.integers(), st.text(max_size=2)), max_size=3),
)
NOT_RECORDS = [None, [1, 2], "offer", 7]


def both_dict_paths(pair: tuple, records: list[Any]) -> tuple[list, list, Any]:
    _, (one, one_rec), (many, many_rec) = pair
    one_rec.sent.clear()
    many_rec.sent.clear()
    verdicts = [one.send(copy.deepcopy(r)) for r in records]
    outcome = many.send_batch(copy.deepcopy(records))
    refused = dict(outcome.refused)
    assert [refused.get(i) for i in range(len(records))] == verdicts
    return one_rec.sent, many_rec.sent, outcome


@hsettings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_generated_dicts_get_the_same_verdicts(pair: tuple, data: st.DataObject) -> None:
    name = pair[0]
    base = list(generate(name, 20, seed=1, mix=Mix(invalid=0.0, duplicates=0.0), clock=lambda: NOW))
    records = data.draw(
        st.lists(mutated_record(base, ANY_PYTHON_VALUE, NOT_RECORDS), min_size=1, max_size=40)
    )
    (expected, got, _) = both_dict_paths(pair, records)
    assert got == expected


def test_a_few_odd_dicts_do_not_send_the_batch_one_by_one(pair: tuple) -> None:
    name = pair[0]
    records = list(generate(name, 3000, seed=11, mix=Mix(invalid=0.02), clock=lambda: NOW))
    (expected, got, outcome) = both_dict_paths(pair, records)
    assert got == expected
    assert 0 < len(outcome.refused) <= outcome.one_by_one < 300  # only the odd ones went alone


def test_unknown_fields_dropped_by_the_pipeline_over_columns(services: Settings) -> None:
    one, one_rec = recording(services, "offers", unknown_fields="drop")
    many, many_rec = recording(services, "offers", unknown_fields="drop")
    lines = [json.dumps({**offer(i), "promocode": "X"}).encode() + b"\n" for i in range(300)]
    assert all(one.send_json_line(line) is None for line in lines)
    outcome = many.send_json_lines(lines)
    assert outcome.accepted == 300 and outcome.one_by_one == 0
    assert many_rec.sent == one_rec.sent


@pytest.mark.parametrize("fmt", ["json", "csv", "parquet"])
def test_produce_file_in_each_format_delivers_what_send_would(
    services: Settings, tmp_path: Path, unique: str, fmt: str
) -> None:
    """`produce --file` through the real broker: every key and value on the topic is what the
    per-record path encodes for the same record, and the invalid ones reach the DLQ."""
    settings = services.model_copy(update={"topic_prefix": f"{unique}-", "state_dir": tmp_path / "state"})
    records = [offer(i) for i in range(2000)]
    records[10]["price_cents"] = -5
    records[20]["currency"] = "XXX"
    path = tmp_path / f"input.{'jsonl' if fmt == 'json' else fmt}"
    if fmt == "json":
        path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in records))
    elif fmt == "csv":
        pacsv.write_csv(pa.Table.from_pylist(records).drop_columns(["promo_code"]), path)
    else:
        pq.write_table(pa.Table.from_pylist(records), path)
    result = run_cli(settings, "produce", "offers", "--file", str(path))
    assert result.returncode == 0, result.stdout[-2000:]
    one, rec = recording(settings, "offers")
    for r in records:
        one.send({k: v for k, v in r.items() if fmt != "csv" or k != "promo_code"})
    expected = [(k, v) for t, k, v, _ in rec.sent if not t.endswith(".dlq")]
    got = [(m.key(), m.value()) for m in consume_all(settings, f"{unique}-offers")]
    assert sorted(got) == sorted(expected) and len(got) == 1998
    dead = consume_all(settings, f"{unique}-offers.dlq")
    assert sorted(dict(m.headers())["lambdalake.rule"].decode() for m in dead) == [
        "currency.allowed",
        "price_cents.range",
    ]
