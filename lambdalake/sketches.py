"""Reading, merging and answering the sketches views store (Apache DataSketches' binary formats, as
Spark's ``hll_sketch_agg`` and ``kll_sketch_agg_double`` write them), without Spark: serving merges a
batch cell's sketch with speed cells' sketches here, as it adds counts.

- ``distinct``: an HLL sketch. Answer: the estimate with lower and upper bounds at
  :data:`DISTINCT_STD_DEVS` standard deviations (:data:`DISTINCT_CONFIDENCE`). Below a few hundred
  distinct values the sketch holds them as a list or set of coupons and the estimate is exact but for
  hash collisions (about one in 2^26 values).
- ``quantiles``: a KLL sketch of doubles. Answer: each asked quantile, the count of values, and the
  sketch's normalized rank error (the quantile ``q``'s value has a true rank within ``q`` plus or minus
  that error, with 99 % confidence).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: Standard deviations of ``distinct``'s bounds, and the confidence they give.
DISTINCT_STD_DEVS = 3
DISTINCT_CONFIDENCE = 0.997


def _union(value: Any, lg_k: int) -> Any:
    """``value`` as an HLL union: a stored sketch's bytes read into a new one, a union as it is."""
    from datasketches import hll_sketch, hll_union

    if isinstance(value, hll_union):
        return value
    union = hll_union(lg_k)
    union.update(hll_sketch.deserialize(bytes(value)))
    return union


def _kll(value: Any) -> Any:
    """``value`` as a KLL sketch of doubles: a stored sketch's bytes read, a sketch as it is."""
    from datasketches import kll_doubles_sketch

    return value if isinstance(value, kll_doubles_sketch) else kll_doubles_sketch.deserialize(bytes(value))


def hll_merge(a: Any, b: bytes, lg_k: int) -> Any:
    """``a`` (a stored sketch, or a union built by an earlier merge) with the sketch ``b`` added."""
    from datasketches import hll_sketch

    union = _union(a, lg_k)
    union.update(hll_sketch.deserialize(bytes(b)))
    return union


def hll_answer(value: Any, lg_k: int) -> dict[str, Any]:
    """What a merged ``distinct`` answers: ``estimate``, ``lower``, ``upper`` and ``confidence``.

    The answer depends on the values alone, not on how the sketch was built: a sketch built by
    updates estimates with its history (the HIP estimator), one built by merging from its registers,
    so the same values would answer a little differently by the path that built them (the speed
    job's state merges partial sketches, a batch aggregates at once, a cell may have one speed row or
    several). Merging the union's result into itself (idempotent) makes every path estimate from the
    registers (measured: four build paths of 30 values, one answer).
    """
    union = _union(value, lg_k)
    union.update(union.get_result())
    sketch = union.get_result()
    return {
        "estimate": sketch.get_estimate(),
        "lower": sketch.get_lower_bound(DISTINCT_STD_DEVS),
        "upper": sketch.get_upper_bound(DISTINCT_STD_DEVS),
        "confidence": DISTINCT_CONFIDENCE,
    }


def kll_merge(a: Any, b: bytes) -> Any:
    """``a`` (a stored sketch, or one merged before) with the sketch ``b`` merged in."""
    merged = _kll(a)
    merged.merge(_kll(b))
    return merged


def kll_answer(value: Any, quantiles: Sequence[float]) -> dict[str, Any]:
    """What a merged ``quantiles`` answers: ``quantiles`` (each asked one by its text, null with no
    values), ``count`` and ``rank_error``."""
    sketch = _kll(value)
    empty = sketch.is_empty()
    return {
        "quantiles": {_q_text(q): None if empty else sketch.get_quantile(q) for q in quantiles},
        "count": sketch.n,
        "rank_error": sketch.normalized_rank_error(False),
    }


def _q_text(q: float) -> str:
    """``0.95`` -> ``"0.95"``, ``1.0`` -> ``"1"``: the JSON keys of a quantiles answer."""
    return format(q, "g")
