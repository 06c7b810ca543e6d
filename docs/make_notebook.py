"""Build examples/quickstart.ipynb from docs/quickstart.md: its prose as markdown cells, its Python blocks as code
cells (the notebook is the quickstart, runnable in Jupyter; tests/test_docs.py checks the two agree).

    python docs/make_notebook.py
"""
from __future__ import annotations

import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent


def notebook(markdown: str) -> dict:
    cells = []
    for i, piece in enumerate(re.split(r"```python\n(.*?)```\n?", markdown, flags=re.S)):
        text = piece.strip("\n")
        if not text:
            continue
        kind = "code" if i % 2 else "markdown"
        cell = {"cell_type": kind, "id": f"cell-{len(cells)}", "metadata": {},
                "source": text.splitlines(keepends=True)}
        if kind == "code":
            cell.update(execution_count=None, outputs=[])
        cells.append(cell)
    return {"cells": cells, "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python",
                                                        "name": "python3"},
                                         "language_info": {"name": "python"}},
            "nbformat": 4, "nbformat_minor": 5}


def render(markdown: str) -> str:
    return json.dumps(notebook(markdown), indent=1, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    (HERE.parent / "examples" / "quickstart.ipynb").write_text(render((HERE / "quickstart.md").read_text(encoding="utf-8")),
                                           encoding="utf-8")
