"""Exact rational numbers for budgets: parsing and formatting."""
from __future__ import annotations

import math
import re
from fractions import Fraction

MAX_TEXT_DIGITS = 60
"""Longest run of digits a number given as text may hold, and MAX_EXPONENT its largest decimal exponent:
'1e-100000000' is 20 bytes, but its exact value needs a 100-million-digit integer (minutes, hundreds of
MiB). Parsing refuses such texts before building any number."""
MAX_EXPONENT = 400
_NUMBER = re.compile(r"^[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE](?P<exponent>[+-]?[0-9]+))?$")
_RATIO = re.compile(r"^[+-]?[0-9]+\s*/\s*[+-]?[0-9]+$")


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
        if value.bit_length() > MAX_TEXT_DIGITS * 4:
            raise ValueError(f"must have at most {MAX_TEXT_DIGITS} digits")
        return Fraction(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return Fraction(repr(value))
    if isinstance(value, str):
        text = value.strip()
        _check_size(text)
        try:
            parsed = Fraction(text)
        except (ValueError, ZeroDivisionError):
            raise ValueError("must be a number such as 0.5 or a fraction such as '1/3'") from None
        return parsed
    raise ValueError("must be a number or a fraction string")


def _check_size(text: str) -> None:
    """Refuse a numeric text whose exact value would be huge to build (see MAX_TEXT_DIGITS)."""
    if len(text) > 4 * MAX_TEXT_DIGITS:
        raise ValueError(f"must be at most {4 * MAX_TEXT_DIGITS} characters long")
    number = _NUMBER.match(text)
    if number is None and not _RATIO.match(text):
        raise ValueError("must be a number such as 0.5 or a fraction such as '1/3'")
    if sum(ch.isdigit() for ch in text.split("e")[0].split("E")[0]) > 2 * MAX_TEXT_DIGITS:
        raise ValueError(f"must have at most {2 * MAX_TEXT_DIGITS} digits")
    if number is not None and number["exponent"] is not None and abs(int(number["exponent"])) > MAX_EXPONENT:
        raise ValueError(f"its exponent must lie within ±{MAX_EXPONENT}")


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
