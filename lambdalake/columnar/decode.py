"""Columnar decoding of Confluent-framed Avro values into an Arrow record batch in the reader schema.

Every row has a cursor; each field of the writer schema is read for all rows at once (a varint, a
float, a string) by gathering bytes at the cursors with numpy, so the cost is per column, not per
record. Rows written with several writer schemas are split by schema id and each group is resolved
to the reader schema by Avro's rules (fields matched by name or alias, missing ones from their
defaults, int/long/float promotions, string and bytes interchangeable, enum symbols by name).

A row that cannot be decoded (bad magic byte, unknown schema id, truncated or corrupt body, a value
the reader cannot take) is reported by row index with its reason and left out; it never fails the
batch. Values come out as :func:`lambdalake.event_schema.arrow_type` shapes them (enums as strings,
timestamps as UTC microseconds, dates as date32, decimals as decimal128, a union of several branches
but null as a struct of one member per branch). A schema part not vectorised yet (a decimal read as a
decimal of another precision or scale, duration) decodes that writer schema's rows with fastavro,
logged once; a value fastavro reads that the reader's Arrow shape cannot hold fails its row.
"""

from __future__ import annotations

import io
import json
import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import fastavro
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lambdalake.columnar.unions import to_members
from lambdalake.event_schema import arrow_type, decimal_of, largest_decimal, union_members

log = logging.getLogger("lambdalake.columnar")

_TEN = np.arange(10)
#: Items of one array or map block at most (a corrupt count must not allocate the world).
MAX_ITEMS = 10_000_000
_SHIFTS = np.arange(10, dtype=np.uint64) * np.uint64(7)
#: Epoch milliseconds of the years 1-9999 (the timestamps fastavro decodes).
MILLIS_RANGE = (-62_135_596_800_000, 253_402_300_799_999)
MICROS_RANGE = (MILLIS_RANGE[0] * 1000, MILLIS_RANGE[1] * 1000 + 999)
DAYS_RANGE = (-719_162, 2_932_896)


class Unsupported(Exception):
    """A schema part decoded row by row instead."""


@dataclass
class Cursor:
    """The bytes of a group of rows and, per row, where reading is and where the row ends."""

    data: np.ndarray
    pos: np.ndarray
    end: np.ndarray
    #: Per row (of this group), the reason it failed (rows failed stay, their values are dropped).
    failed: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.bad = np.zeros(len(self.pos), dtype=bool)

    def fail(self, rows: np.ndarray, reason: str) -> None:
        fresh = rows[~self.bad[rows]]
        self.bad[rows] = True
        for r in fresh.tolist():
            self.failed[r] = reason

    def take(self, idx: np.ndarray, width: int) -> np.ndarray:
        """``width`` bytes at each row's cursor (rows of ``idx``), advancing it; past a row's end the
        row fails as truncated."""
        p = self.pos[idx]
        self.pos[idx] = p + width
        over = p + width > self.end[idx]
        if over.any():
            self.fail(idx[over], "truncated: the value ends past the record's last byte")
        limit = len(self.data) - width
        return self.data[np.minimum(p, limit)[:, None] + np.arange(width)]

    def varint(self, idx: np.ndarray) -> np.ndarray:
        """Zig-zag varints (Avro int and long) at each row's cursor."""
        p = self.pos[idx]
        window = self.data[np.minimum(p, len(self.data) - 10)[:, None] + _TEN]
        stops = (window & 0x80) == 0
        length = np.argmax(stops, axis=1) + 1
        endless = ~stops.any(axis=1)
        if endless.any():
            self.fail(idx[endless], "corrupt: a varint longer than 10 bytes")
            length[endless] = 10
        groups = (window & 0x7F).astype(np.uint64) << _SHIFTS
        groups[_TEN[None, :] >= length[:, None]] = 0
        zz = np.bitwise_or.reduce(groups, axis=1)
        self.pos[idx] = p + length
        over = p + length > self.end[idx]
        if over.any():
            self.fail(idx[over], "truncated: the value ends past the record's last byte")
        return ((zz >> np.uint64(1)) ^ (np.uint64(0) - (zz & np.uint64(1)))).view(np.int64)

    def blobs(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Length-prefixed bytes (Avro bytes and string) at each row's cursor: (data, offsets)."""
        lengths = self.varint(idx)
        bad = (lengths < 0) | (self.pos[idx] + lengths > self.end[idx])
        if bad.any():
            self.fail(idx[bad], "truncated or corrupt: a length beyond the record's last byte")
            lengths = np.where(bad, 0, lengths)
        starts = self.pos[idx]
        self.pos[idx] = starts + lengths
        offsets = np.zeros(len(idx) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        total = int(offsets[-1])
        gather = np.arange(total, dtype=np.int64) + np.repeat(starts - offsets[:-1], lengths)
        return self.data[gather], offsets


Reader = Callable[[Cursor, np.ndarray], pa.Array]


def _bytes_array(kind: pa.DataType, data: np.ndarray, offsets: np.ndarray) -> pa.Array:
    large = pa.Array.from_buffers(pa.large_binary(), len(offsets) - 1,
                                  [None, pa.py_buffer(offsets), pa.py_buffer(data)])  # fmt: skip
    return large.cast(pa.binary()) if kind == pa.binary() else large


def _promote(writer: str, reader: str) -> bool:
    return writer == reader or (writer, reader) in {
        ("int", "long"), ("int", "float"), ("int", "double"), ("long", "float"), ("long", "double"),
        ("float", "double"), ("string", "bytes"), ("bytes", "string"),
    }  # fmt: skip


def _name(schema: Any) -> str:
    if isinstance(schema, str):
        return schema
    if isinstance(schema, list):
        return "union"
    return schema["type"] if isinstance(schema["type"], str) else _name(schema["type"])


def _default_value(field_schema: Mapping[str, Any]) -> Any:
    """A reader field's default as fastavro reads it (typed, not its JSON form)."""
    empty = fastavro.parse_schema({"type": "record", "name": "w", "fields": []})
    reader = fastavro.parse_schema({"type": "record", "name": "w", "fields": [dict(field_schema)]})
    return fastavro.schemaless_reader(io.BytesIO(b""), empty, reader)[field_schema["name"]]


def _may_be_empty(schema: Any) -> bool:
    """Whether a value of ``schema`` (expanded) can take no bytes: null, a fixed of size 0, a record
    of such fields."""
    if isinstance(schema, dict) and isinstance(schema.get("type"), dict | list):
        return _may_be_empty(schema["type"])
    name = _name(schema)
    if name == "null":
        return True
    if name == "fixed":
        return int(schema["size"]) == 0
    if name == "record":
        return all(_may_be_empty(f["type"]) for f in schema["fields"])
    return False


def compile_reader(writer: Any, reader: Any) -> Reader:
    """A reader of ``writer``-encoded values, resolved to ``reader`` (both expanded by fastavro)."""
    if isinstance(writer, dict) and isinstance(writer.get("type"), dict | list):
        return compile_reader(writer["type"], reader)
    if isinstance(reader, dict) and isinstance(reader.get("type"), dict | list):
        return compile_reader(writer, reader["type"])
    if isinstance(writer, list) or isinstance(reader, list):
        return _union(writer, reader)
    w, r = _name(writer), _name(reader)
    wl = writer.get("logicalType") if isinstance(writer, dict) else None
    rl = reader.get("logicalType") if isinstance(reader, dict) else None
    written, read = decimal_of(writer), decimal_of(reader)
    if written is not None or read is not None:
        size = int(writer["size"]) if w == "fixed" else None
        if written != read or w != r or (size is not None and int(reader["size"]) != size):
            raise Unsupported(f"a {w} {written or 'value'} read as a {r} {read or 'value'}")
        return _decimal(size, written)  # type: ignore[arg-type]
    if "decimal" in (wl, rl) or "duration" in (wl, rl):
        raise Unsupported(f"logical type {wl or rl}")
    target = arrow_type(reader, {})
    if not _promote(w, r):
        raise _Mismatch(f"a writer {w} cannot be read as {r}")
    if w == "null":
        return lambda cur, idx: pa.nulls(len(idx), pa.null())
    if w == "boolean":

        def booleans(cur: Cursor, idx: np.ndarray) -> pa.Array:
            b = cur.take(idx, 1)[:, 0]
            if (b > 1).any():
                cur.fail(idx[b > 1], "corrupt: a boolean byte other than 0 or 1")
            return pa.array(b == 1, pa.bool_())

        return booleans
    if w in ("int", "long"):
        if wl in TIMESTAMPS and rl in TIMESTAMPS and wl != rl:
            return _retimed(wl, rl, target)
        return _integers(w, rl, target)
    if w in ("float", "double"):
        width, dtype = (4, "<f4") if w == "float" else (8, "<f8")

        def floats(cur: Cursor, idx: np.ndarray) -> pa.Array:
            raw = np.ascontiguousarray(cur.take(idx, width)).view(dtype)[:, 0]
            return pa.array(raw).cast(target)

        return floats
    if w in ("string", "bytes"):

        def blobs(cur: Cursor, idx: np.ndarray) -> pa.Array:
            data, offsets = cur.blobs(idx)
            if target == pa.string():
                text = _utf8(cur, idx, data, offsets)
                return _uuids(cur, idx, text) if rl == "uuid" else text
            return _bytes_array(target, data, offsets)

        return blobs
    if w == "fixed":
        size = int(writer["size"])
        if r != "fixed" or int(reader["size"]) != size:
            raise _Mismatch("fixed sizes differ")
        return lambda cur, idx: pa.FixedSizeBinaryArray.from_buffers(
            pa.binary(size), len(idx), [None, pa.py_buffer(np.ascontiguousarray(cur.take(idx, size)))]
        )
    if w == "enum":
        return _enum(writer, reader)
    if w == "record":
        return _record(writer, reader)
    if w == "array":
        items = compile_reader(writer["items"], reader["items"])
        empty = _may_be_empty(writer["items"])  # items of no bytes: a count may exceed the bytes left
        return _blocks(lambda cur, idx: [items(cur, idx)], target, pairs=False, empty_items=empty)
    if w == "map":
        values = compile_reader(writer["values"], reader["values"])
        keys = compile_reader("string", "string")
        return _blocks(
            lambda cur, idx: [keys(cur, idx), values(cur, idx)], target, pairs=True, empty_items=False
        )
    raise Unsupported(f"type {w}")


def _decimal(size: int | None, target: pa.Decimal128Type) -> Reader:
    """Decimals (the unscaled value as big-endian two's complement, in ``bytes`` or a ``fixed`` of
    ``size``) as Arrow decimal128: each value sign-extended to 16 little-endian bytes. A value of more
    digits than the precision fails its row (fastavro would round it to the precision)."""
    largest = largest_decimal(target.precision, target.scale)
    bound, low = pa.scalar(largest, target), pa.scalar(largest.copy_negate(), target)

    def decimals(cur: Cursor, idx: np.ndarray) -> pa.Array:
        if size is None:
            data, offsets = cur.blobs(idx)
        else:
            data = cur.take(idx, size).reshape(-1)
            offsets = np.arange(len(idx) + 1, dtype=np.int64) * size
        lengths = np.diff(offsets)
        starts = offsets[:-1]
        first = data[np.minimum(starts, max(len(data) - 1, 0))] if len(data) else np.zeros(len(idx), np.uint8)
        negative = (lengths > 0) & ((first & 0x80) != 0)
        out = np.where(negative[:, None], np.uint8(0xFF), np.uint8(0)).repeat(16, axis=1)
        columns = np.arange(16)[None, :]
        own = columns < np.minimum(lengths, 16)[:, None]
        out[own] = data[(starts[:, None] + lengths[:, None] - 1 - columns)[own]]
        for i in np.flatnonzero(lengths > 16).tolist():
            # Bytes beyond 16 must only extend the sign, or the value is wider than any 38 digits.
            extra, top = data[starts[i] : starts[i] + lengths[i] - 16], data[starts[i] + lengths[i] - 16]
            if not (extra == (0xFF if top & 0x80 else 0)).all():
                cur.fail(idx[[i]], "corrupt: a decimal wider than 38 digits")
        values = pa.Array.from_buffers(target, len(idx), [None, pa.py_buffer(np.ascontiguousarray(out))])
        fits = pc.and_(pc.greater_equal(values, low), pc.less_equal(values, bound))
        wide = ~np.asarray(fits.to_numpy(zero_copy_only=False), dtype=bool)
        if wide.any():
            cur.fail(idx[wide], f"corrupt: a decimal of more digits than its precision {target.precision}")
            values = pc.if_else(fits, values, pa.scalar(Decimal(0), target))
        return values

    return decimals


class _Mismatch(Exception):
    """Writer and reader types that do not resolve (refused like fastavro's resolution)."""


def _utf8(cur: Cursor, idx: np.ndarray, data: np.ndarray, offsets: np.ndarray) -> pa.Array:
    array = _bytes_array(pa.large_binary(), data, offsets)
    try:
        return array.cast(pa.large_string()).cast(pa.string())
    except pa.ArrowInvalid:
        values = array.to_pylist()
        good = []
        for i, v in enumerate(values):
            try:
                good.append(v.decode("utf-8"))
            except UnicodeDecodeError:
                cur.fail(idx[i : i + 1], "corrupt: a string that is not UTF-8")
                good.append("")
        return pa.array(good, pa.string())


_CANONICAL_UUID = "^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"


def _uuids(cur: Cursor, idx: np.ndarray, text: pa.Array) -> pa.Array:
    """uuid strings in their canonical form, as fastavro gives them (other forms parsed one by one)."""
    canonical = pc.match_substring_regex(text, _CANONICAL_UUID).to_numpy(zero_copy_only=False)
    if canonical.all():
        return text
    values = text.to_pylist()
    for i in np.flatnonzero(~canonical).tolist():
        try:
            values[i] = str(uuid.UUID(values[i]))
        except ValueError:
            cur.fail(idx[i : i + 1], "corrupt: a uuid that is not one")
            values[i] = ""
    return pa.array(values, pa.string())


TIMESTAMPS = ("timestamp-millis", "timestamp-micros")


def _retimed(written: str, read: str, target: pa.DataType) -> Reader:
    """A timestamp written in one unit and read in the other: the writer's unit says what the long
    means, and the reader's unit floors it (as fastavro reads a datetime and the reader keeps whole
    milliseconds)."""

    def retimed(cur: Cursor, idx: np.ndarray) -> pa.Array:
        v = cur.varint(idx)
        lo, hi = MILLIS_RANGE if written == "timestamp-millis" else MICROS_RANGE
        beyond = (v < lo) | (v > hi)
        if beyond.any():
            cur.fail(idx[beyond], f"a {written} beyond the years 1-9999")
        micros = np.where(beyond, 0, v) * (1000 if written == "timestamp-millis" else 1)
        if read == "timestamp-millis":
            micros = np.floor_divide(micros, 1000) * 1000
        return pa.array(micros, pa.int64()).cast(target)

    return retimed


def _integers(w: str, logical: str | None, target: pa.DataType) -> Reader:
    """Avro int and long; ``logical``: the reader's logical type, which decides what they mean."""

    def integers(cur: Cursor, idx: np.ndarray) -> pa.Array:
        v = cur.varint(idx)
        if w == "int":
            wide = (v < -(2**31)) | (v >= 2**31)
            if wide.any():
                cur.fail(idx[wide], "corrupt: an int beyond 32 bits")
        if logical == "timestamp-millis":
            lo, hi = MILLIS_RANGE
            beyond = (v < lo) | (v > hi)
            if beyond.any():
                cur.fail(idx[beyond], "a timestamp-millis beyond the years 1-9999")
            return pa.array(np.where(beyond, 0, v) * 1000, pa.int64()).cast(target)
        if logical in ("timestamp-micros", "date"):
            lo, hi = MICROS_RANGE if logical == "timestamp-micros" else DAYS_RANGE
            beyond = (v < lo) | (v > hi)
            if beyond.any():
                cur.fail(idx[beyond], f"a {logical} beyond the years 1-9999")
            v = np.where(beyond, 0, v)
            if logical == "date":
                return pa.array(v.astype(np.int32), pa.int32()).cast(pa.date32())
            return pa.array(v, pa.int64()).cast(target)
        return pa.array(v, pa.int64()).cast(target, safe=False)

    return integers


def _enum(writer: Mapping[str, Any], reader: Any) -> Reader:
    if _name(reader) != "enum":
        raise _Mismatch("an enum read as another type")
    symbols = list(writer["symbols"])
    known = set(reader["symbols"])
    default = reader.get("default")
    resolved = [s if s in known else default for s in symbols]
    names = pa.array(resolved, pa.string())

    def enum(cur: Cursor, idx: np.ndarray) -> pa.Array:
        i = cur.varint(idx)
        bad = (i < 0) | (i >= len(symbols))
        if bad.any():
            cur.fail(idx[bad], "corrupt: an enum index beyond the writer's symbols")
        i = np.where(bad, 0, i)
        out = names.take(pa.array(i))
        unknown = np.asarray(out.is_null().to_numpy(zero_copy_only=False))
        if unknown.any():
            cur.fail(idx[unknown], "an enum symbol the reader schema does not have (and it has no default)")
        return out

    return enum


def _union(writer: Any, reader: Any) -> Reader:
    w_branches = writer if isinstance(writer, list) else [writer]
    r_branches = reader if isinstance(reader, list) else [reader]
    r_values = union_members(r_branches)
    if len(r_values) > 1:
        return _general_union(w_branches, r_branches, isinstance(writer, list))
    r_value = r_values[0] if r_values else "null"
    target = arrow_type(r_value, {}) if r_values else pa.null()
    readers: list[Reader | None] = []
    for b in w_branches:
        if _name(b) == "null":
            readers.append(None)
            continue
        try:
            readers.append(compile_reader(b, r_value))
        except _Mismatch:
            readers.append(_refuse(f"a union branch {_name(b)} the reader cannot take"))
    nullable = any(_name(b) == "null" for b in r_branches)

    def union(cur: Cursor, idx: np.ndarray) -> pa.Array:
        branch = _branches(cur, idx, len(w_branches), isinstance(writer, list))
        parts, order = [], []
        for k, read in enumerate(readers):
            rows = np.flatnonzero(branch == k)
            if not len(rows):
                continue
            if read is None:
                if not nullable:
                    cur.fail(idx[rows], "a null the reader schema does not allow")
                parts.append(pa.nulls(len(rows), target))
            else:
                parts.append(read(cur, idx[rows]).cast(target))
            order.append(rows)
        if not parts:
            return pa.nulls(0, target)
        values = pa.concat_arrays(parts)
        positions = np.empty(len(idx), dtype=np.int64)
        positions[np.concatenate(order)] = np.arange(len(idx))
        return values.take(pa.array(positions))

    return union


def _branches(cur: Cursor, idx: np.ndarray, count: int, tagged: bool) -> np.ndarray:
    """Each row's writer branch: read (a union) or 0 (a writer type that is not a union)."""
    if not tagged:
        return np.zeros(len(idx), dtype=np.int64)
    branch = cur.varint(idx)
    bad = (branch < 0) | (branch >= count)
    if bad.any():
        cur.fail(idx[bad], "corrupt: a union branch beyond the writer's")
        branch = np.where(bad, 0, branch)
    return branch


def _base(schema: Any) -> str:
    """The type a union branch is matched by: a primitive's name, or a named type's own name."""
    if isinstance(schema, dict) and isinstance(schema.get("type"), dict):
        return _base(schema["type"])
    name = _name(schema)
    return f"{name}:{schema['name'].rsplit('.', 1)[-1]}" if name in ("record", "enum", "fixed") else name


def _matches(w: Any, r: Any) -> bool:
    """Whether a writer branch resolves to reader branch ``r`` (fastavro's and Java's test: the same
    type, a promotion, a named type of the same name or an alias)."""
    wb, rb = _base(w), _base(r)
    kind, _, name = wb.partition(":")
    if name and kind == rb.partition(":")[0]:  # named types of one kind: by name or alias
        aliases = {a.rsplit(".", 1)[-1] for a in (r.get("aliases", []) if isinstance(r, dict) else [])}
        return wb == rb or name in aliases
    return _promote(wb, rb)


def _general_union(w_branches: list[Any], r_branches: list[Any], tagged: bool) -> Reader:
    """A reader union of several branches but null: a struct of one member per such branch (see
    :func:`lambdalake.event_schema.arrow_type`). A writer branch is read as the reader branch of the
    same type, else the first it promotes to (as Java's resolver; fastavro takes the first match,
    which is the same whenever writer and reader unions list their common types alike)."""
    members = union_members(r_branches)
    target = arrow_type(r_branches, {})
    nullable = len(members) < len(r_branches)
    plan: list[tuple[int, Reader] | None] = []  # per writer branch: (member, reader), None for null
    for b in w_branches:
        if _name(b) == "null":
            plan.append(None)
            continue
        exact = [i for i, m in enumerate(members) if _base(m) == _base(b)]
        chosen = exact or [i for i, m in enumerate(members) if _matches(b, m)]
        try:
            if not chosen:
                raise _Mismatch("no reader branch")
            plan.append((chosen[0], compile_reader(b, members[chosen[0]])))
        except _Mismatch:
            plan.append((0, _refuse(f"a union branch {_name(b)} the reader union cannot take")))

    def union(cur: Cursor, idx: np.ndarray) -> pa.Array:
        branch = _branches(cur, idx, len(w_branches), tagged)
        found: list[list[tuple[np.ndarray, pa.Array]]] = [[] for _ in members]
        null = np.zeros(len(idx), dtype=bool)
        for k, step in enumerate(plan):
            rows = np.flatnonzero(branch == k)
            if not len(rows):
                continue
            if step is None:
                if not nullable:
                    cur.fail(idx[rows], "a null the reader schema does not allow")
                null[rows] = True
                continue
            member, read = step
            found[member].append((rows, read(cur, idx[rows]).cast(target.field(member).type)))
        children = []
        for member, parts in enumerate(found):
            kind = target.field(member).type
            # Every row points at the trailing null unless this member holds its value.
            positions = np.full(len(idx), sum(len(v) for _, v in parts), dtype=np.int64)
            start = 0
            for rows, values in parts:
                positions[rows] = np.arange(start, start + len(values))
                start += len(values)
            values = pa.concat_arrays([v for _, v in parts] + [pa.nulls(1, kind)])
            children.append(values.take(pa.array(positions)))
        return pa.StructArray.from_arrays(children, fields=list(target), mask=pa.array(null, pa.bool_()))

    return union


def _refuse(reason: str) -> Reader:
    def refuse(cur: Cursor, idx: np.ndarray) -> pa.Array:
        cur.fail(idx, reason)
        return pa.nulls(len(idx))

    return refuse


def _record(writer: Mapping[str, Any], reader: Any) -> Reader:
    if _name(reader) != "record":
        raise _Mismatch("a record read as another type")
    r_fields = reader["fields"]
    by_name = {f["name"]: f for f in r_fields}
    for f in r_fields:
        for alias in f.get("aliases", []):
            by_name.setdefault(alias, f)
    steps: list[tuple[str | None, Reader]] = []
    for wf in writer["fields"]:
        rf = by_name.get(wf["name"])
        if rf is None:
            steps.append((None, compile_reader(wf["type"], wf["type"])))  # read to skip
        else:
            steps.append((rf["name"], compile_reader(wf["type"], rf["type"])))
    written = {name for name, _ in steps if name is not None}
    defaults = {}
    for rf in r_fields:
        if rf["name"] not in written:
            if "default" not in rf:
                raise _Mismatch(f"reader field {rf['name']} has no default and the writer lacks it")
            defaults[rf["name"]] = (_default_value(rf), arrow_type(rf["type"], {}))
    names = [f["name"] for f in r_fields]
    written_names = [wf["name"] for wf in writer["fields"]]

    def record(cur: Cursor, idx: np.ndarray) -> pa.Array:
        columns: dict[str, pa.Array] = {}
        for (name, read), written_name in zip(steps, written_names, strict=True):
            before = len(cur.failed)
            values = read(cur, idx)
            if len(cur.failed) > before:  # name the field in the reasons of rows that failed in it
                for r in list(cur.failed)[before:]:
                    cur.failed[r] = f"{written_name}: {cur.failed[r]}"
            if name is not None:
                columns[name] = values
        for name, (value, kind) in defaults.items():
            columns[name] = pa.array([value] * len(idx), kind)
        return pa.StructArray.from_arrays([columns[n] for n in names], names=names)

    return record


def _blocks(
    items: Callable[[Cursor, np.ndarray], list[pa.Array]],
    target: pa.DataType,
    *,
    pairs: bool,
    empty_items: bool,
) -> Reader:
    """Avro arrays and maps: blocks of items (a count, negative with a byte size after it) until a
    zero count. Items of all rows are read in step: the j-th item of every row that has one."""

    def blocks(cur: Cursor, idx: np.ndarray) -> pa.Array:
        counts = np.zeros(len(idx), dtype=np.int64)
        found: list[tuple[np.ndarray, np.ndarray, list[pa.Array]]] = []  # (rows, sequence, values)
        active = np.arange(len(idx))
        while len(active):
            n = cur.varint(idx[active])
            negative = n < 0
            if negative.any():
                cur.varint(idx[active[negative]])  # the block's byte size: not needed
                n = np.abs(n)
            # A count beyond the bytes left is corrupt (each item takes a byte at least).
            left = cur.end[idx[active]] - cur.pos[idx[active]]
            absurd = (n > MAX_ITEMS) | ((n > left) if not empty_items else False)
            if np.any(absurd):
                cur.fail(idx[active[absurd]], "corrupt: a block count beyond the record's bytes")
            n = np.where(cur.bad[idx[active]], 0, n)
            for j in range(int(n.max(initial=0))):
                rows = active[n > j]
                found.append((rows, counts[rows] + j, items(cur, idx[rows])))
            counts[active] += n
            active = active[n > 0]
        if found:
            rows = np.concatenate([f[0] for f in found])
            seq = np.concatenate([f[1] for f in found])
            order = pa.array(np.lexsort((seq, rows)))
            parts = [pa.concat_arrays([f[2][k] for f in found]).take(order) for k in range(2 if pairs else 1)]
        else:
            parts = [
                pa.array([], t)
                for t in ((target.key_type, target.item_type) if pairs else (target.value_type,))
            ]
        offsets = pa.array(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32))
        if pairs:
            return pa.MapArray.from_arrays(offsets, parts[0], parts[1].cast(target.item_type))
        return pa.ListArray.from_arrays(offsets, parts[0].cast(target.value_type))

    return blocks


@dataclass
class Decoded:
    """A decoded batch: the rows that decoded, their indexes in the input, and why others did not."""

    batch: pa.RecordBatch
    rows: np.ndarray
    errors: dict[int, str]
    #: The failed rows that are not framed Avro of a known schema id (too short, another magic
    #: byte, an id the registry lacks); the others' bodies did not decode.
    unframed: frozenset[int] = frozenset()
    #: Per input row, the registry id its header names (null where it is too short to have one).
    schema_ids: pa.Array | None = None


class ColumnarDecoder:
    """Decodes framed Avro values into the reader schema's Arrow shape.

    Args:
        reader_schema: The pipeline's reader schema (JSON text or dict).
        fetch_schema: The schema JSON text of a registry id (called once per id). It raises for an id
            the registry does not have; ``unknown`` names the exception types that mean "no such id"
            (those rows fail; any other error is raised: the registry is down).
        unknown: Exception types ``fetch_schema`` raises for an unknown id. Default ``(KeyError,)``.
    """

    def __init__(
        self,
        reader_schema: str | Mapping[str, Any],
        fetch_schema: Callable[[int], str],
        *,
        unknown: tuple[type[BaseException], ...] = (KeyError,),
    ) -> None:
        self.reader = json.loads(reader_schema) if isinstance(reader_schema, str) else dict(reader_schema)
        self._expanded_reader = fastavro.parse_schema(self.reader, expand=True, _write_hint=False)
        self._parsed_reader = fastavro.parse_schema(self.reader)
        self.schema = pa.schema(list(arrow_type(self.reader, {})))
        self._fetch = fetch_schema
        self._unknown = unknown
        self._readers: dict[int, tuple[Reader | None, Any, str | None]] = {}

    def _reader_for(self, schema_id: int) -> tuple[Reader | None, Any, str | None]:
        """(columnar reader or None for the row-by-row path, fastavro writer schema, error)."""
        if schema_id not in self._readers:
            try:
                text = json.loads(self._fetch(schema_id))
            except self._unknown:
                self._readers[schema_id] = (None, None, f"schema id {schema_id} is not in the registry")
                return self._readers[schema_id]
            parsed = fastavro.parse_schema(text)
            try:
                expanded = fastavro.parse_schema(text, expand=True, _write_hint=False)
                self._readers[schema_id] = (compile_reader(expanded, self._expanded_reader), parsed, None)
            except Unsupported as exc:
                log.warning("schema id %d: %s is not vectorised; decoding it row by row", schema_id, exc)
                self._readers[schema_id] = (None, parsed, None)
            except (_Mismatch, RecursionError) as exc:
                self._readers[schema_id] = (None, parsed, None)
                log.warning("schema id %d: %s; decoding it row by row", schema_id, exc)
        return self._readers[schema_id]

    def decode(self, values: pa.Array | pa.ChunkedArray) -> Decoded:
        """Decode a binary array of framed values (nulls fail as empty records)."""
        if isinstance(values, pa.ChunkedArray):
            values = values.combine_chunks() if values.num_chunks else pa.array([], pa.binary())
        values = values.cast(pa.large_binary())
        n = len(values)
        _, offs, buf = values.buffers()
        offsets = np.frombuffer(offs, dtype=np.int64)[values.offset : values.offset + n + 1]
        raw = np.frombuffer(buf, dtype=np.uint8) if buf is not None else np.zeros(0, dtype=np.uint8)
        data = np.concatenate([raw, np.zeros(16, dtype=np.uint8)])
        valid = values.is_valid().to_numpy(zero_copy_only=False)
        starts, ends = offsets[:-1], offsets[1:]
        errors: dict[int, str] = {}
        short = (ends - starts < 5) | ~valid
        for r in np.flatnonzero(short).tolist():
            errors[r] = f"record of {int(ends[r] - starts[r])} bytes is too short to be framed Avro"
        head = data[np.minimum(starts, len(data) - 5)[:, None] + np.arange(5)]
        magic = head[:, 0]
        for r in np.flatnonzero(~short & (magic != 0)).tolist():
            errors[r] = f"unknown magic byte {int(magic[r])} (expected 0: Confluent wire format)"
        ids = head[:, 1:5].astype(np.uint32)
        ids = (ids[:, 0] << 24) | (ids[:, 1] << 16) | (ids[:, 2] << 8) | ids[:, 3]
        framed = ~short & (magic == 0)
        unframed = set(errors)
        parts: list[tuple[np.ndarray, pa.Array]] = []
        for schema_id in np.unique(ids[framed]).tolist():
            rows = np.flatnonzero(framed & (ids == schema_id))
            reader, writer, error = self._reader_for(int(schema_id))
            if error is not None:
                errors.update({int(r): error for r in rows})
                unframed.update(rows.tolist())
                continue
            if reader is None:
                got, bad = self._row_by_row(values, rows, writer)
            else:
                cur = Cursor(data, starts[rows] + 5, ends[rows].copy())
                got = reader(cur, np.arange(len(rows)))
                bad = {int(rows[i]): reason for i, reason in cur.failed.items()}
            errors.update(bad)
            keep = np.array([int(r) not in bad for r in rows], dtype=bool)
            if keep.any():
                parts.append((rows[keep], got.filter(pa.array(keep)) if not keep.all() else got))
        if parts:
            rows_out = np.concatenate([p[0] for p in parts])
            struct = pa.concat_arrays([p[1].cast(pa.struct(list(self.schema))) for p in parts])
            order = np.argsort(rows_out, kind="stable")
            struct, rows_out = struct.take(pa.array(order)), rows_out[order]
            batch = pa.RecordBatch.from_struct_array(struct)
        else:
            rows_out = np.zeros(0, dtype=np.int64)
            batch = pa.RecordBatch.from_pylist([], schema=self.schema)
        headed = pa.array(ids.view(np.int32), pa.int32(), mask=np.asarray(short, dtype=bool))
        return Decoded(batch, rows_out, dict(sorted(errors.items())), frozenset(unframed), headed)

    def _row_by_row(self, values: pa.Array, rows: np.ndarray, writer: Any) -> tuple[pa.Array, dict[int, str]]:
        records, bad = [], {}
        for r in rows.tolist():
            body = values[r].as_py()[5:]
            try:
                record = fastavro.schemaless_reader(io.BytesIO(body), writer, self._parsed_reader)
                records.append(to_members(record, self._expanded_reader))
            # fastavro raises EOFError, ValueError, ... on corrupt bodies (to_members: ValueError).
            except Exception as exc:
                bad[r] = f"cannot decode: {exc!r}"
                records.append(None)  # dropped by the caller through ``bad``
        shape = pa.struct(list(self.schema))
        try:
            return pa.array(records, shape), bad
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            pass
        # A value fastavro reads that the reader's Arrow shape cannot hold (a decimal of a scale the
        # reader's lacks...) fails its row, not the batch.
        for i, r in enumerate(rows.tolist()):
            try:
                pa.array([records[i]], shape)
            except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
                bad[r] = f"cannot decode into the reader schema: {exc}"
                records[i] = None
        return pa.array(records, shape), bad
