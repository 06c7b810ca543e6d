"""Periods of a release series and the per-period budgets they are charged against.

A spec names the period its release covers in one of four formats: `YYYY` (a year), `YYYY-Qn` (a
quarter), `YYYY-MM` (a month) or `YYYY-MM-DD` (a day); any other text is refused (exit 2), so that two
spellings of one period (`2026-11`, `nov-2026`) can never be charged against two different budgets.

A dataset's per-period budget has a granularity (`year`, `quarter`, `month` or `day`). A release is
charged, in full, against the budget of EVERY period of that granularity its own period overlaps:
under a monthly budget a release of `2026-11-05` counts against `2026-11`, a release of `2026-Q4`
against `2026-10`, `2026-11` and `2026-12`, and a release of `2026` against all twelve months (it
uses data of each). Privacy: the budget of a period bounds the loss of every release whose period
touches it, whatever format or granularity the releases were named in.
"""
from __future__ import annotations

import calendar
import datetime as dt
import re
from dataclasses import dataclass

FORMATS = "YYYY, YYYY-Qn, YYYY-MM or YYYY-MM-DD (e.g. 2026, 2026-Q4, 2026-11, 2026-11-05)"
UNITS = ("year", "quarter", "month", "day")
_PATTERN = re.compile(r"(?P<year>[0-9]{4})(?:-Q(?P<quarter>[1-4])|-(?P<month>[0-9]{2})(?:-(?P<day>[0-9]{2}))?)?")


@dataclass(frozen=True)
class Period:
    """A calendar period: its canonical text, first and last day (inclusive) and granularity."""

    text: str
    first: dt.date
    last: dt.date
    unit: str


def parse_period(text: object) -> Period:
    """The period a text names; ValueError saying the allowed formats otherwise."""
    match = _PATTERN.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"must be a period in one of the formats {FORMATS}")
    year = int(match["year"])
    if year < 1:
        raise ValueError(f"year {year}: must be 0001 or later")
    try:
        if match["quarter"]:
            first_month = 3 * int(match["quarter"]) - 2
            return Period(text, dt.date(year, first_month, 1), _month_end(year, first_month + 2), "quarter")
        if match["day"]:
            day = dt.date(year, int(match["month"]), int(match["day"]))
            return Period(text, day, day, "day")
        if match["month"]:
            month = int(match["month"])
            return Period(text, dt.date(year, month, 1), _month_end(year, month), "month")
    except ValueError:
        raise ValueError(f"is not a date of the calendar; formats: {FORMATS}") from None
    return Period(text, dt.date(year, 1, 1), dt.date(year, 12, 31), "year")


def _month_end(year: int, month: int) -> dt.date:
    return dt.date(year, month, calendar.monthrange(year, month)[1])


def period_of(day: dt.date, unit: str) -> str:
    """The canonical text of the `unit` period holding `day`."""
    if unit == "year":
        return f"{day.year:04d}"
    if unit == "quarter":
        return f"{day.year:04d}-Q{(day.month - 1) // 3 + 1}"
    if unit == "month":
        return f"{day.year:04d}-{day.month:02d}"
    if unit == "day":
        return day.isoformat()
    raise ValueError(f"period unit ({unit!r}) must be one of {', '.join(UNITS)}")


def budget_periods(period: Period, unit: str) -> list[str]:
    """The `unit` periods (canonical texts, in order) that `period` overlaps: the budgets it is charged to."""
    if unit not in UNITS:
        raise ValueError(f"period unit ({unit!r}) must be one of {', '.join(UNITS)}")
    if unit == "day" and (period.last - period.first).days > 366:
        raise ValueError("a per-day budget cannot be charged by a release covering more than a year")
    names: list[str] = []
    day = period.first
    while day <= period.last:
        name = period_of(day, unit)
        if not names or names[-1] != name:
            names.append(name)
        day = _next_start(day, unit)
    return names


def _next_start(day: dt.date, unit: str) -> dt.date:
    """The first day of the `unit` period after the one holding `day`."""
    if unit == "day":
        return day + dt.timedelta(days=1)
    if unit == "year":
        return dt.date(day.year + 1, 1, 1)
    months = 3 if unit == "quarter" else 1
    first_month = day.month - (day.month - 1) % months
    month = first_month + months
    return dt.date(day.year + (month - 1) // 12, (month - 1) % 12 + 1, 1)


def overlaps(text: str | None, budget_period: str, unit: str) -> bool:
    """Whether a ledger row's period (text as recorded) is charged to `budget_period`. A recorded period
    that does not parse (written by an older dprelease, which took any text) counts against every
    budget period: the conservative reading."""
    if text is None:
        return False
    try:
        return budget_period in budget_periods(parse_period(text), unit)
    except ValueError:
        return True
