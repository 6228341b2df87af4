"""Columnar Avro encoding into the Confluent wire format: an Arrow table or record batch in, one framed
value per row out, built with numpy over whole columns (no Python object per row).

Every value of a row is a run of bytes, and a row's record is its fields' runs in schema order, so
each column is encoded at once into :class:`Runs` (one byte buffer and per-row offsets) and the runs
of all columns are interleaved row by row with one scatter. The bytes are those fastavro's
``schemaless_writer`` writes for the same values (property-tested against it).

Vectorised: null, boolean, int, long, float, double, bytes, string, enum, fixed, unions (``["null",
T]``, and general ones from their struct of members), nested records, arrays and maps, and the logical
types timestamp-millis/micros, date, uuid and decimal (from Arrow decimal columns). A schema with
another part (duration, a recursive type) is encoded with fastavro row by row instead;
:class:`ColumnarEncoder` logs that once, naming the part.
"""

from __future__ import annotations

import io
import json
import logging
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import fastavro
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lambdalake.columnar.unions import from_members, has_general_union
from lambdalake.event_schema import decimal_of, largest_decimal, member_name, union_members

log = logging.getLogger("lambdalake.columnar")

HEADER = struct.Struct(">bI")
_SHIFTS = np.arange(10, dtype=np.uint64) * np.uint64(7)
_COLUMNS = np.arange(10)


class EncodeError(ValueError):
    """A value the writer schema cannot take (names the field and the first row)."""


class Unsupported(Exception):
    """A schema part the columnar encoder does not handle (the row-by-row path takes it)."""


@dataclass(frozen=True)
class Runs:
    """Per row a run of bytes: row ``i`` is ``data[offsets[i]:offsets[i + 1]]``."""

    data: np.ndarray
    offsets: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @classmethod
    def fixed(cls, data: np.ndarray, width: int, rows: int) -> Runs:
        return cls(data, np.arange(rows + 1, dtype=np.int64) * width)

    @classmethod
    def constant(cls, value: bytes, rows: int) -> Runs:
        data = np.tile(np.frombuffer(value, dtype=np.uint8), rows)
        return cls.fixed(data, len(value), rows)

    @classmethod
    def spread(cls, runs: Runs, present: np.ndarray) -> Runs:
        """``runs`` (one per True of ``present``) as runs of every row, empty where ``present`` is False."""
        lengths = np.zeros(len(present), dtype=np.int64)
        lengths[present] = runs.lengths
        return cls(runs.data, _offsets(lengths))


def _offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.empty(len(lengths) + 1, dtype=np.int64)
    out[0] = 0
    np.cumsum(lengths, out=out[1:])
    return out


def concat(parts: list[Runs]) -> Runs:
    """Row by row, the runs of ``parts`` one after the other (Arrow's element-wise binary join)."""
    if len(parts) == 1:
        return parts[0]
    n = len(parts[0].offsets) - 1
    arrays = [
        pa.Array.from_buffers(
            pa.large_binary(), n, [None, pa.py_buffer(p.offsets - p.offsets[0]),
                                   pa.py_buffer(np.ascontiguousarray(p.data[p.offsets[0] : p.offsets[-1]]))]
        )
        for p in parts
    ]  # fmt: skip
    joined = pc.binary_join_element_wise(*arrays, pa.scalar(b"", pa.large_binary()))
    _, offsets, data = joined.buffers()
    offs = np.frombuffer(offsets, dtype=np.int64)[joined.offset : joined.offset + n + 1]
    raw = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, dtype=np.uint8)
    return Runs(raw, offs)


def longs(values: np.ndarray) -> Runs:
    """Avro ``long``/``int``: zig-zag, then variable-length 7-bit groups, low first."""
    v = values.astype(np.int64, copy=False)
    zz = ((v << 1) ^ (v >> 63)).view(np.uint64)
    count = np.ones(len(zz), dtype=np.int64)
    rest = zz >> np.uint64(7)
    while rest.any():
        count += rest != 0
        rest >>= np.uint64(7)
    # Only as many 7-bit groups as the widest value needs (most columns need one to six).
    width = int(count.max()) if len(count) else 1
    columns = _COLUMNS[None, :width]
    groups = ((zz[:, None] >> _SHIFTS[:width]) & np.uint64(0x7F)).astype(np.uint8)
    groups |= np.where(columns < (count[:, None] - 1), np.uint8(0x80), np.uint8(0))
    return Runs(groups[columns < count[:, None]], _offsets(count))


def _values(array: pa.Array, what: str) -> pa.Array:
    if array.null_count:
        row = int(pc.index(pc.is_null(array), True).as_py())
        raise EncodeError(f"{what}: null at row {row}, and the schema does not allow null there")
    return array


def _blobs(array: pa.Array) -> Runs:
    """Variable-length binary values as they are (no length prefix)."""
    array = array.cast(pa.large_binary())
    _, offsets, data = array.buffers()
    offs = np.frombuffer(offsets, dtype=np.int64)[array.offset : array.offset + len(array) + 1]
    raw = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, dtype=np.uint8)
    return Runs(raw, offs)


Encoder = Callable[[pa.Array, str], Runs]


def _schema_part(schema: Any) -> str:
    return json.dumps(schema)[:120]


def _compile(schema: Any) -> Encoder:
    """An encoder of Arrow arrays for one (expanded) Avro type."""
    if isinstance(schema, str):
        schema = {"type": schema}
    if isinstance(schema, list):
        return _union(schema)
    kind, logical = schema["type"], schema.get("logicalType")
    if isinstance(kind, dict | list):
        return _compile(kind)
    decimal = decimal_of(schema)
    if decimal is not None:
        return _decimal(int(schema["size"]) if kind == "fixed" else None, decimal)
    if logical == "decimal" or logical == "duration":
        raise Unsupported(f"logical type {logical} ({_schema_part(schema)})")
    if kind == "null":
        return lambda array, _what: Runs.fixed(np.zeros(0, dtype=np.uint8), 0, len(array))
    if kind == "boolean":
        return lambda array, what: Runs.fixed(
            np.asarray(_values(array, what).to_numpy(zero_copy_only=False), dtype=np.uint8), 1, len(array)
        )
    if kind in ("int", "long"):
        return _integers(logical)
    if kind in ("float", "double"):
        width, dtype = (4, "<f4") if kind == "float" else (8, "<f8")

        def floats(array: pa.Array, what: str) -> Runs:
            values = np.ascontiguousarray(_values(array, what).to_numpy(zero_copy_only=False), dtype=dtype)
            return Runs.fixed(values.view(np.uint8), width, len(array))

        return floats
    if kind in ("string", "bytes"):
        return _strings
    if kind == "fixed":
        size = int(schema["size"])

        def fixed(array: pa.Array, what: str) -> Runs:
            blobs = _blobs(_values(array, what).cast(pa.binary()))
            if not (blobs.lengths == size).all():
                row = int(np.argmax(blobs.lengths != size))
                raise EncodeError(f"{what}: row {row} is not {size} bytes long (fixed)")
            return Runs(blobs.data[blobs.offsets[0] : blobs.offsets[-1]], blobs.offsets - blobs.offsets[0])

        return fixed
    if kind == "enum":
        return _enum(schema["symbols"])
    if kind == "record":
        return _record(schema)
    if kind == "array":
        return _array(_compile(schema["items"]))
    if kind == "map":
        return _map(_compile(schema["values"]))
    raise Unsupported(f"type {kind!r} ({_schema_part(schema)})")


def _integers(logical: str | None) -> Encoder:
    unit = {"timestamp-millis": "ms", "timestamp-micros": "us"}.get(logical or "")

    def encode(array: pa.Array, what: str) -> Runs:
        array = _values(array, what)
        if pa.types.is_timestamp(array.type) and unit is not None:
            micros = array.cast(pa.timestamp("us", tz=array.type.tz)).cast(pa.int64()).to_numpy()
            # fastavro floors a datetime to whole milliseconds.
            return longs(np.floor_divide(micros, 1000) if unit == "ms" else micros)
        if pa.types.is_date(array.type):
            return longs(array.cast(pa.date32()).cast(pa.int32()).to_numpy())
        if not pa.types.is_integer(array.type):
            raise EncodeError(f"{what}: {array.type} cannot be written as an Avro int or long")
        return longs(array.to_numpy())

    return encode


def _bit_length(x: np.ndarray) -> np.ndarray:
    """Bits of each uint64 (``int.bit_length``)."""
    n = np.zeros(len(x), dtype=np.int64)
    for shift in (32, 16, 8, 4, 2, 1):
        wide = (x >> np.uint64(shift)) != 0
        n += np.where(wide, shift, 0)
        x = np.where(wide, x >> np.uint64(shift), x)
    return n + (x != 0)


def _decimal(size: int | None, target: pa.Decimal128Type) -> Encoder:
    """Decimals from Arrow decimal columns, as fastavro writes a ``Decimal``: the unscaled value at the
    schema's scale in big-endian two's complement, in ``(bit_length(|u|) + 8) // 8`` bytes (with a
    length) or in all ``size`` bytes of a fixed. A column of more decimal places than the scale, or
    a value of more digits than the precision at the scale, is refused (the row-by-row path then
    names the record)."""
    scale, precision = target.scale, target.precision

    def encode(array: pa.Array, what: str) -> Runs:
        array = _values(array, what)
        if not pa.types.is_decimal(array.type) or array.type.scale > scale:
            raise EncodeError(f"{what}: {array.type} cannot be written as {target}")
        # Digits counted at the schema's scale: fastavro counts them as given (12345678.9 passes a
        # decimal(9, 2) and is written as ten digits, which no reader of the schema can hold).
        try:
            unscaled = array.cast(pa.decimal128(38, scale))
        except pa.ArrowInvalid as exc:  # beyond 38 digits at the schema's scale
            raise EncodeError(f"{what}: {exc}") from None
        bound = pa.scalar(largest_decimal(precision, scale), pa.decimal128(38, scale))
        over = pc.or_(pc.greater(unscaled, bound), pc.less(unscaled, pc.negate(bound)))
        if pc.any(over).as_py():
            row = int(pc.index(over, True).as_py())
            raise EncodeError(f"{what}: {array[row].as_py()} at row {row} has more than {precision} digits")
        n = len(unscaled)
        words = np.frombuffer(unscaled.buffers()[1], dtype=np.uint64).reshape(-1, 2)[unscaled.offset :][:n]
        little = words.view(np.uint8).reshape(n, 16)
        big = little[:, ::-1]
        if size is not None:
            if size <= 16:
                return Runs.fixed(np.ascontiguousarray(big[:, 16 - size :]).reshape(-1), size, n)
            sign = np.where(words[:, 1] >> np.uint64(63) == 1, np.uint8(0xFF), np.uint8(0))
            padded = np.concatenate([sign[:, None].repeat(size - 16, axis=1), big], axis=1)
            return Runs.fixed(padded.reshape(-1), size, n)
        lo, hi = words[:, 0], words[:, 1]
        negative = (hi >> np.uint64(63)) == 1
        # |u| of a negative two's complement value: invert and add one (carrying into the high word).
        mlo = np.where(negative, ~lo + np.uint64(1), lo)
        mhi = np.where(negative, ~hi + (mlo == 0).astype(np.uint64), hi)
        bits = np.where(mhi != 0, 64 + _bit_length(mhi), _bit_length(mlo))
        count = (bits + 8) // 8
        body = Runs(big[np.arange(16)[None, :] >= (16 - count)[:, None]], _offsets(count))
        return concat([longs(count), body])

    return encode


def _strings(array: pa.Array, what: str) -> Runs:
    blobs = _blobs(_values(array, what))
    body = Runs(blobs.data[blobs.offsets[0] : blobs.offsets[-1]], blobs.offsets - blobs.offsets[0])
    return concat([longs(body.lengths), body])


def _enum(symbols: list[str]) -> Encoder:
    known = pa.array(symbols, pa.string())

    def encode(array: pa.Array, what: str) -> Runs:
        array = _values(array, what)
        if pa.types.is_dictionary(array.type):
            array = array.cast(pa.string())
        index = pc.index_in(array, value_set=known)
        if index.null_count:
            row = int(pc.index(pc.is_null(index), True).as_py())
            raise EncodeError(f"{what}: {array[row].as_py()!r} at row {row} is not one of {symbols}")
        return longs(index.to_numpy())

    return encode


def _union(branches: list[Any]) -> Encoder:
    others = union_members(branches)
    if len(others) > 1:
        return _general_union(branches)
    if len(branches) == 1:  # a union of one branch: its index, then the value
        inner = _compile(branches[0])
        return lambda array, what: concat([Runs.constant(b"\x00", len(array)), inner(array, what)])
    if not others:
        return lambda array, _what: Runs.constant(b"\x00", len(array))
    null_index, value_index = (0, 1) if branches[0] in ("null", {"type": "null"}) else (1, 0)
    inner = _compile(others[0])
    null_tag, value_tag = (longs(np.array([i])).data.tobytes() for i in (null_index, value_index))

    def encode(array: pa.Array, what: str) -> Runs:
        present = array.is_valid().to_numpy(zero_copy_only=False)
        tags = Runs(np.frombuffer(value_tag * len(array), dtype=np.uint8).copy(),
                    np.arange(len(array) + 1, dtype=np.int64) * len(value_tag))  # fmt: skip
        if present.all():
            return concat([tags, inner(array, what)])
        tags.data[~present] = null_tag[0]  # both tags are one byte
        if not present.any():
            return tags
        values = inner(array.filter(pa.array(present)), what)
        return concat([tags, Runs.spread(values, present)])

    return encode


def _general_union(branches: list[Any]) -> Encoder:
    """A union of several branches but null, from the struct of one member per such branch
    (:func:`lambdalake.event_schema.arrow_type`): the branch of the member set, then its value; a
    null struct is the null branch."""
    null_index = next((i for i, b in enumerate(branches) if b in ("null", {"type": "null"})), None)
    indexes = [i for i, b in enumerate(branches) if b not in ("null", {"type": "null"})]
    inners = [_compile(branches[i]) for i in indexes]

    def encode(array: pa.Array, what: str) -> Runs:
        if not pa.types.is_struct(array.type) or [f.name for f in array.type] != [
            member_name(i) for i in range(len(indexes))
        ]:
            raise EncodeError(
                f"{what}: {array.type} is not the union's shape (a struct of "
                f"{', '.join(member_name(i) for i in range(len(indexes)))}, one of them set)"
            )
        n = len(array)
        present = np.asarray(array.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
        children = array.flatten()
        set_ = (
            np.stack([np.asarray(c.is_valid().to_numpy(zero_copy_only=False), dtype=bool) for c in children])
            & present[None, :]
        )
        count = set_.sum(axis=0)
        if (count > 1).any():
            row = int(np.argmax(count > 1))
            raise EncodeError(f"{what}: row {row} sets more than one member of the union")
        empty = present & (count == 0)
        if empty.any():
            row = int(np.argmax(empty))
            raise EncodeError(f"{what}: row {row} sets no member of the union (a null is the struct's null)")
        if not present.all() and null_index is None:
            row = int(np.argmax(~present))
            raise EncodeError(f"{what}: null at row {row}, and the schema does not allow null there")
        branch = np.full(n, -1 if null_index is None else null_index, dtype=np.int64)
        parts = []
        for k, (index, inner) in enumerate(zip(indexes, inners, strict=True)):
            branch[set_[k]] = index
            if set_[k].any():
                values = inner(children[k].filter(pa.array(set_[k])), f"{what}{member_name(k)}.")
                parts.append(Runs.spread(values, set_[k]))
        return concat([longs(branch), *parts])

    return encode


def _record(schema: Mapping[str, Any]) -> Encoder:
    fields = [(f["name"], _compile(f["type"]), f) for f in schema["fields"]]

    def encode(array: pa.Array | pa.Table | pa.RecordBatch, what: str) -> Runs:
        columns = _columns(array, what)
        rows = len(array) if not isinstance(array, pa.Table | pa.RecordBatch) else array.num_rows
        parts = []
        for name, encoder, field in fields:
            column = columns.get(name)
            if column is None:
                if "default" not in field:
                    raise EncodeError(f"{what}{name}: no such column, and the field has no default")
                parts.append(Runs.constant(_default_bytes(field), rows))
                continue
            parts.append(encoder(column, f"{what}{name}."))
        if not parts:
            return Runs.fixed(np.zeros(0, dtype=np.uint8), 0, rows)
        return concat(parts)

    return encode


def _columns(array: Any, what: str) -> dict[str, pa.Array]:
    if isinstance(array, pa.Table):
        return {n: array.column(n).combine_chunks() for n in array.column_names}
    if isinstance(array, pa.RecordBatch):
        return {n: array.column(n) for n in array.schema.names}
    _values(array, what.rstrip(".") or "record")
    # flatten(): the children with the struct's own offset and length applied.
    return {array.type.field(i).name: child for i, child in enumerate(array.flatten())}


def _default_bytes(field: Mapping[str, Any]) -> bytes:
    buf = io.BytesIO()
    schema = fastavro.parse_schema({"type": "record", "name": "d", "fields": [field]})
    fastavro.schemaless_writer(buf, schema, {field["name"]: field["default"]})
    return buf.getvalue()


def _blocks(items: Runs, list_offsets: np.ndarray) -> Runs:
    """Avro array/map blocks per row: the count and items (if any), then a zero count."""
    counts = np.diff(list_offsets)
    body = Runs(items.data, items.offsets[list_offsets])
    body = Runs(body.data[body.offsets[0] : body.offsets[-1]], body.offsets - body.offsets[0])
    head = Runs.spread(longs(counts[counts > 0]), counts > 0)
    return concat([head, body, Runs.constant(b"\x00", len(counts))])


def _list_offsets(array: pa.Array) -> np.ndarray:
    offsets = np.frombuffer(
        array.buffers()[1], dtype=np.int32 if not pa.types.is_large_list(array.type) else np.int64
    )
    return offsets[array.offset : array.offset + len(array) + 1].astype(np.int64)


def _array(items: Encoder) -> Encoder:
    def encode(array: pa.Array, what: str) -> Runs:
        array = _values(array, what)
        offsets = _list_offsets(array)
        child = array.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
        return _blocks(items(child, f"{what}[]"), offsets - offsets[0])

    return encode


def _map(values: Encoder) -> Encoder:
    def encode(array: pa.Array, what: str) -> Runs:
        array = _values(array, what)
        offsets = _list_offsets(array)
        start, size = int(offsets[0]), int(offsets[-1] - offsets[0])
        keys, items = array.keys.slice(start, size), array.items.slice(start, size)
        pairs = concat([_strings(keys, f"{what}{{}}"), values(items, f"{what}{{}}")])
        return _blocks(pairs, offsets - offsets[0])

    return encode


@dataclass
class ColumnarEncoder:
    """Encodes Arrow rows with one registered writer schema into Confluent-framed Avro values.

    Args:
        schema: The writer schema (JSON text or dict).
        schema_id: Its registry id.

    Attributes:
        vectorised: False when a schema part made it fall back to fastavro row by row.
    """

    schema: str | Mapping[str, Any]
    schema_id: int

    def __post_init__(self) -> None:
        parsed = json.loads(self.schema) if isinstance(self.schema, str) else dict(self.schema)
        self._header = HEADER.pack(0, self.schema_id)
        self._fastavro = fastavro.parse_schema(parsed)
        self._encode: Encoder | None = None
        #: The expanded schema when it holds a general union (rows then need :meth:`plain`).
        self._unions: Any = None
        try:
            expanded = fastavro.parse_schema(parsed, expand=True, _write_hint=False)
            self._unions = expanded if has_general_union(expanded) else None
            self._encode = _compile(expanded)
        except Unsupported as exc:
            log.warning("schema id %d: %s is not vectorised; encoding it row by row", self.schema_id, exc)
        except RecursionError:
            log.warning(
                "schema id %d: a recursive type is not vectorised; encoding it row by row", self.schema_id
            )

    @property
    def vectorised(self) -> bool:
        return self._encode is not None

    def encode(self, rows: pa.Table | pa.RecordBatch) -> pa.LargeBinaryArray:
        """One framed value per row of ``rows`` (columns named as the schema's fields).

        Raises:
            EncodeError: a value the schema cannot take, naming the field and the row.
        """
        n = rows.num_rows
        if self._encode is None:
            return self._row_by_row(rows)
        body = self._encode(rows, "")
        framed = concat([Runs.constant(self._header, n), body])
        return pa.Array.from_buffers(
            pa.large_binary(), n, [None, pa.py_buffer(framed.offsets), pa.py_buffer(framed.data)]
        )

    def plain(self, row: dict[str, Any]) -> dict[str, Any]:
        """A row of Arrow values as fastavro writes it: a general union's struct as its member set,
        in fastavro's ``(branch, value)`` notation (the branch the member names)."""
        return from_members(row, self._unions) if self._unions is not None else row

    def _row_by_row(self, rows: pa.Table | pa.RecordBatch) -> pa.LargeBinaryArray:
        out, buf = [], io.BytesIO()
        for record in map(self.plain, rows.to_pylist()):
            buf.seek(0)
            buf.truncate()
            buf.write(self._header)
            fastavro.schemaless_writer(buf, self._fastavro, record)
            out.append(buf.getvalue())
        return pa.array(out, pa.large_binary())
