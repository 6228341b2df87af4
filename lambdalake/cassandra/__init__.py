"""Cassandra access shared by the layers: sessions, view tables (DDL), idempotent upserts."""
