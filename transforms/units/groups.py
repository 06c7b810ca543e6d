"""How the units of each level are grouped for the passes: a public function of the tree alone.

The down pass from level i-1 to level i needs, in one place, a parent and all of its children (their
final totals share the parent's, their integers add up to the parent's), so its unit of work is a group
of consecutive parents and all their children, sized so that the children hold at most `budget` cells
(a parent whose children alone exceed it forms a group of its own). The up pass into level i-1 uses the
same groups. A group is also the part in which the children's tables are written (tables/NAME/part-K),
so every engine writes the same files. Units are in code order, so a group's children are a contiguous
range of the level below.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .tree import UnitTree

GROUP_CELLS = 4_000_000
"""Children's cells per group (a few hundred MiB of work arrays): the memory a worker needs per group."""


@dataclass(frozen=True)
class Transition:
    """The groups of the pass between level `index - 1` (parents) and level `index` (children)."""

    index: int
    parent_start: np.ndarray  # first parent of each group, and the number of parents last
    child_start: np.ndarray   # first child of each group, and the number of children last

    @property
    def count(self) -> int:
        return self.parent_start.size - 1

    def group_of_parent(self) -> np.ndarray:
        return np.repeat(np.arange(self.count), np.diff(self.parent_start))

    def group_of_child(self) -> np.ndarray:
        return np.repeat(np.arange(self.count), np.diff(self.child_start))


def transitions(tree: UnitTree, budget: int = GROUP_CELLS) -> list[Transition]:
    """Per level below the root, the groups of its pass (see the module docstring)."""
    out = []
    for level in tree.levels[1:]:
        parents = tree.levels[level.index - 1].units
        children = np.bincount(level.parent, minlength=parents)
        first_child = np.concatenate([[0], np.cumsum(children)])
        cells = children * max(level.size, 1)
        parent_start, running = [0], 0
        for p in range(parents):
            if running and running + cells[p] > budget:
                parent_start.append(p)
                running = 0
            running += cells[p]
        parent_start.append(parents)
        starts = np.asarray(parent_start, dtype=np.int64)
        out.append(Transition(level.index, starts, first_child[starts]))
    return out
