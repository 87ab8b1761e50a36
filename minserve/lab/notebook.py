"""One call at the top of every chapter: the course theme, and how figures are displayed."""

from __future__ import annotations

import pandas as pd

from minserve.lab import render
from minserve.lab.theme import use_course_theme


def setup_notebook() -> None:
    """Use the course plotly theme, the course's figure renderer and a readable pandas float format."""
    use_course_theme()
    render.configure_renderer()
    pd.set_option("display.precision", 3)
