"""Notebook helpers: the course plotly theme, figures and tables from minserve results, widget builders.

plotly, pandas and ipywidgets (the ``lab`` extra) are imported here and nowhere below this layer: the
engine and the model never need them. Start a chapter with ``minserve.lab.setup_notebook()``.
"""

import importlib

from minserve.lab.anatomy import detokenizer_steps, request_timeline, stage_explorer, stage_table, token_pieces
from minserve.lab.engine_runs import run_engine
from minserve.lab.figures import latency_ecdf, latency_histogram
from minserve.lab.kv import kv_calculator, kv_calculator_result, kv_memory_figure
from minserve.lab.notebook import setup_notebook
from minserve.lab.playground import playground_result, scheduling_playground
from minserve.lab.roofline_widget import roofline_explorer, roofline_explorer_result
from minserve.lab.tables import contract_table, percentile_table
from minserve.lab.theme import TEMPLATE_NAME, use_course_theme
from minserve.lab.widgets import attainment_for_thresholds, slo_explorer

__all__ = [
    "TEMPLATE_NAME",
    "attainment_for_thresholds",
    "bundle_explorer",
    "contract_table",
    "detokenizer_steps",
    "explore_run",
    "kv_calculator",
    "kv_calculator_result",
    "kv_memory_figure",
    "latency_ecdf",
    "latency_histogram",
    "load_bundle",
    "percentile_table",
    "playground_result",
    "request_timeline",
    "roofline_explorer",
    "roofline_explorer_result",
    "run_engine",
    "scheduling_playground",
    "setup_notebook",
    "slo_explorer",
    "stage_explorer",
    "stage_table",
    "token_pieces",
    "use_course_theme",
]

# Chapter 10's helpers drive the load tester, which needs the ``server`` extra (httpx, prometheus-client):
# imported on first use, so that ``import minserve.lab`` works with the ``lab`` extra alone.
_LAZY = {name: "minserve.lab.bundle_view" for name in ("bundle_explorer", "explore_run", "load_bundle")}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
