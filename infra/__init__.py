"""Embedded services for one-machine runs: a Kafka-protocol broker, a schema registry, Cassandra.

Production points the settings at real clusters instead; nothing outside this package starts a
process. Each service keeps its state under ``Settings.state_dir`` with a PID file and a log.
"""
