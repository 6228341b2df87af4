"""Spark code both layers share: the session, the Kafka source, Avro decoding, view compilation."""
