"""The documentation runs: every Python block of docs/quickstart.md, in order, in one namespace."""
from __future__ import annotations

import json
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


def test_the_notebook_is_the_quickstart():
    """docs/quickstart.ipynb holds exactly the quickstart's prose and code (rebuild: python docs/make_notebook.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_notebook", REPO / "docs" / "make_notebook.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    built = module.render((REPO / "docs" / "quickstart.md").read_text(encoding="utf-8"))
    assert (REPO / "docs" / "quickstart.ipynb").read_text(encoding="utf-8") == built
    code = ["".join(c["source"]) for c in json.loads(built)["cells"] if c["cell_type"] == "code"]
    assert [c.strip() for c in code] == [b.strip() for b in python_blocks(REPO / "docs" / "quickstart.md")]
