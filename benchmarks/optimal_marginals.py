"""Published marginals measured by the workload-optimal split (`strategy: optimal`, the default) against each
table measured directly with equal shares (`strategy: direct`), on UCI Adult's all-2-way tables
(`examples/adult/spec.yaml`), and against the records of the reference MST (Private-PGM's `mechanisms/mst.py`)
and of dprelease's `select: mst` release in the same run.

Per epsilon (delta = 1e-9; dprelease turns it into rho by its tight conversion, the reference MST by its
own `cdp_rho`) and key: the mean over the 91 2-way tables of the L1 distance between the normalised
published table and the true one (the project's metric), and the expected workload variance from the plan
(sum over the 2-way tables of every cell's raw noise variance, and of its least-squares variance) for both
strategies. The reference MST runs in its own environment (JAX):
  python3.11 -m venv /tmp/pgm-venv && /tmp/pgm-venv/bin/pip install mbi pandas
  python benchmarks/optimal_marginals.py --pgm-python /tmp/pgm-venv/bin/python \\
      --pgm-mechanisms PATH/private-pgm/mechanisms
Evaluation only: it reads the true data.
Usage: python benchmarks/optimal_marginals.py [--repeats 5] [--epsilons 0.3,1,3] [--pgm-python P --pgm-mechanisms D]
"""
from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import synthetic_adult as adult  # noqa: E402

from dprelease.accounting.conversions import approx_to_zcdp  # noqa: E402

REFERENCE_MST = """
import sys
sys.path.insert(0, sys.argv[1])
from mbi import Dataset
from mst import MST
data = Dataset.load(sys.argv[2], sys.argv[3])
MST(data, float(sys.argv[4]), float(sys.argv[5])).df.to_csv(sys.argv[6], index=False)
"""


def published(rho: Fraction, columns: list[str], work: Path, run: str, truth: np.ndarray, sizes: list[int],
              strategy: str) -> tuple[float, float, float]:
    """(mean L1 of the published 2-way tables, raw workload variance, least-squares workload variance)."""
    import pyarrow.parquet as pq

    query = {"name": "m", "kind": "marginals", "attributes": columns, "way": 2, "strategy": strategy}
    root = adult.run_dprelease(rho, columns, work, f"{strategy}-{run}", [query])
    manifest = json.loads((root / "manifest.json").read_text())
    raw = least_squares = 0.0
    errors = []
    for a, b in itertools.combinations(range(len(columns)), 2):
        name = f"m.{columns[a]}-{columns[b]}"
        table = pq.read_table(root / "tables" / f"{name}.parquet")
        counts = table.column("count").to_numpy().astype(np.float64)
        errors.append(np.abs(counts / max(counts.sum(), 1.0) - adult.marginal(truth, [a, b], sizes)).sum())
        record = next(t for t in manifest["tables"] if t["name"] == name)
        raw += record["expected_error"]["variance"] * record["cells"]
        least_squares += record["estimate"]["variance_mean"] * record["cells"]
    return float(np.mean(errors)), raw, least_squares


def reference_mst(epsilon: float, python: str, mechanisms: str, work: Path, truth: np.ndarray,
                  sizes: list[int], columns: list[str]) -> float:
    import pyarrow.csv as pv

    out = work / "mst.csv"
    subprocess.run([python, "-c", REFERENCE_MST, mechanisms, str(adult.DATA), str(adult.DOMAIN), str(epsilon),
                    str(adult.DELTA), str(out)], check=True, capture_output=True)
    table = pv.read_csv(out)
    records = np.stack([table.column(c).to_numpy().astype(np.int64) for c in columns], axis=1)
    return adult.workload_error(records, truth, sizes, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epsilons", default="0.3,1,3")
    parser.add_argument("--pgm-python", help="a Python with Private-PGM's mbi installed")
    parser.add_argument("--pgm-mechanisms", help="Private-PGM's mechanisms/ folder (its mst.py)")
    parser.add_argument("--mst-repeats", type=int, default=2)
    args = parser.parse_args()
    truth, columns, domain = adult.true_records()
    sizes = [domain[c] for c in columns]
    rows = []
    with tempfile.TemporaryDirectory(prefix="optimal-marginals-") as tmp:
        work = Path(tmp)
        for epsilon in [Fraction(e) for e in args.epsilons.split(",")]:
            rho = approx_to_zcdp(epsilon, adult.DELTA)
            for run in range(args.repeats):
                for strategy in ("direct", "optimal"):
                    start = time.perf_counter()
                    error, raw, gls = published(rho, columns, work, f"{float(epsilon)}-{run}", truth, sizes, strategy)
                    rows.append({"epsilon": float(epsilon), "method": strategy, "run": run, "error": error,
                                 "raw_variance": raw, "gls_variance": gls, "seconds": time.perf_counter() - start})
                    print(json.dumps(rows[-1]), flush=True)
            for run in range(args.repeats):  # the records of dprelease's own `select: mst` release, beside them
                start = time.perf_counter()
                records = adult.dprelease_records(rho, columns, work, f"{float(epsilon)}-{run}", "mst")
                rows.append({"epsilon": float(epsilon), "method": "dprelease_mst", "run": run,
                             "error": adult.workload_error(records, truth, sizes, 2),
                             "seconds": time.perf_counter() - start})
                print(json.dumps(rows[-1]), flush=True)
            if args.pgm_python:
                for run in range(args.mst_repeats):
                    start = time.perf_counter()
                    error = reference_mst(float(epsilon), args.pgm_python, args.pgm_mechanisms, work, truth, sizes,
                                          columns)
                    rows.append({"epsilon": float(epsilon), "method": "reference_mst", "run": run, "error": error,
                                 "seconds": time.perf_counter() - start})
                    print(json.dumps(rows[-1]), flush=True)
    print("\nepsilon  method          mean L1 (min-max)        raw variance   GLS variance   seconds")
    for key in sorted({(r["epsilon"], r["method"]) for r in rows}):
        group = [r for r in rows if (r["epsilon"], r["method"]) == key]
        errors = [r["error"] for r in group]
        variances = (f"{np.mean([r['raw_variance'] for r in group]):>13.4g}  {np.mean([r['gls_variance'] for r in group]):>13.4g}"
                     if "raw_variance" in group[0] else f"{'-':>13}  {'-':>13}")
        print(f"{key[0]:<8} {key[1]:<15} {np.mean(errors):.4f} ({min(errors):.4f}-{max(errors):.4f})  {variances}"
              f"  {np.mean([r['seconds'] for r in group]):8.1f}")


if __name__ == "__main__":
    main()
