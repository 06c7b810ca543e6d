"""Consistency post-processing: exactness, optimality, invariants, degenerate inputs."""
from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from dprelease.pipelines import postprocessing
from dprelease.pipelines.run import run_release
from dprelease.pipelines.verify import verify_release
from dprelease.transforms.postprocess import hierarchical_least_squares, top_down_hierarchy

from .conftest import GEO_LEAVES

# a 3-level tree: root -> 3 -> 7 leaves
P1 = np.array([0, 0, 0])
P2 = np.array([0, 0, 1, 1, 1, 2, 2])


def _design() -> np.ndarray:
    a1 = np.zeros((3, 7))
    a1[P2, np.arange(7)] = 1
    return np.vstack([np.ones((1, 7)), a1, np.eye(7)])


def _measure(truth: np.ndarray, sd: list[float], rng) -> list[np.ndarray]:
    lvl1 = np.zeros((3, truth.shape[1]))
    np.add.at(lvl1, P2, truth)
    levels = [lvl1.sum(0, keepdims=True), lvl1, truth]
    return [x + rng.normal(0, s, x.shape) for x, s in zip(levels, sd)]


def test_least_squares_equals_brute_force_gls():
    rng = np.random.default_rng(0)
    variances = [9.0, 1.0, 2.5]
    noisy = _measure(rng.integers(0, 50, (7, 4)).astype(float), [3, 1, 1.6], rng)
    estimate = hierarchical_least_squares(noisy, variances, [None, P1, P2])
    a = _design()
    w = np.diag(np.repeat([1 / 9.0, 1.0, 1 / 2.5], [1, 3, 7]))
    for c in range(4):
        y = np.concatenate([lvl[:, c] for lvl in noisy])
        x = np.linalg.solve(a.T @ w @ a, a.T @ w @ y)
        assert np.allclose(estimate[2][:, c], x, atol=1e-9)
        assert np.allclose(estimate[1][:, c], a[1:4] @ x, atol=1e-9)
        assert np.allclose(estimate[0][:, c], a[0] @ x, atol=1e-9)


def test_least_squares_reduces_error_at_every_level_and_matches_blue_variance():
    rng = np.random.default_rng(1)
    replicates = 20_000  # carried as attribute cells: one vectorized call
    variances = [25.0, 4.0, 1.0]
    truth = np.repeat(rng.integers(0, 100, (7, 1)).astype(float), replicates, axis=1)
    noisy = _measure(truth, [5, 2, 1], rng)
    estimate = hierarchical_least_squares(noisy, variances, [None, P1, P2])
    a = _design()
    covariance = np.linalg.inv(a.T @ np.diag(1 / np.repeat(variances, [1, 3, 7])) @ a)
    true_levels = _measure(truth, [0, 0, 0], rng)
    for level, rows in ((0, a[0:1]), (1, a[1:4]), (2, a[4:])):
        raw_mse = np.mean((noisy[level] - true_levels[level]) ** 2)
        ls_mse = np.mean((estimate[level] - true_levels[level]) ** 2, axis=1)
        theory = np.diag(rows @ covariance @ rows.T)
        assert ls_mse.mean() < raw_mse
        assert np.allclose(ls_mse, theory, rtol=0.06)  # 20,000 replicates: relative SE about 1%


def test_exact_levels_stay_exact():
    rng = np.random.default_rng(2)
    truth = rng.integers(0, 30, (7, 3)).astype(float)
    noisy = _measure(truth, [4, 0, 2], rng)  # level 1 is an invariant
    estimate = hierarchical_least_squares(noisy, [16.0, 0.0, 4.0], [None, P1, P2])
    assert np.allclose(estimate[1], noisy[1])
    assert np.allclose(estimate[0], noisy[1].sum(0, keepdims=True))
    assert np.allclose(np.bincount(P2, estimate[2][:, 0], 3), noisy[1][:, 0])


@pytest.mark.parametrize("sd", [0.0, 1e6])
def test_degenerate_inputs_stay_consistent(sd):
    rng = np.random.default_rng(3)
    zero = np.zeros((7, 2))
    noisy = _measure(zero, [sd, sd, sd], rng)
    estimate = hierarchical_least_squares(noisy, [sd * sd + 1] * 3, [None, P1, P2])
    final = top_down_hierarchy(estimate, [None, P1, P2])
    for parent, child, mapping in ((final[0], final[1], P1), (final[1], final[2], P2)):
        assert np.array_equal(np.vstack([np.bincount(mapping, child[:, c], parent.shape[0]) for c in range(2)]).T, parent)
        assert (child >= 0).all() and child.dtype == np.int64
    if sd == 0:
        assert all((f == 0).all() for f in final)


def test_one_child_equals_its_parent():
    noisy = [np.array([[10.0]]), np.array([[13.0]])]
    estimate = hierarchical_least_squares(noisy, [1.0, 1.0], [None, np.array([0])])
    assert estimate[0][0, 0] == pytest.approx(11.5) and estimate[1][0, 0] == pytest.approx(11.5)
    assert top_down_hierarchy(estimate, [None, np.array([0])])[1][0, 0] == 12


def _release(case, tmp_path, **overrides):
    rng = np.random.default_rng(4)
    n = 3000
    rows = {"pid": np.arange(n), "geo": rng.choice(GEO_LEAVES, n), "age": rng.integers(0, 100, n),
            "sex": rng.choice(["F", "M"], n)}
    spec = {"budget": {"definition": "zcdp", "rho": "1/2"}, **overrides}
    return run_release(case(rows=rows, **spec), key_file=tmp_path / "k.key"), rows


def _table(result, name, folder="tables"):
    return pq.read_table(result.release_dir / folder / f"{name}.parquet").to_pydict()


def test_invariants_are_exact_and_listed(case, tmp_path):
    result, rows = _release(case, tmp_path, invariants=["pop.state"], neighbouring="replace")
    states = _table(result, "pop.state")
    truth = {s: sum(1 for g in rows["geo"] if g.startswith(s)) for s in ("01", "02")}
    assert dict(zip(states["state"], states["count"])) == {**truth, "(other)": 0}
    assert _table(result, "pop.state", "measurements")["noisy_count"] == states["count"]
    assert _table(result, "pop.nation")["count"] == [3000]
    counties = _table(result, "pop.county")
    assert sum(c for u, c in zip(counties["county"], counties["count"]) if u.startswith("01")) == truth["01"]
    manifest = json.loads((result.release_dir / "manifest.json").read_text())
    assert [i["table"] for i in manifest["invariants"]] == ["pop.state"]
    record = next(t for t in manifest["tables"] if t["name"] == "pop.state")
    assert record["invariant"] is True and record["mechanism"] is None
    assert verify_release(result.release_dir).ok


def _marginal_checks(result, plan):
    marginals = {t.name: _table(result, t.name) for t in plan.tables if t.query == "agesex"}
    (name, table), = marginals.items()
    by_state = {}
    for state, count in zip(table["state"], table["count"]):
        by_state[state] = by_state.get(state, 0) + count
    population = _table(result, "pop.state")
    assert by_state == dict(zip(population["state"], population["count"]))
    assert min(table["count"]) >= 0


def test_marginal_totals_match_the_hierarchy(case, tmp_path):
    result, _ = _release(case, tmp_path)
    _marginal_checks(result, result.plan)


def test_marginals_agree_on_shared_sub_marginals(case, tmp_path):
    queries = [
        {"name": "pop", "kind": "hierarchy", "geography": "geo", "levels": ["nation", "state", "county"]},
        {"name": "m", "kind": "marginals", "attributes": ["age", "sex", "geo.tract"], "way": 2, "within": None},
    ]
    del queries[1]["within"]
    result, _ = _release(case, tmp_path, queries=queries)
    tables = {t.name: np.array(_table(result, t.name)["count"]).reshape([d.size for d in t.dims])
              for t in result.plan.tables if t.query == "m"}
    age_sex, age_tract, sex_tract = tables["m.age-sex"], tables["m.age-geo_tract"], tables["m.sex-geo_tract"]
    assert np.array_equal(age_sex.sum(1), age_tract.sum(1))
    assert np.array_equal(age_sex.sum(0), sex_tract.sum(1))
    assert np.array_equal(age_tract.sum(0), sex_tract.sum(0))
    assert age_sex.sum() == _table(result, "pop.nation")["count"][0]
    assert all((t >= 0).all() for t in tables.values())


def test_marginals_without_joint_fit_keep_totals(case, tmp_path, monkeypatch):
    monkeypatch.setattr(postprocessing, "JOINT_UNIT_LIMIT", 0)
    result, _ = _release(case, tmp_path)
    _marginal_checks(result, result.plan)
    manifest = json.loads((result.release_dir / "manifest.json").read_text())
    assert "too large" in next(s["step"] for s in manifest["post_processing"] if s["query"] == "agesex")
