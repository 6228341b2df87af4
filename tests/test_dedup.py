"""speed.dedup: repeats decided from the log alone, whatever the batch cuts, processes and replays."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import lambdalake.speed.dedup as dedup
from lambdalake.identity import ENCODING
from lambdalake.speed.dedup import DedupLog, IdentityIndex, repeats_within

WINDOW = 10_000_000  # ten seconds, in µs


def log_table(rows: list[tuple[int, str, int, int]], *, partition: int = 0) -> pa.Table:
    """Records (offset, key, n, ingest µs) of one partition; identity (key, n)."""
    offsets, keys, ns, ts = zip(*rows, strict=True)
    return pa.table(
        {
            "_topic": ["t"] * len(rows),
            "_partition": pa.array([partition] * len(rows), pa.int32()),
            "_offset": pa.array(offsets, pa.int64()),
            "_ingest_ts": pa.array(ts, pa.timestamp("us", tz="UTC")),
            "key": keys,
            "n": pa.array(ns, pa.int64()),
        }
    )


def brute_force(rows: list[tuple[int, str, int, int]]) -> list[bool]:
    """Fresh unless an earlier record (lower offset) has the identity within the window before."""
    return brute_force_window(rows, WINDOW)


def random_log(seed: int, n: int = 3000, *, jitter_us: int = 0) -> list[tuple[int, str, int, int]]:
    """Offsets with gaps (compaction), ingest time rising ~20 ms a record with ``jitter_us`` of
    disorder, and repeats of recent and long-past identities."""
    rng = random.Random(seed)
    rows, offset, t = [], 0, 1_700_000_000_000_000
    for _ in range(n):
        offset += rng.choice([1, 1, 1, 2, 5])
        t += rng.randrange(0, 40_000)
        ts = t + rng.randrange(-jitter_us, jitter_us + 1) if jitter_us else t
        if rows and rng.random() < 0.15:  # a repeat: of a recent record mostly, sometimes an old one
            back = int(rng.expovariate(1 / 200)) if rng.random() < 0.7 else rng.randrange(len(rows))
            j = len(rows) - 1 - min(back, len(rows) - 1)
            rows.append((offset, rows[j][1], rows[j][2], ts))
        else:
            rows.append((offset, f"k{rng.randrange(50)}", rng.randrange(10**9), ts))
    return rows


def run_batches(log: DedupLog, rows: list, cuts: list[int], *, rng: random.Random) -> list[bool]:
    """Feed ``rows`` in micro-batches cut at ``cuts``; between batches another process may take
    over (this one's index forgotten), and a batch may run twice (a replay after a crash)."""
    out: list[bool] = []
    bounds = [0, *cuts, len(rows)]
    for a, b in itertools.pairwise(bounds):
        if a == b:
            continue
        batch = log_table(rows[a:b])
        if rng.random() < 0.3:
            dedup._states.clear()
        if rng.random() < 0.2:
            log.fresh(batch)  # an attempt whose results were lost
        shuffled = batch.take(pa.array(rng.sample(range(batch.num_rows), batch.num_rows)))
        fresh = log.fresh(shuffled)
        by_offset = dict(zip(shuffled.column("_offset").to_pylist(), fresh.tolist(), strict=True))
        out.extend(by_offset[o] for o in batch.column("_offset").to_pylist())
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_first_deliveries_do_not_depend_on_batching_processes_or_replays(tmp_path: Path, seed: int) -> None:
    rows = random_log(seed)
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(rows)), 12))
    dedup._states.clear()
    log = DedupLog(root=str(tmp_path / "dedup"), identity=("key", "n"), window_us=WINDOW)
    got = run_batches(log, rows, cuts, rng=rng)
    expected = brute_force(rows)
    assert got == expected
    assert expected.count(False) > 100  # the log has repeats inside the window...
    seen: set[tuple[str, int]] = set()
    outside = 0
    for (_, k, n, _), fresh in zip(rows, expected, strict=True):
        outside += fresh and (k, n) in seen
        seen.add((k, n))
    assert outside > 10  # ...and outside it


def test_segments_beyond_twice_the_window_are_deleted(tmp_path: Path) -> None:
    rows = random_log(7, n=4000)  # ~80 s of ingest time, against a 1-minute window
    log = DedupLog(root=str(tmp_path / "dedup"), identity=("key", "n"), window_us=WINDOW)
    dedup._states.clear()
    run_batches(log, rows, list(range(200, 4000, 200)), rng=random.Random(0))
    kept = sorted((tmp_path / "dedup" / f"e{ENCODING}" / "t" / "0").glob("*.arrow"))
    assert 2 <= len(kept) < 19
    state = dedup._states[(log.root, "t", 0)]
    assert len(state.index) < 4000


def test_out_of_order_ingest_times_decide_alike_for_rows_the_view_counts(tmp_path: Path) -> None:
    """With ingest times out of order, eviction may only change rows at or behind the watermark
    (dropped by the windowed view): compare the rest to the brute force."""
    rows = random_log(11, n=4000, jitter_us=8_000_000)
    rng = random.Random(11)
    cuts = list(range(250, 4000, 250))
    log = DedupLog(root=str(tmp_path / "dedup"), identity=("key", "n"), window_us=WINDOW)
    dedup._states.clear()
    got = run_batches(log, rows, cuts, rng=rng)
    expected = brute_force_window(rows, WINDOW)
    bounds = [0, *cuts, len(rows)]
    counted = 0
    newest_fresh = -1
    for a, b in itertools.pairwise(bounds):
        watermark = newest_fresh - WINDOW
        for i in range(a, b):
            if rows[i][3] > watermark:
                counted += 1
                assert got[i] == expected[i], rows[i]
        fresh_ts = [rows[i][3] for i in range(a, b) if expected[i]]
        newest_fresh = max([newest_fresh, *fresh_ts])
    assert counted > 3000


def brute_force_window(rows: list[tuple[int, str, int, int]], window: int) -> list[bool]:
    return [
        not any(o2 < o and (k2, n2) == (k, n) and t2 >= t - window for o2, k2, n2, t2 in rows)
        for o, k, n, t in rows
    ]


def test_index_lookup_and_in_batch_repeats_agree_with_brute_force() -> None:
    rng = np.random.default_rng(5)
    h1 = rng.integers(0, 50, 400).astype(np.uint64)  # many equal h1 with different h2: collisions
    h2 = rng.integers(0, 3, 400).astype(np.uint64)
    ts = rng.integers(0, 1000, 400)
    index = IdentityIndex()
    for a in range(0, 300, 37):
        b = min(a + 37, 300)
        index.add(h1[a:b], h2[a:b], ts[a:b], evict_before=-1)
    since = ts[300:] - 100
    got = index.seen_since(h1[300:], h2[300:], since)
    want = [
        any(h1[j] == h1[i] and h2[j] == h2[i] and ts[j] >= since[i - 300] for j in range(300))
        for i in range(300, 400)
    ]
    assert got.tolist() == want
    assert 0 < sum(want) < 100
    rep = repeats_within(h1, h2, ts, 100)
    assert rep.tolist() == [
        any(h1[j] == h1[i] and h2[j] == h2[i] and ts[j] >= ts[i] - 100 for j in range(i)) for i in range(400)
    ]


def test_records_without_a_timestamp_are_judged_like_the_oldest(tmp_path: Path) -> None:
    table = log_table([(0, "a", 1, 5_000_000), (1, "a", 1, 6_000_000), (2, "b", 1, 7_000_000)])
    table = table.set_column(3, "_ingest_ts", pa.array([None, None, 7_000_000], pa.timestamp("us", tz="UTC")))
    dedup._states.clear()
    log = DedupLog(root=str(tmp_path / "dedup"), identity=("key", "n"), window_us=WINDOW)
    assert log.fresh(table).tolist() == [True, False, True]


def test_as_a_map_in_arrow_function_it_passes_first_deliveries_and_takes_empty_tasks(tmp_path: Path) -> None:
    log = DedupLog(root=str(tmp_path / "dedup"), identity=("key", "n"), window_us=WINDOW)
    dedup._states.clear()
    assert list(log(iter([]))) == []
    table = log_table([(0, "a", 1, 5_000_000), (1, "a", 1, 6_000_000), (2, "b", 1, 7_000_000)])
    out = pa.Table.from_batches(list(log(iter(table.to_batches(max_chunksize=2)))))
    assert out.column("_offset").to_pylist() == [0, 2]


def test_a_table_of_two_partitions_is_judged_per_partition(tmp_path: Path) -> None:
    """Copies in different partitions are different deliveries' logs: each partition is judged on
    its own, as if it came in a task of its own."""
    rows = [(0, "a", 1, 5_000_000), (1, "a", 1, 6_000_000), (2, "b", 1, 7_000_000)]
    both = pa.concat_tables([log_table(rows, partition=0), log_table(rows, partition=1)])
    mixed = both.take(pa.array([3, 0, 4, 1, 5, 2]))
    dedup._states.clear()
    log = DedupLog(root=str(tmp_path / "dedup"), identity=("key", "n"), window_us=WINDOW)
    assert log.fresh(mixed).tolist() == [True, True, False, False, True, True]
    assert sorted(p.name for p in (tmp_path / "dedup" / f"e{ENCODING}" / "t").iterdir()) == ["0", "1"]
