"""Input validation with great-expectations: a suite from the spec, the confidential report kept
internal, schema failures exit 2 before any budget is reserved, value failures handled by policy
(or --strict), and nothing about pass/fail in the public release."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from fractions import Fraction

import pyarrow as pa
import pytest

from dprelease.accounting.errors import InputSchemaError
from dprelease.accounting.ledger import history, open_ledger, set_budget
from dprelease.pipelines.plan import build_plan
from dprelease.pipelines.spec import load_spec
from dprelease.pipelines.validation import (SuiteRunner, check_schema, expectations_from_spec, manifest_record,
                                            suite_sha256)
from dprelease.pipelines.verify import verify_release

from .conftest import GEO_LEAVES

pytest.importorskip("great_expectations")

CLEAN = {"pid": [1, 2, 3, 4], "geo": [GEO_LEAVES[0], GEO_LEAVES[3], GEO_LEAVES[5], GEO_LEAVES[1]],
         "age": [10, 40, 70, 5], "sex": ["F", "M", "F", "M"]}
DIRTY = {"pid": [1, 2, 3, None], "geo": [GEO_LEAVES[0], "99999999999", GEO_LEAVES[5], GEO_LEAVES[1]],
         "age": [10, 400, 70, 5], "sex": ["F", "M", "Q", "M"]}
"""One record of each kind of bad value: null unit, unknown geography, age out of range, unknown sex."""


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", *map(str, args)],
                          capture_output=True, text=True)


def plan_of(spec_path):
    spec, base = load_spec(spec_path)
    return build_plan(spec, base)


def run_validated(spec_path, tmp_path, name, *extra):
    return cli("run", spec_path, "--no-ledger", "--out", tmp_path / name, "--key-file", tmp_path / f"{name}.key",
               "--internal-dir", tmp_path / f"{name}-internal", *extra)


def internal_report(directory):
    [path] = directory.glob("*-validation.json")
    return json.loads(path.read_text())


def test_suite_is_a_pure_function_of_the_spec(case):
    plan = plan_of(case())
    expectations = expectations_from_spec(plan)
    kinds = {(e["type"], e["kwargs"]["column"]) for e in expectations}
    assert ("expect_column_values_to_not_be_null", "pid") in kinds
    assert ("expect_column_values_to_be_in_type_list", "geo") in kinds
    between = [e for e in expectations if e["type"] == "expect_column_values_to_be_between"]
    assert between == [{"type": "expect_column_values_to_be_between",
                        "kwargs": {"column": "age", "min_value": 0, "max_value": 99}}]
    in_set = {e["kwargs"]["column"]: e["kwargs"]["value_set"] for e in expectations
              if e["type"] == "expect_column_values_to_be_in_set"}
    assert in_set == {"geo": GEO_LEAVES, "sex": ["F", "M"]}
    assert suite_sha256(expectations) == suite_sha256(expectations_from_spec(plan_of(case(rows=DIRTY))))
    other = plan_of(case(columns={**plan.spec.model_dump(mode="json")["columns"],
                                  "sex": {"type": "categorical", "values": ["F", "M", "X"]}}))
    assert suite_sha256(expectations_from_spec(other)) != suite_sha256(expectations)


def test_dirty_values_are_reported_internally_and_handled_by_policy(case, tmp_path):
    ran = run_validated(case(rows=DIRTY), tmp_path, "dirty")
    assert ran.returncode == 0, ran.stderr
    release = tmp_path / "dirty" / "test-release"
    report = internal_report(tmp_path / "dirty-internal")
    assert report["success"] is False and report["batches"] == 1
    failed = {(e["type"], e["kwargs"]["column"]): e["unexpected_count"] for e in report["expectations"]
              if e["level"] == "value" and not e["success"]}
    assert failed == {("expect_column_values_to_not_be_null", "pid"): 1,
                      ("expect_column_values_to_be_in_set", "geo"): 1,
                      ("expect_column_values_to_be_between", "age"): 1,
                      ("expect_column_values_to_be_in_set", "sex"): 1}
    assert "Q" in json.dumps(report)  # the internal report names the confidential value ...
    released = b"".join(p.read_bytes() for p in release.rglob("*") if p.is_file())
    assert b"validation.json" not in released and b'"Q"' not in released  # ... the release does not
    manifest = json.loads((release / "manifest.json").read_text())
    assert manifest["input_validation"] == manifest_record(plan_of(case(rows=DIRTY)))
    assert not re.search(r"success|passed|failed", json.dumps(manifest["input_validation"]))
    assert verify_release(release).ok


def test_pass_or_fail_does_not_reach_the_release_or_the_console(case, tmp_path):
    """One record flips the validation outcome; the manifest block and the CLI output do not change."""
    outputs, blocks = [], []
    for name, rows in (("clean", CLEAN), ("dirty", DIRTY)):
        ran = run_validated(case(rows=rows), tmp_path, name)
        assert ran.returncode == 0, ran.stderr
        # the coding check's warning is computed from the published (noisy) tables, like the release's files: a
        # fresh key's noise may or may not cross its threshold, whatever the validation outcome
        text = re.sub(r"Warning: \d+% of the published total of .*?(\n|$)", "", ran.stdout + ran.stderr, flags=re.S)
        outputs.append(re.sub(r"\d{4}-\d\d-\d\d \S+|\d+:\d\d:\d\d|/\S+", "<x>", text))
        blocks.append(json.loads((tmp_path / name / "test-release" / "manifest.json").read_text())["input_validation"])
    assert internal_report(tmp_path / "clean-internal")["success"] is True
    assert internal_report(tmp_path / "dirty-internal")["success"] is False
    assert blocks[0] == blocks[1] and outputs[0] == outputs[1]


def test_schema_failures_exit_2_before_any_budget_is_reserved(case, tmp_path):
    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "test-data", "epsilon", Fraction(5))
    missing = case(rows={k: v for k, v in CLEAN.items() if k != "sex"})
    numeric_geo = case(rows={**CLEAN, "geo": [1001000100, 2005000100, 2005000300, 1001000200]})
    for spec_path, message in ((missing, "sex"), (numeric_geo, "geo")):
        ran = cli("run", spec_path, "--ledger", book, "--internal-dir", tmp_path / "internal",
                  "--key-file", tmp_path / "k.key", "--out", tmp_path / "out")
        assert ran.returncode == 2 and message in ran.stderr, ran.stderr
    assert history(open_ledger(book), "test-data")[1] == []
    assert not (tmp_path / "k.key").exists() and not (tmp_path / "out").exists()


def test_schema_level_expectations_name_each_failure(case):
    plan = plan_of(case())
    suite = SuiteRunner(expectations_from_spec(plan))
    schema = pa.schema([("pid", pa.int64()), ("geo", pa.int64()), ("age", pa.int64())])
    with pytest.raises(InputSchemaError) as raised:
        check_schema(suite, schema, plan)
    text = str(raised.value)
    assert "input column 'sex': missing" in text and "columns.geo: input type is int64" in text
    ok = pa.schema([("pid", pa.int64()), ("geo", pa.string()), ("age", pa.string()), ("sex", pa.string())])
    assert all(r["success"] for r in check_schema(suite, ok, plan).values())


def test_strict_stops_on_failed_values_before_anything_is_reserved(case, tmp_path):
    """Issue 30 item 3: the operator's own validation runs before the key is drawn and the budget reserved, so a
    mis-coded column stops a --strict run for free, naming the failed checks (never a value)."""
    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "test-data", "epsilon", Fraction(5))
    common = ("--ledger", book, "--out", tmp_path / "out", "--key-file", tmp_path / "k.key",
              "--internal-dir", tmp_path / "internal", "--strict")
    stopped = cli("run", case(rows=DIRTY), *common)
    assert stopped.returncode == 1 and "--strict" in stopped.stderr and "nothing was reserved" in stopped.stderr
    assert "sex: values outside the spec's domain" in " ".join(stopped.stderr.split())
    assert not (tmp_path / "out").exists() and not (tmp_path / "k.key").exists()
    _, rows = history(open_ledger(book), "test-data")
    assert rows == []  # nothing reserved, nothing to abort
    published = cli("run", case(rows=CLEAN), *common)
    assert published.returncode == 0, published.stderr
    assert cli("run", case(), "--no-ledger", "--strict").returncode == 2  # strict needs an internal directory
    inside = cli("run", case(), "--no-ledger", "--out", tmp_path / "pub", "--internal-dir", tmp_path / "pub" / "x")
    assert inside.returncode == 2 and "must not be inside the output directory" in inside.stderr


def test_verify_recomputes_the_suite_hash(case, tmp_path):
    ran = run_validated(case(), tmp_path, "r")
    assert ran.returncode == 0, ran.stderr
    release = tmp_path / "r" / "test-release"
    path = release / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["input_validation"]["suite_sha256"] = "0" * 64
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    assert any(p.startswith("input_validation") for p in verify_release(release).problems)


def test_validate_command_checks_without_releasing(case, tmp_path):
    """The console says the data does not match the spec, naming the failed checks in public words (exit 1);
    the report holds the details; nothing is released."""
    spec_path = case(rows=DIRTY)
    checked = cli("validate", spec_path, "--internal-dir", tmp_path / "internal")
    assert checked.returncode == 1, checked.stderr
    said = " ".join(checked.stderr.split())
    assert "The data does not match the spec" in said and "sex: values outside the spec's domain" in said
    assert internal_report(tmp_path / "internal")["success"] is False
    clean = cli("validate", case(rows=CLEAN), "--internal-dir", tmp_path / "clean")
    assert clean.returncode == 0 and "Every expectation met" in clean.stdout, clean.stderr
    assert not (spec_path.parent / "out").exists() and not (spec_path.parent / "keys").exists()
    broken = cli("validate", case(rows={k: v for k, v in CLEAN.items() if k != "age"}), "--internal-dir", tmp_path / "i2")
    assert broken.returncode == 2 and "age" in broken.stderr


def test_schema_and_values_validate_under_pandas_string_inference(case, tmp_path):
    """pandas 3 infers text as the `str` dtype (pandas 2.x does so with future.infer_string), which
    great-expectations' type check did not accept: every geography column failed the schema check."""
    import pandas as pd

    from dprelease import Release

    with pd.option_context("future.infer_string", True):
        assert str(pa.table({"x": ["a"]}).to_pandas().dtypes["x"]) == "str"
        report = Release.from_yaml(case(rows=DIRTY)).validate(tmp_path / "internal").report
    failed = {e["kwargs"]["column"] for e in json.loads(report.read_text())["expectations"] if not e["success"]}
    assert failed == {"pid", "geo", "age", "sex"}  # the dirty values, and no schema failure


def test_the_validate_extra_pins_the_pandas_it_is_tested_on():
    from importlib.metadata import requires

    pins = [r for r in requires("dprelease") if r.startswith("pandas") and 'extra == "validate"' in r]
    assert pins and all("<3" in pin for pin in pins), pins
