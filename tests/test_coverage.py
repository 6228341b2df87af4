"""Master dataset records the offset ranges every commit read; a coordinate is never held twice, even when two
writers commit overlapping ranges from one snapshot; how far a partition is archived is the gap-free
run of ranges, not the highest offset any commit read."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable

from lambdalake.coverage import covered_until, intersection, merged, normalized
from lambdalake.master import MasterDataset
from lambdalake.master_files import write_event_files
from lambdalake.pipeline import LayersSpec
from lambdalake.settings import Settings

LAYERS = LayersSpec(epoch="1 hour", dedup_delay="10 minutes")


def events(partition: int, offsets: range, topic: str = "t") -> pa.Table:
    n = len(offsets)
    return pa.table({
        "id": [f"e{partition}-{o}" for o in offsets],
        "event_time": pa.array([datetime(2026, 1, 1, 10, tzinfo=UTC)] * n, type=pa.timestamp("us", tz="UTC")),
        "_topic": [topic] * n,
        "_partition": pa.array([partition] * n, type=pa.int32()),
        "_offset": pa.array(list(offsets), type=pa.int64()),
    })  # fmt: skip


def run_together(n: int, work: Callable[[int], None]) -> None:
    """``work(0)`` .. ``work(n - 1)`` on threads of their own; fails with every error they raised."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def coordinates(master: MasterDataset) -> list[tuple[int, int]]:
    table = master.read()
    return sorted(
        zip(table.column("_partition").to_pylist(), table.column("_offset").to_pylist(), strict=True)
    )


@pytest.mark.parametrize(
    ("ranges", "more", "want"),
    [
        ([], [(0, 10)], [(0, 10)]),
        ([(0, 10)], [(10, 20)], [(0, 20)]),
        ([(0, 10)], [(30, 40)], [(0, 10), (30, 40)]),
        ([(0, 10), (30, 40)], [(5, 35)], [(0, 40)]),
        ([(0, 10)], [(3, 3)], [(0, 10)]),
    ],
)
def test_ranges_merge(ranges: list, more: list, want: list) -> None:
    assert merged({"t/0": ranges}, {"t/0": more}).get("t/0", []) == want


def test_gap_free_run_and_overlap() -> None:
    assert covered_until(normalized([(0, 10), (20, 30)]), 0) == 10
    assert covered_until(normalized([(0, 10), (10, 30)]), 0) == 30
    assert covered_until(normalized([(5, 10)]), 0) == 0  # offsets 0-4 were never read
    assert covered_until(normalized([(5, 10)]), 5) == 10  # the log starts at 5
    assert intersection({"t/0": [(0, 10), (20, 30)]}, {"t/0": [(5, 25)], "t/1": [(0, 5)]}) == {
        "t/0": [(5, 10), (20, 25)]
    }


def test_progress_is_the_gap_free_run_and_every_batch_records_it(tmp_path: Path) -> None:
    path = str(tmp_path / "master")
    master = MasterDataset(path, event_time="event_time")
    first = write_event_files(events(0, range(0, 100)), path=path, event_time="event_time", name="a")
    master.commit(first, app_id="speed", batch_id=0, layers=LAYERS, ranges={"t/0": [(0, 100)]}, speed=True)
    ahead = write_event_files(events(0, range(200, 300)), path=path, event_time="event_time", name="b")
    master.commit(ahead, app_id="replay", batch_id=0, layers=LAYERS, ranges={"t/0": [(200, 300)]})
    # The highest offset read is 299, but 100-199 were never read: progress stays at 99.
    assert master.read_progress(["t/0"]) == {"t/0": 99}
    assert master.read_speed_end() == {"t/0": 100}
    # A micro-batch whose records all went to the dead-letter topic writes no file, and still
    # records its range: the gap closes and the run reaches the replay's range.
    assert (
        master.commit([], app_id="speed", batch_id=1, layers=LAYERS, ranges={"t/0": [(100, 200)]}, speed=True)
        == 0
    )
    assert master.read_progress(["t/0", "t/1"]) == {"t/0": 299, "t/1": -1}
    assert master.read_speed_end() == {"t/0": 200}
    # The same batch again is skipped (exactly once per app transaction).
    assert master.commit([], app_id="speed", batch_id=1, layers=LAYERS, ranges={"t/0": [(100, 200)]}) is None


def test_the_coverage_of_a_pinned_version_is_that_version_s(tmp_path: Path) -> None:
    """A batch run pins the master dataset, and the speed job commits on: the coverage (and progress) read at
    the pinned version are that version's, not the newest (delta-rs's history() of a table loaded at an
    older version returns the newest commits)."""
    path = str(tmp_path / "master")
    master = MasterDataset(path, event_time="event_time")
    for batch_id, (start, end) in enumerate([(0, 100), (100, 200), (200, 300)]):
        files = write_event_files(
            events(0, range(start, end)), path=path, event_time="event_time", name=f"b{start}"
        )
        master.commit(files, app_id="speed", batch_id=batch_id, layers=LAYERS, ranges={"t/0": [(start, end)]})
    assert DeltaTable(path).version() == 3  # version 0 created the table
    assert master.read_coverage(version=1) == {"t/0": [(0, 100)]}
    assert master.read_coverage(version=2) == {"t/0": [(0, 200)]}
    assert master.read_progress(["t/0"], version=1) == {"t/0": 99}
    assert master.read_coverage() == {"t/0": [(0, 300)]}


def test_a_commit_leaves_out_the_coordinates_master_holds(tmp_path: Path) -> None:
    path = str(tmp_path / "master")
    master = MasterDataset(path, event_time="event_time")
    replay = write_event_files(events(0, range(50, 150)), path=path, event_time="event_time", name="replay")
    master.commit(replay, app_id="replay", batch_id=0, layers=LAYERS, ranges={"t/0": [(50, 150)]})
    speed = write_event_files(events(0, range(0, 120)), path=path, event_time="event_time", name="speed")
    speed += write_event_files(events(1, range(0, 10)), path=path, event_time="event_time", name="speed1")
    added = master.commit(
        speed, app_id="speed", batch_id=0, layers=LAYERS, ranges={"t/0": [(0, 120)], "t/1": [(0, 10)]}
    )
    assert added == 50 + 10
    assert coordinates(master) == [(0, o) for o in range(150)] + [(1, o) for o in range(10)]
    assert master.read_progress(["t/0"]) == {"t/0": 149}


def test_a_writer_decides_on_what_others_committed_since_its_last_commit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The speed job keeps one MasterDataset for its run: its next commit is decided on the newest
    snapshot (another writer's commit in between seen at once, not learnt from a conflict)."""
    path = str(tmp_path / "master")
    seed = write_event_files(events(1, range(0, 1)), path=path, event_time="event_time", name="seed")
    MasterDataset(path, event_time="event_time").commit(
        seed, app_id="seed", batch_id=0, layers=LAYERS, ranges={"t/1": [(0, 1)]}
    )
    speed = MasterDataset(path, event_time="event_time")
    first = write_event_files(events(0, range(0, 100)), path=path, event_time="event_time", name="s0")
    speed.commit(first, app_id="speed", batch_id=0, layers=LAYERS, ranges={"t/0": [(0, 100)]}, speed=True)
    replay = write_event_files(events(0, range(100, 200)), path=path, event_time="event_time", name="r")
    MasterDataset(path, event_time="event_time").commit(
        replay, app_id="replay", batch_id=0, layers=LAYERS, ranges={"t/0": [(100, 200)]}
    )
    second = write_event_files(events(0, range(100, 250)), path=path, event_time="event_time", name="s1")
    with caplog.at_level("INFO", logger="lambdalake.master"):
        added = speed.commit(
            second, app_id="speed", batch_id=1, layers=LAYERS, ranges={"t/0": [(100, 250)]}, speed=True
        )
    assert added == 50
    assert not [r for r in caplog.records if "concurrent commit" in r.getMessage()]
    assert coordinates(speed) == [(0, o) for o in range(250)] + [(1, 0)]
    assert speed.read_speed_end() == {"t/0": 250}
    # The replay's commit is not the speed job's batch 1: the same batch again is still skipped.
    again = speed.commit(second, app_id="speed", batch_id=1, layers=LAYERS, ranges={"t/0": [(100, 250)]})
    assert again is None


@pytest.mark.parametrize("commits_each", [1, 3])
def test_concurrent_writers_of_one_range_never_hold_a_coordinate_twice(
    tmp_path: Path, commits_each: int
) -> None:
    """Writers deciding on one snapshot: the commit that lands second conflicts and decides again
    (each writer keeps its MasterDataset, and so its snapshot, across its commits)."""
    path = str(tmp_path / "master")
    master = MasterDataset(path, event_time="event_time")
    seed = write_event_files(events(0, range(0, 1)), path=path, event_time="event_time", name="seed")
    master.commit(seed, app_id="seed", batch_id=0, layers=LAYERS, ranges={"t/0": [(0, 1)]})
    writers = 6
    # Writer i's batch b reads [1 + 10 * (i + b), 60 + 10 * (i + b)): every range overlaps others.
    files = {
        (i, b): write_event_files(events(0, range(1 + 10 * (i + b), 60 + 10 * (i + b))), path=path,
                                  event_time="event_time", name=f"w{i}b{b}")
        for i in range(writers) for b in range(commits_each)
    }  # fmt: skip
    barrier = threading.Barrier(writers)

    def write(i: int) -> None:
        barrier.wait()
        writer = MasterDataset(path, event_time="event_time")  # one per writer, kept across its commits
        for b in range(commits_each):
            writer.commit(
                files[(i, b)],
                app_id=f"w{i}",
                batch_id=b,
                layers=LAYERS,
                ranges={"t/0": [(1 + 10 * (i + b), 60 + 10 * (i + b))]},
            )

    run_together(writers, write)
    end = 60 + 10 * (writers - 1 + commits_each - 1)
    assert coordinates(master) == [(0, o) for o in range(end)]
    assert master.read_coverage() == {"t/0": [(0, end)]}
    assert pc.sum(pc.equal(master.read().column("_offset"), 30)).as_py() == 1


def test_a_coordinate_held_twice_is_one_delivery_in_deduplication(spark, tmp_path: Path) -> None:
    """The master dataset written before commits left held coordinates out may hold one Kafka record twice (a
    replay and the speed job archived it side by side): deduplication keeps exactly one copy of it,
    and never drops the event because its two copies ranked 1 and 2."""
    from lambdalake.delta import commit_files
    from lambdalake.pipeline import configured_pipeline
    from lambdalake.spark.views import INGEST_TS, deduplicate, read_master

    pipeline = configured_pipeline("offers", Settings())
    identity = list(pipeline.event.identity)
    base = events(0, range(0, 6))
    ingest = pa.array(
        [datetime(2026, 1, 1, 10, 0, i, tzinfo=UTC) for i in range(6)], pa.timestamp("us", tz="UTC")
    )
    rows = base.append_column(INGEST_TS, ingest)
    for name in identity:  # identities: e0-0 .. e0-5, except offsets 4 and 5 repeat offset 3's
        rows = rows.append_column(name, pa.array([f"{name}-{min(o, 3)}" for o in range(6)]))
    path = str(tmp_path / "master")
    # Offsets 0-5 in one file; offsets 2 and 3 again in a second (the same records archived twice).
    once = write_event_files(rows, path=path, event_time="event_time", name="speed")
    twice = write_event_files(rows.slice(2, 2), path=path, event_time="event_time", name="replay")
    commit_files(path, once + twice, mode="append", metadata={}, partition=("event_date", pa.date32()))
    master = read_master(spark, MasterDataset(path, event_time="event_time").file_uris())
    kept = deduplicate(master, pipeline).select("_offset").collect()
    # 0, 1 and 2 once each; 3 is the first delivery of its identity (4 and 5 repeat it), once.
    assert sorted(r[0] for r in kept) == [0, 1, 2, 3]


def test_a_snapshot_that_fails_to_refresh_after_a_commit_is_opened_again(tmp_path: Path) -> None:
    """The kept snapshot is brought up to date off the caller's path after each commit; if that
    fails, the next commit opens the table again instead of deciding on a stale snapshot."""
    path = str(tmp_path / "master")
    speed = MasterDataset(path, event_time="event_time")

    def commit(batch: int) -> int | None:
        files = write_event_files(
            events(0, range(100 * batch, 100 * batch + 100)),
            path=path,
            event_time="event_time",
            name=f"b{batch}",
        )
        return speed.commit(
            files,
            app_id="speed",
            batch_id=batch,
            layers=LAYERS,
            ranges={"t/0": [(100 * batch, 100 * batch + 100)]},
        )

    commit(0)  # creates the table
    commit(1)  # opens it, and keeps it
    kept = speed._committing
    assert kept is not None
    calls = []

    def failing_second_call() -> None:
        calls.append(1)
        if len(calls) == 2:  # the refresh after batch 2's commit
            raise OSError("the log is unreadable for a moment")
        type(kept).update_incremental(kept)

    kept.update_incremental = failing_second_call  # type: ignore[method-assign]
    assert commit(2) == 100
    other = write_event_files(events(0, range(300, 400)), path=path, event_time="event_time", name="other")
    MasterDataset(path, event_time="event_time").commit(
        other, app_id="replay", batch_id=0, layers=LAYERS, ranges={"t/0": [(300, 400)]}
    )
    assert commit(3) == 0  # the replay's commit holds batch 3's offsets: seen on the reopened table
    assert len(calls) == 2 and speed._committing is not kept
    assert coordinates(speed) == [(0, o) for o in range(400)]


def test_concurrent_writers_bringing_a_new_column_never_hold_a_coordinate_twice(tmp_path: Path) -> None:
    """Each writer's files carry a column the master dataset's schema lacks (a reader schema that gained a
    field): the commit adding it to the schema shares the writers' app transaction, so one landing after the
    writer's snapshot fails it and the writer decides again, never a data commit rebased over it."""
    path = str(tmp_path / "master")
    master = MasterDataset(path, event_time="event_time")
    seed = write_event_files(events(0, range(0, 1)), path=path, event_time="event_time", name="seed")
    master.commit(seed, app_id="seed", batch_id=0, layers=LAYERS, ranges={"t/0": [(0, 1)]})
    writers = 6
    files = {}
    for i in range(writers):
        table = events(0, range(1 + 10 * i, 60 + 10 * i))
        table = table.append_column("channel", pa.array([f"w{i}"] * table.num_rows))
        files[i] = write_event_files(table, path=path, event_time="event_time", name=f"w{i}")
    barrier = threading.Barrier(writers)

    def write(i: int) -> None:
        writer = MasterDataset(path, event_time="event_time")
        barrier.wait()
        ranges = {"t/0": [(1 + 10 * i, 60 + 10 * i)]}
        writer.commit(files[i], app_id=f"w{i}", batch_id=0, layers=LAYERS, ranges=ranges)

    run_together(writers, write)
    end = 60 + 10 * (writers - 1)
    assert coordinates(master) == [(0, o) for o in range(end)]
    assert "channel" in {f.name for f in DeltaTable(path).schema().fields}


def test_a_new_column_decided_on_a_stale_snapshot_is_decided_again(tmp_path: Path) -> None:
    """Writer A decides on its snapshot; writer B's commit of an overlapping range lands; A's files
    bring a new column. The commit adding it shares the writers' app transaction, so it fails against
    B's instead of being rebased over it (A's data commit would then land on a decision that never
    saw B's offsets): A decides again and leaves B's coordinates out."""
    path = str(tmp_path / "master")
    seed = write_event_files(events(0, range(0, 1)), path=path, event_time="event_time", name="seed")
    MasterDataset(path, event_time="event_time").commit(
        seed, app_id="seed", batch_id=0, layers=LAYERS, ranges={"t/0": [(0, 1)]}
    )
    other = write_event_files(events(0, range(1, 60)), path=path, event_time="event_time", name="b")
    wider = events(0, range(1, 80))
    mine = write_event_files(
        wider.append_column("channel", pa.array(["web"] * wider.num_rows)), path=path,
        event_time="event_time", name="a",
    )  # fmt: skip

    class Stale(MasterDataset):
        """Hands out, once, a snapshot taken before B's commit landed."""

        stale = True

        def _newest_for_commit(self):  # type: ignore[no-untyped-def]
            table = super()._newest_for_commit()
            if self.stale:
                self.stale = False
                MasterDataset(path, event_time="event_time").commit(
                    other, app_id="b", batch_id=0, layers=LAYERS, ranges={"t/0": [(1, 60)]}
                )
            return table

    writer = Stale(path, event_time="event_time")
    added = writer.commit(mine, app_id="a", batch_id=0, layers=LAYERS, ranges={"t/0": [(1, 80)]})
    assert added == 20
    assert coordinates(writer) == [(0, o) for o in range(80)]
    assert "channel" in {f.name for f in DeltaTable(path).schema().fields}
