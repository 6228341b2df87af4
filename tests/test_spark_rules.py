"""The Real-time path's decode and rules (:mod:`lambdalake.spark.realtime`, :mod:`lambdalake.spark.rules`),
Spark expressions only, against the speed job's decode (:func:`lambdalake.spark.decode.decoder`), the
definition: on the same Kafka records, the same records pass, with the same values, and each latest
view's candidate holds what the micro-batch path would write."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest
from pyspark.sql import functions as F

from lambdalake.avro import WireEncoder, parse_schema
from lambdalake.cassandra.encode import arrow_type
from lambdalake.errors import ConfigurationError
from lambdalake.filters import arrow_expression
from lambdalake.latest import RANK, latest_rank
from lambdalake.pipeline import configured_pipeline
from lambdalake.settings import Settings
from lambdalake.spark import decode
from lambdalake.spark.realtime import decoded_records, latest_targets
from lambdalake.writer_schemas import SchemaIdNotFound
from tests.realtime_pipeline import SCHEMA_V1, SCHEMA_V2, kinds_records, write_kinds

pytestmark = pytest.mark.services

REGISTRY = "http://registry.invalid:3"


def _records(now_ms: int) -> tuple[list[bytes], list[int | None]]:
    """Framed values of both writer schemas, with broken ones, and Kafka timestamps around them."""
    v1 = WireEncoder(1, parse_schema(SCHEMA_V1))
    v2 = WireEncoder(2, parse_schema(SCHEMA_V2))
    values, stamps = [], []
    for i, r in enumerate(kinds_records(1500, seed=5, now_ms=now_ms)):
        value = v2.encode({**r, "channel": "app"}) if i % 3 == 0 else v1.encode(r)
        if i % 97 == 0:
            value = value[: len(value) // 2]  # truncated: does not decode
        elif i % 89 == 0:
            value = b"\x01" + value[1:]  # not the wire format
        elif i % 83 == 0:
            value = value[:1] + (7).to_bytes(4, "big") + value[5:]  # an id the registry lacks
        elif i % 79 == 0:  # one whose high bit is set: the header's id is a signed integer
            value = value[:1] + (-7).to_bytes(4, "big", signed=True) + value[5:]
        values.append(value)
        stamps.append(None if i % 211 == 0 else now_ms * 1000 + (i % 7) * 1_000_000 - 3_000_000 + i)
    return values, stamps


def test_the_real_time_decode_and_rules_give_the_speed_jobs_verdicts_and_values(
    spark, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = write_kinds(Settings(registry={"url": REGISTRY}), tmp_path, "kinds")
    pipeline = configured_pipeline("kinds", settings)
    schemas = {1: json.dumps(SCHEMA_V1), 2: json.dumps(SCHEMA_V2)}

    def fetch(schema_id: int) -> str:
        if schema_id not in schemas:
            raise SchemaIdNotFound(f"schema id {schema_id} is not in the registry")
        return schemas[schema_id]

    monkeypatch.setitem(decode._FETCHERS, REGISTRY, fetch)
    now_ms = int(time.time() * 1000)
    values, stamps = _records(now_ms)
    n = len(values)
    source = pa.table({
        "key": pa.array([b"k"] * n), "value": pa.array(values, pa.binary()), "topic": ["kinds"] * n,
        "partition": pa.array([i % 2 for i in range(n)], pa.int32()),
        "offset": pa.array(range(n), pa.int64()),
        "timestamp": pa.array(stamps, pa.timestamp("us", tz="UTC")),
        "timestampType": pa.array([1] * n, pa.int32()),
    })  # fmt: skip

    # The definition: the speed job's decode, rules and reasons.
    spec = decode.DecodeSpec.of(pipeline, settings)
    python = pa.Table.from_batches(list(decode.decoder(spec)(iter(source.to_batches()))))
    passed = [rule is None for rule in python.column("_error_rule").to_pylist()]
    assert 0.5 * n < sum(passed) < 0.95 * n, sum(passed)  # both verdicts are well represented
    assert {r.split(".")[-1] for r in python.column("_error_rule").to_pylist() if r} >= {
        "required",
        "range",
        "allowed",
        "not_future",
        "avro",
        "wire_format",
        "no_timestamp",
    }

    # Spark's expressions over the same records, as a bounded frame (the streaming query's plan).
    df = spark.createDataFrame(source.to_pandas())
    events, ok = decoded_records(
        df, pipeline, writers={1: schemas[1], 2: schemas[2]}, missing=frozenset({7, -7})
    )
    targets = latest_targets(pipeline)
    got = events.select(
        F.col("_offset"), ok.alias("ok"), F.col("_unknown"),
        *[t.candidate(events, pipeline).alias(t.view.name) for t in targets],
    ).orderBy("_offset").toArrow()  # fmt: skip
    assert got.column("ok").to_pylist() == passed
    assert got.column("_unknown").null_count == n  # every id is known or known to be missing
    # Ids neither known nor missing are named, as the header holds them (framed values only).
    unknown, _ = decoded_records(df, pipeline, writers={1: schemas[1]})
    named = unknown.select("_offset", "_unknown").orderBy("_offset").toArrow().column("_unknown")
    header = [
        int.from_bytes(v[1:5], "big", signed=True) if len(v) >= 5 and v[0] == 0 else None for v in values
    ]
    assert named.to_pylist() == [None if i in (1, None) else i for i in header]
    assert {7, -7, 2} <= set(named.to_pylist())

    valid = python.filter(pa.array(passed))
    for target in targets:
        table = target.table
        where = pipeline.view_filter(target.view)
        kept = valid.filter(arrow_expression(where, valid.schema)) if where is not None else valid
        offsets = set(kept.column("_offset").to_pylist())
        spark_rows = [
            (o, row) for o, ok_, row in zip(
                got.column("_offset").to_pylist(), got.column("ok").to_pylist(),
                got.column(target.view.name).to_pylist(), strict=True,
            ) if ok_ and row is not None
        ]  # fmt: skip
        assert {o for o, _ in spark_rows} == offsets, target.view.name
        want = {}
        for r in kept.to_pylist():
            version = r[target.view.version]
            if isinstance(version, datetime):
                version = _micros(version)
            r[RANK] = latest_rank(-(1 << 63) - 1 if version is None else version, _seconds(r["_ingest_ts"]))
            want[r["_offset"]] = r
        for offset, row in spark_rows:
            expected = want[offset]
            for column, cql in table.columns:
                mine, theirs = row[column], expected.get(column)
                if cql == "timestamp":
                    mine = None if mine is None else _micros(mine) // 1000
                    theirs = _millis(theirs)
                elif cql == "varint":
                    mine = int(mine)
                elif cql == "decimal" and theirs is not None:
                    # The same digits and the same scale (the writer sends both).
                    assert mine.as_tuple() == theirs.as_tuple(), (offset, column, mine, theirs)
                elif theirs is not None:
                    theirs = pa.array([theirs], type=arrow_type(cql)).to_pylist()[0]
                both_nan = isinstance(mine, float) and mine != mine and theirs != theirs
                assert mine == theirs or both_nan, (target.view.name, offset, column, mine, theirs)


def _micros(t: datetime) -> int:
    delta = t - datetime(1970, 1, 1, tzinfo=UTC)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def _seconds(t: datetime) -> int:
    return _micros(t) // 1_000_000


def _millis(t: datetime | None) -> int | None:
    """As the micro-batch writer cuts a timestamp: microseconds divided toward zero."""
    if t is None:
        return None
    micros = _micros(t)
    return int(micros / 1000) if micros >= 0 else -((-micros) // 1000)


def test_a_rule_on_a_general_union_is_refused_by_the_real_time_path(spark, tmp_path: Path) -> None:
    settings = write_kinds(Settings(registry={"url": REGISTRY}), tmp_path, "kinds", versions=1)
    schema = json.loads((tmp_path / "schemas" / "kinds" / "v1.avsc").read_text())
    schema["fields"].append({"name": "either", "type": ["null", "long", "string"], "default": None})
    (tmp_path / "schemas" / "kinds" / "v1.avsc").write_text(json.dumps(schema))
    toml = tmp_path / "pipelines" / "kinds.toml"
    # The latest view keeps the union out (a view cannot keep one); a rule judges its value.
    text = toml.read_text().replace('version = "rev"\n', 'version = "rev"\ncolumns = ["name"]\n')
    toml.write_text(text.replace("[layers]", '[[rules]]\nkind = "required"\nfield = "either"\n\n[layers]'))
    pipeline = configured_pipeline("kinds", settings)
    df = spark.createDataFrame(
        [(b"", 0, 0, datetime.now(UTC))], "value binary, partition int, offset long, timestamp timestamp"
    )
    with pytest.raises(ConfigurationError) as refused:
        decoded_records(df, pipeline, writers={1: json.dumps(schema)})
    assert "either.required" in refused.value.message and "microbatch" in str(refused.value.fix)
