"""The graphical-model estimator (`transforms/units/graphical.py`) against Private-PGM's (`mbi`'s
`estimation.mirror_descent`, the reference implementation) on the same noisy measurements, in the same run.

Measurements: UCI Adult's 14 1-way tables and the K pairs of highest mutual information (computed from the
data: this benchmarks the estimator, not a selection) kept while the model stays within 2^20 cells, so the
pairs close cycles; every table with Gaussian noise of the standard deviation that spends rho (from epsilon at
delta = 1e-9) equally over them, one noise draw per seed shared by both estimators. Each estimator runs the
same iterations from zero potentials with its own line search (the reference after one untimed 2-iteration
call that compiles it); reported: wall seconds of the fit, the loss
sum ||mu_m - y_m||^2 / 2 over the measurements (equal variances, so both minimise the same loss), and the mean
L1 distance of the model's 91 normalised 2-way tables to the true ones (the project's workload metric).
The reference runs in its own environment (JAX):
  python3.11 -m venv /tmp/pgm-venv && /tmp/pgm-venv/bin/pip install mbi pandas
Usage: python benchmarks/graphical_fit.py --pgm-python /tmp/pgm-venv/bin/python [--pairs 13,26]
       [--iterations 250,1000] [--seeds 2] [--epsilon 1]
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import subprocess
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import numpy as np

import synthetic_adult as adult
from dprelease.accounting.conversions import approx_to_zcdp
from dprelease.transforms.units import graphical

MODEL_CELLS = 1 << 20

REFERENCE = r"""
import json, sys, time
import numpy as np
from mbi import Domain, LinearMeasurement, estimation
work = sys.argv[1]
spec = json.load(open(work + "/spec.json"))
data = np.load(work + "/measurements.npz")
domain = Domain(spec["attributes"], [spec["sizes"][a] for a in spec["attributes"]])
measurements = [LinearMeasurement(data[f"m{i}"].ravel(), tuple(c), stddev=spec["sigma"])
                for i, c in enumerate(spec["cliques"])]
out = {}
estimation.mirror_descent(domain, measurements, iters=2, known_total=spec["total"])  # compiles: not timed
for iterations in spec["iterations"]:
    start = time.perf_counter()
    model = estimation.mirror_descent(domain, measurements, iters=iterations, known_total=spec["total"])
    seconds = time.perf_counter() - start
    tables = {"-".join(p): np.asarray(model.project(tuple(p)).datavector()).tolist() for p in spec["pairs"]}
    out[str(iterations)] = {"seconds": seconds, "tables": tables}
json.dump(out, open(work + "/reference.json", "w"))
"""


def mutual_information(truth: np.ndarray, a: int, b: int, sizes: list[int]) -> float:
    joint = adult.marginal(truth, [a, b], sizes).reshape(sizes[a], sizes[b])
    product = joint.sum(axis=1, keepdims=True) * joint.sum(axis=0, keepdims=True)
    mask = joint > 0
    return float((joint[mask] * np.log(joint[mask] / product[mask])).sum())


def chosen_pairs(truth: np.ndarray, columns: list[str], sizes: dict[str, int], count: int) -> list[tuple[str, str]]:
    """The `count` pairs of highest mutual information, each kept while the model stays within MODEL_CELLS."""
    width = [sizes[c] for c in columns]
    ranked = sorted(itertools.combinations(range(len(columns)), 2),
                    key=lambda p: -mutual_information(truth, p[0], p[1], width))
    kept: list[tuple[str, str]] = []
    for a, b in ranked:
        pair = (columns[a], columns[b])
        ones = [(c,) for c in columns]
        if graphical.junction_tree(columns, ones + kept + [pair], sizes).cells(sizes) <= MODEL_CELLS:
            kept.append(pair)
        if len(kept) == count:
            break
    return kept


def pair_error(tables: dict[str, np.ndarray], truth: np.ndarray, columns: list[str], sizes: list[int]) -> float:
    errors = []
    for a, b in itertools.combinations(range(len(columns)), 2):
        table = np.maximum(np.asarray(tables[f"{columns[a]}-{columns[b]}"], dtype=np.float64).ravel(), 0.0)
        errors.append(np.abs(table / max(table.sum(), 1.0) - adult.marginal(truth, [a, b], sizes)).sum())
    return float(np.mean(errors))


def loss(tables: dict[str, np.ndarray], measured: list[tuple[tuple[str, ...], np.ndarray]]) -> float:
    return float(sum(0.5 * np.sum((np.asarray(tables["-".join(c)]).ravel() - y.ravel()) ** 2) for c, y in measured))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pgm-python", help="a Python with Private-PGM's mbi installed (omit: dprelease only)")
    parser.add_argument("--pairs", default="13,26")
    parser.add_argument("--iterations", default="250,1000")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--epsilon", default="1")
    args = parser.parse_args()
    truth, columns, domain = adult.true_records()
    width = [domain[c] for c in columns]
    rho = float(approx_to_zcdp(Fraction(args.epsilon), adult.DELTA))
    iterations = [int(i) for i in args.iterations.split(",")]
    all_pairs = list(itertools.combinations(columns, 2))
    for count in [int(k) for k in args.pairs.split(",")]:
        pairs = chosen_pairs(truth, columns, domain, count)
        cliques = [(c,) for c in columns] + pairs
        sigma = math.sqrt(len(cliques) / (2 * rho))
        tree = graphical.junction_tree(columns, cliques, domain)
        for seed in range(args.seeds):
            rng = np.random.default_rng(seed)
            exact = [adult.marginal(truth, [columns.index(a) for a in c], width) * truth.shape[0] for c in cliques]
            noisy = [e + rng.normal(0, sigma, size=e.shape) for e in exact]
            measured = list(zip(cliques, noisy))
            total = float(np.mean([y.sum() for y in noisy]))
            for count_iterations in iterations:
                start = time.perf_counter()
                model = graphical.fit(tree, domain, [graphical.Measurement(c, y.reshape((1,) + tuple(domain[a] for a in c)),
                                                                           sigma ** 2) for c, y in measured],
                                      np.array([total]), count_iterations)
                seconds = time.perf_counter() - start
                marginals = model.marginals()
                tables = {"-".join(p): model.table(p, marginals)[0] for p in all_pairs + cliques}
                print(json.dumps({"pairs": count, "model_cells": tree.cells(domain), "seed": seed,
                                  "iterations": count_iterations, "method": "dprelease",
                                  "seconds": round(seconds, 2), "loss": round(loss(tables, measured), 1),
                                  "error_2way": round(pair_error(tables, truth, columns, width), 4)}), flush=True)
            if args.pgm_python:
                with tempfile.TemporaryDirectory() as tmp:
                    np.savez(Path(tmp) / "measurements.npz", **{f"m{i}": y for i, y in enumerate(noisy)})
                    (Path(tmp) / "spec.json").write_text(json.dumps({
                        "attributes": columns, "sizes": domain, "cliques": cliques, "sigma": sigma,
                        "total": total, "iterations": iterations, "pairs": all_pairs + cliques}))
                    subprocess.run([args.pgm_python, "-c", REFERENCE, tmp], check=True)
                    found = json.loads((Path(tmp) / "reference.json").read_text())
                for count_iterations in iterations:
                    row = found[str(count_iterations)]
                    print(json.dumps({"pairs": count, "model_cells": tree.cells(domain), "seed": seed,
                                      "iterations": count_iterations, "method": "reference",
                                      "seconds": round(row["seconds"], 2),
                                      "loss": round(loss(row["tables"], measured), 1),
                                      "error_2way": round(pair_error(row["tables"], truth, columns, width), 4)}),
                          flush=True)


if __name__ == "__main__":
    main()
