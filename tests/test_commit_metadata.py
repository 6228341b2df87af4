"""How a commit's metadata is read back whichever writer made it (delta-rs keys, or delta-spark's
``userMetadata`` JSON)."""

from __future__ import annotations

from lambdalake.delta import commit_metadata


def test_delta_spark_user_metadata_is_merged_into_the_commit() -> None:
    entry = {"version": 3, "userMetadata": '{"lambdalake.run_id": "r1", "lambdalake.rows": "7"}'}
    merged = commit_metadata(entry)
    assert merged["lambdalake.run_id"] == "r1" and merged["lambdalake.rows"] == "7"
    assert merged["version"] == 3


def test_delta_rs_keys_are_read_as_they_are() -> None:
    entry = {"version": 1, "lambdalake.run_id": "old"}
    assert commit_metadata(entry) == entry


def test_user_metadata_that_is_not_a_json_object_is_left_alone() -> None:
    for text in ("not json", "[1, 2]", ""):
        entry = {"version": 2, "userMetadata": text}
        assert commit_metadata(entry) == entry
