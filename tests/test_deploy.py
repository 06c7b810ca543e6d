"""The embedded deploy wrapper runs and verifies a release."""
from __future__ import annotations

import subprocess

from .conftest import REPO


def test_run_release_wrapper(case, tmp_path):
    spec_path = case()
    keys = tmp_path / "keys"
    budget = subprocess.run(["dprelease", "ledger", "set-budget", "test-data", "--epsilon", "5"], capture_output=True)
    assert budget.returncode == 0, budget.stderr  # in the default ledger, under the test's own XDG_DATA_HOME
    result = subprocess.run(["bash", str(REPO / "deploy" / "embedded" / "run-release.sh"), str(spec_path), str(keys)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "OK" in result.stdout
    assert len(list(keys.glob("*.key"))) == 1
    again = subprocess.run(["bash", str(REPO / "deploy" / "embedded" / "run-release.sh"), str(spec_path), str(keys)],
                           capture_output=True, text=True)
    assert again.returncode == 2
