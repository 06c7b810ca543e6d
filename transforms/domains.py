"""Public domains of columns: the cells every table is counted over.

Domains come from the spec and public files only, never from the data. A column whose
invalid-value policy is `other` gets one extra cell, the last, labelled `OTHER_LABEL`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

OTHER_LABEL = "(other)"
NATION = "nation"
Policy = Literal["other", "drop"]


@dataclass(frozen=True)
class CategoricalDomain:
    """A list of values, matched by their string form."""

    name: str
    values: tuple[str, ...]
    policy: Policy

    @property
    def size(self) -> int:
        return len(self.values) + (self.policy == "other")

    def labels(self) -> list[str]:
        return list(self.values) + ([OTHER_LABEL] if self.policy == "other" else [])


@dataclass(frozen=True)
class IntegerDomain:
    """Integers in [minimum, maximum]; with `edges`, cell i is [edges[i], edges[i+1])."""

    name: str
    minimum: int
    maximum: int
    edges: tuple[int, ...] | None
    policy: Policy

    @property
    def size(self) -> int:
        base = len(self.edges) - 1 if self.edges else self.maximum - self.minimum + 1
        return base + (self.policy == "other")

    def labels(self) -> list[str]:
        if self.edges:
            base = [
                f"{lo}" if hi - lo == 1 else f"{lo}-{hi - 1}"
                for lo, hi in zip(self.edges[:-1], self.edges[1:])
            ]
        else:
            base = [str(v) for v in range(self.minimum, self.maximum + 1)]
        return base + ([OTHER_LABEL] if self.policy == "other" else [])


@dataclass(frozen=True)
class GeographyDomain:
    """Fixed-width geography codes whose prefixes name the levels (state = 2 chars, ...).

    `leaves` is the sorted public list of valid finest-level codes. Level `nation` (width 0)
    is implicit and has the single unit "US". With policy `other`, every other level gets an
    extra last unit `(other)` whose parent is the `(other)` unit of the level above (at the
    top, the nation, which contains every record).
    """

    name: str
    levels: tuple[tuple[str, int], ...]
    leaves: tuple[str, ...] = field(repr=False)
    policy: Policy = "other"
    _cache: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    def __getstate__(self) -> dict:
        """Pickled without `_cache` (derived: units and lookups a worker makes again when it needs them), so a domain
        travels at the size of its leaves."""
        return {k: v for k, v in self.__dict__.items() if k != "_cache"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _cache={})

    def level_names(self) -> list[str]:
        return [NATION] + [name for name, _ in self.levels]

    def width(self, level: str) -> int:
        if level == NATION:
            return 0
        return dict(self.levels)[level]

    @property
    def leaf_level(self) -> str:
        return self.levels[-1][0]

    @property
    def size(self) -> int:
        return self.level_size(self.leaf_level)

    def units(self, level: str) -> list[str]:
        """Sorted unit codes of a level (without the other unit)."""
        if level not in self._cache:
            width = self.width(level)
            self._cache[level] = sorted({leaf[:width] for leaf in self.leaves})
        return self._cache[level]

    def has_other(self, level: str) -> bool:
        return self.policy == "other" and level != NATION

    def level_size(self, level: str) -> int:
        return len(self.units(level)) + self.has_other(level)

    def labels(self, level: str | None = None) -> list[str]:
        level = level or self.leaf_level
        units = ["US" if level == NATION else u for u in self.units(level)]
        return units + ([OTHER_LABEL] if self.has_other(level) else [])

    def leaf_to_level(self, level: str) -> np.ndarray:
        """Array mapping each leaf cell (incl. other) to its unit index at `level` (read-only, made once: every table
        of the level shares it, so a pickled plan holds it once)."""
        key = ("leaf_to_level", level)
        if key not in self._cache:
            self._cache[key] = self._leaf_to_level(level)
            self._cache[key].setflags(write=False)
        return self._cache[key]

    def _leaf_to_level(self, level: str) -> np.ndarray:
        width = self.width(level)
        index = {u: i for i, u in enumerate(self.units(level))}
        mapping = [index[leaf[:width]] for leaf in self.leaves]
        if self.policy == "other":
            mapping.append(len(index) if self.has_other(level) else 0)
        return np.asarray(mapping, dtype=np.int64)

    def parent_of(self, child_level: str, parent_level: str) -> np.ndarray:
        """Array mapping each unit of `child_level` (incl. other) to its unit at `parent_level`."""
        key = ("parent_of", child_level, parent_level)
        if key not in self._cache:
            self._cache[key] = self._parent_of(child_level, parent_level)
            self._cache[key].setflags(write=False)
        return self._cache[key]

    def _parent_of(self, child_level: str, parent_level: str) -> np.ndarray:
        width = self.width(parent_level)
        index = {u: i for i, u in enumerate(self.units(parent_level))}
        mapping = [index[u[:width]] for u in self.units(child_level)]
        if self.has_other(child_level):
            mapping.append(len(index) if self.has_other(parent_level) else 0)
        return np.asarray(mapping, dtype=np.int64)


@dataclass(frozen=True)
class MeasureDomain:
    """An integer measure clamped to [lower, upper] (sum, mean, quantile queries).

    Its encoded column (named `measure_key(source)`) holds value - lower for a valid value and
    `invalid_code` for a null, NaN or non-integer one, which is left out of the measure's tables; the
    record itself is never dropped for it."""

    name: str
    source: str
    lower: int
    upper: int
    policy: Policy = "other"

    @property
    def span(self) -> int:
        return self.upper - self.lower

    @property
    def invalid_code(self) -> int:
        return self.span + 1

    @property
    def size(self) -> int:
        return self.span + 2


def measure_key(column: str) -> str:
    """Name of a measure's encoded column ('#' cannot occur in a spec column reference)."""
    return f"{column}#measure"


Domain = CategoricalDomain | IntegerDomain | GeographyDomain | MeasureDomain


@dataclass(frozen=True)
class Dimension:
    """One axis of a table: a column at a level (geography) or its own cells."""

    column: str
    level: str | None
    size: int

    @property
    def label(self) -> str:
        return f"{self.column}.{self.level}" if self.level else self.column

    @property
    def output_name(self) -> str:
        return self.level if self.level else self.column


def dimension(domain: Domain, level: str | None) -> Dimension:
    if isinstance(domain, GeographyDomain):
        level = level or domain.leaf_level
        return Dimension(domain.name, level, domain.level_size(level))
    return Dimension(domain.name, None, domain.size)


def dimension_labels(domain: Domain, dim: Dimension) -> list[str]:
    if isinstance(domain, GeographyDomain):
        return domain.labels(dim.level)
    return domain.labels()
