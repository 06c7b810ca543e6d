"""Exact rational numbers for budgets: parsing and formatting."""
from __future__ import annotations

import math
from fractions import Fraction


def parse_rational(value: object) -> Fraction:
    """Parse an int, a float (by its shortest decimal form) or a string 'p/q' / '0.1' exactly.

    Raises ValueError saying what is allowed; the caller names the field.

    A float 0.1 becomes exactly 1/10, never 3602879701896397/36028797018963968.
    """
    if isinstance(value, bool):
        raise ValueError("must be a number, not a boolean")
    if isinstance(value, Fraction):
        return value
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return Fraction(repr(value))
    if isinstance(value, str):
        text = value.strip()
        try:
            parsed = Fraction(text)
        except (ValueError, ZeroDivisionError):
            raise ValueError("must be a number such as 0.5 or a fraction such as '1/3'") from None
        return parsed
    raise ValueError("must be a number or a fraction string")


def fraction_text(value: Fraction) -> str:
    """'p/q' (or 'p' for integers): the exact form written into manifests."""
    return str(value)


def allocate(total: Fraction, weights: list[Fraction]) -> list[Fraction]:
    """Split `total` in proportion to positive `weights`, exactly: the parts sum to `total`.

    Privacy: the sum of the parts is checked to equal the total, so basic/additive
    composition of the parts never exceeds the declared budget.
    """
    if not weights:
        return []
    if any(w <= 0 for w in weights):
        raise ValueError(f"weights must all be > 0, got {[str(w) for w in weights]}")
    weight_sum = sum(weights, Fraction(0))
    parts = [total * w / weight_sum for w in weights]
    if sum(parts, Fraction(0)) != total:  # cannot happen with exact arithmetic; checked anyway
        raise ArithmeticError("allocation does not sum to the total")
    return parts
