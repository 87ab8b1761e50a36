"""Build the course site: execute every chapter into build/executed/, then ``mkdocs build --strict``.

The committed notebooks stay output-free; the site shows them executed. Each cell has a timeout because a
notebook run occasionally hangs on this stack; a run that times out is retried once, so one stuck kernel
does not fail the build, while a cell that raises fails it at once. Wrap the whole script in ``timeout``.

    python scripts/build_site.py                  # execute the chapters and build site/
    python scripts/build_site.py --execute-only   # only execute (what `make docs-serve` needs first)

MINSERVE_CHAPTERS_DIR=/elsewhere/chapters builds the site from other notebooks (for trying the site out).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
from latex2mathml.converter import convert as latex_to_mathml
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError

ROOT = Path(__file__).resolve().parents[1]
EXECUTED_DIR = ROOT / "build" / "executed" / "chapters"  # where docs/hooks/minserve_site.py looks
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
# In a markdown cell: code (fenced or inline) keeps its dollars; $…$ and $$…$$ elsewhere are TeX math.
_MARKDOWN_CODE = re.compile(r"(```.*?```|`[^`\n]*`)", re.S)
_TEX_MATH = re.compile(r"\$\$(.+?)\$\$|(?<![\\$])\$([^$\n]+?)\$", re.S)
WIDGET_NOTE = "<p><em>An interactive widget: run this chapter in JupyterLab (<code>make lab</code>) to use it.</em></p>"


def execute_notebook(source: Path, target: Path, cell_timeout_s: int) -> None:
    for attempt in (1, 2):
        nb = nbformat.read(source, as_version=4)
        client = NotebookClient(
            nb,
            timeout=cell_timeout_s,
            kernel_name="python3",
            # Run where the notebook lives, as JupyterLab and nbval do, so relative paths agree.
            resources={"metadata": {"path": str(source.parent)}},
        )
        try:
            client.execute()
            break
        except (CellTimeoutError, DeadKernelError) as error:
            if attempt == 2:
                raise
            print(f"  {source.name}: {type(error).__name__}, retrying once", file=sys.stderr)
    # Saved widget state makes nbconvert load the widget manager from a CDN, and the site is offline, so
    # drop it (nbclient's own store_widget_state=False crashes on interact's Output widget)...
    nb.metadata.pop("widgets", None)
    # ...and say where the widget lives instead of printing its repr ("interactive(children=(IntSlider…").
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if WIDGET_VIEW in output.get("data", {}):
                output["data"] = {"text/html": WIDGET_NOTE}
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = tex_to_mathml(cell.source)
    # The hook renders this copy only while it matches the notebook as committed (same bytes).
    nb.metadata["minserve"] = {"source_sha256": hashlib.sha256(source.read_bytes()).hexdigest()}
    target.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, target)


def tex_to_mathml(markdown: str) -> str:
    """Replace the TeX math of a markdown cell by MathML, which browsers draw with no script.

    JupyterLab renders ``$…$`` with MathJax; the site would need MathJax from a CDN to do the same.
    """
    parts = _MARKDOWN_CODE.split(markdown)  # odd indices are the code spans and fences
    return "".join(part if i % 2 else _TEX_MATH.sub(_mathml, part) for i, part in enumerate(parts))


def _mathml(match: re.Match) -> str:
    display, inline = match.groups()
    return latex_to_mathml(display.strip() if display is not None else inline, display="block" if display else "inline")


def execute_chapters(chapters_dir: Path, cell_timeout_s: int) -> None:
    for source in sorted(chapters_dir.glob("*.ipynb")):
        start_s = time.perf_counter()
        execute_notebook(source, EXECUTED_DIR / source.name, cell_timeout_s)
        print(f"executed {source.name} in {time.perf_counter() - start_s:.1f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cell-timeout", type=int, default=300, help="seconds per cell (default 300)")
    parser.add_argument("--execute-only", action="store_true", help="execute the chapters, skip mkdocs")
    args = parser.parse_args(argv)
    chapters_dir = Path(os.environ.get("MINSERVE_CHAPTERS_DIR", ROOT / "chapters"))
    execute_chapters(chapters_dir, args.cell_timeout)
    if args.execute_only:
        return 0
    return subprocess.call([sys.executable, "-m", "mkdocs", "build", "--strict"], cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
