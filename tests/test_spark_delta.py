"""delta-spark's writes of the tables Spark makes (``lambdalake.spark.delta``), read back by delta-rs."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
from deltalake import DeltaTable

from lambdalake.delta import commit_metadata
from lambdalake.spark.delta import write_table

NO_STATS = {"delta.dataSkippingNumIndexedCols": "0"}


def _rows(spark, n: int):
    return spark.range(n).selectExpr("id AS a", "id * 2 AS b")


def _stats_columns(table: DeltaTable) -> list[str]:
    columns = pa.table(table.get_add_actions(flatten=True)).column_names
    return [c for c in columns if c.startswith(("min.", "max."))]


def test_table_properties_are_given_to_a_new_table_and_to_one_without_them(spark, tmp_path: Path) -> None:
    fresh = str(tmp_path / "fresh")
    version = write_table(
        _rows(spark, 5), fresh, mode="overwrite", metadata={"run": "r1"}, properties=NO_STATS
    )
    table = DeltaTable(fresh)
    assert version == table.version() == 0
    assert table.metadata().configuration == NO_STATS
    assert _stats_columns(table) == []

    older = str(tmp_path / "older")
    write_table(_rows(spark, 5), older, mode="overwrite", metadata={"run": "r1"})
    assert _stats_columns(DeltaTable(older)) != []  # made with statistics, as before they were asked for
    version = write_table(
        _rows(spark, 7), older, mode="overwrite", metadata={"run": "r2"}, properties=NO_STATS
    )
    table = DeltaTable(older)
    assert table.metadata().configuration == NO_STATS
    assert _stats_columns(table) == []
    newest, before = table.history(2)
    assert version == newest["version"] == table.version()
    assert commit_metadata(newest)["run"] == "r2"
    assert "TBLPROPERTIES" in before["operation"]
    assert table.to_pyarrow_table().num_rows == 7

    # The properties held: the next write is its one commit.
    version = write_table(_rows(spark, 3), older, mode="append", metadata={"run": "r3"}, properties=NO_STATS)
    assert version == newest["version"] + 1 == DeltaTable(older).version()
    assert json.loads(DeltaTable(older).history(1)[0]["userMetadata"]) == {"run": "r3"}
