"""The Plan: everything about a release that follows from the spec alone (no data is read).

Tables and their public cell domains, the sensitivity derived from the contribution
bounds, the exact budget allocation, the calibrated mechanisms and their expected errors.
`dprelease plan` prints it; `dprelease verify` rebuilds it from a manifest's spec.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Callable

from dprelease.accounting.composition import MeasurementEvent, Totals, compose
from dprelease.accounting.conversions import approx_to_zcdp
from dprelease.accounting.errors import SpecError
from dprelease.accounting.mechanisms import calibrate_gaussian, calibrate_laplace, calibrate_selection
from dprelease.accounting.rationals import allocate
from dprelease.accounting.sensitivity import (ContributionBounds, Sensitivity, count_sensitivity,
                                              quantile_score_sensitivity, sum_sensitivity, unit_count_sensitivity)
from dprelease.transforms.aggregate import TableLayout
from dprelease.transforms.domains import (NATION, CategoricalDomain, Dimension, Domain, GeographyDomain,
                                          IntegerDomain, MeasureDomain, dimension, measure_key)
from dprelease.transforms.release_values import TableRelease

from .safe_files import UnsafeFile, read_regular
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
        """(unit, amount) the ledger charges for this release: epsilon under pure DP, else rho."""
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
    path = where
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


def _query_tables(query, spec: ReleaseSpec, domains) -> list[TableShape]:
    """Every table a query asks for."""
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
        tables = []
        for combo in itertools.combinations(query.attributes, query.way):
            suffix = "-".join(ref.replace(".", "_") for ref in combo)
            tables.append(TableShape(f"{query.name}.{suffix}", prefix + _dims(list(combo), domains)))
        return tables
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


def build_plan(spec: ReleaseSpec, base_dir: Path, reader: DomainReader | None = None) -> Plan:
    """Plan a release from its spec. Privacy: sensitivity comes from `count_sensitivity` of the
    declared bounds; each table's mechanism is calibrated to its exact share of the budget. Domain files
    are read by `reader` (default: relative to `base_dir`)."""
    domains = build_domains(spec, base_dir, reader)
    bounds = ContributionBounds(spec.contribution.max_records_per_unit, spec.neighbouring)
    sensitivity = count_sensitivity(bounds)
    total = allocation_budget(spec)
    query_shares = allocate(total, [Fraction(q.weight) for q in spec.queries])
    tables: list[TablePlan] = []
    means: list[MeanOutput] = []
    definition = "pure" if spec.budget.definition == "pure" else "rho"
    for query, share in zip(spec.queries, query_shares):
        shapes = _query_tables(query, spec, domains)
        noisy = [shape for shape in shapes if shape.name not in spec.invariants]
        parts = dict(zip([shape.name for shape in noisy], allocate(share, [shape.weight for shape in noisy])))
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
        raise SpecError(f"queries: two tables would share a name: {sorted({n for n in names if names.count(n) > 1})}")
    totals = compose([t.event for t in tables if t.event is not None], spec.budget.definition,
                     getattr(spec.budget, "delta", None))
    return Plan(spec, domains, bounds, sensitivity, total, tuple(tables), totals, tuple(means))


__all__ = ["Plan", "TablePlan", "HierarchyLink", "MeanOutput", "Measure", "build_plan", "build_domains", "NATION"]
