"""The speed layer: Spark Structured Streaming from Kafka into the master dataset and speed views."""
