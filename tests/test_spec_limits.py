"""Bad specs are refused up front (exit 2, before any key, reservation or data): too many cells,
YAML bombs and duplicate keys, budgets that are not representable; messages stay bounded."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from fractions import Fraction

import pytest
import yaml

from dprelease.accounting.ledger import history, open_ledger, set_budget
from dprelease.pipelines.manifest import dump_manifest

from .conftest import DEMO_SPEC, small_spec, write_case


def cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=120)


def huge_marginal_spec(tmp_path):
    values = [f"v{i}" for i in range(10_000)]
    spec = small_spec(
        columns={name: {"type": "categorical", "values": list(values)} for name in "abc"},  # copies: no YAML aliases
        queries=[{"name": "abc", "kind": "marginals", "attributes": ["a", "b", "c"], "way": 3}])
    return write_case(tmp_path / "huge", spec, rows={"pid": [1], "a": ["v1"], "b": ["v2"], "c": ["v3"]})


# 8. Cell limit ---------------------------------------------------------------------------------------------------

def test_plan_shows_memory_and_refuses_a_trillion_cell_release(tmp_path):
    spec = huge_marginal_spec(tmp_path)
    planned = cli("plan", spec)
    assert planned.returncode == 2, planned.stderr
    assert "1,000,300,030,001 public cells" in planned.stderr and "--max-cells" in planned.stderr
    assert "TiB" in planned.stdout + planned.stderr
    small = write_case(tmp_path / "small", small_spec())
    ok = cli("plan", small)
    assert ok.returncode == 0 and "of process memory" in ok.stdout and "limit 20,000,000" in ok.stdout
    assert cli("plan", small, "--max-cells", 10).returncode == 2


def test_the_cap_is_the_embedded_engines_and_plan_says_where_memory_goes():
    """Spark and Beam post-process a tree of units in their workers: no cell cap there, and plan says so."""
    capped = cli("plan", DEMO_SPEC, "--max-cells", 1000)
    assert capped.returncode == 2 and "over the limit of 1,000" in capped.stderr
    for engine in ("spark", "beam"):
        workers = cli("plan", DEMO_SPEC, "--max-cells", 1000, "--engine", engine)
        assert workers.returncode == 0, workers.stderr
        assert "no cell limit in the workers" in workers.stdout and "the driver holds no cells" in workers.stdout


def test_run_refuses_before_any_key_or_reservation(tmp_path):
    spec = huge_marginal_spec(tmp_path)
    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "test-data", "epsilon", Fraction(5))
    ran = cli("run", spec, "--ledger", book, "--key-file", tmp_path / "k.key", "--out", tmp_path / "out")
    assert ran.returncode == 2 and "over the limit" in ran.stderr
    assert not (tmp_path / "k.key").exists() and history(open_ledger(book))[1] == []
    small = write_case(tmp_path / "small", small_spec())
    env = {**__import__("os").environ, "DPRELEASE_MAX_CELLS": "5"}
    capped = cli("run", small, "--no-ledger", "--key-file", tmp_path / "k2.key", "--out", tmp_path / "o2", env=env)
    assert capped.returncode == 2 and "over the limit of 5" in capped.stderr


# 9. YAML -----------------------------------------------------------------------------------------------------------

def test_a_billion_laughs_spec_is_refused_at_once(tmp_path):
    levels = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    levels += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    spec = tmp_path / "bomb.yaml"
    spec.write_text("\n".join(levels) + "\n")
    started = time.monotonic()
    ran = cli("plan", spec)
    assert ran.returncode == 2 and "aliases" in ran.stderr
    assert time.monotonic() - started < 60 and len(ran.stderr) < 2_000


def test_duplicate_and_merge_keys_are_refused(tmp_path):
    text = yaml.safe_dump(small_spec(), sort_keys=False).replace(
        "  epsilon: 1\n", "  epsilon: 1\n  epsilon: 1000\n")
    assert text.count("epsilon") == 2
    spec = write_case(tmp_path / "dup", small_spec())
    spec.write_text(text)
    ran = cli("plan", spec)
    assert ran.returncode == 2 and "duplicate key 'epsilon'" in ran.stderr and "line" in ran.stderr
    merged = tmp_path / "merge.yaml"
    merged.write_text("defaults: {a: 1}\nbudget:\n  <<: {definition: pure}\n  epsilon: 1\n")
    ran = cli("plan", merged)
    assert ran.returncode == 2 and "merge keys" in ran.stderr


def test_error_messages_stay_bounded_whatever_the_spec_holds(tmp_path):
    spec = write_case(tmp_path / "big", small_spec(release_id="x" * 500_000, budget={"definition": "pure",
                                                                                        "epsilon": "y" * 500_000}))
    ran = cli("plan", spec)
    assert ran.returncode == 2 and "release_id" in ran.stderr and "budget.epsilon" in ran.stderr
    assert len(ran.stderr) < 3_000
    oversized = tmp_path / "oversized.yaml"
    oversized.write_text("# " + "z" * (2 << 20) + "\n")
    ran = cli("plan", oversized)
    assert ran.returncode == 2 and "at most 1,048,576 bytes" in ran.stderr


# 10. Budgets that are not representable ----------------------------------------------------------------------------

@pytest.mark.parametrize("budget, field", [
    ({"definition": "approx", "epsilon": 1e308, "delta": 1e-10}, "budget.epsilon"),
    ({"definition": "zcdp", "rho": 1, "delta": 5e-324}, "budget.delta"),
    ({"definition": "zcdp", "rho": "1/" + "9" * 60}, "budget.rho"),
])
def test_unrepresentable_budgets_are_spec_errors(tmp_path, budget, field):
    spec = write_case(tmp_path / "b", small_spec(budget=budget))
    for command in ("plan", "run"):
        ran = cli(command, spec, *(["--no-ledger", "--key-file", tmp_path / "k.key"] if command == "run" else []))
        assert ran.returncode == 2 and field in ran.stderr, ran.stderr
    assert not (tmp_path / "k.key").exists()


def test_manifests_are_strict_json():
    with pytest.raises(ValueError):
        dump_manifest({"x": float("inf")})
    assert json.loads(dump_manifest({"x": 1.5})) == {"x": 1.5}
