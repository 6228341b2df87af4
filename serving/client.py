"""The merged query as a Python API: reads the active batch version, then the batch and speed rows
of one key with prepared statements, and merges them exactly (``serving.merge``)."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pyarrow as pa
from cassandra import InvalidRequest, OperationTimedOut, ReadFailure, ReadTimeout, Unavailable
from cassandra.cluster import EXEC_PROFILE_DEFAULT, ExecutionProfile, ResponseFuture, Session
from cassandra.protocol import ServerError
from cassandra.query import PreparedStatement, tuple_factory

from lambdalake.cassandra.active import ActiveBatch, PipelineMeta, read_meta
from lambdalake.cassandra.routing import (
    lags_schema,
    missing_table,
    replica_lacks_schema,
    suspect_coordinator,
    table_known,
)
from lambdalake.cassandra.session import await_schema_agreement, connect
from lambdalake.cassandra.tables import TableDef, read_stored, speed_table_def
from lambdalake.errors import ConfigurationError, LambdalakeError, ServiceUnavailable
from lambdalake.event_schema import event_schema
from lambdalake.latest import CANDIDATE, RANK, rank
from lambdalake.pipeline import LatestView, Pipeline, WindowedView, configured_pipeline, list_pipelines
from lambdalake.serving.answers import Answer, LatestRow, Provenance
from lambdalake.serving.contract import EARLIEST_MS, LATEST_MS
from lambdalake.serving.merge import RowSet, aware_utc, aware_utc_values, merge_windows, pick_latest
from lambdalake.settings import Settings
from lambdalake.view_types import held_types
from lambdalake.views import (
    CELL_VERSION,
    WINDOW_START,
    batch_table,
    newest_cells,
    speed_table,
)

#: Window bounds when a query gives none (Cassandra timestamps are epoch milliseconds).

#: The ingest time of a ``latest`` row (a batch row published without a rank is ranked by it).
RANKED_COLUMN = "_ingest_ts"


def _batch_rank(data: dict[str, Any]) -> int:
    """A batch row's rank (:mod:`lambdalake.latest`): its own; a row without one ranks as a null
    version does."""
    if data.get(RANK) is not None:
        return int(data[RANK])
    ingest = aware_utc(data[RANKED_COLUMN])
    return rank(None, math.floor(ingest.timestamp()))


class NotFound(LambdalakeError):
    """An unknown pipeline or view (HTTP 404)."""


class BadQuery(LambdalakeError, ValueError):
    """A key or time the view cannot take (HTTP 422)."""


#: Tries of a read before it answers 503 (a table no coordinator asked has seen yet, or replicas
#: that did not answer), and the pause before each retry after the second (seconds, times the try).
LAG_ATTEMPTS = 4
LAG_PAUSE_S = 0.25


#: Errors of a read that the next try may not meet: a replica too slow to answer in time (one just
#: back, replaying its commit log), or a coordinator whose gossip still counts a returned node down.
#: With a quorum up, a later try answers; with a quorum down every try fails alike, and the last
#: error is raised (the API's 503 names the consistency level).
REPLICA_ERRORS = (ReadTimeout, Unavailable, ReadFailure, OperationTimedOut)

#: How long a read whose replica had not seen the table yet (``INCOMPATIBLE_SCHEMA``: a node back
#: from an outage, before it pulled the schema of a batch published without it) waits for the nodes
#: to agree on the schema before its next try. Another coordinator alone does not help: it may ask the
#: same replica. Measured: one such read failed all four quick tries in a churn soak.
SCHEMA_WAIT_S = 10.0


class SchemaCatchingUp(ServiceUnavailable):
    """The coordinators asked have not seen a view's table yet though the cluster has it (HTTP 503)."""


class NotDeployed(ConfigurationError):
    """A pipeline of the pipelines folder whose view tables are not in the keyspace (HTTP 503)."""


Moment = datetime | int | str

#: The largest finite 32-bit float.
FLOAT32_MAX = 3.4028234663852886e38


class ServingClient:
    """Merged answers for the views of every pipeline under ``settings.pipelines_dir``.

    Thread-safe: one client serves concurrent requests (the driver's session is shared).

    Args:
        settings: Where Cassandra and the pipeline definitions are.
        meta_ttl_s: How long the active-batch row is cached before it is read again (default 1 s):
            a new batch version is served at most this long after its publish.
        session: A Cassandra session to use (default: one from ``settings``).
    """

    def __init__(
        self, *, settings: Settings, meta_ttl_s: float = 1.0, session: Session | None = None
    ) -> None:
        self.settings = settings
        self.keyspace = settings.cassandra.keyspace
        self.meta_ttl_s = meta_ttl_s
        self._session = session
        self._pipelines: dict[str, Pipeline] = {}
        self._types: dict[str, dict[str, pa.DataType]] = {}
        self._meta: dict[str, tuple[float, PipelineMeta]] = {}
        self._prepared: dict[str, PreparedStatement] = {}
        self._tables: dict[tuple[str, str, str], TableDef] = {}
        self._lock = threading.Lock()
        self._profile: ExecutionProfile | None = None

    @property
    def session(self) -> Session:
        if self._session is None:
            self._session = connect(self.settings.cassandra)
        return self._session

    @property
    def profile(self) -> ExecutionProfile:
        """The session's default profile returning plain tuples: the driver's named tuples build a
        class per result (and rename columns starting with ``_``)."""
        if self._profile is None:
            self._profile = self.session.execution_profile_clone_update(
                EXEC_PROFILE_DEFAULT, row_factory=tuple_factory
            )
        return self._profile

    # --- definitions ------------------------------------------------------------------------

    def pipeline_names(self) -> list[str]:
        return list_pipelines(self.settings.pipelines_dir)

    def pipeline(self, name: str) -> Pipeline:
        """The pipeline ``name`` (cached); :class:`NotFound` if there is no such file."""
        if name not in self._pipelines:
            if name not in self.pipeline_names():
                raise NotFound(f"no pipeline named {name!r}", fix=f"use one of {self.pipeline_names()}")
            pipeline = configured_pipeline(name, self.settings)
            self._types[name] = event_types(pipeline)  # before the pipeline: readers take both
            self._pipelines[name] = pipeline
        return self._pipelines[name]

    def view(self, pipeline: str, view: str) -> tuple[Pipeline, LatestView | WindowedView]:
        p = self.pipeline(pipeline)
        found = next((v for v in p.views if v.name == view), None)
        if found is None:
            raise NotFound(
                f"pipeline {pipeline!r} has no view {view!r}", fix=f"use one of {[v.name for v in p.views]}"
            )
        return p, found

    def meta(self, pipeline: str, *, refresh: bool = False) -> PipelineMeta:
        """The pipeline's metadata row (active batch, view versions), cached for ``meta_ttl_s``."""
        now = time.monotonic()
        cached = self._meta.get(pipeline)
        if refresh or cached is None or now - cached[0] > self.meta_ttl_s:
            cached = (now, read_meta(self.session, self.keyspace, pipeline))
            self._meta[pipeline] = cached
        return cached[1]

    def active(self, pipeline: str, *, refresh: bool = False) -> ActiveBatch | None:
        """The active batch version, cached for ``meta_ttl_s``."""
        return self.meta(pipeline, refresh=refresh).batch

    def served(
        self, pipeline: str, view: str, *, refresh: bool = False
    ) -> tuple[Pipeline, LatestView | WindowedView, ActiveBatch | None]:
        """The view's active version (its definition under its internal name) and the active
        batch if it published that version (None: served from speed rows alone).

        Raises:
            NotFound: No such pipeline or view.
            NotDeployed: The view's first version is still being built.
        """
        p, v = self.view(pipeline, view)
        meta = self.meta(p.name, refresh=refresh)
        if not meta.registry.empty:
            version = meta.registry.active(view)
            if version is None:
                raise NotDeployed(
                    f"view {view!r} of {p.name!r} is being built from the master dataset; it is answered "
                    "once the build completes",
                    fix=f"wait for `lambdalake deploy --pipeline {p.name}` to finish (`lambdalake status` "
                    "shows each view's versions)",
                )
            v = version.definition
        batch = meta.batch if meta.batch is not None and v.name in meta.batch.views else None
        return p, v, batch

    # --- the query --------------------------------------------------------------------------

    def query(
        self,
        pipeline: str,
        view: str,
        key: Any,
        *,
        start: Moment | None = None,
        end: Moment | None = None,
        quantiles: Sequence[float] | None = None,
    ) -> Answer:
        """The merged answer for ``key`` of ``view``.

        Args:
            pipeline: The pipeline's name.
            view: The view's name.
            key: The key's value; a composite key as a sequence in the view's key order (or one
                string with the values separated by commas).
            start: Windows starting at or after this (windowed views; datetime, epoch ms or ISO-8601).
            end: Windows starting before this.
            quantiles: What every ``quantiles`` aggregate answers (default: each one's own ``q``),
                from the same merged sketch.

        Raises:
            NotFound: Unknown pipeline or view.
            BadQuery: A key value or time the view cannot take.
        """
        p, v, active = self.served(pipeline, view)
        for attempt in range(LAG_ATTEMPTS):
            values = key_values(p, v, key, types=self._types[p.name])
            sent: tuple[ResponseFuture | None, ...] = ()
            try:
                sent = self._send(p, v, values, active, start, end)
                return self._answer(p, view, v, values, active, *sent, quantiles=quantiles)
            except (InvalidRequest, ServerError) as exc:
                p, v, active = self._recover(exc, p, view, v, active, sent, attempt)
                time.sleep(LAG_PAUSE_S * attempt)
            except REPLICA_ERRORS as exc:
                if attempt + 1 == LAG_ATTEMPTS:
                    raise
                if replica_lacks_schema(exc):
                    await_schema_agreement(self.session, SCHEMA_WAIT_S)
                time.sleep(LAG_PAUSE_S * attempt)
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def aquery(
        self,
        pipeline: str,
        view: str,
        key: Any,
        *,
        start: Moment | None = None,
        end: Moment | None = None,
        quantiles: Sequence[float] | None = None,
    ) -> Answer:
        """:meth:`query` for asyncio: waits for Cassandra without blocking the event loop (the
        active-batch row, cached, is read synchronously at most once per ``meta_ttl_s``)."""
        p, v, active = self.served(pipeline, view)
        for attempt in range(LAG_ATTEMPTS):
            values = key_values(p, v, key, types=self._types[p.name])
            sent: tuple[ResponseFuture | None, ...] = ()
            try:
                sent = self._send(p, v, values, active, start, end)
                await _completed(*sent)
                return self._answer(p, view, v, values, active, *sent, quantiles=quantiles)
            except (InvalidRequest, ServerError) as exc:
                p, v, active = self._recover(exc, p, view, v, active, sent, attempt)
                if attempt:
                    await asyncio.sleep(LAG_PAUSE_S * attempt)
            except REPLICA_ERRORS as exc:
                if attempt + 1 == LAG_ATTEMPTS:
                    raise
                if replica_lacks_schema(exc):
                    await asyncio.to_thread(await_schema_agreement, self.session, SCHEMA_WAIT_S)
                await asyncio.sleep(LAG_PAUSE_S * attempt)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _recover(
        self,
        exc: InvalidRequest | ServerError,
        p: Pipeline,
        view: str,
        v: LatestView | WindowedView,
        active: ActiveBatch | None,
        sent: tuple[ResponseFuture | None, ...],
        attempt: int,
    ) -> tuple[Pipeline, LatestView | WindowedView, ActiveBatch | None]:
        """After a read failed: the version to try again with, or the error to show.

        A table the metadata row names that a coordinator says does not exist is either retired
        meanwhile (the row, read again, names another) or not seen by that coordinator yet (a node
        back from an outage before it pulled the schema): then the read goes to another one.
        """
        tables = {speed_table(p, v)} | (
            {batch_table(p, v, active.generation)} if active is not None else set()
        )
        missing = missing_table(exc)
        if missing in tables:
            # The cached batch or view version may have been retired meanwhile: read the row again.
            fresh = self.served(p.name, view, refresh=True)
            if fresh[1].name != v.name or fresh[2] != active:  # anything else would fail the same way
                return fresh
        lagging = lags_schema(exc, tables if self._registered(p, missing) else None)
        if lagging:
            for future in sent:
                if future is not None and getattr(future, "_final_exception", None) is not None:
                    suspect_coordinator(self.session, future)
            if attempt + 1 < LAG_ATTEMPTS:
                return p, v, active
            raise SchemaCatchingUp(
                f"the Cassandra nodes asked for {p.name}/{view} have not all seen its table "
                f"{missing or '(unknown CF)'} yet: a node back from an outage is catching up on the schema",
                fix=f"retry in a few seconds (after {LAG_ATTEMPTS} tries on other coordinators)",
            ) from None
        missing_keyspace = f"Keyspace {self.keyspace} does not exist" in str(exc)
        if missing == speed_table(p, v) or missing_keyspace:
            raise NotDeployed(
                f"the view tables of {p.name!r} do not exist in keyspace {self.keyspace!r}",
                fix=f"run `lambdalake deploy --pipeline {p.name}`",
            ) from None
        raise exc

    def _registered(self, p: Pipeline, table: str | None) -> bool:
        """Whether ``table`` exists by what serving knows apart from the coordinator that said it
        does not: the active-version row names its view version, or the driver's schema has it."""
        if table is None:
            return False
        if not self.meta(p.name).registry.empty:
            return True  # the row names the active version: its tables were created before it was
        return table_known(self.session, self.keyspace, table)

    def _send(
        self,
        p: Pipeline,
        v: LatestView | WindowedView,
        values: list[Any],
        active: ActiveBatch | None,
        start: Moment | None,
        end: Moment | None,
    ) -> tuple[ResponseFuture, ResponseFuture | None]:
        """Both reads, in flight at once: the speed rows and the active version's batch rows."""
        params = values
        if isinstance(v, WindowedView):
            params = [*values, moment_ms(start, "from") if start is not None else EARLIEST_MS,
                      moment_ms(end, "to") if end is not None else LATEST_MS]  # fmt: skip
        return self._read(p, v, None, params), self._read(p, v, active.generation, params) if active else None

    def _answer(
        self,
        p: Pipeline,
        name: str,
        v: LatestView | WindowedView,
        values: list[Any],
        active: ActiveBatch | None,
        speed_f: ResponseFuture,
        batch_f: ResponseFuture | None,
        *,
        quantiles: Sequence[float] | None = None,
    ) -> Answer:
        epoch_ms = active.epoch_ms if active else p.layers.epoch_ms
        horizon = active.horizon if active else None
        key = dict(zip(v.key, values, strict=True))
        if isinstance(v, LatestView):
            speed_rows = _rows(speed_f)
            batch_rows = _rows(batch_f) if batch_f is not None else []
            speed = batch = None
            table = self._table_def(p, v)
            for data in speed_rows:  # the first candidate: the winner (LIMIT 1)
                rank = data[RANK]
                for c in CANDIDATE:
                    data.pop(c)
                speed = LatestRow(read_stored(data, table), int(rank), "speed")
            for data in newest_rows(batch_rows, active):
                read_stored(data, table)
                batch = LatestRow(
                    {k: x for k, x in data.items() if k not in (RANK, CELL_VERSION)},
                    _batch_rank(data),
                    "batch",
                )
            winner = pick_latest(batch, speed)
            epochs = (winner.values.get("_epoch"),) if winner is speed and winner is not None else ()
            provenance = _provenance(active, epoch_ms, tuple(e for e in epochs if e is not None))
            return Answer(p.name, name, "latest", key, provenance, latest=winner)
        names, rows = _tuples(batch_f)
        if active is not None:
            rows = newest_cells(names, rows, cell=(WINDOW_START,), version=active.version)
        windows = merge_windows((names, rows), _tuples(speed_f), v, horizon=horizon, quantiles=quantiles)
        epochs = tuple(sorted({e for w in windows for e in w.speed_epochs}))
        return Answer(p.name, name, "windowed", key, _provenance(active, epoch_ms, epochs), windows=windows)

    def _read(
        self, p: Pipeline, v: LatestView | WindowedView, generation: int | None, params: list[Any]
    ) -> ResponseFuture:
        """The speed rows (``generation`` None) or one batch generation's rows of a key (every cell
        version in it), asynchronously."""
        return self.session.execute_async(
            self._statement(p, v, generation), params, execution_profile=self.profile
        )

    def _table_def(self, p: Pipeline, v: LatestView | WindowedView) -> TableDef:
        """The view's speed table (computed once per pipeline, view and reader schema)."""
        key = (p.name, v.name, p.schema_.versions[-1])
        found = self._tables.get(key)
        if found is None:
            found = self._tables[key] = speed_table_def(p, v)
        return found

    def _statement(
        self, p: Pipeline, v: LatestView | WindowedView, generation: int | None
    ) -> PreparedStatement:
        table = speed_table(p, v) if generation is None else batch_table(p, v, generation)
        where = " AND ".join(f'"{k}" = ?' for k in v.key)
        if isinstance(v, WindowedView):
            window = f'"{WINDOW_START}" >= ? AND "{WINDOW_START}" < ?'
            cql = f'SELECT * FROM "{self.keyspace}"."{table}" WHERE {where} AND {window}'
        elif generation is None:
            # Candidates in the latest rule's order: the first is the winner.
            cols = ", ".join(f'"{c}"' for c in self._table_def(p, v).column_names)
            cql = f'SELECT {cols} FROM "{self.keyspace}"."{table}" WHERE {where} LIMIT 1'
        else:
            cql = f'SELECT * FROM "{self.keyspace}"."{table}" WHERE {where}'
        with self._lock:
            stmt = self._prepared.get(cql)
        if stmt is None:
            stmt = self.session.prepare(cql)
            with self._lock:
                self._prepared[cql] = stmt
        return stmt


def quantile_list(texts: Sequence[str]) -> list[float]:
    """Quantiles asked as text (each value may hold several, comma-separated).

    Raises:
        BadQuery: One is not a number in [0, 1].
    """
    out = []
    for text in texts:
        for part in text.split(","):
            try:
                q = float(part)
            except ValueError:
                q = math.nan
            if not 0.0 <= q <= 1.0:
                raise BadQuery(
                    f"quantile {part!r} is not a number between 0 and 1", fix="ask e.g. q=0.5,0.99"
                )
            out.append(q)
    return out


def newest_rows(rows: list[dict[str, Any]], active: ActiveBatch | None) -> list[dict[str, Any]]:
    """A key's ``latest`` batch rows as ``active`` reads them: the newest cell version not above it."""
    if active is None or not rows:
        return rows
    names = list(rows[0])
    kept = newest_cells(names, [tuple(r.values()) for r in rows], cell=(), version=active.version)
    return [dict(zip(names, row, strict=True)) for row in kept]


def _provenance(active: ActiveBatch | None, epoch_ms: int, epochs: tuple[int, ...]) -> Provenance:
    if active is None:
        return Provenance(None, None, None, epoch_ms, epochs)
    return Provenance(
        active.version, active.horizon, (active.horizon + 1) * active.epoch_ms, epoch_ms, epochs
    )


async def _completed(*futures: ResponseFuture | None) -> None:
    """Wait for the driver's futures on the running asyncio loop (their callbacks run on the
    driver's I/O thread); their results are then read without blocking."""
    loop = asyncio.get_running_loop()
    waits = []
    for rf in futures:
        if rf is None:
            continue
        done = loop.create_future()

        def settle(_result: Any, done: asyncio.Future = done) -> None:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

        rf.add_callbacks(settle, settle)  # an error is raised by .result() afterwards
        waits.append(done)
    await asyncio.gather(*waits)


def _tuples(future: ResponseFuture | None) -> RowSet:
    """A query's column names and rows (plain tuples: the profile's row factory)."""
    if future is None:
        return (), ()
    result = future.result()
    # More than a page (fetch_size rows): the iterator fetches the rest.
    return result.column_names, list(result) if result.has_more_pages else result.current_rows


def _rows(future: ResponseFuture) -> list[dict[str, Any]]:
    """A query's rows as dicts by column name; timestamps as aware UTC datetimes (the driver returns
    naive UTC)."""
    result = future.result()
    names = result.column_names
    return [aware_utc_values(dict(zip(names, row, strict=True))) for row in result]


def key_values(
    p: Pipeline,
    v: LatestView | WindowedView,
    key: Any,
    *,
    types: dict[str, pa.DataType] | None = None,
) -> list[Any]:
    """The key as the table's column types (raises :class:`BadQuery` naming the column).
    ``types``: :func:`event_types` of ``p``, when the caller keeps them."""
    if isinstance(key, str):
        parts = [key] if len(v.key) == 1 else key.split(",")
    elif isinstance(key, Sequence) and not isinstance(key, bytes | bytearray):
        parts = list(key)
    else:  # one value of a one-column key: a number, bytes, a datetime...
        parts = [key]
    if len(parts) != len(v.key):
        raise BadQuery(
            f"view {v.name!r} is keyed by {list(v.key)}: got {len(parts)} value(s)",
            fix="give one value per key column, separated by commas",
        )
    types = types or event_types(p)
    types = {**types, **held_types(p, v, types)}  # a version made before a widening
    return [_typed(column, types[column], value) for column, value in zip(v.key, parts, strict=True)]


def event_types(p: Pipeline) -> dict[str, pa.DataType]:
    """Each event column's type."""
    return {f.name: f.type for f in event_schema(p.reader_schema)}


def _typed(column: str, t: pa.DataType, value: Any) -> Any:
    """``value`` as the key column's type, inside what the column holds (an integer beyond the
    column's bits, or a float beyond a ``float``'s range, is no key any row has: a 422, not a
    driver error)."""
    try:
        if pa.types.is_integer(t):
            number = int(str(value).strip()) if isinstance(value, str) else int(value)
            half = 1 << (t.bit_width - 1)
            if not -half <= number < half:
                raise ValueError(f"beyond a {t.bit_width}-bit integer")
            return number
        if pa.types.is_floating(t):
            number = float(value)
            if t.bit_width == 32 and math.isfinite(number) and abs(number) > FLOAT32_MAX:
                raise ValueError("beyond a 32-bit float")
            return number
        if pa.types.is_decimal(t):
            # As the column stores it, at its scale: Cassandra hashes 12.5 and 12.50 apart.
            scaled = Decimal(str(value).strip()).scaleb(t.scale)
            if not scaled.is_finite() or scaled != scaled.to_integral_value():
                raise ValueError(f"not a decimal of at most {t.scale} places")
            if abs(scaled) >= 10**t.precision:
                raise ValueError(f"more than {t.precision} digits")
            return Decimal(int(scaled)).scaleb(-t.scale)
        if pa.types.is_binary(t):
            return value if isinstance(value, bytes) else str(value).encode("utf-8")
        if pa.types.is_boolean(t):
            if str(value).lower() not in ("true", "false"):
                raise ValueError(value)
            return str(value).lower() == "true"
        if pa.types.is_timestamp(t):
            return moment_ms(value, column)
    except (TypeError, ValueError, ArithmeticError):
        raise BadQuery(
            f"key column {column!r} is {t}: {str(value)[:100]!r} is not one", fix=f"give a {t} value"
        ) from None
    return str(value)


def moment_ms(value: Moment, what: str) -> int:
    """Epoch milliseconds from a datetime, a number of ms or ISO-8601 text."""
    if isinstance(value, datetime):
        ms = int((value if value.tzinfo else value.replace(tzinfo=UTC)).timestamp() * 1000)
    elif isinstance(value, int) and not isinstance(value, bool):
        ms = value
    elif (text := str(value).strip()).lstrip("-").isdigit():
        ms = int(text)
    else:
        try:
            parsed = datetime.fromisoformat(text.upper().replace("Z", "+00:00"))
            ms = int((parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).timestamp() * 1000)
        except (ValueError, OverflowError):
            raise BadQuery(
                f"{what} {value!r} is not a time",
                fix="give ISO-8601 (2026-11-23T02:00:00Z) or epoch milliseconds",
            ) from None
    if not EARLIEST_MS <= ms <= LATEST_MS:
        raise BadQuery(
            f"{what} {value!r} is outside the times a view stores",
            fix=f"give epoch milliseconds from {EARLIEST_MS} to {LATEST_MS}, or ISO-8601 in years 1-9999",
        )
    return ms
