"""Empirical privacy audit of the release path: spec -> bounding -> aggregation -> noise.

Neighbouring inputs: D0, and D1 = D0 plus one privacy unit carrying twice the bound's number
of records, all in one cell (the worst case). The release runs RUNS times per side with fresh
keys through the Python API (plan + embedded engine). For fixed events "cell >= c", one-sided
Clopper-Pearson bounds give a lower confidence bound on the privacy loss,
    eps_lb = log(lower(P[S | D1]) / upper(P[S | D0])),
which a correct mechanism exceeds with probability below ALPHA (union bound over the events).

Power: the events are chosen so that a factor-2 error (the loss being 2 eps) gives an
expected eps_lb of about 1.7 eps at RUNS = 2000, caught essentially always; the test
`test_audit_catches_a_broken_bound` shows it on a deliberately broken bound.
"""
from __future__ import annotations

import dataclasses
import math

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
from dprelease.transforms.csprng import ReleaseKey

RUNS = 2000
ALPHA = 1e-3
EPSILON = 1
K = 2
BASE = 20  # records of distinct units in the audited cell


def _write_side(directory, extra_unit: bool):
    directory.mkdir(parents=True, exist_ok=True)
    units = list(range(BASE)) + [7, 8, 9]
    cells = ["A"] * BASE + ["B", "B", "C"]
    if extra_unit:
        units += [999] * (2 * K)
        cells += ["A"] * (2 * K)
    pq.write_table(pa.table({"pid": units, "cell": cells}), directory / "input.parquet")
    spec = {
        "release_id": "audit", "dataset_id": "audit", "input": {"path": "input.parquet"}, "privacy_unit": "pid",
        "budget": {"definition": "pure", "epsilon": EPSILON}, "contribution": {"max_records_per_unit": K},
        "columns": {"cell": {"type": "categorical", "values": ["A", "B", "C"]}},
        "queries": [{"name": "h", "kind": "histogram", "by": ["cell"]}], "output": {"dir": "out"},
    }
    (directory / "spec.yaml").write_text(yaml.safe_dump(spec))
    return directory / "spec.yaml"


def _release_outputs(spec_path, runs: int, broken: bool) -> np.ndarray:
    """The noisy count of cell A over `runs` releases with fresh keys."""
    spec, base = load_spec(spec_path)
    plan = build_plan(spec, base)
    if broken:  # bounding keeps 2k records while the noise stays calibrated to k
        plan = dataclasses.replace(plan, bounds=ContributionBounds(2 * K, spec.neighbouring))
    source = open_input(plan, base)
    engine = EmbeddedEngine(workers=1)
    return np.array([engine.noisy_measurements(plan, source, ReleaseKey.generate())["h"][0] for _ in range(runs)])


def _clopper_pearson(successes: int, trials: int, alpha: float) -> tuple[float, float]:
    lower = stats.beta.ppf(alpha, successes, trials - successes + 1) if successes > 0 else 0.0
    upper = stats.beta.ppf(1 - alpha, successes + 1, trials - successes) if successes < trials else 1.0
    return float(lower), float(upper)


def epsilon_lower_bound(d0: np.ndarray, d1: np.ndarray, thresholds: list[int], alpha: float) -> float:
    """Largest Clopper-Pearson lower bound on the loss over the events {y >= c}, both directions."""
    per_test = alpha / (2 * len(thresholds))
    best = 0.0
    for c in thresholds:
        for first, second, event in ((d1, d0, lambda y: y >= c), (d0, d1, lambda y: y < c)):
            low, _ = _clopper_pearson(int(event(first).sum()), first.size, per_test)
            _, high = _clopper_pearson(int(event(second).sum()), second.size, per_test)
            if low > 0 and high > 0:
                best = max(best, math.log(low / high))
    return best


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit")
    return _write_side(root / "d0", False), _write_side(root / "d1", True)


THRESHOLDS = [BASE + K, BASE + 2 * K]


def test_audit_of_the_release_path_stays_within_epsilon(sides):
    d0 = _release_outputs(sides[0], RUNS, broken=False)
    d1 = _release_outputs(sides[1], RUNS, broken=False)
    assert abs(d1.mean() - d0.mean() - K) < 0.5  # the added unit counts k records, not 2k
    eps_lb = epsilon_lower_bound(d0, d1, THRESHOLDS, ALPHA)
    assert eps_lb <= EPSILON, f"empirical loss lower bound {eps_lb:.3f} exceeds the claimed {EPSILON}"


def test_audit_catches_a_broken_bound(sides):
    d0 = _release_outputs(sides[0], RUNS, broken=True)
    d1 = _release_outputs(sides[1], RUNS, broken=True)
    eps_lb = epsilon_lower_bound(d0, d1, THRESHOLDS, ALPHA)
    assert eps_lb > EPSILON, f"a 2x sensitivity bug went unnoticed (lower bound {eps_lb:.3f})"
