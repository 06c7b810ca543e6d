"""The graphical model over any measured cliques (`transforms.units.graphical`): its junction tree, a fit equal
to the dense least-squares fit on small cyclic models, tables of any attributes, integer tables that add up
and records that tabulate to them."""
import itertools
import math

import numpy as np
import pytest
from scipy.optimize import minimize

from dprelease.transforms.units import graphical as g


def _connected(tree: g.JunctionTree, members: list[int]) -> bool:
    """Whether the cliques `members` form one connected part of the tree."""
    members = set(members)
    reached = {min(members)}
    changed = True
    while changed:
        changed = False
        for i in members - reached:
            if tree.parents[i] in reached or any(tree.parents[j] == i for j in reached):
                reached.add(i)
                changed = True
    return reached == members


def _check_tree(tree: g.JunctionTree, cliques) -> None:
    assert tree.parents[0] == -1
    assert all(0 <= p < i for i, p in enumerate(tree.parents) if i)
    for clique in cliques:
        assert any(set(clique) <= set(c) for c in tree.cliques), clique
    for a in tree.attributes:
        holding = [i for i, c in enumerate(tree.cliques) if a in c]
        assert holding and _connected(tree, holding), a  # running intersection
    for c in tree.cliques:
        assert c == tuple(a for a in tree.attributes if a in c)


@pytest.mark.parametrize("cliques,expected", [
    ([("a", "b"), ("b", "c"), ("a", "c")], [("a", "b", "c"), ("d",)]),
    ([("a", "b"), ("b", "c"), ("c", "d")], [("a", "b"), ("b", "c"), ("c", "d")]),
    ([("a", "b"), ("b", "c"), ("c", "d"), ("a", "d")], [("a", "b", "c"), ("a", "c", "d")]),
    ([("a", "b"), ("c", "d")], [("a", "b"), ("c", "d")]),
    ([("a", "b", "c"), ("b", "c"), ("c", "d")], [("a", "b", "c"), ("c", "d")]),
])
def test_junction_tree_of_cycles_trees_and_parts(cliques, expected):
    sizes = {"a": 2, "b": 3, "c": 4, "d": 5}
    tree = g.junction_tree("abcd", cliques, sizes)
    _check_tree(tree, cliques)
    assert sorted(tree.cliques) == sorted(expected)
    assert tree == g.junction_tree("abcd", cliques, sizes)  # deterministic


def test_junction_tree_of_random_graphs_keeps_running_intersection():
    rng = np.random.default_rng(0)
    attributes = tuple("abcdefgh")
    sizes = dict(zip(attributes, rng.integers(2, 6, size=8).tolist()))
    for _ in range(60):
        cliques = [tuple(sorted(rng.choice(8, size=rng.integers(2, 4), replace=False).tolist()))
                   for _ in range(rng.integers(1, 9))]
        cliques = [tuple(attributes[i] for i in c) for c in cliques]
        _check_tree(g.junction_tree(attributes, cliques, sizes), cliques)


ATTRIBUTES = ("a", "b", "c", "d")
SIZES = {"a": 2, "b": 3, "c": 2, "d": 3}


def _margin(joint: np.ndarray, clique) -> np.ndarray:
    """(units, *ATTRIBUTES) joint summed to the clique."""
    return joint.sum(axis=tuple(1 + i for i, a in enumerate(ATTRIBUTES) if a not in clique))


def _measurements(rng, units: int, cliques, noise: float = 5.0) -> tuple[np.ndarray, list[g.Measurement]]:
    cells = math.prod(SIZES.values())
    joint = rng.dirichlet(np.full(cells, 3.0), size=units).reshape((units,) + tuple(SIZES.values())) * 5000
    out = []
    for clique in cliques:
        exact = _margin(joint, clique)
        variance = (noise if len(clique) > 1 else 2 * noise) ** 2
        out.append(g.Measurement(clique, exact + rng.normal(0, math.sqrt(variance), size=exact.shape), variance))
    return joint, out


def _dense_fit(measurements: list[g.Measurement], unit: int, total: float) -> np.ndarray:
    """The weighted least-squares joint (nonnegative, summing to `total`) by a dense solver."""
    cells = math.prod(SIZES.values())
    rows, values, weights = [], [], []
    for m in measurements:
        axes = [ATTRIBUTES.index(a) for a in m.clique]
        for index in itertools.product(*[range(SIZES[a]) for a in m.clique]):
            row = np.zeros(tuple(SIZES.values()))
            where: list = [slice(None)] * len(ATTRIBUTES)
            for axis, i in zip(axes, index):
                where[axis] = i
            row[tuple(where)] = 1
            rows.append(row.ravel())
            values.append(m.values[unit][index])
            weights.append(1 / m.variance)
    a, y, w = np.array(rows), np.array(values), np.array(weights)
    found = minimize(lambda p: 0.5 * np.sum(w * (a @ p - y) ** 2), np.full(cells, total / cells),
                     jac=lambda p: a.T @ (w * (a @ p - y)), method="SLSQP", bounds=[(0, None)] * cells,
                     constraints=[{"type": "eq", "fun": lambda p: p.sum() - total, "jac": lambda p: np.ones(cells)}],
                     options={"ftol": 1e-15, "maxiter": 2000})
    return found.x.reshape(tuple(SIZES.values()))


@pytest.mark.parametrize("cliques", [
    [("a", "b"), ("b", "c"), ("c", "d"), ("a", "d"), ("a",), ("b",)],     # a 4-cycle
    [("a", "b"), ("b", "c"), ("a", "c"), ("c", "d"), ("d",)],             # a triangle and a pendant pair
    [("a", "b", "c"), ("b", "c", "d"), ("a", "d")],                       # 3-way tables closing a cycle
])
def test_fit_equals_the_dense_least_squares_fit(cliques):
    rng = np.random.default_rng(len(cliques))
    _, measurements = _measurements(rng, 2, cliques)
    tree = g.junction_tree(ATTRIBUTES, cliques, SIZES)
    model = g.fit(tree, SIZES, measurements, iterations=3000)
    marginals = model.marginals()
    for unit in range(2):
        dense = _dense_fit(measurements, unit, float(model.totals[unit]))[None]
        for m in measurements:
            assert np.abs(model.table(m.clique, marginals)[unit] - _margin(dense, m.clique)[0]).max() < 1e-3


def test_fit_of_the_exact_tables_recovers_them():
    rng = np.random.default_rng(5)
    cliques = [("a", "b"), ("b", "c"), ("c", "d"), ("a", "d")]
    joint, noisy = _measurements(rng, 1, cliques)
    exact = [g.Measurement(m.clique, _margin(joint, m.clique), m.variance) for m in noisy]
    model = g.fit(g.junction_tree(ATTRIBUTES, cliques, SIZES), SIZES, exact, iterations=3000)
    for m in exact:
        assert np.abs(model.table(m.clique) - m.values).max() < 1e-3 * 5000


def test_units_are_fitted_independently():
    rng = np.random.default_rng(7)
    cliques = [("a", "b"), ("b", "c"), ("c", "d"), ("a", "d")]
    _, measurements = _measurements(rng, 3, cliques)
    measurements[0] = g.Measurement(measurements[0].clique, measurements[0].values * [[[1]], [[0]], [[50]]],
                                    measurements[0].variance)  # one unit empty, one far larger
    tree = g.junction_tree(ATTRIBUTES, cliques, SIZES)
    together = g.fit(tree, SIZES, measurements, iterations=200).marginals()
    for unit in range(3):
        alone = g.fit(tree, SIZES, [g.Measurement(m.clique, m.values[unit:unit + 1], m.variance)
                                    for m in measurements], iterations=200).marginals()
        for x, y in zip(together, alone):
            np.testing.assert_allclose(x[unit], y[0], rtol=1e-9, atol=1e-9)
    assert all(np.isfinite(t).all() for t in together)


def test_a_fit_to_convergence_stops_each_unit_on_its_own_when_its_loss_settles():
    """With a tolerance, each unit stops at the first check (every CONVERGENCE_CHECK iterations) where its loss
    fell by less than tolerance x the noise's loss: its model is the fixed-iteration fit's at that count, whatever
    the other units of its chunk do (a unit that settles early is not moved by one that does not), and a longer
    fit improves its loss by little against the noise's."""
    rng = np.random.default_rng(11)
    cliques = [("a", "b", "c"), ("b", "c", "d"), ("a", "d")]
    _, measurements = _measurements(rng, 3, cliques, noise=50.0)
    measurements[1] = g.Measurement(measurements[1].clique, measurements[1].values * [[[[1]]], [[[0.01]]], [[[40]]]],
                                    measurements[1].variance)  # one unit nearly empty, one far larger
    noise_loss = 0.5 * min(m.variance for m in measurements) * sum(m.values[0].size for m in measurements)
    tree = g.junction_tree(ATTRIBUTES, cliques, SIZES)
    together = g.fit(tree, SIZES, measurements, iterations=5000, tolerance=1e-3)
    stopped = together.iterations
    assert (stopped % g.CONVERGENCE_CHECK == 0).all() and (stopped < 5000).all() and len(set(stopped)) > 1
    marginals = together.marginals()
    smallest = min(m.variance for m in measurements)

    def loss(model):
        return sum(0.5 * smallest / m.variance * ((model.table(m.clique)[0] - m.values[unit]) ** 2).sum()
                   for m in measurements)

    for unit in range(3):
        own = [g.Measurement(m.clique, m.values[unit:unit + 1], m.variance) for m in measurements]
        alone = g.fit(tree, SIZES, own, iterations=5000, tolerance=1e-3)
        fixed = g.fit(tree, SIZES, own, iterations=int(stopped[unit]))
        assert alone.iterations[0] == stopped[unit]
        for x, y, z in zip(marginals, alone.marginals(), fixed.marginals()):
            assert np.array_equal(x[unit], y[0]) and np.array_equal(y[0], z[0])
        longer = g.fit(tree, SIZES, own, iterations=10_000)
        assert loss(longer) <= loss(alone) <= loss(longer) + 0.005 * noise_loss  # stopped at 300: 0.009


def test_a_fit_without_a_tolerance_runs_every_iteration():
    rng = np.random.default_rng(12)
    cliques = [("a", "b"), ("b", "c")]
    _, measurements = _measurements(rng, 2, cliques)
    model = g.fit(g.junction_tree(ATTRIBUTES, cliques, SIZES), SIZES, measurements, iterations=321)
    assert model.iterations.tolist() == [321, 321]


@pytest.mark.parametrize("cliques", [
    [("a", "b"), ("b", "c"), ("c", "d"), ("a", "d"), ("d", "e"), ("e", "f"), ("b", "f")],
    [("a", "b"), ("b", "c"), ("a", "c"), ("c", "d"), ("e",), ("f",)],  # parts no table joins: triples across them
    # (d, e, f): no two share a clique, and f's clique hangs off the path from d's to e's
    [("a", "b", "c"), ("a", "b", "d"), ("a", "c", "f"), ("e",)],
])
def test_tables_across_cliques_are_the_models_margins(cliques):
    rng = np.random.default_rng(3)
    attributes = tuple("abcdef")
    sizes = dict(zip(attributes, [2, 3, 2, 3, 2, 2]))
    measurements = [g.Measurement(c, rng.uniform(10, 100, size=(2,) + tuple(sizes[a] for a in c)), 4.0)
                    for c in cliques]
    tree = g.junction_tree(attributes, cliques, sizes)
    model = g.fit(tree, sizes, measurements, iterations=100)
    marginals = model.marginals()
    joint = np.ones((2,) + tuple(sizes.values()))
    for i, clique in enumerate(tree.cliques):  # the junction tree's distribution, densely
        joint = joint * g._expand(marginals[i], clique, attributes, sizes)
        if tree.parents[i] >= 0:
            separator = tree.separator(i)
            joint = joint / g._expand(g._sum_to(marginals[i], clique, separator), separator, attributes, sizes)
    np.testing.assert_allclose(joint.reshape(2, -1).sum(axis=1), model.totals)
    every = [c for size in (1, 2, 3) for c in itertools.combinations(attributes, size)]
    for clique, many in zip(every, model.tables(every, marginals)):  # one attribute with a clique, or spanning
        dense = g._sum_to(joint, attributes, clique)
        np.testing.assert_allclose(model.table(clique, marginals), dense, rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(many, dense, rtol=1e-9, atol=1e-9)


def test_read_cells_bounds_every_array_a_table_read_makes(monkeypatch):
    """`read_cells` (public: the model's shape) bounds every array `Model.tables` makes to read a set's table,
    so AIM's rounds can refuse a candidate before reading it; dropping the kept carried tables (`KEPT_CELLS`)
    changes no table."""
    rng = np.random.default_rng(11)
    attributes = tuple("abcdefg")
    largest = [0]
    contract = g._contract

    def spy(factors, out):
        made = contract(factors, out)
        largest[0] = max([largest[0], made[0].size] + [v[0].size for _, v in factors])
        return made

    monkeypatch.setattr(g, "_contract", spy)
    checked = 0
    for _ in range(12):
        sizes = {a: int(rng.choice([2, 3, 5, 7])) for a in attributes}
        cliques = [tuple(sorted(rng.choice(7, size=2, replace=False).tolist())) for _ in range(6)]
        cliques = [tuple(attributes[i] for i in c) for c in cliques]
        tree = g.junction_tree(attributes, cliques, sizes)
        model = g.Model(tree, sizes, np.array([500.0, 80.0]))
        marginals = model.marginals()
        own = max(math.prod(sizes[a] for a in c) for c in tree.cliques)
        every = [c for size in (2, 3) for c in itertools.combinations(attributes, size)]
        for clique in every:
            largest[0] = 0
            [table] = model.tables([clique], marginals)
            bound = g.read_cells(tree, sizes, clique)
            assert largest[0] <= max(bound, own, table[0].size), (clique, largest[0], bound, tree.cliques)
            checked += bound > own
        kept = model.tables(every, marginals)
        monkeypatch.setattr(g, "KEPT_CELLS", 0)
        for x, y in zip(kept, model.tables(every, marginals)):
            np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-12)
        monkeypatch.setattr(g, "KEPT_CELLS", 1 << 22)
    assert checked > 20  # reads whose carried tables outgrow the model's largest clique were met


def test_a_warm_start_reads_within_its_limit(monkeypatch):
    """`start_from` reads each new clique from the previous model; one in no old clique goes across the tree
    (`_spanning_table`, bounded by `_spanning_cells`), and past `limit` it starts from zero potential instead:
    the start's memory is public whatever tables were measured (the reviewer's case: (x, y) added beside
    (x, m1), (m1, m2, big), (m2, y) reads |m1 m2 big| x |x| cells)."""
    attributes = ("x", "m1", "m2", "big", "y")
    sizes = {"x": 30, "m1": 2, "m2": 2, "big": 40, "y": 2}
    before = [(a,) for a in attributes] + [("x", "m1"), ("m1", "m2", "big"), ("m2", "y")]
    tree = g.junction_tree(attributes, before, sizes)
    rng = np.random.default_rng(0)
    previous = g.Model(tree, sizes, np.array([1000.0, 10.0]))
    previous.potentials = [rng.normal(size=p.shape) for p in previous.potentials]
    new = g.junction_tree(attributes, before + [("x", "y")], sizes)
    largest = [0]
    product = g._product

    def spy(attributes, sizes, a, x, b, y):
        union, values = product(attributes, sizes, a, x, b, y)
        largest[0] = max(largest[0], values[0].size)
        return union, values

    monkeypatch.setattr(g, "_product", spy)
    warm = g.start_from(previous, new)
    crossing = [i for i, c in enumerate(new.cliques) if not any(set(c) <= set(o) for o in tree.cliques)]
    bound = max(g._spanning_cells(tree, sizes, new.cliques[i]) for i in crossing)
    assert crossing and 0 < largest[0] <= bound and bound >= 30 * 2 * 2 * 40
    largest[0] = 0
    smallest = min(g._spanning_cells(tree, sizes, new.cliques[i]) for i in crossing)
    limited = g.start_from(previous, new, limit=smallest - 1)
    assert largest[0] == 0  # nothing read across the tree
    for i, (x, y) in enumerate(zip(warm.potentials, limited.potentials)):
        if i in crossing:
            assert not y.any() and x.any()
        else:
            np.testing.assert_array_equal(x, y)


def test_integer_tables_add_up_and_records_tabulate_to_them():
    rng = np.random.default_rng(11)
    cliques = [("a", "b"), ("b", "c"), ("c", "d"), ("a", "d")]
    _, measurements = _measurements(rng, 3, cliques, noise=40.0)
    tree = g.junction_tree(ATTRIBUTES, cliques, SIZES)
    model = g.fit(tree, SIZES, measurements, iterations=300)
    marginals = model.marginals()
    totals = np.rint(model.totals).astype(np.int64)
    tables = g.integer_tables(tree, SIZES, marginals, totals)
    for i, (clique, table) in enumerate(zip(tree.cliques, tables)):
        assert table.dtype == np.int64 and (table >= 0).all()
        np.testing.assert_array_equal(table.reshape(3, -1).sum(axis=1), totals)
        if tree.parents[i] >= 0:
            p, separator = tree.parents[i], tree.separator(i)
            np.testing.assert_array_equal(g._sum_to(table, clique, separator),
                                          g._sum_to(tables[p], tree.cliques[p], separator))
        assert np.abs(table - marginals[i]).sum() < table.size * 2
    unit, codes = g.records(tree, SIZES, tables, seed=1)
    assert unit.size == totals.sum()
    for clique, table in zip(tree.cliques, tables):
        counted = np.zeros_like(table)
        np.add.at(counted, (unit,) + tuple(codes[a] for a in clique), 1)
        np.testing.assert_array_equal(counted, table)
    again = g.records(tree, SIZES, tables, seed=1)
    assert all((again[1][a] == codes[a]).all() for a in ATTRIBUTES)


def test_an_attribute_no_table_joins_is_its_own_part():
    rng = np.random.default_rng(2)
    cliques = [("a", "b"), ("b", "c"), ("d",)]
    _, measurements = _measurements(rng, 1, cliques)
    tree = g.junction_tree(ATTRIBUTES, cliques, SIZES)
    assert ("d",) in tree.cliques and tree.separator(tree.cliques.index(("d",))) == ()
    model = g.fit(tree, SIZES, measurements, iterations=500)
    table = model.table(("a", "d"))
    independent = model.table(("a",))[:, :, None] * model.table(("d",))[:, None, :] / model.totals[:, None, None]
    np.testing.assert_allclose(table, independent, rtol=1e-9)
    tables = g.integer_tables(tree, SIZES, model.marginals(), np.rint(model.totals).astype(np.int64))
    unit, codes = g.records(tree, SIZES, tables, seed=0)
    assert np.bincount(codes["d"], minlength=3).tolist() == tables[tree.cliques.index(("d",))][0].tolist()


def test_tree_start_is_the_tree_distribution():
    """A model started from a tree of consistent pair tables holds them (before any fit step), cycles in the
    model or not."""
    rng = np.random.default_rng(8)
    units = 2
    root = rng.dirichlet(np.ones(SIZES["a"]), size=units) * 1000  # a -> b, a -> c, c -> d
    conditionals = {child: rng.dirichlet(np.ones(SIZES[child]), size=(units, SIZES[parent]))
                    for parent, child in (("a", "b"), ("a", "c"), ("c", "d"))}
    ab = root[:, :, None] * conditionals["b"]
    ac = root[:, :, None] * conditionals["c"]
    cd = ac.sum(axis=1)[:, :, None] * conditionals["d"]
    edges = [("a", "b", ab), ("a", "c", ac), ("c", "d", cd)]
    for extra in ([], [("b", "d")]):  # the tree alone, and a model where (b, d) closes a cycle
        tree = g.junction_tree(ATTRIBUTES, [("a", "b"), ("a", "c"), ("c", "d")] + extra, SIZES)
        model = g.tree_start(tree, SIZES, root.sum(axis=1), "a", root, edges, floor=1e-12)
        for (parent, child, table) in edges:
            np.testing.assert_allclose(model.table((parent, child)), table, rtol=1e-9)


def test_forest_start_holds_the_forest_of_the_first_pairs_that_join_parts():
    """Pairs taken in order while they join two parts: (a, b), (c, d) and (a, c) make the forest, (b, c) would close
    a cycle and is left to the fit; (e) joins nothing and starts independent. The started model holds every
    forest pair's table and e's distribution, in a model where (b, c) closes a cycle."""
    rng = np.random.default_rng(4)
    attributes = tuple("abcde")
    sizes = dict(zip(attributes, [2, 3, 2, 3, 4]))
    units = 2
    joint = rng.dirichlet(np.ones(math.prod(sizes.values())), size=units).reshape((units,) + tuple(sizes.values()))
    joint = joint * 1000
    table = {c: g._sum_to(joint, attributes, c) for c in [("a", "b"), ("c", "d"), ("a", "c"), ("b", "c"), ("e",)]}
    one_way = {a: g._sum_to(joint, attributes, (a,)) for a in attributes}
    pairs = [(c, table[c]) for c in [("a", "b"), ("c", "d"), ("a", "c"), ("b", "c")]]
    tree = g.junction_tree(attributes, [c for c, _ in pairs] + [("e",)], sizes)
    model = g.forest_start(tree, sizes, joint.reshape(units, -1).sum(axis=1), one_way, pairs, floor=1e-12)
    for clique in [("a", "b"), ("c", "d"), ("a", "c"), ("e",)]:
        np.testing.assert_allclose(model.table(clique), table[clique], rtol=1e-9)
    assert np.abs(model.table(("b", "c")) - table[("b", "c")]).max() > 1  # (b, c) given only through a


def test_integer_tables_deal_a_large_clique_attribute_by_attribute():
    """A 5-attribute clique with few records per cell: its pairs' margins stay within rounding of the fit
    (the first attributes dealt exactly as the fit's rows), instead of each of its 243 cells rounded."""
    rng = np.random.default_rng(9)
    attributes = tuple("abcde")
    sizes = dict.fromkeys(attributes, 3)
    fitted = rng.dirichlet(np.ones(243), size=1).reshape((1,) + (3,) * 5) * 200
    tree = g.junction_tree(attributes, [attributes], sizes)
    table = g.integer_tables(tree, sizes, [fitted], np.array([200]))[0]
    assert table.sum() == 200 and (table >= 0).all()
    for pair in (("a",), ("a", "b"), ("a", "b", "c")):
        assert np.abs(g._sum_to(table, attributes, pair) - g._sum_to(fitted, attributes, pair)).max() < 2
