"""Aggregation: measurement vectors over a table's full public cell domain.

Statistics: `count` (records), `sum` (a clamped measure), `units` (distinct privacy units) and
`quantile` (per cell, counts of the measure's values in the 2m + 1 buckets around m public
candidates: below c_0, at c_0, between c_0 and c_1, ..., above c_m-1). All are exact int64.

Privacy: the output has one entry for every public cell (empty cells included), in a
fixed C order of the table's dimensions, so the set and order of released cells never
depend on the data.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Literal

import numpy as np
import pyarrow as pa

from . import _counting
from ._counting import COUNT, COUNT_VALID, QUANTILE, SUM
from .bound import bound_contributions, dense_unit_ids, record_keys
from .encode import LOOKUP_VALUES


@dataclass(frozen=True)
class TableLayout:
    """How to turn encoded columns into a table's cell index.

    For each dimension: the source column and an optional lookup (e.g. tract -> county).
    """

    name: str
    columns: tuple[str, ...]
    lookups: tuple[np.ndarray | None, ...]
    sizes: tuple[int, ...]
    statistic: Literal["count", "sum", "units", "quantile"] = "count"
    measure: str | None = None
    """Encoded measure column (codes value - lower; `invalid` for no value): summed or ranked, and for a
    `count` with a measure, the records counted are those with a valid value."""
    lower: int = 0
    invalid: int = 0
    candidates: tuple[int, ...] = field(default=())

    @property
    def n_cells(self) -> int:
        """Public cells of the table."""
        n = 1
        for size in self.sizes:
            n *= size
        return n

    @property
    def buckets(self) -> int:
        """Entries per cell of the measurement vector: 2m + 1 for a quantile, else 1."""
        return 2 * len(self.candidates) + 1 if self.statistic == "quantile" else 1

    @property
    def n_measured(self) -> int:
        """Length of the measurement vector."""
        return self.n_cells * self.buckets

    @property
    def inputs(self) -> tuple[str, ...]:
        """Encoded columns the layout reads."""
        return self.columns + ((self.measure,) if self.measure else ())

    def cell_index(self, codes: dict[str, np.ndarray], n_rows: int) -> np.ndarray:
        index = np.zeros(n_rows, dtype=np.int64)
        for column, lookup, size in zip(self.columns, self.lookups, self.sizes):
            values = codes[column]
            if lookup is not None:
                values = lookup[values]
            index *= size
            index += values
        return index

    def count(self, codes: dict[str, np.ndarray], n_rows: int) -> np.ndarray:
        """True counts of every cell (int64, length n_cells)."""
        return self._counted(codes, n_rows, COUNT)

    def measure_vector(self, codes: dict[str, np.ndarray], n_rows: int, units: np.ndarray | None = None) -> np.ndarray:
        """The table's exact measurement vector (int64, length n_measured) over these records.

        `units`: dense ids of the records' privacy units (all records of each unit present), or None when
        every record is its own unit."""
        if self.statistic == "count":
            return self._counted(codes, n_rows, COUNT if self.measure is None else COUNT_VALID)
        if self.statistic == "units":
            return _distinct_units(self.cell_index(codes, n_rows), units, self.n_cells)
        if self.statistic == "sum":
            return self._counted(codes, n_rows, SUM)
        if self.invalid <= LOOKUP_VALUES:  # buckets read from a table over the measure's codes
            return self._counted(codes, n_rows, QUANTILE, _bucket_table(self.candidates, self.lower, self.invalid))
        values = codes[self.measure].astype(np.int64)
        valid = values != self.invalid
        bucket = quantile_buckets(self.candidates, values[valid] + self.lower)
        index = self.cell_index(codes, n_rows)[valid]
        return np.bincount(index * self.buckets + bucket, minlength=self.n_measured).astype(np.int64)

    def _counted(self, codes: dict[str, np.ndarray], n_rows: int, kind: int,
                 buckets: np.ndarray | None = None) -> np.ndarray:
        """The measurement vector of a count, a measure's count, a sum (exact in int64) or a quantile over a
        bucket table, in one pass over the records (C kernel `_counting.count`: no index array; every code
        checked in its domain)."""
        if any(np.ndim(codes[c]) != 1 or len(codes[c]) != n_rows for c in self.inputs):
            raise ValueError(f"table {self.name}: a code column is not one code for each of its {n_rows} records")
        out = np.zeros(self.n_measured, dtype=np.int64)
        _counting.count(tuple(_code_column(codes[c]) for c in self.columns),
                        tuple(None if lookup is None else np.ascontiguousarray(lookup, dtype=np.int32)
                              for lookup in self.lookups),
                        np.array(self.sizes, dtype=np.int64), n_rows, out, kind,
                        None if kind == COUNT else _measure_column(codes[self.measure]), self.invalid, self.lower,
                        buckets)
        return out


@functools.lru_cache(maxsize=16)
def _bucket_table(candidates: tuple[int, ...], lower: int, invalid: int) -> np.ndarray:
    """Each measure code's (value - lower) quantile bucket, codes 0 .. invalid - 1 (public: from the candidates
    and the measure's range)."""
    table = quantile_buckets(candidates, lower + np.arange(invalid, dtype=np.int64)).astype(np.int32)
    table.flags.writeable = False
    return table


def _code_column(values: np.ndarray) -> np.ndarray:
    """A dimension's code column as the counting kernel reads it: contiguous int8, int16 or int32 (as encoded;
    wider or unsigned integers narrowed to int32 when every code fits, else the kernel's own out-of-domain
    error: a code past 2^31 is past every dimension's size)."""
    if values.dtype not in (np.int8, np.int16, np.int32):
        if values.size and (int(values.min()) < 0 or int(values.max()) > np.iinfo(np.int32).max):
            raise ValueError("count: a code is outside its column's domain (an encoding error)")
        values = values.astype(np.int32)
    return np.ascontiguousarray(values)


def _measure_column(values: np.ndarray) -> np.ndarray:
    """A measure's code column as the counting kernel reads it: contiguous int8, int16, int32 or int64."""
    if values.dtype not in (np.int8, np.int16, np.int32, np.int64):
        values = values.astype(np.int64)
    return np.ascontiguousarray(values)


def quantile_buckets(candidates: tuple[int, ...], values: np.ndarray) -> np.ndarray:
    """Each value's bucket among 2m + 1 around m sorted candidates: 2i below candidate i, 2i + 1 equal to it."""
    candidates = np.asarray(candidates, dtype=np.int64)
    below = np.searchsorted(candidates, values, side="left")
    equal = (below < candidates.size) & (candidates[np.minimum(below, candidates.size - 1)] == values)
    return 2 * below + equal


def _distinct_units(index: np.ndarray, units: np.ndarray | None, n_cells: int) -> np.ndarray:
    """Per cell, the number of distinct units among its records (each record its own unit: the count)."""
    if units is None:
        return np.bincount(index, minlength=n_cells).astype(np.int64)
    pairs = np.unique(units.astype(np.int64) * n_cells + index)
    return np.bincount(pairs % n_cells, minlength=n_cells).astype(np.int64)


def unravel_cells(sizes: tuple[int, ...]) -> list[np.ndarray]:
    """Per-dimension coordinates of every cell, in the C order used by `TableLayout`."""
    if not sizes:
        return []
    grids = np.unravel_index(np.arange(math.prod(map(int, sizes)), dtype=np.int64), sizes)
    return [np.asarray(g, dtype=np.int64) for g in grids]


def bounded_counts(layouts: list[TableLayout], codes: dict[str, np.ndarray], rows: int, sizes: list[int],
                   units: pa.Array | pa.ChunkedArray | None, k: int, subkey: bytes, sink=None) -> list[np.ndarray]:
    """True measurement vectors of every table over `rows` records (their `codes`; none when no table reads a
    column) that hold all records of their units (a partition); `sink(codes, rows)`, when given, also receives
    the codes of the records kept.

    Privacy: with `units`, each unit's records are first bounded to k (`bound_contributions`);
    with None every record is its own unit and is counted as is. The row count is given, never derived from
    the codes: a release whose tables read no column (a total) counts every record on every engine.
    """
    codes, n_rows, keep = bounded_records(codes, rows, sizes, units, k, subkey)
    if sink is not None:
        sink(codes, n_rows)
    unit_ids = None
    if keep is not None and any(layout.statistic == "units" for layout in layouts):
        unit_ids = dense_unit_ids(units.filter(pa.array(keep)))
    layouts, codes = shared_lookups(layouts, codes, n_rows)
    return [layout.measure_vector(codes, n_rows, unit_ids) for layout in layouts]


def shared_lookups(layouts: list[TableLayout], codes: dict[str, np.ndarray],
                   rows: int) -> tuple[list[TableLayout], dict[str, np.ndarray]]:
    """The layouts and codes with each column that two or more tables read through one lookup (a record's county
    from its tract, for every table within county) looked up once for all of them (`_counting.looked_up`: every
    code checked in the lookup's range): those tables then read the looked-up column with no lookup. The same
    counts; less work per table."""
    uses = Counter((column, id(lookup)) for layout in layouts for column, lookup in zip(layout.columns, layout.lookups)
                   if lookup is not None)
    shared = {}
    for layout in layouts:
        for column, lookup in zip(layout.columns, layout.lookups):
            key = (column, id(lookup))
            if lookup is not None and uses[key] > 1 and key not in shared and column in codes:
                name = f"{column}@lookup-{len(shared)}"  # '@' is in no spec column's name nor in a measure's
                if name in codes:
                    raise ValueError(f"a code column is named {name!r}, the name of a looked-up column")
                shared[key] = (name, _looked_up(column, codes[column], lookup, rows))
    if not shared:
        return layouts, codes
    codes = {**codes, **{name: values for name, values in shared.values()}}
    return [_reading_shared(layout, shared) for layout in layouts], codes


def _looked_up(column: str, values: np.ndarray, lookup: np.ndarray, rows: int) -> np.ndarray:
    """lookup[values] in the narrowest code type that holds the lookup's codes (checked in the C kernel)."""
    if np.ndim(values) != 1 or len(values) != rows:
        raise ValueError(f"column {column}: a code column is not one code for each of its {rows} records")
    lookup = np.ascontiguousarray(lookup, dtype=np.int32)
    top = int(lookup.max()) if lookup.size else 0
    out = np.empty(rows, dtype=np.int8 if top <= 127 else np.int16 if top <= 32767 else np.int32)
    _counting.looked_up(_code_column(values), lookup, rows, out)
    return out


def _reading_shared(layout: TableLayout, shared: dict) -> TableLayout:
    """The layout reading each shared looked-up column instead of its column through the lookup."""
    names = [shared.get((column, id(lookup)), (None,))[0] if lookup is not None else None
             for column, lookup in zip(layout.columns, layout.lookups)]
    if not any(names):
        return layout
    return dataclasses.replace(layout, columns=tuple(name or column for name, column in zip(names, layout.columns)),
                               lookups=tuple(None if name else lookup for name, lookup in zip(names, layout.lookups)))


def kept_counts(layouts: list[TableLayout], batches: Iterable[tuple[dict[str, np.ndarray], int]]) -> list[np.ndarray]:
    """Measurement vectors of count tables over records already bounded (`bounded_records`' codes, kept for a
    selection's later passes), given as (codes, rows) batches: the records' contributions were bounded once,
    over every encoded column, so counting them again adds no unit more than it contributed. No unit or measure
    statistics (the kept codes hold neither units nor measures)."""
    totals = [np.zeros(layout.n_measured, dtype=np.int64) for layout in layouts]
    for codes, rows in batches:
        reading, codes = shared_lookups(layouts, codes, rows)
        for total, layout in zip(totals, reading):
            total += layout.measure_vector(codes, rows)
    return totals


def bounded_records(codes: dict[str, np.ndarray], rows: int, sizes: list[int],
                    units: pa.Array | pa.ChunkedArray | None, k: int,
                    subkey: bytes) -> tuple[dict[str, np.ndarray], int, np.ndarray | None]:
    """(the codes of the records kept, their number, the mask kept or None) of `rows` records that hold all
    records of their units (a partition). Privacy: with `units`, each unit's records bounded to k
    (`bound_contributions`, keyed by the records' codes of every column in `codes`); with None every record is
    its own unit, kept."""
    n_rows = rows
    if units is None or not n_rows:
        return codes, n_rows, None
    def keys(positions: np.ndarray) -> np.ndarray:  # the keys of the records of units over k only
        return record_keys([codes[c][positions] for c in codes], sizes, positions.size)

    keep = bound_contributions(units, keys, k, subkey)
    return {c: values[keep] for c, values in codes.items()}, int(keep.sum()), keep
