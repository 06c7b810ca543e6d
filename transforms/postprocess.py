"""Consistency post-processing of noisy measurements (never touches the raw data).

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


def iterative_proportional_fit(shape: tuple[int, ...], totals: np.ndarray,
                               margins: list[tuple[tuple[int, ...], np.ndarray]], sweeps: int = 100,
                               start: np.ndarray | None = None) -> np.ndarray:
    """A nonnegative joint table (axis 0 = unit) whose unit totals are `totals` and whose margins
    approach the nonnegative targets (IPF / raking; it preserves totals and nonnegativity). From
    `start` (nonnegative, each unit summing to its total) when given, else uniform."""
    if start is not None:
        joint = np.array(start, dtype=np.float64)
    else:
        cells_per_unit = int(np.prod(shape[1:]))
        joint = np.broadcast_to((totals / cells_per_unit).reshape((-1,) + (1,) * (len(shape) - 1)), shape).copy()
    for _ in range(sweeps):
        worst = 0.0
        for kept, target in margins:
            other = tuple(a for a in range(joint.ndim) if a not in kept)
            current = joint.sum(axis=other, keepdims=True)
            goal = np.expand_dims(target, other)
            worst = max(worst, float(np.abs(goal - current).max(initial=0.0)))
            with np.errstate(invalid="ignore", divide="ignore"):
                ratio = np.where(current > 0, goal / current, 0.0)
            joint *= ratio
        if worst < 1e-6:
            break
    return joint


def round_joint(joint: np.ndarray, totals: np.ndarray) -> np.ndarray:
    """Nonnegative integer joint per unit summing exactly to the integer `totals` (controlled rounding)."""
    units = joint.shape[0]
    flat = joint.reshape(units, -1)
    fitted = project_to_simplex(flat.ravel(), np.repeat(np.arange(units), flat.shape[1]), totals.astype(np.float64))
    rounded = controlled_round(fitted, np.repeat(np.arange(units), flat.shape[1]), totals)
    return rounded.reshape(joint.shape)


START_FLOOR = 1e-3
"""A warm start's zero cells begin at this fraction of their unit's mean cell (multiplicative updates
cannot leave an exact 0)."""


def fit_joint_least_squares(shape: tuple[int, ...], totals: np.ndarray,
                            measurements: list[tuple[tuple[int, ...], np.ndarray, float]],
                            max_iterations: int = 2000, tolerance: float = 1e-9,
                            start: np.ndarray | None = None) -> np.ndarray:
    """The nonnegative joint table per unit (axis 0) with the given unit totals whose margins best fit the
    noisy measurements: minimises sum_m ||margin_m(p) - y_m||^2 / v_m over {p >= 0, each unit sums to
    its total}, the marginal polytope, by entropic mirror descent (exponentiated gradient with a
    backtracking step; Private-PGM's estimator on a single clique, McKenna et al. 2019).

    `measurements`: (kept axes incl. 0, noisy margin with those axes, noise variance > 0); `start`: a
    nonnegative joint to begin from (cells at 0 are lifted to START_FLOOR of their unit's mean). The truth
    lies in the feasible set, so the fitted margins are never farther from it, in this weighted norm,
    than the measurements are. Post-processing: reads noisy values and public structure only."""
    totals = np.asarray(totals, dtype=np.float64)
    units = shape[0]
    per_unit = int(np.prod(shape[1:]))
    log_p = np.zeros(shape)
    if start is not None:
        mean = np.maximum(totals / per_unit, 1e-12).reshape((-1,) + (1,) * (len(shape) - 1))
        log_p = np.log(np.maximum(np.asarray(start, dtype=np.float64), START_FLOOR * mean))

    def normalise(log_values: np.ndarray) -> np.ndarray:
        flat = log_values.reshape(units, per_unit)
        weights = np.exp(flat - flat.max(axis=1, keepdims=True))
        weights /= weights.sum(axis=1, keepdims=True)
        return (weights * totals[:, None]).reshape(shape)

    def loss_and_gradient(p: np.ndarray) -> tuple[float, np.ndarray]:
        loss, gradient = 0.0, np.zeros(shape)
        for kept, noisy, variance in measurements:
            other = tuple(a for a in range(len(shape)) if a not in kept)
            residual = p.sum(axis=other) - noisy
            loss += float((residual ** 2).sum()) / variance
            gradient += np.expand_dims(2.0 * residual / variance, other)
        return loss, gradient

    p = normalise(log_p)
    loss, gradient = loss_and_gradient(p)
    step = 1.0 / max(float(np.abs(gradient).max()), 1e-12)
    for _ in range(max_iterations):
        while True:
            candidate_log = log_p - step * gradient
            candidate = normalise(candidate_log)
            candidate_loss, candidate_gradient = loss_and_gradient(candidate)
            if candidate_loss <= loss or step < 1e-300:
                break
            step /= 2.0
        improvement = loss - candidate_loss
        log_p = candidate_log - candidate_log.reshape(units, per_unit).max(axis=1).reshape(
            (-1,) + (1,) * (len(shape) - 1))
        p, gradient = candidate, candidate_gradient
        loss = candidate_loss
        step *= 1.5
        if improvement <= tolerance * max(loss, 1.0):
            break
    return p
