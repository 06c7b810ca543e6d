"""The release manifest as a pydantic model: its JSON Schema is published with the package
(`dprelease schema --manifest`, accounting/manifest.schema.json) and `verify` checks manifests
against it. Unknown fields are errors, so the schema documents every field a manifest holds."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_FILE = Path(__file__).with_name("manifest.schema.json")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Exact(Strict):
    fraction: str = Field(description="Exact rational, 'p/q' or 'p'.")
    decimal: float


class Software(Strict):
    name: Literal["dprelease"]
    version: str = Field(description="Descriptive (not verified): the dprelease version that wrote the release.")


class Privacy(Strict):
    unit: str = Field(description="The privacy-unit column, or 'record'.")
    neighbouring: Literal["add_remove", "replace"]
    neighbouring_note: str
    definition: Literal["pure", "approx", "zcdp"]
    declared_budget: dict[str, Any]
    contribution_bounds: dict[str, int]
    invalid_value_policy: dict[str, Literal["other", "drop"]]


class AllocationBudget(Exact):
    unit: Literal["epsilon", "rho"]


class Dimension(Strict):
    column: str
    level: str | None
    size: int


class Mechanism(Strict):
    kind: Literal["discrete_laplace", "discrete_gaussian", "exponential"]
    parameter: Literal["scale", "sigma2", "epsilon"]
    value: Exact
    selections: int | None = None
    accounted_as: Literal["epsilon", "rho"] | None = None


class Sensitivity(Strict):
    l1: int
    l2_squared: int
    derivation: str


class ExpectedError(Strict):
    variance: float | None = None
    std: float | None = None
    margin_95: int | None = None
    rank_margin_95: int | None = None
    note: str | None = None


class Measure(Strict):
    column: str
    clamp: list[int]


class Quantile(Strict):
    q: list[str]
    candidates: list[int]
    score_sensitivity: list[int]


class MeanRecord(Strict):
    table: str
    sum_table: str
    count_table: str
    measure: Measure


class EstimateRecord(Strict):
    """The GLS variance of a count table's cells (before rounding): public, from the plan."""

    variance_min: float
    variance_max: float
    variance_mean: float
    bound: Literal["exact", "upper bound"]
    note: str


class TableRecord(Strict):
    name: str
    query: str
    kind: Literal["histogram", "marginals", "hierarchy", "sum", "mean", "quantile", "count_units"]
    statistic: Literal["sum", "units", "quantile", "count"] | None = None
    measure: Measure | None = None
    quantile: Quantile | None = None
    cells: int
    dimensions: list[Dimension]
    invariant: bool
    mechanism: Mechanism | None
    note: str | None = None
    sensitivity: Sensitivity | None = None
    allocated: Exact | None = None
    loss: Exact | None = None
    expected_error: ExpectedError | None = None
    estimate: EstimateRecord | None = Field(
        None, description="Count tables of version-2 manifests: variance of the global least-squares estimate.")


class PairTables(Strict):
    mechanism: Mechanism
    sensitivity: Sensitivity
    allocated: Exact
    loss: Exact
    expected_error: ExpectedError


class WorkloadWeight(Strict):
    """A candidate pair and its public weight in the selection's score."""

    pair: list[str]
    weight: int


class AttributeWeight(Strict):
    """An attribute and its public weight in a `select: aim` selection's score (a candidate weighs the sum of its
    attributes')."""

    attribute: str
    weight: int


class SelectionRecord(Strict):
    """A `select: mst` or `select: aim` query's selection: rounds of the exponential mechanism and the tables
    they chose."""

    name: str
    query: str
    method: Literal["mst", "aim"]
    degree: int | None = Field(None, description="aim: the most attributes a new attribute's table joins it to.")
    score: str
    candidates_rule: str | None = Field(None, description="aim: which tables a round chooses among.")
    rounds: int
    candidates: int
    mechanism: Mechanism
    sensitivity: Sensitivity
    allocated: Exact
    loss: Exact
    chosen: list[list[str]] | None
    pair_tables: PairTables | None = Field(None, description="mst: the mechanism of every chosen pair's table.")
    chosen_tables: PairTables | None = Field(None, description="aim: the mechanism of every chosen table.")
    annealing: str | None = Field(None, description="aim (version 9 on, over a capped model): how the rounds spend "
                                  "the budget's units.")
    units: list[int] | None = Field(None, description="aim with annealing: each chosen table's round's budget units, "
                                    "in order (null in a plan made before the data was read).")
    unused_units: int | None = Field(None, description="aim with annealing: the budget units no round spent (still "
                                     "accounted).")
    workload_weights: list[WorkloadWeight] | None = Field(
        None, description="mst: each candidate pair's workload weight (only with a workload in the spec).")
    attribute_weights: list[AttributeWeight] | None = Field(
        None, description="aim: each attribute's workload weight (only with a workload in the spec).")


class Totals(Strict):
    definition: Literal["pure", "approx", "zcdp"]
    allocated_sum: Exact
    epsilon: Exact | None = None
    rho: Exact | None = None
    epsilon_at_delta: float | None = None
    delta: float | None = None


class LossBySection(Strict):
    by_attribute: dict[str, dict[str, Any]]
    by_geography_level: dict[str, dict[str, Any]]


class ImpliedLoss(Strict):
    """The loss each attribute and each geography level carries (from version 6: selections included)."""

    by_attribute: dict[str, dict[str, Any]]
    by_geography_level: dict[str, dict[str, Any]]
    worst_case_over_selections: LossBySection | None = Field(
        None, description="Version 6 on, releases with selections: the loss if every table every selection chose "
                          "held the attribute or level (a bound whatever the data chose).")


class Invariant(Strict):
    table: str
    protected: Literal[False]
    note: str


class Step(Strict):
    query: str
    step: str


class LedgerV2(Strict):
    """The ledger block of manifests of versions 1 and 2 (`charged` is 0 for a free re-run)."""

    dataset_id: str
    unit: Literal["epsilon", "rho"]
    lifetime_budget: str
    spent_before: str
    spent_after: str
    charged: str
    rerun_of_committed_release: bool
    period: str | None
    period_budget: str | None
    period_spent_before: str | None
    period_spent_after: str | None


class PeriodCharge(Strict):
    period: str = Field(description="A budget period the release is charged to (canonical text).")
    spent_before: str
    spent_after: str


class PeriodBudget(Strict):
    per: Literal["year", "quarter", "month", "day"]
    budget: str
    periods: list[PeriodCharge] = Field(description="Every budget period the release's period overlaps.")


class Ledger(Strict):
    """The ledger block (version 3 and on): what the release cost and what this run added to the dataset's spend."""

    dataset_id: str
    unit: Literal["epsilon", "rho"]
    lifetime_budget: str
    spent_before: str
    spent_after: str
    charged: str = Field(description="What the release cost in the ledger (also when this run re-published it free).")
    charged_by_this_run: str = Field(description="What this run added: the charge, or 0 for a free re-run.")
    rerun_of_committed_release: bool
    period: str | None
    period_budget: PeriodBudget | None


class InputValidation(Strict):
    tool: Literal["great_expectations"]
    suite_sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the suite generated from the spec.")
    expectations: int
    schema_failures: str
    value_failures: str
    invalid_value_policy: dict[str, Literal["other", "drop"]]
    null_privacy_unit: str


class FileEntry(Strict):
    path: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    bytes: int


class Invocation(Strict):
    """The entry point and its allow-listed options, each value only where its type is known public."""

    entry: str
    options: dict[str, Any]


class Provenance(Strict):
    """Descriptive (not verified): how the release was made. Version 6 on: `invocation`, structured and
    allow-listed; before: `command_line`, with credentials redacted by a denylist."""

    git_commit: str | None
    versions: dict[str, str]
    invocation: Invocation | None = None
    command_line: list[str] | None = None
    created_at: str = Field(description="Start of the run, before any data is read (or SOURCE_DATE_EPOCH).")


class LayoutRecord(Strict):
    """The two sizes that decide which parts the tables are written in (checked, then used by verify)."""

    group_work: int = Field(description="Work per group of units of a level's pass; a group is a part.")
    part_rows: int = Field(description="Rows per part of a table not written per group.")


class LocalColumnRecord(Strict):
    """A column its respondents randomized before collection (k-ary randomized response)."""

    column: str
    mechanism: Literal["k-ary randomized response"]
    values: int = Field(description="k: the number of values a report is drawn from.")
    epsilon0: str = Field(description="The local epsilon per record, exact.")
    epsilon0_value: float
    p_truth: float = Field(description="Probability that a report is the true value, e^ε₀/(e^ε₀ + k − 1).")
    p_each_other: float = Field(description="Probability of each other value, 1/(e^ε₀ + k − 1).")
    per_unit_epsilon: str = Field(description="max_records_per_unit × ε₀, exact: the local guarantee per unit for "
                                              "this release against anyone without its key (the collected file "
                                              "holds all n reports of a unit: n × ε₀).")
    per_unit_epsilon_value: float
    value_change_epsilon: float = Field(description="For neighbours that change only one unit's true values of this "
                                                    "column: the smaller of value_change.central_epsilon and "
                                                    "per_unit_epsilon.")
    value_change_delta: float = Field(description="The δ of value_change_epsilon: the central one's when it is the "
                                                  "smaller, else 0 (the local bound is pure).")


class ValueChange(Strict):
    """The central guarantee for neighbours that change one unit's values (not its presence)."""

    central_epsilon: float
    delta: float
    steps: int = Field(description="Neighbour steps such a change takes: 1 (replace) or 2 (add_remove).")
    rho: str | None = Field(None, description="zCDP: steps² × the release's rho, exact (absent under pure DP).")


class DebiasedTableRecord(Strict):
    """A count table published debiased in debiased/<table>."""

    table: str
    randomized: list[str] = Field(description="Its randomized columns.")
    noise_variance: float = Field(description="The central noise's variance per debiased cell (exact); the "
                                              "randomization's part is per cell in the file's response_variance.")


class LocalRandomization(Strict):
    columns: list[LocalColumnRecord]
    debiased_tables: list[DebiasedTableRecord]
    value_change: ValueChange
    note: str


class Signature(Strict):
    algorithm: Literal["Ed25519"]
    file: str
    public_key_sha256: str


class Manifest(Strict):
    """A published release's manifest: no true counts, no row counts, no key. `dprelease verify` recomputes
    every field from the embedded spec or checks it for consistency, except those described as descriptive."""

    manifest_version: Literal[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    release_id: str
    dataset_id: str
    software: Software
    engine: Literal["embedded", "spark", "beam"] = Field(
        description="Descriptive (not verified): every engine writes the same release bytes.")
    spec: dict[str, Any]
    spec_sha256: str
    privacy: Privacy
    allocation_budget: AllocationBudget
    tables: list[TableRecord]
    totals: Totals
    implied_loss: ImpliedLoss
    selections: list[SelectionRecord] | None = Field(
        None, description="Tables chosen from the data (`select: mst` or `aim`), in the order chosen (absent without "
                          "one).")
    invariants: list[Invariant]
    post_processing: list[Step]
    means: list[MeanRecord] | None = Field(
        None, description="Mean tables, each derived from a noisy sum and a noisy count table (absent without means).")
    local_randomization: LocalRandomization | None = Field(
        None, description="Columns collected under randomized response, their local guarantee and the tables "
                          "published debiased (absent without such a column).")
    ledger: Ledger | LedgerV2 | None
    input_validation: InputValidation | None = Field(
        description="Present when the input was validated: the suite's hash and the policies, never pass/fail.")
    key_id: str = Field(pattern=r"^[0-9a-f]{16}$",
                        description="One-way id of the key file's key; well-formedness checked, value authenticated "
                                    "only by a signature.")
    domain_files: dict[str, str]
    layout: LayoutRecord | None = Field(
        None, description="Descriptive (not verified): a run option, version 3 and on; verify takes it, within bounds, "
                          "to know which parts the tables are written in, and checks the files against those parts.")
    files: list[FileEntry]
    provenance: Provenance
    signature: Signature | None = None


def manifest_json_schema() -> dict:
    return Manifest.model_json_schema()


def write_schema_file() -> None:
    """Regenerate accounting/manifest.schema.json (run after changing the model)."""
    SCHEMA_FILE.write_text(json.dumps(manifest_json_schema(), indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    write_schema_file()
