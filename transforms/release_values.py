"""From a table's true measurement vector to its released values, one range of cells at a time.

Additive tables (counts, sums, unit counts) release measurement + noise(key, table, cell); an
invariant releases the measurement itself. A quantile table releases, per (cell, q), one public
candidate chosen by the exponential mechanism on integer scores computed from the cell's bucket
counts, its randomness from its own stream (key, table, q) at lane `cell`.

Privacy: a released value depends only on (key, table, cell) and the true measurement of that cell,
so any split into ranges, worker or engine releases the same bytes; the engines hand `release_range`
whole cells (a quantile range never splits a cell's buckets).
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from typing import Iterable

import numpy as np

from .csprng import CellStream
from .samplers import select_cells, table_noise


@dataclass(frozen=True)
class TableRelease:
    """What a worker needs to release a range of one table: its name, measurement length, mechanism
    (None for an invariant) and, for a quantile table, its buckets, quantiles, candidates and the score
    sensitivity of each quantile."""

    name: str
    n_measured: int
    mechanism: object | None
    buckets: int = 1
    quantiles: tuple[Fraction, ...] = ()
    candidates: tuple[int, ...] = ()
    score_sensitivities: tuple[int, ...] = ()

    @property
    def selects(self) -> bool:
        return bool(self.quantiles)

    @property
    def n_outputs(self) -> int:
        """Released values: one per cell, or one per (cell, quantile) in cell-major order."""
        return self.n_measured // self.buckets * len(self.quantiles) if self.selects else self.n_measured

    def range_length(self, target: int) -> int:
        """A range length near `target` that holds whole cells."""
        return max(1, target // self.buckets) * self.buckets

    def range_count(self, step: int) -> int:
        """How many ranges of `step` measured entries the table has (every one is processed, empty or not)."""
        return -(-self.n_measured // step)

    def output_start(self, start: int) -> int:
        """Where the released values of the range starting at `start` begin."""
        return start // self.buckets * len(self.quantiles) if self.selects else start


def quantile_scores(buckets: np.ndarray, q: Fraction) -> np.ndarray:
    """Scores (lower is better) of every candidate of every cell: |(b - a) * below - a * above| for q = a/b,
    below/above the cell's values strictly below/above the candidate. `buckets`: (cells, 2m + 1) counts."""
    cumulative = np.cumsum(buckets, axis=1)
    total = cumulative[:, -1:]
    below = cumulative[:, 0:-1:2]  # buckets 0 .. 2j: values below candidate j
    at = buckets[:, 1::2]
    above = total - below - at
    a, b = q.numerator, q.denominator
    return np.abs((b - a) * below - a * above)


def quantile_stream(key, table: str, index: int) -> CellStream:
    """The keystream of a quantile table's `index`-th quantile: lane c belongs to cell c."""
    return CellStream(key.derive(f"dprelease/select/{table}/{index}"))


def release_range(key, release: TableRelease, start: int, stop: int, measured: np.ndarray) -> np.ndarray:
    """Released values of measurement range [start, stop) given its true values `measured` (dense)."""
    measured = np.asarray(measured, dtype=np.int64)
    if release.selects:
        return _select_range(key, release, start, stop, measured)
    if release.mechanism is None:
        return measured.copy()
    return measured + table_noise(key, release.name, release.mechanism, start, stop)


def release_table(key, release: TableRelease, measured: np.ndarray, range_target: int) -> np.ndarray:
    """Released values of a whole table, range by range (the same values as any other split)."""
    step = release.range_length(range_target)
    return np.concatenate([release_range(key, release, start, min(start + step, release.n_measured),
                                         measured[start:start + step])
                           for start in range(0, release.n_measured, step)])


def _select_range(key, release: TableRelease, start: int, stop: int, measured: np.ndarray) -> np.ndarray:
    if start % release.buckets or stop % release.buckets:
        raise ValueError(f"table {release.name}: a selection range must hold whole cells")
    cells = measured.reshape(-1, release.buckets)
    first = start // release.buckets
    candidates = np.asarray(release.candidates, dtype=np.int64)
    out = np.empty((cells.shape[0], len(release.quantiles)), dtype=np.int64)
    for i, (q, sensitivity) in enumerate(zip(release.quantiles, release.score_sensitivities)):
        chosen = select_cells(quantile_stream(key, release.name, i), first, first + cells.shape[0],
                              quantile_scores(cells, q), release.mechanism.epsilon, sensitivity)
        out[:, i] = candidates[chosen]
    return out.ravel()


def dense_parts(start: int, stop: int, parts: Iterable[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Entries [start, stop) of a measurement given as sparse parts (each `(cells, counts)`: absolute indices and
    their counts; repeats, within and across parts, summed; every other entry is 0), added part by part: beyond
    the range, memory holds one part at a time on a runner that streams grouped values (the DirectRunner hands
    them all at once). Shared by the engines that release ranges in workers."""
    measured = np.zeros(stop - start, dtype=np.int64)
    for cells, counts in parts:
        offsets = np.asarray(cells, dtype=np.int64) - start
        if offsets.size and np.all(offsets[1:] > offsets[:-1]):  # distinct cells (the usual part): one add each
            measured[offsets] += np.asarray(counts, dtype=np.int64)
        else:
            np.add.at(measured, offsets, counts)
    return measured


def dense_range(start: int, stop: int, cells: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """`dense_parts` of one part."""
    return dense_parts(start, stop, [(cells, counts)])
