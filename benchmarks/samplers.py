"""Samples per second of the exact samplers (one process, one core), at several scales."""
from __future__ import annotations

import time
from fractions import Fraction

from dprelease.transforms.csprng import CellStream, ReleaseKey
from dprelease.transforms.samplers import sample_cells

CELLS = 1_000_000


def main() -> None:
    stream = CellStream.for_table(ReleaseKey.generate(), "bench")
    for kind, parameters in (("discrete_laplace", [1, 10, 100, 1000]), ("discrete_gaussian", [1, 100, 10**4, 10**6])):
        for value in parameters:
            start = time.perf_counter()
            sample_cells(stream, 0, CELLS, kind, Fraction(value))
            elapsed = time.perf_counter() - start
            name = "scale" if kind == "discrete_laplace" else "sigma2"
            print(f"{kind:18s} {name}={value:<8} {CELLS / elapsed:>12,.0f} samples/s")


if __name__ == "__main__":
    main()
