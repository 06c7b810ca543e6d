"""k-ary randomized response (`transforms/randomized_response.py`): the exact collection sampler against its
exact distribution (with power to reject a 30% wrong epsilon), an empirical audit of its local guarantee that
catches a 30% wrong epsilon, and the debiasing kernel's unbiasedness and stated variances against Monte Carlo
(with tolerances that a 30% wrong variance fails)."""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from dprelease.transforms.csprng import CellStream
from dprelease.transforms.randomized_response import (RandomizedResponse, debias, noise_variance, randomize,
                                                      response_variance)

DRAWS = 60_000
"""Draws per true value: a 30% larger epsilon moves p(truth) for k = 4, ε₀ = 1 from 0.475 to 0.55, some 35
standard errors; the chi-square test below rejects it with p < 1e-12."""


def reports(true_value: int, rr: RandomizedResponse, seed: int, draws: int = DRAWS) -> np.ndarray:
    stream = CellStream(bytes([seed]) * 32)
    return randomize(np.full(draws, true_value), rr, stream)


def chi_square_p(observed: np.ndarray, rr: RandomizedResponse, true_value: int) -> float:
    expected = rr.transition()[true_value] * observed.sum()
    return stats.chisquare(observed, expected).pvalue


@pytest.mark.parametrize("k, epsilon", [(2, Fraction(1)), (4, Fraction(1)), (7, Fraction(3, 2))])
def test_sampler_matches_the_exact_distribution(k, epsilon):
    rr = RandomizedResponse(k, epsilon)
    for true_value in (0, k - 1):
        observed = np.bincount(reports(true_value, rr, seed=true_value + k), minlength=k)
        assert chi_square_p(observed, rr, true_value) > 1e-4


def test_sampler_test_rejects_a_thirty_percent_wrong_epsilon():
    """The same test on draws made with 1.3 ε₀ (or 0.7 ε₀), judged against the declared ε₀: rejected."""
    declared = RandomizedResponse(4, Fraction(1))
    for wrong in (Fraction(13, 10), Fraction(7, 10)):
        observed = np.bincount(reports(1, RandomizedResponse(4, wrong), seed=9), minlength=4)
        assert chi_square_p(observed, declared, 1) < 1e-12


def audit_epsilon_lower_bound(rr: RandomizedResponse, seed: int, alpha: float = 1e-6) -> float:
    """An empirical lower confidence bound on the local epsilon: for neighbouring true values 0 and 1 (one
    record), max over reports r of log(P(r | 0) / P(r | 1)) with Clopper-Pearson bounds (lower on the
    numerator, upper on the denominator) at level alpha each."""
    first = np.bincount(reports(0, rr, seed), minlength=rr.k)
    second = np.bincount(reports(1, rr, seed + 100), minlength=rr.k)
    best = -math.inf
    for r in range(rr.k):
        for a, b in ((first, second), (second, first)):
            low = stats.beta.ppf(alpha, a[r], DRAWS - a[r] + 1) if a[r] else 0.0
            high = stats.beta.ppf(1 - alpha, b[r] + 1, DRAWS - b[r])
            if low > 0:
                best = max(best, math.log(low / high))
    return best


def test_audit_finds_no_more_loss_than_declared_and_catches_a_wrong_epsilon():
    """The mechanism with ε₀ = 1: the audit's lower bound stays below 1 (and near it: the bound is tight). A
    mechanism that draws with 1.3 ε₀ while declaring ε₀: the audit's lower bound exceeds the declared ε₀."""
    declared = Fraction(1)
    honest = audit_epsilon_lower_bound(RandomizedResponse(2, declared), seed=3)
    assert 0.8 < honest <= float(declared)
    cheating = audit_epsilon_lower_bound(RandomizedResponse(2, declared * Fraction(13, 10)), seed=5)
    assert cheating > float(declared)


def apply_transition(x: np.ndarray, axes) -> np.ndarray:
    """E[report counts] from true counts x: P(report | true) applied along each randomized axis."""
    for axis, rr in axes:
        x = np.moveaxis(np.tensordot(rr.transition().T, np.moveaxis(x, axis, 0), axes=1), 0, axis)
    return x


def test_debiasing_inverts_the_expected_reports_exactly():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 500, size=(4, 3, 5, 2)).astype(float)
    axes = [(1, RandomizedResponse(3, Fraction(1, 2))), (3, RandomizedResponse(2, Fraction(2)))]
    assert np.allclose(debias(apply_transition(x, axes), axes), x, rtol=1e-10, atol=1e-8)
    # margins over a randomized axis are kept: debiasing never moves a total
    assert np.allclose(debias(x, axes).sum(axis=1), debias(x.sum(axis=1), [(2, axes[1][1])]))


def simulate(x: np.ndarray, axes, rng, reps: int) -> np.ndarray:
    """Debiased report counts of `reps` independent collections of the records counted by x (shape (a, b): both
    axes randomized), each record's values randomized independently."""
    true_a, true_b = np.nonzero(x)
    counts = x[true_a, true_b].astype(int)
    a_values, b_values = np.repeat(true_a, counts), np.repeat(true_b, counts)
    out = np.empty((reps, *x.shape))
    (_, ra), (_, rb) = axes
    for i in range(reps):
        ka = np.where(rng.random(a_values.size) < ra.p_truth, a_values,
                      (a_values + rng.integers(1, ra.k, a_values.size)) % ra.k)
        kb = np.where(rng.random(b_values.size) < rb.p_truth, b_values,
                      (b_values + rng.integers(1, rb.k, b_values.size)) % rb.k)
        reported = np.zeros(x.shape)
        np.add.at(reported, (ka, kb), 1)
        out[i] = debias(reported, axes)
    return out


def test_stated_response_variance_matches_monte_carlo_with_two_randomized_axes():
    """4,000 collections of 300 records: the empirical variance per cell is within 12% of the stated one (its
    standard error is about 2.2%), so a variance 30% off fails; the mean is the truth."""
    rng = np.random.default_rng(1)
    x = np.array([[120.0, 30.0], [0.0, 60.0], [45.0, 45.0]])
    axes = [(0, RandomizedResponse(3, Fraction(1))), (1, RandomizedResponse(2, Fraction(3, 2)))]
    draws = simulate(x, axes, rng, 4000)
    stated = response_variance(x, axes)
    empirical = draws.var(axis=0, ddof=1)
    assert np.all(np.abs(empirical / stated - 1) < 0.12), (empirical, stated)
    assert np.all(np.abs(draws.mean(axis=0) - x) < 4 * np.sqrt(stated / 4000))


def test_stated_noise_variance_matches_monte_carlo():
    """Independent noise of variance 9 per cell of reports, debiased: variance 9 × ∏ ‖row of M‖²."""
    rng = np.random.default_rng(2)
    axes = [(1, RandomizedResponse(4, Fraction(1))), (2, RandomizedResponse(2, Fraction(1)))]
    noise = rng.normal(0, 3, size=(20_000, 4, 2))
    empirical = debias(noise, axes).var(axis=0).mean()
    assert abs(empirical / noise_variance(9.0, axes) - 1) < 0.05
