"""Producers: edge validation, registered Avro, idempotent produce; synthetic event streams."""
