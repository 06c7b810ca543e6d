"""Sensitivity of count tables, derived from contribution bounds and the neighbouring relation."""
from __future__ import annotations

from dataclasses import dataclass
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
class CountSensitivity:
    """L1 and squared-L2 sensitivity of one count vector (a histogram over a public domain).

    Integers, so the discrete mechanisms' guarantees apply exactly.
    """

    l1: int
    l2_squared: int
    derivation: str


def count_sensitivity(bounds: ContributionBounds) -> CountSensitivity:
    """Sensitivity of one histogram when each unit contributes at most k records.

    Privacy: adding or removing one unit changes at most k records, so the count
    vector moves by at most k in L1 and (all k in one cell) by k in L2.
    Replacing a unit removes up to k records and adds up to k others: L1 <= 2k and,
    worst case all removed from one cell and all added to another, L2^2 <= 2k^2.
    """
    k = bounds.max_records_per_unit
    if bounds.neighbouring == "add_remove":
        return CountSensitivity(
            l1=k, l2_squared=k * k,
            derivation=f"add/remove one unit with at most k={k} records: L1 = k, L2 = k",
        )
    return CountSensitivity(
        l1=2 * k, l2_squared=2 * k * k,
        derivation=f"replace one unit of at most k={k} records: L1 = 2k, L2 = sqrt(2)*k",
    )
