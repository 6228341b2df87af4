"""The columnar encoder writes exactly the bytes fastavro's schemaless writer writes (plus the Confluent
frame), for generated schemas and values; a value the schema cannot take is refused naming the row."""

from __future__ import annotations

import io
import json
import math
import string
import uuid
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

import fastavro
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lambdalake.columnar import ColumnarEncoder, EncodeError
from lambdalake.event_schema import event_schema
from lambdalake.settings import PROJECT_ROOT

NAMES = st.text(string.ascii_lowercase, min_size=1, max_size=6).map(lambda s: f"f_{s}")
LONGS = st.integers(-(2**63), 2**63 - 1)
INTS = st.integers(-(2**31), 2**31 - 1)
MILLIS = st.integers(-62_135_596_800_000, 253_402_300_799_999)


def _fastavro_bytes(schema: dict[str, Any], record: dict[str, Any], schema_id: int) -> bytes:
    buf = io.BytesIO()
    buf.write(b"\x00" + schema_id.to_bytes(4, "big"))
    fastavro.schemaless_writer(buf, fastavro.parse_schema(schema), record)
    return buf.getvalue()


counter = iter(range(10**9))


@st.composite
def avro_types(draw: Any, depth: int = 0) -> tuple[Any, pa.DataType, st.SearchStrategy]:
    """(Avro type, Arrow type, strategy of Python values as Arrow's to_pylist gives them)."""
    leaves = [
        ("boolean", pa.bool_(), st.booleans()),
        ("int", pa.int32(), INTS),
        ("long", pa.int64(), LONGS),
        ("float", pa.float32(), st.floats(width=32, allow_nan=False)),
        ("double", pa.float64(), st.floats(allow_nan=False)),
        ("string", pa.string(), st.text(max_size=20)),
        ("bytes", pa.binary(), st.binary(max_size=20)),
        ({"type": "long", "logicalType": "timestamp-millis"}, pa.timestamp("ms", tz="UTC"),
         MILLIS.map(lambda ms: datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=ms))),
        ({"type": "long", "logicalType": "timestamp-micros"}, pa.timestamp("us", tz="UTC"),
         st.datetimes(timezones=st.just(UTC))),
        ({"type": "int", "logicalType": "date"}, pa.date32(), st.dates()),
        ({"type": "string", "logicalType": "uuid"}, pa.string(), st.uuids().map(str)),
    ]  # fmt: skip
    n = next(counter)
    kinds = ["leaf"] * 6 + ["enum", "fixed", "decimal", "nullable"]
    kinds += ["record", "array", "map", "union"] if depth < 2 else []
    kind = draw(st.sampled_from(kinds))
    if kind == "leaf":
        return draw(st.sampled_from(leaves))
    if kind == "union":
        return draw(general_unions(depth))
    if kind == "decimal":
        return draw(decimals(n))
    if kind == "enum":
        symbols = draw(st.lists(st.text(string.ascii_uppercase, min_size=1, max_size=4), min_size=1,
                                max_size=5, unique=True))  # fmt: skip
        return {"type": "enum", "name": f"E{n}", "symbols": symbols}, pa.string(), st.sampled_from(symbols)
    if kind == "fixed":
        size = draw(st.integers(0, 8))
        return (
            {"type": "fixed", "name": f"F{n}", "size": size},
            pa.binary(size),
            st.binary(min_size=size, max_size=size),
        )
    inner, arrow, values = draw(avro_types(depth + 1))
    if kind == "nullable":
        if isinstance(inner, list):
            return inner, arrow, values
        branches = draw(st.sampled_from([["null", inner], [inner, "null"]]))
        return branches, arrow, st.one_of(st.none(), values)
    if kind == "array":
        return {"type": "array", "items": inner}, pa.list_(arrow), st.lists(values, max_size=4)
    if kind == "map":
        pairs = st.dictionaries(st.text(max_size=5), values, max_size=4).map(lambda d: list(d.items()))
        return {"type": "map", "values": inner}, pa.map_(pa.string(), arrow), pairs
    record, arrow_record, fields = draw(records(depth + 1))
    return record, arrow_record, fields


#: Which branch of a union a value fastavro reads belongs to, told by its Python type. A generated
#: union takes one branch of a class at most: branches of one class promote to each other (or read
#: as the same Python type), and then fastavro's choice (the first that matches) and Java's (the same
#: type first) can differ.
def _value_class(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float | date):
        return "number"
    if isinstance(value, str | bytes | Decimal | uuid.UUID):
        return "text"
    return "nested" if isinstance(value, dict) else "array"


def _avro_class(avro: Any) -> str:
    kind = avro if isinstance(avro, str) else avro["type"]
    logical = None if isinstance(avro, str) else avro.get("logicalType")
    if kind == "boolean":
        return "boolean"
    if kind in ("int", "long", "float", "double"):
        return "number"
    if kind in ("string", "bytes", "enum", "fixed") or logical == "decimal":
        return "text"
    return "nested" if kind in ("record", "map") else "array"


@st.composite
def general_unions(draw: Any, depth: int) -> tuple[Any, pa.DataType, st.SearchStrategy]:
    """A union of two or three branches but null (one of a class, see :func:`_value_class`), with
    or without null; values as Arrow gives them: a struct of one member per branch, one set."""
    branches: list[tuple[Any, pa.DataType, st.SearchStrategy]] = []
    for _ in range(draw(st.integers(2, 3))):
        inner = draw(avro_types(depth + 1).filter(lambda t: not isinstance(t[0], list)))
        if _avro_class(inner[0]) not in {_avro_class(b[0]) for b in branches}:
            branches.append(inner)
    if len(branches) < 2:
        return draw(st.sampled_from([("boolean", pa.bool_(), st.booleans())]))
    members = [f"member{i}" for i in range(len(branches))]
    arrow = pa.struct([pa.field(m, a) for m, (_, a, _) in zip(members, branches, strict=True)])

    def only(i: int, value: Any) -> dict[str, Any]:
        return {m: value if k == i else None for k, m in enumerate(members)}

    values = st.one_of(*[v.map(lambda x, i=i: only(i, x)) for i, (_, _, v) in enumerate(branches)])
    avro = [b[0] for b in branches]
    if draw(st.booleans()):
        avro.insert(draw(st.integers(0, len(avro))), "null")
        values = st.one_of(st.none(), values)
    return avro, arrow, values


@st.composite
def decimals(draw: Any, n: int) -> tuple[Any, pa.DataType, st.SearchStrategy]:
    """A decimal in ``bytes`` or in a ``fixed`` at least as large as its precision needs, and values
    of up to its precision (as Arrow gives them: at the type's scale)."""
    precision = draw(st.integers(1, 38))
    scale = draw(st.integers(0, precision))
    avro: dict[str, Any] = {"type": "bytes", "logicalType": "decimal", "precision": precision, "scale": scale}
    if draw(st.booleans()):
        size = next(k for k in range(1, 18) if 10**precision - 1 < 2 ** (8 * k - 1))
        size += draw(st.integers(0, 3))
        avro = {**avro, "type": "fixed", "name": f"D{n}", "size": size}
    largest = 10**precision - 1
    values = st.integers(-largest, largest).map(lambda u: Decimal(f"{u}E-{scale}"))
    return avro, pa.decimal128(precision, scale), values


@st.composite
def records(draw: Any, depth: int = 0) -> tuple[dict[str, Any], pa.DataType, st.SearchStrategy]:
    names = draw(st.lists(NAMES, min_size=1, max_size=5, unique=True))
    parts = [draw(avro_types(depth)) for _ in names]
    fields = [{"name": n, "type": t} for n, (t, _, _) in zip(names, parts, strict=True)]
    schema = {"type": "record", "name": f"R{next(counter)}", "fields": fields}
    arrow = pa.struct([pa.field(n, a) for n, (_, a, _) in zip(names, parts, strict=True)])
    values = st.fixed_dictionaries({n: v for n, (_, _, v) in zip(names, parts, strict=True)})
    return schema, arrow, values


def _fastavro_value(avro: Any, value: Any) -> Any:
    """A value as fastavro takes it (Arrow's map values come as lists of pairs)."""
    if value is None:
        return None
    if isinstance(avro, list):
        branches = [b for b in avro if b != "null"]
        if len(branches) > 1:  # the member set, in fastavro's tuple notation: (branch, value)
            i, member = next((int(k[6:]), v) for k, v in value.items() if v is not None)
            b = branches[i]
            name = b if isinstance(b, str) else b.get("name", b["type"])
            return name, _fastavro_value(b, member)
        return _fastavro_value(branches[0], value)
    if isinstance(avro, dict):
        kind = avro["type"]
        if kind == "map":
            return {k: _fastavro_value(avro["values"], v) for k, v in value}
        if kind == "array":
            return [_fastavro_value(avro["items"], v) for v in value]
        if kind == "record":
            return {f["name"]: _fastavro_value(f["type"], value[f["name"]]) for f in avro["fields"]}
    return value


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_encoded_values_are_byte_identical_to_fastavro(data: Any) -> None:
    schema, arrow, values = data.draw(records())
    rows = data.draw(st.lists(values, min_size=0, max_size=12))
    table = pa.Table.from_pylist(rows, schema=pa.schema(list(arrow)))
    encoder = ColumnarEncoder(json.dumps(schema), 258)
    assert encoder.vectorised
    got = encoder.encode(table).to_pylist()
    want = [_fastavro_bytes(schema, _fastavro_value(schema, r), 258) for r in table.to_pylist()]
    assert got == want


def test_offers_of_both_schema_versions_and_a_sliced_batch() -> None:
    from lambdalake.produce.generator import Mix, generate

    for version in ("v1", "v2"):
        schema = json.loads((PROJECT_ROOT / "schemas" / "offers" / f"{version}.avsc").read_text())
        records = list(generate("offers", 500, seed=4, mix=Mix(0, 0, 0)))
        fields = {f["name"] for f in schema["fields"]}
        for r in records:
            r["updated_at"] = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=r["updated_at"])
            for k in set(r) - fields:
                del r[k]
        table = pa.Table.from_pylist(records, schema=event_schema(schema)).slice(7, 300)
        batch = table.to_batches()[0]
        want = [_fastavro_bytes(schema, r, 3) for r in table.to_pylist()]
        assert ColumnarEncoder(schema, 3).encode(batch).to_pylist() == want


def test_a_missing_field_takes_its_default_and_a_bad_value_names_its_row() -> None:
    schema = {"type": "record", "name": "r", "fields": [
        {"name": "id", "type": "long"},
        {"name": "promo", "type": ["null", "string"], "default": None},
        {"name": "status", "type": {"type": "enum", "name": "S", "symbols": ["on", "off"]}},
    ]}  # fmt: skip
    encoder = ColumnarEncoder(schema, 1)
    table = pa.table({"id": [1, 2], "status": ["on", "off"]})
    assert encoder.encode(table).to_pylist() == [
        _fastavro_bytes(schema, {"id": i, "promo": None, "status": s}, 1) for i, s in ((1, "on"), (2, "off"))
    ]
    with pytest.raises(EncodeError, match=r"status.*'maybe' at row 1"):
        encoder.encode(pa.table({"id": [1, 2], "status": ["on", "maybe"]}))
    with pytest.raises(EncodeError, match=r"id.*null at row 0"):
        encoder.encode(pa.table({"id": pa.array([None, 2], pa.int64()), "status": ["on", "on"]}))


def test_a_schema_part_not_vectorised_falls_back_to_fastavro(caplog: pytest.LogCaptureFixture) -> None:
    duration = {"type": "fixed", "name": "D", "size": 12, "logicalType": "duration"}
    schema = {"type": "record", "name": "r", "fields": [
        {"name": "v", "type": ["null", "string", "long"]},
        {"name": "d", "type": duration},
    ]}  # fmt: skip
    encoder = ColumnarEncoder(schema, 9)
    assert not encoder.vectorised
    assert "duration" in caplog.text and "row by row" in caplog.text
    members = pa.struct([("member0", pa.string()), ("member1", pa.int64())])
    rows = [
        {"v": {"member0": "a", "member1": None}, "d": b"\x01" * 12},
        {"v": {"member0": None, "member1": 7}, "d": b"\x02" * 12},
        {"v": None, "d": b"\x03" * 12},
    ]
    table = pa.Table.from_pylist(rows, schema=pa.schema([("v", members), ("d", pa.binary(12))]))
    plain = [{**r, "v": (r["v"] or {}).get("member0") or (r["v"] or {}).get("member1")} for r in rows]
    assert encoder.encode(table).to_pylist() == [_fastavro_bytes(schema, r, 9) for r in plain]


def test_dates_and_timestamps_floor_as_fastavro_does() -> None:
    schema = {"type": "record", "name": "r", "fields": [
        {"name": "t", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "d", "type": {"type": "int", "logicalType": "date"}},
    ]}  # fmt: skip
    rows = [
        {"t": datetime(1969, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC), "d": date(1969, 12, 31)},
        {"t": datetime(2026, 11, 25, 1, 2, 3, 456_789, tzinfo=UTC), "d": date(2026, 11, 25)},
    ]
    table = pa.Table.from_pylist(
        rows, schema=pa.schema([("t", pa.timestamp("us", tz="UTC")), ("d", pa.date32())])
    )
    assert ColumnarEncoder(schema, 2).encode(table).to_pylist() == [
        _fastavro_bytes(schema, r, 2) for r in rows
    ]


def _fastavro_decoded(writer: dict[str, Any], reader: dict[str, Any], body: bytes) -> Any:
    return fastavro.schemaless_reader(
        io.BytesIO(body), fastavro.parse_schema(writer), fastavro.parse_schema(reader)
    )


def _decoder(schemas: dict[int, dict[str, Any]], reader: dict[str, Any]) -> Any:
    from lambdalake.columnar import ColumnarDecoder

    return ColumnarDecoder(reader, lambda i: json.dumps(schemas[i]))


def _mapped(value: Any, leaf: Any) -> Any:
    if isinstance(value, dict):
        return {k: _mapped(v, leaf) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_mapped(v, leaf) for v in value]
    return leaf(value)


def _plain(value: Any) -> Any:
    """Rows to compare: NaN as a marker (a NaN equals no NaN, so equal rows holding one differ)."""
    return _mapped(value, lambda v: "NaN" if isinstance(v, float) and math.isnan(v) else v)


def _members(avro: Any, value: Any) -> Any:
    """fastavro's value of ``avro`` with each general union's as the member of its branch's class."""
    if value is None:
        return None
    if isinstance(avro, list):
        branches = [b for b in avro if b != "null"]
        if len(branches) == 1:
            return _members(branches[0], value)
        i = next(k for k, b in enumerate(branches) if _avro_class(b) == _value_class(value))
        return {f"member{k}": _members(b, value) if k == i else None for k, b in enumerate(branches)}
    if isinstance(avro, dict) and avro["type"] == "record":
        return {f["name"]: _members(f["type"], value.get(f["name"])) for f in avro["fields"]}
    if isinstance(avro, dict) and avro["type"] == "array":
        return [_members(avro["items"], v) for v in value]
    if isinstance(avro, dict) and avro["type"] == "map":
        return {k: _members(avro["values"], v) for k, v in value.items()}
    return value


def _as_rows(reader: dict[str, Any], records: list[Any]) -> list[Any]:
    """fastavro's records in the decoder's Arrow shape (uuids as their text), back as Python values."""
    records = [_members(reader, r) for r in records]
    texts = [_mapped(r, lambda v: str(v) if isinstance(v, uuid.UUID) else v) for r in records]
    return pa.Table.from_pylist(texts, schema=event_schema(reader)).to_pylist()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_decoded_rows_equal_fastavro_with_schema_resolution(data: Any) -> None:
    writer, arrow, values = data.draw(records())
    rows = data.draw(st.lists(values, min_size=0, max_size=12))
    table = pa.Table.from_pylist(rows, schema=pa.schema(list(arrow)))
    framed = [_fastavro_bytes(writer, _fastavro_value(writer, r), 5) for r in table.to_pylist()]
    # The reader: the writer, with a field the writer lacks (from its default) and one it drops.
    added = {"name": "added_later", "type": ["null", "string"], "default": None}
    reader = {**writer, "fields": [*writer["fields"][1:], added]}
    for schema in (writer, reader):
        decoded = _decoder({5: writer}, schema).decode(pa.array(framed, pa.binary()))
        assert decoded.errors == {}
        want = [_fastavro_decoded(writer, schema, b[5:]) for b in framed]
        assert _plain(decoded.batch.to_pylist()) == _plain(_as_rows(schema, want))
        assert decoded.rows.tolist() == list(range(len(framed)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_corrupt_and_truncated_values_give_row_errors_never_a_crash_or_a_wrong_row(data: Any) -> None:
    writer, arrow, values = data.draw(records())
    rows = data.draw(st.lists(values, min_size=1, max_size=8))
    table = pa.Table.from_pylist(rows, schema=pa.schema(list(arrow)))
    framed = [_fastavro_bytes(writer, _fastavro_value(writer, r), 5) for r in table.to_pylist()]
    broken = []
    for b in framed:
        how = data.draw(st.sampled_from(["truncate", "flip", "keep", "garbage"]))
        if how == "truncate" and len(b) > 5:
            b = b[: data.draw(st.integers(0, len(b) - 1))]
        elif how == "flip" and len(b) > 5:
            i = data.draw(st.integers(5, len(b) - 1))
            b = b[:i] + bytes([b[i] ^ data.draw(st.integers(1, 255))]) + b[i + 1 :]
        elif how == "garbage":
            b = data.draw(st.binary(max_size=12))
        broken.append(b)
    decoded = _decoder({5: writer}, writer).decode(pa.array(broken, pa.binary()))
    got = dict(zip(decoded.rows.tolist(), decoded.batch.to_pylist(), strict=True))
    assert set(got) | set(decoded.errors) == set(range(len(broken))) and not set(got) & set(decoded.errors)
    for i, b in enumerate(broken):
        if i in got:  # decoded: it must be what fastavro reads from the same bytes
            assert b[:5] == b"\x00\x00\x00\x00\x05"
            want = _as_rows(writer, [_fastavro_decoded(writer, writer, b[5:])])[0]
            assert _plain(got[i]) == _plain(want)
        else:
            assert decoded.errors[i]


def test_a_decimal_read_as_another_decimal_goes_row_by_row_and_a_value_it_cannot_hold_fails_its_row() -> None:
    def schema(scale: int) -> dict[str, Any]:
        decimal = {"type": "bytes", "logicalType": "decimal", "precision": 9, "scale": scale}
        return {"type": "record", "name": "r", "fields": [{"name": "d", "type": decimal}]}

    writer, reader = schema(4), schema(2)
    values = [Decimal("1.2300"), Decimal("1.2345"), Decimal("-7.0000")]
    framed = [_fastavro_bytes(writer, {"d": v}, 5) for v in values]
    decoded = _decoder({5: writer}, reader).decode(pa.array(framed, pa.binary()))
    want = [_fastavro_decoded(writer, reader, b[5:])["d"] for b in framed]
    assert set(decoded.errors) == {1} and "reader schema" in decoded.errors[1]
    assert decoded.rows.tolist() == [0, 2]
    assert [r["d"] for r in decoded.batch.to_pylist()] == [want[0], want[2]]
    assert decoded.batch.schema.field("d").type == pa.decimal128(9, 2)


def test_a_decimal_column_the_schema_cannot_hold_is_refused_naming_the_row() -> None:
    schema = {"type": "record", "name": "r", "fields": [
        {"name": "d", "type": {"type": "bytes", "logicalType": "decimal", "precision": 9, "scale": 2}},
    ]}  # fmt: skip
    encoder = ColumnarEncoder(schema, 3)
    fine = pa.array([Decimal("1.5"), Decimal("-1234567.8")], pa.decimal128(9, 1))
    assert encoder.encode(pa.table({"d": fine})).to_pylist() == [
        _fastavro_bytes(schema, {"d": v}, 3) for v in fine.to_pylist()
    ]
    # Three places for a scale of two (fastavro refuses the Decimal too).
    with pytest.raises(EncodeError, match="cannot be written as decimal128"):
        encoder.encode(pa.table({"d": pa.array([Decimal("1.250")], pa.decimal128(9, 3))}))
    # Nine digits as given, ten at the schema's scale: no reader of the schema could hold it.
    wide = pa.array([Decimal("1.0"), Decimal("12345678.9")], pa.decimal128(9, 1))
    with pytest.raises(EncodeError, match=r"12345678.9 at row 1 has more than 9 digits"):
        encoder.encode(pa.table({"d": wide}))


def test_a_general_union_read_row_by_row_takes_the_same_shape(caplog: pytest.LogCaptureFixture) -> None:
    """A writer schema decoded with fastavro (a part not vectorised: duration) gives a general
    union's values in the same struct of members as the columnar path."""
    ref = {"type": "record", "name": "Ref", "fields": [{"name": "code", "type": "string"}]}
    union = ["null", "long", "string", ref]
    columnar = {"type": "record", "name": "r", "fields": [{"name": "v", "type": union}]}
    duration = {"type": "fixed", "name": "D", "size": 12, "logicalType": "duration"}
    fallback = {**columnar, "fields": [*columnar["fields"], {"name": "d", "type": duration}]}
    values = [None, 7, "seven", {"code": "x"}]
    framed = [_fastavro_bytes(fallback, {"v": v, "d": b"\x00" * 12}, 5) for v in values]
    framed += [_fastavro_bytes(columnar, {"v": v}, 6) for v in values]
    decoded = _decoder({5: fallback, 6: columnar}, columnar).decode(pa.array(framed, pa.binary()))
    assert "row by row" in caplog.text and decoded.errors == {}
    shaped = [None, {"member0": 7, "member1": None, "member2": None},
              {"member0": None, "member1": "seven", "member2": None},
              {"member0": None, "member1": None, "member2": {"code": "x"}}]  # fmt: skip
    assert [r["v"] for r in decoded.batch.to_pylist()] == shaped * 2


def test_uuids_read_row_by_row_come_as_their_text(caplog: pytest.LogCaptureFixture) -> None:
    """A writer schema decoded with fastavro (duration is not vectorised) gives uuids as the columnar
    path does, as their canonical text (fastavro's ``uuid.UUID`` failed the row before)."""
    text = {"type": "string", "logicalType": "uuid"}
    ref = {"type": "record", "name": "Ref", "fields": [{"name": "id", "type": text}]}
    reader = {"type": "record", "name": "r", "fields": [
        {"name": "u", "type": text},
        {"name": "nu", "type": ["null", text]},
        {"name": "gu", "type": ["null", "long", text, ref]},
        {"name": "us", "type": {"type": "array", "items": text}},
    ]}  # fmt: skip
    duration = {"type": "fixed", "name": "D", "size": 12, "logicalType": "duration"}
    writer = {**reader, "fields": [*reader["fields"], {"name": "d", "type": duration}]}
    ids = [str(uuid.UUID(int=i * 7919 + 1)) for i in range(6)]
    records = [
        {"u": ids[0], "nu": ids[1], "gu": ids[2], "us": [ids[3], ids[4]]},
        {"u": ids[5], "nu": None, "gu": {"id": ids[0]}, "us": []},
    ]
    framed = [_fastavro_bytes(writer, {**r, "d": b"\x00" * 12}, 3) for r in records]
    framed += [_fastavro_bytes(reader, r, 4) for r in records]
    decoded = _decoder({3: writer, 4: reader}, reader).decode(pa.array(framed, pa.binary()))
    assert "row by row" in caplog.text and decoded.errors == {}
    shaped = [
        {**records[0], "gu": {"member0": None, "member1": ids[2], "member2": None}},
        {**records[1], "gu": {"member0": None, "member1": None, "member2": {"id": ids[0]}}},
    ]
    assert decoded.batch.to_pylist() == shaped * 2
