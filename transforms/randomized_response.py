"""k-ary randomized response (Warner 1965; the k-ary form of Kairouz, Oh and Viswanath 2016, as in RAPPOR's
local model): a column its respondents randomized before the agency collected it, and the debiasing of the
tables that count it. Engine-neutral kernels; `pipelines/debiased.py` applies them part by part.

A respondent whose true value is x reports x with probability p = e^ε₀ / (e^ε₀ + k − 1) and each other value
with probability q = 1 / (e^ε₀ + k − 1).

Privacy (local, per record): for any two true values x, x' and any report r, P(r | x) / P(r | x') ≤ p / q =
e^ε₀, so each record's value of the column is ε₀-DP against everyone, the agency included, and so is anything
computed from the collected file (post-processing). A unit of m records whose values were randomized
independently: m·ε₀. The central noise of a release is added to counts of the *reported* values and is
accounted as for any column; debiasing is post-processing of the noisy counts.

Debiasing: if y counts reports over one axis of k cells and n = Σy, E[y_j] = q·n + (p − q)·x_j, so
x̂_j = (y_j − q·n) / (p − q) is unbiased (the matrix M = (I − qJ)/(p − q), applied along every randomized axis;
its column sums are 1, so every margin is kept). Variance of x̂ per cell, two independent parts:
  - the central noise: σ² ∏_a ‖row of M_a‖², with ‖row‖² = ((1 − q)² + (k − 1) q²) / (p − q)², exact and public;
  - the respondents' randomization: Σ over records of ∏_a s_a(i_a, j_a) − ∏_a [i_a = j_a], which is
    (⊗_a S_a) x − x with S = (q(1 − q) J + (p − q)(1 − 2q) I) / (p − q)². It depends on the true counts x, so a
    release states it evaluated at the debiased estimate clipped at 0 (nonnegative, like the true value).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from .csprng import CellStream

MAX_LOCAL_EPSILON = 50
"""Largest ε₀ accepted: beyond it q < e^-50 and the report is the true value for every practical purpose."""
MIN_LOCAL_EPSILON = Fraction(1, 1000)
"""Smallest ε₀ a spec accepts: at 1/1000 debiasing multiplies a k = 2 cell's variance by 4 million per axis."""


@dataclass(frozen=True)
class RandomizedResponse:
    """k-ary randomized response over `k` values with local parameter `epsilon` (ε₀)."""

    k: int
    epsilon: Fraction

    def __post_init__(self) -> None:
        if self.k < 2:
            raise ValueError(f"randomized response needs at least 2 values (got {self.k})")
        if not 0 < self.epsilon <= MAX_LOCAL_EPSILON:
            raise ValueError(f"randomized response epsilon must be in (0, {MAX_LOCAL_EPSILON}] (got {self.epsilon})")

    @property
    def p_truth(self) -> float:
        """Probability that a report is the true value."""
        return 1.0 / (1.0 + (self.k - 1) * math.exp(-float(self.epsilon)))

    @property
    def p_other(self) -> float:
        """Probability of each particular other value."""
        return math.exp(-float(self.epsilon)) * self.p_truth

    @property
    def gap(self) -> float:
        """p − q, computed without cancellation: (1 − e^-ε₀) · p."""
        return -math.expm1(-float(self.epsilon)) * self.p_truth

    def transition(self) -> np.ndarray:
        """P(report j | true i) as a k × k matrix (rows: true values)."""
        matrix = np.full((self.k, self.k), self.p_other)
        np.fill_diagonal(matrix, self.p_truth)
        return matrix

    def noise_gain(self) -> float:
        """‖row of M‖²: how debiasing scales the variance of independent noise on each cell."""
        q, gap = self.p_other, self.gap
        return ((1 - q) ** 2 + (self.k - 1) * q * q) / (gap * gap)


def randomize(codes: np.ndarray, rr: RandomizedResponse, stream: CellStream) -> np.ndarray:
    """Simulate collection: record i (true code codes[i] in 0..k-1) reports j with probability P(j | codes[i]),
    exactly, from lane i of `stream` (the exponential mechanism with score 0 for the true value and 1 for the
    others at 2ε₀ and sensitivity 1: weights e^-ε₀ per other value, which is k-ary randomized response).

    For tests, examples and agencies rehearsing a collection; real reports are randomized on the respondent's
    side, before anything reaches the agency."""
    from .samplers import select_cells

    codes = np.asarray(codes, dtype=np.int64)
    if codes.size and (codes.min() < 0 or codes.max() >= rr.k):
        raise ValueError(f"codes must lie in 0..{rr.k - 1}")
    out = np.empty(codes.size, dtype=np.int64)
    chunk = max(1, (1 << 22) // rr.k)
    for start in range(0, codes.size, chunk):
        stop = min(start + chunk, codes.size)
        scores = np.ones((stop - start, rr.k), dtype=np.int64)
        scores[np.arange(stop - start), codes[start:stop]] = 0
        out[start:stop] = select_cells(stream, start, stop, scores, 2 * rr.epsilon, 1)
    return out


def _along(values: np.ndarray, axis: int, identity: float, ones: float) -> np.ndarray:
    """identity·x + ones·(Σ along `axis`) for every cell: the k × k matrix (identity·I + ones·J) applied along
    one axis, in O(cells)."""
    return identity * values + ones * values.sum(axis=axis, keepdims=True)


def debias(counts: np.ndarray, axes: list[tuple[int, RandomizedResponse]]) -> np.ndarray:
    """The unbiased estimate of the true counts from counts of reports (any shape; `axes`: each randomized
    axis and its mechanism): M = (I − qJ)/(p − q) along every randomized axis. Post-processing."""
    estimate = np.asarray(counts, dtype=np.float64)
    for axis, rr in axes:
        estimate = _along(estimate, axis, 1.0 / rr.gap, -rr.p_other / rr.gap)
    return estimate


def response_variance(estimate: np.ndarray, axes: list[tuple[int, RandomizedResponse]]) -> np.ndarray:
    """The variance the respondents' randomization adds to each debiased cell, (⊗_a S_a) x − x, evaluated at
    x = the estimate clipped at 0 (see the module's docstring). Post-processing."""
    x = np.maximum(np.asarray(estimate, dtype=np.float64), 0.0)
    spread = x
    for axis, rr in axes:
        q, gap = rr.p_other, rr.gap
        spread = _along(spread, axis, (1 - 2 * q) / gap, q * (1 - q) / (gap * gap))
    return np.maximum(spread - x, 0.0)


def noise_variance(noise: float, axes: list[tuple[int, RandomizedResponse]]) -> float:
    """The variance the release's central noise (variance `noise` per cell, independent) contributes to each
    debiased cell: exact and public."""
    return noise * math.prod(rr.noise_gain() for _, rr in axes)
