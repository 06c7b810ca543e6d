"""Spec validation: every bad-input class gets one error naming the field, the value, what is allowed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dprelease.accounting.errors import SpecError
from dprelease.pipelines.spec import json_schema, parse_spec

from .conftest import small_spec

REPO = Path(__file__).resolve().parents[1]


def errors_of(document) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse_spec(document)
    return info.value.messages


def with_budget(**budget) -> dict:
    return small_spec(budget=budget)


def test_valid_spec_parses():
    spec = parse_spec(small_spec())
    assert spec.release_id == "test-release"
    assert list(spec.columns["geo"].levels) == ["state", "county", "tract"]


def test_missing_field_is_named():
    document = small_spec()
    del document["budget"]
    assert errors_of(document) == ["budget: required field is missing"]


def test_unknown_field_is_named():
    document = small_spec(epsilon=1)
    (message,) = errors_of(document)
    assert message.startswith("epsilon: unknown field")


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), "abc", True])
def test_epsilon_must_be_positive_finite(value):
    (message,) = errors_of(with_budget(definition="pure", epsilon=value))
    assert message.startswith("budget.epsilon = ")
    assert repr(value) in message or str(value) in message
    assert "must be" in message


def test_epsilon_accepts_exact_fractions():
    spec = parse_spec(with_budget(definition="pure", epsilon="1/3"))
    assert spec.budget.epsilon == "1/3"


@pytest.mark.parametrize("value", [1, 1.5, 0, -0.1, float("nan"), float("inf")])
def test_delta_must_be_in_open_unit_interval(value):
    (message,) = errors_of(with_budget(definition="approx", epsilon=1, delta=value))
    assert message.startswith("budget.delta = ")
    assert "[1e-100, 1)" in message


def test_rho_must_be_positive():
    (message,) = errors_of(with_budget(definition="zcdp", rho=0))
    assert message.startswith("budget.rho = 0")


def test_unknown_budget_definition():
    (message,) = errors_of(with_budget(definition="renyi", epsilon=1))
    assert message.startswith("budget")
    assert "renyi" in message and "pure" in message


def test_unknown_column_in_query():
    document = small_spec()
    document["queries"][2]["by"] = ["income"]
    (message,) = errors_of(document)
    assert message.startswith("queries[2].by[0] = 'income': unknown column")
    assert "'age'" in message


def test_unknown_geography_level():
    document = small_spec()
    document["queries"][1]["within"] = "geo.block"
    (message,) = errors_of(document)
    assert "queries[1].within = 'geo.block'" in message and "allowed" in message


@pytest.mark.parametrize("bins,expect", [
    ([0, 18, 18, 100], "strictly increasing"),
    ([5, 18, 100], "first edge must equal min"),
    ([0, 18, 99], "last edge max + 1"),
    ([0], "at least 2 edges"),
])
def test_bad_bins(bins, expect):
    document = small_spec()
    document["columns"]["age"]["bins"] = bins
    (message,) = errors_of(document)
    assert message.startswith(f"columns.age.bins = {bins}") and expect in message


@pytest.mark.parametrize("bound", [0, -3, 10**9])
def test_contribution_bound_range(bound):
    (message,) = errors_of(small_spec(contribution={"max_records_per_unit": bound}))
    assert message.startswith(f"contribution.max_records_per_unit = {bound}")


def test_duplicate_query_names():
    document = small_spec()
    document["queries"][2]["name"] = "pop"
    messages = errors_of(document)
    assert "queries[2].name = 'pop': duplicate query name" in messages


def test_each_invalid_field_reported_once():
    document = small_spec(contribution={"max_records_per_unit": 0}, budget={"definition": "pure", "epsilon": -1})
    messages = errors_of(document)
    assert len(messages) == 2


def test_geography_level_widths_must_be_distinct():
    document = small_spec()
    document["columns"]["geo"]["levels"] = {"state": 2, "county": 2, "tract": 11}
    (message,) = errors_of(document)
    assert message.startswith("columns.geo.levels") and "distinct" in message


def test_schema_is_json_schema():
    schema = json_schema()
    assert schema["type"] == "object"
    assert "budget" in schema["properties"]


SHIPPED_SPECS = sorted([*(REPO / "examples").glob("*/*.yaml"), *(REPO / "benchmarks").glob("*.yaml")])


@pytest.mark.parametrize("path", SHIPPED_SPECS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_shipped_spec_is_valid_under_the_json_schema(path):
    """What editors check against (`dprelease schema`) accepts what the parser accepts: budgets and weights
    as numbers or fraction text, a delta YAML reads as text (1e-10), defaulted lists left out."""
    from jsonschema import Draft202012Validator
    from dprelease.pipelines.spec import SpecLoader

    text = path.read_text().replace("{{MONTH}}", "2026-11")  # the scheduler's template, as it renders it
    document = yaml.load(text, Loader=SpecLoader)
    parse_spec(document)
    errors = [f"{list(e.path)}: {e.message}" for e in Draft202012Validator(json_schema()).iter_errors(document)]
    assert errors == []


@pytest.mark.parametrize("budget", [{"definition": "pure", "epsilon": -1}, {"definition": "pure", "epsilon": "a lot"},
                                    {"definition": "zcdp", "rho": 1, "delta": 2}])
def test_the_json_schema_still_rejects_bad_budgets(budget):
    from jsonschema import Draft202012Validator

    document = small_spec(budget=budget)
    assert list(Draft202012Validator(json_schema()).iter_errors(document))
    assert errors_of(document)


def test_cli_exit_code_2_on_bad_spec(tmp_path):
    document = small_spec(budget={"definition": "pure", "epsilon": -1})
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(document))
    result = subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", "plan", str(path)],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "budget.epsilon = -1" in result.stderr


def test_cli_schema_prints_json():
    result = subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", "schema"], capture_output=True, text=True)
    assert result.returncode == 0
    assert json.loads(result.stdout)["title"] == "ReleaseSpec"


def _without(document: dict, field: str) -> dict:
    return {k: v for k, v in document.items() if k != field}


REFUSED_FIELD_BY_FIELD = {
    "missing release_id": lambda: _without(small_spec(), "release_id"),
    "unknown top-level field": lambda: small_spec(surprise=1),
    "epsilon 0": lambda: small_spec(budget={"definition": "pure", "epsilon": 0}),
    "epsilon text": lambda: small_spec(budget={"definition": "pure", "epsilon": "abc"}),
    "epsilon boolean": lambda: small_spec(budget={"definition": "pure", "epsilon": True}),
    "delta 1": lambda: small_spec(budget={"definition": "approx", "epsilon": 1, "delta": 1}),
    "delta 1.5": lambda: small_spec(budget={"definition": "approx", "epsilon": 1, "delta": 1.5}),
    "delta 0": lambda: small_spec(budget={"definition": "approx", "epsilon": 1, "delta": 0}),
    "delta negative": lambda: small_spec(budget={"definition": "approx", "epsilon": 1, "delta": -0.1}),
    "rho negative": lambda: small_spec(budget={"definition": "zcdp", "rho": -1, "delta": 1e-9}),
    "unknown definition": lambda: small_spec(budget={"definition": "renyi", "epsilon": 1}),
    "contribution 0": lambda: small_spec(contribution={"max_records_per_unit": 0}),
    "contribution huge": lambda: small_spec(contribution={"max_records_per_unit": 10**9}),
    "release id with a slash": lambda: small_spec(release_id="a/b"),
    "unknown query kind": lambda: small_spec(queries=[{"name": "q", "kind": "median", "by": ["sex"]}]),
}
"""Specs the tests expect refused on one field's own value: the JSON Schema refuses them too. (Refusals that
relate fields, such as a query naming an undeclared column or level, are the parser's: a schema cannot say
them; docs/reference/spec.md says so.)"""


@pytest.mark.parametrize("name", sorted(REFUSED_FIELD_BY_FIELD))
def test_the_json_schema_refuses_what_the_parser_refuses_field_by_field(name):
    from jsonschema import Draft202012Validator

    document = REFUSED_FIELD_BY_FIELD[name]()
    with pytest.raises(Exception):
        parse_spec(document)
    assert list(Draft202012Validator(json_schema()).iter_errors(document)), name


def test_the_json_schema_accepts_the_specs_the_tests_run():
    from jsonschema import Draft202012Validator

    from .test_api import spec_with_means
    from .test_dataflow import FLOW_COLUMNS, QUERIES
    from .test_randomized_response import spec_document

    for document in (small_spec(), spec_with_means(), spec_document(),
                     small_spec(columns=FLOW_COLUMNS, queries=QUERIES, budget={"definition": "zcdp", "rho": "1/3"}),
                     small_spec(neighbouring="replace", invariants=["pop.state"])):
        parse_spec(document)
        assert list(Draft202012Validator(json_schema()).iter_errors(document)) == []


@pytest.mark.parametrize("block, field, allowed", [
    ("budget", "definition", "pure (epsilon), zcdp (rho, delta) or approx (epsilon, delta)"),
    ("kind", "kind", "histogram, marginals"),
])
def test_a_block_without_its_kind_names_the_field_and_the_kinds_allowed(block, field, allowed):
    """Issue 30: not pydantic's "Unable to extract tag using discriminator" but the field and its values."""
    document = small_spec()
    if block == "budget":
        document["budget"] = {"epsilon": 1}
    else:
        del document["queries"][0]["kind"]
    (message,) = errors_of(document)
    assert f"{field} is missing; allowed: {allowed}" in message and "discriminator" not in message, message
    if block == "budget":
        document["budget"] = {"definition": "renyi", "epsilon": 1}
        (message,) = errors_of(document)
        assert "definition = 'renyi'; allowed: pure" in message, message
