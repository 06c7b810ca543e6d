"""AIM's selection over a graphical model (McKenna et al. 2022), engine-neutral: which tables a `select: aim`
query measures from manifest version 8 on, tables that close cycles included.

Every attribute's 1-way table is measured first. Then rounds spend a budget of `cycle_rounds` equal rounds' units
(twice the attributes less one, at most the candidates; from manifest version 9 annealed, `next_units`: a round
spends more units once the table measured before it taught the model less than its noise), each choosing one table
among the candidates (every 2- to degree+1-way table of the
query's attributes) not chosen yet whose addition keeps the model within its cap (`round_candidates`): the
junction tree of the 1-way tables, the tables chosen so far and the candidate (`units.graphical`) of at most
MODEL_CELLS cells per unit and `graphical.MODEL_CELLS_CAP` over all units (every candidate tried every round). A table among attributes the model
already holds closes a cycle (the reference AIM's candidates; the junction path of `transforms.aim` adds one
attribute a round and cannot). A candidate's estimate is the model's table of it (`units.graphical.Model.table`)
fitted to every table released so far (`round_model`: ROUND_ITERATIONS of mirror descent, warm from the round
before), rounded per cell (`TableEstimate`); its score is `transforms.aim`'s: the L1 distance between its bounded
counts and that estimate less the expected L1 error of measuring it (`mst.noise_penalty`), times its workload
weight.

Privacy: as `transforms.aim`: the candidates and estimates of a round are functions of earlier rounds' choices
and released tables only (public), each round one exact exponential-mechanism draw with the plan's score
sensitivity (one unit moves the L1 distance to a fixed estimate by at most its records' change, times the
largest weight), so the rounds and measurements compose adaptively. A round's budget units are a function of
earlier rounds' units and released values (`anneals`), and `next_units` never lets them sum past the budget, so
the adaptively chosen rounds form a privacy filter whose total is the plan's. A round left with no candidate draws
nothing and measures nothing; the plan charged its share before any data was read (more than was spent: safe).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from .units import graphical
from .units.graphical import Measurement, Model

Clique = tuple[str, ...]
"""Attributes of one measured table, in the query's order."""

MODEL_CELLS = 1 << 16
"""The largest model (cells of its maximal cliques) per unit a round's candidate may make: a round fits the model
once and reads every candidate's table from it."""

ROUND_ITERATIONS = 200
"""Mirror-descent iterations of each round's fit, warm from the model of the round before."""

CYCLE_WORK = 1 << 20
"""Largest candidates x attributes^2 of a query whose rounds weigh tables that close cycles (each round triangulates
the model with every candidate not chosen, at a cost growing with the attributes squared; about 0.12 s a round
for Adult's 455 candidates of 14 attributes at degree 2, 89,180, measured before every candidate was tried): 22
attributes at
degree 2, 38 at degree 1 fit. A larger query grows its junction tree one attribute a round (`transforms.aim`)."""


CYCLE_UNITS = 16
"""Most geographic units (of a query's `within` level) whose rounds weigh tables that close cycles: every round
fits the model per unit by mirror descent (5 attributes within 3,577 counties: 11 million model cells, about 0.7 s
an iteration on 2 cores, where the junction tree's fit is closed form)."""


def uses_cycles(attributes, candidates, units: int) -> bool:
    """Whether a query's rounds choose among tables that close cycles (public: its attributes, candidates and
    units): within CYCLE_WORK and CYCLE_UNITS."""
    return len(candidates) * len(attributes) ** 2 <= CYCLE_WORK and units <= CYCLE_UNITS


def cycle_rounds(attributes, candidates) -> int:
    """The rounds of a query's selection: twice the attributes less one (AIM keeps choosing while its budget
    lasts; at a fixed per-round share, measured on Adult: 26 rounds 0.082 against 13 rounds 0.091 workload
    error), at most its candidates."""
    return min(2 * (len(attributes) - 1), len(candidates))


ANNEAL_GROWTH = {"rho": 4, "epsilon": 2}
"""How much a round's budget grows when AIM anneals (McKenna et al. 2022, Algorithm 2: the noise's sigma halved and
the selection's epsilon doubled): zCDP losses grow with their square (4 units), pure-DP losses linearly (2)."""


def anneals(before: np.ndarray, after: np.ndarray, sigma: float) -> bool:
    """AIM's test on a table just measured: the model's estimate of it moved by at most the expected L1 error of the
    measurement (sqrt(2/pi) * sigma per cell), so measurements this noisy teach the model little and the next
    rounds get more budget each. `before` and `after`: the model's table of it before and after it was measured.
    Post-processing of released values only."""
    return float(np.abs(after - before).sum()) <= float(np.sqrt(2 / np.pi)) * sigma * before.size


def next_units(spent: list[int], budget: int, annealed: bool, growth: int) -> int:
    """The budget units of a selection's next round (0: the budget is spent): the last round's units, times
    `growth` after an `annealed` round, and every unit left when fewer than twice that would be left (AIM's last
    round). Public: a function of the earlier rounds' units and `anneals` decisions (released values only), so
    the rounds form a privacy filter (Rogers, Roth, Ullman and Vadhan 2016; for zCDP Whitehouse et al. 2023):
    whatever the decisions, the units sum to at most `budget`."""
    left = budget - sum(spent)
    units = (spent[-1] * (growth if annealed else 1)) if spent else 1
    return left if left < 2 * units else units


def check_units(units: list[int], budget: int, growth: int) -> None:
    """A recorded annealing as `next_units` makes one: the first round 1 unit, each next the same or `growth`
    times as many, or, last, every unit left when fewer than twice that were left; at most `budget` in all.
    ValueError naming the problem otherwise."""
    if any(type(u) is not int or u < 1 for u in units):  # noqa: E721
        raise ValueError(f"round units {units} are not all positive integers")
    for i, u in enumerate(units):
        options = {next_units(units[:i], budget, annealed, growth) for annealed in (False, True)}
        if u not in options:
            raise ValueError(f"round {i + 1} has {u} budget units; after {units[:i]} of {budget} the rounds allow "
                             f"{sorted(options)}")
    if sum(units) > budget:  # unreachable through next_units: checked anyway (the filter's bound)
        raise ValueError(f"round units sum to {sum(units)}, over the selection's {budget}")


def model_cliques(attributes, chosen) -> list[Clique]:
    """The measured cliques of the model: every attribute's 1-way table and the tables chosen so far."""
    return [(a,) for a in attributes] + [tuple(c) for c in chosen]


def within_cap(cells: int, units: int) -> bool:
    """Whether a model of `cells` per unit over `units` units may be fitted."""
    return cells <= MODEL_CELLS and cells * units <= graphical.MODEL_CELLS_CAP


READ_CELLS = 1 << 22
"""From manifest version 9: the largest array (cells per unit) reading a candidate's table from the model of the
tables so far may make (`graphical.read_cells`: a carried table can reach a separator times two domains, far past
the model's own cells), and READ_CELLS x 16 over all units; the next round's warm start reads no clique past it
either (`graphical.start_from`'s limit: such a clique starts cold). The cap is public (the models' shapes), so no
round can fail for memory after the budget is charged, whichever tables the data made the rounds choose."""


def readable(tree: graphical.JunctionTree, sizes: dict[str, int], clique, units: int) -> bool:
    """Whether the model of `tree` can read `clique`'s table within READ_CELLS."""
    cells = graphical.read_cells(tree, sizes, clique)
    return cells <= READ_CELLS and cells * units <= READ_CELLS * 16


def round_candidates(attributes, candidates, chosen, sizes: dict[str, int], units: int,
                     bounded_reads: bool = False) -> list[Clique]:
    """The candidates of the next round, in the plan's order: those not chosen whose addition keeps the model
    within the cap, each tried by the cells of the model with it (`graphical.model_cells` of the same cliques the
    round's fit triangulates, so the fitted model never exceeds the cap; a table inside one of the model's cliques
    is tried too: making its fill-in edges real can change the triangulation), and with `bounded_reads`
    (manifest version 9 on) whose table the model of the tables so far reads within READ_CELLS (`readable`).
    Public: the plan and earlier rounds' choices."""
    attributes = tuple(attributes)
    cliques = model_cliques(attributes, chosen)
    taken = set(map(tuple, chosen))
    tree = graphical.junction_tree(attributes, cliques, sizes) if bounded_reads else None
    return [c for c in candidates if c not in taken
            and within_cap(graphical.model_cells(attributes, cliques + [c], sizes), units)
            and (tree is None or readable(tree, sizes, c, units))]


def check_chosen(attributes, candidates, chosen, rounds: int, sizes: dict[str, int], units: int,
                 unspent: bool | None = None, bounded_reads: bool = False) -> None:
    """A recorded selection as the rounds make one: at most `rounds` tables, each a candidate (in the query's
    order), none twice, the model within the cap after each (and with `bounded_reads` each read within READ_CELLS
    from the model before it), and ended with budget `unspent` (default: fewer than `rounds` tables) only when no
    candidate was left. ValueError naming the problem otherwise."""
    if len(chosen) > rounds:
        raise ValueError(f"{len(chosen)} tables chosen; the selection has {rounds} rounds")
    allowed = set(candidates)
    seen: set[Clique] = set()
    for i, clique in enumerate(chosen):
        clique = tuple(clique)
        if clique not in allowed:
            raise ValueError(f"table {list(clique)} is not a candidate (2 to degree + 1 of the query's attributes, "
                             f"in its order)")
        if clique in seen:
            raise ValueError(f"table {list(clique)} is chosen twice")
        seen.add(clique)
        if bounded_reads:
            tree = graphical.junction_tree(tuple(attributes), model_cliques(attributes, chosen[:i]), sizes)
            if not readable(tree, sizes, clique, units):
                raise ValueError(f"table {list(clique)} is read from the model of the tables before it with "
                                 f"{graphical.read_cells(tree, sizes, clique):,} cells per unit over {units:,} units, "
                                 f"over the cap ({READ_CELLS:,} per unit, {READ_CELLS * 16:,} in all)")
        cells = graphical.model_cells(tuple(attributes), model_cliques(attributes, chosen[:i + 1]), sizes)
        if not within_cap(cells, units):
            raise ValueError(f"table {list(clique)} makes the model {cells:,} cells per unit over {units:,} units, "
                             f"over the cap ({MODEL_CELLS:,} per unit, {graphical.MODEL_CELLS_CAP:,} in all)")
    if len(chosen) < rounds if unspent is None else unspent:
        left = round_candidates(attributes, candidates, chosen, sizes, units, bounded_reads)
        if left:
            raise ValueError(f"{len(chosen)} tables chosen and the rounds' budget ({rounds}) not spent, but "
                             f"{len(left)} candidates (such as {list(left[0])}) were left within the cap")


def round_model(attributes, sizes: dict[str, int], measurements: list[Measurement],
                previous: Model | None) -> Model:
    """The model of the tables released so far (1-way tables and chosen tables with their public noise
    variances): their junction tree fitted by least squares (`graphical.fit`, ROUND_ITERATIONS), warm from the
    round before's model (`graphical.start_from`, reading within READ_CELLS). Post-processing of released values
    only."""
    tree = graphical.junction_tree(tuple(attributes), [m.clique for m in measurements], sizes)
    units = measurements[0].values.shape[0]
    start = None if previous is None else graphical.start_from(previous, tree,
                                                               limit=min(READ_CELLS, READ_CELLS * 16 // units))
    return graphical.fit(tree, sizes, measurements, iterations=ROUND_ITERATIONS, start=start)


@dataclass(frozen=True)
class TableEstimate:
    """What a candidate is scored against: its table under the model, rounded per cell, flat (units, cells in
    the table's order). Post-processing of released values only (picklable: the engines' workers score with
    it)."""

    values: np.ndarray

    @classmethod
    def of(cls, model: Model, cliques: list[Clique], marginals: list[np.ndarray]) -> list["TableEstimate"]:
        """Each clique's estimate (`Model.tables`)."""
        return [cls(np.rint(np.nan_to_num(table, nan=0.0, posinf=0.0, neginf=0.0)).astype(np.int64).ravel())
                for table in model.tables(cliques, marginals)]

    def cells(self, start: int, stop: int) -> np.ndarray:
        """The rounded estimate of the table's cells [start, stop) (int64)."""
        return self.values[start:stop]


def all_candidates(attributes, degree: int) -> tuple[Clique, ...]:
    """Every 2- to degree+1-way table of the attributes, smaller first, each in the query's order."""
    return tuple(c for size in range(2, degree + 2) for c in itertools.combinations(attributes, size))
