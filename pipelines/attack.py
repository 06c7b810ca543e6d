"""`dprelease attack RELEASE --data CONFIDENTIAL --internal-dir DIR`: a reconstruction-risk check for agencies.

The Census Bureau's experiment on its 2010 tables (after Dinur and Nissim 2003): find microdata consistent with
the published tables, then count how many confidential records it matches exactly. Here, per geographic unit of
the finest level that the release crosses with attributes, an integer program (scipy's `milp`, HiGHS) finds
nonnegative integer counts x over the joint cells of those attributes whose margins are as close as possible
(least total absolute deviation) to every published count table of that unit, ties broken towards the unit's
prior. A reconstructed record matches a confidential one when both have the same unit and the same value of
every attribute; the exact-match rate is the sum over units and cells of min(x, y) over the number of
confidential records y. Beside it: the same program on the true tables of the confidential records (what exact
tables would give away), and two baselines an attacker has without the release's cross-tabulations: a guess
from national marginals (the national joint, scaled to each unit's total) and a per-unit prior (the product of
the unit's published one-way margins). The result says plainly whether the release does better than the
baselines for an attacker.

Confidential: the result compares the release with the confidential records, so it is written only to the
internal directory (0600 in a 0700 directory) and nothing about it is printed but where it is. The release is
verified first and read through its manifest only.
"""
from __future__ import annotations

import datetime as dt
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from scipy.optimize import Bounds, LinearConstraint, milp

from dprelease.accounting.errors import SpecError, VerificationError
from dprelease.transforms.domains import GeographyDomain, dimension_labels
from dprelease.transforms.encode import ColumnEncoder, encode_batch

from .error_columns import read_table
from .plan import Plan, TablePlan
from .source import open_input
from .storage import private_directory, write_private
from .verify import verify_release

MAX_JOINT_CELLS = 200_000
"""Joint cells per unit above which the program is refused (its size grows with the product of the domains)."""


@dataclass(frozen=True)
class Target:
    """What is attacked: units of one geography level and the attributes its count tables cross them with."""

    geography: str
    level: str
    attributes: tuple[str, ...]
    tables: tuple[TablePlan, ...]


def choose_target(plan: Plan) -> Target:
    """The finest geography level with count tables that cross it with attributes (and only with it), those
    attributes, and every count table over that level and a subset of them (a unit total included)."""
    geographies = [name for name, d in plan.domains.items() if isinstance(d, GeographyDomain)]
    measured_counts = [t for t in plan.tables if t.statistic == "count" and t.event is not None]
    candidates = []
    for table in measured_counts:
        geo = [d for d in table.dims if d.column in geographies]
        if len(geo) == 1 and len(table.dims) > 1:
            candidates.append((geo[0].column, geo[0].level))
    if not candidates:
        raise SpecError("attack: the release has no count table that crosses a geography level with attributes "
                        "(nothing to reconstruct per unit)")
    order = {(g, level): i for g in geographies for i, level in enumerate(plan.domains[g].level_names())}
    geography, level = max(set(candidates), key=lambda c: order[c])
    chosen = []
    for table in measured_counts:
        geo = [d for d in table.dims if d.column == geography]
        others = [d for d in table.dims if d.column != geography]
        if len(geo) == 1 and geo[0].level == level and all(d.level is None for d in others):
            chosen.append(table)
    attributes = tuple(sorted({d.column for t in chosen for d in t.dims if d.column != geography}))
    return Target(geography, level, attributes, tuple(chosen))


def _published(directory: Path, manifest: dict, plan: Plan, table: TablePlan) -> np.ndarray:
    """A published count table as a dense array over its dimensions (codes in the domains' label order)."""
    frame = read_table(directory, manifest, table.name)
    shape = tuple(d.size for d in table.dims)
    values = np.zeros(shape, dtype=np.int64)
    index = []
    for d in table.dims:
        labels = {label: i for i, label in enumerate(dimension_labels(plan.domains[d.column], d))}
        column = frame.column(d.output_name).to_pylist()
        index.append(np.asarray([labels[str(v)] for v in column], dtype=np.int64))
    values[tuple(index)] = frame.column("count").to_numpy()
    geo = next(i for i, d in enumerate(table.dims) if d.level is not None)
    return np.moveaxis(values, geo, 0)  # units first, then the attributes in the table's order


def _margin_matrix(sizes: list[int], keep: list[int]) -> sp.csr_matrix:
    """The 0/1 matrix that sums a joint array of `sizes` (C order) onto its axes `keep` (C order)."""
    n = math.prod(map(int, sizes))
    cells = np.unravel_index(np.arange(n), sizes)
    rows = np.ravel_multi_index([cells[k] for k in keep], [sizes[k] for k in keep]) if keep else np.zeros(n, int)
    height = math.prod(map(int, [sizes[k] for k in keep])) if keep else 1
    return sp.csr_matrix((np.ones(n), (rows, np.arange(n))), shape=(height, n))


FIT_WEIGHT = 1000.0
"""Cost of one unit of deviation from a published margin, against one record of distance from the prior."""


def _reconstruct(blocks: list[tuple[sp.csr_matrix, np.ndarray]], n: int, time_limit: float,
                 prior: np.ndarray | None = None) -> tuple[np.ndarray, bool]:
    """Nonnegative integer joint counts whose margins are closest (L1) to the given ones and, among those
    (FIT_WEIGHT), closest (L1) to `prior`: the program has many solutions, and an attacker breaks ties towards
    what the unit's one-way margins suggest. Returns (x, solved to optimality)."""
    matrix = sp.vstack([m for m, _ in blocks]).tocsr()
    target = np.concatenate([b for _, b in blocks]).astype(float)
    m = matrix.shape[0]
    fit = sp.identity(m, format="csr")
    rows = [sp.hstack([matrix, -fit, fit])]
    cost = [np.zeros(n), np.full(2 * m, FIT_WEIGHT)]
    if prior is not None:
        near = sp.identity(n, format="csr")
        rows = [sp.hstack([rows[0], sp.csr_matrix((m, 2 * n))]),
                sp.hstack([near, sp.csr_matrix((n, 2 * m)), -near, near])]
        target = np.concatenate([target, prior.astype(float)])
        cost.append(np.ones(2 * n))
    constraint = LinearConstraint(sp.vstack(rows).tocsr(), target, target)
    cost = np.concatenate(cost)
    integrality = np.concatenate([np.ones(n), np.zeros(cost.size - n)])
    result = milp(cost, constraints=constraint, integrality=integrality, bounds=Bounds(0, np.inf),
                  options={"time_limit": time_limit, "disp": False})
    if result.x is None:
        return np.zeros(n, dtype=np.int64), False
    return np.rint(result.x[:n]).astype(np.int64), result.status == 0


def _truth(plan: Plan, data: str, target: Target, sizes: list[int]) -> np.ndarray:
    """The confidential records' counts per unit and joint cell (policy `drop` applied as in the release)."""
    source = open_input(plan, Path.cwd(), data)
    columns = [target.geography, *target.attributes]
    encoders = {c: ColumnEncoder(plan.domains[c]) for c in columns}
    to_unit = plan.domains[target.geography].leaf_to_level(target.level)
    units = plan.domains[target.geography].level_size(target.level)
    counts = np.zeros(units * math.prod(map(int, sizes)), dtype=np.int64)
    for path in source.files():
        for batch in source.batches(path):
            codes, keep = encode_batch(batch, encoders)
            cells = np.ravel_multi_index([to_unit[codes[target.geography][keep]]] +
                                         [codes[a][keep] for a in target.attributes], [units, *sizes])
            counts += np.bincount(cells, minlength=counts.size)
    return counts.reshape(units, -1)


def _rounded(weights: np.ndarray, total: int) -> np.ndarray:
    """Nonnegative integers summing to `total`, proportional to `weights` (largest remainders)."""
    if total <= 0 or weights.sum() <= 0:
        return np.zeros(weights.size, dtype=np.int64)
    share = weights / weights.sum() * total
    floor = np.floor(share).astype(np.int64)
    floor[np.argsort(floor - share, kind="stable")[:total - int(floor.sum())]] += 1
    return floor


def _unit_prior(unit_tables: list[np.ndarray], axes: list[list[int]], sizes: list[int]) -> np.ndarray:
    """The per-unit prior: the product of the unit's published one-way margins (each attribute's from the first
    table that has it), rounded to the unit's published total."""
    total = next((int(v.sum()) for v in unit_tables), 0)
    joint = np.ones(sizes)
    for k, size in enumerate(sizes):
        found = next(((v, keep) for v, keep in zip(unit_tables, axes) if k in keep), None)
        margin = _one_way(*found, k).astype(float).clip(min=0) if found else np.ones(size)
        shape = [1] * len(sizes)
        shape[k] = size
        joint = joint * (margin / max(margin.sum(), 1)).reshape(shape)
    return _rounded(joint.ravel(), total)


def _national_guess(published: list[np.ndarray], blocks_of, n: int, time_limit: float) -> np.ndarray:
    """A national joint rebuilt from the tables summed over every unit (what national tables would show), as
    proportions: the guess of an attacker who knows the national marginals only."""
    tables = [values.sum(axis=0) for values in published]
    national, _ = _reconstruct(blocks_of(tables), n, time_limit)
    return national.astype(float)


def attack(release_dir: Path, data: str, internal_dir: Path, max_units: int | None = None,
           time_limit: float = 10.0, progress=lambda done, total: None) -> Path:
    """Run the reconstruction and write its (confidential) result into `internal_dir`; returns the file.

    Four rebuilds per unit, each scored by exact matches: from the published tables (the attack); from the
    true tables of the confidential records (what exact tables would give away); a guess from national
    marginals (the national joint, scaled to the unit's published total); a per-unit prior (the product of the
    unit's published one-way margins)."""
    release_dir = Path(release_dir)
    internal_dir = private_directory(internal_dir, "--internal-dir")  # never inside a release, never chmod-ed
    report = verify_release(release_dir)
    if not report.ok or report.plan is None:
        raise VerificationError(f"{release_dir}: does not verify; attack a verified release")
    plan, manifest = report.plan, report.manifest
    target = choose_target(plan)
    sizes = [plan.domains[a].size for a in target.attributes]
    n = math.prod(map(int, sizes))
    if n > MAX_JOINT_CELLS:
        raise SpecError(f"attack: the joint of {', '.join(target.attributes)} has {n:,} cells per unit; at most "
                        f"{MAX_JOINT_CELLS:,}")
    published = [_published(release_dir, manifest, plan, t) for t in target.tables]
    axes = [[target.attributes.index(d.column) for d in t.dims if d.column != target.geography] for t in target.tables]
    matrices = [_margin_matrix(sizes, keep) for keep in axes]

    def blocks_of(unit_tables: list[np.ndarray]) -> list:
        return [(matrix, values.ravel()) for matrix, values in zip(matrices, unit_tables)]

    truth = _truth(plan, data, target, sizes)
    national = _national_guess(published, blocks_of, n, time_limit)
    labels = plan.domains[target.geography].labels(target.level)
    units = list(range(len(labels)))[:max_units]  # public: which units hold records is not (progress shows it)
    kinds = ("release", "true_tables", "national_guess", "unit_prior")
    matched = dict.fromkeys(kinds, 0)
    records = optimal = 0
    per_unit = []
    started = time.perf_counter()
    for done, u in enumerate(units):
        y = truth[u]
        unit_tables = [values[u] for values in published]
        true_tables = [(matrix @ y).reshape(values.shape[1:]) for matrix, values in zip(matrices, published)]
        prior = _unit_prior(unit_tables, axes, sizes)
        release, solved = _reconstruct(blocks_of(unit_tables), n, time_limit, prior)
        exact, _ = _reconstruct(blocks_of(true_tables), n, time_limit, _unit_prior(true_tables, axes, sizes))
        total = next((int(v.sum()) for v in unit_tables), 0)
        rebuilt = {"release": release, "true_tables": exact, "national_guess": _rounded(national, total),
                   "unit_prior": prior}
        scores = {kind: int(np.minimum(x, y).sum()) for kind, x in rebuilt.items()}
        for kind in kinds:
            matched[kind] += scores[kind]
        records += int(y.sum())
        optimal += solved
        per_unit.append({"unit": labels[u], "records": int(y.sum()), "exact_matches": scores, "optimal": solved})
        progress(done + 1, len(units))
    rates = {kind: matched[kind] / max(records, 1) for kind in kinds}
    result = {
        "confidential": "compares the release with the confidential records; never publish",
        "release_id": manifest["release_id"], "attacked_at": dt.datetime.now(dt.timezone.utc).isoformat(),
        "geography_level": f"{target.geography}.{target.level}", "attributes": list(target.attributes),
        "tables": [t.name for t in target.tables], "joint_cells_per_unit": n,
        "units_attacked": len(units), "units_solved_to_optimality": optimal, "records": records,
        "exact_matches": matched, "exact_match_rates": rates, "verdict": verdict(rates),
        "seconds": round(time.perf_counter() - started, 3), "per_unit": per_unit,
    }
    path = internal_dir / f"attack-{manifest['release_id']}.json"
    write_private(path, json.dumps(result, indent=2) + "\n")
    return path


def verdict(rates: dict[str, float]) -> str:
    """In plain words: does the release let an attacker rebuild more records than the baselines do?"""
    best = max(("national_guess", "unit_prior"), key=rates.get)
    names = {"national_guess": "a guess from national marginals", "unit_prior": "a per-unit prior"}
    gain = rates["release"] - rates[best]
    said = (f"From the release an attacker rebuilds {rates['release']:.1%} of the records exactly; the best baseline "
            f"({names[best]}) rebuilds {rates[best]:.1%}, and the true tables would give {rates['true_tables']:.1%}. ")
    if gain > 0.01:
        return said + (f"The release does better than the baselines for an attacker, by {gain:.1%} of the records: "
                       "it discloses record-level combinations beyond what public-level information gives.")
    if gain < -0.01:
        return said + (f"The release does no better than the baselines for an attacker: this attack on it rebuilds "
                       f"{-gain:.1%} of the records fewer than the best baseline.")
    return said + "The release does no better than the baselines for an attacker (within 1% of the records)."


def _one_way(values: np.ndarray, axes: list[int], k: int) -> np.ndarray:
    """The one-way margin on attribute `k` of one unit's published table over attributes `axes`."""
    position = axes.index(k)
    others = tuple(i for i in range(len(axes)) if i != position)
    return values.sum(axis=others) if others else values


__all__ = ["attack", "choose_target", "verdict", "MAX_JOINT_CELLS"]
