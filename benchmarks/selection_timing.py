"""Does a quantile selection's running time depend on the confidential values? (issue 18, item 6)

Releases one quantile table of CELLS cells over CANDIDATES public candidates with the exact exponential
mechanism (the release path's `release_range`: integer scores from the cells' bucket counts, then the
selection kernel), for one of three data shapes of the same size:
  concentrated  every cell's RECORDS values at one candidate (a single candidate scores low: the
                unpadded rejection sampler needs about CANDIDATES proposals per cell)
  spread        every cell's values spread evenly over the candidates (many candidates score low)
  single        one record per cell (scores differ by a few units: exponents near 1, the costliest acceptance)
  empty         no records (every candidate scores 0: the first proposal is accepted)
Run it as a whole process per shape and compare the times (a ratio near 1 is the goal):

    python benchmarks/selection_timing.py concentrated
"""
from __future__ import annotations

import sys
import time
from fractions import Fraction

import numpy as np

from dprelease.accounting.mechanisms import calibrate_selection
from dprelease.transforms.csprng import ReleaseKey
from dprelease.transforms.release_values import TableRelease, release_range

CELLS = 900
CANDIDATES = 10_000
RECORDS = 1_000_000


def buckets(shape: str) -> np.ndarray:
    """Per cell, the counts in the 2m + 1 buckets around the m candidates (below c0, at c0, between, ...)."""
    width = 2 * CANDIDATES + 1
    counts = np.zeros((CELLS, width), dtype=np.int64)
    if shape == "concentrated":
        counts[:, 2 * (CANDIDATES // 2) + 1] = RECORDS
    elif shape == "spread":
        counts[:, 1:width:2] = RECORDS // CANDIDATES
    elif shape == "single":
        counts[:, 2 * (CANDIDATES // 2) + 1] = 1
    elif shape != "empty":
        raise SystemExit(f"shape must be concentrated, spread or empty, not {shape!r}")
    return counts.ravel()


def main(shape: str) -> None:
    mechanism = calibrate_selection(Fraction(1, 2), 1, "pure", "bench")
    release = TableRelease("q", CELLS * (2 * CANDIDATES + 1), mechanism, 2 * CANDIDATES + 1, (Fraction(1, 2),),
                           tuple(range(CANDIDATES)), (1,))
    measured = buckets(shape)
    started = time.perf_counter()
    chosen = release_range(ReleaseKey(b"b" * 32), release, 0, release.n_measured, measured)
    print(f"{shape}: {CELLS} cells x {CANDIDATES} candidates selected in {time.perf_counter() - started:.2f} s "
          f"(median choice {int(np.median(chosen))})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "concentrated")
