"""The speed job's tuning (:class:`SpeedOptions`) and which queries it runs."""

from __future__ import annotations

from dataclasses import dataclass

from lambdalake.pipeline import LatestView, Pipeline
from lambdalake.settings import Settings


@dataclass(frozen=True)
class SpeedOptions:
    """Tuning of the speed job.

    Args:
        trigger_seconds: Micro-batch interval; 0 starts the next batch as soon as one ends. Default 0.
        max_offsets_per_trigger: Records per micro-batch at most (bounds catch-up batches). Default 200k.
        starting_offsets: Where a query without a checkpoint starts. Default ``earliest``.
        broker_wait_s: How long the Kafka source retries a broker that does not answer (a restart)
            before the job stops with an error naming the broker. Default 120 s.
        fail_on_data_loss: Stop with an error naming the offsets when the broker lost records the
            job had read (default True); False goes on past them with a warning.

    Each Kafka partition's share of a micro-batch is read whole by one task (Spark's Kafka source
    without ``minPartitions`` or ``maxRecordsPerPartition``): deduplication needs a partition's
    records in one task, and each task has a fixed cost (more tasks than partitions made a batch
    slower). Raise the topic's partitions to use more cores.
    """

    trigger_seconds: float = 0.0
    max_offsets_per_trigger: int = 200_000
    starting_offsets: str = "earliest"
    broker_wait_s: float = 120.0
    fail_on_data_loss: bool = True


def runs_realtime_query(settings: Settings, pipeline: Pipeline) -> bool:
    """Whether a speed job of ``pipeline`` writes its latest views from a Real-time query of their
    own (``<pipeline>-latest``) beside the main one: ``speed.latest`` is ``realtime`` and it has one."""
    return settings.speed.latest == "realtime" and any(isinstance(v, LatestView) for v in pipeline.views)
