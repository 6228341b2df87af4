"""Event identity in the speed layer: which deliveries are repeats, decided from the log alone.

A valid record is a *repeat* when an earlier record of the same Kafka partition (lower offset) has
the same identity and an ingest time no more than the dedup window before its own. Every copy of
an event is in one partition (an identity includes the event key), so this is the batch layer's
"first delivery in the partition's log" (:func:`lambdalake.spark.views.deduplicate`) restricted to
copies less than a window apart. It depends on nothing but the log, so a replayed or re-planned
micro-batch decides exactly as before.

Why not Spark's ``dropDuplicatesWithinWatermark``: it reads its whole state store every
micro-batch to find expired entries (its CPU per batch grows with every identity the window
holds), and it needs a shuffle of every event. Here each Kafka partition's task keeps an index of the window's
identities in memory and appends one small *segment* file per micro-batch (the identities of the
records it read) beside the checkpoint. A task that finds its process's index behind (the previous
batch ran in another worker or executor) reads the segments it misses; one whose process has no
index (a restart, a replay) rebuilds it from the segments. Cost per batch: the batch's own rows.

Identities are compared by their 128-bit hash (:mod:`lambdalake.identity`, the batch layer's identity
index's too): typed and null-aware, computed on the Arrow columns as they are, so a row hashes the
same whatever else its micro-batch holds; two different identities are taken for one only on a
128-bit collision. Segments are kept per identity encoding (``e<N>/`` under the root): a job of a new
encoding does not read an older one's hashes, so a copy delivered within one window across the
upgrade may count twice in the speed layer until the batch covers its epoch (the batch counts it once).

Eviction cannot change a decision that counts: the windowed view drops rows whose ingest time is
at or behind Spark's watermark, which trails the newest ingest time passed on by ``window``, so no
row that is counted looks back further than that newest time minus twice the window.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lambdalake.identity import ENCODING, arrow_hashes
from lambdalake.spark.views import INGEST_TS
from lambdalake.storage import delete_file, list_files, read_bytes, write_bytes

_SEGMENT = re.compile(r"^(\d{20})-(\d{20})-(-?\d+)-(-?\d+)\.arrow$")


@dataclass
class _Run:
    """Identities sorted by ``h1`` (repeats of one identity side by side), with ingest times."""

    h1: np.ndarray
    h2: np.ndarray
    ts: np.ndarray

    @classmethod
    def of(cls, h1: np.ndarray, h2: np.ndarray, ts: np.ndarray) -> _Run:
        # Stable sort: on two concatenated sorted runs it is a linear merge.
        order = np.argsort(h1, kind="stable")
        return cls(h1[order], h2[order], ts[order])

    def __len__(self) -> int:
        return len(self.h1)

    def keep(self, mask: np.ndarray) -> _Run:
        return _Run(self.h1[mask], self.h2[mask], self.ts[mask])


@dataclass
class IdentityIndex:
    """Identities with their ingest times, kept as a few sorted runs (merged as they grow, so a
    lookup searches O(log n) runs) and dropped once older than an eviction bound."""

    runs: list[_Run] = field(default_factory=list)

    def __len__(self) -> int:
        return sum(len(r) for r in self.runs)

    def add(self, h1: np.ndarray, h2: np.ndarray, ts: np.ndarray, *, evict_before: int) -> None:
        if len(h1):
            self.runs.append(_Run.of(h1, h2, ts))
        self.runs = [r for r in self.runs if len(r) and r.ts.max() >= evict_before]
        while len(self.runs) >= 2 and len(self.runs[-2]) <= 2 * len(self.runs[-1]):
            newer, older = self.runs.pop(), self.runs.pop()
            older, newer = older.keep(older.ts >= evict_before), newer.keep(newer.ts >= evict_before)
            self.runs.append(
                _Run.of(*(np.concatenate([getattr(older, c), getattr(newer, c)]) for c in ("h1", "h2", "ts")))
            )

    def seen_since(self, h1: np.ndarray, h2: np.ndarray, since: np.ndarray) -> np.ndarray:
        """Whether each identity is in the index with an ingest time at or after ``since``."""
        order = np.argsort(h1)  # sorted needles search faster
        q1, q2, qsince = h1[order], h2[order], since[order]
        found = np.zeros(len(h1), dtype=bool)
        for run in self.runs:
            start = np.searchsorted(run.h1, q1)
            rows, k = np.arange(len(q1)), 0
            while rows.size:  # the k-th entry sharing each needle's h1, while there is one
                at = start[rows] + k
                inside = at < len(run)
                rows, at = rows[inside], at[inside]
                same = run.h1[at] == q1[rows]
                rows, at = rows[same], at[same]
                found[rows] |= (run.h2[at] == q2[rows]) & (run.ts[at] >= qsince[rows])
                k += 1
        out = np.empty_like(found)
        out[order] = found
        return out


def repeats_within(h1: np.ndarray, h2: np.ndarray, ts: np.ndarray, window: int) -> np.ndarray:
    """For rows in log order: whether an earlier row has the same identity and an ingest time at
    or after the row's own minus ``window``."""
    repeat = np.zeros(len(h1), dtype=bool)
    order = np.argsort(h1, kind="stable")  # equal h1 side by side, each in log order
    sorted_h1 = h1[order]
    group: list[int] = []
    previous = -2
    for k in (np.nonzero(sorted_h1[1:] == sorted_h1[:-1])[0] + 1).tolist():
        if k != previous + 1:
            group = [int(order[k - 1])]
        i = int(order[k])
        repeat[i] = any(h2[j] == h2[i] and ts[j] >= ts[i] - window for j in group)
        group.append(i)
        previous = k
    return repeat


@dataclass
class _PartitionState:
    index: IdentityIndex
    last_offset: int  # the highest offset indexed, -1 before any
    newest: int  # the newest ingest time passed on as fresh (µs), -1 before any


@dataclass(frozen=True)
class _Segment:
    """The identities one task read: offsets ``first``..``last``, the newest ingest time it passed
    on as fresh and the newest of all its rows (µs; -1 if none)."""

    first: int
    last: int
    newest_fresh: int
    newest: int
    uri: str

    @classmethod
    def parse(cls, uri: str) -> _Segment | None:
        m = _SEGMENT.match(uri.rsplit("/", 1)[1])
        return cls(int(m[1]), int(m[2]), int(m[3]), int(m[4]), uri) if m else None

    def name(self) -> str:
        return f"{self.first:020d}-{self.last:020d}-{self.newest_fresh}-{self.newest}.arrow"


_states: dict[tuple[str, str, int], _PartitionState] = {}


@dataclass(frozen=True)
class DedupLog:
    """Marks repeats among one task's valid records, with segment files under ``root``.

    Args:
        root: Folder for the segment files, beside the query's checkpoint (a local path or an
            object-store URI). Deleting the checkpoint deletes them with it.
        identity: The pipeline's identity columns.
        window_us: The dedup window (the watermark delay), in microseconds of ingest time.

    A task must hold a partition's whole range of its micro-batch (one task per Kafka partition,
    as the Kafka source plans without ``maxRecordsPerPartition``): the range's later part would
    need the earlier part's segment.
    """

    root: str
    identity: tuple[str, ...]
    window_us: int

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """As a ``mapInArrow`` function: the first deliveries among a task's valid events."""
        received = list(batches)
        table = pa.Table.from_batches(received) if received else None
        if table is not None and table.num_rows:
            yield from table.filter(pa.array(self.fresh(table))).to_batches()

    def fresh(self, events: pa.Table) -> np.ndarray:
        """Which of ``events`` (valid, with ``_topic``, ``_partition``, ``_offset`` and the ingest
        time) are first deliveries; the task's segments are written before this returns."""
        keep = np.ones(events.num_rows, dtype=bool)
        if events.num_rows == 0:
            return keep
        topics, partitions = pc.unique(events.column("_topic")), pc.unique(events.column("_partition"))
        if len(topics) == 1 and len(partitions) == 1:  # as the speed job plans its tasks
            return self._fresh_in_partition(events, topics[0].as_py(), partitions[0].as_py())
        coords = events.select(["_topic", "_partition"]).to_pandas()
        for (topic, partition), rows in coords.groupby(["_topic", "_partition"], sort=False).indices.items():
            part = events.take(pa.array(rows)) if len(rows) < events.num_rows else events
            keep[rows] = self._fresh_in_partition(part, str(topic), int(partition))
        return keep

    def _fresh_in_partition(self, events: pa.Table, topic: str, partition: int) -> np.ndarray:
        offsets = events.column("_offset").to_numpy()
        order = np.argsort(offsets, kind="stable")
        events, offsets = events.take(pa.array(order)), offsets[order]
        ingest = pc.cast(pc.cast(events.column(INGEST_TS), pa.timestamp("us", tz="UTC")), pa.int64())
        # A record without a timestamp (old message formats) counts as the oldest: the windowed view
        # drops it behind the watermark anyway, and the batch layer counts it.
        ts = pc.fill_null(ingest, 0).to_numpy()
        h1, h2 = arrow_hashes(events, self.identity)

        state = self._state(topic, partition, before=int(offsets[0]))
        seen = state.index.seen_since(h1, h2, ts - self.window_us)
        fresh = ~(seen | repeats_within(h1, h2, ts, self.window_us))
        newest_fresh = int(ts[fresh].max()) if fresh.any() else -1
        segment = _Segment(int(offsets[0]), int(offsets[-1]), newest_fresh, int(ts.max()), "")
        identities = pa.table({"h1": h1, "h2": h2, "ts": ts})
        write_bytes(f"{self._folder(topic, partition)}/{segment.name()}", _ipc(identities))
        state.index.add(h1, h2, ts, evict_before=self._evict_before(state))
        state.last_offset, state.newest = segment.last, max(state.newest, segment.newest_fresh)

        out = np.empty(len(order), dtype=bool)
        out[order] = fresh
        return out

    def _evict_before(self, state: _PartitionState) -> int:
        """Ingest times older than this can match no row the windowed view counts (module doc)."""
        return state.newest - 2 * self.window_us

    def _folder(self, topic: str, partition: int) -> str:
        return f"{self.root.rstrip('/')}/e{ENCODING}/{topic}/{partition}"

    def _state(self, topic: str, partition: int, *, before: int) -> _PartitionState:
        """This process's index of the partition brought up to (not including) offset ``before``,
        from the segments other processes wrote since; segments no row can match any more are
        deleted."""
        key = (self.root, topic, partition)
        state = _states.get(key)
        if state is None or state.last_offset >= before:  # new process, replay, or rewound checkpoint
            state = _states[key] = _PartitionState(IdentityIndex(), -1, -1)
        found = (_Segment.parse(uri) for uri in list_files(self._folder(topic, partition), suffix=".arrow"))
        segments = sorted((s for s in found if s is not None and s.last < before), key=lambda s: s.first)
        state.newest = max([state.newest, *(s.newest_fresh for s in segments)])
        evict_before = self._evict_before(state)
        for segment in segments:
            if segment.newest < evict_before:
                delete_file(segment.uri)
            elif segment.first > state.last_offset:
                h1, h2, ts = (c.to_numpy() for c in _read_ipc(segment.uri).columns)
                state.index.add(h1, h2, ts, evict_before=evict_before)
        state.last_offset = max([state.last_offset, *(s.last for s in segments)])
        return state


def _ipc(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def _read_ipc(uri: str) -> pa.Table:
    data = read_bytes(uri)
    if data is None:
        raise FileNotFoundError(uri)
    return pa.ipc.open_file(pa.py_buffer(data)).read_all()
