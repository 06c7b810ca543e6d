"""Sums, means, quantiles and unit counts: spec errors, sensitivity derived from the bounds and checked
on neighbouring inputs, clamping and invalid values, the release files, and byte-identical engines."""
from __future__ import annotations

import json
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dprelease.accounting.errors import SpecError
from dprelease.accounting.sensitivity import (ContributionBounds, quantile_score_sensitivity, sum_sensitivity,
                                              unit_count_sensitivity)
from dprelease.pipelines.plan import build_plan
from dprelease.pipelines.run import run_release
from dprelease.pipelines.spec import load_spec, parse_spec
from dprelease.pipelines.verify import verify_release
from dprelease.transforms.aggregate import bounded_counts
from dprelease.transforms.encode import ColumnEncoder, encode_batch
from dprelease.transforms.release_values import quantile_scores

from .conftest import GEO_LEAVES, small_spec, write_case
from .test_spark import assert_same_release

INCOME = {"type": "integer", "min": -1000, "max": 10**9, "bins": [-1000, 0, 100, 1000, 10**9 + 1],
          "clamp": [0, 1000]}


def measure_spec(**overrides) -> dict:
    """The small spec with an income measure and one query of every new kind."""
    spec = small_spec(
        privacy_unit="hid",
        contribution={"max_records_per_unit": 2},
        columns={**small_spec()["columns"], "income": INCOME},
        queries=[
            {"name": "total", "kind": "sum", "column": "income", "by": ["geo.county"]},
            {"name": "avg", "kind": "mean", "column": "income", "by": ["sex"], "count_share": "1/4"},
            {"name": "median", "kind": "quantile", "column": "income", "by": ["geo.state"], "q": [0.5, "1/4"],
             "candidates": [0, 10, 100, 500, 1000]},
            {"name": "households", "kind": "count_units", "by": ["geo.county"]},
            {"name": "by_sex", "kind": "histogram", "by": ["sex"]},
        ],
    )
    spec.update(overrides)
    return spec


def measure_rows(n: int = 400, seed: int = 3) -> dict:
    rng = np.random.default_rng(seed)
    income = rng.integers(-50, 3000, n).astype(object)
    income[::37] = None
    return {"hid": (np.arange(n) // 3).tolist(), "geo": rng.choice(GEO_LEAVES, n).tolist(),
            "age": rng.integers(0, 100, n).tolist(), "sex": rng.choice(["F", "M"], n).tolist(),
            "income": pa.array(income.tolist(), type=pa.int64())}


def spec_errors(**overrides) -> list[str]:
    with pytest.raises(SpecError) as caught:
        parse_spec(measure_spec(**overrides))
    return caught.value.messages


# ---- bad inputs: clear errors naming the field --------------------------------------------------------------

@pytest.mark.parametrize("change,expected", [
    ({"clamp": [10, 0]}, "columns.income.clamp = [10, 0]: lo must be <= hi"),
    ({"clamp": [0, 2**31]}, "columns.income.clamp = [0, 2147483648]: lo and hi must lie within"),
    ({"clamp": [0, 0]}, "columns.income.clamp = [0, 0]: every value would be 0"),
    ({"clamp": [1, 2, 3]}, "columns.income.clamp = [1, 2, 3]: must be [lo, hi]"),
])
def test_bad_clamps_name_the_field(change, expected):
    columns = {**small_spec()["columns"], "income": {**INCOME, **change}}
    assert any(p.startswith(expected) for p in spec_errors(columns=columns)), spec_errors(columns=columns)


def test_clamp_on_a_categorical_is_refused_naming_the_field():
    columns = {**small_spec()["columns"], "income": INCOME,
               "sex": {"type": "categorical", "values": ["F", "M"], "clamp": [0, 1]}}
    problems = spec_errors(columns=columns)
    assert problems == ["columns.sex = {'type': 'categorical', 'values': ['F', 'M'], 'clamp': [0, 1]}: clamp applies "
                        "to integer columns only (a measure to sum, average or rank); this column is categorical"]


@pytest.mark.parametrize("query,expected", [
    ({"name": "s", "kind": "sum", "column": "sex"}, "queries[0].column = 'sex': a sum needs an integer column with "
                                                   "clamp: [lo, hi] (this one is categorical)"),
    ({"name": "s", "kind": "sum", "column": "age"}, "queries[0].column = 'age': a sum needs an integer column with "
                                                   "clamp: [lo, hi] (this one is integer without clamp)"),
    ({"name": "s", "kind": "mean", "column": "wage"}, "queries[0].column = 'wage': unknown column"),
    ({"name": "q", "kind": "quantile", "column": "income", "q": [0.5], "candidates": [0, 500, 100]},
     "queries[0].candidates = [0, 500, 100]: must be strictly increasing"),
    ({"name": "q", "kind": "quantile", "column": "income", "q": [0.5], "candidates": [0, 5000]},
     "queries[0].candidates = [0, 5000]: must lie within the clamp [0, 1000]"),
    ({"name": "q", "kind": "quantile", "column": "income", "q": [1.5]},
     "queries[0].q = [1.5]: each q must lie in (0, 1)"),
    ({"name": "q", "kind": "quantile", "column": "income", "q": [0.5, "1/2"]}, "queries[0].q = [0.5, '1/2']: must be distinct"),
    ({"name": "m", "kind": "mean", "column": "income", "count_share": 1}, "queries[0].count_share = 1: must be a fraction in (0, 1)"),
    ({"name": "s", "kind": "sum", "column": "income", "by": ["geo.city"]}, "queries[0].by[0] = 'geo.city': unknown level"),
])
def test_bad_measure_queries_name_the_field(query, expected):
    problems = spec_errors(queries=[query])
    assert any(p.startswith(expected) for p in problems), problems


def test_default_candidates_are_the_bin_edges_within_the_clamp(tmp_path):
    spec = measure_spec(queries=[{"name": "q", "kind": "quantile", "column": "income", "q": [0.5]}])
    plan = build_plan(parse_spec(spec), write_case(tmp_path, spec).parent)
    assert plan.table("q").layout.candidates == (0, 100, 1000)
    few = {**INCOME, "bins": [-1000, 10**9 + 1]}
    problems = spec_errors(columns={**small_spec()["columns"], "income": few},
                           queries=[{"name": "q", "kind": "quantile", "column": "income", "q": [0.5]}])
    assert problems[0].startswith("queries[0].candidates (default: columns.income.bins within the clamp) = []: "
                                  "needs at least 2 candidate values")


def test_cli_exits_2_on_a_bad_measure_spec(tmp_path):
    spec = write_case(tmp_path, measure_spec(queries=[{"name": "s", "kind": "sum", "column": "sex"}]))
    result = subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", "plan", str(spec)],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "queries[0].column = 'sex'" in result.stderr + result.stdout


# ---- sensitivity: derived from the bounds, and checked on neighbouring inputs --------------------------------

@pytest.mark.parametrize("k", [1, 3])
def test_sum_sensitivity_under_both_relations(k):
    add = sum_sensitivity(ContributionBounds(k, "add_remove"), -30, 20)
    assert (add.l1, add.l2_squared) == (30 * k, (30 * k) ** 2)
    replace = sum_sensitivity(ContributionBounds(k, "replace"), -30, 20)
    assert (replace.l1, replace.l2_squared) == (60 * k, (50 * k) ** 2)  # a sign flip in one cell: k(hi - lo)
    spread_out = sum_sensitivity(ContributionBounds(k, "replace"), 0, 20)
    assert spread_out.l2_squared == 2 * (20 * k) ** 2  # records moved to another cell: sqrt(2) k M
    units = unit_count_sensitivity(ContributionBounds(k, "add_remove"))
    assert (units.l1, units.l2_squared) == (k, k)
    assert unit_count_sensitivity(ContributionBounds(k, "replace")).l1 == 2 * k
    assert quantile_score_sensitivity(ContributionBounds(k, "add_remove"), Fraction(1, 4)).l1 == 3 * k
    assert quantile_score_sensitivity(ContributionBounds(k, "replace"), Fraction(1, 4)).l1 == 6 * k
    assert quantile_score_sensitivity(ContributionBounds(k, "replace"), Fraction(1, 2)).l1 == 2 * k


def _vectors(plan, rows: dict, key_bytes: bytes = b"k" * 32) -> dict[str, np.ndarray]:
    """True (bounded) measurement vectors of every table of `plan` over `rows` (kernel path of every engine)."""
    from dprelease.transforms.csprng import ReleaseKey

    batch = pa.table(rows)
    columns = plan.encoded_columns()
    encoders = {c: ColumnEncoder(plan.domains[c]) for c in columns}
    codes, keep = encode_batch(batch, encoders)
    codes = {c: v[keep] for c, v in codes.items()}
    units = batch.column(plan.spec.privacy_unit).filter(pa.array(keep))
    vectors = bounded_counts([t.layout for t in plan.tables], codes, int(keep.sum()), [plan.domains[c].size for c in columns], units,
                             plan.bounds.max_records_per_unit, ReleaseKey(key_bytes).derive("dprelease/bound"))
    return {t.name: v for t, v in zip(plan.tables, vectors)}


def _neighbours(rows: dict, relation: str, rng, lo: int, hi: int) -> list[dict]:
    """Neighbours of `rows`: a unit removed or a new unit added (add_remove), or a unit's records replaced
    (replace). The new records are the worst cases: more than k records at the top of the clamp in few
    cells; under replace also the unit's records moved to another cell unchanged (at lo and at hi), and
    its records all lo in one cell beside a neighbour where they are all hi there (a sign flip inside one
    cell when lo < 0)."""
    def extreme(unit: int) -> dict:
        return {"hid": [unit] * 3, "geo": [GEO_LEAVES[0], GEO_LEAVES[0], GEO_LEAVES[5]], "age": [1, 2, 3],
                "sex": ["F", "F", "M"], "income": [10**8] * 3}

    def uniform(unit: int, geo: str, value: int, count: int = 2) -> dict:
        return {"hid": [unit] * count, "geo": [geo] * count, "age": [1] * count, "sex": ["F"] * count,
                "income": [value] * count}

    out = []
    for i, unit in enumerate(rng.choice(sorted(set(rows["hid"])), 6, replace=False).tolist()):
        kept = [j for j, u in enumerate(rows["hid"]) if u != unit]
        removed = {c: [v[j] for j in kept] for c, v in rows.items()}
        if relation == "add_remove":
            out.append((removed, None))
            out.append(({c: rows[c] + extreme(10_000 + i)[c] for c in rows}, None))
            continue
        out.append(({c: removed[c] + extreme(unit)[c] for c in rows}, None))
        # moved: the unit's two records below every candidate > lo, from state 01 to state 02
        before = {c: removed[c] + uniform(unit, GEO_LEAVES[0], lo)[c] for c in rows}
        after = {c: removed[c] + uniform(unit, GEO_LEAVES[3], lo)[c] for c in rows}
        out.append((after, before))
        # flipped: the unit's two records of lo become two of hi in the same cell
        flipped = {c: removed[c] + uniform(unit, GEO_LEAVES[0], hi)[c] for c in rows}
        out.append((flipped, before))
        # moved at the top: two records of hi from state 01 to state 02
        after_high = {c: removed[c] + uniform(unit, GEO_LEAVES[3], hi)[c] for c in rows}
        out.append((after_high, flipped))
    return out


def _score_movement(first: np.ndarray, second: np.ndarray, buckets: int, q: Fraction) -> int:
    """A unit's quantile privacy cost in score units: per cell the largest score change over candidates
    (each cell is its own exponential mechanism), summed over cells."""
    change = np.abs(quantile_scores(first.reshape(-1, buckets), q) - quantile_scores(second.reshape(-1, buckets), q))
    return int(change.max(axis=1).sum())


@pytest.mark.parametrize("relation,clamp", [("add_remove", [0, 1000]), ("replace", [0, 1000]),
                                            ("replace", [-1000, 1000])])
def test_measured_vectors_move_at_most_the_derived_sensitivity_on_neighbours(tmp_path, relation, clamp):
    columns = {**small_spec()["columns"], "income": {**INCOME, "clamp": clamp}}
    spec_doc = measure_spec(neighbouring=relation, columns=columns)
    spec = parse_spec(spec_doc)
    plan = build_plan(spec, write_case(tmp_path, spec_doc).parent)
    rng = np.random.default_rng(5)
    base_rows = {c: list(v.to_pylist() if isinstance(v, pa.Array) else v) for c, v in measure_rows(90).items()}
    seen = {t.name: 0 for t in plan.tables}
    seen_l2 = {t.name: 0 for t in plan.tables}
    for other_rows, reference_rows in _neighbours(base_rows, relation, rng, *clamp):
        base = _vectors(plan, reference_rows or base_rows)
        other = _vectors(plan, other_rows)
        for t in plan.tables:
            if t.statistic == "quantile":
                for q, bound in zip(t.quantiles, t.score_sensitivities):
                    moved = _score_movement(base[t.name], other[t.name], t.layout.buckets, q)
                    assert moved <= bound, (t.name, q, moved, bound)
                    seen[t.name] = max(seen[t.name], moved)
                continue
            diff = base[t.name] - other[t.name]
            assert np.abs(diff).sum() <= t.event.sensitivity.l1, t.name
            assert int((diff * diff).sum()) <= t.event.sensitivity.l2_squared, t.name
            seen[t.name] = max(seen[t.name], int(np.abs(diff).sum()))
            seen_l2[t.name] = max(seen_l2[t.name], int((diff * diff).sum()))
    if relation == "add_remove":  # the added worst case reaches the bound: it is tight
        assert seen["total"] == plan.table("total").event.sensitivity.l1
    else:  # the moved records reach the quantile bound, the worse of moved and flipped the sum's L2 bound
        median = plan.table("median")
        assert seen["median"] == max(median.score_sensitivities)
        assert seen_l2["total"] == plan.table("total").event.sensitivity.l2_squared


# ---- clamping and invalid values ---------------------------------------------------------------------------

def test_values_are_clamped_and_invalid_ones_left_out_of_measures_only(tmp_path):
    spec = measure_spec(privacy_unit=None, contribution={"max_records_per_unit": 1},
                        queries=[{"name": "total", "kind": "sum", "column": "income"},
                                 {"name": "avg", "kind": "mean", "column": "income"},
                                 {"name": "all", "kind": "histogram"}])
    plan = build_plan(parse_spec(spec), write_case(tmp_path, spec).parent)
    rows = {"income": pa.array(["5", "-7", "2000", "99999999999999999999", "x", None, "12.5", "nan", "3.0"]),
            "geo": [GEO_LEAVES[0]] * 9, "age": [1] * 9, "sex": ["F"] * 9}
    columns = plan.encoded_columns()
    codes, keep = encode_batch(pa.table(rows), {c: ColumnEncoder(plan.domains[c]) for c in columns})
    vectors = {t.name: t.layout.measure_vector(codes, 9) for t in plan.tables}
    assert vectors["total"].tolist() == [5 + 0 + 1000 + 1000 + 3]
    assert vectors["avg.count"].tolist() == [5]
    assert vectors["all"].tolist() == [9]  # the records themselves are kept for every other table


def test_sums_are_exact_beyond_double_precision():
    from dprelease.transforms.aggregate import TableLayout

    rows, largest = 3 * 2**22 + 5, 2**31 - 2
    layout = TableLayout("s", ("c",), (None,), (2,), statistic="sum", measure="m", lower=1, invalid=2**31 - 1)
    codes = {"c": np.zeros(rows, dtype=np.int8), "m": np.full(rows, largest, dtype=np.int32)}
    # > 2**53: float64 alone rounds
    assert layout.measure_vector(codes, rows).tolist() == [rows * (largest + 1), 0]


@pytest.mark.parametrize("rows, table_limit", [(50, None), (5000, None), (5000, 10)])
def test_buckets_and_bins_read_from_a_table_are_the_searched_ones(rows, table_limit, monkeypatch):
    """A quantile's buckets are read from a table over the measure's range (C kernel), or searched value by
    value past LOOKUP_VALUES (`table_limit`); a binned column's bins from a table when the batch holds more values
    than its range, else searched. All give the codes a search of every value gives, at every edge, candidate and
    end of the range (nulls and values outside left to their policy)."""
    from dprelease.transforms import aggregate
    from dprelease.transforms.aggregate import TableLayout, quantile_buckets

    if table_limit is not None:
        monkeypatch.setattr(aggregate, "LOOKUP_VALUES", table_limit)
    from dprelease.transforms.domains import IntegerDomain
    from dprelease.transforms.encode import INVALID

    rng = np.random.default_rng(rows)
    lower, upper, candidates = -40, 1000, (-40, -3, 0, 1, 17, 500, 999, 1000)
    values = np.concatenate([np.asarray(candidates), rng.integers(lower, upper + 1, rows)])
    layout = TableLayout("q", ("c",), (None,), (2,), statistic="quantile", measure="m", lower=lower,
                         invalid=upper - lower + 1, candidates=candidates)
    invalid = np.full(7, upper - lower + 1)
    codes = {"c": rng.integers(0, 2, values.size + invalid.size),
             "m": np.concatenate([values - lower, invalid])}
    searched = np.bincount(codes["c"][:values.size] * layout.buckets + quantile_buckets(candidates, values),
                           minlength=layout.n_measured)
    assert layout.measure_vector(codes, codes["c"].size).tolist() == searched.tolist()

    edges = (0, 5, 10, 18, 65, 116)
    domain = IntegerDomain("age", 0, 115, edges, "drop")
    ages = np.concatenate([np.asarray([0, 4, 5, 17, 18, 64, 65, 115, -1, 116]), rng.integers(-5, 120, rows)])
    found = ColumnEncoder(domain).encode(pa.array(ages))
    inside = (ages >= 0) & (ages <= 115)
    expected = np.where(inside, np.searchsorted(np.asarray(edges), np.where(inside, ages, 0), side="right") - 1,
                        INVALID)
    assert found.tolist() == expected.tolist()


# ---- the release, end to end ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    root = tmp_path_factory.mktemp("measures")
    spec = write_case(root / "case", measure_spec(), measure_rows())
    result = run_release(spec, key_file=root / "k.key", out_dir=root / "embedded", ledger=None)
    return {"root": root, "spec": spec, "result": result}


def test_the_release_publishes_every_new_table_and_verifies(measured):
    result = measured["result"]
    tables = result.release_dir / "tables"
    median = pq.read_table(tables / "median.parquet")
    assert median.column_names == ["state", "q", "value"]
    assert median.num_rows == 3 * 2  # 2 states + (other), two quantiles each
    assert set(median.column("value").to_pylist()) <= {0, 10, 100, 500, 1000}
    assert median.column("q").to_pylist()[:2] == [0.5, 0.25]
    assert pq.read_table(tables / "total.parquet").column_names == ["county", "sum"]
    assert min(pq.read_table(tables / "total.parquet").column("sum").to_pylist()) >= 0  # clamp lo >= 0
    assert pq.read_table(tables / "households.parquet").column_names == ["county", "units"]
    mean = pq.read_table(tables / "avg.parquet")
    assert mean.column_names == ["sex", "mean"]
    sums = pq.read_table(result.release_dir / "measurements" / "avg.sum.parquet").column("noisy_sum").to_numpy()
    counts = pq.read_table(result.release_dir / "measurements" / "avg.count.parquet").column("noisy_count").to_numpy()
    expected = [min(max(s / c, 0), 1000) if c >= 1 else None for s, c in zip(sums, counts)]
    assert mean.column("mean").to_pylist() == pytest.approx(expected)
    report = verify_release(result.release_dir)
    assert report.ok, report.problems
    manifest = report.manifest
    record = {t["name"]: t for t in manifest["tables"]}
    assert record["median"]["mechanism"]["kind"] == "exponential"
    assert record["median"]["quantile"] == {"q": ["1/2", "1/4"], "candidates": [0, 10, 100, 500, 1000],
                                            "score_sensitivity": [2, 6]}
    assert record["total"]["measure"] == {"column": "income", "clamp": [0, 1000]}
    assert record["total"]["sensitivity"]["l1"] == 2000
    assert manifest["means"] == [{"table": "avg", "sum_table": "avg.sum", "count_table": "avg.count",
                                  "measure": {"column": "income", "clamp": [0, 1000]}}]
    assert Fraction(manifest["totals"]["epsilon"]["fraction"]) <= 1
    import jsonschema

    from dprelease.accounting.manifest_model import SCHEMA_FILE

    jsonschema.validate(manifest, json.loads(SCHEMA_FILE.read_text()))


def test_verify_rederives_the_new_fields(measured, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(measured["result"].release_dir, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    for edit in (lambda m: m["tables"][0]["measure"].update(clamp=[0, 10]),
                 lambda m: next(t for t in m["tables"] if t["name"] == "median")["quantile"]["candidates"].pop(),
                 lambda m: m["means"][0].update(count_table="by_sex")):
        changed = json.loads(json.dumps(manifest))
        edit(changed)
        (copy / "manifest.json").write_text(json.dumps(changed))
        assert not verify_release(copy).ok


def test_unit_counts_count_each_unit_once_per_cell(tmp_path):
    spec = measure_spec(contribution={"max_records_per_unit": 3},
                        queries=[{"name": "households", "kind": "count_units", "by": ["geo.county"]},
                                 {"name": "people", "kind": "histogram", "by": ["geo.county"]}])
    rows = {"hid": [1, 1, 1, 2, 2, 3], "geo": [GEO_LEAVES[0], GEO_LEAVES[1], GEO_LEAVES[2], GEO_LEAVES[3],
                                               GEO_LEAVES[3], GEO_LEAVES[3]],
            "age": [1] * 6, "sex": ["F"] * 6, "income": [1] * 6}
    plan = build_plan(parse_spec(spec), write_case(tmp_path, spec).parent)
    vectors = _vectors(plan, rows)
    assert vectors["households"].tolist() == [1, 1, 2, 0]  # counties 01001, 01003, 02005, (other)
    assert vectors["people"].tolist() == [2, 1, 3, 0]


@pytest.mark.parametrize("engine", ["spark", "beam"])
def test_every_engine_releases_the_same_bytes(measured, engine):
    options = {"spark": {"master": "local[2]"},
               "beam": {"beam_options": ["--direct_running_mode=multi_processing", "--direct_num_workers=2"]}}
    pytest.importorskip("pyspark" if engine == "spark" else "apache_beam")
    result = run_release(measured["spec"], key_file=measured["root"] / "k.key", out_dir=measured["root"] / engine,
                         ledger=None, engine=engine, **options[engine])
    assert_same_release(measured["result"].release_dir, result.release_dir, engine)


def test_plan_shows_the_new_tables(measured):
    result = subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", "plan", str(measured["spec"])],
                            capture_output=True, text=True, env={"COLUMNS": "220", "PATH": ""})
    assert result.returncode == 0, result.stderr
    assert "quantile(income)" in result.stdout and "EM eps=" in result.stdout and "ranks" in result.stdout
    assert "within clamp [0, 1000]: L1 = L2 = k*max(|lo|,|hi|) = 2000" in result.stdout


def test_combinations_of_statistics_compose_to_the_budget(tmp_path):
    for definition in ({"definition": "pure", "epsilon": "1/3"}, {"definition": "zcdp", "rho": "1/7"},
                       {"definition": "approx", "epsilon": 1, "delta": 1e-9}):
        plan = build_plan(parse_spec(measure_spec(budget=definition)), write_case(tmp_path, measure_spec()).parent)
        spent = plan.totals.pure_epsilon if definition["definition"] == "pure" else plan.totals.rho
        assert 0 < spent <= plan.allocation_budget
        assert spent >= plan.allocation_budget * Fraction(999, 1000)


def test_load_spec_of_the_demo_has_every_new_kind():
    from .conftest import DEMO_SPEC

    spec, _ = load_spec(DEMO_SPEC)
    assert {q.kind for q in spec.queries} >= {"sum", "quantile", "mean"}
