"""Build the course site: execute every chapter into build/executed/, then ``mkdocs build --strict``.

The committed notebooks stay output-free; the site shows them executed. Each cell has a timeout because a
notebook run occasionally hangs on this stack; a run that times out is retried once, so one stuck kernel
does not fail the build, while a cell that raises fails it at once. Wrap the whole script in ``timeout``.

Kernels talk over IPC (Unix sockets at a fresh path each), not TCP: jupyter_client picks free TCP ports,
closes them and lets the kernel bind them a moment later, so two kernels starting at once (another build, an
nbval run) could race for a port ("ZMQError: Address already in use"). The repository's conftest.py does
the same for nbval.

A widget cannot move on a static page (that needs a Python kernel behind it), so each widget is drawn as it
was left when the chapter ran: its controls, disabled, at their values, and its readout and plots, from the
widget state the run saved (:func:`static_widget_html`), with a note to run the chapter in JupyterLab.

    python scripts/build_site.py                  # execute the chapters and build site/
    python scripts/build_site.py --execute-only   # only execute (what `make docs-serve` needs first)

MINSERVE_CHAPTERS_DIR=/elsewhere/chapters builds the site from other notebooks (for trying the site out).
"""

from __future__ import annotations

import argparse
import hashlib
import html
import os
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

ROOT = Path(__file__).resolve().parents[1]
EXECUTED_DIR = ROOT / "build" / "executed" / "chapters"  # where docs/hooks/minserve_site.py looks
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


def execute_notebook(source: Path, target: Path, cell_timeout_s: int) -> None:
    for attempt in (1, 2):
        nb = nbformat.read(source, as_version=4)
        client = NotebookClient(
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
    # Saved widget state makes nbconvert load the widget manager from a CDN, and the site is offline, so
    # drop it (nbclient's own store_widget_state=False crashes on interact's Output widget)...
    state = nb.metadata.pop("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    # ...and draw each widget from it, as it was left, instead of its repr ("VBox(children=(Dropdown…").
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            view = output.get("data", {}).get(WIDGET_VIEW)
            if view is not None:
                output["data"] = {"text/html": static_widget_html(view["model_id"], state) + WIDGET_NOTE}
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = tex_to_mathml(cell.source)
    # The hook renders this copy only while it matches the notebook as committed (same bytes).
    nb.metadata["minserve"] = {"source_sha256": hashlib.sha256(source.read_bytes()).hexdigest()}
    target.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, target)


# --- widgets, drawn as the run left them ----------------------------------------------------------------------

_BOXES = {"VBoxModel": "column", "BoxModel": "column", "GridBoxModel": "column", "HBoxModel": "row"}
_LABEL = '<span style="display:inline-block;min-width:8em">{}</span>'


def static_widget_html(model_id: str, state: dict[str, dict]) -> str:
    """The widget ``model_id`` as static HTML, from a notebook's saved widget state (``{id: {"model_name",
    "state"}}``): boxes lay out their children, controls are disabled inputs at their values, an HTML widget
    is its HTML, an Output widget its outputs (a plotly chart included). Empty when the model is missing."""
    body = _widget(model_id, state)
    return f'<div class="minserve-widget">{body}</div>' if body else ""


def _widget(model_id: str, state: dict[str, dict]) -> str:
    model = state.get(model_id.removeprefix("IPY_MODEL_"))
    if model is None:
        return ""
    name, fields = model.get("model_name", ""), model.get("state", {})
    if name in _BOXES:
        children = "".join(_widget(child, state) for child in fields.get("children", []))
        return f'<div style="display:flex;flex-direction:{_BOXES[name]};gap:6px;margin:4px 0">{children}</div>'
    if name in ("HTMLModel", "HTMLMathModel"):  # a readout: the callback's HTML at the controls' values
        return f'<div class="minserve-widget-readout">{fields.get("value", "")}</div>'
    if name == "OutputModel":
        outputs = "".join(_output_html(output) for output in fields.get("outputs", []))
        return f'<div class="minserve-widget-readout">{outputs}</div>'
    return _control_html(name, fields)


def _control_html(name: str, fields: dict) -> str:
    """A control as a disabled input showing its value, with its description as the label."""
    description = html.escape(str(fields.get("description") or ""))
    label, value = _LABEL.format(description), fields.get("value", "")
    if name == "LabelModel":
        return f"<div>{html.escape(str(value))}</div>"
    if "_options_labels" in fields:  # Dropdown, Select, ToggleButtons, RadioButtons
        options = "".join(
            f"<option{' selected' if i == fields.get('index') else ''}>{html.escape(str(o))}</option>"
            for i, o in enumerate(fields["_options_labels"])
        )
        return f"<label>{label}<select disabled>{options}</select></label>"
    if name == "CheckboxModel":
        return f'<label><input type="checkbox" disabled{" checked" if value else ""}> {description}</label>'
    if name.endswith("SliderModel") and not isinstance(value, list):
        bounds = " ".join(f'{k}="{fields[k]}"' for k in ("min", "max", "step") if k in fields)
        return f'<label>{label}<input type="range" disabled {bounds} value="{value}"> {value}</label>'
    if name == "TextareaModel":
        return f"<label>{label}<textarea disabled>{html.escape(str(value))}</textarea></label>"
    if name == "ButtonModel":
        return f"<button disabled>{description}</button>"
    if "value" in fields:  # IntText, FloatText, Text, range sliders, …
        return f'<label>{label}<input disabled value="{html.escape(str(value))}"></label>'
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
    args = parser.parse_args(argv)
    chapters_dir = Path(os.environ.get("MINSERVE_CHAPTERS_DIR", ROOT / "chapters"))
    execute_chapters(chapters_dir, args.cell_timeout)
    if args.execute_only:
        return 0
    return subprocess.call([sys.executable, "-m", "mkdocs", "build", "--strict"], cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
