"""Accuracy of a release's post-processing: per table (per hierarchy level), the mean squared error per
cell of the raw noisy measurements, of the global least-squares estimate (before rounding) and of the
published nonnegative integer tables, with the GLS variance the plan predicts (its mean over cells).
Also the bias the nonnegative step adds on small marginal cells.

Evaluation only: it reads the true counts, which a release never does.
Usage: python benchmarks/accuracy.py [--spec SPEC] [--data FILE | --rows N] [--repeats R]
  (default: the demo spec on 1,000,000 generated rows)
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from dprelease.pipelines.commands import demo_data
from dprelease.pipelines.engines.embedded import EmbeddedEngine
from dprelease.pipelines.plan import build_plan
from dprelease.pipelines.postprocessing import count_tables, estimate_variances, least_squares_estimates, post_process
from dprelease.pipelines.source import open_input
from dprelease.pipelines.spec import load_spec
from dprelease.transforms.csprng import ReleaseKey

HERE = Path(__file__).resolve().parent
DEMO_SPEC = HERE.parent / "examples" / "demo" / "spec.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", type=Path, default=DEMO_SPEC)
    parser.add_argument("--data", type=Path, default=None, help="input file (default: generated demo rows)")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    data = args.data
    if data is None:
        data = HERE / "out" / f"rows-{args.rows}" / "persons.parquet"
        if not data.exists():
            demo_data(args.rows, data.parent)
    spec, base = load_spec(args.spec)
    plan = build_plan(spec, base)
    source = open_input(plan, base, str(data))
    engine = EmbeddedEngine()
    truth = engine.true_counts(plan, source, ReleaseKey.generate(), lambda *a: None)
    tables = count_tables(plan)
    predicted = estimate_variances(plan)
    errors = {t.name: {"raw": [], "gls": [], "published": []} for t in tables}
    small_raw, small_pub = [], []
    for _ in range(args.repeats):
        noise = engine.noise(plan, ReleaseKey.generate(), lambda *a: None)
        noisy = {t.name: truth[t.name] + noise[t.name] if t.name in noise else  # a quantile: not evaluated here
                 np.zeros(t.n_outputs, dtype=np.int64) for t in plan.tables}
        estimates = least_squares_estimates(plan, noisy)
        published = post_process(plan, noisy)
        for t in tables:
            true = truth[t.name].astype(np.float64)
            errors[t.name]["raw"].append(np.mean((noisy[t.name] - true) ** 2))
            errors[t.name]["gls"].append(np.mean((estimates[t.name] - true) ** 2))
            errors[t.name]["published"].append(np.mean((published[t.name] - true) ** 2))
            if t.kind == "marginals":
                small = truth[t.name] <= 5
                small_raw.append((noisy[t.name] - true)[small])
                small_pub.append((published[t.name] - true)[small])
    kind = "exact" if predicted.exact else "upper bound"
    print(f"{args.spec.name}, {args.repeats} keys: mean squared error per cell")
    print(f"{'table':34s} {'cells':>8s} {'raw':>9s} {'GLS':>9s} {'published':>10s} {'GLS predicted':>14s}  worse than raw?")
    worse = 0
    for t in tables:
        e = {k: float(np.mean(v)) for k, v in errors[t.name].items()}
        flag = "WORSE" if e["published"] > e["raw"] else ""
        worse += bool(flag)
        print(f"{t.name:34s} {t.n_cells:>8,} {e['raw']:>9.3f} {e['gls']:>9.3f} {e['published']:>10.3f} "
              f"{predicted.per_cell[t.name].mean():>14.3f}  {flag}")
    print(f"GLS variance ({kind}) predicted from the plan; published worse than raw in {worse} of {len(tables)} tables")
    if small_raw:
        raw, pub = np.concatenate(small_raw), np.concatenate(small_pub)
        print(f"marginal cells with true count <= 5 ({raw.size // args.repeats:,} per release): "
              f"mean error raw {raw.mean():+.3f}, published {pub.mean():+.3f} (bias of the nonnegative step)")


if __name__ == "__main__":
    main()
