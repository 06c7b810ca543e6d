"""`dprelease verify DIR`: recompute everything a manifest claims and report every mismatch.

Every field of a manifest is one of three kinds, and verify checks each:
- derived: recomputed from the embedded spec and a fresh plan of it over the release's own domain
  files, and compared (ids, spec and its hash, privacy block, tables, sensitivities, allocations,
  mechanisms, expected errors, totals, implied losses, invariants, post-processing, domain files,
  the input-validation record, the set of files a release of this plan holds);
- checked: internally consistent and well formed (ledger arithmetic: spent_after = spent_before + what
  the run charged, the release's cost = the plan's spend, within the budgets and over the budget periods
  the spec's period overlaps; key_id and file hashes well formed; every listed file present with its
  size and SHA-256, nothing else in the tree; a signature block has its signature file) and every
  structural property the tables claim (`verify_tables`: exact columns, labels, CSV = Parquet, values,
  tables that add up as the post-processing steps state);
- descriptive (`DESCRIPTIVE_FIELDS`: software version, engine, provenance): recorded, not verified.
With `ledger`, the manifest is checked against the ledger's rows (a committed release, its cost, and
this very manifest among those recorded at publication); with `recompute`, the published tables are
recomputed from measurements/.

A release directory is untrusted: only regular files inside it are read (`pipelines.storage`), sizes, digits
and nesting are bounded before anything is parsed or built, and a malformed manifest gives a list of
problems, never a traceback, a hang or a read outside the release.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path, PurePosixPath

from pydantic import ValidationError

from dprelease.accounting.errors import DPReleaseError
from dprelease.accounting.manifest_model import Manifest
from dprelease.accounting.periods import budget_periods, parse_period
from dprelease.accounting.signing import (MAX_KEY_BYTES, SIGNATURE_FILE, check, fingerprint, load_public_key,
                                          well_formed)

from .limits import check_cell_limit
from .manifest import (AIM_ANNEALING_VERSION, AIM_CONVERGED_FIT_VERSION, AIM_CYCLES_VERSION, AIM_VERSION,
                       DESCRIPTIVE_FIELDS, MANIFEST_VERSION, OPTIMAL_MARGINALS_VERSION, WORKLOAD_VERSION,
                       derived_section, domain_file_name, domain_file_names)
from .plan import MAX_DOMAIN_FILE_BYTES, Plan, SelectionError, build_plan
from .postprocessing import EstimateVariances, estimate_variances, unit_tree
from .layout import Layout, layout_of, release_files
from .storage import (UnsafeFile, open_file, read_inside, read_named, read_regular, regular_directory,
                      safe_relative, tree_entries)
from .storage.objects import MAX_MANIFEST_BYTES
from .spec import MAX_NESTING, brief, parse_spec
from .validation import manifest_record
from .verify_tables import check_consistency, check_recomputed, check_table_files

MANIFEST = "manifest.json"
SUPPORTED_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10)
HEX16 = re.compile(r"^[0-9a-f]{16}$")
HEX64 = re.compile(r"^[0-9a-f]{64}$")
MAX_PROBLEMS = 1000
"""Problems kept per report (a hostile manifest can make millions); the rest are counted."""

MAX_SPEC_JSON_BYTES = 4 << 20
MAX_JSON_DIGITS = 100
MAX_SIGNATURE_BYTES = 4096


class Problems(list):
    """A list of problems that keeps the first MAX_PROBLEMS and counts the rest (bounded memory)."""

    def __init__(self):
        super().__init__()
        self.dropped = 0

    def append(self, problem: str) -> None:
        if len(self) < MAX_PROBLEMS:
            super().append(problem)
        else:
            self.dropped += 1
            if self.dropped == 1:
                super().append("... further problems not listed")


@dataclass
class VerifyReport:
    release_dir: Path
    problems: list[str] = field(default_factory=Problems)
    checked_files: int = 0
    manifest: dict | None = None
    plan: Plan | None = None
    estimate: EstimateVariances | None = None
    signature: str = "not checked"
    ledger: str = "not checked (pass --ledger)"
    recomputed: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems


def expected_files(plan: Plan, layout: Layout) -> set[str]:
    """The files a release of this plan holds (besides the manifest and its signature)."""
    return release_files(plan, layout) | set(domain_file_names(plan).values())


# ---- reading the manifest, bounded -----------------------------------------------------------------------------

def parse_json_bounded(data: bytes) -> object:
    """Strict JSON with integers of at most MAX_JSON_DIGITS digits and nesting of at most MAX_NESTING levels
    (ValueError otherwise): nothing a hostile file holds can build a huge number or exhaust the stack."""
    try:
        value = json.loads(data.decode("utf-8"), parse_constant=_refuse_constant, parse_int=_bounded_int)
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_NESTING} levels") from None
    if _depth(value) > MAX_NESTING:
        raise ValueError(f"nested deeper than {MAX_NESTING} levels")
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_JSON_DIGITS:
        raise ValueError(f"an integer of more than {MAX_JSON_DIGITS} digits")
    return int(text)


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _depth(value: object) -> int:
    """Nesting depth of a parsed JSON value, without recursion."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        deepest = max(deepest, depth)
        if deepest > MAX_NESTING:
            return deepest
        if isinstance(item, dict):
            pending.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            pending.extend((v, depth + 1) for v in item)
    return deepest


def _check_schema(manifest: dict, report: VerifyReport) -> None:
    """The manifest against the published schema; the `files` list is checked entry by entry elsewhere
    (only its first entries go through the schema model, so a list of millions costs no more)."""
    shallow = dict(manifest)
    if isinstance(shallow.get("files"), list):
        shallow["files"] = shallow["files"][:100]
    try:
        Manifest.model_validate(shallow)
    except ValidationError as error:
        for item in error.errors()[:20]:
            report.problems.append(f"manifest schema: {'.'.join(map(str, item['loc']))[:200]}: {item['msg']}")


def _read_manifest(root: Path, report: VerifyReport) -> tuple[dict, bytes] | None:
    if not regular_directory(root):
        report.problems.append(f"{root}: not a directory (or a symbolic link)")
        return None
    try:
        manifest_bytes = read_inside(root, MANIFEST, MAX_MANIFEST_BYTES)
        manifest = parse_json_bounded(manifest_bytes)
    except UnsafeFile as error:
        report.problems.append(f"manifest.json: {error}")
        return None
    except (ValueError, UnicodeDecodeError) as error:
        report.problems.append(f"manifest.json: cannot be read as strict JSON ({type(error).__name__}: "
                               f"{brief(str(error), 200)})")
        return None
    if not isinstance(manifest, dict):
        report.problems.append(f"manifest.json: must be a JSON object, found {type(manifest).__name__}")
        return None
    return manifest, manifest_bytes


# ---- files ---------------------------------------------------------------------------------------------------------

def _check_files(root: Path, manifest: dict, report: VerifyReport, bounds: dict[str, int] | None = None) -> None:
    """Every listed file is a safe relative path, present as a regular file, with its size and SHA-256;
    nothing else (no unlisted file, directory, link or special file) is in the release tree. A file is
    hashed only when its size is the listed one and within its bound (`bounds`: the largest size a file of
    this release's plan can have; files not in it are not hashed)."""
    entries = manifest.get("files")
    if not isinstance(entries, list):
        report.problems.append("files: must be a list of {path, sha256, bytes}")
        entries = []
    listed: set[str] = set()
    for i, entry in enumerate(entries):
        path = safe_relative(entry.get("path") if isinstance(entry, dict) else None)
        if path is None:
            shown = entry.get("path") if isinstance(entry, dict) else entry
            report.problems.append(f"files[{i}]: path {brief(shown, 120)} is not a plain relative path inside the "
                                   "release")
            continue
        if path in listed or path in (MANIFEST, SIGNATURE_FILE):
            report.problems.append(f"files[{i}]: {path} listed twice or names the manifest/signature")
            continue
        listed.add(path)
        bound = (bounds or {}).get(path)
        try:
            digest = _hash_inside(root, path, entry.get("bytes"), bound)
        except UnsafeFile as error:
            report.problems.append(f"file {path}: missing (or not a regular file)" if "open" in str(error)
                                   else f"file {path}: {error}")
            continue
        if digest is None:
            continue
        if not HEX64.fullmatch(str(entry.get("sha256"))) or digest != entry.get("sha256"):
            report.problems.append(f"file {path}: SHA-256 differs from the manifest")
        report.checked_files += 1
    allowed_dirs = {parent.as_posix() for p in listed for parent in PurePosixPath(p).parents} - {"."}
    allowed_files = listed | {MANIFEST} | ({SIGNATURE_FILE} if manifest.get("signature") else set())
    for relative, kind in tree_entries(root):
        if kind == "link":
            report.problems.append(f"{relative}: a symbolic link inside the release")
        elif kind == "dir":
            if relative not in allowed_dirs:
                report.problems.append(f"directory {relative}: present but holds no listed file")
        elif kind != "file":
            report.problems.append(f"{relative}: not a regular file")
        elif relative not in allowed_files:
            report.problems.append(f"file {relative}: present but not listed in the manifest")


def _hash_inside(root: Path, relative: str, listed, bound: int | None) -> str | None:
    """The SHA-256 of a regular file inside the release, read only when its size equals the listed size
    and is within `bound` (None: not a file of this plan, not read)."""
    with open_file(root, relative) as handle:
        size = os.fstat(handle.fileno()).st_size
        if size != listed:
            raise UnsafeFile(f"size {size} != manifest {brief(listed, 40)}")
        if bound is None:
            return None  # not a file of this release's plan (reported as such), or no plan: never read
        if size > bound:
            raise UnsafeFile(f"size {size} is more than a file of this release can hold")
        digest = hashlib.sha256()
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def size_bounds(plan: Plan, layout: Layout) -> dict[str, int]:
    """The largest size each file of a release of this plan can have."""
    from .layout import release_parts
    from .verify_tables import MAX_ROW_BYTES

    bounds = {path: MAX_DOMAIN_FILE_BYTES for path in domain_file_names(plan).values()}
    for part in release_parts(plan, layout):
        for ext in ("parquet", "csv"):
            bounds[f"{part.stem}.{ext}"] = (part.stop - part.start) * MAX_ROW_BYTES + (1 << 20)
    return bounds


# ---- derived fields --------------------------------------------------------------------------------------------------

def _compare(path: str, expected, actual, problems: list[str]) -> None:
    """Deep comparison; floats within 1e-9 relative (they are re-derived by the same formulas)."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        for key in sorted(set(expected) | set(actual), key=str):
            if key not in actual:
                problems.append(f"{path}.{key}: missing from the manifest")
            elif key not in expected:
                problems.append(f"{path}.{brief(key, 60)}: not expected (value {brief(actual[key], 200)})")
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


def _release_reader(root: Path):
    """Domain files come from the release's own domains/ folder, never from a path the manifest names."""
    def read(column: str, domain_file: str) -> str:
        relative = domain_file_name(column)
        try:
            return read_inside(root, relative, MAX_DOMAIN_FILE_BYTES).decode("utf-8")
        except UnsafeFile as error:
            raise DPReleaseError(f"{relative}: {error}") from None
        except UnicodeDecodeError:
            raise DPReleaseError(f"{relative}: not UTF-8 text") from None
    return read


def _replan(root: Path, manifest: dict, report: VerifyReport):
    """(plan, embedded spec), the plan made over the release's own domain files; None when the embedded
    spec is missing, invalid or cannot be planned. The spec must be in the canonical form dprelease writes."""
    document = manifest.get("spec")
    if not isinstance(document, dict):
        report.problems.append("spec: missing or not a mapping")
        return None
    if len(json.dumps(document)) > MAX_SPEC_JSON_BYTES:
        report.problems.append(f"spec: larger than {MAX_SPEC_JSON_BYTES:,} bytes of JSON; no spec is")
        return None
    try:
        original = parse_spec(document)
    except DPReleaseError as error:
        report.problems.append(f"spec: invalid: {brief(str(error), 2000)}")
        return None
    if original.model_dump(mode="json") != document:
        report.problems.append("spec: not in the canonical form dprelease writes (edited after publication?)")
    recorded = _recorded_selections(manifest, original, report)
    if recorded is None:
        return None
    chosen, units = recorded
    try:
        version = manifest.get("manifest_version")
        optimal = not (type(version) is int and version < OPTIMAL_MARGINALS_VERSION)  # noqa: E721
        cycles = not (type(version) is int and version < AIM_CYCLES_VERSION)  # noqa: E721
        annealing = not (type(version) is int and version < AIM_ANNEALING_VERSION)  # noqa: E721
        converged = not (type(version) is int and version < AIM_CONVERGED_FIT_VERSION)  # noqa: E721
        return build_plan(original, root, _release_reader(root), chosen, optimal, cycles, units, annealing,
                          converged), original
    except SelectionError as error:
        report.problems.append(f"selections: {brief(str(error), 2000)}")
        return None
    except DPReleaseError as error:
        report.problems.append(f"spec: cannot be re-planned over the release's domain files: {brief(str(error), 2000)}")
        return None


def _recorded_selections(manifest: dict, spec, report: VerifyReport) -> tuple[dict, dict] | None:
    """The tables each `select: mst` or `aim` query of the spec chose, as the manifest records them (checked by
    the plan to be a spanning tree of the query's attributes, a junction tree grown one attribute a round, or
    tables a capped model's rounds could choose), and each annealed selection's rounds' budget units (checked
    by the plan to be units its rounds could spend, within its budget); None, with the problem, when they are
    missing or malformed."""
    wanted = [q.name for q in spec.queries if getattr(q, "selects", False)]
    methods = {q.name: q.select for q in spec.queries if getattr(q, "selects", False)}
    records = manifest.get("selections", [])
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        report.problems.append("selections: not a list of mappings")
        return None
    chosen, units = {}, {}
    for record in records:
        query, pairs = record.get("query"), record.get("chosen")
        if query not in wanted or query in chosen:
            report.problems.append(f"selections: {brief(query, 100)} is not a `select: mst` or `select: aim` query "
                                   "of the spec (or is listed twice)")
            return None
        sizes = (2,) if methods[query] == "mst" else (2, 3)
        if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) in sizes and
                                                  all(isinstance(a, str) for a in p) for p in pairs):
            report.problems.append(f"selections: {query}: `chosen` is not a list of attribute "
                                   f"{'pairs' if methods[query] == 'mst' else 'tables'}")
            return None
        chosen[query] = tuple(tuple(p) for p in pairs)
        if record.get("units") is not None:  # the plan refuses units where its rounds are not annealed
            units[query] = record["units"]
    missing = [q for q in wanted if q not in chosen]
    if missing:
        report.problems.append(f"selections: the tables chosen by {missing} are missing")
        return None
    return chosen, units


def _check_budget(plan: Plan, report: VerifyReport) -> None:
    budget = plan.spec.budget
    totals = plan.totals
    if budget.definition == "pure" and totals.pure_epsilon > Fraction(budget.epsilon):
        report.problems.append(f"totals: epsilon {totals.pure_epsilon} exceeds the declared {budget.epsilon}")
    if budget.definition == "zcdp" and totals.rho > Fraction(budget.rho):
        report.problems.append(f"totals: rho {totals.rho} exceeds the declared {budget.rho}")
    if budget.definition == "approx" and totals.epsilon_at_delta > float(Fraction(budget.epsilon)):
        report.problems.append(f"totals: epsilon {totals.epsilon_at_delta} at delta exceeds the declared {budget.epsilon}")


# ---- the ledger block -----------------------------------------------------------------------------------------------

def _fraction(block: dict, name: str, problems: list[str], where: str = "ledger") -> Fraction | None:
    """A non-negative exact fraction in canonical text form (as the ledger writes it)."""
    text = block.get(name)
    try:
        value = Fraction(text) if isinstance(text, str) and len(text) <= 200 else None
    except (ValueError, ZeroDivisionError):
        value = None
    if value is None or value < 0 or str(value) != text:
        problems.append(f"{where}.{name}: {brief(text, 200)} is not a non-negative exact fraction in canonical form")
        return None
    return value


def _check_ledger(plan: Plan, manifest: dict, version: int, report: VerifyReport) -> None:
    """The ledger block's internal arithmetic against the plan's spend and the spec's period."""
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
    if version < 3:
        _check_legacy_ledger(block, spend, unit, rerun, problems)
        return
    if "period_spent_before" in block or "charged_by_this_run" not in block:
        problems.append(f"ledger: the block of a version-{version} manifest has the fields of another version")
        return
    names = ("lifetime_budget", "spent_before", "spent_after", "charged", "charged_by_this_run")
    values = {name: _fraction(block, name, problems) for name in names}
    if None in values.values():
        return
    if values["charged"] != spend:
        problems.append(f"ledger.charged: {values['charged']}, but this release spends {spend} {unit}")
    added = Fraction(0) if rerun else values["charged"]
    if values["charged_by_this_run"] != added:
        problems.append(f"ledger.charged_by_this_run: {values['charged_by_this_run']}, but "
                        f"{'a free re-run adds 0' if rerun else f'a first run adds the charge {added}'}")
    _check_running_total("ledger", values["spent_before"], values["spent_after"], added, values["lifetime_budget"],
                         problems)
    if rerun and values["spent_before"] < values["charged"]:
        problems.append("ledger.spent_before: below the release's own charge, which a re-run's total includes")
    _check_period_budget(plan, block.get("period_budget"), added, values, rerun, problems)


def _check_period_budget(plan: Plan, budget, added: Fraction, values: dict, rerun: bool, problems: list[str]) -> None:
    if budget is None:
        return
    if not isinstance(budget, dict) or not isinstance(budget.get("periods"), list):
        problems.append("ledger.period_budget: must be null or {per, budget, periods}")
        return
    if plan.spec.period is None:
        problems.append("ledger.period_budget: present, but the spec names no period")
        return
    amount = _fraction(budget, "budget", problems, "ledger.period_budget")
    try:
        names = budget_periods(parse_period(plan.spec.period), budget.get("per"))
    except (ValueError, TypeError):
        problems.append(f"ledger.period_budget.per: {brief(budget.get('per'), 40)} is not a period unit")
        return
    charged = [entry.get("period") if isinstance(entry, dict) else None for entry in budget["periods"]]
    if charged != names:
        problems.append(f"ledger.period_budget.periods: {brief(charged, 200)}, but period {plan.spec.period} is "
                        f"charged to {names}")
        return
    if amount is None:
        return
    if amount > values["lifetime_budget"]:
        problems.append("ledger.period_budget.budget: exceeds the lifetime budget")
    for i, entry in enumerate(budget["periods"]):
        where = f"ledger.period_budget.periods[{i}]"
        before, after = _fraction(entry, "spent_before", problems, where), _fraction(entry, "spent_after", problems, where)
        if before is not None and after is not None:
            _check_running_total(where, before, after, added, amount, problems)
            if rerun and before < values["charged"]:
                problems.append(f"{where}.spent_before: below the release's own charge")


def _check_running_total(where: str, before: Fraction, after: Fraction, added: Fraction, budget: Fraction,
                         problems: list[str]) -> None:
    """spent_after = spent_before + what this run added, and within `budget`."""
    if after != before + added:
        problems.append(f"{where}.spent_after: {after} != spent_before {before} + {added}")
    if after > budget:
        problems.append(f"{where}.spent_after: {after} exceeds the budget {budget}")


def _check_legacy_ledger(block: dict, spend: Fraction, unit: str, rerun: bool, problems: list[str]) -> None:
    """The ledger block of version 1 and 2 manifests: `charged` is 0 for a free re-run."""
    values = {name: _fraction(block, name, problems) for name in ("lifetime_budget", "spent_before", "spent_after",
                                                                  "charged")}
    if None in values.values():
        return
    expected_charge = Fraction(0) if rerun else spend
    if values["charged"] != expected_charge:
        problems.append(f"ledger.charged: {values['charged']}, but this release "
                        f"{'is a free re-run (0)' if rerun else f'spends {spend} {unit}'}")
    _check_running_total("ledger", values["spent_before"], values["spent_after"], values["charged"],
                         values["lifetime_budget"], problems)
    if block.get("period_budget") is None:
        for name in ("period_spent_before", "period_spent_after"):
            if block.get(name) is not None:
                problems.append(f"ledger.{name}: must be null when there is no period budget")
        return
    period = {name: _fraction(block, name, problems) for name in ("period_budget", "period_spent_before",
                                                                  "period_spent_after")}
    if None in period.values():
        return
    _check_running_total("ledger.period", period["period_spent_before"], period["period_spent_after"],
                         values["charged"], period["period_budget"], problems)
    if period["period_budget"] > values["lifetime_budget"]:
        problems.append("ledger.period_budget: exceeds the lifetime budget")


def check_against_ledger(manifest: dict, manifest_bytes: bytes, location: str, report: VerifyReport) -> None:
    """The manifest against the ledger's own rows: a release charged in this ledger, at the cost it states,
    published with exactly this manifest."""
    from dprelease.accounting.ledger import (COMMITTED, RESERVED, dataset_row, open_ledger, publications_of,
                                             release_rows)

    problems = report.problems
    book = open_ledger(location, create=False)
    dataset, release = str(manifest.get("dataset_id")), str(manifest.get("release_id"))
    rows = [r for r in release_rows(book, dataset, release) if r.status in (COMMITTED, RESERVED)]
    block = manifest.get("ledger")
    if block is None:
        problems.append(f"ledger: the manifest says the release was not run against a ledger, but this ledger "
                        f"{'holds it' if rows else 'has no record of it either: it is not accounted there'}")
        report.ledger = "mismatch"
        return
    mine = [r for r in rows if r.key_id == manifest.get("key_id") and r.spec_sha256 == manifest.get("spec_sha256")]
    committed = [r for r in mine if r.status == COMMITTED]
    if not committed:
        problems.append(f"ledger: no committed release {release!r} of dataset {dataset!r} with this key and spec "
                        f"({'reserved only' if mine else 'none at all'})")
        report.ledger = "mismatch"
        return
    row = committed[0]
    version = manifest.get("manifest_version")
    if isinstance(block, dict) and str(block.get("charged")) != row.spend and (not isinstance(version, int)
                                                                             or version >= 3):
        problems.append(f"ledger.charged: {brief(block.get('charged'), 40)}, but the ledger charged {row.spend}")
    spec = manifest.get("spec") if isinstance(manifest.get("spec"), dict) else {}
    if (row.period or None) != spec.get("period"):
        problems.append(f"ledger: the ledger recorded period {row.period!r}, the spec names another")
    data_row = dataset_row(book, dataset)
    if data_row is None or (isinstance(block, dict) and block.get("unit") != data_row.unit):
        problems.append("ledger.unit: differs from the dataset's unit in the ledger")
    published = {row.manifest_sha256, *publications_of(book, row.id)}
    if hashlib.sha256(manifest_bytes).hexdigest() not in published:
        problems.append("manifest.json: not a manifest this ledger recorded publishing for the release (edited "
                        "after publication?)")
    report.ledger = "mismatch" if problems else f"committed in the ledger (row {row.id}, charged {row.spend})"


# ---- signature -------------------------------------------------------------------------------------------------------

def _check_signature(root: Path, manifest: dict, manifest_bytes: bytes, public_key_path: Path | None,
                     report: VerifyReport) -> None:
    """A manifest that says it is signed must have its signature file (always checked); with
    --public-key the manifest must name that key and the Ed25519 signature must be valid."""
    declared = manifest.get("signature")
    try:
        signature = read_inside(root, SIGNATURE_FILE, MAX_SIGNATURE_BYTES)
    except UnsafeFile:
        signature = None
    if declared is not None:
        if not isinstance(declared, dict) or declared.get("file") != SIGNATURE_FILE \
                or declared.get("algorithm") != "Ed25519" or not HEX64.fullmatch(str(declared.get("public_key_sha256"))):
            report.problems.append(f"signature: the block must name algorithm Ed25519, file {SIGNATURE_FILE} and a "
                                   "SHA-256 key fingerprint")
        if signature is None or not well_formed(signature):
            report.problems.append(f"signature: the manifest says it is signed, but {SIGNATURE_FILE} is missing or "
                                   "not a base64 Ed25519 signature")
    if public_key_path is None:
        report.signature = "signed (not checked: pass --public-key)" if declared else "not signed"
        return
    public_key = load_public_key(read_named(public_key_path, MAX_KEY_BYTES, "--public-key"), public_key_path)
    if not declared:
        report.problems.append("signature: the release is not signed, but --public-key was given")
        return
    if not isinstance(declared, dict) or declared.get("public_key_sha256") != fingerprint(public_key):
        report.problems.append("signature: the manifest names a different signing key")
    if signature is None or not check(public_key, manifest_bytes, signature):
        report.problems.append(f"signature: {SIGNATURE_FILE} is missing or does not match manifest.json")
    else:
        report.signature = f"valid Ed25519 signature by key {fingerprint(public_key)[:16]}"


# ---- the whole check --------------------------------------------------------------------------------------------------

OPTIONAL_DERIVED = frozenset({"selections", "means", "local_randomization"})
"""Derived sections only some releases have: one the plan does not produce must be absent, not merely ignored."""


def _check_derived(root: Path, manifest: dict, version: int, plan: Plan, embedded_spec,
                   report: VerifyReport, layout: Layout) -> None:
    """Every derived field, the file set of the plan, the budget and the ledger block."""
    report.estimate = estimate_variances(plan) if version >= 2 else None
    expected = derived_section(plan, version, report.estimate, layout)
    expected.update(spec=embedded_spec.model_dump(mode="json"), spec_sha256=embedded_spec.spec_hash())
    for key, value in expected.items():
        _compare(key, value, manifest.get(key), report.problems)
    for key in sorted(OPTIONAL_DERIVED - set(expected)):
        if key in manifest:
            report.problems.append(f"{key}: present, but a release of this spec has none (value "
                                   f"{brief(manifest[key], 200)})")
    if version < AIM_VERSION:
        for selection in plan.selections:
            if selection.method == "aim":
                report.problems.append(f"selections: {selection.query} is a `select: aim` selection, which manifests "
                                       f"state from version {AIM_VERSION} on (this one says {version})")
    if version < WORKLOAD_VERSION:
        for selection in plan.selections:
            if selection.weights is not None:
                report.problems.append(f"selections: {selection.query} has a workload, which manifests state from "
                                       f"version {WORKLOAD_VERSION} on (this one says {version})")
    if manifest.get("input_validation") is not None:
        _compare("input_validation", manifest_record(plan), manifest["input_validation"], report.problems)
    listed = {e.get("path") for e in manifest.get("files", []) if isinstance(e, dict)} \
        if isinstance(manifest.get("files"), list) else set()
    expected_paths = expected_files(plan, layout)
    for missing in sorted(expected_paths - listed):
        report.problems.append(f"files: {missing} is part of this release but not listed")
    for extra in sorted(p for p in listed - expected_paths if isinstance(p, str)):
        report.problems.append(f"files: {brief(extra, 120)} is listed but not part of a release of this spec")
    if not HEX16.fullmatch(str(manifest.get("key_id"))):
        report.problems.append(f"key_id: {brief(manifest.get('key_id'), 200)} is not a 16-digit lowercase hex key id")
    software = manifest.get("software")
    if not isinstance(software, dict) or software.get("name") != "dprelease":
        report.problems.append("software.name: must be 'dprelease'")
    _check_budget(plan, report)
    _check_ledger(plan, manifest, version, report)


def verify_release(release_dir: Path, public_key: Path | None = None, *, ledger: str | None = None,
                   recompute: bool = False) -> VerifyReport:
    """Check a release directory against its manifest (and, when given, against a ledger, and by
    recomputing the post-processing). Problems are collected, never raised."""
    root = Path(release_dir)
    report = VerifyReport(root)
    read = _read_manifest(root, report)
    if read is None:
        return report
    manifest, manifest_bytes = read
    report.manifest = manifest
    _check_schema(manifest, report)
    _check_signature(root, manifest, manifest_bytes, public_key, report)
    if ledger is not None:
        try:
            check_against_ledger(manifest, manifest_bytes, ledger, report)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            report.problems.append(f"ledger: the manifest's fields cannot be compared with the ledger "
                                   f"({type(error).__name__})")
    planned = _replan(root, manifest, report)
    plan = planned[0] if planned else None
    if plan is not None and (recompute or unit_tree(plan) is None):  # else verify streams, a part at a time
        try:
            check_cell_limit(plan)
        except DPReleaseError as error:
            report.problems.append(f"spec: {error}")
            plan = None
    version = manifest.get("manifest_version")
    if type(version) is not int:  # noqa: E721 (5.0 or True would compare equal to a supported version)
        report.problems.append(f"manifest_version: {brief(version, 40)} is not an integer")
    version = version if type(version) is int and version in SUPPORTED_VERSIONS else MANIFEST_VERSION
    layout = layout_of(manifest, version, report.problems)
    _check_files(root, manifest, report, size_bounds(plan, layout) if plan is not None else {})
    if plan is None:
        return report
    embedded_spec = planned[1]
    report.plan = plan
    try:
        _check_derived(root, manifest, version, plan, embedded_spec, report, layout)
    except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError) as error:
        report.problems.append(f"manifest: malformed ({type(error).__name__}); see the schema problems above")
    usable = check_table_files(root, plan, report.estimate, layout, report.problems)
    check_consistency(root, plan, usable, layout, report.problems)
    if recompute:
        check_recomputed(root, plan, usable, layout, report.problems)
        report.recomputed = True
    return report


def published_manifest_sha256(row) -> str | None:
    """For `ledger reconcile`: the SHA-256 of the manifest published at a ledger row's release directory (or
    object-store URI) when it is that row's release (same dataset, release, key and spec), else None. Reads only a regular
    file (never a link, FIFO or device), at most MAX_MANIFEST_BYTES."""
    from .storage import read_manifest_bytes
    from .storage import is_uri

    try:
        data = read_manifest_bytes(row.release_dir) if is_uri(row.release_dir) else \
            read_regular(Path(row.release_dir) / MANIFEST, MAX_MANIFEST_BYTES)
        if data is None:
            return None
        manifest = parse_json_bounded(data)
    except (UnsafeFile, ValueError, UnicodeDecodeError, OSError):
        return None
    if not isinstance(manifest, dict):
        return None
    same = (manifest.get("dataset_id"), manifest.get("release_id"), manifest.get("key_id"),
            manifest.get("spec_sha256")) == (row.dataset_id, row.release_id, row.key_id, row.spec_sha256)
    if not same:
        return None
    return hashlib.sha256(data).hexdigest()


__all__ = ["verify_release", "published_manifest_sha256", "DESCRIPTIVE_FIELDS", "VerifyReport", "parse_json_bounded"]
