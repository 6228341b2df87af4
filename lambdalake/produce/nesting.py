"""Nesting bounds for input, decided before a native parser or builder sees it.

pyarrow's JSON reader and ``pa.array`` recurse on the C stack for every level of nesting: a line or
a value nested some ten thousand levels deep kills the process (SIGSEGV), which no ``try`` catches.
Lines and values nested deeper than :data:`MAX_DEPTH` therefore never reach them; they take the
per-record path, whose Python parser and checks stop at Python's recursion limit with an error that
sends the record to the dead-letter topic with its reason.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

#: Levels of ``[``/``{`` (or of lists and dicts) a record may nest for the columnar path; a
#: record deeper than this goes per record, and one deeper than :data:`MAX_RECORD_DEPTH` is refused.
MAX_DEPTH = 64
#: Levels a record may nest at all: Avro allows recursive types, but a record this deep is refused
#: (rule ``too_deep``) before Python's recursion limit or a native encoder's stack could be reached.
MAX_RECORD_DEPTH = 500

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


class DepthScan:
    """Finds the lines that may nest deeper than ``bound``, reusing its scratch arrays (a chunk of
    JSON lines is megabytes: fresh arrays per chunk cost more in page faults than the scan).

    Counting the opening brackets of every line bounds its depth from above at numpy's speed; only
    a line holding more than ``bound`` of them is measured exactly (strings taken out first). A line
    that is not valid JSON may be counted deeper than it is, never shallower.

    Args:
        bound: Levels a line may nest (default :data:`MAX_DEPTH`).
    """

    def __init__(self, bound: int = MAX_DEPTH) -> None:
        self.bound = bound
        self._folded = np.empty(0, dtype=np.uint8)
        self._opens = np.empty(0, dtype=bool)

    def deep(self, lines: Sequence[bytes], joined: bytes | None = None) -> list[int]:
        """Indexes of the ``lines`` deeper than the bound (``joined``: the lines joined, when the
        caller has them)."""
        if not lines:
            return []
        data = np.frombuffer(b"".join(lines) if joined is None else joined, dtype=np.uint8)
        n = len(data)
        if len(self._folded) < n:
            self._folded = np.empty(max(n, 2 * len(self._folded)), dtype=np.uint8)
            self._opens = np.empty(len(self._folded), dtype=bool)
        folded, opens = self._folded[:n], self._opens[:n]
        np.bitwise_or(data, 0x20, out=folded)  # "[" | 0x20 is "{": both in one comparison
        np.equal(folded, ord("{"), out=opens)
        at = np.flatnonzero(opens)
        if len(at) <= self.bound:
            return []
        ends = np.cumsum(np.fromiter(map(len, lines), dtype=np.int64, count=len(lines)))
        per_line = np.diff(np.searchsorted(at, ends), prepend=0)
        bound = self.bound
        return [i for i in np.flatnonzero(per_line > bound).tolist() if json_depth(lines[i]) > bound]


def deep_lines(lines: Sequence[bytes], *, bound: int = MAX_DEPTH) -> list[int]:
    """Indexes of the ``lines`` that may nest deeper than ``bound`` (see :class:`DepthScan`)."""
    return DepthScan(bound).deep(lines)


def json_depth(line: bytes) -> int:
    """The deepest nesting of ``[``/``{`` in a JSON text, brackets inside strings not counted."""
    bare = _STRING.sub(b'""', line)
    data = np.frombuffer(bare, dtype=np.uint8)
    steps = np.zeros(len(data), dtype=np.int32)
    steps[np.bitwise_or(data, 0x20) == ord("{")] = 1
    steps[(data == ord("]")) | (data == ord("}"))] = -1
    return int(np.cumsum(steps).max(initial=0))


def deeper_than(value: Any, bound: int = MAX_DEPTH) -> bool:
    """Whether ``value`` nests lists, tuples and dicts more than ``bound`` levels deep (walked
    without recursion, and no further than the bound)."""
    if not isinstance(value, list | tuple | dict):
        return False
    todo = [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if depth > bound:
            return True
        inner = item.values() if isinstance(item, dict) else item
        todo.extend((v, depth + 1) for v in inner if isinstance(v, list | tuple | dict))
    return False


def has_nested_types(schema: dict[str, Any]) -> bool:
    """Whether a record schema has a field of an array, map or record type (in a union too), or one
    that refers to the record itself (a recursive type). A name defined in an earlier field needs no
    look: a record defined there makes that field nested already."""
    own = {schema.get("name"), f"{schema.get('namespace')}.{schema.get('name')}"}

    def nested(t: Any) -> bool:
        if isinstance(t, list):
            return any(nested(b) for b in t)
        if isinstance(t, dict):
            return t.get("type") in ("array", "map", "record") or nested(t.get("type"))
        return t in own

    return any(nested(f["type"]) for f in schema["fields"])
