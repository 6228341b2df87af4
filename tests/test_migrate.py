"""The stored layout's version and `lambdalake migrate`: a keyspace written by 0.1.0 (its batch
versions table with ``bronze_version``, no layout stamp) is refused by every reader, naming the fix;
migrate refuses while a writer holds a lease, then renames the column keeping every value, renames
the expectations files' key and stamps the platform tables; a second run changes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lambdalake.cassandra.active import read_meta
from lambdalake.cassandra.session import connect
from lambdalake.cassandra.stored_layout import forget
from lambdalake.cassandra.tables import BATCH_META, ensure_table
from lambdalake.errors import ConfigurationError
from lambdalake.layout import BATCH_META_TABLE, LEASES_TABLE, layout_comment
from lambdalake.settings import Settings
from tests.conftest import isolated, pipeline_named, run_cli
from tests.helpers import pipelines_folder

pytestmark = [pytest.mark.services]

#: lambdalake_batch and lambdalake_leases as 0.1.0 created them (no comment).
OLD_TABLES = (
    f"CREATE TABLE {{ks}}.{BATCH_META_TABLE} (pipeline text PRIMARY KEY, version bigint, horizon bigint, "
    "epoch_ms bigint, bronze_version bigint, views text, published_at timestamp, view_versions text, "
    "generation bigint)",
    f"CREATE TABLE {{ks}}.{LEASES_TABLE} (pipeline text, lease text, holder text, role text, host text, "
    "pid int, since timestamp, renewed timestamp, PRIMARY KEY (pipeline, lease))",
)


def old_keyspace(settings: Settings) -> None:
    session = connect(settings.cassandra)
    ks = settings.cassandra.keyspace
    session.execute(
        f"CREATE KEYSPACE {ks} WITH replication = {{'class': 'SimpleStrategy', 'replication_factor': 1}}"
    )
    for cql in OLD_TABLES:
        session.execute(cql.format(ks=ks))
    for pipeline, version, master in (("offers", 3, 41), ("telemetry", 1, 7)):
        session.execute(
            f"INSERT INTO {ks}.{BATCH_META_TABLE} (pipeline, version, horizon, epoch_ms, bronze_version, "
            "views, published_at, view_versions, generation) "
            "VALUES (%s, %s, 10, 60000, %s, '{}', toTimestamp(now()), null, 1)",
            [pipeline, version, master],
        )


def test_a_keyspace_of_0_1_is_refused_until_migrate_renames_what_it_stores(
    services: Settings, tmp_path: Path, unique: str
) -> None:
    pipelines = pipelines_folder(tmp_path, pipeline_named(services, "offers", topic=f"offers-{unique}"))
    suite = {
        "row_count_tolerance": 0.2,
        "bronze": [{"type": "expect_column_to_exist", "kwargs": {"column": "id"}}],
    }
    (pipelines / "offers.expectations.json").write_text(json.dumps(suite))
    settings = isolated(services, tmp_path, unique).model_copy(update={"pipelines_dir": pipelines})
    old_keyspace(settings)
    ks = settings.cassandra.keyspace

    # Every reader refuses it, naming the fix; the CLI says so in two lines, exit 2.
    with pytest.raises(ConfigurationError) as refused:
        read_meta(connect(settings.cassandra), ks, "offers")
    assert "0.1.0" in refused.value.message and "lambdalake migrate" in (refused.value.fix or "")
    shown = run_cli(settings, "speed", "reset", "offers", "--yes")
    text = (shown.stdout + shown.stderr).decode()
    assert shown.returncode == 2 and "lambdalake migrate" in text and "Traceback" not in text, text

    # Not while a writer holds a lease.
    session = connect(settings.cassandra)
    session.execute(
        f"INSERT INTO {ks}.{LEASES_TABLE} (pipeline, lease, holder, host) "
        "VALUES ('offers', 'speed', 'job-1', 'h1')"
    )
    busy = run_cli(settings, "migrate")
    text = (busy.stdout + busy.stderr).decode()
    assert busy.returncode == 2 and "offers/speed by job-1 on h1" in text, text
    session.execute(f"DELETE FROM {ks}.{LEASES_TABLE} WHERE pipeline = 'offers' AND lease = 'speed'")

    done = run_cli(settings, "migrate")
    text = (done.stdout + done.stderr).decode()
    assert done.returncode == 0, text
    assert "bronze_version -> master_version (2 pipeline(s))" in text and "key bronze -> master" in text, text

    fresh = connect(settings.cassandra)
    fresh.cluster.refresh_schema_metadata()
    table = fresh.cluster.metadata.keyspaces[ks].tables[BATCH_META_TABLE]
    assert "master_version" in table.columns and "bronze_version" not in table.columns
    stored = {r.pipeline: r.master_version for r in fresh.execute(f"SELECT * FROM {ks}.{BATCH_META_TABLE}")}
    assert stored == {"offers": 41, "telemetry": 7}
    meta = fresh.cluster.metadata.keyspaces[ks].tables
    assert {meta[t].options.get("comment") for t in (BATCH_META_TABLE, LEASES_TABLE)} == {layout_comment()}
    active = read_meta(fresh, ks, "offers").batch
    assert active is not None and (active.version, active.master_version) == (3, 41)
    renamed = json.loads((pipelines / "offers.expectations.json").read_text())
    assert renamed == {"row_count_tolerance": 0.2, "master": suite["bronze"]}

    again = run_cli(settings, "migrate")
    assert again.returncode == 0 and "already holds lambdalake 0.2.0" in again.stdout.decode(), again


def test_tables_are_stamped_at_creation_and_a_newer_layout_is_refused(
    services: Settings, tmp_path: Path, unique: str
) -> None:
    settings = isolated(services, tmp_path, unique)
    ks = settings.cassandra.keyspace
    session = connect(settings.cassandra)
    assert read_meta(session, ks, "offers").batch is None  # nothing there yet: no refusal
    from lambdalake.cassandra.tables import create_keyspace

    create_keyspace(session, settings.cassandra)
    ensure_table(session, ks, BATCH_META)
    assert (
        session.cluster.metadata.keyspaces[ks].tables[BATCH_META_TABLE].options["comment"] == layout_comment()
    )
    session.execute(f"ALTER TABLE {ks}.{BATCH_META_TABLE} WITH comment = '{layout_comment(3)}'")
    session.cluster.refresh_schema_metadata()
    forget(session, ks)  # as another process would: it has not checked this keyspace yet
    with pytest.raises(ConfigurationError) as refused:
        read_meta(session, ks, "offers")
    assert "newer" in refused.value.message, refused.value.message
    migrate = run_cli(settings, "migrate")
    assert migrate.returncode == 2 and "newer" in (migrate.stdout + migrate.stderr).decode()


def test_an_expectations_file_with_an_unknown_key_is_refused_naming_it(tmp_path: Path) -> None:
    from lambdalake.batch.quality import _extra

    (tmp_path / "offers.expectations.json").write_text(json.dumps({"bronze": [], "views": {}}))
    with pytest.raises(Exception) as refused:
        _extra(tmp_path, "offers")
    assert "unknown key(s) bronze" in str(refused.value) and "master" in str(refused.value.fix)
