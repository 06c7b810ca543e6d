"""One generalised least-squares estimate over every count measurement of a release.

Every count table of a release (hierarchy levels, marginals, histograms) tabulates the same bounded
records, so the true tables agree wherever two of them can be compared: on their common coarsening
(the coarser geography level of each geography column, the attributes both carry). The estimator
minimises sum_t ||z_t - y_t||^2 / v_t subject to all those agreements: the best linear unbiased
estimate of every table from all measurements together (Hay et al. 2010 on a tree, generalised to any
set of marginal-type tables). Solved in measurement space: z = y - V C^T lambda with
(C V C^T) lambda = C y, by Jacobi-preconditioned conjugate gradients on sparse matrices, O(cells) per
iteration, no commercial solver and no dense matrix.

Privacy: reads only noisy measurements, their public variances and the public plan (tables, domains):
post-processing, so every output keeps the measurements' guarantee. Nothing here reads a record.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from scipy.sparse.linalg import LinearOperator, cg

from .aggregate import unravel_cells
from .domains import NATION, Dimension, GeographyDomain

TOLERANCE = 1e-11
"""Relative residual of the conjugate-gradient solve (the estimate is consistent to ~1e-9 of its scale)."""


@dataclass(frozen=True)
class CountTable:
    """A count table as the estimator sees it: its public axes and per-cell noise variance (0: invariant)."""

    name: str
    dims: tuple[Dimension, ...]
    variance: float

    @property
    def n_cells(self) -> int:
        return math.prod(map(int, [d.size for d in self.dims])) if self.dims else 1


@dataclass(frozen=True)
class Coarsening:
    """What two tables can be compared on: a level per geography column (nation omitted), and attributes."""

    geography: tuple[tuple[str, str], ...]
    attributes: frozenset[str]

    def within(self, finer: "Coarsening", geographies: dict[str, GeographyDomain]) -> bool:
        """True when `finer` determines this coarsening (each level at least as fine, attributes a superset)."""
        levels = dict(finer.geography)
        for column, level in self.geography:
            if column not in levels or geographies[column].width(levels[column]) < geographies[column].width(level):
                return False
        return self.attributes <= finer.attributes


def _levels(table: CountTable, geographies: dict[str, GeographyDomain]) -> dict[str, str]:
    return {d.column: d.level for d in table.dims if d.column in geographies}


def common_coarsening(a: CountTable, b: CountTable, geographies: dict[str, GeographyDomain]) -> Coarsening:
    """The finest public table both `a` and `b` determine (by summing cells)."""
    levels_a, levels_b = _levels(a, geographies), _levels(b, geographies)
    geography = []
    for column in sorted(set(levels_a) & set(levels_b)):
        coarser = min(levels_a[column], levels_b[column], key=geographies[column].width)
        if coarser != NATION:
            geography.append((column, coarser))
    attributes = frozenset(d.column for d in a.dims if d.column not in geographies) & \
        frozenset(d.column for d in b.dims if d.column not in geographies)
    return Coarsening(tuple(geography), attributes)


def projection(table: CountTable, target: Coarsening, geographies: dict[str, GeographyDomain]) -> sp.csr_matrix:
    """0/1 matrix summing the table's cells (C order) into the cells of `target` (geography columns in
    `target` order, then attributes sorted)."""
    coordinates = unravel_cells(tuple(d.size for d in table.dims))
    by_column = {d.column: (d, c) for d, c in zip(table.dims, coordinates)}
    index = np.zeros(table.n_cells, dtype=np.int64)
    size = 1
    for column, level in target.geography:
        dim, coords = by_column[column]
        mapping = geographies[column].parent_of(dim.level, level)
        index = index * len(geographies[column].labels(level)) + mapping[coords]
        size *= len(geographies[column].labels(level))
    for column in sorted(target.attributes):
        dim, coords = by_column[column]
        index = index * dim.size + coords
        size *= dim.size
    ones = np.ones(table.n_cells)
    return sp.csr_matrix((ones, (index, np.arange(table.n_cells))), shape=(size, table.n_cells))


def linked_pairs(tables: list[CountTable], geographies: dict[str, GeographyDomain]) -> list[tuple[int, int, Coarsening]]:
    """Pairs of tables whose agreement is a constraint, without the ones other kept pairs imply.

    Pairs are taken finest common coarsening first; a pair is left out when a path of kept pairs,
    each agreeing on a coarsening that determines this pair's, already joins the two tables."""
    candidates = []
    for i, j in itertools.combinations(range(len(tables)), 2):
        if tables[i].variance == 0 and tables[j].variance == 0:
            continue
        common = common_coarsening(tables[i], tables[j], geographies)
        size = projection_size(common, tables[i], geographies)
        candidates.append((-size, i, j, common))
    candidates.sort(key=lambda c: (c[0], c[1], c[2]))
    kept: list[tuple[int, int, Coarsening]] = []
    adjacent: dict[int, list[tuple[int, Coarsening]]] = {k: [] for k in range(len(tables))}
    for _, i, j, common in candidates:
        if not _joined(i, j, common, adjacent, geographies):
            kept.append((i, j, common))
            adjacent[i].append((j, common))
            adjacent[j].append((i, common))
    return kept


def projection_size(target: Coarsening, table: CountTable, geographies: dict[str, GeographyDomain]) -> int:
    sizes = {d.column: d.size for d in table.dims}
    geo = [len(geographies[c].labels(level)) for c, level in target.geography]
    return math.prod(map(int, geo + [sizes[a] for a in target.attributes]))


def _joined(i: int, j: int, common: Coarsening, adjacent: dict[int, list[tuple[int, Coarsening]]],
            geographies) -> bool:
    """Is there a path i -> j over kept pairs (`adjacent`: each table's kept pairs) whose coarsenings each
    determine `common`?"""
    reached, frontier = {i}, [i]
    while frontier:
        node = frontier.pop()
        for other, edge in adjacent[node]:
            if other not in reached and common.within(edge, geographies):
                if other == j:
                    return True
                reached.add(other)
                frontier.append(other)
    return j in reached


def constraint_matrix(tables: list[CountTable], geographies: dict[str, GeographyDomain]) -> sp.csr_matrix:
    """C with C z = 0 exactly when the stacked tables z agree on every linked pair's coarsening."""
    offsets = np.concatenate([[0], np.cumsum([t.n_cells for t in tables])])
    blocks = []
    for i, j, common in linked_pairs(tables, geographies):
        left = projection(tables[i], common, geographies).tocoo()
        right = projection(tables[j], common, geographies).tocoo()
        rows = np.concatenate([left.row, right.row])
        cols = np.concatenate([left.col + offsets[i], right.col + offsets[j]])
        data = np.concatenate([left.data, -right.data])
        blocks.append(sp.csr_matrix((data, (rows, cols)), shape=(left.shape[0], offsets[-1])))
    if not blocks:
        return sp.csr_matrix((0, int(offsets[-1])))
    return sp.vstack(blocks, format="csr")


def generalised_least_squares(tables: list[CountTable], noisy: list[np.ndarray],
                              geographies: dict[str, GeographyDomain]) -> list[np.ndarray]:
    """The GLS estimate of every table from all measurements (flat, float64), consistent on every link.

    Privacy: post-processing of the noisy measurements with public variances and structure."""
    y = np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in noisy])
    variances = np.concatenate([np.full(t.n_cells, float(t.variance)) for t in tables])
    constraints = constraint_matrix(tables, geographies)
    z = y - _correction(constraints, variances, constraints @ y)
    offsets = np.concatenate([[0], np.cumsum([t.n_cells for t in tables])])
    return [z[offsets[k]:offsets[k + 1]] for k in range(len(tables))]


def _correction(constraints: sp.csr_matrix, variances: np.ndarray, gap: np.ndarray) -> np.ndarray:
    """V C^T lambda with (C V C^T) lambda = gap: the least-variance-weighted change closing every gap."""
    if constraints.shape[0] == 0 or not np.any(gap):
        return np.zeros(constraints.shape[1])
    transpose = constraints.T.tocsr()
    operator = LinearOperator((constraints.shape[0],) * 2, dtype=np.float64,
                              matvec=lambda x: constraints @ (variances * (transpose @ x)))
    diagonal = constraints.multiply(constraints) @ variances
    inverse = np.where(diagonal > 0, 1.0 / np.where(diagonal > 0, diagonal, 1.0), 0.0)
    preconditioner = LinearOperator(operator.shape, dtype=np.float64, matvec=lambda x: inverse * x)
    multipliers, info = cg(operator, gap, rtol=TOLERANCE, atol=0.0, maxiter=10_000, M=preconditioner)
    if info > 0:
        multipliers, _ = cg(operator, gap, x0=multipliers, rtol=TOLERANCE, atol=0.0, maxiter=50_000, M=preconditioner)
    return variances * (transpose @ multipliers)


def gls_variances(tables: list[CountTable], geographies: dict[str, GeographyDomain]) -> tuple[list[np.ndarray], bool]:
    """Per cell of every table, the variance of its GLS estimate (before any rounding), and whether it is
    exact (True) or an upper bound (False).

    Public: a function of the plan's structure and noise variances only, never of the measurements.
    Exact when the links between tables of different geography levels carry no attributes (they agree
    on unit totals only): the tables at one level with attributes then form one block per unit, whose
    internal least-squares variances are found once (every unit's block has the same structure, and
    permuting an attribute's values permutes cells of equal variance), and the units' totals form a
    tree solved by Gaussian message passing (an up pass of subtree variances, a down pass of
    outside-subtree variances). Attributes every table carries (a hierarchy crossed with `by`) split the
    system into identical independent copies, one per their cells, and are set aside first. Otherwise the
    same computation ignores the attribute links across levels: the variance of an unbiased estimator
    that uses less information, an upper bound.
    With more than one geography column, the raw noise variance (also an upper bound)."""
    shared = set.intersection(*[{d.column for d in _attributes(t, geographies)} for t in tables]) if tables else set()
    if shared:  # every table carries these attributes: the system is one copy per their cells
        reduced = [CountTable(t.name, tuple(d for d in t.dims if d.column not in shared), t.variance) for t in tables]
        variances, exact = gls_variances(reduced, geographies)
        return [_spread(t, r, v) for t, r, v in zip(tables, reduced, variances)], exact
    columns = sorted({d.column for t in tables for d in t.dims if d.column in geographies})
    if len(columns) > 1:
        return [np.full(t.n_cells, float(t.variance)) for t in tables], False
    geo = geographies[columns[0]] if columns else None

    def level_of(table: CountTable) -> str:
        return next((d.level for d in table.dims if d.column in geographies), NATION)

    levels = sorted({level_of(t) for t in tables}, key=lambda lvl: geo.width(lvl) if geo else 0)
    # exact unless a link across levels carries attributes; with one level there is no such link (and the pairs,
    # quadratic in the tables, are not worth finding: 435 tables took 17 s)
    exact = len(levels) <= 1 or all(not common.attributes for i, j, common in linked_pairs(tables, geographies)
                                    if level_of(tables[i]) != level_of(tables[j]))
    precision, blocks = {}, {}
    for level in levels:
        at_level = [t for t in tables if level_of(t) == level]
        nodes = [t for t in at_level if len(_attributes(t, geographies)) == 0]
        block = [t for t in at_level if len(_attributes(t, geographies)) > 0]
        blocks[level] = _block_variances(block, geographies) if block else None
        node_precision = sum(_precision(t.variance) for t in nodes)
        if blocks[level] is not None:
            node_precision += _precision(blocks[level][1])
        precision[level] = node_precision
    sizes = [geo.level_size(lvl) if geo else 1 for lvl in levels]
    parents = [None] + [geo.parent_of(levels[i], levels[i - 1]) for i in range(1, len(levels))]
    final = _tree_variances([np.full(n, precision[lvl]) for n, lvl in zip(sizes, levels)], parents)
    result = []
    for t in tables:
        level = level_of(t)
        total = final[levels.index(level)]
        attributes = _attributes(t, geographies)
        if not attributes:
            result.append(total.copy() if geo and level != NATION else np.full(t.n_cells, float(total[0])))
            continue
        internal, block_total = blocks[level][0][t.name], blocks[level][1]
        per_unit = math.prod(map(int, [d.size for d in attributes]))
        unit_variance = internal - (block_total - total) / per_unit ** 2
        unit_of_cell = _unit_of_cell(t, geographies)
        result.append(np.maximum(unit_variance[unit_of_cell], 0.0))
    return result, exact


def _spread(table: CountTable, reduced: CountTable, values: np.ndarray) -> np.ndarray:
    """Per cell of `table`, the value of its cell in `reduced` (the same dimensions less some)."""
    kept = {d.column for d in reduced.dims}
    index = np.zeros(table.n_cells, dtype=np.int64)
    for d, c in zip(table.dims, unravel_cells(tuple(d.size for d in table.dims))):
        if d.column in kept:
            index = index * d.size + c
    return values[index]


def _attributes(table: CountTable, geographies: dict[str, GeographyDomain]) -> list[Dimension]:
    return [d for d in table.dims if d.column not in geographies]


def _unit_of_cell(table: CountTable, geographies: dict[str, GeographyDomain]) -> np.ndarray:
    """Each cell's geography unit (0 for a table without a geography axis)."""
    coordinates = unravel_cells(tuple(d.size for d in table.dims))
    for d, c in zip(table.dims, coordinates):
        if d.column in geographies:
            return c
    return np.zeros(table.n_cells, dtype=np.int64)


def _precision(variance: float) -> float:
    return np.inf if variance == 0 else 1.0 / variance


def _block_variances(block: list[CountTable], geographies) -> tuple[dict[str, float], float]:
    """One unit's block of attribute tables: each table's per-cell GLS variance within the block, and the
    variance of the block's estimate of the unit total, in closed form (as ResidualPlanner, Xiao et al. 2023).

    Each table's cells split into orthogonal residual components, one per subset S of its attributes (the part
    of its S-margin orthogonal to every coarser margin). Consistency on every shared margin makes a residual
    one unknown for all tables holding S, and a table A measures it with independent noise of variance
    v_A * prod(n_i, i in A - S) per component (summing the cells of the other attributes); so the GLS estimate
    of residual S is the inverse-variance average, of precision I_S = sum over tables A holding S of
    1 / (v_A prod(n_i, i in A - S)), and a cell of table B has variance
    sum over S in B of prod(1 - 1/n_i, i in S) / (I_S prod(n_i^2, i in B - S)); the total's is 1 / I_empty.
    An invariant (v = 0) makes the residuals it holds exact. Public: the plan's structure and variances only."""
    local = [CountTable(t.name, tuple(_attributes(t, geographies)), t.variance) for t in block]
    sizes = {d.column: d.size for t in local for d in t.dims}
    held = [frozenset(d.column for d in t.dims) for t in local]
    precision: dict[frozenset, float] = {}

    def information(subset: frozenset) -> float:
        if subset not in precision:
            found = [(t, attributes) for t, attributes in zip(local, held) if subset <= attributes]
            precision[subset] = np.inf if any(t.variance == 0 for t, _ in found) else math.fsum(
                1.0 / (float(t.variance) * math.prod(sizes[a] for a in attributes - subset)) for t, attributes in found)
        return precision[subset]

    internal = {}
    for t, attributes in zip(local, held):
        terms = []
        for k in range(len(attributes) + 1):
            for subset in map(frozenset, itertools.combinations(sorted(attributes), k)):
                if not np.isinf(information(subset)):
                    terms.append(math.prod(1 - 1 / sizes[a] for a in subset)
                                 / (information(subset) * math.prod(sizes[a] ** 2 for a in attributes - subset)))
        internal[t.name] = math.fsum(terms)
    total = information(frozenset())
    return internal, 0.0 if np.isinf(total) else 1.0 / total


def _tree_variances(precisions: list[np.ndarray], parents: list[np.ndarray | None]) -> list[np.ndarray]:
    """Gaussian message passing on a tree of unit totals: level i's units each hold one measurement of
    precision `precisions[i]` (0: none, inf: exact); the final variance of every unit's estimate."""
    with np.errstate(divide="ignore", invalid="ignore"):
        below = [None] * len(precisions)
        child_sums = [None] * len(precisions)
        for i in range(len(precisions) - 1, -1, -1):
            child_precision = 0.0
            if i + 1 < len(precisions):
                child_sums[i] = np.bincount(parents[i + 1], weights=below[i + 1], minlength=precisions[i].size)
                child_precision = 1.0 / child_sums[i]
            below[i] = 1.0 / (precisions[i] + child_precision)
        above = [np.full(precisions[0].size, np.inf)]
        for i in range(1, len(precisions)):
            outside_parent = 1.0 / (precisions[i - 1] + 1.0 / above[i - 1])
            parent = parents[i]
            above.append(outside_parent[parent] + child_sums[i - 1][parent] - below[i])
        final = [1.0 / (1.0 / a + 1.0 / b) for a, b in zip(above, below)]
    return [np.nan_to_num(f, nan=0.0, posinf=np.inf) for f in final]
