"""View tables follow the pipeline's schema versions; writes that cannot succeed fail at once."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from lambdalake.cassandra.session import connect
from lambdalake.cassandra.tables import deploy_speed_tables, speed_table_def
from lambdalake.cassandra.writer import WriteRefused, upsert
from lambdalake.pipeline import Pipeline
from lambdalake.settings import Settings
from tests.conftest import isolated, pipeline_named

pytestmark = pytest.mark.services


def test_a_new_field_is_refused_at_once_until_deploy_adds_its_column(
    services: Settings, tmp_path: Path, unique: str
) -> None:
    """Measured before: a write naming a column the table lacks was retried for 15 minutes."""
    settings = isolated(services, tmp_path, unique)
    v2 = pipeline_named(settings, "offers")
    raw = v2.model_dump(by_alias=True)
    raw["schema"]["versions"] = raw["schema"]["versions"][:1]
    v1 = Pipeline.model_validate({**raw, "schemas_dir": v2.schemas_dir})
    assert "promo_code" not in v1.reader_fields
    session = connect(settings.cassandra)
    deploy_speed_tables(session, settings.cassandra, v1)
    table = speed_table_def(v2, v2.view("offer_latest"))
    assert "promo_code" in table.column_names
    row = {
        "offer_id": "o-1", "merchant_id": "m", "title": "t", "price_cents": 1, "currency": "EUR",
        "stock": 1, "status": "active", "version": 1, "updated_at": datetime(2026, 1, 1, tzinfo=UTC),
        "promo_code": "SPRING", "_ingest_ts": datetime(2026, 1, 1, tzinfo=UTC), "_epoch": 1,
        "_latest_rank": 1 << 20, "_partition": 0, "_offset": 0,
    }  # fmt: skip
    values = [row[c] for c in table.column_names]
    ranked: dict = {}
    t0 = time.monotonic()
    with pytest.raises(WriteRefused) as refused:
        upsert([values], table=table, settings=settings.cassandra, **ranked)
    assert time.monotonic() - t0 < 30
    assert "promo_code" in str(refused.value) and "lambdalake deploy" in str(refused.value)
    deploy_speed_tables(session, settings.cassandra, v2)  # adds the column (ALTER TABLE ... ADD)
    deploy_speed_tables(session, settings.cassandra, v2)  # and again: nothing left to add
    assert upsert([values], table=table, settings=settings.cassandra, **ranked) == 1
    stored = session.execute(f'SELECT promo_code FROM "{settings.cassandra.keyspace}"."{table.name}"').one()
    assert stored.promo_code == "SPRING"


def test_a_value_of_the_wrong_type_is_refused_at_once(
    services: Settings, tmp_path: Path, unique: str
) -> None:
    settings = isolated(services, tmp_path, unique)
    pipeline = pipeline_named(settings, "offers")
    deploy_speed_tables(connect(settings.cassandra), settings.cassandra, pipeline)
    table = speed_table_def(pipeline, pipeline.view("offer_latest"))
    values = ["o-1"] + ["not a number"] * (len(table.column_names) - 1)
    with pytest.raises(WriteRefused):
        upsert([values], table=table, settings=settings.cassandra, give_up_after_s=600)


def test_speed_rows_of_windowed_views_expire_with_the_pipelines_ttl(
    services: Settings, tmp_path: Path, unique: str
) -> None:
    settings = isolated(services, tmp_path, unique)
    pipeline = pipeline_named(settings, "offers", speed_ttl="4 days")
    session = connect(settings.cassandra)
    deploy_speed_tables(session, settings.cassandra, pipeline)

    def ttl(view: str) -> int:
        name = speed_table_def(pipeline, pipeline.view(view)).name
        session.cluster.refresh_table_metadata(settings.cassandra.keyspace, name)
        options = session.cluster.metadata.keyspaces[settings.cassandra.keyspace].tables[name].options
        return int(options.get("default_time_to_live") or 0)

    assert ttl("merchant_offers_hourly") == 4 * 86400
    assert ttl("offer_latest") == 0  # a latest row stays until a higher version replaces it
    shorter = pipeline_named(settings, "offers", speed_ttl="3 days")
    deploy_speed_tables(session, settings.cassandra, shorter)  # an existing table follows the file
    assert ttl("merchant_offers_hourly") == 3 * 86400
