"""Building the release manifest (JSON): everything an auditor needs, nothing confidential.

No true counts, no row counts, no key (only its one-way `key_id`), and no timing that
depends on the data: `created_at` is taken before any data is read.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import subprocess
import sys
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Callable

import numpy as np

from dprelease.accounting.conversions import zcdp_to_epsilon
from dprelease.accounting.manifest import exact, measurement_record, totals_record

from .plan import SelectionPlan, Plan, TablePlan
from .debiased import local_section
from .postprocessing import EstimateVariances, estimate_variances, steps_applied

MANIFEST_VERSION = 10
"""2: one global least-squares estimate behind the count tables, its per-cell variance in the tables and
the manifest. 3: the ledger block states what the release cost (`charged`, also for a free re-run) beside
what the run added (`charged_by_this_run`) and every budget period charged; invariants state which
neighbours the guarantee covers. 4: a `select: mst` selection scores each pair less the expected L1 error of
measuring it (`transforms.mst.noise_penalty`). 5: `select: aim` selections (a manifest claiming an earlier
version with one is refused). 6: the implied loss per attribute and per geography level includes the
selections that read them, and states the worst case over every selection the data could have made; provenance
is structured and allow-listed (`invocation`), no command line. 7: a published marginals query under a zcdp or
approx budget is measured by its workload-optimal split (`transforms.strategy`) unless its spec says `strategy:
direct`; releases of versions 1 to 6 are re-planned with every such query measured directly, as they were. verify
still checks versions 1 to 6 against the rules of their time. Any change to the optimisation (its iterations,
loss, thresholds or grid) changes plans: it needs a new version, and the old behaviour kept for the old ones.
8: a `select: aim` query within `transforms.aim_model.uses_cycles` (candidates x attributes^2, units) chooses among every table
that keeps its graphical model within the cap, tables that close cycles included, for twice as many rounds, and its
tables are post-processed as the margins of that model (`marginals_model`); releases of versions 5 to 7 are
re-planned with the junction tree grown one attribute a round, as they were.
9: such a query's rounds anneal their budgets (AIM's: a round gets the units `transforms.aim_model.next_units`
gives, recorded per chosen table in `units`); releases of version 8 are re-planned with equal rounds.
10: such a query's published tables are the margins of its model fitted until each unit's fit settles
(`transforms.units.graphical.CONVERGENCE_TOLERANCE`, the 'converged_model' path); releases of version 9 are
re-planned with the fit's fixed 1000 iterations ('model')."""
SELECTION_LOSS_VERSION = 6
OPTIMAL_MARGINALS_VERSION = 7
AIM_CYCLES_VERSION = 8
AIM_ANNEALING_VERSION = 9
AIM_CONVERGED_FIT_VERSION = 10
DEPENDENCIES = ["numpy", "pyarrow", "pydantic", "PyYAML", "cryptography", "click", "rich"]
NEIGHBOURING_NOTE = {
    "add_remove": "neighbouring inputs differ by adding or removing one privacy unit with all its records",
    "replace": "neighbouring inputs differ by replacing one privacy unit's records (doubles count sensitivity)",
}


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_stamp(created_at: str) -> str:
    """A run's start time (ISO, UTC) as it goes into file names: 20261122T225608Z."""
    return created_at.replace(":", "").replace("-", "").replace("+0000", "Z")


def software_version() -> str:
    try:
        return importlib.metadata.version("dprelease")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _git_commit() -> str | None:
    source = Path(__file__).resolve().parent
    try:
        result = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() or None if result.returncode == 0 else None


def _versions() -> dict[str, str]:
    versions = {"python": sys.version.split()[0]}
    for name in DEPENDENCIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "missing"
    return versions


def implied_loss(plan: Plan, version: int = MANIFEST_VERSION) -> dict:
    """The loss each attribute and each geography level carries: summed over the tables that read it and (from
    version 6) over the selections that read it (a selection scores candidate tables over every attribute of its
    query, within its geography level), and, from version 6, over every table for a column with
    `on_invalid: drop` (an invalid value there removes the record from every table). Privacy: a selection's
    chosen tables depend on the data, so the loss of an attribute in the tables that happened to be chosen is not
    a bound; `worst_case_over_selections` is (from version 6, for releases with selections): the loss if every
    chosen table of every selection held the attribute or level, which some data could make happen."""
    unit = "epsilon" if plan.definition == "pure" else "rho"
    if version < SELECTION_LOSS_VERSION:
        by_attribute, by_level = _table_losses(plan.measured())
        return {"by_attribute": _rendered(plan, by_attribute, unit), "by_geography_level": _rendered(plan, by_level, unit)}
    drops = dropping_columns(plan)
    by_attribute, by_level = _table_losses(plan.measured(), drops)
    if not plan.selections:
        return {"by_attribute": _rendered(plan, by_attribute, unit), "by_geography_level": _rendered(plan, by_level, unit)}
    chosen = {name for s in plan.selections for name in _chosen_tables(plan, s)}
    fixed_attribute, fixed_level = _table_losses([t for t in plan.measured() if t.name not in chosen], drops)
    worst_attribute, worst_level = dict(fixed_attribute), dict(fixed_level)
    for selection in plan.selections:
        attributes, levels = _selection_reads(plan, selection)
        attributes = list(dict.fromkeys([*attributes, *drops]))
        if selection.annealing:  # the filter's bound (`plan._at_filter_bounds`): its draws' and tables' allocations
            drawn, every_round = selection.event.allocated, selection.pair_event.allocated * selection.rounds
        else:
            drawn, every_round = selection.event.loss, selection.rounds * selection.pair_event.loss
        for totals, worst, names in ((by_attribute, worst_attribute, attributes), (by_level, worst_level, levels)):
            for name in names:
                totals[name] = totals.get(name, Fraction(0)) + drawn
                worst[name] = worst.get(name, Fraction(0)) + drawn + every_round
    return {"by_attribute": _rendered(plan, by_attribute, unit), "by_geography_level": _rendered(plan, by_level, unit),
            "worst_case_over_selections": {"by_attribute": _rendered(plan, worst_attribute, unit),
                                           "by_geography_level": _rendered(plan, worst_level, unit)}}


def dropping_columns(plan: Plan) -> list[str]:
    """The columns with `on_invalid: drop` a release reads: an invalid value there removes the record from every
    table (`transforms.encode.encode_batch`), so every table's output depends on the column."""
    return [c for c in plan.used_columns() if c in plan.spec.columns and plan.spec.columns[c].on_invalid == "drop"]


def _table_losses(tables: list[TablePlan], drops: list[str] = ()) -> tuple[dict[str, Fraction], dict[str, Fraction]]:
    """Loss summed per attribute and per geography level over `tables`: a table counts against its dimension
    and measure columns and (`drops`) every column whose invalid values remove a record from it."""
    by_attribute: dict[str, Fraction] = {}
    by_level: dict[str, Fraction] = {}
    for t in tables:
        involved = [dim.column for dim in t.dims] + ([t.measure.column] if t.measure else []) + list(drops)
        for column in dict.fromkeys(involved):
            by_attribute[column] = by_attribute.get(column, Fraction(0)) + t.event.loss
        for dim in t.dims:
            if dim.level:
                by_level[dim.label] = by_level.get(dim.label, Fraction(0)) + t.event.loss
    return by_attribute, by_level


def _chosen_tables(plan: Plan, selection: SelectionPlan) -> list[str]:
    """The names of the tables a selection chose (measured with its `pair_event`)."""
    from .plan import table_name

    return [table_name(selection.query, clique) for clique in selection.chosen or ()]


def _selection_reads(plan: Plan, selection: SelectionPlan) -> tuple[list[str], list[str]]:
    """(attributes, geography levels) a selection's scores read: every attribute of its query, and the
    geography column and level of its `within` (the dimensions of the query's 1-way tables)."""
    query = plan.query(selection.query)
    one_way = [t for t in plan.tables if t.query == query.name and len(t.dims) <= 2]
    attributes = list(dict.fromkeys([*query.attributes, *(d.column for t in one_way for d in t.dims)]))
    levels = list(dict.fromkeys(d.label for t in one_way for d in t.dims if d.level))
    return attributes, levels


def _rendered(plan: Plan, values: dict[str, Fraction], unit: str) -> dict:
    out = {}
    for name, value in sorted(values.items()):
        entry = {unit: exact(value)}
        if unit == "rho" and plan.delta is not None:
            entry["epsilon_at_delta"] = zcdp_to_epsilon(float(value), plan.delta)
        out[name] = entry
    return out


def statistic_record(table: TablePlan) -> dict:
    """What a table of a sum, mean, quantile or count_units query measures (nothing for plain counts, so
    manifests of count releases keep their shape): statistic, measure and clamp, quantiles and candidates,
    and a quantile's expected rank error."""
    record: dict = {}
    if table.statistic != "count" or table.measure is not None:
        record["statistic"] = table.statistic
    if table.measure is not None:
        record["measure"] = {"column": table.measure.column, "clamp": [table.measure.lower, table.measure.upper]}
    if table.quantiles:
        record["quantile"] = {"q": [str(q) for q in table.quantiles], "candidates": list(table.layout.candidates),
                              "score_sensitivity": list(table.score_sensitivities)}
        record["expected_error"] = {"rank_margin_95": rank_margin_95(table), "note": RANK_NOTE}
    return record


RANK_NOTE = ("exponential mechanism utility bound: with probability >= 95% the chosen candidate's score is within "
             "(2 * sensitivity / epsilon) * ln(20 * candidates) of the best candidate's; divided by b (q = a/b), "
             "about the number of records by which its rank misses q * n (largest over q)")


def rank_margin_95(table: TablePlan) -> int:
    """The RANK_NOTE bound, in records, for the worst of the table's quantiles (public: from the plan)."""
    epsilon = float(table.event.mechanism.epsilon)
    m = len(table.layout.candidates)
    return max(math.ceil(2 * sensitivity / epsilon * math.log(20 * m) / q.denominator)
               for q, sensitivity in zip(table.quantiles, table.score_sensitivities))


def means_section(plan: Plan) -> dict:
    """The mean tables and the sum and count tables they divide (only in releases that have means)."""
    if not plan.means:
        return {}
    return {"means": [{"table": m.name, "sum_table": m.sum_table, "count_table": m.count_table,
                       "measure": {"column": m.measure.column, "clamp": [m.measure.lower, m.measure.upper]}}
                      for m in plan.means]}


ESTIMATE_NOTE = ("variance per cell of the generalised least-squares estimate from all count measurements, before "
                 "the nonnegative integer step (which adds about 1/12 to 1/6 per cell from rounding and may move "
                 "cells near 0); per cell in the tables' gls_variance column")


@dataclass(frozen=True)
class VarianceSummary:
    """What the manifest states of a count table's per-cell variances, from its parts: the smallest, the
    largest, each part's sum (numpy's, over the part's cells in order) and the number of cells. The mean is
    math.fsum of the part sums over the count: the same digits whether one machine holds the whole table
    or each worker summarised its part."""

    minimum: float
    maximum: float
    sums: tuple[float, ...]
    count: int

    @classmethod
    def of(cls, values: np.ndarray, parts: list[tuple[int, int]]) -> "VarianceSummary":
        values = np.asarray(values, dtype=np.float64)
        return cls(float(values.min()), float(values.max()),
                   tuple(float(values[a:b].sum()) for a, b in parts), int(values.size))

    @classmethod
    def merged(cls, pieces: list["VarianceSummary"]) -> "VarianceSummary":
        """Summaries of consecutive parts, in part order, as one."""
        return cls(min(p.minimum for p in pieces), max(p.maximum for p in pieces),
                   tuple(s for p in pieces for s in p.sums), sum(p.count for p in pieces))

    def mean(self) -> float:
        return math.fsum(self.sums) / self.count


def estimate_record(summary: VarianceSummary, exact: bool) -> dict:
    """The manifest's summary of a count table's GLS variances (6 significant digits)."""
    def rounded(x: float) -> float:
        return float(f"{x:.6g}")
    return {"variance_min": rounded(summary.minimum), "variance_max": rounded(summary.maximum),
            "variance_mean": rounded(summary.mean()), "bound": "exact" if exact else "upper bound",
            "note": ESTIMATE_NOTE}


def table_summary(plan: Plan, table, layout, cells: Callable[[int, int], np.ndarray]) -> VarianceSummary:
    """A count table's summary over the parts its published file is in (`cells(start, stop)`: the variances of
    cells [start, stop))."""
    from .layout import TABLES_DIR, table_parts

    return VarianceSummary.merged([VarianceSummary.of(cells(p.start, p.stop), [(0, p.stop - p.start)])
                                   for p in table_parts(plan, table, TABLES_DIR, layout)])


def variance_summaries(plan: Plan, estimate: EstimateVariances, layout=None) -> dict[str, VarianceSummary]:
    """Each count table's summary from its per-cell variances, over the parts its published file is in."""
    from .layout import Layout

    layout = layout or Layout()
    return {t.name: table_summary(plan, t, layout, lambda start, stop, name=t.name: estimate.cells(name, start, stop))
            for t in plan.tables if t.name in estimate.per_cell}


def accounting_section(plan: Plan, estimate: EstimateVariances | None = None, layout=None,
                       summaries: dict[str, VarianceSummary] | None = None, version: int = MANIFEST_VERSION) -> dict:
    """The part of the manifest `verify` recomputes from the spec alone (`estimate`: version 2 and on; its
    per-table `summaries`, from the parts of `layout`, computed here when not given)."""
    if estimate is not None and summaries is None:
        summaries = variance_summaries(plan, estimate, layout)
    tables = []
    for t in plan.tables:
        record = {"name": t.name, "query": t.query, "kind": t.kind, "cells": t.n_cells,
                  "dimensions": [{"column": d.column, "level": d.level, "size": d.size} for d in t.dims]}
        if t.invariant:
            record.update({"invariant": True, "mechanism": None,
                           "note": "published exactly: true counts, not protected by differential privacy"})
        else:
            record.update({"invariant": False, **measurement_record(t.event)})
        record.update(statistic_record(t))
        if estimate is not None and t.name in summaries:
            record["estimate"] = estimate_record(summaries[t.name], estimate.exact)
        tables.append(record)
    totals = plan.totals  # its events composed, an annealed selection at its filter's bound
    section = {
        "allocation_budget": {"unit": "epsilon" if plan.definition == "pure" else "rho",
                              **exact(plan.allocation_budget)},
        "tables": tables,
        "totals": totals_record(totals),
        "implied_loss": implied_loss(plan, version),
    }
    if plan.selections:  # absent otherwise: manifests of releases without a selection keep their bytes
        section["selections"] = [selection_record(s, version) for s in plan.selections]
    return section


SELECTION_SCORE = ("L1 distance between the pair's bounded counts and the product of the noisy 1-way tables "
                   "made nonnegative and scaled to the unit's noisy total, rounded to integers per cell")
NOISE_PENALTY = (", less round(sqrt(2/pi) * sigma * cells), AIM's Gaussian approximation of the expected L1 error "
                 "of measuring the pair (sigma: the pair tables' noise standard deviation; a public constant per pair)")


WORKLOAD_VERSION = 4
"""The first manifest version that can hold a workload (4 came with the noise penalty; no earlier dprelease
scored a workload, so a manifest claiming an earlier version with one is refused by verify)."""
WORKLOAD_WEIGHT = (", times the pair's workload weight, AIM's sum over the spec's workload of each marginal's "
                   "weight times the attributes the pair shares with it, divided by their greatest common divisor "
                   "(public; the score sensitivity is the unweighted one times the largest weight)")


AIM_VERSION = 5
"""The first manifest version that can hold a `select: aim` selection."""
AIM_SCORE = ("L1 distance between the candidate's bounded counts and the model's estimate of its table: the table "
             "of its separator (the attributes it shares with the tables chosen before it) fitted from the "
             "released measurements so far as the junction path fits them (the unit total times the attribute's "
             "noisy 1-way distribution in the first round), times the new attribute's noisy 1-way distribution "
             "made nonnegative, rounded to integers per cell; less round(sqrt(2/pi) * sigma * cells), AIM's Gaussian "
             "approximation of the expected L1 error of measuring it (sigma: the chosen tables' noise standard "
             "deviation; a public constant per candidate)")
AIM_CANDIDATES = ("every pair of attributes in the first round; afterwards every table of one attribute no chosen "
                  "table holds and a separator of 1 to `degree` attributes inside one chosen table")
AIM_WEIGHT = (", times the candidate's workload weight, AIM's sum over the spec's workload of each marginal's "
              "weight times the attributes the candidate shares with it: the sum of its attributes' weights "
              "listed here (public; the score sensitivity is the unweighted one times the largest weight a "
              "candidate can have, the sum of the degree + 1 largest)")


def selection_record(selection: SelectionPlan, version: int = MANIFEST_VERSION) -> dict:
    """A `select: mst` or `aim` query's selection as the manifest states it: the rounds, each round's epsilon
    (and what it is accounted as), the score and its sensitivity, the candidates, the tables chosen in order
    (null in a plan made before the data was read) and the mechanism every chosen table got, and with a
    workload the weights. The score of a manifest before version 4 had no noise penalty."""
    if selection.method == "aim":
        return _aim_record(selection)
    record = {
        "name": selection.name, "query": selection.query, "method": "mst",
        "score": SELECTION_SCORE + (NOISE_PENALTY if version >= 4 else ""),
        "rounds": selection.rounds, "candidates": len(selection.candidates),
        **measurement_record(selection.event),
        "chosen": None if selection.chosen is None else [list(pair) for pair in selection.chosen],
        "pair_tables": measurement_record(selection.pair_event),
    }
    if selection.weights is not None:  # absent without a workload: those manifests keep their bytes
        record["score"] += WORKLOAD_WEIGHT
        record["workload_weights"] = [{"pair": list(pair), "weight": weight}
                                      for pair, weight in zip(selection.candidates, selection.weights)]
    return record


AIM_MODEL_SCORE = ("L1 distance between the candidate's bounded counts and the model's estimate of its table: the "
                   "graphical model of every table released so far (the 1-way tables and the tables chosen in "
                   "earlier rounds, weighted by their public noise variances), its junction tree fitted by "
                   "200 iterations of entropic mirror descent warm from the round before's model, the candidate's "
                   "table read from it and rounded to integers per cell; less round(sqrt(2/pi) * sigma * cells), "
                   "AIM's Gaussian approximation of the expected L1 error of measuring it (sigma: the chosen tables' "
                   "noise standard deviation; a public constant per candidate)")
AIM_MODEL_CANDIDATES = ("every table of 2 to degree + 1 attributes not chosen yet whose addition keeps the model (the "
                        "junction tree of the 1-way tables, the chosen tables and it) within 65,536 cells per unit "
                        "and 33,554,432 over all units; tables among attributes the model holds close cycles; a "
                        "round left without a candidate ends the selection, the rounds left unused still accounted")


AIM_SIGMA = "the chosen tables' noise standard deviation; a public constant per candidate"
AIM_ROUND_SIGMA = "the noise standard deviation the round's budget units give its chosen table; public"
AIM_READ_RULE = ("; from version 9 also only tables the model of the tables chosen before it reads with arrays of at "
                 "most 4,194,304 cells per unit and 67,108,864 over all units (a carried table: a separator with the "
                 "attributes it lacks)")
AIM_ANNEALING = ("`rounds` is the selection's budget in units of one equal round (the mechanism above is one unit's "
                 "draw, `chosen_tables` one unit's measurement); round 1 spends 1 unit; a round spends the units of "
                 "the round before, times {growth} when the model's table of the table chosen the round before moved "
                 "by at most sqrt(2/pi) * sigma * cells (its L1 change once measured; AIM's annealing), and every unit "
                 "left when fewer than twice that would be left; a round of u units draws with the exponential "
                 "mechanism calibrated to u units of the selection's share and measures its table with u units of the "
                 "chosen tables' share (each chosen table's mechanism in `tables`); the rounds end when the units are "
                 "spent or no candidate is left (`unused_units` still accounted). `units`: each chosen table's "
                 "round's units, in order")


def _aim_record(selection: SelectionPlan) -> dict:
    """A `select: aim` selection as the manifest states it (version 5 on; over a capped model, version 8 on)."""
    record = {
        "name": selection.name, "query": selection.query, "method": "aim", "degree": selection.degree,
        "score": (AIM_MODEL_SCORE.replace(AIM_SIGMA, AIM_ROUND_SIGMA) if selection.annealing else AIM_MODEL_SCORE)
        if selection.cycles else AIM_SCORE,
        "candidates_rule": (AIM_MODEL_CANDIDATES + AIM_READ_RULE if selection.annealing else AIM_MODEL_CANDIDATES)
        if selection.cycles else AIM_CANDIDATES,
        "rounds": selection.rounds, "candidates": len(selection.candidates),
        **measurement_record(selection.event),
        "chosen": None if selection.chosen is None else [list(clique) for clique in selection.chosen],
        "chosen_tables": measurement_record(selection.pair_event),
    }
    if selection.annealing:
        record["annealing"] = AIM_ANNEALING.format(growth=selection.growth)
        record["units"] = None if selection.chosen is None else list(selection.round_units())
        record["unused_units"] = None if selection.chosen is None else selection.unused_rounds
    if selection.attribute_weights is not None:
        record["score"] += AIM_WEIGHT
        record["attribute_weights"] = [{"attribute": a, "weight": w} for a, w in selection.attribute_weights]
    return record


NOISE_VERSION = 2
"""How a key draws noise: samplers, keystream layout, bounding choices, key binding (2: the key bound to
the plan fingerprint). Part of the plan fingerprint, so a dprelease that would draw differently never
re-runs an older release for free."""


def plan_fingerprint(plan: Plan) -> str:
    """SHA-256 of everything that decides which noise lands on which cell and how much: the spec's hash,
    the contents of every geography domain file (the cells' order), the calibrated accounting (tables,
    dimensions, sensitivities, mechanisms) and the noise version. The release key is bound to it and the
    ledger records it: a free re-run must reproduce all of it, or the same noise would land on other cells
    or with another scale (publishing differences of true counts)."""
    from dprelease.transforms.domains import GeographyDomain

    domains = {name: hashlib.sha256("\n".join(d.leaves).encode()).hexdigest()
               for name, d in sorted(plan.domains.items()) if isinstance(d, GeographyDomain)}
    document = {"spec": plan.spec.spec_hash(), "domains": domains, "accounting": accounting_section(plan),
                "noise_version": NOISE_VERSION}
    return hashlib.sha256(json.dumps(document, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def selection_fingerprint(plan: Plan) -> str:
    """SHA-256 of what a plan's selections chose (each query's tables, in the order chosen): recorded in the
    ledger by a release's first run and demanded of a free re-run (`accounting.ledger.check_selection`)."""
    document = [[s.query, [list(c) for c in s.chosen or ()]] + ([list(s.units or ())] if s.annealing else [])
                for s in plan.selections]
    return hashlib.sha256(json.dumps(document, separators=(",", ":")).encode()).hexdigest()


def privacy_section(plan: Plan) -> dict:
    """The manifest's privacy block: unit, neighbouring relation, declared budget, bounds, policies."""
    spec = plan.spec
    return {
        "unit": spec.privacy_unit or "record",
        "neighbouring": spec.neighbouring,
        "neighbouring_note": NEIGHBOURING_NOTE[spec.neighbouring],
        "definition": spec.budget.definition,
        "declared_budget": spec.budget.model_dump(mode="json"),
        "contribution_bounds": {"max_records_per_unit": plan.bounds.max_records_per_unit},
        "invalid_value_policy": {name: c.on_invalid for name, c in spec.columns.items()},
    }


def domain_file_name(column: str) -> str:
    """Where a geography column's domain is published inside a release (column names are restricted by
    the spec to file-name-safe characters)."""
    return f"domains/{column}.txt"


def domain_file_names(plan: Plan) -> dict[str, str]:
    """Where each geography domain is published inside the release (public: the spec's domain files)."""
    from dprelease.transforms.domains import GeographyDomain

    return {name: domain_file_name(name) for name, domain in plan.domains.items() if isinstance(domain, GeographyDomain)}


def derived_section(plan: Plan, version: int = MANIFEST_VERSION, estimate: EstimateVariances | None = None,
                    layout=None, summaries: dict | None = None) -> dict:
    """Every manifest field that follows from the spec and its plan alone; `verify` recomputes all of it
    (for a manifest of `version`). `estimate`: the plan's GLS variances when the caller has them (or their
    `summaries` alone, from a distributed run)."""
    spec = plan.spec
    if version < 2:
        estimate, summaries = None, None
    elif estimate is None:
        estimate = estimate_variances(plan)
    return {
        "manifest_version": version,
        "release_id": spec.release_id,
        "dataset_id": spec.dataset_id,
        "spec": spec.model_dump(mode="json"),
        "spec_sha256": spec.spec_hash(),
        "privacy": privacy_section(plan),
        **accounting_section(plan, estimate, layout, summaries, version),
        "invariants": [{"table": t.name, "protected": False, "note": invariant_note(version)}
                       for t in plan.tables if t.invariant],
        "post_processing": steps_applied(plan, version),
        **means_section(plan),
        **local_section(plan),
        "domain_files": domain_file_names(plan),
    }


INVARIANT_NOTE = ("true counts published exactly, without protection; the guarantee covers neighbours that replace "
                  "one unit by another whose records fall in the same cells of every invariant table (neighbours "
                  "that change an invariant are not covered)")
LEGACY_INVARIANT_NOTE = "true counts published exactly; the guarantee holds conditional on them"


def invariant_note(version: int) -> str:
    """What an invariant's manifest entry says (the text of version 1 and 2 manifests, or the current one)."""
    return LEGACY_INVARIANT_NOTE if version < 3 else INVARIANT_NOTE


DESCRIPTIVE_FIELDS = ("software.version", "engine", "provenance", "layout")
"""Manifest fields that describe how a release was made and are not verified (the same release bytes
come from every engine and version); every other field is recomputed or checked by `verify`. `layout`
is a run option: verify takes it (within bounds) to know which parts the tables are in, so a value that
gives other parts than the files is caught by the file checks, and one that gives the same parts says
the same thing."""


def build_manifest(plan: Plan, engine: str, key_id: str, files: list[dict], created_at: str,
                   invocation: dict, ledger: dict | None = None, input_validation: dict | None = None,
                   estimate: EstimateVariances | None = None, layout=None, summaries: dict | None = None) -> dict:
    """The manifest. `invocation`: the entry point and its allow-listed options (`provenance.Invocation`)."""
    from .layout import Layout

    return {
        **derived_section(plan, estimate=estimate, layout=layout, summaries=summaries),
        "layout": (layout or Layout()).record(),
        "software": {"name": "dprelease", "version": software_version()},
        "engine": engine,
        "ledger": ledger,
        "input_validation": input_validation,
        "key_id": key_id,
        "files": files,
        "provenance": {
            "git_commit": _git_commit(),
            "versions": _versions(),
            "invocation": invocation,
            "created_at": created_at,
        },
    }


def dump_manifest(manifest: dict) -> bytes:
    """Strict JSON only: a NaN or infinity anywhere is a bug upstream (the plan refuses such budgets)."""
    return (json.dumps(manifest, indent=2, sort_keys=True, allow_nan=False) + "\n").encode("utf-8")
