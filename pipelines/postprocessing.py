"""Post-processing of a release's noisy measurements into publishable tables.

Reads only noisy measurements, their variances and the public plan (post-processing
immunity). Order: hierarchy queries first (their integer totals become the totals of the
marginal queries over the same geography level), then marginals, then plain histograms.
"""
from __future__ import annotations

import itertools

import numpy as np

from dprelease.transforms.domains import GeographyDomain
from dprelease.transforms.postprocess import (clamp_nonnegative, hierarchical_least_squares,
                                              iterative_proportional_fit, match_margins,
                                              nonnegative_integer_children, round_joint, top_down_hierarchy)

from .plan import MeanOutput, Plan, TablePlan
from .spec import CountUnitsQuery, HierarchyQuery, MarginalsQuery, MeanQuery, QuantileQuery, SumQuery

JOINT_LIMIT = 20_000_000
"""Largest joint table (units x attribute cells) fitted for exactly consistent integer marginals."""

STEPS = {
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
    "count_units": "negative noisy unit counts set to 0",
    "sum_nonnegative": "negative noisy sums set to 0 (the clamp's lower bound is >= 0)",
    "sum": "published raw (the clamp allows negative values)",
    "mean": "NAME.count: negative noisy counts set to 0; NAME.sum: negative sums set to 0 when the clamp's lower "
            "bound is >= 0; NAME (the mean): raw noisy sum / raw noisy count, clamped to the clamp, null where the "
            "noisy count is below 1",
    "quantile": "published as selected (each value a public candidate)",
}


def post_process(plan: Plan, noisy: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Published table values (int64, >= 0) for every table of the plan."""
    published: dict[str, np.ndarray] = {}
    unit_totals: dict[tuple[str, str], np.ndarray] = {}
    for query in plan.spec.queries:
        if isinstance(query, HierarchyQuery):
            published.update(_hierarchy(plan, query, noisy, unit_totals))
    for query in plan.spec.queries:
        if isinstance(query, MarginalsQuery):
            published.update(_marginals(plan, query, noisy, unit_totals))
    for t in plan.tables:
        if t.name not in published:
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


def _hierarchy(plan: Plan, query: HierarchyQuery, noisy, unit_totals) -> dict[str, np.ndarray]:
    tables = [t for t in plan.tables if t.query == query.name]
    geo = plan.domains[query.geography]
    assert isinstance(geo, GeographyDomain)
    levels, parent_maps = [], []
    for i, t in enumerate(tables):
        units = t.dims[0].size
        levels.append(noisy[t.name].reshape(units, t.n_cells // units))
        parent_maps.append(geo.parent_of(query.levels[i], query.levels[i - 1]) if i else None)
    estimates = hierarchical_least_squares(levels, [t.noise_variance() for t in tables], parent_maps)
    result = {}
    for t, level, values in zip(tables, query.levels, top_down_hierarchy(estimates, parent_maps)):
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


def _marginals(plan: Plan, query: MarginalsQuery, noisy, unit_totals) -> dict[str, np.ndarray]:
    tables = [t for t in plan.tables if t.query == query.name]
    offset = 1 if query.within else 0
    attributes = list(dict.fromkeys(d.label for t in tables for d in t.dims[offset:]))
    size = {d.label: d.size for t in tables for d in t.dims[offset:]}
    units = tables[0].dims[0].size if query.within else 1
    arrays = {t.name: noisy[t.name].astype(np.float64).reshape((units,) + tuple(d.size for d in t.dims[offset:]))
              for t in tables}
    labels = {t.name: [d.label for d in t.dims[offset:]] for t in tables}
    variance = {t.name: t.noise_variance() for t in tables}

    totals = _unit_totals(plan, query, tables, arrays, variance, unit_totals, units)
    consensus = {(): totals.astype(np.float64)}
    for width in range(1, query.way):
        for subset in itertools.combinations(attributes, width):
            holders = [t for t in tables if set(subset) <= set(labels[t.name])]
            if len(holders) < 2:
                continue
            estimates, weights = [], []
            for t in holders:  # tables and subsets keep the query's attribute order: axes line up
                other = tuple(1 + labels[t.name].index(a) for a in labels[t.name] if a not in subset)
                projected = arrays[t.name].sum(axis=other)
                collapsed = int(np.prod([size[a] for a in labels[t.name] if a not in subset]))
                estimates.append(projected)
                weights.append(1.0 / (variance[t.name] * collapsed))
            mean = sum(w * e for w, e in zip(weights, estimates)) / sum(weights)
            consensus[subset] = match_margins(mean, _targets(list(subset), consensus))
    adjusted = {t.name: match_margins(arrays[t.name], _targets(labels[t.name], consensus)) for t in tables}

    if joint_size(plan, query) <= JOINT_LIMIT:
        shape = (units,) + tuple(size[a] for a in attributes)
        margins = []
        for t in tables:
            target = np.maximum(adjusted[t.name], 0.0)
            flat = target.reshape(units, -1)
            sums = flat.sum(axis=1)
            with np.errstate(invalid="ignore", divide="ignore"):
                scale = np.where(sums > 0, totals / sums, 0.0)
            margins.append(((0,) + tuple(1 + attributes.index(a) for a in labels[t.name]),
                            target * scale.reshape((-1,) + (1,) * (target.ndim - 1))))
        joint = round_joint(iterative_proportional_fit(shape, totals.astype(np.float64), margins), totals)
        result = {}
        for t in tables:
            keep = [attributes.index(a) for a in labels[t.name]]
            other = tuple(1 + i for i in range(len(attributes)) if i not in keep)
            table = joint.sum(axis=other)
            result[t.name] = table.astype(np.int64).ravel()
        return result
    segments = lambda t: np.repeat(np.arange(units), t.n_cells // units)  # noqa: E731
    return {t.name: nonnegative_integer_children(adjusted[t.name].ravel(), segments(t), totals) for t in tables}


def _targets(labels: list[str], consensus: dict) -> list[tuple[tuple[int, ...], np.ndarray]]:
    """Margins of a table with attribute axes `labels` (axis 0: unit) that have a consensus.
    Subsets and labels both follow the query's attribute order, so kept axes are increasing."""
    return [((0,) + tuple(1 + labels.index(a) for a in subset), values)
            for subset, values in consensus.items()
            if set(subset) <= set(labels) and len(subset) < len(labels)]


def _unit_totals(plan, query, tables: list[TablePlan], arrays, variance, unit_totals, units) -> np.ndarray:
    """Integer total per unit: the hierarchy's final value at that level, else a weighted consensus."""
    column, _, level = (query.within or "").partition(".")
    if query.within and (column, level) in unit_totals:
        return unit_totals[(column, level)]
    if not query.within:
        for (geo, lvl), values in unit_totals.items():
            if lvl == "nation":
                return values
    estimates = [arrays[t.name].reshape(units, -1).sum(axis=1) for t in tables]
    weights = [1.0 / (variance[t.name] * (t.n_cells // units)) for t in tables]
    mean = sum(w * e for w, e in zip(weights, estimates)) / sum(weights)
    return np.maximum(np.rint(mean), 0).astype(np.int64)


def steps_applied(plan: Plan) -> list[dict]:
    """The post-processing steps, per query, as the manifest lists them."""
    steps = []
    for q in plan.spec.queries:
        if isinstance(q, HierarchyQuery):
            key = "hierarchy"
        elif isinstance(q, MarginalsQuery):
            key = "marginals_joint" if joint_size(plan, q) <= JOINT_LIMIT else "marginals_tables"
        elif isinstance(q, SumQuery):
            key = "sum" if plan.table(q.name).measure.lower < 0 else "sum_nonnegative"
        elif isinstance(q, (CountUnitsQuery, MeanQuery, QuantileQuery)):
            key = q.kind
        else:
            key = "histogram"
        steps.append({"query": q.name, "step": STEPS[key]})
    return steps
