"""Which Kafka offsets the master dataset has covered: per ``"topic/partition"``, sorted disjoint
``[start, end)`` ranges.

An offset is covered when a master dataset commit read it: the master dataset then holds it if it was valid
(invalid records went to the dead-letter topic). Every commit records the ranges it read (the speed job's
micro-batch, a replay's range, the gaps ``speed reset`` fills), so how far a partition is archived
is the end of the gap-free run of ranges from the start of the log, never just the highest offset
some commit read: a range read ahead (a replay) leaves the gap before it open until someone reads it.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

#: Per "topic/partition", sorted disjoint [start, end) offset ranges.
Coverage = dict[str, list[tuple[int, int]]]


def normalized(ranges: list[tuple[int, int]] | list[list[int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint, non-empty ranges; touching or overlapping ranges are joined."""
    out: list[tuple[int, int]] = []
    for start, end in sorted((int(s), int(e)) for s, e in ranges if int(e) > int(s)):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def merged(
    coverage: Mapping[str, list[tuple[int, int]]], ranges: Mapping[str, list[tuple[int, int]]]
) -> Coverage:
    """``coverage`` with ``ranges`` added."""
    out = {k: list(v) for k, v in coverage.items()}
    for key, more in ranges.items():
        out[key] = normalized([*out.get(key, []), *more])
    return {k: v for k, v in out.items() if v}


def intersection(
    coverage: Mapping[str, list[tuple[int, int]]], ranges: Mapping[str, list[tuple[int, int]]]
) -> Coverage:
    """The parts of ``ranges`` that ``coverage`` already holds."""
    out: Coverage = {}
    for key, wanted in ranges.items():
        held = coverage.get(key, [])
        parts = [
            (max(s, hs), min(e, he)) for s, e in normalized(wanted) for hs, he in held if hs < e and s < he
        ]
        if parts:
            out[key] = normalized(parts)
    return out


def difference(
    ranges: Mapping[str, list[tuple[int, int]]], coverage: Mapping[str, list[tuple[int, int]]]
) -> Coverage:
    """The parts of ``ranges`` that ``coverage`` does not hold."""
    out: Coverage = {}
    for key, wanted in ranges.items():
        held = normalized(coverage.get(key, []))
        parts = []
        for start, end in normalized(wanted):
            for hs, he in held:
                if he <= start or hs >= end:
                    continue
                if hs > start:
                    parts.append((start, hs))
                start = max(start, he)
            if start < end:
                parts.append((start, end))
        if parts:
            out[key] = normalized(parts)
    return out


def runs(offsets: np.ndarray) -> list[tuple[int, int]]:
    """Offsets as ranges of consecutive ones."""
    if len(offsets) == 0:
        return []
    ordered = np.unique(offsets.astype(np.int64))
    breaks = np.flatnonzero(np.diff(ordered) != 1)
    starts = np.concatenate([ordered[:1], ordered[breaks + 1]])
    ends = np.concatenate([ordered[breaks], ordered[-1:]]) + 1
    return [(int(a), int(b)) for a, b in zip(starts, ends, strict=True)]


def covered_until(ranges: list[tuple[int, int]], low: int = 0) -> int:
    """The end of the gap-free run of ``ranges`` from offset ``low`` (the log's first offset): every
    offset in ``[low, result)`` is covered. ``low`` itself when it is not covered."""
    end = low
    for start, stop in ranges:
        if start > end:
            break
        end = max(end, stop)
    return end


def to_json(coverage: Mapping[str, list[tuple[int, int]]]) -> dict[str, list[list[int]]]:
    return {k: [[s, e] for s, e in v] for k, v in sorted(coverage.items())}


def from_json(value: Mapping[str, list[list[int]]]) -> Coverage:
    return {k: normalized(v) for k, v in value.items()}
