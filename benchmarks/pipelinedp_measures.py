"""The peer for sums and medians: PipelineDP's LocalBackend, SUM and PERCENTILE(50) per public tract
(benchmarks only). Max 1 partition and 1 contribution per privacy unit, values clamped to [0, 500000],
Laplace, eps = 1 split between the two metrics by PipelineDP's accountant; null incomes are left out.
Usage: python benchmarks/pipelinedp_measures.py PERSONS.parquet GEOGRAPHY.txt
"""
from __future__ import annotations

import argparse

import pipeline_dp
import pyarrow.compute as pc
import pyarrow.parquet as pq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("data")
    parser.add_argument("geography")
    args = parser.parse_args()
    partitions = [line.strip() for line in open(args.geography) if line.strip()]
    table = pq.read_table(args.data, columns=["person_id", "geo", "income"])
    table = table.filter(pc.is_valid(table.column("income")))
    rows = list(zip(table.column("person_id").to_pylist(), table.column("geo").to_pylist(),
                    table.column("income").to_pylist()))
    accountant = pipeline_dp.NaiveBudgetAccountant(total_epsilon=1, total_delta=1e-6)
    engine = pipeline_dp.DPEngine(accountant, pipeline_dp.LocalBackend())
    params = pipeline_dp.AggregateParams(noise_kind=pipeline_dp.NoiseKind.LAPLACE,
                                         metrics=[pipeline_dp.Metrics.SUM, pipeline_dp.Metrics.PERCENTILE(50)],
                                         max_partitions_contributed=1, max_contributions_per_partition=1,
                                         min_value=0, max_value=500000)
    extractors = pipeline_dp.DataExtractors(privacy_id_extractor=lambda r: r[0], partition_extractor=lambda r: r[1],
                                            value_extractor=lambda r: r[2])
    result = engine.aggregate(rows, params, extractors, public_partitions=partitions)
    accountant.compute_budgets()
    print(f"{len(list(result))} partitions released")


if __name__ == "__main__":
    main()
