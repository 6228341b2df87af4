"""A pipeline's streaming checkpoints and the records the platform keeps beside them: the only code
that names files under ``<storage_root>/checkpoints/<pipeline>``.

Beside Spark's own checkpoint folders (one per query: ``main``, ``main-g<n>`` after a move,
``latest-<hash>`` for a Real-time query) the platform keeps:

- :class:`MainRecord` (``lambdalake-main.json``): the main query's checkpoint folder and the windowed
  views it aggregates, in its Spark state's order;
- :class:`ViewStart` (``<view>/lambdalake-start.json``): for a view first counted on a live
  pipeline, the epoch from which the main query counts it (the view build recomputes the ones
  before from the master dataset);
- :class:`Reset` (``starting-offsets.json``, ``counting-from.json``): where ``speed reset`` left the
  rebuilt queries to start, and the ingest time from which they count;
- in a query's folder, its run id (``lambdalake-run-id``) and its deduplication segments
  (``lambdalake-dedup/``).

Every write is one small-file PUT (:mod:`lambdalake.storage`), so the folder can live on an object store.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass, field

from lambdalake.layout import checkpoints_path
from lambdalake.spark.kafka import Offsets
from lambdalake.storage import delete_file, delete_folder, list_files, read_text, write_text

#: Written by ``speed reset`` beside the checkpoints: the starting offsets of the rebuilt queries.
RESET_FILE = "starting-offsets.json"
#: Written by ``speed reset`` too: the ingest time (the oldest open epoch's start) from which the
#: rebuilt windowed queries count; they start one deduplication window before it.
RESET_FROM_FILE = "counting-from.json"
#: Beside the checkpoints: the main query's checkpoint folder and the windowed views it aggregates.
MAIN_FILE = "lambdalake-main.json"
#: In a windowed view's folder beside the checkpoints (:class:`ViewStart`).
START_FILE = "lambdalake-start.json"
#: In a query's checkpoint folder: the run id its master files and Delta app id carry.
RUN_ID_FILE = "lambdalake-run-id"
#: In a query's checkpoint folder: its deduplication segments (:mod:`lambdalake.speed.dedup`).
DEDUP_FOLDER = "lambdalake-dedup"


@dataclass(frozen=True)
class MainRecord:
    """The main query's checkpoint folder (``dir``, ``main`` then ``main-g<generation>``) and the
    windowed views it aggregates as (name, signature) in its state's order; after a move, the
    offsets its new checkpoint starts at and the ingest time from which it counts (``from_ms``)."""

    dir: str = "main"
    views: tuple[tuple[str, str | None], ...] = ()
    from_ms: int | None = None
    generation: int = 0
    offsets: Offsets | None = None

    @classmethod
    def parse(cls, text: str) -> MainRecord:
        data = json.loads(text)
        return cls(
            dir=data["dir"], views=tuple((name, signature) for name, signature in data["views"]),
            from_ms=data.get("from_ms"), generation=int(data.get("generation", 0)),
            offsets=data.get("offsets"),
        )  # fmt: skip

    def to_json(self) -> str:
        data = {"dir": self.dir, "views": [list(v) for v in self.views], "from_ms": self.from_ms,
                "generation": self.generation}  # fmt: skip
        if self.offsets:
            data["offsets"] = self.offsets
        return json.dumps(data)

    @property
    def view_names(self) -> list[str]:
        return [name for name, _ in self.views]

    def earlier_dirs(self) -> list[str]:
        """The main query's folders before this one (a move leaves them)."""
        return ["main" if g == 0 else f"main-g{g}" for g in range(self.generation)]


@dataclass(frozen=True)
class ViewStart:
    """The ingest epoch (and its start, ms) from which the main query counts a view."""

    epoch: int
    from_ms: int


@dataclass(frozen=True)
class Reset:
    """Where ``speed reset`` left the rebuilt queries: their starting offsets (Spark's
    ``startingOffsets`` JSON), and the ingest time from which the windowed views count."""

    offsets: Offsets = field(default_factory=dict)
    from_ms: int | None = None


class Checkpoints:
    """The checkpoints folder of one pipeline (:func:`checkpoints_path`)."""

    def __init__(self, storage_root: str, pipeline: str) -> None:
        self.root = checkpoints_path(storage_root, pipeline)

    def folder(self, name: str) -> str:
        """A query's (or a view's) folder."""
        return f"{self.root}/{name}"

    # --- the main query -------------------------------------------------------------------

    def main(self) -> MainRecord | None:
        text = read_text(f"{self.root}/{MAIN_FILE}")
        return None if text is None else MainRecord.parse(text)

    def write_main(self, record: MainRecord) -> None:
        write_text(f"{self.root}/{MAIN_FILE}", record.to_json())

    def main_counts(self, view: str) -> bool:
        """Whether the main query's checkpoint aggregates ``view`` (an internal name)."""
        main = self.main()
        return main is not None and view in main.view_names

    # --- views first counted on a live pipeline -------------------------------------------

    def view_start(self, view: str) -> ViewStart | None:
        text = read_text(f"{self.folder(view)}/{START_FILE}")
        if text is None:
            return None
        data = json.loads(text)
        return ViewStart(int(data["epoch"]), int(data["from_ms"]))

    def mark_start(self, view: str, start: ViewStart) -> None:
        text = json.dumps({"epoch": start.epoch, "from_ms": start.from_ms})
        write_text(f"{self.folder(view)}/{START_FILE}", text)

    def counted_before(self, view: str) -> bool:
        """Whether a start was recorded for ``view``, or a query of its own ran."""
        return self.view_start(view) is not None or self.has_run(view)

    # --- speed reset ------------------------------------------------------------------------

    def reset(self) -> Reset | None:
        offsets = read_text(f"{self.root}/{RESET_FILE}")
        if offsets is None:
            return None
        counting = read_text(f"{self.root}/{RESET_FROM_FILE}")
        return Reset(json.loads(offsets), int(json.loads(counting)["from_ms"]) if counting else None)

    def start_over(self, reset: Reset) -> None:
        """Delete every checkpoint, and leave where the rebuilt queries start."""
        delete_folder(self.root)
        write_text(f"{self.root}/{RESET_FILE}", json.dumps(reset.offsets))
        write_text(f"{self.root}/{RESET_FROM_FILE}", json.dumps({"from_ms": reset.from_ms}))

    # --- a query's folder -------------------------------------------------------------------

    def has_run(self, name: str) -> bool:
        """Whether a streaming query has run with this checkpoint (Spark writes ``metadata`` first)."""
        return read_text(f"{self.folder(name)}/metadata") is not None

    def run_id(self, name: str) -> str:
        """The run id of query folder ``name``, made at its first start: it names the query's master
        files and Delta app id, so a fresh checkpoint (a replay of old offsets) never collides with
        what an earlier run committed. Kept in the folder, on the same filesystem (an object store
        on clusters): a driver restarted on another host must find it, or its replay would commit
        under a new app id."""
        uri = f"{self.folder(name)}/{RUN_ID_FILE}"
        existing = read_text(uri)
        if existing is not None:
            return existing.strip()
        run_id = uuid.uuid4().hex[:12]
        write_text(uri, run_id)
        return run_id

    def dedup_root(self, name: str) -> str:
        return f"{self.folder(name)}/{DEDUP_FOLDER}"

    def batch_offsets(self, name: str, batch_id: int) -> tuple[Offsets, Offsets]:
        """Where micro-batch ``batch_id`` of query folder ``name`` starts and ends, per topic and
        partition: its offset log entry (written before the batch runs) holds its end, the entry
        before it its start, and a checkpoint's first batch starts at the initial offsets Spark's
        Kafka source keeps under ``sources/0/0``."""
        folder = self.folder(name)
        end = _source_offsets(read_text(f"{folder}/offsets/{batch_id}"))
        if end is None:
            raise RuntimeError(f"no offset log entry for batch {batch_id} under {folder}")
        start = _source_offsets(read_text(f"{folder}/offsets/{batch_id - 1}")) if batch_id else None
        if start is None:
            start = _source_offsets(read_text(f"{folder}/sources/0/0")) or {}
        return start, end

    def latest_dir(self, tables: list[str]) -> str:
        """The Real-time query's folder name, one per set of latest view tables it writes."""
        return f"latest-{hashlib.sha256(json.dumps(sorted(tables)).encode()).hexdigest()[:12]}"

    def drop_unlogged_batch(self, name: str) -> list[str]:
        """Remove what a checkpoint's first batch left half-written, when its offset log has no
        entry; returns the files removed.

        A query (the main one or the Real-time one) killed in its first batch can leave a temporary
        file of its first offset log entry, or of its first commit, and no offset log entry; Spark
        then refuses that checkpoint for good ("should be empty on batch 0"). Such a checkpoint has
        committed nothing; its initial offsets (``sources/0/0``) stay, so the query runs its first
        batch again from where it was meant to start."""
        folder = self.folder(name)
        offsets = list_files(f"{folder}/offsets")
        if any(u.rsplit("/", 1)[1].isdigit() for u in offsets):
            return []
        stray = [*offsets, *list_files(f"{folder}/commits")]
        for uri in stray:
            delete_file(uri)
        return stray


def _source_offsets(entry: str | None) -> Offsets | None:
    """The Kafka source's offsets in a checkpoint's offset log entry (``v1``, the batch's metadata,
    then the source's line) or in its initial offsets (a NUL byte, ``v1``, then the offsets)."""
    if entry is None:
        return None
    return json.loads(entry.strip("\x00").splitlines()[-1])


def offset_ranges(start: Offsets, end: Offsets) -> dict[str, list[tuple[int, int]]]:
    """The offsets ``[start, end)`` per ``"topic/partition"`` with records between the two."""
    return {
        f"{topic}/{p}": [(int(start.get(topic, {}).get(p, 0)), int(until))]
        for topic, ps in end.items()
        for p, until in ps.items()
        if int(until) > int(start.get(topic, {}).get(p, 0))
    }
