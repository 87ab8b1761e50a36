"""scripts/build_site.py: what it changes in an executed chapter before the site renders it, and how its (and
nbval's) kernels start without racing for ports."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

import nbformat
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "build_site.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("build_site", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_site"] = module
    spec.loader.exec_module(module)
    return module


build_site = _load_script()


def test_inline_and_display_math_become_mathml() -> None:
    html = build_site.tex_to_mathml("TTFT is $t_1 - t_a$, and\n\n$$\\frac{a}{b}$$")
    assert "$" not in html
    assert html.count("<math ") == 2
    assert 'display="inline"' in html and 'display="block"' in html


def test_code_and_escaped_dollars_are_left_alone() -> None:
    markdown = "run `echo $HOME $PATH`, then\n\n```bash\nexport X=$Y; echo $Z\n```\n\nit costs \\$5 and \\$6"
    assert build_site.tex_to_mathml(markdown) == markdown


# --- kernels that cannot collide ------------------------------------------------------------------------------


def test_each_kernel_gets_ipc_sockets_of_its_own() -> None:
    first, second = build_site.kernel_config(), build_site.kernel_config()
    assert first.KernelManager.transport == second.KernelManager.transport == "ipc"
    assert first.KernelManager.ip != second.KernelManager.ip  # not jupyter_client's shared "kernel-ipc"
    assert Path(first.KernelManager.ip).parent == Path(tempfile.gettempdir())


def test_nbvals_kernels_use_ipc_too() -> None:
    """The repository's conftest.py swaps nbval's kernel manager for one on IPC (nbval passes no config)."""
    kernel = pytest.importorskip("nbval.kernel")
    km, kc = kernel.start_new_kernel(kernel_name=kernel.CURRENT_ENV_KERNEL_NAME)
    try:
        assert km.transport == "ipc" and km.ip.startswith(os.path.join(tempfile.gettempdir(), "minserve-kernel-"))
        sockets = [f"{km.ip}-{port}" for port in (km.shell_port, km.iopub_port, km.hb_port)]
        assert all(Path(s).is_socket() for s in sockets)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    assert not any(Path(s).exists() for s in sockets)  # removed with the kernel


# --- widgets, drawn as the chapter left them ----------------------------------------------------------------


def _model(name: str, **state) -> dict:
    return {"model_name": name, "state": state}


WIDGET_STATE = {
    "box": _model("VBoxModel", children=["IPY_MODEL_row", "IPY_MODEL_readout", "IPY_MODEL_plot", "IPY_MODEL_gone"]),
    "row": _model("HBoxModel", children=["IPY_MODEL_policy", "IPY_MODEL_rate", "IPY_MODEL_chunked"]),
    "policy": _model("DropdownModel", description="policy", _options_labels=["fcfs", "spf <aged>"], index=1),
    "rate": _model("FloatSliderModel", description="rate", min=0.5, max=8.0, step=0.5, value=2.5),
    "chunked": _model("CheckboxModel", description="chunked prefill", value=True),
    "readout": _model("HTMLModel", value="<p>goodput <b>1.9</b> req/s</p>"),
    "plot": _model(
        "OutputModel",
        outputs=[
            {"output_type": "display_data", "data": {"text/html": '<div class="plotly-graph-div"></div>'}},
            {"output_type": "stream", "name": "stdout", "text": "5 < 6"},
        ],
    ),
}


def test_a_widget_is_drawn_from_its_saved_state() -> None:
    html = build_site.static_widget_html("box", WIDGET_STATE)
    assert html.startswith('<div class="minserve-widget">')
    assert '<select disabled><option value="0">fcfs</option><option value="1" selected>spf &lt;aged&gt;<' in html
    assert 'type="range" disabled min="0.5" max="8.0" step="0.5" value="2.5"> <output>2.5</output>' in html
    assert '<input type="checkbox" disabled checked> chunked prefill' in html
    assert '<div class="minserve-widget-readout"><p>goodput <b>1.9</b> req/s</p></div>' in html  # its HTML
    assert '<div class="plotly-graph-div"></div>' in html and "<pre>5 &lt; 6</pre>" in html  # an Output's outputs
    assert html.index("policy") < html.index("goodput") < html.index("plotly-graph-div")  # in the box's order
    assert build_site.static_widget_html("missing", WIDGET_STATE) == ""


@pytest.mark.slow
def test_an_executed_chapter_shows_its_widget_not_its_repr(tmp_path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells.append(
        nbformat.v4.new_code_cell(
            "import ipywidgets as w\n"
            "w.VBox([w.IntSlider(value=3, min=0, max=9, description='seats'), w.HTML('<p>three seats</p>')])"
        )
    )
    source, target = tmp_path / "chapter.ipynb", tmp_path / "executed" / "chapter.ipynb"
    nbformat.write(nb, source)
    build_site.execute_notebook(source, target, cell_timeout_s=120)
    executed = nbformat.read(target, as_version=4)
    assert "widgets" not in executed.metadata  # its state would make nbconvert load a CDN
    (output,) = executed.cells[0].outputs
    assert set(output["data"]) == {"text/html"}
    html = output["data"]["text/html"]
    assert 'class="minserve-widget"' in html and 'value="3"> <output>3</output>' in html
    assert "<p>three seats</p>" in html
    assert build_site.WIDGET_NOTE in html and "VBox(children" not in html


@pytest.mark.slow
def test_an_explorer_is_live_on_the_page_from_its_built_grid(tmp_path: Path) -> None:
    """A widget whose controls match an explorer (scripts/site_explorers.py) gets its readouts computed at
    every point of a grid in the chapter's kernel; the page's controls are enabled and carry the grid."""
    nb = nbformat.v4.new_notebook()
    nb.cells.append(
        nbformat.v4.new_code_cell(
            "import ipywidgets as w\n"
            "a = w.Dropdown(options=['int8', 'int4'], description='weights')\n"
            "b = w.Dropdown(options=['bf16', 'fp8'], description='KV cache')\n"
            "out = w.HTML()\n"
            "def show(_=None): out.value = f'<p>{a.value} + {b.value}</p>'\n"
            "a.observe(show, 'value'); b.observe(show, 'value'); show()\n"
            "w.VBox([w.HBox([a, b]), out])"
        )
    )
    source, target = tmp_path / "chapter.ipynb", tmp_path / "executed" / "chapter.ipynb"
    nbformat.write(nb, source)
    build_site.execute_notebook(source, target, cell_timeout_s=120)
    executed = nbformat.read(target, as_version=4)
    assert len(executed.cells) == 1  # the grid cell is gone
    html = executed.cells[0].outputs[0]["data"]["text/html"]
    assert 'data-explorer="format-explorer" data-mode="grid"' in html and 'data-control="weights"' in html
    grid = json.loads(html.split('class="minserve-explorer-data">')[1].split("</script>")[0].replace("<\\/", "</"))
    shown = {key: grid["readouts"][row][0] for key, row in grid["index"].items()}
    assert shown["1,1"] == "<p>int4 + fp8</p>" and shown["0,1"] == "<p>int8 + fp8</p>" and len(shown) == 4
    assert "<p>int8 + bf16</p>" in html  # the page starts where the chapter left it
    assert (tmp_path / "raw" / "chapter.ipynb").is_file()  # kept raw, for --render-only
