"""What Spark's Kafka source does not check: that the broker did not give read offsets to new records.

A broker that loses the tail of a partition (an unclean leader election; a disk restored from an
older copy) hands the lost offsets to the next records it is sent. Spark's source notices a log
whose end is behind the checkpoint (``KAFKA_DATA_LOSS.PARTITION_OFFSET_CHANGED``), but once new
records pass the checkpoint it reads on: the records before it were never read, and the records
after it sit at offsets whose neighbours the archive holds from the lost log.

So the main query's archive pass reports the last record it read of each partition (offset,
timestamp, CRC-32 of the value: :class:`LastRecords`), the driver keeps them beside the checkpoint,
and before a micro-batch reads a partition again it checks that that record is still the same
(:class:`LastReadCheck`). A record that changed is data loss: the query stops naming the partition
and offsets, or with ``failOnDataLoss`` false goes on after the checkpoint with a warning (the new
records at the reused offsets before it are not read: their coordinates are taken in the master dataset).
"""

from __future__ import annotations

import json
import logging
import re
import zlib
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
from confluent_kafka import Consumer
from pyspark.accumulators import AccumulatorParam

from lambdalake.errors import LambdalakeError
from lambdalake.kafka.offsets import lookup_consumer, record_at
from lambdalake.settings import Settings
from lambdalake.storage import read_text, write_text

log = logging.getLogger("lambdalake.speed")

#: Per ``"topic/partition"``: ``[offset, timestamp ms, crc32 of the value]`` of the last record read.
Fingerprints = dict[str, list[int]]

#: How a data-loss error's message ends: what to do.
FIX = (
    "see docs/layers.md (Broker restarts and data loss): produce the lost records again, then restart with "
    "failOnDataLoss=false (`speed run --no-fail-on-data-loss`) to go on past them; new records at the "
    "reused offsets are not read (they would take coordinates the archive already holds)"
)


class DataLossError(LambdalakeError):
    """Records the query read are gone from the log, or their offsets hold other records now."""


class LastRecords(AccumulatorParam):
    """Accumulates :data:`Fingerprints`, the higher offset winning (a task run twice reports the same)."""

    def zero(self, value: Fingerprints) -> Fingerprints:
        return {}

    def addInPlace(self, a: Fingerprints, b: Fingerprints) -> Fingerprints:
        out = dict(a)
        for k, v in b.items():
            if k not in out or v[0] > out[k][0]:
                out[k] = v
        return out


def fingerprint(batch: pa.RecordBatch, row: int) -> list[int]:
    """``[offset, timestamp ms, crc32]`` of one row of the Kafka source's records."""
    stamp = batch.column("timestamp")[row].cast(pa.timestamp("us")).cast(pa.int64()).as_py()
    value = batch.column("value")[row].as_py() or b""
    return [batch.column("offset")[row].as_py(), stamp // 1000, zlib.crc32(value)]


def noting_last(batches: Iterator[pa.RecordBatch], last: Fingerprints) -> Iterator[pa.RecordBatch]:
    """``batches`` unchanged; ``last`` holds the last row's fingerprint of each partition seen."""
    for batch in batches:
        if batch.num_rows:
            # Over columns: this runs on every record read (one group: a task reads one partition).
            index = pa.array(np.arange(batch.num_rows))
            rows = pa.table({"t": batch.column("topic"), "p": batch.column("partition"), "i": index})
            rows = rows.group_by(["t", "p"]).aggregate([("i", "max")])
            for t, p, i in zip(*(rows.column(c).to_pylist() for c in ("t", "p", "i_max")), strict=True):
                last[f"{t}/{p}"] = fingerprint(batch, i)
        yield batch


def record_fingerprint(
    consumer: Consumer, topic: str, partition: int, offset: int, timeout: float
) -> list[int] | None:
    """The fingerprint of the record at ``offset`` now (None: the log holds no record there)."""
    msg = record_at(consumer, topic, partition, offset, timeout)
    if msg is None or msg.offset() != offset:
        return None
    return [msg.offset(), msg.timestamp()[1], zlib.crc32(msg.value() or b"")]


class LastReadCheck:
    """The driver's side: the fingerprints of a checkpoint (a file beside it) and their check.

    Args:
        settings: The Kafka cluster to ask.
        checkpoint: The main query's checkpoint folder (the fingerprints live in it: a new checkpoint
            starts with none).
        fail: Raise :class:`DataLossError` on a replaced record (``failOnDataLoss``); else warn.
    """

    def __init__(self, *, settings: Settings, checkpoint: str, fail: bool) -> None:
        self.settings = settings
        self.uri = f"{checkpoint}/lambdalake-last-read.json"
        self.fail = fail
        self.known: Fingerprints = json.loads(read_text(self.uri) or "{}")
        self._consumer: Consumer | None = None

    def check(self, reading: list[str]) -> None:
        """Before a micro-batch reads the ``"topic/partition"`` keys in ``reading``: each one's last
        record read is still the same record."""
        problems = []
        for key in reading:
            then = self.known.get(key)
            if then is None:
                continue
            topic, _, p = key.rpartition("/")
            now = record_fingerprint(
                self._kafka(), topic, int(p), then[0], self.settings.kafka.connect_timeout_s * 6
            )
            if now is not None and now != then:
                problems.append(
                    f"{topic}-{p}: the record at offset {then[0]}, the last one the query read, has been "
                    f"replaced (timestamp {then[1]} -> {now[1]}): the broker lost records up to offset "
                    f"{then[0]} and gave their offsets to new records"
                )
                self.known.pop(key)
        if problems:
            message = "DATA LOSS: " + "; ".join(problems)
            if self.fail:
                raise DataLossError(message, fix=FIX)
            log.warning("%s; going on after the checkpoint's offsets (failOnDataLoss=false): new records "
                        "at the reused offsets before them are not read", message)  # fmt: skip

    def record(self, last: Fingerprints) -> None:
        """Keep what a committed micro-batch read last (before Spark commits the batch)."""
        if last:
            self.known = LastRecords().addInPlace(self.known, last)
            write_text(self.uri, json.dumps(self.known))

    def _kafka(self) -> Consumer:
        if self._consumer is None:
            self._consumer = lookup_consumer(self.settings, "lambdalake-last-read")
        return self._consumer

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None


#: Spark's Kafka source's words for a log whose end went behind the checkpoint.
_OFFSET_CHANGED = re.compile(r"Partition (\S+?)-(\d+) offset was changed from (\d+) to (\d+)")


def lost_tail(topic: str, partition: int, checkpoint: int, log_end: int) -> DataLossError:
    """The error for a partition whose log ends at ``log_end``, behind the ``checkpoint``'s offset."""
    return DataLossError(
        f"DATA LOSS: {topic}-{partition}: the log ends at offset {log_end} but the checkpoint has read up "
        f"to {checkpoint - 1}: offsets {log_end}..{checkpoint - 1} were lost by the broker",
        fix=FIX,
    )


def offset_changed(text: str) -> DataLossError | None:
    """The data-loss error for Spark's ``PARTITION_OFFSET_CHANGED`` in ``text`` (None: not that)."""
    found = _OFFSET_CHANGED.search(text)
    if found is None:
        return None
    return lost_tail(found.group(1), int(found.group(2)), int(found.group(3)), int(found.group(4)))
