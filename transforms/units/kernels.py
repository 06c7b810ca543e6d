"""The per-group kernels of post-processing over a tree of units: what a worker runs for one group.

up    `up_group`: a group's parents' blocks and their children's subtree estimates in; each parent's block
      estimate, its own total and its subtree estimate (and variance) out.
down  `down_group`: a group's parents' final totals, variances and hierarchy integers, and their children's
      up state in; the children's final totals, variances, hierarchy integers, and every table's estimates,
      variances and published integers at the children's level out.
`root` runs the down step of the top level. Arrays hold units in rows, in unit (code) order; each kernel
computes a unit from its own rows and its parent's, so any grouping gives the same bits.
Post-processing: noisy values, public variances and structure only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import integers
from .estimate import combine_up, final_estimate, final_variances, own_estimate, split_down, sum_by_parent
from .joint import JointShape, JointTable, marginal_tables
from .tree import Level, UnitTree

JOINT_ITERATIONS = 50
"""Mirror-descent iterations of the joint fit from its raked start (per unit, each with its own step)."""


@dataclass
class UpState:
    """A level's units after the up pass (rows: units)."""

    block: np.ndarray        # own block estimate (units x cells)
    own_total: np.ndarray    # (units x copies)
    subtree: np.ndarray      # (units x copies)
    subtree_var: np.ndarray  # (units x copies)


@dataclass
class DownState:
    """A level's units after the down pass: what their children need (rows: units)."""

    final: np.ndarray                 # final totals (units x copies)
    final_var: np.ndarray             # their variances
    integers: dict[str, np.ndarray] = field(default_factory=dict)  # hierarchy query -> (units x by cells)


@dataclass
class LevelOutput:
    """Per table at a level: estimates, their variances and published integers (units x table cells)."""

    estimates: dict[str, np.ndarray]
    variances: dict[str, np.ndarray]
    published: dict[str, np.ndarray]


def up_group(level: Level, noisy: np.ndarray, children: UpState | None, child_parent: np.ndarray | None) -> UpState:
    """The up step for units of `level` (their noisy blocks, rows) given all their children's up state
    (`child_parent`: each child's row among these units)."""
    units = noisy.shape[0]
    if level.size:
        block, own_total = own_estimate(level, noisy)
    else:
        block, own_total = np.zeros((units, 0)), np.zeros((units, level.copies))
    if children is None:
        subtree, subtree_var = combine_up(own_total, level.total_var, None, None)
    else:
        subtree, subtree_var = combine_up(own_total, level.total_var,
                                          sum_by_parent(children.subtree, child_parent, units),
                                          sum_by_parent(children.subtree_var, child_parent, units))
    return UpState(block, own_total, subtree, subtree_var)


def root(tree: UnitTree, state: UpState, noisy: np.ndarray) -> tuple[DownState, LevelOutput]:
    """The down step of the top level (its final totals are its subtree estimates)."""
    level = tree.levels[0]
    final, final_var = state.subtree.copy(), state.subtree_var.copy()
    return _finish(tree, level, state, noisy, final, final_var, None, None)


def down_group(tree: UnitTree, level: Level, parents: DownState, children: UpState, noisy: np.ndarray,
               child_parent: np.ndarray) -> tuple[DownState, LevelOutput]:
    """The down step for a group: `parents` (rows: the group's parents), `children` and their `noisy`
    blocks (rows: all the parents' children, in order), `child_parent` each child's parent row."""
    count = parents.final.shape[0]
    sibling_sum = sum_by_parent(children.subtree, child_parent, count)
    sibling_var = sum_by_parent(children.subtree_var, child_parent, count)
    final, final_var = split_down(children.subtree, children.subtree_var, child_parent, parents.final,
                                  parents.final_var, sibling_sum, sibling_var)
    return _finish(tree, level, children, noisy, final, final_var, parents.integers, child_parent)


def _finish(tree: UnitTree, level: Level, state: UpState, noisy: np.ndarray, final: np.ndarray,
            final_var: np.ndarray, parent_integers, child_parent) -> tuple[DownState, LevelOutput]:
    estimate = final_estimate(level, state.block, state.own_total, final) if level.size else state.block
    variance = final_variances(level, final_var) if level.size else state.block
    estimates = {b.table.name: estimate[:, b.offset:b.offset + b.size] for b in level.tables}
    variances = {b.table.name: variance[:, b.offset:b.offset + b.size] for b in level.tables}
    noisy_tables = {b.table.name: noisy[:, b.offset:b.offset + b.size] for b in level.tables}
    published: dict[str, np.ndarray] = {}
    down = DownState(final, final_var)
    for h in tree.hierarchies:
        if level.name not in h.levels:
            continue
        name = h.tables[h.levels.index(level.name)]
        if h.levels.index(level.name) == 0:
            published[name] = integers.rounded(estimates[name])
        else:
            published[name] = integers.children(estimates[name], child_parent, parent_integers[h.name])
        down.integers[h.name] = published[name]
    for m in tree.marginals:
        if m.level != level.name:
            continue
        totals = published[m.totals_from][:, 0] if m.totals_from else \
            integers.rounded(estimates[m.tables[0]].sum(axis=1))
        shape = marginals_shape(tree, m)
        tables = marginal_tables(shape, totals, [noisy_tables[t] for t in m.tables], [estimates[t] for t in m.tables],
                                 JOINT_ITERATIONS, m.path)
        published.update(zip(m.tables, tables))
    for name, values in estimates.items():
        if name not in published:
            published[name] = integers.rounded(values)
    return down, LevelOutput(estimates, variances, published)


def marginals_shape(tree: UnitTree, query) -> JointShape:
    """The joint of a marginals query within a level, from its tables' attribute dimensions."""
    level = tree.level_of(query.tables[0])
    blocks = [level.table(t) for t in query.tables]
    attributes = list(dict.fromkeys((a, s) for b in blocks for a, s in zip(b.attributes, b.shape)))
    names = [a for a, _ in attributes]
    return JointShape(tuple(s for _, s in attributes),
                      tuple(JointTable(b.table.name, tuple(names.index(a) for a in b.attributes), b.table.variance)
                            for b in blocks))
