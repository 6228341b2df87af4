"""A pipeline that declares a decimal field: JSON numbers and strings become exact decimals at the
edge (one of more places than the scale goes to the DLQ, never rounded), the speed job decodes them
columnar, the master dataset holds them as Parquet decimals, and the latest view stores them in Cassandra as
``decimal``: every copy equal to the value sent, digit for digit."""

from __future__ import annotations

import json
import os
from decimal import Decimal
from pathlib import Path

import pytest
from deltalake import DeltaTable

from lambdalake.cassandra.session import connect
from lambdalake.errors import ConfigurationError
from lambdalake.layout import master_path
from lambdalake.pipeline import configured_pipeline
from lambdalake.produce.producer import EventProducer
from lambdalake.serving import ServingClient
from lambdalake.settings import Settings
from lambdalake.speed.job import SpeedJob
from lambdalake.speed.supervisor import Supervisor
from lambdalake.views import speed_table
from tests.conftest import isolated
from tests.helpers import consume_all, offers_with_field

DISCOUNT = {"type": "bytes", "logicalType": "decimal", "precision": 9, "scale": 2}


def decimal_pipeline(settings: Settings, tmp_path: Path, unique: str) -> Settings:
    """The offers pipeline under another name, topic and subject, its reader schema v2 plus an
    optional decimal ``discount``."""
    field = {"name": "discount", "type": ["null", DISCOUNT], "default": None}
    return offers_with_field(settings, tmp_path, name="offers_dec", topic=f"offers-dec-{unique}", field=field)


def offer(i: int, discount: object) -> bytes:
    record = {
        "offer_id": f"dec-{i}", "merchant_id": "m-1", "title": "a lamp", "price_cents": 1000 + i,
        "currency": "EUR", "stock": 3, "status": "active", "version": 1,
        "updated_at": 1_700_000_000_000, "promo_code": None, "discount": discount,
    }  # fmt: skip
    return json.dumps(record).encode() + b"\n"


def test_a_decimal_field_is_exact_from_json_to_master_and_the_latest_view(
    services: Settings, spark, tmp_path: Path
) -> None:
    unique = os.urandom(4).hex()
    settings = decimal_pipeline(isolated(services, tmp_path, unique), tmp_path, unique)
    pipeline = configured_pipeline("offers_dec", settings)
    sent = {
        0: "12.50", 1: 0.1, 2: 7, 3: None, 4: "-9999999.99", 5: "1234567.89",
        6: "0.125",  # three places for a scale of two: refused, not rounded
        7: "12345678.9",  # ten digits for a precision of nine
    }  # fmt: skip
    producer = EventProducer(settings=settings, pipeline=pipeline)
    outcome = producer.send_json_lines([offer(i, v) for i, v in sent.items()])
    stats = producer.flush()
    assert stats.unacknowledged == 0
    assert sorted(i for i, _ in outcome.refused) == [6, 7]
    for _, rejection in outcome.refused:
        assert rejection.rule == "schema" and "at most 9 digits, 2 after the point" in rejection.reason
    assert len(consume_all(settings, pipeline.topic.dlq)) == 2

    want = {f"dec-{i}": None if v is None else Decimal(str(v)) for i, v in sent.items() if i < 6}
    job = SpeedJob(settings=settings, pipeline=pipeline, spark=spark)
    job.start()
    try:
        Supervisor(job).catch_up()
    finally:
        job.stop()

    master = DeltaTable(master_path(settings.storage_root, pipeline.name)).to_pyarrow_table()
    assert str(master.schema.field("discount").type) == "decimal128(9, 2)"
    stored = dict(
        zip(master.column("offer_id").to_pylist(), master.column("discount").to_pylist(), strict=True)
    )
    assert stored == want

    view = next(v for v in pipeline.views if v.kind == "latest")
    session = connect(settings.cassandra)
    rows = session.execute(
        f'SELECT offer_id, discount FROM "{settings.cassandra.keyspace}"."{speed_table(pipeline, view)}"'
        " PER PARTITION LIMIT 1"
    )
    assert {r.offer_id: r.discount for r in rows} == want

    # Served as read, and in JSON as the text of its exact digits (a JSON number would go through
    # a float in most readers).
    client = ServingClient(settings=settings)
    answer = client.query(pipeline.name, view.name, "dec-0")
    assert answer.latest is not None and answer.latest.values["discount"] == Decimal("12.50")
    assert json.loads(answer.to_json())["latest"]["values"]["discount"] == "12.50"
    assert answer.to_dict()["latest"]["values"]["discount"] == "12.50"


def test_a_reader_schema_without_a_column_shape_is_refused_naming_the_field(tmp_path: Path) -> None:
    """No Spark, Delta or Cassandra column holds a decimal of over 38 digits: the pipeline is refused
    when it is loaded, naming the field and the fix, not when a job meets it."""
    field_type = {"type": "bytes", "logicalType": "decimal", "precision": 40, "scale": 2}
    said = "precision of 38 or less"
    settings = decimal_pipeline(Settings(), tmp_path, "x")
    path = settings.schemas_dir / "offers_dec" / "v1.avsc"
    schema = json.loads(path.read_text())
    schema["fields"][-1] = {"name": "odd", "type": field_type}
    path.write_text(json.dumps(schema))
    with pytest.raises(ConfigurationError) as refused:
        configured_pipeline("offers_dec", settings)
    assert "field 'odd'" in refused.value.message and said in refused.value.message
