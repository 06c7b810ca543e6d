"""The plan as records: per table, its allocation and expected error, computed from the spec alone.

One source for `dprelease plan` (a rich table, or JSON with --json) and the Python API's
`Release.plan()` (a DataFrame). Public: nothing here reads data.
"""
from __future__ import annotations

from typing import Any

from .manifest import rank_margin_95
from .plan import Plan

PLAN_COLUMNS = ("table", "statistic", "cells", "l1", "l2", "budget", "mechanism", "noise", "noise_std", "margin_95",
                "gls_std")
"""The fields of every record, in order. `budget` is epsilon (pure) or rho (zcdp, approx); `noise` is the
mechanism's parameter as text (DLap b=, DGauss s2=, EM eps= per selection x selections); `margin_95` is in
the table's units (quantiles: in ranks); `gls_std` is the largest per-cell standard deviation of the count tables'
least-squares estimate (None for other tables). A mean's record (mechanism "ratio") has `mean_std_at_n`: its
standard deviation at n records in a cell is at most mean_std_at_n / n."""


def plan_records(plan: Plan, estimate) -> list[dict[str, Any]]:
    """One record per table of `plan`; `estimate`: its GLS variances (`postprocessing.estimate_variances`)."""
    records = []
    for t in plan.tables:
        statistic = f"{t.statistic}({t.measure.column})" if t.measure else t.statistic
        record = dict.fromkeys(PLAN_COLUMNS)
        record.update(table=t.name, statistic=statistic, cells=t.n_cells)
        if t.invariant:
            record.update(budget=0.0, mechanism="invariant", noise="exact (invariant)", noise_std=0.0, margin_95=0,
                          gls_std=0.0)
            records.append(record)
            continue
        m = t.event.mechanism
        sens = t.event.sensitivity
        record.update(l1=sens.l1, budget=float(t.event.allocated))
        if m.kind == "exponential":
            record.update(mechanism="exponential", noise=f"EM eps={float(m.epsilon):.4g} x {m.selections}",
                          margin_95=rank_margin_95(t), quantiles=len(t.quantiles))
            records.append(record)
            continue
        noise = _noise_text(m)
        record.update(l2=sens.l2_squared ** 0.5, mechanism=m.kind, noise=noise, noise_std=m.variance() ** 0.5,
                      margin_95=m.margin_95())
        if t.name in estimate.per_cell:
            record["gls_std"] = estimate.largest(t.name) ** 0.5
        records.append(record)
    return records + [_mean_record(plan, mean) for mean in plan.means] + \
        [r for selection in plan.selections for r in _selection_records(selection)]


def _selection_records(selection) -> list[dict[str, Any]]:
    """A `select: mst` or `aim` query's selection (its rounds of the exponential mechanism; cells: the tables a
    round could choose) and, before the run chose them, its chosen tables as one record (cells unknown: None;
    each gets the same mechanism whichever tables are chosen)."""
    m, sens = selection.event.mechanism, selection.event.sensitivity
    record = dict.fromkeys(PLAN_COLUMNS)
    record.update(table=selection.name, statistic=f"{selection.method} selection", cells=len(selection.candidates), l1=sens.l1,
                  budget=float(selection.event.allocated), mechanism="exponential",
                  noise=f"EM eps={float(m.epsilon):.4g} x {m.selections}")
    if selection.chosen is not None:
        return [record]
    pair = selection.pair_event
    pending = dict.fromkeys(PLAN_COLUMNS)
    noise = _noise_text(pair.mechanism)
    chosen = "pairs" if selection.method == "mst" else "tables"
    upto = "up to " if selection.annealing else ""  # an annealed round may spend several rounds' units
    pending.update(table=f"{selection.query}.<{upto}{selection.rounds} {chosen} chosen>", statistic="count", l1=pair.sensitivity.l1,
                   l2=pair.sensitivity.l2_squared ** 0.5, budget=float(pair.allocated * selection.rounds),
                   mechanism=pair.mechanism.kind, noise=noise, noise_std=pair.mechanism.variance() ** 0.5,
                   margin_95=pair.mechanism.margin_95())
    return [record, pending]


def _noise_text(mechanism) -> str:
    """An additive mechanism's parameter as the plan prints it."""
    return f"DLap b={mechanism.scale}" if mechanism.kind == "discrete_laplace" else f"DGauss s2={mechanism.sigma2}"


def _mean_record(plan: Plan, mean) -> dict[str, Any]:
    """A mean S/C per cell: its error depends on the cell's count n (data), so the plan states the bound it obeys
    at n records: std <= sqrt(Var S + M^2 Var C) / n (delta method, M = max(|lo|, |hi|)), as `mean_std_at_n`
    (the numerator; divide by n). Its budget is its sum's and count's (None here: nothing more is spent)."""
    total, count = plan.table(mean.sum_table), plan.table(mean.count_table)
    largest = max(abs(mean.measure.lower), abs(mean.measure.upper))
    variances = total.event.mechanism.variance(), count.event.mechanism.variance()
    record = dict.fromkeys(PLAN_COLUMNS)
    record.update(table=mean.name, statistic=f"mean({mean.measure.column})", cells=total.n_cells, mechanism="ratio",
                  noise=f"{mean.sum_table} / {mean.count_table}",
                  mean_std_at_n=(variances[0] + largest * largest * variances[1]) ** 0.5)
    return record

