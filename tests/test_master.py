"""The master dataset's files: written whole under names from their records, half-written ones cleared."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest
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
