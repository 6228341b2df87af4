"""A user's own pipeline (tests/user_pipeline.py: card payments) end to end, against the real
services: decimal sums, minima, maxima and averages exact through the speed layer, the batch layer
and serving's merge, compared with a plain-Python reference of the records read back by another
client."""

from __future__ import annotations

import copy
import os
import random
import shutil
import struct
import time
from collections import defaultdict
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from lambdalake.batch.job import BatchJob
from lambdalake.errors import ConfigurationError
from lambdalake.pipeline import Pipeline, configured_pipeline
from lambdalake.produce.producer import EventProducer
from lambdalake.serving import ServingClient
from lambdalake.settings import Settings
from lambdalake.speed.replay import Replayer, plan_replay
from lambdalake.speed.reset import reset_speed
from tests.conftest import isolated
from tests.helpers import run_speed_once
from tests.user_pipeline import (
    AMOUNT,
    SCHEMA_V1,
    STATUSES,
    WINDOW_MS,
    payments,
    read_back,
    reference,
    write_pipeline,
)

pytestmark = [pytest.mark.services, pytest.mark.slow]


def send(producer: EventProducer, records: list[dict[str, Any]]) -> None:
    outcome = producer.send_batch(records)
    assert not outcome.refused, outcome.refused[:3]
    assert producer.flush().unacknowledged == 0


def merged_problems(settings: Settings, pipeline: Pipeline, *, sums: tuple[str, ...] = ()) -> list[str]:
    """How serving's merged answers differ from the reference, value for value and type for type."""
    windowed, latest = reference(read_back(settings, pipeline.topic.name), sums=sums)
    client = ServingClient(settings=settings, meta_ttl_s=0)
    problems = []
    keys = sorted({(a, r) for a, r, _ in windowed})
    assert len(keys) >= 150, len(keys)  # nearly every one of the 160 composite keys
    for account, region in keys:
        answer = client.query("payments", "account_region_5m", [account, region])
        got = {round(w.window_start.timestamp() * 1000): w.values for w in answer.windows}
        want = {start: row for (a, r, start), row in windowed.items() if (a, r) == (account, region)}
        if set(got) != set(want):
            problems.append(f"{account},{region}: windows {sorted(got)} != {sorted(want)}")
            continue
        for start, row in want.items():
            for name, value in row.items():
                value_got = got[start][name]
                if value_got != value or type(value_got) is not type(value):
                    problems.append(f"{account},{region} {start} {name}: want {value!r}, got {value_got!r}")
    for payment_id in random.Random(3).sample(sorted(latest), 200):
        answer = client.query("payments", "payment_latest", payment_id)
        want_row = latest[payment_id]
        got_row = answer.latest.values if answer.latest else {}
        kept = pipeline.views[0].columns or ["amount", "status", "note", "attempt", "account_id", "region"]
        for name in kept:
            if got_row.get(name) != want_row[name]:
                problems.append(f"{payment_id} {name}: want {want_row[name]!r}, got {got_row.get(name)!r}")
    return problems


def test_decimal_aggregates_are_exact_through_both_layers_and_the_merge(
    services: Settings, spark, tmp_path: Path
) -> None:
    unique = os.urandom(4).hex()
    settings = write_pipeline(
        isolated(services, tmp_path, unique), tmp_path, f"payments-{unique}", [SCHEMA_V1]
    )
    pipeline = configured_pipeline("payments", settings)
    producer = EventProducer(settings=settings, pipeline=pipeline)
    first = payments(1500, seed=1)
    copies = random.Random(2).sample(first, 60)  # sent again at once: one delivery counts
    send(producer, first + copies)
    run_speed_once(settings, pipeline, spark)
    assert merged_problems(settings, pipeline) == []  # the speed layer alone

    # The batch covers the closed epochs; the next wave is merged from the speed layer on top of it.
    time.sleep(pipeline.layers.epoch_seconds + 2)
    run = BatchJob(settings=settings, pipeline=pipeline, spark=spark).run()
    assert run.outcome == "published", run
    send(producer, payments(900, seed=4, start=10_000))
    run_speed_once(settings, pipeline, spark)
    problems = merged_problems(settings, pipeline)
    assert problems == [], problems[:10]
    answer = ServingClient(settings=settings).query("payments", "account_region_5m", ["acct-00", "eu"])
    assert answer.provenance.batch_version is not None and answer.windows
    assert all(isinstance(w.values["total"], Decimal) for w in answer.windows)


def wide_amount(precision: int) -> dict[str, Any]:
    fields = [
        {**f, "type": {**f["type"], "precision": precision}} if f["name"] == "amount" else f
        for f in SCHEMA_V1["fields"]
    ]
    return {**SCHEMA_V1, "fields": fields}


def test_a_decimal_too_wide_to_sum_is_refused_when_the_pipeline_loads(tmp_path: Path) -> None:
    settings = write_pipeline(Settings(), tmp_path, "payments-x", [wide_amount(29)])
    with pytest.raises(ConfigurationError) as refused:
        configured_pipeline("payments", settings)
    text = str(refused.value)
    assert "'total'" in text and "29 digits" in text and "precision of 28 or less" in text, text
    settings = write_pipeline(Settings(), tmp_path / "ok", "payments-x", [wide_amount(28)])
    assert configured_pipeline("payments", settings).views[1].aggregates[1].fn == "sum"


def test_a_decimal_sum_beyond_its_type_fails_the_query_never_a_null(spark, tmp_path: Path) -> None:
    """A window whose sum outgrows ``decimal(p + 10, s)`` (10^10 events of the largest amount) is
    made here with amounts as wide as the sum: the view's query fails naming the overflow, where
    Spark's non-ANSI arithmetic would have stored a null."""
    from pyspark.sql import functions as F

    from lambdalake.spark.views import windowed

    pipeline = configured_pipeline("payments", write_pipeline(Settings(), tmp_path, "p-x", [SCHEMA_V1]))
    view = pipeline.views[1]
    big = Decimal("9" * 36 + ".00")
    rows = [("acct-00", "eu", big, 1_700_000_000_000), ("acct-00", "eu", big, 1_700_000_000_001)]
    df = spark.createDataFrame(rows, "account_id string, region string, amount decimal(38,2), t long")
    df = df.withColumn("paid_at", F.timestamp_millis("t"))
    with pytest.raises(Exception) as failed:
        windowed(df, pipeline, view).collect()
    assert "OVERFLOW" in str(failed.value).upper(), str(failed.value)[:500]
    one = windowed(df.limit(1), pipeline, view).collect()[0]
    assert one["total"] == big and one["largest"] == big


def v2_schema() -> dict[str, Any]:
    """v1 plus an optional ``channel`` (null by default) and a ``source`` defaulting to "card"."""
    added = [
        {"name": "channel", "type": ["null", "string"], "default": None},
        {"name": "source", "type": "string", "default": "card"},
    ]
    return {**SCHEMA_V1, "fields": [*SCHEMA_V1["fields"], *added]}


def test_a_field_added_on_a_live_pipeline_reaches_master_the_batch_and_serving(
    services: Settings, spark, tmp_path: Path
) -> None:
    """v1 events archived, then v2 (an optional ``channel``, a ``source`` with a default) registered
    while v1 producers keep sending: the master dataset's Delta schema gains both columns (seen by delta-rs),
    the batch reads the master dataset of both shapes, and every answer gives old events the defaults."""
    from deltalake import DeltaTable

    from lambdalake.layout import master_path

    unique = os.urandom(4).hex()
    base = isolated(services, tmp_path, unique)
    topic = f"payments-{unique}"
    old = write_pipeline(base, tmp_path / "v1", topic, [SCHEMA_V1])
    v1 = configured_pipeline("payments", old)
    old_producer = EventProducer(settings=old, pipeline=v1)
    wave_a = payments(600, seed=11)
    send(old_producer, wave_a)
    run_speed_once(old, v1, spark)

    new = write_pipeline(base, tmp_path / "v2", topic, [SCHEMA_V1, v2_schema()])
    v2 = configured_pipeline("payments", new)
    new_producer = EventProducer(settings=new, pipeline=v2)
    wave_b = [
        {**p, "channel": random.Random(i).choice([None, "web", "pos"]), "source": "wallet"}
        for i, p in enumerate(payments(600, seed=12, start=20_000))
    ]
    send(new_producer, wave_b)
    wave_c = payments(300, seed=13, start=40_000)  # a producer still on v1
    send(old_producer, wave_c)
    run_speed_once(new, v2, spark)

    master = DeltaTable(master_path(new.storage_root, "payments"))
    assert {"channel", "source"} <= {f.name for f in master.schema().fields}
    stored = master.to_pyarrow_table(columns=["payment_id", "channel", "source"]).to_pylist()
    by_id = {r["payment_id"]: r for r in stored}
    assert by_id[wave_b[0]["payment_id"]]["source"] == "wallet"
    assert by_id[wave_c[0]["payment_id"]]["source"] == "card"  # decoded with v2: the default
    assert by_id[wave_a[0]["payment_id"]]["source"] is None  # a v1 file: Delta has no read defaults

    time.sleep(v2.layers.epoch_seconds + 2)
    run = BatchJob(settings=new, pipeline=v2, spark=spark).run()
    assert run.outcome == "published", run
    client = ServingClient(settings=new, meta_ttl_s=0)
    for waves, channel, source in ((wave_a, None, "card"), (wave_c, None, "card")):
        for record in waves[:50]:
            if record["attempt"] != 1:
                continue
            got = client.query("payments", "payment_latest", record["payment_id"]).latest
            assert got is not None and (got.values["channel"], got.values["source"]) == (channel, source)
            assert got.values["amount"] == record["amount"]
    for record in wave_b[:50]:
        got = client.query("payments", "payment_latest", record["payment_id"]).latest
        assert got is not None and got.values["channel"] == record["channel"]
        assert got.values["source"] == "wallet"
    problems = merged_problems(new, v2)
    assert problems == [], problems[:10]

    # A replay of the whole range and a speed reset both recompute from the master dataset of both
    # shapes (in this process's session: a command's own driver JVM costs ~20 CPU-seconds, and the
    # commands have tests of their own).
    start = min(r["_ts"] for r in read_back(new, topic))
    plan = plan_replay(new, v2, from_ms=start, to_ms=int(time.time() * 1000))
    Replayer(settings=new, pipeline=v2, spark=spark).run(plan)
    assert plan.batch_epochs, plan  # the epochs a batch covers: the batch run recomputes them
    again = BatchJob(settings=new, pipeline=v2, spark=spark).run()
    assert again.outcome == "published", again
    assert merged_problems(new, v2) == []
    shutil.rmtree(Path(new.storage_root) / "checkpoints" / "payments")
    reset_speed(new, v2, spark)
    assert merged_problems(new, v2) == []
    got = client.query("payments", "payment_latest", wave_a[0]["payment_id"]).latest
    assert got is not None and got.values["source"] == "card"


def changed(schema: dict[str, Any], name: str, avro_type: Any) -> dict[str, Any]:
    fields = [{**f, "type": avro_type} if f["name"] == name else f for f in schema["fields"]]
    return {**schema, "fields": fields}


def test_changes_the_layers_cannot_apply_are_named(tmp_path: Path) -> None:
    from lambdalake.evolution import unappliable_changes

    def problems(new: dict[str, Any]) -> list[str]:
        root = tmp_path / os.urandom(3).hex()
        return unappliable_changes(
            configured_pipeline("payments", write_pipeline(Settings(), root, "p", [new])), SCHEMA_V1
        )

    assert problems(v2_schema()) == []  # fields added with defaults
    more_symbols = {
        "type": "enum",
        "name": "Status",
        "symbols": ["AUTHORIZED", "DECLINED", "SETTLED", "VOID"],
    }
    assert problems(changed(SCHEMA_V1, "status", more_symbols)) == []  # an enum symbol added
    attempt = problems(changed(SCHEMA_V1, "attempt", "long"))  # identity, version, stored int
    assert any("identity field 'attempt'" in p for p in attempt), attempt
    # The latest view keeps a promoted field beside its old values: only its identity role refuses.
    assert not any("stores 'attempt'" in p for p in attempt), attempt
    # A key column of the windowed view: a new version of it, built beside (lambdalake.view_types).
    assert problems(changed(SCHEMA_V1, "region", "bytes")) == []
    # A latest view's key is its table's primary key, and keeps no column per type.
    keyed = write_pipeline(Settings(), tmp_path / "keyed", "p", [changed(SCHEMA_V1, "region", "bytes")])
    path = keyed.pipelines_dir / "payments.toml"
    path.write_text(path.read_text().replace('key = ["payment_id"]\nversion', 'key = ["region"]\nversion'))
    region = unappliable_changes(configured_pipeline("payments", keyed), SCHEMA_V1)
    assert any("'payment_latest' is keyed by 'region', stored as Cassandra text" in p for p in region), region
    wider = {**AMOUNT, "precision": 14}  # the stored decimal column stays `decimal`
    assert problems(changed(SCHEMA_V1, "amount", wider)) == []

    # Fields no view stores: the master dataset's Parquet files must still read as the new type.
    extra = [{"name": "hits", "type": "int"}, {"name": "total", "type": "long"},
             {"name": "rate", "type": "float"}, {"name": "ref", "type": "string"}]  # fmt: skip
    before = {**SCHEMA_V1, "fields": [*SCHEMA_V1["fields"], *extra]}
    keep = ["account_id", "region", "amount", "attempt"]

    def master_problems(field: str, avro_type: Any) -> list[str]:
        root = tmp_path / os.urandom(3).hex()
        new = changed(before, field, avro_type)
        settings = write_pipeline(Settings(), root, "p", [new], latest_columns=keep)
        return unappliable_changes(configured_pipeline("payments", settings), before)

    widenings = (("hits", "long"), ("hits", "double"), ("rate", "double"), ("ref", "bytes"),
                 ("hits", "float"), ("total", "double"), ("total", "float"))  # fmt: skip
    for field, wider_type in widenings:
        assert master_problems(field, wider_type) == [], (field, wider_type)
    branch = master_problems("ref", ["string", "long"])  # a union branch added: a struct of members
    assert any("field 'ref' changes its column type from string to struct" in p for p in branch), branch


def test_deploy_refuses_a_change_the_layers_cannot_apply_before_anything_changes(
    services: Settings, tmp_path: Path
) -> None:
    from tests.conftest import run_cli

    unique = os.urandom(4).hex()
    base = isolated(services, tmp_path, unique).model_copy(update={"state_dir": tmp_path / "state"})
    topic = f"payments-{unique}"
    first = write_pipeline(base, tmp_path / "v1", topic, [SCHEMA_V1])
    done = run_cli(first, "deploy", "payments", "--no-jobs")
    assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()
    bad = changed(SCHEMA_V1, "attempt", "long")  # the registry takes int -> long
    second = write_pipeline(base, tmp_path / "v2", topic, [SCHEMA_V1, bad])
    refused = run_cli(second, "deploy", "payments", "--no-jobs")
    text = " ".join((refused.stdout + refused.stderr).decode().split())
    assert refused.returncode == 2, text
    assert "identity field 'attempt'" in text and "Nothing was deployed" in text and "fix:" in text, text
    assert "Traceback" not in text
    from confluent_kafka.schema_registry import SchemaRegistryClient

    registry = SchemaRegistryClient(base.registry.client_config())
    assert registry.get_versions(f"{topic}-value") == [1]  # v2 was not registered


def test_a_refused_deploy_records_nothing_and_the_corrected_file_deploys(
    services: Settings, tmp_path: Path
) -> None:
    """Every check runs before anything is recorded: a latest view keeping a field no Cassandra column
    holds (a date) is refused with nothing deployed, and the file corrected as the error says deploys.
    A ``fixed`` field is kept as a blob."""
    from lambdalake.cassandra.active import read_meta
    from lambdalake.cassandra.session import connect
    from tests.conftest import run_cli

    unique = os.urandom(4).hex()
    base = isolated(services, tmp_path, unique).model_copy(update={"state_dir": tmp_path / "state"})
    topic = f"payments-{unique}"
    schema = copy.deepcopy(SCHEMA_V1)
    schema["fields"] += [
        {"name": "card_bin", "type": {"type": "fixed", "name": "Bin", "size": 4}},
        {"name": "settled_on", "type": ["null", {"type": "int", "logicalType": "date"}], "default": None},
    ]
    refused = run_cli(
        write_pipeline(base, tmp_path / "bad", topic, [schema]), "deploy", "payments", "--no-jobs"
    )
    text = " ".join((refused.stdout + refused.stderr).decode().split())
    assert refused.returncode == 2 and "Traceback" not in text, text
    assert "keeps field 'settled_on'" in text and "fix: list the fields the view keeps without it" in text, (
        text
    )
    session = connect(base.cassandra)
    assert read_meta(session, base.cassandra.keyspace, "payments").registry.empty, "view versions recorded"
    keyspace = session.cluster.metadata.keyspaces.get(base.cassandra.keyspace)
    assert keyspace is None or not keyspace.tables, "tables created by a refused deploy"

    kept = [f["name"] for f in schema["fields"] if f["name"] not in ("payment_id", "settled_on")]
    fixed = write_pipeline(base, tmp_path / "good", topic, [schema], latest_columns=kept)
    done = run_cli(fixed, "deploy", "payments", "--no-jobs")
    assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()
    session.cluster.refresh_schema_metadata()
    table = session.cluster.metadata.keyspaces[base.cassandra.keyspace].tables[
        "payments__payment_latest__speed_latest"
    ]
    assert table.columns["card_bin"].cql_type == "blob" and "settled_on" not in table.columns


def test_produce_generate_works_for_a_pipeline_of_ones_own(services: Settings, tmp_path: Path) -> None:
    """`produce --generate` for a pipeline without a [generator]: records drawn from its schema and
    rules, the invalid share dead-lettered, the rest on the topic (counted by kcat)."""
    import re

    from tests.conftest import run_cli
    from tests.helpers import kcat_count

    unique = os.urandom(4).hex()
    base = isolated(services, tmp_path, unique).model_copy(update={"state_dir": tmp_path / "state"})
    topic = f"payments-{unique}"
    settings = write_pipeline(base, tmp_path, topic, [SCHEMA_V1, v2_schema()])
    done = run_cli(settings, "produce", "payments", "--generate", "2000", "--invalid", "0.05", "--seed", "7")
    text = " ".join((done.stdout + done.stderr).decode().split())
    assert done.returncode == 0, text
    acked = int(re.search(r"acknowledged ([\d,]+)", text).group(1).replace(",", ""))  # type: ignore[union-attr]
    rejected = int(re.search(r"rejected \(DLQ\) ([\d,]+)", text).group(1).replace(",", ""))  # type: ignore[union-attr]
    assert acked + rejected == 2000 and 40 <= rejected <= 200, text
    assert kcat_count(settings, topic) == acked
    assert kcat_count(settings, f"{topic}.dlq") == rejected
    records = read_back(settings, topic)
    assert all(r["account_id"] and isinstance(r["amount"], Decimal) for r in records)
    assert len({r["payment_id"] for r in records}) > 100  # many keys, some updated more than once
    now_ms = time.time() * 1000
    assert all(r["status"] in STATUSES and r["paid_at"] <= now_ms + 300_000 for r in records)
    assert all(isinstance(r["source"], str) and r["source"] for r in records)  # v2's field, generated


def test_promoted_fields_an_enum_symbol_and_a_removed_field_on_a_live_pipeline(
    services: Settings, spark, tmp_path: Path
) -> None:
    """v2 promotes ``score`` from int to long and ``rate`` from float to double (both summed by the
    windowed view), ``hits`` from int to double and ``ref`` from string to bytes (kept out of the
    views), adds the status ``REFUNDED`` and removes ``obsolete`` (it had a default): deploy accepts
    it, v1 and v2 producers both send, the batch over the master dataset of both shapes sums exactly what the
    reference does, the latest view answers the new symbol, and master dataset reads every row as v2's
    types."""
    from lambdalake.evolution import unappliable_changes
    from lambdalake.layout import master_path
    from lambdalake.spark.master import read_events
    from tests.conftest import run_cli

    obsolete = {"name": "obsolete", "type": ["null", "string"], "default": None}
    v1_extra = [{"name": "score", "type": "int"}, {"name": "rate", "type": "float"},
                {"name": "hits", "type": "int"}, {"name": "ref", "type": "string"}, obsolete]  # fmt: skip
    v1_schema = {**SCHEMA_V1, "fields": [*SCHEMA_V1["fields"], *v1_extra]}
    refunded = {"type": "enum", "name": "Status", "symbols": [*STATUSES, "REFUNDED"]}
    v2_extra = [{"name": "score", "type": "long"}, {"name": "rate", "type": "double"},
                {"name": "hits", "type": "double"}, {"name": "ref", "type": "bytes"}]  # fmt: skip
    v2_schema_ = changed({**SCHEMA_V1, "fields": [*SCHEMA_V1["fields"], *v2_extra]}, "status", refunded)
    keep = ["account_id", "region", "amount", "attempt", "status"]
    sums = ("score", "rate")
    unique = os.urandom(4).hex()
    base = isolated(services, tmp_path, unique).model_copy(update={"state_dir": tmp_path / "state"})
    topic = f"payments-{unique}"
    old = write_pipeline(base, tmp_path / "v1", topic, [v1_schema], sums=sums, latest_columns=keep)
    v1 = configured_pipeline("payments", old)
    old_producer = EventProducer(settings=old, pipeline=v1)

    def v1_fields(i: int) -> dict[str, Any]:  # rates in quarters: exact in a float and in any sum
        return {"score": i % 1000, "rate": (i % 40) / 4, "hits": i % 7, "ref": f"r{i}", "obsolete": "x"}

    send(old_producer, [{**p, **v1_fields(i)} for i, p in enumerate(payments(500, seed=21))])
    run_speed_once(old, v1, spark)

    new = write_pipeline(
        base, tmp_path / "v2", topic, [v1_schema, v2_schema_], sums=sums, latest_columns=keep
    )
    v2 = configured_pipeline("payments", new)
    assert unappliable_changes(v2, v1_schema) == []
    deployed = run_cli(new, "deploy", "payments", "--no-jobs")
    assert deployed.returncode == 0, (deployed.stdout + deployed.stderr).decode()[-3000:]
    big = [
        {**p, "score": 3_000_000_000 + i, "rate": i / 8, "hits": i / 2,
         "ref": bytes([i % 256, 0xFF]), "status": "REFUNDED" if i % 3 == 0 else p["status"]}
        for i, p in enumerate(payments(500, seed=22, start=30_000))
    ]  # fmt: skip
    send(EventProducer(settings=new, pipeline=v2), big)
    send(
        old_producer,
        [{**p, **v1_fields(i), "obsolete": "y"} for i, p in enumerate(payments(200, seed=23, start=50_000))],
    )
    run_speed_once(new, v2, spark)
    assert merged_problems(new, v2, sums=sums) == []

    time.sleep(v2.layers.epoch_seconds + 2)
    run = BatchJob(settings=new, pipeline=v2, spark=spark).run()
    assert run.outcome == "published", run
    problems = merged_problems(new, v2, sums=sums)
    assert problems == [], problems[:10]
    client = ServingClient(settings=new, meta_ttl_s=0)
    refund = next(p for p in big if p["status"] == "REFUNDED" and p["attempt"] == 1)
    got = client.query("payments", "payment_latest", refund["payment_id"]).latest
    assert got is not None and got.values["status"] == "REFUNDED"

    from deltalake import DeltaTable

    rows = read_events(spark, DeltaTable(master_path(new.storage_root, "payments")).file_uris(), v2)
    by_id = {r["payment_id"]: r for r in rows.select("payment_id", "hits", "ref", "rate").collect()}
    assert len(by_id) == 1200
    first = by_id["pay-000001"]  # a v1 event, read as v2's types
    assert (first["hits"], first["ref"], first["rate"]) == (1.0, b"r1", 0.25)
    assert (
        by_id[big[1]["payment_id"]]["ref"] == bytes([1, 0xFF]) and by_id[big[1]["payment_id"]]["hits"] == 0.5
    )


def _float32(value: float) -> float:
    """``value`` as a 32-bit float holds it (Avro's int or long to float: the nearest float)."""
    return struct.unpack("<f", struct.pack("<f", float(value)))[0]


def test_fields_a_latest_view_stores_widen_on_a_live_pipeline_and_answer_exactly(
    services: Settings, spark, tmp_path: Path
) -> None:
    """v2 widens five fields the latest view keeps: ``fee_cents`` int to long (values above 2^31
    follow), ``level`` int to double, ``tag`` string to bytes, ``points`` long to double and
    ``ratio`` int to float (both with values their new type rounds; Spark's Parquet reader reads
    neither promotion, so the batch reads those files as written and casts). Deploy accepts it on the
    live pipeline, the view keeps its name and tables (a column per type beside the old one), and
    serving answers old and new rows, from the speed layer and then from a batch, as v2's types,
    value for value."""
    from lambdalake.evolution import unappliable_changes
    from tests.conftest import run_cli

    unique = os.urandom(4).hex()
    base = isolated(services, tmp_path, unique).model_copy(update={"state_dir": tmp_path / "state"})
    topic = f"payments-{unique}"
    v1_extra = [{"name": "fee_cents", "type": "int"}, {"name": "level", "type": "int"},
                {"name": "tag", "type": "string"}, {"name": "points", "type": "long"},
                {"name": "ratio", "type": "int"}]  # fmt: skip
    v2_extra = [{"name": "fee_cents", "type": "long"}, {"name": "level", "type": "double"},
                {"name": "tag", "type": "bytes"}, {"name": "points", "type": "double"},
                {"name": "ratio", "type": "float"}]  # fmt: skip
    v1_schema = {**SCHEMA_V1, "fields": [*SCHEMA_V1["fields"], *v1_extra]}
    v2_schema = {**SCHEMA_V1, "fields": [*SCHEMA_V1["fields"], *v2_extra]}
    old = write_pipeline(base, tmp_path / "v1", topic, [v1_schema], distincts=("level",))
    done = run_cli(old, "deploy", "payments", "--no-jobs")
    assert done.returncode == 0, (done.stdout + done.stderr).decode()[-3000:]
    v1 = configured_pipeline("payments", old)
    old_producer = EventProducer(settings=old, pipeline=v1)
    first = payments(300, seed=31)
    # Above 2^53 and 2^24: the long and the int a double and a float round.
    send(old_producer, [
        {**p, "fee_cents": i * 7, "level": i % 9, "tag": f"t{i}", "points": 2**53 + 1 + 2 * i,
         "ratio": 2**24 + 1 + 2 * i}
        for i, p in enumerate(first)
    ])  # fmt: skip
    run_speed_once(old, v1, spark)

    new = write_pipeline(base, tmp_path / "v2", topic, [v1_schema, v2_schema], distincts=("level",))
    v2 = configured_pipeline("payments", new)
    assert unappliable_changes(v2, v1_schema) == []
    deployed = run_cli(new, "deploy", "payments", "--no-jobs")
    text = (deployed.stdout + deployed.stderr).decode()
    assert deployed.returncode == 0, text[-3000:]
    # Later attempts of half the first keys (they win), and keys of their own, in v2's types.
    later = [{**p, "attempt": p["attempt"] + 5} for p in first[::2]] + payments(200, seed=32, start=40_000)
    send(
        EventProducer(settings=new, pipeline=v2),
        [{**p, "fee_cents": 3_000_000_000 + i, "level": i / 4, "tag": bytes([i % 256, 0xFF]),
          "points": i / 8, "ratio": i / 3} for i, p in enumerate(later)],
    )  # fmt: skip

    def problems() -> list[str]:
        records = read_back(new, topic)
        _windowed, latest = reference(records)
        client = ServingClient(settings=new, meta_ttl_s=0)
        found = []
        # The distinct levels per cell, over first copies: an int 3 sent before the promotion and a
        # 3.0 after it are one value.
        firsts: dict[tuple, dict] = {}
        for r in sorted(records, key=lambda r: (r["_ts"], r["_partition"], r["_offset"])):
            firsts.setdefault((r["payment_id"], r["attempt"]), r)
        kinds: dict[tuple, set] = defaultdict(set)
        for r in firsts.values():
            cell = (r["account_id"], r["region"], r["paid_at"] // WINDOW_MS * WINDOW_MS)
            kinds[cell].add(float(r["level"]))
        for account, region in sorted({(a, g) for a, g, _ in kinds}):
            answer = client.query("payments", "account_region_5m", [account, region])
            for w in answer.windows:
                want = len(kinds[(account, region, round(w.window_start.timestamp() * 1000))])
                if round(w.values["level_kinds"]["estimate"]) != want:
                    found.append(f"{account},{region} {w.window_start}: {w.values['level_kinds']} != {want}")
        for payment_id, row in latest.items():
            want = {"fee_cents": row["fee_cents"], "level": float(row["level"]),
                    "tag": row["tag"].encode() if isinstance(row["tag"], str) else row["tag"],
                    "points": float(row["points"]), "ratio": _float32(row["ratio"])}  # fmt: skip
            answer = client.query("payments", "payment_latest", payment_id).latest
            got = {k: answer.values.get(k) for k in want} if answer else None
            if got != want or any(type(got[k]) is not type(v) for k, v in want.items()):
                found.append(f"{payment_id}: want {want!r}, got {got!r}")
        return found

    run_speed_once(new, v2, spark)
    assert problems() == []
    time.sleep(v2.layers.epoch_seconds + 2)
    run = BatchJob(settings=new, pipeline=v2, spark=spark).run()
    assert run.outcome == "published", run
    assert problems() == []


def test_a_repeat_just_after_a_speed_resets_start_counts_once(
    services: Settings, spark, tmp_path: Path
) -> None:
    """A payment delivered just before an epoch boundary and again just after it (within the
    deduplication window): after a ``speed reset`` whose oldest open epoch is the second one, the
    rebuilt job reads one deduplication window earlier, so the copy is known as one and the merged
    count stays 1 (the first copy counts in the epoch before, recomputed from the master dataset)."""
    import shutil

    from lambdalake.speed.reset import reset_speed

    unique = os.urandom(4).hex()
    settings = write_pipeline(
        isolated(services, tmp_path, unique), tmp_path, f"payments-{unique}", [SCHEMA_V1]
    )
    pipeline = configured_pipeline("payments", settings)
    producer = EventProducer(settings=settings, pipeline=pipeline)
    epoch_ms = pipeline.layers.epoch_ms
    send(producer, payments(600, seed=41))
    for attempt in range(3):  # the two sends must fall either side of a boundary, close together
        boundary = (int(time.time() * 1000) // epoch_ms + 2) * epoch_ms
        record = {**payments(1, seed=42 + attempt, start=900_000 + attempt)[0], "attempt": 1}
        time.sleep(max(0.0, (boundary - 1200) / 1000 - time.time()))
        send(producer, [record])
        time.sleep(max(0.0, (boundary + 300) / 1000 - time.time()))
        send(producer, [record])
        copies = [
            r for r in read_back(settings, pipeline.topic.name) if r["payment_id"] == record["payment_id"]
        ]
        first, second = sorted(r["_ts"] for r in copies)
        if first < boundary <= second and second - first < pipeline.layers.dedup_delay_seconds * 1000:
            break
    else:
        pytest.fail("could not place two copies either side of an epoch boundary")
    run_speed_once(settings, pipeline, spark)
    shutil.rmtree(Path(settings.storage_root) / "checkpoints" / "payments")
    result = reset_speed(
        settings, pipeline, spark, now_ms=boundary + pipeline.layers.grace_seconds * 1000 + 500
    )
    assert result.first_open_epoch == boundary // epoch_ms, result
    run_speed_once(settings, pipeline, spark)
    answer = ServingClient(settings=settings, meta_ttl_s=0).query(
        "payments", "account_region_5m", [record["account_id"], record["region"]]
    )
    window = record["paid_at"] // (5 * 60_000) * (5 * 60_000)
    cell = next(w for w in answer.windows if round(w.window_start.timestamp() * 1000) == window)
    windowed, _ = reference(read_back(settings, pipeline.topic.name))
    assert cell.values["payments"] == windowed[(record["account_id"], record["region"], window)]["payments"]
    assert merged_problems(settings, pipeline) == []
