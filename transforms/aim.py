"""An AIM-style adaptive selection (McKenna et al. 2022), engine-neutral: which tables a `select: aim` marginals
query measures, round by round, each chosen against the model fitted to the measurements made so far, where the
model is a junction tree grown one attribute a round: every `select: aim` release of manifest version 7 or
earlier, and from version 8 a query past `aim_model.uses_cycles` (candidates x attributes^2, units; the others choose
over a graphical model, tables that close cycles included: `transforms.aim_model`).

Every attribute's 1-way table is measured first. The model grows as a junction tree: the first round picks a
pair of attributes, every later round a clique made of one attribute the model does not hold yet and a
separator of 1 to `degree` attributes inside a clique already measured (PrivBayes' Bayesian network of degree
k, Zhang et al. 2017, with AIM's choice of each clique against the current model). A candidate's estimate is
what the model says of it: the separator's table fitted from the released measurements
(`units.tree_model.junction_tables`) times the new attribute's distribution from its released 1-way table
(the model holds nothing else about it), rounded per cell (`mst.CliqueEstimate`). Its score is the L1 distance
between its bounded counts and that estimate, less the expected L1 error of measuring it (`mst.noise_penalty`,
public per candidate), times its workload weight (public): the cliques the model gets most wrong, beyond what
their measurement's noise would cost. Each chosen clique is measured (and released) before the next round.

Privacy: each round is one exact exponential-mechanism draw (`mst.draw_round`) on scores whose sensitivity is
the count table's (one unit moves the L1 distance to a fixed estimate by at most its records' change) times
the largest weight (`accounting.sensitivity.mst_score_sensitivity`); the candidates and estimates of a round are
functions of earlier rounds' released outputs only (public), so the rounds and measurements compose
adaptively. The true counts are read by `mst.range_score` only, where each engine holds them.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from .mst import CliqueEstimate

Clique = tuple[str, ...]
"""Attributes of one measured table, in the query's order."""


def clique_of(attributes: list[str], members) -> Clique:
    """The members in the query's order."""
    members = set(members)
    return tuple(a for a in attributes if a in members)


def separators(cliques: list[Clique], degree: int) -> list[Clique]:
    """Every separator a new attribute may join: the non-empty subsets of at most `degree` attributes of the
    cliques chosen so far, each once, in the order they first appear (clique by clique, smaller first, then in
    the query's order)."""
    found: list[Clique] = []
    for clique in cliques:
        for size in range(1, min(degree, len(clique)) + 1):
            for subset in itertools.combinations(clique, size):
                if subset not in found:
                    found.append(subset)
    return found


def round_candidates(attributes: list[str], cliques: list[Clique], degree: int) -> list[tuple[Clique, str]]:
    """The candidates of the next round as (separator, new attribute): every pair (a, b), a before b in the
    query's order, in the first round; afterwards every separator of the cliques so far (`separators`) with
    every attribute the model does not hold yet. Public: the query and earlier rounds' choices only."""
    if not cliques:
        return [((a,), b) for a, b in itertools.combinations(attributes, 2)]
    held = {a for clique in cliques for a in clique}
    new = [a for a in attributes if a not in held]
    return [(separator, x) for separator in separators(cliques, degree) for x in new]


def junction_steps(attributes: list[str], cliques: list[Clique], degree: int) -> list[tuple[Clique, str]]:
    """Each clique of a grown junction tree as (separator, new attribute), checked: the first clique is a pair
    (its second attribute the new one), each later one adds exactly one attribute the earlier cliques lack to a
    separator of 1 to `degree` attributes inside one of them, every clique is in the query's order, and the
    cliques together hold every attribute (attributes - 1 of them). ValueError naming the problem otherwise."""
    if len(cliques) != len(attributes) - 1:
        raise ValueError(f"{len(cliques)} cliques chosen; a junction tree of {len(attributes)} attributes grown one "
                         f"attribute a round has {len(attributes) - 1}")
    held: set[str] = set()
    for i, clique in enumerate(cliques):
        clique = tuple(clique)
        if not all(isinstance(a, str) for a in clique) or clique != clique_of(attributes, clique) \
                or len(set(clique)) != len(clique):
            raise ValueError(f"clique {list(clique)} is not a set of the query's attributes in its order")
        if i == 0 and len(clique) != 2:
            raise ValueError(f"the first clique {list(clique)} must be a pair")
        new = [a for a in clique if a not in held]
        separator = [a for a in clique if a in held]
        if i and (len(new) != 1 or not 1 <= len(separator) <= degree):
            raise ValueError(f"clique {list(clique)} must add one new attribute to 1 to {degree} attributes the model "
                             f"holds (it adds {new})")
        if i and not any(set(separator) <= set(c) for c in cliques[:i]):
            raise ValueError(f"clique {list(clique)}: its separator {separator} lies inside no earlier clique")
        held.update(clique)
    return clique_steps([tuple(c) for c in cliques])


def attribute_weights(attributes: list[str], workload: list[tuple[tuple[str, ...], int]] | None) -> dict[str, int]:
    """Each attribute's share of a workload of (attributes, weight) marginals, c_x = the weights of the marginals
    holding x, over their greatest common divisor: a clique r weighs AIM's w_r = sum over the workload of
    weight_s * |r & s| = the sum of c_x over its attributes (`clique_weight`). Without a workload every clique
    weighs 1. Public: the spec's declarations only."""
    if workload is None:
        return {}
    per_attribute = dict.fromkeys(attributes, 0)
    for members, weight in workload:
        for attribute in set(members):
            per_attribute[attribute] += weight
    divisor = math.gcd(*per_attribute.values())
    return {a: (w // divisor if divisor else 0) for a, w in per_attribute.items()}


def clique_weight(weights: dict[str, int], clique) -> int:
    """A clique's workload weight (`attribute_weights`); 1 without a workload."""
    return sum(weights[a] for a in clique) if weights else 1


def largest_weight(weights: dict[str, int], degree: int) -> int:
    """The largest weight any candidate clique of at most degree + 1 attributes can have (public: it scales the
    selection's sensitivity before any data is read); 1 without a workload."""
    return sum(sorted(weights.values(), reverse=True)[:degree + 1]) if weights else 1


@dataclass(frozen=True)
class JunctionModel:
    """The model of the measurements so far, per unit: the unit totals and each attribute's distribution from the
    released 1-way tables (clipped), and the fitted tables of the cliques chosen so far (`junction_tables` of
    their released tables, as the junction path fits them). Post-processing of released values only."""

    totals: np.ndarray
    shares: dict[str, np.ndarray]
    one_way: dict[str, np.ndarray]
    fitted: list[tuple[Clique, np.ndarray]]

    @classmethod
    def fit(cls, attributes: list[str], one_way: dict[str, np.ndarray], cliques: list[Clique],
            clique_tables: list[np.ndarray], clique_variance: float) -> "JunctionModel":
        """`one_way`: every attribute's released 1-way table (units, size); `clique_tables`: the released tables of
        the cliques chosen so far (units, sizes in the clique's order), fitted from the first clique's first
        attribute with the 1-way tables' mean total, rounded, as unit totals and rows shrunk toward the new
        attribute's 1-way table."""
        from .mst import independent_estimates
        from .units.tree_model import junction_tables

        totals, shares = independent_estimates([one_way[a] for a in attributes])
        if not cliques:
            return cls(totals, dict(zip(attributes, shares)), {}, [])
        steps = [(separator, new, oriented(table, clique, separator, new))
                 for (separator, new), clique, table in zip(clique_steps(cliques), cliques, clique_tables)]
        margins = {a: np.asarray(one_way[a], dtype=np.float64) for a in attributes}
        root = cliques[0][0]
        fitted_one_way, tables = junction_tables(np.rint(totals).astype(np.int64), root, one_way[root], steps,
                                                 margins, [clique_variance] * len(steps))
        return cls(totals, dict(zip(attributes, shares)), fitted_one_way,
                   [(separator + (new,), table) for (separator, new, _), table in zip(steps, tables)])

    def estimates(self, attributes: list[str], candidates: list[tuple[Clique, str]], sizes: dict[str, int]
                  ) -> list[CliqueEstimate]:
        """Each candidate's estimate: its separator's table in the model (before any clique, the unit total times
        the attribute's distribution: MST's independent estimate) times the new attribute's distribution."""
        from .units.tree_model import separator_counts

        out = []
        for separator, new in candidates:
            if self.fitted:
                counts = separator_counts(separator, self.one_way, self.fitted)
                counts = counts.reshape(self.totals.size, -1).astype(np.float64)
            else:
                counts = self.totals[:, None] * self.shares[separator[0]]
            clique = clique_of(attributes, separator + (new,))
            out.append(CliqueEstimate(counts, self.shares[new], tuple(sizes[a] for a in clique), clique.index(new)))
        return out


def model_estimates(attributes: list[str], one_way: dict[str, np.ndarray], cliques: list[Clique],
                    clique_tables: list[np.ndarray], clique_variance: float, candidates: list[tuple[Clique, str]],
                    sizes: dict[str, int]) -> list[CliqueEstimate]:
    """Each candidate's estimate under the model of the measurements so far (`JunctionModel`)."""
    return JunctionModel.fit(attributes, one_way, cliques, clique_tables, clique_variance).estimates(
        attributes, candidates, sizes)


def clique_steps(cliques: list[Clique]) -> list[tuple[Clique, str]]:
    """Each clique of a grown junction tree as (separator, new attribute): the first clique's second attribute
    joins its first; every later clique's one attribute no earlier clique holds joins the others (unchecked:
    `junction_steps` checks a recorded selection)."""
    steps: list[tuple[Clique, str]] = []
    held: set[str] = set()
    for clique in cliques:
        if not held:
            steps.append(((clique[0],), clique[1]))
        else:
            new = next(a for a in clique if a not in held)
            steps.append((tuple(a for a in clique if a != new), new))
        held.update(clique)
    return steps


def oriented(table: np.ndarray, clique: Clique, separator: Clique, new: str) -> np.ndarray:
    """A clique's table (units, sizes in the clique's order) as (units, separator sizes..., new attribute's size)."""
    order = [clique.index(a) for a in separator] + [clique.index(new)]
    return np.transpose(np.asarray(table, dtype=np.float64), [0] + [1 + i for i in order])


def oriented_back(table: np.ndarray, clique: Clique, separator: Clique, new: str) -> np.ndarray:
    """`oriented`'s inverse: a (units, separator..., new) table in the clique's own order."""
    order = [clique.index(a) for a in separator] + [clique.index(new)]
    return np.transpose(table, [0] + [1 + order.index(i) for i in range(len(clique))])
