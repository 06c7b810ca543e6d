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
from .sensitivity import CountSensitivity

_MAX_DENOMINATOR = 2**20
_MAX_LAPLACE_SCALE = 2**20
_MAX_GAUSSIAN_SIGMA = 30000
_GAUSSIAN_PRODUCT_LIMIT = 2**62


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

    def privacy_loss(self, sensitivity: CountSensitivity) -> Fraction:
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

    def privacy_loss(self, sensitivity: CountSensitivity) -> Fraction:
        """rho of one release of a vector with this squared L2 sensitivity."""
        return Fraction(sensitivity.l2_squared) / (2 * self.sigma2)

    def _pmf(self) -> tuple[np.ndarray, np.ndarray]:
        sigma = math.sqrt(float(self.sigma2))
        bound = int(math.ceil(40 * sigma)) + 40
        xs = np.arange(-bound, bound + 1, dtype=np.float64)
        weights = np.exp(-(xs * xs) / (2 * float(self.sigma2)))
        return xs, weights / weights.sum()

    def variance(self) -> float:
        xs, pmf = self._pmf()
        return float(np.sum(xs * xs * pmf))

    def margin_95(self) -> int:
        xs, pmf = self._pmf()
        centre = xs.size // 2
        inside = pmf[centre] + np.concatenate(([0.0], np.cumsum(pmf[centre + 1:] * 2)))
        return int(np.argmax(inside >= 0.95))

    def parameter_text(self) -> str:
        return f"sigma2={self.sigma2}"


Mechanism = DiscreteLaplace | DiscreteGaussian


def _round_up(value: Fraction, denominator: int) -> Fraction:
    if value.denominator <= denominator:
        return value
    return Fraction(math.ceil(value * denominator), denominator)


def calibrate_laplace(epsilon: Fraction, sensitivity: CountSensitivity, where: str) -> DiscreteLaplace:
    """Discrete Laplace whose loss is at most `epsilon` for this sensitivity.

    Privacy: scale >= L1 / epsilon (rounded up to a denominator <= 2^20).
    """
    if epsilon <= 0:
        raise SpecError(f"{where}: allocated epsilon ({epsilon}) must be > 0")
    scale = _round_up(Fraction(sensitivity.l1) / epsilon, _MAX_DENOMINATOR)
    if scale > _MAX_LAPLACE_SCALE:
        raise SpecError(
            f"{where}: noise scale {float(scale):.4g} exceeds {_MAX_LAPLACE_SCALE}; "
            "raise the budget or lower the weight's share"
        )
    return DiscreteLaplace(scale=scale)


def calibrate_gaussian(rho: Fraction, sensitivity: CountSensitivity, where: str) -> DiscreteGaussian:
    """Discrete Gaussian whose zCDP loss is at most `rho` for this sensitivity.

    Privacy: sigma2 >= L2^2 / (2 rho). sigma2 is rounded up to a denominator b such that
    the sampler's exact integer arithmetic (2 a b t^2 with sigma2 = a/b, t = floor(sigma)+1)
    stays below 2^62.
    """
    if rho <= 0:
        raise SpecError(f"{where}: allocated rho ({rho}) must be > 0")
    exact = Fraction(sensitivity.l2_squared) / (2 * rho)
    if math.sqrt(float(exact)) > _MAX_GAUSSIAN_SIGMA:
        raise SpecError(
            f"{where}: noise sigma {math.sqrt(float(exact)):.4g} exceeds {_MAX_GAUSSIAN_SIGMA}; "
            "raise the budget or lower the weight's share"
        )
    denominator = _MAX_DENOMINATOR
    while True:
        sigma2 = _round_up(exact, denominator)
        t = math.isqrt(sigma2.numerator // sigma2.denominator) + 1
        if 2 * sigma2.numerator * sigma2.denominator * t * t < _GAUSSIAN_PRODUCT_LIMIT:
            return DiscreteGaussian(sigma2=sigma2)
        if denominator == 1:
            raise AssertionError("unreachable: sigma bounded above")  # pragma: no cover
        denominator //= 2
