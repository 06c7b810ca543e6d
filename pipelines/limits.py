"""How big a release may be: a public cap on cells, checked before any key, budget or data.

The embedded engine holds each table's full public domain in its process (true counts, noise, noisy and
published values), and so do Spark and Beam for a release whose count tables do not form a tree of
geographic units (they post-process on the driver); memory grows with cells, not rows. A spec whose tables
exceed the cap is refused (exit 2) by `plan` and `run` before anything is reserved. Spark and Beam
post-process and write a tree of units in their workers (`pipelines.dataflow`): no cell reaches the
driver, a worker holds one group of units at a time (`--group-work` cells, a unit's block at most
`transforms.units.tree.MAX_BLOCK_CELLS`), and the cap does not apply.
"""
from __future__ import annotations

import json
import os

from dprelease.accounting.errors import SpecError

from .manifest import accounting_section
from .plan import AIM_ROUND_CELLS, MAX_SELECTION_PASSES, Plan, selection_cells, selection_passes

DEFAULT_MAX_CELLS = 20_000_000
MAX_CELLS_ENV = "DPRELEASE_MAX_CELLS"
BYTES_PER_CELL = 200
"""Estimated peak driver memory per public cell: int64 counts, noise, noisy and published vectors,
post-processing work arrays, and the label columns of the Parquet/CSV writers."""
SELECTION_BYTES_PER_CELL = 16
"""Estimated peak memory per cell of a candidate table a selection counts: its int64 counts and the counting's
temporary (candidates are scored a range of cells at a time, never published)."""


def max_cells_setting(value: int | None = None) -> int:
    """The cap in force: `value` (--max-cells), else $DPRELEASE_MAX_CELLS, else DEFAULT_MAX_CELLS."""
    if value is not None:
        return value
    text = os.environ.get(MAX_CELLS_ENV)
    if text is None:
        return DEFAULT_MAX_CELLS
    if not text.isdigit() or int(text) < 1:
        raise SpecError(f"{MAX_CELLS_ENV} = {text!r}: must be a positive integer")
    return int(text)


WORKER_ENGINES = ("spark", "beam")
"""The engines that run the post-processing stages of a tree of units in their workers (`Engine.writes_parts`)."""


def runs_in_workers(plan: Plan, engine: str) -> bool:
    """Whether `engine` post-processes and writes this release in its workers (no cell on the driver)."""
    from .postprocessing import unit_tree

    return engine in WORKER_ENGINES and unit_tree(plan) is not None


def estimated_memory_bytes(plan: Plan) -> int:
    """The cells a run holds at once (a selection's candidate tables too), in bytes."""
    return plan.n_cells * BYTES_PER_CELL + selection_cells(plan) * SELECTION_BYTES_PER_CELL


def weighted_cells(plan: Plan) -> int:
    """The cells the cap counts: the release's own, and a selection's candidate cells at their share of a
    release cell's memory (SELECTION_BYTES_PER_CELL of BYTES_PER_CELL)."""
    return plan.n_cells + -(-selection_cells(plan) * SELECTION_BYTES_PER_CELL // BYTES_PER_CELL)


def human_bytes(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if count < 1024 or unit == "PiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError


def memory_statement(plan: Plan, engine: str, group_work: int) -> str:
    """What a run of this plan holds in memory, where (public: from the plan)."""
    if runs_in_workers(plan, engine):
        return (f"the {engine} workers post-process and write it group by group (about {group_work:,} cells, "
                f"{human_bytes(group_work * BYTES_PER_CELL)} per group at a time); the driver holds no cells")
    where = "driver" if engine in WORKER_ENGINES else "process"
    chosen = sum(s.rounds for s in plan.selections if s.chosen is None)
    candidates = f" (and the {selection_cells(plan):,} candidate cells it counts at once to choose up to {chosen} tables, " \
                 f"in at most {selection_passes(plan):,} passes over the input)" if chosen else ""
    return f"a run needs about {human_bytes(estimated_memory_bytes(plan))} of {where} memory for them{candidates}"


def check_plan_limits(plan: Plan, max_cells: int | None = None, engine: str = "embedded") -> None:
    """Everything about a plan's size and numbers that must hold before a run may reserve budget."""
    check_representable(plan)
    check_selection_passes(plan)
    if plan.selections or not runs_in_workers(plan, engine):  # conservative for a selection: its candidates' cells are capped too
        check_cell_limit(plan, max_cells)


def check_selection_passes(plan: Plan) -> None:
    """Refuse (SpecError, exit 2) selections that could read the input more than MAX_SELECTION_PASSES times."""
    passes = selection_passes(plan)
    if passes > MAX_SELECTION_PASSES:
        names = [s.query for s in plan.selections if s.chosen is None]
        raise SpecError(f"queries {names}: choosing their tables could take up to {passes:,} passes over the input "
                        f"(each round counts its candidate tables, at most {AIM_ROUND_CELLS:,} cells a pass), over the limit "
                        f"of {MAX_SELECTION_PASSES}; coarsen the attributes (bins), list fewer, or use degree: 1")


def check_representable(plan: Plan) -> None:
    """Refuse (SpecError) a plan whose accounting holds a number strict JSON cannot carry (inf, NaN)."""
    try:
        json.dumps(accounting_section(plan), allow_nan=False)
    except ValueError:
        raise SpecError("budget: the plan's accounting (losses, noise scales, expected errors) is not finite "
                        "for this budget; choose a smaller epsilon/rho or a larger delta") from None


def check_cell_limit(plan: Plan, max_cells: int | None = None) -> None:
    """Refuse (SpecError, exit 2) a release whose tables together exceed the cell cap."""
    limit = max_cells_setting(max_cells)
    total = weighted_cells(plan)
    if total <= limit:
        return
    if plan.selections and plan.n_cells <= limit:
        raise SpecError(f"queries: choosing the tables of `select: mst` or `aim` counts candidate tables: "
                        f"{selection_cells(plan):,} candidate cells at once, as much memory as {total - plan.n_cells:,} "
                        f"release cells; with the release's own {plan.n_cells:,}, over the limit of {limit:,} "
                        f"(--max-cells or ${MAX_CELLS_ENV}); coarsen the attributes (bins) or list fewer")
    largest = max(plan.tables, key=lambda t: t.layout.n_measured)
    entries = (f"{largest.n_cells:,} cells x {largest.layout.buckets} quantile buckets" if largest.layout.buckets > 1
               else f"{largest.n_cells:,} cells")
    raise SpecError(
        f"queries: the release has {total:,} public cells (largest table {largest.name!r}: {entries}), over "
        f"the limit of {limit:,} (--max-cells or ${MAX_CELLS_ENV}); a run needs about "
        f"{human_bytes(estimated_memory_bytes(plan))} of memory on one machine (the embedded engine holds every "
        "table's cells; spark and beam do too unless the count tables form a tree of geographic units, which "
        "they post-process in their workers without this limit: see `dprelease plan`). Coarsen the table (bins, "
        "fewer attributes, a smaller way), or raise --max-cells on a machine with that much memory")
