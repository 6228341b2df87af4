"""The speed layer's bulk decoder, as a plain function over Arrow batches (schemas served from a
dict instead of the registry: the registry path is covered end to end in test_speed)."""

from __future__ import annotations

import time

import pyarrow as pa
import pytest

from lambdalake.avro import WireEncoder, parse_schema
from lambdalake.pipeline import Pipeline, configured_pipeline
from lambdalake.settings import Settings
from lambdalake.spark import decode
from lambdalake.writer_schemas import SchemaIdNotFound


@pytest.fixture
def telemetry(monkeypatch: pytest.MonkeyPatch) -> tuple[Pipeline, decode.DecodeSpec]:
    settings = Settings(registry={"url": "http://registry.invalid:1"})
    pipeline = configured_pipeline("telemetry", settings)
    schemas = {1: pipeline.schema_text(1), 2: pipeline.schema_text(2)}

    def fetch(schema_id: int) -> str:
        if schema_id not in schemas:
            raise SchemaIdNotFound(f"schema id {schema_id} is not in the registry")
        return schemas[schema_id]

    monkeypatch.setitem(decode._FETCHERS, "http://registry.invalid:1", fetch)
    return pipeline, decode.DecodeSpec.of(pipeline, settings)


def source_batch(values: list[bytes | None], ts_us: int) -> pa.RecordBatch:
    n = len(values)
    return pa.RecordBatch.from_pydict(
        {
            "key": [b"k"] * n,
            "value": pa.array(values, pa.binary()),
            "topic": ["telemetry"] * n,
            "partition": pa.array([0] * n, pa.int32()),
            "offset": pa.array(range(n), pa.int64()),
            "timestamp": pa.array([ts_us] * n, pa.timestamp("us", tz="UTC")),
            "timestampType": pa.array([0] * n, pa.int32()),
        }
    )


def test_decoder_resolves_both_versions_and_names_each_failure(telemetry: tuple) -> None:
    pipeline, spec = telemetry
    now_ms = int(time.time() * 1000)
    reading = {
        "vehicle_id": "veh-1", "event_time": now_ms - 1000, "speed_kmh": 50.0, "heading_deg": 90.0,
        "latitude": 1.0, "longitude": 2.0, "engine_state": "running", "odometer_km": 10.0,
    }  # fmt: skip
    v1 = WireEncoder(1, parse_schema(pipeline.schema_text(1)))
    v2 = WireEncoder(2, parse_schema(pipeline.schema_text(2)))
    values = [
        v1.encode(reading),
        v2.encode({**reading, "fuel_level_pct": 40.0}),
        b"not avro at all",
        v2.encode(reading)[:-3],  # truncated body
        WireEncoder(99, parse_schema(pipeline.schema_text(2))).encode({**reading, "fuel_level_pct": None}),
        v2.encode({**reading, "speed_kmh": 999.0, "fuel_level_pct": None}),
    ]
    out = pa.Table.from_batches(list(decode.decoder(spec)(iter([source_batch(values, now_ms * 1000)]))))
    rules = out.column("_error_rule").to_pylist()
    assert rules == [None, None, "wire_format", "avro", "wire_format", "speed_kmh.range"]
    reasons = out.column("_error_reason").to_pylist()
    assert "schema id 99" in reasons[4] and "schema id 2" in reasons[3]
    assert out.column("_schema_id").to_pylist() == [1, 2, 0x6F742061, 2, 99, 2]
    # Both versions decode into the reader's shape; failed rows carry nulls and their raw bytes.
    assert out.column("fuel_level_pct").to_pylist() == [None, 40.0, None, None, None, None]
    assert out.column("vehicle_id").to_pylist() == ["veh-1", "veh-1", None, None, None, None]
    assert out.column("engine_state").to_pylist()[:2] == ["running", "running"]
    assert out.column("_raw_value").to_pylist() == [None, None, *values[2:]]


def test_any_64_bit_version_decodes_as_valid(monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured before: versions beyond 2^43 (a CDC log position, nanoseconds) were dead-lettered,
    since the rank had to fit one long. The rank is exact now (lambdalake.latest): every long is valid."""
    settings = Settings(registry={"url": "http://registry.invalid:2"})
    pipeline = configured_pipeline("offers", settings)
    monkeypatch.setitem(decode._FETCHERS, "http://registry.invalid:2", lambda _id: pipeline.schema_text(2))
    spec = decode.DecodeSpec.of(pipeline, settings)
    now_ms = int(time.time() * 1000)
    offer = {
        "offer_id": "o-1", "merchant_id": "m-1", "title": "Lamp", "price_cents": 100, "currency": "EUR",
        "stock": 1, "status": "active", "version": 1, "updated_at": now_ms - 1000, "promo_code": None,
    }  # fmt: skip
    encoder = WireEncoder(2, parse_schema(pipeline.schema_text(2)))
    versions = [2**43 - 1, 2**43, 2**62, 2**63 - 1, 1]
    values = [encoder.encode({**offer, "version": v}) for v in versions]
    batch = source_batch(values, now_ms * 1000)
    out = pa.Table.from_batches(list(decode.decoder(spec)(iter([batch]))))
    assert out.column("_error_rule").to_pylist() == [None] * len(versions)
    assert out.column("version").to_pylist() == versions


def test_the_edge_takes_any_64_bit_version() -> None:
    from lambdalake.validation import RecordValidator, checked_rules

    pipeline = configured_pipeline("offers", Settings())
    schema = pipeline.reader_schema
    validator = RecordValidator(checked_rules(pipeline), schema=schema, parsed_schema=parse_schema(schema))
    offer = {
        "offer_id": "o-1", "merchant_id": "m-1", "title": "Lamp", "price_cents": 100, "currency": "EUR",
        "stock": 1, "status": "active", "version": 2**43, "updated_at": 1, "promo_code": None,
    }  # fmt: skip
    for version in (2**43, 2**62, 2**63 - 1):
        assert validator.check({**offer, "version": version}) is None
    rejection = validator.check({**offer, "version": 2**63})
    assert rejection is not None and rejection.rule == "schema", "beyond a long: the schema refuses it"


def test_millisecond_timestamps_decode_as_before_whatever_wrote_them(telemetry: tuple) -> None:
    """timestamp-millis fields are decoded as integers (no datetime per value) and cast once: the
    instants must equal what fastavro's datetimes give, also for a writer that typed the field
    timestamp-micros (decoded the usual way, converted after), and a value beyond the years fastavro
    can decode must still be refused, not crash the batch."""
    import io
    import json
    from datetime import UTC, datetime

    import fastavro

    pipeline, spec = telemetry
    now_ms = int(time.time() * 1000)
    reading = {
        "vehicle_id": "veh-1", "event_time": now_ms - 1234, "speed_kmh": 50.0, "heading_deg": 90.0,
        "latitude": 1.0, "longitude": 2.0, "engine_state": "running", "odometer_km": 10.0,
        "fuel_level_pct": None,
    }  # fmt: skip
    micros_schema = json.loads(pipeline.schema_text(2))
    for f in micros_schema["fields"]:
        if f["name"] == "event_time":
            f["type"] = {"type": "long", "logicalType": "timestamp-micros"}
    v2 = WireEncoder(2, parse_schema(pipeline.schema_text(2)))
    micros = WireEncoder(7, parse_schema(micros_schema))
    known = {7: json.dumps(micros_schema)}
    spec = decode.DecodeSpec(**{**spec.__dict__, "writer_schemas": tuple(known.items())})
    values = [
        v2.encode(reading),
        micros.encode({**reading, "event_time": (now_ms - 1234) * 1000 + 999}),
        v2.encode({**reading, "event_time": 253_402_300_800_000}),  # 10000-01-01
        v2.encode({**reading, "event_time": -2_208_988_800_000}),  # 1900-01-01: negative millis
    ]
    out = pa.Table.from_batches(list(decode.decoder(spec)(iter([source_batch(values, now_ms * 1000)]))))
    assert out.column("_error_rule").to_pylist() == [None, None, "avro", None]
    assert "event_time" in out.column("_error_reason").to_pylist()[2]
    times = out.column("event_time")
    assert times.type == pa.timestamp("us", tz="UTC")
    body = io.BytesIO(values[0][5:])
    expected = fastavro.schemaless_reader(body, parse_schema(pipeline.schema_text(2)), None)["event_time"]
    assert times.to_pylist()[0] == expected == datetime.fromtimestamp((now_ms - 1234) / 1000, UTC)
    assert times.to_pylist()[1] == expected  # the micros writer, floored to the reader's milliseconds
    assert times.to_pylist()[3] == datetime(1900, 1, 1, tzinfo=UTC)


def test_a_record_without_a_timestamp_is_dead_lettered_not_lost(telemetry: tuple) -> None:
    """No ingest epoch without the Kafka timestamp: the record goes to the DLQ with its reason."""
    pipeline, spec = telemetry
    now_ms = int(time.time() * 1000)
    reading = {
        "vehicle_id": "veh-1", "event_time": now_ms - 1000, "speed_kmh": 50.0, "heading_deg": 90.0,
        "latitude": 1.0, "longitude": 2.0, "engine_state": "running", "odometer_km": 10.0,
        "fuel_level_pct": None,
    }  # fmt: skip
    value = WireEncoder(2, parse_schema(pipeline.schema_text(2))).encode(reading)
    batch = source_batch([value, value], now_ms * 1000)
    stamps = pa.array([now_ms * 1000, None], pa.timestamp("us", tz="UTC"))
    batch = batch.set_column(batch.schema.get_field_index("timestamp"), "timestamp", stamps)
    out = pa.Table.from_batches(list(decode.decoder(spec)(iter([batch]))))
    assert out.column("_error_rule").to_pylist() == [None, "no_timestamp"]
    assert "LogAppendTime" in out.column("_error_reason").to_pylist()[1]
    assert out.column("_raw_value").to_pylist()[1] == value


@pytest.mark.parametrize("name", ["offers", "telemetry"])
def test_columnar_decode_and_checks_give_the_per_record_verdicts(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Generated records of both schema versions with invalid, truncated, re-framed and unstamped
    ones among them: each row decodes to what fastavro reads and fails with the rule the per-record
    validator names (a reference written here, record by record)."""
    import json
    import random

    from lambdalake.avro import WireDecoder, WireFormatError
    from lambdalake.produce.generator import Mix, generate
    from lambdalake.validation import RecordValidator, checked_rules

    settings = Settings(registry={"url": "http://registry.invalid:2"})
    pipeline = configured_pipeline(name, settings)
    schemas = {i: pipeline.schema_text(i) for i in range(1, len(pipeline.schema_.versions) + 1)}
    monkeypatch.setitem(decode._FETCHERS, "http://registry.invalid:2", lambda i: schemas[i])
    spec = decode.DecodeSpec.of(pipeline, settings, writer_schemas=schemas)
    now = time.time()
    rng = random.Random(4)
    encoders = {i: WireEncoder(i, parse_schema(json.loads(t))) for i, t in schemas.items()}
    writer_fields = {i: {f["name"] for f in json.loads(t)["fields"]} for i, t in schemas.items()}
    int_fields = {
        i: {f["name"] for f in json.loads(t)["fields"] if f["type"] == "int"} for i, t in schemas.items()
    }
    values, stamps = [], []
    for record in generate(name, 3000, seed=9, mix=Mix(invalid=0.0), clock=lambda: now):
        version = rng.choice(sorted(encoders))
        record = {k: v for k, v in record.items() if k in writer_fields[version]}
        if rng.random() < 0.05:  # values only the rules refuse: out of range, future, blank
            key = rng.choice(sorted(record))
            if isinstance(record[key], int | float) and not isinstance(record[key], bool):
                # An int field takes only 32-bit values (fastavro would write more, and no reader
                # could read them); a long one may be beyond the years a timestamp can hold.
                record[key] = rng.choice([-(10**9)] if int_fields[version] & {key} else [-(10**9), 2**50])
            elif isinstance(record[key], str) and key not in ("currency", "status", "engine_state"):
                record[key] = rng.choice(["", "  "])
        try:
            value = encoders[version].encode(record)
        except (TypeError, ValueError, OverflowError):
            continue
        roll = rng.random()
        if roll < 0.02:
            value = value[: rng.randrange(len(value))]
        elif roll < 0.03:
            value = b"\x01" + value[1:]
        values.append(value)
        # Around the records' time: some more than the not_future skew before them.
        stamps.append(None if rng.random() < 0.01 else int(now * 1e6) + rng.randrange(-(10**9), 10**8))
    batch = source_batch(values, 0)
    batch = batch.set_column(
        batch.schema.get_field_index("timestamp"), "timestamp", pa.array(stamps, pa.timestamp("us", tz="UTC"))
    )
    out = pa.Table.from_batches(list(decode.decoder(spec)(iter([batch]))))

    reader = json.loads(spec.reader_schema)
    wire = WireDecoder(reader, lambda i: schemas[i], millis_as_int=True)
    validator = RecordValidator(checked_rules(pipeline), schema=reader, parsed_schema=parse_schema(reader),
                                check_shape=False)  # fmt: skip
    expected_rules, expected_rows = [], []
    for value, stamp in zip(values, stamps, strict=True):
        rule, record = None, None
        if stamp is None:
            rule = "no_timestamp"
        else:
            try:
                record = wire.decode(value)
            except WireFormatError:
                rule = "wire_format"
            except Exception:
                rule = "avro"
            else:
                rejection = validator.check(record, now=stamp / 1e6)
                rule = rejection.rule if rejection else None
        expected_rules.append(rule)
        expected_rows.append(record if rule is None else None)
    assert out.column("_error_rule").to_pylist() == expected_rules
    assert 50 < sum(r is not None for r in expected_rules) < len(values) - 1000
    names = [f["name"] for f in reader["fields"]]
    millis = set(wire.millis_fields)
    got = out.select(names).to_pylist()
    for row, want in zip(got, expected_rows, strict=True):
        if want is None:
            assert all(v is None for v in row.values())
            continue
        for k in millis:  # the event carries a timestamp; the rules saw epoch milliseconds
            row[k] = None if row[k] is None else int(row[k].timestamp() * 1000)
        assert row == want
