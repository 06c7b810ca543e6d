"""Post-processing at census scale: a synthetic 5-level geography with 1M, 2M and 4M leaf cells.

nation > 50 states > 3,000 counties > 75,000 tracts > N blocks, uneven fan-out; each level measured
with integer noise of variance 16 (as a discrete Gaussian of sigma 4 gives). Times, in-process and per
size, the global least-squares estimate (the release's kernel: sparse conjugate gradients over every
link), the nonnegative integer step (top-down fitting and controlled rounding), and the exact per-cell
GLS variances; prints the peak resident memory and, per level, the mean squared error per cell of the
raw measurements, the GLS estimate and the published integers, with the variance the plan predicts.
Usage: python benchmarks/postprocess.py [N ...]
"""
from __future__ import annotations

import resource
import sys
import time

import numpy as np

from dprelease.transforms.domains import Dimension, GeographyDomain
from dprelease.transforms.estimation import CountTable, generalised_least_squares, gls_variances
from dprelease.transforms.postprocess import top_down_hierarchy

UNITS = [50, 3000, 75000]
LEVELS = ["nation", "state", "county", "tract", "block"]
WIDTHS = [("state", 2), ("county", 5), ("tract", 9), ("block", 14)]
NOISE_SD = 4.0


def geography(leaves: int, rng) -> GeographyDomain:
    """Codes SS CCC TTTT BBBBB with every parent holding at least one child, sizes uneven."""
    parents = []
    for parent_units, units in zip([1] + UNITS, UNITS + [leaves]):
        parents.append(np.sort(np.concatenate([np.arange(parent_units),
                                               rng.integers(0, parent_units, units - parent_units)])))
    codes = [np.asarray([f"{i:02d}" for i in range(UNITS[0])])]
    for parent, digits in zip(parents[1:], (3, 4, 5)):
        rank = np.arange(parent.size) - np.searchsorted(parent, parent)
        codes.append(np.char.add(codes[-1][parent], np.char.zfill(rank.astype(str), digits)))
    return GeographyDomain("geo", tuple(WIDTHS), tuple(codes[-1].tolist()), "drop")


def main(sizes: list[int]) -> None:
    rng = np.random.default_rng(0)
    for leaves in sizes:
        geo = geography(leaves, rng)
        geographies = {"geo": geo}
        tables = [CountTable(level, (Dimension("geo", level, geo.level_size(level)),), NOISE_SD ** 2) for level in LEVELS]
        maps = [None] + [geo.parent_of(LEVELS[i], LEVELS[i - 1]) for i in range(1, len(LEVELS))]
        truth = [rng.poisson(3.0, leaves)]
        for mapping, units in zip(maps[:0:-1], ([1] + UNITS)[::-1]):
            truth.insert(0, np.bincount(mapping, truth[0], units).astype(np.int64))
        noisy = [t + np.rint(rng.normal(0, NOISE_SD, t.shape)).astype(np.int64) for t in truth]
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.perf_counter()
        estimates = generalised_least_squares(tables, noisy, geographies)
        solved = time.perf_counter()
        final = top_down_hierarchy([e.reshape(-1, 1) for e in estimates], maps)
        rounded = time.perf_counter()
        variances, exact = gls_variances(tables, geographies)
        end = time.perf_counter()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        cells = sum(t.size for t in truth)
        print(f"{leaves:>9,} leaf cells ({cells:,} in all): GLS {solved - start:5.2f} s, integer step "
              f"{rounded - solved:5.2f} s, variances {end - rounded:5.2f} s, total {end - start:5.2f} s; "
              f"peak RSS {peak / 1024:,.0f} MiB ({before / 1024:,.0f} MiB before)")
        print(f"    {'level':8s} {'cells':>10s} {'MSE raw':>9s} {'GLS':>9s} {'published':>10s} "
              f"{'GLS predicted':>14s} ({'exact' if exact else 'upper bound'})")
        for level, t, n, e, f, v in zip(LEVELS, truth, noisy, estimates, final, variances):
            mse = [np.mean((np.asarray(x, dtype=np.float64).ravel() - t) ** 2) for x in (n, e, f)]
            flag = "  WORSE than raw" if mse[2] > mse[0] else ""
            print(f"    {level:8s} {t.size:>10,} {mse[0]:>9.3f} {mse[1]:>9.3f} {mse[2]:>10.3f} {v.mean():>14.3f}{flag}")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1_000_000, 2_000_000, 4_000_000])
