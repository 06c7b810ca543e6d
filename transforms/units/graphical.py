"""A graphical model fitted to any set of measured tables (cliques that may close cycles), per unit, as
Private-PGM fits one (McKenna, Sheldon and Miklau 2019), in numpy and vectorised across geographic units.

    junction tree   the measured cliques' graph is made chordal (greedy minimum-fill elimination, ties by
                    the attributes' sizes, then the query's order) and its maximal cliques joined by a maximum
                    spanning tree on their overlaps: the model's cliques, each a table per unit, and the
                    separators between them. Its size (cells per unit x units) is capped by its callers
                    (`transforms.aim_model.within_cap`).
    fit             the weighted least-squares fit of the measurements' tables, sum_m ||mu_m - y_m||^2 / v_m
                    (v_m the table's public noise variance), over the tables of every distribution with the
                    unit's estimated total: mirror descent on the maximal cliques' log-potentials (the entropic
                    mirror map), their marginals from two-pass belief propagation on the junction tree, and an
                    Armijo step per unit. The loss is convex in the measured tables, and the marginal polytope
                    of a junction tree holds the margins of every joint, so the fit converges to the dense
                    least-squares fit's measured tables (tested against one).
    start           `tree_start`: the distribution of a spanning tree of the measured pairs (the tree model
                    `tree_model` samples from), so a fit starts no worse than the tree.
    integers        the maximal cliques' tables as nonnegative integers that add up exactly (from the unit
                    totals, then clique by clique from the separator's counts in its parent, one attribute at
                    a time: `tree_model.fitted_rows` per row of counts), and records that tabulate to them
                    exactly (`records`): every table of the model's attributes that lies in a clique is then a
                    margin of the same records.

    tables          any attribute set's table under the model (`Model.tables`): a clique's margin, or the table
                    of one attribute (or two) carried out from its clique to the clique holding the others, as
                    factors contracted without forming their product; AIM scores every candidate against them.

Used by `select: aim` (`transforms.aim_model`: each round's model and candidates' estimates; the published tables
through `joint`'s 'converged_model' path; the records `synthesize` draws) and by `synthesize` for a `select: all` query
whose joint is too large to fit. A `select: mst` query's tables (and a `select: aim` query's of manifest version 7
or earlier) form a tree grown one attribute at a time and take the tree path (`tree_model.junction_tables`, with
its shrinkage).

Privacy: post-processing. Every function reads released noisy tables, their public variances and the public
plan (attributes, sizes, cliques) only; a unit's result depends on that unit's inputs alone (per-unit steps).
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np

from .dealing import by_domain, dealt_cells
from .tree_model import fitted_rows

Clique = tuple[str, ...]
"""Attributes of one table, in the query's order."""

MODEL_CELLS_CAP = 1 << 25
"""The largest model (cells of its maximal cliques per unit, times units) a fit holds: 256 MiB per array of
doubles; the fit keeps about ten such arrays."""

KEPT_CELLS = 1 << 22
"""Cells per unit of the carried tables of other attributes `Model.tables` keeps when it starts carrying a new one
(dropped past it, made again when asked for). What one attribute's (or one pair's) carried tables keep along a path
is not counted: up to the path's length times the largest read (`read_cells`)."""

FIT_ITERATIONS = 1000
"""Mirror-descent iterations (Private-PGM's default for AIM)."""

CONVERGENCE_CHECK = 100
"""Iterations between a fit's convergence checks (`fit` with a `tolerance`)."""

CONVERGENCE_TOLERANCE = 0.005
"""A unit's fit stops at a check where its loss fell by less than this fraction of the noise's loss (the loss of
residuals of one noise standard deviation in every measured cell) since the check before (`fit` with a
`tolerance`): the release's fit of a `select: aim` query's model (`joint`'s 'converged_model' path). Measured on
Adult at epsilon 10 (the loss in units of the noise's: 1.0 after 1,000 iterations, 0.51 after 3,000, 0.37 after
10,000; the records' 2-way error 0.0497, 0.0469, 0.0467): the loss still falls for thousands of iterations, by
less each time, long after the tables stop improving. A fraction of the loss itself never stops it (the estimates
it fits are consistent, so the loss falls towards a small floor)."""

CONVERGENCE_LIMIT = 10_000
"""The most mirror-descent iterations of a fit run to convergence."""


@dataclass(frozen=True)
class JunctionTree:
    """The maximal cliques of the measured cliques' chordal completion, each in the query's order, ordered so
    that every clique's parent comes before it (`parents[0] == -1`: the root). Public: from the cliques."""

    attributes: tuple[str, ...]
    cliques: tuple[Clique, ...]
    parents: tuple[int, ...]

    def separator(self, i: int) -> Clique:
        """The attributes clique i shares with its parent (empty for the root or a clique starting a part of
        the model no other clique touches)."""
        if self.parents[i] < 0:
            return ()
        parent = set(self.cliques[self.parents[i]])
        return tuple(a for a in self.cliques[i] if a in parent)

    def children(self, i: int) -> list[int]:
        return [j for j, p in enumerate(self.parents) if p == i]

    def home(self, clique) -> int:
        """The first maximal clique holding every attribute of `clique`."""
        members = set(clique)
        return next(i for i, c in enumerate(self.cliques) if members <= set(c))

    def cells(self, sizes: dict[str, int]) -> int:
        """Cells per unit of the model's tables."""
        return sum(math.prod(sizes[a] for a in c) for c in self.cliques)


def _ordered(attributes: tuple[str, ...], members) -> Clique:
    members = set(members)
    return tuple(a for a in attributes if a in members)


def _elimination_cliques(attributes: tuple[str, ...], cliques: list[Clique], sizes: dict[str, int]) -> list[Clique]:
    """The cliques met eliminating every attribute from the graph joining each clique's attributes: at each step
    the attribute whose elimination adds the fewest edges (then the smallest eliminated table, then the query's
    order) goes with the attributes still joined to it."""
    neighbours: dict[str, set[str]] = {a: set() for a in attributes}
    for clique in cliques:
        for a in clique:
            neighbours[a].update(b for b in clique if b != a)
    remaining = set(attributes)
    position = {a: i for i, a in enumerate(attributes)}
    found: list[Clique] = []
    while remaining:
        def cost(a: str) -> tuple[int, int, int]:
            around = [b for b in neighbours[a] if b in remaining]
            fill = sum(1 for i, b in enumerate(around) for c in around[i + 1:] if c not in neighbours[b])
            return fill, sizes[a] * math.prod(sizes[b] for b in around), position[a]

        chosen = min(remaining, key=cost)  # the cost ends in the attribute's position: no ties
        around = sorted((b for b in neighbours[chosen] if b in remaining), key=position.__getitem__)
        for b in around:
            neighbours[b].update(c for c in around if c != b)
        found.append(_ordered(attributes, [chosen, *around]))
        remaining.discard(chosen)
    return found


def _maximal_cliques(attributes: tuple[str, ...], cliques, sizes: dict[str, int]) -> list[Clique]:
    """The maximal cliques of the chordal completion (`_elimination_cliques`), largest first (ties in the query's
    order)."""
    found = _elimination_cliques(attributes, [_ordered(attributes, c) for c in cliques], sizes)
    maximal: list[Clique] = []
    for clique in sorted(found, key=lambda c: (-len(c), [attributes.index(a) for a in c])):
        if not any(set(clique) <= set(m) for m in maximal):
            maximal.append(clique)
    return maximal


def model_cells(attributes, cliques, sizes: dict[str, int]) -> int:
    """Cells per unit of the junction tree of `cliques` (`junction_tree(...).cells`), without joining its cliques
    into a tree. Public: from the cliques."""
    attributes = tuple(attributes)
    return sum(math.prod(sizes[a] for a in c) for c in _maximal_cliques(attributes, cliques, sizes))


def junction_tree(attributes, cliques, sizes: dict[str, int]) -> JunctionTree:
    """The junction tree of `cliques` over `attributes` (every attribute a vertex, also one no clique holds):
    the maximal cliques of the chordal completion (`_elimination_cliques`), joined by Kruskal's maximum spanning
    tree on their overlaps (ties by the cliques' order; parts that share nothing joined by empty separators),
    ordered breadth first from the largest clique. Running intersection holds: an attribute's cliques form a
    connected part of the tree. Made once per set of arguments (an AIM round asks for it when it lists its
    candidates and again when it fits: `_junction_tree`, cached; the tree is immutable)."""
    return _junction_tree(tuple(attributes), tuple(tuple(c) for c in cliques),
                          tuple(sorted(sizes.items())))


@functools.lru_cache(maxsize=64)
def _junction_tree(attributes: tuple[str, ...], cliques: tuple[Clique, ...],
                   size_items: tuple[tuple[str, int], ...]) -> JunctionTree:
    sizes = dict(size_items)
    maximal = _maximal_cliques(attributes, cliques, sizes)
    pairs = sorted(((i, j) for i in range(len(maximal)) for j in range(i + 1, len(maximal))),
                   key=lambda p: -len(set(maximal[p[0]]) & set(maximal[p[1]])))
    part = list(range(len(maximal)))

    def root(i: int) -> int:
        while part[i] != i:
            i = part[i]
        return i

    adjacent: dict[int, list[int]] = {i: [] for i in range(len(maximal))}
    for i, j in pairs:
        if root(i) != root(j):
            part[root(i)] = root(j)
            adjacent[i].append(j)
            adjacent[j].append(i)
    start = max(range(len(maximal)), key=lambda i: (math.prod(sizes[a] for a in maximal[i]), -i))
    order, parents, seen = [start], {start: -1}, {start}
    for i in order:
        for j in sorted(adjacent[i]):
            if j not in seen:
                seen.add(j)
                parents[j] = i
                order.append(j)
    position = {old: new for new, old in enumerate(order)}
    return JunctionTree(attributes, tuple(maximal[i] for i in order),
                        tuple(-1 if parents[i] < 0 else position[parents[i]] for i in order))


@dataclass(frozen=True)
class Measurement:
    """One released table: its clique (in the query's order), its noisy values (units, sizes in the clique's
    order) and its public noise variance per cell."""

    clique: Clique
    values: np.ndarray
    variance: float


def _shape(sub: Clique, full: Clique, sizes: dict[str, int]) -> tuple[int, ...]:
    """The broadcast shape (after the unit axis) of a table over `sub` inside a table over `full`."""
    members = set(sub)
    return tuple(sizes[a] if a in members else 1 for a in full)


def _expand(values: np.ndarray, sub: Clique, full: Clique, sizes: dict[str, int]) -> np.ndarray:
    """A (units, sub...) table shaped to broadcast against a (units, full...) one (both in the query's order)."""
    return values.reshape((values.shape[0],) + _shape(sub, full, sizes))


def _dropped(sub: Clique, full: Clique) -> tuple[int, ...]:
    members = set(sub)
    return tuple(1 + i for i, a in enumerate(full) if a not in members)


def _sum_to(values: np.ndarray, full: Clique, sub: Clique) -> np.ndarray:
    """A (units, full...) table summed down to (units, sub...)."""
    axes = _dropped(sub, full)
    return values.sum(axis=axes) if axes else values


def margin_of(values: np.ndarray, full: Clique, sub: Clique) -> np.ndarray:
    """A (units, full...) table's margin over `sub` (units, sub... in `full`'s order)."""
    return _sum_to(values, full, sub)


def _log_sum_to(values: np.ndarray, full: Clique, sub: Clique) -> np.ndarray:
    """log of the sum of exp(values) down to (units, sub...), stably."""
    axes = _dropped(sub, full)
    if not axes:
        return values
    top = values.max(axis=axes, keepdims=True)
    return np.log(np.exp(values - top).sum(axis=axes)) + np.squeeze(top, axis=axes)


class Model:
    """A junction tree's log-potentials per unit and the marginals they give (`marginals`)."""

    def __init__(self, tree: JunctionTree, sizes: dict[str, int], totals: np.ndarray):
        self.tree, self.sizes = tree, sizes
        self.totals = np.maximum(np.asarray(totals, dtype=np.float64), 0.0)
        units = self.totals.size
        self.potentials = [np.zeros((units,) + tuple(sizes[a] for a in c)) for c in tree.cliques]
        self.iterations = np.zeros(units, dtype=np.int64)
        """Each unit's mirror-descent iterations in the fit that made the model (`fit`)."""

    def marginals(self, potentials: list[np.ndarray] | None = None) -> list[np.ndarray]:
        """Every maximal clique's table (units, sizes...) of the distribution the potentials define, scaled to
        the unit totals: messages leaves to root (log-sum-exp over each clique's attributes outside its
        separator), the root's table from its belief, then root to leaves each clique's table as its new
        attributes' distribution given the separator (its belief less its message, at most 1: no overflow)
        times the separator's table in its parent."""
        tree, sizes = self.tree, self.sizes
        theta = self.potentials if potentials is None else potentials
        n = len(tree.cliques)
        up: list[np.ndarray | None] = [None] * n
        inward = [t.copy() for t in theta]
        for i in range(n - 1, 0, -1):
            p, separator = tree.parents[i], tree.separator(i)
            up[i] = _log_sum_to(inward[i], tree.cliques[i], separator)
            inward[p] += _expand(up[i], separator, tree.cliques[p], sizes)
        flat = inward[0].reshape(inward[0].shape[0], -1)
        weights = np.exp(flat - flat.max(axis=1, keepdims=True))
        weights *= (self.totals / weights.sum(axis=1))[:, None]
        out = [weights.reshape(inward[0].shape)]
        for i in range(1, n):
            p, separator, clique = tree.parents[i], tree.separator(i), tree.cliques[i]
            given = np.exp(inward[i] - _expand(up[i], separator, clique, sizes))
            given *= _expand(_sum_to(out[p], tree.cliques[p], separator), separator, clique, sizes)
            out.append(given)
        return out

    def table(self, clique, marginals: list[np.ndarray] | None = None) -> np.ndarray:
        """The model's table of any set of its attributes (units, sizes in the query's order): a margin of the
        maximal clique holding them, else of the distribution over the part of the tree joining cliques that
        hold them (`_spanning_table`)."""
        clique = _ordered(self.tree.attributes, clique)
        tables = self.marginals() if marginals is None else marginals
        home = next((i for i, c in enumerate(self.tree.cliques) if set(clique) <= set(c)), None)
        if home is not None:
            return _sum_to(tables[home], self.tree.cliques[home], clique)
        return _spanning_table(self.tree, self.sizes, tables, clique)


    def tables(self, cliques, marginals: list[np.ndarray] | None = None) -> list[np.ndarray]:
        """The model's tables of many attribute sets (`table` of each, the same distribution): a set inside one
        maximal clique is its margin; a set of one attribute `a` and others inside one clique k is the margin of
        the model's table of k's attributes with `a` (`_JointsWith`, each clique's made once per `a` and kept
        across the sets); a set of x, y and z no two of which share a clique, the margin of the table of z's
        clique with x and y, carried out from the clique on the paths between their cliques (`_pair_from`); any
        other set `_spanning_table`'s."""
        tree = self.tree
        tables = self.marginals() if marginals is None else marginals
        members = [set(c) for c in tree.cliques]
        joints: dict[str, _JointsWith] = {}

        def with_one(a: str) -> _JointsWith:
            if a not in joints:
                if sum(j.cells for j in joints.values()) > KEPT_CELLS * self.totals.size:
                    joints.clear()  # made again when asked for: memory bounded, the same tables
                home = tree.home((a,))
                joints[a] = _JointsWith(tree, self.sizes, tables, (a,), home, [(tree.cliques[home], tables[home])])
            return joints[a]

        out = []
        pair: _JointsWith | None = None  # the last pair carried (kept while the sets share it)
        for clique in cliques:
            clique = _ordered(tree.attributes, clique)
            route = _route(tree, members, clique)
            if route[0] == "margin":
                out.append(_sum_to(tables[route[1]], tree.cliques[route[1]], clique))
            elif route[0] == "one":
                out.append(with_one(route[1]).margin(route[2], clique))
            elif route[0] == "pair":
                x, y, z = clique
                homes, middle = route[1], route[2]
                if pair is None or (pair.carried, pair.start) != ({x, y}, middle):  # (x, y, z) follow in order
                    pair = self._pair_from(middle, x, y, with_one(x), with_one(y), tables)
                out.append(pair.margin(homes[2], clique))
            else:
                out.append(_spanning_table(tree, self.sizes, tables, clique))
        return out

    def _pair_from(self, middle: int, x: str, y: str, joint_x: "_JointsWith", joint_y: "_JointsWith",
                   tables: list[np.ndarray]) -> "_JointsWith":
        """x and y carried out from the clique `middle` on the paths between their cliques and a third's: there
        x and y lie on different sides (or inside it), independent given its attributes, so its table with both
        is its table with x times its table with y over its own (kept as those three factors)."""
        members = self.tree.cliques[middle]
        with_x = _ordered(self.tree.attributes, set(members) | {x})
        with_y = _ordered(self.tree.attributes, set(members) | {y})
        own = tables[middle]
        factors: Factors = [(with_x, joint_x.margin(middle, with_x)), (with_y, joint_y.margin(middle, with_y)),
                            (members, np.where(own > _TINY, 1.0 / np.where(own > _TINY, own, 1.0), 0.0))]
        return _JointsWith(self.tree, self.sizes, tables, (x, y), middle, factors)


def _route(tree: JunctionTree, members: list[set], clique: Clique) -> tuple:
    """How `Model.tables` reads a set's table: ("margin", k) inside clique k; ("one", a, k) carrying a from its
    clique to the clique k holding the others; ("pair", homes, middle) carrying x and y of a 3-way set no two of
    which share a clique out from the clique on the paths between their homes; ("spanning",) otherwise."""
    home = next((i for i, c in enumerate(members) if set(clique) <= c), None)
    if home is not None:
        return ("margin", home)
    for a in clique:
        k = next((i for i, c in enumerate(members) if set(clique) - {a} <= c), None)
        if k is not None:
            return ("one", a, k)
    if len(clique) == 3:
        homes = [tree.home((a,)) for a in clique]
        return ("pair", homes, _median(tree, *homes))
    return ("spanning",)


def read_cells(tree: JunctionTree, sizes: dict[str, int], clique) -> int:
    """Cells per unit of the largest array `Model.tables` makes to read `clique`'s table (0 inside a clique):
    carried attributes' tables with each separator on their way (`_JointsWith.of`) and, for a pair, the table of
    the clique they start from with each. Public: the model's shape."""
    clique = _ordered(tree.attributes, clique)
    route = _route(tree, [set(c) for c in tree.cliques], clique)
    if route[0] == "margin":
        return 0
    if route[0] == "one":
        return _carried_cells(tree, sizes, {route[1]}, tree.home((route[1],)), route[2])
    if route[0] == "pair":
        (hx, hy, hz), middle = route[1], route[2]
        x, y, _ = clique
        starts = [math.prod(sizes[a] for a in set(tree.cliques[middle]) | {b}) for b in (x, y)]
        return max(*starts, _carried_cells(tree, sizes, {x}, hx, middle), _carried_cells(tree, sizes, {y}, hy, middle),
                   _carried_cells(tree, sizes, {x, y}, middle, hz))
    return _spanning_cells(tree, sizes, clique)


def _carried_cells(tree: JunctionTree, sizes: dict[str, int], carried: set, start: int, end: int) -> int:
    """The largest table `_JointsWith` makes carrying `carried` from clique `start` to clique `end`: each step's
    separator with the carried attributes the clique reached lacks."""
    path = _path(tree, start, end)
    cells = 0
    for p, k in zip(path, path[1:]):
        separator = tree.separator(k) if tree.parents[k] == p else tree.separator(p)
        lacking = carried - set(tree.cliques[k])
        if lacking:
            cells = max(cells, math.prod(sizes[a] for a in set(separator) | lacking))
    return cells


_TINY = 1e-300
"""Clique probabilities at or below this are taken as 0 where divided by (1 / 1e-308 would overflow to inf)."""


def _path(tree: JunctionTree, a: int, b: int) -> list[int]:
    """The cliques on the tree's path from clique a to clique b (both included)."""
    up_a, up_b = [a], [b]
    while up_a[-1] >= 0:
        up_a.append(tree.parents[up_a[-1]])
    while up_b[-1] >= 0:
        up_b.append(tree.parents[up_b[-1]])
    common = next(i for i in up_a if i in set(up_b))
    return up_a[:up_a.index(common) + 1] + list(reversed(up_b[:up_b.index(common)]))


def _median(tree: JunctionTree, a: int, b: int, c: int) -> int:
    """The clique on every path between cliques a, b and c (a tree has exactly one)."""
    return next(i for i in _path(tree, a, b) if i in set(_path(tree, a, c)) and i in set(_path(tree, b, c)))


class _JointsWith:
    """The model's table of each maximal clique's attributes with the attributes `carried`, clique by clique out
    from clique `start` (whose table with them is given as factors), every carried attribute's cliques at `start`
    or on its side of each clique reached: clique k, reached from its neighbour p toward `start` across their
    separator S, is k's table times the carried attributes k lacks given S (p's table summed to S and them, over
    S's table): in a junction tree the attributes on p's side are independent of k's other attributes given S. Each clique's table is kept as those two factors (`Factors`), made when first asked for;
    margins are taken from the factors without forming their product (`_contract`)."""

    def __init__(self, tree: JunctionTree, sizes: dict[str, int], tables: list[np.ndarray], carried: Clique,
                 start: int, start_factors: "Factors"):
        self.tree, self.sizes, self.tables, self.carried, self.start = tree, sizes, tables, set(carried), start
        self.toward: dict[int, int] = {start: -1}  # each clique's neighbour on its path to `start`
        order = [start]
        for i in order:
            for j in tree.children(i) + ([tree.parents[i]] if tree.parents[i] >= 0 else []):
                if j not in self.toward:
                    self.toward[j] = i
                    order.append(j)
        self.made: dict[int, Factors] = {start: start_factors}
        self.cells = 0  # cells (all units) of the factors made here

    def of(self, k: int) -> "Factors":
        """Clique k's table with the carried attributes, as factors whose product it is."""
        if k in self.made:
            return self.made[k]
        tree, sizes = self.tree, self.sizes
        lacking = self.carried - set(tree.cliques[k])
        found: Factors = [(tree.cliques[k], self.tables[k])]
        if lacking:
            p = self.toward[k]
            separator = tree.separator(k) if tree.parents[k] == p else tree.separator(p)
            with_carried = _ordered(tree.attributes, set(separator) | lacking)
            joint = _contract(self.of(p), with_carried)
            below = _expand(_sum_to(self.tables[k], tree.cliques[k], separator), separator, with_carried, sizes)
            found.append((with_carried, joint / np.where(below > 0, below, 1.0)))
            self.cells += joint.size
        self.made[k] = found
        return found

    def margin(self, k: int, clique: Clique) -> np.ndarray:
        """The table of `clique` (inside clique k's attributes and the carried ones; in the query's order)."""
        return _contract(self.of(k), clique)


Factors = list[tuple[Clique, np.ndarray]]
"""Tables (attributes in the query's order; values (units, sizes...)) whose product is one table."""


def _contract(factors: Factors, out: Clique) -> np.ndarray:
    """The product of the factors summed down to `out` (units, sizes in `out`'s order), by one einsum: the
    product is never formed."""
    if len(factors) == 1:
        members, values = factors[0]
        return _sum_to(values, members, out)
    index: dict[str, int] = {}
    operands: list = []
    for members, values in factors:
        operands += [values, [0] + [index.setdefault(a, len(index) + 1) for a in members]]
    return np.einsum(*operands, [0] + [index[a] for a in out], optimize=True)


def _spanning_table(tree: JunctionTree, sizes: dict[str, int], tables: list[np.ndarray], clique: Clique) -> np.ndarray:
    """The table of `clique` under the junction tree's distribution, whose restriction to a connected part of
    the tree is the product of its cliques' tables over the product of its separators' tables: the part joining
    the first clique holding each attribute (paths up to their common ancestor), eliminated leaves first, each
    message keeping its separator and the attributes of `clique` met below it."""
    part, top = _spanning_part(tree, clique)
    wanted = set(clique)
    messages: dict[int, tuple[Clique, np.ndarray]] = {}
    for i in sorted(part, reverse=True):
        members, values = tree.cliques[i], tables[i]
        if i != top:
            separator = tree.separator(i)
            below = _expand(_sum_to(values, members, separator), separator, members, sizes)
            values = values / np.where(below > 0, below, 1.0)
        for child in [j for j in tree.children(i) if j in messages]:
            kept, message = messages.pop(child)
            members, values = _product(tree.attributes, sizes, members, values, kept, message)
        keep = set(tree.separator(i)) | wanted if i != top else wanted
        kept = tuple(a for a in members if a in keep)
        messages[i] = (kept, _sum_to(values, members, kept))
    return messages[top][1]


def _spanning_part(tree: JunctionTree, clique: Clique) -> tuple[set[int], int]:
    """(The cliques joining the first clique holding each attribute of `clique`: their paths up to their deepest
    common ancestor, that ancestor): the part of the tree `_spanning_table` eliminates."""
    paths = []  # each home's path to the root
    for i in {tree.home((a,)) for a in clique}:
        path = [i]
        while tree.parents[path[-1]] >= 0:
            path.append(tree.parents[path[-1]])
        paths.append(path)
    top = max(set.intersection(*(set(path) for path in paths)))  # the deepest clique on every path
    return {i for path in paths for i in path[:path.index(top) + 1]}, top


def _spanning_cells(tree: JunctionTree, sizes: dict[str, int], clique: Clique) -> int:
    """A bound on the largest array (cells per unit) `_spanning_table` makes for `clique`: each clique of the part
    times the attributes of `clique` its messages carry (at most all of them)."""
    part, _ = _spanning_part(tree, clique)
    return max(math.prod(sizes[a] for a in set(tree.cliques[i]) | set(clique)) for i in part)


def _product(attributes: tuple[str, ...], sizes: dict[str, int], a: Clique, x: np.ndarray, b: Clique, y: np.ndarray
             ) -> tuple[Clique, np.ndarray]:
    """The product of two tables over their attributes' union (in the query's order)."""
    union = _ordered(attributes, set(a) | set(b))
    return union, _expand(x, a, union, sizes) * _expand(y, b, union, sizes)


def tree_start(tree: JunctionTree, sizes: dict[str, int], totals: np.ndarray, root: str, root_table: np.ndarray,
               edges: list[tuple[str, str, np.ndarray]], floor: float = 1e-3) -> Model:
    """A model of `tree` holding exactly the tree distribution of `edges` (parent, child, table (units, parent,
    child)), directed away from `root` (whose table is `root_table`, (units, size)): the root's distribution times
    each child's given its parent, every table made at least `floor` (a zero stays possible, just unlikely). Each
    factor lies in a maximal clique (every edge is a measured pair), so the potentials' product is the tree's.
    A start for `fit` that is already as good as the tree model."""
    model = Model(tree, sizes, totals)
    units = model.totals.size
    factors = [((root,), np.log(np.maximum(np.asarray(root_table, dtype=np.float64).reshape(units, -1), floor)))]
    for parent, child, table in edges:
        rows = np.maximum(np.asarray(table, dtype=np.float64), floor)
        conditional = np.log(rows / rows.sum(axis=2, keepdims=True))
        pair = _ordered(tree.attributes, (parent, child))
        factors.append((pair, conditional if pair == (parent, child) else np.swapaxes(conditional, 1, 2)))
    for clique, values in factors:
        home = tree.home(clique)
        model.potentials[home] = model.potentials[home] + _expand(values, clique, tree.cliques[home], sizes)
    return model


def start_from(previous: Model, tree: JunctionTree, floor: float = 1e-3, limit: int | None = None) -> Model:
    """A model of `tree` holding `previous`'s distribution where `tree` can (a warm start for `fit` after tables
    were added): each clique's potential the log of `previous`'s table of it less the log of its separator's
    (the junction tree's factorisation, exact when `tree`'s cliques hold `previous`'s), every table made at least
    `floor`. `limit`: a clique in no clique of `previous` whose table would take arrays of more cells per unit
    (`_spanning_cells`: public, the two trees' shapes) starts from zero potential instead, so the start's memory
    is bounded whatever tables were measured."""
    model = Model(tree, previous.sizes, previous.totals)
    marginals = previous.marginals()
    old = [set(c) for c in previous.tree.cliques]
    for i, clique in enumerate(tree.cliques):
        if limit is not None and not any(set(clique) <= c for c in old) and \
                _spanning_cells(previous.tree, previous.sizes, clique) > limit:
            continue
        values = np.log(np.maximum(previous.table(clique, marginals), floor))
        separator = tree.separator(i)
        if separator:
            below = np.log(np.maximum(previous.table(separator, marginals), floor))
            values = values - _expand(below, separator, clique, previous.sizes)
        model.potentials[i] = values
    return model


def forest_start(tree: JunctionTree, sizes: dict[str, int], totals: np.ndarray, one_way: dict[str, np.ndarray],
                 pairs: list[tuple[Clique, np.ndarray]], floor: float = 1e-3) -> Model:
    """A model of `tree` holding the distribution of a forest of measured pairs: the pairs (each (a, b) in the
    query's order with its table (units, a, b)) taken in the order given while they join two parts (Kruskal),
    each part from its first attribute in the query's order: that attribute's distribution (`one_way`, (units,
    size)) times every other's given its parent; attributes no pair joins independent. Every table is made at
    least `floor`. Each factor lies in a maximal clique (every pair is measured, or inside a measured clique). A
    start for `fit` that already holds the strongest measured dependencies (from zero potentials, 300 iterations
    on Adult's 26 chosen pairs leave the model at 0.136 mean L1 over its 2-way tables; from this start 0.084)."""
    model = Model(tree, sizes, totals)
    part = {a: a for a in tree.attributes}

    def root(a: str) -> str:
        while part[a] != a:
            a = part[a]
        return a

    joined: dict[str, list[tuple[str, Clique, np.ndarray]]] = {a: [] for a in tree.attributes}
    for (a, b), table in pairs:
        if root(a) != root(b):
            part[root(a)] = root(b)
            joined[a].append((b, (a, b), table))
            joined[b].append((a, (a, b), table))
    units = model.totals.size
    factors: list[tuple[Clique, np.ndarray]] = []
    seen: set[str] = set()
    for first in tree.attributes:
        if first in seen:
            continue
        seen.add(first)
        factors.append(((first,), np.log(np.maximum(np.asarray(one_way[first], dtype=np.float64).reshape(units, -1),
                                                     floor))))
        reached = [first]
        for parent in reached:
            for child, pair, table in joined[parent]:
                if child in seen:
                    continue
                seen.add(child)
                reached.append(child)
                rows = np.maximum(np.asarray(table, dtype=np.float64), floor)
                given_axis = 2 if pair == (parent, child) else 1  # the child's axis
                factors.append((pair, np.log(rows / rows.sum(axis=given_axis, keepdims=True))))
    for clique, values in factors:
        home = tree.home(clique)
        model.potentials[home] = model.potentials[home] + _expand(values, clique, tree.cliques[home], sizes)
    return model


def measured_start(tree: JunctionTree, sizes: dict[str, int], totals: np.ndarray,
                   measurements: list[Measurement]) -> Model:
    """`forest_start` from measurements: each attribute's 1-way table (clipped at 0; uniform where none is
    measured) and, in the measurements' order, each measured pair, or each pair inside a larger measured table
    (its margin)."""
    units = np.asarray(totals).size
    one_way = {a: np.ones((units, sizes[a])) for a in tree.attributes}
    pairs: list[tuple[Clique, np.ndarray]] = []
    for m in measurements:
        values = np.asarray(m.values, dtype=np.float64).reshape((units,) + tuple(sizes[a] for a in m.clique))
        if len(m.clique) == 1:
            one_way[m.clique[0]] = np.maximum(values, 0.0)
        for pair in itertools.combinations(m.clique, 2):
            pairs.append((pair, _sum_to(values, m.clique, pair)))
    return forest_start(tree, sizes, totals, one_way, pairs)


def estimated_totals(measurements: list[Measurement]) -> np.ndarray:
    """Each unit's total: the inverse-variance weighted mean of the measurements' totals (a table of n cells with
    variance v per cell gives its total with variance n v), at least 0."""
    weights = [1.0 / (max(m.variance, 1e-12) * m.values[0].size) for m in measurements]
    sums = [m.values.reshape(m.values.shape[0], -1).sum(axis=1) for m in measurements]
    return np.maximum(sum(w * s for w, s in zip(weights, sums)) / sum(weights), 0.0)


@dataclass(frozen=True)
class _Margins:
    """How the loss takes each measurement's table from the model: per maximal clique, its measurements largest
    first, each summed from the smallest table already taken that holds it (a 1-way table from its pair, not
    from a large clique), and the gradient pushed back the same way, smallest first. Public: from the cliques."""

    steps: tuple[tuple[int, tuple[tuple[int, Clique, Clique], ...]], ...]
    """Per maximal clique (its index): (measurement index, its clique, the clique it is summed from)."""

    @classmethod
    def of(cls, tree: JunctionTree, measurements: list[Measurement]) -> "_Margins":
        steps = []
        for home, clique in enumerate(tree.cliques):
            held = sorted((i for i, m in enumerate(measurements) if tree.home(m.clique) == home),
                          key=lambda i: -len(measurements[i].clique))
            taken: list[Clique] = [clique]
            order = []
            for i in held:
                sub = measurements[i].clique
                source = min((c for c in taken if set(sub) <= set(c)), key=len)
                order.append((i, sub, source))
                if sub not in taken:
                    taken.append(sub)
            if order:
                steps.append((home, tuple(order)))
        return cls(tuple(steps))


def _loss_and_gradients(model: Model, marginals: list[np.ndarray], measurements: list[Measurement],
                        weights: list[float], margins: _Margins) -> tuple[np.ndarray, list[np.ndarray]]:
    """Per unit, sum_m w_m ||mu_m - y_m||^2 / 2, and its gradient with respect to each maximal clique's table."""
    tree, sizes = model.tree, model.sizes
    loss = np.zeros(model.totals.size)
    gradients = [np.zeros_like(t) for t in marginals]
    for home, order in margins.steps:
        clique = tree.cliques[home]
        tables: dict[Clique, np.ndarray] = {clique: marginals[home]}
        pushed: dict[Clique, np.ndarray] = {}
        for i, sub, source in order:
            m = measurements[i]
            if sub not in tables:
                tables[sub] = _sum_to(tables[source], source, sub)
            residual = tables[sub] - m.values
            loss += 0.5 * weights[i] * (residual * residual).reshape(residual.shape[0], -1).sum(axis=1)
            pushed[sub] = pushed.get(sub, 0.0) + weights[i] * residual
        for i, sub, source in reversed(order):  # smallest first: each gradient into the table it was taken from
            if sub in pushed and sub != clique:
                part = pushed.pop(sub)
                if source == clique:
                    gradients[home] += _expand(part, sub, clique, sizes)
                else:
                    pushed[source] = pushed.get(source, 0.0) + _expand(part, sub, source, sizes)
        if clique in pushed:
            gradients[home] += pushed.pop(clique)
    return loss, gradients


def _inner(gradients: list[np.ndarray], a: list[np.ndarray], b: list[np.ndarray]) -> np.ndarray:
    """Per unit, sum over the cliques of <gradient, a - b>."""
    return sum(((g * (x - y)).reshape(g.shape[0], -1).sum(axis=1) for g, x, y in zip(gradients, a, b)))


def fit(tree: JunctionTree, sizes: dict[str, int], measurements: list[Measurement],
        totals: np.ndarray | None = None, iterations: int = FIT_ITERATIONS, start: Model | None = None,
        tolerance: float | None = None) -> Model:
    """The model whose tables fit the measurements best (weighted least squares, weights the inverse variances
    relative to the smallest), each unit with `totals` records (default `estimated_totals`): mirror descent on
    the log-potentials, theta <- theta - step * gradient, each unit's step grown by 1.01 after a step that meets
    Armijo's condition and halved (the step undone) after one that does not, from 2 / total (Private-PGM's
    schedule). `start`: a model of the same tree whose potentials the descent starts from (warm start).
    `tolerance`: every CONVERGENCE_CHECK iterations, a unit whose loss fell by less than `tolerance` times the
    noise's loss (0.5 x the smallest variance x the measured cells: every residual one noise standard deviation)
    since the check before stops (its potentials stay as they are), and the fit ends when every unit has stopped
    or after `iterations`: each unit's result depends on its own trajectory only, never on the other units of its
    chunk (so the engines, chunking units differently, agree).
    Measured limits: one step per unit, so a table weighted far below the heaviest converges slowly (a 100-cell
    1-way table weighted 1/100 beside a 2-way table: still 17% off in L1 after 1000 iterations, 0.03% at equal
    weights), and large cliques slowly (Adult's published 2-way tables, 30 pairs closing cycles into a 5-way
    clique: 2.4% mean L1 misfit after 1000 iterations)."""
    if totals is None:
        totals = estimated_totals(measurements)
    model = Model(tree, sizes, totals)
    if start is not None:
        model.potentials = [p.copy() for p in start.potentials]
    smallest = min(max(m.variance, 1e-12) for m in measurements)
    weights = [smallest / max(m.variance, 1e-12) for m in measurements]
    measurements = [Measurement(m.clique, np.asarray(m.values, dtype=np.float64).reshape(
        (-1,) + tuple(sizes[a] for a in m.clique)), m.variance) for m in measurements]
    margins = _Margins.of(tree, measurements)
    step = 2.0 / np.maximum(model.totals, 1.0)
    marginals = model.marginals()
    loss, gradients = _loss_and_gradients(model, marginals, measurements, weights, margins)
    moving = np.ones(loss.shape, dtype=bool)
    checked = loss
    noise_loss = 0.5 * smallest * sum(m.values[0].size for m in measurements)  # in the loss's weights
    for iteration in range(iterations):
        if tolerance is not None and iteration and iteration % CONVERGENCE_CHECK == 0:
            moving &= checked - loss > tolerance * noise_loss
            checked = loss
            if not moving.any():
                break
        trial = [p - _per_unit(step, p) * g for p, g in zip(model.potentials, gradients)]
        trial_marginals = model.marginals(trial)
        trial_loss, trial_gradients = _loss_and_gradients(model, trial_marginals, measurements, weights, margins)
        accept = moving & (loss - trial_loss >= 0.5 * step * _inner(gradients, marginals, trial_marginals))
        model.iterations += moving
        model.potentials = _chosen(accept, trial, model.potentials)
        marginals = _chosen(accept, trial_marginals, marginals)
        gradients = _chosen(accept, trial_gradients, gradients)
        loss = np.where(accept, trial_loss, loss)
        step = np.where(accept, 1.01 * step, 0.5 * step)
    return model


def _chosen(accept: np.ndarray, trial: list[np.ndarray], current: list[np.ndarray]) -> list[np.ndarray]:
    """Per unit, the trial's tables where its step was accepted, else the current ones (the same values
    `np.where` gives, without the copies when every unit or none accepted)."""
    if accept.all():
        return trial
    if not accept.any():
        return current
    return [np.where(_per_unit(accept, c), t, c) for t, c in zip(trial, current)]


def _per_unit(values: np.ndarray, like: np.ndarray) -> np.ndarray:
    """A per-unit vector shaped to broadcast against a (units, ...) table."""
    return values.reshape((-1,) + (1,) * (like.ndim - 1))


def integer_tables(tree: JunctionTree, sizes: dict[str, int], marginals: list[np.ndarray],
                   unit_totals: np.ndarray) -> list[np.ndarray]:
    """Every maximal clique's table as nonnegative integers (units, sizes...) adding up exactly: the root's
    attributes dealt from the unit totals, each later clique's from its separator's counts in its parent's integer
    table, one attribute at a time: the counts of the attributes dealt so far split among the next attribute's
    values in proportion to the clique's fitted table (`fitted_rows`, per row of counts). Dealing attribute by
    attribute keeps each row's rounding among a few cells (rounding a large clique's table at once spreads its
    error over its many small cells). A unit's tables depend on that unit's inputs only."""
    unit_totals = np.asarray(unit_totals, dtype=np.int64)
    units = unit_totals.size
    out: list[np.ndarray] = []
    for i, (clique, table) in enumerate(zip(tree.cliques, marginals)):
        have = tree.separator(i)
        if tree.parents[i] < 0:
            counts = unit_totals
        else:
            p = tree.parents[i]
            counts = _sum_to(out[p], tree.cliques[p], have)
        for a in [x for x in clique if x not in have]:
            grown = _ordered(tree.attributes, set(have) | {a})
            rows = _grouped(_sum_to(table, clique, grown), grown, have, (a,))
            dealt = fitted_rows(rows.reshape(-1, sizes[a]), counts.reshape(-1))
            counts = _ungrouped(dealt.reshape((units,) + tuple(sizes[x] for x in have + (a,))), grown, have + (a,))
            have = grown
        out.append(counts)
    return out


def _grouped(table: np.ndarray, clique: Clique, separator: Clique, new: Clique) -> np.ndarray:
    """A (units, clique...) table as (units, separator..., new...)."""
    return np.transpose(table, [0] + [1 + clique.index(a) for a in separator + new])


def _ungrouped(table: np.ndarray, clique: Clique, order: Clique) -> np.ndarray:
    """`_grouped`'s inverse: a (units, order...) table in the clique's own order."""
    return np.ascontiguousarray(np.transpose(table, [0] + [1 + order.index(a) for a in clique]))


def records(tree: JunctionTree, sizes: dict[str, int], tables: list[np.ndarray], seed: int
            ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(each record's unit, each attribute's code per record) tabulating exactly to `tables` (`integer_tables`):
    the root clique's records, then clique by clique the new attributes' cells dealt evenly to the records of
    each separator value (`dealing.dealt_cells`, keyed by `seed`, public), so the new attributes are independent
    of the attributes already drawn given the separator in expectation (the model's conditional independence),
    and every run of records sharing their earlier values gets each cell's share within `dealing`'s bound."""
    rng = np.random.default_rng(seed)
    units = tables[0].shape[0]
    root = tree.cliques[0]
    unit = np.repeat(np.arange(units), tables[0].reshape(units, -1).sum(axis=1))
    cell = np.repeat(np.tile(np.arange(math.prod(sizes[a] for a in root)), units), tables[0].ravel())
    codes = dict(zip(root, np.unravel_index(cell, [sizes[a] for a in root])))
    for i in range(1, len(tree.cliques)):
        clique, separator = tree.cliques[i], tree.separator(i)
        new = tuple(a for a in clique if a not in separator)
        group = unit
        for a in separator:
            group = group * sizes[a] + codes[a]
        counts = _grouped(tables[i], clique, separator, new).reshape(-1, math.prod(sizes[a] for a in new))
        cells = dealt_cells(group, counts, by_domain(codes, sizes, separator), rng)
        codes.update(zip(new, np.unravel_index(cells, [sizes[a] for a in new])))
    return unit, {a: np.asarray(codes[a], dtype=np.int64) for a in tree.attributes}
