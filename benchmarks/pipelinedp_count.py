"""The peer: PipelineDP's LocalBackend, SparkRDDBackend or BeamBackend on the single count job (benchmarks only).

COUNT per public tract partition, max 1 partition and 1 contribution per privacy unit, Laplace, eps = 1.
Usage: python benchmarks/pipelinedp_count.py PERSONS.parquet GEOGRAPHY.txt [--backend local|spark|beam] [--master URL]
The beam backend runs on the DirectRunner, multi_processing, 2 workers (--beam-workers).
"""
from __future__ import annotations

import argparse
import os
import sys

import pipeline_dp
import pyarrow.parquet as pq


def count_job(rows, partitions: list[str], backend) -> list:
    accountant = pipeline_dp.NaiveBudgetAccountant(total_epsilon=1, total_delta=1e-6)
    engine = pipeline_dp.DPEngine(accountant, backend)
    params = pipeline_dp.AggregateParams(noise_kind=pipeline_dp.NoiseKind.LAPLACE,
                                         metrics=[pipeline_dp.Metrics.COUNT],
                                         max_partitions_contributed=1, max_contributions_per_partition=1)
    extractors = pipeline_dp.DataExtractors(privacy_id_extractor=lambda r: r[0],
                                            partition_extractor=lambda r: r[1], value_extractor=lambda r: 0)
    result = engine.aggregate(rows, params, extractors, public_partitions=partitions)
    accountant.compute_budgets()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("data")
    parser.add_argument("geography")
    parser.add_argument("--backend", choices=["local", "spark", "beam"], default="local")
    parser.add_argument("--beam-workers", type=int, default=2)
    parser.add_argument("--master", default="local[2]")
    args = parser.parse_args()
    partitions = [line.strip() for line in open(args.geography) if line.strip()]
    if args.backend == "local":
        table = pq.read_table(args.data, columns=["person_id", "geo"])
        rows = list(zip(table.column("person_id").to_pylist(), table.column("geo").to_pylist()))
        released = list(count_job(rows, partitions, pipeline_dp.LocalBackend()))
    elif args.backend == "beam":
        import apache_beam as beam
        from apache_beam.options.pipeline_options import PipelineOptions

        options = PipelineOptions(["--runner=DirectRunner", "--direct_running_mode=multi_processing",
                                   f"--direct_num_workers={args.beam_workers}"])
        with beam.Pipeline(options=options) as pipeline:
            rows = (pipeline | beam.io.ReadFromParquet(args.data, columns=["person_id", "geo"])
                    | beam.Map(lambda row: (row["person_id"], row["geo"])))
            released = count_job(rows, partitions, pipeline_dp.BeamBackend())
            released | beam.combiners.Count.Globally() | beam.Map(lambda n: print(f"{n} partitions released"))
        return
    else:
        from pyspark.sql import SparkSession

        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # workers need pipeline_dp too
        spark = SparkSession.builder.master(args.master).appName("pipelinedp-count").getOrCreate()
        rows = spark.read.parquet(args.data).select("person_id", "geo").rdd.map(tuple)
        released = count_job(rows, partitions, pipeline_dp.SparkRDDBackend(spark.sparkContext)).collect()
        spark.stop()
    print(f"{len(released)} partitions released")


if __name__ == "__main__":
    main()
