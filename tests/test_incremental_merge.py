"""The incremental merge, property-based (hypothesis) on a real Spark session: for any history of
deliveries (copies of one identity in old and new epochs, in several partitions, ties of rank within
one ingest second), the base's views with the new epochs' events merged in equal the views computed
over the whole history at once. A pipeline of the test's own (tests/user_pipeline.py: decimal sums,
minima, maxima and averages, a composite key, a latest view ranked by attempt)."""

from __future__ import annotations

import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lambdalake.batch.identities import COORDINATE, EARLIER, KNOWN, classify, identity_hashes
from lambdalake.batch.job import BatchJob
from lambdalake.batch.merge import TOUCHED, merge_latest, merge_windowed, same_columns
from lambdalake.pipeline import LatestView, Pipeline, configured_pipeline
from lambdalake.settings import Settings
from lambdalake.spark.master import master_schema
from lambdalake.spark.views import deduplicate
from tests.user_pipeline import SCHEMA_V1, STATUSES, write_pipeline

EPOCH_MS = 5_000  # the payments pipeline's epoch

delivery = st.fixed_dictionaries(
    {
        "payment": st.integers(0, 7),
        "attempt": st.integers(1, 3),
        "account": st.integers(0, 2),
        "cents": st.integers(-5_000, 99_999),
        "minute": st.integers(0, 14),
        "second": st.integers(0, 59),  # ingest second: many deliveries share one, so ranks tie
        "partition": st.integers(0, 2),
        "copy_of": st.none() | st.integers(0, 30),  # a later delivery of an earlier one's event
    }
)


@pytest.fixture(scope="module")
def payments_pipeline(tmp_path_factory: pytest.TempPathFactory) -> tuple[Settings, Pipeline]:
    root = tmp_path_factory.mktemp("merge")
    cfg = write_pipeline(Settings(), root, "payments-merge", [SCHEMA_V1])
    return cfg.model_copy(update={"storage_root": str(root / "lake")}), configured_pipeline("payments", cfg)


def deliveries_table(pipeline: Pipeline, drawn: list[dict[str, Any]]) -> pa.Table:
    """Master dataset rows of the drawn deliveries: a copy repeats its original's event (another coordinate,
    a later or equal ingest time); offsets follow ingest time in each partition (LogAppendTime)."""
    rows: list[dict[str, Any]] = []
    for d in drawn:
        source = rows[d["copy_of"]] if d["copy_of"] is not None and d["copy_of"] < len(rows) else None
        ingest_ms = 1_700_000_000_000 + d["second"] * 1000
        event = dict(source) if source is not None else {
            "payment_id": f"pay-{d['payment']}", "account_id": f"acct-{d['account']}", "region": "eu",
            "amount": Decimal(d["cents"]).scaleb(-2), "status": STATUSES[d["cents"] % 3],
            "note": None if d["cents"] % 2 else "x", "attempt": d["attempt"],
            "paid_at": 1_699_999_000_000 + d["minute"] * 60_000,
        }  # fmt: skip
        if source is not None:
            ingest_ms = max(ingest_ms, source["_ingest_ms"])
        rows.append({**event, "_partition": d["partition"], "_ingest_ms": ingest_ms})
    next_offset = [0, 0, 0]
    for row in sorted(rows, key=lambda r: r["_ingest_ms"]):
        row["_offset"] = next_offset[row["_partition"]]
        next_offset[row["_partition"]] += 1
    schema = master_schema(pipeline)
    columns: dict[str, list[Any]] = {f.name: [] for f in schema}
    for row in rows:
        for name in columns:
            if name == "_topic":
                columns[name].append("payments-merge")
            elif name == "_ingest_ts":
                columns[name].append(row["_ingest_ms"] * 1000)
            elif name == "_epoch":
                columns[name].append(row["_ingest_ms"] // EPOCH_MS)
            elif name == "_schema_id":
                columns[name].append(1)
            elif name == "paid_at":
                columns[name].append(row["paid_at"] * 1000)
            else:
                columns[name].append(row.get(name))
    return pa.table({f.name: pa.array(columns[f.name], f.type) for f in schema})


def collected(df: Any) -> list[tuple]:
    return sorted((tuple(r) for r in df.collect()), key=repr)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drawn=st.lists(delivery, min_size=1, max_size=40), cut=st.integers(0, 12))
def test_merging_new_epochs_into_the_base_equals_computing_the_whole_history(
    spark: Any, payments_pipeline: tuple[Settings, Pipeline], drawn: list[dict[str, Any]], cut: int
) -> None:
    cfg, pipeline = payments_pipeline
    job = BatchJob(settings=cfg, pipeline=pipeline, spark=spark)
    path = Path(cfg.storage_root) / f"master-{uuid.uuid4().hex}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(deliveries_table(pipeline, drawn), path)
    everything = spark.read.parquet(str(path))
    horizon = (1_700_000_000_000 + cut * 5_000) // EPOCH_MS  # base: the epochs up to it
    old = everything.filter(f"_epoch <= {horizon}")
    new = everything.filter(f"_epoch > {horizon}")
    index = deduplicate(old, pipeline)
    indexed = index.select(*identity_hashes(index, pipeline), *COORDINATE)  # as IdentityIndex writes it
    classified = classify(deduplicate(new, pipeline), indexed, pipeline, rows=len(drawn))
    # New epochs' deliveries never precede a counted copy: their ingest time is later.
    assert classified.filter(EARLIER).count() == 0
    events = classified.filter(f"not {KNOWN}").drop(KNOWN, EARLIER)
    for view in pipeline.views:
        whole = job.compute(deduplicate(everything, pipeline), view)
        base = job.compute(index, view)
        rows = job.compute(events, view)
        assert same_columns(rows, base)
        merge = merge_latest if isinstance(view, LatestView) else merge_windowed
        merged = merge(base, rows, view)  # type: ignore[arg-type]
        assert collected(merged.drop(TOUCHED)) == collected(whole), view.name
        # Every cell whose row differs from the base's is marked touched (publish writes those).
        touched = set(collected(merged.filter(TOUCHED).drop(TOUCHED)))
        assert set(collected(whole)) - set(collected(base)) <= touched <= set(collected(whole)), view.name
