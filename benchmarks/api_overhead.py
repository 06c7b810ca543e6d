"""The Python API on a pandas DataFrame against the same release from the same data written as Parquet.

    python benchmarks/api_overhead.py prepare [ROWS]      # out/api-ROWS/persons.parquet and geography.txt
    python benchmarks/api_overhead.py path [ROWS]         # Release.run(parquet path): what `dprelease run` runs
    python benchmarks/api_overhead.py frame [ROWS]        # Release.run(pandas DataFrame), the frame read first

Each run prints `seconds=<the run call alone>`: the in-process cost of Release.run, excluding interpreter
start, imports and (frame) reading the Parquet file into pandas, which a notebook user has already done.
Time whole processes too (`/usr/bin/time -v`, or any whole-process timer pairing `... frame` against `... path`
or against `dprelease run benchmarks/out/api-ROWS/spec.yaml --no-ledger --overwrite`). The release is the
demo's (examples/demo/spec.yaml) without a ledger, published under out/api-ROWS/releases/, replaced each run.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
DEMO = HERE.parent / "examples" / "demo" / "spec.yaml"


def case_dir(rows: int) -> Path:
    return HERE / "out" / f"api-{rows}"


def prepare(rows: int) -> None:
    directory = case_dir(rows)
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / "persons.parquet").exists():
        subprocess.run(["dprelease", "demo-data", "--rows", str(rows), "--out", str(directory)], check=True)
    spec = yaml.safe_load(DEMO.read_text())
    spec["input"] = {"path": "persons.parquet"}
    spec["columns"]["geo"]["domain_file"] = "geography.txt"
    spec["output"] = {"dir": "releases"}
    (directory / "spec.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))


def run(rows: int, mode: str) -> float:
    import pandas as pd

    import dprelease

    directory = case_dir(rows)
    release = dprelease.Release.from_yaml(directory / "spec.yaml")
    data = pd.read_parquet(directory / "persons.parquet") if mode == "frame" else str(directory / "persons.parquet")
    shutil.rmtree(directory / "releases", ignore_errors=True)
    start = time.perf_counter()
    release.run(data, ledger=None, key_file=directory / "bench.key", overwrite=True)
    return time.perf_counter() - start


if __name__ == "__main__":
    mode = sys.argv[1]
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 1_000_000
    if mode == "prepare":
        prepare(count)
    else:
        print(f"mode={mode} rows={count} seconds={run(count, mode):.3f}")
