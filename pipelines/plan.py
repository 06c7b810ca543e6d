"""The Plan: everything about a release that follows from the spec alone (no data is read).

Tables and their public cell domains, the sensitivity derived from the contribution
bounds, the exact budget allocation, the calibrated mechanisms and their expected errors.
`dprelease plan` prints it; `dprelease verify` rebuilds it from a manifest's spec.
"""
from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Callable

from dprelease.accounting.composition import MeasurementEvent, Totals, compose
from dprelease.accounting.conversions import approx_to_zcdp, zcdp_to_epsilon
from dprelease.accounting.errors import SpecError
from dprelease.accounting.mechanisms import (calibrate_gaussian, calibrate_laplace, calibrate_selection,
                                              compact_gaussian_budget)
from dprelease.accounting.rationals import allocate
from dprelease.accounting.sensitivity import (ContributionBounds, Sensitivity, count_sensitivity,
                                              mst_score_sensitivity, quantile_score_sensitivity, sum_sensitivity,
                                              unit_count_sensitivity)
from dprelease.transforms.aggregate import TableLayout
from dprelease.transforms.aim import attribute_weights, junction_steps, largest_weight
from dprelease.transforms.aim_model import (ANNEAL_GROWTH, all_candidates, check_chosen, check_units, cycle_rounds,
                                            uses_cycles)
from dprelease.transforms.mst import Components, workload_weights
from dprelease.transforms.domains import (NATION, CategoricalDomain, Dimension, Domain, GeographyDomain,
                                          IntegerDomain, MeasureDomain, dimension, measure_key)
from dprelease.transforms.release_values import TableRelease
from dprelease.transforms.strategy import Strategy, optimal_strategy, workload_error
from dprelease.transforms.strategy import direct_reason as strategy_direct_reason

from .storage import UnsafeFile, read_regular
from .spec import (CategoricalColumn, CountUnitsQuery, GeographyColumn, HierarchyQuery, HistogramQuery,
                   IntegerColumn, MarginalsQuery, MeanQuery, QuantileQuery, ReleaseSpec, SumQuery)
from .spec_checks import measure_clamp, quantile_candidates


@dataclass(frozen=True)
class HierarchyLink:
    """A hierarchy table's place in its tree: the table of the level above and the unit map."""

    query: str
    level_index: int
    parent_table: str | None


VALUE_NAMES = {"count": "count", "sum": "sum", "units": "units", "quantile": "value"}
"""The value column of a table's files, by statistic (measurements: 'noisy_' + it)."""


@dataclass(frozen=True)
class Measure:
    """The measure column a sum, mean or quantile table aggregates, and its public clamp."""

    column: str
    lower: int
    upper: int


@dataclass(frozen=True)
class TablePlan:
    name: str
    query: str
    kind: str
    dims: tuple[Dimension, ...]
    layout: TableLayout
    event: MeasurementEvent | None
    hierarchy: HierarchyLink | None
    measure: Measure | None = None
    quantiles: tuple[Fraction, ...] = ()
    score_sensitivities: tuple[int, ...] = ()

    @property
    def n_cells(self) -> int:
        """Public cells of the table (rows of its files; a quantile table has a row per cell and q)."""
        return self.layout.n_cells

    @property
    def statistic(self) -> str:
        return self.layout.statistic

    @property
    def value_name(self) -> str:
        return VALUE_NAMES[self.statistic]

    @property
    def release(self) -> TableRelease:
        """What the engines' workers need to release this table (picklable, engine-neutral)."""
        return TableRelease(self.name, self.layout.n_measured, self.event.mechanism if self.event else None,
                            self.layout.buckets, self.quantiles, self.layout.candidates, self.score_sensitivities)

    @property
    def n_outputs(self) -> int:
        return self.release.n_outputs

    @property
    def invariant(self) -> bool:
        """Published exactly (declared in the spec): no noise, no budget, no protection."""
        return self.event is None

    def noise_variance(self) -> float:
        return 0.0 if self.event is None else self.event.mechanism.variance()


@dataclass(frozen=True)
class MeanOutput:
    """A mean table: derived from the noisy sum and noisy count tables of one mean query (post-processing)."""

    name: str
    sum_table: str
    count_table: str
    measure: Measure


Pair = tuple[str, str]
"""Two attributes of a marginals query (spec references, in the query's order): one 2-way table."""

Clique = tuple[str, ...]
"""Attributes of a marginals query (in the query's order) whose table a selection may choose."""


@dataclass(frozen=True)
class SelectionPlan:
    """The adaptive part of a `select: mst` or `select: aim` marginals query.

    `rounds` exponential-mechanism selections (attributes - 1; a selection over a capped model,
    `transforms.aim_model.cycle_rounds`), calibrated to `event`'s score sensitivity, each chosen table then
    measured like any table with `pair_event`'s mechanism (every chosen table the same share); with `annealing`,
    `rounds` is a budget of that many such rounds, and each round spends the units `units` records (its draw
    `round_selection`, its table `round_measurement`).
    mst (MST, McKenna, Miklau and Sheldon 2021): each round among the candidate pairs that join two components of
    the tree chosen so far, scored against the estimate from the measured 1-way tables (`transforms.mst`).
    aim (McKenna et al. 2022): with `cycles`, each round among every table of 2 to `degree` + 1 attributes not
    chosen yet that keeps the graphical model of the measurements within its cap, tables that close cycles
    included (`transforms.aim_model`); without (manifest version 7 or earlier, too many candidates or units), among the
    tables of a new attribute and a separator of up to `degree` attributes inside a table already chosen
    (`transforms.aim`); each scored against the model of the measurements so far, the chosen table measured
    before the next round. `candidates`: every table a round could choose. `chosen` is None until the run
    selects (the plan before data is read).

    Privacy: the selections compose with the measurements (`Plan.events`): `event` accounts all `rounds`
    (pure: rounds * epsilon; zCDP: rounds * epsilon^2 / 8, bounded range) and the chosen tables' measurements
    are accounted at their planned share whichever tables are chosen, a round left without a candidate's
    included (`unused_rounds`), so the total is known before any data is read. Annealed rounds are a privacy
    filter: their units sum to at most `rounds` whatever the released values decide, and each round's mechanisms
    lose at most its units' share (`Plan.ledger_spend` charges the allocation, the filter's bound).
    """

    query: str
    candidates: tuple[Clique, ...]
    rounds: int
    event: MeasurementEvent
    pair_event: MeasurementEvent
    chosen: tuple[Clique, ...] | None = None
    weights: tuple[int, ...] | None = None
    """mst: each candidate's workload weight (`transforms.mst.workload_weights`); None without a workload (all 1)."""
    method: str = "mst"
    degree: int = 1
    """aim: the most attributes a new attribute's table joins it to."""
    attribute_weights: tuple[tuple[str, int], ...] | None = None
    """aim: each attribute's workload weight (`transforms.aim.attribute_weights`), a clique weighing their sum;
    None without a workload (every clique 1)."""
    cycles: bool = False
    """aim: the rounds choose among every candidate that keeps the model within its cap, tables that close cycles
    included (`transforms.aim_model`, manifest version 8 on); False: a junction tree grown one attribute a round."""
    annealing: bool = False
    """aim with `cycles` (manifest version 9 on): `rounds` is the selection's budget in units of one equal round,
    and each round spends the units `transforms.aim_model.next_units` gives it (AIM's annealing)."""
    units: tuple[int, ...] | None = None
    """With `annealing`, each chosen table's round's budget units, in order (None until the run selects)."""

    @property
    def name(self) -> str:
        return self.event.table

    @property
    def growth(self) -> int:
        """How many times the units of an annealed round grow (`transforms.aim_model.ANNEAL_GROWTH`)."""
        return ANNEAL_GROWTH[self.event.mechanism.accounted_as]

    def round_units(self) -> tuple[int, ...]:
        """Each chosen table's budget units (1 each without annealing)."""
        return self.units if self.annealing and self.units is not None else (1,) * len(self.chosen or ())

    def round_selection(self, units: int) -> MeasurementEvent:
        """The exponential mechanism of a round of `units` budget units: calibrated to that many rounds' share of
        the selection's budget (a round of 1 unit: the plan's `event`, once)."""
        share = self.event.allocated * units / self.rounds
        definition = "pure" if self.event.mechanism.accounted_as == "epsilon" else "rho"
        return MeasurementEvent(self.name, calibrate_selection(share, 1, definition, f"selection {self.query}"),
                                self.event.sensitivity, share)

    def round_measurement(self, units: int, table: str) -> MeasurementEvent:
        """The mechanism of the table a round of `units` budget units chooses: calibrated to that many rounds'
        share of the chosen tables' budget (1 unit: `pair_event`'s)."""
        share = self.pair_event.allocated * units
        if units == 1:
            return MeasurementEvent(table, self.pair_event.mechanism, self.pair_event.sensitivity, share)
        calibrate = calibrate_laplace if self.event.mechanism.accounted_as == "epsilon" else calibrate_gaussian
        return MeasurementEvent(table, calibrate(share, self.pair_event.sensitivity, f"table {table}"),
                                self.pair_event.sensitivity, share)

    def events(self) -> list[MeasurementEvent]:
        """The selection and, while the tables are still to be chosen, their measurements (once each). Annealed
        rounds: each round's selection at its units, then the units left unused (both parts, at 1 unit each)."""
        if not self.annealing or self.chosen is None:
            return [self.event, *[self.pair_event] * self.unused_rounds]
        unused = self.unused_rounds
        left = [MeasurementEvent(self.name, replace(self.event.mechanism, selections=unused), self.event.sensitivity,
                                 self.event.allocated * unused / self.rounds)] if unused else []
        return [self.round_selection(u) for u in self.round_units()] + left + [self.pair_event] * unused

    @property
    def unused_rounds(self) -> int:
        """Budget units (rounds) whose table is not chosen (yet): every unit before the selection; after it, the
        units a selection over a capped model left without a candidate (`transforms.aim_model`), accounted all
        the same."""
        return self.rounds - sum(self.round_units())


@dataclass(frozen=True)
class Plan:
    spec: ReleaseSpec
    domains: dict[str, Domain]
    bounds: ContributionBounds
    sensitivity: Sensitivity
    allocation_budget: Fraction
    tables: tuple[TablePlan, ...]
    totals: Totals
    means: tuple[MeanOutput, ...] = ()
    selections: tuple[SelectionPlan, ...] = ()
    optimal_marginals: bool = True
    """Published marginals queries measured by their workload-optimal split (`measured_strategy`); False
    re-plans a release of manifest version 6 or earlier, when every query was measured directly."""
    aim_cycles: bool = True
    """`select: aim` queries choose tables that close cycles (`transforms.aim_model`) where they have at most
    `aim_model.uses_cycles` (candidates x attributes^2, units); False re-plans a release of manifest version 7 or earlier, whose
    rounds grew a junction tree one attribute a round."""
    aim_annealing: bool = True
    """`select: aim` queries over a capped model anneal their rounds' budgets (`SelectionPlan.annealing`); False
    re-plans a release of manifest version 8 or earlier, whose rounds had equal shares."""
    aim_converged_fit: bool = True
    """`select: aim` queries over a capped model publish the margins of their model fitted until it settles
    (`postprocessing.marginals_path` 'converged_model'); False re-plans a release of manifest version 9 or
    earlier, whose fit ran a fixed number of iterations ('model')."""

    def events(self) -> list[MeasurementEvent]:
        """Every measurement the release composes: its measured tables, its selections, and the tables still
        to be chosen by them."""
        return [t.event for t in self.measured()] + [e for s in self.selections for e in s.events()]

    def query(self, name: str):
        """The spec's query of that name."""
        return next(q for q in self.spec.queries if q.name == name)

    @property
    def pending(self) -> bool:
        """Whether some tables are chosen from the data at run time (a selection not yet made)."""
        return any(s.chosen is None for s in self.selections)

    @property
    def definition(self) -> str:
        return self.spec.budget.definition

    @property
    def delta(self) -> float | None:
        return getattr(self.spec.budget, "delta", None)

    @property
    def n_cells(self) -> int:
        """Entries of every table's measurement vector together (what a run holds in memory)."""
        return sum(t.layout.n_measured for t in self.tables)

    def ledger_spend(self) -> tuple[str, Fraction]:
        """(unit, amount) the ledger charges for this release: epsilon under pure DP, else rho (`totals`: the
        same before and after its selections)."""
        totals = self.totals
        return ("epsilon", totals.pure_epsilon) if self.definition == "pure" else ("rho", totals.rho)

    def table(self, name: str) -> TablePlan:
        return next(t for t in self.tables if t.name == name)

    def measured(self) -> list[TablePlan]:
        """Tables released with noise (every table but the invariants)."""
        return [t for t in self.tables if not t.invariant]

    def encoded_columns(self) -> list[str]:
        """The encoded columns the tables read (spec columns, and measures as `measure_key(column)`)."""
        return sorted({c for t in self.tables for c in t.layout.inputs})

    def used_columns(self) -> list[str]:
        """The input columns read (besides the privacy unit)."""
        return sorted({getattr(self.domains[c], "source", c) for c in self.encoded_columns()})

    def input_columns(self) -> list[str]:
        """Every input column a run reads: the used columns, then the privacy unit's (when there is one)."""
        unit = self.spec.privacy_unit
        return self.used_columns() + ([unit] if unit else [])


MAX_DOMAIN_FILE_BYTES = 256 << 20
"""Largest geography domain file read (256 MiB: about 16 million 16-character codes)."""

DomainReader = Callable[[str, str], str]
"""reader(column, domain_file) -> the file's text: how a plan reads a geography domain file."""


def spec_file_reader(base_dir: Path) -> DomainReader:
    """Read domain files relative to the spec's directory: a regular file of at most MAX_DOMAIN_FILE_BYTES
    (never a FIFO or a device, which would hang or exhaust memory)."""
    def read(column: str, domain_file: str) -> str:
        path = base_dir / domain_file
        where = f"columns.{column}.domain_file = {domain_file!r}"
        try:
            data = read_regular(path, MAX_DOMAIN_FILE_BYTES)
        except UnsafeFile as error:
            raise SpecError(f"{where}: {error}") from None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise SpecError(f"{where}: not UTF-8 text") from None
    return read


def read_geography_leaves(text: str, width: int, where: str) -> tuple[str, ...]:
    """The public list of finest-level codes: one code per line; '#' comments and blanks skipped."""
    lines = text.splitlines()
    codes: list[str] = []
    problems: list[str] = []
    for number, line in enumerate(lines, start=1):
        code = line.split(",")[0].strip()
        if not code or code.startswith("#"):
            continue
        if len(code) != width:
            problems.append(f"{where}, line {number}: code {code[:40]!r} has {len(code)} characters; the finest "
                            f"level needs {width}")
        codes.append(code)
    if len(set(codes)) != len(codes):
        problems.append(f"{where}: repeated codes")
    if not codes:
        problems.append(f"{where}: no codes")
    if problems:
        raise SpecError(problems[:20])
    return tuple(sorted(codes))


def build_domains(spec: ReleaseSpec, base_dir: Path, reader: DomainReader | None = None) -> dict[str, Domain]:
    reader = reader or spec_file_reader(base_dir)
    domains: dict[str, Domain] = {}
    for name, column in spec.columns.items():
        if isinstance(column, CategoricalColumn):
            domains[name] = CategoricalDomain(name, tuple(str(v) for v in column.values), column.on_invalid)
        elif isinstance(column, IntegerColumn):
            edges = tuple(column.bins) if column.bins else None
            domains[name] = IntegerDomain(name, column.min, column.max, edges, column.on_invalid)
            if measure_clamp(spec, name) is not None:
                lo, hi = measure_clamp(spec, name)
                domains[measure_key(name)] = MeasureDomain(measure_key(name), name, lo, hi)
        else:
            assert isinstance(column, GeographyColumn)
            levels = tuple(column.levels.items())
            leaves = read_geography_leaves(reader(name, column.domain_file), levels[-1][1],
                                           f"columns.{name}.domain_file")
            domains[name] = GeographyDomain(name, levels, leaves, column.on_invalid)
    return domains


def _dims(refs: list[str], domains: dict[str, Domain]) -> list[Dimension]:
    dims = []
    for ref in refs:
        column, _, level = ref.partition(".")
        dims.append(dimension(domains[column], level or None))
    return dims


def _layout(name: str, dims: list[Dimension], domains: dict[str, Domain], statistic: str = "count",
            measure: Measure | None = None, candidates: tuple[int, ...] = ()) -> TableLayout:
    lookups = []
    for dim in dims:
        domain = domains[dim.column]
        if isinstance(domain, GeographyDomain) and dim.level != domain.leaf_level:
            lookups.append(domain.leaf_to_level(dim.level))
        else:
            lookups.append(None)
    if measure is None:
        return TableLayout(name, tuple(d.column for d in dims), tuple(lookups), tuple(d.size for d in dims), statistic)
    domain = domains[measure_key(measure.column)]
    return TableLayout(name, tuple(d.column for d in dims), tuple(lookups), tuple(d.size for d in dims), statistic,
                       domain.name, domain.lower, domain.invalid_code, candidates)


@dataclass(frozen=True)
class TableShape:
    """One table a query asks for, before budget: name, dimensions, statistic, budget weight within the query."""

    name: str
    dims: list[Dimension]
    link: HierarchyLink | None = None
    statistic: str = "count"
    measure: Measure | None = None
    weight: Fraction = Fraction(1)


def table_name(query: str, combo) -> str:
    """A marginal's table name: the query's, then its attributes joined by '-'."""
    return f"{query}." + "-".join(ref.replace(".", "_") for ref in combo)


ONE_WAY_SHARE, SELECTION_SHARE, PAIR_SHARE = Fraction(9, 20), Fraction(1, 10), Fraction(9, 20)
"""How a `select: mst` or `aim` query's budget splits: its 1-way tables, the selection of its other tables, and
those tables (each group's share equal among its members). Measured on Adult at epsilon = 1 (benchmarks/
synthetic_adult.py): 9/20, 1/10, 9/20 (OpenDP's 0.9 measuring share) gives 5% less workload error than
MST's paper's thirds."""


def measured_strategy(query: MarginalsQuery, spec: ReleaseSpec, domains, enabled: bool = True) -> Strategy | None:
    """The workload-optimal strategy of a published (not selected) marginals query (`transforms.strategy`), or
    None where its tables are measured directly (`direct_reason` says why)."""
    if query.selects or direct_reason(query, spec, enabled) is not None:
        return None
    return optimal_strategy(_workload(query), _attribute_sizes(query, domains))


def _workload(query: MarginalsQuery) -> list[tuple[str, ...]]:
    """A published marginals query's tables: every `way`-combination of its attributes, in their order."""
    return list(itertools.combinations(query.attributes, query.way))


def _attribute_sizes(query: MarginalsQuery, domains) -> dict[str, int]:
    """Each attribute of a marginals query (a column or a geography level) with its public domain size."""
    return {a: d.size for a, d in zip(query.attributes, _dims(list(query.attributes), domains))}


def direct_reason(query: MarginalsQuery, spec: ReleaseSpec, enabled: bool = True) -> str | None:
    """Why a published marginals query is measured directly (None: by its optimal split): `strategy: direct`, a
    pure-DP budget (the optimisation is for variances proportional to 1/rho), a release of manifest version 6 or
    earlier, a workload of one table, or one too large to optimise (`transforms.strategy.direct_reason`)."""
    if query.strategy == "direct":
        return "strategy: direct"
    if spec.budget.definition == "pure":
        return "a pure-DP budget (Laplace noise: the split is optimised for zcdp and approx budgets)"
    if not enabled:
        return "a release of manifest version 6 or earlier, when every table was measured directly"
    return strategy_direct_reason(_workload(query))


def _marginal_weights(query: MarginalsQuery, spec: ReleaseSpec, domains, chosen: tuple[Pair, ...] | None,
                      optimal: bool, rounds: int | None,
                      units: tuple[int, ...] | None = None) -> list[tuple[tuple[str, ...], Fraction]]:
    """Every table of a marginals query with its budget weight: a selected query's 1-way tables and chosen
    tables (fixed shares: each chosen table `units` of `rounds`, 1 each without annealing); a published query's
    strategy (`measured_strategy`), or its t-way tables alike."""
    if query.selects:
        r = len(query.attributes)
        chosen = list(chosen or [])
        return [((a,), ONE_WAY_SHARE / r) for a in query.attributes] + \
            [(tuple(c), PAIR_SHARE * u / rounds) for c, u in zip(chosen, units or [1] * len(chosen))]
    strategy = measured_strategy(query, spec, domains, optimal)
    if strategy is None:
        return [(combo, Fraction(1)) for combo in _workload(query)]
    return [(combo, Fraction(weight)) for combo, weight in zip(strategy.tables, strategy.weights)]


def strategy_errors(plan: "Plan", query: MarginalsQuery) -> tuple[int, int, float] | None:
    """A published marginals query measured by its strategy: (tables measured, of them lower-way, the expected
    workload error over that of the equal split of the same budget), from the calibrated mechanisms' variances;
    None where it is measured directly. Public: the plan only."""
    strategy = measured_strategy(query, plan.spec, plan.domains, plan.optimal_marginals)
    if strategy is None:
        return None
    workload, sizes = _workload(query), _attribute_sizes(query, plan.domains)
    measured = {t.name: t.event for t in plan.tables if t.query == query.name}
    variances = [float(measured[table_name(query.name, t)].mechanism.sigma2) for t in strategy.tables]
    share = sum((e.allocated for e in measured.values()), Fraction(0))
    equal = float(calibrate_gaussian(share / len(workload), count_sensitivity(plan.bounds), query.name).sigma2)
    ratio = workload_error(workload, list(strategy.tables), variances, sizes) / \
        workload_error(workload, workload, [equal] * len(workload), sizes)
    return len(strategy.tables), sum(1 for t in strategy.tables if len(t) < query.way), ratio


def _compact_parts(parts: dict[str, Fraction], sensitivity: Sensitivity) -> dict[str, Fraction]:
    """Unequal shares of one query (a workload-optimal split) moved onto the compact variance grid
    (`compact_gaussian_budget`), every table's but the largest's, which takes the rest: the parts still sum
    exactly to the query's share, and their losses to a fraction short enough to print and verify. Each grid
    share is at most its optimal share (within 1/32 of its variance), the largest table's at least its own."""
    largest = max(parts, key=lambda name: parts[name])
    compact = {name: compact_gaussian_budget(part, sensitivity) for name, part in parts.items() if name != largest}
    compact[largest] = sum(parts.values(), Fraction(0)) - sum(compact.values(), Fraction(0))
    return {name: compact[name] for name in parts}


def _query_tables(query, spec: ReleaseSpec, domains, chosen: tuple[Pair, ...] | None = None,
                  optimal: bool = True, rounds: int | None = None,
                  units: tuple[int, ...] | None = None) -> list[TableShape]:
    """Every table a query asks for (a `select: mst` or `aim` query: its 1-way tables and the `chosen` tables,
    each `units` of the selection's `rounds`)."""
    if isinstance(query, HistogramQuery):
        return [TableShape(query.name, _dims(query.by, domains))]
    if isinstance(query, CountUnitsQuery):
        return [TableShape(query.name, _dims(query.by, domains), statistic="units")]
    if isinstance(query, (SumQuery, MeanQuery, QuantileQuery)):
        measure = Measure(query.column, *measure_clamp(spec, query.column))
        dims = _dims(query.by, domains)
        if isinstance(query, MeanQuery):
            share = Fraction(query.count_share)
            return [TableShape(f"{query.name}.sum", dims, None, "sum", measure, 1 - share),
                    TableShape(f"{query.name}.count", dims, None, "count", measure, share)]
        return [TableShape(query.name, dims, None, "sum" if isinstance(query, SumQuery) else "quantile", measure)]
    if isinstance(query, MarginalsQuery):
        prefix = _dims([query.within], domains) if query.within else []
        return [TableShape(table_name(query.name, combo), prefix + _dims(list(combo), domains), weight=weight)
                for combo, weight in _marginal_weights(query, spec, domains, chosen, optimal, rounds, units)]
    assert isinstance(query, HierarchyQuery)
    tables = []
    by = _dims(query.by, domains)
    for i, level in enumerate(query.levels):
        parent = f"{query.name}.{query.levels[i - 1]}" if i else None
        geo = _dims([f"{query.geography}.{level}"], domains)
        tables.append(TableShape(f"{query.name}.{level}", geo + by, HierarchyLink(query.name, i, parent)))
    return tables


def _sensitivity(shape: TableShape, bounds: ContributionBounds) -> Sensitivity:
    """The table's sensitivity, derived from the contribution bounds (accounting.sensitivity)."""
    if shape.statistic == "sum":
        return sum_sensitivity(bounds, shape.measure.lower, shape.measure.upper)
    if shape.statistic == "units":
        return unit_count_sensitivity(bounds)
    return count_sensitivity(bounds)


def _quantile_table(query: QuantileQuery, shape: TableShape, spec: ReleaseSpec, domains, bounds, budget: Fraction,
                    definition: str) -> TablePlan:
    """A quantile table: one exponential-mechanism selection per (cell, q), the budget split equally among q."""
    quantiles = tuple(Fraction(q) for q in query.q)
    scores = [quantile_score_sensitivity(bounds, q) for q in quantiles]
    sensitivity = Sensitivity(max(s.l1 for s in scores), 0, "; ".join(s.derivation for s in scores))
    mechanism = calibrate_selection(budget, len(quantiles), definition, f"table {shape.name}")
    candidates = tuple(quantile_candidates(spec, query))
    layout = _layout(shape.name, shape.dims, domains, "quantile", shape.measure, candidates)
    event = MeasurementEvent(shape.name, mechanism, sensitivity, budget)
    return TablePlan(shape.name, query.name, query.kind, tuple(shape.dims), layout, event, None, shape.measure,
                     quantiles, tuple(s.l1 for s in scores))


def allocation_budget(spec: ReleaseSpec) -> Fraction:
    """The budget split among tables: epsilon (pure), rho (zcdp), or the rho that meets (eps, delta)."""
    budget = spec.budget
    if budget.definition == "pure":
        return Fraction(budget.epsilon)
    if budget.definition == "zcdp":
        return Fraction(budget.rho)
    rho = approx_to_zcdp(Fraction(budget.epsilon), budget.delta)
    if rho <= 0:
        raise SpecError(f"budget: epsilon = {budget.epsilon}, delta = {budget.delta} is too small to release anything")
    return rho


class SelectionError(SpecError):
    """The tables a manifest or a run says a selection chose cannot be what it chooses (exit 2)."""


def check_spanning_tree(query: MarginalsQuery, pairs) -> tuple[Pair, ...]:
    """The pairs as a tuple when they are a spanning tree of the query's attributes, each a candidate (its
    attributes in the query's order); SpecError (naming the problem) otherwise."""
    attributes = list(query.attributes)
    candidates = set(itertools.combinations(attributes, 2))
    parts = Components(attributes)
    pairs = tuple(tuple(p) for p in pairs)
    if len(pairs) != len(attributes) - 1:
        raise SelectionError(f"selection of {query.name!r}: {len(pairs)} pairs chosen; a spanning tree of "
                        f"{len(attributes)} attributes has {len(attributes) - 1}")
    for pair in pairs:
        if pair not in candidates:
            raise SelectionError(f"selection of {query.name!r}: {list(pair)} is not a pair of its attributes "
                            f"(in the query's order)")
        if not parts.join(*pair):
            raise SelectionError(f"selection of {query.name!r}: {list(pair)} closes a cycle; the pairs must form a tree")
    return pairs


def check_junction_tree(query: MarginalsQuery, cliques) -> tuple[Clique, ...]:
    """The cliques as a tuple when they grow a junction tree of the query's attributes one attribute a round
    (`transforms.aim.junction_steps`); SpecError (naming the problem) otherwise."""
    cliques = tuple(tuple(c) for c in cliques)
    try:
        junction_steps(list(query.attributes), list(cliques), query.aim_degree)
    except ValueError as error:
        raise SelectionError(f"selection of {query.name!r}: {error}") from None
    return cliques


def _selection(query: MarginalsQuery, share: Fraction, bounds: ContributionBounds, definition: str,
               chosen, domains, cycles_allowed: bool, annealing_allowed: bool = False,
               units: tuple[int, ...] | None = None) -> SelectionPlan:
    """The selection of a `select: mst` or `aim` query: its exponential mechanism and the chosen tables'
    mechanism, each calibrated to its exact share of the query's budget (every round's, chosen or not); with
    annealing, `units` are the chosen tables' rounds' budget units (checked: `aim_model.check_units`)."""
    r = len(query.attributes)
    rounds = r - 1
    cycles = False
    workload = None if query.workload is None else [(tuple(m.attributes), m.weight) for m in query.workload]
    weights = per_attribute = None
    if query.select == "aim":
        degree = query.aim_degree
        candidates = all_candidates(query.attributes, degree)
        cycles = cycles_allowed and uses_cycles(query.attributes, candidates, selection_shape(query, domains)[1])
        if cycles:
            rounds = cycle_rounds(query.attributes, candidates)
        if workload is not None:
            per_attribute = tuple(attribute_weights(list(query.attributes), workload).items())
        score = mst_score_sensitivity(bounds, largest_weight(dict(per_attribute or ()), degree), "aim")
    else:
        degree = 1
        candidates = tuple(itertools.combinations(query.attributes, 2))
        weights = tuple(workload_weights(list(candidates), workload)) if workload is not None else None
        score = mst_score_sensitivity(bounds, max(weights) if weights else 1)
    selection_share = share * SELECTION_SHARE
    selection = MeasurementEvent(f"{query.name}.selection",
                                 calibrate_selection(selection_share, rounds, definition, f"selection {query.name}"),
                                 score, selection_share)
    pair_share = share * PAIR_SHARE / rounds
    counts = count_sensitivity(bounds)
    where = f"{'chosen' if query.select == 'aim' else '2-way'} tables of {query.name}"
    mechanism = calibrate_laplace(pair_share, counts, where) if definition == "pure" else \
        calibrate_gaussian(pair_share, counts, where)
    if chosen is None:
        tables = None
    elif cycles and annealing_allowed:  # the rounds end when the budget is spent or no candidate is left
        units = _checked_units(query, units, len(chosen), rounds, definition)
        tables = check_cycle_selection(query, candidates, chosen, rounds, domains, sum(units) < rounds, True)
    elif cycles:
        tables = check_cycle_selection(query, candidates, chosen, rounds, domains)
    else:
        tables = check_junction_tree(query, chosen) if query.select == "aim" else check_spanning_tree(query, chosen)
    annealing = cycles and annealing_allowed
    if units is not None and not (annealing and tables is not None):
        raise SelectionError(f"selection of {query.name!r}: budget units are recorded, but its rounds are not "
                             f"annealed (only `select: aim` over a capped model, manifest version 9 on)")
    measured = f"{query.name}.{'clique' if query.select == 'aim' else 'pair'}"
    return SelectionPlan(query.name, candidates, rounds, selection, MeasurementEvent(measured, mechanism, counts, pair_share),
                         tables, weights, query.select, degree, per_attribute, cycles, annealing,
                         units if tables is not None and annealing else None)


def _checked_units(query: MarginalsQuery, units, chosen: int, rounds: int, definition: str) -> tuple[int, ...]:
    """The budget units of an annealed selection's rounds, one per chosen table, as its rounds could spend them;
    SelectionError (naming the problem) otherwise."""
    if chosen > rounds:
        raise SelectionError(f"selection of {query.name!r}: {chosen} tables chosen; the selection has {rounds} rounds")
    if not isinstance(units, (list, tuple)) or len(units) != chosen:
        shown = repr(units) if len(repr(units)) <= 200 else repr(units)[:200] + "..."  # a hostile list: cut short
        raise SelectionError(f"selection of {query.name!r}: {chosen} tables chosen, but the rounds' budget units "
                             f"are {shown} (one positive integer per chosen table)")
    try:
        check_units(list(units), rounds, ANNEAL_GROWTH["epsilon" if definition == "pure" else "rho"])
    except ValueError as error:
        raise SelectionError(f"selection of {query.name!r}: {error}") from None
    return tuple(units)


def annealed_slack(selection: SelectionPlan, events: dict[str, MeasurementEvent]) -> Fraction:
    """What an annealed selection's allocation exceeds its realized loss by (0 for any other): its draws' and
    its tables' (`events`, by name) allocations less their losses (each round's mechanisms are rounded towards
    less loss, so the gap is a rounding's, about 1e-7 of the allocation)."""
    if not selection.annealing:
        return Fraction(0)
    chosen = [events[table_name(selection.query, c)] for c in selection.chosen or ()]
    return sum((e.allocated - e.loss for e in selection.events() + chosen), Fraction(0))


def _at_filter_bounds(totals: Totals, selections: list[SelectionPlan], events: dict[str, MeasurementEvent]) -> Totals:
    """The release's totals with every annealed selection at its allocation. Privacy: the rounds are a privacy
    filter, and its guarantee is the bound over every units sequence the data could make the rounds spend, not
    the loss of the one they spent (another sequence's rounded mechanisms can lose slightly more); that bound is
    at most the allocation, so stating it makes the totals (and the ledger's charge) the same before and after
    the selection and an upper bound either way."""
    slack = sum((annealed_slack(s, events) for s in selections), Fraction(0))
    if not slack:
        return totals
    if totals.definition == "pure":
        return replace(totals, pure_epsilon=totals.pure_epsilon + slack)
    rho = totals.rho + slack
    return replace(totals, rho=rho, epsilon_at_delta=zcdp_to_epsilon(float(rho), totals.delta)
                   if totals.delta is not None else None)


def selection_shape(query: MarginalsQuery, domains) -> tuple[dict[str, int], int]:
    """(Each attribute's domain size, the units of the query's `within` level, 1 without one): public."""
    units = _dims([query.within], domains)[0].size if query.within else 1
    return _attribute_sizes(query, domains), units


def check_cycle_selection(query: MarginalsQuery, candidates, chosen, rounds: int, domains,
                          unspent: bool | None = None, bounded_reads: bool = False) -> tuple[Clique, ...]:
    """The chosen tables as a tuple when a selection over a capped model could have chosen them
    (`transforms.aim_model.check_chosen`; `unspent`: whether its budget was left unspent; `bounded_reads`: the
    rounds' candidates read within `aim_model.READ_CELLS`, manifest version 9 on); SelectionError (naming the
    problem) otherwise."""
    cliques = tuple(tuple(c) for c in chosen)
    sizes, units = selection_shape(query, domains)
    try:
        check_chosen(list(query.attributes), candidates, list(cliques), rounds, sizes, units, unspent, bounded_reads)
    except ValueError as error:
        raise SelectionError(f"selection of {query.name!r}: {error}") from None
    return cliques


def build_plan(spec: ReleaseSpec, base_dir: Path, reader: DomainReader | None = None,
               chosen: dict[str, tuple[Clique, ...]] | None = None, optimal_marginals: bool = True,
               aim_cycles: bool = True, units: dict[str, tuple[int, ...]] | None = None,
               aim_annealing: bool = True, aim_converged_fit: bool = True) -> Plan:
    """Plan a release from its spec. Privacy: sensitivity comes from `count_sensitivity` of the
    declared bounds; each table's mechanism is calibrated to its exact share of the budget. Domain files
    are read by `reader` (default: relative to `base_dir`). `chosen`: the tables each `select: mst` or `aim`
    query chose (from a run or a manifest); without them the plan is the one before data is read.
    `optimal_marginals`: False for a release of manifest version 6 or earlier (`Plan.optimal_marginals`);
    `aim_cycles`: False for one of version 7 or earlier (`Plan.aim_cycles`); `units`: each annealed selection's
    rounds' budget units (`SelectionPlan.units`); `aim_annealing`: False for one of version 8 or earlier;
    `aim_converged_fit`: False for one of version 9 or earlier."""
    return plan_over(spec, build_domains(spec, base_dir, reader), chosen, optimal_marginals, aim_cycles, units,
                     aim_annealing, aim_converged_fit)


def with_selections(plan: Plan, chosen: dict[str, tuple[Clique, ...]],
                    units: dict[str, tuple[int, ...]] | None = None) -> Plan:
    """The plan once its selections are made: the chosen tables in place of the pending ones (the same budget,
    mechanisms and totals); `units`: each annealed selection's rounds' budget units."""
    return plan_over(plan.spec, plan.domains, chosen, plan.optimal_marginals, plan.aim_cycles, units,
                     plan.aim_annealing, plan.aim_converged_fit)


def candidate_tables(plan: Plan, selection: SelectionPlan, cliques=None, units: list[int] | None = None
                     ) -> list[TablePlan]:
    """The tables of a selection's candidates (every candidate, or `cliques`): layout only, no mechanism (they
    are scored, not released), or with `units` (per clique, its round's budget units) the mechanism each chosen
    table gets (`SelectionPlan.round_measurement`: the same noise the measurement stage draws, noise being a
    function of the key, the table's name and the cell)."""
    query = plan.query(selection.query)
    prefix = _dims([query.within], plan.domains) if query.within else []
    tables = []
    for i, clique in enumerate(selection.candidates if cliques is None else cliques):
        name = table_name(query.name, clique)
        dims = prefix + _dims(list(clique), plan.domains)
        event = selection.round_measurement(units[i], name) if units is not None else None
        tables.append(TablePlan(name, query.name, query.kind, tuple(dims), _layout(name, dims, plan.domains), event,
                                None))
    return tables


def _check_selection_names(tables: list[TablePlan], selections: list[SelectionPlan]) -> None:
    """Refuse (SpecError, before any data is read) a release in which a candidate table, a selection or its
    chosen tables' record would share a name with any other table: the selection stage keys counts by name."""
    if not selections:
        return
    names = [t.name for t in tables] + [n for s in selections for n in (s.name, s.pair_event.table)]
    for s in selections:
        chosen = set(s.chosen or ())
        names += [table_name(s.query, clique) for clique in s.candidates if clique not in chosen]
    repeated = sorted(n for n, count in Counter(names).items() if count > 1)
    if repeated:
        methods = sorted({f"select: {s.method}" for s in selections})
        raise SpecError(f"queries: with `{'` and `'.join(methods)}`, these names would each belong to two tables (or "
                        f"to a table and the selection): {repeated[:10]}; rename the columns (a '-' in a column name "
                        f"can make a candidate's name equal another's)")


AIM_ROUND_CELLS = 1 << 22
"""Most candidate cells a `select: aim` round counts in one pass over the input (a round's candidates are
counted in passes of at most this many cells, or one candidate where it alone is larger): 32 MiB of counts."""
MAX_SELECTION_PASSES = 400
"""Most passes over the input the selections of a release may make (`selection_passes`, an upper bound from
the plan): each pass reads, bounds and counts every record again."""


def candidate_cells(plan: Plan, selection: SelectionPlan) -> list[int]:
    """Each candidate's cells (public: its dimensions' sizes), without building its table (`candidate_tables`)."""
    query = plan.query(selection.query)
    units = _dims([query.within], plan.domains)[0].size if query.within else 1
    sizes = _attribute_sizes(query, plan.domains)
    return [units * math.prod(sizes[a] for a in clique) for clique in selection.candidates]


def selection_passes(plan: Plan) -> int:
    """An upper bound on the passes over the input a run's selections make (public: from the plan). mst: one.
    aim: per round, at most 2 ceil(cells / AIM_ROUND_CELLS) + 1 passes (`selection._passes` packs candidates in
    order, so two consecutive passes hold more than AIM_ROUND_CELLS), the round's cells every candidate's
    together over a capped model (`SelectionPlan.cycles`), else bounded by those and by its count of candidates
    times the largest: the separators of at most `degree` of the attributes held (every attribute of the first
    round's pairs) with every attribute not held."""
    passes = 0
    for s in plan.selections:
        if s.chosen is not None:
            continue
        if s.method == "mst":
            passes += 1
            continue
        sizes = candidate_cells(plan, s)
        if s.cycles:  # every round weighs at most every candidate
            passes += s.rounds * (2 * -(-sum(sizes) // AIM_ROUND_CELLS) + 1)
            continue
        attributes = s.rounds + 1
        for round_ in range(s.rounds):
            held = round_ + 1
            count = math.comb(attributes, 2) if round_ == 0 else \
                sum(math.comb(held, k) for k in range(1, s.degree + 1)) * (attributes - held)
            cells = min(sum(sizes), count * max(sizes))
            passes += 2 * -(-cells // AIM_ROUND_CELLS) + 1
    return passes


def selection_cells(plan: Plan) -> int:
    """Cells the selection stage holds at once (public: from the plan): mst, every candidate pair's table; aim, a
    pass of candidates (at most `AIM_ROUND_CELLS`, or the largest candidate) and the table the round before
    chose (at most the largest candidate; the tables chosen earlier are kept as released values)."""
    cells = 0
    for s in plan.selections:
        if s.chosen is not None:
            continue
        sizes = candidate_cells(plan, s)
        if s.method == "aim":
            cells += min(sum(sizes), max(AIM_ROUND_CELLS, max(sizes))) + max(sizes)
        else:
            cells += sum(sizes)
    return cells


def plan_over(spec: ReleaseSpec, domains: dict[str, Domain], chosen: dict[str, tuple[Clique, ...]] | None,
              optimal_marginals: bool = True, aim_cycles: bool = True, units: dict[str, tuple[int, ...]] | None = None,
              aim_annealing: bool = True, aim_converged_fit: bool = True) -> Plan:
    """`build_plan` over domains already built."""
    chosen = chosen or {}
    units = units or {}
    unknown = sorted(set(chosen) - {q.name for q in spec.queries if getattr(q, "selects", False)})
    if unknown:
        raise SpecError(f"selections: {unknown} name no `select: mst` or `select: aim` query")
    bounds = ContributionBounds(spec.contribution.max_records_per_unit, spec.neighbouring)
    sensitivity = count_sensitivity(bounds)
    total = allocation_budget(spec)
    query_shares = allocate(total, [Fraction(q.weight) for q in spec.queries])
    tables: list[TablePlan] = []
    means: list[MeanOutput] = []
    definition = "pure" if spec.budget.definition == "pure" else "rho"
    selections: list[SelectionPlan] = []
    for query, share in zip(spec.queries, query_shares):
        selected = isinstance(query, MarginalsQuery) and query.selects
        if selected:
            selections.append(_selection(query, share, bounds, definition, chosen.get(query.name), domains,
                                         aim_cycles, aim_annealing, units.get(query.name)))
        shapes = _query_tables(query, spec, domains, selections[-1].chosen if selected else None, optimal_marginals,
                               selections[-1].rounds if selected else None,
                               selections[-1].round_units() if selected else None)
        noisy = [shape for shape in shapes if shape.name not in spec.invariants]
        if selected:  # fixed shares (1-way, pairs, selection: a third each), the same before and after choosing
            parts = {shape.name: share * shape.weight for shape in noisy}
        else:
            parts = dict(zip([shape.name for shape in noisy], allocate(share, [shape.weight for shape in noisy])))
            if isinstance(query, MarginalsQuery) and definition != "pure" and len(set(parts.values())) > 1:
                parts = _compact_parts(parts, count_sensitivity(bounds))
        for shape in shapes:
            if isinstance(query, QuantileQuery):
                tables.append(_quantile_table(query, shape, spec, domains, bounds, parts[shape.name], definition))
                continue
            event = None
            if shape.name in parts:
                where = f"table {shape.name}"
                sensitivity = _sensitivity(shape, bounds)
                if definition == "pure":
                    mechanism = calibrate_laplace(parts[shape.name], sensitivity, where)
                else:
                    mechanism = calibrate_gaussian(parts[shape.name], sensitivity, where)
                event = MeasurementEvent(shape.name, mechanism, sensitivity, parts[shape.name])
            layout = _layout(shape.name, shape.dims, domains, shape.statistic, shape.measure)
            tables.append(TablePlan(shape.name, query.name, query.kind, tuple(shape.dims), layout, event, shape.link,
                                    shape.measure))
        if isinstance(query, MeanQuery):
            means.append(MeanOutput(query.name, shapes[0].name, shapes[1].name, shapes[0].measure))
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise SpecError(f"queries: two tables would share a name: {sorted({n for n in names if names.count(n) > 1})} "
                        f"(a marginal's name joins its attributes with '-': rename a column whose name holds one)")
    _check_selection_names(tables, selections)
    events = [t.event for t in tables if t.event is not None] + [e for s in selections for e in s.events()]
    if sum((e.allocated for e in events), Fraction(0)) != total:  # exact arithmetic: checked anyway
        raise ArithmeticError("the allocation does not sum to the budget")
    totals = _at_filter_bounds(compose(events, spec.budget.definition, getattr(spec.budget, "delta", None)),
                               selections, {t.name: t.event for t in tables if t.event is not None})
    return Plan(spec, domains, bounds, sensitivity, total, tuple(tables), totals, tuple(means), tuple(selections),
                optimal_marginals, aim_cycles, aim_annealing, aim_converged_fit)


__all__ = ["Plan", "TablePlan", "SelectionPlan", "Pair", "with_selections", "candidate_tables", "HierarchyLink", "MeanOutput", "Measure", "build_plan", "build_domains", "NATION"]
