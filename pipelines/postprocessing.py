"""Post-processing of a release's noisy measurements into publishable tables.

Reads only noisy measurements, their variances and the public plan (post-processing
immunity). First one generalised least-squares estimate over every count table of the release
(hierarchy levels, marginals, histograms together: `transforms.estimation`); then the integer step:
hierarchy queries top-down (their integer totals become the totals of the marginal queries over
the same geography level), then marginals, then plain histograms.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dprelease.transforms.domains import GeographyDomain
from dprelease.transforms.estimation import CountTable, generalised_least_squares, gls_variances
from dprelease.transforms.postprocess import (clamp_nonnegative, fit_joint_least_squares, iterative_proportional_fit,
                                              project_to_simplex,
                                              nonnegative_integer_children, round_joint, top_down_hierarchy)

from .plan import MeanOutput, Plan, TablePlan
from .spec import CountUnitsQuery, HierarchyQuery, MarginalsQuery, MeanQuery, QuantileQuery, SumQuery

JOINT_LIMIT = 20_000_000
"""Largest joint table (units x attribute cells) fitted for exactly consistent integer marginals."""

JOINT_ITERATIONS = 50
"""Mirror-descent iterations of the joint fit from its raked start (fewer when the loss stops improving)."""

MIN_VARIANCE = 1e-9
"""Floor of a table's weight in the joint fit (a huge epsilon gives a variance that rounds to 0)."""

JOINT_SPREAD_LIMIT = 16
"""Largest ratio of a unit's joint cells to its largest table's cells for the joint path: rounding a
joint far larger than the tables spreads rounding error over many joint cells per published cell
(measured on Adult, 6 attributes, 2-way: published error above raw), so such queries take the
table-by-table path. Public: from the plan."""


def uses_joint(plan: Plan, query: MarginalsQuery) -> bool:
    """Whether a marginals query's integer tables are the margins of one rounded joint table per unit."""
    tables = [t for t in plan.tables if t.query == query.name]
    units = tables[0].dims[0].size if query.within else 1
    largest = max(t.n_cells // units for t in tables)
    size = joint_size(plan, query)
    return size <= JOINT_LIMIT and size // units <= JOINT_SPREAD_LIMIT * largest


COUNT_KINDS = ("hierarchy", "marginals", "histogram")
"""Query kinds whose tables all count the same bounded records: one estimate covers them together."""

ESTIMATE = ("one generalised least-squares estimate of every count table (hierarchy levels, marginals, "
            "histograms) from all their noisy measurements and variances together, consistent wherever two "
            "tables can be compared (best linear unbiased; invariants held exact)")

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
    """The tables the global estimate covers."""
    return [t for t in plan.tables if t.kind in COUNT_KINDS and t.statistic == "count"]


def _estimator_inputs(plan: Plan) -> tuple[list[TablePlan], list[CountTable], dict[str, GeographyDomain]]:
    tables = count_tables(plan)
    geographies = {name: d for name, d in plan.domains.items() if isinstance(d, GeographyDomain)}
    return tables, [CountTable(t.name, t.dims, t.noise_variance()) for t in tables], geographies


def least_squares_estimates(plan: Plan, noisy: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The GLS estimate (float, before the integer step) of every count table of the plan."""
    tables, inputs, geographies = _estimator_inputs(plan)
    if not tables:
        return {}
    estimates = generalised_least_squares(inputs, [noisy[t.name] for t in tables], geographies)
    return {t.name: e for t, e in zip(tables, estimates)}


@dataclass(frozen=True)
class EstimateVariances:
    """Per cell of every count table, the variance of its GLS estimate before rounding; `exact` False
    means an upper bound (see `transforms.estimation.gls_variances`). Public: from the plan only."""

    per_cell: dict[str, np.ndarray]
    exact: bool


def estimate_variances(plan: Plan) -> EstimateVariances:
    tables, inputs, geographies = _estimator_inputs(plan)
    if not tables:
        return EstimateVariances({}, True)
    variances, exact = gls_variances(inputs, geographies)
    return EstimateVariances({t.name: v for t, v in zip(tables, variances)}, exact)


def post_process(plan: Plan, noisy: dict[str, np.ndarray], joints: dict | None = None) -> dict[str, np.ndarray]:
    """Published table values (int64) for every table of the plan. `joints`, when given, receives each
    marginals query's fitted integer joint table (units x attribute cells), from which `synthesize`
    draws records."""
    estimates = least_squares_estimates(plan, noisy)
    published: dict[str, np.ndarray] = {}
    unit_totals: dict[tuple[str, str], np.ndarray] = {}
    for query in plan.spec.queries:
        if isinstance(query, HierarchyQuery):
            published.update(_hierarchy(plan, query, estimates, unit_totals))
    for query in plan.spec.queries:
        if isinstance(query, MarginalsQuery):
            published.update(_marginals(plan, query, estimates, noisy, unit_totals, joints))
    for t in plan.tables:
        if t.name in published:
            continue
        if t.name in estimates:
            published[t.name] = np.maximum(np.rint(estimates[t.name]), 0).astype(np.int64)
        else:
            published[t.name] = noisy[t.name].copy() if _published_raw(t) else clamp_nonnegative(noisy[t.name])
    return published


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
    tables = [t for t in plan.tables if t.query == query.name]
    geo = plan.domains[query.geography]
    assert isinstance(geo, GeographyDomain)
    levels, parent_maps = [], []
    for i, t in enumerate(tables):
        units = t.dims[0].size
        levels.append(estimates[t.name].reshape(units, t.n_cells // units))
        parent_maps.append(geo.parent_of(query.levels[i], query.levels[i - 1]) if i else None)
    result = {}
    for t, level, values in zip(tables, query.levels, top_down_hierarchy(levels, parent_maps)):
        result[t.name] = values.ravel()
        if not query.by:
            unit_totals.setdefault((query.geography, level), values.ravel())
    return result


def joint_size(plan: Plan, query: MarginalsQuery) -> int:
    """Cells of the joint table (units x attribute cells) of a marginals query: public."""
    tables = [t for t in plan.tables if t.query == query.name]
    units = tables[0].dims[0].size if query.within else 1
    sizes = {}
    for t in tables:
        for d in t.dims[1 if query.within else 0:]:
            sizes[d.label] = d.size
    return units * int(np.prod(list(sizes.values())))


def _marginals(plan: Plan, query: MarginalsQuery, estimates, noisy, unit_totals, joints=None) -> dict[str, np.ndarray]:
    """Integer tables of a marginals query: from a nonnegative joint fitted to its noisy tables (with the
    unit totals fixed) where the joint is small enough, else from the least-squares estimates."""
    tables = [t for t in plan.tables if t.query == query.name]
    offset = 1 if query.within else 0
    attributes = list(dict.fromkeys(d.label for t in tables for d in t.dims[offset:]))
    size = {d.label: d.size for t in tables for d in t.dims[offset:]}
    units = tables[0].dims[0].size if query.within else 1
    shapes = {t.name: (units,) + tuple(d.size for d in t.dims[offset:]) for t in tables}
    arrays = {t.name: estimates[t.name].reshape(shapes[t.name]) for t in tables}
    labels = {t.name: [d.label for d in t.dims[offset:]] for t in tables}
    totals = _unit_totals(query, tables, arrays, unit_totals, units)
    segments = {t.name: np.repeat(np.arange(units), t.n_cells // units) for t in tables}
    if joint_size(plan, query) > JOINT_LIMIT:
        return {t.name: nonnegative_integer_children(arrays[t.name].ravel(), segments[t.name], totals) for t in tables}

    axes = {t.name: (0,) + tuple(1 + attributes.index(a) for a in labels[t.name]) for t in tables}
    shape = (units,) + tuple(size[a] for a in attributes)
    measured = [(axes[t.name], noisy[t.name].astype(np.float64).reshape(shapes[t.name]),
                 max(t.noise_variance(), MIN_VARIANCE)) for t in tables if not t.invariant]
    start = _raked_start(arrays, labels, attributes, axes, shape, totals, segments)
    fitted = fit_joint_least_squares(shape, totals, measured, max_iterations=JOINT_ITERATIONS, start=start)

    def margin(joint: np.ndarray, t: TablePlan) -> np.ndarray:
        return joint.sum(axis=tuple(a for a in range(len(shape)) if a not in axes[t.name]))

    if not uses_joint(plan, query):
        return {t.name: nonnegative_integer_children(margin(fitted, t).ravel(), segments[t.name], totals)
                for t in tables}
    joint = round_joint(fitted, totals)
    if joints is not None:
        joints[query.name] = (attributes, joint)
    return {t.name: margin(joint, t).astype(np.int64).ravel() for t in tables}


START_SWEEPS = 20
"""Raking sweeps of the fit's warm start (the mirror descent refines it)."""

RAKE_FLOOR = 1e-3
"""Added to every cell before raking a table to its one-way margins, so a margin can reach a row the
nonnegative fit left empty."""


def _raked_start(arrays, labels, attributes, axes, shape, totals, segments) -> np.ndarray:
    """A nonnegative joint near the estimate, where the fit begins: each table's estimate projected onto
    {x >= 0, sum = total} and raked to integer one-way margins shared by all tables, then one joint per
    unit fitted to those tables by iterative proportional fitting."""
    one_way = _one_way_margins(arrays, labels, attributes, totals, shape[0])
    margins = []
    for name, estimate in arrays.items():
        target = project_to_simplex(estimate.ravel(), segments[name], totals).reshape(estimate.shape)
        if len(labels[name]) > 1:
            fixed = [((0, 1 + i), one_way[a]) for i, a in enumerate(labels[name])]
            target = iterative_proportional_fit(target.shape, totals, fixed, START_SWEEPS, start=target + RAKE_FLOOR)
        margins.append((axes[name], target))
    return iterative_proportional_fit(shape, totals.astype(np.float64), margins, START_SWEEPS)


def _one_way_margins(arrays, labels, attributes, totals, units) -> dict[str, np.ndarray]:
    """Per attribute, its margin per unit (the estimate is consistent: any table holding the attribute
    gives it) as nonnegative integers adding up to the unit totals."""
    margins = {}
    for a in attributes:
        name = next(n for n in arrays if a in labels[n])
        axis = 1 + labels[name].index(a)
        other = tuple(i for i in range(1, arrays[name].ndim) if i != axis)
        margin = arrays[name].sum(axis=other)
        segments = np.repeat(np.arange(units), margin.shape[1])
        margins[a] = nonnegative_integer_children(margin.ravel(), segments, totals).reshape(margin.shape).astype(
            np.float64)
    return margins


def _unit_totals(query: MarginalsQuery, tables: list[TablePlan], arrays, unit_totals, units) -> np.ndarray:
    """Integer total per unit: the hierarchy's final value at that level, else the (consistent) estimate
    rounded: every table of the query carries the same estimated totals."""
    column, _, level = (query.within or "").partition(".")
    if query.within and (column, level) in unit_totals:
        return unit_totals[(column, level)]
    if not query.within:
        for (geo, lvl), values in unit_totals.items():
            if lvl == "nation":
                return values
    estimate = arrays[tables[0].name].reshape(units, -1).sum(axis=1)
    return np.maximum(np.rint(estimate), 0).astype(np.int64)


def steps_applied(plan: Plan, manifest_version: int = 2) -> list[dict]:
    """The post-processing steps, per query, as a manifest of `manifest_version` lists them."""
    texts = {**STEPS, **LEGACY_STEPS} if manifest_version == 1 else STEPS
    steps = []
    for q in plan.spec.queries:
        if isinstance(q, HierarchyQuery):
            key = "hierarchy"
        elif isinstance(q, MarginalsQuery):
            key = ("marginals_tables" if joint_size(plan, q) > JOINT_LIMIT
                   else "marginals_joint" if uses_joint(plan, q) else "marginals_fitted_tables")
        elif isinstance(q, SumQuery):
            key = "sum" if plan.table(q.name).measure.lower < 0 else "sum_nonnegative"
        elif isinstance(q, (CountUnitsQuery, MeanQuery, QuantileQuery)):
            key = q.kind
        else:
            key = "histogram"
        steps.append({"query": q.name, "step": texts[key]})
    return steps
