"""The peer: PipelineDP's LocalBackend on the same single count job (benchmark environment only).

COUNT per public tract partition, max 1 partition and 1 contribution per privacy unit, Laplace, eps = 1.
Usage: python benchmarks/pipelinedp_count.py PERSONS.parquet GEOGRAPHY.txt
"""
from __future__ import annotations

import sys

import pipeline_dp
import pyarrow.parquet as pq


def main(data_path: str, geography_path: str) -> None:
    table = pq.read_table(data_path, columns=["person_id", "geo"])
    rows = list(zip(table.column("person_id").to_pylist(), table.column("geo").to_pylist()))
    partitions = [line.strip() for line in open(geography_path) if line.strip()]
    accountant = pipeline_dp.NaiveBudgetAccountant(total_epsilon=1, total_delta=1e-6)
    engine = pipeline_dp.DPEngine(accountant, pipeline_dp.LocalBackend())
    params = pipeline_dp.AggregateParams(noise_kind=pipeline_dp.NoiseKind.LAPLACE,
                                         metrics=[pipeline_dp.Metrics.COUNT],
                                         max_partitions_contributed=1, max_contributions_per_partition=1)
    extractors = pipeline_dp.DataExtractors(privacy_id_extractor=lambda r: r[0],
                                            partition_extractor=lambda r: r[1], value_extractor=lambda r: 0)
    result = engine.aggregate(rows, params, extractors, public_partitions=partitions)
    accountant.compute_budgets()
    counts = list(result)
    print(f"{len(counts)} partitions released")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
