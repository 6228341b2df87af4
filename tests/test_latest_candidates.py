"""A ``latest`` speed table on a real Cassandra keeps the rule's winner whole, whatever micro-batches,
tasks and write order the deliveries came in: two deliveries of one version in one ingest second (one
rank) are two candidates, never one row of mixed cells; the first by (partition, offset) is served.
A speed table of the layout before (one row per key, its rank the write timestamp) is adopted."""

from __future__ import annotations

import itertools
import json
import random
from datetime import UTC, datetime

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lambdalake.cassandra.legacy_latest import adopt_legacy_latest
from lambdalake.cassandra.session import connect
from lambdalake.cassandra.tables import deploy_speed_tables, speed_table_def
from lambdalake.cassandra.writer import upsert_arrow
from lambdalake.pipeline import configured_pipeline
from lambdalake.settings import Settings
from lambdalake.views import NULL_VERSION, latest_rank, legacy_latest_table
from serving import ServingClient
from speed.sinks import latest_order, winners
from tests.conftest import isolated
from tests.test_latest_rule import BASE_S, SCHEMA, TOML, _table

pytestmark = pytest.mark.services

COLUMNS = ["device", "level", "note", "rev", "id"]


@pytest.fixture(scope="module")
def readings(services: Settings, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """The readings pipeline (tests/test_latest_rule.py) with a keyspace of its own, tables made."""
    root = tmp_path_factory.mktemp("candidates")
    (root / "pipelines").mkdir()
    (root / "schemas").mkdir()
    (root / "schemas" / "readings.avsc").write_text(json.dumps(SCHEMA))
    (root / "pipelines" / "readings.toml").write_text(TOML)
    base = isolated(services, root, random.Random().randbytes(4).hex())
    out = base.model_copy(update={"pipelines_dir": root / "pipelines", "schemas_dir": root / "schemas"})
    deploy_speed_tables(connect(out.cassandra), out.cassandra, configured_pipeline("readings", out))
    return out


def _reference(rows: list[dict]) -> dict[str, dict]:
    """The rule, written out plainly: per device the highest version (null lowest), then the earliest
    ingest second, then the lowest partition, then offset."""
    best: dict[str, tuple] = {}
    for r in rows:
        version = NULL_VERSION if r["rev"] is None else r["rev"]
        order = (-version, r["_second"], r["_partition"], r["_offset"])
        if r["device"] not in best or order < best[r["device"]][0]:
            best[r["device"]] = (order, r)
    return {d: {c: r[c] for c in COLUMNS} for d, (_, r) in best.items()}


_counter = itertools.count()


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    drawn=st.lists(
        st.tuples(
            st.sampled_from(["a", "b"]),  # device: few, so keys collide
            st.none() | st.integers(0, 1),  # rev: few values, so versions tie
            st.integers(0, 1),  # ingest second: few, so ranks tie
            st.integers(0, 2),  # Kafka partition: ties across tasks
            st.none() | st.integers(-3, 3),  # level
            st.sampled_from(["x", "y", "z"]),  # note
        ),
        min_size=1,
        max_size=14,
    ),
    cuts=st.lists(st.integers(0, 20), max_size=3),
    order_seed=st.integers(0, 1000),
)
def test_tied_deliveries_across_micro_batches_and_tasks_keep_one_whole_winner(
    readings: Settings, drawn: list[tuple], cuts: list[int], order_seed: int
) -> None:
    pipeline = configured_pipeline("readings", readings)
    view = pipeline.views[0]
    table = speed_table_def(pipeline, view)
    run = next(_counter)
    offsets = [0, 0, 0]
    rows = []
    for i, (device, rev, second, part, level, note) in enumerate(sorted(drawn, key=lambda d: d[2])):
        rows.append({
            "device": f"{device}-{run}", "rev": rev, "level": level, "note": note, "id": f"e{i}",
            "_ingest_ts": datetime.fromtimestamp(BASE_S + second + i / 1000, UTC), "_second": second,
            "_offset": offsets[part], "_partition": part, "_epoch": 0,
        })  # fmt: skip
        offsets[part] += 1
    # Tasks: each partition's records cut into micro-batches; written in any order (a retried
    # micro-batch, tasks racing), each writing its winners as the speed job's sink does.
    tasks = []
    for part in range(3):
        mine = [r for r in rows if r["_partition"] == part]
        bounds = [0, *sorted({c % (len(mine) + 1) for c in cuts}), len(mine)]
        tasks += [mine[lo:hi] for lo, hi in itertools.pairwise(bounds) if hi > lo]
    random.Random(order_seed).shuffle(tasks)
    for task in tasks:
        data = _table(task)
        order = latest_order(data, "rev")
        best = winners([(d,) for d in data.column("device").to_pylist()], order)
        upsert_arrow(
            data.take(pa.array(best, pa.int64())), table=table, settings=readings.cassandra,
            write_timestamps=pa.array(order.data[best]),
        )  # fmt: skip
    client = ServingClient(settings=readings, meta_ttl_s=0)
    want = _reference(rows)
    got = {}
    for device in want:
        answer = client.query("readings", view.name, device).latest
        assert answer is not None, device
        got[device] = {c: answer.values.get(c) for c in COLUMNS}
    assert got == want


def test_an_old_layout_speed_table_is_adopted_with_its_ranks(readings: Settings) -> None:
    """Rows of the table before ranked candidates (rank = write timestamp) answer as before once
    adopted; a higher-ranked delivery written after still wins, a lower one does not; the old table
    is dropped only when asked."""
    pipeline = configured_pipeline("readings", readings)
    view = pipeline.views[0]
    ks = readings.cassandra.keyspace
    session = connect(readings.cassandra)
    old = legacy_latest_table(pipeline, view)
    session.execute(
        f'CREATE TABLE "{ks}"."{old}" (device text PRIMARY KEY, level int, note text, rev bigint, id text, '
        '"_ingest_ts" timestamp, "_epoch" bigint)'
    )
    at = datetime.fromtimestamp(BASE_S, UTC)
    for device, rev in (("old-1", 5), ("old-2", None), ("old-3", 2)):
        rank = latest_rank(NULL_VERSION if rev is None else rev, BASE_S)
        session.execute(
            f'INSERT INTO "{ks}"."{old}" (device, level, note, rev, id, "_ingest_ts", "_epoch") '
            f"VALUES (%s, 1, 'kept', %s, 'o', %s, 0) USING TIMESTAMP {rank}",
            [device, rev, at],
        )
    session.cluster.refresh_schema_metadata()
    assert adopt_legacy_latest(session, readings.cassandra, pipeline, drop=False) == {old: 3}
    table = speed_table_def(pipeline, view)
    later = [
        {"device": "old-1", "rev": 4, "level": 9, "note": "lower version", "id": "n1"},
        {"device": "old-3", "rev": 3, "level": 9, "note": "higher version", "id": "n3"},
    ]
    at_5 = datetime.fromtimestamp(BASE_S + 5, UTC)
    data = _table([
        {**r, "_ingest_ts": at_5, "_offset": i, "_partition": 0, "_epoch": 0} for i, r in enumerate(later)
    ])  # fmt: skip
    upsert_arrow(data, table=table, settings=readings.cassandra,
                 write_timestamps=pa.array(latest_order(data, "rev").data))  # fmt: skip
    client = ServingClient(settings=readings, meta_ttl_s=0)
    keys = ("old-1", "old-2", "old-3")
    notes = {d: client.query("readings", view.name, d).latest.values["note"] for d in keys}
    assert notes == {"old-1": "kept", "old-2": "kept", "old-3": "higher version"}
    session.cluster.refresh_schema_metadata()
    assert old in session.cluster.metadata.keyspaces[ks].tables
    adopt_legacy_latest(session, readings.cassandra, pipeline, drop=True)
    session.cluster.refresh_schema_metadata()
    assert old not in session.cluster.metadata.keyspaces[ks].tables
