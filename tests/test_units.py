"""Post-processing per geographic unit (`transforms.units`): the two passes equal the global least-squares
estimate and its variances, any grouping of units gives the same bits, and the per-unit integer step
gives the same integers as the whole-table one, consistent at every level."""
from __future__ import annotations

import numpy as np
import pytest

from dprelease.pipelines.plan import build_plan
from dprelease.pipelines.postprocessing import (_estimator_inputs, estimate_variances, integer_step,
                                                least_squares_estimates, post_process, unit_tree)
from dprelease.pipelines.spec import parse_spec
from dprelease.transforms.estimation import generalised_least_squares, gls_variances
from dprelease.transforms.units.groups import transitions
from dprelease.transforms.units.passes import blocks_of, estimate_tree, run_tree

from .conftest import small_spec, write_case

COLUMNS = {**small_spec()["columns"], "race": {"type": "categorical", "values": ["a", "b", "c"]}}
HIERARCHY = {"name": "pop", "kind": "hierarchy", "geography": "geo", "levels": ["nation", "state", "county", "tract"]}
QUERY_SETS = {
    "marginals within county, histogram by county": [
        HIERARCHY,
        {"name": "m", "kind": "marginals", "attributes": ["age", "sex", "race"], "way": 2, "within": "geo.county"},
        {"name": "h", "kind": "histogram", "by": ["geo.county", "age"]}],
    "hierarchy by sex, marginals within tract": [
        {"name": "pop", "kind": "hierarchy", "geography": "geo", "levels": ["nation", "state", "county"], "by": ["sex"]},
        {"name": "m", "kind": "marginals", "attributes": ["age", "sex"], "way": 2, "within": "geo.tract"}],
    "no nation, 3-way marginals over the nation": [
        {"name": "pop", "kind": "hierarchy", "geography": "geo", "levels": ["state", "county", "tract"]},
        {"name": "m", "kind": "marginals", "attributes": ["age", "sex", "race"], "way": 3}],
}


def geography(seed: int) -> list[str]:
    """A ragged geography: 3 states, 1-4 counties each, 1-5 tracts per county (one-child units included)."""
    rng = np.random.default_rng(seed)
    leaves = []
    for state in range(1, 4):
        for county in range(1, int(rng.integers(1, 5)) + 1):
            for tract in range(1, int(rng.integers(1, 6)) + 1):
                leaves.append(f"{state:02d}{county:03d}{tract:06d}")
    return leaves


def plan_for(tmp_path, queries, seed: int = 0, **extra):
    spec = small_spec(columns=COLUMNS, queries=queries, budget={"definition": "zcdp", "rho": "1/3"}, **extra)
    path = write_case(tmp_path, spec)
    (tmp_path / "geo.txt").write_text("\n".join(geography(seed)) + "\n")
    return build_plan(parse_spec(spec), path.parent)


def noisy_values(plan, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {t.name: rng.integers(-5, 60, t.n_outputs).astype(np.int64) for t in plan.tables}


def per_unit(plan, noisy, group_work: int):
    """run_tree's estimates, variances and integers, flat per table."""
    tree = unit_tree(plan)
    out = {}
    for _, output in run_tree(tree, blocks_of(tree, noisy), transitions(tree, group_work)):
        for name in output.published:
            out[name] = tuple(np.asarray(a[name]).ravel() for a in (output.estimates, output.variances,
                                                                     output.published))
    return out


@pytest.mark.parametrize("queries", QUERY_SETS.values(), ids=QUERY_SETS.keys())
def test_per_unit_estimate_is_the_global_least_squares_estimate(tmp_path, queries):
    plan = plan_for(tmp_path, queries)
    assert unit_tree(plan) is not None
    tables, inputs, geographies = _estimator_inputs(plan)
    noisy = noisy_values(plan, 1)
    ours, our_variances = estimate_tree(unit_tree(plan), {t.name: noisy[t.name] for t in tables})
    reference = generalised_least_squares(inputs, [noisy[t.name] for t in tables], geographies)
    reference_variances, exact = gls_variances(inputs, geographies)
    assert exact
    for table, expected, variance in zip(tables, reference, reference_variances):
        assert np.max(np.abs(ours[table.name] - expected)) < 1e-8, table.name
        np.testing.assert_allclose(our_variances[table.name], variance, rtol=1e-9, atol=1e-12)


def test_invariant_levels_stay_exact(tmp_path):
    plan = plan_for(tmp_path, list(QUERY_SETS.values())[0], invariants=["pop.state"], neighbouring="replace")
    noisy = noisy_values(plan, 2)
    estimates = least_squares_estimates(plan, noisy)
    np.testing.assert_array_equal(estimates["pop.state"], noisy["pop.state"])
    assert np.all(estimate_variances(plan).per_cell["pop.state"] == 0)


@pytest.mark.parametrize("queries", QUERY_SETS.values(), ids=QUERY_SETS.keys())
def test_any_grouping_of_units_gives_the_same_bits(tmp_path, queries):
    plan = plan_for(tmp_path, queries, seed=3)
    noisy = noisy_values(plan, 4)
    one_group = per_unit(plan, noisy, 10**9)
    for group_work in (1, 7, 100):
        grouped = per_unit(plan, noisy, group_work)
        assert grouped.keys() == one_group.keys()
        for name, arrays in one_group.items():
            for ours, reference in zip(grouped[name], arrays):
                np.testing.assert_array_equal(ours, reference)
    tree = unit_tree(plan)
    whole = estimate_tree(tree, noisy, batch=4096)
    for batch in (1, 3):
        for ours, reference in zip(estimate_tree(tree, noisy, batch=batch), whole):
            for name in reference:
                np.testing.assert_array_equal(ours[name], reference[name])
    assert len(transitions(tree, 1)[-1].parent_start) > 2  # the small budget really made several groups


@pytest.mark.parametrize("queries", QUERY_SETS.values(), ids=QUERY_SETS.keys())
@pytest.mark.parametrize("seed", range(3))
def test_per_unit_integers_equal_the_whole_table_integer_step(tmp_path, queries, seed):
    plan = plan_for(tmp_path, queries, seed=seed)
    noisy = noisy_values(plan, 10 + seed)
    published = post_process(plan, noisy, group_work=5)
    whole = integer_step(plan, least_squares_estimates(plan, noisy), noisy, None)
    assert published.keys() == whole.keys()
    for name in whole:
        np.testing.assert_array_equal(published[name], whole[name])


def test_published_tables_add_up_at_every_level(tmp_path):
    plan = plan_for(tmp_path, list(QUERY_SETS.values())[0], seed=5)
    published = post_process(plan, noisy_values(plan, 6), group_work=3)
    geo = plan.domains["geo"]
    levels = ["nation", "state", "county", "tract"]
    for parent, child in zip(levels, levels[1:]):
        parents = published[f"pop.{parent}"]
        sums = np.bincount(geo.parent_of(child, parent), weights=published[f"pop.{child}"],
                           minlength=parents.size)
        np.testing.assert_array_equal(sums, parents)
    counties = published["pop.county"]
    for table in (t for t in plan.tables if t.query == "m"):
        values = published[table.name].reshape(counties.size, -1)
        np.testing.assert_array_equal(values.sum(axis=1), counties)  # each marginal's total is its county's
    assert all(np.all(values >= 0) for values in published.values())


@pytest.mark.parametrize("queries", QUERY_SETS.values(), ids=QUERY_SETS.keys())
def test_variances_on_demand_are_the_passes_bits(tmp_path, queries):
    """`TreeVariances` (a range of cells from each unit's final total variance, what verify and the manifest
    read a part at a time) gives the bits of the full passes."""
    plan = plan_for(tmp_path, queries, seed=6)
    tree = unit_tree(plan)
    _, full = estimate_tree(tree, {n: np.zeros(t.n_cells) for n, t in tree.tables.items()})
    lazy = estimate_variances(plan)
    rng = np.random.default_rng(0)
    for name, expected in full.items():
        np.testing.assert_array_equal(lazy.per_cell[name], expected)
        assert lazy.largest(name) == expected.max()
        for _ in range(5):
            start, stop = sorted(rng.integers(0, expected.size + 1, 2))
            np.testing.assert_array_equal(lazy.cells(name, start, stop), expected[start:stop])
