"""The dead-letter convention: a refused record goes to ``<topic>.dlq`` with its reason in headers.

The value is the original payload, unchanged (JSON from the producer's input, or the raw Kafka value
when a later stage could not decode it), so a fixed record can be re-published as is.
"""

from __future__ import annotations

from typing import Literal

RULE = "lambdalake.rule"
REASON = "lambdalake.reason"
PIPELINE = "lambdalake.pipeline"
STAGE = "lambdalake.stage"
SOURCE = "lambdalake.source"  # topic/partition/offset of the original record, when it had one

Stage = Literal["producer", "speed", "batch"]
#: Reasons can quote a record's value: keep the header small whatever the record holds.
MAX_REASON_CHARS = 2000


def _text(value: str) -> bytes:
    # backslashreplace: a lone surrogate from a JSON input must not make the DLQ write itself fail.
    return value.encode("utf-8", "backslashreplace")


def headers(
    *, pipeline: str, stage: Stage, rule: str, reason: str, source: str | None = None
) -> list[tuple[str, bytes]]:
    if len(reason) > MAX_REASON_CHARS:
        reason = reason[: MAX_REASON_CHARS - 20] + f"... ({len(reason)} chars)"
    out = [(RULE, _text(rule)), (REASON, _text(reason)), (PIPELINE, _text(pipeline)), (STAGE, _text(stage))]
    if source is not None:
        out.append((SOURCE, _text(source)))
    return out
