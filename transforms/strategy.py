"""Which marginals to measure, and with what share of a query's budget, so its workload is answered best.

A `marginals` query publishes the t-way tables of its attributes (the workload). Measuring each of them
directly with equal shares is one strategy; measuring every table of the workload's down-closure (its
(t-1)-way, ..., 1-way tables too) with the shares that minimise the workload's expected error, and
combining all measurements by generalised least squares (`estimation`), is never worse and usually
better (ResidualPlanner, Xiao, He, Zhang and Kifer 2023: the optimal measurement of marginal workloads
is a set of residual measurements over the down-closure with an optimal budget split).

The error of a strategy, in closed form (as `estimation._block_variances`). Give table A the precision
t_A = 1 / (per-cell noise variance), proportional to its zCDP share (sigma^2 = Delta^2 / (2 rho_A)).
Residual B (the part of the B-margin orthogonal to every coarser margin) is measured by every table A
holding B, with precision t_A / n(A - B); its GLS estimate has precision I_B = sum_A t_A / n(A - B). The
sum over a workload table W's cells of its estimate's variance is
    V_W = sum over B in W of prod(n_i - 1, i in B) / (n(W - B) I_B).
The loss is L(t) = sum_W V_W / sqrt(n(W)) = sum_B C_B / I_B, convex in t, minimised over the simplex of
shares by the multiplicative update t_A <- t_A sqrt(-dL/dt_A) (the fixed point is the KKT point: every
measured table's marginal gain equal; monotone for this A-optimal-design objective, Yu 2010). The weight
1 / sqrt(cells) sits between the sum of all cells' variances (weight 1, which starves small tables) and
each table's mean cell variance (weight 1 / cells, the equal split): measured on Adult's published
all-2-way tables (mean L1 of the normalised tables, 4 keys), it beat weights 1, cells^-1/4, cells^-3/4
and 1/cells at epsilon 0.3, 1 and 3 (benchmarks/README.md, "Published marginals").

Measurement, not residual noise. ResidualPlanner adds noise in each residual subspace only, which costs
less budget than measuring the whole marginal; its privacy analysis is for continuous Gaussian noise.
Here each chosen table is measured whole with exact discrete Gaussian noise (its zCDP cost is exact, as
every other table's), and the lower residuals it also holds are used by the estimator, not thrown away.

Determinism. The shares enter the plan, which `verify` recomputes on another machine: the optimisation
uses only Python floats, `math.fsum` (correctly rounded, independent of order) and `math.sqrt` (correctly
rounded), for a fixed number of iterations, so every platform computes the same bits, and the shares are
rounded to integers before they become exact fractions.

Privacy: reads the query's public attributes, domain sizes and nothing else; the shares sum exactly to
the query's budget (`accounting.rationals.allocate`).
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

ITERATIONS = 100
"""Multiplicative updates: on Adult's all 2-way and all 3-way tables the workload error after 100 equals that
after 1,000 to 12 significant digits (tests/test_strategy.py checks 1e-6 on its workloads)."""
SHARE_RESOLUTION = 10 ** 9
"""Shares are rounded to integers out of this many before they become the plan's exact fractions."""
DROP_BELOW = 0.01
"""A down-closure table whose optimal share is below this fraction of an equal share is not measured (the
optimisation is then repeated without it): it would be a table of noise the estimator barely uses."""
MAX_TERMS = 100_000
"""Most (table, subset) terms the optimisation iterates over (all 3-way tables of 40 attributes have
79,040; about 5 s): beyond it the query measures its tables directly (the plan says so)."""


Marginal = tuple[str, ...]


@dataclass(frozen=True)
class Strategy:
    """The tables a query measures (workload and down-closure, in a fixed order) and each one's integer
    weight (its share of the query's budget, out of the weights' sum), with the workload's expected
    total variance per unit of precision under this strategy and under direct measurement."""

    tables: tuple[Marginal, ...]
    weights: tuple[int, ...]
    error: float
    direct_error: float


def down_closure(workload: list[Marginal]) -> list[Marginal]:
    """Every non-empty subset of a workload marginal, largest first, each in its marginal's attribute order."""
    found: dict[frozenset, Marginal] = {}
    for marginal in workload:
        for k in range(len(marginal), 0, -1):
            for subset in itertools.combinations(marginal, k):
                found.setdefault(frozenset(subset), subset)
    return sorted(found.values(), key=lambda m: -len(m))


def _subsets(marginal: frozenset) -> list[frozenset]:
    items = sorted(marginal)
    return [frozenset(c) for k in range(len(items) + 1) for c in itertools.combinations(items, k)]


class _Problem:
    """The workload error L(t) = sum_B C_B / I_B(t) over candidate tables, in flat lists for speed."""

    def __init__(self, workload: list[Marginal], candidates: list[Marginal], sizes: dict[str, int]):
        self.candidates = candidates
        residuals: dict[frozenset, int] = {}
        coefficient: list[list[float]] = []
        for marginal in workload:
            held = frozenset(marginal)
            weight = 1.0 / math.sqrt(math.prod(sizes[a] for a in held))
            for subset in _subsets(held):
                index = residuals.setdefault(subset, len(residuals))
                if index == len(coefficient):
                    coefficient.append([])
                coefficient[index].append(weight * math.prod(sizes[a] - 1 for a in subset)
                                          / math.prod(sizes[a] for a in held - subset))
        self.coefficients = [math.fsum(c) for c in coefficient]
        self.terms: list[list[tuple[int, float]]] = [[] for _ in residuals]  # per residual: (table, 1/n(A-B))
        self.holds: list[list[tuple[int, float]]] = []  # per table: (residual, 1/n(A-B))
        for a, marginal in enumerate(candidates):
            held = frozenset(marginal)
            row = []
            for subset in _subsets(held):
                if subset in residuals:
                    r = residuals[subset]
                    scale = 1.0 / math.prod(sizes[x] for x in held - subset)
                    self.terms[r].append((a, scale))
                    row.append((r, scale))
            self.holds.append(row)

    @property
    def size(self) -> int:
        return sum(len(row) for row in self.holds)

    def precisions(self, shares: list[float]) -> list[float]:
        return [math.fsum(shares[a] * scale for a, scale in terms) for terms in self.terms]

    def error(self, shares: list[float]) -> float:
        """Workload total variance with shares summing to 1 (per unit of total precision)."""
        precision = self.precisions(shares)
        if any(p <= 0 for p in precision):
            return math.inf
        return math.fsum(c / p for c, p in zip(self.coefficients, precision))

    def step(self, shares: list[float]) -> list[float]:
        """One multiplicative update, renormalised to sum to 1."""
        precision = self.precisions(shares)
        weight = [c / (p * p) for c, p in zip(self.coefficients, precision)]
        grown = [s * math.sqrt(math.fsum(weight[r] * scale for r, scale in row)) for s, row in zip(shares, self.holds)]
        total = math.fsum(grown)
        return [g / total for g in grown]


def workload_error(workload: list[Marginal], tables: list[Marginal], variances: list[float],
                   sizes: dict[str, int]) -> float:
    """The workload's loss (sum over its tables of total least-squares variance / sqrt(cells)) when each of
    `tables` is measured with the given per-cell noise variance."""
    return _Problem(workload, tables, sizes).error([1.0 / v for v in variances])


def _optimise(problem: _Problem) -> list[float]:
    shares = [1.0 / len(problem.candidates)] * len(problem.candidates)
    for _ in range(ITERATIONS):
        shares = problem.step(shares)
    return shares


def optimal_strategy(workload: list[Marginal], sizes: dict[str, int]) -> Strategy | None:
    """`_optimal_strategy`, computed once per workload and sizes in a process (the plan is built more than once)."""
    return _optimal_strategy(tuple(map(tuple, workload)), tuple(sorted((a, int(n)) for a, n in sizes.items())))


@functools.lru_cache(maxsize=64)
def _optimal_strategy(workload: tuple[Marginal, ...], size_items: tuple[tuple[str, int], ...]) -> Strategy | None:
    """The tables to measure for `workload` (its marginals weighted as the module says) and their integer
    weights, or None where it is measured directly (`direct_reason`)."""
    workload, sizes = list(workload), dict(size_items)
    if direct_reason(workload) is not None:
        return None
    direct_error = _Problem(workload, list(workload), sizes).error([1.0 / len(workload)] * len(workload))
    candidates, weights, error = _choose([_fit(workload, list(workload), sizes),
                                          _fit(workload, down_closure(workload), sizes)])
    return Strategy(tuple(candidates), tuple(weights), error, direct_error)


def direct_reason(workload: list[Marginal]) -> str | None:
    """Why `workload` is measured directly, not optimised (None: it is optimised): a single table (direct is
    optimal), or more than MAX_TERMS (table, subset) terms to iterate over (counted before anything is built)."""
    if len(workload) < 2:
        return "a single table"
    if sum(2 ** len(m) for m in down_closure(workload)) > MAX_TERMS:
        return f"too large to optimise (over {MAX_TERMS:,} table-subset terms)"
    return None


def _fit(workload: list[Marginal], candidates: list[Marginal], sizes: dict[str, int]):
    """The optimal integer weights over `candidates` (dropping, and re-optimising without, any table of the
    down-closure whose share falls below DROP_BELOW of an equal share): (tables, weights, error)."""
    required = {frozenset(m) for m in workload}
    while True:
        problem = _Problem(workload, candidates, sizes)
        shares = _optimise(problem)
        floor = DROP_BELOW / len(candidates)
        kept = [m for m, s in zip(candidates, shares) if s >= floor or frozenset(m) in required]
        if len(kept) == len(candidates):
            break
        candidates = kept
    weights = [max(1, round(s * SHARE_RESOLUTION)) for s in shares]
    total = sum(weights)
    return candidates, weights, problem.error([w / total for w in weights])


def _choose(fits: list[tuple]) -> tuple:
    """The fit of least error; the first (the workload's own tables) unless another is better by more than a
    relative 1e-9 (a difference of an ulp never adds tables). Measured whole, a workload table
    already measures every lower residual it holds, so the down-closure's tables rarely pay: they got under
    0.5% of the budget on Adult and on 300 random workloads, the multiplicative update only driving them
    towards 0 (slowly), so the fit over the workload's tables alone is the guard against a worse split."""
    best = fits[0]
    for fit in fits[1:]:
        if fit[2] < best[2] * (1 - 1e-9):
            best = fit
    return best
