"""Run inside a chapter's kernel, after the chapter, by scripts/build_site.py: the built grid of each explorer.

A static page has no kernel, so an explorer that needs the engine (or the chapter's own data) to answer gets
its answers computed here, once, at build time: for each live explorer matching a spec, its controls are set
to every point of a small grid and its readouts (HTML widgets, and what its Output widgets displayed) are
recorded. The page then lets its controls pick among those points (docs/javascripts/explorers.js). The
explorer's own callbacks do the work, so the site shows exactly what JupyterLab would.

This file is sent as a cell's source, then ``site_grids(specs, out_path)`` is called; it prints nothing and
never raises (an error is written into the result), so the cell can be dropped from the notebook afterwards.
"""

import itertools
import json
import math
import time


def site_grids(specs, out_path, budget_s=90.0):
    """``specs``: ``{name: {"controls": [description…], "max_points": n, "mode": "grid" or "model"}}``. Writes
    ``{model_id: grid}``, or ``{model_id: {"page_data": …}}`` for a ``model`` explorer that exports its numbers.

    Past ``budget_s`` seconds in all, no more points are visited (a grid cut short says so), so the cell
    stays well inside the build's cell timeout whatever the machine's load.
    """
    from ipywidgets.widgets.widget import _instances

    deadline = time.monotonic() + budget_s

    boxes = [w for w in list(_instances.values()) if hasattr(w, "children")]
    found = {}
    for name, spec in specs.items():
        matches = [b for b in boxes if sorted({c.description for c in _controls(b)}) == sorted(spec["controls"])]
        inner = {id(d) for b in matches for d in _descendants(b)}
        for box in (b for b in matches if id(b) not in inner):  # the outermost box of each explorer
            if spec["mode"] == "model":  # the page does the arithmetic: it needs only the widget's own numbers
                if hasattr(box, "page_data"):
                    found[box.model_id] = {"explorer": name, "page_data": box.page_data}
                continue
            try:
                found[box.model_id] = {"explorer": name, **_grid(box, spec["max_points"], deadline)}
            except Exception as error:  # reported by the build; it never fails the chapter
                found[box.model_id] = {"explorer": name, "error": f"{type(error).__name__}: {error}"}
    with open(out_path, "w", encoding="utf-8") as out:
        json.dump(found, out)


def _descendants(widget):
    for child in getattr(widget, "children", ()):
        yield child
        yield from _descendants(child)


def _controls(box):
    """The widgets a reader moves: they have a description and a value (readouts and labels do not count)."""
    from ipywidgets import HTML, HTMLMath, Label

    return [
        w
        for w in _descendants(box)
        if getattr(w, "description", "") and hasattr(w, "value") and not isinstance(w, (HTML, HTMLMath, Label))
    ]


def _readouts(box):
    from ipywidgets import HTML, HTMLMath, Output

    return [w for w in _descendants(box) if isinstance(w, (HTML, HTMLMath, Output))]


def _axes(controls, max_points):
    """The values each control takes on the grid: every option, both checkbox states, slider samples at a
    multiple of the slider's step through its current value; text inputs stay as they are."""
    axes = {}
    for control in controls:
        if hasattr(control, "options") and hasattr(control, "index"):
            axes[control] = ("index", list(range(len(control.options))))
        elif isinstance(control.value, bool):
            axes[control] = ("value", [False, True])
    sliders = [c for c in controls if type(c).__name__.endswith("Slider")]  # not a range slider, not a text box
    fixed = math.prod(len(values) for _, values in axes.values())
    per_slider = max(2, int((max_points / fixed) ** (1 / len(sliders)))) if sliders else 0
    for slider in sliders:
        lo, hi, step = slider.min, slider.max, slider.step or 1
        # The same stride both ways from the chapter's value, so each side of it is seen where there is room.
        span = min(slider.value - lo, hi - slider.value) or max(slider.value - lo, hi - slider.value)
        stride = step * max(1, math.floor(span / step / max(1, (per_slider - 1) // 2)))
        below = math.floor((slider.value - lo) / stride + 1e-9)
        above = math.floor((hi - slider.value) / stride + 1e-9)
        values = [slider.value + j * stride for j in range(-below, above + 1)]
        axes[slider] = ("value", [round(v, 10) if isinstance(v, float) else v for v in values])
    while math.prod(len(v) for _, v in axes.values()) > max_points:  # trim the longest slider at its far end
        longest = max(sliders, key=lambda s: len(axes[s][1]), default=None)
        values = axes[longest][1] if longest is not None else []
        if len(values) <= 2:
            break
        far = max((0, -1), key=lambda i: abs(values[i] - longest.value))
        values.pop(far)
    return axes


def _grid(box, max_points, deadline):
    controls = _controls(box)
    axes = _axes(controls, max_points)
    start = {c: getattr(c, attr) for c, (attr, _) in axes.items()}
    names = [c.description for c in axes]
    points = list(itertools.product(*(values for _, values in axes.values())))
    if len(points) > max_points:  # too many: vary one control at a time from where the chapter left them
        points = sorted({tuple(v if c is moved else start[c] for c in axes) for moved in axes for v in axes[moved][1]})
    readouts, table, index = _readouts(box), {}, {}
    for point in points:
        if time.monotonic() > deadline:
            break
        shown = _visit(dict(zip(axes, point)), axes, readouts)
        key = ",".join(str(_position(values, v)) for (_, values), v in zip(axes.values(), point))
        index[key] = table.setdefault(json.dumps(shown), len(table))
    for control, value in start.items():  # back where the chapter left it, drawn for the saved state
        setattr(control, axes[control][0], value)
    return {
        "controls": names,
        "values": [values for _, values in axes.values()],
        "by": [attr for attr, _ in axes.values()],
        "readouts": [json.loads(shown) for shown in table],
        "index": index,
    }


def _position(values, value):
    """Where ``value`` sits among an axis' values: the nearest one, since a slider left at 36.300000000000004
    by the chapter is the grid's 36.3 (the grid's values are rounded to 10 places)."""
    return min(range(len(values)), key=lambda i: abs(values[i] - value))


def _visit(settings, axes, readouts):
    """Set the controls (each observer runs on its change) and return what every readout shows: an HTML
    widget's value; for an Output widget what the last update that drew anything displayed or printed
    (None: nothing redrew it, so the page keeps what it shows)."""
    drawn = None
    for control, value in settings.items():
        with _Capture() as captured:
            setattr(control, axes[control][0], value)
        if captured.displays or captured.stdout.getvalue():
            drawn = captured
    return [_display_html(drawn) if hasattr(r, "outputs") else r.value for r in readouts]


class _Capture:
    """What the code in the block displays (kept from the front end) and prints. IPython's capture_output
    cannot stand in for the display publisher under an Output widget's context, so publish is wrapped."""

    def __enter__(self):
        import contextlib
        import io

        from IPython import get_ipython

        self.displays, self.stdout = [], io.StringIO()
        self._publisher = get_ipython().display_pub
        self._publish = self._publisher.publish
        self._publisher.publish = lambda data, *args, **kwargs: self.displays.append(data)
        self._redirect = contextlib.redirect_stdout(self.stdout)
        self._redirect.__enter__()
        return self

    def __exit__(self, *exc):
        self._redirect.__exit__(*exc)
        self._publisher.publish = self._publish
        return False


def _display_html(captured):
    """A capture as HTML: its last display's HTML (a plotly chart's div and script) or text, else its
    printed text. None when nothing was drawn."""
    import html

    if captured is None:
        return None
    if captured.displays:
        data = captured.displays[-1]
        if "text/html" in data:
            return data["text/html"]
        return "<pre>" + html.escape(str(data.get("text/plain", ""))) + "</pre>"
    return "<pre>" + html.escape(captured.stdout.getvalue()) + "</pre>"
