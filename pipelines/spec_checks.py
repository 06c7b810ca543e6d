"""Cross-field checks of a spec: references between queries and columns, bins, levels, names."""
from __future__ import annotations

from .spec import (MAX_CANDIDATES, MEASURE_QUERIES, CategoricalColumn, CountUnitsQuery, GeographyColumn,
                   HierarchyQuery, HistogramQuery, IntegerColumn, MarginalsQuery, QuantileQuery, ReleaseSpec)

NATION = "nation"
MAX_INTEGER_BOUND = 2**53 - 1
"""Integer domains lie within ±(2**53 - 1), so any input value beyond them, however large, is out of
domain (an invalid value handled by policy) even after conversion to a double."""
MAX_CLAMP = 2**31 - 1
"""Measure clamps lie within ±(2**31 - 1): sums of up to 2**32 records per cell are exact in int64, and
per-batch partial sums exact in doubles."""

MAX_MST_ATTRIBUTES = 200
"""Most attributes of a `select: mst` query: 19,900 candidate pairs, each scored once (planning and verify
build every candidate)."""
MAX_AIM_ATTRIBUTES = 60
"""Most attributes of a `select: aim` query: the plan checks the names of every table a round could choose
(35,990 pairs and triples of 60 attributes), and a round scores up to a few thousand candidates."""


def _check_clamp(path: str, column: IntegerColumn, problems: list[str]) -> None:
    clamp = column.clamp
    if clamp is None:
        return
    if len(clamp) != 2:
        problems.append(f"{path}.clamp = {clamp}: must be [lo, hi]")
    elif clamp[0] > clamp[1]:
        problems.append(f"{path}.clamp = {clamp}: lo must be <= hi")
    elif max(abs(clamp[0]), abs(clamp[1])) > MAX_CLAMP:
        problems.append(f"{path}.clamp = {clamp}: lo and hi must lie within ±{MAX_CLAMP} (2**31 - 1)")
    elif clamp == [0, 0]:
        problems.append(f"{path}.clamp = {clamp}: every value would be 0; give a range that holds the measure")


def _check_column(name: str, column, problems: list[str]) -> None:
    path = f"columns.{name}"
    if isinstance(column, IntegerColumn):
        _check_clamp(path, column, problems)
        if max(abs(column.min), abs(column.max)) > MAX_INTEGER_BOUND:
            problems.append(f"{path}: min and max must lie within ±{MAX_INTEGER_BOUND} (2**53 - 1: exact as doubles); "
                            f"got [{column.min}, {column.max}]")
            return
        if column.max < column.min:
            problems.append(f"{path}.max = {column.max}: must be >= min ({column.min})")
            return
        if column.bins is not None:
            bins = column.bins
            if len(bins) < 2:
                problems.append(f"{path}.bins = {bins}: needs at least 2 edges")
            elif any(b >= a for a, b in zip(bins[1:], bins[:-1])):
                problems.append(f"{path}.bins = {bins}: edges must be strictly increasing")
            elif bins[0] != column.min or bins[-1] != column.max + 1:
                problems.append(
                    f"{path}.bins = {bins}: first edge must equal min ({column.min}) and last edge max + 1 ({column.max + 1})"
                )
        if column.max - column.min >= 1_000_000 and not column.bins:
            problems.append(f"{path}: range [{column.min}, {column.max}] has over 1,000,000 cells; give bins")
    elif isinstance(column, GeographyColumn):
        if NATION in column.levels:
            problems.append(f"{path}.levels: '{NATION}' is implicit (width 0); do not list it")


def _resolve(spec: ReleaseSpec, ref: str, path: str, problems: list[str]) -> tuple[str, str | None] | None:
    column, _, level = ref.partition(".")
    if column not in spec.columns:
        problems.append(f"{path} = {ref!r}: unknown column; known: {sorted(spec.columns)}")
        return None
    domain = spec.columns[column]
    if level:
        if not isinstance(domain, GeographyColumn):
            problems.append(f"{path} = {ref!r}: only geography columns have levels")
            return None
        allowed = [NATION, *domain.levels]
        if level not in allowed:
            problems.append(f"{path} = {ref!r}: unknown level; allowed: {allowed}")
            return None
    return column, level or None


def _check_refs(spec: ReleaseSpec, refs: list[str], path: str, problems: list[str]) -> None:
    seen = []
    for i, ref in enumerate(refs):
        resolved = _resolve(spec, ref, f"{path}[{i}]", problems)
        if resolved:
            if resolved[0] in seen:
                problems.append(f"{path}[{i}] = {ref!r}: column {resolved[0]!r} used twice in one table")
            seen.append(resolved[0])


def _select_said(query: MarginalsQuery, auto: bool) -> str:
    """A query's `select` as its spec said it: 'auto' (chose 'aim') for a `select: auto` query (`auto`)."""
    return f"'auto' (chose {query.select!r})" if auto else repr(query.select)


def _check_workload(query: MarginalsQuery, path: str, problems: list[str], auto: bool) -> None:
    """A workload belongs to a `select: mst` or `aim` query and names its attributes, each once per marginal; a
    degree belongs to a `select: aim` query (not `select: auto`, which may choose mst); a strategy to published
    tables. `auto`: the query's spec said `select: auto`."""
    said = _select_said(query, auto)
    if query.degree is not None and auto:
        problems.append(f"{path}.degree = {query.degree}: `select: auto` takes no degree (it chooses mst or "
                        f"aim from the budget); write `select: aim` to give one")
    elif query.degree is not None and query.select != "aim":
        problems.append(f"{path}.degree = {query.degree}: only a `select: aim` query takes a degree (select = "
                        f"{said})")
    if query.strategy == "direct" and query.selects:
        problems.append(f"{path}.strategy = 'direct': only published tables (select: all) take a strategy (select = "
                        f"{said})")
    if query.workload is None:
        return
    if not query.selects:
        problems.append(f"{path}.workload: only a `select: mst` or `select: aim` query takes a workload (select = "
                        f"{said})")
        return
    for i, marginal in enumerate(query.workload):
        for j, attribute in enumerate(marginal.attributes):
            where = f"{path}.workload[{i}].attributes[{j}] = {attribute!r}"
            if attribute not in query.attributes:
                problems.append(f"{where}: not one of the query's attributes {list(query.attributes)}")
            elif marginal.attributes.index(attribute) != j:
                problems.append(f"{where}: listed twice in one marginal")


def _location_problems(spec: ReleaseSpec) -> list[str]:
    """The spec's input and output URIs checked as a run would check them, with no store reached."""
    from dprelease.accounting.errors import SpecError

    from .storage.uris import check_uri, is_uri, local_path

    problems = []
    for field, value in (("input.path", spec.input.path), ("output.dir", spec.output.dir)):
        try:
            text = local_path(value)
            if is_uri(text):
                check_uri(text, field)
        except SpecError as error:
            problems.append(str(error))
    return problems


def cross_reference_problems(spec: ReleaseSpec) -> list[str]:
    problems: list[str] = _location_problems(spec)
    for name, column in spec.columns.items():
        _check_column(name, column, problems)
    if spec.privacy_unit is None and spec.contribution.max_records_per_unit != 1:
        problems.append(
            f"contribution.max_records_per_unit = {spec.contribution.max_records_per_unit}: "
            "must be 1 when privacy_unit is null (each record is its own unit)"
        )
    if spec.privacy_unit is not None and spec.privacy_unit in spec.columns:
        problems.append(f"privacy_unit = {spec.privacy_unit!r}: the unit column cannot also be a table column")
    names = [q.name for q in spec.queries]
    for i, query in enumerate(spec.queries):
        path = f"queries[{i}]"
        if names.count(query.name) > 1:
            problems.append(f"{path}.name = {query.name!r}: duplicate query name")
        _refuse_randomized(spec, query, path, problems)
        if isinstance(query, (HistogramQuery, CountUnitsQuery)):
            _check_refs(spec, query.by, f"{path}.by", problems)
        elif isinstance(query, MEASURE_QUERIES):
            _check_refs(spec, query.by, f"{path}.by", problems)
            _check_measure(spec, query, path, problems)
        elif isinstance(query, MarginalsQuery):
            if query.attributes is None:
                problems.append(f"{path}.attributes: required (only a `select: mst` or `select: aim` query takes "
                                f"every column by default)")
                continue
            _check_refs(spec, query.attributes, f"{path}.attributes", problems)
            if query.way > len(query.attributes):
                problems.append(f"{path}.way = {query.way}: must be <= number of attributes ({len(query.attributes)})")
            limit = MAX_MST_ATTRIBUTES if query.select == "mst" else MAX_AIM_ATTRIBUTES
            auto = query.name in spec.auto_selections
            if query.selects and (query.way != 2 or not 2 <= len(query.attributes) <= limit):
                problems.append(f"{path}.select = {_select_said(query, auto)}: needs way = 2 and 2 to {limit} attributes "
                                f"(got way = {query.way}, {len(query.attributes)} attribute(s))")
            if query.selects:
                for j, ref in enumerate(query.attributes):
                    if isinstance(spec.columns.get(ref.partition(".")[0]), GeographyColumn):
                        plain = f"auto` (chose {query.select})" if auto else f"{query.select}`"
                        problems.append(f"{path}.attributes[{j}] = {ref!r}: a `select: {plain} query's "
                                        f"attributes cannot be a geography (cross its tables with one by `within`)")
            _check_workload(query, path, problems, auto)
            if query.within is not None:
                resolved = _resolve(spec, query.within, f"{path}.within", problems)
                if resolved and resolved[1] is None:
                    problems.append(f"{path}.within = {query.within!r}: must name a level, e.g. 'geo.county'")
                if resolved and resolved[0] in [a.partition('.')[0] for a in query.attributes]:
                    problems.append(f"{path}.within = {query.within!r}: also listed in attributes")
        elif isinstance(query, HierarchyQuery):
            geo = spec.columns.get(query.geography)
            if not isinstance(geo, GeographyColumn):
                problems.append(f"{path}.geography = {query.geography!r}: must name a geography column")
            else:
                allowed = [NATION, *geo.levels]
                unknown = [lvl for lvl in query.levels if lvl not in allowed]
                if unknown:
                    problems.append(f"{path}.levels = {query.levels}: unknown levels {unknown}; allowed: {allowed}")
                elif [allowed.index(lvl) for lvl in query.levels] != sorted({allowed.index(lvl) for lvl in query.levels}):
                    problems.append(f"{path}.levels = {query.levels}: must be distinct and ordered coarse to fine")
            _check_refs(spec, query.by, f"{path}.by", problems)
            if query.geography in [b.partition('.')[0] for b in query.by]:
                problems.append(f"{path}.by: cannot cross the hierarchy with its own geography column")
    _check_invariants(spec, problems)
    return problems


def randomized_columns(spec: ReleaseSpec) -> list[str]:
    """The columns declared as collected under randomized response, in the spec's order."""
    return [name for name, column in spec.columns.items()
            if isinstance(column, CategoricalColumn) and column.randomized_response is not None]


def _refuse_randomized(spec: ReleaseSpec, query, path: str, problems: list[str]) -> None:
    """Only count tables are debiased: a sum, mean, quantile or unit count over a randomized column would be
    published over the reports, silently biased, so it is refused; so is a `select: mst` query over one (its
    purpose, synthetic records, cannot be drawn from reports)."""
    randomized = set(randomized_columns(spec))
    if isinstance(query, (CountUnitsQuery, *MEASURE_QUERIES)):
        crossed = [b for b in query.by if b in randomized]
        if crossed:
            problems.append(f"{path}.by = {query.by}: {crossed} collected under randomized_response; only count "
                            f"tables (histogram, marginals, hierarchy by) are debiased, not a {query.kind} query's")
    if isinstance(query, MarginalsQuery) and query.selects and query.attributes:
        crossed = [a for a in query.attributes if a in randomized]
        if crossed:
            problems.append(f"{path}.attributes: {crossed} collected under randomized_response; a `select: {query.select}` "
                            f"query is for synthetic records, which cannot be drawn from reports (leave it out, "
                            f"or measure it with select: all)")


def measure_clamp(spec: ReleaseSpec, column: str) -> tuple[int, int] | None:
    """The clamp of a measure column, None when the column is not a measure."""
    declared = spec.columns.get(column)
    if isinstance(declared, IntegerColumn) and declared.clamp is not None and len(declared.clamp) == 2:
        return declared.clamp[0], declared.clamp[1]
    return None


def quantile_candidates(spec: ReleaseSpec, query: QuantileQuery) -> list[int]:
    """The query's candidates, or the column's bin edges within its clamp."""
    if query.candidates is not None:
        return list(query.candidates)
    column = spec.columns[query.column]
    lo, hi = measure_clamp(spec, query.column)
    return [edge for edge in (column.bins or []) if lo <= edge <= hi]


def _check_measure(spec: ReleaseSpec, query, path: str, problems: list[str]) -> None:
    column = spec.columns.get(query.column)
    if column is None:
        problems.append(f"{path}.column = {query.column!r}: unknown column; known: {sorted(spec.columns)}")
        return
    if not isinstance(column, IntegerColumn) or column.clamp is None:
        problems.append(f"{path}.column = {query.column!r}: a {query.kind} needs an integer column with "
                        f"clamp: [lo, hi] (this one is {column.type}{'' if column.type != 'integer' else ' without clamp'})")
        return
    if measure_clamp(spec, query.column) is None:
        return  # the clamp itself is reported
    if not isinstance(query, QuantileQuery):
        return
    lo, hi = measure_clamp(spec, query.column)
    candidates = quantile_candidates(spec, query)
    where = f"{path}.candidates" if query.candidates is not None else f"{path}.candidates (default: columns.{query.column}.bins within the clamp)"
    if len(candidates) < 2:
        problems.append(f"{where} = {candidates}: needs at least 2 candidate values; list them")
    elif len(candidates) > MAX_CANDIDATES:
        problems.append(f"{where}: {len(candidates):,} candidates; at most {MAX_CANDIDATES:,}")
    elif any(b <= a for a, b in zip(candidates, candidates[1:])):
        problems.append(f"{where} = {candidates[:20]}: must be strictly increasing")
    elif candidates[0] < lo or candidates[-1] > hi:
        problems.append(f"{where} = {candidates[:20]}: must lie within the clamp [{lo}, {hi}]")


def _check_invariants(spec: ReleaseSpec, problems: list[str]) -> None:
    hierarchy_tables = {f"{q.name}.{lvl}": q for q in spec.queries if isinstance(q, HierarchyQuery) for lvl in q.levels}
    for i, name in enumerate(spec.invariants):
        if name not in hierarchy_tables:
            problems.append(f"invariants[{i}] = {name!r}: must name a hierarchy table; allowed: {sorted(hierarchy_tables)}")
        elif spec.invariants.count(name) > 1:
            problems.append(f"invariants[{i}] = {name!r}: listed twice")
        elif set(hierarchy_tables[name].by) & set(randomized_columns(spec)):
            problems.append(f"invariants[{i}] = {name!r}: crosses {sorted(set(hierarchy_tables[name].by) & set(randomized_columns(spec)))}, "
                            "collected under randomized_response; exact counts of reports would leave a changed "
                            "value covered by the local guarantee alone (publish it with noise)")
    for query in {id(q): q for q in hierarchy_tables.values()}.values():
        if all(f"{query.name}.{lvl}" in spec.invariants for lvl in query.levels):
            problems.append(f"invariants: every level of query {query.name!r} is an invariant; nothing would be protected")
    if spec.invariants and spec.neighbouring != "replace":
        problems.append(f"invariants = {spec.invariants}: need neighbouring: replace. Under add_remove every neighbour "
                        "adds or removes a unit and so changes an invariant total: a guarantee conditional on the "
                        "invariants would cover no neighbour at all. Under replace it covers replacing one unit by "
                        "another whose records fall in the same cells of every invariant table")


__all__ = ["cross_reference_problems", "CategoricalColumn"]
