"""Post-processing of a release's noisy measurements into publishable tables.

Reads only noisy measurements, their variances and the public plan (post-processing immunity). First
one generalised least-squares estimate over every count table of the release (hierarchy levels,
marginals, histograms together): computed per geographic unit, two passes over the levels, when the
tables form a tree of units (`transforms.units`), else globally (`transforms.estimation`, conjugate
gradients over every link); `estimation_path` says which and why. Then the integer step: hierarchy
queries top-down, per (parent, cell) (their integer totals become the totals of the marginal queries
over the same geography level), marginals per unit through a fitted joint table, histograms rounded.
Every step is a kernel over batches of parents or units whose results do not depend on the batching.
"""
from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from dprelease.transforms.domains import NATION, GeographyDomain
from dprelease.transforms.estimation import CountTable, generalised_least_squares, gls_variances
from dprelease.transforms.postprocess import clamp_nonnegative
from dprelease.transforms.units import integers
from dprelease.transforms.units.graphical import CONVERGENCE_CHECK, CONVERGENCE_LIMIT, CONVERGENCE_TOLERANCE
from dprelease.transforms.units.joint import JointShape, JointTable, marginal_tables
from dprelease.transforms.units.kernels import JOINT_ITERATIONS
from dprelease.transforms.units.groups import GROUP_WORK, transitions
from dprelease.transforms.units.passes import TreeVariances, blocks_of, down_job, estimate_tree, run_tree
from dprelease.transforms.units.tree import HierarchyQuery as TreeHierarchy
from dprelease.transforms.units.tree import MarginalsQuery as TreeMarginals
from dprelease.transforms.units.tree import UnitTable, UnitTree, decompose, decomposition_problem

from .engines.workers import worker_pool
from .plan import MeanOutput, Plan, TablePlan
from .spec import CountUnitsQuery, HierarchyQuery, MarginalsQuery, MeanQuery, QuantileQuery, SumQuery

JOINT_UNIT_LIMIT = 4_000_000
"""Largest joint table of one unit (attribute cells) fitted for exactly consistent integer marginals; the
joint of a query is fitted a chunk of units at a time, so the query's whole joint may be far larger."""

JOINT_SPREAD_LIMIT = 16
"""Largest ratio of a unit's joint cells to its largest table's cells for the joint path: rounding a
joint far larger than the tables spreads rounding error over many joint cells per published cell
(measured on Adult, 6 attributes, 2-way: published error above raw), so such queries take the
table-by-table path. Public: from the plan."""


def marginals_path(plan: Plan, query: MarginalsQuery) -> str:
    """'joint', 'fitted_tables', 'tables', 'tree' (`select: mst`), 'converged_model' (`select: aim` over a capped
    model, its tables may close cycles; 'model', its fit a fixed number of iterations, for manifest version 9 or
    earlier) or 'junction' (`select: aim` of manifest version 7 or earlier, or with too many candidates): how a
    marginals query's integer tables are made (public)."""
    if query.select == "mst":
        return "tree"
    if query.select == "aim":
        if not next(s for s in plan.selections if s.query == query.name).cycles:
            return "junction"
        return "converged_model" if plan.aim_converged_fit else "model"
    tables = [t for t in plan.tables if t.query == query.name]
    units = tables[0].dims[0].size if query.within else 1
    per_unit = joint_size(plan, query) // units
    if per_unit > JOINT_UNIT_LIMIT:
        return "tables"
    largest = max(t.n_cells // units for t in tables)
    return "joint" if per_unit <= JOINT_SPREAD_LIMIT * largest else "fitted_tables"


def uses_joint(plan: Plan, query: MarginalsQuery) -> bool:
    """Whether a marginals query's integer tables are the margins of one rounded joint table per unit."""
    return marginals_path(plan, query) == "joint"


COUNT_KINDS = ("hierarchy", "marginals", "histogram")
"""Query kinds whose tables all count the same bounded records: one estimate covers them together."""

ESTIMATE = ("one generalised least-squares estimate of every count table (hierarchy levels, marginals, "
            "histograms) from all their noisy measurements and variances together, consistent wherever two "
            "tables can be compared (best linear unbiased; invariants held exact)")

def _model_step(fit: str) -> str:
    """The step of a `select: aim` query's model path, `fit` saying how long its fit runs (one text per path:
    'model', manifest version 9 and earlier, and 'converged_model')."""
    return (ESTIMATE + "; per unit, the graphical model of the query's 1-way tables and chosen tables (AIM; the "
            "tables may close cycles): the junction tree of their attributes' chordal completion, fitted to their "
            "estimates by weighted least squares over the marginal polytope (entropic mirror descent on the "
            "cliques' log-potentials, Private-PGM's estimator" + fit + ", its maximal cliques' tables made "
            "nonnegative integers dealt attribute by attribute from the unit total and each parent's separator "
            "counts; published tables are their margins (every shared margin and total agrees exactly)")


STEPS = {
    "hierarchy": ESTIMATE + "; then top-down per (parent, cell): nonnegative least-squares fit to the parent's "
                 "final value and controlled rounding preserving the parent's integer",
    "marginals_joint": ESTIMATE + "; unit totals from the hierarchy of the same geography level (else the estimate "
                       "rounded); a nonnegative joint table per unit with those totals fitted to the query's noisy "
                       "tables by weighted least squares over the marginal polytope (entropic mirror descent, "
                       "Private-PGM's estimator on one clique, started from the estimated tables made nonnegative, "
                       "raked to shared integer one-way margins and joined by iterative proportional fitting), "
                       "rounded to the unit's integer total by controlled rounding; published tables are its "
                       "marginals (exactly consistent)",
    "marginals_fitted_tables": ESTIMATE + "; a nonnegative joint fitted per unit as for a joint path, but much larger "
                               "than the tables (rounding it would spread error), so each table, a margin of the "
                               "fitted joint, is rounded to integers adding up to the unit total: totals agree exactly, "
                               "other shared margins up to rounding",
    "marginals_tables": ESTIMATE + "; the joint table is too large to fit, so each table is made nonnegative and "
                        "integral per unit with its unit total preserved: totals agree exactly, other shared "
                        "sub-marginals only up to rounding",
    "marginals_tree": ESTIMATE + "; per unit, the tree model of the chosen 2-way tables (MST): the first "
                      "attribute's table fitted to the unit total, then down each chosen pair away from it, each "
                      "parent value's row of the pair's estimate, its cells at rare child values (estimated count "
                      "below one noise standard deviation) pooled, shrunk toward the child's 1-way estimate "
                      "(James-Stein factor from the public noise variance) and fitted to that value's count by "
                      "least squares and controlled rounding: nonnegative integer tables that add up exactly (each "
                      "pair's margins are the 1-way tables) and that `synthesize`'s records reproduce",
    "marginals_junction": ESTIMATE + "; per unit, the junction tree of the chosen tables (AIM-style selection), "
                          "grown in the order they were chosen: the first table's first attribute fitted to the unit "
                          "total, then each chosen table's rows (its new attribute given each value of its separator, "
                          "the attributes it shares with the tables before it), cells at rare values (estimated count "
                          "below one noise standard deviation) pooled, shrunk toward the new attribute's 1-way "
                          "estimate (James-Stein factor from the public noise variance) and fitted to the "
                          "separator's count by least squares and controlled rounding: nonnegative integer tables "
                          "that add up exactly and that `synthesize`'s records reproduce",
    "marginals_model": _model_step("; 1000 iterations, the unit total fixed)"),
    "marginals_converged_model": _model_step(
        f", the unit total fixed) until it settles (a unit stops when its loss falls in {CONVERGENCE_CHECK} "
        f"iterations by less than {CONVERGENCE_TOLERANCE} of the loss of residuals of one noise standard deviation "
        f"in every measured cell; at most {CONVERGENCE_LIMIT} iterations)"),
    "histogram": ESTIMATE + "; rounded to the nearest integer, negative values set to 0",
    "count_units": "negative noisy unit counts set to 0",
    "sum_nonnegative": "negative noisy sums set to 0 (the clamp's lower bound is >= 0)",
    "sum": "published raw (the clamp allows negative values)",
    "mean": "NAME.count: negative noisy counts set to 0; NAME.sum: negative sums set to 0 when the clamp's lower "
            "bound is >= 0; NAME (the mean): raw noisy sum / raw noisy count, clamped to the clamp, null where the "
            "noisy count is below 1",
    "quantile": "published as selected (each value a public candidate)",
}

LEGACY_STEPS = {
    "hierarchy": "weighted least squares on the tree (best linear unbiased estimate, variances per level; "
                 "invariant levels held exact), then top-down per (parent, cell): nonnegative least-squares fit "
                 "to the parent's final value and controlled rounding preserving the parent's integer",
    "marginals_joint": "unit totals from the hierarchy of the same geography level (or a weighted consensus); "
                       "shared sub-marginals set to their inverse-variance weighted consensus, smallest first, and "
                       "each table adjusted to them by least squares; then a nonnegative joint table per unit "
                       "fitted to those tables by iterative proportional fitting, rounded to the unit's integer "
                       "total by controlled rounding; published tables are its marginals (exactly consistent)",
    "marginals_tables": "unit totals and shared sub-marginals made consistent by weighted least squares as above; "
                        "the joint table is too large to fit, so each table is made nonnegative and integral per "
                        "unit with its unit total preserved: totals agree exactly, other shared sub-marginals only "
                        "up to rounding",
    "histogram": "negative noisy counts set to 0",
}
"""The steps as manifests of version 1 state them (releases made before the global estimate): verify
compares such a manifest against these texts."""


def count_tables(plan: Plan) -> list[TablePlan]:
    """The tables the least-squares estimate covers."""
    return [t for t in plan.tables if t.kind in COUNT_KINDS and t.statistic == "count"]


def _geographies(plan: Plan) -> dict[str, GeographyDomain]:
    return {name: d for name, d in plan.domains.items() if isinstance(d, GeographyDomain)}


def _estimator_inputs(plan: Plan) -> tuple[list[TablePlan], list[CountTable], dict[str, GeographyDomain]]:
    tables = count_tables(plan)
    return tables, [CountTable(t.name, t.dims, t.noise_variance()) for t in tables], _geographies(plan)


def _tree_inputs(plan: Plan) -> tuple[list[UnitTable], list[TreeHierarchy]]:
    tables = [UnitTable(t.name, t.query, t.kind, t.dims, t.noise_variance()) for t in count_tables(plan)]
    hierarchies = [TreeHierarchy(q.name, tuple(f"{q.name}.{level}" for level in q.levels), tuple(q.levels), bool(q.by))
                   for q in plan.spec.queries if isinstance(q, HierarchyQuery)]
    return tables, hierarchies


def _tree_marginals(plan: Plan) -> list[TreeMarginals]:
    """Each marginals query as the tree's integer step needs it: its tables, level, integer path, and the
    hierarchy table whose integers are its unit totals (the first hierarchy without `by` over that level)."""
    out = []
    for q in plan.spec.queries:
        if not isinstance(q, MarginalsQuery):
            continue
        level = q.within.partition(".")[2] if q.within else NATION
        source = next((h for h in plan.spec.queries if isinstance(h, HierarchyQuery) and not h.by and level in h.levels),
                      None)
        out.append(TreeMarginals(q.name, tuple(t.name for t in plan.tables if t.query == q.name), level,
                                 marginals_path(plan, q), f"{source.name}.{level}" if source else None))
    return out


_TREES: dict[int, tuple[weakref.ref, UnitTree | None]] = {}


def unit_tree(plan: Plan) -> UnitTree | None:
    """The tree of geographic units of the plan's count tables, or None when they do not form one
    (`estimation_path` says why). Public: from the plan alone; built once per plan object."""
    cached = _TREES.get(id(plan))
    if cached is not None and cached[0]() is plan:
        return cached[1]
    tree = _unit_tree(plan)
    _TREES[id(plan)] = (weakref.ref(plan), tree)
    weakref.finalize(plan, _TREES.pop, id(plan), None)
    return tree


def _unit_tree(plan: Plan) -> UnitTree | None:
    tables, hierarchies = _tree_inputs(plan)
    if not tables or decomposition_problem(tables, _geographies(plan), hierarchies):
        return None
    try:
        return decompose(tables, _geographies(plan), hierarchies, _tree_marginals(plan))
    except ValueError:
        return None


def estimation_path(plan: Plan) -> str:
    """How the least-squares estimate is computed, for people: what it means for the tables first (one estimate
    behind every count table, each cell's error stated), then per geographic unit or globally, and why."""
    tables, hierarchies = _tree_inputs(plan)
    if not tables:
        return "no count tables"
    problem = decomposition_problem(tables, _geographies(plan), hierarchies)
    if problem is None:
        try:
            tree = decompose(tables, _geographies(plan), hierarchies, [])
        except ValueError as error:
            problem = str(error)
        else:
            return (f"{ESTIMATE_MEANING}; computed per geographic unit: two passes over {len(tree.levels)} levels "
                    f"({' > '.join(level.name for level in tree.levels)}), each unit's block of tables at a time")
    return (f"{ESTIMATE_MEANING}; computed globally (conjugate gradients over every table at once, on one machine), "
            f"since the tables do not form a tree of geographic units ({problem})")


ESTIMATE_MEANING = ("every count table is published from one least-squares estimate of all of them together, so "
                    "tables that share a margin agree before rounding and each cell's error is stated (its GLS std "
                    "above, usually below its own table's noise)")


def least_squares_estimates(plan: Plan, noisy: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The GLS estimate (float, before the integer step) of every count table of the plan."""
    tree = unit_tree(plan)
    if tree is not None:
        return estimate_tree(tree, {n: noisy[n] for n in tree.tables})[0]
    tables, inputs, geographies = _estimator_inputs(plan)
    if not tables:
        return {}
    estimates = generalised_least_squares(inputs, [noisy[t.name] for t in tables], geographies)
    return {t.name: e for t, e in zip(tables, estimates)}


@dataclass(frozen=True)
class EstimateVariances:
    """Per cell of every count table, the variance of its GLS estimate before rounding; `exact` False
    means an upper bound (see `transforms.estimation.gls_variances`). Public: from the plan only.
    `per_cell` maps a table to its variances (computed on access for a tree of units: `TreeVariances`);
    `cells` and `largest` read a range or the maximum without holding a whole table."""

    per_cell: Mapping[str, np.ndarray]
    exact: bool

    def cells(self, name: str, start: int, stop: int) -> np.ndarray:
        ranged = getattr(self.per_cell, "cells", None)
        return ranged(name, start, stop) if ranged else np.asarray(self.per_cell[name][start:stop])

    def largest(self, name: str) -> float:
        largest = getattr(self.per_cell, "largest", None)
        return largest(name) if largest else float(np.max(self.per_cell[name]))


def estimate_variances(plan: Plan) -> EstimateVariances:
    """Exact per-cell variances from the tree of units when the tables form one (computed on demand from
    each unit's final total variance: memory per unit, not per cell), else `gls_variances` (exact or an
    upper bound, said so)."""
    tree = unit_tree(plan)
    if tree is not None:
        return EstimateVariances(TreeVariances(tree), True)
    tables, inputs, geographies = _estimator_inputs(plan)
    if not tables:
        return EstimateVariances({}, True)
    variances, exact = gls_variances(inputs, geographies)
    return EstimateVariances({t.name: v for t, v in zip(tables, variances)}, exact)


def post_process(plan: Plan, noisy: dict[str, np.ndarray], joints: dict | None = None, workers: int = 1,
                 group_work: int | None = None) -> dict[str, np.ndarray]:
    """Published table values (int64) for every table of the plan. On a tree of units: the passes and the
    integer step group by group (`workers` processes run the groups of a level at once; any grouping gives
    the same values). `joints`, when given, receives each marginals query's fitted integer joint table
    (attributes, units x attribute cells), or a `select: aim` model's integer clique tables (`ModelCliques`), from
    which `synthesize` draws records."""
    tree = unit_tree(plan)
    if tree is None or joints is not None:
        return integer_step(plan, least_squares_estimates(plan, noisy), noisy, joints)
    published: dict[str, np.ndarray] = {}
    with group_mapper(plan, workers) as mapper:
        for _, output in run_tree(tree, blocks_of(tree, noisy), transitions(tree, group_work or GROUP_WORK), mapper):
            published.update({name: values.ravel() for name, values in output.published.items()})
    return _other_tables(plan, published, {}, noisy)


_WORKER_TREE: UnitTree | None = None


def _start_worker(tree: UnitTree) -> None:
    global _WORKER_TREE
    _WORKER_TREE = tree


def _worker_down_job(job):
    return down_job(_WORKER_TREE, job)


@contextlib.contextmanager
def group_mapper(plan: Plan, workers: int):
    """How a level's groups run: in this process, or in `workers` processes that each receive this process's
    tree once (results are per unit: the same bits either way; the tree's operators are never recomputed
    in a worker, whose BLAS may run with another thread count and give other bits)."""
    if workers <= 1:
        yield None
        return
    with worker_pool(workers, _start_worker, (unit_tree(plan),)) as pool:
        yield lambda jobs: pool.map(_worker_down_job, jobs) if len(jobs) > 1 else [_local_down_job(plan, jobs[0])]


def _local_down_job(plan: Plan, job):
    return down_job(unit_tree(plan), job)


def integer_step(plan: Plan, estimates: dict[str, np.ndarray], noisy: dict[str, np.ndarray],
                 joints: dict | None = None) -> dict[str, np.ndarray]:
    """Published integers from the least-squares estimates (count tables) and the noisy measurements."""
    published: dict[str, np.ndarray] = {}
    unit_totals: dict[tuple[str, str], np.ndarray] = {}
    for query in plan.spec.queries:
        if isinstance(query, HierarchyQuery):
            published.update(_hierarchy(plan, query, estimates, unit_totals))
    for query in plan.spec.queries:
        if isinstance(query, MarginalsQuery):
            published.update(_marginals(plan, query, estimates, noisy, unit_totals, joints))
    return _other_tables(plan, published, estimates, noisy)


def _other_tables(plan: Plan, published: dict, estimates: dict, noisy: dict) -> dict[str, np.ndarray]:
    """Every table not published yet: histograms rounded from their estimates, the rest cell by cell."""
    for t in plan.tables:
        if t.name in published:
            continue
        if t.name in estimates:
            published[t.name] = integers.rounded(estimates[t.name])
        else:
            published[t.name] = published_cells(t, noisy[t.name])
    return published


def published_cells(table: TablePlan, noisy: np.ndarray) -> np.ndarray:
    """A table post-processed cell by cell (sums, unit counts, quantiles, a mean's sum and count): raw, or
    negative values set to 0 where the table is published nonnegative. Any range of cells alone."""
    return np.asarray(noisy).copy() if _published_raw(table) else clamp_nonnegative(noisy)


def _published_raw(table: TablePlan) -> bool:
    """Quantile selections, and sums whose clamp allows negative values, are published as released."""
    return table.statistic == "quantile" or (table.statistic == "sum" and table.measure.lower < 0)


def mean_values(mean: MeanOutput, noisy: dict[str, np.ndarray]) -> np.ndarray:
    """Per cell: raw noisy sum / raw noisy count, clamped to the measure's [lo, hi]; NaN (null) where the
    noisy count is below 1. Post-processing: reads noisy measurements and the public clamp only."""
    sums = noisy[mean.sum_table].astype(np.float64)
    counts = noisy[mean.count_table].astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.clip(sums / counts, mean.measure.lower, mean.measure.upper)
    return np.where(counts >= 1, ratio, np.nan)


def _hierarchy(plan: Plan, query: HierarchyQuery, estimates, unit_totals) -> dict[str, np.ndarray]:
    """Top-down: the first level rounded and clamped at 0, each lower level fitted per (parent, cell)."""
    tables = [t for t in plan.tables if t.query == query.name]
    geo = plan.domains[query.geography]
    assert isinstance(geo, GeographyDomain)
    result: dict[str, np.ndarray] = {}
    above = None
    for i, t in enumerate(tables):
        units = t.dims[0].size
        estimate = estimates[t.name].reshape(units, t.n_cells // units)
        if i == 0:
            values = integers.rounded(estimate)
        else:
            values = integers.children(estimate, geo.parent_of(query.levels[i], query.levels[i - 1]), above)
        result[t.name] = values.ravel()
        if not query.by:
            unit_totals.setdefault((query.geography, query.levels[i]), values.ravel())
        above = values
    return result


def joint_size(plan: Plan, query: MarginalsQuery) -> int:
    """Cells of the joint table (units x attribute cells) of a marginals query: public."""
    tables = [t for t in plan.tables if t.query == query.name]
    units = tables[0].dims[0].size if query.within else 1
    sizes = {}
    for t in tables:
        for d in t.dims[1 if query.within else 0:]:
            sizes[d.label] = d.size
    return units * math.prod(map(int, list(sizes.values())))


def joint_shape(plan: Plan, query: MarginalsQuery) -> tuple[JointShape, list[str]]:
    """The joint of a marginals query (its attributes' sizes, each table's axes and variance) and the
    attribute labels in joint order."""
    tables = [t for t in plan.tables if t.query == query.name]
    offset = 1 if query.within else 0
    attributes = list(dict.fromkeys(d.label for t in tables for d in t.dims[offset:]))
    size = {d.label: d.size for t in tables for d in t.dims[offset:]}
    shape = JointShape(tuple(size[a] for a in attributes),
                       tuple(JointTable(t.name, tuple(attributes.index(d.label) for d in t.dims[offset:]),
                                        t.noise_variance()) for t in tables))
    return shape, attributes


def _marginals(plan: Plan, query: MarginalsQuery, estimates, noisy, unit_totals, joints=None) -> dict[str, np.ndarray]:
    """Integer tables of a marginals query, per unit: through a joint fitted to its noisy tables with the
    unit totals fixed (`marginals_path`), or table by table from the least-squares estimates."""
    tables = [t for t in plan.tables if t.query == query.name]
    units = tables[0].dims[0].size if query.within else 1
    shape, attributes = joint_shape(plan, query)
    rows = {t.name: t.n_cells // units for t in tables}
    totals = _unit_totals(query, tables, estimates, unit_totals, units)
    collected: list = [] if joints is not None else None
    path = marginals_path(plan, query)
    published = marginal_tables(shape, totals, [noisy[t.name].reshape(units, rows[t.name]) for t in tables],
                                [estimates[t.name].reshape(units, rows[t.name]) for t in tables], JOINT_ITERATIONS,
                                path, collected)
    if joints is not None and collected:
        if path in ("model", "converged_model"):  # the model's integer clique tables, chunk by chunk
            joints[query.name] = ModelCliques(shape, attributes, [np.concatenate(c) for c in zip(*collected)])
        else:
            joints[query.name] = (attributes, np.concatenate(collected).reshape((units,) + shape.sizes))
    return {t.name: values.ravel() for t, values in zip(tables, published)}


@dataclass(frozen=True)
class ModelCliques:
    """The integer tables of the maximal cliques of a `select: aim` query's model (every unit's), as its
    post-processing made them (`joint._model_path`): each published table of the query is a margin of one of
    them, so records drawn from them tabulate exactly to the published tables."""
    shape: JointShape
    attributes: list[str]
    """The query's attributes in the joint's order (`joint_shape`): the model's attribute i is attributes[i]."""
    tables: list[np.ndarray]


def _unit_totals(query: MarginalsQuery, tables: list[TablePlan], estimates, unit_totals, units) -> np.ndarray:
    """Integer total per unit: the hierarchy's final value at that level, else the (consistent) estimate
    rounded: every table of the query carries the same estimated totals."""
    column, _, level = (query.within or "").partition(".")
    if query.within and (column, level) in unit_totals:
        return unit_totals[(column, level)]
    if not query.within:
        for (geo, lvl), values in unit_totals.items():
            if lvl == NATION:
                return values
    estimate = estimates[tables[0].name].reshape(units, -1).sum(axis=1)
    return np.maximum(np.rint(estimate), 0).astype(np.int64)


CONSISTENCY_STATED = (
    "; which published tables agree exactly: the estimate (before the integer step) is consistent wherever two "
    "tables can be compared; after it, the tables of one query agree as its step says, a marginals query's unit "
    "totals equal the hierarchy's at its level when it has one, and otherwise tables of different queries agree "
    "on a shared total only up to rounding (each table rounds on its own: a histogram's total can differ from "
    "the hierarchy's nation value by a few units)")
"""What manifests state from version 6 (SELECTION_LOSS_VERSION) after each count query's step: precisely which
tables agree, since rounding per query can leave two queries' grand totals a few units apart."""


def steps_applied(plan: Plan, manifest_version: int = 2) -> list[dict]:
    """The post-processing steps, per query, as a manifest of `manifest_version` lists them."""
    texts = {**STEPS, **LEGACY_STEPS} if manifest_version == 1 else STEPS
    if manifest_version >= 6:
        texts = {key: text + CONSISTENCY_STATED if text.startswith(ESTIMATE) else text for key, text in texts.items()}
    steps = []
    for q in plan.spec.queries:
        if isinstance(q, HierarchyQuery):
            key = "hierarchy"
        elif isinstance(q, MarginalsQuery):
            key = f"marginals_{marginals_path(plan, q)}"
        elif isinstance(q, SumQuery):
            key = "sum" if plan.table(q.name).measure.lower < 0 else "sum_nonnegative"
        elif isinstance(q, (CountUnitsQuery, MeanQuery, QuantileQuery)):
            key = q.kind
        else:
            key = "histogram"
        steps.append({"query": q.name, "step": texts[key]})
    return steps
