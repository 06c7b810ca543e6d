"""Segment arithmetic on sorted keys, shared by bounding and post-processing."""
from __future__ import annotations

import numpy as np

from . import _segments


def run_positions(*sorted_keys: np.ndarray) -> np.ndarray:
    """Position (0, 1, ...) of each element within its run of equal keys, the arrays being
    sorted together (lexicographically) so that equal key tuples are adjacent."""
    n = sorted_keys[0].size
    starts = np.ones(n, dtype=bool)
    if n:
        starts[1:] = False
        for keys in sorted_keys:
            starts[1:] |= keys[1:] != keys[:-1]
    index = np.arange(n)
    return index - np.maximum.accumulate(np.where(starts, index, 0))


def _contiguous(segments: np.ndarray, count: int) -> tuple[np.ndarray | None, np.ndarray]:
    """(order putting each segment's values together, keeping their relative order; None when they already
    are), and the offsets of the segments in that order."""
    segments = np.asarray(segments, dtype=np.int64)
    order = None if segments.size < 2 or bool(np.all(segments[1:] >= segments[:-1])) \
        else np.argsort(segments, kind="stable")
    offsets = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(np.bincount(segments, minlength=count), out=offsets[1:])
    return order, offsets


def project_segments(values: np.ndarray, segments: np.ndarray, totals: np.ndarray) -> np.ndarray:
    """Per segment s: the closest (least squares) x >= 0 with sum(x) = totals[s] (0 where totals[s] <= 0).
    Each segment is computed from its own values alone (C kernel), so its result never depends on the
    other segments of the call. Post-processing: noisy values and public totals only."""
    totals = np.ascontiguousarray(totals, dtype=np.float64)
    order, offsets = _contiguous(segments, totals.size)
    ordered = np.ascontiguousarray(values if order is None else np.asarray(values)[order], dtype=np.float64)
    out = np.empty_like(ordered)
    _segments.project(ordered, offsets, totals, out)
    if order is None:
        return out
    result = np.empty_like(out)
    result[order] = out
    return result


def round_segments(values: np.ndarray, segments: np.ndarray, totals: np.ndarray) -> np.ndarray:
    """Per segment s: integers >= 0 summing to the integer totals[s] (values >= 0 summing to it up to float
    error): floors, then +1 to the cells with the largest fractional parts, ties by position. Per segment
    alone, as `project_segments`."""
    totals = np.ascontiguousarray(totals, dtype=np.int64)
    order, offsets = _contiguous(segments, totals.size)
    ordered = np.ascontiguousarray(values if order is None else np.asarray(values)[order], dtype=np.float64)
    out = np.empty(ordered.size, dtype=np.int64)
    _segments.round(ordered, offsets, totals, out)
    if order is None:
        return out
    result = np.empty_like(out)
    result[order] = out
    return result
