"""A Kafka source for Spark written with PySpark 4's Python Data Source API.

pyspark ships no ``spark-sql-kafka`` connector and none can be fetched here, so this is a twin of
Spark's built-in ``kafka`` source: the same columns and types and the same option names, so switching
a job to the built-in connector on a cluster that has it is the one-word change
``format("lambdalake_kafka")`` -> ``format("kafka")``.

Columns: ``key`` binary, ``value`` binary, ``topic`` string, ``partition`` int, ``offset`` long,
``timestamp`` timestamp, ``timestampType`` int, and ``headers`` array<struct<key string, value binary>>
when ``includeHeaders`` is true.

Options (as Spark's): ``kafka.<librdkafka property>`` (``kafka.bootstrap.servers`` required),
``subscribe`` (comma-separated topics) or ``assign`` (JSON ``{"topic": [0, 1]}``),
``startingOffsets`` (``earliest``, ``latest`` or JSON ``{"topic": {"0": 23, "1": -2}}``, -2 earliest,
-1 latest), ``startingTimestamp`` (ms, all partitions), ``endingOffsets`` (batch reads: ``latest`` or
JSON), ``endingTimestamp`` (batch reads, ms), ``maxOffsetsPerTrigger``, ``maxRecordsPerPartition``,
``minRecordsPerTask`` (streaming reads: partitions' ranges joined into one task up to that many
offsets; not an option of Spark's source), ``failOnDataLoss`` (default true), ``includeHeaders``
(default false), ``kafkaConsumer.pollTimeoutMs`` (default 120000), ``fetchOffset.numRetries``
(default 3) and ``fetchOffset.retryIntervalMs`` (default 1000): how often and how far apart a
metadata or offset request the broker did not answer is retried before the query fails naming the
broker.

Data loss: a broker that loses acknowledged records (a crashed one that had not written them, or an
unclean leader election) loses the tail of a partition and hands the lost offsets to new records. The
streaming reader notices both forms: the log's end behind the checkpoint, and the last record read
no longer being the same record (each planned end carries the offset, timestamp and CRC of the record
before it, checked when the next batch is planned). With ``failOnDataLoss`` true (the default) the
query fails naming the partition and offsets; with false it goes on past the checkpoint with a
warning naming the offsets whose new records it does not read (they would reuse archived coordinates).

:func:`transformed` makes a streaming variant whose reader yields a function of each partition's
records instead of the records (the speed job's archive pass runs there: one Python worker per task).

Delivery guarantee: the streaming reader's offsets are Kafka's per-partition offsets and live in
Spark's checkpoint, not in a consumer group; a restarted query re-reads exactly the planned ranges,
so with idempotent sinks each record takes effect exactly once.
"""

from __future__ import annotations

import json
import logging
import pickle
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain, pairwise
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows
from pyspark.sql.types import StructType

from lambdalake.procs import LIGHT_TASK_ROWS, release_freed_memory

log = logging.getLogger("lambdalake.kafka_source")

EARLIEST, LATEST = -2, -1
ARROW_BATCH_ROWS = 20_000
#: Records asked of the consumer per call.
CONSUME_RECORDS = 10_000

BASE_SCHEMA = (
    "key binary, value binary, topic string, partition int, offset long, "
    "timestamp timestamp, timestampType int"
)
HEADERS_SCHEMA = ", headers array<struct<key: string, value: binary>>"

ARROW_FIELDS = [
    pa.field("key", pa.binary()),
    pa.field("value", pa.binary()),
    pa.field("topic", pa.string()),
    pa.field("partition", pa.int32()),
    pa.field("offset", pa.int64()),
    pa.field("timestamp", pa.timestamp("us", tz="UTC")),
    pa.field("timestampType", pa.int32()),
]
ARROW_HEADERS = pa.field(
    "headers", pa.list_(pa.struct([pa.field("key", pa.string()), pa.field("value", pa.binary())]))
)

#: Offsets as Spark's kafka source writes them: {"topic": {"partition": offset}}.
Offsets = dict[str, dict[str, int]]
#: Key of the planned end offsets' fingerprints in a streaming offset ('$' is not valid in a topic
#: name): {"topic/partition": [offset, timestamp_ms, crc32 of the value] | null}.
CHECK = "$lambdalake.check"
#: Key of a planned end offset's start (the previous end): {"topic": {"partition": offset}}. Kept in
#: each offset-log entry so a micro-batch's whole range is known from its own entry (the first
#: batch's start is logged nowhere else): bronze records the ranges it covered.
FROM = "$lambdalake.from"
Fingerprint = list[int] | None


class KafkaSourceError(RuntimeError):
    """A problem reading Kafka: the message says which topic/partition and what to do."""


class DataLossError(KafkaSourceError):
    """Records the query read or planned are gone from the log (or were replaced by others)."""


class BrokerUnavailableError(KafkaSourceError):
    """The broker did not answer a metadata or offset request within the configured retries."""


def positions(offsets: dict) -> Offsets:
    """The topic/partition offsets of a streaming offset, without its fingerprints."""
    return {t: ps for t, ps in offsets.items() if not t.startswith("$")}


@dataclass(frozen=True)
class SourceOptions:
    """The parsed options of one ``readStream``/``read``."""

    client_config: dict[str, str]
    subscribe: tuple[str, ...]
    assign: dict[str, list[int]] | None
    starting: str
    starting_timestamp: int | None
    ending: str
    ending_timestamp: int | None
    max_offsets_per_trigger: int | None
    max_records_per_partition: int | None
    min_records_per_task: int | None
    fail_on_data_loss: bool
    include_headers: bool
    poll_timeout_s: float
    fetch_retries: int = 3
    retry_interval_s: float = 1.0

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SourceOptions:
        opts = {k: v for k, v in options.items()}
        lower = {k.lower(): v for k, v in opts.items()}
        config = {k[len("kafka.") :]: v for k, v in opts.items() if k.lower().startswith("kafka.")}
        if "bootstrap.servers" not in config:
            raise KafkaSourceError("option 'kafka.bootstrap.servers' is required")
        subscribe = tuple(t.strip() for t in lower.get("subscribe", "").split(",") if t.strip())
        assign = json.loads(lower["assign"]) if "assign" in lower else None
        if bool(subscribe) == bool(assign):
            raise KafkaSourceError("give exactly one of the options 'subscribe' or 'assign'")

        def as_int(name: str) -> int | None:
            return int(lower[name]) if lower.get(name) not in (None, "") else None

        return cls(
            client_config=config,
            subscribe=subscribe,
            assign=assign,
            starting=lower.get("startingoffsets", "latest"),
            starting_timestamp=as_int("startingtimestamp"),
            ending=lower.get("endingoffsets", "latest"),
            ending_timestamp=as_int("endingtimestamp"),
            max_offsets_per_trigger=as_int("maxoffsetspertrigger"),
            max_records_per_partition=as_int("maxrecordsperpartition"),
            min_records_per_task=as_int("minrecordspertask"),
            fail_on_data_loss=lower.get("failondataloss", "true").lower() != "false",
            include_headers=lower.get("includeheaders", "false").lower() == "true",
            poll_timeout_s=int(lower.get("kafkaconsumer.polltimeoutms", "120000")) / 1000,
            fetch_retries=int(lower.get("fetchoffset.numretries", "3")),
            retry_interval_s=int(lower.get("fetchoffset.retryintervalms", "1000")) / 1000,
        )

    @property
    def brokers(self) -> str:
        return self.client_config["bootstrap.servers"]

    def retrying(self, what: str, call: Callable[[], Any]) -> Any:
        """``call()``, retried ``fetch_retries`` times ``retry_interval_s`` apart while the broker does
        not answer (a restart, a leader election); then :class:`BrokerUnavailableError`."""
        from confluent_kafka import KafkaException

        attempts = self.fetch_retries + 1
        t0 = time.monotonic()
        for attempt in range(1, attempts + 1):
            try:
                return call()
            except (KafkaException, _NoAnswer) as exc:
                if attempt == attempts:
                    raise BrokerUnavailableError(
                        f"the Kafka broker at {self.brokers} did not answer {what} in {attempts} attempts "
                        f"over {time.monotonic() - t0:.0f}s (last error: {exc}). Fix: start the broker or "
                        "correct LAMBDALAKE_KAFKA__BOOTSTRAP_SERVERS, then restart the job (it resumes from "
                        "its checkpoint); to wait longer, raise fetchOffset.numRetries"
                    ) from None
                log.warning("%s: no answer from %s (%s); retry %d of %d", what, self.brokers, exc,
                            attempt, attempts - 1)  # fmt: skip
                time.sleep(self.retry_interval_s)
        raise AssertionError("unreachable")


class _NoAnswer(Exception):
    """A request that returned without the broker's answer (retried like a client timeout)."""


def _consumer(config: Mapping[str, str], *, records: int | None = None) -> Any:
    """A consumer for our own offsets; ``records``: how many the caller will read, if it knows."""
    from confluent_kafka import Consumer

    # librdkafka keeps up to 100k records a partition fetched ahead: for a task's small range that
    # was up to 100k records past its end, for the broker to send and the worker to hold and drop.
    # A large range keeps the full prefetch.
    ahead = (
        {} if records is None else {"queued.min.messages": min(100_000, max(2 * CONSUME_RECORDS, records))}
    )
    return Consumer(
        {
            **ahead,
            **config,
            # Offsets are ours (the checkpoint's); the group only satisfies the client.
            "group.id": config.get("group.id", "lambdalake-spark-source"),
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "enable.partition.eof": True,
            "auto.offset.reset": "earliest",
        }
    )


class OffsetOracle:
    """Driver-side questions about the cluster: partitions, watermarks, offsets for timestamps."""

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts
        self._consumer = None
        self._fetcher = None

    @property
    def consumer(self) -> Any:
        if self._consumer is None:
            self._consumer = _consumer(self.opts.client_config)
        return self._consumer

    def partitions(self) -> dict[str, list[int]]:
        if self.opts.assign is not None:
            return {t: sorted(ps) for t, ps in self.opts.assign.items()}
        metadata = self.opts.retrying("a metadata request", lambda: self.consumer.list_topics(timeout=10))
        out = {}
        for topic in self.opts.subscribe:
            meta = metadata.topics.get(topic)
            if meta is None or meta.error is not None:
                raise KafkaSourceError(f"topic {topic!r} does not exist on {self.opts.brokers}")
            out[topic] = sorted(meta.partitions)
        return out

    def watermarks(self, topic: str, partition: int) -> tuple[int, int]:
        from confluent_kafka import TopicPartition

        return self.opts.retrying(
            f"the offsets of {topic}-{partition}",
            lambda: self.consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10),
        )

    def resolve(self, spec: str, timestamp: int | None, default: int) -> Offsets:
        """Concrete offsets for every partition from an offsets spec or a timestamp."""
        parts = self.partitions()
        if timestamp is not None:
            return self.for_timestamp(parts, timestamp)
        explicit: dict[str, dict[str, int]] = {}
        if spec.strip().startswith("{"):
            explicit = {t: {str(p): int(o) for p, o in ps.items()} for t, ps in json.loads(spec).items()}
        elif spec not in ("earliest", "latest"):
            raise KafkaSourceError(f"offsets must be 'earliest', 'latest' or JSON, not {spec!r}")
        fallback = {"earliest": EARLIEST, "latest": LATEST}.get(spec, default)
        out: Offsets = {}
        for topic, ps in parts.items():
            out[topic] = {}
            for p in ps:
                want = explicit.get(topic, {}).get(str(p), fallback)
                if want in (EARLIEST, LATEST):
                    low, high = self.watermarks(topic, p)
                    want = low if want == EARLIEST else high
                out[topic][str(p)] = want
        return out

    def for_timestamp(self, parts: dict[str, list[int]], timestamp: int) -> Offsets:
        """The first offset whose record timestamp is >= ``timestamp`` (the end offset if none)."""
        from confluent_kafka import TopicPartition

        tps = [TopicPartition(t, p, timestamp) for t, ps in parts.items() for p in ps]
        found = self.opts.retrying(
            "an offsets-for-times request", lambda: self.consumer.offsets_for_times(tps, timeout=10)
        )
        out: Offsets = {}
        for tp in found:
            offset = tp.offset if tp.offset >= 0 else self.watermarks(tp.topic, tp.partition)[1]
            out.setdefault(tp.topic, {})[str(tp.partition)] = offset
        return out

    def latest(self) -> Offsets:
        return {t: {str(p): self.watermarks(t, p)[1] for p in ps} for t, ps in self.partitions().items()}

    def fingerprints(self, offsets: Offsets) -> dict[str, Fingerprint]:
        """Offset, timestamp and value CRC of the record just before each offset (null where there is
        none: offset 0, or a gap left by compaction)."""
        wanted = {(t, int(p)): o - 1 for t, ps in offsets.items() for p, o in ps.items() if o > 0}
        found = self.opts.retrying("a fetch of the last planned records", lambda: self._records_at(wanted))
        return {f"{t}/{p}": found.get((t, int(p))) for t, ps in offsets.items() for p in ps}

    def _records_at(self, wanted: dict[tuple[str, int], int]) -> dict[tuple[str, int], Fingerprint]:
        """The fingerprint of the record at each wanted offset, one partition at a time (a fetch of
        several at once lets one partition's prefetched records starve the others)."""
        from confluent_kafka import KafkaError, TopicPartition

        consumer = self.fetcher
        out: dict[tuple[str, int], Fingerprint] = {}
        for (topic, partition), offset in wanted.items():
            consumer.assign([TopicPartition(topic, partition, offset)])
            deadline = time.monotonic() + 10
            try:
                while (topic, partition) not in out:
                    if time.monotonic() > deadline:
                        raise _NoAnswer(f"no record or end of partition for {topic}-{partition} at {offset}")
                    msg = consumer.poll(0.2)
                    if msg is None:
                        continue
                    err = msg.error()
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            out[(topic, partition)] = None
                        continue
                    if msg.offset() != offset:
                        out[(topic, partition)] = None  # compacted away: nothing to compare
                        continue
                    ts_type, ts = msg.timestamp()
                    out[(topic, partition)] = [offset, ts if ts_type else -1, zlib.crc32(msg.value() or b"")]
            finally:
                consumer.unassign()
        return out

    @property
    def fetcher(self) -> Any:
        """A consumer that fetches as little as possible: one record per partition is wanted."""
        if self._fetcher is None:
            self._fetcher = _consumer(
                {
                    **self.opts.client_config,
                    "max.partition.fetch.bytes": "65536",
                    "fetch.max.bytes": "1048576",
                    # librdkafka postpones a partition's next fetch by this much once its queue holds
                    # queued.min.messages: a 1 s stall per check with the default (measured).
                    "fetch.queue.backoff.ms": "0",
                }
            )
        return self._fetcher

    def close(self) -> None:
        for consumer in (self._consumer, self._fetcher):
            if consumer is not None:
                consumer.close()
        self._consumer = self._fetcher = None


class KafkaPartition(InputPartition):
    """Offsets ``[start, until)`` of one topic partition."""

    def __init__(self, topic: str, partition: int, start: int, until: int, *, new: bool = False) -> None:
        super().__init__((topic, partition, start, until))
        self.topic, self.partition, self.start, self.until, self.new = topic, partition, start, until, new

    def __repr__(self) -> str:
        return f"KafkaPartition({self.topic}-{self.partition} [{self.start}, {self.until}))"


def plan(start: Offsets, end: Offsets, *, max_records: int | None = None) -> list[KafkaPartition]:
    """One input partition per topic partition with records between ``start`` and ``end``, or more
    when a range holds over ``max_records`` offsets (``maxRecordsPerPartition``): it is cut into
    equal pieces, so a large micro-batch spreads evenly over the cores even when Kafka partitions
    are skewed.

    A partition in ``end`` but not in ``start`` was added while running: read it from its beginning.
    """
    out = []
    for topic, ps in sorted(end.items()):
        for p, until in sorted(ps.items(), key=lambda kv: int(kv[0])):
            known = str(p) in start.get(topic, {})
            begin = start[topic][str(p)] if known else 0
            if until <= begin:
                continue
            pieces = -(-(until - begin) // max_records) if max_records else 1
            bounds = [begin + (until - begin) * i // pieces for i in range(pieces)] + [until]
            out.extend(KafkaPartition(topic, int(p), lo, hi, new=not known) for lo, hi in pairwise(bounds))
    return out


class KafkaRanges(InputPartition):
    """Several partitions' ranges read one after another by one task (see :func:`pack`)."""

    def __init__(self, parts: Sequence[KafkaPartition]) -> None:
        super().__init__(tuple(p.value for p in parts))
        self.parts = tuple(parts)

    def __repr__(self) -> str:
        return f"KafkaRanges({', '.join(map(repr, self.parts))})"


def pack(parts: list[KafkaPartition], min_records: int | None) -> list[KafkaPartition | KafkaRanges]:
    """``parts`` with consecutive ones joined into one task until it holds ``min_records`` offsets
    (``minRecordsPerTask``); each range stays whole within its task.

    A small micro-batch costs a task's fixed overhead per Kafka partition and a Python worker per
    task running at once; read by one task it costs one of each. A large one keeps a task per range.
    """
    if not min_records or len(parts) < 2:
        return list(parts)
    out: list[KafkaPartition | KafkaRanges] = []
    group: list[KafkaPartition] = []
    held = 0
    for part in parts:
        group.append(part)
        held += part.until - part.start
        if held >= min_records:
            out.append(group[0] if len(group) == 1 else KafkaRanges(group))
            group, held = [], 0
    if group:
        out.append(group[0] if len(group) == 1 else KafkaRanges(group))
    return out


def read_partition(opts: SourceOptions, part: KafkaPartition) -> Iterator[pa.RecordBatch]:
    """Read ``[start, until)`` of one partition as Arrow batches (runs on executors).

    Compacted topics have gaps between offsets: the read ends at the first record at or past
    ``until``, or when the consumer's position reaches it. Records removed by retention before
    ``start`` fail the read (or are skipped with a warning when ``failOnDataLoss`` is false).
    """
    from confluent_kafka import KafkaError, TopicPartition

    consumer = _consumer(opts.client_config, records=part.until - part.start)
    try:
        tp = TopicPartition(part.topic, part.partition)
        low, high = opts.retrying(
            f"the offsets of {part.topic}-{part.partition}",
            lambda: consumer.get_watermark_offsets(tp, timeout=10),
        )
        until = part.until
        if high < until:
            # The offsets were planned from this log's end: a lower end now means the broker lost
            # acknowledged records (a new leader's end can lag for a moment, so look again first).
            time.sleep(opts.retry_interval_s)
            high = consumer.get_watermark_offsets(tp, timeout=10)[1]
        if high < until:
            message = (
                f"DATA LOSS on {part.topic}-{part.partition}: offsets {high}..{until - 1} were in the "
                f"log when this batch was planned and are gone now (the log ends at {high}): the broker "
                "lost acknowledged records"
            )
            if opts.fail_on_data_loss:
                raise DataLossError(
                    f"{message}. Fix: see the README (data loss); produce the lost records again, or "
                    "set failOnDataLoss=false to go on without them"
                )
            log.warning("%s; reading up to %d (failOnDataLoss=false)", message, high)
            until = high
        begin = part.start
        if begin < low and not part.new:
            message = (
                f"{part.topic}-{part.partition}: offsets {begin}..{low - 1} were removed (retention) before "
                "they were read"
            )
            if opts.fail_on_data_loss:
                raise KafkaSourceError(
                    f"{message}. Set failOnDataLoss=false to skip them, or restart from a newer offset."
                )
            log.warning("%s; skipping them (failOnDataLoss=false)", message)
        begin = max(begin, low)
        if begin >= until or begin >= high:
            return
        consumer.assign([TopicPartition(part.topic, part.partition, begin)])
        fields = ARROW_FIELDS + ([ARROW_HEADERS] if opts.include_headers else [])
        schema = pa.schema(fields)
        cols: list[list[Any]] = [[] for _ in fields]
        last_progress = time.monotonic()
        done = False
        next_offset = begin
        while not done:
            # consume() waits for num_messages or the timeout: ask for no more than can be left, and
            # wait briefly, so the tail of a range (or a gap at it) costs milliseconds, not seconds.
            wanted = max(1, min(CONSUME_RECORDS, until - next_offset))
            msgs = consumer.consume(num_messages=wanted, timeout=0.1)
            if not msgs:
                position = consumer.position([tp])[0].offset
                if position >= until:
                    break
                if time.monotonic() - last_progress > opts.poll_timeout_s:
                    raise KafkaSourceError(
                        f"{part.topic}-{part.partition}: no record at or after offset {position} within "
                        f"{opts.poll_timeout_s:g}s (wanted up to {until}); is the broker reachable?"
                    )
                continue
            last_progress = time.monotonic()
            for msg in msgs:
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        if msg.offset() >= until:
                            done = True
                            break
                        continue
                    if err.fatal() or (not err.retriable() and err.code() != KafkaError._TRANSPORT):
                        raise KafkaSourceError(f"{part.topic}-{part.partition}: {err.str()}")
                    # A broker restart or leader change: librdkafka reconnects and resumes the fetch;
                    # the poll timeout bounds how long that may take.
                    log.warning("%s-%d: %s (retrying)", part.topic, part.partition, err.str())
                    continue
                offset = msg.offset()
                next_offset = offset + 1
                if offset >= until:
                    done = True
                    break
                ts_type, ts = msg.timestamp()
                cols[0].append(msg.key())
                cols[1].append(msg.value())
                cols[2].append(part.topic)
                cols[3].append(part.partition)
                cols[4].append(offset)
                cols[5].append(ts * 1000 if ts_type else None)
                # Kafka's TimestampType ids: 0 CreateTime, 1 LogAppendTime (librdkafka: 1, 2).
                cols[6].append(ts_type - 1 if ts_type else -1)
                if opts.include_headers:
                    cols[7].append([{"key": k, "value": v} for k, v in (msg.headers() or [])])
                if offset >= until - 1:
                    done = True
                    break
            if len(cols[0]) >= ARROW_BATCH_ROWS:
                yield pa.RecordBatch.from_arrays(
                    [pa.array(c, type=f.type) for c, f in zip(cols, fields, strict=True)], schema=schema
                )
                cols = [[] for _ in fields]
        if cols[0]:
            yield pa.RecordBatch.from_arrays(
                [pa.array(c, type=f.type) for c, f in zip(cols, fields, strict=True)], schema=schema
            )
    finally:
        consumer.close()


#: A function over one partition's Arrow batches, as ``mapInArrow`` takes (see :func:`transformed`).
Transform = Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]


class KafkaStreamReader(DataSourceStreamReader):
    def __init__(self, opts: SourceOptions, transform: Transform | None = None) -> None:
        self.opts = opts
        self.transform = transform
        self._oracle: OffsetOracle | None = None
        self._latest: Offsets | None = None
        self._checked_at = 0.0

    def __getstate__(self) -> dict[str, Any]:
        # A live consumer does not travel to executors.
        return {
            "opts": self.opts, "transform": self.transform, "_oracle": None, "_latest": None,
            "_checked_at": 0.0,
        }  # fmt: skip

    @property
    def oracle(self) -> OffsetOracle:
        if self._oracle is None:
            self._oracle = OffsetOracle(self.opts)
        return self._oracle

    def initialOffset(self) -> dict:
        return self.oracle.resolve(self.opts.starting, self.opts.starting_timestamp, LATEST)

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.opts.max_offsets_per_trigger:
            return ReadMaxRows(self.opts.max_offsets_per_trigger)
        return ReadAllAvailable()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        checks: dict[str, Fingerprint] = start.get(CHECK, {})
        previous, start = start, positions(start)
        latest = self._latest = self.oracle.latest()
        for topic, ps in start.items():
            missing = set(ps) - set(latest.get(topic, {}))
            if missing:
                message = f"partitions {sorted(missing)} of {topic!r} disappeared"
                if self.opts.fail_on_data_loss:
                    raise KafkaSourceError(f"{message}; set failOnDataLoss=false to go on without them")
                log.warning("%s; going on without them", message)
        lost = self._lost(start, latest, checks)
        end = rate_limit(start, latest, limit.max_rows) if isinstance(limit, ReadMaxRows) else latest
        # Never plan behind the checkpoint: new records at offsets the broker handed out again would
        # reuse coordinates bronze already holds.
        end = {t: {p: max(o, start.get(t, {}).get(p, 0)) for p, o in ps.items()} for t, ps in end.items()}
        moved = {t: {p: o for p, o in ps.items() if o != start.get(t, {}).get(p)} for t, ps in end.items()}
        fingerprints = {k: v for k, v in checks.items() if k not in lost}
        fingerprints.update({k: None for k in lost})
        fingerprints.update(self.oracle.fingerprints(moved))
        if end == start and fingerprints == checks:
            # Nothing to read: the same offset as before, so Spark plans no batch (a new FROM would
            # read as new data).
            return previous
        return {**end, CHECK: fingerprints, FROM: start}

    def _lost(self, start: Offsets, latest: Offsets, checks: dict[str, Fingerprint]) -> set[str]:
        """Partitions whose log lost records the query had read: its end is behind the checkpoint,
        or the last record read is not the same record any more. Raises :class:`DataLossError`
        unless ``failOnDataLoss`` is false."""
        problems: dict[str, str] = {}
        for topic, ps in start.items():
            for p, offset in ps.items():
                end = latest.get(topic, {}).get(p)
                if end is not None and end < offset:
                    problems[f"{topic}/{p}"] = (
                        f"{topic}-{p}: the log ends at offset {end} but the checkpoint has read up to "
                        f"{offset - 1}: offsets {end}..{offset - 1} were lost by the broker"
                    )
        # Partitions about to be read are checked at every trigger; idle ones once a second (their
        # next records are checked before they are read, and an idle query asks every few ms).
        reading = {
            f"{t}/{p}" for t, ps in latest.items() for p, o in ps.items() if o > start.get(t, {}).get(p, o)
        }
        due = time.monotonic() - self._checked_at >= 1.0
        known = {
            k: v for k, v in checks.items() if v is not None and k not in problems and (due or k in reading)
        }
        if due:
            self._checked_at = time.monotonic()
        if known:
            wanted: Offsets = {}
            for k, (offset, _ts, _crc) in known.items():
                topic, _, p = k.rpartition("/")
                wanted.setdefault(topic, {})[p] = offset + 1
            now = self.oracle.fingerprints(wanted)
            for k, then in known.items():
                if now.get(k) is not None and now[k] != then:
                    topic, _, p = k.rpartition("/")
                    problems[k] = (
                        f"{topic}-{p}: the record at offset {then[0]}, the last one the query read, has "
                        f"been replaced (timestamp {then[1]} -> {now[k][1]}): the broker lost records up "
                        f"to offset {then[0]} and gave their offsets to new records"
                    )
        if not problems:
            return set()
        message = "DATA LOSS: " + "; ".join(problems.values())
        if self.opts.fail_on_data_loss:
            raise DataLossError(
                f"{message}. Fix: see the README (data loss): produce the lost records again, then restart "
                "with failOnDataLoss=false to go on past them; new records at the reused offsets are "
                "not read (they would take coordinates the archive already holds)"
            )
        log.warning(
            "%s; going on after the checkpoint's offsets (failOnDataLoss=false): new records at the "
            "reused offsets before them are not read",
            message,
        )
        return set(problems)

    def reportLatestOffset(self) -> dict | None:
        # Spark asks right after latestOffset: answer from that snapshot instead of asking the
        # broker for every partition's watermark a second time per trigger.
        return self._latest

    def partitions(self, start: dict, end: dict) -> list[KafkaPartition | KafkaRanges]:
        parts = plan(positions(start), positions(end), max_records=self.opts.max_records_per_partition)
        return pack(parts, self.opts.min_records_per_task)

    def read(self, partition: KafkaPartition | KafkaRanges) -> Iterator[pa.RecordBatch]:  # type: ignore[override]
        if isinstance(partition, KafkaRanges):
            records = chain.from_iterable(read_partition(self.opts, p) for p in partition.parts)
        else:
            records = read_partition(self.opts, partition)
        return records if self.transform is None else self.transform(records)

    def commit(self, end: dict) -> None:
        # Progress lives in Spark's checkpoint; nothing to commit to Kafka.
        pass

    def stop(self) -> None:
        if self._oracle is not None:
            self._oracle.close()


def rate_limit(start: Offsets, latest: Offsets, max_rows: int) -> Offsets:
    """Cap the records of one trigger at ``max_rows``, shared across partitions by their backlog."""
    backlog = {
        (t, p): until - start.get(t, {}).get(p, 0)
        for t, ps in latest.items()
        for p, until in ps.items()
        if until > start.get(t, {}).get(p, 0)
    }
    total = sum(backlog.values())
    if total <= max_rows:
        return latest
    end: Offsets = {t: dict(ps) for t, ps in latest.items()}
    granted = 0
    for (t, p), lag in sorted(backlog.items()):
        share = min(lag, max(1, lag * max_rows // total))
        if granted + share > max_rows:
            share = max(0, max_rows - granted)
        end[t][p] = start.get(t, {}).get(p, 0) + share
        granted += share
    return end


class KafkaBatchReader(DataSourceReader):
    """Bounded read between ``startingOffsets`` (default earliest) and ``endingOffsets`` (default latest)."""

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts
        oracle = OffsetOracle(opts)
        try:
            starting = (
                "earliest" if opts.starting == "latest" and opts.starting_timestamp is None else opts.starting
            )
            self.start = oracle.resolve(starting, opts.starting_timestamp, EARLIEST)
            self.end = oracle.resolve(opts.ending, opts.ending_timestamp, LATEST)
        finally:
            oracle.close()

    def partitions(self) -> list[KafkaPartition]:
        parts = plan(self.start, self.end, max_records=self.opts.max_records_per_partition)
        return parts or [KafkaPartition("", 0, 0, 0)]

    def read(self, partition: KafkaPartition) -> Iterator[pa.RecordBatch]:  # type: ignore[override]
        if partition.until <= partition.start:
            return iter(())
        return read_partition(self.opts, partition)


class KafkaSource(DataSource):
    """``spark.read[Stream].format("lambdalake_kafka")``: see the module docstring."""

    @classmethod
    def name(cls) -> str:
        return "lambdalake_kafka"

    def schema(self) -> str:
        opts = SourceOptions.parse(self.options)
        return BASE_SCHEMA + (HEADERS_SCHEMA if opts.include_headers else "")

    def reader(self, schema: Any) -> DataSourceReader:
        return KafkaBatchReader(SourceOptions.parse(self.options))

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
        return KafkaStreamReader(SourceOptions.parse(self.options))


def transformed(transform: Transform, schema: StructType, *, name: str) -> type[KafkaSource]:
    """A streaming Kafka source named ``name`` whose reader yields ``transform`` of each partition's
    records (of ``schema``) instead of the records.

    The same as ``readStream.format("lambdalake_kafka")...load().mapInArrow(transform, schema)`` with
    one Python worker per task instead of two, and without the round trip of every record through
    the JVM (Arrow to rows and back) between them. Accumulators in ``transform`` report as from
    ``mapInArrow``. It travels pickled and is unpickled where a partition is read only: the
    processes that plan the query (one of them lives as long as the query) never import its code.
    """
    from pyspark import cloudpickle

    pickled = cloudpickle.dumps(transform)

    def run(records: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        read = 0

        def counted() -> Iterator[pa.RecordBatch]:
            nonlocal read
            for batch in records:
                read += batch.num_rows
                yield batch

        yield from pickle.loads(pickled)(counted())
        if read <= LIGHT_TASK_ROWS:
            release_freed_memory()

    class Transformed(KafkaSource):
        @classmethod
        def name(cls) -> str:
            return name

        def schema(self) -> StructType:
            return schema

        def reader(self, schema: Any) -> DataSourceReader:
            raise KafkaSourceError(f"{name} is a streaming source: read it with readStream")

        def streamReader(self, schema: Any) -> DataSourceStreamReader:
            return KafkaStreamReader(SourceOptions.parse(self.options), run)

    return Transformed
