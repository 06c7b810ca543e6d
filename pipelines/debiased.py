"""Debiased tables of columns collected under randomized response (`randomized_response` in the spec).

A count table that crosses a randomized column counts the respondents' *reports*: `tables/` and
`measurements/` hold those, as for any column. Beside them, `debiased/<table>` holds per cell the unbiased
estimate of the count of true values (`estimate`, may be negative), its variance (`variance`: the central
noise's part, exact, plus `response_variance`, the randomization's part evaluated at the estimate clipped at
0). Computed from the raw noisy measurement alone (`transforms.randomized_response`), part by part: a part
holds whole blocks of cells that differ only in the randomized axes, so every engine writes each part from
its own rows. Post-processing: reads noisy measurements and the public spec only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow as pa

from dprelease.transforms.randomized_response import RandomizedResponse, debias, noise_variance, response_variance

from .layout import Layout, Part, _by_rows, table_parts
from .plan import Plan, TablePlan
from .spec import CategoricalColumn

DEBIASED_DIR = "debiased"
ESTIMATE, VARIANCE, RESPONSE_VARIANCE = "estimate", "variance", "response_variance"
DEBIASED_KINDS = ("histogram", "marginals", "hierarchy")
LOCAL_NOTE = (
    "each listed column was randomized by its respondents before collection (k-ary randomized response): every "
    "record's value of it is epsilon0-DP against anyone, the agency included, and so is everything computed from "
    "it. Per unit: the collected file holds all of a unit's reports (n records: n x epsilon0 against the agency); "
    "this release uses at most max_records_per_unit of them, chosen by its secret key, so against anyone without "
    "the key it is per_unit_epsilon (releases with other keys may use other records: up to n x epsilon0 in all). "
    "The central budget (totals) is charged as for any column, with the release's neighbouring relation. Neighbours "
    "that differ only in one unit's true values of a randomized column are covered twice: by the central guarantee "
    "as one unit changed (value_change.central_epsilon: under add_remove a removal and an addition, so twice the "
    "epsilon of pure DP or four times the rho of zCDP, converted at value_change.delta) and by the local one "
    "(per_unit_epsilon, pure); each column's value_change_epsilon is the smaller, at value_change_delta. The local "
    "epsilon is spent at collection, per record, and is not charged to the ledger. tables/ and measurements/ count "
    "the reports; debiased/ estimates the true values")


def randomizations(plan: Plan) -> dict[str, RandomizedResponse]:
    """Each randomized column's mechanism, from the spec (public), by column name: the order a manifest's spec
    (written with sorted keys) gives verify too."""
    return {name: RandomizedResponse(len(column.values), Fraction(column.randomized_response.epsilon))
            for name, column in sorted(plan.spec.columns.items())
            if isinstance(column, CategoricalColumn) and column.randomized_response is not None}


@dataclass(frozen=True)
class DebiasedTable:
    """A count table with randomized axes: `axes` (axis index, mechanism) in the table's cell order, `block`
    the cells from the first randomized axis on (a debiased cell needs only its own block)."""

    table: TablePlan
    axes: tuple[tuple[int, RandomizedResponse], ...]

    @property
    def first_axis(self) -> int:
        return self.axes[0][0]

    @property
    def block(self) -> int:
        return math.prod(d.size for d in self.table.dims[self.first_axis:])

    @property
    def columns(self) -> list[str]:
        return [self.table.dims[axis].column for axis, _ in self.axes]

    def noise_variance(self) -> float:
        return noise_variance(self.table.noise_variance(), list(self.axes))


def debiased_tables(plan: Plan) -> list[DebiasedTable]:
    """The release's count tables that cross a randomized column, in table order."""
    mechanisms = randomizations(plan)
    if not mechanisms:
        return []
    out = []
    for table in plan.tables:
        axes = tuple((i, mechanisms[d.column]) for i, d in enumerate(table.dims) if d.column in mechanisms)
        if axes and table.kind in DEBIASED_KINDS and table.statistic == "count":
            out.append(DebiasedTable(table, axes))
    return out


def debiased_parts(plan: Plan, debiased: DebiasedTable, layout: Layout) -> list[Part]:
    """The parts of `debiased/<table>`: a tree count table's parts are its own (whole units, so whole blocks: its
    geography is its first axis); any other table's hold whole blocks of at most `layout.part_rows` rows, or one
    block when a block is larger (a table whose first axis is randomized is one block: such a table is outside
    any tree of units, so its release is post-processed on one machine anyway)."""
    parts = table_parts(plan, debiased.table, DEBIASED_DIR, layout)
    if all(p.start % debiased.block == 0 and p.stop % debiased.block == 0 for p in parts):
        return parts
    return _by_rows(f"{DEBIASED_DIR}/{debiased.table.name}", debiased.table.n_cells, debiased.block, layout)


def debiased_columns(debiased: DebiasedTable, noisy: np.ndarray) -> dict[str, pa.Array]:
    """The value columns of rows of whole blocks of the table, from their raw noisy counts."""
    sizes = [d.size for d in debiased.table.dims[debiased.first_axis:]]
    values = np.asarray(noisy, dtype=np.float64).reshape(-1, *sizes)
    axes = [(axis - debiased.first_axis + 1, rr) for axis, rr in debiased.axes]
    estimate = debias(values, axes)
    response = response_variance(estimate, axes)
    return {ESTIMATE: pa.array(estimate.ravel()),
            VARIANCE: pa.array((response + debiased.noise_variance()).ravel()),
            RESPONSE_VARIANCE: pa.array(response.ravel())}


def debiased_frame(plan: Plan, debiased: DebiasedTable, part: Part, noisy: np.ndarray) -> pa.Table:
    """Part `part` of `debiased/<table>` (labels, then values) from the noisy counts of its rows."""
    from .release import rows_frame

    return rows_frame(plan, debiased.table.dims, (), part.start, part.stop, debiased_columns(debiased, noisy))


def write_debiased(plan: Plan, root: Path, debiased: DebiasedTable, noisy: np.ndarray, layout: Layout) -> list[dict]:
    """Write every part of `debiased/<table>` from the table's whole noisy vector (the embedded engine)."""
    from .release import write_part

    return [entry for part in debiased_parts(plan, debiased, layout)
            for entry in write_part(root, part, debiased_frame(plan, debiased, part, noisy[part.start:part.stop]))]


def local_section(plan: Plan) -> dict:
    """The manifest's `local_randomization` block (only in releases with a randomized column): recomputed by
    verify from the spec."""
    mechanisms = randomizations(plan)
    if not mechanisms:
        return {}
    records = plan.bounds.max_records_per_unit
    change = value_change(plan)
    columns = [{"column": name, "mechanism": "k-ary randomized response", "values": rr.k,
                "epsilon0": str(rr.epsilon), "epsilon0_value": float(rr.epsilon),
                "p_truth": rr.p_truth, "p_each_other": rr.p_other,
                "per_unit_epsilon": str(records * rr.epsilon), "per_unit_epsilon_value": float(records * rr.epsilon),
                **_smaller(change, float(records * rr.epsilon))}
               for name, rr in mechanisms.items()]
    tables = [{"table": d.table.name, "randomized": d.columns, "noise_variance": d.noise_variance()}
              for d in debiased_tables(plan)]
    return {"local_randomization": {"columns": columns, "debiased_tables": tables, "value_change": change,
                                    "note": LOCAL_NOTE}}


def _smaller(change: dict, local: float) -> dict:
    """The smaller of the central bound (ε at δ) and the local one (pure): what holds for a value change."""
    if change["central_epsilon"] < local:
        return {"value_change_epsilon": change["central_epsilon"], "value_change_delta": change["delta"]}
    return {"value_change_epsilon": local, "value_change_delta": 0.0}


def value_change(plan: Plan) -> dict:
    """The central guarantee for neighbours that change one unit's values (its records stay, their values
    move): one step under `replace`; under `add_remove` a removal then an addition, group privacy of 2 (2ε under
    pure DP, 4ρ under zCDP, then converted to ε at the release's δ)."""
    from dprelease.accounting.conversions import zcdp_to_epsilon

    steps = 1 if plan.spec.neighbouring == "replace" else 2
    totals = plan.totals
    if totals.pure_epsilon is not None:
        return {"central_epsilon": float(steps * totals.pure_epsilon), "delta": 0.0, "steps": steps}
    rho = steps * steps * totals.rho
    return {"central_epsilon": zcdp_to_epsilon(float(rho), totals.delta), "delta": totals.delta, "steps": steps,
            "rho": str(rho)}
