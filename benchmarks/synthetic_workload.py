"""A workload that is not every marginal alike: synthetic UCI Adult for the statistics about one target
attribute (income > 50K), with and without telling the selection so (`workload:` of a `select: mst` query).

Workloads: every 2-way and every 3-way marginal that contains the target (13 and 78 of them). Per epsilon
in {0.3, 1, 3} at delta = 1e-9 (as rho, like `synthetic_adult.py`) and per key: one `select: mst` release of
all 14 attributes without a workload, one whose workload lists the 13 target pairs (weight 1 each: every
target pair then weighs 7 times an other pair) and one whose workload lists the 78 target triples (a target
pair weighs 15, an other pair 4), each followed by `synthesize`. Error: the mean over
the workload's marginals of the L1 distance between the normalised tabulations of the synthetic and the
true records (the measure of `synthetic_adult.py`). Every run gets a fresh key; the three modes of a repeat
run in the same process one after the other, so their mean errors and times compare like for like.
Evaluation only: it reads the true data.
Usage: python benchmarks/synthetic_workload.py [--repeats 5] [--epsilons 0.3,1,3] [--target income>50K]
"""
from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import numpy as np

from dprelease.accounting.conversions import approx_to_zcdp

from synthetic_adult import DELTA, marginal, run_dprelease, true_records


def target_workload(columns: list[str], target: str, way: int) -> list[tuple[int, ...]]:
    """Every `way`-way combination of the columns' indices that contains the target's."""
    t = columns.index(target)
    return [c for c in itertools.combinations(range(len(columns)), way) if t in c]


def error_on(records: np.ndarray, truth: np.ndarray, sizes: list[int], workload: list[tuple[int, ...]]) -> float:
    return float(np.mean([np.abs(marginal(records, list(w), sizes) - marginal(truth, list(w), sizes)).sum()
                          for w in workload]))


def synthetic(rho: Fraction, columns: list[str], work: Path, release_id: str, workload: list | None) -> np.ndarray:
    from dprelease.pipelines.synthesize import synthesize

    query = {"name": "m", "kind": "marginals", "attributes": columns, "way": 2, "select": "mst"}
    if workload is not None:
        query["workload"] = workload
    records = synthesize(run_dprelease(rho, columns, work, release_id, [query])).records
    return np.stack([np.asarray(records.column(c).to_pylist(), dtype=np.int64) for c in columns], axis=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epsilons", default="0.3,1,3")
    parser.add_argument("--target", default="income>50K")
    args = parser.parse_args()
    truth, columns, domain = true_records()
    sizes = [domain[c] for c in columns]
    workloads = {way: target_workload(columns, args.target, way) for way in (2, 3)}
    modes = [("all pairs alike", None)] + [
        (f"{way}-way workload", [{"attributes": [columns[i] for i in w]} for w in workloads[way]]) for way in (2, 3)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="synthetic-workload-") as tmp:
        work = Path(tmp)
        for epsilon in [Fraction(e) for e in args.epsilons.split(",")]:
            rho = approx_to_zcdp(epsilon, DELTA)
            for run in range(args.repeats):
                for mode, workload in modes:
                    start = time.perf_counter()
                    records = synthetic(rho, columns, work, f"{mode[:3].strip()}-{float(epsilon)}-{run}", workload)
                    seconds = time.perf_counter() - start
                    row = {"epsilon": float(epsilon), "mode": mode, "run": run, "seconds": seconds,
                           **{f"error_{way}way": error_on(records, truth, sizes, w) for way, w in workloads.items()}}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    print(f"\nworkload: the 2-way / 3-way marginals containing {args.target}")
    print("epsilon  mode              2-way error  3-way error  mean seconds")
    for epsilon in sorted({r["epsilon"] for r in rows}):
        for mode, _ in modes:
            group = [r for r in rows if r["epsilon"] == epsilon and r["mode"] == mode]
            print(f"{epsilon:<8} {mode:<17} {np.mean([r['error_2way'] for r in group]):.4f}       "
                  f"{np.mean([r['error_3way'] for r in group]):.4f}       {np.mean([r['seconds'] for r in group]):.1f}")


if __name__ == "__main__":
    main()
