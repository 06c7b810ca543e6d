"""Structural checks of released measurements: integers, one per public cell, in both formats."""
from __future__ import annotations

import csv
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dprelease.pipelines.run import run_release

from ..conftest import small_spec, write_case


@pytest.mark.parametrize("budget", [{"definition": "pure", "epsilon": "1/3"},
                                    {"definition": "zcdp", "rho": 0.2},
                                    {"definition": "approx", "epsilon": 2, "delta": 1e-7}])
def test_every_released_measurement_is_an_integer(tmp_path, budget):
    result = run_release(write_case(tmp_path / "case", small_spec(budget=budget)), key_file=tmp_path / "k.key")
    for table in result.plan.tables:
        for folder, column in (("measurements", "noisy_count"), ("tables", "count")):
            data = pq.read_table(result.release_dir / folder / f"{table.name}.parquet")
            assert data.schema.field(column).type == pa.int64()
            assert data.num_rows == table.n_cells
            with open(result.release_dir / folder / f"{table.name}.csv", newline="") as handle:
                values = [row[column] for row in csv.DictReader(handle)]
            assert len(values) == table.n_cells
            assert all(re.fullmatch(r"-?\d+", v) for v in values)
            if folder == "tables":
                assert min(map(int, values)) >= 0
