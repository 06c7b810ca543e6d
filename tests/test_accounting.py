"""Sensitivity derived from bounds, exact allocation, calibration that never under-noises."""
from __future__ import annotations

import math
from fractions import Fraction

import pytest

from dprelease.accounting.conversions import approx_to_zcdp, zcdp_to_epsilon
from dprelease.accounting.mechanisms import calibrate_gaussian, calibrate_laplace
from dprelease.accounting.rationals import allocate
from dprelease.accounting.sensitivity import ContributionBounds, count_sensitivity
from dprelease.pipelines.plan import build_plan
from dprelease.pipelines.spec import load_spec


@pytest.mark.parametrize("k", [1, 2, 5, 100])
def test_sensitivity_add_remove(k):
    s = count_sensitivity(ContributionBounds(k, "add_remove"))
    assert (s.l1, s.l2_squared) == (k, k * k)


@pytest.mark.parametrize("k", [1, 2, 5, 100])
def test_sensitivity_replace_doubles_l1(k):
    s = count_sensitivity(ContributionBounds(k, "replace"))
    assert (s.l1, s.l2_squared) == (2 * k, 2 * k * k)


def test_bounds_reject_nonpositive():
    with pytest.raises(ValueError):
        ContributionBounds(0, "add_remove")


def test_allocation_is_exact():
    parts = allocate(Fraction(1), [Fraction(1), Fraction(1), Fraction(1)])
    assert parts == [Fraction(1, 3)] * 3 and sum(parts) == 1
    parts = allocate(Fraction(7, 10), [Fraction(2), Fraction(3, 7)])
    assert sum(parts) == Fraction(7, 10)


def test_laplace_calibration_never_exceeds_allocation():
    sens = count_sensitivity(ContributionBounds(3, "replace"))
    for eps in [Fraction(1), Fraction(1, 3), Fraction(7, 1000003)]:
        mech = calibrate_laplace(eps, sens, "t")
        assert mech.scale >= Fraction(sens.l1) / eps
        assert mech.privacy_loss(sens) <= eps


def test_gaussian_calibration_never_exceeds_allocation():
    sens = count_sensitivity(ContributionBounds(2, "add_remove"))
    for rho in [Fraction(1), Fraction(1, 3), Fraction(1, 91), Fraction(11927552, 796600953)]:
        mech = calibrate_gaussian(rho, sens, "t")
        assert mech.sigma2 >= Fraction(sens.l2_squared) / (2 * rho)
        assert mech.privacy_loss(sens) <= rho
        # the rounding costs a negligible amount of accuracy
        assert float(mech.sigma2) <= float(Fraction(sens.l2_squared) / (2 * rho)) * (1 + 1e-5)


def test_laplace_variance_and_margin():
    mech = calibrate_laplace(Fraction(1), count_sensitivity(ContributionBounds(1, "add_remove")), "t")
    q = math.exp(-1)
    assert mech.variance() == pytest.approx(2 * q / (1 - q) ** 2)
    m = mech.margin_95()
    assert 2 * q ** (m + 1) / (1 + q) <= 0.05 < 2 * q ** m / (1 + q)


def test_zcdp_conversion_is_at_least_as_tight_as_classic():
    for rho in [0.001, 0.1, 1, 5]:
        for delta in [1e-5, 1e-10]:
            eps = zcdp_to_epsilon(rho, delta)
            assert 0 < eps <= rho + 2 * math.sqrt(rho * math.log(1 / delta)) + 1e-12
            assert eps >= rho  # epsilon of a rho-zCDP mechanism is never below rho


def test_approx_to_zcdp_round_trip():
    rho = approx_to_zcdp(Fraction(1), 1e-9)
    assert zcdp_to_epsilon(float(rho), 1e-9) <= 1
    assert zcdp_to_epsilon(float(rho) * 1.001, 1e-9) > 1


def test_plan_noise_scales_with_bound_and_relation(case):
    base = build_plan(*load_spec(case()))
    triple = build_plan(*load_spec(case(contribution={"max_records_per_unit": 3})))
    replace = build_plan(*load_spec(case(neighbouring="replace")))
    for a, b, c in zip(base.tables, triple.tables, replace.tables):
        assert b.event.mechanism.scale == 3 * a.event.mechanism.scale
        assert c.event.mechanism.scale == 2 * a.event.mechanism.scale
        assert b.event.loss == a.event.loss == c.event.loss == a.event.allocated


def test_plan_totals_equal_budget(case):
    plan = build_plan(*load_spec(case(budget={"definition": "pure", "epsilon": "2/3"})))
    assert plan.totals.pure_epsilon == Fraction(2, 3)
    plan = build_plan(*load_spec(case(budget={"definition": "zcdp", "rho": 0.5})))
    assert plan.totals.rho <= Fraction(1, 2)
    assert plan.totals.allocated_sum == Fraction(1, 2)
