"""What a process tree uses while a bench runs: its RSS and PSS sampled in a thread, the CPU seconds
of every process it had, and the whole machine's busy CPU (``/proc``)."""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path

from lambdalake.procs import process_tree, tree_memory


def _cpu_seconds(pid: int) -> float | None:
    """User and system CPU seconds ``pid`` has used so far (None: it has ended)."""
    try:
        fields = Path("/proc", str(pid), "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu() -> tuple[float, float]:
    """(busy, all) CPU seconds of the whole machine so far, every core summed (``/proc/stat``)."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = ticks[3] + ticks[4]  # idle and iowait
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK"), sum(ticks) / os.sysconf("SC_CLK_TCK")


class RssSampler:
    """Samples the summed RSS of a process tree every ``every`` seconds in a thread, and its summed
    PSS every ``pss_every`` samples (reading every process's page-table rollup costs the machine
    more than its RSS does). It also keeps the CPU seconds of every process of the tree it saw
    (:meth:`cpu_seconds`): a process that ended between two samples counts up to the last one."""

    def __init__(self, root: int, every: float = 0.5, pss_every: int = 10) -> None:
        self.samples: list[tuple[float, int]] = []
        self.pss_samples: list[tuple[float, int]] = []
        self.root = root
        self._cpu: dict[int, float] = {}
        self._cpu_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(root, every, pss_every), daemon=True)
        self._thread.start()

    def _run(self, root: int, every: float, pss_every: int) -> None:
        n = 0
        while not self._stop.wait(every):
            n += 1
            memory = tree_memory(root, pss=n % pss_every == 0)
            self.cpu_seconds()
            if memory.rss_bytes:
                self.samples.append((time.monotonic(), memory.rss_bytes))
            if memory.pss_bytes:
                self.pss_samples.append((time.monotonic(), memory.pss_bytes))

    def cpu_seconds(self) -> float:
        """CPU seconds the tree has used since the sampler started (its every process, read now)."""
        with self._cpu_lock:
            for pid in process_tree(self.root):
                used = _cpu_seconds(pid)
                if used is not None:
                    self._cpu[pid] = used
            return sum(self._cpu.values())

    def stop(self, steady_from: float | None = None) -> dict[str, float]:
        """Median and max of every sample, and ``steady_mb`` / ``steady_pss_mb``: the medians of
        those from the monotonic time ``steady_from`` on (0 where there are none)."""
        self._stop.set()
        self._thread.join()

        def steady(samples: list[tuple[float, int]]) -> list[int]:
            return [v for t, v in samples if steady_from is not None and t >= steady_from]

        every = [rss for _, rss in self.samples]
        steady_rss, steady_pss = steady(self.samples), steady(self.pss_samples)
        return {
            "median_mb": statistics.median(every) / 2**20 if every else 0.0,
            "max_mb": max(every, default=0) / 2**20,
            "steady_mb": statistics.median(steady_rss) / 2**20 if steady_rss else 0.0,
            "steady_pss_mb": statistics.median(steady_pss) / 2**20 if steady_pss else 0.0,
            "samples": len(every),
            "steady_samples": len(steady_rss),
        }
