"""Aggregation: count vectors over a table's full public cell domain.

Privacy: the output has one entry for every public cell (empty cells included), in a
fixed C order of the table's dimensions, so the set and order of released cells never
depend on the data.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from .bound import bound_contributions, record_keys


@dataclass(frozen=True)
class TableLayout:
    """How to turn encoded columns into a table's cell index.

    For each dimension: the source column and an optional lookup (e.g. tract -> county).
    """

    name: str
    columns: tuple[str, ...]
    lookups: tuple[np.ndarray | None, ...]
    sizes: tuple[int, ...]

    @property
    def n_cells(self) -> int:
        n = 1
        for size in self.sizes:
            n *= size
        return n

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
        return np.bincount(self.cell_index(codes, n_rows), minlength=self.n_cells).astype(np.int64)


def unravel_cells(sizes: tuple[int, ...]) -> list[np.ndarray]:
    """Per-dimension coordinates of every cell, in the C order used by `TableLayout`."""
    if not sizes:
        return []
    grids = np.unravel_index(np.arange(int(np.prod(sizes)), dtype=np.int64), sizes)
    return [np.asarray(g, dtype=np.int64) for g in grids]


def bounded_counts(layouts: list[TableLayout], codes: dict[str, np.ndarray], sizes: list[int],
                   units: pa.Array | pa.ChunkedArray | None, k: int, subkey: bytes) -> list[np.ndarray]:
    """True counts of every table over records that hold all records of their units (a partition).

    Privacy: with `units`, each unit's records are first bounded to k (`bound_contributions`);
    with None every record is its own unit and is counted as is.
    """
    n_rows = len(next(iter(codes.values()))) if codes else 0
    if units is not None and n_rows:
        columns = list(codes)
        keep = bound_contributions(units, record_keys([codes[c] for c in columns], sizes), k, subkey)
        codes = {c: values[keep] for c, values in codes.items()}
        n_rows = int(keep.sum())
    return [layout.count(codes, n_rows) for layout in layouts]
