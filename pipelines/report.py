"""`dprelease report DIR`: a self-contained HTML page (no scripts, no network), for a director first and an
auditor after.

The first screen says what was published (tables, cells, geography levels), the guarantee in one sentence (ε to
three significant figures, the exact fraction on hover and in the manifest), each query's typical error as a
share of its typical value and the share of its cells known to within ±10%, which tables are too noisy to use,
and which checks ran (plain verify shows the release agrees with itself; `--recompute` that its tables are the
post-processing of its measurements; `--ledger` that it was charged; `--public-key` the signature). Figures
(matplotlib, inline SVG: `report_figures`) show error against cell size, small tables' values with their 95%
intervals on a readable scale, and error by geography level. The auditor's sections follow: the budget per
query (identical tables grouped), noise and expected error, the loss per attribute and level (with the worst
case over selections), post-processing, invariants, ledger, validation, coding check and file hashes.

The page is a Jinja2 template with autoescaping: every text from a manifest or a table is escaped; only the
figures' SVG (drawn here) is inserted as markup. Everything on it is post-processing of the verified release's
public files. Written beside the release directory, never inside it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup

from . import report_figures
from .verify import VerifyReport, verify_release

READ_CELLS = 5_000_000
"""Published cells read for the summary and figures (in table order); a larger release is summarised from its
first tables and says so (the manifest's expected errors cover every table)."""
SMALL_TABLE = 30
"""Tables of at most this many cells are drawn with their values and intervals (the first few of them)."""
SMALL_TABLES_DRAWN = 4
PRECISE = 0.10
"""A cell is known precisely when its 95% margin is within this share of its value."""
TOO_NOISY = 0.5
"""A table is too noisy to use when its typical (median) nonzero cell's 95% margin exceeds this share of its
value."""


def _environment() -> Environment:
    environment = Environment(loader=PackageLoader("dprelease.pipelines", "templates"),
                              autoescape=select_autoescape(["html", "j2"]), trim_blocks=True, lstrip_blocks=True)
    environment.filters["figure"] = _decimal
    return environment


def _decimal(value, digits: int = 3) -> str:
    """A number for people: three significant figures, grouped thousands, no exponent below a million."""
    if value is None:
        return "–"
    number = float(value)
    if number == 0:
        return "0"
    if abs(number) >= 1000:
        return f"{number:,.0f}"
    return f"{number:#.{digits}g}".rstrip(".") if abs(number) >= 10 ** (digits - 1) else f"{number:#.{digits}g}"


@dataclass
class TableSummary:
    """One published table's values, read from its files, and what they say about its error."""

    name: str
    query: str
    cells: int
    values: np.ndarray
    margins: np.ndarray
    labels: list[str]

    @property
    def nonzero(self) -> np.ndarray:
        return self.values > 0

    @property
    def typical_value(self) -> float:
        """The median value of the cells above zero (0 when there are none)."""
        mine = self.nonzero
        return float(np.median(self.values[mine])) if mine.any() else 0.0

    @property
    def typical_margin(self) -> float:
        return float(np.median(self.margins)) if self.margins.size else 0.0

    @property
    def relative(self) -> float:
        """The typical nonzero cell's 95% margin as a share of its value (inf when no cell is above zero)."""
        mine = self.nonzero
        return float(np.median(self.margins[mine] / self.values[mine])) if mine.any() else math.inf

    @property
    def precise_share(self) -> float:
        """The share of cells whose 95% margin is within PRECISE of their value."""
        return float(np.mean(self.margins <= PRECISE * self.values)) if self.values.size else 0.0

    @classmethod
    def combined(cls, query: str, tables: list["TableSummary"]) -> "TableSummary":
        """The cells of several tables (a query's) as one summary."""
        return cls(query, query, sum(s.cells for s in tables), np.concatenate([s.values for s in tables]),
                   np.concatenate([s.margins for s in tables]), [])


@dataclass
class Page:
    """Everything the template shows, computed here (the template only lays it out)."""

    manifest: dict
    report: VerifyReport
    checks: list[dict]
    published: dict
    guarantee: dict
    groups: list[dict]
    noisy: list[str]
    figures: dict[str, Markup]
    budget: list[dict]
    errors: list[dict]
    means: list[dict]
    losses: list[dict]
    coding: dict
    history: list | None
    notes: list[str] = field(default_factory=list)


def _checks(report: VerifyReport) -> list[dict]:
    """Which checks ran, what each shows, and which did not run (the banner)."""
    ran_ledger = not report.ledger.startswith("not checked")
    signature = report.signature
    return [
        {"name": "verify", "state": "passed" if report.ok else "failed",
         "says": "the release agrees with itself: every file's hash and size, every allocation, mechanism, "
                 "sensitivity and total re-derived from its spec, every table's structure"},
        {"name": "--recompute", "state": ("passed" if report.ok else "failed") if report.recomputed else "not run",
         "says": "the published tables are the post-processing of the published measurements"},
        {"name": "--ledger", "state": ("passed" if report.ledger.startswith("committed") else "failed")
         if ran_ledger else "not run", "says": "the release is committed in the ledger at the cost it states, "
                                               "with this very manifest"},
        {"name": "--public-key", "state": "passed" if signature.startswith("valid") else
         ("failed" if report.problems and any(p.startswith("signature") for p in report.problems) else "not run"),
         "says": "the manifest is signed by the agency's key"},
    ]


def _summaries(report: VerifyReport) -> tuple[list[TableSummary], list[str]]:
    """The count and sum tables' published values and each cell's 95% margin, read from the verified files."""
    from .error_columns import with_error_columns

    manifest, summaries, notes, read = report.manifest, [], [], 0
    for t in manifest.get("tables", []):
        if t.get("invariant") or t["mechanism"]["kind"] == "exponential" or t.get("statistic") == "units":
            continue
        if read + t["cells"] > READ_CELLS:
            notes.append(f"Tables from {t['name']} on are summarised from the manifest only (over "
                         f"{READ_CELLS:,} cells read).")
            break
        frame = with_error_columns(report.release_dir, manifest, t["name"])
        value = "count" if "count" in frame.columns else "sum" if "sum" in frame.columns else None
        if value is None:
            continue
        labels = list(frame.columns[:list(frame.columns).index(value)])
        if "gls_variance" in frame.columns:
            margins = 1.96 * frame["std"].to_numpy(float)
        else:
            margins = np.full(len(frame), float(t["expected_error"]["margin_95"]))
        text = [" · ".join(str(v) for v in row) for row in frame[labels].itertuples(index=False)] \
            if t["cells"] <= SMALL_TABLE else []
        summaries.append(TableSummary(t["name"], t["query"], t["cells"], frame[value].to_numpy(float), margins, text))
        read += t["cells"]
    return summaries, notes


def _groups(summaries: list[TableSummary], manifest: dict) -> list[dict]:
    """Per query: its tables and cells, the typical value and margin, the share of cells within ±10%, and a word."""
    kinds = {q["name"]: q["kind"] for q in manifest["spec"]["queries"]}
    groups = []
    for query in dict.fromkeys(s.query for s in summaries):
        mine = [s for s in summaries if s.query == query]
        whole = TableSummary.combined(query, mine)
        relative, precise = whole.relative, whole.precise_share
        word = "too noisy to use" if relative > TOO_NOISY else "good" if precise >= 0.5 else "usable with care"
        groups.append({"query": query, "kind": kinds.get(query, ""), "tables": len(mine), "cells": int(whole.cells),
                       "typical_value": whole.typical_value, "typical_margin": whole.typical_margin,
                       "relative": relative, "precise": precise, "word": word})
    return groups


def _published(manifest: dict) -> dict:
    tables = manifest.get("tables", [])
    levels = []
    for t in tables:
        for d in t["dimensions"]:
            if d["level"] and f"{d['column']}.{d['level']}" not in levels:
                levels.append(f"{d['column']}.{d['level']}")
    return {"tables": len(tables), "cells": sum(t["cells"] for t in tables),
            "queries": len(manifest["spec"]["queries"]), "levels": levels,
            "invariants": [i["table"] for i in manifest.get("invariants") or []]}


def _guarantee(manifest: dict) -> dict:
    """The guarantee in one sentence: ε (and δ) to three significant figures, the exact terms on hover."""
    privacy, totals = manifest["privacy"], manifest["totals"]
    unit = "each record" if privacy["unit"] == "record" else f"each {privacy['unit']} (with all their records)"
    if totals.get("epsilon"):
        terms = f"ε = {_decimal(totals['epsilon']['decimal'])}"
        exact = f"epsilon = {totals['epsilon']['fraction']} (pure DP)"
    else:
        terms = f"ε = {_decimal(totals['epsilon_at_delta'])}, δ = {totals['delta']:g}"
        exact = f"rho = {totals['rho']['fraction']} (zCDP), converted to (epsilon, delta) = " \
                f"({totals['epsilon_at_delta']}, {totals['delta']})"
    return {"unit": unit, "terms": terms, "exact": exact, "note": privacy["neighbouring_note"]}


def _figures(summaries: list[TableSummary], manifest: dict) -> dict[str, Markup]:
    figures = {}
    statistics = {t["name"]: t.get("statistic", "count") for t in manifest.get("tables", [])}
    counts = [s for s in summaries if s.values.size and statistics.get(s.name) == "count"]
    if counts:
        groups = {}
        for query in dict.fromkeys(s.query for s in counts):
            whole = TableSummary.combined(query, [s for s in counts if s.query == query])
            groups[query] = (whole.values, whole.margins)
        figures["error_against_size"] = Markup(report_figures.error_against_size(groups))
    kinds = {q["name"]: q["kind"] for q in manifest["spec"]["queries"]}
    small = sorted((s for s in counts if s.labels), key=lambda s: kinds.get(s.query) != "hierarchy")[:SMALL_TABLES_DRAWN]
    if small:
        figures["small_tables"] = Markup(report_figures.values_with_intervals(
            [(s.name, s.labels, s.values, s.margins) for s in small]))
    levels = _level_errors(summaries, manifest)
    if levels:
        figures["by_level"] = Markup(report_figures.error_by_level(levels))
    return figures


def _level_errors(summaries: list[TableSummary], manifest: dict) -> list[tuple[str, float, float]]:
    """Per geography level of a hierarchy query: the median margin and the median relative margin."""
    kinds = {q["name"]: q["kind"] for q in manifest["spec"]["queries"]}
    found = []
    for s in summaries:
        if kinds.get(s.query) != "hierarchy":
            continue
        found.append((s.name, s.typical_margin, s.relative if s.nonzero.any() else 0.0))
    return found if len(found) > 1 else []


def _grouped_budget(manifest: dict) -> list[dict]:
    """The budget per query: its tables grouped where they got the same share (91 identical rows become one)."""
    tables = [t for t in manifest.get("tables", []) if t.get("allocated")]
    total = sum(t["allocated"]["decimal"] for t in tables) or 1.0
    rows: dict[tuple, dict] = {}
    for t in tables:
        key = (t["query"], t["allocated"]["fraction"])
        row = rows.setdefault(key, {"query": t["query"], "tables": 0, "each": t["allocated"]["decimal"],
                                    "exact": t["allocated"]["fraction"], "names": []})
        row["tables"] += 1
        row["names"].append(t["name"])
    for row in rows.values():
        row["share"] = row["each"] * row["tables"] / total
    for selection in manifest.get("selections") or []:
        rows[(selection["query"], "selection")] = {
            "query": f"{selection['query']} (selection)", "tables": selection["rounds"],
            "each": selection["allocated"]["decimal"] / max(selection["rounds"], 1),
            "exact": selection["allocated"]["fraction"], "names": [f"{selection['rounds']} rounds"],
            "share": selection["allocated"]["decimal"] / total}
    return list(rows.values())


def _grouped_errors(manifest: dict) -> list[dict]:
    """Noise and expected error per table, identical rows (same query, cells, mechanism, error) grouped."""
    rows: dict[tuple, dict] = {}
    for t in manifest.get("tables", []):
        if t.get("invariant"):
            key = (t["name"], "invariant")
            rows[key] = {"names": [t["name"]], "cells": t["cells"], "noise": "exact (invariant: not protected)",
                         "std": 0, "margin": "0", "gls": "–"}
            continue
        mechanism = t["mechanism"]
        if mechanism["kind"] == "exponential":
            noise = f"exponential mechanism, ε = {_decimal(mechanism['value']['decimal'])} per selection"
            key = (t["query"], t["cells"], noise)
            row = rows.setdefault(key, {"names": [], "cells": t["cells"], "noise": noise, "std": None,
                                        "margin": f"±{t['expected_error']['rank_margin_95']} ranks", "gls": "–"})
        else:
            kind = {"discrete_gaussian": "discrete Gaussian, σ² =", "discrete_laplace": "discrete Laplace, b ="}.get(
                mechanism["kind"], f"{mechanism['kind']} {mechanism['parameter']} =")
            noise = f"{kind} {_decimal(mechanism['value']['decimal'])}"
            gls = _estimate_text(t.get("estimate"))
            key = (t["query"], t["cells"], noise, gls)
            row = rows.setdefault(key, {"names": [], "cells": t["cells"], "noise": noise,
                                        "std": t["expected_error"]["std"],
                                        "margin": f"±{t['expected_error']['margin_95']:,}", "gls": gls,
                                        "exact": mechanism["value"]["fraction"]})
        row["names"].append(t["name"])
    return list(rows.values())


def _estimate_text(estimate: dict | None) -> str:
    """A count table's GLS standard deviation range (version-2 manifests on), else a dash."""
    if not estimate:
        return "–"
    low, high = math.sqrt(estimate["variance_min"]), math.sqrt(estimate["variance_max"])
    span = _decimal(low) if _decimal(low) == _decimal(high) else f"{_decimal(low)}–{_decimal(high)}"
    return span + (" (upper bound)" if estimate["bound"] != "exact" else "")


def _means(manifest: dict) -> list[dict]:
    """A row per mean: its error at n records from its sum's and count's noise (no budget of its own)."""
    by_name = {t["name"]: t for t in manifest.get("tables", [])}
    rows = []
    for mean in manifest.get("means") or []:
        total, count = by_name.get(mean.get("sum_table")), by_name.get(mean.get("count_table"))
        if not total or not count:
            continue
        largest = max(abs(float(b)) for b in mean["measure"]["clamp"])
        numerator = math.sqrt(total["expected_error"]["variance"] + largest ** 2 * count["expected_error"]["variance"])
        rows.append({"name": mean["table"], "cells": total["cells"], "sum": mean["sum_table"],
                     "count": mean["count_table"], "std_at_n": numerator, "margin_at_n": 1.96 * numerator})
    return rows


def _losses(manifest: dict) -> list[dict]:
    """The loss each attribute and geography level carries, decimals first, and the worst case over selections."""
    implied = manifest.get("implied_loss") or {}
    unit = "epsilon" if manifest["privacy"]["definition"] == "pure" else "rho"
    worst = implied.get("worst_case_over_selections") or {}
    rows = []
    for section, label in (("by_attribute", "attribute"), ("by_geography_level", "geography level")):
        for name, loss in (implied.get(section) or {}).items():
            bound = (worst.get(section) or {}).get(name)
            rows.append({"of": label, "name": name, "amount": loss[unit]["decimal"], "exact": loss[unit]["fraction"],
                         "epsilon": loss.get("epsilon_at_delta"),
                         "worst": None if bound is None else bound[unit]["decimal"],
                         "worst_epsilon": None if bound is None else bound.get("epsilon_at_delta")})
    return rows


def _coding(report: VerifyReport) -> dict:
    """Dimensions whose (other) cells hold a large share of a published count table (public files only)."""
    from .coding_check import OTHER_SHARE_LIMIT, other_shares

    if not report.ok:
        return {"ran": False, "limit": OTHER_SHARE_LIMIT, "found": []}
    return {"ran": True, "limit": OTHER_SHARE_LIMIT,
            "found": [share.message() for share in other_shares(report.release_dir, report.manifest)]}


def _conforms(manifest: dict | None) -> bool:
    """Whether the manifest has the published schema's shape (only then are its sections drawn)."""
    from pydantic import ValidationError

    from dprelease.accounting.manifest_model import Manifest

    try:
        Manifest.model_validate(manifest)
    except ValidationError:
        return False
    return True


def page_of(report: VerifyReport, ledger_history: list | None = None) -> Page:
    """The page's content for a release whose manifest has the published schema's shape."""
    manifest = report.manifest
    summaries, notes = _summaries(report) if report.ok else ([], ["Not read: the release did not verify."])
    groups = _groups(summaries, manifest)
    noisy = [s.name for s in summaries if s.relative > TOO_NOISY]
    return Page(manifest, report, _checks(report), _published(manifest), _guarantee(manifest), groups, noisy,
                _figures(summaries, manifest), _grouped_budget(manifest), _grouped_errors(manifest), _means(manifest),
                _losses(manifest), _coding(report), ledger_history, notes)


def render(report: VerifyReport, ledger_history: list | None = None) -> str:
    environment = _environment()
    if not _conforms(report.manifest):
        return environment.get_template("malformed.html.j2").render(report=report)
    return environment.get_template("report.html.j2").render(page=page_of(report, ledger_history), inf=math.inf)


def render_report(release_dir: Path, public_key: Path | None = None, ledger: str | None = None,
                  recompute: bool = False, extra_problems: list[str] = ()) -> tuple[bytes, VerifyReport]:
    """The report page of a (local) release directory, verified first (`extra_problems`: mismatches found
    before, e.g. odd object names in its store), and the verify report."""
    report = verify_release(Path(release_dir), public_key, ledger=ledger, recompute=recompute)
    for problem in extra_problems:
        report.problems.append(problem)
    history_rows = None
    if ledger and report.manifest and isinstance(report.manifest.get("dataset_id"), str):
        from dprelease.accounting.ledger import history, open_ledger

        _, history_rows = history(open_ledger(ledger, create=False), report.manifest.get("dataset_id"))
    return render(report, history_rows).encode("utf-8"), report
