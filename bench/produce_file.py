"""``lambdalake produce offers --file`` of generated JSON lines, timed as a whole new process.

The same file (``--events`` generated offers, 1 % invalid, 2 % duplicates) is produced to a topic of
its own per run. With ``--base PATH`` (a second work tree of other code, e.g. ``git worktree add``),
the same command from that tree runs in turn with this one, on the same services, and the ratio of
whole-process rates is reported per round.

    python -m bench.produce_file [--events 1000000] [--rounds 2] [--base PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from bench.common import bench_settings, write_result
from lambdalake.infra.services import running
from lambdalake.produce.generator import generate
from lambdalake.settings import PROJECT_ROOT


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--base", type=Path, help="a work tree of the code to compare with")
    args = parser.parse_args()
    settings = bench_settings()
    trees = {"this": PROJECT_ROOT, **({"base": args.base.resolve()} if args.base else {})}
    rates: dict[str, list[float]] = {k: [] for k in trees}
    with running(settings, ["broker", "registry"]):
        source = settings.state_dir / f"offers-{args.events}.jsonl"
        if not source.exists():
            source.parent.mkdir(parents=True, exist_ok=True)
            with source.open("w") as out:
                for record in generate("offers", args.events, seed=42):
                    out.write(json.dumps(record) + "\n")
        for round_no in range(args.rounds):
            for name in sorted(trees, reverse=round_no % 2 == 1):  # alternate who goes first
                tree = trees[name]
                env = {
                    **os.environ, **settings.to_env(), "PYTHONPATH": str(tree),
                    "LAMBDALAKE_TOPIC_PREFIX": f"file-{uuid.uuid4().hex[:6]}-",
                    "LAMBDALAKE_PIPELINES_DIR": str(tree / "pipelines"),
                    "LAMBDALAKE_SCHEMAS_DIR": str(tree / "schemas"),
                }  # fmt: skip
                command = [sys.executable, "-m", "lambdalake", "produce", "offers", "--file", str(source)]
                t0 = time.perf_counter()
                done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
                seconds = time.perf_counter() - t0
                if done.returncode != 0:
                    raise SystemExit(
                        f"{name}: exit {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
                    )
                rates[name].append(args.events / seconds)
                print(f"round {round_no + 1} {name}: {seconds:.1f}s, {rates[name][-1]:,.0f} lines/s")
    result: dict = {
        "events": args.events,
        "command": "lambdalake produce offers --file <events>.jsonl",
        "lines_per_s": rates,
        "median_lines_per_s": {k: statistics.median(v) for k, v in rates.items()},
        "targets": {"lines_per_s": 150_000, "ratio_to_base": 5.0},
    }
    if args.base:
        result["ratio_per_round"] = [a / b for a, b in zip(rates["this"], rates["base"], strict=True)]
        result["base"] = str(args.base)
    path = write_result("produce-file", result)
    print(json.dumps(result["median_lines_per_s"]), f"-> {path}")


if __name__ == "__main__":
    main()
