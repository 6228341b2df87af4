"""Start and stop times of the embedded broker and Cassandra, against another tree's in the same run.

Each round starts one service in a fresh state folder (a first start: the broker's log folder is
formatted), times the spawn until it answers (the broker a metadata request naming a broker,
Cassandra a CQL query), then a clean stop; then the same with a restart on the data it kept. Rounds
alternate between this tree and ``--base`` (a work tree of an older commit, e.g. the stand-ins:
noida-db and Cassandra 2.1, ``git worktree add /tmp/base <commit>``), each run by its own
``infra.services`` in a process of its own. A first round of each, not counted, installs what the
tree's services need.

    python -m bench.services --base /tmp/base [--rounds 3]   # -> bench/results/services.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import write_result
from lambdalake.settings import PROJECT_ROOT

#: Run inside the measured tree: its own infra.services, its own settings model.
PROBE = r"""
import json, sys, time
from pathlib import Path
from infra.services import BrokerService, CassandraService
from lambdalake.settings import Settings
name, state, cache = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
settings = Settings(
    kafka={"bootstrap_servers": "127.0.0.1:25092"},
    cassandra={"port": 25042, "storage_port": 25000},
    state_dir=state, cache_dir=cache,
)
service = (BrokerService if name == "broker" else CassandraService)(settings)
out = {}
for phase in ("first", "again"):
    t0 = time.monotonic()
    service.start()
    out[f"{phase}_start_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    service.stop()
    out[f"{phase}_stop_s"] = time.monotonic() - t0
print(json.dumps(out))
"""


def measure(tree: Path, python: str, name: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-services-") as state:
        out = subprocess.run(
            [python, "-c", PROBE, name, state, str(tree / ".lambdalake" / "cache")],
            cwd=tree, capture_output=True, text=True, timeout=600, check=False,
            env={**os.environ, "PYTHONPATH": str(tree)},
        )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"{name} in {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", type=Path, required=True, help="a work tree of the commit to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    trees = {"this": PROJECT_ROOT, "base": args.base.resolve()}
    runs: dict[str, dict[str, list[dict[str, float]]]] = {t: {"broker": [], "cassandra": []} for t in trees}
    for rnd in range(args.rounds + 1):
        for name in ("broker", "cassandra"):
            for label, tree in trees.items():
                result = measure(tree, sys.executable, name)
                if rnd > 0:  # round 0 installs
                    runs[label][name].append(result)
                shown = {k: round(v, 2) for k, v in result.items()}
                print(f"round {rnd} {label:<4} {name:<9} {json.dumps(shown)}")
    summary = {
        label: {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in got.items()}
        for label, got in runs.items()
    }
    for name in ("broker", "cassandra"):
        this, base = summary["this"][name], summary["base"][name]
        print(
            f"{name}: first start {this['first_start_s']:.1f} s (base {base['first_start_s']:.1f}), "
            f"restart {this['again_start_s']:.1f} s (base {base['again_start_s']:.1f}), "
            f"stop {this['again_stop_s']:.1f} s (base {base['again_stop_s']:.1f})"
        )
    write_result(
        "services", {"base": str(trees["base"]), "rounds": args.rounds, "median": summary, "runs": runs}
    )


if __name__ == "__main__":
    main()
