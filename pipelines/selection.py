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
from dprelease.transforms.mst import independent_estimates, noise_penalty, select_tree

from .engines.base import Engine, ProgressHook, no_progress
from .plan import Pair, Plan, SelectionPlan, TablePlan, candidate_tables, table_name, with_selections
from .source import InputSource

LOG = logging.getLogger("dprelease")


def check_engine_selects(plan: Plan, engine: Engine) -> None:
    """Refuse (exit 2, before any budget is reserved) a release with a selection on an engine that cannot
    score its candidates."""
    if plan.selections and not engine.scores_candidates:
        names = [s.query for s in plan.selections]
        raise SpecError(f"queries {names}: `select: mst` needs an engine that scores candidate tables; the "
                        f"{engine.name} engine does not (run it with --engine embedded, spark or beam)")


def select_tables(plan: Plan, engine: Engine, source: InputSource, key: ReleaseKey,
                  progress: ProgressHook = no_progress) -> Plan:
    """The plan with every selection made (itself when it has none)."""
    if not plan.selections:
        return plan
    candidates = {s.query: candidate_tables(plan, s) for s in plan.selections}
    one_way = {s.query: _one_way_tables(plan, s) for s in plan.selections}
    # the release's own tables too: the same encoded columns, so the same records are bounded and kept
    counting = list(plan.tables) + [t for ts in candidates.values() for t in ts]

    def estimates(noisy: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        return {name: estimate for s in plan.selections
                for name, estimate in _estimates(plan, s, one_way[s.query], candidates[s.query], noisy).items()}

    scores = engine.score_candidates(plan, counting, [t for ts in one_way.values() for t in ts], estimates, source,
                                     key, progress)
    chosen = {}
    for selection in plan.selections:
        chosen[selection.query] = _choose(plan, selection, candidates[selection.query], scores, key)
        LOG.info("selection %s: chose %d of %d pairs", selection.name, len(chosen[selection.query]),
                 len(selection.candidates))
    return with_selections(plan, chosen)


def _one_way_tables(plan: Plan, selection: SelectionPlan) -> list[TablePlan]:
    query = plan.query(selection.query)
    return [plan.table(table_name(query.name, (a,))) for a in query.attributes]


def _estimates(plan: Plan, selection: SelectionPlan, one_way: list[TablePlan], candidates: list[TablePlan],
               noisy: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Each candidate's independent estimate, as (unit totals, share of a, share of b), from the query's
    released 1-way tables. Post-processing of released values only."""
    units = one_way[0].dims[0].size if len(one_way[0].dims) == 2 else 1
    totals, shares = independent_estimates([noisy[t.name].reshape(units, -1) for t in one_way])
    index = {a: i for i, a in enumerate(plan.query(selection.query).attributes)}
    return {table.name: (totals, shares[index[a]], shares[index[b]])
            for (a, b), table in zip(selection.candidates, candidates)}


def _choose(plan: Plan, selection: SelectionPlan, candidates: list[TablePlan], scores: dict[str, int],
            key: ReleaseKey) -> tuple[Pair, ...]:
    """One query's tree: the rounds of the exponential mechanism on its candidates' scores, each less the
    expected L1 error of measuring that pair (`noise_penalty`: public, so the sensitivity is unchanged) and
    times the pair's workload weight (public; the sensitivity is the plan's, times the largest weight)."""
    mechanism = selection.event.mechanism
    variance = selection.pair_event.mechanism.variance()
    weights = selection.weights or [1] * len(candidates)
    penalised = [w * (scores[t.name] - noise_penalty(t.n_cells, variance)) for w, t in zip(weights, candidates)]
    return select_tree(key, selection.name, list(plan.query(selection.query).attributes),
                       list(selection.candidates), penalised, mechanism.epsilon, selection.event.sensitivity.l1)
