"""The workload-optimal measurement of published marginals (`transforms.strategy`): its error formula against
a dense least-squares computation, its optimality, its exact allocation in the plan, and a release whose
lower-way tables are measured, published and verified."""
from __future__ import annotations

import itertools
import json
import math
from fractions import Fraction

import numpy as np
import pyarrow.parquet as pq
import pytest

from dprelease.accounting.errors import SpecError
from dprelease.accounting.mechanisms import calibrate_gaussian, compact_gaussian_budget
from dprelease.accounting.sensitivity import Sensitivity
from dprelease.pipelines.plan import build_plan, measured_strategy
from dprelease.pipelines.run import run_release
from dprelease.pipelines.spec import parse_spec
from dprelease.pipelines.verify import verify_release
from dprelease.transforms import strategy
from dprelease.transforms.strategy import _optimise, _Problem, down_closure, optimal_strategy

from .conftest import GEO_LEAVES, small_spec

SIZES = {"a": 2, "b": 3, "c": 4, "d": 6}


def _marginal_matrix(marginal: tuple[str, ...], attributes: list[str]) -> np.ndarray:
    """0/1 matrix summing the full joint (C order over `attributes`) into the marginal's cells."""
    rows = []
    for cell in itertools.product(*(range(SIZES[a]) for a in attributes)):
        index = 0
        for a in marginal:
            index = index * SIZES[a] + cell[attributes.index(a)]
        rows.append(index)
    matrix = np.zeros((math.prod(SIZES[a] for a in marginal), len(rows)))
    matrix[rows, np.arange(len(rows))] = 1
    return matrix


def _dense_loss(workload, tables, shares) -> float:
    """sum over W of trace(Cov(GLS estimate of W)) / sqrt(cells of W), from the full design matrix."""
    attributes = sorted(SIZES)
    design = np.vstack([_marginal_matrix(t, attributes) for t in tables])
    precision = np.concatenate([np.full(math.prod(SIZES[a] for a in t), s) for t, s in zip(tables, shares)])
    information = np.linalg.pinv(design.T @ (precision[:, None] * design))
    loss = 0.0
    for w in workload:
        query = _marginal_matrix(w, attributes)
        loss += np.trace(query @ information @ query.T) / math.sqrt(query.shape[0])
    return loss


@pytest.mark.parametrize("way", [2, 3])
def test_error_formula_equals_dense_least_squares(way):
    workload = list(itertools.combinations(sorted(SIZES), way))
    tables = down_closure(workload)
    rng = np.random.default_rng(way)
    shares = list(rng.uniform(0.2, 1.0, len(tables)))
    total = sum(shares)
    shares = [s / total for s in shares]
    assert _Problem(workload, tables, SIZES).error(shares) == pytest.approx(_dense_loss(workload, tables, shares),
                                                                            rel=1e-9)


def test_optimum_beats_direct_and_every_nearby_split():
    sizes = {"a": 2, "b": 50, "c": 7, "d": 100}
    workload = list(itertools.combinations(sizes, 2))
    found = optimal_strategy(workload, sizes)
    assert found.error < 0.9 * found.direct_error
    problem = _Problem(workload, list(found.tables), sizes)
    shares = [w / sum(found.weights) for w in found.weights]
    rng = np.random.default_rng(0)
    for _ in range(200):
        moved = np.maximum(np.array(shares) * np.exp(rng.normal(0, 0.05, len(shares))), 1e-12)
        assert problem.error(list(moved / moved.sum())) >= found.error * (1 - 1e-9)
    longer = _Problem(workload, list(found.tables), sizes)
    more = longer.error(_optimise_for(longer, 1000))
    assert found.error == pytest.approx(more, rel=1e-6)


def _optimise_for(problem, iterations: int) -> list[float]:
    shares = [1.0 / len(problem.candidates)] * len(problem.candidates)
    for _ in range(iterations):
        shares = problem.step(shares)
    return shares


def test_the_down_closure_never_makes_the_split_worse():
    """A workload holding `a` only inside huge tables: the down-closure's 1-way tables are considered, and the
    strategy is never worse than the best split of the workload's own tables, nor than measuring them alike."""
    sizes = {"a": 2, "b": 1000, "c": 1000}
    workload = [("a", "b"), ("a", "c")]
    assert down_closure(workload) == [("a", "b"), ("a", "c"), ("a",), ("b",), ("c",)]
    found = optimal_strategy(workload, sizes)
    own = _Problem(workload, list(workload), sizes)
    assert found.error <= own.error(_optimise(own)) * (1 + 1e-12)
    assert found.error <= found.direct_error * (1 + 1e-12)


def _spec(**query):
    document = small_spec(budget={"definition": "zcdp", "rho": "1/2"})
    document["columns"]["race"] = {"type": "categorical", "values": ["a", "b", "c", "d", "e", "f", "g"]}
    document["queries"] = [{"name": "m", "kind": "marginals", "attributes": ["age", "sex", "race", "geo.county"],
                            "way": 2, **query}]
    return document


def test_plan_splits_the_query_budget_exactly_by_the_strategy(tmp_path):
    (tmp_path / "geo.txt").write_text("\n".join(GEO_LEAVES) + "\n")
    document = _spec()
    document["columns"]["geo"]["domain_file"] = str(tmp_path / "geo.txt")
    plan = build_plan(parse_spec(document), tmp_path)
    direct = build_plan(parse_spec({**document, "queries": [{**document["queries"][0], "strategy": "direct"}]}),
                        tmp_path)
    found = measured_strategy(plan.spec.queries[0], plan.spec, plan.domains)
    assert found.tables == tuple(itertools.combinations(["age", "sex", "race", "geo.county"], 2))
    allocated = {t.name: t.event.allocated for t in plan.tables}
    assert sum(allocated.values(), Fraction(0)) == Fraction(1, 2)
    optimal = {"m." + "-".join(a.replace(".", "_") for a in t): Fraction(1, 2) * w / sum(found.weights)
               for t, w in zip(found.tables, found.weights)}
    assert set(allocated) == set(optimal) and len(set(allocated.values())) > 1  # not the equal split
    largest = max(optimal, key=optimal.get)
    for name, part in allocated.items():  # on the variance grid: within 1/32 below the optimal share
        assert part >= optimal[name] if name == largest else optimal[name] * 32 / 33 <= part <= optimal[name]
    for t in plan.tables:  # every share spent exactly (no rounding waste) but the largest's, at most its share
        assert t.event.loss == t.event.allocated or (t.name == largest and t.event.loss <= t.event.allocated)
    assert plan.totals.rho <= Fraction(1, 2) and len(str(plan.totals.rho)) < 100
    assert {t.event.allocated for t in direct.tables} == {Fraction(1, 12)}
    assert {t.name for t in direct.tables} == set(allocated)
    again = build_plan(parse_spec(document), tmp_path)
    assert [t.event.mechanism for t in again.tables] == [t.event.mechanism for t in plan.tables]


def test_direct_strategy_belongs_to_published_tables():
    document = _spec(select="mst", strategy="direct")
    document["queries"][0]["attributes"] = ["age", "sex", "race"]
    with pytest.raises(SpecError, match=r"queries\[0\]\.strategy = 'direct': only published tables"):
        parse_spec(document)
    assert "strategy" not in parse_spec(_spec()).canonical_json()  # the default keeps older specs' hash
    assert '"strategy":"direct"' in parse_spec(_spec(strategy="direct")).canonical_json().replace(" ", "")


def test_lower_tables_are_measured_published_and_verified(tmp_path, monkeypatch):
    """Kept however small their share, the down-closure's 1-way tables are measured, published, agree with the
    2-way tables, and `verify` recomputes the plan that measured them."""
    monkeypatch.setattr(strategy, "DROP_BELOW", 0.0)
    monkeypatch.setattr(strategy, "_choose", lambda fits: fits[-1])  # the down-closure's fit, however it scores
    strategy._optimal_strategy.cache_clear()
    try:
        rng = np.random.default_rng(3)
        n = 4000
        rows = {"pid": np.arange(n), "geo": rng.choice(GEO_LEAVES, n), "age": rng.integers(0, 100, n),
                "sex": rng.choice(["F", "M"], n), "race": rng.choice(list("abcdefg"), n)}
        from .conftest import write_case
        spec = write_case(tmp_path / "case", _spec(), rows)
        result = run_release(spec, key_file=tmp_path / "k.key")
        names = {t.name for t in result.plan.tables}
        assert {"m.age", "m.sex", "m.race", "m.geo_county"} <= names and "m.age-sex" in names
        tables = {t.name: np.array(pq.read_table(result.release_dir / "tables" / f"{t.name}.parquet")
                                   .column("count").to_pylist()).reshape([d.size for d in t.dims])
                  for t in result.plan.tables}
        assert np.array_equal(tables["m.age-sex"].sum(1), tables["m.age"])
        assert np.array_equal(tables["m.sex-race"].sum(0), tables["m.race"])
        assert all((t >= 0).all() for t in tables.values())
        manifest = json.loads((result.release_dir / "manifest.json").read_text())
        assert {"m.age", "m.sex"} <= {e["name"] for e in manifest["tables"]}
        assert verify_release(result.release_dir).ok
    finally:
        strategy._optimal_strategy.cache_clear()


@pytest.mark.parametrize("rho", [Fraction(1, 3), Fraction(1, 5000), Fraction(123456789, 10 ** 12), Fraction(7),
                                 Fraction(1, 10 ** 9)])
@pytest.mark.parametrize("l2_squared", [1, 4, 9])
def test_compact_budget_is_below_and_near_and_spent_exactly(rho, l2_squared):
    sensitivity = Sensitivity(math.isqrt(l2_squared), l2_squared, "test")
    compact = compact_gaussian_budget(rho, sensitivity)
    assert rho * 32 / 33 <= compact <= rho
    sigma2 = Fraction(l2_squared) / (2 * compact)
    step = Fraction(2) ** (math.floor(math.log2(sigma2)) - 5)  # 6 bits of mantissa
    assert (sigma2 / step).denominator == 1 and 32 <= sigma2 / step < 64
    assert calibrate_gaussian(compact, sensitivity, "t").sigma2 == sigma2


def _auto_document(budget: dict) -> dict:
    document = _spec()
    document["budget"] = budget
    document["queries"] = [{"name": "m", "kind": "marginals", "attributes": ["age", "sex", "race"], "select": "auto"}]
    return document


@pytest.mark.parametrize("budget, mode", [({"definition": "zcdp", "rho": "1/10000"}, "mst"),
                                          ({"definition": "zcdp", "rho": "1/100"}, "aim"),
                                          ({"definition": "approx", "epsilon": "0.1", "delta": 1e-9}, "mst"),
                                          ({"definition": "approx", "epsilon": "1", "delta": 1e-9}, "aim"),
                                          ({"definition": "pure", "epsilon": "0.02"}, "mst")])
def test_auto_select_chooses_from_the_budget_per_attribute(budget, mode):
    spec = parse_spec(_auto_document(budget))
    assert spec.queries[0].select == mode
    assert spec.auto_selections["m"].startswith(f"select: auto chose {mode}: the query's rho per attribute")
    explicit = _auto_document(budget)
    explicit["queries"][0]["select"] = mode
    assert parse_spec(explicit).spec_hash() == spec.spec_hash() and "auto" not in spec.canonical_json()
    assert parse_spec(explicit).auto_selections == {}


def test_auto_select_weighs_the_query_share_and_rechooses_at_another_budget(tmp_path):
    document = _auto_document({"definition": "zcdp", "rho": "3/1000"})  # 1/1000 per attribute: aim
    assert parse_spec(document).queries[0].select == "aim"
    document["queries"].append({"name": "h", "kind": "histogram", "by": ["sex"], "weight": 9})  # a tenth: mst
    assert parse_spec(document).queries[0].select == "mst"
    from dprelease import Release
    (tmp_path / "geo.txt").write_text("\n".join(GEO_LEAVES) + "\n")
    path = tmp_path / "spec.yaml"
    document["columns"]["geo"]["domain_file"] = "geo.txt"
    path.write_text(json.dumps(document))
    release = Release.from_yaml(path)
    assert release.spec.queries[0].select == "mst"
    assert release.with_budget(rho="1").spec.queries[0].select == "aim"


def test_an_auto_selected_release_runs_says_why_and_verifies(tmp_path):
    from dprelease.pipelines.cli import _path_lines

    rng = np.random.default_rng(5)
    n = 3000
    rows = {"pid": np.arange(n), "geo": rng.choice(GEO_LEAVES, n), "age": rng.integers(0, 100, n),
            "sex": rng.choice(["F", "M"], n), "race": rng.choice(list("abcdefg"), n)}
    from .conftest import write_case
    spec = write_case(tmp_path / "case", _auto_document({"definition": "zcdp", "rho": "1/10"}), rows)
    result = run_release(spec, key_file=tmp_path / "k.key")
    assert any(line.startswith("Selection m: select: auto chose aim") for line in _path_lines(result.plan))
    manifest = json.loads((result.release_dir / "manifest.json").read_text())
    assert manifest["spec"]["queries"][0]["select"] == "aim"
    assert verify_release(result.release_dir).ok


def test_a_tiny_variance_stays_on_the_calibrations_grid():
    sensitivity = Sensitivity(1, 1, "test")
    for rho in (Fraction(10 ** 6), Fraction(123456, 7), Fraction(40000)):
        compact = compact_gaussian_budget(rho, sensitivity)
        assert 0 < compact <= rho and calibrate_gaussian(compact, sensitivity, "t").privacy_loss(sensitivity) == compact


def test_a_release_of_manifest_version_6_is_replanned_with_its_tables_measured_directly(tmp_path, monkeypatch):
    """A release made before the optimal split (every table measured directly, manifest version 6) still
    verifies; the same release claiming version 7 does not (its allocations are not the optimal split's)."""
    from dprelease.pipelines import plan as planning

    rng = np.random.default_rng(6)
    n = 2000
    rows = {"pid": np.arange(n), "geo": rng.choice(GEO_LEAVES, n), "age": rng.integers(0, 100, n),
            "sex": rng.choice(["F", "M"], n), "race": rng.choice(list("abcdefg"), n)}
    from .conftest import write_case
    spec = write_case(tmp_path / "case", _spec(), rows)
    with monkeypatch.context() as patched:  # the code before version 7: no query measured by its split
        patched.setattr(planning, "measured_strategy", lambda *args, **kwargs: None)
        result = run_release(spec, key_file=tmp_path / "k.key")
    path = result.release_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    assert len({t["allocated"]["fraction"] for t in manifest["tables"]}) == 1  # the equal split
    manifest["manifest_version"] = 6
    path.write_text(json.dumps(manifest, indent=2))
    assert verify_release(result.release_dir).ok, verify_release(result.release_dir).problems
    manifest["manifest_version"] = 7
    path.write_text(json.dumps(manifest, indent=2))
    assert any("allocat" in p for p in verify_release(result.release_dir).problems)


def test_auto_select_falls_back_to_mst_past_aims_attributes_and_words_errors_as_auto():
    document = _auto_document({"definition": "zcdp", "rho": "1000"})
    for i in range(61):
        document["columns"][f"c{i}"] = {"type": "categorical", "values": ["a", "b"]}
    document["queries"][0]["attributes"] = [f"c{i}" for i in range(61)]
    spec = parse_spec(document)
    assert spec.queries[0].select == "mst" and "61 attributes, more than aim takes (60)" in spec.auto_selections["m"]
    with pytest.raises(SpecError, match=r"queries\[0\]\.degree = 1: `select: auto` takes no degree"):
        parse_spec(_auto_document({"definition": "zcdp", "rho": "1"}) | {"queries": [
            {"name": "m", "kind": "marginals", "attributes": ["age", "sex", "race"], "select": "auto", "degree": 1}]})
    with pytest.raises(SpecError, match=r"select = 'auto' \(chose 'aim'\): needs way = 2"):
        parse_spec(_auto_document({"definition": "zcdp", "rho": "1"}) | {"queries": [
            {"name": "m", "kind": "marginals", "attributes": ["age", "sex", "race"], "select": "auto", "way": 3}]})


def test_a_wide_query_is_planned_without_the_quadratic_pair_search(tmp_path, monkeypatch):
    """30 attributes, all 435 pairs: one level of tables has no links across levels, so the exact variances
    need no search over the pairs of tables (it took 17 s here; 40 attributes' 3-way tables never finished)."""
    from dprelease.pipelines.postprocessing import estimate_variances
    from dprelease.transforms import estimation

    document = _spec()
    document["columns"] = {f"c{i}": {"type": "categorical", "values": list("abcd")} for i in range(30)}
    document["queries"] = [{"name": "m", "kind": "marginals", "attributes": [f"c{i}" for i in range(30)]}]
    plan = build_plan(parse_spec(document), tmp_path)
    monkeypatch.setattr(estimation, "linked_pairs", lambda *args: pytest.fail("searched the pairs of tables"))
    variances = estimate_variances(plan)
    assert variances.exact and len(variances.per_cell) == 435
