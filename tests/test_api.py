"""The Python API (`import dprelease`): specs from files, dicts and models; plans as DataFrames; runs on
in-memory data with the CLI's ledger default; tables read back with their error columns."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pytest

import dprelease
from dprelease.accounting.ledger import default_ledger_location

from .conftest import GEO_LEAVES, small_spec, write_case

ROWS = 600


def persons(rows: int = ROWS, seed: int = 3) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"pid": np.arange(rows), "geo": rng.choice(GEO_LEAVES, rows),
                         "age": rng.integers(0, 100, rows), "sex": rng.choice(["F", "M"], rows),
                         "income": rng.integers(0, 1000, rows)})


def spec_with_means(**overrides) -> dict:
    document = small_spec(**overrides)
    document["columns"]["income"] = {"type": "integer", "min": 0, "max": 999, "clamp": [0, 999]}
    document["queries"] += [{"name": "income_mean", "kind": "mean", "column": "income", "by": ["geo.state"]},
                            {"name": "income_total", "kind": "sum", "column": "income", "by": ["geo.state"]}]
    return document


def test_import_dprelease_exports_the_api_and_one_error_base():
    assert {"Release", "ReleaseResult", "DPReleaseError", "SpecError", "BudgetError"} <= set(dprelease.__all__)
    assert issubclass(dprelease.BudgetError, dprelease.DPReleaseError) and dprelease.BudgetError.exit_code == 3
    assert dprelease.SpecError.exit_code == 2


def test_plan_is_a_dataframe_of_the_cli_plans_records(tmp_path):
    path = write_case(tmp_path, spec_with_means())
    frame = dprelease.Release.from_yaml(path).plan()
    cli = subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", "plan", str(path), "--json"],
                         capture_output=True, text=True, check=True)
    records = json.loads(cli.stdout)["tables"]
    assert list(frame["table"]) == [r["table"] for r in records]
    assert np.allclose(frame["noise_std"].astype(float), [np.nan if r["noise_std"] is None else r["noise_std"]
                                                          for r in records], equal_nan=True)
    counts = frame[frame["statistic"] == "count"]
    assert (counts["gls_std"] > 0).all() and (counts["gls_std"] <= counts["noise_std"] + 1e-12).all()


def test_from_dict_validates_like_a_file(tmp_path):
    with pytest.raises(dprelease.SpecError) as info:
        dprelease.Release.from_dict(small_spec(budget={"definition": "pure", "epsilon": -1}), base_dir=tmp_path)
    assert info.value.exit_code == 2 and "budget.epsilon = -1" in str(info.value)
    with pytest.raises(dprelease.SpecError):
        dprelease.Release.from_dict("spec.yaml")  # a path is from_yaml's


def test_run_charges_the_default_ledger_as_the_cli_does(tmp_path):
    """No ledger argument: the default ledger, which refuses a dataset without a budget (exit class 3)."""
    write_case(tmp_path, spec_with_means())
    release = dprelease.Release.from_dict(spec_with_means(), base_dir=tmp_path)
    with pytest.raises(dprelease.BudgetError) as info:
        release.run(persons())
    assert info.value.exit_code == 3
    assert not (tmp_path / "out" / "test-release").exists()
    subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", "ledger", "set-budget", "test-data",
                    "--epsilon", "3"], check=True, capture_output=True, env=os.environ)
    result = release.run(persons())
    assert result.manifest["ledger"] is not None
    assert Path(default_ledger_location()).exists()
    shown = subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", "ledger", "show", "test-data"],
                           capture_output=True, text=True, check=True)
    assert "test-release" in shown.stdout


def test_run_on_pandas_publishes_tables_with_error_columns_and_verifies(tmp_path):
    write_case(tmp_path, spec_with_means())
    before = set(os.listdir(tempfile.gettempdir()))
    result = dprelease.Release.from_dict(spec_with_means(), base_dir=tmp_path).run(persons(), ledger=None)
    assert result.manifest["ledger"] is None
    assert not {n for n in set(os.listdir(tempfile.gettempdir())) - before if n.startswith("dprelease-input-")}
    assert result.directory == tmp_path / "out" / "test-release"
    tables = result.tables
    assert {"pop.state", "agesex.age-sex", "income_mean", "income_total"} <= set(tables)
    county = tables["pop.county"]
    assert list(county.columns) == ["county", "count", "gls_variance", "std"]
    assert np.allclose(county["std"] ** 2, county["gls_variance"])
    assert abs(int(tables["pop.nation"]["count"].iloc[0]) - ROWS) < 60
    total = tables["income_total"]
    assert (total["std"] > 0).all() and (total["margin_95"] > total["std"]).all()
    mean = tables["income_mean"]
    assert "std_approx" in mean.columns and (mean["std_approx"].dropna() > 0).all()
    assert result.verify().ok


def test_pyarrow_table_and_dataset_inputs(tmp_path):
    write_case(tmp_path, small_spec())
    table = pa.Table.from_pandas(persons(), preserve_index=False)
    release = dprelease.Release.from_dict(small_spec(), base_dir=tmp_path)
    first = release.run(table, ledger=None, out_dir=tmp_path / "a")
    (tmp_path / "parts").mkdir()
    ds.write_dataset(table, tmp_path / "parts", format="parquet", max_rows_per_file=200, max_rows_per_group=200)
    second = release.run(ds.dataset(tmp_path / "parts"), ledger=None, out_dir=tmp_path / "b")
    for result in (first, second):
        assert result.table("pop.nation")["count"].iloc[0] > 0


def test_unknown_data_and_table_names_are_spec_errors(tmp_path):
    write_case(tmp_path, small_spec())
    release = dprelease.Release.from_dict(small_spec(), base_dir=tmp_path)
    with pytest.raises(dprelease.SpecError, match="data: a path"):
        release.run([1, 2, 3], ledger=None)
    result = release.run(ledger=None)  # the spec's own input
    with pytest.raises(dprelease.SpecError, match="table = 'nope'"):
        result.table("nope")


def test_temporary_copy_is_private(tmp_path, monkeypatch):
    """Data the embedded engine cannot take in memory (a pyarrow Dataset; any frame on spark or beam) is written
    once to a 0700 directory, which is gone after the run."""
    seen = []
    from dprelease.pipelines import api

    original = api.run_release_spec

    def spy(spec, base, *, input_path, **options):
        folder = Path(input_path).parent
        seen.append((folder, stat.S_IMODE(folder.stat().st_mode)))
        return original(spec, base, input_path=input_path, **options)

    monkeypatch.setattr(api, "run_release_spec", spy)
    write_case(tmp_path, small_spec())
    dataset = ds.dataset(pa.Table.from_pandas(persons(), preserve_index=False))
    dprelease.Release.from_dict(small_spec(), base_dir=tmp_path).run(dataset, ledger=None)
    (folder, mode), = seen
    assert mode == 0o700 and not folder.exists()


def test_a_frame_on_the_embedded_engine_is_never_written_to_disk(tmp_path, monkeypatch):
    from dprelease.pipelines import api

    original, seen = api.run_release_spec, []

    def spy(spec, base, *, input_path, **options):
        seen.append((input_path, options.get("input_table")))
        return original(spec, base, input_path=input_path, **options)

    monkeypatch.setattr(api, "run_release_spec", spy)
    monkeypatch.setattr(api._input_of, "_directory", lambda *a: pytest.fail("in-memory data was written"))
    write_case(tmp_path, small_spec())
    dprelease.Release.from_dict(small_spec(), base_dir=tmp_path).run(persons(), ledger=None)
    (path, table), = seen
    assert path is None and table.num_rows == ROWS


def test_an_in_memory_input_binds_its_key_to_its_content(tmp_path):
    """The ledger binds a key to the input's fingerprint: a rerun on the same frame is free and byte-identical;
    a frame with one value changed under the same key is refused (its fingerprint is its Arrow bytes')."""
    from dprelease.accounting.errors import KeyReuseError

    ledger = tmp_path / "ledger.sqlite"
    subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", "ledger", "set-budget", "test-data",
                    "--epsilon", "5", "--ledger", str(ledger)], check=True, capture_output=True)
    write_case(tmp_path, small_spec())
    release = dprelease.Release.from_dict(small_spec(), base_dir=tmp_path)
    frame = persons()
    first = release.run(frame, ledger=ledger, key_file=tmp_path / "k.key", out_dir=tmp_path / "a")
    again = release.run(frame.copy(), ledger=ledger, key_file=tmp_path / "k.key", out_dir=tmp_path / "b")
    assert again.manifest["ledger"]["charged_by_this_run"] == "0"
    for name in first.table_names:
        assert first.table(name).equals(again.table(name)), name
    changed = frame.copy()
    changed.loc[0, "age"] = (changed.loc[0, "age"] + 50) % 100
    with pytest.raises(KeyReuseError):
        release.run(changed, ledger=ledger, key_file=tmp_path / "k.key", out_dir=tmp_path / "c")


def memory_fingerprint(key, table) -> str:
    from dprelease.pipelines.source import MemorySource, serialized_copy

    serialized, copy = serialized_copy(table)
    return MemorySource(None, [], None, "parquet", {}, table=copy, serialized=serialized).fingerprint(key)


def test_the_fingerprint_of_a_table_tells_one_changed_value_apart():
    from dprelease.transforms.csprng import ReleaseKey

    key = ReleaseKey.generate()
    table = pa.Table.from_pandas(persons(), preserve_index=False)
    same = pa.Table.from_pandas(persons(), preserve_index=False)
    values = table.column("sex").to_pylist()
    values[7] = "M" if values[7] == "F" else "F"
    other = table.set_column(table.column_names.index("sex"), "sex", pa.array(values))
    assert memory_fingerprint(key, table) == memory_fingerprint(key, same)
    assert memory_fingerprint(key, table) != memory_fingerprint(key, other)
    nulled = table.set_column(table.column_names.index("sex"), "sex", pa.array(values[:7] + [None] + values[8:]))
    assert memory_fingerprint(key, other) != memory_fingerprint(key, nulled)
    assert memory_fingerprint(key, table) == memory_fingerprint(key, table.replace_schema_metadata({"pandas": "x"}))


def test_a_frame_changed_during_the_run_is_read_as_it_was_fingerprinted(tmp_path, monkeypatch):
    """pandas shares a frame's numeric memory with the Arrow table: a change after the key is bound must not
    reach the counts (found by review: the same noise over other data). The run reads its own copy."""
    from dprelease.pipelines import run as run_module

    write_case(tmp_path, small_spec())
    release = dprelease.Release.from_dict(small_spec(), base_dir=tmp_path)
    frame = persons()
    clean = release.run(frame.copy(), ledger=None, key_file=tmp_path / "k.key", out_dir=tmp_path / "clean")
    original = run_module.bind_release_key

    def change_after_binding(key, plan, source):
        bound = original(key, plan, source)
        frame.loc[:, "age"] = 5  # every person becomes a child, in the caller's frame
        return bound

    monkeypatch.setattr(run_module, "bind_release_key", change_after_binding)
    raced = release.run(frame, ledger=None, key_file=tmp_path / "k.key", out_dir=tmp_path / "raced")
    for name in clean.table_names:
        assert clean.table(name).equals(raced.table(name)), name


def test_categories_that_no_numeric_value_can_match_are_refused_before_any_run(tmp_path):
    """values: [F, M] over data coded 0/1 would publish a release where every record is (other): refused from the
    schema and the spec alone (exit 2, naming file, column and the spec's values, never a data value)."""
    coded = persons().assign(sex=lambda f: (f["sex"] == "M").astype("int64"))
    write_case(tmp_path, small_spec())
    release = dprelease.Release.from_dict(small_spec(), base_dir=tmp_path)
    with pytest.raises(dprelease.InputSchemaError) as info:
        release.run(coded, ledger=None)
    assert "columns.sex" in str(info.value) and "['F', 'M']" in str(info.value) and info.value.exit_code == 2
    numeric = small_spec()
    numeric["columns"]["sex"] = {"type": "categorical", "values": [0, 1]}
    assert dprelease.Release.from_dict(numeric, base_dir=tmp_path).run(coded, ledger=None).table("by_sex") is not None


def test_zero_padded_codes_over_an_integer_column_are_refused(tmp_path):
    coded = persons().assign(sex=lambda f: (f["sex"] == "M").astype("int64") + 1)
    padded = small_spec()
    padded["columns"]["sex"] = {"type": "categorical", "values": ["01", "02"]}
    write_case(tmp_path, padded)
    with pytest.raises(dprelease.InputSchemaError, match="columns.sex"):
        dprelease.Release.from_dict(padded, base_dir=tmp_path).run(coded, ledger=None)


def test_mixed_python_values_are_invalid_values_not_errors_that_quote_them(tmp_path):
    """An object column mixing numbers and text converts as text (the encoder's policy handles what is invalid):
    no error depends on, or quotes, a value."""
    frame = persons().astype({"age": object})
    frame.loc[3, "age"] = "SECRET-AGE-123"
    write_case(tmp_path, small_spec())
    result = dprelease.Release.from_dict(small_spec(), base_dir=tmp_path).run(frame, ledger=None)
    assert int(result.table("pop.nation")["count"].iloc[0]) > 0


def test_unexpected_failures_name_only_their_type_and_keep_details_internal(tmp_path, monkeypatch):
    from dprelease.pipelines import api

    def failing(*args, **kwargs):
        raise ValueError("value SECRET-42 of a confidential record")

    monkeypatch.setattr(api, "run_release_spec", failing)
    write_case(tmp_path, small_spec())
    release = dprelease.Release.from_dict(small_spec(), base_dir=tmp_path)
    with pytest.raises(dprelease.DPReleaseError) as info:
        release.run(persons(), ledger=None, internal_dir=tmp_path / "internal")
    assert "SECRET" not in str(info.value) and "ValueError" in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__
    (failure,) = (tmp_path / "internal").glob("failure-*.txt")
    assert "SECRET-42" in failure.read_text() and stat.S_IMODE(failure.stat().st_mode) == 0o600


def test_a_killed_runs_input_copy_is_removed_by_the_next_run(tmp_path):
    """The private copy is named after its process, so the next run of the release removes a dead run's copy."""
    from dprelease.pipelines.housekeeping import host_identity, input_copy_prefix

    dead = Path(tempfile.gettempdir()) / f"{input_copy_prefix('test-release')}4194303.1@{host_identity()}@x1"
    dead.mkdir()
    (dead / "input.parquet").write_bytes(b"confidential")
    write_case(tmp_path, small_spec())
    dprelease.Release.from_dict(small_spec(), base_dir=tmp_path).run(persons(), ledger=None)
    assert not dead.exists()


def test_mean_error_is_the_delta_method_at_the_ratio_of_the_noisy_measurements(tmp_path):
    write_case(tmp_path, spec_with_means())
    result = dprelease.Release.from_dict(spec_with_means(), base_dir=tmp_path).run(persons(), ledger=None)
    measured = result.directory / "measurements"
    sums = pd.read_parquet(measured / "income_mean.sum.parquet")["noisy_sum"].to_numpy(float)
    counts = pd.read_parquet(measured / "income_mean.count.parquet")["noisy_count"].to_numpy(float)
    entry = {t["name"]: t for t in result.manifest["tables"]}
    var_s = entry["income_mean.sum"]["expected_error"]["variance"]
    var_c = entry["income_mean.count"]["expected_error"]["variance"]
    with np.errstate(divide="ignore", invalid="ignore"):
        expected = np.sqrt(var_s + (sums / counts) ** 2 * var_c) / counts
    assert np.allclose(result.table("income_mean")["std_approx"], np.where(counts >= 1, expected, np.nan),
                       equal_nan=True)


def test_polars_input(tmp_path):
    polars = pytest.importorskip("polars")
    write_case(tmp_path, small_spec())
    frame = polars.from_pandas(persons())
    result = dprelease.Release.from_dict(small_spec(), base_dir=tmp_path).run(frame, ledger=None)
    assert abs(int(result.table("pop.nation")["count"].iloc[0]) - ROWS) < 60


def test_with_budget_compares_expected_errors_before_spending(tmp_path):
    """Utility before budget: the same plan at several budgets; errors shrink as the budget grows (zCDP: std
    scales as 1/sqrt(rho)); the original release is unchanged; an invalid budget is a spec error."""
    document = small_spec(budget={"definition": "zcdp", "rho": 1})
    write_case(tmp_path, document)
    release = dprelease.Release.from_dict(document, base_dir=tmp_path)
    stds = {rho: release.with_budget(rho=rho).plan().set_index("table")["noise_std"] for rho in ("1/4", "1", "4")}
    assert (stds["1/4"] > stds["1"]).all() and (stds["1"] > stds["4"]).all()
    assert np.allclose(stds["1/4"] / stds["4"], 4.0, rtol=0.02)
    assert release.spec.budget.rho == "1"
    with pytest.raises(dprelease.SpecError, match="budget.rho"):
        release.with_budget(rho=-1)


def test_with_budget_keeps_every_other_field_and_can_switch_definitions(tmp_path):
    for document in (small_spec(privacy_unit=None), small_spec()):
        write_case(tmp_path, document)
        release = dprelease.Release.from_dict(document, base_dir=tmp_path)
        assert release.with_budget().spec == release.spec
        switched = release.with_budget(definition="zcdp", rho="1/2")
        assert switched.spec.budget.definition == "zcdp" and switched.spec.queries == release.spec.queries


def test_the_plan_states_a_means_own_error_at_n_records(tmp_path):
    """A mean's error depends on its cell's count; the plan states the public bound sqrt(Var S + M^2 Var C) / n
    and spends nothing more on it."""
    write_case(tmp_path, spec_with_means())
    plan = dprelease.Release.from_dict(spec_with_means(), base_dir=tmp_path).plan().set_index("table")
    mean = plan.loc["income_mean"]
    var_s, var_c = plan.loc["income_mean.sum", "noise_std"] ** 2, plan.loc["income_mean.count", "noise_std"] ** 2
    assert mean["mechanism"] == "ratio" and mean["budget"] is None or np.isnan(mean["budget"])
    assert np.isclose(mean["mean_std_at_n"], np.sqrt(var_s + 999 ** 2 * var_c))
    cli = subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", "plan", str(tmp_path / "spec.yaml")],
                         capture_output=True, text=True, check=True)
    assert f"≤{mean['mean_std_at_n']:.4g}/n" in cli.stdout


def test_a_frame_whose_module_is_the_pandas_package_is_a_pandas_frame(tmp_path):
    """pandas 3 names its DataFrame's module "pandas" (pandas 2: "pandas.core.frame"); a fresh install without
    the test extras gets pandas 3, and the quickstart refused its frame."""
    class Frame(pd.DataFrame):
        pass

    Frame.__module__ = "pandas"
    write_case(tmp_path, small_spec())
    result = dprelease.Release.from_dict(small_spec(), base_dir=tmp_path).run(Frame(persons()), ledger=None)
    assert int(result.table("pop.nation")["count"].iloc[0]) > 0
