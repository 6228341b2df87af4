"""delta-spark's writes of the tables Spark makes (``lambdalake.spark.delta``), read back by delta-rs."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

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


#: Avro's promotions (``int`` to ``long``, ``float``, ``double``; ``long`` to ``float``, ``double``;
#: ``float`` to ``double``) that Delta's type widening does not cover.
NOT_DELTA_WIDENINGS = [("bigint", "double"), ("bigint", "float"), ("int", "float")]


@pytest.mark.parametrize(("written", "promoted"), NOT_DELTA_WIDENINGS)
def test_master_stays_on_delta_rs_delta_spark_refuses_an_append_of_an_avro_promotion(
    spark, tmp_path: Path, written: str, promoted: str
) -> None:
    """Why the master dataset is not appended by Spark's Delta writer (README, "A schema that changes"): a
    pipeline whose field is promoted as Avro allows appends events with the wider column, which
    delta-spark refuses even with type widening on. When this fails, delta-spark accepts the promotion."""
    from pyspark.errors import AnalysisException

    path = str(tmp_path / "master")
    spark.createDataFrame([(1,)], f"a {written}").write.format("delta").option(
        "delta.enableTypeWidening", "true"
    ).save(path)
    assert DeltaTable(path).metadata().configuration.get("delta.enableTypeWidening") == "true"
    with pytest.raises(AnalysisException, match="DELTA_FAILED_TO_MERGE_FIELDS"):
        spark.createDataFrame([(2.5,)], f"a {promoted}").write.format("delta").mode("append").option(
            "mergeSchema", "true"
        ).save(path)


def test_master_stays_on_delta_rs_delta_spark_refuses_a_promotion_on_a_table_delta_rs_made(
    spark, tmp_path: Path
) -> None:
    """The master dataset as it is made (by delta-rs, without type widening): delta-spark refuses even ``int``
    to ``long``, the promotion Delta's type widening covers."""
    from pyspark.errors import AnalysisException

    path = str(tmp_path / "master")
    write_deltalake(path, pa.table({"a": pa.array([1, 2], pa.int32())}))
    with pytest.raises(AnalysisException, match="DELTA_FAILED_TO_MERGE_FIELDS"):
        spark.createDataFrame([(3_000_000_000,)], "a bigint").write.format("delta").mode("append").option(
            "mergeSchema", "true"
        ).save(path)
    assert DeltaTable(path).to_pyarrow_table().column("a").to_pylist() == [1, 2]


def test_master_stays_on_delta_rs_a_widened_table_locks_delta_rs_out(spark, tmp_path: Path) -> None:
    """The promotions Delta can widen (``int`` to ``long`` here) need its type-widening reader
    feature, which delta-rs refuses to read or write: the master dataset, read by delta-rs where Python runs
    without Spark, cannot have it. When this fails, delta-rs reads such a table."""
    from deltalake.exceptions import DeltaError

    path = str(tmp_path / "master")
    spark.createDataFrame([(1,)], "a int").write.format("delta").option(
        "delta.enableTypeWidening", "true"
    ).save(path)
    spark.createDataFrame([(3_000_000_000,)], "a bigint").write.format("delta").mode("append").option(
        "mergeSchema", "true"
    ).save(path)
    assert sorted(r.a for r in spark.read.format("delta").load(path).collect()) == [1, 3_000_000_000]
    assert "typeWidening" in (DeltaTable(path).protocol().reader_features or [])
    with pytest.raises(DeltaError, match="typeWidening"):
        DeltaTable(path).to_pyarrow_table()
    with pytest.raises(DeltaError, match=r"(?i)typewidening"):
        write_deltalake(path, pa.table({"a": pa.array([5], pa.int64())}), mode="append")
