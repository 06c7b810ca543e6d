"""The release spec: a YAML file validated by frozen pydantic models.

Every field is documented as required, optional or defaulted in its `Field(description=...)`;
`dprelease schema` prints the JSON Schema. `load_spec` turns every problem into one
message naming the field path, the value and what is allowed (a `SpecError`, exit code 2).
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, WithJsonSchema, field_validator,
                      model_serializer, model_validator)

from dprelease.accounting.errors import SpecError
from dprelease.accounting.redact import shown
from dprelease.accounting.periods import parse_period
from dprelease.accounting.rationals import parse_rational
from dprelease.transforms.randomized_response import MAX_LOCAL_EPSILON, MIN_LOCAL_EPSILON

IDENTIFIER = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
NAME = r"^[A-Za-z][A-Za-z0-9_-]{0,63}$"
COLUMN_NAME = r"^[A-Za-z0-9_][A-Za-z0-9_<>=+-]{0,63}$"
"""Spec column names become parts of file names (domains/<column>.txt, marginal table names): letters,
digits and _ - < > = + only (no '.', which separates a geography column from its level, no '/')."""
LEVEL_NAME = NAME
UNIT_COLUMN = r"^[^\x00-\x1f\x7f]{1,128}$"
MAX_RECORDS_PER_UNIT = 10_000


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


MAX_BUDGET = 10**6
"""Largest epsilon or rho a spec may declare: beyond it no guarantee is meaningful and the
conversions overflow (an epsilon of 1e308 is not a budget)."""
MIN_DELTA = 1e-100
"""Smallest delta: below it 1/delta and log(1/delta) leave the range of doubles (5e-324 -> inf)."""
MAX_RATIONAL_DIGITS = 40
"""Longest numerator or denominator (decimal digits) of a budget or weight: exact arithmetic on
huge fractions costs time and memory, and no budget needs more precision."""


def _positive_rational(value: Any, field: str) -> str:
    """Validate a positive finite rational given as a number or 'p/q'; keep its exact text."""
    parsed = parse_rational(value)
    if parsed <= 0:
        raise ValueError(f"must be > 0 (got {brief(value)})")
    if len(str(parsed.numerator)) > MAX_RATIONAL_DIGITS or len(str(parsed.denominator)) > MAX_RATIONAL_DIGITS:
        raise ValueError(f"must have at most {MAX_RATIONAL_DIGITS} digits in numerator and denominator "
                         f"(got {brief(value)})")
    return str(parsed)


def _rational_up_to(value: Any, field: str, upper: Fraction | int, closed: bool, allowed: str) -> str:
    """A positive exact rational at most `upper` (below it unless `closed`); `allowed` says so in the message."""
    text = _positive_rational(value, field)
    if Fraction(text) > upper or (not closed and Fraction(text) == upper):
        raise ValueError(f"must be {allowed} (got {brief(value)})")
    return text


def _budget_amount(value: Any) -> str:
    """An epsilon or rho: a positive exact rational of at most MAX_BUDGET."""
    return _rational_up_to(value, "budget", MAX_BUDGET, True, f"at most {MAX_BUDGET:,}")


def brief(value: Any, limit: int = 80) -> str:
    """repr of a value, cut to `limit` characters: messages stay bounded whatever the spec holds."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _delta(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"must be a number in [{MIN_DELTA:g}, 1) (got {brief(value)})")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"must be a number in [{MIN_DELTA:g}, 1) (got {brief(value)})") from None
    if not (math.isfinite(number) and MIN_DELTA <= number < 1):
        raise ValueError(f"must be a finite number in [{MIN_DELTA:g}, 1) (got {brief(value)})")
    return number


RATIONAL_PATTERN = r"^\s*[0-9]+(\.[0-9]*)?([eE][-+]?[0-9]+)?(\s*/\s*[0-9]+)?\s*$"
Rational = Annotated[str, WithJsonSchema({
    "anyOf": [{"type": "number", "exclusiveMinimum": 0}, {"type": "string", "pattern": RATIONAL_PATTERN}],
    "description": "A positive number, or an exact fraction as text ('1/3', '0.1').",
})]
"""An exact rational, stored as its text; written in a spec as a number or a string (the JSON Schema says both)."""
Delta = Annotated[float, WithJsonSchema({
    "anyOf": [{"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
              {"type": "string", "pattern": r"^\s*[0-9.]+([eE]-?[0-9]+)?\s*$"}],
    "description": "A number in [1e-100, 1); YAML reads 1e-10 as text, which is accepted.",
})]


class InputSpec(Frozen):
    path: str = Field(description="Required. A Parquet or CSV file, or a directory of them (relative to the spec file).")
    format: Literal["parquet", "csv"] | None = Field(
        None, description="Optional. parquet or csv; default: from the file extension (directories: parquet)."
    )


class PureBudget(Frozen):
    definition: Literal["pure"] = Field(description="Required. Pure epsilon-DP; counts get discrete Laplace noise.")
    epsilon: Rational = Field(description="Required. Total epsilon in (0, 1e6], a number or an exact fraction 'p/q'.")

    _check_epsilon = field_validator("epsilon", mode="before")(_budget_amount)


class ApproxBudget(Frozen):
    definition: Literal["approx"] = Field(
        description="Required. Approximate (epsilon, delta)-DP, met through zCDP and discrete Gaussian noise."
    )
    epsilon: Rational = Field(description="Required. Total epsilon in (0, 1e6].")
    delta: Delta = Field(description="Required. Total delta in [1e-100, 1).")

    _check_epsilon = field_validator("epsilon", mode="before")(_budget_amount)
    _check_delta = field_validator("delta", mode="before")(_delta)


class ZcdpBudget(Frozen):
    definition: Literal["zcdp"] = Field(description="Required. rho-zCDP; counts get discrete Gaussian noise.")
    rho: Rational = Field(description="Required. Total rho in (0, 1e6].")
    delta: Delta = Field(1e-10, description="Defaulted (1e-10). The delta in [1e-100, 1) at which the implied "
                                            "epsilon is reported.")

    _check_rho = field_validator("rho", mode="before")(_budget_amount)
    _check_delta = field_validator("delta", mode="before")(_delta)


Budget = Annotated[Union[PureBudget, ApproxBudget, ZcdpBudget], Field(discriminator="definition")]


class Contribution(Frozen):
    max_records_per_unit: int = Field(
        ge=1, le=MAX_RECORDS_PER_UNIT,
        description=f"Required. At most this many records of a privacy unit are used (1..{MAX_RECORDS_PER_UNIT}).",
    )


def _no_clamp(data: Any, kind: str) -> Any:
    """`clamp` on a column that cannot be a measure: say why instead of 'unknown field'."""
    if isinstance(data, dict) and "clamp" in data:
        raise ValueError(f"clamp applies to integer columns only (a measure to sum, average or rank); "
                         f"this column is {kind}")
    return data


def _no_randomized_response(data: Any, kind: str) -> Any:
    """`randomized_response` on a column that cannot carry it: say why instead of 'unknown field'."""
    if isinstance(data, dict) and "randomized_response" in data:
        raise ValueError(f"randomized_response applies to categorical columns only (the respondent reports one of "
                         f"the listed values); this column is {kind}")
    return data


class RandomizedResponseSpec(Frozen):
    """How respondents randomized a column before it was collected (k-ary randomized response)."""

    epsilon: Rational = Field(
        description=f"Required. The local epsilon (ε₀) in [{MIN_LOCAL_EPSILON}, {MAX_LOCAL_EPSILON}] (numerator and "
                    "denominator below 2**60) each respondent's report was "
                    "randomized with: the true value with probability e^ε₀/(e^ε₀ + k − 1), each other listed value "
                    "with probability 1/(e^ε₀ + k − 1), k the number of values.")

    @field_validator("epsilon", mode="before")
    @classmethod
    def _local_epsilon(cls, value: Any) -> str:
        text = _rational_up_to(value, "epsilon", MAX_LOCAL_EPSILON, True, f"at most {MAX_LOCAL_EPSILON}")
        parsed = Fraction(text)
        if parsed < MIN_LOCAL_EPSILON or max(parsed.numerator, parsed.denominator) >= 2**60:
            raise ValueError(f"must be at least {MIN_LOCAL_EPSILON} with numerator and denominator below 2**60 "
                             f"(got {brief(value)}): below it debiasing multiplies the noise by millions")
        return text


class CategoricalColumn(Frozen):
    type: Literal["categorical"]
    values: list[str | int] = Field(min_length=1, description="Required. The public list of values (matched as text).")
    on_invalid: Literal["other", "drop"] = Field("other", description="Defaulted (other). Out-of-domain/null values.")
    randomized_response: RandomizedResponseSpec | None = Field(
        None, description="Optional. The column was collected under k-ary randomized response over `values` with "
                          "this local epsilon: its count tables are also published debiased (debiased/), and the "
                          "manifest states the local guarantee. Needs on_invalid: drop and at least 2 values.")

    @model_validator(mode="after")
    def _randomized_domain(self) -> "CategoricalColumn":
        if self.randomized_response is not None:
            if self.on_invalid != "drop":
                raise ValueError("a column with randomized_response needs on_invalid: drop (a report is one of the "
                                 "listed values; an (other) cell could not be debiased)")
            if len(self.values) < 2:
                raise ValueError("a column with randomized_response needs at least 2 values")
        return self

    @model_serializer(mode="wrap")
    def _omit_absent_randomization(self, handler):
        """The canonical form leaves `randomized_response` out when absent, so older specs keep their hash."""
        document = handler(self)
        if document.get("randomized_response") is None:
            document.pop("randomized_response", None)
        return document

    @field_validator("values")
    @classmethod
    def _unique(cls, values: list) -> list:
        texts = [str(v) for v in values]
        duplicates = sorted({t for t in texts if texts.count(t) > 1})
        if duplicates:
            raise ValueError(f"must be distinct; repeated: {duplicates}")
        return values

    _refuse_clamp = model_validator(mode="before")(lambda data: _no_clamp(data, "categorical"))


class IntegerColumn(Frozen):
    type: Literal["integer"]
    min: int = Field(description="Required. Smallest valid value.")
    max: int = Field(description="Required. Largest valid value (>= min).")
    bins: list[int] | None = Field(
        None,
        description="Optional. Bin edges e0 < e1 < ... with e0 = min and last = max + 1; cell i is [e_i, e_i+1).",
    )
    on_invalid: Literal["other", "drop"] = Field("other", description="Defaulted (other).")
    clamp: list[int] | None = Field(
        None,
        description="Optional. [lo, hi] (public, within ±(2**31 - 1)): makes the column a measure that sum, mean and "
                    "quantile queries aggregate. Each value is clamped to [lo, hi] first; a null, NaN or non-integer "
                    "value is left out of the measure's tables (never an error). Independent of min/max/bins, which "
                    "govern the column as a table dimension.",
    )

    _refuse_randomized = model_validator(mode="before")(lambda data: _no_randomized_response(data, "an integer"))


class GeographyColumn(Frozen):
    type: Literal["geography"]
    domain_file: str = Field(description="Required. Text/CSV file of valid finest-level codes, one per line.")
    levels: dict[str, int] = Field(
        min_length=1,
        description="Required. Level name -> code prefix width, e.g. {state: 2, county: 5, tract: 11}; "
                    "widths are distinct and positive and order the levels coarse to fine.",
    )
    on_invalid: Literal["other", "drop"] = Field("other", description="Defaulted (other).")

    @field_validator("levels")
    @classmethod
    def _order_by_width(cls, levels: dict[str, int]) -> dict[str, int]:
        bad = [name for name in levels if not re.fullmatch(LEVEL_NAME, name)]
        if bad:
            raise ValueError(f"level names {[brief(n, 40) for n in bad[:5]]} must match {LEVEL_NAME}: they name tables "
                             "and files")
        widths = list(levels.values())
        if any(w <= 0 for w in widths) or len(set(widths)) != len(widths):
            raise ValueError("widths must be distinct positive integers")
        return dict(sorted(levels.items(), key=lambda item: item[1]))

    _refuse_clamp = model_validator(mode="before")(lambda data: _no_clamp(data, "geography"))
    _refuse_randomized = model_validator(mode="before")(lambda data: _no_randomized_response(data, "a geography"))


Column = Annotated[Union[CategoricalColumn, IntegerColumn, GeographyColumn], Field(discriminator="type")]


class QueryBase(Frozen):
    """Fields every query has: its name and its budget weight."""

    name: str = Field(pattern=NAME, description="Required. Unique query name (letters, digits, _ and -).")
    weight: Rational = Field("1", description="Defaulted (1). Share of the budget relative to the other queries.")

    _check_weight = field_validator("weight", mode="before")(lambda v: _positive_rational(v, "weight"))


class HistogramQuery(QueryBase):
    kind: Literal["histogram"]
    by: list[str] = Field(default_factory=list, description="Defaulted ([]: the total). Columns or geo levels 'geo.county'.")


MAX_AIM_DEGREE = 2
"""Largest `degree` of a `select: aim` query: its cliques have at most 3 attributes (every round counts each
candidate table in full, so larger cliques multiply the cells a round counts)."""
DEFAULT_AIM_DEGREE = 2

MAX_WORKLOAD_WEIGHT = 1000
"""Largest weight of a workload marginal: weights are relative, and the selection's sensitivity grows with
the largest pair weight they give."""
MAX_WORKLOAD_MARGINALS = 10_000
"""Most marginals a workload may list (all 3-way marginals of 40 attributes are 9,880). With the weight cap a
pair weighs at most 2 * 1000 * 10,000 = 2 * 10^7 (a `select: aim` triple 3 * 10^7), so the score sensitivity (at
most 2 * 10,000 records per unit times that) and a selection epsilon's denominator (2^20) stay within the
selection kernel's 62 bits."""


class WorkloadMarginal(Frozen):
    """One marginal of a `select: mst` or `select: aim` query's workload: the statistics the synthetic data should serve best."""

    attributes: list[str] = Field(min_length=1, description="Required. Attributes of the query whose joint "
                                                            "table the workload asks for (distinct).")
    weight: int = Field(1, ge=1, le=MAX_WORKLOAD_WEIGHT, strict=True,
                        description="Defaulted (1). Its importance relative to the workload's other marginals (an "
                                    "integer).")


class MarginalsQuery(QueryBase):
    kind: Literal["marginals"]
    attributes: list[str] | None = Field(
        None, min_length=1, description="Required, except with select: mst or aim (default there: every column of the spec "
                                        "that is not a geography or collected under randomized_response, in the "
                                        "spec's order). Attributes whose t-way combinations are tabulated.")
    way: int = Field(2, ge=1, description="Defaulted (2). t: the size of each combination.")
    within: str | None = Field(None, description="Optional. A geography level every marginal is crossed with, 'geo.county'.")
    select: Literal["all", "mst", "aim", "auto"] = Field(
        "all", description="Defaulted (all): measure every t-way combination. 'auto': 'mst' or 'aim', chosen from "
                           "the query's budget per attribute (public; `plan` says which and why, the manifest's spec "
                           "holds the choice). 'mst' (way 2 only): measure every "
                           "attribute's 1-way table, choose a spanning tree of 2-way tables with the exponential "
                           "mechanism (MST, McKenna et al. 2021; each pair scored less the expected error of measuring it, as in AIM) "
                           "and measure those; the query's budget splits 45% 1-way "
                           "tables, 10% selection, 45% 2-way tables, and the chosen tables are recorded in the "
                           "manifest. 'aim' (way 2 only): AIM's adaptive rounds (McKenna et al. 2022): after the "
                           "1-way tables, a budget of 2 x (attributes - 1) equal rounds, each round choosing with "
                           "the exponential mechanism "
                           "one table of 2 to `degree` + 1 attributes not chosen yet (tables that close cycles "
                           "included) that keeps the graphical model of the measurements within its cap, scored "
                           "against that model fitted to the measurements so far, and measuring it before the next "
                           "round (the same budget split); a round spends 4 times (zcdp; 2 times under pure) the units "
                           "of the round before once the table measured before it moved the model less than its "
                           "noise, and all units left when fewer than twice its own would be left (AIM's annealing); "
                           "a query with more such tables than 2^20 / attributes^2, or "
                           "within more than 16 units, "
                           "grows a junction tree instead, one new attribute a round, attributes - 1 rounds.")
    strategy: Literal["optimal", "direct"] = Field(
        "optimal", description="Defaulted (optimal), for published tables (select: all) under a zcdp or approx budget: "
                               "'optimal' measures the t-way tables and their lower-way tables with the budget split "
                               "that minimises the t-way tables' total variance (ResidualPlanner, Xiao et al. 2023); "
                               "the lower-way tables it measures are published too, and `plan` shows the expected "
                               "error against 'direct'; 'direct' measures each t-way table alone, with equal shares.")
    degree: int | None = Field(
        None, ge=1, le=MAX_AIM_DEGREE, strict=True,
        description=f"Optional, with select: aim only (default 2): a chosen table has up to degree + 1 attributes "
                    f"(1 to {MAX_AIM_DEGREE}; 1 chooses 2-way tables, 2 also 3-way tables).")
    workload: list[WorkloadMarginal] | None = Field(
        None, min_length=1, max_length=MAX_WORKLOAD_MARGINALS, description="Optional, with select: mst or aim only (default: every table of the attributes, "
                                        "alike). The marginals the synthetic data should serve, weighted: each "
                                        "candidate table's score is multiplied by its AIM weight (McKenna et al. "
                                        "2022), the sum over the workload of weight x the attributes the table "
                                        "shares with the marginal, and the selection's sensitivity by the largest "
                                        "such weight.")

    @property
    def selects(self) -> bool:
        """Whether the query's tables beyond the 1-way ones are chosen from the data (`select: mst` or `aim`)."""
        return self.select != "all"

    @property
    def aim_degree(self) -> int:
        """The degree of a `select: aim` query (2 unless given)."""
        return self.degree if self.degree is not None else DEFAULT_AIM_DEGREE

    @model_serializer(mode="wrap")
    def _omit_default_select(self, handler):
        """The canonical form leaves `select`, `degree` and `workload` out at their defaults, so specs written before them
        keep their hash."""
        document = handler(self)
        if document.get("select") == "all":
            del document["select"]
        if document.get("workload") is None:
            document.pop("workload", None)
        if document.get("degree") is None:
            document.pop("degree", None)
        if document.get("strategy") == "optimal":
            del document["strategy"]
        return document


class HierarchyQuery(QueryBase):
    kind: Literal["hierarchy"]
    geography: str = Field(description="Required. The geography column.")
    levels: list[str] = Field(min_length=1, description="Required. Levels coarse to fine, e.g. [nation, state, county].")
    by: list[str] = Field(default_factory=list, description="Defaulted ([]). Attributes crossed with every level.")


class SumQuery(QueryBase):
    kind: Literal["sum"]
    column: str = Field(description="Required. An integer column with `clamp`: the measure summed per cell.")
    by: list[str] = Field(default_factory=list, description="Defaulted ([]: the total). Columns or geo levels.")


class MeanQuery(QueryBase):
    kind: Literal["mean"]
    column: str = Field(description="Required. An integer column with `clamp`: the measure averaged per cell.")
    by: list[str] = Field(default_factory=list, description="Defaulted ([]). Columns or geo levels.")
    count_share: Rational = Field(
        "1/3", description="Defaulted (1/3). Share of the query's budget for the noisy count of records with a valid "
                           "measure (tables NAME.sum and NAME.count); the rest measures the sum. The mean is "
                           "their ratio, clamped to [lo, hi] (post-processing).")

    _check_share = field_validator("count_share", mode="before")(
        lambda v: _rational_up_to(v, "count_share", 1, False, "a fraction in (0, 1)"))


MAX_QUANTILE_DENOMINATOR = 1000
MAX_CANDIDATES = 10_000


class QuantileQuery(QueryBase):
    kind: Literal["quantile"]
    column: str = Field(description="Required. An integer column with `clamp`: the measure ranked per cell.")
    by: list[str] = Field(default_factory=list, description="Defaulted ([]). Columns or geo levels.")
    q: list[Rational] = Field(min_length=1, max_length=20,
                         description="Required. Quantiles in (0, 1), e.g. [0.5] or [0.25, 0.5, 0.75] (denominators "
                                     f"up to {MAX_QUANTILE_DENOMINATOR}); the budget is split equally among them.")
    candidates: list[int] | None = Field(
        None, description=f"Optional. Public candidate values, strictly increasing, within the clamp (2..{MAX_CANDIDATES:,}); "
                          "default: the column's bin edges within its clamp. Each release picks one of them.")

    @field_validator("q", mode="before")
    @classmethod
    def _quantiles(cls, values: Any) -> list[str]:
        if not isinstance(values, list):
            raise ValueError(f"must be a list of quantiles in (0, 1) (got {brief(values)})")
        parsed = []
        for value in values:
            q = parse_rational(value)
            if not 0 < q < 1 or q.denominator > MAX_QUANTILE_DENOMINATOR:
                raise ValueError(f"each q must lie in (0, 1) with a denominator of at most {MAX_QUANTILE_DENOMINATOR} "
                                 f"(got {brief(value)})")
            parsed.append(str(q))
        if len(set(parsed)) != len(parsed):
            raise ValueError(f"must be distinct (got {brief(values)})")
        return parsed


class CountUnitsQuery(QueryBase):
    kind: Literal["count_units"]
    by: list[str] = Field(default_factory=list, description="Defaulted ([]). Columns or geo levels.")


Query = Annotated[Union[HistogramQuery, MarginalsQuery, HierarchyQuery, SumQuery, MeanQuery, QuantileQuery,
                        CountUnitsQuery], Field(discriminator="kind")]
MEASURE_QUERIES = (SumQuery, MeanQuery, QuantileQuery)


class OutputSpec(Frozen):
    dir: str = Field(description="Required. Directory under which the release directory <release_id>/ is published.")


AUTO_AIM_RHO_PER_ATTRIBUTE = Fraction(1, 3000)
"""`select: auto` takes 'aim' when the query's zCDP budget per attribute is at least this (a pure epsilon counts
as epsilon^2 / 2), 'mst' below. Measured on UCI Adult's 14 attributes (benchmarks/synthetic_adult.py, 5 keys):
at epsilon 0.3 (rho per attribute 1.1e-4) mst's records were 2% better on 2-way and 3-way marginals, at epsilon
1 (1.1e-3) and 3 aim's 7-12% better: each AIM round buys an estimate of a table only when a round's share beats
the table's noise, which a small budget per attribute does not."""


def auto_selection(spec: "ReleaseSpec", query: "MarginalsQuery") -> tuple[str, str]:
    """The mode `select: auto` picks for `query` and why, from public things only: the spec's budget, the
    query's weight among the queries', its number of attributes."""
    from dprelease.accounting.conversions import approx_to_zcdp

    from .spec_checks import MAX_AIM_ATTRIBUTES

    if len(query.attributes) > MAX_AIM_ATTRIBUTES:
        return "mst", (f"select: auto chose mst: {len(query.attributes)} attributes, more than aim takes "
                       f"({MAX_AIM_ATTRIBUTES})")
    budget = spec.budget
    if budget.definition == "pure":
        total = Fraction(budget.epsilon) ** 2 / 2
    elif budget.definition == "zcdp":
        total = Fraction(budget.rho)
    else:
        total = approx_to_zcdp(Fraction(budget.epsilon), budget.delta)
    share = total * Fraction(query.weight) / sum((Fraction(q.weight) for q in spec.queries), Fraction(0))
    per_attribute = share / len(query.attributes)
    mode = "aim" if per_attribute >= AUTO_AIM_RHO_PER_ATTRIBUTE else "mst"
    relation = ">=" if mode == "aim" else "<"
    counted = " (its pure epsilon counted as epsilon^2 / 2)" if budget.definition == "pure" else ""
    return mode, (f"select: auto chose {mode}: the query's rho per attribute{counted}, {float(per_attribute):.3g}, "
                  f"is {relation} {float(AUTO_AIM_RHO_PER_ATTRIBUTE):.3g}")


class ReleaseSpec(Frozen):
    """A differentially private release: what to read, how to bound, what to count, how much budget."""

    release_id: str = Field(pattern=IDENTIFIER, description="Required. Identifier of this release.")
    dataset_id: str = Field(pattern=IDENTIFIER, description="Required. Identifier of the confidential dataset.")
    period: str | None = Field(
        None,
        description="Optional. The period this release of a series covers: YYYY, YYYY-Qn, YYYY-MM or YYYY-MM-DD "
                    "(e.g. 2026-11). The ledger charges the release against the per-period budget of every budget "
                    "period it overlaps (see accounting/periods.py).",
    )
    engine: Literal["embedded", "spark", "beam"] = Field(
        "embedded", description="Defaulted (embedded). The engine that runs it: embedded, spark or beam.")
    input: InputSpec
    privacy_unit: str | None = Field(
        pattern=UNIT_COLUMN,
        description="Required. Column identifying a privacy unit (person, household); null: each record is a unit."
    )
    neighbouring: Literal["add_remove", "replace"] = Field(
        "add_remove", description="Defaulted (add_remove). Neighbouring inputs add/remove or replace one unit."
    )
    budget: Budget
    contribution: Contribution
    columns: dict[str, Column] = Field(min_length=1, description="Required. Public domains of the columns used.")
    queries: list[Query] = Field(min_length=1, description="Required. The tables to release.")
    invariants: list[str] = Field(
        default_factory=list,
        description="Defaulted ([]). Hierarchy tables published exactly, without noise and without protection "
                    "(e.g. population.state); the manifest lists them as unprotected. Only with neighbouring: replace: "
                    "the guarantee then covers neighbours that replace one unit by another whose records fall in the "
                    "same cells of every invariant table (under add_remove every neighbour changes an invariant).",
    )
    output: OutputSpec

    @model_validator(mode="before")
    @classmethod
    def _mst_attributes(cls, document: Any) -> Any:
        """A `select: mst` or `select: aim` marginals query without attributes takes every column that is neither a geography nor
        collected under randomized response (public: the spec's own declarations), written into the spec so its
        hash and manifest say which."""
        if not isinstance(document, dict) or not isinstance(document.get("queries"), list) \
                or not isinstance(document.get("columns"), dict):
            return document
        columns = [name for name, column in document["columns"].items()
                   if not (isinstance(column, dict) and (column.get("type") == "geography"
                                                         or column.get("randomized_response") is not None))]
        queries = []
        for query in document["queries"]:
            if isinstance(query, dict) and query.get("kind") == "marginals" and query.get("select") in ("mst", "aim", "auto") \
                    and query.get("attributes") is None:
                query = {**query, "attributes": columns}
            queries.append(query)
        return {**document, "queries": queries}

    _auto: dict[str, str] | None = PrivateAttr(default=None)

    @model_validator(mode="wrap")
    @classmethod
    def _resolve_auto_select(cls, data: Any, handler) -> "ReleaseSpec":
        """`select: auto` becomes 'mst' or 'aim' (`auto_selection`), so the canonical spec, its hash and the
        manifest hold the choice; the reasons stay on the parsed spec for `plan` (`auto_selections`)."""
        spec = handler(data)
        chosen = {q.name: auto_selection(spec, q) for q in spec.queries
                  if isinstance(q, MarginalsQuery) and q.select == "auto"}
        if not chosen:
            return spec
        queries = [q.model_copy(update={"select": chosen[q.name][0]}) if q.name in chosen else q for q in spec.queries]
        resolved = spec.model_copy(update={"queries": queries})
        resolved._auto = {name: reason for name, (_, reason) in chosen.items()}
        return resolved

    @property
    def auto_selections(self) -> dict[str, str]:
        """Per `select: auto` query of the document this spec was parsed from: the mode chosen, and why."""
        return dict(self._auto or {})

    @field_validator("period")
    @classmethod
    def _period(cls, value: str | None) -> str | None:
        if value is not None:
            parse_period(value)
        return value

    @field_validator("columns")
    @classmethod
    def _column_names(cls, columns: dict) -> dict:
        bad = [name for name in columns if not re.fullmatch(COLUMN_NAME, name)]
        if bad:
            raise ValueError(f"column names {[brief(n, 40) for n in bad[:5]]} must match {COLUMN_NAME} (letters, digits "
                             "and _ - < > = +, at most 64): they become parts of file names")
        return columns

    def canonical_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def spec_hash(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    def total_budget(self) -> Fraction:
        value = getattr(self.budget, "rho", None) or self.budget.epsilon
        return Fraction(value)


def _location(loc: tuple) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text or "spec"


DISCRIMINATED = {
    "definition": "pure (epsilon), zcdp (rho, delta) or approx (epsilon, delta)",
    "type": "categorical (values), integer (min, max, bins) or geography (domain_file, levels)",
    "kind": "histogram, marginals, hierarchy, sum, mean, quantile or count_units",
}
"""The field that says which kind a block is, and what each kind allows (for a block without it)."""


def _pydantic_messages(error: ValidationError) -> list[str]:
    messages = []
    for item in error.errors():
        loc = tuple(p for p in item["loc"] if p not in ("pure", "approx", "zcdp", "categorical", "integer",
                                                       "geography", "histogram", "marginals", "hierarchy", "sum", "mean",
                                                       "quantile", "count_units"))
        path = _location(loc)
        msg = item["msg"].removeprefix("Value error, ")
        if item["type"] == "missing":
            messages.append(f"{path}: required field is missing")
        elif item["type"] in ("union_tag_not_found", "union_tag_invalid"):
            tag = item["ctx"]["discriminator"].strip("'")
            allowed = DISCRIMINATED.get(tag, "see `dprelease schema`")
            found = "is missing" if item["type"] == "union_tag_not_found" else f"= {brief(item['ctx'].get('tag'))}"
            messages.append(f"{path}.{tag} {found}; allowed: {allowed}")
        elif item["type"] == "extra_forbidden":
            messages.append(f"{path}: unknown field (value {brief(item['input'])}); check the spelling against "
                            "`dprelease schema`")
        else:
            messages.append(f"{path} = {brief(item.get('input'))}: {msg[:300]}")
    return messages


def parse_spec(document: Any) -> ReleaseSpec:
    """Validate a parsed YAML/JSON document; all field and cross-reference problems at once."""
    if not isinstance(document, dict):
        raise SpecError(f"spec: expected a mapping of fields, got {type(document).__name__}")
    try:
        spec = ReleaseSpec.model_validate(document)
    except ValidationError as error:
        raise SpecError(_pydantic_messages(error)) from None
    from .spec_checks import cross_reference_problems

    problems = cross_reference_problems(spec)
    if problems:
        raise SpecError(problems)
    return spec


MAX_SPEC_BYTES = 1 << 20
"""A spec is a small public file; a larger one is refused before it is parsed."""


MAX_YAML_DIGITS = 100
"""Longest integer a spec may write: Python refuses to build integers of over 4,300 digits with a
traceback-worthy ValueError, and no field of a spec needs more than a few dozen."""
MAX_NESTING = 64
"""Deepest nesting of a spec document (a spec is a few levels deep)."""


class SpecLoader(yaml.SafeLoader):
    """YAML's safe loader without aliases, merge keys or duplicate keys: a spec is plain data.

    Aliases make billion-laughs documents (a few lines, gigabytes once expanded) and merge keys hide
    where a value came from; a duplicate key (`rho: 1` then `rho: 1000`) would silently take the last
    value. Each is an error naming the line."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.constructor.ConstructorError(
                None, None, "aliases (*name) are not allowed in a spec; write the value out", event.start_mark)
        return super().compose_node(parent, index)

    def construct_yaml_int(self, node):
        text = str(node.value)
        if sum(ch.isdigit() for ch in text) > MAX_YAML_DIGITS:
            raise yaml.constructor.ConstructorError(
                None, None, f"an integer of more than {MAX_YAML_DIGITS} digits", node.start_mark)
        return super().construct_yaml_int(node)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise yaml.constructor.ConstructorError(
                    None, None, "merge keys (<<) are not allowed in a spec", key_node.start_mark)
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {brief(key)} (each field may appear once)", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


SpecLoader.add_constructor("tag:yaml.org,2002:int", SpecLoader.construct_yaml_int)


def load_spec(path: str | Path) -> tuple[ReleaseSpec, Path]:
    """Read and validate a spec file (read without blocking and bounded: a FIFO, a device or a file over
    MAX_SPEC_BYTES is refused). Returns the spec and the directory relative paths start from."""
    from .storage import read_named

    data = read_named(path, MAX_SPEC_BYTES, "spec file")
    path = Path(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecError(f"spec file {shown(path)}: not UTF-8 text") from None
    if nesting_depth(text) > MAX_NESTING:
        raise SpecError(f"spec file {shown(path)}: nested more than {MAX_NESTING} levels deep; a spec is plain data a few "
                        "levels deep")
    try:
        document = yaml.load(text, Loader=SpecLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as error:
        raise SpecError(f"spec file {shown(path)}: not valid YAML ({str(error)[:500]})") from None
    except RecursionError:
        raise SpecError(f"spec file {shown(path)}: nested too deeply to be a spec") from None
    return parse_spec(document), path.resolve().parent


def nesting_depth(text: str) -> int:
    """An upper bound on the nesting of flow collections ([ and {) in a YAML or JSON text, and of its
    indentation levels: cheap, before any parser recurses."""
    depth = deepest = 0
    for ch in text:
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth = max(0, depth - 1)
    indents = {len(line) - len(line.lstrip(" -")) for line in text.splitlines() if line.strip()}
    return max(deepest, len(indents))


def json_schema() -> dict:
    return ReleaseSpec.model_json_schema()
