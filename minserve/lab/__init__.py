"""Notebook helpers: the course plotly theme, figures and tables from minserve results, widget builders.

plotly, pandas and ipywidgets (the ``lab`` extra) are imported here and nowhere below this layer: the
engine and the model never need them. Start a chapter with ``minserve.lab.setup_notebook()``.
"""

from minserve.lab.figures import latency_ecdf, latency_histogram
from minserve.lab.notebook import setup_notebook
from minserve.lab.tables import contract_table, percentile_table
from minserve.lab.theme import TEMPLATE_NAME, use_course_theme
from minserve.lab.widgets import attainment_for_thresholds, slo_explorer

__all__ = [
    "TEMPLATE_NAME",
    "attainment_for_thresholds",
    "contract_table",
    "latency_ecdf",
    "latency_histogram",
    "percentile_table",
    "setup_notebook",
    "slo_explorer",
    "use_course_theme",
]
