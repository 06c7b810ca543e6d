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

from dprelease.accounting.composition import MeasurementEvent, Totals, compose
from dprelease.accounting.conversions import approx_to_zcdp
from dprelease.accounting.errors import SpecError
from dprelease.accounting.mechanisms import calibrate_gaussian, calibrate_laplace
from dprelease.accounting.rationals import allocate
from dprelease.accounting.sensitivity import ContributionBounds, CountSensitivity, count_sensitivity
from dprelease.transforms.aggregate import TableLayout
from dprelease.transforms.domains import (NATION, CategoricalDomain, Dimension, Domain, GeographyDomain,
                                          IntegerDomain, dimension)

from .spec import (CategoricalColumn, GeographyColumn, HierarchyQuery, HistogramQuery, IntegerColumn,
                   MarginalsQuery, ReleaseSpec)


@dataclass(frozen=True)
class HierarchyLink:
    """A hierarchy table's place in its tree: the table of the level above and the unit map."""

    query: str
    level_index: int
    parent_table: str | None


@dataclass(frozen=True)
class TablePlan:
    name: str
    query: str
    kind: str
    dims: tuple[Dimension, ...]
    layout: TableLayout
    event: MeasurementEvent | None
    hierarchy: HierarchyLink | None

    @property
    def n_cells(self) -> int:
        return self.layout.n_cells

    @property
    def invariant(self) -> bool:
        """Published exactly (declared in the spec): no noise, no budget, no protection."""
        return self.event is None

    def noise_variance(self) -> float:
        return 0.0 if self.event is None else self.event.mechanism.variance()


@dataclass(frozen=True)
class Plan:
    spec: ReleaseSpec
    domains: dict[str, Domain]
    bounds: ContributionBounds
    sensitivity: CountSensitivity
    allocation_budget: Fraction
    tables: tuple[TablePlan, ...]
    totals: Totals

    @property
    def definition(self) -> str:
        return self.spec.budget.definition

    @property
    def delta(self) -> float | None:
        return getattr(self.spec.budget, "delta", None)

    @property
    def n_cells(self) -> int:
        """Public cells of every table together (what a run holds in memory)."""
        return sum(t.n_cells for t in self.tables)

    def ledger_spend(self) -> tuple[str, Fraction]:
        """(unit, amount) the ledger charges for this release: epsilon under pure DP, else rho."""
        totals = self.totals
        return ("epsilon", totals.pure_epsilon) if self.definition == "pure" else ("rho", totals.rho)

    def table(self, name: str) -> TablePlan:
        return next(t for t in self.tables if t.name == name)

    def measured(self) -> list[TablePlan]:
        """Tables released with noise (every table but the invariants)."""
        return [t for t in self.tables if not t.invariant]

    def used_columns(self) -> list[str]:
        return sorted({c for t in self.tables for c in t.layout.columns})


def read_geography_leaves(path: Path, width: int, where: str) -> tuple[str, ...]:
    """The public list of finest-level codes: one code per line; '#' comments and blanks skipped."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise SpecError(f"{where} = {str(path)!r}: cannot be read ({error.strerror})") from None
    codes: list[str] = []
    problems: list[str] = []
    for number, line in enumerate(lines, start=1):
        code = line.split(",")[0].strip()
        if not code or code.startswith("#"):
            continue
        if len(code) != width:
            problems.append(f"{where} {path}:{number}: code {code!r} has {len(code)} characters; the finest level needs {width}")
        codes.append(code)
    if len(set(codes)) != len(codes):
        problems.append(f"{where} {path}: repeated codes")
    if not codes:
        problems.append(f"{where} {path}: no codes")
    if problems:
        raise SpecError(problems[:20])
    return tuple(sorted(codes))


def build_domains(spec: ReleaseSpec, base_dir: Path) -> dict[str, Domain]:
    domains: dict[str, Domain] = {}
    for name, column in spec.columns.items():
        if isinstance(column, CategoricalColumn):
            domains[name] = CategoricalDomain(name, tuple(str(v) for v in column.values), column.on_invalid)
        elif isinstance(column, IntegerColumn):
            edges = tuple(column.bins) if column.bins else None
            domains[name] = IntegerDomain(name, column.min, column.max, edges, column.on_invalid)
        else:
            assert isinstance(column, GeographyColumn)
            levels = tuple(column.levels.items())
            path = (base_dir / column.domain_file)
            leaves = read_geography_leaves(path, levels[-1][1], f"columns.{name}.domain_file")
            domains[name] = GeographyDomain(name, levels, leaves, column.on_invalid)
    return domains


def _dims(refs: list[str], domains: dict[str, Domain]) -> list[Dimension]:
    dims = []
    for ref in refs:
        column, _, level = ref.partition(".")
        dims.append(dimension(domains[column], level or None))
    return dims


def _layout(name: str, dims: list[Dimension], domains: dict[str, Domain]) -> TableLayout:
    lookups = []
    for dim in dims:
        domain = domains[dim.column]
        if isinstance(domain, GeographyDomain) and dim.level != domain.leaf_level:
            lookups.append(domain.leaf_to_level(dim.level))
        else:
            lookups.append(None)
    return TableLayout(name, tuple(d.column for d in dims), tuple(lookups), tuple(d.size for d in dims))


def _query_tables(query, domains) -> list[tuple[str, list[Dimension], HierarchyLink | None]]:
    """(table name, dims, hierarchy link) of each table a query asks for."""
    if isinstance(query, HistogramQuery):
        return [(query.name, _dims(query.by, domains), None)]
    if isinstance(query, MarginalsQuery):
        prefix = _dims([query.within], domains) if query.within else []
        tables = []
        for combo in itertools.combinations(query.attributes, query.way):
            suffix = "-".join(ref.replace(".", "_") for ref in combo)
            tables.append((f"{query.name}.{suffix}", prefix + _dims(list(combo), domains), None))
        return tables
    assert isinstance(query, HierarchyQuery)
    tables = []
    by = _dims(query.by, domains)
    for i, level in enumerate(query.levels):
        parent = f"{query.name}.{query.levels[i - 1]}" if i else None
        geo = _dims([f"{query.geography}.{level}"], domains)
        tables.append((f"{query.name}.{level}", geo + by, HierarchyLink(query.name, i, parent)))
    return tables


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


def build_plan(spec: ReleaseSpec, base_dir: Path) -> Plan:
    """Plan a release from its spec. Privacy: sensitivity comes from `count_sensitivity` of the
    declared bounds; each table's mechanism is calibrated to its exact share of the budget."""
    domains = build_domains(spec, base_dir)
    bounds = ContributionBounds(spec.contribution.max_records_per_unit, spec.neighbouring)
    sensitivity = count_sensitivity(bounds)
    total = allocation_budget(spec)
    query_shares = allocate(total, [Fraction(q.weight) for q in spec.queries])
    tables: list[TablePlan] = []
    for query, share in zip(spec.queries, query_shares):
        specs = _query_tables(query, domains)
        noisy = [name for name, _, _ in specs if name not in spec.invariants]
        parts = dict(zip(noisy, allocate(share, [Fraction(1)] * len(noisy))))
        for name, dims, link in specs:
            event = None
            if name in parts:
                where = f"table {name}"
                if spec.budget.definition == "pure":
                    mechanism = calibrate_laplace(parts[name], sensitivity, where)
                else:
                    mechanism = calibrate_gaussian(parts[name], sensitivity, where)
                event = MeasurementEvent(name, mechanism, sensitivity, parts[name])
            tables.append(TablePlan(name, query.name, query.kind, tuple(dims), _layout(name, dims, domains), event, link))
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise SpecError(f"queries: two tables would share a name: {sorted({n for n in names if names.count(n) > 1})}")
    totals = compose([t.event for t in tables if t.event is not None], spec.budget.definition,
                     getattr(spec.budget, "delta", None))
    return Plan(spec, domains, bounds, sensitivity, total, tuple(tables), totals)


__all__ = ["Plan", "TablePlan", "HierarchyLink", "build_plan", "build_domains", "NATION"]
