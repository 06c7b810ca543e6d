"""Noise mechanisms as exact parameters, calibrated from a budget and a derived sensitivity.

A mechanism here is arithmetic only: the samplers live in `dprelease.transforms.samplers`.
Parameters are rationals chosen so the exact samplers' integer arithmetic fits in 64 bits;
whenever a parameter is rounded, it is rounded toward *more* noise, so the privacy loss
actually incurred is at most the allocation (`privacy_loss` reports the exact value).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

import numpy as np

from .errors import SpecError
from .sensitivity import Sensitivity

_MAX_DENOMINATOR = 2**20
_MAX_LAPLACE_SCALE = 2**40
_LAPLACE_NUMERATOR_LIMIT = 2**52
"""The sampler adds t * v (t: the scale's numerator, v: a geometric draw) in 64 bits: t < 2**52 leaves
room for any v below 2**11, whose probability of being exceeded is e**-2048."""
_MAX_GAUSSIAN_SIGMA = 2**21
_SIGMA_64 = 30000
_GAUSSIAN_PRODUCT_LIMIT_64 = 2**62
"""Up to sigma 30000 (counts), sigma2's denominator keeps D = 2 a b t^2 below 2**62, as every earlier
version did: the same spec gives the same mechanism, so old manifests still verify."""
_GAUSSIAN_PRODUCT_LIMIT = 2**86
"""Above it (sums), the sampler's acceptance step divides by D in 128-bit arithmetic; D < 2**86 keeps the
squared numerator in 128 bits whenever the acceptance probability is above exp(-2**40)."""
_EXACT_PMF_SIGMA = _SIGMA_64
"""Above this sigma the discrete Gaussian's variance and 95% margin are those of the continuous one
(they differ by far less than a double's precision); up to it they are summed from the pmf."""


@dataclass(frozen=True)
class DiscreteLaplace:
    """P(x) proportional to exp(-|x| / scale) on the integers. Gives (L1 / scale)-DP."""

    scale: Fraction
    kind: Literal["discrete_laplace"] = "discrete_laplace"
    parameter_name = "scale"

    @property
    def parameter(self) -> Fraction:
        """What the sampler takes: the scale."""
        return self.scale

    def privacy_loss(self, sensitivity: Sensitivity) -> Fraction:
        """Pure epsilon of one release of a vector with this L1 sensitivity."""
        return Fraction(sensitivity.l1) / self.scale

    def variance(self) -> float:
        q = math.exp(-1 / float(self.scale))
        return 2 * q / (1 - q) ** 2

    def margin_95(self) -> int:
        """Smallest m >= 0 with P(|X| > m) = 2 q^(m+1) / (1+q) <= 0.05, in log space (q = e^(-1/scale))."""
        log_q = -1 / float(self.scale)
        q = math.exp(log_q)

        def log_tail(m: int) -> float:
            return math.log(2) + (m + 1) * log_q - math.log1p(q)

        m = max(math.ceil((math.log(0.05) - math.log(2) + math.log1p(q)) / log_q - 1), 0)
        while m > 0 and log_tail(m - 1) <= math.log(0.05):
            m -= 1
        while log_tail(m) > math.log(0.05):
            m += 1
        return m

    def parameter_text(self) -> str:
        return f"scale={self.scale}"


@dataclass(frozen=True)
class DiscreteGaussian:
    """P(x) proportional to exp(-x^2 / (2 sigma2)) on the integers. Gives (L2^2 / (2 sigma2))-zCDP
    (Canonne, Kamath, Steinke 2020, Thm 14)."""

    sigma2: Fraction
    kind: Literal["discrete_gaussian"] = "discrete_gaussian"
    parameter_name = "sigma2"

    @property
    def parameter(self) -> Fraction:
        """What the sampler takes: the variance parameter sigma^2."""
        return self.sigma2

    def privacy_loss(self, sensitivity: Sensitivity) -> Fraction:
        """rho of one release of a vector with this squared L2 sensitivity."""
        return Fraction(sensitivity.l2_squared) / (2 * self.sigma2)

    def _pmf(self) -> tuple[np.ndarray, np.ndarray]:
        sigma = math.sqrt(float(self.sigma2))
        bound = int(math.ceil(40 * sigma)) + 40
        xs = np.arange(-bound, bound + 1, dtype=np.float64)
        weights = np.exp(-(xs * xs) / (2 * float(self.sigma2)))
        return xs, weights / weights.sum()

    def variance(self) -> float:
        if self.sigma2 > _EXACT_PMF_SIGMA ** 2:
            return float(self.sigma2)
        xs, pmf = self._pmf()
        return float(np.sum(xs * xs * pmf))

    def margin_95(self) -> int:
        if self.sigma2 > _EXACT_PMF_SIGMA ** 2:
            return math.ceil(1.959963984540054 * math.sqrt(float(self.sigma2)))
        xs, pmf = self._pmf()
        centre = xs.size // 2
        inside = pmf[centre] + np.concatenate(([0.0], np.cumsum(pmf[centre + 1:] * 2)))
        return int(np.argmax(inside >= 0.95))

    def parameter_text(self) -> str:
        return f"sigma2={self.sigma2}"


@dataclass(frozen=True)
class ExponentialSelection:
    """The exponential mechanism over a public list of candidates, once per (cell, quantile): candidate j
    is chosen with probability proportional to exp(-epsilon * score_j / (2 * score sensitivity)), sampled
    exactly (rejection with exact Bernoulli(exp(-x)) draws, `dprelease.transforms.selection`).

    Privacy: each selection is epsilon-DP and epsilon-bounded-range, hence epsilon^2/8-zCDP (Cesar and
    Rogers 2021); `selections` selections per table compose to selections * epsilon (pure) or
    selections * epsilon^2 / 8 (rho). `accounted_as` says which the release's definition uses.
    """

    epsilon: Fraction
    selections: int
    accounted_as: Literal["epsilon", "rho"]
    kind: Literal["exponential"] = "exponential"
    parameter_name = "epsilon"

    @property
    def parameter(self) -> Fraction:
        """The epsilon of each selection."""
        return self.epsilon

    def privacy_loss(self, sensitivity: Sensitivity) -> Fraction:
        """Loss of the table's selections; `sensitivity` is the score sensitivity they were calibrated to."""
        per = self.epsilon if self.accounted_as == "epsilon" else self.epsilon ** 2 / 8
        return per * self.selections

    def parameter_text(self) -> str:
        return f"epsilon={self.epsilon} per selection"


Mechanism = DiscreteLaplace | DiscreteGaussian | ExponentialSelection


def _round_up(value: Fraction, denominator: int) -> Fraction:
    if value.denominator <= denominator:
        return value
    return Fraction(math.ceil(value * denominator), denominator)


def calibrate_laplace(epsilon: Fraction, sensitivity: Sensitivity, where: str) -> DiscreteLaplace:
    """Discrete Laplace whose loss is at most `epsilon` for this sensitivity.

    Privacy: scale >= L1 / epsilon (rounded up to a denominator <= 2^20, smaller for scales so large
    that the sampler's numerator must stay below 2^52).
    """
    if epsilon <= 0:
        raise SpecError(f"{where}: allocated epsilon ({epsilon}) must be > 0")
    exact_scale = Fraction(sensitivity.l1) / epsilon
    denominator = _MAX_DENOMINATOR
    scale = _round_up(exact_scale, denominator)
    while scale.numerator >= _LAPLACE_NUMERATOR_LIMIT and denominator > 1:
        denominator //= 2
        scale = _round_up(exact_scale, denominator)
    if scale > _MAX_LAPLACE_SCALE:
        raise SpecError(
            f"{where}: noise scale {float(scale):.4g} exceeds {_MAX_LAPLACE_SCALE}; "
            "raise the budget or lower the weight's share"
        )
    return DiscreteLaplace(scale=scale)


def calibrate_gaussian(rho: Fraction, sensitivity: Sensitivity, where: str) -> DiscreteGaussian:
    """Discrete Gaussian whose zCDP loss is at most `rho` for this sensitivity.

    Privacy: sigma2 >= L2^2 / (2 rho). sigma2 is rounded up to a denominator b such that
    the sampler's exact integer arithmetic (2 a b t^2 with sigma2 = a/b, t = floor(sigma)+1)
    stays below 2^62, or, for sigma above 30000 (where no b does), below 2^86.
    """
    if rho <= 0:
        raise SpecError(f"{where}: allocated rho ({rho}) must be > 0")
    exact = Fraction(sensitivity.l2_squared) / (2 * rho)
    if math.sqrt(float(exact)) > _MAX_GAUSSIAN_SIGMA:
        raise SpecError(
            f"{where}: noise sigma {math.sqrt(float(exact)):.4g} exceeds {_MAX_GAUSSIAN_SIGMA}; "
            "raise the budget or lower the weight's share"
        )
    limit = _GAUSSIAN_PRODUCT_LIMIT_64 if math.sqrt(float(exact)) <= _SIGMA_64 else _GAUSSIAN_PRODUCT_LIMIT
    denominator = _MAX_DENOMINATOR
    while True:
        sigma2 = _round_up(exact, denominator)
        t = math.isqrt(sigma2.numerator // sigma2.denominator) + 1
        if 2 * sigma2.numerator * sigma2.denominator * t * t < limit:
            return DiscreteGaussian(sigma2=sigma2)
        if denominator == 1:
            raise AssertionError("unreachable: sigma bounded above")  # pragma: no cover
        denominator //= 2


GRID_MANTISSA_BITS = 6
"""`compact_gaussian_budget` puts sigma^2 on m * 2^e with m of this many bits (32 to 63): within 1/32 of the
requested sigma^2, and the losses of many such tables sum to a fraction whose denominator divides
lcm(32..63) times a power of two (tens of digits, never hundreds)."""


_GRID_FINEST = 20
"""The finest grid step is 2^-20 (`_MAX_DENOMINATOR`): a variance on it is one `calibrate_gaussian` keeps as is."""


def compact_gaussian_budget(rho: Fraction, sensitivity: Sensitivity) -> Fraction:
    """The largest rho' <= rho whose discrete Gaussian variance L2^2 / (2 rho') is m * 2^e with m of
    GRID_MANTISSA_BITS bits (or, for a variance below 2^-14, a multiple of 2^-20): `calibrate_gaussian(rho', ...)`
    then spends exactly rho' (its sampler's limits permitting; at most rho' always).

    Why: a query whose tables get many different shares (a workload-optimal split) would otherwise compose to
    a sum of fractions with as many unrelated denominators, too long to print, store or verify exactly.
    Privacy: rho' <= rho (sigma^2 rounded up)."""
    exact = Fraction(sensitivity.l2_squared) / (2 * rho)
    e = exact.numerator.bit_length() - exact.denominator.bit_length() - GRID_MANTISSA_BITS
    while Fraction(2) ** (e + GRID_MANTISSA_BITS) <= exact:  # the grid step 2^e with exact < 2^(e + bits)
        e += 1
    while e > -1000 and Fraction(2) ** (e + GRID_MANTISSA_BITS - 1) > exact:
        e -= 1
    step = Fraction(2) ** max(e, -_GRID_FINEST)  # sigma^2 below 2^-14: a step of 2^-20, the calibration's own grid
    sigma2 = math.ceil(exact / step) * step
    return Fraction(sensitivity.l2_squared) / (2 * sigma2)


def calibrate_selection(budget: Fraction, selections: int, definition: str, where: str) -> ExponentialSelection:
    """Exponential mechanism selections whose composed loss is at most `budget`.

    Privacy: pure: epsilon = budget / selections; zCDP: the largest epsilon with denominator 2^20 and
    selections * epsilon^2 / 8 <= budget (rounded down: less loss). Each selection is calibrated to its
    score sensitivity by the sampler (exp(-epsilon * score / (2 * sensitivity))).
    """
    if budget <= 0:
        raise SpecError(f"{where}: allocated budget ({budget}) must be > 0")
    if definition == "pure":
        epsilon = budget / selections
        if epsilon.denominator > _MAX_DENOMINATOR:
            epsilon = Fraction(math.floor(epsilon * _MAX_DENOMINATOR), _MAX_DENOMINATOR)
        if epsilon <= 0:
            raise SpecError(f"{where}: allocated epsilon ({budget}) is too small for {selections} selection(s)")
        return ExponentialSelection(epsilon, selections, "epsilon")
    per_rho = budget / selections
    numerator = math.isqrt(math.floor(8 * per_rho * _MAX_DENOMINATOR ** 2))
    while Fraction(numerator, _MAX_DENOMINATOR) ** 2 / 8 > per_rho:  # isqrt of a floor: never too large, checked
        numerator -= 1
    if numerator <= 0:
        raise SpecError(f"{where}: allocated rho ({budget}) is too small for {selections} selection(s)")
    return ExponentialSelection(Fraction(numerator, _MAX_DENOMINATOR), selections, "rho")
