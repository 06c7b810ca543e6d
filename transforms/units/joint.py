"""Marginals within a unit: a nonnegative joint table per unit fitted to the unit's noisy tables.

Per unit: minimise sum_t ||margin_t(p) - y_t||^2 / v_t over {p >= 0, sum p = the unit's integer total}
(the marginal polytope; Private-PGM's estimator on one clique, McKenna et al. 2019) by entropic mirror
descent, started from the least-squares tables made nonnegative, raked to shared integer one-way margins
and joined by iterative proportional fitting; then the joint rounded to the unit total (controlled
rounding) so the published tables are its margins.

Cost. Units are processed a chunk at a time in a unit-minor layout (joint axes..., width), so every
reduction and broadcast runs over contiguous vectors of `chunk_units` units. A mirror-descent step needs no
exponential per joint cell: the gradient is a sum of one term per table, so exp(-step * gradient) is a
product of one factor per table, each computed on the table's (small) margin and broadcast into the joint.
Each unit keeps its own step size (grown 1.5x after a step that lowered its loss, halved and the step
undone otherwise): one loss evaluation per iteration, and no unit's step depends on another's.
Every operation has one fixed shape per chunk, so a unit's result is the same bits in any batch.
Post-processing: noisy tables, their public variances and public totals only.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from ..segments import project_segments, round_segments

CHUNK_CELLS = 1 << 21
"""Joint cells per chunk array (16 MiB of doubles): a chunk holds max(2, min(256, CHUNK_CELLS // joint cells))
units, a public function of the joint's size, so every engine and batch computes a unit in the same shape."""
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

    def groups(self) -> list[tuple[tuple[int, ...], list[int]]]:
        """Tables grouped under shared intermediate margins: [(kept axes, table indices)]. Greedily, while
        some (k-1)-way margin (all axes but one) holds two or more tables not yet grouped, the one holding
        the most becomes an intermediate: its tables' margins are taken from it, and their update factors
        multiplied into it before it is broadcast into the joint. Tables left over form groups of their own
        (kept axes: the full joint). Public: from the shape alone."""
        k = len(self.sizes)
        left = list(range(len(self.tables)))
        groups = []
        while k > 2:
            best, held = None, []
            for dropped in range(k):
                inside = [i for i in left if dropped not in self.tables[i].axes]
                if len(inside) > len(held):
                    best, held = dropped, inside
            if len(held) < 2:
                break
            groups.append((tuple(a for a in range(k) if a != best), held))
            left = [i for i in left if i not in held]
        groups.extend((tuple(range(k)), [i]) for i in left)
        return groups


def chunk_units(cells: int) -> int:
    """Units per chunk for a joint of `cells` cells per unit."""
    return max(2, min(256, CHUNK_CELLS // max(cells, 1)))


def _margin(joint: np.ndarray, shape: JointShape, table: JointTable) -> np.ndarray:
    """The table's margin of a chunk (table dims in the table's order..., width)."""
    k = len(shape.sizes)
    other = tuple(a for a in range(k) if a not in table.axes)
    margin = joint.sum(axis=other) if other else joint
    kept = sorted(table.axes)
    order = [kept.index(a) for a in table.axes] + [len(kept)]
    return np.ascontiguousarray(np.transpose(margin, order))


def _broadcast(values: np.ndarray, shape: JointShape, table: JointTable) -> np.ndarray:
    """A table-shaped chunk array (table dims..., width) with axes to broadcast against the joint."""
    kept = sorted(table.axes)
    back = np.transpose(values, [table.axes.index(a) for a in kept] + [len(kept)])
    return back.reshape([shape.sizes[a] if a in table.axes else 1 for a in range(len(shape.sizes))]
                        + [values.shape[-1]])


def _chunk_rows(rows: np.ndarray, dims: tuple[int, ...], width: int) -> np.ndarray:
    """Units' rows (units x cells, at most `width` units) as a unit-minor chunk (dims..., width), zero padded."""
    out = np.zeros((math.prod(map(int, dims)) if dims else 1, width))
    out[:, :rows.shape[0]] = rows.T
    return out.reshape(tuple(dims) + (width,))


def _rows(chunk: np.ndarray, units: int) -> np.ndarray:
    return chunk.reshape(-1, chunk.shape[-1])[:, :units].T.copy()


def fit_joints(shape: JointShape, totals: np.ndarray, noisy: list[np.ndarray], estimates: list[np.ndarray],
               iterations: int) -> np.ndarray:
    """The fitted joint of every unit (units x joint cells): `noisy` and `estimates` hold, per table of
    `shape`, the units' noisy and least-squares tables (units x table cells)."""
    totals = np.asarray(totals, dtype=np.float64)
    out = np.empty((totals.size, shape.cells))
    width = chunk_units(shape.cells)
    for start in range(0, totals.size, width):
        rows = slice(start, min(start + width, totals.size))
        units = rows.stop - rows.start
        total = np.zeros(width)
        total[:units] = totals[rows]
        start_joint = _raked_start(shape, total, [e[rows] for e in estimates], units)
        fitted = _mirror_descent(shape, total, [_chunk_rows(n[rows].astype(np.float64), _dims(shape, t), width)
                                                for n, t in zip(noisy, shape.tables)], start_joint, iterations)
        out[rows] = _rows(fitted, units)
    return out


def _dims(shape: JointShape, table: JointTable) -> tuple[int, ...]:
    return tuple(shape.sizes[a] for a in table.axes)


def _raked_start(shape: JointShape, total: np.ndarray, estimates: list[np.ndarray], units: int) -> np.ndarray:
    """A nonnegative joint near the estimate: each table projected onto {x >= 0, sum = total}, raked to
    integer one-way margins shared by all tables, then the joint fitted to them by iterative proportional
    fitting from uniform."""
    one_way: dict[int, np.ndarray] = {}
    for table, estimate in zip(shape.tables, estimates):
        dims = _dims(shape, table)
        local = JointShape(dims, tuple(JointTable("", (i,), 1.0) for i in range(len(dims))))
        chunk = _chunk_rows(estimate, dims, total.size)
        for position, axis in enumerate(table.axes):
            if axis not in one_way:
                margin = _rows(_margin(chunk, local, local.tables[position]), units)
                one_way[axis] = _chunk_rows(_nonnegative_integers(margin, total[:units]).astype(np.float64),
                                            (dims[position],), total.size)
    targets = []
    for table, estimate in zip(shape.tables, estimates):
        dims = _dims(shape, table)
        target = _chunk_rows(_project_rows(estimate, total[:units]), dims, total.size)
        if len(table.axes) > 1:
            local = JointShape(dims, tuple(JointTable("", (i,), 1.0) for i in range(len(dims))))
            target = _ipf(local, [one_way[a] for a in table.axes], START_SWEEPS, target + RAKE_FLOOR)
        targets.append(target)
    uniform = np.broadcast_to(total / shape.cells, tuple(shape.sizes) + (total.size,)).copy()
    return _ipf(shape, targets, START_SWEEPS, uniform)


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


def _ipf(shape: JointShape, targets: list[np.ndarray], sweeps: int, joint: np.ndarray) -> np.ndarray:
    """Iterative proportional fitting of a chunk's joints to nonnegative table targets (totals kept)."""
    joint = joint.copy()
    for _ in range(sweeps):
        for table, target in zip(shape.tables, targets):
            current = _margin(joint, shape, table)
            with np.errstate(invalid="ignore", divide="ignore"):
                ratio = np.where(current > 0, target / np.where(current > 0, current, 1.0), 0.0)
            joint *= _broadcast(ratio, shape, table)
    return joint


def _all_margins(joint: np.ndarray, shape: JointShape, groups) -> list[np.ndarray]:
    """Every table's margin of a chunk, each group's tables from one intermediate margin."""
    margins: list[np.ndarray | None] = [None] * len(shape.tables)
    for kept, members in groups:
        if len(kept) == len(shape.sizes):
            for i in members:
                margins[i] = _margin(joint, shape, shape.tables[i])
            continue
        dropped = next(a for a in range(len(shape.sizes)) if a not in kept)
        partial = joint.sum(axis=dropped)
        local = JointShape(tuple(shape.sizes[a] for a in kept), ())
        for i in members:
            table = shape.tables[i]
            margins[i] = _margin(partial, local, JointTable(table.name, tuple(kept.index(a) for a in table.axes), 1.0))
    return margins


def _updated(joint: np.ndarray, shape: JointShape, groups, exponents: list[np.ndarray],
             scale: np.ndarray) -> np.ndarray:
    """joint * scale * exp(-step * gradient) for a chunk (`scale` per unit): the product over tables of each
    table's factor broadcast into the joint, each group's factors multiplied in its intermediate shape first,
    the scale multiplied into the first factor (no pass of its own over the joint)."""
    out = None
    scale = scale.reshape((1,) * len(shape.sizes) + (scale.size,))
    for kept, members in groups:
        if len(kept) == len(shape.sizes):
            factors = [_broadcast(np.exp(exponents[i]), shape, shape.tables[i]) for i in members]
        else:
            local = JointShape(tuple(shape.sizes[a] for a in kept), ())
            partial = None
            for i in members:
                table = shape.tables[i]
                factor = _broadcast(np.exp(exponents[i]), local,
                                    JointTable(table.name, tuple(kept.index(a) for a in table.axes), 1.0))
                partial = factor if partial is None else partial * factor
            dropped = next(a for a in range(len(shape.sizes)) if a not in kept)
            factors = [np.expand_dims(partial, dropped)]
        for factor in factors:
            if out is None:
                out = joint * (factor * scale)
            else:
                out *= factor
    return out


def _loss_terms(joint: np.ndarray, shape: JointShape, noisy: list[np.ndarray], variances: list[float], groups=None,
                total: np.ndarray | None = None):
    """Per unit loss sum_t ||margin_t - y_t||^2 / v_t, and per table the gradient factor's exponent
    2 (margin_t - y_t) / v_t, and the scale: given `total`, each of those is of the joint scaled to sum to it, the
    scale (per unit) applied to the (small) margins only; None without."""
    width = joint.shape[-1]
    loss = np.zeros(width)
    gradients = []
    margins = _all_margins(joint, shape, groups if groups is not None else shape.groups())
    scale = None
    if total is not None:
        scale = _scale_to(margins[0].reshape(-1, width).sum(axis=0), total)
        margins = [m * scale for m in margins]
    for table, y, variance, margin in zip(shape.tables, noisy, variances, margins):
        residual = margin - y
        loss += (residual * residual).reshape(-1, width).sum(axis=0) / variance
        gradients.append(2.0 * residual / variance)
    return loss, gradients, scale


def _shifted(exponents: np.ndarray) -> np.ndarray:
    """A table's exponents less their largest per unit: every factor at most 1, so their product never overflows
    (the normalisation that follows cancels a per-unit constant factor)."""
    return exponents - exponents.reshape(-1, exponents.shape[-1]).max(axis=0)


def _scale_to(sums: np.ndarray, total: np.ndarray) -> np.ndarray:
    """Per unit, the factor taking a joint summing to `sums` to `total` (0 for an empty joint)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(sums > 0, total / np.where(sums > 0, sums, 1.0), 0.0)


def _normalised(joint: np.ndarray, total: np.ndarray) -> np.ndarray:
    joint *= _scale_to(joint.reshape(-1, joint.shape[-1]).sum(axis=0), total)
    return joint


def _mirror_descent(shape: JointShape, total: np.ndarray, noisy: list[np.ndarray], start: np.ndarray,
                    iterations: int) -> np.ndarray:
    measured = [(t, y, max(t.variance, MIN_VARIANCE)) for t, y in zip(shape.tables, noisy) if t.variance > 0]
    if not measured:
        return start
    fit = JointShape(shape.sizes, tuple(t for t, _, _ in measured))
    groups = fit.groups()
    ys, variances = [y for _, y, _ in measured], [v for _, _, v in measured]
    width = total.size
    mean = (total / shape.cells).reshape((1,) * len(shape.sizes) + (width,))
    joint = _normalised(np.maximum(start, START_FLOOR * mean), total)
    loss, gradients, _ = _loss_terms(joint, fit, ys, variances, groups)  # the start sums to the totals
    scale = np.ones(width)  # the joint is `joint * scale`: each step's normalisation rides on the next update
    largest = np.zeros(width)
    for g in gradients:
        largest += np.abs(g).reshape(-1, width).max(axis=0)
    step = 1.0 / np.maximum(largest, 1e-12)
    for _ in range(iterations):
        exponents = [_shifted(np.clip(-step * g, -EXPONENT_CLIP, EXPONENT_CLIP)) for g in gradients]
        candidate = _updated(joint, fit, groups, exponents, scale)
        candidate_loss, candidate_gradients, candidate_scale = _loss_terms(candidate, fit, ys, variances, groups,
                                                                           total)
        # a step is kept when it does not raise the loss and leaves a joint to scale: factors clipped at
        # exp(-EXPONENT_CLIP) each can underflow a whole unit's joint to 0, whose loss may be the lower one
        better = (candidate_loss <= loss) & ((candidate_scale > 0) | (total == 0))
        if better.all():
            joint, loss, gradients, scale = candidate, candidate_loss, candidate_gradients, candidate_scale
        else:
            joint = np.where(better, candidate, joint)
            loss = np.where(better, candidate_loss, loss)
            scale = np.where(better, candidate_scale, scale)
            gradients = [np.where(better, new, old) for new, old in zip(candidate_gradients, gradients)]
        step = np.where(better, np.minimum(step * 1.5, MAX_STEP), step / 2.0)
    joint *= scale
    return joint


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


def _model_tree(shape: JointShape):
    """(The attribute names, their sizes, the junction tree of every table's attributes): a capped model's."""
    from .graphical import junction_tree

    names = tuple(str(a) for a in range(len(shape.sizes)))
    sizes = {n: int(size) for n, size in zip(names, shape.sizes)}
    return names, sizes, junction_tree(names, [tuple(names[a] for a in t.axes) for t in shape.tables], sizes)


def _model_path(shape: JointShape, totals: np.ndarray, estimates: list[np.ndarray],
                converged: bool = False) -> list[np.ndarray]:
    """The 'model' path: a `select: aim` query's 1-way tables and its chosen tables (which may close cycles) as
    the margins of one graphical model per unit (`graphical`): its junction tree fitted by weighted least squares
    to their estimates (`graphical.fit`, FIT_ITERATIONS from `graphical.measured_start`, the unit totals fixed;
    the 'converged_model' path, `converged`: until each unit's loss settles, CONVERGENCE_TOLERANCE, at most
    CONVERGENCE_LIMIT iterations), its maximal cliques' tables made
    nonnegative integers adding up exactly (`graphical.integer_tables`) and each published table summed from the
    first clique holding it: every shared margin and total agrees exactly."""
    from . import graphical

    names, sizes, tree = _model_tree(shape)
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
    `joints`, when given, receives each chunk's rounded joint (path 'joint')."""
    totals = np.asarray(totals, dtype=np.int64)
    out = [np.empty((totals.size, shape.table_cells(t)), dtype=np.int64) for t in shape.tables]
    if path in ("model", "converged_model"):  # the fit holds about ten arrays of the model's cells
        _, sizes, tree = _model_tree(shape)
        width = chunk_units(10 * tree.cells(sizes))
    elif path in ("tree", "junction"):
        width = chunk_units(sum(shape.table_cells(t) for t in shape.tables))
    else:
        width = chunk_units(shape.cells)
    for start in range(0, totals.size, width):
        rows = slice(start, min(start + width, totals.size))
        unit_totals = totals[rows]
        if path in ("tree", "junction", "model", "converged_model"):
            kernel = {"tree": _tree_path, "junction": _junction_path, "model": _model_path,
                      "converged_model": functools.partial(_model_path, converged=True)}[path]
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
