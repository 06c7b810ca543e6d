"""The manifest's JSON Schema: published with the package, in sync with the model, and every
manifest the pipeline writes (plain, with invariants, ledger and signature) validates against it."""
from __future__ import annotations

import json
import subprocess
import sys
from fractions import Fraction

import jsonschema
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dprelease.accounting.ledger import open_ledger, set_budget
from dprelease.accounting.manifest_model import SCHEMA_FILE, manifest_json_schema
from dprelease.pipelines.run import run_release
from dprelease.pipelines.verify import verify_release


def test_published_schema_file_matches_the_model():
    assert json.loads(SCHEMA_FILE.read_text()) == json.loads(json.dumps(manifest_json_schema()))
    printed = subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", "schema", "--manifest"],
                             capture_output=True, text=True)
    assert json.loads(printed.stdout) == json.loads(SCHEMA_FILE.read_text())


def test_every_kind_of_manifest_validates(case, tmp_path):
    schema = json.loads(SCHEMA_FILE.read_text())
    signer = tmp_path / "agency.pem"
    signer.write_bytes(Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    book = tmp_path / "ledger.sqlite"
    set_budget(open_ledger(book), "test-data", "rho", Fraction(10))
    plain = run_release(case(), key_file=tmp_path / "a.key", out_dir=tmp_path / "a")
    full = run_release(case(budget={"definition": "zcdp", "rho": 1}, invariants=["pop.state"], neighbouring="replace"),
                       key_file=tmp_path / "b.key", out_dir=tmp_path / "b", ledger=book, sign_key=signer)
    for result in (plain, full):
        jsonschema.validate(json.loads((result.release_dir / "manifest.json").read_text()), schema)
        assert verify_release(result.release_dir).ok


def test_verify_reports_schema_violations(case, tmp_path):
    result = run_release(case(), key_file=tmp_path / "k.key")
    path = result.release_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["true_counts"] = [1, 2, 3]
    path.write_text(json.dumps(manifest))
    assert any(p.startswith("manifest schema: true_counts") for p in verify_release(result.release_dir).problems)
