"""A schema registry speaking the Confluent Schema Registry REST API (the subset clients use).

State lives in a compacted Kafka topic (``_schemas``) keyed as Confluent's is, so a restart replays
the topic and every id, version and config comes back. One instance at a time: there is no leader
election, which a production deployment gets from Confluent Schema Registry or Karapace instead.
"""
