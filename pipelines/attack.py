"""`dprelease attack RELEASE --data CONFIDENTIAL --internal-dir DIR`: a reconstruction-risk check for agencies.

The Census Bureau's experiment on its 2010 tables (after Dinur and Nissim 2003): find microdata consistent with
the published tables, then count how many confidential records it matches exactly. Here, per geographic unit of
the finest level that the release crosses with attributes, an integer program (scipy's `milp`, HiGHS) finds
nonnegative integer counts x over the joint cells of those attributes whose margins are as close as possible
(least total absolute deviation) to every published count table of that unit. A reconstructed record matches a
confidential one when both have the same unit and the same value of every attribute; the exact-match rate is
sum over units and cells of min(x, y) over the number of confidential records y. The baseline is the same
program given only the one-way margins of the same tables: what the cross-tabulations add.

Confidential: the result compares the release with the confidential records, so it is written only to the
internal directory (0600 in a 0700 directory) and nothing about it is printed but where it is. The release is
verified first and read through its manifest only.
"""
from __future__ import annotations

import datetime as dt
import json
import os
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
from .housekeeping import write_private
from .plan import Plan, TablePlan
from .source import open_input
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
    candidates = []
    for table in plan.tables:
        if table.statistic != "count" or table.event is None:
            continue
        geo = [d for d in table.dims if d.column in geographies]
        if len(geo) == 1 and len(table.dims) > 1:
            candidates.append((geo[0].column, geo[0].level))
    if not candidates:
        raise SpecError("attack: the release has no count table that crosses a geography level with attributes "
                        "(nothing to reconstruct per unit)")
    order = {(g, level): i for g in geographies for i, level in enumerate(plan.domains[g].level_names())}
    geography, level = max(set(candidates), key=lambda c: order[c])
    chosen = []
    for table in plan.tables:
        if table.statistic != "count" or table.event is None:
            continue
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
    n = int(np.prod(sizes))
    cells = np.unravel_index(np.arange(n), sizes)
    rows = np.ravel_multi_index([cells[k] for k in keep], [sizes[k] for k in keep]) if keep else np.zeros(n, int)
    height = int(np.prod([sizes[k] for k in keep])) if keep else 1
    return sp.csr_matrix((np.ones(n), (rows, np.arange(n))), shape=(height, n))


def _reconstruct(blocks: list[tuple[sp.csr_matrix, np.ndarray]], n: int, time_limit: float) -> tuple[np.ndarray, bool]:
    """Nonnegative integer joint counts whose margins are closest (L1) to the published ones; (x, optimal)."""
    matrix = sp.vstack([m for m, _ in blocks]).tocsr()
    target = np.concatenate([b for _, b in blocks]).astype(float)
    m = matrix.shape[0]
    identity = sp.identity(m, format="csr")
    constraint = LinearConstraint(sp.hstack([matrix, -identity, identity]).tocsr(), target, target)
    cost = np.concatenate([np.zeros(n), np.ones(2 * m)])
    integrality = np.concatenate([np.ones(n), np.zeros(2 * m)])
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
    counts = np.zeros(units * int(np.prod(sizes)), dtype=np.int64)
    for path in source.files():
        for batch in source.batches(path):
            codes, keep = encode_batch(batch, encoders)
            cells = np.ravel_multi_index([to_unit[codes[target.geography][keep]]] +
                                         [codes[a][keep] for a in target.attributes], [units, *sizes])
            counts += np.bincount(cells, minlength=counts.size)
    return counts.reshape(units, -1)


def attack(release_dir: Path, data: str, internal_dir: Path, max_units: int | None = None,
           time_limit: float = 10.0, progress=lambda done, total: None) -> Path:
    """Run the reconstruction and write its (confidential) result into `internal_dir`; returns the file."""
    release_dir, internal_dir = Path(release_dir), Path(internal_dir)
    if internal_dir.resolve().is_relative_to(release_dir.resolve()):
        raise SpecError(f"--internal-dir = {str(internal_dir)!r}: must not be inside the release (the result is "
                        "confidential)")
    report = verify_release(release_dir)
    if not report.ok or report.plan is None:
        raise VerificationError(f"{release_dir}: does not verify; attack a verified release")
    plan, manifest = report.plan, report.manifest
    target = choose_target(plan)
    sizes = [plan.domains[a].size for a in target.attributes]
    n = int(np.prod(sizes))
    if n > MAX_JOINT_CELLS:
        raise SpecError(f"attack: the joint of {', '.join(target.attributes)} has {n:,} cells per unit; at most "
                        f"{MAX_JOINT_CELLS:,}")
    published = [(t, _published(release_dir, manifest, plan, t)) for t in target.tables]
    axes = [[target.attributes.index(d.column) for d in t.dims if d.column != target.geography] for t in target.tables]
    full = [_margin_matrix(sizes, keep) for keep in axes]
    one_way = [_margin_matrix(sizes, [k]) for k in range(len(sizes))]
    truth = _truth(plan, data, target, sizes)
    labels = plan.domains[target.geography].labels(target.level)
    units = [u for u in range(len(labels)) if truth[u].sum() > 0][:max_units]
    tallies = dict(records=0, matched=0, matched_baseline=0, optimal=0)
    per_unit = []
    started = time.perf_counter()
    for done, u in enumerate(units):
        blocks = [(matrix, values[u].ravel()) for matrix, (_, values) in zip(full, published)]
        x, optimal = _reconstruct(blocks, n, time_limit)
        baseline, _ = _reconstruct(_one_way_blocks([values[u] for _, values in published], axes, full, one_way),
                                   n, time_limit)
        y = truth[u]
        matched, matched_baseline = int(np.minimum(x, y).sum()), int(np.minimum(baseline, y).sum())
        tallies["records"] += int(y.sum())
        tallies["matched"] += matched
        tallies["matched_baseline"] += matched_baseline
        tallies["optimal"] += optimal
        per_unit.append({"unit": labels[u], "records": int(y.sum()), "reconstructed": int(x.sum()),
                         "exact_matches": matched, "baseline_matches": matched_baseline, "optimal": optimal})
        progress(done + 1, len(units))
    records = max(tallies["records"], 1)
    result = {
        "confidential": "compares the release with the confidential records; never publish",
        "release_id": manifest["release_id"], "attacked_at": dt.datetime.now(dt.timezone.utc).isoformat(),
        "geography_level": f"{target.geography}.{target.level}", "attributes": list(target.attributes),
        "tables": [t.name for t in target.tables], "joint_cells_per_unit": n,
        "units_attacked": len(units), "units_solved_to_optimality": tallies["optimal"],
        "records": tallies["records"], "exact_matches": tallies["matched"],
        "exact_match_rate": tallies["matched"] / records,
        "baseline_one_way_matches": tallies["matched_baseline"],
        "baseline_one_way_rate": tallies["matched_baseline"] / records,
        "seconds": round(time.perf_counter() - started, 3), "per_unit": per_unit,
    }
    internal_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(internal_dir, 0o700)
    path = internal_dir / f"attack-{manifest['release_id']}.json"
    write_private(path, json.dumps(result, indent=2) + "\n")
    return path


def _one_way_blocks(unit_tables: list[np.ndarray], axes: list[list[int]], full: list, one_way: list) -> list:
    """The baseline's constraints: each attribute's one-way margin (from the first table that has it) and the
    unit totals (tables without attributes)."""
    blocks = [(matrix, values.ravel()) for matrix, values, keep in zip(full, unit_tables, axes) if not keep]
    for k, matrix in enumerate(one_way):
        found = next(((values, keep) for values, keep in zip(unit_tables, axes) if k in keep), None)
        if found is not None:
            blocks.append((matrix, _one_way(found[0], found[1], k)))
    return blocks


def _one_way(values: np.ndarray, axes: list[int], k: int) -> np.ndarray:
    """The one-way margin on attribute `k` of one unit's published table over attributes `axes`."""
    position = axes.index(k)
    others = tuple(i for i in range(len(axes)) if i != position)
    return values.sum(axis=others) if others else values


__all__ = ["attack", "choose_target", "MAX_JOINT_CELLS"]
