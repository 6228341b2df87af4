"""The speed job's progress: every micro-batch's rows, lag and duration in its log, and a status file
per pipeline (what `lambdalake status` and `speed status` show)."""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql.streaming import StreamingQuery

from lambdalake.procs import TreeMemory, tree_memory
from lambdalake.spark.kafka import Offsets
from lambdalake.storage import read_text, write_text

log = logging.getLogger("lambdalake.speed")


def per_partition(offsets: str | Offsets | None) -> dict[tuple[str, str], int]:
    """A Kafka source's offsets in a query's progress (JSON text or parsed) per (topic, partition)."""
    parsed = json.loads(offsets) if isinstance(offsets, str) else offsets
    return {(t, str(p)): int(off) for t, parts in (parsed or {}).items() for p, off in parts.items()}


def progress_end(progress: Any) -> dict[tuple[str, str], int]:
    """Where a query's reported batch ended, per (topic, partition), over its sources."""
    return {tp: off for source in progress.sources for tp, off in per_partition(source.endOffset).items()}


@dataclass
class QueryStats:
    batches: int = 0
    rows: int = 0
    #: Rows Spark's state operators dropped as late: partially aggregated (key, window) groups.
    dropped_behind_watermark: int = 0
    last_batch: dict[str, Any] = field(default_factory=dict)
    #: The checkpoint's query id: batch ids start over when a checkpoint is rebuilt.
    query_id: str = ""
    #: The highest batch id whose rows are counted.
    counted: int = -1


class ProgressLog:
    """Logs every micro-batch (rows, lag, duration) and keeps a status file per pipeline.

    A thread polls the queries (:meth:`follow`) rather than a listener being called: a Python
    ``StreamingQueryListener`` is called back through py4j on every event, which cost a quarter of a
    core here.
    """

    def __init__(self, status_file: str, *, interval_s: float = 0.25) -> None:
        self.status_file = status_file
        self.interval_s = interval_s
        # The counts go on from the previous run's (a restart resumes the checkpoint's batch ids);
        # batches up to the last one recorded are not counted again.
        previous = json.loads(read_text(status_file) or "{}")
        self.stats: dict[str, QueryStats] = {
            name: QueryStats(**{"counted": s.get("last_batch", {}).get("batch_id", -1), **s})
            for name, s in previous.items()
        }
        self._seen: dict[str, tuple[int, str]] = {
            name: (s.last_batch["batch_id"], s.last_batch.get("at", ""))
            for name, s in self.stats.items()
            if "batch_id" in s.last_batch
        }
        #: Records read per (query, batch id) where Spark's input row count is not that: the main
        #: query's source yields what the archive pass passes on (:meth:`records_read`).
        self._read: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def follow(self, queries: list[StreamingQuery]) -> None:
        """Poll ``queries`` in the background until :meth:`close`."""
        self._stop.clear()
        with self._lock:  # queries of an earlier job's plan (a query per windowed view) are gone
            running = {q.name for q in queries}
            self.stats = {name: s for name, s in self.stats.items() if name in running}

        def run() -> None:
            while not self._stop.wait(self.interval_s):
                try:
                    self.poll(queries)
                except Exception as exc:  # a query being torn down; the next poll or close() catches up
                    log.debug("progress poll failed: %r", exc)

        self._thread = threading.Thread(target=run, name="lambdalake-progress", daemon=True)
        self._thread.start()

    def close(self, queries: list[StreamingQuery]) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.poll(queries)

    def records_read(self, query: str, batch_id: int, records: int) -> None:
        """Count ``records`` as what batch ``batch_id`` of ``query`` read (called before Spark
        reports the batch's progress: from the batch's sink)."""
        with self._lock:
            self._read = {k: v for k, v in self._read.items() if k[1] > batch_id - 100}
            self._read[query, batch_id] = records

    def poll(self, queries: list[StreamingQuery]) -> None:
        """Record the progress of every batch the queries finished since the last poll."""
        with self._lock:
            changed = False
            for q in queries:
                recorded = self.stats.get(q.name)
                if recorded is not None and recorded.query_id not in ("", str(q.id)):
                    self.stats[q.name] = QueryStats()  # a new checkpoint: a new history
                    self._seen.pop(q.name, None)
                last = q.lastProgress
                if last is None or self._seen.get(q.name) == (last.batchId, last.timestamp):
                    continue
                counted = self.stats.setdefault(q.name, QueryStats()).counted
                # More than one batch since the last poll: read the ones in between too.
                events = q.recentProgress if last.batchId > counted + 1 else [last]
                # The job's every process (driver, JVM, Python workers), as `speed status` shows.
                memory = tree_memory(os.getpid())
                for p in events:
                    # Spark reports idle triggers too (every 10 s without new records), under the id
                    # of the batch to come: only a batch that ran counts, once.
                    new = "addBatch" in p.durationMs and p.batchId > counted
                    if new or p is events[-1]:
                        self._record(p, new_batch=new, memory=memory)
                        counted = max(counted, p.batchId) if new else counted
                self._seen[q.name] = (last.batchId, last.timestamp)
                changed = True
            if changed:
                self._write()

    def _record(self, p: Any, *, new_batch: bool, memory: TreeMemory) -> None:
        lag = 0
        for source in p.sources:
            end = per_partition(source.endOffset)
            lag += sum(max(0, off - end.get(tp, 0)) for tp, off in per_partition(source.latestOffset).items())
        dropped = sum(op.numRowsDroppedByWatermark for op in p.stateOperators) if new_batch else 0
        rows = self._read.get((p.name, p.batchId), p.numInputRows)
        stats = self.stats.setdefault(p.name, QueryStats())
        stats.query_id = str(p.id)
        if new_batch:
            stats.batches += 1
            stats.rows += rows
            stats.counted = p.batchId
            stats.dropped_behind_watermark += dropped
        stats.last_batch = {
            "batch_id": p.batchId,
            "rows": rows,
            "lag": lag,
            "duration_ms": p.durationMs.get("triggerExecution"),
            "at": p.timestamp,
            "job_rss_mb": memory.rss_mb,
            "job_processes": memory.processes,
        }
        if new_batch:
            log.debug("%s batch %d phases (ms): %s", p.name, p.batchId, p.durationMs)
        if new_batch and (rows or dropped):
            log.info(
                "%s batch %d: %d rows, lag %d, %d ms%s",
                p.name,
                p.batchId,
                rows,
                lag,
                p.durationMs.get("triggerExecution", 0),
                f", {dropped} behind the watermark (left to the batch layer)" if dropped else "",
            )

    def _write(self) -> None:
        write_text(self.status_file, json.dumps({name: vars(s) for name, s in self.stats.items()}, indent=2))
