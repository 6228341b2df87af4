"""The churn soak as a benchmark: three nodes of each service, steady load and 20 HTTP clients while
brokers, Cassandra nodes and Spark workers are killed and restarted at random, and what the clients
were answered.

It runs the soak of ``tests/test_cluster.py`` (one implementation: the test asserts what this
reports) for ``--seconds`` of churn, and writes ``bench/results/churn.json``: queries made, server
errors (5xx) and 503s with their longest stretch, p99 latency with and without churn, the kills,
the batch runs beside it, records acknowledged and in the topic, merged answers unlike the
reference, and the nodes whose own copy (read alone at ONE) differs from it.

    python -m bench.churn [--seconds 1800] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1800.0, help="seconds of churn")
    parser.add_argument("--seed", type=int, default=None, help="the churn's seed (random by default)")
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    report = RESULTS / "churn.json"
    env = {**os.environ, "LAMBDALAKE_CHURN_S": str(args.seconds), "LAMBDALAKE_CHURN_REPORT": str(report)}
    if args.seed is not None:
        env["LAMBDALAKE_CHURN_SEED"] = str(args.seed)
    # The module's cluster fixture starts the three nodes of each; only the soak runs on it.
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
         "tests/test_cluster.py", "-k", "churn_soak"],
        env=env, cwd=Path(__file__).parent.parent,
    )  # fmt: skip
    if report.exists():
        print(json.dumps(json.loads(report.read_text()), indent=2))
    sys.exit(result.returncode)


if __name__ == "__main__":
    main()
