"""Conversions between privacy definitions.

zCDP -> (epsilon, delta) uses the tight conversion of Canonne, Kamath, Steinke (2020),
Corollary 13: a rho-zCDP mechanism is (epsilon, delta)-DP for
    delta = min_{a>1} exp((a-1)(a*rho - epsilon)) / (a-1) * (1 - 1/a)^a,
i.e.  epsilon(rho, delta) = min_{a>1} a*rho + log(1/delta)/(a-1) + log(a-1) - a*log(a)/(a-1).
"""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np


def _epsilon_at_orders(rho: float, delta: float, orders: np.ndarray) -> np.ndarray:
    a = orders
    return a * rho + math.log(1.0 / delta) / (a - 1.0) + np.log(a - 1.0) - a * np.log(a) / (a - 1.0)


def zcdp_to_epsilon(rho: float, delta: float) -> float:
    """Smallest epsilon such that rho-zCDP implies (epsilon, delta)-DP (CKS20, Cor. 13).

    Minimises over the Renyi order on a dense logarithmic grid and refines by
    golden-section search; the result is never below the true minimum by more
    than float rounding, and is capped by the classic rho + 2 sqrt(rho log 1/delta).
    """
    if not (rho >= 0 and math.isfinite(rho)):
        raise ValueError(f"rho ({rho}) must be a finite number >= 0")
    if not (0 < delta < 1):
        raise ValueError(f"delta ({delta}) must be within (0, 1)")
    if rho == 0:
        return 0.0
    grid = 1.0 + np.logspace(-8, 8, 4001)
    values = _epsilon_at_orders(rho, delta, grid)
    best = int(np.argmin(values))
    lo = grid[max(best - 1, 0)]
    hi = grid[min(best + 1, grid.size - 1)]
    golden = (math.sqrt(5) - 1) / 2
    for _ in range(200):
        m1 = hi - golden * (hi - lo)
        m2 = lo + golden * (hi - lo)
        f1, f2 = _epsilon_at_orders(rho, delta, np.array([m1, m2]))
        if f1 < f2:
            hi = m2
        else:
            lo = m1
    refined = float(_epsilon_at_orders(rho, delta, np.array([(lo + hi) / 2]))[0])
    classic = rho + 2 * math.sqrt(rho * math.log(1 / delta))
    return max(min(refined, float(values[best]), classic), 0.0)


def approx_to_zcdp(epsilon: Fraction, delta: float) -> Fraction:
    """Largest rho (a rational, rounded down) whose CKS20 conversion is (epsilon, delta)-DP.

    Privacy: composing zCDP measurements whose rhos sum to this value, then converting,
    gives (epsilon', delta) with epsilon' <= epsilon; the rounding is downward.
    """
    eps = float(epsilon)
    lo, hi = 0.0, eps
    for _ in range(200):
        mid = (lo + hi) / 2
        if zcdp_to_epsilon(mid, delta) <= eps:
            lo = mid
        else:
            hi = mid
    scale = 2**40
    rho = Fraction(math.floor(lo * scale), scale)
    while rho > 0 and zcdp_to_epsilon(float(rho), delta) > eps:
        rho -= Fraction(1, scale)
    return rho


def pure_to_zcdp(epsilon: Fraction) -> Fraction:
    """epsilon-DP implies (epsilon^2 / 2)-zCDP (Bun & Steinke 2016, Prop. 1.4)."""
    return epsilon * epsilon / 2


def group_privacy_epsilon(epsilon: Fraction, group_size: int) -> Fraction:
    """Pure epsilon-DP for one unit gives (k * epsilon)-DP for a group of k units."""
    return epsilon * group_size


def group_privacy_rho(rho: Fraction, group_size: int) -> Fraction:
    """rho-zCDP for one unit gives (k^2 * rho)-zCDP for a group of k units."""
    return rho * group_size * group_size
