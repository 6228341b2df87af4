"""How many Python workers a Spark session keeps after parallel tasks (``spark.idle_python_workers``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Two tasks at once (each sleeps, so they overlap on local[2,4]), then the child's forked workers are
# counted: a worker is a process whose parent runs the same daemon command (its argument `pyspark.worker`).
CHILD = r"""
import os, time
from pathlib import Path
from lambdalake.procs import process_tree
from lambdalake.settings import Settings
from lambdalake.spark.session import spark_session

def slow(batches):
    import time
    time.sleep(1.5)
    yield from batches

def cmdline(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return b""

def workers():
    # Among this process's descendants only: the test session's own Spark has workers too.
    tree = process_tree(os.getpid())
    return [
        pid for pid, parent in tree.items()
        if cmdline(pid).endswith(b" pyspark.worker ") and cmdline(parent) == cmdline(pid)
    ]

spark = spark_session(Settings(), "python-workers")
df = spark.range(0, 2, 1, 2)
for _ in range(2):
    assert df.mapInArrow(slow, df.schema).count() == 2
deadline = time.monotonic() + 20
while len(workers()) > int(os.environ["WANT"]) and time.monotonic() < deadline:
    time.sleep(0.2)
print("workers", len(workers()), flush=True)
spark.stop()
"""


@pytest.mark.parametrize(("idle", "kept"), [(None, 2), (1, 1)])
def test_idle_python_workers_bounds_the_workers_kept(idle: int | None, kept: int, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "LAMBDALAKE_SPARK__MASTER": "local[2,4]",
        "LAMBDALAKE_SPARK__CDS": "false",
        "LAMBDALAKE_STATE_DIR": str(tmp_path),
        "WANT": str(kept),
    }
    env.pop("LAMBDALAKE_SPARK__CONF", None)
    if idle is not None:
        env["LAMBDALAKE_SPARK__IDLE_PYTHON_WORKERS"] = str(idle)
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"workers {kept}" in out.stdout.splitlines(), out.stdout


# One worker (local[1]) runs two tasks in turn: the first leaves a reference cycle behind, the second
# says which daemon forked it and whether the cycle is still there.
BETWEEN_TASKS = r"""
from lambdalake.settings import Settings
from lambdalake.spark.session import spark_session

def leave_a_cycle(batches):
    import builtins, weakref

    class Node:
        pass

    node = Node()
    node.self = node  # freed only by a collection
    builtins._lambdalake_probe = weakref.ref(node)
    yield from batches

def look(batches):
    import builtins, sys
    import pyarrow as pa

    alive = builtins._lambdalake_probe() is not None
    yield pa.RecordBatch.from_pydict({"daemon": [sys.argv[0]], "alive": [alive]})

spark = spark_session(Settings(), "between-tasks")
df = spark.range(0, 1, 1, 1)
assert df.mapInArrow(leave_a_cycle, df.schema).count() == 1
row = df.mapInArrow(look, "daemon string, alive boolean").first()
cycle = "alive" if row["alive"] else "collected"
print("daemon", row["daemon"].rsplit("/", 1)[-1], "cycle", cycle, flush=True)
spark.stop()
"""


def test_a_reused_worker_runs_the_young_collecting_daemon_and_still_frees_a_task_s_cycles(
    tmp_path: Path,
) -> None:
    """The workers are forked by lambdalake.spark.pydaemon (a young collection between tasks, not
    PySpark's full one), and the garbage cycle a task leaves is gone when the worker's next task runs."""
    env = {
        **os.environ,
        "LAMBDALAKE_SPARK__MASTER": "local[1]",
        "LAMBDALAKE_SPARK__CDS": "false",
        "LAMBDALAKE_STATE_DIR": str(tmp_path),
    }
    env.pop("LAMBDALAKE_SPARK__CONF", None)
    command = [sys.executable, "-c", BETWEEN_TASKS]
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "daemon pydaemon.py cycle collected" in out.stdout.splitlines(), out.stdout
