"""`dprelease verify DIR`: recompute everything a manifest claims and report every mismatch.

Checks: the manifest parses; every listed file exists with its SHA-256 and size, and no
unlisted file is present; the embedded spec hashes to `spec_sha256` and is valid; the
accounting (tables, cells, sensitivities, allocations, mechanisms, losses, expected errors,
totals, implied losses) equals a fresh plan of that spec over the release's own domain
files; the composed loss is within the declared budget; every measurement is an integer
count with one row per public cell.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pydantic import ValidationError

from dprelease.accounting.errors import DPReleaseError
from dprelease.accounting.manifest_model import Manifest
from dprelease.accounting.signing import SIGNATURE_FILE, check, fingerprint, load_public_key

from .manifest import accounting_section, sha256_file
from .validation import manifest_record
from .plan import Plan, build_plan
from .spec import parse_spec


@dataclass
class VerifyReport:
    release_dir: Path
    problems: list[str] = field(default_factory=list)
    checked_files: int = 0
    manifest: dict | None = None
    plan: Plan | None = None
    signature: str = "not checked"

    @property
    def ok(self) -> bool:
        return not self.problems


def _check_files(root: Path, manifest: dict, report: VerifyReport) -> None:
    listed = set()
    for entry in manifest.get("files", []):
        path = root / entry["path"]
        listed.add(entry["path"])
        if not path.is_file():
            report.problems.append(f"file {entry['path']}: missing")
            continue
        if path.stat().st_size != entry.get("bytes"):
            report.problems.append(f"file {entry['path']}: size {path.stat().st_size} != manifest {entry.get('bytes')}")
        if sha256_file(path) != entry.get("sha256"):
            report.problems.append(f"file {entry['path']}: SHA-256 differs from the manifest")
        report.checked_files += 1
    present = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()} - {"manifest.json"}
    if manifest.get("signature"):
        present.discard(SIGNATURE_FILE)
    for extra in sorted(present - listed):
        report.problems.append(f"file {extra}: present but not listed in the manifest")


def _compare(path: str, expected, actual, problems: list[str]) -> None:
    """Deep comparison; floats within 1e-9 relative (they are re-derived by the same formulas)."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        for key in sorted(set(expected) | set(actual)):
            if key not in actual:
                problems.append(f"{path}.{key}: missing from the manifest")
            elif key not in expected:
                problems.append(f"{path}.{key}: not expected (value {actual[key]!r})")
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
    elif expected != actual:
        problems.append(f"{path}: manifest says {actual!r}, recomputed {expected!r}")


def _replan(root: Path, manifest: dict, report: VerifyReport) -> Plan | None:
    document = json.loads(json.dumps(manifest["spec"]))
    for column, relative in manifest.get("domain_files", {}).items():
        document["columns"][column]["domain_file"] = relative
    try:
        spec = parse_spec(document)
        plan = build_plan(spec, root)
    except DPReleaseError as error:
        report.problems.append(f"spec: cannot be re-planned: {error}")
        return None
    original = parse_spec(manifest["spec"])
    if original.spec_hash() != manifest.get("spec_sha256"):
        report.problems.append("spec_sha256: does not match the embedded spec")
    return plan


def _check_budget(plan: Plan, report: VerifyReport) -> None:
    budget = plan.spec.budget
    totals = plan.totals
    if budget.definition == "pure" and totals.pure_epsilon > Fraction(budget.epsilon):
        report.problems.append(f"totals: epsilon {totals.pure_epsilon} exceeds the declared {budget.epsilon}")
    if budget.definition == "zcdp" and totals.rho > Fraction(budget.rho):
        report.problems.append(f"totals: rho {totals.rho} exceeds the declared {budget.rho}")
    if budget.definition == "approx" and totals.epsilon_at_delta > float(Fraction(budget.epsilon)):
        report.problems.append(f"totals: epsilon {totals.epsilon_at_delta} at delta exceeds the declared {budget.epsilon}")


def _check_measurements(root: Path, plan: Plan, report: VerifyReport) -> None:
    for table in plan.tables:
        for folder, column in (("measurements", "noisy_count"), ("tables", "count")):
            path = root / folder / f"{table.name}.parquet"
            if not path.is_file():
                continue
            data = pq.read_table(path)
            if data.num_rows != table.n_cells:
                report.problems.append(f"{folder}/{table.name}: {data.num_rows} rows, the public domain has {table.n_cells}")
            if column not in data.column_names or not pa.types.is_integer(data.schema.field(column).type):
                report.problems.append(f"{folder}/{table.name}: column {column!r} must hold integers")


def _check_signature(root: Path, manifest: dict, manifest_bytes: bytes, public_key_path: Path | None,
                     report: VerifyReport) -> None:
    """With --public-key: the manifest must name that key and carry a valid Ed25519 signature."""
    declared = manifest.get("signature")
    if public_key_path is None:
        report.signature = "signed (not checked: pass --public-key)" if declared else "not signed"
        return
    public_key = load_public_key(public_key_path)
    if not declared:
        report.problems.append("signature: the release is not signed, but --public-key was given")
        return
    if declared.get("public_key_sha256") != fingerprint(public_key):
        report.problems.append("signature: the manifest names a different signing key")
    signature_path = root / SIGNATURE_FILE
    if not signature_path.is_file() or not check(public_key, manifest_bytes, signature_path.read_bytes()):
        report.problems.append(f"signature: {SIGNATURE_FILE} is missing or does not match manifest.json")
    else:
        report.signature = f"valid Ed25519 signature by key {fingerprint(public_key)[:16]}"


def verify_release(release_dir: Path, public_key: Path | None = None) -> VerifyReport:
    root = Path(release_dir)
    report = VerifyReport(root)
    manifest_path = root / "manifest.json"
    try:
        manifest_bytes = manifest_path.read_bytes()
        manifest = json.loads(manifest_bytes.decode("utf-8"))
    except (OSError, ValueError) as error:
        report.problems.append(f"manifest.json: cannot be read as JSON ({error})")
        return report
    report.manifest = manifest
    try:
        Manifest.model_validate(manifest)
    except ValidationError as error:
        for item in error.errors()[:20]:
            report.problems.append(f"manifest schema: {'.'.join(map(str, item['loc']))}: {item['msg']}")
    _check_signature(root, manifest, manifest_bytes, public_key, report)
    _check_files(root, manifest, report)
    plan = _replan(root, manifest, report)
    if plan is None:
        return report
    report.plan = plan
    expected = accounting_section(plan)
    for key, value in expected.items():
        _compare(key, value, manifest.get(key), report.problems)
    if manifest.get("input_validation") is not None:
        _compare("input_validation", manifest_record(plan), manifest["input_validation"], report.problems)
    _check_budget(plan, report)
    _check_measurements(root, plan, report)
    return report
