"""The edge's rules, per record and over Arrow columns, outside any service.

On the same generated records (``--events`` offers and telemetry events, 1 % invalid): the pipeline's
rules alone per record (``RecordValidator`` without the shape check, as the speed job's decode runs
them on suspects), the shape and the rules per record (a producer's ``send``), and the columnar
pass over a table of the valid records (``ColumnarValidator.suspects``). Best of ``--rounds``, in
microseconds a record.

With ``--baseline DIR`` (a checkout of another revision) the same file runs on that tree's code in
a subprocess, round by round in turn with this tree's, and the ratios are printed:

    python -m bench.rules [--events 100000] [--rounds 5] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

#: A fixed "now" for the ``not_future`` rules, after every generated time.
NOW = 1.8e9


def measure(events: int) -> dict[str, float]:
    """One round on the code on the path: microseconds a record per case (best of three)."""
    from lambdalake.settings import Settings

    settings = Settings(registry={"url": "http://registry.invalid:1"})
    out: dict[str, float] = {}
    for kind in ("offers", "telemetry"):
        for case, us in _measure_kind(settings, kind, events).items():
            out[f"{kind}: {case}"] = us
    return out


def _measure_kind(settings: object, kind: str, events: int) -> dict[str, float]:
    import pyarrow as pa
    from fastavro import parse_schema

    from lambdalake.columnar.validate import ColumnarValidator
    from lambdalake.pipeline import configured_pipeline
    from lambdalake.produce.generator import Mix, generate
    from lambdalake.validation import RecordValidator, checked_rules

    pipeline = configured_pipeline(kind, settings)
    schema, rules = pipeline.reader_schema, checked_rules(pipeline)
    records = list(generate(kind, events, seed=7, mix=Mix(invalid=0.01), clock=lambda: NOW - 60))
    full = RecordValidator(rules, schema=schema, parsed_schema=parse_schema(schema), now=lambda: NOW)
    alone = RecordValidator(rules, schema=schema, parsed_schema=None, check_shape=False, now=lambda: NOW)
    verdicts = [full.check(r) for r in records]
    shaped = [r for r, v in zip(records, verdicts, strict=True) if v is None or v.rule != "schema"]
    table = pa.Table.from_pylist([r for r, v in zip(records, verdicts, strict=True) if v is None])
    columns = ColumnarValidator(rules, schema=schema)
    cases: dict[str, tuple[Callable[[], object], int]] = {
        "rules per record": (lambda: [alone.check(r) for r in shaped], len(shaped)),
        "shape and rules per record": (lambda: [full.check(r) for r in records], len(records)),
        "rules over columns": (lambda: columns.suspects(table, now=NOW), table.num_rows),
    }
    out = {}
    for case, (run, n) in cases.items():
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - t0)
        out[case] = best / n * 1e6
    return out


def _round_on(tree: Path, events: int) -> dict[str, float]:
    """One round on ``tree``'s code, in a process of its own with that tree first on the path."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--one-round", "--events", str(events)],
        env=env, cwd=tree, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", help="a checkout of another revision, timed in turn with this one")
    parser.add_argument("--one-round", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_round:
        print(json.dumps(measure(args.events)))
        return
    here = Path(__file__).resolve().parent.parent
    trees = {"this tree": here} | ({"baseline": Path(args.baseline).resolve()} if args.baseline else {})
    best: dict[str, dict[str, float]] = {name: {} for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            for case, us in _round_on(tree, args.events).items():
                best[name][case] = min(us, best[name].get(case, float("inf")))
    for case in best["this tree"]:
        line = f"{case}: {best['this tree'][case]:.3f} us/record"
        if args.baseline:
            base = best["baseline"][case]
            line += f", baseline {base:.3f} ({best['this tree'][case] / base:.2f}x)"
        print(line)
    from bench.common import write_result

    print("->", write_result("rules", {"events": args.events, "rounds": args.rounds, "best_us": best}))


if __name__ == "__main__":
    main()
