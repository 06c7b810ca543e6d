"""Accuracy of the demo release at rho = 1: mean absolute error per table, raw noisy measurements
vs published (post-processed) tables, and the bias the nonnegative step adds on small cells.

Evaluation only: it reads the true counts, which a release never does.
Usage: python benchmarks/accuracy.py [--rows N] [--repeats R]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from dprelease.examples.generator import write_demo_data
from dprelease.pipelines.engines.embedded import EmbeddedEngine
from dprelease.pipelines.plan import build_plan
from dprelease.pipelines.postprocessing import post_process
from dprelease.pipelines.source import open_input
from dprelease.pipelines.spec import load_spec
from dprelease.transforms.csprng import ReleaseKey

HERE = Path(__file__).resolve().parent
SPEC = HERE.parent / "examples" / "demo" / "spec.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    data = HERE / "out" / f"rows-{args.rows}" / "persons.parquet"
    if not data.exists():
        write_demo_data(data.parent, args.rows)
    spec, base = load_spec(SPEC)
    plan = build_plan(spec, base)
    source = open_input(plan, base, str(data))
    engine = EmbeddedEngine()
    truth = engine.true_counts(plan, source, ReleaseKey.generate(), lambda *a: None)
    raw_err = {t.name: [] for t in plan.tables}
    pub_err = {t.name: [] for t in plan.tables}
    small_raw, small_pub = [], []
    for _ in range(args.repeats):
        key = ReleaseKey.generate()
        noise = engine.noise(plan, key, lambda *a: None)
        noisy = {n: truth[n] + noise[n] for n in truth}
        published = post_process(plan, noisy)
        for t in plan.tables:
            raw_err[t.name].append(np.abs(noisy[t.name] - truth[t.name]).mean())
            pub_err[t.name].append(np.abs(published[t.name] - truth[t.name]).mean())
            if t.kind == "marginals":
                small = truth[t.name] <= 5
                small_raw.append((noisy[t.name] - truth[t.name])[small])
                small_pub.append((published[t.name] - truth[t.name])[small])
    print(f"{'table':34s} {'cells':>8s} {'MAE raw':>9s} {'MAE published':>14s}")
    for t in plan.tables:
        print(f"{t.name:34s} {t.n_cells:>8,} {np.mean(raw_err[t.name]):>9.3f} {np.mean(pub_err[t.name]):>14.3f}")
    raw, pub = np.concatenate(small_raw), np.concatenate(small_pub)
    print(f"marginal cells with true count <= 5 ({raw.size // args.repeats:,} per release): "
          f"mean error raw {raw.mean():+.3f}, published {pub.mean():+.3f} (bias of the nonnegative step)")


if __name__ == "__main__":
    main()
