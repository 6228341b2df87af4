"""JSON lines read as Arrow tables, piece by piece, with the lines the reader refuses set apart."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.json as pajson

from lambdalake.produce.nesting import DepthScan

#: Lines read as one table at most.
MAX_PIECE = 16384
_CHANGED = re.compile(r"Column\(/([^)/]+)\) changed from (\w+) to (\w+) in row (\d+)")
_ROW = re.compile(r"in row (\d+)")


def _json_kind(avro_type: Any) -> str | None:
    """The JSON kind (as pyarrow's reader names it) a value of the type is written as."""
    if isinstance(avro_type, list):
        kinds = {_json_kind(t) for t in avro_type if t != "null"}
        return kinds.pop() if len(kinds) == 1 else None
    if isinstance(avro_type, dict):
        return "string" if avro_type.get("type") == "enum" else _json_kind(avro_type.get("type"))
    return {
        "int": "number", "long": "number", "float": "number", "double": "number",
        "string": "string", "boolean": "boolean",
    }.get(avro_type)  # fmt: skip


class JsonPieces:
    """Reads JSON lines into Arrow tables for the columnar path.

    pyarrow's reader infers each column's type and refuses a piece at the first row whose JSON kind
    differs from the rows before (a string where numbers were), naming the row and the column. The
    rows before it are then read as a piece, that line goes alone (the per-record path names what is
    wrong with it), and reading goes on after it. A refusal costs a read, so when the line's kind is
    not the schema's (``"price_cents": "12.99"``) the key and the value's first byte as written are
    learned, and later lines holding that pattern go alone without being read. A line nested deeper
    than :data:`lambdalake.produce.nesting.MAX_DEPTH` goes alone before any read (pyarrow's reader
    would overflow its stack on it).

    Args:
        schema: The writer schema (for the JSON kind of each field).
    """

    def __init__(self, schema: Mapping[str, Any]) -> None:
        self._kinds = {f["name"]: _json_kind(f["type"]) for f in schema["fields"]}
        self.learned: set[bytes] = set()
        self._depth = DepthScan()

    def read(self, lines: Sequence[bytes]) -> Iterator[tuple[np.ndarray, pa.Table]]:
        """Pieces ``(positions, table)`` of ``lines``: row ``i`` of the table is line
        ``positions[i]``. A line in no piece is to be sent on its own, in its place."""
        n = len(lines)
        alone = np.zeros(n, dtype=bool)
        alone[list(_holding(lines, self.learned))] = True
        p, cap = 0, MAX_PIECE
        while p < n:
            end = min(n, p + cap)
            positions = p + np.flatnonzero(~alone[p:end])
            if not len(positions):
                p = end
                continue
            piece = [lines[i] for i in positions.tolist()]
            data = b"".join(piece)
            deep = self._depth.deep(piece, data)
            if deep:  # pyarrow's reader would recurse past its stack on them: they go alone
                alone[positions[deep]] = True
                continue
            try:
                table = pajson.read_json(
                    pa.BufferReader(data), read_options=pajson.ReadOptions(block_size=1 << 28)
                )
            except (pa.ArrowException, UnicodeDecodeError, ValueError) as exc:
                rows = self._refused_rows(str(exc), lines, positions)
                if rows is not None:
                    alone[positions[rows]] = True
                    for pattern in self._learn(lines, positions[rows], str(exc)):
                        alone[[p + i for i in _holding(lines[p:], {pattern})]] = True
                elif len(positions) == 1:
                    alone[positions] = True
                else:
                    cap = max(1, (end - p) // 2)  # no row named: halve until the line is alone
                continue
            if table.num_rows != len(positions):  # not one object a line: halve until alone
                if len(positions) == 1:
                    alone[positions] = True
                else:
                    cap = max(1, (end - p) // 2)
                continue
            yield positions, table
            p, cap = end, MAX_PIECE

    def _refused_rows(self, message: str, lines: Sequence[bytes], positions: np.ndarray) -> slice | None:
        """The rows of the piece to set apart: the row the reader named, or the rows before it when
        those have the kind the schema does not (the named row is then the first right one)."""
        changed = _CHANGED.search(message)
        if changed is None:
            row = _ROW.search(message)
            at = int(row.group(1)) if row else -1
            return slice(at, at + 1) if 0 <= at < len(positions) else None
        (field, was, now, row) = changed.groups()
        at = int(row)
        if not 0 < at < len(positions):
            return slice(at, at + 1) if at == 0 else None
        if self._kinds.get(field) == now and was != "null":
            return slice(0, at)
        return slice(at, at + 1)

    def _learn(self, lines: Sequence[bytes], refused: np.ndarray, message: str) -> list[bytes]:
        """Patterns new to :attr:`learned` from refused lines whose kind is not the schema's."""
        changed = _CHANGED.search(message)
        if changed is None:
            return []
        field = changed.group(1)
        expected = self._kinds.get(field)
        if expected is None:
            return []
        found = []
        for i in refused[:8].tolist():
            pattern = _kind_pattern(lines[i], field)
            if pattern is None or pattern in self.learned or _value_kind(pattern) in (expected, "null"):
                continue
            self.learned.add(pattern)
            found.append(pattern)
        return found


def _value_kind(pattern: bytes) -> str:
    first = pattern[-1:]
    if first == b'"':
        return "string"
    if first in (b"t", b"f"):
        return "boolean"
    if first == b"n":
        return "null"
    if first in (b"[", b"{"):
        return "nested"
    return "number"


def _holding(lines: Sequence[bytes], patterns: set[bytes]) -> set[int]:
    """Indexes of the lines that hold one of ``patterns``."""
    if not patterns:
        return set()
    data = b"".join(lines)
    hits = []
    for pattern in patterns:
        at = data.find(pattern)
        while at >= 0:
            hits.append(at)
            at = data.find(pattern, at + 1)
    if not hits:
        return set()
    starts = np.cumsum([0, *map(len, lines)])
    return set((np.searchsorted(starts, hits, side="right") - 1).tolist())


def _kind_pattern(line: bytes, field: str) -> bytes | None:
    """The field's key and the first byte of its value as ``line`` writes them (``"f": "``)."""
    key = json.dumps(field).encode()
    at = line.find(key)
    colon = line.find(b":", at + len(key)) if at >= 0 else -1
    if colon < 0:
        return None
    rest = line[colon + 1 :]
    space = len(rest) - len(rest.lstrip())
    return line[at : colon + 2 + space] if space < len(rest) else None
