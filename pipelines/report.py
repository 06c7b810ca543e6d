"""`dprelease report DIR`: a self-contained HTML page for auditors (no scripts, no network).

Built from the manifest after `verify` has re-checked it: the verification result, the budget
split (an inline SVG chart), each table's expected error (standard deviation and 95% margin, drawn
as error bars, one scale per kind of value), the loss per attribute and geography level, the published
values of small tables with their 95% intervals (read from the verified files), the post-processing steps,
the invariants (unprotected), the ledger (the manifest's block, and the dataset's history when a ledger is
given), the signature status and the file hashes.
Written beside the release directory, never inside it (the release stays exactly as published).
"""
from __future__ import annotations

import json
import math
from html import escape
from pathlib import Path

import numpy as np

from .verify import VerifyReport, verify_release

STYLE = """
body{font-family:system-ui,sans-serif;margin:2rem;max-width:72rem;color:#1b1b1b}
h1{margin-bottom:.2rem} h2{margin-top:2rem;border-bottom:1px solid #ccc}
table{border-collapse:collapse;width:100%;font-size:.9rem} td,th{border:1px solid #ddd;padding:.25rem .5rem;text-align:left}
th{background:#f3f3f3} .ok{color:#0a6b2d;font-weight:bold} .bad{color:#b00020;font-weight:bold}
code{font-size:.8rem;overflow-wrap:anywhere} .num{text-align:right;font-variant-numeric:tabular-nums}
td{overflow-wrap:anywhere}
"""


def _rows(headers: list[str], rows: list[list[str]], numeric: set[int] = frozenset()) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f'<td class="{"num" if i in numeric else ""}">{cell}</td>'
                                    for i, cell in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _budget_chart(tables: list[dict]) -> str:
    measured = [t for t in tables if t.get("allocated")]
    total = sum(t["allocated"]["decimal"] for t in measured) or 1.0
    width, bar, gap = 640, 18, 6
    height = len(measured) * (bar + gap) + 10
    parts = [f'<svg role="img" aria-label="budget split" width="{width + 320}" height="{height}" '
             f'xmlns="http://www.w3.org/2000/svg">']
    for i, t in enumerate(measured):
        share = t["allocated"]["decimal"] / total
        y = 5 + i * (bar + gap)
        parts.append(f'<text x="0" y="{y + 13}" font-size="12">{escape(t["name"])}</text>')
        parts.append(f'<rect x="260" y="{y}" width="{max(share * width, 1):.1f}" height="{bar}" fill="#3b6ea5"/>')
        parts.append(f'<text x="{266 + share * width:.1f}" y="{y + 13}" font-size="12">'
                     f'{escape(t["allocated"]["fraction"])} ({share:.1%})</text>')
    parts.append("</svg>")
    return "".join(parts)


def _error_bar(margin: int, scale: float) -> str:
    half = margin * scale
    return (f'<svg width="220" height="16" xmlns="http://www.w3.org/2000/svg"><line x1="{110 - half:.1f}" y1="8" '
            f'x2="{110 + half:.1f}" y2="8" stroke="#b35c00" stroke-width="2"/><line x1="110" y1="2" x2="110" y2="14" '
            f'stroke="#1b1b1b"/></svg>')


def _bar_scales(tables: list[dict]) -> dict[str, float]:
    """Pixels per unit of each table's error bar: one scale per kind of value (counts of units together; each
    measured column's sums, means and counts together), so a sum's margin never flattens the counts' bars."""
    largest: dict[str, float] = {}
    for t in tables:
        margin = (t.get("expected_error") or {}).get("margin_95")
        if margin:
            group = _bar_group(t)
            largest[group] = max(largest.get(group, 0), margin)
    return {group: 100 / value for group, value in largest.items() if value > 0}


def _bar_group(table: dict) -> str:
    measure = table.get("measure")
    return f"{table.get('statistic')} of {measure['column']}" if measure else "counts"


def _words(key: str) -> str:
    return key.replace("_", " ").capitalize()


def _plain(value) -> str:
    """A manifest value as a reader expects it: yes/no, a dash for nothing, JSON for nested values."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return str(value)


def _record_rows(record: dict) -> str:
    """A flat manifest block (ledger, input validation) as a two-column table of readable keys and values."""
    return _rows(["", ""], [[escape(_words(k)), escape(_plain(v))] for k, v in record.items()])


def _loss_rows(implied: dict, unit: str) -> str:
    """The loss each attribute and each geography level carries (the manifest's implied_loss)."""
    rows = []
    for section, label in (("by_attribute", "attribute"), ("by_geography_level", "geography level")):
        for name, loss in (implied.get(section) or {}).items():
            amount = loss.get(unit) or {}
            rows.append([escape(label), escape(name), escape(str(amount.get("fraction", "-"))),
                         f"{loss['epsilon_at_delta']:.4f}" if loss.get("epsilon_at_delta") is not None else "-"])
    if not rows:
        return "<p>Not recorded in this manifest.</p>"
    return _rows(["of", "name", unit, "epsilon at the release's delta"], rows, {2, 3})


PLOTTED_CELLS = 60
"""Tables of at most this many cells get a plot of their published values with 95% intervals."""


def _mean_rows(manifest: dict) -> list[list[str]]:
    """A row per mean: its error at n records from its sum's and count's noise (no budget of its own)."""
    by_name = {t["name"]: t for t in manifest.get("tables", [])}
    rows = []
    for mean in manifest.get("means") or []:
        total, count = by_name.get(mean.get("sum_table")), by_name.get(mean.get("count_table"))
        if not total or not count:
            continue
        largest = max(abs(float(b)) for b in mean["measure"]["clamp"])
        numerator = math.sqrt(total["expected_error"]["variance"] + largest ** 2 * count["expected_error"]["variance"])
        rows.append([escape(mean["table"]), f"{total['cells']:,}",
                     f"ratio {escape(mean['sum_table'])} / {escape(mean['count_table'])} (no budget of its own)",
                     f"≤ {numerator:,.1f} / n", f"≤ ±{1.96 * numerator:,.1f} / n", "-", ""])
    return rows


def _coding_check(report: VerifyReport) -> str:
    """Dimensions whose (other) cells hold a large share of a published count table (public files only)."""
    from .coding_check import OTHER_SHARE_LIMIT, other_shares

    if not report.ok:
        return "<p>Not run: the release did not verify.</p>"
    found = other_shares(report.release_dir, report.manifest)
    if not found:
        return (f"<p>No column or geography level has more than {OTHER_SHARE_LIMIT:.0%} of a published count "
                "table's total in its (other) cells.</p>")
    return '<ul class="bad">' + "".join(f"<li>{escape(share.message())}</li>" for share in found) + "</ul>"


def _value_plots(report: VerifyReport) -> str:
    """Per small table (count, sum), its published values with their 95% intervals (counts: 1.96 x the GLS std of
    the cell; sums: the noise's 95% margin), read from the verified release's own files (public)."""
    from .error_columns import with_error_columns

    if not report.ok:
        return "<p>Not drawn: the release did not verify.</p>"
    manifest = report.manifest
    plots = []
    for t in manifest.get("tables", []):
        if t["cells"] > PLOTTED_CELLS or t.get("invariant") or t["mechanism"]["kind"] == "exponential":
            continue
        frame = with_error_columns(report.release_dir, manifest, t["name"])
        value = "count" if "count" in frame.columns else "sum"
        if value not in frame.columns:
            continue
        labels = frame.columns[:list(frame.columns).index(value)]
        half = 1.96 * frame["std"] if "gls_variance" in frame.columns else frame.get("margin_95", 0 * frame[value])
        plots.append(f"<h3>{escape(t['name'])}</h3>" + _dot_plot(
            [" ".join(str(v) for v in row) for row in frame[list(labels)].itertuples(index=False)],
            frame[value].to_numpy(float), np.asarray(half, dtype=float)))
    return "".join(plots) or f"<p>No table has at most {PLOTTED_CELLS} cells.</p>"


def _dot_plot(labels: list[str], values, half) -> str:
    width, row = 420, 16
    high = float(max(np.max(values + half), 1.0)) if len(values) else 1.0
    low = float(min(np.min(values - half), 0.0)) if len(values) else 0.0
    scale = width / (high - low)
    parts = [f'<svg role="img" aria-label="values with 95% intervals" width="{width + 330}" '
             f'height="{len(values) * row + 8}" xmlns="http://www.w3.org/2000/svg">']
    for i, (label, v, h) in enumerate(zip(labels, values, half)):
        y = 4 + i * row + row / 2
        x0, x1, x = (200 + (a - low) * scale for a in (v - h, v + h, v))
        parts.append(f'<text x="0" y="{y + 4:.1f}" font-size="11">{escape(label[:32])}</text>'
                     f'<line x1="{x0:.1f}" y1="{y:.1f}" x2="{x1:.1f}" y2="{y:.1f}" stroke="#b35c00" stroke-width="2"/>'
                     f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="#3b6ea5"/>'
                     f'<text x="{210 + width:.1f}" y="{y + 4:.1f}" font-size="11">{v:,.0f} ± {h:,.1f}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _conforms(manifest: dict | None) -> bool:
    """Whether the manifest has the published schema's shape (only then are its sections drawn)."""
    from pydantic import ValidationError

    from dprelease.accounting.manifest_model import Manifest

    try:
        Manifest.model_validate(manifest)
    except ValidationError:
        return False
    return True


def _problems_page(report: VerifyReport) -> str:
    """A malformed manifest: the page lists what verify found, and draws nothing from the manifest."""
    items = "".join(f"<li>{escape(p)}</li>" for p in report.problems)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>dprelease report: malformed '
            f"manifest</title><style>{STYLE}</style></head><body><h1>{escape(str(report.release_dir.name))}</h1>"
            f'<p class="bad">MISMATCH: the manifest does not have the published schema\'s shape:</p>'
            f"<ul>{items}</ul></body></html>\n")


def _measure_text(table: dict) -> str:
    """'sum of income clamped to [0, 500000]; ' for a measure table, '' otherwise (escaped)."""
    measure = table.get("measure")
    if not measure:
        return escape(f"{table['statistic']}; ") if table.get("statistic") else ""
    low, high = measure["clamp"]
    return escape(f"{table['statistic']} of {measure['column']} clamped to [{low}, {high}]; ")


def _candidates_text(candidates: list) -> str:
    shown = ", ".join(str(c) for c in candidates[:8])
    return f"{shown}, ... ({len(candidates)})" if len(candidates) > 8 else shown


def _estimate_text(estimate: dict | None) -> str:
    """A count table's GLS standard deviation range (version-2 manifests), else '-'."""
    if not estimate:
        return "-"
    low, high = math.sqrt(estimate["variance_min"]), math.sqrt(estimate["variance_max"])
    span = f"{low:.3f}" if f"{low:.3f}" == f"{high:.3f}" else f"{low:.3f}–{high:.3f}"
    return span + (" (upper bound)" if estimate["bound"] != "exact" else "")


def render(report: VerifyReport, ledger_history: list | None = None) -> str:
    if not _conforms(report.manifest):
        return _problems_page(report)
    manifest = report.manifest
    tables = manifest.get("tables", [])
    scales = _bar_scales(tables)
    status = ('<p class="ok">Verified: every file hash, allocation, mechanism and total matches.</p>' if report.ok
              else '<p class="bad">MISMATCH:</p><ul>' + "".join(f"<li>{escape(p)}</li>" for p in report.problems) + "</ul>")
    totals = manifest.get("totals", {})
    total_text = (f"epsilon = {escape(totals['epsilon']['fraction'])}" if totals.get("epsilon")
                  else f"rho = {escape(totals.get('rho', {}).get('fraction', '?'))}, i.e. "
                       f"({totals.get('epsilon_at_delta', 0):.4f}, {totals.get('delta')})-DP")
    error_rows = []
    for t in tables:
        if t.get("invariant"):
            error_rows.append([escape(t["name"]), f"{t['cells']:,}", "exact (invariant)", "0", "0", "-", ""])
            continue
        mechanism = t["mechanism"]
        measured = _measure_text(t)
        if mechanism["kind"] == "exponential":
            error_rows.append([escape(t["name"]), f"{t['cells']:,} x {len(t['quantile']['q'])} q",
                               f"{measured}exponential mechanism, epsilon={escape(mechanism['value']['fraction'])} per "
                               f"selection; q {escape(', '.join(t['quantile']['q']))}; candidates "
                               f"{escape(_candidates_text(t['quantile']['candidates']))}",
                               "-", f"±{t['expected_error']['rank_margin_95']} ranks", "-", ""])
            continue
        error_rows.append([escape(t["name"]), f"{t['cells']:,}",
                           f"{measured}{escape(mechanism['kind'])} {escape(mechanism['parameter'])}={escape(mechanism['value']['fraction'])}",
                           f"{t['expected_error']['std']:.3f}", f"±{t['expected_error']['margin_95']}",
                           _estimate_text(t.get("estimate")),
                           _error_bar(t["expected_error"]["margin_95"], scales.get(_bar_group(t), 1.0))])
    error_rows += _mean_rows(manifest)
    privacy = manifest.get("privacy", {})
    sections = [
        f"<h1>Release {escape(manifest.get('release_id', '?'))}</h1>",
        f"<p>Dataset <b>{escape(manifest.get('dataset_id', '?'))}</b> · engine {escape(str(manifest.get('engine')))} · "
        f"dprelease {escape(str(manifest.get('software', {}).get('version')))} · created "
        f"{escape(str(manifest.get('provenance', {}).get('created_at')))} · key id <code>{escape(str(manifest.get('key_id')))}</code>"
        f" · signature: {escape(report.signature)}</p>",
        status,
        "<h2>Privacy guarantee</h2>",
        f"<p>Privacy unit: <b>{escape(str(privacy.get('unit')))}</b>; {escape(str(privacy.get('neighbouring_note', '')))}. "
        f"Definition {escape(str(privacy.get('definition')))}; total {total_text}; at most "
        f"{escape(str(privacy.get('contribution_bounds', {}).get('max_records_per_unit')))} records per unit.</p>",
        "<h2>Budget split</h2>", _budget_chart(tables),
        "<h2>Privacy loss per attribute and geography level</h2>",
        "<p>What the release reveals about one attribute or one geography level of a unit: the composed loss of the "
        "tables that use it.</p>",
        _loss_rows(manifest.get("implied_loss") or {}, "epsilon" if privacy.get("definition") == "pure" else "rho"),
        "<h2>Expected error per cell</h2>",
        _rows(["table", "cells", "noise", "std dev", "95% margin", "GLS std dev", "error bar"], error_rows, {1, 3, 4, 5}),
        "<p>Error bars: the 95% margin, drawn to one scale per kind of value (" +
        escape(", ".join(sorted(scales))) + "), so bars compare within a kind only.</p>",
        "<p>GLS std dev: the standard deviation of a cell's generalised least-squares estimate from all count "
        "measurements together, before the nonnegative integer step (min–max over the table's cells; per cell in "
        "the table's <code>gls_variance</code> column); an upper bound where marked.</p>",
        "<p>Means: the ratio of a sum and a count table; at n records in a cell the standard deviation is at most "
        "the numerator shown divided by n (delta method: sqrt(Var S + M<sup>2</sup> Var C) / n, M the larger bound "
        "of the clamp); per cell in the API's <code>std_approx</code> column.</p>" if manifest.get("means") else "",
        "<h2>Coding check</h2>", _coding_check(report),
        "<h2>Published values with 95% intervals</h2>",
        "<p>Tables of at most " + str(PLOTTED_CELLS) + " cells: each cell's published value (dot) and its 95% "
        "interval (counts: ±1.96 standard deviations of the least-squares estimate; sums: the noise's margin).</p>",
        _value_plots(report),
        "<h2>Post-processing</h2>",
        "<ol>" + "".join(f"<li><b>{escape(s['query'])}</b>: {escape(s['step'])}</li>"
                          for s in manifest.get("post_processing", [])) + "</ol>",
        "<h2>Invariants (published without protection)</h2>",
        ("<ul>" + "".join(f"<li>{escape(i['table'])}: {escape(i['note'])}</li>" for i in manifest["invariants"]) + "</ul>")
        if manifest.get("invariants") else "<p>None.</p>",
        "<h2>Ledger</h2>",
        _record_rows(manifest["ledger"]) if manifest.get("ledger") else "<p>This release was not run against a ledger.</p>",
    ]
    if ledger_history:
        sections.append(_rows(["release", "period", "key id", "spend", "status", "reserved at"],
                              [[escape(r.release_id), escape(r.period or "-"), f"<code>{escape(r.key_id)}</code>",
                                escape(r.spend), escape(r.status), escape(str(r.reserved_at))]
                               for r in ledger_history]))
    validation = manifest.get("input_validation")
    sections += ["<h2>Input validation</h2>",
                 _record_rows(validation) if validation else "<p>The input was not validated with an expectation suite.</p>"]
    sections += ["<h2>Files</h2>",
                 _rows(["path", "bytes", "SHA-256"], [[escape(f["path"]), f"{f['bytes']:,}", f"<code>{escape(f['sha256'])}</code>"]
                                                      for f in manifest.get("files", [])], {1})]
    title = escape(f"dprelease report: {manifest.get('release_id', '?')}")
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
            f"<style>{STYLE}</style></head><body>{''.join(sections)}</body></html>\n")


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
