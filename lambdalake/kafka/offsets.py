"""Offsets by time and by position: what replay, ``speed reset`` and ``offsets reset`` resolve
ranges with. With LogAppendTime, offsets-for-times is exact: the first offset whose append time is
at or after a moment, the same on every call."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from lambdalake.errors import ConfigurationError, LambdalakeError, ServiceUnavailable
from lambdalake.settings import Settings

#: How long a request waits out a partition without a leader: one just created, or a broker that is
#: starting again (Kafka answers NOT_LEADER_FOR_PARTITION until its controller has elected one).
LEADER_WAIT_S = 30.0

T = TypeVar("T")

#: What a partition answers while it has no leader yet (librdkafka marks none of them retriable),
#: and what a request to a leader that just died fails with (its connection refused, or its handle
#: dropped from the metadata) before the new leader is known.
_ELECTING = {
    KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError._UNKNOWN_PARTITION,
    KafkaError._DESTROY_BROKER,
    KafkaError._TRANSPORT,
}


def while_electing(call: Callable[[], T], timeout: float = LEADER_WAIT_S) -> T:
    """``call()``, asked again while Kafka answers with a retriable error, for ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except KafkaException as exc:
            err = exc.args[0]
            if not (err.retriable() or err.code() in _ELECTING) or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def lookup_consumer(settings: Settings, group: str | None = None) -> Consumer:
    """A consumer that never subscribes (only asks offsets and reads records at them, or commits
    offsets for ``group``); the caller closes it."""
    return Consumer(
        {**settings.kafka.client_config(), "group.id": group or f"lambdalake-offsets-{uuid.uuid4().hex[:8]}",
         "enable.auto.commit": False, "fetch.queue.backoff.ms": 0}
    )  # fmt: skip


@contextmanager
def offset_consumer(settings: Settings, group: str | None = None) -> Iterator[Consumer]:
    """:func:`lookup_consumer` for a block, closed after it; a broker that does not answer becomes
    :class:`ServiceUnavailable`."""
    consumer = lookup_consumer(settings, group)
    try:
        yield consumer
    except KafkaException as exc:
        raise ServiceUnavailable(
            f"Kafka at {settings.kafka.bootstrap_servers} did not answer: {exc.args[0].str()}",
            fix="start the broker (`lambdalake up`) or set LAMBDALAKE_KAFKA__BOOTSTRAP_SERVERS",
        ) from None
    finally:
        consumer.close()


def partitions(consumer: Consumer, topic: str, timeout: float = 30) -> list[int]:
    meta = consumer.list_topics(topic, timeout=timeout).topics.get(topic)
    if meta is None or meta.error is not None or not meta.partitions:
        raise ConfigurationError(
            f"topic {topic!r} does not exist",
            fix="check the name (`lambdalake pipelines`), or create a pipeline's topics with "
            "`lambdalake deploy`",
        )
    return sorted(meta.partitions)


def watermarks(consumer: Consumer, topic: str, timeout: float = 30) -> dict[int, tuple[int, int]]:
    """Each partition's (first offset, end offset)."""
    return {
        p: while_electing(
            lambda p=p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout)
        )
        for p in partitions(consumer, topic, timeout)
    }


def offsets_at(consumer: Consumer, topic: str, ms: int, timeout: float = 30) -> dict[int, int]:
    """Per partition, the first offset appended at or after ``ms`` (the end offset if none)."""
    ends = watermarks(consumer, topic, timeout)
    asked = [TopicPartition(topic, p, ms) for p in ends]
    return {tp.partition: tp.offset if tp.offset >= 0 else ends[tp.partition][1]
            for tp in consumer.offsets_for_times(asked, timeout=timeout)}  # fmt: skip


def record_at(
    consumer: Consumer, topic: str, partition: int, offset: int, timeout: float = 30
) -> Message | None:
    """The record at ``offset``, or the next one present (a compacted log); None if none came in time."""
    consumer.assign([TopicPartition(topic, partition, offset)])
    try:
        msg = consumer.poll(timeout)
        while msg is not None and msg.error() is not None:
            msg = consumer.poll(timeout)
        return msg
    finally:
        consumer.unassign()


def record_time(consumer: Consumer, topic: str, partition: int, offset: int, timeout: float = 30) -> int:
    """The timestamp (ms) of the record at ``offset`` (or the next one present, in a compacted log)."""
    msg = record_at(consumer, topic, partition, offset, timeout)
    if msg is None:
        raise LambdalakeError(f"no record at {topic}-{partition}@{offset} within {timeout:.0f}s")
    return msg.timestamp()[1]


def parse_offsets(text: str, option: str) -> dict[int, int]:
    """``'0:120,1:98'`` -> ``{0: 120, 1: 98}`` (raises naming the option and the part)."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        p, sep, o = part.partition(":")
        if not sep or not p.strip().isdigit() or not o.strip().lstrip("-").isdigit():
            raise ConfigurationError(
                f"{option} {text!r}: {part!r} is not PARTITION:OFFSET", fix=f"e.g. {option} '0:120,1:98'"
            )
        out[int(p)] = int(o)
    if not out:
        raise ConfigurationError(f"{option} {text!r} names no partition", fix=f"e.g. {option} '0:120,1:98'")
    return out


@dataclass(frozen=True)
class GroupReset:
    """One partition of a consumer-group reset: the committed offset and the new one."""

    partition: int
    current: int | None
    target: int


def reset_group(
    settings: Settings, group: str, topic: str, targets: Mapping[int, int], *, dry_run: bool = False
) -> list[GroupReset]:
    """Move ``group``'s committed offsets on ``topic`` to ``targets`` (clamped to each partition's
    first and end offsets), as ``kafka-consumer-groups --reset-offsets`` does. The group's consumers
    must be stopped: they would commit over the reset."""
    with offset_consumer(settings, group) as consumer:
        bounds = watermarks(consumer, topic)
        unknown = sorted(set(targets) - set(bounds))
        if unknown:
            raise ConfigurationError(
                f"topic {topic!r} has no partition {unknown}", fix=f"partitions are {sorted(bounds)}"
            )
        committed = {
            tp.partition: (tp.offset if tp.offset >= 0 else None)
            for tp in consumer.committed([TopicPartition(topic, p) for p in targets], timeout=30)
        }
        plan = [
            GroupReset(p, committed.get(p), min(max(o, bounds[p][0]), bounds[p][1]))
            for p, o in sorted(targets.items())
        ]
        if not dry_run:
            consumer.commit(
                offsets=[TopicPartition(topic, r.partition, r.target) for r in plan], asynchronous=False
            )
    return plan
