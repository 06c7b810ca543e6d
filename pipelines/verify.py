"""`dprelease verify DIR`: recompute everything a manifest claims and report every mismatch.

Every field of a manifest is one of three kinds, and verify checks each:
- derived: recomputed from the embedded spec and a fresh plan of it over the release's own domain
  files, and compared (ids, spec and its hash, privacy block, tables, sensitivities, allocations,
  mechanisms, expected errors, totals, implied losses, invariants, post-processing, domain files,
  the input-validation record, the set of files a release of this plan holds);
- checked: internally consistent and well formed (ledger arithmetic: spent_after = spent_before +
  charged, charged = the plan's spend unless a free re-run, within the budgets; key_id and file
  hashes well formed; every listed file present with its size and SHA-256, nothing else in the tree;
  a signature block has its signature file; every table readable with one integer row per cell);
- descriptive (`DESCRIPTIVE_FIELDS`: software version, engine, provenance): recorded, not verified.
A malformed manifest (`{}`, `[]`, `null`, missing or mistyped fields) gives a list of problems, not
a traceback.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path, PurePosixPath

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import ValidationError

from dprelease.accounting.errors import DPReleaseError
from dprelease.accounting.manifest_model import Manifest
from dprelease.accounting.signing import SIGNATURE_FILE, check, fingerprint, load_public_key, well_formed

from .manifest import DESCRIPTIVE_FIELDS, MANIFEST_VERSION, derived_section, domain_file_names, sha256_file
from .limits import check_cell_limit
from .plan import Plan, build_plan
from .postprocessing import EstimateVariances, estimate_variances
from .release import GLS_VARIANCE, MEASUREMENTS_DIR, TABLES_DIR
from .spec import brief, parse_spec
from .validation import manifest_record

MANIFEST = "manifest.json"
SUPPORTED_VERSIONS = (1, 2)
HEX16 = re.compile(r"^[0-9a-f]{16}$")
HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass
class VerifyReport:
    release_dir: Path
    problems: list[str] = field(default_factory=list)
    checked_files: int = 0
    manifest: dict | None = None
    plan: Plan | None = None
    estimate: EstimateVariances | None = None
    signature: str = "not checked"

    @property
    def ok(self) -> bool:
        return not self.problems


def _safe_relative(path: object) -> str | None:
    """The path if it is a plain relative POSIX path inside the release (no '..', '.', '/' prefix)."""
    if not isinstance(path, str) or not path or "\\" in path or "\0" in path:
        return None
    parts = PurePosixPath(path).parts
    if path.startswith("/") or any(p in ("..", ".", "") for p in parts) or PurePosixPath(*parts).as_posix() != path:
        return None
    return path


def expected_files(plan: Plan) -> set[str]:
    """The files a release of this plan holds (besides the manifest and its signature)."""
    names = {f"{folder}/{t.name}.{ext}" for t in plan.tables for folder in (TABLES_DIR, MEASUREMENTS_DIR)
             for ext in ("parquet", "csv")}
    means = {f"{TABLES_DIR}/{m.name}.{ext}" for m in plan.means for ext in ("parquet", "csv")}
    return names | means | set(domain_file_names(plan).values())


def _check_files(root: Path, manifest: dict, report: VerifyReport) -> None:
    """Every listed file is a safe relative path, present, with its size and SHA-256; nothing else
    (no unlisted file, directory, link or special file) is in the release tree."""
    entries = manifest.get("files")
    if not isinstance(entries, list):
        report.problems.append("files: must be a list of {path, sha256, bytes}")
        entries = []
    listed: set[str] = set()
    for i, entry in enumerate(entries):
        path = _safe_relative(entry.get("path") if isinstance(entry, dict) else None)
        if path is None:
            report.problems.append(f"files[{i}]: path {entry.get('path') if isinstance(entry, dict) else entry!r} "
                                   "is not a plain relative path inside the release")
            continue
        if path in listed or path in (MANIFEST, SIGNATURE_FILE):
            report.problems.append(f"files[{i}]: {path} listed twice or names the manifest/signature")
            continue
        listed.add(path)
        target = root / path
        if target.is_symlink() or not target.is_file():
            report.problems.append(f"file {path}: missing (or not a regular file)")
            continue
        if target.stat().st_size != entry.get("bytes"):
            report.problems.append(f"file {path}: size {target.stat().st_size} != manifest {entry.get('bytes')!r}")
        if not HEX64.match(str(entry.get("sha256"))) or sha256_file(target) != entry.get("sha256"):
            report.problems.append(f"file {path}: SHA-256 differs from the manifest")
        report.checked_files += 1
    allowed_dirs = {parent.as_posix() for p in listed for parent in PurePosixPath(p).parents} - {"."}
    allowed_files = listed | {MANIFEST} | ({SIGNATURE_FILE} if manifest.get("signature") else set())
    for item in sorted(root.rglob("*")):
        relative = item.relative_to(root).as_posix()
        if item.is_symlink():
            report.problems.append(f"{relative}: a symbolic link inside the release")
        elif item.is_dir():
            if relative not in allowed_dirs:
                report.problems.append(f"directory {relative}: present but holds no listed file")
        elif not item.is_file():
            report.problems.append(f"{relative}: not a regular file")
        elif relative not in allowed_files:
            report.problems.append(f"file {relative}: present but not listed in the manifest")


def _compare(path: str, expected, actual, problems: list[str]) -> None:
    """Deep comparison; floats within 1e-9 relative (they are re-derived by the same formulas)."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        for key in sorted(set(expected) | set(actual)):
            if key not in actual:
                problems.append(f"{path}.{key}: missing from the manifest")
            elif key not in expected:
                problems.append(f"{path}.{key}: not expected (value {brief(actual[key], 200)})")
            else:
                _compare(f"{path}.{key}", expected[key], actual[key], problems)
    elif isinstance(expected, list) and isinstance(actual, list):
        if len(expected) != len(actual):
            problems.append(f"{path}: {len(actual)} entries, expected {len(expected)}")
        for i, (e, a) in enumerate(zip(expected, actual)):
            _compare(f"{path}[{i}]", e, a, problems)
    elif isinstance(expected, float) and isinstance(actual, (int, float)) and not isinstance(actual, bool):
        if not math.isclose(expected, actual, rel_tol=1e-9, abs_tol=1e-12):
            problems.append(f"{path}: manifest says {actual!r}, recomputed {expected!r}")
    elif expected != actual or type(expected) is not type(actual):
        problems.append(f"{path}: manifest says {brief(actual, 200)}, recomputed {brief(expected, 200)}")


def _replan(root: Path, manifest: dict, report: VerifyReport):
    """(plan, embedded spec), the plan made over the release's own domain files; None when the embedded
    spec is missing, invalid or cannot be planned. The spec must be in the canonical form dprelease writes."""
    document = manifest.get("spec")
    if not isinstance(document, dict):
        report.problems.append("spec: missing or not a mapping")
        return None
    try:
        original = parse_spec(document)
    except DPReleaseError as error:
        report.problems.append(f"spec: invalid: {error}")
        return None
    if original.model_dump(mode="json") != document:
        report.problems.append("spec: not in the canonical form dprelease writes (edited after publication?)")
    located = json.loads(json.dumps(document))
    domain_files = manifest.get("domain_files")
    for column, relative in (domain_files.items() if isinstance(domain_files, dict) else []):
        if column in located.get("columns", {}) and _safe_relative(relative):
            located["columns"][column]["domain_file"] = relative
    try:
        return build_plan(parse_spec(located), root), original
    except DPReleaseError as error:
        report.problems.append(f"spec: cannot be re-planned over the release's domain files: {error}")
        return None


def _check_budget(plan: Plan, report: VerifyReport) -> None:
    budget = plan.spec.budget
    totals = plan.totals
    if budget.definition == "pure" and totals.pure_epsilon > Fraction(budget.epsilon):
        report.problems.append(f"totals: epsilon {totals.pure_epsilon} exceeds the declared {budget.epsilon}")
    if budget.definition == "zcdp" and totals.rho > Fraction(budget.rho):
        report.problems.append(f"totals: rho {totals.rho} exceeds the declared {budget.rho}")
    if budget.definition == "approx" and totals.epsilon_at_delta > float(Fraction(budget.epsilon)):
        report.problems.append(f"totals: epsilon {totals.epsilon_at_delta} at delta exceeds the declared {budget.epsilon}")


def _fraction(block: dict, name: str, problems: list[str]) -> Fraction | None:
    """A non-negative exact fraction in canonical text form (as the ledger writes it)."""
    text = block.get(name)
    try:
        value = Fraction(text) if isinstance(text, str) else None
    except (ValueError, ZeroDivisionError):
        value = None
    if value is None or value < 0 or str(value) != text:
        problems.append(f"ledger.{name}: {brief(text, 200)} is not a non-negative exact fraction in canonical form")
        return None
    return value


def _check_ledger(plan: Plan, manifest: dict, report: VerifyReport) -> None:
    """The ledger block's internal arithmetic against the plan's spend (the ledger itself is private)."""
    block = manifest.get("ledger")
    if block is None:
        return
    problems = report.problems
    if not isinstance(block, dict):
        problems.append("ledger: must be an object or null")
        return
    unit, spend = plan.ledger_spend()
    _compare("ledger.unit", unit, block.get("unit"), problems)
    _compare("ledger.dataset_id", plan.spec.dataset_id, block.get("dataset_id"), problems)
    _compare("ledger.period", plan.spec.period, block.get("period"), problems)
    rerun = block.get("rerun_of_committed_release")
    if not isinstance(rerun, bool):
        problems.append("ledger.rerun_of_committed_release: must be true or false")
        return
    values = {name: _fraction(block, name, problems)
              for name in ("lifetime_budget", "spent_before", "spent_after", "charged")}
    if None in values.values():
        return
    expected_charge = Fraction(0) if rerun else spend
    if values["charged"] != expected_charge:
        problems.append(f"ledger.charged: {values['charged']}, but this release "
                        f"{'is a free re-run (0)' if rerun else f'spends {spend} {unit}'}")
    _check_running_total("", values, values["charged"], "lifetime_budget", problems)
    period_fields = ("period_budget", "period_spent_before", "period_spent_after")
    if block.get("period_budget") is None:
        for name in period_fields[1:]:
            if block.get(name) is not None:
                problems.append(f"ledger.{name}: must be null when there is no period budget")
        return
    period = {name: _fraction(block, name, problems) for name in period_fields}
    if None in period.values():
        return
    _check_running_total("period_", period, values["charged"], "period_budget", problems)
    if period["period_budget"] > values["lifetime_budget"]:
        problems.append("ledger.period_budget: exceeds the lifetime budget")


def _check_running_total(prefix: str, values: dict, charged: Fraction, budget: str, problems: list[str]) -> None:
    """<prefix>spent_after = <prefix>spent_before + charged, and within `budget`."""
    before, after = values[f"{prefix}spent_before"], values[f"{prefix}spent_after"]
    if after != before + charged:
        problems.append(f"ledger.{prefix}spent_after: {after} != {prefix}spent_before {before} + charged {charged}")
    if after > values[budget]:
        problems.append(f"ledger.{prefix}spent_after: {after} exceeds the {budget.replace('_', ' ')} {values[budget]}")


def _check_measurements(root: Path, plan: Plan, report: VerifyReport) -> None:
    """Every table file is readable Parquet with a row per public cell (and q) and its value column's type;
    with `report.estimate` (version 2), every count table's `gls_variance` column equal to it."""
    per_cell = report.estimate.per_cell if report.estimate is not None else {}
    for table in plan.tables:
        for folder, column in ((MEASUREMENTS_DIR, f"noisy_{table.value_name}"), (TABLES_DIR, table.value_name)):
            data = _check_table_file(root, folder, table.name, table.n_outputs, column, pa.types.is_integer, report)
            if folder == TABLES_DIR and table.name in per_cell and data is not None:
                _check_estimate_column(table.name, data, per_cell[table.name], report)
    for mean in plan.means:
        _check_table_file(root, TABLES_DIR, mean.name, plan.table(mean.sum_table).n_cells, "mean",
                          pa.types.is_floating, report)


def _check_estimate_column(name: str, data: pa.Table, expected: np.ndarray, report: VerifyReport) -> None:
    """A count table's `gls_variance` column equals the variance recomputed from the plan."""
    if GLS_VARIANCE not in data.column_names:
        report.problems.append(f"{TABLES_DIR}/{name}: no readable {GLS_VARIANCE!r} column")
        return
    column = data.column(GLS_VARIANCE)
    if not pa.types.is_floating(column.type) or column.null_count or len(column) != expected.size:
        report.problems.append(f"{TABLES_DIR}/{name}: {GLS_VARIANCE!r} must hold a number per cell")
        return
    if not np.allclose(column.to_numpy(), expected, rtol=1e-6, atol=1e-9):
        report.problems.append(f"{TABLES_DIR}/{name}: {GLS_VARIANCE!r} differs from the variance recomputed "
                               f"from the plan")


def _check_table_file(root: Path, folder: str, name: str, rows: int, column: str, kind,
                      report: VerifyReport) -> pa.Table | None:
    """Check one table file's rows and value column; the file's data when it could be read."""
    path = root / folder / f"{name}.parquet"
    if not path.is_file():
        return None
    try:
        data = pq.read_table(path)
    except (pa.ArrowException, OSError) as error:
        report.problems.append(f"{folder}/{name}.parquet: cannot be read as Parquet ({type(error).__name__})")
        return None
    if data.num_rows != rows:
        report.problems.append(f"{folder}/{name}: {data.num_rows} rows, the public domain has {rows}")
    if column not in data.column_names or not kind(data.schema.field(column).type):
        report.problems.append(f"{folder}/{name}: column {column!r} must hold "
                               f"{'integers' if kind is pa.types.is_integer else 'numbers'}")
    return data


def _check_signature(root: Path, manifest: dict, manifest_bytes: bytes, public_key_path: Path | None,
                     report: VerifyReport) -> None:
    """A manifest that says it is signed must have its signature file (always checked); with
    --public-key the manifest must name that key and the Ed25519 signature must be valid."""
    declared = manifest.get("signature")
    signature_path = root / SIGNATURE_FILE
    if declared is not None:
        if not isinstance(declared, dict) or declared.get("file") != SIGNATURE_FILE \
                or declared.get("algorithm") != "Ed25519" or not HEX64.match(str(declared.get("public_key_sha256"))):
            report.problems.append(f"signature: the block must name algorithm Ed25519, file {SIGNATURE_FILE} and a "
                                   "SHA-256 key fingerprint")
        if signature_path.is_symlink() or not signature_path.is_file() \
                or not well_formed(signature_path.read_bytes()):
            report.problems.append(f"signature: the manifest says it is signed, but {SIGNATURE_FILE} is missing or "
                                   "not a base64 Ed25519 signature")
    if public_key_path is None:
        report.signature = "signed (not checked: pass --public-key)" if declared else "not signed"
        return
    public_key = load_public_key(public_key_path)
    if not declared:
        report.problems.append("signature: the release is not signed, but --public-key was given")
        return
    if not isinstance(declared, dict) or declared.get("public_key_sha256") != fingerprint(public_key):
        report.problems.append("signature: the manifest names a different signing key")
    if not signature_path.is_file() or not check(public_key, manifest_bytes, signature_path.read_bytes()):
        report.problems.append(f"signature: {SIGNATURE_FILE} is missing or does not match manifest.json")
    else:
        report.signature = f"valid Ed25519 signature by key {fingerprint(public_key)[:16]}"


def _check_derived(root: Path, manifest: dict, plan: Plan, embedded_spec, report: VerifyReport) -> None:
    """Every derived field, the file set of the plan, the budget, the tables' shape and the ledger."""
    version = manifest.get("manifest_version")
    version = version if version in SUPPORTED_VERSIONS else MANIFEST_VERSION
    report.estimate = estimate_variances(plan) if version >= 2 else None
    expected = derived_section(plan, version, report.estimate)
    expected.update(spec=embedded_spec.model_dump(mode="json"), spec_sha256=embedded_spec.spec_hash())
    for key, value in expected.items():
        _compare(key, value, manifest.get(key), report.problems)
    if manifest.get("input_validation") is not None:
        _compare("input_validation", manifest_record(plan), manifest["input_validation"], report.problems)
    listed = {e.get("path") for e in manifest.get("files", []) if isinstance(e, dict)} \
        if isinstance(manifest.get("files"), list) else set()
    expected_paths = expected_files(plan)
    for missing in sorted(expected_paths - listed):
        report.problems.append(f"files: {missing} is part of this release but not listed")
    for extra in sorted(p for p in listed - expected_paths if isinstance(p, str)):
        report.problems.append(f"files: {extra} is listed but not part of a release of this spec")
    if not HEX16.match(str(manifest.get("key_id"))):
        report.problems.append(f"key_id: {brief(manifest.get('key_id'), 200)} is not a 16-digit lowercase hex key id")
    software = manifest.get("software")
    if not isinstance(software, dict) or software.get("name") != "dprelease":
        report.problems.append("software.name: must be 'dprelease'")
    _check_budget(plan, report)
    _check_ledger(plan, manifest, report)
    _check_measurements(root, plan, report)


def verify_release(release_dir: Path, public_key: Path | None = None) -> VerifyReport:
    root = Path(release_dir)
    report = VerifyReport(root)
    try:
        manifest_bytes = (root / MANIFEST).read_bytes()
        manifest = json.loads(manifest_bytes.decode("utf-8"), parse_constant=_refuse_constant)
    except (OSError, ValueError) as error:
        report.problems.append(f"manifest.json: cannot be read as strict JSON ({type(error).__name__}: {error})")
        return report
    if not isinstance(manifest, dict):
        report.problems.append(f"manifest.json: must be a JSON object, found {type(manifest).__name__}")
        return report
    report.manifest = manifest
    try:
        Manifest.model_validate(manifest)
    except ValidationError as error:
        for item in error.errors()[:20]:
            report.problems.append(f"manifest schema: {'.'.join(map(str, item['loc']))}: {item['msg']}")
    _check_signature(root, manifest, manifest_bytes, public_key, report)
    _check_files(root, manifest, report)
    planned = _replan(root, manifest, report)
    if planned is None:
        return report
    plan, embedded_spec = planned
    try:
        check_cell_limit(plan)
    except DPReleaseError as error:
        report.problems.append(f"spec: {error}")
        return report
    report.plan = plan
    try:
        _check_derived(root, manifest, plan, embedded_spec, report)
    except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError) as error:
        report.problems.append(f"manifest: malformed ({type(error).__name__}); see the schema problems above")
    return report


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def published_manifest_sha256(row) -> str | None:
    """For `ledger reconcile`: the SHA-256 of the manifest published at a ledger row's release directory
    when it is that row's release (same dataset, release, key and spec), else None."""
    path = Path(row.release_dir) / MANIFEST
    try:
        data = path.read_bytes()
        manifest = json.loads(data)
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict):
        return None
    same = (manifest.get("dataset_id"), manifest.get("release_id"), manifest.get("key_id"),
            manifest.get("spec_sha256")) == (row.dataset_id, row.release_id, row.key_id, row.spec_sha256)
    if not same:
        return None
    return hashlib.sha256(data).hexdigest()


__all__ = ["verify_release", "published_manifest_sha256", "DESCRIPTIVE_FIELDS", "VerifyReport"]
