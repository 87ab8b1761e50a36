"""How the chapters' plotly figures are displayed: live in JupyterLab, and on the offline course site.

Every figure a notebook shows carries two representations in its output:

* ``application/vnd.plotly.v1+json`` (plotly's mimetype renderer), which JupyterLab's plotly extension
  draws live and prefers over HTML;
* ``text/html``: a ``<div>`` and a ``Plotly.newPlot`` call, *without* plotly.js. The site (mkdocs-jupyter)
  renders this one, and the site loads plotly.js once, from its own copy, so no page needs the internet
  and no page carries a 5 MB copy of the library.

The HTML is deterministic (no random div ids, no MathJax CDN tag), so re-executing an unchanged notebook
gives the same outputs, and nbval has nothing random to sanitize in a figure.
"""

from __future__ import annotations

import hashlib
import itertools
import json

import plotly.io as pio
from plotly.io.base_renderers import MimetypeRenderer

RENDERER_NAME = "minserve_site"
DEFAULT_RENDERERS = f"plotly_mimetype+{RENDERER_NAME}"
FIGURE_HEIGHT_PX = 480


class SiteHtmlRenderer(MimetypeRenderer):
    """``text/html`` for a page that already has ``window.Plotly`` (the course site loads it in <head>)."""

    def __init__(self, config: dict | None = None) -> None:
        # displaylogo off: the chart toolbar links to plotly's website, which the offline site cannot reach.
        self.config = {"displaylogo": False, "responsive": True, **(config or {})}
        self._counter = itertools.count(1)

    def to_mimebundle(self, fig_dict: dict) -> dict[str, str]:
        html = pio.to_html(
            fig_dict,
            config=self.config,
            include_plotlyjs=False,  # the site serves plotly.js itself
            include_mathjax=False,  # plotly's default would add a MathJax <script> from a CDN
            full_html=False,
            default_width="100%",
            default_height=FIGURE_HEIGHT_PX,
            validate=False,
            div_id=self._div_id(fig_dict),
        )
        return {"text/html": html}

    def _div_id(self, fig_dict: dict) -> str:
        # A counter keeps two identical figures in one notebook apart; the content hash keeps ids stable
        # between runs. plotly's own default is a fresh uuid4 every time.
        digest = hashlib.sha256(json.dumps(fig_dict, sort_keys=True, default=str).encode()).hexdigest()[:10]
        return f"plotly-{next(self._counter)}-{digest}"


def configure_renderer(config: dict | None = None) -> None:
    """Make every ``fig.show()`` (and a figure as a cell's last value) emit both representations.

    Call it once at the top of a notebook, before the first figure; it returns nothing, so the cell shows no
    output. ``config`` is plotly.js' figure config (``{"scrollZoom": True}``, …).
    """
    pio.renderers[RENDERER_NAME] = SiteHtmlRenderer(config)
    pio.renderers.default = DEFAULT_RENDERERS
