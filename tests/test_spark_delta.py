"""delta-spark's writes of the tables Spark makes (``lambdalake.spark.delta``), read back by delta-rs."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from lambdalake.delta import commit_metadata
from lambdalake.spark.delta import write_table, write_tables

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


def test_writes_side_by_side_each_commit_once_and_a_failure_is_raised_after_the_others(
    spark, tmp_path: Path
) -> None:
    paths = {name: str(tmp_path / name) for name in ("a", "b", "c")}
    for path in paths.values():
        write_table(_rows(spark, 2), path, mode="overwrite", metadata={"run": "r0"})
    versions = write_tables(
        {
            name: partial(
                write_table, _rows(spark, 5 + i), path, mode="overwrite", metadata={"run": f"r1{name}"}
            )
            for i, (name, path) in enumerate(paths.items())
        }
    )
    assert versions == {name: 1 for name in paths}
    for i, (name, path) in enumerate(paths.items()):
        table = DeltaTable(path)
        assert table.version() == 1 and table.to_pyarrow_table().num_rows == 5 + i
        assert commit_metadata(table.history(1)[0])["run"] == f"r1{name}"

    def broken() -> int:
        raise ValueError("a view that cannot be written")

    with pytest.raises(ValueError, match="cannot be written"):
        write_tables(
            {
                "a": partial(
                    write_table, _rows(spark, 9), paths["a"], mode="overwrite", metadata={"run": "r2"}
                ),
                "broken": broken,
            }
        )
    # The other write ended (committed) before the failure was raised.
    assert DeltaTable(paths["a"]).version() == 2
    assert commit_metadata(DeltaTable(paths["a"]).history(1)[0])["run"] == "r2"
