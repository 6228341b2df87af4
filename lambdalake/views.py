"""What a view stores and how its rows merge: the engine-free half of a view definition.

A windowed aggregate is stored as mergeable components (an average as its sum and count), so a batch
row and any number of speed rows of later epochs combine exactly; :func:`merge` is that combination,
used by serving. The Spark half (``lambdalake.spark.views``) computes the same components.
"""

from __future__ import annotations

import decimal
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from functools import partial
from typing import Any, Literal

from lambdalake import filters, layout, sketches
from lambdalake.pipeline import Aggregate, LatestView, Pipeline, WindowedView

Merge = Literal["add", "min", "max", "hll", "kll"]

#: Columns every speed row of a windowed view is keyed by besides the view's key.
WINDOW_START = "window_start"
EPOCH = "epoch"


@dataclass(frozen=True)
class Component:
    """One stored column of an aggregate and how two values of it combine."""

    column: str
    #: ``hll``: a ``distinct`` aggregate's HLL sketch; ``kll``: a ``quantiles`` aggregate's KLL sketch
    #: (both stored as their DataSketches bytes).
    fn: Literal["count", "sum", "min", "max", "hll", "kll"]
    source: str | None
    merge: Merge
    #: The sketch's size parameter: ``lg_k`` of an HLL sketch, ``k`` of a KLL sketch.
    size: int | None = None


def components(agg: Aggregate) -> list[Component]:
    if agg.fn == "avg":
        return [
            Component(f"{agg.name}_sum", "sum", agg.column, "add"),
            Component(f"{agg.name}_count", "count", agg.column, "add"),
        ]
    if agg.fn == "distinct":
        return [Component(agg.name, "hll", agg.column, "hll", agg.sketch_lg_k)]
    if agg.fn == "quantiles":
        return [Component(agg.name, "kll", agg.column, "kll", agg.sketch_k)]
    merge: Merge = {"count": "add", "sum": "add", "min": "min", "max": "max"}[agg.fn]  # type: ignore[assignment]
    return [Component(agg.name, agg.fn, agg.column, merge)]  # type: ignore[arg-type]


def view_components(view: WindowedView) -> list[Component]:
    return [c for agg in view.aggregates for c in components(agg)]


def windowed_inputs(pipeline: Pipeline, view: WindowedView) -> list[str]:
    """The event columns a windowed view reads: its key, its time column, what it aggregates and
    what its filter reads."""
    sources = [c.source for c in view_components(view) if c.source]
    return list(
        dict.fromkeys([*view.key, view.time or pipeline.event.time, *sources, *filter_inputs(pipeline, view)])
    )


def filter_inputs(pipeline: Pipeline, view: LatestView | WindowedView) -> list[str]:
    """The event columns a view's ``where`` reads (none without one)."""
    node = pipeline.view_filter(view)
    return filters.fields(node) if node is not None else []


#: Decimal arithmetic wide enough for any sum of decimals of 38 digits, and trapping any rounding:
#: merged decimal sums are exact (the default context keeps 28 digits and rounds silently).
EXACT = decimal.Context(prec=200, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN, traps=[decimal.Inexact])
#: Places an average of a decimal adds to its field's scale (``decimal(p + 4, s + 4)``, as Spark's avg).
AVG_EXTRA_SCALE = 4


def _add(a: Any, b: Any) -> Any:
    return EXACT.add(a, b) if type(a) is Decimal else a + b


#: How two non-null values of a component combine.
_COMBINE = {"add": _add, "min": min, "max": max}


def _combine(c: Component) -> Callable[[Any, Any], Any]:
    if c.merge == "hll":
        return partial(sketches.hll_merge, lg_k=c.size)
    if c.merge == "kll":
        return sketches.kll_merge
    return _COMBINE[c.merge]


def average(total: Any, n: int) -> Any:
    """``total / n``: a float for numbers; for a decimal sum of scale ``s``, the decimal of scale
    ``s + 4`` nearest the exact quotient, halves away from zero (Spark's avg of a decimal), computed
    in integers so that no intermediate rounding can move it."""
    if type(total) is not Decimal:
        return total / n
    scale = -total.as_tuple().exponent  # type: ignore[operator]
    unscaled = int(total.scaleb(scale, context=EXACT)) * 10**AVG_EXTRA_SCALE
    q, r = divmod(abs(unscaled), n)
    q += 2 * r >= n
    return Decimal(q if unscaled >= 0 else -q).scaleb(-(scale + AVG_EXTRA_SCALE), context=EXACT)


class Merger:
    """How rows of one windowed view combine, prepared once for the many windows of a query.

    An accumulator is a list of the view's components in :attr:`columns` order. A null component (no
    value in that row) leaves the other side's value; :meth:`finish` derives the averages from the
    merged sum and count.
    """

    def __init__(self, view: WindowedView, *, quantiles: Sequence[float] | None = None) -> None:
        """``quantiles``: what every ``quantiles`` aggregate answers (default: each one's ``q``)."""
        comps = view_components(view)
        self.columns = tuple(c.column for c in comps)
        self._ops = tuple(enumerate(_combine(c) for c in comps))
        self._averages = tuple(
            (a.name, f"{a.name}_sum", f"{a.name}_count") for a in view.aggregates if a.fn == "avg"
        )
        self._distinct = tuple((a.name, a.sketch_lg_k) for a in view.aggregates if a.fn == "distinct")
        self._quantiles = tuple(
            (a.name, tuple(quantiles) if quantiles else a.quantiles)
            for a in view.aggregates
            if a.fn == "quantiles"
        )

    def components(self, row: Mapping[str, Any]) -> list[Any]:
        """``row``'s components (None where it has none)."""
        return [row.get(column) for column in self.columns]

    def picker(self, names: Sequence[str]) -> Callable[[Sequence[Any]], Sequence[Any]]:
        """Reads the components from rows laid out as ``names`` (tuples from a query)."""
        positions = [names.index(column) for column in self.columns]
        if len(positions) == 1:
            return lambda row: (row[positions[0]],)
        return operator.itemgetter(*positions)

    def add(self, acc: list[Any], components: Sequence[Any]) -> None:
        """Fold a row's components into ``acc``."""
        for i, op in self._ops:
            b = components[i]
            if b is not None:
                a = acc[i]
                acc[i] = b if a is None else op(a, b)

    def finish(self, acc: Sequence[Any]) -> dict[str, Any]:
        """The merged components by column, with each average derived from its sum and count."""
        out = dict(zip(self.columns, acc, strict=True))
        for name, total, count in self._averages:
            n = out[count]
            out[name] = average(out[total], n) if n else None
        for name, lg_k in self._distinct:
            out[name] = sketches.hll_answer(out[name], lg_k) if out[name] is not None else None
        for name, qs in self._quantiles:
            out[name] = sketches.kll_answer(out[name], qs) if out[name] is not None else None
        return out


def merge(
    rows: Iterable[Mapping[str, Any]], view: WindowedView, *, merger: Merger | None = None
) -> dict[str, Any] | None:
    """Combine rows of one (key, window) by each component's merge, then derive averages (None for
    no rows). ``merger``: the view's :class:`Merger`, when the caller merges many windows."""
    merger = merger or Merger(view)
    rows = iter(rows)
    first = next(rows, None)
    if first is None:
        return None
    acc = merger.components(first)
    for row in rows:
        merger.add(acc, merger.components(row))
    return merger.finish(acc)


def speed_table(pipeline: Pipeline, view: LatestView | WindowedView) -> str:
    """The Cassandra table of a view's speed rows: named per pipeline, so two pipelines may each
    have a view called ``hourly``, and told apart from the batch table by its suffix. A ``latest``
    view's table holds candidates in the latest rule's order (:data:`lambdalake.latest.CANDIDATE`),
    under a suffix of its own."""
    return layout.speed_table(pipeline.name, view.name, latest=isinstance(view, LatestView))


def batch_table(pipeline: Pipeline, view: LatestView | WindowedView, generation: int) -> str:
    """The Cassandra table of one generation of a view's batch versions: a full run starts a
    generation (a table beside the active one, dropped whole once retired); an incremental run adds
    the cells it changed to its base's generation, each row marked with its version
    (:data:`CELL_VERSION`)."""
    return layout.batch_table(pipeline.name, view.name, generation)


#: The batch rows' column holding the batch version that wrote the cell: a reader of version ``N``
#: takes, per cell, the row of the newest version not above ``N`` (:func:`newest_cells`).
CELL_VERSION = "_bv"


def newest_cells(
    names: Sequence[str], rows: Iterable[Sequence[Any]], *, cell: Sequence[str], version: int
) -> list[Sequence[Any]]:
    """Per cell (the rows' values of the ``cell`` columns), the row of the newest batch version not
    above ``version``, in the rows' order (rows without :data:`CELL_VERSION`, of a table written
    before cells were versioned, are all current)."""
    if CELL_VERSION not in names:
        return list(rows)
    at = names.index(CELL_VERSION)
    key = operator.itemgetter(*[names.index(c) for c in cell]) if cell else (lambda _row: ())
    best: dict[Any, Sequence[Any]] = {}
    for row in rows:
        v = row[at]
        if v is None or v > version:
            continue  # a version being published, or one never activated
        k = key(row)
        seen = best.get(k)
        if seen is None or seen[at] < v:
            best[k] = row
    return list(best.values())


def latest_columns(pipeline: Pipeline, view: LatestView) -> list[str]:
    cols = view.columns or pipeline.reader_fields
    return [*view.key, *[c for c in cols if c not in view.key]]
