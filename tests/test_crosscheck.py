"""Accounting cross-checked against independent implementations: Google's dp-accounting
(RDP accountant) and OpenDP (mechanism privacy maps), on grids of parameters."""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from dprelease.accounting.composition import advanced_composition, basic_composition_approx
from dprelease.accounting.conversions import (group_privacy_epsilon, group_privacy_rho, pure_to_zcdp,
                                              zcdp_to_epsilon)
from dprelease.accounting.mechanisms import DiscreteGaussian, DiscreteLaplace
from dprelease.accounting.sensitivity import ContributionBounds, count_sensitivity

dp_accounting = pytest.importorskip("dp_accounting")
opendp = pytest.importorskip("opendp.prelude")


@pytest.mark.parametrize("rho", [0.001, 0.01, 0.1, 0.5, 1.0, 2.0, 10.0])
@pytest.mark.parametrize("delta", [1e-5, 1e-8, 1e-10])
def test_zcdp_to_epsilon_matches_dp_accounting(rho, delta):
    """rho-zCDP is a Gaussian with noise multiplier 1/sqrt(2 rho) in RDP terms; dp-accounting's
    conversion over a fine grid of orders must agree with ours (ours optimises continuously)."""
    orders = 1 + np.logspace(-4, 3.7, 20000)
    accountant = dp_accounting.rdp.RdpAccountant(orders=list(orders))
    accountant.compose(dp_accounting.GaussianDpEvent(noise_multiplier=1 / math.sqrt(2 * rho)))
    theirs = accountant.get_epsilon(delta)
    ours = zcdp_to_epsilon(rho, delta)
    assert ours <= theirs + 1e-9
    assert ours >= theirs * (1 - 1e-3) - 1e-6


@pytest.mark.parametrize("rho,delta", [(0.1, 1e-6), (1.0, 1e-10), (5.0, 1e-7)])
def test_zcdp_to_epsilon_not_looser_than_opendp(rho, delta):
    opendp.enable_features("contrib")
    space = (opendp.atom_domain(T=float, nan=False), opendp.absolute_distance(T=float))
    # a zCDP measurement whose map is exactly rho at d_in = 1
    gaussian = opendp.m.make_gaussian(*space, scale=1 / math.sqrt(2 * rho))
    approx = opendp.c.make_zCDP_to_approxDP(gaussian)
    theirs = approx.map(1.0).epsilon(delta)
    assert zcdp_to_epsilon(rho, delta) <= theirs * (1 + 1e-9) + 1e-12
    assert zcdp_to_epsilon(rho, delta) >= theirs * (1 - 1e-2)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("relation", ["add_remove", "replace"])
@pytest.mark.parametrize("scale", [Fraction(1), Fraction(7, 2), Fraction(40)])
def test_mechanism_losses_match_opendp_maps(k, relation, scale):
    """Our loss for the derived sensitivity equals OpenDP's privacy map of the same mechanism."""
    opendp.enable_features("contrib")
    sens = count_sensitivity(ContributionBounds(k, relation))
    space = (opendp.vector_domain(opendp.atom_domain(T=int)), opendp.l1_distance(T=int))
    laplace = opendp.m.make_laplace(*space, scale=float(scale))
    assert float(DiscreteLaplace(scale).privacy_loss(sens)) == pytest.approx(laplace.map(sens.l1), rel=1e-12)
    space2 = (opendp.vector_domain(opendp.atom_domain(T=int)), opendp.l2_distance(T=float))
    gaussian = opendp.m.make_gaussian(*space2, scale=float(scale))
    l2 = math.sqrt(sens.l2_squared)
    assert float(DiscreteGaussian(scale * scale).privacy_loss(sens)) == pytest.approx(gaussian.map(l2), rel=1e-9)


def test_pure_to_zcdp_and_group_privacy():
    assert pure_to_zcdp(Fraction(1, 2)) == Fraction(1, 8)
    assert group_privacy_epsilon(Fraction(1, 3), 4) == Fraction(4, 3)
    assert group_privacy_rho(Fraction(1, 10), 3) == Fraction(9, 10)
    # group privacy of a mechanism equals its loss at k-fold sensitivity
    sens1 = count_sensitivity(ContributionBounds(1, "add_remove"))
    sens3 = count_sensitivity(ContributionBounds(3, "add_remove"))
    lap, gauss = DiscreteLaplace(Fraction(2)), DiscreteGaussian(Fraction(5))
    assert lap.privacy_loss(sens3) == group_privacy_epsilon(lap.privacy_loss(sens1), 3)
    assert gauss.privacy_loss(sens3) == group_privacy_rho(gauss.privacy_loss(sens1), 3)


def test_basic_and_advanced_composition():
    assert basic_composition_approx([(0.5, 1e-6), (0.25, 2e-6)]) == (0.75, 3e-6)
    # k = 100 mechanisms of epsilon = 0.1: DRV gives sqrt(2 k ln(1/d)) eps + k eps (e^eps - 1)
    eps, delta = advanced_composition([(0.1, 0.0)] * 100, 1e-6)
    expected = math.sqrt(2 * 100 * math.log(1e6)) * 0.1 + 100 * 0.1 * math.expm1(0.1)
    assert eps == pytest.approx(expected) and eps < 10 and delta == pytest.approx(1e-6)
    # few large epsilons: basic composition is the better bound and is returned
    assert advanced_composition([(1.0, 0.0)] * 2, 1e-6)[0] == 2.0
    with pytest.raises(ValueError):
        advanced_composition([(0.1, 0.0)], 0.0)
