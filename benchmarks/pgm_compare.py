"""dprelease's global least-squares estimate and published tables against Private-PGM (`mbi`) fitted to
the same raw noisy measurements, on UCI Adult marginals (pure epsilon and zCDP).

Per configuration and key: the total L1 error over all cells of all tables and the mean squared error
per cell, of the raw measurements, the GLS estimate, the published nonnegative integer tables and
mbi's graphical model (mirror descent, its default estimator), with wall times of GLS + integer step
and of mbi. Attribute subsets keep mbi's exact junction tree tractable (all 2-way marginals of 14
attributes make one clique of the whole 14-attribute domain).
Evaluation only: it reads the true counts. Needs `pip install mbi` (JAX); not part of the test run.
Usage: python benchmarks/pgm_compare.py [--repeats R] [--iters N]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import numpy as np
import yaml

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_enable_compilation_cache", False)

import mbi  # noqa: E402

from dprelease.pipelines.engines.embedded import EmbeddedEngine  # noqa: E402
from dprelease.pipelines.plan import build_plan  # noqa: E402
from dprelease.pipelines.postprocessing import least_squares_estimates, post_process  # noqa: E402
from dprelease.pipelines.source import open_input  # noqa: E402
from dprelease.pipelines.spec import load_spec  # noqa: E402
from dprelease.transforms.csprng import ReleaseKey  # noqa: E402

HERE = Path(__file__).resolve().parent
ADULT = HERE.parent / "examples" / "adult" / "spec.yaml"
DATA = HERE.parent.parent / "shared" / "data" / "adult" / "adult.csv"
CONFIGS = [
    ("2-way, 6 attributes, pure eps=1", ["age", "workclass", "education-num", "marital-status", "sex", "income>50K"],
     2, {"definition": "pure", "epsilon": 1}),
    ("2-way, 6 attributes, zCDP rho=1/8", ["age", "workclass", "education-num", "marital-status", "sex", "income>50K"],
     2, {"definition": "zcdp", "rho": "1/8", "delta": 1e-9}),
    ("3-way, 5 attributes, pure eps=1", ["workclass", "education-num", "marital-status", "sex", "income>50K"],
     3, {"definition": "pure", "epsilon": 1}),
    ("3-way, 5 attributes, zCDP rho=1/8", ["workclass", "education-num", "marital-status", "sex", "income>50K"],
     3, {"definition": "zcdp", "rho": "1/8", "delta": 1e-9}),
]


def spec_file(attributes: list[str], way: int, budget: dict, out: Path) -> Path:
    document = yaml.safe_load(ADULT.read_text())
    document["input"]["path"] = str(DATA)
    document["budget"] = budget
    document["columns"] = {a: document["columns"][a] for a in attributes}
    document["queries"] = [{"name": "m", "kind": "marginals", "attributes": attributes, "way": way}]
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"adult-{way}way-{budget['definition']}.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def errors(values: dict, truth: dict, tables) -> tuple[float, float]:
    l1 = sum(np.abs(np.asarray(values[t.name], dtype=np.float64) - truth[t.name]).sum() for t in tables)
    squared = np.concatenate([(np.asarray(values[t.name], dtype=np.float64) - truth[t.name]) ** 2 for t in tables])
    return float(l1), float(squared.mean())


def fit_mbi(plan, noisy: dict, iters: int) -> dict:
    sizes = _sizes(plan)
    domain = mbi.Domain(list(sizes), list(sizes.values()))
    measurements = [mbi.LinearMeasurement(np.asarray(noisy[t.name], dtype=np.float64),
                                          tuple(d.column for d in t.dims), stddev=float(np.sqrt(t.noise_variance())))
                    for t in plan.tables]
    model = mbi.estimation.MirrorDescent().estimate(domain, measurements, iters=iters)
    return {t.name: np.asarray(model.project(tuple(d.column for d in t.dims)).datavector()) for t in plan.tables}


def _sizes(plan) -> dict[str, int]:
    return {d.column: d.size for t in plan.tables for d in t.dims}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iters", type=int, default=1000)
    args = parser.parse_args()
    engine = EmbeddedEngine()
    for title, attributes, way, budget in CONFIGS:
        spec, base = load_spec(spec_file(attributes, way, budget, HERE / "out" / "pgm"))
        plan = build_plan(spec, base)
        truth = engine.true_counts(plan, open_input(plan, base, str(DATA)), ReleaseKey.generate(), lambda *a: None)
        totals = {k: np.zeros(2) for k in ("raw", "GLS", "published", "mbi")}
        seconds = {"dprelease": 0.0, "mbi": 0.0}
        for _ in range(args.repeats):
            noise = engine.noise(plan, ReleaseKey.generate(), lambda *a: None)
            noisy = {t.name: truth[t.name] + noise[t.name] for t in plan.tables}
            start = time.perf_counter()
            estimates = least_squares_estimates(plan, noisy)
            published = post_process(plan, noisy)
            seconds["dprelease"] += time.perf_counter() - start
            start = time.perf_counter()
            fitted = fit_mbi(plan, noisy, args.iters)
            seconds["mbi"] += time.perf_counter() - start
            for name, values in (("raw", noisy), ("GLS", estimates), ("published", published), ("mbi", fitted)):
                totals[name] += errors(values, truth, plan.tables)
        cells = sum(t.n_cells for t in plan.tables)
        print(f"{title}: {len(plan.tables)} tables, {cells:,} cells, {args.repeats} keys "
              f"(noise variance per cell {plan.tables[0].noise_variance():.1f})")
        for name, (l1, mse) in totals.items():
            print(f"    {name:10s} total L1 {l1 / args.repeats:12,.0f}   MSE per cell {mse / args.repeats:10.2f}")
        print(f"    time per key: GLS + integer step {seconds['dprelease'] / args.repeats:.2f} s, "
              f"mbi mirror descent ({args.iters} iterations) {seconds['mbi'] / args.repeats:.2f} s")


if __name__ == "__main__":
    main()
