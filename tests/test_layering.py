"""kernels/ sits at the bottom of the layers: it may import torch and triton, never the rest of minserve.

import-linter cannot see it (it is mapped to ``minserve.kernels`` at install time), so this test reads the
imports of every file there.
"""

from __future__ import annotations

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "kernels"


def _imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
    return modules


def test_kernels_import_only_kernels_from_minserve():
    files = sorted(KERNELS.rglob("*.py"))
    assert files, "kernels/ should hold at least its package file"
    for path in files:
        for module in _imported_modules(path):
            if module == "minserve" or module.startswith("minserve."):
                assert module.startswith("minserve.kernels"), f"{path.name} imports {module}"


def test_kernels_import_under_the_minserve_namespace():
    import minserve.kernels

    assert Path(minserve.kernels.__file__).resolve().parent == KERNELS


def test_every_subpackage_ships_in_the_wheel():
    """An editable install imports any folder with an ``__init__.py``; a wheel carries only the listed ones
    (and ``minserve.assets``, the embedded models' data)."""
    import tomllib

    root = KERNELS.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(root).parts) for p in (root / "minserve").rglob("__init__.py")}
    assert on_disk | {"minserve.kernels", "minserve.assets"} == listed
