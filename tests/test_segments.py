"""The per-segment post-processing kernels (transforms/_segments.c) against plain numpy references."""
from __future__ import annotations

import numpy as np
import pytest

from dprelease.transforms.segments import project_segments, round_segments


def _reference_round(values: np.ndarray, total: int) -> np.ndarray:
    """Floors, then +1 to the `total - sum(floors)` largest fractional parts, ties by position (a full sort)."""
    floors = np.maximum(np.floor(values + 1e-9), 0).astype(np.int64)
    order = np.lexsort((np.arange(values.size), -(values - floors)))
    out = floors.copy()
    out[order[:max(0, min(values.size, total - int(floors.sum())))]] += 1
    return out


def _reference_project(values: np.ndarray, total: float) -> np.ndarray:
    """The Euclidean projection onto {x >= 0, sum x = total} (Duchi et al. 2008)."""
    if total <= 0 or values.size == 0:
        return np.zeros_like(values)
    ordered = np.sort(values)[::-1]
    candidates = (np.cumsum(ordered) - total) / np.arange(1, values.size + 1)
    tau = candidates[np.flatnonzero(ordered - candidates > 0)[-1]]
    return np.maximum(values - tau, 0.0)


def _segments(rng, kind: str):
    lengths = rng.integers(0, 600, rng.integers(1, 6))
    segments = np.repeat(np.arange(lengths.size), lengths)
    n = int(lengths.sum())
    values = {"ties": rng.integers(0, 4, n) / 4.0, "gamma": rng.gamma(0.5, 3.0, n),
              "signed": rng.normal(1.0, 3.0, n)}[kind]
    sums = np.bincount(segments, weights=np.maximum(values, 0), minlength=lengths.size)
    totals = np.maximum(0, np.rint(sums) + rng.integers(-3, 4, lengths.size)).astype(np.int64)
    return values, segments, totals, np.concatenate([[0], np.cumsum(lengths)])


@pytest.mark.parametrize("kind", ["ties", "gamma", "signed"])
def test_rounding_raises_exactly_the_cells_a_full_sort_would(kind):
    """The kernel selects the cells to raise (quickselect) instead of sorting: the strict order (fraction,
    then position) makes the set unique, so the integers equal the full sort's, ties included."""
    rng = np.random.default_rng(["ties", "gamma", "signed"].index(kind))
    for _ in range(300):
        values, segments, totals, offsets = _segments(rng, kind)
        values = np.maximum(values, 0)
        got = round_segments(values, segments, totals)
        for s in range(totals.size):
            cells = slice(offsets[s], offsets[s + 1])
            np.testing.assert_array_equal(got[cells], _reference_round(values[cells], int(totals[s])))


@pytest.mark.parametrize("kind", ["ties", "gamma", "signed"])
def test_projection_equals_the_sorted_reference(kind):
    """Both of the kernel's paths: no sort when every cell stays in the support (a joint already on the
    simplex), the sorted threshold otherwise."""
    rng = np.random.default_rng(10 + ["ties", "gamma", "signed"].index(kind))
    for _ in range(300):
        values, segments, totals, offsets = _segments(rng, kind)
        got = project_segments(values, segments, totals.astype(np.float64))
        for s in range(totals.size):
            cells = slice(offsets[s], offsets[s + 1])
            np.testing.assert_allclose(got[cells], _reference_project(values[cells], float(totals[s])),
                                       rtol=0, atol=1e-9)


def test_a_point_on_the_simplex_projects_to_itself_and_rounds_to_its_total():
    rng = np.random.default_rng(3)
    values = rng.gamma(0.3, 3.0, 588)
    values *= 250 / values.sum()
    projected = project_segments(values, np.zeros(588, dtype=np.int64), np.array([250.0]))
    np.testing.assert_allclose(projected, values, rtol=0, atol=1e-12)
    assert round_segments(projected, np.zeros(588, dtype=np.int64), np.array([250])).sum() == 250


def test_a_segment_s_result_does_not_depend_on_the_other_segments_of_the_call():
    rng = np.random.default_rng(4)
    values, segments, totals, offsets = _segments(rng, "signed")
    together = project_segments(values, segments, totals.astype(np.float64))
    rounded = round_segments(np.maximum(values, 0), segments, totals)
    for s in range(totals.size):
        cells = slice(offsets[s], offsets[s + 1])
        alone = project_segments(values[cells], np.zeros(cells.stop - cells.start, dtype=np.int64),
                                 totals[s:s + 1].astype(np.float64))
        assert together[cells].tobytes() == alone.tobytes()
        alone_rounded = round_segments(np.maximum(values[cells], 0), np.zeros(cells.stop - cells.start, dtype=np.int64),
                                       totals[s:s + 1])
        np.testing.assert_array_equal(rounded[cells], alone_rounded)
