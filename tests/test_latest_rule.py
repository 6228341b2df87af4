"""The latest rule, one definition in every layer: the highest version wins, a null version below all
others; between deliveries of one version the earlier ingest second, then the lower Kafka partition
and offset. The same deliveries split any way between the batch (whole epochs) and the speed layer's
micro-batches and tasks give the same whole winning row as Spark's batch over all of them, null
versions included."""

from __future__ import annotations

import itertools
import json
import os
import random
import zlib
from datetime import UTC, datetime

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lambdalake.latest import (
    TIEBREAK_BITS,
    arrow_winners,
    latest_tiebreak,
    rank,
    winner_key,
)
from lambdalake.pipeline import Pipeline, load
from lambdalake.serving.answers import LatestRow
from lambdalake.serving.merge import pick_latest

SCHEMA = {
    "type": "record", "name": "Reading", "namespace": "test.latest",
    "fields": [
        {"name": "id", "type": "string"},
        {"name": "device", "type": "string"},
        {"name": "rev", "type": ["null", "long"], "default": None},
        {"name": "level", "type": ["null", "int"], "default": None},
        {"name": "note", "type": ["null", "string"], "default": None},
        {"name": "at", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    ],
}  # fmt: skip
TOML = """name = "readings"
[topic]
name = "readings"
partitions = 3
[schema]
subject = "readings-value"
versions = ["readings.avsc"]
[event]
key = "device"
time = "at"
identity = ["device", "id"]
[[views]]
name = "current"
kind = "latest"
key = ["device"]
version = "rev"
columns = ["level", "note", "rev", "id"]
"""
BASE_S = 1_800_000_000
COLUMNS = ["device", "level", "note", "rev", "id"]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Pipeline:
    folder = tmp_path_factory.mktemp("latest-rule")
    (folder / "readings.avsc").write_text(json.dumps(SCHEMA))
    (folder / "readings.toml").write_text(TOML)
    return load(folder / "readings.toml", schemas_dir=folder)


delivery = st.tuples(
    st.sampled_from(["d1", "d2", "d3"]),  # device
    # rev: few values, so versions tie; and the ends of the 64-bit range, adjacent values beyond 2^53
    st.none() | st.integers(-2, 2) | st.sampled_from([-(2**63), 2**63 - 1, 2**60, 2**60 + 1]),
    st.integers(0, 3),  # ingest second: few, so seconds tie
    st.integers(0, 999),  # its millisecond
    st.none() | st.integers(-5, 5),  # level
    st.none() | st.sampled_from(["a", "b", ""]),  # note
)


def _table(rows: list[dict]) -> pa.Table:
    return pa.table({
        "device": pa.array([r["device"] for r in rows], pa.string()),
        "level": pa.array([r["level"] for r in rows], pa.int32()),
        "note": pa.array([r["note"] for r in rows], pa.string()),
        "rev": pa.array([r["rev"] for r in rows], pa.int64()),
        "id": pa.array([r["id"] for r in rows], pa.string()),
        "_ingest_ts": pa.array([r["_ingest_ts"] for r in rows], pa.timestamp("us", tz="UTC")),
        "_offset": pa.array([r["_offset"] for r in rows], pa.int64()),
        "_partition": pa.array([r["_partition"] for r in rows], pa.int32()),
        "_epoch": pa.array([r["_epoch"] for r in rows], pa.int64()),
    })  # fmt: skip


def _speed(rows: list[dict], cuts: list[int], shuffle: random.Random) -> dict[str, LatestRow]:
    """The speed layer: per micro-batch and partition (a task, its rows in any order) the winners
    of :func:`lambdalake.latest.arrow_winners`, kept as the candidates table keeps them (the first by
    :func:`lambdalake.latest.winner_key`; tests/test_latest_candidates.py checks that table on
    Cassandra)."""
    stored: dict[str, tuple[tuple[int, int, int], LatestRow]] = {}
    for part in range(3):
        mine = [r for r in rows if r["_partition"] == part]
        bounds = [0, *sorted({c % (len(mine) + 1) for c in cuts}), len(mine)]
        for lo, hi in itertools.pairwise(bounds):
            task = mine[lo:hi]
            if not task:
                continue
            shuffle.shuffle(task)
            table = _table(task)
            won, ranks = arrow_winners(table, [(d,) for d in table.column("device").to_pylist()], "rev")
            for i, r in zip(won, ranks, strict=True):
                row = LatestRow({c: task[i][c] for c in COLUMNS}, r, "speed")
                first = winner_key(r, part, task[i]["_offset"])
                seen = stored.get(row.values["device"])
                if seen is None or first > seen[0]:
                    stored[row.values["device"]] = (first, row)
    return {device: row for device, (_, row) in stored.items()}


def plain_rule(rows: list[dict]) -> dict[str, dict]:
    """The rule written out plainly, as an independent reference: per device the highest version (a
    null below all), then the earliest ingest second (within 2^20 s), then the lowest partition,
    then offset."""
    best: dict[str, tuple] = {}
    for r in rows:
        has, version = r["rev"] is not None, r["rev"] or 0
        second = int(r["_ingest_ts"].timestamp()) % (1 << TIEBREAK_BITS)
        order = (not has, -version, second, r["_partition"], r["_offset"])
        if r["device"] not in best or order < best[r["device"]][0]:
            best[r["device"]] = (order, r)
    return {d: {c: r[c] for c in COLUMNS} for d, (_, r) in best.items()}


@settings(
    max_examples=int(os.environ.get("LAMBDALAKE_PROPERTY_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    drawn=st.lists(delivery, min_size=1, max_size=25),
    horizon=st.integers(-1, 3),
    cuts=st.lists(st.integers(0, 30), max_size=4),
)
def test_any_split_between_batch_and_micro_batches_gives_the_same_whole_row(
    spark, pipeline: Pipeline, drawn: list[tuple], horizon: int, cuts: list[int]
) -> None:
    from lambdalake.spark.views import latest
    from lambdalake.spark.views import latest_order as spark_order

    view = pipeline.views[0]
    # Offsets follow ingest time within a partition, as the broker's append time does; deliveries
    # of one version in one ingest second may be in any partition and micro-batch.
    drawn = sorted(drawn, key=lambda d: (d[2], d[3]))
    offsets = [0, 0, 0]
    rows = []
    for i, (device, rev, second, milli, level, note) in enumerate(drawn):
        part = zlib.crc32(repr((device, rev, second, milli, i)).encode()) % 3
        rows.append({
            "device": device, "rev": rev, "level": level, "note": note, "id": f"e{i}",
            "_ingest_ts": datetime.fromtimestamp(BASE_S + second + milli / 1000, UTC),
            "_offset": offsets[part], "_partition": part, "_epoch": second, "_second": second,
        })  # fmt: skip
        offsets[part] += 1
    whole = spark.createDataFrame(_table(rows))
    want = {r["device"]: {c: r[c] for c in COLUMNS} for r in latest(whole, pipeline, view).collect()}

    assert want == plain_rule(rows), "Spark's latest against the rule written out"

    closed = [r for r in rows if r["_second"] <= horizon]
    batch: dict[str, LatestRow] = {}
    if closed:
        df = spark.createDataFrame(_table(closed))
        out = latest(df, pipeline, view)
        for r in out.withColumn("_rank", spark_order(out, view)).collect():
            assert r["_rank"] is not None, "a batch row without a rank"
            batch[r["device"]] = LatestRow({c: r[c] for c in COLUMNS}, int(r["_rank"]), "batch")
            sent = next(d for d in closed if d["id"] == r["id"])
            assert int(r["_rank"]) == rank(sent["rev"], int(sent["_ingest_ts"].timestamp())), "Spark's rank"
    speed = _speed(rows, cuts, random.Random(len(rows) + sum(cuts)))
    got = {}
    for device in set(batch) | set(speed):
        winner = pick_latest(batch.get(device), speed.get(device))
        assert winner is not None
        got[device] = winner.values
    assert got == want, (got, want)
    assert set(want) == {r["device"] for r in rows}, "a key whose versions are all null has no row"


def test_any_long_version_ranks_exactly_and_a_null_version_below_all() -> None:
    """Ranks are exact integers: adjacent versions near 2^63 order as the versions do, a null version
    ranks below -2^63, and the earlier ingest second wins between deliveries of one version."""
    assert rank(None, 0) < rank(-(2**63), 2**20 - 1) < rank(-(2**63) + 1, 0)
    assert rank(2**63 - 2, 0) < rank(2**63 - 1, 2**20 - 1)
    assert rank(2**60, 0) < rank(2**60 + 1, 0)
    assert rank(7, BASE_S) > rank(7, BASE_S + 1)
    assert latest_tiebreak(BASE_S) == (1 << TIEBREAK_BITS) - 1 - BASE_S % (1 << TIEBREAK_BITS)
