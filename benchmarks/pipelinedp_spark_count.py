"""The peer on Spark: PipelineDP's SparkRDDBackend on the single count job, on local[2].

COUNT per public tract partition, max 1 partition and 1 contribution per privacy unit, Laplace, eps = 1.
Usage: python benchmarks/pipelinedp_spark_count.py PERSONS.parquet GEOGRAPHY.txt [MASTER]
"""
from __future__ import annotations

import sys

import pipeline_dp
from pyspark.sql import SparkSession


def main(data_path: str, geography_path: str, master: str = "local[2]") -> None:
    spark = SparkSession.builder.master(master).appName("pipelinedp-count").getOrCreate()
    rows = spark.read.parquet(data_path).select("person_id", "geo").rdd.map(tuple)
    partitions = [line.strip() for line in open(geography_path) if line.strip()]
    accountant = pipeline_dp.NaiveBudgetAccountant(total_epsilon=1, total_delta=1e-6)
    engine = pipeline_dp.DPEngine(accountant, pipeline_dp.SparkRDDBackend(spark.sparkContext))
    params = pipeline_dp.AggregateParams(noise_kind=pipeline_dp.NoiseKind.LAPLACE,
                                         metrics=[pipeline_dp.Metrics.COUNT],
                                         max_partitions_contributed=1, max_contributions_per_partition=1)
    extractors = pipeline_dp.DataExtractors(privacy_id_extractor=lambda r: r[0],
                                            partition_extractor=lambda r: r[1], value_extractor=lambda r: 0)
    result = engine.aggregate(rows, params, extractors, public_partitions=partitions)
    accountant.compute_budgets()
    print(f"{len(result.collect())} partitions released")
    spark.stop()


if __name__ == "__main__":
    main(*sys.argv[1:])
