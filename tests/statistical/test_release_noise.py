"""The noise a release actually adds has the variance its manifest states.

An empty input makes every measurement pure noise. With n = 150,000 cells the relative
standard error of the sample variance is under 0.7%, so a 30% wrong noise scale (a variance
off by 50% or more) is rejected far beyond the tolerance of 5 standard errors.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dprelease.pipelines.run import run_release

CELLS = 150_000


def _spec(budget: dict) -> dict:
    return {
        "release_id": "noise", "dataset_id": "noise", "input": {"path": "input.parquet"}, "privacy_unit": "pid",
        "budget": budget, "contribution": {"max_records_per_unit": 2},
        "columns": {"x": {"type": "integer", "min": 0, "max": CELLS - 1, "on_invalid": "drop"}},
        "queries": [{"name": "h", "kind": "histogram", "by": ["x"]}], "output": {"dir": "out"},
    }


def _release_noise(tmp_path, budget) -> tuple[np.ndarray, dict]:
    import yaml

    pq.write_table(pa.table({"pid": pa.array([], pa.int64()), "x": pa.array([], pa.int64())}),
                   tmp_path / "input.parquet")
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(_spec(budget)))
    result = run_release(tmp_path / "spec.yaml", key_file=tmp_path / "k.key", workers=2)
    manifest = json.loads((result.release_dir / "manifest.json").read_text())
    noise = pq.read_table(result.release_dir / "measurements" / "h.parquet").column("noisy_count").to_numpy()
    return noise, manifest["tables"][0]


def _within(sample_variance: float, variance: float, kurtosis: float, n: int) -> bool:
    standard_error = variance * math.sqrt((kurtosis - 1) / n)
    return abs(sample_variance - variance) < 5 * standard_error


@pytest.mark.parametrize("budget", [{"definition": "pure", "epsilon": "1/2"},
                                    {"definition": "zcdp", "rho": "1/8"}])
def test_release_noise_has_the_stated_variance(tmp_path, budget):
    noise, record = _release_noise(tmp_path, budget)
    stated = record["expected_error"]["variance"]
    # sensitivity is derived from k = 2: DLap scale = 2 / eps = 4; DGauss sigma2 = k^2 / (2 rho) = 16
    expected_parameter = "4" if budget["definition"] == "pure" else "16"
    assert record["mechanism"]["value"]["fraction"] == expected_parameter
    kurtosis = float(np.mean(noise.astype(float) ** 4) / np.mean(noise.astype(float) ** 2) ** 2)
    sample_variance = float(np.mean(noise.astype(float) ** 2))
    assert abs(noise.mean()) < 5 * math.sqrt(stated / noise.size)
    assert _within(sample_variance, stated, kurtosis, noise.size)
    for wrong_scale in (0.7, 1.3):  # the same check has the power to reject a 30% wrong scale
        assert not _within(sample_variance, stated * wrong_scale ** 2, kurtosis, noise.size)
    coverage = np.mean(np.abs(noise) <= record["expected_error"]["margin_95"])
    assert 0.945 <= coverage <= 0.975
