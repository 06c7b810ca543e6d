"""The report's figures: matplotlib drawn to inline SVG (no scripts, no network: the page stays self-contained).

Every figure is post-processing of public files only: the published values of a verified release and the
error its manifest states per cell.
"""
from __future__ import annotations

import io
import re

import numpy as np

WIDTH = 9.0
"""Inches; about 860 px at the page's 96 dpi."""
MAX_POINTS = 20_000
"""Cells drawn in the error-against-size figure (an even sample of larger releases, seeded: the page is
reproducible)."""


def _pyplot():
    import matplotlib

    matplotlib.use("svg", force=True)
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "font.size": 10, "axes.spines.top": False,
                         "axes.spines.right": False})
    return plt


def svg(figure) -> str:
    """A figure as an inline <svg> element (the XML prologue and fixed sizes dropped, so it scales to the page)."""
    plt = _pyplot()
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", bbox_inches="tight", dpi=110)
    plt.close(figure)
    text = buffer.getvalue()
    text = text[text.index("<svg"):]
    text = re.sub(r"<metadata>.*?</metadata>", "", text, flags=re.S)  # RDF about the drawing: not needed
    return re.sub(r'<svg([^>]*?) width="[^"]*" height="[^"]*"', r'<svg\1 style="max-width:100%;height:auto"',
                  text, count=1)


def error_against_size(groups: dict[str, tuple[np.ndarray, np.ndarray]]) -> str:
    """Per query, each count cell's 95% margin against its published value (log-log), with the ±10% line:
    cells below it are known to within 10%."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(WIDTH, 4.2))
    total = sum(v.size for v, _ in groups.values())
    rng = np.random.default_rng(0)
    for name, (values, margins) in groups.items():
        keep = np.arange(values.size)
        if total > MAX_POINTS:
            keep = np.sort(rng.choice(values.size, max(1, values.size * MAX_POINTS // total), replace=False))
        axes.scatter(np.maximum(values[keep], 0) + 1, margins[keep] + 1e-3, s=6, alpha=0.5, label=name,
                     rasterized=True)  # the points as one embedded image: a small page whatever the cells
    top = max((float(np.max(v)) for v, _ in groups.values() if v.size), default=10.0) + 1
    line = np.geomspace(1, max(top, 10.0), 50)
    axes.plot(line, 0.1 * line, "k--", linewidth=1, label="±10% of the value")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("published value of the cell (+1)")
    axes.set_ylabel("95% margin of error")
    axes.legend(fontsize=8, loc="upper left", frameon=False, ncol=2)
    return svg(figure)


def values_with_intervals(tables: list[tuple[str, list[str], np.ndarray, np.ndarray]]) -> str:
    """Small tables' published values (dots) with their 95% intervals (bars), one panel per table, each on its
    own scale so that the intervals are visible."""
    plt = _pyplot()
    rows = sum(len(labels) for _, labels, _, _ in tables)
    figure, panels = plt.subplots(len(tables), 1, figsize=(WIDTH, 0.9 + 0.22 * rows + 0.5 * len(tables)),
                                  squeeze=False, gridspec_kw={"height_ratios": [max(len(t[1]), 1) for t in tables]})
    for axes, (name, labels, values, margins) in zip(panels[:, 0], tables):
        y = np.arange(len(labels))[::-1]
        axes.errorbar(values, y, xerr=margins, fmt="o", markersize=3, color="#3b6ea5", ecolor="#b35c00",
                      elinewidth=1.5, capsize=2)
        axes.set_yticks(y, [label[:28] for label in labels], fontsize=8)
        axes.set_title(name, fontsize=9, loc="left")
        axes.ticklabel_format(axis="x", style="plain", useOffset=False)
        axes.grid(axis="x", alpha=0.3)
    figure.tight_layout()
    return svg(figure)


def error_by_level(levels: list[tuple[str, float, float]]) -> str:
    """Per geography level: the median 95% margin of a cell, absolute and as a share of the median value."""
    plt = _pyplot()
    figure, (absolute, relative) = plt.subplots(1, 2, figsize=(WIDTH, 2.8))
    names = [name for name, _, _ in levels]
    absolute.barh(names[::-1], [m for _, m, _ in levels][::-1], color="#3b6ea5")
    absolute.set_xlabel("median 95% margin per cell")
    relative.barh(names[::-1], [100 * r for _, _, r in levels][::-1], color="#b35c00")
    relative.set_xlabel("median margin, % of the cell's value")
    figure.tight_layout()
    return svg(figure)
