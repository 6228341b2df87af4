"""Ground truth for the speed views, computed without lambdalake's code.

Events are read back from Kafka with confluent-kafka's own ``AvroDeserializer`` (not our decoder),
judged with the hand-written checks in ``tests.helpers`` and aggregated with pandas from the view
definitions' plain meaning: dedupe by identity keeping the first delivery (first in the partition's
log), latest = highest version per key, windowed = count/sum/min/max per (key, event-time window,
ingest epoch).
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pandas as pd
import pyarrow as pa
from cassandra.cluster import Cluster
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from lambdalake import filters
from lambdalake.cassandra.active import active_batch
from lambdalake.cassandra.session import connect
from lambdalake.cassandra.tables import batch_table_def
from lambdalake.pipeline import LatestView, Pipeline, WindowedView
from lambdalake.settings import Settings
from lambdalake.views import speed_table
from tests.helpers import REFERENCE_VALID, consume_all

logging.getLogger("cassandra").setLevel(logging.ERROR)


def topic_events(settings: Settings, pipeline: Pipeline) -> tuple[pd.DataFrame, int]:
    """(valid events with Kafka coordinates, number of records that are not valid events)."""
    deserializer = AvroDeserializer(SchemaRegistryClient(settings.registry.client_config()))
    rows, invalid = [], 0
    is_valid = REFERENCE_VALID[pipeline.generator.kind if pipeline.generator else pipeline.name]
    for msg in consume_all(settings, pipeline.topic.name):
        try:
            value = deserializer(msg.value(), SerializationContext(msg.topic(), MessageField.VALUE))
        except Exception:
            invalid += 1
            continue
        value = {k: (int(v.timestamp() * 1000) if hasattr(v, "timestamp") else v) for k, v in value.items()}
        if not is_valid(value, msg.timestamp()[1]):
            invalid += 1
            continue
        value.update(_ts=msg.timestamp()[1], _partition=msg.partition(), _offset=msg.offset())
        rows.append(value)
    return pd.DataFrame(rows), invalid


def first_deliveries(events: pd.DataFrame, pipeline: Pipeline) -> pd.DataFrame:
    # Log order, not timestamp order: two producers' records reach a partition in an order of their
    # own, and the first copy in the log is the first delivery.
    ordered = events.sort_values(["_partition", "_offset"])
    return ordered.drop_duplicates(subset=list(pipeline.event.identity), keep="first")


@dataclass(frozen=True)
class Distinct:
    """A ``distinct`` aggregate's truth: the distinct values (the stored sketch must bound their number)."""

    values: frozenset


@dataclass(frozen=True)
class Values:
    """A ``quantiles`` aggregate's truth: the values, sorted."""

    values: tuple[float, ...]


def kept(events: pd.DataFrame, pipeline: Pipeline, view: LatestView | WindowedView) -> pd.DataFrame:
    """The events the view's ``where`` keeps, judged by :func:`lambdalake.filters.keeps` on each event
    as the producer sent it (times as aware datetimes)."""
    node = pipeline.view_filter(view)
    if node is None or events.empty:
        return events
    times = [c for c, t in pipeline.field_types.items() if pa.types.is_timestamp(t) and c in events]

    def as_sent(row: dict[str, Any]) -> dict[str, Any]:
        for c in times:
            if row[c] is not None and not pd.isna(row[c]):
                row[c] = datetime.fromtimestamp(row[c] / 1000, UTC)
            else:
                row[c] = None
        return {
            k: (None if not isinstance(v, list | tuple | bytes) and pd.isna(v) else v) for k, v in row.items()
        }

    mask = [filters.keeps(node, as_sent(r)) for r in events.to_dict("records")]
    return events[mask]


def latest_view(
    events: pd.DataFrame, view: LatestView, pipeline: Pipeline | None = None
) -> dict[tuple, dict[str, Any]]:
    # Highest version (a null one below every version); among deliveries of one version the first
    # (lowest ingest time, offset).
    if pipeline is not None:
        events = kept(events, pipeline, view)
    if events.empty:
        return {}
    ordered = events.sort_values(
        [view.version, "_ts", "_offset"], ascending=[True, False, False], na_position="first", kind="stable"
    )
    winners = ordered.groupby(view.key, sort=False).tail(1)
    return {tuple(r[k] for k in view.key): r for r in winners.to_dict("records")}


def windowed_view(
    events: pd.DataFrame, pipeline: Pipeline, view: WindowedView, epoch_seconds: int
) -> dict[tuple, dict]:
    df = first_deliveries(events, pipeline).copy()
    df["epoch"] = df["_ts"] // (epoch_seconds * 1000)
    return _aggregate(df, pipeline, view, ["epoch"])


def batch_views(events: pd.DataFrame, pipeline: Pipeline, horizon: int) -> dict[str, dict[tuple, dict]]:
    """What the batch layer must hold for ``horizon``: each identity's first copy by (ingest time,
    partition, offset) over the whole history, then the events of epochs <= horizon, then the views
    (windowed rows per key and window, across epochs)."""
    ordered = events.sort_values(["_ts", "_partition", "_offset"], kind="stable")
    firsts = ordered.drop_duplicates(subset=list(pipeline.event.identity), keep="first")
    covered = firsts[firsts["_ts"] // (pipeline.layers.epoch_seconds * 1000) <= horizon]
    out: dict[str, dict[tuple, dict]] = {}
    for view in pipeline.views:
        if isinstance(view, LatestView):
            out[view.name] = latest_view(covered, view, pipeline)
        else:
            out[view.name] = _aggregate(covered.copy(), pipeline, view, [])
    return out


def _aggregate(
    df: pd.DataFrame, pipeline: Pipeline, view: WindowedView, extra: list[str]
) -> dict[tuple, dict]:
    df = kept(df, pipeline, view).copy()
    time_col = view.time or pipeline.event.time
    size_ms = view.window_seconds * 1000
    df["window_start"] = df[time_col] // size_ms * size_ms
    out: dict[tuple, dict] = {}
    for key, group in df.groupby([*view.key, "window_start", *extra]):
        row: dict[str, Any] = {}
        for agg in view.aggregates:
            col = group[agg.column] if agg.column else None
            if agg.fn == "count":
                row[agg.name] = len(group)
            elif agg.fn == "sum":
                row[agg.name] = col.sum()
            elif agg.fn == "min":
                row[agg.name] = col.min()
            elif agg.fn == "max":
                row[agg.name] = col.max()
            elif agg.fn == "distinct":
                row[agg.name] = Distinct(frozenset(v for v in col if v is not None and not pd.isna(v)))
            elif agg.fn == "quantiles":
                row[agg.name] = Values(
                    tuple(sorted(float(v) for v in col if v is not None and not pd.isna(v)))
                )
            else:
                row[f"{agg.name}_sum"], row[f"{agg.name}_count"] = col.sum(), col.count()
        out[key] = row
    return out


def cassandra_rows(settings: Settings, table: str, *, host: str | None = None) -> list[dict[str, Any]]:
    """Every row of ``table``, read at the settings' consistency, or from ``host`` alone at ONE (what
    that one replica holds)."""
    from cassandra import ConsistencyLevel
    from cassandra.cluster import EXEC_PROFILE_DEFAULT, ExecutionProfile
    from cassandra.policies import RoundRobinPolicy, WhiteListRoundRobinPolicy

    profile = (
        ExecutionProfile(load_balancing_policy=WhiteListRoundRobinPolicy([host]),
                         consistency_level=ConsistencyLevel.ONE)
        if host is not None
        else ExecutionProfile(load_balancing_policy=RoundRobinPolicy(),
                              consistency_level=ConsistencyLevel.name_to_value[settings.cassandra.consistency])
    )  # fmt: skip
    cluster = Cluster(
        [host] if host is not None else settings.cassandra.contact_points,
        port=settings.cassandra.port,
        **settings.cassandra.driver_options(),
        execution_profiles={EXEC_PROFILE_DEFAULT: profile},
    )
    try:
        session = cluster.connect(settings.cassandra.keyspace)
        rows = []
        # A ranked latest table's first candidate of a key is its row.
        limit = " PER PARTITION LIMIT 1" if table.endswith("__speed_latest") else ""
        for r in session.execute(f'SELECT * FROM "{table}"{limit}', timeout=60):
            d = r._asdict()
            # The driver returns naive UTC datetimes.
            rows.append(
                {
                    k: (round(v.replace(tzinfo=UTC).timestamp() * 1000) if hasattr(v, "timestamp") else v)
                    for k, v in d.items()
                }
            )
        return rows
    finally:
        cluster.shutdown()


def differences(
    settings: Settings, pipeline: Pipeline, events: pd.DataFrame, *, host: str | None = None
) -> list[str]:
    """Every way the speed tables differ from the reference (empty when equal); ``host``: as that
    one Cassandra node holds them."""
    problems: list[str] = []
    for view in pipeline.views:
        rows = cassandra_rows(settings, speed_table(pipeline, view), host=host)
        if isinstance(view, LatestView):
            want = latest_view(events, view, pipeline)
        else:
            want = windowed_view(events, pipeline, view, pipeline.layers.epoch_seconds)
        problems += compare(pipeline, view, want, rows, epoch=True)
    return problems


def batch_differences(
    pipeline: Pipeline, want: dict[str, dict[tuple, dict]], rows: dict[str, list[dict[str, Any]]]
) -> list[str]:
    """Every way batch rows (per view; timestamps as epoch ms) differ from :func:`batch_views`."""
    problems: list[str] = []
    for view in pipeline.views:
        problems += compare(pipeline, view, want[view.name], rows[view.name], epoch=False)
    return problems


def compare(
    pipeline: Pipeline,
    view: LatestView | WindowedView,
    want: dict[tuple, dict],
    rows: list[dict],
    *,
    epoch: bool,
) -> list[str]:
    """How ``rows`` (as stored: timestamps in epoch ms) differ from the reference ``want``."""
    if isinstance(view, LatestView):
        got = {tuple(r[k] for k in view.key): r for r in rows}
        cols = [c for c in pipeline.reader_fields if c not in view.key]
    else:
        extra = ["epoch"] if epoch else []
        got = {(*[r[k] for k in view.key], r["window_start"], *[r[e] for e in extra]): r for r in rows}
        cols = list(next(iter(want.values())).keys()) if want else []
    if set(got) != set(want):
        return [
            f"{view.name}: {len(set(want) - set(got))} rows missing, "
            f"{len(set(got) - set(want))} unexpected (of {len(want)})"
        ]
    problems: list[str] = []
    bad = 0
    aggregates = {a.name: a for a in view.aggregates} if isinstance(view, WindowedView) else {}
    for key, w in want.items():
        for c in cols:
            a, b = w[c], got[key][c]
            if isinstance(a, Distinct | Values):
                problem = sketch_problem(a, b, aggregates[c])
                if problem:
                    bad += 1
                    if bad <= 3:
                        problems.append(f"{view.name} {key} {c}: {problem}")
                continue
            if isinstance(a, float) or isinstance(b, float):
                same = a is not None and b is not None and abs(a - b) <= 1e-6 * max(1.0, abs(a))
                same = same or (pd.isna(a) and (b is None or pd.isna(b)))
            else:
                same = (None if pd.isna(a) else a) == b if not isinstance(a, str) else a == b
            if not same:
                bad += 1
                if bad <= 3:
                    problems.append(f"{view.name} {key} {c}: want {a!r}, got {b!r}")
    if bad:
        problems.append(f"{view.name}: {bad} values differ")
    return problems


def sketch_problem(truth: Distinct | Values, got: Any, agg: Any) -> str | None:
    """Why a stored sketch (bytes) or a merged answer (dict) is outside its stated bound of the
    truth, or None. ``distinct``: the exact count within [lower, upper]; ``quantiles``: the count
    exact and each answered quantile's value of a true rank within q plus or minus the rank error."""
    from lambdalake import sketches

    if isinstance(got, bytes | bytearray):
        got = (
            sketches.hll_answer(got, agg.sketch_lg_k)
            if isinstance(truth, Distinct)
            else sketches.kll_answer(got, agg.quantiles)
        )
    if got is None:
        return None if not truth.values else f"no sketch for {len(truth.values)} values"
    if isinstance(truth, Distinct):
        n = len(truth.values)
        if not got["lower"] <= n <= got["upper"]:
            bounds = f"[{got['lower']:.1f}, {got['upper']:.1f}]"
            return f"{n} distinct values, answered {got['estimate']:.1f} in {bounds}"
        return None
    values = truth.values
    if got["count"] != len(values):
        return f"{len(values)} values, the sketch counted {got['count']}"
    eps = got["rank_error"]
    for q_text, v in got["quantiles"].items():
        if not values:
            if v is not None:
                return f"quantile {q_text} of no values answered {v}"
            continue
        q = float(q_text)
        below = bisect.bisect_left(values, v) / len(values)
        at_most = bisect.bisect_right(values, v) / len(values)
        if not below - eps <= q <= at_most + eps:
            rank = f"{below:.4f}-{at_most:.4f}"
            return f"quantile {q_text} answered {v}, whose true rank is {rank} (error {eps:.4f})"
    return None


#: A horizon past every epoch: :func:`batch_views` over every event.
EVERYTHING = 2**62


def as_ms(value: Any) -> Any:
    return round(value.timestamp() * 1000) if isinstance(value, datetime) else value


def merged_rows(client: Any, pipeline: Pipeline, view, keys: set[tuple]) -> list[dict]:
    """Every key's merged answer as stored-style rows (timestamps as epoch ms) for ``compare``."""
    rows = []
    for key in keys:
        answer = client.query(pipeline.name, view.name, list(key))
        if isinstance(view, LatestView):
            if answer.latest is not None:
                rows.append({k: as_ms(v) for k, v in answer.latest.values.items()})
            continue
        for w in answer.windows:
            rows.append({**answer.key, "window_start": as_ms(w.window_start), **w.values})
    return rows


def batch_rows(settings: Settings, pipeline: Pipeline, view, active) -> list[dict[str, Any]]:
    """The rows of ``view`` that batch version ``active`` serves: per cell, the newest cell version
    not above it, in its generation's table (without the version column)."""
    from lambdalake.views import CELL_VERSION, WINDOW_START, newest_cells

    rows = cassandra_rows(settings, batch_table_def(pipeline, view, active.generation).name)
    if not rows:
        return []
    names = list(rows[0])
    cell = [*view.key, *([] if isinstance(view, LatestView) else [WINDOW_START])]
    kept = newest_cells(names, [tuple(r.values()) for r in rows], cell=cell, version=active.version)
    return [{k: v for k, v in zip(names, row, strict=True) if k != CELL_VERSION} for row in kept]


def stored_keys(settings: Settings, pipeline: Pipeline, view) -> set[tuple]:
    """Keys the speed table and the active batch table hold (to catch answers the reference lacks)."""
    rows = cassandra_rows(settings, speed_table(pipeline, view))
    active = active_batch(connect(settings.cassandra), settings.cassandra.keyspace, pipeline.name)
    if active is not None:
        rows += batch_rows(settings, pipeline, view, active)
    return {tuple(r[k] for k in view.key) for r in rows}


def merged_differences(settings: Settings, client: Any, pipelines: dict[str, Pipeline]) -> list[str]:
    """How merged answers differ from the reference over every valid event sent (empty when equal)."""
    problems = []
    for pipeline in pipelines.values():
        events, _ = topic_events(settings, pipeline)
        want = batch_views(events, pipeline, EVERYTHING)
        for view in pipeline.views:
            keys = {k[: len(view.key)] for k in want[view.name]} | stored_keys(settings, pipeline, view)
            got = merged_rows(client, pipeline, view, keys)
            problems += compare(pipeline, view, want[view.name], got, epoch=False)
    return problems
