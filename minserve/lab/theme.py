"""The course's one plotly look: a ``pio.templates`` entry named ``"minserve"``.

Every figure helper in :mod:`minserve.lab` names the template itself, so its figures look the same whether
or not the notebook called :func:`use_course_theme`; calling it makes the learner's own figures match.
"""

from __future__ import annotations

import plotly.graph_objects as go
import plotly.io as pio

TEMPLATE_NAME = "minserve"
# Colour-blind-safe (Okabe–Ito), in the order traces take them: measured data first, then comparisons.
COLORWAY = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000"]
SLO_COLOR = "#D55E00"  # threshold lines: one colour that always means "the contract"
FONT_FAMILY = "Inter, Helvetica Neue, Arial, sans-serif"  # system fonts only: the site loads no web fonts


def course_template() -> go.layout.Template:
    """The template: plotly_white's grid, the course colours, a legend that does not cover the data."""
    template = go.layout.Template(pio.templates["plotly_white"])
    template.layout.update(
        colorway=COLORWAY,
        font={"family": FONT_FAMILY, "size": 14},
        title={"x": 0.02, "xanchor": "left", "font": {"size": 18}},
        margin={"l": 64, "r": 24, "t": 64, "b": 56},
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "xanchor": "right", "x": 1},
        hovermode="closest",
    )
    return template


def register_course_theme() -> str:
    """Add the template to ``plotly.io.templates`` (idempotent); returns its name."""
    pio.templates[TEMPLATE_NAME] = course_template()
    return TEMPLATE_NAME


def use_course_theme() -> str:
    """Register the template and make it every new figure's default; returns its name."""
    pio.templates.default = register_course_theme()
    return TEMPLATE_NAME
