"""lambdalake: a Kafka-backed lambda-architecture data platform.

This package holds what every layer shares: settings, pipeline definitions, Avro and registry helpers,
Kafka clients, producers and the command line. The layers live beside it: ``infra`` (embedded
services), ``speed`` (streaming), ``batch`` and ``serving``.
"""

__version__ = "0.2.0"
