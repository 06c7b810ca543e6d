"""Samplers against their exact distributions, with power to reject a 30% wrong scale.

Every goodness-of-fit test runs at alpha = 1e-6 on n >= 10^5 samples, and the same test is
shown to reject samples drawn at 0.7x and 1.3x the scale.
"""
from __future__ import annotations

import math
import os
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from dprelease.transforms import samplers
from dprelease.transforms.csprng import CellStream, ReleaseKey
from dprelease.transforms.samplers import sample_cells

ALPHA = 1e-6
N = 120_000


def laplace_pmf(scale: Fraction, xs: np.ndarray) -> np.ndarray:
    q = math.exp(-1 / float(scale))
    return (1 - q) / (1 + q) * q ** np.abs(xs)


def gaussian_pmf(sigma2: Fraction, xs: np.ndarray) -> np.ndarray:
    s2 = float(sigma2)
    span = np.arange(-int(60 * math.sqrt(s2)) - 60, int(60 * math.sqrt(s2)) + 61)
    norm = np.exp(-(span.astype(float) ** 2) / (2 * s2)).sum()
    return np.exp(-(xs.astype(float) ** 2) / (2 * s2)) / norm


def chi_square_p(samples: np.ndarray, pmf) -> float:
    """Chi-square goodness of fit with one bin per value of expected count >= 20, tails pooled."""
    n = samples.size
    lo, hi = int(samples.min()) - 1, int(samples.max()) + 1
    xs = np.arange(lo - 2000, hi + 2001)
    expected = pmf(xs) * n
    keep = expected >= 20
    inner = xs[keep]
    observed = np.array([np.count_nonzero(samples == x) for x in inner], dtype=float)
    exp_inner = expected[keep]
    below = samples < inner.min()
    above = samples > inner.max()
    observed = np.concatenate(([below.sum()], observed, [above.sum()]))
    exp_tails = [n * 0 + expected[xs < inner.min()].sum(), expected[xs > inner.max()].sum()]
    expected_all = np.concatenate(([exp_tails[0]], exp_inner, [exp_tails[1]]))
    expected_all *= n / expected_all.sum()
    return float(stats.chisquare(observed, expected_all).pvalue)


def draw(kind: str, parameter: Fraction, n: int = N) -> np.ndarray:
    stream = CellStream.for_table(ReleaseKey.generate(), "sampler-test")
    return sample_cells(stream, 0, n, kind, parameter)


@pytest.mark.parametrize("scale", [Fraction(1), Fraction(7, 3), Fraction(20)])
def test_discrete_laplace_matches_pmf_and_test_has_power(scale):
    pmf = lambda xs: laplace_pmf(scale, xs)  # noqa: E731
    assert chi_square_p(draw("discrete_laplace", scale), pmf) > ALPHA
    for wrong in (scale * Fraction(13, 10), scale * Fraction(7, 10)):
        assert chi_square_p(draw("discrete_laplace", wrong), pmf) < ALPHA


@pytest.mark.parametrize("sigma2", [Fraction(1), Fraction(9, 2), Fraction(400)])
def test_discrete_gaussian_matches_pmf_and_test_has_power(sigma2):
    pmf = lambda xs: gaussian_pmf(sigma2, xs)  # noqa: E731
    assert chi_square_p(draw("discrete_gaussian", sigma2), pmf) > ALPHA
    for factor in (Fraction(13, 10), Fraction(7, 10)):
        wrong = sigma2 * factor * factor  # 30% wrong scale (standard deviation)
        assert chi_square_p(draw("discrete_gaussian", wrong), pmf) < ALPHA


def test_noise_is_the_same_in_any_batching(monkeypatch):
    stream = CellStream.for_table(ReleaseKey.generate(), "t")
    whole = sample_cells(stream, 0, 5000, "discrete_gaussian", Fraction(7, 2))
    monkeypatch.setattr(samplers, "CHUNK_CELLS", 333)
    pieces = np.concatenate([sample_cells(stream, a, b, "discrete_gaussian", Fraction(7, 2))
                             for a, b in [(0, 1), (1, 1700), (1700, 4999), (4999, 5000)]])
    assert np.array_equal(whole, pieces)


def test_streams_of_distinct_tables_and_keys_are_independent():
    key = ReleaseKey(os.urandom(32))
    a = sample_cells(CellStream.for_table(key, "a"), 0, N, "discrete_laplace", Fraction(3))
    b = sample_cells(CellStream.for_table(key, "b"), 0, N, "discrete_laplace", Fraction(3))
    c = sample_cells(CellStream.for_table(ReleaseKey(os.urandom(32)), "a"), 0, N, "discrete_laplace", Fraction(3))
    for x, y in ((a, b), (a, c)):
        assert not np.array_equal(x, y)
        assert abs(np.corrcoef(x, y)[0, 1]) < 5 / math.sqrt(N)
    assert abs(np.corrcoef(a[:-1], a[1:])[0, 1]) < 5 / math.sqrt(N)  # neighbouring cells


@pytest.mark.parametrize("kind,parameter", [
    ("discrete_laplace", Fraction(1)), ("discrete_laplace", Fraction(7, 3)), ("discrete_laplace", Fraction(1000)),
    ("discrete_gaussian", Fraction(1, 4)), ("discrete_gaussian", Fraction(9, 2)), ("discrete_gaussian", Fraction(10**6)),
])
def test_c_kernel_is_bit_identical_to_the_numpy_reference(kind, parameter):
    """Two implementations of CKS20 over the same bit streams; cells that need a second round
    of keystream (several per thousand at sigma2 = 10^6) exercise the re-run path too."""
    from dprelease.transforms.samplers_reference import sample_cells_reference

    stream = CellStream.for_table(ReleaseKey.generate(), "cross-check")
    assert np.array_equal(sample_cells(stream, 0, 20_000, kind, parameter),
                          sample_cells_reference(stream, 0, 20_000, kind, parameter))
