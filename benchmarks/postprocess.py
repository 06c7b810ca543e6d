"""Post-processing at census scale: a synthetic 5-level hierarchy with 1M, 2M and 4M leaf cells.

nation > 50 states > 3,000 counties > 75,000 tracts > N blocks; each level measured with its
own discrete-Gaussian-like noise variance. Times the full post-processing (least squares on the
tree, then top-down nonnegative integer fitting) in-process, per size, to show linear cost.
Usage: python benchmarks/postprocess.py [N ...]
"""
from __future__ import annotations

import sys
import time

import numpy as np

from dprelease.transforms.postprocess import hierarchical_least_squares, top_down_hierarchy

FANOUT_UNITS = [1, 50, 3000, 75000]
VARIANCES = [16.0, 16.0, 16.0, 16.0, 16.0]


def tree(leaves: int, rng) -> list[np.ndarray]:
    """Parent maps of the 5 levels (None for the nation), uneven sizes."""
    sizes = FANOUT_UNITS + [leaves]
    maps = [None]
    for parent_units, units in zip(sizes[:-1], sizes[1:]):
        mapping = np.sort(np.concatenate([np.arange(parent_units), rng.integers(0, parent_units, units - parent_units)]))
        maps.append(mapping)
    return maps


def main(sizes: list[int]) -> None:
    rng = np.random.default_rng(0)
    for leaves in sizes:
        maps = tree(leaves, rng)
        truth = [rng.poisson(3.0, leaves).astype(float)]
        for mapping, units in zip(maps[:0:-1], FANOUT_UNITS[::-1]):
            truth.insert(0, np.bincount(mapping, truth[0], units))
        noisy = [(t + rng.normal(0, 4, t.shape)).reshape(-1, 1) for t in truth]
        start = time.perf_counter()
        estimates = hierarchical_least_squares(noisy, VARIANCES, maps)
        mid = time.perf_counter()
        final = top_down_hierarchy(estimates, maps)
        end = time.perf_counter()
        cells = sum(t.size for t in truth)
        print(f"{leaves:>9,} leaf cells ({cells:,} in all): least squares {mid - start:6.2f} s, "
              f"nonnegative integers {end - mid:6.2f} s, total {end - start:6.2f} s "
              f"({cells / (end - start) / 1e6:.2f} M cells/s)")
        for level, (f, t, n) in enumerate(zip(final, truth, noisy)):
            if level in (0, 4):
                print(f"    level {level}: MAE raw {np.abs(n.ravel() - t).mean():.3f} "
                      f"post-processed {np.abs(f.ravel() - t).mean():.3f}")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1_000_000, 2_000_000, 4_000_000])
