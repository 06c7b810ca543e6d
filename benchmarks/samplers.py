"""Samples per second of the exact samplers (one process, one core), beside OpenDP's exact
samplers on the same vector length when OpenDP is installed (`pip install opendp`).

Usage: python benchmarks/samplers.py [--cells N]
"""
from __future__ import annotations

import argparse
import time
from fractions import Fraction

from dprelease.transforms.csprng import CellStream, ReleaseKey
from dprelease.transforms.samplers import sample_cells

SCALES = [1, 10, 100, 1000]


def rate(function, cells: int, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return cells / best


def opendp_samplers(cells: int):
    try:
        import opendp.prelude as dp
    except ImportError:
        return None
    dp.enable_features("contrib")
    zeros = [0] * cells
    domain = dp.vector_domain(dp.atom_domain(T=int))

    def laplace(scale):
        measurement = dp.m.make_laplace(domain, dp.l1_distance(T=int), scale=float(scale))
        return lambda: measurement(zeros)

    def gaussian(scale):
        measurement = dp.m.make_gaussian(domain, dp.l2_distance(T=float), scale=float(scale))
        return lambda: measurement(zeros)

    return {"discrete_laplace": laplace, "discrete_gaussian": gaussian}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cells", type=int, default=1_000_000)
    parser.add_argument("--peer-cells", type=int, default=100_000)
    args = parser.parse_args()
    stream = CellStream.for_table(ReleaseKey.generate(), "bench")
    peer = opendp_samplers(args.peer_cells)
    print(f"{'sampler':18s} {'scale':>6s} {'dprelease /s':>14s} {'OpenDP /s':>12s} {'ratio':>7s}")
    for kind in ("discrete_laplace", "discrete_gaussian"):
        for scale in SCALES:
            parameter = Fraction(scale) if kind == "discrete_laplace" else Fraction(scale * scale)
            ours = rate(lambda: sample_cells(stream, 0, args.cells, kind, parameter), args.cells)
            theirs = rate(peer[kind](scale), args.peer_cells, repeats=1) if peer else float("nan")
            print(f"{kind:18s} {scale:>6d} {ours:>14,.0f} {theirs:>12,.0f} {ours / theirs:>7.1f}")


if __name__ == "__main__":
    main()
