"""Optional Ed25519 manifest signatures: written by run --sign-key, checked by verify --public-key."""
from __future__ import annotations

import subprocess
import sys

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dprelease.pipelines.run import run_release
from dprelease.pipelines.verify import verify_release


def _keypair(directory, name):
    key = Ed25519PrivateKey.generate()
    private = directory / f"{name}.pem"
    public = directory / f"{name}.pub.pem"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


@pytest.fixture
def signed(case, tmp_path):
    private, public = _keypair(tmp_path, "agency")
    result = run_release(case(), key_file=tmp_path / "k.key", sign_key=private)
    return result.release_dir, public


def test_signed_release_verifies_with_the_public_key(signed):
    release, public = signed
    report = verify_release(release, public)
    assert report.ok, report.problems
    assert report.signature.startswith("valid Ed25519 signature")
    assert verify_release(release).signature == "signed (not checked: pass --public-key)"
    result = subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", "verify", str(release),
                             "--public-key", str(public)], capture_output=True, text=True)
    assert result.returncode == 0 and "valid Ed25519" in result.stdout


def test_edited_manifest_breaks_the_signature(signed):
    release, public = signed
    path = release / "manifest.json"
    path.write_text(path.read_text().replace('"dataset_id": "test-data"', '"dataset_id": "other-data"'))
    assert any(p.startswith("signature: manifest.json.sig") for p in verify_release(release, public).problems)


def test_another_key_is_rejected(signed, tmp_path):
    release, _ = signed
    _, other = _keypair(tmp_path, "impostor")
    problems = verify_release(release, other).problems
    assert "signature: the manifest names a different signing key" in problems


def test_unsigned_release_fails_a_signature_check(case, tmp_path):
    _, public = _keypair(tmp_path, "agency")
    release = run_release(case(), key_file=tmp_path / "k.key").release_dir
    assert "signature: the release is not signed, but --public-key was given" in verify_release(release, public).problems
