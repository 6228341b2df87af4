"""The edge of the trusted domain: validate, encode as registered Avro, produce idempotently."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from confluent_kafka import KafkaError, KafkaException, Message, Producer

from lambdalake.avro import WireEncoder, parse_schema
from lambdalake.columnar import ColumnarEncoder
from lambdalake.columnar.validate import ColumnarValidator
from lambdalake.event_schema import decimal_of
from lambdalake.kafka import dlq
from lambdalake.kafka.admin import ensure_pipeline_topics, require_pipeline_topics
from lambdalake.pipeline import Pipeline
from lambdalake.produce.dict_rows import DictRows
from lambdalake.produce.json_pieces import JsonPieces
from lambdalake.produce.nesting import MAX_RECORD_DEPTH, deeper_than, has_nested_types
from lambdalake.registry import register_pipeline
from lambdalake.settings import Settings
from lambdalake.validation import RecordValidator, Rejection, checked_rules

#: Safe defaults: no loss (acks=all), no duplicates or reordering from retries (idempotence).
PRODUCER_DEFAULTS: dict[str, Any] = {
    "enable.idempotence": True,
    "acks": "all",
    "compression.type": "lz4",
    "linger.ms": 20,
    "batch.num.messages": 10000,
    "queue.buffering.max.messages": 500_000,
    "queue.buffering.max.kbytes": 512 * 1024,
    "message.timeout.ms": 120_000,
    # Failures are reported; acknowledgements are counted at flush (see EventProducer.flush).
    "delivery.report.only.error": True,
}


@dataclass
class ProduceStats:
    """What happened to every record handed to :class:`EventProducer`."""

    sent: int = 0
    acked: int = 0
    failed: int = 0
    rejected: int = 0
    dlq_acked: int = 0
    dlq_failed: int = 0
    #: Refused records even the DLQ could not take (e.g. above the broker's message size): each is
    #: written with its reason to :attr:`rejects_file`.
    rejects_written: int = 0
    rejects_file: Path | None = None
    #: The producer's fatal error, if one ended the session (nothing more can be sent).
    fatal: str | None = None
    #: The client's log line of its fatal error (its cause, when the error itself was lost).
    fatal_log: str | None = None
    rejected_by_rule: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)

    @property
    def unacknowledged(self) -> int:
        """Records (valid or dead-lettered) the broker did not confirm, less those kept in the
        rejects file."""
        return (self.sent - self.acked) + (self.rejected - self.dlq_acked - self.rejects_written)


@dataclass
class BatchOutcome:
    """What :meth:`EventProducer.send_batch` did with a batch: how many records went to the topic,
    and each refused one (its index in the batch and the rejection; it went to the DLQ)."""

    accepted: int = 0
    refused: list[tuple[int, Rejection]] = field(default_factory=list)
    #: Records that took the per-record path (the columnar checks could not vouch for them).
    one_by_one: int = 0


@dataclass
class _Ready:
    """Per record of a batch, its encoded key and value when the columnar path cleared it."""

    n: int

    def __post_init__(self) -> None:
        self.keys: list[bytes | None] = [None] * self.n
        self.values: list[bytes | None] = [None] * self.n


class ProducerFailed(Exception):
    """The Kafka producer hit a fatal error: nothing more can be sent in this session."""


class RejectsFile:
    """A local JSON-lines file for refused records the DLQ could not take, opened on first use.

    Args:
        path: Where to write. Created (with its folder) on the first record.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: Any = None

    def write(self, *, rule: str, reason: str, error: str, payload: bytes) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        entry = {
            "rule": rule,
            "reason": reason,
            "dlq_error": error,
            "payload_bytes": len(payload),
            "payload": payload.decode("utf-8", "backslashreplace"),
        }
        self._file.write(json.dumps(entry) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _fatal_recorder(stats: ProduceStats) -> Callable[[KafkaError], None]:
    """librdkafka's error callback: remembers the first fatal error in ``stats``."""

    def on_error(err: KafkaError) -> None:
        if err.fatal() and stats.fatal is None:
            stats.fatal = f"{err.name()}: {err.str()}"

    return on_error


def _delivery_counter(stats: ProduceStats) -> Callable[[KafkaError | None, Message], None]:
    """The producer's default delivery report, for records of the topic: counts them in ``stats``.

    Set once in the producer's configuration rather than given to each ``produce`` call, which
    would cost a Python reference per record (a DLQ record still brings its own callback)."""

    def on_delivery(err: KafkaError | None, _msg: Message) -> None:
        if err is None:
            stats.acked += 1
        else:
            stats.failed += 1
            stats.errors[err.str()] += 1

    return on_delivery


def _drop_tracebacks(exc: BaseException | None) -> None:
    """Forget the frames of ``exc`` and the errors it chains. confluent-kafka keeps the error a
    delivery callback raised after a fatal error, and its frames hold this producer: kept, they
    keep it (and its librdkafka threads, retrying a broker) alive for good (measured in the tests)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__


#: librdkafka's own log lines.
_CLIENT_LOG = logging.getLogger("lambdalake.kafka.client")


def _client_log(stats: ProduceStats) -> logging.Logger:
    """A logger of one producer's librdkafka lines: each goes on to :data:`_CLIENT_LOG`, and a
    fatal error's line is kept in ``stats``. The client calls the delivery callbacks with its fatal
    error pending, so the error reaches Python as a SystemError that has lost it; its log line has
    it (e.g. "Cluster authorization failed": a login without the right to write the topic)."""

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            text = record.getMessage()
            if "Fatal error" in text and stats.fatal_log is None:
                stats.fatal_log = text.split("Fatal error: ", 1)[-1]
            _CLIENT_LOG.handle(record)

    logger = logging.Logger("lambdalake.kafka.producer")  # one of its own: not in logging's registry
    logger.addHandler(Keep())
    return logger


def _describe_fatal(exc: BaseException) -> str:
    # A fatal error met inside a delivery callback surfaces as a SystemError whose context is the
    # client's KafkaException (e.g. CLUSTER_AUTHORIZATION_FAILED: a login without the right to write).
    found: BaseException | None = exc
    while found is not None and not isinstance(found, KafkaException):
        found = found.__cause__ or found.__context__
    if isinstance(found, KafkaException):
        return f"{found.args[0].name()}: {found.args[0].str()}"
    return f"{type(exc).__name__}: {exc}"


def _timestamp_fields(schema: Mapping[str, Any]) -> list[str]:
    return [
        f["name"] for f in schema["fields"]
        if isinstance(f["type"], dict) and str(f["type"].get("logicalType", "")).startswith("timestamp")
    ]  # fmt: skip


def _decimal_fields(schema: Mapping[str, Any]) -> list[str]:
    """Top-level fields of a decimal type (alone or beside null in a union)."""
    return [
        f["name"] for f in schema["fields"]
        if any(decimal_of(t) is not None for t in (f["type"] if isinstance(f["type"], list) else [f["type"]]))
    ]  # fmt: skip


def _float_fields(schema: Mapping[str, Any]) -> frozenset[str]:
    def floating(t: Any) -> bool:
        if isinstance(t, list):
            return any(floating(b) for b in t)
        return t in ("float", "double") or (isinstance(t, dict) and t.get("type") in ("float", "double"))

    return frozenset(f["name"] for f in schema["fields"] if floating(f["type"]))


class EventProducer:
    """Produces one pipeline's events to its topic, refusing invalid ones to ``<topic>.dlq``.

    Delivery guarantee: at least once per call of :meth:`send`, and exactly once per record within
    a producer session (idempotent producer, ``acks=all``). A record counts as acknowledged only
    when its delivery report arrives; :meth:`flush` returns the counts, and anything not
    acknowledged is reported there, never dropped silently.

    Args:
        settings: Cluster addresses and credentials.
        pipeline: The pipeline whose topic, schema and rules apply.
        schema_version: Which of the pipeline's schema versions to write with (1-based).
            Default: the newest.
        producer_config: librdkafka overrides on top of :data:`PRODUCER_DEFAULTS`.
        clock: Seconds since the epoch, for the ``not_future`` rules. Default ``time.time``.
        prepare: Create topics and register schemas first (both idempotent). Default True.
    """

    def __init__(
        self,
        *,
        settings: Settings,
        pipeline: Pipeline,
        schema_version: int | None = None,
        producer_config: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.time,
        prepare: bool = True,
        rejects_file: Path | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.stats = ProduceStats()
        if prepare:
            if settings.provisions:
                ensure_pipeline_topics(settings, pipeline)
            else:
                require_pipeline_topics(settings, pipeline)
        registered = register_pipeline(settings, pipeline)
        index = (schema_version or len(registered)) - 1
        schema_text = pipeline.schema_text(index + 1)
        schema = json.loads(schema_text)
        parsed = parse_schema(schema)
        self.schema_id = registered[index].schema_id
        self._encoder = WireEncoder(self.schema_id, parsed)
        rules = checked_rules(pipeline)
        self._validator = RecordValidator(rules, schema=schema, parsed_schema=parsed, now=clock)
        self._clock = clock
        self._columnar = ColumnarEncoder(schema, self.schema_id)
        self._columns = ColumnarValidator(
            rules, schema=schema, drop_unknown=pipeline.event.unknown_fields == "drop"
        )
        self._float_fields = _float_fields(schema)
        self._pieces = JsonPieces(schema)
        self._dict_rows = DictRows(schema, drop_unknown=pipeline.event.unknown_fields == "drop")
        self._ts_fields = _timestamp_fields(schema)
        self._decimal_fields = _decimal_fields(schema)
        self._fields = frozenset(f["name"] for f in schema["fields"])
        self._nested = has_nested_types(schema)
        self._drop_unknown = pipeline.event.unknown_fields == "drop"
        self._topic = pipeline.topic.name
        self._dlq = pipeline.topic.dlq
        self._key = pipeline.event.key
        stamp = time.strftime("%Y%m%dT%H%M%S")
        self._rejects = RejectsFile(
            rejects_file or settings.state_dir / "rejects" / f"{pipeline.name}-{stamp}-{os.getpid()}.jsonl"
        )
        config = {
            **settings.kafka.client_config(),
            **PRODUCER_DEFAULTS,
            **(producer_config or {}),
            # Callbacks on the stats, not on self: a bound method would make a reference cycle that
            # keeps a discarded producer (and its librdkafka threads) alive until a GC pass.
            "error_cb": _fatal_recorder(self.stats),
            # librdkafka's log through Python's logging, served by poll and flush: without it a fatal
            # error (a login refused the right to write) reached Python as a bare SystemError.
            "logger": _client_log(self.stats),
        }
        #: Whether the topic's producer reports each delivery, or (the default) only failures: a
        #: report is a Python call per record (~1 us, a seventh of the columnar path's cost), and
        #: once a flush has nothing left queued, every record not reported failed was acknowledged.
        self._reports_each = str(config.get("delivery.report.only.error", False)).lower() in ("false", "0")
        self._producer = Producer({**config, "on_delivery": _delivery_counter(self.stats)})
        # Dead letters need a report each (one the broker finds too large is kept locally): they go
        # through a producer of their own, made for the first one.
        self._dlq_config = {**config, "delivery.report.only.error": False}
        self._dlq_producer: Producer | None = None

    # --- delivery reports (called from poll/flush on this thread) ------------------------------

    def _dlq_callback(self, rejection: Rejection, payload: bytes) -> Callable[[Any, Any], None]:
        def on_delivery(err: KafkaError | None, _msg: Message) -> None:
            if err is None:
                self.stats.dlq_acked += 1
            elif err.code() == KafkaError.MSG_SIZE_TOO_LARGE:
                # The broker refused it for its size: keep it locally rather than lose it.
                self._keep_locally(rejection, payload, err.str())
            else:
                self.stats.dlq_failed += 1
                self.stats.errors[f"dlq: {err.str()}"] += 1

        return on_delivery

    def _keep_locally(self, rejection: Rejection, payload: bytes, error: str) -> None:
        self._rejects.write(rule=rejection.rule, reason=rejection.reason, error=error, payload=payload)
        self.stats.rejects_written += 1
        self.stats.rejects_file = self._rejects.path

    def _produce(
        self, topic: str, key: bytes | None, value: bytes, callback: Any = None, headers: Any = None
    ) -> None:
        """Hand one record to librdkafka.

        Raises:
            ProducerFailed: the producer hit a fatal error (e.g. the broker lost acknowledged
                sequence numbers); nothing more can be sent in this session.
            KafkaException: the record itself was refused (e.g. ``MSG_SIZE_TOO_LARGE``).
        """
        while True:
            if self.stats.fatal is not None:
                raise ProducerFailed(self.stats.fatal)
            try:
                if callback is None:  # the configured default: counts a record of the topic
                    self._producer.produce(topic, value, key, headers=headers)
                else:
                    self._dead_letters().produce(topic, value, key, headers=headers, on_delivery=callback)
                return
            except BufferError:
                # Local queue full: serve delivery reports until there is room (back-pressure).
                self.poll(0.05)
            except KafkaException as exc:
                if exc.args[0].fatal():
                    self._fatal(exc)
                raise

    def _dead_letters(self) -> Producer:
        if self._dlq_producer is None:
            self._dlq_producer = Producer(self._dlq_config)
        return self._dlq_producer

    def _fatal(self, exc: Exception) -> None:
        self.stats.fatal = self.stats.fatal or _describe_fatal(exc)
        _drop_tracebacks(exc)
        raise ProducerFailed(self.stats.fatal) from None

    # --- public API --------------------------------------------------------------------------

    def _coerce(self, record: dict[str, Any]) -> None:
        """JSON input may carry ISO-8601 times (Avro wants epoch milliseconds), and decimals as
        numbers or strings (fastavro wants a ``Decimal``)."""
        for name in self._ts_fields:
            value = record.get(name)
            if isinstance(value, str):
                # An unparsable string is left as is: the schema check then names the field and value.
                with contextlib.suppress(ValueError):
                    parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
                    record[name] = int(parsed.timestamp() * 1000)
        for name in self._decimal_fields:
            value = record.get(name)
            if isinstance(value, str | int | float) and not isinstance(value, bool):
                # A float by its shortest text (0.1 as 0.1, not its binary expansion); a value of
                # more places than the scale is then refused by the schema check, never rounded.
                with contextlib.suppress(ArithmeticError, ValueError):
                    number = Decimal(repr(value) if isinstance(value, float) else str(value).strip())
                    if number.is_finite():
                        record[name] = number

    def send(self, record: dict[str, Any], *, original: bytes | None = None) -> Rejection | None:
        """Validate and produce one record. Returns the rejection if it went to the DLQ.

        No record makes this raise except a fatal producer error (:class:`ProducerFailed`): whatever
        is wrong with the record itself sends it to the DLQ with the reason.

        Args:
            record: The event as a dict of the schema's fields.
            original: The record's original bytes (e.g. its JSON line), kept verbatim in the DLQ.
        """
        try:
            rejection = self._send(record)
        except ProducerFailed:
            raise
        except RecursionError:  # a value nested past Python's recursion limit (a message's repr of it)
            rejection = Rejection("too_deep", "the record nests deeper than Python's recursion limit")
        except KafkaException as exc:
            rejection = Rejection("kafka", f"the broker client refused the record: {exc.args[0].str()}")
        except Exception as exc:  # a record nobody foresaw must not end the command or lose the rest
            rejection = Rejection("unprocessable", f"{type(exc).__name__}: {exc}")
        if rejection is not None:
            self.reject(record, rejection, original=original)
        return rejection

    def _send(self, record: dict[str, Any]) -> Rejection | None:
        # Only a schema of nested types has checks and an encoder that descend into values (fastavro's
        # compiled ones among them, which Python's recursion limit does not stop): bound them first.
        if self._nested and deeper_than(record, MAX_RECORD_DEPTH):
            return Rejection("too_deep", f"the record nests more than {MAX_RECORD_DEPTH} levels deep")
        if isinstance(record, dict):
            if self._drop_unknown:
                for name in [k for k in record if k not in self._fields]:
                    del record[name]
            self._coerce(record)
        rejection = self._validator.check(record)
        if rejection is not None:
            return rejection
        try:
            value = self._encoder.encode(record)
        except (TypeError, ValueError, OverflowError) as exc:
            return Rejection("schema", f"cannot encode as Avro: {exc}")
        key = record[self._key]
        key_bytes = (key if isinstance(key, str) else str(key)).encode("utf-8")
        try:
            self._produce(self._topic, key_bytes, value)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.MSG_SIZE_TOO_LARGE:
                raise
            return Rejection("too_large", f"the encoded record is {len(value):,} bytes: {exc.args[0].str()}")
        self.stats.sent += 1
        if self.stats.sent % 1000 == 0:
            self.poll(0)
        return None

    def reject(self, record: Any, rejection: Rejection, *, original: bytes | None = None) -> None:
        """Send a refused record to the DLQ with the rule and reason in its headers; one the DLQ
        cannot take (too large) is written to the local rejects file instead."""
        if original is None:
            original = _as_json(record)
        key = record.get(self._key) if isinstance(record, dict) else None
        key_bytes = str(key).encode("utf-8", "backslashreplace")[:1024] if key is not None else None
        self.stats.rejected += 1
        self.stats.rejected_by_rule[rejection.rule] += 1
        try:
            self._produce(
                self._dlq, key_bytes, original, self._dlq_callback(rejection, original),
                dlq.headers(pipeline=self.pipeline.name, stage="producer", rule=rejection.rule,
                            reason=rejection.reason),
            )  # fmt: skip
        except KafkaException as exc:
            self._keep_locally(rejection, original, exc.args[0].str())

    def send_json_line(self, line: bytes) -> Rejection | None:
        """Parse one JSON line and :meth:`send` it; unparsable lines go to the DLQ as ``json``."""
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as exc:
            reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            rejection = Rejection("json", f"not valid JSON: {reason}")
            self.reject(None, rejection, original=line)
            return rejection
        return self.send(record, original=line)

    def send_batch(self, records: Sequence[Mapping[str, Any]] | pa.Table | pa.RecordBatch) -> BatchOutcome:
        """Validate and produce many records at once, in order; refused ones go to the DLQ.

        The records are checked and encoded over Arrow columns; a record the columnar checks cannot
        vouch for (see :mod:`lambdalake.columnar.validate`) takes :meth:`send`'s path, so the
        verdicts, reasons and DLQ payloads are exactly :meth:`send`'s. Delivery guarantee as
        :meth:`send`: the counts in :meth:`flush` say what the broker acknowledged.

        Args:
            records: Dicts of the schema's fields, or an Arrow table or record batch whose columns
                are named as the fields (a null is a field the record lacks).
        """
        if isinstance(records, pa.RecordBatch):
            records = pa.Table.from_batches([records])
        if isinstance(records, pa.Table):
            table = records
            plain = self._columnar.plain
            return self._send_table(table, lambda i: self.send(plain(table.slice(i, 1).to_pylist()[0])))
        rows = list(records)
        ready = _Ready(len(rows))
        read = self._dict_rows.read(rows)
        if read is not None:
            self._encode_clear(read[1], read[0], ready)
        return self._produce_in_order(ready, lambda i: self.send(rows[i]))  # type: ignore[arg-type]

    def send_json_lines(self, lines: Sequence[bytes]) -> BatchOutcome:
        """:meth:`send_json_line` for many lines (each one JSON object), read as Arrow tables.

        A line the JSON reader refuses (not an object, invalid UTF-8, a value of another kind than
        the rows before...) goes through :meth:`send_json_line` in its place, and reaches the DLQ
        with its own reason; see :class:`lambdalake.produce.json_pieces.JsonPieces`.
        """
        ready = _Ready(len(lines))
        for positions, table in self._pieces.read(lines):
            self._encode_clear(table, positions, ready)
        return self._produce_in_order(ready, lambda i: self.send_json_line(lines[i]))

    def _send_table(self, table: pa.Table, one: Callable[[int], Rejection | None]) -> BatchOutcome:
        ready = _Ready(table.num_rows)
        self._encode_clear(table, np.arange(table.num_rows), ready)
        return self._produce_in_order(ready, one)

    def _encode_clear(self, table: pa.Table, positions: np.ndarray, ready: _Ready) -> None:
        """Encodes the rows of ``table`` the columnar checks clear into ``ready`` (row ``i`` is
        record ``positions[i]``); the others stay for the per-record path."""
        table = self._columns.known_columns(table)
        suspect = self._columns.suspects(table, now=self._clock()) | self._key_suspects(table)
        clear = np.flatnonzero(~suspect)
        if not len(clear):
            return
        rows = table if len(clear) == table.num_rows else table.take(pa.array(clear))
        try:
            values = self._columnar.encode(self._writer_columns(rows)).to_pylist()
            keys = pc.cast(pc.cast(rows.column(self._key), pa.string()), pa.binary()).to_pylist()
        except (pa.ArrowException, ValueError, TypeError, OverflowError):
            return  # whatever the columns could not take, the per-record path names (never lost)
        for i, key, value in zip(positions[clear].tolist(), keys, values, strict=True):
            ready.keys[i] = key
            ready.values[i] = value

    def _produce_in_order(self, ready: _Ready, one: Callable[[int], Rejection | None]) -> BatchOutcome:
        """Every record in order: an encoded one straight to the topic, the others by ``one(i)``."""
        outcome = BatchOutcome()
        topic, values, keys = self._topic, ready.values, ready.keys
        produce, stats = self._producer.produce, self.stats
        for i in range(len(values)):
            value = values[i]
            if value is not None:
                if stats.fatal is not None:
                    raise ProducerFailed(stats.fatal)
                try:
                    try:
                        produce(topic, value, keys[i])
                    except BufferError:
                        self._produce(topic, keys[i], value)  # waits for room in the queue
                except KafkaException as exc:
                    if exc.args[0].fatal():
                        self._fatal(exc)
                    # Refused by the client (too large...): the per-record path names why.
                else:
                    stats.sent += 1
                    if stats.sent % 1000 == 0:
                        self.poll(0)
                    continue
            outcome.one_by_one += 1
            rejection = one(i)
            if rejection is not None:
                outcome.refused.append((i, rejection))
        outcome.accepted = len(values) - len(outcome.refused)
        return outcome

    def _key_suspects(self, table: pa.Table) -> np.ndarray:
        """Rows whose Kafka key the columns cannot make as :meth:`send` does (``str(key)``)."""
        if self._key not in table.column_names:
            return np.ones(table.num_rows, dtype=bool)
        column = table.column(self._key)
        if not (pa.types.is_string(column.type) or pa.types.is_signed_integer(column.type)):
            return np.ones(table.num_rows, dtype=bool)
        return np.asarray(column.is_null().to_numpy(zero_copy_only=False), dtype=bool)

    def _writer_columns(self, rows: pa.Table) -> pa.Table:
        """Cleared rows with integers of float fields as doubles (as fastavro writes them)."""
        for name in self._float_fields & set(rows.column_names):
            index = rows.column_names.index(name)
            column = rows.column(index)
            if not pa.types.is_floating(column.type) and not pa.types.is_null(column.type):
                rows = rows.set_column(index, name, pc.cast(column, pa.float64()))
        return rows

    def poll(self, timeout: float = 0) -> None:
        """Serve delivery reports for up to ``timeout`` seconds.

        Raises:
            ProducerFailed: the producer hit a fatal error.
        """
        try:
            self._producer.poll(timeout)
            if self._dlq_producer is not None:
                self._dlq_producer.poll(0)
        except (KafkaException, SystemError) as exc:
            self._fatal(exc)

    def flush(self, timeout: float = 120.0) -> ProduceStats:
        """Wait for every delivery report (up to ``timeout``); what is still queued counts as failed.

        The topic's producer reports failures only (by default): a record it no longer holds and
        did not report failed was acknowledged, so ``acked`` is exact once nothing is left queued,
        and what is left counts as not acknowledged (after a fatal error, every record does)."""
        deadline = time.monotonic() + timeout
        remaining = 0
        for producer in (self._producer, self._dlq_producer):
            if producer is None:
                continue
            try:
                left = producer.flush(max(0.0, deadline - time.monotonic()))
            except (KafkaException, SystemError) as exc:
                # A fatal error raises from flush (confluent-kafka then calls the delivery callbacks
                # with that exception still set, which surfaces as SystemError): every record still
                # queued fails with it, and the counts say how many were not acknowledged.
                self.stats.fatal = self.stats.fatal or self.stats.fatal_log or _describe_fatal(exc)
                _drop_tracebacks(exc)
                left = len(producer)
            if producer is self._producer and not self._reports_each:
                # After a fatal error the reports of what was in flight need not all arrive, and
                # the broker may have lost what it acknowledged (what makes an idempotent producer
                # fail fatally): nothing counts as acknowledged then, the safe side (a record sent
                # again counts once in the views).
                self.stats.acked = 0 if self.stats.fatal else self.stats.sent - self.stats.failed - left
            remaining += left
        if remaining:
            self.stats.errors[f"{remaining} record(s) still queued after {timeout:g}s"] += 1
        self._rejects.close()
        return self.stats


def _as_json(record: Any) -> bytes:
    """The record as the DLQ keeps it: JSON, or (nested past Python's recursion limit, or holding
    what JSON cannot) a JSON object saying so with the record's key fields' text where it has them."""
    try:
        return json.dumps(record, default=str).encode("utf-8", "backslashreplace")
    except (RecursionError, ValueError, TypeError) as exc:
        plain = (str, int, float, bool)
        items = record.items() if isinstance(record, dict) else ()
        shallow = {k: v for k, v in items if isinstance(k, str) and isinstance(v, plain)}
        note = {"lambdalake.unserializable": f"{type(exc).__name__}: {exc}", **shallow}
        return json.dumps(note, default=str).encode("utf-8", "backslashreplace")
