"""Master dataset compaction against real Delta tables: small files of one event date and Kafka partition are
rewritten into one, every row and every recorded coverage stays as it was, and a commit or another
compaction landing meanwhile never makes a row vanish or count twice."""

from __future__ import annotations

import json
import threading
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from lambdalake.compaction import OPERATION, Compaction, CompactionPolicy, Compactor, plan, vacuum
from lambdalake.master import MasterDataset
from lambdalake.master_files import write_event_files
from tests.test_coverage import LAYERS, coordinates, events

SMALL = CompactionPolicy(fan_in=3)


def master_of(
    path: Path, batches: int, *, partitions: tuple[int, ...] = (0, 1), size: int = 10
) -> MasterDataset:
    """A master dataset of one file per partition and micro-batch, as the speed job commits them."""
    master = MasterDataset(str(path), event_time="event_time")
    for i in range(batches):
        for p in partitions:
            offsets = range(i * size, (i + 1) * size)
            files = write_event_files(
                events(p, offsets), path=str(path), event_time="event_time", name=f"r-{p}-{i}"
            )
            commit(master, files, batch=i * 10 + p, ranges={f"t/{p}": [(offsets.start, offsets.stop)]})
    return master


def commit(master: MasterDataset, files: list[str], *, batch: int, ranges: dict, app: str = "speed") -> None:
    master.commit(files, app_id=app, batch_id=batch, layers=LAYERS, ranges=ranges, speed=True)


def rows(master: MasterDataset) -> list[dict]:
    return sorted(master.read().to_pylist(), key=lambda r: (r["_partition"], r["_offset"]))


def live(master: MasterDataset) -> int:
    return len(DeltaTable(master.path).file_uris())


@pytest.mark.parametrize(
    ("size", "klass"),
    [
        (0, 0),
        ((1 << 20) - 1, 0),
        (1 << 20, 1),
        (10 << 20, 2),
        ((100 << 20) - 1, 2),
        (100 << 20, 3),
        (1000 << 20, 4),
    ],
)
def test_size_classes_widen_by_the_fan_in(size: int, klass: int) -> None:
    assert CompactionPolicy(fan_in=10).size_class(size) == klass


def test_an_output_stops_growing_at_max_bytes(tmp_path: Path) -> None:
    master = master_of(tmp_path / "b", 12, partitions=(0,))
    sizes = sorted(f.stat().st_size for f in (tmp_path / "b" / "event_date=2026-01-01").iterdir())
    capped = CompactionPolicy(fan_in=3, base_bytes=1, max_bytes=3 * sizes[-1] + 1)  # three inputs an output
    groups = plan(DeltaTable(master.path), capped)
    assert [len(g.files) for g in groups] == [3, 3, 3, 3]
    assert [g.files[0].first_offset for g in groups] == [0, 30, 60, 90]  # in offset order
    before = rows(master)
    assert Compaction(master.path, policy=capped).run() == 12
    assert rows(master) == before and live(master) == 4


def test_only_groups_of_fan_in_files_of_one_date_and_partition_are_planned(tmp_path: Path) -> None:
    master = master_of(tmp_path / "b", 3, partitions=(0,))
    # Two files of another partition (fewer than the fan-in), and one spanning two partitions.
    for i in range(2):
        files = write_event_files(
            events(1, range(i, i + 1)), path=master.path, event_time="event_time", name=f"q{i}"
        )
        commit(master, files, batch=100 + i, ranges={"t/1": [(i, i + 1)]})
    both = pa.concat_tables([events(2, range(0, 1)), events(3, range(0, 1))])
    mixed = write_event_files(both, path=master.path, event_time="event_time", name="mixed")
    commit(master, mixed, batch=200, ranges={"t/2": [(0, 1)], "t/3": [(0, 1)]})
    groups = plan(DeltaTable(master.path), SMALL)
    assert [(g.date, g.partition, [f.path.rsplit("/", 1)[1] for f in g.files]) for g in groups] == [
        ("2026-01-01", 0, ["r-0-0.parquet", "r-0-1.parquet", "r-0-2.parquet"])
    ]
    assert plan(DeltaTable(master.path), CompactionPolicy(fan_in=4)) == []


def test_compaction_keeps_every_row_and_what_master_recorded(tmp_path: Path) -> None:
    master = master_of(tmp_path / "b", 12)
    before, coverage, speed_end, layers = (
        rows(master),
        master.read_coverage(),
        master.read_speed_end(),
        master.recorded_layers(),
    )
    assert live(master) == 24
    assert Compaction(master.path, policy=SMALL).run() == 24
    assert live(master) == 2  # one file per Kafka partition
    assert rows(master) == before  # every column of every row, read back through the Delta log
    assert (master.read_coverage(), master.read_speed_end(), master.recorded_layers()) == (
        coverage,
        speed_end,
        layers,
    )
    assert not master.may_hold_twice()  # each file's coordinate stats still cover one partition's run
    assert master.files_holding([(0, 55, 56), (1, 119, 120)]) == [
        [u for u in DeltaTable(master.path).file_uris() if "compact-p0-" in u],
        [u for u in DeltaTable(master.path).file_uris() if "compact-p1-" in u],
    ]
    assert DeltaTable(master.path).history(1)[0][OPERATION] == "compact"
    assert master.num_records() == 240
    # The next commit goes on as before: what the master dataset holds is decided across the compacted files.
    again = write_event_files(
        events(0, range(50, 130)), path=master.path, event_time="event_time", name="replay"
    )
    commit(master, again, batch=0, app="replay", ranges={"t/0": [(50, 130)]})
    assert coordinates(master) == sorted({(p, o) for p, o in coordinates(master)})
    assert len(coordinates(master)) == 250
    assert Compaction(master.path, policy=SMALL).run() == 0  # nothing worth it


def test_a_commit_landing_during_compaction_stays_and_the_compaction_commits_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    master = master_of(tmp_path / "b", 6)
    round_ = Compaction(master.path, policy=SMALL)
    assert len(round_.write()) == 2
    original = Compaction._commit
    landed = []

    def speed_commit_first(self, table, groups):
        if not landed:  # a micro-batch's commit lands after the compaction decided on `table`
            files = write_event_files(
                events(0, range(60, 70)), path=master.path, event_time="event_time", name="late"
            )
            commit(
                MasterDataset(master.path, event_time="event_time"),
                files,
                batch=999,
                ranges={"t/0": [(60, 70)]},
            )
            landed.append(True)
        return original(self, table, groups)

    monkeypatch.setattr(Compaction, "_commit", speed_commit_first)
    assert round_.commit() == 12  # an append changes nothing it decided: no conflict
    assert coordinates(master) == sorted([(0, o) for o in range(70)] + [(1, o) for o in range(60)])
    assert live(master) == 3


def test_two_compactions_of_the_same_files_replace_them_once(tmp_path: Path) -> None:
    master = master_of(tmp_path / "b", 6)
    before = rows(master)
    first, second = Compaction(master.path, policy=SMALL), Compaction(master.path, policy=SMALL)
    assert len(first.write()) == len(second.write()) == 2  # the same outputs, written once
    assert first.commit() == 12
    assert second.commit() == 0  # its inputs are gone: nothing committed twice
    assert rows(master) == before and live(master) == 2


def test_a_compaction_landing_inside_another_on_overlapping_files_wins_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second decided on a snapshot where the first's inputs were live; the rounds' own app
    transaction fails its commit, and deciding again it finds them gone."""
    master = master_of(tmp_path / "b", 3)
    early = Compaction(master.path, policy=SMALL)
    assert len(early.write()) == 2  # three files a partition
    for i in range(3, 5):  # two more files a partition: the next round's groups differ
        for p in (0, 1):
            files = write_event_files(events(p, range(i * 10, i * 10 + 10)), path=master.path,
                                      event_time="event_time", name=f"r-{p}-{i}")  # fmt: skip
            commit(master, files, batch=i * 10 + p, ranges={f"t/{p}": [(i * 10, i * 10 + 10)]})
    before = rows(master)
    late = Compaction(master.path, policy=SMALL)
    assert [len(g.files) for g in late.write()] == [5, 5]
    original = Compaction._commit

    def early_lands_first(self, table, groups):
        if self is late and early.groups:
            assert early.commit() == 6
            early.groups = []
        return original(self, table, groups)

    monkeypatch.setattr(Compaction, "_commit", early_lands_first)
    assert late.commit() == 0
    assert rows(master) == before and live(master) == 6  # two compacted, four left for the next round


def test_compactions_and_writers_at_once_hold_each_coordinate_once(tmp_path: Path) -> None:
    master = master_of(tmp_path / "b", 4)
    errors: list[BaseException] = []

    def write(writer: int) -> None:
        mine = MasterDataset(master.path, event_time="event_time")
        try:
            for i in range(6):
                start = 40 + (writer * 6 + i) * 5
                files = write_event_files(events(writer % 2, range(start - 3, start + 5)), path=master.path,
                                          event_time="event_time", name=f"w{writer}-{i}")  # fmt: skip
                commit(
                    mine,
                    files,
                    batch=i,
                    app=f"w{writer}",
                    ranges={f"t/{writer % 2}": [(start - 3, start + 5)]},
                )
        except BaseException as exc:
            errors.append(exc)

    def compact() -> None:
        try:
            for _ in range(4):
                Compaction(master.path, policy=SMALL).run()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(4)]
    threads += [threading.Thread(target=compact) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    got = coordinates(master)
    assert len(got) == len(set(got))
    want = {(p, o) for p in (0, 1) for o in range(40)}
    want |= {
        (w % 2, o)
        for w in range(4)
        for i in range(6)
        for o in range(37 + (w * 6 + i) * 5, 45 + (w * 6 + i) * 5)
    }
    assert set(got) == want
    assert any(e.get(OPERATION) == "compact" for e in DeltaTable(master.path).history())


def test_a_round_killed_after_writing_is_adopted_by_the_next(tmp_path: Path) -> None:
    master = master_of(tmp_path / "b", 3)
    before = rows(master)
    killed = Compaction(master.path, policy=SMALL, staging_prefix="run1-")
    written = killed.write()  # and never committed
    assert live(master) == 6 and rows(master) == before  # nothing a reader sees changed
    mtimes = {g.relative: (tmp_path / "b" / g.relative).stat().st_mtime_ns for g in written}
    assert Compaction(master.path, policy=SMALL, staging_prefix="run1-").run() == 6
    assert {g: (tmp_path / "b" / g).stat().st_mtime_ns for g in mtimes} == mtimes  # adopted, not rewritten
    assert rows(master) == before and live(master) == 2
    assert list((tmp_path / "b" / "_staging").iterdir()) == []


def test_a_group_of_more_files_than_a_process_may_open_at_once(tmp_path: Path) -> None:
    """Found by bench.compaction: 25k inputs opened together ran out of file descriptors. The round
    runs in a process that may open 256 files; the group holds 400."""
    import resource
    import subprocess
    import sys

    master = MasterDataset(str(tmp_path / "b"), event_time="event_time")
    files = [
        f
        for i in range(400)
        for f in write_event_files(
            events(0, range(i, i + 1)), path=master.path, event_time="event_time", name=f"f{i}"
        )
    ]
    commit(master, files, batch=0, ranges={"t/0": [(0, 400)]})
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    code = (
        "import sys; from lambdalake.compaction import Compaction, CompactionPolicy; "
        "print(Compaction(sys.argv[1], policy=CompactionPolicy(fan_in=3)).run())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, master.path], capture_output=True, text=True, timeout=120,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "400"
    assert coordinates(master) == [(0, o) for o in range(400)] and live(master) == 1


def test_files_that_may_hold_a_coordinate_twice_are_left_alone(tmp_path: Path) -> None:
    """A master dataset written before commits left out what it held: two files hold offsets 20-29. Merged,
    one file would hold each twice and readers could not keep exactly one."""
    from lambdalake.delta import commit_files
    from lambdalake.master_files import PARTITION

    master = master_of(tmp_path / "b", 5, partitions=(0,))
    again = write_event_files(
        events(0, range(20, 30)), path=master.path, event_time="event_time", name="again"
    )
    commit_files(master.path, again, mode="append", metadata={}, partition=(PARTITION, pa.date32()),
                 stats_columns=("_partition", "_offset"))  # fmt: skip
    assert master.may_hold_twice()
    assert Compaction(master.path, policy=SMALL).run() == 4  # r-0-2 and `again` left apart
    assert len(coordinates(master)) == 60 and len(set(coordinates(master))) == 50
    assert master.may_hold_twice()
    live_names = sorted(u.rsplit("/", 1)[1] for u in DeltaTable(master.path).file_uris())
    assert [n for n in live_names if not n.startswith("compact-p0-")] == ["again.parquet", "r-0-2.parquet"]
    assert len(live_names) == 3


def test_files_of_different_schemas_are_left_alone(tmp_path: Path) -> None:
    master = master_of(tmp_path / "b", 2, partitions=(0,))
    wider = events(0, range(20, 30)).append_column("extra", pa.array(["x"] * 10))
    commit(master, write_event_files(wider, path=master.path, event_time="event_time", name="v2"), batch=50,
           ranges={"t/0": [(20, 30)]})  # fmt: skip
    assert Compaction(master.path, policy=SMALL).run() == 0
    assert live(master) == 3 and len(coordinates(master)) == 30
    assert not list((tmp_path / "b").glob("_staging/*"))  # the copy begun before the mismatch is gone


def test_the_compactor_runs_a_round_every_so_many_commits_on_a_thread(tmp_path: Path) -> None:
    master = master_of(tmp_path / "b", 3)
    compactor = Compactor(master.path, policy=SMALL, every_commits=2)
    compactor.committed()
    compactor.close()
    assert compactor.rounds == 0 and live(master) == 6
    compactor.committed()
    compactor.close()
    assert (compactor.rounds, compactor.replaced, live(master)) == (1, 6, 2)


def test_a_vacuum_deletes_only_files_removed_longer_ago_than_its_retention(tmp_path: Path) -> None:
    import os
    import time

    master = master_of(tmp_path / "b", 3)
    before = rows(master)
    # A file written long ago and never committed (a micro-batch to be committed by its replay).
    pending = write_event_files(
        events(0, range(90, 95)), path=master.path, event_time="event_time", name="pending"
    )
    month_ago = time.time() - 30 * 86400
    os.utime(tmp_path / "b" / pending[0], (month_ago, month_ago))
    on_disk = {p.name for p in (tmp_path / "b" / "event_date=2026-01-01").iterdir()}
    compactor = Compactor(
        master.path, policy=SMALL, every_commits=1, vacuum_retention_hours=1, vacuum_every_rounds=1
    )
    compactor.committed()
    compactor.close()
    assert (compactor.replaced, compactor.vacuumed) == (6, 0)  # removed just now: kept
    compactor = Compactor(
        master.path, policy=SMALL, every_commits=1, vacuum_retention_hours=0, vacuum_every_rounds=1
    )
    compactor.committed()
    compactor.close()
    assert compactor.vacuumed == 6
    left = {p.name for p in (tmp_path / "b" / "event_date=2026-01-01").iterdir()}
    assert left == {"pending.parquet", *(u.rsplit("/", 1)[1] for u in DeltaTable(master.path).file_uris())}
    assert on_disk - left == {f"r-{p}-{i}.parquet" for p in (0, 1) for i in range(3)}
    assert rows(master) == before


def test_layers_recorded_before_many_compactions_and_vacuums_are_still_checked(tmp_path: Path) -> None:
    from lambdalake.errors import ConfigurationError
    from lambdalake.pipeline import LayersSpec

    master = master_of(tmp_path / "b", 3, partitions=(0,))
    assert Compaction(master.path, policy=SMALL).run() == 3
    for _ in range(12):
        vacuum(master.path, retention_hours=0)
    assert all("lambdalake.epoch_ms" not in e for e in DeltaTable(master.path).history(21))  # none recent
    assert master.recorded_layers() == {
        "lambdalake.epoch_ms": 3_600_000,
        "lambdalake.dedup_delay_ms": 600_000,
    }
    with pytest.raises(ConfigurationError, match="epoch"):
        master.check_layers(LayersSpec(epoch="2 hours"), pipeline="p")


def test_a_failed_round_is_reported_and_leaves_master_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    master = master_of(tmp_path / "b", 3)
    before = rows(master)

    def broken(self, table, groups):
        raise OSError("storage refused the commit")

    monkeypatch.setattr(Compaction, "_commit", broken)
    failures: list[BaseException] = []
    compactor = Compactor(master.path, policy=SMALL, every_commits=1, on_error=failures.append)
    compactor.committed()
    compactor.close()
    assert [str(e) for e in failures] == ["storage refused the commit"]
    assert rows(master) == before and live(master) == 6


def test_events_without_a_date_are_compacted_in_their_own_partition(tmp_path: Path) -> None:
    master = MasterDataset(str(tmp_path / "b"), event_time="event_time")
    for i in range(3):
        dated = events(0, range(i * 2, i * 2 + 2))
        times = pa.array([None, datetime(2026, 1, 2, tzinfo=UTC)], type=pa.timestamp("us", tz="UTC"))
        dated = dated.set_column(1, "event_time", times)
        files = write_event_files(dated, path=master.path, event_time="event_time", name=f"n{i}")
        commit(master, files, batch=i, ranges={"t/0": [(i * 2, i * 2 + 2)]})
    before = rows(master)
    assert Compaction(master.path, policy=SMALL).run() == 6
    assert rows(master) == before and live(master) == 2


def test_the_command_compacts_a_pipelines_master_and_says_what_it_did(tmp_path: Path) -> None:
    from lambdalake.layout import master_path
    from lambdalake.settings import MasterSettings, Settings
    from tests.conftest import run_cli

    settings = Settings(storage_root=str(tmp_path / "storage"), master=MasterSettings(compact_fan_in=3))
    missing = run_cli(settings, "master", "compact", "offers", timeout=120)
    assert missing.returncode == 2 and "run the speed job first" in missing.stderr.decode()
    master = master_of(Path(master_path(settings.storage_root, "offers")), 4)
    before = rows(master)
    dry = run_cli(settings, "master", "compact", "offers", "--dry-run", timeout=120)
    assert dry.returncode == 0, dry.stderr.decode()
    assert "8 live files; 8 would be rewritten" in dry.stdout.decode() and live(master) == 8
    done = run_cli(settings, "master", "compact", "offers", timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    assert "8 files rewritten; 8 live files before, 2 now" in done.stdout.decode()
    assert "0 files removed more than 168 hours ago deleted" in done.stdout.decode()
    assert rows(master) == before and live(master) == 2
    status = run_cli(settings, "master", "status", "offers", "--json", timeout=120)
    assert status.returncode == 0, status.stderr.decode()
    found = json.loads(status.stdout)
    assert (found["live_files"], found["records"], found["would_rewrite"]) == (2, 80, 0)
    assert found["last_round"]["files_replaced"] == 8
