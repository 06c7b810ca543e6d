"""Consistency post-processing of noisy measurements (never touches the raw data): the nonnegative clamp
a release uses, and the whole-table reference forms of the tree estimate (Hay et al. 2010) and of the
top-down integer step, against which tests and benchmarks check the per-unit kernels (`transforms.units`).

Privacy: every function here reads only noisy measurements and public structure
(the hierarchy's parent maps), so by post-processing immunity the outputs carry the
same guarantee as the measurements.
"""
from __future__ import annotations

import numpy as np

from .segments import run_positions


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
    start_index = np.arange(n) - run_positions(seg_sorted)
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
    rank = run_positions(seg_sorted)
    bump = np.zeros(values.size, dtype=np.int64)
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
        segment = _parent_cell_segments(parent_maps[i], cells)
        fitted = nonnegative_integer_children(noisy.ravel().astype(np.float64), segment, parent.ravel())
        results.append(fitted.reshape(units, cells))
    return results


def clamp_nonnegative(noisy: np.ndarray) -> np.ndarray:
    """A table with no consistency constraint: negative noisy counts become 0."""
    return np.maximum(np.asarray(noisy, dtype=np.int64), 0)


def _parent_cell_segments(parent: np.ndarray, cells: int) -> np.ndarray:
    """Segment id (parent unit, attribute cell) of every (unit, cell) entry, flattened C order."""
    return (parent[:, None] * cells + np.arange(cells)[None, :]).ravel()


def _sum_by_parent(values: np.ndarray, parent: np.ndarray, n_parents: int) -> np.ndarray:
    """Row sums of `values` (units, cells) grouped by parent unit: shape (n_parents, cells)."""
    cells = values.shape[1]
    index = _parent_cell_segments(parent, cells)
    return np.bincount(index, weights=values.ravel(), minlength=n_parents * cells).reshape(n_parents, cells)


def hierarchical_least_squares(
    noisy: list[np.ndarray], variances: list[float], parent_maps: list[np.ndarray | None]
) -> list[np.ndarray]:
    """Best linear unbiased estimate of a tree of count measurements, exactly consistent: the closed form
    the release's global estimator (`transforms.estimation`) is tested against on hierarchies.

    `noisy[i]` is level i's measurement, shape (units_i, cells) (cells: attribute cells carried
    by every unit); `variances[i]` its per-cell noise variance, 0 for an exact level (an
    invariant); `parent_maps[i]` maps level i's units to level i-1's. Hay, Rastogi, Miklau,
    Suciu (2010), generalised to unequal variances: an upward pass combines each node's own
    measurement with the sum of its children's subtree estimates by inverse-variance weights,
    a downward pass splits each parent's final value among its children in proportion to
    their subtree variances. O(cells) with one bincount per level and pass.
    """
    depth = len(noisy)
    up = [np.asarray(noisy[-1], dtype=np.float64)]
    up_var = [np.full(up[0].shape[0], float(variances[-1]))]
    for i in range(depth - 2, -1, -1):
        parents = parent_maps[i + 1]
        own = np.asarray(noisy[i], dtype=np.float64)
        child_sum = _sum_by_parent(up[0], parents, own.shape[0])
        child_var = np.bincount(parents, weights=up_var[0], minlength=own.shape[0])
        own_var = float(variances[i])
        total_var = own_var + child_var
        with np.errstate(invalid="ignore", divide="ignore"):
            weight_own = np.where(total_var > 0, child_var / total_var, 1.0)
            combined_var = np.where(total_var > 0, own_var * child_var / total_var, 0.0)
        if own_var == 0:
            weight_own[:] = 1.0
        up.insert(0, weight_own[:, None] * own + (1 - weight_own[:, None]) * child_sum)
        up_var.insert(0, combined_var)
    final = [up[0]]
    for i in range(1, depth):
        parents = parent_maps[i]
        n_parents = final[-1].shape[0]
        sibling_sum = _sum_by_parent(up[i], parents, n_parents)
        sibling_var = np.bincount(parents, weights=up_var[i], minlength=n_parents)
        siblings = np.bincount(parents, minlength=n_parents)
        with np.errstate(invalid="ignore", divide="ignore"):
            share = np.where(sibling_var[parents] > 0, up_var[i] / sibling_var[parents], 1.0 / siblings[parents])
        residual = final[-1] - sibling_sum
        final.append(up[i] + share[:, None] * residual[parents])
    return final
