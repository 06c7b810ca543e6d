"""Synthetic microdata on UCI Adult at one budget, per method: dprelease (`select: mst` release, then
`synthesize`), dprelease_aim (the same with `select: aim`), OpenDP's MST and AIM (Private-PGM's `mbi`), DataSynthesizer (PrivBayes, degree 2), and the
published mechanism the synthetic data must beat (dprelease's all-2-way marginals release, its published
tables read directly: 2-way workload only), and the records `synthesize` draws from that release
("published_records": a tree of its published tables).

Workloads: all 2-way and all 3-way marginals of the 14 attributes. Error of a method: the mean over the
workload's marginals of the L1 distance between the normalised tabulation of its records (or tables) and
of the true data (twice the total variation distance; 0 is perfect, 2 the worst). Budgets: epsilon in
{0.3, 1, 3} at delta = 1e-9 turned into rho by the tight conversion (dprelease's `approx_to_zcdp`) for
dprelease, MST and AIM; DataSynthesizer takes epsilon itself (pure DP, so it is favoured). Every run gets
a fresh key or seed; the wall time of each run (release + synthesis) is reported beside its error.
Evaluation only: it reads the true data. Needs, in its own environment:
  pip install -e . "opendp[mbi]==0.16.0" pandas datasynthesizer polars
Usage: python benchmarks/synthetic_adult.py [--repeats 5] [--epsilons 0.3,1,3] [--methods dprelease,mst,...]
       [--degree 2]  (DataSynthesizer's network degree)
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import yaml

from dprelease.accounting.conversions import approx_to_zcdp

HERE = Path(__file__).resolve().parent
ADULT_SPEC = HERE.parent / "examples" / "adult" / "spec.yaml"
DATA = HERE.parent.parent / "shared" / "data" / "adult" / "adult.csv"
DOMAIN = DATA.with_name("adult-domain.json")
DELTA = 1e-9
METHODS = ("dprelease", "dprelease_aim", "published", "published_records", "mst", "aim", "datasynthesizer")


def true_records() -> tuple[np.ndarray, list[str], dict[str, int]]:
    import pyarrow.csv as pv

    table = pv.read_csv(DATA)
    sizes = json.loads(DOMAIN.read_text())
    return np.stack([table.column(c).to_numpy() for c in table.column_names], axis=1), table.column_names, sizes


def marginal(records: np.ndarray, columns: list[int], sizes: list[int]) -> np.ndarray:
    index = np.zeros(records.shape[0], dtype=np.int64)
    for c in columns:
        index = index * sizes[c] + records[:, c]
    counts = np.bincount(index, minlength=int(np.prod([sizes[c] for c in columns]))).astype(np.float64)
    return counts / max(counts.sum(), 1.0)


def workload_error(records: np.ndarray, truth: np.ndarray, sizes: list[int], way: int) -> float:
    errors = [np.abs(marginal(records, list(w), sizes) - marginal(truth, list(w), sizes)).sum()
              for w in itertools.combinations(range(truth.shape[1]), way)]
    return float(np.mean(errors))


def spec_document(rho: Fraction, queries: list[dict], release_id: str, out: Path) -> dict:
    document = yaml.safe_load(ADULT_SPEC.read_text())
    document.update(release_id=release_id, budget={"definition": "zcdp", "rho": str(rho), "delta": DELTA},
                    queries=queries, output={"dir": str(out)})
    document["input"]["path"] = str(DATA)
    return document


def run_dprelease(rho: Fraction, columns: list[str], work: Path, release_id: str, queries: list[dict]) -> Path:
    from dprelease.pipelines.run import run_release

    spec = work / f"{release_id}.yaml"
    spec.write_text(yaml.safe_dump(spec_document(rho, queries, release_id, work / "releases"), sort_keys=False))
    return run_release(spec, key_file=work / f"{release_id}.key", ledger=None).release_dir


def dprelease_records(rho: Fraction, columns: list[str], work: Path, run: str, select: str = "mst") -> np.ndarray:
    from dprelease.pipelines.synthesize import synthesize

    root = run_dprelease(rho, columns, work, f"{select}-{run}", [{"name": "m", "kind": "marginals",
                                                                   "attributes": columns, "way": 2, "select": select}])
    records = synthesize(root).records
    return np.stack([np.asarray(records.column(c).to_pylist(), dtype=np.int64) for c in columns], axis=1)


def published_records(rho: Fraction, columns: list[str], work: Path, run: str) -> np.ndarray:
    """Records `synthesize` draws from the all-2-way release (a tree of its published tables)."""
    from dprelease.pipelines.synthesize import synthesize

    root = run_dprelease(rho, columns, work, f"all2r-{run}", [{"name": "m", "kind": "marginals",
                                                                 "attributes": columns, "way": 2}])
    records = synthesize(root).records
    return np.stack([np.asarray(records.column(c).to_pylist(), dtype=np.int64) for c in columns], axis=1)


def published_error(rho: Fraction, columns: list[str], work: Path, run: str, truth: np.ndarray,
                    sizes: list[int]) -> float:
    import pyarrow.parquet as pq

    root = run_dprelease(rho, columns, work, f"all2-{run}", [{"name": "m", "kind": "marginals",
                                                                "attributes": columns, "way": 2}])
    errors = []
    for a, b in itertools.combinations(range(len(columns)), 2):
        table = pq.read_table(root / "tables" / f"m.{columns[a]}-{columns[b]}.parquet")
        counts = table.column("count").to_numpy().astype(np.float64)
        errors.append(np.abs(counts / max(counts.sum(), 1.0) - marginal(truth, [a, b], sizes)).sum())
    return float(np.mean(errors))


def opendp_records(algorithm: str, rho: Fraction, columns: list[str], sizes: dict[str, int], way: int) -> np.ndarray:
    import opendp.prelude as dp
    import polars as pl

    dp.enable_features("contrib")
    frame = pl.read_csv(DATA)
    keys = {c: list(range(sizes[c])) for c in columns}
    chosen = dp.mbi.MST(measure_split=0.875) if algorithm == "mst" else dp.mbi.AIM(queries=way, measure_split=0.875)
    # OpenDP splits the budget in floats and can refuse its own last query by one ulp: a dyadic budget just
    # below rho and a dyadic split (7/8 measuring, near its 0.9 default) keep every split exact
    for attempt in range(8):  # a budget a few ulps lower when OpenDP still refuses its own split
        budget = (math.floor(float(rho) * 2**30) - attempt) / 2**30
        context = dp.Context.compositor(data=frame.lazy(), privacy_unit=dp.unit_of(contributions=1),
                                        privacy_loss=dp.loss_of(rho=budget))
        try:
            table = context.query(rho=budget).select(*columns).contingency_table(keys=keys, algorithm=chosen).release()
            break
        except dp.OpenDPException as error:
            if "insufficient budget" not in str(error) or attempt == 7:
                raise
    synthetic = table.synthesize()
    rng = np.random.default_rng()  # values merged into OpenDP's rare category come back null
    return np.stack([synthetic[c].fill_null(-1).to_numpy().astype(np.int64) for c in columns], axis=1), rng


def filled(records: np.ndarray, rng, sizes: list[int]) -> np.ndarray:
    """Records with every -1 (a null: a value OpenDP merged into its rare category) replaced by a uniform draw
    among the values of the column's public domain that its records never hold (the merged ones), or the
    whole domain when it holds them all."""
    out = records.copy()
    for c, size in enumerate(sizes):
        missing = out[:, c] < 0
        merged = np.setdiff1d(np.arange(size), out[~missing, c])
        pool = merged if merged.size else np.arange(size)
        out[missing, c] = rng.choice(pool, int(missing.sum()))
    return out


def datasynthesizer_records(epsilon: float, columns: list[str], sizes: dict[str, int], work: Path, seed: int,
                            n: int, degree: int = 2) -> np.ndarray:
    import pandas as pd
    from DataSynthesizer.DataDescriber import DataDescriber
    from DataSynthesizer.DataGenerator import DataGenerator

    domain = work / "domains.json"  # public domains: nothing about them is read from the data
    domain.write_text(json.dumps({c: list(range(sizes[c])) for c in columns}))
    describer = DataDescriber(category_threshold=max(sizes.values()) + 1)
    describer.describe_dataset_in_correlated_attribute_mode(
        str(DATA), k=degree, epsilon=epsilon, attribute_to_is_categorical={c: True for c in columns},
        categorical_attribute_domain_file=str(domain), seed=seed)
    description = work / f"description-{seed}.json"
    describer.save_dataset_description_to_file(str(description))
    generator = DataGenerator()
    generator.generate_dataset_in_correlated_attribute_mode(n, str(description), seed=seed)
    frame: pd.DataFrame = generator.synthetic_dataset
    return np.stack([frame[c].to_numpy().astype(np.int64) for c in columns], axis=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epsilons", default="0.3,1,3")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--ways", default="2,3", help="AIM runs once per workload way (its workload)")
    parser.add_argument("--json", type=Path, help="write every run's row here as well")
    parser.add_argument("--degree", type=int, default=2, help="DataSynthesizer's Bayesian network degree k")
    args = parser.parse_args()
    truth, columns, domain = true_records()
    sizes = [domain[c] for c in columns]
    ways = [int(w) for w in args.ways.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="synthetic-adult-") as tmp:
        work = Path(tmp)
        for epsilon in [Fraction(e) for e in args.epsilons.split(",")]:
            rho = approx_to_zcdp(epsilon, DELTA)
            for method in args.methods.split(","):
                for run in range(args.repeats):
                    for way in (ways if method == "aim" else [None]):
                        start = time.perf_counter()
                        if method == "published":
                            errors = {2: published_error(rho, columns, work, f"{float(epsilon)}-{run}", truth, sizes)}
                        else:
                            if method in ("dprelease", "dprelease_aim"):
                                records = dprelease_records(rho, columns, work, f"{float(epsilon)}-{run}",
                                                            "aim" if method == "dprelease_aim" else "mst")
                            elif method == "published_records":
                                records = published_records(rho, columns, work, f"{float(epsilon)}-{run}")
                            elif method in ("mst", "aim"):
                                records = filled(*opendp_records(method, rho, columns, domain, way or 2), sizes)
                            else:
                                records = datasynthesizer_records(float(epsilon), columns, domain, work, run,
                                                                  truth.shape[0], args.degree)
                            errors = {w: workload_error(records, truth, sizes, w) for w in (ways if way is None
                                                                                           else [way])}
                        seconds = time.perf_counter() - start
                        for w, error in errors.items():
                            row = {"epsilon": float(epsilon), "rho": float(rho), "method": method, "run": run,
                                   "way": w, "error": error, "seconds": seconds}
                            rows.append(row)
                            print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print("\nepsilon  method           way  mean error (min-max)      mean seconds")
    for key in sorted({(r["epsilon"], r["method"], r["way"]) for r in rows}):
        group = [r for r in rows if (r["epsilon"], r["method"], r["way"]) == key]
        errors = [r["error"] for r in group]
        print(f"{key[0]:<8} {key[1]:<16} {key[2]:<4} {np.mean(errors):.4f} ({min(errors):.4f}-{max(errors):.4f})"
              f"   {np.mean([r['seconds'] for r in group]):.1f}")


if __name__ == "__main__":
    main()
