"""Kafka clients shared by every layer: admin (topics), the dead-letter convention."""
