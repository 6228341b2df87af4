"""Bronze compaction against real Delta tables: small files of one event date and Kafka partition are
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


def bronze_of(
    path: Path, batches: int, *, partitions: tuple[int, ...] = (0, 1), size: int = 10
) -> MasterDataset:
    """A bronze of one file per partition and micro-batch, as the speed job commits them."""
    bronze = MasterDataset(str(path), event_time="event_time")
    for i in range(batches):
        for p in partitions:
            offsets = range(i * size, (i + 1) * size)
            files = write_event_files(
                events(p, offsets), path=str(path), event_time="event_time", name=f"r-{p}-{i}"
            )
            commit(bronze, files, batch=i * 10 + p, ranges={f"t/{p}": [(offsets.start, offsets.stop)]})
    return bronze


def commit(bronze: MasterDataset, files: list[str], *, batch: int, ranges: dict, app: str = "speed") -> None:
    bronze.commit(files, app_id=app, batch_id=batch, layers=LAYERS, ranges=ranges, speed=True)


def rows(bronze: MasterDataset) -> list[dict]:
    return sorted(bronze.read().to_pylist(), key=lambda r: (r["_partition"], r["_offset"]))


def live(bronze: MasterDataset) -> int:
    return len(DeltaTable(bronze.path).file_uris())


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
    bronze = bronze_of(tmp_path / "b", 12, partitions=(0,))
    sizes = sorted(f.stat().st_size for f in (tmp_path / "b" / "event_date=2026-01-01").iterdir())
    capped = CompactionPolicy(fan_in=3, base_bytes=1, max_bytes=3 * sizes[-1] + 1)  # three inputs an output
    groups = plan(DeltaTable(bronze.path), capped)
    assert [len(g.files) for g in groups] == [3, 3, 3, 3]
    assert [g.files[0].first_offset for g in groups] == [0, 30, 60, 90]  # in offset order
    before = rows(bronze)
    assert Compaction(bronze.path, policy=capped).run() == 12
    assert rows(bronze) == before and live(bronze) == 4


def test_only_groups_of_fan_in_files_of_one_date_and_partition_are_planned(tmp_path: Path) -> None:
    bronze = bronze_of(tmp_path / "b", 3, partitions=(0,))
    # Two files of another partition (fewer than the fan-in), and one spanning two partitions.
    for i in range(2):
        files = write_event_files(
            events(1, range(i, i + 1)), path=bronze.path, event_time="event_time", name=f"q{i}"
        )
        commit(bronze, files, batch=100 + i, ranges={"t/1": [(i, i + 1)]})
    both = pa.concat_tables([events(2, range(0, 1)), events(3, range(0, 1))])
    mixed = write_event_files(both, path=bronze.path, event_time="event_time", name="mixed")
    commit(bronze, mixed, batch=200, ranges={"t/2": [(0, 1)], "t/3": [(0, 1)]})
    groups = plan(DeltaTable(bronze.path), SMALL)
    assert [(g.date, g.partition, [f.path.rsplit("/", 1)[1] for f in g.files]) for g in groups] == [
        ("2026-01-01", 0, ["r-0-0.parquet", "r-0-1.parquet", "r-0-2.parquet"])
    ]
    assert plan(DeltaTable(bronze.path), CompactionPolicy(fan_in=4)) == []


def test_compaction_keeps_every_row_and_what_bronze_recorded(tmp_path: Path) -> None:
    bronze = bronze_of(tmp_path / "b", 12)
    before, coverage, speed_end, layers = (
        rows(bronze),
        bronze.read_coverage(),
        bronze.read_speed_end(),
        bronze.recorded_layers(),
    )
    assert live(bronze) == 24
    assert Compaction(bronze.path, policy=SMALL).run() == 24
    assert live(bronze) == 2  # one file per Kafka partition
    assert rows(bronze) == before  # every column of every row, read back through the Delta log
    assert (bronze.read_coverage(), bronze.read_speed_end(), bronze.recorded_layers()) == (
        coverage,
        speed_end,
        layers,
    )
    assert not bronze.may_hold_twice()  # each file's coordinate stats still cover one partition's run
    assert bronze.files_holding([(0, 55, 56), (1, 119, 120)]) == [
        [u for u in DeltaTable(bronze.path).file_uris() if "compact-p0-" in u],
        [u for u in DeltaTable(bronze.path).file_uris() if "compact-p1-" in u],
    ]
    assert DeltaTable(bronze.path).history(1)[0][OPERATION] == "compact"
    assert bronze.num_records() == 240
    # The next commit goes on as before: what bronze holds is decided across the compacted files.
    again = write_event_files(
        events(0, range(50, 130)), path=bronze.path, event_time="event_time", name="replay"
    )
    commit(bronze, again, batch=0, app="replay", ranges={"t/0": [(50, 130)]})
    assert coordinates(bronze) == sorted({(p, o) for p, o in coordinates(bronze)})
    assert len(coordinates(bronze)) == 250
    assert Compaction(bronze.path, policy=SMALL).run() == 0  # nothing worth it


def test_a_commit_landing_during_compaction_stays_and_the_compaction_commits_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bronze = bronze_of(tmp_path / "b", 6)
    round_ = Compaction(bronze.path, policy=SMALL)
    assert len(round_.write()) == 2
    original = Compaction._commit
    landed = []

    def speed_commit_first(self, table, groups):
        if not landed:  # a micro-batch's commit lands after the compaction decided on `table`
            files = write_event_files(
                events(0, range(60, 70)), path=bronze.path, event_time="event_time", name="late"
            )
            commit(
                MasterDataset(bronze.path, event_time="event_time"),
                files,
                batch=999,
                ranges={"t/0": [(60, 70)]},
            )
            landed.append(True)
        return original(self, table, groups)

    monkeypatch.setattr(Compaction, "_commit", speed_commit_first)
    assert round_.commit() == 12  # an append changes nothing it decided: no conflict
    assert coordinates(bronze) == sorted([(0, o) for o in range(70)] + [(1, o) for o in range(60)])
    assert live(bronze) == 3


def test_two_compactions_of_the_same_files_replace_them_once(tmp_path: Path) -> None:
    bronze = bronze_of(tmp_path / "b", 6)
    before = rows(bronze)
    first, second = Compaction(bronze.path, policy=SMALL), Compaction(bronze.path, policy=SMALL)
    assert len(first.write()) == len(second.write()) == 2  # the same outputs, written once
    assert first.commit() == 12
    assert second.commit() == 0  # its inputs are gone: nothing committed twice
    assert rows(bronze) == before and live(bronze) == 2


def test_a_compaction_landing_inside_another_on_overlapping_files_wins_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second decided on a snapshot where the first's inputs were live; the rounds' own app
    transaction fails its commit, and deciding again it finds them gone."""
    bronze = bronze_of(tmp_path / "b", 3)
    early = Compaction(bronze.path, policy=SMALL)
    assert len(early.write()) == 2  # three files a partition
    for i in range(3, 5):  # two more files a partition: the next round's groups differ
        for p in (0, 1):
            files = write_event_files(events(p, range(i * 10, i * 10 + 10)), path=bronze.path,
                                      event_time="event_time", name=f"r-{p}-{i}")  # fmt: skip
            commit(bronze, files, batch=i * 10 + p, ranges={f"t/{p}": [(i * 10, i * 10 + 10)]})
    before = rows(bronze)
    late = Compaction(bronze.path, policy=SMALL)
    assert [len(g.files) for g in late.write()] == [5, 5]
    original = Compaction._commit

    def early_lands_first(self, table, groups):
        if self is late and early.groups:
            assert early.commit() == 6
            early.groups = []
        return original(self, table, groups)

    monkeypatch.setattr(Compaction, "_commit", early_lands_first)
    assert late.commit() == 0
    assert rows(bronze) == before and live(bronze) == 6  # two compacted, four left for the next round


def test_compactions_and_writers_at_once_hold_each_coordinate_once(tmp_path: Path) -> None:
    bronze = bronze_of(tmp_path / "b", 4)
    errors: list[BaseException] = []

    def write(writer: int) -> None:
        mine = MasterDataset(bronze.path, event_time="event_time")
        try:
            for i in range(6):
                start = 40 + (writer * 6 + i) * 5
                files = write_event_files(events(writer % 2, range(start - 3, start + 5)), path=bronze.path,
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
                Compaction(bronze.path, policy=SMALL).run()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(4)]
    threads += [threading.Thread(target=compact) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    got = coordinates(bronze)
    assert len(got) == len(set(got))
    want = {(p, o) for p in (0, 1) for o in range(40)}
    want |= {
        (w % 2, o)
        for w in range(4)
        for i in range(6)
        for o in range(37 + (w * 6 + i) * 5, 45 + (w * 6 + i) * 5)
    }
    assert set(got) == want
    assert any(e.get(OPERATION) == "compact" for e in DeltaTable(bronze.path).history())


def test_a_round_killed_after_writing_is_adopted_by_the_next(tmp_path: Path) -> None:
    bronze = bronze_of(tmp_path / "b", 3)
    before = rows(bronze)
    killed = Compaction(bronze.path, policy=SMALL, staging_prefix="run1-")
    written = killed.write()  # and never committed
    assert live(bronze) == 6 and rows(bronze) == before  # nothing a reader sees changed
    mtimes = {g.relative: (tmp_path / "b" / g.relative).stat().st_mtime_ns for g in written}
    assert Compaction(bronze.path, policy=SMALL, staging_prefix="run1-").run() == 6
    assert {g: (tmp_path / "b" / g).stat().st_mtime_ns for g in mtimes} == mtimes  # adopted, not rewritten
    assert rows(bronze) == before and live(bronze) == 2
    assert list((tmp_path / "b" / "_staging").iterdir()) == []


def test_a_group_of_more_files_than_a_process_may_open_at_once(tmp_path: Path) -> None:
    """Found by bench.compaction: 25k inputs opened together ran out of file descriptors. The round
    runs in a process that may open 256 files; the group holds 400."""
    import resource
    import subprocess
    import sys

    bronze = MasterDataset(str(tmp_path / "b"), event_time="event_time")
    files = [
        f
        for i in range(400)
        for f in write_event_files(
            events(0, range(i, i + 1)), path=bronze.path, event_time="event_time", name=f"f{i}"
        )
    ]
    commit(bronze, files, batch=0, ranges={"t/0": [(0, 400)]})
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    code = (
        "import sys; from lambdalake.compaction import Compaction, CompactionPolicy; "
        "print(Compaction(sys.argv[1], policy=CompactionPolicy(fan_in=3)).run())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, bronze.path], capture_output=True, text=True, timeout=120,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "400"
    assert coordinates(bronze) == [(0, o) for o in range(400)] and live(bronze) == 1


def test_files_that_may_hold_a_coordinate_twice_are_left_alone(tmp_path: Path) -> None:
    """A bronze written before commits left out what it held: two files hold offsets 20-29. Merged,
    one file would hold each twice and readers could not keep exactly one."""
    from lambdalake.delta import commit_files
    from lambdalake.master_files import PARTITION

    bronze = bronze_of(tmp_path / "b", 5, partitions=(0,))
    again = write_event_files(
        events(0, range(20, 30)), path=bronze.path, event_time="event_time", name="again"
    )
    commit_files(bronze.path, again, mode="append", metadata={}, partition=(PARTITION, pa.date32()),
                 stats_columns=("_partition", "_offset"))  # fmt: skip
    assert bronze.may_hold_twice()
    assert Compaction(bronze.path, policy=SMALL).run() == 4  # r-0-2 and `again` left apart
    assert len(coordinates(bronze)) == 60 and len(set(coordinates(bronze))) == 50
    assert bronze.may_hold_twice()
    live_names = sorted(u.rsplit("/", 1)[1] for u in DeltaTable(bronze.path).file_uris())
    assert [n for n in live_names if not n.startswith("compact-p0-")] == ["again.parquet", "r-0-2.parquet"]
    assert len(live_names) == 3


def test_files_of_different_schemas_are_left_alone(tmp_path: Path) -> None:
    bronze = bronze_of(tmp_path / "b", 2, partitions=(0,))
    wider = events(0, range(20, 30)).append_column("extra", pa.array(["x"] * 10))
    commit(bronze, write_event_files(wider, path=bronze.path, event_time="event_time", name="v2"), batch=50,
           ranges={"t/0": [(20, 30)]})  # fmt: skip
    assert Compaction(bronze.path, policy=SMALL).run() == 0
    assert live(bronze) == 3 and len(coordinates(bronze)) == 30
    assert not list((tmp_path / "b").glob("_staging/*"))  # the copy begun before the mismatch is gone


def test_the_compactor_runs_a_round_every_so_many_commits_on_a_thread(tmp_path: Path) -> None:
    bronze = bronze_of(tmp_path / "b", 3)
    compactor = Compactor(bronze.path, policy=SMALL, every_commits=2)
    compactor.committed()
    compactor.close()
    assert compactor.rounds == 0 and live(bronze) == 6
    compactor.committed()
    compactor.close()
    assert (compactor.rounds, compactor.replaced, live(bronze)) == (1, 6, 2)


def test_a_vacuum_deletes_only_files_removed_longer_ago_than_its_retention(tmp_path: Path) -> None:
    import os
    import time

    bronze = bronze_of(tmp_path / "b", 3)
    before = rows(bronze)
    # A file written long ago and never committed (a micro-batch to be committed by its replay).
    pending = write_event_files(
        events(0, range(90, 95)), path=bronze.path, event_time="event_time", name="pending"
    )
    month_ago = time.time() - 30 * 86400
    os.utime(tmp_path / "b" / pending[0], (month_ago, month_ago))
    on_disk = {p.name for p in (tmp_path / "b" / "event_date=2026-01-01").iterdir()}
    compactor = Compactor(
        bronze.path, policy=SMALL, every_commits=1, vacuum_retention_hours=1, vacuum_every_rounds=1
    )
    compactor.committed()
    compactor.close()
    assert (compactor.replaced, compactor.vacuumed) == (6, 0)  # removed just now: kept
    compactor = Compactor(
        bronze.path, policy=SMALL, every_commits=1, vacuum_retention_hours=0, vacuum_every_rounds=1
    )
    compactor.committed()
    compactor.close()
    assert compactor.vacuumed == 6
    left = {p.name for p in (tmp_path / "b" / "event_date=2026-01-01").iterdir()}
    assert left == {"pending.parquet", *(u.rsplit("/", 1)[1] for u in DeltaTable(bronze.path).file_uris())}
    assert on_disk - left == {f"r-{p}-{i}.parquet" for p in (0, 1) for i in range(3)}
    assert rows(bronze) == before


def test_layers_recorded_before_many_compactions_and_vacuums_are_still_checked(tmp_path: Path) -> None:
    from lambdalake.errors import ConfigurationError
    from lambdalake.pipeline import LayersSpec

    bronze = bronze_of(tmp_path / "b", 3, partitions=(0,))
    assert Compaction(bronze.path, policy=SMALL).run() == 3
    for _ in range(12):
        vacuum(bronze.path, retention_hours=0)
    assert all("lambdalake.epoch_ms" not in e for e in DeltaTable(bronze.path).history(21))  # none recent
    assert bronze.recorded_layers() == {
        "lambdalake.epoch_ms": 3_600_000,
        "lambdalake.dedup_delay_ms": 600_000,
    }
    with pytest.raises(ConfigurationError, match="epoch"):
        bronze.check_layers(LayersSpec(epoch="2 hours"), pipeline="p")


def test_a_failed_round_is_reported_and_leaves_bronze_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bronze = bronze_of(tmp_path / "b", 3)
    before = rows(bronze)

    def broken(self, table, groups):
        raise OSError("storage refused the commit")

    monkeypatch.setattr(Compaction, "_commit", broken)
    failures: list[BaseException] = []
    compactor = Compactor(bronze.path, policy=SMALL, every_commits=1, on_error=failures.append)
    compactor.committed()
    compactor.close()
    assert [str(e) for e in failures] == ["storage refused the commit"]
    assert rows(bronze) == before and live(bronze) == 6


def test_events_without_a_date_are_compacted_in_their_own_partition(tmp_path: Path) -> None:
    bronze = MasterDataset(str(tmp_path / "b"), event_time="event_time")
    for i in range(3):
        dated = events(0, range(i * 2, i * 2 + 2))
        times = pa.array([None, datetime(2026, 1, 2, tzinfo=UTC)], type=pa.timestamp("us", tz="UTC"))
        dated = dated.set_column(1, "event_time", times)
        files = write_event_files(dated, path=bronze.path, event_time="event_time", name=f"n{i}")
        commit(bronze, files, batch=i, ranges={"t/0": [(i * 2, i * 2 + 2)]})
    before = rows(bronze)
    assert Compaction(bronze.path, policy=SMALL).run() == 6
    assert rows(bronze) == before and live(bronze) == 2


def test_the_command_compacts_a_pipelines_bronze_and_says_what_it_did(tmp_path: Path) -> None:
    from lambdalake.layout import master_path
    from lambdalake.settings import BronzeSettings, Settings
    from tests.conftest import run_cli

    settings = Settings(storage_root=str(tmp_path / "storage"), bronze=BronzeSettings(compact_fan_in=3))
    missing = run_cli(settings, "bronze", "compact", "offers", timeout=120)
    assert missing.returncode == 2 and "run the speed job first" in missing.stderr.decode()
    bronze = bronze_of(Path(master_path(settings.storage_root, "offers")), 4)
    before = rows(bronze)
    dry = run_cli(settings, "bronze", "compact", "offers", "--dry-run", timeout=120)
    assert dry.returncode == 0, dry.stderr.decode()
    assert "8 live files; 8 would be rewritten" in dry.stdout.decode() and live(bronze) == 8
    done = run_cli(settings, "bronze", "compact", "offers", timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    assert "8 files rewritten; 8 live files before, 2 now" in done.stdout.decode()
    assert "0 files removed more than 168 hours ago deleted" in done.stdout.decode()
    assert rows(bronze) == before and live(bronze) == 2
    status = run_cli(settings, "bronze", "status", "offers", "--json", timeout=120)
    assert status.returncode == 0, status.stderr.decode()
    found = json.loads(status.stdout)
    assert (found["live_files"], found["records"], found["would_rewrite"]) == (2, 80, 0)
    assert found["last_round"]["files_replaced"] == 8
