"""Whether a process runs, and the resident memory of a process and everything it started (a Spark
driver, its JVM, its Python workers), read from Linux's ``/proc``; and handing a finished task's
freed memory back."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True)
class TreeMemory:
    """Resident memory summed over a process tree.

    ``rss_bytes`` counts a page once per process mapping it (a forked worker's pages shared with its
    daemon, the libraries every Python maps); ``pss_bytes``, where asked for, shares each such page
    among the processes mapping it: what the tree costs the machine.
    """

    rss_bytes: int
    processes: int
    pss_bytes: int | None = None

    @property
    def rss_mb(self) -> float:
        return round(self.rss_bytes / 2**20, 1)


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (exited, not reaped yet) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _parent_and_rss(pid: str) -> tuple[int, int] | None:
    try:
        stat = Path("/proc", pid, "stat").read_text()
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])  # after the command, which may hold spaces
        return parent, int(Path("/proc", pid, "statm").read_text().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None  # ended meanwhile, or not Linux


def _tree(root: int) -> dict[int, tuple[int, int]]:
    """``root`` and its live descendants, each as ``pid: (parent pid, RSS bytes)``, from one pass
    over ``/proc`` (empty where it is not there)."""
    if not os.path.isdir("/proc"):
        return {}
    children: dict[int, list[int]] = {}
    found: dict[int, tuple[int, int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (parent_rss := _parent_and_rss(entry.name)) is not None:
            children.setdefault(parent_rss[0], []).append(int(entry.name))
            found[int(entry.name)] = parent_rss
    todo, tree = [root], {}
    while todo:
        pid = todo.pop()
        if pid in found:
            tree[pid] = found[pid]
            todo += children.get(pid, [])
    return tree


def process_tree(root: int) -> dict[int, int]:
    """``root`` and its live descendants, each with its parent's pid (empty without ``/proc``)."""
    return {pid: parent for pid, (parent, _) in _tree(root).items()}


def _pss(pid: int) -> int:
    """The process's proportional set size (0 when it ended meanwhile or the kernel has no rollup)."""
    try:
        for line in Path("/proc", str(pid), "smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def tree_memory(root: int, *, pss: bool = False) -> TreeMemory:
    """RSS of ``root`` and all its descendants (zero processes where ``/proc`` is not there).

    Args:
        root: The tree's root process.
        pss: Also sum the proportional set sizes (reads each process's ``smaps_rollup``, which walks
            its page tables: a few milliseconds for a JVM, so not for every poll of a hot loop).
    """
    tree = _tree(root)
    rss = sum(r for _, r in tree.values())
    return TreeMemory(rss, len(tree), sum(_pss(p) for p in tree) if pss else None)


_libc: ctypes.CDLL | None = None


#: Tasks of up to this many rows hand freed memory back when they end (see release_freed_memory).
LIGHT_TASK_ROWS = 20_000


def release_freed_memory() -> None:
    """Hand what a finished task freed back to the system: the unused pages of Arrow's memory pool,
    and glibc's free pages in every arena (``malloc_trim``; nothing where the C library has none).

    A Python worker is reused for the next task and otherwise stays as large as its largest task
    made it. Callers do it after light
    tasks only (``LIGHT_TASK_ROWS``): a backlog's large tasks would fault the pages in again each
    time, and once the job has caught up its first light task hands the backlog's memory back.
    """
    global _libc
    import pyarrow as pa

    pa.default_memory_pool().release_unused()
    if _libc is None:
        _libc = ctypes.CDLL(None)  # the process's own symbols, the C library's among them
    trim = getattr(_libc, "malloc_trim", None)
    if trim is not None:
        trim(0)
