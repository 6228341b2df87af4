"""The peer of the speed layer in ``bench.peers``: quix-streams computing the two offers views.

Runs in the peer's own virtualenv (quix-streams pins confluent-kafka below the project's), so it
imports nothing from lambdalake. The same two views as ``pipelines/offers.toml``, written the way a
quix-streams user would:

- ``offer_latest``: per offer the update with the highest version;
- ``merchant_offers_hourly``: per merchant and hour of ``updated_at``, count, sum/min/max/avg of
  the price and sum of the stock.

Copies of one update (same offer and version) count once, as in lambdalake: the topic is keyed by
offer, so a state per offer remembers the versions seen. Windows are by event time with a grace
long enough that no generated event is dropped as late. Both sinks write to Cassandra in batches
when quix-streams checkpoints (every ``--commit-interval`` s), and the offsets are committed after
the sinks flushed (at-least-once).

    peer-venv/bin/python bench/peer_quix.py --broker HOST:PORT --registry URL --topic T --group G
        --cassandra-port P --keyspace K [--commit-interval 5.0] --state-dir DIR
"""

from __future__ import annotations

import argparse
import logging
from datetime import UTC, datetime
from typing import Any

from cassandra.cluster import Cluster
from cassandra.concurrent import execute_concurrent_with_args
from quixstreams import Application
from quixstreams.dataframe.windows import Count, Max, Mean, Min, Sum
from quixstreams.models.serializers.avro import AvroDeserializer
from quixstreams.models.serializers.schema_registry import SchemaRegistryClientConfig
from quixstreams.sinks.base import BatchingSink, SinkBatch

HOUR_MS = 3_600_000
LATEST_COLUMNS = [
    "offer_id", "merchant_id", "title", "price_cents", "currency", "stock", "status", "version",
    "updated_at", "promo_code",
]  # fmt: skip
HOURLY_COLUMNS = [
    "merchant_id", "window_start", "updates", "price_sum", "price_min", "price_max", "price_avg",
    "stock_sum",
]  # fmt: skip


def create_tables(session: Any, keyspace: str) -> None:
    session.execute(
        f"CREATE KEYSPACE IF NOT EXISTS {keyspace} WITH replication = "
        "{'class': 'SimpleStrategy', 'replication_factor': 1}"
    )
    session.execute(
        f"CREATE TABLE IF NOT EXISTS {keyspace}.offer_latest (offer_id text PRIMARY KEY, "
        "merchant_id text, title text, price_cents bigint, currency text, stock int, status text, "
        "version bigint, updated_at timestamp, promo_code text)"
    )
    session.execute(
        f"CREATE TABLE IF NOT EXISTS {keyspace}.merchant_offers_hourly (merchant_id text, "
        "window_start timestamp, updates bigint, price_sum bigint, price_min bigint, price_max bigint, "
        "price_avg double, stock_sum bigint, PRIMARY KEY (merchant_id, window_start))"
    )


class CassandraSink(BatchingSink):
    """Upserts a checkpoint's rows, the last row of each primary key only."""

    def __init__(self, session: Any, table: str, columns: list[str], key: list[str]) -> None:
        super().__init__()
        marks = ", ".join("?" * len(columns))
        self._statement = session.prepare(f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks})")
        self._session, self._columns, self._key = session, columns, key

    def write(self, batch: SinkBatch) -> None:
        last: dict[tuple, tuple] = {}
        for item in batch:
            row = item.value
            last[tuple(row[k] for k in self._key)] = tuple(row.get(c) for c in self._columns)
        for ok, result in execute_concurrent_with_args(
            self._session, self._statement, list(last.values()), concurrency=64, raise_on_first_error=False
        ):
            if not ok:
                raise result


def first_copies(value: dict, state: Any) -> dict:
    """Marks copies of an update already seen, and whether it is the offer's newest so far (a state
    entry per version seen: one lookup an event however many updates an offer has)."""
    version = value["version"]
    seen = f"v{version}"
    newest = state.get("newest", None)
    value["_copy"] = state.exists(seen)
    value["_newer"] = newest is None or version > newest
    value["updated_at"] = event_time(value, None, 0, None)  # epoch ms: the repartition topic is JSON
    if not value["_copy"]:
        state.set(seen, True)
        if value["_newer"]:
            state.set("newest", version)
    return value


def event_time(value: Any, _headers: Any, timestamp: int, _type: Any) -> int:
    updated = value.get("updated_at") if isinstance(value, dict) else None
    if isinstance(updated, datetime):
        return int(updated.timestamp() * 1000)
    return updated if isinstance(updated, int) else timestamp


def hourly_row(result: dict, key: Any) -> dict:
    return {
        "merchant_id": key.decode() if isinstance(key, bytes) else key,
        "window_start": datetime.fromtimestamp(result["start"] / 1000, tz=UTC),
        **{c: result[c] for c in HOURLY_COLUMNS[2:]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--broker", required=True)
    parser.add_argument("--registry", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--cassandra-port", type=int, required=True)
    parser.add_argument("--keyspace", required=True)
    parser.add_argument("--commit-interval", type=float, default=5.0, help="quix-streams' default: 5.0")
    parser.add_argument("--state-dir", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    session = Cluster(["127.0.0.1"], port=args.cassandra_port).connect()
    create_tables(session, args.keyspace)
    session.set_keyspace(args.keyspace)

    app = Application(
        broker_address=args.broker,
        consumer_group=args.group,
        auto_offset_reset="earliest",
        commit_interval=args.commit_interval,
        state_dir=args.state_dir,
        loglevel="WARNING",
    )
    topic = app.topic(
        args.topic,
        key_deserializer="str",
        value_deserializer=AvroDeserializer(
            schema_registry_client_config=SchemaRegistryClientConfig(url=args.registry)
        ),
        timestamp_extractor=event_time,
    )
    sdf = app.dataframe(topic)
    sdf = sdf.apply(first_copies, stateful=True)
    sdf = sdf.filter(lambda v: not v["_copy"])

    latest = sdf.filter(lambda v: v["_newer"])
    latest = latest.apply(lambda v: {c: v.get(c) for c in LATEST_COLUMNS})
    latest.sink(CassandraSink(session, "offer_latest", LATEST_COLUMNS, ["offer_id"]))

    hourly = sdf.group_by("merchant_id")
    hourly = hourly.tumbling_window(duration_ms=HOUR_MS, grace_ms=7 * 24 * HOUR_MS).agg(
        updates=Count(),
        price_sum=Sum("price_cents"),
        price_min=Min("price_cents"),
        price_max=Max("price_cents"),
        price_avg=Mean("price_cents"),
        stock_sum=Sum("stock"),
    )
    hourly = hourly.current().apply(lambda result, key, *_: hourly_row(result, key), metadata=True)
    hourly.sink(
        CassandraSink(session, "merchant_offers_hourly", HOURLY_COLUMNS, ["merchant_id", "window_start"])
    )
    app.run()


if __name__ == "__main__":
    main()
