"""Bounded reads of Kafka partition ranges into Arrow, for Spark tasks: replay's pieces, and
``spark.read.format("lambdalake_kafka")``.

The speed job reads with Spark's own Kafka source (``format("kafka")``, spark-sql-kafka-0-10, on
every session's classpath). Replay still reads its pieces here: each task reads, decodes and
archives one piece in one Python worker, so no record crosses into the JVM (measuring it against
Spark's source is issue 46's next step).

Columns (as Spark's source): ``key`` binary, ``value`` binary, ``topic`` string, ``partition`` int,
``offset`` long, ``timestamp`` timestamp, ``timestampType`` int, and ``headers``
array<struct<key string, value binary>> when ``includeHeaders`` is true.

Options (as Spark's): ``kafka.<librdkafka property>`` (``kafka.bootstrap.servers`` required),
``subscribe`` (comma-separated topics) or ``assign`` (JSON ``{"topic": [0, 1]}``),
``startingOffsets`` (``earliest``, ``latest`` or JSON ``{"topic": {"0": 23, "1": -2}}``, -2 earliest,
-1 latest), ``startingTimestamp`` (ms, all partitions), ``endingOffsets`` (``latest`` or JSON),
``endingTimestamp`` (ms), ``maxRecordsPerPartition``, ``failOnDataLoss`` (default true: records
removed from a range fail the read), ``includeHeaders`` (default false),
``kafkaConsumer.pollTimeoutMs`` (default 120000), ``fetchOffset.numRetries`` (default 3) and
``fetchOffset.retryIntervalMs`` (default 1000): how often and how far apart a metadata or offset
request the broker did not answer is retried before the read fails naming the broker.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

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


class KafkaSourceError(RuntimeError):
    """A problem reading Kafka: the message says which topic/partition and what to do."""


class DataLossError(KafkaSourceError):
    """Records of the range are gone from the log."""


class BrokerUnavailableError(KafkaSourceError):
    """The broker did not answer a metadata or offset request within the configured retries."""


@dataclass(frozen=True)
class SourceOptions:
    """The parsed options of one bounded read."""

    client_config: dict[str, str]
    subscribe: tuple[str, ...]
    assign: dict[str, list[int]] | None
    starting: str
    starting_timestamp: int | None
    ending: str
    ending_timestamp: int | None
    max_records_per_partition: int | None
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
            max_records_per_partition=as_int("maxrecordsperpartition"),
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

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
        self._consumer = None


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
    """``spark.read.format("lambdalake_kafka")``: see the module docstring."""

    @classmethod
    def name(cls) -> str:
        return "lambdalake_kafka"

    def schema(self) -> str:
        opts = SourceOptions.parse(self.options)
        return BASE_SCHEMA + (HEADERS_SCHEMA if opts.include_headers else "")

    def reader(self, schema: Any) -> DataSourceReader:
        return KafkaBatchReader(SourceOptions.parse(self.options))
