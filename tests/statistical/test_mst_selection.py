"""MST's selection: the score sensitivity against every neighbour of small data sets (both relations, k
records per unit; plain and times workload weights), each round's draw against the exact exponential
mechanism (with the power to reject a 30% wrong epsilon), and empirical audits of a round on the worst-case
neighbours that catch the add/remove sensitivity used under `replace` and the unweighted sensitivity used
for weighted scores."""
from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from dprelease.accounting.sensitivity import ContributionBounds, mst_score_sensitivity
from dprelease.transforms.csprng import ReleaseKey
from dprelease.transforms.mst import pair_score, select_tree, selection_stream
from dprelease.transforms.samplers import select_cells

from .test_audit import _clopper_pearson

SIZES = (2, 3, 2)
PAIRS = list(itertools.combinations(range(len(SIZES)), 2))
ATTRIBUTES = ["a", "b", "c"]


def pair_counts(records: np.ndarray, pair: tuple[int, int]) -> np.ndarray:
    a, b = pair
    return np.bincount(records[:, a] * SIZES[b] + records[:, b], minlength=SIZES[a] * SIZES[b]).reshape(SIZES[a], SIZES[b])


WEIGHTS = np.array([1, 3, 2])
"""Workload weights of PAIRS (`transforms.mst.workload_weights` gives such integers): the heaviest is 3."""


def scores(records: np.ndarray, estimates: list[np.ndarray], weights=None) -> np.ndarray:
    """Each pair's score, times its workload weight when `weights` are given."""
    plain = np.array([pair_score(pair_counts(records, p), e) for p, e in zip(PAIRS, estimates)])
    return plain if weights is None else plain * weights


def fixed_estimates(rng) -> list[np.ndarray]:
    """Estimates made from released measurements: fixed while the selection runs (any integers will do)."""
    return [rng.integers(0, 6, size=(1, SIZES[a], SIZES[b])) for a, b in PAIRS]


def all_values() -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(s) for s in SIZES)))


def largest_change(k: int, relation: str, trials: int = 25, weights=None) -> int:
    """The largest change of any candidate's score over every neighbour of random data sets whose units hold
    k records each: add/remove a unit, or replace one unit's records by any others."""
    rng = np.random.default_rng(7)
    values = all_values()
    largest = 0
    for _ in range(trials):
        units = [rng.integers(0, s, size=(k,)) for s in SIZES]
        records = rng.integers(0, 1, size=(0, 3))
        base = np.stack([rng.integers(0, s, size=12 * k) for s in SIZES], axis=1)
        unit = np.stack(units, axis=1)  # the unit whose records change
        estimates = fixed_estimates(rng)
        with_unit = scores(np.concatenate([base, unit]), estimates, weights)
        if relation == "add_remove":
            largest = max(largest, int(np.abs(with_unit - scores(base, estimates, weights)).max()))
            continue
        for replacement in itertools.product(values, repeat=k):
            other = np.array(replacement)
            largest = max(largest, int(np.abs(with_unit - scores(np.concatenate([base, other]), estimates,
                                                                 weights)).max()))
        del records
    return largest


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("relation", ["add_remove", "replace"])
def test_score_sensitivity_holds_and_is_reached_by_the_worst_neighbour(k, relation):
    """The largest change over all neighbours equals the derived sensitivity (never more: it holds; not
    less: it is tight, so a smaller value would be wrong): records moving between cells under replace."""
    claimed = mst_score_sensitivity(ContributionBounds(k, relation)).l1
    assert largest_change(k, relation) == claimed


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("relation", ["add_remove", "replace"])
def test_weighted_score_sensitivity_holds_and_is_reached_by_the_worst_neighbour(k, relation):
    """Scores times workload weights: the largest change over all neighbours is the unweighted sensitivity
    times the largest weight (never more; reached, so the unweighted value would be wrong)."""
    claimed = mst_score_sensitivity(ContributionBounds(k, relation), int(WEIGHTS.max())).l1
    assert claimed == int(WEIGHTS.max()) * mst_score_sensitivity(ContributionBounds(k, relation)).l1
    assert largest_change(k, relation, weights=WEIGHTS) == claimed


def _law(weights: np.ndarray, epsilon: float, sensitivity: int) -> np.ndarray:
    p = np.exp(epsilon * (weights - weights.max()) / (2 * sensitivity))
    return p / p.sum()


def _first_round(weights: np.ndarray, epsilon: Fraction, sensitivity: int, draws: int, name: str) -> np.ndarray:
    """`draws` independent first rounds of the selection: the kernel call `select_tree` makes, on lanes."""
    lowest_best = np.tile(weights.max() - weights, (draws, 1))
    return select_cells(selection_stream(ReleaseKey(b"m" * 32), name, 0), 0, draws, lowest_best, epsilon, sensitivity)


def test_a_round_follows_the_exponential_mechanism_on_the_largest_weight():
    weights = np.array([10, 14, 9], dtype=np.int64)
    draws = 40_000
    chosen = _first_round(weights, Fraction(1), 2, draws, "law")
    observed = np.bincount(chosen, minlength=weights.size)
    assert stats.chisquare(observed, _law(weights, 1.0, 2) * draws).pvalue > 1e-4
    assert stats.chisquare(observed, _law(weights, 1.3, 2) * draws).pvalue < 1e-4  # power: 30% wrong epsilon


def test_select_tree_returns_a_spanning_tree_and_is_a_pure_function_of_the_key():
    key = ReleaseKey(b"t" * 32)
    candidates = list(itertools.combinations(ATTRIBUTES, 2))
    first = select_tree(key, "q.selection", ATTRIBUTES, candidates, [5, 50, 7], Fraction(1), 1)
    assert len(first) == 2 and len({a for p in first for a in p}) == 3
    assert first == select_tree(key, "q.selection", ATTRIBUTES, candidates, [5, 50, 7], Fraction(1), 1)
    assert ("a", "c") in first  # by far the heaviest: chosen with probability 1 - O(e^-10)


def worst_neighbours(weights=None, assumed: int = 1):
    """Two data sets that differ by one record moved between cells (replace, k = 1), with the largest
    change of the log-probability of some candidate under the `assumed` sensitivity (by default the
    add/remove one), their scores times `weights` when given."""
    rng = np.random.default_rng(11)
    base = np.stack([rng.integers(0, s, size=20) for s in SIZES], axis=1)
    estimates = fixed_estimates(rng)
    best = None
    for old in all_values():
        for new in all_values():
            w0 = scores(np.concatenate([base, [old]]), estimates, weights)
            w1 = scores(np.concatenate([base, [new]]), estimates, weights)
            loss = np.abs(np.log(_law(w0, 1.0, assumed)) - np.log(_law(w1, 1.0, assumed))).max()
            if best is None or loss > best[0]:
                best = (loss, w0, w1)
    return best


def _loss_lower_bound(d0: np.ndarray, d1: np.ndarray, m: int, alpha: float = 1e-3) -> float:
    per_test = alpha / (2 * m)
    best = 0.0
    for j in range(m):
        for first, second in ((d0, d1), (d1, d0)):
            low, _ = _clopper_pearson(int((first == j).sum()), first.size, per_test)
            _, high = _clopper_pearson(int((second == j).sum()), second.size, per_test)
            if low > 0 and high > 0:
                best = max(best, math.log(low / high))
    return best


def test_empirical_audit_of_a_round_stays_within_epsilon_and_catches_the_add_remove_sensitivity():
    loss_if_wrong, w0, w1 = worst_neighbours()
    assert loss_if_wrong > 1.4  # epsilon = 1: the add/remove sensitivity would lose 1.45 epsilon here
    replace = mst_score_sensitivity(ContributionBounds(1, "replace")).l1
    draws = 200_000
    right = [_first_round(w, Fraction(1), replace, draws, f"right{i}") for i, w in enumerate((w0, w1))]
    assert _loss_lower_bound(*right, m=w0.size) <= 1.0
    wrong = [_first_round(w, Fraction(1), 1, draws, f"wrong{i}") for i, w in enumerate((w0, w1))]
    assert _loss_lower_bound(*wrong, m=w0.size) > 1.1  # the audit sees the wrong value


def test_empirical_audit_of_a_weighted_round_stays_within_epsilon_and_catches_the_unweighted_sensitivity():
    """Weighted scores calibrated to the unweighted replace sensitivity (2) lose up to 3 epsilon; the audit
    sees it, and stays within epsilon at the weighted one (2 x 3)."""
    replace = mst_score_sensitivity(ContributionBounds(1, "replace")).l1
    weighted = mst_score_sensitivity(ContributionBounds(1, "replace"), int(WEIGHTS.max())).l1
    loss_if_wrong, w0, w1 = worst_neighbours(WEIGHTS, replace)
    assert loss_if_wrong > 1.4
    draws = 200_000
    right = [_first_round(w, Fraction(1), weighted, draws, f"weighted-right{i}") for i, w in enumerate((w0, w1))]
    assert _loss_lower_bound(*right, m=w0.size) <= 1.0
    wrong = [_first_round(w, Fraction(1), replace, draws, f"weighted-wrong{i}") for i, w in enumerate((w0, w1))]
    assert _loss_lower_bound(*wrong, m=w0.size) > 1.1
