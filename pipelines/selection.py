"""The selection stage of a run: the tables a `select: mst` or `select: aim` marginals query measures, chosen
from the data.

Runs after the budget is reserved and the key bound, before the measurements. mst: the engine counts every
candidate pair (bounded exactly as the release's own tables are), the query's 1-way tables are released with
the noise the measurement stage will draw for them again (noise is a pure function of key, table and cell),
and `transforms.mst` chooses the tree. aim: round by round, the engine counts the round's candidates, the
tables measured so far are released (the same noise again) and fitted (a graphical model,
`transforms.aim_model`; or, for a release of manifest version 7 or earlier or a query with too many candidates or units,
the junction tree of `transforms.aim.JunctionModel`), and one candidate is chosen; its table is released in the
next round. Over a capped model (manifest version 9 on) each round's budget units follow AIM's annealing
(`aim_model.next_units`, decided from the released tables). The run then continues with the plan of the
chosen tables.
Privacy: accounted in the plan before any data is read (`plan.SelectionPlan`); only the chosen tables leave
this stage, and they are published in the manifest.
"""
from __future__ import annotations

import logging

import numpy as np

from dprelease.accounting.errors import SpecError
from dprelease.transforms import aim_model
from dprelease.transforms.aim import JunctionModel, clique_of, clique_weight, round_candidates
from dprelease.transforms.units.graphical import Measurement, Model
from dprelease.transforms.csprng import ReleaseKey
from dprelease.transforms.mst import CliqueEstimate, draw_round, independent_estimates, noise_penalty, select_tree

from .engines.base import Engine, ProgressHook, no_progress
from .plan import (AIM_ROUND_CELLS, Clique, Plan, SelectionPlan, TablePlan, candidate_tables, selection_shape,
                   table_name, with_selections)
from .source import InputSource

LOG = logging.getLogger("dprelease")


def check_engine_selects(plan: Plan, engine: Engine) -> None:
    """Refuse (exit 2, before any budget is reserved) a release with a selection on an engine that cannot
    score its candidates."""
    if plan.selections and not engine.scores_candidates:
        names = [s.query for s in plan.selections]
        raise SpecError(f"queries {names}: `select: mst` and `select: aim` need an engine that scores candidate "
                        f"tables; the {engine.name} engine does not (run it with --engine embedded, spark or beam)")


def select_tables(plan: Plan, engine: Engine, source: InputSource, key: ReleaseKey,
                  progress: ProgressHook = no_progress) -> Plan:
    """The plan with every selection made (itself when it has none)."""
    if not plan.selections:
        return plan
    trees = [s for s in plan.selections if s.method == "mst"]
    chosen = _select_trees(plan, trees, engine, source, key, progress) if trees else {}
    units: dict[str, tuple[int, ...]] = {}
    for selection in plan.selections:
        if selection.method == "aim" and selection.cycles:
            chosen[selection.query], spent = _grow_model(plan, selection, engine, source, key, progress)
            if selection.annealing:
                units[selection.query] = spent
        elif selection.method == "aim":
            chosen[selection.query] = _grow(plan, selection, engine, source, key, progress)
        LOG.info("selection %s: chose %d tables", selection.name, len(chosen[selection.query]))
    return with_selections(plan, chosen, units)


def _select_trees(plan: Plan, selections: list[SelectionPlan], engine: Engine, source: InputSource, key: ReleaseKey,
                  progress: ProgressHook) -> dict[str, tuple[Clique, ...]]:
    """Every `select: mst` query's tree, from one count of all their candidate pairs."""
    candidates = {s.query: candidate_tables(plan, s) for s in selections}
    one_way = {s.query: _one_way_tables(plan, s) for s in selections}
    # the release's own tables too: the same encoded columns, so the same records are bounded and kept
    counting = list(plan.tables) + [t for ts in candidates.values() for t in ts]

    def estimates(noisy: dict[str, np.ndarray]) -> dict[str, CliqueEstimate]:
        return {name: estimate for s in selections
                for name, estimate in _estimates(plan, s, one_way[s.query], candidates[s.query], noisy).items()}

    scores = engine.score_candidates(plan, counting, [t for ts in one_way.values() for t in ts], estimates, source,
                                     key, progress)
    return {s.query: _choose(plan, s, candidates[s.query], scores, key) for s in selections}


def _one_way_tables(plan: Plan, selection: SelectionPlan) -> list[TablePlan]:
    query = plan.query(selection.query)
    return [plan.table(table_name(query.name, (a,))) for a in query.attributes]


def _units(one_way: list[TablePlan]) -> int:
    """Units of the query's `within` level (1 without one)."""
    return one_way[0].dims[0].size if len(one_way[0].dims) == 2 else 1


def _estimates(plan: Plan, selection: SelectionPlan, one_way: list[TablePlan], candidates: list[TablePlan],
               noisy: dict[str, np.ndarray]) -> dict[str, CliqueEstimate]:
    """Each candidate pair's independent estimate from the query's released 1-way tables. Post-processing of
    released values only."""
    units = _units(one_way)
    totals, shares = independent_estimates([noisy[t.name].reshape(units, -1) for t in one_way])
    index = {a: i for i, a in enumerate(plan.query(selection.query).attributes)}
    return {table.name: CliqueEstimate.pair(totals, shares[index[a]], shares[index[b]])
            for (a, b), table in zip(selection.candidates, candidates)}


def _choose(plan: Plan, selection: SelectionPlan, candidates: list[TablePlan], scores: dict[str, int],
            key: ReleaseKey) -> tuple[Clique, ...]:
    """One query's tree: the rounds of the exponential mechanism on its candidates' scores, each less the
    expected L1 error of measuring that pair (`noise_penalty`: public, so the sensitivity is unchanged) and
    times the pair's workload weight (public; the sensitivity is the plan's, times the largest weight)."""
    mechanism = selection.event.mechanism
    variance = selection.pair_event.mechanism.variance()
    weights = selection.weights or [1] * len(candidates)
    penalised = [w * (scores[t.name] - noise_penalty(t.n_cells, variance)) for w, t in zip(weights, candidates)]
    return select_tree(key, selection.name, list(plan.query(selection.query).attributes),
                       list(selection.candidates), penalised, mechanism.epsilon, selection.event.sensitivity.l1)


def _grow(plan: Plan, selection: SelectionPlan, engine: Engine, source: InputSource, key: ReleaseKey,
          progress: ProgressHook) -> tuple[Clique, ...]:
    """A `select: aim` query's cliques, round by round: the round's candidates (`transforms.aim.round_candidates`)
    counted in passes of at most `AIM_ROUND_CELLS` cells, each scored against the model of the tables released
    so far (the 1-way tables and the cliques chosen in earlier rounds), less the expected L1 error of measuring
    it (`noise_penalty`, public) and times its workload weight (public); then one exponential-mechanism draw."""
    query = plan.query(selection.query)
    attributes = list(query.attributes)
    one_way = _one_way_tables(plan, selection)
    units = _units(one_way)
    sizes = {a: t.dims[-1].size for a, t in zip(attributes, one_way)}
    variance = selection.pair_event.mechanism.variance()
    weights = dict(selection.attribute_weights or ())
    cliques: list[Clique] = []
    released: dict[str, np.ndarray] = {}  # the noisy values of every table released so far (public)
    for round_ in range(selection.rounds):
        steps = round_candidates(attributes, cliques, selection.degree)
        members = [clique_of(attributes, separator + (new,)) for separator, new in steps]
        tables = candidate_tables(plan, selection, members)
        # the table the round before chose is released (counted, its noise drawn) with this round's first pass
        newest = candidate_tables(plan, selection, cliques[-1:], units=[1] * len(cliques[-1:]))
        model: list[JunctionModel] = []  # fitted once a round, on its first pass (when the newest table is released)

        def estimates(noisy: dict[str, np.ndarray], batch: list[int]) -> dict[str, CliqueEstimate]:
            released.update(noisy)
            if not model:
                model.append(JunctionModel.fit(
                    attributes, {a: released[t.name].reshape(units, -1) for a, t in zip(attributes, one_way)},
                    cliques, [released[table_name(query.name, c)].reshape(units, *[sizes[a] for a in c])
                              for c in cliques], variance))
            found = model[0].estimates(attributes, [steps[i] for i in batch], sizes)
            return {tables[i].name: estimate for i, estimate in zip(batch, found)}

        scores = _score_passes(plan, engine, source, key, progress, one_way, newest, tables, estimates)
        cliques.append(members[_draw(selection, round_, members, tables, scores, weights, key)])
    return tuple(cliques)


def _grow_model(plan: Plan, selection: SelectionPlan, engine: Engine, source: InputSource, key: ReleaseKey,
                progress: ProgressHook) -> tuple[tuple[Clique, ...], tuple[int, ...]]:
    """A `select: aim` query's tables over a capped graphical model (`transforms.aim_model`) and each round's
    budget units, round by round: the round's candidates (any table not chosen that keeps the model within its cap,
    cycles included) counted in passes of at most `AIM_ROUND_CELLS` cells, each scored against the model fitted to
    every table released so far (the 1-way tables and the tables chosen in earlier rounds), less the expected L1
    error of measuring it at the round's noise (`noise_penalty`, public) and times its workload weight (public);
    then one exponential-mechanism draw. With annealing, a round's units are `_RoundModels.next_units`'s (released
    values only); without, 1 each. The rounds end when the budget is spent or no candidate is left (the units
    left stay accounted)."""
    rounds = _RoundModels(plan, selection)
    weights = dict(selection.attribute_weights or ())
    while True:
        members = aim_model.round_candidates(rounds.attributes, selection.candidates, rounds.cliques, rounds.sizes,
                                             rounds.units, bounded_reads=selection.annealing)
        if not members or sum(rounds.spent) == selection.rounds:
            if not members:
                LOG.info("selection %s: round %d has no candidate within the model's cap; %d of %d budget units "
                         "unused", selection.name, len(rounds.spent) + 1, selection.rounds - sum(rounds.spent),
                         selection.rounds)
            break
        tables = candidate_tables(plan, selection, members)
        newest = candidate_tables(plan, selection, rounds.cliques[-1:], units=rounds.spent[-1:])
        model: list[tuple[Model, list[np.ndarray]]] = []  # fitted once a round, on its first pass

        def estimates(noisy: dict[str, np.ndarray], batch: list[int]) -> dict[str, aim_model.TableEstimate]:
            rounds.released.update(noisy)
            if not model:
                model.append(rounds.fit())
            fitted, marginals = model[0]
            found = aim_model.TableEstimate.of(fitted, [members[i] for i in batch], marginals)
            return {tables[i].name: estimate for i, estimate in zip(batch, found)}

        scores = _score_passes(plan, engine, source, key, progress, rounds.one_way, newest, tables, estimates)
        round_units = rounds.next_units(model[0])
        pick = _draw(selection, len(rounds.spent), members, tables, scores, weights, key,
                     round_units if selection.annealing else None)
        rounds.record(members[pick], round_units, model[0])
    return tuple(rounds.cliques), tuple(rounds.spent)


def replay_units(plan: Plan, selection: SelectionPlan, noisy: dict[str, np.ndarray]) -> tuple[int, ...]:
    """The budget units an annealed selection's rounds spend, decided again from the noisy values of its 1-way and
    chosen tables (`noisy`: the published measurements, the values the rounds read) and its recorded choices: what
    `verify --recompute` compares with the manifest. Floating point: another CPU or numpy build could decide a
    tie differently."""
    rounds = _RoundModels(plan, selection)
    rounds.released.update(noisy)
    for clique in selection.chosen or ():
        fitted = rounds.fit()
        units = rounds.next_units(fitted)
        if units == 0:  # the budget spent before this table: the rounds decided otherwise
            break
        rounds.record(clique, units, fitted)
    return tuple(rounds.spent)


class _RoundModels:
    """The models an aim selection's rounds fit over a capped model, and the rounds' choices and units so far.
    Post-processing of released values only."""

    def __init__(self, plan: Plan, selection: SelectionPlan):
        self.selection = selection
        self._variances: dict[int, float] = {}
        self.query = plan.query(selection.query)
        self.attributes = list(self.query.attributes)
        self.one_way = _one_way_tables(plan, selection)
        self.sizes, self.units = selection_shape(self.query, plan.domains)
        self.cliques: list[Clique] = []
        self.spent: list[int] = []  # each chosen table's round's budget units
        self.released: dict[str, np.ndarray] = {}  # the noisy values of every table released so far (public)
        self.previous: Model | None = None  # the model of the round before (a warm start)
        self.before: np.ndarray | None = None  # the estimate of the table the round before chose, when chosen

    def variance(self, units: int) -> float:
        """The noise variance of the table a round of `units` budget units chooses (public), calibrated once."""
        if units not in self._variances:
            self._variances[units] = _round_variance(self.selection, units)
        return self._variances[units]

    def fit(self) -> tuple[Model, list[np.ndarray]]:
        """This round's model (of the 1-way tables and the tables chosen so far, warm from the round before's)
        and its marginals."""
        sizes, units = self.sizes, self.units
        measurements = [Measurement((a,), self.released[t.name].reshape(units, -1), float(t.noise_variance()))
                        for a, t in zip(self.attributes, self.one_way)]
        measurements += [Measurement(c, self.released[table_name(self.query.name, c)].reshape(
            units, *[sizes[a] for a in c]), self.variance(u)) for c, u in zip(self.cliques, self.spent)]
        fitted = aim_model.round_model(self.attributes, sizes, measurements, self.previous)
        self.previous = fitted
        return fitted, fitted.marginals()

    def next_units(self, fitted: tuple[Model, list[np.ndarray]]) -> int:
        """This round's budget units (1 without annealing): `aim_model.next_units` of the units so far, annealed
        when the table the round before chose moved this round's model by less than its noise
        (`aim_model.anneals`)."""
        if not self.selection.annealing:
            return 1
        annealed = bool(self.spent) and aim_model.anneals(
            self.before, _estimate_of(fitted, self.cliques[-1]), self.variance(self.spent[-1]) ** 0.5)
        return aim_model.next_units(self.spent, self.selection.rounds, annealed, self.selection.growth)

    def record(self, clique: Clique, units: int, fitted: tuple[Model, list[np.ndarray]]) -> None:
        """The round's choice, its units, and the model's estimate of it (for the next round's `next_units`)."""
        self.cliques.append(tuple(clique))
        self.spent.append(units)
        self.before = _estimate_of(fitted, tuple(clique))


def _estimate_of(fitted: tuple[Model, list[np.ndarray]], clique: Clique) -> np.ndarray:
    """The model's table of `clique`, flat (units, cells), as candidates are scored against it."""
    model, marginals = fitted
    return aim_model.TableEstimate.of(model, [clique], marginals)[0].values


def _score_passes(plan: Plan, engine: Engine, source: InputSource, key: ReleaseKey, progress: ProgressHook,
                  one_way: list[TablePlan], newest: list[TablePlan], tables: list[TablePlan],
                  estimates) -> dict[str, int]:
    """Every candidate's score, the candidates counted in passes of at most `AIM_ROUND_CELLS` cells (the release's
    own tables counted beside them: the same records bounded and kept); the 1-way tables and `newest` (the table
    the round before chose) are released with the first pass, and `estimates(noisy, batch)` gives each pass's
    candidates' estimates from the tables released so far."""
    scores: dict[str, int] = {}
    for batch in _passes(list(range(len(tables))), tables):
        counting = list(plan.tables) + newest + [tables[i] for i in batch]
        scores.update(engine.score_candidates(plan, counting, one_way + newest,
                                              lambda noisy, batch=batch: estimates(noisy, batch), source, key,
                                              progress))
        newest = []  # released by the first pass
    return scores


def _round_variance(selection: SelectionPlan, units: int) -> float:
    """The noise variance of the table a round of `units` budget units chooses (public)."""
    return float(selection.round_measurement(units, selection.pair_event.table).mechanism.variance())


def _draw(selection: SelectionPlan, round_: int, members: list[Clique], tables: list[TablePlan],
          scores: dict[str, int], weights: dict[str, int], key: ReleaseKey, units: int | None = None) -> int:
    """One aim round's table (its index in `members`): the exponential mechanism on the candidates' scores, each
    less the expected L1 error of measuring it (`noise_penalty`, public) and times its workload weight (public;
    the plan's sensitivity is the unweighted one times the largest weight). `units`: an annealed round's budget
    units (its epsilon and the noise its table gets); None: the plan's one-round mechanism."""
    epsilon = selection.event.mechanism.epsilon if units is None else \
        selection.round_selection(units).mechanism.epsilon
    variance = selection.pair_event.mechanism.variance() if units is None else _round_variance(selection, units)
    penalised = [clique_weight(weights, clique) * (scores[t.name] - noise_penalty(t.n_cells, variance))
                 for clique, t in zip(members, tables)]
    pick = draw_round(key, selection.name, round_, penalised, epsilon, selection.event.sensitivity.l1)
    LOG.info("selection %s: round %d chose %s among %d candidates%s", selection.name, round_ + 1,
             "-".join(members[pick]), len(members),
             "" if units is None else f" ({units} budget units, {selection.rounds} in all)")
    return pick


def _passes(indices: list[int], tables: list[TablePlan]) -> list[list[int]]:
    """The candidates split into passes of at most `AIM_ROUND_CELLS` cells each (a larger candidate alone), in
    order. Public: from the plan."""
    passes: list[list[int]] = []
    cells = 0
    for i in indices:
        if passes and cells + tables[i].n_cells <= AIM_ROUND_CELLS:
            passes[-1].append(i)
            cells += tables[i].n_cells
        else:
            passes.append([i])
            cells = tables[i].n_cells
    return passes
