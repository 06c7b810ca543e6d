"""`verify` checks everything it prints: every non-descriptive leaf of a real manifest, edited in turn,
is rejected; signatures, extra directories, unsafe paths, corrupt tables and malformed manifests are
mismatches (exit 1), never tracebacks."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from fractions import Fraction

import pytest

from dprelease.accounting.ledger import open_ledger, set_budget
from dprelease.pipelines.manifest import DESCRIPTIVE_FIELDS
from dprelease.pipelines.run import run_release
from dprelease.pipelines.verify import verify_release

from .conftest import GEO_LEAVES, small_spec, write_case


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A release with a ledger block (and period budget), an input-validation record and a table of every
    kind (sum, mean, quantile, unit count beside the count tables): their fields are edit-tested too."""
    directory = tmp_path_factory.mktemp("coverage")
    base = small_spec()
    columns = {**base["columns"], "income": {"type": "integer", "min": 0, "max": 10**5, "clamp": [0, 1000]}}
    queries = base["queries"] + [
        {"name": "total", "kind": "sum", "column": "income", "by": ["geo.county"]},
        {"name": "avg", "kind": "mean", "column": "income", "by": ["sex"]},
        {"name": "median", "kind": "quantile", "column": "income", "q": [0.5, 0.9], "candidates": [0, 100, 1000]},
        {"name": "people", "kind": "count_units", "by": ["sex"]},
    ]
    rows = {"pid": [1, 2, 3], "geo": [GEO_LEAVES[0], GEO_LEAVES[3], GEO_LEAVES[5]], "age": [10, 40, 70],
            "sex": ["F", "M", "F"], "income": [0, 500, 5000]}
    spec = write_case(directory / "case", small_spec(period="2026-11", invariants=["pop.state"], neighbouring="replace", columns=columns,
                                                     queries=queries), rows)
    book = directory / "ledger.sqlite"
    set_budget(open_ledger(book), "test-data", "epsilon", Fraction(5), Fraction(2))
    return run_release(spec, key_file=directory / "k.key", out_dir=directory / "out", ledger=book,
                       internal_dir=directory / "internal").release_dir


@pytest.fixture
def release(published, tmp_path):
    copy = tmp_path / "release"
    shutil.copytree(published, copy)
    return copy


def leaves(value, path=()):
    """(path, value) of every leaf; empty containers count as leaves."""
    if isinstance(value, dict) and value:
        for key, item in value.items():
            yield from leaves(item, (*path, key))
    elif isinstance(value, list) and value:
        for index, item in enumerate(value):
            yield from leaves(item, (*path, index))
    else:
        yield path, value


def edited(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 1.5 + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, list):
        return ["x"]
    if isinstance(value, dict):
        return {"x": 1}
    return "x"


def set_leaf(document, path, value):
    target = document
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value


def descriptive(path) -> bool:
    dotted = ".".join(str(p) for p in path)
    return any(dotted == f or dotted.startswith(f + ".") for f in DESCRIPTIVE_FIELDS)


def test_every_non_descriptive_leaf_edit_is_rejected(release):
    manifest_path = release / "manifest.json"
    original = manifest_path.read_text()
    manifest = json.loads(original)
    assert manifest["ledger"]["period_budget"]["budget"] == "2" and manifest["input_validation"] is not None
    assert verify_release(release).ok
    accepted, checked = [], 0
    for path, value in leaves(manifest):
        if descriptive(path):
            continue
        document = json.loads(original)
        set_leaf(document, path, edited(value))
        manifest_path.write_text(json.dumps(document, indent=2, sort_keys=True))
        checked += 1
        if verify_release(release).ok:
            accepted.append(".".join(map(str, path)))
    manifest_path.write_text(original)
    assert checked > 300
    assert accepted == []


def test_descriptive_edits_are_accepted(release):
    def edit(manifest):
        manifest["provenance"]["created_at"] = "2030-01-01T00:00:00+00:00"
        manifest["software"]["version"] = "9.9.9"
        manifest["engine"] = "spark"

    rewrite(release, edit)
    assert verify_release(release).ok


def rewrite(release, edit):
    path = release / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True))


def cli_verify(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", "verify", *map(str, args)],
                          capture_output=True, text=True)


@pytest.mark.parametrize("text", ["{}", "[]", "null", '{"files": 3, "spec": []}', '{"x": Infinity}'])
def test_malformed_manifests_are_mismatches_not_tracebacks(release, text):
    (release / "manifest.json").write_text(text)
    ran = cli_verify(release)
    assert ran.returncode == 1 and "MISMATCH" in ran.stderr and "Traceback" not in ran.stderr + ran.stdout


def test_a_corrupt_table_is_a_mismatch(release):
    table = release / "tables" / "pop.tract.parquet"
    table.write_bytes(b"PAR1 not really parquet PAR1")
    import hashlib

    def edit(manifest):
        for entry in manifest["files"]:
            if entry["path"] == "tables/pop.tract.parquet":
                entry["sha256"] = hashlib.sha256(table.read_bytes()).hexdigest()
                entry["bytes"] = table.stat().st_size

    rewrite(release, edit)
    ran = cli_verify(release)
    assert ran.returncode == 1 and "cannot be read as Parquet" in ran.stderr and "Traceback" not in ran.stderr


def test_extra_directories_and_unsafe_paths_are_mismatches(release, tmp_path):
    (release / "extra" / "nested").mkdir(parents=True)
    report = verify_release(release)
    assert any("directory extra" in p for p in report.problems)
    shutil.rmtree(release / "extra")
    outside = tmp_path / "outside.txt"
    outside.write_text("x")
    import hashlib

    rewrite(release, lambda m: m["files"].append(
        {"path": "../outside.txt", "sha256": hashlib.sha256(b"x").hexdigest(), "bytes": 1}))
    report = verify_release(release)
    assert any("not a plain relative path" in p for p in report.problems)


def test_a_signed_release_without_its_signature_file_fails(case, tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private = Ed25519PrivateKey.generate()
    key_file = tmp_path / "sign.pem"
    key_file.write_bytes(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    public_file = tmp_path / "sign.pub"
    public_file.write_bytes(private.public_key().public_bytes(serialization.Encoding.PEM,
                                                              serialization.PublicFormat.SubjectPublicKeyInfo))
    result = run_release(case(), key_file=tmp_path / "k.key", out_dir=tmp_path / "out", sign_key=key_file)
    assert verify_release(result.release_dir).problems == []
    (result.release_dir / "manifest.json.sig").unlink()
    ran = cli_verify(result.release_dir)
    assert ran.returncode == 1 and "says it is signed" in ran.stderr
    rewrite(result.release_dir, lambda m: m.pop("signature"))  # strip both: only the public key can tell
    assert verify_release(result.release_dir).ok
    assert cli_verify(result.release_dir, "--public-key", public_file).returncode == 1


def test_the_schema_marks_exactly_the_descriptive_fields():
    from dprelease.accounting.manifest_model import manifest_json_schema

    schema = manifest_json_schema()
    marked = {name for name, field in schema["properties"].items()
              if "Descriptive (not verified)" in field.get("description", "")}
    for name, definition in schema["$defs"].items():
        for field_name, field in definition.get("properties", {}).items():
            if "Descriptive (not verified)" in field.get("description", ""):
                marked.add(f"{name.lower()}.{field_name}")
    if "Descriptive (not verified)" in schema["$defs"]["Provenance"].get("description", ""):
        marked.add("provenance")
    assert marked == set(DESCRIPTIVE_FIELDS)
