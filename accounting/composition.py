"""Records of measurements (DpEvent-like) and their composition into release totals.

Totals are always recomputed from the measurement records, never stored separately:
the manifest's totals and `dprelease verify` both call `compose`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from .conversions import zcdp_to_epsilon
from .mechanisms import DiscreteGaussian, DiscreteLaplace, ExponentialSelection, Mechanism
from .sensitivity import Sensitivity

Definition = Literal["pure", "approx", "zcdp"]


@dataclass(frozen=True)
class MeasurementEvent:
    """One noisy count vector released: which mechanism, on what sensitivity, for what budget.

    `allocated` is the share of the release budget given to this measurement
    (epsilon for pure DP, rho for zCDP/approx); `loss` is what the calibrated mechanism
    actually spends, always <= allocated.
    """

    table: str
    mechanism: Mechanism
    sensitivity: Sensitivity
    allocated: Fraction

    @property
    def loss(self) -> Fraction:
        return self.mechanism.privacy_loss(self.sensitivity)


@dataclass(frozen=True)
class Totals:
    """Composed privacy loss of a set of measurements under the release's definition."""

    definition: Definition
    pure_epsilon: Fraction | None
    rho: Fraction | None
    epsilon_at_delta: float | None
    delta: float | None
    allocated_sum: Fraction


def compose(events: list[MeasurementEvent], definition: Definition, delta: float | None) -> Totals:
    """Basic composition for pure DP (epsilons add) or additive zCDP (rhos add).

    For zCDP/approx the composed rho is also reported as (epsilon, delta) with the
    CKS20 conversion. Raises if events mix mechanism families (check first, then sum):
    pure DP takes discrete Laplace and selections accounted in epsilon, zCDP discrete Gaussian
    and selections accounted in rho (epsilon^2/8 each, bounded range).
    """
    allocated = sum((e.allocated for e in events), Fraction(0))
    if definition == "pure":
        if any(not (isinstance(e.mechanism, DiscreteLaplace) or _selection_in(e, "epsilon")) for e in events):
            raise ValueError("pure-DP composition requires discrete Laplace measurements or pure selections")
        eps = sum((e.loss for e in events), Fraction(0))
        return Totals(definition, eps, None, None, None, allocated)
    if any(not (isinstance(e.mechanism, DiscreteGaussian) or _selection_in(e, "rho")) for e in events):
        raise ValueError("zCDP composition requires discrete Gaussian measurements or selections accounted in rho")
    rho = sum((e.loss for e in events), Fraction(0))
    eps = zcdp_to_epsilon(float(rho), delta) if delta is not None else None
    return Totals(definition, None, rho, eps, delta, allocated)


def _selection_in(event: MeasurementEvent, unit: str) -> bool:
    return isinstance(event.mechanism, ExponentialSelection) and event.mechanism.accounted_as == unit


def basic_composition_approx(budgets: list[tuple[float, float]]) -> tuple[float, float]:
    """k (epsilon_i, delta_i)-DP mechanisms compose to (sum epsilon_i, sum delta_i)-DP."""
    if any(eps < 0 or not 0 <= delta <= 1 for eps, delta in budgets):
        raise ValueError("every epsilon must be >= 0 and every delta within [0, 1]")
    return sum(eps for eps, _ in budgets), min(sum(delta for _, delta in budgets), 1.0)


def advanced_composition(budgets: list[tuple[float, float]], delta_slack: float) -> tuple[float, float]:
    """The advanced composition theorem (Dwork, Rothblum, Vadhan 2010; heterogeneous form):
    (epsilon_i, delta_i)-DP mechanisms compose to (epsilon', sum delta_i + delta_slack)-DP with
        epsilon' = sqrt(2 ln(1/delta_slack) * sum epsilon_i^2) + sum epsilon_i (e^epsilon_i - 1).
    Returns the smaller of that and basic composition's epsilon (both hold)."""
    if not 0 < delta_slack < 1:
        raise ValueError(f"delta_slack ({delta_slack}) must be within (0, 1)")
    basic_eps, basic_delta = basic_composition_approx(budgets)
    squares = sum(eps * eps for eps, _ in budgets)
    advanced = math.sqrt(2 * math.log(1 / delta_slack) * squares) + sum(eps * math.expm1(eps) for eps, _ in budgets)
    return min(advanced, basic_eps), min(basic_delta + delta_slack, 1.0)
