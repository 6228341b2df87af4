"""Settings a user gives: the storage root and the topic prefix."""

from __future__ import annotations

from pathlib import Path

import pytest

from lambdalake.pipeline import configured_pipeline
from lambdalake.settings import Settings


def test_relative_storage_root_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert Settings(storage_root="data/lake").storage_root == str(tmp_path / "data" / "lake")
    assert Settings(storage_root="s3://bucket/lake").storage_root == "s3://bucket/lake"


def test_topic_prefix_names_every_pipeline_topic_and_its_dlq(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAMBDALAKE_TOPIC_PREFIX", "staging.")
    pipeline = configured_pipeline("offers", Settings())
    assert (pipeline.topic.name, pipeline.topic.dlq) == ("staging.offers", "staging.offers.dlq")
    assert pipeline.schema_.subject == "offers-value"  # subjects are not prefixed
