"""MST's selection (McKenna, Miklau and Sheldon 2021), engine-neutral: which 2-way tables a `select: mst`
marginals query measures.

Every attribute's 1-way table is measured first. The estimate of a pair's table is the product of its two
noisy 1-way tables made nonnegative, scaled to the unit's noisy total (per geographic unit for a query
`within` a level) and rounded to integers: post-processing of released measurements. A pair's score is the
L1 distance between its bounded counts and that estimate (an integer) less the expected L1 error of
measuring it (`noise_penalty`, a public constant per pair, as in AIM); the pairs the independent estimate
gets most wrong, beyond what their measurement's noise would cost, are the ones worth measuring. Kruskal's algorithm with the exponential mechanism in place of
"take the heaviest edge": `rounds` selections, each among the pairs joining two components of the tree so far.

Privacy: each round is one exact exponential-mechanism draw (`samplers.select_cells`) from its own keyed
stream, calibrated to the score sensitivity (`accounting.sensitivity.mst_score_sensitivity`); the candidates
of a round depend only on earlier rounds' choices (public), so the rounds compose adaptively. The true pair
counts are read by `range_score` only (run by each engine where the counts are: range by range in Spark
executors and Beam workers, whole tables in the embedded engine); only the chosen pairs leave.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from .csprng import CellStream, ReleaseKey


def independent_estimates(one_way: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """(unit totals, each attribute's distribution per unit) from noisy 1-way tables of shape (units, size):
    each made nonnegative; the unit's total is the mean of the tables' totals (a uniform distribution where
    a unit's clipped table is all zero). Post-processing of released values only."""
    clipped = [np.maximum(np.asarray(t, dtype=np.float64), 0.0) for t in one_way]
    totals = np.maximum(np.mean([np.asarray(t, dtype=np.float64).sum(axis=1) for t in one_way], axis=0), 0.0)
    shares = []
    for table in clipped:
        sums = table.sum(axis=1, keepdims=True)
        uniform = np.full_like(table, 1.0 / table.shape[1])
        shares.append(np.where(sums > 0, table / np.where(sums > 0, sums, 1.0), uniform))
    return totals, shares


SCORE_DISTANCE_CAP = 1 << 62
"""The largest distance to a round's best score the kernel is given (int64 room for its arithmetic)."""


def pair_estimate(totals: np.ndarray, share_a: np.ndarray, share_b: np.ndarray) -> np.ndarray:
    """The independent estimate of a pair's table per unit, rounded to integers: shape (units, a, b)."""
    product = totals[:, None, None] * share_a[:, :, None] * share_b[:, None, :]
    return np.rint(product).astype(np.int64)


@dataclass(frozen=True)
class CliqueEstimate:
    """What a candidate table is scored against: per unit, its separator's estimated table times the new
    attribute's distribution, rounded per cell, estimate[unit, s, x] = rint(separator[unit, s] * share[unit, x]),
    with s the cell of the table's other dimensions (in its own order) and x the new attribute's value.
    An MST pair (a, b) is the clique of separator a with separator = totals x share_a (`pair`): the same
    arithmetic as `pair_estimate`. Post-processing of released values only (picklable: the engines' workers
    score with it)."""

    separator: np.ndarray
    """(units, separator cells) float64: the separator's estimated counts per unit."""
    share: np.ndarray
    """(units, new attribute's size) float64: the new attribute's distribution per unit."""
    sizes: tuple[int, ...]
    """The table's dimension sizes after the unit's (its own order)."""
    child_axis: int
    """Which of `sizes` is the new attribute."""

    @classmethod
    def pair(cls, totals: np.ndarray, share_a: np.ndarray, share_b: np.ndarray) -> "CliqueEstimate":
        """A pair's independent estimate (`pair_estimate`) as a clique estimate: separator a, new attribute b."""
        return cls(totals[:, None] * share_a, share_b, (share_a.shape[1], share_b.shape[1]), 1)

    def cells(self, start: int, stop: int) -> np.ndarray:
        """The rounded estimate of the table's cells [start, stop) (int64), cell by cell."""
        width = math.prod(map(int, self.sizes))
        unit, rest = np.divmod(np.arange(start, stop, dtype=np.int64), width)
        digits = np.unravel_index(rest, self.sizes)
        separator_cell = np.zeros(rest.size, dtype=np.int64)
        for axis, digit in enumerate(digits):
            if axis != self.child_axis:
                separator_cell = separator_cell * self.sizes[axis] + digit
        product = self.separator[unit, separator_cell] * self.share[unit, digits[self.child_axis]]
        return np.rint(product).astype(np.int64)


def range_score(counts: np.ndarray, start: int, estimate: CliqueEstimate) -> int:
    """The L1 distance between cells [start, start + len(counts)) of a candidate's bounded counts and the same
    cells of its estimate (`CliqueEstimate.cells`, the same arithmetic cell by cell): a worker scores its own
    range of cells, and the ranges' scores add up to the score of the whole table. Private: the exponential
    mechanism's input only."""
    values = estimate.cells(start, start + len(counts))
    return int(np.abs(np.asarray(counts, dtype=np.int64) - values).sum())


def scores_from_counts(key: ReleaseKey, counts: dict[str, np.ndarray], one_way: list, estimates,
                       range_target: int) -> dict[str, int]:
    """Every candidate's score from whole bounded count vectors held in one process (the embedded engine):
    the tables released (`one_way`: their TableReleases; the values the release publishes), mapped by
    `estimates` to each candidate's `CliqueEstimate`, and each candidate scored over all its cells, `range_target`
    cells at a time (the ranges' scores add up to the whole table's; memory stays a range's)."""
    from .release_values import release_table

    noisy = {t.name: release_table(key, t, counts[t.name], range_target) for t in one_way}
    return {name: sum(range_score(counts[name][start:start + range_target], start, estimate)
                      for start in range(0, counts[name].size, range_target))
            for name, estimate in estimates(noisy).items()}


def noise_penalty(cells: int, variance: float) -> int:
    """AIM's (McKenna et al. 2022) Gaussian approximation of the expected L1 error of measuring a table of `cells`
    cells with noise of `variance` per cell, round(sqrt(2/pi) * sigma * cells) (exact for a continuous Gaussian;
    13% above a discrete Laplace's, more for a very small discrete Gaussian):
    a pair's score minus its penalty says how much measuring it is worth beyond the noise it brings, so a
    round prefers a small table whose independent estimate is wrong to a large one whose measurement would
    be mostly noise. Public (the domain and the calibrated mechanism only): a constant per candidate, which
    leaves the scores' sensitivity and the exponential mechanism's guarantee unchanged."""
    return int(round(math.sqrt(2 / math.pi) * math.sqrt(variance) * cells))


def workload_weights(candidates: list[tuple[str, str]], workload: list[tuple[tuple[str, ...], int]] | None) -> list[int]:
    """Each candidate pair's weight in a workload of (attributes, weight) marginals, AIM's (McKenna et al. 2022)
    w_r = sum over the workload of weight_s * |r & s|: a pair sharing more attributes with more important
    marginals counts more. Divided by their greatest common divisor (the same distribution of every round,
    smaller integers); without a workload every pair weighs 1 (the workload of all pairs gives every pair
    the same weight). Public: the spec's declarations only. The scores multiplied by these weights have the
    unweighted sensitivity times the largest weight (`accounting.sensitivity.mst_score_sensitivity`)."""
    if workload is None:
        return [1] * len(candidates)
    # |r & s| = [a in s] + [b in s] for r = (a, b), so w_r = c_a + c_b with c_x the weight of the marginals holding x
    per_attribute: dict[str, int] = {}
    for attributes, weight in workload:
        for attribute in set(attributes):
            per_attribute[attribute] = per_attribute.get(attribute, 0) + weight
    weights = [per_attribute.get(a, 0) + per_attribute.get(b, 0) for a, b in candidates]
    divisor = math.gcd(*weights)
    return [w // divisor for w in weights] if divisor else [0] * len(candidates)


def pair_score(counts: np.ndarray, estimate: np.ndarray) -> int:
    """The L1 distance between a pair's bounded counts and its estimate (same shape). Private: the
    exponential mechanism's input only."""
    return int(np.abs(np.asarray(counts, dtype=np.int64).reshape(estimate.shape) - estimate).sum())


class Components:
    """The parts a set of attributes falls into as pairs join them (union-find): a pair joining one part to
    itself would close a cycle."""

    def __init__(self, attributes):
        self._parent = {a: a for a in attributes}

    def root(self, a: str) -> str:
        while self._parent[a] != a:
            a = self._parent[a]
        return a

    def join(self, a: str, b: str) -> bool:
        """Join the parts of a and b; False (nothing joined) when they are one part already."""
        ra, rb = self.root(a), self.root(b)
        self._parent[ra] = rb
        return ra != rb


def selection_stream(key: ReleaseKey, name: str, round_: int) -> CellStream:
    """The keystream of one round of a selection (lane 0)."""
    return CellStream(key.derive(f"dprelease/select/{name}/round-{round_}"))


def draw_round(key: ReleaseKey, name: str, round_: int, scores: list[int], epsilon: Fraction, sensitivity: int) -> int:
    """One round's exponential mechanism: the index of the score picked, with probability proportional to
    exp(epsilon * score / (2 * sensitivity)) (the kernel's lowest-is-best form on best - score, which gives the
    same distribution), from the round's own keyed stream (`selection_stream`).

    Privacy: epsilon-DP (and epsilon^2 / 8-zCDP) when no score moves by more than `sensitivity` between
    neighbouring inputs."""
    from .samplers import select_cells

    best = max(int(s) for s in scores)
    # in Python integers, capped: the distance to the best, min(best - score, 2^62), is the lowest-is-best
    # form of the score max(score, best - 2^62), of the same sensitivity (best and score each move by at
    # most it); a capped candidate keeps at most exp(-epsilon * 2^62 / (2 * sensitivity)) of the best's
    # weight (below exp(-1e8) without a workload; with the largest weights and a tiny epsilon it can matter,
    # and the draw is still exact for the capped scores)
    lowest_best = np.array([[min(best - int(s), SCORE_DISTANCE_CAP) for s in scores]], dtype=np.int64)
    return int(select_cells(selection_stream(key, name, round_), 0, 1, lowest_best, epsilon, sensitivity)[0])


def select_tree(key: ReleaseKey, name: str, attributes: list[str], candidates: list[tuple[str, str]],
                scores: list[int], epsilon: Fraction, sensitivity: int) -> tuple[tuple[str, str], ...]:
    """The pairs of a spanning tree of `attributes`, chosen round by round: each round the exponential
    mechanism (`draw_round`) picks one of the candidates joining two components.

    Privacy: `len(attributes) - 1` epsilon-DP selections on scores of the given sensitivity."""
    parts = Components(attributes)
    chosen = []
    for round_ in range(len(attributes) - 1):
        open_pairs = [i for i, (a, b) in enumerate(candidates) if parts.root(a) != parts.root(b)]
        pick = draw_round(key, name, round_, [scores[i] for i in open_pairs], epsilon, sensitivity)
        a, b = candidates[open_pairs[pick]]
        parts.join(a, b)
        chosen.append((a, b))
    return tuple(chosen)
