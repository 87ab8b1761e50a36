"""Build the course site: execute every chapter into build/executed/, then ``mkdocs build --strict``.

The committed notebooks stay output-free; the site shows them executed. Each cell has a timeout because a
notebook run occasionally hangs on this stack; a run that times out is retried once, so one stuck kernel
does not fail the build, while a cell that raises fails it at once. Wrap the whole script in ``timeout``.

Kernels talk over IPC (Unix sockets at a fresh path each), not TCP: jupyter_client picks free TCP ports,
closes them and lets the kernel bind them a moment later, so two kernels starting at once (another build, an
nbval run) could race for a port ("ZMQError: Address already in use"). The repository's conftest.py does
the same for nbval.

A widget needs a Python kernel to answer, and a static page has none. A chapter's explorer (a widget that
scripts/site_explorers.py recognises) is made live on the page instead: its arithmetic evaluated in the
browser, or a grid of its answers computed in the chapter's kernel at build time (scripts/site_grid_kernel.py)
that its controls pick from (docs/javascripts/explorers.js). Any other widget is drawn as it was left when
the chapter ran, its controls disabled, from the widget state the run saved (:func:`static_widget_html`).

The executed notebook, widget state and grids included, is kept in build/executed/raw/, so the pages can be
drawn again from it without running the chapters (``--render-only``) while the site's look is worked on.

    python scripts/build_site.py                  # execute the chapters and build site/
    python scripts/build_site.py --execute-only   # only execute (what `make docs-serve` needs first)
    python scripts/build_site.py --render-only    # redraw build/executed/ from build/executed/raw/, then build

MINSERVE_CHAPTERS_DIR=/elsewhere/chapters builds the site from other notebooks (for trying the site out).
"""

from __future__ import annotations

import argparse
import hashlib
import html
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import nbformat
from latex2mathml.converter import convert as latex_to_mathml
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from traitlets.config import Config

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, however the script is run
import site_explorers

ROOT = Path(__file__).resolve().parents[1]
EXECUTED_DIR = ROOT / "build" / "executed" / "chapters"  # where docs/hooks/minserve_site.py looks
RAW_DIR = ROOT / "build" / "executed" / "raw"  # the same, before the widgets are drawn for the page
GRID_KERNEL = Path(__file__).resolve().parent / "site_grid_kernel.py"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
# In a markdown cell: code (fenced or inline) keeps its dollars; $…$ and $$…$$ elsewhere are TeX math.
_MARKDOWN_CODE = re.compile(r"(```.*?```|`[^`\n]*`)", re.S)
_TEX_MATH = re.compile(r"\$\$(.+?)\$\$|(?<![\\$])\$([^$\n]+?)\$", re.S)
WIDGET_NOTE = (
    '<p class="minserve-widget-note"><em>An interactive widget, shown as the chapter left it: run this chapter'
    " in JupyterLab (<code>make lab</code>) to move it.</em></p>"
)


def kernel_config() -> Config:
    """Kernel-manager settings for one kernel: IPC sockets under a path no other kernel uses.

    The sockets are ``<prefix>-1`` … ``<prefix>-5``; jupyter_client removes them when the kernel stops. Its
    own IPC default, ``kernel-ipc`` in the working directory, is shared by every kernel started there.
    """
    config = Config()
    if os.name != "nt":  # zmq has no IPC transport on Windows; there the TCP default stays
        config.KernelManager.transport = "ipc"
        config.KernelManager.ip = os.path.join(tempfile.gettempdir(), f"minserve-kernel-{uuid.uuid4().hex[:12]}")
    return config


class _SlicedReplyClient(NotebookClient):
    """nbclient that waits for the kernel's messages in one-second polls rather than one long poll.

    pyzmq's asyncio poll can miss the wake-up for a message that has already arrived; it then finds it only
    when the poll's own timeout fires, so a 0.1 s cell was seen to cost the whole 300 s cell timeout (and
    output, polled with no timeout at all, could wait for ever). Short polls bound that to a second; a cell's
    deadline is unchanged.
    """

    async def async_start_new_kernel_client(self):  # type: ignore[override]
        client = await super().async_start_new_kernel_client()
        for channel in (client.shell_channel, client.iopub_channel):
            channel.get_msg = _in_slices(channel.get_msg)
        return client


def _in_slices(get_msg, slice_s: float = 1.0):
    """Wrap an async ``get_msg(timeout=…)`` so it polls at most ``slice_s`` at a time until its deadline."""

    async def get_msg_in_slices(timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = slice_s if deadline is None else max(0.0, min(slice_s, deadline - time.monotonic()))
            try:
                return await get_msg(timeout=left)
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    return get_msg_in_slices


def execute_notebook(source: Path, target: Path, cell_timeout_s: int) -> None:
    """Run ``source`` in a fresh kernel, with the explorers' grid cell last; keep it raw, then draw the page."""
    for attempt in (1, 2):
        nb = nbformat.read(source, as_version=4)
        grids_path = Path(tempfile.mkstemp(prefix="minserve-grids-", suffix=".json")[1])
        nb.cells.append(nbformat.v4.new_code_cell(grid_cell_source(grids_path)))
        client = _SlicedReplyClient(
            nb,
            timeout=cell_timeout_s,
            kernel_name="python3",
            # Run where the notebook lives, as JupyterLab and nbval do, so relative paths agree.
            resources={"metadata": {"path": str(source.parent)}},
            config=kernel_config(),
        )
        try:
            client.execute()
            break
        except (CellTimeoutError, DeadKernelError) as error:
            if attempt == 2:
                raise
            print(f"  {source.name}: {type(error).__name__}, retrying once", file=sys.stderr)
        finally:
            grids = _read_grids(grids_path)
    nb.cells.pop()  # the grid cell: not the chapter's
    for grid in grids.values():
        if "error" in grid:
            print(f"  {source.name}: the {grid['explorer']} grid failed: {grid['error']}", file=sys.stderr)
    # The hook renders this copy only while it matches the notebook as committed (same bytes).
    nb.metadata["minserve"] = {"source_sha256": hashlib.sha256(source.read_bytes()).hexdigest(), "grids": grids}
    raw = target.parent.parent / RAW_DIR.name / target.name  # build/executed/raw/ beside …/chapters/
    raw.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, raw)
    render_notebook(nb, target)


def grid_cell_source(out_path: Path) -> str:
    """The cell that makes the explorers' grids in the chapter's kernel (scripts/site_grid_kernel.py)."""
    specs = json.dumps(site_explorers.grid_specs(), ensure_ascii=False)
    return f"{GRID_KERNEL.read_text(encoding='utf-8')}\nsite_grids({specs}, {str(out_path)!r})\n"


def _read_grids(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8") or "{}")
    finally:
        path.unlink(missing_ok=True)


def render_notebook(nb: nbformat.NotebookNode, target: Path) -> None:
    """The page's copy of an executed notebook: widgets drawn as HTML, TeX as MathML."""
    grids = nb.metadata.get("minserve", {}).pop("grids", {})
    # Saved widget state makes nbconvert load the widget manager from a CDN, and the site is offline, so
    # drop it (nbclient's own store_widget_state=False crashes on interact's Output widget)...
    state = nb.metadata.pop("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    # ...and draw each widget from it, live or as it was left, instead of its repr ("VBox(children=(Dropdown…").
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            view = output.get("data", {}).get(WIDGET_VIEW)
            if view is not None:
                output["data"] = {"text/html": widget_page_html(view["model_id"], state, grids)}
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = tex_to_mathml(cell.source)
    target.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, target)


def widget_page_html(model_id: str, state: dict[str, dict], grids: dict[str, dict]) -> str:
    """A live explorer where the widget is one and its data is there; else the widget as it was left."""
    name = site_explorers.match(model_id, state)
    grid = grids.get(model_id.removeprefix("IPY_MODEL_"))
    data = name and site_explorers.explorer_data(name, model_id, state, grid)
    if data is None:
        return static_widget_html(model_id, state) + WIDGET_NOTE
    live = {"grid": data} if site_explorers.EXPLORERS[name].mode == "grid" else {"model": True}
    return site_explorers.wrap(name, _widget(model_id, state, **live), data)


# --- widgets, drawn as the run left them ----------------------------------------------------------------------

_BOXES = {"VBoxModel": "column", "BoxModel": "column", "GridBoxModel": "column", "HBoxModel": "row"}
_LABEL = '<span style="display:inline-block;min-width:8em">{}</span>'


def static_widget_html(model_id: str, state: dict[str, dict]) -> str:
    """The widget ``model_id`` as static HTML, from a notebook's saved widget state (``{id: {"model_name",
    "state"}}``): boxes lay out their children, controls are disabled inputs at their values, an HTML widget
    is its HTML, an Output widget its outputs (a plotly chart included). Empty when the model is missing."""
    body = _widget(model_id, state)
    return f'<div class="minserve-widget">{body}</div>' if body else ""


def _widget(model_id: str, state: dict[str, dict], grid: dict | None = None, model: bool = False) -> str:
    """The widget as HTML. Live (a ``grid`` to pick from, or a ``model`` in the page), its controls are
    enabled and carry ``data-control`` (their description) for docs/javascripts/explorers.js."""
    entry = state.get(model_id.removeprefix("IPY_MODEL_"))
    if entry is None:
        return ""
    name, fields = entry.get("model_name", ""), entry.get("state", {})
    if name in _BOXES:
        children = "".join(_widget(child, state, grid, model) for child in fields.get("children", []))
        return f'<div style="display:flex;flex-direction:{_BOXES[name]};gap:6px;margin:4px 0">{children}</div>'
    if name in ("HTMLModel", "HTMLMathModel"):  # a readout: the callback's HTML at the controls' values
        return f'<div class="minserve-widget-readout">{fields.get("value", "")}</div>'
    if name == "OutputModel":
        outputs = "".join(_output_html(output) for output in fields.get("outputs", []))
        return f'<div class="minserve-widget-readout">{outputs}</div>'
    description = str(fields.get("description") or "")
    if grid is not None and description in grid["controls"]:
        values = grid["values"][grid["controls"].index(description)]
        return _control_html(name, fields, live=description, grid_values=values)
    return _control_html(name, fields, live=description if model else None)


def _control_html(name: str, fields: dict, live: str | None = None, grid_values: list | None = None) -> str:
    """A control showing its value, with its description as the label: disabled, or (``live``) enabled and
    named by ``data-control``. A grid slider moves in the grid's steps, between its first and last value."""
    description = html.escape(str(fields.get("description") or ""))
    label, value = _LABEL.format(description), fields.get("value", "")
    state = f'data-control="{html.escape(live)}"' if live else "disabled"
    if name == "LabelModel":
        return f"<div>{html.escape(str(value))}</div>"
    if "_options_labels" in fields:  # Dropdown, Select, ToggleButtons, RadioButtons
        options = "".join(
            f'<option value="{i}"{" selected" if i == fields.get("index") else ""}>{html.escape(str(o))}</option>'
            for i, o in enumerate(fields["_options_labels"])
        )
        return f"<label>{label}<select {state}>{options}</select></label>"
    if name == "CheckboxModel":
        return f'<label><input type="checkbox" {state}{" checked" if value else ""}> {description}</label>'
    if name.endswith("SliderModel") and not isinstance(value, list):
        bounds = {k: fields[k] for k in ("min", "max", "step") if k in fields}
        if grid_values:
            step = grid_values[1] - grid_values[0] if len(grid_values) > 1 else bounds.get("step", 1)
            bounds = {"min": grid_values[0], "max": grid_values[-1], "step": step}
        attrs = " ".join(f'{k}="{v}"' for k, v in bounds.items())
        return f'<label>{label}<input type="range" {state} {attrs} value="{value}"> <output>{value}</output></label>'
    if name == "TextareaModel":  # free text needs the kernel: disabled even in a live explorer
        hint = html.escape(f"{fields.get('placeholder') or ''} (in JupyterLab)".strip())
        return f'<label>{label}<textarea disabled placeholder="{hint}">{html.escape(str(value))}</textarea></label>'

    if name == "ButtonModel":
        return f"<button disabled>{description}</button>"
    if "value" in fields:  # IntText, FloatText, Text, range sliders (a grid holds these where they were left)
        return f'<label>{label}<input {state} value="{html.escape(str(value))}"></label>'
    return ""


def _output_html(output: dict) -> str:
    """One saved output (an Output widget's) as HTML: its HTML, a PNG, or its text."""
    if output.get("output_type") == "stream":
        return f"<pre>{html.escape(output.get('text', ''))}</pre>"
    data = output.get("data", {})
    if "text/html" in data:
        return "".join(data["text/html"]) if isinstance(data["text/html"], list) else data["text/html"]
    if "image/png" in data:
        return f'<img src="data:image/png;base64,{data["image/png"]}">'
    return f"<pre>{html.escape(str(data.get('text/plain', '')))}</pre>" if "text/plain" in data else ""


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
    parser.add_argument("--render-only", action="store_true", help="redraw the pages from build/executed/raw/")
    args = parser.parse_args(argv)
    chapters_dir = Path(os.environ.get("MINSERVE_CHAPTERS_DIR", ROOT / "chapters"))
    if args.render_only:
        for raw in sorted(RAW_DIR.glob("*.ipynb")):
            render_notebook(nbformat.read(raw, as_version=4), EXECUTED_DIR / raw.name)
    else:
        execute_chapters(chapters_dir, args.cell_timeout)
    if args.execute_only:
        return 0
    return subprocess.call([sys.executable, "-m", "mkdocs", "build", "--strict"], cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
