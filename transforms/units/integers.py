"""The integer step: nonnegative integer tables that add up, per parent and per unit.

A hierarchy level's cells are fitted per (parent, attribute cell) to the parent's final integers:
projected onto {x >= 0, sum x = parent} and rounded by controlled rounding (TopDown-style), so children
add up exactly; the top level is rounded and clamped at 0. Marginals are rounded per unit through their
joint (`joint.marginal_tables`); histograms rounded and clamped at 0. Each segment and unit is computed
from its own values (C kernels, fixed chunks): any batch of parents gives the same integers.
Post-processing: estimates and public structure only.
"""
from __future__ import annotations

import numpy as np

from ..segments import project_segments, round_segments


def rounded(estimate: np.ndarray) -> np.ndarray:
    """Cells with no integer constraint: the estimate rounded to the nearest integer, negatives set to 0."""
    return np.maximum(np.rint(estimate), 0).astype(np.int64)


def children(estimate: np.ndarray, parent: np.ndarray, parent_integers: np.ndarray) -> np.ndarray:
    """Children's integers (units x attribute cells) adding up, per (parent, attribute cell), to the
    parent's integers: `parent` gives each child's row in `parent_integers` (parents x attribute cells)."""
    units, cells = estimate.shape
    segments = (np.asarray(parent, dtype=np.int64)[:, None] * cells + np.arange(cells)[None, :]).ravel()
    totals = np.asarray(parent_integers, dtype=np.int64).ravel()
    projected = project_segments(estimate.ravel(), segments, totals.astype(np.float64))
    return round_segments(projected, segments, totals).reshape(units, cells)
