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


@pytest.fixture
def telemetry(monkeypatch: pytest.MonkeyPatch) -> tuple[Pipeline, decode.DecodeSpec]:
    settings = Settings(registry={"url": "http://registry.invalid:1"})
    pipeline = configured_pipeline("telemetry", settings)
    schemas = {1: pipeline.schema_text(1), 2: pipeline.schema_text(2)}

    def fetch(schema_id: int) -> str:
        if schema_id not in schemas:
            from confluent_kafka.schema_registry.error import SchemaRegistryError

            raise SchemaRegistryError(404, 40403, "not found")
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


def test_a_version_that_would_wrap_the_latest_rank_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured before: version 2^43 passed both the edge and the decoder, and its rank
    (version x 2^20) wrapped to a negative long, so the oldest update won."""
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
    versions = [2**43 - 1, 2**43, 2**62]
    values = [encoder.encode({**offer, "version": v}) for v in versions]
    batch = source_batch(values, now_ms * 1000)
    out = pa.Table.from_batches(list(decode.decoder(spec)(iter([batch]))))
    assert out.column("_error_rule").to_pylist() == [None, "version.latest_rank", "version.latest_rank"]
    assert "2^43" in out.column("_error_reason").to_pylist()[1]


def test_the_edge_refuses_a_version_that_would_wrap_the_rank() -> None:
    from lambdalake.validation import RecordValidator, checked_rules

    pipeline = configured_pipeline("offers", Settings())
    schema = pipeline.reader_schema
    validator = RecordValidator(checked_rules(pipeline), schema=schema, parsed_schema=parse_schema(schema))
    offer = {
        "offer_id": "o-1", "merchant_id": "m-1", "title": "Lamp", "price_cents": 100, "currency": "EUR",
        "stock": 1, "status": "active", "version": 2**43, "updated_at": 1, "promo_code": None,
    }  # fmt: skip
    rejection = validator.check(offer)
    assert rejection is not None and rejection.rule == "version.latest_rank"
    assert validator.check({**offer, "version": 2**43 - 1}) is None


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
