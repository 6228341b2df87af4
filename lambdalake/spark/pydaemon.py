"""PySpark's worker daemon (``spark.python.daemon.module``) with workers that collect only young garbage
between tasks.

PySpark's daemon runs a full ``gc.collect()`` in a reused worker after every task. A worker holds
pyarrow, the Cassandra driver, the decoders and their caches (over 100,000 tracked objects), so each
collection walks all of them: in a speed job under a trickle, 70 % of the Python workers' CPU went to
it, about 0.2 CPU-seconds a micro-batch (py-spy; docs/benchmarks-log.md). Here the collection
between tasks takes the two young generations, where a task's garbage is. Older garbage is left to
the interpreter's own full collections, which run when the old generation has grown by a quarter.

Only this module changes: the daemon's loop, its forking and its workers are PySpark's own. It
imports nothing but PySpark's daemon, so no thread is started before the daemon forks.
"""

from __future__ import annotations

import gc
from types import SimpleNamespace

from pyspark import daemon

#: The generations collected between two tasks of a worker (0 and 1: what the task left young).
BETWEEN_TASKS = 1

# The daemon's loop calls ``gc.collect()`` through its module's global ``gc``; its other uses of
# gc (none in PySpark 4.2) would fail loudly here rather than silently change.
daemon.gc = SimpleNamespace(collect=lambda: gc.collect(BETWEEN_TASKS))  # type: ignore[attr-defined]

if __name__ == "__main__":
    daemon.manager()
