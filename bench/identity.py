"""The identity hash against the per-layer hashes it replaced, each pair in one process, in turn.

- ``arrow``: the speed layer's dedup hashing of one task's micro-batch (``--rows``, the offers
  identity: a string and a long, and the ledger's: a string and a nullable long), with
  :func:`lambdalake.identity.arrow_hashes` against the pandas ``hash_pandas_object`` it replaced.
- ``spark``: the batch's identity stage, the index hashes of ``--events`` rows computed and summed
  by Spark, with :func:`lambdalake.identity.spark_hashes` against the expressions it replaced.

    python -m bench.identity [--rows 20000] [--events 10000000] [--rounds 5] [--skip-spark]

Writes ``bench/results/identity.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import pandas as pd
import pyarrow as pa

from bench.common import write_result
from lambdalake.identity import arrow_hashes

_OLD_KEYS = ("lambdalake-id-k1", "lambdalake-id-k2")


def old_arrow_hashes(table: pa.Table, columns: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The speed layer's hashing before lambdalake.identity (through pandas)."""
    frame = table.select(columns).to_pandas()
    return tuple(pd.util.hash_pandas_object(frame, index=False, hash_key=k).to_numpy() for k in _OLD_KEYS)  # type: ignore[return-value]


def _times(fn: Callable[[], object], rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def arrow_pairs(rows: int, rounds: int) -> dict[str, dict[str, float]]:
    rng = np.random.default_rng(7)
    offers = pa.table({
        "offer_id": pa.array([f"offer-{i % 5000:06d}" for i in range(rows)]),
        "version": pa.array(rng.integers(1, 10**6, rows), pa.int64()),
    })  # fmt: skip
    refs = rng.integers(2**60, 2**60 + 10**6, rows)
    ledger = pa.table({
        "account": pa.array([f"acct-{i % 40:02d}" for i in range(rows)]),
        "ref": pa.array([None if i % 50 == 0 else int(r) for i, r in enumerate(refs)], pa.int64()),
    })  # fmt: skip
    out = {}
    for name, table, cols in (
        ("offers", offers, ["offer_id", "version"]),
        ("ledger", ledger, ["account", "ref"]),
    ):
        new = old = []
        for _ in range(2):  # in turn, twice: the second pass is the one kept
            new = _times(lambda t=table, c=cols: arrow_hashes(t, c), rounds)
            old = _times(lambda t=table, c=cols: old_arrow_hashes(t, c), rounds)
        out[name] = {
            "rows": rows, "new_median_ms": 1000 * statistics.median(new),
            "old_median_ms": 1000 * statistics.median(old),
            "new_min_ms": 1000 * min(new), "old_min_ms": 1000 * min(old),
            "ratio_new_over_old": statistics.median(new) / statistics.median(old),
        }  # fmt: skip
        print(name, {k: round(v, 3) for k, v in out[name].items()})
    return out


def spark_pair(events: int, rounds: int) -> dict[str, float]:
    from pyspark.sql import functions as F

    from lambdalake.identity import spark_hashes
    from lambdalake.settings import Settings
    from lambdalake.spark.session import command_session

    with command_session(Settings(), "bench-identity", workload="batch", events=events) as spark:
        df = (
            spark.range(events)
            .select(
                F.concat(F.lit("offer-"), (F.col("id") % 100_000).cast("string")).alias("offer_id"),
                (F.col("id") % 1_000_003).alias("version"),
            )
            .cache()
        )
        df.count()

        def new() -> None:
            h1, h2 = spark_hashes(df, ["offer_id", "version"])
            df.select(F.sum(h1 % 1000), F.sum(h2 % 1000)).collect()

        def old() -> None:
            parts = [
                df.offer_id.isNull(),
                df.offer_id.cast("binary"),
                df.version.isNull(),
                df.version.cast("long"),
            ]
            h1, h2 = F.xxhash64(*parts), F.xxhash64(F.lit("lambdalake-id"), *parts)
            df.select(F.sum(h1 % 1000), F.sum(h2 % 1000)).collect()

        new_t, old_t = [], []
        for _ in range(rounds):  # in turn
            new_t += _times(new, 1)
            old_t += _times(old, 1)
        later = max(1, rounds // 2)
        result = {
            "events": events, "new_median_s": statistics.median(new_t[later:]),
            "old_median_s": statistics.median(old_t[later:]), "new_all_s": new_t, "old_all_s": old_t,
        }  # fmt: skip
        result["ratio_new_over_old"] = result["new_median_s"] / result["old_median_s"]
        print("spark", result)
        return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--events", type=int, default=10_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip-spark", action="store_true")
    args = parser.parse_args()
    result: dict[str, object] = {"arrow": arrow_pairs(args.rows, args.rounds)}
    if not args.skip_spark:
        result["spark"] = spark_pair(args.events, args.rounds)
    write_result("identity", result)


if __name__ == "__main__":
    main()
