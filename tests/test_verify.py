"""`dprelease verify` catches each kind of tampering and exits non-zero."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from dprelease.pipelines.run import run_release
from dprelease.pipelines.verify import verify_release


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    from .conftest import small_spec, write_case

    directory = tmp_path_factory.mktemp("published")
    spec_path = write_case(directory / "case", small_spec())
    return run_release(spec_path, key_file=directory / "k.key").release_dir


@pytest.fixture
def release(published, tmp_path):
    copy = tmp_path / "release"
    shutil.copytree(published, copy)
    return copy


def cli_verify(path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dprelease.pipelines.cli", "verify", str(path)],
                          capture_output=True, text=True)


def edit_manifest(release, edit):
    path = release / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True))


def test_untouched_release_verifies(release):
    assert verify_release(release).ok
    result = cli_verify(release)
    assert result.returncode == 0, result.stderr
    assert "OK" in result.stdout


def test_changed_byte_in_a_table(release):
    path = release / "tables" / "pop.state.csv"
    data = bytearray(path.read_bytes())
    data[-2] = ord("7") if data[-2] != ord("7") else ord("8")
    path.write_bytes(bytes(data))
    report = verify_release(release)
    assert any("tables/pop.state.csv: SHA-256" in p for p in report.problems)
    assert cli_verify(release).returncode == 1


def test_edited_epsilon_of_a_table(release):
    edit_manifest(release, lambda m: m["tables"][0]["allocated"].update(fraction="1/2"))
    report = verify_release(release)
    assert any(p.startswith("tables[0].allocated.fraction") for p in report.problems)
    assert cli_verify(release).returncode == 1


def test_edited_total(release):
    edit_manifest(release, lambda m: m["totals"]["epsilon"].update(decimal=0.5))
    assert any(p.startswith("totals.epsilon.decimal") for p in verify_release(release).problems)


def test_edited_noise_scale(release):
    edit_manifest(release, lambda m: m["tables"][1]["mechanism"]["value"].update(fraction="100"))
    assert any("mechanism.value.fraction" in p for p in verify_release(release).problems)


def test_edited_declared_budget_breaks_spec_hash(release):
    def edit(m):
        m["spec"]["budget"]["epsilon"] = "10"

    edit_manifest(release, edit)
    problems = verify_release(release).problems
    assert any(p.startswith("spec_sha256") for p in problems)


def test_missing_file(release):
    (release / "measurements" / "pop.tract.parquet").unlink()
    report = verify_release(release)
    assert "file measurements/pop.tract.parquet: missing (or not a regular file)" in report.problems
    assert cli_verify(release).returncode == 1


def test_extra_file(release):
    (release / "tables" / "extra.csv").write_text("x\n")
    assert "file tables/extra.csv: present but not listed in the manifest" in verify_release(release).problems


def test_missing_manifest(release):
    (release / "manifest.json").unlink()
    assert not verify_release(release).ok
    assert cli_verify(release).returncode == 1


def test_manifest_holds_no_key_and_no_counts(release, tmp_path):
    text = (release / "manifest.json").read_text()
    key = (release.parent.parent / "k.key") if (release.parent.parent / "k.key").exists() else None
    manifest = json.loads(text)
    assert "key" not in manifest and len(manifest["key_id"]) == 16
    if key is not None:
        assert key.read_text().strip() not in text
