"""Input validation with great-expectations (the `validate` extra).

The expectation suite is a pure function of the spec (public): columns present, geography
codes stored as text, privacy unit not null, values in the public domain, integers in range.
Two levels, two consequences:

- schema level (columns exist, types), checked on a zero-row frame built from the input's
  schema: public, so a failure aborts with exit 2 before any budget is reserved;
- value level, checked on every record by the engine in use (pandas batches or a Spark
  DataFrame): confidential. Its detailed report (counts, sample values) goes only to the
  private `--internal-dir`; invalid values are then handled by the spec's declared policy.
  Only `--strict` turns a value-level failure into an abort, which makes whether a release
  exists depend on the data: an internal choice, documented as such.

The public manifest records the suite's hash and the policies, never pass/fail.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np
import pyarrow as pa

from dprelease.accounting.errors import DPReleaseError, InputSchemaError, SpecError
from dprelease.transforms.domains import CategoricalDomain, GeographyDomain, IntegerDomain
from dprelease.transforms.encode import (_as_text, _integer_values, dictionary_encoded, dictionary_values, is_text,
                                         text_as_bytes)

from .storage import private_directory, write_private
from .manifest import file_stamp
from .plan import Plan
from .source import value_type

SCHEMA_LEVEL = ("expect_column_to_exist", "expect_column_values_to_be_in_type_list")
TEXT_TYPES = ["str", "string", "object", "large_string", "StringType"]
VALIDATION_ROWS = 1 << 22
"""Rows per great-expectations call: its cost per call (configuration copies that grow with the value
sets) is large, its cost per row small, so batches are merged up to this size."""
SAMPLE_VALUES = 20
"""Unexpected values kept per expectation in the internal report (confidential; never published)."""


def expectations_from_spec(plan: Plan) -> list[dict]:
    """The suite as plain {type, kwargs} records: a pure function of the spec and its public domains."""
    spec = plan.spec
    suite: list[dict] = []
    unit = spec.privacy_unit
    columns = plan.used_columns()
    for name in ([unit] if unit else []) + columns:
        suite.append({"type": "expect_column_to_exist", "kwargs": {"column": name}})
    for name in columns:
        if isinstance(plan.domains[name], GeographyDomain):
            suite.append({"type": "expect_column_values_to_be_in_type_list",
                          "kwargs": {"column": name, "type_list": TEXT_TYPES}})
    if unit:
        suite.append({"type": "expect_column_values_to_not_be_null", "kwargs": {"column": unit}})
    for name in columns:
        domain = plan.domains[name]
        suite.append({"type": "expect_column_values_to_not_be_null", "kwargs": {"column": name}})
        if isinstance(domain, IntegerDomain):
            suite.append({"type": "expect_column_values_to_be_between",
                          "kwargs": {"column": name, "min_value": domain.minimum, "max_value": domain.maximum}})
        elif isinstance(domain, CategoricalDomain):
            suite.append({"type": "expect_column_values_to_be_in_set",
                          "kwargs": {"column": name, "value_set": list(domain.values)}})
        elif isinstance(domain, GeographyDomain):
            suite.append({"type": "expect_column_values_to_be_in_set",
                          "kwargs": {"column": name, "value_set": list(domain.leaves)}})
    return suite


def suite_sha256(expectations: list[dict]) -> str:
    """SHA-256 of the suite's canonical JSON: what the manifest records and `verify` recomputes."""
    text = json.dumps(expectations, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def manifest_record(plan: Plan) -> dict:
    """The manifest's public validation block: suite hash and policies, no results."""
    expectations = expectations_from_spec(plan)
    spec = plan.spec
    return {
        "tool": "great_expectations",
        "suite_sha256": suite_sha256(expectations),
        "expectations": len(expectations),
        "schema_failures": "abort (exit 2) before any budget is reserved",
        "value_failures": "handled by the declared invalid_value_policy; results kept internal",
        "invalid_value_policy": {name: c.on_invalid for name, c in spec.columns.items()},
        "null_privacy_unit": "record dropped" if spec.privacy_unit else "not applicable",
    }


def _import_gx():
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    try:
        import great_expectations as gx
        import great_expectations.expectations  # noqa: F401
        from great_expectations.data_context.types.base import ProgressBarsConfig
    except ImportError:
        raise SpecError("input validation (--internal-dir / --strict) needs great-expectations: "
                        "pip install \"dprelease[validate]\"") from None
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("great_expectations")] + ["great_expectations"]:
        logging.getLogger(name).setLevel(logging.ERROR)
    return gx, ProgressBarsConfig


def _camel(snake: str) -> str:
    return "".join(part.capitalize() for part in snake.split("_"))


class SuiteRunner:
    """One ephemeral great-expectations context holding the spec's suite, split by level; validates frames."""

    def __init__(self, expectations: list[dict]):
        gx, progress_config = _import_gx()
        self.expectations = expectations
        self.context = gx.get_context(mode="ephemeral")
        self.context.variables.progress_bars = progress_config(globally=False)

        def configured(indices: list[int]) -> list:
            return [getattr(gx.expectations, _camel(expectations[i]["type"]))(
                **expectations[i]["kwargs"], meta={"dprelease_index": i}) for i in indices]

        everything = list(range(len(expectations)))
        self.suite = gx.ExpectationSuite(name="dprelease", expectations=configured(everything))
        self.level_suites = {}
        for level in ("schema", "value"):
            indices = [i for i in everything if (expectations[i]["type"] in SCHEMA_LEVEL) == (level == "schema")]
            self.level_suites[level] = self.context.suites.add(
                gx.ExpectationSuite(name=f"dprelease-{level}", expectations=configured(indices)))
        self._batch_definitions: dict[str, object] = {}

    def _batch_definition(self, frame):
        """A whole-dataframe batch definition for pandas or Spark frames (created on first use)."""
        import pandas as pd

        kind = "pandas" if isinstance(frame, pd.DataFrame) else "spark"
        if kind not in self._batch_definitions:
            sources = self.context.data_sources
            source = sources.add_pandas("pandas") if kind == "pandas" else sources.add_spark("spark")
            self._batch_definitions[kind] = source.add_dataframe_asset("batch").add_batch_definition_whole_dataframe("whole")
        return self._batch_definitions[kind]

    def validate(self, frame, level: str) -> dict[int, dict]:
        """`frame`: a pandas or Spark DataFrame. Results by suite index for the expectations of `level` ('schema' or 'value')."""
        batch = self._batch_definition(frame).get_batch(batch_parameters={"dataframe": frame})
        result = batch.validate(self.level_suites[level])
        out = {}
        for item in result.results:
            index = item.expectation_config.meta["dprelease_index"]
            info = item.exception_info or {}
            out[index] = {"success": bool(item.success), "result": dict(item.result or {}),
                          "exception": info.get("exception_message") if info.get("raised_exception") else None}
        return out

    def suite_json(self) -> dict:
        """The whole suite in great-expectations' own JSON (for reuse in an agency's GX project)."""
        return self.suite.to_json_dict()


def schema_frame(schema: pa.Schema, columns: Iterable[str]):
    """A zero-row pandas frame with the input's column types: the schema-level checks see no values.

    Text columns are given pandas' `object` dtype whatever pandas infers: pandas 3 (and 2.x with
    future.infer_string) makes them `str`, which great-expectations' type-list check does not match."""
    fields = [pa.field(name, value_type(schema.field(name).type)) for name in columns if name in schema.names]
    frame = pa.schema(fields).empty_table().to_pandas()
    text = [f.name for f in fields if is_text(f.type)]
    return frame.astype({name: object for name in text}) if text else frame


def value_frame(batch: pa.RecordBatch | pa.Table, plan: Plan):
    """One batch in the form the encoder reads it: integer columns as numbers (NaN when not an
    integer), categorical and geography columns as text (matched as text; pandas categoricals, so
    set and null checks run on codes), the unit unchanged."""
    import pandas as pd

    data = {}
    unit = plan.spec.privacy_unit
    if unit:
        data[unit] = text_as_bytes(batch.column(unit)).to_pandas()
    for name in plan.used_columns():
        column = batch.column(name)
        if isinstance(plan.domains[name], IntegerDomain):
            data[name] = _integer_values(column)
            continue
        encoded = dictionary_encoded(column)
        texts = [_as_text(v) for v in dictionary_values(encoded.dictionary)]
        categories = sorted({t for t in texts if t is not None})
        position = {text: i for i, text in enumerate(categories)}
        lookup = np.array([position[t] if t is not None else -1 for t in texts] + [-1], dtype=np.int64)
        codes = lookup[encoded.indices.fill_null(len(texts)).to_numpy(zero_copy_only=False)]
        data[name] = pd.Categorical.from_codes(codes, categories=categories)
    return pd.DataFrame(data)


@dataclass
class ValidationOutcome:
    """Aggregated value-level results: confidential, written only to the internal directory."""

    expectations: list[dict]
    results: dict[int, dict] = field(default_factory=dict)
    batches: int = 0

    def add(self, batch_results: dict[int, dict]) -> None:
        """Fold in one GE validation call's results (by suite index)."""
        one = {index: {"success": item["success"],
                       **{name: int(item["result"].get(name) or 0)
                          for name in ("element_count", "unexpected_count", "missing_count")},
                       "sample_unexpected": [_jsonable(v) for v in
                                             item["result"].get("partial_unexpected_list", [])[:SAMPLE_VALUES]],
                       "exceptions": [item["exception"]] if item["exception"] else []}
               for index, item in batch_results.items()}
        self.merge(ValidationOutcome(self.expectations, one, 1))

    def merge(self, other: "ValidationOutcome") -> "ValidationOutcome":
        """Fold in another outcome (of other batches): counts add, samples fill up to SAMPLE_VALUES."""
        self.batches += other.batches
        for index, item in other.results.items():
            total = self.results.setdefault(int(index), {"success": True, "element_count": 0, "unexpected_count": 0,
                                                         "missing_count": 0, "sample_unexpected": [], "exceptions": []})
            total["success"] = total["success"] and item["success"]
            for name in ("element_count", "unexpected_count", "missing_count"):
                total[name] += item[name]
            room = SAMPLE_VALUES - len(total["sample_unexpected"])
            total["sample_unexpected"] += item["sample_unexpected"][:max(room, 0)]
            total["exceptions"] += item["exceptions"]
        return self

    @property
    def success(self) -> bool:
        return all(r["success"] for r in self.results.values())

    def failed_checks(self) -> list[str]:
        """The value checks that failed, in public words: the column and what the spec asks of it (its domain,
        bounds or non-null), never a value or a count. For the operator's console (nothing is published)."""
        return [describe_check(self.expectations[index]) for index, result in sorted(self.results.items())
                if not result["success"]]


CHECK_WORDS = {
    "expect_column_values_to_be_in_set": "values outside the spec's domain (e.g. codes spelled otherwise)",
    "expect_column_values_to_be_between": "values outside the spec's range",
    "expect_column_values_to_not_be_null": "missing values",
    "expect_column_values_to_be_in_type_list": "values that are not text codes",
}


def describe_check(expectation: dict) -> str:
    """One expectation in public words: its column and what it asks."""
    return f"{expectation['kwargs']['column']}: {CHECK_WORDS.get(expectation['type'], expectation['type'])}"


def _jsonable(value):
    if isinstance(value, (np.generic,)):
        return value.item()
    if isinstance(value, float) and not np.isfinite(value):
        return repr(value)
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def check_schema(runner: SuiteRunner, schema: pa.Schema, plan: Plan) -> dict[int, dict]:
    """Run the schema-level expectations; raise InputSchemaError (exit 2) naming each failure."""
    columns = ([plan.spec.privacy_unit] if plan.spec.privacy_unit else []) + plan.used_columns()
    results = runner.validate(schema_frame(schema, columns), "schema")
    problems = []
    for index in sorted(results):
        if not results[index]["success"]:
            expectation = runner.expectations[index]
            column = expectation["kwargs"]["column"]
            if expectation["type"] == "expect_column_to_exist":
                problems.append(f"input column {column!r}: missing; the input has {schema.names}")
            else:
                kind = schema.field(column).type if column in schema.names else "absent"
                problems.append(f"columns.{column}: input type is {kind}; allowed: text (string) codes")
    if problems:
        raise InputSchemaError(problems)
    return results


def write_internal_report(directory: Path, plan: Plan, runner: SuiteRunner, schema_results: dict[int, dict],
                          outcome: ValidationOutcome, engine: str, files: list[str], created_at: str) -> Path:
    """Write the detailed (confidential) report and the suite to `directory`; return the report path."""
    directory = private_directory(directory, "--internal-dir")
    entries = []
    for index, expectation in enumerate(runner.expectations):
        if index in schema_results:
            entries.append({**expectation, "level": "schema", "success": schema_results[index]["success"]})
        else:
            entries.append({**expectation, "level": "value", **outcome.results.get(index, {"success": True})})
    for entry in entries:
        if entry["type"] == "expect_column_values_to_be_in_set":
            entry["kwargs"] = {**entry["kwargs"], "value_set": f"{len(entry['kwargs']['value_set'])} public values"}
    report = {
        "confidential": "contains counts and values from the confidential input; never publish",
        "release_id": plan.spec.release_id, "spec_sha256": plan.spec.spec_hash(),
        "suite_sha256": suite_sha256(runner.expectations), "engine": engine, "input_files": files,
        "created_at": created_at, "validated_at": dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat(),
        "batches": outcome.batches, "success": outcome.success and all(r["success"] for r in schema_results.values()),
        "expectations": entries,
    }
    path = directory / f"{plan.spec.release_id}-{file_stamp(created_at)}-validation.json"
    write_private(path, json.dumps(report, indent=2) + "\n")
    write_private(directory / f"{plan.spec.release_id}-suite.json", json.dumps(runner.suite_json(), indent=2) + "\n")
    return path


class StrictValidationError(DPReleaseError):
    """--strict and at least one value-level expectation failed (a data-dependent, internal abort)."""
