"""The chapter notebooks are committed clean: no outputs, no execution counts.

Outputs belong to the executed copies the site build makes (build/executed/), not to the repository: they
bloat diffs, go stale as the engine changes, and carry timings from whoever ran them last.
To clean a notebook: `jupyter nbconvert --clear-output --inplace chapters/NAME.ipynb`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

CHAPTERS_DIR = Path(__file__).resolve().parents[1] / "chapters"
NOTEBOOKS = sorted(CHAPTERS_DIR.glob("*.ipynb"))


def dirty_cells(notebook: dict) -> list[str]:
    """One line per code cell that still carries outputs or an execution count."""
    problems = []
    for index, cell in enumerate(notebook.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        if cell.get("outputs"):
            problems.append(f"cell {index}: {len(cell['outputs'])} output(s)")
        if cell.get("execution_count") is not None:
            problems.append(f"cell {index}: execution_count {cell['execution_count']}")
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_chapter_notebook_is_clean(path: Path) -> None:
    problems = dirty_cells(json.loads(path.read_text(encoding="utf-8")))
    assert not problems, f"{path.name} was committed with outputs; clear them:\n  " + "\n  ".join(problems)


def test_dirty_cells_finds_outputs_and_counts() -> None:
    notebook = {
        "cells": [
            {"cell_type": "markdown", "source": "# title"},
            {"cell_type": "code", "outputs": [], "execution_count": None},
            {"cell_type": "code", "outputs": [{"output_type": "stream"}], "execution_count": 3},
        ]
    }
    assert dirty_cells(notebook) == ["cell 2: 1 output(s)", "cell 2: execution_count 3"]
