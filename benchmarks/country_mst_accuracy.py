"""Accuracy of `select: mst` and `select: aim` within county at a country's scale, against measuring every pair:
after `benchmarks/country_mst.sh` made the releases (country_mst_spec.yaml, its `select: aim` and `select: all`
twins), the L1
error of every 2-way table within county (10 pairs of age, income, sex, race, ethnicity; 3,577 counties),
summed over cells and counties and divided by the population, for
  - the `select: all` release's published tables (every pair measured at 1/10 of the query's budget);
  - the MST and AIM releases' synthetic records (`dprelease synthesize`), tabulated (MST: 4 pairs measured, 6 from
    the tree; AIM: 4 tables of 2 or 3 attributes measured);
against the true tables of the bounded records (the embedded engine's exact counts).
Usage: python benchmarks/country_mst_accuracy.py [ROWS]   (default 10000000; run from anywhere)
"""
from __future__ import annotations

import itertools
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
    manifest = json.loads((all_dir / "manifest.json").read_text())
    selected = {name: out / "releases" / f"country-{name}-2026" for name in ("mst", "aim")}
    selected = {name: path for name, path in selected.items() if (path / "manifest.json").exists()}
    chosen, tabulated = {}, {}
    for name, path in selected.items():
        record = json.loads((path / "manifest.json").read_text())["selections"][0]
        chosen[name] = {f"county.{a}-{b}" for c in record["chosen"] for a, b in itertools.combinations(c, 2)}
        with tempfile.TemporaryDirectory() as scratch:
            synthetic = Path(scratch) / "records.parquet"
            start = time.perf_counter()
            subprocess.run(["dprelease", "synthesize", str(path), "--out", str(synthetic)], check=True,
                           stdout=subprocess.DEVNULL)
            print(f"synthesize {name}: {time.perf_counter() - start:.1f} s")
            records = pq.read_table(synthetic)
        tabulated[name] = {table.name: tabulate(records, plan, table) for table in pairs}
    print(f"{'pair':28s} {'all 2-way':>10s} " + " ".join(f"{n:>10s}" for n in selected)
          + "  (L1 / population; * the pair is a margin of a table the selection measured)")
    errors: dict[str, list] = {"all": [], **{n: [] for n in selected}}
    for table in pairs:
        published = read_table(all_dir, manifest, table.name).column("count").to_numpy()
        errors["all"].append(np.abs(published - truth[table.name]).sum() / population)
        line = f"{table.name:28s} {errors['all'][-1]:10.4f}"
        for name in selected:
            errors[name].append(np.abs(tabulated[name][table.name] - truth[table.name]).sum() / population)
            line += f" {errors[name][-1]:9.4f}{'*' if table.name in chosen[name] else ' '}"
        print(line)
    print("mean over the 10 pairs: " + ", ".join(f"{n} {np.mean(e):.4f}" for n, e in errors.items())
          + f"; population {population:,}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10_000_000)
