"""Consistency post-processing of noisy measurements (never touches the raw data).

Privacy: every function here reads only noisy measurements and public structure
(the hierarchy's parent maps), so by post-processing immunity the outputs carry the
same guarantee as the measurements.
"""
from __future__ import annotations

import numpy as np


def project_to_simplex(values: np.ndarray, segments: np.ndarray, totals: np.ndarray) -> np.ndarray:
    """Per segment s: the closest (least squares) x >= 0 with sum(x) = totals[s].

    `segments` gives each value's segment (0..n_segments-1); O(n log n) by one sort.
    x_i = max(v_i - tau_s, 0) where tau_s is found from the sorted values (Duchi et al. 2008).
    """
    values = np.asarray(values, dtype=np.float64)
    totals = np.asarray(totals, dtype=np.float64)
    n = values.size
    if n == 0:
        return values.copy()
    order = np.lexsort((-values, segments))
    seg_sorted = segments[order]
    v_sorted = values[order]
    starts = np.ones(n, dtype=bool)
    starts[1:] = seg_sorted[1:] != seg_sorted[:-1]
    start_index = np.maximum.accumulate(np.where(starts, np.arange(n), 0))
    cumulative = np.cumsum(v_sorted)
    before = np.where(start_index > 0, cumulative[start_index - 1], 0.0)
    seg_cumsum = cumulative - before
    rank = np.arange(n) - start_index + 1
    candidate_tau = (seg_cumsum - totals[seg_sorted]) / rank
    active = v_sorted - candidate_tau > 0
    n_segments = totals.size
    last_active = np.full(n_segments, -1, dtype=np.int64)
    np.maximum.at(last_active, seg_sorted[active], np.flatnonzero(active))
    tau = np.zeros(n_segments)
    has = last_active >= 0
    tau[has] = candidate_tau[last_active[has]]
    projected = np.maximum(values - tau[segments], 0.0)
    projected[totals[segments] <= 0] = 0.0
    return projected


def controlled_round(values: np.ndarray, segments: np.ndarray, totals: np.ndarray) -> np.ndarray:
    """Integers >= 0 per segment summing exactly to the integer totals[s].

    Floors every value, then gives +1 to the cells with the largest fractional parts
    (ties by position) until the segment adds up. Requires sum(values in s) == totals[s]
    up to float error and values >= 0.
    """
    values = np.asarray(values, dtype=np.float64)
    totals = np.asarray(totals, dtype=np.int64)
    floors = np.floor(values + 1e-9).astype(np.int64)
    floors = np.maximum(floors, 0)
    shortfall = totals - np.bincount(segments, weights=floors, minlength=totals.size).astype(np.int64)
    fraction = values - floors
    order = np.lexsort((np.arange(values.size), -fraction, segments))
    seg_sorted = segments[order]
    n = values.size
    starts = np.ones(n, dtype=bool)
    if n:
        starts[1:] = seg_sorted[1:] != seg_sorted[:-1]
    rank = np.arange(n) - np.maximum.accumulate(np.where(starts, np.arange(n), 0))
    bump = np.zeros(n, dtype=np.int64)
    bump[order] = (rank < shortfall[seg_sorted]).astype(np.int64)
    result = floors + bump
    return result


def nonnegative_integer_children(
    children: np.ndarray, parent_of_child: np.ndarray, parent_values: np.ndarray
) -> np.ndarray:
    """Children made nonnegative integers adding up exactly to their (final, integer) parent."""
    fitted = project_to_simplex(children, parent_of_child, parent_values)
    return controlled_round(fitted, parent_of_child, parent_values)


def top_down_hierarchy(levels: list[np.ndarray], parent_maps: list[np.ndarray | None]) -> list[np.ndarray]:
    """Nonnegative integer tables where each level adds up to the level above (TopDown-style).

    `levels[i]` is the noisy table of level i, shape (units_i, attribute_cells);
    `parent_maps[i]` maps each unit of level i to its unit at level i-1 (None for the top).
    The top level is clamped at zero; each lower level is fitted per (parent, attribute cell).
    """
    results: list[np.ndarray] = []
    for i, noisy in enumerate(levels):
        noisy = np.asarray(noisy)
        if i == 0:
            results.append(np.maximum(np.rint(noisy).astype(np.int64), 0))
            continue
        parent = results[-1]
        units, cells = noisy.shape
        parent_units = parent_maps[i]
        segment = (parent_units[:, None] * cells + np.arange(cells)[None, :]).ravel()
        fitted = nonnegative_integer_children(noisy.ravel().astype(np.float64), segment, parent.ravel())
        results.append(fitted.reshape(units, cells))
    return results


def clamp_nonnegative(noisy: np.ndarray) -> np.ndarray:
    """A table with no consistency constraint: negative noisy counts become 0."""
    return np.maximum(np.asarray(noisy, dtype=np.int64), 0)
