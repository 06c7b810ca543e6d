"""Post-processing of a release's noisy measurements into publishable tables.

Reads only noisy measurements and the public plan (post-processing immunity).
Hierarchy queries: top-down, nonnegative integers, every level adds up to its parent.
Other tables: negative counts clamped to zero.
"""
from __future__ import annotations

import numpy as np

from dprelease.transforms.domains import GeographyDomain
from dprelease.transforms.postprocess import clamp_nonnegative, top_down_hierarchy

from .plan import Plan

STEPS = {
    "hierarchy": "top-down: top level clamped at 0; each lower level fitted per (parent, cell) by least squares "
                 "to x >= 0 summing to the parent, then controlled rounding preserving the parent's integer total",
    "other": "negative noisy counts set to 0",
}


def post_process(plan: Plan, noisy: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Published table values (int64, >= 0) for every table of the plan."""
    published: dict[str, np.ndarray] = {}
    for query in plan.spec.queries:
        tables = [t for t in plan.tables if t.query == query.name]
        if query.kind != "hierarchy":
            for t in tables:
                published[t.name] = clamp_nonnegative(noisy[t.name])
            continue
        geo = plan.domains[query.geography]
        assert isinstance(geo, GeographyDomain)
        levels, parent_maps = [], []
        for i, t in enumerate(tables):
            units = t.dims[0].size
            levels.append(noisy[t.name].reshape(units, t.n_cells // units))
            parent_maps.append(geo.parent_of(query.levels[i], query.levels[i - 1]) if i else None)
        for t, values in zip(tables, top_down_hierarchy(levels, parent_maps)):
            published[t.name] = values.ravel()
    return published


def steps_applied(plan: Plan) -> list[dict]:
    """The post-processing steps, per query, as the manifest lists them."""
    return [
        {"query": q.name, "step": STEPS["hierarchy" if q.kind == "hierarchy" else "other"]}
        for q in plan.spec.queries
    ]
