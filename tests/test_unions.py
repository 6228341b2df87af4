"""A pipeline that declares a general union (a field of several types): producers send its plain
values (JSON lines, dicts) or its Arrow shape (a struct of one member per branch but null, as Spark's
Avro reader shapes it), a value of no branch goes to the DLQ with its reason, the speed job decodes
it columnar into the master dataset, where any Delta reader sees the struct, and the views over the other
fields are built by both layers."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from lambdalake.batch.job import BatchJob
from lambdalake.cassandra.session import connect
from lambdalake.cassandra.tables import speed_table_def
from lambdalake.errors import ConfigurationError
from lambdalake.layout import master_path
from lambdalake.pipeline import configured_pipeline
from lambdalake.produce.producer import EventProducer
from lambdalake.settings import Settings
from lambdalake.speed.job import SpeedJob
from lambdalake.speed.supervisor import Supervisor
from lambdalake.views import speed_table
from tests.conftest import isolated
from tests.helpers import consume_all, offers_with_field
from tests.test_batch import wait_for_epoch_end

REF = {"type": "record", "name": "Ref", "fields": [{"name": "code", "type": "string"}]}
MEMBERS = ("member0", "member1", "member2")


def union_pipeline(settings: Settings, tmp_path: Path, unique: str, *, columns: bool = True) -> Settings:
    """The offers pipeline under another name, its reader schema v2 plus ``ref``: null, a string, a
    long or a record; the latest view keeps the fields Cassandra has a column type for."""

    def edit(text: str) -> str:
        if columns:
            kept = 'columns = ["merchant_id", "price_cents", "version", "updated_at"]'
            text = text.replace('version = "version"\n', f'version = "version"\n{kept}\n', 1)
        # Short epochs, so that the batch layer can cover the test's events after a few seconds.
        text = text.replace('epoch = "1 hour"', 'epoch = "10 seconds"')
        return text.replace('dedup_delay = "10 minutes"', 'dedup_delay = "3 seconds"\ngrace = "1 second"')

    field = {"name": "ref", "type": ["null", "string", "long", REF], "default": None}
    return offers_with_field(
        settings, tmp_path, name="offers_union", topic=f"offers-union-{unique}", field=field, edit=edit
    )


def offer(i: int, ref: object, updated_at: int) -> dict[str, object]:
    return {
        "offer_id": f"u-{i}", "merchant_id": f"m-{i % 2}", "title": "a lamp", "price_cents": 1000 + i,
        "currency": "EUR", "stock": 3, "status": "active", "version": 1, "updated_at": updated_at,
        "promo_code": None, "ref": ref,
    }  # fmt: skip


def members(**set_: object) -> dict[str, object]:
    return {m: set_.get(m) for m in MEMBERS}


def test_a_general_union_goes_from_producers_to_master_and_both_layers(
    services: Settings, spark, tmp_path: Path
) -> None:
    unique = os.urandom(4).hex()
    settings = union_pipeline(isolated(services, tmp_path, unique), tmp_path, unique)
    pipeline = configured_pipeline("offers_union", settings)
    now_ms = int(time.time() * 1000)
    producer = EventProducer(settings=settings, pipeline=pipeline)

    # JSON lines and dicts hold plain values: the branch is the first the value is valid for.
    sent_json = {0: None, 1: "abc", 2: 42, 3: {"code": "x"}, 4: 1.5, 5: True}
    lines = [json.dumps(offer(i, v, now_ms)).encode() + b"\n" for i, v in sent_json.items()]
    outcome = producer.send_json_lines(lines)
    assert sorted(i for i, _ in outcome.refused) == [4, 5]  # a float and a boolean: no branch
    assert all(r.rule == "schema" and "ref" in r.reason for _, r in outcome.refused)
    outcome = producer.send_batch([offer(6, "dict", now_ms), offer(7, 7, now_ms)])
    assert outcome.accepted == 2

    # An Arrow table holds the union's shape: the member set names the branch.
    shape = pa.struct([("member0", pa.string()), ("member1", pa.int64()),
                       ("member2", pa.struct([("code", pa.string())]))])  # fmt: skip
    rows = [offer(8, members(member2={"code": "y"}), now_ms), offer(9, members(member1=-3), now_ms),
            offer(10, None, now_ms), offer(11, members(member0="s", member1=1), now_ms)]  # fmt: skip
    table = pa.Table.from_pylist(rows).set_column(10, "ref", pa.array([r["ref"] for r in rows], shape))
    outcome = producer.send_batch(table)
    assert [i for i, _ in outcome.refused] == [3]  # two members set: no single branch
    assert producer.flush().unacknowledged == 0
    assert len(consume_all(settings, pipeline.topic.dlq)) == 3

    want = {
        "u-0": None, "u-1": members(member0="abc"), "u-2": members(member1=42),
        "u-3": members(member2={"code": "x"}), "u-6": members(member0="dict"),
        "u-7": members(member1=7), "u-8": members(member2={"code": "y"}),
        "u-9": members(member1=-3), "u-10": None,
    }  # fmt: skip
    job = SpeedJob(settings=settings, pipeline=pipeline, spark=spark)
    job.start()
    try:
        Supervisor(job).catch_up()
        master = DeltaTable(master_path(settings.storage_root, pipeline.name)).to_pyarrow_table()
        assert master.schema.field("ref").type == shape
        offers = master.column("offer_id").to_pylist()
        assert dict(zip(offers, master.column("ref").to_pylist(), strict=True)) == want

        view = next(v for v in pipeline.views if v.kind == "latest")
        table_name = f'"{settings.cassandra.keyspace}"."{speed_table(pipeline, view)}"'
        found = connect(settings.cassandra).execute(
            f"SELECT offer_id, price_cents FROM {table_name} PER PARTITION LIMIT 1"
        )
        assert {r.offer_id: r.price_cents for r in found} == {k: 1000 + int(k[2:]) for k in want}

        # The batch layer reads the same master dataset (the union's struct included) into its views, once
        # the events' epoch has closed and a later event shows the speed job read past it.
        wait_for_epoch_end(pipeline)
        # Judged as of now: the later event's epoch is open then, however long what follows takes.
        as_of = int(time.time() * 1000)
        producer.send(offer(12, "later", as_of))
        assert producer.flush().unacknowledged == 0
        Supervisor(job).catch_up()
    finally:
        job.stop()
    run = BatchJob(settings=settings, pipeline=pipeline, spark=spark).run(as_of_ms=as_of)
    assert run.outcome == "published", run
    assert run.rows[view.name] == len(want)


def test_a_general_union_where_one_type_is_needed_is_refused_when_the_pipeline_loads(tmp_path: Path) -> None:
    """A latest view keeping every field (the default) would need a Cassandra column for the union's
    struct: the pipeline is refused when it loads, naming the view, the field and the fix."""
    settings = union_pipeline(Settings(), tmp_path, "x", columns=False)
    with pytest.raises(ConfigurationError) as refused:
        configured_pipeline("offers_union", settings)
    said = refused.value.message
    assert "view 'offer_latest' columns" in said and "'ref'" in said and "keeps such a field out" in said


def test_a_latest_view_keeping_a_record_is_refused_naming_the_field_and_the_fix(tmp_path: Path) -> None:
    """Cassandra has no column type for a record: the view's table is refused when it is defined
    (before a job reads anything), naming the view, the field and the columns to keep."""
    field = {"name": "ref", "type": ["null", REF], "default": None}
    settings = offers_with_field(Settings(), tmp_path, name="offers_ref", topic="offers-ref", field=field)
    pipeline = configured_pipeline("offers_ref", settings)
    view = next(v for v in pipeline.views if v.kind == "latest")
    with pytest.raises(ConfigurationError) as refused:
        speed_table_def(pipeline, view)
    assert "view 'offer_latest'" in refused.value.message and "field 'ref'" in refused.value.message
    assert refused.value.fix is not None and '"promo_code"]' in refused.value.fix
