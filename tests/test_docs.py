"""The documentation runs: every Python block of docs/quickstart.md, in order, in one namespace."""
from __future__ import annotations

import re

from .conftest import REPO


def python_blocks(path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


def test_quickstart_runs_as_written(tmp_path, monkeypatch, capsys):
    blocks = python_blocks(REPO / "docs" / "quickstart.md")
    assert len(blocks) == 5
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/quickstart.md", "exec"), namespace)  # noqa: S102 - our own documentation
    printed = capsys.readouterr().out
    assert "refused:" in printed and "no budget" in printed
    assert namespace["report"].ok
    assert (tmp_path / "releases" / "quickstart-2026" / "manifest.json").exists()


def test_api_reference_names_what_exists():
    """Every `release.x` / `result.x` member docs/api.md documents exists."""
    import dprelease

    text = (REPO / "docs" / "api.md").read_text(encoding="utf-8")
    for member in set(re.findall(r"`release\.([a-z_]+)", text)):
        assert hasattr(dprelease.Release, member) or member in ("spec",), member
    for member in set(re.findall(r"`(table_names|mean_names|table|tables|verify|directory|manifest)`", text)):
        assert hasattr(dprelease.ReleaseResult, member) or member in dprelease.ReleaseResult.__dataclass_fields__
