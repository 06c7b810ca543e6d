"""Input validation as Beam transforms: the spec's great-expectations suite on every batch, in the
workers (each builds the suite once), outcomes merged by a combine into one JSON file.

The outcome is confidential (counts, sample values): the launcher reads it back and writes it to
the internal directory only.
"""
from __future__ import annotations

import json

import apache_beam as beam

from dprelease.pipelines.validation import SuiteRunner, ValidationOutcome, value_frame
from dprelease.transforms.worker_errors import public_failures


class _ValidateBatch(beam.DoFn):
    def __init__(self, expectations: list[dict], plan):
        self.expectations, self.plan = expectations, plan

    def setup(self):
        self.suite = SuiteRunner(self.expectations)

    setup = public_failures("validate", setup)

    def process(self, table):
        outcome = ValidationOutcome(self.expectations)
        outcome.add(self.suite.validate(value_frame(table, self.plan), "value"))
        yield outcome

    process = public_failures("validate", process)


def _merge(outcomes, expectations: list[dict]) -> ValidationOutcome:
    merged = ValidationOutcome(expectations)
    for outcome in outcomes:
        merged.merge(outcome)
    return merged


def _write(outcome: ValidationOutcome, path: str) -> str:
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.create(path) as handle:
        handle.write(json.dumps({"batches": outcome.batches, "results": outcome.results}).encode("utf-8"))
    return path


class ValidateBatches(beam.PTransform):
    """Batches (pa.Table) -> one JSON file at `path` holding the merged value-level outcome."""

    def __init__(self, expectations: list[dict], plan, path: str):
        super().__init__()
        self.expectations, self.plan, self.path = expectations, plan, path

    def expand(self, batches):
        return (batches
                | "Validate" >> beam.ParDo(_ValidateBatch(self.expectations, self.plan))
                | "Merge" >> beam.CombineGlobally(public_failures("merge outcomes", _merge), self.expectations)
                | "Write" >> beam.Map(public_failures("write the validation outcome", _write), self.path))
