"""The least-squares estimate over a tree of units, and its variances, one level and one batch at a time.

up    `own_estimate` (a block's own estimate of its cells and of its total), `combine_up` (with the
      children's subtree estimates: the unit's subtree estimate of its total and that estimate's variance);
down  `split_down` (a parent's final total shared among its children in proportion to their subtree
      variances), `final_estimate` (each child's block conditioned on its final total) and its variances.

Arrays are per unit in rows (units x cells, units x copies). Linear algebra runs on chunks of exactly
CHUNK units (the last one padded) and sparse products whose sums run in a fixed order, so a unit's
result is the same bits in any batch. Post-processing only (noisy values, public structure).
"""
from __future__ import annotations

import numpy as np

from .tree import Level

CHUNK = 64
"""Units per linear-algebra chunk: every product has one fixed shape, whatever the batch."""


def own_estimate(level: Level, noisy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(block estimate, its total): per unit, the least-squares estimate of its block from its own
    measurements (consistent inside the block) and that estimate's total per copy cell."""
    noisy = np.asarray(noisy, dtype=np.float64).reshape(-1, level.size)
    if level.constraints is None:
        estimate = noisy.copy()
    else:
        estimate = np.empty_like(noisy)
        transposed = _transposed(level)
        for start in range(0, noisy.shape[0], CHUNK):
            rows = noisy[start:start + CHUNK]
            chunk = np.zeros((level.size, CHUNK))
            chunk[:, :rows.shape[0]] = rows.T
            multipliers = level.multipliers @ (level.constraints @ chunk)
            corrected = chunk - level.variance[:, None] * (transposed @ multipliers)
            estimate[start:start + CHUNK] = corrected[:, :rows.shape[0]].T
    return estimate, totals(level, estimate)


def totals(level: Level, block: np.ndarray) -> np.ndarray:
    """Per unit, the reference table's cells summed per copy cell (units x copies), in a fixed order."""
    out = np.empty((block.shape[0], level.copies))
    for start in range(0, block.shape[0], CHUNK):
        rows = block[start:start + CHUNK]
        chunk = np.zeros((level.size, CHUNK))
        chunk[:, :rows.shape[0]] = rows.T
        out[start:start + CHUNK] = (level.total @ chunk)[:, :rows.shape[0]].T
    return out


def _transposed(level: Level):
    cached = getattr(level, "_transposed_constraints", None)
    if cached is None:
        cached = level.constraints.T.tocsr()
        level._transposed_constraints = cached
    return cached


def combine_up(own: np.ndarray, own_var: np.ndarray, children: np.ndarray | None,
               children_var: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """A unit's subtree estimate of its total and its variance: its own estimate (variance `own_var`, 0 for
    an invariant, inf for no tables) combined with the sum of its children's subtree estimates (variance
    `children_var`, the sum of theirs; None at the leaves) by inverse-variance weights."""
    own_var = np.broadcast_to(own_var, own.shape)
    if children is None:
        return own.copy(), own_var.copy()
    with np.errstate(divide="ignore", invalid="ignore"):
        precision = np.where(own_var > 0, 1.0 / own_var, np.inf) + np.where(children_var > 0, 1.0 / children_var,
                                                                             np.inf)
        combined = (np.where(np.isfinite(own_var) & (own_var > 0), own / own_var, 0.0)
                    + np.where(np.isfinite(children_var) & (children_var > 0), children / children_var, 0.0)) / precision
    exact_own, exact_children = own_var == 0, children_var == 0
    estimate = np.where(exact_own, own, np.where(exact_children, children,
                        np.where(np.isinf(own_var), children, np.where(np.isinf(children_var), own, combined))))
    variance = np.where(exact_own | exact_children, 0.0, np.where(np.isinf(own_var), children_var,
                        np.where(np.isinf(children_var), own_var, 1.0 / precision)))
    return estimate, variance


def sum_by_parent(values: np.ndarray, parent: np.ndarray, parents: int) -> np.ndarray:
    """Rows of `values` (units x copies) summed per parent (parents x copies), children in unit order."""
    out = np.empty((parents, values.shape[1]))
    for column in range(values.shape[1]):
        out[:, column] = np.bincount(parent, weights=values[:, column], minlength=parents)
    return out


def split_down(subtree: np.ndarray, subtree_var: np.ndarray, parent: np.ndarray, parent_final: np.ndarray,
               parent_var: np.ndarray, sibling_sum: np.ndarray, sibling_var: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """Children's final totals and their variances: each child's subtree estimate plus its share (its
    subtree variance over its siblings') of the parent's final total minus the siblings' sum.
    `parent` indexes the rows of the parent arrays for each child."""
    total_var = sibling_var[parent]
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(total_var > 0, subtree_var / np.where(total_var > 0, total_var, 1.0), 0.0)
    final = subtree + share * (parent_final[parent] - sibling_sum[parent])
    variance = np.where(total_var > 0, subtree_var - share * subtree_var + share * share * parent_var[parent], 0.0)
    return final, np.maximum(variance, 0.0)


def final_estimate(level: Level, block: np.ndarray, own_total: np.ndarray, final_total: np.ndarray) -> np.ndarray:
    """Each unit's block conditioned on its final total: block + K (final - own total)."""
    out = block.copy()
    for copy in range(level.copies):
        out += (final_total[:, copy] - own_total[:, copy])[:, None] * level.gain[:, copy][None, :]
    return out


def final_variances(level: Level, final_var: np.ndarray) -> np.ndarray:
    """Per unit and cell, the variance of the final estimate: diag(P) - sum_l K_l^2 (v_l - var(final_l))."""
    out = np.broadcast_to(level.cell_var, (final_var.shape[0], level.size)).copy()
    for copy in range(level.copies):
        drop = level.total_var[copy] - final_var[:, copy]
        out -= drop[:, None] * (level.gain[:, copy] ** 2)[None, :]
    return np.maximum(out, 0.0)
