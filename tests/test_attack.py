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


def test_reconstruction_against_the_true_tables_and_the_baselines(releases, tmp_path):
    """A near-exact release gives an attacker about what the true tables give, far more than either baseline;
    a small budget gives less; the verdict says so in words."""
    data = str(releases / "data" / "persons.parquet")
    exact = json.loads(attack(releases / "releases" / "attack-exact", data, tmp_path / "a", max_units=8).read_text())
    private = json.loads(attack(releases / "releases" / "attack-private", data, tmp_path / "b",
                                max_units=8).read_text())
    assert exact["geography_level"] == "geo.county" and exact["attributes"] == ["age", "ethnicity", "race", "sex"]
    assert exact["units_attacked"] == 8 and exact["records"] == sum(u["records"] for u in exact["per_unit"])
    rates = exact["exact_match_rates"]
    assert rates["release"] > max(rates["national_guess"], rates["unit_prior"]) + 0.15
    assert abs(rates["release"] - rates["true_tables"]) < 0.1
    assert rates["release"] > private["exact_match_rates"]["release"] + 0.05
    assert private["exact_match_rates"]["true_tables"] == pytest.approx(rates["true_tables"])  # same records
    assert "does better than the baselines" in exact["verdict"]
    for unit in exact["per_unit"]:
        assert all(0 <= matches <= unit["records"] for matches in unit["exact_matches"].values())


def test_the_verdict_says_when_a_release_does_no_better_than_the_baselines():
    from dprelease.pipelines.attack import verdict

    said = verdict({"release": 0.20, "true_tables": 0.7, "national_guess": 0.195, "unit_prior": 0.15})
    assert "does no better than the baselines" in said and "20.0%" in said
    worse = verdict({"release": 0.40, "true_tables": 0.6, "national_guess": 0.44, "unit_prior": 0.58})
    assert "does no better than the baselines" in worse and "18.0% of the records fewer" in worse


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
    with pytest.raises(SpecError, match="inside the release"):
        attack(release, str(releases / "data" / "persons.parquet"), release / "internal")
    done = subprocess.run([*CLI, "attack", str(release), "--data", "x", "--internal-dir", str(release / "i")],
                          capture_output=True, text=True)
    assert done.returncode == 2
