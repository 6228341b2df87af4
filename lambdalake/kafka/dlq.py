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


def headers(
    *, pipeline: str, stage: Stage, rule: str, reason: str, source: str | None = None
) -> list[tuple[str, bytes]]:
    out = [
        (RULE, rule.encode()),
        (REASON, reason.encode()),
        (PIPELINE, pipeline.encode()),
        (STAGE, stage.encode()),
    ]
    if source is not None:
        out.append((SOURCE, source.encode()))
    return out
