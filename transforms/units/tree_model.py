"""Records from a tree of 2-way tables, per unit: the graphical model MST fits (a junction tree whose cliques
are the measured pairs and whose separators are single attributes), drawn without ever forming the joint.

Per unit, the root attribute's records follow its 1-way table; then, edge by edge away from the root, the
records holding value v of the parent are dealt child values in proportion to row v of the pair's table
(the child given the parent, as the tree model says), by controlled rounding (largest remainder: the
counts add up to the records exactly), the records in an order shuffled by a public seed so a child's value
is independent of the attributes already drawn given its parent. Where the pair's table and the parent's
records agree (the published tables are consistent), the records tabulate to the pair's table exactly.
Cost: O(records x attributes + units x pair cells); no array has the joint's size.
Post-processing: published tables and a public seed only.
"""
from __future__ import annotations

import numpy as np


def largest_remainder(totals: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Integer rows adding up to `totals` (one per row of `weights`, nonnegative), in proportion to each row
    (uniform where a row is all zero): floors, then one more to the largest remainders (ties: lower index)."""
    weights = np.maximum(np.asarray(weights, dtype=np.float64), 0.0)
    sums = weights.sum(axis=1, keepdims=True)
    shares = np.where(sums > 0, weights / np.where(sums > 0, sums, 1.0), 1.0 / weights.shape[1])
    expected = np.asarray(totals, dtype=np.float64)[:, None] * shares
    base = np.floor(expected).astype(np.int64)
    short = np.asarray(totals, dtype=np.int64) - base.sum(axis=1)
    order = np.argsort(-(expected - base), axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(weights.shape[1])[None, :].repeat(weights.shape[0], 0), axis=1)
    return base + (rank < short[:, None])


def tree_edges(attributes: list[str], pairs: list[tuple[str, str]]) -> list[tuple[str, str, int]]:
    """The pairs as (parent, child, index of the pair) edges directed away from the first attribute, in
    breadth-first order; every attribute reached (the pairs must span them)."""
    neighbours: dict[str, list[tuple[str, int]]] = {a: [] for a in attributes}
    for i, (a, b) in enumerate(pairs):
        neighbours[a].append((b, i))
        neighbours[b].append((a, i))
    seen, frontier, edges = {attributes[0]}, [attributes[0]], []
    while frontier:
        parent = frontier.pop(0)
        for child, i in neighbours[parent]:
            if child not in seen:
                seen.add(child)
                frontier.append(child)
                edges.append((parent, child, i))
    if len(seen) != len(attributes):
        raise ValueError(f"the pairs do not reach {sorted(set(attributes) - seen)}")
    return edges


def tree_tables(unit_totals: np.ndarray, root_table: np.ndarray, attributes: list[str],
                pairs: list[tuple[str, str]], pair_tables: list[np.ndarray]) -> tuple[dict, list[np.ndarray]]:
    """Nonnegative integer tables of a tree model that add up exactly, per unit: (each attribute's 1-way table
    (units, size), each pair's table (units, size a, size b)). The root's table is `root_table` rounded to the
    unit totals; down each edge, the records of each parent value are dealt to child values in proportion to
    the pair's row (largest remainder; a row with no weight takes the pair's child margin in the unit). So
    every pair's table has the 1-way tables of its attributes as margins, and all add up to the unit totals.
    Post-processing: a unit's tables depend on that unit's inputs only."""
    units = unit_totals.size
    one_way = {attributes[0]: largest_remainder(unit_totals, root_table.reshape(units, -1))}
    out: list[np.ndarray | None] = [None] * len(pairs)
    for parent, child, i in tree_edges(attributes, pairs):
        table = np.maximum(np.asarray(pair_tables[i], dtype=np.float64), 0.0)
        rows = table if pairs[i][0] == parent else np.swapaxes(table, 1, 2)  # (units, parent, child)
        parent_size, child_size = rows.shape[1], rows.shape[2]
        weights = rows.reshape(units * parent_size, child_size).copy()
        empty = weights.sum(axis=1) <= 0  # a parent value the pair gives no weight: the child's margin in the unit
        if empty.any():
            weights[empty] = np.repeat(rows.sum(axis=1), parent_size, axis=0)[empty]
        dealt = largest_remainder(one_way[parent].reshape(-1), weights).reshape(units, parent_size, child_size)
        one_way[child] = dealt.sum(axis=1)
        out[i] = dealt if pairs[i][0] == parent else np.swapaxes(dealt, 1, 2)
    return one_way, out


def sample_tree(unit_totals: np.ndarray, root_table: np.ndarray, attributes: list[str],
                pairs: list[tuple[str, str]], pair_tables: list[np.ndarray], seed: int) -> tuple[np.ndarray, dict]:
    """(each record's unit, each attribute's code per record) for `unit_totals` records per unit, tabulating
    exactly to `tree_tables` of the same inputs (which are the inputs themselves when those add up already).

    `root_table`: (units, size) table of the first attribute; `pair_tables[i]`: (units, size a, size b) table
    of pairs[i] = (a, b). Records are grouped by unit, then by root value; each edge's child values are dealt
    to the parent's records in an order shuffled by `seed` (public)."""
    units = unit_totals.size
    one_way, tables = tree_tables(unit_totals, root_table, attributes, pairs, pair_tables)
    rng = np.random.default_rng(seed)
    root_counts = one_way[attributes[0]]
    unit = np.repeat(np.arange(units), unit_totals.astype(np.int64))
    codes = {attributes[0]: np.repeat(np.tile(np.arange(root_counts.shape[1]), units), root_counts.ravel())}
    for parent, child, i in tree_edges(attributes, pairs):
        dealt = tables[i] if pairs[i][0] == parent else np.swapaxes(tables[i], 1, 2)  # (units, parent, child)
        parent_size, child_size = dealt.shape[1], dealt.shape[2]
        group = unit * parent_size + codes[parent]
        order = np.lexsort((rng.random(group.size), group))
        child_codes = np.empty(group.size, dtype=np.int64)
        child_codes[order] = np.repeat(np.tile(np.arange(child_size), units * parent_size), dealt.ravel())
        codes[child] = child_codes
    return unit, codes
