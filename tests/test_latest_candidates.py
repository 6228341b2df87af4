"""A ``latest`` speed table on a real Cassandra keeps the rule's winner whole, whatever micro-batches,
tasks and write order the deliveries came in, for any 64-bit version: two deliveries of one version in
one ingest second (one rank) are two candidates, never one row of mixed cells; the first by
(partition, offset) is served. Speed tables of the layouts before (one row per key, its rank the
write timestamp; candidates under a 64-bit rank) are adopted with their ranks converted."""

from __future__ import annotations

import itertools
import json
import random
from datetime import UTC, datetime

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lambdalake.cassandra.session import connect
from lambdalake.cassandra.tables import deploy_speed_tables, speed_table_def
from lambdalake.cassandra.writer import upsert_arrow
from lambdalake.latest import RANK, arrow_winners, rank_array
from lambdalake.pipeline import configured_pipeline
from lambdalake.serving import ServingClient
from lambdalake.settings import Settings
from tests.conftest import isolated
from tests.test_latest_rule import BASE_S, SCHEMA, TOML, _table, plain_rule

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


_counter = itertools.count()


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    drawn=st.lists(
        st.tuples(
            st.sampled_from(["a", "b"]),  # device: few, so keys collide
            # rev: few values, so versions tie; the ends of the 64-bit range
            st.none() | st.integers(0, 1) | st.sampled_from([-(2**63), 2**63 - 1]),
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
        best, ranks = arrow_winners(data, [(d,) for d in data.column("device").to_pylist()], "rev")
        chosen = data.take(pa.array(best, pa.int64())).append_column(RANK, rank_array(ranks))
        upsert_arrow(chosen, table=table, settings=readings.cassandra)
    client = ServingClient(settings=readings, meta_ttl_s=0)
    want = plain_rule(rows)
    got = {}
    for device in want:
        answer = client.query("readings", view.name, device).latest
        assert answer is not None, device
        got[device] = {c: answer.values.get(c) for c in COLUMNS}
    assert got == want
