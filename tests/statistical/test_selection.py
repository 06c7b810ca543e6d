"""The samplers behind sums and quantiles, against their exact distributions, and empirical privacy audits
of a sum and a median through the release path (plan -> bounding -> aggregation -> noise / selection).

Distribution tests: chi-square goodness of fit of N draws against the exact law (p > 1e-4 to pass), with
the power shown in the same test: the same draws reject the law with a 30% wrong scale (p < 1e-4).
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from fractions import Fraction

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from scipy import stats

from dprelease.accounting.sensitivity import ContributionBounds
from dprelease.pipelines.engines.embedded import EmbeddedEngine
from dprelease.pipelines.plan import build_plan
from dprelease.pipelines.source import open_input
from dprelease.pipelines.spec import load_spec
from dprelease.transforms.csprng import CellStream, ReleaseKey
from dprelease.transforms.samplers import sample_cells, select_cells
from dprelease.transforms.samplers_reference import sample_cells_reference, select_cells_reference

from .test_audit import epsilon_lower_bound

PASS_P = 1e-4
DRAWS = 40_000


def _chi_square_p(observed: np.ndarray, probabilities: np.ndarray) -> float:
    expected = probabilities / probabilities.sum() * observed.sum()
    return float(stats.chisquare(observed, expected).pvalue)


def _selection_law(scores: np.ndarray, epsilon: float, sensitivity: int) -> np.ndarray:
    weights = np.exp(-epsilon * (scores - scores.min()) / (2 * sensitivity))
    return weights / weights.sum()


@pytest.mark.parametrize("epsilon,sensitivity", [(Fraction(1), 1), (Fraction(3, 7), 2)])
def test_selection_follows_the_exponential_mechanism_exactly(epsilon, sensitivity):
    scores = np.array([7, 0, 2, 3, 11, 2], dtype=np.int64)
    stream = CellStream.for_table(ReleaseKey(b"s" * 32), "sel")
    chosen = select_cells(stream, 0, DRAWS, np.tile(scores, (DRAWS, 1)), epsilon, sensitivity)
    observed = np.bincount(chosen, minlength=scores.size)
    keep = _selection_law(scores, float(epsilon), sensitivity) * DRAWS >= 5  # chi-square needs expected >= 5
    assert _chi_square_p(observed[keep], _selection_law(scores, float(epsilon), sensitivity)[keep]) > PASS_P
    wrong = _selection_law(scores, 1.3 * float(epsilon), sensitivity)
    assert _chi_square_p(observed[keep], wrong[keep]) < PASS_P  # power: a 30% wrong epsilon is rejected


def test_selection_kernel_is_bit_identical_to_the_reference():
    rng = np.random.default_rng(2)
    scores = rng.integers(0, 10**6, size=(3000, 9))
    scores[::3] = rng.integers(0, 5, size=(1000, 9))  # near-ties: long rejection runs, extra rounds
    stream = CellStream.for_table(ReleaseKey(b"r" * 32), "sel")
    for epsilon, sensitivity in ((Fraction(1, 1000), 3), (Fraction(5, 2), 1), (Fraction(2**20 - 1, 2**20), 7)):
        fast = select_cells(stream, 100, 3100, scores, epsilon, sensitivity)
        assert np.array_equal(fast, select_cells_reference(stream, 100, 3100, scores, epsilon, sensitivity))
        assert np.array_equal(fast[1000:1500], select_cells(stream, 1100, 1600, scores[1000:1500], epsilon, sensitivity))


def test_lane_rounds_are_the_ctr_rounds_of_each_cell():
    stream = CellStream.for_table(ReleaseKey(b"w" * 32), "lanes")
    rounds = stream.lane_rounds(5, 9, 6)
    expected = np.stack([np.concatenate([stream.block(r, c, c + 1)[0] for r in range(6)]) for c in range(5, 9)])
    assert np.array_equal(rounds, expected)


def test_every_selection_makes_its_padded_number_of_proposals():
    """Item 6: the first proposal of an all-equal cell is accepted, yet the kernel goes on proposing until
    16m proposals were made (so it runs out of a short stream), and returns the first accepted candidate."""
    from dprelease.transforms import _exact
    from dprelease.transforms.samplers import PROPOSALS_PER_CANDIDATE, selection_rounds

    m, lanes = 8, 64
    scores = np.zeros((lanes, m), dtype=np.int64)
    stream = CellStream.for_table(ReleaseKey(b"p" * 32), "pad")
    short = np.ascontiguousarray(stream.lane_rounds(0, lanes, 2))  # 256 bits: a few proposals only
    out, status = np.empty(lanes, dtype=np.int64), np.zeros(lanes, dtype=np.uint8)
    _exact.select(short, 4, scores, m, 1, 2, out, status, 0)
    assert not status.any()  # unpadded: the first proposal is accepted well within 256 bits
    first = out.copy()
    _exact.select(short, 4, scores, m, 1, 2, out, status, PROPOSALS_PER_CANDIDATE * m)
    assert status.all()  # padded: 128 proposals of 3 bits each need more than 256 bits
    sized = stream.lane_rounds(0, lanes, selection_rounds(m))
    status[:] = 0
    _exact.select(sized, 2 * selection_rounds(m), scores, m, 1, 2, out, status, PROPOSALS_PER_CANDIDATE * m)
    assert not status.any() and np.array_equal(out, first)


@pytest.mark.parametrize("sigma2", [Fraction(10**12 + 7, 3), Fraction(4 * 10**12)])
def test_wide_gaussian_is_bit_identical_to_the_reference_and_has_its_law(sigma2):
    stream = CellStream.for_table(ReleaseKey(b"g" * 32), "wide")
    fast = sample_cells(stream, 0, 400, "discrete_gaussian", sigma2)
    assert np.array_equal(fast, sample_cells_reference(stream, 0, 400, "discrete_gaussian", sigma2))
    draws = sample_cells(stream, 0, DRAWS, "discrete_gaussian", sigma2)
    sigma = math.sqrt(float(sigma2))
    # for sigma this large the discrete Gaussian's mass on [a, b] equals the normal's on [a - 1/2, b + 1/2]
    # to far below double precision (Poisson summation: error ~ exp(-2 pi^2 sigma^2))
    edges = np.floor(stats.norm.ppf(np.linspace(0, 1, 21)[1:-1], scale=sigma))
    observed = np.bincount(np.searchsorted(edges, draws, side="right"), minlength=20)
    cut = np.concatenate(([-np.inf], edges + 0.5, [np.inf]))
    for scale, passes in ((sigma, True), (1.3 * sigma, False)):
        law = np.diff(stats.norm.cdf(cut, scale=scale))
        assert (_chi_square_p(observed, law) > PASS_P) == passes


def test_large_laplace_scales_have_their_law():
    scale = Fraction(10**9, 3)
    stream = CellStream.for_table(ReleaseKey(b"l" * 32), "large")
    fast = sample_cells(stream, 0, 1000, "discrete_laplace", scale)
    assert np.array_equal(fast, sample_cells_reference(stream, 0, 1000, "discrete_laplace", scale))
    draws = sample_cells(stream, 0, DRAWS, "discrete_laplace", scale)
    edges = np.array([-2e9, -8e8, -3e8, -1e8, -3e7, 0, 3e7, 1e8, 3e8, 8e8, 2e9])

    def cdf(x: np.ndarray, b: float) -> np.ndarray:  # P(X <= x) of the discrete Laplace, x integer
        q = math.exp(-1 / b)
        return np.where(x >= 0, 1 - q ** (x + 1) / (1 + q), q ** (-x) / (1 + q))

    observed = np.bincount(np.searchsorted(edges, draws, side="left"), minlength=edges.size + 1)
    for b, passes in ((float(scale), True), (1.3 * float(scale), False)):
        law = np.diff(np.concatenate(([0.0], cdf(edges, b), [1.0])))
        assert (_chi_square_p(observed, law) > PASS_P) == passes


# ---- empirical privacy audits: a sum and a median, worst-case neighbours -------------------------------------

RUNS = {"sum": 2000, "median": 8000}
"""Releases per side. The broken median (halved score sensitivity) moves P(median >= 30) from about 0.13
to 0.48: with 2000 runs the Clopper-Pearson bound sat near 1.0 (it once failed at 0.97); 8000 give ~1.13."""
ALPHA = 1e-3
EPSILON = 1
K = 2


def _write(directory, spec_query: dict, values: list[int], extra: list[int]):
    """D0: one record per unit in cell A with `values`; D1 adds a unit with `extra` records in A."""
    directory.mkdir(parents=True, exist_ok=True)
    units = list(range(len(values))) + [999] * len(extra)
    pq.write_table(pa.table({"pid": units, "cell": ["A"] * len(units), "v": values + extra}),
                   directory / "input.parquet")
    spec = {
        "release_id": "audit", "dataset_id": "audit", "input": {"path": "input.parquet"}, "privacy_unit": "pid",
        "budget": {"definition": "pure", "epsilon": EPSILON}, "contribution": {"max_records_per_unit": K},
        "columns": {"cell": {"type": "categorical", "values": ["A", "B"]},
                    "v": {"type": "integer", "min": -1000, "max": 1000, "clamp": [0, 40]}},
        "queries": [{**spec_query, "by": ["cell"]}], "output": {"dir": "out"},
    }
    (directory / "spec.yaml").write_text(yaml.safe_dump(spec))
    return directory / "spec.yaml"


def _outputs(spec_path, broken: bool, runs: int) -> np.ndarray:
    """Cell A's released value over `runs` releases, each with its own key (fixed per side and run, so
    the audit is reproducible: keys are independent uniform 256-bit strings either way); `broken` runs a
    deliberately wrong mechanism (bounding keeps 2k records, or the quantile scores' sensitivity is halved)."""
    spec, base = load_spec(spec_path)
    plan = build_plan(spec, base)
    if broken:
        table = plan.tables[0]
        if table.quantiles:
            halved = tuple(s // 2 for s in table.score_sensitivities)
            plan = dataclasses.replace(plan, tables=(dataclasses.replace(table, score_sensitivities=halved),))
        else:
            plan = dataclasses.replace(plan, bounds=ContributionBounds(2 * K, spec.neighbouring))
    source = open_input(plan, base)
    engine = EmbeddedEngine(workers=1)
    name = plan.tables[0].name
    side = spec_path.parent.name

    def key(i: int) -> ReleaseKey:
        return ReleaseKey(hashlib.sha256(f"audit/{side}/{broken}/{i}".encode()).digest())
    return np.array([engine.noisy_measurements(plan, source, key(i))[name][0] for i in range(runs)])


SUM_CASE = ({"name": "s", "kind": "sum", "column": "v"}, [5] * 20, [100] * (2 * K))
"""The added unit carries 2k records above the clamp: bounded to k, each clamped to 40: the sum moves by kM."""
MEDIAN_CASE = ({"name": "m", "kind": "quantile", "column": "v", "q": [0.5], "candidates": [0, 10, 20, 30, 40]},
               [10, 10, 20, 20, 30, 30], [100] * (2 * K))
"""Six values around the median 20; the added unit's records all fall at the top (clamped to 40)."""


@pytest.fixture(scope="module", params=["sum", "median"])
def audited(request, tmp_path_factory):
    query, values, extra = SUM_CASE if request.param == "sum" else MEDIAN_CASE
    root = tmp_path_factory.mktemp(f"audit-{request.param}")
    d0, d1 = _write(root / "d0", query, values, []), _write(root / "d1", query, values, extra)
    thresholds = [100 + 40 * K, 100 + 80 * K] if request.param == "sum" else [10, 20, 30]
    return d0, d1, thresholds, RUNS[request.param]


def test_audit_of_sums_and_medians_stays_within_epsilon(audited):
    d0, d1, thresholds, runs = audited
    eps_lb = epsilon_lower_bound(_outputs(d0, False, runs), _outputs(d1, False, runs), thresholds, ALPHA)
    assert eps_lb <= EPSILON, f"empirical loss lower bound {eps_lb:.3f} exceeds the claimed {EPSILON}"


def test_audit_catches_a_broken_sum_or_median(audited):
    d0, d1, thresholds, runs = audited
    eps_lb = epsilon_lower_bound(_outputs(d0, True, runs), _outputs(d1, True, runs), thresholds, ALPHA)
    assert eps_lb > EPSILON, f"a 2x sensitivity bug went unnoticed (lower bound {eps_lb:.3f})"
