"""A mis-coded category is noticed from the published release alone: the CLI, the Python API and the report
name the column whose (other) cells hold a large share of a published table; a well-coded release says nothing."""
from __future__ import annotations

import json
import subprocess
import sys
import warnings

import numpy as np
import pandas as pd
import pytest

import dprelease
from dprelease.pipelines.coding_check import OTHER_SHARE_LIMIT, other_shares
from dprelease.pipelines.commands import write_report

from .conftest import GEO_LEAVES, small_spec, write_case

ROWS = 2000


def persons(sex_codes: list[str]) -> dict:
    rng = np.random.default_rng(11)
    return {"pid": np.arange(ROWS), "geo": rng.choice(GEO_LEAVES, ROWS), "age": rng.integers(0, 100, ROWS),
            "sex": rng.choice(sex_codes, ROWS)}


def spelled(values: list[str]) -> dict:
    document = small_spec(budget={"definition": "pure", "epsilon": 4})
    document["columns"]["sex"]["values"] = values
    return document


def cli_run(path):
    return subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", "run", str(path), "--no-ledger"],
                          capture_output=True, text=True)


def test_a_category_spelled_otherwise_than_the_data_is_named_after_the_run_and_in_the_report(tmp_path):
    path = write_case(tmp_path, spelled(["Female", "Male"]), persons(["F", "M"]))
    done = cli_run(path)
    assert done.returncode == 0, done.stderr
    assert "Warning:" in done.stderr and "sex = (other)" in done.stderr
    release = tmp_path / "out" / "test-release"
    manifest = json.loads((release / "manifest.json").read_text())
    (share,) = other_shares(release, manifest)
    assert share.dimension == "sex" and share.table == "by_sex" and share.share > 0.9
    page = write_report(release)[0].read_text(encoding="utf-8")
    assert "Coding check" in page and "sex = (other)" in page


def test_a_well_coded_release_has_no_warning(tmp_path):
    path = write_case(tmp_path, spelled(["F", "M"]), persons(["F", "M"]))
    done = cli_run(path)
    assert done.returncode == 0, done.stderr
    assert "Warning:" not in done.stderr
    release = tmp_path / "out" / "test-release"
    assert other_shares(release, json.loads((release / "manifest.json").read_text())) == []
    assert "No column or geography level has more than" in write_report(release)[0].read_text(encoding="utf-8")


def test_a_legitimate_small_other_share_stays_below_the_limit(tmp_path):
    """A tenth of records in (other) (a real third category) is no warning; the limit is a quarter."""
    codes = ["F"] * 9 + ["M"] * 9 + ["X"] * 2
    path = write_case(tmp_path, spelled(["F", "M"]), persons(codes))
    assert cli_run(path).returncode == 0
    release = tmp_path / "out" / "test-release"
    assert OTHER_SHARE_LIMIT == 0.25
    assert other_shares(release, json.loads((release / "manifest.json").read_text())) == []


def test_a_geography_level_of_unknown_codes_is_named(tmp_path):
    rows = persons(["F", "M"])
    rows["geo"] = np.where(np.arange(ROWS) % 2 == 0, "99999999999", rows["geo"])  # half the records off the file
    path = write_case(tmp_path, spelled(["F", "M"]), rows)
    assert cli_run(path).returncode == 0
    release = tmp_path / "out" / "test-release"
    named = {s.dimension for s in other_shares(release, json.loads((release / "manifest.json").read_text()))}
    assert {"state", "county", "tract"} <= named and "sex" not in named


def test_the_python_api_warns(tmp_path):
    path = write_case(tmp_path, spelled(["Female", "Male"]))
    release = dprelease.Release.from_yaml(path)
    with pytest.warns(UserWarning, match=r"sex = \(other\)"):
        result = release.run(pd.DataFrame(persons(["F", "M"])), ledger=None)
    assert result.coding_warnings and "sex" in result.coding_warnings[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dprelease.ReleaseResult.open(result.directory).coding_warnings == result.coding_warnings


def test_manifest_paths_that_leave_the_release_are_never_read():
    """An unverified manifest (ReleaseResult.open on someone's directory) cannot point a reader outside it."""
    from dprelease.pipelines.error_columns import table_files

    manifest = {"files": [{"path": "tables/t/../../../secret.parquet"}, {"path": "/etc/t.parquet"},
                          {"path": "tables/t//part-00000.parquet"}, {"path": "tables/t/part-00001.parquet"}]}
    assert table_files(manifest, "t") == ["tables/t/part-00001.parquet"]
