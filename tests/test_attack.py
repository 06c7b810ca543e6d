"""`dprelease attack`: the reconstruction-risk check. Against a near-exact release (a huge budget) the integer
programs rebuild most records of each unit and beat the one-way baseline; a small budget rebuilds fewer; the
result is written only to the internal directory, owner-only, and nothing about it is printed."""
from __future__ import annotations

import json
import stat
import subprocess
import sys

import pytest
import yaml

from dprelease.accounting.errors import SpecError
from dprelease.pipelines.attack import attack

from .conftest import DEMO_SPEC

CLI = [sys.executable, "-m", "dprelease.pipelines.cli"]


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """The demo spec on 5,000 generated persons at rho = 1000 (near exact) and rho = 1/4."""
    root = tmp_path_factory.mktemp("attack")
    subprocess.run([*CLI, "demo-data", "--rows", "5000", "--out", str(root / "data")], check=True, capture_output=True)
    spec = yaml.safe_load(DEMO_SPEC.read_text())
    spec["input"] = {"path": "data/persons.parquet"}
    spec["columns"]["geo"]["domain_file"] = "data/geography.txt"
    spec["output"] = {"dir": "releases"}
    for name, rho in (("exact", 1000), ("private", "1/4")):
        spec["release_id"], spec["budget"] = f"attack-{name}", {"definition": "zcdp", "rho": rho}
        (root / f"{name}.yaml").write_text(yaml.safe_dump(spec))
        subprocess.run([*CLI, "run", str(root / f"{name}.yaml"), "--no-ledger"], check=True, capture_output=True)
    return root


def test_reconstruction_beats_the_baseline_and_a_smaller_budget_rebuilds_less(releases, tmp_path):
    data = str(releases / "data" / "persons.parquet")
    exact = json.loads(attack(releases / "releases" / "attack-exact", data, tmp_path / "a", max_units=8).read_text())
    private = json.loads(attack(releases / "releases" / "attack-private", data, tmp_path / "b",
                                max_units=8).read_text())
    assert exact["geography_level"] == "geo.county" and exact["attributes"] == ["age", "ethnicity", "race", "sex"]
    assert exact["units_attacked"] == 8 and exact["records"] == sum(u["records"] for u in exact["per_unit"])
    assert exact["exact_match_rate"] > 2 * exact["baseline_one_way_rate"]
    assert exact["exact_match_rate"] > private["exact_match_rate"] + 0.05
    assert all(u["exact_matches"] <= u["records"] for u in exact["per_unit"])


def test_the_cli_writes_the_result_only_to_the_internal_directory(releases, tmp_path):
    internal = tmp_path / "internal"
    done = subprocess.run([*CLI, "attack", str(releases / "releases" / "attack-private"), "--data",
                           str(releases / "data" / "persons.parquet"), "--internal-dir", str(internal),
                           "--max-units", "3"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (path,) = internal.iterdir()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(internal.stat().st_mode) == 0o700
    result = json.loads(path.read_text())
    assert str(result["exact_matches"]) not in done.stdout.replace(str(path), "")
    assert "confidential" in done.stdout and str(path) in done.stdout


def test_an_internal_directory_inside_the_release_is_refused(releases):
    release = releases / "releases" / "attack-private"
    with pytest.raises(SpecError, match="must not be inside the release"):
        attack(release, str(releases / "data" / "persons.parquet"), release / "internal")
    done = subprocess.run([*CLI, "attack", str(release), "--data", "x", "--internal-dir", str(release / "i")],
                          capture_output=True, text=True)
    assert done.returncode == 2
