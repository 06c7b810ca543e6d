"""End to end through the CLI: the demo release and the Adult release."""
from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.parquet as pq

from .conftest import DEMO_SPEC



def cli(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd)


def test_demo_release_end_to_end(tmp_path):
    data = tmp_path / "data"
    generated = cli("demo-data", "--rows", 50_000, "--out", data)
    assert generated.returncode == 0, generated.stderr
    assert (data / "persons.parquet").is_file() and (data / "geography.txt").is_file()
    assert (data / "geography.txt").read_text() == (DEMO_SPEC.parent / "geography.txt").read_text()
    planned = cli("plan", DEMO_SPEC)
    assert planned.returncode == 0, planned.stderr
    assert "population.tract" in planned.stdout and "rho = 1" in planned.stdout
    assert "Measurement county_marginals: workload-optimal split" in planned.stdout
    key = tmp_path / "demo.key"
    refused = cli("run", DEMO_SPEC, "--input", data / "persons.parquet", "--out", tmp_path / "releases",
                  "--key-file", key)
    assert refused.returncode == 3 and "no budget in the ledger" in refused.stderr, refused.stderr
    assert not key.exists() and not (tmp_path / "releases").exists()
    budget = cli("ledger", "set-budget", "demo-census", "--rho", 2)  # the default ledger, in the user data dir
    assert budget.returncode == 0, budget.stderr
    ran = cli("run", DEMO_SPEC, "--input", data / "persons.parquet", "--out", tmp_path / "releases",
              "--key-file", key)
    assert ran.returncode == 0, ran.stderr
    release = tmp_path / "releases" / "demo-2026"
    assert "Published" in ran.stdout and key.is_file()
    manifest = json.loads((release / "manifest.json").read_text())
    assert manifest["engine"] == "embedded" and manifest["privacy"]["unit"] == "person_id"
    assert len(manifest["tables"]) == 4 + 6 + 4  # hierarchy, marginals, sum, quantile, mean (sum + count)
    assert manifest["ledger"]["spent_before"] == "0" and manifest["ledger"]["spent_after"] == "1"
    nation = pq.read_table(release / "tables" / "population.nation.parquet").to_pydict()["count"][0]
    assert abs(nation - 50_000) < 50
    verified = cli("verify", release)
    assert verified.returncode == 0, verified.stderr
    again = cli("run", DEMO_SPEC, "--input", data / "persons.parquet", "--out", tmp_path / "releases")
    assert again.returncode == 2 and "already exists" in again.stderr


def test_missing_input_is_exit_2(tmp_path):
    ran = cli("run", DEMO_SPEC, "--input", tmp_path / "nope.parquet", "--out", tmp_path)
    assert ran.returncode == 2
    assert "input.path" in ran.stderr and "no such file" in ran.stderr


def test_help_lists_commands():
    result = cli("--help")
    for command in ("plan", "run", "verify", "schema", "demo-data"):
        assert command in result.stdout
