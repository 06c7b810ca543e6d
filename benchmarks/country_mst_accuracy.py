"""Accuracy of `select: mst` within county at a country's scale, against measuring every pair: after
`benchmarks/country_mst.sh` made both releases (country_mst_spec.yaml and its `select: all` twin), the L1
error of every 2-way table within county (10 pairs of age, income, sex, race, ethnicity; 3,577 counties),
summed over cells and counties and divided by the population, for
  - the `select: all` release's published tables (every pair measured at 1/10 of the query's budget);
  - the MST release's synthetic records (`dprelease synthesize`), tabulated (4 pairs measured, 6 from the tree);
against the true tables of the bounded records (the embedded engine's exact counts).
Usage: python benchmarks/country_mst_accuracy.py [ROWS]   (default 10000000; run from anywhere)
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dprelease.pipelines.engines.embedded import EmbeddedEngine
from dprelease.pipelines.error_columns import read_table
from dprelease.pipelines.plan import build_plan
from dprelease.pipelines.run import bind_release_key
from dprelease.pipelines.source import open_input
from dprelease.pipelines.spec import load_spec
from dprelease.transforms.csprng import ReleaseKey
from dprelease.transforms.domains import dimension_labels

HERE = Path(__file__).resolve().parent


def true_tables(spec_path: Path, input_path: str) -> tuple[object, dict[str, np.ndarray]]:
    """The plan of the `select: all` spec and the exact counts of its tables (the bounded records)."""
    spec, base = load_spec(spec_path)
    plan = build_plan(spec, base)
    source = open_input(plan, base, input_path)
    key, _ = bind_release_key(ReleaseKey.generate(), plan, source)
    return plan, EmbeddedEngine(workers=1).true_counts(plan, source, key, lambda *_: None)


def tabulate(records: pa.Table, plan, table) -> np.ndarray:
    """Counts of the records over a table's cells (labels matched to the public domain, in cell order)."""
    codes = []
    for dim in table.dims:
        labels = pa.array(dimension_labels(plan.domains[dim.column], dim), pa.string())
        codes.append(pc.index_in(records.column(dim.output_name).cast(pa.string()), value_set=labels)
                     .to_numpy(zero_copy_only=False))
    sizes = [d.size for d in table.dims]
    flat = np.ravel_multi_index(tuple(np.asarray(c, dtype=np.int64) for c in codes), sizes)
    return np.bincount(flat, minlength=int(np.prod(sizes)))


def main(rows: int) -> None:
    out = HERE / "out"
    data = out / f"country-{rows}" / "persons.parquet"
    plan, truth = true_tables(out / "country_all_spec.yaml", str(data))
    population = truth["population.nation"].sum()
    pairs = [t for t in plan.tables if t.query == "county"]
    all_dir = out / "releases" / "country-all-2026"
    mst_dir = out / "releases" / "country-mst-2026"
    manifest = json.loads((all_dir / "manifest.json").read_text())
    mst_manifest = json.loads((mst_dir / "manifest.json").read_text())
    chosen = {"county." + "-".join(pair) for s in mst_manifest["selections"] for pair in s["chosen"]}
    with tempfile.TemporaryDirectory() as scratch:
        synthetic = Path(scratch) / "records.parquet"
        start = time.perf_counter()
        subprocess.run(["dprelease", "synthesize", str(mst_dir), "--out", str(synthetic)], check=True,
                       stdout=subprocess.DEVNULL)
        print(f"synthesize: {time.perf_counter() - start:.1f} s")
        records = pq.read_table(synthetic)
    print(f"{'pair':28s} {'all 2-way':>10s} {'MST':>10s}  (L1 / population; MST measured the pair: *)")
    errors = {"all": [], "mst": [], "mst_measured": [], "mst_tree": []}
    for table in pairs:
        published = read_table(all_dir, manifest, table.name).column("count").to_numpy()
        mst = tabulate(records, plan, table)
        e_all = np.abs(published - truth[table.name]).sum() / population
        e_mst = np.abs(mst - truth[table.name]).sum() / population
        errors["all"].append(e_all)
        errors["mst"].append(e_mst)
        errors["mst_measured" if table.name in chosen else "mst_tree"].append(e_mst)
        print(f"{table.name:28s} {e_all:10.4f} {e_mst:10.4f}  {'*' if table.name in chosen else ''}")
    print(f"mean over the 10 pairs: all 2-way {np.mean(errors['all']):.4f}, MST {np.mean(errors['mst']):.4f} "
          f"(measured pairs {np.mean(errors['mst_measured']):.4f}, tree pairs {np.mean(errors['mst_tree']):.4f}); "
          f"population {population:,}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10_000_000)
