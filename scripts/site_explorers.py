"""The chapters' explorers, live on the static site (no kernel): which they are, and the data each page needs.

A widget needs a Python kernel to answer; the site has none. Two ways round it, one per kind of explorer:

* ``model``: the answer is arithmetic (the speculation formula, the KV-cache calculator, the roofline). The
  page evaluates the same arithmetic in JavaScript (docs/javascripts/explorers.js), from the numbers exported
  out of :mod:`minserve.capacity` when the site is built (a widget with a ``page_data`` attribute exports its
  own, this machine's measured roofs among them), so any value of the controls works.
* ``grid``: the answer needs the engine or the chapter's own data (the scheduling playground's simulations,
  a trace's requests, a measured table). The build sets the live explorer's controls to each point of a
  small grid in the chapter's kernel (scripts/site_grid_kernel.py) and records its readouts; the page's
  controls pick among them and the page says these are built results.

An explorer is recognised by the descriptions of its controls (no chapter needs a tag), so a widget whose
controls change stops matching and the site test, which moves each explorer, says so.
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Explorer:
    """One chapter explorer: how the page answers (``model`` or ``grid``) and the controls that identify it.
    ``max_points`` bounds a grid's size: each point runs the explorer's callback once at build time."""

    mode: str
    controls: tuple[str, ...]
    max_points: int = 200


EXPLORERS: dict[str, Explorer] = {
    "slo-thresholds": Explorer("grid", ("TTFT ms", "TPOT ms"), max_points=400),
    "stage-timeline": Explorer("grid", ("request",), max_points=200),
    "roofline": Explorer("model", ("model", "hardware", "batch", "context")),
    "kv-calculator": Explorer("model", ("model", "context", "batch", "weights", "KV cache", "GPU")),
    "scheduling-playground": Explorer("grid", ("policy", "rate req/s", "chunked prefill", "KV blocks"), 48),
    "parallel-planner": Explorer("grid", ("model", "GPU", "GPUs", "link", "batch", "context"), max_points=60),
    "format-explorer": Explorer("grid", ("weights", "KV cache"), max_points=100),
    "speculation": Explorer("model", ("α", "draft cost c", "verify cost v")),
    # A point is a capacity plan (a few simulations, ~3 s): each slider at the chapter's value and one above it.
    "capacity-planner": Explorer(
        "grid", ("target req/s", "prompt tokens", "output tokens", "TTFT ms", "TPOT ms", "$ / hour"), max_points=4
    ),
    "bundle-explorer": Explorer("grid", ("run", "metric", "TTFT ms", "TPOT ms"), max_points=30),
}

GRID_NOTE = (
    '<p class="minserve-widget-note"><em>Built results: the controls pick among the {points} settings this'
    " explorer's own code answered when the site was built ({varied}). Run the chapter in JupyterLab"
    " (<code>make lab</code>) to try any other.</em></p>"
)
MODEL_NOTE = (
    '<p class="minserve-widget-note"><em>Live: this page evaluates the arithmetic of this explorer in your browser'
    " (the same formulas as <code>minserve.capacity</code>); the chapter in JupyterLab (<code>make lab</code>)"
    " runs the Python itself.</em></p>"
)


def grid_specs() -> dict[str, dict[str, Any]]:
    """What the kernel side needs, as plain JSON: every explorer, to find; a grid for the ``grid`` ones."""
    return {
        name: {"controls": list(e.controls), "max_points": e.max_points, "mode": e.mode}
        for name, e in EXPLORERS.items()
    }


def control_descriptions(model_id: str, state: dict[str, dict]) -> list[str]:
    """The descriptions of the controls under a saved widget (as the kernel side counts them)."""
    model = state.get(model_id.removeprefix("IPY_MODEL_"), {})
    fields, name = model.get("state", {}), model.get("model_name", "")
    found = [] if name in ("HTMLModel", "HTMLMathModel", "LabelModel") else [fields.get("description") or ""]
    for child in fields.get("children", []):
        found += control_descriptions(child, state)
    return [d for d in found if d]


def match(model_id: str, state: dict[str, dict]) -> str | None:
    """The explorer a saved widget is, by its controls' descriptions; None for any other widget."""
    found = sorted(set(control_descriptions(model_id, state)))
    return next((name for name, e in EXPLORERS.items() if sorted(e.controls) == found), None)


def explorer_data(name: str, model_id: str, state: dict[str, dict], grid: dict[str, Any] | None) -> dict | None:
    """The JSON a page's explorer reads: its built grid, or the numbers its model needs. None: not live."""
    if EXPLORERS[name].mode == "model":  # the numbers the live widget itself gave (its own models), else ours
        built = (grid or {}).get("page_data")
        return built if built is not None else MODEL_DATA.get(name, dict)()
    if not grid or "error" in grid:
        return None
    start, kinds = _start(model_id, state, grid), _models(model_id, state)
    for axis in reversed(range(len(grid["controls"]))):  # a text box is no axis (a build before this fix made one)
        if not _is_axis(kinds.get(grid["controls"][axis], "")):
            grid, start = _drop_axis(grid, axis, start[axis]), start[:axis] + start[axis + 1 :]
    if len(json.dumps(grid)) > MAX_GRID_BYTES:  # charts in every readout: keep one control moved at a time
        grid = _star(grid, start)
    return grid


_CHOICES = ("DropdownModel", "SelectModel", "ToggleButtonsModel", "RadioButtonsModel", "CheckboxModel")


def _is_axis(model_name: str) -> bool:
    """Whether a control can be a grid axis: a choice among options, or a slider (not a text box)."""
    return model_name in _CHOICES or (model_name.endswith("SliderModel") and "Range" not in model_name)


def _models(model_id: str, state: dict[str, dict]) -> dict[str, str]:
    """Each control's widget model name (``DropdownModel``…), by description."""
    entry = state.get(model_id.removeprefix("IPY_MODEL_"), {})
    found = {entry.get("state", {}).get("description") or "": entry.get("model_name", "")}
    for child in entry.get("state", {}).get("children", []):
        found = {**_models(child, state), **found}
    return found


def _drop_axis(grid: dict[str, Any], axis: int, at: int) -> dict[str, Any]:
    """The grid with one control held where the chapter left it (position ``at``) and no longer an axis."""
    index = {}
    for key, row in grid["index"].items():
        positions = key.split(",")
        if int(positions[axis]) == at:
            index[",".join(positions[:axis] + positions[axis + 1 :])] = row
    cut = {name: grid[name][:axis] + grid[name][axis + 1 :] for name in ("controls", "values", "by")}
    return {**grid, **cut, "index": index}


MAX_GRID_BYTES = 600_000  # a page stays well under the 2 MB tests/site/test_offline.py allows


def _start(model_id: str, state: dict[str, dict], grid: dict[str, Any]) -> list[int]:
    """Where the chapter left each of the grid's controls, as positions in the grid's values."""
    found: dict[str, dict] = {}

    def walk(widget_id: str) -> None:
        fields = state.get(widget_id.removeprefix("IPY_MODEL_"), {}).get("state", {})
        found.setdefault(fields.get("description") or "", fields)
        for child in fields.get("children", []):
            walk(child)

    walk(model_id)
    positions = []
    for name, values, by in zip(grid["controls"], grid["values"], grid["by"], strict=True):
        at = found.get(name, {}).get(by)
        positions.append(min(range(len(values)), key=lambda i: abs(values[i] - at)) if at is not None else 0)
    return positions


def _star(grid: dict[str, Any], start: list[int]) -> dict[str, Any]:
    """The grid's points that differ from ``start`` in one control at most, and only their readouts."""
    kept = {k: r for k, r in grid["index"].items() if sum(int(p) != s for p, s in zip(k.split(","), start)) <= 1}
    rows = sorted(set(kept.values()))
    renumber = {row: i for i, row in enumerate(rows)}
    index = {k: renumber[r] for k, r in kept.items()}
    return {**grid, "index": index, "readouts": [grid["readouts"][r] for r in rows]}


def kv_calculator_data() -> dict[str, Any]:
    """Per preset model and dtype, the weights' bytes and the KV bytes per token; each GPU's bytes."""
    from minserve import capacity
    from minserve.capacity.memory import DEFAULT_GPU_MEMORY_UTILIZATION, weights_bytes

    dtypes = ("bfloat16", "float16", "fp8", "float32")
    models = {}
    for name in capacity.MODEL_PRESETS:
        config = capacity.model_config(name)
        models[name] = {
            "weights": {d: weights_bytes(config, d) for d in dtypes},
            "kv_per_token": {d: capacity.kv_bytes_per_token(config, d) for d in dtypes},
        }
    return {
        "models": models,
        "gpus": dict(capacity.GPU_MEMORY_BYTES),
        "utilization": DEFAULT_GPU_MEMORY_UTILIZATION,
        "block_size": 16,
    }


def roofline_data() -> dict[str, Any]:
    """The roofline's terms for the preset models and accelerators (a chapter's own widget adds its own)."""
    from minserve.lab.roofline_widget import roofline_page_data

    return roofline_page_data()


MODEL_DATA = {"kv-calculator": kv_calculator_data, "roofline": roofline_data}


def wrap(name: str, body: str, data: dict[str, Any]) -> str:
    """The live explorer's HTML: its controls and readouts, its data as inline JSON, and the note."""
    mode = EXPLORERS[name].mode
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")  # never ends the script early
    if mode == "grid":
        varied = ", ".join(f"{c}: {len(v)}" for c, v in zip(data["controls"], data["values"], strict=True))
        if len(data["index"]) < math.prod(len(values) for values in data["values"]):
            varied += "; not every combination: one control at a time from the chapter's setting"
        note = GRID_NOTE.format(points=len(data["index"]), varied=html.escape(varied))
    else:
        note = MODEL_NOTE
    return (
        f'<div class="minserve-widget minserve-explorer" data-explorer="{name}" data-mode="{mode}">{body}'
        f'<p class="minserve-explorer-status"></p>'
        f'<script type="application/json" class="minserve-explorer-data">{payload}</script></div>{note}'
    )
