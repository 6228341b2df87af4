"""Resident memory of a process tree, as the speed job reports it; freed memory handed back."""

from __future__ import annotations

import os
import subprocess
import sys

from lambdalake.procs import tree_memory


def test_a_tree_counts_its_children_and_their_memory() -> None:
    # A child that holds 200 MB, and a grandchild of its own: both count, nothing outside the tree does.
    code = (
        "import subprocess, sys, time; b = bytearray(200 * 2**20); "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
        "print('ready', flush=True); time.sleep(30)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        alone = tree_memory(child.pid)
        assert alone.processes == 2
        assert 200 * 2**20 < alone.rss_bytes < 400 * 2**20
        mine = tree_memory(os.getpid())
        assert mine.processes >= 3 and mine.rss_bytes > alone.rss_bytes
        assert alone.pss_bytes is None
        # PSS shares the Python interpreter's pages between the two: less than the RSS sum, and
        # still the 200 MB that only the child holds.
        shared = tree_memory(child.pid, pss=True)
        assert 200 * 2**20 < shared.pss_bytes < shared.rss_bytes
    finally:
        child.kill()
        child.wait()


def test_a_process_that_is_gone_has_nothing() -> None:
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    assert tree_memory(done.pid) == tree_memory(done.pid).__class__(0, 0)


def test_freed_memory_goes_back_to_the_system() -> None:
    """A reused Python worker keeps what its largest task allocated unless freed pages go back."""
    code = (
        "import pyarrow\n"  # imported by the release: before the measurement, not inside it
        "from lambdalake.procs import release_freed_memory\n"
        "def rss():\n"
        "    return int(open('/proc/self/statm').read().split()[1]) * 4096 // 2**20\n"
        "base = rss()\n"
        "objs = [bytes(4000) + bytes([i % 256]) for i in range(40_000)]\n"
        "kept = objs[::8]\n"  # holes between live blocks: glibc keeps those pages on its own
        "del objs\n"
        "held = rss()\n"
        "release_freed_memory()\n"
        "print(base, held, rss())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    base, held, after = map(int, out.stdout.split())
    assert held - base > 100, out.stdout  # ~160 MB allocated, 20 MB of it still live
    assert held - after > 0.4 * (held - base), out.stdout
