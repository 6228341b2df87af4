"""The master dataset's files: written whole under names from their records, half-written ones cleared."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable
from deltalake.exceptions import DeltaError

from lambdalake.master import MasterDataset
from lambdalake.master_files import write_event_files

EVENTS = pa.table({
    "id": ["a", "b", "c"],
    "event_time": pa.array(
        [datetime(2026, 1, 1, 10, tzinfo=UTC), datetime(2026, 1, 2, 10, tzinfo=UTC), None],
        type=pa.timestamp("us", tz="UTC"),
    ),
})  # fmt: skip


def test_one_file_per_event_date_and_an_existing_name_is_never_rewritten(tmp_path: Path) -> None:
    files = write_event_files(EVENTS, path=str(tmp_path), event_time="event_time", name="run1-t-0-0-2")
    assert sorted(files) == [
        "event_date=2026-01-01/run1-t-0-0-2.parquet",
        "event_date=2026-01-02/run1-t-0-0-2.parquet",
        "event_date=__HIVE_DEFAULT_PARTITION__/run1-t-0-0-2.parquet",
    ]
    first = {f: (tmp_path / f).stat().st_mtime_ns for f in files}
    again = write_event_files(EVENTS, path=str(tmp_path), event_time="event_time", name="run1-t-0-0-2")
    assert again == files and {f: (tmp_path / f).stat().st_mtime_ns for f in files} == first
    assert list((tmp_path / "_staging").iterdir()) == []  # every staged file was moved in


def test_clear_staging_deletes_only_the_runs_leftovers(tmp_path: Path) -> None:
    staging = tmp_path / "_staging"
    staging.mkdir()
    for name in ("run1-t-0-0-9.2026-01-01.x.parquet", "run1-t-1-0-9.2026-01-01.y.parquet",
                 "run2-t-0-0-9.2026-01-01.z.parquet"):  # fmt: skip
        (staging / name).write_bytes(b"half")
    master = MasterDataset(str(tmp_path), event_time="event_time")
    assert master.clear_staging("run1-") == 2
    assert [p.name for p in staging.iterdir()] == ["run2-t-0-0-9.2026-01-01.z.parquet"]
    assert MasterDataset(str(tmp_path / "nothing"), event_time="event_time").clear_staging("run1-") == 0


def test_clear_staging_by_age_keeps_what_may_still_be_written(tmp_path: Path) -> None:
    import os
    import time

    staging = tmp_path / "_staging"
    staging.mkdir()
    for name in ("compact-cli-a.parquet", "compact-cli-b.parquet"):
        (staging / name).write_bytes(b"half")
    two_hours_ago = time.time() - 7200
    os.utime(staging / "compact-cli-a.parquet", (two_hours_ago, two_hours_ago))
    master = MasterDataset(str(tmp_path), event_time="event_time")
    assert master.clear_staging("compact-cli-", older_than_s=3600) == 1
    assert [p.name for p in staging.iterdir()] == ["compact-cli-b.parquet"]


def test_only_a_missing_table_reads_as_empty(tmp_path: Path) -> None:
    """Measured before: any storage error (a corrupt log, a denied path) read as "no table yet"."""
    missing = MasterDataset(str(tmp_path / "none"), event_time="t")
    assert missing.file_uris() == []
    with pytest.raises(FileNotFoundError):
        missing.read()
    log = tmp_path / "broken" / "_delta_log"
    log.mkdir(parents=True)
    (log / "00000000000000000000.json").write_text("not a delta log")
    broken = MasterDataset(str(tmp_path / "broken"), event_time="t")
    with pytest.raises(DeltaError):
        broken.file_uris()
    with pytest.raises(DeltaError):
        broken.read()


def test_commits_record_layers_and_progress_and_refuse_other_layers(tmp_path: Path) -> None:
    from lambdalake.errors import ConfigurationError
    from lambdalake.master import PARTITIONS
    from lambdalake.pipeline import LayersSpec

    path = str(tmp_path / "master")
    files = write_event_files(EVENTS, path=path, event_time="event_time", name="run1-t-0-0-2")
    master = MasterDataset(path, event_time="event_time")
    hourly = LayersSpec(epoch="1 hour", dedup_delay="10 minutes")
    master.check_layers(hourly, pipeline="p")  # no table yet: nothing to compare
    progress = {"t/0": [2, 1_700_000_000_000], "t/1": [7, 1_700_000_001_000]}
    assert master.commit(files, app_id="a", batch_id=0, layers=hourly, partitions=progress) == 3
    master.check_layers(hourly, pipeline="p")
    for other in (LayersSpec(epoch="2 hours"), LayersSpec(dedup_delay="5 minutes")):
        with pytest.raises(ConfigurationError) as refused:
            master.check_layers(other, pipeline="p")
        assert "pipelines/p.toml" in str(refused.value)
    last = DeltaTable(path).history(1)[0]
    assert json.loads(last[PARTITIONS]) == progress


def _coordinates(partition: int, offsets: range) -> pa.Table:
    n = len(offsets)
    return pa.table({
        "id": [f"e{o}" for o in offsets],
        "event_time": pa.array([datetime(2026, 1, 1, 10, tzinfo=UTC)] * n, type=pa.timestamp("us", tz="UTC")),
        "_partition": pa.array([partition] * n, type=pa.int32()),
        "_offset": pa.array(list(offsets), type=pa.int64()),
    })  # fmt: skip


def test_files_holding_a_range_are_picked_by_their_offset_stats(tmp_path: Path) -> None:
    from lambdalake.delta import commit_files
    from lambdalake.master_files import offsets_present
    from lambdalake.pipeline import LayersSpec

    path = str(tmp_path / "master")
    master = MasterDataset(path, event_time="event_time")
    layers = LayersSpec(epoch="1 hour", dedup_delay="10 minutes")
    p0_low = write_event_files(_coordinates(0, range(0, 100)), path=path, event_time="event_time", name="a")
    p0_high = write_event_files(
        _coordinates(0, range(100, 200)), path=path, event_time="event_time", name="b"
    )
    p1 = write_event_files(_coordinates(1, range(0, 50)), path=path, event_time="event_time", name="c")
    master.commit(p0_low + p0_high + p1, app_id="s", batch_id=0, layers=layers)
    stats = {a["path"]: a for a in pa.table(DeltaTable(path).get_add_actions(flatten=True)).to_pylist()}
    assert [(stats[f]["min._offset"], stats[f]["max._offset"]) for f in p0_low + p0_high + p1] == [
        (0, 99), (100, 199), (0, 49),
    ]  # fmt: skip

    def names(found: list[str]) -> list[str]:
        return sorted(uri.rsplit("/", 1)[1] for uri in found)

    held = master.files_holding([(0, 50, 150), (0, 150, 300), (1, 0, 10), (2, 0, 10), (0, 200, 300)])
    assert [names(f) for f in held] == [["a.parquet", "b.parquet"], ["b.parquet"], ["c.parquet"], [], []]
    assert offsets_present(held[0], partition=0, start=95, end=105).to_pylist() == list(range(95, 105))
    assert offsets_present([], partition=0, start=0, end=10).to_pylist() == []

    # A file committed without stats (as older commits were) may hold anything: it is always read.
    old = write_event_files(_coordinates(3, range(0, 10)), path=path, event_time="event_time", name="d")
    commit_files(path, old, mode="append", metadata={}, partition=("event_date", pa.date32()))
    held = master.files_holding([(0, 150, 300), (5, 0, 1)])
    assert [names(f) for f in held] == [["b.parquet", "d.parquet"], ["d.parquet"]]
    assert offsets_present(held[1], partition=5, start=0, end=1).to_pylist() == []
