"""Prometheus metrics of the serving API: its own request latencies, and on each scrape the state of
every pipeline (stream lag per partition, speed view freshness, DLQ records, active batch)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from lambdalake.serving.client import ServingClient
from lambdalake.settings import Settings
from lambdalake.status import pipeline_status

log = logging.getLogger("lambdalake.serving")

#: Seconds; fine-grained below 50 ms, where a merged query should answer.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class PipelineCollector(Collector):
    """Gauges read fresh on every scrape (nothing is cached between scrapes)."""

    def __init__(self, settings: Settings, client: ServingClient) -> None:
        self.settings = settings
        self.client = client

    def collect(self) -> Iterator[GaugeMetricFamily]:
        lag = GaugeMetricFamily(
            "lambdalake_stream_lag_records", "Records on the topic the speed job has not archived yet",
            labels=["pipeline", "partition"],
        )  # fmt: skip
        fresh = GaugeMetricFamily(
            "lambdalake_speed_view_last_batch_age_seconds",
            "Seconds since the micro-batch that last wrote the speed view", labels=["pipeline", "view"],
        )  # fmt: skip
        dlq = GaugeMetricFamily(
            "lambdalake_dlq_records", "Records in the pipeline's dead-letter topic", labels=["pipeline"]
        )
        version = GaugeMetricFamily(
            "lambdalake_batch_active_version", "The active batch version", labels=["pipeline"]
        )
        horizon = GaugeMetricFamily(
            "lambdalake_batch_horizon_epoch", "The active batch's horizon (ingest epoch)", labels=["pipeline"]
        )
        up = GaugeMetricFamily(
            "lambdalake_status_problems", "Sources the status could not read", labels=["pipeline"]
        )
        for name in self.client.pipeline_names():
            try:
                status = pipeline_status(
                    self.settings, self.client.pipeline(name), session=self.client.session
                )
            except Exception as exc:  # a broken pipeline file must not break the scrape
                log.warning("status of %s: %s", name, exc)
                up.add_metric([name], 1)
                continue
            for p in status.partitions:
                lag.add_metric([name, str(p.partition)], p.lag)
            for v in status.views:
                if v.seconds_since is not None:
                    fresh.add_metric([name, v.view], v.seconds_since)
            if status.dlq_records is not None:
                dlq.add_metric([name], status.dlq_records)
            if status.batch_version is not None:
                version.add_metric([name], status.batch_version)
                horizon.add_metric([name], status.horizon or 0)
            up.add_metric([name], len(status.problems))
        yield from (lag, fresh, dlq, version, horizon, up)


def make_registry(settings: Settings, client: ServingClient) -> tuple[CollectorRegistry, Histogram]:
    """A registry with the request latency histogram and the pipeline gauges."""
    registry = CollectorRegistry()
    latency = Histogram(
        "lambdalake_request_seconds", "Serving API request latency", ["route", "status"],
        buckets=LATENCY_BUCKETS, registry=registry,
    )  # fmt: skip
    registry.register(PipelineCollector(settings, client))
    return registry, latency
