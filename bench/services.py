"""Start and stop times of the embedded broker and Cassandra, against another tree's in the same run.

Each round starts one service in a fresh state folder (a first start: the broker's log folder is
formatted), times the spawn until it answers (the broker a metadata request naming a broker,
Cassandra a CQL query), then a clean stop; then the same with a restart on the data it kept. Rounds
alternate between this tree and ``--base`` (a work tree of an older commit, e.g. the stand-ins:
noida-db and Cassandra 2.1, ``git worktree add /tmp/base <commit>``), each run by its own
``infra.services`` in a process of its own. A first round of each, not counted, installs what the
tree's services need. ``--quick-jit`` compares this tree's services with the C1 compiler alone (the
JVM option the test suite gives them) instead. Each start also reports the service's CPU seconds
until it answered.

    python -m bench.services --base /tmp/base [--rounds 3]   # -> bench/results/services.json
    python -m bench.services --quick-jit [--rounds 3]        # -> bench/results/services-quick-jit.json
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
from lambdalake.settings import PROJECT_ROOT, QUICK_JIT

#: Run inside the measured tree: its own infra.services, its own settings model.
PROBE = r"""
import json, os, sys, time
from pathlib import Path
from lambdalake.infra.services import BrokerService, CassandraService
from lambdalake.settings import Settings
name, state, cache = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
jvm = {"jvm_options": json.loads(sys.argv[4])} if len(sys.argv) > 4 else {}
settings = Settings(
    kafka={"bootstrap_servers": "127.0.0.1:25092", **jvm},
    cassandra={"port": 25042, "storage_port": 25000, **jvm},
    state_dir=state, cache_dir=cache,
)

def cpu_s(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

service = (BrokerService if name == "broker" else CassandraService)(settings)
out = {}
for phase in ("first", "again"):
    t0 = time.monotonic()
    service.start()
    out[f"{phase}_start_s"] = time.monotonic() - t0
    out[f"{phase}_start_cpu_s"] = cpu_s(service.proc.pid())
    t0 = time.monotonic()
    service.stop()
    out[f"{phase}_stop_s"] = time.monotonic() - t0
print(json.dumps(out))
"""


def measure(tree: Path, python: str, name: str, jvm_options: list[str] | None = None) -> dict[str, float]:
    extra = [json.dumps(jvm_options)] if jvm_options is not None else []
    with tempfile.TemporaryDirectory(prefix="bench-services-") as state:
        out = subprocess.run(
            [python, "-c", PROBE, name, state, str(tree / ".lambdalake" / "cache"), *extra],
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
    parser.add_argument("--base", type=Path, help="a work tree of the commit to compare with")
    parser.add_argument("--quick-jit", action="store_true", help="this tree with C1 alone as the base")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if (args.base is None) == (not args.quick_jit):
        parser.error("give --base or --quick-jit")
    # label -> (tree, JVM options; None: the settings' default)
    sides: dict[str, tuple[Path, list[str] | None]] = {"this": (PROJECT_ROOT, None)}
    sides["base"] = (PROJECT_ROOT, QUICK_JIT) if args.quick_jit else (args.base.resolve(), None)
    runs: dict[str, dict[str, list[dict[str, float]]]] = {t: {"broker": [], "cassandra": []} for t in sides}
    for rnd in range(args.rounds + 1):
        for name in ("broker", "cassandra"):
            for label, (tree, jvm_options) in sides.items():
                result = measure(tree, sys.executable, name, jvm_options)
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
            f"stop {this['again_stop_s']:.1f} s (base {base['again_stop_s']:.1f}), "
            f"CPU to first answer {this['first_start_cpu_s']:.1f} s (base {base['first_start_cpu_s']:.1f})"
        )
    base = f"this tree with {QUICK_JIT}" if args.quick_jit else str(sides["base"][0])
    write_result(
        "services-quick-jit" if args.quick_jit else "services",
        {"base": base, "rounds": args.rounds, "median": summary, "runs": runs},
    )


if __name__ == "__main__":
    main()
