"""Sensitivity of every statistic, derived from contribution bounds and the neighbouring relation."""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

Neighbouring = Literal["add_remove", "replace"]


@dataclass(frozen=True)
class ContributionBounds:
    """What contribution bounding guarantees about any one privacy unit.

    `max_records_per_unit`: at most this many of a unit's records reach any table
    (enforced by `dprelease.transforms.bound`).
    """

    max_records_per_unit: int
    neighbouring: Neighbouring

    def __post_init__(self) -> None:
        if self.max_records_per_unit < 1:
            raise ValueError(f"max_records_per_unit ({self.max_records_per_unit}) must be >= 1")
        if self.neighbouring not in ("add_remove", "replace"):
            raise ValueError(f"neighbouring ({self.neighbouring!r}) must be add_remove or replace")


@dataclass(frozen=True)
class Sensitivity:
    """L1 and squared-L2 sensitivity of one vector released over a public domain (counts, sums), or of
    a selection's integer scores (quantiles: `l1` is the score sensitivity, `l2_squared` unused: 0).

    Integers, so the discrete mechanisms' guarantees apply exactly.
    """

    l1: int
    l2_squared: int
    derivation: str


def count_sensitivity(bounds: ContributionBounds) -> Sensitivity:
    """Sensitivity of one histogram when each unit contributes at most k records.

    Privacy: adding or removing one unit changes at most k records, so the count
    vector moves by at most k in L1 and (all k in one cell) by k in L2.
    Replacing a unit removes up to k records and adds up to k others: L1 <= 2k and,
    worst case all removed from one cell and all added to another, L2^2 <= 2k^2.
    """
    k = bounds.max_records_per_unit
    if bounds.neighbouring == "add_remove":
        return Sensitivity(
            l1=k, l2_squared=k * k,
            derivation=f"add/remove one unit with at most k={k} records: L1 = k, L2 = k",
        )
    return Sensitivity(
        l1=2 * k, l2_squared=2 * k * k,
        derivation=f"replace one unit of at most k={k} records: L1 = 2k, L2 = sqrt(2)*k",
    )


def sum_sensitivity(bounds: ContributionBounds, lo: int, hi: int) -> Sensitivity:
    """Sensitivity of a vector of per-cell sums of a measure clamped to [lo, hi].

    Privacy: every value summed lies in [lo, hi], so one record moves its cell's sum by at most
    M = max(|lo|, |hi|). Adding or removing a unit changes at most k records: L1 <= kM and, all in one
    cell, L2 <= kM.
    Replacing a unit removes up to k records and adds up to k others. Cell c's sum moves by
    d_c = (added to c) - (removed from c), which lies in [n_c lo - m_c hi, n_c hi - m_c lo] for n_c records
    added to and m_c removed from c. |d_c| is bounded by the larger of two absolute values of linear
    functions of (n, m); its square summed over cells is convex in (n, m), so its maximum over the
    allocations (sum n_c <= k, sum m_c <= k) lies at a vertex: all k removed from one cell and all k
    added to one cell. Different cells: L2^2 = (kM)^2 + (kM)^2; the same cell (k records of lo replaced by
    k of hi): L2 = k(hi - lo). So L2 = k max(sqrt(2) M, hi - lo), and L1 <= 2kM (k(hi - lo) <= 2kM).
    """
    k = bounds.max_records_per_unit
    m = max(abs(lo), abs(hi))
    if bounds.neighbouring == "add_remove":
        return Sensitivity(l1=k * m, l2_squared=(k * m) ** 2,
                           derivation=f"add/remove one unit, at most k={k} records each within clamp [{lo}, {hi}]: "
                                      f"L1 = L2 = k*max(|lo|,|hi|) = {k * m}")
    spread = hi - lo
    return Sensitivity(l1=2 * k * m, l2_squared=k * k * max(2 * m * m, spread * spread),
                       derivation=f"replace one unit of at most k={k} records within clamp [{lo}, {hi}]: "
                                  f"L1 = 2k*max(|lo|,|hi|) = {2 * k * m}, L2 = k*max(sqrt(2)*max(|lo|,|hi|), hi-lo) "
                                  f"(records moved to another cell, or replaced within one)")


def unit_count_sensitivity(bounds: ContributionBounds) -> Sensitivity:
    """Sensitivity of a vector of per-cell counts of distinct privacy units.

    Privacy: a unit is counted at most once per cell, in the cells of its at most k kept records, so
    adding or removing it changes at most k cells by 1: L1 <= k, L2^2 <= k. Replacing it: L1 <= 2k,
    L2^2 <= 2k.
    """
    k = bounds.max_records_per_unit
    if bounds.neighbouring == "add_remove":
        return Sensitivity(l1=k, l2_squared=k,
                           derivation=f"add/remove one unit: at most k={k} cells change by 1: L1 = k, L2 = sqrt(k)")
    return Sensitivity(l1=2 * k, l2_squared=2 * k,
                       derivation=f"replace one unit: at most 2k={2 * k} cells change by 1: L1 = 2k, L2 = sqrt(2k)")


def quantile_score_sensitivity(bounds: ContributionBounds, q: Fraction) -> Sensitivity:
    """Sensitivity of the integer quantile scores |(b - a) * below(c) - a * above(c)| for q = a/b, where
    below(c) / above(c) count a cell's values < c / > c.

    Each cell runs its own exponential mechanism, so a unit's privacy loss is the sum over the cells its
    records reach of each cell's largest score change (over candidates); this returns that sum's bound,
    and every cell's selection is calibrated to it.
    Privacy: one record added to or removed from a cell raises or lowers below(c) by 1 (the score moves by
    at most b - a) or above(c) (at most a) or neither, for every candidate c at once: at most max(a, b - a)
    in that cell. Adding or removing a unit's at most k records: summed over cells, k * max(a, b - a).
    Replacing a unit removes up to k records and adds up to k others, each moving the scores of its own
    cell by up to max(a, b - a) (a record replaced within one cell moves them by at most b, which is
    less than 2 max(a, b - a)): summed over cells, 2k * max(a, b - a).
    """
    k = bounds.max_records_per_unit
    a, b = q.numerator, q.denominator
    step = max(a, b - a)
    if bounds.neighbouring == "add_remove":
        return Sensitivity(l1=k * step, l2_squared=0,
                           derivation=f"quantile {q} score, add/remove one unit of at most k={k} records: "
                                      f"k*max(a, b-a) = {k * step}, summed over cells")
    return Sensitivity(l1=2 * k * step, l2_squared=0,
                       derivation=f"quantile {q} score, replace one unit of at most k={k} records: "
                                  f"2k*max(a, b-a) = {2 * k * step}, summed over cells")


def mst_score_sensitivity(bounds: ContributionBounds, max_weight: int = 1, method: str = "mst") -> Sensitivity:
    """Sensitivity of the selection score of a candidate table (an MST pair, or a `select: aim` table of 2 or 3
    attributes): the L1 distance sum_c |x_c - e_c| between the table's bounded count vector x and an estimate e
    made from already released measurements (fixed while the round runs: adaptive composition), times the
    table's public workload weight (at most `max_weight`; 1 without a workload).

    Privacy: by the triangle inequality the distance moves by at most ||x - x'||_1, the count vector's L1
    sensitivity: adding or removing a unit of at most k records moves it by at most k; replacing one (its
    records moved to other cells: k cells down, k up) by at most 2k. A record replaced within its own cell
    moves nothing. A score weighted by w moves by w times as much, so by at most max_weight times. The
    exponential mechanism's distribution is unchanged by adding one constant to every candidate's score, so a
    score taken as (largest - score) keeps this sensitivity, and a public per-candidate penalty (a function of
    the domain and the calibrated noise only) moves no score between neighbours.
    """
    k = bounds.max_records_per_unit
    weighted = "" if max_weight == 1 else f", times the largest workload weight {max_weight}"
    what = "MST score (L1 distance of a pair's counts" if method == "mst" else \
        "AIM-style score (L1 distance of a candidate table's counts"
    if bounds.neighbouring == "add_remove":
        return Sensitivity(l1=k * max_weight, l2_squared=0,
                           derivation=f"{what} to a fixed estimate{weighted}), "
                                      f"add/remove one unit of at most k={k} records: "
                                      + (f"k = {k}" if max_weight == 1 else f"k * {max_weight} = {k * max_weight}"))
    return Sensitivity(l1=2 * k * max_weight, l2_squared=0,
                       derivation=f"{what} to a fixed estimate{weighted}), replace one "
                                  f"unit of at most k={k} records (moved to other cells): "
                                  + (f"2k = {2 * k}" if max_weight == 1 else
                                     f"2k * {max_weight} = {2 * k * max_weight}"))
