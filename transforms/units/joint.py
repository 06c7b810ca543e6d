"""Marginals within a unit: a nonnegative joint table per unit fitted to the unit's noisy tables.

Per unit: minimise sum_t ||margin_t(p) - y_t||^2 / v_t over {p >= 0, sum p = the unit's integer total}
(the marginal polytope; Private-PGM's estimator on one clique, McKenna et al. 2019) by entropic mirror
descent, started from the least-squares tables made nonnegative, raked to shared integer one-way margins
and joined by iterative proportional fitting; then the joint rounded to the unit total (controlled
rounding) so the published tables are its margins.

Cost. The fit and the start's IPF run in C (`transforms/_joint.c`), 8 units side by side in the kernel's
lanes, each unit computed from its own row alone in one fixed order: a unit's result is the same bits in any
batch, on any worker or engine (the kernel refuses fast-math builds and turns fused multiply-adds off). A
mirror-descent step needs no exponential per joint cell: the gradient is a sum of one term per table, so
exp(-step * gradient) is a product of one factor per table, each computed on the table's (small) margin; the
update and the new margins are one pass over the joint. Each unit
keeps its own step size (grown 1.5x after a step that lowered its loss, halved and the step undone
otherwise): one loss evaluation per iteration, and no unit's step depends on another's. Units are taken a
chunk at a time (`chunk_units`), so memory holds a chunk's joints, never a level's, and the kernel's block of
8 units' joints and candidates (no per-cell map of the tables: strides). The numpy version these kernels
replaced agrees to rounding (a near-converged step's accept-or-undo can turn on the last bits).
Post-processing: noisy tables, their public variances and public totals only.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from .. import _joint
from ..segments import project_segments, round_segments

CHUNK_CELLS = 1 << 21
"""Joint cells per chunk (16 MiB of doubles): a chunk holds max(2, min(256, CHUNK_CELLS // joint cells)) units
(a public function of the joint's size)."""
START_SWEEPS = 20
RAKE_FLOOR = 1e-3
START_FLOOR = 1e-3
MIN_VARIANCE = 1e-9
EXPONENT_CLIP = 100.0
"""Bound on each table's factor exponent: the product of the factors stays finite (a unit whose loss cannot
move, a zero total say, keeps growing its step)."""
MAX_STEP = 1e200
"""Bound on a unit's step: a unit whose gradient vanishes keeps growing its step, which must stay finite
(inf * 0 is NaN). Never reached in the release's 50 iterations (a step starts at most at 1e12)."""


@dataclass(frozen=True)
class JointTable:
    """One table of a marginals query as the joint sees it: its axes (indices into the joint's attributes,
    in the table's own dimension order) and its noise variance (0: published exactly)."""

    name: str
    axes: tuple[int, ...]
    variance: float


@dataclass(frozen=True)
class JointShape:
    sizes: tuple[int, ...]
    tables: tuple[JointTable, ...]

    @property
    def cells(self) -> int:
        return math.prod(map(int, self.sizes))

    def table_cells(self, table: JointTable) -> int:
        return math.prod(map(int, [self.sizes[a] for a in table.axes]))


def chunk_units(cells: int) -> int:
    """Units per chunk for a joint of `cells` cells per unit."""
    return max(2, min(256, CHUNK_CELLS // max(cells, 1)))


def fit_joints(shape: JointShape, totals: np.ndarray, noisy: list[np.ndarray], estimates: list[np.ndarray],
               iterations: int) -> np.ndarray:
    """The fitted joint of every unit (units x joint cells): `noisy` and `estimates` hold, per table of
    `shape`, the units' noisy and least-squares tables (units x table cells)."""
    totals = np.asarray(totals, dtype=np.float64)
    out = np.empty((totals.size, shape.cells))
    width = chunk_units(shape.cells)
    for start in range(0, totals.size, width):
        rows = slice(start, min(start + width, totals.size))
        out[rows] = _raked_start(shape, totals[rows], [e[rows] for e in estimates])
        _mirror_descent(shape, totals[rows], [n[rows] for n in noisy], out[rows], iterations)
    return out


def _dims(shape: JointShape, table: JointTable) -> tuple[int, ...]:
    return tuple(shape.sizes[a] for a in table.axes)


def _raked_start(shape: JointShape, totals: np.ndarray, estimates: list[np.ndarray]) -> np.ndarray:
    """A nonnegative joint per unit (units x joint cells) near the estimate: each table projected onto
    {x >= 0, sum = total}, raked to integer one-way margins shared by all tables, then the joint fitted to them by
    iterative proportional fitting from uniform (C kernel, one unit at a time)."""
    units = totals.size
    one_way: dict[int, np.ndarray] = {}
    for table, estimate in zip(shape.tables, estimates):
        dims = _dims(shape, table)
        for position, axis in enumerate(table.axes):
            if axis not in one_way:
                other = tuple(1 + i for i in range(len(dims)) if i != position)
                margin = estimate.reshape((units,) + dims).sum(axis=other) if other else estimate
                one_way[axis] = _nonnegative_integers(margin, totals).astype(np.float64)
    targets = []
    for table, estimate in zip(shape.tables, estimates):
        target = _project_rows(estimate, totals)
        if len(table.axes) > 1:
            target += RAKE_FLOOR
            _ipf(target, _dims(shape, table), tuple((i,) for i in range(len(table.axes))),
                 [one_way[a] for a in table.axes])
        targets.append(target)
    joint = np.repeat((totals / shape.cells)[:, None], shape.cells, axis=1)
    _ipf(joint, shape.sizes, tuple(t.axes for t in shape.tables), targets)
    return joint


def _ipf(joints: np.ndarray, sizes: tuple[int, ...], axes: tuple[tuple[int, ...], ...],
         targets: list[np.ndarray]) -> None:
    """Each unit's joint (a row of `joints`, in place) fitted to its nonnegative table targets (the tables of
    `axes`, units x table cells each) by START_SWEEPS sweeps of iterative proportional fitting (C kernel
    `_joint.ipf`, one unit at a time; totals kept)."""
    tables = _table_axes(sizes, axes)
    _joint.ipf(joints, tables.sizes, tables.axes, tables.axis_offsets,
               np.concatenate([np.asarray(t, dtype=np.float64) for t in targets], axis=1), START_SWEEPS)


def _project_rows(rows: np.ndarray, totals: np.ndarray) -> np.ndarray:
    """Each unit's row projected onto {x >= 0, sum x = its total}."""
    units, cells = rows.shape
    return project_segments(rows.ravel(), np.repeat(np.arange(units), cells), totals).reshape(units, cells)


def _nonnegative_integers(rows: np.ndarray, totals: np.ndarray) -> np.ndarray:
    """Each unit's row as nonnegative integers adding up to its (integer) total."""
    units, cells = rows.shape
    segments = np.repeat(np.arange(units), cells)
    projected = project_segments(rows.ravel(), segments, totals)
    return round_segments(projected, segments, np.rint(totals).astype(np.int64)).reshape(units, cells)


@dataclass(frozen=True)
class TableAxes:
    """A joint's shape as the C kernels read it: the joint's `sizes` (int64), and each table's axes (in the
    table's own order) concatenated in `axes` (int32), table t's from axis_offsets[t] to axis_offsets[t + 1]."""

    sizes: np.ndarray
    axes: np.ndarray
    axis_offsets: np.ndarray


def _table_axes(sizes: tuple[int, ...], tables: tuple[tuple[int, ...], ...]) -> TableAxes:
    offsets = np.zeros(len(tables) + 1, dtype=np.int64)
    np.cumsum([len(axes) for axes in tables], out=offsets[1:])
    return TableAxes(np.asarray(sizes, dtype=np.int64), np.array([a for axes in tables for a in axes], dtype=np.int32),
                     offsets)


def _mirror_descent(shape: JointShape, totals: np.ndarray, noisy: list[np.ndarray], joints: np.ndarray,
                    iterations: int) -> None:
    """Each unit's joint (a row of `joints`, its start; in place) fitted to its noisy tables (units x table
    cells) by entropic mirror descent, its total kept (C kernel `_joint.mirror_descent`, one unit at a time:
    each unit's own step, grown 1.5x after a step that lowered its loss, halved and the step undone otherwise).
    Tables published exactly (variance 0) are not fitted."""
    measured = [(t, y) for t, y in zip(shape.tables, noisy) if t.variance > 0]
    if not measured:
        return
    tables = _table_axes(shape.sizes, tuple(t.axes for t, _ in measured))
    _joint.mirror_descent(joints, tables.sizes, tables.axes, tables.axis_offsets,
                          np.concatenate([np.asarray(y, dtype=np.float64) for _, y in measured], axis=1),
                          np.array([max(t.variance, MIN_VARIANCE) for t, _ in measured]),
                          np.ascontiguousarray(totals, dtype=np.float64), iterations, EXPONENT_CLIP, MAX_STEP,
                          START_FLOOR)


def round_joints(fitted: np.ndarray, totals: np.ndarray) -> np.ndarray:
    """Each unit's joint as nonnegative integers adding up to its integer total (projection onto the
    simplex, then controlled rounding), per unit."""
    units, cells = fitted.shape
    segments = np.repeat(np.arange(units), cells)
    totals = np.asarray(totals, dtype=np.int64)
    projected = project_segments(fitted.ravel(), segments, totals.astype(np.float64))
    return round_segments(projected, segments, totals).reshape(units, cells)


def joint_margins(joint: np.ndarray, shape: JointShape) -> list[np.ndarray]:
    """Each table's margin of every unit's joint (units x table cells), in the table's cell order."""
    units = joint.shape[0]
    full = joint.reshape((units,) + tuple(shape.sizes))
    out = []
    for table in shape.tables:
        other = tuple(1 + a for a in range(len(shape.sizes)) if a not in table.axes)
        margin = full.sum(axis=other) if other else full
        kept = sorted(table.axes)
        out.append(np.transpose(margin, [0] + [1 + kept.index(a) for a in table.axes]).reshape(units, -1))
    return out


def _tree_path(shape: JointShape, totals: np.ndarray, estimates: list[np.ndarray]) -> list[np.ndarray]:
    """The 'tree' path: a query's 1-way tables and a spanning tree of its 2-way tables made nonnegative
    integers that add up exactly (`tree_model.tree_tables`), from their estimates."""
    from .tree_model import tree_tables

    units = totals.size
    names = [str(a) for a in range(len(shape.sizes))]
    by_axes = {t.axes: i for i, t in enumerate(shape.tables)}
    pairs = [t.axes for t in shape.tables if len(t.axes) == 2]
    one_way, tables = tree_tables(totals, estimates[by_axes[(0,)]], names, [(names[a], names[b]) for a, b in pairs],
                                  [estimates[by_axes[p]].reshape(units, shape.sizes[p[0]], shape.sizes[p[1]])
                                   for p in pairs],
                                  {names[a]: estimates[by_axes[(a,)]] for a in range(len(shape.sizes))},
                                  [shape.tables[by_axes[p]].variance for p in pairs])
    out: list[np.ndarray] = [np.empty(0)] * len(shape.tables)
    for axes, i in by_axes.items():
        out[i] = (one_way[names[axes[0]]] if len(axes) == 1 else tables[pairs.index(axes)]).reshape(units, -1)
    return out


def _junction_path(shape: JointShape, totals: np.ndarray, estimates: list[np.ndarray]) -> list[np.ndarray]:
    """The 'junction' path: a `select: aim` query's 1-way tables and its chosen tables (in the order they were
    chosen, each adding one attribute) made nonnegative integers that add up exactly
    (`tree_model.junction_tables`), from their estimates."""
    from ..aim import clique_steps, oriented, oriented_back
    from .tree_model import junction_tables

    units = totals.size
    names = [str(a) for a in range(len(shape.sizes))]
    one_way_index = {t.axes[0]: i for i, t in enumerate(shape.tables) if len(t.axes) == 1}
    chosen = [i for i, t in enumerate(shape.tables) if len(t.axes) > 1]
    cliques = [tuple(names[a] for a in shape.tables[i].axes) for i in chosen]
    joins = clique_steps(cliques)
    steps = []
    for (separator, new), clique, i in zip(joins, cliques, chosen):
        table = estimates[i].reshape((units,) + tuple(shape.sizes[a] for a in shape.tables[i].axes))
        steps.append((separator, new, oriented(table, clique, separator, new)))
    one_way, tables = junction_tables(totals, cliques[0][0], estimates[one_way_index[int(cliques[0][0])]], steps,
                                      {names[a]: estimates[i] for a, i in one_way_index.items()},
                                      [shape.tables[i].variance for i in chosen])
    out: list[np.ndarray] = [np.empty(0)] * len(shape.tables)
    for a, i in one_way_index.items():
        out[i] = one_way[names[a]].reshape(units, -1)
    for (separator, new), clique, i, table in zip(joins, cliques, chosen, tables):
        out[i] = np.ascontiguousarray(oriented_back(table, clique, separator, new)).reshape(units, -1)
    return out


def model_tree(shape: JointShape):
    """(The attribute names, their sizes, the junction tree of every table's attributes): a capped model's."""
    from .graphical import junction_tree

    names = tuple(str(a) for a in range(len(shape.sizes)))
    sizes = {n: int(size) for n, size in zip(names, shape.sizes)}
    return names, sizes, junction_tree(names, [tuple(names[a] for a in t.axes) for t in shape.tables], sizes)


def _model_path(shape: JointShape, totals: np.ndarray, estimates: list[np.ndarray],
                converged: bool = False, cliques: list | None = None) -> list[np.ndarray]:
    """The 'model' path: a `select: aim` query's 1-way tables and its chosen tables (which may close cycles) as
    the margins of one graphical model per unit (`graphical`): its junction tree fitted by weighted least squares
    to their estimates (`graphical.fit`, FIT_ITERATIONS from `graphical.measured_start`, the unit totals fixed;
    the 'converged_model' path, `converged`: until each unit's loss settles, CONVERGENCE_TOLERANCE, at most
    CONVERGENCE_LIMIT iterations), its maximal cliques' tables made
    nonnegative integers adding up exactly (`graphical.integer_tables`) and each published table summed from the
    first clique holding it: every shared margin and total agrees exactly. `cliques`, when given, receives the
    integer tables of the model's maximal cliques (`model_tree`'s order and attribute names)."""
    from . import graphical

    names, sizes, tree = model_tree(shape)
    units = totals.size
    measurements = [graphical.Measurement(tuple(names[a] for a in t.axes),
                                          estimate.reshape((units,) + tuple(int(shape.sizes[a]) for a in t.axes)),
                                          t.variance)
                    for t, estimate in zip(shape.tables, estimates)]
    measurements = [_in_order(m, names) for m in measurements]
    start = graphical.measured_start(tree, sizes, totals.astype(np.float64), measurements)
    model = graphical.fit(tree, sizes, measurements, totals.astype(np.float64),
                          graphical.CONVERGENCE_LIMIT if converged else graphical.FIT_ITERATIONS, start,
                          graphical.CONVERGENCE_TOLERANCE if converged else None)
    integers = graphical.integer_tables(tree, sizes, model.marginals(), totals)
    if cliques is not None:
        cliques.append(integers)
    out = []
    for t in shape.tables:
        clique = tuple(names[a] for a in sorted(t.axes))
        home = tree.home(clique)
        margin = graphical.margin_of(integers[home], tree.cliques[home], clique)
        order = [sorted(t.axes).index(a) for a in t.axes]  # the table's own dimension order
        out.append(np.ascontiguousarray(np.transpose(margin, [0] + [1 + i for i in order])).reshape(units, -1))
    return out


def _in_order(measurement, names: tuple[str, ...]):
    """A measurement whose table's dimensions follow the attributes' order (the model's)."""
    from .graphical import Measurement

    clique = measurement.clique
    ordered = tuple(sorted(clique, key=names.index))
    values = np.transpose(measurement.values, [0] + [1 + clique.index(a) for a in ordered])
    return Measurement(ordered, values, measurement.variance)


def marginal_tables(shape: JointShape, totals: np.ndarray, noisy: list[np.ndarray], estimates: list[np.ndarray],
                    iterations: int, path: str, joints: list | None = None) -> list[np.ndarray]:
    """The published integer tables of every unit (per table, units x table cells), a chunk of units at a time
    (memory: a chunk's joint, never a level's):
      'joint'          the fitted joint rounded to the unit total; every table a margin of it (consistent);
      'fitted_tables'  each table, a margin of the fitted joint, rounded to the unit total on its own;
      'tables'         no joint: each table's estimate made nonnegative and rounded to the unit total;
      'tree'           a `select: mst` query (1-way tables and a spanning tree of pairs): `_tree_path`;
      'junction'       a `select: aim` query (1-way tables and a junction tree grown by rounds): `_junction_path`;
      'model'          a `select: aim` query whose tables may close cycles: `_model_path` (manifest version 9
                       or earlier: FIT_ITERATIONS of the fit);
      'converged_model' the same, the fit run until it settles (version 10 on).
    `joints`, when given, receives each chunk's rounded joint (path 'joint'), or the integer tables of its model's
    maximal cliques (paths 'model' and 'converged_model': `_model_path`)."""
    totals = np.asarray(totals, dtype=np.int64)
    out = [np.empty((totals.size, shape.table_cells(t)), dtype=np.int64) for t in shape.tables]
    if path in ("model", "converged_model"):  # the fit holds about ten arrays of the model's cells
        _, sizes, tree = model_tree(shape)
        width = chunk_units(10 * tree.cells(sizes))
    elif path in ("tree", "junction"):
        width = chunk_units(sum(shape.table_cells(t) for t in shape.tables))
    else:
        width = chunk_units(shape.cells)
    for start in range(0, totals.size, width):
        rows = slice(start, min(start + width, totals.size))
        unit_totals = totals[rows]
        if path in ("tree", "junction", "model", "converged_model"):
            kernel = {"tree": _tree_path, "junction": _junction_path,
                      "model": functools.partial(_model_path, cliques=joints),
                      "converged_model": functools.partial(_model_path, converged=True, cliques=joints)}[path]
            for i, table in enumerate(kernel(shape, unit_totals, [e[rows] for e in estimates])):
                out[i][rows] = table
            continue
        if path == "tables":
            for i, estimate in enumerate(estimates):
                out[i][rows] = _nonnegative_integers(estimate[rows], unit_totals.astype(np.float64))
            continue
        fitted = fit_joints(shape, unit_totals, [n[rows] for n in noisy], [e[rows] for e in estimates], iterations)
        if path == "joint":
            joint = round_joints(fitted, unit_totals)
            if joints is not None:
                joints.append(joint)
            for i, margin in enumerate(joint_margins(joint, shape)):
                out[i][rows] = margin
        else:
            for i, margin in enumerate(joint_margins(fitted, shape)):
                out[i][rows] = _nonnegative_integers(margin, unit_totals.astype(np.float64))
    return out
