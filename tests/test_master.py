"""The master dataset's files: written whole under names from their records, half-written ones cleared."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable
from deltalake.exceptions import DeltaError

from lambdalake.master import MasterDataset, write_event_files

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

    path = str(tmp_path / "bronze")
    files = write_event_files(EVENTS, path=path, event_time="event_time", name="run1-t-0-0-2")
    bronze = MasterDataset(path, event_time="event_time")
    hourly = LayersSpec(epoch="1 hour", dedup_delay="10 minutes")
    bronze.check_layers(hourly, pipeline="p")  # no table yet: nothing to compare
    progress = {"t/0": [2, 1_700_000_000_000], "t/1": [7, 1_700_000_001_000]}
    assert bronze.commit(files, app_id="a", batch_id=0, layers=hourly, partitions=progress) == 3
    bronze.check_layers(hourly, pipeline="p")
    for other in (LayersSpec(epoch="2 hours"), LayersSpec(dedup_delay="5 minutes")):
        with pytest.raises(ConfigurationError) as refused:
            bronze.check_layers(other, pipeline="p")
        assert "pipelines/p.toml" in str(refused.value)
    last = DeltaTable(path).history(1)[0]
    assert json.loads(last[PARTITIONS]) == progress
