"""The selection stage of a run: the tables a `select: mst` marginals query measures, chosen from the data.

Runs after the budget is reserved and the key bound, before the measurements: the engine counts every
candidate pair (bounded exactly as the release's own tables are), the query's 1-way tables are released
with the noise the measurement stage will draw for them again (noise is a pure function of key, table and
cell), and `transforms.mst` chooses the tree. The run then continues with the plan of the chosen tables.
Privacy: accounted in the plan before any data is read (`plan.SelectionPlan`); only the chosen pairs leave
this stage, and they are published in the manifest.
"""
from __future__ import annotations

import logging

import numpy as np

from dprelease.accounting.errors import SpecError
from dprelease.transforms.csprng import ReleaseKey
from dprelease.transforms.mst import independent_estimates, pair_estimate, pair_score, select_tree
from dprelease.transforms.release_values import release_table

from .engines.base import Engine, ProgressHook, no_progress
from .plan import Pair, Plan, SelectionPlan, TablePlan, candidate_tables, table_name, with_selections
from .source import InputSource

LOG = logging.getLogger("dprelease")

NOISE_RANGE_CELLS = 1 << 18


def check_engine_selects(plan: Plan, engine: Engine) -> None:
    """Refuse (exit 2, before any budget is reserved) a release with a selection on an engine that cannot
    count its candidates."""
    if plan.selections and not engine.counts_candidates:
        names = [s.query for s in plan.selections]
        raise SpecError(f"queries {names}: `select: mst` chooses its tables on the embedded engine; the "
                        f"{engine.name} engine does not count candidate tables yet (run it with --engine embedded)")


def select_tables(plan: Plan, engine: Engine, source: InputSource, key: ReleaseKey,
                  progress: ProgressHook = no_progress) -> Plan:
    """The plan with every selection made (itself when it has none)."""
    if not plan.selections:
        return plan
    candidates = {s.query: candidate_tables(plan, s) for s in plan.selections}
    one_way = {s.query: _one_way_tables(plan, s) for s in plan.selections}
    # the release's own tables too: the same encoded columns, so the same records are bounded and kept
    counting = list(plan.tables) + [t for ts in candidates.values() for t in ts]
    counts = engine.candidate_counts(plan, counting, source, key, progress)
    chosen = {}
    for selection in plan.selections:
        chosen[selection.query] = _choose(plan, selection, one_way[selection.query], candidates[selection.query],
                                          counts, key)
        LOG.info("selection %s: chose %d of %d pairs", selection.name, len(chosen[selection.query]),
                 len(selection.candidates))
    return with_selections(plan, chosen)


def _one_way_tables(plan: Plan, selection: SelectionPlan) -> list[TablePlan]:
    query = plan.query(selection.query)
    return [plan.table(table_name(query.name, (a,))) for a in query.attributes]


def _choose(plan: Plan, selection: SelectionPlan, one_way: list[TablePlan], candidates: list[TablePlan],
            counts: dict[str, np.ndarray], key: ReleaseKey) -> tuple[Pair, ...]:
    """One query's tree: its 1-way tables released (the same values the release publishes), the
    independent estimate of every candidate, the scores, and the rounds of the exponential mechanism."""
    units = one_way[0].dims[0].size if len(one_way[0].dims) == 2 else 1
    noisy = [release_table(key, t.release, counts[t.name], NOISE_RANGE_CELLS).reshape(units, -1) for t in one_way]
    totals, shares = independent_estimates(noisy)
    attributes = list(plan.query(selection.query).attributes)
    index = {a: i for i, a in enumerate(attributes)}
    scores = [pair_score(counts[table.name], pair_estimate(totals, shares[index[a]], shares[index[b]]))
              for (a, b), table in zip(selection.candidates, candidates)]
    mechanism = selection.event.mechanism
    return select_tree(key, selection.name, attributes, list(selection.candidates), scores, mechanism.epsilon,
                       selection.event.sensitivity.l1)
