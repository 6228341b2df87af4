"""Small files under the storage root, on a local path or a filesystem URI."""

from __future__ import annotations

from pathlib import Path

import pytest

from lambdalake.storage import list_files, read_text, write_text


@pytest.mark.parametrize("as_uri", [False, True], ids=["path", "file-uri"])
def test_write_read_and_list(tmp_path: Path, as_uri: bool) -> None:
    root = tmp_path.as_uri() if as_uri else str(tmp_path)
    assert read_text(f"{root}/status/speed-a.json") is None
    assert list_files(f"{root}/status") == []
    write_text(f"{root}/status/speed-a.json", "one")
    write_text(f"{root}/status/speed-a.json", "two")  # replaced whole
    write_text(f"{root}/status/other.json", "x")
    assert read_text(f"{root}/status/speed-a.json") == "two"
    assert list_files(f"{root}/status", prefix="speed-", suffix=".json") == [f"{root}/status/speed-a.json"]
    assert sorted(p.name for p in (tmp_path / "status").iterdir()) == ["other.json", "speed-a.json"]
