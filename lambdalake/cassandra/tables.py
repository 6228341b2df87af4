"""View tables in Cassandra, derived from the view definitions (CQL that Cassandra 2.1 understands)."""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
from cassandra import DriverException
from cassandra.cluster import Session

from lambdalake.cassandra.session import execute_ddl, refresh_metadata
from lambdalake.cassandra.stored_layout import require_current
from lambdalake.errors import ConfigurationError
from lambdalake.event_schema import event_schema
from lambdalake.latest import CANDIDATE, CANDIDATE_ORDER, RANK, RANK_CQL
from lambdalake.layout import BATCH_CLAIMS_TABLE, BATCH_META_TABLE, layout_comment
from lambdalake.pipeline import LatestView, Pipeline, WindowedView
from lambdalake.settings import CassandraSettings
from lambdalake.view_types import held_types
from lambdalake.views import (
    CELL_VERSION,
    EPOCH,
    WINDOW_START,
    batch_table,
    latest_columns,
    speed_table,
    view_components,
)

INGEST_COLUMNS = [("_ingest_ts", "timestamp"), ("_epoch", "bigint")]
_DESCENDING = tuple(c for c in CANDIDATE if CANDIDATE_ORDER[c] == "DESC")
#: A ``latest`` speed row's candidate columns (:data:`lambdalake.latest.CANDIDATE`), as typed.
CANDIDATE_COLUMNS = list(zip(CANDIDATE, (RANK_CQL, "int", "bigint"), strict=True))


#: Arrow type test -> CQL type (only types Cassandra 2.1 has).
CQL_TYPES = (
    (pa.types.is_string, "text"),
    (pa.types.is_int64, "bigint"),
    (pa.types.is_int32, "int"),
    (pa.types.is_float64, "double"),
    (pa.types.is_float32, "float"),
    (pa.types.is_boolean, "boolean"),
    (pa.types.is_binary, "blob"),
    (pa.types.is_fixed_size_binary, "blob"),  # an Avro fixed: its length is the schema's to keep
    (pa.types.is_timestamp, "timestamp"),
    (pa.types.is_decimal, "decimal"),
)


def cql_type(t: pa.DataType) -> str:
    for matches, cql in CQL_TYPES:
        if matches(t):
            return cql
    raise ConfigurationError(
        f"no Cassandra column type for {t}", fix="flatten the field or keep it out of views"
    )


@dataclass(frozen=True)
class StoredField:
    """A field a ``latest`` view keeps whose Cassandra type a schema promotion changed (``int`` to
    ``long`` or ``double``, ``float`` to ``double``, ``string`` to ``bytes`` and back): Cassandra
    changes no column's type in place, so each type the field has had keeps a column of its own,
    the first named as the field, later ones ``<field>__<type>``. A row is written in the current
    type's column (the others null, so an older row's value never shows through); a reader takes
    the one set, as the current type (:func:`stored_value`)."""

    field: str
    #: (column, CQL type), oldest first.
    columns: tuple[tuple[str, str], ...]
    #: The column of the field's current type.
    current: str

    @property
    def cql(self) -> str:
        return dict(self.columns)[self.current]


@dataclass(frozen=True)
class TableDef:
    """A Cassandra table: columns in order, partition key, clustering columns."""

    name: str
    columns: tuple[tuple[str, str], ...]
    partition_key: tuple[str, ...]
    clustering: tuple[str, ...] = ()
    #: Rows expire this long after they were written (Cassandra's ``default_time_to_live``).
    ttl_seconds: int | None = None
    #: Fields kept in a column per type they have had (a ``latest`` view's promoted fields).
    stored: tuple[StoredField, ...] = ()
    #: Clustering columns sorted descending (the others ascending).
    descending: tuple[str, ...] = ()
    #: The table's comment (lambdalake's own tables carry the stored layout's version in it).
    comment: str | None = None

    @property
    def ranked(self) -> bool:
        """Whether rows are ``latest`` candidates (:data:`lambdalake.latest.CANDIDATE`), each write
        deleting the key's lower-ranked candidates."""
        return self.clustering == CANDIDATE

    @property
    def column_names(self) -> list[str]:
        return [c for c, _ in self.columns]

    @property
    def source_columns(self) -> list[str]:
        """The columns of the rows written to it: a stored field's columns as the field itself."""
        named = {c: s.field for s in self.stored for c, _ in s.columns}
        return list(dict.fromkeys(named.get(c, c) for c in self.column_names))

    @property
    def timestamp_columns(self) -> list[str]:
        return [c for c, t in self.columns if t == "timestamp"]

    def create_cql(self, keyspace: str) -> str:
        cols = ", ".join(f'"{c}" {t}' for c, t in self.columns)
        pk = "(" + ", ".join(f'"{c}"' for c in self.partition_key) + ")"
        if self.clustering:
            pk += ", " + ", ".join(f'"{c}"' for c in self.clustering)
        options = []
        if self.descending:
            order = ", ".join(f'"{c}" {"DESC" if c in self.descending else "ASC"}' for c in self.clustering)
            options.append(f"CLUSTERING ORDER BY ({order})")
        if self.ttl_seconds:
            options.append(f"default_time_to_live = {self.ttl_seconds}")
        if self.comment:
            options.append(f"comment = '{self.comment}'")
        with_ = f" WITH {' AND '.join(options)}" if options else ""
        return f'CREATE TABLE IF NOT EXISTS "{keyspace}"."{self.name}" ({cols}, PRIMARY KEY ({pk})){with_}'

    def delete_lower_cql(self, keyspace: str) -> str:
        """A ranked table's delete of a key's candidates ranked below the one written (values: the
        partition key, the rank). It only keeps the table small: the first candidate is the winner
        whichever lower ones a reordered write leaves behind, so the server's write time will do."""
        where = " AND ".join(f'"{k}" = ?' for k in self.partition_key)
        return f'DELETE FROM "{keyspace}"."{self.name}" WHERE {where} AND "{RANK}" < ?'

    @property
    def delete_lower_at(self) -> list[int]:
        """Where :meth:`delete_lower_cql`'s values are among a row's columns: its key, its rank."""
        names = self.column_names
        return [*(names.index(k) for k in self.partition_key), names.index(RANK)]

    def insert_cql(self, keyspace: str) -> str:
        cols = ", ".join(f'"{c}"' for c in self.column_names)
        marks = ", ".join("?" for _ in self.columns)
        return f'INSERT INTO "{keyspace}"."{self.name}" ({cols}) VALUES ({marks})'


def _field_types(pipeline: Pipeline) -> dict[str, pa.DataType]:
    return {f.name: f.type for f in event_schema(pipeline.reader_schema)}


def _cql_history(pipeline: Pipeline, field: str) -> list[str]:
    """The Cassandra types ``field`` has had across the pipeline's schema versions, oldest first
    (versions giving it a type no column holds are passed over)."""
    out = []
    for t in pipeline.field_type_history.get(field, []):
        try:
            out.append(cql_type(t))
        except ConfigurationError:
            continue
    return list(dict.fromkeys(out))


def stored_value(value: Any, cql: str) -> Any:
    """A value read from one of a stored field's columns, as the field's current CQL type holds it
    (every promotion Avro allows converts exactly, or as Avro itself does)."""
    if value is None:
        return None
    if cql == "float" and isinstance(value, int):
        # Rounded once to the nearest 32-bit float, as the speed layer's decode (Arrow's cast),
        # Spark's cast and Avro's Java resolver round an int or long read as a float.
        return float(np.array(value, np.int64).astype(np.float32))
    if cql in ("double", "float"):
        return float(value)
    if cql == "text" and isinstance(value, bytes | bytearray):
        return bytes(value).decode()
    if cql == "blob" and isinstance(value, str):
        return value.encode()
    return value


def read_stored(row: dict[str, Any], table: TableDef) -> dict[str, Any]:
    """``row`` (by column) with each stored field's columns folded into the field (in place)."""
    for s in table.stored:
        values = {c: row.pop(c, None) for c, _ in s.columns}
        # One is set (a row's write nulls the others); a row from before the promotion set the first.
        found = next((v for c, v in [(s.current, values[s.current]), *values.items()] if v is not None), None)
        row[s.field] = stored_value(found, s.cql)
    return row


def speed_table_def(
    pipeline: Pipeline, view: LatestView | WindowedView, *, types: Mapping[str, pa.DataType] | None = None
) -> TableDef:
    """The speed table of ``view`` (``types``: the event columns' types, by default the reader
    schema's; ``deploy`` passes the deployed schema's to compare the two)."""
    types = _field_types(pipeline) if types is None else types
    if isinstance(view, LatestView):
        cols: list[tuple[str, str]] = []
        stored = []
        for c in latest_columns(pipeline, view):
            try:
                cql = cql_type(types[c])
            except ConfigurationError as exc:
                kept = [k for k in latest_columns(pipeline, view) if k not in view.key and k != c]
                raise ConfigurationError(
                    f"view {view.name!r} of pipeline {pipeline.name!r} keeps field {c!r}: {exc.message}",
                    fix=f"list the fields the view keeps without it: columns = {json.dumps(kept)}",
                ) from None
            past = [] if c in view.key else _cql_history(pipeline, c)
            kinds = list(dict.fromkeys([*past, cql]))
            named = tuple((c if i == 0 else f"{c}__{t}", t) for i, t in enumerate(kinds))
            cols += named
            if len(named) > 1:
                stored.append(StoredField(c, named, current=dict((t, n) for n, t in named)[cql]))
        return TableDef(
            speed_table(pipeline, view), tuple(cols + INGEST_COLUMNS + CANDIDATE_COLUMNS), tuple(view.key),
            CANDIDATE, stored=tuple(stored), descending=_DESCENDING,
        )  # fmt: skip
    # A version made before a widening keeps its types until its successor serves.
    types = {**types, **held_types(pipeline, view, types)}
    cols = [(k, cql_type(types[k])) for k in view.key]
    cols += [(WINDOW_START, "timestamp"), (EPOCH, "bigint")]
    for c in view_components(view):
        if c.fn == "count":
            cols.append((c.column, "bigint"))
        elif c.fn in ("hll", "kll"):
            cols.append((c.column, "blob"))
        elif c.fn == "sum":
            src = types[c.source]  # type: ignore[index]
            summed = "decimal" if pa.types.is_decimal(src) else "bigint"
            cols.append((c.column, "double" if pa.types.is_floating(src) else summed))
        else:
            cols.append((c.column, cql_type(types[c.source])))  # type: ignore[index]
    # Speed rows of an epoch are covered by a batch within two batch periods: they expire after that.
    return TableDef(
        speed_table(pipeline, view), tuple(cols), tuple(view.key), (WINDOW_START, EPOCH),
        ttl_seconds=pipeline.layers.speed_ttl_seconds,
    )  # fmt: skip


def batch_table_def(pipeline: Pipeline, view: LatestView | WindowedView, generation: int) -> TableDef:
    """The table of one generation of published batch versions: the speed table's columns, without
    the ingest epoch (a batch row covers every epoch up to the horizon), each cell (a key of ``latest``,
    a key and window of a windowed view) once per batch version that wrote it (:data:`CELL_VERSION`,
    the last clustering column); ``latest`` rows carry their rank."""
    speed = speed_table_def(pipeline, view)
    name = batch_table(pipeline, view, generation)
    if isinstance(view, LatestView):
        values = [c for c in speed.columns if c[0] not in CANDIDATE]
        cols = (*values, (RANK, RANK_CQL), (CELL_VERSION, "bigint"))
        return TableDef(name, cols, speed.partition_key, (CELL_VERSION,), stored=speed.stored)
    cols = (*(c for c in speed.columns if c[0] != EPOCH), (CELL_VERSION, "bigint"))
    return TableDef(name, cols, speed.partition_key, (WINDOW_START, CELL_VERSION))


#: One row per pipeline: the active batch version, its generation (whose tables hold its cells) and
#: horizon, and the view versions (:mod:`lambdalake.view_versions`). Publishing writes every row of a
#: new version first, then this one row: the swap is a single-partition write, so atomic. Version 0:
#: no batch published yet.
BATCH_META = TableDef(
    BATCH_META_TABLE,
    (
        ("pipeline", "text"), ("version", "bigint"), ("horizon", "bigint"), ("epoch_ms", "bigint"),
        ("master_version", "bigint"), ("views", "text"), ("published_at", "timestamp"),
        ("view_versions", "text"), ("generation", "bigint"),
    ),
    ("pipeline",),
    comment=layout_comment(),
)  # fmt: skip


#: Batch versions claimed by publishes (``INSERT ... IF NOT EXISTS``): two runs never write one
#: version's tables, whatever they saw of each other.
BATCH_CLAIMS = TableDef(
    BATCH_CLAIMS_TABLE,
    (("pipeline", "text"), ("version", "bigint"), ("run_id", "text"), ("claimed_at", "timestamp")),
    ("pipeline",),
    ("version",),
    comment=layout_comment(),
)


def keyspace_replication(session: Session, settings: CassandraSettings) -> dict[str, str | int]:
    """The replication map a new keyspace gets: ``settings.replication``, or NetworkTopologyStrategy
    with 3 replicas in each datacenter (its nodes, if fewer).

    Raises:
        ConfigurationError: A replication factor above the nodes there are (every write would fail).
    """
    nodes = Counter(h.datacenter or "datacenter1" for h in session.cluster.metadata.all_hosts())
    if settings.replication is None:
        return {"class": "NetworkTopologyStrategy", **{dc: min(3, n) for dc, n in sorted(nodes.items())}}
    wanted = dict(settings.replication)
    strategy = str(wanted.get("class", "")).rsplit(".", 1)[-1]
    factors = (
        {"the cluster": (int(wanted.get("replication_factor", 1)), sum(nodes.values()))}
        if strategy == "SimpleStrategy"
        else {f"datacenter {dc}": (int(k), nodes.get(dc, 0)) for dc, k in wanted.items() if dc != "class"}
    )
    for where, (factor, have) in factors.items():
        if factor > have:
            raise ConfigurationError(
                f"keyspace {settings.keyspace!r}: replication factor {factor} in {where}, which has "
                f"{have} Cassandra node(s): no write could reach its replicas",
                fix="lower LAMBDALAKE_CASSANDRA__REPLICATION (or unset it: 3, or the nodes there are), "
                "or add nodes",
            )
    return wanted


def create_keyspace(session: Session, settings: CassandraSettings) -> None:
    """Create the keyspace unless it exists (its replication is then left as it is)."""
    if settings.keyspace in session.cluster.metadata.keyspaces:
        require_current(session, settings.keyspace)
        return
    replication = json.dumps(keyspace_replication(session, settings)).replace('"', "'")
    execute_ddl(
        session, f'CREATE KEYSPACE IF NOT EXISTS "{settings.keyspace}" WITH replication = {replication}'
    )


def ensure_table(session: Session, keyspace: str, table: TableDef) -> list[str]:
    """Create ``table`` if missing, and add the columns it lacks (a compatible schema version with a
    new field: ``ALTER TABLE ... ADD``). Returns the columns added. A column whose type differs is
    refused with the fix, since Cassandra cannot change it in place. A table the cluster has already
    takes no DDL: a job's role (the speed job's) may modify rows without the right to create tables."""
    ks = session.cluster.metadata.keyspaces.get(keyspace)
    fresh = False  # the driver's metadata of the table read anew here
    if ks is not None and table.name in ks.tables:
        # The driver's metadata may be stale: another process may have dropped the table since.
        with contextlib.suppress(DriverException):
            refresh_metadata(session, keyspace, table.name, wait_s=0)
            fresh = True
        ks = session.cluster.metadata.keyspaces.get(keyspace)
    if ks is None or table.name not in ks.tables:
        execute_ddl(session, table.create_cql(keyspace))
        fresh = False
    if not fresh:  # created just now, or the quick refresh failed: wait for the table to show
        refresh_metadata(session, keyspace, table.name)
    meta = session.cluster.metadata.keyspaces[keyspace].tables[table.name]
    if table.ttl_seconds and int(meta.options.get("default_time_to_live") or 0) != table.ttl_seconds:
        execute_ddl(
            session,
            f'ALTER TABLE "{keyspace}"."{table.name}" WITH default_time_to_live = {table.ttl_seconds}',
        )
    require_columns_fit(session, keyspace, table)
    added = []
    for name, cql in table.columns:
        if name not in meta.columns:
            execute_ddl(session, f'ALTER TABLE "{keyspace}"."{table.name}" ADD "{name}" {cql}')
            added.append(name)
    return added


def require_columns_fit(session: Session, keyspace: str, table: TableDef) -> None:
    """Refuse ``table`` if it exists with a column of another type (Cassandra cannot change it in
    place); a missing table or column is fine (``ensure_table`` adds it). Changes nothing."""
    ks = session.cluster.metadata.keyspaces.get(keyspace)
    meta = ks.tables.get(table.name) if ks is not None else None
    if meta is None:
        return
    for name, cql in table.columns:
        have = meta.columns.get(name)
        if have is not None and have.cql_type != cql:
            raise ConfigurationError(
                f"column {keyspace}.{table.name}.{name} is {have.cql_type}, the pipeline needs {cql}",
                fix="a field's type cannot change in place: give the field a new name in a new schema "
                "version, or drop the table and let the job write it again",
            )


def deploy_speed_tables(session: Session, settings: CassandraSettings, pipeline: Pipeline) -> list[TableDef]:
    """Create the keyspace and every speed table of the pipeline, adding new columns (idempotent)."""
    create_keyspace(session, settings)
    tables = [speed_table_def(pipeline, v) for v in pipeline.views]
    for table in tables:
        ensure_table(session, settings.keyspace, table)
    return tables
