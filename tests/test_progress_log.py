"""The speed job's progress log counts each micro-batch that ran once (narrow: fake query progress)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from lambdalake.speed.progress import ProgressLog


def progress(batch_id: int, rows: int, *, ran: bool, at: str) -> SimpleNamespace:
    phases = {"addBatch": 10, "triggerExecution": 20} if ran else {"latestOffset": 2, "triggerExecution": 2}
    return SimpleNamespace(
        name="p-main", id="q1", batchId=batch_id, timestamp=at, numInputRows=rows, durationMs=phases,
        sources=[], stateOperators=[],
    )  # fmt: skip


class FakeQuery:
    name, id = "p-main", "q1"

    def __init__(self) -> None:
        self.recentProgress: list[SimpleNamespace] = []

    @property
    def lastProgress(self) -> SimpleNamespace | None:
        return self.recentProgress[-1] if self.recentProgress else None


def test_an_idle_trigger_reported_under_the_next_batch_id_does_not_hide_that_batch(tmp_path: Path) -> None:
    """Measured: Spark reported an idle trigger as batch 52 with 0 rows; the batch 52 that then read
    1,939 records was not counted, and `speed status` stayed 1,939 rows short for good."""
    status = str(tmp_path / "status.json")
    log, query = ProgressLog(status), FakeQuery()
    steps = [progress(50, 959, ran=True, at="t1"), progress(51, 0, ran=True, at="t2"),
             progress(52, 0, ran=False, at="t3"), progress(52, 1939, ran=True, at="t4")]  # fmt: skip
    for step in steps:
        query.recentProgress.append(step)
        log.poll([query])  # type: ignore[list-item]
    stats = json.loads(Path(status).read_text())["p-main"]
    assert (stats["rows"], stats["batches"]) == (959 + 1939, 3)
    # A restart reads the file and goes on without counting batch 52 again.
    again = ProgressLog(status)
    query.recentProgress.append(progress(53, 5, ran=True, at="t5"))
    again.poll([query])  # type: ignore[list-item]
    assert json.loads(Path(status).read_text())["p-main"]["rows"] == 959 + 1939 + 5


def test_batches_finished_between_two_polls_are_all_counted(tmp_path: Path) -> None:
    status = str(tmp_path / "status.json")
    log, query = ProgressLog(status), FakeQuery()
    query.recentProgress += [
        progress(0, 10, ran=True, at="a"), progress(1, 0, ran=False, at="b"),
        progress(1, 20, ran=True, at="c"), progress(2, 30, ran=True, at="d"),
    ]  # fmt: skip
    log.poll([query])  # type: ignore[list-item]
    stats = json.loads(Path(status).read_text())["p-main"]
    assert (stats["rows"], stats["batches"], stats["last_batch"]["batch_id"]) == (60, 3, 2)
