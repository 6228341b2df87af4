"""The identity index: every identity a pipeline's published batch views count, with the Kafka
coordinate of its first delivery, so an incremental run deduplicates its new rows against the whole
history by reading 16 bytes per identity instead of all of the master dataset (:mod:`batch.incremental`)."""

from __future__ import annotations

from typing import Literal

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from lambdalake.batch.run import RUN_ID, BatchRun
from lambdalake.delta import commit_metadata, open_table
from lambdalake.identity import spark_hashes
from lambdalake.layout import identities_path
from lambdalake.pipeline import Pipeline
from lambdalake.settings import Settings
from lambdalake.spark.delta import read_table, write_table
from lambdalake.spark.views import INGEST_TS

#: What the index keeps of each identity's first delivery (its coordinate).
COORDINATE = ("_topic", "_partition", "_offset", INGEST_TS)
#: The index's table properties: no column statistics. An incremental run reads the whole index, so
#: statistics skip nothing, and collecting them was a fifth of a write's time (the benchmarks log).
TABLE_PROPERTIES = {"delta.dataSkippingNumIndexedCols": "0"}
#: The index's identity: 128 bits, the two hashes of :mod:`lambdalake.identity` (the speed layer's
#: deduplication compares identities by the same two): two identities are taken for one only on a
#: 128-bit collision.
HASHES = ("_id_h1", "_id_h2")


def identity_hashes(df: DataFrame, pipeline: Pipeline) -> list[Column]:
    """:data:`HASHES` of each row's identity (:func:`lambdalake.identity.spark_hashes`)."""
    h1, h2 = spark_hashes(df, pipeline.event.identity)
    return [h1.alias(HASHES[0]), h2.alias(HASHES[1])]


class IdentityIndex:
    """Every identity the published views count (:data:`HASHES`), with the coordinate of its first
    delivery: a Delta table beside the views (``<storage_root>/identities/<pipeline>``), rewritten by
    a full run and appended to by an incremental one, each commit naming its run.

    Args:
        settings: The storage root.
        pipeline: The pipeline (its identity columns).
    """

    def __init__(self, settings: Settings, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.path = identities_path(settings.storage_root, pipeline.name)

    def run_id(self) -> str | None:
        """The run whose commit is the newest (None: no index)."""
        table = open_table(self.path)
        return None if table is None else commit_metadata(table.history(1)[0]).get(RUN_ID)

    def read(self, spark: SparkSession) -> DataFrame | None:
        return read_table(spark, self.path)

    def write(self, firsts: DataFrame, run: BatchRun, *, mode: Literal["append", "overwrite"]) -> int:
        """Record the first deliveries ``firsts`` in one commit naming the run (``overwrite``: they are
        the whole index); returns the index's version."""
        rows = firsts.select(*identity_hashes(firsts, self.pipeline), *COORDINATE)
        return write_table(
            rows, self.path, mode=mode, properties=TABLE_PROPERTIES,
            metadata={
                RUN_ID: run.run_id, "lambdalake.horizon": str(run.horizon),
            },
        )  # fmt: skip


#: Columns :func:`classify` adds: the identity is in the index; and the delivery precedes the
#: indexed first delivery.
KNOWN = "_known"
EARLIER = "_earlier"


#: The most first deliveries whose identities are sent to every task reading the index (a hash
#: table of identities per executor); more are joined by shuffling both sides.
BROADCAST_IDENTITIES = 4_000_000


def classify(firsts: DataFrame, index: DataFrame | None, pipeline: Pipeline, *, rows: int) -> DataFrame:
    """``firsts`` (first deliveries per identity of the rows read, ``rows`` of them) with
    :data:`KNOWN` and :data:`EARLIER`. Unknown identities are new events; a known one is a copy the
    views counted (or the very delivery they counted), unless it is earlier.

    The index is read once, two longs a row, streamed past the hashes of the identities read
    (broadcast when they are few): only the index rows of those identities (copies: few) are kept,
    with their coordinates, and joined back."""
    if index is None:
        return firsts.withColumn(KNOWN, F.lit(False)).withColumn(EARLIER, F.lit(False))
    order = ("_ingest_ts", "_partition", "_offset", "_topic")
    hashed = firsts.select("*", *identity_hashes(firsts, pipeline))
    wanted = hashed.select(*HASHES)
    wanted = F.broadcast(wanted) if rows <= BROADCAST_IDENTITIES else wanted
    matched = index.join(wanted, list(HASHES), "left_semi").select(
        *HASHES, *[F.col(c).alias(f"_i{c}") for c in order], F.lit(True).alias(KNOWN)
    )
    joined = hashed.alias("_f").join(matched.alias("_i"), list(HASHES), "left")
    known = F.coalesce(F.col(f"_i.{KNOWN}"), F.lit(False))
    earlier = F.struct(*[F.col(f"_f.{c}") for c in order]) < F.struct(*[F.col(f"_i._i{c}") for c in order])
    return joined.select(
        *[F.col(f"_f.{c}") for c in firsts.columns], known.alias(KNOWN), (known & earlier).alias(EARLIER)
    )
