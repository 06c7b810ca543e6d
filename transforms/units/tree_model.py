"""Records from a junction tree of measured tables, per unit, drawn without ever forming the joint: the
graphical model MST fits (cliques: the measured pairs; separators: single attributes) and the one a
`select: aim` query grows (cliques of up to degree + 1 attributes, each adding one attribute to a separator
inside an earlier clique).

Per unit, the root attribute's records follow its 1-way table; then, clique by clique away from the root, the
records holding value v of the separator are dealt values of the new attribute in proportion to row v of the
clique's table (the new attribute given its separator, as the model says), fitted by least squares to
nonnegative integers that add up to the separator's count exactly, and dealt evenly along the records sorted by
their earlier attributes (`dealing`, keyed by a public seed), so a child's value is independent of the attributes
already drawn given its parent in expectation, and every run of records sharing them gets its share within
`dealing`'s bound. Where the pair's table and the parent's records agree (the published tables are consistent),
the records tabulate to the pair's table exactly.
Cost: O(records x attributes + units x clique cells); no array has the joint's size.
Post-processing: published tables and a public seed only.
"""
from __future__ import annotations

import math
import numpy as np

from ..segments import project_segments, round_segments
from .dealing import by_domain, dealt_cells


def fitted_rows(rows: np.ndarray, totals: np.ndarray) -> np.ndarray:
    """Each row of estimates as the closest (least squares) nonnegative integers adding up to its integer
    total: projected onto {x >= 0, sum x = total}, then controlled rounding (`segments`). Row by row: a row's
    result depends on that row alone."""
    count, width = rows.shape
    segments = np.repeat(np.arange(count), width)
    totals = np.asarray(totals, dtype=np.int64)
    projected = project_segments(np.asarray(rows, dtype=np.float64).ravel(), segments, totals.astype(np.float64))
    return round_segments(projected, segments, totals).reshape(count, width)


RARE_SIGMAS = 1.0
"""A child value whose estimated count in the unit is below this many noise standard deviations is rare: a
row's cells at rare values are pooled (MST's domain compression, here as post-processing). Measured on Adult
(benchmarks/synthetic_adult.py, 2-way workload): 0.203 -> 0.168 at epsilon = 0.3, 0.127 -> 0.115 at 1; 2 and 3
sigmas (MST's choice) within 0.005 of it."""


def pooled_rare(rows: np.ndarray, share: np.ndarray, rare: np.ndarray) -> np.ndarray:
    """Each row's cells at its rare values replaced by their sum dealt in proportion to `share` (the child's
    margin) among them: one noisy total per row instead of many noisy cells. Row by row."""
    weights = np.where(rare, share, 0.0)
    total = np.where(rare, rows, 0.0).sum(axis=1, keepdims=True)
    mass = weights.sum(axis=1, keepdims=True)
    spread = np.where(mass > 0, weights / np.where(mass > 0, mass, 1.0), rare / np.maximum(rare.sum(1, keepdims=True), 1))
    return np.where(rare, total * spread, rows)


def shrunk_rows(rows: np.ndarray, child_margin: np.ndarray, variance: float) -> np.ndarray:
    """Each row of a pair's estimate (the child given one parent value), its rare values pooled
    (`pooled_rare`), shrunk toward the child's margin scaled to the row's sum (the pair independent at that
    value) by the James-Stein factor
    max(0, 1 - (m - 2) variance / ||residual||^2) of its m cells: a row whose departure from independence is
    within its noise keeps little of it, a strong one nearly all. On Adult at epsilon = 1 this lowers the
    synthetic data's 2-way workload error from 0.36 to 0.13 (sparse rows of 100-value attributes were mostly
    noise). Post-processing: noisy estimates and the public noise variance; row by row."""
    margin = np.maximum(child_margin, 0.0)
    sums = margin.sum(axis=1, keepdims=True)
    share = np.where(sums > 0, margin / np.where(sums > 0, sums, 1.0), 1.0 / margin.shape[1])
    prior = rows.sum(axis=1, keepdims=True) * share
    rows = pooled_rare(rows, share, child_margin < RARE_SIGMAS * np.sqrt(variance))
    residual = rows - prior
    power = (residual ** 2).sum(axis=1, keepdims=True)
    keep = np.clip(1.0 - (rows.shape[1] - 2) * variance / np.where(power > 0, power, 1.0), 0.0, 1.0)
    return prior + keep * residual


def dependence_score(table: np.ndarray, variance: float) -> float:
    """How much a pair's table (units, a, b) departs from its margins' product, beyond its noise: the L1 distance
    between the table (made nonnegative) and the product of its margins per unit, less AIM's expected L1 error
    of its noise, sqrt(2/pi) sigma per cell (the criterion of MST's selection, here on published values).
    Post-processing: published tables and their public noise variance."""
    table = np.maximum(np.asarray(table, dtype=np.float64), 0.0)
    totals = table.sum(axis=(1, 2), keepdims=True)
    product = table.sum(axis=2, keepdims=True) * table.sum(axis=1, keepdims=True) / np.where(totals > 0, totals, 1.0)
    return float(np.abs(table - product).sum() - np.sqrt(2 / np.pi) * np.sqrt(variance) * table.size)


def spanning_tree(attributes: list[str], scores: dict[tuple[str, str], float]) -> list[tuple[str, str]]:
    """The maximum spanning tree of `attributes` under the pairs' `scores` (Kruskal; ties by the pairs' order in
    `scores`): the pairs a tree model keeps when every pair's table was published. Post-processing."""
    from ..mst import Components

    parts, chosen = Components(attributes), []
    for pair in sorted(scores, key=lambda p: -scores[p]):  # stable: ties keep their order
        if parts.join(*pair):
            chosen.append(pair)
    return chosen


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


Step = tuple[tuple[str, ...], str, np.ndarray]
"""One clique of a junction tree, in the order the model grows: (separator, new attribute, the clique's table
(units, separator sizes..., new attribute's size)). The separator lies inside the root or an earlier clique."""


def separator_counts(separator: tuple[str, ...], one_way: dict, fitted: list[tuple[tuple[str, ...], np.ndarray]]
                     ) -> np.ndarray:
    """The integer table of `separator` per unit (units, sizes in its order): a 1-way table, or the margin of the
    first fitted clique that holds it (every clique holding it has the same margin: the tables add up)."""
    if len(separator) == 1:
        return one_way[separator[0]]
    attributes, table = next((a, t) for a, t in fitted if set(separator) <= set(a))
    dropped = tuple(1 + i for i, a in enumerate(attributes) if a not in separator)
    kept = [a for a in attributes if a in separator]
    margin = table.sum(axis=dropped) if dropped else table
    return np.transpose(margin, [0] + [1 + kept.index(a) for a in separator])


def junction_tables(unit_totals: np.ndarray, root: str, root_table: np.ndarray, steps: list[Step],
                    margins: dict | None = None, variances: list[float] | None = None
                    ) -> tuple[dict, list[np.ndarray]]:
    """Nonnegative integer tables of a junction tree that add up exactly, per unit: (each attribute's 1-way table
    (units, size), each step's clique table (units, separator sizes..., new attribute's size)). The root's
    table is `root_table` fitted to the unit totals; then clique by clique, row s of its table (the new
    attribute given separator value s), shrunk toward the new attribute's margin when `margins` (each
    attribute's estimated 1-way table) and the cliques' noise `variances` are given (`shrunk_rows`), is fitted
    to the separator's count of s (`fitted_rows`). So every clique's margin on its separator is the table that
    separator already has, and all add up to the unit totals.
    Post-processing: a unit's tables depend on that unit's inputs only."""
    units = unit_totals.size
    one_way = {root: fitted_rows(root_table.reshape(units, -1), unit_totals)}
    fitted: list[tuple[tuple[str, ...], np.ndarray]] = []
    for i, (separator, child, table) in enumerate(steps):
        rows = np.asarray(table, dtype=np.float64)
        separator_cells, child_size = math.prod(map(int, rows.shape[1:-1])), rows.shape[-1]
        flat = rows.reshape(units * separator_cells, child_size)
        if margins is not None:
            flat = shrunk_rows(flat, np.repeat(margins[child], separator_cells, axis=0), variances[i])
        dealt = fitted_rows(flat, separator_counts(separator, one_way, fitted).reshape(-1)).reshape(rows.shape)
        one_way[child] = dealt.sum(axis=tuple(range(1, dealt.ndim - 1)))
        fitted.append((separator + (child,), dealt))
    return one_way, [table for _, table in fitted]


def sample_junction(unit_totals: np.ndarray, root: str, root_table: np.ndarray, steps: list[Step], seed: int,
                    margins: dict | None = None, variances: list[float] | None = None) -> tuple[np.ndarray, dict]:
    """(each record's unit, each attribute's code per record) for `unit_totals` records per unit, tabulating
    exactly to `junction_tables` of the same inputs (which are the inputs themselves when those add up already).
    Records are grouped by unit, then by root value; each clique's new values are dealt evenly to the records of
    each separator value (`dealing.dealt_cells`, keyed by `seed`, public), so a new value is independent of the
    attributes already drawn given its separator in expectation (the junction tree's model)."""
    units = unit_totals.size
    one_way, tables = junction_tables(unit_totals, root, root_table, steps, margins, variances)
    rng = np.random.default_rng(seed)
    root_counts = one_way[root]
    unit = np.repeat(np.arange(units), unit_totals.astype(np.int64))
    codes = {root: np.repeat(np.tile(np.arange(root_counts.shape[1]), units), root_counts.ravel())}
    for (separator, child, _), dealt in zip(steps, tables):
        group = unit
        for attribute, size in zip(separator, dealt.shape[1:-1]):
            group = group * size + codes[attribute]
        codes[child] = dealt_cells(group, dealt.reshape(-1, dealt.shape[-1]),
                                   by_domain(codes, {a: t.shape[1] for a, t in one_way.items()}, separator), rng)
    return unit, codes


def tree_steps(attributes: list[str], pairs: list[tuple[str, str]], pair_tables: list[np.ndarray]
               ) -> tuple[list[tuple[str, str, int]], list[Step]]:
    """A tree of pairs as junction steps away from the first attribute (`tree_edges`), each pair's table as
    (units, parent, child)."""
    edges = tree_edges(attributes, pairs)
    steps = []
    for parent, child, i in edges:
        table = np.asarray(pair_tables[i], dtype=np.float64)
        steps.append(((parent,), child, table if pairs[i][0] == parent else np.swapaxes(table, 1, 2)))
    return edges, steps


def tree_tables(unit_totals: np.ndarray, root_table: np.ndarray, attributes: list[str],
                pairs: list[tuple[str, str]], pair_tables: list[np.ndarray], margins: dict | None = None,
                variances: list[float] | None = None) -> tuple[dict, list[np.ndarray]]:
    """`junction_tables` of a tree of 2-way tables rooted at the first attribute: (each attribute's 1-way table
    (units, size), each pair's table (units, size a, size b)), nonnegative integers that add up exactly, per
    unit (every pair's margins are the 1-way tables).
    Post-processing: a unit's tables depend on that unit's inputs only."""
    edges, steps = tree_steps(attributes, pairs, pair_tables)
    one_way, dealt = junction_tables(unit_totals, attributes[0], root_table, steps, margins,
                                     None if variances is None else [variances[i] for _, _, i in edges])
    out: list[np.ndarray | None] = [None] * len(pairs)
    for (parent, _, i), table in zip(edges, dealt):
        out[i] = table if pairs[i][0] == parent else np.swapaxes(table, 1, 2)
    return one_way, out


def sample_tree(unit_totals: np.ndarray, root_table: np.ndarray, attributes: list[str],
                pairs: list[tuple[str, str]], pair_tables: list[np.ndarray], seed: int, margins: dict | None = None,
                variances: list[float] | None = None) -> tuple[np.ndarray, dict]:
    """`sample_junction` along a tree of 2-way tables rooted at the first attribute: records tabulating exactly
    to `tree_tables` of the same inputs. `root_table`: (units, size) table of the first attribute;
    `pair_tables[i]`: (units, size a, size b) table of pairs[i] = (a, b)."""
    edges, steps = tree_steps(attributes, pairs, pair_tables)
    return sample_junction(unit_totals, attributes[0], root_table, steps, seed, margins,
                           None if variances is None else [variances[i] for _, _, i in edges])
